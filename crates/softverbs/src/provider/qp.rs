//! Queue pairs (RC, UC, UD, XRC): creation, the state machine (from [`crate::model::qp`]),
//! queries, receive posting and the flush on error.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};

use super::context::{inner, limits, pd_id, ContextInner};
use super::cq::{sv as sv_cq, SvCq};
use super::send::SendSide;
use super::srq::SvSrq;
use super::{set_bad, set_errno};
use crate::model::device::DEAD_ERRNO;
use crate::model::qp::{self as m, QpState, QpType};
use crate::model::wc::{opcode, WcStatus};
use crate::shm::claim::{ClaimRing, Token};
use crate::shm::layout::{
    recv_seg_bytes, ring_offset, Cqe, QpHeader, RecvWqe, Sge, MAGIC, MAX_SGE,
};
use crate::shm::{Ids, Segment};
use crate::sys::abi::VerbsQp;
use crate::sys::ibv;

/// Queue capacities as granted.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// Send work requests that may wait for the responder.
    pub max_send_wr: u32,
    /// Receive ring capacity (0 with an SRQ).
    pub max_recv_wr: u32,
    /// Gather entries per send.
    pub max_send_sge: u32,
    /// Scatter entries per receive.
    pub max_recv_sge: u32,
    /// Inline bytes per send.
    pub max_inline: u32,
}

/// A queue pair.
#[repr(C)]
pub struct SvQp {
    /// The libibverbs part (`verbs_qp`, `comp_mask` 0).
    pub vqp: VerbsQp,
    /// Owning context.
    pub ctx: *const ContextInner,
    /// QP number.
    pub qpn: u32,
    /// Transport.
    pub qp_type: QpType,
    /// Protection domain id.
    pub pd: u32,
    /// Segment `qp-<qpn>`.
    pub seg: Arc<Segment>,
    /// Receive queue (requesters claim from it, shm::claim).
    pub rq: ClaimRing<RecvWqe>,
    /// Send CQ.
    pub send_cq: *const SvCq,
    /// Receive CQ.
    pub recv_cq: *const SvCq,
    /// SRQ or null.
    pub srq: *const SvSrq,
    /// `sq_sig_all`.
    pub sig_all: bool,
    /// Granted capacities.
    pub caps: Caps,
    /// Send side: destination, responder handle, waiting sends.
    pub send: Mutex<SendSide>,
    /// `ibv_qp_ex` operations the QP was created for (`create_qp_ex` with
    /// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`; 0 otherwise).
    pub send_ops: u64,
    /// The `ibv_qp_ex` batch being built (provider::qp_ex).
    pub ex: Mutex<super::qp_ex::ExBatch>,
    attr: Mutex<Box<ibv::ibv_qp_attr>>,
}

impl std::fmt::Debug for SvQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvQp").field("qpn", &self.qpn).finish()
    }
}

impl SvQp {
    /// The shared header.
    pub fn hdr(&self) -> &QpHeader {
        // SAFETY: the segment starts with the QpHeader written at creation.
        unsafe { &*self.seg.base().cast::<QpHeader>() }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        QpState::from_u32(self.hdr().state.load(Ordering::Acquire)).unwrap_or(QpState::Err)
    }

    /// The owning context.
    pub fn ctx(&self) -> &ContextInner {
        // SAFETY: a context outlives its QPs (verbs rule).
        unsafe { &*self.ctx }
    }

    /// The send CQ (an XRC_RECV QP, which never sends, has none).
    pub fn send_cq(&self) -> &SvCq {
        // SAFETY: a CQ cannot be destroyed while a QP uses it: destroy_cq
        // answers EBUSY while send_qps is non-empty or recv_users non-zero.
        unsafe { &*self.send_cq }
    }

    /// The receive CQ (only QPs with a receive queue have one: not the
    /// XRC QPs; an XRC SRQ has its own).
    pub fn recv_cq(&self) -> &SvCq {
        // SAFETY: as for send_cq.
        unsafe { &*self.recv_cq }
    }

    /// Lock the send side.
    pub fn lock_send(&self) -> MutexGuard<'_, SendSide> {
        self.send.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Move to ERR and flush both queues (model::qp flush rule); a QP on
    /// an SRQ then gets its last-WQE event when due (model::event), after
    /// the flush (steps 1–3 of "Last WQE reached", provider::events).
    /// Idempotent: a QP a requester already moved to ERR gets its waiting
    /// sends flushed.
    pub fn to_error(&self, ss: &mut SendSide) {
        let h = self.hdr();
        // Step 1: counted while the flush adds receive completions.
        let me = h.insiders.enter();
        h.state.store(QpState::Err as u32, Ordering::SeqCst);
        // Requesters waiting on us now hear nothing (their timeout starts).
        h.doorbell.ring();
        self.flush(ss);
        h.insiders.leave(me);
        super::events::last_wqe(self.ctx().hdr(), h);
    }

    /// A UC/UD send-queue error (model::qp): the QP enters SQE, where
    /// later sends flush and receives go on, until `ibv_modify_qp` to RTS.
    /// Their sends never wait, so there is nothing queued to flush.
    pub fn to_send_error(&self) {
        let _ = self.hdr().state.compare_exchange(
            QpState::Rts as u32,
            QpState::Sqe as u32,
            Ordering::SeqCst,
            Ordering::Acquire,
        );
    }

    /// Complete every waiting send and (without SRQ) every posted receive
    /// with `IBV_WC_WR_FLUSH_ERR`, in order, including receives taken by a
    /// requester that died before completing them (shm::claim); on an SRQ,
    /// the receives such a requester took for this QP.
    pub fn flush(&self, ss: &mut SendSide) {
        while let Some(w) = ss.pending.pop_front() {
            self.send_cq().port.push(Cqe {
                wr_id: w.wr_id,
                status: WcStatus::WrFlushErr as u32,
                opcode: crate::model::wc::send_wc_opcode(w.opcode).unwrap_or(opcode::SEND),
                qp_num: self.qpn,
                ..Cqe::default()
            });
        }
        ss.set_waiting(self, false);
        let me = Token::mine(self.qpn);
        if self.srq.is_null() {
            self.rq.flush(
                me,
                |_| true,
                |r, release| self.flush_recv_with(r.wr_id, release),
            );
        } else {
            // SAFETY: an SRQ cannot be destroyed while a QP uses it (verbs
            // rule: destroy the QPs first).
            let srq = unsafe { &*self.srq };
            srq.flush_taken_for(self.qpn, |r, release| {
                self.flush_recv_with(r.wr_id, release)
            });
        }
    }

    fn flush_recv(&self, wr_id: u64) {
        self.flush_recv_with(wr_id, &|| {});
    }

    /// Flush a receive whose claim `release` releases (shm::claim) before
    /// its completion is published.
    fn flush_recv_with(&self, wr_id: u64, release: &dyn Fn()) {
        self.recv_cq().port.push_with(
            Cqe {
                wr_id,
                status: WcStatus::WrFlushErr as u32,
                opcode: opcode::RECV,
                qp_num: self.qpn,
                ..Cqe::default()
            },
            release,
        );
    }

    /// After a receive was pushed: if a requester moved the QP to ERR
    /// meanwhile (its flush may have missed the new WQE), flush the ring.
    fn recheck_error(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.state() == QpState::Err {
            self.rq.flush(
                Token::mine(self.qpn),
                |_| true,
                |r, release| self.flush_recv_with(r.wr_id, release),
            );
        }
    }

    /// Retry sends waiting for the responder, unless another thread holds
    /// the send side (it is posting or progressing them already).
    pub fn try_progress(&self) {
        if let Ok(mut ss) = self.send.try_lock() {
            super::send::progress(self, &mut ss);
        }
    }
}

fn caps_ok(c: &ibv::ibv_qp_cap, has_srq: bool) -> bool {
    c.max_send_wr <= limits::MAX_QP_WR
        && (has_srq || c.max_recv_wr <= limits::MAX_QP_WR)
        && c.max_send_sge as usize <= MAX_SGE
        && c.max_recv_sge as usize <= MAX_SGE
        && c.max_inline_data <= limits::MAX_INLINE
}

/// `create_qp`: RC, UC, UD and XRC_SEND QPs (XRC_RECV ones need a domain:
/// `create_qp_ex`).
///
/// # Safety
/// `pd` is a PD of this provider; `attr` is a valid init attribute block.
pub unsafe extern "C" fn create_qp(
    pd: *mut ibv::ibv_pd,
    attr: *mut ibv::ibv_qp_init_attr,
) -> *mut ibv::ibv_qp {
    // SAFETY: caller contract.
    let ctx = unsafe { (*pd).context };
    // SAFETY: as above.
    unsafe { make_qp(ctx, pd, &mut *attr, 0) }
}

/// Build a QP. `pd` is null only for an XRC_RECV QP, which belongs to the
/// XRC domain `xrcd` instead and has no CQs and no queues.
///
/// # Safety
/// `ctx` is a live softverbs context; `pd` is null or a PD of it; the CQs
/// and SRQ in `a` are null or objects of this provider.
pub unsafe fn make_qp(
    ctx: *mut ibv::ibv_context,
    pd: *mut ibv::ibv_pd,
    a: &mut ibv::ibv_qp_init_attr,
    xrcd: u32,
) -> *mut ibv::ibv_qp {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return super::dead();
    }
    let Some(qp_type) = QpType::from_u32(a.qp_type) else {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    };
    let cqs_ok = match qp_type {
        QpType::XrcRecv => xrcd != 0 && pd.is_null(),
        QpType::XrcSend => !a.send_cq.is_null() && a.srq.is_null() && !pd.is_null(),
        _ => !a.send_cq.is_null() && !a.recv_cq.is_null() && !pd.is_null(),
    };
    if !cqs_ok || !caps_ok(&a.cap, !a.srq.is_null() || !qp_type.has_recv_queue()) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // The CQs the QP uses: none for an XRC_RECV QP, no receive CQ for an
    // XRC_SEND one (whatever the caller passed).
    let send_cq = if qp_type == QpType::XrcRecv {
        std::ptr::null_mut()
    } else {
        a.send_cq
    };
    let recv_cq = if qp_type.has_recv_queue() {
        a.recv_cq
    } else {
        std::ptr::null_mut()
    };
    let pdid = if pd.is_null() {
        0
    } else {
        // SAFETY: caller contract.
        unsafe { pd_id(pd) }
    };
    // SAFETY: `ctx` is a live softverbs context.
    let c = unsafe { inner(ctx) };
    let srq = a.srq.cast::<SvSrq>() as *const SvSrq;
    // With an SRQ, or with no receive queue (XRC_SEND), the QP's own
    // receive ring is never used: the smallest ring there is.
    let rq_cap = ClaimRing::<RecvWqe>::capacity_for(if srq.is_null() && qp_type.has_recv_queue() {
        a.cap.max_recv_wr as usize
    } else {
        0
    });
    let ids = match Ids::get() {
        Ok(i) => i,
        Err(e) => {
            set_errno(crate::shm::fabric::errno(&e, libc::EIO));
            return std::ptr::null_mut();
        }
    };
    let (qpn, seg) = match crate::shm::segment::create_fresh(
        "qp-",
        || ids.next_qpn(),
        recv_seg_bytes::<QpHeader>(rq_cap),
    ) {
        Ok(x) => x,
        Err(e) => {
            set_errno(crate::shm::fabric::errno(&e, libc::EIO));
            return std::ptr::null_mut();
        }
    };
    // SAFETY: fresh zeroed segment sized for the ring at ring_offset; nobody
    // knows the QPN yet.
    let rq =
        unsafe { ClaimRing::<RecvWqe>::init(seg.base().add(ring_offset::<QpHeader>()), rq_cap) };
    let recv_cq_id = if recv_cq.is_null() {
        0
    } else {
        // SAFETY: a CQ of this provider (caller contract).
        unsafe { sv_cq(recv_cq).id }
    };
    let srq_id = if srq.is_null() {
        0
    } else {
        // SAFETY: a live SRQ of this provider.
        unsafe { (*srq).id }
    };
    let hdr = seg.base().cast::<QpHeader>();
    // SAFETY: as above; the header is ours until returned.
    unsafe {
        (*hdr).pid = std::process::id();
        (*hdr).ctx = c.id;
        (*hdr).qpn = qpn;
        (*hdr).pd = pdid;
        (*hdr).recv_cq = recv_cq_id;
        (*hdr).srq = srq_id;
        (*hdr).qp_type = qp_type as u32;
        (*hdr).xrcd = xrcd;
        (*hdr).state.store(QpState::Reset as u32, Ordering::Relaxed);
        (*hdr).magic = MAGIC;
    }
    let caps = Caps {
        max_send_wr: a.cap.max_send_wr.max(1),
        max_recv_wr: if srq.is_null() && qp_type.has_recv_queue() {
            rq_cap as u32
        } else {
            0
        },
        max_send_sge: a.cap.max_send_sge.max(1),
        max_recv_sge: a.cap.max_recv_sge.max(1),
        max_inline: a.cap.max_inline_data,
    };
    a.cap.max_send_wr = caps.max_send_wr;
    a.cap.max_recv_wr = caps.max_recv_wr;
    let qp = Box::new(SvQp {
        // SAFETY: all-zero is valid for verbs_qp (plain C data, glibc
        // pthread objects' static initialisers are zero).
        vqp: unsafe { std::mem::zeroed() },
        ctx: c,
        qpn,
        qp_type,
        pd: pdid,
        seg,
        rq,
        send_cq: send_cq.cast::<SvCq>(),
        recv_cq: recv_cq.cast::<SvCq>(),
        srq,
        sig_all: a.sq_sig_all != 0,
        caps,
        send: Mutex::new(SendSide::new()),
        send_ops: 0,
        ex: Mutex::new(super::qp_ex::ExBatch::default()),
        // SAFETY: ibv_qp_attr is plain C data; zero is a valid value.
        attr: Mutex::new(Box::new(unsafe { std::mem::zeroed() })),
    });
    let raw = Box::into_raw(qp);
    // SAFETY: `raw` is the live box; filling the ibv_qp part libibverbs reads.
    unsafe {
        let q = &mut (*raw).vqp.qp_ex.qp_base;
        q.context = ctx;
        q.qp_context = a.qp_context;
        q.pd = pd;
        q.send_cq = send_cq;
        q.recv_cq = recv_cq;
        q.srq = a.srq;
        q.handle = qpn;
        q.qp_num = qpn;
        q.state = QpState::Reset as u32;
        q.qp_type = qp_type as u32;
        (*hdr).qp_ptr = raw as u64;
        if !recv_cq.is_null() {
            (*raw).recv_cq().recv_users.fetch_add(1, Ordering::AcqRel);
        }
        if !send_cq.is_null() {
            (*raw)
                .send_cq()
                .send_qps
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(raw as usize);
        }
    }
    super::events::register(raw as usize, ctx as usize, super::events::Kind::Qp);
    raw.cast()
}

/// The SvQp of an `ibv_qp` of this provider.
///
/// # Safety
/// `qp` was made by [`create_qp`] and is live.
pub unsafe fn sv<'a>(qp: *mut ibv::ibv_qp) -> &'a SvQp {
    // SAFETY: `qp` is at offset 0 of a boxed SvQp.
    unsafe { &*qp.cast::<SvQp>() }
}

/// `destroy_qp`: peers see ERR; no completions or events are generated,
/// and the QP's completions not yet polled leave its CQs, the SRQ
/// receives dead requesters took for it go back to the SRQ
/// (provider::purge, as mlx5's `mlx5_destroy_qp`). Waits until the
/// application acked the async events it read for the QP (libibverbs'
/// rule); see provider::events for records still unread.
///
/// # Safety
/// `qp` was made by [`create_qp`]; not used afterwards. The calling thread
/// is not inside an `ibv_start_poll` … `ibv_end_poll` of one of its CQs
/// (the clean takes the CQ's consumer lock, as mlx5's does).
pub unsafe extern "C" fn destroy_qp(qp: *mut ibv::ibv_qp) -> c_int {
    // SAFETY: caller contract.
    let q = unsafe { sv(qp) };
    // A QP still attached to a multicast group is not destroyed (the
    // kernel's answer): detach first. A dead context's QP cannot be
    // detached (EIO): its attachments go with it.
    if q.qp_type == QpType::Ud {
        if q.ctx().dead() {
            super::mcast::detach_all(q.qpn);
        } else if super::mcast::attachments(q.qpn) > 0 {
            return libc::EBUSY;
        }
    }
    // Events protocol: no record after this (requesters check it).
    q.hdr().gone.store(1, Ordering::SeqCst);
    // The name goes now, whoever still maps the segment (a peer, or the
    // progress thread asleep on its doorbell): the QP is gone for anyone
    // who would open it, and its number's next QP gets a fresh segment.
    q.seg.unlink();
    {
        let mut ss = q.lock_send();
        // Purge P1.
        q.hdr().state.store(QpState::Err as u32, Ordering::SeqCst);
        q.hdr().doorbell.ring();
        // Purge P2.
        ss.pending.clear();
        ss.set_waiting(q, false);
        // Progress step 3: leave the background registry before the free,
        // even if `waiting` was already false (the registry, not this flag,
        // decides what the progress thread dereferences).
        // SAFETY: `on` is false: the pointer is only a key.
        unsafe { super::progress::set(q, false) };
    }
    if !q.send_cq.is_null() {
        q.send_cq()
            .send_qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&p| p != qp as usize);
    }
    // Purge P3–P5. A dead device's CQs deliver nothing any more, and its
    // cleanup never waits (model::device).
    if !q.ctx().dead() {
        super::purge::purge(q);
    }
    if !q.recv_cq.is_null() {
        q.recv_cq().recv_users.fetch_sub(1, Ordering::AcqRel);
    }
    let written = q.hdr().events.load(Ordering::SeqCst);
    match super::events::retire(qp as usize, written) {
        super::events::Retire::Free { read } => {
            // SAFETY: `qp` is live until the free below; its mutex and
            // condition variable are zeroed (static initialisers) or
            // initialised by libibverbs.
            unsafe {
                super::events::wait_acks(
                    std::ptr::addr_of_mut!((*qp).mutex).cast(),
                    std::ptr::addr_of_mut!((*qp).cond).cast(),
                    std::ptr::addr_of!((*qp).events_completed),
                    read,
                );
            }
            // SAFETY: caller contract: last use of the box.
            drop(unsafe { Box::from_raw(qp.cast::<SvQp>()) });
        }
        super::events::Retire::Zombie => {
            // SAFETY: move the provider state out and drop it (segment
            // unlinked, references released); the allocation stays, so its
            // `verbs_qp` part (plain C data) remains valid for the
            // ibv_ack_async_event of a record still unread. Freed by
            // `free_zombie` when the context closes, never dropped again.
            drop(unsafe { std::ptr::read(qp.cast::<SvQp>()) });
        }
    }
    0
}

/// Free the memory of a QP destroyed while event records naming it were
/// unread (its fields were dropped by `destroy_qp`).
///
/// # Safety
/// `obj` is such a zombie, freed once.
pub unsafe fn free_zombie(obj: usize) {
    // SAFETY: caller contract: the Box allocation of an SvQp, contents
    // already dropped.
    unsafe { std::alloc::dealloc(obj as *mut u8, std::alloc::Layout::new::<SvQp>()) };
}

macro_rules! copy_if {
    ($mask:expr, $bit:expr, $dst:expr, $src:expr, $($f:ident),+) => {
        if $mask & $bit != 0 { $( $dst.$f = $src.$f; )+ }
    };
}

/// `modify_qp`.
///
/// # Safety
/// `qp` is live; `attr` is valid.
pub unsafe extern "C" fn modify_qp(
    qp: *mut ibv::ibv_qp,
    attr: *mut ibv::ibv_qp_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: caller contract.
    let (q, a) = unsafe { (sv(qp), &*attr) };
    if q.ctx().dead() {
        return DEAD_ERRNO;
    }
    let mut ss = q.lock_send();
    let cur = q.state();
    let next = if mask & m::ATTR_STATE != 0 {
        match QpState::from_u32(a.qp_state) {
            Some(s) => s,
            None => return libc::EINVAL,
        }
    } else {
        cur
    };
    // As the kernel's table: a mask without a state is a move from the
    // current state to itself, which must be a transition too.
    if !m::transition_ok(cur, next) || !m::attrs_ok(q.qp_type, cur, next, mask) {
        return libc::EINVAL;
    }
    // The device's limits on outstanding READ/atomic requests
    // (`max_qp_init_rd_atom`, `max_qp_rd_atom`): larger is EINVAL, as the
    // kernel answers. Each request completes before post_send returns, so
    // at most one is ever outstanding and any accepted limit is honoured.
    if (mask & m::ATTR_MAX_QP_RD_ATOMIC != 0 && a.max_rd_atomic > limits::MAX_RD_ATOM)
        || (mask & m::ATTR_MAX_DEST_RD_ATOMIC != 0 && a.max_dest_rd_atomic > limits::MAX_RD_ATOM)
    {
        return libc::EINVAL;
    }
    // One port, one P_Key (index 0).
    if (mask & m::ATTR_PORT != 0 && a.port_num != 1)
        || (mask & m::ATTR_PKEY_INDEX != 0 && a.pkey_index != 0)
    {
        return libc::EINVAL;
    }
    {
        let mut st = q.attr.lock().unwrap_or_else(|e| e.into_inner());
        let st = &mut **st;
        copy_if!(mask, m::ATTR_ACCESS_FLAGS, st, a, qp_access_flags);
        copy_if!(mask, m::ATTR_PKEY_INDEX, st, a, pkey_index);
        copy_if!(mask, m::ATTR_PORT, st, a, port_num);
        copy_if!(mask, m::ATTR_QKEY, st, a, qkey);
        copy_if!(mask, m::ATTR_PATH_MTU, st, a, path_mtu);
        copy_if!(mask, m::ATTR_TIMEOUT, st, a, timeout);
        copy_if!(mask, m::ATTR_RETRY_CNT, st, a, retry_cnt);
        copy_if!(mask, m::ATTR_RNR_RETRY, st, a, rnr_retry);
        copy_if!(mask, m::ATTR_RQ_PSN, st, a, rq_psn);
        copy_if!(mask, m::ATTR_SQ_PSN, st, a, sq_psn);
        copy_if!(mask, m::ATTR_MAX_QP_RD_ATOMIC, st, a, max_rd_atomic);
        copy_if!(mask, m::ATTR_MAX_DEST_RD_ATOMIC, st, a, max_dest_rd_atomic);
        copy_if!(mask, m::ATTR_MIN_RNR_TIMER, st, a, min_rnr_timer);
        copy_if!(mask, m::ATTR_DEST_QPN, st, a, dest_qp_num);
        if mask & m::ATTR_AV != 0 {
            // SAFETY: both are valid ibv_ah_attr values (plain C data).
            unsafe { std::ptr::copy_nonoverlapping(&a.ah_attr, &mut st.ah_attr, 1) };
        }
        ss.transport_timeout = m::transport_timeout(st.timeout, st.retry_cnt);
        ss.rnr_retry = st.rnr_retry;
    }
    if mask & m::ATTR_MIN_RNR_TIMER != 0 {
        q.hdr()
            .min_rnr_timer
            .store(u32::from(a.min_rnr_timer), Ordering::Release);
    }
    if mask & m::ATTR_ACCESS_FLAGS != 0 {
        q.hdr().access.store(a.qp_access_flags, Ordering::Release);
    }
    if mask & m::ATTR_QKEY != 0 {
        q.hdr().qkey.store(a.qkey, Ordering::Release);
    }
    if mask & m::ATTR_DEST_QPN != 0 {
        ss.set_dest(a.dest_qp_num);
    }
    if mask & m::ATTR_STATE != 0 {
        match next {
            QpState::Err => q.to_error(&mut ss),
            QpState::Reset => {
                // Purge P1 and P2 (the QP stays on its CQs: its send side,
                // emptied here, adds nothing in RESET).
                q.hdr().state.store(next as u32, Ordering::SeqCst);
                q.hdr().last_wqe.store(0, Ordering::Release);
                ss.pending.clear();
                ss.set_waiting(q, false);
                // Posted receives go, and those a dead requester took.
                q.rq.flush(Token::mine(q.qpn), |_| true, |_, _| {});
            }
            _ => q.hdr().state.store(next as u32, Ordering::Release),
        }
        // Requesters waiting for us to reach RTR (or now unanswered).
        q.hdr().doorbell.ring();
        if next == QpState::Reset {
            // Purge P3–P5: completions of its former life are not polled
            // after it is reused. Not under the send side's lock: the clean
            // takes the CQs' consumer lock, which a thread inside an
            // `ibv_start_poll` … `ibv_end_poll` holds while it may post on
            // this QP.
            drop(ss);
            super::purge::purge(q);
        }
    }
    0
}

/// `query_qp`.
///
/// # Safety
/// `qp` is live; `attr` and `init` are writable.
pub unsafe extern "C" fn query_qp(
    qp: *mut ibv::ibv_qp,
    attr: *mut ibv::ibv_qp_attr,
    _mask: c_int,
    init: *mut ibv::ibv_qp_init_attr,
) -> c_int {
    // SAFETY: caller contract.
    let q = unsafe { sv(qp) };
    if q.ctx().dead() {
        return DEAD_ERRNO;
    }
    let st = q.attr.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: `attr` is writable (caller contract); copying a plain C struct.
    unsafe {
        std::ptr::copy_nonoverlapping(&**st, attr, 1);
        let a = &mut *attr;
        a.qp_state = q.state() as u32;
        a.cur_qp_state = a.qp_state;
        a.cap.max_send_wr = q.caps.max_send_wr;
        a.cap.max_recv_wr = q.caps.max_recv_wr;
        a.cap.max_send_sge = q.caps.max_send_sge;
        a.cap.max_recv_sge = q.caps.max_recv_sge;
        a.cap.max_inline_data = q.caps.max_inline;
        if !init.is_null() {
            let i = &mut *init;
            let b = &(*qp);
            i.qp_context = b.qp_context;
            i.send_cq = b.send_cq;
            i.recv_cq = b.recv_cq;
            i.srq = b.srq;
            i.cap = a.cap;
            i.qp_type = q.qp_type as u32;
            i.sq_sig_all = q.sig_all as c_int;
        }
    }
    0
}

/// Gather the SGEs of a receive WR, or `None` if there are too many.
///
/// # Safety
/// `wr` is a valid receive WR whose `sg_list` has `num_sge` entries.
pub unsafe fn recv_wqe(wr: &ibv::ibv_recv_wr, max: u32) -> Option<RecvWqe> {
    let n = wr.num_sge.max(0) as usize;
    if n > MAX_SGE || n > max as usize {
        return None;
    }
    let mut s = [Sge::default(); MAX_SGE];
    for (i, d) in s.iter_mut().enumerate().take(n) {
        // SAFETY: i < num_sge (caller contract).
        let g = unsafe { &*wr.sg_list.add(i) };
        *d = Sge {
            addr: g.addr,
            length: g.length,
            lkey: g.lkey,
        };
    }
    Some(RecvWqe::new(wr.wr_id, &s[..n]))
}

/// `post_recv`.
///
/// # Safety
/// `qp` is live; `wr` is a valid chain; `bad` is writable.
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv::ibv_qp,
    mut wr: *mut ibv::ibv_recv_wr,
    bad: *mut *mut ibv::ibv_recv_wr,
) -> c_int {
    // SAFETY: caller contract.
    let q = unsafe { sv(qp) };
    if q.ctx().dead() && !wr.is_null() {
        // SAFETY: caller contract.
        unsafe { set_bad(bad, wr) };
        return DEAD_ERRNO;
    }
    while !wr.is_null() {
        // SAFETY: `wr` is a node of the caller's valid chain.
        let w = unsafe { &*wr };
        let st = q.state();
        if !q.srq.is_null() || !q.qp_type.has_recv_queue() || !st.can_post_recv() {
            // SAFETY: caller contract.
            unsafe { set_bad(bad, wr) };
            return libc::EINVAL;
        }
        // SAFETY: `w` is valid (caller contract).
        let Some(wqe) = (unsafe { recv_wqe(w, q.caps.max_recv_sge) }) else {
            // SAFETY: caller contract.
            unsafe { set_bad(bad, wr) };
            return libc::EINVAL;
        };
        if st == QpState::Err {
            q.flush_recv(w.wr_id);
        } else if q.rq.push(wqe).is_err() {
            // SAFETY: caller contract.
            unsafe { set_bad(bad, wr) };
            return libc::ENOMEM;
        } else {
            q.recheck_error();
            // A requester may be waiting for this receive (RNR).
            q.hdr().doorbell.ring();
        }
        wr = w.next;
    }
    0
}

/// Sends waiting for the responder, oldest first.
pub type Pending = VecDeque<super::send::Wr>;

/// Set errno and return null (for constructors).
pub fn fail<T>(e: i32) -> *mut T {
    set_errno(e);
    std::ptr::null_mut()
}
