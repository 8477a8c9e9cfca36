//! The private provider ABI 34 of libibverbs, mirrored from rdma-core v44.0
//! `libibverbs/driver.h`. Debian does not ship that header, so these layouts
//! are written here by hand; field order follows v44 exactly and the layout
//! tests at the bottom pin sizes and offsets.

use std::ffi::{c_char, c_int, c_void};

use super::ibv;

/// `VERBS_MATCH_SENTINEL`: ends a match table.
pub const VERBS_MATCH_SENTINEL: u8 = 0;
/// `VERBS_MATCH_MODALIAS`: `u.modalias` is an fnmatch pattern.
pub const VERBS_MATCH_MODALIAS: u8 = 2;

/// `struct verbs_match_ent`.
#[repr(C)]
#[derive(Debug)]
pub struct VerbsMatchEnt {
    /// `driver_data`.
    pub driver_data: *const c_void,
    /// `u.modalias` (the union's other member, `driver_id`, is unused here).
    pub modalias: *const c_char,
    /// `vendor`.
    pub vendor: u16,
    /// `device`.
    pub device: u16,
    /// `kind`, one of the `VERBS_MATCH_*` values.
    pub kind: u8,
}

// SAFETY: a match table is immutable static data: its pointers name other
// statics ('static C strings) and are never written through.
unsafe impl Sync for VerbsMatchEnt {}

/// `struct list_node` from ccan/list.
#[repr(C)]
#[derive(Debug)]
pub struct ListNode {
    /// `next`.
    pub next: *mut ListNode,
    /// `prev`.
    pub prev: *mut ListNode,
}

/// `struct verbs_sysfs_dev`: opaque here, the provider only passes it around.
#[repr(C)]
#[derive(Debug)]
pub struct VerbsSysfsDev {
    _opaque: [u8; 0],
}

/// An `alloc_context` callback.
pub type AllocContextFn =
    unsafe extern "C" fn(*mut ibv::ibv_device, c_int, *mut c_void) -> *mut ibv::verbs_context;

/// `struct verbs_device_ops`.
#[repr(C)]
#[derive(Debug)]
pub struct VerbsDeviceOps {
    /// `name`.
    pub name: *const c_char,
    /// `match_min_abi_version`.
    pub match_min_abi_version: u32,
    /// `match_max_abi_version`.
    pub match_max_abi_version: u32,
    /// `match_table`, ended by a sentinel entry.
    pub match_table: *const VerbsMatchEnt,
    /// `static_providers`.
    pub static_providers: *const *const VerbsDeviceOps,
    /// `match_device`.
    pub match_device: Option<unsafe extern "C" fn(*mut VerbsSysfsDev) -> bool>,
    /// `alloc_context`.
    pub alloc_context: Option<AllocContextFn>,
    /// `import_context`.
    pub import_context:
        Option<unsafe extern "C" fn(*mut ibv::ibv_device, c_int) -> *mut ibv::verbs_context>,
    /// `alloc_device`.
    pub alloc_device: Option<unsafe extern "C" fn(*mut VerbsSysfsDev) -> *mut VerbsDevice>,
    /// `uninit_device`.
    pub uninit_device: Option<unsafe extern "C" fn(*mut VerbsDevice)>,
}

// SAFETY: the ops table is immutable static data (function pointers and
// pointers to other statics); libibverbs only reads it.
unsafe impl Sync for VerbsDeviceOps {}

/// `struct verbs_device`.
#[repr(C)]
pub struct VerbsDevice {
    /// `device`: must be first.
    pub device: ibv::ibv_device,
    /// `ops`.
    pub ops: *const VerbsDeviceOps,
    /// `refcount` (`atomic_int`).
    pub refcount: c_int,
    /// `entry`.
    pub entry: ListNode,
    /// `sysfs`.
    pub sysfs: *mut VerbsSysfsDev,
    /// `core_support`.
    pub core_support: u64,
}

/// `struct verbs_mr`.
#[repr(C)]
pub struct VerbsMr {
    /// `ibv_mr`.
    pub ibv_mr: ibv::ibv_mr,
    /// `mr_type` (`IBV_MR_TYPE_MR` = 0).
    pub mr_type: u32,
    /// `access`.
    pub access: c_int,
}

/// `struct verbs_qp`: the union of `ibv_qp` and `ibv_qp_ex` (the larger),
/// then `comp_mask` and `xrcd`.
#[repr(C)]
pub struct VerbsQp {
    /// The `ibv_qp_ex` arm of the union; `qp_base` (an `ibv_qp`) is at offset 0.
    pub qp_ex: ibv::ibv_qp_ex,
    /// `comp_mask`: 0, so `ibv_qp_to_qp_ex` answers NULL.
    pub comp_mask: u32,
    /// `xrcd`.
    pub xrcd: *mut c_void,
}

impl std::fmt::Debug for VerbsQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VerbsQp")
            .field("comp_mask", &self.comp_mask)
            .finish()
    }
}

/// `struct verbs_srq`.
#[repr(C)]
pub struct VerbsSrq {
    /// `srq`.
    pub srq: ibv::ibv_srq,
    /// `srq_type` (`IBV_SRQT_BASIC` = 0).
    pub srq_type: u32,
    /// `xrcd`.
    pub xrcd: *mut c_void,
    /// `cq`.
    pub cq: *mut ibv::ibv_cq,
    /// `srq_num`.
    pub srq_num: u32,
}

/// An operation slot this provider leaves empty (libibverbs then answers
/// EOPNOTSUPP/ENOSYS through its dummy ops).
pub type Unused = Option<unsafe extern "C" fn()>;

/// `struct verbs_context_ops` (76 function pointers in v44, alphabetical).
#[repr(C)]
#[derive(Debug, Default)]
#[allow(missing_docs)]
pub struct VerbsContextOps {
    pub advise_mr:
        Option<unsafe extern "C" fn(*mut ibv::ibv_pd, u32, u32, *mut ibv::ibv_sge, u32) -> c_int>,
    pub alloc_dm: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *mut ibv::ibv_alloc_dm_attr,
        ) -> *mut ibv::ibv_dm,
    >,
    pub alloc_mw: Option<unsafe extern "C" fn(*mut ibv::ibv_pd, u32) -> *mut ibv::ibv_mw>,
    pub alloc_null_mr: Unused,
    pub alloc_parent_domain: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *mut ibv::ibv_parent_domain_init_attr,
        ) -> *mut ibv::ibv_pd,
    >,
    pub alloc_pd: Option<unsafe extern "C" fn(*mut ibv::ibv_context) -> *mut ibv::ibv_pd>,
    pub alloc_td: Option<
        unsafe extern "C" fn(*mut ibv::ibv_context, *mut ibv::ibv_td_init_attr) -> *mut ibv::ibv_td,
    >,
    pub async_event: Option<unsafe extern "C" fn(*mut ibv::ibv_context, *mut ibv::ibv_async_event)>,
    pub attach_counters_point_flow: Unused,
    pub attach_mcast:
        Option<unsafe extern "C" fn(*mut ibv::ibv_qp, *const ibv::ibv_gid, u16) -> c_int>,
    pub bind_mw: Option<
        unsafe extern "C" fn(*mut ibv::ibv_qp, *mut ibv::ibv_mw, *mut ibv::ibv_mw_bind) -> c_int,
    >,
    pub close_xrcd: Option<unsafe extern "C" fn(*mut ibv::ibv_xrcd) -> c_int>,
    pub cq_event: Option<unsafe extern "C" fn(*mut ibv::ibv_cq)>,
    pub create_ah:
        Option<unsafe extern "C" fn(*mut ibv::ibv_pd, *mut ibv::ibv_ah_attr) -> *mut ibv::ibv_ah>,
    pub create_counters: Unused,
    pub create_cq: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            c_int,
            *mut ibv::ibv_comp_channel,
            c_int,
        ) -> *mut ibv::ibv_cq,
    >,
    pub create_cq_ex: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *mut ibv::ibv_cq_init_attr_ex,
        ) -> *mut ibv::ibv_cq_ex,
    >,
    pub create_flow: Unused,
    pub create_flow_action_esp: Unused,
    pub create_qp: Option<
        unsafe extern "C" fn(*mut ibv::ibv_pd, *mut ibv::ibv_qp_init_attr) -> *mut ibv::ibv_qp,
    >,
    pub create_qp_ex: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *mut ibv::ibv_qp_init_attr_ex,
        ) -> *mut ibv::ibv_qp,
    >,
    pub create_rwq_ind_table: Unused,
    pub create_srq: Option<
        unsafe extern "C" fn(*mut ibv::ibv_pd, *mut ibv::ibv_srq_init_attr) -> *mut ibv::ibv_srq,
    >,
    pub create_srq_ex: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *mut ibv::ibv_srq_init_attr_ex,
        ) -> *mut ibv::ibv_srq,
    >,
    pub create_wq: Unused,
    pub dealloc_mw: Option<unsafe extern "C" fn(*mut ibv::ibv_mw) -> c_int>,
    pub dealloc_pd: Option<unsafe extern "C" fn(*mut ibv::ibv_pd) -> c_int>,
    pub dealloc_td: Option<unsafe extern "C" fn(*mut ibv::ibv_td) -> c_int>,
    pub dereg_mr: Option<unsafe extern "C" fn(*mut VerbsMr) -> c_int>,
    pub destroy_ah: Option<unsafe extern "C" fn(*mut ibv::ibv_ah) -> c_int>,
    pub destroy_counters: Unused,
    pub destroy_cq: Option<unsafe extern "C" fn(*mut ibv::ibv_cq) -> c_int>,
    pub destroy_flow: Unused,
    pub destroy_flow_action: Unused,
    pub destroy_qp: Option<unsafe extern "C" fn(*mut ibv::ibv_qp) -> c_int>,
    pub destroy_rwq_ind_table: Unused,
    pub destroy_srq: Option<unsafe extern "C" fn(*mut ibv::ibv_srq) -> c_int>,
    pub destroy_wq: Unused,
    pub detach_mcast:
        Option<unsafe extern "C" fn(*mut ibv::ibv_qp, *const ibv::ibv_gid, u16) -> c_int>,
    pub free_context: Option<unsafe extern "C" fn(*mut ibv::ibv_context)>,
    pub free_dm: Option<unsafe extern "C" fn(*mut ibv::ibv_dm) -> c_int>,
    pub get_srq_num: Option<unsafe extern "C" fn(*mut ibv::ibv_srq, *mut u32) -> c_int>,
    pub import_dm: Unused,
    pub import_mr: Unused,
    pub import_pd: Unused,
    pub modify_cq: Unused,
    pub modify_flow_action_esp: Unused,
    pub modify_qp:
        Option<unsafe extern "C" fn(*mut ibv::ibv_qp, *mut ibv::ibv_qp_attr, c_int) -> c_int>,
    pub modify_qp_rate_limit: Unused,
    pub modify_srq:
        Option<unsafe extern "C" fn(*mut ibv::ibv_srq, *mut ibv::ibv_srq_attr, c_int) -> c_int>,
    pub modify_wq: Unused,
    pub open_qp: Unused,
    pub open_xrcd: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *mut ibv::ibv_xrcd_init_attr,
        ) -> *mut ibv::ibv_xrcd,
    >,
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv::ibv_cq, c_int, *mut ibv::ibv_wc) -> c_int>,
    pub post_recv: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_qp,
            *mut ibv::ibv_recv_wr,
            *mut *mut ibv::ibv_recv_wr,
        ) -> c_int,
    >,
    pub post_send: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_qp,
            *mut ibv::ibv_send_wr,
            *mut *mut ibv::ibv_send_wr,
        ) -> c_int,
    >,
    pub post_srq_ops: Unused,
    pub post_srq_recv: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_srq,
            *mut ibv::ibv_recv_wr,
            *mut *mut ibv::ibv_recv_wr,
        ) -> c_int,
    >,
    pub query_device_ex: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_context,
            *const ibv::ibv_query_device_ex_input,
            *mut ibv::ibv_device_attr_ex,
            usize,
        ) -> c_int,
    >,
    pub query_ece: Unused,
    pub query_port:
        Option<unsafe extern "C" fn(*mut ibv::ibv_context, u8, *mut ibv::ibv_port_attr) -> c_int>,
    pub query_qp: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_qp,
            *mut ibv::ibv_qp_attr,
            c_int,
            *mut ibv::ibv_qp_init_attr,
        ) -> c_int,
    >,
    pub query_qp_data_in_order: Unused,
    pub query_rt_values:
        Option<unsafe extern "C" fn(*mut ibv::ibv_context, *mut ibv::ibv_values_ex) -> c_int>,
    pub query_srq: Option<unsafe extern "C" fn(*mut ibv::ibv_srq, *mut ibv::ibv_srq_attr) -> c_int>,
    pub read_counters: Unused,
    pub reg_dm_mr: Option<
        unsafe extern "C" fn(
            *mut ibv::ibv_pd,
            *mut ibv::ibv_dm,
            u64,
            usize,
            u32,
        ) -> *mut ibv::ibv_mr,
    >,
    pub reg_dmabuf_mr: Unused,
    pub reg_mr: Option<
        unsafe extern "C" fn(*mut ibv::ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ibv::ibv_mr,
    >,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv::ibv_cq, c_int) -> c_int>,
    pub rereg_mr: Option<
        unsafe extern "C" fn(
            *mut VerbsMr,
            c_int,
            *mut ibv::ibv_pd,
            *mut c_void,
            usize,
            c_int,
        ) -> c_int,
    >,
    pub resize_cq: Option<unsafe extern "C" fn(*mut ibv::ibv_cq, c_int) -> c_int>,
    pub set_ece: Unused,
    pub unimport_dm: Unused,
    pub unimport_mr: Unused,
    pub unimport_pd: Unused,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    const P: usize = size_of::<usize>();

    #[test]
    fn verbs_context_ops_has_76_slots_in_v44_order() {
        assert_eq!(size_of::<VerbsContextOps>(), 76 * P);
        // Spot checks: index (0-based) of the slot in driver.h v44.
        assert_eq!(offset_of!(VerbsContextOps, alloc_pd), 5 * P);
        assert_eq!(offset_of!(VerbsContextOps, async_event), 7 * P);
        assert_eq!(offset_of!(VerbsContextOps, cq_event), 12 * P);
        assert_eq!(offset_of!(VerbsContextOps, create_cq), 15 * P);
        assert_eq!(offset_of!(VerbsContextOps, create_cq_ex), 16 * P);
        assert_eq!(offset_of!(VerbsContextOps, create_qp), 19 * P);
        assert_eq!(offset_of!(VerbsContextOps, create_srq), 22 * P);
        assert_eq!(offset_of!(VerbsContextOps, dealloc_pd), 26 * P);
        assert_eq!(offset_of!(VerbsContextOps, dereg_mr), 28 * P);
        assert_eq!(offset_of!(VerbsContextOps, destroy_cq), 31 * P);
        assert_eq!(offset_of!(VerbsContextOps, destroy_qp), 34 * P);
        assert_eq!(offset_of!(VerbsContextOps, destroy_srq), 36 * P);
        assert_eq!(offset_of!(VerbsContextOps, free_context), 39 * P);
        assert_eq!(offset_of!(VerbsContextOps, modify_qp), 47 * P);
        assert_eq!(offset_of!(VerbsContextOps, modify_srq), 49 * P);
        assert_eq!(offset_of!(VerbsContextOps, poll_cq), 53 * P);
        assert_eq!(offset_of!(VerbsContextOps, post_recv), 54 * P);
        assert_eq!(offset_of!(VerbsContextOps, post_send), 55 * P);
        assert_eq!(offset_of!(VerbsContextOps, post_srq_recv), 57 * P);
        assert_eq!(offset_of!(VerbsContextOps, query_device_ex), 58 * P);
        assert_eq!(offset_of!(VerbsContextOps, query_port), 60 * P);
        assert_eq!(offset_of!(VerbsContextOps, query_qp), 61 * P);
        assert_eq!(offset_of!(VerbsContextOps, query_srq), 64 * P);
        assert_eq!(offset_of!(VerbsContextOps, reg_mr), 68 * P);
        assert_eq!(offset_of!(VerbsContextOps, req_notify_cq), 69 * P);
        assert_eq!(offset_of!(VerbsContextOps, unimport_pd), 75 * P);
    }

    #[test]
    fn verbs_device_ops_layout() {
        assert_eq!(offset_of!(VerbsDeviceOps, match_min_abi_version), 8);
        assert_eq!(offset_of!(VerbsDeviceOps, match_max_abi_version), 12);
        assert_eq!(offset_of!(VerbsDeviceOps, match_table), 16);
        assert_eq!(offset_of!(VerbsDeviceOps, static_providers), 24);
        assert_eq!(offset_of!(VerbsDeviceOps, match_device), 32);
        assert_eq!(offset_of!(VerbsDeviceOps, alloc_context), 40);
        assert_eq!(offset_of!(VerbsDeviceOps, import_context), 48);
        assert_eq!(offset_of!(VerbsDeviceOps, alloc_device), 56);
        assert_eq!(offset_of!(VerbsDeviceOps, uninit_device), 64);
        assert_eq!(size_of::<VerbsDeviceOps>(), 72);
    }

    #[test]
    fn verbs_device_layout() {
        // ibv_device: _ops (2 pointers) + node_type + transport_type + 64 + 64 + 256 + 256.
        assert_eq!(size_of::<ibv::ibv_device>(), 16 + 8 + 64 + 64 + 256 + 256);
        let base = size_of::<ibv::ibv_device>();
        assert_eq!(offset_of!(VerbsDevice, ops), base);
        assert_eq!(offset_of!(VerbsDevice, refcount), base + 8);
        assert_eq!(offset_of!(VerbsDevice, entry), base + 16);
        assert_eq!(offset_of!(VerbsDevice, sysfs), base + 32);
        assert_eq!(offset_of!(VerbsDevice, core_support), base + 40);
        assert_eq!(size_of::<VerbsDevice>(), base + 48);
    }

    #[test]
    fn match_ent_mr_qp_srq_layout() {
        assert_eq!(offset_of!(VerbsMatchEnt, modalias), 8);
        assert_eq!(offset_of!(VerbsMatchEnt, vendor), 16);
        assert_eq!(offset_of!(VerbsMatchEnt, device), 18);
        assert_eq!(offset_of!(VerbsMatchEnt, kind), 20);
        assert_eq!(size_of::<VerbsMatchEnt>(), 24);
        assert_eq!(size_of::<ibv::ibv_mr>(), 48);
        assert_eq!(offset_of!(VerbsMr, mr_type), 48);
        assert_eq!(offset_of!(VerbsMr, access), 52);
        assert_eq!(offset_of!(VerbsQp, comp_mask), size_of::<ibv::ibv_qp_ex>());
        assert_eq!(offset_of!(VerbsSrq, srq_type), size_of::<ibv::ibv_srq>());
        assert_eq!(
            offset_of!(VerbsSrq, srq_num),
            size_of::<ibv::ibv_srq>() + 24
        );
    }
}

crate::opaque_debug!(VerbsDevice);

crate::opaque_debug!(VerbsMr);

crate::opaque_debug!(VerbsSrq);
