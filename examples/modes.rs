//! Completions flowing through a poller to handlers, in every poll mode.
//!
//! ```text
//! cargo run --release --example modes
//! cargo run --release --example modes -- --completions 500000 --burst 64 --gap-us 20
//! ```
//!
//! For each mode (busy, event, hybrid, adaptive) it makes a simulated CQ,
//! registers 8 handlers (send and receive completions mixed on one CQ, some
//! errors and flushes), and runs a producer that posts bursts — through the
//! posting call, on a loopback QP whose posts complete at once — with pauses
//! between them — the pattern that separates the modes: busy polling burns
//! the pauses (naps through those past 100 µs), event mode sleeps through
//! them and pays wake-ups, hybrid and adaptive spin across short pauses and
//! sleep through long ones. It checks
//! that every completion reached the right callback exactly once and prints
//! the counters side by side.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::PollerReport;
use cqd::core::{
    split, CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Outbox, PollMode, PollerBuilder,
    RecvDone, Registration, SendDone, Status,
};
use cqd::sim::{sim_cq, Faults, LoopWr, Loopback};

/// Counts what a handler saw.
#[derive(Default)]
struct Seen {
    sends: AtomicU64,
    recvs: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
}

struct Conn {
    seen: Arc<Seen>,
}

impl Handler for Conn {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.sends.fetch_add(1, Ordering::Relaxed);
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.recvs.fetch_add(1, Ordering::Relaxed);
        self.seen
            .bytes
            .fetch_add(u64::from(d.byte_len()), Ordering::Relaxed);
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.errors.fetch_add(1, Ordering::Relaxed);
    }
}

struct Args {
    completions: u64,
    burst: u64,
    gap: Duration,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        completions: 200_000,
        burst: 32,
        gap: Duration::from_micros(50),
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
            "--burst" => a.burst = value("--burst")?.max(1),
            "--gap-us" => a.gap = Duration::from_micros(value("--gap-us")?),
            other => {
                return Err(format!(
                    "unknown argument {other} (try --completions N --burst N --gap-us N)"
                ))
            }
        }
    }
    Ok(a)
}

fn run(mode: PollMode, args: &Args) -> Result<(PollerReport, Duration, u64), String> {
    let (producer, source) = sim_cq(format!("cq-{}", mode.name()), 4096, Faults::default())
        .map_err(|e| e.to_string())?;
    let (poller, handle) =
        split::<NoWork>(source, CqOptions::default()).map_err(|e| e.to_string())?;
    let seen = Arc::new(Seen::default());
    let regs: Vec<Registration> = (0..8)
        .map(|_| {
            handle.register(Conn {
                seen: Arc::clone(&seen),
            })
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let thread = PollerBuilder::new(mode.name(), NoSink)
        .mode(mode)
        .cq(poller)
        .spawn()
        .map_err(|e| e.to_string())?;

    // A loopback QP: each post completes at once on the CQ, with the
    // status the request asks for; posts go through the one posting call.
    let qp = Loopback::new(producer.clone(), 1);
    let start = Instant::now();
    let mut posted = 0u64;
    while posted < args.completions {
        let burst = args.burst.min(args.completions - posted);
        // Never overflow the CQ: wait while it is nearly full, as credits would.
        while producer.len() + burst as usize >= producer.capacity() as usize {
            std::thread::yield_now();
        }
        for _ in 0..burst {
            let reg = &regs[(posted % 8) as usize];
            let tag = posted % (1 << 20);
            match posted % 100 {
                0 => reg.post_send(
                    &qp,
                    &mut [LoopWr::new(tag, OpKind::Send).failing(Status::WrFlush)],
                ),
                n if n % 2 == 0 => reg.post_send(&qp, &mut [LoopWr::new(tag, OpKind::Send)]),
                _ => reg.post_recv(&qp, &mut [LoopWr::new(tag, OpKind::Recv).with_len(4096)]),
            }
            .map_err(|e| e.to_string())?;
            posted += 1;
        }
        if !args.gap.is_zero() {
            std::thread::sleep(args.gap);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    let total = |s: &Seen| {
        s.sends.load(Ordering::Relaxed)
            + s.recvs.load(Ordering::Relaxed)
            + s.errors.load(Ordering::Relaxed)
    };
    while total(&seen) < args.completions && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(100));
    }
    let elapsed = start.elapsed();
    let report = thread.stop().map_err(|e| e.to_string())?;
    let delivered = total(&seen);
    if delivered != args.completions {
        return Err(format!(
            "{}: delivered {delivered} of {}",
            mode.name(),
            args.completions
        ));
    }
    let outstanding: u64 = regs.iter().map(|r| r.ledger().outstanding()).sum();
    if outstanding != 0 {
        return Err(format!(
            "{}: {outstanding} requests still outstanding",
            mode.name()
        ));
    }
    Ok((report, elapsed, seen.errors.load(Ordering::Relaxed)))
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("modes: {e}");
            std::process::exit(2);
        }
    };
    println!(
        "{} completions per mode in bursts of {} every {:?}, 8 handlers, one simulated CQ of 4096",
        args.completions, args.burst, args.gap
    );
    println!(
        "{:<9} {:>9} {:>7} {:>8} {:>8} {:>11} {:>7} {:>7} {:>7} {:>9} {:>9} {:>6}",
        "mode",
        "delivered",
        "errors",
        "time ms",
        "cpu ms",
        "polls",
        "empty%",
        "sleeps",
        "events",
        "spurious",
        "recovered",
        "stale"
    );
    let mut failed = false;
    for mode in PollMode::all() {
        match run(mode, &args) {
            Ok((r, elapsed, errors)) => {
                let c = &r.cqs[0];
                let empty = 100.0 * c.empty_polls as f64 / c.polls.max(1) as f64;
                println!(
                    "{:<9} {:>9} {:>7} {:>8.1} {:>8.1} {:>11} {:>6.1}% {:>7} {:>7} {:>9} {:>9} {:>6}",
                    mode.name(),
                    c.completions,
                    errors,
                    elapsed.as_secs_f64() * 1e3,
                    r.poller.cpu_ns as f64 / 1e6,
                    c.polls,
                    empty,
                    r.poller.sleeps,
                    c.events,
                    c.spurious_wakeups,
                    c.recovered_missed_events,
                    c.stale_wr_ids
                );
            }
            Err(e) => {
                eprintln!("modes: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
    println!("every completion reached its handler exactly once in every mode");
}
