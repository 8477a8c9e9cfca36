//! Work requests: what a post hands the device (`ibv_send_wr`,
//! `ibv_recv_wr`), their kinds for cqd's wr_id, the transport check, and
//! the C form the device reads.

use cqd_core::post::{Invalid, SendRequest, WorkRequest};
use cqd_core::wr_id::OpKind;

use crate::ah::UdDest;
use crate::pd::{RemoteAddr, Sge};
use crate::qp::QpType;
use crate::sys;

/// A send-side operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum WrOp {
    /// SEND.
    Send,
    /// SEND with immediate data (network order as given).
    SendWithImm(u32),
    /// RDMA WRITE.
    Write(RemoteAddr),
    /// RDMA WRITE with immediate: also consumes a receive on the peer.
    WriteWithImm(RemoteAddr, u32),
    /// RDMA READ into the local SGEs.
    Read(RemoteAddr),
    /// Atomic compare-and-swap of the 8-byte word at `remote` (aligned);
    /// its old value lands in the local SGEs (8 bytes, local write).
    CompareSwap {
        /// The word.
        remote: RemoteAddr,
        /// Expected value.
        compare: u64,
        /// Stored if the word equals `compare`.
        swap: u64,
    },
    /// Atomic fetch-and-add on the 8-byte word at `remote` (aligned); its
    /// old value lands in the local SGEs (8 bytes, local write).
    FetchAdd {
        /// The word.
        remote: RemoteAddr,
        /// Added, modulo 2^64.
        add: u64,
    },
}

impl WrOp {
    pub(crate) fn name(self) -> &'static str {
        match self {
            WrOp::Send | WrOp::SendWithImm(_) => "SEND",
            WrOp::Write(_) | WrOp::WriteWithImm(..) => "RDMA WRITE",
            WrOp::Read(_) => "RDMA READ",
            WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => "an atomic",
        }
    }
}

/// A send-side work request (`ibv_send_wr`). On the way into the posting
/// call `wr_id` holds the caller's tag; the call replaces it with the
/// encoded wr_id (and puts the tag back if the request was not posted).
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// Tag in, wr_id out (see the type's documentation).
    pub wr_id: u64,
    /// The operation.
    pub op: WrOp,
    /// Local memory.
    pub sg_list: &'a [Sge<'a>],
    /// A completion on success (`IBV_SEND_SIGNALED`); errors always
    /// complete.
    pub signaled: bool,
    /// `IBV_SEND_SOLICITED`.
    pub solicited: bool,
    /// `IBV_SEND_INLINE`: the data is copied at post time (up to the QP's
    /// `max_inline_data`).
    pub inline: bool,
    /// The destination of a SEND on a UD QP (`wr.ud`); `None` on RC.
    pub ud: Option<UdDest<'a>>,
}

impl<'a> SendWr<'a> {
    /// A signaled request with tag `tag`.
    pub fn new(tag: u64, op: WrOp, sg_list: &'a [Sge<'a>]) -> Self {
        SendWr {
            wr_id: tag,
            op,
            sg_list,
            signaled: true,
            solicited: false,
            inline: false,
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
        self.sg_list.iter().map(|s| u64::from(s.len)).sum()
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

    /// With the inline flag.
    pub fn inline(mut self) -> Self {
        self.inline = true;
        self
    }
}

impl WorkRequest for SendWr<'_> {
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

impl SendRequest for SendWr<'_> {
    fn kind(&self) -> OpKind {
        match self.op {
            WrOp::Send | WrOp::SendWithImm(_) => OpKind::Send,
            WrOp::Write(_) | WrOp::WriteWithImm(..) => OpKind::Write,
            WrOp::Read(_) => OpKind::Read,
            WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => OpKind::Atomic,
        }
    }
    fn signaled(&self) -> bool {
        self.signaled
    }
}

/// A receive (`ibv_recv_wr`); `wr_id` as for [`SendWr`].
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// Tag in, wr_id out.
    pub wr_id: u64,
    /// Where the message lands.
    pub sg_list: &'a [Sge<'a>],
}

impl<'a> RecvWr<'a> {
    /// A receive with tag `tag` into `sg_list`.
    pub fn new(tag: u64, sg_list: &'a [Sge<'a>]) -> Self {
        RecvWr {
            wr_id: tag,
            sg_list,
        }
    }
}

impl WorkRequest for RecvWr<'_> {
    fn wr_id(&self) -> u64 {
        self.wr_id
    }
    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

/// The operation against the transport: UD sends SEND (with immediate) to
/// a destination, RC everything but datagrams.
pub(crate) fn transport_check(qp_type: QpType, wr: &SendWr<'_>) -> Result<(), Invalid> {
    let send = matches!(wr.op, WrOp::Send | WrOp::SendWithImm(_));
    let wrong = |op| {
        Err(Invalid::Transport {
            op,
            transport: qp_type.name(),
        })
    };
    match (qp_type, wr.ud.is_some(), send) {
        (QpType::Ud, true, true) | (QpType::Rc, false, _) => Ok(()),
        (QpType::Ud, false, true) => wrong("a SEND without destination (address handle)"),
        (QpType::Ud, _, false) => wrong(wr.op.name()),
        (QpType::Rc, true, _) => wrong("a datagram (address handle)"),
    }
}

/// The `ibv_send_wr` of `w` (unlinked), its scatter list at `sg`.
pub(crate) fn raw_send_wr(w: &SendWr<'_>, sg: *mut sys::ibv_sge) -> sys::ibv_send_wr {
    use sys::ibv_send_flags as f;
    use sys::ibv_wr_opcode as o;
    // SAFETY: plain C data; all-zero is a valid value.
    let mut r: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    r.wr_id = w.wr_id;
    r.sg_list = sg;
    r.num_sge = w.sg_list.len() as i32;
    let (opcode, imm, remote) = match w.op {
        WrOp::Send => (o::IBV_WR_SEND, None, None),
        WrOp::SendWithImm(imm) => (o::IBV_WR_SEND_WITH_IMM, Some(imm), None),
        WrOp::Write(ra) => (o::IBV_WR_RDMA_WRITE, None, Some(ra)),
        WrOp::WriteWithImm(ra, imm) => (o::IBV_WR_RDMA_WRITE_WITH_IMM, Some(imm), Some(ra)),
        WrOp::Read(ra) => (o::IBV_WR_RDMA_READ, None, Some(ra)),
        WrOp::CompareSwap {
            remote,
            compare,
            swap,
        } => {
            r.wr.atomic = rdma_sys::atomic_t {
                remote_addr: remote.addr,
                compare_add: compare,
                swap,
                rkey: remote.rkey,
            };
            (o::IBV_WR_ATOMIC_CMP_AND_SWP, None, None)
        }
        WrOp::FetchAdd { remote, add } => {
            r.wr.atomic = rdma_sys::atomic_t {
                remote_addr: remote.addr,
                compare_add: add,
                swap: 0,
                rkey: remote.rkey,
            };
            (o::IBV_WR_ATOMIC_FETCH_AND_ADD, None, None)
        }
    };
    r.opcode = opcode;
    if let Some(imm) = imm {
        r.imm_data_invalidated_rkey_union.imm_data = imm;
    }
    if let Some(ra) = remote {
        r.wr.rdma = rdma_sys::rdma_t {
            remote_addr: ra.addr,
            rkey: ra.rkey,
        };
    }
    if let Some(d) = &w.ud {
        r.wr.ud = rdma_sys::ud_t {
            ah: d.ah.inner.ah.as_ptr(),
            remote_qpn: d.qpn,
            remote_qkey: d.qkey,
        };
    }
    let mut flags = 0;
    if w.signaled {
        flags |= f::IBV_SEND_SIGNALED.0;
    }
    if w.solicited {
        flags |= f::IBV_SEND_SOLICITED.0;
    }
    if w.inline {
        flags |= f::IBV_SEND_INLINE.0;
    }
    r.send_flags = flags;
    r
}
