//! Per-completion cost of the poller path, side by side in one run:
//!
//! - `raw poll`: polling the simulated CQ in batches of 32, no dispatch;
//! - `cqd dispatch`: the same polls through `CqPoller::poll_once` — decode
//!   the wr_id, check the slab generation, call the handler, keep the ledger;
//! - `mutex map`: the raw poll, then for each completion a lock of a
//!   `Mutex<HashMap<u64, Box<dyn FnMut>>>` keyed by handler, as some RDMA
//!   crates route completions.
//!
//! `cargo bench --bench dispatch` (add `-- --quick` for a smoke run).
//! Figures are recorded in docs/benchmarks.md.

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use cqd::core::{
    split, Completion, CompletionSource, CqOptions, CqPoller, Failed, Handler, NoWork, OpKind,
    Opcode, Outbox, RecvDone, Registration, SendDone,
};
use cqd::sim::{sim_cq, Faults, SimCq};

const CQ_SIZE: u32 = 65_536;
const HANDLERS: usize = 64;
const BATCH: usize = 32;

struct Count(u64);

impl Handler for Count {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0 += u64::from(d.tag());
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0 += u64::from(d.byte_len());
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0 += 1;
    }
}

fn completions(regs: &[Registration]) -> Vec<Completion> {
    (0..CQ_SIZE)
        .map(|i| {
            let r = &regs[i as usize % regs.len()];
            let (kind, op) = if i % 2 == 0 {
                (OpKind::Send, Opcode::Send)
            } else {
                (OpKind::Recv, Opcode::Recv)
            };
            let mut c = Completion::success(r.wr_id(kind, i).unwrap(), op, 7);
            c.byte_len = 512;
            c
        })
        .collect()
}

/// Fills the CQ (untimed), then times `drain` until it reports 0.
fn measure(cq: &SimCq, wcs: &[Completion], rounds: usize, mut drain: impl FnMut() -> usize) -> f64 {
    let mut total = Duration::ZERO;
    let mut n = 0usize;
    for _ in 0..rounds {
        cq.push_all(wcs).unwrap();
        let start = Instant::now();
        loop {
            let got = drain();
            n += got;
            if got == 0 {
                break;
            }
        }
        total += start.elapsed();
    }
    total.as_nanos() as f64 / n as f64
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let rounds = if quick { 20 } else { 400 };
    let reps = if quick { 1 } else { 5 };

    // cqd dispatch.
    let (cq_d, src_d) = sim_cq("dispatch", CQ_SIZE, Faults::default()).unwrap();
    let (poller, handle) = split::<NoWork>(src_d, CqOptions::default()).unwrap();
    let mut poller: CqPoller<NoWork> = poller.bind();
    let regs: Vec<Registration> = (0..HANDLERS)
        .map(|_| handle.register(Count(0)).unwrap())
        .collect();
    let wcs = completions(&regs);
    let mut out = VecDeque::new();

    // Raw poll and mutex map on their own CQs with the same entries.
    let (cq_r, mut src_r) = sim_cq("raw", CQ_SIZE, Faults::default()).unwrap();
    let (cq_m, mut src_m) = sim_cq("mutex", CQ_SIZE, Faults::default()).unwrap();
    type Callback = Box<dyn FnMut(&Completion) + Send>;
    let map: Mutex<HashMap<u64, Callback>> = Mutex::new(HashMap::new());
    for r in &regs {
        let mut sum = 0u64;
        let key = r.wr_id(OpKind::Send, 0).unwrap() >> cqd::core::wr_id::SLOT_SHIFT
            & cqd::core::wr_id::SLOT_MASK;
        map.lock().unwrap().insert(
            key,
            Box::new(move |c: &Completion| {
                sum += u64::from(c.byte_len);
                black_box(sum);
            }),
        );
    }
    let mut buf = vec![Completion::default(); BATCH];

    let mut best = [f64::MAX; 3];
    for _ in 0..reps {
        let raw = measure(&cq_r, &wcs, rounds, || {
            let n = src_r.poll(&mut buf).unwrap();
            black_box(&buf[..n]);
            n
        });
        let dispatch = measure(&cq_d, &wcs, rounds, || {
            // Every ledger entry is tracked so the slots stay consistent.
            poller.poll_once(&mut out).unwrap()
        });
        let mutex = measure(&cq_m, &wcs, rounds, || {
            let n = src_m.poll(&mut buf).unwrap();
            for c in &buf[..n] {
                let key = c.wr_id >> cqd::core::wr_id::SLOT_SHIFT & cqd::core::wr_id::SLOT_MASK;
                if let Some(cb) = map.lock().unwrap().get_mut(&key) {
                    cb(c);
                }
            }
            n
        });
        for (b, v) in best.iter_mut().zip([raw, dispatch, mutex]) {
            *b = b.min(v);
        }
    }
    let [raw, dispatch, mutex] = best;
    println!("per-completion cost, batch {BATCH}, {HANDLERS} handlers, best of {reps} × {rounds} × {CQ_SIZE} completions");
    println!("{:<14} {:>10} {:>14}", "path", "ns/compl", "vs raw poll");
    for (name, v) in [
        ("raw poll", raw),
        ("cqd dispatch", dispatch),
        ("mutex map", mutex),
    ] {
        println!("{name:<14} {v:>10.2} {:>13.2}x", v / raw);
    }
    println!(
        "dispatch / raw = {:.2} (goal <= 2.0); mutex map / dispatch = {:.2} (goal >= 5.0)",
        dispatch / raw,
        mutex / dispatch
    );
    let snap = handle.snapshot();
    assert_eq!(
        snap.stale_wr_ids + snap.foreign_wr_ids,
        0,
        "every completion was dispatched"
    );
    assert!(out.is_empty());
}
