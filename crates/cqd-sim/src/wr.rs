//! Work requests: what a post hands the NIC (`ibv_send_wr`, `ibv_recv_wr`).
//! The caller's `wr_id` comes back untouched in the completion.

use crate::ah::{Datagram, UdDest};
use crate::mr::{RemoteAddr, Sge};
use crate::state::Op;

/// A send-side operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WrOp {
    /// SEND: consumes a receive on the peer.
    Send,
    /// SEND with immediate data.
    SendWithImm(u32),
    /// RDMA WRITE.
    Write(RemoteAddr),
    /// RDMA WRITE with immediate: also consumes a receive on the peer.
    WriteWithImm(RemoteAddr, u32),
    /// RDMA READ into the local SGEs (which need LOCAL_WRITE).
    Read(RemoteAddr),
    /// Atomic compare-and-swap of the 8 aligned bytes at `remote`; the old
    /// value lands in the (8-byte) local SGE.
    CompareSwap {
        /// The target.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// New value if it matched.
        swap: u64,
    },
    /// Atomic fetch-and-add; the old value lands in the local SGE.
    FetchAdd {
        /// The target.
        remote: RemoteAddr,
        /// Added value.
        add: u64,
    },
}

/// A send-side work request (`ibv_send_wr`).
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Handed back untouched in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: WrOp,
    /// Local scatter/gather list.
    pub sg_list: &'a [Sge],
    /// Produce a completion on success (`IBV_SEND_SIGNALED`). Errors always
    /// produce one.
    pub signaled: bool,
    /// Ask the peer's CQ to notify a solicited-only arm
    /// (`IBV_SEND_SOLICITED`).
    pub solicited: bool,
    /// The destination of a SEND on a UD QP (`wr.ud`); `None` on RC.
    pub ud: Option<UdDest<'a>>,
}

impl<'a> SendWr<'a> {
    /// A signaled, unsolicited request.
    pub fn new(wr_id: u64, op: WrOp, sg_list: &'a [Sge]) -> Self {
        SendWr {
            wr_id,
            op,
            sg_list,
            signaled: true,
            solicited: false,
            ud: None,
        }
    }

    /// A datagram to `dest` (a SEND or SEND with immediate on a UD QP).
    pub fn to(mut self, dest: UdDest<'a>) -> Self {
        self.ud = Some(dest);
        self
    }

    /// Bytes of the local scatter list.
    pub fn len(&self) -> u64 {
        self.sg_list.iter().map(|s| u64::from(s.length)).sum()
    }

    /// True for an empty scatter list.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Without a completion on success.
    pub fn unsignaled(mut self) -> Self {
        self.signaled = false;
        self
    }

    /// With the solicited flag.
    pub fn solicited(mut self) -> Self {
        self.solicited = true;
        self
    }
}

/// A receive work request (`ibv_recv_wr`).
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Handed back untouched in the completion.
    pub wr_id: u64,
    /// Where the message lands.
    pub sg_list: &'a [Sge],
}

impl<'a> RecvWr<'a> {
    /// A receive into `sg_list`.
    pub fn new(wr_id: u64, sg_list: &'a [Sge]) -> Self {
        RecvWr { wr_id, sg_list }
    }
}

pub(crate) fn op_of(wr: &SendWr<'_>) -> Op {
    if let Some(d) = wr.ud {
        let imm = match wr.op {
            WrOp::SendWithImm(imm) => Some(imm),
            _ => None,
        };
        return Op::Datagram(Datagram {
            imm,
            ah: d.ah.attr,
            qpn: d.qpn,
            qkey: d.qkey,
        });
    }
    match wr.op {
        WrOp::Send => Op::Send { imm: None },
        WrOp::SendWithImm(imm) => Op::Send { imm: Some(imm) },
        WrOp::Write(remote) => Op::Write { remote, imm: None },
        WrOp::WriteWithImm(remote, imm) => Op::Write {
            remote,
            imm: Some(imm),
        },
        WrOp::Read(remote) => Op::Read { remote },
        WrOp::CompareSwap {
            remote,
            compare,
            swap,
        } => Op::CompareSwap {
            remote,
            compare,
            swap,
        },
        WrOp::FetchAdd { remote, add } => Op::FetchAdd { remote, add },
    }
}
