//! Errors of the simulated NIC: verbs that fail ([`VerbsError`]) and posts
//! that are refused ([`PostError`]). A refused post changes nothing: no
//! request of the list was queued.

use cqd_core::budget::BudgetError;
use cqd_core::post::Refused;
use cqd_core::SourceError;

use crate::cq::SimCqError;
use crate::qp::QpState;

/// Errors of creating, modifying and destroying NIC objects.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// A request beyond a device attribute.
    #[error("{what}: requested {requested}, the device allows at most {max}")]
    LimitExceeded {
        /// The attribute (for example `max_qp_wr`).
        what: &'static str,
        /// What was asked.
        requested: u64,
        /// The device's limit.
        max: u64,
    },
    /// Objects of different devices or protection domains mixed.
    #[error("{what} belongs to another {owner}")]
    Foreign {
        /// The object.
        what: &'static str,
        /// Device or protection domain.
        owner: &'static str,
    },
    /// The CQ budget refused the attach.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The QP's receive CQ is not the CQ its SRQ serves.
    #[error(transparent)]
    SrqOnOtherCq(#[from] cqd_core::ledger::SrqOnOtherCq),
    /// The CQ could not be made.
    #[error(transparent)]
    Cq(#[from] SimCqError),
    /// The CQ could not be split into its poller and handle.
    #[error(transparent)]
    Split(#[from] SourceError),
    /// A QP state transition the RC state machine does not have.
    #[error("QP {qpn}: no transition from {from:?} to {to:?}")]
    BadTransition {
        /// The QP.
        qpn: u32,
        /// Its current state.
        from: QpState,
        /// The state asked for.
        to: QpState,
    },
    /// A modify attribute out of range.
    #[error("QP {qpn}: attribute {what} = {value} is invalid (max {max})")]
    BadAttr {
        /// The QP.
        qpn: u32,
        /// The attribute.
        what: &'static str,
        /// The value given.
        value: u64,
        /// The largest valid value.
        max: u64,
    },
    /// The verb does not apply to the QP's transport (an RC transition on
    /// a UD QP, or the reverse).
    #[error("QP {qpn} is {qp_type:?}: {what} does not apply")]
    WrongQpType {
        /// The QP.
        qpn: u32,
        /// Its transport.
        qp_type: crate::qp::QpType,
        /// What was asked.
        what: &'static str,
    },
    /// An address handle's attributes name no destination.
    #[error("invalid address handle: {why}")]
    BadAh {
        /// What is wrong.
        why: &'static str,
    },
    /// No QP with this number exists on the fabric.
    #[error("no QP {qpn} on this fabric")]
    NoSuchQp {
        /// The QP number.
        qpn: u32,
    },
    /// The object was destroyed.
    #[error("{what} was destroyed")]
    Destroyed {
        /// The object.
        what: &'static str,
    },
    /// Memory access outside a memory region.
    #[error("access of {len} bytes at offset {offset} is outside the {size}-byte memory region")]
    OutOfBounds {
        /// The offset asked.
        offset: u64,
        /// The length asked.
        len: u64,
        /// The region's size.
        size: u64,
    },
    /// The device vanished (see `Device::vanish`).
    #[error("RDMA device {device} is gone")]
    DeviceGone {
        /// The device's name.
        device: String,
    },
    /// The timed engine's thread could not be started.
    #[error("could not start the NIC engine thread: {source}")]
    Spawn {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Why a post was refused. Nothing of the list was queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The QP's state does not accept this queue's requests (send needs
    /// RTS; receive needs INIT or later).
    #[error("QP {qpn}: cannot post to the {queue} queue in state {state:?}")]
    WrongState {
        /// The QP.
        qpn: u32,
        /// `send` or `recv`.
        queue: &'static str,
        /// Its state.
        state: QpState,
    },
    /// The queue would hold more requests than its depth. Slots are freed
    /// when their completions are polled (an unsignaled send's with the
    /// next completion of its queue).
    #[error("QP {qpn}: {queue} queue full (depth {depth}, {outstanding} outstanding, posting {posting})")]
    QueueFull {
        /// The QP (or SRQ number).
        qpn: u32,
        /// `send`, `recv` or `srq`.
        queue: &'static str,
        /// The queue's depth.
        depth: u32,
        /// Requests holding a slot.
        outstanding: u32,
        /// Requests in this post.
        posting: u32,
    },
    /// A work request has more scatter/gather entries than the queue allows.
    #[error("QP {qpn}: work request {index} has {sges} SGEs, the queue allows {max}")]
    TooManySge {
        /// The QP.
        qpn: u32,
        /// Index of the work request in the list.
        index: usize,
        /// Its SGE count.
        sges: usize,
        /// The queue's `max_sge`.
        max: u32,
    },
    /// A request its QP's transport does not have (an RDMA operation or
    /// a SEND without destination on a UD QP, a datagram on an RC QP).
    #[error("QP {qpn}: work request {index}: {source}")]
    Invalid {
        /// The QP.
        qpn: u32,
        /// Index of the work request in the list.
        index: usize,
        /// What is wrong.
        #[source]
        source: cqd_core::post::Invalid,
    },
    /// A UD send's address handle belongs to another protection domain.
    #[error(
        "QP {qpn}: work request {index}: the address handle belongs to another protection domain"
    )]
    ForeignAh {
        /// The QP.
        qpn: u32,
        /// Index of the work request in the list.
        index: usize,
    },
    /// The QP draws receives from an SRQ; post them there.
    #[error("QP {qpn} uses an SRQ: post receives to the SRQ")]
    HasSrq {
        /// The QP.
        qpn: u32,
    },
    /// Credits are on and none is left (see `cqd_core::budget`).
    #[error(transparent)]
    Credits(#[from] BudgetError),
    /// The posting call refused the list before posting (a tag too large,
    /// a queue whose completions go to another CQ than the handler's).
    #[error(transparent)]
    Refused(Refused),
    /// The QP was destroyed.
    #[error("QP {qpn} was destroyed")]
    Destroyed {
        /// The QP.
        qpn: u32,
    },
    /// The QP's device vanished.
    #[error("QP {qpn}: its device is gone")]
    DeviceGone {
        /// The QP.
        qpn: u32,
    },
}

impl From<Refused> for PostError {
    fn from(r: Refused) -> Self {
        match r {
            Refused::Credits(e) => PostError::Credits(e),
            // The posting call's own check, the NIC's refusal made early.
            Refused::Full {
                qp_num,
                depth,
                outstanding,
                posting,
            } => PostError::QueueFull {
                qpn: qp_num,
                queue: "send",
                depth,
                outstanding: u32::try_from(outstanding).unwrap_or(u32::MAX),
                posting: u32::try_from(posting).unwrap_or(u32::MAX),
            },
            other => PostError::Refused(other),
        }
    }
}
