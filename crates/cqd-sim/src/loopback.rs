//! A loopback queue pair on a bare simulated CQ: posting a request produces
//! its completion at once, with the status the request asks for. For
//! examples and benchmarks that drive a poller with a stream of
//! completions but still post through the one posting call
//! (`cqd_core::Registration::post_send` / `post_recv`), so that every
//! completion is accounted as a real QP's would be.
//!
//! ```
//! use std::collections::VecDeque;
//! use cqd_core::{split, CqOptions, NoWork, OpKind, Status};
//! use cqd_sim::{sim_cq, Faults, LoopWr, Loopback};
//! # struct H;
//! # impl cqd_core::Handler for H {
//! #     fn on_send(&mut self, _: &cqd_core::SendDone<'_>, _: &mut cqd_core::Outbox<'_, NoWork>) {}
//! #     fn on_recv(&mut self, _: &cqd_core::RecvDone<'_>, _: &mut cqd_core::Outbox<'_, NoWork>) {}
//! #     fn on_error(&mut self, _: &cqd_core::Failed<'_>, _: &mut cqd_core::Outbox<'_, NoWork>) {}
//! # }
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let (producer, source) = sim_cq("cq", 64, Faults::default())?;
//! let (poller, handle) = split::<NoWork>(source, CqOptions::default())?;
//! let mut poller = poller.bind();
//! let qp = Loopback::new(producer, 7);
//! let reg = handle.register(H)?;
//! reg.post_send(&qp, &mut [
//!     LoopWr::new(1, OpKind::Write).unsignaled(),
//!     LoopWr::new(2, OpKind::Write),
//!     LoopWr::new(3, OpKind::Send).failing(Status::WrFlush),
//! ])?;
//! assert_eq!(poller.poll_once(&mut VecDeque::new())?, 2);
//! assert_eq!(reg.ledger().outstanding(), 0);
//! # Ok(())
//! # }
//! ```

use std::sync::Arc;

use cqd_core::ledger::{Queue, QueueAccount, WrLedger};
use cqd_core::post::{PostRecv, PostSend, Refused, SendRequest, WorkRequest};
use cqd_core::{Completion, OpKind, Opcode, Status};

use crate::cq::{PushError, SimCq};

/// A request on a [`Loopback`] queue: its completion's status and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoopWr {
    /// The tag on the way in, the encoded wr_id on the way out.
    pub wr_id: u64,
    /// The operation.
    pub kind: OpKind,
    /// The status its completion carries.
    pub status: Status,
    /// The completion's `byte_len`.
    pub byte_len: u32,
    /// A successful unsignaled send produces no completion.
    pub signaled: bool,
}

impl LoopWr {
    /// A signaled request of `kind` that succeeds.
    pub fn new(tag: u64, kind: OpKind) -> Self {
        LoopWr {
            wr_id: tag,
            kind,
            status: Status::Success,
            byte_len: 0,
            signaled: true,
        }
    }

    /// Completes with `status`.
    pub fn failing(mut self, status: Status) -> Self {
        self.status = status;
        self
    }

    /// Without a completion on success.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// With this `byte_len`.
    pub fn with_len(mut self, byte_len: u32) -> Self {
        self.byte_len = byte_len;
        self
    }

    fn completion(&self, qp_num: u32) -> Option<Completion> {
        if !self.status.is_success() {
            return Some(Completion::error(self.wr_id, self.status, qp_num));
        }
        if !self.signaled && self.kind != OpKind::Recv {
            return None;
        }
        let opcode = match self.kind {
            OpKind::Recv => Opcode::Recv,
            OpKind::Write => Opcode::RdmaWrite,
            OpKind::Read => Opcode::RdmaRead,
            OpKind::Atomic => Opcode::FetchAdd,
            OpKind::Send | OpKind::Internal => Opcode::Send,
            OpKind::Window => Opcode::BindMw,
        };
        let mut c = Completion::success(self.wr_id, opcode, qp_num);
        c.byte_len = self.byte_len;
        Some(c)
    }
}

impl WorkRequest for LoopWr {
    fn wr_id(&self) -> u64 {
        self.wr_id
    }

    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

impl SendRequest for LoopWr {
    fn kind(&self) -> OpKind {
        self.kind
    }

    fn signaled(&self) -> bool {
        self.signaled
    }
}

/// Why a loopback post failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoopbackError {
    /// The posting call refused the list.
    #[error(transparent)]
    Refused(#[from] Refused),
    /// The CQ overflowed or is gone.
    #[error(transparent)]
    Push(#[from] PushError),
}

/// A queue pair whose posts complete at once on a bare simulated CQ (see
/// the module documentation). Its send and receive queues have accounts on
/// the CQ's ledger, which the CQ's source gave `split` to attach.
#[derive(Debug)]
pub struct Loopback {
    producer: SimCq,
    qp_num: u32,
    ledger: WrLedger,
    send: Arc<QueueAccount>,
    recv: Arc<QueueAccount>,
}

impl Loopback {
    /// A loopback QP numbered `qp_num` completing on `producer`, its
    /// queues attached to the CQ's ledger (made with credits by
    /// [`sim_cq_with_ledger`](crate::sim_cq_with_ledger) and
    /// `WrLedger::with_budget`).
    pub fn new(producer: SimCq, qp_num: u32) -> Self {
        let ledger = producer.ledger().clone();
        Loopback {
            send: ledger.open_queue(qp_num, Queue::Send),
            recv: ledger.open_queue(qp_num, Queue::Recv),
            producer,
            qp_num,
            ledger,
        }
    }

    /// The ledger of its queues.
    pub fn ledger(&self) -> &WrLedger {
        &self.ledger
    }

    fn push(&self, wrs: &[LoopWr]) -> Result<(), (usize, LoopbackError)> {
        for (i, wr) in wrs.iter().enumerate() {
            if let Some(c) = wr.completion(self.qp_num) {
                self.producer.push(c, false).map_err(|e| (i, e.into()))?;
            }
        }
        Ok(())
    }
}

impl PostSend for Loopback {
    type Wr<'a> = LoopWr;
    type Error = LoopbackError;

    fn send_account(&self) -> &QueueAccount {
        &self.send
    }

    fn post_send_unaccounted(&self, wrs: &[LoopWr]) -> Result<(), (usize, LoopbackError)> {
        self.push(wrs)
    }
}

impl PostRecv for Loopback {
    type Wr<'a> = LoopWr;
    type Error = LoopbackError;

    fn recv_account(&self) -> &QueueAccount {
        &self.recv
    }

    fn post_recv_unaccounted(&self, wrs: &[LoopWr]) -> Result<(), (usize, LoopbackError)> {
        self.push(wrs)
    }
}

impl Drop for Loopback {
    fn drop(&mut self) {
        self.send.close();
        self.recv.close();
    }
}
