//! Small runs of the worker pool's unsafe ring and its park/unpark, sized
//! for Miri (`cargo +nightly miri test -p cqd-core --test miri_pool`, which
//! `.ci/run` runs): two producers' sinks, two workers parking and waking on
//! four-slot rings, items with heap payloads (so that a slot read twice, or
//! never dropped, shows as a double free or a leak), a panicking work item,
//! and the stop. The same tests run natively as ordinary tests.
#![cfg(not(loom))]

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use cqd_core::sink::{Route, Routed, WorkSink};
use cqd_core::topology::{PoolConfig, TopologyConfig};

const ITEMS: u64 = if cfg!(miri) { 60 } else { 5_000 };

#[test]
fn every_item_is_run_once_across_park_and_wake() {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("miri", 2).capacity(4))
        .validate()
        .unwrap();
    let ran = Arc::new(AtomicU64::new(0));
    let sum = Arc::new(AtomicU64::new(0));
    let (pool, sinks) = topology
        .take_pool("miri")
        .unwrap()
        .spawn(2, |_| {
            let (ran, sum) = (ran.clone(), sum.clone());
            move |item: Box<u64>| {
                sum.fetch_add(*item, Relaxed);
                ran.fetch_add(1, Relaxed);
                if *item % 17 == 3 {
                    panic!("injected");
                }
            }
        })
        .unwrap();
    std::thread::scope(|s| {
        for (p, mut sink) in sinks.into_iter().enumerate() {
            s.spawn(move || {
                let mut spill = VecDeque::new();
                for i in 0..ITEMS {
                    let route = if i % 3 == 0 {
                        Route::LeastLoaded
                    } else {
                        Route::Key(i)
                    };
                    spill.push_back(Routed {
                        route,
                        item: Box::new(p as u64 * ITEMS + i),
                    });
                    if spill.len() >= 5 {
                        sink.offer(&mut spill);
                        // Let the workers drain and park now and then.
                        if !spill.is_empty() {
                            std::thread::yield_now();
                        }
                    }
                }
                sink.flush(&mut spill, Duration::from_secs(600)).unwrap();
                assert!(spill.is_empty());
            });
        }
    });
    let snap = pool.join().unwrap();
    let n = 2 * ITEMS;
    assert_eq!(ran.load(Relaxed), n);
    assert_eq!(sum.load(Relaxed), n * (n - 1) / 2);
    assert_eq!(snap.items(), n);
    assert_eq!(snap.panics(), (0..n).filter(|i| i % 17 == 3).count() as u64);
}

#[test]
fn dropping_sinks_with_nothing_offered_stops_parked_workers() {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("idle", 2).capacity(4))
        .validate()
        .unwrap();
    let (pool, sinks) = topology
        .take_pool("idle")
        .unwrap()
        .spawn(2, |_| |_: Box<u64>| {})
        .unwrap();
    std::thread::sleep(Duration::from_millis(1));
    drop(sinks);
    assert_eq!(pool.join().unwrap().items(), 0);
}
