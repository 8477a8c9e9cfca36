//! Loom models of the worker park/unpark protocol (`pool::park`) and the
//! stop sequence, through the public pool API on tiny rings.
//!
//! The main thread waits (on a loom condvar) for the worker to have handled
//! what was offered *before* it drops its sink, because dropping a sink
//! unparks every worker and would heal a lost wake-up. A lost wake-up thus
//! shows up as a deadlock (worker parked, main waiting), which loom reports;
//! a lost or duplicated item fails the assertions.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p cqd-core --test loom_worker --release`
#![cfg(loom)]

use std::collections::VecDeque;
use std::time::Duration;

use loom::sync::{Arc, Condvar, Mutex};

use cqd_core::pool::PoolSink;
use cqd_core::pool::{worker_for_key, Pool};
use cqd_core::sink::{Burst, Route, Routed, WorkSink};
use cqd_core::topology::{PoolConfig, TopologyConfig};

/// What the worker has handled, in order, and a condvar to wait on it.
#[derive(Default)]
struct Log {
    items: Mutex<Vec<u32>>,
    grew: Condvar,
}

impl Log {
    /// Blocks until `n` items were handled; returns them.
    fn wait_for(&self, n: usize) -> Vec<u32> {
        let mut items = self.items.lock().unwrap();
        while items.len() < n {
            items = self.grew.wait(items).unwrap();
        }
        items.clone()
    }
}

/// Spawns a one-worker pool of `capacity` slots fed by `producers` sinks;
/// the worker appends every item it runs to the returned log.
fn pool(capacity: usize, producers: usize) -> (Pool, Vec<PoolSink<u32>>, Arc<Log>) {
    pool_of(1, capacity, producers)
}

/// As [`pool`], with `workers` workers sharing the log.
fn pool_of(
    workers: usize,
    capacity: usize,
    producers: usize,
) -> (Pool, Vec<PoolSink<u32>>, Arc<Log>) {
    let log = Arc::new(Log::default());
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("m", workers).capacity(capacity))
        .validate()
        .expect("valid topology");
    let plan = topology.take_pool("m").expect("pool plan");
    let seen = log.clone();
    let (pool, sinks) = plan
        .spawn(producers, move |_| {
            let seen = seen.clone();
            move |item: u32| {
                seen.items.lock().unwrap().push(item);
                seen.grew.notify_all();
            }
        })
        .expect("spawn");
    (pool, sinks, log)
}

fn keyed(items: impl IntoIterator<Item = u32>) -> VecDeque<Routed<u32>> {
    items
        .into_iter()
        .map(|item| Routed {
            route: Route::Key(7),
            item,
        })
        .collect()
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// Two separate offers race with the worker going idle after the first:
/// every interleaving of publish/fence/check against announce/fence/re-check/
/// park ends with both items handled, in order, and the pool joined.
#[test]
fn no_lost_wakeup_between_push_and_park() {
    model(|| {
        let (pool, mut sinks, log) = pool(2, 1);
        let mut sink = sinks.pop().unwrap();
        let mut spill = keyed([1]);
        sink.offer(&mut spill);
        assert!(spill.is_empty());
        let mut spill = keyed([2]);
        sink.offer(&mut spill);
        assert!(spill.is_empty());
        assert_eq!(log.wait_for(2), [1, 2]);
        drop(sink);
        let snapshot = pool.join().unwrap();
        assert_eq!(snapshot.items(), 2);
        let w = &snapshot.workers[0];
        assert!(w.parks >= w.wakeups);
    });
}

/// A full ring refuses without blocking and keeps the refused items in
/// order; flushing hands them over once the worker frees a slot; the stop
/// sequence loses nothing.
#[test]
fn full_ring_refuses_in_order_and_stop_drains() {
    model(|| {
        let (pool, mut sinks, log) = pool(1, 1);
        let mut sink = sinks.pop().unwrap();
        let mut spill = keyed([1, 2]);
        sink.offer(&mut spill);
        assert!(!spill.is_empty(), "a one-slot ring takes at most one item");
        assert_eq!(spill.front().map(|r| r.item), Some(2));
        sink.flush(&mut spill, Duration::from_secs(3600)).unwrap();
        assert_eq!(log.wait_for(2), [1, 2]);
        drop(sink);
        pool.join().unwrap();
    });
}

/// Two producers (two pollers) feed one worker, each through its own ring;
/// a wake-up from either is never lost. The worker exits only after both
/// sinks are gone and both rings are drained.
#[test]
fn two_producers_and_stop_order() {
    model(|| {
        let (pool, mut sinks, log) = pool(1, 2);
        let mut second = sinks.pop().unwrap();
        let mut first = sinks.pop().unwrap();
        let other = loom::thread::spawn(move || {
            let mut spill = keyed([20]);
            second.offer(&mut spill);
            assert!(spill.is_empty());
            second
        });
        let mut spill = keyed([10]);
        first.offer(&mut spill);
        assert!(spill.is_empty());
        let second = other.join().unwrap();
        let mut seen = log.wait_for(2);
        drop(first);
        drop(second);
        pool.join().unwrap();
        seen.sort_unstable();
        assert_eq!(seen, [10, 20]);
    });
}

/// The stop sequence: items offered right before the sink is dropped are
/// all handled before `join` returns, whatever the worker was doing.
#[test]
fn stop_right_after_offer_loses_nothing() {
    model(|| {
        let (pool, mut sinks, log) = pool(2, 1);
        let mut sink = sinks.pop().unwrap();
        let mut spill = keyed([1, 2]);
        sink.offer(&mut spill);
        assert!(spill.is_empty());
        drop(sink);
        pool.join().unwrap();
        assert_eq!(*log.items.lock().unwrap(), [1, 2]);
    });
}

/// One offer feeds two workers (a key for each): each ring's wake-up goes to
/// its own worker, and neither is lost.
#[test]
fn one_offer_wakes_each_worker_it_feeds() {
    let k0 = (0..).find(|&k| worker_for_key(k, 2) == 0).unwrap();
    let k1 = (0..).find(|&k| worker_for_key(k, 2) == 1).unwrap();
    model(move || {
        let (pool, mut sinks, log) = pool_of(2, 1, 1);
        let mut sink = sinks.pop().unwrap();
        let mut spill: VecDeque<_> = [(k0, 1), (k1, 2)]
            .into_iter()
            .map(|(k, item)| Routed {
                route: Route::Key(k),
                item,
            })
            .collect();
        sink.offer(&mut spill);
        assert!(spill.is_empty());
        let mut seen = log.wait_for(2);
        drop(sink);
        pool.join().unwrap();
        seen.sort_unstable();
        assert_eq!(seen, [1, 2]);
    });
}

/// A two-slot, one-worker pool fed through a [`Burst`]: `hand_offs` makes
/// the offers, the burst is then dropped (settled), and in every
/// interleaving against the worker's announce/fence/re-check/park the
/// worker handles `expect`, in order: none lost, none left asleep.
fn through_a_burst(
    expect: &'static [u32],
    hand_offs: impl Fn(&mut Burst<'_, u32, PoolSink<u32>>, &Log) + Send + Sync + 'static,
) {
    model(move || {
        let (pool, mut sinks, log) = pool(2, 1);
        let mut sink = sinks.pop().unwrap();
        let mut burst = Burst::new(&mut sink);
        hand_offs(&mut burst, &log);
        drop(burst);
        assert_eq!(log.wait_for(expect.len()), expect);
        drop(sink);
        let snapshot = pool.join().unwrap();
        assert_eq!(snapshot.items(), expect.len() as _);
    });
}

/// Burst offers (`Burst::offer`) may defer the fence and the wake-up check
/// while the worker looks awake; the settle after them (the poller's next
/// round that finds nothing; here, the burst dropped) completes the check:
/// a worker that raced into sleep is woken by the settle at the latest.
#[test]
fn burst_offers_then_settle_lose_no_wakeup() {
    through_a_burst(&[1, 2], |burst, _| {
        for item in [1, 2] {
            let mut spill = keyed([item]);
            burst.offer(&mut spill, 0);
            assert!(spill.is_empty());
        }
    });
}

/// A burst offer followed by a plain offer (the poller's spill offered
/// again, or the stop's flush): the plain offer completes the deferred
/// check of the burst's publication as well as its own, before the burst
/// is settled.
#[test]
fn burst_then_plain_offer_lose_no_wakeup() {
    through_a_burst(&[1], |burst, log| {
        burst.offer(&mut keyed([1]), 0);
        burst.sink().offer(&mut keyed([]));
        assert_eq!(log.wait_for(1), [1], "woken by the plain offer");
    });
}

/// A burst offer may hold its publication back for the next hand-off (the
/// pool's step 3'); the settle after it publishes it and runs the check.
#[test]
fn held_burst_publication_then_settle_loses_nothing() {
    through_a_burst(&[1], |burst, _| {
        burst.offer(&mut keyed([1]), 0);
    });
}

/// A held publication followed by a burst hand-off with nothing new (a
/// poller round whose completions emitted no work), which publishes what
/// was held and owes its check, then the settle (the unit tests in
/// `pool::feed` check that the empty hand-off publishes).
#[test]
fn held_burst_publication_then_empty_burst_publishes() {
    through_a_burst(&[1], |burst, _| {
        let mut spill = keyed([1]);
        burst.offer(&mut spill, 0);
        burst.offer(&mut spill, 0);
    });
}
