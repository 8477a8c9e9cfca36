//! The poller's spill: back-pressure and the space wait.
//!
//! Work the sink refuses stays in the poller's spill queue, in order, and is
//! offered again on every loop. The hand-off of a round that found
//! completions is a burst offer ([`WorkSink::offer_burst`]: the next round
//! follows at once); every other hand-off is a plain offer, or a
//! [`WorkSink::settle`] when the spill is empty, so that whatever a burst
//! deferred (the pool's wake-up check) is done before the poller can sleep.
//!
//! Two rules keep that queue bounded and the poller off the CPU:
//!
//! 1. **The mark.** Before polling a round, the poller compares its spill
//!    with its high-water mark ([`PollerBuilder::spill_high_water_mark`]).
//!    Above it, the poller does not poll, arm or sleep on its CQs: it only
//!    offers the spill again. The CQs hold the completions meanwhile
//!    (admission makes that safe: a CQ cannot receive more than it was sized
//!    for) and, because credits return only as completions are polled, the
//!    posters run out of credits: the back-pressure reaches them.
//! 2. **The space wait.** With a spill and nothing else to do, the poller
//!    sleeps until a worker frees ring space, never spinning (except in
//!    Busy mode, which spins by choice):
//!    1. it arms the sink ([`WorkSink::arm_space`]: announce on the full
//!       destinations, fence, re-check by offering again); a re-check that
//!       handed items over ends the wait at once;
//!    2. at or below the mark it then runs the CQ sleep protocol
//!       (`mode::sleep_once`) and blocks on the CQs' notifications *and* the
//!       space doorbell; above the mark it blocks on the space doorbell and
//!       the poller's doorbell (stop, registrations) only (the control set
//!       of `poller::ready`);
//!    3. either way with the safety timeout; on return it drains the space
//!       doorbell, disarms the sink and offers again.
//!
//!    A sink that cannot wake ([`SpaceWait::Unsupported`]) is retried on a
//!    short timer (a tenth of the wake timeout, 1–10 ms) instead.
//!
//! # The bound
//!
//! Handlers emit work only while the poller polls, and the poller polls only
//! in a round that starts with `spill <= mark` (rule 1; the re-poll and
//! post-wake polls of the sleep protocol are rounds too, and a re-poll that
//! finds completions ends the sleep before any further poll). One round
//! polls at most `B_i` completions from CQ `i` (its `CqOptions::batch`) —
//! it polls a CQ again within its round budget only while the spill is at
//! or below the mark, so the repeat polls keep the bound — and
//! each completion makes its handler emit at most `m` items (a property of
//! the application's handlers: cqd does not cap an outbox). A hand-off only
//! removes items. So at every moment, before and after the hand-off:
//!
//! ```text
//! spill <= mark + m × (B_1 + ... + B_k)        (= mark + m × B × k for equal batches)
//! ```
//!
//! The stop is the one exception: it drains every CQ whatever the spill
//! (posting has stopped, so this adds at most `m ×` what the CQs hold), so
//! that every completion reaches its handler; what the sink still refuses at
//! the stop timeout is handed back, never dropped
//! ([`PollerBuilder::on_undelivered`]).

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

use super::{Group, PollerBuilder};
use crate::metrics::{bump, raise};
use crate::mode::PollMode;
use crate::sink::{Bursting, Routed, SpaceWait, SpaceWaker, WorkSink};
use crate::sync::Ordering;
use crate::sys::Doorbell;

/// The default high-water mark of a poller's spill: four default batches.
pub const DEFAULT_SPILL_HIGH_WATER_MARK: usize = 128;

/// What receives the undelivered items at the stop.
pub(super) type GiveBack<W> = Box<dyn FnOnce(Vec<W>) + Send>;

/// The spill queue and its state.
pub(super) struct Spill<W> {
    pub(super) items: VecDeque<Routed<W>>,
    /// Items at the front of `items` already counted as spilled.
    counted: usize,
    mark: usize,
    above: bool,
    /// The space doorbell, once the sink took its waker.
    pub(super) space: Option<Arc<Doorbell>>,
    give_back: Option<GiveBack<W>>,
    /// The last block was skipped: arming found space.
    pub(super) skipped_block: bool,
}

impl<W> Spill<W> {
    pub(super) fn new(mark: usize, give_back: Option<GiveBack<W>>) -> Self {
        Spill {
            items: VecDeque::new(),
            counted: 0,
            mark,
            above: false,
            space: None,
            give_back,
            skipped_block: false,
        }
    }

    /// The high-water mark.
    pub(super) fn mark(&self) -> usize {
        self.mark
    }

    /// Rule 1: the poller must not poll.
    pub(super) fn above_mark(&self) -> bool {
        self.items.len() > self.mark
    }
}

impl<W: Send + 'static, S: WorkSink<W>> PollerBuilder<W, S> {
    /// The spill's high-water mark, in work items (default
    /// [`DEFAULT_SPILL_HIGH_WATER_MARK`]). While more items than this wait
    /// in its spill queue, the poller stops polling its CQs (back-pressure:
    /// the CQs hold the completions, the posters run out of credits) and
    /// sleeps until a worker frees ring space. The spill then never holds
    /// more than
    ///
    /// ```text
    /// mark + m × (B_1 + ... + B_k)
    /// ```
    ///
    /// items, for `k` CQs polled `B_i` completions at a time
    /// ([`CqOptions::batch`](crate::cq::CqOptions::batch), 32 by default)
    /// whose handlers emit at most `m` items per completion. 0 stops
    /// polling as soon as anything is spilled.
    pub fn spill_high_water_mark(mut self, items: usize) -> Self {
        self.spill_mark = items;
        self
    }

    /// Receives, at the stop, the work items the sink never took (in their
    /// order; a sink that stays full past
    /// [`stop_timeout`](Self::stop_timeout)), so the application can fail
    /// those requests explicitly. Called once, on the poller thread, only
    /// if something is left. Without it, what is left is dropped after an
    /// error-level trace; the report counts it either way
    /// ([`PollerReport::undelivered`](super::PollerReport::undelivered)).
    pub fn on_undelivered(mut self, f: impl FnOnce(Vec<W>) + Send + 'static) -> Self {
        self.give_back = Some(Box::new(f));
        self
    }
}

impl<W: Send + 'static, S: WorkSink<W>> Group<W, S> {
    /// Hands the sink the space waker (at the start of the thread). A
    /// doorbell that cannot be made, or a sink that cannot wake, leaves the
    /// poller retrying on a timer.
    pub(super) fn install_space_waker(&mut self) {
        let Ok(doorbell) = Doorbell::new() else {
            tracing::warn!("no eventfd for the space wake-up; spills retry on a timer");
            return;
        };
        if let Err(e) = self.ready.add_space(&doorbell) {
            tracing::warn!(error = %e, "space doorbell not in the epoll set; spills retry on a timer");
            return;
        }
        let doorbell = Arc::new(doorbell);
        let ring = Arc::clone(&doorbell);
        if self
            .sink
            .set_space_waker(SpaceWaker::new(move || ring.ring()))
        {
            self.spill.space = Some(doorbell);
        }
    }

    /// Offers the spill (fresh items behind the counted ones) to the sink,
    /// completing any wake-up check an earlier burst deferred: what the
    /// poller calls before it may go idle.
    pub(super) fn hand_off(&mut self) {
        self.offer_spill(false);
    }

    /// The hand-off of a round that found completions: the poller runs
    /// another round next, whose hand-off completes what this one defers
    /// ([`WorkSink::offer_burst`]).
    pub(super) fn hand_off_burst(&mut self) {
        self.offer_spill(true);
    }

    fn offer_spill(&mut self, burst: bool) {
        let before = self.spill.items.len();
        if before == 0 {
            if burst {
                // Nothing to hand over, but the sink hears of the round: a
                // pool publishes what an earlier burst offer held back and
                // counts the round toward its bound on deferred checks
                // (`pool::park`, "Deferred checks"), so neither waits for
                // a round that finds nothing.
                self.sink
                    .offer_burst(&mut self.spill.items, 0, &Bursting(()));
            } else {
                self.sink.settle();
            }
            return;
        }
        let fresh = self.spill.counted.min(before);
        let refused = if burst {
            self.sink
                .offer_burst(&mut self.spill.items, fresh, &Bursting(()))
        } else {
            self.sink.offer_fresh(&mut self.spill.items, fresh)
        };
        self.after_offer(before, refused);
    }

    /// Counts a hand-off: items taken, fresh items refused (each counted
    /// once), the gauge, the high-water mark and the throttle.
    fn after_offer(&mut self, before: usize, fresh_refused: usize) {
        let left = self.spill.items.len();
        let m = &self.metrics.0;
        bump(&m.handed_off, before.saturating_sub(left) as u64);
        bump(&m.spills, fresh_refused as u64);
        m.spill_len.store(left as u64, Ordering::Relaxed);
        raise(&m.spill_high_water, left as u64);
        self.spill.counted = left;
        let above = self.spill.above_mark();
        if above && !self.spill.above {
            bump(&m.throttles, 1);
        }
        self.spill.above = above;
    }

    /// Space wait step 1: arm the sink (announce, fence, re-check).
    pub(super) fn arm_space(&mut self) -> SpaceWait {
        let before = self.spill.items.len();
        let wait = if self.spill.space.is_some() {
            self.sink.arm_space(&mut self.spill.items)
        } else {
            self.sink.offer(&mut self.spill.items);
            if self.spill.items.len() < before {
                SpaceWait::Progress
            } else {
                SpaceWait::Unsupported
            }
        };
        self.after_offer(before, 0);
        wait
    }

    /// Space wait step 3: drain the doorbell, disarm the sink.
    pub(super) fn end_space_wait(&mut self) {
        if let Some(d) = &self.spill.space {
            if d.drain() > 0 {
                bump(&self.metrics.0.space_wakeups, 1);
            }
        }
        self.sink.disarm_space();
    }

    /// A short pause for retries that have no wake-up: a tenth of the wake
    /// timeout, 1–10 ms.
    pub(super) fn retry_pause(&self) -> Duration {
        (self.wake_timeout / 10).clamp(Duration::from_millis(1), Duration::from_millis(10))
    }

    /// With the spill above its mark and nothing polled: Busy mode spins
    /// (it never sleeps); every other mode waits for space (rule 2, above
    /// the mark).
    pub(super) fn throttled(&mut self) {
        if matches!(self.idle.mode(), PollMode::Busy) {
            self.idle.spin();
        } else {
            self.wait_for_space(self.wake_timeout);
        }
    }

    /// Sleeps until a worker frees space, `timeout` passes or the poller's
    /// doorbell rings (stop, registrations); never on the CQs'
    /// notifications.
    pub(super) fn wait_for_space(&mut self, timeout: Duration) {
        let armed = match self.arm_space() {
            SpaceWait::Progress => return,
            SpaceWait::Armed => true,
            _ => false,
        };
        let timeout = if armed {
            timeout
        } else {
            timeout.min(self.retry_pause())
        };
        // The control set: the poller's doorbell and the space doorbell,
        // never the CQs' notifications.
        if self.wait_control(timeout).is_err() {
            std::thread::sleep(self.retry_pause().min(timeout));
        }
        bump(&self.metrics.0.space_waits, 1);
        if armed {
            self.end_space_wait();
        }
        self.record_cpu();
    }

    /// Stop step 3: hands the spill over, waiting for space, until
    /// `deadline`; then gives what is left back. Returns how many.
    pub(super) fn flush_spill(&mut self, deadline: std::time::Instant) -> u64 {
        loop {
            self.hand_off();
            let now = std::time::Instant::now();
            if self.spill.items.is_empty() || now >= deadline {
                break;
            }
            self.wait_for_space((deadline - now).min(self.wake_timeout));
        }
        let left: Vec<W> = self.spill.items.drain(..).map(|r| r.item).collect();
        self.spill.counted = 0;
        self.metrics.0.spill_len.store(0, Ordering::Relaxed);
        let n = left.len() as u64;
        hand_back(&self.name, left, self.spill.give_back.take());
        n
    }
}

/// The end of every stop's hand-over (a poller thread's, the tokio
/// driver's): gives `left`, the work the sink never took, in order, to the
/// application's `on_undelivered` callback, or drops it after an
/// error-level trace when there is none. False when the callback panicked
/// (caught and traced).
pub(crate) fn hand_back<W>(who: &str, left: Vec<W>, callback: Option<impl FnOnce(Vec<W>)>) -> bool {
    let n = left.len();
    if n == 0 {
        return true;
    }
    let Some(callback) = callback else {
        tracing::error!(
            poller = who,
            undelivered = n,
            "stop: work the sink never took; no on_undelivered callback, dropped"
        );
        return true;
    };
    tracing::error!(
        poller = who,
        undelivered = n,
        "stop: work the sink never took; handing it back"
    );
    let given = catch_unwind(AssertUnwindSafe(|| callback(left))).is_ok();
    if !given {
        tracing::error!(poller = who, "the on_undelivered callback panicked");
    }
    given
}
