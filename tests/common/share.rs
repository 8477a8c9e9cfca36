//! How much CPU a busy producer thread gets while idle pollers run beside
//! it: the harness of `tests/cpu_share.rs` and of `benches/busy_share.rs`.
//!
//! 1. Pick a CPU (the last one this process may use, away from CPU 0's
//!    interrupts) and, if the setup is pinned, pin the producer thread to
//!    it; a refused pin is a skip.
//! 2. Start the pollers, each on an idle simulated CQ and, if pinned,
//!    pinning itself to that CPU first thing (`on_start`).
//! 3. The producer reads the CPU time of every thread of the setup, counts
//!    in a busy loop for the window (or sleeps through it), and reads them
//!    again.
//! 4. Stop the pollers.
#![allow(dead_code)]

use std::hint::black_box;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cqd::core::{split, CqOptions, NoSink, NoWork, PollMode, PollerBuilder, PollerThread};
use cqd::sim::{sim_cq, Faults, SimCq};

/// One measurement.
#[derive(Debug, Clone)]
pub struct Setup {
    /// The pollers' mode.
    pub mode: PollMode,
    /// How many pollers.
    pub pollers: usize,
    /// The producer's window.
    pub window: Duration,
    /// Whether the producer counts (or sleeps through the window, leaving
    /// the CPU to the pollers).
    pub count: bool,
    /// Whether the producer and the pollers are pinned to one CPU (or left
    /// to the scheduler).
    pub pinned: bool,
    /// Prefix of the poller names, unique among setups measured at once.
    pub tag: String,
}

impl Setup {
    /// `pollers` idle pollers in `mode` pinned with a counting producer for
    /// 500 ms.
    pub fn new(mode: PollMode, pollers: usize) -> Self {
        Setup {
            mode,
            pollers,
            window: Duration::from_millis(500),
            count: true,
            pinned: true,
            tag: mode.name()[..1].to_string(),
        }
    }
}

/// What the producer got during its window.
#[derive(Debug, Clone, Copy)]
pub struct Share {
    /// The CPU everything was pinned to (the CPU it would have been, when
    /// unpinned).
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

    /// The pollers' CPU time as a fraction of the window.
    pub fn pollers_of_wall(&self) -> f64 {
        self.pollers.as_secs_f64() / self.wall.as_secs_f64()
    }

    /// The producer's fraction of the CPU time the threads of the setup
    /// used (the producer and the pollers). Unlike [`of_wall`](Self::of_wall)
    /// it does not move when other processes load the same CPU.
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

/// Pins the calling thread to `cpu`, if there is one.
fn pin(cpu: Option<usize>) -> Result<(), String> {
    match cpu {
        None => Ok(()),
        Some(id) if core_affinity::set_for_current(core_affinity::CoreId { id }) => Ok(()),
        Some(id) => Err(format!("cannot pin a thread to CPU {id}")),
    }
}

/// Pollers running on idle CQs.
struct Idle {
    threads: Vec<PollerThread>,
    /// The CQs' producer ends, kept alive.
    _cqs: Vec<SimCq>,
    /// The threads' names as Linux shows them.
    names: Vec<String>,
}

/// Step 2: `n` pollers in `mode` on idle CQs, each pinned to `cpu` if
/// given.
fn idle_pollers(mode: PollMode, n: usize, cpu: Option<usize>, tag: &str) -> Result<Idle, String> {
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
    Ok(Idle {
        threads,
        _cqs: cqs,
        names,
    })
}

/// Step 3, on the producer thread, once it has the pollers' thread ids.
fn count(setup: &Setup, cpu: usize, tids: &[String]) -> Result<Share, String> {
    let me = || cpu_time_at("/proc/thread-self/schedstat");
    let them = || -> Option<Duration> { tids.iter().map(|t| cpu_time_of(t)).sum() };
    let (p0, q0) = (me(), them());
    let start = Instant::now();
    if setup.count {
        let mut n = 0u64;
        while start.elapsed() < setup.window {
            for _ in 0..10_000 {
                n = black_box(n + 1);
            }
        }
    } else {
        std::thread::sleep(setup.window);
    }
    let wall = start.elapsed();
    let (p1, q1) = (me(), them());
    let unreadable = || "cannot read thread CPU times from /proc".to_string();
    Ok(Share {
        cpu,
        wall,
        producer: p1.ok_or_else(unreadable)? - p0.ok_or_else(unreadable)?,
        pollers: q1.ok_or_else(unreadable)? - q0.ok_or_else(unreadable)?,
        naps: 0,
    })
}

/// Steps 1–4. `Err` is the reason to skip: the CPU cannot be pinned, or
/// thread CPU times cannot be read.
pub fn producer_share(setup: &Setup) -> Result<Share, String> {
    // 1. The CPU, and the producer.
    let cpu = core_affinity::get_core_ids()
        .and_then(|ids| ids.iter().map(|c| c.id).max())
        .ok_or("cannot read the CPUs this process may use")?;
    let pinned = setup.pinned.then_some(cpu);
    let (go_tx, go_rx) = mpsc::channel::<Vec<String>>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<(), String>>();
    let theirs = setup.clone();
    let producer = std::thread::Builder::new()
        .name(format!("{}-producer", setup.tag))
        .spawn(move || -> Result<Share, String> {
            let ready = pin(pinned);
            let _ = ready_tx.send(ready.clone());
            ready?;
            let tids = go_rx.recv().map_err(|_| "no pollers started".to_string())?;
            count(&theirs, cpu, &tids)
        })
        .map_err(|e| e.to_string())?;
    let ready = ready_rx
        .recv()
        .map_err(|_| "the producer thread died".to_string())
        .and_then(|r| r);
    // 2. The pollers, once the producer is placed.
    let started = ready.and_then(|()| idle_pollers(setup.mode, setup.pollers, pinned, &setup.tag));
    let Idle {
        threads,
        names,
        _cqs,
    } = match started {
        Ok(started) => started,
        Err(reason) => {
            drop(go_tx);
            let _ = producer.join();
            return Err(reason);
        }
    };
    let tids = tids_named(&names);
    if tids.len() != names.len() {
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
