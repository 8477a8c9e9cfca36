//! Shared receive queues: a shared ring of receive WQEs (segment
//! `srq-<id>`) that requesters of every attached QP pop from.

use std::ffi::c_int;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::context::{inner, limits, pd_id, ContextInner};
use super::qp::{fail, recv_wqe};
use super::set_bad;
use crate::model::device::DEAD_ERRNO;
use crate::model::event::srq_limit_ok;
use crate::shm::claim::{ClaimRing, Token};
use crate::shm::layout::{recv_seg_bytes, ring_offset, RecvWqe, SrqHeader, MAGIC, MAX_SGE};
use crate::shm::segment::IdKind;
use crate::shm::{Ids, Segment};
use crate::sys::abi::VerbsSrq;
use crate::sys::ibv;

/// A shared receive queue.
#[repr(C)]
pub struct SvSrq {
    /// The libibverbs part.
    pub vsrq: VerbsSrq,
    /// SRQ id.
    pub id: u32,
    /// Owning context (its `dead` flag).
    ctx: *const ContextInner,
    seg: Arc<Segment>,
    ring: ClaimRing<RecvWqe>,
    max_sge: u32,
    /// An XRC SRQ's CQ (its receives complete there), else null.
    pub xrc_cq: *const super::cq::SvCq,
}

impl SvSrq {
    /// The shared header (the armed limit lives there: requesters of every
    /// process take receives and apply the limit rule, model::event).
    fn hdr(&self) -> &SrqHeader {
        // SAFETY: the segment starts with the SrqHeader written at creation
        // and lives as long as `self`.
        unsafe { &*self.seg.base().cast::<SrqHeader>() }
    }

    /// Flush, oldest first, the receives of this SRQ that a requester
    /// took for QP `qpn` and died before completing (shm::claim): taken,
    /// they belong to that QP, whose error state flushes them to its CQ,
    /// as a NIC completes in error the WQE a QP had consumed for a message
    /// that never finished. Receives nobody took stay in the SRQ for the
    /// other QPs.
    pub fn flush_taken_for(&self, qpn: u32, f: impl FnMut(RecvWqe, &dyn Fn())) -> usize {
        flush_taken_for(&self.ring, qpn, f)
    }

    /// Release, without a completion, the receives of this SRQ that a
    /// requester took for QP `qpn` and died before completing (purge step
    /// P4, the QP being destroyed or reset): their slots are free again.
    pub fn release_taken_for(&self, qpn: u32) -> usize {
        flush_taken_for(&self.ring, qpn, |_, _| {})
    }

    /// Whether the device died for the owning context (model::device).
    fn dead(&self) -> bool {
        // SAFETY: a context outlives its SRQs (verbs rule).
        unsafe { &*self.ctx }.dead()
    }
}

/// `create_srq`.
///
/// # Safety
/// `pd` is a PD of this provider; `attr` is valid.
pub unsafe extern "C" fn create_srq(
    pd: *mut ibv::ibv_pd,
    attr: *mut ibv::ibv_srq_init_attr,
) -> *mut ibv::ibv_srq {
    // SAFETY: caller contract.
    unsafe { make_srq(pd, &mut (*attr).attr, 0, std::ptr::null_mut()) }.cast()
}

/// Build an SRQ: a basic one (`xrcd` 0, `cq` null) or an XRC SRQ of
/// domain `xrcd` completing into `cq` (provider::xrc).
///
/// # Safety
/// `pd` is a PD of this provider; `cq` is null or a CQ of it.
pub unsafe fn make_srq(
    pd: *mut ibv::ibv_pd,
    a: &mut ibv::ibv_srq_attr,
    xrcd: u32,
    cq: *mut ibv::ibv_cq,
) -> *mut SvSrq {
    // SAFETY: caller contract.
    let c = unsafe { inner((*pd).context) };
    if c.dead() {
        return super::dead();
    }
    if a.max_wr == 0 || a.max_wr > limits::MAX_QP_WR || a.max_sge as usize > MAX_SGE {
        return fail(libc::EINVAL);
    }
    // SAFETY: caller contract.
    let pdid = unsafe { pd_id(pd) };
    let cap = ClaimRing::<RecvWqe>::capacity_for(a.max_wr as usize);
    let Ok(ids) = Ids::get() else {
        return fail(libc::EIO);
    };
    let (id, seg) = match crate::shm::segment::create_fresh(
        "srq-",
        || ids.next(IdKind::Srq),
        recv_seg_bytes::<SrqHeader>(cap),
    ) {
        Ok(x) => x,
        Err(e) => return fail(crate::shm::fabric::errno(&e, libc::EIO)),
    };
    // SAFETY: fresh zeroed segment sized for the ring; unknown to others.
    let ring =
        unsafe { ClaimRing::<RecvWqe>::init(seg.base().add(ring_offset::<SrqHeader>()), cap) };
    let h = seg.base().cast::<SrqHeader>();
    // SAFETY: as above.
    unsafe {
        (*h).pid = std::process::id();
        (*h).ctx = c.id;
        (*h).pd = pdid;
        (*h).xrcd = xrcd;
        if !cq.is_null() {
            (*h).cq = super::cq::sv(cq).id;
        }
        (*h).magic = MAGIC;
    }
    a.max_wr = cap as u32;
    let srq = Box::new(SvSrq {
        // SAFETY: plain C data; zero is valid (glibc pthread initialisers).
        vsrq: unsafe { std::mem::zeroed() },
        id,
        ctx: c,
        seg,
        ring,
        max_sge: a.max_sge.max(1),
        xrc_cq: cq.cast::<super::cq::SvCq>(),
    });
    let raw = Box::into_raw(srq);
    // SAFETY: the live box; libibverbs fills context/pd/srq_context after
    // create_srq (create_srq_ex fills them itself, provider::xrc).
    // The SRQ id is not known to anybody yet: the header is still ours.
    unsafe {
        (*raw).vsrq.srq.handle = id;
        (*raw).vsrq.srq_num = id;
        (*h).srq_ptr = raw as u64;
    }
    // `srq_limit` is ignored at creation (ibv_create_srq(3)): the limit is
    // armed by ibv_modify_srq only.
    // SAFETY: `pd` is live (caller contract).
    let ctx = unsafe { (*pd).context };
    super::events::register(raw as usize, ctx as usize, super::events::Kind::Srq);
    if !cq.is_null() {
        // SAFETY: a live CQ of ours; it cannot be destroyed while counted.
        unsafe { super::cq::sv(cq).recv_users.fetch_add(1, Ordering::AcqRel) };
    }
    raw
}

/// `destroy_srq`. Waits until the application acked the async events it
/// read for the SRQ (libibverbs' rule); see provider::events for records
/// still unread.
///
/// # Safety
/// `srq` was made by [`create_srq`]; not used afterwards.
pub unsafe extern "C" fn destroy_srq(srq: *mut ibv::ibv_srq) -> c_int {
    // SAFETY: caller contract: live until freed below.
    let s = unsafe { &*srq.cast::<SvSrq>() };
    s.hdr().gone.store(1, Ordering::SeqCst);
    // As `destroy_qp`: the name goes with the SRQ, mapped or not.
    s.seg.unlink();
    s.hdr().limit.store(0, Ordering::Release);
    if !s.xrc_cq.is_null() {
        // SAFETY: counted in make_srq, so the CQ is still live.
        unsafe { (*s.xrc_cq).recv_users.fetch_sub(1, Ordering::AcqRel) };
    }
    let written = s.hdr().events.load(Ordering::SeqCst);
    match super::events::retire(srq as usize, written) {
        super::events::Retire::Free { read } => {
            // SAFETY: `srq` is live; libibverbs initialised its mutex and
            // condition variable in ibv_create_srq.
            unsafe {
                super::events::wait_acks(
                    std::ptr::addr_of_mut!((*srq).mutex).cast(),
                    std::ptr::addr_of_mut!((*srq).cond).cast(),
                    std::ptr::addr_of!((*srq).events_completed),
                    read,
                );
            }
            // SAFETY: caller contract: last use of the box.
            drop(unsafe { Box::from_raw(srq.cast::<SvSrq>()) });
        }
        super::events::Retire::Zombie => {
            // SAFETY: as in destroy_qp: the provider state is dropped, the
            // allocation (its `verbs_srq` part, plain C data) is kept for
            // an unread record's ack and freed by `free_zombie`.
            drop(unsafe { std::ptr::read(srq.cast::<SvSrq>()) });
        }
    }
    0
}

/// Free the memory of an SRQ destroyed while event records naming it were
/// unread (its fields were dropped by `destroy_srq`).
///
/// # Safety
/// `obj` is such a zombie, freed once.
pub unsafe fn free_zombie(obj: usize) {
    // SAFETY: caller contract: the Box allocation of an SvSrq, contents
    // already dropped.
    unsafe { std::alloc::dealloc(obj as *mut u8, std::alloc::Layout::new::<SvSrq>()) };
}

/// `post_srq_recv`.
///
/// # Safety
/// `srq` is live; `wr` is a valid chain; `bad` is writable.
pub unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv::ibv_srq,
    mut wr: *mut ibv::ibv_recv_wr,
    bad: *mut *mut ibv::ibv_recv_wr,
) -> c_int {
    // SAFETY: caller contract.
    let s = unsafe { &*srq.cast::<SvSrq>() };
    let _ = &s.seg;
    if s.dead() && !wr.is_null() {
        // SAFETY: caller contract.
        unsafe { set_bad(bad, wr) };
        return DEAD_ERRNO;
    }
    while !wr.is_null() {
        // SAFETY: a node of the caller's chain.
        let w = unsafe { &*wr };
        // SAFETY: valid WR (caller contract).
        let Some(wqe) = (unsafe { recv_wqe(w, s.max_sge) }) else {
            // SAFETY: caller contract.
            unsafe { set_bad(bad, wr) };
            return libc::EINVAL;
        };
        if s.ring.push(wqe).is_err() {
            // SAFETY: caller contract.
            unsafe { set_bad(bad, wr) };
            return libc::ENOMEM;
        }
        // Requesters of any QP on this SRQ may be waiting (RNR).
        s.hdr().doorbell.ring();
        wr = w.next;
    }
    0
}

/// `IBV_SRQ_MAX_WR`.
const SRQ_MAX_WR: c_int = 1;
/// `IBV_SRQ_LIMIT`.
const SRQ_LIMIT: c_int = 2;

/// `modify_srq`: `IBV_SRQ_LIMIT` arms (limit > 0) or disarms (0) the limit
/// event (model::event); EINVAL for a limit above the SRQ's capacity.
/// Resizing is not supported (a larger `max_wr`: EINVAL).
///
/// # Safety
/// `srq` is live; `attr` valid.
pub unsafe extern "C" fn modify_srq(
    srq: *mut ibv::ibv_srq,
    attr: *mut ibv::ibv_srq_attr,
    mask: c_int,
) -> c_int {
    // SAFETY: caller contract.
    let (s, a) = unsafe { (&*srq.cast::<SvSrq>(), &*attr) };
    if s.dead() {
        return DEAD_ERRNO;
    }
    if mask & SRQ_MAX_WR != 0 && a.max_wr as usize > s.ring.capacity() {
        return libc::EINVAL;
    }
    if mask & SRQ_LIMIT != 0 {
        if !srq_limit_ok(a.srq_limit, s.ring.capacity()) {
            return libc::EINVAL;
        }
        s.hdr().limit.store(a.srq_limit, Ordering::Release);
    }
    0
}

/// `query_srq`.
///
/// # Safety
/// `srq` is live; `attr` writable.
pub unsafe extern "C" fn query_srq(srq: *mut ibv::ibv_srq, attr: *mut ibv::ibv_srq_attr) -> c_int {
    // SAFETY: caller contract.
    let (s, a) = unsafe { (&*srq.cast::<SvSrq>(), &mut *attr) };
    if s.dead() {
        return DEAD_ERRNO;
    }
    a.max_wr = s.ring.capacity() as u32;
    a.max_sge = s.max_sge;
    a.srq_limit = s.hdr().limit.load(Ordering::Acquire);
    0
}

/// [`SvSrq::flush_taken_for`] on an SRQ's ring, for the owner and for a
/// requester that moved the QP to error (provider::remote).
pub fn flush_taken_for(
    ring: &ClaimRing<RecvWqe>,
    qpn: u32,
    f: impl FnMut(RecvWqe, &dyn Fn()),
) -> usize {
    ring.flush(
        Token::mine(qpn),
        |holder| holder.is_some_and(|t| t.qpn() == qpn),
        f,
    )
}

crate::opaque_debug!(SvSrq);
