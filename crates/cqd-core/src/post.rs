//! Posting: one call, or it did not happen.
//!
//! The dispatcher's promises hold only if every post is accounted, so a post
//! is one call on a handler's `Registration` (`crate::cq`):
//! `post_send` or `post_recv`. It
//!
//! 0. has the queue check each request ([`PostSend::check_send`]; see
//!    below), and refuses the list untouched if one is invalid;
//! 1. encodes each request's wr_id: on the way in a work request's wr_id
//!    field carries the caller's tag (at most
//!    [`MAX_TAG`](crate::wr_id::MAX_TAG)); the call replaces it with the
//!    wr_id that names the handler, the kind and the tag;
//! 2. counts the requests as posted in the handler's ledger, per kind, or
//!    refuses the list if the handler was released
//!    ([`Refused::Released`]) or is not installed yet
//!    ([`Refused::NotInstalled`]);
//! 3. takes the queue's posting lock (posters of one queue serialise; the
//!    poller never takes it) and the CQ's credits (refused: the counts of
//!    step 2 are taken back);
//! 4. writes the requests' entries in the queue's [`QueueAccount`] (wr_id,
//!    post time, credit, signaled), in post order, and publishes them
//!    (R1–R2 of the ring protocol in `account::ring`);
//! 5. calls the backend's post (R3) — still under the posting lock, so that
//!    the account's order is the queue's order whatever the number of
//!    posting threads;
//! 6. if the backend posted only the first `k` requests (verbs posts up to
//!    `bad_wr`), tombstones the others' entries (R4) and takes back
//!    everything else of them: their credits, their posted counts, and
//!    their tags in their wr_id fields, so the rest of the list can be
//!    posted again as it is.
//!
//! A completion can arrive before the post returns (an inline NIC, a fast
//! one): it finds the handler's ledger counting the request (step 2) and
//! its entry published (step 4), and the poller retires it at once: it
//! never waits for a poster, nor a poster for it.
//!
//! Backends implement [`PostSend`] (a QP's send queue) and [`PostRecv`] (a
//! QP's receive queue, a shared receive queue); applications and tests are
//! written once against these traits.
//!
//! Before step 1 touches a request, the queue checks it
//! ([`PostSend::check_send`]): what a device would otherwise take and fail
//! later, or fail on the wire — an atomic whose remote address is not
//! 8-byte aligned or whose local scatter list is not exactly the 8 bytes
//! of the old value ([`check_atomic`]), a datagram longer than the path
//! MTU ([`check_datagram`]), an operation its transport does not have
//! (RDMA on a UD QP, a datagram on an RC QP). Such a list is refused as a
//! whole with [`Refused::Invalid`], naming the request; nothing was posted
//! or recorded. The check is one `match` per request: an RC request pays a
//! compare and a branch.
//!
//! The expert path — `Registration::wr_id`, `Registration::track`,
//! [`WrLedger::posted`](crate::ledger::WrLedger::posted) — is for adopting
//! code that already posts by itself; the posting call needs none of it.

use crate::account::QueueAccount;
use crate::budget::BudgetError;
use crate::wr_id::{OpKind, WrIdError};

/// What the posting call needs of a work request.
pub trait WorkRequest {
    /// The wr_id field.
    fn wr_id(&self) -> u64;
    /// Sets the wr_id field.
    fn set_wr_id(&mut self, wr_id: u64);
}

/// What the posting call needs of a send-side work request.
pub trait SendRequest: WorkRequest {
    /// The operation, stored in the wr_id; it routes the completion (also
    /// an error, whose opcode is undefined).
    ///
    /// Signaled or not, every request is recorded: an unsignaled one is
    /// retired by the next completion of its send queue, or flushed.
    fn kind(&self) -> OpKind;
    /// True if the request asks for a completion on success
    /// (`IBV_SEND_SIGNALED`, or a QP made with `sq_sig_all`). Recorded with
    /// the request: a success names only signaled requests, so a wr_id
    /// posted twice retires the right one.
    fn signaled(&self) -> bool;
}

/// Why a work request cannot be posted as it is, found before the device
/// sees it (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Invalid {
    /// An atomic's remote address is not a multiple of 8 (the device would
    /// fail it with a remote invalid request and move the responder's QP
    /// to the error state).
    #[error("atomic target address {addr:#x} is not 8-byte aligned")]
    AtomicMisaligned {
        /// The remote address.
        addr: u64,
    },
    /// An atomic's local scatter list does not add up to the 8 bytes of
    /// the old value it receives.
    #[error("an atomic's local scatter list must be exactly 8 bytes (the old value), not {len}")]
    AtomicLocalLength {
        /// The list's total length.
        len: u64,
    },
    /// A datagram longer than its QP's path MTU: UD does not segment.
    #[error("a {len}-byte datagram does not fit the {mtu}-byte MTU of a UD QP")]
    DatagramTooLong {
        /// The datagram's length.
        len: u64,
        /// The MTU.
        mtu: u32,
    },
    /// The operation does not exist on the QP's transport.
    #[error("{op} cannot be posted on a {transport} QP")]
    Transport {
        /// The operation (`RDMA WRITE`, `a datagram`, …).
        op: &'static str,
        /// The QP's transport (`UD`, `RC`).
        transport: &'static str,
    },
}

/// Checks an atomic (compare-and-swap, fetch-and-add): the remote address
/// 8-byte aligned, the local scatter list (`local_len` bytes in all)
/// exactly 8.
///
/// # Errors
/// [`Invalid::AtomicMisaligned`], [`Invalid::AtomicLocalLength`].
#[inline]
pub const fn check_atomic(remote_addr: u64, local_len: u64) -> Result<(), Invalid> {
    if remote_addr % 8 != 0 {
        return Err(Invalid::AtomicMisaligned { addr: remote_addr });
    }
    if local_len != 8 {
        return Err(Invalid::AtomicLocalLength { len: local_len });
    }
    Ok(())
}

/// Checks a datagram of `len` bytes against its UD QP's `mtu` (0: not
/// known yet, left to the device).
///
/// # Errors
/// [`Invalid::DatagramTooLong`].
#[inline]
pub const fn check_datagram(len: u64, mtu: u32) -> Result<(), Invalid> {
    if mtu != 0 && len > mtu as u64 {
        return Err(Invalid::DatagramTooLong { len, mtu });
    }
    Ok(())
}

/// Why the posting call refused a list before the backend saw it. Nothing
/// of the list was posted or recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refused {
    /// A request's wr_id cannot be made: its tag does not fit, or its
    /// kind is cqd's own ([`OpKind::Internal`]).
    #[error("work request {index}: {source}")]
    Tag {
        /// The request's index in the list.
        index: usize,
        /// The tag error.
        #[source]
        source: WrIdError,
    },
    /// A request's kind belongs to the other side of the queue pair (a
    /// receive posted on a send queue, or the reverse): its completion would
    /// be looked for in the wrong queue.
    #[error("work request {index}: a {kind} request cannot be posted on a {queue:?} queue")]
    WrongSide {
        /// The request's index in the list.
        index: usize,
        /// Its kind.
        kind: OpKind,
        /// The queue posted to.
        queue: crate::account::Queue,
    },
    /// A request the device would fail or refuse (see [`Invalid`]).
    #[error("work request {index}: {source}")]
    Invalid {
        /// The request's index in the list.
        index: usize,
        /// What is wrong with it.
        #[source]
        source: Invalid,
    },
    /// Too few CQ credits are left.
    #[error(transparent)]
    Credits(#[from] BudgetError),
    /// The send queue is full: the list would take it past its depth
    /// (its requests not yet retired, `tail - head`, as the device counts
    /// its slots). Nothing was posted; post it again once completions of
    /// the queue have been polled (a completion future waits for room by
    /// itself). A connection need not end on it.
    #[error("QP {qp_num}'s send queue is full: {outstanding} of its {depth} slots hold requests not yet completed, {posting} more asked; post again after its completions")]
    Full {
        /// The QP.
        qp_num: u32,
        /// The queue's depth (as the backend reserved it).
        depth: u32,
        /// Its requests not yet retired.
        outstanding: u64,
        /// The requests the list asked for.
        posting: usize,
    },
    /// The handler's CQ has no ledger: its source gave none to `split` and
    /// none was attached, so no poller would retire what is posted.
    #[error("handler {handler}'s CQ {cq} has no ledger: use a source that gives one to split (every cqd backend's does) or attach the CQ's ledger (CqHandle::attach_ledger)")]
    Unattached {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
        /// The handler's CQ.
        cq: String,
    },
    /// The handler was unregistered and released: its slot may hold
    /// another handler, and the requests would never reach this one.
    #[error(
        "handler {handler} was released (unregistered, nothing outstanding): it posts no more"
    )]
    Released {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
    },
    /// The handler is still being made: a post from inside the closure of
    /// [`CqHandle::register_with`](crate::CqHandle::register_with), before
    /// the handler that would receive its completions is installed.
    #[error("handler {handler} is not installed yet: post from its callbacks, or once register_with has returned, not from inside its closure")]
    NotInstalled {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
    },
    /// The handler's table of request contexts has fewer free slots than
    /// the list has requests: `capacity` requests are outstanding.
    #[error("handler {handler}'s {capacity} request contexts are all in use")]
    Contexts {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
        /// The table's capacity.
        capacity: u32,
    },
    /// A context handler's poller has stopped (its handler was dropped
    /// and handed back what it held): a context posted now would never
    /// come back to it.
    #[error("handler {handler}'s poller has stopped: a context posted now would not come back")]
    Ended {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
    },
    /// A request with a context is tagged with its position on its queue
    /// (24 bits): the queue still holds a request posted about 2^24 posts
    /// ago, whose tag a new one could repeat. Requests without contexts
    /// are still taken; this clears once that request completes.
    #[error("handler {handler}: queue {queue} holds a request outstanding for about 2^24 posts; a context's tag could repeat its tag")]
    ContextTagsWrap {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
        /// The queue's number (its QP's, or its SRQ's).
        queue: u32,
    },
    /// The queue's completions go to another CQ than the handler's: they
    /// would never reach it.
    #[error("the queue's completions go to another CQ than handler {handler}'s ({cq})")]
    WrongCq {
        /// The handler.
        handler: crate::wr_id::HandlerKey,
        /// The handler's CQ.
        cq: String,
    },
}

/// A queue that send-side requests are posted to: a QP's send queue.
pub trait PostSend {
    /// The backend's send work request.
    type Wr<'a>: SendRequest;
    /// The backend's post error; the posting call's refusals convert into
    /// it.
    type Error: From<Refused>;

    /// Waits until the send queue has room for `n` more requests, at most
    /// `timeout` ([`QueueAccount::wait_room`]): after a
    /// [`Refused::Full`], post again once it returns.
    ///
    /// # Errors
    /// As [`QueueAccount::wait_room`].
    fn wait_send_room(
        &self,
        n: usize,
        timeout: std::time::Duration,
    ) -> Result<(), crate::account::RoomError> {
        self.send_account().wait_room(n, timeout)
    }

    /// As [`wait_send_room`](Self::wait_send_room), as a future
    /// ([`QueueAccount::room`]).
    fn send_room(&self, n: usize) -> crate::account::SendRoom<'_> {
        self.send_account().room(n)
    }

    /// The send queue's account.
    fn send_account(&self) -> &QueueAccount;
    /// Checks one request before anything of its list is recorded or
    /// posted: operation against the QP's transport, atomics' alignment and
    /// local length ([`check_atomic`]), datagrams against the MTU
    /// ([`check_datagram`]). The default accepts everything.
    ///
    /// # Errors
    /// What is wrong with the request; the posting call refuses the list
    /// with [`Refused::Invalid`].
    #[inline]
    fn check_send(&self, wr: &Self::Wr<'_>) -> Result<(), Invalid> {
        let _ = wr;
        Ok(())
    }
    /// The backend's own post, which the posting call wraps: posts `wrs`
    /// in order and **bypasses every account** (no ledger, no queue
    /// account, no credit). Their completions reach no handler: each is
    /// counted foreign, and the stop's verdict names it. Post through a
    /// registration ([`Registration::post_send`](crate::Registration::post_send)) instead. On failure returns how
    /// many requests, from the front, were posted before it (verbs: those
    /// before `bad_wr`), with the error.
    ///
    /// # Errors
    /// The backend's.
    fn post_send_unaccounted(&self, wrs: &[Self::Wr<'_>]) -> Result<(), (usize, Self::Error)>;
}

/// A queue that receives are posted to: a QP's receive queue or a shared
/// receive queue.
pub trait PostRecv {
    /// The backend's receive work request.
    type Wr<'a>: WorkRequest;
    /// The backend's post error; the posting call's refusals convert into
    /// it.
    type Error: From<Refused>;

    /// The receive queue's account (an SRQ's, for a QP that draws on one).
    fn recv_account(&self) -> &QueueAccount;
    /// The backend's own post, which the posting call wraps: bypasses
    /// every account, as [`PostSend::post_send_unaccounted`] does. Post
    /// through a registration ([`Registration::post_recv`](crate::Registration::post_recv)) instead. On
    /// failure returns how many requests, from the front, were posted
    /// before it, with the error.
    ///
    /// # Errors
    /// The backend's.
    fn post_recv_unaccounted(&self, wrs: &[Self::Wr<'_>]) -> Result<(), (usize, Self::Error)>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn atomics_need_alignment_and_eight_local_bytes() {
        assert_eq!(check_atomic(0x1000, 8), Ok(()));
        assert_eq!(check_atomic(u64::MAX - 7, 8), Ok(()));
        for addr in [1u64, 4, 0x1004, u64::MAX] {
            assert_eq!(
                check_atomic(addr, 8),
                Err(Invalid::AtomicMisaligned { addr })
            );
        }
        for len in [0u64, 4, 7, 9, 16] {
            assert_eq!(
                check_atomic(0x1000, len),
                Err(Invalid::AtomicLocalLength { len })
            );
        }
        let msg = Refused::Invalid {
            index: 2,
            source: Invalid::AtomicMisaligned { addr: 0x1004 },
        }
        .to_string();
        assert_eq!(
            msg,
            "work request 2: atomic target address 0x1004 is not 8-byte aligned"
        );
    }

    #[test]
    fn datagrams_fit_the_mtu() {
        assert_eq!(check_datagram(4096, 4096), Ok(()));
        assert_eq!(check_datagram(0, 256), Ok(()));
        assert_eq!(
            check_datagram(4097, 4096),
            Err(Invalid::DatagramTooLong {
                len: 4097,
                mtu: 4096
            })
        );
        // An MTU not known yet is left to the device.
        assert_eq!(check_datagram(1 << 20, 0), Ok(()));
    }
}
