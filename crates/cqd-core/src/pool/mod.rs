//! Worker pools: the lock-free hand-off from pollers to worker threads.
//!
//! Handlers run on a poller thread and must not block, so heavy work goes to
//! a pool. A pool of `n` workers fed by `p` pollers has `p × n` bounded SPSC
//! rings: each [`PoolSink`] (one per poller, a [`WorkSink`](crate::sink::WorkSink))
//! owns one ring to every worker, so every ring has exactly one producer and
//! one consumer. The poller offers each drained batch at once: one
//! publication per ring per offer, and a wake-up only when a ring goes from
//! empty to non-empty while its worker sleeps (see the `park` protocol in
//! this module's source, model-checked by `tests/loom_worker.rs`). While
//! rounds keep finding completions the poller offers in bursts
//! ([`WorkSink::offer_burst`](crate::sink::WorkSink::offer_burst)): the
//! fence and wake-up check are then owed to a later offer for as long as
//! the workers look awake, at most [`MAX_DEFERRED_CHECKS`] offers, and an
//! offer may hold its publication back for the next hand-off, once in a
//! row ("Held publications" in the `park` protocol).
//!
//! Routing: [`Route::Key`](crate::sink::Route::Key) hashes to a fixed worker
//! ([`worker_for_key`]), so per-key order holds; `Route::LeastLoaded` goes to
//! the shallowest ring. A full ring refuses; the refused items stay in the
//! poller's spill queue, in order, and are offered again next loop.
//!
//! Panics in the work function are caught and counted; the worker goes on.
//!
//! Memory is bounded by the capacities: the rings hold at most
//! `p × n × capacity` items (a worker frees the slots of a batch when it has
//! run the whole batch, at most [`MAX_BATCH`] items), plus what each poller
//! keeps in its spill queue, at most its high-water mark + `m × B × k` (`k`
//! CQs polled `B` completions at a time, at most `m` items emitted per
//! completion; see [`PollerBuilder::spill_high_water_mark`](crate::poller::PollerBuilder::spill_high_water_mark)).
//! A poller that waits for ring space sleeps until a worker frees some (the
//! `space` protocol, model-checked by `tests/loom_space.rs`).
//!
//! Stop sequence (nothing handed over is lost):
//!
//! 1. Each poller stops polling, hands over its spill (the poller's stop
//!    retries `offer`; other code can call [`PoolSink::flush`]), and drops
//!    its sink.
//! 2. Dropping a sink publishes anything staged, lowers the pool's count of
//!    live producers (`Release`), and unparks every worker.
//! 3. A worker that finds no producer left and all its rings empty exits
//!    (park step 4); until then it keeps serving, so it finishes everything
//!    handed to it.
//! 4. [`Pool::join`] joins every worker and returns the final snapshot;
//!    [`Pool::join_timeout`] gives up at a deadline and names what is left
//!    (a sink still alive, items not yet taken).
//!
//! A pool is started from plain data (its name, one thread spec per worker,
//! the ring capacity and the [`Routing`]); the public way to get that data is
//! a validated topology's
//! [`PoolPlan::spawn`](crate::topology::PoolPlan::spawn).

mod feed;
mod metrics;
mod park;
mod ring;
mod space;
mod worker;

use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;
use serde::{Deserialize, Serialize};

pub use feed::{worker_for_key, PoolSink, MAX_DEFERRED_CHECKS};
pub use metrics::{PoolSnapshot, SinkSnapshot, WorkerSnapshot};
pub use worker::{Work, MAX_BATCH};

use crate::sync::{Arc, AtomicUsize, Ordering};
use crate::thread::{SpawnError, ThreadHandle, ThreadSpec};
use metrics::{PoolCounters, SinkCounters, WorkerCounters};
use park::Bell;
use space::SpaceBell;
use worker::Worker;

/// How a worker pool spreads items over its workers (`routing` in a pool's
/// config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum Routing {
    /// Honour each item's [`Route`](crate::sink::Route), as the handler chose
    /// it: keys to fixed workers, the rest to the shallowest ring.
    #[default]
    AsRouted,
    /// Send every item to the shallowest ring, ignoring keys: for work whose
    /// order does not matter.
    LeastLoaded,
}

/// What a pool's worker does when its rings are empty (`idle` in a pool's
/// config).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
#[non_exhaustive]
pub enum WorkerIdle {
    /// Back off, then park until a producer hands it work: an idle pool
    /// costs no CPU, and each hand-off pays one `SeqCst` fence on the
    /// producer (and a wake-up when the worker had parked).
    #[default]
    Park,
    /// Spin on the rings and never park: each worker keeps a whole CPU
    /// busy even when idle, and producers skip the fence and the wake-up
    /// check. For pinned, latency-critical servers with a CPU per worker;
    /// `validate()` warns when spinning workers may share a CPU.
    Spin,
}

impl WorkerIdle {
    /// Whether this is the default, [`Park`](Self::Park).
    pub fn is_park(&self) -> bool {
        *self == WorkerIdle::Park
    }
}

/// Everything [`spawn`] needs, as plain data (checked by whoever built it).
#[derive(Debug, Clone)]
pub(crate) struct PoolSpec {
    /// The pool's name, for counters and errors.
    pub(crate) name: String,
    /// One spec per worker thread, in worker order.
    pub(crate) workers: Vec<ThreadSpec>,
    /// Slots per ring as asked (rounded up to a power of two here).
    pub(crate) capacity: usize,
    /// How sinks spread items over the workers.
    pub(crate) routing: Routing,
    /// Whether idle workers park or spin.
    pub(crate) idle: WorkerIdle,
    /// For parking workers: spin on the rings for [`park::SPIN_WINDOW`]
    /// before backing off (park step 1). Only for a pool whose CPUs no
    /// other thread of its topology may use: sharing, the spin would take
    /// the CPU from a poller that needs it.
    pub(crate) spin_before_park: bool,
}

/// What can go wrong running or stopping a pool.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// [`PoolSink::flush`] gave up with items left (workers stuck).
    #[error("flush gave up after {waited:?} with {left} items not handed over")]
    FlushTimeout {
        /// Items still in the caller's queue.
        left: usize,
        /// How long it tried.
        waited: Duration,
    },
    /// A worker thread died outside the work function (a bug in cqd).
    #[error("worker thread {worker} panicked outside the work function")]
    WorkerPanicked {
        /// The thread name.
        worker: String,
    },
    /// [`Pool::join_timeout`] gave up: workers were still running at the
    /// deadline, usually because a sink is still alive (the workers exit
    /// only once every sink is dropped) or the work function is stuck.
    #[error(
        "pool {pool}: {running} of {workers} workers still running after {waited:?}; \
         sinks still alive (by spawn index): {live_sinks:?}; {queued} items handed over \
         and not yet taken by a worker"
    )]
    JoinTimeout {
        /// The pool.
        pool: String,
        /// Worker threads that had not exited.
        running: usize,
        /// Worker threads of the pool.
        workers: usize,
        /// The sinks not yet dropped, by their index in the `Vec` that
        /// spawn returned.
        live_sinks: Vec<usize>,
        /// Items the sinks handed over that no worker has taken yet.
        queued: u64,
        /// How long it waited.
        waited: Duration,
    },
}

/// State shared by a pool's workers, sinks and monitors.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Live producers (sinks); the workers exit when it reaches zero and
    /// their rings are empty.
    pub(crate) open: CachePadded<AtomicUsize>,
    pub(crate) counters: PoolCounters,
    pub(crate) exits: Exits,
}

/// Workers that have left their loop, for [`Pool::join_timeout`]. A plain
/// std mutex and condvar, not the `sync` shim's: no lock-free protocol
/// depends on it, each worker takes it once (on exit), and it needs a timed
/// wait.
#[derive(Debug, Default)]
pub(crate) struct Exits {
    count: std::sync::Mutex<usize>,
    changed: std::sync::Condvar,
}

impl Exits {
    pub(crate) fn worker_exited(&self) {
        *self.count.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        self.changed.notify_all();
    }

    /// Waits until `workers` workers have exited or `deadline` passes;
    /// returns how many have.
    fn wait(&self, workers: usize, deadline: Option<Instant>) -> usize {
        let mut count = self.count.lock().unwrap_or_else(|e| e.into_inner());
        while *count < workers {
            count = match deadline {
                None => self.changed.wait(count).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        break;
                    }
                    match self.changed.wait_timeout(count, deadline - now) {
                        Ok((guard, _)) => guard,
                        Err(e) => e.into_inner().0,
                    }
                }
            };
        }
        *count
    }
}

/// A running pool: its worker threads and counters. Stop it by dropping
/// every [`PoolSink`], then [`join`](Pool::join).
#[derive(Debug)]
pub struct Pool {
    workers: Vec<ThreadHandle<()>>,
    shared: Arc<Shared>,
}

impl Pool {
    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.shared.counters.name
    }

    /// Worker threads.
    pub fn workers(&self) -> usize {
        self.workers.len()
    }

    /// The counters now.
    pub fn snapshot(&self) -> PoolSnapshot {
        self.shared.counters.snapshot()
    }

    /// A cloneable, `Sync` handle to the counters, for a metrics thread.
    pub fn monitor(&self) -> PoolMonitor {
        PoolMonitor {
            shared: self.shared.clone(),
        }
    }

    /// Waits until every sink is dropped and every worker has drained its
    /// rings and exited (stop steps 3 and 4), then returns the final counters.
    /// Blocks for as long as a sink is alive; [`join_timeout`](Self::join_timeout)
    /// gives up at a deadline instead.
    ///
    /// # Errors
    ///
    /// [`PoolError::WorkerPanicked`] naming the first worker thread that died
    /// outside the work function; the others are still joined.
    pub fn join(self) -> Result<PoolSnapshot, PoolError> {
        self.join_all()
    }

    /// As [`join`](Self::join), but gives up after `timeout`: the close of a
    /// pool with a deadline. On time it returns the final counters; past it
    /// the worker threads are left running (they exit on their own once
    /// every sink is gone) and the error names what was left.
    ///
    /// ```
    /// use std::time::Duration;
    /// use cqd_core::pool::PoolError;
    /// use cqd_core::topology::{PoolConfig, TopologyConfig};
    ///
    /// let mut topology = TopologyConfig::new().pool(PoolConfig::new("p", 1)).validate()?;
    /// let (pool, sinks) = topology.take_pool("p").unwrap().spawn(1, |_| |_: u32| {})?;
    /// // A sink kept alive (say, for `try_push`) keeps the workers serving.
    /// let err = pool.join_timeout(Duration::from_millis(10)).unwrap_err();
    /// assert!(matches!(&err, PoolError::JoinTimeout { live_sinks, .. } if live_sinks == &[0]));
    /// drop(sinks);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`PoolError::JoinTimeout`] at the deadline;
    /// [`PoolError::WorkerPanicked`] as for [`join`](Self::join).
    pub fn join_timeout(self, timeout: Duration) -> Result<PoolSnapshot, PoolError> {
        let started = Instant::now();
        // A timeout too large for the clock means no deadline.
        let deadline = started.checked_add(timeout);
        let workers = self.workers.len();
        let exited = self.shared.exits.wait(workers, deadline);
        if exited < workers {
            let snapshot = self.shared.counters.snapshot();
            return Err(PoolError::JoinTimeout {
                pool: snapshot.name.clone(),
                running: workers - exited,
                workers,
                live_sinks: self.shared.counters.live_sinks(),
                queued: snapshot.accepted().saturating_sub(snapshot.items()),
                waited: started.elapsed(),
            });
        }
        self.join_all()
    }

    fn join_all(self) -> Result<PoolSnapshot, PoolError> {
        let mut failed = None;
        for handle in self.workers {
            let name = handle.name().to_owned();
            if handle.join().is_err() && failed.is_none() {
                failed = Some(name);
            }
        }
        match failed {
            Some(worker) => Err(PoolError::WorkerPanicked { worker }),
            None => Ok(self.shared.counters.snapshot()),
        }
    }
}

/// A read-only handle to a pool's counters; cheap to clone.
#[derive(Debug, Clone)]
pub struct PoolMonitor {
    shared: Arc<Shared>,
}

impl PoolMonitor {
    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.shared.counters.name
    }

    /// The counters now.
    pub fn snapshot(&self) -> PoolSnapshot {
        self.shared.counters.snapshot()
    }
}

impl Shared {
    /// Shared state for `workers` workers and `sinks` sinks.
    fn new(name: &str, capacity: usize, worker_names: Vec<String>, sinks: usize) -> Self {
        Shared {
            open: CachePadded::new(AtomicUsize::new(sinks)),
            counters: PoolCounters {
                name: name.to_owned(),
                capacity,
                workers: worker_names
                    .iter()
                    .map(|_| CachePadded::new(WorkerCounters::default()))
                    .collect(),
                worker_names: worker_names.into(),
                sinks: (0..sinks)
                    .map(|_| CachePadded::new(SinkCounters::default()))
                    .collect(),
            },
            exits: Exits::default(),
        }
    }
}

/// Builds rings, starts workers, hands out sinks (for
/// [`PoolPlan::spawn`](crate::topology::PoolPlan::spawn)).
pub(crate) fn spawn<W, H, M>(
    spec: PoolSpec,
    producers: usize,
    mut make: M,
) -> Result<(Pool, Vec<PoolSink<W>>), SpawnError>
where
    W: Send + 'static,
    H: Work<W>,
    M: FnMut(usize) -> H,
{
    let PoolSpec {
        name,
        workers: specs,
        capacity,
        routing,
        idle,
        spin_before_park,
    } = spec;
    if producers == 0 {
        return Err(SpawnError::NoProducers { pool: name });
    }
    let threads = specs.len();
    let capacity = capacity.max(1).next_power_of_two();
    let shared = Arc::new(Shared::new(
        &name,
        capacity,
        specs.iter().map(|s| s.name.clone()).collect(),
        producers,
    ));
    // rings[p][w] is producer p's ring to worker w.
    let mut producer_ends: Vec<Vec<_>> = (0..producers)
        .map(|_| Vec::with_capacity(threads))
        .collect();
    let mut consumer_ends: Vec<Vec<_>> = (0..threads)
        .map(|_| Vec::with_capacity(producers))
        .collect();
    for ends in producer_ends.iter_mut() {
        for consumers in consumer_ends.iter_mut() {
            let (tx, rx) = ring::ring(capacity);
            ends.push(tx);
            consumers.push(rx);
        }
    }
    let spaces: Vec<Arc<SpaceBell>> = (0..producers)
        .map(|_| Arc::new(SpaceBell::new(threads)))
        .collect();
    let mut handles: Vec<ThreadHandle<()>> = Vec::with_capacity(threads);
    let mut bells = Vec::with_capacity(threads);
    for ((index, rings), spec) in consumer_ends.into_iter().enumerate().zip(specs) {
        let bell = Arc::new(Bell::default());
        let worker = Worker {
            index,
            rings,
            space: spaces.clone(),
            bell: bell.clone(),
            shared: shared.clone(),
            work: make(index),
            spin: idle == WorkerIdle::Spin,
            spin_window: if spin_before_park {
                park::SPIN_WINDOW
            } else {
                std::time::Duration::ZERO
            },
        };
        match crate::thread::spawn(spec, move || worker.run()) {
            Ok(handle) => {
                bells.push((bell, handle.thread().clone()));
                handles.push(handle);
            }
            Err(e) => {
                // No sink will ever exist: let the started workers exit.
                shared.open.store(0, Ordering::Release);
                for handle in &handles {
                    handle.thread().unpark();
                }
                for handle in handles {
                    let _ = handle.join();
                }
                return Err(e);
            }
        }
    }
    let sinks = producer_ends
        .into_iter()
        .zip(spaces)
        .enumerate()
        .map(|(index, (rings, space))| {
            let mut sink =
                PoolSink::new(index, rings, bells.clone(), routing, shared.clone(), space);
            sink.spinning_workers = idle == WorkerIdle::Spin;
            sink
        })
        .collect();
    Ok((
        Pool {
            workers: handles,
            shared,
        },
        sinks,
    ))
}
