//! Zero heap allocations per request and per completion in steady state, on
//! softverbs (run under softverbs-run; skipped loudly otherwise): the twin of
//! the simulator's `tests/alloc_free.rs` at the workspace root, with the
//! same streams — SEND/RECV, signaled RDMA WRITEs, SEND/RECV with a context
//! per request — 100,000 requests each through the posting call and the
//! CQ's poller (`CqPoller::poll_once`, on the posting thread), counted by a
//! global allocator after a warm-up. The softverbs provider runs in this
//! process, so its allocations count too.
#![allow(missing_docs)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::backtrace::Backtrace;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cqd_core::*;
use cqd_verbs::{Access, ConnectOptions, Context, CqSpec, QpCap, QpInit, RecvWr, SendWr, WrOp};

/// Counts allocations while `COUNTING` is set, whichever thread makes them,
/// and keeps the stacks of the first few (printed when the test fails).
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// parking_lot's bookkeeping, made once per process (its hash table) and
/// once per thread (a thread's first park registers its thread data): the
/// first contention on a lock may fall in the window, but it is not per
/// request. Counted apart, by the stack.
static ONCE: AtomicU64 = AtomicU64::new(0);
static STACKS: Mutex<Vec<String>> = Mutex::new(Vec::new());

thread_local! {
    /// Set while this thread records a stack (which allocates).
    static RECORDING: Cell<bool> = const { Cell::new(false) };
}

fn counted(layout: Layout) {
    if !COUNTING.load(Ordering::Relaxed) || RECORDING.with(Cell::get) {
        return;
    }
    RECORDING.with(|r| r.set(true));
    let stack = format!("{layout:?}\n{}", Backtrace::force_capture());
    if stack.contains("parking_lot_core::parking_lot::ThreadData::new")
        || stack.contains("parking_lot_core::parking_lot::create_hashtable")
    {
        ONCE.fetch_add(1, Ordering::Relaxed);
    } else if ALLOCS.fetch_add(1, Ordering::Relaxed) < 4 {
        if let Ok(mut s) = STACKS.lock() {
            s.push(stack);
        }
    }
    RECORDING.with(|r| r.set(false));
}

// SAFETY: forwards every call to the system allocator unchanged; the
// counter is a side effect only.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        counted(layout);
        // SAFETY: the caller's layout, as GlobalAlloc requires.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        counted(layout);
        // SAFETY: as for `alloc` and `dealloc`.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Counts what reaches it; an error is a failure of the test.
struct Count {
    done: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
}

impl Handler for Count {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.done.fetch_add(1, Ordering::Release);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.done.fetch_add(1, Ordering::Release);
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.errors.fetch_add(1, Ordering::Release);
    }
}

/// The same with a context per request: a boxed value moved in at the
/// post and out at the completion (the table is made at registration).
struct WithCtx {
    done: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
}

impl ContextHandler for WithCtx {
    type Ctx = u64;
    fn on_send(&mut self, _: &SendDone<'_>, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.done.fetch_add(1, Ordering::Release);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.done.fetch_add(1, Ordering::Release);
    }
    fn on_error(&mut self, _: &Failed<'_>, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.errors.fetch_add(1, Ordering::Release);
    }
    fn on_silent(&mut self, _: &Silent, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.done.fetch_add(1, Ordering::Release);
    }
    fn on_abandoned(&mut self, _: u64) {
        self.errors.fetch_add(1, Ordering::Release);
    }
}

const LIST: usize = 8;
const REQUESTS: u64 = 100_000;
const WARM_UP: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stream {
    SendRecv,
    Write,
    /// SEND/RECV through a context registration.
    Contexts,
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stream::SendRecv => "SEND/RECV",
            Stream::Write => "RDMA WRITE",
            Stream::Contexts => "SEND/RECV with contexts",
        })
    }
}

fn launcher_or_skip(test: &str) -> bool {
    if std::env::var_os("SOFTVERBS_RUN").is_some() {
        return true;
    }
    eprintln!("SKIPPED: {test} (needs softverbs-run, root)");
    false
}

#[test]
fn steady_state_posting_and_dispatch_allocate_nothing_on_softverbs() {
    if !launcher_or_skip("steady_state_posting_and_dispatch_allocate_nothing_on_softverbs") {
        return;
    }
    let ctx = Context::open_first().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("alloc", 1024, CqSpec::default(), CqOptions::default())
        .unwrap();
    let cap = QpCap {
        max_send_wr: 128,
        max_recv_wr: 128,
        ..QpCap::default()
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(&opts, 1).unwrap(), b.endpoint(&opts, 2).unwrap());
    a.connect(&eb, 1, &opts).unwrap();
    b.connect(&ea, 2, &opts).unwrap();
    let mr = pd.reg_mr(8192, Access::ALL_RDMA).unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let reg = handle
        .register(Count {
            done: Arc::clone(&done),
            errors: Arc::clone(&errors),
        })
        .unwrap();
    let ctx_reg = handle
        .register_with_contexts(
            WithCtx {
                done: Arc::clone(&done),
                errors: Arc::clone(&errors),
            },
            256,
        )
        .unwrap();
    let mut poller = unbound.bind();
    let mut out = std::collections::VecDeque::new();
    let (src, dst) = ([mr.sge(0, 64)], [mr.sge(4096, 64)]);
    let mut posted = 0u64;
    let mut drain = |posted: u64, poller: &mut CqPoller<NoWork>| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::Acquire) < posted {
            assert!(Instant::now() < deadline, "completions stopped coming");
            poller.poll_once(&mut out).unwrap();
        }
    };
    let mut round = |posted: &mut u64, tag: u32, stream: Stream, poller: &mut CqPoller<NoWork>| {
        match stream {
            Stream::Contexts => {
                let n = *posted;
                let mut rs = [RecvWr::new(0, &dst); LIST / 2];
                ctx_reg
                    .post_recv(&b, &mut rs, std::array::from_fn(|i| n + i as u64))
                    .unwrap();
                let mut ss = [SendWr::new(0, WrOp::Send, &src); LIST / 2];
                ctx_reg
                    .post_send(&a, &mut ss, std::array::from_fn(|i| n + i as u64))
                    .unwrap();
            }
            Stream::Write => {
                let remote = mr.remote(4096);
                let mut wrs = [SendWr::new(u64::from(tag), WrOp::Write(remote), &src); LIST];
                reg.post_send(&a, &mut wrs).unwrap();
            }
            Stream::SendRecv => {
                let mut rs = [RecvWr::new(u64::from(tag), &dst); LIST / 2];
                reg.post_recv(&b, &mut rs).unwrap();
                let mut ss = [SendWr::new(u64::from(tag), WrOp::Send, &src); LIST / 2];
                reg.post_send(&a, &mut ss).unwrap();
            }
        }
        *posted += LIST as u64;
        drain(*posted, poller);
    };
    for stream in [Stream::SendRecv, Stream::Write, Stream::Contexts] {
        let start = posted;
        while posted - start < WARM_UP {
            let tag = (posted % 1000) as u32;
            round(&mut posted, tag, stream, &mut poller);
        }
        let before = ALLOCS.load(Ordering::Relaxed);
        COUNTING.store(true, Ordering::SeqCst);
        let start = posted;
        while posted - start < REQUESTS {
            let tag = (posted % 1000) as u32;
            round(&mut posted, tag, stream, &mut poller);
        }
        COUNTING.store(false, Ordering::SeqCst);
        let allocs = ALLOCS.load(Ordering::Relaxed) - before;
        println!(
            "{stream}: {REQUESTS} requests and their completions on softverbs, {allocs} allocations \
             (and {} of parking_lot's once-per-thread bookkeeping)",
            ONCE.swap(0, Ordering::Relaxed)
        );
        assert_eq!(
            allocs,
            0,
            "{stream}: {allocs} heap allocations over {REQUESTS} requests in steady state; the first:\n{}",
            STACKS.lock().map(|s| s.join("\n")).unwrap_or_default()
        );
    }
    assert_eq!(errors.load(Ordering::Acquire), 0);
    assert_eq!(done.load(Ordering::Acquire), posted);
    assert_eq!(reg.ledger().outstanding(), 0);
    assert_eq!(cq.budget_snapshot().credits_in_use, 0);
}
