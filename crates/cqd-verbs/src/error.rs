//! The errors of the verbs backend: each names the verb, the object and the
//! errno, so a log line is enough to act on.

use std::io;

use cqd_core::budget::BudgetError;
use cqd_core::ledger::SrqOnOtherCq;
use cqd_core::post::Refused;
use cqd_core::source::SourceError;

/// An error of a verb (creation, modification, destruction).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// No RDMA device of that name, or none at all.
    #[error("no RDMA device {wanted}: {reason} (devices seen: {seen:?}){hint}")]
    NoDevice {
        /// The name asked for (`"(any)"` for the first device).
        wanted: String,
        /// Why: the device list failed (with its errno), or no name matched.
        reason: String,
        /// The errno, when a verb failed (`ENODEV` when none matched).
        errno: i32,
        /// The devices libibverbs listed.
        seen: Vec<String>,
        /// What to try (softverbs-run on a machine without RDMA).
        hint: &'static str,
    },
    /// A verb failed.
    #[error("{verb} on {object} failed: {source}")]
    Verb {
        /// The libibverbs call.
        verb: &'static str,
        /// What it was called on.
        object: String,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// A QP's depth could not be admitted on its CQ (the CQ could overflow).
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// An SRQ already serves the handlers of another CQ.
    #[error(transparent)]
    SrqOnOtherCq(#[from] SrqOnOtherCq),
    /// The dispatcher's half of a CQ could not be made.
    #[error(transparent)]
    Split(#[from] SourceError),
    /// An argument is out of range.
    #[error("{0}")]
    Invalid(String),
    /// The device reported a fatal error (`IBV_EVENT_DEVICE_FATAL`); make a
    /// new context once it is back.
    #[error("RDMA device {device} is gone (fatal error reported)")]
    DeviceGone {
        /// The device's name.
        device: String,
    },
}

impl VerbsError {
    pub(crate) fn verb(verb: &'static str, object: impl Into<String>, source: io::Error) -> Self {
        VerbsError::Verb {
            verb,
            object: object.into(),
            source,
        }
    }

    /// The errno of a failed verb, if this is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            VerbsError::NoDevice { errno, .. } => Some(*errno),
            VerbsError::Verb { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// Why a post failed. Nothing of the failed requests (and of those after
/// them in the list) was posted or recorded: their tags are back in their
/// wr_id fields.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PostError {
    /// The posting call refused the list before the device saw it.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// `ibv_post_send` / `ibv_post_recv` / `ibv_post_srq_recv` refused the
    /// request at `index` (its `bad_wr`); those before it were posted.
    #[error("{verb} on {queue} refused work request {index}: {source}")]
    Device {
        /// The verb.
        verb: &'static str,
        /// The queue (`QP 17 send queue`, `SRQ 3`).
        queue: String,
        /// The index of the bad request in the list.
        index: usize,
        /// The errno.
        #[source]
        source: io::Error,
    },
    /// The device reported a fatal error (or the post failed with EIO /
    /// ENODEV): nothing of the list was posted from the refused request on.
    #[error("{queue}: RDMA device {device} is gone")]
    DeviceGone {
        /// The device.
        device: String,
        /// The queue.
        queue: String,
    },
    /// A request is malformed for this queue (too many SGEs, inline data
    /// too long), found before the device was called.
    #[error("{queue}: work request {index}: {why}")]
    Invalid {
        /// The queue.
        queue: String,
        /// The request's index in the list.
        index: usize,
        /// What is wrong.
        why: String,
    },
}
