//! The worker park/unpark protocol: no lost wake-up, and no wake-up unless a
//! ring went from empty to non-empty while its worker was (about to be) parked.
//!
//! Each worker has one [`Bell`] (a `sleeping` flag on its own cache line) and
//! one ring per producer. All flag and ring-position accesses are `Relaxed`,
//! `Acquire` or `Release`; the two `SeqCst` fences below (one per side) order
//! the store-then-load pairs, Dekker style.
//!
//! Worker, when a pass over its rings found nothing:
//!
//! 1. Spin, then back off: re-check the rings after every spin-loop hint
//!    for up to [`SPIN_WINDOW`] (a producer that keeps publishing is seen
//!    at once, as by a spinning worker), then between exponentially growing
//!    spins and `yield`s (crossbeam's `Backoff::snooze`), so that a worker
//!    sharing its CPU lets the producer run before it parks.
//! 2. Announce: store `sleeping = true`, then `fence(SeqCst)`.
//! 3. Read `open` (the number of producers still alive) with `Acquire`, then
//!    re-check every ring. Work found: store `sleeping = false` and serve it.
//! 4. No producer left and every ring empty: store `sleeping = false` and
//!    exit; nothing can arrive any more.
//! 5. Park. On return (a wake-up, or a spurious return) store
//!    `sleeping = false` and serve the rings again.
//!
//! Producer, per offer:
//!
//! 1. Stage and publish a batch per ring (`Release` store of the tail; see
//!    `ring`), remembering each ring's old tail.
//! 2. `fence(SeqCst)`, once for the whole offer.
//! 3. For each ring published to: if the worker's `sleeping` flag is set
//!    and the consumer's position equals the old tail (the ring was empty,
//!    so this publication is the empty→non-empty transition), unpark it.
//!
//! Why no wake-up is lost: take the producer's fence P (step 2) and the
//! worker's fence W (its step 2). If P precedes W, the worker's re-check in
//! its step 3 sees the new tail and does not park. If W precedes P, the
//! producer's loads in its step 3 see `sleeping = true`, and the consumer's
//! position that the worker stored before W, which equals the old tail
//! because the worker saw the ring empty; so it unparks, and the park token
//! makes a later `park` return at once. A producer going away (drop) lowers
//! `open` and then unparks every worker unconditionally, so step 4 is reached.
//! `tests/loom_worker.rs` checks this exhaustively on small rings.
//!
//! # Deferred checks (burst offers)
//!
//! The fence of producer step 2 waits until every store before it, the
//! batch's slot writes and the tail included, has left the store buffer;
//! those lines sit in the worker's cache, so it costs a round trip to the
//! worker's core per offer (perf showed it at about 60% of the producer's
//! time in `benches/handoff.rs`). A producer that knows it will offer
//! again soon ([`WorkSink::offer_burst`](crate::sink::WorkSink::offer_burst),
//! the poller's hand-off after a round that found completions) may owe
//! steps 2 and 3 instead of running them:
//!
//! - 2'. After publishing, record each publication's old tail as owed
//!   (the first one per ring), and load the `sleeping` flag of each worker
//!   owed a check, `Relaxed` and without a fence (a cache hit: the flag is
//!   rarely written). If any is set, run steps 2 and 3 now.
//! - The owed steps 2 and 3 run, for every owed ring at once, at the
//!   producer's next plain offer, [`settle`](crate::sink::WorkSink::settle)
//!   or space arm, at an offer that published nothing, and after at most
//!   [`MAX_DEFERRED_CHECKS`](super::MAX_DEFERRED_CHECKS) deferring offers
//!   in a row; dropping the sink unparks every worker anyway.
//! - Step 3 generalised: with several publications owed on a ring, the
//!   first one's old tail `f` and the tail now `t`, unpark if the worker
//!   announced sleep and its position `h` has `f <= h < t`. A parked
//!   worker saw its ring empty at position `h` after its fence. If
//!   `h >= f`, a publication it may have missed came after: wake it. If
//!   `h < f`, the publication that started at `h` was checked with a fence
//!   before (the argument above: it woke the worker, or the worker's
//!   re-check saw it and so `h` could not be its position). With one
//!   publication owed this is the `h == old tail` test of step 3.
//!
//! The `Relaxed` load of step 2' proves nothing when it reads `false` (the
//! worker's announcement may not have reached this core), which is why the
//! check is owed rather than skipped: a worker that raced into sleep is
//! woken by the owed check, at most one burst later than by a plain offer.
//! A worker that has slept for a while shows its flag, and is woken at once.
//! The poller owes checks only across rounds that found completions (the
//! next round follows at once) and settles in every hand-off that may
//! precede a sleep. `tests/loom_worker.rs` models burst offers followed by
//! a settle, and by a plain offer.
//!
//! # Held publications (burst offers)
//!
//! A worker waiting for work keeps reading its ring's tail, so every
//! publication's store of the tail waits for that line to come back from
//! the worker's core, and the producer's later stores queue behind it.
//! A burst offer that was refused nothing may therefore hold its
//! publication back (producer step 1 without step 2) for the next
//! hand-off, once in a row, and only while every worker looks awake (the
//! same `Relaxed` read of the flags as step 2'; a worker that shows its
//! flag gets the publication at once). The next hand-off publishes what was
//! held with its own items, as one publication whose old tail is the held
//! items' first slot, so steps 2 and 3 above apply unchanged; until then
//! the held items are staged slots that no worker can see, so no
//! interleaving of the worker's steps differs from one where the producer
//! had not yet staged them. The next hand-off is a burst offer (the poller
//! makes one for every round that found completions, even when their
//! handlers emitted nothing), a plain offer, a settle or a space arm, or
//! the sink's drop: items wait at most one poller round longer, never past
//! the poller's next sleep. `tests/loom_worker.rs` models a held
//! publication then a settle, and then an empty burst hand-off.

use crossbeam_utils::CachePadded;

use crate::sync::{fence, thread, AtomicBool, AtomicUsize, Ordering};

/// Whether a worker spins and backs off before parking (step 1). Under loom
/// every check is a branch of the model and a yield is not a loom yield, so
/// the model goes straight to step 2, which is the step that matters there.
const BACK_OFF: bool = cfg!(not(loom));

/// How long a worker that found its rings empty spins on them, re-checking
/// after every spin-loop hint, before it backs off (step 1). A producer
/// streaming batches publishes far more often than this, so its worker
/// never leaves the spin (measured in `docs/benchmarks-handoff.md`); an
/// idle worker pays this much CPU once per idle spell, then backs off and
/// parks. Only workers with CPUs of their own spin (a pool whose placement
/// no poller or other pool of the topology may share, `PoolPlan`): on a
/// shared CPU the spin would take the time of the thread that is about to
/// hand it work (measured: the storage demo with its server poller and
/// worker on one CPU lost a fifth of its throughput to it).
pub(crate) const SPIN_WINDOW: std::time::Duration = std::time::Duration::from_micros(20);

/// Spin-loop hints between two reads of the clock in the spin window.
const SPINS_PER_CLOCK_READ: u32 = 32;

/// A worker's sleeping flag.
#[derive(Debug, Default)]
pub(crate) struct Bell {
    sleeping: CachePadded<AtomicBool>,
}

/// What a worker found when it had nothing to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Idle {
    /// Work arrived while spinning or announcing; nothing was parked.
    Work,
    /// The worker parked and was woken (or returned spuriously).
    Parked,
    /// No producer is left and every ring is empty.
    Closed,
}

impl Bell {
    /// The worker side, steps 1 to 5. `has_work` re-checks every ring;
    /// `parking` runs once the worker is committed to park, before it
    /// sleeps (the park counter: a snapshot then shows the park while the
    /// worker sleeps).
    pub(crate) fn idle(
        &self,
        open: &AtomicUsize,
        spin_window: std::time::Duration,
        mut has_work: impl FnMut() -> bool,
        parking: impl FnOnce(),
    ) -> Idle {
        // 1. Spin, then back off.
        if BACK_OFF {
            let started = std::time::Instant::now();
            'spin: while !spin_window.is_zero() {
                for _ in 0..SPINS_PER_CLOCK_READ {
                    std::hint::spin_loop();
                    if has_work() {
                        return Idle::Work;
                    }
                }
                if started.elapsed() >= spin_window {
                    break 'spin;
                }
            }
            let backoff = crossbeam_utils::Backoff::new();
            while !backoff.is_completed() {
                backoff.snooze();
                if has_work() {
                    return Idle::Work;
                }
            }
        }
        // 2. Announce.
        self.sleeping.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        // 3. Re-check, reading `open` first so that a zero makes every
        //    publication of the departed producers visible to the re-check.
        let closed = open.load(Ordering::Acquire) == 0;
        if has_work() {
            self.sleeping.store(false, Ordering::Relaxed);
            return Idle::Work;
        }
        // 4. Nothing can arrive any more.
        if closed {
            self.sleeping.store(false, Ordering::Relaxed);
            return Idle::Closed;
        }
        // 5. Park.
        parking();
        thread::park();
        self.sleeping.store(false, Ordering::Relaxed);
        Idle::Parked
    }

    /// The producer side, step 3 (after the caller's publication and
    /// [`producer_fence`]): whether the worker must be unparked.
    /// `was_empty` loads the consumer's position; it is called only when
    /// the worker announced sleep, because that flag's line is rarely
    /// written (a cache hit) while the position's line moves with every
    /// batch the worker takes. Both loads follow the fence, so their order
    /// does not matter to the protocol.
    #[inline]
    pub(crate) fn needs_wake(&self, was_empty: impl FnOnce() -> bool) -> bool {
        self.sleeping.load(Ordering::Relaxed) && was_empty()
    }

    /// The producer side of a deferred check (step 2'): whether the worker
    /// looks like it announced sleep, by a `Relaxed` load with no fence
    /// before it. `true` is a hint to check now; `false` proves nothing
    /// (the announcement may not be visible yet), so the caller must still
    /// run steps 2 and 3 later.
    #[inline]
    pub(crate) fn looks_asleep(&self) -> bool {
        self.sleeping.load(Ordering::Relaxed)
    }

    /// For unit tests of the producer side: a worker's announcement.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn set_sleeping(&self, sleeping: bool) {
        self.sleeping.store(sleeping, Ordering::Relaxed);
    }
}

/// The producer side, step 2: one fence per offer, between publication and
/// the loads of step 3.
#[inline]
pub(crate) fn producer_fence() {
    fence(Ordering::SeqCst);
}
