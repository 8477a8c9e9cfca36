//! cqd: RDMA completion dispatch.
//!
//! - [`core`]: the dispatcher (pollers, handlers, worker pools, posting).
//! - [`sim`] (feature `sim`, on by default): the simulated NIC.
//! - [`verbs`] (feature `verbs`): real RDMA through libibverbs.
pub use cqd_core as core;
#[cfg(feature = "sim")]
pub use cqd_sim as sim;
#[cfg(feature = "verbs")]
pub use cqd_verbs as verbs;

/// Real RDMA is behind the `verbs` feature, so that the default build needs
/// no system library. In a build without it, naming anything here fails
/// with a message that says what to add:
///
/// ```compile_fail
/// // Fails: cqd was built without the `verbs` feature.
/// let ctx = cqd::verbs::Context::open("mlx5_0");
/// ```
#[cfg(not(feature = "verbs"))]
pub mod verbs {
    /// Implemented by nothing: `Context::open`'s argument must implement
    /// it, so a call fails to compile with this message.
    #[diagnostic::on_unimplemented(
        message = "cqd was built without the `verbs` feature: real RDMA needs `cqd = {{ features = [\"verbs\"] }}` in Cargo.toml",
        label = "needs the `verbs` feature",
        note = "the feature builds rdma-sys against the system's libibverbs: on Debian, `apt-get install libibverbs-dev librdmacm-dev libclang-dev pkg-config`",
        note = "without RDMA hardware, run the program under softverbs-run (docs/softverbs.md)"
    )]
    pub trait VerbsFeature {}

    /// Stands for `cqd_verbs::Context` in a build without the feature.
    #[derive(Debug)]
    pub struct Context;

    impl Context {
        /// Never callable: see the module documentation.
        pub fn open<N: VerbsFeature>(_name: N) -> Context {
            Context
        }
    }
}
