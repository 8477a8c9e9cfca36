//! Work-completion statuses, opcodes and flags, with the numbers of the verbs
//! ABI (`enum ibv_wc_status`, `enum ibv_wc_opcode`, `enum ibv_wr_opcode`).

/// `enum ibv_wc_status` values this device produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum WcStatus {
    /// `IBV_WC_SUCCESS`.
    Success = 0,
    /// `IBV_WC_LOC_LEN_ERR`: the receive buffer is too short.
    LocLenErr = 1,
    /// `IBV_WC_LOC_QP_OP_ERR`.
    LocQpOpErr = 2,
    /// `IBV_WC_LOC_PROT_ERR`: a local lkey or range is invalid.
    LocProtErr = 4,
    /// `IBV_WC_WR_FLUSH_ERR`: flushed by a QP in the error state.
    WrFlushErr = 5,
    /// `IBV_WC_MW_BIND_ERR`: a memory-window bind or invalidation
    /// (InfiniBand's local memory-management operation error) failed.
    MwBindErr = 6,
    /// `IBV_WC_REM_INV_REQ_ERR`: the responder rejected the request.
    RemInvReqErr = 9,
    /// `IBV_WC_REM_ACCESS_ERR`: bad rkey, range or permission at the responder.
    RemAccessErr = 10,
    /// `IBV_WC_REM_OP_ERR`: the responder failed the operation.
    RemOpErr = 11,
    /// `IBV_WC_RETRY_EXC_ERR`: the responder never answered.
    RetryExcErr = 12,
    /// `IBV_WC_RNR_RETRY_EXC_ERR`: the responder had no receive for the
    /// request through every RNR retry the QP allows.
    RnrRetryExcErr = 13,
}

/// `enum ibv_wc_opcode` values.
pub mod opcode {
    /// `IBV_WC_SEND`.
    pub const SEND: u32 = 0;
    /// `IBV_WC_RDMA_WRITE`.
    pub const RDMA_WRITE: u32 = 1;
    /// `IBV_WC_RDMA_READ`.
    pub const RDMA_READ: u32 = 2;
    /// `IBV_WC_COMP_SWAP`.
    pub const COMP_SWAP: u32 = 3;
    /// `IBV_WC_FETCH_ADD`.
    pub const FETCH_ADD: u32 = 4;
    /// `IBV_WC_BIND_MW`.
    pub const BIND_MW: u32 = 5;
    /// `IBV_WC_LOCAL_INV`.
    pub const LOCAL_INV: u32 = 6;
    /// `IBV_WC_ATOMIC_WRITE`.
    pub const ATOMIC_WRITE: u32 = 9;
    /// `IBV_WC_RECV`.
    pub const RECV: u32 = 128;
    /// `IBV_WC_RECV_RDMA_WITH_IMM`.
    pub const RECV_RDMA_WITH_IMM: u32 = 129;
}

/// `enum ibv_wc_flags`: `IBV_WC_GRH`.
pub const WC_GRH: u32 = 1 << 0;
/// `enum ibv_wc_flags`: `IBV_WC_WITH_IMM`.
pub const WC_WITH_IMM: u32 = 1 << 1;
/// `enum ibv_wc_flags`: `IBV_WC_WITH_INV` (the receive's sender
/// invalidated `invalidated_rkey`).
pub const WC_WITH_INV: u32 = 1 << 3;

/// `enum ibv_wr_opcode` values.
pub mod wr {
    /// `IBV_WR_RDMA_WRITE`.
    pub const RDMA_WRITE: u32 = 0;
    /// `IBV_WR_RDMA_WRITE_WITH_IMM`.
    pub const RDMA_WRITE_WITH_IMM: u32 = 1;
    /// `IBV_WR_SEND`.
    pub const SEND: u32 = 2;
    /// `IBV_WR_SEND_WITH_IMM`.
    pub const SEND_WITH_IMM: u32 = 3;
    /// `IBV_WR_RDMA_READ`.
    pub const RDMA_READ: u32 = 4;
    /// `IBV_WR_ATOMIC_CMP_AND_SWP`.
    pub const ATOMIC_CMP_AND_SWP: u32 = 5;
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD`.
    pub const ATOMIC_FETCH_AND_ADD: u32 = 6;
    /// `IBV_WR_LOCAL_INV`.
    pub const LOCAL_INV: u32 = 7;
    /// `IBV_WR_BIND_MW`.
    pub const BIND_MW: u32 = 8;
    /// `IBV_WR_SEND_WITH_INV`.
    pub const SEND_WITH_INV: u32 = 9;
    /// `IBV_WR_ATOMIC_WRITE`: 8 bytes from the gather list stored at
    /// `wr.rdma.remote_addr` at once (RC and XRC).
    pub const ATOMIC_WRITE: u32 = 15;

    /// Whether the opcode is a remote atomic (RC and XRC).
    pub fn is_atomic(op: u32) -> bool {
        matches!(op, ATOMIC_CMP_AND_SWP | ATOMIC_FETCH_AND_ADD)
    }
}

/// `enum ibv_send_flags`.
pub mod send_flags {
    /// `IBV_SEND_SIGNALED`.
    pub const SIGNALED: u32 = 1 << 1;
    /// `IBV_SEND_SOLICITED`.
    pub const SOLICITED: u32 = 1 << 2;
    /// `IBV_SEND_INLINE`.
    pub const INLINE: u32 = 1 << 3;
}

/// `enum ibv_access_flags`.
pub mod access {
    /// `IBV_ACCESS_LOCAL_WRITE`.
    pub const LOCAL_WRITE: u32 = 1;
    /// `IBV_ACCESS_REMOTE_WRITE`.
    pub const REMOTE_WRITE: u32 = 2;
    /// `IBV_ACCESS_REMOTE_READ`.
    pub const REMOTE_READ: u32 = 4;
    /// `IBV_ACCESS_REMOTE_ATOMIC`.
    pub const REMOTE_ATOMIC: u32 = 8;

    /// Whether `flags` may register a memory region: remote write or
    /// remote atomic access requires local write, as the kernel and every
    /// rdma-core device require (the HCA writes into the region on the
    /// peer's behalf).
    pub fn mr_access_ok(flags: u32) -> bool {
        flags & (REMOTE_WRITE | REMOTE_ATOMIC) == 0 || flags & LOCAL_WRITE != 0
    }
}

/// The send-side completion opcode of a work-request opcode, or `None` for an
/// opcode this device does not support (TSO, atomic write, ...).
pub fn send_wc_opcode(wr_opcode: u32) -> Option<u32> {
    match wr_opcode {
        wr::SEND | wr::SEND_WITH_IMM | wr::SEND_WITH_INV => Some(opcode::SEND),
        wr::BIND_MW => Some(opcode::BIND_MW),
        wr::LOCAL_INV => Some(opcode::LOCAL_INV),
        wr::ATOMIC_WRITE => Some(opcode::ATOMIC_WRITE),
        wr::RDMA_WRITE | wr::RDMA_WRITE_WITH_IMM => Some(opcode::RDMA_WRITE),
        wr::RDMA_READ => Some(opcode::RDMA_READ),
        wr::ATOMIC_CMP_AND_SWP => Some(opcode::COMP_SWAP),
        wr::ATOMIC_FETCH_AND_ADD => Some(opcode::FETCH_ADD),
        _ => None,
    }
}

/// Whether a send work request produces a completion: signaled ones always,
/// and every unsuccessful one whatever its flags.
pub fn send_completes(signaled: bool, status: WcStatus) -> bool {
    signaled || status != WcStatus::Success
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opcodes_map() {
        assert_eq!(send_wc_opcode(wr::SEND_WITH_IMM), Some(opcode::SEND));
        assert_eq!(
            send_wc_opcode(wr::RDMA_WRITE_WITH_IMM),
            Some(opcode::RDMA_WRITE)
        );
        assert_eq!(send_wc_opcode(wr::RDMA_READ), Some(opcode::RDMA_READ));
        assert_eq!(send_wc_opcode(5), Some(opcode::COMP_SWAP));
        assert_eq!(send_wc_opcode(6), Some(opcode::FETCH_ADD));
        assert_eq!(send_wc_opcode(wr::LOCAL_INV), Some(opcode::LOCAL_INV));
        assert_eq!(send_wc_opcode(wr::BIND_MW), Some(opcode::BIND_MW));
        assert_eq!(send_wc_opcode(wr::SEND_WITH_INV), Some(opcode::SEND));
        assert_eq!(send_wc_opcode(10), None, "TSO");
        assert_eq!(send_wc_opcode(wr::ATOMIC_WRITE), Some(opcode::ATOMIC_WRITE));
        assert!(send_completes(false, WcStatus::RemAccessErr));
        assert!(!send_completes(false, WcStatus::Success));
    }

    #[test]
    fn remote_write_or_atomic_needs_local_write() {
        use access::*;
        assert!(mr_access_ok(0) && mr_access_ok(REMOTE_READ));
        assert!(mr_access_ok(LOCAL_WRITE | REMOTE_WRITE | REMOTE_ATOMIC));
        assert!(!mr_access_ok(REMOTE_WRITE) && !mr_access_ok(REMOTE_ATOMIC));
        assert!(!mr_access_ok(REMOTE_READ | REMOTE_WRITE));
    }
}
