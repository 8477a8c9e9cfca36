//! [`PoolSink`]: the producer's end of a pool, the poller's [`WorkSink`].
//!
//! One offer (the producer half of the park protocol, see
//! [`park`](super::park)):
//!
//! 1. Reload each ring's consumer position once; note its free slots.
//! 2. Walk the caller's queue front to back. A keyed item goes to its
//!    fixed worker, anything else to the ring with most free slots. If the
//!    ring has room the item is staged in it; if not, the item goes to the
//!    back of the queue. A ring full once stays full for the rest of the
//!    offer, so no later item overtakes a refused one to the same worker.
//!    When every ring is full the walk stops and the unvisited items are
//!    rotated behind the refused ones: the queue keeps its order.
//! 3. Publish each ring that got items (one `Release` store per ring).
//! 4. One `SeqCst` fence.
//! 5. For each ring published to that was empty, unpark its worker if it
//!    announced sleep.
//!
//! Why the spill this leaves in the caller's queue is bounded: every work
//! item comes from a completion, and every completion from a work request
//! posted against a CQ. Today nothing stops a handler from re-posting at
//! once, so a poller whose workers lag can accumulate spill; the spill is
//! counted and its high-water mark is a metric. With the CQ budget (a later
//! issue), a work item keeps its completion's credit until a worker has
//! handled it, so for a poller owning CQs of admitted capacities `C1..Ck`
//! whose handlers emit at most `m` items per completion:
//!
//! ```text
//! spill + items in its rings <= m × (C1 + ... + Ck)
//! ```
//!
//! For example one CQ of 4096 entries and one item per completion bounds a
//! poller's spill at 4096 items minus what its rings hold, whatever the
//! workers do.

use std::cell::Cell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use super::park::{producer_fence, Bell};
use super::ring::Producer;
use super::{PoolError, Shared};
use crate::sink::{Route, Routed, WorkSink};
use crate::sync::{thread, Arc, Ordering};
use crate::topology::Routing;

/// The worker a key maps to in a pool of `workers` workers: the same key
/// always maps to the same worker, so keyed items keep their order.
///
/// ```
/// use cqd_core::pool::worker_for_key;
/// assert_eq!(worker_for_key(42, 3), worker_for_key(42, 3));
/// assert!(worker_for_key(7, 3) < 3);
/// ```
pub fn worker_for_key(key: u64, workers: usize) -> usize {
    // Fibonacci hashing spreads consecutive keys; the high half of the
    // 128-bit product maps the hash onto 0..workers without a division.
    let hash = (key ^ (key >> 29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    ((u128::from(hash) * workers as u128) >> 64) as usize
}

const NOT_PUBLISHED: usize = usize::MAX;

/// One producer's end of a worker pool: a ring to every worker. Hand it to
/// the poller that feeds the pool; `Send`, not `Sync`, not `Clone`.
/// Dropping it tells the workers this producer is gone; once every sink is
/// dropped the workers drain their rings and exit.
///
/// A sink cannot be shared between threads (each ring has one producer) ...
///
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<cqd_core::pool::PoolSink<u64>>();
/// ```
///
/// ... nor cloned:
///
/// ```compile_fail
/// fn cloned<T: Clone>() {}
/// cloned::<cqd_core::pool::PoolSink<u64>>();
/// ```
///
/// but it can move to the poller thread:
///
/// ```
/// fn moved<T: Send>() {}
/// moved::<cqd_core::pool::PoolSink<u64>>();
/// ```
pub struct PoolSink<W> {
    index: usize,
    rings: Box<[Producer<W>]>,
    bells: Box<[(Arc<Bell>, thread::Thread)]>,
    free: Box<[usize]>,
    old_tail: Box<[usize]>,
    routing: Routing,
    start: usize,
    shared: Arc<Shared>,
    _not_sync: PhantomData<Cell<()>>,
}

impl<W> PoolSink<W> {
    pub(crate) fn new(
        index: usize,
        rings: Vec<Producer<W>>,
        bells: Vec<(Arc<Bell>, thread::Thread)>,
        routing: Routing,
        shared: Arc<Shared>,
    ) -> Self {
        let n = rings.len();
        Self {
            index,
            rings: rings.into(),
            bells: bells.into(),
            free: vec![0; n].into(),
            old_tail: vec![NOT_PUBLISHED; n].into(),
            routing,
            start: 0,
            shared,
            _not_sync: PhantomData,
        }
    }

    /// The ring with the most free slots (all rings have one capacity),
    /// starting the search at a rotating worker so ties spread out.
    fn shallowest(&self) -> usize {
        let n = self.free.len();
        let mut best = self.start;
        let mut w = self.start;
        for _ in 1..n {
            w += 1;
            if w == n {
                w = 0;
            }
            if self.free[w] > self.free[best] {
                best = w;
            }
        }
        best
    }

    /// Hands over everything in `items`, retrying while rings are full, for
    /// the stop sequence (never on the poller's hot path: this waits).
    ///
    /// # Errors
    ///
    /// [`PoolError::FlushTimeout`] when items are still left after
    /// `timeout` (workers stuck); they stay in `items`, in order.
    pub fn flush(
        &mut self,
        items: &mut VecDeque<Routed<W>>,
        timeout: Duration,
    ) -> Result<(), PoolError>
    where
        W: Send,
    {
        let started = Instant::now();
        loop {
            self.offer(items);
            if items.is_empty() {
                return Ok(());
            }
            if started.elapsed() >= timeout {
                return Err(PoolError::FlushTimeout {
                    left: items.len(),
                    waited: started.elapsed(),
                });
            }
            thread::yield_now();
        }
    }
}

impl<W: Send> WorkSink<W> for PoolSink<W> {
    fn offer(&mut self, items: &mut VecDeque<Routed<W>>) {
        let n = items.len();
        if n == 0 {
            return;
        }
        let workers = self.rings.len();
        // 1. Free slots per ring.
        let mut open = 0;
        for (ring, free) in self.rings.iter_mut().zip(self.free.iter_mut()) {
            *free = ring.refresh();
            open += usize::from(*free > 0);
        }
        // 2. Route and stage.
        let mut visited = 0;
        while visited < n && open > 0 {
            let Some(Routed { route, item }) = items.pop_front() else {
                break;
            };
            visited += 1;
            let dest = match (self.routing, route) {
                (Routing::AsRouted, Route::Key(key)) => worker_for_key(key, workers),
                _ => self.shallowest(),
            };
            if self.free[dest] == 0 {
                items.push_back(Routed { route, item });
                continue;
            }
            match self.rings[dest].stage(item) {
                Ok(()) => {
                    self.free[dest] -= 1;
                    open -= usize::from(self.free[dest] == 0);
                }
                Err(item) => {
                    // Not expected (free mirrors the ring), but never lose it.
                    items.push_back(Routed { route, item });
                    open -= 1;
                    self.free[dest] = 0;
                }
            }
        }
        items.rotate_left(n - visited);
        self.start += 1;
        if self.start == workers {
            self.start = 0;
        }
        // 3. Publish.
        let mut published = false;
        for (ring, old) in self.rings.iter_mut().zip(self.old_tail.iter_mut()) {
            *old = ring.publish().unwrap_or(NOT_PUBLISHED);
            published |= *old != NOT_PUBLISHED;
        }
        let mut unparks = 0;
        if published {
            // 4. Fence.
            producer_fence();
            // 5. Wake on empty→non-empty.
            for ((ring, old), (bell, thread)) in self
                .rings
                .iter()
                .zip(self.old_tail.iter())
                .zip(self.bells.iter())
            {
                if *old != NOT_PUBLISHED && bell.needs_wake(ring.consumer_position() == *old) {
                    thread.unpark();
                    unparks += 1;
                }
            }
        }
        let refused = items.len();
        self.shared.counters.sinks[self.index].offer(n - refused, refused, unparks);
    }

    fn destinations(&self) -> usize {
        self.rings.len()
    }
}

impl<W> Drop for PoolSink<W> {
    /// The stop sequence's step 2 (see [`pool`](super)).
    fn drop(&mut self) {
        for ring in self.rings.iter_mut() {
            ring.publish();
        }
        self.shared.open.fetch_sub(1, Ordering::AcqRel);
        for (_, thread) in self.bells.iter() {
            thread.unpark();
        }
    }
}

impl<W> std::fmt::Debug for PoolSink<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolSink")
            .field("pool", &self.shared.counters.name)
            .field("index", &self.index)
            .field("workers", &self.rings.len())
            .field("routing", &self.routing)
            .finish_non_exhaustive()
    }
}
