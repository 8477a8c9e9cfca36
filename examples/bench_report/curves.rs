//! Mode curves: completions arriving on a fixed schedule (a rate, or
//! bursts), one poller thread in each poll mode, and for each completion
//! the time from its arrival to its handler's call; plus the poller
//! thread's CPU time per second of the run.
//!
//! The arrival thread (pinned to CPU 0) makes each completion arrive at its
//! scheduled instant and stamps it right before: on the simulator it pushes
//! the completion into the simulated CQ (the NIC's part), on softverbs it
//! posts a signaled 8-byte RDMA WRITE, which softverbs executes inside the
//! post call (so the stamp also counts the post, about 0.1–1 µs: the verbs
//! figures are upper bounds). The poller thread is pinned to CPU 1.
//! Latency is then `handler call − stamp` on one monotonic clock.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cqd::core::{
    Adaptive, Failed, Handler, NoSink, NoWork, Outbox, PollMode, PollerBuilder, PollerThread,
    RecvDone, SendDone, UnboundCq,
};
use hdrhistogram::Histogram;

use crate::clock::{now_ns, pin, spread, wait_until, Spread, ThreadCpu};

/// CPU of the arrival thread and of the poller thread.
pub const ARRIVAL_CPU: usize = 0;
pub const POLLER_CPU: usize = 1;

/// How completions arrive.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// Evenly spaced, this many per second.
    Rate(u64),
    /// `size` at once every `every_us` µs.
    Burst { size: u64, every_us: u64 },
}

impl Load {
    /// Mean completions per second.
    pub fn mean_rate(&self) -> f64 {
        match *self {
            Load::Rate(r) => r as f64,
            Load::Burst { size, every_us } => size as f64 * 1e6 / every_us as f64,
        }
    }

    /// When arrival `i` is due, in ns after the run's start.
    fn due(&self, i: u64) -> u64 {
        match *self {
            Load::Rate(r) => i * 1_000_000_000 / r,
            Load::Burst { size, every_us } => (i / size) * every_us * 1000,
        }
    }

    pub fn label(&self) -> String {
        match *self {
            Load::Rate(r) if r >= 1_000_000 => format!("{}M/s", r / 1_000_000),
            Load::Rate(r) => format!("{}k/s", r / 1000),
            Load::Burst { size, every_us } => format!("bursts of {size} every {every_us} µs"),
        }
    }
}

/// The loads of a run: four rates and one burst pattern.
pub fn loads() -> Vec<Load> {
    vec![
        Load::Rate(1_000),
        Load::Rate(10_000),
        Load::Rate(100_000),
        Load::Rate(1_000_000),
        Load::Burst {
            size: 32,
            every_us: 200,
        },
    ]
}

/// The name of the Adaptive poller told the machine's wake-up cost.
pub const ADAPTIVE_TOLD: &str = "adaptive, wake_cost = floor";

/// The modes compared: Busy without naps (a poller pinned alone on its
/// core, as the docs advise for Busy), Event, Hybrid and Adaptive with
/// their defaults, and Adaptive whose `wake_cost` (the floor under its
/// estimate of the wake-up latency, 20 µs by default, raised to what its
/// own probe measures) is the eventfd wake-up floor this run measured.
pub fn modes(wake_floor: Duration) -> Vec<(&'static str, PollMode)> {
    let mut m: Vec<(&'static str, PollMode)> =
        PollMode::all().into_iter().map(|m| (m.name(), m)).collect();
    m.push((
        ADAPTIVE_TOLD,
        PollMode::Adaptive(Adaptive {
            wake_cost: wake_floor,
            ..Adaptive::default()
        }),
    ));
    m
}

/// The handler: for its k-th completion, records `now − arrival[k]`.
pub struct Stamp {
    shared: Arc<Shared>,
    next: usize,
}

/// Arrival stamps and latencies of one run, by arrival index.
pub struct Shared {
    arrivals: Vec<AtomicU64>,
    latencies: Vec<AtomicU64>,
    done: AtomicUsize,
    /// Completions whose tag was not the expected one (none, unless
    /// completions were reordered or lost).
    mismatched: AtomicU64,
    errors: AtomicU64,
}

impl Shared {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Shared {
            arrivals: (0..n).map(|_| AtomicU64::new(0)).collect(),
            latencies: (0..n).map(|_| AtomicU64::new(0)).collect(),
            done: AtomicUsize::new(0),
            mismatched: AtomicU64::new(0),
            errors: AtomicU64::new(0),
        })
    }
}

impl Stamp {
    fn record(&mut self, tag: u32) {
        let now = now_ns();
        let k = self.next;
        self.next += 1;
        let s = &self.shared;
        if k >= s.arrivals.len() {
            s.mismatched.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if tag != tag_of(k) {
            s.mismatched.fetch_add(1, Ordering::Relaxed);
        }
        let at = s.arrivals[k].load(Ordering::Acquire);
        s.latencies[k].store(now.saturating_sub(at), Ordering::Relaxed);
        s.done.store(k + 1, Ordering::Release);
    }
}

/// The tag of arrival `k` (16 bits fit every backend's wr_id encoding).
pub fn tag_of(k: usize) -> u32 {
    (k & 0xffff) as u32
}

impl Handler for Stamp {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.record(d.tag());
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.record(d.tag());
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.shared.errors.fetch_add(1, Ordering::Relaxed);
        self.next += 1;
    }
}

/// One backend's set-up for a run: a dispatched CQ with the handler
/// registered, and how to make one completion arrive now.
pub struct Rig {
    /// The CQ, to bind to the poller thread.
    pub cq: UnboundCq<NoWork>,
    /// Makes completion `k` (tag `tag_of(k)`) arrive; false when the CQ or
    /// the queue is full (the arrival waits and tries again).
    pub deliver: Box<dyn FnMut(usize) -> bool>,
    /// Anything the backend must keep alive for the run.
    pub keep: Box<dyn std::any::Any>,
    /// Arrivals not yet handled at most: beyond, an arrival waits (a
    /// stall), so that the CQ never overflows.
    pub max_outstanding: usize,
}

/// A backend: builds a rig whose CQ calls `handler`.
pub type Backend<'a> = dyn FnMut(Stamp) -> Result<Rig, String> + 'a;

/// One run's figures.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    /// Poller CPU seconds per second of the run.
    pub cpu: f64,
    /// Completions per second actually achieved.
    pub rate: f64,
    /// Times an arrival found the queue full and waited.
    pub stalls: u64,
    /// Sleeps of the poller that its safety-net timeout ended with
    /// completions waiting: notifications that never came.
    pub recovered: u64,
}

/// How many arrivals a run of `load` makes.
pub fn arrivals(load: Load, quick: bool) -> usize {
    let (secs, min) = if quick { (0.05, 200.0) } else { (0.5, 2000.0) };
    (load.mean_rate() * secs).max(min) as usize
}

/// One run of `mode` under `load`.
pub fn run_one(
    backend: &mut Backend<'_>,
    mode: PollMode,
    load: Load,
    n: usize,
) -> Result<Sample, String> {
    let shared = Shared::new(n);
    let rig = backend(Stamp {
        shared: Arc::clone(&shared),
        next: 0,
    })?;
    let Rig {
        cq,
        mut deliver,
        keep,
        max_outstanding,
    } = rig;
    let clock: Arc<OnceLock<Option<ThreadCpu>>> = Arc::new(OnceLock::new());
    let on_start = Arc::clone(&clock);
    let thread: PollerThread = PollerBuilder::new(mode.name(), NoSink)
        .mode(mode)
        // Busy pinned alone on its core: no naps (PollerBuilder::busy_naps).
        .busy_naps(false)
        .on_start(move || {
            if !pin(POLLER_CPU) {
                return Err(format!("cannot pin the poller to CPU {POLLER_CPU}"));
            }
            let _ = on_start.set(ThreadCpu::current());
            Ok(())
        })
        .cq(cq)
        .spawn()
        .map_err(|e| e.to_string())?;
    let cpu_clock = clock
        .get()
        .copied()
        .flatten()
        .ok_or("no CPU clock for the poller thread")?;
    // Let the poller settle into its idle state.
    std::thread::sleep(Duration::from_millis(5));
    let cpu0 = cpu_clock.read().ok_or("poller CPU clock")?;
    let start = now_ns() + 1_000_000;
    let mut stalls = 0;
    for k in 0..n {
        wait_until(start + load.due(k as u64));
        loop {
            let room = k - shared.done.load(Ordering::Acquire) < max_outstanding;
            shared.arrivals[k].store(now_ns(), Ordering::Release);
            if room && deliver(k) {
                break;
            }
            stalls += 1;
            if now_ns() > start + load.due(k as u64) + 10_000_000_000 {
                return Err(format!(
                    "{}: arrival {k} could not be delivered for 10 s (the queue stayed full)",
                    mode.name()
                ));
            }
            std::thread::yield_now();
        }
    }
    let deadline = now_ns() + 30_000_000_000;
    while shared.done.load(Ordering::Acquire) < n && now_ns() < deadline {
        std::thread::sleep(Duration::from_micros(50));
    }
    let end = now_ns();
    let cpu1 = cpu_clock.read().ok_or("poller CPU clock")?;
    let report = thread.stop().map_err(|e| e.to_string())?;
    drop(keep);
    let done = shared.done.load(Ordering::Acquire);
    let errors = shared.errors.load(Ordering::Relaxed);
    let mismatched = shared.mismatched.load(Ordering::Relaxed);
    if done != n || errors != 0 || mismatched != 0 {
        return Err(format!(
            "{}: {done} of {n} completions handled, {errors} errors, {mismatched} out of order \
             (poller: {:?})",
            mode.name(),
            report.errors
        ));
    }
    let mut h =
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).map_err(|e| e.to_string())?;
    for l in &shared.latencies {
        h.saturating_record(l.load(Ordering::Relaxed).max(1));
    }
    let wall = (end - start) as f64 / 1e9;
    let us = |q: f64| h.value_at_quantile(q) as f64 / 1e3;
    Ok(Sample {
        p50_us: us(0.5),
        p99_us: us(0.99),
        p999_us: us(0.999),
        cpu: (cpu1 - cpu0).as_secs_f64() / wall,
        rate: n as f64 / wall,
        stalls,
        recovered: report.cqs.iter().map(|c| c.recovered_missed_events).sum(),
    })
}

/// A mode × load point over repeated runs.
#[derive(Debug, Clone)]
pub struct Point {
    pub mode: &'static str,
    pub load: Load,
    pub p50: Spread,
    pub p99: Spread,
    pub p999: Spread,
    pub cpu: Spread,
    pub rate: Spread,
    pub stalls: u64,
    /// Over every run: safety-net wake-ups that found completions.
    pub recovered: u64,
}

/// Every mode at every load, `reps` runs each; the runs are interleaved
/// (each rep visits every mode at one load in turn) so that the machine's
/// load drifts over all contenders alike.
pub fn curves(
    backend: &mut Backend<'_>,
    quick: bool,
    reps: usize,
    wake_floor: Duration,
) -> Result<Vec<Point>, String> {
    if !pin(ARRIVAL_CPU) {
        return Err(format!(
            "cannot pin the arrival thread to CPU {ARRIVAL_CPU}"
        ));
    }
    let modes = modes(wake_floor);
    let mut points = Vec::new();
    for load in loads() {
        let n = arrivals(load, quick);
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); modes.len()];
        for _ in 0..reps {
            for (i, (_, mode)) in modes.iter().enumerate() {
                samples[i].push(run_one(backend, *mode, load, n)?);
            }
        }
        for ((name, _), s) in modes.iter().zip(samples) {
            let col = |f: fn(&Sample) -> f64| spread(&mut s.iter().map(f).collect::<Vec<_>>());
            let point = Point {
                mode: name,
                load,
                p50: col(|s| s.p50_us),
                p99: col(|s| s.p99_us),
                p999: col(|s| s.p999_us),
                cpu: col(|s| s.cpu),
                rate: col(|s| s.rate),
                stalls: s.iter().map(|s| s.stalls).sum(),
                recovered: s.iter().map(|s| s.recovered).sum(),
            };
            eprintln!(
                "  {:<28} {:<28} p50 {} µs  p99 {} µs  cpu {} s/s",
                point.mode,
                load.label(),
                point.p50.show(2),
                point.p99.show(1),
                point.cpu.show(3)
            );
            points.push(point);
        }
    }
    Ok(points)
}

/// The simulated backend: a simulated CQ of 4096 entries; an arrival is a
/// completion pushed into it.
pub fn sim_backend() -> impl FnMut(Stamp) -> Result<Rig, String> {
    use cqd::core::{split, Completion, CqOptions, OpKind, Opcode};
    use cqd::sim::{sim_cq, Faults};
    |stamp: Stamp| {
        let (producer, source) =
            sim_cq("curve", 4096, Faults::default()).map_err(|e| e.to_string())?;
        let (cq, handle) =
            split::<NoWork>(source, CqOptions::default()).map_err(|e| e.to_string())?;
        let reg = handle.register(stamp).map_err(|e| e.to_string())?;
        let capacity = producer.capacity() as usize;
        let wr_ids: Vec<u64> = (0..=0xffff)
            .map(|t| reg.wr_id(OpKind::Send, t))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let deliver = Box::new(move |k: usize| {
            if producer.len() + 1 >= capacity {
                return false;
            }
            let wc = Completion::success(wr_ids[tag_of(k) as usize], Opcode::Send, 1);
            producer.push(wc, false).is_ok()
        });
        Ok(Rig {
            cq,
            deliver,
            keep: Box::new((reg, handle)),
            max_outstanding: capacity - 1,
        })
    }
}
