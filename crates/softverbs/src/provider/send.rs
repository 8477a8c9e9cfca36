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

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::qp::{sv, Pending, SvQp};
use super::remote::Remote;
use super::set_bad;
use super::xfer::{read_from, write_to, Span};
use crate::model::device::DEAD_ERRNO;
use crate::model::qp::QpState;
use crate::model::wc::{
    access, opcode, send_completes, send_flags, send_wc_opcode, wr, WcStatus, WC_WITH_IMM,
};
use crate::shm::layout::{mr_lookup, Cqe, RecvWqe, Sge, MAX_SGE};
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
    owned: Option<Vec<u8>>,
    since: Option<Instant>,
    /// Since when the responder has not answered this WR at all (the
    /// transport timeout runs from there).
    silent_since: Option<Instant>,
}

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
            waiting: false,
        }
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

fn check(
    info: Option<crate::shm::layout::MrInfo>,
    pd: u32,
    addr: u64,
    len: u64,
    need: u32,
) -> bool {
    info.is_some_and(|m| {
        m.pd == pd && m.contains(addr, len) && (need == 0 || m.access & need == need)
    })
}

/// The responder's check of an RDMA WRITE/READ target: rkey, PD, range and
/// access against its MR table. A zero-length transfer checks neither key
/// nor address (InfiniBand spec, C9-88: R_Key and VA need not be valid when
/// the DMA length is zero); the QP's remote access flags still apply.
fn remote_ok(r: &Remote, pd: u32, w: &Wr, len: u64, need: u32) -> bool {
    len == 0 || check(mr_lookup(r.mrs(), w.rkey), pd, w.remote_addr, len, need)
}

fn local_spans(q: &SvQp, w: &Wr, out: &mut [Span; MAX_SGE]) -> Option<u64> {
    let mrs = q.ctx().mrs();
    let need = if w.opcode == wr::RDMA_READ {
        access::LOCAL_WRITE
    } else {
        0
    };
    let inline = w.flags & send_flags::INLINE != 0 && w.opcode != wr::RDMA_READ;
    let mut total = 0u64;
    for (i, s) in w.sge[..w.nsge].iter().enumerate() {
        if !inline
            && s.length > 0
            && !check(mr_lookup(mrs, s.lkey), q.pd, s.addr, s.length as u64, need)
        {
            return None;
        }
        out[i] = Span {
            addr: s.addr,
            len: s.length as usize,
        };
        total += s.length as u64;
    }
    Some(total)
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
    Cqe {
        wr_id: wqe.wr_id,
        status: status as u32,
        opcode: op,
        byte_len: len,
        imm: if imm { w.imm } else { 0 },
        qp_num: r.hdr().qpn,
        src_qp: q.qpn,
        wc_flags: if imm { WC_WITH_IMM } else { 0 },
        solicited: (w.flags & send_flags::SOLICITED != 0) as u32,
    }
}

/// The responder detected an error (model::event): its QP goes to ERR and
/// raises its event; the requester completes with `status`.
fn responder_failed(r: &Remote, status: WcStatus) -> Outcome {
    if let Some(event) = crate::model::event::responder_error(status) {
        r.fail(event);
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
    let mut local = [Span::default(); MAX_SGE];
    let Some(len) = local_spans(q, w, &mut local) else {
        return Outcome::Done(WcStatus::LocProtErr, 0);
    };
    let local = &local[..w.nsge];
    if ss.remote.is_none() {
        match Remote::open(ss.dest_qpn) {
            Ok(r) => ss.remote = Some(r),
            // A QPN is only learnt after its QP was created, so a missing
            // segment means the responder is gone: requests to it are
            // dropped, as by hardware for an unknown QPN.
            Err(_) => return Outcome::NoAnswer,
        }
    }
    let Some(r) = ss.remote.as_ref() else {
        return Outcome::WaitPeer;
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
    let pid = rh.pid;
    match w.opcode {
        wr::SEND | wr::SEND_WITH_IMM => {
            let Some(wqe) = r.pop_recv() else {
                return no_receive(r);
            };
            let mut dst = [Span::default(); MAX_SGE];
            let mut cap = 0u64;
            let mrs = r.mrs();
            for (i, s) in wqe.sges().iter().enumerate() {
                if s.length > 0
                    && !check(
                        mr_lookup(mrs, s.lkey),
                        rh.pd,
                        s.addr,
                        s.length as u64,
                        access::LOCAL_WRITE,
                    )
                {
                    r.cq.push(recv_cqe(
                        r,
                        &wqe,
                        q,
                        w,
                        WcStatus::LocProtErr,
                        0,
                        opcode::RECV,
                    ));
                    return responder_failed(r, WcStatus::RemOpErr);
                }
                dst[i] = Span {
                    addr: s.addr,
                    len: s.length as usize,
                };
                cap += s.length as u64;
            }
            if len > cap {
                r.cq.push(recv_cqe(
                    r,
                    &wqe,
                    q,
                    w,
                    WcStatus::LocLenErr,
                    0,
                    opcode::RECV,
                ));
                return responder_failed(r, WcStatus::RemInvReqErr);
            }
            // SAFETY: local spans were validated against our MR table (or are
            // the caller's inline buffers); remote spans against the
            // responder's table, and the kernel checks them again.
            if !unsafe { write_to(pid, &dst[..wqe.sges().len()], local) } {
                if r.owner_gone() {
                    return Outcome::NoAnswer;
                }
                r.cq.push(recv_cqe(
                    r,
                    &wqe,
                    q,
                    w,
                    WcStatus::LocProtErr,
                    0,
                    opcode::RECV,
                ));
                return responder_failed(r, WcStatus::RemOpErr);
            }
            r.cq.push(recv_cqe(
                r,
                &wqe,
                q,
                w,
                WcStatus::Success,
                len as u32,
                opcode::RECV,
            ));
            Outcome::Done(WcStatus::Success, len as u32)
        }
        wr::RDMA_WRITE | wr::RDMA_WRITE_WITH_IMM => {
            let ok = rh.access.load(Ordering::Acquire) & access::REMOTE_WRITE != 0
                && remote_ok(r, rh.pd, w, len, access::REMOTE_WRITE);
            if !ok {
                return responder_failed(r, WcStatus::RemAccessErr);
            }
            let wqe = if w.opcode == wr::RDMA_WRITE_WITH_IMM {
                match r.pop_recv() {
                    Some(x) => Some(x),
                    None => return no_receive(r),
                }
            } else {
                None
            };
            let dst = [Span {
                addr: w.remote_addr,
                len: len as usize,
            }];
            // SAFETY: validated as in the SEND arm.
            if !unsafe { write_to(pid, &dst, local) } {
                if r.owner_gone() {
                    return Outcome::NoAnswer;
                }
                if let Some(wqe) = wqe {
                    r.cq.push(recv_cqe(
                        r,
                        &wqe,
                        q,
                        w,
                        WcStatus::LocProtErr,
                        0,
                        opcode::RECV_RDMA_WITH_IMM,
                    ));
                }
                return responder_failed(r, WcStatus::RemAccessErr);
            }
            if let Some(wqe) = wqe {
                r.cq.push(recv_cqe(
                    r,
                    &wqe,
                    q,
                    w,
                    WcStatus::Success,
                    len as u32,
                    opcode::RECV_RDMA_WITH_IMM,
                ));
            }
            Outcome::Done(WcStatus::Success, len as u32)
        }
        wr::RDMA_READ => {
            let ok = rh.access.load(Ordering::Acquire) & access::REMOTE_READ != 0
                && remote_ok(r, rh.pd, w, len, access::REMOTE_READ);
            if !ok {
                return responder_failed(r, WcStatus::RemAccessErr);
            }
            let src = [Span {
                addr: w.remote_addr,
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
        _ => Outcome::Done(WcStatus::LocQpOpErr, 0),
    }
}

fn complete(q: &SvQp, ss: &mut SendSide, w: &Wr, status: WcStatus, len: u32) {
    if send_completes(w.flags & send_flags::SIGNALED != 0, status) {
        q.send_cq().port.push(Cqe {
            wr_id: w.wr_id,
            status: status as u32,
            opcode: send_wc_opcode(w.opcode).unwrap_or(opcode::SEND),
            byte_len: len,
            qp_num: q.qpn,
            ..Cqe::default()
        });
    }
    if status != WcStatus::Success {
        q.to_error(ss);
    }
}

/// Keep a copy of inline data so the WR can wait without the caller's buffer.
fn own(mut w: Wr) -> Wr {
    if w.flags & send_flags::INLINE != 0 && w.owned.is_none() && w.opcode != wr::RDMA_READ {
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

/// When the WR at the head of the queue runs out of retries, if its
/// responder is silent and the QP's timeout is finite (the progress
/// thread's wake-up time).
pub fn silence_deadline(ss: &SendSide) -> Option<Instant> {
    let since = ss.pending.front()?.silent_since?;
    Some(since + ss.transport_timeout?)
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
    while let Some(mut w) = ss.pending.pop_front() {
        match execute(q, ss, &w) {
            Outcome::Done(s, len) => complete(q, ss, &w, s, len),
            Outcome::WaitPeer if w.since.is_some_and(|t| t.elapsed() > PEER_TIMEOUT) => {
                complete(q, ss, &w, WcStatus::RetryExcErr, 0)
            }
            Outcome::NoAnswer if silent_too_long(ss, &mut w) => {
                // Retries exhausted: the QP goes to ERR, which flushes the
                // WRs behind this one, in order.
                complete(q, ss, &w, WcStatus::RetryExcErr, 0)
            }
            o => {
                if !matches!(o, Outcome::NoAnswer) {
                    // The responder answered (RNR, not ready): the
                    // transport timer restarts.
                    w.silent_since = None;
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
        if send_wc_opcode(x.opcode).is_none() || n > MAX_SGE {
            return fail(libc::EINVAL);
        }
        if st != QpState::Err && !st.can_post_send() {
            return fail(libc::EINVAL);
        }
        let mut w = Wr {
            wr_id: x.wr_id,
            opcode: x.opcode,
            flags: x.send_flags | if q.sig_all { send_flags::SIGNALED } else { 0 },
            // SAFETY: reading the immediate-data arm of a plain u32 union.
            imm: unsafe { x.imm_data_invalidated_rkey_union.imm_data },
            sge: [Sge::default(); MAX_SGE],
            nsge: n,
            // SAFETY: the rdma arm of the wr union is plain data.
            remote_addr: unsafe { x.wr.rdma.remote_addr },
            // SAFETY: as above.
            rkey: unsafe { x.wr.rdma.rkey },
            owned: None,
            since: None,
            silent_since: None,
        };
        let mut inline_len = 0u32;
        for i in 0..n {
            // SAFETY: i < num_sge entries of the caller's sg_list.
            let g = unsafe { &*x.sg_list.add(i) };
            w.sge[i] = Sge {
                addr: g.addr,
                length: g.length,
                lkey: g.lkey,
            };
            inline_len = inline_len.saturating_add(g.length);
        }
        if w.flags & send_flags::INLINE != 0
            && inline_len
                > q.caps
                    .max_inline
                    .max(crate::provider::context::limits::MAX_INLINE)
        {
            return fail(libc::EINVAL);
        }
        if st == QpState::Err {
            complete(q, &mut ss, &w, WcStatus::WrFlushErr, 0);
        } else if !ss.pending.is_empty() {
            if ss.pending.len() >= q.caps.max_send_wr as usize {
                return fail(libc::ENOMEM);
            }
            ss.pending.push_back(own(w));
        } else {
            match execute(q, &mut ss, &w) {
                Outcome::Done(s, len) => complete(q, &mut ss, &w, s, len),
                o => {
                    if matches!(o, Outcome::NoAnswer) {
                        w.silent_since = Some(Instant::now());
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
