//! Extended completion queues (`ibv_create_cq_ex`, `ibv_start_poll` …).
//!
//! The same CQ as [`super::cq`], with the `ibv_cq_ex` iterator filled in,
//! following the protocol of [`super::cq_iter`] (its step numbers):
//! 1. `start_poll` retries waiting sends, takes the CQ's iterator lock
//!    (step 1), pops one CQE into the current completion and copies
//!    `status`/`wr_id` into the `ibv_cq_ex`; when the ring is empty it
//!    releases the lock and answers ENOENT (step 3);
//! 2. `next_poll` pops the next one the same way, keeping the lock (step 4);
//! 3. `end_poll` releases the lock (step 4);
//! 4. the `read_*` functions read the current completion (step 2).
//!
//! On a dead context (model::device) `start_poll` answers EIO without taking
//! the lock (no `end_poll` follows an error), `next_poll` answers EIO and
//! keeps it (its `end_poll` follows).
//!
//! A CQ created with `IBV_CREATE_CQ_ATTR_SINGLE_THREADED` gets the
//! lock-free variants of `start_poll`/`end_poll` (the `LOCK` parameter):
//! the application promised one polling thread; `ibv_poll_cq` and the clean
//! of a destroyed QP's completions then take no lock either
//! ([`SvCq::locked`]). `ibv_poll_cq` never touches the current completion.
//! Completion timestamps (device clock and wall clock, provider::clock)
//! are read from the CQE; flow tags, CVLAN
//! and TM info are not supported and answer EOPNOTSUPP; a parent domain is
//! accepted (`IBV_CQ_INIT_ATTR_MASK_PD`, it must be one of this context).
//!
//! Every callback here is called by libibverbs for the application, which
//! keeps the verbs contract: `cq` is an extended CQ of this provider made by
//! [`create_cq_ex`] and not yet destroyed, and `next_poll`, `end_poll` and
//! the `read_*` functions are called only by the thread whose `start_poll`
//! succeeded, before its `end_poll`.

use std::ffi::{c_int, c_uint};

use super::context::inner;
use super::cq::{make_cq, SvCq};
use super::set_errno;
use crate::model::device::DEAD_ERRNO;
use crate::sys::ibv;

/// `IBV_WC_EX_WITH_{BYTE_LEN,IMM,QP_NUM,SRC_QP,SLID,SL,DLID_PATH_BITS}`,
/// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP` and `_WALLCLOCK`
/// (provider::clock). CVLAN and flow tags belong to Ethernet ports and
/// flow steering, TM info to tag matching: none exists here.
pub const SUPPORTED_WC_FLAGS: u64 =
    0x7f | WITH_COMPLETION_TIMESTAMP | WITH_COMPLETION_TIMESTAMP_WALLCLOCK;
/// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`: the CQ's completions are
/// stamped (shm::layout::CqHeader::stamp).
const WITH_COMPLETION_TIMESTAMP: u64 = 1 << 7;
/// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK`: stamped too.
const WITH_COMPLETION_TIMESTAMP_WALLCLOCK: u64 = 1 << 11;
/// `IBV_CQ_INIT_ATTR_MASK_FLAGS`.
const MASK_FLAGS: u32 = 1;
/// `IBV_CQ_INIT_ATTR_MASK_PD`.
const MASK_PD: u32 = 1 << 1;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`.
const SINGLE_THREADED: u32 = 1;

/// The [`SvCq`] behind an extended CQ.
///
/// # Safety
/// `cq` was returned by [`create_cq_ex`] and is not destroyed while the
/// returned reference is in use.
unsafe fn sv_ex<'a>(cq: *mut ibv::ibv_cq_ex) -> &'a SvCq {
    // SAFETY: caller contract: `cq` is the first field of a live boxed SvCq
    // (SvCq is repr(C); create_cq_ex hands out that field's address).
    unsafe { &*cq.cast::<SvCq>() }
}

/// Pop the next CQE and make it current: `status` and `wr_id` into the
/// `ibv_cq_ex`, the rest for the `read_*` callbacks. False when empty.
///
/// # Safety
/// 1. As [`sv_ex`].
/// 2. The calling thread owns the iteration of `cq` (`cq_iter` step 2): it
///    holds the CQ's iterator lock, or the CQ was created single-threaded.
unsafe fn take(cq: *mut ibv::ibv_cq_ex) -> bool {
    // SAFETY: condition 1.
    let s = unsafe { sv_ex(cq) };
    let Some(e) = s.pop() else {
        return false;
    };
    // SAFETY: condition 2.
    unsafe { s.iter.set_current(e) };
    // SAFETY: 1. `cq` is live (condition 1); 2. `status` and `wr_id` belong
    // to the iteration this thread owns (condition 2), so these plain writes
    // race with no other poller.
    unsafe {
        (*cq).status = e.status;
        (*cq).wr_id = e.wr_id;
    }
    true
}

/// `start_poll`; `LOCK` is false for CQs created single-threaded.
///
/// # Safety
/// The verbs contract (module docs): `cq` is a live extended CQ of ours.
unsafe extern "C" fn start_poll<const LOCK: bool>(
    cq: *mut ibv::ibv_cq_ex,
    _attr: *mut ibv::ibv_poll_cq_attr,
) -> c_int {
    // SAFETY: caller contract: `cq` is live for this call.
    let s = unsafe { sv_ex(cq) };
    if s.dead() {
        // Like ENOENT, an error is not followed by end_poll: no lock held.
        return DEAD_ERRNO;
    }
    s.progress_waiting();
    if LOCK {
        s.iter.lock();
    }
    // SAFETY: 1. caller contract; 2. this thread now owns the iteration: it
    // took the lock just above, or (without LOCK) the CQ was created
    // single-threaded and the application promised one polling thread.
    if unsafe { take(cq) } {
        return 0;
    }
    if LOCK {
        // SAFETY: taken above on this thread; released here because no
        // end_poll follows ENOENT (cq_iter step 3).
        unsafe { s.iter.unlock() };
    }
    s.empty_poll();
    libc::ENOENT
}

/// `next_poll`: keeps the lock whatever it answers (`cq_iter` step 4).
///
/// # Safety
/// The verbs contract (module docs): called by the thread whose
/// `start_poll` on `cq` succeeded, before its `end_poll`.
unsafe extern "C" fn next_poll(cq: *mut ibv::ibv_cq_ex) -> c_int {
    // SAFETY: caller contract: `cq` is live.
    if unsafe { sv_ex(cq) }.dead() {
        return DEAD_ERRNO;
    }
    // SAFETY: 1. caller contract: `cq` is live; 2. this thread owns the
    // iteration since its successful start_poll (lock held, or a
    // single-threaded CQ).
    if unsafe { take(cq) } {
        return 0;
    }
    // SAFETY: caller contract: `cq` is live.
    unsafe { sv_ex(cq) }.empty_poll();
    libc::ENOENT
}

/// `end_poll`; `LOCK` as for [`start_poll`].
///
/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn end_poll<const LOCK: bool>(cq: *mut ibv::ibv_cq_ex) {
    if LOCK {
        // SAFETY: 1. caller contract: `cq` is live; 2. the successful
        // start_poll this call ends took the lock, and only this end_poll
        // releases it (cq_iter step 4).
        unsafe { sv_ex(cq).iter.unlock() };
    }
}

/// The current completion, for the `read_*` callbacks.
///
/// # Safety
/// As [`next_poll`].
unsafe fn current(cq: *mut ibv::ibv_cq_ex) -> crate::shm::layout::Cqe {
    // SAFETY: 1. caller contract: `cq` is live; 2. the verbs contract lets
    // only the thread that owns the iteration call read_* (cq_iter step 2).
    unsafe { sv_ex(cq).iter.current() }
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_opcode(cq: *mut ibv::ibv_cq_ex) -> ibv::ibv_wc_opcode::Type {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.opcode
}

/// # Safety
/// Any argument (nothing is read).
unsafe extern "C" fn read_vendor_err(_cq: *mut ibv::ibv_cq_ex) -> u32 {
    0
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_byte_len(cq: *mut ibv::ibv_cq_ex) -> u32 {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.byte_len
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_imm_data(cq: *mut ibv::ibv_cq_ex) -> ibv::__be32 {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.imm
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_qp_num(cq: *mut ibv::ibv_cq_ex) -> u32 {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.qp_num
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_src_qp(cq: *mut ibv::ibv_cq_ex) -> u32 {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.src_qp
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_wc_flags(cq: *mut ibv::ibv_cq_ex) -> c_uint {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.wc_flags
}

/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_sl(cq: *mut ibv::ibv_cq_ex) -> u8 {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.sl as u8
}

/// # Safety
/// Any argument (nothing is read).
unsafe extern "C" fn read_slid(_cq: *mut ibv::ibv_cq_ex) -> u32 {
    1
}

/// # Safety
/// Any argument (nothing is read).
unsafe extern "C" fn read_zero_u8(_cq: *mut ibv::ibv_cq_ex) -> u8 {
    0
}

/// The device clock when the completion was added (provider::clock).
///
/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_completion_ts(cq: *mut ibv::ibv_cq_ex) -> u64 {
    // SAFETY: caller contract, which is current's.
    unsafe { current(cq) }.ts
}

/// The same instant in real time, nanoseconds since the epoch.
///
/// # Safety
/// As [`next_poll`].
unsafe extern "C" fn read_completion_wallclock_ns(cq: *mut ibv::ibv_cq_ex) -> u64 {
    // SAFETY: caller contract, which is current's.
    super::clock::wallclock_ns(unsafe { current(cq) }.ts)
}

/// `create_cq_ex`.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid.
pub unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_cq_init_attr_ex,
) -> *mut ibv::ibv_cq_ex {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return super::dead();
    }
    // SAFETY: caller contract.
    let a = unsafe { &*attr };
    let flags_ok = a.comp_mask & !(MASK_FLAGS | MASK_PD) == 0
        && (a.comp_mask & MASK_FLAGS == 0 || a.flags & !SINGLE_THREADED == 0);
    if a.wc_flags & !SUPPORTED_WC_FLAGS != 0 || !flags_ok {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    // A CQ may name the parent domain it belongs to (it must be one, of
    // this context); a CQ needs nothing from it here.
    let pd = a.parent_domain;
    // SAFETY: a non-null parent_domain the caller passes is a live PD, and
    // a PD of this context is one of ours.
    let pd_ok =
        !pd.is_null() && unsafe { (*pd).context == ctx && super::context::is_parent_domain(pd) };
    if a.comp_mask & MASK_PD != 0 && !pd_ok {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let (Ok(cqe), Ok(vector)) = (c_int::try_from(a.cqe), c_int::try_from(a.comp_vector)) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let stamp = a.wc_flags & (WITH_COMPLETION_TIMESTAMP | WITH_COMPLETION_TIMESTAMP_WALLCLOCK) != 0;
    // SAFETY: caller contract.
    let raw = unsafe { make_cq(ctx, cqe, a.channel, vector, stamp) };
    if raw.is_null() {
        return std::ptr::null_mut();
    }
    // Without the flag, pollers may share the CQ: lock each iteration.
    let single = a.comp_mask & MASK_FLAGS != 0 && a.flags & SINGLE_THREADED != 0;
    // SAFETY: `raw` is the live box just made, unknown to other threads
    // until we return it; filling the iterator slots.
    unsafe {
        (*raw).locked = !single;
        let c = &mut (*raw).cq;
        if single {
            c.start_poll = Some(start_poll::<false>);
            c.end_poll = Some(end_poll::<false>);
        } else {
            c.start_poll = Some(start_poll::<true>);
            c.end_poll = Some(end_poll::<true>);
        }
        c.next_poll = Some(next_poll);
        c.read_opcode = Some(read_opcode);
        c.read_vendor_err = Some(read_vendor_err);
        c.read_byte_len = Some(read_byte_len);
        c.read_imm_data = Some(read_imm_data);
        c.read_qp_num = Some(read_qp_num);
        c.read_src_qp = Some(read_src_qp);
        c.read_wc_flags = Some(read_wc_flags);
        c.read_slid = Some(read_slid);
        c.read_sl = Some(read_sl);
        c.read_dlid_path_bits = Some(read_zero_u8);
        c.read_completion_ts = Some(read_completion_ts);
        c.read_completion_wallclock_ns = Some(read_completion_wallclock_ns);
        std::ptr::addr_of_mut!((*raw).cq)
    }
}
