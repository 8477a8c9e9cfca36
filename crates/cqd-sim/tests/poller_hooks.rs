//! The budget, ledger and shutdown account wired into the poller itself
//! (no handler wrappers): credits come back as the poller polls, the
//! ledger retires as it polls, and a stop flushes and accounts for every
//! request, or names what is missing.

mod common;

use std::time::{Duration, Instant};

use common::Rig;
use cqd_core::budget::BudgetOptions;
use cqd_core::ledger::WrLedger;
use cqd_core::{NoSink, OpKind, PollMode, PollerBuilder, Side};
use cqd_sim::{CqConfig, Fabric, QpCap, RecvWr, SendWr, WrOp};

fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    cond()
}

/// The shared rig (two connected QPs on one CQ, a recording handler) with
/// a ledger attached to the CQ.
fn rig(cqe: u32, config: CqConfig) -> (Rig, WrLedger) {
    let r = Rig::with(Fabric::inline(), QpCap::default(), cqe, config);
    let ledger = WrLedger::new();
    r.handle.attach_ledger(ledger.clone()).unwrap();
    (r, ledger)
}

#[test]
fn the_poller_returns_credits_and_retires_the_ledger() {
    for mode in PollMode::all() {
        let config = CqConfig {
            budget: BudgetOptions {
                admission: false,
                credits: Some(8),
            },
            ..CqConfig::default()
        };
        let (mut r, ledger) = rig(8, config);
        r.handle.attach_budget(r.cq.budget().clone()).unwrap();
        assert!(
            r.handle.attach_ledger(WrLedger::new()).is_err(),
            "one ledger per CQ"
        );
        let poller = r.take_poller();
        let thread = PollerBuilder::new(mode.name(), NoSink)
            .mode(mode)
            .cq(poller)
            .spawn()
            .unwrap();
        let sge = [r.mr_a.sge(0, 8)];
        for round in 0..50u32 {
            // Two unsignaled writes and a signaled one: 3 credits, all
            // returned when the signaled completion is polled.
            let ids: Vec<u64> = (0..3)
                .map(|i| r.reg.wr_id(OpKind::Write, round * 3 + i).unwrap())
                .collect();
            r.reg.track(OpKind::Write, 1);
            ledger.posted(r.a.qpn(), Side::Send, &ids, Instant::now());
            let wrs = [
                SendWr::new(ids[0], WrOp::Write(r.mr_a.remote(0)), &sge).unsignaled(),
                SendWr::new(ids[1], WrOp::Write(r.mr_a.remote(0)), &sge).unsignaled(),
                SendWr::new(ids[2], WrOp::Write(r.mr_a.remote(0)), &sge),
            ];
            // Credits run out while the poller lags: retry, never overflow.
            while let Err(e) = r.a.post_send(&wrs) {
                assert!(matches!(e, cqd_sim::PostError::Credits(_)), "{e}");
                std::thread::yield_now();
            }
        }
        assert!(
            wait_until(Duration::from_secs(5), || r.log.0.lock().len() == 50),
            "{}",
            mode.name()
        );
        assert!(wait_until(Duration::from_secs(5), || r
            .cq
            .budget_snapshot()
            .credits_in_use
            == 0));
        assert_eq!(
            ledger.outstanding(r.a.qpn(), Side::Send),
            0,
            "the poller retired every entry"
        );
        let report = thread.stop().unwrap();
        let budget = report.cqs[0]
            .budget
            .clone()
            .expect("budget in the snapshot");
        assert_eq!(budget.overflows, 0);
        assert!(budget.credits_high_water <= 8);
        assert!(report.accounts.is_balanced(), "{}", report.accounts);
    }
}

#[test]
fn stop_with_flush_accounts_for_every_request() {
    for mode in PollMode::all() {
        let (mut r, ledger) = rig(256, CqConfig::default());
        let poller = r.take_poller();
        let thread = PollerBuilder::new(mode.name(), NoSink)
            .mode(mode)
            .cq(poller)
            .spawn()
            .unwrap();
        let sge = [r.mr_a.sge(0, 64)];
        // Receives nobody sends to: outstanding until flushed.
        for t in 0..5 {
            let id = r.reg.wr_id(OpKind::Recv, t).unwrap();
            r.reg.track(OpKind::Recv, 1);
            ledger.posted(r.a.qpn(), Side::Recv, &[id], Instant::now());
            r.a.post_recv(&[RecvWr::new(id, &sge)]).unwrap();
        }
        // And work that completes.
        for t in 5..9 {
            let id = r.reg.wr_id(OpKind::Write, t).unwrap();
            r.reg.track(OpKind::Write, 1);
            r.a.post_send(&[SendWr::new(id, WrOp::Write(r.mr_a.remote(0)), &sge)])
                .unwrap();
        }
        assert!(wait_until(Duration::from_secs(5), || r.log.0.lock().len() == 4));
        let report = thread.stop_with(|| r.a.force_error()).unwrap();
        let acc = &report.accounts;
        assert!(acc.is_balanced(), "{}: {acc}", mode.name());
        let recv = acc
            .accounts
            .iter()
            .find(|k| k.kind == OpKind::Recv)
            .unwrap();
        assert_eq!((recv.posted, recv.completed, recv.flushed), (5, 0, 5));
        let write = acc
            .accounts
            .iter()
            .find(|k| k.kind == OpKind::Write)
            .unwrap();
        assert_eq!((write.posted, write.completed, write.flushed), (4, 4, 0));
        assert!(acc.stuck.is_empty());
        assert!(!acc.timed_out);
    }
}

#[test]
fn a_stop_that_times_out_names_what_is_missing() {
    let (mut r, ledger) = rig(256, CqConfig::default());
    let sge = [r.mr_a.sge(0, 8)];
    let ids: Vec<u64> = (0..3)
        .map(|t| r.reg.wr_id(OpKind::Recv, t).unwrap())
        .collect();
    r.reg.track(OpKind::Recv, 3);
    ledger.posted(r.a.qpn(), Side::Recv, &ids, Instant::now());
    for id in &ids {
        r.a.post_recv(&[RecvWr::new(*id, &sge)]).unwrap();
    }
    let thread = PollerBuilder::new("t", NoSink)
        .mode(PollMode::Event)
        .drain_timeout(Duration::from_millis(50))
        .watchdog(Duration::from_millis(1))
        .wake_timeout(Duration::from_millis(10))
        .cq(r.take_poller())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(40));
    let report = thread.stop().unwrap();
    let acc = &report.accounts;
    assert!(acc.timed_out);
    assert!(!acc.is_balanced());
    let missing: Vec<_> = acc.missing().collect();
    assert_eq!(missing.len(), 1);
    assert_eq!((missing[0].kind, missing[0].missing()), (OpKind::Recv, 3));
    let stuck: Vec<u64> = acc.stuck.iter().map(|s| s.wr_id).collect();
    assert_eq!(stuck, ids, "the report names each stuck request");
    let text = acc.to_string();
    assert!(text.contains("missing 3"), "{text}");
    assert!(
        ledger.snapshot(Instant::now()).stuck >= 3,
        "the watchdog reported them while running"
    );
}

#[test]
fn shutdown_in_one_call_flushes_accounts_and_reports() {
    let (mut r, _ledger) = rig(256, CqConfig::default());
    let sge = [r.mr_a.sge(0, 64)];
    for t in 0..7 {
        r.recv(&r.a, t, &sge).unwrap();
    }
    let thread = PollerBuilder::new("s", NoSink)
        .cq(r.take_poller())
        .spawn()
        .unwrap();
    let a = &r.a;
    let report = cqd_core::shutdown(|| a.force_error(), [thread], []);
    assert!(report.is_clean(), "{:?}", report.errors);
    let recv = &report.pollers[0].accounts.accounts[0];
    assert_eq!((recv.kind, recv.posted, recv.flushed), (OpKind::Recv, 7, 7));
    assert_eq!(r.log.0.lock().len(), 7, "every flush reached the handler");

    // Without the flush, the same stop names what is missing.
    let (mut r, _ledger) = rig(256, CqConfig::default());
    r.recv(&r.a, 0, &[r.mr_a.sge(0, 64)]).unwrap();
    let thread = PollerBuilder::new("s", NoSink)
        .drain_timeout(Duration::from_millis(20))
        .cq(r.take_poller())
        .spawn()
        .unwrap();
    let report = cqd_core::shutdown(|| {}, [thread], []);
    assert!(!report.is_clean());
    assert!(
        report.errors[0].contains("missing 1"),
        "{:?}",
        report.errors
    );
}
