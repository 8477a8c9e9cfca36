//! The UD rules of the simulated NIC at the device level (raw posts, the
//! CQ polled directly): what a datagram delivers, when it is dropped, what
//! the transport refuses, and the UD state machine. The dispatcher's side
//! (routing by handler, every poll mode, the same scenarios on softverbs)
//! is in crates/cqd-verbs/tests/two_backends.rs.

use cqd_core::completion::GRH_LEN;
use cqd_core::{Completion, CompletionSource, Invalid, Opcode, Status, WcFlags};
use cqd_sim::{
    Access, AhAttr, CqConfig, Device, Fabric, Modify, PostError, Qp, QpCap, QpInit, QpState,
    RecvWr, SendWr, SimCqSource, UdDest, VerbsError, WrOp,
};

const QKEY: u32 = 0x11;

struct Ud {
    dev: Device,
    pd: cqd_sim::Pd,
    _cq: cqd_sim::Cq,
    src: SimCqSource,
    mr: cqd_sim::Mr,
}

impl Ud {
    fn on(dev: Device) -> Self {
        let pd = dev.alloc_pd();
        let (cq, src) = dev.create_cq("ud", 1024, CqConfig::default()).unwrap();
        let mr = pd.reg_mr(1 << 16, Access::ALL).unwrap();
        Ud {
            dev,
            pd,
            _cq: cq,
            src,
            mr,
        }
    }

    fn qp(&self) -> Qp {
        let qp = self
            .pd
            .create_qp(&QpInit::new(&self._cq, &self._cq, QpCap::default()).datagram())
            .unwrap();
        qp.ready_ud(QKEY).unwrap();
        qp
    }

    fn poll(&mut self) -> Vec<Completion> {
        let mut out = vec![Completion::default(); 64];
        let n = self.src.poll(&mut out).unwrap();
        out.truncate(n);
        out
    }
}

fn send(qp: &Qp, wr_id: u64, op: WrOp, sg: &[cqd_sim::Sge], dest: UdDest<'_>) {
    qp.post_send_unaccounted(&[SendWr::new(wr_id, op, sg).to(dest)])
        .unwrap();
}

#[test]
fn a_datagram_lands_after_the_grh_with_the_sender_named() {
    let mut u = Ud::on(Device::open("ud0"));
    let (tx, rx) = (u.qp(), u.qp());
    let by_gid = u.pd.create_ah(AhAttr::to_gid(&u.dev)).unwrap();
    let by_lid =
        u.pd.create_ah(AhAttr {
            sl: 3,
            ..AhAttr::to_lid(&u.dev)
        })
        .unwrap();
    u.mr.write(0, b"datagram payload").unwrap();
    rx.post_recv_unaccounted(&[
        RecvWr::new(1, &[u.mr.sge(1024, 256)]),
        RecvWr::new(2, &[u.mr.sge(2048, 256)]),
    ])
    .unwrap();
    let sg = [u.mr.sge(0, 16)];
    let dest = |ah| UdDest {
        ah,
        qpn: rx.qpn(),
        qkey: QKEY,
    };
    send(&tx, 10, WrOp::SendWithImm(0x77), &sg, dest(&by_gid));
    send(&tx, 11, WrOp::Send, &sg, dest(&by_lid));
    let wcs = u.poll();
    let recvs: Vec<_> = wcs.iter().filter(|c| c.opcode == Opcode::Recv).collect();
    let sends: Vec<_> = wcs.iter().filter(|c| c.opcode == Opcode::Send).collect();
    assert_eq!((recvs.len(), sends.len()), (2, 2), "{wcs:?}");
    let (g, l) = (recvs[0], recvs[1]);
    assert_eq!(
        (g.wr_id, g.status, g.byte_len),
        (1, Status::Success, GRH_LEN + 16)
    );
    assert_eq!(
        (g.src_qp, g.slid, g.qp_num),
        (tx.qpn(), u.dev.lid(), rx.qpn())
    );
    assert!(g.has_grh() && g.wc_flags.contains(WcFlags::WITH_IMM));
    assert_eq!(g.imm(), Some(0x77));
    assert_eq!((l.wr_id, l.sl, l.has_grh(), l.imm()), (2, 3, false, None));
    let mut buf = [0u8; 56];
    u.mr.read(1024, &mut buf).unwrap();
    assert_eq!(buf[0] >> 4, 6);
    assert_eq!(u16::from_be_bytes([buf[4], buf[5]]), 12 + 8 + 4 + 16 + 4);
    assert_eq!((buf[6], buf[7]), (0x1b, 64));
    assert_eq!(buf[8..24], u.dev.gid());
    assert_eq!(buf[24..40], u.dev.gid());
    assert_eq!(&buf[40..], b"datagram payload");
    u.mr.read(2048, &mut buf).unwrap();
    assert_eq!(buf[..40], [0u8; 40], "no GRH: the 40 bytes are left zero");
    assert_eq!(&buf[40..], b"datagram payload");
}

#[test]
fn undeliverable_datagrams_vanish_and_their_sends_succeed() {
    let fabric = Fabric::inline();
    let mut u = Ud::on(fabric.open_device("a", cqd_sim::DeviceAttr::default()));
    let other = fabric.open_device("b", cqd_sim::DeviceAttr::default());
    let (tx, rx) = (u.qp(), u.qp());
    let not_ready =
        u.pd.create_qp(&QpInit::new(&u._cq, &u._cq, QpCap::default()).datagram())
            .unwrap();
    not_ready.modify(Modify::InitUd { qkey: QKEY }).unwrap();
    let here = u.pd.create_ah(AhAttr::to_lid(&u.dev)).unwrap();
    let elsewhere = u.pd.create_ah(AhAttr::to_gid(&other)).unwrap();
    let sg = [u.mr.sge(0, 8)];
    // Wrong Q_Key, another port, a QP not at RTR, a QPN that does not
    // exist, and finally a good one with no receive posted.
    let dests = [
        (&here, rx.qpn(), QKEY + 1),
        (&elsewhere, rx.qpn(), QKEY),
        (&here, not_ready.qpn(), QKEY),
        (&here, 0xdead, QKEY),
        (&here, rx.qpn(), QKEY),
    ];
    rx.post_recv_unaccounted(&[RecvWr::new(1, &[u.mr.sge(1024, 64)])])
        .unwrap();
    not_ready
        .post_recv_unaccounted(&[RecvWr::new(2, &[u.mr.sge(2048, 64)])])
        .unwrap();
    for (i, (ah, qpn, qkey)) in dests.iter().enumerate() {
        send(
            &tx,
            10 + i as u64,
            WrOp::Send,
            &sg,
            UdDest {
                ah,
                qpn: *qpn,
                qkey: *qkey,
            },
        );
    }
    let wcs = u.poll();
    // Five successful sends, and the last datagram took the one receive.
    let sends: Vec<_> = wcs.iter().filter(|c| c.qp_num == tx.qpn()).collect();
    assert_eq!(sends.len(), 5, "{wcs:?}");
    assert!(sends.iter().all(|c| c.status == Status::Success));
    let recvs: Vec<_> = wcs.iter().filter(|c| c.qp_num != tx.qpn()).collect();
    assert_eq!(recvs.len(), 1, "{wcs:?}");
    assert_eq!((recvs[0].wr_id, recvs[0].qp_num), (1, rx.qpn()));
    assert_eq!(u.dev.fabric().stats().dropped, 4);
    // With nothing posted any more, the next one is dropped too.
    send(
        &tx,
        20,
        WrOp::Send,
        &sg,
        UdDest {
            ah: &here,
            qpn: rx.qpn(),
            qkey: QKEY,
        },
    );
    assert_eq!(u.dev.fabric().stats().dropped, 5);
    // A Q_Key with the high-order bit set means the sender's own.
    rx.post_recv_unaccounted(&[RecvWr::new(3, &[u.mr.sge(1024, 64)])])
        .unwrap();
    send(
        &tx,
        21,
        WrOp::Send,
        &sg,
        UdDest {
            ah: &here,
            qpn: rx.qpn(),
            qkey: 0x8000_0000,
        },
    );
    let wcs = u.poll();
    assert!(
        wcs.iter()
            .any(|c| c.wr_id == 3 && c.status == Status::Success),
        "{wcs:?}"
    );
}

#[test]
fn a_receive_too_short_for_grh_and_payload_fails_alone() {
    let mut u = Ud::on(Device::open("ud0"));
    let (tx, rx) = (u.qp(), u.qp());
    let ah = u.pd.create_ah(AhAttr::to_lid(&u.dev)).unwrap();
    // 40 + 16 bytes needed, 48 given.
    rx.post_recv_unaccounted(&[RecvWr::new(1, &[u.mr.sge(1024, 48)])])
        .unwrap();
    let sg = [u.mr.sge(0, 16)];
    send(
        &tx,
        10,
        WrOp::Send,
        &sg,
        UdDest {
            ah: &ah,
            qpn: rx.qpn(),
            qkey: QKEY,
        },
    );
    let wcs = u.poll();
    let r = wcs
        .iter()
        .find(|c| c.wr_id == 1)
        .expect("the receive completes");
    assert_eq!(r.status, Status::LocalLength);
    let s = wcs
        .iter()
        .find(|c| c.wr_id == 10)
        .expect("the send completes");
    assert_eq!(s.status, Status::Success, "UD: the sender does not know");
    assert_eq!(rx.state().unwrap(), QpState::Rts, "the receiver stays up");
}

#[test]
fn the_transport_decides_what_may_be_posted() {
    let u = Ud::on(Device::open("ud0"));
    let ud = u.qp();
    let ah = u.pd.create_ah(AhAttr::to_lid(&u.dev)).unwrap();
    let sg = [u.mr.sge(0, 8)];
    let dest = UdDest {
        ah: &ah,
        qpn: ud.qpn(),
        qkey: QKEY,
    };
    let refused = |r: Result<(), PostError>| match r {
        Err(PostError::Invalid {
            index: 0, source, ..
        }) => source,
        other => panic!("{other:?}"),
    };
    let write = SendWr::new(1, WrOp::Write(u.mr.remote(0)), &sg);
    assert!(matches!(
        refused(ud.post_send_unaccounted(&[write.to(dest)])),
        Invalid::Transport {
            transport: "UD",
            ..
        }
    ));
    assert!(matches!(
        refused(ud.post_send_unaccounted(&[SendWr::new(1, WrOp::Send, &sg)])),
        Invalid::Transport {
            transport: "UD",
            ..
        }
    ));
    let other_pd = u.dev.alloc_pd().create_ah(AhAttr::to_lid(&u.dev)).unwrap();
    let foreign = SendWr::new(1, WrOp::Send, &sg).to(UdDest {
        ah: &other_pd,
        ..dest
    });
    assert!(matches!(
        ud.post_send_unaccounted(&[foreign]),
        Err(PostError::ForeignAh { index: 0, .. })
    ));
    // An RC QP takes no address handle, and a UD QP no RC transition.
    let rc =
        u.pd.create_qp(&QpInit::new(&u._cq, &u._cq, QpCap::default()))
            .unwrap();
    assert!(matches!(
        rc.modify(Modify::InitUd { qkey: 1 }),
        Err(VerbsError::WrongQpType { .. })
    ));
    let fresh =
        u.pd.create_qp(&QpInit::new(&u._cq, &u._cq, QpCap::default()).datagram())
            .unwrap();
    assert!(matches!(
        fresh.modify(Modify::Init {
            access: Access::ALL
        }),
        Err(VerbsError::WrongQpType { .. })
    ));
    cqd_sim::connect(
        &rc,
        &u.pd
            .create_qp(&QpInit::new(&u._cq, &u._cq, QpCap::default()))
            .unwrap(),
    )
    .unwrap();
    assert!(matches!(
        refused(rc.post_send_unaccounted(&[SendWr::new(1, WrOp::Send, &sg).to(dest)])),
        Invalid::Transport {
            transport: "RC",
            ..
        }
    ));
    assert!(matches!(
        u.pd.create_ah(AhAttr {
            dlid: 0,
            sl: 0,
            grh: None
        }),
        Err(VerbsError::BadAh { .. })
    ));
}

#[test]
fn a_ud_qp_may_draw_its_receives_from_an_srq() {
    let mut u = Ud::on(Device::open("ud0"));
    let srq = u.pd.create_srq(16, 1).unwrap();
    let rx =
        u.pd.create_qp(
            &QpInit::new(&u._cq, &u._cq, QpCap::default())
                .datagram()
                .with_srq(&srq),
        )
        .unwrap();
    rx.ready_ud(QKEY).unwrap();
    let tx = u.qp();
    srq.post_recv_unaccounted(&[RecvWr::new(5, &[u.mr.sge(4096, 128)])])
        .unwrap();
    let ah = u.pd.create_ah(AhAttr::to_gid(&u.dev)).unwrap();
    let sg = [u.mr.sge(0, 24)];
    send(
        &tx,
        10,
        WrOp::Send,
        &sg,
        UdDest {
            ah: &ah,
            qpn: rx.qpn(),
            qkey: QKEY,
        },
    );
    let wcs = u.poll();
    let r = wcs
        .iter()
        .find(|c| c.wr_id == 5)
        .expect("the SRQ's receive completes");
    assert_eq!(
        (r.status, r.qp_num, r.src_qp),
        (Status::Success, rx.qpn(), tx.qpn())
    );
    assert_eq!((r.byte_len, r.has_grh()), (GRH_LEN + 24, true));
}
