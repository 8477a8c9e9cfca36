//! The ledger, the watchdog and the shutdown account on the simulated NIC:
//! shutdown with outstanding work flushes and accounts for all of it, or
//! says exactly what is missing.

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::{Log, Recorder};
use cqd_core::ledger::{drain, Accounted, Watchdog, WrLedger};
use cqd_core::{split, CqOptions, CqPoller, NoWork, OpKind, Registration, Side};
use cqd_sim::{connect, Access, CqConfig, Device, Mr, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp};

struct Server {
    poller: CqPoller<NoWork>,
    reg: Registration,
    flushes: std::sync::Arc<cqd_core::FlushCounts>,
    ledger: WrLedger,
    a: Qp,
    b: Qp,
    mr: Mr,
    _dev: Device,
}

fn server() -> Server {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("cq", 256, CqConfig::default()).unwrap();
    let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
    let ledger = WrLedger::new();
    let h = Accounted::new(Some(ledger.clone()), Recorder(Log::default()));
    let flushes = h.flushes();
    let reg = handle.register(h).unwrap();
    let pd = dev.alloc_pd();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(1024, Access::ALL).unwrap();
    Server {
        poller: poller.bind(),
        reg,
        flushes,
        ledger,
        a,
        b,
        mr,
        _dev: dev,
    }
}

impl Server {
    /// Work that stays outstanding: receives on `a` nobody sends to, and
    /// sends from `a` waiting for receives `b` never posts (rnr_retry 7).
    fn post_outstanding(&self) {
        let sge = [self.mr.sge(0, 64)];
        let now = Instant::now();
        for t in 0..5 {
            let id = self.reg.wr_id(OpKind::Recv, t).unwrap();
            self.reg.track(OpKind::Recv, 1);
            self.ledger.posted(self.a.qpn(), Side::Recv, &[id], now);
            self.a.post_recv(&[RecvWr::new(id, &sge)]).unwrap();
        }
        for t in 0..3 {
            let id = self.reg.wr_id(OpKind::Send, t).unwrap();
            self.reg.track(OpKind::Send, 1);
            self.ledger.posted(self.a.qpn(), Side::Send, &[id], now);
            self.a
                .post_send(&[SendWr::new(id, WrOp::Send, &sge[..])])
                .unwrap();
        }
    }

    fn poll(&mut self) {
        let mut out = VecDeque::new();
        while self.poller.poll_once(&mut out).unwrap() > 0 {}
    }
}

#[test]
fn shutdown_with_outstanding_work_flushes_and_accounts_for_all_of_it() {
    let mut s = server();
    s.post_outstanding();
    s.poll();
    assert_eq!(s.reg.ledger().outstanding(), 8);
    // 1. stop posting (the test posts nothing more) 2. flush: QPs to error.
    s.a.force_error();
    s.b.force_error();
    // 3. poll until resolved.
    let (key, slot, flushes) = (s.reg.key(), s.reg.ledger(), &*s.flushes);
    let ledger = s.ledger.clone();
    let poller = &mut s.poller;
    let report = drain(
        &[(key, slot, Some(flushes))],
        Some(&ledger),
        Duration::from_secs(5),
        || {
            let mut out = VecDeque::new();
            while poller.poll_once(&mut out).unwrap() > 0 {}
        },
    );
    assert!(report.is_balanced(), "{report}");
    let recv = report
        .accounts
        .iter()
        .find(|a| a.kind == OpKind::Recv)
        .unwrap();
    let send = report
        .accounts
        .iter()
        .find(|a| a.kind == OpKind::Send)
        .unwrap();
    assert_eq!((recv.posted, recv.completed, recv.flushed), (5, 0, 5));
    assert_eq!((send.posted, send.completed, send.flushed), (3, 0, 3));
    assert!(report.stuck.is_empty());
    assert_eq!(s.ledger.snapshot(Instant::now()).outstanding, 0);
    assert!(
        report.to_string().contains("all 8 requests accounted for"),
        "{report}"
    );
}

#[test]
fn a_drain_that_times_out_lists_what_is_stuck() {
    let mut s = server();
    s.post_outstanding();
    let (key, slot, flushes) = (s.reg.key(), s.reg.ledger(), &*s.flushes);
    let ledger = s.ledger.clone();
    let poller = &mut s.poller;
    let report = drain(
        &[(key, slot, Some(flushes))],
        Some(&ledger),
        Duration::from_millis(30),
        || {
            let mut out = VecDeque::new();
            let _ = poller.poll_once(&mut out);
            std::thread::sleep(Duration::from_millis(1));
        },
    );
    assert!(report.timed_out && !report.is_balanced());
    let missing: Vec<_> = report.missing().map(|a| (a.kind, a.missing())).collect();
    assert_eq!(missing, vec![(OpKind::Send, 3), (OpKind::Recv, 5)]);
    assert_eq!(report.stuck.len(), 8);
    let first_send = report.stuck.iter().find(|w| w.side == Side::Send).unwrap();
    assert_eq!(first_send.qp_num, s.a.qpn());
    assert_eq!(first_send.decoded.unwrap().key, key);
    let text = report.to_string();
    assert!(
        text.contains("missing 3") && text.contains(&format!("QP {}", s.a.qpn())),
        "{text}"
    );
    s.poll();
}

#[test]
fn the_watchdog_reports_old_requests_and_the_oldest_age() {
    let s = server();
    s.post_outstanding();
    let t0 = Instant::now();
    assert!(s.ledger.scan(t0, Duration::from_secs(60)).is_empty());
    let later = t0 + Duration::from_secs(2);
    let stuck = s.ledger.scan(later, Duration::from_secs(1));
    assert_eq!(stuck.len(), 8);
    assert!(s.ledger.oldest(s.a.qpn(), Side::Send, later).unwrap() >= Duration::from_secs(2));
    assert_eq!(s.ledger.snapshot(later).stuck, 8);
    // The thread form.
    let dog = Watchdog::spawn(s.ledger.clone(), Duration::ZERO, Duration::from_millis(1)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.ledger.snapshot(Instant::now()).scans < 3 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(dog);
    assert!(s.ledger.snapshot(Instant::now()).scans >= 3);
}
