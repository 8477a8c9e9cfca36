//! Context, protection domains and memory regions, device and port queries.

use std::collections::HashSet;
use std::ffi::{c_int, c_void};
use std::mem::offset_of;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use super::{set_errno, CONTEXT_OPS, CTX_OFFSET};
use crate::model::device::DEAD_ERRNO;
use crate::model::ud;
use crate::shm::layout::{self, CtxHeader, MrInfo, MrSlot, CTX_BYTES, MAGIC, MR_SLOTS};
use crate::shm::segment::IdKind;
use crate::shm::{Ids, Segment};
use crate::sys::abi::VerbsMr;
use crate::sys::ibv;
use crate::sys::private::private;

/// The provider's context: libibverbs allocates it (`calloc`) through
/// `_verbs_init_and_alloc_context`, so `inner` starts null and is set by
/// [`alloc_context`].
#[repr(C)]
pub struct SvContext {
    /// The libibverbs part; `vctx.context` is the `ibv_context` users see.
    pub vctx: ibv::verbs_context,
    /// Provider state.
    pub inner: *mut ContextInner,
}

/// Provider state of a context.
#[derive(Debug)]
pub struct ContextInner {
    /// Context id (segment `ctx-<id>`).
    pub id: u32,
    /// This process.
    pub pid: u32,
    /// The context segment (header + MR table).
    pub seg: Arc<Segment>,
    /// Write end of the async-event pipe, kept so reads block instead of
    /// EOF; closed after the `IBV_EVENT_DEVICE_FATAL` record (provider::fatal).
    pub async_w: Mutex<Option<OwnedFd>>,
    /// Read end number (the `async_fd` libibverbs reads and closes).
    pub async_r: i32,
    mr: Mutex<MrAlloc>,
    next_pd: AtomicU32,
    /// Bytes of device memory allocated (model::mr::dm).
    pub dm_used: Mutex<u64>,
    /// Live address handles (provider::ah), at most [`limits::MAX_AH`].
    pub ahs: AtomicU32,
}

#[derive(Debug)]
struct MrAlloc {
    free: Vec<u32>,
    gen: u32,
}

impl ContextInner {
    /// The shared header.
    pub fn hdr(&self) -> &CtxHeader {
        // SAFETY: the segment starts with the CtxHeader written at creation
        // and lives as long as `self`.
        unsafe { &*self.seg.base().cast::<CtxHeader>() }
    }

    /// Whether the device died for this context (model::device).
    pub fn dead(&self) -> bool {
        self.hdr().dead.load(Ordering::Acquire) != 0
    }

    /// Reserve a slot of the MR table: its index and a fresh key for it.
    pub fn take_slot(&self) -> Option<(u32, u32)> {
        let mut a = self.mr.lock().unwrap_or_else(|e| e.into_inner());
        let index = a.free.pop()?;
        a.gen = (a.gen % 0xf_ffff) + 1;
        Some((index, layout::make_key(index, a.gen)))
    }

    /// Give a slot back (its key already cleared).
    pub fn give_slot(&self, index: u32) {
        self.mr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .free
            .push(index);
    }

    /// This context's MR table.
    pub fn mrs(&self) -> &[MrSlot] {
        // SAFETY: the segment is CTX_BYTES long and lives as long as `self`.
        unsafe { layout::mr_table(self.seg.base()) }
    }
}

/// The set of live softverbs contexts, for the comp-channel interposer.
pub fn contexts() -> &'static Mutex<HashSet<usize>> {
    static S: OnceLock<Mutex<HashSet<usize>>> = OnceLock::new();
    S.get_or_init(|| Mutex::new(HashSet::new()))
}

/// Whether `ctx` is a context of this provider.
pub fn is_ours(ctx: *mut ibv::ibv_context) -> bool {
    contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(&(ctx as usize))
}

/// Provider state of an `ibv_context`.
///
/// # Safety
/// `ctx` is a live context made by [`alloc_context`].
pub unsafe fn inner<'a>(ctx: *mut ibv::ibv_context) -> &'a ContextInner {
    // SAFETY: `ctx` is the `context` field of the `vctx` field (offset 0) of
    // an SvContext (caller contract), whose `inner` was set at creation.
    unsafe {
        let sv = ctx.cast::<u8>().sub(CTX_OFFSET).cast::<SvContext>();
        &*(*sv).inner
    }
}

fn make_inner() -> std::io::Result<ContextInner> {
    let ids = Ids::get()?;
    crate::shm::segment::sweep_dead();
    let (id, seg) = crate::shm::segment::create_fresh("ctx-", || ids.next(IdKind::Ctx), CTX_BYTES)?;
    let mut fds = [0 as c_int; 2];
    // SAFETY: `fds` is a valid 2-int array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fds[1] is the fresh write end, owned from here on.
    let async_w = unsafe { OwnedFd::from_raw_fd(fds[1]) };
    // Our own event writes never block: a full pipe (thousands of unread
    // events) drops the record. Only the write end's file description
    // changes; libibverbs' reads on fds[0] still block.
    // SAFETY: fcntl on the write end we own.
    unsafe { libc::fcntl(fds[1], libc::F_SETFL, libc::O_NONBLOCK) };
    let pid = std::process::id();
    // SAFETY: the segment was just created (zeroed), is CTX_BYTES long and
    // nobody else knows its id yet.
    unsafe {
        let h = seg.base().cast::<CtxHeader>();
        (*h).pid = pid;
        (*h).async_fd = fds[0];
        (*h).async_ino = super::events::pipe_ino(fds[0]);
        (*h).id = id;
        (*h).magic = MAGIC;
    }
    Ok(ContextInner {
        id,
        pid,
        seg,
        async_w: Mutex::new(Some(async_w)),
        async_r: fds[0],
        mr: Mutex::new(MrAlloc {
            free: (1..MR_SLOTS as u32).rev().collect(),
            gen: 1,
        }),
        next_pd: AtomicU32::new(1),
        dm_used: Mutex::new(0),
        ahs: AtomicU32::new(0),
    })
}

/// `alloc_context` of the device ops.
///
/// # Safety
/// Called by libibverbs with a device made by this provider and an open fd.
pub unsafe extern "C" fn alloc_context(
    device: *mut ibv::ibv_device,
    cmd_fd: c_int,
    _private: *mut c_void,
) -> *mut ibv::verbs_context {
    let p = match private() {
        Ok(p) => p,
        Err(_) => {
            set_errno(libc::ENOSYS);
            return std::ptr::null_mut();
        }
    };
    // SAFETY: the ABI: allocate size_of::<SvContext>() bytes with the
    // verbs_context at offset_of!(SvContext, vctx); ownership of cmd_fd passes in.
    let sv = unsafe {
        (p.init_and_alloc_context)(
            device,
            cmd_fd,
            std::mem::size_of::<SvContext>(),
            offset_of!(SvContext, vctx) as *mut ibv::verbs_context,
            0,
        )
    }
    .cast::<SvContext>();
    if sv.is_null() {
        return std::ptr::null_mut();
    }
    match make_inner() {
        Ok(inner) => {
            let async_r = inner.async_r;
            // SAFETY: `sv` is the fresh zeroed allocation; we own it until return.
            unsafe {
                (*sv).inner = Box::into_raw(Box::new(inner));
                (p.set_ops)(&mut (*sv).vctx, &CONTEXT_OPS);
                (*sv).vctx.context.async_fd = async_r;
                (*sv).vctx.context.num_comp_vectors = 1;
            }
            // SAFETY: `sv` is valid; taking the address of a field.
            let ctx = unsafe { std::ptr::addr_of_mut!((*sv).vctx.context) };
            contexts()
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(ctx as usize);
            // SAFETY: as above.
            unsafe { std::ptr::addr_of_mut!((*sv).vctx) }
        }
        Err(e) => {
            // SAFETY: undo init_and_alloc_context: uninit closes cmd_fd, then
            // the calloc'd block is freed.
            unsafe {
                (p.uninit_context)(&mut (*sv).vctx);
                libc::free(sv.cast());
            }
            set_errno(crate::shm::fabric::errno(&e, libc::ENOMEM));
            std::ptr::null_mut()
        }
    }
}

/// `free_context`.
///
/// # Safety
/// `ctx` is a context made by [`alloc_context`], not used afterwards.
pub unsafe extern "C" fn free_context(ctx: *mut ibv::ibv_context) {
    contexts()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&(ctx as usize));
    // No event can be read any more: free the QPs and SRQs kept for records
    // that were still unread when they were destroyed (provider::events).
    for (obj, kind) in super::events::take_zombies(ctx as usize) {
        // SAFETY: a zombie is the allocation of a destroyed object whose
        // fields were already dropped, recorded once and freed once here.
        unsafe {
            match kind {
                super::events::Kind::Qp => super::qp::free_zombie(obj),
                super::events::Kind::Srq => super::srq::free_zombie(obj),
            }
        }
    }
    // SAFETY: `ctx` lies CTX_OFFSET into an SvContext (offset 0 of vctx).
    let sv = unsafe { ctx.cast::<u8>().sub(CTX_OFFSET).cast::<SvContext>() };
    // SAFETY: `inner` came from Box::into_raw in alloc_context; last use.
    unsafe {
        if !(*sv).inner.is_null() {
            drop(Box::from_raw((*sv).inner));
            (*sv).inner = std::ptr::null_mut();
        }
    }
    if let Ok(p) = private() {
        // SAFETY: closes cmd_fd/async_fd and drops the device reference; then
        // the block libibverbs calloc'd is freed, as rdma-core providers do.
        unsafe {
            (p.uninit_context)(&mut (*sv).vctx);
            libc::free(sv.cast());
        }
    }
}

/// `async_event`, which `ibv_get_async_event` calls after reading each
/// record: count the records read per QP/SRQ, so that destroy knows which
/// ones the application must still ack (provider::events).
///
/// # Safety
/// `ev` is null or the event libibverbs just filled.
pub unsafe extern "C" fn async_event(_ctx: *mut ibv::ibv_context, ev: *mut ibv::ibv_async_event) {
    if ev.is_null() {
        return;
    }
    // SAFETY: `ev` is valid (caller contract); the type is read as a plain
    // u32 (a value outside rdma-sys's enum must not be read as the enum),
    // the element as a pointer-sized integer (every member is plain data).
    let (ty, obj) = unsafe {
        (
            std::ptr::addr_of!((*ev).event_type).cast::<u32>().read(),
            (*ev).element.qp as usize,
        )
    };
    use crate::model::event::{names_qp, names_srq};
    if names_qp(ty) || names_srq(ty) {
        super::events::on_read(obj);
    }
}

/// Device limits (also used for query_qp/caps).
pub mod limits {
    /// Work requests per queue.
    pub const MAX_QP_WR: u32 = 16384;
    /// Completions per CQ: 4Mi - 1, as mlx5's (libfabric's ofi_rxm asks
    /// for 262,144, four times the 65,536 this was).
    /// A CQ's ring is a power of two of slots (shm::ring), so one of this
    /// size has 4Mi slots of 64 bytes: 256 MiB of shared memory, mapped
    /// and written (each slot's sequence) when it is created. Memory is
    /// per CQ, sized by what the CQ asks for; nothing is sized by this
    /// limit. `cq->cqe` never reports more than it (provider::cq).
    pub const MAX_CQE: u32 = (1 << 22) - 1;
    /// Address handles per context (`max_ah`): counted by `create_ah` and
    /// `destroy_ah` (provider::ah), beyond it ENOMEM. An address handle is
    /// a small heap object of its process; the count bounds what one
    /// context can hold, as `max_mr` bounds its MR table.
    pub const MAX_AH: u32 = 65536;
    /// Inline data per send.
    pub const MAX_INLINE: u32 = 4096;
    /// Largest message (2 GiB, as IB).
    pub const MAX_MSG: u32 = 0x8000_0000;
    /// Outstanding RDMA READ / atomic requests a QP may have as initiator
    /// (`max_qp_init_rd_atom`, the ceiling of `max_rd_atomic`) and as
    /// responder (`max_qp_rd_atom`, of `max_dest_rd_atomic`).
    pub const MAX_RD_ATOM: u8 = 16;
}

/// `query_device_ex` (v44 routes `ibv_query_device` here too).
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is writable for `attr_size`
/// bytes.
pub unsafe extern "C" fn query_device_ex(
    ctx: *mut ibv::ibv_context,
    _input: *const ibv::ibv_query_device_ex_input,
    attr: *mut ibv::ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    // SAFETY: caller contract: a live context of ours.
    if unsafe { inner(ctx) }.dead() {
        return DEAD_ERRNO;
    }
    if attr.is_null() || attr_size < std::mem::size_of::<ibv::ibv_device_attr>() {
        return libc::EINVAL;
    }
    let size = attr_size.min(std::mem::size_of::<ibv::ibv_device_attr_ex>());
    // SAFETY: `attr` is writable for attr_size >= size bytes (caller contract).
    unsafe { std::ptr::write_bytes(attr.cast::<u8>(), 0, size) };
    // SAFETY: orig_attr is at offset 0 and fits (checked above).
    let a = unsafe { &mut (*attr).orig_attr };
    let fw = b"softverbs-0.1";
    for (d, s) in a.fw_ver.iter_mut().zip(fw.iter()) {
        *d = *s as _;
    }
    a.node_guid = 0x0200_00ff_fe00_0001_u64.to_be();
    a.sys_image_guid = a.node_guid;
    a.max_mr_size = u64::MAX;
    a.page_size_cap = 0xffff_f000;
    a.vendor_id = 0x5356;
    a.vendor_part_id = 1;
    a.hw_ver = 1;
    a.max_qp = 65536;
    a.max_qp_wr = limits::MAX_QP_WR as i32;
    // IBV_DEVICE_RC_RNR_NAK_GEN, IBV_DEVICE_MEM_WINDOW,
    // IBV_DEVICE_MEM_WINDOW_TYPE_2B (model::mr::mw).
    a.device_cap_flags = (1 << 12) | (1 << 17) | (1 << 24);
    a.max_mw = (MR_SLOTS - 1) as i32;
    a.max_sge = layout::MAX_SGE as i32;
    a.max_sge_rd = layout::MAX_SGE as i32;
    a.max_cq = 65536;
    a.max_cqe = limits::MAX_CQE as i32;
    a.max_mr = (MR_SLOTS - 1) as i32;
    a.max_pd = 65536;
    a.max_ah = limits::MAX_AH as i32;
    a.max_qp_rd_atom = limits::MAX_RD_ATOM.into();
    a.max_res_rd_atom = i32::from(limits::MAX_RD_ATOM) * 65536;
    a.max_qp_init_rd_atom = limits::MAX_RD_ATOM.into();
    // Atomics are atomic among themselves, from any process, not against
    // the CPU (model::atomic, shm::atomics).
    a.atomic_cap = ibv::ibv_atomic_cap::IBV_ATOMIC_HCA;
    a.max_srq = 65536;
    a.max_srq_wr = limits::MAX_QP_WR as i32;
    a.max_srq_sge = layout::MAX_SGE as i32;
    a.max_pkeys = 1;
    // Multicast (provider::mcast): the fabric's table.
    a.max_mcast_grp = ud::MAX_MCAST_GRP as i32;
    a.max_mcast_qp_attach = ud::MAX_MCAST_QP_ATTACH as i32;
    a.max_total_mcast_qp_attach = (ud::MAX_MCAST_GRP * ud::MAX_MCAST_QP_ATTACH) as i32;
    a.phys_port_cnt = 1;
    // Past orig_attr only what the caller's structure holds (an older
    // application passes a shorter one).
    if size >= offset_of!(ibv::ibv_device_attr_ex, phys_port_cnt_ex) + 4 {
        // SAFETY: `attr` is writable for `size` bytes, which cover the field.
        unsafe { (*attr).phys_port_cnt_ex = 1 };
    }
    if size >= offset_of!(ibv::ibv_device_attr_ex, hca_core_clock) + 8 {
        // SAFETY: as above: completion timestamps (provider::clock).
        unsafe {
            (*attr).completion_timestamp_mask = u64::MAX;
            (*attr).hca_core_clock = super::clock::CORE_CLOCK_KHZ;
        }
    }
    if size >= offset_of!(ibv::ibv_device_attr_ex, max_dm_size) + 8 {
        // SAFETY: as above.
        unsafe { (*attr).max_dm_size = crate::model::mr::dm::MAX_SIZE };
    }
    if size >= offset_of!(ibv::ibv_device_attr_ex, odp_caps) + size_of::<ibv::ibv_odp_caps>() {
        // SAFETY: as above, the caller's structure covers odp_caps.
        unsafe { (*attr).odp_caps = odp_caps() };
    }
    if size >= offset_of!(ibv::ibv_device_attr_ex, xrc_odp_caps) + 4 {
        use crate::model::mr::odp;
        // SAFETY: as above. XRC is served by the RC data path.
        unsafe {
            (*attr).xrc_odp_caps = odp::SEND | odp::WRITE | odp::READ | odp::ATOMIC | odp::SRQ_RECV
        };
    }
    0
}

/// On-demand paging (model::mr): the device never pins memory — every
/// access goes through the owner's page tables at the time it happens
/// (`memcpy` or `process_vm_readv`/`writev`) — so every region behaves as
/// an ODP region, implicit ones included, for every operation of every
/// transport it has (XRC's in `xrc_odp_caps`).
fn odp_caps() -> ibv::ibv_odp_caps {
    use crate::model::mr::odp;
    ibv::ibv_odp_caps {
        general_caps: odp::SUPPORT | odp::SUPPORT_IMPLICIT,
        per_transport_caps: ibv::ibv_odp_caps__bindgen_ty_1 {
            rc_odp_caps: odp::SEND
                | odp::RECV
                | odp::WRITE
                | odp::READ
                | odp::ATOMIC
                | odp::SRQ_RECV,
            uc_odp_caps: odp::SEND | odp::RECV | odp::WRITE | odp::SRQ_RECV,
            ud_odp_caps: odp::SEND | odp::RECV | odp::SRQ_RECV,
        },
    }
}

/// `query_rt_values` (`ibv_query_rt_values_ex(3)`): the device clock
/// (`IBV_VALUES_MASK_RAW_CLOCK`, its ticks in `raw_clock.tv_nsec`, as
/// hardware providers report their cycle counter); other bits are
/// cleared from `comp_mask`, as the man page says of what a device cannot
/// report.
///
/// # Safety
/// `ctx` is a live softverbs context; `values` is writable.
pub unsafe extern "C" fn query_rt_values(
    ctx: *mut ibv::ibv_context,
    values: *mut ibv::ibv_values_ex,
) -> c_int {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return DEAD_ERRNO;
    }
    if values.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: caller contract.
    let v = unsafe { &mut *values };
    const RAW_CLOCK: u32 = 1;
    v.comp_mask &= RAW_CLOCK;
    if v.comp_mask & RAW_CLOCK != 0 {
        v.raw_clock.tv_sec = 0;
        v.raw_clock.tv_nsec = super::clock::device_ns() as i64;
    }
    0
}

/// `query_port`.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is writable.
pub unsafe extern "C" fn query_port(
    ctx: *mut ibv::ibv_context,
    port: u8,
    attr: *mut ibv::ibv_port_attr,
) -> c_int {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return DEAD_ERRNO;
    }
    if port != 1 || attr.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: `attr` is a writable ibv_port_attr (libibverbs zeroed it).
    let a = unsafe { &mut *attr };
    a.state = 4; // IBV_PORT_ACTIVE
    a.max_mtu = 5; // IBV_MTU_4096
    a.active_mtu = 5;
    // Index 0 holds the port's GID, index 1 is empty (the launcher's
    // sysfs tree): libibverbs answers ENODATA for it and skips it in
    // ibv_query_gid_table, as for the unpopulated entries of real ports.
    a.gid_tbl_len = 2;
    a.max_msg_sz = limits::MAX_MSG;
    a.pkey_tbl_len = 1;
    a.lid = 1;
    a.sm_lid = 1;
    a.max_vl_num = 1;
    a.active_width = 2; // 4X
    a.active_speed = 32; // EDR
    a.phys_state = 5; // LinkUp
    a.link_layer = 1; // IBV_LINK_LAYER_INFINIBAND
    0
}

/// A protection domain, or a parent domain (`ibv_alloc_parent_domain`),
/// which is used wherever a PD is and protects with its PD's id.
#[repr(C)]
pub struct SvPd {
    /// The libibverbs part.
    pub pd: ibv::ibv_pd,
    /// PD id within the context (compared against MR and QP PDs); a
    /// parent domain's is its protection domain's.
    pub id: u32,
    /// A parent domain's attributes; `None` for a protection domain.
    pub parent: Option<Box<Parent>>,
}

/// What a parent domain was made of (`struct ibv_parent_domain_init_attr`).
#[derive(Debug)]
pub struct Parent {
    /// Its protection domain.
    pub pd: *mut ibv::ibv_pd,
    /// Its thread domain, or null.
    pub td: *mut ibv::ibv_td,
    /// The application's allocator (`IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS`).
    pub alloc: Option<
        unsafe extern "C" fn(*mut ibv::ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void,
    >,
    /// Its counterpart.
    pub free: Option<unsafe extern "C" fn(*mut ibv::ibv_pd, *mut c_void, *mut c_void, u64)>,
    /// `pd_context` (`IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT`).
    pub pd_context: *mut c_void,
}

/// `enum ibv_parent_domain_init_attr_mask`.
const PARENT_ALLOCATORS: u32 = 1;
const PARENT_PD_CONTEXT: u32 = 1 << 1;

/// `alloc_td`: a thread domain. The application promises that what it
/// creates in a parent domain with this thread domain is used by one
/// thread at a time; softverbs keeps its locks (correct either way:
/// uncontended, they cost a few atomic operations), so there is nothing
/// to set up beyond the object. `comp_mask` must be 0 (EINVAL).
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid.
pub unsafe extern "C" fn alloc_td(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_td_init_attr,
) -> *mut ibv::ibv_td {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return super::dead();
    }
    // SAFETY: caller contract.
    if attr.is_null() || unsafe { (*attr).comp_mask } != 0 {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    Box::into_raw(Box::new(ibv::ibv_td { context: ctx }))
}

/// `dealloc_td`.
///
/// # Safety
/// `td` was made by [`alloc_td`]; not used afterwards.
pub unsafe extern "C" fn dealloc_td(td: *mut ibv::ibv_td) -> c_int {
    // SAFETY: caller contract: the box of alloc_td, last use.
    drop(unsafe { Box::from_raw(td) });
    0
}

/// `alloc_parent_domain` (`ibv_alloc_parent_domain(3)`): a domain used as
/// a PD — for regions, QPs, SRQs, windows and as the `parent_domain` of an
/// extended CQ — protecting with its PD's id. Its PD must be a protection
/// domain of this context and its thread domain, when given, one of this
/// context; an unknown `comp_mask` bit is EINVAL.
///
/// The allocators are kept and offered nothing to allocate: every byte
/// the device reads or writes for a queue lives in a shared segment that
/// peer processes map (docs/softverbs.md, "The fabric"), which memory
/// from an application allocator cannot be.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid.
pub unsafe extern "C" fn alloc_parent_domain(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_parent_domain_init_attr,
) -> *mut ibv::ibv_pd {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return super::dead();
    }
    if attr.is_null() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    // SAFETY: caller contract.
    let a = unsafe { &*attr };
    let ok = a.comp_mask & !(PARENT_ALLOCATORS | PARENT_PD_CONTEXT) == 0
        && !a.pd.is_null()
        // SAFETY: a non-null PD the caller passes is a live PD.
        && unsafe { (*a.pd).context } == ctx
        // SAFETY: a PD of this context is an SvPd.
        && unsafe { (*a.pd.cast::<SvPd>()).parent.is_none() }
        // SAFETY: as above, for the thread domain.
        && (a.td.is_null() || unsafe { (*a.td).context } == ctx)
        && (a.comp_mask & PARENT_ALLOCATORS == 0 || (a.alloc.is_some() && a.free.is_some()));
    if !ok {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let with_alloc = a.comp_mask & PARENT_ALLOCATORS != 0;
    let parent = Parent {
        pd: a.pd,
        td: a.td,
        alloc: if with_alloc { a.alloc } else { None },
        free: if with_alloc { a.free } else { None },
        pd_context: if a.comp_mask & PARENT_PD_CONTEXT != 0 {
            a.pd_context
        } else {
            std::ptr::null_mut()
        },
    };
    // SAFETY: `a.pd` is a PD of this context (checked).
    let id = unsafe { pd_id(a.pd) };
    let pd = Box::new(SvPd {
        pd: ibv::ibv_pd {
            context: ctx,
            handle: id,
        },
        id,
        parent: Some(Box::new(parent)),
    });
    Box::into_raw(pd).cast()
}

/// Whether `pd` is a parent domain of this provider.
///
/// # Safety
/// `pd` is null or a PD of this provider.
pub unsafe fn is_parent_domain(pd: *mut ibv::ibv_pd) -> bool {
    // SAFETY: caller contract.
    !pd.is_null() && unsafe { (*pd.cast::<SvPd>()).parent.is_some() }
}

/// `alloc_pd`.
///
/// # Safety
/// `ctx` is a live softverbs context.
pub unsafe extern "C" fn alloc_pd(ctx: *mut ibv::ibv_context) -> *mut ibv::ibv_pd {
    // SAFETY: caller contract.
    let c = unsafe { inner(ctx) };
    if c.dead() {
        return super::dead();
    }
    let id = c.next_pd.fetch_add(1, Ordering::Relaxed);
    let pd = Box::new(SvPd {
        pd: ibv::ibv_pd {
            context: ctx,
            handle: id,
        },
        id,
        parent: None,
    });
    Box::into_raw(pd).cast()
}

/// `dealloc_pd` (parent domains too).
///
/// # Safety
/// `pd` was made by [`alloc_pd`].
pub unsafe extern "C" fn dealloc_pd(pd: *mut ibv::ibv_pd) -> c_int {
    // SAFETY: `pd` is the first field of a boxed SvPd (alloc_pd).
    drop(unsafe { Box::from_raw(pd.cast::<SvPd>()) });
    0
}

/// The PD id of an `ibv_pd` of this provider.
///
/// # Safety
/// `pd` was made by [`alloc_pd`].
pub unsafe fn pd_id(pd: *mut ibv::ibv_pd) -> u32 {
    // SAFETY: caller contract: `pd` heads an SvPd.
    unsafe { (*pd.cast::<SvPd>()).id }
}

/// A memory region.
#[repr(C)]
#[derive(Debug)]
pub struct SvMr {
    /// The libibverbs part (`verbs_mr`).
    pub vmr: VerbsMr,
    ctx: *const ContextInner,
    index: u32,
    /// The device memory the region lies in (null: host memory).
    dm: *const super::dm::SvDm,
}

/// `reg_mr`: publish the region in the context's shared MR table.
///
/// # Safety
/// `pd` was made by [`alloc_pd`].
pub unsafe extern "C" fn reg_mr(
    pd: *mut ibv::ibv_pd,
    addr: *mut c_void,
    length: usize,
    hca_va: u64,
    access: c_int,
) -> *mut ibv::ibv_mr {
    // SAFETY: caller contract.
    let (c, pdid) = unsafe { (inner((*pd).context), pd_id(pd)) };
    if c.dead() {
        return super::dead();
    }
    if let Some(e) = crate::model::mr::reg_error(access as u32, addr as u64, length as u64) {
        set_errno(e);
        return std::ptr::null_mut();
    }
    // `hca_va` is the I/O virtual address users name the first byte with:
    // `addr` for ibv_reg_mr, the caller's for ibv_reg_mr_iova.
    let info = MrInfo {
        iova: hca_va,
        ..MrInfo::at(pdid, access as u32, addr as u64, length as u64)
    };
    publish_mr(c, info, std::ptr::null())
}

/// Publish a region in the context's shared MR table and make its
/// `verbs_mr` (keys and access; libibverbs or the caller fills the rest).
/// `dm` is the device memory it lies in, or null.
pub fn publish_mr(c: &ContextInner, info: MrInfo, dm: *const super::dm::SvDm) -> *mut ibv::ibv_mr {
    let Some((index, key)) = c.take_slot() else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    layout::mr_publish(&c.mrs()[index as usize], key, info);
    // SAFETY: all-zero is valid for this plain C struct; fields set below.
    let vmr: VerbsMr = unsafe { std::mem::zeroed() };
    let mut mr: Box<SvMr> = Box::new(SvMr {
        vmr,
        ctx: c,
        index,
        dm,
    });
    mr.vmr.ibv_mr.lkey = key;
    mr.vmr.ibv_mr.rkey = key;
    mr.vmr.ibv_mr.handle = key;
    mr.vmr.access = info.access as c_int;
    Box::into_raw(mr).cast()
}

/// `rereg_mr`: change a region's translation, PD and/or access in place;
/// its keys stay the same. EBUSY while a memory window is bound to it. The slot is unpublished while it changes, so a
/// peer's access in that instant fails with a protection error instead of
/// seeing a half-changed region (using a region during its
/// re-registration is the application's error, `ibv_rereg_mr(3)`).
/// Returns 0 or an errno value (libibverbs turns it into
/// `IBV_REREG_MR_ERR_CMD`) and sets errno.
///
/// # Safety
/// `vmr` was made by [`reg_mr`]; `pd`, when `CHANGE_PD` is asked, is a PD of
/// this provider.
pub unsafe extern "C" fn rereg_mr(
    vmr: *mut VerbsMr,
    flags: c_int,
    pd: *mut ibv::ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    use crate::model::mr::rereg;
    // SAFETY: `vmr` heads a live boxed SvMr (caller contract).
    let mr = unsafe { &mut *vmr.cast::<SvMr>() };
    // SAFETY: the context outlives its MRs.
    let c = unsafe { &*mr.ctx };
    let fail = |e: i32| {
        set_errno(e);
        e
    };
    if c.dead() {
        return fail(DEAD_ERRNO);
    }
    let flags = flags as u32;
    // A region on device memory keeps its place there (ibv_reg_dm_mr).
    if flags == 0 || flags & !rereg::ALL != 0 || !mr.dm.is_null() {
        return fail(libc::EINVAL);
    }
    // Windows bound to the region were bound to its old translation.
    if c.mrs()
        .iter()
        .any(|s| s.parent.load(Ordering::Acquire) == mr.index && s.key.load(Ordering::Acquire) != 0)
    {
        return fail(libc::EBUSY);
    }
    let slot = &c.mrs()[mr.index as usize];
    let key = slot.key.load(Ordering::Acquire);
    let Some(mut info) = layout::mr_lookup(c.mrs(), key) else {
        return fail(libc::EINVAL);
    };
    if flags & rereg::CHANGE_PD != 0 {
        // SAFETY: caller contract.
        if pd.is_null() || unsafe { (*pd).context } != mr.vmr.ibv_mr.context {
            return fail(libc::EINVAL);
        }
        // SAFETY: a PD of this provider (checked: same context).
        info.pd = unsafe { pd_id(pd) };
    }
    if flags & rereg::CHANGE_TRANSLATION != 0 {
        info.addr = addr as u64;
        info.iova = addr as u64;
        info.len = length as u64;
    }
    if flags & rereg::CHANGE_ACCESS != 0 {
        info.access = access as u32;
    }
    if let Some(e) = crate::model::mr::reg_error(info.access, info.addr, info.len) {
        return fail(e);
    }
    slot.key.store(0, Ordering::Release);
    layout::mr_publish(slot, key, info);
    mr.vmr.access = info.access as c_int;
    0
}

/// `advise_mr` (`ibv_advise_mr(3)`): prefetch ranges of on-demand-paging
/// regions. Every range must lie in a region of `pd` registered with
/// `IBV_ACCESS_ON_DEMAND` (with local write for write advice): else
/// EINVAL. The pages are faulted in with `madvise(MADV_POPULATE_READ /
/// _WRITE)`, readable or writable as advised; `PREFETCH_NO_FAULT` maps
/// only what is present, which for this device (it reaches memory through
/// the owner's page tables at every access) is nothing to do. A failed
/// populate (pages since unmapped, a kernel older than 5.14) is not an
/// error: advice is a hint, the access itself faults again.
/// `IBV_ADVISE_MR_FLAG_FLUSH` is honoured trivially: the work is done
/// before the call returns.
///
/// # Safety
/// `pd` is a PD of this provider; `sg` holds `num_sge` entries.
pub unsafe extern "C" fn advise_mr(
    pd: *mut ibv::ibv_pd,
    advice: u32,
    flags: u32,
    sg: *mut ibv::ibv_sge,
    num_sge: u32,
) -> c_int {
    use crate::model::mr::{self as m, advise};
    // SAFETY: caller contract.
    let (c, pdid) = unsafe { (inner((*pd).context), pd_id(pd)) };
    if c.dead() {
        return DEAD_ERRNO;
    }
    if let Some(e) = m::advise_error(advice, flags, num_sge) {
        return e;
    }
    if sg.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: `sg` holds num_sge entries (caller contract).
    let sges = unsafe { std::slice::from_raw_parts(sg, num_sge as usize) };
    for s in sges {
        let ok = layout::mr_lookup(c.mrs(), s.lkey).is_some_and(|i| {
            i.pd == pdid
                && i.access & m::ON_DEMAND != 0
                && i.access & m::advise_needs(advice) == m::advise_needs(advice)
                && i.contains(s.addr, u64::from(s.length))
        });
        if !ok {
            return libc::EINVAL;
        }
    }
    if advice == advise::PREFETCH_NO_FAULT {
        return 0;
    }
    let how = if advice == advise::PREFETCH_WRITE {
        libc::MADV_POPULATE_WRITE
    } else {
        libc::MADV_POPULATE_READ
    };
    let page = 4096u64;
    for s in sges.iter().filter(|s| s.length > 0) {
        let start = s.addr & !(page - 1);
        let end = s.addr.saturating_add(u64::from(s.length));
        // SAFETY: madvise on a range of our own address space inside a
        // registered region; POPULATE only faults pages in, it changes no
        // content, and an unmapped range is an error return, not a fault.
        unsafe { libc::madvise(start as usize as *mut c_void, (end - start) as usize, how) };
    }
    0
}

/// `dereg_mr`: EBUSY while a memory window is bound to the region
/// (model::mr::mw).
///
/// # Safety
/// `vmr` was made by [`reg_mr`]; on success it is not used afterwards.
pub unsafe extern "C" fn dereg_mr(vmr: *mut VerbsMr) -> c_int {
    {
        // SAFETY: `vmr` heads a live boxed SvMr (caller contract).
        let mr = unsafe { &*vmr.cast::<SvMr>() };
        // SAFETY: the context outlives its MRs (verbs rule: dereg before close).
        let c = unsafe { &*mr.ctx };
        let bound = c.mrs().iter().any(|s| {
            s.parent.load(Ordering::Acquire) == mr.index && s.key.load(Ordering::Acquire) != 0
        });
        if bound {
            return libc::EBUSY;
        }
    }
    // SAFETY: `vmr` heads a boxed SvMr (reg_mr); this is its last use.
    let mr = unsafe { Box::from_raw(vmr.cast::<SvMr>()) };
    // SAFETY: the context outlives its MRs (verbs rule: dereg before close).
    let c = unsafe { &*mr.ctx };
    c.mrs()[mr.index as usize].key.store(0, Ordering::Release);
    if !mr.dm.is_null() {
        // SAFETY: a device memory outlives its regions: free_dm answers
        // EBUSY while this count is non-zero.
        unsafe { (*mr.dm).users.fetch_sub(1, Ordering::AcqRel) };
    }
    c.give_slot(mr.index);
    0
}

crate::opaque_debug!(SvPd);
crate::opaque_debug!(SvContext);
