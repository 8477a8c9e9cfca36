//! Remote atomic operations of RC QPs (`IBV_WR_ATOMIC_CMP_AND_SWP`,
//! `IBV_WR_ATOMIC_FETCH_AND_ADD`): what the responder computes and which
//! requests it rejects.
//!
//! - The target is one 8-byte word at `remote_addr`, which must be
//!   naturally aligned; a misaligned address is an invalid request
//!   (InfiniBand: NAK-Invalid Request), so the requester completes with
//!   `IBV_WC_REM_INV_REQ_ERR` and the responder QP goes to ERR. The
//!   responder checks the R_Key, range and `REMOTE_ATOMIC` access (of the
//!   MR and of the QP) first: those fail with `IBV_WC_REM_ACCESS_ERR`.
//! - The word's original value is returned to the requester, which writes
//!   it into the first 8 bytes of its scatter list (a list shorter than 8
//!   bytes: `IBV_WC_LOC_LEN_ERR`); the completion's opcode is
//!   `IBV_WC_COMP_SWAP` / `IBV_WC_FETCH_ADD` and its `byte_len` is 8.
//! - Values are 64-bit integers in the host's byte order, both the operands
//!   of the work request and the word in memory (as rdma-core's software
//!   devices do; some hardware stores the word big-endian).
//! - Atomicity (`IBV_ATOMIC_HCA`): atomic with respect to every other
//!   atomic of this device on the same address, from any process; not with
//!   respect to the memory owner's plain loads and stores.

/// Bytes an atomic operates on and returns.
pub const ATOMIC_LEN: u32 = 8;

/// Which atomic operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Compare-and-swap: the word becomes `swap` if it equals `compare`.
    CmpSwap {
        /// Compared with the word.
        compare: u64,
        /// Stored when equal.
        swap: u64,
    },
    /// Fetch-and-add: the word becomes word + `add` (wrapping, mod 2^64).
    FetchAdd {
        /// Added.
        add: u64,
    },
    /// Atomic write (`IBV_WR_ATOMIC_WRITE`): the word becomes `value`,
    /// all 8 bytes at once with respect to every other atomic.
    Write {
        /// Stored.
        value: u64,
    },
}

impl AtomicOp {
    /// The value the word takes when it held `old`, or `None` when it is
    /// left as is (a compare that failed).
    pub fn apply(self, old: u64) -> Option<u64> {
        match self {
            Self::CmpSwap { compare, swap } => (old == compare).then_some(swap),
            Self::FetchAdd { add } => Some(old.wrapping_add(add)),
            Self::Write { value } => Some(value),
        }
    }
}

/// Whether `addr` is a valid atomic target address (naturally aligned).
pub fn aligned(addr: u64) -> bool {
    addr % u64::from(ATOMIC_LEN) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compare_swap_and_fetch_add() {
        let cs = AtomicOp::CmpSwap {
            compare: 5,
            swap: 9,
        };
        assert_eq!(cs.apply(5), Some(9));
        assert_eq!(cs.apply(6), None);
        assert_eq!(AtomicOp::FetchAdd { add: 3 }.apply(4), Some(7));
        assert_eq!(AtomicOp::FetchAdd { add: 2 }.apply(u64::MAX), Some(1));
        assert!(aligned(0x1000) && aligned(8));
        assert!(!aligned(0x1004) && !aligned(1));
    }
}
