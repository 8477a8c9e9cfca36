//! Asynchronous events: what a device reports about a CQ, a queue pair or a
//! shared receive queue outside the completion stream.
//!
//! A [`CompletionSource`](crate::source::CompletionSource) hands them to its
//! poller, which counts and traces them and gives a queue's events to the
//! handler that owns the queue ([`Handler::on_async`](crate::handler::Handler::on_async)).

/// An asynchronous event of a CQ or its device.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum AsyncEvent {
    /// The CQ overflowed (`IBV_EVENT_CQ_ERR`): completions were lost and the
    /// CQ is in error. With admission on, this never happens.
    CqOverflow {
        /// The CQ's capacity.
        capacity: u32,
        /// Entries the device could not write (if it knows).
        lost: u64,
    },
    /// The device reported a fatal error (`IBV_EVENT_DEVICE_FATAL`).
    DeviceFatal,
    /// An event of a queue pair whose completions come to this CQ. Given to
    /// the QP's owning handler ([`Handler::on_async`]) when the backend
    /// knows it.
    ///
    /// [`Handler::on_async`]: crate::handler::Handler::on_async
    Qp {
        /// The QP.
        qp_num: u32,
        /// What happened.
        kind: QpEvent,
        /// The handler that owns the QP, if one was named when it was made.
        owner: Option<crate::wr_id::HandlerKey>,
    },
    /// An event of a shared receive queue whose receives complete on this
    /// CQ; given to its owning handler as for [`AsyncEvent::Qp`].
    Srq {
        /// The SRQ's number.
        srq_num: u32,
        /// What happened.
        kind: SrqEvent,
        /// The owning handler, if one was named.
        owner: Option<crate::wr_id::HandlerKey>,
    },
    /// Not a device's event: the backend destroyed QP `qp_num`, which drew
    /// its receives from an SRQ whose completions come to this CQ, on a
    /// device that keeps a destroyed QP's completions in its CQs and
    /// writes none after the destroy returned (the kernel's rxe). Every
    /// completion of the QP is in this CQ: its poller quiesces the QP's SRQ
    /// use after its next short poll (step 2' of `ledger::teardown`). The
    /// poller neither counts it among the asynchronous events nor gives it
    /// to a handler.
    QpDestroyed {
        /// The QP.
        qp_num: u32,
    },
    /// Another event, by its `ibv_event_type` number.
    Other(u32),
}

impl AsyncEvent {
    /// The handler the event is for, if any.
    pub fn owner(&self) -> Option<crate::wr_id::HandlerKey> {
        match self {
            AsyncEvent::Qp { owner, .. } | AsyncEvent::Srq { owner, .. } => *owner,
            _ => None,
        }
    }
}

/// What happened to a queue pair (`ibv_event_type`'s QP events).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum QpEvent {
    /// `IBV_EVENT_QP_FATAL`: the QP is in the error state; its requests
    /// flush.
    Fatal,
    /// `IBV_EVENT_QP_REQ_ERR`: the responder saw an invalid request; the
    /// QP is in the error state.
    RequestError,
    /// `IBV_EVENT_QP_ACCESS_ERR`: a remote access violation on the
    /// responder; the QP is in the error state.
    AccessError,
    /// `IBV_EVENT_COMM_EST`: a message arrived on a QP still in RTR.
    CommunicationEstablished,
    /// `IBV_EVENT_SQ_DRAINED`
    SendQueueDrained,
    /// `IBV_EVENT_PATH_MIG`
    PathMigrated,
    /// `IBV_EVENT_PATH_MIG_ERR`
    PathMigrationError,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED`: a QP on an SRQ in the error state
    /// will consume no more receives; it can be destroyed once its
    /// completions are polled.
    LastWqeReached,
}

/// What happened to a shared receive queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum SrqEvent {
    /// `IBV_EVENT_SRQ_LIMIT_REACHED`: fewer receives are left than the
    /// armed limit (post more).
    LimitReached,
    /// `IBV_EVENT_SRQ_ERR`: the SRQ is in error.
    Error,
}
