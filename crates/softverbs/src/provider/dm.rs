//! Device memory: `ibv_alloc_dm`, `ibv_memcpy_to_dm` / `ibv_memcpy_from_dm`,
//! `ibv_free_dm` and `ibv_reg_dm_mr` (rules in [`crate::model::mr::dm`]).
//!
//! The memory is an anonymous private mapping of the process that
//! allocated it; the device reaches it as any memory of that process
//! (same process: pointers; a peer: `process_vm_readv`/`writev`), the host
//! program only through the two copy verbs.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicU32, Ordering};

use super::context::{inner, pd_id, publish_mr, ContextInner};
use super::qp::fail as fail_null;
use crate::model::mr::dm;
use crate::shm::layout::MrInfo;
use crate::sys::ibv;

/// A device-memory allocation.
#[repr(C)]
pub struct SvDm {
    /// The libibverbs part.
    pub dm: ibv::ibv_dm,
    ctx: *const ContextInner,
    base: *mut u8,
    len: u64,
    map_len: usize,
    /// Regions registered on it (`ibv_free_dm` answers EBUSY meanwhile).
    pub users: AtomicU32,
}

impl std::fmt::Debug for SvDm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvDm").field("len", &self.len).finish()
    }
}

/// `alloc_dm`.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid.
pub unsafe extern "C" fn alloc_dm(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_alloc_dm_attr,
) -> *mut ibv::ibv_dm {
    // SAFETY: caller contract.
    let c = unsafe { inner(ctx) };
    if c.dead() {
        return super::dead();
    }
    if attr.is_null() {
        return fail_null(libc::EINVAL);
    }
    // SAFETY: caller contract.
    let a = unsafe { &*attr };
    let len = a.length as u64;
    let mut used = c.dm_used.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(e) = dm::alloc_error(len, a.log_align_req, a.comp_mask, *used) {
        return fail_null(e);
    }
    let map_len = (a.length + 4095) & !4095;
    // SAFETY: a fresh anonymous mapping; no existing memory is affected.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return fail_null(libc::ENOMEM);
    }
    *used += len;
    let d = Box::new(SvDm {
        dm: ibv::ibv_dm {
            context: ctx,
            memcpy_to_dm: Some(memcpy_to_dm),
            memcpy_from_dm: Some(memcpy_from_dm),
            comp_mask: 0,
            handle: 0,
        },
        ctx: c,
        base: base.cast(),
        len,
        map_len,
        users: AtomicU32::new(0),
    });
    Box::into_raw(d).cast()
}

/// `free_dm`: EBUSY while a region is registered on it.
///
/// # Safety
/// `d` was made by [`alloc_dm`]; on success it is not used afterwards.
pub unsafe extern "C" fn free_dm(d: *mut ibv::ibv_dm) -> c_int {
    // SAFETY: `d` heads a live boxed SvDm (caller contract).
    let s = unsafe { &*d.cast::<SvDm>() };
    if s.users.load(Ordering::Acquire) != 0 {
        return libc::EBUSY;
    }
    // SAFETY: the context outlives its device memory (verbs rule).
    let c = unsafe { &*s.ctx };
    *c.dm_used.lock().unwrap_or_else(|e| e.into_inner()) -= s.len;
    // SAFETY: the mapping made by alloc_dm, no region uses it any more.
    unsafe { libc::munmap(s.base.cast(), s.map_len) };
    // SAFETY: last use of the box (caller contract).
    drop(unsafe { Box::from_raw(d.cast::<SvDm>()) });
    0
}

unsafe extern "C" fn memcpy_to_dm(
    d: *mut ibv::ibv_dm,
    offset: u64,
    host: *const c_void,
    len: usize,
) -> c_int {
    // SAFETY: libibverbs passes one of our live DMs.
    let s = unsafe { &*d.cast::<SvDm>() };
    if let Some(e) = dm::copy_error(s.len, offset, len as u64) {
        return e;
    }
    if len > 0 {
        // SAFETY: the range is inside the mapping (checked); `host` is the
        // caller's readable buffer of `len` bytes (ibv_memcpy_to_dm(3)).
        unsafe { std::ptr::copy(host.cast::<u8>(), s.base.add(offset as usize), len) };
    }
    0
}

unsafe extern "C" fn memcpy_from_dm(
    host: *mut c_void,
    d: *mut ibv::ibv_dm,
    offset: u64,
    len: usize,
) -> c_int {
    // SAFETY: libibverbs passes one of our live DMs.
    let s = unsafe { &*d.cast::<SvDm>() };
    if let Some(e) = dm::copy_error(s.len, offset, len as u64) {
        return e;
    }
    if len > 0 {
        // SAFETY: as memcpy_to_dm, the other way.
        unsafe { std::ptr::copy(s.base.add(offset as usize), host.cast::<u8>(), len) };
    }
    0
}

/// `reg_dm_mr`: a zero-based region over `len` bytes at `offset` of the
/// device memory (its users name the first byte 0; `mr->addr` is 0).
///
/// # Safety
/// `pd` is a PD and `d` a device memory of this provider.
pub unsafe extern "C" fn reg_dm_mr(
    pd: *mut ibv::ibv_pd,
    d: *mut ibv::ibv_dm,
    offset: u64,
    len: usize,
    access: u32,
) -> *mut ibv::ibv_mr {
    // SAFETY: caller contract.
    let (c, pdid) = unsafe { (inner((*pd).context), pd_id(pd)) };
    if c.dead() {
        return super::dead();
    }
    // SAFETY: caller contract.
    let s = unsafe { &*d.cast::<SvDm>() };
    if !std::ptr::eq(s.ctx, c) {
        return fail_null(libc::EINVAL);
    }
    if let Some(e) = dm::reg_error(s.len, offset, len as u64, access) {
        return fail_null(e);
    }
    // SAFETY: offset + len lies inside the mapping (checked).
    let at = unsafe { s.base.add(offset as usize) } as u64;
    let info = MrInfo {
        iova: 0,
        ..MrInfo::at(pdid, access, at, len as u64)
    };
    s.users.fetch_add(1, Ordering::AcqRel);
    let mr = publish_mr(c, info, s);
    if mr.is_null() {
        s.users.fetch_sub(1, Ordering::AcqRel);
        return mr;
    }
    // SAFETY: the fresh MR; libibverbs fills nothing for ibv_reg_dm_mr.
    unsafe {
        (*mr).context = (*pd).context;
        (*mr).pd = pd;
        (*mr).addr = std::ptr::null_mut();
        (*mr).length = len;
    }
    mr
}
