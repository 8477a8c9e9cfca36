//! softverbs: a userspace libibverbs provider (work in progress, see issue 5).
