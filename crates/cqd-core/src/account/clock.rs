//! Post times: the clock the posting call stamps each request with, and how
//! a stamp turns back into an instant when an age is read.
//!
//! Every post is stamped; ages (the watchdog, `oldest`, the stop's report)
//! are read rarely. So where the kernel itself keeps time with the CPU's
//! time-stamp counter (x86-64 with the `tsc` clocksource: the kernel has
//! found the counter invariant and synchronised across CPUs), a stamp is a
//! bare read of the counter — SPDK's tick counter reads the same — and not
//! `clock_gettime`, which adds the vDSO's sequence lock, an ordering fence
//! and the scaling to nanoseconds: 13 against 31 ns a read on the machine
//! of docs/benchmarks.md §8b (2026-12-02). Ticks become time only when an
//! age is read, with the counter's rate measured then against `Instant`
//! over everything since the first stamp, counted back from a fresh
//! reading of both clocks, so an age is right to within the two clocks'
//! read skew (under a microsecond) and the kernel's frequency correction of
//! its clock (at most 0.05% of the age).
//!
//! Elsewhere (another architecture or clocksource, Miri, loom) a stamp is
//! `Instant::now()` in nanoseconds.
//!
//! A reading holds its unit in its low bit: counter ticks (the posting
//! call's stamps) or nanoseconds (an instant a caller passes, from an
//! expert `posted` call or a test, which reads back exactly). Both count
//! from an origin set well before the first stamp, so that an instant from
//! before it still has a reading; readings fit in [`BITS`] bits.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Bits a reading has (the rest of an entry's word holds its flags).
pub(crate) const BITS: u32 = 59;
/// The unit bit: set for counter ticks.
const TICKS: u64 = 1;
/// The largest count a reading holds, above its unit bit.
const MAX: u64 = (1 << (BITS - 1)) - 1;

/// How far before the first stamp the origin lies, in counter ticks: 2^52
/// ticks is 17 days at 3 GHz, and leaves 2^58 - 2^52 (over 2 years at
/// 3 GHz) after it.
const BACK_TICKS: u64 = 1 << 52;

/// The same for nanoseconds, tried in order (a monotonic clock may be too
/// young to go back so far): 13 days, an hour, a second.
const BACK_NS: [u64; 3] = [1 << 50, 3_600_000_000_000, 1_000_000_000];

struct Clock {
    /// Readings in nanoseconds count from here.
    origin: Instant,
    /// An instant, and the counter read right after it, if the counter is
    /// the posting call's clock.
    tsc: Option<(Instant, u64)>,
}

/// The counter's nanoseconds per tick, as an `f64`'s bits, once measured
/// over at least [`SETTLED`] (0: not yet).
static RATE: AtomicU64 = AtomicU64::new(0);
const SETTLED: Duration = Duration::from_secs(1);

fn clock() -> &'static Clock {
    static CLOCK: OnceLock<Clock> = OnceLock::new();
    CLOCK.get_or_init(|| {
        let tsc = counter_is_the_clock().then(pair);
        let base = tsc.map_or_else(Instant::now, |(i, _)| i);
        let origin = BACK_NS
            .iter()
            .find_map(|&ns| base.checked_sub(Duration::from_nanos(ns)))
            .unwrap_or(base);
        Clock { origin, tsc }
    })
}

/// Whether the kernel keeps time with the time-stamp counter, which it
/// does only once it has found the counter invariant and synchronised.
#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri), not(loom)))]
fn counter_is_the_clock() -> bool {
    use std::io::Read;
    let mut buf = [0u8; 16];
    let Ok(mut f) =
        std::fs::File::open("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    else {
        return false;
    };
    let n = f.read(&mut buf).unwrap_or(0);
    buf[..n].trim_ascii() == b"tsc"
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri), not(loom))))]
fn counter_is_the_clock() -> bool {
    false
}

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri), not(loom)))]
#[inline]
fn ticks() -> u64 {
    // SAFETY: `rdtsc` has no preconditions: it reads the time-stamp
    // counter, which every x86-64 CPU has (and `counter_is_the_clock`
    // chose it only where the kernel keeps time with it).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri), not(loom))))]
#[inline]
fn ticks() -> u64 {
    0
}

/// Now, as the posting call stamps its requests.
#[inline]
pub(crate) fn now() -> u64 {
    let c = clock();
    match c.tsc {
        Some((_, at_base)) => {
            let n = ticks().wrapping_sub(at_base).wrapping_add(BACK_TICKS);
            (n.min(MAX) << 1) | TICKS
        }
        None => of(Instant::now()),
    }
}

/// The reading of instant `at` (in nanoseconds: it reads back exactly).
pub(crate) fn of(at: Instant) -> u64 {
    let ns = at.saturating_duration_since(clock().origin).as_nanos();
    u64::try_from(ns).unwrap_or(u64::MAX).min(MAX) << 1
}

/// The instant of reading `r`: exact for nanoseconds; for ticks, counted
/// back from both clocks read now at the counter's measured rate.
pub(crate) fn instant(r: u64) -> Instant {
    let c = clock();
    let count = r >> 1;
    let (Some((base, at_base)), true) = (c.tsc, r & TICKS != 0) else {
        return c.origin + Duration::from_nanos(count);
    };
    let (i, t, rate) = now_and_rate(base, at_base);
    let now = t.wrapping_sub(at_base).wrapping_add(BACK_TICKS);
    if count <= now {
        let back = Duration::from_nanos(((now - count) as f64 * rate) as u64);
        i.checked_sub(back).unwrap_or(c.origin)
    } else {
        i + Duration::from_nanos(((count - now) as f64 * rate) as u64)
    }
}

/// Both clocks now: the counter read between two instants at most
/// [`SKEW`] apart (the best of a few tries: a preemption between the reads
/// would skew the pair), and their midpoint.
fn pair() -> (Instant, u64) {
    let mut best = None;
    for _ in 0..64 {
        let a = Instant::now();
        let t = ticks();
        let b = Instant::now();
        let gap = b - a;
        let mid = (a + gap / 2, t);
        if gap <= SKEW {
            return mid;
        }
        if best.is_none_or(|(g, _)| gap < g) {
            best = Some((gap, mid));
        }
    }
    best.map_or_else(|| (Instant::now(), ticks()), |(_, p)| p)
}

/// How far apart the instants around a counter read may be.
const SKEW: Duration = Duration::from_nanos(500);

/// Both clocks now ([`pair`]), and the counter's nanoseconds per tick over
/// everything since `base`. A stamp is never older than `base`, so the
/// rate's error (the two pairs' skew over the span) moves an age by at
/// most about the two skews.
fn now_and_rate(base: Instant, at_base: u64) -> (Instant, u64, f64) {
    let cached = f64::from_bits(RATE.load(Ordering::Relaxed));
    loop {
        let (i, t) = pair();
        if cached > 0.0 {
            return (i, t, cached);
        }
        let span = i.saturating_duration_since(base);
        let n = t.wrapping_sub(at_base);
        // Not within microseconds of the first stamp.
        if n < 1 << 14 || span < Duration::from_micros(10) {
            std::hint::spin_loop();
            continue;
        }
        let rate = span.as_nanos() as f64 / n as f64;
        if span >= SETTLED {
            RATE.store(rate.to_bits(), Ordering::Relaxed);
        }
        return (i, t, rate);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A stamp reads back between the instants read just before and just
    /// after it, within the two clocks' read skew.
    #[test]
    fn a_stamp_reads_back_as_the_instant_it_was_taken() {
        let slack = Duration::from_micros(20);
        for _ in 0..1000 {
            let before = Instant::now();
            let r = now();
            let after = Instant::now();
            let at = instant(r);
            assert!(at + slack >= before, "{at:?} before {before:?}");
            assert!(at <= after + slack, "{at:?} after {after:?}");
        }
        // And still a millisecond later.
        let before = Instant::now();
        let r = now();
        let after = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        let at = instant(r);
        assert!(at + slack >= before && at <= after + slack, "{at:?}");
    }

    /// An instant's reading reads back as exactly that instant, before the
    /// first stamp and after now alike.
    #[test]
    fn an_instant_reads_back_exactly() {
        let now = Instant::now();
        for at in [
            now,
            now - Duration::from_millis(1),
            now.checked_sub(Duration::from_secs(5)).unwrap_or(now),
            now + Duration::from_secs(2),
        ] {
            assert_eq!(instant(of(at)), at);
        }
    }

    /// Stamps never go backwards on one thread.
    #[test]
    fn stamps_are_monotonic() {
        let mut last = now();
        for _ in 0..if cfg!(miri) { 1_000 } else { 100_000 } {
            let r = now();
            assert!(r >> 1 >= last >> 1);
            last = r;
        }
    }
}
