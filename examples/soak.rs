//! The soak: completions through pollers (one per poll mode), handlers and
//! a worker pool on the simulator with every fault on at random, then a
//! stop; exactly-once checked to the completion and to the work item,
//! overflows counted, resident memory sampled.
//!
//! ```text
//! cargo run --release --example soak -- --completions 100000000
//! cargo run --release --example soak -- --seconds 60        # what CI runs
//! ```
//!
//! Four simulated CQs with credits (the CQ's capacity; a post beyond is
//! refused and retried), one poller thread each in busy, event, hybrid and
//! adaptive mode, a pool of two workers. Two producer threads post through
//! the posting call on loopback QPs (each post completes at once), and
//! inject, at random:
//!
//! - error completions (remote access, retry exceeded, local protection),
//!   and successful unsignaled sends (retired by the next completion of
//!   their queue);
//! - "QP to error": a burst of requests completing as flushes, after which
//!   the QP is dropped and replaced by a new one;
//! - handlers unregistered with requests in flight (they keep receiving
//!   their completions, flushes included) and replaced;
//! - dropped, spurious and delayed notifications (the CQs' fault rates);
//! - slow work items (a 200 µs sleep) and work items that panic (caught by
//!   the pool, counted).
//!
//! At the end every handler — live or retired — received exactly the
//! requests it posted (count and sum of tags), every work item was run
//! once (or panicked, counted, once), no CQ overflowed, no wr_id was stale
//! or foreign, every ledger is clean, and resident memory after warm-up
//! (the first fifth of the samples) grew by less than 8 MiB. Exit status 1
//! otherwise.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::budget::BudgetOptions;
use cqd::core::ledger::WrLedger;
use cqd::core::pool::Work;
use cqd::core::topology::{ModeConfig, PollerConfig, PoolConfig, TopologyConfig};
use cqd::core::{
    split, CqBudget, CqHandle, Failed, Handler, OpKind, Outbox, RecvDone, Refused, Registration,
    SendDone, Status,
};
use cqd::sim::{sim_cq_with_ledger, Faults, LoopWr, Loopback, LoopbackError, SimCq};

const CQS: usize = 4;
const CAPACITY: u32 = 1024;
const HANDLERS_PER_CQ: usize = 8;
const TAG_SPACE: u64 = 1 << 24;

/// What one handler was sent and what it got.
#[derive(Default)]
struct Count {
    posted: AtomicU64,
    posted_sum: AtomicU64,
    delivered: AtomicU64,
    delivered_sum: AtomicU64,
}

/// A work item: the tag of the completion it came from.
struct Job {
    tag: u32,
}

struct Conn {
    count: Arc<Count>,
    total: Arc<AtomicU64>,
}

impl Conn {
    fn got(&mut self, tag: u32, out: &mut Outbox<'_, Job>) {
        self.count.delivered.fetch_add(1, Relaxed);
        self.count.delivered_sum.fetch_add(u64::from(tag), Relaxed);
        self.total.fetch_add(1, Relaxed);
        out.push(Job { tag });
    }
}

impl Handler<Job> for Conn {
    fn on_send(&mut self, d: &SendDone<'_>, out: &mut Outbox<'_, Job>) {
        self.got(d.tag(), out);
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, Job>) {
        self.got(d.tag(), out);
    }
    fn on_error(&mut self, f: &Failed<'_>, out: &mut Outbox<'_, Job>) {
        self.got(f.tag(), out);
    }
}

#[derive(Default)]
struct WorkCount {
    ran: AtomicU64,
    panicked: AtomicU64,
    sum: AtomicU64,
}

struct Worker(Arc<WorkCount>);

impl Work<Job> for Worker {
    fn run(&mut self, job: Job) {
        self.0.sum.fetch_add(u64::from(job.tag), Relaxed);
        if job.tag % 10_007 == 3 {
            self.0.panicked.fetch_add(1, Relaxed);
            panic!("soak: injected worker panic");
        }
        if job.tag % 20_011 == 5 {
            std::thread::sleep(Duration::from_micros(200));
        }
        self.0.ran.fetch_add(1, Relaxed);
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn one_in(&mut self, n: u64) -> bool {
        self.next() % n == 0
    }
}

/// One CQ as its producer sees it.
struct Lane {
    producer: SimCq,
    handle: CqHandle<Job>,
    qp: Loopback,
    next_qpn: u32,
    regs: Vec<(Registration, Arc<Count>)>,
    retired: Vec<Arc<Count>>,
    tag: u64,
}

#[derive(Default)]
struct Faulted {
    errors: AtomicU64,
    unsignaled: AtomicU64,
    qp_errors: AtomicU64,
    unregistered: AtomicU64,
    refused: AtomicU64,
}

impl Lane {
    fn conn(&self, total: &Arc<AtomicU64>) -> (Registration, Arc<Count>) {
        let count = Arc::new(Count::default());
        let reg = self
            .handle
            .register(Conn {
                count: Arc::clone(&count),
                total: Arc::clone(total),
            })
            .expect("register");
        (reg, count)
    }

    /// Posts one request (a send if `send`, else a send or a receive at
    /// random); false if the CQ's credits refused it.
    fn post(&mut self, rng: &mut Rng, f: &Faulted, status: Option<Status>, send: bool) -> bool {
        let i = (rng.next() % self.regs.len() as u64) as usize;
        let tag = self.tag % TAG_SPACE;
        let recv = !send && rng.one_in(2);
        let kind = if recv { OpKind::Recv } else { OpKind::Send };
        let mut wr = LoopWr::new(tag, kind);
        let mut owed = true;
        let status = status.or_else(|| {
            rng.one_in(200).then(|| {
                [
                    Status::RemoteAccess,
                    Status::RetryExceeded,
                    Status::LocalProtection,
                ][(rng.next() % 3) as usize]
            })
        });
        if let Some(s) = status {
            wr = wr.failing(s);
        } else if !recv && rng.one_in(10) {
            wr = wr.unsignaled();
            owed = false;
        }
        let (reg, count) = &self.regs[i];
        let r = if recv {
            reg.post_recv(&self.qp, &mut [wr])
        } else {
            reg.post_send(&self.qp, &mut [wr])
        };
        match r {
            Ok(()) => {
                self.tag += 1;
                if owed {
                    count.posted.fetch_add(1, Relaxed);
                    count.posted_sum.fetch_add(tag, Relaxed);
                } else {
                    f.unsignaled.fetch_add(1, Relaxed);
                }
                if status.is_some_and(|s| s != Status::WrFlush) {
                    f.errors.fetch_add(1, Relaxed);
                }
                true
            }
            Err(LoopbackError::Refused(Refused::Credits(_))) => {
                f.refused.fetch_add(1, Relaxed);
                false
            }
            Err(e) => panic!("post failed: {e}"),
        }
    }
}

struct Args {
    completions: u64,
    seconds: Option<u64>,
    seed: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        completions: 2_000_000,
        seconds: None,
        seed: 0x5eed,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            it.next()
                .ok_or(format!("{name} needs a value"))?
                .parse()
                .map_err(|e| format!("{name}: {e}"))
        };
        match flag.as_str() {
            "--completions" => a.completions = value("--completions")?,
            "--seconds" => {
                a.seconds = Some(value("--seconds")?);
                a.completions = u64::MAX;
            }
            "--seed" => a.seed = value("--seed")?.max(1),
            other => {
                return Err(format!(
                    "unknown argument {other} (try --completions N | --seconds N, --seed N)"
                ))
            }
        }
    }
    Ok(a)
}

fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("soak: {e}");
        std::process::exit(2);
    });
    // Injected panics are expected: keep them off stderr, others not.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info
            .payload()
            .downcast_ref::<&str>()
            .is_some_and(|s| s.starts_with("soak: injected"));
        if !injected {
            default_hook(info);
        }
    }));
    match run(&args) {
        Ok(()) => println!("soak: PASS"),
        Err(e) => {
            eprintln!("soak: FAIL: {e}");
            std::process::exit(1);
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    let modes = [
        ModeConfig::Busy,
        ModeConfig::Event { timeout_ms: 100 },
        ModeConfig::Hybrid {
            spin_window_us: 50,
            timeout_ms: 100,
        },
        ModeConfig::Adaptive {
            min_window_us: 2,
            max_window_us: 200,
            cpu_budget_percent: 50,
            timeout_ms: 100,
        },
    ];
    let mut config = TopologyConfig::new().pool(PoolConfig::new("work", 2).capacity(256));
    for (i, m) in modes.iter().enumerate() {
        config = config.poller(
            PollerConfig::new(format!("p{i}"))
                .cq(format!("cq{i}"))
                .pool("work")
                .mode(*m),
        );
    }
    let mut topology = config.validate().map_err(|e| e.to_string())?;
    let work = Arc::new(WorkCount::default());
    let (pool, mut feeds) = topology
        .take_pool("work")
        .ok_or("no pool")?
        .spawn_feeds(|_| Worker(Arc::clone(&work)))
        .map_err(|e| e.to_string())?;

    let total = Arc::new(AtomicU64::new(0));
    let undelivered = Arc::new(AtomicU64::new(0));
    let mut pollers = Vec::new();
    let mut lanes = Vec::new();
    for (i, plan) in topology.take_pollers().into_iter().enumerate() {
        let name = plan.cqs()[0].clone();
        let faults = Faults {
            spurious: 0.05,
            drop: 0.05,
            delay: 0.05,
            delay_by: Duration::from_micros(300),
            seed: args.seed + i as u64,
            ..Faults::default()
        };
        let budget = CqBudget::new(
            name.clone(),
            CAPACITY,
            BudgetOptions {
                admission: false,
                credits: Some(CAPACITY),
            },
        );
        let (producer, source) =
            sim_cq_with_ledger(name, CAPACITY, faults, WrLedger::with_budget(budget))
                .map_err(|e| e.to_string())?;
        let (cq, handle) = split(source, plan.cq_options()).map_err(|e| e.to_string())?;
        let u = Arc::clone(&undelivered);
        let thread = plan
            .poller_builder_fed(&mut feeds)
            .map_err(|e| e.to_string())?
            .on_undelivered(move |v: Vec<Job>| {
                u.fetch_add(v.len() as u64, Relaxed);
            })
            .cq(cq)
            .spawn()
            .map_err(|e| e.to_string())?;
        pollers.push(thread);
        let qp = Loopback::new(producer.clone(), 1);
        let mut lane = Lane {
            producer,
            handle,
            qp,
            next_qpn: 2,
            regs: Vec::new(),
            retired: Vec::new(),
            tag: 0,
        };
        for _ in 0..HANDLERS_PER_CQ {
            let c = lane.conn(&total);
            lane.regs.push(c);
        }
        lanes.push(lane);
    }

    let faulted = Arc::new(Faulted::default());
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let mut producers = Vec::new();
    let mut lanes_iter = lanes.into_iter();
    for p in 0..2u64 {
        let mine: Vec<Lane> = lanes_iter.by_ref().take(CQS / 2).collect();
        let (f, stop, total) = (Arc::clone(&faulted), Arc::clone(&stop), Arc::clone(&total));
        let seed = args.seed.wrapping_mul(31).wrapping_add(p) | 1;
        let target = args.completions;
        producers.push(std::thread::spawn(move || {
            produce(mine, seed, target, &f, &stop, &total)
        }));
    }

    // Sample resident memory while it runs.
    let mut samples = Vec::new();
    let mut last = (Instant::now(), 0u64);
    println!(
        "{:>7} {:>13} {:>10} {:>9}",
        "secs", "completions", "per sec", "RSS MiB"
    );
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let done = producers.iter().all(|h| h.is_finished());
        let elapsed = start.elapsed();
        if args.seconds.is_some_and(|s| elapsed.as_secs() >= s) {
            stop.store(true, Relaxed);
        }
        if last.0.elapsed() >= Duration::from_secs(5) || done {
            let n = total.load(Relaxed);
            let rate = (n - last.1) as f64 / last.0.elapsed().as_secs_f64();
            let rss = rss_bytes();
            samples.push(rss);
            println!(
                "{:>7.1} {:>13} {:>10.0} {:>9.1}",
                elapsed.as_secs_f64(),
                n,
                rate,
                rss as f64 / 1048576.0
            );
            last = (Instant::now(), n);
        }
        if done {
            break;
        }
    }
    let producers_done = start.elapsed();
    let mut counts = Vec::new();
    let mut handles = Vec::new();
    for h in producers {
        let (c, keep) = h.join().map_err(|_| "a producer panicked")??;
        counts.extend(c);
        handles.extend(keep);
    }

    // Everything posted must arrive before the stop; then stop pollers
    // first, then the pool.
    let owed: u64 = counts.iter().map(|c| c.posted.load(Relaxed)).sum();
    let deadline = Instant::now() + Duration::from_secs(60);
    while total.load(Relaxed) < owed && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let drained_in = start.elapsed();
    let mut overflows = 0;
    let mut stale = 0;
    let mut foreign = 0;
    let mut notes = (0u64, 0u64, 0u64, 0u64);
    for t in pollers {
        let r = t.stop().map_err(|e| e.to_string())?;
        if !r.errors.is_empty() {
            return Err(format!("poller errors: {:?}", r.errors));
        }
        if !r.accounts.is_balanced() || r.accounts.timed_out {
            let missing: Vec<_> = r.accounts.missing().collect();
            return Err(format!(
                "poller {}: ledgers not balanced at the stop: {missing:?}, {} stuck",
                r.poller.name,
                r.accounts.stuck.len()
            ));
        }
        for c in &r.cqs {
            overflows += c.overflows;
            stale += c.stale_wr_ids;
            foreign += c.foreign_wr_ids;
            notes.0 += c.events;
            notes.1 += c.spurious_wakeups;
            notes.2 += c.recovered_missed_events;
            notes.3 += c.acks;
        }
    }
    let stopped_in = start.elapsed();
    let snap = pool
        .join_timeout(Duration::from_secs(30))
        .map_err(|e| e.to_string())?;
    println!(
        "posting ended at {:.1} s, all delivered at {:.1} s, pollers stopped at {:.1} s, pool joined at {:.1} s",
        producers_done.as_secs_f64(),
        drained_in.as_secs_f64(),
        stopped_in.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    let elapsed = start.elapsed();

    let delivered: u64 = counts.iter().map(|c| c.delivered.load(Relaxed)).sum();
    let mut bad = Vec::new();
    for (i, c) in counts.iter().enumerate() {
        let (p, d) = (c.posted.load(Relaxed), c.delivered.load(Relaxed));
        let (ps, ds) = (c.posted_sum.load(Relaxed), c.delivered_sum.load(Relaxed));
        if p != d || ps != ds {
            bad.push(format!(
                "handler {i}: posted {p} (sum {ps}), delivered {d} (sum {ds})"
            ));
        }
    }
    let ran = work.ran.load(Relaxed);
    let panicked = work.panicked.load(Relaxed);
    let lost_work = undelivered.load(Relaxed);
    let f = &faulted;
    println!(
        "{delivered} completions in {:.1} s ({:.0}/s), {} handlers ({} unregistered in flight)",
        elapsed.as_secs_f64(),
        delivered as f64 / elapsed.as_secs_f64(),
        counts.len(),
        f.unregistered.load(Relaxed)
    );
    println!(
        "faults: {} error completions, {} QPs to error (flushed), {} unsignaled sends, {} posts refused for credits",
        f.errors.load(Relaxed),
        f.qp_errors.load(Relaxed),
        f.unsignaled.load(Relaxed),
        f.refused.load(Relaxed)
    );
    println!(
        "notifications: {} events, {} spurious, {} missed and recovered, {} acked; work: {ran} ran, {panicked} panicked (caught), {} pool panics, {lost_work} undelivered",
        notes.0, notes.1, notes.2, notes.3, snap.panics()
    );
    println!("overflows {overflows}, stale wr_ids {stale}, foreign wr_ids {foreign}");
    let mut sim = (0u64, 0u64, 0u64, 0u64);
    for (producer, _) in &handles {
        let st = producer.stats();
        sim.0 += st.dropped;
        sim.1 += st.delayed;
        sim.2 += st.spurious;
        sim.3 += st.lost;
    }
    println!(
        "injected notification faults: {} dropped, {} delayed, {} spurious; {} completions lost to overflow",
        sim.0, sim.1, sim.2, sim.3
    );
    drop(handles);

    if !bad.is_empty() {
        return Err(format!("exactly-once broken: {}", bad.join("; ")));
    }
    if delivered != owed {
        return Err(format!("delivered {delivered} of {owed}"));
    }
    if ran + panicked != delivered || lost_work != 0 || snap.panics() != panicked {
        return Err(format!(
            "work: {ran} ran + {panicked} panicked != {delivered} emitted ({lost_work} undelivered)"
        ));
    }
    if overflows != 0 || sim.3 != 0 || stale != 0 || foreign != 0 {
        return Err("overflow or misrouted wr_id".into());
    }
    let warm = samples.len() / 5;
    if samples.len() >= 5 {
        let base = samples[warm];
        let top = samples[warm..].iter().copied().max().unwrap_or(base);
        println!(
            "RSS after warm-up: {:.1} MiB → max {:.1} MiB ({} samples)",
            base as f64 / 1048576.0,
            top as f64 / 1048576.0,
            samples.len() - warm
        );
        if top > base + 8 * 1048576 {
            return Err("resident memory grew after warm-up".into());
        }
    } else {
        println!(
            "RSS: too short a run to judge growth ({} samples)",
            samples.len()
        );
    }
    Ok(())
}

type Produced = (Vec<Arc<Count>>, Vec<(SimCq, CqHandle<Job>)>);

fn produce(
    mut lanes: Vec<Lane>,
    seed: u64,
    target: u64,
    f: &Faulted,
    stop: &AtomicBool,
    total: &Arc<AtomicU64>,
) -> Result<Produced, String> {
    let mut rng = Rng(seed);
    let mut spins = 0u32;
    while total.load(Relaxed) < target && !stop.load(Relaxed) {
        let mut any = false;
        for lane in &mut lanes {
            for _ in 0..32 {
                if lane.post(&mut rng, f, None, false) {
                    any = true;
                } else {
                    break;
                }
            }
            if rng.one_in(2_000) {
                // QP to error: what is queued completes as flushes, then
                // the QP goes and a new one takes its place.
                // At least one flush, and the first a send's, which
                // retires the unsignaled sends before it on the send queue
                // (their queue is going away; a receive's flush would not,
                // and they would stay outstanding for ever).
                let mut flushed = 0;
                for _ in 0..1_000_000 {
                    if lane.post(&mut rng, f, Some(Status::WrFlush), flushed == 0) {
                        flushed += 1;
                        if flushed == 16 {
                            break;
                        }
                    } else if flushed > 0 {
                        break;
                    } else {
                        std::thread::sleep(Duration::from_micros(50));
                    }
                }
                lane.qp = Loopback::new(lane.producer.clone(), lane.next_qpn);
                lane.next_qpn += 1;
                f.qp_errors.fetch_add(1, Relaxed);
            }
            if rng.one_in(3_000) {
                // A handler retired with requests in flight, and replaced.
                let i = (rng.next() % lane.regs.len() as u64) as usize;
                let fresh = lane.conn(total);
                let (reg, count) = std::mem::replace(&mut lane.regs[i], fresh);
                lane.handle
                    .unregister(reg.key())
                    .map_err(|e| e.to_string())?;
                lane.retired.push(count);
                f.unregistered.fetch_add(1, Relaxed);
            }
        }
        if any {
            spins = 0;
        } else {
            spins += 1;
            if spins > 16 {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::yield_now();
            }
        }
    }
    // Close every queue's stream: a signaled send per live handler retires
    // the unsignaled sends before it.
    let mut counts = Vec::new();
    let mut keep = Vec::new();
    for mut lane in lanes {
        for i in 0..lane.regs.len() {
            let tag = lane.tag % TAG_SPACE;
            let (reg, count) = &lane.regs[i];
            loop {
                match reg.post_send(&lane.qp, &mut [LoopWr::new(tag, OpKind::Send)]) {
                    Ok(()) => break,
                    Err(LoopbackError::Refused(Refused::Credits(_))) => {
                        std::thread::sleep(Duration::from_micros(50))
                    }
                    Err(e) => return Err(format!("final post: {e}")),
                }
            }
            count.posted.fetch_add(1, Relaxed);
            count.posted_sum.fetch_add(tag, Relaxed);
            lane.tag += 1;
        }
        counts.extend(lane.regs.iter().map(|(_, c)| Arc::clone(c)));
        counts.append(&mut lane.retired);
        keep.push((lane.producer.clone(), lane.handle.clone()));
    }
    Ok((counts, keep))
}
