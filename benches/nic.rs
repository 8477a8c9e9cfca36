//! Completions per second through one poller thread, fed by the simulated
//! NIC's timed engine, at poll batch sizes 1, 16, 32 and 64, side by side in
//! one run.
//!
//! A poster thread keeps 4 RC QPs (send depth 256 each) full of signaled
//! 64-byte RDMA WRITEs; the NIC thread completes each after the model's
//! latency (2 µs) and link time (100 Gb/s); one poller thread (Busy, then
//! Adaptive mode) drains the CQ and calls a counting handler. The figure is
//! completions handled per second of wall time (best and median of 5 runs);
//! the ratio column compares each batch size's median with batch 1's.
//!
//! `cargo bench --bench nic` (add `-- --quick` for a CI smoke run).
//! Figures are recorded in docs/benchmarks-nic.md.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    cq_depth_for, CqOptions, Failed, Handler, NoSink, NoWork, Outbox, PollMode, PollerBuilder,
    RecvDone, SendDone,
};
use cqd::sim::{
    connect, Access, CqConfig, Engine, Fabric, QpCap, QpInit, SendWr, TimedModel, WrOp,
};

const QPS: usize = 4;
const DEPTH: u32 = 256;
const CHUNK: usize = 16;

struct Count(Arc<AtomicU64>);

impl Handler for Count {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        panic!("unexpected error completion: {}", f.status());
    }
}

struct Run {
    rate: f64,
    mean_batch: f64,
    overflows: u64,
}

fn run(mode: PollMode, batch: usize, total: u64) -> Run {
    let fabric = Fabric::new(Engine::Timed(TimedModel::default())).expect("fabric");
    let dev = fabric.open_device("sim0", Default::default());
    // Each pair: two send queues of DEPTH and two receive queues of 1.
    let depths = vec![DEPTH + 1; QPS * 2];
    let cqe = cq_depth_for(&depths, 2, dev.attr().max_cqe).expect("fits");
    let options = CqOptions {
        batch,
        ..CqOptions::default()
    };
    let (cq, poller, handle) = dev
        .create_dispatched_cq::<NoWork>("bench", cqe, CqConfig::default(), options)
        .expect("cq");
    let count = Arc::new(AtomicU64::new(0));
    let reg = handle
        .register(Count(Arc::clone(&count)))
        .expect("register");
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: DEPTH,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let mut pairs = Vec::new();
    for _ in 0..QPS {
        let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).expect("qp");
        let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).expect("qp");
        connect(&a, &b).expect("connect");
        pairs.push((a, b));
    }
    let mr = pd.reg_mr(4096, Access::ALL).expect("mr");
    let sge = [mr.sge(0, 64)];
    let remote = mr.remote(1024);
    let thread = PollerBuilder::new("bench", NoSink)
        .mode(mode)
        .cq(poller)
        .spawn()
        .expect("poller");
    let start = Instant::now();
    let mut posted = 0u64;
    let mut qp = 0;
    while posted < total {
        let n = CHUNK.min((total - posted) as usize);
        let mut wrs: Vec<SendWr<'_>> = (0..n)
            .map(|i| {
                let tag = (posted + i as u64) & 0xff_ffff;
                SendWr::new(tag, WrOp::Write(remote), &sge)
            })
            .collect();
        match reg.post_send(&pairs[qp].0, &mut wrs) {
            Ok(()) => posted += n as u64,
            Err(_) => std::thread::yield_now(),
        }
        qp = (qp + 1) % QPS;
    }
    while count.load(Ordering::Relaxed) < total {
        std::thread::yield_now();
    }
    let elapsed = start.elapsed();
    let report = thread.stop().expect("stop");
    let snap = &report.cqs[0];
    let nonempty = snap.polls.saturating_sub(snap.empty_polls).max(1);
    Run {
        rate: total as f64 / elapsed.as_secs_f64(),
        mean_batch: snap.completions as f64 / nonempty as f64,
        overflows: snap.overflows + cq.budget_snapshot().overflows,
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let total: u64 = if quick { 20_000 } else { 400_000 };
    let reps = if quick { 1 } else { 5 };
    println!(
        "timed engine: {QPS} QPs x depth {DEPTH}, 64-byte signaled WRITEs, \
         {total} completions per run, {reps} runs per batch size (best and median)"
    );
    println!(
        "{:>9} {:>6} {:>14} {:>14} {:>10} {:>11} {:>10} {:>9}",
        "mode",
        "batch",
        "best compl/s",
        "median compl/s",
        "ns/compl",
        "mean batch",
        "vs batch 1",
        "overflows"
    );
    for mode in [PollMode::Busy, PollMode::default()] {
        let mut base = None;
        for batch in [1usize, 16, 32, 64] {
            let mut runs: Vec<Run> = (0..reps)
                .map(|_| {
                    let r = run(mode, batch, total);
                    std::thread::sleep(Duration::from_millis(20));
                    r
                })
                .collect();
            runs.sort_by(|a, b| a.rate.total_cmp(&b.rate));
            let (Some(best), Some(median)) = (runs.last(), runs.get(runs.len() / 2)) else {
                continue;
            };
            let b = *base.get_or_insert(median.rate);
            println!(
                "{:>9} {:>6} {:>14.0} {:>14.0} {:>10.1} {:>11.1} {:>9.2}x {:>9}",
                mode.name(),
                batch,
                best.rate,
                median.rate,
                1e9 / median.rate,
                median.mean_batch,
                median.rate / b,
                runs.iter().map(|r| r.overflows).sum::<u64>()
            );
        }
    }
}
