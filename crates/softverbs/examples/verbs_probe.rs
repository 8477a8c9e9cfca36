//! Verbs probes for differential conformance: one program, run on softverbs
//! and on the kernel's rxe, that prints what the device reports for each
//! probe — QP state transitions, completion statuses, opcodes, byte
//! counts, immediate data, the order of errors and flushes, RNR and access
//! errors — one `key = value` line each, in a form two devices can be
//! compared by. `scripts/verbs-diff.py` compares two such outputs against
//! the documented differences (crates/softverbs/tests/rxe_differences.txt).
//!
//! ```text
//! cargo build -p softverbs --release --example verbs_probe
//! sudo target/release/softverbs-run target/release/examples/verbs_probe > softverbs.txt
//! mkdir -p /tmp/probe   # the guest writes only where RXE_VM_LOGDIR says
//! sudo RXE_VM_LOGDIR=/tmp/probe scripts/rxe-vm.sh sh -c \
//!     'target/release/examples/verbs_probe --device rxe0 --gid-index 1 > $RXE_VM_LOGDIR/rxe.txt'
//! python3 scripts/verbs-diff.py softverbs.txt /tmp/probe/rxe.txt
//! ```
//!
//! Every probe uses fresh RC QPs connected to each other on one device (a
//! loopback pair), each with a CQ of its own, except the teardown probes
//! (`destroy_unpolled`, `destroy_srq`, `last_wqe`): what `ibv_destroy_qp`
//! does to completions still in a CQ shared with another QP, to an SRQ's
//! receives, and when `IBV_EVENT_QP_LAST_WQE_REACHED` comes. Values a device
//! may leave undefined are not printed: the opcode and byte count of an
//! error completion, the byte count of a SEND or WRITE's own completion. A
//! QP's number is printed as its role (`a`, `b`, `d`). Exit status 0 once
//! every probe ran (what they found is the output), 1 when the device cannot
//! be opened or a set-up step fails.
#![allow(clippy::undocumented_unsafe_blocks)]
// Each unsafe block calls libibverbs with objects this program made and
// still holds (contexts, PDs, CQs, QPs, MRs over live vectors), as any
// verbs program does; none outlives what it points to.

use std::ffi::CStr;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use rdma_sys::*;

/// How long a probe waits for a completion (TCG runs rxe slowly).
const WAIT: Duration = Duration::from_secs(10);
/// How long a probe waits to see that no (further) completion comes.
const QUIET: Duration = Duration::from_millis(300);
/// How long the last-WQE probe waits for the event (a device that never
/// raises it costs this much).
const EVENT_WAIT: Duration = Duration::from_secs(3);
/// `enum ibv_event_type`'s `IBV_EVENT_QP_LAST_WQE_REACHED`.
const QP_LAST_WQE_REACHED: u32 = 16;

const ACCESS_ALL: u32 = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
    | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
const SIGNALED: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;

fn die(what: &str) -> ! {
    let errno = std::io::Error::last_os_error();
    eprintln!("verbs_probe: {what} failed: {errno}");
    std::process::exit(1)
}

/// The device, its PD, and how to address the port.
struct Dev {
    ctx: *mut ibv_context,
    pd: *mut ibv_pd,
    lid: u16,
    gid: Option<(u8, ibv_gid)>,
}

impl Dev {
    fn open(name: Option<&str>, gid_index: Option<u8>) -> Dev {
        unsafe {
            let mut n = 0;
            let list = ibv_get_device_list(&mut n);
            if list.is_null() || n == 0 {
                die("ibv_get_device_list (no RDMA device)");
            }
            let mut ctx = null_mut();
            for i in 0..n as usize {
                let d = *list.add(i);
                let dn = CStr::from_ptr(ibv_get_device_name(d)).to_string_lossy();
                if name.is_none_or(|w| w == dn) {
                    ctx = ibv_open_device(d);
                    break;
                }
            }
            ibv_free_device_list(list);
            if ctx.is_null() {
                die("ibv_open_device (no such device?)");
            }
            let pd = ibv_alloc_pd(ctx);
            if pd.is_null() {
                die("ibv_alloc_pd");
            }
            let mut port: ibv_port_attr = std::mem::zeroed();
            if ___ibv_query_port(ctx, 1, &mut port) != 0 {
                die("ibv_query_port");
            }
            let gid = gid_index.map(|i| {
                let mut g: ibv_gid = std::mem::zeroed();
                if ibv_query_gid(ctx, 1, i32::from(i), &mut g) != 0 {
                    die("ibv_query_gid");
                }
                (i, g)
            });
            Dev {
                ctx,
                pd,
                lid: port.lid,
                gid,
            }
        }
    }

    fn cq(&self) -> *mut ibv_cq {
        let cq = unsafe { ibv_create_cq(self.ctx, 64, null_mut(), null_mut(), 0) };
        if cq.is_null() {
            die("ibv_create_cq");
        }
        cq
    }

    fn qp(&self, cq: *mut ibv_cq, sig_all: bool) -> *mut ibv_qp {
        self.qp_on(cq, null_mut(), sig_all)
    }

    /// An RC QP on `cq`, receiving from `srq` when it is not null.
    fn qp_on(&self, cq: *mut ibv_cq, srq: *mut ibv_srq, sig_all: bool) -> *mut ibv_qp {
        let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        a.send_cq = cq;
        a.recv_cq = cq;
        a.srq = srq;
        a.qp_type = ibv_qp_type::IBV_QPT_RC;
        a.sq_sig_all = i32::from(sig_all);
        a.cap.max_send_wr = 16;
        a.cap.max_recv_wr = 16;
        a.cap.max_send_sge = 1;
        a.cap.max_recv_sge = 1;
        a.cap.max_inline_data = 64;
        let qp = unsafe { ibv_create_qp(self.pd, &mut a) };
        if qp.is_null() {
            die("ibv_create_qp");
        }
        qp
    }

    fn mr(&self, len: usize, access: u32) -> Buf {
        let mut data = vec![0u8; len];
        let mr = unsafe { ibv_reg_mr(self.pd, data.as_mut_ptr().cast(), len, access as i32) };
        if mr.is_null() {
            die("ibv_reg_mr");
        }
        Buf { data, mr }
    }
}

struct Buf {
    data: Vec<u8>,
    mr: *mut ibv_mr,
}

impl Buf {
    fn addr(&self, off: usize) -> u64 {
        self.data.as_ptr() as u64 + off as u64
    }
    fn lkey(&self) -> u32 {
        unsafe { (*self.mr).lkey }
    }
    fn rkey(&self) -> u32 {
        unsafe { (*self.mr).rkey }
    }
    fn read_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        // The device wrote it: read through a volatile copy.
        for (i, x) in b.iter_mut().enumerate() {
            *x = unsafe { std::ptr::read_volatile(self.data.as_ptr().add(off + i)) };
        }
        u64::from_ne_bytes(b)
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// The transport attributes of a probe's QP.
#[derive(Clone, Copy)]
struct Transport {
    access: u32,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    min_rnr_timer: u8,
}

const DEFAULT: Transport = Transport {
    access: ACCESS_ALL,
    timeout: 14,
    retry_cnt: 7,
    rnr_retry: 7,
    min_rnr_timer: 1,
};

fn errno_name(rc: i32) -> String {
    let e = if rc < 0 { -rc } else { rc };
    match e {
        0 => "ok".into(),
        libc::EINVAL => "EINVAL".into(),
        libc::ENOMEM => "ENOMEM".into(),
        libc::EPERM => "EPERM".into(),
        libc::EOPNOTSUPP => "EOPNOTSUPP".into(),
        libc::EAGAIN => "EAGAIN".into(),
        other => format!("errno{other}"),
    }
}

fn to_state(qp: *mut ibv_qp, state: u32, peer: u32, t: Transport, dev: &Dev) -> i32 {
    to_state_without(qp, state, peer, t, dev, 0)
}

/// [`to_state`] without the attributes in `drop`.
fn to_state_without(
    qp: *mut ibv_qp,
    state: u32,
    peer: u32,
    t: Transport,
    dev: &Dev,
    drop: u32,
) -> i32 {
    use ibv_qp_attr_mask as m;
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = state;
    let mask = match state {
        ibv_qp_state::IBV_QPS_INIT => {
            a.port_num = 1;
            a.qp_access_flags = t.access;
            m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0
        }
        ibv_qp_state::IBV_QPS_RTR => {
            a.path_mtu = ibv_mtu::IBV_MTU_1024;
            a.dest_qp_num = peer;
            a.max_dest_rd_atomic = 1;
            a.min_rnr_timer = t.min_rnr_timer;
            a.ah_attr.dlid = dev.lid;
            a.ah_attr.port_num = 1;
            if let Some((index, gid)) = dev.gid {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid = gid;
                a.ah_attr.grh.sgid_index = index;
                a.ah_attr.grh.hop_limit = 1;
            }
            m::IBV_QP_STATE.0
                | m::IBV_QP_AV.0
                | m::IBV_QP_PATH_MTU.0
                | m::IBV_QP_DEST_QPN.0
                | m::IBV_QP_RQ_PSN.0
                | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | m::IBV_QP_MIN_RNR_TIMER.0
        }
        ibv_qp_state::IBV_QPS_RTS => {
            a.timeout = t.timeout;
            a.retry_cnt = t.retry_cnt;
            a.rnr_retry = t.rnr_retry;
            a.max_rd_atomic = 1;
            m::IBV_QP_STATE.0
                | m::IBV_QP_TIMEOUT.0
                | m::IBV_QP_RETRY_CNT.0
                | m::IBV_QP_RNR_RETRY.0
                | m::IBV_QP_SQ_PSN.0
                | m::IBV_QP_MAX_QP_RD_ATOMIC.0
        }
        _ => m::IBV_QP_STATE.0,
    };
    unsafe { ibv_modify_qp(qp, &mut a, (mask & !drop) as i32) }
}

fn up(qp: *mut ibv_qp, peer: u32, t: Transport, dev: &Dev) {
    for s in [
        ibv_qp_state::IBV_QPS_INIT,
        ibv_qp_state::IBV_QPS_RTR,
        ibv_qp_state::IBV_QPS_RTS,
    ] {
        if to_state(qp, s, peer, t, dev) != 0 {
            die("ibv_modify_qp on the way to RTS");
        }
    }
}

fn state_of(qp: *mut ibv_qp) -> &'static str {
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    let mut i: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    let rc = unsafe { ibv_query_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32, &mut i) };
    if rc != 0 {
        return "query-failed";
    }
    state_name(a.qp_state)
}

fn state_name(s: u32) -> &'static str {
    match s {
        ibv_qp_state::IBV_QPS_RESET => "RESET",
        ibv_qp_state::IBV_QPS_INIT => "INIT",
        ibv_qp_state::IBV_QPS_RTR => "RTR",
        ibv_qp_state::IBV_QPS_RTS => "RTS",
        ibv_qp_state::IBV_QPS_SQD => "SQD",
        ibv_qp_state::IBV_QPS_SQE => "SQE",
        ibv_qp_state::IBV_QPS_ERR => "ERR",
        _ => "UNKNOWN",
    }
}

fn status_name(s: u32) -> String {
    let name = unsafe { CStr::from_ptr(ibv_wc_status_str(s)) };
    name.to_string_lossy().replace(' ', "_")
}

fn opcode_name(op: u32) -> String {
    match op {
        ibv_wc_opcode::IBV_WC_SEND => "SEND".into(),
        ibv_wc_opcode::IBV_WC_RDMA_WRITE => "RDMA_WRITE".into(),
        ibv_wc_opcode::IBV_WC_RDMA_READ => "RDMA_READ".into(),
        ibv_wc_opcode::IBV_WC_COMP_SWAP => "COMP_SWAP".into(),
        ibv_wc_opcode::IBV_WC_FETCH_ADD => "FETCH_ADD".into(),
        ibv_wc_opcode::IBV_WC_RECV => "RECV".into(),
        ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => "RECV_RDMA_WITH_IMM".into(),
        other => format!("opcode{other}"),
    }
}

/// One probe's pair: QPs `a` and `b`, connected, each with its CQ, and
/// one region each.
struct Pair<'d> {
    dev: &'d Dev,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
    cq_a: *mut ibv_cq,
    cq_b: *mut ibv_cq,
    buf_a: Buf,
    buf_b: Buf,
}

impl<'d> Pair<'d> {
    fn new(dev: &'d Dev, ta: Transport, tb: Transport, sig_all: bool) -> Pair<'d> {
        let (cq_a, cq_b) = (dev.cq(), dev.cq());
        let (a, b) = (dev.qp(cq_a, sig_all), dev.qp(cq_b, sig_all));
        let (na, nb) = unsafe { ((*a).qp_num, (*b).qp_num) };
        up(a, nb, ta, dev);
        up(b, na, tb, dev);
        Pair {
            dev,
            a,
            b,
            cq_a,
            cq_b,
            buf_a: dev.mr(4096, ACCESS_ALL),
            buf_b: dev.mr(4096, ACCESS_ALL),
        }
    }

    fn role(&self, qp_num: u32) -> &'static str {
        unsafe {
            if qp_num == (*self.a).qp_num {
                "a"
            } else if qp_num == (*self.b).qp_num {
                "b"
            } else {
                "other"
            }
        }
    }

    fn recv(&self, on_b: bool, wr_id: u64, off: usize, len: u32) -> i32 {
        let (qp, buf) = if on_b {
            (self.b, &self.buf_b)
        } else {
            (self.a, &self.buf_a)
        };
        let mut sge = ibv_sge {
            addr: buf.addr(off),
            length: len,
            lkey: buf.lkey(),
        };
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = null_mut();
        unsafe { ibv_post_recv(qp, &mut wr, &mut bad) }
    }

    /// Posts one request from `a`: `op`, `len` bytes at offset `off` of
    /// `a`'s region (lkey `lkey`, or the region's), to `b`'s region at
    /// `roff` (rkey `rkey`, or the region's).
    fn send(&self, wr_id: u64, op: u32, s: SendArgs) -> i32 {
        let mut sge = ibv_sge {
            addr: self.buf_a.addr(s.off),
            length: s.len,
            lkey: s.lkey.unwrap_or(self.buf_a.lkey()),
        };
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = i32::from(s.len > 0);
        wr.opcode = op;
        wr.send_flags = s.flags;
        wr.imm_data_invalidated_rkey_union.imm_data = s.imm.to_be();
        let raddr = self.buf_b.addr(s.roff);
        let rkey = s.rkey.unwrap_or(self.buf_b.rkey());
        if op == ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD
            || op == ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP
        {
            wr.wr.atomic = atomic_t {
                remote_addr: raddr,
                compare_add: s.compare_add,
                swap: s.swap,
                rkey,
            };
        } else {
            wr.wr.rdma = rdma_t {
                remote_addr: raddr,
                rkey,
            };
        }
        let mut bad = null_mut();
        unsafe { ibv_post_send(self.a, &mut wr, &mut bad) }
    }

    /// Prints `a`'s and `b`'s completions (`na` and `nb` expected) as
    /// `probe.a.N` / `probe.b.N` lines, then both QPs' states.
    fn report(&self, probe: &str, na: usize, nb: usize) {
        for (side, cq, n) in [("a", self.cq_a, na), ("b", self.cq_b, nb)] {
            let wcs = wcs(cq, n);
            println!("{probe}.{side}.count = {}", wcs.len());
            for (i, wc) in wcs.iter().enumerate() {
                println!("{probe}.{side}.{i} = {}", self.describe(wc));
            }
        }
        println!("{probe}.a.state = {}", state_of(self.a));
        println!("{probe}.b.state = {}", state_of(self.b));
    }

    fn describe(&self, wc: &ibv_wc) -> String {
        describe(wc, self.role(wc.qp_num))
    }
}

/// Every completion of `cq` until `n` came (or [`WAIT`] passed), then
/// any more within [`QUIET`].
fn wcs(cq: *mut ibv_cq, n: usize) -> Vec<ibv_wc> {
    let mut out = Vec::new();
    let start = Instant::now();
    let mut quiet_from = None;
    loop {
        let mut wc: ibv_wc = unsafe { std::mem::zeroed() };
        let got = unsafe { ibv_poll_cq(cq, 1, &mut wc) };
        if got > 0 {
            out.push(wc);
            continue;
        }
        if got < 0 {
            break;
        }
        if out.len() >= n {
            let q = *quiet_from.get_or_insert_with(Instant::now);
            if q.elapsed() >= QUIET {
                break;
            }
        } else if start.elapsed() >= WAIT {
            break;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    out
}

/// A completion as a probe line's value, its QP named `role`.
fn describe(wc: &ibv_wc, role: &str) -> String {
    let mut s = format!(
        "wr_id={} status={} qp={role}",
        wc.wr_id,
        status_name(wc.status),
    );
    if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
        return s; // opcode, byte_len and flags are undefined
    }
    s += &format!(" opcode={}", opcode_name(wc.opcode));
    let receive = wc.opcode & ibv_wc_opcode::IBV_WC_RECV != 0;
    if receive
        || matches!(
            wc.opcode,
            ibv_wc_opcode::IBV_WC_RDMA_READ
                | ibv_wc_opcode::IBV_WC_COMP_SWAP
                | ibv_wc_opcode::IBV_WC_FETCH_ADD
        )
    {
        s += &format!(" byte_len={}", wc.byte_len);
    }
    if receive {
        let imm = wc.wc_flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
        s += &format!(" with_imm={imm}");
        if imm {
            let v = u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data });
            s += &format!(" imm={v:#x}");
        }
    }
    s
}

impl Drop for Pair<'_> {
    fn drop(&mut self) {
        unsafe {
            ibv_destroy_qp(self.a);
            ibv_destroy_qp(self.b);
            ibv_destroy_cq(self.cq_a);
            ibv_destroy_cq(self.cq_b);
        }
        let _ = self.dev;
    }
}

#[derive(Clone, Copy)]
struct SendArgs {
    off: usize,
    len: u32,
    roff: usize,
    flags: u32,
    imm: u32,
    lkey: Option<u32>,
    rkey: Option<u32>,
    compare_add: u64,
    swap: u64,
}

const ARGS: SendArgs = SendArgs {
    off: 0,
    len: 64,
    roff: 0,
    flags: SIGNALED,
    imm: 0,
    lkey: None,
    rkey: None,
    compare_add: 0,
    swap: 0,
};

use ibv_wr_opcode::{
    IBV_WR_ATOMIC_CMP_AND_SWP as CAS, IBV_WR_ATOMIC_FETCH_AND_ADD as FADD,
    IBV_WR_RDMA_READ as READ, IBV_WR_RDMA_WRITE as WRITE, IBV_WR_RDMA_WRITE_WITH_IMM as WRITE_IMM,
    IBV_WR_SEND as SEND, IBV_WR_SEND_WITH_IMM as SEND_IMM,
};

/// Which transitions the device accepts, from each state an application
/// can reach to each other, with the attributes each needs.
fn transitions(dev: &Dev) {
    use ibv_qp_state::*;
    let states = [
        IBV_QPS_RESET,
        IBV_QPS_INIT,
        IBV_QPS_RTR,
        IBV_QPS_RTS,
        IBV_QPS_ERR,
    ];
    for &from in &states {
        for &to in &states {
            let cq = dev.cq();
            let qp = dev.qp(cq, true);
            let peer = unsafe { (*qp).qp_num };
            let path: &[u32] = match from {
                IBV_QPS_RESET => &[],
                IBV_QPS_INIT => &[IBV_QPS_INIT],
                IBV_QPS_RTR => &[IBV_QPS_INIT, IBV_QPS_RTR],
                IBV_QPS_RTS => &[IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS],
                _ => &[IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_ERR],
            };
            for &s in path {
                if to_state(qp, s, peer, DEFAULT, dev) != 0 {
                    die("ibv_modify_qp on the way to a probe's start state");
                }
            }
            let rc = to_state(qp, to, peer, DEFAULT, dev);
            println!(
                "transition.{}->{} = {} now={}",
                state_name(from),
                state_name(to),
                errno_name(rc),
                state_of(qp)
            );
            unsafe {
                ibv_destroy_qp(qp);
                ibv_destroy_cq(cq);
            }
        }
    }
}

/// Attribute masks each transition must refuse or take, as the kernel's
/// table has them (`ib_modify_qp_is_ok`).
fn masks(dev: &Dev) {
    use ibv_qp_attr_mask as m;
    use ibv_qp_state::*;
    let cases: [(&str, &[u32], u32, u32); 6] = [
        (
            "init_rtr_without_min_rnr_timer",
            &[IBV_QPS_INIT],
            IBV_QPS_RTR,
            m::IBV_QP_MIN_RNR_TIMER.0,
        ),
        (
            "rtr_rts_without_rnr_retry",
            &[IBV_QPS_INIT, IBV_QPS_RTR],
            IBV_QPS_RTS,
            m::IBV_QP_RNR_RETRY.0,
        ),
        (
            "reset_init_without_access",
            &[],
            IBV_QPS_INIT,
            m::IBV_QP_ACCESS_FLAGS.0,
        ),
        (
            "rts_rts_min_rnr_timer",
            &[IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS],
            IBV_QPS_RTS,
            0,
        ),
        (
            "rts_err_with_timeout",
            &[IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS],
            IBV_QPS_ERR,
            0,
        ),
        ("init_cur_state", &[IBV_QPS_INIT], IBV_QPS_INIT, 0),
    ];
    for (name, path, to, drop) in cases {
        let cq = dev.cq();
        let qp = dev.qp(cq, true);
        let peer = unsafe { (*qp).qp_num };
        for &s in path {
            if to_state(qp, s, peer, DEFAULT, dev) != 0 {
                die("ibv_modify_qp on the way to a probe's start state");
            }
        }
        let rc = match name {
            "rts_rts_min_rnr_timer" => {
                modify(qp, to, m::IBV_QP_MIN_RNR_TIMER.0, |a| a.min_rnr_timer = 14)
            }
            "rts_err_with_timeout" => modify(qp, to, m::IBV_QP_TIMEOUT.0, |a| a.timeout = 14),
            "init_cur_state" => modify(qp, to, m::IBV_QP_CUR_STATE.0, |a| {
                a.cur_qp_state = IBV_QPS_INIT
            }),
            _ => to_state_without(qp, to, peer, DEFAULT, dev, drop),
        };
        println!("mask.{name} = {} now={}", errno_name(rc), state_of(qp));
        unsafe {
            ibv_destroy_qp(qp);
            ibv_destroy_cq(cq);
        }
    }
}

/// `ibv_modify_qp` to `state` with the attributes in `extra` set by `set`.
fn modify(qp: *mut ibv_qp, state: u32, extra: u32, set: impl FnOnce(&mut ibv_qp_attr)) -> i32 {
    let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
    a.qp_state = state;
    set(&mut a);
    let mask = ibv_qp_attr_mask::IBV_QP_STATE.0 | extra;
    unsafe { ibv_modify_qp(qp, &mut a, mask as i32) }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut device, mut gid_index) = (None, None);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => device = args.next(),
            "--gid-index" => gid_index = args.next().and_then(|v| v.parse().ok()),
            _ => {
                eprintln!("usage: verbs_probe [--device NAME] [--gid-index N]");
                std::process::exit(2);
            }
        }
    }
    let dev = Dev::open(device.as_deref(), gid_index);
    transitions(&dev);
    masks(&dev);
    data_path(&dev);
    errors(&dev);
    teardown(&dev);
}

/// Successful requests of each kind: what each side's completion says.
fn data_path(dev: &Dev) {
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 256);
    p.send(1, SEND, ARGS);
    p.report("send", 1, 1);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 256);
    p.send(
        1,
        SEND_IMM,
        SendArgs {
            imm: 0x1234_5678,
            ..ARGS
        },
    );
    p.report("send_imm", 1, 1);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 256);
    p.send(
        1,
        SEND,
        SendArgs {
            flags: SIGNALED | ibv_send_flags::IBV_SEND_INLINE.0,
            len: 32,
            ..ARGS
        },
    );
    p.report("send_inline", 1, 1);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 256);
    p.send(1, SEND, SendArgs { len: 0, ..ARGS });
    p.report("send_zero_length", 1, 1);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.send(1, WRITE, SendArgs { len: 128, ..ARGS });
    p.report("write", 1, 0);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 0);
    p.send(
        1,
        WRITE_IMM,
        SendArgs {
            len: 128,
            imm: 0xabcd,
            ..ARGS
        },
    );
    p.report("write_imm", 1, 1);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.send(1, READ, SendArgs { len: 200, ..ARGS });
    p.report("read", 1, 0);

    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.send(
        1,
        FADD,
        SendArgs {
            len: 8,
            compare_add: 5,
            ..ARGS
        },
    );
    p.send(
        2,
        CAS,
        SendArgs {
            len: 8,
            off: 8,
            compare_add: 5,
            swap: 9,
            ..ARGS
        },
    );
    p.report("atomics", 2, 0);
    println!(
        "atomics.values = fetched={} compared={} remote={}",
        p.buf_a.read_u64(0),
        p.buf_a.read_u64(8),
        p.buf_b.read_u64(0)
    );

    // Unsignaled requests (sq_sig_all 0): only the signaled one completes.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.send(1, WRITE, SendArgs { flags: 0, ..ARGS });
    p.send(2, WRITE, SendArgs { flags: 0, ..ARGS });
    p.send(3, WRITE, ARGS);
    p.report("unsignaled", 1, 0);

    // sq_sig_all 1: an unsignaled request completes anyway.
    let p = Pair::new(dev, DEFAULT, DEFAULT, true);
    p.send(1, WRITE, SendArgs { flags: 0, ..ARGS });
    p.report("sig_all", 1, 0);
}

/// Errors: what fails, with which status, on which side, and what
/// happens to the requests behind it.
fn errors(dev: &Dev) {
    // A SEND longer than the receive it lands in.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 16);
    p.send(1, SEND, ARGS);
    p.report("recv_too_short", 1, 1);

    // A SEND with no receive posted, and no RNR retries.
    let no_rnr = Transport {
        rnr_retry: 0,
        ..DEFAULT
    };
    let p = Pair::new(dev, no_rnr, DEFAULT, false);
    p.send(1, SEND, ARGS);
    p.send(2, SEND, ARGS);
    p.report("rnr", 2, 0);

    // A WRITE with a wrong rkey, two requests behind it.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.send(
        1,
        WRITE,
        SendArgs {
            rkey: Some(p.buf_b.rkey() ^ 0x5a5a_0000),
            ..ARGS
        },
    );
    p.send(2, WRITE, ARGS);
    p.send(3, WRITE, ARGS);
    p.report("write_bad_rkey", 3, 0);

    // A WRITE past the end of the remote region.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.send(
        1,
        WRITE,
        SendArgs {
            roff: 4096 - 32,
            ..ARGS
        },
    );
    p.report("write_past_region", 1, 0);

    // A READ from a region without remote read.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    let local_only = dev.mr(4096, ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0);
    p.send(
        1,
        READ,
        SendArgs {
            rkey: Some(local_only.rkey()),
            ..ARGS
        },
    );
    p.report("read_no_access", 1, 0);
    drop(local_only);

    // A WRITE to a QP that does not allow remote writes.
    let no_write = Transport {
        access: ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0,
        ..DEFAULT
    };
    let p = Pair::new(dev, DEFAULT, no_write, false);
    p.send(1, WRITE, ARGS);
    p.report("write_qp_no_access", 1, 0);

    // A SEND from a wrong lkey.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    p.recv(true, 10, 0, 256);
    p.send(
        1,
        SEND,
        SendArgs {
            lkey: Some(p.buf_a.lkey() ^ 0x5a5a_0000),
            ..ARGS
        },
    );
    p.send(2, SEND, ARGS);
    p.report("send_bad_lkey", 2, 1);

    // Receives flushed by a move to ERR, in the order posted.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    for i in 0..3 {
        p.recv(true, 10 + i, 0, 256);
    }
    to_state(p.b, ibv_qp_state::IBV_QPS_ERR, 0, DEFAULT, dev);
    p.report("flush_recvs", 0, 3);

    // Requests posted to a QP already in ERR.
    let p = Pair::new(dev, DEFAULT, DEFAULT, false);
    to_state(p.a, ibv_qp_state::IBV_QPS_ERR, 0, DEFAULT, dev);
    let rc_send = p.send(1, SEND, ARGS);
    let rc_recv = p.recv(false, 2, 0, 256);
    println!(
        "post_in_err.post = send={} recv={}",
        errno_name(rc_send),
        errno_name(rc_recv)
    );
    p.report("post_in_err", 2, 0);

    // A SEND to a QP number nobody has, with a short retry budget.
    let short = Transport {
        timeout: 8,
        retry_cnt: 1,
        ..DEFAULT
    };
    let mut p = Pair::new(dev, short, DEFAULT, false);
    unsafe { ibv_destroy_qp(p.b) };
    p.b = dev.qp(p.cq_b, false); // b's place, in RESET, under a new number
    p.send(1, SEND, ARGS);
    p.send(2, SEND, ARGS);
    p.report("no_peer", 2, 0);
}

/// Connects `x` and `y` (RESET to RTS, each toward the other).
fn pair_up(dev: &Dev, x: *mut ibv_qp, y: *mut ibv_qp) {
    let (nx, ny) = unsafe { ((*x).qp_num, (*y).qp_num) };
    up(x, ny, DEFAULT, dev);
    up(y, nx, DEFAULT, dev);
}

/// One SEND of 8 bytes from `qp`, waited for on its CQ `cq`: on success
/// the receive's completion is in the responder's CQ too (an RC responder
/// completes a receive before it acknowledges the SEND).
fn send_waited(qp: *mut ibv_qp, cq: *mut ibv_cq, buf: &Buf, wr_id: u64) -> String {
    let mut sge = ibv_sge {
        addr: buf.addr(0),
        length: 8,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    wr.opcode = SEND;
    wr.send_flags = SIGNALED;
    let mut bad = null_mut();
    if unsafe { ibv_post_send(qp, &mut wr, &mut bad) } != 0 {
        die("ibv_post_send");
    }
    match wcs(cq, 1).first() {
        Some(wc) => status_name(wc.status),
        None => "none".into(),
    }
}

/// `ibv_post_recv` (to `qp`) or `ibv_post_srq_recv` (to `srq`) of one
/// 64-byte receive: its return code.
fn post_one_recv(qp: *mut ibv_qp, srq: *mut ibv_srq, buf: &Buf, wr_id: u64) -> i32 {
    let mut sge = ibv_sge {
        addr: buf.addr(64),
        length: 64,
        lkey: buf.lkey(),
    };
    let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
    wr.wr_id = wr_id;
    wr.sg_list = &mut sge;
    wr.num_sge = 1;
    let mut bad = null_mut();
    unsafe {
        if srq.is_null() {
            ibv_post_recv(qp, &mut wr, &mut bad)
        } else {
            ibv_post_srq_recv(srq, &mut wr, &mut bad)
        }
    }
}

fn make_srq(dev: &Dev, max_wr: u32) -> (*mut ibv_srq, u64) {
    let mut a: ibv_srq_init_attr = unsafe { std::mem::zeroed() };
    a.attr.max_wr = max_wr;
    a.attr.max_sge = 1;
    let srq = unsafe { ibv_create_srq(dev.pd, &mut a) };
    if srq.is_null() {
        die("ibv_create_srq");
    }
    let mut q: ibv_srq_attr = unsafe { std::mem::zeroed() };
    if unsafe { ibv_query_srq(srq, &mut q) } != 0 {
        die("ibv_query_srq");
    }
    (srq, u64::from(q.max_wr))
}

/// Every async event already queued, read and acknowledged (earlier probes
/// raise some on some devices).
fn drain_async_events(dev: &Dev) {
    while next_async_event(dev, Duration::ZERO).is_some() {}
}

/// The next async event within `wait`: its type and element, acknowledged.
fn next_async_event(dev: &Dev, wait: Duration) -> Option<(u32, usize)> {
    let mut p = libc::pollfd {
        fd: unsafe { (*dev.ctx).async_fd },
        events: libc::POLLIN,
        revents: 0,
    };
    if unsafe { libc::poll(&mut p, 1, wait.as_millis() as i32) } != 1 {
        return None;
    }
    let mut ev: ibv_async_event = unsafe { std::mem::zeroed() };
    if unsafe { ibv_get_async_event(dev.ctx, &mut ev) } != 0 {
        die("ibv_get_async_event");
    }
    let ty = unsafe { *(std::ptr::addr_of!(ev.event_type) as *const u32) };
    let element = unsafe { ev.element.qp } as usize;
    unsafe { ibv_ack_async_event(&mut ev) };
    Some((ty, element))
}

/// Waits up to `wait` for `IBV_EVENT_QP_LAST_WQE_REACHED` naming `qp`
/// (other events are read and dropped): the probe line's value.
fn last_wqe_event(dev: &Dev, qp: *mut ibv_qp, wait: Duration) -> String {
    let end = Instant::now() + wait;
    loop {
        let left = end.saturating_duration_since(Instant::now());
        match next_async_event(dev, left) {
            Some((QP_LAST_WQE_REACHED, e)) if e == qp as usize => {
                return "QP_LAST_WQE_REACHED qp=b".into()
            }
            Some(_) => continue,
            None => return "none".into(),
        }
    }
}

/// What `ibv_destroy_qp` does with what the QP leaves behind, and when the
/// last-WQE event of a QP on an SRQ comes.
fn teardown(dev: &Dev) {
    destroy_unpolled(dev);
    destroy_srq(dev);
    last_wqe(dev);
}

/// `b` and `d` share a CQ; `a` SENDs to `b` and `c` to `d`, in turn, and
/// nobody polls the shared CQ. `b` is destroyed, then the shared CQ is
/// polled: the completions left there of each QP (`b`'s sorted by
/// wr_id).
fn destroy_unpolled(dev: &Dev) {
    let shared = dev.cq();
    let (cq_a, cq_c) = (dev.cq(), dev.cq());
    let (b, d) = (dev.qp(shared, false), dev.qp(shared, false));
    let (a, c) = (dev.qp(cq_a, false), dev.qp(cq_c, false));
    pair_up(dev, a, b);
    pair_up(dev, c, d);
    let buf = dev.mr(4096, ACCESS_ALL);
    for i in 0..2 {
        post_one_recv(b, null_mut(), &buf, 10 + i);
        post_one_recv(d, null_mut(), &buf, 20 + i);
    }
    let mut sent = Vec::new();
    for (i, (qp, cq)) in [(a, cq_a), (c, cq_c), (a, cq_a), (c, cq_c)]
        .into_iter()
        .enumerate()
    {
        sent.push(send_waited(qp, cq, &buf, i as u64 + 1));
    }
    println!("destroy_unpolled.sent = {}", sent.join(" "));
    let (nb, nd) = unsafe { ((*b).qp_num, (*d).qp_num) };
    println!(
        "destroy_unpolled.destroy = {}",
        errno_name(unsafe { ibv_destroy_qp(b) })
    );
    let left = wcs(shared, 2);
    for (name, num) in [("b", nb), ("d", nd)] {
        let mut mine: Vec<&ibv_wc> = left.iter().filter(|w| w.qp_num == num).collect();
        if name == "b" {
            mine.sort_by_key(|w| w.wr_id);
        }
        println!("destroy_unpolled.{name}.count = {}", mine.len());
        for (i, wc) in mine.iter().enumerate() {
            println!("destroy_unpolled.{name}.{i} = {}", describe(wc, name));
        }
    }
    let others = left
        .iter()
        .filter(|w| w.qp_num != nb && w.qp_num != nd)
        .count();
    println!("destroy_unpolled.other.count = {others}");
    drop(buf);
    unsafe {
        ibv_destroy_qp(a);
        ibv_destroy_qp(c);
        ibv_destroy_qp(d);
        for cq in [shared, cq_a, cq_c] {
            ibv_destroy_cq(cq);
        }
    }
}

/// `b` on an SRQ filled to its capacity; `a` SENDs to `b` twice; `b` is
/// destroyed with both receive completions unpolled. Then: what `b`'s CQ
/// still holds, and whether the SRQ takes two receives again, and a third.
fn destroy_srq(dev: &Dev) {
    let (srq, cap) = make_srq(dev, 4);
    let (cq_a, cq_b) = (dev.cq(), dev.cq());
    let b = dev.qp_on(cq_b, srq, false);
    let a = dev.qp(cq_a, false);
    pair_up(dev, a, b);
    let buf = dev.mr(4096, ACCESS_ALL);
    let filled = (0..cap).all(|i| post_one_recv(null_mut(), srq, &buf, 100 + i) == 0);
    println!(
        "destroy_srq.fill = {}",
        if filled { "ok" } else { "refused" }
    );
    let over = post_one_recv(null_mut(), srq, &buf, 999);
    println!("destroy_srq.over = {}", errno_name(over));
    let sent: Vec<String> = (1..=2).map(|i| send_waited(a, cq_a, &buf, i)).collect();
    println!("destroy_srq.sent = {}", sent.join(" "));
    println!(
        "destroy_srq.destroy = {}",
        errno_name(unsafe { ibv_destroy_qp(b) })
    );
    println!("destroy_srq.b.count = {}", wcs(cq_b, 0).len());
    let refill: Vec<String> = (0..2)
        .map(|i| errno_name(post_one_recv(null_mut(), srq, &buf, 200 + i)))
        .collect();
    println!("destroy_srq.refill = {}", refill.join(" "));
    let over = post_one_recv(null_mut(), srq, &buf, 999);
    println!("destroy_srq.refill_over = {}", errno_name(over));
    drop(buf);
    unsafe {
        ibv_destroy_qp(a);
        ibv_destroy_srq(srq);
        ibv_destroy_cq(cq_a);
        ibv_destroy_cq(cq_b);
    }
}

/// `b` on an SRQ took one receive; then it goes to ERR: does the last-WQE
/// event come (within [`EVENT_WAIT`]), what `b`'s CQ holds then, and does a
/// second move to ERR raise it again.
fn last_wqe(dev: &Dev) {
    let (srq, _) = make_srq(dev, 4);
    let (cq_a, cq_b) = (dev.cq(), dev.cq());
    let b = dev.qp_on(cq_b, srq, false);
    let a = dev.qp(cq_a, false);
    pair_up(dev, a, b);
    let buf = dev.mr(4096, ACCESS_ALL);
    for i in 0..4 {
        post_one_recv(null_mut(), srq, &buf, 100 + i);
    }
    println!("last_wqe.sent = {}", send_waited(a, cq_a, &buf, 1));
    drain_async_events(dev);
    let rc = to_state(b, ibv_qp_state::IBV_QPS_ERR, 0, DEFAULT, dev);
    println!("last_wqe.to_err = {}", errno_name(rc));
    println!("last_wqe.event = {}", last_wqe_event(dev, b, EVENT_WAIT));
    let left = wcs(cq_b, 1);
    println!("last_wqe.b.count = {}", left.len());
    for (i, wc) in left.iter().enumerate() {
        println!("last_wqe.b.{i} = {}", describe(wc, "b"));
    }
    let rc = to_state(b, ibv_qp_state::IBV_QPS_ERR, 0, DEFAULT, dev);
    println!(
        "last_wqe.again = {} event={}",
        errno_name(rc),
        last_wqe_event(dev, b, QUIET)
    );
    drop(buf);
    unsafe {
        ibv_destroy_qp(a);
        ibv_destroy_qp(b);
        ibv_destroy_srq(srq);
        ibv_destroy_cq(cq_a);
        ibv_destroy_cq(cq_b);
    }
}
