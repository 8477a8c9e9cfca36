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

use std::collections::VecDeque;

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

/// Anything the poller can hand work to without blocking.
pub trait WorkSink<W>: Send {
    /// Takes as many items from the front-to-back order of `items` as it can
    /// without blocking, under the contract in the module documentation.
    fn offer(&mut self, items: &mut VecDeque<Routed<W>>);

    /// How many destinations (workers) this sink feeds; used for metrics.
    fn destinations(&self) -> usize {
        1
    }
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
