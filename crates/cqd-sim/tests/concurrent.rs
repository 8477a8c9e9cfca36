//! Random schedules on the timed engine with a real poller thread, in every
//! poll mode: a poster thread, the NIC thread, and a poller whose handlers
//! hand every completion to slow workers (a sink that takes a few items at a
//! time, or none, so the poller spills). NIC faults (errors, forced QP
//! errors, delays) and CQ notification faults (dropped, spurious, delayed)
//! are on. Broken QP pairs are destroyed and replaced — their handlers
//! unregistered, their CQ reservations released once drained, new QPs
//! admitted. Every request completes exactly once, to its handler, on its
//! side; no CQ overflows; shutdown (QPs to error, drain) accounts for all.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd_core::ledger::{drain, ShutdownReport};
use cqd_core::{
    CqHandle, Failed, Handler, OpKind, Outbox, PollMode, PollerBuilder, RecvDone, Registration,
    Routed, SendDone, Side, WorkSink,
};
use cqd_sim::{
    connect, Access, Cq, CqConfig, Engine, Fabric, Faults, Mr, NicFaults, PostError, Qp, QpCap,
    QpInit, QpState, RecvWr, RemoteAddr, SendWr, TimedModel, VerbsError, WrOp,
};
use parking_lot::Mutex;

/// A completion as a worker sees it.
#[derive(Debug)]
struct Item {
    table: usize,
    tag: u32,
    kind: OpKind,
    side: Side,
    qp: u32,
}

struct Fwd(usize);

impl Handler<Item> for Fwd {
    fn on_send(&mut self, d: &SendDone<'_>, out: &mut Outbox<'_, Item>) {
        out.push(Item {
            table: self.0,
            tag: d.tag(),
            kind: d.kind(),
            side: Side::Send,
            qp: d.qp_num(),
        });
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, Item>) {
        out.push(Item {
            table: self.0,
            tag: d.tag(),
            kind: OpKind::Recv,
            side: Side::Recv,
            qp: d.qp_num(),
        });
    }
    fn on_error(&mut self, f: &Failed<'_>, out: &mut Outbox<'_, Item>) {
        out.push(Item {
            table: self.0,
            tag: f.tag(),
            kind: f.kind(),
            side: f.side(),
            qp: f.qp_num(),
        });
    }
}

/// Per handler: (kind, qp, times seen) by tag.
type Tables = Arc<Mutex<Vec<Vec<(OpKind, u32, u8)>>>>;

/// Slow workers: take 0 to 3 items per offer.
struct Slow {
    tables: Tables,
    rng: u64,
    violations: Arc<Mutex<Vec<String>>>,
}

impl WorkSink<Item> for Slow {
    fn offer(&mut self, items: &mut VecDeque<Routed<Item>>) {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let take = (self.rng % 4) as usize;
        let mut t = self.tables.lock();
        for r in items.drain(..take.min(items.len())) {
            let i = r.item;
            match t.get_mut(i.table).and_then(|t| t.get_mut(i.tag as usize)) {
                Some(e) => {
                    e.2 += 1;
                    if e.2 > 1 || e.0 != i.kind || e.0.side() != i.side || e.1 != i.qp {
                        self.violations.lock().push(format!("{i:?} vs {e:?}"));
                    }
                }
                None => self.violations.lock().push(format!("never posted: {i:?}")),
            }
        }
    }
}

struct End {
    qp: Qp,
    reg: Registration,
    table: usize,
}

const DEPTH: u32 = 16;
const PAIRS: usize = 2;

struct Poster {
    handle: CqHandle<Item>,
    cq: Cq,
    mr: Mr,
    pd: cqd_sim::Pd,
    tables: Tables,
    pairs: Vec<(End, End)>,
    retired: Vec<Registration>,
    rng: u64,
}

impl Poster {
    fn rand(&mut self, n: u64) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng % n
    }

    fn end(&self) -> Result<End, VerbsError> {
        let cap = QpCap {
            max_send_wr: DEPTH,
            max_recv_wr: DEPTH,
            max_send_sge: 1,
            max_recv_sge: 1,
        };
        let qp = self.pd.create_qp(&QpInit::new(&self.cq, &self.cq, cap))?;
        let mut t = self.tables.lock();
        let table = t.len();
        t.push(Vec::new());
        let reg = self.handle.register(Fwd(table)).expect("register");
        Ok(End { qp, reg, table })
    }

    /// A new connected pair; waits until the CQ admits it.
    fn pair(&self) -> (End, End) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match (self.end(), self.end()) {
                (Ok(a), Ok(b)) => {
                    connect(&a.qp, &b.qp).expect("connect");
                    return (a, b);
                }
                (a, b) => {
                    for e in [a, b].into_iter().flatten() {
                        self.retire(e);
                    }
                    assert!(Instant::now() < deadline, "admission never freed");
                    std::thread::sleep(Duration::from_micros(200));
                }
            }
        }
    }

    fn retire(&self, e: End) {
        self.handle.unregister(e.reg.key()).expect("unregister");
        drop(e.qp);
    }

    /// Posts one request (or a receive) on a random end; returns how many
    /// were posted.
    fn step(&mut self) -> u64 {
        let p = self.rand(PAIRS as u64) as usize;
        let flip = self.rand(2) == 1;
        let recv = self.rand(10) < 4;
        let bad = self.rand(2000) == 0;
        let op = self.rand(5);
        let force = self.rand(5000) == 0;
        let (a, b) = &self.pairs[p];
        let e = if flip { b } else { a };
        let sge = [self.mr.sge(64, 8)];
        let remote = if bad {
            RemoteAddr {
                addr: self.mr.addr(),
                rkey: self.mr.lkey(),
            }
        } else {
            self.mr.remote(128)
        };
        let (kind, wrop) = match op {
            0 => (OpKind::Send, WrOp::Send),
            1 => (OpKind::Write, WrOp::Write(remote)),
            2 => (OpKind::Write, WrOp::WriteWithImm(remote, 1)),
            3 => (OpKind::Read, WrOp::Read(remote)),
            _ => (OpKind::Atomic, WrOp::FetchAdd { remote, add: 1 }),
        };
        let kind = if recv { OpKind::Recv } else { kind };
        let mut t = self.tables.lock();
        let tag = t[e.table].len() as u32;
        t[e.table].push((kind, e.qp.qpn(), 0));
        drop(t);
        let r = if recv {
            e.reg
                .post_recv(&e.qp, &mut [RecvWr::new(u64::from(tag), &sge)])
        } else {
            e.reg
                .post_send(&e.qp, &mut [SendWr::new(u64::from(tag), wrop, &sge)])
        };
        if force {
            e.qp.force_error();
        }
        match r {
            Ok(()) => 1,
            Err(err) => {
                self.tables.lock()[e.table].pop();
                assert!(matches!(err, PostError::QueueFull { .. }), "{err}");
                std::thread::yield_now();
                0
            }
        }
    }

    fn repair(&mut self) {
        for i in 0..PAIRS {
            let (a, b) = &self.pairs[i];
            if [a, b]
                .iter()
                .any(|e| e.qp.state().ok() == Some(QpState::Err))
            {
                let fresh = self.pair();
                let (a, b) = std::mem::replace(&mut self.pairs[i], fresh);
                a.qp.force_error();
                b.qp.force_error();
                self.retired.push(a.reg.clone());
                self.retired.push(b.reg.clone());
                self.retire(a);
                self.retire(b);
            }
        }
    }
}

fn schedule(mode: PollMode, seed: u64, target: u64) {
    let model = TimedModel {
        latency: Duration::from_micros(5),
        ..TimedModel::default()
    };
    let fabric = Fabric::new(Engine::Timed(model)).unwrap();
    fabric.set_faults(NicFaults {
        error_rate: 0.001,
        qp_error_rate: 0.0005,
        delay_rate: 0.01,
        delay_by: Duration::from_micros(300),
        seed,
    });
    let dev = fabric.open_device("sim0", Default::default());
    let faults = Faults {
        spurious: 0.01,
        drop: 0.02,
        delay: 0.02,
        delay_by: Duration::from_millis(1),
        seed,
        ..Faults::default()
    };
    // Room for the live pairs plus the pairs being replaced.
    let cqe = (2 * PAIRS as u32) * 2 * DEPTH * 2;
    let (cq, poller, handle) = dev
        .create_dispatched_cq::<Item>(
            "cq",
            cqe,
            CqConfig {
                faults,
                ..CqConfig::default()
            },
            Default::default(),
        )
        .unwrap();
    let tables: Tables = Arc::default();
    let violations = Arc::new(Mutex::new(Vec::new()));
    let sink = Slow {
        tables: Arc::clone(&tables),
        rng: seed | 1,
        violations: Arc::clone(&violations),
    };
    let thread = PollerBuilder::new("p", sink)
        .mode(mode)
        .wake_timeout(Duration::from_millis(5))
        .cq(poller)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let mr = pd.reg_mr(4096, Access::ALL).unwrap();
    let mut p = Poster {
        handle,
        cq,
        mr,
        pd,
        tables: Arc::clone(&tables),
        pairs: Vec::new(),
        retired: Vec::new(),
        rng: seed | 1,
    };
    p.pairs = (0..PAIRS).map(|_| p.pair()).collect();
    let mut posted = 0;
    while posted < target {
        posted += p.step();
        if posted % 64 == 0 {
            p.repair();
        }
    }
    // Shutdown: stop posting, flush, drain to a full account.
    for (a, b) in &p.pairs {
        a.qp.force_error();
        b.qp.force_error();
    }
    let regs: Vec<Registration> = p
        .pairs
        .iter()
        .flat_map(|(a, b)| [a.reg.clone(), b.reg.clone()])
        .chain(p.retired.iter().cloned())
        .collect();
    let handlers: Vec<_> = regs.iter().map(|r| (r.key(), r.ledger())).collect();
    let report: ShutdownReport = drain(&handlers, None, Duration::from_secs(20), || {
        std::thread::sleep(Duration::from_millis(1))
    });
    assert!(report.is_balanced(), "mode {}: {report}", mode.name());
    let final_report = thread.stop().unwrap();
    let v = violations.lock();
    assert!(v.is_empty(), "{:?}", &v[..v.len().min(5)]);
    let t = tables.lock();
    let mut n = 0;
    for (h, table) in t.iter().enumerate() {
        for (tag, e) in table.iter().enumerate() {
            assert_eq!(e.2, 1, "mode {}: handler {h} tag {tag} {e:?}", mode.name());
            n += 1;
        }
    }
    assert!(n >= target);
    let cqs = &final_report.cqs[0];
    assert_eq!(
        (cqs.overflows, cqs.stale_wr_ids, cqs.handler_panics),
        (0, 0, 0),
        "{cqs:?}"
    );
    assert_eq!(p.cq.budget_snapshot().overflows, 0);
    assert!(
        final_report.poller.spills > 0,
        "the slow workers made the poller spill"
    );
    assert_eq!(final_report.undelivered, 0);
    let stats = fabric.stats();
    assert!(
        stats.errors + stats.flushed > 0 && stats.delayed > 0,
        "{stats:?}"
    );
    assert!(!p.retired.is_empty(), "broken pairs were replaced");
    eprintln!(
        "mode {}: {n} WRs, {} pairs replaced, {stats:?}, spills {}",
        mode.name(),
        p.retired.len() / 2,
        final_report.poller.spills
    );
}

#[test]
fn random_schedules_with_slow_workers_in_every_poll_mode() {
    for (i, mode) in PollMode::all().into_iter().enumerate() {
        schedule(mode, 0xc0ffee + i as u64, 25_000);
    }
}
