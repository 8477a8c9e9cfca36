//! What `ibv_destroy_qp` takes back, as rdma-core's mlx5 provider does
//! (`mlx5_destroy_qp`, `__mlx5_cq_clean`): the destroyed QP's completions
//! not yet polled leave its CQs, and the other QPs' completions on those
//! CQs stay, in order; on an SRQ, the receives it consumed hold no slot of
//! the SRQ, the one a requester that died took for it included. And
//! `IBV_EVENT_QP_LAST_WQE_REACHED` comes after every receive completion of
//! its QP, so that a consumer that reads it and then polls the CQ until it
//! is empty (the kernel's `__ib_drain_srq`) has seen them all.
//!
//! No test waits for a time to pass: each waits for what it needs (a
//! completion, an event, a line from the other process), with a bound
//! that fails it. Run under `softverbs-run`; skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::child::{child_chan, kill_and_wait_dead, spawn, spawn_env, wait_stopped, Chan};
use common::*;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Short transport timeout (4.096 µs × 2^10 × 4 ≈ 17 ms): a request to a
/// QP that is gone or in ERR gives up quickly.
const SHORT_TIMEOUT: u8 = 10;
const SHORT_RETRY: u8 = 3;

/// `enum ibv_event_type`'s `IBV_EVENT_QP_LAST_WQE_REACHED`.
const QP_LAST_WQE_REACHED: u32 = 16;

const RECV: u32 = ibv_wc_opcode::IBV_WC_RECV;
const SEND: u32 = ibv_wc_opcode::IBV_WC_SEND;

/// An RC QP with queues of `depth` work requests.
fn qp_with(
    dev: &Dev,
    scq: *mut ibv_cq,
    rcq: *mut ibv_cq,
    srq: *mut ibv_srq,
    depth: u32,
) -> *mut ibv_qp {
    let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    a.send_cq = scq;
    a.recv_cq = rcq;
    a.srq = srq;
    a.qp_type = ibv_qp_type::IBV_QPT_RC;
    a.cap.max_send_wr = depth;
    a.cap.max_recv_wr = depth;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    let qp = unsafe { ibv_create_qp(dev.pd, &mut a) };
    assert!(!qp.is_null(), "create_qp");
    qp
}

/// What a test compares of a completion: (QP number, wr_id, status, opcode).
fn key(w: &Wc) -> (u32, u64, u32, u32) {
    (w.qp_num, w.wr_id, w.status, w.opcode)
}

/// Everything `cq` holds now: polled until a poll finds nothing.
fn drain(cq: *mut ibv_cq) -> Vec<Wc> {
    let mut out = Vec::new();
    loop {
        let mut wc: [ibv_wc; 16] = unsafe { std::mem::zeroed() };
        let n = unsafe { ibv_poll_cq(cq, 16, wc.as_mut_ptr()) };
        assert!(n >= 0, "poll_cq failed");
        if n == 0 {
            return out;
        }
        out.extend(wc[..n as usize].iter().map(Wc::from));
    }
}

/// `ibv_post_srq_recv` of one receive, its return code.
fn try_post_srq_recv(srq: *mut ibv_srq, buf: &Buf, wr_id: u64) -> i32 {
    let mut sge = ibv_sge {
        addr: buf.addr(),
        length: 64,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = null_mut();
    unsafe { ibv_post_srq_recv(srq, &mut wr, &mut bad) }
}

/// The SRQ's capacity as granted (`max_wr` rounded up).
fn srq_capacity(srq: *mut ibv_srq) -> u64 {
    let mut a: ibv_srq_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_srq(srq, &mut a) }, 0);
    u64::from(a.max_wr)
}

/// One signaled SEND of 8 bytes from `qp`, which must complete with
/// success on `cq` (the receive's completion is added before it).
fn send_ok(qp: *mut ibv_qp, cq: *mut ibv_cq, buf: &Buf, wr_id: u64) {
    assert_eq!(post_send(qp, buf, 0, 8, wr_id, send(WR_SEND, SIGNALED)), 0);
    let w = poll(cq, 1);
    assert_eq!((w[0].wr_id, w[0].status), (wr_id, WC_SUCCESS));
}

/// Destroy `b`, whose completions lie in its CQs between those of `d`,
/// another QP on the same CQs, with `b`'s receives flushed in the middle:
/// afterwards the CQs hold exactly `d`'s completions, in the order they
/// were added. `split`: `b` and `d` send to one CQ and receive into
/// another (both are cleaned), else one CQ holds everything.
fn destroy_between_another_qps_completions(split: bool) {
    let dev = Dev::open();
    let scq = dev.cq(64, null_mut());
    let rcq = if split { dev.cq(64, null_mut()) } else { scq };
    // The peers `a` (of `b`) and `c` (of `d`): a send CQ each, polled
    // here, and one receive CQ, never looked at.
    let (ca, cc) = (dev.cq(16, null_mut()), dev.cq(16, null_mut()));
    let peers_rcq = dev.cq(64, null_mut());
    let b = dev.qp(scq, rcq, null_mut());
    let d = dev.qp(scq, rcq, null_mut());
    let a = dev.qp(ca, peers_rcq, null_mut());
    let c = dev.qp(cc, peers_rcq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    connect(c, qpn(d));
    connect(d, qpn(c));
    let buf = Buf::new(&dev, 256, 1);
    for i in 0..8 {
        post_recv(b, &buf, 0, 64, 10 + i);
        post_recv(d, &buf, 0, 64, 20 + i);
        post_recv(a, &buf, 0, 64, 30 + i);
        post_recv(c, &buf, 0, 64, 40 + i);
    }
    let dn = qpn(d);
    // What `d` adds, in order, to its send CQ and to its receive CQ (one
    // list when they are one CQ). softverbs adds a request's completions
    // inside `ibv_post_send`, so the order is known. `b`'s and `d`'s own
    // SENDs are posted, not polled: their CQ is polled only after the
    // destroy.
    let (mut want_s, mut want_r) = (Vec::new(), Vec::new());
    let mut expect = |w: (u32, u64, u32, u32)| {
        if split && w.3 == RECV {
            want_r.push(w);
        } else {
            want_s.push(w);
        }
    };
    let post = |qp, wr| assert_eq!(post_send(qp, &buf, 0, 8, wr, send(WR_SEND, SIGNALED)), 0);
    send_ok(a, ca, &buf, 1); // b: receive 10
    send_ok(c, cc, &buf, 2);
    expect((dn, 20, WC_SUCCESS, RECV));
    post(b, 50); // b: send 50
    post(d, 60);
    expect((dn, 60, WC_SUCCESS, SEND));
    send_ok(a, ca, &buf, 3); // b: receive 11
    post(b, 51); // b: send 51
    send_ok(c, cc, &buf, 4);
    expect((dn, 21, WC_SUCCESS, RECV));
    post(d, 61);
    expect((dn, 61, WC_SUCCESS, SEND));
    to_error(b); // b: receives 12 to 17 flushed
    send_ok(c, cc, &buf, 5);
    expect((dn, 22, WC_SUCCESS, RECV));
    post(d, 62);
    expect((dn, 62, WC_SUCCESS, SEND));
    let b_num = qpn(b);
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    let got_s: Vec<_> = drain(scq).iter().map(key).collect();
    assert_eq!(got_s, want_s, "the send CQ after b's destroy");
    if split {
        let got_r: Vec<_> = drain(rcq).iter().map(key).collect();
        assert_eq!(got_r, want_r, "the receive CQ after b's destroy");
    }
    assert!(!got_s.iter().any(|w| w.0 == b_num));
    // The CQs go on: d's next completion arrives, alone.
    send_ok(c, cc, &buf, 6);
    let next: Vec<_> = drain(rcq).iter().map(key).collect();
    assert_eq!(next, vec![(dn, 23, WC_SUCCESS, RECV)]);
    for q in [a, c, d] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    let mut cqs = vec![scq, ca, cc, peers_rcq];
    if split {
        cqs.push(rcq);
    }
    for cq in cqs {
        assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    }
}

#[test]
fn destroy_takes_its_completions_out_of_a_shared_cq() {
    if !launcher_or_skip("destroy_takes_its_completions_out_of_a_shared_cq") {
        return;
    }
    destroy_between_another_qps_completions(false);
}

#[test]
fn destroy_takes_its_completions_out_of_its_send_and_receive_cqs() {
    if !launcher_or_skip("destroy_takes_its_completions_out_of_its_send_and_receive_cqs") {
        return;
    }
    destroy_between_another_qps_completions(true);
}

/// `b` and `d` on one SRQ and one CQ: `b` consumed receives 0, 2 and 4, `d`
/// 1 and 3, none polled. After `b`'s destroy, the CQ holds `d`'s two
/// completions only, the SRQ takes `max_wr` receives again (not one more),
/// and `d` goes on with the SRQ's next receive in order.
#[test]
fn destroy_on_an_srq_leaves_its_receives_nowhere() {
    if !launcher_or_skip("destroy_on_an_srq_leaves_its_receives_nowhere") {
        return;
    }
    let dev = Dev::open();
    let srq = dev.srq(16);
    let cap = srq_capacity(srq);
    let rcq = dev.cq(64, null_mut());
    let (ca, cc) = (dev.cq(16, null_mut()), dev.cq(16, null_mut()));
    let b = dev.qp(rcq, rcq, srq);
    let d = dev.qp(rcq, rcq, srq);
    let a = dev.qp(ca, ca, null_mut());
    let c = dev.qp(cc, cc, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    connect(c, qpn(d));
    connect(d, qpn(c));
    let buf = Buf::new(&dev, 256, 1);
    for i in 0..cap {
        assert_eq!(try_post_srq_recv(srq, &buf, i), 0);
    }
    assert_eq!(try_post_srq_recv(srq, &buf, 999), libc::ENOMEM, "full");
    for i in 0..5 {
        let (qp, cq) = if i % 2 == 0 { (a, ca) } else { (c, cc) };
        send_ok(qp, cq, &buf, i);
    }
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    let got: Vec<_> = drain(rcq).iter().map(key).collect();
    assert_eq!(
        got,
        vec![(qpn(d), 1, WC_SUCCESS, RECV), (qpn(d), 3, WC_SUCCESS, RECV)]
    );
    for i in 0..5 {
        assert_eq!(try_post_srq_recv(srq, &buf, 100 + i), 0, "refill {i}");
    }
    assert_eq!(
        try_post_srq_recv(srq, &buf, 999),
        libc::ENOMEM,
        "full again"
    );
    send_ok(c, cc, &buf, 9);
    let got: Vec<_> = drain(rcq).iter().map(key).collect();
    assert_eq!(
        got,
        vec![(qpn(d), 5, WC_SUCCESS, RECV)],
        "the SRQ's order goes on"
    );
    for q in [a, c, d] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_srq(srq) }, 0);
    for cq in [rcq, ca, cc] {
        assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    }
}

/// The requester of [`destroy_releases_the_srq_receive_a_killed_requester_took`]:
/// connects to the parent's QP, answers with its own, and on "go" SENDs,
/// stopping itself right after it took an SRQ receive (the provider's
/// test hook `SOFTVERBS_TEST_STALL_AFTER_CLAIM`, src/shm/claim.rs).
fn stalling_requester(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(16, null_mut());
    let qp = dev.qp(cq, cq, null_mut());
    let peer = ch.recv()[0] as u32;
    ch.send(&qpn(qp).to_string());
    connect_with(qp, peer, SHORT_TIMEOUT, SHORT_RETRY);
    let _go = ch.recv();
    let src = Buf::new(&dev, 64, 9);
    post_send(qp, &src, 0, 8, 77, send(WR_SEND, SIGNALED));
    panic!("the stall hook did not stop the requester after its claim");
}

/// A requester killed right after it took an SRQ receive for `b`: `b` is
/// destroyed without going to ERR. The receive never completes anywhere,
/// and its slot is the SRQ's again — without the release, the SRQ's
/// producer would find it still taken one lap later and refuse every post
/// from then on (ENOMEM).
#[test]
fn destroy_releases_the_srq_receive_a_killed_requester_took() {
    const NAME: &str = "destroy_releases_the_srq_receive_a_killed_requester_took";
    if let Some(ch) = child_chan() {
        return stalling_requester(ch);
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let (mut child, mut ch) = spawn_env(NAME, &[("SOFTVERBS_TEST_STALL_AFTER_CLAIM", "1")]);
    let dev = Dev::open();
    let srq = dev.srq(4);
    let cap = srq_capacity(srq);
    let rcq = dev.cq(64, null_mut());
    let b = dev.qp(rcq, rcq, srq);
    ch.send(&qpn(b).to_string());
    let peer = ch.recv()[0] as u32;
    connect_with(b, peer, SHORT_TIMEOUT, SHORT_RETRY);
    let buf = Buf::new(&dev, 256, 0);
    assert_eq!(try_post_srq_recv(srq, &buf, 1), 0);
    ch.send("go");
    wait_stopped(&child);
    kill_and_wait_dead(&child);
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert!(!child.wait().expect("reap").success());
    // Another QP on the SRQ takes every receive posted from now on, for
    // more than two laps of the SRQ's ring.
    let cc = dev.cq(16, null_mut());
    let d = dev.qp(rcq, rcq, srq);
    let c = dev.qp(cc, cc, null_mut());
    connect(c, qpn(d));
    connect(d, qpn(c));
    for i in 0..2 * cap + 2 {
        assert_eq!(
            try_post_srq_recv(srq, &buf, 1000 + i),
            0,
            "post {i} of the SRQ"
        );
        send_ok(c, cc, &buf, i);
        let got: Vec<_> = drain(rcq).iter().map(key).collect();
        assert_eq!(
            got,
            vec![(qpn(d), 1000 + i, WC_SUCCESS, RECV)],
            "receive {i}"
        );
    }
    for q in [c, d] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_srq(srq) }, 0);
    for cq in [rcq, cc] {
        assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    }
}

/// Phase 1's SENDs to each of the parent's QPs.
const PHASE1: u64 = 300;
/// Phase 2's SENDs to `d` (while `b` is destroyed).
const PHASE2: u64 = 20_000;
/// `d`'s receive queue: reposted by the parent's poller as it polls.
const D_DEPTH: u64 = 1024;

/// The requester process of the test below: QP `qa` SENDs to the parent's
/// `b` and `qc` to its `d`, each from a thread of its own. Phase 1 (on
/// "go"): [`PHASE1`] SENDs on each, then "1". Phase 2 (on "go"): `qc`
/// SENDs [`PHASE2`] more while `qa` SENDs until one fails (`b` is gone);
/// then the number of `qa`'s successful SENDs.
fn two_stream_requester(mut ch: Chan) {
    let dev = Dev::open();
    let (ca, cc) = (dev.cq(16, null_mut()), dev.cq(16, null_mut()));
    let qa = dev.qp(ca, ca, null_mut());
    let qc = dev.qp(cc, cc, null_mut());
    let peers = ch.recv();
    ch.send(&format!("{} {}", qpn(qa), qpn(qc)));
    connect_with(qa, peers[0] as u32, SHORT_TIMEOUT, SHORT_RETRY);
    connect(qc, peers[1] as u32);
    let src = Buf::new(&dev, 64, 7);
    let src = SendPtr(std::ptr::addr_of!(src).cast_mut());
    let (qa, ca, qc, cc) = (SendPtr(qa), SendPtr(ca), SendPtr(qc), SendPtr(cc));
    // Each thread owns its QP and CQ; both read `src`, alive until the
    // scope ends.
    let to_d = move |from: u64, n: u64| {
        let (src, qc, cc) = (src, qc, cc);
        let src = unsafe { &*src.0 };
        for i in from..from + n {
            let s = Send {
                imm: i as u32,
                ..send(WR_SEND_IMM, SIGNALED)
            };
            assert_eq!(post_send(qc.0, src, 0, 8, i, s), 0);
            let w = poll(cc.0, 1);
            assert_eq!((w[0].wr_id, w[0].status), (i, WC_SUCCESS), "SEND {i} to d");
        }
    };
    let to_b = move |limit: Option<u64>| {
        let (src, qa, ca) = (src, qa, ca);
        let src = unsafe { &*src.0 };
        let mut ok = 0u64;
        while limit != Some(ok) {
            assert_eq!(post_send(qa.0, src, 0, 8, ok, send(WR_SEND, SIGNALED)), 0);
            if poll(ca.0, 1)[0].status != WC_SUCCESS {
                break;
            }
            ok += 1;
        }
        ok
    };
    let _go = ch.recv();
    let sent_b = std::thread::scope(|s| {
        let b = s.spawn(move || to_b(Some(PHASE1)));
        to_d(0, PHASE1);
        b.join().expect("phase 1 to b")
    });
    ch.send("1");
    let _go = ch.recv();
    let sent_b = sent_b
        + std::thread::scope(|s| {
            let b = s.spawn(move || to_b(None));
            to_d(PHASE1, PHASE2);
            b.join().expect("phase 2 to b")
        });
    ch.send(&sent_b.to_string());
    let _bye = ch.recv();
}

/// The case the purge exists for: `b` and `d` share a CQ that a poller
/// thread polls, while another thread destroys `b` and a requester in
/// another process keeps SENDing to both. No poll begun after the destroy
/// returned yields a completion of `b`; every completion of `d` arrives
/// once, in order. `race`: the poller starts as the destroy does, else
/// only once it returned — then all of `b`'s completions, at least
/// [`PHASE1`] of them between `d`'s, must have been taken out.
fn destroy_while_another_process_sends(name: &str, race: bool) {
    if let Some(ch) = child_chan() {
        return two_stream_requester(ch);
    }
    if !launcher_or_skip(name) {
        return;
    }
    let (mut child, mut ch) = spawn(name);
    let dev = Dev::open();
    // Room for every completion the test makes, so that none is lost
    // whatever the scheduler does with the poller.
    let cq = dev.cq(65_536, null_mut());
    let b = qp_with(&dev, cq, cq, null_mut(), 1024);
    let d = qp_with(&dev, cq, cq, null_mut(), D_DEPTH as u32);
    ch.send(&format!("{} {}", qpn(b), qpn(d)));
    let p = ch.recv();
    connect(b, p[0] as u32);
    connect(d, p[1] as u32);
    let buf = Buf::new(&dev, 64, 0);
    for i in 0..1024 {
        post_recv(b, &buf, 0, 64, 1_000_000 + i);
    }
    for i in 0..D_DEPTH {
        post_recv(d, &buf, 0, 64, i);
    }
    let (b_num, d_num) = (qpn(b), qpn(d));
    let hold = Arc::new(AtomicBool::new(true));
    let destroyed = Arc::new(AtomicBool::new(false));
    // Polls the CQ (after `hold` clears) until every completion of `d`
    // came, reposting `d`'s receives; returns how many of `b`'s it polled.
    let poller = {
        let (cq, d, buf) = (
            SendPtr(cq),
            SendPtr(d),
            SendPtr(std::ptr::addr_of!(buf).cast_mut()),
        );
        let (hold, destroyed) = (Arc::clone(&hold), Arc::clone(&destroyed));
        std::thread::spawn(move || {
            let (cq, d, buf) = (cq, d, buf);
            // `buf` outlives the thread: it is joined first.
            let buf = unsafe { &*buf.0 };
            let (mut d_seen, mut b_polled) = (0u64, 0u64);
            let deadline = Instant::now() + Duration::from_secs(60);
            while d_seen < PHASE1 + PHASE2 {
                assert!(
                    Instant::now() < deadline,
                    "d's completions stopped at {d_seen}"
                );
                if hold.load(Ordering::Acquire) {
                    std::thread::yield_now();
                    continue;
                }
                let after = destroyed.load(Ordering::Acquire);
                let mut wc: [ibv_wc; 32] = unsafe { std::mem::zeroed() };
                let n = unsafe { ibv_poll_cq(cq.0, 32, wc.as_mut_ptr()) };
                assert!(n >= 0);
                for w in wc[..n as usize].iter().map(Wc::from) {
                    assert_eq!(w.status, WC_SUCCESS);
                    if w.qp_num == b_num {
                        assert!(
                            !after,
                            "a completion of b from a poll begun after its destroy"
                        );
                        b_polled += 1;
                        continue;
                    }
                    assert_eq!(w.qp_num, d_num);
                    assert_eq!(
                        (w.wr_id, w.imm),
                        (d_seen, d_seen as u32),
                        "d's completions, in order, once"
                    );
                    d_seen += 1;
                    post_recv(d.0, buf, 0, 64, d_seen - 1 + D_DEPTH);
                }
            }
            b_polled
        })
    };
    // Phase 1 with nobody polling: the CQ fills with both QPs' completions.
    ch.send("go");
    assert_eq!(ch.recv(), vec![1]);
    // Phase 2: the requester sends on while b goes.
    ch.send("go");
    if race {
        hold.store(false, Ordering::Release);
    }
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    destroyed.store(true, Ordering::Release);
    hold.store(false, Ordering::Release);
    let sent_b = ch.recv()[0];
    let b_polled = poller.join().expect("poller");
    assert!(sent_b >= PHASE1);
    if race {
        assert!(b_polled <= sent_b, "b: {b_polled} polled of {sent_b} sent");
    } else {
        assert_eq!(b_polled, 0, "b's {sent_b} completions were all taken out");
    }
    // Nothing of b's comes later either.
    assert!(drain(cq).iter().all(|w| w.qp_num != b_num));
    ch.send("bye");
    assert!(child.wait().expect("wait").success(), "requester failed");
    assert_eq!(unsafe { ibv_destroy_qp(d) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
}

#[test]
fn destroy_while_another_process_sends_to_both_qps() {
    const NAME: &str = "destroy_while_another_process_sends_to_both_qps";
    destroy_while_another_process_sends(NAME, false);
}

#[test]
fn destroy_while_a_poller_polls_and_another_process_sends() {
    const NAME: &str = "destroy_while_a_poller_polls_and_another_process_sends";
    destroy_while_another_process_sends(NAME, true);
}

/// Rounds of a requester SENDing to `b` (on an SRQ) while the owner moves
/// `b` to ERR at a varying moment; an event thread waits for `b`'s
/// `IBV_EVENT_QP_LAST_WQE_REACHED`, then polls `b`'s CQ until it is empty,
/// as `__ib_drain_srq` does. What it polled is every receive completion of
/// `b`: one per successful SEND, and nothing comes after.
#[test]
fn last_wqe_reached_comes_after_every_receive_completion() {
    if !launcher_or_skip("last_wqe_reached_comes_after_every_receive_completion") {
        return;
    }
    let (da, db) = (Dev::open(), Dev::open());
    let src = Buf::new(&da, 64, 3);
    let dst = Buf::new(&db, 64, 0);
    for round in 0..24u64 {
        let srq = db.srq(1024);
        let cb = db.cq(2048, null_mut());
        let ca = da.cq(16, null_mut());
        let b = db.qp(cb, cb, srq);
        let a = da.qp(ca, ca, null_mut());
        connect_with(a, qpn(b), SHORT_TIMEOUT, SHORT_RETRY);
        connect(b, qpn(a));
        for i in 0..srq_capacity(srq) {
            assert_eq!(try_post_srq_recv(srq, &dst, i), 0);
        }
        let sent = Arc::new(AtomicU64::new(0));
        let sender = {
            let (a, ca, sent) = (SendPtr(a), SendPtr(ca), Arc::clone(&sent));
            let src = SendPtr(std::ptr::addr_of!(src).cast_mut());
            std::thread::spawn(move || {
                let (a, ca, src) = (a, ca, src);
                // `src` outlives the thread: it is joined within the round.
                let src = unsafe { &*src.0 };
                loop {
                    let i = sent.load(Ordering::Relaxed);
                    assert_eq!(post_send(a.0, src, 0, 8, i, send(WR_SEND, SIGNALED)), 0);
                    if poll(ca.0, 1)[0].status != WC_SUCCESS {
                        return;
                    }
                    sent.fetch_add(1, Ordering::Release);
                }
            })
        };
        let events = {
            let (ctx, b, cb) = (SendPtr(db.ctx), SendPtr(b), SendPtr(cb));
            std::thread::spawn(move || {
                let (ctx, b, cb) = (ctx, b, cb);
                loop {
                    assert!(
                        fd_readable(unsafe { (*ctx.0).async_fd }, 10_000),
                        "no last-WQE event"
                    );
                    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
                    assert_eq!(unsafe { ibv_get_async_event(ctx.0, &mut ev) }, 0);
                    let ty = unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) };
                    let mine = ty == QP_LAST_WQE_REACHED && unsafe { ev.element.qp } == b.0;
                    unsafe { ibv_ack_async_event(&mut ev) };
                    if mine {
                        return drain(cb.0);
                    }
                }
            })
        };
        // The error comes after 0 to 11 successful SENDs.
        let at = round % 12;
        let deadline = Instant::now() + Duration::from_secs(10);
        while sent.load(Ordering::Acquire) < at {
            assert!(
                Instant::now() < deadline,
                "round {round}: the requester is stuck"
            );
            std::thread::yield_now();
        }
        to_error(b);
        let drained = events.join().expect("event thread");
        sender.join().expect("sender");
        let ok = sent.load(Ordering::Acquire);
        assert!(ok >= at);
        assert_eq!(
            drained.iter().map(key).collect::<Vec<_>>(),
            (0..ok)
                .map(|i| (qpn(b), i, WC_SUCCESS, RECV))
                .collect::<Vec<_>>(),
            "round {round}: what the CQ held once the event came"
        );
        assert!(
            drain(cb).is_empty(),
            "round {round}: a completion after the event"
        );
        for q in [a, b] {
            assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
        }
        assert_eq!(unsafe { ibv_destroy_srq(srq) }, 0);
        for cq in [ca, cb] {
            assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
        }
    }
}
