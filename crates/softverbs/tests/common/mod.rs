//! Helpers for the integration tests: thin wrappers over rdma-sys (the real
//! libibverbs), used exactly as an application would.
//!
//! These tests never link the softverbs library itself: the device must come
//! from libibverbs loading the provider, as for any program.
#![allow(dead_code, missing_docs, clippy::undocumented_unsafe_blocks)]
// The helpers are test scaffolding around FFI calls whose arguments are all
// built right here; each block calls libibverbs with live objects it made.

pub mod child;

use std::ffi::CStr;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

pub use rdma_sys::*;

/// True when running under softverbs-run; otherwise print the skip line.
pub fn launcher_or_skip(test: &str) -> bool {
    if std::env::var_os("SOFTVERBS_RUN").is_some() {
        return true;
    }
    // nextest runs this test under the launcher or leaves it out
    // (.config/nextest.toml): run here, it would pass without testing.
    assert!(
        std::env::var_os("NEXTEST").is_none(),
        "{test} needs softverbs-run (root), but nextest ran it outside the launcher: \
         .config/nextest.toml must count it in the softverbs set"
    );
    // Straight to fd 2: libtest captures print!/eprint! of passing tests, and
    // a skip must be seen.
    let line = format!("SKIPPED: {test} (needs softverbs-run, root)\n");
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    false
}

pub const ACCESS_ALL: i32 = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0) as i32;

/// [`ACCESS_ALL`] and remote atomics.
pub const ACCESS_ATOMIC: i32 = ACCESS_ALL | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0 as i32;

pub struct Dev {
    pub ctx: *mut ibv_context,
    pub pd: *mut ibv_pd,
}

impl Dev {
    pub fn open() -> Dev {
        unsafe {
            let mut n = 0;
            let list = ibv_get_device_list(&mut n);
            assert!(!list.is_null() && n > 0, "no verbs device");
            let mut ctx = null_mut();
            for i in 0..n as usize {
                let d = *list.add(i);
                let name = CStr::from_ptr(ibv_get_device_name(d)).to_string_lossy();
                if name.starts_with("softverbs") {
                    ctx = ibv_open_device(d);
                }
            }
            ibv_free_device_list(list);
            assert!(!ctx.is_null(), "softverbs device not found or not opened");
            let pd = ibv_alloc_pd(ctx);
            assert!(!pd.is_null());
            Dev { ctx, pd }
        }
    }

    pub fn cq(&self, n: i32, ch: *mut ibv_comp_channel) -> *mut ibv_cq {
        let cq = unsafe { ibv_create_cq(self.ctx, n, null_mut(), ch, 0) };
        assert!(!cq.is_null(), "create_cq");
        cq
    }

    pub fn channel(&self) -> *mut ibv_comp_channel {
        let ch = unsafe { ibv_create_comp_channel(self.ctx) };
        assert!(
            !ch.is_null(),
            "create_comp_channel (is the library preloaded?)"
        );
        ch
    }

    pub fn qp(&self, scq: *mut ibv_cq, rcq: *mut ibv_cq, srq: *mut ibv_srq) -> *mut ibv_qp {
        self.qp_of(ibv_qp_type::IBV_QPT_RC, scq, rcq, srq)
    }

    pub fn qp_of(
        &self,
        ty: u32,
        scq: *mut ibv_cq,
        rcq: *mut ibv_cq,
        srq: *mut ibv_srq,
    ) -> *mut ibv_qp {
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = scq;
        a.recv_cq = rcq;
        a.srq = srq;
        a.qp_type = ty;
        a.cap.max_send_wr = 64;
        a.cap.max_recv_wr = 64;
        a.cap.max_send_sge = 2;
        a.cap.max_recv_sge = 2;
        a.cap.max_inline_data = 64;
        let qp = unsafe { ibv_create_qp(self.pd, &mut a) };
        assert!(!qp.is_null(), "create_qp");
        qp
    }

    pub fn srq(&self, n: u32) -> *mut ibv_srq {
        let mut a: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
        a.attr.max_wr = n;
        a.attr.max_sge = 1;
        let s = unsafe { ibv_create_srq(self.pd, &mut a) };
        assert!(!s.is_null(), "create_srq");
        s
    }
}

/// `ibv_create_cq_ex` as verbs.h's inline does it. rdma-sys 0.3's wrapper
/// cannot be used: its `verbs_get_ctx` compares `abi_compat` with
/// `u32::MAX` instead of `UINTPTR_MAX`, so on 64-bit it never finds the
/// extended context and answers EOPNOTSUPP for every device.
pub fn create_cq_ex(ctx: *mut ibv_context, attr: *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex {
    unsafe {
        assert_eq!((*ctx).abi_compat as usize, usize::MAX, "extended context");
        let off = std::mem::offset_of!(verbs_context, context);
        let vctx = ctx.cast::<u8>().sub(off).cast::<verbs_context>();
        let f = (*vctx)
            .create_cq_ex
            .expect("libibverbs installs create_cq_ex");
        f(ctx, attr)
    }
}

/// `ibv_query_device_ex` through the `verbs_context` slot (rdma-sys 0.3's
/// wrapper has the `create_cq_ex` defect above).
pub fn query_device_ex(ctx: *mut ibv_context, attr: &mut ibv_device_attr_ex) -> i32 {
    unsafe {
        let off = std::mem::offset_of!(verbs_context, context);
        let vctx = ctx.cast::<u8>().sub(off).cast::<verbs_context>();
        let f = (*vctx)
            .query_device_ex
            .expect("the provider installs query_device_ex");
        f(
            ctx,
            std::ptr::null(),
            attr,
            std::mem::size_of::<ibv_device_attr_ex>(),
        )
    }
}

pub struct Buf {
    pub data: Vec<u8>,
    pub mr: *mut ibv_mr,
}

impl Buf {
    pub fn new(dev: &Dev, len: usize, fill: u8) -> Buf {
        Buf::with_access(dev, len, fill, ACCESS_ALL)
    }
    pub fn with_access(dev: &Dev, len: usize, fill: u8, access: i32) -> Buf {
        let mut data = vec![fill; len];
        let mr = unsafe { ibv_reg_mr(dev.pd, data.as_mut_ptr().cast(), len, access) };
        assert!(!mr.is_null(), "reg_mr");
        Buf { data, mr }
    }
    pub fn addr(&self) -> u64 {
        self.data.as_ptr() as u64
    }
    pub fn lkey(&self) -> u32 {
        unsafe { (*self.mr).lkey }
    }
    pub fn rkey(&self) -> u32 {
        unsafe { (*self.mr).rkey }
    }
}

pub fn qpn(qp: *mut ibv_qp) -> u32 {
    unsafe { (*qp).qp_num }
}

/// RESET -> INIT -> RTR -> RTS toward `remote`, with ibv_rc_pingpong's
/// transport attributes (timeout 14, retry_cnt 7).
pub fn connect(qp: *mut ibv_qp, remote: u32) {
    connect_with(qp, remote, 14, 7);
}

/// [`connect`] with the given local ACK `timeout` and `retry_cnt`.
pub fn connect_with(qp: *mut ibv_qp, remote: u32, timeout: u8, retry_cnt: u8) {
    connect_full(qp, remote, timeout, retry_cnt, ACCESS_ALL);
}

/// [`connect_with`] with the given remote `access` flags of the QP.
pub fn connect_full(qp: *mut ibv_qp, remote: u32, timeout: u8, retry_cnt: u8, access: i32) {
    to_init_with(qp, access);
    assert_eq!(to_rtr(qp, remote, 1), 0, "RTR");
    assert_eq!(to_rts_rc(qp, timeout, retry_cnt, 1), 0, "RTS");
}

/// RESET -> INIT on port 1 with the QP's remote `access` flags.
pub fn to_init_with(qp: *mut ibv_qp, access: i32) {
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.port_num = 1;
        a.qp_access_flags = access as u32;
        let m = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
            | ibv_qp_attr_mask::IBV_QP_PORT.0
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as i32), 0, "INIT");
    }
}

/// An RC (or XRC) QP's INIT -> RTR toward `remote` (LID 1), with the
/// attributes the kernel's table requires of its type; `ibv_modify_qp`'s
/// answer.
pub fn to_rtr(qp: *mut ibv_qp, remote: u32, max_dest_rd_atomic: u8) -> i32 {
    unsafe {
        // An XRC initiator has no responder side: no RDMA read depth, no
        // RNR timer.
        let responder = (*qp).qp_type != ibv_qp_type::IBV_QPT_XRC_SEND;
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::IBV_MTU_4096;
        a.dest_qp_num = remote;
        a.max_dest_rd_atomic = max_dest_rd_atomic;
        a.min_rnr_timer = 12;
        a.ah_attr.dlid = 1;
        a.ah_attr.port_num = 1;
        let mut m = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_AV.0
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU.0
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN.0
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN.0;
        if responder {
            m |= ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0;
        }
        ibv_modify_qp(qp, &mut a, m as i32)
    }
}

/// An RC (or XRC) QP's RTR -> RTS with the given local ACK `timeout`,
/// `retry_cnt` and `max_rd_atomic` (RNR retry 7), as far as its type
/// takes them; `ibv_modify_qp`'s answer.
pub fn to_rts_rc(qp: *mut ibv_qp, timeout: u8, retry_cnt: u8, max_rd_atomic: u8) -> i32 {
    unsafe {
        // An XRC target sends no requests: no retries, no read depth.
        let requester = (*qp).qp_type != ibv_qp_type::IBV_QPT_XRC_RECV;
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.timeout = timeout;
        a.retry_cnt = retry_cnt;
        a.rnr_retry = 7;
        a.max_rd_atomic = max_rd_atomic;
        let mut m = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT.0
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
        if requester {
            m |= ibv_qp_attr_mask::IBV_QP_RETRY_CNT.0
                | ibv_qp_attr_mask::IBV_QP_RNR_RETRY.0
                | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC.0;
        }
        ibv_modify_qp(qp, &mut a, m as i32)
    }
}

/// A UD QP to RTS: INIT with `qkey`, RTR, RTS with a send PSN.
pub fn ud_up(qp: *mut ibv_qp, qkey: u32) {
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.port_num = 1;
        a.qkey = qkey;
        let m = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
            | ibv_qp_attr_mask::IBV_QP_PORT.0
            | ibv_qp_attr_mask::IBV_QP_QKEY.0;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as i32), 0, "UD INIT");
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        assert_eq!(
            ibv_modify_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32),
            0,
            "UD RTR"
        );
        to_rts(qp);
    }
}

/// SQE -> RTS: the state alone (the kernel's table takes no send PSN
/// there).
pub fn resume_from_sqe(qp: *mut ibv_qp) {
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        let m = ibv_qp_attr_mask::IBV_QP_STATE.0;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as i32), 0, "SQE -> RTS");
    }
}

/// RTR -> RTS with a send PSN (UD, UC).
pub fn to_rts(qp: *mut ibv_qp) {
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = 0x1234;
        let m = ibv_qp_attr_mask::IBV_QP_STATE.0 | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as i32), 0, "RTS");
    }
}

/// A UC QP to RTS toward `remote` (ibv_uc_pingpong's attributes).
pub fn uc_connect(qp: *mut ibv_qp, remote: u32) {
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_INIT;
        a.port_num = 1;
        a.qp_access_flags = ACCESS_ALL as u32;
        let m = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
            | ibv_qp_attr_mask::IBV_QP_PORT.0
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as i32), 0, "UC INIT");
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = ibv_mtu::IBV_MTU_4096;
        a.dest_qp_num = remote;
        a.ah_attr.dlid = 1;
        a.ah_attr.port_num = 1;
        let m = ibv_qp_attr_mask::IBV_QP_STATE.0
            | ibv_qp_attr_mask::IBV_QP_AV.0
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU.0
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN.0
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN.0;
        assert_eq!(ibv_modify_qp(qp, &mut a, m as i32), 0, "UC RTR");
        to_rts(qp);
    }
}

pub fn qp_state(qp: *mut ibv_qp) -> u32 {
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    assert_eq!(
        unsafe { ibv_query_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32, &mut i) },
        0
    );
    a.qp_state
}

/// An address handle to LID 1 with service level `sl`; global (with the
/// given GRH fields) when `grh` is given.
pub fn create_ah(dev: &Dev, sl: u8, grh: Option<ibv_global_route>) -> *mut ibv_ah {
    let mut a: ibv_ah_attr = unsafe { std::mem::zeroed() };
    a.dlid = 1;
    a.sl = sl;
    a.port_num = 1;
    if let Some(g) = grh {
        a.is_global = 1;
        a.grh = g;
    }
    let ah = unsafe { ibv_create_ah(dev.pd, &mut a) };
    assert!(!ah.is_null(), "create_ah");
    ah
}

/// Post one signaled UD send of `buf[off..off + len]` to (`ah`, `qpn`,
/// `qkey`); with immediate data when `imm` is given.
#[allow(clippy::too_many_arguments)]
pub fn post_ud(
    qp: *mut ibv_qp,
    buf: &Buf,
    off: usize,
    len: u32,
    wr_id: u64,
    ah: *mut ibv_ah,
    qpn: u32,
    qkey: u32,
    imm: Option<u32>,
) -> i32 {
    let mut sge = ibv_sge {
        addr: buf.addr() + off as u64,
        length: len,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = if imm.is_some() { WR_SEND_IMM } else { WR_SEND };
    wr.send_flags = SIGNALED;
    wr.imm_data_invalidated_rkey_union.imm_data = imm.unwrap_or(0);
    wr.wr.ud = ud_t {
        ah,
        remote_qpn: qpn,
        remote_qkey: qkey,
    };
    let mut bad = null_mut();
    unsafe { ibv_post_send(qp, &mut wr, &mut bad) }
}

/// RESET -> INIT on port 1 with every access flag.
pub fn to_init(qp: *mut ibv_qp) {
    to_init_with(qp, ACCESS_ALL);
}

pub fn to_error(qp: *mut ibv_qp) {
    unsafe {
        let mut a: ibv_qp_attr = std::mem::zeroed();
        a.qp_state = ibv_qp_state::IBV_QPS_ERR;
        assert_eq!(
            ibv_modify_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32),
            0
        );
    }
}

pub fn post_recv(qp: *mut ibv_qp, buf: &Buf, off: usize, len: u32, wr_id: u64) {
    let mut sge = ibv_sge {
        addr: buf.addr() + off as u64,
        length: len,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = null_mut();
    assert_eq!(
        unsafe { ibv_post_recv(qp, &mut wr, &mut bad) },
        0,
        "post_recv"
    );
}

pub fn post_srq_recv(srq: *mut ibv_srq, buf: &Buf, off: usize, len: u32, wr_id: u64) {
    let mut sge = ibv_sge {
        addr: buf.addr() + off as u64,
        length: len,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = null_mut();
    assert_eq!(
        unsafe { ibv_post_srq_recv(srq, &mut wr, &mut bad) },
        0,
        "post_srq_recv"
    );
}

pub struct Send {
    pub opcode: u32,
    pub flags: u32,
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
}

pub const SIGNALED: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;
pub const SOLICITED: u32 = ibv_send_flags::IBV_SEND_SOLICITED.0;
pub const INLINE: u32 = ibv_send_flags::IBV_SEND_INLINE.0;

pub fn post_send(qp: *mut ibv_qp, buf: &Buf, off: usize, len: u32, wr_id: u64, s: Send) -> i32 {
    let mut sge = ibv_sge {
        addr: buf.addr() + off as u64,
        length: len,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = s.opcode;
    wr.send_flags = s.flags;
    wr.imm_data_invalidated_rkey_union.imm_data = s.imm;
    wr.wr.rdma = rdma_t {
        remote_addr: s.remote_addr,
        rkey: s.rkey,
    };
    let mut bad = null_mut();
    unsafe { ibv_post_send(qp, &mut wr, &mut bad) }
}

/// Post one signaled atomic (`opcode` IBV_WR_ATOMIC_*) on the 8-byte word
/// at `raddr`, the original value going to `buf[off..off + 8]`.
#[allow(clippy::too_many_arguments)]
pub fn post_atomic(
    qp: *mut ibv_qp,
    buf: &Buf,
    off: usize,
    wr_id: u64,
    opcode: u32,
    raddr: u64,
    rkey: u32,
    compare_add: u64,
    swap: u64,
) -> i32 {
    let mut sge = ibv_sge {
        addr: buf.addr() + off as u64,
        length: 8,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = opcode;
    wr.send_flags = SIGNALED;
    wr.wr.atomic = atomic_t {
        remote_addr: raddr,
        compare_add,
        swap,
        rkey,
    };
    let mut bad = null_mut();
    unsafe { ibv_post_send(qp, &mut wr, &mut bad) }
}

/// The native-endian u64 at `buf[off..off + 8]` (read volatile: the device
/// writes it behind the compiler's back).
pub fn word(buf: &Buf, off: usize) -> u64 {
    unsafe { std::ptr::read_volatile(buf.data.as_ptr().add(off).cast::<u64>()) }
}

pub fn send(opcode: u32, flags: u32) -> Send {
    Send {
        opcode,
        flags,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub byte_len: u32,
    pub imm: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub slid: u16,
    pub sl: u8,
    pub pkey_index: u16,
}

impl From<&ibv_wc> for Wc {
    fn from(wc: &ibv_wc) -> Wc {
        Wc {
            wr_id: wc.wr_id,
            status: wc.status,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            imm: unsafe { wc.imm_data_invalidated_rkey_union.imm_data },
            qp_num: wc.qp_num,
            src_qp: wc.src_qp,
            wc_flags: wc.wc_flags,
            slid: wc.slid,
            sl: wc.sl,
            pkey_index: wc.pkey_index,
        }
    }
}

/// A raw libibverbs handle moved into a test thread.
pub struct SendPtr<T>(pub *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY (test): libibverbs objects may be used from several threads; each
// test says which thread uses which object how.
unsafe impl<T> std::marker::Send for SendPtr<T> {}

/// Poll until `n` completions arrived (or panic after 10 s).
pub fn poll(cq: *mut ibv_cq, n: usize) -> Vec<Wc> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut out = Vec::new();
    while out.len() < n {
        let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
        let r = unsafe { ibv_poll_cq(cq, 1, &mut wc) };
        assert!(r >= 0, "poll_cq failed");
        if r == 1 {
            out.push(Wc::from(&wc));
        } else {
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} completions, got {out:?}"
            );
        }
    }
    out
}

/// Poll for `d` and expect nothing.
pub fn poll_none(cq: *mut ibv_cq, d: Duration) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
        assert_eq!(
            unsafe { ibv_poll_cq(cq, 1, &mut wc) },
            0,
            "unexpected completion"
        );
    }
}

/// Whether the channel fd becomes readable within `ms`.
pub fn readable(ch: *mut ibv_comp_channel, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd: unsafe { (*ch).fd },
        events: libc::POLLIN,
        revents: 0,
    };
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

pub fn fd_readable(fd: i32, ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    unsafe { libc::poll(&mut p, 1, ms) == 1 }
}

/// Read one CQ event, check it names `cq`, ack it.
pub fn get_event(ch: *mut ibv_comp_channel, cq: *mut ibv_cq) {
    let mut got = null_mut();
    let mut ctx = null_mut();
    assert_eq!(unsafe { ibv_get_cq_event(ch, &mut got, &mut ctx) }, 0);
    assert_eq!(got, cq);
    unsafe { ibv_ack_cq_events(cq, 1) };
}

pub const WR_SEND: u32 = ibv_wr_opcode::IBV_WR_SEND;
pub const WR_SEND_IMM: u32 = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
pub const WR_WRITE: u32 = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
pub const WR_WRITE_IMM: u32 = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
pub const WR_READ: u32 = ibv_wr_opcode::IBV_WR_RDMA_READ;
pub const WR_CMP_SWAP: u32 = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
pub const WR_FETCH_ADD: u32 = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
pub const WC_SUCCESS: u32 = ibv_wc_status::IBV_WC_SUCCESS;
pub const WC_FLUSH: u32 = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
pub const WC_REM_ACCESS: u32 = ibv_wc_status::IBV_WC_REM_ACCESS_ERR;
