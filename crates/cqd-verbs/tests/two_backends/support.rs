//! What every scenario uses: a handler that records each callback, poller
//! threads in a given mode, waiting with a deadline, posting with retry,
//! the skip line for a verbs backend without its device, and the slowdown
//! of every limit when the suite runs in a VM under TCG.

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cqd_core::source::{ArmKind, AsyncEvent, SharedNotifier, SourceError};
use cqd_core::{
    CompletionSource, Failed, Handler, NoSink, NoWork, OpKind, Opcode, Outbox, PollMode,
    PollerBuilder, PollerThread, RecvDone, SendDone, Side, Status, UnboundCq,
};

use crate::backend::Backend;

/// One recorded callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ev {
    pub ok: bool,
    pub side: Side,
    pub kind: OpKind,
    pub tag: u32,
    pub status: Status,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub qp: u32,
    /// The device's opcode (successes only).
    pub opcode: Opcode,
    /// The sender's QP (UD receives).
    pub src_qp: u32,
    /// `IBV_WC_GRH` (UD receives).
    pub grh: bool,
}

/// A handler's record, shared with the test.
#[derive(Clone, Default, Debug)]
pub struct Log(pub Arc<Mutex<Vec<Ev>>>);

impl Log {
    pub fn lock(&self) -> MutexGuard<'_, Vec<Ev>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
    pub fn len(&self) -> usize {
        self.lock().len()
    }
    pub fn snapshot(&self) -> Vec<Ev> {
        self.lock().clone()
    }
    /// The errors, as (side, kind, tag, status), sorted.
    pub fn errors(&self) -> Vec<(Side, OpKind, u32, Status)> {
        let mut v: Vec<_> = self
            .lock()
            .iter()
            .filter(|e| !e.ok)
            .map(|e| (e.side, e.kind, e.tag, e.status))
            .collect();
        v.sort_by_key(|e| (e.0 as u8, e.1.index(), e.2));
        v
    }
    /// (successes, errors, flushes) of `kind`.
    pub fn counts(&self, kind: OpKind) -> (u64, u64, u64) {
        let l = self.lock();
        let of = l.iter().filter(|e| e.kind == kind);
        let ok = of.clone().filter(|e| e.ok).count() as u64;
        let err = of.clone().filter(|e| !e.ok).count() as u64;
        let flush = of.filter(|e| e.status == Status::WrFlush).count() as u64;
        (ok, err, flush)
    }
}

/// Records every callback in its [`Log`].
#[derive(Debug)]
pub struct Recorder(pub Log);

impl Handler for Recorder {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let wc = d.completion();
        self.0.lock().push(Ev {
            ok: true,
            side: Side::Send,
            kind: d.kind(),
            tag: d.tag(),
            status: wc.status,
            byte_len: wc.byte_len,
            imm: wc.imm(),
            qp: wc.qp_num,
            opcode: d.opcode(),
            src_qp: wc.src_qp,
            grh: wc.has_grh(),
        });
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let wc = d.completion();
        self.0.lock().push(Ev {
            ok: true,
            side: Side::Recv,
            kind: OpKind::Recv,
            tag: d.tag(),
            status: wc.status,
            byte_len: d.byte_len(),
            imm: d.imm(),
            qp: wc.qp_num,
            opcode: d.opcode(),
            src_qp: d.src_qp(),
            grh: d.has_grh(),
        });
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.lock().push(Ev {
            ok: false,
            side: f.side(),
            kind: f.kind(),
            tag: f.tag(),
            status: f.status(),
            byte_len: 0,
            imm: None,
            qp: f.qp_num(),
            opcode: f.opcode(),
            src_qp: 0,
            grh: false,
        });
    }
}

/// The mode called `name` (the test's name): each with cqd's defaults.
pub fn mode(name: &str) -> PollMode {
    let all = PollMode::all();
    *all.iter()
        .find(|m| m.name() == name)
        .unwrap_or_else(|| panic!("no poll mode {name}"))
}

/// A poller thread in `mode` over `cqs`.
pub fn poller(name: &str, mode: PollMode, cqs: Vec<UnboundCq<NoWork>>) -> PollerThread {
    poller_with(name, mode, cqs, Duration::from_secs(10))
}

/// As [`poller`], with the stop's drain timeout.
pub fn poller_with(
    name: &str,
    mode: PollMode,
    cqs: Vec<UnboundCq<NoWork>>,
    drain: Duration,
) -> PollerThread {
    let mut b = PollerBuilder::new(name, NoSink)
        .mode(mode)
        .wake_timeout(Duration::from_millis(50))
        .drain_timeout(drain * slow())
        .stop_timeout(secs(5));
    for cq in cqs {
        b = b.cq(cq);
    }
    b.spawn().expect("spawn the poller")
}

/// How much slower than the host this process runs: 1, or
/// `CQD_SUITE_SLOW` (scripts/rxe-vm.sh sets `RXE_VM`, which makes it 8: a
/// margin for a VM under TCG on a shared machine, not a measured ratio;
/// the rxe third's slowest test, `overflow`, takes 2.5 s, most of it its
/// poller's scaled 300 ms drain timeout). Every
/// limit of the suite (waits, hang checks, posting retries, poller
/// drain and stop timeouts) is multiplied by it; what is asserted is not.
pub fn slow() -> u32 {
    static SLOW: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *SLOW.get_or_init(|| {
        let vm = std::env::var_os("RXE_VM").map(|_| 8);
        std::env::var("CQD_SUITE_SLOW")
            .ok()
            .and_then(|v| v.parse().ok())
            .or(vm)
            .unwrap_or(1)
            .max(1)
    })
}

/// `n` seconds, times [`slow`].
pub fn secs(n: u64) -> Duration {
    Duration::from_secs(n) * slow()
}

/// Waits until `cond` holds; false if `limit` (times [`slow`]) passed
/// first.
pub fn wait_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit * slow();
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Runs `post` until it succeeds, again while the backend says the queue
/// is full (the poller frees slots as it polls); any other error, or 20 s
/// (times [`slow`]) of refusals, fails the test.
pub fn retry<B: Backend>(mut post: impl FnMut() -> Result<(), B::PostErr>) {
    let deadline = Instant::now() + secs(20);
    loop {
        match post() {
            Ok(()) => return,
            Err(e) if B::retryable(&e) && Instant::now() < deadline => {
                std::thread::yield_now();
            }
            Err(e) => panic!("{}: post failed: {e}", B::NAME),
        }
    }
}

/// Writes `line` to fd 2, unbuffered, past the test harness's capture.
pub fn say(line: &str) {
    // SAFETY: writes a live buffer of `line.len()` bytes to fd 2.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// Whether backend `name`'s device is here: softverbs (`verbs`) only under
/// softverbs-run, rxe only where `CQD_RXE` names an rxe device
/// (scripts/rxe-vm.sh); elsewhere it says so on fd 2 and the test passes,
/// except under nextest, whose configuration runs the verbs cells under the
/// launcher and leaves out those it cannot run (.config/nextest.toml): a
/// cell that gets here under nextest would pass without testing, so it
/// fails. The simulator is always here.
pub fn device_or_skip(name: &str, test: &str) -> bool {
    let (why, set) = match name {
        "verbs" if std::env::var_os("SOFTVERBS_RUN").is_none() => {
            ("needs softverbs-run, root", "softverbs")
        }
        "rxe" if crate::backend::RxeDevice::name().is_none() => (
            "needs rxe: CQD_RXE naming an rxe device, as in scripts/rxe-vm.sh",
            "rxe",
        ),
        _ => return true,
    };
    assert!(
        std::env::var_os("NEXTEST").is_none(),
        "{test} {why}, but nextest ran it without: .config/nextest.toml must count it \
         in the {set} set"
    );
    say(&format!("SKIPPED: {test} ({why})\n"));
    false
}

/// Runs `f` on its own thread and fails if it does not finish within
/// `limit` times [`slow`] (a hang is a failure, not a stuck test run).
pub fn within<T: Send + 'static>(
    what: &str,
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let t = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    let limit = limit * slow();
    match rx.recv_timeout(limit) {
        Ok(v) => {
            t.join().expect("join");
            v
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {limit:?}: it hangs")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match t.join() {
            Err(p) => std::panic::resume_unwind(p),
            Ok(()) => unreachable!("the thread sent nothing and did not panic"),
        },
    }
}

/// A source with a side door: the poller owns it through `split` (so the
/// CQ's handle, ledger and registrations are the real ones), while the
/// test keeps [`Spy::side`] to call the source's contract directly (arm,
/// take, ack, destroy) without the poller acknowledging first.
pub struct Spy<S> {
    inner: Arc<Mutex<S>>,
    name: String,
    fd: RawFd,
    async_fd: Option<RawFd>,
}

impl<S: CompletionSource> Spy<S> {
    pub fn new(source: S) -> Self {
        let name = source.name().to_string();
        let fd = source.event_fd().as_raw_fd();
        let async_fd = source.async_fd().map(|f| f.as_raw_fd());
        Spy {
            inner: Arc::new(Mutex::new(source)),
            name,
            fd,
            async_fd,
        }
    }

    pub fn side(&self) -> Arc<Mutex<S>> {
        Arc::clone(&self.inner)
    }

    fn lock(&self) -> MutexGuard<'_, S> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl<S: CompletionSource> CompletionSource for Spy<S> {
    fn name(&self) -> &str {
        &self.name
    }
    fn capacity(&self) -> u32 {
        self.lock().capacity()
    }
    fn poll(&mut self, out: &mut [cqd_core::Completion]) -> Result<usize, SourceError> {
        self.lock().poll(out)
    }
    fn arm(&mut self, kind: ArmKind) -> Result<(), SourceError> {
        self.lock().arm(kind)
    }
    fn event_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the descriptor belongs to the inner source, which lives
        // as long as `self` (it is in `self.inner`) and never changes its
        // descriptor.
        unsafe { BorrowedFd::borrow_raw(self.fd) }
    }
    fn take_events(&mut self) -> Result<u32, SourceError> {
        self.lock().take_events()
    }
    fn ack_events(&mut self, n: u32) -> Result<(), SourceError> {
        self.lock().ack_events(n)
    }
    fn unacked_events(&self) -> u32 {
        self.lock().unacked_events()
    }
    fn async_fd(&self) -> Option<BorrowedFd<'_>> {
        // SAFETY: as in `event_fd`.
        self.async_fd
            .map(|fd| unsafe { BorrowedFd::borrow_raw(fd) })
    }
    fn notifier(&self) -> Option<(Arc<dyn SharedNotifier>, u64)> {
        self.lock().notifier()
    }
    fn ledger(&self) -> Option<cqd_core::ledger::WrLedger> {
        self.lock().ledger()
    }
    fn take_async_event(&mut self) -> Option<AsyncEvent> {
        self.lock().take_async_event()
    }
    fn destroy(&mut self) -> Result<(), SourceError> {
        self.lock().destroy()
    }
}

/// Waits up to `limit` for `fd` to become readable.
pub fn readable(fd: BorrowedFd<'_>, limit: Duration) -> bool {
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd; the descriptor is open while `fd` borrows
    // it.
    let r = unsafe { libc::poll(&mut p, 1, limit.as_millis() as i32) };
    r == 1
}
