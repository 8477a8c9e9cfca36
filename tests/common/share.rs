//! How much of one CPU a busy producer thread gets while idle pollers are
//! pinned to the same CPU: the harness of `tests/cpu_share.rs` and of
//! `benches/busy_share.rs`.
//!
//! 1. Pick a CPU (the last one this process may use, away from CPU 0's
//!    interrupts) and pin the producer thread to it; a refused pin is a skip.
//! 2. Start the pollers, each pinning itself to that CPU first thing
//!    (`on_start`), each on an idle simulated CQ.
//! 3. The producer reads the CPU time of every thread on the CPU, counts in a
//!    busy loop for the window, and reads them again.
//! 4. Stop the pollers.
#![allow(dead_code)]

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cqd::core::{split, CqOptions, NoSink, NoWork, PollMode, PollerBuilder, PollerThread};
use cqd::sim::{sim_cq, Faults, SimCq};

/// What the producer got during its window.
#[derive(Debug, Clone, Copy)]
pub struct Share {
    /// The CPU everything ran on.
    pub cpu: usize,
    /// The producer's window (wall time).
    pub wall: Duration,
    /// CPU time the producer got in the window.
    pub producer: Duration,
    /// CPU time all the pollers together got in the window.
    pub pollers: Duration,
    /// Naps the pollers took, window or not (`PollerSnapshot::naps`).
    pub naps: u64,
}

impl Share {
    /// The producer's CPU time as a fraction of the window.
    pub fn of_wall(&self) -> f64 {
        self.producer.as_secs_f64() / self.wall.as_secs_f64()
    }

    /// The producer's fraction of the CPU time the threads on its CPU used
    /// (the producer and the pollers). Unlike [`of_wall`](Self::of_wall) it
    /// does not move when other processes load the same CPU.
    pub fn of_used(&self) -> f64 {
        let used = self.producer + self.pollers;
        self.producer.as_secs_f64() / used.as_secs_f64().max(f64::MIN_POSITIVE)
    }
}

/// A thread's CPU time from its schedstat file (the first field is
/// nanoseconds on a CPU).
fn cpu_time_at(schedstat: &str) -> Option<Duration> {
    let text = std::fs::read_to_string(schedstat).ok()?;
    let ns = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// The CPU time of thread `tid` of this process.
fn cpu_time_of(tid: &str) -> Option<Duration> {
    cpu_time_at(&format!("/proc/self/task/{tid}/schedstat"))
}

/// The thread ids of this process whose name is one of `names`.
fn tids_named(names: &[String]) -> Vec<String> {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| {
            let tid = e.file_name().into_string().ok()?;
            let comm = std::fs::read_to_string(e.path().join("comm")).ok()?;
            names.iter().any(|n| n == comm.trim_end()).then_some(tid)
        })
        .collect()
}

fn pin(cpu: usize) -> Result<(), String> {
    if core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        Ok(())
    } else {
        Err(format!("cannot pin a thread to CPU {cpu}"))
    }
}

/// Starts `n` pollers in `mode` on idle CQs, each pinned to `cpu`; their
/// thread names and the CQs' producer ends (kept alive).
pub fn pinned_pollers(
    mode: PollMode,
    n: usize,
    cpu: usize,
    tag: &str,
) -> Result<(Vec<PollerThread>, Vec<SimCq>, Vec<String>), String> {
    let (mut threads, mut cqs, mut names) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..n {
        let name = format!("{tag}{i}");
        let (producer, source) =
            sim_cq(&name, 256, Faults::default()).map_err(|e| e.to_string())?;
        let (cq, _handle) =
            split::<NoWork>(source, CqOptions::default()).map_err(|e| e.to_string())?;
        let thread = PollerBuilder::new(name.clone(), NoSink)
            .mode(mode)
            .on_start(move || pin(cpu))
            .cq(cq)
            .spawn()
            .map_err(|e| e.to_string())?;
        // The thread is cqd-poller-<name>; Linux keeps 15 bytes of it.
        let mut comm = format!("cqd-poller-{name}");
        comm.truncate(15);
        names.push(comm);
        threads.push(thread);
        cqs.push(producer);
    }
    Ok((threads, cqs, names))
}

/// Steps 1–4: `pollers` idle pollers in `mode` share a CPU with a producer
/// that counts for `window` (or, with `count` false, sleeps through it, so
/// that the pollers have the CPU to themselves). `Err` is the reason to skip
/// (the CPU cannot be pinned, or thread CPU times cannot be read).
pub fn producer_share(
    mode: PollMode,
    pollers: usize,
    window: Duration,
    count: bool,
    tag: &str,
) -> Result<Share, String> {
    // 1. The CPU, and a producer pinned to it.
    let cpu = core_affinity::get_core_ids()
        .and_then(|ids| ids.iter().map(|c| c.id).max())
        .ok_or("cannot read the CPUs this process may use")?;
    let (go_tx, go_rx) = mpsc::channel::<Vec<String>>();
    let (pinned_tx, pinned_rx) = mpsc::channel::<Result<(), String>>();
    let producer = std::thread::Builder::new()
        .name(format!("{tag}-producer"))
        .spawn(move || -> Result<Share, String> {
            let pinned = pin(cpu);
            let _ = pinned_tx.send(pinned.clone());
            pinned?;
            let tids = go_rx.recv().map_err(|_| "no pollers started".to_string())?;
            // 3. Count, between two readings of every thread's CPU time.
            let me = || cpu_time_at("/proc/thread-self/schedstat");
            let read =
                |tids: &[String]| -> Option<Duration> { tids.iter().map(|t| cpu_time_of(t)).sum() };
            let (p0, q0) = (me(), read(&tids));
            let start = Instant::now();
            let mut n = 0u64;
            while count && start.elapsed() < window {
                for _ in 0..10_000 {
                    n = black_box(n + 1);
                }
            }
            if !count {
                std::thread::sleep(window);
            }
            let wall = start.elapsed();
            let (p1, q1) = (me(), read(&tids));
            let cpu_times = "cannot read thread CPU times from /proc";
            let (p0, p1, q0, q1) = (
                p0.ok_or(cpu_times)?,
                p1.ok_or(cpu_times)?,
                q0.ok_or(cpu_times)?,
                q1.ok_or(cpu_times)?,
            );
            Ok(Share {
                cpu,
                wall,
                producer: p1.saturating_sub(p0),
                pollers: q1.saturating_sub(q0),
                naps: 0,
            })
        })
        .map_err(|e| e.to_string())?;
    let pinned = pinned_rx
        .recv()
        .map_err(|_| "the producer thread died".to_string());
    if let Err(reason) = pinned.and_then(|r| r) {
        let _ = producer.join();
        return Err(reason);
    }
    // 2. The pollers.
    let (threads, _cqs, names) = match pinned_pollers(mode, pollers, cpu, tag) {
        Ok(started) => started,
        Err(reason) => {
            drop(go_tx);
            let _ = producer.join();
            return Err(reason);
        }
    };
    let tids = tids_named(&names);
    if tids.len() != names.len() {
        drop(go_tx);
        let _ = producer.join();
        return Err(format!("cannot find the poller threads {names:?} in /proc"));
    }
    let _ = go_tx.send(tids);
    let share = producer
        .join()
        .map_err(|_| "the producer panicked".to_string())?;
    // 4. Stop.
    let mut naps = 0;
    for t in threads {
        naps += t.stop().map_err(|e| e.to_string())?.poller.naps;
    }
    share.map(|s| Share { naps, ..s })
}
