//! The poller's side of the worker hand-off.
//!
//! Handlers emit work through an [`Outbox`](crate::handler::Outbox); after each
//! drained batch the poller offers everything emitted to a [`WorkSink`]. A
//! worker pool is a sink; so is anything else that can take work without
//! blocking.
//!
//! The contract (the poller relies on every point):
//!
//! 1. `offer` never blocks and never drops. What it does not accept stays in
//!    the deque, in its original relative order, and the poller keeps it in its
//!    spill queue and offers it again on its next loop.
//! 2. Per-destination order holds: an item bound for a worker is never accepted
//!    after an earlier item bound for the same worker was refused. Key-routed
//!    work therefore keeps per-key order.
//! 3. One `offer` is one batch: a sink should publish to each destination once
//!    per call and wake a parked consumer at most once per call.
//! 4. A parked consumer is woken by the offer that handed it work, or, for an
//!    [`offer_burst`](WorkSink::offer_burst), at the latest by the caller's
//!    next plain offer, [`settle`](WorkSink::settle) or space arm (the poller
//!    bursts only while its rounds find completions, see `poller::spill`).
//!
//! # Waiting for space
//!
//! A poller whose spill a sink refused must not spin on it. It hands the
//! sink a [`SpaceWaker`] once ([`WorkSink::set_space_waker`]); when it is
//! about to sleep with a spill it *arms* the sink ([`WorkSink::arm_space`]:
//! announce, fence, re-check — the mirror of the CQ's arm / re-poll), sleeps
//! until the waker is woken or its safety timeout passes, then disarms
//! ([`WorkSink::disarm_space`]) and offers again. A sink that cannot wake
//! anyone keeps the provided methods; the poller then retries on a short
//! timer instead. The worker pool's protocol is written out in `pool::space`.

use std::collections::VecDeque;
use std::sync::Arc;

/// Where a work item goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Route {
    /// Hash the key to a fixed worker: every item with the same key goes to
    /// the same worker, in order (per-connection order).
    Key(u64),
    /// The worker with the shallowest queue at the time of the offer.
    LeastLoaded,
}

/// A work item with its destination.
#[derive(Debug)]
pub struct Routed<W> {
    /// Where the item goes.
    pub route: Route,
    /// The item itself.
    pub item: W,
}

/// Wakes a producer (a poller) that sleeps until a sink frees space. Cheap
/// to clone; waking is one call of the function it was made from.
#[derive(Clone)]
pub struct SpaceWaker(Arc<dyn Fn() + Send + Sync>);

impl SpaceWaker {
    /// A waker that calls `wake` (for a poller: ring its doorbell).
    pub fn new(wake: impl Fn() + Send + Sync + 'static) -> Self {
        SpaceWaker(Arc::new(wake))
    }

    /// Wakes the producer.
    pub fn wake(&self) {
        (self.0)()
    }
}

impl std::fmt::Debug for SpaceWaker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SpaceWaker")
    }
}

/// What [`WorkSink::arm_space`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpaceWait {
    /// The re-check handed items over: do not sleep, go on.
    Progress,
    /// Armed: the waker will be woken once a destination that refused items
    /// frees space. Sleep (with a safety timeout), then
    /// [`disarm_space`](WorkSink::disarm_space).
    Armed,
    /// This sink cannot wake anyone: retry on a timer.
    Unsupported,
}

/// Anything the poller can hand work to without blocking.
pub trait WorkSink<W>: Send {
    /// Takes as many items from the front-to-back order of `items` as it can
    /// without blocking, under the contract in the module documentation.
    fn offer(&mut self, items: &mut VecDeque<Routed<W>>);

    /// As [`offer`](Self::offer), and returns how many of the items it
    /// refused were *fresh*: at positions `fresh..` of `items` on entry
    /// (never offered before). The poller counts each spilled item once
    /// with it.
    ///
    /// The provided version is exact for a sink that takes no item behind
    /// a refused one (one destination, as contract point 2 then requires):
    /// what it refuses is a suffix. A sink with several destinations should
    /// override it; otherwise the count may be too high (never above the
    /// number of fresh items).
    fn offer_fresh(&mut self, items: &mut VecDeque<Routed<W>>, fresh: usize) -> usize {
        let n = items.len();
        self.offer(items);
        items.len().min(n.saturating_sub(fresh))
    }

    /// As [`offer_fresh`](Self::offer_fresh), for an offer in the middle of
    /// a burst: the caller promises to make another offer or call
    /// [`settle`](Self::settle) soon, and always before it blocks, sleeps
    /// or goes idle. The sink may then defer work that can wait that long;
    /// the worker pool defers the fence and the wake-up check while every
    /// worker it feeds looks awake (at most a few offers in a row). Every
    /// other method (a plain offer, [`arm_space`](Self::arm_space),
    /// dropping the sink) completes what was deferred. The poller uses it
    /// for the hand-off of a round that found completions, which is
    /// followed by another round. The provided version is `offer_fresh`.
    fn offer_burst(&mut self, items: &mut VecDeque<Routed<W>>, fresh: usize) -> usize {
        self.offer_fresh(items, fresh)
    }

    /// Completes what [`offer_burst`](Self::offer_burst) deferred (for the
    /// worker pool: the fence and the wake-up check). The provided version
    /// does nothing.
    fn settle(&mut self) {}

    /// How many destinations (workers) this sink feeds; used for metrics.
    fn destinations(&self) -> usize {
        1
    }

    /// Installs the waker that [`arm_space`](Self::arm_space) promises to
    /// wake; called once, by the poller thread, before its first offer.
    /// Returns whether this sink will use it (the provided version: no).
    fn set_space_waker(&mut self, waker: SpaceWaker) -> bool {
        let _ = waker;
        false
    }

    /// Arms the space wake-up for the destinations that refused `items`,
    /// then re-checks by offering `items` again (the announce must be
    /// visible before the re-check reads how much space there is, or a
    /// consumer that frees space in between would wake nobody). The
    /// provided version only offers again.
    fn arm_space(&mut self, items: &mut VecDeque<Routed<W>>) -> SpaceWait {
        let before = items.len();
        self.offer(items);
        if items.len() < before {
            SpaceWait::Progress
        } else {
            SpaceWait::Unsupported
        }
    }

    /// Withdraws what [`arm_space`](Self::arm_space) announced (after the
    /// sleep), so consumers stop waking a producer that is awake.
    fn disarm_space(&mut self) {}
}

/// The work type of a dispatcher without workers: it has no values, so a
/// handler cannot emit work and nothing can be lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoWork {}

/// The sink of a dispatcher without workers.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoSink;

impl WorkSink<NoWork> for NoSink {
    fn offer(&mut self, items: &mut VecDeque<Routed<NoWork>>) {
        // `NoWork` has no values, so the deque is always empty.
        debug_assert!(items.is_empty());
    }
}
