//! Pool counters and their serde snapshot.
//!
//! Every counter has exactly one writer (a worker writes its own
//! [`WorkerCounters`], a sink its own [`SinkCounters`]), so a bump is a
//! `Relaxed` load and store, not a read-modify-write, and each writer's
//! counters sit on their own cache line. Readers take a [`PoolSnapshot`] at
//! any time; a snapshot is not atomic across counters.
//!
//! These atomics are plain `std` ones, not the `sync` shim's: they carry no
//! ordering the protocols rely on, and loom need not explore them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};

use crossbeam_utils::CachePadded;
use serde::{Deserialize, Serialize};

/// Adds `n` to a counter that only the calling thread writes.
#[inline]
fn add(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Relaxed).wrapping_add(n), Relaxed);
}

/// One worker's counters, written only by that worker.
#[derive(Debug, Default)]
pub(crate) struct WorkerCounters {
    items: AtomicU64,
    batches: AtomicU64,
    parks: AtomicU64,
    wakeups: AtomicU64,
    depth_high_water: AtomicU64,
    panics: AtomicU64,
}

impl WorkerCounters {
    #[inline]
    pub(crate) fn batch(&self, items: usize) {
        add(&self.items, items as u64);
        add(&self.batches, 1);
    }

    #[inline]
    pub(crate) fn depth(&self, depth: usize) {
        if depth as u64 > self.depth_high_water.load(Relaxed) {
            self.depth_high_water.store(depth as u64, Relaxed);
        }
    }

    pub(crate) fn park(&self) {
        add(&self.parks, 1);
    }

    pub(crate) fn wakeup(&self) {
        add(&self.wakeups, 1);
    }

    pub(crate) fn panic(&self) {
        add(&self.panics, 1);
    }

    pub(crate) fn snapshot(&self, name: &str) -> WorkerSnapshot {
        WorkerSnapshot {
            name: name.to_owned(),
            items: self.items.load(Relaxed),
            batches: self.batches.load(Relaxed),
            parks: self.parks.load(Relaxed),
            wakeups: self.wakeups.load(Relaxed),
            depth_high_water: self.depth_high_water.load(Relaxed),
            panics: self.panics.load(Relaxed),
        }
    }
}

/// One sink's counters, written only by the thread that owns the sink.
#[derive(Debug, Default)]
pub(crate) struct SinkCounters {
    dropped: AtomicBool,
    offers: AtomicU64,
    accepted: AtomicU64,
    refused: AtomicU64,
    unparks: AtomicU64,
}

impl SinkCounters {
    /// The sink was dropped.
    pub(crate) fn dropped(&self) {
        self.dropped.store(true, Relaxed);
    }

    #[inline]
    pub(crate) fn offer(&self, accepted: usize, refused: usize, unparks: usize) {
        add(&self.offers, 1);
        add(&self.accepted, accepted as u64);
        // Rarely non-zero: spare the stores.
        if refused > 0 {
            add(&self.refused, refused as u64);
        }
        if unparks > 0 {
            add(&self.unparks, unparks as u64);
        }
    }

    /// Unparks of a wake-up check run outside an offer (a settle).
    #[inline]
    pub(crate) fn unparked(&self, unparks: usize) {
        if unparks > 0 {
            add(&self.unparks, unparks as u64);
        }
    }

    pub(crate) fn snapshot(&self) -> SinkSnapshot {
        SinkSnapshot {
            offers: self.offers.load(Relaxed),
            accepted: self.accepted.load(Relaxed),
            refused: self.refused.load(Relaxed),
            unparks: self.unparks.load(Relaxed),
        }
    }
}

/// Cache-padded counters of one pool, shared by its workers, sinks and
/// [`PoolMonitor`](super::PoolMonitor)s.
#[derive(Debug)]
pub(crate) struct PoolCounters {
    pub(crate) name: String,
    pub(crate) capacity: usize,
    pub(crate) workers: Box<[CachePadded<WorkerCounters>]>,
    pub(crate) worker_names: Box<[String]>,
    pub(crate) sinks: Box<[CachePadded<SinkCounters>]>,
}

impl PoolCounters {
    /// The indices of the sinks not yet dropped.
    pub(crate) fn live_sinks(&self) -> Vec<usize> {
        self.sinks
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.dropped.load(Relaxed))
            .map(|(i, _)| i)
            .collect()
    }

    pub(crate) fn snapshot(&self) -> PoolSnapshot {
        PoolSnapshot {
            name: self.name.clone(),
            ring_capacity: self.capacity as u64,
            workers: self
                .workers
                .iter()
                .zip(self.worker_names.iter())
                .map(|(w, n)| w.snapshot(n))
                .collect(),
            sinks: self.sinks.iter().map(|s| s.snapshot()).collect(),
        }
    }
}

/// One worker's counters at the time of a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct WorkerSnapshot {
    /// The worker's thread name, e.g. `cqd-worker-io-3`.
    pub name: String,
    /// Work items handed to the work function (including those that panicked).
    pub items: u64,
    /// Batches taken from the rings.
    pub batches: u64,
    /// Times the worker parked.
    pub parks: u64,
    /// Times a park returned with work waiting.
    pub wakeups: u64,
    /// The deepest any of its rings was when the worker took a batch.
    pub depth_high_water: u64,
    /// Work items whose work function panicked (caught; the worker went on).
    pub panics: u64,
}

/// One sink's (one producer's) counters at the time of a snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SinkSnapshot {
    /// Calls to `offer` that had something to offer.
    pub offers: u64,
    /// Items taken into the rings.
    pub accepted: u64,
    /// Items left in the caller's queue because a ring was full (each offer
    /// counts the items it refused, so one item may count several times).
    pub refused: u64,
    /// Workers unparked (empty→non-empty transitions that found the worker
    /// asleep).
    pub unparks: u64,
}

/// A pool's counters at the time of a snapshot; serde-ready, to be folded
/// into the dispatcher's global snapshot.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PoolSnapshot {
    /// The pool's name from the topology.
    pub name: String,
    /// Slots per ring (the configured capacity rounded up to a power of two).
    pub ring_capacity: u64,
    /// One entry per worker, in worker order.
    pub workers: Vec<WorkerSnapshot>,
    /// One entry per sink, in the order the sinks were returned at spawn.
    pub sinks: Vec<SinkSnapshot>,
}

impl PoolSnapshot {
    /// Items handled by all workers.
    pub fn items(&self) -> u64 {
        self.workers.iter().map(|w| w.items).sum()
    }

    /// Panics caught in all workers.
    pub fn panics(&self) -> u64 {
        self.workers.iter().map(|w| w.panics).sum()
    }

    /// Items accepted by all sinks.
    pub fn accepted(&self) -> u64 {
        self.sinks.iter().map(|s| s.accepted).sum()
    }
}

/// One line: items over the workers, batches, parks, wake-ups, the
/// deepest ring and panics (the form reports print).
impl std::fmt::Display for PoolSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let items: Vec<String> = self.workers.iter().map(|w| w.items.to_string()).collect();
        let sum = |g: fn(&WorkerSnapshot) -> u64| -> u64 { self.workers.iter().map(g).sum() };
        write!(
            f,
            "pool {}: {} items over {} workers ({}) in {} batches, {} parks, {} wake-ups, deepest ring {}, {} panics",
            self.name,
            self.items(),
            self.workers.len(),
            items.join(" + "),
            sum(|w| w.batches),
            sum(|w| w.parks),
            sum(|w| w.wakeups),
            self.workers.iter().map(|w| w.depth_high_water).max().unwrap_or(0),
            self.panics()
        )
    }
}
