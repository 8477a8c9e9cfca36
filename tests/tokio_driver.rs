//! A CQ group driven by a tokio task (`cqd::core::driver::TokioDriver`) on
//! the simulated NIC: every completion reaches its handler exactly once,
//! work reaches a pool, a handler registered while the task sleeps gets its
//! completions, a CQ that drops notifications is recovered by the safety
//! net, and both ways to stop (`DriverHandle::stop().await`, and `shutdown`
//! from another thread beside a poller thread) account for everything.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::driver::{DriverHandle, TokioDriver};
use cqd::core::topology::{PollerConfig, PoolConfig, TopologyConfig};
use cqd::core::*;
use cqd::sim::{connect, Access, CqConfig, Device, Mr, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp};

/// Counts its completions; pushes one work item per receive.
struct Count {
    seen: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
}

impl Handler<u64> for Count {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, u64>) {
        self.seen.fetch_add(1, Relaxed);
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, u64>) {
        self.seen.fetch_add(1, Relaxed);
        out.push_to(Route::Key(u64::from(d.tag())), u64::from(d.byte_len()));
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, u64>) {
        if !f.is_flush() {
            self.errors.fetch_add(1, Relaxed);
        }
    }
}

/// Counts its completions, emits no work.
struct Plain {
    seen: Arc<AtomicU64>,
}

impl Handler for Plain {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.fetch_add(1, Relaxed);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.seen.fetch_add(1, Relaxed);
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

struct Rig<W> {
    _dev: Device,
    a: Qp,
    b: Qp,
    mr: Mr,
    handle: CqHandle<W>,
}

fn rig<W: Send + 'static>(name: &str, cq_config: CqConfig) -> (Rig<W>, UnboundCq<W>) {
    let dev = Device::open(name);
    let (cq, unbound, handle) = dev
        .create_dispatched_cq(name, 256, cq_config, CqOptions::default())
        .unwrap();
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: 32,
        max_recv_wr: 32,
        ..QpCap::default()
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(64 * 1024, Access::ALL).unwrap();
    (
        Rig {
            _dev: dev,
            a,
            b,
            mr,
            handle,
        },
        unbound,
    )
}

/// `rounds` of 16 receives and 16 sends through `reg`, each round awaited
/// (the driver runs meanwhile on the same thread).
async fn exchange<W>(r: &Rig<W>, reg: &Registration, seen: &AtomicU64, rounds: u64) {
    let start = seen.load(Relaxed);
    for round in 0..rounds {
        let bufs: Vec<_> = (0..16).map(|i| [r.mr.sge(i * 1024, 1024)]).collect();
        let mut recvs: Vec<_> = (0..16).map(|i| RecvWr::new(i as u64, &bufs[i])).collect();
        reg.post_recv(&r.b, &mut recvs).unwrap();
        let data = [r.mr.sge(32 * 1024, 64)];
        let mut sends: Vec<_> = (0..16).map(|t| SendWr::new(t, WrOp::Send, &data)).collect();
        reg.post_send(&r.a, &mut sends).unwrap();
        let want = start + (round + 1) * 32;
        let deadline = Instant::now() + Duration::from_secs(20);
        while seen.load(Relaxed) < want {
            assert!(
                Instant::now() < deadline,
                "{} of {want} completions",
                seen.load(Relaxed)
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    }
}

/// A pool fed by one planned poller `poller` (of CQ `cq`), whose workers
/// take `per_item` per item and count them; the poller's feed.
fn fed_pool(
    poller: &str,
    cq: &str,
    pool: PoolConfig,
    per_item: Duration,
) -> (
    cqd::core::pool::Pool,
    cqd::core::pool::PoolSink<u64>,
    Arc<AtomicU64>,
) {
    let name = pool.name.clone();
    let mut topology = TopologyConfig::new()
        .poller(PollerConfig::new(poller).cq(cq).pool(name.as_str()))
        .pool(pool)
        .validate()
        .unwrap();
    let items = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&items);
    let (pool, mut feeds) = topology
        .take_pool(&name)
        .unwrap()
        .spawn_feeds(move |_| {
            let counted = Arc::clone(&counted);
            move |_: u64| {
                if !per_item.is_zero() {
                    std::thread::sleep(per_item);
                }
                counted.fetch_add(1, Relaxed);
            }
        })
        .unwrap();
    let sink = feeds.take(&topology.take_poller(poller).unwrap()).unwrap();
    (pool, sink, items)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn every_completion_reaches_its_handler_and_the_pool_under_the_driver() {
    let (pool, sink, items) = fed_pool("net", "td0", PoolConfig::new("io", 2), Duration::ZERO);
    let (r, unbound) = rig::<u64>("td0", CqConfig::default());
    let (seen, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let report = local.block_on(&rt, async {
        let driver = TokioDriver::new("net", sink)
            .cq(unbound)
            .wake_timeout(Duration::from_secs(1))
            .spawn_local()
            .unwrap();
        let reg = r
            .handle
            .register(Count {
                seen: Arc::clone(&seen),
                errors: Arc::clone(&errors),
            })
            .unwrap();
        exchange(&r, &reg, &seen, 100).await;
        // A handler registered while the task sleeps: the doorbell wakes it
        // and it applies the registration at once (the wake timeout is 1 s).
        tokio::time::sleep(Duration::from_millis(20)).await;
        let before = r.handle.snapshot().registrations;
        let late = r
            .handle
            .register(Count {
                seen: Arc::clone(&seen),
                errors: Arc::clone(&errors),
            })
            .unwrap();
        let deadline = Instant::now() + Duration::from_millis(500);
        while r.handle.snapshot().registrations == before {
            assert!(
                Instant::now() < deadline,
                "the doorbell did not wake the driver"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        exchange(&r, &late, &seen, 3).await;
        r.a.force_error();
        r.b.force_error();
        driver.stop().await
    });
    let pool = pool.join().unwrap();
    assert_eq!(seen.load(Relaxed), 103 * 32);
    assert_eq!(errors.load(Relaxed), 0);
    assert!(report.is_clean(), "{report}");
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(report.poller.name, "net");
    assert_eq!(report.cqs[0].completions, 103 * 32);
    assert_eq!(report.poller.handed_off, 103 * 16);
    assert_eq!(items.load(Relaxed), 103 * 16);
    assert_eq!(pool.items(), 103 * 16);
    assert!(report.cqs[0].events > 0, "it slept on notifications");
    // Woken by notifications, not by the safety net: a broken wake-up path
    // would leave every round to the 1 s timeout.
    assert_eq!(report.cqs[0].recovered_missed_events, 0);
    assert!(report.poller.timeouts <= 2, "{:?}", report.poller);
    assert!(report.poller.control_wakeups >= 1, "{:?}", report.poller);
    assert_eq!(
        report.cqs[0].events, report.cqs[0].acks,
        "every event acknowledged"
    );
}

#[test]
fn shutdown_takes_the_driver_beside_a_poller_thread() {
    let (r, unbound) = rig::<NoWork>("td1", CqConfig::default());
    let (r2, unbound2) = rig::<NoWork>("td2", CqConfig::default());
    let seen = Arc::new(AtomicU64::new(0));
    let thread = PollerBuilder::new("thread", NoSink)
        .cq(unbound2)
        .spawn()
        .unwrap();
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let system = local.block_on(&rt, async {
        let driver: DriverHandle = TokioDriver::new("task", NoSink)
            .cq(unbound)
            .spawn_local()
            .unwrap();
        let reg = r
            .handle
            .register(Plain {
                seen: Arc::clone(&seen),
            })
            .unwrap();
        let reg2 = r2
            .handle
            .register(Plain {
                seen: Arc::clone(&seen),
            })
            .unwrap();
        exchange(&r, &reg, &seen, 10).await;
        exchange(&r2, &reg2, &seen, 10).await;
        // Receives left posted on both: the stop's flush returns them.
        let bufs: Vec<_> = (0..4).map(|i| [r.mr.sge(i * 1024, 1024)]).collect();
        let mut recvs: Vec<_> = (0..4).map(|i| RecvWr::new(i as u64, &bufs[i])).collect();
        reg.post_recv(&r.b, &mut recvs).unwrap();
        let mut recvs: Vec<_> = (0..4).map(|i| RecvWr::new(i as u64, &bufs[i])).collect();
        reg2.post_recv(&r2.b, &mut recvs).unwrap();
        let (qps, qps2) = ((r.a, r.b), (r2.a, r2.b));
        // The driver's thread runs its task meanwhile: shutdown blocks
        // another thread.
        tokio::task::spawn_blocking(move || {
            shutdown(
                || {
                    for q in [&qps.0, &qps.1, &qps2.0, &qps2.1] {
                        q.force_error();
                    }
                },
                [Stopper::from(driver), Stopper::from(thread)],
                [],
            )
        })
        .await
        .unwrap()
    });
    assert!(system.is_clean(), "{system}");
    let names: Vec<&str> = system
        .pollers
        .iter()
        .map(|p| p.poller.name.as_str())
        .collect();
    assert_eq!(names, ["task", "thread"]);
    for p in &system.pollers {
        assert!(p.accounts.is_balanced(), "{}", p.accounts);
        assert_eq!(p.cqs[0].flushes, 4, "{}", p.poller.name);
    }
    assert_eq!(seen.load(Relaxed), 2 * 10 * 32);
}

#[test]
fn the_safety_net_recovers_what_lost_notifications_would_strand() {
    let faults = cqd::sim::Faults {
        drop: 0.3,
        spurious: 0.1,
        seed: 11,
        ..Default::default()
    };
    let (r, unbound) = rig::<NoWork>(
        "td3",
        CqConfig {
            faults,
            ..CqConfig::default()
        },
    );
    let seen = Arc::new(AtomicU64::new(0));
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let report = local.block_on(&rt, async {
        let driver = TokioDriver::new("lossy", NoSink)
            .cq(unbound)
            .wake_timeout(Duration::from_millis(2))
            .spawn_local()
            .unwrap();
        let reg = r
            .handle
            .register(Plain {
                seen: Arc::clone(&seen),
            })
            .unwrap();
        // Gaps longer than the arm-to-notification path, so that the task
        // sleeps between rounds and lost notifications matter.
        for _ in 0..40 {
            exchange(&r, &reg, &seen, 1).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        driver.stop().await
    });
    assert_eq!(seen.load(Relaxed), 40 * 32);
    assert!(report.is_clean(), "{report}");
    assert!(report.poller.timeouts > 0);
    assert!(
        report.cqs[0].recovered_missed_events > 0,
        "30 % of notifications dropped: the safety net must have found some: {:?}",
        report.cqs[0]
    );
}

#[test]
fn a_stop_under_back_pressure_hands_everything_over_and_collects_every_flush() {
    // One slow worker behind a ring of 2: the driver's spill passes its mark.
    let slow = PoolConfig::new("slow", 1).capacity(2);
    let (pool, sink, items) = fed_pool("bp", "td4", slow, Duration::from_micros(300));
    let (r, unbound) = rig::<u64>("td4", CqConfig::default());
    let driver = TokioDriver::new("bp", sink)
        .cq(unbound)
        .drain_timeout(Duration::from_secs(3));
    let (report, errors) = drive_counted(&r, driver, 20, |reg| {
        // Receives left posted: only the stop's drain collects their flushes.
        let bufs: Vec<_> = (0..16).map(|i| [r.mr.sge(i * 1024, 1024)]).collect();
        let mut recvs: Vec<_> = (0..16).map(|i| RecvWr::new(i as u64, &bufs[i])).collect();
        reg.post_recv(&r.b, &mut recvs).unwrap();
        r.a.force_error();
        r.b.force_error();
    });
    let pool = pool.join().unwrap();
    assert!(report.is_clean(), "{report}");
    assert!(!report.accounts.timed_out, "{}", report.accounts);
    // The drain went past the spill's mark: it did not sit out its 3 s.
    assert!(
        report.accounts.waited < Duration::from_secs(2),
        "{}",
        report.accounts
    );
    assert_eq!(report.cqs[0].flushes, 16);
    assert_eq!(errors, 0, "flushes only");
    assert_eq!(report.undelivered, 0);
    assert_eq!(items.load(Relaxed), 20 * 16, "every item handed over");
    assert_eq!(pool.items(), 20 * 16);
}

/// A sink that takes nothing (a pool that never drains).
struct Refuse;

impl WorkSink<u64> for Refuse {
    fn offer(&mut self, _: &mut VecDeque<Routed<u64>>) {}
}

/// Spawns `driver` on a `LocalSet` of a current-thread runtime, registers
/// a `Count` handler on `r`, runs `rounds` of [`exchange`], then `before_stop`,
/// then stops the driver: its report, and the handler's error count.
fn drive_counted<S: WorkSink<u64> + 'static>(
    r: &Rig<u64>,
    driver: TokioDriver<u64, S>,
    rounds: u64,
    before_stop: impl FnOnce(&Registration),
) -> (PollerReport, u64) {
    let (seen, errors) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let report = local.block_on(&rt, async {
        let driver = driver.spawn_local().unwrap();
        let reg = r
            .handle
            .register(Count {
                seen: Arc::clone(&seen),
                errors: Arc::clone(&errors),
            })
            .unwrap();
        exchange(r, &reg, &seen, rounds).await;
        before_stop(&reg);
        driver.stop().await
    });
    (report, errors.load(Relaxed))
}

#[test]
fn a_stop_hands_back_what_the_sink_never_took() {
    let (r, unbound) = rig::<u64>("td5", CqConfig::default());
    let back = Rc::new(RefCell::new(Vec::new()));
    let into = Rc::clone(&back);
    let driver = TokioDriver::new("refused", Refuse)
        .cq(unbound)
        .stop_timeout(Duration::from_millis(50))
        .on_undelivered(move |left| into.borrow_mut().extend(left));
    let (report, errors) = drive_counted(&r, driver, 3, |_| {});
    // Every receive's item, in order (each round's tags 0..16), came back;
    // none was dropped, and the report says how many.
    let want: Vec<u64> = (0..3).flat_map(|_| std::iter::repeat_n(64, 16)).collect();
    assert_eq!(*back.borrow(), want);
    assert_eq!(report.undelivered, 48);
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert!(
        !report.is_clean(),
        "undelivered work is a finding: {report}"
    );
    assert_eq!(errors, 0);
}

/// CQs added to a running driver (`DriverHandle::add_cq`): each joins, its
/// notifications wake the task (none of its completions is left to the
/// 1 s safety net), and the stop's report has every CQ, clean. A CQ on a
/// shared completion channel, and a name the driver serves already, are
/// refused with their reasons.
#[test]
fn cqs_added_to_a_running_driver_are_served() {
    let (r0, u0) = rig::<NoWork>("grow0", CqConfig::default());
    let (r1, u1) = rig::<NoWork>("grow1", CqConfig::default());
    let (r2, u2) = rig::<NoWork>("grow2", CqConfig::default());
    let (_dup, u_dup) = rig::<NoWork>("grow1", CqConfig::default());
    let shared_dev = Device::open("grow-shared");
    let shared_config = CqConfig {
        channel: Some(cqd::sim::SimChannel::new().unwrap()),
        ..CqConfig::default()
    };
    let (_shared_cq, u_shared, _h) = shared_dev
        .create_dispatched_cq::<NoWork>("grow-shared", 64, shared_config, CqOptions::default())
        .unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let report = local.block_on(&rt, async {
        let driver = TokioDriver::new("grow", NoSink)
            .cq(u0)
            .wake_timeout(Duration::from_secs(1))
            .spawn_local()
            .unwrap();
        let plain = || Plain {
            seen: Arc::clone(&seen),
        };
        let reg0 = r0.handle.register(plain()).unwrap();
        exchange(&r0, &reg0, &seen, 2).await;
        for u in [u1, u2] {
            let joining = driver.add_cq(u).map_err(|n| n.error().clone()).unwrap();
            joining.await.unwrap();
        }
        let reg1 = r1.handle.register(plain()).unwrap();
        let reg2 = r2.handle.register(plain()).unwrap();
        // The task sleeps between rounds: each CQ's descriptor wakes it.
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            exchange(&r1, &reg1, &seen, 1).await;
            tokio::time::sleep(Duration::from_millis(5)).await;
            exchange(&r2, &reg2, &seen, 1).await;
        }
        let dup = driver
            .add_cq(u_dup)
            .map_err(|n| n.error().clone())
            .unwrap()
            .await;
        assert!(
            matches!(&dup, Err(JoinError::Duplicate { cq, .. }) if cq == "grow1"),
            "{dup:?}"
        );
        let shared = driver
            .add_cq(u_shared)
            .map_err(|n| n.error().clone())
            .unwrap()
            .await;
        assert!(
            matches!(&shared, Err(JoinError::SharedChannel { cq, .. }) if cq == "grow-shared"),
            "{shared:?}"
        );
        for r in [&r0, &r1, &r2] {
            r.a.force_error();
            r.b.force_error();
        }
        driver.stop().await
    });
    assert!(report.is_clean(), "{report}");
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let names: Vec<_> = report.cqs.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["grow0", "grow1", "grow2"]);
    assert_eq!(seen.load(Relaxed), 2 * 32 + 6 * 32);
    for c in &report.cqs[1..] {
        assert_eq!(c.completions, 3 * 32, "{}", c.name);
        assert!(c.events > 0, "{}: it slept on notifications", c.name);
        assert_eq!(c.recovered_missed_events, 0, "{}", c.name);
    }
}
