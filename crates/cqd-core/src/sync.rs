//! The synchronisation shim: every atomic, lock and park used by a concurrent
//! protocol in cqd-core comes from here, so that `--cfg loom` swaps in loom's
//! model-checked versions (docs/architecture.md, "Concurrency and checking").

#[cfg(loom)]
pub use loom::sync::atomic::{
    fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
#[cfg(loom)]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(loom)]
pub use loom::thread;

#[cfg(not(loom))]
pub use std::sync::atomic::{
    fence, AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering,
};
#[cfg(not(loom))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
pub use std::thread;

/// A lock held for a few instructions by threads that meet briefly (a
/// queue's posters and its poller): parking_lot's in a build — it spins
/// briefly, then parks; std's futex lock, tried here, made the storage
/// demo end to end about 40 % slower where a worker's posts and the
/// poller's retirements meet on one queue — and loom's under `--cfg loom`,
/// behind the same `lock()` returning the guard.
#[cfg(not(loom))]
pub(crate) use parking_lot::{Mutex as ShortMutex, MutexGuard as ShortGuard};

/// See the build's version.
#[cfg(loom)]
#[derive(Debug, Default)]
pub(crate) struct ShortMutex<T>(loom::sync::Mutex<T>);

#[cfg(loom)]
impl<T> ShortMutex<T> {
    pub(crate) fn new(value: T) -> Self {
        ShortMutex(loom::sync::Mutex::new(value))
    }

    pub(crate) fn lock(&self) -> ShortGuard<'_, T> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// See the build's version.
#[cfg(loom)]
pub(crate) type ShortGuard<'a, T> = loom::sync::MutexGuard<'a, T>;
