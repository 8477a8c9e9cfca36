//! The machine's floors, the limits the poll modes are compared to:
//!
//! - **eventfd wake-up**: a thread blocked in `poll(2)` on an eventfd (CPU 1)
//!   is woken by a write from another thread (CPU 0); the time from just
//!   before the write to the woken thread's first clock read. The writes
//!   come 1 ms apart (after a random 0–100 µs), so the sleeper is asleep
//!   each time, as an Event poller at 1k/s is.
//! - **busy-poll detection**: a thread (CPU 1) spins on an atomic that
//!   another (CPU 0) stores to; the time from just before the store to the
//!   spinner's clock read after it sees the new value (one cache-line
//!   transfer plus two clock reads).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hdrhistogram::Histogram;
use rustix::event::{eventfd, poll, EventfdFlags, PollFd, PollFlags};

use crate::clock::{now_ns, pin, spread, wait_until, Spread};
use crate::curves::{ARRIVAL_CPU, POLLER_CPU};

/// One floor over repeated runs: p50 and p99 in µs.
#[derive(Debug, Clone)]
pub struct Floor {
    pub name: &'static str,
    pub p50: Spread,
    pub p99: Spread,
}

fn percentiles(lat: &[u64]) -> Result<(f64, f64), String> {
    let mut h =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())?;
    for &l in lat {
        h.saturating_record(l.max(1));
    }
    Ok((
        h.value_at_quantile(0.5) as f64 / 1e3,
        h.value_at_quantile(0.99) as f64 / 1e3,
    ))
}

/// A small deterministic generator for the jitter between samples.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// One run of the eventfd floor: `n` wake-ups. A wake-up that found two
/// writes (the sleeper was descheduled past the next one) counts the
/// latest; the run ends when the sleeper has seen all `n`.
fn eventfd_once(n: usize) -> Result<Vec<u64>, String> {
    let fd = Arc::new(eventfd(0, EventfdFlags::CLOEXEC).map_err(|e| e.to_string())?);
    let stamps: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let (fd2, stamps2) = (Arc::clone(&fd), Arc::clone(&stamps));
    let sleeper = std::thread::spawn(move || -> Result<Vec<u64>, String> {
        if !pin(POLLER_CPU) {
            return Err(format!("cannot pin to CPU {POLLER_CPU}"));
        }
        let mut lat = Vec::with_capacity(n);
        let mut buf = [0u8; 8];
        let mut seen = 0u64;
        let timeout = rustix::time::Timespec {
            tv_sec: 5,
            tv_nsec: 0,
        };
        while (seen as usize) < n {
            let mut fds = [PollFd::new(&*fd2, PollFlags::IN)];
            if poll(&mut fds, Some(&timeout)).map_err(|e| e.to_string())? == 0 {
                return Err(format!(
                    "eventfd floor: no write for 5 s after {seen} of {n}"
                ));
            }
            let woke = now_ns();
            rustix::io::read(&*fd2, &mut buf).map_err(|e| e.to_string())?;
            seen += u64::from_ne_bytes(buf);
            let at = stamps2[(seen as usize).min(n) - 1].load(Ordering::Acquire);
            lat.push(woke.saturating_sub(at));
        }
        Ok(lat)
    });
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let start = now_ns() + 2_000_000;
    for i in 0..n {
        wait_until(start + i as u64 * 1_000_000 + rng.next() % 100_000);
        stamps[i].store(now_ns(), Ordering::Release);
        rustix::io::write(&*fd, &1u64.to_ne_bytes()).map_err(|e| e.to_string())?;
    }
    sleeper.join().map_err(|_| "sleeper panicked".to_string())?
}

/// One run of the busy-poll floor: `n` stores, 20 µs apart; a store the
/// spinner missed (it was descheduled) is skipped, the next one counts.
fn busy_once(n: usize) -> Result<Vec<u64>, String> {
    let seq = Arc::new(AtomicU64::new(0));
    let stamps: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
    let (seq2, stamps2) = (Arc::clone(&seq), Arc::clone(&stamps));
    let spinner = std::thread::spawn(move || -> Result<Vec<u64>, String> {
        if !pin(POLLER_CPU) {
            return Err(format!("cannot pin to CPU {POLLER_CPU}"));
        }
        let mut lat = Vec::with_capacity(n);
        let mut seen = 0;
        while seen < n as u64 {
            let s = seq2.load(Ordering::Acquire);
            if s == seen {
                std::hint::spin_loop();
                continue;
            }
            let now = now_ns();
            seen = s;
            let at = stamps2[s as usize - 1].load(Ordering::Relaxed);
            lat.push(now.saturating_sub(at));
        }
        Ok(lat)
    });
    let start = now_ns() + 2_000_000;
    for i in 0..n {
        wait_until(start + i as u64 * 20_000);
        stamps[i].store(now_ns(), Ordering::Relaxed);
        seq.store(i as u64 + 1, Ordering::Release);
    }
    spinner.join().map_err(|_| "spinner panicked".to_string())?
}

/// Both floors, `reps` runs each, alternating.
pub fn floors(quick: bool, reps: usize) -> Result<Vec<Floor>, String> {
    if !pin(ARRIVAL_CPU) {
        return Err(format!("cannot pin to CPU {ARRIVAL_CPU}"));
    }
    let (n_event, n_busy) = if quick { (200, 2000) } else { (1000, 20_000) };
    let (mut e50, mut e99, mut b50, mut b99) = (vec![], vec![], vec![], vec![]);
    for _ in 0..reps {
        let (p50, p99) = percentiles(&eventfd_once(n_event)?)?;
        e50.push(p50);
        e99.push(p99);
        let (p50, p99) = percentiles(&busy_once(n_busy)?)?;
        b50.push(p50);
        b99.push(p99);
    }
    Ok(vec![
        Floor {
            name: "eventfd wake-up (poll(2))",
            p50: spread(&mut e50),
            p99: spread(&mut e99),
        },
        Floor {
            name: "busy-poll detection",
            p50: spread(&mut b50),
            p99: spread(&mut b99),
        },
    ])
}

/// Adaptive's estimate of the wake-up latency, as it measured it in this
/// process (waits up to 5 s for the probe).
pub fn adaptive_estimate() -> String {
    let started = std::time::Instant::now();
    loop {
        if let Some(w) = cqd::core::mode::measured_wake_latency() {
            return format!("{:.2} µs", w.as_secs_f64() * 1e6);
        }
        if started.elapsed() > std::time::Duration::from_secs(5) {
            return "not measured within 5 s".into();
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
