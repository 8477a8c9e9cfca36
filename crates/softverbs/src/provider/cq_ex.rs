//! Extended completion queues (`ibv_create_cq_ex`, `ibv_start_poll` …).
//!
//! The same CQ as [`super::cq`], with the `ibv_cq_ex` iterator filled in:
//! 1. `start_poll` retries waiting sends, pops one CQE into `cur` and copies
//!    `status`/`wr_id` into the `ibv_cq_ex`; ENOENT when empty (and nothing
//!    is held, as the verbs contract says);
//! 2. `next_poll` pops the next one the same way;
//! 3. `end_poll` releases nothing (the CQE was copied out on pop);
//! 4. the `read_*` functions read `cur`.
//!
//! `IBV_CREATE_CQ_ATTR_SINGLE_THREADED` is accepted (the rings are lock-free
//! anyway); timestamps, flow tags, CVLAN, TM info and parent domains are not
//! supported and answer EOPNOTSUPP.

use std::ffi::{c_int, c_uint};

use super::cq::{make_cq, SvCq};
use super::set_errno;
use crate::sys::ibv;

/// `IBV_WC_EX_WITH_{BYTE_LEN,IMM,QP_NUM,SRC_QP,SLID,SL,DLID_PATH_BITS}`.
pub const SUPPORTED_WC_FLAGS: u64 = 0x7f;
/// `IBV_CQ_INIT_ATTR_MASK_FLAGS`.
const MASK_FLAGS: u32 = 1;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`.
const SINGLE_THREADED: u32 = 1;

fn sv_ex<'a>(cq: *mut ibv::ibv_cq_ex) -> &'a SvCq {
    // SAFETY: every ibv_cq_ex handed to these callbacks is the first field of
    // a live boxed SvCq (create_cq_ex), per the libibverbs contract.
    unsafe { &*cq.cast::<SvCq>() }
}

fn take(cq: *mut ibv::ibv_cq_ex) -> c_int {
    let s = sv_ex(cq);
    match s.port.ring().pop() {
        Some(e) => {
            s.cur.set(e);
            // SAFETY: `cq` is live (sv_ex contract); plain field writes.
            unsafe {
                (*cq).status = e.status;
                (*cq).wr_id = e.wr_id;
            }
            0
        }
        None => {
            s.empty_poll();
            libc::ENOENT
        }
    }
}

unsafe extern "C" fn start_poll(
    cq: *mut ibv::ibv_cq_ex,
    _attr: *mut ibv::ibv_poll_cq_attr,
) -> c_int {
    sv_ex(cq).progress_waiting();
    take(cq)
}

unsafe extern "C" fn next_poll(cq: *mut ibv::ibv_cq_ex) -> c_int {
    take(cq)
}

unsafe extern "C" fn end_poll(_cq: *mut ibv::ibv_cq_ex) {}

unsafe extern "C" fn read_opcode(cq: *mut ibv::ibv_cq_ex) -> ibv::ibv_wc_opcode::Type {
    sv_ex(cq).cur.get().opcode
}

unsafe extern "C" fn read_vendor_err(_cq: *mut ibv::ibv_cq_ex) -> u32 {
    0
}

unsafe extern "C" fn read_byte_len(cq: *mut ibv::ibv_cq_ex) -> u32 {
    sv_ex(cq).cur.get().byte_len
}

unsafe extern "C" fn read_imm_data(cq: *mut ibv::ibv_cq_ex) -> ibv::__be32 {
    sv_ex(cq).cur.get().imm
}

unsafe extern "C" fn read_qp_num(cq: *mut ibv::ibv_cq_ex) -> u32 {
    sv_ex(cq).cur.get().qp_num
}

unsafe extern "C" fn read_src_qp(cq: *mut ibv::ibv_cq_ex) -> u32 {
    sv_ex(cq).cur.get().src_qp
}

unsafe extern "C" fn read_wc_flags(cq: *mut ibv::ibv_cq_ex) -> c_uint {
    sv_ex(cq).cur.get().wc_flags
}

unsafe extern "C" fn read_slid(_cq: *mut ibv::ibv_cq_ex) -> u32 {
    1
}

unsafe extern "C" fn read_zero_u8(_cq: *mut ibv::ibv_cq_ex) -> u8 {
    0
}

/// `create_cq_ex`.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid.
pub unsafe extern "C" fn create_cq_ex(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_cq_init_attr_ex,
) -> *mut ibv::ibv_cq_ex {
    // SAFETY: caller contract.
    let a = unsafe { &*attr };
    let flags_ok = a.comp_mask & !MASK_FLAGS == 0
        && (a.comp_mask & MASK_FLAGS == 0 || a.flags & !SINGLE_THREADED == 0);
    if a.wc_flags & !SUPPORTED_WC_FLAGS != 0 || !flags_ok {
        set_errno(libc::EOPNOTSUPP);
        return std::ptr::null_mut();
    }
    let Ok(cqe) = c_int::try_from(a.cqe) else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    // SAFETY: caller contract.
    let raw = unsafe { make_cq(ctx, cqe, a.channel) };
    if raw.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: `raw` is the live box just made; filling the iterator slots.
    unsafe {
        let c = &mut (*raw).cq;
        c.start_poll = Some(start_poll);
        c.next_poll = Some(next_poll);
        c.end_poll = Some(end_poll);
        c.read_opcode = Some(read_opcode);
        c.read_vendor_err = Some(read_vendor_err);
        c.read_byte_len = Some(read_byte_len);
        c.read_imm_data = Some(read_imm_data);
        c.read_qp_num = Some(read_qp_num);
        c.read_src_qp = Some(read_src_qp);
        c.read_wc_flags = Some(read_wc_flags);
        c.read_slid = Some(read_slid);
        c.read_sl = Some(read_zero_u8);
        c.read_dlid_path_bits = Some(read_zero_u8);
        std::ptr::addr_of_mut!((*raw).cq)
    }
}
