//! UD QPs with address handles, and UC QPs, through the real libibverbs,
//! both sides in one process (tests/cross_process.rs has a cross-process
//! UD exchange). Run under `softverbs-run`; skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::ptr::null_mut;
use std::time::Duration;

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

const QKEY: u32 = 0x1111_1111;
const GRH: usize = 40;
const WC_GRH: u32 = ibv_wc_flags::IBV_WC_GRH.0;
const WC_IMM: u32 = ibv_wc_flags::IBV_WC_WITH_IMM.0;

struct Ud {
    dev: Dev,
    cq_a: *mut ibv_cq,
    cq_b: *mut ibv_cq,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
}

fn ud_pair() -> Ud {
    let dev = Dev::open();
    let cq_a = dev.cq(64, null_mut());
    let cq_b = dev.cq(64, null_mut());
    let a = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq_a, cq_a, null_mut());
    let b = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq_b, cq_b, null_mut());
    ud_up(a, QKEY);
    ud_up(b, QKEY);
    Ud {
        dev,
        cq_a,
        cq_b,
        a,
        b,
    }
}

#[test]
fn ud_send_lands_after_a_zero_grh_with_source_in_the_completion() {
    needs_launcher!("ud_send_lands_after_a_zero_grh_with_source_in_the_completion");
    let p = ud_pair();
    let mut src = Buf::new(&p.dev, 256, 0);
    for (i, b) in src.data.iter_mut().enumerate() {
        *b = i as u8 ^ 0x5a;
    }
    let dst = Buf::new(&p.dev, GRH + 256, 0xee);
    post_recv(p.b, &dst, 0, (GRH + 256) as u32, 9);
    let ah = create_ah(&p.dev, 3, None);
    let imm = 0xfeed_beefu32.to_be();
    assert_eq!(
        post_ud(p.a, &src, 0, 100, 1, ah, qpn(p.b), QKEY, Some(imm)),
        0
    );
    let s = poll(p.cq_a, 1)[0];
    assert_eq!(
        (s.wr_id, s.status, s.opcode),
        (1, WC_SUCCESS, ibv_wc_opcode::IBV_WC_SEND)
    );
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len),
        (
            9,
            WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RECV,
            (GRH + 100) as u32
        )
    );
    assert_eq!(
        (r.qp_num, r.src_qp, r.slid, r.sl),
        (qpn(p.b), qpn(p.a), 1, 3)
    );
    assert_eq!(r.pkey_index, 0);
    assert_eq!((r.wc_flags & WC_GRH, r.wc_flags & WC_IMM), (0, WC_IMM));
    assert_eq!(r.imm, imm);
    assert!(dst.data[..GRH].iter().all(|&b| b == 0), "GRH zeros");
    assert_eq!(&dst.data[GRH..GRH + 100], &src.data[..100]);
    assert!(dst.data[GRH + 100..].iter().all(|&b| b == 0xee));
    assert_eq!(unsafe { ibv_destroy_ah(ah) }, 0);
}

#[test]
fn ud_global_ah_fills_the_grh() {
    needs_launcher!("ud_global_ah_fills_the_grh");
    let p = ud_pair();
    let src = Buf::new(&p.dev, 64, 0x11);
    let dst = Buf::new(&p.dev, GRH + 64, 0xee);
    post_recv(p.b, &dst, 0, (GRH + 64) as u32, 1);
    let mut g: ibv_global_route = unsafe { std::mem::zeroed() };
    g.dgid.raw = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0xff, 0xfe, 0, 0, 1];
    g.flow_label = 0x12345;
    g.hop_limit = 7;
    g.traffic_class = 0xab;
    let ah = create_ah(&p.dev, 0, Some(g));
    assert_eq!(post_ud(p.a, &src, 0, 64, 1, ah, qpn(p.b), QKEY, None), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!((r.status, r.byte_len), (WC_SUCCESS, (GRH + 64) as u32));
    assert_eq!(r.wc_flags & WC_GRH, WC_GRH);
    let h = &dst.data[..GRH];
    let vtf = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
    assert_eq!(vtf >> 28, 6, "IP version");
    assert_eq!((vtf >> 20) & 0xff, 0xab, "traffic class");
    assert_eq!(vtf & 0xf_ffff, 0x12345, "flow label");
    assert_eq!(u16::from_be_bytes([h[4], h[5]]), 12 + 8 + 64 + 4, "PayLen");
    assert_eq!((h[6], h[7]), (0x1b, 7), "next header, hop limit");
    // Source GID: our port's GID 0, as ibv_query_gid reports it.
    let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_gid(p.dev.ctx, 1, 0, &mut gid) }, 0);
    assert_eq!(&h[8..24], unsafe { &gid.raw });
    assert_eq!(&h[24..40], unsafe { &g.dgid.raw });
    assert!(dst.data[GRH..].iter().all(|&b| b == 0x11));
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn ud_wrong_qkey_or_no_receive_is_dropped_silently() {
    needs_launcher!("ud_wrong_qkey_or_no_receive_is_dropped_silently");
    let p = ud_pair();
    let src = Buf::new(&p.dev, 64, 0x22);
    let dst = Buf::new(&p.dev, 2 * (GRH + 64), 0);
    let ah = create_ah(&p.dev, 0, None);
    // No receive posted: dropped, not queued.
    assert_eq!(post_ud(p.a, &src, 0, 8, 1, ah, qpn(p.b), QKEY, None), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    post_recv(p.b, &dst, 0, (GRH + 64) as u32, 1);
    poll_none(p.cq_b, Duration::from_millis(20));
    // Wrong Q_Key: dropped, the sender still succeeds.
    assert_eq!(post_ud(p.a, &src, 0, 8, 2, ah, qpn(p.b), QKEY + 1, None), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    poll_none(p.cq_b, Duration::from_millis(20));
    // A QPN nobody has: dropped too.
    assert_eq!(post_ud(p.a, &src, 0, 8, 3, ah, 0x00ff_fff0, QKEY, None), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    // A controlled Q_Key (high bit set) is the sender QP's own: delivered.
    assert_eq!(
        post_ud(p.a, &src, 0, 8, 4, ah, qpn(p.b), 0x8000_0000, None),
        0
    );
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!((r.wr_id, r.byte_len), (1, (GRH + 8) as u32));
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn ud_message_above_the_mtu_fails_locally_and_the_send_queue_recovers() {
    needs_launcher!("ud_message_above_the_mtu_fails_locally_and_the_send_queue_recovers");
    let p = ud_pair();
    let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ___ibv_query_port(p.dev.ctx, 1, &mut pa) }, 0);
    let mtu = 128usize << pa.active_mtu;
    let src = Buf::new(&p.dev, mtu + 1, 0x33);
    let dst = Buf::new(&p.dev, GRH + mtu + 1, 0);
    post_recv(p.b, &dst, 0, (GRH + mtu + 1) as u32, 1);
    let ah = create_ah(&p.dev, 0, None);
    assert_eq!(
        post_ud(p.a, &src, 0, (mtu + 1) as u32, 1, ah, qpn(p.b), QKEY, None),
        0
    );
    let c = poll(p.cq_a, 1)[0];
    assert_eq!((c.wr_id, c.status), (1, ibv_wc_status::IBV_WC_LOC_LEN_ERR));
    poll_none(p.cq_b, Duration::from_millis(20));
    // Send Queue Error: later sends flush, receives go on.
    assert_eq!(qp_state(p.a), ibv_qp_state::IBV_QPS_SQE);
    assert_eq!(post_ud(p.a, &src, 0, 8, 2, ah, qpn(p.b), QKEY, None), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_FLUSH);
    assert_eq!(post_ud(p.b, &src, 0, 8, 3, ah, qpn(p.a), QKEY, None), 0);
    poll(p.cq_b, 1);
    // The receive posted on the SQE QP still takes messages.
    let back = Buf::new(&p.dev, GRH + 8, 0);
    post_recv(p.a, &back, 0, (GRH + 8) as u32, 4);
    assert_eq!(post_ud(p.b, &src, 0, 8, 5, ah, qpn(p.a), QKEY, None), 0);
    let r = poll(p.cq_a, 1)[0];
    assert_eq!((r.wr_id, r.status), (4, WC_SUCCESS));
    poll(p.cq_b, 1);
    // Back to RTS: sending works again, exactly MTU bytes fit.
    resume_from_sqe(p.a);
    assert_eq!(
        post_ud(p.a, &src, 0, mtu as u32, 6, ah, qpn(p.b), QKEY, None),
        0
    );
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.byte_len),
        (1, WC_SUCCESS, (GRH + mtu) as u32)
    );
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn ud_receive_too_short_for_grh_and_payload_completes_in_error() {
    needs_launcher!("ud_receive_too_short_for_grh_and_payload_completes_in_error");
    let p = ud_pair();
    let src = Buf::new(&p.dev, 100, 0x44);
    let dst = Buf::new(&p.dev, 2 * (GRH + 100), 0);
    post_recv(p.b, &dst, 0, (GRH + 50) as u32, 1);
    post_recv(p.b, &dst, GRH + 100, (GRH + 100) as u32, 2);
    let ah = create_ah(&p.dev, 0, None);
    assert_eq!(post_ud(p.a, &src, 0, 100, 1, ah, qpn(p.b), QKEY, None), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS, "UD: no NAK");
    let r = poll(p.cq_b, 1)[0];
    assert_eq!((r.wr_id, r.status), (1, ibv_wc_status::IBV_WC_LOC_LEN_ERR));
    assert_eq!(
        qp_state(p.b),
        ibv_qp_state::IBV_QPS_RTS,
        "the UD QP stays up"
    );
    assert_eq!(post_ud(p.a, &src, 0, 100, 2, ah, qpn(p.b), QKEY, None), 0);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.byte_len),
        (2, WC_SUCCESS, (GRH + 100) as u32)
    );
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn ud_attributes_opcodes_and_address_handles_are_checked() {
    needs_launcher!("ud_attributes_opcodes_and_address_handles_are_checked");
    let dev = Dev::open();
    let cq = dev.cq(8, null_mut());
    let qp = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut());
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = ibv_qp_state::IBV_QPS_INIT;
    a.port_num = 1;
    let no_qkey = (ibv_qp_attr_mask::IBV_QP_STATE.0
        | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
        | ibv_qp_attr_mask::IBV_QP_PORT.0) as i32;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, no_qkey) }, libc::EINVAL);
    a.pkey_index = 1; // the P_Key table has one entry
    let m = no_qkey | ibv_qp_attr_mask::IBV_QP_QKEY.0 as i32;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, m) }, libc::EINVAL);
    a.pkey_index = 0;
    a.qkey = QKEY;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, m) }, 0);
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = ibv_qp_state::IBV_QPS_RTR;
    let st = ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, st) }, 0);
    a.qp_state = ibv_qp_state::IBV_QPS_RTS;
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, st) },
        libc::EINVAL,
        "no SQ PSN"
    );
    to_rts(qp);
    let mut q: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_qp(qp, &mut q, st, &mut i) }, 0);
    assert_eq!((q.qkey, i.qp_type), (QKEY, ibv_qp_type::IBV_QPT_UD));
    // RDMA WRITE is not a UD opcode; a null AH is not a destination.
    let buf = Buf::new(&dev, 64, 0);
    assert_eq!(
        post_send(qp, &buf, 0, 8, 1, send(WR_WRITE, SIGNALED)),
        libc::EINVAL
    );
    assert_eq!(
        post_ud(qp, &buf, 0, 8, 1, null_mut(), qpn(qp), QKEY, None),
        libc::EINVAL
    );
    // Port 2 does not exist.
    let mut aa: ibv_ah_attr = unsafe { std::mem::zeroed() };
    aa.dlid = 1;
    aa.port_num = 2;
    assert!(unsafe { ibv_create_ah(dev.pd, &mut aa) }.is_null());
}

struct Uc {
    dev: Dev,
    cq_a: *mut ibv_cq,
    cq_b: *mut ibv_cq,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
}

fn uc_pair() -> Uc {
    let dev = Dev::open();
    let cq_a = dev.cq(64, null_mut());
    let cq_b = dev.cq(64, null_mut());
    let a = dev.qp_of(ibv_qp_type::IBV_QPT_UC, cq_a, cq_a, null_mut());
    let b = dev.qp_of(ibv_qp_type::IBV_QPT_UC, cq_b, cq_b, null_mut());
    uc_connect(a, qpn(b));
    uc_connect(b, qpn(a));
    Uc {
        dev,
        cq_a,
        cq_b,
        a,
        b,
    }
}

#[test]
fn uc_send_write_and_write_with_immediate() {
    needs_launcher!("uc_send_write_and_write_with_immediate");
    let p = uc_pair();
    let src = Buf::new(&p.dev, 8192, 0x61);
    let dst = Buf::new(&p.dev, 8192, 0);
    let remote = Buf::new(&p.dev, 8192, 0);
    post_recv(p.b, &dst, 0, 8192, 1);
    assert_eq!(post_send(p.a, &src, 0, 6000, 1, send(WR_SEND, SIGNALED)), 0);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.byte_len, r.src_qp),
        (1, WC_SUCCESS, 6000, qpn(p.a))
    );
    assert!(
        dst.data[..6000].iter().all(|&b| b == 0x61),
        "UC: no MTU limit"
    );
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    let w = Send {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 8192, 2, w), 0);
    assert_eq!(poll(p.cq_a, 1)[0].opcode, ibv_wc_opcode::IBV_WC_RDMA_WRITE);
    assert!(remote.data.iter().all(|&b| b == 0x61));
    post_recv(p.b, &dst, 0, 8192, 3);
    let wi = Send {
        imm: 5u32.to_be(),
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        ..send(WR_WRITE_IMM, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 16, 3, wi), 0);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.opcode, r.imm),
        (3, ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, 5u32.to_be())
    );
    poll(p.cq_a, 1);
    // READ and atomics are not UC operations.
    let rd = Send {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        ..send(WR_READ, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 8, 4, rd), libc::EINVAL);
    assert_eq!(
        post_atomic(
            p.a,
            &src,
            0,
            5,
            WR_FETCH_ADD,
            remote.addr(),
            remote.rkey(),
            1,
            0
        ),
        libc::EINVAL
    );
}

#[test]
fn uc_drops_what_the_responder_cannot_take() {
    needs_launcher!("uc_drops_what_the_responder_cannot_take");
    let p = uc_pair();
    let src = Buf::new(&p.dev, 256, 0x71);
    let dst = Buf::new(&p.dev, 256, 0);
    let remote = Buf::new(&p.dev, 64, 0);
    // No receive: the message is dropped (no RNR retry), the sender succeeds.
    assert_eq!(post_send(p.a, &src, 0, 32, 1, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    post_recv(p.b, &dst, 0, 256, 1);
    poll_none(p.cq_b, Duration::from_millis(20));
    // A bad rkey: dropped, no NAK, the responder stays up.
    let bad = Send {
        remote_addr: remote.addr(),
        rkey: remote.rkey() ^ 0x0100_0000,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 32, 2, bad), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    assert!(remote.data.iter().all(|&b| b == 0));
    assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_RTS);
    // The receive posted earlier takes the next message.
    assert_eq!(post_send(p.a, &src, 0, 48, 3, send(WR_SEND, SIGNALED)), 0);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!((r.wr_id, r.status, r.byte_len), (1, WC_SUCCESS, 48));
    poll(p.cq_a, 1);
}

/// `max_ah` is what a context may hold: that many address handles are
/// created, one more is ENOMEM, a destroyed one makes room again, and
/// another context counts its own.
#[test]
fn address_handles_up_to_max_ah() {
    needs_launcher!("address_handles_up_to_max_ah");
    let dev = Dev::open();
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_device(dev.ctx, &mut a) }, 0);
    assert_eq!(a.max_ah, 65536, "max_ah");
    let mut ahs: Vec<*mut ibv_ah> = (0..a.max_ah).map(|_| create_ah(&dev, 0, None)).collect();
    let mut attr: ibv_ah_attr = unsafe { std::mem::zeroed() };
    attr.dlid = 1;
    attr.port_num = 1;
    unsafe { *libc::__errno_location() = 0 };
    assert!(
        unsafe { ibv_create_ah(dev.pd, &mut attr) }.is_null(),
        "one more than max_ah"
    );
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::ENOMEM)
    );
    let other = Dev::open();
    let theirs = create_ah(&other, 0, None);
    assert_eq!(unsafe { ibv_destroy_ah(theirs) }, 0);
    assert_eq!(unsafe { ibv_destroy_ah(ahs.pop().unwrap()) }, 0);
    ahs.push(create_ah(&dev, 0, None));
    for ah in ahs {
        assert_eq!(unsafe { ibv_destroy_ah(ah) }, 0);
    }
}
