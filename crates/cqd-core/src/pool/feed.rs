//! [`PoolSink`]: the producer's end of a pool, the poller's [`WorkSink`].
//!
//! One offer (the producer half of the park protocol, see
//! [`park`](super::park)):
//!
//! 1. Reload each ring's consumer position once; note its free slots.
//! 2. Walk the caller's queue front to back. A keyed item goes to its
//!    fixed worker, anything else to the ring with most free slots.
//!
//!    - 2a, the fast path and the common case: while every item fits, stage
//!      it and take it off the front (for one worker, the whole fitting
//!      prefix in one tight loop).
//!    - 2b: once an item does not fit, it goes to the back of the queue and
//!      the walk goes on. A ring full once stays full for the rest of the
//!      offer, so no later item overtakes a refused one to the same worker.
//!      When every ring is full the walk stops and the unvisited items are
//!      rotated behind the refused ones: the queue keeps its order.
//! 3. Publish each ring that got items (one `Release` store per ring).
//!    3'. A burst offer that was refused nothing may instead hold its
//!    publication back for the next hand-off, once, while every worker
//!    looks awake (see "Held publications" in [`park`](super::park)).
//! 4. One `SeqCst` fence.
//! 5. For each ring published to that was empty, unpark its worker if it
//!    announced sleep.
//!
//! A burst offer ([`WorkSink::offer_burst`]) may owe steps 4 and 5 to a
//! later offer or [`settle`](WorkSink::settle) while every worker it
//! published to looks awake, for at most [`MAX_DEFERRED_CHECKS`] offers in a
//! row (see "Deferred checks" in [`park`](super::park)).
//!
//! A full ring's refusal leaves items in the caller's queue (the poller's
//! spill). The sink never blocks; the bound on that queue is the poller's
//! back-pressure, see `poller::spill` (above its high-water mark a poller
//! stops polling its CQs, so the CQs hold the completions and credits carry
//! the pressure back to the posters):
//!
//! ```text
//! spill <= high-water mark + m × (B1 + ... + Bk)
//! ```
//!
//! for a poller of `k` CQs with poll batches `B1..Bk`, whose handlers emit at
//! most `m` items per completion; and the rings a poller feeds hold at most
//! `workers × capacity` more. For example a mark of 128, one CQ polled 32 at
//! a time and one item per completion bound the spill at 160 items,
//! whatever the workers do. A poller that waits for space sleeps until a
//! worker frees some ([`space`](super::space)); it never spins on a full ring.

use std::cell::Cell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use super::park::{producer_fence, Bell};
use super::ring::Producer;
use super::space::{self, SpaceBell};
use super::{PoolError, Routing, Shared};
use crate::sink::{Bursting, Route, Routed, SpaceWait, SpaceWaker, WorkSink};
use crate::sync::{thread, Arc, Ordering};

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

/// The most burst offers ([`WorkSink::offer_burst`]) whose fence and
/// wake-up check may be deferred before one is run anyway: bounds how late
/// a worker that raced into sleep is woken, in offers.
pub const MAX_DEFERRED_CHECKS: u32 = 8;

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
    /// Per ring, the old tail of the first publication whose wake-up check
    /// (steps 4 and 5) is still owed, or `NOT_PUBLISHED`.
    unchecked: Box<[usize]>,
    /// Whether any ring has an owed check.
    owed: bool,
    /// Burst offers since the last check.
    deferred: u32,
    /// Whether a burst offer left staged values unpublished (step 3').
    held: bool,
    routing: Routing,
    start: usize,
    shared: Arc<Shared>,
    space: Arc<SpaceBell>,
    /// The pool's workers spin and never park ([`WorkerIdle::Spin`](super::WorkerIdle::Spin)):
    /// no worker ever announces sleep, so an offer needs neither the fence
    /// nor the wake-up check (steps 4 and 5).
    pub(crate) spinning_workers: bool,
    #[cfg(loom)]
    unfenced: bool,
    _not_sync: PhantomData<Cell<()>>,
}

impl<W> PoolSink<W> {
    pub(crate) fn new(
        index: usize,
        rings: Vec<Producer<W>>,
        bells: Vec<(Arc<Bell>, thread::Thread)>,
        routing: Routing,
        shared: Arc<Shared>,
        space: Arc<SpaceBell>,
    ) -> Self {
        let n = rings.len();
        Self {
            index,
            rings: rings.into(),
            bells: bells.into(),
            free: vec![0; n].into(),
            unchecked: vec![NOT_PUBLISHED; n].into(),
            owed: false,
            deferred: 0,
            held: false,
            routing,
            start: 0,
            shared,
            space,
            spinning_workers: false,
            #[cfg(loom)]
            unfenced: false,
            _not_sync: PhantomData,
        }
    }

    /// For the loom model only: arm without the producer's fence (space
    /// step 2), to show that the model then finds the lost wake-up.
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn unfenced_for_model(&mut self) {
        self.unfenced = true;
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

    /// Hands one item over now, for code outside a poller's batch loop;
    /// a full ring gives the item back, as crossbeam's queues do. This
    /// publishes and may wake per item: a poller uses
    /// [`offer`](WorkSink::offer), which does that once per batch.
    ///
    /// ```
    /// use cqd_core::sink::Route;
    /// use cqd_core::topology::{PoolConfig, TopologyConfig};
    ///
    /// let mut topology = TopologyConfig::new().pool(PoolConfig::new("one", 1).capacity(1)).validate()?;
    /// let (gate_tx, gate_rx) = std::sync::mpsc::channel::<()>();
    /// let gate = std::sync::Mutex::new(Some(gate_rx));
    /// let (pool, mut sinks) = topology.take_pool("one").unwrap().spawn(1, |_| {
    ///     let gate = gate.lock().unwrap().take();
    ///     move |_: u32| if let Some(g) = &gate { let _ = g.recv(); }
    /// })?;
    /// let sink = &mut sinks[0];
    /// sink.try_push(Route::Key(1), 1).unwrap();
    /// // The one slot stays taken until the worker is done with item 1.
    /// assert_eq!(sink.try_push(Route::Key(1), 2), Err(2));
    /// drop(gate_tx); // let the worker go on
    /// while sink.try_push(Route::Key(1), 2).is_err() {
    ///     std::thread::yield_now();
    /// }
    /// drop(sinks);
    /// assert_eq!(pool.join()?.items(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// The item, when the ring it is routed to is full.
    pub fn try_push(&mut self, route: Route, item: W) -> Result<(), W> {
        let workers = self.rings.len();
        for (ring, free) in self.rings.iter_mut().zip(self.free.iter_mut()) {
            *free = ring.refresh();
        }
        let dest = self.route(route, workers);
        self.rings[dest].stage(item)?;
        // Keep `free` a lower bound of the truth: arming the space wake-up
        // reads it.
        self.free[dest] -= 1;
        self.publish_all();
        if self.spinning_workers {
            self.shared.counters.sinks[self.index].offer(1, 0, 0);
            return Ok(());
        }
        let unparks = self.check_wakes();
        self.shared.counters.sinks[self.index].offer(1, 0, unparks);
        Ok(())
    }

    /// Step 3 for every ring: publishes what is staged (including what
    /// burst offers held back), noting, for parking workers, each
    /// publication's wake-up check as owed.
    /// Returns whether anything was published.
    fn publish_all(&mut self) -> bool {
        self.held = false;
        let mut published = false;
        for w in 0..self.rings.len() {
            let old = self.rings[w].publish().unwrap_or(NOT_PUBLISHED);
            published |= old != NOT_PUBLISHED;
            if !self.spinning_workers {
                self.owe_check(w, old);
            }
        }
        published
    }

    /// Records that ring `w`'s publication from tail `old` still needs its
    /// wake-up check.
    fn owe_check(&mut self, w: usize, old: usize) {
        if old != NOT_PUBLISHED && self.unchecked[w] == NOT_PUBLISHED {
            self.unchecked[w] = old;
            self.owed = true;
        }
    }

    /// Steps 4 and 5 for every owed publication: one fence, then unpark
    /// each worker that announced sleep on a ring that holds items it has
    /// not seen. Returns the unparks.
    ///
    /// A worker parks only after its re-check saw its ring empty at some
    /// published tail `h` (its position). If `h` is at or past the first
    /// owed publication's old tail and below the tail now, a publication it
    /// may have missed followed its re-check: wake it. If `h` is below the
    /// first owed publication, the publication that ended at `h` or later
    /// was checked with a fence already (it woke the worker, or the
    /// worker's re-check saw it). With one owed publication this is the
    /// plain "position equals the old tail" test.
    fn check_wakes(&mut self) -> usize {
        self.deferred = 0;
        if !std::mem::take(&mut self.owed) {
            return 0;
        }
        producer_fence();
        let mut unparks = 0;
        for ((ring, from), (bell, thread)) in self
            .rings
            .iter()
            .zip(self.unchecked.iter_mut())
            .zip(self.bells.iter())
        {
            let first = std::mem::replace(from, NOT_PUBLISHED);
            if first == NOT_PUBLISHED {
                continue;
            }
            let published = ring.published();
            if bell.needs_wake(|| {
                let position = ring.consumer_position();
                first <= position && position < published
            }) {
                thread.unpark();
                unparks += 1;
            }
        }
        unparks
    }

    /// The destination of an item.
    fn route(&self, route: Route, workers: usize) -> usize {
        match (self.routing, route) {
            (Routing::AsRouted, Route::Key(key)) => worker_for_key(key, workers),
            _ => self.shallowest(),
        }
    }

    /// Step 2a: stages items off the front of `items` for as long as each
    /// fits, and returns how many it took.
    #[inline]
    fn stage_prefix(&mut self, items: &mut VecDeque<Routed<W>>, open: &mut usize) -> usize {
        let workers = self.rings.len();
        if workers == 1 {
            let taken = self.rings[0].stage_front(items, usize::MAX);
            self.free[0] -= taken;
            *open -= usize::from(self.free[0] == 0 && taken > 0);
            return taken;
        }
        let mut taken = 0;
        while let Some(front) = items.front() {
            let dest = self.route(front.route, workers);
            if self.free[dest] == 0 {
                break;
            }
            let Some(Routed { route, item }) = items.pop_front() else {
                break;
            };
            if let Err(item) = self.rings[dest].stage(item) {
                // Not expected (free mirrors the ring), but never lose it.
                items.push_front(Routed { route, item });
                *open -= usize::from(self.free[dest] > 0);
                self.free[dest] = 0;
                break;
            }
            self.free[dest] -= 1;
            *open -= usize::from(self.free[dest] == 0);
            taken += 1;
        }
        taken
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

impl<W: Send> PoolSink<W> {
    /// One offer (steps 1 to 5; in a burst, steps 4 and 5 may be owed,
    /// see [`WorkSink::offer_burst`]); returns how many refused items were
    /// at positions `fresh..` on entry.
    fn offer_inner(&mut self, items: &mut VecDeque<Routed<W>>, fresh: usize, burst: bool) -> usize {
        let n = items.len();
        if n == 0 {
            // Nothing new: publish what bursts held (3'), and run the owed
            // checks outside a burst, or after `MAX_DEFERRED_CHECKS`
            // hand-offs of a burst.
            if self.held {
                self.publish_all();
            }
            if self.owed {
                self.deferred += u32::from(burst);
                if !burst || self.deferred >= MAX_DEFERRED_CHECKS {
                    let unparks = self.check_wakes();
                    self.shared.counters.sinks[self.index].unparked(unparks);
                }
            }
            return 0;
        }
        let workers = self.rings.len();
        // 1. Free slots per ring. With several workers every ring is
        //    reloaded, so that least-loaded routing sees current depths; a
        //    single ring is reloaded only when its cached free slots cannot
        //    take the whole offer (its depth matters to nobody), which
        //    spares a cache miss per offer in the steady state.
        let mut open = 0;
        let lazy = self.rings.len() == 1;
        for (ring, free) in self.rings.iter_mut().zip(self.free.iter_mut()) {
            *free = if lazy && ring.free() >= n {
                ring.free()
            } else {
                ring.refresh()
            };
            open += usize::from(*free > 0);
        }
        // 2a. Fast path.
        let taken = self.stage_prefix(items, &mut open);
        // 2b. Walk the rest.
        let n_rest = n - taken;
        let mut visited = 0;
        let mut fresh_refused = 0;
        while visited < n_rest && open > 0 {
            let Some(Routed { route, item }) = items.pop_front() else {
                break;
            };
            let position = taken + visited;
            visited += 1;
            let dest = self.route(route, workers);
            if self.free[dest] == 0 {
                items.push_back(Routed { route, item });
                fresh_refused += usize::from(position >= fresh);
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
                    fresh_refused += usize::from(position >= fresh);
                    open -= 1;
                    self.free[dest] = 0;
                }
            }
        }
        // The unvisited items, positions `taken + visited .. n`, stay too.
        fresh_refused += n.saturating_sub(fresh.max(taken + visited));
        items.rotate_left(n_rest - visited);
        self.start += 1;
        if self.start == workers {
            self.start = 0;
        }
        // 3. Publish. 3'. A burst offer that staged something and was
        //    refused nothing may hold its publication back for the next
        //    hand-off, once: a worker then takes two offers per pass, and
        //    the producer stores each ring's tail (a line the worker keeps
        //    reading, so a round trip to its core) half as often.
        //    Not while a worker looks asleep: it would wait for the next
        //    hand-off.
        let hold = burst
            && !self.held
            && items.is_empty()
            && (self.spinning_workers || self.bells.iter().all(|(b, _)| !b.looks_asleep()));
        let published = if hold {
            self.held = true;
            false
        } else {
            self.publish_all()
        };
        let mut unparks = 0;
        if !self.spinning_workers {
            let mut asleep = false;
            for w in 0..self.rings.len() {
                // 4'. In a burst: a worker owed a check that looks asleep
                //     is checked now.
                asleep |=
                    burst && self.unchecked[w] != NOT_PUBLISHED && self.bells[w].0.looks_asleep();
            }
            if self.owed {
                self.deferred += 1;
                // 4 and 5, unless a burst may defer them: outside a burst,
                // for a worker that looks asleep, for an offer that
                // published nothing and held nothing (the producer is not
                // streaming), and after `MAX_DEFERRED_CHECKS` deferred
                // offers.
                if !burst || asleep || !(published || hold) || self.deferred >= MAX_DEFERRED_CHECKS
                {
                    unparks = self.check_wakes();
                }
            }
        }
        let refused = items.len();
        self.shared.counters.sinks[self.index].offer(n - refused, refused, unparks);
        fresh_refused
    }
}

impl<W: Send> WorkSink<W> for PoolSink<W> {
    fn offer(&mut self, items: &mut VecDeque<Routed<W>>) {
        let n = items.len();
        self.offer_inner(items, n, false);
    }

    fn offer_fresh(&mut self, items: &mut VecDeque<Routed<W>>, fresh: usize) -> usize {
        self.offer_inner(items, fresh, false)
    }

    /// Defers the fence and the wake-up check (steps 4 and 5) while every
    /// worker published to looks awake, for at most
    /// [`MAX_DEFERRED_CHECKS`] burst offers in a row (see `pool::park`,
    /// "Deferred checks").
    fn offer_burst(
        &mut self,
        items: &mut VecDeque<Routed<W>>,
        fresh: usize,
        _: &Bursting,
    ) -> usize {
        self.offer_inner(items, fresh, true)
    }

    fn settle(&mut self) {
        if self.held {
            self.publish_all();
        }
        if self.owed {
            let unparks = self.check_wakes();
            self.shared.counters.sinks[self.index].unparked(unparks);
        }
    }

    fn destinations(&self) -> usize {
        self.rings.len()
    }

    fn set_space_waker(&mut self, waker: SpaceWaker) -> bool {
        self.space.set_waker(waker)
    }

    /// Producer steps 1 to 3 of the space wake-up (`pool::space`).
    fn arm_space(&mut self, items: &mut VecDeque<Routed<W>>) -> SpaceWait {
        if items.is_empty() {
            return SpaceWait::Progress;
        }
        if !self.space.has_waker() {
            return SpaceWait::Unsupported;
        }
        // 1. Announce on every ring the last offer left full.
        for (w, free) in self.free.iter().enumerate() {
            if *free == 0 {
                self.space.announce(w);
            }
        }
        // 2. Fence.
        #[cfg(loom)]
        let fenced = !self.unfenced;
        #[cfg(not(loom))]
        let fenced = true;
        if fenced {
            space::producer_fence();
        }
        // 3. Re-check.
        let before = items.len();
        self.offer(items);
        if items.len() < before {
            self.space.disarm();
            SpaceWait::Progress
        } else {
            SpaceWait::Armed
        }
    }

    fn disarm_space(&mut self) {
        self.space.disarm();
    }
}

impl<W> Drop for PoolSink<W> {
    /// The stop sequence's step 2 (see [`pool`](super)).
    fn drop(&mut self) {
        for ring in self.rings.iter_mut() {
            ring.publish();
        }
        self.shared.counters.sinks[self.index].dropped();
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::pool::ring::{ring, Consumer};
    use proptest::prelude::*;

    /// A sink over `workers` rings of `capacity` slots, without worker
    /// threads (unparks go to the test thread and are harmless).
    fn sink(
        workers: usize,
        capacity: usize,
        routing: Routing,
    ) -> (PoolSink<usize>, Vec<Consumer<usize>>) {
        let shared = Arc::new(Shared::new("t", capacity, vec![String::new(); workers], 1));
        let (producers, consumers): (Vec<_>, Vec<_>) = (0..workers).map(|_| ring(capacity)).unzip();
        let bells = (0..workers)
            .map(|_| (Arc::new(Bell::default()), thread::current()))
            .collect();
        let space = Arc::new(SpaceBell::new(workers));
        (
            PoolSink::new(0, producers, bells, routing, shared, space),
            consumers,
        )
    }

    fn drain(c: &mut Consumer<usize>) -> Vec<usize> {
        let mut out = Vec::new();
        c.pop_batch(usize::MAX, |v| out.push(v));
        out
    }

    #[test]
    fn a_full_ring_holds_back_later_items_for_it_and_order_is_kept() {
        let (mut sink, mut rings) = sink(2, 2, Routing::AsRouted);
        let k0 = (0..).find(|&k| worker_for_key(k, 2) == 0).unwrap();
        let k1 = (0..).find(|&k| worker_for_key(k, 2) == 1).unwrap();
        let mut items: VecDeque<_> = [(k0, 0), (k0, 1), (k0, 2), (k1, 3), (k0, 4), (k1, 5)]
            .into_iter()
            .map(|(k, item)| Routed {
                route: Route::Key(k),
                item,
            })
            .collect();
        sink.offer(&mut items);
        let left: Vec<_> = items.iter().map(|r| r.item).collect();
        assert_eq!(left, [2, 4], "refused items keep their order");
        assert_eq!(drain(&mut rings[0]), [0, 1]);
        assert_eq!(drain(&mut rings[1]), [3, 5]);
        sink.offer(&mut items);
        assert!(items.is_empty());
        assert_eq!(drain(&mut rings[0]), [2, 4]);
    }

    #[test]
    fn everything_full_refuses_everything_untouched() {
        let (mut sink, _rings) = sink(2, 1, Routing::AsRouted);
        let mut items: VecDeque<_> = (0..6)
            .map(|item| Routed {
                route: Route::LeastLoaded,
                item,
            })
            .collect();
        sink.offer(&mut items);
        sink.offer(&mut items);
        let left: Vec<_> = items.iter().map(|r| r.item).collect();
        assert_eq!(left, [2, 3, 4, 5]);
    }

    fn unparks(sink: &PoolSink<usize>) -> u64 {
        sink.shared.counters.sinks[sink.index].snapshot().unparks
    }

    fn least_loaded(items: impl IntoIterator<Item = usize>) -> VecDeque<Routed<usize>> {
        items
            .into_iter()
            .map(|item| Routed {
                route: Route::LeastLoaded,
                item,
            })
            .collect()
    }

    #[test]
    fn bursts_owe_the_check_for_at_most_max_deferred_offers() {
        let (mut sink, mut rings) = sink(1, 1024, Routing::AsRouted);
        for i in 0..MAX_DEFERRED_CHECKS - 1 {
            sink.offer_burst(&mut least_loaded([i as usize]), 0, &Bursting(()));
            // Every other burst offer holds its publication back (3'); the
            // others publish it and the one held before, and owe the check.
            assert_eq!(sink.held, i % 2 == 0, "offer {i}");
            assert_eq!(sink.owed, i > 0, "an awake worker's check is owed");
            if sink.owed {
                assert_eq!(sink.unchecked[0], 0, "from the first owed publication");
            }
        }
        // The worker announces sleep without having seen anything: its
        // position is the first owed publication's old tail.
        sink.bells[0].0.set_sleeping(true);
        sink.settle();
        assert!(!sink.owed && !sink.held);
        assert_eq!(unparks(&sink), 1, "the settle wakes the sleeper");
        sink.bells[0].0.set_sleeping(false);
        assert_eq!(drain(&mut rings[0]).len(), MAX_DEFERRED_CHECKS as usize - 1);
        // An awake worker: the check runs `MAX_DEFERRED_CHECKS` burst
        // offers after the first owed publication.
        sink.offer_burst(&mut least_loaded([0]), 0, &Bursting(()));
        assert!(
            sink.held && !sink.owed,
            "held: nothing published, nothing owed"
        );
        for i in 0..MAX_DEFERRED_CHECKS {
            sink.offer_burst(&mut least_loaded([i as usize]), 0, &Bursting(()));
            assert_eq!(sink.owed, i + 1 < MAX_DEFERRED_CHECKS, "offer {i}");
        }
        assert_eq!(unparks(&sink), 1);
    }

    #[test]
    fn bursts_that_bring_nothing_publish_what_was_held_and_keep_the_bound() {
        let (mut sink, mut rings) = sink(1, 1024, Routing::AsRouted);
        sink.offer_burst(&mut least_loaded([1, 2]), 0, &Bursting(()));
        assert!(sink.held);
        assert!(drain(&mut rings[0]).is_empty(), "held: not visible yet");
        sink.offer_burst(&mut least_loaded([]), 0, &Bursting(()));
        assert!(!sink.held && sink.owed);
        assert_eq!(drain(&mut rings[0]), [1, 2]);
        for _ in 1..MAX_DEFERRED_CHECKS {
            assert!(sink.owed);
            sink.offer_burst(&mut least_loaded([]), 0, &Bursting(()));
        }
        assert!(
            !sink.owed,
            "checked after {MAX_DEFERRED_CHECKS} burst hand-offs"
        );
    }

    #[test]
    fn a_burst_to_a_worker_that_looks_asleep_checks_at_once() {
        let (mut sink, mut rings) = sink(1, 1024, Routing::AsRouted);
        sink.bells[0].0.set_sleeping(true);
        sink.offer_burst(&mut least_loaded([1, 2]), 0, &Bursting(()));
        assert!(!sink.owed);
        assert_eq!(unparks(&sink), 1);
        // Woken but not yet out of `park` (the flag still set), the worker
        // has not moved: a second burst owes no second unpark ...
        sink.offer_burst(&mut least_loaded([3]), 0, &Bursting(()));
        assert_eq!(unparks(&sink), 1, "position below the first owed tail");
        // ... and once it has taken everything, nothing is left to wake it for.
        assert_eq!(drain(&mut rings[0]), [1, 2, 3]);
        sink.settle();
        assert_eq!(unparks(&sink), 1);
    }

    #[test]
    fn a_plain_offer_settles_what_bursts_owe_on_every_ring() {
        let (mut sink, mut rings) = sink(2, 4, Routing::AsRouted);
        let k0 = (0..).find(|&k| worker_for_key(k, 2) == 0).unwrap();
        let k1 = (0..).find(|&k| worker_for_key(k, 2) == 1).unwrap();
        let keyed = |k: u64, item: usize| Routed {
            route: Route::Key(k),
            item,
        };
        sink.offer_burst(&mut VecDeque::from([keyed(k0, 1)]), 0, &Bursting(()));
        sink.offer_burst(&mut VecDeque::from([keyed(k1, 2)]), 0, &Bursting(()));
        assert!(sink.owed);
        sink.bells[0].0.set_sleeping(true);
        sink.bells[1].0.set_sleeping(true);
        // A plain offer to worker 0 only checks worker 1's owed publication too.
        sink.offer(&mut VecDeque::from([keyed(k0, 3)]));
        assert!(!sink.owed);
        assert_eq!(unparks(&sink), 2);
        assert_eq!(drain(&mut rings[0]), [1, 3]);
        assert_eq!(drain(&mut rings[1]), [2]);
    }

    proptest! {
        /// The `WorkSink` contract, for any routes and ring sizes: nothing
        /// lost or duplicated, refused items in their original order, each
        /// ring's items in their original order, and no item accepted for a
        /// worker after an earlier one for it was refused.
        #[test]
        fn offer_keeps_the_contract(
            workers in 1usize..4,
            capacity in 1usize..8,
            routes in proptest::collection::vec(proptest::option::of(0u64..6), 0..40),
            least_loaded in any::<bool>(),
        ) {
            let routing = if least_loaded { Routing::LeastLoaded } else { Routing::AsRouted };
            let (mut sink, mut rings) = sink(workers, capacity, routing);
            let route_of = |i: usize| routes[i].map_or(Route::LeastLoaded, Route::Key);
            let mut items: VecDeque<_> = (0..routes.len())
                .map(|item| Routed { route: route_of(item), item })
                .collect();
            sink.offer(&mut items);
            let left: Vec<usize> = items.iter().map(|r| r.item).collect();
            prop_assert!(left.windows(2).all(|w| w[0] < w[1]), "refused out of order: {:?}", left);
            let mut all = left.clone();
            for (w, ring) in rings.iter_mut().enumerate() {
                let got = drain(ring);
                prop_assert!(got.len() <= sink.rings[w].capacity());
                prop_assert!(got.windows(2).all(|p| p[0] < p[1]), "ring {} out of order: {:?}", w, got);
                for &item in &got {
                    if let (Routing::AsRouted, Route::Key(k)) = (routing, route_of(item)) {
                        prop_assert_eq!(worker_for_key(k, workers), w);
                        // No refused item for this worker comes before it.
                        let blocked = left.iter().any(|&r| r < item
                            && matches!(route_of(r), Route::Key(k2) if worker_for_key(k2, workers) == w));
                        prop_assert!(!blocked, "item {} overtook a refused one for worker {}", item, w);
                    }
                }
                all.extend(got);
            }
            all.sort_unstable();
            prop_assert_eq!(all, (0..routes.len()).collect::<Vec<_>>());
        }

        /// `offer_fresh` counts exactly the refused items that were at
        /// positions `fresh..` on entry: a poller counts each spill once.
        #[test]
        fn offer_fresh_counts_the_fresh_refusals(
            workers in 1usize..4,
            capacity in 1usize..6,
            routes in proptest::collection::vec(proptest::option::of(0u64..6), 1..40),
            old in 0usize..40,
            least_loaded in any::<bool>(),
        ) {
            let routing = if least_loaded { Routing::LeastLoaded } else { Routing::AsRouted };
            let (mut sink, mut rings) = sink(workers, capacity, routing);
            let route_of = |i: usize| routes[i].map_or(Route::LeastLoaded, Route::Key);
            let old = old.min(routes.len());
            // A first offer of the old items fills some rings...
            let mut items: VecDeque<_> = (0..old)
                .map(|item| Routed { route: route_of(item), item })
                .collect();
            sink.offer(&mut items);
            // ... a worker frees one ring ...
            drain(&mut rings[0]);
            // ... and the old leftovers go again with fresh items behind.
            let fresh = items.len();
            items.extend((old..routes.len()).map(|item| Routed { route: route_of(item), item }));
            let counted = sink.offer_fresh(&mut items, fresh);
            let expected = items.iter().filter(|r| r.item >= old).count();
            prop_assert_eq!(counted, expected);
        }
    }
}
