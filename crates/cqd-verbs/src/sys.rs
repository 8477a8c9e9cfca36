//! Every call into libibverbs, in one place.
//!
//! The rest of the crate never touches a raw pointer of libibverbs except
//! through these functions. Each is `unsafe` with its contract in its
//! `# Safety` section: the objects passed in are live objects this process
//! created (or adopted under [`crate::adopt`]'s contract) and not yet
//! destroyed. Failures come back as `io::Error` from `errno` (or from the
//! returned code, for the verbs that return it), never a panic.
//!
//! rdma-sys's inline helpers (`ibv_poll_cq`, `ibv_post_send` …) call
//! `Option::unwrap` on the context's function table; these wrappers check
//! the slot instead, so a provider that lacks a verb is an error, not a
//! panic. rdma-sys 0.3's helpers for the extended verbs are broken on
//! 64-bit (their `verbs_get_ctx` compares `abi_compat` with `u32::MAX`);
//! [`create_cq_ex`] reads the `verbs_context` slot itself.

use std::ffi::CStr;
use std::io;
use std::ptr::{null_mut, NonNull};

pub(crate) use rdma_sys::{
    ibv_access_flags, ibv_ah, ibv_ah_attr, ibv_async_event, ibv_comp_channel, ibv_context, ibv_cq,
    ibv_cq_init_attr_ex, ibv_device_attr, ibv_gid, ibv_mr, ibv_mw, ibv_mw_type, ibv_pd,
    ibv_port_attr, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask, ibv_qp_init_attr, ibv_qp_state,
    ibv_qp_type, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_srq, ibv_srq_init_attr,
    ibv_wc, ibv_wr_opcode, verbs_context,
};

/// The last OS error (libibverbs sets `errno`); `fallback` when `errno` is
/// 0 (some providers return NULL without setting it).
fn last_error(fallback: i32) -> io::Error {
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(0) | None => io::Error::from_raw_os_error(fallback),
        Some(_) => e,
    }
}

/// An error from a verb that returns its errno (0 on success); a negative
/// return is treated as `-errno`, and `-1` as "see errno".
fn from_ret(ret: i32) -> io::Result<()> {
    match ret {
        0 => Ok(()),
        -1 => Err(last_error(libc::EIO)),
        r if r < 0 => Err(io::Error::from_raw_os_error(-r)),
        r => Err(io::Error::from_raw_os_error(r)),
    }
}

/// A device of the list: its name and whether it could be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceName {
    /// `ibv_get_device_name`.
    pub name: String,
    /// The node GUID, host order.
    pub guid: u64,
}

/// The names of the RDMA devices libibverbs sees.
///
/// # Errors
/// `ibv_get_device_list` failed (no libibverbs support in the kernel:
/// `ENOSYS`; no permission …).
pub(crate) fn device_names() -> io::Result<Vec<DeviceName>> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { rdma_sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(last_error(libc::ENODEV));
    }
    let mut out = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until freed.
        let dev = unsafe { *list.add(i) };
        out.push(DeviceName {
            // SAFETY: `dev` is a listed device; the name is a C string it owns.
            name: unsafe { name_of(dev) },
            // SAFETY: as above.
            guid: u64::from_be(unsafe { rdma_sys::ibv_get_device_guid(dev) }),
        });
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { rdma_sys::ibv_free_device_list(list) };
    Ok(out)
}

/// # Safety
/// `dev` is a device of a list not yet freed.
unsafe fn name_of(dev: *mut rdma_sys::ibv_device) -> String {
    // SAFETY: the caller's contract.
    let p = unsafe { rdma_sys::ibv_get_device_name(dev) };
    if p.is_null() {
        return String::new();
    }
    // SAFETY: a non-null name is a NUL-terminated string owned by the device.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Why a device could not be opened.
#[derive(Debug)]
pub(crate) enum OpenFailure {
    /// The device list could not be read.
    List(io::Error),
    /// No device of that name (or none at all); the names seen.
    NotFound(Vec<String>),
    /// `ibv_open_device` failed.
    Open(String, io::Error),
}

/// An opened device: its context, its name and its directory in sysfs
/// (`ibv_device::ibdev_path`, `/sys/class/infiniband/<name>`).
pub(crate) struct Opened {
    pub(crate) ctx: NonNull<ibv_context>,
    pub(crate) name: String,
    pub(crate) sysfs: std::path::PathBuf,
}

/// # Safety
/// `dev` is a device of a live list.
unsafe fn ibdev_path_of(dev: *mut rdma_sys::ibv_device) -> std::path::PathBuf {
    // SAFETY: the caller's contract; `ibdev_path` is a NUL-terminated
    // array libibverbs filled from sysfs when it listed the device.
    let raw = unsafe { &(*dev).ibdev_path };
    let bytes: Vec<u8> = raw
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    use std::os::unix::ffi::OsStringExt;
    std::path::PathBuf::from(std::ffi::OsString::from_vec(bytes))
}

/// Opens the device called `name` (the first device if `None`).
pub(crate) fn open_device(name: Option<&str>) -> Result<Opened, OpenFailure> {
    let mut n = 0;
    // SAFETY: `n` is a valid out-pointer; the list is freed below.
    let list = unsafe { rdma_sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(OpenFailure::List(last_error(libc::ENODEV)));
    }
    let mut seen = Vec::new();
    let mut result = None;
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers until freed.
        let dev = unsafe { *list.add(i) };
        // SAFETY: `dev` is a listed device.
        let dev_name = unsafe { name_of(dev) };
        if name.is_none_or(|want| want == dev_name) {
            // SAFETY: `dev` is a listed device; the context outlives the
            // list (libibverbs keeps a reference on the device).
            let ctx = unsafe { rdma_sys::ibv_open_device(dev) };
            // SAFETY: `dev` is a listed device.
            let sysfs = unsafe { ibdev_path_of(dev) };
            result = Some(match NonNull::new(ctx) {
                Some(ctx) => Ok(Opened {
                    ctx,
                    name: dev_name,
                    sysfs,
                }),
                None => Err(OpenFailure::Open(dev_name, last_error(libc::ENODEV))),
            });
            break;
        }
        seen.push(dev_name);
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { rdma_sys::ibv_free_device_list(list) };
    result.unwrap_or(Err(OpenFailure::NotFound(seen)))
}

/// # Safety
/// `ctx` is open and every object made on it is destroyed.
pub(crate) unsafe fn close_device(ctx: NonNull<ibv_context>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_close_device(ctx.as_ptr()) })
}

/// # Safety
/// `ctx` is open.
pub(crate) unsafe fn query_device(ctx: NonNull<ibv_context>) -> io::Result<ibv_device_attr> {
    // SAFETY: plain C data; all-zero is a valid value.
    let mut attr: ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's contract; `attr` is a valid out-pointer.
    from_ret(unsafe { rdma_sys::ibv_query_device(ctx.as_ptr(), &mut attr) })?;
    Ok(attr)
}

/// # Safety
/// `ctx` is open.
pub(crate) unsafe fn query_port(ctx: NonNull<ibv_context>, port: u8) -> io::Result<ibv_port_attr> {
    // SAFETY: plain C data; all-zero is a valid value.
    let mut attr: ibv_port_attr = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's contract; `attr` is a valid out-pointer of the
    // size of the compat structure the exported symbol fills.
    from_ret(unsafe { rdma_sys::ibv_query_port(ctx.as_ptr(), port, (&raw mut attr).cast()) })?;
    Ok(attr)
}

/// # Safety
/// `ctx` is open.
pub(crate) unsafe fn query_gid(
    ctx: NonNull<ibv_context>,
    port: u8,
    index: i32,
) -> io::Result<[u8; 16]> {
    // SAFETY: plain C data; all-zero is a valid value.
    let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's contract; `gid` is a valid out-pointer.
    from_ret(unsafe { rdma_sys::ibv_query_gid(ctx.as_ptr(), port, index, &mut gid) })?;
    // SAFETY: every bit pattern of the union is a valid `[u8; 16]`.
    Ok(unsafe { gid.raw })
}

/// # Safety
/// `ctx` is open.
pub(crate) unsafe fn alloc_pd(ctx: NonNull<ibv_context>) -> io::Result<NonNull<ibv_pd>> {
    // SAFETY: the caller's contract.
    NonNull::new(unsafe { rdma_sys::ibv_alloc_pd(ctx.as_ptr()) })
        .ok_or_else(|| last_error(libc::ENOMEM))
}

/// # Safety
/// `pd` is live; `attr` names a port of its device.
pub(crate) unsafe fn create_ah(
    pd: NonNull<ibv_pd>,
    attr: &mut ibv_ah_attr,
) -> io::Result<NonNull<ibv_ah>> {
    // SAFETY: the caller's contract; `attr` is a valid pointer for the
    // call (libibverbs reads it and keeps no reference).
    NonNull::new(unsafe { rdma_sys::ibv_create_ah(pd.as_ptr(), attr) })
        .ok_or_else(|| last_error(libc::EINVAL))
}

/// # Safety
/// `ah` is live and no posted send that names it is still outstanding.
pub(crate) unsafe fn destroy_ah(ah: NonNull<ibv_ah>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_destroy_ah(ah.as_ptr()) })
}

/// # Safety
/// `pd` is live and has no objects left.
pub(crate) unsafe fn dealloc_pd(pd: NonNull<ibv_pd>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_dealloc_pd(pd.as_ptr()) })
}

/// # Safety
/// `pd` is live; `addr..addr+len` stays allocated until [`dereg_mr`].
pub(crate) unsafe fn reg_mr(
    pd: NonNull<ibv_pd>,
    addr: *mut u8,
    len: usize,
    access: u32,
) -> io::Result<NonNull<ibv_mr>> {
    // SAFETY: the caller's contract.
    let mr = unsafe { rdma_sys::ibv_reg_mr(pd.as_ptr(), addr.cast(), len, access as i32) };
    NonNull::new(mr).ok_or_else(|| last_error(libc::EINVAL))
}

/// A type-2 memory window of `pd` (`ibv_alloc_mw`).
///
/// # Safety
/// `pd` is live.
pub(crate) unsafe fn alloc_mw_type2(pd: NonNull<ibv_pd>) -> io::Result<NonNull<ibv_mw>> {
    // SAFETY: the caller's contract; the inline verb calls the provider's
    // op or sets EOPNOTSUPP.
    match unsafe { rdma_sys::ibv_alloc_mw(pd.as_ptr(), ibv_mw_type::IBV_MW_TYPE_2) } {
        Some(mw) => NonNull::new(mw).ok_or_else(|| last_error(libc::EOPNOTSUPP)),
        None => Err(last_error(libc::EOPNOTSUPP)),
    }
}

/// # Safety
/// `mw` is live and is not used again.
pub(crate) unsafe fn dealloc_mw(mw: NonNull<ibv_mw>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_dealloc_mw(mw.as_ptr()) })
}

/// # Safety
/// `mr` is live; no posted request uses it any more.
pub(crate) unsafe fn dereg_mr(mr: NonNull<ibv_mr>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_dereg_mr(mr.as_ptr()) })
}

/// Makes `fd` non-blocking.
fn set_nonblocking(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor number; a bad one is EBADF, not UB.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A completion channel with a non-blocking descriptor.
///
/// # Safety
/// `ctx` is open.
pub(crate) unsafe fn create_comp_channel(
    ctx: NonNull<ibv_context>,
) -> io::Result<NonNull<ibv_comp_channel>> {
    // SAFETY: the caller's contract.
    let ch = NonNull::new(unsafe { rdma_sys::ibv_create_comp_channel(ctx.as_ptr()) })
        .ok_or_else(|| last_error(libc::ENOMEM))?;
    // SAFETY: `ch` is live; `fd` is its descriptor.
    if let Err(e) = set_nonblocking(unsafe { ch.as_ref() }.fd) {
        // SAFETY: `ch` is live and has no CQ.
        unsafe { rdma_sys::ibv_destroy_comp_channel(ch.as_ptr()) };
        return Err(e);
    }
    Ok(ch)
}

/// # Safety
/// `ch` is live and no CQ uses it any more.
pub(crate) unsafe fn destroy_comp_channel(ch: NonNull<ibv_comp_channel>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_destroy_comp_channel(ch.as_ptr()) })
}

/// The channel's descriptor.
///
/// # Safety
/// `ch` is live.
pub(crate) unsafe fn channel_fd(ch: NonNull<ibv_comp_channel>) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { ch.as_ref() }.fd
}

/// Makes a descriptor non-blocking (the adoption path's channel, the
/// context's async descriptor).
pub(crate) fn make_nonblocking(fd: i32) -> io::Result<()> {
    set_nonblocking(fd)
}

/// How a CQ was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqFlavor {
    /// `ibv_create_cq_ex` with `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`: the
    /// provider takes no lock (cqd's single poller makes that sound).
    SingleThreaded,
    /// `ibv_create_cq`: the device refused the extended call.
    Plain,
    /// An application's CQ ([`crate::adopt`]).
    Adopted,
}

/// The `create_cq_ex` slot of the extended context, if the provider has
/// one.
///
/// # Safety
/// `ctx` is open.
unsafe fn create_cq_ex_slot(
    ctx: NonNull<ibv_context>,
) -> Option<
    unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut rdma_sys::ibv_cq_ex,
> {
    // SAFETY: the caller's contract: the context is readable.
    let compat = unsafe { ctx.as_ref() }.abi_compat as usize;
    // verbs.h: an extended context marks `abi_compat` with
    // `__VERBS_ABI_IS_EXTENDED`, i.e. `(void *)UINTPTR_MAX`.
    if compat != usize::MAX {
        return None;
    }
    let off = std::mem::offset_of!(verbs_context, context);
    // SAFETY: an extended context is the `context` member of a
    // `verbs_context` (verbs.h's `verbs_get_ctx`), so stepping back by its
    // offset stays inside that allocation.
    let vctx = unsafe { ctx.as_ptr().cast::<u8>().sub(off).cast::<verbs_context>() };
    // SAFETY: `vctx` points at the provider's verbs_context; `sz` says how
    // much of it exists (fields are added at the front, so a field exists
    // when `sz` reaches past its distance from the end).
    let sz = unsafe { (*vctx).sz };
    let from_end =
        std::mem::size_of::<verbs_context>() - std::mem::offset_of!(verbs_context, create_cq_ex);
    if sz < from_end {
        return None;
    }
    // SAFETY: the slot exists (checked above).
    unsafe { (*vctx).create_cq_ex }
}

/// `IBV_WC_EX_WITH_{BYTE_LEN, IMM, QP_NUM, SRC_QP, SLID, SL, DLID_PATH_BITS}`.
pub(crate) const IBV_WC_STANDARD_FLAGS: u32 = 0x7f;

/// Creates a CQ of at least `cqe` entries on `channel`: extended and
/// single-threaded where the device allows, else plain. `context` is the
/// `cq_context` given back by `ibv_get_cq_event`.
///
/// # Safety
/// `ctx` is open and `channel` is a live channel of it.
pub(crate) unsafe fn create_cq(
    ctx: NonNull<ibv_context>,
    cqe: u32,
    channel: NonNull<ibv_comp_channel>,
    context: usize,
    comp_vector: i32,
) -> io::Result<(NonNull<ibv_cq>, CqFlavor)> {
    let cqe_i = i32::try_from(cqe).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: the caller's contract.
    if let Some(f) = unsafe { create_cq_ex_slot(ctx) } {
        // SAFETY: plain C data; all-zero is a valid value.
        let mut attr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
        attr.cqe = cqe;
        attr.cq_context = context as *mut libc::c_void;
        attr.channel = channel.as_ptr();
        attr.comp_vector = comp_vector as u32;
        // verbs.h's IBV_WC_STANDARD_FLAGS: every field of `ibv_wc`.
        attr.wc_flags = u64::from(IBV_WC_STANDARD_FLAGS);
        attr.comp_mask = rdma_sys::ibv_cq_init_attr_mask::IBV_CQ_INIT_ATTR_MASK_FLAGS.0;
        attr.flags = rdma_sys::ibv_create_cq_attr_flags::IBV_CREATE_CQ_ATTR_SINGLE_THREADED.0;
        // SAFETY: the slot of this context, with a valid attribute block.
        let cqx = unsafe { f(ctx.as_ptr(), &mut attr) };
        if !cqx.is_null() {
            // verbs.h's `ibv_cq_ex_to_cq`: the extended CQ begins with the
            // members of `ibv_cq`.
            if let Some(cq) = NonNull::new(cqx.cast::<ibv_cq>()) {
                return Ok((cq, CqFlavor::SingleThreaded));
            }
        }
        let e = last_error(libc::EOPNOTSUPP);
        // A device that refuses the flag or the extended call: plain CQ.
        // Anything else (no memory, too many entries) is the answer.
        if !matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP | libc::ENOSYS | libc::EINVAL)
        ) {
            return Err(e);
        }
    }
    // SAFETY: the caller's contract.
    let cq = unsafe {
        rdma_sys::ibv_create_cq(
            ctx.as_ptr(),
            cqe_i,
            context as *mut libc::c_void,
            channel.as_ptr(),
            comp_vector,
        )
    };
    NonNull::new(cq)
        .map(|c| (c, CqFlavor::Plain))
        .ok_or_else(|| last_error(libc::ENOMEM))
}

/// The number of entries the device granted.
///
/// # Safety
/// `cq` is live.
pub(crate) unsafe fn cq_entries(cq: NonNull<ibv_cq>) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { cq.as_ref() }.cqe
}

/// `ibv_resize_cq`: at least `cqe` entries; returns the entries the
/// device now holds (`ibv_cq.cqe`).
///
/// # Safety
/// `cq` is live and not polled by another thread during the call.
pub(crate) unsafe fn resize_cq(cq: NonNull<ibv_cq>, cqe: u32) -> io::Result<i32> {
    let cqe = i32::try_from(cqe).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: the caller's contract.
    let r = unsafe { rdma_sys::ibv_resize_cq(cq.as_ptr(), cqe) };
    if r != 0 {
        // libibverbs returns the provider's errno (positive), or -1 with
        // errno set.
        return Err(if r > 0 {
            io::Error::from_raw_os_error(r)
        } else {
            last_error(libc::EIO)
        });
    }
    // SAFETY: the caller's contract; the resize returned.
    Ok(unsafe { cq_entries(cq) })
}

/// # Safety
/// `cq` is live, no QP uses it, and every event read for it was acked.
pub(crate) unsafe fn destroy_cq(cq: NonNull<ibv_cq>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_destroy_cq(cq.as_ptr()) })
}

/// The provider's `poll_cq`, looked up once per CQ (the hot path then costs
/// one indirect call, as libibverbs' own inline does).
pub(crate) type PollFn = unsafe extern "C" fn(*mut ibv_cq, i32, *mut ibv_wc) -> i32;
/// The provider's `req_notify_cq`.
pub(crate) type NotifyFn = unsafe extern "C" fn(*mut ibv_cq, i32) -> i32;

/// The CQ verbs of `cq`'s provider.
///
/// # Safety
/// `cq` is live.
pub(crate) unsafe fn cq_ops(cq: NonNull<ibv_cq>) -> io::Result<(PollFn, NotifyFn)> {
    // SAFETY: a live CQ's context is live; its ops table is plain data.
    let ops = unsafe { &(*cq.as_ref().context).ops };
    match (ops.poll_cq, ops.req_notify_cq) {
        (Some(p), Some(n)) => Ok((p, n)),
        _ => Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP)),
    }
}

/// Polls up to `len` completions into `out`.
///
/// # Safety
/// `cq` is live and polled by this thread only; `poll` is its provider's;
/// `out` is valid for writes of `len` `ibv_wc`s.
#[inline]
pub(crate) unsafe fn poll_cq(
    poll: PollFn,
    cq: NonNull<ibv_cq>,
    out: *mut ibv_wc,
    len: usize,
) -> io::Result<usize> {
    let n = i32::try_from(len).unwrap_or(i32::MAX);
    // SAFETY: the caller's contract; `out` has room for `n` entries.
    let got = unsafe { poll(cq.as_ptr(), n, out) };
    if got < 0 {
        // Providers return -1 with errno, or -errno without setting it.
        return Err(match got {
            -1 => last_error(libc::EIO),
            e => io::Error::from_raw_os_error(-e),
        });
    }
    Ok((got as usize).min(len))
}

/// Requests one notification.
///
/// # Safety
/// `cq` is live; `notify` is its provider's.
pub(crate) unsafe fn req_notify_cq(
    notify: NotifyFn,
    cq: NonNull<ibv_cq>,
    solicited_only: bool,
) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { notify(cq.as_ptr(), i32::from(solicited_only)) })
}

/// One event from a non-blocking channel: the CQ and its `cq_context`, or
/// `None` when nothing is pending.
///
/// # Safety
/// `ch` is live and non-blocking.
pub(crate) unsafe fn get_cq_event(
    ch: NonNull<ibv_comp_channel>,
) -> io::Result<Option<(NonNull<ibv_cq>, usize)>> {
    let mut cq = null_mut();
    let mut context = null_mut();
    // SAFETY: the caller's contract; both out-pointers are valid.
    let r = unsafe { rdma_sys::ibv_get_cq_event(ch.as_ptr(), &mut cq, &mut context) };
    if r != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) => Ok(None),
            _ => Err(e),
        };
    }
    Ok(NonNull::new(cq).map(|cq| (cq, context as usize)))
}

/// # Safety
/// `cq` is live and `n` events were read for it and not yet acked.
pub(crate) unsafe fn ack_cq_events(cq: NonNull<ibv_cq>, n: u32) {
    // SAFETY: the caller's contract.
    unsafe { rdma_sys::ibv_ack_cq_events(cq.as_ptr(), n) }
}

/// # Safety
/// `pd` is live; the CQs and SRQ in `attr` are live objects of its device.
pub(crate) unsafe fn create_qp(
    pd: NonNull<ibv_pd>,
    attr: &mut ibv_qp_init_attr,
) -> io::Result<NonNull<ibv_qp>> {
    // SAFETY: the caller's contract.
    NonNull::new(unsafe { rdma_sys::ibv_create_qp(pd.as_ptr(), attr) })
        .ok_or_else(|| last_error(libc::EINVAL))
}

/// # Safety
/// `qp` is live.
pub(crate) unsafe fn modify_qp(
    qp: NonNull<ibv_qp>,
    attr: &mut ibv_qp_attr,
    mask: u32,
) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_modify_qp(qp.as_ptr(), attr, mask as i32) })
}

/// # Safety
/// `qp` is live.
pub(crate) unsafe fn destroy_qp(qp: NonNull<ibv_qp>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_destroy_qp(qp.as_ptr()) })
}

/// # Safety
/// `qp` is live.
pub(crate) unsafe fn qp_num(qp: NonNull<ibv_qp>) -> u32 {
    // SAFETY: the caller's contract.
    unsafe { qp.as_ref() }.qp_num
}

/// Posts a linked list of send requests; on failure, the index of the
/// first request not posted (libibverbs' `bad_wr`).
///
/// # Safety
/// `qp` is live; `wrs` is a list linked through `next` (the last `next`
/// null) whose SGEs name registered memory that stays registered until
/// the requests complete.
pub(crate) unsafe fn post_send(
    qp: NonNull<ibv_qp>,
    wrs: &mut [ibv_send_wr],
) -> Result<(), (usize, io::Error)> {
    if wrs.is_empty() {
        return Ok(());
    }
    // SAFETY: a live QP's context and ops table.
    let Some(f) = (unsafe { (*qp.as_ref().context).ops.post_send }) else {
        return Err((0, io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
    };
    let mut bad = null_mut();
    let base = wrs.as_mut_ptr();
    // SAFETY: the caller's contract; `bad` is a valid out-pointer.
    let r = unsafe { f(qp.as_ptr(), base, &mut bad) };
    if r == 0 {
        return Ok(());
    }
    Err((bad_index(base, bad, wrs.len()), ret_error(r)))
}

/// Posts a linked list of receives to a QP or, with `srq`, to an SRQ.
///
/// # Safety
/// As [`post_send`].
pub(crate) unsafe fn post_recv(
    target: RecvTarget,
    wrs: &mut [ibv_recv_wr],
) -> Result<(), (usize, io::Error)> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut bad = null_mut();
    let base = wrs.as_mut_ptr();
    let r = match target {
        RecvTarget::Qp(qp) => {
            // SAFETY: a live QP's context and ops table.
            let Some(f) = (unsafe { (*qp.as_ref().context).ops.post_recv }) else {
                return Err((0, io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
            };
            // SAFETY: the caller's contract.
            unsafe { f(qp.as_ptr(), base, &mut bad) }
        }
        RecvTarget::Srq(srq) => {
            // SAFETY: a live SRQ's context and ops table.
            let Some(f) = (unsafe { (*srq.as_ref().context).ops.post_srq_recv }) else {
                return Err((0, io::Error::from_raw_os_error(libc::EOPNOTSUPP)));
            };
            // SAFETY: the caller's contract.
            unsafe { f(srq.as_ptr(), base, &mut bad) }
        }
    };
    if r == 0 {
        return Ok(());
    }
    Err((bad_index(base, bad, wrs.len()), ret_error(r)))
}

/// Where receives go.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RecvTarget {
    /// A QP's own receive queue.
    Qp(NonNull<ibv_qp>),
    /// A shared receive queue.
    Srq(NonNull<ibv_srq>),
}

/// A post verb's return: an errno (providers differ on the sign).
fn ret_error(r: i32) -> io::Error {
    match r {
        -1 => last_error(libc::EINVAL),
        r => io::Error::from_raw_os_error(r.abs()),
    }
}

/// The index of `bad` in the array at `base`; 0 when the provider left it
/// null or pointed outside the list (then nothing is assumed posted).
fn bad_index<T>(base: *mut T, bad: *mut T, len: usize) -> usize {
    let (b, x) = (base as usize, bad as usize);
    let size = std::mem::size_of::<T>();
    if bad.is_null() || x < b || (x - b) % size != 0 || (x - b) / size >= len {
        return 0;
    }
    (x - b) / size
}

/// Creates an SRQ; returns it with the depth and SGEs the device granted
/// (at least those asked).
///
/// # Safety
/// `pd` is live.
pub(crate) unsafe fn create_srq(
    pd: NonNull<ibv_pd>,
    max_wr: u32,
    max_sge: u32,
) -> io::Result<(NonNull<ibv_srq>, u32, u32)> {
    // SAFETY: plain C data; all-zero is a valid value.
    let mut attr: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
    attr.attr.max_wr = max_wr;
    attr.attr.max_sge = max_sge;
    // SAFETY: the caller's contract.
    let srq = NonNull::new(unsafe { rdma_sys::ibv_create_srq(pd.as_ptr(), &mut attr) })
        .ok_or_else(|| last_error(libc::EINVAL))?;
    Ok((
        srq,
        attr.attr.max_wr.max(max_wr),
        attr.attr.max_sge.max(max_sge),
    ))
}

/// # Safety
/// `srq` is live and no QP uses it.
pub(crate) unsafe fn destroy_srq(srq: NonNull<ibv_srq>) -> io::Result<()> {
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_destroy_srq(srq.as_ptr()) })
}

/// Arms the SRQ limit event: one `IBV_EVENT_SRQ_LIMIT_REACHED` when fewer
/// than `limit` receives are left.
///
/// # Safety
/// `srq` is live.
pub(crate) unsafe fn arm_srq_limit(srq: NonNull<ibv_srq>, limit: u32) -> io::Result<()> {
    // SAFETY: plain C data; all-zero is a valid value.
    let mut attr: rdma_sys::ibv_srq_attr = unsafe { std::mem::zeroed() };
    attr.srq_limit = limit;
    let mask = rdma_sys::ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32;
    // SAFETY: the caller's contract.
    from_ret(unsafe { rdma_sys::ibv_modify_srq(srq.as_ptr(), &mut attr, mask) })
}

/// The context's asynchronous-event descriptor.
///
/// # Safety
/// `ctx` is open.
pub(crate) unsafe fn async_fd(ctx: NonNull<ibv_context>) -> i32 {
    // SAFETY: the caller's contract.
    unsafe { ctx.as_ref() }.async_fd
}

/// What an asynchronous event names, copied out before it is acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Element {
    /// A CQ (`cq_context` is not part of the event: the CQ pointer is).
    Cq(usize),
    /// A QP, by pointer.
    Qp(usize),
    /// An SRQ, by pointer.
    Srq(usize),
    /// A port number.
    Port(u8),
    /// The device.
    Device,
}

/// The raw event type values of rdma-core 44 (`enum ibv_event_type`).
#[allow(dead_code)] // The whole enum, for the layout test and readers.
pub(crate) mod event {
    pub const CQ_ERR: u32 = 0;
    pub const QP_FATAL: u32 = 1;
    pub const QP_REQ_ERR: u32 = 2;
    pub const QP_ACCESS_ERR: u32 = 3;
    pub const COMM_EST: u32 = 4;
    pub const SQ_DRAINED: u32 = 5;
    pub const PATH_MIG: u32 = 6;
    pub const PATH_MIG_ERR: u32 = 7;
    pub const DEVICE_FATAL: u32 = 8;
    pub const PORT_ACTIVE: u32 = 9;
    pub const PORT_ERR: u32 = 10;
    pub const LID_CHANGE: u32 = 11;
    pub const PKEY_CHANGE: u32 = 12;
    pub const SM_CHANGE: u32 = 13;
    pub const SRQ_ERR: u32 = 14;
    pub const SRQ_LIMIT_REACHED: u32 = 15;
    pub const QP_LAST_WQE_REACHED: u32 = 16;
    pub const CLIENT_REREGISTER: u32 = 17;
    pub const GID_CHANGE: u32 = 18;
    pub const WQ_FATAL: u32 = 19;
}

/// `struct ibv_async_event` with the event type as a plain `u32`:
/// rdma-sys makes it a Rust enum, and a provider newer than its bindings
/// may report a type the enum lacks, which no Rust enum may hold.
#[repr(C)]
pub(crate) struct RawAsyncEvent {
    element: RawElement,
    event_type: u32,
}

/// The `element` union of `struct ibv_async_event`.
#[repr(C)]
#[derive(Clone, Copy)]
union RawElement {
    ptr: *mut libc::c_void,
    port_num: libc::c_int,
}

/// Reads one asynchronous event (non-blocking descriptor), copies what it
/// names and acks it at once. `None` when nothing is pending.
///
/// # Safety
/// `ctx` is open and its async descriptor non-blocking.
pub(crate) unsafe fn get_async_event(
    ctx: NonNull<ibv_context>,
) -> io::Result<Option<(u32, Element)>> {
    let mut ev = RawAsyncEvent {
        element: RawElement { ptr: null_mut() },
        event_type: 0,
    };
    let p = (&raw mut ev).cast::<ibv_async_event>();
    // SAFETY: the caller's contract; `p` points at storage of the C
    // layout (the layout tests check it), written by libibverbs.
    if unsafe { rdma_sys::ibv_get_async_event(ctx.as_ptr(), p) } != 0 {
        let e = io::Error::last_os_error();
        return match e.raw_os_error() {
            Some(libc::EAGAIN) => Ok(None),
            _ => Err(e),
        };
    }
    let ty = ev.event_type;
    use event::*;
    // SAFETY: the union member read is the one the event type names
    // (verbs.h documents which member each type uses); both are plain data.
    let element = unsafe {
        match ty {
            CQ_ERR => Element::Cq(ev.element.ptr as usize),
            QP_FATAL | QP_REQ_ERR | QP_ACCESS_ERR | COMM_EST | SQ_DRAINED | PATH_MIG
            | PATH_MIG_ERR | QP_LAST_WQE_REACHED => Element::Qp(ev.element.ptr as usize),
            SRQ_ERR | SRQ_LIMIT_REACHED => Element::Srq(ev.element.ptr as usize),
            PORT_ACTIVE | PORT_ERR | LID_CHANGE | PKEY_CHANGE | SM_CHANGE | CLIENT_REREGISTER
            | GID_CHANGE => Element::Port(u8::try_from(ev.element.port_num).unwrap_or(0)),
            _ => Element::Device,
        }
    };
    // SAFETY: `ev` was filled by ibv_get_async_event and is acked once;
    // ack reads only the element and type.
    unsafe { rdma_sys::ibv_ack_async_event(p) };
    Ok(Some((ty, element)))
}

#[cfg(test)]
mod layout {
    //! The C structures this crate reads or writes, against verbs.h of
    //! rdma-core 44 on x86_64 / aarch64 (LP64). rdma-sys writes some of
    //! them by hand (the ones with unions), so they are checked here.
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn ibv_wc_matches_verbs_h() {
        assert_eq!(size_of::<ibv_wc>(), 48);
        assert_eq!(offset_of!(ibv_wc, wr_id), 0);
        assert_eq!(offset_of!(ibv_wc, status), 8);
        assert_eq!(offset_of!(ibv_wc, opcode), 12);
        assert_eq!(offset_of!(ibv_wc, vendor_err), 16);
        assert_eq!(offset_of!(ibv_wc, byte_len), 20);
        assert_eq!(offset_of!(ibv_wc, imm_data_invalidated_rkey_union), 24);
        assert_eq!(offset_of!(ibv_wc, qp_num), 28);
        assert_eq!(offset_of!(ibv_wc, src_qp), 32);
        assert_eq!(offset_of!(ibv_wc, wc_flags), 36);
        assert_eq!(offset_of!(ibv_wc, pkey_index), 40);
        assert_eq!(offset_of!(ibv_wc, slid), 42);
        assert_eq!(offset_of!(ibv_wc, sl), 44);
        assert_eq!(offset_of!(ibv_wc, dlid_path_bits), 45);
    }

    #[test]
    fn ibv_send_wr_matches_verbs_h() {
        assert_eq!(size_of::<ibv_send_wr>(), 128);
        assert_eq!(offset_of!(ibv_send_wr, wr_id), 0);
        assert_eq!(offset_of!(ibv_send_wr, next), 8);
        assert_eq!(offset_of!(ibv_send_wr, sg_list), 16);
        assert_eq!(offset_of!(ibv_send_wr, num_sge), 24);
        assert_eq!(offset_of!(ibv_send_wr, opcode), 28);
        assert_eq!(offset_of!(ibv_send_wr, send_flags), 32);
        assert_eq!(offset_of!(ibv_send_wr, imm_data_invalidated_rkey_union), 36);
        assert_eq!(offset_of!(ibv_send_wr, wr), 40);
        assert_eq!(offset_of!(ibv_send_wr, qp_type), 72);
        assert_eq!(offset_of!(ibv_send_wr, bind_mw_tso_union), 80);
        assert_eq!(offset_of!(rdma_sys::rdma_t, remote_addr), 0);
        assert_eq!(offset_of!(rdma_sys::rdma_t, rkey), 8);
    }

    #[test]
    fn ibv_send_wr_atomic_and_ud_match_verbs_h() {
        // `wr.atomic` and `wr.ud` of `struct ibv_send_wr` (rdma-sys writes
        // the union by hand).
        assert_eq!(size_of::<rdma_sys::wr_t>(), 32);
        assert_eq!(size_of::<rdma_sys::atomic_t>(), 32);
        assert_eq!(offset_of!(rdma_sys::atomic_t, remote_addr), 0);
        assert_eq!(offset_of!(rdma_sys::atomic_t, compare_add), 8);
        assert_eq!(offset_of!(rdma_sys::atomic_t, swap), 16);
        assert_eq!(offset_of!(rdma_sys::atomic_t, rkey), 24);
        assert_eq!(size_of::<rdma_sys::ud_t>(), 16);
        assert_eq!(offset_of!(rdma_sys::ud_t, ah), 0);
        assert_eq!(offset_of!(rdma_sys::ud_t, remote_qpn), 8);
        assert_eq!(offset_of!(rdma_sys::ud_t, remote_qkey), 12);
    }

    #[test]
    fn ibv_ah_attr_and_global_route_match_verbs_h() {
        use rdma_sys::ibv_global_route;
        assert_eq!(size_of::<ibv_global_route>(), 24);
        assert_eq!(offset_of!(ibv_global_route, dgid), 0);
        assert_eq!(offset_of!(ibv_global_route, flow_label), 16);
        assert_eq!(offset_of!(ibv_global_route, sgid_index), 20);
        assert_eq!(offset_of!(ibv_global_route, hop_limit), 21);
        assert_eq!(offset_of!(ibv_global_route, traffic_class), 22);
        assert_eq!(size_of::<ibv_ah_attr>(), 32);
        assert_eq!(offset_of!(ibv_ah_attr, grh), 0);
        assert_eq!(offset_of!(ibv_ah_attr, dlid), 24);
        assert_eq!(offset_of!(ibv_ah_attr, sl), 26);
        assert_eq!(offset_of!(ibv_ah_attr, src_path_bits), 27);
        assert_eq!(offset_of!(ibv_ah_attr, static_rate), 28);
        assert_eq!(offset_of!(ibv_ah_attr, is_global), 29);
        assert_eq!(offset_of!(ibv_ah_attr, port_num), 30);
    }

    #[test]
    fn ibv_recv_wr_and_sge_match_verbs_h() {
        assert_eq!(size_of::<ibv_recv_wr>(), 32);
        assert_eq!(offset_of!(ibv_recv_wr, wr_id), 0);
        assert_eq!(offset_of!(ibv_recv_wr, next), 8);
        assert_eq!(offset_of!(ibv_recv_wr, sg_list), 16);
        assert_eq!(offset_of!(ibv_recv_wr, num_sge), 24);
        assert_eq!(size_of::<ibv_sge>(), 16);
        assert_eq!(offset_of!(ibv_sge, addr), 0);
        assert_eq!(offset_of!(ibv_sge, length), 8);
        assert_eq!(offset_of!(ibv_sge, lkey), 12);
    }

    #[test]
    fn ibv_async_event_matches_verbs_h() {
        assert_eq!(size_of::<ibv_async_event>(), 16);
        assert_eq!(offset_of!(ibv_async_event, element), 0);
        assert_eq!(offset_of!(ibv_async_event, event_type), 8);
        assert_eq!(size_of::<RawAsyncEvent>(), 16);
        assert_eq!(offset_of!(RawAsyncEvent, element), 0);
        assert_eq!(offset_of!(RawAsyncEvent, event_type), 8);
        assert_eq!(size_of::<RawElement>(), 8);
    }

    #[test]
    fn event_numbers_match_verbs_h() {
        use rdma_sys::ibv_event_type as t;
        let pairs = [
            (t::IBV_EVENT_CQ_ERR, event::CQ_ERR),
            (t::IBV_EVENT_QP_FATAL, event::QP_FATAL),
            (t::IBV_EVENT_QP_REQ_ERR, event::QP_REQ_ERR),
            (t::IBV_EVENT_QP_ACCESS_ERR, event::QP_ACCESS_ERR),
            (t::IBV_EVENT_COMM_EST, event::COMM_EST),
            (t::IBV_EVENT_SQ_DRAINED, event::SQ_DRAINED),
            (t::IBV_EVENT_PATH_MIG, event::PATH_MIG),
            (t::IBV_EVENT_PATH_MIG_ERR, event::PATH_MIG_ERR),
            (t::IBV_EVENT_DEVICE_FATAL, event::DEVICE_FATAL),
            (t::IBV_EVENT_PORT_ACTIVE, event::PORT_ACTIVE),
            (t::IBV_EVENT_PORT_ERR, event::PORT_ERR),
            (t::IBV_EVENT_LID_CHANGE, event::LID_CHANGE),
            (t::IBV_EVENT_PKEY_CHANGE, event::PKEY_CHANGE),
            (t::IBV_EVENT_SM_CHANGE, event::SM_CHANGE),
            (t::IBV_EVENT_SRQ_ERR, event::SRQ_ERR),
            (t::IBV_EVENT_SRQ_LIMIT_REACHED, event::SRQ_LIMIT_REACHED),
            (t::IBV_EVENT_QP_LAST_WQE_REACHED, event::QP_LAST_WQE_REACHED),
            (t::IBV_EVENT_CLIENT_REREGISTER, event::CLIENT_REREGISTER),
            (t::IBV_EVENT_GID_CHANGE, event::GID_CHANGE),
            (t::IBV_EVENT_WQ_FATAL, event::WQ_FATAL),
        ];
        for (e, n) in pairs {
            assert_eq!(e as u32, n);
        }
    }

    #[test]
    fn bad_wr_index() {
        let mut a = [0u64; 4];
        let base = a.as_mut_ptr();
        assert_eq!(bad_index(base, base.wrapping_add(2), 4), 2);
        assert_eq!(bad_index(base, null_mut(), 4), 0);
        assert_eq!(bad_index(base, base.wrapping_add(9), 4), 0);
        assert_eq!(bad_index(base, (base as usize + 3) as *mut u64, 4), 0);
    }
}
