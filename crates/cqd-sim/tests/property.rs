//! Random schedules of posts (every operation, signaled and unsignaled),
//! errors (bad keys, short receives, RNR), QPs forced to error, NIC faults
//! (injected errors, forced QP errors, delayed requests) and a slow poller,
//! over at least 1,000,000 work requests: every request completes exactly
//! once, to the handler that posted it, on the right side and QP — or, for a
//! successful unsignaled send, silently, and the NIC's count of executed
//! requests balances that to the request. With admission on, no CQ
//! overflows.
//!
//! The default test runs 1,000,000 requests (about 20 s in debug on two
//! cores); proptest runs many shorter schedules from random seeds.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd_core::budget::BudgetOptions;
use cqd_core::{
    CqHandle, CqOptions, CqPoller, Failed, Handler, NoWork, OpKind, Outbox, RecvDone, Registration,
    SendDone, Side,
};
use cqd_sim::{
    connect_with, Access, Cq, CqConfig, Fabric, Modify, Mr, NicFaults, PostError, Qp, QpCap,
    QpInit, QpState, RecvWr, RemoteAddr, SendWr, Sge, Srq, WrOp,
};
use parking_lot::Mutex;
use proptest::prelude::*;

#[derive(Clone, Copy)]
struct Expect {
    kind: OpKind,
    qp: u32,
    signaled: bool,
    seen: u8,
}

#[derive(Default)]
struct Table {
    wrs: Vec<Expect>,
    violations: Vec<String>,
    ok_signaled_sends: u64,
    completions: u64,
}

impl Table {
    fn check(&mut self, tag: u32, kind: OpKind, side: Side, qp: u32) {
        self.completions += 1;
        let Some(e) = self.wrs.get_mut(tag as usize) else {
            self.violations
                .push(format!("tag {tag} never posted by this handler"));
            return;
        };
        e.seen += 1;
        if e.seen > 1 || e.kind != kind || e.kind.side() != side || (e.qp != SRQ_USER && e.qp != qp)
        {
            self.violations.push(format!(
                "tag {tag}: seen {} times, kind {kind:?}/{:?}, side {side:?}, qp {qp}/{}",
                e.seen, e.kind, e.qp
            ));
        }
    }
}

struct Checker(Arc<Mutex<Table>>);

impl Handler for Checker {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let mut t = self.0.lock();
        t.ok_signaled_sends += 1;
        t.check(d.tag(), d.kind(), Side::Send, d.qp_num());
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0
            .lock()
            .check(d.tag(), OpKind::Recv, Side::Recv, d.qp_num());
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.lock().check(f.tag(), f.kind(), f.side(), f.qp_num());
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

struct End {
    qp: Qp,
    reg: Registration,
    table: Arc<Mutex<Table>>,
    mr: Mr,
}

struct World {
    credits: bool,
    fabric: Fabric,
    srq: Srq,
    pairs: Vec<(End, End)>,
    pollers: Vec<CqPoller<NoWork>>,
    handles: Vec<CqHandle<NoWork>>,
    cqs: Vec<Cq>,
    rng: Rng,
    posted: u64,
    unsignaled: u64,
    out: VecDeque<cqd_core::Routed<NoWork>>,
}

const PAIRS: usize = 4;
const DEPTH: u32 = 32;
const BUF: u64 = 256;
const SRQ_DEPTH: u32 = 64;
/// The expected QP of a receive posted to the SRQ: any of its users.
const SRQ_USER: u32 = 0;

fn world(seed: u64, credits: bool) -> World {
    let fabric = Fabric::inline();
    fabric.set_faults(NicFaults {
        error_rate: 0.0005,
        qp_error_rate: 0.0003,
        delay_rate: 0.002,
        delay_by: Duration::from_micros(200),
        seed,
    });
    let dev = fabric.open_device("sim0", Default::default());
    let cap = QpCap {
        max_send_wr: DEPTH,
        max_recv_wr: DEPTH,
        max_send_sge: 2,
        max_recv_sge: 2,
    };
    // Exactly the admitted sizes, the tightest admission allows: the a side
    // has send and receive queues, the b side send queues and one SRQ
    // (counted once).
    let mut cqs = Vec::new();
    let mut pollers = Vec::new();
    let mut handles = Vec::new();
    //
    // With credits: a deliberately oversubscribed design. Admission is off,
    // each CQ holds half of what its queues could produce, and credits (as
    // many as the CQ holds, less the SRQ's depth: SRQ receives take none)
    // keep it from overflowing.
    let half = PAIRS as u32 * DEPTH / 2;
    for (name, cqe, limit) in [
        ("a", PAIRS as u32 * 2 * DEPTH, 2 * half),
        ("b", PAIRS as u32 * DEPTH + SRQ_DEPTH, half),
    ] {
        let (cqe, budget) = if credits {
            let opts = BudgetOptions {
                admission: false,
                credits: Some(limit),
            };
            (cqe / 2 + if name == "b" { SRQ_DEPTH / 2 } else { 0 }, opts)
        } else {
            (cqe, BudgetOptions::default())
        };
        let config = CqConfig {
            budget,
            ..CqConfig::default()
        };
        let (cq, p, h) = dev
            .create_dispatched_cq::<NoWork>(
                name,
                cqe,
                config,
                CqOptions {
                    batch: 16,
                    ..CqOptions::default()
                },
            )
            .unwrap();
        cqs.push(cq);
        pollers.push(p.bind());
        handles.push(h);
    }
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(SRQ_DEPTH, 2).unwrap();
    let end = |i: usize| {
        let init = QpInit::new(&cqs[i], &cqs[i], cap);
        let init = if i == 1 { init.with_srq(&srq) } else { init };
        let qp = pd.create_qp(&init).unwrap();
        let table = Arc::new(Mutex::new(Table::default()));
        let checker = Checker(Arc::clone(&table));
        let reg = handles[i].register(checker).unwrap();
        let mr = pd.reg_mr(BUF * 2, Access::ALL).unwrap();
        End { qp, reg, table, mr }
    };
    let pairs: Vec<_> = (0..PAIRS)
        .map(|_| {
            let (a, b) = (end(0), end(1));
            connect_with(&a.qp, &b.qp, 7).unwrap();
            (a, b)
        })
        .collect();
    World {
        credits,
        fabric,
        srq,
        pairs,
        pollers,
        handles,
        cqs,
        rng: Rng(seed | 1),
        posted: 0,
        unsignaled: 0,
        out: VecDeque::new(),
    }
}

impl World {
    fn poll(&mut self, all: bool) {
        for p in &mut self.pollers {
            loop {
                let n = p.poll_once(&mut self.out).unwrap();
                if n == 0 || !all {
                    break;
                }
            }
        }
    }

    /// Posts and records; a refused post is forgotten.
    fn post_recvs(&mut self, pair: usize, side_b: bool) {
        let n = 1 + self.rng.below(4) as usize;
        let short = self.rng.chance(2);
        let (p, _) = &self.pairs[pair];
        let e = if side_b { &self.pairs[pair].1 } else { p };
        let len = if short { 1 } else { 64 };
        let sges: Vec<[Sge; 1]> = (0..n)
            .map(|i| [e.mr.sge(BUF + 64 * (i as u64 % 2), len)])
            .collect();
        let mut t = e.table.lock();
        let first = t.wrs.len() as u32;
        let mut wrs: Vec<RecvWr<'_>> = sges
            .iter()
            .enumerate()
            .map(|(i, s)| RecvWr::new(u64::from(first) + i as u64, s))
            .collect();
        let r = if side_b {
            e.reg.post_recv(&self.srq, &mut wrs)
        } else {
            e.reg.post_recv(&e.qp, &mut wrs)
        };
        match r {
            Ok(()) => {
                let qp = if side_b { SRQ_USER } else { e.qp.qpn() };
                t.wrs.extend((0..n).map(|_| Expect {
                    kind: OpKind::Recv,
                    qp,
                    signaled: true,
                    seen: 0,
                }));
                self.posted += n as u64;
            }
            Err(err) => {
                assert!(
                    matches!(
                        err,
                        PostError::QueueFull { .. }
                            | PostError::WrongState { .. }
                            | PostError::Credits(_)
                    ),
                    "{err}"
                );
            }
        }
    }

    fn post_sends(&mut self, pair: usize, side_b: bool) {
        let n = 1 + self.rng.below(4) as usize;
        let (a, b) = &self.pairs[pair];
        let (e, peer) = if side_b { (b, a) } else { (a, b) };
        let mut ops = Vec::with_capacity(n);
        for _ in 0..n {
            let r = &mut self.rng;
            let mut remote = peer.mr.remote(8 * r.below(BUF / 8 - 1));
            let mut local = e.mr.sge(8 * r.below(8), 8);
            if r.chance(1) {
                remote = RemoteAddr {
                    addr: remote.addr,
                    rkey: peer.mr.lkey(),
                };
            }
            if r.chance(1) {
                local.lkey = e.mr.rkey();
            }
            let (kind, op) = match r.below(7) {
                0 => (OpKind::Send, WrOp::Send),
                1 => (OpKind::Send, WrOp::SendWithImm(r.next() as u32)),
                2 => (OpKind::Write, WrOp::Write(remote)),
                3 => (OpKind::Write, WrOp::WriteWithImm(remote, 5)),
                4 => (OpKind::Read, WrOp::Read(remote)),
                5 => (OpKind::Atomic, WrOp::FetchAdd { remote, add: 1 }),
                _ => (
                    OpKind::Atomic,
                    WrOp::CompareSwap {
                        remote,
                        compare: 0,
                        swap: 1,
                    },
                ),
            };
            let signaled = !r.chance(250);
            ops.push((kind, op, [local], signaled));
        }
        let mut t = e.table.lock();
        let first = t.wrs.len() as u32;
        let mut wrs: Vec<SendWr<'_>> = ops
            .iter()
            .enumerate()
            .map(|(i, (_, op, sge, signaled))| {
                let wr = SendWr::new(u64::from(first) + i as u64, *op, sge);
                if *signaled {
                    wr
                } else {
                    wr.unsignaled()
                }
            })
            .collect();
        let qp = e.qp.qpn();
        // Record before posting: the inline engine completes inside the call.
        t.wrs
            .extend(ops.iter().map(|(kind, _, _, signaled)| Expect {
                kind: *kind,
                qp,
                signaled: *signaled,
                seen: 0,
            }));
        drop(t);
        match e.reg.post_send(&e.qp, &mut wrs) {
            Ok(()) => {
                self.posted += n as u64;
                self.unsignaled += ops.iter().filter(|o| !o.3).count() as u64;
            }
            Err(err) => {
                let mut t = e.table.lock();
                t.wrs.truncate(first as usize);
                assert!(
                    matches!(
                        err,
                        PostError::QueueFull { .. }
                            | PostError::WrongState { .. }
                            | PostError::Credits(_)
                    ),
                    "{err}"
                );
            }
        }
    }

    /// A pair with a QP in error: both to error, drain, reset, reconnect.
    fn repair(&mut self) {
        for i in 0..self.pairs.len() {
            let (a, b) = &self.pairs[i];
            let broken = [a, b].iter().any(|e| e.qp.state().unwrap() == QpState::Err);
            if !broken {
                continue;
            }
            a.qp.force_error();
            b.qp.force_error();
            self.poll(true);
            let (a, b) = &self.pairs[i];
            a.qp.modify(Modify::Reset).unwrap();
            b.qp.modify(Modify::Reset).unwrap();
            let rnr = if self.rng.chance(300) { 0 } else { 7 };
            connect_with(&a.qp, &b.qp, rnr).unwrap();
        }
    }

    fn step(&mut self) {
        let pair = self.rng.below(PAIRS as u64) as usize;
        let side_b = self.rng.chance(500);
        match self.rng.below(100) {
            0..=39 => self.post_recvs(pair, side_b),
            40..=97 => self.post_sends(pair, side_b),
            _ if self.rng.chance(30) => {
                let (a, b) = &self.pairs[pair];
                if side_b {
                    b.qp.force_error()
                } else {
                    a.qp.force_error()
                }
            }
            _ => {}
        }
        // A slow poller: not every step.
        if self.rng.chance(if self.credits { 30 } else { 600 }) {
            self.poll(false);
        }
        if self.rng.chance(20) {
            self.fabric.progress();
        }
        if self.rng.chance(50) {
            self.repair();
        }
    }

    /// Shutdown: every QP to error, poll until nothing is outstanding
    /// except silent unsignaled successes, then check every account.
    fn finish(mut self) -> u64 {
        std::thread::sleep(Duration::from_millis(1));
        self.fabric.progress();
        for (a, b) in &self.pairs {
            a.qp.force_error();
            b.qp.force_error();
        }
        self.poll(true);
        assert!(self.fabric.is_idle());
        let stats = self.fabric.stats();
        let mut ok_signaled = 0;
        let mut silent_expected = 0u64;
        let mut in_srq = 0u64;
        let mut outstanding = 0;
        for (a, b) in &self.pairs {
            for e in [a, b] {
                let t = e.table.lock();
                assert!(
                    t.violations.is_empty(),
                    "{:?}",
                    &t.violations[..t.violations.len().min(5)]
                );
                ok_signaled += t.ok_signaled_sends;
                for (tag, x) in t.wrs.iter().enumerate() {
                    if x.qp == SRQ_USER && x.seen == 0 {
                        in_srq += 1; // SRQ receives are not flushed with a QP
                    } else if x.kind == OpKind::Recv || x.signaled {
                        assert_eq!(x.seen, 1, "tag {tag} {:?} on QP {}", x.kind, x.qp);
                    } else if x.seen == 0 {
                        silent_expected += 1;
                    }
                }
                outstanding += e.reg.ledger().outstanding();
            }
        }
        // Every unsignaled request without a completion executed successfully.
        assert_eq!(stats.executed - ok_signaled, silent_expected, "{stats:?}");
        assert_eq!(
            in_srq,
            self.srq.available() as u64,
            "unconsumed receives are still in the SRQ"
        );
        // A silent success counts completed once a later completion of its
        // send queue retires it; what the handlers still count outstanding
        // is exactly what the queue accounts still hold: silent ones at
        // the tail of a send queue, and receives still in the SRQ.
        let held: u64 = self
            .cqs
            .iter()
            .map(|cq| cq.ledger().snapshot(Instant::now()).outstanding)
            .sum();
        assert_eq!(outstanding, held, "handler ledgers agree with the queues");
        assert!(
            outstanding <= silent_expected + in_srq && outstanding >= in_srq,
            "outstanding {outstanding}: at most the silent ones and those in the SRQ"
        );
        for (h, cq) in self.handles.iter().zip(&self.cqs) {
            let s = h.snapshot();
            assert_eq!(
                (
                    s.overflows,
                    s.handler_panics,
                    s.stale_wr_ids,
                    s.foreign_wr_ids
                ),
                (0, 0, 0, 0)
            );
            assert_eq!(cq.budget_snapshot().overflows, 0);
        }
        assert_eq!(stats.lost, 0);
        if self.credits {
            let b: Vec<_> = self.cqs.iter().map(Cq::budget_snapshot).collect();
            assert!(
                b.iter().all(|s| s.reserved > u64::from(s.capacity)),
                "oversubscribed: {b:?}"
            );
            assert!(
                b.iter().any(|s| s.would_overflow > 0),
                "credits refused posts: {b:?}"
            );
        }
        self.posted
    }
}

fn run(seed: u64, target: u64) -> (u64, cqd_sim::NicStats) {
    run_with(seed, target, false)
}

fn run_with(seed: u64, target: u64, credits: bool) -> (u64, cqd_sim::NicStats) {
    let mut w = world(seed, credits);
    while w.posted < target {
        w.step();
    }
    let stats = w.fabric.stats();
    (w.finish(), stats)
}

#[test]
fn a_million_work_requests_each_complete_exactly_once() {
    let start = Instant::now();
    let (posted, stats) = run(0x5eed, 1_000_000);
    assert!(posted >= 1_000_000);
    // The schedule did exercise every path.
    assert!(
        stats.errors > 100 && stats.flushed > 1000 && stats.injected_errors > 10,
        "{stats:?}"
    );
    assert!(
        stats.forced_qp_errors > 10 && stats.delayed > 100,
        "{stats:?}"
    );
    eprintln!("{posted} WRs in {:?}: {stats:?}", start.elapsed());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, failure_persistence: None, ..ProptestConfig::default() })]
    #[test]
    fn random_schedules_complete_exactly_once(seed in any::<u64>(), credits in any::<bool>()) {
        let (posted, _) = run_with(seed, 20_000, credits);
        prop_assert!(posted >= 20_000);
    }
}

#[test]
fn credits_keep_an_oversubscribed_design_from_overflowing() {
    let (posted, stats) = run_with(0xc4ed17, 300_000, true);
    assert!(posted >= 300_000);
    assert_eq!(stats.lost, 0);
}
