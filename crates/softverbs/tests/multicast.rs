//! UD multicast through the real libibverbs: `ibv_attach_mcast` /
//! `ibv_detach_mcast`, and sends to QPN 0xFFFFFF through an address handle
//! to the group, with receivers in this process and in a child process
//! (the test binary re-runs itself). Each test uses its own group: the
//! table is the fabric's. Run under `softverbs-run`; skipped loudly
//! otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::child::{child_chan, spawn, Chan};
use common::*;
use std::ptr::null_mut;
use std::time::Duration;

const QKEY: u32 = 0x0123_4567;
const GRH: usize = 40;
const MCAST_QPN: u32 = 0x00ff_ffff;
const MLID: u16 = 0xc00a;

/// The group GID of test `n` (a multicast GID: first byte 0xFF).
fn mgid(n: u8) -> ibv_gid {
    let mut g: ibv_gid = unsafe { std::mem::zeroed() };
    g.raw = [
        0xff, 0x12, 0x40, 0x1b, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0x0e, 0, 0x7e, n,
    ];
    g
}

fn attach(qp: *mut ibv_qp, g: &ibv_gid, lid: u16) -> i32 {
    unsafe { ibv_attach_mcast(qp, g, lid) }
}

fn detach(qp: *mut ibv_qp, g: &ibv_gid, lid: u16) -> i32 {
    unsafe { ibv_detach_mcast(qp, g, lid) }
}

/// An address handle to the group (global, DLID the group's LID).
fn group_ah(dev: &Dev, g: &ibv_gid) -> *mut ibv_ah {
    let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
    a.dlid = MLID;
    a.port_num = 1;
    a.is_global = 1;
    a.grh.dgid = *g;
    a.grh.hop_limit = 1;
    let ah = unsafe { ibv_create_ah(dev.pd, &mut a) };
    assert!(!ah.is_null(), "create_ah");
    ah
}

struct Rx {
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    buf: Buf,
}

fn rx(dev: &Dev, qkey: u32, recvs: usize) -> Rx {
    let cq = dev.cq(64, null_mut());
    let qp = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut());
    ud_up(qp, qkey);
    let buf = Buf::new(dev, recvs * (GRH + 256), 0xee);
    for i in 0..recvs {
        post_recv(qp, &buf, i * (GRH + 256), (GRH + 256) as u32, i as u64);
    }
    Rx { cq, qp, buf }
}

#[test]
fn multicast_limits_and_attach_rules() {
    if !launcher_or_skip("multicast_limits_and_attach_rules") {
        return;
    }
    let dev = Dev::open();
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_device(dev.ctx, &mut a) }, 0);
    assert_eq!((a.max_mcast_grp, a.max_mcast_qp_attach), (64, 32));
    assert_eq!(a.max_total_mcast_qp_attach, 64 * 32);
    let cq = dev.cq(16, null_mut());
    let ud = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut());
    let rc = dev.qp(cq, cq, null_mut());
    let g = mgid(1);
    // Only UD QPs, multicast GIDs and multicast LIDs.
    assert_eq!(attach(rc, &g, MLID), libc::EINVAL);
    let mut unicast = g;
    unsafe { unicast.raw[0] = 0xfe };
    assert_eq!(attach(ud, &unicast, MLID), libc::EINVAL);
    assert_eq!(attach(ud, &g, 1), libc::EINVAL);
    assert_eq!(attach(ud, &g, 0xffff), libc::EINVAL);
    // Not attached: detach is EINVAL.
    assert_eq!(detach(ud, &g, MLID), libc::EINVAL);
    assert_eq!(attach(ud, &g, MLID), 0);
    // Again: succeeds, one attachment.
    assert_eq!(attach(ud, &g, MLID), 0);
    // A QP still attached is not destroyed.
    assert_eq!(unsafe { ibv_destroy_qp(ud) }, libc::EBUSY);
    assert_eq!(detach(ud, &g, MLID + 1), libc::EINVAL, "other LID");
    assert_eq!(detach(ud, &g, MLID), 0);
    assert_eq!(detach(ud, &g, MLID), libc::EINVAL, "detached once");
    // A group holds 32 QPs: the 33rd is ENOMEM, the others stay.
    let g2 = mgid(2);
    let many: Vec<_> = (0..33)
        .map(|_| dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut()))
        .collect();
    for q in &many[..32] {
        assert_eq!(attach(*q, &g2, MLID), 0);
    }
    assert_eq!(attach(many[32], &g2, MLID), libc::ENOMEM);
    assert_eq!(detach(many[0], &g2, MLID), 0);
    assert_eq!(attach(many[32], &g2, MLID), 0, "room again");
    for q in &many[1..] {
        assert_eq!(detach(*q, &g2, MLID), 0);
    }
    for q in many.into_iter().chain([ud, rc]) {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
}

/// One send reaches every attached QP of this process, each with the GRH
/// (destination GID the group's) and the sender as source; a QP that is not
/// attached, or attached with another Q_Key, gets nothing; the sender gets
/// its own message once it is attached; a detached QP no longer receives.
#[test]
fn multicast_reaches_every_attached_qp_once() {
    if !launcher_or_skip("multicast_reaches_every_attached_qp_once") {
        return;
    }
    let dev = Dev::open();
    let g = mgid(3);
    let r1 = rx(&dev, QKEY, 4);
    let r2 = rx(&dev, QKEY, 4);
    let other_qkey = rx(&dev, QKEY + 1, 4);
    let outsider = rx(&dev, QKEY, 4);
    let tx = rx(&dev, QKEY, 4);
    for r in [&r1, &r2, &other_qkey] {
        assert_eq!(attach(r.qp, &g, MLID), 0);
    }
    let mut src = Buf::new(&dev, 256, 0);
    for (i, b) in src.data.iter_mut().enumerate() {
        *b = (i as u8).wrapping_mul(7);
    }
    let ah = group_ah(&dev, &g);
    assert_eq!(
        post_ud(tx.qp, &src, 0, 200, 1, ah, MCAST_QPN, QKEY, None),
        0
    );
    assert_eq!(poll(tx.cq, 1)[0].status, WC_SUCCESS);
    for r in [&r1, &r2] {
        let c = poll(r.cq, 1)[0];
        assert_eq!(
            (c.wr_id, c.status, c.byte_len, c.qp_num, c.src_qp, c.slid),
            (0, WC_SUCCESS, (GRH + 200) as u32, qpn(r.qp), qpn(tx.qp), 1)
        );
        assert_eq!(
            c.wc_flags & ibv_wc_flags::IBV_WC_GRH.0,
            ibv_wc_flags::IBV_WC_GRH.0
        );
        assert_eq!(&r.buf.data[24..40], unsafe { &g.raw }, "GRH DGID");
        assert_eq!(&r.buf.data[GRH..GRH + 200], &src.data[..200]);
        poll_none(r.cq, Duration::from_millis(10));
    }
    // Q_Key mismatch, not attached, sender not attached: nothing.
    poll_none(other_qkey.cq, Duration::from_millis(10));
    poll_none(outsider.cq, Duration::from_millis(10));
    // The sender attached: it receives its own message too (IB loops a
    // multicast back to an attached sender).
    assert_eq!(attach(tx.qp, &g, MLID), 0);
    assert_eq!(detach(r2.qp, &g, MLID), 0);
    assert_eq!(post_ud(tx.qp, &src, 0, 64, 2, ah, MCAST_QPN, QKEY, None), 0);
    let mine = poll(tx.cq, 2);
    let recv = mine.iter().find(|c| c.opcode == ibv_wc_opcode::IBV_WC_RECV);
    let sent = mine.iter().find(|c| c.opcode == ibv_wc_opcode::IBV_WC_SEND);
    assert_eq!(sent.map(|c| (c.wr_id, c.status)), Some((2, WC_SUCCESS)));
    assert_eq!(
        recv.map(|c| (c.src_qp, c.byte_len)),
        Some((qpn(tx.qp), (GRH + 64) as u32))
    );
    assert_eq!(poll(r1.cq, 1)[0].byte_len, (GRH + 64) as u32);
    // Detached: nothing more for r2.
    poll_none(r2.cq, Duration::from_millis(10));
    // To the group QPN without a GRH, or to a group nobody joined:
    // dropped everywhere, the send still succeeds.
    let plain = create_ah(&dev, 0, None);
    assert_eq!(
        post_ud(tx.qp, &src, 0, 8, 3, plain, MCAST_QPN, QKEY, None),
        0
    );
    let nobody = group_ah(&dev, &mgid(4));
    assert_eq!(
        post_ud(tx.qp, &src, 0, 8, 4, nobody, MCAST_QPN, QKEY, None),
        0
    );
    let s = poll(tx.cq, 2);
    assert!(s
        .iter()
        .all(|c| c.status == WC_SUCCESS && c.opcode == ibv_wc_opcode::IBV_WC_SEND));
    for r in [&r1, &r2, &other_qkey, &outsider, &tx] {
        poll_none(r.cq, Duration::from_millis(10));
    }
    for r in [&r1, &other_qkey, &tx] {
        assert_eq!(detach(r.qp, &g, MLID), 0);
    }
    unsafe {
        ibv_destroy_ah(ah);
        ibv_destroy_ah(plain);
        ibv_destroy_ah(nobody);
    }
}

/// Two receivers in a child process and one here: each send reaches all
/// three. The child then exits with its QPs still attached: later sends
/// skip them and still reach ours, and the group has room again for new
/// members once the dead ones are pruned.
#[test]
fn multicast_across_processes_and_past_a_dead_member() {
    if let Some(ch) = child_chan() {
        return mcast_child(ch);
    }
    if !launcher_or_skip("multicast_across_processes_and_past_a_dead_member") {
        return;
    }
    let g = mgid(5);
    let (mut child, mut ch) = spawn("multicast_across_processes_and_past_a_dead_member");
    let dev = Dev::open();
    let local = rx(&dev, QKEY, 4);
    assert_eq!(attach(local.qp, &g, MLID), 0);
    let tx = rx(&dev, QKEY, 0);
    let children = ch.recv();
    assert_eq!(children.len(), 2, "child's QPNs");
    let mut src = Buf::new(&dev, 3 * 128, 0);
    for (i, b) in src.data.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let ah = group_ah(&dev, &g);
    for i in 0..3 {
        assert_eq!(
            post_ud(
                tx.qp,
                &src,
                i * 128,
                128,
                i as u64,
                ah,
                MCAST_QPN,
                QKEY,
                None
            ),
            0
        );
        assert_eq!(poll(tx.cq, 1)[0].status, WC_SUCCESS);
    }
    for (i, c) in poll(local.cq, 3).iter().enumerate() {
        assert_eq!((c.wr_id, c.src_qp), (i as u64, qpn(tx.qp)));
        let off = i * (GRH + 256);
        assert_eq!(
            &local.buf.data[off + GRH..off + GRH + 128],
            &src.data[i * 128..(i + 1) * 128]
        );
    }
    ch.send(&format!("{}", qpn(tx.qp)));
    assert_eq!(ch.recv(), vec![6], "the child's two QPs got 3 each");
    assert!(
        child.wait().expect("wait").success(),
        "multicast child failed"
    );
    // The child is gone, its QPs still in the table: skipped.
    assert_eq!(
        post_ud(tx.qp, &src, 0, 128, 9, ah, MCAST_QPN, QKEY, None),
        0
    );
    assert_eq!(poll(tx.cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(poll(local.cq, 1)[0].wr_id, 3);
    // The dead members' places are free again: 31 more QPs fit next to
    // ours in the group of 32.
    let cq = dev.cq(16, null_mut());
    let more: Vec<_> = (0..31)
        .map(|_| dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut()))
        .collect();
    for q in &more {
        assert_eq!(attach(*q, &g, MLID), 0);
    }
    for q in more {
        assert_eq!(detach(q, &g, MLID), 0);
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(detach(local.qp, &g, MLID), 0);
    unsafe { ibv_destroy_ah(ah) };
}

fn mcast_child(mut ch: Chan) {
    let g = mgid(5);
    let dev = Dev::open();
    let a = rx(&dev, QKEY, 4);
    let b = rx(&dev, QKEY, 4);
    assert_eq!(attach(a.qp, &g, MLID), 0);
    assert_eq!(attach(b.qp, &g, MLID), 0);
    ch.send(&format!("{} {}", qpn(a.qp), qpn(b.qp)));
    let sender = ch.recv()[0] as u32;
    let mut got = 0;
    for r in [&a, &b] {
        for (i, c) in poll(r.cq, 3).iter().enumerate() {
            assert_eq!(
                (c.wr_id, c.status, c.byte_len, c.src_qp),
                (i as u64, WC_SUCCESS, (GRH + 128) as u32, sender)
            );
            let off = i * (GRH + 256);
            let want: Vec<u8> = (i * 128..(i + 1) * 128).map(|k| (k % 251) as u8).collect();
            assert_eq!(&r.buf.data[off + GRH..off + GRH + 128], &want[..]);
            got += 1;
        }
    }
    ch.send(&format!("{got}"));
    // Exit with both QPs attached, as a crashing process would.
    std::process::exit(0);
}

/// A dead device (`softverbs_inject_device_fatal`): attach and detach
/// answer EIO, and a QP still attached is destroyed all the same, its
/// attachment with it (the group's sends no longer reach it).
#[test]
fn multicast_qp_of_a_dead_device_is_destroyed_attached() {
    if !launcher_or_skip("multicast_qp_of_a_dead_device_is_destroyed_attached") {
        return;
    }
    type Inject = unsafe extern "C" fn(*mut ibv_context) -> i32;
    let p = unsafe {
        libc::dlsym(
            libc::RTLD_DEFAULT,
            c"softverbs_inject_device_fatal".as_ptr(),
        )
    };
    assert!(!p.is_null(), "softverbs_inject_device_fatal not found");
    let inject = unsafe { std::mem::transmute::<*mut libc::c_void, Inject>(p) };
    let g = mgid(6);
    let dying = Dev::open();
    let cq = dying.cq(16, null_mut());
    let qp = dying.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut());
    ud_up(qp, QKEY);
    assert_eq!(attach(qp, &g, MLID), 0);
    assert_eq!(unsafe { inject(dying.ctx) }, 0);
    assert_eq!(attach(qp, &mgid(7), MLID), libc::EIO);
    assert_eq!(detach(qp, &g, MLID), libc::EIO);
    assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
    // The group is empty again: a live device's member is alone in it.
    let dev = Dev::open();
    let r = rx(&dev, QKEY, 2);
    let tx = rx(&dev, QKEY, 0);
    assert_eq!(attach(r.qp, &g, MLID), 0);
    let src = Buf::new(&dev, 16, 0x42);
    let ah = group_ah(&dev, &g);
    assert_eq!(post_ud(tx.qp, &src, 0, 16, 1, ah, MCAST_QPN, QKEY, None), 0);
    assert_eq!(poll(tx.cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(poll(r.cq, 1)[0].byte_len, (GRH + 16) as u32);
    assert_eq!(detach(r.qp, &g, MLID), 0);
    unsafe { ibv_destroy_ah(ah) };
}
