//! Many CQs per poller, side by side in one run: what 1,023 idle CQs cost
//! the one that has traffic.
//!
//! - **Event latency**: one poller in Event mode over N CQs on one
//!   `SimChannel` (one descriptor for the group); a producer thread pushes
//!   one completion at a time on one CQ after a pause long enough for the
//!   poller to sleep, and the handler measures push → handler. p50 of 400
//!   samples per run.
//! - **Event idle CPU**: the same group with no traffic; the poller
//!   thread's CPU time over 2 s of wall time (ms per s), safety-net wake-ups
//!   (100 ms) included.
//! - **Busy throughput**: one poller in Busy mode over N CQs; a producer
//!   keeps one CQ fed, half its capacity at a time (never past it); the
//!   figure is completions handled per second on that CQ.
//! - **Descriptors**: the process's open descriptors before and after
//!   making 10,000 simulated CQs on one channel and a poller over all of
//!   them; and per CQ for CQs with descriptors of their own.
//!
//! N is 1 and 1,024; each figure is the median of 5 runs [min–max], and the
//! ratio column divides the 1,024-CQ median by the 1-CQ one; the two sizes
//! run interleaved so that both meet the same machine load. The poller is
//! pinned to CPU 1 when the machine has two; the producer is left to the
//! scheduler (pinned to a busy CPU, it is preempted between its time stamp
//! and its push, and the latency measures that). The poller's CPU time per
//! wake-up in the latency runs is what the group's size costs each wake-up
//! whatever the scheduler adds. It is read over the steady part of each
//! run (from the 20th sample to the last), and again over the poller's
//! whole life: start-up arms every CQ of the group once and the stop
//! drains each, which a group of 1,024 pays once and the whole-life figure
//! spreads over its 400 wake-ups.
//!
//! `cargo bench --bench scale` (add `-- --quick` for a CI smoke run: one
//! short run each; `-- --profile event N`: six latency runs of a group of
//! one and of N alternated in one process, for a profiler). Figures are
//! recorded in docs/benchmarks.md, "Many CQs per poller".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    split, CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Opcode, Outbox, PollMode,
    PollerBuilder, PollerThread, RecvDone, Registration, SendDone,
};
use cqd::sim::{sim_cq, Faults, SimChannel, SimCq};

#[path = "common/pin.rs"]
mod pin;
use pin::pin;

const CAPACITY: u32 = 4096;

/// Busy completions per poller CPU-second (M/s), by group size.
static BUSY_CPU: std::sync::Mutex<Vec<(usize, f64)>> = std::sync::Mutex::new(Vec::new());
/// Poller CPU per wake-up of the latency runs, by group size: its whole
/// life (start-up and stop included) over its sleeps.
static WAKE_CPU: std::sync::Mutex<Vec<(usize, f64)>> = std::sync::Mutex::new(Vec::new());
/// The same over the steady part of the run only (after the warm-up
/// samples, to the last): the cost of a wake-up itself.
static WAKE_CPU_STEADY: std::sync::Mutex<Vec<(usize, f64)>> = std::sync::Mutex::new(Vec::new());
/// Samples of a latency run before its steady window opens.
const WARM: usize = 20;

/// Counts completions and, when asked, the latency from the push stamp.
struct Probe {
    count: Arc<AtomicU64>,
    base: Instant,
    pushed_ns: Arc<AtomicU64>,
    latency_ns: Arc<AtomicU64>,
}

impl Handler for Probe {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let now = self.base.elapsed().as_nanos() as u64;
        let pushed = self.pushed_ns.load(Ordering::Acquire);
        self.latency_ns
            .store(now.saturating_sub(pushed), Ordering::Release);
        self.count.fetch_add(1, Ordering::Release);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        panic!("unexpected error completion: {}", f.status());
    }
}

/// A group of `n` CQs on one channel, the active one (index `n / 2`)
/// registered with a probe.
struct Group {
    thread: PollerThread,
    producer: SimCq,
    reg: Registration,
    count: Arc<AtomicU64>,
    base: Instant,
    pushed_ns: Arc<AtomicU64>,
    latency_ns: Arc<AtomicU64>,
    _keep: Vec<SimCq>,
}

fn group(mode: PollMode, n: usize) -> Group {
    let chan = SimChannel::new().expect("channel");
    let active = n / 2;
    let count = Arc::new(AtomicU64::new(0));
    let pushed_ns = Arc::new(AtomicU64::new(0));
    let latency_ns = Arc::new(AtomicU64::new(0));
    let base = Instant::now();
    let mut b = PollerBuilder::new("scale", NoSink)
        .mode(mode)
        .on_start(|| pin(1));
    let mut keep = Vec::new();
    let mut active_parts = None;
    for i in 0..n {
        let (producer, source) = chan
            .cq(format!("c{i}"), CAPACITY, Faults::default())
            .expect("cq");
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).expect("split");
        if i == active {
            let reg = handle
                .register(Probe {
                    count: Arc::clone(&count),
                    base,
                    pushed_ns: Arc::clone(&pushed_ns),
                    latency_ns: Arc::clone(&latency_ns),
                })
                .expect("register");
            active_parts = Some((producer, reg));
        } else {
            keep.push(producer);
        }
        b = b.cq(unbound);
    }
    let (producer, reg) = active_parts.expect("an active CQ");
    Group {
        thread: b.spawn().expect("poller"),
        producer,
        reg,
        count,
        base,
        pushed_ns,
        latency_ns,
        _keep: keep,
    }
}

fn completion(reg: &Registration, tag: u32) -> cqd::core::Completion {
    cqd::core::Completion::success(
        reg.wr_id(OpKind::Send, tag & 0xff_ffff).expect("wr_id"),
        Opcode::Send,
        1,
    )
}

/// p50 push → handler, in µs.
fn event_p50(n: usize, samples: usize) -> f64 {
    let g = group(PollMode::Event, n);
    std::thread::sleep(Duration::from_millis(50));
    let mut lat = Vec::with_capacity(samples);
    let mut steady_from = None;
    for i in 0..samples {
        // Long enough for the poller to go to sleep.
        std::thread::sleep(Duration::from_micros(300 + (i as u64 * 37) % 200));
        if i == WARM.min(samples / 2) {
            // The poller is asleep: its CPU time was read as it went.
            steady_from = Some(g.thread.snapshot());
        }
        g.reg.track(OpKind::Send, 1);
        g.pushed_ns
            .store(g.base.elapsed().as_nanos() as u64, Ordering::Release);
        g.producer
            .push(completion(&g.reg, i as u32), false)
            .expect("push");
        let want = i as u64 + 1;
        while g.count.load(Ordering::Acquire) < want {
            std::hint::spin_loop();
        }
        lat.push(g.latency_ns.load(Ordering::Acquire) as f64 / 1e3);
    }
    // Asleep again after the last sample (its CPU time read as it went).
    std::thread::sleep(Duration::from_millis(2));
    if let Some(s0) = steady_from {
        let s1 = g.thread.snapshot();
        let wakes = s1.sleeps.saturating_sub(s0.sleeps).max(1);
        let per_wake = s1.cpu_ns.saturating_sub(s0.cpu_ns) as f64 / 1e3 / wakes as f64;
        if let Ok(mut v) = WAKE_CPU_STEADY.lock() {
            v.push((n, per_wake));
        }
    }
    if let Ok(r) = g.thread.stop() {
        // The poller's CPU per notified wake-up: what the group's size costs
        // each wake-up, whatever the scheduler adds to the latency.
        let per_wake = r.poller.cpu_ns as f64 / 1e3 / r.poller.sleeps.max(1) as f64;
        if let Ok(mut v) = WAKE_CPU.lock() {
            v.push((n, per_wake));
        }
    }
    lat.sort_by(f64::total_cmp);
    lat[lat.len() / 2]
}

/// Idle poller CPU, in ms per s.
fn event_idle_cpu(n: usize, wall: Duration) -> f64 {
    let g = group(PollMode::Event, n);
    std::thread::sleep(Duration::from_millis(250));
    let c0 = g.thread.snapshot().cpu_ns;
    let t0 = Instant::now();
    std::thread::sleep(wall);
    let c1 = g.thread.snapshot().cpu_ns;
    let secs = t0.elapsed().as_secs_f64();
    let _ = g.thread.stop();
    (c1.saturating_sub(c0)) as f64 / 1e6 / secs
}

/// Busy completions/s on the active CQ.
fn busy_rate(n: usize, wall: Duration) -> f64 {
    let g = group(PollMode::Busy, n);
    std::thread::sleep(Duration::from_millis(50));
    // Half the CQ at a time, under one lock: the producer is not the limit.
    let batch: Vec<cqd::core::Completion> =
        (0..CAPACITY / 2).map(|t| completion(&g.reg, t)).collect();
    let start = Instant::now();
    let c0 = g.count.load(Ordering::Acquire);
    while start.elapsed() < wall {
        if g.producer.len() + batch.len() <= CAPACITY as usize {
            g.reg.track(OpKind::Send, batch.len() as u64);
            g.producer.push_all(&batch).expect("push");
        } else {
            std::hint::spin_loop();
        }
    }
    let handled = g.count.load(Ordering::Acquire) - c0;
    let secs = start.elapsed().as_secs_f64();
    if let Ok(r) = g.thread.stop() {
        // Completions per second of the poller's own CPU time (all of its
        // completions over all of its time): what the group's size costs
        // the active CQ whatever share of a CPU the poller got.
        let all = r.cqs.get(n / 2).map_or(0, |c| c.completions);
        let cpu = r.poller.cpu_ns.max(1) as f64 / 1e9;
        if let Ok(mut v) = BUSY_CPU.lock() {
            v.push((n, all as f64 / cpu / 1e6));
        }
    }
    handled as f64 / secs
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// Descriptors for `n` CQs on one channel with a poller over them, and per
/// CQ for CQs with descriptors of their own (measured on 100).
fn descriptors(n: usize) -> (usize, f64) {
    let before = open_fds();
    let chan = SimChannel::new().expect("channel");
    let mut b = PollerBuilder::new("fds", NoSink).mode(PollMode::Event);
    let mut keep = Vec::with_capacity(n);
    for i in 0..n {
        let (p, s) = chan.cq(format!("c{i}"), 16, Faults::default()).expect("cq");
        let (u, _h) = split::<NoWork>(s, CqOptions::default()).expect("split");
        keep.push(p);
        b = b.cq(u);
    }
    let thread = b.spawn().expect("poller");
    let shared = open_fds() - before;
    let _ = thread.stop();
    drop(keep);
    let before = open_fds();
    let own: Vec<_> = (0..100)
        .map(|i| {
            let (p, s) = sim_cq(format!("o{i}"), 16, Faults::default()).expect("cq");
            (p, split::<NoWork>(s, CqOptions::default()).expect("split"))
        })
        .collect();
    let per_cq = (open_fds() - before) as f64 / 100.0;
    drop(own);
    (shared, per_cq)
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// A goal on a ratio.
#[derive(Clone, Copy)]
enum Goal {
    AtMost(f64),
    AtLeast(f64),
}

impl Goal {
    fn met(self, ratio: f64) -> bool {
        match self {
            Goal::AtMost(g) => ratio <= g,
            Goal::AtLeast(g) => ratio >= g,
        }
    }
}

impl std::fmt::Display for Goal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Goal::AtMost(g) => write!(f, "<= {g}x"),
            Goal::AtLeast(g) => write!(f, ">= {g}x"),
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `--profile event N`: latency runs of a group of one and of N,
    // alternated six times in this process, for a profiler.
    if let Some(i) = args.iter().position(|a| a == "--profile") {
        let n = args.get(i + 2).and_then(|n| n.parse().ok()).unwrap_or(1024);
        for _ in 0..6 {
            for n in [1, n] {
                let p50 = event_p50(n, 400);
                let per = WAKE_CPU_STEADY
                    .lock()
                    .map(|v| v.last().copied())
                    .unwrap_or_default();
                println!("event, {n} CQs: p50 {p50:.2} us, poller CPU per wake-up {per:?} us");
            }
        }
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let reps = if quick { 1 } else { 5 };
    let samples = if quick { 40 } else { 400 };
    let idle_wall = Duration::from_millis(if quick { 300 } else { 2000 });
    let busy_wall = Duration::from_millis(if quick { 100 } else { 1000 });
    let big = 1024;
    println!("scale: 1 vs {big} CQs per poller, median of {reps} runs [min-max]");
    println!(
        "{:<34} {:>24} {:>24} {:>8} {:>10}",
        "measure", "1 CQ", "1,024 CQs", "ratio", "goal"
    );
    // The goal on the ratio 1,024 CQs / 1 CQ: the verdict and the label
    // both come from it.
    type Measure = (&'static str, Box<dyn Fn(usize) -> f64>, Goal);
    let measures: Vec<Measure> = vec![
        (
            "Event p50 push->handler (us)",
            Box::new(move |n| event_p50(n, samples)),
            Goal::AtMost(1.5),
        ),
        (
            "Event idle poller CPU (ms/s)",
            Box::new(move |n| event_idle_cpu(n, idle_wall)),
            Goal::AtMost(2.0),
        ),
        (
            "Busy active-CQ completions (M/s)",
            Box::new(move |n| busy_rate(n, busy_wall) / 1e6),
            Goal::AtLeast(0.8),
        ),
    ];
    for (name, f, goal) in &measures {
        // Interleaved, so that both sizes meet the same machine load.
        let (mut ones, mut manys) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            ones.push(f(1));
            manys.push(f(big));
        }
        let (one, many) = (stats(ones), stats(manys));
        let ratio = many.0 / one.0;
        let met = goal.met(ratio);
        println!(
            "{:<34} {:>24} {:>24} {:>7.2}x {:>6} {}",
            name,
            format!("{:.2} [{:.2}-{:.2}]", one.0, one.1, one.2),
            format!("{:.2} [{:.2}-{:.2}]", many.0, many.1, many.2),
            ratio,
            goal.to_string(),
            if met { "met" } else { "MISSED" }
        );
    }
    // Rows of per-run figures gathered by size: the median [min-max] of
    // each size and the ratio.
    let row = |label: &str, samples: &std::sync::Mutex<Vec<(usize, f64)>>| {
        let all = samples.lock().map(|v| v.clone()).unwrap_or_default();
        let of = |size| {
            all.iter()
                .filter(|(n, _)| *n == size)
                .map(|(_, c)| *c)
                .collect()
        };
        let (one, many) = (stats(of(1)), stats(of(big)));
        println!(
            "{:<34} {:>24} {:>24} {:>7.2}x",
            label,
            format!("{:.2} [{:.2}-{:.2}]", one.0, one.1, one.2),
            format!("{:.2} [{:.2}-{:.2}]", many.0, many.1, many.2),
            many.0 / one.0
        );
    };
    row("Event poller CPU per wake-up (us)", &WAKE_CPU_STEADY);
    row("  the same, start and stop incl.", &WAKE_CPU);
    row("Busy compl. per poller CPU-s (M/s)", &BUSY_CPU);
    let n = if quick { 1000 } else { 10_000 };
    let (shared, per_cq) = descriptors(n);
    println!(
        "descriptors: {n} CQs on one channel + their poller: {shared} in all \
         ({:.4} per CQ; goal <= 1 per CQ: {}); a CQ with its own: {per_cq:.1}",
        shared as f64 / n as f64,
        if shared <= n { "met" } else { "MISSED" }
    );
}
