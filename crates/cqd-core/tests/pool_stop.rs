//! The stop sequence: pollers (sinks) go first, workers finish everything
//! handed to them, then join. Nothing is lost.
#![cfg(not(loom))]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use cqd_core::pool::PoolError;
use cqd_core::sink::{Route, Routed, WorkSink};
use cqd_core::topology::{PoolConfig, TopologyConfig};

#[test]
fn stop_drains_every_ring_before_join_returns() {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("stop", 2).capacity(4096))
        .validate()
        .unwrap();
    let handled = Arc::new(AtomicU64::new(0));
    let (pool, sinks) = topology
        .take_pool("stop")
        .unwrap()
        .spawn(2, |_| {
            let handled = handled.clone();
            move |_: u64| {
                // Slow enough that the rings are still full at the stop.
                std::thread::sleep(Duration::from_micros(50));
                handled.fetch_add(1, Relaxed);
            }
        })
        .unwrap();
    let mut offered = 0;
    for mut sink in sinks {
        let mut spill: VecDeque<_> = (0..6000u64)
            .map(|i| Routed {
                route: if i % 2 == 0 {
                    Route::Key(i)
                } else {
                    Route::LeastLoaded
                },
                item: i,
            })
            .collect();
        sink.offer(&mut spill);
        offered += 6000 - spill.len();
        // Stop step 1: hand over the spill, then drop the sink.
        sink.flush(&mut spill, Duration::from_secs(60)).unwrap();
        drop(sink);
    }
    assert_eq!(offered, 12_000, "4096-slot rings take everything at once");
    // About 300 ms of work is still in the rings; join must wait for it all.
    let before_join = handled.load(Relaxed);
    assert!(before_join < 12_000, "the test needs work left at the stop");
    let snapshot = pool.join().unwrap();
    assert_eq!(handled.load(Relaxed), 12_000);
    assert_eq!(snapshot.items(), 12_000);
}

#[test]
fn flush_gives_up_with_the_items_still_in_order() {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("stuck", 1).capacity(2))
        .validate()
        .unwrap();
    let gate = Arc::new(std::sync::Barrier::new(2));
    let worker_gate = gate.clone();
    let (pool, mut sinks) = topology
        .take_pool("stuck")
        .unwrap()
        .spawn(1, move |_| {
            let gate = worker_gate.clone();
            let mut first = true;
            move |_: u32| {
                if first {
                    first = false;
                    gate.wait();
                }
            }
        })
        .unwrap();
    let mut spill: VecDeque<_> = (0..10u32)
        .map(|i| Routed {
            route: Route::Key(0),
            item: i,
        })
        .collect();
    let err = sinks[0]
        .flush(&mut spill, Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(err, PoolError::FlushTimeout { left, .. } if left == spill.len()));
    assert!(err.to_string().contains("not handed over"));
    let left: Vec<_> = spill.iter().map(|r| r.item).collect();
    let expected: Vec<_> = (10 - left.len() as u32..10).collect();
    assert_eq!(left, expected, "refused items keep their order");
    gate.wait();
    sinks[0].flush(&mut spill, Duration::from_secs(60)).unwrap();
    drop(sinks);
    assert_eq!(pool.join().unwrap().items(), 10);
}

#[test]
fn dropping_every_sink_without_offering_stops_an_idle_pool() {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("idle", 3))
        .validate()
        .unwrap();
    let (pool, sinks) = topology
        .take_pool("idle")
        .unwrap()
        .spawn(2, |_| |_: ()| {})
        .unwrap();
    // Until every worker has parked (a park is counted as the worker goes
    // to sleep; a loaded machine can take longer than any fixed pause to
    // run the workers that far): the stop below must wake parked workers.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while !pool.snapshot().workers.iter().all(|w| w.parks >= 1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle workers never parked"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(sinks);
    let s = pool.join().unwrap();
    assert_eq!(s.items(), 0);
    assert!(s.workers.iter().all(|w| w.parks >= 1));
}
