//! Every error status the model produces, routed through a real `CqPoller`
//! to `on_error` with the right side; flushes of both queues; posting errors
//! that change nothing.

mod common;

use std::time::Duration;

use common::{sges, Ev, Rig};
use cqd_core::{NoSink, OpKind, PollMode, PollerBuilder, Side, Status};
use cqd_sim::{
    connect_with, Access, CqConfig, Fabric, Modify, PostError, QpCap, QpInit, QpState, SendWr,
    VerbsError, WrOp,
};

fn errors(evs: &[Ev]) -> Vec<(Side, OpKind, u32, Status)> {
    evs.iter()
        .filter(|e| !e.ok)
        .map(|e| (e.side, e.kind, e.tag, e.status))
        .collect()
}

#[test]
fn rnr_retry_exceeded_when_no_receive_is_posted() {
    let mut r = Rig::new();
    // Reconnect with rnr_retry 0.
    for q in [&r.a, &r.b] {
        q.modify(Modify::Reset).unwrap();
    }
    connect_with(&r.a, &r.b, 0).unwrap();
    r.recv(&r.a, 50, &[r.mr_a.sge(0, 64)]).unwrap();
    let s = sges(&[r.mr_a.sge(0, 8)]);
    r.send(&r.a, OpKind::Send, 1, |id| SendWr::new(id, WrOp::Send, s))
        .unwrap();
    r.poll_all();
    assert_eq!(
        errors(&r.log.take()),
        vec![
            (Side::Send, OpKind::Send, 1, Status::RnrRetryExceeded),
            (Side::Recv, OpKind::Recv, 50, Status::WrFlush),
        ]
    );
    assert_eq!(r.a.state().unwrap(), QpState::Err);
    assert_eq!(
        r.b.state().unwrap(),
        QpState::Rts,
        "the responder is not affected by RNR"
    );
    assert_eq!(r.reg.ledger().outstanding(), 0);
}

#[test]
fn local_length_error_when_the_receive_is_too_small() {
    let mut r = Rig::new();
    r.recv(&r.b, 7, &[r.mr_b.sge(0, 4)]).unwrap();
    r.recv(&r.b, 8, &[r.mr_b.sge(0, 64)]).unwrap();
    let s = sges(&[r.mr_a.sge(0, 16)]);
    r.send(&r.a, OpKind::Send, 1, |id| SendWr::new(id, WrOp::Send, s))
        .unwrap();
    r.poll_all();
    let evs = r.log.take();
    assert_eq!(
        errors(&evs),
        vec![
            (Side::Recv, OpKind::Recv, 7, Status::LocalLength),
            (Side::Recv, OpKind::Recv, 8, Status::WrFlush),
            (Side::Send, OpKind::Send, 1, Status::RemoteInvalidRequest),
        ]
    );
    assert_eq!(evs[0].qp, r.b.qpn());
    assert_eq!(
        (r.a.state().unwrap(), r.b.state().unwrap()),
        (QpState::Err, QpState::Err)
    );
}

#[test]
fn remote_access_errors_bad_rkey_out_of_bounds_missing_permission() {
    type MakeOp = Box<dyn Fn(&Rig, &cqd_sim::Mr) -> WrOp>;
    let cases: Vec<(&str, MakeOp)> = vec![
        (
            "bad rkey",
            Box::new(|r, _| {
                WrOp::Write(cqd_sim::RemoteAddr {
                    addr: r.mr_b.addr(),
                    rkey: r.mr_b.lkey(),
                })
            }),
        ),
        (
            "out of bounds",
            Box::new(|r, _| WrOp::Write(r.mr_b.remote(common::MR_LEN - 4))),
        ),
        (
            "read-only region written",
            Box::new(|_, ro| WrOp::Write(ro.remote(0))),
        ),
        (
            "region without remote read",
            Box::new(|_, ro| WrOp::Read(ro.remote(0))),
        ),
        (
            "atomic without remote atomic",
            Box::new(|_, ro| WrOp::FetchAdd {
                remote: ro.remote(0),
                add: 1,
            }),
        ),
    ];
    for (what, op) in cases {
        let mut r = Rig::new();
        let ro =
            r.pd.reg_mr(64, Access::LOCAL_WRITE | Access::REMOTE_READ)
                .unwrap();
        let no_read = r.pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
        let target = if what == "region without remote read" {
            &no_read
        } else {
            &ro
        };
        let op = op(&r, target);
        r.recv(&r.b, 9, &[r.mr_b.sge(0, 64)]).unwrap();
        let s = sges(&[r.mr_a.sge(0, 8)]);
        let kind = match op {
            WrOp::Read(_) => OpKind::Read,
            WrOp::FetchAdd { .. } => OpKind::Atomic,
            _ => OpKind::Write,
        };
        r.send(&r.a, kind, 1, |id| SendWr::new(id, op, s)).unwrap();
        r.poll_all();
        assert_eq!(
            errors(&r.log.take()),
            vec![
                (Side::Recv, OpKind::Recv, 9, Status::WrFlush),
                (Side::Send, kind, 1, Status::RemoteAccess)
            ],
            "{what}"
        );
        assert_eq!(
            (r.a.state().unwrap(), r.b.state().unwrap()),
            (QpState::Err, QpState::Err),
            "{what}"
        );
    }
}

#[test]
fn local_protection_errors_bad_lkey_out_of_bounds_no_local_write() {
    let mut r = Rig::new();
    let ro = r.pd.reg_mr(64, Access::REMOTE_READ).unwrap();
    let bad = [
        cqd_sim::Sge {
            addr: r.mr_a.addr(),
            length: 8,
            lkey: r.mr_a.rkey(),
        },
        r.mr_a.sge(common::MR_LEN - 4, 8),
    ];
    for (i, sge) in bad.into_iter().enumerate() {
        for q in [&r.a, &r.b] {
            q.modify(Modify::Reset).unwrap();
        }
        connect_with(&r.a, &r.b, 7).unwrap();
        let s = sges(&[sge]);
        let remote = r.mr_b.remote(0);
        r.send(&r.a, OpKind::Write, i as u32, |id| {
            SendWr::new(id, WrOp::Write(remote), s)
        })
        .unwrap();
        r.poll_all();
        assert_eq!(
            errors(&r.log.take()),
            vec![(Side::Send, OpKind::Write, i as u32, Status::LocalProtection)]
        );
        assert_eq!(r.a.state().unwrap(), QpState::Err);
        assert_eq!(
            r.b.state().unwrap(),
            QpState::Rts,
            "a local error leaves the peer alone"
        );
    }
    // RDMA READ into a region without local write.
    for q in [&r.a, &r.b] {
        q.modify(Modify::Reset).unwrap();
    }
    connect_with(&r.a, &r.b, 7).unwrap();
    let s = sges(&[ro.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    r.send(&r.a, OpKind::Read, 5, |id| {
        SendWr::new(id, WrOp::Read(remote), s)
    })
    .unwrap();
    r.poll_all();
    assert_eq!(
        errors(&r.log.take()),
        vec![(Side::Send, OpKind::Read, 5, Status::LocalProtection)]
    );
}

#[test]
fn qp_to_error_flushes_both_queues_and_later_posts() {
    let mut r = Rig::new();
    for t in 0..3 {
        r.recv(&r.a, 100 + t, &[r.mr_a.sge(0, 64)]).unwrap();
    }
    let s = sges(&[r.mr_a.sge(0, 8)]);
    // b has no receive: with rnr_retry 7 these wait (in order).
    for t in 0..3 {
        r.send(&r.a, OpKind::Send, t, |id| {
            SendWr::new(id, WrOp::Send, s).unsignaled()
        })
        .unwrap();
    }
    assert_eq!(r.poll_all(), 0);
    r.a.modify(Modify::Err).unwrap();
    r.send(&r.a, OpKind::Send, 9, |id| SendWr::new(id, WrOp::Send, s))
        .unwrap();
    r.poll_all();
    let evs = r.log.take();
    assert_eq!(evs.len(), 7, "unsignaled requests flush too: {evs:?}");
    assert!(evs.iter().all(|e| !e.ok && e.status == Status::WrFlush));
    let sends: Vec<u32> = evs
        .iter()
        .filter(|e| e.side == Side::Send)
        .map(|e| e.tag)
        .collect();
    assert_eq!(
        sends,
        vec![0, 1, 2, 9],
        "in order, the post in ERR flushed at once"
    );
    assert_eq!(evs.iter().filter(|e| e.side == Side::Recv).count(), 3);
    assert_eq!(r.reg.ledger().outstanding(), 0);
    assert_eq!(r.handle.snapshot().flushes, 7);
}

#[test]
fn posting_errors_change_nothing() {
    let mut r = Rig::with(
        Fabric::inline(),
        QpCap {
            max_send_wr: 2,
            max_recv_wr: 2,
            max_send_sge: 1,
            max_recv_sge: 1,
        },
        64,
        CqConfig::default(),
    );
    let s1 = [r.mr_a.sge(0, 8)];
    let s2 = [r.mr_a.sge(0, 8), r.mr_a.sge(8, 8)];
    let remote = r.mr_b.remote(0);
    let w = |id, s| SendWr::new(id, WrOp::Write(remote), s);
    // Too many SGEs (second WR of the list): nothing of the list is posted.
    let e =
        r.a.post_send_unaccounted(&[w(1, &s1), w(2, &s2)])
            .unwrap_err();
    assert_eq!(
        e,
        PostError::TooManySge {
            qpn: r.a.qpn(),
            index: 1,
            sges: 2,
            max: 1
        }
    );
    // Beyond the depth.
    let e =
        r.a.post_send_unaccounted(&[w(1, &s1), w(2, &s1), w(3, &s1)])
            .unwrap_err();
    assert!(
        matches!(
            e,
            PostError::QueueFull {
                depth: 2,
                outstanding: 0,
                posting: 3,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(r.fabric.stats().executed, 0);
    assert_eq!(r.poll_all(), 0);
    // Wrong state: a fresh QP in RESET/INIT.
    let small = QpCap {
        max_send_wr: 2,
        max_recv_wr: 2,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let c = r.pd.create_qp(&QpInit::new(&r.cq, &r.cq, small)).unwrap();
    let e = c.post_send_unaccounted(&[w(1, &s1)]).unwrap_err();
    assert!(matches!(
        e,
        PostError::WrongState {
            state: QpState::Reset,
            ..
        }
    ));
    assert!(matches!(
        c.post_recv_unaccounted(&[cqd_sim::RecvWr::new(1, &s1)]),
        Err(PostError::WrongState { .. })
    ));
    c.modify(Modify::Init {
        access: Access::default(),
    })
    .unwrap();
    assert!(matches!(
        c.post_send_unaccounted(&[w(1, &s1)]),
        Err(PostError::WrongState {
            state: QpState::Init,
            ..
        })
    ));
    c.post_recv_unaccounted(&[cqd_sim::RecvWr::new(1, &s1)])
        .unwrap();
    // The queue is intact: two signaled writes fit, a third does not until polled.
    r.a.post_send_unaccounted(&[w(1, &s1), w(2, &s1)]).unwrap();
    assert!(matches!(
        r.a.post_send_unaccounted(&[w(3, &s1)]),
        Err(PostError::QueueFull { outstanding: 2, .. })
    ));
    assert_eq!(r.cq.producer().len(), 2);
    let mut out = std::collections::VecDeque::new();
    r.poller().poll_once(&mut out).unwrap();
    r.a.post_send_unaccounted(&[w(3, &s1)]).unwrap();
    drop(c);
}

#[test]
fn bad_transitions_and_attributes_are_refused() {
    let r = Rig::new();
    let c =
        r.pd.create_qp(&QpInit::new(&r.cq, &r.cq, QpCap::default()))
            .unwrap();
    assert!(matches!(
        c.modify(Modify::Rtr {
            remote_qpn: r.a.qpn()
        }),
        Err(VerbsError::BadTransition {
            from: QpState::Reset,
            to: QpState::Rtr,
            ..
        })
    ));
    c.modify(Modify::Init {
        access: Access::ALL,
    })
    .unwrap();
    assert!(matches!(
        c.modify(Modify::Rtr { remote_qpn: 9999 }),
        Err(VerbsError::NoSuchQp { qpn: 9999 })
    ));
    c.modify(Modify::Rtr {
        remote_qpn: r.a.qpn(),
    })
    .unwrap();
    assert!(matches!(
        c.modify(Modify::Rts {
            rnr_retry: 8,
            retry_cnt: 7
        }),
        Err(VerbsError::BadAttr {
            what: "rnr_retry",
            ..
        })
    ));
    assert_eq!(
        c.state().unwrap(),
        QpState::Rtr,
        "a refused modify changes nothing"
    );
}

/// The error statuses through a real poller thread, in every poll mode.
#[test]
fn errors_reach_on_error_in_every_poll_mode() {
    for mode in PollMode::all() {
        let mut r = Rig::new();
        let poller = r.take_poller();
        let common::Rig {
            a,
            b,
            mr_a,
            mr_b,
            reg,
            log,
            fabric,
            ..
        } = r;
        let t = PollerBuilder::new("p", NoSink)
            .mode(mode)
            .cq(poller)
            .spawn()
            .unwrap();
        reg.post_recv(&b, &mut [cqd_sim::RecvWr::new(1, &[mr_b.sge(0, 2)])])
            .unwrap();
        reg.post_send(&a, &mut [SendWr::new(2, WrOp::Send, &[mr_a.sge(0, 8)])])
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while reg.ledger().outstanding() > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let report = t.stop().unwrap();
        let evs = log.take();
        assert_eq!(
            errors(&evs),
            vec![
                (Side::Recv, OpKind::Recv, 1, Status::LocalLength),
                (Side::Send, OpKind::Send, 2, Status::RemoteInvalidRequest)
            ],
            "mode {}",
            mode.name()
        );
        assert_eq!(report.cqs[0].overflows, 0);
        drop((a, b, fabric));
    }
}

#[test]
fn a_vanished_device_fails_its_polls_posts_and_peers() {
    use cqd_core::{AsyncEvent, CompletionSource, SourceError};
    let fabric = Fabric::inline();
    let gone = fabric.open_device("gone", Default::default());
    let peer_dev = fabric.open_device("peer", Default::default());
    let (gcq, mut gsrc) = gone.create_cq("g", 256, CqConfig::default()).unwrap();
    let (pcq, psrc) = peer_dev.create_cq("p", 256, CqConfig::default()).unwrap();
    let (ppoller, phandle) = cqd_core::split::<cqd_core::NoWork>(psrc, Default::default()).unwrap();
    let mut ppoller = ppoller.bind();
    let log = common::Log::default();
    let reg = phandle.register(common::Recorder(log.clone())).unwrap();
    let (gpd, ppd) = (gone.alloc_pd(), peer_dev.alloc_pd());
    let g = gpd
        .create_qp(&QpInit::new(&gcq, &gcq, QpCap::default()))
        .unwrap();
    let p = ppd
        .create_qp(&QpInit::new(&pcq, &pcq, QpCap::default()))
        .unwrap();
    cqd_sim::connect(&g, &p).unwrap();
    let mr = ppd.reg_mr(64, Access::ALL).unwrap();
    gone.vanish();
    assert!(gone.is_gone());
    assert_eq!(g.state().unwrap(), QpState::Err);
    let sge = [mr.sge(0, 8)];
    assert!(matches!(
        g.post_recv_unaccounted(&[cqd_sim::RecvWr::new(1, &sge)]),
        Err(PostError::DeviceGone { .. })
    ));
    assert!(matches!(
        gpd.reg_mr(8, Access::ALL),
        Err(VerbsError::DeviceGone { .. })
    ));
    let mut buf = [cqd_core::Completion::default(); 4];
    assert!(matches!(
        gsrc.poll(&mut buf),
        Err(SourceError::DeviceGone(_))
    ));
    assert_eq!(gsrc.take_async_event(), Some(AsyncEvent::DeviceFatal));
    // The peer's request to the vanished QP fails with a transport error.
    reg.post_send(&p, &mut [SendWr::new(5, WrOp::Send, &sge)])
        .unwrap();
    let mut out = std::collections::VecDeque::new();
    ppoller.poll_once(&mut out).unwrap();
    assert_eq!(
        errors(&log.take()),
        vec![(Side::Send, OpKind::Send, 5, Status::RetryExceeded)]
    );
}
