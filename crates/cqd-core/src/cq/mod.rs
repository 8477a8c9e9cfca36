//! A completion queue split into its two rights: the right to poll, arm and
//! acknowledge it, and [`CqHandle`], the cloneable right to register handlers
//! and read metrics.
//!
//! The polling right comes in two states, so that "exactly one poller
//! thread" is a fact of the types, not a habit:
//!
//! 1. [`split`] returns an [`UnboundCq`]: `Send` (it can be moved to the
//!    thread that will poll), but neither `Sync` nor `Clone`, and it has no
//!    method that polls, arms or acknowledges.
//! 2. [`UnboundCq::bind`], called on the polling thread, consumes it and
//!    returns the [`CqPoller`]: neither `Send` nor `Sync`, so it never leaves
//!    that thread, cannot be shared, and cannot be put behind an
//!    `Arc<Mutex<…>>` for two threads to poll in turn. A poller thread binds
//!    its own CQs ([`PollerBuilder::cq`](crate::poller::PollerBuilder::cq)
//!    takes the `UnboundCq`); a custom loop binds on its own thread.
//! 3. Dropping either finishes the CQ: registration closes, every event is
//!    acknowledged and the CQ is destroyed (a failure is traced at error
//!    level, never ignored silently).
//!
//! An `UnboundCq` cannot be polled:
//!
//! ```compile_fail,E0599
//! # use cqd_core::cq::UnboundCq;
//! # use cqd_core::sink::NoWork;
//! fn poll(mut p: UnboundCq<NoWork>) {
//!     let mut out = std::collections::VecDeque::new();
//!     let _ = p.poll_once(&mut out); // bind it first
//! }
//! ```
//!
//! nor cloned, nor shared by reference across threads:
//!
//! ```compile_fail,E0277
//! # use cqd_core::cq::UnboundCq;
//! # use cqd_core::sink::NoWork;
//! fn assert_clone<T: Clone>() {}
//! assert_clone::<UnboundCq<NoWork>>();
//! ```
//!
//! ```compile_fail,E0277
//! # use cqd_core::cq::UnboundCq;
//! # use cqd_core::sink::NoWork;
//! fn share(p: &UnboundCq<NoWork>) {
//!     std::thread::scope(|s| { s.spawn(|| p.name().len()); });
//! }
//! ```
//!
//! A bound `CqPoller` cannot move to another thread:
//!
//! ```compile_fail,E0277
//! # use cqd_core::cq::CqPoller;
//! # use cqd_core::sink::NoWork;
//! fn assert_send<T: Send>() {}
//! assert_send::<CqPoller<NoWork>>();
//! ```
//!
//! nor be polled by two threads in turn behind a lock:
//!
//! ```compile_fail,E0277
//! # use std::sync::{Arc, Mutex};
//! # use cqd_core::cq::CqPoller;
//! # use cqd_core::sink::NoWork;
//! fn two_pollers(p: CqPoller<NoWork>) {
//!     let shared = Arc::new(Mutex::new(p));
//!     let other = Arc::clone(&shared);
//!     std::thread::spawn(move || {
//!         let mut out = std::collections::VecDeque::new();
//!         let _ = other.lock().unwrap().poll_once(&mut out);
//!     });
//! }
//! ```
//!
//! nor be given back unbound, so that a lock could relay the polling right
//! from thread to thread (there is no way back from bound to unbound):
//!
//! ```compile_fail,E0599
//! # use std::sync::{Arc, Mutex};
//! # use cqd_core::cq::{CqPoller, UnboundCq};
//! # use cqd_core::sink::NoWork;
//! fn relay(slot: Arc<Mutex<Option<UnboundCq<NoWork>>>>) {
//!     let mut guard = slot.lock().unwrap();
//!     let mut p: CqPoller<NoWork> = guard.take().unwrap().bind();
//!     let mut out = std::collections::VecDeque::new();
//!     let _ = p.poll_once(&mut out);
//!     *guard = Some(p.unbind()); // the next thread to lock polls next
//! }
//! ```
//!
//! nor be cloned:
//!
//! ```compile_fail,E0599
//! # use cqd_core::cq::CqPoller;
//! # use cqd_core::sink::NoWork;
//! fn cloned(p: CqPoller<NoWork>) { let _q = p.clone(); }
//! ```
//!
//! and an `UnboundCq` moved into a poller thread is gone:
//!
//! ```compile_fail,E0382
//! # use cqd_core::cq::UnboundCq;
//! # use cqd_core::poller::PollerBuilder;
//! # use cqd_core::sink::{NoSink, NoWork};
//! fn moved(p: UnboundCq<NoWork>) {
//!     let _t = PollerBuilder::new("p", NoSink).cq(p).spawn();
//!     let _ = p.bind(); // use of moved value
//! }
//! ```

use std::cell::Cell;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use crossbeam::queue::SegQueue;

use crate::budget::CqBudget;
use crate::completion::Completion;
use crate::ledger::AccountCache;
use crate::ledger::WrLedger;
use crate::metrics::{batch_bucket, bump, CqMetrics};
use crate::sink::Routed;
use crate::slab::{Entry, Slab, SlotTable};
use crate::source::{ArmKind, AsyncEvent, CompletionSource, SourceError};
use crate::sync::{AtomicBool, Ordering};

use crate::wr_id::HandlerKey;

/// Options of one CQ.
#[derive(Debug, Clone)]
pub struct CqOptions {
    /// Completions polled at once (default 32).
    pub batch: usize,
    /// Arm for solicited completions only (receive CQs of request/response
    /// protocols); errors still notify.
    pub arm: ArmKind,
    /// Trace every completion's wr_id and status at `TRACE` level. Costs one
    /// predictable branch when off.
    pub trace_completions: bool,
    /// Measure time spent in handlers (two clock reads per batch).
    pub measure_handlers: bool,
    /// Completions a poller takes from this CQ per round at most (default
    /// [`DEFAULT_ROUND_BUDGET`], as the kernel's `ib_cq` polls in interrupt
    /// context): it polls the CQ again while it returns full batches, up to
    /// this budget, before moving to the next CQ. Every CQ is still visited
    /// every round; a busy CQ is no longer served one batch per sweep.
    pub round_budget: usize,
    /// A receive queue holding this many posted receives or fewer after a
    /// batch consumed from it (and its handlers reposted) is dry: counted
    /// (`CqSnapshot::recv_queues_dry`) and warned about; one still dry
    /// [`DRY_GRACE`] later is named in the snapshot (`left_dry`) and in the
    /// stop's findings. Default 0: a queue with nothing posted, whose
    /// peer's next SEND meets RNR.
    pub recv_low_water: u32,
    /// A batch whose handler calls take longer than this is slow (default
    /// 1 ms; `None`: not measured). One batch in 8 on average, at random
    /// intervals, is timed (two clock reads; every batch with
    /// `measure_handlers`), and a poller thread's round that took longer
    /// has the next batch timed;
    /// after a slow one the next completions are timed one by one, and a
    /// handler call over the threshold during which the thread blocked (it
    /// gave up its CPU: a sleep, a lock, I/O — not a preemption) is
    /// counted, warned about and named in the stop's findings: a handler
    /// that blocks holds up every CQ of its poller.
    pub slow_batch: Option<std::time::Duration>,
}

/// Completions timed one by one after a slow batch.
pub(crate) const SLOW_PROBE: u32 = 64;
/// One batch in this many, on average, is timed for the slow check: the
/// next timed batch comes 1 to `2 * SLOW_SAMPLE - 1` batches later, drawn
/// at random, so that no periodic pattern of batches (one of receives,
/// then one of the replies' sends, and again) keeps the check on one kind
/// of batch, as a fixed stride of 8 against a period of 2 did.
pub(crate) const SLOW_SAMPLE: u32 = 8;

/// The default [`CqOptions::round_budget`].
pub const DEFAULT_ROUND_BUDGET: usize = 256;

impl Default for CqOptions {
    fn default() -> Self {
        CqOptions {
            batch: 32,
            arm: ArmKind::Next,
            trace_completions: false,
            measure_handlers: false,
            round_budget: DEFAULT_ROUND_BUDGET,
            recv_low_water: 0,
            slow_batch: Some(std::time::Duration::from_millis(1)),
        }
    }
}

pub(crate) enum Command<W> {
    Register {
        key: HandlerKey,
        entry: Box<Entry<W>>,
    },
    Unregister {
        key: HandlerKey,
    },
    /// A poster took back counts (a post that failed): a retiring handler
    /// may now be drained, with no completion coming to say so.
    Recheck {
        key: HandlerKey,
    },
}

/// What the two halves of a CQ share.
pub(crate) struct CqShared<W> {
    pub(crate) name: String,
    /// Its resize requests and its capacity (`resize`).
    pub(crate) resizes: resize::Resizes,
    pub(crate) commands: SegQueue<Command<W>>,
    /// Set by the first command pushed after the poller last began to
    /// apply them; only that push rings the doorbell (the registration
    /// doorbell protocol in `handle`).
    pub(crate) commands_rung: AtomicBool,
    /// From the sync shim, so that the loom model of registration and
    /// retirement (`tests/loom_register.rs`) sees who holds it.
    pub(crate) table: crate::sync::Mutex<SlotTable>,
    pub(crate) metrics: CqMetrics,
    /// The doorbell of the poller the CQ is bound to, once bound: one per
    /// poller, shared by every CQ of its group (see [`CqShared::ring`]).
    pub(crate) doorbell: crate::sync::Mutex<Option<(Arc<GroupBell>, usize)>>,
    pub(crate) closed: AtomicBool,
    /// The CQ's budget, once attached (its counters join the snapshot;
    /// overflow events are recorded in it).
    pub(crate) budget: Arc<OnceLock<CqBudget>>,
    /// The CQ's ledger of queue accounts, once attached: the poller
    /// retires their entries and returns their credits as it polls.
    /// Shared with registrations, which post only to its queues.
    pub(crate) ledger: Arc<OnceLock<WrLedger>>,
    /// The signals of handlers being retired ([`CqHandle::unregister`]),
    /// fired when the poller drops them, or when it finishes.
    pub(crate) retiring: parking_lot::Mutex<Vec<(HandlerKey, Arc<crate::ledger::CloseSignal>)>>,
}

impl<W> CqShared<W> {
    /// Fires the retirement signals of `key`, or every one (`None`: the
    /// poller finished).
    pub(crate) fn retired(&self, key: Option<HandlerKey>) {
        let fired: Vec<_> = {
            let mut r = self.retiring.lock();
            let (fired, keep) = std::mem::take(&mut *r)
                .into_iter()
                .partition(|(k, _)| key.is_none_or(|key| *k == key));
            *r = keep;
            fired
        };
        for (_, s) in fired {
            s.fire();
        }
    }
    /// The slot table, locked. A panic under the lock cannot leave it half
    /// changed (each change is one call that either happens or not), so a
    /// poisoned lock is taken as it is.
    pub(crate) fn table(&self) -> crate::sync::MutexGuard<'_, SlotTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Rings the doorbell of the poller the CQ is bound to, after a command
    /// was queued (registration, unregistration). The hand-over, in order:
    ///
    /// 1. A handle queues its command, then locks the slot and rings the
    ///    doorbell in it, if any.
    /// 2. A poller binding the CQ locks the slot and installs its doorbell,
    ///    then applies every queued command
    ///    ([`CqPoller::install_doorbell`]).
    ///
    /// The slot's lock orders the two: either the handle's lock comes
    /// second and it rings the installed bell, or it comes first, its
    /// command was queued before, and step 2 applies it.
    pub(crate) fn ring(&self) {
        let slot = self.doorbell.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((bell, index)) = &*slot {
            bell.note(*index);
        }
    }
}

/// Makes the two halves of a CQ from a backend's source: the
/// [`UnboundCq`] (to be bound on the thread that polls it) and the
/// [`CqHandle`], with the source's ledger and budget attached
/// ([`CompletionSource::ledger`]).
///
/// # Errors
/// None today (kept for backends' and future set-up failures); a CQ
/// makes no descriptor of its own (its poller's doorbell serves it).
pub fn split<W: Send + 'static>(
    source: impl CompletionSource,
    options: CqOptions,
) -> Result<(UnboundCq<W>, CqHandle<W>), SourceError> {
    let batch = options.batch.clamp(1, 4096);
    let shared = Arc::new(CqShared {
        name: source.name().to_string(),
        resizes: resize::Resizes::new(source.capacity()),
        commands: SegQueue::new(),
        commands_rung: AtomicBool::new(false),
        table: crate::sync::Mutex::new(SlotTable::default()),
        metrics: CqMetrics::default(),
        doorbell: crate::sync::Mutex::new(None),
        closed: AtomicBool::new(false),
        budget: Arc::default(),
        ledger: Arc::default(),
        retiring: parking_lot::Mutex::new(Vec::new()),
    });
    // The source's ledger and budget, attached before anything can post.
    if let Some(ledger) = source.ledger() {
        if let Some(b) = ledger.budget() {
            let _ = shared.budget.set(b.clone());
        }
        let _ = shared.ledger.set(ledger);
    }
    let core = Core {
        source: Box::new(source),
        shared: Arc::clone(&shared),
        slab: Slab::default(),
        account_cache: AccountCache::new(batch),
        probe: 0,
        sampler: Sampler::default(),
        buf: vec![Completion::default(); batch],
        options,
        finished: false,
        in_error: false,
        overflows: 0,
        last_wqe: Vec::new(),
        doorbell: None,
    };
    Ok((
        UnboundCq {
            core,
            _not_sync: PhantomData,
        },
        CqHandle { shared },
    ))
}

/// What both states of the polling right own. Dropping it finishes the CQ
/// (step 3 of the module documentation).
struct Core<W> {
    source: Box<dyn CompletionSource>,
    shared: Arc<CqShared<W>>,
    slab: Slab<W>,
    /// Queue accounts by (qp_num, side), poller-local.
    account_cache: AccountCache,
    buf: Vec<Completion>,
    options: CqOptions,
    /// Set once the CQ was acknowledged and destroyed.
    finished: bool,
    /// Set once the CQ was found in the error state (overflow).
    in_error: bool,
    /// Overflows reported (the metric's value: this poller is its only
    /// writer).
    overflows: u64,
    /// QPs of an SRQ whose `LAST_WQE_REACHED` (or, on a device that keeps
    /// a destroyed QP's completions, whose destroy) this poller took (step
    /// 2 or 2' of `ledger::teardown`), to quiesce after the next short
    /// poll.
    last_wqe: Vec<u32>,
    /// The doorbell installed for this CQ (the poller's), for its fd.
    doorbell: Option<Arc<GroupBell>>,
    /// Completions still to be timed one by one after a slow batch, to
    /// name the slow handler ([`CqOptions::slow_batch`]).
    probe: u32,
    /// Which batches the slow check times.
    sampler: Sampler,
}

/// Chooses the batches the slow check times: one in [`SLOW_SAMPLE`] on
/// average, at jittered intervals (see there). Two clock reads per timed
/// batch then cost a few nanoseconds per batch.
struct Sampler {
    /// Batches left before the next timed one.
    until: u32,
    /// xorshift32 state (never 0).
    rng: u32,
}

impl Default for Sampler {
    fn default() -> Self {
        Sampler {
            until: SLOW_SAMPLE,
            rng: 0x9e37_79b9,
        }
    }
}

impl Sampler {
    /// True when the next batch is to be timed.
    #[inline]
    fn take(&mut self) -> bool {
        self.until -= 1;
        if self.until > 0 {
            return false;
        }
        self.next_interval();
        true
    }

    #[cold]
    fn next_interval(&mut self) {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.rng = x;
        self.until = 1 + x % (2 * SLOW_SAMPLE - 1);
    }
}

impl<W> Core<W> {
    /// Closes registration, acknowledges every event and destroys the CQ,
    /// once.
    fn finish(&mut self) -> Result<(), SourceError> {
        self.shared.closed.store(true, Ordering::Release);
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        // No handler is retired any more: whoever waits for one learns it
        // now (the stop's report says what it left).
        self.shared.retired(None);
        // Nor is any send request: a poster waiting for room learns it.
        if let Some(l) = self.shared.ledger.get() {
            l.room_bell().end();
        }
        // Nor any resize (`resize`, step 3).
        self.shared.resizes.end(&self.shared.name);
        let taken = self.source.take_events();
        if let Ok(n) = taken {
            bump(&self.shared.metrics.0.events, u64::from(n));
        }
        let n = self.source.unacked_events();
        if n > 0 {
            self.source.ack_events(n)?;
            bump(&self.shared.metrics.0.acks, u64::from(n));
        }
        taken?;
        self.source.destroy()
    }
}

impl<W> Drop for Core<W> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let handlers = self.slab.iter().count();
        match self.finish() {
            Ok(()) => tracing::debug!(cq = %self.shared.name, handlers,
                "CQ dropped without a stop: registration closed, events acked, CQ destroyed"),
            Err(e) => tracing::error!(cq = %self.shared.name, handlers, error = %e,
                "CQ dropped: acknowledging or destroying it failed"),
        }
    }
}

/// The right to poll one CQ, not yet bound to a thread: `Send` (move it to
/// the thread that will poll), neither `Sync` nor `Clone`, and unable to
/// poll, arm or acknowledge until [`bind`](Self::bind) makes it a
/// [`CqPoller`] there. Dropping it finishes the CQ.
pub struct UnboundCq<W> {
    core: Core<W>,
    _not_sync: PhantomData<Cell<()>>,
}

impl<W> std::fmt::Debug for UnboundCq<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UnboundCq")
            .field("name", &self.core.shared.name)
            .field("capacity", &self.core.shared.resizes.capacity())
            .finish()
    }
}

impl<W: Send + 'static> UnboundCq<W> {
    /// The CQ's name.
    pub fn name(&self) -> &str {
        &self.core.shared.name
    }

    /// A handle to the same CQ.
    pub fn handle(&self) -> CqHandle<W> {
        CqHandle {
            shared: Arc::clone(&self.core.shared),
        }
    }

    pub(crate) fn source(&self) -> &dyn CompletionSource {
        &*self.core.source
    }

    /// Binds the CQ to the calling thread: the returned [`CqPoller`] can
    /// poll, arm and acknowledge it, and can never leave this thread.
    pub fn bind(self) -> CqPoller<W> {
        CqPoller {
            core: self.core,
            _not_send: PhantomData,
        }
    }
}

/// The only right to poll, arm and acknowledge one CQ, bound to the thread
/// that called [`UnboundCq::bind`]: neither `Send` nor `Sync`, not `Clone`
/// (see the module documentation). Dropping it finishes the CQ.
pub struct CqPoller<W> {
    core: Core<W>,
    /// `*const ()` is neither `Send` nor `Sync`.
    _not_send: PhantomData<*const ()>,
}

impl<W> std::fmt::Debug for CqPoller<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqPoller")
            .field("name", &self.core.shared.name)
            .field("capacity", &self.core.shared.resizes.capacity())
            .field("slab", &self.core.slab)
            .finish()
    }
}

impl<W: Send + 'static> CqPoller<W> {
    /// The CQ's name.
    pub fn name(&self) -> &str {
        &self.core.shared.name
    }

    /// A handle to the same CQ.
    pub fn handle(&self) -> CqHandle<W> {
        CqHandle {
            shared: Arc::clone(&self.core.shared),
        }
    }

    /// Polls one batch and dispatches it; work emitted by handlers is
    /// appended to `out`. Returns the number of completions polled (0 means
    /// the CQ was empty). For custom poll loops; a poller thread calls this.
    ///
    /// # Errors
    /// When the source fails (device gone); nothing polled is lost.
    pub fn poll_once(&mut self, out: &mut VecDeque<Routed<W>>) -> Result<usize, SourceError> {
        // The registration doorbell protocol (step 3, in `handle`): every
        // poll looks at the flag, so a ring consumed without a poll cannot
        // strand a command.
        if self.core.shared.commands_rung.load(Ordering::Acquire) {
            self.apply_commands();
        }
        let m = &self.core.shared.metrics.0;
        bump(&m.polls, 1);
        // SRQ users whose last WQE was taken before this poll began
        // (`ledger::teardown`, step 3).
        let quiescing = self.core.last_wqe.len();
        let n = match self.core.source.poll(&mut self.core.buf) {
            Ok(n) => n.min(self.core.buf.len()),
            Err(e) => {
                bump(&m.poll_errors, 1);
                return Err(e);
            }
        };
        if n == 0 {
            bump(&m.empty_polls, 1);
            if quiescing > 0 {
                self.quiesce(quiescing);
            }
            return Ok(0);
        }
        bump(&m.completions, n as u64);
        bump(&m.batch_hist[batch_bucket(n)], 1);
        // One batch in SLOW_SAMPLE, at random intervals, is timed for the
        // slow check (every one when handler time is measured): two clock
        // reads per batch cost about a nanosecond per completion on the
        // verbs path.
        let o = &self.core.options;
        let sample = o.measure_handlers || (o.slow_batch.is_some() && self.core.sampler.take());
        let start = sample.then(Instant::now);
        dispatch_batch(
            &self.core.shared,
            &mut self.core.slab,
            &mut self.core.account_cache,
            &self.core.options,
            &self.core.buf[..n],
            out,
            &mut self.core.probe,
        );
        if let Some(start) = start {
            let took = start.elapsed();
            if self.core.options.measure_handlers {
                bump(
                    &self.core.shared.metrics.0.handler_ns,
                    took.as_nanos() as u64,
                );
            }
            if self.core.options.slow_batch.is_some_and(|t| took > t) {
                self.slow_batch(took);
            }
        }
        if quiescing > 0 && n < self.core.buf.len() {
            self.quiesce(quiescing);
        }
        Ok(n)
    }

    /// The stop's hand-back of SRQ receives: each receive still posted on
    /// an SRQ whose completions come here, once no QP can take it any more
    /// ([`WrLedger::unused_srq_receives`]), is dispatched as a flush, as if
    /// the device had flushed it. Its account retires it, its handler's
    /// `on_error` sees a flush (a context comes back with it), and the
    /// handler's ledger counts it completed and flushed, so the stop
    /// balances; the CQ counts it in `srq_returned`. Returns how many.
    pub fn return_srq_receives(&mut self, out: &mut VecDeque<Routed<W>>) -> usize {
        let Some(l) = self.core.shared.ledger.get() else {
            return 0;
        };
        let unused = l.unused_srq_receives();
        if unused.is_empty() {
            return 0;
        }
        for chunk in unused.chunks(self.core.buf.len().max(1)) {
            for (wc, &(qp_num, wr_id)) in self.core.buf.iter_mut().zip(chunk) {
                *wc = Completion::error(wr_id, crate::completion::Status::WrFlush, qp_num);
                wc.opcode = crate::completion::Opcode::Recv;
            }
            dispatch_batch(
                &self.core.shared,
                &mut self.core.slab,
                &mut self.core.account_cache,
                &self.core.options,
                &self.core.buf[..chunk.len()],
                out,
                &mut self.core.probe,
            );
        }
        bump(
            &self.core.shared.metrics.0.srq_returned,
            unused.len() as u64,
        );
        tracing::info!(cq = %self.core.shared.name, returned = unused.len(),
            "stop: receives still posted on an SRQ handed back as flushes");
        unused.len()
    }

    /// True while an SRQ user waits for a short poll of this CQ (step 3 of
    /// `ledger::teardown`): the poller polls the CQ before it sleeps.
    #[inline]
    pub(crate) fn quiescing(&self) -> bool {
        !self.core.last_wqe.is_empty()
    }

    /// Step 3 of `ledger::teardown` for the first `count` SRQ users of
    /// `last_wqe`: the poll that just ended began after their events,
    /// found the CQ empty, and its batch is accounted.
    #[cold]
    #[inline(never)]
    fn quiesce(&mut self, count: usize) {
        let done: Vec<u32> = self.core.last_wqe.drain(..count).collect();
        if let Some(l) = self.core.shared.ledger.get() {
            l.quiesce(&done);
        }
    }

    /// Out of line: a batch whose handlers took longer than
    /// [`CqOptions::slow_batch`]; the next completions are timed one by
    /// one to find the handler.
    #[cold]
    #[inline(never)]
    fn slow_batch(&mut self, took: std::time::Duration) {
        bump(&self.core.shared.metrics.0.slow_batches, 1);
        if self.core.probe == 0 {
            tracing::debug!(cq = %self.core.shared.name, ?took,
                "slow batch: timing the next completions one by one to find the handler");
        }
        self.core.probe = SLOW_PROBE;
    }

    /// Requests a notification of the CQ's arm kind (see [`CqOptions::arm`]).
    ///
    /// # Errors
    /// When the source fails. [`SourceError::CqInError`] once the CQ is in
    /// the error state ([`is_in_error`](Self::is_in_error)): it will never
    /// notify again, and later calls return that error at once, without
    /// asking the device.
    pub fn arm(&mut self) -> Result<(), SourceError> {
        if self.core.in_error {
            return Err(SourceError::CqInError);
        }
        let m = &self.core.shared.metrics.0;
        bump(&m.arms, 1);
        match self.core.source.arm(self.core.options.arm) {
            Ok(()) => Ok(()),
            Err(SourceError::CqInError) => {
                bump(&m.arm_errors, 1);
                self.enter_error("the device refused to arm it");
                Err(SourceError::CqInError)
            }
            Err(e) => {
                bump(&m.arm_errors, 1);
                Err(e)
            }
        }
    }

    /// True once the CQ is in the error state (an overflow): it is no
    /// longer armed; what it still holds can be polled.
    pub fn is_in_error(&self) -> bool {
        self.core.in_error
    }

    /// Marks the CQ in error, once: a metric and one error-level trace.
    #[cold]
    fn enter_error(&mut self, why: &str) {
        if std::mem::replace(&mut self.core.in_error, true) {
            return;
        }
        self.core
            .shared
            .metrics
            .0
            .in_error
            .store(1, Ordering::Relaxed);
        tracing::error!(cq = %self.core.shared.name, why,
            "CQ in the error state: no longer armed; its poller polls it once per wake timeout");
    }

    /// Takes pending notifications (non-blocking); they must be acked.
    ///
    /// # Errors
    /// When the source fails.
    pub fn take_events(&mut self) -> Result<u32, SourceError> {
        let n = self.core.source.take_events()?;
        bump(&self.core.shared.metrics.0.events, u64::from(n));
        Ok(n)
    }

    /// Acknowledges every notification taken so far.
    ///
    /// # Errors
    /// When the source fails.
    pub fn ack_all(&mut self) -> Result<(), SourceError> {
        let n = self.core.source.unacked_events();
        if n > 0 {
            self.core.source.ack_events(n)?;
            bump(&self.core.shared.metrics.0.acks, u64::from(n));
        }
        Ok(())
    }

    /// Notifications taken and not yet acknowledged.
    pub fn unacked_events(&self) -> u32 {
        self.core.source.unacked_events()
    }

    /// The notification descriptor (for epoll or an async runtime).
    pub fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.core.source.event_fd()
    }

    /// The descriptor that is rung when a handle registers or unregisters a
    /// handler (for a custom loop: a poller thread installs its own, one
    /// for its whole group). The first call makes it.
    ///
    /// # Errors
    /// When the eventfd cannot be made.
    pub fn doorbell_fd(&mut self) -> Result<std::os::fd::BorrowedFd<'_>, SourceError> {
        use std::os::fd::AsFd;
        if self.core.doorbell.is_none() {
            let d = GroupBell::new().map_err(|source| SourceError::Os {
                op: "eventfd",
                source,
            })?;
            self.install_doorbell(Arc::new(d), 0);
        }
        match &self.core.doorbell {
            Some(d) => Ok(d.as_fd()),
            None => unreachable!("installed above"),
        }
    }

    /// Makes `doorbell` the one every command on this CQ rings, noting
    /// `index` (the CQ's place in its group), then applies the commands
    /// queued before (see [`CqShared::ring`]).
    pub(crate) fn install_doorbell(&mut self, doorbell: Arc<GroupBell>, index: usize) {
        *self
            .core
            .shared
            .doorbell
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some((Arc::clone(&doorbell), index));
        self.core.doorbell = Some(doorbell);
        self.apply_commands();
    }

    /// Polls up to the round budget: again while the CQ returns full
    /// batches ([`CqOptions::round_budget`]) and `out` holds at most
    /// `spill_mark` items (so the spill's bound of `poller::spill` is that
    /// of one batch per CQ). Returns the completions polled; an error after
    /// some were polled ends the round quietly (the next round meets it
    /// again).
    pub(crate) fn poll_round(
        &mut self,
        out: &mut VecDeque<Routed<W>>,
        spill_mark: usize,
    ) -> Result<usize, SourceError> {
        let batch = self.core.buf.len();
        let budget = self.core.options.round_budget.max(1);
        let mut total = 0;
        loop {
            let n = match self.poll_once(out) {
                Ok(n) => n,
                Err(e) if total == 0 => return Err(e),
                Err(_) => return Ok(total),
            };
            total += n;
            if n < batch || total >= budget || out.len() > spill_mark {
                return Ok(total);
            }
        }
    }

    /// Handles pending asynchronous events: counts them, traces them (a
    /// CQ's or device's at error level, a QP's or SRQ's at warning level,
    /// and a QP's `LastWqeReached`, the usual end of a QP on an SRQ that
    /// step 2 of `ledger::teardown` waits for, at debug level), and
    /// returns how many there were. A backend's
    /// [`AsyncEvent::QpDestroyed`] is taken here too (step 2' of
    /// `ledger::teardown`), neither counted nor traced as a device's event.
    pub fn check_async(&mut self) -> usize {
        let mut n = 0;
        while let Some(ev) = self.core.source.take_async_event() {
            if let AsyncEvent::QpDestroyed { qp_num } = ev {
                // Step 2' of `ledger::teardown` (one event per destroy).
                if !self.core.last_wqe.contains(&qp_num)
                    && self
                        .core
                        .shared
                        .ledger
                        .get()
                        .is_some_and(|l| l.qp_destroyed(qp_num))
                {
                    self.core.last_wqe.push(qp_num);
                }
                continue;
            }
            n += 1;
            let m = &self.core.shared.metrics.0;
            bump(&m.async_events, 1);
            if let AsyncEvent::CqOverflow { capacity, lost } = ev {
                tracing::error!(cq = %self.core.shared.name, capacity, lost, "CQ overflow: completions were lost");
                // The error state and the budget's count are published
                // before the overflow count (`CqMetrics::publish_overflow`,
                // steps 1-3): a snapshot that shows the overflow shows the
                // CQ in error and the budget's count of it.
                self.enter_error("it overflowed");
                self.core.overflows += 1;
                let budget = self.core.shared.budget.get();
                self.core
                    .shared
                    .metrics
                    .publish_overflow(self.core.overflows, budget);
            } else {
                match ev {
                    AsyncEvent::Qp {
                        kind: crate::event::QpEvent::LastWqeReached,
                        ..
                    } => {
                        tracing::debug!(cq = %self.core.shared.name, event = ?ev, "asynchronous event")
                    }
                    AsyncEvent::Qp { .. } | AsyncEvent::Srq { .. } => {
                        tracing::warn!(cq = %self.core.shared.name, event = ?ev, "asynchronous event")
                    }
                    _ => {
                        tracing::error!(cq = %self.core.shared.name, event = ?ev, "asynchronous event")
                    }
                }
                if let AsyncEvent::Qp {
                    qp_num,
                    kind: crate::event::QpEvent::LastWqeReached,
                    ..
                } = ev
                {
                    // Step 2 of `ledger::teardown`.
                    if self
                        .core
                        .shared
                        .ledger
                        .get()
                        .is_some_and(|l| l.last_wqe_reached(qp_num))
                    {
                        self.core.last_wqe.push(qp_num);
                    }
                }
                self.route_async(&ev);
            }
        }
        n
    }

    /// Gives `ev` to its owning handler, if it names one that is still
    /// installed (a panic is caught and counted, as for completions).
    fn route_async(&mut self, ev: &AsyncEvent) {
        let Some(key) = ev.owner() else {
            return;
        };
        let Some(entry) = self.core.slab.get_mut(key) else {
            tracing::warn!(cq = %self.core.shared.name, %key, event = ?ev,
                "asynchronous event for a handler that is gone");
            return;
        };
        let handler = &mut entry.handler;
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler.on_async(ev))).is_err()
        {
            bump(&self.core.shared.metrics.0.handler_panics, 1);
            tracing::error!(cq = %self.core.shared.name, %key, event = ?ev, "handler panicked in on_async");
        }
    }

    /// Applies pending registrations and unregistrations.
    pub fn apply_commands(&mut self) {
        apply_commands(&self.core.shared, &mut self.core.slab);
        if self.core.shared.resizes.waiting() {
            self.resize();
        }
    }

    /// Step 2 of `resize`: makes the resizes asked, on this (the polling)
    /// thread, between two polls.
    #[cold]
    fn resize(&mut self) {
        let shared = Arc::clone(&self.core.shared);
        for (cqe, answer) in shared.resizes.take() {
            let capacity = shared.resizes.capacity();
            let outcome = if cqe <= capacity {
                Err(ResizeError::NotLarger {
                    cq: shared.name.clone(),
                    asked: cqe,
                    capacity,
                })
            } else {
                match self.core.source.resize(cqe) {
                    Ok(now) => {
                        // Admission counts the new entries only now that
                        // the device holds them.
                        if let Some(b) = shared.budget.get() {
                            b.grown_to(now);
                        }
                        shared.resizes.set_capacity(now.max(capacity));
                        tracing::debug!(cq = %shared.name, asked = cqe, capacity = now, "CQ resized");
                        Ok(now)
                    }
                    Err(SourceError::Unsupported(reason)) => Err(ResizeError::Unsupported {
                        cq: shared.name.clone(),
                        reason,
                    }),
                    Err(e) => Err(ResizeError::Failed {
                        cq: shared.name.clone(),
                        asked: cqe,
                        reason: e.to_string(),
                    }),
                }
            };
            answer.answer(outcome);
        }
    }

    /// Requests posted under this CQ's handlers and not yet completed.
    pub fn outstanding(&self) -> u64 {
        self.core
            .slab
            .iter()
            .map(|(_, e)| e.ledger.outstanding_raw())
            .sum()
    }

    /// The account of every installed handler (retired ones are balanced
    /// by definition), with the requests an attached [`WrLedger`] still
    /// holds.
    pub fn accounts(&self) -> crate::ledger::ShutdownReport {
        let mut report = crate::ledger::ShutdownReport::from_ledgers(
            self.core.slab.iter().map(|(key, e)| (key, &e.ledger)),
        );
        if let Some(l) = self.core.shared.ledger.get() {
            report.stuck = l.scan(Instant::now(), std::time::Duration::ZERO);
        }
        report
    }

    /// Keys of the installed handlers (retiring ones included).
    pub fn handler_keys(&self) -> Vec<HandlerKey> {
        self.core.slab.keys().collect()
    }

    /// Destroys the CQ after acknowledging every event. Consumes the poller.
    /// It neither drains nor reports: a loop of your own stops with
    /// [`stop`](Self::stop), whose report `shutdown` takes.
    ///
    /// # Errors
    /// When acknowledging or destroying fails.
    pub fn destroy(mut self) -> Result<(), SourceError> {
        self.finish()
    }

    pub(crate) fn finish(&mut self) -> Result<(), SourceError> {
        self.core.finish()
    }

    pub(crate) fn shared(&self) -> &CqShared<W> {
        &self.core.shared
    }

    /// The CQ's slow threshold ([`CqOptions::slow_batch`]).
    pub(crate) fn slow_threshold(&self) -> Option<std::time::Duration> {
        self.core.options.slow_batch
    }

    /// A poller thread's round that polled this CQ took `took`: past the
    /// slow threshold, the CQ's next batch is timed whatever the sampler
    /// drew, so that a handler that blocks on every call is found on the
    /// next batch rather than by chance.
    #[cold]
    pub(crate) fn round_took(&mut self, took: std::time::Duration) {
        if self.core.options.slow_batch.is_some_and(|t| took > t) {
            self.core.sampler.until = 1;
        }
    }
}

mod bell;
mod contexts;
mod dispatch;
mod handle;
mod posting;
mod resize;

pub(crate) use bell::GroupBell;
pub use resize::{ResizeError, Resizing};

pub use contexts::{ContextRegistration, PostRefused};
use dispatch::{apply_commands, dispatch_batch};
pub use handle::{CqHandle, Registration, DRY_GRACE};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::NoWork;
    use crate::sys::Doorbell;

    fn assert_send<T: Send>() {}
    fn assert_send_sync<T: Send + Sync>() {}

    /// The slow check's sampler times one batch in SLOW_SAMPLE on
    /// average, and every kind of batch of a periodic pattern (the strided
    /// sampler it replaced timed one kind only: a stride of 8 batches
    /// against a period of 2 or 4).
    #[test]
    fn sampler_times_every_kind_of_batch_of_a_periodic_pattern() {
        for period in [2usize, 3, 4, 8, 16] {
            let mut s = Sampler::default();
            let mut timed = vec![0u32; period];
            let rounds = 20_000;
            for _ in 0..rounds {
                for t in timed.iter_mut() {
                    *t += u32::from(s.take());
                }
            }
            let all: u32 = timed.iter().sum();
            let per = (rounds * period) as f64 / f64::from(all);
            assert!(
                (f64::from(SLOW_SAMPLE) * 0.9..=f64::from(SLOW_SAMPLE) * 1.1).contains(&per),
                "period {period}: one timed batch in {per:.2}"
            );
            // Each kind of batch gets its share, within 20 %.
            let share = f64::from(all) / period as f64;
            for (kind, &t) in timed.iter().enumerate() {
                assert!(
                    (f64::from(t) - share).abs() < share * 0.2,
                    "period {period}: kind {kind} timed {t} times of {all}"
                );
            }
        }
    }

    /// A source holding `left` completions (foreign wr_ids: dispatch only
    /// counts them) and the asynchronous events in `events`.
    struct Queue {
        left: usize,
        fd: Doorbell,
        events: std::sync::Arc<parking_lot::Mutex<VecDeque<AsyncEvent>>>,
        ledger: Option<WrLedger>,
    }

    fn queue(left: usize) -> Queue {
        Queue {
            left,
            fd: Doorbell::new().unwrap(),
            events: Default::default(),
            ledger: None,
        }
    }

    impl CompletionSource for Queue {
        fn name(&self) -> &str {
            "q"
        }
        fn capacity(&self) -> u32 {
            1024
        }
        fn poll(&mut self, out: &mut [Completion]) -> Result<usize, SourceError> {
            let n = out.len().min(self.left);
            self.left -= n;
            Ok(n)
        }
        fn arm(&mut self, _: ArmKind) -> Result<(), SourceError> {
            Ok(())
        }
        fn event_fd(&self) -> std::os::fd::BorrowedFd<'_> {
            use std::os::fd::AsFd;
            self.fd.as_fd()
        }
        fn take_events(&mut self) -> Result<u32, SourceError> {
            Ok(0)
        }
        fn ack_events(&mut self, _: u32) -> Result<(), SourceError> {
            Ok(())
        }
        fn unacked_events(&self) -> u32 {
            0
        }
        fn take_async_event(&mut self) -> Option<AsyncEvent> {
            self.events.lock().pop_front()
        }
        fn ledger(&self) -> Option<WrLedger> {
            self.ledger.clone()
        }
        fn destroy(&mut self) -> Result<(), SourceError> {
            Ok(())
        }
    }

    fn poller<W: Send + 'static>(left: usize, batch: usize, round_budget: usize) -> CqPoller<W> {
        let options = CqOptions {
            batch,
            round_budget,
            ..CqOptions::default()
        };
        split::<W>(queue(left), options).unwrap().0.bind()
    }

    /// Records the asynchronous events it is given; panics on the second.
    struct Owner(std::sync::Arc<parking_lot::Mutex<Vec<AsyncEvent>>>);

    impl crate::handler::Handler for Owner {
        fn on_send(
            &mut self,
            _: &crate::handler::SendDone<'_>,
            _: &mut crate::handler::Outbox<'_, NoWork>,
        ) {
        }
        fn on_recv(
            &mut self,
            _: &crate::handler::RecvDone<'_>,
            _: &mut crate::handler::Outbox<'_, NoWork>,
        ) {
        }
        fn on_error(
            &mut self,
            _: &crate::handler::Failed<'_>,
            _: &mut crate::handler::Outbox<'_, NoWork>,
        ) {
        }
        fn on_async(&mut self, event: &AsyncEvent) {
            let mut seen = self.0.lock();
            seen.push(event.clone());
            if seen.len() == 2 {
                drop(seen);
                panic!("a handler that panics in on_async");
            }
        }
    }

    #[test]
    fn queue_events_reach_their_owner_and_only_it() {
        use crate::source::{QpEvent, SrqEvent};
        let seen = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let other = std::sync::Arc::new(parking_lot::Mutex::new(Vec::new()));
        let source = queue(0);
        let queue = source.events.clone();
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
        let owner = handle.register(Owner(seen.clone())).unwrap();
        let bystander = handle.register(Owner(other.clone())).unwrap();
        let gone = handle.register(Owner(other.clone())).unwrap();
        let gone_key = gone.key();
        handle.unregister(gone_key).unwrap();
        drop(gone);
        let mut p = unbound.bind();
        p.apply_commands();
        let events = [
            AsyncEvent::Qp {
                qp_num: 17,
                kind: QpEvent::Fatal,
                owner: Some(owner.key()),
            },
            // No owner: counted and traced only.
            AsyncEvent::Qp {
                qp_num: 18,
                kind: QpEvent::AccessError,
                owner: None,
            },
            // An owner that is gone: counted, traced, nobody called.
            AsyncEvent::Srq {
                srq_num: 3,
                kind: SrqEvent::LimitReached,
                owner: Some(gone_key),
            },
            // The owner panics on this one: caught and counted.
            AsyncEvent::Srq {
                srq_num: 4,
                kind: SrqEvent::Error,
                owner: Some(owner.key()),
            },
        ];
        queue.lock().extend(events.iter().cloned());
        assert_eq!(p.check_async(), 4);
        assert_eq!(*seen.lock(), vec![events[0].clone(), events[3].clone()]);
        assert!(other.lock().is_empty(), "no other handler is called");
        let m = handle.snapshot();
        assert_eq!(m.async_events, 4);
        assert_eq!(m.handler_panics, 1);
        assert_eq!(m.overflows, 0, "queue events do not put the CQ in error");
        drop(bystander);
    }

    /// Step 2' of `ledger::teardown`: a backend's `QpDestroyed` is no
    /// device event (not counted, given to no handler); the poll after it
    /// that comes back short quiesces the QP's SRQ user, detaches it and
    /// reaps the graveyard the rest of the QP waits in, and no other user.
    #[test]
    fn a_destroyed_srq_user_is_quiesced_by_the_next_short_poll() {
        use crate::account::QueueAccount;
        use crate::ledger::{Graveyard, SrqUser, Zombie};
        use crate::wr_id::Side;
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;

        struct Rest(Arc<SrqUser>, Arc<AtomicBool>);
        impl Zombie for Rest {
            fn ready(&self) -> bool {
                self.0.quiesced()
            }
        }
        impl Drop for Rest {
            fn drop(&mut self) {
                self.1.store(true, Ordering::Release);
            }
        }

        let ledger = WrLedger::new();
        let srq = QueueAccount::srq(5);
        let user = ledger.attach_srq_user(40, &srq).unwrap();
        let other = ledger.attach_srq_user(41, &srq).unwrap();
        let mut source = queue(7);
        source.ledger = Some(ledger.clone());
        let events = source.events.clone();
        let options = CqOptions {
            batch: 4,
            ..CqOptions::default()
        };
        let (unbound, handle) = split::<NoWork>(source, options).unwrap();
        let mut p = unbound.bind();
        let (grave, reaped) = (Graveyard::new(), Arc::new(AtomicBool::new(false)));
        // The backend's part of step 2'.
        assert!(user.mark_destroyed());
        assert!(user.destroyed() && user.last_wqe_seen() && !user.quiesced());
        user.waits_in(&grave);
        grave.bury(Box::new(Rest(Arc::clone(&user), Arc::clone(&reaped))));
        events.lock().extend([
            AsyncEvent::QpDestroyed { qp_num: 40 },
            // Not destroyed: nothing to quiesce.
            AsyncEvent::QpDestroyed { qp_num: 41 },
            // No SRQ user of that number here: nothing to quiesce.
            AsyncEvent::QpDestroyed { qp_num: 99 },
        ]);
        assert_eq!(p.check_async(), 0, "not a device's event");
        assert_eq!(handle.snapshot().async_events, 0);
        assert!(p.quiescing());
        assert!(ledger.has_srq_user(40), "attached until quiesced");
        let mut out = VecDeque::new();
        // A full batch: the CQ may hold more of the QP's completions.
        assert_eq!(p.poll_once(&mut out).unwrap(), 4);
        assert!(!user.quiesced() && grave.len() == 1);
        // A short one: every completion the QP wrote is accounted.
        assert_eq!(p.poll_once(&mut out).unwrap(), 3);
        assert!(user.quiesced() && !user.destroyed());
        assert!(reaped.load(Ordering::Acquire) && grave.is_empty());
        assert!(!p.quiescing());
        assert!(!ledger.has_srq_user(40) && ledger.lookup(40, Side::Recv).is_none());
        assert!(ledger.has_srq_user(41) && ledger.lookup(41, Side::Recv).is_some());
        assert!(!other.last_wqe_seen());
        // A second event for it finds nothing.
        events
            .lock()
            .push_back(AsyncEvent::QpDestroyed { qp_num: 40 });
        p.check_async();
        assert!(!p.quiescing());
    }

    #[test]
    fn a_round_polls_full_batches_up_to_the_budget() {
        let mut out = VecDeque::new();
        // Full batches of 4 until the budget of 10 is reached: 12.
        assert_eq!(
            poller::<NoWork>(100, 4, 10)
                .poll_round(&mut out, usize::MAX)
                .unwrap(),
            12
        );
        // A short batch ends the round.
        assert_eq!(
            poller::<NoWork>(6, 4, 10)
                .poll_round(&mut out, usize::MAX)
                .unwrap(),
            6
        );
        // A budget below a batch still polls one batch.
        assert_eq!(
            poller::<NoWork>(100, 4, 1)
                .poll_round(&mut out, usize::MAX)
                .unwrap(),
            4
        );
        // The default: 256 (eight batches of 32).
        let mut p = split::<NoWork>(queue(1000), CqOptions::default())
            .unwrap()
            .0
            .bind();
        assert_eq!(
            p.poll_round(&mut out, usize::MAX).unwrap(),
            DEFAULT_ROUND_BUDGET
        );
    }

    #[test]
    fn a_round_stops_repeating_above_the_spill_mark() {
        let mut p = poller::<u32>(100, 4, 100);
        // An item already spilled, above a mark of 0: one batch only.
        let mut out = VecDeque::from([Routed {
            item: 7u32,
            route: crate::sink::Route::Key(0),
        }]);
        assert_eq!(p.poll_round(&mut out, 0).unwrap(), 4);
    }

    #[test]
    fn auto_traits() {
        // UnboundCq: Send (moved to its thread); CqPoller's !Send and both
        // !Sync and !Clone are pinned by the compile_fail doctests of this
        // module.
        assert_send::<UnboundCq<NoWork>>();
        assert_send::<UnboundCq<Vec<u8>>>();
        assert_send_sync::<CqHandle<NoWork>>();
        assert_send_sync::<Registration>();
    }
}
