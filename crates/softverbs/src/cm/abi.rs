//! The kernel's `rdma_ucm` command interface (ABI version 4), the structures
//! librdmacm writes to the `rdma_cm` character device. Written from the
//! kernel's UAPI header `rdma/rdma_user_cm.h`; sizes and offsets are checked
//! by the tests below.

#![allow(missing_docs, missing_debug_implementations)]

use libc::sockaddr_in6;

/// `RDMA_USER_CM_ABI_VERSION`.
pub const ABI_VERSION: u32 = 4;
/// `RDMA_MAX_PRIVATE_DATA`.
pub const MAX_PRIVATE_DATA: usize = 256;

pub mod cmd {
    pub const CREATE_ID: u32 = 0;
    pub const DESTROY_ID: u32 = 1;
    pub const BIND_IP: u32 = 2;
    pub const RESOLVE_IP: u32 = 3;
    pub const RESOLVE_ROUTE: u32 = 4;
    pub const QUERY_ROUTE: u32 = 5;
    pub const CONNECT: u32 = 6;
    pub const LISTEN: u32 = 7;
    pub const ACCEPT: u32 = 8;
    pub const REJECT: u32 = 9;
    pub const DISCONNECT: u32 = 10;
    pub const INIT_QP_ATTR: u32 = 11;
    pub const GET_EVENT: u32 = 12;
    pub const GET_OPTION: u32 = 13;
    pub const SET_OPTION: u32 = 14;
    pub const NOTIFY: u32 = 15;
    pub const JOIN_IP_MCAST: u32 = 16;
    pub const LEAVE_MCAST: u32 = 17;
    pub const MIGRATE_ID: u32 = 18;
    pub const QUERY: u32 = 19;
    pub const BIND: u32 = 20;
    pub const RESOLVE_ADDR: u32 = 21;
    pub const JOIN_MCAST: u32 = 22;
}

/// `enum rdma_cm_event_type`.
pub mod event {
    pub const ADDR_RESOLVED: u32 = 0;
    pub const ADDR_ERROR: u32 = 1;
    pub const ROUTE_RESOLVED: u32 = 2;
    pub const ROUTE_ERROR: u32 = 3;
    pub const CONNECT_REQUEST: u32 = 4;
    pub const CONNECT_RESPONSE: u32 = 5;
    pub const CONNECT_ERROR: u32 = 6;
    pub const UNREACHABLE: u32 = 7;
    pub const REJECTED: u32 = 8;
    pub const ESTABLISHED: u32 = 9;
    pub const DISCONNECTED: u32 = 10;
    pub const DEVICE_REMOVAL: u32 = 11;
    pub const MULTICAST_JOIN: u32 = 12;
    pub const MULTICAST_ERROR: u32 = 13;
    pub const ADDR_CHANGE: u32 = 14;
    pub const TIMEWAIT_EXIT: u32 = 15;
}

/// Port spaces (`enum rdma_ucm_port_space`).
pub mod ps {
    pub const IPOIB: u16 = 0x0002;
    pub const IB: u16 = 0x013F;
    pub const TCP: u16 = 0x0106;
    pub const UDP: u16 = 0x0111;
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CmdHdr {
    pub cmd: u32,
    pub in_: u16,
    pub out: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CreateId {
    pub uid: u64,
    pub response: u64,
    pub ps: u16,
    pub qp_type: u8,
    pub reserved: [u8; 5],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct CreateIdResp {
    pub id: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct DestroyId {
    pub response: u64,
    pub id: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EventsReported {
    pub events_reported: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BindIp {
    pub response: u64,
    pub addr: sockaddr_in6,
    pub id: u32,
}

/// `struct __kernel_sockaddr_storage`.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub struct SockaddrStorage {
    pub bytes: [u8; 128],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Bind {
    pub id: u32,
    pub addr_size: u16,
    pub reserved: u16,
    pub addr: SockaddrStorage,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ResolveIp {
    pub src_addr: sockaddr_in6,
    pub dst_addr: sockaddr_in6,
    pub id: u32,
    pub timeout_ms: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ResolveAddr {
    pub id: u32,
    pub timeout_ms: u32,
    pub src_size: u16,
    pub dst_size: u16,
    pub reserved: u32,
    pub src_addr: SockaddrStorage,
    pub dst_addr: SockaddrStorage,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ResolveRoute {
    pub id: u32,
    pub timeout_ms: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Query {
    pub response: u64,
    pub id: u32,
    pub option: u32,
}

/// `struct ib_user_path_rec`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct UserPathRec {
    pub dgid: [u8; 16],
    pub sgid: [u8; 16],
    pub dlid: u16,
    pub slid: u16,
    pub raw_traffic: u32,
    pub flow_label: u32,
    pub reversible: u32,
    pub mtu: u32,
    pub pkey: u16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub numb_path: u8,
    pub sl: u8,
    pub mtu_selector: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct QueryRouteResp {
    pub node_guid: u64,
    pub ib_route: [UserPathRec; 2],
    pub src_addr: sockaddr_in6,
    pub dst_addr: sockaddr_in6,
    pub num_paths: u32,
    pub port_num: u8,
    pub reserved: [u8; 3],
    pub ibdev_index: u32,
    pub reserved1: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ConnParam {
    pub qp_num: u32,
    pub qkey: u32,
    pub private_data: [u8; MAX_PRIVATE_DATA],
    pub private_data_len: u8,
    pub srq: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub valid: u8,
}

/// `struct ib_uverbs_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reserved: u8,
}

/// `struct ib_uverbs_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct AhAttr {
    pub grh: GlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
    pub reserved: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct UdParam {
    pub qp_num: u32,
    pub qkey: u32,
    pub ah_attr: AhAttr,
    pub private_data: [u8; MAX_PRIVATE_DATA],
    pub private_data_len: u8,
    pub reserved: [u8; 7],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Ece {
    pub vendor_id: u32,
    pub attr_mod: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Connect {
    pub conn_param: ConnParam,
    pub id: u32,
    pub reserved: u32,
    pub ece: Ece,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Listen {
    pub id: u32,
    pub backlog: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Accept {
    pub uid: u64,
    pub conn_param: ConnParam,
    pub id: u32,
    pub reserved: u32,
    pub ece: Ece,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Reject {
    pub id: u32,
    pub private_data_len: u8,
    pub reason: u8,
    pub reserved: [u8; 2],
    pub private_data: [u8; MAX_PRIVATE_DATA],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Disconnect {
    pub id: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct InitQpAttr {
    pub response: u64,
    pub id: u32,
    pub qp_state: u32,
}

/// `struct ib_uverbs_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct KernQpAttr {
    pub qp_attr_mask: u32,
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub ah_attr: AhAttr,
    pub alt_ah_attr: AhAttr,
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub reserved: [u8; 5],
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Notify {
    pub id: u32,
    pub event: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct GetEvent {
    pub response: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union EventParam {
    pub conn: ConnParam,
    pub ud: UdParam,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EventResp {
    pub uid: u64,
    pub id: u32,
    pub event: u32,
    pub status: u32,
    pub param: EventParam,
    pub reserved: u32,
    pub ece: Ece,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct SetOption {
    pub optval: u64,
    pub id: u32,
    pub level: u32,
    pub optname: u32,
    pub optlen: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct MigrateId {
    pub response: u64,
    pub id: u32,
    pub fd: u32,
}

/// `struct rdma_ucm_join_ip_mcast` (the answer is a `CreateIdResp`: the
/// group's handle).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct JoinIpMcast {
    pub response: u64,
    pub uid: u64,
    pub addr: sockaddr_in6,
    pub id: u32,
}

/// `struct rdma_ucm_join_mcast`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct JoinMcast {
    pub response: u64,
    pub uid: u64,
    pub id: u32,
    pub addr_size: u16,
    pub join_flags: u16,
    pub addr: SockaddrStorage,
}

/// `rdma_cm_join_mc_attr_ex` join flags.
pub mod join_flag {
    pub const FULLMEMBER: u16 = 0;
    pub const SENDONLY_FULLMEMBER: u16 = 1;
}

/// A structure of this module that every bit pattern is valid for.
///
/// # Safety
/// Implementors are `repr(C)` plain data with no invalid bit patterns.
pub unsafe trait Pod: Copy {
    /// All bytes zero.
    fn zeroed() -> Self {
        // SAFETY: the trait's contract: every bit pattern, zeros included,
        // is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

macro_rules! pod {
    ($($t:ty),*) => { $(
        // SAFETY: repr(C) structs of integers, byte arrays, sockaddr_in6
        // and unions of those: every bit pattern is valid.
        unsafe impl Pod for $t {}
    )* };
}
pod!(
    CmdHdr,
    CreateId,
    CreateIdResp,
    DestroyId,
    EventsReported,
    BindIp,
    Bind,
    ResolveIp,
    ResolveAddr,
    ResolveRoute,
    Query,
    QueryRouteResp,
    ConnParam,
    UdParam,
    Connect,
    Listen,
    Accept,
    Reject,
    Disconnect,
    InitQpAttr,
    KernQpAttr,
    Notify,
    GetEvent,
    EventResp,
    SetOption,
    MigrateId,
    JoinIpMcast,
    JoinMcast
);

impl ConnParam {
    /// The private data as a slice (length clamped to the array).
    pub fn pdata(&self) -> &[u8] {
        &self.private_data[..usize::from(self.private_data_len).min(MAX_PRIVATE_DATA)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn sizes_match_the_kernel_header() {
        assert_eq!(size_of::<CmdHdr>(), 8);
        assert_eq!(size_of::<CreateId>(), 24);
        assert_eq!(size_of::<DestroyId>(), 16);
        assert_eq!(size_of::<BindIp>(), 40);
        assert_eq!(size_of::<JoinIpMcast>(), 48);
        assert_eq!(offset_of!(JoinIpMcast, id), 44);
        assert_eq!(size_of::<JoinMcast>(), 152);
        assert_eq!(offset_of!(JoinMcast, addr), 24);
        assert_eq!(size_of::<Bind>(), 136);
        assert_eq!(size_of::<ResolveIp>(), 64);
        assert_eq!(size_of::<ResolveAddr>(), 272);
        assert_eq!(size_of::<ResolveRoute>(), 8);
        assert_eq!(size_of::<Query>(), 16);
        assert_eq!(size_of::<UserPathRec>(), 64);
        assert_eq!(size_of::<QueryRouteResp>(), 208);
        assert_eq!(size_of::<ConnParam>(), 272);
        assert_eq!(size_of::<AhAttr>(), 32);
        assert_eq!(size_of::<UdParam>(), 304);
        assert_eq!(size_of::<Connect>(), 288);
        assert_eq!(size_of::<Listen>(), 8);
        assert_eq!(size_of::<Accept>(), 296);
        assert_eq!(size_of::<Reject>(), 264);
        assert_eq!(size_of::<InitQpAttr>(), 16);
        assert_eq!(size_of::<KernQpAttr>(), 144);
        assert_eq!(size_of::<EventResp>(), 336);
        assert_eq!(size_of::<SetOption>(), 24);
        assert_eq!(size_of::<MigrateId>(), 16);
        assert_eq!(align_of::<EventParam>(), 4);
    }

    #[test]
    fn offsets_match_the_kernel_header() {
        assert_eq!(offset_of!(BindIp, id), 36);
        assert_eq!(offset_of!(ResolveIp, id), 56);
        assert_eq!(offset_of!(QueryRouteResp, src_addr), 136);
        assert_eq!(offset_of!(QueryRouteResp, num_paths), 192);
        assert_eq!(offset_of!(QueryRouteResp, port_num), 196);
        assert_eq!(offset_of!(QueryRouteResp, ibdev_index), 200);
        assert_eq!(offset_of!(ConnParam, private_data_len), 264);
        assert_eq!(offset_of!(ConnParam, valid), 271);
        assert_eq!(offset_of!(Connect, id), 272);
        assert_eq!(offset_of!(Accept, id), 280);
        assert_eq!(offset_of!(Reject, private_data), 8);
        assert_eq!(offset_of!(KernQpAttr, ah_attr), 40);
        assert_eq!(offset_of!(KernQpAttr, max_send_wr), 104);
        assert_eq!(offset_of!(KernQpAttr, pkey_index), 124);
        assert_eq!(offset_of!(KernQpAttr, max_rd_atomic), 130);
        assert_eq!(offset_of!(KernQpAttr, port_num), 133);
        assert_eq!(offset_of!(EventResp, param), 20);
        assert_eq!(offset_of!(EventResp, reserved), 324);
        assert_eq!(offset_of!(EventResp, ece), 328);
        assert_eq!(offset_of!(UserPathRec, pkey), 52);
        assert_eq!(offset_of!(UserPathRec, preference), 63);
    }
}
