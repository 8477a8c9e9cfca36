//! The timed engine and NIC fault injection.

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::{sges, Rig};
use cqd_core::{NoSink, OpKind, PollMode, PollerBuilder, Side, Status};
use cqd_sim::{CqConfig, Engine, Fabric, NicFaults, QpCap, QpState, SendWr, TimedModel, WrOp};

fn timed(latency: Duration) -> Fabric {
    Fabric::new(Engine::Timed(TimedModel {
        latency,
        ..TimedModel::default()
    }))
    .unwrap()
}

#[test]
fn timed_engine_completes_after_the_latency() {
    let mut r = Rig::with(
        timed(Duration::from_millis(100)),
        QpCap::default(),
        1024,
        CqConfig::default(),
    );
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    let t0 = Instant::now();
    r.send(&r.a, OpKind::Write, 1, |id| {
        SendWr::new(id, WrOp::Write(remote), s)
    })
    .unwrap();
    assert_eq!(r.poll_all(), 0, "not before the latency");
    let deadline = t0 + Duration::from_secs(5);
    while r.poll_all() == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(t0.elapsed() >= Duration::from_millis(100));
    assert_eq!(r.log.take()[0].tag, 1);
}

#[test]
fn timed_engine_keeps_order_per_send_queue_through_a_poller_thread() {
    let mut r = Rig::with(
        timed(Duration::from_micros(50)),
        QpCap {
            max_send_wr: 128,
            ..QpCap::default()
        },
        1024,
        CqConfig::default(),
    );
    let poller = r.take_poller();
    let Rig {
        a,
        b,
        mr_a,
        mr_b,
        reg,
        log,
        fabric,
        cq,
        ..
    } = r;
    let t = PollerBuilder::new("p", NoSink)
        .mode(PollMode::Event)
        .cq(poller)
        .spawn()
        .unwrap();
    let sge = [mr_a.sge(0, 64)];
    let mut posted = 0u32;
    while posted < 2000 {
        let id = reg.wr_id(OpKind::Write, posted).unwrap();
        reg.track(OpKind::Write, 1);
        match a.post_send(&[SendWr::new(id, WrOp::Write(mr_b.remote(0)), &sge)]) {
            Ok(()) => posted += 1,
            Err(_) => {
                reg.untrack(OpKind::Write, 1);
                std::thread::yield_now();
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while reg.ledger().outstanding() > 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    let report = t.stop().unwrap();
    let tags: Vec<u32> = log.take().iter().map(|e| e.tag).collect();
    assert_eq!(tags, (0..2000).collect::<Vec<_>>());
    assert_eq!(report.cqs[0].overflows, 0);
    assert_eq!(cq.budget_snapshot().overflows, 0);
    drop((a, b, fabric));
}

#[test]
fn delayed_requests_hold_back_their_queue_until_due() {
    let mut r = Rig::new();
    r.fabric.set_faults(NicFaults {
        delay_rate: 1.0,
        delay_by: Duration::from_millis(200),
        seed: 7,
        ..NicFaults::default()
    });
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    r.send(&r.a, OpKind::Write, 1, |id| {
        SendWr::new(id, WrOp::Write(remote), s)
    })
    .unwrap();
    r.fabric.set_faults(NicFaults::default());
    r.send(&r.a, OpKind::Write, 2, |id| {
        SendWr::new(id, WrOp::Write(remote), s)
    })
    .unwrap();
    assert_eq!(r.poll_all(), 0, "the second waits behind the delayed first");
    std::thread::sleep(Duration::from_millis(250));
    r.fabric.progress();
    assert_eq!(r.poll_all(), 2);
    let tags: Vec<u32> = r.log.take().iter().map(|e| e.tag).collect();
    assert_eq!(tags, vec![1, 2]);
    assert_eq!(r.fabric.stats().delayed, 1);
}

#[test]
fn injected_errors_and_forced_qp_errors() {
    let mut r = Rig::new();
    r.recv(&r.a, 9, &[r.mr_a.sge(0, 64)]).unwrap();
    r.fabric.set_faults(NicFaults {
        error_rate: 1.0,
        seed: 1,
        ..NicFaults::default()
    });
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    r.send(&r.a, OpKind::Write, 1, |id| {
        SendWr::new(id, WrOp::Write(remote), s).unsignaled()
    })
    .unwrap();
    r.poll_all();
    let evs = r.log.take();
    assert_eq!(
        (evs[0].side, evs[0].tag, evs[0].status),
        (Side::Send, 1, Status::RetryExceeded),
        "unsignaled errors complete"
    );
    assert_eq!(
        (evs[1].side, evs[1].tag, evs[1].status),
        (Side::Recv, 9, Status::WrFlush)
    );
    assert_eq!(r.a.state().unwrap(), QpState::Err);
    r.fabric.set_faults(NicFaults {
        qp_error_rate: 1.0,
        seed: 1,
        ..NicFaults::default()
    });
    r.send(&r.b, OpKind::Write, 2, |id| {
        SendWr::new(id, WrOp::Write(r.mr_a.remote(0)), s)
    })
    .unwrap();
    r.poll_all();
    let evs = r.log.take();
    assert_eq!((evs[0].tag, evs[0].status), (2, Status::WrFlush));
    assert_eq!(r.fabric.stats().forced_qp_errors, 1);
    assert_eq!(r.reg.ledger().outstanding(), 0);
    let mut out = VecDeque::new();
    assert_eq!(r.poller().poll_once(&mut out).unwrap(), 0);
}

#[test]
fn timed_engine_retries_rnr_on_its_timer() {
    let model = TimedModel {
        latency: Duration::from_micros(10),
        rnr_timer: Duration::from_millis(50),
        ..TimedModel::default()
    };
    let mut r = Rig::with(
        Fabric::new(Engine::Timed(model)).unwrap(),
        QpCap::default(),
        1024,
        CqConfig::default(),
    );
    for q in [&r.a, &r.b] {
        q.modify(cqd_sim::Modify::Reset).unwrap();
    }
    cqd_sim::connect_with(&r.a, &r.b, 3).unwrap();
    let s = sges(&[r.mr_a.sge(0, 8)]);
    // A receive posted while the sender retries: success.
    r.send(&r.a, OpKind::Send, 1, |id| SendWr::new(id, WrOp::Send, s))
        .unwrap();
    std::thread::sleep(Duration::from_millis(5));
    r.recv(&r.b, 2, &[r.mr_b.sge(0, 64)]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while r.reg.ledger().outstanding() > 0 && Instant::now() < deadline {
        r.poll_all();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(r.log.take().iter().all(|e| e.ok));
    assert!(r.fabric.stats().rnr_retries >= 1);
    // None posted: 3 retries, then RNR retry exceeded.
    r.send(&r.a, OpKind::Send, 3, |id| SendWr::new(id, WrOp::Send, s))
        .unwrap();
    let t0 = Instant::now();
    while r.reg.ledger().outstanding() > 0 && Instant::now() < deadline + Duration::from_secs(5) {
        r.poll_all();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(
        t0.elapsed() >= Duration::from_millis(150),
        "three timers of 50 ms"
    );
    let evs = r.log.take();
    assert_eq!((evs[0].tag, evs[0].status), (3, Status::RnrRetryExceeded));
}
