//! softverbs: a userspace libibverbs provider, so that real, unmodified verbs
//! programs (`ibv_rc_pingpong`, perftest, anything on rdma-sys) run on a
//! machine whose kernel has no RDMA at all.
//!
//! The pieces:
//! - [`sys`]: the private provider ABI 34 of libibverbs, mirrored by hand
//!   from rdma-core v44 with layout tests, resolved at run time;
//! - [`model`]: NIC semantics (QP state machine, statuses, arm and flush
//!   rules), kept free of FFI so it can be shared with `cqd-sim`;
//! - [`shm`]: the shared-memory fabric (segments named by id/QPN, a
//!   lock-free cross-process ring);
//! - [`provider`]: the verbs themselves and the comp-channel interposer;
//! - [`cm`]: rdma_cm (the kernel's `rdma_ucm` commands, emulated behind
//!   `/dev/infiniband/rdma_cm`);
//! - [`launcher`]: what `softverbs-run` does (fake sysfs, private mount
//!   namespace, environment).
//!
//! A program runs on it with `softverbs-run PROGRAM ARGS...` (root):
//!
//! ```text
//! softverbs-run ibv_devinfo -v
//! softverbs-run ibv_rc_pingpong -n 1000 & softverbs-run ibv_rc_pingpong -n 1000 127.0.0.1
//! ```
//!
//! See `docs/softverbs.md` for the design and limits.

pub mod cm;
pub mod launcher;
pub mod model;
pub mod provider;
pub mod shm;
pub mod sys;

/// The load-time constructor: registers the provider with libibverbs.
/// Not under Miri, which runs the FFI-free unit tests (rings, segment
/// layout, the send checks) and has no libibverbs to look up.
#[cfg(not(miri))]
extern "C" fn softverbs_init() {
    provider::register();
}

#[cfg(not(miri))]
#[used]
#[link_section = ".init_array"]
static SOFTVERBS_INIT: extern "C" fn() = softverbs_init;
