//! softverbs through the real libibverbs (rdma-sys), requester and responder
//! in two processes: the test binary re-runs itself as the child, and the two
//! exchange QPNs, addresses and rkeys over a socketpair, as verbs programs do
//! over TCP. Run under `softverbs-run`; skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::child::{child_chan, spawn, Chan};
use common::*;
use std::os::fd::AsRawFd;
use std::ptr::null_mut;

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect()
}

const HALF: usize = 32 * 1024;

#[test]
fn cross_process_send_write_read() {
    if let Some(ch) = child_chan() {
        return requester(ch);
    }
    if !launcher_or_skip("cross_process_send_write_read") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_send_write_read");
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let qp = dev.qp(cq, cq, null_mut());
    let qp2 = dev.qp(cq, cq, null_mut());
    let mut target = Buf::new(&dev, 2 * HALF, 0);
    target.data[HALF..].copy_from_slice(&pattern(3, HALF));
    let rbuf = Buf::new(&dev, 4096, 0);
    ch.send(&format!(
        "{} {} {} {}",
        qpn(qp),
        target.addr(),
        target.rkey(),
        qpn(qp2)
    ));
    let peers = ch.recv();
    let peer = peers[0] as u32;
    connect(qp, peer);
    connect(qp2, peers[1] as u32);
    post_recv(qp, &rbuf, 0, 4096, 1);
    post_recv(qp, &rbuf, 0, 4096, 2);
    ch.send("ready");
    let r = poll(cq, 2);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].opcode, r[0].byte_len),
        (1, WC_SUCCESS, ibv_wc_opcode::IBV_WC_RECV, 100)
    );
    assert_eq!(r[0].imm, 0xabcdu32.to_be());
    assert_eq!(r[0].src_qp, peer);
    assert_eq!(&rbuf.data[..100], &pattern(1, 100)[..]);
    assert_eq!(
        (r[1].wr_id, r[1].opcode, r[1].imm),
        (2, ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, 7u32.to_be())
    );
    assert!(
        target.data[..HALF] == pattern(2, HALF)[..],
        "cross-process RDMA WRITE payload differs"
    );
    assert_eq!(ch.recv(), vec![1], "requester finished");
    assert!(
        child.wait().expect("wait").success(),
        "requester process failed"
    );
}

fn requester(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let qp = dev.qp(cq, cq, null_mut());
    let qp2 = dev.qp(cq, cq, null_mut());
    let r = ch.recv();
    let (peer, raddr, rkey) = (r[0] as u32, r[1], r[2] as u32);
    ch.send(&format!("{} {}", qpn(qp), qpn(qp2)));
    connect(qp, peer);
    connect(qp2, r[3] as u32);
    let _ready = ch.recv();
    let mut src = Buf::new(&dev, HALF, 0);
    src.data[..100].copy_from_slice(&pattern(1, 100));
    let s = Send {
        imm: 0xabcdu32.to_be(),
        ..send(WR_SEND_IMM, SIGNALED)
    };
    assert_eq!(post_send(qp, &src, 0, 100, 1, s), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    src.data.copy_from_slice(&pattern(2, HALF));
    let w = Send {
        remote_addr: raddr,
        rkey,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(qp, &src, 0, HALF as u32, 2, w), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    let back = Buf::new(&dev, HALF, 0);
    let rd = Send {
        remote_addr: raddr + HALF as u64,
        rkey,
        ..send(WR_READ, SIGNALED)
    };
    assert_eq!(post_send(qp, &back, 0, HALF as u32, 3, rd), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert!(
        back.data == pattern(3, HALF),
        "cross-process RDMA READ payload differs"
    );
    let wi = Send {
        imm: 7u32.to_be(),
        remote_addr: raddr,
        rkey,
        ..send(WR_WRITE_IMM, SIGNALED)
    };
    assert_eq!(post_send(qp, &src, 0, 0, 4, wi), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    // A bad rkey and an out-of-bounds READ are remote access errors here and
    // harm neither process.
    let bad = Send {
        remote_addr: raddr,
        rkey: rkey ^ 0x0100_0000,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(qp, &src, 0, 8, 5, bad), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_REM_ACCESS);
    // Out of bounds: a READ running past the end of the responder's region.
    let oob = Send {
        remote_addr: raddr + 2 * HALF as u64 - 8,
        rkey,
        ..send(WR_READ, SIGNALED)
    };
    assert_eq!(post_send(qp2, &back, 0, 64, 6, oob), 0);
    let c = poll(cq, 1)[0];
    assert_eq!((c.wr_id, c.status), (6, WC_REM_ACCESS));
    ch.send("1");
}

#[test]
fn cross_process_srq_events_and_overflow() {
    if let Some(ch) = child_chan() {
        return sender(ch);
    }
    if !launcher_or_skip("cross_process_srq_events_and_overflow") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_srq_events_and_overflow");
    let dev = Dev::open();
    let chan = dev.channel();
    let rcq = dev.cq(64, chan);
    let scq = dev.cq(64, null_mut());
    let small = dev.cq(4, null_mut());
    let cap = unsafe { (*small).cqe } as u64;
    let srq = dev.srq(16);
    let buf = Buf::new(&dev, 64 * 16, 0);
    for i in 0..16 {
        post_srq_recv(srq, &buf, i * 64, 64, i as u64);
    }
    let q1 = dev.qp(scq, rcq, srq);
    let q2 = dev.qp(scq, rcq, srq);
    let q3 = dev.qp(scq, small, null_mut());
    ch.send(&format!("{} {} {} {}", qpn(q1), qpn(q2), qpn(q3), cap));
    let p = ch.recv();
    connect(q1, p[0] as u32);
    connect(q2, p[1] as u32);
    connect(q3, p[2] as u32);
    for i in 0..=cap {
        post_recv(q3, &buf, 0, 64, 100 + i);
    }
    assert_eq!(unsafe { ibv_req_notify_cq(rcq, 1) }, 0);
    ch.send("ready");
    assert_eq!(ch.recv(), vec![1]);
    assert!(
        !readable(chan, 100),
        "solicited-only arm fired on an unsolicited send from the peer"
    );
    ch.send("next");
    assert!(
        readable(chan, 5000),
        "no event for the peer's solicited send"
    );
    get_event(chan, rcq);
    let got = poll(rcq, 2);
    assert_eq!(
        got.iter().map(|w| w.qp_num).collect::<Vec<_>>(),
        vec![qpn(q1), qpn(q2)]
    );
    assert_eq!(ch.recv(), vec![2]);
    let afd = unsafe { (*dev.ctx).async_fd };
    assert!(
        fd_readable(afd, 5000),
        "no async CQ_ERR after the peer overfilled the CQ"
    );
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_get_async_event(dev.ctx, &mut ev) }, 0);
    assert_eq!(
        unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) },
        0
    );
    assert_eq!(unsafe { ev.element.cq }, small);
    unsafe { ibv_ack_async_event(&mut ev) };
    assert!(
        child.wait().expect("wait").success(),
        "sender process failed"
    );
}

fn sender(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let r = ch.recv();
    let qps: Vec<_> = (0..3).map(|_| dev.qp(cq, cq, null_mut())).collect();
    ch.send(&format!("{} {} {}", qpn(qps[0]), qpn(qps[1]), qpn(qps[2])));
    for (q, peer) in qps.iter().zip(&r) {
        connect(*q, *peer as u32);
    }
    let cap = r[3];
    let _ready = ch.recv();
    let src = Buf::new(&dev, 64, 1);
    assert_eq!(post_send(qps[0], &src, 0, 8, 1, send(WR_SEND, 0)), 0);
    ch.send("1");
    let _next = ch.recv();
    assert_eq!(
        post_send(qps[1], &src, 0, 8, 2, send(WR_SEND, SOLICITED)),
        0
    );
    for i in 0..=cap {
        assert_eq!(post_send(qps[2], &src, 0, 8, 10 + i, send(WR_SEND, 0)), 0);
    }
    ch.send("2");
}

/// `softverbs_inject_device_fatal`, found as applications find it.
fn inject_device_fatal(ctx: *mut ibv_context) -> i32 {
    let p = unsafe {
        libc::dlsym(
            libc::RTLD_DEFAULT,
            c"softverbs_inject_device_fatal".as_ptr(),
        )
    };
    assert!(!p.is_null(), "softverbs_inject_device_fatal not found");
    let f: unsafe extern "C" fn(*mut ibv_context) -> i32 = unsafe { std::mem::transmute(p) };
    unsafe { f(ctx) }
}

#[test]
fn cross_process_peer_of_dead_context_gets_retry_exceeded() {
    if let Some(ch) = child_chan() {
        return peer_of_dead(ch);
    }
    if !launcher_or_skip("cross_process_peer_of_dead_context_gets_retry_exceeded") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_peer_of_dead_context_gets_retry_exceeded");
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let q1 = dev.qp(cq, cq, null_mut());
    let q2 = dev.qp(cq, cq, null_mut());
    let target = Buf::new(&dev, 64, 0);
    ch.send(&format!(
        "{} {} {} {}",
        qpn(q1),
        qpn(q2),
        target.addr(),
        target.rkey()
    ));
    let p = ch.recv();
    connect(q1, p[0] as u32);
    connect(q2, p[1] as u32);
    post_recv(q1, &target, 0, 8, 1);
    ch.send("ready");
    // The peer's first send arrived; its second waits for a receive.
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(ch.recv(), vec![1]);
    assert_eq!(inject_device_fatal(dev.ctx), 0);
    ch.send("dead");
    assert_eq!(ch.recv(), vec![2], "peer saw RETRY_EXC_ERR");
    assert!(child.wait().expect("wait").success(), "peer process failed");
    assert!(
        target.data[8..].iter().all(|&b| b == 0),
        "nothing written after death"
    );
    for q in [q1, q2] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
}

fn peer_of_dead(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let r = ch.recv();
    let (q1, q2) = (dev.qp(cq, cq, null_mut()), dev.qp(cq, cq, null_mut()));
    ch.send(&format!("{} {}", qpn(q1), qpn(q2)));
    connect(q1, r[0] as u32);
    connect(q2, r[1] as u32);
    let (raddr, rkey) = (r[2], r[3] as u32);
    let _ready = ch.recv();
    let src = Buf::new(&dev, 64, 9);
    assert_eq!(post_send(q1, &src, 0, 8, 1, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(post_send(q1, &src, 0, 8, 2, send(WR_SEND, SIGNALED)), 0);
    ch.send("1");
    let _dead = ch.recv();
    let w = poll(cq, 1)[0];
    assert_eq!(
        (w.wr_id, w.status),
        (2, ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
        "the send waiting when the peer's device died"
    );
    let wr = Send {
        remote_addr: raddr + 8,
        rkey,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(q2, &src, 0, 8, 3, wr), 0);
    let w = poll(cq, 1)[0];
    assert_eq!(
        (w.wr_id, w.status),
        (3, ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
        "a WRITE after death"
    );
    ch.send("2");
}

/// The transport timeout the dead-peer test's QPs use: local ACK timeout
/// 10 (4.096 µs × 2^10) and retry_cnt 3, i.e. four tries.
const DEAD_TIMEOUT: u8 = 10;
const DEAD_RETRY: u8 = 3;

fn dead_peer_transport_timeout() -> std::time::Duration {
    std::time::Duration::from_nanos(4096 * (1 << DEAD_TIMEOUT) * (DEAD_RETRY as u64 + 1))
}

/// A responder process that dies (no destroy, no cleanup) never answers
/// again: as on an RC QP of hardware, the requester's WR completes with
/// `IBV_WC_RETRY_EXC_ERR` once the QP's transport timeout (4.096 µs ×
/// 2^timeout per try, retry_cnt + 1 tries) has passed since the peer fell
/// silent — not at once with a remote error (a receive was still posted in
/// the dead process), and not never (a send waiting for a receive when the
/// peer died). The WRs behind it flush, in order.
#[test]
fn cross_process_dead_peer_gets_retry_exceeded_after_transport_timeout() {
    if let Some(ch) = child_chan() {
        return dying_peer(ch);
    }
    if !launcher_or_skip("cross_process_dead_peer_gets_retry_exceeded_after_transport_timeout") {
        return;
    }
    let (mut child, mut ch) =
        spawn("cross_process_dead_peer_gets_retry_exceeded_after_transport_timeout");
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let q1 = dev.qp(cq, cq, null_mut());
    let q2 = dev.qp(cq, cq, null_mut());
    ch.send(&format!("{} {}", qpn(q1), qpn(q2)));
    let p = ch.recv();
    connect_with(q1, p[0] as u32, DEAD_TIMEOUT, DEAD_RETRY);
    connect_with(q2, p[1] as u32, DEAD_TIMEOUT, DEAD_RETRY);
    let _ready = ch.recv();
    let src = Buf::new(&dev, 64, 5);
    // q2's peer has no receive: the SEND waits (RNR) while the peer lives.
    assert_eq!(post_send(q2, &src, 0, 8, 10, send(WR_SEND, SIGNALED)), 0);
    poll_none(cq, std::time::Duration::from_millis(50));
    ch.send("die");
    assert!(child.wait().expect("wait").success(), "peer process failed");
    let died = std::time::Instant::now();
    // q1's peer left a receive posted in its (dead) ring.
    for id in 1..=3 {
        assert_eq!(post_send(q1, &src, 0, 8, id, send(WR_SEND, SIGNALED)), 0);
    }
    let wcs = poll(cq, 4);
    let elapsed = died.elapsed();
    let of = |q: *mut ibv_qp| -> Vec<(u64, u32)> {
        wcs.iter()
            .filter(|w| w.qp_num == qpn(q))
            .map(|w| (w.wr_id, w.status))
            .collect()
    };
    assert_eq!(
        of(q1),
        vec![
            (1, ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
            (2, ibv_wc_status::IBV_WC_WR_FLUSH_ERR),
            (3, ibv_wc_status::IBV_WC_WR_FLUSH_ERR),
        ],
        "the first WR times out, the others flush behind it"
    );
    assert_eq!(
        of(q2),
        vec![(10, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)],
        "the SEND that waited for a receive when the peer died"
    );
    assert!(
        elapsed >= dead_peer_transport_timeout(),
        "RETRY_EXC_ERR after {elapsed:?}, before the transport timeout {:?}",
        dead_peer_transport_timeout()
    );
    for q in [q1, q2] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
}

fn dying_peer(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let r = ch.recv();
    let (q1, q2) = (dev.qp(cq, cq, null_mut()), dev.qp(cq, cq, null_mut()));
    ch.send(&format!("{} {}", qpn(q1), qpn(q2)));
    connect_with(q1, r[0] as u32, DEAD_TIMEOUT, DEAD_RETRY);
    connect_with(q2, r[1] as u32, DEAD_TIMEOUT, DEAD_RETRY);
    let dst = Buf::new(&dev, 64, 0);
    post_recv(q1, &dst, 0, 64, 1);
    ch.send("ready");
    let _die = ch.recv();
    // Gone without a word: no destroy, no close, no exit handlers.
    unsafe { libc::_exit(0) };
}

/// Read one async event of `ctx` (within 5 s), check type and element, ack.
fn expect_async(ctx: *mut ibv_context, ty: u32, element: usize) {
    assert!(
        fd_readable(unsafe { (*ctx).async_fd }, 5000),
        "no async event (wanted type {ty})"
    );
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_get_async_event(ctx, &mut ev) }, 0);
    let got = unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) };
    assert_eq!(
        (got, unsafe { ev.element.qp } as usize),
        (ty, element),
        "event type and element"
    );
    unsafe { ibv_ack_async_event(&mut ev) };
}

#[test]
fn cross_process_responder_events_reach_the_owner() {
    if let Some(ch) = child_chan() {
        return violator(ch);
    }
    if !launcher_or_skip("cross_process_responder_events_reach_the_owner") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_responder_events_reach_the_owner");
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let srq = dev.srq(16);
    let buf = Buf::new(&dev, 64, 0);
    post_srq_recv(srq, &buf, 0, 32, 1);
    post_srq_recv(srq, &buf, 32, 32, 2);
    let mut a: ibv_srq_attr = unsafe { std::mem::zeroed() };
    a.srq_limit = 2;
    let m = ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32;
    assert_eq!(unsafe { ibv_modify_srq(srq, &mut a, m) }, 0);
    let q1 = dev.qp(cq, cq, null_mut());
    let q2 = dev.qp(cq, cq, srq);
    ch.send(&format!(
        "{} {} {} {}",
        qpn(q1),
        qpn(q2),
        buf.addr(),
        buf.rkey()
    ));
    let p = ch.recv();
    connect(q1, p[0] as u32);
    connect(q2, p[1] as u32);
    ch.send("ready");
    assert_eq!(ch.recv(), vec![1], "requester finished");
    // The records were written by the requester's process into this
    // process's async pipe, naming this process's objects.
    expect_async(dev.ctx, 15, srq as usize); // SRQ_LIMIT_REACHED
    expect_async(dev.ctx, 3, q1 as usize); // QP_ACCESS_ERR
    expect_async(dev.ctx, 3, q2 as usize); // QP_ACCESS_ERR
    expect_async(dev.ctx, 16, q2 as usize); // QP_LAST_WQE_REACHED
    assert!(!fd_readable(unsafe { (*dev.ctx).async_fd }, 50));
    assert!(
        child.wait().expect("wait").success(),
        "requester process failed"
    );
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS, "the SEND via the SRQ");
    for q in [q1, q2] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_srq(srq) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
}

fn violator(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let r = ch.recv();
    let (q1, q2) = (dev.qp(cq, cq, null_mut()), dev.qp(cq, cq, null_mut()));
    ch.send(&format!("{} {}", qpn(q1), qpn(q2)));
    connect(q1, r[0] as u32);
    connect(q2, r[1] as u32);
    let (raddr, rkey) = (r[2], r[3] as u32);
    let _ready = ch.recv();
    let src = Buf::new(&dev, 64, 9);
    // One receive taken from the SRQ armed at 2: one left, below the limit.
    assert_eq!(post_send(q2, &src, 0, 8, 1, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    for (i, q) in [q1, q2].into_iter().enumerate() {
        let bad = Send {
            remote_addr: raddr,
            rkey: rkey ^ 0x0100_0000,
            ..send(WR_WRITE, SIGNALED)
        };
        assert_eq!(post_send(q, &src, 0, 8, 2 + i as u64, bad), 0);
        assert_eq!(poll(cq, 1)[0].status, WC_REM_ACCESS);
    }
    ch.send("1");
}

const ATOMIC_EACH: u64 = 20_000;

/// Fetch-and-adds on one word from this process (through its own loopback
/// QPs: the same-process path) and from another process (process_vm_*) at
/// the same time: no update is lost and every original value is returned
/// exactly once, so the two paths are atomic with respect to each other.
#[test]
fn cross_process_atomics_are_atomic_among_processes() {
    if let Some(ch) = child_chan() {
        return atomic_adder(ch);
    }
    if !launcher_or_skip("cross_process_atomics_are_atomic_among_processes") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_atomics_are_atomic_among_processes");
    let dev = Dev::open();
    let target = Buf::with_access(&dev, 64, 0, ACCESS_ATOMIC);
    let cq = dev.cq(64, null_mut());
    let responder = dev.qp(cq, cq, null_mut());
    // Our own requester toward a loopback responder of ours.
    let lcq = dev.cq(64, null_mut());
    let la = dev.qp(lcq, lcq, null_mut());
    let lb = dev.qp(lcq, lcq, null_mut());
    connect_full(la, qpn(lb), 14, 7, ACCESS_ATOMIC);
    connect_full(lb, qpn(la), 14, 7, ACCESS_ATOMIC);
    ch.send(&format!(
        "{} {} {}",
        qpn(responder),
        target.addr() + 8,
        target.rkey()
    ));
    let peer = ch.recv()[0] as u32;
    connect_full(responder, peer, 14, 7, ACCESS_ATOMIC);
    ch.send("go");
    let local = Buf::new(&dev, 8, 0);
    let mut seen = Vec::new();
    for i in 0..ATOMIC_EACH {
        let r = post_atomic(
            la,
            &local,
            0,
            i,
            WR_FETCH_ADD,
            target.addr() + 8,
            target.rkey(),
            1,
            0,
        );
        assert_eq!(r, 0);
        assert_eq!(poll(lcq, 1)[0].status, WC_SUCCESS);
        seen.push(word(&local, 0));
    }
    seen.extend(ch.recv());
    assert!(
        child.wait().expect("wait").success(),
        "adder process failed"
    );
    assert_eq!(word(&target, 8), 2 * ATOMIC_EACH, "no lost update");
    assert_eq!((word(&target, 0), word(&target, 16)), (0, 0));
    seen.sort_unstable();
    assert!(
        seen == (0..2 * ATOMIC_EACH).collect::<Vec<_>>(),
        "each original value returned once"
    );
}

fn atomic_adder(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let qp = dev.qp(cq, cq, null_mut());
    let r = ch.recv();
    let (peer, raddr, rkey) = (r[0] as u32, r[1], r[2] as u32);
    ch.send(&format!("{}", qpn(qp)));
    connect_full(qp, peer, 14, 7, ACCESS_ATOMIC);
    let _go = ch.recv();
    let local = Buf::new(&dev, 8, 0);
    let mut seen = Vec::new();
    for i in 0..ATOMIC_EACH {
        assert_eq!(
            post_atomic(qp, &local, 0, i, WR_FETCH_ADD, raddr, rkey, 1, 0),
            0
        );
        let c = poll(cq, 1)[0];
        assert_eq!(
            (c.status, c.opcode, c.byte_len),
            (WC_SUCCESS, ibv_wc_opcode::IBV_WC_FETCH_ADD, 8)
        );
        seen.push(word(&local, 0));
    }
    // A compare that cannot match returns the word and leaves it.
    assert_eq!(
        post_atomic(qp, &local, 0, 99, WR_CMP_SWAP, raddr, rkey, u64::MAX, 0),
        0
    );
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert!(word(&local, 0) >= ATOMIC_EACH, "read after our own adds");
    let line: Vec<String> = seen.iter().map(u64::to_string).collect();
    ch.send(&line.join(" "));
}

/// A UD exchange between two processes: the datagram lands after its GRH
/// in the receiver's process, the completion names the sender's QP, and
/// the receiver answers through an address handle to that source.
#[test]
fn cross_process_ud_datagrams() {
    if let Some(ch) = child_chan() {
        return ud_peer(ch);
    }
    if !launcher_or_skip("cross_process_ud_datagrams") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_ud_datagrams");
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let qp = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut());
    ud_up(qp, 0x4242);
    let dst = Buf::new(&dev, 4 * 1064, 0xee);
    for i in 0..4 {
        post_recv(qp, &dst, i * 1064, 1064, i as u64);
    }
    ch.send(&format!("{}", qpn(qp)));
    let peer = ch.recv()[0] as u32;
    let r = poll(cq, 3);
    for (i, c) in r.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.status, c.byte_len, c.src_qp, c.slid),
            (i as u64, WC_SUCCESS, 40 + 1024, peer, 1)
        );
        assert_eq!(
            c.wc_flags & ibv_wc_flags::IBV_WC_GRH.0,
            ibv_wc_flags::IBV_WC_GRH.0
        );
        let b = &dst.data[i * 1064..(i + 1) * 1064];
        assert_eq!(b[6], 0x1b, "GRH next header");
        assert_eq!(&b[40..], &pattern(i as u8, 1024)[..]);
    }
    // Answer the source the completion names (ibv_ud_pingpong-style).
    let ah = create_ah(&dev, 0, None);
    let src = Buf::new(&dev, 16, 0x3c);
    assert_eq!(
        post_ud(qp, &src, 0, 16, 9, ah, r[0].src_qp, 0x4242, Some(1)),
        0
    );
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(ch.recv(), vec![1], "peer got the answer");
    assert!(child.wait().expect("wait").success(), "UD peer failed");
    unsafe { ibv_destroy_ah(ah) };
}

fn ud_peer(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(64, null_mut());
    let qp = dev.qp_of(ibv_qp_type::IBV_QPT_UD, cq, cq, null_mut());
    ud_up(qp, 0x4242);
    let back = Buf::new(&dev, 56, 0);
    post_recv(qp, &back, 0, 56, 7);
    let peer = ch.recv()[0] as u32;
    ch.send(&format!("{}", qpn(qp)));
    let mut g: ibv_global_route = unsafe { std::mem::zeroed() };
    g.hop_limit = 1;
    let ah = create_ah(&dev, 0, Some(g));
    let mut src = Buf::new(&dev, 3 * 1024, 0);
    for i in 0..3 {
        src.data[i * 1024..(i + 1) * 1024].copy_from_slice(&pattern(i as u8, 1024));
        assert_eq!(
            post_ud(qp, &src, i * 1024, 1024, i as u64, ah, peer, 0x4242, None),
            0
        );
        assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    }
    let r = poll(cq, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.byte_len, r.src_qp),
        (7, WC_SUCCESS, 56, peer)
    );
    assert!(back.data[40..].iter().all(|&b| b == 0x3c));
    unsafe { ibv_destroy_ah(ah) };
    ch.send("1");
}

/// A peer process keeps completing into a CQ its owner grew with
/// `ibv_resize_cq`: it follows the chain to the new ring, and the owner
/// polls everything in order.
#[test]
fn cross_process_peer_follows_a_resized_cq() {
    if let Some(mut ch) = child_chan() {
        let dev = Dev::open();
        let cq = dev.cq(16, null_mut());
        let qp = dev.qp(cq, cq, null_mut());
        let peer = ch.recv()[0] as u32;
        ch.send(&format!("{}", qpn(qp)));
        connect(qp, peer);
        let src = Buf::new(&dev, 64, 9);
        for round in 0..2u64 {
            let _go = ch.recv();
            let (from, to) = if round == 0 { (0, 2) } else { (2, 32) };
            for id in from..to {
                assert_eq!(post_send(qp, &src, 0, 8, id, send(WR_SEND, SIGNALED)), 0);
                assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
            }
            ch.send("1");
        }
        return;
    }
    if !launcher_or_skip("cross_process_peer_follows_a_resized_cq") {
        return;
    }
    let (mut child, mut ch) = spawn("cross_process_peer_follows_a_resized_cq");
    let dev = Dev::open();
    let scq = dev.cq(4, null_mut());
    let rcq = dev.cq(2, null_mut());
    let qp = dev.qp(scq, rcq, null_mut());
    ch.send(&format!("{}", qpn(qp)));
    let peer = ch.recv()[0] as u32;
    connect(qp, peer);
    let buf = Buf::new(&dev, 64, 0);
    for id in 0..32 {
        post_recv(qp, &buf, 0, 64, id);
    }
    // The child maps the CQ as it is (two entries), and fills it.
    ch.send("go");
    assert_eq!(ch.recv(), vec![1]);
    assert_eq!(
        unsafe { ibv_resize_cq(rcq, 1) },
        libc::EINVAL,
        "two waiting"
    );
    assert_eq!(unsafe { ibv_resize_cq(rcq, 64) }, 0);
    ch.send("go");
    assert_eq!(ch.recv(), vec![1]);
    let ids: Vec<u64> = poll(rcq, 32).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, (0..32).collect::<Vec<u64>>());
    assert!(child.wait().expect("wait").success(), "peer process failed");
}

/// XRC across processes: the domain is named by a file both processes
/// open; the XRC SRQ (and its regions) in one, the XRC_RECV QP in the
/// other, the requester beside the SRQ.
#[test]
fn cross_process_xrc_domain_shared_by_file() {
    if let Some(mut ch) = child_chan() {
        // The parent named the file after itself.
        let file =
            std::fs::File::open(xrc_file(unsafe { libc::getppid() } as u32)).expect("domain file");
        let dev = Dev::open();
        let xrcd = open_xrcd(&dev, file.as_raw_fd());
        assert!(!xrcd.is_null());
        let recv = xrc_recv_qp(&dev, xrcd);
        let sender = ch.recv()[0] as u32;
        ch.send(&format!("{}", qpn(recv)));
        connect(recv, sender);
        ch.send("up");
        let _done = ch.recv();
        assert_eq!(unsafe { ibv_destroy_qp(recv) }, 0);
        return;
    }
    if !launcher_or_skip("cross_process_xrc_domain_shared_by_file") {
        return;
    }
    let path = xrc_file(std::process::id());
    let file = std::fs::File::create(&path).expect("domain file");
    let (mut child, mut ch) = spawn("cross_process_xrc_domain_shared_by_file");
    let dev = Dev::open();
    let xrcd = open_xrcd(&dev, file.as_raw_fd());
    assert!(!xrcd.is_null());
    let srq_cq = dev.cq(16, null_mut());
    let (srq, srqn) = xrc_srq(&dev, xrcd, srq_cq);
    let send_cq = dev.cq(16, null_mut());
    let sender = dev.qp_of(
        ibv_qp_type::IBV_QPT_XRC_SEND,
        send_cq,
        null_mut(),
        null_mut(),
    );
    ch.send(&format!("{}", qpn(sender)));
    let recv = ch.recv()[0] as u32;
    connect(sender, recv);
    let _up = ch.recv();
    let src = Buf::new(&dev, 16, 0x77);
    let dst = Buf::new(&dev, 16, 0);
    post_srq_recv(srq, &dst, 0, 16, 5);
    let mut sge = ibv_sge {
        addr: src.addr(),
        length: 16,
        lkey: src.lkey(),
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 1;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = WR_SEND;
    wr.send_flags = SIGNALED;
    wr.qp_type.xrc.remote_srqn = srqn;
    let mut bad = null_mut();
    assert_eq!(unsafe { ibv_post_send(sender, &mut wr, &mut bad) }, 0);
    assert_eq!(poll(send_cq, 1)[0].status, WC_SUCCESS);
    let r = poll(srq_cq, 1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].qp_num),
        (5, WC_SUCCESS, recv)
    );
    assert_eq!(&dst.data[..], &[0x77; 16]);
    ch.send("done");
    assert!(
        child.wait().expect("wait").success(),
        "target process failed"
    );
    drop(file);
    let _ = std::fs::remove_file(&path);
}

/// The file naming the XRC domain of the test run by process `pid`.
fn xrc_file(pid: u32) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("softverbs-xrc-cp-{pid}"))
}

fn xrc_vctx(ctx: *mut ibv_context) -> *mut verbs_context {
    unsafe {
        let off = std::mem::offset_of!(verbs_context, context);
        ctx.cast::<u8>().sub(off).cast::<verbs_context>()
    }
}

fn open_xrcd(dev: &Dev, fd: i32) -> *mut ibv_xrcd {
    let f = unsafe { (*xrc_vctx(dev.ctx)).open_xrcd.expect("open_xrcd slot") };
    let mut a = ibv_xrcd_init_attr {
        comp_mask: (ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_FD.0
            | ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_OFLAGS.0),
        fd,
        oflags: libc::O_CREAT,
    };
    unsafe { f(dev.ctx, &mut a) }
}

fn xrc_srq(dev: &Dev, xrcd: *mut ibv_xrcd, cq: *mut ibv_cq) -> (*mut ibv_srq, u32) {
    let f = unsafe {
        (*xrc_vctx(dev.ctx))
            .create_srq_ex
            .expect("create_srq_ex slot")
    };
    let mut a: ibv_srq_init_attr_ex = unsafe { std::mem::zeroed() };
    a.attr.max_wr = 16;
    a.attr.max_sge = 1;
    a.comp_mask = ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0
        | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0
        | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_XRCD.0
        | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_CQ.0;
    a.srq_type = ibv_srq_type::IBV_SRQT_XRC;
    a.pd = dev.pd;
    a.xrcd = xrcd;
    a.cq = cq;
    let srq = unsafe { f(dev.ctx, &mut a) };
    assert!(!srq.is_null());
    let num = unsafe { (*xrc_vctx(dev.ctx)).get_srq_num.expect("get_srq_num slot") };
    let mut n = 0;
    assert_eq!(unsafe { num(srq, &mut n) }, 0);
    (srq, n)
}

fn xrc_recv_qp(dev: &Dev, xrcd: *mut ibv_xrcd) -> *mut ibv_qp {
    let f = unsafe {
        (*xrc_vctx(dev.ctx))
            .create_qp_ex
            .expect("create_qp_ex slot")
    };
    let mut a: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    a.qp_type = ibv_qp_type::IBV_QPT_XRC_RECV;
    a.comp_mask = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_XRCD.0;
    a.xrcd = xrcd;
    let qp = unsafe { f(dev.ctx, &mut a) };
    assert!(!qp.is_null());
    qp
}
