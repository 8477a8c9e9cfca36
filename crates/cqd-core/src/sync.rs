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

/// A plain (not atomic) word that two threads pass between them under a
/// protocol that orders every write before the other side's read (a
/// request's context in its queue's ring: written before the Release that
/// publishes the entry, read by whichever side the entry's claim made its
/// owner). loom's version checks that no two accesses race. The word may
/// hold a value's bytes whatever they are (padding included), so it is a
/// `MaybeUninit`.
#[cfg(not(loom))]
pub(crate) struct Word(std::cell::UnsafeCell<std::mem::MaybeUninit<u64>>);
/// See the build's version.
#[cfg(loom)]
pub(crate) struct Word(loom::cell::UnsafeCell<std::mem::MaybeUninit<u64>>);

impl Word {
    pub(crate) fn new() -> Self {
        #[cfg(not(loom))]
        let cell = std::cell::UnsafeCell::new(std::mem::MaybeUninit::uninit());
        #[cfg(loom)]
        let cell = loom::cell::UnsafeCell::new(std::mem::MaybeUninit::uninit());
        Word(cell)
    }

    /// # Safety
    /// No other thread writes the word now, and its last write happened
    /// before this read (the caller's protocol orders them).
    #[inline(always)]
    pub(crate) unsafe fn read(&self) -> std::mem::MaybeUninit<u64> {
        #[cfg(not(loom))]
        // SAFETY: the caller's.
        return unsafe { *self.0.get() };
        #[cfg(loom)]
        // SAFETY: the caller's.
        return self.0.with(|p| unsafe { *p });
    }

    /// # Safety
    /// No other thread reads or writes the word now.
    #[inline(always)]
    pub(crate) unsafe fn write(&self, value: std::mem::MaybeUninit<u64>) {
        #[cfg(not(loom))]
        // SAFETY: the caller's.
        unsafe {
            *self.0.get() = value;
        }
        #[cfg(loom)]
        // SAFETY: the caller's.
        self.0.with_mut(|p| unsafe { *p = value });
    }
}

// SAFETY: the word is reached only under the protocol its owner follows
// (see the type's documentation); it holds plain bytes.
unsafe impl Sync for Word {}
// SAFETY: as above.
unsafe impl Send for Word {}
