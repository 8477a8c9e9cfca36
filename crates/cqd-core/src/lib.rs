//! cqd-core: the backend-agnostic heart of cqd.
pub mod pool;
pub mod sink;
#[doc(hidden)]
pub mod sync;
pub mod topology;
