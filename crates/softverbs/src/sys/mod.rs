//! FFI: the private provider ABI of libibverbs (written by hand from rdma-core
//! v44's `driver.h`), the public `verbs.h` types (from `rdma-sys`), and the
//! run-time resolution of the private symbols.

pub mod abi;
pub mod private;

pub use rdma_sys as ibv;

/// `Debug` for FFI-embedding structs whose C parts have no `Debug`.
#[macro_export]
#[doc(hidden)]
macro_rules! opaque_debug {
    ($t:ident) => {
        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($t)).finish_non_exhaustive()
            }
        }
    };
}
