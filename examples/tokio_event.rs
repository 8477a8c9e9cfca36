//! cqd's Event mode driven from tokio, for servers that are already async.
//!
//! ```text
//! cargo run --example tokio_event
//! cargo run --example tokio_event -- --completions 100000 --drop 0.02 --seed 7
//! ```
//!
//! Instead of a cqd poller thread, a task on the server's own
//! current-thread runtime owns the CQ's polling right (`CqPoller`, which
//! is `!Send`: it stays on the thread that bound it, so the task runs in a
//! `LocalSet`). The CQ's notification descriptor is registered with tokio
//! (`AsyncFd`), and the task follows the sleep protocol of cqd's Event mode
//! (`cqd_core::mode`, "The sleep protocol") step by step:
//!
//! 5. **Poll** until the CQ is empty — drain to empty, never one entry per
//!    notification (yielding to the runtime's other tasks every 256
//!    completions, but never sleeping before the CQ is empty).
//! 1. **Arm**, unless the arm of an earlier cycle is still in force (an arm
//!    is one-shot: it stays in force until it fires).
//! 2. **Re-poll** after arming: a completion that landed after the last
//!    empty poll but before the arm took effect raises no notification. If
//!    the re-poll finds anything, do not sleep: back to 5.
//! 3. **Block**: await the descriptor's readiness, with a safety timeout.
//! 4. **Collect**: take the notifications (reading the descriptor until it
//!    would block, tokio's readiness contract), acknowledge them in batches
//!    of 16; a CQ that fired is no longer armed. Then 5.
//!
//! **The safety net**: when the block times out, the task takes what is
//! already notified, then polls the quiet CQ; completions found there with
//! no notification on its way had theirs lost, and are counted as
//! recovered (and the CQ is armed afresh). Asynchronous events are checked
//! at every wake-up; a CQ in error (an overflow) is never armed again and
//! is polled once per wake timeout, as a poller thread does.
//!
//! The NIC is the simulated one (cqd-sim), with a producer task on a
//! runtime of its own (another thread, as a NIC is): it posts bursts
//! through the posting call on a loopback QP, now and then makes
//! completions land between the task's last empty poll and its arm (only
//! the re-poll of step 2 finds those), and the simulated CQ drops and
//! invents notifications at random. At the end the example checks that
//! every completion reached its handler exactly once, that every
//! notification was acknowledged, and that the safety net recovered no
//! more completions than the simulated CQ dropped notifications (a lost
//! wake-up of the protocol's own would show there); it exits non-zero
//! otherwise.
//!
//! Handlers registered while the task waits are applied by its next poll,
//! before any of their completions is dispatched. A server that retires
//! handlers on a quiet CQ can also watch `CqPoller::doorbell_fd` to apply
//! retirements at once.

use std::collections::VecDeque;
use std::io;
use std::os::fd::OwnedFd;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    split, Completion, CqOptions, CqPoller, Failed, Handler, NoWork, OpKind, Opcode, Outbox,
    RecvDone, Registration, SendDone, SourceError, Status,
};
use cqd::sim::{sim_cq, Faults, LoopWr, Loopback, SimCq};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

/// Acknowledge notifications once this many are pending (as a poller
/// thread does by default).
const ACK_BATCH: u32 = 16;
/// The safety net's timeout (a poller thread's default is 100 ms; shorter
/// here so that dropped notifications cost the example little time).
const WAKE_TIMEOUT: Duration = Duration::from_millis(10);
/// Everything must be handled within this, or the example fails.
const DEADLINE: Duration = Duration::from_secs(60);
/// Completions polled between two yields to the runtime (a poller
/// thread's default round budget).
const ROUND_BUDGET: usize = 256;
/// The simulated CQ's capacity.
const CAPACITY: u32 = 1024;
/// Handlers (connections) on the CQ.
const CONNS: usize = 8;
/// The QP number of the completions injected between poll and arm (no
/// queue account: they are tracked on the handler's ledger only).
const INJECT_QP: u32 = 2;

/// Per tag: how many times it reached a handler.
struct Seen {
    hits: Vec<AtomicU8>,
    delivered: AtomicU64,
    errors: AtomicU64,
}

impl Seen {
    fn hit(&self, tag: u32) {
        if let Some(h) = self.hits.get(tag as usize) {
            h.fetch_add(1, Ordering::Relaxed);
        }
        self.delivered.fetch_add(1, Ordering::Relaxed);
    }
}

struct Conn {
    seen: Arc<Seen>,
}

impl Handler for Conn {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.hit(d.tag());
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.hit(d.tag());
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.errors.fetch_add(1, Ordering::Relaxed);
        self.seen.hit(f.tag());
    }
}

/// What the driving task did.
#[derive(Debug, Default)]
struct Stats {
    wakeups: u64,
    events: u64,
    spurious: u64,
    arms: u64,
    repolls: u64,
    repoll_found: u64,
    timeouts: u64,
    recovered: u64,
    ack_batches: u64,
    async_events: u64,
}

/// The task that owns the CQ's polling right: the sleep protocol of cqd's
/// Event mode on tokio. Returns when `seen` has `total` completions.
struct Driver {
    cq: CqPoller<NoWork>,
    /// The CQ's notification descriptor (a duplicate of it), registered
    /// with the runtime.
    fd: AsyncFd<OwnedFd>,
    /// Handlers emit no work here; the outbox a poll fills stays empty.
    out: VecDeque<cqd::core::Routed<NoWork>>,
    /// The CQ's one-shot arm is in force (not seen firing).
    armed: bool,
    stats: Stats,
}

impl Driver {
    fn new(cq: CqPoller<NoWork>) -> io::Result<Self> {
        let fd = cq.event_fd().try_clone_to_owned()?;
        // SAFETY: `register_with_interest` needs a descriptor that stays
        // open and names the same open file for as long as the `AsyncFd`
        // lives. `fd` is an `OwnedFd` the `AsyncFd` takes ownership of: it
        // is closed only when the `AsyncFd` drops it, its raw number never
        // changes, and nothing here replaces it (no `get_mut`). It is a
        // duplicate of the CQ's descriptor, so it names the same eventfd
        // even though the CQ keeps its own.
        let fd = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }?;
        Ok(Driver {
            fd,
            cq,
            out: VecDeque::new(),
            armed: false,
            stats: Stats::default(),
        })
    }

    /// Step 5: polls until the CQ is empty; returns the completions. Every
    /// [`ROUND_BUDGET`] completions it yields to the runtime's other tasks
    /// (it does not sleep: the CQ is drained before any block).
    async fn drain(&mut self) -> io::Result<u64> {
        let (mut total, mut round) = (0, 0);
        loop {
            let n = self.cq.poll_once(&mut self.out).map_err(io::Error::other)?;
            if n == 0 {
                return Ok(total);
            }
            total += n as u64;
            round += n;
            if round >= ROUND_BUDGET {
                round = 0;
                tokio::task::yield_now().await;
            }
        }
    }

    /// Step 4 without waiting: takes the notifications already there and
    /// acknowledges once [`ACK_BATCH`] are pending. A CQ that fired is no
    /// longer armed.
    fn take_events(&mut self) -> io::Result<u32> {
        let n = self.cq.take_events().map_err(io::Error::other)?;
        if n > 0 {
            self.armed = false;
            self.stats.events += u64::from(n);
        }
        if self.cq.unacked_events() >= ACK_BATCH {
            self.cq.ack_all().map_err(io::Error::other)?;
            self.stats.ack_batches += 1;
        }
        Ok(n)
    }

    async fn run(&mut self, seen: &Seen, total: u64) -> io::Result<()> {
        // Notifications collected since the last poll (a wake-up whose poll
        // finds nothing is spurious).
        let mut collected = 0;
        loop {
            // 5. Poll: drain to empty.
            let found = self.drain().await?;
            if collected > 0 && found == 0 {
                self.stats.spurious += 1;
            }
            collected = 0;
            if seen.delivered.load(Ordering::Relaxed) >= total {
                return Ok(());
            }
            // Asynchronous events (an overflow puts the CQ in error): one
            // atomic load when there are none.
            self.stats.async_events += self.cq.check_async() as u64;
            if self.cq.is_in_error() {
                // Never armed again (it would never notify): poll it once
                // per wake timeout for what it still holds.
                tokio::time::sleep(WAKE_TIMEOUT).await;
                continue;
            }
            // 1. Arm, unless the arm of an earlier cycle is still in force:
            //    then it has not fired (and will, for the next completion)
            //    or it has, and the descriptor is ready.
            if !self.armed {
                match self.cq.arm() {
                    Ok(()) => {
                        self.armed = true;
                        self.stats.arms += 1;
                    }
                    // In error now (traced and counted once by cqd).
                    Err(SourceError::CqInError) => continue,
                    Err(e) => return Err(io::Error::other(e)),
                }
                // 2. Re-poll what was just armed: a completion that landed
                //    between the last empty poll and the arm raised no
                //    notification. Found something: do not sleep.
                self.stats.repolls += 1;
                let found = self.drain().await?;
                if found > 0 {
                    self.stats.repoll_found += found;
                    continue;
                }
            }
            // 3. Block on the descriptor, with the safety timeout.
            match tokio::time::timeout(WAKE_TIMEOUT, self.fd.readable()).await {
                Ok(guard) => {
                    let mut guard = guard?;
                    self.stats.wakeups += 1;
                    // 4. Collect: read the descriptor until it would block,
                    //    then (and only then) tokio may forget the
                    //    readiness; a notification written after that read
                    //    is a new edge, which tokio keeps.
                    loop {
                        let taken = guard.try_io(|_| match self.cq.take_events() {
                            Ok(0) => Err(io::ErrorKind::WouldBlock.into()),
                            Ok(n) => Ok(n),
                            Err(e) => Err(io::Error::other(e)),
                        });
                        match taken {
                            Ok(Ok(n)) => {
                                self.armed = false;
                                self.stats.events += u64::from(n);
                                collected += n;
                            }
                            Ok(Err(e)) => return Err(e),
                            Err(_would_block) => break,
                        }
                    }
                    if self.cq.unacked_events() >= ACK_BATCH {
                        self.cq.ack_all().map_err(io::Error::other)?;
                        self.stats.ack_batches += 1;
                    }
                }
                Err(_elapsed) => {
                    // The safety net: first what is already notified (a
                    // notification on its way is not a missed one)…
                    self.stats.timeouts += 1;
                    collected += self.take_events()?;
                    if collected > 0 {
                        continue;
                    }
                    // …then poll the quiet CQ. Completions there with no
                    // notification written for them had theirs lost (a
                    // completion and the notification it fires are made
                    // together, so one seen by the poll has its
                    // notification already written, unless it was lost).
                    let found = self.drain().await?;
                    if found > 0 && self.take_events()? == 0 {
                        self.stats.recovered += 1;
                        // Its arm is suspect: arm afresh.
                        self.armed = false;
                    }
                }
            }
        }
    }

    /// The end: acknowledge every notification, destroy the CQ.
    fn finish(mut self) -> io::Result<Stats> {
        self.cq.ack_all().map_err(io::Error::other)?;
        let Driver { cq, fd, stats, .. } = self;
        drop(fd);
        cq.destroy().map_err(io::Error::other)?;
        Ok(stats)
    }
}

/// What the producer task posted.
#[derive(Debug, Default)]
struct Produced {
    posted: u64,
    flushed: u64,
    injected: u64,
}

/// The producer task (on the NIC's runtime): bursts of posts on a loopback
/// QP, with pauses; every 25th burst also makes completions land between
/// the driver's last empty poll and its next arm.
async fn produce(
    sim: SimCq,
    regs: Vec<Registration>,
    total: u64,
    seed: u64,
) -> Result<Produced, String> {
    let qp = Loopback::new(sim.clone(), 1);
    let mut p = Produced::default();
    let mut rng = seed | 1;
    let mut next = move || {
        // xorshift64: reproducible for a seed.
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut tag = 0u64;
    let mut bursts = 0u64;
    while tag < total {
        let burst = (1 + next() % 48).min(total - tag);
        // Never overflow the CQ (credits would hold a real poster back).
        while sim.len() + burst as usize + 4 >= CAPACITY as usize {
            tokio::time::sleep(Duration::from_micros(100)).await;
        }
        bursts += 1;
        let inject = bursts % 25 == 0 && tag + burst < total;
        for _ in 0..burst {
            let reg = &regs[(tag % CONNS as u64) as usize];
            let res = if inject && tag % 16 == 0 {
                // Lands at the driver's next arm, before it takes effect.
                let t = tag as u32;
                let wr_id = reg.wr_id(OpKind::Recv, t).map_err(|e| e.to_string())?;
                if !reg.track(OpKind::Recv, 1) {
                    return Err("handler released".into());
                }
                let mut wc = Completion::success(wr_id, Opcode::Recv, INJECT_QP);
                wc.byte_len = 64;
                sim.inject_before_next_arm(&[wc]);
                p.injected += 1;
                Ok(())
            } else if tag % 97 == 0 {
                p.flushed += 1;
                let wr = LoopWr::new(tag, OpKind::Send).failing(Status::WrFlush);
                reg.post_send(&qp, &mut [wr])
            } else if tag % 2 == 0 {
                reg.post_send(&qp, &mut [LoopWr::new(tag, OpKind::Send)])
            } else {
                let wr = LoopWr::new(tag, OpKind::Recv).with_len(256);
                reg.post_recv(&qp, &mut [wr])
            };
            res.map_err(|e| format!("post {tag}: {e}"))?;
            p.posted += 1;
            tag += 1;
        }
        // A pause between bursts: most long enough for the driver to go to
        // sleep, some only a yield.
        if next() % 4 == 0 {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
    Ok(p)
}

struct Args {
    completions: u64,
    drop: f64,
    spurious: f64,
    seed: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        completions: 20_000,
        drop: 0.01,
        spurious: 0.02,
        seed: 11,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or(format!("{name} needs a value"));
        match flag.as_str() {
            "--completions" => {
                a.completions = value("--completions")?
                    .parse()
                    .map_err(|e| format!("--completions: {e}"))?
            }
            "--drop" => {
                a.drop = value("--drop")?
                    .parse()
                    .map_err(|e| format!("--drop: {e}"))?
            }
            "--spurious" => {
                a.spurious = value("--spurious")?
                    .parse()
                    .map_err(|e| format!("--spurious: {e}"))?
            }
            "--seed" => {
                a.seed = value("--seed")?
                    .parse()
                    .map_err(|e| format!("--seed: {e}"))?
            }
            other => {
                return Err(format!(
                    "unknown argument {other} (try --completions N --drop P --spurious P --seed N)"
                ))
            }
        }
    }
    if a.completions == 0 || a.completions >= 1 << 24 {
        return Err("--completions must be in 1..16777216 (a tag each)".into());
    }
    Ok(a)
}

fn run(args: &Args) -> Result<(), String> {
    let faults = Faults {
        drop: args.drop,
        spurious: args.spurious,
        seed: args.seed,
        ..Faults::default()
    };
    let (sim, source) = sim_cq("rx0", CAPACITY, faults).map_err(|e| e.to_string())?;
    let (unbound, handle) =
        split::<NoWork>(source, CqOptions::default()).map_err(|e| e.to_string())?;
    let seen = Arc::new(Seen {
        hits: (0..args.completions).map(|_| AtomicU8::new(0)).collect(),
        delivered: AtomicU64::new(0),
        errors: AtomicU64::new(0),
    });
    let regs: Vec<Registration> = (0..CONNS)
        .map(|_| {
            handle.register(Conn {
                seen: Arc::clone(&seen),
            })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;

    // The server's runtime: one thread; the CQ is bound on it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| e.to_string())?;
    let local = tokio::task::LocalSet::new();
    let cq = unbound.bind();
    let mut driver = {
        // AsyncFd registers with the runtime in force.
        let _in_runtime = rt.enter();
        Driver::new(cq).map_err(|e| e.to_string())?
    };

    // The NIC: a producer task on a runtime of its own, on another thread.
    let done = Arc::new(AtomicBool::new(false));
    let nic = {
        let (sim, regs, total, seed) = (sim.clone(), regs.clone(), args.completions, args.seed);
        let done = Arc::clone(&done);
        std::thread::Builder::new()
            .name("nic".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_time()
                    .build()
                    .map_err(|e| e.to_string())?;
                let produced = rt.block_on(produce(sim, regs, total, seed));
                done.store(true, Ordering::Release);
                produced
            })
            .map_err(|e| e.to_string())?
    };

    let start = Instant::now();
    let total = args.completions;
    let seen_task = Arc::clone(&seen);
    let outcome = local.block_on(&rt, async move {
        let task = tokio::task::spawn_local(async move {
            let r = tokio::time::timeout(DEADLINE, driver.run(&seen_task, total)).await;
            (r, driver)
        });
        task.await
    });
    let elapsed = start.elapsed();
    let produced = nic
        .join()
        .map_err(|_| "the producer thread panicked".to_string())??;
    let (result, driver) = outcome.map_err(|e| format!("the driving task failed: {e}"))?;
    match result {
        Ok(r) => r.map_err(|e| format!("the driving task failed: {e}"))?,
        Err(_) => {
            return Err(format!(
                "lost completions: {} of {total} handled after {DEADLINE:?}",
                seen.delivered.load(Ordering::Relaxed)
            ))
        }
    }
    let stats = driver.finish().map_err(|e| e.to_string())?;
    let sim_stats = sim.stats();
    let snap = handle.snapshot();

    println!(
        "tokio_event: {total} completions in {:.0} ms on one current-thread runtime \
         ({} posted in bursts, {} landed between poll and arm, {} flushed)",
        elapsed.as_secs_f64() * 1e3,
        produced.posted - produced.injected,
        produced.injected,
        produced.flushed
    );
    println!(
        "  wake-ups {} (notifications {}, spurious {}), arms {}, re-polls {} (found {})",
        stats.wakeups, stats.events, stats.spurious, stats.arms, stats.repolls, stats.repoll_found
    );
    println!(
        "  safety timeouts {}, recovered {} (the simulated CQ dropped {} notifications, invented {})",
        stats.timeouts, stats.recovered, sim_stats.dropped, sim_stats.spurious
    );
    println!(
        "  acknowledged {} of {} notifications, in {} batches of {ACK_BATCH} and one at the end",
        snap.acks, snap.events, stats.ack_batches
    );

    // The checks.
    let mut failures = Vec::new();
    let wrong: Vec<(usize, u8)> = seen
        .hits
        .iter()
        .enumerate()
        .map(|(t, h)| (t, h.load(Ordering::Relaxed)))
        .filter(|&(_, n)| n != 1)
        .take(5)
        .collect();
    if !wrong.is_empty() {
        failures.push(format!("not exactly once (tag, times): {wrong:?}"));
    }
    if produced.posted != total || snap.completions != total {
        failures.push(format!(
            "posted {}, polled {}, expected {total}",
            produced.posted, snap.completions
        ));
    }
    if seen.errors.load(Ordering::Relaxed) != produced.flushed {
        failures.push(format!(
            "{} errors for {} flushed",
            seen.errors.load(Ordering::Relaxed),
            produced.flushed
        ));
    }
    let outstanding: u64 = regs.iter().map(|r| r.ledger().outstanding()).sum();
    if outstanding != 0 {
        failures.push(format!("{outstanding} requests still outstanding"));
    }
    if snap.acks != snap.events {
        failures.push(format!(
            "{} notifications taken, {} acknowledged",
            snap.events, snap.acks
        ));
    }
    if stats.recovered > sim_stats.dropped {
        failures.push(format!(
            "a lost wake-up: the safety net recovered {} times, but only {} notifications were dropped",
            stats.recovered, sim_stats.dropped
        ));
    }
    if stats.async_events > 0 {
        failures.push(format!(
            "{} asynchronous events (the producer paces itself: no overflow expected)",
            stats.async_events
        ));
    }
    if produced.injected > 0 && stats.repoll_found == 0 {
        failures.push("the re-poll after arming never found the injected completions".into());
    }
    if !done.load(Ordering::Acquire) {
        failures.push("the producer did not finish".into());
    }
    if failures.is_empty() {
        println!("every completion handled exactly once; every notification acknowledged; no lost wake-up");
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tokio_event: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tokio_event: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
