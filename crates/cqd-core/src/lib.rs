//! cqd-core: the backend-agnostic heart of cqd.
pub mod sink;
#[doc(hidden)]
pub mod sync;
