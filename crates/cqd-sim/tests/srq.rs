//! Shared receive queues: many QPs draw on one pool of receives.

mod common;

use std::collections::VecDeque;

use common::{Log, Recorder};
use cqd_core::{split, CqOptions, NoWork, OpKind, Side, Status};
use cqd_sim::{connect, Access, CqConfig, Device, PostError, QpCap, QpInit, RecvWr, SendWr, WrOp};

#[test]
fn many_qps_share_one_srq_and_completions_name_the_qp() {
    let dev = Device::open("sim0");
    let (cq, poller, handle) = dev
        .create_dispatched_cq::<NoWork>("server", 1024, CqConfig::default(), CqOptions::default())
        .unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 1024, CqConfig::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let mut poller = poller.bind();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(64, 1).unwrap();
    let cap = QpCap {
        max_send_wr: 16,
        max_recv_wr: 0,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let mut pairs = Vec::new();
    for _ in 0..4 {
        let server = pd
            .create_qp(&QpInit::new(&cq, &cq, cap).with_srq(&srq))
            .unwrap();
        let client = pd
            .create_qp(&QpInit::new(&ccq, &ccq, QpCap::default()))
            .unwrap();
        connect(&server, &client).unwrap();
        pairs.push((server, client));
    }
    let bufs = pd.reg_mr(64 * 64, Access::LOCAL_WRITE).unwrap();
    let wrs: Vec<_> = (0..8u32)
        .map(|i| [bufs.sge(u64::from(i) * 64, 64)])
        .collect();
    let mut recvs: Vec<_> = (0..8u32)
        .map(|i| RecvWr::new(u64::from(i), &wrs[i as usize]))
        .collect();
    reg.post_recv(&srq, &mut recvs).unwrap();
    assert_eq!(srq.available(), 8);
    // Each client sends one message; each lands in the next SRQ receive.
    let msg = pd.reg_mr(8, Access::LOCAL_WRITE).unwrap();
    let sge = [msg.sge(0, 8)];
    for (i, (_, client)) in pairs.iter().enumerate() {
        msg.write(0, &(i as u64).to_ne_bytes()).unwrap();
        client
            .post_send_unaccounted(&[SendWr::new(i as u64, WrOp::Send, &sge).unsignaled()])
            .unwrap();
    }
    let mut out = VecDeque::new();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    let evs = log.take();
    assert_eq!(evs.len(), 4);
    for (i, e) in evs.iter().enumerate() {
        assert_eq!(
            (e.side, e.tag, e.qp, e.byte_len),
            (Side::Recv, i as u32, pairs[i].0.qpn(), 8)
        );
        assert_eq!(bufs.read_u64(i as u64 * 64).unwrap(), i as u64);
    }
    assert_eq!(srq.available(), 4);
    // A server QP in error flushes its own queues, not the SRQ.
    pairs[0].0.force_error();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    assert!(log.take().is_empty());
    assert_eq!(srq.available(), 4);
    // The others still receive.
    pairs[1]
        .1
        .post_send_unaccounted(&[SendWr::new(9, WrOp::Send, &sge)])
        .unwrap();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    let evs = log.take();
    assert_eq!(
        (evs[0].tag, evs[0].qp, evs[0].status),
        (4, pairs[1].0.qpn(), Status::Success)
    );
    // Each QP's receive completions retired the SRQ's own account: 5
    // consumed, 3 outstanding, whichever QP consumed them.
    let account = cq.ledger().lookup(pairs[3].0.qpn(), Side::Recv).unwrap();
    assert_eq!(account.outstanding(), 3);
    assert_eq!(reg.ledger().outstanding(), 3);
    // A QP with an SRQ refuses receives of its own, and the refused post
    // leaves every account as it was.
    let mut one = [RecvWr::new(1, &wrs[0])];
    assert!(matches!(
        reg.post_recv(&pairs[2].0, &mut one),
        Err(PostError::HasSrq { .. })
    ));
    assert_eq!(one[0].wr_id, 1, "the tag is back in the wr_id field");
    assert_eq!((account.outstanding(), reg.ledger().outstanding()), (3, 3));
}

#[test]
fn srq_slots_are_freed_when_their_completions_are_polled() {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("cq", 64, CqConfig::default()).unwrap();
    let (poller, handle) = split::<NoWork>(src, CqOptions::default()).unwrap();
    let reg = handle.register(Recorder(Log::default())).unwrap();
    let pd = dev.alloc_pd();
    let mut poller = poller.bind();
    let srq = pd.create_srq(2, 1).unwrap();
    let cap = QpCap {
        max_send_wr: 8,
        max_recv_wr: 0,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let server = pd
        .create_qp(&QpInit::new(&cq, &cq, cap).with_srq(&srq))
        .unwrap();
    let client = pd
        .create_qp(&QpInit::new(
            &cq,
            &cq,
            QpCap {
                max_send_wr: 8,
                max_recv_wr: 8,
                ..cap
            },
        ))
        .unwrap();
    connect(&server, &client).unwrap();
    let mr = pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = [mr.sge(0, 8)];
    let r = |t| RecvWr::new(reg.wr_id(OpKind::Recv, t).unwrap(), &sge);
    srq.post_recv_unaccounted(&[r(0), r(1)]).unwrap();
    assert!(matches!(
        srq.post_recv_unaccounted(&[r(2)]),
        Err(PostError::QueueFull {
            queue: "srq",
            depth: 2,
            outstanding: 2,
            ..
        })
    ));
    client
        .post_send_unaccounted(&[SendWr::new(
            reg.wr_id(OpKind::Send, 0).unwrap(),
            WrOp::Send,
            &sge,
        )])
        .unwrap();
    assert!(
        matches!(
            srq.post_recv_unaccounted(&[r(2)]),
            Err(PostError::QueueFull { outstanding: 2, .. })
        ),
        "consumed but not polled"
    );
    let mut out = VecDeque::new();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    srq.post_recv_unaccounted(&[r(2)]).unwrap();
    assert_eq!(srq.available(), 2);
}
