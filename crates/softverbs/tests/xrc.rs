//! Extended reliable connections through the real libibverbs (rdma-sys):
//! a domain named by a file and opened by two contexts, an XRC SRQ in one,
//! the XRC_RECV QP in the other, an XRC_SEND requester naming the SRQ.
//! Run under `softverbs-run` (the CI script does); skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::os::fd::AsRawFd;
use std::ptr::null_mut;

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

fn vctx(ctx: *mut ibv_context) -> *mut verbs_context {
    unsafe {
        let off = std::mem::offset_of!(verbs_context, context);
        ctx.cast::<u8>().sub(off).cast::<verbs_context>()
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn open_xrcd(dev: &Dev, fd: i32) -> *mut ibv_xrcd {
    open_xrcd_with(dev, fd, libc::O_CREAT)
}

fn open_xrcd_with(dev: &Dev, fd: i32, oflags: i32) -> *mut ibv_xrcd {
    let f = unsafe { (*vctx(dev.ctx)).open_xrcd.expect("open_xrcd slot") };
    let mut a = ibv_xrcd_init_attr {
        comp_mask: (ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_FD.0
            | ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_OFLAGS.0),
        fd,
        oflags,
    };
    unsafe { f(dev.ctx, &mut a) }
}

fn xrc_srq(dev: &Dev, xrcd: *mut ibv_xrcd, cq: *mut ibv_cq) -> (*mut ibv_srq, u32) {
    let f = unsafe { (*vctx(dev.ctx)).create_srq_ex.expect("create_srq_ex slot") };
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
    assert!(!srq.is_null(), "XRC SRQ: errno {}", errno());
    let num = unsafe { (*vctx(dev.ctx)).get_srq_num.expect("get_srq_num slot") };
    let mut n = 0;
    assert_eq!(unsafe { num(srq, &mut n) }, 0);
    (srq, n)
}

fn xrc_recv_qp(dev: &Dev, xrcd: *mut ibv_xrcd) -> *mut ibv_qp {
    let f = unsafe { (*vctx(dev.ctx)).create_qp_ex.expect("create_qp_ex slot") };
    let mut a: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    a.qp_type = ibv_qp_type::IBV_QPT_XRC_RECV;
    a.comp_mask = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_XRCD.0;
    a.xrcd = xrcd;
    let qp = unsafe { f(dev.ctx, &mut a) };
    assert!(!qp.is_null(), "XRC_RECV QP: errno {}", errno());
    qp
}

#[allow(clippy::too_many_arguments)]
fn xrc_send(
    qp: *mut ibv_qp,
    buf: &Buf,
    len: u32,
    wr_id: u64,
    opcode: u32,
    srqn: u32,
    raddr: u64,
    rkey: u32,
) -> i32 {
    let mut sge = ibv_sge {
        addr: buf.addr(),
        length: len,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = SIGNALED;
    wr.wr.rdma = rdma_t {
        remote_addr: raddr,
        rkey,
    };
    wr.qp_type.xrc.remote_srqn = srqn;
    let mut bad = null_mut();
    unsafe { ibv_post_send(qp, &mut wr, &mut bad) }
}

#[test]
fn xrc_requests_reach_the_srq_they_name_in_a_shared_domain() {
    needs_launcher!("xrc_requests_reach_the_srq_they_name_in_a_shared_domain");
    let path = std::env::temp_dir().join(format!("softverbs-xrc-test-{}", std::process::id()));
    let file = std::fs::File::create(&path).expect("domain file");
    let target = Dev::open();
    let other = Dev::open();
    // One domain, opened by two contexts through the same file.
    let xrcd_t = open_xrcd(&target, file.as_raw_fd());
    let xrcd_o = open_xrcd(&other, file.as_raw_fd());
    assert!(!xrcd_t.is_null() && !xrcd_o.is_null());
    // A private domain needs O_CREAT; a bad fd is EBADF.
    let f = unsafe { (*vctx(target.ctx)).open_xrcd.expect("slot") };
    let mut bad = ibv_xrcd_init_attr {
        comp_mask: 3,
        fd: -1,
        oflags: 0,
    };
    assert!(unsafe { f(target.ctx, &mut bad) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    bad.fd = 9999;
    bad.oflags = libc::O_CREAT;
    assert!(unsafe { f(target.ctx, &mut bad) }.is_null());
    assert_eq!(errno(), libc::EBADF);
    let private = open_xrcd(&target, -1);
    assert!(!private.is_null());
    // The domain exists while a context holds it: O_EXCL finds it; a file
    // nobody opened has none to join without O_CREAT.
    let excl = libc::O_CREAT | libc::O_EXCL;
    assert!(open_xrcd_with(&target, file.as_raw_fd(), excl).is_null());
    assert_eq!(errno(), libc::EEXIST);
    let path2 = std::env::temp_dir().join(format!("softverbs-xrc-test2-{}", std::process::id()));
    let file2 = std::fs::File::create(&path2).expect("second file");
    assert!(open_xrcd_with(&target, file2.as_raw_fd(), 0).is_null());
    assert_eq!(errno(), libc::ENOENT);

    // The SRQ and its CQ in the target context; the XRC_RECV QP in the
    // other one, through its own handle on the domain.
    let srq_cq = target.cq(16, null_mut());
    let (srq, srqn) = xrc_srq(&target, xrcd_t, srq_cq);
    let (lone, lone_n) = xrc_srq(&target, private, srq_cq);
    let recv = xrc_recv_qp(&other, xrcd_o);
    let send_cq = target.cq(16, null_mut());
    let send = target.qp_of(
        ibv_qp_type::IBV_QPT_XRC_SEND,
        send_cq,
        null_mut(),
        null_mut(),
    );
    connect(send, qpn(recv));
    connect(recv, qpn(send));

    let src = Buf::new(&target, 32, 0x42);
    let dst = Buf::new(&target, 32, 0);
    post_srq_recv(srq, &dst, 0, 32, 700);
    assert_eq!(xrc_send(send, &src, 20, 1, WR_SEND, srqn, 0, 0), 0);
    let w = poll(send_cq, 1);
    assert_eq!((w[0].wr_id, w[0].status), (1, WC_SUCCESS));
    let r = poll(srq_cq, 1);
    assert_eq!(
        (r[0].wr_id, r[0].status, r[0].byte_len),
        (700, WC_SUCCESS, 20)
    );
    assert_eq!((r[0].qp_num, r[0].src_qp), (qpn(recv), qpn(send)));
    assert_eq!(&dst.data[..20], &[0x42; 20]);
    // RDMA through the target reaches regions of the SRQ's PD.
    let region = Buf::new(&target, 16, 0);
    assert_eq!(
        xrc_send(
            send,
            &src,
            16,
            2,
            WR_WRITE,
            srqn,
            region.addr(),
            region.rkey()
        ),
        0
    );
    assert_eq!(poll(send_cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(&region.data[..], &[0x42; 16]);
    // XRC QPs have no receive queue; the target cannot send.
    let mut rwr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    let mut badr = null_mut();
    assert_eq!(
        unsafe { ibv_post_recv(send, &mut rwr, &mut badr) },
        libc::EINVAL
    );
    assert_eq!(
        unsafe { ibv_post_recv(recv, &mut rwr, &mut badr) },
        libc::EINVAL
    );
    assert_eq!(
        xrc_send(recv, &src, 4, 3, WR_SEND, srqn, 0, 0),
        libc::EINVAL
    );
    // An SRQ of another domain: the target rejects the request.
    assert_eq!(xrc_send(send, &src, 4, 4, WR_SEND, lone_n, 0, 0), 0);
    assert_eq!(
        poll(send_cq, 1)[0].status,
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR
    );
    unsafe {
        assert_eq!(ibv_destroy_qp(send), 0);
        assert_eq!(ibv_destroy_qp(recv), 0);
        assert_eq!(ibv_destroy_srq(srq), 0);
        assert_eq!(ibv_destroy_srq(lone), 0);
        let close = (*vctx(target.ctx)).close_xrcd.expect("close_xrcd slot");
        assert_eq!(close(xrcd_t), 0);
        assert_eq!(close(xrcd_o), 0);
        assert_eq!(close(private), 0);
        // Nobody holds the domain any more: O_EXCL creates it anew.
        let again = open_xrcd_with(&target, file.as_raw_fd(), excl);
        assert!(!again.is_null(), "errno {}", errno());
        assert_eq!(close(again), 0);
    }
    // A holder in another process holds the domain while it lives, and
    // lets go of it when it exits without closing (as the kernel's file
    // release does): a dead holder never keeps a domain alive, also not
    // for a later file that reuses the inode.
    let mut pipe = [0; 2];
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let (held_r, held_w) = (pipe[0], pipe[1]);
    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
    let (exit_r, exit_w) = (pipe[0], pipe[1]);
    // SAFETY: the child only opens the domain, writes a byte, reads one
    // and leaves with _exit, through the inherited context.
    let child = unsafe { libc::fork() };
    assert!(child >= 0, "fork: errno {}", errno());
    if child == 0 {
        unsafe { libc::close(exit_w) };
        let x = open_xrcd(&target, file.as_raw_fd());
        let mut b = [u8::from(!x.is_null())];
        unsafe {
            libc::write(held_w, b.as_ptr().cast(), 1);
            libc::read(exit_r, b.as_mut_ptr().cast(), 1);
            libc::_exit(0);
        }
    }
    let mut b = [0u8];
    assert_eq!(unsafe { libc::read(held_r, b.as_mut_ptr().cast(), 1) }, 1);
    assert_eq!(b[0], 1, "the child could not open the domain");
    assert!(open_xrcd_with(&target, file.as_raw_fd(), excl).is_null());
    assert_eq!(errno(), libc::EEXIST);
    unsafe { libc::close(exit_w) };
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "the child did not exit cleanly: status {status:#x}"
    );
    let after = open_xrcd_with(&target, file.as_raw_fd(), excl);
    assert!(
        !after.is_null(),
        "a dead holder kept the domain: errno {}",
        errno()
    );
    // Without O_CREAT the held domain is joined.
    let joined = open_xrcd_with(&target, file.as_raw_fd(), 0);
    assert!(!joined.is_null(), "errno {}", errno());
    unsafe {
        let close = (*vctx(target.ctx)).close_xrcd.expect("close_xrcd slot");
        assert_eq!(close(joined), 0);
        assert_eq!(close(after), 0);
        libc::close(held_r);
        libc::close(held_w);
        libc::close(exit_r);
    }
    drop(file);
    drop(file2);
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_file(&path2);
}
