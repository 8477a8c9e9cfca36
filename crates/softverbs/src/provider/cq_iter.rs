//! The consumer lock of a CQ, and the iterator state of an extended CQ
//! (`ibv_start_poll` …): the current completion, which the lock lets one
//! thread at a time own.
//!
//! Protocol (the verbs iterator contract; hardware providers such as
//! rdma-core's mlx5 lock the same way):
//! 1. `start_poll` takes the lock, unless the CQ was created with
//!    `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`: then the application promised
//!    that a single thread polls the CQ, and no lock is needed. `poll_cq`
//!    and the clean of a QP's completions (provider::purge) take the same
//!    lock for the length of their call ([`CqIter::hold`]), as mlx5's
//!    `poll_cq` and `__mlx5_cq_clean` take the CQ's: whoever holds it is
//!    the CQ's only consumer.
//! 2. Holding the lock (or that promise), the thread owns the iteration: it
//!    alone writes the current completion (`start_poll`, `next_poll`) and
//!    reads it (the `read_*` callbacks, the `ibv_cq_ex` `status`/`wr_id`).
//! 3. A `start_poll` that finds the CQ empty releases the lock before it
//!    answers ENOENT: the application does not call `end_poll` then.
//! 4. `next_poll` keeps the lock whatever it answers; `end_poll` releases it.
//!
//! The lock is held across calls from C, so it cannot be a guard: it is a
//! flag taken with [`CqIter::lock`] and released with the `unsafe`
//! [`CqIter::unlock`]. Waiters spin briefly, then yield, since the owner may
//! be descheduled on a machine with fewer cores than pollers.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::shm::layout::Cqe;

/// Spin-loop rounds a waiter spends before it starts yielding the CPU.
const SPINS_BEFORE_YIELD: u32 = 64;

/// The current completion of an extended CQ and the lock that guards it.
///
/// The current completion is reachable only through `unsafe` methods, whose
/// callers own the iteration (step 2); unlocking is `unsafe` too:
///
/// ```compile_fail,E0133
/// let it = softverbs::provider::cq_iter::CqIter::new();
/// it.lock();
/// it.unlock(); // must be `unsafe`: only the owner may release the lock
/// ```
pub struct CqIter {
    /// True while a thread owns the iteration (steps 1–4).
    held: AtomicBool,
    /// The completion `start_poll`/`next_poll` made current (step 2).
    cur: UnsafeCell<Cqe>,
}

impl CqIter {
    /// Unlocked, with an all-zero current completion.
    pub fn new() -> Self {
        Self {
            held: AtomicBool::new(false),
            cur: UnsafeCell::new(Cqe::default()),
        }
    }

    /// Step 1: wait until no thread owns the iteration, then own it.
    pub fn lock(&self) {
        let mut spins = 0u32;
        while self
            .held
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            // Wait on plain loads, so waiters do not bounce the line.
            while self.held.load(Ordering::Relaxed) {
                if spins < SPINS_BEFORE_YIELD {
                    spins += 1;
                    std::hint::spin_loop();
                } else {
                    std::thread::yield_now();
                }
            }
        }
    }

    /// Steps 3 and 4: give up the iteration.
    ///
    /// # Safety
    /// The caller owns the iteration through this lock: it (or the
    /// `start_poll` this call ends) took it with [`CqIter::lock`], and it
    /// has not been released since.
    pub unsafe fn unlock(&self) {
        self.held.store(false, Ordering::Release);
    }

    /// Step 2: make `e` the current completion.
    ///
    /// # Safety
    /// The calling thread owns the iteration: it holds the lock, or the CQ
    /// was created single-threaded and this is the one thread polling it.
    pub unsafe fn set_current(&self, e: Cqe) {
        // SAFETY: caller contract: no other thread reads or writes `cur`
        // while we own the iteration (step 2), so this write races with
        // nothing; the lock's Acquire/Release orders it with the previous
        // and next owners.
        unsafe { *self.cur.get() = e };
    }

    /// Step 2: the current completion.
    ///
    /// # Safety
    /// As [`CqIter::set_current`].
    pub unsafe fn current(&self) -> Cqe {
        // SAFETY: caller contract, as in set_current: only the owner of the
        // iteration touches `cur`.
        unsafe { *self.cur.get() }
    }
}

impl CqIter {
    /// Step 1 for one call: take the lock when `lock` (a CQ not created
    /// single-threaded) until the returned guard drops.
    pub fn hold(&self, lock: bool) -> Held<'_> {
        if lock {
            self.lock();
        }
        Held {
            it: lock.then_some(self),
        }
    }
}

/// The lock taken by [`CqIter::hold`], released on drop.
#[derive(Debug)]
pub struct Held<'a> {
    it: Option<&'a CqIter>,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(it) = self.it {
            // SAFETY: `hold` took the lock for this guard, and only this
            // drop releases it.
            unsafe { it.unlock() };
        }
    }
}

impl Default for CqIter {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for CqIter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqIter")
            .field("held", &self.held.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two threads each own the iteration in turn and bump the current
    /// completion's wr_id non-atomically: with mutual exclusion no update
    /// is lost.
    #[test]
    fn lock_makes_one_owner_at_a_time() {
        // Under Miri, whose scheduler switches threads inside rounds, a
        // thousand rounds a thread take the lock at once, after failed
        // exchanges, and (in the long holds below) after a waiter's spins
        // ran out and it yielded: thousands of failed exchanges and of
        // yields. At twenty thousand, Miri's time goes from 3 s to more
        // than a minute with its random choices.
        const ROUNDS: u64 = if cfg!(miri) { 1_000 } else { 20_000 };
        let it = CqIter::new();
        // SAFETY (test, for the Sync that UnsafeCell withholds): every
        // access to `cur` below is made while holding the lock.
        struct Shared<'a>(&'a CqIter);
        // SAFETY: see above; `held` is atomic.
        unsafe impl Sync for Shared<'_> {}
        let shared = Shared(&it);
        std::thread::scope(|s| {
            for _ in 0..2 {
                let sh = &shared;
                s.spawn(move || {
                    for round in 0..ROUNDS {
                        sh.0.lock();
                        // SAFETY: we hold the lock (step 2).
                        let mut e = unsafe { sh.0.current() };
                        e.wr_id += 1;
                        // One round in 64 holds the lock longer than a
                        // waiter spins before it yields.
                        let spins = if round % 64 == 0 {
                            2 * SPINS_BEFORE_YIELD
                        } else {
                            1
                        };
                        for _ in 0..spins {
                            std::hint::spin_loop();
                        }
                        // SAFETY: as above.
                        unsafe { sh.0.set_current(e) };
                        // SAFETY: taken at the top of this round.
                        unsafe { sh.0.unlock() };
                    }
                });
            }
        });
        it.lock();
        // SAFETY: we hold the lock; the threads are gone.
        assert_eq!(unsafe { it.current() }.wr_id, 2 * ROUNDS);
        // SAFETY: taken just above.
        unsafe { it.unlock() };
    }
}
