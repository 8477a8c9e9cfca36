//! Memory-region rules: which access flags register, what an implicit
//! on-demand-paging region is, what `ibv_rereg_mr` may change and what
//! `ibv_advise_mr` accepts.
//!
//! On-demand paging costs this device nothing: it never pins memory, every
//! access goes through the owner's page tables at the moment it happens
//! (`memcpy` in the same process, `process_vm_readv`/`writev` from another
//! one), so a page that is not present is faulted in by the kernel then,
//! and a range unmapped since registration fails that one access with a
//! remote or local protection error instead of reaching stale pages. Every
//! region is therefore an ODP region; `IBV_ACCESS_ON_DEMAND` is accepted and
//! reported back, and only changes what an *implicit* registration means.

use super::wc::access;

/// `enum ibv_odp_general_caps` and `enum ibv_odp_transport_cap_bits`.
pub mod odp {
    /// `IBV_ODP_SUPPORT`.
    pub const SUPPORT: u64 = 1;
    /// `IBV_ODP_SUPPORT_IMPLICIT`.
    pub const SUPPORT_IMPLICIT: u64 = 1 << 1;
    /// `IBV_ODP_SUPPORT_SEND`.
    pub const SEND: u32 = 1;
    /// `IBV_ODP_SUPPORT_RECV`.
    pub const RECV: u32 = 1 << 1;
    /// `IBV_ODP_SUPPORT_WRITE`.
    pub const WRITE: u32 = 1 << 2;
    /// `IBV_ODP_SUPPORT_READ`.
    pub const READ: u32 = 1 << 3;
    /// `IBV_ODP_SUPPORT_ATOMIC`.
    pub const ATOMIC: u32 = 1 << 4;
    /// `IBV_ODP_SUPPORT_SRQ_RECV`.
    pub const SRQ_RECV: u32 = 1 << 5;
}

/// `IBV_ACCESS_MW_BIND`.
pub const MW_BIND: u32 = 1 << 4;
/// `IBV_ACCESS_ZERO_BASED`.
pub const ZERO_BASED: u32 = 1 << 5;
/// `IBV_ACCESS_ON_DEMAND`.
pub const ON_DEMAND: u32 = 1 << 6;
/// `IBV_ACCESS_HUGETLB`.
pub const HUGETLB: u32 = 1 << 7;
/// `IBV_ACCESS_RELAXED_ORDERING` and the rest of the optional range
/// (`IBV_ACCESS_OPTIONAL_RANGE`): a device that does not know an optional
/// flag ignores it (`ibv_reg_mr(3)`).
pub const OPTIONAL_RANGE: u32 = 0x3ff0_0000;

/// Every flag `ibv_reg_mr` accepts on this device.
pub const KNOWN: u32 = access::LOCAL_WRITE
    | access::REMOTE_WRITE
    | access::REMOTE_READ
    | access::REMOTE_ATOMIC
    | MW_BIND
    | ON_DEMAND
    | HUGETLB
    | OPTIONAL_RANGE;

/// Whether `(addr, len)` asks for an implicit ODP region: the whole
/// address space (`ibv_reg_mr(3)`: address NULL, length `SIZE_MAX`).
pub fn is_implicit(addr: u64, len: u64) -> bool {
    addr == 0 && len == u64::MAX
}

/// The errno `ibv_reg_mr` answers for `access` over `(addr, len)`, or
/// `None` when it registers.
///
/// - remote write or atomic access without local write: EINVAL (the HCA
///   writes into such a region on the peer's behalf);
/// - a flag this device does not know (outside the optional range): EINVAL;
/// - `IBV_ACCESS_ZERO_BASED` on a plain registration: EINVAL (it is for
///   device memory, [`ZERO_BASED`]);
/// - an implicit region without `IBV_ACCESS_ON_DEMAND`, or a zero length:
///   EINVAL.
pub fn reg_error(access: u32, addr: u64, len: u64) -> Option<i32> {
    if !access::mr_access_ok(access) || access & !KNOWN != 0 || len == 0 {
        return Some(libc::EINVAL);
    }
    if is_implicit(addr, len) && access & ON_DEMAND == 0 {
        return Some(libc::EINVAL);
    }
    None
}

/// `enum ibv_rereg_mr_flags`.
pub mod rereg {
    /// `IBV_REREG_MR_CHANGE_TRANSLATION`.
    pub const CHANGE_TRANSLATION: u32 = 1;
    /// `IBV_REREG_MR_CHANGE_PD`.
    pub const CHANGE_PD: u32 = 1 << 1;
    /// `IBV_REREG_MR_CHANGE_ACCESS`.
    pub const CHANGE_ACCESS: u32 = 1 << 2;
    /// All of them.
    pub const ALL: u32 = CHANGE_TRANSLATION | CHANGE_PD | CHANGE_ACCESS;
}

/// `enum ib_uverbs_advise_mr_advice` and its flag.
pub mod advise {
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH`: fault the pages in for reading.
    pub const PREFETCH: u32 = 0;
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE`: fault them in writable.
    pub const PREFETCH_WRITE: u32 = 1;
    /// `IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT`: map only what is present.
    pub const PREFETCH_NO_FAULT: u32 = 2;
    /// `IBV_ADVISE_MR_FLAG_FLUSH`: return when done (synchronous).
    pub const FLAG_FLUSH: u32 = 1;
}

/// The errno `ibv_advise_mr` answers for `advice`, `flags` and `num_sge`
/// before the ranges are looked at, or `None`.
pub fn advise_error(advice: u32, flags: u32, num_sge: u32) -> Option<i32> {
    if advice > advise::PREFETCH_NO_FAULT || flags & !advise::FLAG_FLUSH != 0 || num_sge == 0 {
        return Some(libc::EINVAL);
    }
    None
}

/// The access a prefetch needs on the region: write advice needs local
/// write (`ibv_advise_mr(3)`).
pub fn advise_needs(advice: u32) -> u32 {
    if advice == advise::PREFETCH_WRITE {
        access::LOCAL_WRITE
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registration_rules() {
        assert_eq!(reg_error(access::LOCAL_WRITE, 0x1000, 4096), None);
        assert_eq!(
            reg_error(access::REMOTE_WRITE, 0x1000, 4096),
            Some(libc::EINVAL)
        );
        assert_eq!(
            reg_error(access::LOCAL_WRITE | ON_DEMAND, 0, u64::MAX),
            None
        );
        assert_eq!(
            reg_error(access::LOCAL_WRITE, 0, u64::MAX),
            Some(libc::EINVAL),
            "implicit needs ODP"
        );
        assert_eq!(
            reg_error(access::LOCAL_WRITE | (1 << 20), 0x1000, 1),
            None,
            "relaxed ordering"
        );
        assert_eq!(
            reg_error(1 << 9, 0x1000, 1),
            Some(libc::EINVAL),
            "unknown flag"
        );
        assert_eq!(reg_error(ZERO_BASED, 0x1000, 1), Some(libc::EINVAL));
        assert_eq!(reg_error(0, 0x1000, 0), Some(libc::EINVAL), "zero length");
    }

    #[test]
    fn advise_rules() {
        assert_eq!(
            advise_error(advise::PREFETCH_WRITE, advise::FLAG_FLUSH, 1),
            None
        );
        assert_eq!(advise_error(3, 0, 1), Some(libc::EINVAL));
        assert_eq!(advise_error(0, 2, 1), Some(libc::EINVAL));
        assert_eq!(advise_error(0, 0, 0), Some(libc::EINVAL));
        assert_eq!(advise_needs(advise::PREFETCH_WRITE), access::LOCAL_WRITE);
        assert_eq!(advise_needs(advise::PREFETCH), 0);
    }
}
