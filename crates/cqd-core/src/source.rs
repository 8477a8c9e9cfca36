//! The backend side: what a completion queue must offer a poller.
//!
//! `cqd-sim` implements [`CompletionSource`] for its simulated CQ; a
//! real-verbs backend implements it for `ibv_cq` + `ibv_comp_channel`
//! (docs/architecture.md, "Crates"). A source is owned by
//! exactly one [`CqPoller`](crate::cq::CqPoller), so every method takes
//! `&mut self`; the type system, not a lock, keeps two threads from polling
//! it.

use std::os::fd::BorrowedFd;
use std::sync::Arc;

use crate::completion::Completion;

/// Which completions an arm asks to be notified of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArmKind {
    /// The next completion of any kind (`solicited_only = 0`).
    Next,
    /// The next solicited receive completion, or any error completion
    /// (`solicited_only = 1`).
    Solicited,
}

pub use crate::event::{AsyncEvent, QpEvent, SrqEvent};

/// Errors of a completion source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// The device went away (hot unplug, driver reset).
    #[error("RDMA device is gone: {0}")]
    DeviceGone(String),
    /// The CQ is in the error state (after an overflow) and cannot be armed
    /// or polled further.
    #[error("CQ is in the error state after an overflow")]
    CqInError,
    /// Destroying a CQ with events not yet acknowledged; `ibv_destroy_cq`
    /// would hang.
    #[error("CQ has {unacked} unacknowledged events; ack them before destroying it")]
    UnackedEvents {
        /// Events read but not acknowledged.
        unacked: u32,
    },
    /// An operating-system call failed.
    #[error("{op} failed: {source}")]
    Os {
        /// What was being done.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The backend cannot do this (a resize on a device without one).
    #[error("not supported: {0}")]
    Unsupported(String),
    /// The backend reported something else.
    #[error("{0}")]
    Backend(String),
}

/// A completion queue as a poller sees it.
///
/// The contract, which every backend keeps and the poller relies on:
///
/// 1. `poll` returns completions in CQ order and never blocks.
/// 2. After `arm`, exactly one notification is delivered for the first
///    matching completion added *after* the arm (IB semantics: completions
///    already queued need not notify — the poller re-polls after arming).
/// 3. `event_fd` becomes readable when a notification is pending;
///    `take_events` consumes pending notifications without blocking and
///    returns how many; each must later be acknowledged with `ack_events`.
/// 4. `destroy` fails, rather than hang, while events are unacknowledged.
/// 5. A source on a shared channel ([`notifier`](Self::notifier)) takes
///    only its own notifications in `take_events`, never another
///    source's; the channel's descriptor is its `event_fd`.
/// 6. `resize` is called by the thread that polls, between two polls (as
///    `ibv_resize_cq` must be); after it returns, the CQ holds the
///    entries it returned, has lost no completion, returns them in order,
///    and an arm made before still holds (a backend whose device drops
///    the arm on a resize arms again).
pub trait CompletionSource: Send + 'static {
    /// A short name for metrics and traces.
    fn name(&self) -> &str;

    /// The number of entries the CQ really holds.
    fn capacity(&self) -> u32;

    /// Moves up to `out.len()` completions into `out`; returns how many.
    ///
    /// # Errors
    /// When the device is gone or the CQ is unusable.
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, SourceError>;

    /// Requests one notification (see the trait contract, point 2).
    ///
    /// # Errors
    /// When the device is gone or the CQ is in error.
    fn arm(&mut self, kind: ArmKind) -> Result<(), SourceError>;

    /// The descriptor that becomes readable when a notification is pending
    /// (for `poll(2)`, epoll or an async runtime).
    fn event_fd(&self) -> BorrowedFd<'_>;

    /// Consumes pending notifications without blocking; returns how many.
    ///
    /// # Errors
    /// When reading the descriptor fails for a reason other than "nothing
    /// pending".
    fn take_events(&mut self) -> Result<u32, SourceError>;

    /// Acknowledges `n` notifications taken with `take_events`.
    ///
    /// # Errors
    /// When the backend refuses.
    fn ack_events(&mut self, n: u32) -> Result<(), SourceError>;

    /// Notifications taken but not yet acknowledged.
    fn unacked_events(&self) -> u32;

    /// A descriptor that becomes readable when an asynchronous event is
    /// pending, if the backend has one separate from `event_fd`.
    fn async_fd(&self) -> Option<BorrowedFd<'_>> {
        None
    }

    /// The shared channel this source notifies through, if any, with the
    /// token the channel reports when this source fired
    /// ([`SharedNotifier::take_ready`]). `None` (the default): the source
    /// has a descriptor of its own. A poller registers each distinct
    /// channel once, and every source of a channel must be bound to the
    /// same poller (as an `ibv_comp_channel` is read by one thread).
    fn notifier(&self) -> Option<(Arc<dyn SharedNotifier>, u64)> {
        None
    }

    /// The ledger of the queues whose completions come to this CQ, with the
    /// CQ's budget: [`split`](crate::cq::split) attaches both, so that the
    /// poller retires every request posted through the posting call and
    /// returns its credits — nobody has to remember to. `None` (the
    /// default) for a source with no queues of its own (a bare completion
    /// stream); the posting call then refuses to post for its handlers
    /// until a ledger is attached ([`CqHandle::attach_ledger`]).
    ///
    /// [`CqHandle::attach_ledger`]: crate::cq::CqHandle::attach_ledger
    fn ledger(&self) -> Option<crate::ledger::WrLedger> {
        None
    }

    /// The next pending asynchronous event, if any; never blocks. The
    /// poller calls this on every loop, so with nothing pending it must cost
    /// no lock and no system call (an atomic load, or nothing at all).
    fn take_async_event(&mut self) -> Option<AsyncEvent>;

    /// Grows the CQ to at least `cqe` entries (`ibv_resize_cq`); returns
    /// the entries it holds now (see the trait contract, point 6). The
    /// default: [`SourceError::Unsupported`].
    ///
    /// # Errors
    /// [`SourceError::Unsupported`] when the backend cannot resize; the
    /// device's error otherwise (the CQ is then as it was).
    fn resize(&mut self, cqe: u32) -> Result<u32, SourceError> {
        let _ = cqe;
        Err(SourceError::Unsupported(format!(
            "{} cannot be resized",
            self.name()
        )))
    }

    /// Destroys the CQ.
    ///
    /// # Errors
    /// [`SourceError::UnackedEvents`] while notifications are
    /// unacknowledged (the CQ is then left as it is).
    fn destroy(&mut self) -> Result<(), SourceError>;
}

/// A notification descriptor several sources share (`ibv_comp_channel`):
/// readable when any of them fired, and able to say which
/// ([`crate::notifier`] has the bookkeeping and its protocol).
pub trait SharedNotifier: Send + Sync + 'static {
    /// The one descriptor of the channel.
    fn fd(&self) -> BorrowedFd<'_>;

    /// Drains the descriptor and appends to `out` the tokens of the sources
    /// that fired since the last call. A token may come with nothing
    /// pending (its source's `take_events` then returns 0); a source with
    /// something pending is never left out. Each source then takes its own
    /// notifications with [`CompletionSource::take_events`].
    ///
    /// # Errors
    /// When reading the descriptor fails for a reason other than "nothing
    /// pending".
    fn take_ready(&self, out: &mut Vec<u64>) -> Result<(), SourceError>;
}
