//! Per-completion cost of routing real verbs completions, side by side in
//! one run, on one softverbs CQ:
//!
//! - `hand-written`: `ibv_poll_cq` (rdma-sys) in batches of 32 and a
//!   `match` on the wr_id, which the poster encoded by hand (kind, handler,
//!   sequence), calling the handler's method directly: what users write
//!   today;
//! - `cqd dispatch`: the same CQ through cqd's poller (`CqPoller::poll_once`,
//!   batch 32) to 64 registered handlers; the poster posts through the
//!   posting call (`Registration::post_send` / `post_recv`), so each
//!   completion also retires its queue account's entry and returns its CQ
//!   credit;
//! - `hand-written + contexts`: the hand-written loop keeping a context per
//!   request, as SPDK and the kernel do: the poster stores the request's
//!   value in a slab slot named by the wr_id, the poller reads it back
//!   (one slot per request in flight, indexed from its sequence number);
//! - `cqd + contexts`: cqd's poller with `ContextHandler`s, each request
//!   posted with a `u64` context through `ContextRegistration::post_send` /
//!   `post_recv` and handed back to its callback;
//! - `mutex map`: `ibv_poll_cq`, then per completion a lock of a
//!   `Mutex<HashMap<u64, u32>>` (wr_id → handler) to remove the entry that
//!   the posting thread inserted (one lock per request) before it posted,
//!   as some RDMA crates route. The value is the handler's index, the
//!   kindest form of that design (no callback allocation per request).
//!
//! Two streams, the same for all three contenders: two RC QP pairs on the
//! CQ, and each round the posting thread posts 1,024 requests in lists of
//! 8 per handler (64 handlers, round robin) on one pair:
//!
//! - `SEND/RECV`: 512 receives on the pair's responder, then 512 signaled
//!   64-byte SENDs from its requester: receive and send completions
//!   alternate (two queues: the accounting's worst case, one account lock
//!   per completion);
//! - `RDMA WRITE`: 1,024 signaled 64-byte WRITEs: every completion from one
//!   send queue (one account lock per batch).
//!
//! And three settings:
//!
//! - `quiet`: the poster posts a round, then the poller drains a round's
//!   worth while the poster waits;
//! - `concurrent, other pair`: the poster posts the next round while the
//!   poller drains, rounds alternating between the two QP pairs: insert
//!   (post) and remove (completion) run at once, on different queues;
//! - `concurrent, same pair`: the same on one pair: the poster posts on the
//!   very queues whose completions are being retired.
//!
//! In every setting the CQ holds more than the round needs, so every poll
//! of a timed round returns completions and the time measured is the
//! consumption only (the poller thread's wall time per completion). The
//! poller (this thread) is pinned to CPU 1 and the poster to CPU 0; each
//! run of the bench gives every contender its turn in each stream and
//! setting, and the tables give the median with the min–max over the runs.
//!
//! Then `cqd_verbs::completion_of` (ibv_wc → cqd's `Completion`) over
//! batches of 32 real `ibv_wc`s captured from the CQ. The two share one
//! layout, so this is a copy, and it is not on cqd's path: the verbs source
//! polls straight into its batch of completions. The line shows what a
//! conversion would add.
//!
//! ```text
//! cargo build -p softverbs --release    # and copy libsoftverbs.so to libsoftverbs-rdmav34.so
//! CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER=$PWD/target/release/softverbs-run \
//!     cargo bench --features verbs --bench verbs_dispatch
//! ```
//!
//! Then the **width axis**: the number of QP pairs whose completions a
//! batch interleaves, 1, 8, 32 and 256 (256 connections on one CQ), on a
//! CQ of its own, quiet, both streams, each request posted alone (a list of
//! 1), pair after pair, and three contenders:
//!
//! - `same-promise`: what a careful engineer writes for one server, with
//!   cqd's promises: a wr_id of (queue, side, position), a per-queue array
//!   of contexts the poster fills, an in-order head check that counts stale
//!   completions and delivers none, a send retiring everything before it,
//!   credits counted once per batch, a `match` to the callback;
//! - `cqd` and `cqd+ctx`: a plain handler, or a context handler with a
//!   `u64` per request, per pair, through the posting call.
//!
//! The run ends with one line per goal, `ratio NAME = VALUE`, each the
//! median of the runs' own ratios: `cqd/same-promise` and
//! `cqd+ctx/same-promise` per width and stream, `flat width=256/1`,
//! `same-pair/quiet`, `mutexmap/cqd setting=other|same`, and
//! `post/hand-written list=1|8` (list 1: the width axis at width 1 against
//! the same-promise post; list 8: the quiet setting above against the
//! hand-written post).
//!
//! (`-- --quick`: one short run, a smoke test; `-- --width`: the width axis
//! alone; `-- --profile cqd` and the like: one contender alone, for a
//! profiler.) Without softverbs-run (or a real device) it prints
//! `SKIPPED: needs softverbs-run` and exits 0.
//! Figures are recorded in docs/benchmarks.md.

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

#[path = "common/handlers.rs"]
mod handlers;
use handlers::{Count, CountCtx};

use cqd::core::{Completion, ContextRegistration, CqOptions, CqPoller, NoWork, Registration};
use cqd::verbs::{
    completion_of, Access, ConnectOptions, Context, Cq, CqSpec, Mr, Qp, QpCap, QpInit, RecvWr,
    SendWr, Sge, WrOp,
};
use rdma_sys::{ibv_recv_wr, ibv_send_wr, ibv_sge, ibv_wc};

const HANDLERS: usize = 64;
/// Requests per post call: one handler's list.
const LIST: usize = 8;
/// SENDs (and receives) per round.
const PAIRS: usize = 512;
/// Completions per round.
const ROUND: usize = 2 * PAIRS;
const BATCH: usize = 32;
const MSG: u32 = 64;
const CQ_ENTRIES: u32 = 32_768;
/// Each queue's depth: up to two rounds (and a batch) are outstanding.
const DEPTH: u32 = 4096;
/// The hand-encoded wr_id's kind (top two bits).
const KIND_RECV: u64 = 1 << 62;
const KIND_SEND: u64 = 2 << 62;
const KIND_WRITE: u64 = 3 << 62;
const POLLER_CPU: usize = 1;
const POSTER_CPU: usize = 0;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Contender {
    Raw,
    Cqd,
    Map,
    RawCtx,
    CqdCtx,
}

const CONTENDERS: [Contender; 5] = [
    Contender::Raw,
    Contender::Cqd,
    Contender::Map,
    Contender::RawCtx,
    Contender::CqdCtx,
];
/// Slots of the hand-written context slab: more than the requests in
/// flight (two rounds).
const CTX_SLOTS: usize = 8192;

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Raw => "hand-written ibv_poll_cq + match",
            Contender::Cqd => "cqd dispatch (poller + handlers)",
            Contender::Map => "mutex map (insert on post, remove on completion)",
            Contender::RawCtx => "hand-written + contexts (slab by wr_id)",
            Contender::CqdCtx => "cqd + contexts (ContextHandler)",
        }
    }
}

/// The hand-written loop's context slab: one slot per request in flight,
/// written by the poster before the post, read by the poller (plain loads
/// and stores on x86; atomics so that Rust orders them as C would).
type Slab = Arc<Vec<AtomicU64>>;

/// The hand-written loop's handlers: the same work, called directly.
#[derive(Default)]
struct Plain(u64);

impl Plain {
    #[inline]
    fn on_send(&mut self, tag: u32) {
        self.0 += u64::from(tag);
    }
    #[inline]
    fn on_recv(&mut self, byte_len: u32) {
        self.0 += u64::from(byte_len);
    }
}

type Map = Arc<Mutex<HashMap<u64, u32>>>;

/// What the posting thread puts on the CQ each round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    /// 512 receives on QP b, then 512 SENDs on QP a: receive and send
    /// completions alternate (two queues, the accounting's worst case).
    SendRecv,
    /// 1,024 RDMA WRITEs on QP a into QP b's side of the region: every
    /// completion from one send queue.
    Write,
}

const STREAMS: [Stream; 2] = [Stream::SendRecv, Stream::Write];

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::SendRecv => "SEND/RECV (receive and send completions alternate)",
            Stream::Write => "RDMA WRITE (one send queue)",
        }
    }

    /// The name in the `ratio` lines.
    fn short(self) -> &'static str {
        match self {
            Stream::SendRecv => "send-recv",
            Stream::Write => "write",
        }
    }
}

/// When the posting thread posts, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Setting {
    /// A round is posted, then drained while the poster waits.
    Quiet,
    /// The next round is posted while the poller drains, on the other QP
    /// pair (rounds alternate between two pairs): concurrent insert and
    /// remove, on different queues.
    Other,
    /// The next round is posted while the poller drains, on the same QP
    /// pair: the poster posts on the very queues being retired.
    Same,
}

const SETTINGS: [Setting; 3] = [Setting::Quiet, Setting::Other, Setting::Same];

impl Setting {
    fn name(self) -> &'static str {
        match self {
            Setting::Quiet => "quiet",
            Setting::Other => "concurrent, other pair",
            Setting::Same => "concurrent, same pair",
        }
    }

    fn concurrent(self) -> bool {
        self != Setting::Quiet
    }

    /// The QP pair round `r` is posted on.
    fn pair(self, r: usize) -> usize {
        match self {
            Setting::Same => 0,
            _ => r % 2,
        }
    }
}

/// One measurement, for the posting thread.
#[derive(Clone, Copy)]
struct Job {
    who: Contender,
    stream: Stream,
    setting: Setting,
    rounds: usize,
}

/// The posting thread's side.
struct Poster {
    /// Two QP pairs (a → b): requests are posted on a's send queue and
    /// b's receive queue.
    pairs: Vec<(Arc<Qp>, Arc<Qp>)>,
    /// The pair of the round being posted.
    cur: usize,
    mr: Mr,
    regs: Vec<Registration>,
    ctx_regs: Vec<ContextRegistration<u64>>,
    map: Map,
    slab: Slab,
    barrier: Arc<Barrier>,
    seq: u64,
}

impl Poster {
    /// Posts one round (see the module documentation); returns its time.
    fn post_round(&mut self, who: Contender, stream: Stream, pair: usize) -> Duration {
        self.cur = pair;
        let start = Instant::now();
        let parts: &[(u64, usize)] = match stream {
            Stream::SendRecv => &[(KIND_RECV, PAIRS), (KIND_SEND, PAIRS)],
            Stream::Write => &[(KIND_WRITE, ROUND)],
        };
        for &(side, n) in parts {
            for list in 0..n / LIST {
                let h = list % HANDLERS;
                match who {
                    Contender::Cqd => self.post_cqd(side, h),
                    Contender::CqdCtx => self.post_cqd_ctx(side, h),
                    Contender::Raw | Contender::Map | Contender::RawCtx => {
                        self.post_raw(side, h, who)
                    }
                }
            }
        }
        start.elapsed()
    }

    fn post_cqd(&mut self, side: u64, h: usize) {
        let mr = &self.mr;
        let sges: [[Sge<'_>; 1]; LIST] = std::array::from_fn(|i| [mr.sge(buf(side, i), MSG)]);
        let tag = self.seq & 0xffff;
        self.seq += LIST as u64;
        let reg = &self.regs[h];
        if side == KIND_RECV {
            let mut wrs: [RecvWr<'_>; LIST] =
                std::array::from_fn(|i| RecvWr::new(tag + i as u64, &sges[i]));
            reg.post_recv(&*self.pairs[self.cur].1, &mut wrs)
                .expect("post_recv");
        } else {
            let op = |i: usize| match side {
                KIND_WRITE => WrOp::Write(mr.remote(buf(KIND_RECV, i))),
                _ => WrOp::Send,
            };
            let mut wrs: [SendWr<'_>; LIST] =
                std::array::from_fn(|i| SendWr::new(tag + i as u64, op(i), &sges[i]));
            reg.post_send(&*self.pairs[self.cur].0, &mut wrs)
                .expect("post_send");
        }
    }

    fn post_cqd_ctx(&mut self, side: u64, h: usize) {
        let mr = &self.mr;
        let sges: [[Sge<'_>; 1]; LIST] = std::array::from_fn(|i| [mr.sge(buf(side, i), MSG)]);
        let seq = self.seq;
        self.seq += LIST as u64;
        let ctxs: [u64; LIST] = std::array::from_fn(|i| seq + i as u64);
        let reg = &self.ctx_regs[h];
        if side == KIND_RECV {
            let mut wrs: [RecvWr<'_>; LIST] = std::array::from_fn(|i| RecvWr::new(0, &sges[i]));
            reg.post_recv(&*self.pairs[self.cur].1, &mut wrs, ctxs)
                .expect("post_recv");
        } else {
            let op = |i: usize| match side {
                KIND_WRITE => WrOp::Write(mr.remote(buf(KIND_RECV, i))),
                _ => WrOp::Send,
            };
            let mut wrs: [SendWr<'_>; LIST] =
                std::array::from_fn(|i| SendWr::new(0, op(i), &sges[i]));
            reg.post_send(&*self.pairs[self.cur].0, &mut wrs, ctxs)
                .expect("post_send");
        }
    }

    /// A list of LIST raw requests of handler `h`, with hand-encoded
    /// wr_ids (and, for the mutex map, one insert per request first; for
    /// the context slab, one slot written per request).
    fn post_raw(&mut self, side: u64, h: usize, who: Contender) {
        let map = who == Contender::Map;
        let lkey = self.mr.lkey();
        let mut sges: [ibv_sge; LIST] = std::array::from_fn(|i| ibv_sge {
            addr: self.mr.addr() + buf(side, i) as u64,
            length: MSG,
            lkey,
        });
        let ids: [u64; LIST] = std::array::from_fn(|i| {
            side | (h as u64) << 32 | ((self.seq + i as u64) & 0xffff_ffff)
        });
        self.seq += LIST as u64;
        if map {
            for id in ids {
                self.map.lock().unwrap().insert(id, h as u32);
            }
        }
        if who == Contender::RawCtx {
            for id in ids {
                let slot = (id as usize) % CTX_SLOTS;
                self.slab[slot].store(id & 0xffff, Ordering::Relaxed);
            }
        }
        let base = sges.as_mut_ptr();
        if side == KIND_RECV {
            let mut wrs: [ibv_recv_wr; LIST] = std::array::from_fn(|i| ibv_recv_wr {
                wr_id: ids[i],
                next: std::ptr::null_mut(),
                // SAFETY: `i < LIST`, inside `sges`.
                sg_list: unsafe { base.add(i) },
                num_sge: 1,
            });
            link(&mut wrs, |w, n| w.next = n);
            let mut bad = std::ptr::null_mut();
            let qp = self.pairs[self.cur].1.as_raw();
            // SAFETY: the QP is live (held by `self.pairs`); the list is linked
            // with a null tail; its SGEs name the registered region, which
            // outlives every request (it is dropped after the last drain).
            let r = unsafe { rdma_sys::ibv_post_recv(qp, wrs.as_mut_ptr(), &mut bad) };
            assert_eq!(r, 0, "ibv_post_recv");
        } else {
            let mut wrs: [ibv_send_wr; LIST] = std::array::from_fn(|i| {
                // SAFETY: plain C data; all-zero is a valid value.
                let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
                w.wr_id = ids[i];
                // SAFETY: `i < LIST`, inside `sges`.
                w.sg_list = unsafe { base.add(i) };
                w.num_sge = 1;
                if side == KIND_WRITE {
                    w.opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    w.wr.rdma = rdma_sys::rdma_t {
                        remote_addr: self.mr.addr() + buf(KIND_RECV, i) as u64,
                        rkey: self.mr.rkey(),
                    };
                } else {
                    w.opcode = rdma_sys::ibv_wr_opcode::IBV_WR_SEND;
                }
                w.send_flags = rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
                w
            });
            link(&mut wrs, |w, n| w.next = n);
            let mut bad = std::ptr::null_mut();
            let qp = self.pairs[self.cur].0.as_raw();
            // SAFETY: as for the receives, on a live QP of `self.pairs`.
            let r = unsafe { rdma_sys::ibv_post_send(qp, wrs.as_mut_ptr(), &mut bad) };
            assert_eq!(r, 0, "ibv_post_send");
        }
    }

    /// Runs one measurement's posting side; returns ns per request posted
    /// in the timed rounds.
    fn run(&mut self, job: Job) -> f64 {
        let s = job.setting;
        self.post_round(job.who, job.stream, s.pair(0));
        self.barrier.wait();
        let mut posting = Duration::ZERO;
        for r in 1..=job.rounds {
            if !s.concurrent() {
                posting += self.post_round(job.who, job.stream, s.pair(r));
            }
            self.barrier.wait();
            if s.concurrent() {
                posting += self.post_round(job.who, job.stream, s.pair(r));
            }
            self.barrier.wait();
        }
        posting.as_nanos() as f64 / (job.rounds * ROUND) as f64
    }
}

/// Offset of request `i`'s buffer: SENDs and WRITEs from the first page,
/// receives (and WRITEs) into the second.
fn buf(side: u64, i: usize) -> usize {
    if side == KIND_RECV {
        4096 + i * MSG as usize
    } else {
        i * MSG as usize
    }
}

/// Links `v[i]` to `v[i + 1]`, the last to null.
fn link<T>(v: &mut [T], set: impl Fn(&mut T, *mut T)) {
    let base = v.as_mut_ptr();
    for i in 0..v.len() {
        let next = if i + 1 < v.len() {
            // SAFETY: `i + 1 < len`: inside the slice.
            unsafe { base.add(i + 1) }
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: `i < len`: inside the slice; no other reference is live.
        set(unsafe { &mut *base.add(i) }, next);
    }
}

/// The polling side: this thread.
struct Consumer {
    cq: Cq,
    poller: CqPoller<NoWork>,
    out: VecDeque<cqd::core::Routed<NoWork>>,
    plain: Vec<Plain>,
    map: Map,
    slab: Slab,
    wcs: Vec<ibv_wc>,
    /// Real `ibv_wc`s kept for the conversion measurement.
    captured: Vec<ibv_wc>,
    bad: u64,
}

impl Consumer {
    fn poll_raw(&mut self) -> usize {
        // SAFETY: the CQ is live (held by `self.cq`) and polled by this
        // thread only (cqd's poller, on this thread too, is not polling
        // it now); `wcs` has room for BATCH entries.
        let n =
            unsafe { rdma_sys::ibv_poll_cq(self.cq.as_raw(), BATCH as i32, self.wcs.as_mut_ptr()) };
        assert!(n >= 0, "ibv_poll_cq failed");
        n as usize
    }

    #[inline]
    fn raw(&mut self) -> usize {
        let n = self.poll_raw();
        for wc in &self.wcs[..n] {
            if wc.status != rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
                self.bad += 1;
                continue;
            }
            let h = (wc.wr_id >> 32 & 0xffff) as usize;
            match wc.wr_id & (3 << 62) {
                KIND_RECV => self.plain[h].on_recv(wc.byte_len),
                KIND_SEND | KIND_WRITE => self.plain[h].on_send(wc.wr_id as u32 & 0xffff),
                _ => self.bad += 1,
            }
        }
        if self.captured.len() < 4096 {
            for wc in &self.wcs[..n] {
                // SAFETY: `ibv_wc` is plain C data (rdma-sys derives no
                // Clone for it): a bitwise copy is a valid value.
                self.captured.push(unsafe { std::ptr::read(wc) });
            }
        }
        n
    }

    #[inline]
    fn mapped(&mut self) -> usize {
        let n = self.poll_raw();
        for wc in &self.wcs[..n] {
            let Some(h) = self.map.lock().unwrap().remove(&wc.wr_id) else {
                self.bad += 1;
                continue;
            };
            if wc.status != rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
                self.bad += 1;
                continue;
            }
            match wc.wr_id & (3 << 62) {
                KIND_RECV => self.plain[h as usize].on_recv(wc.byte_len),
                KIND_SEND | KIND_WRITE => self.plain[h as usize].on_send(wc.wr_id as u32 & 0xffff),
                _ => self.bad += 1,
            }
        }
        n
    }

    /// The hand-written loop with the context slab (SPDK's, the kernel's
    /// shape): the wr_id names the slot, the slot holds the request's value.
    #[inline]
    fn with_slab(&mut self) -> usize {
        let n = self.poll_raw();
        for wc in &self.wcs[..n] {
            if wc.status != rdma_sys::ibv_wc_status::IBV_WC_SUCCESS {
                self.bad += 1;
                continue;
            }
            let h = (wc.wr_id >> 32 & 0xffff) as usize;
            let ctx = self.slab[(wc.wr_id as usize) % CTX_SLOTS].load(Ordering::Relaxed);
            match wc.wr_id & (3 << 62) {
                KIND_RECV => self.plain[h].on_recv(wc.byte_len + ctx as u32),
                KIND_SEND | KIND_WRITE => self.plain[h].on_send(ctx as u32),
                _ => self.bad += 1,
            }
        }
        n
    }

    fn drain_once(&mut self, who: Contender) -> usize {
        match who {
            Contender::Raw => self.raw(),
            Contender::Cqd | Contender::CqdCtx => {
                self.poller.poll_once(&mut self.out).expect("poll")
            }
            Contender::Map => self.mapped(),
            Contender::RawCtx => self.with_slab(),
        }
    }

    /// One measurement's polling side: ns per completion in the timed
    /// rounds.
    fn run(&mut self, job: Job, barrier: &Barrier) -> f64 {
        let mut consumed = 0usize;
        let mut timed = Duration::ZERO;
        let mut timed_n = 0usize;
        barrier.wait(); // the first round is on the CQ
        for k in 1..=job.rounds {
            barrier.wait();
            let before = consumed;
            let target = k * ROUND - BATCH;
            let start = Instant::now();
            while consumed < target {
                consumed += self.drain_once(job.who);
            }
            timed += start.elapsed();
            timed_n += consumed - before;
            barrier.wait();
        }
        // The rest, untimed: every request posted is consumed.
        let all = (job.rounds + 1) * ROUND;
        let deadline = Instant::now() + Duration::from_secs(10);
        while consumed < all {
            consumed += self.drain_once(job.who);
            assert!(Instant::now() < deadline, "the CQ did not drain");
        }
        assert_eq!(
            consumed,
            all,
            "{} consumed more than posted",
            job.who.name()
        );
        timed.as_nanos() as f64 / timed_n as f64
    }

    /// ns per `completion_of`, over batches of 32 captured `ibv_wc`s.
    fn conversion(&self, reps: usize) -> f64 {
        let mut out = [Completion::default(); BATCH];
        let n = self.captured.len() / BATCH * BATCH;
        assert!(n > 0, "no ibv_wc captured");
        let start = Instant::now();
        for _ in 0..reps {
            for chunk in black_box(&self.captured[..n]).chunks_exact(BATCH) {
                for (slot, wc) in out.iter_mut().zip(chunk) {
                    *slot = completion_of(wc);
                }
                black_box(&out);
            }
        }
        start.elapsed().as_nanos() as f64 / (reps * n) as f64
    }
}

/// Median, min and max.
fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn pin(cpu: usize) {
    if !core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        eprintln!("verbs_dispatch: could not pin to CPU {cpu}; running unpinned");
    }
}

/// `--profile CONTENDER [write]` (raw, cqd, map, raw-ctx, cqd-ctx): that
/// contender alone, quiet, 20 × 500 rounds, for a profiler such as
/// `perf record`.
fn profile_job() -> Option<(Contender, Stream)> {
    let args: Vec<String> = std::env::args().collect();
    let at = args.iter().position(|a| a == "--profile")?;
    let who = match args.get(at + 1).map(String::as_str) {
        Some("raw") => Contender::Raw,
        Some("cqd") => Contender::Cqd,
        Some("map") => Contender::Map,
        Some("raw-ctx") => Contender::RawCtx,
        Some("cqd-ctx") => Contender::CqdCtx,
        other => panic!("--profile takes raw, cqd, map, raw-ctx or cqd-ctx, not {other:?}"),
    };
    let stream = if args.iter().any(|a| a == "write") {
        Stream::Write
    } else {
        Stream::SendRecv
    };
    Some((who, stream))
}

fn main() {
    run(std::env::args().any(|a| a == "--quick"));
}

/// The whole bench (also called by `examples/bench_report --backend
/// verbs`, which includes this file as a module).
pub fn run(quick: bool) {
    let device = std::env::var_os("SOFTVERBS_RUN").is_some()
        || cqd::verbs::devices().is_ok_and(|d| !d.is_empty());
    if !device {
        println!("SKIPPED: needs softverbs-run (no RDMA device)");
        return;
    }
    let (rounds, reps) = if quick { (10, 1) } else { (200, 9) };
    pin(POLLER_CPU);

    let ctx = Context::open_first().expect("open the device");
    let pd = ctx.alloc_pd().expect("PD");
    let options = CqOptions {
        batch: BATCH,
        ..CqOptions::default()
    };
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("verbs_dispatch", CQ_ENTRIES, CqSpec::default(), options)
        .expect("CQ");
    let cap = |send, recv| QpCap {
        max_send_wr: send,
        max_recv_wr: recv,
        ..QpCap::default()
    };
    let opts = ConnectOptions::default();
    let pairs: Vec<(Arc<Qp>, Arc<Qp>)> = (0..2)
        .map(|_| {
            let a = pd
                .create_qp(&QpInit::new(&cq, &cq, cap(DEPTH, 1)))
                .expect("QP a");
            let b = pd
                .create_qp(&QpInit::new(&cq, &cq, cap(1, DEPTH)))
                .expect("QP b");
            let (ea, eb) = (a.endpoint(&opts, 1).unwrap(), b.endpoint(&opts, 2).unwrap());
            a.connect(&eb, 1, &opts).expect("connect a");
            b.connect(&ea, 2, &opts).expect("connect b");
            (Arc::new(a), Arc::new(b))
        })
        .collect();
    let mr = pd.reg_mr(8192, Access::ALL_RDMA).expect("MR");
    if std::env::args().any(|a| a == "--width") {
        for line in width_axis(&ctx, &pd, &mr, quick) {
            println!("{line}");
        }
        return;
    }
    let regs: Vec<Registration> = (0..HANDLERS)
        .map(|_| handle.register(Count(0)).unwrap())
        .collect();
    let ctx_regs: Vec<ContextRegistration<u64>> = (0..HANDLERS)
        .map(|_| handle.register_with_contexts(CountCtx(0), DEPTH).unwrap())
        .collect();
    let slab: Slab = Arc::new((0..CTX_SLOTS).map(|_| AtomicU64::new(0)).collect());
    let mut poller = unbound.bind();
    poller.apply_commands();
    let map: Map = Arc::new(Mutex::new(HashMap::new()));
    let barrier = Arc::new(Barrier::new(2));

    let (jobs, job_rx): (Sender<Job>, Receiver<Job>) = channel();
    let (post_tx, post_ns) = channel::<f64>();
    let mut poster = Poster {
        pairs: pairs.clone(),
        cur: 0,
        mr: mr.clone(),
        regs: regs.clone(),
        ctx_regs: ctx_regs.clone(),
        map: Arc::clone(&map),
        slab: Arc::clone(&slab),
        barrier: Arc::clone(&barrier),
        seq: 0,
    };
    let posting = std::thread::spawn(move || {
        pin(POSTER_CPU);
        for job in job_rx {
            let ns = poster.run(job);
            if post_tx.send(ns).is_err() {
                break;
            }
        }
    });

    let mut consumer = Consumer {
        cq: cq.clone(),
        poller,
        out: VecDeque::new(),
        plain: (0..HANDLERS).map(|_| Plain::default()).collect(),
        map: Arc::clone(&map),
        slab: Arc::clone(&slab),
        // SAFETY: plain C data; all-zero is a valid value.
        wcs: (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect(),
        captured: Vec::new(),
        bad: 0,
    };
    // [stream][setting][contender] → per-run figures.
    let mut poll: [[[Vec<f64>; 5]; 3]; 2] = Default::default();
    let mut post: [[[Vec<f64>; 5]; 3]; 2] = Default::default();
    let mut conv = Vec::new();
    if let Some((who, stream)) = profile_job() {
        // One contender, quiet, for a profiler: no tables.
        for _ in 0..20 {
            let job = Job {
                who,
                stream,
                setting: Setting::Quiet,
                rounds: 500,
            };
            jobs.send(job).unwrap();
            let ns = consumer.run(job, &barrier);
            let posting = post_ns.recv().unwrap();
            println!(
                "{}: {ns:.2} ns per completion, {posting:.1} ns per request posted",
                who.name()
            );
        }
        drop(jobs);
        posting.join().unwrap();
        return;
    }
    for _ in 0..reps {
        for (t, stream) in STREAMS.into_iter().enumerate() {
            for (s, setting) in SETTINGS.into_iter().enumerate() {
                for (c, who) in CONTENDERS.into_iter().enumerate() {
                    let job = Job {
                        who,
                        stream,
                        setting,
                        rounds,
                    };
                    jobs.send(job).unwrap();
                    poll[t][s][c].push(consumer.run(job, &barrier));
                    post[t][s][c].push(post_ns.recv().unwrap());
                }
            }
        }
        conv.push(consumer.conversion(if quick { 20 } else { 2000 }));
    }
    drop(jobs);
    posting.join().unwrap();
    // The goals' ratios, each the median of the runs' own (before the
    // tables sort the runs' figures).
    let mut lines = Vec::new();
    {
        let ratio = |num: &[f64], den: &[f64]| {
            let mut r: Vec<f64> = num.iter().zip(den).map(|(a, b)| a / b).collect();
            stats(&mut r).0
        };
        let (quiet, other, same) = (0, 1, 2);
        let (raw, cqd, map) = (0, 1, 2);
        for (t, stream) in STREAMS.into_iter().enumerate() {
            let s = stream.short();
            lines.push(format!(
                "ratio same-pair/quiet stream={s} = {:.2}",
                ratio(&poll[t][same][cqd], &poll[t][quiet][cqd])
            ));
            lines.push(format!(
                "ratio mutexmap/cqd setting=other stream={s} = {:.2}",
                ratio(&poll[t][other][map], &poll[t][other][cqd])
            ));
            lines.push(format!(
                "ratio mutexmap/cqd setting=same stream={s} = {:.2}",
                ratio(&poll[t][same][map], &poll[t][same][cqd])
            ));
            lines.push(format!(
                "ratio post/hand-written list={LIST} stream={s} = {:.2}",
                ratio(&post[t][quiet][cqd], &post[t][quiet][raw])
            ));
        }
    }

    println!(
        "verbs dispatch on softverbs: one CQ, two RC QP pairs, {ROUND} completions per round posted in lists of {LIST} over {HANDLERS} handlers, batch {BATCH}; {reps} runs × {rounds} timed rounds per contender, stream and setting; poller pinned to CPU {POLLER_CPU}, poster to CPU {POSTER_CPU}"
    );
    let verdict = |ok: bool| if ok { "met" } else { "not met" };
    for (t, stream) in STREAMS.into_iter().enumerate() {
        println!();
        println!(
            "{}: ns per completion (poller thread, wall time), median [min–max] (× the hand-written loop)",
            stream.name()
        );
        print!("{:<50}", "path");
        for setting in SETTINGS {
            print!(" {:>33}", setting.name());
        }
        println!();
        let mut med = [[0.0; 5]; 3];
        for (s, row) in med.iter_mut().enumerate() {
            for (c, m) in row.iter_mut().enumerate() {
                *m = stats(&mut poll[t][s][c]).0;
            }
        }
        for (c, who) in CONTENDERS.into_iter().enumerate() {
            print!("{:<50}", who.name());
            for s in 0..SETTINGS.len() {
                let (m, lo, hi) = stats(&mut poll[t][s][c]);
                print!(
                    " {:>7.2} [{:>6.2}–{:>6.2}] {:>6.2}x",
                    m,
                    lo,
                    hi,
                    m / med[s][0]
                );
            }
            println!();
        }
        for (s, setting) in SETTINGS.into_iter().enumerate() {
            let vs_hw = med[s][1] / med[s][0];
            let map = med[s][2] / med[s][1];
            // The issue's goals: quiet at most 1.5x, the same pair at most
            // 2x; the other pair has none of its own.
            let goal = match setting {
                Setting::Quiet => format!(" (goal <= 1.5): {:<8}", verdict(vs_hw <= 1.5)),
                Setting::Same => format!(" (goal <= 2.0): {:<8}", verdict(vs_hw <= 2.0)),
                Setting::Other => String::from(" "),
            };
            print!(
                "{:<24} cqd / hand-written = {vs_hw:.2}{goal} mutex map / cqd = {map:.2}",
                setting.name(),
            );
            if setting.concurrent() {
                print!(" (goal >= 5.0): {}", verdict(map >= 5.0));
            }
            println!();
            let vs_ctx = med[s][1] / med[s][3];
            let ctx_vs_ctx = med[s][4] / med[s][3];
            let added = med[s][1] - med[s][0];
            println!(
                "{:<24} cqd / hand-written + contexts = {vs_ctx:.2}, cqd + contexts / hand-written + contexts = {ctx_vs_ctx:.2}{}; cqd adds {added:.1} ns per completion{}",
                "",
                if setting.concurrent() { String::new() } else { format!(" (goal <= 1.2): {}", verdict(vs_ctx <= 1.2 && ctx_vs_ctx <= 1.2)) },
                if setting.concurrent() { String::new() } else { format!(" (goal <= 10): {}", verdict(added <= 10.0)) },
            );
        }
        println!("post side, ns per request (posting thread), median [min–max]:");
        for (c, who) in CONTENDERS.into_iter().enumerate() {
            print!("  {:<48}", who.name());
            for (s, setting) in SETTINGS.into_iter().enumerate() {
                let (m, lo, hi) = stats(&mut post[t][s][c]);
                print!(" {}: {m:.1} [{lo:.1}–{hi:.1}];", setting.name());
            }
            println!();
        }
        let posting: Vec<f64> = (0..SETTINGS.len())
            .map(|s| stats(&mut post[t][s][1]).0 / stats(&mut post[t][s][0]).0)
            .collect();
        println!(
            "posting call, cqd / hand-written = {} (quiet / other pair / same pair; goal <= 1.5): {}",
            posting
                .iter()
                .map(|r| format!("{r:.2}"))
                .collect::<Vec<_>>()
                .join(" / "),
            verdict(posting.iter().all(|&r| r <= 1.5))
        );
    }
    let (cm, clo, chi) = stats(&mut conv);
    println!();
    println!(
        "ibv_wc -> Completion (cqd_verbs::completion_of), batches of {BATCH} real ibv_wc: {cm:.2} [{clo:.2}–{chi:.2}] ns per completion"
    );
    // Every stream and setting, the untimed first round and drain included.
    let per_contender = reps * STREAMS.len() * SETTINGS.len() * (rounds + 1) * ROUND;

    // Every completion reached its handler, every account balanced.
    assert_eq!(consumer.bad, 0, "hand-written or map: bad completions");
    assert!(map.lock().unwrap().is_empty(), "map entries left");
    let snap = handle.snapshot();
    assert_eq!(
        snap.stale_wr_ids + snap.foreign_wr_ids,
        0,
        "cqd: undispatched"
    );
    assert_eq!(
        snap.completions as usize,
        2 * per_contender,
        "cqd (with and without contexts) saw exactly its streams"
    );
    assert!(regs.iter().all(|r| r.ledger().outstanding() == 0));
    assert!(ctx_regs
        .iter()
        .all(|r| r.ledger().outstanding() == 0 && r.empty_hits() == 0));
    assert_eq!(
        cq.budget_snapshot().credits_in_use,
        0,
        "every credit came back"
    );
    assert!(consumer.out.is_empty());
    black_box(consumer.plain.iter().map(|p| p.0).sum::<u64>());
    lines.extend(width_axis(&ctx, &pd, &mr, quick));
    println!();
    for line in lines {
        println!("{line}");
    }
}

/// The widths of the width axis: the number of QP pairs whose completions
/// a batch interleaves.
const WIDTHS: [usize; 4] = [1, 8, 32, 256];
/// Completions per fill on the width axis.
const WFILL: usize = 2048;
/// The width axis's CQ.
const WIDTH_CQ_ENTRIES: u32 = 32_768;

/// One queue of the same-promise contender: the contexts its poster
/// writes at the tail, read by the poller at the head.
struct SpQueue {
    /// The next position the poller expects (receive) or the first not
    /// yet retired (send).
    head: u32,
    /// The next position the poster fills.
    tail: u32,
    ctx: Box<[u64]>,
}

/// The width axis at one width: `width` RC QP pairs (a → b) on the axis's
/// CQ, a plain handler and a context handler per pair, and the
/// same-promise contender's queues (per pair: a's send queue, b's receive
/// queue).
struct WidthRig {
    pairs: Vec<(Qp, Qp)>,
    regs: Vec<Registration>,
    ctx_regs: Vec<ContextRegistration<u64>>,
    sp: Vec<[SpQueue; 2]>,
    mask: u32,
    plain: Vec<Plain>,
    /// Completions the same-promise loop found at no expected position.
    stale: u64,
    /// Credits the same-promise loop holds (requests posted, not yet
    /// completed), given back once per batch.
    credits: u64,
}

/// The width axis's contenders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WidthWho {
    SamePromise,
    Cqd,
    CqdCtx,
}

const WIDTH_WHO: [WidthWho; 3] = [WidthWho::SamePromise, WidthWho::Cqd, WidthWho::CqdCtx];

impl WidthRig {
    fn new(
        pd: &cqd::verbs::Pd,
        cq: &Cq,
        handle: &cqd::core::CqHandle<NoWork>,
        width: usize,
    ) -> Self {
        // Each queue holds one fill's share, and a little more.
        let depth = (WFILL / width + 8) as u32;
        let cap = |send, recv| QpCap {
            max_send_wr: send,
            max_recv_wr: recv,
            ..QpCap::default()
        };
        let opts = ConnectOptions::default();
        let pairs: Vec<(Qp, Qp)> = (0..width)
            .map(|_| {
                let a = pd
                    .create_qp(&QpInit::new(cq, cq, cap(depth, 1)))
                    .expect("QP a");
                let b = pd
                    .create_qp(&QpInit::new(cq, cq, cap(1, depth)))
                    .expect("QP b");
                let (ea, eb) = (a.endpoint(&opts, 1).unwrap(), b.endpoint(&opts, 2).unwrap());
                a.connect(&eb, 1, &opts).expect("connect a");
                b.connect(&ea, 2, &opts).expect("connect b");
                (a, b)
            })
            .collect();
        let slots = (depth as usize).next_power_of_two();
        let queue = || SpQueue {
            head: 0,
            tail: 0,
            ctx: vec![0; slots].into_boxed_slice(),
        };
        WidthRig {
            pairs,
            regs: (0..width)
                .map(|_| handle.register(Count(0)).unwrap())
                .collect(),
            ctx_regs: (0..width)
                .map(|_| handle.register_with_contexts(CountCtx(0), depth).unwrap())
                .collect(),
            sp: (0..width).map(|_| [queue(), queue()]).collect(),
            mask: slots as u32 - 1,
            plain: (0..width).map(|_| Plain::default()).collect(),
            stale: 0,
            credits: 0,
        }
    }

    /// Posts one fill, one request per post call (a list of 1): for
    /// SEND/RECV every pair's receives first, then the SENDs, pair after
    /// pair; for WRITE the WRITEs, pair after pair. Returns the time.
    fn post_fill(&mut self, who: WidthWho, stream: Stream, mr: &Mr) -> Duration {
        let width = self.pairs.len();
        let parts: &[(u64, usize)] = match stream {
            Stream::SendRecv => &[(KIND_RECV, WFILL / 2), (KIND_SEND, WFILL / 2)],
            Stream::Write => &[(KIND_WRITE, WFILL)],
        };
        let start = Instant::now();
        for &(side, n) in parts {
            for i in 0..n {
                let q = i % width;
                let value = i as u64;
                match who {
                    WidthWho::SamePromise => self.post_sp(q, side, value, mr),
                    WidthWho::Cqd | WidthWho::CqdCtx => {
                        self.post_cqd(q, side, value, mr, who == WidthWho::CqdCtx)
                    }
                }
            }
        }
        start.elapsed()
    }

    /// The same-promise post: the context written at the queue's tail,
    /// the wr_id made of (queue, side, position), one `ibv_post_*`.
    #[inline]
    fn post_sp(&mut self, q: usize, side: u64, value: u64, mr: &Mr) {
        let recv = side == KIND_RECV;
        let queue = &mut self.sp[q][usize::from(recv)];
        let p = queue.tail;
        queue.ctx[(p & self.mask) as usize] = value;
        queue.tail = p.wrapping_add(1);
        self.credits += 1;
        let wr_id = (q as u64) << 33 | u64::from(recv) << 32 | u64::from(p);
        let mut sge = ibv_sge {
            addr: mr.addr() + buf(side, 0) as u64,
            length: MSG,
            lkey: mr.lkey(),
        };
        let (a, b) = &self.pairs[q];
        if recv {
            let mut bad = std::ptr::null_mut();
            let mut wr = ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: &mut sge,
                num_sge: 1,
            };
            // SAFETY: the QP is live (held by `self.pairs`); the one request
            // has a null `next`; its SGE names the registered region, which
            // outlives every request.
            let r = unsafe { rdma_sys::ibv_post_recv(b.as_raw(), &mut wr, &mut bad) };
            assert_eq!(r, 0, "ibv_post_recv");
        } else {
            // SAFETY: plain C data; all-zero is a valid value.
            let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
            wr.wr_id = wr_id;
            wr.sg_list = &mut sge;
            wr.num_sge = 1;
            if side == KIND_WRITE {
                wr.opcode = rdma_sys::ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                wr.wr.rdma = rdma_sys::rdma_t {
                    remote_addr: mr.addr() + buf(KIND_RECV, 0) as u64,
                    rkey: mr.rkey(),
                };
            } else {
                wr.opcode = rdma_sys::ibv_wr_opcode::IBV_WR_SEND;
            }
            wr.send_flags = rdma_sys::ibv_send_flags::IBV_SEND_SIGNALED.0;
            let mut bad = std::ptr::null_mut();
            // SAFETY: as for the receive, on a live QP of `self.pairs`.
            let r = unsafe { rdma_sys::ibv_post_send(a.as_raw(), &mut wr, &mut bad) };
            assert_eq!(r, 0, "ibv_post_send");
        }
    }

    /// cqd's post of the same request, through the posting call (with its
    /// context for `ctx`).
    #[inline]
    fn post_cqd(&mut self, q: usize, side: u64, value: u64, mr: &Mr, ctx: bool) {
        let sge = [mr.sge(buf(side, 0), MSG)];
        let (a, b) = &self.pairs[q];
        let tag = value & 0xffff;
        if side == KIND_RECV {
            let mut wr = [RecvWr::new(if ctx { 0 } else { tag }, &sge)];
            if ctx {
                self.ctx_regs[q]
                    .post_recv(b, &mut wr, [value])
                    .map_err(drop)
            } else {
                self.regs[q].post_recv(b, &mut wr).map_err(drop)
            }
            .expect("post_recv");
        } else {
            let op = match side {
                KIND_WRITE => WrOp::Write(mr.remote(buf(KIND_RECV, 0))),
                _ => WrOp::Send,
            };
            let mut wr = [SendWr::new(if ctx { 0 } else { tag }, op, &sge)];
            if ctx {
                self.ctx_regs[q]
                    .post_send(a, &mut wr, [value])
                    .map_err(drop)
            } else {
                self.regs[q].post_send(a, &mut wr).map_err(drop)
            }
            .expect("post_send");
        }
    }

    /// The same-promise poller: one batch. A receive must be at its
    /// queue's head; a send retires every request before it (unsignaled
    /// ones run silently; here every send is signaled); anything else is
    /// counted stale and not delivered. Credits go back once per batch.
    #[inline]
    fn poll_sp(&mut self, cq: &Cq, wcs: &mut [ibv_wc]) -> usize {
        // SAFETY: the CQ is live (held by `cq`) and polled by this thread
        // only (cqd's poller, on this thread too, is not polling it now);
        // `wcs` has room for BATCH entries.
        let n = unsafe { rdma_sys::ibv_poll_cq(cq.as_raw(), BATCH as i32, wcs.as_mut_ptr()) };
        assert!(n >= 0, "ibv_poll_cq failed");
        let n = n as usize;
        let mask = self.mask;
        for wc in &wcs[..n] {
            let q = (wc.wr_id >> 33) as usize;
            let recv = wc.wr_id >> 32 & 1 == 1;
            let p = wc.wr_id as u32;
            let Some(pair) = self.sp.get_mut(q) else {
                self.stale += 1;
                continue;
            };
            let queue = &mut pair[usize::from(recv)];
            if recv {
                if p != queue.head {
                    self.stale += 1;
                    continue;
                }
            } else if p.wrapping_sub(queue.head) >= queue.tail.wrapping_sub(queue.head) {
                self.stale += 1;
                continue;
            }
            queue.head = p.wrapping_add(1);
            let ctx = queue.ctx[(p & mask) as usize];
            let h = &mut self.plain[q];
            match (wc.status == rdma_sys::ibv_wc_status::IBV_WC_SUCCESS, recv) {
                (true, true) => h.on_recv(wc.byte_len + ctx as u32),
                (true, false) => h.on_send(ctx as u32),
                (false, _) => self.stale += 1,
            }
        }
        self.credits -= n as u64;
        n
    }
}

/// The width axis on verbs (see the module documentation): per stream,
/// width and contender, the per-run ns per completion (drain) and per
/// request (post), quiet. Returns the lines `ratio NAME = VALUE`.
fn width_axis(ctx: &Context, pd: &cqd::verbs::Pd, mr: &Mr, quick: bool) -> Vec<String> {
    let (rounds, reps) = if quick { (2, 1) } else { (20, 9) };
    let options = CqOptions {
        batch: BATCH,
        ..CqOptions::default()
    };
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("verbs_width", WIDTH_CQ_ENTRIES, CqSpec::default(), options)
        .expect("the width axis's CQ");
    let mut rigs: Vec<WidthRig> = WIDTHS
        .iter()
        .map(|&w| WidthRig::new(pd, &cq, &handle, w))
        .collect();
    let mut poller = unbound.bind();
    poller.apply_commands();
    let mut out: VecDeque<cqd::core::Routed<NoWork>> = VecDeque::new();
    // SAFETY: plain C data; all-zero is a valid value.
    let mut wcs: Vec<ibv_wc> = (0..BATCH).map(|_| unsafe { std::mem::zeroed() }).collect();
    // [stream][width][contender] → per-run ns per completion / per request.
    let mut poll: [[[Vec<f64>; 3]; 4]; 2] = Default::default();
    let mut post: [[[Vec<f64>; 3]; 4]; 2] = Default::default();
    for _ in 0..reps {
        for (t, stream) in STREAMS.into_iter().enumerate() {
            for (wi, rig) in rigs.iter_mut().enumerate() {
                for (c, who) in WIDTH_WHO.into_iter().enumerate() {
                    let (mut drained, mut posted) = (Duration::ZERO, Duration::ZERO);
                    for _ in 0..rounds {
                        posted += rig.post_fill(who, stream, mr);
                        let deadline = Instant::now() + Duration::from_secs(10);
                        let mut n = 0;
                        let start = Instant::now();
                        while n < WFILL {
                            n += match who {
                                WidthWho::SamePromise => rig.poll_sp(&cq, &mut wcs),
                                _ => poller.poll_once(&mut out).expect("poll"),
                            };
                            if Instant::now() > deadline {
                                panic!("width {}: the fill did not drain", rig.pairs.len());
                            }
                        }
                        drained += start.elapsed();
                        assert_eq!(n, WFILL, "more completions than requests");
                    }
                    let per = |d: Duration| d.as_nanos() as f64 / (rounds * WFILL) as f64;
                    poll[t][wi][c].push(per(drained));
                    post[t][wi][c].push(per(posted));
                }
            }
        }
    }
    println!();
    println!(
        "width axis on softverbs: one CQ, W RC QP pairs, {WFILL} completions per fill posted one request per call, pair after pair, batch {BATCH}, quiet; {reps} runs × {rounds} fills; poller and poster on CPU {POLLER_CPU}"
    );
    let mut lines = Vec::new();
    // The median of the runs' own ratios.
    let ratio = |num: &[f64], den: &[f64]| {
        let mut r: Vec<f64> = num.iter().zip(den).map(|(a, b)| a / b).collect();
        stats(&mut r).0
    };
    for (t, stream) in STREAMS.into_iter().enumerate() {
        let s = stream.short();
        println!(
            "{}: ns per completion | ns per request posted, median [min–max]",
            stream.name()
        );
        println!(
            "{:<8} {:>24} {:>24} {:>24} | {:>20} {:>20} {:>20}",
            "width", "same-promise", "cqd", "cqd+ctx", "same-promise", "cqd", "cqd+ctx"
        );
        for (wi, w) in WIDTHS.iter().enumerate() {
            let cell = |v: &[f64], d: usize| {
                let mut v = v.to_vec();
                let (m, lo, hi) = stats(&mut v);
                format!("{m:.d$} [{lo:.d$}–{hi:.d$}]")
            };
            let p = &poll[t][wi];
            let q = &post[t][wi];
            println!(
                "{w:<8} {:>24} {:>24} {:>24} | {:>20} {:>20} {:>20}",
                cell(&p[0], 2),
                cell(&p[1], 2),
                cell(&p[2], 2),
                cell(&q[0], 1),
                cell(&q[1], 1),
                cell(&q[2], 1)
            );
        }
        for (wi, w) in WIDTHS.iter().enumerate() {
            let p = &poll[t][wi];
            lines.push(format!(
                "ratio cqd/same-promise width={w} stream={s} = {:.2}",
                ratio(&p[1], &p[0])
            ));
            lines.push(format!(
                "ratio cqd+ctx/same-promise width={w} stream={s} = {:.2}",
                ratio(&p[2], &p[0])
            ));
        }
        lines.push(format!(
            "ratio flat width={}/{} stream={s} = {:.2}",
            WIDTHS[3],
            WIDTHS[0],
            ratio(&poll[t][3][1], &poll[t][0][1])
        ));
        lines.push(format!(
            "ratio post/hand-written list=1 stream={s} = {:.2}",
            ratio(&post[t][0][1], &post[t][0][0])
        ));
    }
    // Every request came back once, every account balanced.
    for rig in &rigs {
        assert_eq!(
            (rig.stale, rig.credits),
            (0, 0),
            "same-promise: every completion matched"
        );
        assert!(rig.regs.iter().all(|r| r.ledger().outstanding() == 0));
        assert!(rig
            .ctx_regs
            .iter()
            .all(|r| r.ledger().outstanding() == 0 && r.empty_hits() == 0));
        black_box(rig.plain.iter().map(|p| p.0).sum::<u64>());
    }
    let snap = handle.snapshot();
    assert_eq!(
        snap.stale_wr_ids + snap.foreign_wr_ids + snap.unmatched_wr_ids,
        0
    );
    assert_eq!(
        cq.budget_snapshot().credits_in_use,
        0,
        "every credit came back"
    );
    assert!(out.is_empty());
    // The QPs go first, drained, while their poller is still bound.
    drop(rigs);
    drop(poller);
    lines
}
