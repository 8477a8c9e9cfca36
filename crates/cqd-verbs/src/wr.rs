//! Work requests: what a post hands the device (`ibv_send_wr`,
//! `ibv_recv_wr`), their kinds for cqd's wr_id, the transport check, and
//! the C form the device reads.

use cqd_core::post::{Invalid, SendRequest, WorkRequest};
use cqd_core::wr_id::OpKind;

use crate::ah::UdDest;
use crate::pd::{Access, RemoteAddr, Sge};
use crate::qp::QpType;
use crate::sys;
use crate::window::{next_key, Window};

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
    /// Binds a memory window (`IBV_WR_BIND_MW`; made by [`SendWr::bind`]):
    /// the peer names this address and key.
    Bind(RemoteAddr),
    /// Invalidates the memory window with this key (`IBV_WR_LOCAL_INV`;
    /// made by [`SendWr::invalidate`]).
    Invalidate(u32),
}

impl WrOp {
    pub(crate) fn name(self) -> &'static str {
        match self {
            WrOp::Send | WrOp::SendWithImm(_) => "SEND",
            WrOp::Write(_) | WrOp::WriteWithImm(..) => "RDMA WRITE",
            WrOp::Read(_) => "RDMA READ",
            WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => "an atomic",
            WrOp::Bind(_) => "a window bind",
            WrOp::Invalidate(_) => "a window invalidate",
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
    /// The window a bind or invalidate acts on, and a bind's buffer and
    /// access ([`SendWr::bind`], [`SendWr::invalidate`]).
    pub(crate) window: Option<WindowUse<'a>>,
}

/// The window of a bind or invalidate request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WindowUse<'a> {
    pub(crate) window: &'a Window,
    /// A bind's buffer and the access it grants (`None`: an invalidate).
    pub(crate) over: Option<(Sge<'a>, Access)>,
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
            window: None,
        }
    }

    /// A bind of `window` over the buffer `over` with `access` (remote
    /// read, write or atomic: what the one request needs), signaled, with
    /// tag `tag`; and what the peer names to reach the buffer: its address
    /// and the window's next key. Post it before the request that sends
    /// the key (verbs executes a QP's requests in order), on the window's
    /// own QP; the posting call refuses a window that is bound already (see
    /// `cqd_verbs::window`).
    pub fn bind(tag: u64, window: &'a Window, over: Sge<'a>, access: Access) -> (Self, RemoteAddr) {
        let remote = RemoteAddr {
            addr: over.addr(),
            rkey: next_key(window.rkey()),
        };
        let mut wr = SendWr::new(tag, WrOp::Bind(remote), &[]);
        wr.window = Some(WindowUse {
            window,
            over: Some((over, access)),
        });
        (wr, remote)
    }

    /// An invalidate of `window`'s current key, signaled, with tag `tag`:
    /// after it executes no peer reaches the buffer through that key.
    /// Post it on the window's own QP once the request the window served
    /// is done; the posting call refuses a window that is not bound.
    pub fn invalidate(tag: u64, window: &'a Window) -> Self {
        let mut wr = SendWr::new(tag, WrOp::Invalidate(window.rkey()), &[]);
        wr.window = Some(WindowUse { window, over: None });
        wr
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
            WrOp::Bind(_) | WrOp::Invalidate(_) => OpKind::Window,
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
#[inline]
pub(crate) fn transport_check(qp_type: QpType, wr: &SendWr<'_>) -> Result<(), Invalid> {
    let send = matches!(wr.op, WrOp::Send | WrOp::SendWithImm(_));
    let wrong = |op| {
        Err(Invalid::Transport {
            op,
            transport: qp_type.name(),
        })
    };
    if qp_type == QpType::Ud && matches!(wr.op, WrOp::Bind(_) | WrOp::Invalidate(_)) {
        return wrong(wr.op.name());
    }
    match (qp_type, wr.ud.is_some(), send) {
        (QpType::Ud, true, true) | (QpType::Rc, false, _) => Ok(()),
        (QpType::Ud, false, true) => wrong("a SEND without destination (address handle)"),
        (QpType::Ud, _, false) => wrong(wr.op.name()),
        (QpType::Rc, true, _) => wrong("a datagram (address handle)"),
    }
}

/// The `ibv_send_wr` of `w` (unlinked), its scatter list at `sg`.
pub(crate) fn raw_send_wr(w: &SendWr<'_>, sg: *mut sys::ibv_sge) -> sys::ibv_send_wr {
    // SAFETY: plain C data; all-zero is a valid value.
    let mut r: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    write_send_wr(&mut r, w, sg);
    r
}

/// Fills `r`, all zero, with the `ibv_send_wr` of `w` (unlinked), its
/// scatter list at `sg`: the posting call builds each request in place in
/// its list rather than on the stack and then copied (128 bytes).
#[inline(always)]
pub(crate) fn write_send_wr(r: &mut sys::ibv_send_wr, w: &SendWr<'_>, sg: *mut sys::ibv_sge) {
    use sys::ibv_send_flags as f;
    use sys::ibv_wr_opcode as o;
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
        WrOp::Invalidate(key) => {
            r.imm_data_invalidated_rkey_union.invalidated_rkey = key;
            (o::IBV_WR_LOCAL_INV, None, None)
        }
        WrOp::Bind(remote) => {
            // The posting call checked that a bind carries its window (live)
            // and buffer; a bind reads no scatter list.
            if let Some(WindowUse {
                window,
                over: Some((over, access)),
            }) = w.window
            {
                r.bind_mw_tso_union.bind_mw = rdma_sys::bind_mw_t {
                    mw: window
                        .inner
                        .raw()
                        .map_or(std::ptr::null_mut(), |m| m.as_ptr()),
                    rkey: remote.rkey,
                    bind_info: rdma_sys::ibv_mw_bind_info {
                        mr: over.mr.as_raw(),
                        addr: over.addr(),
                        length: u64::from(over.len()),
                        mw_access_flags: access.0,
                    },
                };
            }
            r.sg_list = std::ptr::null_mut();
            r.num_sge = 0;
            (o::IBV_WR_BIND_MW, None, None)
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
}
