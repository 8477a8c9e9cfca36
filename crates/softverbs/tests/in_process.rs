//! softverbs through the real libibverbs (rdma-sys), both QPs in one process.
//! Run under `softverbs-run` (the CI script does); skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

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
    cq_b: *mut ibv_cq,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
}

fn pair() -> Pair {
    let dev = Dev::open();
    let cq_a = dev.cq(64, null_mut());
    let cq_b = dev.cq(64, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    Pair {
        dev,
        cq_a,
        cq_b,
        a,
        b,
    }
}

#[test]
fn send_recv_with_immediate() {
    needs_launcher!("send_recv_with_immediate");
    let p = pair();
    let src = Buf::new(&p.dev, 256, 0);
    let mut src2 = src;
    for (i, b) in src2.data.iter_mut().enumerate() {
        *b = i as u8;
    }
    let dst = Buf::new(&p.dev, 256, 0xee);
    post_recv(p.b, &dst, 0, 256, 7);
    let s = Send {
        imm: 0x1234_5678u32.to_be(),
        ..send(WR_SEND_IMM, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src2, 0, 200, 1, s), 0);
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len),
        (7, WC_SUCCESS, ibv_wc_opcode::IBV_WC_RECV, 200)
    );
    assert_eq!(r.imm, 0x1234_5678u32.to_be());
    assert_ne!(r.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0, 0);
    assert_eq!((r.qp_num, r.src_qp), (qpn(p.b), qpn(p.a)));
    assert_eq!(&dst.data[..200], &src2.data[..200]);
    assert!(dst.data[200..].iter().all(|&b| b == 0xee));
    let s = poll(p.cq_a, 1)[0];
    assert_eq!(
        (s.wr_id, s.status, s.opcode),
        (1, WC_SUCCESS, ibv_wc_opcode::IBV_WC_SEND)
    );
}

#[test]
fn unsignaled_and_inline_sends() {
    needs_launcher!("unsignaled_and_inline_sends");
    let p = pair();
    let src = Buf::new(&p.dev, 64, 0x5a);
    let dst = Buf::new(&p.dev, 128, 0);
    post_recv(p.b, &dst, 0, 64, 1);
    post_recv(p.b, &dst, 64, 64, 2);
    assert_eq!(post_send(p.a, &src, 0, 32, 10, send(WR_SEND, 0)), 0);
    assert_eq!(
        post_send(p.a, &src, 0, 48, 11, send(WR_SEND, SIGNALED | INLINE)),
        0
    );
    let r = poll(p.cq_b, 2);
    assert_eq!(
        (r[0].wr_id, r[0].byte_len, r[1].wr_id, r[1].byte_len),
        (1, 32, 2, 48)
    );
    let s = poll(p.cq_a, 1);
    assert_eq!(s[0].wr_id, 11, "the unsignaled send must not complete");
    poll_none(p.cq_a, Duration::from_millis(20));
    assert!(
        dst.data[..32].iter().all(|&b| b == 0x5a) && dst.data[64..112].iter().all(|&b| b == 0x5a)
    );
}

#[test]
fn rdma_write_and_read_byte_for_byte() {
    needs_launcher!("rdma_write_and_read_byte_for_byte");
    let p = pair();
    let mut src = Buf::new(&p.dev, 1 << 20, 0);
    for (i, b) in src.data.iter_mut().enumerate() {
        *b = (i * 31 % 251) as u8;
    }
    let remote = Buf::new(&p.dev, 1 << 20, 0);
    let back = Buf::new(&p.dev, 1 << 20, 0);
    let w = Send {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 1 << 20, 1, w), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    assert!(remote.data == src.data, "RDMA WRITE payload differs");
    let r = Send {
        remote_addr: remote.addr(),
        rkey: remote.rkey(),
        ..send(WR_READ, SIGNALED)
    };
    assert_eq!(post_send(p.a, &back, 0, 1 << 20, 2, r), 0);
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(
        (c.status, c.opcode, c.byte_len),
        (WC_SUCCESS, ibv_wc_opcode::IBV_WC_RDMA_READ, 1 << 20)
    );
    assert!(back.data == src.data, "RDMA READ payload differs");
    // WRITE with immediate consumes a receive and reports the immediate.
    let rbuf = Buf::new(&p.dev, 16, 0);
    post_recv(p.b, &rbuf, 0, 16, 99);
    let wi = Send {
        imm: 42u32.to_be(),
        remote_addr: remote.addr() + 10,
        rkey: remote.rkey(),
        ..send(WR_WRITE_IMM, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 100, 5, 3, wi), 0);
    let rc = poll(p.cq_b, 1)[0];
    assert_eq!(
        (rc.wr_id, rc.opcode, rc.imm, rc.byte_len),
        (
            99,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            42u32.to_be(),
            5
        )
    );
    assert_eq!(&remote.data[10..15], &src.data[100..105]);
    assert_eq!(poll(p.cq_a, 1)[0].wr_id, 3);
}

#[test]
fn bad_rkey_is_remote_access_error() {
    needs_launcher!("bad_rkey_is_remote_access_error");
    let p = pair();
    let src = Buf::new(&p.dev, 64, 1);
    let remote = Buf::new(&p.dev, 64, 0);
    let w = Send {
        remote_addr: remote.addr(),
        rkey: remote.rkey() ^ 0x0100_0000,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 64, 5, w), 0);
    let c = poll(p.cq_a, 1)[0];
    assert_eq!((c.wr_id, c.status), (5, WC_REM_ACCESS));
    assert!(
        remote.data.iter().all(|&b| b == 0),
        "nothing may be written"
    );
    // The requester is now in ERR: the next WR is flushed.
    assert_eq!(post_send(p.a, &src, 0, 8, 6, send(WR_SEND, 0)), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_FLUSH);
}

#[test]
fn out_of_bounds_is_remote_access_error() {
    needs_launcher!("out_of_bounds_is_remote_access_error");
    let p = pair();
    let src = Buf::new(&p.dev, 4096, 1);
    let remote = Buf::new(&p.dev, 64, 0);
    let w = Send {
        remote_addr: remote.addr() + 32,
        rkey: remote.rkey(),
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(p.a, &src, 0, 64, 5, w), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_REM_ACCESS);
    assert!(remote.data.iter().all(|&b| b == 0));
    // A READ below the region, on a fresh pair (the first one is in ERR now).
    let p = pair();
    let dst = Buf::new(&p.dev, 64, 7);
    let remote = Buf::new(&p.dev, 64, 0);
    let r = Send {
        remote_addr: remote.addr().wrapping_sub(4096),
        rkey: remote.rkey(),
        ..send(WR_READ, SIGNALED)
    };
    assert_eq!(post_send(p.a, &dst, 0, 16, 6, r), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_REM_ACCESS);
    assert!(dst.data.iter().all(|&b| b == 7));
}

#[test]
fn qp_error_flushes_both_queues() {
    needs_launcher!("qp_error_flushes_both_queues");
    let p = pair();
    let buf = Buf::new(&p.dev, 256, 0);
    for i in 0..3 {
        post_recv(p.a, &buf, 0, 64, 100 + i);
    }
    // A send the responder cannot take yet (no receive posted at b) waits.
    assert_eq!(post_send(p.a, &buf, 0, 16, 1, send(WR_SEND, SIGNALED)), 0);
    poll_none(p.cq_a, Duration::from_millis(20));
    to_error(p.a);
    let mut got = poll(p.cq_a, 4);
    got.sort_by_key(|w| w.wr_id);
    assert!(got.iter().all(|w| w.status == WC_FLUSH), "{got:?}");
    assert_eq!(
        got.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![1, 100, 101, 102]
    );
    post_recv(p.a, &buf, 0, 8, 200);
    assert_eq!(post_send(p.a, &buf, 0, 8, 201, send(WR_SEND, 0)), 0);
    let mut late = poll(p.cq_a, 2);
    late.sort_by_key(|w| w.wr_id);
    assert_eq!(
        (late[0].wr_id, late[0].status, late[1].wr_id, late[1].status),
        (200, WC_FLUSH, 201, WC_FLUSH)
    );
}

#[test]
fn srq_shared_by_several_qps() {
    needs_launcher!("srq_shared_by_several_qps");
    let dev = Dev::open();
    let scq = dev.cq(64, null_mut());
    let rcq = dev.cq(64, null_mut());
    let srq = dev.srq(32);
    let bufs = Buf::new(&dev, 32 * 64, 0);
    for i in 0..12 {
        post_srq_recv(srq, &bufs, i * 64, 64, i as u64);
    }
    let src = Buf::new(&dev, 64, 9);
    let mut servers = Vec::new();
    for k in 0..3 {
        let s = dev.qp(scq, rcq, srq);
        let c = dev.qp(scq, scq, null_mut());
        connect(s, qpn(c));
        connect(c, qpn(s));
        for j in 0..4 {
            assert_eq!(post_send(c, &src, 0, 10 + k, j, send(WR_SEND, 0)), 0);
        }
        servers.push(qpn(s));
    }
    let got = poll(rcq, 12);
    let mut ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
    ids.sort();
    assert_eq!(ids, (0..12).collect::<Vec<u64>>());
    for (k, q) in servers.iter().enumerate() {
        let n = got
            .iter()
            .filter(|w| w.qp_num == *q && w.byte_len == 10 + k as u32)
            .count();
        assert_eq!(n, 4, "each QP of the SRQ received its 4 messages");
    }
}

#[test]
fn completion_channel_arm_semantics() {
    needs_launcher!("completion_channel_arm_semantics");
    let dev = Dev::open();
    let ch = dev.channel();
    let cq_b = dev.cq(64, ch);
    let cq_a = dev.cq(64, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 1024, 0);
    for i in 0..8 {
        post_recv(b, &buf, 0, 64, i);
    }
    // No arm: no event.
    assert_eq!(post_send(a, &buf, 0, 8, 0, send(WR_SEND, 0)), 0);
    poll(cq_b, 1);
    assert!(!readable(ch, 50), "event without an arm");
    // One arm: exactly one event for two completions.
    assert_eq!(unsafe { ibv_req_notify_cq(cq_b, 0) }, 0);
    assert_eq!(post_send(a, &buf, 0, 8, 0, send(WR_SEND, 0)), 0);
    assert_eq!(post_send(a, &buf, 0, 8, 0, send(WR_SEND, 0)), 0);
    assert!(readable(ch, 1000));
    get_event(ch, cq_b);
    assert!(!readable(ch, 50), "second event from one arm");
    poll(cq_b, 2);
    // Solicited-only: an unsolicited completion does not fire; a solicited one does.
    assert_eq!(unsafe { ibv_req_notify_cq(cq_b, 1) }, 0);
    assert_eq!(post_send(a, &buf, 0, 8, 0, send(WR_SEND, 0)), 0);
    assert!(
        !readable(ch, 50),
        "solicited-only arm fired on an unsolicited send"
    );
    assert_eq!(post_send(a, &buf, 0, 8, 0, send(WR_SEND, SOLICITED)), 0);
    assert!(readable(ch, 1000));
    get_event(ch, cq_b);
    poll(cq_b, 2);
    // ack (done in get_event) then destroy must not hang.
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(cq_b) }, 0);
    assert_eq!(unsafe { ibv_destroy_comp_channel(ch) }, 0);
}

#[test]
fn overfilled_cq_raises_async_cq_error() {
    needs_launcher!("overfilled_cq_raises_async_cq_error");
    let dev = Dev::open();
    let small = dev.cq(4, null_mut());
    let cap = unsafe { (*small).cqe } as usize;
    let other = dev.cq(64, null_mut());
    let a = dev.qp(small, small, null_mut());
    let b = dev.qp(other, other, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 64, 0);
    let async_fd = unsafe { (*dev.ctx).async_fd };
    assert!(!fd_readable(async_fd, 0));
    for i in 0..=cap as u64 {
        let w = Send {
            remote_addr: buf.addr(),
            rkey: buf.rkey(),
            ..send(WR_WRITE, SIGNALED)
        };
        assert_eq!(post_send(a, &buf, 0, 8, i, w), 0);
    }
    assert!(fd_readable(async_fd, 1000), "no async event after overflow");
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_get_async_event(dev.ctx, &mut ev) }, 0);
    let ty = unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) };
    assert_eq!(ty, 0, "IBV_EVENT_CQ_ERR");
    assert_eq!(unsafe { ev.element.cq }, small);
    unsafe { ibv_ack_async_event(&mut ev) };
}

#[test]
fn waiting_send_completes_without_polling() {
    needs_launcher!("waiting_send_completes_without_polling");
    let dev = Dev::open();
    let ch = dev.channel();
    let cq_a = dev.cq(16, ch);
    let cq_b = dev.cq(16, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 64, 3);
    assert_eq!(unsafe { ibv_req_notify_cq(cq_a, 0) }, 0);
    // No receive at b yet: the send waits (RNR, retried forever).
    assert_eq!(post_send(a, &buf, 0, 8, 1, send(WR_SEND, SIGNALED)), 0);
    assert!(!readable(ch, 30));
    post_recv(b, &buf, 32, 32, 2);
    // Nobody polls cq_a: the progress thread must finish the send and fire the arm.
    assert!(
        readable(ch, 2000),
        "a waiting send never completed in event mode"
    );
    get_event(ch, cq_a);
    assert_eq!(poll(cq_a, 1)[0].wr_id, 1);
    assert_eq!(poll(cq_b, 1)[0].wr_id, 2);
}

#[test]
fn destroy_order_is_enforced_and_clean() {
    needs_launcher!("destroy_order_is_enforced_and_clean");
    let p = pair();
    // A CQ still used by a QP (as send or receive CQ) cannot go.
    assert_eq!(unsafe { ibv_destroy_cq(p.cq_b) }, libc::EBUSY);
    assert_eq!(unsafe { ibv_destroy_qp(p.b) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(p.cq_b) }, 0);
    // The peer is gone: a send now fails instead of hanging, after the
    // transport timeout (connect's timeout 14 and retry_cnt 7: 4.096 µs ×
    // 2^14 per try, 8 tries), as the responder never answers.
    let buf = Buf::new(&p.dev, 64, 0);
    let t0 = std::time::Instant::now();
    assert_eq!(post_send(p.a, &buf, 0, 8, 1, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(
        poll(p.cq_a, 1)[0].status,
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR
    );
    let timeout = std::time::Duration::from_nanos(4096 * (1 << 14) * 8);
    assert!(
        t0.elapsed() >= timeout,
        "RETRY_EXC_ERR after {:?}, before the transport timeout {timeout:?}",
        t0.elapsed()
    );
    assert_eq!(unsafe { ibv_destroy_qp(p.a) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(p.cq_a) }, 0);
    assert_eq!(unsafe { ibv_dereg_mr(buf.mr) }, 0);
    assert_eq!(unsafe { ibv_dealloc_pd(p.dev.pd) }, 0);
    assert_eq!(unsafe { ibv_close_device(p.dev.ctx) }, 0);
}

#[test]
fn concurrent_posters_one_poller() {
    needs_launcher!("concurrent_posters_one_poller");
    const N: u64 = 2000;
    let dev = Dev::open();
    let scq = dev.cq(4096, null_mut());
    let rcq = dev.cq(4096, null_mut());
    let srq = dev.srq(4096);
    let rbuf = Buf::new(&dev, 64, 0);
    for i in 0..(2 * N) {
        post_srq_recv(srq, &rbuf, 0, 64, i);
    }
    // Each QP is posted to by exactly one thread.
    let mut qps = Vec::new();
    for _ in 0..2 {
        let a = dev.qp(scq, scq, null_mut());
        let b = dev.qp(rcq, rcq, srq);
        connect(a, qpn(b));
        connect(b, qpn(a));
        qps.push(SendPtr(a));
    }
    let src = Buf::new(&dev, 64, 1);
    let src_p = SendPtr(&src as *const Buf as *mut Buf);
    std::thread::scope(|s| {
        for (t, q) in qps.iter().copied().enumerate() {
            s.spawn(move || {
                let q = q;
                let src = src_p;
                for i in 0..N {
                    // SAFETY (test): `src` outlives the scope.
                    let b = unsafe { &*src.0 };
                    assert_eq!(
                        post_send(q.0, b, 0, 8, (t as u64) << 32 | i, send(WR_SEND, SIGNALED)),
                        0
                    );
                }
            });
        }
        let got = poll(scq, 2 * N as usize);
        let mut ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(
            ids.len(),
            2 * N as usize,
            "every send completes exactly once"
        );
        assert!(got.iter().all(|w| w.status == WC_SUCCESS));
    });
    assert_eq!(poll(rcq, 2 * N as usize).len(), 2 * N as usize);
    poll_none(rcq, Duration::from_millis(10));
}

#[test]
fn zero_length_rdma_needs_no_key_or_address() {
    needs_launcher!("zero_length_rdma_needs_no_key_or_address");
    // The InfiniBand spec checks neither R_Key nor address of a zero-length
    // RDMA operation; middleware flushes RC endpoints with such a WRITE.
    let p = pair();
    let buf = Buf::new(&p.dev, 64, 3);
    let bogus = |opcode, flags| Send {
        imm: 0x55u32.to_be(),
        remote_addr: 0xdead_beef_0000,
        rkey: 0,
        ..send(opcode, flags)
    };
    assert_eq!(post_send(p.a, &buf, 0, 0, 1, bogus(WR_WRITE, SIGNALED)), 0);
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (1, WC_SUCCESS, ibv_wc_opcode::IBV_WC_RDMA_WRITE, 0)
    );
    assert_eq!(post_send(p.a, &buf, 0, 0, 2, bogus(WR_READ, SIGNALED)), 0);
    let c = poll(p.cq_a, 1)[0];
    assert_eq!(
        (c.wr_id, c.status, c.opcode, c.byte_len),
        (2, WC_SUCCESS, ibv_wc_opcode::IBV_WC_RDMA_READ, 0)
    );
    // With immediate: still consumes a receive and delivers the immediate.
    post_recv(p.b, &buf, 32, 32, 77);
    assert_eq!(
        post_send(p.a, &buf, 0, 0, 3, bogus(WR_WRITE_IMM, SIGNALED)),
        0
    );
    let r = poll(p.cq_b, 1)[0];
    assert_eq!(
        (r.wr_id, r.status, r.opcode, r.byte_len, r.imm),
        (
            77,
            WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
            0,
            0x55u32.to_be()
        )
    );
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_SUCCESS);
    assert!(buf.data.iter().all(|&b| b == 3), "nothing was written");
    // A non-empty WRITE with that key is still refused.
    assert_eq!(post_send(p.a, &buf, 0, 1, 4, bogus(WR_WRITE, SIGNALED)), 0);
    assert_eq!(poll(p.cq_a, 1)[0].status, WC_REM_ACCESS);
}

#[test]
fn query_device_ex_counts_the_port() {
    needs_launcher!("query_device_ex_counts_the_port");
    let dev = Dev::open();
    let mut a: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    assert_eq!(query_device_ex(dev.ctx, &mut a), 0);
    assert_eq!(a.orig_attr.phys_port_cnt, 1);
    assert_eq!(a.phys_port_cnt_ex, 1, "phys_port_cnt_ex");
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[test]
fn comp_vector_must_be_below_num_comp_vectors() {
    needs_launcher!("comp_vector_must_be_below_num_comp_vectors");
    let dev = Dev::open();
    let n = unsafe { (*dev.ctx).num_comp_vectors };
    assert_eq!(n, 1);
    for v in [n, n + 5, -1] {
        let cq = unsafe { ibv_create_cq(dev.ctx, 4, null_mut(), null_mut(), v) };
        assert!(cq.is_null(), "create_cq accepted comp_vector {v}");
        assert_eq!(errno(), libc::EINVAL, "create_cq comp_vector {v}");
    }
    let mut attr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    attr.cqe = 4;
    attr.comp_vector = n as u32;
    assert!(create_cq_ex(dev.ctx, &mut attr).is_null(), "create_cq_ex");
    assert_eq!(errno(), libc::EINVAL, "create_cq_ex");
    // The last valid vector works on both paths.
    let cq = unsafe { ibv_create_cq(dev.ctx, 4, null_mut(), null_mut(), n - 1) };
    assert!(!cq.is_null());
    attr.comp_vector = (n - 1) as u32;
    let cqx = create_cq_ex(dev.ctx, &mut attr);
    assert!(!cqx.is_null());
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) }, 0);
}

#[test]
fn reg_mr_remote_write_or_atomic_needs_local_write() {
    needs_launcher!("reg_mr_remote_write_or_atomic_needs_local_write");
    let dev = Dev::open();
    let mut data = vec![0u8; 64];
    let addr = data.as_mut_ptr();
    let local = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0;
    let rw = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
    let rr = ibv_access_flags::IBV_ACCESS_REMOTE_READ.0;
    let ra = ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
    let reg = |access: u32| unsafe { ibv_reg_mr(dev.pd, addr.cast(), 64, access as i32) };
    for bad in [rw, ra, rw | ra, rw | rr] {
        assert!(reg(bad).is_null(), "access {bad:#x} accepted");
        assert_eq!(errno(), libc::EINVAL, "access {bad:#x}");
    }
    for good in [0, rr, local, local | rw, local | ra, local | rw | rr | ra] {
        let mr = reg(good);
        assert!(!mr.is_null(), "access {good:#x} refused");
        assert_eq!(unsafe { ibv_dereg_mr(mr) }, 0);
    }
}

/// A send waiting for a receive (RNR) while the application sleeps in the
/// completion channel resumes when the responder posts the receive — the
/// responder rings its QP's doorbell and the progress thread, asleep on it,
/// retries at once — not when a retry timer next expires.
///
/// The rounds run in a child process with the progress thread's liveness
/// timer off (`SOFTVERBS_TEST_NO_LIVENESS=1`, src/provider/progress.rs):
/// nothing but the ring can then wake the thread for the waiting send, so
/// each round's completion proves the ring resumed it, however loaded the
/// machine is. Each round leaves the progress thread asleep (2 ms) before
/// the receive is posted; the post_recv → completion-event latency is
/// printed, not bounded.
#[test]
fn waiting_send_resumes_on_the_receive_not_on_a_timer() {
    const NAME: &str = "waiting_send_resumes_on_the_receive_not_on_a_timer";
    needs_launcher!(NAME);
    if std::env::var_os("SOFTVERBS_TEST_ROLE").is_none() {
        let (mut child, _chan) =
            common::child::spawn_env(NAME, &[("SOFTVERBS_TEST_NO_LIVENESS", "1")]);
        let st = child.wait().expect("wait for the child");
        assert!(
            st.success(),
            "the rounds without a liveness timer failed: {st}"
        );
        return;
    }
    const ROUNDS: usize = 100;
    let dev = Dev::open();
    let ch = dev.channel();
    let cq_a = dev.cq(16, ch);
    let cq_b = dev.cq(16, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 64, 3);
    let mut lat = Vec::with_capacity(ROUNDS);
    for i in 0..ROUNDS as u64 {
        assert_eq!(unsafe { ibv_req_notify_cq(cq_a, 0) }, 0);
        assert_eq!(post_send(a, &buf, 0, 8, i, send(WR_SEND, SIGNALED)), 0);
        // Vary the phase against any periodic retry.
        std::thread::sleep(Duration::from_micros(2000 + (i * 37) % 200));
        let t0 = Instant::now();
        post_recv(b, &buf, 32, 32, 1000 + i);
        // A hang bound, not a latency bound: without the ring nothing
        // would ever resume the send.
        assert!(
            readable(ch, 10_000),
            "round {i}: the waiting send was not resumed by the posted receive"
        );
        lat.push(t0.elapsed());
        get_event(ch, cq_a);
        assert_eq!(poll(cq_a, 1)[0].wr_id, i);
        assert_eq!(poll(cq_b, 1)[0].wr_id, 1000 + i);
    }
    lat.sort();
    let (median, p90, max) = (lat[ROUNDS / 2], lat[ROUNDS * 9 / 10], lat[ROUNDS - 1]);
    let line = format!("resume latency: median {median:?}, p90 {p90:?}, max {max:?}\n");
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    for q in [a, b] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    for c in [cq_a, cq_b] {
        assert_eq!(unsafe { ibv_destroy_cq(c) }, 0);
    }
}

#[test]
fn rnr_retries_run_out_with_rnr_retry_exc_err() {
    needs_launcher!("rnr_retries_run_out_with_rnr_retry_exc_err");
    let dev = Dev::open();
    let cq_a = dev.cq(16, null_mut());
    let cq_b = dev.cq(16, null_mut());
    let a = dev.qp(cq_a, cq_a, null_mut());
    let b = dev.qp(cq_b, cq_b, null_mut());
    connect(b, qpn(a)); // b's min_rnr_timer: 12, 0.64 ms
    to_init(a);
    assert_eq!(to_rtr(a, qpn(b), 1), 0);
    let mut at: ibv_qp_attr = unsafe { std::mem::zeroed() };
    at.qp_state = ibv_qp_state::IBV_QPS_RTS;
    at.timeout = 14;
    at.retry_cnt = 7;
    at.rnr_retry = 2; // the first try and 2 retries: 3 × 0.64 ms
    at.max_rd_atomic = 1;
    let m = ibv_qp_attr_mask::IBV_QP_STATE.0
        | ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
        | ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
        | ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0
        | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0
        | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0;
    assert_eq!(unsafe { ibv_modify_qp(a, &mut at, m as i32) }, 0);
    let buf = Buf::new(&dev, 64, 3);
    // No receive on b: RNR, retried for the budget, then the error; the
    // send behind it is flushed; nothing reaches b.
    let t0 = Instant::now();
    assert_eq!(post_send(a, &buf, 0, 8, 1, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(post_send(a, &buf, 0, 8, 2, send(WR_SEND, SIGNALED)), 0);
    let c = poll(cq_a, 2);
    let took = t0.elapsed();
    assert_eq!(
        (c[0].wr_id, c[0].status, c[1].wr_id, c[1].status),
        (1, ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR, 2, WC_FLUSH)
    );
    assert!(
        took >= Duration::from_micros(3 * 640),
        "failed after {took:?}, before its RNR budget"
    );
    assert_eq!(qp_state(a), ibv_qp_state::IBV_QPS_ERR);
    assert_eq!(
        qp_state(b),
        ibv_qp_state::IBV_QPS_RTS,
        "an RNR NAK is no error at the responder"
    );
    post_recv(b, &buf, 32, 32, 10);
    poll_none(cq_b, Duration::from_millis(20));
    for q in [a, b] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    for c in [cq_a, cq_b] {
        assert_eq!(unsafe { ibv_destroy_cq(c) }, 0);
    }
}
