//! Every operation of the RC model on the inline engine, routed through a
//! real `CqPoller` to the right callback with the right fields.

mod common;

use common::{sges, Ev, Rig};
use cqd_core::{OpKind, Opcode, Side, Status};
use cqd_sim::{QpState, SendWr, WrOp};

fn ok(
    side: Side,
    kind: OpKind,
    tag: u32,
    opcode: Opcode,
    byte_len: u32,
    imm: Option<u32>,
    qp: u32,
) -> Ev {
    Ev {
        side,
        ok: true,
        kind,
        tag,
        status: Status::Success,
        opcode,
        byte_len,
        imm,
        qp,
    }
}

#[test]
fn send_and_send_with_imm_land_in_the_receive() {
    let mut r = Rig::new();
    r.mr_a.write(0, b"hello world").unwrap();
    r.recv(&r.b, 1, &[r.mr_b.sge(100, 64)]).unwrap();
    r.recv(&r.b, 2, &[r.mr_b.sge(200, 4), r.mr_b.sge(300, 60)])
        .unwrap();
    let s1 = sges(&[r.mr_a.sge(0, 5)]);
    r.send(&r.a, OpKind::Send, 10, |id| SendWr::new(id, WrOp::Send, s1))
        .unwrap();
    let s2 = sges(&[r.mr_a.sge(0, 11)]);
    r.send(&r.a, OpKind::Send, 11, |id| {
        SendWr::new(id, WrOp::SendWithImm(0xabcd), s2)
    })
    .unwrap();
    assert_eq!(r.poll_all(), 4);
    let (a, b) = (r.a.qpn(), r.b.qpn());
    assert_eq!(
        r.log.take(),
        vec![
            ok(Side::Recv, OpKind::Recv, 1, Opcode::Recv, 5, None, b),
            ok(Side::Send, OpKind::Send, 10, Opcode::Send, 0, None, a),
            ok(
                Side::Recv,
                OpKind::Recv,
                2,
                Opcode::Recv,
                11,
                Some(0xabcd),
                b
            ),
            ok(Side::Send, OpKind::Send, 11, Opcode::Send, 0, None, a),
        ]
    );
    let mut got = [0u8; 5];
    r.mr_b.read(100, &mut got).unwrap();
    assert_eq!(&got, b"hello");
    let (mut x, mut y) = ([0u8; 4], [0u8; 7]);
    r.mr_b.read(200, &mut x).unwrap();
    r.mr_b.read(300, &mut y).unwrap();
    assert_eq!((&x, &y), (b"hell", b"o world"), "scattered over two SGEs");
}

#[test]
fn write_read_and_write_with_imm() {
    let mut r = Rig::new();
    r.mr_a.write(0, b"0123456789").unwrap();
    let s = sges(&[r.mr_a.sge(0, 10)]);
    let remote = r.mr_b.remote(1000);
    r.send(&r.a, OpKind::Write, 1, |id| {
        SendWr::new(id, WrOp::Write(remote), s)
    })
    .unwrap();
    let mut got = [0u8; 10];
    r.mr_b.read(1000, &mut got).unwrap();
    assert_eq!(&got, b"0123456789");

    r.mr_b.write(2000, b"remote data!").unwrap();
    let dst = sges(&[r.mr_a.sge(500, 6), r.mr_a.sge(600, 6)]);
    let src = r.mr_b.remote(2000);
    r.send(&r.a, OpKind::Read, 2, |id| {
        SendWr::new(id, WrOp::Read(src), dst)
    })
    .unwrap();
    let (mut x, mut y) = ([0u8; 6], [0u8; 6]);
    r.mr_a.read(500, &mut x).unwrap();
    r.mr_a.read(600, &mut y).unwrap();
    assert_eq!((&x, &y), (b"remote", b" data!"));

    r.recv(&r.b, 3, &[]).unwrap();
    let s = sges(&[r.mr_a.sge(0, 4)]);
    let remote = r.mr_b.remote(3000);
    r.send(&r.a, OpKind::Write, 4, |id| {
        SendWr::new(id, WrOp::WriteWithImm(remote, 77), s).solicited()
    })
    .unwrap();
    assert_eq!(r.poll_all(), 4);
    let (a, b) = (r.a.qpn(), r.b.qpn());
    assert_eq!(
        r.log.take(),
        vec![
            ok(Side::Send, OpKind::Write, 1, Opcode::RdmaWrite, 0, None, a),
            ok(Side::Send, OpKind::Read, 2, Opcode::RdmaRead, 12, None, a),
            ok(
                Side::Recv,
                OpKind::Recv,
                3,
                Opcode::RecvRdmaWithImm,
                4,
                Some(77),
                b
            ),
            ok(Side::Send, OpKind::Write, 4, Opcode::RdmaWrite, 0, None, a),
        ]
    );
    let mut got = [0u8; 4];
    r.mr_b.read(3000, &mut got).unwrap();
    assert_eq!(&got, b"0123");
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    let mut r = Rig::new();
    r.mr_b.write_u64(64, 5).unwrap();
    let res = sges(&[r.mr_a.sge(8, 8)]);
    let t = r.mr_b.remote(64);
    r.send(&r.a, OpKind::Atomic, 1, |id| {
        SendWr::new(id, WrOp::FetchAdd { remote: t, add: 10 }, res)
    })
    .unwrap();
    assert_eq!(r.mr_a.read_u64(8).unwrap(), 5);
    assert_eq!(r.mr_b.read_u64(64).unwrap(), 15);
    let op = WrOp::CompareSwap {
        remote: t,
        compare: 15,
        swap: 99,
    };
    r.send(&r.a, OpKind::Atomic, 2, |id| SendWr::new(id, op, res))
        .unwrap();
    assert_eq!(
        (r.mr_a.read_u64(8).unwrap(), r.mr_b.read_u64(64).unwrap()),
        (15, 99)
    );
    let op = WrOp::CompareSwap {
        remote: t,
        compare: 1,
        swap: 2,
    };
    r.send(&r.a, OpKind::Atomic, 3, |id| SendWr::new(id, op, res))
        .unwrap();
    assert_eq!(
        (r.mr_a.read_u64(8).unwrap(), r.mr_b.read_u64(64).unwrap()),
        (99, 99),
        "no swap on mismatch"
    );
    assert_eq!(r.poll_all(), 3);
    let a = r.a.qpn();
    let evs = r.log.take();
    assert_eq!(
        evs[0],
        ok(Side::Send, OpKind::Atomic, 1, Opcode::FetchAdd, 8, None, a)
    );
    assert_eq!(
        evs[1],
        ok(
            Side::Send,
            OpKind::Atomic,
            2,
            Opcode::CompareSwap,
            8,
            None,
            a
        )
    );
}

#[test]
fn unsignaled_sends_complete_silently_in_order() {
    let mut r = Rig::new();
    let s = sges(&[r.mr_a.sge(0, 8)]);
    let remote = r.mr_b.remote(0);
    for tag in 0..5 {
        r.send(&r.a, OpKind::Write, tag, |id| {
            SendWr::new(id, WrOp::Write(remote), s).unsignaled()
        })
        .unwrap();
    }
    r.send(&r.a, OpKind::Write, 5, |id| {
        SendWr::new(id, WrOp::Write(remote), s)
    })
    .unwrap();
    assert_eq!(r.poll_all(), 1, "only the signaled one completes");
    assert_eq!(r.log.take()[0].tag, 5);
    assert_eq!(r.fabric.stats().executed, 6);
    // The signaled completion retired the 5 unsignaled writes before it
    // (send queues complete in order): all 6 count completed.
    assert_eq!(r.reg.ledger().outstanding(), 0);
    assert_eq!(r.reg.ledger().completed(OpKind::Write), 6);
    assert_eq!(r.a.state().unwrap(), QpState::Rts);
}

#[test]
fn rnr_retry_seven_waits_for_the_receive() {
    let mut r = Rig::new();
    let s = sges(&[r.mr_a.sge(0, 8)]);
    r.send(&r.a, OpKind::Send, 1, |id| SendWr::new(id, WrOp::Send, s))
        .unwrap();
    r.send(&r.a, OpKind::Write, 2, |id| {
        SendWr::new(id, WrOp::Write(r.mr_b.remote(0)), s)
    })
    .unwrap();
    assert_eq!(
        r.poll_all(),
        0,
        "the send waits, and the write behind it (in order)"
    );
    assert!(!r.fabric.is_idle());
    r.recv(&r.b, 3, &[r.mr_b.sge(0, 64)]).unwrap();
    assert_eq!(r.poll_all(), 3);
    let tags: Vec<u32> = r.log.take().iter().map(|e| e.tag).collect();
    assert_eq!(tags, vec![3, 1, 2]);
    assert!(r.fabric.is_idle());
}

#[test]
fn a_list_that_fits_only_after_polling_reclaims_slots() {
    let cap = cqd_sim::QpCap {
        max_send_wr: 8,
        ..cqd_sim::QpCap::default()
    };
    let mut r = Rig::with(
        cqd_sim::Fabric::inline(),
        cap,
        1024,
        cqd_sim::CqConfig::default(),
    );
    let s = [r.mr_a.sge(0, 8)];
    let remote = r.mr_b.remote(0);
    let reg = r.reg.clone();
    let w = |t| SendWr::new(t, WrOp::Write(remote), &s);
    let mut first: Vec<_> = (0..6).map(w).collect();
    let mut three: Vec<_> = (6..9).map(w).collect();
    let mut four: Vec<_> = (6..10).map(w).collect();
    reg.post_send(&r.a, &mut first).unwrap();
    assert!(
        reg.post_send(&r.a, &mut three).is_err(),
        "6 + 3 > 8 before polling"
    );
    r.poll_all();
    reg.post_send(&r.a, &mut four).unwrap();
    assert_eq!(r.poll_all(), 4);
    assert_eq!(reg.ledger().posted(OpKind::Write), 10);
    assert_eq!(reg.ledger().outstanding(), 0);
}

#[test]
fn nic_objects_can_be_shared_across_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<cqd_sim::Fabric>();
    send_sync::<cqd_sim::Device>();
    send_sync::<cqd_sim::Pd>();
    send_sync::<cqd_sim::Mr>();
    send_sync::<cqd_sim::Qp>();
    send_sync::<cqd_sim::Srq>();
    send_sync::<cqd_sim::Cq>();
    send_sync::<cqd_core::budget::CqBudget>();
    send_sync::<cqd_core::ledger::WrLedger>();
}

#[test]
fn wr_id_untouched_and_the_solicited_flag_drives_a_solicited_arm() {
    use cqd_core::{ArmKind, Completion, CompletionSource};
    let dev = cqd_sim::Device::open("sim0");
    let (cq, mut src) = dev
        .create_cq("cq", 64, cqd_sim::CqConfig::default())
        .unwrap();
    let pd = dev.alloc_pd();
    let cap = cqd_sim::QpCap::default();
    let (cap_small, mr) = (
        cqd_sim::QpCap {
            max_send_wr: 8,
            max_recv_wr: 8,
            ..cap
        },
        pd.reg_mr(64, cqd_sim::Access::ALL).unwrap(),
    );
    let a = pd
        .create_qp(&cqd_sim::QpInit::new(&cq, &cq, cap_small))
        .unwrap();
    let b = pd
        .create_qp(&cqd_sim::QpInit::new(&cq, &cq, cap_small))
        .unwrap();
    cqd_sim::connect(&a, &b).unwrap();
    let sge = [mr.sge(0, 8)];
    let raw = 0x1234_5678_9abc_def0;
    b.post_recv_unaccounted(&[
        cqd_sim::RecvWr::new(raw, &sge),
        cqd_sim::RecvWr::new(raw + 1, &sge),
    ])
    .unwrap();
    src.arm(ArmKind::Solicited).unwrap();
    a.post_send_unaccounted(&[SendWr::new(7, WrOp::Send, &sge).unsignaled()])
        .unwrap();
    assert_eq!(
        src.take_events().unwrap(),
        0,
        "an unsolicited receive does not fire a solicited arm"
    );
    a.post_send_unaccounted(&[SendWr::new(8, WrOp::SendWithImm(1), &sge)
        .unsignaled()
        .solicited()])
        .unwrap();
    assert_eq!(src.take_events().unwrap(), 1, "a solicited one does");
    src.ack_events(1).unwrap();
    let mut buf = [Completion::default(); 4];
    assert_eq!(src.poll(&mut buf).unwrap(), 2);
    assert_eq!(
        (buf[0].wr_id, buf[1].wr_id),
        (raw, raw + 1),
        "wr_id comes back untouched"
    );
    assert_eq!((buf[0].qp_num, buf[0].src_qp), (b.qpn(), a.qpn()));
    assert!(!buf[0].wc_flags.contains(cqd_core::WcFlags::WITH_IMM));
    assert_eq!(buf[1].imm(), Some(1));
}

#[test]
fn two_devices_on_one_fabric_connect_and_objects_stay_on_their_device() {
    let fabric = cqd_sim::Fabric::inline();
    let client = fabric.open_device("client", cqd_sim::DeviceAttr::default());
    let server = fabric.open_device(
        "server",
        cqd_sim::DeviceAttr {
            max_qp_wr: 16,
            ..Default::default()
        },
    );
    let (ccq, _cs) = client
        .create_cq("c", 64, cqd_sim::CqConfig::default())
        .unwrap();
    let (scq, mut ss) = server
        .create_cq("s", 64, cqd_sim::CqConfig::default())
        .unwrap();
    let (cpd, spd) = (client.alloc_pd(), server.alloc_pd());
    let small = cqd_sim::QpCap {
        max_send_wr: 16,
        max_recv_wr: 16,
        ..cqd_sim::QpCap::default()
    };
    let c = cpd
        .create_qp(&cqd_sim::QpInit::new(&ccq, &ccq, small))
        .unwrap();
    let s = spd
        .create_qp(&cqd_sim::QpInit::new(&scq, &scq, small))
        .unwrap();
    assert!(matches!(
        spd.create_qp(&cqd_sim::QpInit::new(&ccq, &ccq, small)),
        Err(cqd_sim::VerbsError::Foreign { what: "CQ", .. })
    ));
    let big = cqd_sim::QpCap {
        max_send_wr: 17,
        ..small
    };
    assert!(matches!(
        spd.create_qp(&cqd_sim::QpInit::new(&scq, &scq, big)),
        Err(cqd_sim::VerbsError::LimitExceeded {
            what: "max_qp_wr",
            requested: 17,
            max: 16
        })
    ));
    cqd_sim::connect(&c, &s).unwrap();
    let (cmr, smr) = (
        cpd.reg_mr(64, cqd_sim::Access::ALL).unwrap(),
        spd.reg_mr(64, cqd_sim::Access::ALL).unwrap(),
    );
    s.post_recv_unaccounted(&[cqd_sim::RecvWr::new(1, &[smr.sge(0, 64)])])
        .unwrap();
    cmr.write(0, b"ping").unwrap();
    c.post_send_unaccounted(&[SendWr::new(2, WrOp::Send, &[cmr.sge(0, 4)])])
        .unwrap();
    let mut buf = [cqd_core::Completion::default(); 2];
    assert_eq!(
        cqd_core::CompletionSource::poll(&mut ss, &mut buf).unwrap(),
        1
    );
    assert_eq!((buf[0].wr_id, buf[0].byte_len), (1, 4));
    // A region of the other domain is not usable locally.
    c.post_send_unaccounted(&[SendWr::new(3, WrOp::Send, &[smr.sge(0, 4)])])
        .unwrap();
    assert_eq!(
        c.state().unwrap(),
        cqd_sim::QpState::Err,
        "local protection error"
    );
}
