//! The poller thread: owns a group of CQs, polls them in its mode, hands
//! work to a sink, and stops cleanly.
//!
//! # The loop
//!
//! 1. If a stop was requested, run the stop protocol (below) and exit.
//! 2. Poll one round, dispatching each completion to its handler
//!    (registrations are applied first): in Busy mode every CQ of the
//!    group, otherwise the active ones (those not quiet, see `mode`), plus
//!    the safety net's slice once per wake timeout. A CQ is polled again
//!    while it returns full batches, up to its round budget
//!    ([`CqOptions::round_budget`](crate::cq::CqOptions::round_budget)).
//!    If the spill is above its high-water mark, skip the polling: only
//!    offer the spill again (back-pressure, see
//!    [`PollerBuilder::spill_high_water_mark`]).
//! 3. Offer the work the handlers emitted — behind any earlier spill — to
//!    the sink; what it refuses stays in the spill queue (each item counted
//!    once).
//! 4. Check asynchronous events (overflow): of every CQ in Busy mode or
//!    after an asynchronous-event descriptor was ready, else of the active
//!    ones (the safety net checks the quiet ones, slice by slice). Outside
//!    Busy mode, look at the epoll set without blocking every 50 µs, so a
//!    quiet CQ that fired is not left waiting while others keep the poller
//!    busy.
//! 5. If the round found work, go to 1. If the spill is above its mark,
//!    wait for ring space (Busy mode: spin) and go to 1. Otherwise ask the
//!    mode: spin (go to 1; an idle Busy poller pauses, yields, then naps,
//!    see `mode`) or sleep ([`sleep_once`], the arm / re-poll /
//!    block protocol; with a spill the block also waits for ring space, see
//!    `poller::spill`). A source that fails (device gone) is counted and traced,
//!    and, if nothing else had work, the poller backs off for a tenth of the
//!    wake timeout instead of spinning on errors.
//!
//! # Stopping
//!
//! The shutdown protocol (docs/architecture.md, "Shutdown"), the poller's part. Before it, the
//! application stops posting and, to finish fast, moves its QPs to the
//! error state so that everything outstanding is flushed
//! ([`PollerThread::stop_with`] runs that step).
//!
//! 1. Apply pending registrations; poll every CQ until each is empty.
//! 2. Keep polling until no handler has a request outstanding (posted and
//!    not completed, flushes included), or [`PollerBuilder::drain_timeout`]
//!    passes; the report then names what is missing and, with a
//!    [`WrLedger`](crate::ledger::WrLedger) attached, each stuck request.
//! 3. Hand every spilled item to the sink, waiting for space (workers stop
//!    after pollers, so they are still draining); give up only after
//!    [`PollerBuilder::stop_timeout`], handing what is left back
//!    ([`PollerBuilder::on_undelivered`]) and reporting how many.
//! 4. Take and acknowledge every notification.
//! 5. Destroy every CQ (which fails, rather than hangs, on unacked events).
//!
//! Workers are drained and joined after the pollers (see `pool`).

mod arrive;
mod ready;
mod spill;

#[cfg(feature = "tokio")]
pub(crate) use spill::hand_back;

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cq::GroupBell;
use crate::cq::{CqPoller, UnboundCq};
use crate::metrics::{bump, CqSnapshot, PollerMetrics, PollerSnapshot};
pub use crate::mode::MIN_WAKE_TIMEOUT;
use crate::mode::{sleep_once, Idle, IdlePolicy, PollMode};
use crate::sink::{Routed, WorkSink};
use crate::sync::{AtomicBool, Ordering};
use crate::sys::thread_cpu_time;
use crate::thread::{start, StartError, ThreadHandle};
pub(crate) use arrive::{hand_over, joiner, AnyArrivals, Arrivals, ARRIVAL};
pub use arrive::{CqJoiner, JoinError, Joining, NotJoined};
use ready::Readiness;
pub use spill::DEFAULT_SPILL_HIGH_WATER_MARK;
use spill::{GiveBack, Spill};

/// Acknowledge notifications once this many are pending.
pub const DEFAULT_ACK_BATCH: u32 = 16;
/// The safety-net timeout of a sleep.
pub const DEFAULT_WAKE_TIMEOUT: Duration = Duration::from_millis(100);

type Setup = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// Builds a poller thread.
pub struct PollerBuilder<W, S> {
    name: String,
    mode: PollMode,
    wake_timeout: Duration,
    ack_batch: u32,
    stop_timeout: Duration,
    drain_timeout: Duration,
    watchdog: Option<Duration>,
    cqs: Vec<UnboundCq<W>>,
    sink: S,
    setup: Option<Setup>,
    spill_mark: usize,
    give_back: Option<GiveBack<W>>,
    busy_naps: bool,
    /// The group may start with no CQ ([`PollerBuilder::starts_empty`]).
    starts_empty: bool,
    /// The topology's assignment, when the builder comes from a plan.
    assigned: Option<Assignment>,
}

impl<W, S> std::fmt::Debug for PollerBuilder<W, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PollerBuilder")
            .field("name", &self.name)
            .field("mode", &self.mode)
            .field("cqs", &self.cqs.len())
            .finish()
    }
}

impl<W: Send + 'static, S: WorkSink<W> + 'static> PollerBuilder<W, S> {
    /// A poller named `name` (the thread is named `cqd-poller-<name>`)
    /// handing work to `sink`, in the default (Adaptive) mode.
    pub fn new(name: impl Into<String>, sink: S) -> Self {
        PollerBuilder {
            name: name.into(),
            mode: PollMode::default(),
            wake_timeout: DEFAULT_WAKE_TIMEOUT,
            ack_batch: DEFAULT_ACK_BATCH,
            stop_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(5),
            watchdog: None,
            cqs: Vec::new(),
            sink,
            setup: None,
            spill_mark: DEFAULT_SPILL_HIGH_WATER_MARK,
            give_back: None,
            busy_naps: true,
            starts_empty: false,
            assigned: None,
        }
    }

    /// Lets the group start with no CQ (`true`): it then takes all its
    /// CQs at run time ([`PollerThread::add_cq`], a
    /// [`CqPool`](crate::CqPool) growing onto it). Off by default: a group
    /// spawned with no CQ is refused ([`PollerError::NoCq`]), the usual
    /// sign of a CQ left out.
    pub fn starts_empty(mut self, on: bool) -> Self {
        self.starts_empty = on;
        self
    }

    /// Holds the builder to a topology's assignment (set by
    /// [`PollerPlan::poller_builder`](crate::topology::PollerPlan::poller_builder)).
    pub(crate) fn assigned(mut self, a: Assignment) -> Self {
        self.assigned = Some(a);
        self
    }

    /// The poll mode.
    pub fn mode(mut self, mode: PollMode) -> Self {
        self.mode = mode;
        self
    }

    /// Busy mode: whether an idle poller naps (default on: after 100 µs
    /// with nothing found it sleeps 10 µs to 1 ms at a time, so that other
    /// threads on its CPU run, at the cost of up to a nap's latency for the
    /// first completion after a quiet spell; see [`crate::mode`]). Turn it
    /// off only for a poller pinned alone on its core: it then pauses and
    /// yields, never sleeps. Other modes ignore it.
    pub fn busy_naps(mut self, on: bool) -> Self {
        self.busy_naps = on;
        self
    }

    /// The safety-net timeout of a sleep (default 100 ms). Below
    /// [`MIN_WAKE_TIMEOUT`] [`spawn`](Self::spawn) refuses it
    /// ([`PollerError::WakeTimeout`]) rather than quietly using another
    /// value.
    pub fn wake_timeout(mut self, t: Duration) -> Self {
        self.wake_timeout = t;
        self
    }

    /// Acknowledge notifications in batches of this many (default 16).
    pub fn ack_batch(mut self, n: u32) -> Self {
        self.ack_batch = n.max(1);
        self
    }

    /// How long a stop may retry handing spilled work to the sink.
    pub fn stop_timeout(mut self, t: Duration) -> Self {
        self.stop_timeout = t;
        self
    }

    /// How long a stop waits for outstanding requests to complete (step 2
    /// of "Stopping"; default 5 s).
    pub fn drain_timeout(mut self, t: Duration) -> Self {
        self.drain_timeout = t;
        self
    }

    /// Reports requests outstanding longer than `threshold`: once per wake
    /// timeout (in every mode), the poller scans the
    /// [`WrLedger`](crate::ledger::WrLedger)s attached to its CQs; each
    /// stuck request is traced once (handler, QP, wr_id) and counted.
    pub fn watchdog(mut self, threshold: Duration) -> Self {
        self.watchdog = Some(threshold);
        self
    }

    /// Adds a CQ to the group. Takes it by value: the poller thread binds
    /// it, and nobody else can poll it afterwards.
    pub fn cq(mut self, cq: UnboundCq<W>) -> Self {
        self.cqs.push(cq);
        self
    }

    /// Runs `f` first thing on the new thread (CPU pinning, priority); an
    /// error aborts the spawn and is returned by [`spawn`](Self::spawn).
    /// Hooks add up: each runs after those set before it (a plan's builder
    /// places and prioritises its thread first, then runs yours).
    pub fn on_start(mut self, f: impl FnOnce() -> Result<(), String> + Send + 'static) -> Self {
        self.setup = Some(match self.setup.take() {
            None => Box::new(f),
            Some(first) => Box::new(move || first().and_then(|()| f())),
        });
        self
    }

    /// Starts the thread.
    ///
    /// # Errors
    /// [`PollerError::NoCq`] for an empty group (unless it
    /// [`starts_empty`](Self::starts_empty)), [`PollerError::Spawn`] if
    /// the OS refuses a thread, [`PollerError::Setup`] if the `on_start`
    /// hook fails; for a builder from a topology's plan,
    /// [`PollerError::NotAssigned`] / [`PollerError::NotAttached`] when its
    /// CQs are not the ones the topology gives it. A refused spawn drops
    /// its CQs (which finishes them).
    pub fn spawn(self) -> Result<PollerThread, PollerError> {
        if self.cqs.is_empty() && !self.starts_empty {
            return Err(PollerError::NoCq { poller: self.name });
        }
        if let Some(a) = &self.assigned {
            a.check(&self.name, self.cqs.iter().map(UnboundCq::name))?;
        }
        if self.wake_timeout < MIN_WAKE_TIMEOUT {
            return Err(PollerError::WakeTimeout {
                poller: self.name,
                given: self.wake_timeout,
                min: MIN_WAKE_TIMEOUT,
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let metrics = Arc::new(PollerMetrics::default());
        // One doorbell for the whole group, and the epoll sets, made here so
        // that a failure is the spawn's error.
        let os = |op: &'static str| {
            let poller = self.name.clone();
            move |source| PollerError::Os { poller, op, source }
        };
        let doorbell = Arc::new(GroupBell::new().map_err(os("eventfd"))?);
        let sources: Vec<&dyn crate::source::CompletionSource> =
            self.cqs.iter().map(UnboundCq::source).collect();
        let readiness = Readiness::new(&sources, Arc::clone(&doorbell)).map_err(os("epoll"))?;
        drop(sources);
        let name = self.name.clone();
        let group_name = self.name.clone();
        let arrivals = Arrivals::<W>::new(&self.name, Arc::clone(&doorbell));
        let group_arrivals = Arc::clone(&arrivals);
        let cqs = self.cqs;
        let group_doorbell = Arc::clone(&doorbell);
        let (group_metrics, group_stop) = (Arc::clone(&metrics), Arc::clone(&stop));
        let group = move |cqs: Vec<CqPoller<W>>| Group {
            name: group_name,
            idle: {
                let idle = IdlePolicy::new(self.mode, Instant::now());
                if self.busy_naps {
                    idle
                } else {
                    idle.without_naps()
                }
            },
            cqs,
            sink: self.sink,
            spill: Spill::new(self.spill_mark, self.give_back),
            metrics: group_metrics,
            wake_timeout: self.wake_timeout,
            ack_batch: self.ack_batch,
            stop_timeout: self.stop_timeout,
            drain_timeout: self.drain_timeout,
            watchdog: self.watchdog,
            stop: group_stop,
            ready: readiness,
            failing: false,
            sleep_failures: 0,
            sleep_cpu_end: None,
            last_scan: Instant::now(),
            slow_threshold: None,
            round_from: None,
            arrivals: group_arrivals,
        };
        let setup = self.setup;
        // The one start-up handshake: returns once `on_start` ran on the new
        // thread. The CQs are bound there, after it, on the thread that polls
        // them; on failure they are dropped there (which finishes them).
        let join = start(
            format!("cqd-poller-{}", self.name),
            move || setup.map_or(Ok(()), |setup| setup()),
            move || {
                let bind = |(i, cq): (usize, UnboundCq<W>)| {
                    let mut cq = cq.bind();
                    cq.install_doorbell(Arc::clone(&group_doorbell), i);
                    cq
                };
                group(cqs.into_iter().enumerate().map(bind).collect()).run()
            },
        )
        .map_err(|e| match e {
            StartError::Spawn(source) => PollerError::Spawn {
                poller: name.clone(),
                source,
            },
            StartError::Setup(reason) => PollerError::Setup {
                poller: name.clone(),
                reason,
            },
            StartError::SetupPanicked => PollerError::Setup {
                poller: name.clone(),
                reason: "on_start panicked".into(),
            },
        })?;
        Ok(PollerThread {
            name,
            stop,
            doorbell,
            metrics,
            arrivals,
            join: Some(join),
        })
    }
}

/// What a topology assigns one poller (`topology::PollerPlan` makes it):
/// its CQs, checked at its spawn against the CQs attached to it.
#[derive(Debug, Clone)]
pub(crate) struct Assignment {
    pub(crate) cqs: Vec<String>,
    /// Every CQ of the topology and its poller, to name the right one.
    pub(crate) owners: Arc<BTreeMap<String, String>>,
}

impl Assignment {
    /// The first disagreement between the CQs attached to `poller` and
    /// what the topology assigns it.
    pub(crate) fn check<'a>(
        &self,
        poller: &str,
        attached: impl Iterator<Item = &'a str> + Clone,
    ) -> Result<(), PollerError> {
        for cq in attached.clone() {
            if !self.cqs.iter().any(|c| c == cq) {
                return Err(PollerError::NotAssigned {
                    poller: poller.to_string(),
                    cq: cq.to_string(),
                    owner: self.owners.get(cq).cloned(),
                });
            }
        }
        for cq in &self.cqs {
            if !attached.clone().any(|a| a == cq) {
                return Err(PollerError::NotAttached {
                    poller: poller.to_string(),
                    cq: cq.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Errors of poller threads.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PollerError {
    /// A poller needs at least one CQ.
    #[error("poller {poller} has no CQ")]
    NoCq {
        /// The poller.
        poller: String,
    },
    /// A CQ was attached to a poller that its topology does not give it to.
    #[error("CQ {cq:?} attached to poller {poller:?}, but {}",
        .owner.as_ref().map_or_else(|| "the topology has no CQ of that name".to_string(),
            |o| format!("the topology gives it to poller {o:?}")))]
    NotAssigned {
        /// The poller it was attached to.
        poller: String,
        /// The CQ.
        cq: String,
        /// The poller the topology gives the CQ to, if any.
        owner: Option<String>,
    },
    /// A CQ on a completion channel shared with other CQs was given to the
    /// tokio driver, which waits on each CQ's own descriptor (a poller
    /// thread reads a shared channel once for all its CQs).
    #[error("driver {poller}: CQ {cq:?} notifies through a completion channel shared with other CQs; give it a poller thread")]
    SharedChannel {
        /// The driver.
        poller: String,
        /// The CQ.
        cq: String,
    },
    /// A CQ the topology gives a poller was not attached to it (its
    /// completions would never be polled).
    #[error("poller {poller:?}: the topology gives it CQ {cq:?}, which was not attached")]
    NotAttached {
        /// The poller.
        poller: String,
        /// The CQ left out.
        cq: String,
    },
    /// The wake timeout is below what the poller can honour.
    #[error("poller {poller}: wake timeout {given:?} is below the minimum {min:?}")]
    WakeTimeout {
        /// The poller.
        poller: String,
        /// The timeout asked for.
        given: Duration,
        /// The smallest timeout a poller honours.
        min: Duration,
    },
    /// The poller's doorbell or epoll set could not be made.
    #[error("poller {poller}: {op} failed: {source}")]
    Os {
        /// The poller.
        poller: String,
        /// What was being made.
        op: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The OS refused a thread.
    #[error("could not spawn poller {poller}: {source}")]
    Spawn {
        /// The poller.
        poller: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The `on_start` hook failed (for example a CPU pin).
    #[error("poller {poller} failed to start: {reason}")]
    Setup {
        /// The poller.
        poller: String,
        /// What the hook said.
        reason: String,
    },
    /// The poller thread panicked (a bug in cqd: handler panics are caught).
    #[error("poller {poller} panicked")]
    Panicked {
        /// The poller.
        poller: String,
    },
}

/// A running poller thread. Dropping it stops it (discarding the report).
#[derive(Debug)]
pub struct PollerThread {
    name: String,
    stop: Arc<AtomicBool>,
    doorbell: Arc<GroupBell>,
    metrics: Arc<PollerMetrics>,
    /// CQs joining the running group (`poller::arrive`).
    arrivals: AnyArrivals,
    join: Option<ThreadHandle<PollerReport>>,
}

impl PollerThread {
    /// The poller's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A copy of the thread's counters.
    pub fn snapshot(&self) -> PollerSnapshot {
        self.metrics.snapshot(&self.name)
    }

    /// A cloneable, `Sync` handle to the thread's counters, for a metrics
    /// thread. It outlives the thread: after the stop it reads the final
    /// counters.
    pub fn monitor(&self) -> PollerMonitor {
        PollerMonitor {
            name: self.name.clone(),
            metrics: Arc::clone(&self.metrics),
        }
    }

    /// Stops the thread (see "Stopping" in the module documentation) and
    /// returns its final report.
    ///
    /// # Errors
    /// [`PollerError::Panicked`] if the thread died.
    pub fn stop(mut self) -> Result<PollerReport, PollerError> {
        self.request_stop();
        let join = self.join.take();
        match join.map(ThreadHandle::join) {
            Some(Ok(report)) => Ok(report),
            _ => Err(PollerError::Panicked {
                poller: self.name.clone(),
            }),
        }
    }

    /// Runs `flush` (the application's "move every QP to the error state"
    /// step, after it stopped posting), then stops as [`stop`](Self::stop)
    /// does: the poller collects every flush before it reports.
    ///
    /// # Errors
    /// [`PollerError::Panicked`] if the thread died.
    pub fn stop_with(self, flush: impl FnOnce()) -> Result<PollerReport, PollerError> {
        flush();
        self.stop()
    }

    fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
        self.doorbell.ring();
    }

    /// Adds a CQ to the running poller, in whatever mode it runs: the
    /// poller registers its notifications, binds it on its own thread and
    /// polls it from its next round (`poller::arrive`). The CQ's name must
    /// be new to the poller. Wait on the [`Joining`] (or await it) to know
    /// that it is polled; register handlers and post through its
    /// `CqHandle` before or after.
    ///
    /// # Errors
    /// With the CQ back: the poller has stopped ([`JoinError::Ended`]), or
    /// the CQ's work type is not the poller's ([`JoinError::WorkType`]).
    /// The `Joining` reports the rest.
    pub fn add_cq<W: Send + 'static>(&self, cq: UnboundCq<W>) -> Result<Joining, NotJoined<W>> {
        hand_over(&self.arrivals, &self.name, cq)
    }

    /// A handle that adds CQs to this group from anywhere (a CQ pool's),
    /// if `W` is its work type.
    pub fn joiner<W: Send + 'static>(&self) -> Option<CqJoiner<W>> {
        joiner(&self.arrivals)
    }
}

impl Drop for PollerThread {
    fn drop(&mut self) {
        if let Some(join) = self.join.take() {
            self.request_stop();
            let _ = join.join();
        }
    }
}

/// A read-only handle to a poller thread's counters
/// ([`PollerThread::monitor`]); cheap to clone.
#[derive(Debug, Clone)]
pub struct PollerMonitor {
    name: String,
    metrics: Arc<PollerMetrics>,
}

impl PollerMonitor {
    /// The poller's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The counters now.
    pub fn snapshot(&self) -> PollerSnapshot {
        self.metrics.snapshot(&self.name)
    }
}

/// What a stopped poller leaves behind.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
#[non_exhaustive]
pub struct PollerReport {
    /// The thread's counters.
    pub poller: PollerSnapshot,
    /// Each CQ's final counters.
    pub cqs: Vec<CqSnapshot>,
    /// Work items the sink never took (0 unless the stop timed out); they
    /// went to [`PollerBuilder::on_undelivered`] if one was set.
    pub undelivered: u64,
    /// Errors met while stopping (acknowledging or destroying a CQ).
    pub errors: Vec<String>,
    /// Per handler and kind: posted, completed and flushed requests, or
    /// exactly what is missing (step 2 of "Stopping").
    pub accounts: crate::ledger::ShutdownReport,
}

impl PollerReport {
    /// Everything this stop found wrong ([`crate::verdict`]): errors,
    /// requests missing, undelivered work, and each CQ's overflows,
    /// foreign and stale wr_ids, unknown statuses and opcodes, handler
    /// panics, failed polls — each naming its CQ, QP and handler.
    pub fn findings(&self) -> Vec<crate::verdict::Finding> {
        use crate::verdict::{Finding, FindingKind};
        let name = format!("poller {}", self.poller.name);
        let mut out: Vec<Finding> = self
            .errors
            .iter()
            .map(|e| Finding::new(FindingKind::Error, format!("{name}: {e}")))
            .collect();
        crate::verdict::of_accounts(&self.accounts, &name, &mut out);
        if self.undelivered > 0 {
            out.push(Finding::new(
                FindingKind::Undelivered,
                format!(
                    "{name}: {} work items the sink never took",
                    self.undelivered
                ),
            ));
        }
        for c in &self.cqs {
            crate::verdict::of_cq(c, &mut out);
        }
        out
    }

    /// True when the stop found nothing wrong (no [`findings`](Self::findings)).
    pub fn is_clean(&self) -> bool {
        self.findings().is_empty()
    }
}

impl PollerReport {
    /// The report's lines without the verdict (the system report prints
    /// one verdict for all).
    pub(crate) fn fmt_body(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.poller;
        let completions: u64 = self.cqs.iter().map(|c| c.completions).sum();
        let polls: u64 = self.cqs.iter().map(|c| c.polls).sum();
        let empty: u64 = self.cqs.iter().map(|c| c.empty_polls).sum();
        let events: u64 = self.cqs.iter().map(|c| c.events).sum();
        writeln!(
            f,
            "poller {}: {completions} completions, {polls} polls ({empty} empty), {events} events, {} sleeps, {} spills, cpu {:.3} s",
            p.name,
            p.sleeps,
            p.spills,
            p.cpu_ns as f64 / 1e9
        )?;
        for c in &self.cqs {
            crate::verdict::cq_line(f, c)?;
        }
        let accounts = self.accounts.to_string();
        let mut lines = accounts.lines();
        if let Some(first) = lines.next() {
            writeln!(f, "  accounts: {first}")?;
        }
        for l in lines {
            writeln!(f, "  {l}")?;
        }
        if self.undelivered > 0 {
            writeln!(f, "  undelivered: {}", self.undelivered)?;
        }
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        Ok(())
    }
}

/// The form the demo prints: the poller's counters, one line per CQ, the
/// accounts, then the verdict (`clean`, or each finding).
impl std::fmt::Display for PollerReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.fmt_body(f)?;
        crate::verdict::verdict_lines(f, &self.findings())
    }
}

struct Group<W, S> {
    /// The poller's name, as given to its builder (its reports' name).
    name: String,
    idle: IdlePolicy,
    cqs: Vec<CqPoller<W>>,
    sink: S,
    spill: Spill<W>,
    metrics: Arc<PollerMetrics>,
    wake_timeout: Duration,
    ack_batch: u32,
    stop_timeout: Duration,
    drain_timeout: Duration,
    watchdog: Option<Duration>,
    stop: Arc<AtomicBool>,
    ready: Readiness,
    failing: bool,
    sleep_failures: u64,
    /// The thread's CPU time when a sleep's wake-up started its poll round
    /// (step 5 of the sleep protocol).
    sleep_cpu_end: Option<Duration>,
    last_scan: Instant,
    /// The smallest slow threshold of the group's CQs
    /// ([`CqOptions::slow_batch`](crate::CqOptions::slow_batch)).
    slow_threshold: Option<Duration>,
    /// The clock the loop read after the last round, if the loop went on
    /// to the next round with no more than a spin between (not after a
    /// sleep or a nap): the clock it reads anyway then times each round,
    /// and a round past the slow threshold has its CQs' next batches
    /// timed. (A yield in the spin may count towards the round: that costs
    /// one timed batch, which judges by its own clock.)
    round_from: Option<Instant>,
    /// CQs handed over to join the group (`poller::arrive`).
    arrivals: Arc<Arrivals<W>>,
}

impl<W: Send + 'static, S: WorkSink<W>> Group<W, S> {
    fn run(mut self) -> PollerReport {
        let name = self.metrics_name();
        let _span =
            tracing::debug_span!("poller", name = %name, mode = self.idle.mode().name()).entered();
        self.install_space_waker();
        self.slow_threshold = self.cqs.iter().filter_map(CqPoller::slow_threshold).min();
        loop {
            let m = &self.metrics.0;
            bump(&m.loops, 1);
            // 1. Stop?
            if self.stop.load(Ordering::Acquire) {
                break;
            }
            // 2. One round (or, above the mark, a hand-off only).
            let found = self.round();
            // 3. Hand off (inside round) and 4. async events (a CQ that
            //    took an SRQ user's last WQE is polled again at once:
            //    `ledger::teardown`, step 3).
            if self.check_async() {
                continue;
            }
            // 5. Work, spin or sleep (or back off from a failing device).
            if std::mem::take(&mut self.failing) && found == 0 {
                self.back_off();
                continue;
            }
            let now = Instant::now();
            if let Some(prev) = self.round_from.take() {
                if found > 0 && self.slow_threshold.is_some_and(|t| now - prev > t) {
                    self.slow_round(now - prev);
                }
            }
            self.check_ready(now);
            if self.watchdog.is_some()
                && now.saturating_duration_since(self.last_scan) >= self.wake_timeout
            {
                self.scan_ledgers(now);
            }
            if found > 0 {
                self.idle.on_work(now, found);
                self.round_from = Some(now);
                continue;
            }
            if self.spill.above_mark() {
                self.throttled();
                continue;
            }
            match self.idle.on_idle(now) {
                Idle::Spin => {
                    let napped = self.idle.idle_spin();
                    let spun = now.elapsed().saturating_sub(napped);
                    bump(&self.metrics.0.spin_ns, spun.as_nanos() as u64);
                    if napped.is_zero() {
                        self.round_from = Some(now);
                    } else {
                        // An idle Busy poller napped (`mode`, "Busy mode when
                        // nothing comes").
                        bump(&self.metrics.0.naps, 1);
                        self.record_cpu();
                    }
                }
                Idle::Sleep => self.sleep(),
            }
            self.metrics
                .0
                .spin_window_ns
                .store(self.idle.window().as_nanos() as u64, Ordering::Relaxed);
        }
        // `poller::arrive` step 3: no CQ joins any more; those queued are
        // finished and told.
        self.arrivals.end();
        self.shutdown()
    }

    /// `poller::arrive` step 2: the CQs handed over join, each last and
    /// active.
    #[cold]
    fn join_arrivals(&mut self) {
        for (cq, answer) in self.arrivals.take() {
            let name = cq.name().to_string();
            let poller = self.name.clone();
            if self.cqs.iter().any(|c| c.name() == name) {
                drop(cq);
                answer.answer(Err(JoinError::Duplicate { poller, cq: name }));
                continue;
            }
            let i = self.cqs.len();
            if let Err(e) = self.ready.add(i, cq.source()) {
                drop(cq);
                answer.answer(Err(JoinError::Os {
                    poller,
                    cq: name,
                    reason: e.to_string(),
                }));
                continue;
            }
            let mut cq = cq.bind();
            cq.install_doorbell(self.ready.doorbell(), i);
            if let Some(t) = cq.slow_threshold() {
                self.slow_threshold = Some(self.slow_threshold.map_or(t, |s| s.min(t)));
            }
            tracing::debug!(poller = %self.name, cq = %name, index = i, "CQ joined");
            self.cqs.push(cq);
            answer.answer(Ok(()));
        }
    }

    /// A round that found work took longer than the smallest slow
    /// threshold: each CQ past its own times its next batch.
    #[cold]
    #[inline(never)]
    fn slow_round(&mut self, took: Duration) {
        for cq in &mut self.cqs {
            cq.round_took(took);
        }
    }

    fn metrics_name(&self) -> String {
        self.name.clone()
    }

    /// One batch from every CQ, then the hand-off — unless the spill is
    /// above its mark, when the round only hands off (back-pressure: the
    /// bound of `poller::spill` rests on this check).
    fn round(&mut self) -> usize {
        if self.spill.above_mark() {
            self.hand_off();
            if self.spill.above_mark() {
                return 0;
            }
        }
        self.poll_all()
    }

    /// A source is failing (device gone) and nothing else had work: do not
    /// spin on errors, in any mode. Wait a tenth of the safety timeout
    /// (1–10 ms) unless a doorbell (stop, control request) rings.
    fn back_off(&mut self) {
        bump(&self.metrics.0.backoffs, 1);
        let pause = self.retry_pause();
        if self.back_off_on_events(pause).is_err() {
            std::thread::sleep(pause);
        }
    }

    fn sleep(&mut self) {
        // The sleep cycle's cost in CPU time (arming, the block and the
        // wake-up in the kernel, collecting the notifications), for
        // Adaptive; it ends where the poll after the wake-up starts.
        let cpu_before = thread_cpu_time();
        self.sleep_cpu_end = None;
        let timeout = self.wake_timeout;
        self.spill.skipped_block = false;
        let slept = match sleep_once(self, timeout) {
            Ok(s) => s,
            Err(e) => {
                // Traced at 1, 2, 4, 8… failures, as poll errors are.
                self.sleep_failures += 1;
                if self.sleep_failures.is_power_of_two() {
                    tracing::error!(error = %e, failures = self.sleep_failures,
                        "sleep protocol failed; backing off");
                }
                self.failing = true;
                return;
            }
        };
        let mut slept = slept;
        if std::mem::take(&mut self.spill.skipped_block) {
            // Arming the space wait found space: nothing was blocked on.
            slept.blocked = false;
        }
        let m = &self.metrics.0;
        if slept.blocked {
            bump(&m.sleeps, 1);
            if slept.timed_out {
                bump(&m.timeouts, 1);
            }
        }
        let cpu_after = self.record_cpu();
        let cpu_end = self.sleep_cpu_end.take().unwrap_or(cpu_after);
        self.idle
            .on_sleep_overhead(Instant::now(), cpu_end.saturating_sub(cpu_before));
        let found = slept.found + slept.repoll_found;
        if found > 0 {
            self.idle.on_work(Instant::now(), found);
        }
    }

    /// The watchdog: at most once per wake timeout, in every mode.
    fn scan_ledgers(&mut self, now: Instant) {
        self.last_scan = now;
        if let Some(threshold) = self.watchdog {
            for cq in &self.cqs {
                if let Some(l) = cq.shared().ledger.get() {
                    l.watch(now, threshold);
                }
            }
        }
    }

    /// Publishes the thread's CPU time, and returns it.
    fn record_cpu(&self) -> Duration {
        let cpu = thread_cpu_time();
        self.metrics
            .0
            .cpu_ns
            .store(cpu.as_nanos() as u64, Ordering::Relaxed);
        cpu
    }

    fn shutdown(mut self) -> PollerReport {
        self.record_cpu();
        // 1. Drain every CQ to empty.
        for cq in &mut self.cqs {
            cq.apply_commands();
        }
        let deadline = Instant::now() + self.stop_timeout;
        while self.poll_every_cq() > 0 && Instant::now() < deadline {}
        // 2. Wait for every outstanding request (flushes included).
        let started = Instant::now();
        let mut timed_out = false;
        while self.cqs.iter().map(CqPoller::outstanding).sum::<u64>() > 0 {
            if started.elapsed() >= self.drain_timeout {
                timed_out = true;
                break;
            }
            // QPs on an SRQ that reached their last WQE are quiesced by the
            // next short poll; an SRQ none can take from any more hands its
            // receives back.
            self.check_async_all();
            if self.poll_every_cq() == 0 && self.return_srq_receives() == 0 {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        let mut accounts = crate::ledger::ShutdownReport::default();
        for cq in &self.cqs {
            let r = cq.accounts();
            accounts.accounts.extend(r.accounts);
            accounts.stuck.extend(r.stuck);
        }
        accounts.waited = started.elapsed();
        accounts.timed_out = timed_out;
        if !accounts.is_balanced() {
            tracing::error!(report = %accounts, "stop: requests unaccounted for");
        }
        // 3. Hand every spilled item over, waiting for space while workers
        //    drain; hand back what is left.
        //    The hand-over has its own stop_timeout: a drain that timed out
        //    must not leave it no time at all.
        let undelivered = self.flush_spill(Instant::now() + self.stop_timeout);
        let mut report = self.report_now();
        report.accounts = accounts;
        report.undelivered = undelivered;
        // 4 and 5. Acknowledge everything, destroy every CQ.
        for cq in &mut self.cqs {
            if let Err(e) = cq.finish() {
                report.errors.push(format!("{}: {e}", cq.name()));
            }
        }
        // Final counters after the acks.
        report.cqs = self.cqs.iter().map(|c| c.handle().snapshot()).collect();
        report
    }

    fn report_now(&self) -> PollerReport {
        PollerReport {
            poller: self.metrics.snapshot(&self.metrics_name()),
            cqs: self.cqs.iter().map(|c| c.handle().snapshot()).collect(),
            undelivered: self.spill.items.len() as u64,
            errors: Vec::new(),
            accounts: Default::default(),
        }
    }
}

/// How a CQ driven by a loop of your own stops ([`CqPoller::stop`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CustomStop {
    /// How long to wait for outstanding requests (completions and flushes).
    pub drain_timeout: Duration,
    /// How long to keep offering the drained work to the sink.
    pub stop_timeout: Duration,
}

impl Default for CustomStop {
    fn default() -> Self {
        CustomStop {
            drain_timeout: Duration::from_secs(5),
            stop_timeout: Duration::from_secs(10),
        }
    }
}

impl<W: Send + 'static> CqPoller<W> {
    /// Stops a CQ driven by a loop of your own the way a poller thread stops
    /// its CQs, and reports it as one: applies pending registrations, polls
    /// until no handler has a request outstanding (flushes included) or
    /// `how.drain_timeout` passes, takes the accounts, offers `pending`
    /// (your loop's work not yet handed on) and all work the drain emits to
    /// `sink` until it is taken or `how.stop_timeout` passes, acknowledges
    /// every event and destroys the CQ.
    ///
    /// The report's poller is named after the CQ. Work the sink never took
    /// stays in `pending`, in its order, for you to fail explicitly (as a
    /// poller thread gives it to
    /// [`PollerBuilder::on_undelivered`](crate::PollerBuilder::on_undelivered)),
    /// and is counted in [`PollerReport::undelivered`] (a finding): nothing
    /// is dropped here. Hand the report to [`shutdown`](crate::shutdown())
    /// through [`Stopper::custom`](crate::shutdown::Stopper::custom), so
    /// that the system report covers this CQ too.
    pub fn stop<S: WorkSink<W>>(
        mut self,
        sink: &mut S,
        pending: &mut VecDeque<Routed<W>>,
        how: CustomStop,
    ) -> PollerReport {
        self.apply_commands();
        let started = Instant::now();
        let mut timed_out = false;
        let mut errors = Vec::new();
        loop {
            let n = match self.poll_once(pending) {
                Ok(n) => n,
                Err(e) => {
                    errors.push(format!("{}: poll: {e}", self.name()));
                    break;
                }
            };
            sink.offer(pending);
            if n > 0 {
                continue;
            }
            if self.outstanding() == 0 {
                break;
            }
            self.check_async();
            if self.return_srq_receives(pending) > 0 {
                sink.offer(pending);
                continue;
            }
            if started.elapsed() >= how.drain_timeout {
                timed_out = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        let mut accounts = self.accounts();
        accounts.waited = started.elapsed();
        accounts.timed_out = timed_out;
        if !accounts.is_balanced() {
            tracing::error!(cq = %self.name(), report = %accounts, "stop: requests unaccounted for");
        }
        let deadline = Instant::now() + how.stop_timeout;
        while !pending.is_empty() && Instant::now() < deadline {
            sink.offer(pending);
            if !pending.is_empty() {
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        let undelivered = pending.len() as u64;
        if undelivered > 0 {
            tracing::error!(cq = %self.name(), undelivered,
                "stop: work the sink never took, left to the caller");
        }
        let name = self.name().to_string();
        let handle = self.handle();
        if let Err(e) = self.finish() {
            errors.push(format!("{name}: {e}"));
        }
        PollerReport {
            poller: PollerMetrics::default().snapshot(&name),
            cqs: vec![handle.snapshot()],
            undelivered,
            errors,
            accounts,
        }
    }
}
