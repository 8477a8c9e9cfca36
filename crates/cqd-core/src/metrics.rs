//! Counters, written only by their owner thread, read by anyone.
//!
//! Each counter block is cache-padded and written with Relaxed load + store
//! by the single thread that owns it (no read-modify-write, no lock on the
//! hot path); readers take a [`CqSnapshot`] at any time. Counters written
//! from several threads (registrations) use `fetch_add`.

use std::collections::BTreeMap;

use crossbeam_utils::CachePadded;
use serde::{Deserialize, Serialize};

use crate::completion::Status;
use crate::sync::{AtomicU64, Ordering};

/// Number of batch-size histogram buckets: 1, 2–3, 4–7, …, 64–127, 128+.
pub const BATCH_BUCKETS: usize = 8;

/// Bucket of a non-empty batch of `n` completions.
#[inline]
pub fn batch_bucket(n: usize) -> usize {
    debug_assert!(n > 0);
    let log = usize::BITS - 1 - n.max(1).leading_zeros();
    (log as usize).min(BATCH_BUCKETS - 1)
}

/// Adds `n` to an owner-written counter.
#[inline]
pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// Raises an owner-written high-water mark.
#[inline]
pub(crate) fn raise(c: &AtomicU64, v: u64) {
    if v > c.load(Ordering::Relaxed) {
        c.store(v, Ordering::Relaxed);
    }
}

#[inline]
fn get(c: &AtomicU64) -> u64 {
    c.load(Ordering::Relaxed)
}

/// The counters of one CQ.
#[derive(Debug, Default)]
pub struct CqCounters {
    pub(crate) completions: AtomicU64,
    pub(crate) polls: AtomicU64,
    pub(crate) empty_polls: AtomicU64,
    pub(crate) batch_hist: [AtomicU64; BATCH_BUCKETS],
    pub(crate) events: AtomicU64,
    pub(crate) arms: AtomicU64,
    pub(crate) acks: AtomicU64,
    pub(crate) spurious_wakeups: AtomicU64,
    pub(crate) recovered_missed_events: AtomicU64,
    pub(crate) stale_wr_ids: AtomicU64,
    pub(crate) unmatched_wr_ids: AtomicU64,
    pub(crate) srq_returned: AtomicU64,
    pub(crate) foreign_wr_ids: AtomicU64,
    pub(crate) unknown_status: AtomicU64,
    pub(crate) unknown_opcode: AtomicU64,
    pub(crate) handler_panics: AtomicU64,
    pub(crate) errors_by_status: [AtomicU64; Status::TABLE_LEN],
    pub(crate) flushes: AtomicU64,
    pub(crate) async_events: AtomicU64,
    pub(crate) overflows: AtomicU64,
    pub(crate) poll_errors: AtomicU64,
    pub(crate) arm_errors: AtomicU64,
    pub(crate) in_error: AtomicU64,
    pub(crate) handler_ns: AtomicU64,
    pub(crate) handlers_live: AtomicU64,
    pub(crate) registrations: AtomicU64,
    pub(crate) unregistrations: AtomicU64,
    /// The QP of the last foreign completion, plus 1 (0: none).
    pub(crate) last_foreign_qp: AtomicU64,
    /// The QP of the last stale completion, plus 1 (0: none).
    pub(crate) last_stale_qp: AtomicU64,
    /// The handler the last stale completion named ([`key_word`]).
    pub(crate) last_stale_key: AtomicU64,
    /// The QP of the last unmatched completion, plus 1 (0: none).
    pub(crate) last_unmatched_qp: AtomicU64,
    /// The handler the last unmatched completion named ([`key_word`]).
    pub(crate) last_unmatched_key: AtomicU64,
    /// The handler whose callback panicked last ([`key_word`]).
    pub(crate) last_panic_key: AtomicU64,
    pub(crate) recv_queues_dry: AtomicU64,
    /// The QP of the last receive queue found dry, plus 1 (0: none).
    pub(crate) last_dry_qp: AtomicU64,
    /// The handler of the last receive consumed from it ([`key_word`]).
    pub(crate) last_dry_key: AtomicU64,
    pub(crate) slow_batches: AtomicU64,
    pub(crate) slow_handler_calls: AtomicU64,
    pub(crate) probed_calls: AtomicU64,
    /// The handler of the last slow call ([`key_word`]), its time, and the
    /// longest slow call.
    pub(crate) last_slow_key: AtomicU64,
    pub(crate) last_slow_ns: AtomicU64,
    pub(crate) max_slow_ns: AtomicU64,
}

/// A handler key as one word for the `last_*` counters (0: none).
pub(crate) fn key_word(key: crate::wr_id::HandlerKey) -> u64 {
    (u64::from(key.slot()) << 16 | u64::from(key.generation())) + 1
}

fn key_of(word: u64) -> Option<String> {
    let w = word.checked_sub(1)?;
    crate::wr_id::HandlerKey::new((w >> 16) as u32, w as u16).map(|k| k.to_string())
}

fn qp_of(word: u64) -> Option<u32> {
    word.checked_sub(1).map(|q| q as u32)
}

/// The counters of one CQ, cache-padded.
#[derive(Debug, Default)]
pub struct CqMetrics(pub(crate) CachePadded<CqCounters>);

impl CqMetrics {
    /// The publication of a CQ overflow (the poller's `check_async`), so
    /// that a snapshot that shows the overflow shows the CQ in error and
    /// the budget's count of it:
    ///
    /// 1. the error state (a relaxed store);
    /// 2. the budget's count, under its lock;
    /// 3. the overflow count, `count` (the poller's own count, the only
    ///    writer's), with a release store;
    /// 4. a snapshot loads the count first, with acquire, then the error
    ///    state (`snapshot` reads the fields in order).
    ///
    /// The loom model `loom_overflow` checks it, and that a relaxed count
    /// (step 3 without its release) lets a reader see the overflow on a CQ
    /// not in error. The count is the poller's own, written with one
    /// release store (no load of the counter first): the shape the model
    /// checks.
    pub(crate) fn publish_overflow(&self, count: u64, budget: Option<&crate::budget::CqBudget>) {
        self.0.in_error.store(1, Ordering::Relaxed);
        if let Some(b) = budget {
            b.record_overflow();
        }
        self.0.overflows.store(count, Ordering::Release);
    }

    /// Step 4 of [`publish_overflow`](Self::publish_overflow): the overflow
    /// count (acquire), then the error state.
    #[inline]
    fn overflow_state(&self) -> (u64, bool) {
        let overflows = self.0.overflows.load(Ordering::Acquire);
        (overflows, get(&self.0.in_error) != 0)
    }

    /// A consistent-enough copy of every counter (each is read atomically;
    /// the set is not a single atomic snapshot).
    pub fn snapshot(&self, name: &str, capacity: u32) -> CqSnapshot {
        let c = &self.0;
        let (overflows, in_error) = self.overflow_state();
        let mut errors = BTreeMap::new();
        for (i, n) in c.errors_by_status.iter().enumerate() {
            let n = get(n);
            if n > 0 {
                let label = if i == Status::TABLE_LEN - 1 {
                    "unknown".to_string()
                } else {
                    Status::from_raw(i as u32).to_string()
                };
                errors.insert(label, n);
            }
        }
        CqSnapshot {
            name: name.to_string(),
            capacity,
            completions: get(&c.completions),
            polls: get(&c.polls),
            empty_polls: get(&c.empty_polls),
            batch_histogram: c.batch_hist.iter().map(get).collect(),
            events: get(&c.events),
            arms: get(&c.arms),
            acks: get(&c.acks),
            spurious_wakeups: get(&c.spurious_wakeups),
            recovered_missed_events: get(&c.recovered_missed_events),
            stale_wr_ids: get(&c.stale_wr_ids),
            unmatched_wr_ids: get(&c.unmatched_wr_ids),
            srq_returned: get(&c.srq_returned),
            foreign_wr_ids: get(&c.foreign_wr_ids),
            unknown_status: get(&c.unknown_status),
            unknown_opcode: get(&c.unknown_opcode),
            handler_panics: get(&c.handler_panics),
            errors_by_status: errors,
            flushes: get(&c.flushes),
            async_events: get(&c.async_events),
            overflows,
            poll_errors: get(&c.poll_errors),
            arm_errors: get(&c.arm_errors),
            in_error,
            handler_ns: get(&c.handler_ns),
            handlers_live: get(&c.handlers_live),
            registrations: get(&c.registrations),
            unregistrations: get(&c.unregistrations),
            last_foreign_qp: qp_of(get(&c.last_foreign_qp)),
            last_stale_qp: qp_of(get(&c.last_stale_qp)),
            last_stale_handler: key_of(get(&c.last_stale_key)),
            last_unmatched_qp: qp_of(get(&c.last_unmatched_qp)),
            last_unmatched_handler: key_of(get(&c.last_unmatched_key)),
            last_panicked_handler: key_of(get(&c.last_panic_key)),
            recv_queues_dry: get(&c.recv_queues_dry),
            last_dry_qp: qp_of(get(&c.last_dry_qp)),
            last_dry_handler: key_of(get(&c.last_dry_key)),
            left_dry: Vec::new(),
            slow_batches: get(&c.slow_batches),
            slow_handler_calls: get(&c.slow_handler_calls),
            probed_calls: get(&c.probed_calls),
            last_slow_handler: key_of(get(&c.last_slow_key)),
            last_slow_ns: get(&c.last_slow_ns),
            max_slow_ns: get(&c.max_slow_ns),
            budget: None,
        }
    }
}

/// A copy of one CQ's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct CqSnapshot {
    /// The CQ's name.
    pub name: String,
    /// Its real capacity.
    pub capacity: u32,
    /// Completions polled (every one, dispatched or counted as an anomaly).
    pub completions: u64,
    /// Calls to poll.
    pub polls: u64,
    /// Polls that returned nothing.
    pub empty_polls: u64,
    /// Non-empty polls by batch size: 1, 2–3, 4–7, …, 64–127, 128+.
    pub batch_histogram: Vec<u64>,
    /// Notifications taken from the event descriptor.
    pub events: u64,
    /// Arms requested.
    pub arms: u64,
    /// Notifications acknowledged.
    pub acks: u64,
    /// Wake-ups by a notification that found nothing to poll.
    pub spurious_wakeups: u64,
    /// Wake-ups by the safety timeout that found completions: a lost
    /// notification, recovered.
    pub recovered_missed_events: u64,
    /// Completions whose wr_id named a handler generation no longer live.
    pub stale_wr_ids: u64,
    /// Completions of an accounted queue that matched no request in flight
    /// on it: the device wrote a completion twice, or named a request that
    /// was never posted there. Counted, never delivered.
    #[serde(default)]
    pub unmatched_wr_ids: u64,
    /// Receives still posted on an SRQ at the stop, once no QP could take
    /// them any more, handed back to their handlers as flushes (a device
    /// never completes them).
    #[serde(default)]
    pub srq_returned: u64,
    /// Completions whose wr_id cqd did not make.
    pub foreign_wr_ids: u64,
    /// Completions with a status this version does not know.
    pub unknown_status: u64,
    /// Successful completions with an opcode this version does not know.
    pub unknown_opcode: u64,
    /// Handler callbacks that panicked (caught).
    pub handler_panics: u64,
    /// Error completions by status text.
    pub errors_by_status: BTreeMap<String, u64>,
    /// Flush errors (a subset of the errors).
    pub flushes: u64,
    /// Asynchronous events (overflow, device fatal, …).
    pub async_events: u64,
    /// CQ overflows reported by the device. Stays 0 with admission on.
    pub overflows: u64,
    /// Polls that failed (device gone).
    pub poll_errors: u64,
    /// Arms that failed, the refusal that put the CQ in error included.
    pub arm_errors: u64,
    /// The CQ is in the error state (after an overflow): it is no longer
    /// armed, and its poller polls it once per wake timeout to take what it
    /// still holds.
    pub in_error: bool,
    /// Time spent in handler callbacks, if measured (nanoseconds).
    pub handler_ns: u64,
    /// Handlers registered and not yet retired.
    pub handlers_live: u64,
    /// Registrations accepted.
    pub registrations: u64,
    /// Handlers retired (unregistered and with no work outstanding).
    pub unregistrations: u64,
    /// The QP number of the last foreign completion (a wr_id cqd did not
    /// make), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_foreign_qp: Option<u32>,
    /// The QP number of the last stale completion, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stale_qp: Option<u32>,
    /// The handler (`slot#generation`) the last stale completion named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stale_handler: Option<String>,
    /// The QP number of the last unmatched completion, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_unmatched_qp: Option<u32>,
    /// The handler (`slot#generation`) the last unmatched completion named.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_unmatched_handler: Option<String>,
    /// The handler whose callback panicked last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_panicked_handler: Option<String>,
    /// Times a receive queue was found dry after a batch consumed from it
    /// ([`CqOptions::recv_low_water`](crate::CqOptions::recv_low_water)):
    /// a handler that does not repost, or a peer that outruns it.
    #[serde(default)]
    pub recv_queues_dry: u64,
    /// The QP of the last receive queue found dry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_dry_qp: Option<u32>,
    /// The handler of the last receive consumed from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_dry_handler: Option<String>,
    /// The receive queues (QP numbers) dry now and for at least
    /// [`DRY_GRACE`](crate::cq::DRY_GRACE): a handler that stopped
    /// reposting. The stop's findings name them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left_dry: Vec<u32>,
    /// Batches whose handler calls took longer than
    /// [`CqOptions::slow_batch`](crate::CqOptions::slow_batch).
    #[serde(default)]
    pub slow_batches: u64,
    /// Handler calls over that threshold, found by timing the completions
    /// after a slow batch one by one.
    #[serde(default)]
    pub slow_handler_calls: u64,
    /// Handler calls timed one by one (after slow batches).
    #[serde(default)]
    pub probed_calls: u64,
    /// The handler of the last slow call.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_slow_handler: Option<String>,
    /// Its time (nanoseconds).
    #[serde(default)]
    pub last_slow_ns: u64,
    /// The longest slow call seen (nanoseconds).
    #[serde(default)]
    pub max_slow_ns: u64,
    /// The CQ budget's counters, if a budget is attached (reserved
    /// capacity, credits in use and high-water mark, overflows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<crate::budget::BudgetSnapshot>,
}

impl CqSnapshot {
    /// Error completions of every status.
    pub fn errors(&self) -> u64 {
        self.errors_by_status.values().sum()
    }
}

/// The counters of one poller thread.
#[derive(Debug, Default)]
pub struct PollerCounters {
    pub(crate) loops: AtomicU64,
    pub(crate) sleeps: AtomicU64,
    pub(crate) timeouts: AtomicU64,
    pub(crate) control_wakeups: AtomicU64,
    pub(crate) spin_ns: AtomicU64,
    pub(crate) spills: AtomicU64,
    pub(crate) spill_len: AtomicU64,
    pub(crate) spill_high_water: AtomicU64,
    pub(crate) throttles: AtomicU64,
    pub(crate) space_waits: AtomicU64,
    pub(crate) space_wakeups: AtomicU64,
    pub(crate) handed_off: AtomicU64,
    pub(crate) spin_window_ns: AtomicU64,
    pub(crate) cpu_ns: AtomicU64,
    pub(crate) naps: AtomicU64,
    pub(crate) backoffs: AtomicU64,
}

/// The counters of one poller thread, cache-padded.
#[derive(Debug, Default)]
pub struct PollerMetrics(pub(crate) CachePadded<PollerCounters>);

impl PollerMetrics {
    /// A copy of every counter.
    pub fn snapshot(&self, name: &str) -> PollerSnapshot {
        let c = &self.0;
        PollerSnapshot {
            name: name.to_string(),
            loops: get(&c.loops),
            sleeps: get(&c.sleeps),
            timeouts: get(&c.timeouts),
            control_wakeups: get(&c.control_wakeups),
            spin_ns: get(&c.spin_ns),
            spills: get(&c.spills),
            spill_len: get(&c.spill_len),
            spill_high_water: get(&c.spill_high_water),
            throttles: get(&c.throttles),
            space_waits: get(&c.space_waits),
            space_wakeups: get(&c.space_wakeups),
            handed_off: get(&c.handed_off),
            spin_window_ns: get(&c.spin_window_ns),
            cpu_ns: get(&c.cpu_ns),
            naps: get(&c.naps),
            backoffs: get(&c.backoffs),
        }
    }
}

/// A copy of one poller thread's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct PollerSnapshot {
    /// The poller's name (its builder's, or its topology entry's; the
    /// thread is `cqd-poller-<name>`).
    pub name: String,
    /// Iterations of the poll loop.
    pub loops: u64,
    /// Times the thread blocked waiting for a notification.
    pub sleeps: u64,
    /// Sleeps ended by the safety timeout.
    pub timeouts: u64,
    /// Sleeps ended by a control request (registration, stop).
    pub control_wakeups: u64,
    /// Time spent spinning with nothing to do (nanoseconds).
    pub spin_ns: u64,
    /// Work items the sink could not take at once (kept, retried). Each
    /// item counts once, when it is first refused.
    pub spills: u64,
    /// Items in the spill queue now (a gauge, updated at each hand-off).
    pub spill_len: u64,
    /// Largest spill queue seen after a hand-off. Bounded by the poller's
    /// high-water mark + `m × B × k` (see
    /// [`PollerBuilder::spill_high_water_mark`](crate::poller::PollerBuilder::spill_high_water_mark)).
    pub spill_high_water: u64,
    /// Times the spill went above the high-water mark, so the poller
    /// stopped polling its CQs (back-pressure).
    #[serde(default)]
    pub throttles: u64,
    /// Sleeps with a spill, waiting for a worker to free ring space (above
    /// the mark: for nothing else; at or below it: for CQ events too).
    #[serde(default)]
    pub space_waits: u64,
    /// Of those, the ones a worker's space wake-up ended.
    #[serde(default)]
    pub space_wakeups: u64,
    /// Work items handed to the sink.
    pub handed_off: u64,
    /// The current spin window of Hybrid/Adaptive mode (nanoseconds).
    pub spin_window_ns: u64,
    /// CPU time the thread has used (nanoseconds; updated at each sleep,
    /// nap and at the stop).
    pub cpu_ns: u64,
    /// Naps of an idle Busy poller: short timed sleeps, from
    /// [`BUSY_NAP_MIN`](crate::mode::BUSY_NAP_MIN) doubling up to
    /// [`BUSY_NAP_MAX`](crate::mode::BUSY_NAP_MAX), taken once nothing was
    /// found for [`BUSY_YIELD_UNTIL`](crate::mode::BUSY_YIELD_UNTIL). Not
    /// counted in `sleeps` (no notification is armed or waited for).
    #[serde(default)]
    pub naps: u64,
    /// Pauses of the poll loop (a tenth of the wake timeout, 1–10 ms)
    /// because a CQ's source was failing (its device gone) and no CQ had
    /// work. A CQ known to be in error leaves the active set, so this stays
    /// at a handful per dead device; a count that keeps rising means a
    /// failing source is holding its group back.
    #[serde(default)]
    pub backoffs: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets() {
        assert_eq!(batch_bucket(1), 0);
        assert_eq!(batch_bucket(2), 1);
        assert_eq!(batch_bucket(3), 1);
        assert_eq!(batch_bucket(4), 2);
        assert_eq!(batch_bucket(32), 5);
        assert_eq!(batch_bucket(127), 6);
        assert_eq!(batch_bucket(128), 7);
        assert_eq!(batch_bucket(100_000), 7);
    }

    #[test]
    fn snapshot_names_errors() {
        let m = CqMetrics::default();
        bump(&m.0.errors_by_status[Status::WrFlush.table_index()], 3);
        bump(&m.0.errors_by_status[Status::from_raw(77).table_index()], 1);
        let s = m.snapshot("cq", 16);
        assert_eq!(
            s.errors_by_status.get("Work Request Flushed Error"),
            Some(&3)
        );
        assert_eq!(s.errors_by_status.get("unknown"), Some(&1));
        assert_eq!(s.errors(), 4);
    }
}

#[cfg(test)]
mod serde_tests {
    use super::*;

    #[test]
    fn snapshots_round_trip_through_toml() {
        let m = CqMetrics::default();
        bump(&m.0.completions, 42);
        bump(&m.0.batch_hist[3], 2);
        bump(&m.0.errors_by_status[Status::RemoteAccess.table_index()], 1);
        let snap = m.snapshot("cq0", 1024);
        let text = toml::to_string(&snap).unwrap();
        let back: CqSnapshot = toml::from_str(&text).unwrap();
        assert_eq!(back, snap);
        let p = PollerMetrics::default();
        bump(&p.0.spills, 3);
        let ps = p.snapshot("p0");
        let back: PollerSnapshot = toml::from_str(&toml::to_string(&ps).unwrap()).unwrap();
        assert_eq!(back, ps);
    }
}

#[cfg(all(test, loom))]
mod loom_overflow {
    use super::*;

    /// The poller publishes an overflow while a reader takes a snapshot's
    /// view of it: whenever the view shows the overflow, it shows the CQ
    /// in error.
    fn model(release: bool) {
        loom::model(move || {
            let m = crate::sync::Arc::new(CqMetrics::default());
            let w = crate::sync::Arc::clone(&m);
            let poller = loom::thread::spawn(move || {
                if release {
                    w.publish_overflow(1, None);
                } else {
                    // The mutation: step 3 as a relaxed store.
                    w.0.in_error.store(1, Ordering::Relaxed);
                    w.0.overflows.store(1, Ordering::Relaxed);
                }
            });
            let (overflows, in_error) = m.overflow_state();
            if overflows > 0 {
                assert!(in_error, "an overflow on a CQ not in error");
            }
            poller.join().unwrap();
        });
    }

    #[test]
    fn a_snapshot_that_shows_an_overflow_shows_the_error_state() {
        model(true);
    }

    /// Mutation: the overflow count stored relaxed.
    #[test]
    #[should_panic(expected = "not in error")]
    fn a_relaxed_overflow_count_shows_a_cq_not_in_error() {
        model(false);
    }
}
