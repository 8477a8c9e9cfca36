//! The space wake-up: a producer (a poller) whose spill a full ring refused
//! sleeps until that ring's worker frees slots — the mirror of the worker's
//! park ([`park`](super::park)), with the roles swapped. No lost wake-up, and
//! no wake-up unless the producer announced that it waits.
//!
//! Each producer has one [`SpaceBell`]: the waker it installed once
//! ([`WorkSink::set_space_waker`](crate::sink::WorkSink::set_space_waker))
//! and one `waiting` flag per ring (per worker), each on its own cache line.
//! Flag and ring-position accesses are `Relaxed`, `Acquire` or `Release`;
//! the two `SeqCst` fences below (one per side) order the store-then-load
//! pairs, Dekker style.
//!
//! Producer, when an offer left items and it is about to sleep
//! ([`WorkSink::arm_space`](crate::sink::WorkSink::arm_space)):
//!
//! 1. Announce: for every ring that the last offer left full (by its cached
//!    view), store `waiting = true` (`Release`, so a worker that sees it also
//!    sees the waker installed before).
//! 2. `fence(SeqCst)`, once.
//! 3. Re-check: offer again, which reloads every ring's consumer position
//!    (`Acquire`). Items taken: clear the flags and do not sleep.
//! 4. Sleep until woken (the poller's doorbell, an eventfd: a wake before
//!    the sleep makes the sleep return at once) or the safety timeout; then
//!    clear the flags (disarm) and offer again.
//!
//! Worker, after each pass over its rings that took items:
//!
//! 1. Free each ring's batch (one `Release` store of its head; ring step 4).
//! 2. `fence(SeqCst)`, once per pass.
//! 3. For each ring it took from: if that ring's flag is set (a `Relaxed`
//!    load of a line that is rarely written), swap it to false (`Acquire`);
//!    if this swap cleared it, wake the producer.
//!
//! Why no wake-up is lost: take the producer's fence P (its step 2) and the
//! worker's fence W (its step 2) after the worker freed slots of a flagged
//! ring. If W precedes P, the producer's re-check (its step 3) loads the
//! consumer position after P and sees the freed slots, so it hands items
//! over and does not sleep. If P precedes W, the worker's flag load after W
//! sees `true` and wakes the producer. Which rings: a ring that is not full
//! by the producer's cached view has free slots in truth (the cache only
//! lags the consumer), so every item the re-check still refuses is bound for
//! a flagged ring. `tests/loom_space.rs` checks this on tiny rings, and that
//! without the producer's fence loom finds the lost wake-up.
//!
//! The cost: the worker pays one fence per pass that found work (not per
//! item); the poller pays steps 1–3 only when it is about to sleep with a
//! spill. The offer itself is unchanged.

use std::sync::OnceLock;

use crossbeam_utils::CachePadded;

use crate::sink::SpaceWaker;
use crate::sync::{fence, AtomicBool, Ordering};

/// One producer's waker and its per-ring `waiting` flags.
#[derive(Debug)]
pub(crate) struct SpaceBell {
    waker: OnceLock<SpaceWaker>,
    waiting: Box<[CachePadded<AtomicBool>]>,
}

impl SpaceBell {
    /// A bell for a producer with a ring to each of `workers` workers.
    pub(crate) fn new(workers: usize) -> Self {
        SpaceBell {
            waker: OnceLock::new(),
            waiting: (0..workers)
                .map(|_| CachePadded::new(AtomicBool::new(false)))
                .collect(),
        }
    }

    /// Installs the producer's waker (once); false if one already was.
    pub(crate) fn set_waker(&self, waker: SpaceWaker) -> bool {
        self.waker.set(waker).is_ok()
    }

    /// Whether a waker is installed.
    pub(crate) fn has_waker(&self) -> bool {
        self.waker.get().is_some()
    }

    /// Producer step 1, for the ring to `worker`.
    pub(crate) fn announce(&self, worker: usize) {
        if let Some(flag) = self.waiting.get(worker) {
            flag.store(true, Ordering::Release);
        }
    }

    /// Producer step 3 or 4: withdraws every announcement.
    pub(crate) fn disarm(&self) {
        for flag in self.waiting.iter() {
            flag.store(false, Ordering::Relaxed);
        }
    }

    /// Worker step 3 (after [`consumer_fence`]), for the ring from this
    /// producer to `worker`: wakes the producer if it announced.
    #[inline]
    pub(crate) fn wake_if_waiting(&self, worker: usize) -> bool {
        let Some(flag) = self.waiting.get(worker) else {
            return false;
        };
        if flag.load(Ordering::Relaxed) && flag.swap(false, Ordering::Acquire) {
            if let Some(waker) = self.waker.get() {
                waker.wake();
                return true;
            }
        }
        false
    }
}

/// Producer step 2: one fence between the announcements and the re-check.
#[inline]
pub(crate) fn producer_fence() {
    fence(Ordering::SeqCst);
}

/// Worker step 2: one fence per pass, between freeing slots and reading the
/// flags.
#[inline]
pub(crate) fn consumer_fence() {
    fence(Ordering::SeqCst);
}
