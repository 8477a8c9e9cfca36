//! Memory windows: `ibv_alloc_mw`, `ibv_dealloc_mw`, `ibv_bind_mw` (type
//! 1), and the execution of `IBV_WR_BIND_MW`, `IBV_WR_LOCAL_INV` and the
//! responder's part of `IBV_WR_SEND_WITH_INV` (rules in
//! [`crate::model::mr::mw`]).
//!
//! A window owns a slot of its context's MR table from allocation on; a
//! bind publishes the slot with the window's new rkey, the region's
//! translation of the bound range, the granted access, the region's slot
//! as parent and, for type 2, the QP; an invalidation clears the key.
//! Peers look windows up exactly as regions, so every remote access check
//! applies to them unchanged.

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use super::context::{inner, pd_id, ContextInner};
use super::qp::{fail, SvQp};
use crate::model::mr::mw::{self as m, Bind};
use crate::model::mr::ZERO_BASED;
use crate::model::wc::{wr, WcStatus};
use crate::shm::layout::{key_index, mr_lookup, mr_publish, MrInfo, MrSlot};
use crate::sys::ibv;

/// A memory window.
#[repr(C)]
pub struct SvMw {
    /// The libibverbs part.
    pub mw: ibv::ibv_mw,
    ctx: *const ContextInner,
    index: u32,
    pd: u32,
}

impl std::fmt::Debug for SvMw {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvMw").field("index", &self.index).finish()
    }
}

/// A bind work request as posted (`wr.bind_mw`), resolved enough to run
/// later in order with the QP's other work requests.
#[derive(Debug, Clone, Copy)]
pub struct BindOp {
    /// The `ibv_mw` (its rkey is updated when the bind succeeds).
    mw: usize,
    /// The window's slot, type and PD.
    index: u32,
    mw_type: u32,
    mw_pd: u32,
    /// The new rkey.
    rkey: u32,
    /// The region's lkey (0: none).
    mr_key: u32,
    addr: u64,
    len: u64,
    access: u32,
}

/// `alloc_mw`: type 1 or 2 (others EINVAL).
///
/// # Safety
/// `pd` is a PD of this provider.
pub unsafe extern "C" fn alloc_mw(pd: *mut ibv::ibv_pd, mw_type: u32) -> *mut ibv::ibv_mw {
    // SAFETY: caller contract.
    let (ctx, pdid) = unsafe { ((*pd).context, pd_id(pd)) };
    // SAFETY: as above.
    let c = unsafe { inner(ctx) };
    if c.dead() {
        return super::dead();
    }
    if mw_type != m::TYPE_1 && mw_type != m::TYPE_2 {
        return fail(libc::EINVAL);
    }
    let Some((index, rkey)) = c.take_slot() else {
        return fail(libc::ENOMEM);
    };
    let w = Box::new(SvMw {
        mw: ibv::ibv_mw {
            context: ctx,
            pd,
            rkey,
            handle: index,
            type_: mw_type,
        },
        ctx: c,
        index,
        pd: pdid,
    });
    Box::into_raw(w).cast()
}

/// `dealloc_mw`: invalidates the window and frees its slot.
///
/// # Safety
/// `mw` was made by [`alloc_mw`]; not used afterwards.
pub unsafe extern "C" fn dealloc_mw(mw: *mut ibv::ibv_mw) -> c_int {
    // SAFETY: caller contract: a boxed SvMw, last use.
    let w = unsafe { Box::from_raw(mw.cast::<SvMw>()) };
    // SAFETY: the context outlives its windows (verbs rule).
    let c = unsafe { &*w.ctx };
    let slot = &c.mrs()[w.index as usize];
    slot.key.store(0, Ordering::Release);
    slot.parent.store(0, Ordering::Release);
    c.give_slot(w.index);
    0
}

/// `bind_mw` (`ibv_bind_mw`, type 1): a bind work request with the next
/// rkey on `qp`'s send queue; `mw->rkey` becomes that rkey when the bind
/// executes. libibverbs already checked the type and the PDs.
///
/// # Safety
/// `qp`, `mw` are live objects of this provider; `bind` is valid.
pub unsafe extern "C" fn bind_mw(
    qp: *mut ibv::ibv_qp,
    mw: *mut ibv::ibv_mw,
    bind: *mut ibv::ibv_mw_bind,
) -> c_int {
    // SAFETY: caller contract.
    let b = unsafe { &*bind };
    // SAFETY: ibv_send_wr is plain C data: all-zero is valid.
    let mut w: ibv::ibv_send_wr = unsafe { std::mem::zeroed() };
    w.wr_id = b.wr_id;
    w.send_flags = b.send_flags;
    w.opcode = wr::BIND_MW;
    w.bind_mw_tso_union.bind_mw = ibv::bind_mw_t {
        mw,
        // SAFETY: caller contract: a live window.
        rkey: m::inc_rkey(unsafe { (*mw).rkey }),
        bind_info: b.bind_info,
    };
    let mut bad = std::ptr::null_mut();
    // SAFETY: `qp` is live; a one-WR chain.
    unsafe { super::send::post_send(qp, &mut w, &mut bad) }
}

/// Read a posted bind work request.
///
/// # Safety
/// `x` is a valid `IBV_WR_BIND_MW` work request naming a window of this
/// provider and a region of it (or none).
pub unsafe fn bind_op(x: &ibv::ibv_send_wr) -> BindOp {
    // SAFETY: the bind_mw arm, which the opcode says the caller filled.
    let b = unsafe { x.bind_mw_tso_union.bind_mw };
    // SAFETY: caller contract: a live SvMw.
    let w = unsafe { &*b.mw.cast::<SvMw>() };
    let mr = b.bind_info.mr;
    BindOp {
        mw: b.mw as usize,
        index: w.index,
        // SAFETY: as above.
        mw_type: unsafe { (*b.mw).type_ },
        mw_pd: w.pd,
        rkey: b.rkey,
        mr_key: if mr.is_null() {
            0
        } else {
            // SAFETY: a non-null region of this provider (caller contract).
            unsafe { (*mr).lkey }
        },
        addr: b.bind_info.addr,
        len: b.bind_info.length,
        access: b.bind_info.mw_access_flags,
    }
}

/// Execute a bind on `q`.
pub fn bind(q: &SvQp, op: &BindOp) -> WcStatus {
    let c = q.ctx();
    let mrs = c.mrs();
    let slot: &MrSlot = &mrs[op.index as usize];
    let region = (op.mr_key != 0)
        .then(|| mr_lookup(mrs, op.mr_key))
        .flatten()
        .filter(|r| r.parent == 0);
    let req = Bind {
        mw_type: op.mw_type,
        mw_pd: op.mw_pd,
        qp_pd: q.pd,
        same_slot: key_index(op.rkey) == op.index as usize && op.rkey != 0,
        bound: slot.key.load(Ordering::Acquire) != 0,
        mr: region.map(|r| (r.pd, r.access, r.contains(op.addr, op.len))),
        len: op.len,
        access: op.access,
    };
    if !m::bind_ok(&req) {
        return WcStatus::MwBindErr;
    }
    slot.key.store(0, Ordering::Release);
    if let (Some(r), true) = (region, op.len > 0) {
        let info = MrInfo {
            pd: r.pd,
            access: m::granted(op.access),
            qpn: if op.mw_type == m::TYPE_2 { q.qpn } else { 0 },
            addr: r.translate(op.addr),
            len: op.len,
            iova: if op.access & ZERO_BASED != 0 {
                0
            } else {
                op.addr
            },
            parent: crate::shm::layout::key_index(op.mr_key) as u32,
        };
        mr_publish(slot, op.rkey, info);
    }
    // SAFETY: the window is live while its bind is outstanding (verbs
    // rule: a window is not deallocated with binds pending).
    unsafe { (*(op.mw as *mut ibv::ibv_mw)).rkey = op.rkey };
    WcStatus::Success
}

/// Execute `IBV_WR_LOCAL_INV` of `rkey` on `q`: a type-2 window of the
/// QP's PD bound to this QP (else `IBV_WC_MW_BIND_ERR`).
pub fn local_invalidate(q: &SvQp, rkey: u32) -> WcStatus {
    if invalidate(q.ctx().mrs(), rkey, q.pd, q.qpn) {
        WcStatus::Success
    } else {
        WcStatus::MwBindErr
    }
}

/// Invalidate `rkey` in `table` if it names a type-2 window of `pd`
/// bound to QP `qpn`; whether it did.
pub fn invalidate(table: &[MrSlot], rkey: u32, pd: u32, qpn: u32) -> bool {
    let ok = mr_lookup(table, rkey).is_some_and(|i| i.parent != 0 && i.pd == pd && i.qpn == qpn);
    ok && table[key_index(rkey)]
        .key
        .compare_exchange(rkey, 0, Ordering::AcqRel, Ordering::Acquire)
        .is_ok()
}
