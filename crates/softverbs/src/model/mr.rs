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
/// - an implicit region without `IBV_ACCESS_ON_DEMAND`: EINVAL.
pub fn reg_error(access: u32, addr: u64, len: u64) -> Option<i32> {
    if !access::mr_access_ok(access) || access & !KNOWN != 0 {
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

/// Device memory (`ibv_alloc_dm(3)`).
///
/// A hardware device keeps it in on-chip memory the host reaches through a
/// BAR; this device's memory is host memory, so device memory is a private
/// mapping of the context's owner process that only the device and
/// `ibv_memcpy_to_dm`/`ibv_memcpy_from_dm` touch: a region registered on
/// it with `ibv_reg_dm_mr` is reached by peers exactly as any region
/// (`process_vm_readv`/`writev`), and is zero-based (its users name its
/// first byte 0, `IBV_ACCESS_ZERO_BASED`, which `ibv_reg_dm_mr` requires).
pub mod dm {
    /// Device memory a context may hold at once (`max_dm_size`): what
    /// on-chip memory of current NICs offers, a bound rather than a
    /// limit of the host.
    pub const MAX_SIZE: u64 = 256 * 1024;
    /// Copies to and from device memory move 4-byte words: offset and
    /// length must be multiples of 4 (as on-chip memory of hardware
    /// devices is written).
    pub const ALIGN: u64 = 4;
    /// The largest alignment `log_align_req` may ask for (a page: the
    /// memory is page-aligned).
    pub const MAX_LOG_ALIGN: u32 = 12;

    /// The errno of `ibv_alloc_dm` for a request of `len` bytes with
    /// `log_align` and `comp_mask` while `used` bytes are allocated, or
    /// `None`: an unknown `comp_mask` bit, a zero length or an alignment
    /// above a page are EINVAL; more than what is left is ENOMEM.
    pub fn alloc_error(len: u64, log_align: u32, comp_mask: u32, used: u64) -> Option<i32> {
        if comp_mask != 0 || len == 0 || log_align > MAX_LOG_ALIGN {
            return Some(libc::EINVAL);
        }
        if len > MAX_SIZE.saturating_sub(used) {
            return Some(libc::ENOMEM);
        }
        None
    }

    /// The errno of a copy of `len` bytes at `offset` of a device memory
    /// of `size` bytes, or `None`: unaligned is EINVAL, outside is EFAULT.
    pub fn copy_error(size: u64, offset: u64, len: u64) -> Option<i32> {
        if offset % ALIGN != 0 || len % ALIGN != 0 {
            return Some(libc::EINVAL);
        }
        if offset.checked_add(len).is_none_or(|end| end > size) {
            return Some(libc::EFAULT);
        }
        None
    }

    /// The errno of `ibv_reg_dm_mr` for `len` bytes at `offset` with
    /// `access`, or `None`: not zero-based, outside the memory, or the
    /// usual access rule: EINVAL.
    pub fn reg_error(size: u64, offset: u64, len: u64, access: u32) -> Option<i32> {
        if access & super::ZERO_BASED == 0
            || !super::access::mr_access_ok(access)
            || access & !(super::KNOWN | super::ZERO_BASED) != 0
            || offset.checked_add(len).is_none_or(|end| end > size)
        {
            return Some(libc::EINVAL);
        }
        None
    }
}

/// Memory windows (`ibv_alloc_mw(3)`, `ibv_bind_mw(3)`, `ibv_post_send(3)`).
///
/// A window is a key of its own onto part of a region registered with
/// `IBV_ACCESS_MW_BIND`, with its own remote access. Type 1 is bound with
/// `ibv_bind_mw` (a work request on any QP of its PD) and usable through
/// every QP of the PD; rebinding it moves it, a zero length unbinds it.
/// Type 2 (2B: bound to one QP) is bound by an `IBV_WR_BIND_MW` work
/// request whose new rkey differs from the window's only in the low 8
/// bits (the consumer's key byte), usable only through that QP, and
/// invalidated by `IBV_WR_LOCAL_INV` on the owner's side, by a peer's
/// `IBV_WR_SEND_WITH_INV` on that QP, or by deallocation; binding a bound
/// type-2 window is an error. A region with windows bound to it cannot be
/// deregistered (EBUSY).
pub mod mw {
    use super::access;

    /// `IBV_MW_TYPE_1`.
    pub const TYPE_1: u32 = 1;
    /// `IBV_MW_TYPE_2`.
    pub const TYPE_2: u32 = 2;
    /// The access a window may grant.
    pub const BIND_ACCESS: u32 =
        access::REMOTE_READ | access::REMOTE_WRITE | access::REMOTE_ATOMIC | super::ZERO_BASED;

    /// `ibv_inc_rkey`: the next key byte, the rest unchanged.
    pub fn inc_rkey(rkey: u32) -> u32 {
        (rkey & 0xffff_ff00) | (rkey.wrapping_add(1) & 0xff)
    }

    /// A bind request as the device sees it when it executes.
    #[derive(Debug, Clone, Copy)]
    pub struct Bind {
        /// The window's type.
        pub mw_type: u32,
        /// The window's PD and the QP's (ids).
        pub mw_pd: u32,
        /// The QP's PD.
        pub qp_pd: u32,
        /// Whether the new rkey names the window's own slot.
        pub same_slot: bool,
        /// Whether the window is bound now.
        pub bound: bool,
        /// The region: its PD, access, and whether it holds the range
        /// (`None`: no region, only valid for a type-1 unbind).
        pub mr: Option<(u32, u32, bool)>,
        /// Bytes to bind (0: unbind, type 1).
        pub len: u64,
        /// Access to grant.
        pub access: u32,
    }

    /// The access a window gets from the flags of its bind: the remote
    /// ones (`IBV_ACCESS_LOCAL_WRITE`, which applications pass along,
    /// grants a window nothing: a window is only ever named by peers).
    pub fn granted(access: u32) -> u32 {
        access & BIND_ACCESS
    }

    /// Whether the bind succeeds (else `IBV_WC_MW_BIND_ERR`): a flag other
    /// than the remote ones, zero-based and local write is an error.
    pub fn bind_ok(b: &Bind) -> bool {
        if !b.same_slot
            || b.mw_pd != b.qp_pd
            || b.access & !(BIND_ACCESS | access::LOCAL_WRITE) != 0
        {
            return false;
        }
        if b.mw_type == TYPE_2 && b.bound {
            return false;
        }
        if b.mw_type == TYPE_1 && b.len == 0 {
            return true; // unbind
        }
        let Some((pd, mr_access, holds)) = b.mr else {
            return false;
        };
        let needs_local_write = b.access & (access::REMOTE_WRITE | access::REMOTE_ATOMIC) != 0;
        pd == b.qp_pd
            && mr_access & super::MW_BIND != 0
            && holds
            && (!needs_local_write || mr_access & access::LOCAL_WRITE != 0)
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
    }

    #[test]
    fn device_memory_rules() {
        use super::dm::*;
        assert_eq!(alloc_error(4096, 0, 0, 0), None);
        assert_eq!(alloc_error(MAX_SIZE, 6, 0, 0), None);
        assert_eq!(alloc_error(MAX_SIZE + 1, 0, 0, 0), Some(libc::ENOMEM));
        assert_eq!(alloc_error(8, 0, 0, MAX_SIZE - 4), Some(libc::ENOMEM));
        assert_eq!(alloc_error(8, 0, 1, 0), Some(libc::EINVAL), "comp_mask");
        assert_eq!(alloc_error(0, 0, 0, 0), Some(libc::EINVAL));
        assert_eq!(alloc_error(8, 13, 0, 0), Some(libc::EINVAL));
        assert_eq!(copy_error(100, 0, 100), None);
        assert_eq!(copy_error(100, 3, 4), Some(libc::EINVAL));
        assert_eq!(copy_error(100, 4, 3), Some(libc::EINVAL));
        assert_eq!(copy_error(100, 104, 4), Some(libc::EFAULT));
        assert_eq!(copy_error(100, 0, 104), Some(libc::EFAULT));
        let zb = ZERO_BASED | access::LOCAL_WRITE;
        assert_eq!(reg_error(100, 0, 100, zb), None);
        assert_eq!(reg_error(100, 0, 0, zb), None, "an empty region registers");
        assert_eq!(reg_error(100, 0, 104, zb), Some(libc::EINVAL));
        assert_eq!(
            reg_error(100, 0, 100, access::LOCAL_WRITE),
            Some(libc::EINVAL)
        );
        assert_eq!(
            reg_error(100, 0, 100, ZERO_BASED | access::REMOTE_WRITE),
            Some(libc::EINVAL)
        );
    }

    #[test]
    fn memory_window_rules() {
        use super::mw::*;
        assert_eq!(inc_rkey(0x1234_56ff), 0x1234_5600);
        assert_eq!(inc_rkey(0x1234_5601), 0x1234_5602);
        let ok = Bind {
            mw_type: TYPE_2,
            mw_pd: 1,
            qp_pd: 1,
            same_slot: true,
            bound: false,
            mr: Some((1, access::LOCAL_WRITE | MW_BIND, true)),
            len: 64,
            access: access::REMOTE_WRITE,
        };
        assert!(bind_ok(&ok));
        assert!(!bind_ok(&Bind { bound: true, ..ok }), "type 2 binds once");
        assert!(
            bind_ok(&Bind {
                bound: true,
                mw_type: TYPE_1,
                ..ok
            }),
            "type 1 rebinds"
        );
        assert!(!bind_ok(&Bind {
            same_slot: false,
            ..ok
        }));
        assert!(!bind_ok(&Bind { qp_pd: 2, ..ok }));
        assert!(
            !bind_ok(&Bind {
                mr: Some((1, access::LOCAL_WRITE, true)),
                ..ok
            }),
            "no MW_BIND"
        );
        assert!(
            !bind_ok(&Bind {
                mr: Some((1, MW_BIND, true)),
                ..ok
            }),
            "remote write needs local write"
        );
        assert!(bind_ok(&Bind {
            mr: Some((1, MW_BIND, true)),
            access: access::REMOTE_READ,
            ..ok
        }));
        assert!(
            !bind_ok(&Bind {
                mr: Some((1, access::LOCAL_WRITE | MW_BIND, false)),
                ..ok
            }),
            "range"
        );
        assert!(bind_ok(&Bind {
            access: access::LOCAL_WRITE | access::REMOTE_WRITE,
            ..ok
        }));
        assert_eq!(
            granted(access::LOCAL_WRITE | access::REMOTE_WRITE),
            access::REMOTE_WRITE
        );
        assert!(
            !bind_ok(&Bind {
                access: MW_BIND,
                ..ok
            }),
            "not a window's flag"
        );
        assert!(
            bind_ok(&Bind {
                mw_type: TYPE_1,
                len: 0,
                mr: None,
                ..ok
            }),
            "type-1 unbind"
        );
        assert!(!bind_ok(&Bind { mr: None, ..ok }));
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
