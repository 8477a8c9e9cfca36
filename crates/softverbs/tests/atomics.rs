//! Remote atomics (compare-and-swap, fetch-and-add) on RC QPs through the
//! real libibverbs, both QPs in one process (tests/cross_process.rs has the
//! cross-process case). Run under `softverbs-run`; skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::ptr::null_mut;

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

struct Pair {
    dev: Dev,
    cq_a: *mut ibv_cq,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
}

/// Requester `a`, responder `b` (whose QP grants `b_access`).
fn pair(b_access: i32) -> Pair {
    let dev = Dev::open();
    let cq_a = dev.cq(64, null_mut());
    let cq_b = dev.cq(64, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect_full(a, qpn(b), 14, 7, ACCESS_ATOMIC);
    connect_full(b, qpn(a), 14, 7, b_access);
    Pair { dev, cq_a, a, b }
}

#[test]
fn atomic_cap_is_hca() {
    needs_launcher!("atomic_cap_is_hca");
    let dev = Dev::open();
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_device(dev.ctx, &mut a) }, 0);
    assert_eq!(a.atomic_cap, ibv_atomic_cap::IBV_ATOMIC_HCA);
    assert!(a.max_qp_rd_atom >= 1 && a.max_qp_init_rd_atom >= 1);
}

#[test]
fn compare_swap_and_fetch_add_return_the_original() {
    needs_launcher!("compare_swap_and_fetch_add_return_the_original");
    let p = pair(ACCESS_ATOMIC);
    let target = Buf::with_access(&p.dev, 64, 0, ACCESS_ATOMIC);
    assert_eq!(target.addr() % 8, 0);
    let local = Buf::new(&p.dev, 64, 0xff);
    unsafe { std::ptr::write_volatile(target.data.as_ptr().add(8) as *mut u64, 100) };
    let raddr = target.addr() + 8;
    // A compare that matches swaps.
    assert_eq!(
        post_atomic(p.a, &local, 0, 1, WR_CMP_SWAP, raddr, target.rkey(), 100, 7),
        0
    );
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (1, WC_SUCCESS, ibv_wc_opcode::IBV_WC_COMP_SWAP, 8)
    );
    assert_eq!((word(&local, 0), word(&target, 8)), (100, 7));
    assert!(local.data[8..].iter().all(|&b| b == 0xff), "8 bytes only");
    // One that does not leaves the word and still returns it.
    assert_eq!(
        post_atomic(
            p.a,
            &local,
            16,
            2,
            WR_CMP_SWAP,
            raddr,
            target.rkey(),
            100,
            9
        ),
        0
    );
    let c = poll(p.cq_a, 1)[0];
    assert_eq!((c.wr_id, c.status), (2, WC_SUCCESS));
    assert_eq!((word(&local, 16), word(&target, 8)), (7, 7));
    // Fetch-and-add, wrapping.
    assert_eq!(
        post_atomic(
            p.a,
            &local,
            24,
            3,
            WR_FETCH_ADD,
            raddr,
            target.rkey(),
            u64::MAX,
            0
        ),
        0
    );
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (3, WC_SUCCESS, ibv_wc_opcode::IBV_WC_FETCH_ADD, 8)
    );
    assert_eq!((word(&local, 24), word(&target, 8)), (7, 6));
    assert_eq!(word(&target, 0), 0, "neighbours untouched");
    assert_eq!(word(&target, 16), 0, "neighbours untouched");
}

#[test]
fn atomic_needs_remote_atomic_on_the_region() {
    needs_launcher!("atomic_needs_remote_atomic_on_the_region");
    let p = pair(ACCESS_ATOMIC);
    let target = Buf::new(&p.dev, 64, 0); // no REMOTE_ATOMIC
    let local = Buf::new(&p.dev, 64, 0);
    assert_eq!(
        post_atomic(
            p.a,
            &local,
            0,
            1,
            WR_FETCH_ADD,
            target.addr(),
            target.rkey(),
            1,
            0
        ),
        0
    );
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(
        (c.status, c.opcode),
        (WC_REM_ACCESS, ibv_wc_opcode::IBV_WC_FETCH_ADD)
    );
    assert_eq!(word(&target, 0), 0);
    assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_ERR, "responder NAKed");
}

#[test]
fn atomic_needs_remote_atomic_on_the_qp() {
    needs_launcher!("atomic_needs_remote_atomic_on_the_qp");
    let p = pair(ACCESS_ALL); // the responder QP grants no atomics
    let target = Buf::with_access(&p.dev, 64, 0, ACCESS_ATOMIC);
    let local = Buf::new(&p.dev, 64, 0);
    assert_eq!(
        post_atomic(
            p.a,
            &local,
            0,
            1,
            WR_CMP_SWAP,
            target.addr(),
            target.rkey(),
            0,
            5
        ),
        0
    );
    // A QP not enabled for atomics: an invalid request (as rxe answers).
    assert_eq!(
        poll(p.cq_a, 1)[0].status,
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR
    );
    assert_eq!(word(&target, 0), 0);
}

#[test]
fn misaligned_atomic_is_an_invalid_request() {
    needs_launcher!("misaligned_atomic_is_an_invalid_request");
    let p = pair(ACCESS_ATOMIC);
    let target = Buf::with_access(&p.dev, 64, 0, ACCESS_ATOMIC);
    let local = Buf::new(&p.dev, 64, 0);
    assert_eq!(
        post_atomic(
            p.a,
            &local,
            0,
            1,
            WR_FETCH_ADD,
            target.addr() + 4,
            target.rkey(),
            1,
            0
        ),
        0
    );
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(c.status, ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
    assert!(target.data.iter().all(|&b| b == 0), "nothing written");
    assert_eq!(qp_state(p.a), ibv_qp_state::IBV_QPS_ERR);
    assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_ERR);
}

#[test]
fn max_rd_atomic_above_the_device_limit_is_einval() {
    needs_launcher!("max_rd_atomic_above_the_device_limit_is_einval");
    let dev = Dev::open();
    let mut da: ibv_device_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_device(dev.ctx, &mut da) }, 0);
    let cq = dev.cq(8, null_mut());
    let qp = dev.qp(cq, cq, null_mut());
    let peer = dev.qp(cq, cq, null_mut());
    // Each limit where the kernel's table takes the attribute: the
    // responder's at INIT -> RTR, the requester's at RTR -> RTS.
    to_init_with(qp, ACCESS_ATOMIC);
    let (init, dest) = (da.max_qp_init_rd_atom as u8, da.max_qp_rd_atom as u8);
    assert_eq!(to_rtr(qp, qpn(peer), dest + 1), libc::EINVAL);
    assert_eq!(to_rtr(qp, qpn(peer), dest), 0);
    assert_eq!(to_rts_rc(qp, 14, 7, init + 1), libc::EINVAL);
    assert_eq!(to_rts_rc(qp, 14, 7, init), 0);
    let mut q: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    let m = (ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0
        | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0) as i32;
    assert_eq!(unsafe { ibv_query_qp(qp, &mut q, m, &mut i) }, 0);
    assert_eq!(
        (q.max_rd_atomic, q.max_dest_rd_atomic),
        (init, dest),
        "as accepted"
    );
}

#[test]
fn concurrent_fetch_adds_from_many_qps_lose_nothing() {
    needs_launcher!("concurrent_fetch_adds_from_many_qps_lose_nothing");
    const THREADS: usize = 4;
    const EACH: u64 = 5000;
    let dev = Dev::open();
    let target = Buf::with_access(&dev, 64, 0, ACCESS_ATOMIC);
    let (raddr, rkey) = (target.addr(), target.rkey());
    let rcq = dev.cq(8, null_mut());
    let mut handles = Vec::new();
    for _ in 0..THREADS {
        let cq = dev.cq(64, null_mut());
        let a = dev.qp(cq, cq, null_mut());
        let b = dev.qp(rcq, rcq, null_mut());
        connect_full(a, qpn(b), 14, 7, ACCESS_ATOMIC);
        connect_full(b, qpn(a), 14, 7, ACCESS_ATOMIC);
        // Each thread owns its QP, CQ and result buffer.
        let local = SendPtr(Box::into_raw(Box::new(Buf::new(&dev, 8, 0))));
        let (a, cq) = (SendPtr(a), SendPtr(cq));
        handles.push(std::thread::spawn(move || {
            let (a, cq, local) = (a, cq, local);
            let local = unsafe { &*local.0 };
            let mut seen = Vec::with_capacity(EACH as usize);
            for i in 0..EACH {
                assert_eq!(
                    post_atomic(a.0, local, 0, i, WR_FETCH_ADD, raddr, rkey, 1, 0),
                    0
                );
                assert_eq!(poll(cq.0, 1)[0].status, WC_SUCCESS);
                seen.push(word(local, 0));
            }
            seen
        }));
    }
    let mut all: Vec<u64> = handles
        .into_iter()
        .flat_map(|h| h.join().expect("thread"))
        .collect();
    assert_eq!(word(&target, 0), THREADS as u64 * EACH, "no lost update");
    all.sort_unstable();
    let expect: Vec<u64> = (0..THREADS as u64 * EACH).collect();
    assert!(all == expect, "every original value seen exactly once");
}

/// A requester QP connected to a new responder QP (granting `b_access`)
/// on `dev`; the requester's CQ and QP.
fn requester(dev: &Dev, b_access: i32) -> (*mut ibv_cq, *mut ibv_qp) {
    let cq_a = dev.cq(16, null_mut());
    let cq_b = dev.cq(16, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect_full(a, qpn(b), 14, 7, ACCESS_ATOMIC);
    connect_full(b, qpn(a), 14, 7, b_access);
    (cq_a, a)
}

#[test]
fn atomic_write_stores_eight_bytes_with_remote_write_access() {
    needs_launcher!("atomic_write_stores_eight_bytes_with_remote_write_access");
    let dev = Dev::open();
    let target = Buf::new(&dev, 64, 0);
    let local = Buf::new(&dev, 64, 0);
    let ro = Buf::with_access(
        &dev,
        64,
        0,
        (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0)
            as i32,
    );
    unsafe { std::ptr::write_volatile(local.data.as_ptr() as *mut u64, 0x0102_0304_0506_0708) };
    let aw = ibv_wr_opcode::IBV_WR_ATOMIC_WRITE;
    let at = |qp, buf: &Buf, off: u64, len: u32, id| {
        let s = Send {
            remote_addr: buf.addr() + off,
            rkey: buf.rkey(),
            ..send(aw, SIGNALED)
        };
        post_send(qp, &local, 0, len, id, s)
    };
    let (cq, a) = requester(&dev, ACCESS_ALL);
    assert_eq!(at(a, &target, 16, 8, 1), 0);
    let w = poll(cq, 1);
    assert_eq!(
        (w[0].status, w[0].opcode, w[0].byte_len),
        (WC_SUCCESS, ibv_wc_opcode::IBV_WC_ATOMIC_WRITE, 8)
    );
    assert_eq!(word(&target, 16), 0x0102_0304_0506_0708);
    // Not 8 bytes: a local length error, nothing stored.
    assert_eq!(at(a, &target, 24, 4, 2), 0);
    assert_eq!(poll(cq, 1)[0].status, ibv_wc_status::IBV_WC_LOC_LEN_ERR);
    assert_eq!(word(&target, 24), 0);
    // Misaligned: an invalid request at the responder.
    let (cq, a) = requester(&dev, ACCESS_ALL);
    assert_eq!(at(a, &target, 4, 8, 3), 0);
    assert_eq!(poll(cq, 1)[0].status, ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
    // A region without remote write: an access error; a QP without it:
    // an invalid request (as rxe answers).
    let (cq, a) = requester(&dev, ACCESS_ALL);
    assert_eq!(at(a, &ro, 0, 8, 4), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_REM_ACCESS);
    assert_eq!(word(&ro, 0), 0);
    let read_only_qp = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 as i32;
    let (cq, a) = requester(&dev, read_only_qp);
    assert_eq!(at(a, &target, 32, 8, 5), 0);
    assert_eq!(poll(cq, 1)[0].status, ibv_wc_status::IBV_WC_REM_INV_REQ_ERR);
    assert_eq!(word(&target, 32), 0);
    // UC has no atomic write.
    let cq = dev.cq(4, null_mut());
    let uc = dev.qp_of(ibv_qp_type::IBV_QPT_UC, cq, cq, null_mut());
    uc_connect(uc, qpn(uc));
    assert_eq!(at(uc, &target, 0, 8, 6), libc::EINVAL);
}
