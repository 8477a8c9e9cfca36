//! cqd's Event mode driven from tokio, for servers that are already async.
//!
//! ```text
//! cargo run --example tokio_event
//! cargo run --example tokio_event -- --completions 100000 --drop 0.02 --seed 7
//! ```
//!
//! Instead of a cqd poller thread, a task on the server's own
//! current-thread runtime drives the CQ: `cqd::core::driver::TokioDriver`
//! (the facade's `tokio` feature) runs the same sleep protocol as cqd's
//! Event mode — drain to empty, arm, re-poll, wait on the CQ's descriptor
//! (registered with tokio), collect and acknowledge the notifications, and
//! at the wake timeout the safety net, which counts completions whose
//! notification was lost as recovered. The user's code has no protocol of
//! its own and no `unsafe`; the driver's stop returns the same report a
//! poller thread's does, so `shutdown` can take it too.
//!
//! The NIC is the simulated one (cqd-sim), with a producer task on a
//! runtime of its own (another thread, as a NIC is): it posts bursts
//! through the posting call on a loopback QP, now and then makes
//! completions land between the task's last empty poll and its arm (only
//! the re-poll after the arm finds those without the safety net), and the
//! simulated CQ drops and invents notifications at random. At the end the
//! example checks that every completion reached its handler exactly once,
//! that the accounts balance, that every notification was acknowledged, and
//! that the safety net recovered no more completions than the simulated CQ
//! dropped notifications (a lost wake-up of the protocol's own would show
//! there); it exits non-zero otherwise.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::driver::TokioDriver;
use cqd::core::{
    split, Completion, CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Opcode, Outbox,
    RecvDone, Registration, SendDone, Status,
};
use cqd::sim::{sim_cq, Faults, LoopWr, Loopback, SimCq};

/// The safety net's timeout (a poller thread's default is 100 ms; shorter
/// here so that dropped notifications cost the example little time).
const WAKE_TIMEOUT: Duration = Duration::from_millis(10);
/// Everything must be handled within this, or the example fails.
const DEADLINE: Duration = Duration::from_secs(60);
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

    // The server's runtime: one thread; the driver is a task of it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|e| e.to_string())?;
    let local = tokio::task::LocalSet::new();

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
    let report = local.block_on(&rt, async {
        let driver = TokioDriver::new("rx", NoSink)
            .cq(unbound)
            .wake_timeout(WAKE_TIMEOUT)
            .spawn_local()
            .map_err(|e| e.to_string())?;
        while seen.delivered.load(Ordering::Relaxed) < total && start.elapsed() < DEADLINE {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok::<_, String>(driver.stop().await)
    })?;
    let elapsed = start.elapsed();
    let produced = nic
        .join()
        .map_err(|_| "the producer thread panicked".to_string())??;
    let sim_stats = sim.stats();
    let snap = &report.cqs[0];

    println!(
        "tokio_event: {total} completions in {:.0} ms on one current-thread runtime \
         ({} posted in bursts, {} landed between poll and arm, {} flushed)",
        elapsed.as_secs_f64() * 1e3,
        produced.posted - produced.injected,
        produced.injected,
        produced.flushed
    );
    print!("{report}");
    println!(
        "  the simulated CQ dropped {} notifications and invented {}; the safety net recovered {}",
        sim_stats.dropped, sim_stats.spurious, snap.recovered_missed_events
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
    if !report.is_clean() {
        failures.push("the driver's report is not clean (above)".into());
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
    if snap.recovered_missed_events > sim_stats.dropped {
        failures.push(format!(
            "a lost wake-up: the safety net recovered {} times, but only {} notifications were dropped",
            snap.recovered_missed_events, sim_stats.dropped
        ));
    }
    if snap.async_events > 0 {
        failures.push(format!(
            "{} asynchronous events (the producer paces itself: no overflow expected)",
            snap.async_events
        ));
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
