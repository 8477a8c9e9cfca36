//! Extended CQs (`ibv_create_cq_ex`, `ibv_start_poll` …) through the real
//! libibverbs (rdma-sys), both QPs in one process.
//! Run under `softverbs-run` (the CI script does); skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::ptr::null_mut;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

macro_rules! needs_launcher {
    ($name:expr) => {
        if !launcher_or_skip($name) {
            return;
        }
    };
}

#[test]
fn extended_cq_single_threaded() {
    needs_launcher!("extended_cq_single_threaded");
    let dev = Dev::open();
    let mut attr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    attr.cqe = 16;
    attr.wc_flags = (ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0
        | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_IMM.0
        | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_QP_NUM.0
        | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SRC_QP.0) as u64;
    attr.comp_mask = ibv_cq_init_attr_mask::IBV_CQ_INIT_ATTR_MASK_FLAGS.0;
    attr.flags = ibv_create_cq_attr_flags::IBV_CREATE_CQ_ATTR_SINGLE_THREADED.0;
    let cqx = create_cq_ex(dev.ctx, &mut attr);
    assert!(!cqx.is_null(), "create_cq_ex");
    let rcq = unsafe { ibv_cq_ex_to_cq(cqx) };
    let scq = dev.cq(16, null_mut());
    let a = dev.qp(scq, scq, null_mut());
    let b = dev.qp(rcq, rcq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 64, 4);
    post_recv(b, &buf, 32, 32, 77);
    post_recv(b, &buf, 32, 32, 78);
    let s = Send {
        imm: 9u32.to_be(),
        ..send(WR_SEND_IMM, 0)
    };
    assert_eq!(post_send(a, &buf, 0, 12, 1, s), 0);
    assert_eq!(post_send(a, &buf, 0, 3, 2, send(WR_SEND, 0)), 0);
    let mut pa: ibv_poll_cq_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_start_poll(cqx, &mut pa) }, 0);
    unsafe {
        assert_eq!(((*cqx).wr_id, (*cqx).status), (77, WC_SUCCESS));
        assert_eq!(ibv_wc_read_opcode(cqx), ibv_wc_opcode::IBV_WC_RECV);
        assert_eq!(ibv_wc_read_byte_len(cqx), 12);
        assert_eq!(ibv_wc_read_imm_data(cqx), 9u32.to_be());
        assert_eq!(ibv_wc_read_qp_num(cqx), qpn(b));
        assert_eq!(ibv_wc_read_src_qp(cqx), qpn(a));
        assert_eq!(ibv_next_poll(cqx), 0);
        assert_eq!(((*cqx).wr_id, ibv_wc_read_byte_len(cqx)), (78, 3));
        assert_eq!(ibv_next_poll(cqx), libc::ENOENT);
        ibv_end_poll(cqx);
        assert_eq!(ibv_start_poll(cqx, &mut pa), libc::ENOENT);
    }
    // Unsupported completion fields are refused, not ignored.
    let mut bad: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    bad.cqe = 4;
    bad.wc_flags = ibv_create_cq_wc_flags::IBV_WC_EX_WITH_CVLAN.0 as u64;
    let r = create_cq_ex(dev.ctx, &mut bad);
    assert!(r.is_null());
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EOPNOTSUPP)
    );
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(rcq) }, 0);
}

/// Completions drained per `start_poll`…`end_poll` window in the two-poller
/// test (small, so that the pollers meet often).
const WINDOW_BATCH: usize = 8;

/// Spin-loop hints between reading a completion's `wr_id` and its byte
/// length (the work an application does per completion).
const WORK_SPINS: u32 = 64;

/// One completion as a poller saw it: (wr_id, status, byte_len).
type Seen = (u64, u32, u32);

/// The byte length send `i` carries, so that a poller can tell whether the
/// `wr_id` and the `read_*` values it saw belong to the same completion.
fn len_of(i: u64) -> u32 {
    (i % 61) as u32 + 1
}

/// Rounds of the two-poller test, and completions per round.
const ROUNDS: u64 = 100;
const PER_ROUND: u64 = 8000;

/// One poller of the two-poller test: each round, once released by `go`,
/// drain `cq` with start/next/end_poll until both pollers together saw the
/// round's completions, then meet at `done`. Nothing here panics inside a
/// poll window (that would keep the CQ's lock); the caller checks what was
/// seen.
fn drain_ex(cq: SendPtr<ibv_cq_ex>, seen: &AtomicU64, go: &Barrier, done: &Barrier) -> Vec<Seen> {
    let cq = cq.0;
    let mut out = Vec::new();
    let mut pa: ibv_poll_cq_attr = unsafe { std::mem::zeroed() };
    for round in 1..=ROUNDS {
        go.wait();
        let deadline = Instant::now() + Duration::from_secs(20);
        while seen.load(Ordering::Acquire) < round * PER_ROUND && Instant::now() < deadline {
            let rc = unsafe { ibv_start_poll(cq, &mut pa) };
            if rc != 0 {
                assert_eq!(rc, libc::ENOENT, "start_poll");
                continue;
            }
            for n in 1.. {
                let (wr_id, status) = unsafe { ((*cq).wr_id, (*cq).status) };
                // A little work per completion, as an application does
                // between reading one field and the next.
                for _ in 0..WORK_SPINS {
                    std::hint::spin_loop();
                }
                out.push((wr_id, status, unsafe { ibv_wc_read_byte_len(cq) }));
                seen.fetch_add(1, Ordering::Release);
                if n == WINDOW_BATCH || unsafe { ibv_next_poll(cq) } != 0 {
                    break;
                }
            }
            unsafe { ibv_end_poll(cq) };
        }
        done.wait();
    }
    out
}

/// Two threads poll one extended CQ created *without*
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`, side by side on a CQ filled
/// beforehand (one round after another): the provider serialises the
/// start_poll…end_poll windows, so each completion is seen by exactly one
/// poller, with its own wr_id, status and byte length.
#[test]
fn extended_cq_two_pollers_see_each_completion_once() {
    needs_launcher!("extended_cq_two_pollers_see_each_completion_once");
    const N: u64 = ROUNDS * PER_ROUND;
    let dev = Dev::open();
    let mut attr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    attr.cqe = PER_ROUND as u32;
    attr.wc_flags = ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0 as u64;
    let cqx = create_cq_ex(dev.ctx, &mut attr);
    assert!(!cqx.is_null(), "create_cq_ex");
    let rcq = unsafe { ibv_cq_ex_to_cq(cqx) };
    let scq = dev.cq(16, null_mut());
    let srq = dev.srq(PER_ROUND as u32);
    let a = dev.qp(scq, scq, null_mut());
    let b = dev.qp(rcq, rcq, srq);
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 128, 5);
    let seen = AtomicU64::new(0);
    let (go, done) = (Barrier::new(3), Barrier::new(3));
    // The two pollers share `cqx` (the point of the test); only this thread
    // posts, and only while the pollers wait at `go`.
    let per: Vec<Vec<Seen>> = std::thread::scope(|s| {
        let pollers: Vec<_> = (0..2)
            .map(|_| {
                let cq = SendPtr(cqx);
                let (seen, go, done) = (&seen, &go, &done);
                s.spawn(move || drain_ex(cq, seen, go, done))
            })
            .collect();
        for round in 0..ROUNDS {
            for i in round * PER_ROUND..(round + 1) * PER_ROUND {
                // The SRQ is FIFO: receive `i` takes send `i`.
                post_srq_recv(srq, &buf, 64, 64, i);
                assert_eq!(post_send(a, &buf, 0, len_of(i), i, send(WR_SEND, 0)), 0);
            }
            go.wait();
            done.wait();
        }
        pollers
            .into_iter()
            .map(|p| p.join().expect("poller thread"))
            .collect()
    });
    let counts: Vec<usize> = per.iter().map(Vec::len).collect();
    assert!(
        counts.iter().all(|&c| c > 0),
        "both pollers took part: {counts:?}"
    );
    let got: Vec<Seen> = per.into_iter().flatten().collect();
    let torn: Vec<&Seen> = got
        .iter()
        .filter(|&&(id, st, len)| st != WC_SUCCESS || len != len_of(id))
        .take(5)
        .collect();
    assert!(
        torn.is_empty(),
        "completions seen torn: {torn:?} (per poller {counts:?})"
    );
    let mut ids: Vec<u64> = got.iter().map(|w| w.0).collect();
    ids.sort_unstable();
    let dups = ids.windows(2).filter(|w| w[0] == w[1]).count();
    ids.dedup();
    assert_eq!(
        (ids.len() as u64, dups, got.len() as u64),
        (N, 0, N),
        "every completion seen exactly once (distinct ids, duplicates, seen)"
    );
    assert!(ids.iter().copied().eq(0..N), "the ids are the posted ones");
    assert_eq!(unsafe { ibv_destroy_qp(a) }, 0);
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(rcq) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(scq) }, 0);
}

fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

fn realtime_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

#[test]
fn extended_cq_stamps_completions_with_the_device_clock() {
    needs_launcher!("extended_cq_stamps_completions_with_the_device_clock");
    let dev = Dev::open();
    let mut attr: ibv_device_attr_ex = unsafe { std::mem::zeroed() };
    assert_eq!(query_device_ex(dev.ctx, &mut attr), 0);
    assert_eq!(attr.hca_core_clock, 1_000_000, "kHz: one tick per ns");
    assert_eq!(attr.completion_timestamp_mask, u64::MAX);
    let mut ca: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    ca.cqe = 8;
    ca.wc_flags = (ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP.0
        | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK.0)
        as u64;
    let cqx = create_cq_ex(dev.ctx, &mut ca);
    assert!(!cqx.is_null());
    let cq = unsafe { ibv_cq_ex_to_cq(cqx) };
    let a = dev.qp(cq, cq, null_mut());
    let b = dev.qp(cq, cq, null_mut());
    connect(a, qpn(b));
    connect(b, qpn(a));
    let buf = Buf::new(&dev, 8, 0);
    let (t0, w0) = (monotonic_ns(), realtime_ns());
    assert_eq!(post_send(a, &buf, 0, 8, 1, send(WR_WRITE, SIGNALED)), 0);
    let (t1, w1) = (monotonic_ns(), realtime_ns());
    let mut pa: ibv_poll_cq_attr = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { ibv_start_poll(cqx, &mut pa) }, 0);
    let (ts, wall) = unsafe {
        (
            ((*cqx).read_completion_ts.expect("read_completion_ts"))(cqx),
            ((*cqx)
                .read_completion_wallclock_ns
                .expect("read_completion_wallclock_ns"))(cqx),
        )
    };
    unsafe { ibv_end_poll(cqx) };
    assert!(t0 <= ts && ts <= t1, "{t0} <= {ts} <= {t1}");
    // Converted with the offset at read time: within a few ms of the send.
    assert!(
        wall + 5_000_000 >= w0 && wall <= w1 + 5_000_000,
        "{w0} ~ {wall} ~ {w1}"
    );
    // ibv_query_rt_values_ex reads the same clock.
    let v = unsafe {
        let off = std::mem::offset_of!(verbs_context, context);
        (*dev.ctx.cast::<u8>().sub(off).cast::<verbs_context>())
            .query_rt_values
            .expect("query_rt_values slot")
    };
    let mut values: ibv_values_ex = unsafe { std::mem::zeroed() };
    values.comp_mask = 1 | 2; // RAW_CLOCK and an unknown bit
    assert_eq!(unsafe { v(dev.ctx, &mut values) }, 0);
    assert_eq!(
        values.comp_mask, 1,
        "what the device cannot report is cleared"
    );
    assert!(values.raw_clock.tv_nsec as u64 >= ts);
    // A resized CQ keeps stamping (its new ring's header says so too).
    assert_eq!(unsafe { ibv_resize_cq(cq, 64) }, 0);
    let t2 = monotonic_ns();
    assert_eq!(post_send(a, &buf, 0, 8, 2, send(WR_WRITE, SIGNALED)), 0);
    let t3 = monotonic_ns();
    assert_eq!(unsafe { ibv_start_poll(cqx, &mut pa) }, 0);
    let ts2 = unsafe { ((*cqx).read_completion_ts.expect("read_completion_ts"))(cqx) };
    unsafe { ibv_end_poll(cqx) };
    assert!(
        t2 <= ts2 && ts2 <= t3,
        "after the resize: {t2} <= {ts2} <= {t3}"
    );
    // A CQ that did not ask for timestamps is not stamped: nobody reads
    // the clock for its completions (the verbs leave the reading
    // undefined there; softverbs answers 0).
    let mut plain_attr: ibv_cq_init_attr_ex = unsafe { std::mem::zeroed() };
    plain_attr.cqe = 8;
    let plainx = create_cq_ex(dev.ctx, &mut plain_attr);
    assert!(!plainx.is_null());
    let plain = unsafe { ibv_cq_ex_to_cq(plainx) };
    let c = dev.qp(plain, plain, null_mut());
    let d = dev.qp(plain, plain, null_mut());
    connect(c, qpn(d));
    connect(d, qpn(c));
    assert_eq!(post_send(c, &buf, 0, 8, 3, send(WR_WRITE, SIGNALED)), 0);
    assert_eq!(unsafe { ibv_start_poll(plainx, &mut pa) }, 0);
    let unstamped = unsafe { ((*plainx).read_completion_ts.expect("read_completion_ts"))(plainx) };
    unsafe { ibv_end_poll(plainx) };
    assert_eq!(unstamped, 0, "a CQ without the flags is not stamped");
    unsafe {
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_destroy_qp(c), 0);
        assert_eq!(ibv_destroy_qp(d), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        assert_eq!(ibv_destroy_cq(plain), 0);
    }
}
