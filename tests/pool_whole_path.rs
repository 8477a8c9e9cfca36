//! The whole path: simulated CQs → 2 poller threads → handlers → their
//! outboxes → a pool of 3 workers (more threads than this 2-CPU box has, on
//! purpose) → the work function. Every work item is handled exactly once,
//! per-key order holds, and stopping (pollers first, then the pool) loses
//! nothing. Runs in every poll mode; the topology comes from a validated
//! config, as a server's would.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use common::wait_until;
use cqd::core::pool::Work;
use cqd::core::topology::{ModeConfig, PollerConfig, PoolConfig, TopologyConfig};
use cqd::core::{
    split, Completion, Failed, Handler, OpKind, Opcode, Outbox, RecvDone, Route, SendDone,
};
use cqd::sim::{sim_cq, Faults, SimCq};

const CONNS: u64 = 16;

/// One unit of work: which connection, its sequence number on that
/// connection, and a unique id.
#[derive(Debug)]
struct Job {
    conn: u64,
    seq: u64,
    id: usize,
}

/// A connection's handler: numbers its receives and hands each to a worker.
struct Conn {
    conn: u64,
    base: usize,
    seq: u64,
    dispatched: Arc<AtomicU64>,
}

impl Handler<Job> for Conn {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, Job>) {}
    fn on_recv(&mut self, done: &RecvDone<'_>, out: &mut Outbox<'_, Job>) {
        self.seq += 1;
        out.push(Job {
            conn: self.conn,
            seq: self.seq,
            id: self.base + done.tag() as usize,
        });
        self.dispatched.fetch_add(1, Relaxed);
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, Job>) {}
}

/// The work function: counts each id, checks per-connection order, and is
/// slow now and then when asked to be.
struct Worker {
    seen: Arc<Vec<AtomicU8>>,
    handled: Arc<AtomicU64>,
    out_of_order: Arc<AtomicU64>,
    last: HashMap<u64, u64>,
    slow_every: usize,
}

impl Work<Job> for Worker {
    fn run(&mut self, job: Job) {
        self.seen[job.id].fetch_add(1, Relaxed);
        let last = self.last.entry(job.conn).or_insert(0);
        if job.seq != *last + 1 {
            self.out_of_order.fetch_add(1, Relaxed);
        }
        *last = job.seq;
        if self.slow_every > 0 && job.id % self.slow_every == 0 {
            std::thread::sleep(Duration::from_micros(500));
        }
        self.handled.fetch_add(1, Relaxed);
    }
}

/// Pushes without overflowing the CQ, as a sender holding CQ credits would.
fn push_paced(cq: &SimCq, wc: Completion) {
    while cq.len() + 1 >= cq.capacity() as usize {
        std::thread::yield_now();
    }
    cq.push(wc, false).unwrap();
}

struct Outcome {
    spills: u64,
    spill_high_water: u64,
    refused: u64,
}

fn whole_path(mode: ModeConfig, per_cq: usize, slow_every: usize, capacity: usize) -> Outcome {
    let total = 2 * per_cq;
    let mut topology = TopologyConfig::new()
        .poller(PollerConfig::new("a").cq("cq-a").pool("io").mode(mode))
        .poller(PollerConfig::new("b").cq("cq-b").pool("io").mode(mode))
        .pool(PoolConfig::new("io", 3).capacity(capacity))
        .validate()
        .unwrap();

    let seen: Arc<Vec<AtomicU8>> = Arc::new((0..total).map(|_| AtomicU8::new(0)).collect());
    let handled = Arc::new(AtomicU64::new(0));
    let out_of_order = Arc::new(AtomicU64::new(0));
    let (pool, mut feeds) = topology
        .take_pool("io")
        .unwrap()
        .spawn_feeds(|_| Worker {
            seen: seen.clone(),
            handled: handled.clone(),
            out_of_order: out_of_order.clone(),
            last: HashMap::new(),
            slow_every,
        })
        .unwrap();

    let dispatched = Arc::new(AtomicU64::new(0));
    let mut pollers = Vec::new();
    let mut feeders = Vec::new();
    for (i, plan) in topology.take_pollers().into_iter().enumerate() {
        let (sim, source) = sim_cq(plan.cqs()[0].clone(), 4096, Faults::default()).unwrap();
        let (cq, handle) = split(source, plan.cq_options()).unwrap();
        let regs: Vec<_> = (0..CONNS)
            .map(|c| {
                let conn = i as u64 * CONNS + c;
                let handler = Conn {
                    conn,
                    base: i * per_cq,
                    seq: 0,
                    dispatched: dispatched.clone(),
                };
                handle
                    .register_routed(handler, Some(Route::Key(conn)))
                    .unwrap()
            })
            .collect();
        let name = plan.name().to_string();
        let thread = plan
            .poller_builder_fed(&mut feeds)
            .unwrap()
            .cq(cq)
            .spawn()
            .unwrap();
        assert_eq!(thread.name(), name, "the topology's name");
        pollers.push(thread);
        feeders.push(std::thread::spawn(move || {
            for tag in 0..per_cq {
                let reg = &regs[tag % CONNS as usize];
                let wr_id = reg.wr_id(OpKind::Recv, tag as u32).unwrap();
                push_paced(&sim, Completion::success(wr_id, Opcode::Recv, 64));
            }
            (sim, handle)
        }));
    }
    let keep: Vec<_> = feeders.into_iter().map(|f| f.join().unwrap()).collect();
    assert!(
        wait_until(Duration::from_secs(300), || dispatched.load(Relaxed)
            == total as u64),
        "dispatched {} of {total}",
        dispatched.load(Relaxed)
    );
    // Stop, as one protocol: pollers first (each drains, accounts, hands
    // over its spill and drops its sink), then the workers finish everything
    // handed to them and join.
    let report = cqd::core::shutdown(|| {}, pollers, [pool]);
    assert!(report.is_clean(), "{:?}", report.errors);
    assert_eq!(report.pollers.len(), 2);
    let spills = report.pollers.iter().map(|r| r.poller.spills).sum();
    let spill_high_water = report
        .pollers
        .iter()
        .map(|r| r.poller.spill_high_water)
        .max()
        .unwrap_or(0);
    for r in &report.pollers {
        assert_eq!(r.undelivered, 0, "{r:?}");
    }
    drop(keep);
    let snapshot = report.pools[0].clone();
    let wrong: Vec<_> = seen
        .iter()
        .enumerate()
        .filter(|(_, n)| n.load(Relaxed) != 1)
        .take(5)
        .map(|(id, n)| (id, n.load(Relaxed)))
        .collect();
    assert!(wrong.is_empty(), "not exactly once (id, times): {wrong:?}");
    assert_eq!(handled.load(Relaxed), total as u64);
    assert_eq!(out_of_order.load(Relaxed), 0, "per-key order broken");
    assert_eq!(snapshot.items(), total as u64);
    assert_eq!(snapshot.workers.len(), 3);
    Outcome {
        spills,
        spill_high_water,
        refused: snapshot.sinks.iter().map(|s| s.refused).sum(),
    }
}

fn modes() -> [ModeConfig; 4] {
    [
        ModeConfig::Busy,
        ModeConfig::Event { timeout_ms: 100 },
        ModeConfig::Hybrid {
            spin_window_us: 50,
            timeout_ms: 100,
        },
        ModeConfig::default(),
    ]
}

/// The test: 1,000,000 completions over 2 pollers into 3 workers.
#[test]
fn a_million_completions_two_pollers_three_workers_exactly_once() {
    whole_path(ModeConfig::default(), 500_000, 0, 1024);
}

/// The same path in every poll mode, on fewer completions.
#[test]
fn whole_path_in_every_mode() {
    for mode in modes() {
        whole_path(mode, 50_000, 0, 1024);
    }
}

/// Slow workers (injected sleeps) and small rings: the pollers spill up to
/// their high-water mark, then leave the completions in their CQs until the
/// workers catch up (the feeders wait on the CQs meanwhile), and lose
/// nothing.
#[test]
fn slow_workers_make_the_pollers_spill_not_block() {
    for mode in modes() {
        let outcome = whole_path(mode, 20_000, 100, 16);
        assert!(outcome.spills > 0, "{mode:?}: no spill counted");
        assert!(outcome.spill_high_water > 0, "{mode:?}");
        assert!(outcome.refused > 0, "{mode:?}");
    }
}
