//! The counting allocator and the handlers of the allocation tests
//! (`tests/alloc_free.rs` on the simulator, `crates/cqd-verbs/tests/alloc_free.rs`
//! on softverbs), included by both with `#[path]`: each test binary gets its
//! own global allocator.
#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::backtrace::Backtrace;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cqd_core::{
    ContextHandler, ContextRegistration, CqHandle, Failed, Handler, NoWork, Outbox, RecvDone,
    Registration, SendDone, Silent,
};

/// Counts allocations while `COUNTING` is set, whichever thread makes them,
/// and keeps the stacks of the first few (printed when the test fails).
struct Counting;

static COUNTING: AtomicBool = AtomicBool::new(false);
static ALLOCS: AtomicU64 = AtomicU64::new(0);
/// Bookkeeping made once per process or once per thread, not per request,
/// which may fall in the window: parking_lot's hash table and a thread's
/// first park (its thread data), and std's record of a new thread's name,
/// which the thread makes as it starts (a thread spawned before the window,
/// such as the device's event reader, may first run inside it on a loaded
/// machine; a spawn itself allocates on the spawning thread, and is
/// counted). Also the test harness's own bookkeeping on its main thread
/// (its table of running tests, its timeouts), which runs beside the test
/// and may be delayed into the window on a loaded machine: once per test,
/// and not the code under test (a test body run on that thread, inside
/// `counted_window`, is still counted). Counted apart, by the stack.
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
        || stack.contains("thread_info::set_current_info")
        || (stack.contains("test::console::run_tests_console") && !stack.contains("counted_window"))
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
pub struct Count {
    pub done: Arc<AtomicU64>,
    pub errors: Arc<AtomicU64>,
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
    fn on_silent(&mut self, _: &Silent, _: &mut Outbox<'_, NoWork>) {
        self.done.fetch_add(1, Ordering::Release);
    }
}

/// The same with a context per request: a boxed value moved in at the
/// post and out at the completion (the table is made at registration).
pub struct WithCtx {
    pub done: Arc<AtomicU64>,
    pub errors: Arc<AtomicU64>,
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

pub const LIST: usize = 8;
pub const REQUESTS: u64 = 100_000;
pub const WARM_UP: u64 = 10_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    SendRecv,
    Write,
    /// RDMA WRITEs in lists of 8 of which only the last is signaled: its
    /// completion retires the 7 before it (`on_silent`).
    Unsignaled,
    /// SEND/RECV through a context registration.
    Contexts,
    /// SEND/RECV as completion futures, awaited on a tokio runtime.
    Futures,
}

impl std::fmt::Display for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stream::SendRecv => "SEND/RECV",
            Stream::Write => "RDMA WRITE",
            Stream::Unsignaled => "RDMA WRITE, 7 of 8 unsignaled",
            Stream::Contexts => "SEND/RECV with contexts",
            Stream::Futures => "SEND/RECV as completion futures",
        })
    }
}

/// A plain handler and a context handler on one CQ, counting into the same
/// two counters (completions, errors).
pub struct Handlers {
    pub done: Arc<AtomicU64>,
    pub errors: Arc<AtomicU64>,
    pub reg: Registration,
    pub ctx_reg: ContextRegistration<u64>,
}

impl Handlers {
    /// Registers both on `handle` (256 contexts).
    pub fn register(handle: &CqHandle<NoWork>) -> Self {
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
        Handlers {
            done,
            errors,
            reg,
            ctx_reg,
        }
    }
}

/// Runs `body` (100,000 requests of `stream` and their completions, after
/// its warm-up) with the allocator counting; asserts that nothing but
/// once-per-thread or harness bookkeeping (see `ONCE`) allocated, naming the first
/// stacks if something did.
pub fn counted_window(stream: Stream, backend: &str, body: impl FnOnce()) {
    let before = ALLOCS.load(Ordering::Relaxed);
    COUNTING.store(true, Ordering::SeqCst);
    body();
    COUNTING.store(false, Ordering::SeqCst);
    let allocs = ALLOCS.load(Ordering::Relaxed) - before;
    println!(
        "{stream}: {REQUESTS} requests and their completions on {backend}, {allocs} allocations \
         (and {} of once-per-thread or harness bookkeeping)",
        ONCE.swap(0, Ordering::Relaxed)
    );
    assert_eq!(
        allocs,
        0,
        "{stream} on {backend}: {allocs} heap allocations over {REQUESTS} requests in steady state; the first:\n{}",
        STACKS.lock().map(|s| s.join("\n")).unwrap_or_default()
    );
}
