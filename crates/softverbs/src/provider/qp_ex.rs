//! `ibv_create_qp_ex` and the `ibv_qp_ex` work-request API
//! (`ibv_wr_post(3)`): `wr_start`, one builder per work request
//! (`wr_send`, `wr_rdma_write`, …) that takes `qp->wr_id` and
//! `qp->wr_flags` as they are at that moment, setters for its data
//! (`wr_set_sge`, `wr_set_sge_list`, `wr_set_inline_data(_list)`,
//! `wr_set_ud_addr`, `wr_set_xrc_srqn`), then `wr_complete` to post the whole batch or
//! `wr_abort` to drop it.
//!
//! A batch is kept as ordinary send work requests and handed to
//! [`super::send::post_send`] by `wr_complete`, so both APIs share one data
//! path and one set of checks. The builders return nothing: an error found
//! while building (an opcode the QP was not created for, a builder outside
//! `wr_start`/`wr_complete`, too many SGEs or inline bytes, a setter with
//! no work request to set) is remembered, and `wr_complete` then returns
//! it and posts nothing of the batch.

use std::ffi::c_void;
use std::sync::MutexGuard;

use super::context::inner;
use super::qp::{fail, make_qp, sv, SvQp};
use crate::model::device::DEAD_ERRNO;
use crate::model::qp::QpType;
use crate::model::wc::{send_flags, wr};
use crate::sys::ibv;

/// `enum ibv_qp_init_attr_mask`.
mod mask {
    pub const PD: u32 = 1;
    pub const XRCD: u32 = 1 << 1;
    pub const CREATE_FLAGS: u32 = 1 << 2;
    pub const SEND_OPS_FLAGS: u32 = 1 << 6;
}

/// `enum ibv_qp_create_send_ops_flags`.
pub mod ops {
    /// `IBV_QP_EX_WITH_RDMA_WRITE`.
    pub const RDMA_WRITE: u64 = 1;
    /// `IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM`.
    pub const RDMA_WRITE_WITH_IMM: u64 = 1 << 1;
    /// `IBV_QP_EX_WITH_SEND`.
    pub const SEND: u64 = 1 << 2;
    /// `IBV_QP_EX_WITH_SEND_WITH_IMM`.
    pub const SEND_WITH_IMM: u64 = 1 << 3;
    /// `IBV_QP_EX_WITH_RDMA_READ`.
    pub const RDMA_READ: u64 = 1 << 4;
    /// `IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP`.
    pub const ATOMIC_CMP_AND_SWP: u64 = 1 << 5;
    /// `IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`.
    pub const ATOMIC_FETCH_AND_ADD: u64 = 1 << 6;
    /// `IBV_QP_EX_WITH_LOCAL_INV`.
    pub const LOCAL_INV: u64 = 1 << 7;
    /// `IBV_QP_EX_WITH_BIND_MW`.
    pub const BIND_MW: u64 = 1 << 8;
    /// `IBV_QP_EX_WITH_SEND_WITH_INV`.
    pub const SEND_WITH_INV: u64 = 1 << 9;
    /// `IBV_QP_EX_WITH_ATOMIC_WRITE`.
    pub const ATOMIC_WRITE: u64 = 1 << 12;

    /// The operations a QP of `t` can be created for: those
    /// `ibv_post_send(3)` allows on the transport (atomic write: RC). TSO
    /// (raw packet QPs only) is refused with EOPNOTSUPP.
    pub fn supported(t: super::QpType) -> u64 {
        let connected = RDMA_WRITE
            | RDMA_WRITE_WITH_IMM
            | SEND
            | SEND_WITH_IMM
            | LOCAL_INV
            | BIND_MW
            | SEND_WITH_INV;
        match t {
            super::QpType::Rc => {
                connected | RDMA_READ | ATOMIC_CMP_AND_SWP | ATOMIC_FETCH_AND_ADD | ATOMIC_WRITE
            }
            super::QpType::Uc => connected,
            super::QpType::Ud => SEND | SEND_WITH_IMM,
            super::QpType::XrcSend => {
                RDMA_WRITE
                    | RDMA_WRITE_WITH_IMM
                    | SEND
                    | SEND_WITH_IMM
                    | RDMA_READ
                    | ATOMIC_CMP_AND_SWP
                    | ATOMIC_FETCH_AND_ADD
                    | ATOMIC_WRITE
            }
            super::QpType::XrcRecv => 0,
        }
    }

    /// The creation flag a work-request opcode needs.
    pub fn for_opcode(op: u32) -> u64 {
        use crate::model::wc::wr;
        match op {
            wr::RDMA_WRITE => RDMA_WRITE,
            wr::RDMA_WRITE_WITH_IMM => RDMA_WRITE_WITH_IMM,
            wr::SEND => SEND,
            wr::SEND_WITH_IMM => SEND_WITH_IMM,
            wr::RDMA_READ => RDMA_READ,
            wr::ATOMIC_CMP_AND_SWP => ATOMIC_CMP_AND_SWP,
            wr::ATOMIC_FETCH_AND_ADD => ATOMIC_FETCH_AND_ADD,
            wr::LOCAL_INV => LOCAL_INV,
            wr::BIND_MW => BIND_MW,
            wr::SEND_WITH_INV => SEND_WITH_INV,
            wr::ATOMIC_WRITE => ATOMIC_WRITE,
            _ => 0,
        }
    }
}

/// `VERBS_QP_EX` of `enum verbs_qp_mask`: `ibv_qp_to_qp_ex` answers the
/// `ibv_qp_ex` only when the provider set it.
const VERBS_QP_EX: u32 = 1 << 1;

/// One work request of a batch.
struct ExWr {
    wr: ibv::ibv_send_wr,
    sges: Vec<ibv::ibv_sge>,
    /// Inline data, copied when set (the caller may reuse its buffer at
    /// once, `ibv_wr_post(3)`).
    inline: Vec<u8>,
}

/// The batch being built between `wr_start` and `wr_complete`/`wr_abort`.
#[derive(Default)]
pub struct ExBatch {
    active: bool,
    wrs: Vec<ExWr>,
    /// The first error found while building (errno).
    error: i32,
}

impl std::fmt::Debug for ExBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExBatch")
            .field("active", &self.active)
            .field("wrs", &self.wrs.len())
            .field("error", &self.error)
            .finish()
    }
}

impl ExBatch {
    fn fail(&mut self, e: i32) {
        if self.error == 0 {
            self.error = e;
        }
    }
}

/// `create_qp_ex`: an RC, UC, UD or XRC_SEND QP as `create_qp` makes it,
/// or an XRC_RECV QP in the XRC domain `IBV_QP_INIT_ATTR_XRCD` names (no
/// PD, no CQs: provider::xrc), from the extended attributes; with
/// `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS` it also answers `ibv_qp_to_qp_ex`
/// with the work-request API for those operations. Raw packet, RSS and TSO
/// attributes and creation flags are EOPNOTSUPP; no PD (no domain for
/// XRC_RECV) is EINVAL.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is a valid attribute block.
pub unsafe extern "C" fn create_qp_ex(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_qp_init_attr_ex,
) -> *mut ibv::ibv_qp {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return super::dead();
    }
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: caller contract.
    let a = unsafe { &mut *attr };
    if a.comp_mask & !(mask::PD | mask::XRCD | mask::CREATE_FLAGS | mask::SEND_OPS_FLAGS) != 0
        || (a.comp_mask & mask::CREATE_FLAGS != 0 && a.create_flags != 0)
    {
        return fail(libc::EOPNOTSUPP);
    }
    let Some(t) = QpType::from_u32(a.qp_type) else {
        return fail(libc::EOPNOTSUPP);
    };
    let (pd, xrcd) = if t == QpType::XrcRecv {
        // SAFETY: a non-null XRCD given by the caller is a live one.
        if a.comp_mask & mask::XRCD == 0 || a.xrcd.is_null() || unsafe { (*a.xrcd).context } != ctx
        {
            return fail(libc::EINVAL);
        }
        // SAFETY: an XRCD of this context.
        (std::ptr::null_mut(), unsafe { super::xrc::xrcd_id(a.xrcd) })
    } else {
        // SAFETY: a non-null PD given by the caller is a PD of some context.
        if a.comp_mask & mask::PD == 0 || a.pd.is_null() || unsafe { (*a.pd).context } != ctx {
            return fail(libc::EINVAL);
        }
        (a.pd, 0)
    };
    let send_ops = if a.comp_mask & mask::SEND_OPS_FLAGS != 0 {
        a.send_ops_flags
    } else {
        0
    };
    if send_ops & !ops::supported(t) != 0 {
        return fail(libc::EOPNOTSUPP);
    }
    let mut init = ibv::ibv_qp_init_attr {
        qp_context: a.qp_context,
        send_cq: a.send_cq,
        recv_cq: a.recv_cq,
        srq: a.srq,
        cap: a.cap,
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all,
    };
    // SAFETY: `pd` is a PD of this context or null with a domain (checked),
    // `init` a valid block whose CQs and SRQ the caller made on `ctx`.
    let qp = unsafe { make_qp(ctx, pd, &mut init, xrcd) };
    if qp.is_null() {
        return qp;
    }
    a.cap = init.cap;
    if a.comp_mask & mask::SEND_OPS_FLAGS != 0 {
        // SAFETY: `qp` heads the SvQp just made, not yet seen by anyone.
        unsafe {
            let q = qp.cast::<SvQp>();
            (*q).send_ops = send_ops;
            (*q).vqp.comp_mask |= VERBS_QP_EX;
            install(&mut (*q).vqp.qp_ex);
        }
    }
    qp
}

fn install(x: &mut ibv::ibv_qp_ex) {
    x.wr_start = Some(wr_start);
    x.wr_complete = Some(wr_complete);
    x.wr_abort = Some(wr_abort);
    x.wr_send = Some(wr_send);
    x.wr_send_imm = Some(wr_send_imm);
    x.wr_rdma_write = Some(wr_rdma_write);
    x.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    x.wr_rdma_read = Some(wr_rdma_read);
    x.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    x.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    x.wr_set_sge = Some(wr_set_sge);
    x.wr_set_sge_list = Some(wr_set_sge_list);
    x.wr_set_inline_data = Some(wr_set_inline_data);
    x.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    x.wr_set_ud_addr = Some(wr_set_ud_addr);
    x.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
    x.wr_local_inv = Some(wr_local_inv);
    x.wr_bind_mw = Some(wr_bind_mw);
    x.wr_send_inv = Some(wr_send_inv);
    x.wr_send_tso = Some(wr_send_tso);
    x.wr_atomic_write = Some(wr_atomic_write);
}

/// The QP and its batch.
///
/// # Safety
/// `x` is the `ibv_qp_ex` of a live QP of this provider.
unsafe fn batch<'a>(x: *mut ibv::ibv_qp_ex) -> (&'a SvQp, MutexGuard<'a, ExBatch>) {
    // SAFETY: the ibv_qp_ex is at offset 0 of the verbs_qp, itself at
    // offset 0 of the SvQp (caller contract).
    let q = unsafe { sv(x.cast()) };
    (q, q.ex.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Start a new work request of `opcode` from `qp->wr_id` and
/// `qp->wr_flags`, and let `fill` set its operation fields.
///
/// # Safety
/// As [`batch`].
unsafe fn begin(x: *mut ibv::ibv_qp_ex, opcode: u32, fill: impl FnOnce(&mut ibv::ibv_send_wr)) {
    // SAFETY: caller contract.
    let (q, mut b) = unsafe { batch(x) };
    if !b.active {
        b.fail(libc::EINVAL);
        return;
    }
    if q.send_ops & ops::for_opcode(opcode) == 0 {
        b.fail(libc::EINVAL);
        return;
    }
    // SAFETY: ibv_send_wr is plain C data (integers, pointers, unions of
    // them): all-zero is valid.
    let mut w: ibv::ibv_send_wr = unsafe { std::mem::zeroed() };
    // SAFETY: `x` is valid (caller contract); the caller set these fields.
    unsafe {
        w.wr_id = (*x).wr_id;
        w.send_flags = (*x).wr_flags;
    }
    w.opcode = opcode;
    fill(&mut w);
    b.wrs.push(ExWr {
        wr: w,
        sges: Vec::new(),
        inline: Vec::new(),
    });
}

/// Apply a setter to the last work request (none: the batch fails).
///
/// # Safety
/// As [`batch`].
unsafe fn set(x: *mut ibv::ibv_qp_ex, f: impl FnOnce(&SvQp, &mut ExWr) -> Result<(), i32>) {
    // SAFETY: caller contract.
    let (q, mut b) = unsafe { batch(x) };
    let active = b.active;
    let r = match b.wrs.last_mut() {
        Some(w) if active => f(q, w),
        _ => Err(libc::EINVAL),
    };
    if let Err(e) = r {
        b.fail(e);
    }
}

unsafe extern "C" fn wr_start(x: *mut ibv::ibv_qp_ex) {
    // SAFETY: libibverbs passes the ibv_qp_ex of one of our QPs.
    let (_, mut b) = unsafe { batch(x) };
    *b = ExBatch {
        active: true,
        ..ExBatch::default()
    };
}

unsafe extern "C" fn wr_abort(x: *mut ibv::ibv_qp_ex) {
    // SAFETY: as wr_start.
    let (_, mut b) = unsafe { batch(x) };
    *b = ExBatch::default();
}

unsafe extern "C" fn wr_complete(x: *mut ibv::ibv_qp_ex) -> i32 {
    // SAFETY: as wr_start.
    let (q, mut b) = unsafe { batch(x) };
    let taken = std::mem::take(&mut *b);
    drop(b);
    if !taken.active {
        return libc::EINVAL;
    }
    if taken.error != 0 {
        return taken.error;
    }
    if q.ctx().dead() {
        return DEAD_ERRNO;
    }
    let mut wrs = taken.wrs;
    if wrs.is_empty() {
        return 0;
    }
    // Link the chain; the vectors live until post_send returns (it copies
    // what it keeps, inline data included).
    let n = wrs.len();
    for w in wrs.iter_mut() {
        if w.wr.send_flags & send_flags::INLINE != 0 {
            w.sges = vec![ibv::ibv_sge {
                addr: w.inline.as_ptr() as u64,
                length: w.inline.len() as u32,
                lkey: 0,
            }];
        }
        w.wr.sg_list = w.sges.as_mut_ptr();
        w.wr.num_sge = w.sges.len() as i32;
    }
    for i in (0..n - 1).rev() {
        let next: *mut ibv::ibv_send_wr = &mut wrs[i + 1].wr;
        wrs[i].wr.next = next;
    }
    let mut bad: *mut ibv::ibv_send_wr = std::ptr::null_mut();
    // SAFETY: `x` is our QP; the chain is valid (linked above, each sg_list
    // points into its own live vector).
    unsafe { super::send::post_send(x.cast(), &mut wrs[0].wr, &mut bad) }
}

unsafe extern "C" fn wr_send(x: *mut ibv::ibv_qp_ex) {
    // SAFETY: as wr_start.
    unsafe { begin(x, wr::SEND, |_| {}) }
}

unsafe extern "C" fn wr_send_imm(x: *mut ibv::ibv_qp_ex, imm: u32) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::SEND_WITH_IMM, |w| {
            w.imm_data_invalidated_rkey_union.imm_data = imm
        })
    }
}

unsafe extern "C" fn wr_rdma_write(x: *mut ibv::ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::RDMA_WRITE, |w| {
            w.wr.rdma.rkey = rkey;
            w.wr.rdma.remote_addr = addr;
        })
    }
}

unsafe extern "C" fn wr_rdma_write_imm(x: *mut ibv::ibv_qp_ex, rkey: u32, addr: u64, imm: u32) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::RDMA_WRITE_WITH_IMM, |w| {
            w.wr.rdma.rkey = rkey;
            w.wr.rdma.remote_addr = addr;
            w.imm_data_invalidated_rkey_union.imm_data = imm;
        })
    }
}

unsafe extern "C" fn wr_rdma_read(x: *mut ibv::ibv_qp_ex, rkey: u32, addr: u64) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::RDMA_READ, |w| {
            w.wr.rdma.rkey = rkey;
            w.wr.rdma.remote_addr = addr;
        })
    }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    x: *mut ibv::ibv_qp_ex,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::ATOMIC_CMP_AND_SWP, |w| {
            w.wr.atomic.rkey = rkey;
            w.wr.atomic.remote_addr = addr;
            w.wr.atomic.compare_add = compare;
            w.wr.atomic.swap = swap;
        })
    }
}

unsafe extern "C" fn wr_atomic_fetch_add(x: *mut ibv::ibv_qp_ex, rkey: u32, addr: u64, add: u64) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::ATOMIC_FETCH_AND_ADD, |w| {
            w.wr.atomic.rkey = rkey;
            w.wr.atomic.remote_addr = addr;
            w.wr.atomic.compare_add = add;
        })
    }
}

unsafe extern "C" fn wr_set_sge(x: *mut ibv::ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: as wr_start.
    unsafe {
        set(x, |_, w| {
            w.wr.send_flags &= !send_flags::INLINE;
            w.sges = vec![ibv::ibv_sge { addr, length, lkey }];
            Ok(())
        })
    }
}

unsafe extern "C" fn wr_set_sge_list(x: *mut ibv::ibv_qp_ex, n: usize, list: *const ibv::ibv_sge) {
    // SAFETY: as wr_start.
    unsafe {
        set(x, |q, w| {
            if n > q.caps.max_send_sge as usize || (n > 0 && list.is_null()) {
                return Err(libc::EINVAL);
            }
            w.wr.send_flags &= !send_flags::INLINE;
            w.sges = if n == 0 {
                Vec::new()
            } else {
                // SAFETY: `list` holds `n` entries (ibv_wr_post(3)).
                std::slice::from_raw_parts(list, n).to_vec()
            };
            Ok(())
        })
    }
}

fn add_inline(q: &SvQp, w: &mut ExWr, bufs: &[(*const u8, usize)]) -> Result<(), i32> {
    let total: usize = bufs.iter().map(|b| b.1).sum();
    if total > q.caps.max_inline as usize {
        return Err(libc::EINVAL);
    }
    w.inline.clear();
    for &(p, len) in bufs {
        if len > 0 {
            // SAFETY: the caller's buffer of `len` bytes, readable during
            // the call (ibv_wr_post(3)); copied now.
            w.inline
                .extend_from_slice(unsafe { std::slice::from_raw_parts(p, len) });
        }
    }
    w.sges.clear();
    w.wr.send_flags |= send_flags::INLINE;
    Ok(())
}

unsafe extern "C" fn wr_set_inline_data(x: *mut ibv::ibv_qp_ex, addr: *mut c_void, len: usize) {
    // SAFETY: as wr_start.
    unsafe {
        set(x, |q, w| {
            add_inline(q, w, &[(addr.cast::<u8>().cast_const(), len)])
        })
    }
}

unsafe extern "C" fn wr_set_inline_data_list(
    x: *mut ibv::ibv_qp_ex,
    n: usize,
    list: *const ibv::ibv_data_buf,
) {
    // SAFETY: as wr_start.
    unsafe {
        set(x, |q, w| {
            if n > 0 && list.is_null() {
                return Err(libc::EINVAL);
            }
            let bufs: Vec<(*const u8, usize)> = if n == 0 {
                Vec::new()
            } else {
                // SAFETY: `list` holds `n` entries (ibv_wr_post(3)).
                std::slice::from_raw_parts(list, n)
                    .iter()
                    .map(|b| (b.addr.cast::<u8>().cast_const(), b.length))
                    .collect()
            };
            add_inline(q, w, &bufs)
        })
    }
}

unsafe extern "C" fn wr_set_ud_addr(
    x: *mut ibv::ibv_qp_ex,
    ah: *mut ibv::ibv_ah,
    qpn: u32,
    qkey: u32,
) {
    // SAFETY: as wr_start.
    unsafe {
        set(x, |q, w| {
            if q.qp_type != QpType::Ud {
                return Err(libc::EINVAL);
            }
            w.wr.wr.ud.ah = ah;
            w.wr.wr.ud.remote_qpn = qpn;
            w.wr.wr.ud.remote_qkey = qkey;
            Ok(())
        })
    }
}

/// A builder or setter for something a QP of this device is never
/// created for (creation answered EOPNOTSUPP): the batch fails.
///
/// # Safety
/// As [`batch`].
unsafe fn unsupported(x: *mut ibv::ibv_qp_ex) {
    // SAFETY: caller contract.
    let (_, mut b) = unsafe { batch(x) };
    b.fail(libc::EOPNOTSUPP);
}

unsafe extern "C" fn wr_set_xrc_srqn(x: *mut ibv::ibv_qp_ex, srqn: u32) {
    // SAFETY: as wr_start.
    unsafe {
        set(x, |q, w| {
            if q.qp_type != QpType::XrcSend {
                return Err(libc::EINVAL);
            }
            w.wr.qp_type.xrc.remote_srqn = srqn;
            Ok(())
        })
    }
}

unsafe extern "C" fn wr_local_inv(x: *mut ibv::ibv_qp_ex, rkey: u32) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::LOCAL_INV, |w| {
            w.imm_data_invalidated_rkey_union.invalidated_rkey = rkey
        })
    }
}

unsafe extern "C" fn wr_bind_mw(
    x: *mut ibv::ibv_qp_ex,
    mw: *mut ibv::ibv_mw,
    rkey: u32,
    info: *const ibv::ibv_mw_bind_info,
) {
    if mw.is_null() || info.is_null() {
        // SAFETY: as wr_start.
        let (_, mut b) = unsafe { batch(x) };
        b.fail(libc::EINVAL);
        return;
    }
    // SAFETY: as wr_start; `info` is the caller's valid bind description,
    // copied now.
    unsafe {
        let info = *info;
        begin(x, wr::BIND_MW, |w| {
            w.bind_mw_tso_union.bind_mw = ibv::bind_mw_t {
                mw,
                rkey,
                bind_info: info,
            }
        })
    }
}

unsafe extern "C" fn wr_send_inv(x: *mut ibv::ibv_qp_ex, rkey: u32) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::SEND_WITH_INV, |w| {
            w.imm_data_invalidated_rkey_union.invalidated_rkey = rkey
        })
    }
}

unsafe extern "C" fn wr_send_tso(x: *mut ibv::ibv_qp_ex, _hdr: *mut c_void, _sz: u16, _mss: u16) {
    // SAFETY: as wr_start.
    unsafe { unsupported(x) }
}

/// `wr_atomic_write`: the 8 bytes at `data` are copied now (as inline
/// data of the work request) and stored at the remote address at once.
unsafe extern "C" fn wr_atomic_write(
    x: *mut ibv::ibv_qp_ex,
    rkey: u32,
    addr: u64,
    data: *const c_void,
) {
    // SAFETY: as wr_start.
    unsafe {
        begin(x, wr::ATOMIC_WRITE, |w| {
            w.wr.rdma.rkey = rkey;
            w.wr.rdma.remote_addr = addr;
        });
        if data.is_null() {
            let (_, mut b) = batch(x);
            b.fail(libc::EINVAL);
            return;
        }
        // The value is the operation's own data, not subject to the QP's
        // inline limit.
        let value = std::ptr::read_unaligned(data.cast::<[u8; 8]>());
        set(x, |_, w| {
            w.inline = value.to_vec();
            w.sges.clear();
            w.wr.send_flags |= send_flags::INLINE;
            Ok(())
        });
    }
}
