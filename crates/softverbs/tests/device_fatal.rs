//! Device death on demand (`softverbs_inject_device_fatal`) through the real
//! libibverbs (rdma-sys), as a library testing its hot-unplug handling sees
//! it. Run under `softverbs-run` (the CI script does); skipped loudly
//! otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::path::PathBuf;
use std::ptr::null_mut;
use std::time::Duration;

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

type Inject = unsafe extern "C" fn(*mut ibv_context) -> i32;

/// The entry point, found the way docs/softverbs.md tells applications to.
fn inject_fn() -> Inject {
    let p = unsafe {
        libc::dlsym(
            libc::RTLD_DEFAULT,
            c"softverbs_inject_device_fatal".as_ptr(),
        )
    };
    assert!(!p.is_null(), "softverbs_inject_device_fatal not found");
    unsafe { std::mem::transmute::<*mut libc::c_void, Inject>(p) }
}

fn inject(ctx: *mut ibv_context) -> i32 {
    unsafe { inject_fn()(ctx) }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Clear errno so that a null result is known to have set it.
fn clear_errno() {
    unsafe { *libc::__errno_location() = 0 };
}

fn seg_path(name: String) -> PathBuf {
    std::env::var_os("SOFTVERBS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm/softverbs"))
        .join(name)
}

/// Read one async event (within 1 s) and ack it; returns its type and
/// `element.port_num`.
fn async_event(ctx: *mut ibv_context) -> (u32, i32) {
    assert!(
        fd_readable(unsafe { (*ctx).async_fd }, 1000),
        "no async event"
    );
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_get_async_event(ctx, &mut ev) }, 0);
    let ty = unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) };
    let port = unsafe { ev.element.port_num };
    unsafe { ibv_ack_async_event(&mut ev) };
    (ty, port)
}

fn recv_wr(buf: &Buf, sge: &mut ibv_sge) -> ibv_recv_wr {
    *sge = ibv_sge {
        addr: buf.addr(),
        length: 8,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 1;
    wr.sg_list = sge;
    wr.num_sge = 1;
    wr
}

#[test]
fn inject_refuses_foreign_contexts() {
    needs_launcher!("inject_refuses_foreign_contexts");
    assert_eq!(inject(null_mut()), libc::EINVAL);
    // Not a context of the provider: never dereferenced, refused.
    let mut fake: ibv_context = unsafe { std::mem::zeroed() };
    assert_eq!(inject(&mut fake), libc::EINVAL);
    // A live context is untouched by those calls.
    let dev = Dev::open();
    assert!(!fd_readable(unsafe { (*dev.ctx).async_fd }, 0));
    let cq = dev.cq(4, null_mut());
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    assert_eq!(unsafe { ibv_dealloc_pd(dev.pd) }, 0);
    assert_eq!(unsafe { ibv_close_device(dev.ctx) }, 0);
}

#[test]
fn device_fatal_event_then_verbs_fail_and_cleanup_succeeds() {
    needs_launcher!("device_fatal_event_then_verbs_fail_and_cleanup_succeeds");
    let dev = Dev::open();
    let ch = dev.channel();
    let cq = dev.cq(64, ch);
    let mut xattr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    xattr.cqe = 8;
    let cqx = create_cq_ex(dev.ctx, &mut xattr);
    assert!(!cqx.is_null(), "create_cq_ex");
    let srq = dev.srq(8);
    let a = dev.qp(cq, cq, null_mut());
    let b = dev.qp(cq, cq, null_mut());
    let c = dev.qp(cq, cq, srq);
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 64, 1);
    // Outstanding work at death: a completion already in the CQ, a posted
    // receive, a send waiting for a receive (b has none), an SRQ receive.
    post_recv(a, &buf, 0, 8, 10);
    assert_eq!(post_send(b, &buf, 8, 8, 11, send(WR_SEND, SIGNALED)), 0);
    post_srq_recv(srq, &buf, 0, 8, 13);
    assert_eq!(post_send(a, &buf, 0, 8, 14, send(WR_SEND, SIGNALED)), 0);
    let segs = [
        seg_path(format!("qp-{}", qpn(a))),
        seg_path(format!("qp-{}", qpn(b))),
        seg_path(format!("qp-{}", qpn(c))),
        seg_path(format!("cq-{}", unsafe { (*cq).handle })),
        seg_path(format!("cq-{}", unsafe { (*cqx).handle })),
        seg_path(format!("srq-{}", unsafe { (*srq).handle })),
    ];
    for s in &segs {
        assert!(s.exists(), "{} missing before the test", s.display());
    }
    assert_eq!(unsafe { ibv_req_notify_cq(cq, 0) }, 0);

    assert_eq!(inject(dev.ctx), 0);
    assert_eq!(
        async_event(dev.ctx),
        (ibv_event_type::IBV_EVENT_DEVICE_FATAL as u32, 0)
    );
    // Idempotent: a second call succeeds and raises no second event; the
    // next read fails at once instead of blocking (the kernel answers EIO
    // for a disassociated device).
    assert_eq!(inject(dev.ctx), 0);
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_get_async_event(dev.ctx, &mut ev) }, -1);

    // Posting fails with EIO and names the first WR.
    let mut sge = ibv_sge {
        addr: buf.addr(),
        length: 8,
        lkey: buf.lkey(),
    };
    let mut swr: ibv_send_wr = unsafe { std::mem::zeroed() };
    swr.sg_list = &mut sge;
    swr.num_sge = 1;
    swr.opcode = WR_SEND;
    let mut sbad = null_mut();
    assert_eq!(unsafe { ibv_post_send(a, &mut swr, &mut sbad) }, libc::EIO);
    assert_eq!(sbad, &mut swr as *mut _);
    let mut rsge = sge;
    let mut rwr = recv_wr(&buf, &mut rsge);
    let mut rbad = null_mut();
    assert_eq!(unsafe { ibv_post_recv(a, &mut rwr, &mut rbad) }, libc::EIO);
    assert_eq!(rbad, &mut rwr as *mut _);
    let mut rbad = null_mut();
    assert_eq!(
        unsafe { ibv_post_srq_recv(srq, &mut rwr, &mut rbad) },
        libc::EIO
    );
    assert_eq!(rbad, &mut rwr as *mut _);

    // Polling and arming fail; the completion queued before death is not
    // delivered.
    let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
    assert!(unsafe { ibv_poll_cq(cq, 1, &mut wc) } < 0, "poll_cq");
    assert!(unsafe { ibv_poll_cq(cq, 1, &mut wc) } < 0, "poll_cq again");
    assert_eq!(unsafe { ibv_req_notify_cq(cq, 0) }, libc::EIO);
    assert_eq!(unsafe { ibv_req_notify_cq(cq, 1) }, libc::EIO);
    let mut pa: ibv_poll_cq_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_start_poll(cqx, &mut pa) }, libc::EIO);

    // Creation verbs fail with EIO.
    clear_errno();
    assert!(unsafe { ibv_create_cq(dev.ctx, 4, null_mut(), null_mut(), 0) }.is_null());
    assert_eq!(errno(), libc::EIO, "create_cq");
    clear_errno();
    let mut xattr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    xattr.cqe = 4;
    assert!(create_cq_ex(dev.ctx, &mut xattr).is_null());
    assert_eq!(errno(), libc::EIO, "create_cq_ex");
    clear_errno();
    assert!(unsafe { ibv_alloc_pd(dev.ctx) }.is_null());
    assert_eq!(errno(), libc::EIO, "alloc_pd");
    clear_errno();
    let mut more = vec![0u8; 64];
    assert!(unsafe { ibv_reg_mr(dev.pd, more.as_mut_ptr().cast(), 64, ACCESS_ALL) }.is_null());
    assert_eq!(errno(), libc::EIO, "reg_mr");
    clear_errno();
    let mut qa: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    qa.send_cq = cq;
    qa.recv_cq = cq;
    qa.qp_type = ibv_qp_type::IBV_QPT_RC;
    qa.cap.max_send_wr = 1;
    qa.cap.max_recv_wr = 1;
    assert!(unsafe { ibv_create_qp(dev.pd, &mut qa) }.is_null());
    assert_eq!(errno(), libc::EIO, "create_qp");
    clear_errno();
    let mut sa: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
    sa.attr.max_wr = 4;
    sa.attr.max_sge = 1;
    assert!(unsafe { ibv_create_srq(dev.pd, &mut sa) }.is_null());
    assert_eq!(errno(), libc::EIO, "create_srq");
    clear_errno();
    assert!(unsafe { ibv_create_comp_channel(dev.ctx) }.is_null());
    assert_eq!(errno(), libc::EIO, "create_comp_channel");

    // Modify and query commands fail too (the kernel answers EIO).
    let mut qattr: ibv_qp_attr = unsafe { std::mem::zeroed() };
    qattr.qp_state = ibv_qp_state::IBV_QPS_ERR;
    let m = ibv_qp_attr_mask::IBV_QP_STATE.0 as i32;
    assert_eq!(unsafe { ibv_modify_qp(a, &mut qattr, m) }, libc::EIO);
    let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { ibv_query_qp(a, &mut qattr, m, &mut init) },
        libc::EIO
    );
    let mut dattr: ibv_device_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_device(dev.ctx, &mut dattr) }, libc::EIO);
    let mut pattr: ibv_port_attr = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { ibv_query_port(dev.ctx, 1, std::ptr::addr_of_mut!(pattr).cast()) },
        libc::EIO
    );

    // Every object can still be released, and its segment goes.
    assert_eq!(unsafe { ibv_destroy_qp(a) }, 0);
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert_eq!(unsafe { ibv_destroy_qp(c) }, 0);
    assert_eq!(unsafe { ibv_destroy_srq(srq) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)) }, 0);
    unsafe { ibv_ack_cq_events(cq, 0) };
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    assert_eq!(unsafe { ibv_destroy_comp_channel(ch) }, 0);
    assert_eq!(unsafe { ibv_dereg_mr(buf.mr) }, 0);
    assert_eq!(unsafe { ibv_dealloc_pd(dev.pd) }, 0);
    assert_eq!(unsafe { ibv_close_device(dev.ctx) }, 0);
    for s in &segs {
        assert!(!s.exists(), "{} leaked", s.display());
    }
}

#[test]
fn peer_of_dead_context_gets_retry_exceeded() {
    needs_launcher!("peer_of_dead_context_gets_retry_exceeded");
    let live = Dev::open();
    let doomed = Dev::open();
    let cq_l = live.cq(64, null_mut());
    let cq_d = doomed.cq(64, null_mut());
    let (a1, a2, a3) = (
        live.qp(cq_l, cq_l, null_mut()),
        live.qp(cq_l, cq_l, null_mut()),
        live.qp(cq_l, cq_l, null_mut()),
    );
    let (b1, b2, b3) = (
        doomed.qp(cq_d, cq_d, null_mut()),
        doomed.qp(cq_d, cq_d, null_mut()),
        doomed.qp(cq_d, cq_d, null_mut()),
    );
    for (a, b) in [(a1, b1), (a2, b2), (a3, b3)] {
        connect(a, qpn(b));
        connect(b, qpn(a));
    }
    let src = Buf::new(&live, 64, 5);
    let target = Buf::new(&doomed, 64, 0);
    // The pair works before death.
    post_recv(b1, &target, 0, 8, 1);
    assert_eq!(post_send(a1, &src, 0, 8, 1, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(poll(cq_l, 1)[0].status, WC_SUCCESS);
    assert_eq!(poll(cq_d, 1)[0].status, WC_SUCCESS);
    // A send waiting for a receive (infinite RNR retry) when the device dies.
    assert_eq!(post_send(a1, &src, 0, 8, 2, send(WR_SEND, SIGNALED)), 0);
    poll_none(cq_l, Duration::from_millis(20));
    // A receive posted at b3 before death must not be consumed after it.
    post_recv(b3, &target, 8, 8, 3);

    assert_eq!(inject(doomed.ctx), 0);
    assert_eq!(
        async_event(doomed.ctx).0,
        ibv_event_type::IBV_EVENT_DEVICE_FATAL as u32
    );
    // The live context saw nothing.
    assert!(!fd_readable(unsafe { (*live.ctx).async_fd }, 0));

    let w = poll(cq_l, 1)[0];
    assert_eq!(
        (w.wr_id, w.status),
        (2, ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
        "the waiting send"
    );
    let wr = Send {
        remote_addr: target.addr(),
        rkey: target.rkey(),
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a2, &src, 0, 8, 4, wr), 0);
    let w = poll(cq_l, 1)[0];
    assert_eq!(
        (w.wr_id, w.status),
        (4, ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
        "a new WRITE"
    );
    assert_eq!(post_send(a3, &src, 0, 8, 5, send(WR_SEND, SIGNALED)), 0);
    let w = poll(cq_l, 1)[0];
    assert_eq!(
        (w.wr_id, w.status),
        (5, ibv_wc_status::IBV_WC_RETRY_EXC_ERR),
        "a new SEND"
    );
    assert!(
        target.data[..16]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == if i < 8 { 5 } else { 0 }),
        "nothing written after death"
    );
    // The live context is still fine: its QPs are in ERR, new ones work.
    let (x, y) = (
        live.qp(cq_l, cq_l, null_mut()),
        live.qp(cq_l, cq_l, null_mut()),
    );
    connect(x, qpn(y));
    connect(y, qpn(x));
    let rb = Buf::new(&live, 8, 0);
    post_recv(y, &rb, 0, 8, 6);
    assert_eq!(post_send(x, &src, 0, 8, 7, send(WR_SEND, SIGNALED)), 0);
    let mut got = poll(cq_l, 2);
    got.sort_by_key(|w| w.wr_id);
    assert!(got.iter().all(|w| w.status == WC_SUCCESS), "{got:?}");

    for q in [a1, a2, a3, b1, b2, b3, x, y] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_cq(cq_d) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(cq_l) }, 0);
    for mr in [src.mr, rb.mr, target.mr] {
        assert_eq!(unsafe { ibv_dereg_mr(mr) }, 0);
    }
    for d in [&live, &doomed] {
        assert_eq!(unsafe { ibv_dealloc_pd(d.pd) }, 0);
        assert_eq!(unsafe { ibv_close_device(d.ctx) }, 0);
    }
}
