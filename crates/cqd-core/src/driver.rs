//! A CQ group driven by a task on a tokio runtime instead of a poller thread
//! (feature `tokio`).
//!
//! [`TokioDriver`] takes the same CQs, sinks and handlers as a poller
//! thread and runs the same sleep protocol as the Event mode (`mode`, "The
//! sleep protocol") as a task: its CQs' notification descriptors, and the
//! group's doorbell, are registered with the runtime (`AsyncFd`), and the
//! task
//!
//! 1. **drains** every CQ to empty, handing the work its handlers emit to
//!    the sink (yielding to the runtime every round budget, never sleeping
//!    before the CQs are empty);
//! 2. **arms** each CQ whose arm is not already in force;
//! 3. **re-polls** each CQ it armed: a completion that landed between the
//!    last empty poll and the arm raised no notification; anything found
//!    means no sleep, back to 1;
//! 4. **waits** for a CQ's descriptor, the doorbell (a registration, a
//!    stop) or the wake timeout;
//! 5. **collects** the notifications of each ready CQ (reading until the
//!    descriptor would block, which is when the runtime may forget its
//!    readiness), acknowledges them in batches, and goes back to 1. On the
//!    wake timeout (the safety net) it first takes what is already
//!    notified, then polls the quiet CQs: completions found there with no
//!    notification on the way had theirs lost, and are counted as
//!    recovered missed events.
//!
//! A CQ in error (an overflow) is never armed again and is polled at each
//! wake timeout, as a poller thread does. The task keeps the CQs' metrics
//! and accounts exactly as a poller thread does; at a stop it drains,
//! accounts, hands over its work, acknowledges every event and destroys its
//! CQs, and its report is a [`PollerReport`] that
//! [`shutdown`](crate::shutdown()) takes beside the poller threads'
//! ([`DriverHandle`] converts into a [`Stopper`]).
//!
//! The driver's future owns the bound CQs, which never leave the thread
//! that binds them, so it is not `Send`: run it with
//! [`spawn_local`](TokioDriver::spawn_local) inside a `tokio::task::LocalSet`
//! (on a current-thread runtime, or on one thread of a multi-thread
//! runtime). Handlers and pools work under it as under a poller thread.
//! No `unsafe` is needed to use it.
//!
//! ```rust,ignore
//! let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
//! let local = tokio::task::LocalSet::new();
//! let driver = local.block_on(&runtime, async {
//!     TokioDriver::new("net", NoSink).cq(unbound).spawn_local()
//! })?;
//! // … the server runs on the runtime; its stop, in a task:
//! let report = local.block_on(&runtime, async {
//!     flush();                                 // every QP to the error state
//!     driver.stop().await                      // drains, accounts, finishes its CQs
//! });
//! // or with the whole system, from a thread other than the driver's:
//! // shutdown(flush, [Stopper::from(driver), poller_thread.into()], pools)
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::cq::{CqPoller, GroupBell, UnboundCq};
use crate::metrics::{bump, PollerMetrics};
use crate::poller::{
    hand_back, hand_over, joiner, AnyArrivals, Arrivals, CqJoiner, CustomStop, JoinError, Joining,
    NotJoined, PollerError, PollerReport, ARRIVAL, DEFAULT_ACK_BATCH,
    DEFAULT_SPILL_HIGH_WATER_MARK, DEFAULT_WAKE_TIMEOUT, MIN_WAKE_TIMEOUT,
};
use crate::shutdown::Stopper;
use crate::sink::{Routed, WorkSink};
use crate::source::SourceError;

/// Builds a CQ group driven by a tokio task.
pub struct TokioDriver<W, S> {
    name: String,
    cqs: Vec<UnboundCq<W>>,
    sink: S,
    wake_timeout: Duration,
    ack_batch: u32,
    how: CustomStop,
    give_back: Option<GiveBack<W>>,
}

/// What receives the work a stop could not hand over.
type GiveBack<W> = Box<dyn FnOnce(Vec<W>)>;

impl<W, S> std::fmt::Debug for TokioDriver<W, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokioDriver")
            .field("name", &self.name)
            .field("cqs", &self.cqs.len())
            .finish()
    }
}

impl<W: Send + 'static, S: WorkSink<W> + 'static> TokioDriver<W, S> {
    /// A driver named `name` (its report's name) handing work to `sink`.
    pub fn new(name: impl Into<String>, sink: S) -> Self {
        TokioDriver {
            name: name.into(),
            cqs: Vec::new(),
            sink,
            wake_timeout: DEFAULT_WAKE_TIMEOUT,
            ack_batch: DEFAULT_ACK_BATCH,
            how: CustomStop::default(),
            give_back: None,
        }
    }

    /// Receives, at the stop, the work items the sink never took (in their
    /// order), so the application can fail those requests explicitly, as
    /// [`PollerBuilder::on_undelivered`](crate::PollerBuilder::on_undelivered)
    /// does for a poller thread. Called once, on the driver's task, only if
    /// something is left. Without it, what is left is dropped after an
    /// error-level trace; the report counts it either way
    /// ([`PollerReport::undelivered`]).
    pub fn on_undelivered(mut self, f: impl FnOnce(Vec<W>) + 'static) -> Self {
        self.give_back = Some(Box::new(f));
        self
    }

    /// Adds a CQ to the group (the task binds it).
    pub fn cq(mut self, cq: UnboundCq<W>) -> Self {
        self.cqs.push(cq);
        self
    }

    /// The safety net's timeout (default 100 ms; at least
    /// [`MIN_WAKE_TIMEOUT`]).
    pub fn wake_timeout(mut self, t: Duration) -> Self {
        self.wake_timeout = t;
        self
    }

    /// How long a stop waits for outstanding requests (default 5 s).
    pub fn drain_timeout(mut self, t: Duration) -> Self {
        self.how.drain_timeout = t;
        self
    }

    /// How long a stop keeps offering the drained work to the sink before
    /// it hands what is left to [`on_undelivered`](Self::on_undelivered)
    /// (default 10 s).
    pub fn stop_timeout(mut self, t: Duration) -> Self {
        self.how.stop_timeout = t;
        self
    }

    /// Starts the driver as a task of the current `LocalSet`
    /// (`tokio::task::spawn_local`): call it from inside one. The CQs are
    /// bound and their descriptors registered before it returns.
    ///
    /// # Errors
    /// [`PollerError::NoCq`] for an empty group,
    /// [`PollerError::WakeTimeout`] below the minimum,
    /// [`PollerError::SharedChannel`] for a CQ on a completion channel
    /// shared with other CQs (give such CQs a poller thread, which reads
    /// the channel once for all of them), [`PollerError::Os`] when a
    /// descriptor cannot be duplicated or registered.
    ///
    /// # Panics
    /// Outside a `LocalSet` (as `tokio::task::spawn_local` does), outside a
    /// runtime, or on a runtime without IO or time enabled
    /// (`Builder::enable_all`), as tokio's `AsyncFd` and timers do.
    pub fn spawn_local(self) -> Result<DriverHandle, PollerError> {
        let name = self.name.clone();
        if self.cqs.is_empty() {
            return Err(PollerError::NoCq { poller: name });
        }
        if self.wake_timeout < MIN_WAKE_TIMEOUT {
            return Err(PollerError::WakeTimeout {
                poller: name,
                given: self.wake_timeout,
                min: MIN_WAKE_TIMEOUT,
            });
        }
        let os = |op: &'static str| {
            let poller = name.clone();
            move |source| PollerError::Os { poller, op, source }
        };
        let bell = Arc::new(GroupBell::new().map_err(os("eventfd"))?);
        let bell_fd = register(bell.as_fd()).map_err(os("register the doorbell"))?;
        if let Some(cq) = self.cqs.iter().find(|c| c.source().notifier().is_some()) {
            return Err(PollerError::SharedChannel {
                poller: name,
                cq: cq.name().to_string(),
            });
        }
        let n_cqs = self.cqs.len();
        let mut cqs = Vec::with_capacity(n_cqs);
        for (i, cq) in self.cqs.into_iter().enumerate() {
            let mut poller = cq.bind();
            poller.install_doorbell(Arc::clone(&bell), i);
            let fd = register(poller.event_fd()).map_err(os("register a CQ's descriptor"))?;
            cqs.push(DrivenCq {
                poller,
                fd,
                armed: false,
            });
        }
        let arrivals = Arrivals::<W>::new(&name, Arc::clone(&bell));
        let shared = Arc::new(Shared {
            thread: std::thread::current().id(),
            stop: AtomicBool::new(false),
            bell,
            report: Mutex::new(None),
            done: Condvar::new(),
            done_async: tokio::sync::Notify::new(),
        });
        let group = Group {
            name: name.clone(),
            cqs,
            bell_fd,
            sink: self.sink,
            out: VecDeque::new(),
            metrics: PollerMetrics::default(),
            shared: Arc::clone(&shared),
            wake_timeout: self.wake_timeout,
            ack_batch: self.ack_batch,
            how: self.how,
            give_back: self.give_back,
            noted: Vec::new(),
            ready: Vec::with_capacity(n_cqs),
            arrivals: Arc::clone(&arrivals),
        };
        tokio::task::spawn_local(group.run());
        // The stop drains once for the group, then hands over per CQ.
        let per_cq = self.how.stop_timeout * (n_cqs as u32 + 1);
        Ok(DriverHandle {
            name,
            shared,
            arrivals,
            wait: self.how.drain_timeout + per_cq + Duration::from_secs(5),
        })
    }
}

/// Registers a duplicate of `fd` with the runtime.
fn register(fd: std::os::fd::BorrowedFd<'_>) -> std::io::Result<AsyncFd<OwnedFd>> {
    let fd = fd.try_clone_to_owned()?;
    // SAFETY: `register_with_interest` needs a descriptor that stays
    // open and names the same open file for as long as the
    // `AsyncFd` lives. `fd` is an `OwnedFd` the `AsyncFd` takes: it
    // is closed only when the `AsyncFd` drops it, its number never
    // changes, and nothing here replaces it (no `get_mut`, no
    // `into_inner` before the drop). It is a duplicate of the CQ's
    // (or the doorbell's) descriptor, so it names the same file
    // even while the CQ keeps its own; the `AsyncFd`s are dropped
    // before their CQs are destroyed (`Group::finish`).
    unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }.map_err(std::io::Error::from)
}

/// What the driver task and its handle share.
struct Shared {
    /// The thread whose `LocalSet` runs the task.
    thread: std::thread::ThreadId,
    stop: AtomicBool,
    bell: Arc<GroupBell>,
    report: Mutex<Option<PollerReport>>,
    done: Condvar,
    done_async: tokio::sync::Notify,
}

impl Shared {
    fn deliver(&self, report: PollerReport) {
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
        self.done.notify_all();
        self.done_async.notify_one();
    }

    fn take(&self) -> Option<PollerReport> {
        self.report.lock().unwrap_or_else(|p| p.into_inner()).take()
    }
}

/// The running driver: `Send` and `Sync`, to stop it from anywhere.
/// Dropping it asks the driver to stop (its report is then nobody's: stop
/// it with [`stop`](Self::stop) or through `shutdown` to read it).
#[must_use = "a dropped DriverHandle stops its driver without reading the report"]
pub struct DriverHandle {
    name: String,
    shared: Arc<Shared>,
    /// CQs joining the running group (`poller::arrive`).
    arrivals: AnyArrivals,
    /// How long a blocking stop waits for the task's report.
    wait: Duration,
}

impl std::fmt::Debug for DriverHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverHandle")
            .field("name", &self.name)
            .finish()
    }
}

impl DriverHandle {
    /// The driver's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Asks the task to stop; it drains, accounts and finishes its CQs.
    pub fn request_stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.bell.ring();
    }

    /// Adds a CQ to the running driver, as
    /// [`PollerThread::add_cq`](crate::PollerThread::add_cq) does: the task
    /// registers its descriptor with the runtime, binds it and drains it
    /// from its next round. The CQ's name must be new to the driver, and
    /// its completion channel its own.
    ///
    /// # Errors
    /// As [`PollerThread::add_cq`](crate::PollerThread::add_cq); the
    /// `Joining` also reports [`JoinError::SharedChannel`].
    pub fn add_cq<W: Send + 'static>(&self, cq: UnboundCq<W>) -> Result<Joining, NotJoined<W>> {
        hand_over(&self.arrivals, &self.name, cq)
    }

    /// A handle that adds CQs to this group from anywhere (a CQ pool's),
    /// if `W` is its work type.
    pub fn joiner<W: Send + 'static>(&self) -> Option<CqJoiner<W>> {
        joiner(&self.arrivals)
    }

    /// Stops the driver and awaits its report, from a task (of any
    /// runtime; the driver's `LocalSet` must go on running).
    pub async fn stop(self) -> PollerReport {
        self.request_stop();
        loop {
            let notified = self.shared.done_async.notified();
            if let Some(r) = self.shared.take() {
                return r;
            }
            notified.await;
        }
    }

    /// The driver as one of `shutdown`'s stops (the same as `Stopper::from`).
    pub fn stopper(self) -> Stopper {
        Stopper::from(self)
    }

    /// Stops the driver and blocks until its report, from a thread that is
    /// not the driver's: the driver's thread must go on running its
    /// `LocalSet` meanwhile.
    fn stop_blocking(self) -> Result<PollerReport, String> {
        self.request_stop();
        if std::thread::current().id() == self.shared.thread {
            return Err(format!(
                "driver {}: a blocking stop on the driver's own thread would wait for itself; \
                 call shutdown from another thread (spawn_blocking) or use \
                 DriverHandle::stop().await",
                self.name
            ));
        }
        let deadline = Instant::now() + self.wait;
        let mut slot = self.shared.report.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = slot.take() {
                return Ok(r);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "driver {}: no report within {:?} of the stop: is its runtime still running \
                     it (a blocking stop on the runtime's own thread waits for itself; stop it \
                     from another thread, or with DriverHandle::stop().await)",
                    self.name, self.wait
                ));
            }
            slot = self
                .shared
                .done
                .wait_timeout(slot, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for DriverHandle {
    fn drop(&mut self) {
        self.request_stop();
    }
}

impl From<DriverHandle> for Stopper {
    fn from(d: DriverHandle) -> Self {
        let name = d.name.clone();
        // Its errors name the driver already.
        Stopper::unprefixed(name, move || d.stop_blocking())
    }
}

/// Delivers a report naming the failure if the driver's task ends (is
/// dropped, or panics) before it delivered its own.
struct Delivery {
    shared: Arc<Shared>,
    name: String,
    delivered: bool,
}

impl Drop for Delivery {
    fn drop(&mut self) {
        if self.delivered {
            return;
        }
        let mut r = PollerReport {
            poller: PollerMetrics::default().snapshot(&self.name),
            cqs: Vec::new(),
            undelivered: 0,
            errors: Vec::new(),
            accounts: Default::default(),
        };
        r.errors.push(format!(
            "driver {}: its task ended without a stop (it panicked, or its LocalSet or runtime \
             was dropped): its CQs were finished without a drain or accounts",
            self.name
        ));
        self.shared.deliver(r);
    }
}

/// One CQ of the group.
struct DrivenCq<W> {
    /// First, so that it is dropped (deregistered) before the CQ.
    fd: AsyncFd<OwnedFd>,
    poller: CqPoller<W>,
    /// The CQ's one-shot arm is in force (not seen firing).
    armed: bool,
}

/// Why a wait ended.
enum Woke {
    /// CQs' descriptors are readable: those in `Group::ready`.
    Cqs,
    /// The doorbell (a registration or a stop).
    Bell,
    /// The wake timeout.
    Timeout,
    /// A descriptor's readiness failed.
    Failed(std::io::Error),
}

struct Group<W, S> {
    name: String,
    cqs: Vec<DrivenCq<W>>,
    bell_fd: AsyncFd<OwnedFd>,
    sink: S,
    out: VecDeque<Routed<W>>,
    metrics: PollerMetrics,
    shared: Arc<Shared>,
    wake_timeout: Duration,
    ack_batch: u32,
    how: CustomStop,
    give_back: Option<GiveBack<W>>,
    noted: Vec<usize>,
    /// The CQs a wait found readable (reused).
    ready: Vec<usize>,
    /// CQs handed over to join the group (`poller::arrive`).
    arrivals: Arc<Arrivals<W>>,
}

impl<W: Send + 'static, S: WorkSink<W>> Group<W, S> {
    async fn run(mut self) {
        // Delivers an error report if the task ends without one (a panic in
        // a sink, the LocalSet dropped): a stop never waits for ever.
        let mut guard = Delivery {
            shared: Arc::clone(&self.shared),
            name: self.name.clone(),
            delivered: false,
        };
        let mut failures = 0u32;
        let mut errors = Vec::new();
        loop {
            match self.serve().await {
                Ok(()) => break,
                Err(e) => {
                    // As a poller thread: traced, counted, backed off; the
                    // loop goes on (a device coming back is served again).
                    failures += 1;
                    tracing::error!(driver = %self.name, error = %e, failures,
                        "driver: a source failed; backing off");
                    if errors.len() < 8 {
                        errors.push(format!("driver {}: {e}", self.name));
                    }
                    let back_off = self.wake_timeout * failures.min(10);
                    tokio::time::sleep(back_off).await;
                }
            }
        }
        // `poller::arrive` step 3.
        self.arrivals.end();
        let mut report = self.finish().await;
        report.errors.extend(errors);
        self.shared.deliver(report);
        guard.delivered = true;
    }

    /// The protocol of the module documentation, until a stop.
    async fn serve(&mut self) -> Result<(), SourceError> {
        loop {
            bump(&self.metrics.0.loops, 1);
            if self.shared.stop.load(Ordering::Acquire) {
                return Ok(());
            }
            // 1. Drain every CQ; asynchronous events.
            self.drain_all().await?;
            for i in 0..self.cqs.len() {
                self.cqs[i].poller.check_async();
                if self.cqs[i].poller.quiescing() {
                    // An SRQ user's last WQE: a short poll quiesces it
                    // (step 3 of `ledger::teardown`).
                    self.drain(i).await?;
                }
            }
            if !self.out.is_empty() {
                // The sink is full: it drains as its workers work; above
                // the spill's mark the CQs keep their completions
                // (admission makes that safe) until it does.
                bump(&self.metrics.0.space_waits, 1);
                tokio::time::sleep(Duration::from_micros(50)).await;
                self.offer();
                continue;
            }
            // 2 and 3. Arm what is not armed, re-poll what was armed.
            let mut refound = 0;
            for i in 0..self.cqs.len() {
                let cq = &mut self.cqs[i];
                if cq.armed || cq.poller.is_in_error() {
                    continue;
                }
                match cq.poller.arm() {
                    Ok(()) => cq.armed = true,
                    Err(SourceError::CqInError) => continue,
                    Err(e) => return Err(e),
                }
                refound += self.drain(i).await?;
            }
            if refound > 0 {
                continue;
            }
            // 4. Wait.
            bump(&self.metrics.0.sleeps, 1);
            match self.wait().await {
                Woke::Cqs => {
                    // Kept between wake-ups: no allocation per wake-up.
                    let ready = std::mem::take(&mut self.ready);
                    for &i in &ready {
                        self.collect(i).await?;
                    }
                    self.ready = ready;
                }
                Woke::Bell => {
                    bump(&self.metrics.0.control_wakeups, 1);
                    self.ring_taken().await;
                }
                Woke::Timeout => {
                    bump(&self.metrics.0.timeouts, 1);
                    self.safety_net().await?;
                }
                Woke::Failed(source) => {
                    return Err(SourceError::Os {
                        op: "wait for a descriptor",
                        source,
                    })
                }
            }
        }
    }

    /// Waits for a CQ's descriptor, the doorbell or the wake timeout.
    async fn wait(&mut self) -> Woke {
        let sleep = tokio::time::sleep(self.wake_timeout);
        let mut sleep = std::pin::pin!(sleep);
        let ready = &mut self.ready;
        let (cqs, bell_fd) = (&self.cqs, &self.bell_fd);
        std::future::poll_fn(|cx| {
            ready.clear();
            for (i, cq) in cqs.iter().enumerate() {
                match cq.fd.poll_read_ready(cx) {
                    Poll::Ready(Ok(_)) => ready.push(i),
                    Poll::Ready(Err(e)) => return Poll::Ready(Woke::Failed(e)),
                    Poll::Pending => {}
                }
            }
            if !ready.is_empty() {
                return Poll::Ready(Woke::Cqs);
            }
            match bell_fd.poll_read_ready(cx) {
                Poll::Ready(Ok(_)) => return Poll::Ready(Woke::Bell),
                Poll::Ready(Err(e)) => return Poll::Ready(Woke::Failed(e)),
                Poll::Pending => {}
            }
            if sleep.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Woke::Timeout);
            }
            Poll::Pending
        })
        .await
    }

    /// The doorbell rang: drain it (clearing the runtime's readiness only
    /// once it would block) and apply the noted CQs' commands.
    async fn ring_taken(&mut self) {
        if let Ok(mut guard) = self.bell_fd.readable().await {
            let bell = &self.shared.bell;
            let noted = &mut self.noted;
            loop {
                let r = guard.try_io(|_| {
                    if bell.drain(noted) {
                        Ok(())
                    } else {
                        Err(std::io::ErrorKind::WouldBlock.into())
                    }
                });
                if r.is_err() {
                    break;
                }
            }
        }
        let mut arrived = false;
        for i in std::mem::take(&mut self.noted) {
            if let Some(cq) = self.cqs.get_mut(i) {
                cq.poller.apply_commands();
            }
            arrived |= i == ARRIVAL;
        }
        if arrived {
            self.join_arrivals();
        }
    }

    /// `poller::arrive` step 2: the CQs handed over join, each last,
    /// unarmed (the next round drains and arms it).
    fn join_arrivals(&mut self) {
        for (cq, answer) in self.arrivals.take() {
            let name = cq.name().to_string();
            let poller = self.name.clone();
            if self.cqs.iter().any(|c| c.poller.name() == name) {
                drop(cq);
                answer.answer(Err(JoinError::Duplicate { poller, cq: name }));
                continue;
            }
            if cq.source().notifier().is_some() {
                drop(cq);
                answer.answer(Err(JoinError::SharedChannel { poller, cq: name }));
                continue;
            }
            let i = self.cqs.len();
            let mut polled = cq.bind();
            polled.install_doorbell(Arc::clone(&self.shared.bell), i);
            match register(polled.event_fd()) {
                Ok(fd) => {
                    self.cqs.push(DrivenCq {
                        poller: polled,
                        fd,
                        armed: false,
                    });
                    answer.answer(Ok(()));
                }
                Err(e) => {
                    drop(polled);
                    answer.answer(Err(JoinError::Os {
                        poller,
                        cq: name,
                        reason: e.to_string(),
                    }));
                }
            }
        }
    }

    /// Step 5 for CQ `i`: takes its notifications until its descriptor
    /// would block, acknowledges in batches.
    async fn collect(&mut self, i: usize) -> Result<(), SourceError> {
        let cq = &mut self.cqs[i];
        if let Ok(mut guard) = cq.fd.readable().await {
            loop {
                let poller = &mut cq.poller;
                let taken = guard.try_io(|_| match poller.take_events() {
                    Ok(0) => Err(std::io::ErrorKind::WouldBlock.into()),
                    Ok(n) => Ok(Ok(n)),
                    Err(e) => Ok(Err(e)),
                });
                match taken {
                    Ok(Ok(Ok(_))) => cq.armed = false,
                    Ok(Ok(Err(e))) => return Err(e),
                    Ok(Err(_)) | Err(_) => break,
                }
            }
        }
        if cq.poller.unacked_events() >= self.ack_batch {
            cq.poller.ack_all()?;
        }
        Ok(())
    }

    /// The safety net: what is already notified first, then the quiet CQs
    /// (and those in error). Completions on an armed quiet CQ with no
    /// notification after the poll that found them had theirs lost.
    async fn safety_net(&mut self) -> Result<(), SourceError> {
        for i in 0..self.cqs.len() {
            let cq = &mut self.cqs[i];
            if cq.poller.take_events()? > 0 {
                cq.armed = false;
                continue;
            }
            let found = self.drain(i).await?;
            let cq = &mut self.cqs[i];
            if found > 0 && !cq.poller.is_in_error() && cq.poller.take_events()? == 0 {
                bump(&cq.poller.shared().metrics.0.recovered_missed_events, 1);
                tracing::warn!(
                    cq = cq.poller.name(),
                    found,
                    "safety net found completions: a notification was missed and recovered"
                );
                cq.armed = false;
            }
        }
        Ok(())
    }

    async fn drain_all(&mut self) -> Result<u64, SourceError> {
        let mut total = 0;
        for i in 0..self.cqs.len() {
            total += self.drain(i).await?;
        }
        Ok(total)
    }

    /// True once a stop began: the stop drains past the spill's mark
    /// (posting has stopped; every completion must reach its handler).
    fn stopping(&self) -> bool {
        self.shared.stop.load(Ordering::Acquire)
    }

    /// Polls CQ `i` until it is empty, handing work to the sink after each
    /// batch; yields to the runtime every round budget.
    async fn drain(&mut self, i: usize) -> Result<u64, SourceError> {
        const ROUND: u64 = crate::cq::DEFAULT_ROUND_BUDGET as u64;
        let (mut total, mut round) = (0, 0);
        loop {
            if self.out.len() > DEFAULT_SPILL_HIGH_WATER_MARK && !self.stopping() {
                return Ok(total); // back-pressure: the CQ holds the rest
            }
            let n = self.cqs[i].poller.poll_once(&mut self.out)? as u64;
            self.offer();
            if n == 0 {
                return Ok(total);
            }
            total += n;
            round += n;
            if round >= ROUND {
                round = 0;
                tokio::task::yield_now().await;
            }
        }
    }

    /// Hands what the handlers emitted to the sink.
    fn offer(&mut self) {
        if !self.out.is_empty() {
            let before = self.out.len();
            self.sink.offer(&mut self.out);
            bump(&self.metrics.0.handed_off, (before - self.out.len()) as u64);
        }
    }

    /// The stop: drain until nothing is outstanding (yielding to the
    /// runtime), then each CQ's own stop, one report. That last step may
    /// block the thread while the sink refuses work, up to the stop
    /// timeout per CQ.
    async fn finish(&mut self) -> PollerReport {
        let started = Instant::now();
        let mut errors = Vec::new();
        for cq in &mut self.cqs {
            cq.poller.apply_commands();
        }
        loop {
            let found = match self.drain_all().await {
                Ok(n) => n,
                Err(e) => {
                    errors.push(format!("driver {}: poll: {e}", self.name));
                    break;
                }
            };
            self.offer();
            let outstanding: u64 = self.cqs.iter().map(|c| c.poller.outstanding()).sum();
            if outstanding == 0 || started.elapsed() >= self.how.drain_timeout {
                break;
            }
            // QPs on an SRQ that reached their last WQE are quiesced by the
            // next short poll; an SRQ none can take from any more hands its
            // receives back.
            let mut returned = 0;
            for cq in &mut self.cqs {
                cq.poller.check_async();
                returned += cq.poller.return_srq_receives(&mut self.out);
            }
            if returned > 0 {
                self.offer();
                continue;
            }
            if found == 0 || !self.out.is_empty() {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        }
        let left = self.how.drain_timeout.saturating_sub(started.elapsed());
        let how = CustomStop {
            drain_timeout: left,
            stop_timeout: self.how.stop_timeout,
        };
        let mut report = PollerReport {
            poller: self.metrics.snapshot(&self.name),
            cqs: Vec::new(),
            undelivered: 0,
            errors,
            accounts: Default::default(),
        };
        let mut pending = std::mem::take(&mut self.out);
        for cq in std::mem::take(&mut self.cqs) {
            let DrivenCq { poller, fd, .. } = cq;
            drop(fd);
            let r = poller.stop(&mut self.sink, &mut pending, how);
            report.cqs.extend(r.cqs);
            report.errors.extend(r.errors);
            report.accounts.accounts.extend(r.accounts.accounts);
            report.accounts.stuck.extend(r.accounts.stuck);
            report.accounts.timed_out |= r.accounts.timed_out;
        }
        report.accounts.waited = started.elapsed();
        // What the sink never took (left in `pending` by every CQ's stop)
        // goes back.
        report.undelivered = pending.len() as u64;
        let left: Vec<W> = pending.drain(..).map(|r| r.item).collect();
        if !hand_back(&self.name, left, self.give_back.take()) {
            report.errors.push(format!(
                "{}: the on_undelivered callback panicked",
                self.name
            ));
        }
        report
    }
}
