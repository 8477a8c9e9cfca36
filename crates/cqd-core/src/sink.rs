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
//!    next hand-off (a burst offer may hold its publication until the next
//!    burst offer, empty or not), plain offer, [`settle`](WorkSink::settle)
//!    or space arm. Only
//!    cqd-core can make a burst offer (it takes a [`Bursting`], which no
//!    other crate can make): the poller, which bursts only while its rounds
//!    find completions (see `poller::spill`), and a [`Burst`], which settles
//!    when it is dropped. A deferred wake-up cannot be forgotten.
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
use std::marker::PhantomData;
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

/// The permission to make a burst offer ([`WorkSink::offer_burst`]):
/// only cqd-core makes one, where it is sure the burst is settled (the
/// poller's rounds, [`Burst`]).
#[derive(Debug)]
pub struct Bursting(pub(crate) ());

/// Burst offers to a sink, settled when this is dropped: for code that
/// drives a sink as the poller does (a benchmark, a poll loop of one's
/// own), offering what each round found without paying the pool's fence
/// and wake-up check on every offer. Drop it before waiting for anything
/// (the next completion, space, a timer): until it is dropped or
/// [`settled`](Self::settle), a worker that went to sleep just as items
/// reached it may stay asleep, and the last offer's items may not be
/// published to the workers yet (a pool holds a burst offer's publication
/// for the next hand-off).
///
/// ```
/// use std::collections::VecDeque;
/// use cqd_core::sink::{Burst, Route, Routed, WorkSink};
/// # use cqd_core::pool::Work;
/// # use cqd_core::topology::{PoolConfig, TopologyConfig};
/// # struct Sum;
/// # impl Work<u64> for Sum { fn run(&mut self, _: u64) {} }
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let mut topology = TopologyConfig::new().pool(PoolConfig::new("p", 1)).validate()?;
/// # let (pool, mut sinks) = topology.take_pool("p").unwrap().spawn(1, |_| Sum)?;
/// # let mut sink = sinks.pop().unwrap();
/// let mut burst = Burst::new(&mut sink);
/// for round in 0..4u64 {
///     let mut items: VecDeque<_> = (0..32)
///         .map(|i| Routed { route: Route::LeastLoaded, item: round * 32 + i })
///         .collect();
///     let refused = burst.offer(&mut items, 0);
///     # assert_eq!(refused, items.len());
/// }
/// drop(burst); // settles: every worker that has items is awake
/// # drop(sink);
/// # pool.join()?;
/// # Ok(())
/// # }
/// ```
pub struct Burst<'a, W, S: WorkSink<W> + ?Sized> {
    sink: &'a mut S,
    _items: PhantomData<fn(W)>,
}

impl<'a, W, S: WorkSink<W> + ?Sized> Burst<'a, W, S> {
    /// Starts a burst on `sink`.
    pub fn new(sink: &'a mut S) -> Self {
        Burst {
            sink,
            _items: PhantomData,
        }
    }

    /// A burst offer ([`WorkSink::offer_burst`]): returns how many of the
    /// fresh items (at positions `fresh..` on entry) it refused; what it
    /// refused stays in `items`, in order.
    pub fn offer(&mut self, items: &mut VecDeque<Routed<W>>, fresh: usize) -> usize {
        self.sink.offer_burst(items, fresh, &Bursting(()))
    }

    /// The sink, for plain offers between burst offers (each completes
    /// what the burst deferred).
    pub fn sink(&mut self) -> &mut S {
        self.sink
    }

    /// Completes what the burst deferred now; the burst goes on.
    pub fn settle(&mut self) {
        self.sink.settle();
    }
}

impl<W, S: WorkSink<W> + ?Sized> Drop for Burst<'_, W, S> {
    fn drop(&mut self) {
        self.sink.settle();
    }
}

impl<W, S: WorkSink<W> + ?Sized> std::fmt::Debug for Burst<'_, W, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Burst")
    }
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
    /// a burst: another offer or a [`settle`](Self::settle) follows soon,
    /// and always before the caller blocks, sleeps or goes idle. The sink
    /// may then defer work that can wait that long; the worker pool defers
    /// the fence and the wake-up check while every worker it feeds looks
    /// awake (at most a few offers in a row), and may hold one offer's
    /// publication back until the next hand-off. Every other method (a
    /// plain offer, [`arm_space`](Self::arm_space), dropping the sink)
    /// completes what was deferred. A burst offer of an empty queue is the
    /// next hand-off of a round that brought nothing new (the poller makes
    /// one). The provided version is `offer_fresh`.
    ///
    /// A sink implements it; only cqd-core calls it, with the [`Bursting`]
    /// that only it can make: the poller, for the hand-off of a round that
    /// found completions (another round follows), and [`Burst::offer`].
    fn offer_burst(
        &mut self,
        items: &mut VecDeque<Routed<W>>,
        fresh: usize,
        bursting: &Bursting,
    ) -> usize {
        let _ = bursting;
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
