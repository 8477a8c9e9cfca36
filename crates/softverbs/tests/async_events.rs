//! QP and SRQ asynchronous events through the real libibverbs (rdma-sys),
//! read with `ibv_get_async_event` as a library routing them to handlers
//! would: responder errors (`IBV_EVENT_QP_ACCESS_ERR`,
//! `IBV_EVENT_QP_REQ_ERR`), `IBV_EVENT_QP_LAST_WQE_REACHED` and
//! `IBV_EVENT_SRQ_LIMIT_REACHED`. Requester and responder live in two
//! contexts, so each event is seen to reach its owner's context only.
//! Run under `softverbs-run` (the CI script does); skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::ptr::null_mut;
use std::sync::mpsc;
use std::time::Duration;

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

/// `enum ibv_event_type` numbers (rdma-sys makes the type a Rust enum).
const QP_REQ_ERR: u32 = 2;
const QP_ACCESS_ERR: u32 = 3;
const SRQ_LIMIT_REACHED: u32 = 15;
const QP_LAST_WQE_REACHED: u32 = 16;

const WC_LOC_LEN: u32 = ibv_wc_status::IBV_WC_LOC_LEN_ERR;
const WC_REM_INV_REQ: u32 = ibv_wc_status::IBV_WC_REM_INV_REQ_ERR;

/// Requester `a` (context `da`) connected to responder `b` (context `db`,
/// on `srq` when given).
struct Pair {
    da: Dev,
    db: Dev,
    cq_a: *mut ibv_cq,
    cq_b: *mut ibv_cq,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
}

fn pair(with_srq: impl FnOnce(&Dev) -> *mut ibv_srq) -> (Pair, *mut ibv_srq) {
    let da = Dev::open();
    let db = Dev::open();
    let srq = with_srq(&db);
    let cq_a = da.cq(64, null_mut());
    let cq_b = db.cq(64, null_mut());
    let a = da.qp(cq_a, cq_a, null_mut());
    let b = db.qp(cq_b, cq_b, srq);
    connect(a, qpn(b));
    connect(b, qpn(a));
    (
        Pair {
            da,
            db,
            cq_a,
            cq_b,
            a,
            b,
        },
        srq,
    )
}

/// Read one async event of `ctx` (within 1 s), unacked: (type, element).
fn next_event(ctx: *mut ibv_context) -> (u32, usize, ibv_async_event) {
    assert!(
        fd_readable(unsafe { (*ctx).async_fd }, 1000),
        "no async event"
    );
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_get_async_event(ctx, &mut ev) }, 0);
    let ty = unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) };
    (ty, unsafe { ev.element.qp } as usize, ev)
}

/// Read one async event, check its type and element, ack it.
fn expect_event(ctx: *mut ibv_context, ty: u32, element: usize) {
    let (t, e, mut ev) = next_event(ctx);
    assert_eq!((t, e), (ty, element), "event type and element");
    unsafe { ibv_ack_async_event(&mut ev) };
}

fn no_event(ctx: *mut ibv_context, ms: i32) {
    assert!(
        !fd_readable(unsafe { (*ctx).async_fd }, ms),
        "unexpected async event"
    );
}

fn qp_state(qp: *mut ibv_qp) -> u32 {
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    let m = ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
    assert_eq!(unsafe { ibv_query_qp(qp, &mut a, m, &mut i) }, 0);
    a.qp_state
}

fn srq_limit(srq: *mut ibv_srq) -> u32 {
    let mut a: ibv_srq_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_srq(srq, &mut a) }, 0);
    a.srq_limit
}

fn arm_srq(srq: *mut ibv_srq, limit: u32) -> i32 {
    let mut a: ibv_srq_attr = unsafe { std::mem::zeroed() };
    a.srq_limit = limit;
    unsafe { ibv_modify_srq(srq, &mut a, ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as i32) }
}

/// Run a destroy verb on another thread; it must return 0 within 5 s.
fn destroys_promptly<T: 'static>(obj: *mut T, destroy: unsafe extern "C" fn(*mut T) -> i32) {
    let p = SendPtr(obj);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let p = p;
        let _ = tx.send(unsafe { destroy(p.0) });
    });
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)),
        Ok(0),
        "destroy hung or failed"
    );
}

/// Tear a pair down (QPs already destroyed or not), checking nothing hangs.
fn close(p: &Pair, qps_left: &[*mut ibv_qp]) {
    for &q in qps_left {
        destroys_promptly(q, ibv_destroy_qp);
    }
    unsafe {
        assert_eq!(ibv_destroy_cq(p.cq_a), 0);
        assert_eq!(ibv_destroy_cq(p.cq_b), 0);
    }
}

#[test]
fn responder_access_violation_raises_qp_access_err_and_moves_it_to_err() {
    needs_launcher!("responder_access_violation_raises_qp_access_err_and_moves_it_to_err");
    // Each violation on a fresh pair: a bad rkey (WRITE), a range outside
    // the region (READ), and a QP without remote write access (WRITE with
    // a valid key).
    for case in 0..3 {
        let (p, _) = pair(|_| null_mut());
        let src = Buf::new(&p.da, 64, 1);
        let target = Buf::new(&p.db, 64, 0);
        let rbuf = Buf::new(&p.db, 64, 0);
        post_recv(p.b, &rbuf, 0, 32, 100);
        post_recv(p.b, &rbuf, 32, 32, 101);
        let w = match case {
            0 => Send {
                remote_addr: target.addr(),
                rkey: target.rkey() ^ 0x0100_0000,
                ..send(WR_WRITE, SIGNALED)
            },
            1 => Send {
                remote_addr: target.addr() + 32,
                rkey: target.rkey(),
                ..send(WR_READ, SIGNALED)
            },
            _ => {
                let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
                a.qp_access_flags = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
                let m = ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0 as i32;
                assert_eq!(unsafe { ibv_modify_qp(p.b, &mut a, m) }, 0);
                Send {
                    remote_addr: target.addr(),
                    rkey: target.rkey(),
                    ..send(WR_WRITE, SIGNALED)
                }
            }
        };
        assert_eq!(post_send(p.a, &src, 0, 64, 5, w), 0);
        let c = poll(p.cq_a, 1)[0];
        // A region's key, range or access: a remote access error. A QP
        // not enabled for the operation: an invalid request, as rxe
        // answers (examples/verbs_probe, write_qp_no_access).
        let (status, event) = if case == 2 {
            (WC_REM_INV_REQ, QP_REQ_ERR)
        } else {
            (WC_REM_ACCESS, QP_ACCESS_ERR)
        };
        assert_eq!((c.wr_id, c.status), (5, status), "case {case}");
        // The responder's owner gets the event, naming its QP; the
        // requester's context gets none.
        expect_event(p.db.ctx, event, p.b as usize);
        no_event(p.da.ctx, 50);
        no_event(p.db.ctx, 0);
        // The responder is in ERR: its posted receives were flushed, and a
        // receive posted now is flushed at once.
        assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_ERR);
        let mut got = poll(p.cq_b, 2);
        got.sort_by_key(|w| w.wr_id);
        assert_eq!(
            got.iter()
                .map(|w| (w.wr_id, w.status, w.qp_num))
                .collect::<Vec<_>>(),
            vec![(100, WC_FLUSH, qpn(p.b)), (101, WC_FLUSH, qpn(p.b))]
        );
        post_recv(p.b, &rbuf, 0, 8, 102);
        assert_eq!(poll(p.cq_b, 1)[0].status, WC_FLUSH);
        assert!(target.data.iter().all(|&b| b == 0));
        close(&p, &[p.b, p.a]);
    }
}

#[test]
fn send_longer_than_the_receive_raises_qp_req_err_on_the_responder() {
    needs_launcher!("send_longer_than_the_receive_raises_qp_req_err_on_the_responder");
    let (p, _) = pair(|_| null_mut());
    let src = Buf::new(&p.da, 64, 1);
    let rbuf = Buf::new(&p.db, 64, 0);
    post_recv(p.b, &rbuf, 0, 4, 100);
    post_recv(p.b, &rbuf, 32, 32, 101);
    assert_eq!(post_send(p.a, &src, 0, 16, 5, send(WR_SEND, SIGNALED)), 0);
    // Requester: remote invalid request; responder: local length error on
    // the receive it took, then the flush of the other one.
    let c = poll(p.cq_a, 1)[0];
    assert_eq!((c.wr_id, c.status), (5, WC_REM_INV_REQ));
    let got = poll(p.cq_b, 2);
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        vec![(100, WC_LOC_LEN), (101, WC_FLUSH)]
    );
    expect_event(p.db.ctx, QP_REQ_ERR, p.b as usize);
    no_event(p.da.ctx, 50);
    assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_ERR);
    assert_eq!(qp_state(p.a), ibv_qp_state::IBV_QPS_ERR);
    assert!(rbuf.data.iter().all(|&b| b == 0));
    close(&p, &[p.b, p.a]);
}

#[test]
fn qp_on_srq_gets_last_wqe_reached_when_moved_to_err() {
    needs_launcher!("qp_on_srq_gets_last_wqe_reached_when_moved_to_err");
    let (p, srq) = pair(|d| d.srq(16));
    let rbuf = Buf::new(&p.db, 64, 0);
    let src = Buf::new(&p.da, 64, 1);
    post_srq_recv(srq, &rbuf, 0, 32, 100);
    post_srq_recv(srq, &rbuf, 32, 32, 101);
    // One receive consumed from the SRQ before the QP goes to ERR.
    assert_eq!(post_send(p.a, &src, 0, 8, 5, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    assert_eq!(poll(p.cq_b, 1)[0].status, WC_SUCCESS);
    no_event(p.db.ctx, 0);
    to_error(p.b);
    expect_event(p.db.ctx, QP_LAST_WQE_REACHED, p.b as usize);
    // Once per stay in ERR: a second modify to ERR raises nothing; the
    // SRQ's receives are not flushed (other QPs may use them).
    to_error(p.b);
    no_event(p.db.ctx, 50);
    poll_none(p.cq_b, Duration::from_millis(20));
    // RESET re-arms it (then INIT: RESET -> ERR is not a transition).
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = ibv_qp_state::IBV_QPS_RESET;
    let m = ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
    assert_eq!(unsafe { ibv_modify_qp(p.b, &mut a, m) }, 0);
    to_init(p.b);
    to_error(p.b);
    expect_event(p.db.ctx, QP_LAST_WQE_REACHED, p.b as usize);
    no_event(p.da.ctx, 0);
    close(&p, &[p.b, p.a]);
    destroys_promptly(srq, ibv_destroy_srq);
}

#[test]
fn qp_on_srq_gets_access_err_then_last_wqe_reached() {
    needs_launcher!("qp_on_srq_gets_access_err_then_last_wqe_reached");
    let (p, srq) = pair(|d| d.srq(16));
    let rbuf = Buf::new(&p.db, 64, 0);
    let src = Buf::new(&p.da, 64, 1);
    post_srq_recv(srq, &rbuf, 0, 32, 100);
    let w = Send {
        remote_addr: rbuf.addr(),
        rkey: rbuf.rkey() ^ 0x0100_0000,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 8, 5, w), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_REM_ACCESS);
    expect_event(p.db.ctx, QP_ACCESS_ERR, p.b as usize);
    expect_event(p.db.ctx, QP_LAST_WQE_REACHED, p.b as usize);
    no_event(p.db.ctx, 50);
    assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_ERR);
    // The SRQ keeps its receive for the other QPs.
    poll_none(p.cq_b, Duration::from_millis(20));
    close(&p, &[p.b, p.a]);
    destroys_promptly(srq, ibv_destroy_srq);
}

#[test]
fn srq_limit_reached_once_per_arm() {
    needs_launcher!("srq_limit_reached_once_per_arm");
    let (p, srq) = pair(|d| d.srq(16));
    let rbuf = Buf::new(&p.db, 8 * 16, 0);
    let src = Buf::new(&p.da, 64, 1);
    for i in 0..8 {
        post_srq_recv(srq, &rbuf, i * 16, 16, 100 + i as u64);
    }
    // Not armed at creation; a limit above the SRQ's size is refused.
    assert_eq!(srq_limit(srq), 0);
    assert_eq!(arm_srq(srq, 17), libc::EINVAL);
    assert_eq!(arm_srq(srq, 4), 0);
    assert_eq!(srq_limit(srq), 4);
    let mut id = 0;
    let mut send_one = || {
        id += 1;
        assert_eq!(post_send(p.a, &src, 0, 8, id, send(WR_SEND, SIGNALED)), 0);
        assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
        assert_eq!(poll(p.cq_b, 1)[0].status, WC_SUCCESS);
    };
    // 8 -> 4 outstanding: not below the limit yet.
    for _ in 0..4 {
        send_one();
    }
    no_event(p.db.ctx, 50);
    assert_eq!(srq_limit(srq), 4);
    // 3 < 4: one event, and the limit is disarmed.
    send_one();
    expect_event(p.db.ctx, SRQ_LIMIT_REACHED, srq as usize);
    assert_eq!(srq_limit(srq), 0);
    send_one(); // 2 left: disarmed, nothing
    no_event(p.db.ctx, 50);
    // Armed again while already below: the next receive taken fires it.
    assert_eq!(arm_srq(srq, 3), 0);
    send_one(); // 1 left
    expect_event(p.db.ctx, SRQ_LIMIT_REACHED, srq as usize);
    assert_eq!(srq_limit(srq), 0);
    // Disarming with 0 works and nothing fires.
    assert_eq!(arm_srq(srq, 2), 0);
    assert_eq!(arm_srq(srq, 0), 0);
    send_one(); // 0 left
    no_event(p.db.ctx, 50);
    no_event(p.da.ctx, 0);
    close(&p, &[p.b, p.a]);
    destroys_promptly(srq, ibv_destroy_srq);
}

#[test]
fn destroy_waits_for_the_ack_of_a_read_event() {
    needs_launcher!("destroy_waits_for_the_ack_of_a_read_event");
    // libibverbs' rule for every device: destroying a QP waits until the
    // events read for it were acked.
    let (p, _) = pair(|_| null_mut());
    let src = Buf::new(&p.da, 64, 1);
    let w = Send {
        remote_addr: src.addr(),
        rkey: 0x7fff_f000,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 8, 5, w), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_REM_ACCESS);
    let (ty, el, mut ev) = next_event(p.db.ctx);
    assert_eq!((ty, el), (QP_ACCESS_ERR, p.b as usize));
    let b = SendPtr(p.b);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let b = b;
        let _ = tx.send(unsafe { ibv_destroy_qp(b.0) });
    });
    assert!(
        rx.recv_timeout(Duration::from_millis(300)).is_err(),
        "destroy returned before the ack"
    );
    unsafe { ibv_ack_async_event(&mut ev) };
    assert_eq!(rx.recv_timeout(Duration::from_secs(5)), Ok(0));
    close(&p, &[p.a]);
}

#[test]
fn event_unread_at_destroy_is_safe_to_read_and_ack() {
    needs_launcher!("event_unread_at_destroy_is_safe_to_read_and_ack");
    // The kernel would drop the record; a pipe cannot, so the QP's memory
    // stays valid until the context closes and the stale event is harmless.
    let (p, _) = pair(|_| null_mut());
    let src = Buf::new(&p.da, 64, 1);
    let w = Send {
        remote_addr: src.addr(),
        rkey: 0x7fff_f000,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 8, 5, w), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_REM_ACCESS);
    let stale = p.b as usize;
    destroys_promptly(p.b, ibv_destroy_qp);
    expect_event(p.db.ctx, QP_ACCESS_ERR, stale);
    // Closing the context frees the kept memory.
    close(&p, &[p.a]);
    unsafe {
        assert_eq!(ibv_dereg_mr(src.mr), 0);
        for d in [&p.da, &p.db] {
            assert_eq!(ibv_dealloc_pd(d.pd), 0);
            assert_eq!(ibv_close_device(d.ctx), 0);
        }
    }
}
