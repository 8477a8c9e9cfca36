//! The send side of an RC QP: `post_send`, executed at once by the requester
//! (one-sided, the responder process takes no part):
//!
//! 1. validate the local gather list against this context's MR table
//!    (skipped for inline sends) — failure: `LOC_PROT_ERR`;
//! 2. find the responder by QPN (segment `qp-<qpn>`, cached) — not yet RTR:
//!    the WR waits; no answer at all (the responder's QP destroyed or in
//!    ERR, its process gone, its device dead): the WR is retried until the
//!    QP's transport timeout ([`crate::model::qp::transport_timeout`]) has
//!    passed, then completes with `RETRY_EXC_ERR`;
//! 3. SEND / WRITE-with-immediate take a receive WQE from the responder's
//!    ring or SRQ — none: the WR waits (infinite RNR retry);
//! 4. validate the responder's buffers against the responder's MR table
//!    (rkey, PD, range, access; none of it for a zero-length WRITE/READ, as
//!    the spec says) — failure: `REM_ACCESS_ERR` (WRITE/READ), or
//!    a receive-side `LOC_PROT_ERR`/`LOC_LEN_ERR` and a `REM_OP_ERR`/
//!    `REM_INV_REQ_ERR` here (SEND); the responder QP goes to ERR and
//!    raises its asynchronous event (model::event, `Remote::fail`);
//! 5. move the bytes (`xfer`), push the responder's receive CQE, then ours.
//!
//! Waiting WRs keep their order and are retried by later `post_send` calls
//! and by `poll_cq` on the send CQ. An unsuccessful completion moves the QP
//! to ERR, which flushes the rest (model::qp).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::notify::Batch;
use super::qp::{sv, Caps, Pending, SvQp};
use super::remote::Remote;
use super::set_bad;
use super::xfer::{read_from, write_to, Span};
use crate::model::device::DEAD_ERRNO;
use crate::model::qp::{self as m, QpState, QpType};
use crate::model::ud::{self, AhInfo};
use crate::model::wc::{
    access, opcode, send_completes, send_flags, send_wc_opcode, wr, WcStatus, WC_GRH, WC_WITH_IMM,
    WC_WITH_INV,
};
use crate::shm::layout::{mr_lookup, Cqe, MrSlot, RecvWqe, Sge, MAX_SGE};
use crate::sys::ibv;

/// How long a WR waits for a responder that is not yet ready (RTR).
const PEER_TIMEOUT: Duration = Duration::from_secs(10);

/// A send work request as the provider keeps it.
#[derive(Debug)]
pub struct Wr {
    /// `wr_id`.
    pub wr_id: u64,
    /// `ibv_wr_opcode`.
    pub opcode: u32,
    /// `ibv_send_flags` (SIGNALED already folded in from `sq_sig_all`).
    pub flags: u32,
    /// Immediate data (network order).
    pub imm: u32,
    sge: [Sge; MAX_SGE],
    nsge: usize,
    remote_addr: u64,
    rkey: u32,
    /// Atomics: the compare (CMP_AND_SWP) or add (FETCH_AND_ADD) operand.
    compare_add: u64,
    /// Atomics: the swap operand (CMP_AND_SWP).
    swap: u64,
    /// UD: the destination (address handle, QPN, Q_Key).
    ud: Option<UdDest>,
    /// `IBV_WR_BIND_MW`: the bind.
    bind: Option<super::mw::BindOp>,
    /// XRC_SEND: the responder's SRQ (`qp_type.xrc.remote_srqn`).
    srqn: u32,
    owned: Option<Vec<u8>>,
    since: Option<Instant>,
    /// Since when the responder has not answered this WR at all (the
    /// transport timeout runs from there).
    silent_since: Option<Instant>,
    /// Since when the responder has answered this WR with RNR only (the
    /// RNR retry budget runs from there).
    rnr_since: Option<Instant>,
}

/// Where a UD send goes (`wr.ud` and the address handle's attributes,
/// copied at post time).
#[derive(Debug, Clone, Copy)]
pub struct UdDest {
    /// `remote_qpn`.
    pub qpn: u32,
    /// `remote_qkey`.
    pub qkey: u32,
    /// The address handle's attributes.
    pub ah: AhInfo,
}

/// UD destinations mapped at most (the cache is emptied beyond).
const UD_PEERS: usize = 1024;

/// The send side of a QP (under the QP's send mutex).
#[derive(Debug)]
pub struct SendSide {
    /// Destination QPN from RTR.
    pub dest_qpn: u32,
    /// The responder, once mapped.
    pub remote: Option<Remote>,
    /// WRs waiting for the responder.
    pub pending: Pending,
    /// The QP's transport timeout (from `timeout` and `retry_cnt`; `None`:
    /// infinite), kept by `modify_qp`.
    pub transport_timeout: Option<Duration>,
    /// The QP's `rnr_retry` (7: for ever), kept by `modify_qp`.
    pub rnr_retry: u8,
    /// UD: the destinations sent to so far, by QPN.
    ud_peers: HashMap<u32, Remote>,
    /// XRC_SEND: the responder with each SRQ sent to so far, by SRQ number.
    xrc: HashMap<u32, Remote>,
    waiting: bool,
}

impl SendSide {
    /// Empty.
    pub fn new() -> Self {
        Self {
            dest_qpn: 0,
            remote: None,
            pending: Pending::new(),
            transport_timeout: None,
            rnr_retry: 7,
            ud_peers: HashMap::new(),
            xrc: HashMap::new(),
            waiting: false,
        }
    }

    /// A new destination (`IBV_QP_DEST_QPN`): forget the responders mapped
    /// for the old one.
    pub fn set_dest(&mut self, qpn: u32) {
        self.dest_qpn = qpn;
        self.remote = None;
        self.xrc.clear();
    }

    /// Keep the send CQ's count of QPs with waiting WRs in step.
    pub fn set_waiting(&mut self, q: &SvQp, on: bool) {
        if on != self.waiting {
            self.waiting = on;
            if on {
                q.send_cq().waiting.fetch_add(1, Ordering::Relaxed);
            } else {
                q.send_cq().waiting.fetch_sub(1, Ordering::Relaxed);
            }
            // SAFETY: 1. `q` is a reference to a QP of this provider (only
            // create_qp makes SvQps); 2. destroy_qp calls progress::set(q,
            // false) before it frees the QP, whatever `waiting` says
            // (progress step 3), so a registered QP outlives its entry.
            unsafe { super::progress::set(q, on) };
        }
    }
}

impl Default for SendSide {
    fn default() -> Self {
        Self::new()
    }
}

enum Outcome {
    Done(WcStatus, u32),
    WaitPeer,
    WaitRnr,
    /// The responder does not answer at all (model::qp::transport_timeout).
    NoAnswer,
}

/// Check `[addr, addr+len)` (addresses as the region's users name them)
/// against a region: PD, range and access; a type-2 memory window also
/// names the one QP (`qpn`) that may use it. The owner's address of
/// `addr`, or `None`.
fn check(
    info: Option<crate::shm::layout::MrInfo>,
    pd: u32,
    qpn: u32,
    addr: u64,
    len: u64,
    need: u32,
) -> Option<u64> {
    info.filter(|m| {
        m.pd == pd
            && (m.qpn == 0 || m.qpn == qpn)
            && m.contains(addr, len)
            && (need == 0 || m.access & need == need)
    })
    .map(|m| m.translate(addr))
}

/// [`check`] for an lkey: a memory window is never one.
fn check_local(
    info: Option<crate::shm::layout::MrInfo>,
    pd: u32,
    qpn: u32,
    addr: u64,
    len: u64,
    need: u32,
) -> Option<u64> {
    check(info.filter(|m| m.parent == 0), pd, qpn, addr, len, need)
}

/// The responder's check of an RDMA WRITE/READ target: rkey, PD, range and
/// access against its MR table; the owner's address of the target. A
/// zero-length transfer checks neither key nor address (InfiniBand spec,
/// C9-88: R_Key and VA need not be valid when the DMA length is zero); the
/// QP's remote access flags still apply.
fn remote_ok(r: &Remote, pd: u32, w: &Wr, len: u64, need: u32) -> Option<u64> {
    if len == 0 {
        return Some(w.remote_addr);
    }
    check(
        mr_lookup(r.mrs(), w.rkey),
        pd,
        r.hdr().qpn,
        w.remote_addr,
        len,
        need,
    )
}

fn local_spans(q: &SvQp, w: &Wr, out: &mut [Span; MAX_SGE]) -> Option<u64> {
    let sges = &w.sge[..w.nsge];
    let mut addrs = [0u64; MAX_SGE];
    let total = local_check(
        q.ctx().mrs(),
        q.pd,
        q.qpn,
        w.opcode,
        w.flags,
        sges,
        &mut addrs,
    )?;
    for ((o, s), addr) in out.iter_mut().zip(sges).zip(addrs) {
        *o = Span {
            addr,
            len: s.length as usize,
        };
    }
    Some(total)
}

/// Step 1, the requester's check of a send's local gather list against
/// its context's MR table `mrs`, for QP `qpn` of protection domain `pd`:
/// each entry of non-zero length names a region (never a memory window)
/// of `pd` by its lkey, lies inside it, and — for READ and atomics, which
/// write into it — allows LOCAL_WRITE. Inline sends (not READ, not
/// atomics) are not checked: their bytes are copied from the caller's
/// memory at post time. Writes each entry's owner's address (translated
/// from the address the region's users name) into `addrs` and returns the
/// total length, or `None` for a `LOC_PROT_ERR` (also for more entries than
/// `addrs` holds). Pure (no FFI), so the fuzz target `softverbs_wr` runs it
/// on arbitrary lists.
pub fn local_check(
    mrs: &[MrSlot],
    pd: u32,
    qpn: u32,
    opcode: u32,
    flags: u32,
    sges: &[Sge],
    addrs: &mut [u64],
) -> Option<u64> {
    if sges.len() > addrs.len() {
        return None;
    }
    // READ and atomics write into the local buffers.
    let writes_local = opcode == wr::RDMA_READ || wr::is_atomic(opcode);
    let need = if writes_local { access::LOCAL_WRITE } else { 0 };
    let inline = flags & send_flags::INLINE != 0 && !writes_local;
    let mut total = 0u64;
    for (s, addr) in sges.iter().zip(addrs.iter_mut()) {
        *addr = if inline || s.length == 0 {
            s.addr
        } else {
            check_local(
                mr_lookup(mrs, s.lkey),
                pd,
                qpn,
                s.addr,
                s.length as u64,
                need,
            )?
        };
        total += s.length as u64;
    }
    Some(total)
}

/// What `post_send` checks of a work request before it reads its gather
/// list: an operation this QP type has, and no more gather entries than
/// the QP was created with (nor than the provider's [`MAX_SGE`]). `false`:
/// the post fails with `EINVAL`, nothing posted.
pub fn shape_ok(qp_type: QpType, caps: &Caps, opcode: u32, num_sge: usize) -> bool {
    qp_type.opcode_ok(opcode) && num_sge <= MAX_SGE && num_sge <= caps.max_send_sge as usize
}

/// Whether an inline send's bytes (`flags` has `IBV_SEND_INLINE`) fit:
/// at most the QP's `max_inline_data`, or the provider's own limit if
/// that is larger. `false`: the post fails with `EINVAL`.
pub fn inline_ok(caps: &Caps, flags: u32, sges: &[Sge]) -> bool {
    if flags & send_flags::INLINE == 0 {
        return true;
    }
    let len = sges.iter().fold(0u32, |n, s| n.saturating_add(s.length));
    len <= caps
        .max_inline
        .max(crate::provider::context::limits::MAX_INLINE)
}

fn recv_cqe(
    r: &Remote,
    wqe: &RecvWqe,
    q: &SvQp,
    w: &Wr,
    status: WcStatus,
    len: u32,
    op: u32,
) -> Cqe {
    let imm = w.opcode == wr::SEND_WITH_IMM || w.opcode == wr::RDMA_WRITE_WITH_IMM;
    let inv = w.opcode == wr::SEND_WITH_INV && status == WcStatus::Success;
    Cqe {
        wr_id: wqe.wr_id,
        status: status as u32,
        opcode: op,
        byte_len: len,
        // The immediate data, or the invalidated rkey (one union in ibv_wc).
        imm: if imm || inv { w.imm } else { 0 },
        qp_num: r.hdr().qpn,
        src_qp: q.qpn,
        wc_flags: if imm { WC_WITH_IMM } else { 0 } | if inv { WC_WITH_INV } else { 0 },
        solicited: (w.flags & send_flags::SOLICITED != 0) as u32,
        sl: 0,
        pkey_index: 0,
        ts: 0,
    }
}

/// The responder detected an error (model::event): its QP goes to ERR and
/// raises its event; the requester completes with `status`.
fn responder_failed(r: &Remote, status: WcStatus) -> Outcome {
    // Only an RC responder NAKs and enters ERR; a UC one drops the message
    // (its receive, if one was consumed, reports the error).
    if QpType::from_u32(r.hdr().qp_type).is_some_and(QpType::reliable) {
        if let Some(event) = crate::model::event::responder_error(status) {
            r.fail(event);
        }
    }
    Outcome::Done(status, 0)
}

/// No receive WQE for a SEND / WRITE-with-immediate: an RNR NAK (retried
/// for ever) from a live responder, silence from a process that is gone.
fn no_receive(r: &Remote) -> Outcome {
    if r.owner_gone() {
        Outcome::NoAnswer
    } else {
        Outcome::WaitRnr
    }
}

fn execute(q: &SvQp, ss: &mut SendSide, w: &Wr) -> Outcome {
    // Memory-window operations act on this context alone, in order with
    // the work requests before them.
    match (w.opcode, w.bind) {
        (wr::BIND_MW, Some(b)) => return Outcome::Done(super::mw::bind(q, &b), 0),
        (wr::BIND_MW, None) => return Outcome::Done(WcStatus::MwBindErr, 0),
        (wr::LOCAL_INV, _) => return Outcome::Done(super::mw::local_invalidate(q, w.imm), 0),
        _ => {}
    }
    let mut local = [Span::default(); MAX_SGE];
    let Some(len) = local_spans(q, w, &mut local) else {
        return Outcome::Done(WcStatus::LocProtErr, 0);
    };
    let local = &local[..w.nsge];
    match q.qp_type {
        QpType::Rc | QpType::XrcSend => execute_connected(q, ss, w, local, len),
        QpType::Ud => execute_ud(q, ss, w, local, len),
        // Never posted to (it has no send queue: EINVAL at post).
        QpType::XrcRecv => Outcome::Done(WcStatus::LocQpOpErr, 0),
        // UC: no ACK, no NAK, no retry. Whatever the responder could not
        // take (not ready, no receive, an access violation, a peer that
        // is gone) is dropped and the requester's completion is a success;
        // only the requester's own errors complete in error.
        QpType::Uc => match execute_connected(q, ss, w, local, len) {
            Outcome::Done(
                WcStatus::RemAccessErr | WcStatus::RemInvReqErr | WcStatus::RemOpErr,
                _,
            )
            | Outcome::WaitPeer
            | Outcome::WaitRnr
            | Outcome::NoAnswer => Outcome::Done(WcStatus::Success, len as u32),
            o => o,
        },
    }
}

/// A UD send (model::ud): always completes at once; what the destination
/// cannot take is dropped.
fn execute_ud(q: &SvQp, ss: &mut SendSide, w: &Wr, local: &[Span], len: u64) -> Outcome {
    let Some(d) = w.ud else {
        return Outcome::Done(WcStatus::LocQpOpErr, 0);
    };
    if len > ud::PORT_MTU {
        return Outcome::Done(WcStatus::LocLenErr, 0);
    }
    let sent = Outcome::Done(WcStatus::Success, len as u32);
    if d.qpn == ud::MULTICAST_QPN {
        // Multicast: a global AH to a multicast GID and LID, delivered to
        // every attached QP (provider::mcast); anything else reaches no
        // group and is dropped.
        if !d.ah.is_global || !ud::is_mcast_gid(&d.ah.dgid) || !ud::is_mcast_lid(d.ah.dlid) {
            return sent;
        }
        for m in super::mcast::members(&d.ah.dgid) {
            if let Some(r) = ud_peer(ss, m.qpn) {
                // The member's own QP, not a later one with its QPN.
                if r.pid() == m.pid {
                    deliver_ud(q, w, &d, local, len, r);
                }
            }
        }
        return sent;
    }
    if let Some(r) = ud_peer(ss, d.qpn) {
        deliver_ud(q, w, &d, local, len, r);
    }
    sent
}

/// The UD destination `qpn`, mapped (cached in `ss`); `None` when it does
/// not exist or is dead.
fn ud_peer(ss: &mut SendSide, qpn: u32) -> Option<&Remote> {
    if !ss.ud_peers.contains_key(&qpn) {
        let r = Remote::open(qpn).ok()?;
        if ss.ud_peers.len() >= UD_PEERS {
            ss.ud_peers.clear();
        }
        ss.ud_peers.insert(qpn, r);
    }
    if ss.ud_peers.get(&qpn)?.dead() {
        // Destroyed (or its device died): forget it, a later QP may
        // take the number.
        ss.ud_peers.remove(&qpn);
        return None;
    }
    ss.ud_peers.get(&qpn)
}

/// One UD message to one destination QP: dropped unless it is a UD QP at
/// RTR or later with the message's Q_Key and a receive posted.
fn deliver_ud(q: &SvQp, w: &Wr, d: &UdDest, local: &[Span], len: u64, r: &Remote) {
    let _inside = r.enter();
    let rh = r.hdr();
    let qkey = ud::effective_qkey(d.qkey, q.hdr().qkey.load(Ordering::Acquire));
    if rh.qp_type != QpType::Ud as u32
        || !r.state().accepts_incoming()
        || rh.qkey.load(Ordering::Acquire) != qkey
    {
        return;
    }
    let Some(wqe) = r.take_recv() else {
        return;
    };
    let imm = w.opcode == wr::SEND_WITH_IMM;
    let mut cqe = Cqe {
        wr_id: wqe.wr_id,
        status: WcStatus::Success as u32,
        opcode: opcode::RECV,
        byte_len: 0,
        imm: if imm { w.imm } else { 0 },
        qp_num: rh.qpn,
        src_qp: q.qpn,
        wc_flags: if imm { WC_WITH_IMM } else { 0 } | if d.ah.is_global { WC_GRH } else { 0 },
        solicited: (w.flags & send_flags::SOLICITED != 0) as u32,
        sl: u32::from(d.ah.sl),
        pkey_index: 0,
        ts: 0,
    };
    let mut dst = [Span::default(); MAX_SGE];
    let mut cap = 0u64;
    for (i, s) in wqe.sges().iter().enumerate() {
        let addr = if s.length == 0 {
            s.addr
        } else if let Some(a) = check_local(
            mr_lookup(r.mrs(), s.lkey),
            r.pd(),
            rh.qpn,
            s.addr,
            u64::from(s.length),
            access::LOCAL_WRITE,
        ) {
            a
        } else {
            cqe.status = WcStatus::LocProtErr as u32;
            wqe.complete(&r.cq, cqe);
            return;
        };
        dst[i] = Span {
            addr,
            len: s.length as usize,
        };
        cap += u64::from(s.length);
    }
    if ud::GRH_LEN as u64 + len > cap {
        cqe.status = WcStatus::LocLenErr as u32;
        wqe.complete(&r.cq, cqe);
        return;
    }
    let grh = ud::grh(&d.ah, len as u32, imm);
    let mut src = [Span::default(); MAX_SGE + 1];
    src[0] = Span {
        addr: grh.as_ptr() as u64,
        len: grh.len(),
    };
    src[1..=local.len()].copy_from_slice(local);
    // SAFETY: `src` is the local GRH array and spans validated against
    // our MR table (or inline buffers); `dst` against the responder's.
    if !unsafe { write_to(r.pid(), &dst[..wqe.sges().len()], &src[..=local.len()]) } {
        if !r.owner_gone() {
            cqe.status = WcStatus::LocProtErr as u32;
            wqe.complete(&r.cq, cqe);
        }
        return;
    }
    cqe.byte_len = ud::GRH_LEN as u32 + len as u32;
    wqe.complete(&r.cq, cqe);
}

/// An RC or UC request to the connected responder.
/// The responder of a connected QP's request: the QP at `dest_qpn`, or
/// for XRC that QP with the SRQ the request names.
fn responder<'a>(q: &SvQp, ss: &'a mut SendSide, w: &Wr) -> Result<&'a Remote, Outcome> {
    if q.qp_type == QpType::XrcSend {
        if ss.xrc.len() >= UD_PEERS {
            ss.xrc.clear();
        }
        if !ss.xrc.contains_key(&w.srqn) {
            match Remote::open_xrc(ss.dest_qpn, w.srqn) {
                Ok(r) => {
                    ss.xrc.insert(w.srqn, r);
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // Not an XRC target, or an SRQ outside its domain:
                    // the target NAKs the request as invalid.
                    return Err(Outcome::Done(WcStatus::RemInvReqErr, 0));
                }
                Err(_) => return Err(Outcome::NoAnswer),
            }
        }
        return ss.xrc.get(&w.srqn).ok_or(Outcome::WaitPeer);
    }
    if ss.remote.is_none() {
        match Remote::open(ss.dest_qpn) {
            Ok(r) => ss.remote = Some(r),
            // A QPN is only learnt after its QP was created, so a missing
            // segment means the responder is gone: requests to it are
            // dropped, as by hardware for an unknown QPN.
            Err(_) => return Err(Outcome::NoAnswer),
        }
    }
    ss.remote.as_ref().ok_or(Outcome::WaitPeer)
}

fn execute_connected(q: &SvQp, ss: &mut SendSide, w: &Wr, local: &[Span], len: u64) -> Outcome {
    let r = match responder(q, ss, w) {
        Ok(r) => r,
        Err(o) => return o,
    };
    if r.dead() {
        // The responder's device died (model::device): it never answers.
        return Outcome::NoAnswer;
    }
    // Inside the responder from here to the return (its last-WQE event
    // waits for us, model::event).
    let _inside = r.enter();
    let st = r.state();
    if st.not_ready_yet() {
        return if r.owner_gone() {
            Outcome::NoAnswer
        } else {
            Outcome::WaitPeer
        };
    }
    if !st.accepts_incoming() {
        // ERR (also what destroy_qp leaves): the responder drops requests.
        return Outcome::NoAnswer;
    }
    let rh = r.hdr();
    if rh.qp_type != q.qp_type.peer() as u32 {
        // Another transport: the packets are not for it.
        return Outcome::NoAnswer;
    }
    let pid = r.pid();
    match w.opcode {
        wr::SEND | wr::SEND_WITH_IMM | wr::SEND_WITH_INV => {
            let Some(wqe) = r.take_recv() else {
                return no_receive(r);
            };
            let mut dst = [Span::default(); MAX_SGE];
            let mut cap = 0u64;
            let mrs = r.mrs();
            for (i, s) in wqe.sges().iter().enumerate() {
                let addr = if s.length == 0 {
                    Some(s.addr)
                } else {
                    check_local(
                        mr_lookup(mrs, s.lkey),
                        r.pd(),
                        rh.qpn,
                        s.addr,
                        s.length as u64,
                        access::LOCAL_WRITE,
                    )
                };
                let Some(addr) = addr else {
                    let cqe = recv_cqe(r, &wqe, q, w, WcStatus::LocProtErr, 0, opcode::RECV);
                    wqe.complete(&r.cq, cqe);
                    return responder_failed(r, WcStatus::RemOpErr);
                };
                dst[i] = Span {
                    addr,
                    len: s.length as usize,
                };
                cap += s.length as u64;
            }
            if len > cap {
                let cqe = recv_cqe(r, &wqe, q, w, WcStatus::LocLenErr, 0, opcode::RECV);
                wqe.complete(&r.cq, cqe);
                return responder_failed(r, WcStatus::RemInvReqErr);
            }
            // SAFETY: local spans were validated against our MR table (or are
            // the caller's inline buffers); remote spans against the
            // responder's table, and the kernel checks them again.
            if !unsafe { write_to(pid, &dst[..wqe.sges().len()], local) } {
                if r.owner_gone() {
                    return Outcome::NoAnswer;
                }
                let cqe = recv_cqe(r, &wqe, q, w, WcStatus::LocProtErr, 0, opcode::RECV);
                wqe.complete(&r.cq, cqe);
                return responder_failed(r, WcStatus::RemOpErr);
            }
            // SEND with invalidate: the responder invalidates the key, a
            // type-2 window bound to its QP (model::mr::mw); any other key
            // is an invalid request.
            if w.opcode == wr::SEND_WITH_INV
                && !super::mw::invalidate(r.mrs(), w.imm, r.pd(), rh.qpn)
            {
                let cqe = recv_cqe(r, &wqe, q, w, WcStatus::LocProtErr, 0, opcode::RECV);
                wqe.complete(&r.cq, cqe);
                return responder_failed(r, WcStatus::RemInvReqErr);
            }
            let cqe = recv_cqe(r, &wqe, q, w, WcStatus::Success, len as u32, opcode::RECV);
            wqe.complete(&r.cq, cqe);
            Outcome::Done(WcStatus::Success, len as u32)
        }
        wr::RDMA_WRITE | wr::RDMA_WRITE_WITH_IMM => {
            // A QP not enabled for the operation does not support it: an
            // Invalid Request NAK (as rxe answers), not an access error.
            if rh.access.load(Ordering::Acquire) & access::REMOTE_WRITE == 0 {
                return responder_failed(r, WcStatus::RemInvReqErr);
            }
            let Some(target) = remote_ok(r, r.pd(), w, len, access::REMOTE_WRITE) else {
                return responder_failed(r, WcStatus::RemAccessErr);
            };
            let wqe = if w.opcode == wr::RDMA_WRITE_WITH_IMM {
                match r.take_recv() {
                    Some(x) => Some(x),
                    None => return no_receive(r),
                }
            } else {
                None
            };
            let dst = [Span {
                addr: target,
                len: len as usize,
            }];
            // SAFETY: validated as in the SEND arm.
            if !unsafe { write_to(pid, &dst, local) } {
                if r.owner_gone() {
                    return Outcome::NoAnswer;
                }
                if let Some(wqe) = wqe {
                    let cqe = recv_cqe(
                        r,
                        &wqe,
                        q,
                        w,
                        WcStatus::LocProtErr,
                        0,
                        opcode::RECV_RDMA_WITH_IMM,
                    );
                    wqe.complete(&r.cq, cqe);
                }
                return responder_failed(r, WcStatus::RemAccessErr);
            }
            if let Some(wqe) = wqe {
                let cqe = recv_cqe(
                    r,
                    &wqe,
                    q,
                    w,
                    WcStatus::Success,
                    len as u32,
                    opcode::RECV_RDMA_WITH_IMM,
                );
                wqe.complete(&r.cq, cqe);
            }
            Outcome::Done(WcStatus::Success, len as u32)
        }
        wr::RDMA_READ => {
            // A QP not enabled for the operation does not support it: an
            // Invalid Request NAK (as rxe answers), not an access error.
            if rh.access.load(Ordering::Acquire) & access::REMOTE_READ == 0 {
                return responder_failed(r, WcStatus::RemInvReqErr);
            }
            let Some(source) = remote_ok(r, r.pd(), w, len, access::REMOTE_READ) else {
                return responder_failed(r, WcStatus::RemAccessErr);
            };
            let src = [Span {
                addr: source,
                len: len as usize,
            }];
            // SAFETY: local spans validated with LOCAL_WRITE; remote as above.
            if !unsafe { read_from(pid, local, &src) } {
                if r.owner_gone() {
                    return Outcome::NoAnswer;
                }
                return responder_failed(r, WcStatus::RemAccessErr);
            }
            Outcome::Done(WcStatus::Success, len as u32)
        }
        wr::ATOMIC_CMP_AND_SWP | wr::ATOMIC_FETCH_AND_ADD => atomic(r, w, local, len),
        wr::ATOMIC_WRITE => atomic_write(r, w, local, len),
        _ => Outcome::Done(WcStatus::LocQpOpErr, 0),
    }
}

/// An atomic write (model::atomic): exactly 8 bytes (else the request is
/// invalid), remote write access on the region and the QP, 8-byte
/// alignment, then the store under the word's machine-wide lock, so that
/// no other atomic sees half of it.
fn atomic_write(r: &Remote, w: &Wr, local: &[Span], len: u64) -> Outcome {
    use crate::model::atomic::{aligned, AtomicOp, ATOMIC_LEN};
    if len != u64::from(ATOMIC_LEN) {
        return Outcome::Done(WcStatus::LocLenErr, 0);
    }
    let mut value = 0u64;
    let here = [Span {
        addr: std::ptr::addr_of_mut!(value) as u64,
        len: 8,
    }];
    // SAFETY: `local` was validated against our MR table (or is inline
    // data owned by the WR); `here` is the local variable.
    if !unsafe { read_from(super::xfer::my_pid(), &here, local) } {
        return Outcome::Done(WcStatus::LocProtErr, 0);
    }
    let rh = r.hdr();
    // A QP not enabled for the operation does not support it: an
    // Invalid Request NAK (as rxe answers), not an access error.
    if rh.access.load(Ordering::Acquire) & access::REMOTE_WRITE == 0 {
        return responder_failed(r, WcStatus::RemInvReqErr);
    }
    let Some(target) = remote_ok(r, r.pd(), w, len, access::REMOTE_WRITE) else {
        return responder_failed(r, WcStatus::RemAccessErr);
    };
    if !aligned(w.remote_addr) || !aligned(target) {
        return responder_failed(r, WcStatus::RemInvReqErr);
    }
    // SAFETY: the word lies in a region the responder registered with
    // REMOTE_WRITE (checked above) and is aligned; in another process the
    // kernel checks the range again.
    if unsafe { super::xfer::atomic_rmw(r.pid(), target, AtomicOp::Write { value }) }.is_none() {
        if r.owner_gone() {
            return Outcome::NoAnswer;
        }
        return responder_failed(r, WcStatus::RemAccessErr);
    }
    Outcome::Done(WcStatus::Success, ATOMIC_LEN)
}

/// The responder part of a remote atomic (model::atomic): access checks,
/// alignment, the read-modify-write under the machine-wide lock of the
/// word, then the original value into our scatter list.
fn atomic(r: &Remote, w: &Wr, local: &[Span], local_len: u64) -> Outcome {
    use crate::model::atomic::{aligned, AtomicOp, ATOMIC_LEN};
    if local_len < u64::from(ATOMIC_LEN) {
        // Where the original value goes is too short: our own error,
        // found before the request leaves (nothing happens remotely).
        return Outcome::Done(WcStatus::LocLenErr, 0);
    }
    let rh = r.hdr();
    // A QP not enabled for the operation does not support it: an
    // Invalid Request NAK (as rxe answers), not an access error.
    if rh.access.load(Ordering::Acquire) & access::REMOTE_ATOMIC == 0 {
        return responder_failed(r, WcStatus::RemInvReqErr);
    }
    let Some(target) = check(
        mr_lookup(r.mrs(), w.rkey),
        r.pd(),
        rh.qpn,
        w.remote_addr,
        u64::from(ATOMIC_LEN),
        access::REMOTE_ATOMIC,
    ) else {
        return responder_failed(r, WcStatus::RemAccessErr);
    };
    if !aligned(w.remote_addr) || !aligned(target) {
        return responder_failed(r, WcStatus::RemInvReqErr);
    }
    let op = if w.opcode == wr::ATOMIC_CMP_AND_SWP {
        AtomicOp::CmpSwap {
            compare: w.compare_add,
            swap: w.swap,
        }
    } else {
        AtomicOp::FetchAdd { add: w.compare_add }
    };
    // SAFETY: the word lies in a region the responder registered with
    // REMOTE_ATOMIC (checked just above) and is aligned; in another
    // process the kernel checks the range again.
    let Some(old) = (unsafe { super::xfer::atomic_rmw(r.pid(), target, op) }) else {
        if r.owner_gone() {
            return Outcome::NoAnswer;
        }
        return responder_failed(r, WcStatus::RemAccessErr);
    };
    let bytes = old.to_ne_bytes();
    let src = [Span {
        addr: bytes.as_ptr() as u64,
        len: bytes.len(),
    }];
    // SAFETY: `local` was validated against our MR table with LOCAL_WRITE;
    // `src` is the local array above; write_to copies the first 8 bytes
    // of the scatter list only.
    if !unsafe { write_to(super::xfer::my_pid(), local, &src) } {
        return Outcome::Done(WcStatus::LocProtErr, 0);
    }
    Outcome::Done(WcStatus::Success, ATOMIC_LEN)
}

/// Complete `w`: its CQE (if it completes) joins `batch`, whose arm check
/// the caller's return makes (provider::notify N4–N5, once per batch).
fn complete<'q>(
    q: &'q SvQp,
    ss: &mut SendSide,
    w: &Wr,
    status: WcStatus,
    len: u32,
    batch: &mut Batch<'q>,
) {
    if send_completes(w.flags & send_flags::SIGNALED != 0, status) {
        batch.push(
            &q.send_cq().port,
            Cqe {
                wr_id: w.wr_id,
                status: status as u32,
                opcode: send_wc_opcode(w.opcode).unwrap_or(opcode::SEND),
                byte_len: len,
                qp_num: q.qpn,
                ..Cqe::default()
            },
        );
    }
    if status != WcStatus::Success {
        match q.qp_type.send_error_state() {
            QpState::Sqe => q.to_send_error(),
            _ => q.to_error(ss),
        }
    }
}

/// Keep a copy of inline data so the WR can wait without the caller's buffer.
fn own(mut w: Wr) -> Wr {
    if w.flags & send_flags::INLINE != 0
        && w.owned.is_none()
        && w.opcode != wr::RDMA_READ
        && !wr::is_atomic(w.opcode)
    {
        let mut v = Vec::new();
        for s in &w.sge[..w.nsge] {
            // SAFETY: inline sends name caller memory readable during post_send.
            v.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
            });
        }
        w.sge[0] = Sge {
            addr: v.as_ptr() as u64,
            length: v.len() as u32,
            lkey: 0,
        };
        w.nsge = 1;
        w.owned = Some(v);
    }
    w.since.get_or_insert_with(Instant::now);
    w
}

/// Whether the responder has been silent for `w` for the QP's transport
/// timeout (the silence starts now if it is new).
fn silent_too_long(ss: &SendSide, w: &mut Wr) -> bool {
    let t0 = *w.silent_since.get_or_insert_with(Instant::now);
    ss.transport_timeout.is_some_and(|d| t0.elapsed() >= d)
}

/// How long the QP keeps retrying a request its responder has no receive
/// for (`None`: for ever): `rnr_retry` tries after the first, each after
/// the responder's RNR timer (model::qp::rnr_budget).
fn rnr_budget(ss: &SendSide) -> Option<Duration> {
    let code = ss
        .remote
        .as_ref()
        .map_or(0, |r| r.hdr().min_rnr_timer.load(Ordering::Acquire));
    m::rnr_budget(ss.rnr_retry, m::rnr_timer(code.min(31) as u8))
}

/// Whether the responder has had no receive for `w` for the QP's RNR
/// budget (the RNR wait starts now if it is new).
fn rnr_too_long(ss: &SendSide, w: &mut Wr) -> bool {
    let t0 = *w.rnr_since.get_or_insert_with(Instant::now);
    rnr_budget(ss).is_some_and(|d| t0.elapsed() >= d)
}

/// When the WR at the head of the queue runs out of retries, if its
/// responder is silent (or has no receive for it) and the QP's budget is
/// finite (the progress thread's wake-up time).
pub fn silence_deadline(ss: &SendSide) -> Option<Instant> {
    let w = ss.pending.front()?;
    let silent = w.silent_since.zip(ss.transport_timeout).map(|(t, d)| t + d);
    let rnr = w.rnr_since.zip(rnr_budget(ss)).map(|(t, d)| t + d);
    silent.into_iter().chain(rnr).min()
}

/// Retry waiting WRs in order until one has to wait again. On a dead
/// context they are dropped: nothing can complete there any more, and the
/// progress thread must not retry them forever.
pub fn progress(q: &SvQp, ss: &mut SendSide) {
    if q.ctx().dead() {
        ss.pending.clear();
        ss.set_waiting(q, false);
        return;
    }
    if q.state() == QpState::Err {
        // A requester of ours moved us to ERR as a responder (model::event):
        // the sends still waiting are flushed, as the flush rule says.
        q.to_error(ss);
        return;
    }
    // The completions of this round: one arm check, at the end.
    let mut batch = Batch::new();
    while let Some(mut w) = ss.pending.pop_front() {
        match execute(q, ss, &w) {
            Outcome::Done(s, len) => complete(q, ss, &w, s, len, &mut batch),
            Outcome::WaitPeer if w.since.is_some_and(|t| t.elapsed() > PEER_TIMEOUT) => {
                complete(q, ss, &w, WcStatus::RetryExcErr, 0, &mut batch)
            }
            Outcome::NoAnswer if silent_too_long(ss, &mut w) => {
                // Retries exhausted: the QP goes to ERR, which flushes the
                // WRs behind this one, in order.
                complete(q, ss, &w, WcStatus::RetryExcErr, 0, &mut batch)
            }
            Outcome::WaitRnr if rnr_too_long(ss, &mut w) => {
                // RNR retries exhausted: as above.
                complete(q, ss, &w, WcStatus::RnrRetryExcErr, 0, &mut batch)
            }
            o => {
                if !matches!(o, Outcome::NoAnswer) {
                    // The responder answered (RNR, not ready): the
                    // transport timer restarts.
                    w.silent_since = None;
                }
                if !matches!(o, Outcome::WaitRnr) {
                    // It had a receive, or did not answer: a later RNR
                    // starts a new RNR wait.
                    w.rnr_since = None;
                }
                ss.pending.push_front(w);
                break;
            }
        }
    }
    let on = !ss.pending.is_empty();
    ss.set_waiting(q, on);
}

/// `post_send`.
///
/// # Safety
/// `qp` is live; `wr` is a valid chain; `bad` is writable.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv::ibv_qp,
    mut wrp: *mut ibv::ibv_send_wr,
    bad: *mut *mut ibv::ibv_send_wr,
) -> libc::c_int {
    // SAFETY: caller contract.
    let q = unsafe { sv(qp) };
    if q.ctx().dead() && !wrp.is_null() {
        // SAFETY: caller contract.
        unsafe { set_bad(bad, wrp) };
        return DEAD_ERRNO;
    }
    let mut ss = q.lock_send();
    if !ss.pending.is_empty() {
        progress(q, &mut ss);
    }
    // The completions of this chain: one arm check, when this returns
    // (the batch drops on every path out).
    let mut batch = Batch::new();
    while !wrp.is_null() {
        // SAFETY: a node of the caller's valid chain.
        let x = unsafe { &*wrp };
        let n = x.num_sge.max(0) as usize;
        let st = q.state();
        let fail = |e| {
            // SAFETY: caller contract.
            unsafe { set_bad(bad, wrp) };
            e
        };
        if !shape_ok(q.qp_type, &q.caps, x.opcode, n) {
            return fail(libc::EINVAL);
        }
        // ERR and SQE flush what is posted.
        let flushing = matches!(st, QpState::Err | QpState::Sqe);
        if !flushing && !st.can_post_send() {
            return fail(libc::EINVAL);
        }
        let ud = if q.qp_type == QpType::Ud {
            // SAFETY: the ud arm of the wr union, which a UD caller fills.
            let u = unsafe { x.wr.ud };
            if u.ah.is_null() {
                return fail(libc::EINVAL);
            }
            Some(UdDest {
                qpn: u.remote_qpn,
                qkey: u.remote_qkey,
                // SAFETY: a live AH of this provider (the caller keeps it
                // until the WR completes, ibv_post_send(3)).
                ah: unsafe { super::ah::info(u.ah) },
            })
        } else {
            None
        };
        let is_atomic = wr::is_atomic(x.opcode);
        let mut w = Wr {
            wr_id: x.wr_id,
            opcode: x.opcode,
            flags: x.send_flags | if q.sig_all { send_flags::SIGNALED } else { 0 },
            // SAFETY: reading the immediate-data arm of a plain u32 union.
            imm: unsafe { x.imm_data_invalidated_rkey_union.imm_data },
            sge: [Sge::default(); MAX_SGE],
            nsge: n,
            // SAFETY: the rdma and atomic arms of the wr union are plain
            // data; the opcode says which one the caller filled.
            remote_addr: unsafe {
                if is_atomic {
                    x.wr.atomic.remote_addr
                } else {
                    x.wr.rdma.remote_addr
                }
            },
            // SAFETY: as above.
            rkey: unsafe {
                if is_atomic {
                    x.wr.atomic.rkey
                } else {
                    x.wr.rdma.rkey
                }
            },
            compare_add: if is_atomic {
                // SAFETY: the atomic arm, filled by the caller (opcode).
                unsafe { x.wr.atomic.compare_add }
            } else {
                0
            },
            swap: if is_atomic {
                // SAFETY: as above.
                unsafe { x.wr.atomic.swap }
            } else {
                0
            },
            ud,
            bind: None,
            srqn: if q.qp_type == QpType::XrcSend {
                // SAFETY: the xrc arm, which an XRC_SEND caller fills.
                unsafe { x.qp_type.xrc.remote_srqn }
            } else {
                0
            },
            owned: None,
            since: None,
            silent_since: None,
            rnr_since: None,
        };
        if x.opcode == wr::BIND_MW {
            // SAFETY: the bind_mw arm, which this opcode says the caller
            // filled; its window and region are live objects of ours.
            let b = unsafe { x.bind_mw_tso_union.bind_mw };
            if b.mw.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: as above.
            w.bind = Some(unsafe { super::mw::bind_op(x) });
        }
        for i in 0..n {
            // SAFETY: i < num_sge entries of the caller's sg_list.
            let g = unsafe { &*x.sg_list.add(i) };
            w.sge[i] = Sge {
                addr: g.addr,
                length: g.length,
                lkey: g.lkey,
            };
        }
        if !inline_ok(&q.caps, w.flags, &w.sge[..n]) {
            return fail(libc::EINVAL);
        }
        if flushing {
            complete(q, &mut ss, &w, WcStatus::WrFlushErr, 0, &mut batch);
        } else if !ss.pending.is_empty() {
            if ss.pending.len() >= q.caps.max_send_wr as usize {
                return fail(libc::ENOMEM);
            }
            ss.pending.push_back(own(w));
        } else {
            match execute(q, &mut ss, &w) {
                Outcome::Done(s, len) => complete(q, &mut ss, &w, s, len, &mut batch),
                o => {
                    match o {
                        Outcome::NoAnswer => w.silent_since = Some(Instant::now()),
                        Outcome::WaitRnr => w.rnr_since = Some(Instant::now()),
                        _ => {}
                    }
                    ss.pending.push_back(own(w));
                    ss.set_waiting(q, true);
                }
            }
        }
        wrp = x.next;
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::layout::{key_index, make_key, mr_publish, mr_table, MrInfo, CTX_BYTES};

    fn caps(max_send_sge: u32, max_inline: u32) -> Caps {
        Caps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge,
            max_recv_sge: 1,
            max_inline,
        }
    }

    /// Regression (found while writing the `softverbs_wr` fuzz target): a
    /// send with more gather entries than the QP was created with was
    /// accepted as long as it stayed under the provider's MAX_SGE; a real
    /// device refuses it (`EINVAL`), as the receive side already did.
    #[test]
    fn more_sges_than_the_qp_has_are_refused() {
        let c = caps(2, 0);
        assert!(shape_ok(QpType::Rc, &c, wr::SEND, 2));
        assert!(!shape_ok(QpType::Rc, &c, wr::SEND, 3));
        assert!(!shape_ok(
            QpType::Rc,
            &caps(MAX_SGE as u32, 0),
            wr::SEND,
            MAX_SGE + 1
        ));
        assert!(!shape_ok(QpType::Ud, &c, wr::RDMA_WRITE, 1));
        assert!(!shape_ok(QpType::Rc, &c, 0xdead, 1));
    }

    #[test]
    fn oversized_inline_is_refused() {
        let limit = crate::provider::context::limits::MAX_INLINE;
        let sge = |length| Sge {
            addr: 0,
            length,
            lkey: 0,
        };
        let c = caps(2, 0);
        assert!(inline_ok(&c, send_flags::INLINE, &[sge(limit)]));
        assert!(!inline_ok(&c, send_flags::INLINE, &[sge(limit), sge(1)]));
        assert!(!inline_ok(
            &c,
            send_flags::INLINE,
            &[sge(u32::MAX), sge(u32::MAX)]
        ));
        assert!(
            inline_ok(&c, 0, &[sge(u32::MAX)]),
            "not inline: not limited"
        );
    }

    #[test]
    fn local_gather_lists_are_checked_against_the_mr_table() {
        let mut seg = vec![0u64; CTX_BYTES / 8 + 1];
        // SAFETY: `seg` is CTX_BYTES long, zeroed (every slot free), and
        // outlives `mrs`.
        let mrs = unsafe { mr_table(seg.as_mut_ptr().cast()) };
        let key = make_key(5, 0x05);
        mr_publish(&mrs[key_index(key)], key, MrInfo::at(3, 0, 0x1000, 0x100));
        let sge = |addr, length, lkey| Sge { addr, length, lkey };
        let local_check = |mrs, pd, op, flags, sges: &[Sge]| {
            local_check(mrs, pd, 1, op, flags, sges, &mut [0; MAX_SGE])
        };
        let ok = [sge(0x1000, 0x80, key), sge(0x1080, 0x80, key)];
        assert_eq!(local_check(mrs, 3, wr::SEND, 0, &ok), Some(0x100));
        assert_eq!(local_check(mrs, 4, wr::SEND, 0, &ok), None, "other PD");
        let past = [sge(0x10ff, 2, key)];
        assert_eq!(
            local_check(mrs, 3, wr::SEND, 0, &past),
            None,
            "past the end"
        );
        let wrap = [sge(u64::MAX, 2, key)];
        assert_eq!(local_check(mrs, 3, wr::SEND, 0, &wrap), None, "wraps");
        assert_eq!(
            local_check(mrs, 3, wr::SEND, 0, &[sge(0x1000, 1, key + 1)]),
            None
        );
        // READ writes locally: the region must allow LOCAL_WRITE.
        assert_eq!(local_check(mrs, 3, wr::RDMA_READ, 0, &ok), None);
        // Inline sends are copied, not looked up; zero-length entries too.
        assert_eq!(
            local_check(mrs, 9, wr::SEND, send_flags::INLINE, &past),
            Some(2)
        );
        assert_eq!(local_check(mrs, 9, wr::SEND, 0, &[sge(7, 0, 0)]), Some(0));
        // A region registered at an I/O virtual address: users name its
        // bytes from 0x9000, the owner's addresses are written out.
        let ikey = make_key(6, 0x06);
        let mut info = MrInfo::at(3, 0, 0x1000, 0x100);
        info.iova = 0x9000;
        mr_publish(&mrs[key_index(ikey)], ikey, info);
        let mut addrs = [0; MAX_SGE];
        let list = [sge(0x9010, 8, ikey), sge(0x90f8, 8, ikey)];
        assert_eq!(
            super::local_check(mrs, 3, 1, wr::SEND, 0, &list, &mut addrs),
            Some(16)
        );
        assert_eq!(&addrs[..2], &[0x1010, 0x10f8]);
        assert_eq!(
            super::local_check(mrs, 3, 1, wr::SEND, 0, &[sge(0x1010, 8, ikey)], &mut addrs),
            None,
            "the owner's address is not the region's name"
        );
        assert_eq!(
            super::local_check(mrs, 3, 1, wr::SEND, 0, &list, &mut addrs[..1]),
            None,
            "more entries than addresses"
        );
    }
}
