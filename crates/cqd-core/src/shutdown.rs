//! The shutdown protocol (docs/architecture.md, "Shutdown") as one call.
//!
//! 1. The application stops posting and runs `flush`: typically it moves
//!    every QP to the error state, so that each outstanding request comes
//!    back as a flush completion instead of being waited for.
//! 2. Every poller stops ([`PollerThread::stop`], or for a CQ driven by a
//!    loop of your own, the [`Stopper::custom`] you give, which typically
//!    ends the loop and returns its [`CqPoller::stop`](crate::cq::CqPoller::stop)).
//!    Each one polls until no
//!    handler has a request outstanding, or until its drain timeout passes.
//!    It then hands its spilled work to the workers (what they never take
//!    by its stop timeout goes back to the application through
//!    [`PollerBuilder::on_undelivered`](crate::poller::PollerBuilder::on_undelivered)
//!    and is named in the errors), acknowledges every
//!    event, destroys its CQs, and drops its sinks. Completion channels go
//!    with the CQs: on verbs the backend destroys each channel after its
//!    CQ.
//! 3. Every pool joins ([`Pool::join_timeout`]), all within one deadline
//!    ([`ShutdownOptions::pool_join_timeout`]). Its workers finish
//!    everything that was handed to them, then exit. A pool that does not
//!    close in time (a sink kept alive, a stuck work function) is reported
//!    in [`SystemReport::errors`], naming the live sinks and what is still
//!    queued, with its counters as they were; the call never hangs on it.
//! 4. The final report gathers every poller's report (CQ counters, and per
//!    handler and kind posted == completed + flushed, or exactly what is
//!    missing) with every pool's counters.
//!
//! Pollers stop before workers so that no work is handed to a worker that
//! has already gone.

use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::poller::{PollerReport, PollerThread};
use crate::pool::{Pool, PoolSnapshot};

/// One thing [`shutdown`]'s step 2 stops, each leaving a [`PollerReport`]:
/// a poller thread (`From<PollerThread>`, so a list of poller threads is
/// passed as it is), or a CQ driven by a loop of your own
/// ([`custom`](Self::custom)).
pub struct Stopper {
    name: String,
    stop: Box<dyn FnOnce() -> Result<PollerReport, String> + Send>,
}

impl std::fmt::Debug for Stopper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stopper").field("name", &self.name).finish()
    }
}

impl Stopper {
    /// A CQ (or group) driven by a loop of your own, named `name` in the
    /// report's errors: `stop` ends the loop (after `shutdown`'s flush) and
    /// returns its report, typically the loop thread's
    /// [`CqPoller::stop`](crate::cq::CqPoller::stop); an `Err` (the loop
    /// panicked, say) is one of the system report's errors.
    pub fn custom(
        name: impl Into<String>,
        stop: impl FnOnce() -> Result<PollerReport, String> + Send + 'static,
    ) -> Self {
        let name = name.into();
        let named = name.clone();
        Stopper {
            name,
            stop: Box::new(move || stop().map_err(|e| format!("{named}: {e}"))),
        }
    }

    /// A stop whose errors already name what failed (a poller thread's, the
    /// tokio driver's): they go into the report as they are.
    pub(crate) fn unprefixed(
        name: String,
        stop: impl FnOnce() -> Result<PollerReport, String> + Send + 'static,
    ) -> Self {
        Stopper {
            name,
            stop: Box::new(stop),
        }
    }

    /// The name the report's errors give it.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl From<PollerThread> for Stopper {
    fn from(poller: PollerThread) -> Self {
        Stopper::unprefixed(poller.name().to_string(), move || {
            poller.stop().map_err(|e| e.to_string())
        })
    }
}

/// Everything a stopped system leaves behind: one snapshot of every poller,
/// CQ and pool.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct SystemReport {
    /// Each poller's final report, in the order given.
    pub pollers: Vec<PollerReport>,
    /// Each pool's final counters, in the order given.
    pub pools: Vec<PoolSnapshot>,
    /// What went wrong while stopping: a poller or worker that died, a CQ
    /// that could not be destroyed, work that could not be handed over.
    pub errors: Vec<String>,
}

impl SystemReport {
    /// True when the shutdown found nothing wrong (no
    /// [`findings`](Self::findings)): every request was accounted for
    /// (completed or flushed), every work item was handed to a worker, no
    /// CQ overflowed (an overflow loses completions even when a later one
    /// retires what they covered), every completion reached the handler
    /// that posted it (no foreign or stale wr_id, no handler panic), and
    /// nothing failed while stopping.
    pub fn is_clean(&self) -> bool {
        self.findings().is_empty()
    }

    /// Everything the shutdown found wrong: its own errors, then each
    /// poller's [`findings`](PollerReport::findings).
    pub fn findings(&self) -> Vec<crate::verdict::Finding> {
        use crate::verdict::{Finding, FindingKind};
        let mut out: Vec<Finding> = self
            .errors
            .iter()
            .map(|e| Finding::new(FindingKind::Error, e.clone()))
            .collect();
        for p in &self.pollers {
            out.extend(p.findings());
        }
        for pool in self.pools.iter().filter(|p| p.panics() > 0) {
            out.push(Finding::new(
                FindingKind::WorkerPanic,
                format!(
                    "pool {}: {} work items panicked in their worker (caught; the item's work was lost)",
                    pool.name,
                    pool.panics()
                ),
            ));
        }
        out
    }
}

/// The form the demo prints: each poller (its CQs and accounts), each
/// pool, the shutdown's errors, then one verdict (`clean`, or each
/// finding).
impl std::fmt::Display for SystemReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for p in &self.pollers {
            p.fmt_body(f)?;
        }
        for pool in &self.pools {
            writeln!(f, "{pool}")?;
        }
        for e in &self.errors {
            writeln!(f, "error: {e}")?;
        }
        crate::verdict::verdict_lines(f, &self.findings())
    }
}

/// Settings of [`shutdown_with`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
#[non_exhaustive]
pub struct ShutdownOptions {
    /// How long step 3 may wait for all the pools together (default 10 s).
    pub pool_join_timeout: Duration,
}

impl Default for ShutdownOptions {
    fn default() -> Self {
        ShutdownOptions {
            pool_join_timeout: Duration::from_secs(10),
        }
    }
}

impl ShutdownOptions {
    /// The default options with `timeout` for step 3.
    pub fn pool_join_timeout(mut self, timeout: Duration) -> Self {
        self.pool_join_timeout = timeout;
        self
    }
}

/// Runs the shutdown protocol (see the module documentation) with the
/// default [`ShutdownOptions`].
pub fn shutdown(
    flush: impl FnOnce(),
    pollers: impl IntoIterator<Item = impl Into<Stopper>>,
    pools: impl IntoIterator<Item = Pool>,
) -> SystemReport {
    shutdown_with(ShutdownOptions::default(), flush, pollers, pools)
}

/// Runs the shutdown protocol (see the module documentation).
pub fn shutdown_with(
    options: ShutdownOptions,
    flush: impl FnOnce(),
    pollers: impl IntoIterator<Item = impl Into<Stopper>>,
    pools: impl IntoIterator<Item = Pool>,
) -> SystemReport {
    // 1. Stop posting, flush.
    flush();
    let mut report = SystemReport::default();
    // 2. Pollers first: drain, account, hand over, ack, destroy.
    for poller in pollers {
        let Stopper { name, stop } = poller.into();
        let name = name.as_str();
        match stop() {
            Ok(r) => {
                if r.undelivered > 0 {
                    report.errors.push(format!(
                        "poller {name}: {} work items never reached a worker \
                         (handed to its on_undelivered callback, if it has one)",
                        r.undelivered
                    ));
                }
                if !r.accounts.is_balanced() {
                    report.errors.push(format!("poller {name}: {}", r.accounts));
                }
                report.pollers.push(r);
            }
            Err(e) => report.errors.push(e),
        }
    }
    // 3. Then the workers: they finish what was handed to them, and join,
    //    all within one deadline.
    let started = Instant::now();
    for pool in pools {
        let left = options.pool_join_timeout.saturating_sub(started.elapsed());
        let monitor = pool.monitor();
        match pool.join_timeout(left) {
            Ok(s) => report.pools.push(s),
            Err(e) => {
                report.errors.push(e.to_string());
                report.pools.push(monitor.snapshot());
            }
        }
    }
    // 4. The report.
    if !report.is_clean() {
        let findings: Vec<String> = report.findings().iter().map(ToString::to_string).collect();
        tracing::error!(?findings, "shutdown found something wrong");
    }
    report
}
