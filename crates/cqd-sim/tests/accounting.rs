//! The one accounting mechanism, end to end on the simulated NIC: the
//! posting call keeps the handler ledger, the queue account and the credits;
//! the poller retires them, unsignaled sends included; a refused post leaves
//! every account as it was; concurrent posters and the poller agree.

mod common;

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{sges, Log, Recorder, Rig};
use cqd_core::budget::BudgetOptions;
use cqd_core::post::{PostSend, Refused};
use cqd_core::{NoSink, OpKind, PollMode, PollerBuilder, Side, Status};
use cqd_sim::{
    connect, connect_with, Access, CqConfig, Fabric, Modify, PostError, Qp, QpCap, QpInit, RecvWr,
    SendWr, WrOp,
};

fn credits(n: u32) -> CqConfig {
    CqConfig {
        budget: BudgetOptions {
            admission: false,
            credits: Some(n),
        },
        ..CqConfig::default()
    }
}

/// What a refused post must leave untouched.
fn state(r: &Rig) -> (Vec<u64>, usize, usize, u64) {
    let posted = OpKind::ALL
        .iter()
        .map(|k| r.reg.ledger().posted(*k))
        .collect();
    let send = r.cq.ledger().outstanding(r.a.qpn(), Side::Send);
    let recv = r.cq.ledger().outstanding(r.a.qpn(), Side::Recv);
    (posted, send, recv, r.cq.budget_snapshot().credits_in_use)
}

#[test]
fn a_signaled_send_retires_the_unsignaled_sends_before_it_in_every_ledger() {
    let mut r = Rig::with(Fabric::inline(), QpCap::default(), 256, credits(64));
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    let w = |t| SendWr::new(t, WrOp::Write(remote), s);
    // Handler X posts three unsignaled writes and is unregistered: it must
    // stay until they are accounted.
    let x = r.handle.register(Recorder(Log::default())).unwrap();
    x.post_send(
        &r.a,
        &mut [w(0).unsignaled(), w(1).unsignaled(), w(2).unsignaled()],
    )
    .unwrap();
    r.handle.unregister(x.key()).unwrap();
    assert_eq!(r.poll_all(), 0, "unsignaled successes have no completion");
    assert_eq!(x.ledger().outstanding(), 3);
    assert_eq!(
        r.handle.snapshot().handlers_live,
        2,
        "X is retiring, not gone"
    );
    // The rig's handler posts two unsignaled writes and a signaled one on
    // the same send queue.
    r.reg
        .post_send(&r.a, &mut [w(10).unsignaled(), w(11).unsignaled(), w(12)])
        .unwrap();
    assert_eq!(r.cq.budget_snapshot().credits_in_use, 6);
    assert_eq!(r.poll_all(), 1);
    // Every ledger applied the in-order rule.
    assert_eq!(r.reg.ledger().outstanding(), 0);
    assert_eq!(r.reg.ledger().completed(OpKind::Write), 3);
    assert_eq!(x.ledger().completed(OpKind::Write), 3);
    assert_eq!(x.ledger().outstanding(), 0);
    assert_eq!(r.cq.ledger().outstanding(r.a.qpn(), Side::Send), 0);
    assert_eq!(r.cq.budget_snapshot().credits_in_use, 0);
    let snap = r.handle.snapshot();
    assert_eq!(
        (snap.handlers_live, snap.unregistrations),
        (1, 1),
        "X retired once its unsignaled writes were accounted"
    );
    // And the rig's handler, unregistered now, retires at once.
    r.handle.unregister(r.reg.key()).unwrap();
    r.poll_all();
    assert_eq!(r.handle.snapshot().handlers_live, 0);
}

#[test]
fn a_stop_after_unsignaled_sends_is_clean_without_waiting_out_the_drain() {
    let mut r = Rig::new();
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    let w = |t| SendWr::new(t, WrOp::Write(remote), s);
    let thread = PollerBuilder::new("p", NoSink)
        .mode(PollMode::Event)
        .drain_timeout(Duration::from_secs(30))
        .cq(r.take_poller())
        .spawn()
        .unwrap();
    for round in 0..20 {
        let t = round * 4;
        let mut list = [
            w(t).unsignaled(),
            w(t + 1).unsignaled(),
            w(t + 2).unsignaled(),
            w(t + 3),
        ];
        // The queue frees its slots as the poller polls.
        while let Err(e) = r.reg.post_send(&r.a, &mut list) {
            assert!(matches!(e, PostError::QueueFull { .. }), "{e}");
            std::thread::yield_now();
        }
    }
    let start = Instant::now();
    let report = cqd_core::shutdown(|| {}, [thread], []);
    assert!(report.is_clean(), "{:?}", report.errors);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "the stop waited {:?}",
        start.elapsed()
    );
    let write = &report.pollers[0].accounts.accounts[0];
    assert_eq!(
        (write.kind, write.posted, write.completed, write.flushed),
        (OpKind::Write, 80, 80, 0)
    );
}

#[test]
fn a_qp_in_error_flushes_each_unsignaled_send_exactly_once() {
    // rnr_retry 7 and no receive on the peer: the SENDs wait in the queue.
    let fabric = Fabric::inline();
    let dev = fabric.open_device("sim0", Default::default());
    let (cq, poller, handle) = dev
        .create_dispatched_cq::<cqd_core::NoWork>("cq", 256, credits(64), Default::default())
        .unwrap();
    let mut poller = poller.bind();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let pd = dev.alloc_pd();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect_with(&a, &b, 7).unwrap();
    let mr = pd.reg_mr(64, Access::ALL).unwrap();
    let sge = [mr.sge(0, 8)];
    let mut wrs: Vec<_> = (0..4)
        .map(|t| SendWr::new(t, WrOp::Send, &sge).unsignaled())
        .collect();
    reg.post_send(&a, &mut wrs).unwrap();
    let mut out = VecDeque::new();
    assert_eq!(poller.poll_once(&mut out).unwrap(), 0);
    assert_eq!(reg.ledger().outstanding(), 4, "nothing hidden: 4 in flight");
    a.force_error();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    let evs = log.take();
    let mut tags: Vec<u32> = evs.iter().map(|e| e.tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, [0, 1, 2, 3], "each flushed once");
    assert!(evs.iter().all(|e| e.status == Status::WrFlush));
    let l = reg.ledger();
    assert_eq!(
        (
            l.posted(OpKind::Send),
            l.completed(OpKind::Send),
            l.flushed(OpKind::Send)
        ),
        (4, 4, 4)
    );
    assert_eq!(cq.ledger().outstanding(a.qpn(), Side::Send), 0);
    assert_eq!(cq.budget_snapshot().credits_in_use, 0);
    let report = poller.accounts();
    assert!(report.is_balanced(), "{report}");
    drop(b);
}

#[test]
fn completed_means_every_completion_and_flushed_is_a_subset_everywhere() {
    let mut r = Rig::new();
    let sge = [r.mr_b.sge(0, 64)];
    for t in 0..5 {
        r.recv(&r.b, t, &sge).unwrap();
    }
    let s = sges(&[r.mr_a.sge(0, 8)]);
    for t in 10..12 {
        r.send(&r.a, OpKind::Send, t, |id| SendWr::new(id, WrOp::Send, s))
            .unwrap();
    }
    r.poll_all();
    // Mid-way: two receives and two sends succeeded, three receives wait.
    let report = r.poller().accounts();
    assert!(!report.is_balanced());
    let text = report.to_string();
    assert!(
        text.contains("recv: posted 5, completed 2 (0 flushed), missing 3"),
        "{text}"
    );
    r.b.force_error();
    r.poll_all();
    let l = r.reg.ledger();
    assert_eq!(
        (
            l.posted(OpKind::Recv),
            l.completed(OpKind::Recv),
            l.flushed(OpKind::Recv)
        ),
        (5, 5, 3),
        "SlotLedger: completed counts the flushes, flushed is their subset"
    );
    assert_eq!(
        (
            l.posted(OpKind::Send),
            l.completed(OpKind::Send),
            l.flushed(OpKind::Send)
        ),
        (2, 2, 0)
    );
    let report = r.poller().accounts();
    let recv = report
        .accounts
        .iter()
        .find(|a| a.kind == OpKind::Recv)
        .unwrap();
    assert_eq!(
        (recv.posted, recv.completed, recv.flushed, recv.missing()),
        (5, 5, 3, 0),
        "KindAccount: the same meaning"
    );
    assert!(report.is_balanced(), "{report}");
    assert!(
        report
            .to_string()
            .starts_with("all 7 requests completed, 3 of them flushed"),
        "{report}"
    );
}

#[test]
fn a_refused_post_leaves_every_account_as_it_was() {
    let cap = QpCap {
        max_send_wr: 8,
        max_send_sge: 1,
        ..QpCap::default()
    };
    let mut r = Rig::with(Fabric::inline(), cap, 256, credits(64));
    let one = [r.mr_a.sge(0, 8)];
    let two = [r.mr_a.sge(0, 8), r.mr_a.sge(8, 8)];
    let remote = r.mr_b.remote(0);
    let w = |t, s| SendWr::new(t, WrOp::Write(remote), s);
    r.reg
        .post_send(&r.a, &mut [w(0, &one[..]), w(1, &one[..]), w(2, &one[..])])
        .unwrap();
    r.reg.post_recv(&r.a, &mut [RecvWr::new(3, &one)]).unwrap();
    let before = state(&r);
    assert_eq!((before.1, before.2, before.3), (3, 1, 4));

    // A bad request in the middle of the list.
    let mut list = [w(4, &one[..]), w(5, &two[..]), w(6, &one[..])];
    let err = r.reg.post_send(&r.a, &mut list).unwrap_err();
    assert!(
        matches!(err, PostError::TooManySge { index: 1, .. }),
        "{err}"
    );
    assert_eq!(state(&r), before);
    assert_eq!(list.map(|x| x.wr_id), [4, 5, 6], "tags back in place");

    // A tag too large in the middle: refused before the NIC sees it.
    let mut list = [w(7, &one[..]), w(1 << 24, &one[..])];
    let err = r.reg.post_send(&r.a, &mut list).unwrap_err();
    assert!(
        matches!(err, PostError::Refused(Refused::Tag { index: 1, .. })),
        "{err}"
    );
    assert_eq!(state(&r), before);
    assert_eq!(list[0].wr_id, 7);

    // The queue full (3 of 8 slots taken, 6 asked): refused by the
    // posting call before the NIC sees it.
    let mut list = [8, 9, 10, 11, 12, 13].map(|t| w(t, &one[..]));
    let err = r.reg.post_send(&r.a, &mut list).unwrap_err();
    assert!(matches!(err, PostError::QueueFull { .. }), "{err}");
    assert_eq!(state(&r), before);

    // The wrong state: a QP reset to RESET takes no sends or receives.
    r.b.modify(Modify::Reset).unwrap();
    let err = r
        .reg
        .post_recv(&r.b, &mut [RecvWr::new(10, &one)])
        .unwrap_err();
    assert!(matches!(err, PostError::WrongState { .. }), "{err}");
    assert_eq!(state(&r), before);

    // What was posted still completes and balances.
    r.poll_all();
    r.a.force_error();
    r.poll_all();
    assert_eq!(r.reg.ledger().outstanding(), 0);
    assert_eq!(state(&r).3, 0, "every credit back");
}

/// A backend that posts only the first `k` requests of a list, as verbs
/// does up to its `bad_wr`.
struct Partial<'a> {
    qp: &'a Qp,
    k: usize,
}

impl PostSend for Partial<'_> {
    type Wr<'a> = SendWr<'a>;
    type Error = PostError;

    fn send_account(&self) -> &cqd_core::QueueAccount {
        self.qp.send_account()
    }

    fn post_send_unaccounted(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, PostError)> {
        self.qp
            .post_send_unaccounted(&wrs[..self.k])
            .map_err(|e| (0, e))?;
        Err((
            self.k,
            PostError::TooManySge {
                qpn: self.qp.qpn(),
                index: self.k,
                sges: 99,
                max: 1,
            },
        ))
    }
}

#[test]
fn a_post_that_fails_part_way_keeps_what_was_posted_and_takes_back_the_rest() {
    let mut r = Rig::with(Fabric::inline(), QpCap::default(), 256, credits(64));
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    let mut list: Vec<_> = (0..5)
        .map(|t| SendWr::new(t, WrOp::Write(remote), s).unsignaled())
        .collect();
    let partial = Partial { qp: &r.a, k: 2 };
    assert!(r.reg.post_send(&partial, &mut list).is_err());
    assert_eq!(r.reg.ledger().posted(OpKind::Write), 2);
    assert_eq!(r.cq.ledger().outstanding(r.a.qpn(), Side::Send), 2);
    assert_eq!(r.cq.budget_snapshot().credits_in_use, 2);
    assert!(
        list[..2].iter().all(|w| w.wr_id > 1 << 24),
        "posted: encoded"
    );
    assert_eq!(
        list[2..].iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        [2, 3, 4]
    );
    // The rest, posted again as it is, with a signaled one behind.
    let mut rest = list[2..].to_vec();
    rest.push(SendWr::new(5, WrOp::Write(remote), s));
    r.reg.post_send(&r.a, &mut rest).unwrap();
    assert_eq!(r.poll_all(), 1);
    assert_eq!(r.reg.ledger().completed(OpKind::Write), 6);
    assert_eq!(r.reg.ledger().outstanding(), 0);
    assert_eq!(r.cq.budget_snapshot().credits_in_use, 0);
}

#[test]
fn a_queue_on_another_cq_is_refused() {
    let r = Rig::new();
    let (other, _p, h) = r
        .dev
        .create_dispatched_cq::<cqd_core::NoWork>(
            "other",
            256,
            CqConfig::default(),
            Default::default(),
        )
        .unwrap();
    let elsewhere = h.register(Recorder(Log::default())).unwrap();
    let s = [r.mr_a.sge(0, 8)];
    let err = elsewhere
        .post_send(
            &r.a,
            &mut [SendWr::new(1, WrOp::Write(r.mr_b.remote(0)), &s)],
        )
        .unwrap_err();
    assert!(
        matches!(err, PostError::Refused(Refused::WrongCq { .. })),
        "{err}"
    );
    assert_eq!(elsewhere.ledger().posted(OpKind::Write), 0);
    drop(other);
}

/// Several threads post on one send queue and on other queues while a
/// poller thread polls; with the inline NIC most completions reach the CQ
/// before their post call returns.
#[test]
fn concurrent_posters_and_the_poller_account_every_request_exactly_once() {
    for mode in [PollMode::Busy, PollMode::Event] {
        let fabric = Fabric::inline();
        let dev = fabric.open_device("sim0", Default::default());
        let (cq, poller, handle) = dev
            .create_dispatched_cq::<cqd_core::NoWork>("cq", 1024, credits(48), Default::default())
            .unwrap();
        let pd = dev.alloc_pd();
        let cap = QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            ..QpCap::default()
        };
        let a = Arc::new(pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap());
        let b = Arc::new(pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap());
        connect(&a, &b).unwrap();
        let mr = pd.reg_mr(4096, Access::ALL).unwrap();
        let thread = PollerBuilder::new("p", NoSink)
            .mode(mode)
            .wake_timeout(Duration::from_millis(2))
            .cq(poller)
            .spawn()
            .unwrap();
        const LISTS: u64 = 400;
        // Three threads on a's send queue, one on b's, one posting receives
        // on b that a fourth stream of SENDs from a consumes.
        let jobs: Vec<(Arc<Qp>, bool)> = vec![
            (Arc::clone(&a), false),
            (Arc::clone(&a), false),
            (Arc::clone(&a), false),
            (Arc::clone(&b), false),
            (Arc::clone(&a), true),
        ];
        let logs: Vec<Log> = jobs.iter().map(|_| Log::default()).collect();
        let regs: Vec<_> = logs
            .iter()
            .map(|l| handle.register(Recorder(l.clone())).unwrap())
            .collect();
        std::thread::scope(|s| {
            for ((qp, sends), reg) in jobs.iter().zip(&regs) {
                let (sge, remote) = ([mr.sge(0, 8)], mr.remote(64));
                let (b, reg) = (&b, reg.clone());
                s.spawn(move || {
                    for i in 0..LISTS {
                        let t = i * 3;
                        let mut posted = false;
                        while !posted {
                            let r = if *sends {
                                // A receive on b, then the SEND from a.
                                reg.post_recv(&**b, &mut [RecvWr::new(t, &sge)]).map(|()| {
                                    let mut wr = [SendWr::new(t + 1, WrOp::Send, &sge)];
                                    while let Err(e) = reg.post_send(&**qp, &mut wr) {
                                        assert!(
                                            matches!(
                                                e,
                                                PostError::Credits(_) | PostError::QueueFull { .. }
                                            ),
                                            "{e}"
                                        );
                                        std::thread::yield_now();
                                    }
                                })
                            } else {
                                let w = |t| SendWr::new(t, WrOp::Write(remote), &sge);
                                reg.post_send(
                                    &**qp,
                                    &mut [w(t).unsignaled(), w(t + 1).unsignaled(), w(t + 2)],
                                )
                            };
                            match r {
                                Ok(()) => posted = true,
                                Err(PostError::Credits(_) | PostError::QueueFull { .. }) => {
                                    std::thread::yield_now()
                                }
                                Err(e) => panic!("{e}"),
                            }
                        }
                    }
                });
            }
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        while regs.iter().any(|r| r.ledger().outstanding() > 0) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        for (i, (reg, log)) in regs.iter().zip(&logs).enumerate() {
            let l = reg.ledger();
            assert_eq!(l.outstanding(), 0, "{}: handler {i}", mode.name());
            let mut tags: Vec<u32> = log.take().iter().map(|e| e.tag).collect();
            tags.sort_unstable();
            let want: Vec<u32> = if jobs[i].1 {
                assert_eq!(
                    (l.posted(OpKind::Recv), l.posted(OpKind::Send)),
                    (LISTS, LISTS)
                );
                (0..LISTS as u32).flat_map(|i| [i * 3, i * 3 + 1]).collect()
            } else {
                assert_eq!(l.completed(OpKind::Write), 3 * LISTS);
                (0..LISTS as u32).map(|i| i * 3 + 2).collect()
            };
            assert_eq!(
                tags,
                want,
                "{}: handler {i}, each signaled once",
                mode.name()
            );
        }
        assert_eq!(cq.budget_snapshot().credits_in_use, 0, "{}", mode.name());
        assert!(cq.budget_snapshot().credits_high_water <= 48);
        assert_eq!(cq.ledger().snapshot(Instant::now()).outstanding, 0);
        let report = thread.stop().unwrap();
        assert!(report.accounts.is_balanced(), "{}", report.accounts);
        assert_eq!(
            (report.cqs[0].stale_wr_ids, report.cqs[0].overflows),
            (0, 0)
        );
    }
}

#[test]
fn a_destroyed_qp_leaves_its_cq_ledger_once_its_requests_are_accounted() {
    let mut r = Rig::new();
    let pd = r.pd.clone();
    let c = pd
        .create_qp(&QpInit::new(&r.cq, &r.cq, QpCap::default()))
        .unwrap();
    let (qpn, ledger) = (c.qpn(), r.cq.ledger().clone());
    // Nothing outstanding: detached at once.
    drop(c);
    assert!(ledger.lookup(qpn, Side::Send).is_none());
    // Receives outstanding: detached when their flushes are polled.
    let d = pd
        .create_qp(&QpInit::new(&r.cq, &r.cq, QpCap::default()))
        .unwrap();
    let qpn = d.qpn();
    d.modify(Modify::Init {
        access: Access::ALL,
    })
    .unwrap();
    r.recv(&d, 1, &[r.mr_a.sge(0, 8)]).unwrap();
    drop(d);
    assert!(ledger.lookup(qpn, Side::Recv).is_some());
    r.poll_all();
    assert!(ledger.lookup(qpn, Side::Recv).is_none());
    assert_eq!(r.reg.ledger().flushed(OpKind::Recv), 1);
}

#[test]
fn a_cq_made_by_hand_gets_its_ledger_and_budget_from_split() {
    let dev = cqd_sim::Device::open("sim0");
    let (cq, source) = dev.create_cq("cq", 256, credits(64)).unwrap();
    let (poller, handle) = cqd_core::split::<cqd_core::NoWork>(source, Default::default()).unwrap();
    assert!(
        handle.budget_snapshot().is_some(),
        "the source gave split its budget"
    );
    let mut poller = poller.bind();
    let reg = handle.register(Recorder(Log::default())).unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(16, 1).unwrap();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()).with_srq(&srq))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(64, Access::ALL).unwrap();
    let sge = [mr.sge(0, 8)];
    reg.post_recv(&srq, &mut [RecvWr::new(1, &sge)]).unwrap();
    reg.post_send(&b, &mut [SendWr::new(2, WrOp::Write(mr.remote(0)), &sge)])
        .unwrap();
    reg.post_send(&b, &mut [SendWr::new(3, WrOp::Send, &sge).unsignaled()])
        .unwrap();
    reg.post_send(&b, &mut [SendWr::new(4, WrOp::Write(mr.remote(0)), &sge)])
        .unwrap();
    let mut out = VecDeque::new();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    assert_eq!(
        reg.ledger().outstanding(),
        0,
        "the unsignaled send retired too"
    );
    assert_eq!(cq.budget_snapshot().credits_in_use, 0);
    assert_eq!(cq.ledger().outstanding(a.qpn(), Side::Recv), 0);
}

/// A handler posts only to queues whose completions come to its own CQ:
/// a QP of another CQ is refused (never adopted), and an SRQ serves the
/// handlers of one CQ (its receives complete on the consuming QP's CQ, and a
/// wr_id names a handler of one CQ).
#[test]
fn queues_of_another_cq_are_refused_and_an_srq_serves_one_cq() {
    let dev = cqd_sim::Device::open("sim0");
    let (x, _px, hx) = dev
        .create_dispatched_cq::<cqd_core::NoWork>("x", 256, credits(64), Default::default())
        .unwrap();
    let (y, _py, _hy) = dev
        .create_dispatched_cq::<cqd_core::NoWork>("y", 256, credits(64), Default::default())
        .unwrap();
    let on_x = hx.register(Recorder(Log::default())).unwrap();
    let pd = dev.alloc_pd();
    let mr = pd.reg_mr(64, Access::ALL).unwrap();
    let sge = [mr.sge(0, 8)];
    let qy = pd
        .create_qp(&QpInit::new(&y, &y, QpCap::default()))
        .unwrap();
    let err = on_x
        .post_send(&qy, &mut [SendWr::new(1, WrOp::Send, &sge)])
        .unwrap_err();
    assert!(
        matches!(err, PostError::Refused(Refused::WrongCq { .. })),
        "{err}"
    );
    assert_eq!(on_x.ledger().posted(OpKind::Send), 0);
    assert_eq!(x.budget_snapshot().credits_in_use, 0);
    assert_eq!(y.budget_snapshot().credits_in_use, 0);
    // The SRQ's first QP binds it to X; a QP completing on Y is refused.
    let srq = pd.create_srq(16, 1).unwrap();
    let _qa = pd
        .create_qp(&QpInit::new(&x, &x, QpCap::default()).with_srq(&srq))
        .unwrap();
    let err = pd
        .create_qp(&QpInit::new(&y, &y, QpCap::default()).with_srq(&srq))
        .unwrap_err();
    assert!(err.to_string().contains("another CQ"), "{err}");
    on_x.post_recv(&srq, &mut [RecvWr::new(2, &sge)]).unwrap();
    // An SRQ bound by a post: Y's handlers are refused.
    let srq2 = pd.create_srq(16, 1).unwrap();
    on_x.post_recv(&srq2, &mut [RecvWr::new(3, &sge)]).unwrap();
    let on_y = _hy.register(Recorder(Log::default())).unwrap();
    let err = on_y
        .post_recv(&srq2, &mut [RecvWr::new(4, &sge)])
        .unwrap_err();
    assert!(
        matches!(err, PostError::Refused(Refused::WrongCq { .. })),
        "{err}"
    );
}

/// One operation's requests may share a tag: an unsignaled write and the
/// final signaled send of the same request carry one wr_id. The success
/// names the signaled one, so both retire.
#[test]
fn a_wr_id_posted_twice_retires_both_requests() {
    let mut r = Rig::with(Fabric::inline(), QpCap::default(), 256, credits(8));
    let s = [r.mr_a.sge(0, 8)];
    let remote = r.mr_b.remote(0);
    r.reg
        .post_send(
            &r.a,
            &mut [
                SendWr::new(5, WrOp::Write(remote), &s).unsignaled(),
                SendWr::new(5, WrOp::Write(remote), &s),
            ],
        )
        .unwrap();
    assert_eq!(r.poll_all(), 1);
    assert_eq!(r.reg.ledger().outstanding(), 0);
    assert_eq!(r.cq.ledger().outstanding(r.a.qpn(), Side::Send), 0);
    assert_eq!(r.cq.budget_snapshot().credits_in_use, 0);
}

/// A handler and a loopback QP on a CQ of their own (the unbound poller
/// must outlive them).
fn loopback_rig(
    name: &str,
) -> (
    cqd_core::UnboundCq<cqd_core::NoWork>,
    cqd_core::Registration,
    cqd_sim::Loopback,
) {
    let (producer, source) = cqd_sim::sim_cq(name, 64, Default::default()).unwrap();
    let (poller, handle) = cqd_core::split::<cqd_core::NoWork>(source, Default::default()).unwrap();
    let reg = handle.register(Recorder(Log::default())).unwrap();
    (poller, reg, cqd_sim::Loopback::new(producer, 1))
}

#[test]
fn a_request_of_the_other_side_is_refused() {
    let (_poller, reg, qp) = loopback_rig("side");
    let mut wrs = [
        cqd_sim::LoopWr::new(1, OpKind::Send),
        cqd_sim::LoopWr::new(2, OpKind::Recv),
    ];
    let err = reg.post_send(&qp, &mut wrs).unwrap_err();
    assert!(
        matches!(
            err,
            cqd_sim::LoopbackError::Refused(Refused::WrongSide { index: 1, .. })
        ),
        "{err}"
    );
    assert_eq!(wrs.map(|w| w.wr_id), [1, 2], "tags given back");
    assert_eq!(reg.ledger().posted(OpKind::Send), 0);
}

#[test]
fn cqds_own_kind_is_refused_to_handlers() {
    let (_poller, reg, qp) = loopback_rig("internal");
    let mut wrs = [
        cqd_sim::LoopWr::new(1, OpKind::Send),
        cqd_sim::LoopWr::new(2, OpKind::Internal),
    ];
    let err = reg.post_send(&qp, &mut wrs).unwrap_err();
    assert!(
        matches!(
            err,
            cqd_sim::LoopbackError::Refused(Refused::Tag {
                index: 1,
                source: cqd_core::wr_id::WrIdError::Reserved
            })
        ),
        "{err}"
    );
    assert_eq!(wrs.map(|w| w.wr_id), [1, 2], "tags given back");
    assert_eq!(reg.ledger().posted(OpKind::Send), 0);
    assert_eq!(
        reg.wr_id(OpKind::Internal, 3),
        Err(cqd_core::wr_id::WrIdError::Reserved),
        "nor can the expert path make one"
    );
}

/// A send queue that checks, inside the raw post, what the posting call
/// promises: the completion is already in the CQ (the inline NIC ran the
/// request), and the handler's ledger and the queue's account already hold
/// the request.
struct Watching<'a> {
    qp: &'a Qp,
    cq: &'a cqd_sim::Cq,
    reg: &'a cqd_core::Registration,
}

impl PostSend for Watching<'_> {
    type Wr<'a> = SendWr<'a>;
    type Error = PostError;

    fn send_account(&self) -> &cqd_core::QueueAccount {
        self.qp.send_account()
    }

    fn post_send_unaccounted(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, PostError)> {
        self.qp.post_send_unaccounted(wrs).map_err(|e| (0, e))?;
        assert_eq!(self.cq.producer().len(), 1, "completed inside the call");
        assert_eq!(self.reg.ledger().posted(OpKind::Write), 2);
        Ok(())
    }
}

#[test]
fn a_completion_that_arrives_inside_the_post_call_is_accounted() {
    let mut r = Rig::with(Fabric::inline(), QpCap::default(), 256, credits(8));
    let s = [r.mr_a.sge(0, 8)];
    let remote = r.mr_b.remote(0);
    let q = Watching {
        qp: &r.a,
        cq: &r.cq,
        reg: &r.reg,
    };
    let mut list = [
        SendWr::new(1, WrOp::Write(remote), &s).unsignaled(),
        SendWr::new(2, WrOp::Write(remote), &s),
    ];
    r.reg.post_send(&q, &mut list).unwrap();
    assert_eq!(r.cq.ledger().outstanding(r.a.qpn(), Side::Send), 2);
    assert_eq!(r.poll_all(), 1);
    assert_eq!(r.reg.ledger().completed(OpKind::Write), 2);
    assert_eq!(r.cq.ledger().outstanding(r.a.qpn(), Side::Send), 0);
    assert_eq!(r.cq.budget_snapshot().credits_in_use, 0);
}
