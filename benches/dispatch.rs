//! Per-completion cost of the poller path, side by side in one run:
//!
//! - `raw poll`: polling the simulated CQ in batches of 32, no dispatch;
//! - `cqd dispatch`: the same polls through `CqPoller::poll_once` — decode
//!   the wr_id, check the slab generation, call the handler, keep the ledger;
//! - `mutex map`: the raw poll, then for each completion a lock of a
//!   `Mutex<HashMap<u64, Box<dyn FnMut>>>` keyed by handler, as some RDMA
//!   crates route completions;
//! - `cqd dispatch with queue accounting (ledger+credits)`: the same
//!   dispatch, with every request posted through the posting call on one
//!   of 64 loopback QPs (one per handler) whose CQ has credits: each
//!   completion also retires its queue account's entry and returns its
//!   credit. Consecutive completions come from different queues, the worst
//!   case (one account lock per completion);
//! - `… runs of 8`: the same, with each handler posting lists of 8 on its
//!   queue, so completions come in runs of 8 from one queue (one account
//!   lock per run), as a busy connection's do.
//!
//! The poll side is timed per completion (the CQ is filled untimed); the
//! post side is timed too: filling by `push_all` against filling through
//! the posting call.
//!
//! Then the handler-count sweep: `cqd dispatch` again, on CQs with 64,
//! 4,096, 65,536 and 262,144 handlers (the most one CQ can hold), each
//! completion for a handler drawn at random from all of them (the fills
//! rotate over [`SWEEP_FILLS`] random sets, so every handler is hit), with
//! the ratio of each count's cost to the 64-handler one. The sizes run
//! interleaved within each repetition, so that a change in the machine's
//! load reaches all of them alike; the sweep is timed in the thread's CPU
//! time, 15 short runs of 20 fills each.
//!
//! Then the width axis: how many queues a batch's completions come from
//! (1, 8, 32 and 256 loopback QPs on one CQ, one handler each, their
//! completions interleaved, sends and receives alternating on each), for
//! three contenders: `same-promise`, the loop a careful engineer writes for
//! one server keeping cqd's promises by hand (a wr_id of queue and
//! position, a per-queue ring of contexts the poster fills, an in-order
//! check that counts stale completions, a send's completion retiring every
//! request before it, counts once per batch, a `match` to the callback);
//! `cqd` (plain handlers, every request through the posting call, with
//! credits); and `cqd+ctx` (a `u64` context per request, carried in its
//! queue's ring). The widths and contenders alternate within each run; each
//! run gives its own ratios, and the lines `ratio NAME = VALUE` give their
//! medians.
//!
//! `taskset -c 1 cargo bench --bench dispatch` (add `-- --quick` for a
//! smoke run; `-- --sweep` runs the sweep only, `-- --width` the width
//! axis only, and `-- --width --widths=1,256` those widths of it).
//! Figures are recorded in docs/benchmarks.md.

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "common/handlers.rs"]
mod handlers;
use handlers::{Count, CountCtx};

use cqd::core::budget::{BudgetOptions, CqBudget};
use cqd::core::{
    split, Completion, CompletionSource, ContextRegistration, CqOptions, CqPoller, NoWork, OpKind,
    Opcode, Registration, Routed, Status, WrLedger,
};
use cqd::sim::{sim_cq, sim_cq_with_ledger, Faults, LoopWr, Loopback, SimCq};

const CQ_SIZE: u32 = 65_536;
const HANDLERS: usize = 64;
const BATCH: usize = 32;
/// Handler counts of the sweep.
const SWEEP: [usize; 4] = [64, 4_096, 65_536, 262_144];
/// Random completion sets each sweep CQ's fills rotate over.
const SWEEP_FILLS: usize = 4;

fn completions(regs: &[Registration]) -> Vec<Completion> {
    mixed(regs, |i| i % regs.len())
}

/// `CQ_SIZE` completions, sends and receives alternating, the `i`th for
/// handler `pick(i)`.
fn mixed(regs: &[Registration], mut pick: impl FnMut(usize) -> usize) -> Vec<Completion> {
    (0..CQ_SIZE)
        .map(|i| {
            let r = &regs[pick(i as usize)];
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

/// Per completion: (poll side, fill side) in ns. Fills the CQ with `fill`
/// (timed apart), then times `drain` until it reports 0.
fn measure(rounds: usize, mut fill: impl FnMut(), mut drain: impl FnMut() -> usize) -> (f64, f64) {
    let (mut polling, mut filling) = (Duration::ZERO, Duration::ZERO);
    let mut n = 0usize;
    for _ in 0..rounds {
        let start = Instant::now();
        fill();
        filling += start.elapsed();
        let start = Instant::now();
        loop {
            let got = drain();
            n += got;
            if got == 0 {
                break;
            }
        }
        polling += start.elapsed();
    }
    let per = |d: Duration| d.as_nanos() as f64 / n as f64;
    (per(polling), per(filling))
}

/// Fills `cq` with `wcs` (the push contenders' fill).
fn filler<'a>(cq: &'a SimCq, wcs: &'a [Completion]) -> impl FnMut() + 'a {
    move || cq.push_all(wcs).unwrap()
}

/// A small deterministic generator (xorshift64*), so every run draws the
/// same handlers.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        ((self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 32) as usize * n) >> 32
    }
}

/// `CQ_SIZE` completions, each for a handler of `regs` drawn at random,
/// sends and receives mixed.
fn random_completions(regs: &[Registration], rng: &mut Rng) -> Vec<Completion> {
    mixed(regs, |_| rng.below(regs.len()))
}

/// One CQ of the handler-count sweep: its CQ, poller, registrations and
/// random fills.
struct SweepCq {
    cq: SimCq,
    poller: CqPoller<NoWork>,
    handle: cqd::core::CqHandle<NoWork>,
    fills: Vec<Vec<Completion>>,
    next: usize,
    _regs: Vec<Registration>,
}

impl SweepCq {
    fn new(handlers: usize, rng: &mut Rng) -> Self {
        let (cq, src) = sim_cq("sweep", CQ_SIZE, Faults::default()).unwrap();
        let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
        let mut poller = poller.bind();
        let regs: Vec<Registration> = (0..handlers)
            .map(|_| handle.register(Count(0)).unwrap())
            .collect();
        poller.apply_commands();
        let fills = (0..SWEEP_FILLS)
            .map(|_| random_completions(&regs, rng))
            .collect();
        SweepCq {
            cq,
            poller,
            handle,
            fills,
            next: 0,
            _regs: regs,
        }
    }

    /// ns per completion over `rounds` fills, in the thread's CPU time
    /// (the machine is shared: time spent descheduled is not the
    /// dispatcher's).
    fn run(&mut self, rounds: usize, out: &mut VecDeque<Routed<NoWork>>) -> f64 {
        let (mut cpu, mut n) = (Duration::ZERO, 0usize);
        for _ in 0..rounds {
            self.cq
                .push_all(&self.fills[self.next % SWEEP_FILLS])
                .unwrap();
            self.next += 1;
            let start = thread_cpu();
            loop {
                let got = self.poller.poll_once(out).unwrap();
                n += got;
                if got == 0 {
                    break;
                }
            }
            cpu += thread_cpu() - start;
        }
        cpu.as_nanos() as f64 / n as f64
    }
}

/// The calling thread's CPU time.
fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The handler-count sweep (see the module documentation).
fn sweep(rounds: usize, reps: usize) {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let start = Instant::now();
    let mut cqs: Vec<SweepCq> = SWEEP.iter().map(|&n| SweepCq::new(n, &mut rng)).collect();
    println!(
        "handler-count sweep: set up in {:.2?} ({} registrations)",
        start.elapsed(),
        SWEEP.iter().sum::<usize>()
    );
    let mut out = VecDeque::new();
    let mut ns: Vec<Vec<f64>> = vec![Vec::new(); SWEEP.len()];
    for _ in 0..reps {
        for (cq, v) in cqs.iter_mut().zip(&mut ns) {
            v.push(cq.run(rounds, &mut out));
        }
    }
    println!("cqd dispatch by handler count, completions spread at random over all handlers, batch {BATCH}, {reps} runs × {rounds} × {CQ_SIZE} completions, thread CPU time: median [min–max]");
    println!(
        "{:>9} {:>24} {:>12} {:>12}",
        "handlers", "ns/compl", "vs 64 (med)", "vs 64 (min)"
    );
    let (base, base_lo, _) = stats(&mut ns[0]);
    for (n, v) in SWEEP.iter().zip(&mut ns) {
        let (m, lo, hi) = stats(v);
        println!(
            "{n:>9} {m:>8.2} [{lo:>5.2}–{hi:>6.2}] {:>11.2}x {:>11.2}x",
            m / base,
            lo / base_lo
        );
    }
    let worst = stats(ns.last_mut().unwrap()).0 / base;
    println!(
        "262,144 handlers / 64 handlers = {worst:.2} (medians; goal <= 3.0): {}",
        if worst <= 3.0 { "met" } else { "not met" }
    );
    for cq in &cqs {
        let snap = cq.handle.snapshot();
        assert_eq!(
            snap.stale_wr_ids + snap.foreign_wr_ids,
            0,
            "every completion was dispatched"
        );
    }
    assert!(out.is_empty());
}

/// Median, min and max.
fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let sweep_only = std::env::args().any(|a| a == "--sweep");
    if std::env::args().any(|a| a == "--width") {
        width(quick);
        return;
    }
    run(quick, sweep_only);
}

/// The whole bench (also called by `examples/bench_report`, which includes
/// this file as a module): every contender, then the handler-count sweep,
/// or the sweep alone.
pub fn run(quick: bool, sweep_only: bool) {
    let rounds = if quick { 20 } else { 400 };
    let reps = if quick { 1 } else { 5 };
    let (sweep_rounds, sweep_reps) = if quick { (4, 1) } else { (20, 15) };
    if sweep_only {
        sweep(sweep_rounds, sweep_reps);
        return;
    }

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

    // cqd dispatch with queue accounting: the same handlers' completions,
    // posted through the posting call on one loopback QP per handler, on a
    // CQ whose budget has credits.
    let budget = CqBudget::new(
        "accounted",
        CQ_SIZE,
        BudgetOptions {
            admission: false,
            credits: Some(CQ_SIZE),
        },
    );
    let ledger = WrLedger::with_budget(budget.clone());
    let (cq_a, src_a) =
        sim_cq_with_ledger("accounted", CQ_SIZE, Faults::default(), ledger.clone()).unwrap();
    let (poller_a, handle_a) = split::<NoWork>(src_a, CqOptions::default()).unwrap();
    let mut poller_a: CqPoller<NoWork> = poller_a.bind();
    let regs_a: Vec<Registration> = (0..HANDLERS)
        .map(|_| handle_a.register(Count(0)).unwrap())
        .collect();
    let qps: Vec<Loopback> = (0..HANDLERS)
        .map(|i| Loopback::new(cq_a.clone(), i as u32 + 1))
        .collect();
    let post_all = || {
        for i in 0..CQ_SIZE {
            let h = i as usize % HANDLERS;
            let (reg, qp) = (&regs_a[h], &qps[h]);
            if i % 2 == 0 {
                reg.post_send(qp, &mut [LoopWr::new(u64::from(i), OpKind::Send)])
            } else {
                reg.post_recv(
                    qp,
                    &mut [LoopWr::new(u64::from(i), OpKind::Recv).with_len(512)],
                )
            }
            .unwrap();
        }
    };

    // The same, in runs of 8 completions per queue.
    const RUN: u32 = 8;
    let post_runs = || {
        for r in 0..CQ_SIZE / RUN {
            let h = r as usize % HANDLERS;
            let (reg, qp) = (&regs_a[h], &qps[h]);
            let t = u64::from(r * RUN);
            if r % 2 == 0 {
                let mut list: [LoopWr; RUN as usize] =
                    std::array::from_fn(|i| LoopWr::new(t + i as u64, OpKind::Send));
                reg.post_send(qp, &mut list)
            } else {
                let mut list: [LoopWr; RUN as usize] =
                    std::array::from_fn(|i| LoopWr::new(t + i as u64, OpKind::Recv).with_len(512));
                reg.post_recv(qp, &mut list)
            }
            .unwrap();
        }
    };

    let names = [
        "raw poll",
        "cqd dispatch",
        "mutex map",
        "cqd dispatch with queue accounting (ledger+credits)",
        "cqd dispatch with queue accounting, runs of 8",
    ];
    let mut poll: [Vec<f64>; 5] = Default::default();
    let mut fill: [Vec<f64>; 5] = Default::default();
    for _ in 0..reps {
        let push = |cq| filler(cq, &wcs);
        let runs = [
            measure(rounds, push(&cq_r), || {
                let n = src_r.poll(&mut buf).unwrap();
                black_box(&buf[..n]);
                n
            }),
            measure(rounds, push(&cq_d), || poller.poll_once(&mut out).unwrap()),
            measure(rounds, push(&cq_m), || {
                let n = src_m.poll(&mut buf).unwrap();
                for c in &buf[..n] {
                    let key = c.wr_id >> cqd::core::wr_id::SLOT_SHIFT & cqd::core::wr_id::SLOT_MASK;
                    if let Some(cb) = map.lock().unwrap().get_mut(&key) {
                        cb(c);
                    }
                }
                n
            }),
            measure(rounds, post_all, || poller_a.poll_once(&mut out).unwrap()),
            measure(rounds, post_runs, || poller_a.poll_once(&mut out).unwrap()),
        ];
        for (i, (p, f)) in runs.into_iter().enumerate() {
            poll[i].push(p);
            fill[i].push(f);
        }
    }
    let med: Vec<(f64, f64, f64)> = poll.iter_mut().map(|v| stats(v)).collect();
    let (raw, dispatch, mutex, accounted) = (med[0].0, med[1].0, med[2].0, med[3].0);
    println!("per-completion cost, batch {BATCH}, {HANDLERS} handlers, {reps} runs × {rounds} × {CQ_SIZE} completions: median [min–max]");
    println!(
        "{:<52} {:>22} {:>12} {:>14}",
        "path", "ns/compl", "vs raw poll", "vs dispatch"
    );
    for (name, (m, lo, hi)) in names.iter().zip(&med) {
        println!(
            "{name:<52} {m:>7.2} [{lo:>5.2}–{hi:>5.2}] {:>11.2}x {:>13.2}x",
            m / raw,
            m / dispatch
        );
    }
    println!(
        "dispatch / raw = {:.2} (goal <= 2.0); mutex map / dispatch = {:.2} (goal >= 5.0); accounted / dispatch = {:.2}",
        dispatch / raw,
        mutex / dispatch,
        accounted / dispatch
    );
    let (push_m, push_lo, push_hi) = stats(&mut fill[1]);
    let (post_m, post_lo, post_hi) = stats(&mut fill[3]);
    let (list_m, list_lo, list_hi) = stats(&mut fill[4]);
    println!("post side, ns per request: push_all (no accounting) {push_m:.2} [{push_lo:.2}–{push_hi:.2}]; posting call, one request per call {post_m:.2} [{post_lo:.2}–{post_hi:.2}]; lists of 8 {list_m:.2} [{list_lo:.2}–{list_hi:.2}]");
    let snap = handle_a.snapshot();
    assert_eq!(snap.stale_wr_ids + snap.foreign_wr_ids, 0);
    assert_eq!(
        budget.snapshot().credits_in_use,
        0,
        "every credit came back"
    );
    assert_eq!(ledger.snapshot(Instant::now()).outstanding, 0);
    assert!(regs_a.iter().all(|r| r.ledger().outstanding() == 0));
    let snap = handle.snapshot();
    assert_eq!(
        snap.stale_wr_ids + snap.foreign_wr_ids,
        0,
        "every completion was dispatched"
    );
    assert!(out.is_empty());
    width(quick);
    sweep(sweep_rounds, sweep_reps);
}

/// The widths of the width axis: the number of queue pairs whose
/// completions a batch interleaves.
const WIDTHS: [usize; 4] = [1, 8, 32, 256];
/// Completions per fill on the width axis.
const WIDTH_FILL: u32 = 8_192;

/// One queue of the same-promise contender: its ring of contexts, written
/// by the poster at the tail, read by the poller at the head.
struct SpQueue {
    /// The next position the poller expects (receive) or the first not yet
    /// retired (send).
    head: u32,
    /// The next position the poster fills.
    tail: u32,
    ctx: Box<[u64]>,
    /// The handler's state.
    sum: u64,
}

/// The same-promise contender: what a careful engineer writes for one
/// server. A wr_id is `queue << 33 | side << 32 | position`; each queue
/// pair has a send and a receive queue.
struct SamePromise {
    queues: Vec<[SpQueue; 2]>,
    mask: u32,
    stale: u64,
    completions: u64,
    credits: u64,
    wcs: Vec<Completion>,
}

impl SamePromise {
    fn new(width: usize) -> Self {
        let cap = (WIDTH_FILL as usize / width).next_power_of_two();
        let queue = || SpQueue {
            head: 0,
            tail: 0,
            ctx: vec![0; cap].into_boxed_slice(),
            sum: 0,
        };
        SamePromise {
            queues: (0..width).map(|_| [queue(), queue()]).collect(),
            mask: cap as u32 - 1,
            stale: 0,
            completions: 0,
            credits: 0,
            wcs: Vec::with_capacity(WIDTH_FILL as usize),
        }
    }

    /// The poster: request `i` on queue pair `i % width`, sends and
    /// receives alternating on each; its context written at the tail, its
    /// completion (the loopback's) pushed on `cq`.
    fn post(&mut self, cq: &SimCq) {
        let width = self.queues.len();
        self.wcs.clear();
        for i in 0..WIDTH_FILL {
            let q = i as usize % width;
            let side = (i as usize / width) % 2;
            let queue = &mut self.queues[q][side];
            let p = queue.tail;
            queue.ctx[(p & self.mask) as usize] = u64::from(i);
            queue.tail = p.wrapping_add(1);
            let wr_id = (q as u64) << 33 | (side as u64) << 32 | u64::from(p);
            let mut c = if side == 0 {
                Completion::success(wr_id, Opcode::Send, q as u32 + 1)
            } else {
                Completion::success(wr_id, Opcode::Recv, q as u32 + 1)
            };
            c.byte_len = 512;
            self.wcs.push(c);
        }
        self.credits += u64::from(WIDTH_FILL);
        cq.push_all(&self.wcs).unwrap();
    }

    /// The poller: one batch.
    fn poll(&mut self, src: &mut impl CompletionSource, buf: &mut [Completion]) -> usize {
        let n = src.poll(buf).unwrap();
        let mut stale = 0;
        for c in &buf[..n] {
            let q = (c.wr_id >> 33) as usize;
            let side = (c.wr_id >> 32 & 1) as usize;
            let p = c.wr_id as u32;
            let Some(pair) = self.queues.get_mut(q) else {
                stale += 1;
                continue;
            };
            let queue = &mut pair[side];
            let mask = self.mask;
            if side == 1 {
                // Receives complete in posting order.
                if p != queue.head {
                    stale += 1;
                    continue;
                }
            } else {
                // A send's completion retires every request before it:
                // the unsignaled ones run silently.
                if p.wrapping_sub(queue.head) >= queue.tail.wrapping_sub(queue.head) {
                    stale += 1;
                    continue;
                }
                while queue.head != p {
                    queue.sum += 1;
                    queue.head = queue.head.wrapping_add(1);
                }
            }
            queue.head = p.wrapping_add(1);
            let ctx = queue.ctx[(p & mask) as usize];
            match (c.status, side) {
                (Status::Success, 0) => queue.sum += ctx,
                (Status::Success, _) => queue.sum += u64::from(c.byte_len) + ctx,
                _ => queue.sum += 1,
            }
        }
        self.completions += n as u64;
        self.credits -= n as u64;
        self.stale += stale;
        n
    }
}

/// cqd at one width: a CQ with credits, `width` loopback QPs and a handler
/// per QP, plain or with contexts.
struct CqdWidth {
    cq: SimCq,
    handle: cqd::core::CqHandle<NoWork>,
    ledger: WrLedger,
    qps: Vec<Loopback>,
    plain: Vec<Registration>,
    ctx: Vec<ContextRegistration<u64>>,
}

impl CqdWidth {
    fn new(width: usize, contexts: bool) -> (Self, CqPoller<NoWork>) {
        let budget = CqBudget::new(
            "width",
            CQ_SIZE,
            BudgetOptions {
                admission: false,
                credits: Some(CQ_SIZE),
            },
        );
        let ledger = WrLedger::with_budget(budget);
        let (cq, src) =
            sim_cq_with_ledger("width", CQ_SIZE, Faults::default(), ledger.clone()).unwrap();
        let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
        let mut poller: CqPoller<NoWork> = poller.bind();
        let (mut plain, mut ctx) = (Vec::new(), Vec::new());
        for _ in 0..width {
            if contexts {
                let cap = WIDTH_FILL / width as u32;
                ctx.push(handle.register_with_contexts(CountCtx(0), cap).unwrap());
            } else {
                plain.push(handle.register(Count(0)).unwrap());
            }
        }
        poller.apply_commands();
        let qps = (0..width)
            .map(|i| Loopback::new(cq.clone(), i as u32 + 1))
            .collect();
        let cqd = CqdWidth {
            cq,
            handle,
            ledger,
            qps,
            plain,
            ctx,
        };
        (cqd, poller)
    }

    /// The same stream as [`SamePromise::post`], through the posting call.
    fn post(&self) {
        let width = self.qps.len();
        for i in 0..WIDTH_FILL {
            let q = i as usize % width;
            let qp = &self.qps[q];
            let recv = (i as usize / width) % 2 == 1;
            let wr = if recv {
                LoopWr::new(u64::from(i), OpKind::Recv).with_len(512)
            } else {
                LoopWr::new(u64::from(i), OpKind::Send)
            };
            match (self.ctx.get(q), recv) {
                (Some(r), false) => r.post_send(qp, &mut [wr], [u64::from(i)]).map_err(drop),
                (Some(r), true) => r.post_recv(qp, &mut [wr], [u64::from(i)]).map_err(drop),
                (None, false) => self.plain[q].post_send(qp, &mut [wr]).map_err(drop),
                (None, true) => self.plain[q].post_recv(qp, &mut [wr]).map_err(drop),
            }
            .unwrap();
        }
    }

    /// Every completion delivered, every account balanced.
    fn check(&self) {
        let snap = self.handle.snapshot();
        assert_eq!(
            snap.stale_wr_ids + snap.foreign_wr_ids + snap.unmatched_wr_ids,
            0
        );
        assert_eq!(self.ledger.snapshot(Instant::now()).outstanding, 0);
        assert_eq!(self.cq.len(), 0);
        assert!(self.ctx.iter().all(|r| r.empty_hits() == 0));
    }
}

/// The width axis (see the module documentation): per-completion cost of
/// each contender at each width, and the ratios the goals are stated in.
pub fn width(quick: bool) {
    let (rounds, reps) = if quick { (2, 1) } else { (40, 9) };
    // `--widths=1,256` runs those widths only (for a profile of one).
    let only: Option<Vec<usize>> = std::env::args()
        .find_map(|a| a.strip_prefix("--widths=").map(str::to_owned))
        .map(|l| l.split(',').filter_map(|w| w.parse().ok()).collect());
    let widths: Vec<usize> = WIDTHS
        .iter()
        .copied()
        .filter(|w| only.as_ref().is_none_or(|o| o.contains(w)))
        .collect();
    let mut buf = vec![Completion::default(); BATCH];
    let mut out: VecDeque<Routed<NoWork>> = VecDeque::new();
    // [width][contender] → per-run ns per completion.
    let mut ns: Vec<[Vec<f64>; 3]> = widths.iter().map(|_| Default::default()).collect();
    for _ in 0..reps {
        for (wi, &w) in widths.iter().enumerate() {
            let (cq_s, mut src_s) = sim_cq("same-promise", CQ_SIZE, Faults::default()).unwrap();
            // The poster and the poller of the same-promise loop share its
            // queues, on this one thread.
            let sp = std::cell::RefCell::new(SamePromise::new(w));
            let (plain, mut plain_poller) = CqdWidth::new(w, false);
            let (ctx, mut ctx_poller) = CqdWidth::new(w, true);
            let runs = [
                measure(
                    rounds,
                    || sp.borrow_mut().post(&cq_s),
                    || sp.borrow_mut().poll(&mut src_s, &mut buf),
                )
                .0,
                measure(
                    rounds,
                    || plain.post(),
                    || plain_poller.poll_once(&mut out).unwrap(),
                )
                .0,
                measure(
                    rounds,
                    || ctx.post(),
                    || ctx_poller.poll_once(&mut out).unwrap(),
                )
                .0,
            ];
            let sp = sp.into_inner();
            assert_eq!(
                (sp.stale, sp.credits),
                (0, 0),
                "same-promise: every completion matched"
            );
            assert_eq!(sp.completions, u64::from(WIDTH_FILL) * rounds as u64);
            black_box(sp.queues.iter().map(|q| q[0].sum + q[1].sum).sum::<u64>());
            plain.check();
            ctx.check();
            assert!(out.is_empty());
            for (c, v) in runs.into_iter().enumerate() {
                ns[wi][c].push(v);
            }
        }
    }
    println!(
        "\nwidth axis: ns per completion, batch {BATCH}, send-recv, {reps} runs × {rounds} × {WIDTH_FILL} completions: median [min–max]"
    );
    println!(
        "{:<8} {:>24} {:>24} {:>24}",
        "width", "same-promise", "cqd", "cqd+ctx"
    );
    for (wi, w) in widths.iter().enumerate() {
        let cell = |v: &mut Vec<f64>| {
            let (m, lo, hi) = stats(v);
            format!("{m:.2} [{lo:.2}–{hi:.2}]")
        };
        let [a, b, c] = &mut ns[wi];
        println!("{w:<8} {:>24} {:>24} {:>24}", cell(a), cell(b), cell(c));
    }
    // The ratios, each the median of the runs' own.
    let ratio = |num: &[f64], den: &[f64]| {
        let mut r: Vec<f64> = num.iter().zip(den).map(|(a, b)| a / b).collect();
        stats(&mut r).0
    };
    for (wi, w) in widths.iter().enumerate() {
        let [sp, cqd, ctx] = &ns[wi];
        println!(
            "ratio cqd/same-promise width={w} stream=send-recv = {:.2}",
            ratio(cqd, sp)
        );
        println!(
            "ratio cqd+ctx/same-promise width={w} stream=send-recv = {:.2}",
            ratio(ctx, sp)
        );
    }
    if widths.len() > 1 {
        let last = widths.len() - 1;
        println!(
            "ratio flat width={}/{} stream=send-recv = {:.2}",
            widths[last],
            widths[0],
            ratio(&ns[last][1], &ns[0][1])
        );
    }
}
