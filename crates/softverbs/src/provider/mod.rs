//! The libibverbs provider: registration, the device and context, and the
//! verbs. Each `extern "C" fn` here is an entry of the ops tables libibverbs
//! calls; they never unwind (a panic would abort: `extern "C"` functions do)
//! and report failures as errno values, as the verbs ABI wants.

pub mod ah;
pub mod channel;
pub mod clock;
pub mod context;
pub mod cq;
pub mod cq_ex;
pub mod cq_iter;
pub mod dm;
pub mod events;
pub mod fatal;
pub mod mcast;
pub mod mw;
pub mod notify;
pub mod progress;
pub mod purge;
pub mod qp;
pub mod qp_ex;
pub mod remote;
pub mod send;
pub mod srq;
pub mod xfer;
pub mod xrc;

use std::ffi::c_void;
use std::mem::offset_of;
use std::sync::Mutex;

use crate::sys::abi::{
    VerbsContextOps, VerbsDevice, VerbsDeviceOps, VerbsMatchEnt, VerbsSysfsDev,
    VERBS_MATCH_MODALIAS, VERBS_MATCH_SENTINEL,
};
use crate::sys::private::{cstr, private, warn};

/// The device name prefix the launcher's sysfs tree uses.
pub const DEVICE_NAME: &str = "softverbs0";

static MATCH: [VerbsMatchEnt; 2] = [
    VerbsMatchEnt {
        driver_data: std::ptr::null(),
        modalias: cstr(c"rdma_device:*Nsoftverbs*"),
        vendor: 0,
        device: 0,
        kind: VERBS_MATCH_MODALIAS,
    },
    VerbsMatchEnt {
        driver_data: std::ptr::null(),
        modalias: std::ptr::null(),
        vendor: 0,
        device: 0,
        kind: VERBS_MATCH_SENTINEL,
    },
];

/// The device ops table handed to `verbs_register_driver_34`.
pub static DEVICE_OPS: VerbsDeviceOps = VerbsDeviceOps {
    name: cstr(c"softverbs"),
    match_min_abi_version: 0,
    match_max_abi_version: u32::MAX,
    match_table: MATCH.as_ptr(),
    static_providers: std::ptr::null(),
    match_device: None,
    alloc_context: Some(context::alloc_context),
    import_context: None,
    alloc_device: Some(alloc_device),
    uninit_device: Some(uninit_device),
};

/// The context ops table installed with `verbs_set_ops`.
pub static CONTEXT_OPS: VerbsContextOps = VerbsContextOps {
    advise_mr: Some(context::advise_mr),
    alloc_dm: Some(dm::alloc_dm),
    alloc_mw: Some(mw::alloc_mw),
    alloc_parent_domain: Some(context::alloc_parent_domain),
    alloc_td: Some(context::alloc_td),
    dealloc_td: Some(context::dealloc_td),
    bind_mw: Some(mw::bind_mw),
    dealloc_mw: Some(mw::dealloc_mw),
    free_dm: Some(dm::free_dm),
    reg_dm_mr: Some(dm::reg_dm_mr),
    create_qp_ex: Some(qp_ex::create_qp_ex),
    close_xrcd: Some(xrc::close_xrcd),
    create_srq_ex: Some(xrc::create_srq_ex),
    get_srq_num: Some(xrc::get_srq_num),
    open_xrcd: Some(xrc::open_xrcd),
    rereg_mr: Some(context::rereg_mr),
    resize_cq: Some(cq::resize_cq),
    alloc_pd: Some(context::alloc_pd),
    async_event: Some(context::async_event),
    cq_event: Some(cq::cq_event),
    create_ah: Some(ah::create_ah),
    create_cq: Some(cq::create_cq),
    create_cq_ex: Some(cq_ex::create_cq_ex),
    create_qp: Some(qp::create_qp),
    create_srq: Some(srq::create_srq),
    dealloc_pd: Some(context::dealloc_pd),
    dereg_mr: Some(context::dereg_mr),
    attach_mcast: Some(mcast::attach_mcast),
    destroy_ah: Some(ah::destroy_ah),
    destroy_cq: Some(cq::destroy_cq),
    destroy_qp: Some(qp::destroy_qp),
    destroy_srq: Some(srq::destroy_srq),
    detach_mcast: Some(mcast::detach_mcast),
    free_context: Some(context::free_context),
    modify_qp: Some(qp::modify_qp),
    modify_srq: Some(srq::modify_srq),
    poll_cq: Some(cq::poll_cq),
    post_recv: Some(qp::post_recv),
    post_send: Some(send::post_send),
    post_srq_recv: Some(srq::post_srq_recv),
    query_device_ex: Some(context::query_device_ex),
    query_port: Some(context::query_port),
    query_rt_values: Some(context::query_rt_values),
    query_qp: Some(qp::query_qp),
    query_srq: Some(srq::query_srq),
    reg_mr: Some(context::reg_mr),
    req_notify_cq: Some(cq::req_notify_cq),
    ..EMPTY_OPS
};

const EMPTY_OPS: VerbsContextOps = VerbsContextOps {
    advise_mr: None,
    alloc_dm: None,
    alloc_mw: None,
    alloc_null_mr: None,
    alloc_parent_domain: None,
    alloc_pd: None,
    alloc_td: None,
    async_event: None,
    attach_counters_point_flow: None,
    attach_mcast: None,
    bind_mw: None,
    close_xrcd: None,
    cq_event: None,
    create_ah: None,
    create_counters: None,
    create_cq: None,
    create_cq_ex: None,
    create_flow: None,
    create_flow_action_esp: None,
    create_qp: None,
    create_qp_ex: None,
    create_rwq_ind_table: None,
    create_srq: None,
    create_srq_ex: None,
    create_wq: None,
    dealloc_mw: None,
    dealloc_pd: None,
    dealloc_td: None,
    dereg_mr: None,
    destroy_ah: None,
    destroy_counters: None,
    destroy_cq: None,
    destroy_flow: None,
    destroy_flow_action: None,
    destroy_qp: None,
    destroy_rwq_ind_table: None,
    destroy_srq: None,
    destroy_wq: None,
    detach_mcast: None,
    free_context: None,
    free_dm: None,
    get_srq_num: None,
    import_dm: None,
    import_mr: None,
    import_pd: None,
    modify_cq: None,
    modify_flow_action_esp: None,
    modify_qp: None,
    modify_qp_rate_limit: None,
    modify_srq: None,
    modify_wq: None,
    open_qp: None,
    open_xrcd: None,
    poll_cq: None,
    post_recv: None,
    post_send: None,
    post_srq_ops: None,
    post_srq_recv: None,
    query_device_ex: None,
    query_ece: None,
    query_port: None,
    query_qp: None,
    query_qp_data_in_order: None,
    query_rt_values: None,
    query_srq: None,
    read_counters: None,
    reg_dm_mr: None,
    reg_dmabuf_mr: None,
    reg_mr: None,
    req_notify_cq: None,
    rereg_mr: None,
    resize_cq: None,
    set_ece: None,
    unimport_dm: None,
    unimport_mr: None,
    unimport_pd: None,
};

unsafe extern "C" fn alloc_device(_sysfs: *mut VerbsSysfsDev) -> *mut VerbsDevice {
    // SAFETY: VerbsDevice is plain C data (integers, arrays, pointers), for
    // which all-zero is valid; libibverbs fills the rest (try_driver).
    let dev: Box<VerbsDevice> = Box::new(unsafe { std::mem::zeroed() });
    Box::into_raw(dev)
}

unsafe extern "C" fn uninit_device(dev: *mut VerbsDevice) {
    if !dev.is_null() {
        // SAFETY: `dev` was made by Box::into_raw in alloc_device and
        // libibverbs calls uninit_device once, as the last use.
        drop(unsafe { Box::from_raw(dev) });
    }
}

/// The load-time constructor's body: have libibverbs know the device.
///
/// Two copies of this library can be in a process started by the launcher
/// (docs/softverbs.md, "How libibverbs finds the device"): the preloaded one,
/// in the global scope, whose `ibv_create_comp_channel` programs call and
/// which therefore must own the contexts; and the one libibverbs `dlopen`s
/// from `RDMAV_DRIVERS` when it loads its providers. The copy the global
/// scope resolves [`softverbs_register`] to is the one registered: the
/// driver copy's constructor hands over to the preloaded copy, and
/// registers itself only when nothing is preloaded.
pub fn register() {
    let mine = softverbs_register as extern "C" fn() as *mut c_void;
    // SAFETY: a valid C string; RTLD_DEFAULT is a valid pseudo-handle.
    let global = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"softverbs_register".as_ptr()) };
    if global.is_null() || global == mine {
        softverbs_register();
    } else {
        // SAFETY: the global scope's `softverbs_register` is this very
        // function in the preloaded copy of this library (same build, the
        // launcher copies one file twice), of this type.
        let f = unsafe { std::mem::transmute::<*mut c_void, extern "C" fn()>(global) };
        f();
    }
}

/// Register this copy's provider with libibverbs, once per process.
///
/// Silent while libibverbs is not loaded (the library is also preloaded
/// into every program the launcher starts, most of which never load it:
/// a later load registers through the driver copy's constructor, see
/// [`register`]); loud when libibverbs is there but lacks the private ABI
/// this build needs. libibverbs is found by handle, not in the global
/// scope, so that a libibverbs `dlopen`ed `RTLD_LOCAL` is found too.
#[no_mangle]
pub extern "C" fn softverbs_register() {
    static REGISTERED: Mutex<bool> = Mutex::new(false);
    let mut done = REGISTERED.lock().unwrap_or_else(|e| e.into_inner());
    if *done || !crate::sys::private::libibverbs_loaded() {
        return;
    }
    *done = true;
    match private() {
        // SAFETY: DEVICE_OPS is a 'static table laid out as v44's
        // verbs_device_ops, and register_driver is verbs_register_driver_34
        // (which keeps the pointer in its driver list: it must be
        // registered once, hence the flag).
        Ok(p) => unsafe { (p.register_driver)(&DEVICE_OPS) },
        Err(e) => warn(&format!("not registering the softverbs device: {e}")),
    }
}

/// Byte offset of `ibv_context` inside `verbs_context`.
pub const CTX_OFFSET: usize = offset_of!(crate::sys::ibv::verbs_context, context);

/// Set `*bad` to `v` if `bad` is non-null.
///
/// # Safety
/// `bad` is null or valid for a pointer-sized write.
pub unsafe fn set_bad<T>(bad: *mut *mut T, v: *mut T) {
    if !bad.is_null() {
        // SAFETY: non-null and writable per the contract.
        unsafe { *bad = v };
    }
}

/// `EIO` and `errno` for a creation verb on a dead context
/// (model::device), null to return.
pub fn dead<T>() -> *mut T {
    set_errno(crate::model::device::DEAD_ERRNO);
    std::ptr::null_mut()
}

/// Set errno (for verbs that return NULL).
pub fn set_errno(e: i32) {
    // SAFETY: __errno_location always returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// A null `*mut c_void` for brevity.
pub fn null() -> *mut c_void {
    std::ptr::null_mut()
}
