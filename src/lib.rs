//! cqd: RDMA completion dispatch.
pub use cqd_core as core;
#[cfg(feature = "sim")]
pub use cqd_sim as sim;
