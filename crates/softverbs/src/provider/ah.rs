//! Address handles (`ibv_create_ah` / `ibv_destroy_ah`): what a UD send
//! takes from its destination's path (model::ud).

use std::ffi::c_int;
use std::sync::atomic::Ordering;

use super::context::inner;
use super::context::limits::MAX_AH;
use super::set_errno;
use crate::model::ud::AhInfo;
use crate::sys::ibv;

/// An address handle.
#[repr(C)]
pub struct SvAh {
    /// The libibverbs part (libibverbs fills `context` and `pd`).
    pub ah: ibv::ibv_ah,
    /// The attributes a UD send uses.
    pub info: AhInfo,
}

/// `create_ah`: one port (1), one GID (index 0); anything else is EINVAL,
/// as the kernel answers for a port or GID index the device lacks. A
/// context holds at most [`MAX_AH`] address handles (`max_ah`); one more
/// is ENOMEM until one is destroyed.
///
/// # Safety
/// `pd` is a PD of this provider; `attr` is a valid attribute block.
pub unsafe extern "C" fn create_ah(
    pd: *mut ibv::ibv_pd,
    attr: *mut ibv::ibv_ah_attr,
) -> *mut ibv::ibv_ah {
    // SAFETY: caller contract.
    let (a, ctx) = unsafe { (&*attr, (*pd).context) };
    // SAFETY: `ctx` is a live softverbs context (caller contract).
    let c = unsafe { inner(ctx) };
    if c.dead() {
        return super::dead();
    }
    if a.port_num != 1 || (a.is_global != 0 && a.grh.sgid_index != 0) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    if c.ahs
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
            (n < MAX_AH).then_some(n + 1)
        })
        .is_err()
    {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    let info = AhInfo {
        dlid: a.dlid,
        sl: a.sl,
        is_global: a.is_global != 0,
        // SAFETY: `raw` is the plain 16-byte arm of the GID union.
        dgid: unsafe { a.grh.dgid.raw },
        flow_label: a.grh.flow_label,
        sgid_index: a.grh.sgid_index,
        hop_limit: a.grh.hop_limit,
        traffic_class: a.grh.traffic_class,
    };
    let ah = Box::new(SvAh {
        ah: ibv::ibv_ah {
            context: ctx,
            pd,
            handle: 0,
        },
        info,
    });
    Box::into_raw(ah).cast()
}

/// `destroy_ah`: frees the handle and its place in the context's count.
///
/// # Safety
/// `ah` was made by [`create_ah`]; not used afterwards.
pub unsafe extern "C" fn destroy_ah(ah: *mut ibv::ibv_ah) -> c_int {
    // SAFETY: caller contract: `ah` heads a boxed SvAh, last use.
    let ah = unsafe { Box::from_raw(ah.cast::<SvAh>()) };
    // SAFETY: create_ah stored its live context, which outlives its AHs
    // (verbs rule: destroy them before closing it).
    unsafe { inner(ah.ah.context) }
        .ahs
        .fetch_sub(1, Ordering::AcqRel);
    0
}

/// The attributes of an AH of this provider.
///
/// # Safety
/// `ah` was made by [`create_ah`] and is live.
pub unsafe fn info(ah: *mut ibv::ibv_ah) -> AhInfo {
    // SAFETY: caller contract.
    unsafe { (*ah.cast::<SvAh>()).info }
}

crate::opaque_debug!(SvAh);
