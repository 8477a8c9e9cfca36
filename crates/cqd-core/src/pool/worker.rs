//! The worker thread: serve the rings, catch panics, park when idle.
//!
//! Loop (the park/unpark steps are those of [`park`](super::park)):
//!
//! 1. One pass over the worker's rings (one per producer): from each
//!    non-empty ring take up to [`MAX_BATCH`] items under one
//!    `catch_unwind`, and free the batch's slots with one store. A panic
//!    frees what was taken, is counted, and the batch goes on after it.
//! 2. If the pass found work: one fence, then wake each producer that waits
//!    for space in a ring the pass freed slots of (space steps 2 and 3, see
//!    [`space`](super::space)); call [`Work::batch_done`] and go to 1.
//! 3. Otherwise go idle: spin, announce, re-check, park (park steps 1–5).
//!    Work found: go to 1. Every producer gone and every ring empty: return.
//!
//! A pool configured to spin ([`WorkerIdle::Spin`](super::WorkerIdle::Spin))
//! replaces step 3 with: read `open`, re-check the rings, return if no
//! producer is left and they are empty, else spin once and go to 1.
//!
//! On its way out (a return or an unwind) the worker counts itself exited,
//! which [`Pool::join_timeout`](super::Pool::join_timeout) waits for.

use std::panic::{catch_unwind, AssertUnwindSafe};

use super::park::{Bell, Idle};
use super::ring::Consumer;
use super::space::{consumer_fence, SpaceBell};
use super::Shared;
use crate::sync::{Arc, Ordering};

/// The most items a worker takes from one ring before looking at the next.
pub const MAX_BATCH: usize = 256;

/// What a worker does with each item. Implemented for every
/// `FnMut(W) + Send + 'static` closure; implement it on a struct to keep
/// per-worker state (a buffer pool, a queue pair, a batch of replies to post)
/// and to use [`batch_done`](Work::batch_done).
///
/// A panic in `run` or `batch_done` is caught and counted in the worker's
/// `panics`; the worker goes on with the same value, so state that a panic
/// can leave half-updated must tolerate it (as with `AssertUnwindSafe`).
pub trait Work<W>: Send + 'static {
    /// Handles one item.
    fn run(&mut self, item: W);

    /// Called after each pass that handled at least one item, before the
    /// worker looks for more or parks: the place to flush what `run`
    /// batched (for instance post all replies with one doorbell).
    fn batch_done(&mut self) {}
}

impl<W, F> Work<W> for F
where
    F: FnMut(W) + Send + 'static,
{
    fn run(&mut self, item: W) {
        self(item)
    }
}

/// One worker's state, moved onto its thread.
pub(crate) struct Worker<W, H> {
    pub(crate) index: usize,
    pub(crate) rings: Vec<Consumer<W>>,
    /// Each ring's producer's space bell, in ring order.
    pub(crate) space: Vec<Arc<SpaceBell>>,
    pub(crate) bell: Arc<Bell>,
    pub(crate) shared: Arc<Shared>,
    pub(crate) work: H,
    /// Spin on the rings instead of parking ([`WorkerIdle::Spin`](super::WorkerIdle::Spin)).
    pub(crate) spin: bool,
    /// How long park step 1 spins before backing off (zero: no spin).
    pub(crate) spin_window: std::time::Duration,
}

impl<W, H: Work<W>> Worker<W, H> {
    /// The worker loop, steps 1 to 3.
    pub(crate) fn run(mut self) {
        let shared = self.shared.clone();
        let _exit = Exit(&shared);
        let mut served = vec![false; self.rings.len()];
        let counters = &shared.counters.workers[self.index];
        let name = &shared.counters.worker_names[self.index];
        let mut woken = false;
        loop {
            // 1. One pass over the rings.
            let mut found = 0;
            for (ring, served) in self.rings.iter_mut().zip(served.iter_mut()) {
                let depth = ring.ready();
                *served = depth > 0;
                if depth == 0 {
                    continue;
                }
                counters.depth(depth);
                // One `catch_unwind` per batch, not per item: a panic unwinds
                // out of `pop_batch`, whose guard frees the slots taken so far
                // (the panicking item included); the rest are served next.
                let mut taken = 0;
                while taken < depth.min(MAX_BATCH) {
                    let work = &mut self.work;
                    let mut n = 0;
                    let outcome = catch_unwind(AssertUnwindSafe(|| {
                        ring.pop_batch(MAX_BATCH - taken, |item| {
                            n += 1;
                            work.run(item);
                        })
                    }));
                    taken += n;
                    if outcome.is_ok() {
                        break;
                    }
                    counters.panic();
                    tracing::error!(target: "cqd::pool", worker = %name, "work panicked; caught, worker goes on");
                }
                counters.batch(taken);
                found += taken;
            }
            // 2. Work done: wake producers waiting for the freed space, let
            //    the work function flush, then look again.
            if found > 0 {
                consumer_fence();
                for (space, _) in self.space.iter().zip(&served).filter(|(_, s)| **s) {
                    space.wake_if_waiting(self.index);
                }
                if woken {
                    counters.wakeup();
                    woken = false;
                }
                if catch_unwind(AssertUnwindSafe(|| self.work.batch_done())).is_err() {
                    counters.panic();
                    tracing::error!(target: "cqd::pool", worker = %name, "batch_done panicked; caught, worker goes on");
                }
                continue;
            }
            // 3. Idle.
            let rings = &mut self.rings;
            if self.spin {
                // Never announce sleep (so producers need not fence): read
                // `open` first, then re-check, as park step 3 does, so that
                // a zero makes the departed producers' publications visible.
                let closed = shared.open.load(Ordering::Acquire) == 0;
                if rings.iter_mut().any(|r| !r.is_empty()) {
                    continue;
                }
                if closed {
                    return;
                }
                std::hint::spin_loop();
                continue;
            }
            match self.bell.idle(
                &shared.open,
                self.spin_window,
                || rings.iter_mut().any(|r| !r.is_empty()),
                || counters.park(),
            ) {
                Idle::Work => {}
                Idle::Parked => woken = true,
                Idle::Closed => return,
            }
        }
    }
}

/// Counts the worker exited when it leaves [`Worker::run`], by return or
/// unwind.
struct Exit<'a>(&'a Shared);

impl Drop for Exit<'_> {
    fn drop(&mut self) {
        self.0.exits.worker_exited();
    }
}
