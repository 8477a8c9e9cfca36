//! The completion model: what a storage server reads from an `ibv_wc`.
//!
//! Values that come from the device are never trusted: [`Status`] and
//! [`Opcode`] take any `u32` (an unknown value stays, and says so),
//! and nothing here can panic on device data (docs/architecture.md,
//! "Invariants").

use std::fmt;

macro_rules! device_enum {
    (
        $(#[$meta:meta])*
        $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $value:expr => $text:expr, )*
        }
    ) => {
        $(#[$meta])*
        ///
        /// The raw `u32` the device wrote, kept as it is: a value is one of the
        /// named constants or unknown ([`is_known`](Self::is_known) is
        /// false), and every value is valid. The names read as an enum's
        /// variants do (`Status::WrFlush`, `match status { Status::Success =>
        /// ... }`), and a match needs a catch-all arm, as it would for a
        /// non-exhaustive enum: the device may report a value this cqd does
        /// not know. Keeping the raw word lets a completion have
        /// `struct ibv_wc`'s layout, so that a CQ is polled straight into
        /// cqd's completions.
        #[derive(Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(transparent)]
        pub struct $name(u32);

        #[allow(non_upper_case_globals)]
        impl $name {
            $( $(#[$vmeta])* pub const $variant: $name = $name($value); )*

            /// Every known value, in numeric order.
            pub const KNOWN: &'static [$name] = &[$($name::$variant),*];

            /// One bit per known value below 256 (every known value is).
            const KNOWN_BITS: [u64; 4] = {
                let mut bits = [0u64; 4];
                let known = Self::KNOWN;
                let mut i = 0;
                while i < known.len() {
                    let raw = known[i].0;
                    assert!(raw < 256, "a known value is below 256");
                    bits[(raw / 64) as usize] |= 1 << (raw % 64);
                    i += 1;
                }
                bits
            };

            /// Takes a raw device value. Never fails: a value this cqd does
            /// not know is kept, and [`is_known`](Self::is_known) says so.
            #[inline]
            pub const fn from_raw(raw: u32) -> Self {
                $name(raw)
            }

            /// The raw value as the device (libibverbs) spells it.
            #[inline]
            pub const fn to_raw(self) -> u32 {
                self.0
            }

            /// The name of the value, as its constant spells it, or `None`
            /// for an unknown value.
            pub const fn name(self) -> Option<&'static str> {
                match self.0 {
                    $( $value => Some(stringify!($variant)), )*
                    _ => None,
                }
            }

            /// The human-readable text (libibverbs' wording where it has one);
            /// "unknown" for a value this cqd does not know.
            pub const fn as_str(self) -> &'static str {
                match self.0 {
                    $( $value => $text, )*
                    _ => "unknown",
                }
            }

            /// True if this is one of the named values.
            #[inline]
            pub const fn is_known(self) -> bool {
                let raw = self.0;
                raw < 256 && Self::KNOWN_BITS[(raw / 64) as usize] & (1 << (raw % 64)) != 0
            }
        }

        impl From<u32> for $name {
            #[inline]
            fn from(raw: u32) -> Self {
                Self::from_raw(raw)
            }
        }

        /// The constant's name (`WrFlush`), or `Unknown(n)`: what a derived
        /// `Debug` of an enum would print.
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(name) => f.write_str(name),
                    None => write!(f, "Unknown({})", self.0),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                if self.is_known() {
                    f.write_str(self.as_str())
                } else {
                    write!(f, "unknown ({})", self.0)
                }
            }
        }
    };
}

device_enum! {
    /// The status of a completion: every `ibv_wc_status` of rdma-core 44.
    /// `Display` gives the `ibv_wc_status_str` text.
    Status {
        /// `IBV_WC_SUCCESS`
        Success = 0 => "success",
        /// `IBV_WC_LOC_LEN_ERR`
        LocalLength = 1 => "local length error",
        /// `IBV_WC_LOC_QP_OP_ERR`
        LocalQpOperation = 2 => "local QP operation error",
        /// `IBV_WC_LOC_EEC_OP_ERR`
        LocalEecOperation = 3 => "local EE context operation error",
        /// `IBV_WC_LOC_PROT_ERR`
        LocalProtection = 4 => "local protection error",
        /// `IBV_WC_WR_FLUSH_ERR`: the QP went to the error state; the work
        /// request was not executed.
        WrFlush = 5 => "Work Request Flushed Error",
        /// `IBV_WC_MW_BIND_ERR`
        MwBind = 6 => "memory management operation error",
        /// `IBV_WC_BAD_RESP_ERR`
        BadResponse = 7 => "bad response error",
        /// `IBV_WC_LOC_ACCESS_ERR`
        LocalAccess = 8 => "local access error",
        /// `IBV_WC_REM_INV_REQ_ERR`
        RemoteInvalidRequest = 9 => "remote invalid request error",
        /// `IBV_WC_REM_ACCESS_ERR`
        RemoteAccess = 10 => "remote access error",
        /// `IBV_WC_REM_OP_ERR`
        RemoteOperation = 11 => "remote operation error",
        /// `IBV_WC_RETRY_EXC_ERR`
        RetryExceeded = 12 => "transport retry counter exceeded",
        /// `IBV_WC_RNR_RETRY_EXC_ERR`
        RnrRetryExceeded = 13 => "RNR retry counter exceeded",
        /// `IBV_WC_LOC_RDD_VIOL_ERR`
        LocalRddViolation = 14 => "local RDD violation error",
        /// `IBV_WC_REM_INV_RD_REQ_ERR`
        RemoteInvalidRdRequest = 15 => "remote invalid RD request",
        /// `IBV_WC_REM_ABORT_ERR`
        RemoteAbort = 16 => "aborted error",
        /// `IBV_WC_INV_EECN_ERR`
        InvalidEecn = 17 => "invalid EE context number",
        /// `IBV_WC_INV_EEC_STATE_ERR`
        InvalidEecState = 18 => "invalid EE context state",
        /// `IBV_WC_FATAL_ERR`
        Fatal = 19 => "fatal error",
        /// `IBV_WC_RESP_TIMEOUT_ERR`
        ResponseTimeout = 20 => "response timeout error",
        /// `IBV_WC_GENERAL_ERR`
        General = 21 => "general error",
        /// `IBV_WC_TM_ERR`
        TagMatching = 22 => "TM error",
        /// `IBV_WC_TM_RNDV_INCOMPLETE`
        TagMatchingRendezvousIncomplete = 23 => "TM software rendezvous",
    }
}

impl Status {
    /// Number of slots in a per-status table: every known status plus one
    /// shared slot for unknown values.
    pub const TABLE_LEN: usize = 25;

    /// True for `Success`.
    #[inline]
    pub const fn is_success(self) -> bool {
        matches!(self, Status::Success)
    }

    /// True for `WrFlush`: the request was not executed because its QP went
    /// to the error state.
    #[inline]
    pub const fn is_flush(self) -> bool {
        matches!(self, Status::WrFlush)
    }

    /// Index into a table of [`Status::TABLE_LEN`] entries; all unknown
    /// values share the last slot.
    #[inline]
    pub const fn table_index(self) -> usize {
        if self.0 < Self::TABLE_LEN as u32 - 1 {
            self.0 as usize
        } else {
            Self::TABLE_LEN - 1
        }
    }
}

device_enum! {
    /// The opcode of a completion: every `ibv_wc_opcode` of rdma-core 44.
    ///
    /// Defined by the device only for successful completions; cqd never
    /// routes by it (the kind stored in the wr_id does that).
    Opcode {
        /// `IBV_WC_SEND`
        Send = 0 => "send",
        /// `IBV_WC_RDMA_WRITE`
        RdmaWrite = 1 => "RDMA write",
        /// `IBV_WC_RDMA_READ`
        RdmaRead = 2 => "RDMA read",
        /// `IBV_WC_COMP_SWAP`
        CompareSwap = 3 => "compare and swap",
        /// `IBV_WC_FETCH_ADD`
        FetchAdd = 4 => "fetch and add",
        /// `IBV_WC_BIND_MW`
        BindMw = 5 => "bind memory window",
        /// `IBV_WC_LOCAL_INV`
        LocalInvalidate = 6 => "local invalidate",
        /// `IBV_WC_TSO`
        Tso = 7 => "TCP segmentation offload",
        /// `IBV_WC_ATOMIC_WRITE`
        AtomicWrite = 9 => "atomic write",
        /// `IBV_WC_RECV`
        Recv = 128 => "receive",
        /// `IBV_WC_RECV_RDMA_WITH_IMM`
        RecvRdmaWithImm = 129 => "receive RDMA write with immediate",
        /// `IBV_WC_TM_ADD`
        TmAdd = 130 => "TM add",
        /// `IBV_WC_TM_DEL`
        TmDel = 131 => "TM delete",
        /// `IBV_WC_TM_SYNC`
        TmSync = 132 => "TM sync",
        /// `IBV_WC_TM_RECV`
        TmRecv = 133 => "TM receive",
        /// `IBV_WC_TM_NO_TAG`
        TmNoTag = 134 => "TM no tag",
        /// `IBV_WC_DRIVER1`
        Driver1 = 135 => "driver 1",
        /// `IBV_WC_DRIVER2`
        Driver2 = 136 => "driver 2",
        /// `IBV_WC_DRIVER3`
        Driver3 = 137 => "driver 3",
    }
}

impl Opcode {
    /// True for the receive-side opcodes (`opcode & IBV_WC_RECV`).
    #[inline]
    pub const fn is_recv(self) -> bool {
        self.to_raw() & 0x80 != 0
    }

    /// True for the atomics' opcodes (`COMP_SWAP`, `FETCH_ADD`,
    /// `ATOMIC_WRITE`).
    #[inline]
    pub const fn is_atomic(self) -> bool {
        matches!(
            self,
            Opcode::CompareSwap | Opcode::FetchAdd | Opcode::AtomicWrite
        )
    }
}

/// Bytes of the Global Routing Header at the start of every UD receive
/// buffer: the device writes the GRH there when the datagram carried one
/// (`IBV_WC_GRH`), and leaves the 40 bytes undefined otherwise; the
/// payload always starts after them.
pub const GRH_LEN: u32 = 40;

/// `ibv_wc_flags` bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[repr(transparent)]
pub struct WcFlags(pub u32);

impl WcFlags {
    /// `IBV_WC_GRH`: a GRH is present in the first 40 bytes of the buffer.
    pub const GRH: u32 = 1 << 0;
    /// `IBV_WC_WITH_IMM`: `imm_data` is valid.
    pub const WITH_IMM: u32 = 1 << 1;
    /// `IBV_WC_IP_CSUM_OK`
    pub const IP_CSUM_OK: u32 = 1 << 2;
    /// `IBV_WC_WITH_INV`: `invalidated_rkey` is valid.
    pub const WITH_INV: u32 = 1 << 3;
    /// `IBV_WC_TM_SYNC_REQ`
    pub const TM_SYNC_REQ: u32 = 1 << 4;
    /// `IBV_WC_TM_MATCH`
    pub const TM_MATCH: u32 = 1 << 5;
    /// `IBV_WC_TM_DATA_VALID`
    pub const TM_DATA_VALID: u32 = 1 << 6;

    /// True if every bit of `bits` is set.
    #[inline]
    pub const fn contains(self, bits: u32) -> bool {
        self.0 & bits == bits
    }
}

/// One work completion, as polled from a CQ.
///
/// Only `wr_id`, `status`, `qp_num` and `vendor_err` are defined for an
/// error completion; the rest is what the device left there.
///
/// The layout is `struct ibv_wc`'s, field for field (cqd-verbs checks every
/// offset when it compiles), and every bit pattern is a valid completion.
/// So a verbs CQ is polled straight into a batch of completions, with no
/// conversion on the poller's path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub struct Completion {
    /// The 64-bit cookie given at post time (see [`crate::wr_id`]).
    pub wr_id: u64,
    /// Outcome of the work request.
    pub status: Status,
    /// Operation, valid for successful completions only.
    pub opcode: Opcode,
    /// Vendor syndrome for errors.
    pub vendor_err: u32,
    /// Bytes transferred (receives, RDMA read, atomics).
    pub byte_len: u32,
    /// Immediate data in network byte order as the device delivers it;
    /// valid when `wc_flags` has `WITH_IMM` (or `WITH_INV`: the rkey).
    pub imm_data: u32,
    /// Local QP number the work request belonged to.
    pub qp_num: u32,
    /// Remote QP number (UD only).
    pub src_qp: u32,
    /// `ibv_wc_flags`.
    pub wc_flags: WcFlags,
    /// P_Key index (GSI QPs only).
    pub pkey_index: u16,
    /// Source LID (UD only).
    pub slid: u16,
    /// Service level (UD only).
    pub sl: u8,
    /// Destination LID path bits (UD only).
    pub dlid_path_bits: u8,
}

impl Completion {
    /// A successful completion with everything else zero.
    pub const fn success(wr_id: u64, opcode: Opcode, qp_num: u32) -> Self {
        Completion {
            wr_id,
            status: Status::Success,
            opcode,
            vendor_err: 0,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            wc_flags: WcFlags(0),
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
        }
    }

    /// An error completion; `opcode` is left undefined (`u32::MAX`, unknown)
    /// as a device may leave it.
    pub const fn error(wr_id: u64, status: Status, qp_num: u32) -> Self {
        let mut c = Self::success(wr_id, Opcode::from_raw(u32::MAX), qp_num);
        c.status = status;
        c
    }

    /// True if the first [`GRH_LEN`] bytes of the receive buffer hold the
    /// datagram's Global Routing Header (`IBV_WC_GRH`; UD receives only).
    #[inline]
    pub const fn has_grh(&self) -> bool {
        self.wc_flags.contains(WcFlags::GRH)
    }

    /// The immediate data, if the completion carries any (`WITH_IMM`).
    #[inline]
    pub const fn imm(&self) -> Option<u32> {
        if self.wc_flags.contains(WcFlags::WITH_IMM) {
            Some(self.imm_data)
        } else {
            None
        }
    }

    /// The rkey a peer's SEND with invalidate invalidated on this side
    /// (`WITH_INV`; host order, as `ibv_wc.invalidated_rkey` is).
    #[inline]
    pub const fn invalidated_rkey(&self) -> Option<u32> {
        if self.wc_flags.contains(WcFlags::WITH_INV) {
            Some(self.imm_data)
        } else {
            None
        }
    }
}

impl Default for Completion {
    fn default() -> Self {
        Self::success(0, Opcode::Send, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_round_trips_and_has_text() {
        for (i, s) in Status::KNOWN.iter().enumerate() {
            assert_eq!(s.to_raw(), i as u32);
            assert_eq!(Status::from_raw(i as u32), *s);
            assert_eq!(s.table_index(), i);
            assert!(!s.to_string().is_empty());
        }
        assert_eq!(Status::KNOWN.len() + 1, Status::TABLE_LEN);
        assert_eq!(Status::WrFlush.to_string(), "Work Request Flushed Error");
        assert_eq!(Status::RemoteAccess.to_string(), "remote access error");
    }

    #[test]
    fn unknown_values_never_panic() {
        for raw in [24u32, 99, u32::MAX] {
            let s = Status::from_raw(raw);
            assert!(!s.is_known());
            assert_eq!(format!("{s:?}"), format!("Unknown({raw})"));
            assert_eq!(s.to_raw(), raw);
            assert_eq!(s.table_index(), Status::TABLE_LEN - 1);
            assert_eq!(s.to_string(), format!("unknown ({raw})"));
        }
        for raw in [8u32, 10, 127, 138, u32::MAX] {
            assert!(!Opcode::from_raw(raw).is_known());
        }
    }

    #[test]
    fn opcodes_match_libibverbs() {
        assert_eq!(Opcode::Recv.to_raw(), 1 << 7);
        assert!(Opcode::RecvRdmaWithImm.is_recv());
        assert!(!Opcode::RdmaRead.is_recv());
        assert_eq!(Opcode::AtomicWrite.to_raw(), 9);
        for op in Opcode::KNOWN {
            assert_eq!(Opcode::from_raw(op.to_raw()), *op);
        }
    }

    #[test]
    fn atomic_opcodes_and_grh_flag() {
        assert!(Opcode::CompareSwap.is_atomic() && Opcode::FetchAdd.is_atomic());
        assert!(!Opcode::RdmaRead.is_atomic() && !Opcode::from_raw(3 + 256).is_atomic());
        assert_eq!(Opcode::from_raw(3), Opcode::CompareSwap);
        assert_eq!(Opcode::from_raw(4), Opcode::FetchAdd);
        let mut c = Completion::success(1, Opcode::Recv, 7);
        assert!(!c.has_grh());
        c.wc_flags = WcFlags(WcFlags::GRH | WcFlags::WITH_IMM);
        assert!(c.has_grh());
    }

    #[test]
    fn imm_only_with_flag() {
        let mut c = Completion::success(1, Opcode::Recv, 7);
        c.imm_data = 42;
        assert_eq!(c.imm(), None);
        c.wc_flags = WcFlags(WcFlags::WITH_IMM);
        assert_eq!(c.imm(), Some(42));
    }
}
