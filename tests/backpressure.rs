//! Back-pressure from the workers to the CQs: the spill is bounded by the
//! poller's high-water mark, a poller with a spill sleeps (never spins)
//! until a worker frees ring space, each spilled item counts once, a stop
//! hands back what the sink never took, and a pool kept open by a live sink
//! cannot hang `shutdown`.

mod common;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use common::wait_until;
use cqd::core::budget::{BudgetOptions, CqBudget};
use cqd::core::pool::{Pool, PoolSink, Work};
use cqd::core::topology::{PoolConfig, TopologyConfig};
use cqd::core::{
    shutdown_with, split, Adaptive, Completion, CqHandle, CqOptions, Failed, Handler, OpKind,
    Opcode, Outbox, PollMode, PollerBuilder, RecvDone, Registration, Route, Routed, SendDone,
    ShutdownOptions, WorkSink,
};
use cqd::core::{Refused, WrLedger};
use cqd::sim::{sim_cq_with_ledger, Faults, LoopWr, Loopback, LoopbackError, SimCq};

/// One unit of work: its connection, its sequence number there, a unique id.
#[derive(Debug)]
struct Job {
    conn: u64,
    seq: u64,
    id: usize,
}

/// A connection's handler: emits `per` jobs per receive, numbered.
struct Conn {
    conn: u64,
    seq: u64,
    per: usize,
}

impl Handler<Job> for Conn {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, Job>) {}
    fn on_recv(&mut self, done: &RecvDone<'_>, out: &mut Outbox<'_, Job>) {
        for k in 0..self.per {
            self.seq += 1;
            out.push(Job {
                conn: self.conn,
                seq: self.seq,
                id: done.tag() as usize * self.per + k,
            });
        }
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, Job>) {}
}

/// A gate the workers wait at while it is closed.
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    fn set(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.changed.notify_all();
    }
    fn pass(&self) {
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.changed.wait(closed).unwrap();
        }
    }
}

/// What the workers saw: every id's count, order per connection.
struct Seen {
    ids: Vec<AtomicU8>,
    handled: AtomicU64,
    out_of_order: AtomicU64,
}

impl Seen {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Seen {
            ids: (0..n).map(|_| AtomicU8::new(0)).collect(),
            handled: AtomicU64::new(0),
            out_of_order: AtomicU64::new(0),
        })
    }

    /// Every id handled exactly once, in order per connection.
    fn check(&self) {
        let wrong: Vec<_> = (self.ids.iter().enumerate())
            .filter(|(_, n)| n.load(Relaxed) != 1)
            .take(5)
            .map(|(id, n)| (id, n.load(Relaxed)))
            .collect();
        assert!(wrong.is_empty(), "not exactly once (id, times): {wrong:?}");
        assert_eq!(self.out_of_order.load(Relaxed), 0, "per-key order broken");
    }
}

struct Worker {
    seen: Arc<Seen>,
    gate: Arc<Gate>,
    last: HashMap<u64, u64>,
    pause: Duration,
}

impl Work<Job> for Worker {
    fn run(&mut self, job: Job) {
        self.gate.pass();
        self.seen.ids[job.id].fetch_add(1, Relaxed);
        let last = self.last.entry(job.conn).or_insert(0);
        if job.seq != *last + 1 {
            self.seen.out_of_order.fetch_add(1, Relaxed);
        }
        *last = job.seq;
        if !self.pause.is_zero() {
            std::thread::sleep(self.pause);
        }
        self.seen.handled.fetch_add(1, Relaxed);
    }
}

/// A pool of `workers` workers with rings of `capacity`, fed by `sinks`
/// producers.
fn pool(
    workers: usize,
    capacity: usize,
    sinks: usize,
    seen: &Arc<Seen>,
    gate: &Arc<Gate>,
    pause: Duration,
) -> (Pool, Vec<PoolSink<Job>>) {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("bp", workers).capacity(capacity))
        .validate()
        .unwrap();
    topology
        .take_pool("bp")
        .unwrap()
        .spawn(sinks, |_| Worker {
            seen: seen.clone(),
            gate: gate.clone(),
            last: HashMap::new(),
            pause,
        })
        .unwrap()
}

/// A simulated CQ of `capacity` entries with `conns` connections
/// registered, each emitting `per` jobs per receive.
fn cq(
    capacity: u32,
    conns: u64,
    per: usize,
) -> (
    SimCq,
    cqd::core::UnboundCq<Job>,
    CqHandle<Job>,
    Vec<Registration>,
) {
    cq_from(capacity, 0, conns, per, WrLedger::new())
}

/// As [`cq`], with connection keys `first..first + conns`, on `ledger`.
fn cq_from(
    capacity: u32,
    first: u64,
    conns: u64,
    per: usize,
    ledger: WrLedger,
) -> (
    SimCq,
    cqd::core::UnboundCq<Job>,
    CqHandle<Job>,
    Vec<Registration>,
) {
    let (sim, source) = sim_cq_with_ledger("bp", capacity, Faults::default(), ledger).unwrap();
    let (poller, handle) = split(source, CqOptions::default()).unwrap();
    let regs = (first..first + conns)
        .map(|conn| {
            handle
                .register_routed(Conn { conn, seq: 0, per }, Some(Route::Key(conn)))
                .unwrap()
        })
        .collect();
    (sim, poller, handle, regs)
}

/// Pushes receives `0..n` and waits until the poller holds all their work
/// as spill (its sink takes nothing).
fn spill_all(sim: &SimCq, regs: &[Registration], poller: &cqd::core::PollerThread, n: usize) {
    for tag in 0..n {
        sim.push(recv(regs, tag), false).unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(10), || poller.snapshot().spill_len
            == n as u64),
        "the spill never held {n} items"
    );
}

/// Receive completion `tag` of connection `tag % conns`.
fn recv(regs: &[Registration], tag: usize) -> Completion {
    let conn = tag % regs.len();
    let reg = &regs[conn];
    reg.track(OpKind::Recv, 1);
    let mut wc = Completion::success(
        reg.wr_id(OpKind::Recv, tag as u32).unwrap(),
        Opcode::Recv,
        64,
    );
    wc.qp_num = conn as u32 + 1;
    wc
}

fn sleeping_modes() -> [PollMode; 3] {
    [
        PollMode::Event,
        PollMode::Hybrid {
            spin: Duration::from_micros(50),
        },
        PollMode::Adaptive(Adaptive::default()),
    ]
}

// ---- Item: the bound ------------------------------------------------------

const BATCH: u64 = 32;

/// Fully admitted 64-entry CQs whose posters hold credits, handlers that
/// emit two jobs per completion, two slow workers with 4-slot rings: the
/// spill never exceeds mark + m × batch × CQs, the poller did throttle, no
/// CQ overflowed, and every job arrives once, in order per key.
fn spill_is_bounded(mode: PollMode) {
    bounded_with(mode, 1);
    bounded_with(mode, 2);
}

fn bounded_with(mode: PollMode, cqs: usize) {
    const MARK: usize = 16;
    const PER: usize = 2;
    const TOTAL: usize = 3000;
    const CONNS: u64 = 8;
    let seen = Seen::new(cqs * TOTAL * PER);
    let gate = Arc::new(Gate::default());
    let (pool, mut sinks) = pool(2, 4, 1, &seen, &gate, Duration::from_micros(20));
    let mut builder = PollerBuilder::new("bound", sinks.pop().unwrap())
        .mode(mode)
        .spill_high_water_mark(MARK);
    let mut posters = Vec::new();
    let mut budgets = Vec::new();
    for c in 0..cqs {
        let budget = CqBudget::new(
            "bp",
            64,
            BudgetOptions {
                admission: true,
                credits: Some(64),
            },
        );
        let admitted = budget.admit("conns", 64).unwrap();
        // One loopback QP per connection, on the CQ's ledger (which takes
        // credits from the budget); split attached both.
        let ledger = WrLedger::with_budget(budget.clone());
        let (sim, cq, handle, regs) = cq_from(64, c as u64 * CONNS, CONNS, PER, ledger);
        let qps: Vec<Loopback> = (0..CONNS)
            .map(|conn| Loopback::new(sim.clone(), conn as u32 + 1))
            .collect();
        builder = builder.cq(cq);
        budgets.push(budget.clone());
        // The posters: the posting call takes a credit per receive; they
        // wait (not fail) when none is left, as a server's would.
        posters.push(std::thread::spawn(move || {
            for tag in c * TOTAL..(c + 1) * TOTAL {
                let conn = tag % CONNS as usize;
                let mut wr = [LoopWr::new(tag as u64, OpKind::Recv)];
                while let Err(e) = regs[conn].post_recv(&qps[conn], &mut wr) {
                    assert!(
                        matches!(e, LoopbackError::Refused(Refused::Credits(_))),
                        "{e}"
                    );
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
            (sim, handle, admitted, qps)
        }));
    }
    let poller = builder.spawn().unwrap();
    let keep: Vec<_> = posters.into_iter().map(|p| p.join().unwrap()).collect();
    let total = cqs * TOTAL * PER;
    assert!(
        wait_until(Duration::from_secs(60), || seen.handled.load(Relaxed)
            == total as u64),
        "{mode:?}: handled {} of {total}",
        seen.handled.load(Relaxed),
    );
    let report = poller.stop().unwrap();
    pool.join().unwrap();
    drop(keep);
    seen.check();
    let bound = MARK as u64 + PER as u64 * BATCH * cqs as u64;
    let p = &report.poller;
    eprintln!(
        "{mode:?}, {cqs} CQs: spill high water {} (bound {bound}), throttles {}, spills {}",
        p.spill_high_water, p.throttles, p.spills
    );
    assert!(
        p.spill_high_water <= bound,
        "{mode:?}: spill reached {} > mark {MARK} + m {PER} × batch {BATCH} × {cqs} CQs = {bound}",
        p.spill_high_water
    );
    assert!(
        p.throttles > 0,
        "{mode:?}: the test needs back-pressure: {p:?}"
    );
    assert_eq!(report.undelivered, 0);
    assert!(report.cqs.iter().all(|c| c.overflows == 0));
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert!(budgets.iter().all(|b| b.snapshot().credits_in_use == 0));
}

all_modes!(spill_is_bounded);

// ---- Item: no busy loop ---------------------------------------------------

/// CPU time of this process's thread named `name` (from /proc).
fn thread_cpu(name: &str) -> Option<Duration> {
    let tick = 100; // USER_HZ on Linux
    for task in std::fs::read_dir("/proc/self/task").ok()? {
        let path = task.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).ok()?;
        if comm.trim() != name {
            continue;
        }
        let stat = std::fs::read_to_string(path.join("stat")).ok()?;
        let fields: Vec<&str> = stat.rsplit_once(") ")?.1.split(' ').collect();
        let utime: u64 = fields.get(11)?.parse().ok()?;
        let stime: u64 = fields.get(12)?.parse().ok()?;
        return Some(Duration::from_millis((utime + stime) * 1000 / tick));
    }
    None
}

/// Workers stalled with a spill held: below the mark (the CQ idle, the
/// poller sleeping on CQ events and the space wake-up) and above it (the
/// poller not polling, sleeping on the space wake-up). Either way the
/// poller's CPU time stays a small fraction of the wall time, and once the
/// workers resume everything is delivered by the space wake-ups (the safety
/// timeout is set far beyond the test's patience).
fn stalled_workers(mode: PollMode, mark: usize, total: usize) {
    let seen = Seen::new(total);
    let gate = Arc::new(Gate::default());
    gate.set(true);
    let (pool, mut sinks) = pool(1, 4, 1, &seen, &gate, Duration::ZERO);
    let (sim, cq, _handle, regs) = cq(1024, 4, 1);
    let poller = PollerBuilder::new("st", sinks.pop().unwrap())
        .mode(mode)
        .wake_timeout(Duration::from_secs(30))
        .spill_high_water_mark(mark)
        .cq(cq)
        .spawn()
        .unwrap();
    for tag in 0..total {
        sim.push(recv(&regs, tag), false).unwrap();
    }
    assert!(wait_until(Duration::from_secs(10), || poller
        .snapshot()
        .spill_len
        > 0));
    std::thread::sleep(Duration::from_millis(100));
    let wall = Duration::from_secs(1);
    let cpu0 = thread_cpu("cqd-poller-st").expect("poller thread");
    let started = Instant::now();
    std::thread::sleep(wall);
    let cpu = thread_cpu("cqd-poller-st").unwrap() - cpu0;
    let wall = started.elapsed();
    let s = poller.snapshot();
    eprintln!(
        "{mode:?} mark {mark}: poller CPU {cpu:?} in {wall:?} with {} items spilled ({} space waits, {} sleeps)",
        s.spill_len, s.space_waits, s.sleeps
    );
    assert!(
        cpu.as_secs_f64() < 0.2 * wall.as_secs_f64(),
        "{mode:?}: the poller burnt {cpu:?} of CPU in {wall:?} holding a spill"
    );
    if total > mark + BATCH as usize {
        assert!(
            !sim.is_empty(),
            "above the mark the CQ holds the completions"
        );
    }
    gate.set(false);
    assert!(
        wait_until(Duration::from_secs(10), || seen.handled.load(Relaxed)
            == total as u64),
        "{mode:?}: handled {} of {total} after the workers resumed",
        seen.handled.load(Relaxed)
    );
    let report = poller.stop().unwrap();
    pool.join().unwrap();
    seen.check();
    assert!(report.poller.space_wakeups > 0, "{:?}", report.poller);
    assert_eq!(report.poller.timeouts, 0, "{:?}", report.poller);
}

#[test]
fn a_spill_below_the_mark_sleeps_on_cq_events_and_space() {
    for mode in sleeping_modes() {
        stalled_workers(mode, 10_000, 200);
    }
}

#[test]
fn a_spill_above_the_mark_sleeps_on_space_only() {
    for mode in sleeping_modes() {
        stalled_workers(mode, 16, 500);
    }
}

// ---- Item: spill counting -------------------------------------------------

/// A sink that refuses everything while closed, then takes everything.
struct Valve {
    open: Arc<AtomicBool>,
    taken: Arc<Mutex<Vec<usize>>>,
}

impl WorkSink<Job> for Valve {
    fn offer(&mut self, items: &mut VecDeque<Routed<Job>>) {
        if self.open.load(Relaxed) {
            let mut taken = self.taken.lock().unwrap();
            taken.extend(items.drain(..).map(|r| r.item.id));
        }
    }
}

/// 500 items refused for a while (the poller retries many times, on a
/// timer: this sink cannot wake it) count as 500 spills, the gauge shows
/// them, and it drops to zero once taken.
#[test]
fn each_spilled_item_counts_once() {
    let open = Arc::new(AtomicBool::new(false));
    let taken = Arc::new(Mutex::new(Vec::new()));
    let sink = Valve {
        open: open.clone(),
        taken: taken.clone(),
    };
    let (sim, cq, _handle, regs) = cq(1024, 4, 1);
    let poller = PollerBuilder::new("cnt", sink)
        .mode(PollMode::Event)
        .spill_high_water_mark(10_000)
        .cq(cq)
        .spawn()
        .unwrap();
    spill_all(&sim, &regs, &poller, 500);
    // Let the poller retry a good many times.
    assert!(wait_until(Duration::from_secs(10), || poller
        .snapshot()
        .space_waits
        > 20));
    let s = poller.snapshot();
    assert_eq!((s.spills, s.spill_len, s.spill_high_water), (500, 500, 500));
    // A sink that cannot wake anyone is retried on a timer, not spun on.
    let cpu0 = thread_cpu("cqd-poller-cnt").expect("poller thread");
    let started = Instant::now();
    std::thread::sleep(Duration::from_millis(500));
    let cpu = thread_cpu("cqd-poller-cnt").unwrap() - cpu0;
    assert!(
        cpu.as_secs_f64() < 0.2 * started.elapsed().as_secs_f64(),
        "retrying a sink without wake-ups burnt {cpu:?}"
    );
    open.store(true, Relaxed);
    assert!(wait_until(Duration::from_secs(10), || taken
        .lock()
        .unwrap()
        .len()
        == 500));
    let report = poller.stop().unwrap();
    let p = &report.poller;
    assert_eq!((p.spills, p.spill_len, p.spill_high_water), (500, 0, 500));
    assert_eq!(p.handed_off, 500);
    assert_eq!(*taken.lock().unwrap(), (0..500).collect::<Vec<_>>());
}

/// The same through a pool of two workers with keyed items (the exact
/// count of a sink with several destinations).
#[test]
fn each_spilled_item_counts_once_through_a_pool() {
    const TOTAL: usize = 400;
    let seen = Seen::new(TOTAL);
    let gate = Arc::new(Gate::default());
    gate.set(true);
    let (pool, mut sinks) = pool(2, 4, 1, &seen, &gate, Duration::ZERO);
    let (sim, cq, _handle, regs) = cq(1024, 8, 1);
    let poller = PollerBuilder::new("count2", sinks.pop().unwrap())
        .mode(PollMode::Event)
        .spill_high_water_mark(10_000)
        .cq(cq)
        .spawn()
        .unwrap();
    for tag in 0..TOTAL {
        sim.push(recv(&regs, tag), false).unwrap();
    }
    // Two rings of 4 and one item held by each worker: 10 taken at most.
    assert!(wait_until(Duration::from_secs(10), || poller
        .snapshot()
        .handed_off
        + poller.snapshot().spill_len
        == TOTAL as u64));
    std::thread::sleep(Duration::from_millis(100));
    let s = poller.snapshot();
    assert_eq!(s.spills, s.spill_len, "{s:?}");
    gate.set(false);
    assert!(wait_until(Duration::from_secs(10), || seen
        .handled
        .load(Relaxed)
        == TOTAL as u64));
    let report = poller.stop().unwrap();
    pool.join().unwrap();
    seen.check();
    let p = &report.poller;
    assert!(p.spills <= TOTAL as u64, "{p:?}");
    assert_eq!(p.spills, s.spills, "nothing new was spilled after the gate");
}

// ---- Item: nothing dropped at the stop ------------------------------------

/// A sink that never takes anything.
struct Wall;

impl WorkSink<Job> for Wall {
    fn offer(&mut self, _: &mut VecDeque<Routed<Job>>) {}
}

#[test]
fn stop_hands_back_what_the_sink_never_took() {
    let back: Arc<Mutex<Option<Vec<Job>>>> = Arc::default();
    let got = back.clone();
    let (sim, cq, _handle, regs) = cq(1024, 4, 1);
    let poller = PollerBuilder::new("wall", Wall)
        .mode(PollMode::Event)
        .stop_timeout(Duration::from_millis(200))
        .on_undelivered(move |items| *got.lock().unwrap() = Some(items))
        .cq(cq)
        .spawn()
        .unwrap();
    spill_all(&sim, &regs, &poller, 100);
    let started = Instant::now();
    let report = cqd::core::shutdown(|| {}, [poller], []);
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(report.pollers[0].undelivered, 100);
    assert!(!report.is_clean());
    assert!(
        report.errors.iter().any(|e| e.contains("100 work items")),
        "{:?}",
        report.errors
    );
    let items = back.lock().unwrap().take().expect("handed back");
    let ids: Vec<_> = items.iter().map(|j| j.id).collect();
    assert_eq!(ids, (0..100).collect::<Vec<_>>(), "every item, in order");
}

/// A sink that takes everything once its opening time has come.
struct Later(Arc<Mutex<Option<Instant>>>);

impl WorkSink<Job> for Later {
    fn offer(&mut self, items: &mut VecDeque<Routed<Job>>) {
        if self
            .0
            .lock()
            .unwrap()
            .is_some_and(|at| Instant::now() >= at)
        {
            items.clear();
        }
    }
}

/// The stop's hand-over has its own `stop_timeout`: a drain that times out
/// (a request that never completes) must not leave it no time at all.
#[test]
fn a_drain_that_times_out_still_leaves_the_hand_over_its_time() {
    let opens: Arc<Mutex<Option<Instant>>> = Arc::default();
    let (sim, cq, _handle, regs) = cq(1024, 4, 1);
    let poller = PollerBuilder::new("later", Later(opens.clone()))
        .mode(PollMode::Event)
        .drain_timeout(Duration::from_millis(150))
        .stop_timeout(Duration::from_millis(100))
        .cq(cq)
        .spawn()
        .unwrap();
    spill_all(&sim, &regs, &poller, 100);
    // A request that will never complete: the drain waits it out.
    regs[0].track(cqd::core::OpKind::Send, 1);
    *opens.lock().unwrap() = Some(Instant::now() + Duration::from_millis(180));
    let report = poller.stop().unwrap();
    assert!(report.accounts.timed_out, "the drain timed out");
    assert_eq!(report.undelivered, 0, "the hand-over still had its time");
}

// ---- Item: a pool kept open does not hang shutdown ------------------------

#[test]
fn a_sink_kept_alive_does_not_hang_shutdown() {
    let seen = Seen::new(10);
    let gate = Arc::new(Gate::default());
    let (pool, mut sinks) = pool(2, 4, 2, &seen, &gate, Duration::ZERO);
    let mut kept = sinks.pop().unwrap(); // sink 1, kept for try_push
    let (sim, cq, _handle, regs) = cq(64, 2, 1);
    let poller = PollerBuilder::new("kept", sinks.pop().unwrap())
        .mode(PollMode::Event)
        .cq(cq)
        .spawn()
        .unwrap();
    for tag in 0..8 {
        sim.push(recv(&regs, tag), false).unwrap();
    }
    kept.try_push(
        Route::Key(0),
        Job {
            conn: 9,
            seq: 1,
            id: 8,
        },
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || seen
        .handled
        .load(Relaxed)
        == 9));
    let started = Instant::now();
    let report = shutdown_with(
        ShutdownOptions::default().pool_join_timeout(Duration::from_millis(300)),
        || {},
        [poller],
        [pool],
    );
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "shutdown took {took:?}");
    assert!(!report.is_clean());
    let error = report
        .errors
        .iter()
        .find(|e| e.contains("pool bp"))
        .unwrap_or_else(|| panic!("{:?}", report.errors));
    assert!(
        error.contains("sinks still alive (by spawn index): [1]"),
        "{error}"
    );
    assert_eq!(
        report.pools.len(),
        1,
        "the pool's counters are still reported"
    );
    assert_eq!(report.pools[0].items(), 9);
    drop(kept);
}
