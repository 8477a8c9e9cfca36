//! The CQ budget on the simulated NIC: admission on QP creation (an SRQ
//! counts once), overflow made loud when admission is off, credits, sizing.

mod common;

use std::collections::VecDeque;

use common::{Log, Recorder};
use cqd_core::budget::{cq_depth_for, BudgetError, BudgetOptions, CreditReturn};
use cqd_core::{split, CqOptions, NoWork, OpKind};
use cqd_sim::{
    connect, Access, CqConfig, Device, PostError, QpCap, QpInit, RecvWr, SendWr, VerbsError, WrOp,
};

fn cap(send: u32, recv: u32) -> QpCap {
    QpCap {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: 2,
        max_recv_sge: 2,
    }
}

#[test]
fn admission_refuses_oversubscription_naming_needed_and_available() {
    let dev = Device::open("sim0");
    let (cq, _src) = dev.create_cq("cq", 100, CqConfig::default()).unwrap();
    let pd = dev.alloc_pd();
    let _a = pd.create_qp(&QpInit::new(&cq, &cq, cap(40, 40))).unwrap();
    let err = pd
        .create_qp(&QpInit::new(&cq, &cq, cap(10, 40)))
        .unwrap_err();
    let VerbsError::Budget(BudgetError::Oversubscribed {
        needed,
        available,
        capacity,
        ..
    }) = &err
    else {
        panic!("unexpected {err:?}");
    };
    assert_eq!((*needed, *available, *capacity), (40, 10, 100));
    let text = err.to_string();
    assert!(
        text.contains("needs 40") && text.contains("only 10 of 100"),
        "{text}"
    );
    assert_eq!(
        cq.budget_snapshot().reserved,
        80,
        "a refused QP reserves nothing"
    );
    drop(_a);
    assert_eq!(
        cq.budget_snapshot().reserved,
        0,
        "destroying a drained QP releases its reservation"
    );
    let _b = pd.create_qp(&QpInit::new(&cq, &cq, cap(50, 50))).unwrap();
    assert_eq!(cq.budget_snapshot().refused, 1);
}

#[test]
fn separate_send_and_receive_cqs_each_reserve_their_queue() {
    let dev = Device::open("sim0");
    let (scq, _s) = dev.create_cq("send", 64, CqConfig::default()).unwrap();
    let (rcq, _r) = dev.create_cq("recv", 64, CqConfig::default()).unwrap();
    let pd = dev.alloc_pd();
    let _q = pd.create_qp(&QpInit::new(&scq, &rcq, cap(64, 64))).unwrap();
    assert_eq!(
        (
            scq.budget_snapshot().reserved,
            rcq.budget_snapshot().reserved
        ),
        (64, 64)
    );
}

#[test]
fn an_srq_counts_once_per_cq() {
    let dev = Device::open("sim0");
    let (cq, _src) = dev.create_cq("cq", 200, CqConfig::default()).unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(100, 1).unwrap();
    let qps: Vec<_> = (0..6)
        .map(|_| {
            pd.create_qp(&QpInit::new(&cq, &cq, cap(16, 0)).with_srq(&srq))
                .unwrap()
        })
        .collect();
    assert_eq!(cq.budget_snapshot().reserved, 100 + 6 * 16);
    assert!(
        pd.create_qp(&QpInit::new(&cq, &cq, cap(16, 0)).with_srq(&srq))
            .is_err(),
        "4 entries left"
    );
    assert_eq!(srq.users(), 6);
    drop(qps);
    assert_eq!(cq.budget_snapshot().reserved, 0);
}

#[test]
fn with_admission_a_queue_cannot_overflow_its_cq() {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("cq", 24, CqConfig::default()).unwrap();
    let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let mut poller = poller.bind();
    let pd = dev.alloc_pd();
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap(8, 8))).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap(4, 4))).unwrap();
    assert!(pd.create_qp(&QpInit::new(&cq, &cq, cap(1, 1))).is_err());
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(64, Access::ALL).unwrap();
    let sge = [mr.sge(0, 8)];
    let mut out = VecDeque::new();
    let mut posted = 0u64;
    // Post as fast as the queues allow, polling only now and then.
    for round in 0..200u32 {
        let id = reg.wr_id(OpKind::Write, round).unwrap();
        reg.track(OpKind::Write, 1);
        let wr = SendWr::new(id, WrOp::Write(mr.remote(8)), &sge);
        let wr = if round % 3 == 0 { wr } else { wr.unsignaled() };
        match a.post_send(&[wr]) {
            Ok(()) => posted += 1,
            Err(PostError::QueueFull { depth: 8, .. }) => {
                reg.untrack(OpKind::Write, 1);
                poller.poll_once(&mut out).unwrap();
            }
            Err(e) => panic!("{e}"),
        }
        a.force_error_if(round == 150);
    }
    while poller.poll_once(&mut out).unwrap() > 0 {}
    assert!(posted > 100);
    assert_eq!(poller.check_async(), 0);
    assert_eq!(handle.snapshot().overflows, 0);
    assert_eq!(cq.budget_snapshot().overflows, 0);
    assert_eq!(cq.producer().stats().lost, 0);
}

trait ForceIf {
    fn force_error_if(&self, c: bool);
}
impl ForceIf for cqd_sim::Qp {
    fn force_error_if(&self, c: bool) {
        if c {
            self.force_error();
        }
    }
}

#[test]
fn with_admission_off_a_too_small_cq_overflows_and_one_poll_reports_it() {
    let dev = Device::open("sim0");
    let config = CqConfig {
        budget: BudgetOptions {
            admission: false,
            credits: None,
        },
        ..CqConfig::default()
    };
    let (cq, src) = dev.create_cq("tiny", 4, config).unwrap();
    let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
    let reg = handle.register(Recorder(Log::default())).unwrap();
    let pd = dev.alloc_pd();
    let mut poller = poller.bind();
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap(16, 16))).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap(16, 16))).unwrap();
    assert_eq!(
        cq.budget_snapshot().reserved,
        64,
        "oversubscribed 16x, as asked"
    );
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(64, Access::ALL).unwrap();
    let sge = [mr.sge(0, 8)];
    for t in 0..8 {
        reg.track(OpKind::Write, 1);
        a.post_send(&[SendWr::new(
            reg.wr_id(OpKind::Write, t).unwrap(),
            WrOp::Write(mr.remote(0)),
            &sge,
        )])
        .unwrap();
    }
    let mut out = VecDeque::new();
    assert_eq!(poller.poll_once(&mut out).unwrap(), 4);
    assert!(poller.check_async() > 0);
    let snap = handle.snapshot();
    assert!(snap.overflows >= 1, "{snap:?}");
    let b = cq.budget_snapshot();
    assert_eq!(
        (b.overflows, b.lost),
        (1, 4),
        "one overflow, every lost entry counted"
    );
    assert_eq!(dev.fabric().stats().lost, 4);
}

#[test]
fn credits_refuse_posts_that_could_overflow_and_come_back_with_completions() {
    let dev = Device::open("sim0");
    let config = CqConfig {
        budget: BudgetOptions {
            admission: false,
            credits: Some(4),
        },
        ..CqConfig::default()
    };
    let (cq, src) = dev.create_cq("cq", 4, config).unwrap();
    let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
    let log = Log::default();
    let mut poller = poller.bind();
    let reg = handle
        .register(CreditReturn::new(
            cq.budget().clone(),
            Recorder(log.clone()),
        ))
        .unwrap();
    let pd = dev.alloc_pd();
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap(32, 32))).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap(32, 32))).unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(64, Access::ALL).unwrap();
    let sge = [mr.sge(0, 8)];
    let w = |t: u32| {
        SendWr::new(
            reg.wr_id(OpKind::Write, t).unwrap(),
            WrOp::Write(mr.remote(0)),
            &sge,
        )
    };
    a.post_send(&[w(0).unsignaled(), w(1).unsignaled(), w(2)])
        .unwrap();
    b.post_recv(&[RecvWr::new(reg.wr_id(OpKind::Recv, 3).unwrap(), &sge)])
        .unwrap();
    let err = a.post_send(&[w(4)]).unwrap_err();
    assert!(
        matches!(
            err,
            PostError::Credits(BudgetError::WouldOverflow {
                needed: 1,
                available: 0,
                limit: 4,
                ..
            })
        ),
        "{err}"
    );
    let s = cq.budget_snapshot();
    assert_eq!(
        (s.credits_in_use, s.credits_high_water, s.would_overflow),
        (4, 4, 1)
    );
    let mut out = VecDeque::new();
    poller.poll_once(&mut out).unwrap();
    assert_eq!(
        cq.budget_snapshot().credits_in_use,
        1,
        "the signaled write returned the two unsignaled credits too"
    );
    a.post_send(&[w(5), w(6), w(7)]).unwrap();
    a.force_error();
    b.force_error();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    assert_eq!(
        cq.budget_snapshot().credits_in_use,
        0,
        "flushes return credits"
    );
    assert_eq!(cq.budget_snapshot().overflows, 0);
    drop(log);
}

#[test]
fn sizing_helper_uses_the_device_limit() {
    let dev = Device::open("sim0");
    let max = dev.attr().max_cqe;
    let depth = cq_depth_for(&[256, 256, 1024], 2, max).unwrap();
    assert_eq!(depth, 3072);
    let (cq, _src) = dev.create_cq("sized", depth, CqConfig::default()).unwrap();
    let pd = dev.alloc_pd();
    for _ in 0..3 {
        let _ = pd.create_qp(&QpInit::new(&cq, &cq, cap(256, 256))).unwrap();
    }
    assert_eq!(cq_depth_for(&[max, 1], 2, max), Err(u64::from(max) + 1));
    assert!(matches!(
        dev.create_cq("big", max + 1, CqConfig::default()),
        Err(VerbsError::LimitExceeded {
            what: "max_cqe",
            ..
        })
    ));
}
