//! What an idle Busy poller leaves to the other threads on its CPU, and what
//! that costs it: side by side in one run.
//!
//! 1. **Share.** A producer thread counts in a busy loop for 500 ms while 0,
//!    1 or 2 Busy pollers on idle simulated CQs run beside it: all pinned to
//!    one CPU (the last this process may use), then all left to the
//!    scheduler. The figures are the producer's CPU time as a part of wall
//!    time, the pollers', and the producer's part of the CPU time all of
//!    them used, which load from other processes does not move (5 runs:
//!    median [min–max]). A third table leaves the pinned pollers alone on
//!    their CPU (the producer sleeps).
//! 2. **Wake latency after idle.** One poller per mode, pinned to the last
//!    CPU; its CQ stays quiet for 10 ms, then a thread pinned to the first
//!    CPU pushes one completion and waits for it; the figure is the time
//!    from the push to the handler's call (100 samples per mode: median,
//!    90th percentile, largest).
//!
//! `cargo bench --bench busy_share` (add `-- --quick` for a smoke run).
//! Figures are recorded in docs/benchmarks.md.

#[path = "../tests/common/share.rs"]
mod share;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    split, Adaptive, Completion, CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Opcode,
    Outbox, PollMode, PollerBuilder, RecvDone, SendDone,
};
use cqd::sim::{sim_cq, Faults};
use share::{producer_share, Setup};

/// `median [min–max]` of percentages.
fn spread(mut v: Vec<f64>) -> String {
    v.sort_by(f64::total_cmp);
    format!(
        "{:5.1}% [{:.1}–{:.1}]",
        v[v.len() / 2],
        v[0],
        v[v.len() - 1]
    )
}

fn share_table(title: &str, runs: usize, setups: &[(usize, Setup)]) {
    println!("\n{title}");
    println!(
        "{:>7}  {:>22}  {:>22}  {:>22}",
        "pollers", "producer / wall", "pollers / wall", "producer / used"
    );
    for (n, setup) in setups {
        let mut producer = Vec::new();
        let mut pollers = Vec::new();
        let mut used = Vec::new();
        for _ in 0..runs {
            match producer_share(setup) {
                Ok(s) => {
                    producer.push(100.0 * s.of_wall());
                    pollers.push(100.0 * s.pollers_of_wall());
                    used.push(100.0 * s.of_used());
                }
                Err(reason) => {
                    println!("SKIPPED: {reason}");
                    return;
                }
            }
        }
        let (producer, used) = if setup.count {
            (spread(producer), spread(used))
        } else {
            ("(asleep)".into(), "".into())
        };
        println!(
            "{n:>7}  {producer:>22}  {:>22}  {used:>22}",
            spread(pollers)
        );
    }
}

/// Stores when it was called, in nanoseconds since `base`.
struct Stamp {
    base: Instant,
    at: Arc<AtomicU64>,
}

impl Stamp {
    fn hit(&self) {
        let ns = self.base.elapsed().as_nanos() as u64;
        self.at.store(ns, Ordering::Release);
    }
}

impl Handler for Stamp {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.hit()
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.hit()
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.hit()
    }
}

fn pin(cpu: usize) -> bool {
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu })
}

/// Microseconds from a push after `quiet` to the handler's call, `samples`
/// times: the poller on the last CPU, the pushing thread on the first (so
/// that its wait never delays the poller), both as far as they can be
/// pinned.
fn wake_latency(mode: PollMode, quiet: Duration, samples: usize) -> Vec<f64> {
    let cpus: Vec<usize> = core_affinity::get_core_ids()
        .unwrap_or_default()
        .iter()
        .map(|c| c.id)
        .collect();
    let (first, last) = (cpus.first().copied(), cpus.last().copied());
    std::thread::spawn(move || {
        let pinned = first.is_some_and(pin);
        if !pinned {
            println!("(the pushing thread could not be pinned)");
        }
        push_and_wait(mode, quiet, samples, last)
    })
    .join()
    .expect("latency thread")
}

fn push_and_wait(mode: PollMode, quiet: Duration, samples: usize, cpu: Option<usize>) -> Vec<f64> {
    let (producer, source) = sim_cq("lat", 256, Faults::default()).expect("sim CQ");
    let (cq, handle) = split::<NoWork>(source, CqOptions::default()).expect("split");
    let base = Instant::now();
    let at = Arc::new(AtomicU64::new(0));
    let reg = handle
        .register(Stamp {
            base,
            at: Arc::clone(&at),
        })
        .expect("register");
    let thread = PollerBuilder::new(format!("lat-{}", mode.name()), NoSink)
        .mode(mode)
        .on_start(move || {
            if cpu.is_some_and(|c| !pin(c)) {
                println!("(the poller could not be pinned)");
            }
            Ok(())
        })
        .cq(cq)
        .spawn()
        .expect("spawn");
    let mut out = Vec::with_capacity(samples);
    for tag in 0..samples as u32 {
        std::thread::sleep(quiet);
        at.store(0, Ordering::Relaxed);
        reg.track(OpKind::Send, 1);
        let wr_id = reg.wr_id(OpKind::Send, tag).expect("wr_id");
        let pushed = base.elapsed().as_nanos() as u64;
        producer
            .push(Completion::success(wr_id, Opcode::Send, 1), false)
            .expect("push");
        let reached = loop {
            let t = at.load(Ordering::Acquire);
            if t != 0 {
                break t;
            }
            std::hint::spin_loop();
        };
        out.push(reached.saturating_sub(pushed) as f64 / 1e3);
    }
    thread.stop().expect("stop");
    out
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let runs = if quick { 1 } else { 5 };
    let samples = if quick { 10 } else { 100 };
    let window = Duration::from_millis(if quick { 100 } else { 500 });
    let setup = |n, count, pinned| {
        (
            n,
            Setup {
                window,
                count,
                pinned,
                tag: format!("s{n}{}", if pinned { "p" } else { "u" }),
                ..Setup::new(PollMode::Busy, n)
            },
        )
    };
    println!(
        "idle Busy pollers beside a counting producer: {runs} runs of {window:?}, \
         median [min–max]"
    );
    share_table(
        "pinned to one CPU",
        runs,
        &[
            setup(0, true, true),
            setup(1, true, true),
            setup(2, true, true),
        ],
    );
    share_table(
        "unpinned (the scheduler places them)",
        runs,
        &[
            setup(0, true, false),
            setup(1, true, false),
            setup(2, true, false),
        ],
    );
    share_table(
        "pinned to one CPU, the producer asleep",
        runs,
        &[setup(1, false, true), setup(2, false, true)],
    );

    let quiet = Duration::from_millis(10);
    println!(
        "\nwake latency: a completion pushed after {quiet:?} of quiet, {samples} samples (µs)"
    );
    println!("{:>9}  {:>8}  {:>8}  {:>8}", "mode", "median", "p90", "max");
    let modes = [
        PollMode::Busy,
        PollMode::Event,
        PollMode::Hybrid {
            spin: Duration::from_micros(50),
        },
        PollMode::Adaptive(Adaptive::default()),
    ];
    for mode in modes {
        let mut v = wake_latency(mode, quiet, samples);
        v.sort_by(f64::total_cmp);
        let at = |q: f64| v[((v.len() - 1) as f64 * q) as usize];
        println!(
            "{:>9}  {:>8.1}  {:>8.1}  {:>8.1}",
            mode.name(),
            at(0.5),
            at(0.9),
            at(1.0)
        );
    }
}
