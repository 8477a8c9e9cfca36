//! Poll modes and the arm / re-poll / sleep protocol they share.
//!
//! # The sleep protocol
//!
//! An arm is one-shot: it stays in force until it fires. So the group keeps
//! each CQ in one of two states: **active** (polled every round: it fired,
//! found work, or is not armed) or **quiet** (armed, and polled empty after
//! its arm took effect: any new completion notifies). Only active CQs are
//! polled, armed and re-polled; a sleep and a wake-up cost what is ready,
//! not the size of the group. A poller goes to sleep only after a round in
//! which every active CQ polled empty. Then, in this order:
//!
//! 1. **Arm** every active CQ that is not armed (its arm fired, or it never
//!    had one); a CQ in error is never armed. An active CQ still armed from
//!    an earlier cycle, which the last round polled empty, becomes quiet at
//!    once: its arm has either not fired (and will, for the next
//!    completion) or has, and its descriptor is ready.
//! 2. **Re-poll** the CQs armed in step 1 — the lost-wake-up rule concerns
//!    only them. A completion that landed after their last empty poll but
//!    before the arm took effect is not notified (IB semantics); without
//!    this step it would sit in the CQ until the next one. One found empty
//!    becomes quiet. If the re-poll finds anything, do not sleep: return to
//!    polling.
//! 3. **Block** on the group's epoll set — each distinct notification
//!    descriptor (a CQ's own, or a channel shared by many), the poller's
//!    one doorbell, asynchronous events — with a timeout.
//! 4. **Collect** the notifications of the ready descriptors only,
//!    acknowledging in batches. A CQ that fired is no longer armed and
//!    becomes active.
//! 5. **Poll** the active CQs. The caller keeps polling until every active
//!    CQ is empty again before it may sleep (drain to empty, never one
//!    entry per event). A wake-up whose notification found nothing is
//!    spurious.
//!
//! **The safety net.** Once per wake timeout (whether or not the block
//! timed out) a round also polls the next slice of the quiet CQs, rotating:
//! `max(64, ⌈N / 8⌉)` of the `N` CQs, so every CQ is polled within 8 wake
//! timeouts (within one for groups of up to 64 CQs), at a cost bounded by
//! the slice, not the group. The round first takes what is already
//! notified (without blocking), so a notification on its way is not taken
//! for a missed one. A quiet CQ then found holding completions had a
//! missed notification: it is counted as recovered, and becomes active and
//! unarmed (its arm is suspect) so that it is armed afresh. CQs in error
//! are polled by every safety round.
//!
//! [`sleep_once`] is that sequence, written once against [`SleepGroup`] so
//! that the real poller and the loom model (`tests/loom_arm.rs`) run the same
//! code.
//!
//! # Modes
//!
//! | mode | when the group is idle |
//! |------|------------------------|
//! | `Busy` | spin, never arm or block on a notification; the longer nothing comes, the more of the CPU it gives away (below) |
//! | `Event` | sleep at once |
//! | `Hybrid` | spin for a fixed window after the last completion, then sleep |
//! | `Adaptive` | Hybrid whose window follows the measured gap between completions against the measured cost of a sleep/wake cycle, within a CPU budget (below) |
//!
//! Hybrid and Adaptive spin with pause hints, then `yield_now` after 64
//! empty rounds, until their window ends.
//!
//! # Adaptive: when spinning pays
//!
//! Sleeping through a gap costs a sleep/wake cycle: the CPU time of
//! arming, blocking and collecting the notification (measured on every
//! sleep), plus the scheduler's wake-up latency — the time from the
//! notification to the poller running again, which is latency added to the
//! completion that woke it. Spinning through a gap costs the gap in CPU
//! time and adds no latency. So Adaptive learns two things:
//!
//! - **the gap**: after every round that found work following a round that
//!   found none, the time since the last work divided by the completions
//!   found (a poller that slept and found four completions waiting learns a
//!   quarter of the time asleep, not the whole of it), capped at twice the
//!   cost of a sleep (beyond it the poller sleeps anyway; so one long pause
//!   is forgotten within a few gaps), averaged (EWMA 0.2);
//! - **the cost of a sleep**: the measured CPU overhead of its sleeps
//!   (EWMA, in thread CPU time) plus the wake-up latency: the larger of
//!   [`Adaptive::wake_cost`] and [`measured_wake_latency`] — this machine's,
//!   measured once per process in the background when the first Adaptive
//!   poller starts (9 hand-offs to a thread blocked on an idle CPU, the
//!   median; about 10 ms); a poller takes it up at the start of its next
//!   100 ms period, and counts the floor alone until then.
//!
//! While the gap is shorter than the cost of a sleep, the window is twice
//! the gap (within `min_spin..=max_spin`): the next completion almost always
//! comes inside it, and each one caught saves a sleep/wake cycle that would
//! have cost more than the spinning did, counting its latency at one µs of
//! CPU per µs. Otherwise the window is `min_spin`: the poller sleeps almost
//! at once, and CPU follows the arrival rate (at 1k/s, a few % of a
//! CPU).
//!
//! **The budget** bounds what spinning wastes: windows that ended without a
//! completion, which then slept anyway. Over each 100 ms, if that time
//! exceeds [`Adaptive::cpu_budget`] of the wall time, the window is
//! `min_spin` for the next 100 ms. Spinning that caught its completion is
//! not charged: it replaced a sleep that would have cost more. Under a
//! steady stream a few µs apart, Adaptive therefore polls like Busy (and
//! uses a CPU, as Busy does); under bursts far apart, it sleeps like Event.
//!
//! # Busy mode when nothing comes
//!
//! A Busy poller is latency-first while completions flow: every round that
//! finds work starts the idle stretch over, so under traffic it only ever
//! spins. When a stretch goes on, it escalates by the time since the last
//! completion, so that a Busy poller with idle CQs leaves its CPU to the
//! other threads there (a yield alone does not: the scheduler still counts
//! a yielding thread as load, and it still takes a whole CPU that nobody
//! else wants):
//!
//! | idle for | each empty round ends with | constant |
//! |----------|----------------------------|----------|
//! | under 50 µs | pause hints, 1 to 64 of them, more as the stretch goes on | [`BUSY_PAUSE_FOR`] |
//! | 50–100 µs | `yield_now` | [`BUSY_YIELD_UNTIL`] |
//! | from 100 µs | a timed sleep (a *nap*): 10 µs, doubling at each nap up to 1 ms | [`BUSY_NAP_MIN`], [`BUSY_NAP_MAX`] |
//!
//! The price is the latency of the first completion after a quiet spell: it
//! waits for the end of the current nap, which is never longer than the
//! spell so far and at most [`BUSY_NAP_MAX`] (plus the timer slack the
//! kernel adds to a sleep, 50 µs by default). Naps are counted in
//! `PollerSnapshot::naps`. A poller pinned alone on its core can turn naps
//! off (`PollerBuilder::busy_naps(false)`): it then pauses and yields, never
//! sleeps. To spin without ever sleeping for a while after
//! each completion, use `Hybrid` with that window: it spins (pause, then
//! yield) for the whole window before it sleeps on a notification.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// The shortest safety-net timeout (step 3 of the sleep protocol) a poller
/// honours: anything shorter would turn the safety net into a stream of
/// timer wake-ups. Shorter values are refused (by the poller builder and by
/// topology validation), never silently raised.
pub const MIN_WAKE_TIMEOUT: Duration = Duration::from_micros(100);

/// Busy mode: an idle stretch shorter than this is spun with pause hints
/// alone (the module documentation, "Busy mode when nothing comes").
pub const BUSY_PAUSE_FOR: Duration = Duration::from_micros(50);

/// Busy mode: from [`BUSY_PAUSE_FOR`] to this much idle time each empty
/// round yields; from here on it naps.
pub const BUSY_YIELD_UNTIL: Duration = Duration::from_micros(100);

/// Busy mode: the first nap of an idle stretch; each nap doubles the last.
pub const BUSY_NAP_MIN: Duration = Duration::from_micros(10);

/// Busy mode: the longest nap, so the first completion after a quiet spell
/// waits at most this long (plus the kernel's timer slack).
pub const BUSY_NAP_MAX: Duration = Duration::from_millis(1);

/// How a poller waits when its CQs are empty.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PollMode {
    /// Never sleep on a notification: latency first while completions flow;
    /// with nothing to poll for a while, pause, yield, then nap (up to
    /// [`BUSY_NAP_MAX`]) so that other threads on its CPU run.
    Busy,
    /// Sleep as soon as the CQs are empty: CPU first.
    Event,
    /// Spin for `spin` after the last completion, then sleep.
    Hybrid {
        /// The spin window.
        #[serde(with = "duration_us")]
        spin: Duration,
    },
    /// Hybrid with a learned window.
    Adaptive(Adaptive),
}

impl Default for PollMode {
    fn default() -> Self {
        PollMode::Adaptive(Adaptive::default())
    }
}

impl PollMode {
    /// A short name for reports.
    pub fn name(&self) -> &'static str {
        match self {
            PollMode::Busy => "busy",
            PollMode::Event => "event",
            PollMode::Hybrid { .. } => "hybrid",
            PollMode::Adaptive(_) => "adaptive",
        }
    }

    /// One of each mode with its defaults (tests run in all of them).
    pub fn all() -> [PollMode; 4] {
        [
            PollMode::Busy,
            PollMode::Event,
            PollMode::Hybrid {
                spin: Duration::from_micros(50),
            },
            PollMode::Adaptive(Adaptive::default()),
        ]
    }
}

/// Parameters of [`PollMode::Adaptive`] (the rule: the module
/// documentation, "Adaptive: when spinning pays").
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Adaptive {
    /// The shortest spin window (also used when over the CPU budget).
    #[serde(with = "duration_us")]
    pub min_spin: Duration,
    /// The longest spin window.
    #[serde(with = "duration_us")]
    pub max_spin: Duration,
    /// The largest fraction of wall time (0..=1) wasted spinning: in
    /// windows that ended without a completion.
    pub cpu_budget: f64,
    /// A floor for the wake-up latency a sleep adds; the poller uses the
    /// larger of this and [`measured_wake_latency`]. The default, 20 µs, is
    /// about the least that waking a thread on an idle CPU costs on common
    /// servers and virtual machines (leaving a C-state, then the
    /// scheduler); the probe can measure less when its CPU happens to be
    /// busy, as on a loaded machine, and more where idle states are deep.
    #[serde(with = "duration_us")]
    pub wake_cost: Duration,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            min_spin: Duration::from_micros(2),
            max_spin: Duration::from_micros(200),
            cpu_budget: 0.5,
            wake_cost: Duration::from_micros(20),
        }
    }
}

/// Hand-offs timed by [`measured_wake_latency`].
const WAKE_SAMPLES: usize = 9;

/// How long the probe's waiter sleeps before each hand-off: long enough
/// for its CPU to go properly idle (virtual machines poll for a while
/// before they halt, and a wake-up within that while costs far less than
/// one after it).
const WAKE_PROBE_IDLE: Duration = Duration::from_millis(1);

/// `WAKE_NS` before the probe has a result.
const WAKE_PENDING: u64 = u64::MAX;

static WAKE_NS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(WAKE_PENDING);

/// This machine's wake-up latency: from one thread handing a value to a
/// thread blocked waiting for it on a CPU idle for a millisecond (a futex
/// wake-up, the path a poller's notification takes through the scheduler)
/// to that thread running. The median of 9 hand-offs, measured once per
/// process by two short-lived threads that the first call starts (about
/// 10 ms): the waiter on the CPU the caller runs on, the waker on another
/// CPU the process may use (if there is one); `None` until they are done.
/// An Adaptive poller asks as it starts and uses the floor
/// [`Adaptive::wake_cost`] until the answer comes.
///
/// ```
/// use std::time::{Duration, Instant};
/// let _ = cqd_core::mode::measured_wake_latency(); // starts the probe
/// let started = Instant::now();
/// let wake = loop {
///     if let Some(w) = cqd_core::mode::measured_wake_latency() {
///         break w;
///     }
///     assert!(started.elapsed() < Duration::from_secs(10));
///     std::thread::sleep(Duration::from_millis(5));
/// };
/// assert!(wake > Duration::ZERO && wake < Duration::from_secs(1));
/// ```
pub fn measured_wake_latency() -> Option<Duration> {
    static PROBE: OnceLock<()> = OnceLock::new();
    PROBE.get_or_init(|| {
        let here = rustix::thread::sched_getcpu();
        let started = std::thread::Builder::new()
            .name("cqd-wake-probe".into())
            .spawn(move || {
                let wake = probe_wake_latency(here);
                tracing::debug!(?wake, "measured the wake-up latency");
                WAKE_NS.store(
                    (wake.as_nanos() as u64).min(WAKE_PENDING - 1),
                    std::sync::atomic::Ordering::Relaxed,
                );
            });
        if let Err(e) = started {
            tracing::warn!(error = %e, "cannot measure the wake-up latency: Adaptive uses its wake_cost");
        }
    });
    match WAKE_NS.load(std::sync::atomic::Ordering::Relaxed) {
        WAKE_PENDING => None,
        ns => Some(Duration::from_nanos(ns)),
    }
}

/// Pins the calling thread to the first CPU it may run on that `accept`s
/// (the probe measures where it is otherwise). Tried one by one, since the
/// caller's own mask may be a single CPU (a pinned poller) while the
/// process may use others.
fn pin_probe(accept: impl Fn(usize) -> bool) {
    for cpu in (0..rustix::thread::CpuSet::MAX_CPU).filter(|&c| accept(c)) {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        if rustix::thread::sched_setaffinity(None, &set).is_ok() {
            return;
        }
    }
}

/// The probe: this thread waits on `waiter_cpu`, a second one, on another
/// CPU if there is one, hands it the time it sent.
fn probe_wake_latency(waiter_cpu: usize) -> Duration {
    pin_probe(|c| c == waiter_cpu);
    let (tx, rx) = std::sync::mpsc::channel::<Instant>();
    let waker = std::thread::Builder::new()
        .name("cqd-wake-probe".into())
        .spawn(move || {
            pin_probe(|c| c != waiter_cpu);
            for _ in 0..WAKE_SAMPLES {
                std::thread::sleep(WAKE_PROBE_IDLE);
                if tx.send(Instant::now()).is_err() {
                    return;
                }
            }
        });
    let Ok(waker) = waker else {
        return Duration::ZERO;
    };
    let mut samples: Vec<Duration> = rx.iter().map(|sent| sent.elapsed()).collect();
    let _ = waker.join();
    samples.sort_unstable();
    samples.get(samples.len() / 2).copied().unwrap_or_default()
}

mod duration_us {
    use serde::{Deserialize, Deserializer, Serializer};
    use std::time::Duration;

    pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(d.as_micros() as u64)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        Ok(Duration::from_micros(u64::deserialize(d)?))
    }
}

/// What a group must offer the sleep protocol (steps as in the module
/// documentation).
pub trait SleepGroup {
    /// The group's error.
    type Error;
    /// Step 1: arms every active CQ that is not armed; an active CQ that is
    /// still armed (and polled empty in the last round) becomes quiet.
    /// Returns how many CQs were armed now.
    fn arm_unarmed(&mut self) -> Result<usize, Self::Error>;
    /// Step 2: re-polls the CQs armed in step 1; each found empty becomes
    /// quiet. Returns the completions found.
    fn repoll_armed(&mut self) -> Result<usize, Self::Error>;
    /// Step 3: blocks until a descriptor is ready or `timeout` passes;
    /// returns true on timeout.
    fn block(&mut self, timeout: Duration) -> Result<bool, Self::Error>;
    /// Step 4: takes and acknowledges (in batches) the notifications of the
    /// ready descriptors; each CQ that fired becomes active and unarmed.
    /// Returns how many notifications.
    fn collect_events(&mut self) -> Result<u32, Self::Error>;
    /// Step 5 (and every round of the caller): polls every active CQ once
    /// (up to its round budget), dispatching; returns the completions
    /// found.
    fn poll_round(&mut self) -> Result<usize, Self::Error>;
}

/// What one call of [`sleep_once`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slept {
    /// Completions the re-poll (step 2) found; if non-zero the poller did
    /// not sleep.
    pub repoll_found: usize,
    /// Whether the poller blocked (step 3).
    pub blocked: bool,
    /// Whether the block ended by timeout.
    pub timed_out: bool,
    /// Notifications collected (step 4).
    pub events: u32,
    /// Completions the poll after the wake-up found (step 5).
    pub found: usize,
}

/// Runs steps 1–5 of the sleep protocol once.
///
/// # Errors
/// Whatever the group's operations return.
pub fn sleep_once<G: SleepGroup>(g: &mut G, timeout: Duration) -> Result<Slept, G::Error> {
    // 1. Arm the active CQs that are not armed; the armed ones go quiet.
    let armed = g.arm_unarmed()?;
    // 2. Re-poll the CQs just armed before sleeping.
    let repoll_found = if armed > 0 { g.repoll_armed()? } else { 0 };
    if repoll_found > 0 {
        return Ok(Slept {
            repoll_found,
            blocked: false,
            timed_out: false,
            events: 0,
            found: 0,
        });
    }
    // 3. Block, with the safety timeout.
    let timed_out = g.block(timeout)?;
    // 4. Collect (and batch-ack) the notifications of the ready descriptors.
    let events = g.collect_events()?;
    // 5. Poll the active CQs; the caller drains to empty before sleeping
    //    again.
    let found = g.poll_round()?;
    Ok(Slept {
        repoll_found,
        blocked: true,
        timed_out,
        events,
        found,
    })
}

/// What to do when a round found nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Idle {
    Spin,
    Sleep,
}

/// The per-thread state of a mode.
#[derive(Debug)]
pub(crate) struct IdlePolicy {
    mode: PollMode,
    last_work: Instant,
    /// A round found nothing since the last work: the next work ends a gap.
    in_gap: bool,
    /// When the current spin began (`on_idle`'s first empty round), until
    /// it ends in work or in a sleep.
    idle_since: Option<Instant>,
    window: Duration,
    gap_ewma_ns: f64,
    /// Adaptive: the CPU overhead of a sleep cycle (EWMA).
    sleep_cpu_ewma_ns: f64,
    /// Adaptive: the wake-up latency a sleep adds: the configured floor,
    /// raised to the measured latency once the probe has it.
    wake_ns: f64,
    /// Adaptive: the probe's result is in `wake_ns`.
    wake_measured: bool,
    period_start: Instant,
    /// Adaptive: spinning wasted this period (windows that ended in a
    /// sleep).
    period_waste: Duration,
    over_budget: bool,
    spins: u32,
    /// Busy mode: when the current idle stretch began (its first spin).
    spin_since: Option<Instant>,
    /// Busy mode: the next nap.
    nap: Duration,
    /// Busy mode: naps allowed (off for a poller alone on its core).
    naps: bool,
}

const PERIOD: Duration = Duration::from_millis(100);

impl IdlePolicy {
    /// The state of `mode` from `now`; Adaptive asks for the machine's
    /// wake-up latency ([`measured_wake_latency`], measured once per
    /// process).
    pub(crate) fn new(mode: PollMode, now: Instant) -> Self {
        let measured = match mode {
            PollMode::Adaptive(_) => measured_wake_latency(),
            _ => Some(Duration::ZERO),
        };
        Self::with_wake_latency(mode, now, measured)
    }

    /// As [`new`](Self::new), told the machine's wake-up latency (`None`:
    /// not yet measured).
    fn with_wake_latency(mode: PollMode, now: Instant, measured: Option<Duration>) -> Self {
        let window = match mode {
            PollMode::Hybrid { spin } => spin,
            PollMode::Adaptive(a) => a.min_spin,
            _ => Duration::ZERO,
        };
        let wake = match mode {
            PollMode::Adaptive(a) => {
                a.wake_cost.max(measured.unwrap_or_default()).as_nanos() as f64
            }
            _ => 0.0,
        };
        IdlePolicy {
            mode,
            last_work: now,
            in_gap: false,
            idle_since: None,
            window,
            gap_ewma_ns: f64::MAX,
            sleep_cpu_ewma_ns: 0.0,
            wake_ns: wake,
            wake_measured: measured.is_some(),
            period_start: now,
            period_waste: Duration::ZERO,
            over_budget: false,
            spins: 0,
            spin_since: None,
            nap: BUSY_NAP_MIN,
            naps: true,
        }
    }

    /// Busy mode without naps: pause hints, then yields, never a sleep
    /// (for a poller pinned alone on its core, where naps would only add
    /// latency).
    pub(crate) fn without_naps(mut self) -> Self {
        self.naps = false;
        self
    }

    pub(crate) fn mode(&self) -> PollMode {
        self.mode
    }

    /// The current spin window.
    pub(crate) fn window(&self) -> Duration {
        self.window
    }

    /// A round (or the poll after a sleep) found `found` completions at
    /// `now`.
    pub(crate) fn on_work(&mut self, now: Instant, found: usize) {
        if std::mem::take(&mut self.in_gap) {
            // The end of a gap (spun or slept through): learn it, per
            // completion found, so that a poller which slept and found
            // several waiting learns their spacing, not its sleep. Beyond
            // twice a sleep's cost the size no longer matters (the poller
            // sleeps either way): capped there, one long pause (a
            // preemption, a quiet second) is forgotten within a few gaps.
            let gap = (now.saturating_duration_since(self.last_work).as_nanos() as f64
                / found.max(1) as f64)
                .min(2.0 * self.sleep_cost_ns().max(1.0));
            self.gap_ewma_ns = if self.gap_ewma_ns == f64::MAX {
                gap
            } else {
                0.8 * self.gap_ewma_ns + 0.2 * gap
            };
        }
        // A spin that ends in work caught its completion: not charged.
        self.idle_since = None;
        self.last_work = now;
        self.spins = 0;
        self.spin_since = None;
        self.nap = BUSY_NAP_MIN;
        self.adapt(now);
    }

    /// A sleep cycle that ended at `now` cost `overhead` of CPU time.
    pub(crate) fn on_sleep_overhead(&mut self, now: Instant, overhead: Duration) {
        if let PollMode::Adaptive(_) = self.mode {
            let cost = overhead.as_nanos() as f64;
            self.sleep_cpu_ewma_ns = 0.8 * self.sleep_cpu_ewma_ns + 0.2 * cost;
        }
        // The spin before the sleep found nothing: it was wasted.
        if let Some(since) = self.idle_since.take() {
            self.period_waste += now.saturating_duration_since(since);
        }
    }

    /// The cost of a sleep/wake cycle, in ns: its CPU overhead and the
    /// wake-up latency it adds.
    fn sleep_cost_ns(&self) -> f64 {
        self.sleep_cpu_ewma_ns + self.wake_ns
    }

    fn adapt(&mut self, now: Instant) {
        let PollMode::Adaptive(a) = self.mode else {
            return;
        };
        let elapsed = now.saturating_duration_since(self.period_start);
        if elapsed >= PERIOD {
            if !self.wake_measured {
                if let Some(measured) = measured_wake_latency() {
                    self.wake_measured = true;
                    self.wake_ns = self.wake_ns.max(measured.as_nanos() as f64);
                }
            }
            let wasted = self.period_waste.as_secs_f64() / elapsed.as_secs_f64();
            self.over_budget = wasted > a.cpu_budget;
            self.period_start = now;
            self.period_waste = Duration::ZERO;
        }
        // Keep polling while the next completion is expected sooner than a
        // sleep/wake cycle would cost; otherwise spin only briefly.
        let window = if self.over_budget || self.gap_ewma_ns >= self.sleep_cost_ns() {
            a.min_spin
        } else {
            Duration::from_nanos((2.0 * self.gap_ewma_ns) as u64)
        };
        self.window = window.clamp(a.min_spin, a.max_spin);
    }

    /// A round found nothing at `now`.
    pub(crate) fn on_idle(&mut self, now: Instant) -> Idle {
        self.in_gap = true;
        if self.idle_since.is_none() {
            self.idle_since = Some(now);
        }
        let idle = now.saturating_duration_since(self.last_work);
        match self.mode {
            PollMode::Busy => Idle::Spin,
            PollMode::Event => Idle::Sleep,
            PollMode::Hybrid { .. } | PollMode::Adaptive(_) => {
                if idle < self.window {
                    Idle::Spin
                } else {
                    Idle::Sleep
                }
            }
        }
    }

    /// One spin that waits for something other than completions (ring
    /// space): pause hints, backing off to a yield after 64 rounds. Never
    /// a nap: what it waits for is making progress.
    pub(crate) fn spin(&mut self) {
        self.spins = self.spins.saturating_add(1);
        if self.spins < 64 {
            self.pause();
        } else {
            std::thread::yield_now();
        }
    }

    /// One idle spin after a round that found nothing; returns how long it
    /// slept. Hybrid and Adaptive: as [`spin`](Self::spin) (their window
    /// ends the spinning). Busy: by the length of the idle stretch, pause
    /// hints, then a yield, then a nap twice as long as the last, up to
    /// [`BUSY_NAP_MAX`] (the table in the module documentation).
    pub(crate) fn idle_spin(&mut self) -> Duration {
        if !matches!(self.mode, PollMode::Busy) {
            self.spin();
            return Duration::ZERO;
        }
        self.spins = self.spins.saturating_add(1);
        let now = Instant::now();
        let idle = now.saturating_duration_since(*self.spin_since.get_or_insert(now));
        if idle < BUSY_PAUSE_FOR {
            self.pause();
        } else if idle < BUSY_YIELD_UNTIL || !self.naps {
            std::thread::yield_now();
        } else {
            std::thread::sleep(self.nap);
            self.nap = (self.nap * 2).min(BUSY_NAP_MAX);
            return now.elapsed();
        }
        Duration::ZERO
    }

    /// The next nap an idle Busy poller would take.
    #[cfg(test)]
    fn next_nap(&self) -> Duration {
        self.nap
    }

    /// Pause hints, more as a stretch of spins goes on (1 to 64).
    fn pause(&self) {
        for _ in 0..(1u32 << (self.spins / 8).min(6)) {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Script {
        log: Vec<&'static str>,
        to_arm: usize,
        repoll: usize,
        after: usize,
    }

    impl SleepGroup for Script {
        type Error = ();
        fn arm_unarmed(&mut self) -> Result<usize, ()> {
            self.log.push("arm");
            Ok(self.to_arm)
        }
        fn repoll_armed(&mut self) -> Result<usize, ()> {
            self.log.push("repoll");
            Ok(self.repoll)
        }
        fn poll_round(&mut self) -> Result<usize, ()> {
            self.log.push("poll");
            Ok(self.after)
        }
        fn block(&mut self, _: Duration) -> Result<bool, ()> {
            self.log.push("block");
            Ok(false)
        }
        fn collect_events(&mut self) -> Result<u32, ()> {
            self.log.push("collect");
            Ok(1)
        }
    }

    #[test]
    fn arm_then_repoll_then_block() {
        let mut g = Script {
            log: vec![],
            to_arm: 1,
            repoll: 0,
            after: 3,
        };
        let s = sleep_once(&mut g, Duration::from_millis(1)).unwrap();
        assert_eq!(g.log, ["arm", "repoll", "block", "collect", "poll"]);
        assert_eq!((s.blocked, s.events, s.found), (true, 1, 3));
    }

    #[test]
    fn repoll_finding_work_does_not_sleep() {
        let mut g = Script {
            log: vec![],
            to_arm: 1,
            repoll: 2,
            after: 0,
        };
        let s = sleep_once(&mut g, Duration::from_millis(1)).unwrap();
        assert_eq!(g.log, ["arm", "repoll"]);
        assert!(!s.blocked);
        assert_eq!(s.repoll_found, 2);
    }

    #[test]
    fn nothing_newly_armed_needs_no_repoll() {
        let mut g = Script {
            log: vec![],
            to_arm: 0,
            repoll: 5,
            after: 0,
        };
        let s = sleep_once(&mut g, Duration::from_millis(1)).unwrap();
        assert_eq!(g.log, ["arm", "block", "collect", "poll"]);
        assert!(s.blocked);
    }

    const WAKE: Duration = Duration::from_micros(35);

    fn adaptive(a: Adaptive, t0: Instant) -> IdlePolicy {
        IdlePolicy::with_wake_latency(PollMode::Adaptive(a), t0, Some(WAKE))
    }

    /// One gap of `gap` spun through: the poller spins until the work.
    fn spun(p: &mut IdlePolicy, t: &mut Instant, gap: Duration) -> Idle {
        let decided = p.on_idle(*t + gap / 2);
        *t += gap;
        p.on_work(*t, 1);
        decided
    }

    /// One gap of `gap` ended by a sleep (after spinning for the window)
    /// whose wake-up found `found` completions.
    fn slept(p: &mut IdlePolicy, t: &mut Instant, gap: Duration, found: usize) {
        assert!(p.window() < gap);
        assert_eq!(p.on_idle(*t + p.window()), Idle::Sleep);
        *t += gap;
        p.on_sleep_overhead(*t, Duration::from_micros(3));
        p.on_work(*t, found);
    }

    #[test]
    fn adaptive_window_follows_gaps() {
        let a = Adaptive::default();
        let t0 = Instant::now();
        let mut p = IdlePolicy::with_wake_latency(PollMode::Adaptive(a), t0, Some(Duration::ZERO));
        // Completions 1 µs apart: cheaper to keep polling than to sleep.
        let mut t = t0;
        for _ in 0..50 {
            spun(&mut p, &mut t, Duration::from_micros(1));
        }
        assert!(p.window() >= Duration::from_micros(1), "{:?}", p.window());
        // 1 ms apart: spin only briefly.
        for _ in 0..50 {
            slept(&mut p, &mut t, Duration::from_millis(1), 1);
        }
        assert_eq!(p.window(), a.min_spin);
    }

    #[test]
    fn adaptive_spins_through_gaps_shorter_than_a_wake_up() {
        let a = Adaptive::default();
        let t0 = Instant::now();
        let mut p = adaptive(a, t0);
        let mut t = t0;
        // Completions 10 µs apart, a wake-up costs 35 µs: spin through them.
        spun(&mut p, &mut t, Duration::from_micros(10));
        for _ in 0..100_000 {
            assert_eq!(spun(&mut p, &mut t, Duration::from_micros(10)), Idle::Spin);
        }
        assert_eq!(p.window(), Duration::from_micros(20));
        // A second of that (all of it spinning) stays within the budget:
        // every spin caught its completion.
        assert!(!p.over_budget);
        // The configured floor counts when it is above the measurement.
        let told = Adaptive {
            wake_cost: Duration::from_micros(100),
            ..a
        };
        let mut q = IdlePolicy::with_wake_latency(PollMode::Adaptive(told), t0, Some(WAKE));
        let mut t = t0;
        for _ in 0..100 {
            spun(&mut q, &mut t, Duration::from_micros(50));
        }
        assert_eq!(q.window(), Duration::from_micros(100));
        assert_eq!(p.window(), Duration::from_micros(20));
    }

    #[test]
    fn adaptive_learns_the_spacing_not_the_sleep() {
        let a = Adaptive::default();
        let t0 = Instant::now();
        let mut p = adaptive(a, t0);
        let mut t = t0;
        // Sleeping, each wake-up 40 µs later finds 4 completions: they are
        // 10 µs apart, so the poller starts to spin.
        for _ in 0..30 {
            slept(&mut p, &mut t, Duration::from_micros(40), 4);
        }
        let w = p.window();
        assert!(
            w >= Duration::from_micros(18) && w <= Duration::from_micros(24),
            "{w:?}"
        );
        assert_eq!(spun(&mut p, &mut t, Duration::from_micros(10)), Idle::Spin);
        // One pause of 5 ms (a preemption): forgotten within a few gaps.
        slept(&mut p, &mut t, Duration::from_millis(5), 1);
        let mut gaps = 0;
        while p.window() < Duration::from_micros(18) {
            spun(&mut p, &mut t, Duration::from_micros(10));
            gaps += 1;
            assert!(gaps <= 8, "still not spinning after {gaps} short gaps");
        }
        // The stream slows to 1k/s: within a few gaps the spinning ends.
        let mut gaps = 0;
        while p.window() > a.min_spin {
            slept(&mut p, &mut t, Duration::from_millis(1), 1);
            gaps += 1;
            assert!(gaps <= 5, "still spinning after {gaps} gaps of 1 ms");
        }
    }

    #[test]
    fn adaptive_budget_charges_only_wasted_spinning() {
        let a = Adaptive {
            cpu_budget: 0.05,
            ..Adaptive::default()
        };
        let t0 = Instant::now();
        let mut p = adaptive(a, t0);
        let mut t = t0;
        // 200 ms of spinning that always catches the completion: free.
        for _ in 0..20_000 {
            spun(&mut p, &mut t, Duration::from_micros(10));
        }
        assert!(!p.over_budget);
        assert_eq!(p.window(), Duration::from_micros(20));
        // Windows that run out: each one spun, then slept as long again,
        // and the wake-up found 4 completions (so the gap still looks
        // short). Half the time wasted, over a 5% budget: the window drops
        // to min_spin.
        let mut wasted = 0;
        while !p.over_budget {
            let gap = 2 * p.window();
            slept(&mut p, &mut t, gap, 4);
            wasted += 1;
            assert!(wasted < 10_000, "the budget never applied");
        }
        assert_eq!(p.window(), a.min_spin);
        assert!(t - t0 < Duration::from_millis(400), "within two periods");
    }

    #[test]
    fn busy_pauses_yields_then_naps_doubling_and_starts_over_on_work() {
        let mut p = IdlePolicy::new(PollMode::Busy, Instant::now());
        // The stretch just began: pause hints, no nap.
        assert_eq!(p.idle_spin(), Duration::ZERO);
        std::thread::sleep(BUSY_YIELD_UNTIL);
        let mut naps = Vec::new();
        for _ in 0..9 {
            let nap = p.next_nap();
            let slept = p.idle_spin();
            assert!(slept >= nap, "slept {slept:?}, meant {nap:?}");
            naps.push(nap.as_micros());
        }
        assert_eq!(naps, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        assert_eq!(BUSY_NAP_MIN.as_micros(), 10);
        assert_eq!(BUSY_NAP_MAX.as_micros(), 1000);
        // Work starts the stretch over: spinning again, the next nap short.
        p.on_work(Instant::now(), 1);
        assert_eq!(p.idle_spin(), Duration::ZERO);
        assert_eq!(p.next_nap(), BUSY_NAP_MIN);
    }

    #[test]
    fn busy_without_naps_never_sleeps() {
        let mut p = IdlePolicy::new(PollMode::Busy, Instant::now()).without_naps();
        assert_eq!(p.idle_spin(), Duration::ZERO);
        std::thread::sleep(BUSY_YIELD_UNTIL * 2);
        for _ in 0..100 {
            assert_eq!(p.idle_spin(), Duration::ZERO, "a yield, never a nap");
        }
    }

    #[test]
    fn only_busy_naps() {
        for mode in PollMode::all() {
            if mode == PollMode::Busy {
                continue;
            }
            let mut p = IdlePolicy::new(mode, Instant::now());
            let start = Instant::now();
            while start.elapsed() < 2 * BUSY_YIELD_UNTIL {
                assert_eq!(p.idle_spin(), Duration::ZERO, "{}", mode.name());
            }
        }
    }

    #[test]
    fn modes_decide() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_secs(1);
        assert_eq!(
            IdlePolicy::new(PollMode::Busy, t0).on_idle(later),
            Idle::Spin
        );
        assert_eq!(
            IdlePolicy::new(PollMode::Event, t0).on_idle(t0),
            Idle::Sleep
        );
        let mut h = IdlePolicy::new(
            PollMode::Hybrid {
                spin: Duration::from_millis(10),
            },
            t0,
        );
        assert_eq!(h.on_idle(t0 + Duration::from_millis(1)), Idle::Spin);
        assert_eq!(h.on_idle(later), Idle::Sleep);
    }
}
