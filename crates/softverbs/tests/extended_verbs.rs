//! The extended verbs through the real libibverbs (rdma-sys), in one
//! process: `ibv_create_qp_ex` and the `ibv_qp_ex` post API, on-demand
//! paging (implicit regions, `ibv_advise_mr`), `ibv_rereg_mr` and the CQ
//! clean of a QP moved to RESET, device memory, memory windows.
//! Run under `softverbs-run` (the CI script does); skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::ffi::c_void;
use std::ptr::null_mut;
use std::time::Duration;

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

/// The `verbs_context` of `ctx` (rdma-sys 0.3's own lookup is broken on
/// 64-bit, see `common::create_cq_ex`).
fn vctx(ctx: *mut ibv_context) -> *mut verbs_context {
    unsafe {
        assert_eq!((*ctx).abi_compat as usize, usize::MAX, "extended context");
        let off = std::mem::offset_of!(verbs_context, context);
        ctx.cast::<u8>().sub(off).cast::<verbs_context>()
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

const QP_EX_SEND: u64 = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0 as u64;
const QP_EX_WRITE: u64 = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0 as u64;
const QP_EX_READ: u64 = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0 as u64;
const QP_EX_FADD: u64 = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0 as u64;
const QP_EX_TSO: u64 = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_TSO.0 as u64;

fn create_qp_ex(dev: &Dev, cq: *mut ibv_cq, ty: u32, ops: u64) -> *mut ibv_qp {
    let mut a: ibv_qp_init_attr_ex = unsafe { std::mem::zeroed() };
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = ty;
    a.cap.max_send_wr = 16;
    a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = 2;
    a.cap.max_recv_sge = 2;
    a.cap.max_inline_data = 64;
    a.pd = dev.pd;
    a.comp_mask = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0
        | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;
    a.send_ops_flags = ops;
    let f = unsafe { (*vctx(dev.ctx)).create_qp_ex.expect("create_qp_ex slot") };
    unsafe { f(dev.ctx, &mut a) }
}

#[test]
fn qp_ex_posts_batches_and_fails_a_bad_batch_whole() {
    needs_launcher!("qp_ex_posts_batches_and_fails_a_bad_batch_whole");
    let dev = Dev::open();
    let ca = dev.cq(32, null_mut());
    let cb = dev.cq(32, null_mut());
    let a = create_qp_ex(
        &dev,
        ca,
        ibv_qp_type::IBV_QPT_RC,
        QP_EX_SEND | QP_EX_WRITE | QP_EX_READ | QP_EX_FADD,
    );
    assert!(!a.is_null(), "create_qp_ex: errno {}", errno());
    // An operation the transport or device cannot do is refused at creation.
    assert!(create_qp_ex(&dev, ca, ibv_qp_type::IBV_QPT_RC, QP_EX_TSO).is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    assert!(create_qp_ex(&dev, ca, ibv_qp_type::IBV_QPT_UD, QP_EX_WRITE).is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    let b = dev.qp(cb, cb, null_mut());
    connect_full(a, qpn(b), 14, 7, ACCESS_ATOMIC);
    connect_full(b, qpn(a), 14, 7, ACCESS_ATOMIC);
    let x = unsafe { ibv_qp_to_qp_ex(a) };
    assert!(!x.is_null(), "a QP made with send ops has an ibv_qp_ex");
    assert!(
        unsafe { ibv_qp_to_qp_ex(b) }.is_null(),
        "a plain QP has none"
    );

    let local = Buf::with_access(&dev, 64, 0x11, ACCESS_ATOMIC);
    let remote = Buf::with_access(&dev, 64, 0, ACCESS_ATOMIC);
    unsafe { std::ptr::write_volatile(remote.data.as_ptr().add(56) as *mut u64, 40) };
    post_recv(b, &remote, 0, 16, 500);
    let inline = *b"inline!!";
    unsafe {
        ibv_wr_start(x);
        (*x).wr_id = 1;
        (*x).wr_flags = SIGNALED;
        ibv_wr_send(x);
        ibv_wr_set_sge(x, local.lkey(), local.addr(), 16);
        (*x).wr_id = 2;
        ibv_wr_rdma_write(x, remote.rkey(), remote.addr() + 16);
        ibv_wr_set_inline_data(x, inline.as_ptr() as *mut c_void, inline.len());
        (*x).wr_id = 3;
        ibv_wr_atomic_fetch_add(x, remote.rkey(), remote.addr() + 56, 2);
        ibv_wr_set_sge(x, local.lkey(), local.addr() + 48, 8);
        assert_eq!(ibv_wr_complete(x), 0);
    }
    let wcs = poll(ca, 3);
    let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status, w.opcode)).collect();
    assert_eq!(
        got,
        vec![
            (1, WC_SUCCESS, ibv_wc_opcode::IBV_WC_SEND),
            (2, WC_SUCCESS, ibv_wc_opcode::IBV_WC_RDMA_WRITE),
            (3, WC_SUCCESS, ibv_wc_opcode::IBV_WC_FETCH_ADD),
        ]
    );
    let r = poll(cb, 1);
    assert_eq!((r[0].wr_id, r[0].byte_len), (500, 16));
    assert_eq!(&remote.data[..16], &[0x11; 16]);
    assert_eq!(&remote.data[16..24], b"inline!!");
    assert_eq!(word(&local, 48), 40);
    assert_eq!(word(&remote, 56), 42);

    // An operation the QP was not created for fails the batch, none of it
    // is posted; an aborted batch posts nothing either.
    unsafe {
        ibv_wr_start(x);
        (*x).wr_id = 4;
        (*x).wr_flags = SIGNALED;
        ibv_wr_rdma_read(x, remote.rkey(), remote.addr());
        ibv_wr_set_sge(x, local.lkey(), local.addr(), 8);
        (*x).wr_id = 5;
        ibv_wr_send_imm(x, 7);
        assert_eq!(ibv_wr_complete(x), libc::EINVAL);
        ibv_wr_start(x);
        (*x).wr_id = 6;
        ibv_wr_send(x);
        ibv_wr_abort(x);
    }
    poll_none(ca, Duration::from_millis(50));
    // The QP is still usable.
    unsafe {
        ibv_wr_start(x);
        (*x).wr_id = 7;
        (*x).wr_flags = SIGNALED;
        ibv_wr_rdma_read(x, remote.rkey(), remote.addr() + 16);
        ibv_wr_set_sge(x, local.lkey(), local.addr(), 8);
        assert_eq!(ibv_wr_complete(x), 0);
    }
    let w = poll(ca, 1);
    assert_eq!((w[0].wr_id, w[0].status), (7, WC_SUCCESS));
    assert_eq!(&local.data[..8], b"inline!!");
}

#[test]
fn odp_implicit_region_serves_any_address_and_prefetch_checks_its_ranges() {
    needs_launcher!("odp_implicit_region_serves_any_address_and_prefetch_checks_its_ranges");
    let dev = Dev::open();
    let mut attr: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    assert_eq!(query_device_ex(dev.ctx, &mut attr), 0);
    let odp = attr.odp_caps;
    assert_eq!(odp.general_caps, 3, "ODP and implicit ODP");
    assert_eq!(odp.per_transport_caps.rc_odp_caps, 0x3f);
    let on_demand = ibv_access_flags::IBV_ACCESS_ON_DEMAND.0 as i32;
    // Implicit: NULL and SIZE_MAX, only with ON_DEMAND.
    let bad = unsafe { ibv_reg_mr(dev.pd, null_mut(), usize::MAX, ACCESS_ALL) };
    assert!(bad.is_null());
    assert_eq!(errno(), libc::EINVAL);
    let all = unsafe { ibv_reg_mr(dev.pd, null_mut(), usize::MAX, ACCESS_ALL | on_demand) };
    assert!(!all.is_null(), "implicit ODP region: errno {}", errno());
    let cq = dev.cq(16, null_mut());
    let a = dev.qp(cq, cq, null_mut());
    let b = dev.qp(cq, cq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let src = Buf::new(&dev, 32, 0x5a);
    // Memory registered nowhere else, named by the implicit region's key.
    let target = vec![0u8; 4096];
    let s = Send {
        remote_addr: target.as_ptr() as u64 + 100,
        rkey: unsafe { (*all).rkey },
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a, &src, 0, 32, 1, s), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(
        unsafe { std::ptr::read_volatile(target.as_ptr().add(100)) },
        0x5a
    );
    assert_eq!(target[132], 0);
    // Prefetch: ranges of ODP regions of this PD only.
    let advise = unsafe { (*vctx(dev.ctx)).advise_mr.expect("advise_mr slot") };
    let mut sge = ibv_sge {
        addr: target.as_ptr() as u64,
        length: 4096,
        lkey: unsafe { (*all).lkey },
    };
    let write = ib_uverbs_advise_mr_advice::IB_UVERBS_ADVISE_MR_ADVICE_PREFETCH_WRITE;
    let flush = 1; // IBV_ADVISE_MR_FLAG_FLUSH
    assert_eq!(unsafe { advise(dev.pd, write, flush, &mut sge, 1) }, 0);
    assert_eq!(
        unsafe { advise(dev.pd, write, 2, &mut sge, 1) },
        libc::EINVAL
    );
    let mut not_odp = ibv_sge {
        addr: src.addr(),
        length: 32,
        lkey: src.lkey(),
    };
    assert_eq!(
        unsafe { advise(dev.pd, write, flush, &mut not_odp, 1) },
        libc::EINVAL
    );
    assert_eq!(unsafe { ibv_dereg_mr(all) }, 0);
}

fn rereg(mr: *mut ibv_mr, flags: i32, addr: *mut c_void, len: usize, access: i32) -> i32 {
    unsafe { ibv_rereg_mr(mr, flags, null_mut(), addr, len, access) }
}

fn reset(qp: *mut ibv_qp) {
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = ibv_qp_state::IBV_QPS_RESET;
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32) },
        0
    );
}

#[test]
fn rereg_changes_access_and_translation_and_reset_drops_old_completions() {
    needs_launcher!("rereg_changes_access_and_translation_and_reset_drops_old_completions");
    let dev = Dev::open();
    let ca = dev.cq(16, null_mut());
    let cb = dev.cq(16, null_mut());
    let a = dev.qp(ca, ca, null_mut());
    let b = dev.qp(cb, cb, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let src = Buf::new(&dev, 16, 7);
    let dst = Buf::new(&dev, 16, 0);
    let key = dst.rkey();
    let write = |off: u64| Send {
        remote_addr: dst.addr() + off,
        rkey: key,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a, &src, 0, 16, 1, write(0)), 0);
    assert_eq!(poll(ca, 1)[0].status, WC_SUCCESS);
    let local_only = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
    let change_access = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 as i32;
    let change_translation = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_TRANSLATION.0 as i32;
    assert_eq!(rereg(dst.mr, change_access, null_mut(), 0, local_only), 0);
    assert_eq!(unsafe { (*dst.mr).rkey }, key, "keys survive a rereg");
    // A receive waiting on the requester: flushed when it enters ERR.
    post_recv(a, &src, 0, 16, 99);
    assert_eq!(post_send(a, &src, 0, 16, 2, write(0)), 0);
    let w = poll(ca, 2);
    assert_eq!((w[0].wr_id, w[0].status), (2, WC_REM_ACCESS));
    assert_eq!((w[1].wr_id, w[1].status), (99, WC_FLUSH));
    // Once more with the flush still in the CQ: RESET removes it.
    post_recv(a, &src, 0, 16, 98);
    reset(a);
    reset(b);
    connect(a, qpn(b));
    connect(b, qpn(a));
    poll_none(ca, Duration::from_millis(20));
    // Move the region to another buffer, remote write allowed again: the
    // same key now names the new memory.
    let mut other = vec![0u8; 16];
    assert_eq!(
        rereg(
            dst.mr,
            change_access | change_translation,
            other.as_mut_ptr().cast(),
            16,
            ACCESS_ALL
        ),
        0
    );
    let s = Send {
        remote_addr: other.as_ptr() as u64,
        rkey: key,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a, &src, 0, 16, 3, s), 0);
    assert_eq!(poll(ca, 1)[0].status, WC_SUCCESS);
    assert_eq!(unsafe { std::ptr::read_volatile(other.as_ptr()) }, 7);
    // Bad flags are refused (libibverbs' IBV_REREG_MR_ERR_INPUT).
    assert_ne!(rereg(dst.mr, 0, null_mut(), 0, 0), 0);
}

#[test]
fn device_memory_copies_registers_and_takes_remote_writes() {
    needs_launcher!("device_memory_copies_registers_and_takes_remote_writes");
    let dev = Dev::open();
    let mut attr: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    assert_eq!(query_device_ex(dev.ctx, &mut attr), 0);
    let max = attr.max_dm_size;
    assert!(max >= 4096, "max_dm_size {max}");
    let v = vctx(dev.ctx);
    let alloc = unsafe { (*v).alloc_dm.expect("alloc_dm slot") };
    let free = unsafe { (*v).free_dm.expect("free_dm slot") };
    let reg = unsafe { (*v).reg_dm_mr.expect("reg_dm_mr slot") };
    let mut da = ibv_alloc_dm_attr {
        length: (max + 1) as usize,
        log_align_req: 0,
        comp_mask: 0,
    };
    assert!(unsafe { alloc(dev.ctx, &mut da) }.is_null());
    assert_eq!(errno(), libc::ENOMEM);
    da.length = 256;
    da.comp_mask = 1;
    assert!(unsafe { alloc(dev.ctx, &mut da) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    da.comp_mask = 0;
    let dm = unsafe { alloc(dev.ctx, &mut da) };
    assert!(!dm.is_null());
    let pattern: Vec<u8> = (0..256u32).map(|i| i as u8).collect();
    unsafe {
        assert_eq!(ibv_memcpy_to_dm(dm, 0, pattern.as_ptr().cast(), 256), 0);
        assert_eq!(
            ibv_memcpy_to_dm(dm, 3, pattern.as_ptr().cast(), 4),
            libc::EINVAL
        );
        assert_eq!(
            ibv_memcpy_to_dm(dm, 256, pattern.as_ptr().cast(), 4),
            libc::EFAULT
        );
        let mut back = vec![0u8; 256];
        assert_eq!(ibv_memcpy_from_dm(back.as_mut_ptr().cast(), dm, 0, 256), 0);
        assert_eq!(back, pattern);
    }
    let zero_based = ibv_access_flags::IBV_ACCESS_ZERO_BASED.0;
    let access = zero_based | ACCESS_ALL as u32;
    assert!(
        unsafe { reg(dev.pd, dm, 0, 64, ACCESS_ALL as u32) }.is_null(),
        "not zero-based"
    );
    assert!(
        unsafe { reg(dev.pd, dm, 200, 64, access) }.is_null(),
        "past the end"
    );
    let mr = unsafe { reg(dev.pd, dm, 64, 128, access) };
    assert!(!mr.is_null());
    assert!(
        unsafe { (*mr).addr }.is_null(),
        "zero-based: the first byte is 0"
    );
    assert_eq!(unsafe { (*mr).length }, 128);
    assert_eq!(unsafe { free(dm) }, libc::EBUSY, "a region lies in it");

    let cq = dev.cq(16, null_mut());
    let a = dev.qp(cq, cq, null_mut());
    let b = dev.qp(cq, cq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    // A peer writes into the device memory: byte 16 of the region is
    // byte 80 of the memory.
    let src = Buf::new(&dev, 8, 0xee);
    let s = Send {
        remote_addr: 16,
        rkey: unsafe { (*mr).rkey },
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a, &src, 0, 8, 1, s), 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    let mut back = [0u8; 16];
    assert_eq!(
        unsafe { ibv_memcpy_from_dm(back.as_mut_ptr().cast(), dm, 76, 16) },
        0
    );
    assert_eq!(&back[..4], &pattern[76..80]);
    assert_eq!(&back[4..12], &[0xee; 8]);
    assert_eq!(&back[12..], &pattern[88..92]);
    // Sent from the device memory (its lkey, zero-based addresses).
    let dst = Buf::new(&dev, 8, 0);
    post_recv(b, &dst, 0, 8, 7);
    let mut sge = ibv_sge {
        addr: 0,
        length: 8,
        lkey: unsafe { (*mr).lkey },
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 2;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = WR_SEND;
    wr.send_flags = SIGNALED;
    let mut badwr = null_mut();
    assert_eq!(unsafe { ibv_post_send(a, &mut wr, &mut badwr) }, 0);
    let w = poll(cq, 2);
    assert!(w.iter().all(|w| w.status == WC_SUCCESS), "{w:?}");
    assert_eq!(&dst.data[..], &pattern[64..72]);
    assert_eq!(unsafe { ibv_dereg_mr(mr) }, 0);
    assert_eq!(unsafe { free(dm) }, 0);
}

fn bind_type2(qp: *mut ibv_qp, mw: *mut ibv_mw, buf: &Buf, off: u64, len: u64, wr_id: u64) -> u32 {
    let rkey = unsafe { ibv_inc_rkey((*mw).rkey) };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = ibv_wr_opcode::IBV_WR_BIND_MW;
    wr.send_flags = SIGNALED;
    wr.bind_mw_tso_union.bind_mw = bind_mw_t {
        mw,
        rkey,
        bind_info: ibv_mw_bind_info {
            mr: buf.mr,
            addr: buf.addr() + off,
            length: len,
            mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        },
    };
    let mut bad = null_mut();
    assert_eq!(unsafe { ibv_post_send(qp, &mut wr, &mut bad) }, 0);
    rkey
}

fn post_inv(qp: *mut ibv_qp, opcode: u32, rkey: u32, wr_id: u64) {
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.opcode = opcode;
    wr.send_flags = SIGNALED;
    wr.imm_data_invalidated_rkey_union.invalidated_rkey = rkey;
    let mut bad = null_mut();
    assert_eq!(unsafe { ibv_post_send(qp, &mut wr, &mut bad) }, 0);
}

#[test]
fn memory_windows_bind_grant_and_invalidate() {
    needs_launcher!("memory_windows_bind_grant_and_invalidate");
    let dev = Dev::open();
    let mw_bind = ibv_access_flags::IBV_ACCESS_MW_BIND.0 as i32;
    let buf = Buf::with_access(
        &dev,
        64,
        0,
        ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32 | mw_bind,
    );
    let src = Buf::new(&dev, 64, 0x33);
    let alloc = |t| unsafe { ibv_alloc_mw(dev.pd, t) }.expect("alloc_mw op");
    assert!(alloc(3).is_null(), "no type 3");
    assert_eq!(errno(), libc::EINVAL);
    let pair = || {
        let ca = dev.cq(16, null_mut());
        let cb = dev.cq(16, null_mut());
        let a = dev.qp(ca, ca, null_mut());
        let b = dev.qp(cb, cb, null_mut());
        connect(a, qpn(b));
        connect(b, qpn(a));
        (ca, a, cb, b)
    };
    let write = |qp, key: u32, off: u64, len: u32, id| {
        let s = Send {
            remote_addr: buf.addr() + off,
            rkey: key,
            ..send(WR_WRITE, SIGNALED)
        };
        assert_eq!(post_send(qp, &src, 0, len, id, s), 0);
    };

    // Type 1: ibv_bind_mw on any QP of the PD, usable through every QP.
    let (ca, a, cb, b) = pair();
    let mw1 = alloc(ibv_mw_type::IBV_MW_TYPE_1);
    let before = unsafe { (*mw1).rkey };
    let mut bind = ibv_mw_bind {
        wr_id: 10,
        send_flags: SIGNALED,
        bind_info: ibv_mw_bind_info {
            mr: buf.mr,
            addr: buf.addr() + 16,
            length: 32,
            mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
        },
    };
    assert_eq!(unsafe { ibv_bind_mw(b, mw1, &mut bind) }, 0);
    let w = poll(cb, 1);
    assert_eq!(
        (w[0].wr_id, w[0].status, w[0].opcode),
        (10, WC_SUCCESS, ibv_wc_opcode::IBV_WC_BIND_MW)
    );
    let k1 = unsafe { (*mw1).rkey };
    assert_eq!(k1, unsafe { ibv_inc_rkey(before) });
    write(a, k1, 16, 32, 1);
    assert_eq!(poll(ca, 1)[0].status, WC_SUCCESS);
    assert_eq!(&buf.data[16..48], &[0x33; 32]);
    assert_eq!(buf.data[15], 0);
    // The region itself grants no remote access, and a region with a
    // window bound cannot go.
    assert_eq!(unsafe { ibv_dereg_mr(buf.mr) }, libc::EBUSY);
    let change_access = ibv_rereg_mr_flags::IBV_REREG_MR_CHANGE_ACCESS.0 as i32;
    assert_ne!(
        unsafe { ibv_rereg_mr(buf.mr, change_access, null_mut(), null_mut(), 0, ACCESS_ALL) },
        0,
        "a region with a window bound keeps its translation"
    );
    write(a, k1, 40, 16, 2); // past the window's end
    assert_eq!(poll(ca, 1)[0].status, WC_REM_ACCESS);

    // Type 2: bound by a work request to one QP; LOCAL_INV on it ends it.
    let (ca, a, cb, b) = pair();
    let mw2 = alloc(ibv_mw_type::IBV_MW_TYPE_2);
    let k2 = bind_type2(b, mw2, &buf, 0, 64, 20);
    let w = poll(cb, 1);
    assert_eq!(
        (w[0].status, w[0].opcode),
        (WC_SUCCESS, ibv_wc_opcode::IBV_WC_BIND_MW)
    );
    write(a, k2, 0, 8, 3);
    assert_eq!(poll(ca, 1)[0].status, WC_SUCCESS);
    // Bound already: binding it again is an error (and the QP's end).
    let (_, _, cc, c) = pair();
    bind_type2(c, mw2, &buf, 0, 64, 21);
    assert_eq!(poll(cc, 1)[0].status, ibv_wc_status::IBV_WC_MW_BIND_ERR);
    post_inv(b, ibv_wr_opcode::IBV_WR_LOCAL_INV, k2, 22);
    let w = poll(cb, 1);
    assert_eq!(
        (w[0].status, w[0].opcode),
        (WC_SUCCESS, ibv_wc_opcode::IBV_WC_LOCAL_INV)
    );
    write(a, k2, 0, 8, 4);
    assert_eq!(poll(ca, 1)[0].status, WC_REM_ACCESS);

    // Type 2 again, ended by the peer's SEND with invalidate.
    let (ca, a, cb, b) = pair();
    let k3 = bind_type2(b, mw2, &buf, 0, 64, 30);
    assert_eq!(poll(cb, 1)[0].status, WC_SUCCESS);
    post_recv(b, &src, 0, 64, 31);
    post_inv(a, ibv_wr_opcode::IBV_WR_SEND_WITH_INV, k3, 5);
    assert_eq!(poll(ca, 1)[0].status, WC_SUCCESS);
    let r = poll(cb, 1);
    assert_eq!(r[0].status, WC_SUCCESS);
    assert_ne!(r[0].wc_flags & ibv_wc_flags::IBV_WC_WITH_INV.0, 0);
    assert_eq!(r[0].imm, k3, "invalidated_rkey");
    write(a, k3, 0, 8, 6);
    assert_eq!(poll(ca, 1)[0].status, WC_REM_ACCESS);
    assert_eq!(unsafe { ibv_dealloc_mw(mw2) }, 0);

    // Unbinding the type-1 window (zero length) frees the region.
    let mut unbind = ibv_mw_bind {
        wr_id: 11,
        send_flags: SIGNALED,
        bind_info: ibv_mw_bind_info {
            mr: buf.mr,
            addr: buf.addr(),
            length: 0,
            mw_access_flags: 0,
        },
    };
    let (_, _, cd, d) = pair();
    assert_eq!(unsafe { ibv_bind_mw(d, mw1, &mut unbind) }, 0);
    assert_eq!(poll(cd, 1)[0].status, WC_SUCCESS);
    assert_eq!(unsafe { ibv_dealloc_mw(mw1) }, 0);
    assert_eq!(unsafe { ibv_dereg_mr(buf.mr) }, 0);
}

#[test]
fn qp_ex_binds_and_invalidates_windows() {
    needs_launcher!("qp_ex_binds_and_invalidates_windows");
    let dev = Dev::open();
    let ca = dev.cq(16, null_mut());
    let cb = dev.cq(16, null_mut());
    let bind = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_BIND_MW.0 as u64;
    let inv = ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_LOCAL_INV.0 as u64;
    let a = dev.qp(ca, ca, null_mut());
    let b = create_qp_ex(&dev, cb, ibv_qp_type::IBV_QPT_RC, bind | inv);
    assert!(!b.is_null());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let mw_bind = ibv_access_flags::IBV_ACCESS_MW_BIND.0 as i32;
    let buf = Buf::with_access(&dev, 32, 0, ACCESS_ALL | mw_bind);
    let src = Buf::new(&dev, 32, 9);
    let mw = unsafe { ibv_alloc_mw(dev.pd, ibv_mw_type::IBV_MW_TYPE_2) }.expect("op");
    assert!(!mw.is_null());
    let key = unsafe { ibv_inc_rkey((*mw).rkey) };
    let info = ibv_mw_bind_info {
        mr: buf.mr,
        addr: buf.addr(),
        length: 32,
        mw_access_flags: ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0,
    };
    let x = unsafe { ibv_qp_to_qp_ex(b) };
    unsafe {
        ibv_wr_start(x);
        (*x).wr_id = 1;
        (*x).wr_flags = SIGNALED;
        ibv_wr_bind_mw(x, mw, key, &info);
        assert_eq!(ibv_wr_complete(x), 0);
    }
    let w = poll(cb, 1);
    assert_eq!(
        (w[0].status, w[0].opcode),
        (WC_SUCCESS, ibv_wc_opcode::IBV_WC_BIND_MW)
    );
    let s = Send {
        remote_addr: buf.addr(),
        rkey: key,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a, &src, 0, 32, 2, s), 0);
    assert_eq!(poll(ca, 1)[0].status, WC_SUCCESS);
    assert_eq!(&buf.data[..], &[9; 32]);
    unsafe {
        ibv_wr_start(x);
        (*x).wr_id = 3;
        (*x).wr_flags = SIGNALED;
        ibv_wr_local_inv(x, key);
        assert_eq!(ibv_wr_complete(x), 0);
    }
    let w = poll(cb, 1);
    assert_eq!(
        (w[0].status, w[0].opcode),
        (WC_SUCCESS, ibv_wc_opcode::IBV_WC_LOCAL_INV)
    );
    let s = Send {
        remote_addr: buf.addr(),
        rkey: key,
        ..send(WR_WRITE, SIGNALED)
    };
    assert_eq!(post_send(a, &src, 0, 32, 4, s), 0);
    assert_eq!(poll(ca, 1)[0].status, WC_REM_ACCESS);
    assert_eq!(unsafe { ibv_dealloc_mw(mw) }, 0);
}

#[test]
fn parent_and_thread_domains_serve_as_protection_domains() {
    needs_launcher!("parent_and_thread_domains_serve_as_protection_domains");
    let dev = Dev::open();
    let v = vctx(dev.ctx);
    let alloc_td = unsafe { (*v).alloc_td.expect("alloc_td slot") };
    let dealloc_td = unsafe { (*v).dealloc_td.expect("dealloc_td slot") };
    let alloc_pad = unsafe { (*v).alloc_parent_domain.expect("alloc_parent_domain slot") };
    let mut ta = ibv_td_init_attr { comp_mask: 1 };
    assert!(unsafe { alloc_td(dev.ctx, &mut ta) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    ta.comp_mask = 0;
    let td = unsafe { alloc_td(dev.ctx, &mut ta) };
    assert!(!td.is_null());
    let mut pa: ibv_parent_domain_init_attr = unsafe { std::mem::zeroed() };
    assert!(unsafe { alloc_pad(dev.ctx, &mut pa) }.is_null(), "no PD");
    assert_eq!(errno(), libc::EINVAL);
    pa.pd = dev.pd;
    pa.td = td;
    let pad = unsafe { alloc_pad(dev.ctx, &mut pa) };
    assert!(!pad.is_null());
    // A parent domain cannot parent another.
    pa.pd = pad;
    assert!(unsafe { alloc_pad(dev.ctx, &mut pa) }.is_null());
    // QPs and regions in the parent domain interoperate with those of its
    // PD: the parent domain protects with the PD's id.
    let cq = dev.cq(16, null_mut());
    let mut qa: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    qa.send_cq = cq;
    qa.recv_cq = cq;
    qa.qp_type = ibv_qp_type::IBV_QPT_RC;
    qa.cap.max_send_wr = 8;
    qa.cap.max_recv_wr = 8;
    qa.cap.max_send_sge = 1;
    qa.cap.max_recv_sge = 1;
    let a = unsafe { ibv_create_qp(pad, &mut qa) };
    assert!(!a.is_null());
    let b = dev.qp(cq, cq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let mut data = vec![3u8; 16];
    let mr = unsafe { ibv_reg_mr(pad, data.as_mut_ptr().cast(), 16, ACCESS_ALL) };
    assert!(!mr.is_null());
    let dst = Buf::new(&dev, 16, 0);
    let mut sge = ibv_sge {
        addr: data.as_ptr() as u64,
        length: 16,
        lkey: unsafe { (*mr).lkey },
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = 1;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = WR_WRITE;
    wr.send_flags = SIGNALED;
    wr.wr.rdma = rdma_t {
        remote_addr: dst.addr(),
        rkey: dst.rkey(),
    };
    let mut bad = null_mut();
    assert_eq!(unsafe { ibv_post_send(a, &mut wr, &mut bad) }, 0);
    assert_eq!(poll(cq, 1)[0].status, WC_SUCCESS);
    assert_eq!(&dst.data[..], &[3; 16]);
    // An extended CQ may name the parent domain, and only a parent domain.
    let mut ca: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    ca.cqe = 4;
    ca.comp_mask = ibv_cq_init_attr_mask::IBV_CQ_INIT_ATTR_MASK_PD.0;
    ca.parent_domain = dev.pd;
    assert!(create_cq_ex(dev.ctx, &mut ca).is_null());
    assert_eq!(errno(), libc::EINVAL);
    ca.parent_domain = pad;
    let cqx = create_cq_ex(dev.ctx, &mut ca);
    assert!(!cqx.is_null());
    unsafe {
        assert_eq!(ibv_destroy_cq(ibv_cq_ex_to_cq(cqx)), 0);
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        assert_eq!(ibv_dealloc_pd(pad), 0);
        assert_eq!(dealloc_td(td), 0);
    }
}

#[test]
fn resize_cq_grows_keeps_order_and_arm() {
    needs_launcher!("resize_cq_grows_keeps_order_and_arm");
    let dev = Dev::open();
    let ch = dev.channel();
    let scq = dev.cq(3, null_mut());
    let rcq = dev.cq(2, ch);
    let a = dev.qp(scq, scq, null_mut());
    let b = dev.qp(rcq, rcq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 64, 1);
    // Three completions wait in the send CQ (it holds 4).
    for id in 1..=3 {
        assert_eq!(post_send(a, &buf, 0, 8, id, send(WR_WRITE, SIGNALED)), 0);
    }
    let resize = |cq: *mut ibv_cq, n: i32| unsafe { ibv_resize_cq(cq, n) };
    assert_eq!(resize(scq, 2), libc::EINVAL, "fewer than the 3 waiting");
    assert_eq!(resize(scq, 0), libc::EINVAL);
    assert_eq!(resize(scq, 3), 0);
    assert!(unsafe { (*scq).cqe } >= 3);
    assert_eq!(resize(scq, 100), 0);
    assert!(unsafe { (*scq).cqe } >= 100);
    for id in 4..=40 {
        assert_eq!(post_send(a, &buf, 0, 8, id, send(WR_WRITE, SIGNALED)), 0);
    }
    let ids: Vec<u64> = poll(scq, 40).iter().map(|w| w.wr_id).collect();
    assert_eq!(
        ids,
        (1..=40).collect::<Vec<u64>>(),
        "in order across the rings"
    );
    // The receive CQ, armed, then grown: the peer's next receive
    // completion lands in the new ring and fires the arm.
    assert_eq!(unsafe { ibv_req_notify_cq(rcq, 0) }, 0);
    assert_eq!(resize(rcq, 64), 0);
    for id in 0..10 {
        post_recv(b, &buf, 0, 64, 100 + id);
    }
    let s = Send {
        imm: 5,
        ..send(WR_SEND_IMM, SIGNALED)
    };
    assert_eq!(post_send(a, &buf, 0, 8, 41, s), 0);
    assert!(readable(ch, 2000), "the arm survives the resize");
    get_event(ch, rcq);
    for _ in 0..9 {
        assert_eq!(post_send(a, &buf, 0, 8, 42, send(WR_SEND, SIGNALED)), 0);
    }
    let r: Vec<u64> = poll(rcq, 10).iter().map(|w| w.wr_id).collect();
    assert_eq!(r, (100..110).collect::<Vec<u64>>());
    assert_eq!(poll(scq, 10).len(), 10);
    unsafe {
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_destroy_cq(scq), 0);
        assert_eq!(ibv_destroy_cq(rcq), 0);
    }
}

/// The shared-memory segment of CQ `cq` (its `handle` is the segment id)
/// and its length in bytes.
fn cq_segment_len(cq: *mut ibv_cq) -> u64 {
    let dir = std::env::var_os("SOFTVERBS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/dev/shm/softverbs"));
    let path = dir.join(format!("cq-{}", unsafe { (*cq).handle }));
    std::fs::metadata(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .len()
}

/// `max_cqe` is mlx5's, 4Mi - 1 (libfabric's ofi_rxm asks for 262,144).
/// Every path agrees on it: `ibv_create_cq`, `ibv_create_cq_ex` and
/// `ibv_resize_cq` take sizes up to it and refuse one more; `cq->cqe`
/// never reports more than `max_cqe`, so it can be asked for again. A
/// CQ's memory is sized by the CQ (64-byte slots, a power of two of
/// them): a small one costs what it did.
#[test]
fn cq_sizes_up_to_max_cqe() {
    needs_launcher!("cq_sizes_up_to_max_cqe");
    let dev = Dev::open();
    let mut a: ibv_device_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_query_device(dev.ctx, &mut a) }, 0);
    let max = a.max_cqe;
    assert_eq!(max, (1 << 22) - 1, "max_cqe");
    let create = |n: i32| unsafe { ibv_create_cq(dev.ctx, n, null_mut(), null_mut(), 0) };
    let resize = |cq: *mut ibv_cq, n: i32| unsafe { ibv_resize_cq(cq, n) };
    // Header (64) + ring header (192) + 64 bytes per slot.
    let seg = |slots: u64| 256 + 64 * slots;

    let small = dev.cq(16, null_mut());
    assert_eq!(unsafe { (*small).cqe }, 16);
    assert_eq!(cq_segment_len(small), seg(16), "a small CQ's memory");
    assert!(create(max + 1).is_null());
    assert_eq!(errno(), libc::EINVAL, "create_cq above max_cqe");
    assert_eq!(resize(small, max + 1), libc::EINVAL, "resize above max_cqe");
    let mut attr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    attr.cqe = max as u32 + 1;
    assert!(create_cq_ex(dev.ctx, &mut attr).is_null());
    assert_eq!(errno(), libc::EINVAL, "create_cq_ex above max_cqe");

    // ofi_rxm's size, exactly a power of two.
    let rxm = create(262_144);
    assert!(!rxm.is_null(), "create_cq(262144): errno {}", errno());
    assert_eq!(unsafe { (*rxm).cqe }, 262_144);
    assert_eq!(cq_segment_len(rxm), seg(262_144));
    assert_eq!(unsafe { ibv_destroy_cq(rxm) }, 0);

    // The largest: 4Mi slots, reported as max_cqe, which resize accepts.
    let big = create(max);
    assert!(!big.is_null(), "create_cq(max_cqe): errno {}", errno());
    assert_eq!(unsafe { (*big).cqe }, max);
    assert_eq!(cq_segment_len(big), seg(1 << 22));
    assert_eq!(resize(big, unsafe { (*big).cqe }), 0);
    assert_eq!(unsafe { (*big).cqe }, max);
    assert_eq!(unsafe { ibv_destroy_cq(big) }, 0);
    attr.cqe = max as u32;
    let big_ex = create_cq_ex(dev.ctx, &mut attr);
    assert!(
        !big_ex.is_null(),
        "create_cq_ex(max_cqe): errno {}",
        errno()
    );
    assert_eq!(unsafe { (*big_ex).cqe }, max);
    assert_eq!(unsafe { ibv_destroy_cq(ibv_cq_ex_to_cq(big_ex)) }, 0);

    // A small CQ grown to the largest size, completions still flowing.
    assert_eq!(resize(small, max), 0);
    assert_eq!(unsafe { (*small).cqe }, max);
    let a_qp = dev.qp(small, small, null_mut());
    let b_qp = dev.qp(small, small, null_mut());
    connect(a_qp, qpn(b_qp));
    connect(b_qp, qpn(a_qp));
    let buf = Buf::new(&dev, 64, 1);
    assert_eq!(post_send(a_qp, &buf, 0, 8, 7, send(WR_WRITE, SIGNALED)), 0);
    assert_eq!(poll(small, 1)[0].wr_id, 7);
    unsafe {
        assert_eq!(ibv_destroy_qp(a_qp), 0);
        assert_eq!(ibv_destroy_qp(b_qp), 0);
        assert_eq!(ibv_destroy_cq(small), 0);
    }
}

/// `struct ibv_gid_entry` (verbs.h; rdma-sys 0.3 has no binding).
#[repr(C)]
#[derive(Default)]
struct GidEntry {
    gid: [u8; 16],
    gid_index: u32,
    port_num: u32,
    gid_type: u32,
    ndev_ifindex: u32,
}

extern "C" {
    fn _ibv_query_gid_ex(
        ctx: *mut ibv_context,
        port: u32,
        index: u32,
        entry: *mut GidEntry,
        flags: u32,
        entry_size: usize,
    ) -> i32;
    fn _ibv_query_gid_table(
        ctx: *mut ibv_context,
        entries: *mut GidEntry,
        max: usize,
        flags: u32,
        entry_size: usize,
    ) -> isize;
}

#[test]
fn gid_table_has_an_empty_entry_that_reads_as_no_data() {
    needs_launcher!("gid_table_has_an_empty_entry_that_reads_as_no_data");
    let dev = Dev::open();
    let mut pa: ibv_port_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ___ibv_query_port(dev.ctx, 1, &mut pa) }, 0);
    assert_eq!(pa.gid_tbl_len, 2);
    let sz = std::mem::size_of::<GidEntry>();
    let mut e = GidEntry::default();
    assert_eq!(
        unsafe { _ibv_query_gid_ex(dev.ctx, 1, 0, &mut e, 0, sz) },
        0
    );
    assert_eq!(&e.gid[..8], &[0xfe, 0x80, 0, 0, 0, 0, 0, 0]);
    assert_eq!(e.gid_type, 0, "IBV_GID_TYPE_IB");
    assert_eq!(
        unsafe { _ibv_query_gid_ex(dev.ctx, 1, 1, &mut e, 0, sz) },
        libc::ENODATA
    );
    let mut table: [GidEntry; 4] = Default::default();
    let n = unsafe { _ibv_query_gid_table(dev.ctx, table.as_mut_ptr(), 4, 0, sz) };
    assert_eq!(n, 1, "only the populated entry");
    assert_eq!(table[0].gid_index, 0);
}
