//! cqd's counters through the [`metrics`] facade (feature
//! `metrics`), so that Prometheus or any other recorder shows them.
//!
//! The hot path does not change: CQs, pollers and pools keep their
//! owner-written relaxed counters, and nothing in the poll loop calls the
//! facade. A [`MetricsExporter`] *samples* their snapshots
//! ([`CqHandle::snapshot`], [`PollerMonitor::snapshot`],
//! [`PoolMonitor::snapshot`], the CQ's ledger) and publishes them under
//! stable names and labels — on demand ([`MetricsExporter::publish`]) or
//! from its own thread every period ([`MetricsExporter::spawn`]). Every
//! name, its type, labels and meaning, and which ones to alert on, is in
//! `docs/metrics.md`; [`catalog`] lists them in code.
//!
//! ```
//! use std::time::Duration;
//! use cqd_core::export::MetricsExporter;
//!
//! // Install a recorder first (a Prometheus exporter, say), then:
//! let exporter = MetricsExporter::new();
//! // exporter.add_cq(&handle)?; exporter.add_poller(&thread)?; exporter.add_pool(&pool)?;
//! let thread = exporter.spawn(Duration::from_secs(1))?;
//! // … later: one last publication, then the thread exits.
//! thread.stop();
//! # Ok::<(), cqd_core::export::ExportError>(())
//! ```
//!
//! # How values are published
//!
//! - Counters are cumulative since the object was made and are published
//!   with [`Counter::absolute`], so a publication never double-counts and a
//!   missed one loses nothing.
//! - Gauges are set to the current value. A few monotonic times in seconds
//!   (`*_seconds_total`) are gauges because the facade's counters hold
//!   integers; they only grow, so `rate()` applies to them as to counters.
//! - The batch-size histogram (opt-in, [`MetricsExporter::batch_histogram`])
//!   is fed from the CQ's batch buckets: each publication records, for each
//!   bucket, the batches added since the last one, at the bucket's lower
//!   bound (1, 2, 4, …, 128). Its cost in the recorder grows with the number
//!   of batches, which is why the exact per-bucket counter
//!   `cqd_cq_batches_total{size=…}` is always published and the histogram
//!   is not.
//!
//! [`MetricsExporter::publish`] publishes through the recorder in force on
//! the calling thread (a local one, as in tests, else the global one),
//! registering its handles at each call. The exporter's thread publishes
//! through the global recorder and keeps its handles from one publication
//! to the next; if the global recorder is installed after the thread
//! started, it registers them again, and the histogram starts over with
//! every batch so far.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ::metrics::{Counter, Gauge, Histogram, Label, Recorder, SharedString, Unit};

use crate::budget::BudgetSnapshot;
use crate::completion::Status;
use crate::cq::CqHandle;
use crate::ledger::{LedgerSnapshot, WrLedger};
use crate::metrics::{CqSnapshot, PollerSnapshot, BATCH_BUCKETS};
use crate::poller::{PollerMonitor, PollerThread};
use crate::pool::{Pool, PoolMonitor, PoolSnapshot, SinkSnapshot, WorkerSnapshot};

/// The shortest period of [`MetricsExporter::spawn`].
pub const MIN_PERIOD: Duration = Duration::from_millis(1);

/// What kind of facade metric a name is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetricKind {
    /// A monotonic integer, published with `absolute`.
    Counter,
    /// A value set at each publication.
    Gauge,
    /// Samples recorded at each publication.
    Histogram,
}

/// One metric the exporter publishes.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct MetricDef {
    /// Its stable name.
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: MetricKind,
    /// Its label keys, in order.
    pub labels: &'static [&'static str],
    /// Seconds, or none.
    pub unit: Option<Unit>,
    /// What it counts (also sent to the recorder as its description).
    pub help: &'static str,
}

/// How a metric's value is read from a snapshot of type `S`.
enum Read<S> {
    Count(fn(&S) -> u64),
    Level(fn(&S) -> f64),
}

/// A metric and how to read it.
struct Field<S> {
    def: MetricDef,
    read: Read<S>,
}

const CQ: &[&str] = &["cq"];
const CQ_STATUS: &[&str] = &["cq", "status"];
const CQ_SIZE: &[&str] = &["cq", "size"];
const POLLER: &[&str] = &["poller"];
const POOL: &[&str] = &["pool"];
const WORKER: &[&str] = &["pool", "worker"];
const SINK: &[&str] = &["pool", "sink"];

const fn count<S>(
    name: &'static str,
    labels: &'static [&'static str],
    help: &'static str,
    read: fn(&S) -> u64,
) -> Field<S> {
    Field {
        def: MetricDef {
            name,
            kind: MetricKind::Counter,
            labels,
            unit: None,
            help,
        },
        read: Read::Count(read),
    }
}

const fn level<S>(
    name: &'static str,
    labels: &'static [&'static str],
    unit: Option<Unit>,
    help: &'static str,
    read: fn(&S) -> f64,
) -> Field<S> {
    Field {
        def: MetricDef {
            name,
            kind: MetricKind::Gauge,
            labels,
            unit,
            help,
        },
        read: Read::Level(read),
    }
}

const SECONDS: Option<Unit> = Some(Unit::Seconds);

fn secs(ns: u64) -> f64 {
    ns as f64 / 1e9
}

#[rustfmt::skip]
static CQ_FIELDS: [Field<CqSnapshot>; 28] = [
    count("cqd_cq_completions_total", CQ, "Completions polled from the CQ (every one: dispatched to a handler, or counted as an anomaly).", |s| s.completions),
    count("cqd_cq_polls_total", CQ, "Calls to poll the CQ.", |s| s.polls),
    count("cqd_cq_empty_polls_total", CQ, "Polls that found the CQ empty.", |s| s.empty_polls),
    count("cqd_cq_events_total", CQ, "Completion notifications taken from the CQ's notification descriptor or shared channel.", |s| s.events),
    count("cqd_cq_arms_total", CQ, "Arms requested (one-shot requests for the next notification).", |s| s.arms),
    count("cqd_cq_acks_total", CQ, "Notifications acknowledged.", |s| s.acks),
    count("cqd_cq_spurious_wakeups_total", CQ, "Wake-ups by a notification whose poll found nothing.", |s| s.spurious_wakeups),
    count("cqd_cq_recovered_missed_events_total", CQ, "Quiet CQs the safety net found holding completions: a notification was lost and recovered.", |s| s.recovered_missed_events),
    count("cqd_cq_stale_wr_ids_total", CQ, "Completions whose wr_id named a handler generation no longer live (never dispatched).", |s| s.stale_wr_ids),
    count("cqd_cq_unmatched_wr_ids_total", CQ, "Completions of an accounted queue that matched no request in flight on it: written twice by the device, or naming a request never posted there (never dispatched).", |s| s.unmatched_wr_ids),
    count("cqd_cq_srq_returned_total", CQ, "Receives still posted on an SRQ at the stop, once no QP could take them any more, handed back to their handlers as flushes.", |s| s.srq_returned),
    count("cqd_cq_foreign_wr_ids_total", CQ, "Completions whose wr_id cqd did not make (never dispatched).", |s| s.foreign_wr_ids),
    count("cqd_cq_slow_handler_calls_total", CQ, "Handler calls that held the poller past CqOptions::slow_batch (found by timing the completions after a slow batch).", |s| s.slow_handler_calls),
    count("cqd_cq_recv_queues_dry_total", CQ, "Times a receive queue was left with no more than the low-water mark of receives after its handler's batch (a peer's next SEND meets RNR).", |s| s.recv_queues_dry),
    count("cqd_cq_unknown_status_total", CQ, "Completions with a status this version does not know.", |s| s.unknown_status),
    count("cqd_cq_unknown_opcode_total", CQ, "Successful completions with an opcode this version does not know.", |s| s.unknown_opcode),
    count("cqd_cq_handler_panics_total", CQ, "Handler callbacks that panicked (caught; the completion counts as delivered).", |s| s.handler_panics),
    count("cqd_cq_flushes_total", CQ, "Flush-error completions (a subset of cqd_cq_errors_total).", |s| s.flushes),
    count("cqd_cq_async_events_total", CQ, "Asynchronous events on the CQ and its queues (overflow, device fatal, QP and SRQ events).", |s| s.async_events),
    count("cqd_cq_overflows_total", CQ, "CQ overflows reported by the device: completions were lost. Stays 0 with admission on.", |s| s.overflows),
    count("cqd_cq_poll_errors_total", CQ, "Polls that failed (device gone).", |s| s.poll_errors),
    count("cqd_cq_arm_errors_total", CQ, "Arms that failed, the refusal that put the CQ in error included.", |s| s.arm_errors),
    count("cqd_cq_registrations_total", CQ, "Handler registrations accepted.", |s| s.registrations),
    count("cqd_cq_unregistrations_total", CQ, "Handlers retired (unregistered, with nothing outstanding).", |s| s.unregistrations),
    level("cqd_cq_in_error", CQ, None, "1 while the CQ is in the error state (after an overflow): never armed again, polled once per wake timeout.", |s| f64::from(u8::from(s.in_error))),
    level("cqd_cq_handlers_live", CQ, None, "Handlers registered and not yet retired.", |s| s.handlers_live as f64),
    level("cqd_cq_capacity", CQ, None, "The CQ's real capacity (entries).", |s| f64::from(s.capacity)),
    level("cqd_cq_handler_seconds_total", CQ, SECONDS, "Time spent in handler callbacks (monotonic; measured only with CqOptions::measure_handlers).", |s| secs(s.handler_ns)),
];

#[rustfmt::skip]
static BUDGET_FIELDS: [Field<BudgetSnapshot>; 6] = [
    level("cqd_cq_budget_reserved", CQ, None, "CQ entries reserved by the queues attached to the CQ's budget.", |s| s.reserved as f64),
    count("cqd_cq_budget_refused_total", CQ, "Queue attaches the budget refused (their worst case would not fit the CQ).", |s| s.refused),
    level("cqd_cq_credits_in_use", CQ, None, "CQ credits taken by posted requests now.", |s| s.credits_in_use as f64),
    level("cqd_cq_credits_high_water", CQ, None, "The most CQ credits ever taken at once.", |s| s.credits_high_water as f64),
    count("cqd_cq_posts_refused_total", CQ, "Posts refused for want of a CQ credit (the poster must wait for completions).", |s| s.would_overflow),
    count("cqd_cq_lost_completions_total", CQ, "Completions lost to overflows, as far as the backend knows.", |s| s.lost),
];

#[rustfmt::skip]
static LEDGER_FIELDS: [Field<LedgerSnapshot>; 4] = [
    level("cqd_cq_outstanding_wrs", CQ, None, "Work requests posted to the CQ's queues and not yet completed.", |s| s.outstanding as f64),
    level("cqd_cq_oldest_outstanding_seconds", CQ, SECONDS, "Age of the oldest outstanding work request (0 if none).", |s| secs(s.oldest_ns)),
    count("cqd_cq_stuck_wrs_total", CQ, "Work requests the watchdog reported as stuck (each once).", |s| s.stuck),
    count("cqd_cq_watchdog_scans_total", CQ, "Watchdog scans of the CQ's ledger.", |s| s.scans),
];

#[rustfmt::skip]
static POLLER_FIELDS: [Field<PollerSnapshot>; 16] = [
    count("cqd_poller_loops_total", POLLER, "Iterations of the poll loop.", |s| s.loops),
    count("cqd_poller_sleeps_total", POLLER, "Times the poller blocked waiting for a notification.", |s| s.sleeps),
    count("cqd_poller_timeouts_total", POLLER, "Sleeps ended by the safety timeout.", |s| s.timeouts),
    count("cqd_poller_control_wakeups_total", POLLER, "Sleeps ended by a control request (registration, stop).", |s| s.control_wakeups),
    level("cqd_poller_spin_seconds_total", POLLER, SECONDS, "Time spent spinning with nothing to do (monotonic).", |s| secs(s.spin_ns)),
    count("cqd_poller_spills_total", POLLER, "Work items the sink could not take at once (kept in the spill, retried; each counted once).", |s| s.spills),
    level("cqd_poller_spill_len", POLLER, None, "Items in the poller's spill queue now.", |s| s.spill_len as f64),
    level("cqd_poller_spill_high_water", POLLER, None, "The longest the spill queue has been.", |s| s.spill_high_water as f64),
    count("cqd_poller_throttles_total", POLLER, "Times the spill went above its high-water mark, so the poller stopped polling its CQs (back-pressure).", |s| s.throttles),
    count("cqd_poller_space_waits_total", POLLER, "Sleeps with a spill, waiting for a worker to free ring space.", |s| s.space_waits),
    count("cqd_poller_space_wakeups_total", POLLER, "Space waits a worker's wake-up ended.", |s| s.space_wakeups),
    count("cqd_poller_handed_off_total", POLLER, "Work items handed to the sink.", |s| s.handed_off),
    level("cqd_poller_spin_window_seconds", POLLER, SECONDS, "The current spin window of Hybrid or Adaptive mode.", |s| secs(s.spin_window_ns)),
    level("cqd_poller_cpu_seconds_total", POLLER, SECONDS, "CPU time the poller thread has used (monotonic; updated at each sleep, nap and at the stop).", |s| secs(s.cpu_ns)),
    count("cqd_poller_naps_total", POLLER, "Naps of an idle Busy poller (short timed sleeps).", |s| s.naps),
    count("cqd_poller_backoffs_total", POLLER, "Pauses of the poll loop because a CQ's device was failing and no CQ had work.", |s| s.backoffs),
];

#[rustfmt::skip]
static POOL_FIELDS: [Field<PoolSnapshot>; 3] = [
    level("cqd_pool_workers", POOL, None, "Worker threads of the pool.", |s| s.workers.len() as f64),
    level("cqd_pool_ring_capacity", POOL, None, "Slots per SPSC ring (one ring per poller and worker).", |s| s.ring_capacity as f64),
    level("cqd_pool_queued_items", POOL, None, "Items handed to the pool's rings and not yet run by a worker (the rings' total depth).", |s| s.accepted().saturating_sub(s.items()) as f64),
];

#[rustfmt::skip]
static WORKER_FIELDS: [Field<WorkerSnapshot>; 6] = [
    count("cqd_pool_worker_items_total", WORKER, "Work items the worker ran (those that panicked included).", |s| s.items),
    count("cqd_pool_worker_batches_total", WORKER, "Batches the worker took from its rings.", |s| s.batches),
    count("cqd_pool_worker_parks_total", WORKER, "Times the worker parked with nothing to do.", |s| s.parks),
    count("cqd_pool_worker_wakeups_total", WORKER, "Parks that ended with work waiting.", |s| s.wakeups),
    level("cqd_pool_worker_ring_depth_high_water", WORKER, None, "The deepest any of the worker's rings was when it took a batch.", |s| s.depth_high_water as f64),
    count("cqd_pool_worker_panics_total", WORKER, "Work items whose work function panicked (caught; the worker went on).", |s| s.panics),
];

#[rustfmt::skip]
static SINK_FIELDS: [Field<SinkSnapshot>; 4] = [
    count("cqd_pool_sink_offers_total", SINK, "Offers of a batch by the sink's poller.", |s| s.offers),
    count("cqd_pool_sink_accepted_total", SINK, "Items the rings took.", |s| s.accepted),
    count("cqd_pool_sink_refused_total", SINK, "Items refused by a full ring (an item refused twice counts twice).", |s| s.refused),
    count("cqd_pool_sink_unparks_total", SINK, "Parked workers woken by the sink.", |s| s.unparks),
];

const ERRORS: MetricDef = MetricDef {
    name: "cqd_cq_errors_total",
    kind: MetricKind::Counter,
    labels: CQ_STATUS,
    unit: None,
    help: "Error completions by status (flushes included), each reaching its handler's on_error.",
};

const BATCHES: MetricDef = MetricDef {
    name: "cqd_cq_batches_total",
    kind: MetricKind::Counter,
    labels: CQ_SIZE,
    unit: None,
    help: "Non-empty polls by the number of completions they returned (size buckets 1, 2-3, 4-7, ..., 64-127, 128+).",
};

const BATCH_SIZE: MetricDef = MetricDef {
    name: "cqd_cq_batch_size",
    kind: MetricKind::Histogram,
    labels: CQ,
    unit: None,
    help: "Completions per non-empty poll, at each size bucket's lower bound (opt-in: MetricsExporter::batch_histogram).",
};

/// The `size` label of each batch bucket.
pub const BATCH_SIZE_LABELS: [&str; BATCH_BUCKETS] = [
    "1", "2-3", "4-7", "8-15", "16-31", "32-63", "64-127", "128+",
];

/// Every metric the exporter publishes, in the order of `docs/metrics.md`.
pub fn catalog() -> &'static [MetricDef] {
    static CATALOG: OnceLock<Vec<MetricDef>> = OnceLock::new();
    CATALOG.get_or_init(|| {
        let mut all: Vec<MetricDef> = CQ_FIELDS.iter().map(|f| f.def).collect();
        all.extend([ERRORS, BATCHES, BATCH_SIZE]);
        all.extend(BUDGET_FIELDS.iter().map(|f| f.def));
        all.extend(LEDGER_FIELDS.iter().map(|f| f.def));
        all.extend(POLLER_FIELDS.iter().map(|f| f.def));
        all.extend(POOL_FIELDS.iter().map(|f| f.def));
        all.extend(WORKER_FIELDS.iter().map(|f| f.def));
        all.extend(SINK_FIELDS.iter().map(|f| f.def));
        all
    })
}

/// The `status` label of an error status: its variant name in snake case
/// (`wr_flush`, `remote_access`, …; `unknown` for values this version does
/// not know). Stable: a variant is renamed only in a breaking release.
pub fn status_label(status: Status) -> String {
    if !status.is_known() {
        return "unknown".to_string();
    }
    let debug = format!("{status:?}");
    let mut out = String::with_capacity(debug.len() + 4);
    for (i, c) in debug.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The `status` label of a [`CqSnapshot::errors_by_status`] key (its
/// status's text).
fn status_label_of_text(text: &str) -> SharedString {
    static BY_TEXT: OnceLock<HashMap<&'static str, SharedString>> = OnceLock::new();
    let map = BY_TEXT.get_or_init(|| {
        Status::KNOWN
            .iter()
            .map(|&s| (s.as_str(), SharedString::from(status_label(s))))
            .collect()
    });
    map.get(text)
        .cloned()
        .unwrap_or(SharedString::const_str("unknown"))
}

/// Errors of the exporter.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ExportError {
    /// Two objects of one kind with one name would publish the same
    /// series.
    #[error("a {kind} named {name:?} is already exported: names label the series, so they must be unique")]
    Duplicate {
        /// `cq`, `poller` or `pool`.
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// The period of [`MetricsExporter::spawn`] is below [`MIN_PERIOD`].
    #[error("export period {given:?} is below the minimum {min:?}")]
    Period {
        /// The period asked for.
        given: Duration,
        /// The shortest allowed.
        min: Duration,
    },
    /// The OS refused a thread.
    #[error("could not spawn the metrics thread: {0}")]
    Spawn(#[source] std::io::Error),
}

/// A CQ as the exporter sees it: snapshots, whatever `W`.
trait CqSample: Send + Sync {
    fn snapshot(&self) -> CqSnapshot;
    fn ledger(&self) -> Option<WrLedger>;
}

impl<W: Send + 'static> CqSample for CqHandle<W> {
    fn snapshot(&self) -> CqSnapshot {
        CqHandle::snapshot(self)
    }
    fn ledger(&self) -> Option<WrLedger> {
        CqHandle::ledger(self).cloned()
    }
}

/// A facade handle.
enum Handle {
    Counter(Counter),
    Gauge(Gauge),
}

/// Registers one handle per field under `labels`.
fn register<S>(fields: &[Field<S>], labels: &[Label]) -> Vec<Handle> {
    fields
        .iter()
        .map(|f| match f.read {
            Read::Count(_) => Handle::Counter(::metrics::counter!(f.def.name, labels.iter())),
            Read::Level(_) => Handle::Gauge(::metrics::gauge!(f.def.name, labels.iter())),
        })
        .collect()
}

/// Publishes `snap` through `handles` (from [`register`] on `fields`).
fn write<S>(fields: &[Field<S>], handles: &[Handle], snap: &S) {
    for (f, h) in fields.iter().zip(handles) {
        match (&f.read, h) {
            (Read::Count(read), Handle::Counter(c)) => c.absolute(read(snap)),
            (Read::Level(read), Handle::Gauge(g)) => g.set(read(snap)),
            _ => {}
        }
    }
}

/// The recorder in force on this thread, by address. Only the exporter's
/// thread keys its handles by it: there the recorder is the global one or
/// the facade's no-op one, both static, so an address names one recorder
/// for good. (A local recorder's address can be reused by the next one once
/// it is dropped, so `publish` never keeps handles.)
fn recorder_id() -> usize {
    ::metrics::with_recorder(|r| (r as *const dyn Recorder).cast::<()>() as usize)
}

/// Whether `handles` must be registered (again): always when not kept
/// (`cached` is `None`), else when registered with another recorder.
fn stale<H>(handles: &Option<(usize, H)>, cached: Option<usize>) -> bool {
    match cached {
        Some(id) => handles.as_ref().map(|h| h.0) != Some(id),
        None => true,
    }
}

fn describe(r: &dyn Recorder, def: &MetricDef) {
    let help = SharedString::const_str(def.help);
    let name = def.name.into();
    match def.kind {
        MetricKind::Counter => r.describe_counter(name, def.unit, help),
        MetricKind::Gauge => r.describe_gauge(name, def.unit, help),
        MetricKind::Histogram => r.describe_histogram(name, def.unit, help),
    }
}

/// A CQ's handles.
struct CqHandles {
    fields: Vec<Handle>,
    batches: Vec<Counter>,
    errors: HashMap<String, Counter>,
    histogram: Option<Histogram>,
    budget: Option<Vec<Handle>>,
    ledger: Option<Vec<Handle>>,
}

struct CqEntry {
    name: Arc<str>,
    cq: Box<dyn CqSample>,
    handles: Option<(usize, CqHandles)>,
    /// The batch buckets the histogram has been fed up to.
    fed: [u64; BATCH_BUCKETS],
}

impl CqEntry {
    fn labels(&self) -> Vec<Label> {
        vec![Label::new("cq", Arc::clone(&self.name))]
    }

    fn publish(&mut self, cached: Option<usize>, options: &Options, now: Instant) {
        let snap = self.cq.snapshot();
        if stale(&self.handles, cached) {
            let labels = self.labels();
            let batches = BATCH_SIZE_LABELS
                .iter()
                .map(|size| {
                    let mut l = labels.clone();
                    l.push(Label::new("size", *size));
                    ::metrics::counter!(BATCHES.name, l.iter())
                })
                .collect();
            let handles = CqHandles {
                fields: register(&CQ_FIELDS, &labels),
                batches,
                errors: HashMap::new(),
                histogram: None,
                budget: None,
                ledger: None,
            };
            if cached.is_some() {
                // A new recorder: the histogram starts over.
                self.fed = [0; BATCH_BUCKETS];
            }
            self.handles = Some((cached.unwrap_or_default(), handles));
        }
        let labels = self.labels();
        let Some((_, h)) = self.handles.as_mut() else {
            return;
        };
        write(&CQ_FIELDS, &h.fields, &snap);
        for (c, n) in h.batches.iter().zip(&snap.batch_histogram) {
            c.absolute(*n);
        }
        for (text, n) in &snap.errors_by_status {
            let c = h.errors.entry(text.clone()).or_insert_with(|| {
                let mut l = labels.clone();
                l.push(Label::new("status", status_label_of_text(text)));
                ::metrics::counter!(ERRORS.name, l.iter())
            });
            c.absolute(*n);
        }
        if options.batch_histogram {
            let hist = h
                .histogram
                .get_or_insert_with(|| ::metrics::histogram!(BATCH_SIZE.name, labels.iter()));
            for (i, (fed, &total)) in self.fed.iter_mut().zip(&snap.batch_histogram).enumerate() {
                let new = total.saturating_sub(*fed);
                if new > 0 {
                    hist.record_many(
                        (1u64 << i) as f64,
                        usize::try_from(new).unwrap_or(usize::MAX),
                    );
                }
                *fed = total;
            }
        }
        if let Some(budget) = &snap.budget {
            let handles = h
                .budget
                .get_or_insert_with(|| register(&BUDGET_FIELDS, &labels));
            write(&BUDGET_FIELDS, handles, budget);
        }
        if options.ledgers {
            if let Some(ledger) = self.cq.ledger() {
                let handles = h
                    .ledger
                    .get_or_insert_with(|| register(&LEDGER_FIELDS, &labels));
                write(&LEDGER_FIELDS, handles, &ledger.snapshot(now));
            }
        }
        if cached.is_none() {
            self.handles = None;
        }
    }
}

struct PollerEntry {
    monitor: PollerMonitor,
    handles: Option<(usize, Vec<Handle>)>,
}

impl PollerEntry {
    fn publish(&mut self, cached: Option<usize>) {
        let snap = self.monitor.snapshot();
        if stale(&self.handles, cached) {
            let labels = [Label::new("poller", self.monitor.name().to_string())];
            let handles = register(&POLLER_FIELDS, &labels);
            self.handles = Some((cached.unwrap_or_default(), handles));
        }
        if let Some((_, h)) = &self.handles {
            write(&POLLER_FIELDS, h, &snap);
        }
        if cached.is_none() {
            self.handles = None;
        }
    }
}

struct PoolHandles {
    pool: Vec<Handle>,
    workers: Vec<Vec<Handle>>,
    sinks: Vec<Vec<Handle>>,
}

struct PoolEntry {
    monitor: PoolMonitor,
    handles: Option<(usize, PoolHandles)>,
}

impl PoolEntry {
    fn publish(&mut self, cached: Option<usize>) {
        let snap = self.monitor.snapshot();
        if stale(&self.handles, cached) {
            let name: Arc<str> = Arc::from(self.monitor.name());
            let pool = [Label::new("pool", Arc::clone(&name))];
            let indexed = |key: &'static str, i: usize| {
                [
                    Label::new("pool", Arc::clone(&name)),
                    Label::new(key, i.to_string()),
                ]
            };
            let handles = PoolHandles {
                pool: register(&POOL_FIELDS, &pool),
                workers: (0..snap.workers.len())
                    .map(|i| register(&WORKER_FIELDS, &indexed("worker", i)))
                    .collect(),
                sinks: (0..snap.sinks.len())
                    .map(|i| register(&SINK_FIELDS, &indexed("sink", i)))
                    .collect(),
            };
            self.handles = Some((cached.unwrap_or_default(), handles));
        }
        if let Some((_, h)) = &self.handles {
            write(&POOL_FIELDS, &h.pool, &snap);
            for (handles, w) in h.workers.iter().zip(&snap.workers) {
                write(&WORKER_FIELDS, handles, w);
            }
            for (handles, s) in h.sinks.iter().zip(&snap.sinks) {
                write(&SINK_FIELDS, handles, s);
            }
        }
        if cached.is_none() {
            self.handles = None;
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Options {
    ledgers: bool,
    batch_histogram: bool,
}

struct Registry {
    options: Options,
    cqs: Vec<CqEntry>,
    pollers: Vec<PollerEntry>,
    pools: Vec<PoolEntry>,
    /// The recorder the descriptions were given to.
    described: Option<usize>,
}

/// Samples the snapshots of the CQs, pollers and pools it was given and
/// publishes them through the `metrics` facade (see the module
/// documentation). Cloneable: every clone is the same exporter, so one can
/// register objects while its thread publishes.
#[derive(Clone)]
pub struct MetricsExporter {
    inner: Arc<Mutex<Registry>>,
}

impl fmt::Debug for MetricsExporter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.lock();
        f.debug_struct("MetricsExporter")
            .field("cqs", &r.cqs.len())
            .field("pollers", &r.pollers.len())
            .field("pools", &r.pools.len())
            .finish()
    }
}

impl Default for MetricsExporter {
    fn default() -> Self {
        Self::new()
    }
}

impl MetricsExporter {
    /// An exporter with nothing registered; ledgers sampled, no batch
    /// histogram.
    pub fn new() -> Self {
        MetricsExporter {
            inner: Arc::new(Mutex::new(Registry {
                options: Options {
                    ledgers: true,
                    batch_histogram: false,
                },
                cqs: Vec::new(),
                pollers: Vec::new(),
                pools: Vec::new(),
                described: None,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether to sample each CQ's ledger (outstanding requests, the oldest
    /// one's age, the watchdog's stuck count; default on). A sample takes
    /// each queue account's lock once, as the watchdog does; turn it off
    /// for CQs with very many queues and a short period.
    pub fn ledgers(self, on: bool) -> Self {
        self.lock().options.ledgers = on;
        self
    }

    /// Whether to feed the `cqd_cq_batch_size` histogram (default off: its
    /// cost in the recorder grows with the number of batches; the exact
    /// `cqd_cq_batches_total{size}` counters are always published).
    pub fn batch_histogram(self, on: bool) -> Self {
        self.lock().options.batch_histogram = on;
        self
    }

    /// Exports a CQ's counters (and its budget's and ledger's, if
    /// attached) with the label `cq` = its name.
    ///
    /// # Errors
    /// [`ExportError::Duplicate`] if a CQ of that name is exported.
    pub fn add_cq<W: Send + 'static>(&self, cq: &CqHandle<W>) -> Result<(), ExportError> {
        let mut r = self.lock();
        if r.cqs.iter().any(|c| &*c.name == cq.name()) {
            return Err(ExportError::Duplicate {
                kind: "cq",
                name: cq.name().to_string(),
            });
        }
        r.cqs.push(CqEntry {
            name: Arc::from(cq.name()),
            cq: Box::new(cq.clone()),
            handles: None,
            fed: [0; BATCH_BUCKETS],
        });
        Ok(())
    }

    /// Exports a poller thread's counters with the label `poller` = its
    /// name. They stay exported (at their final values) after it stops,
    /// until [`remove_poller`](Self::remove_poller).
    ///
    /// # Errors
    /// [`ExportError::Duplicate`] if a poller of that name is exported.
    pub fn add_poller(&self, poller: &PollerThread) -> Result<(), ExportError> {
        self.add_poller_monitor(poller.monitor())
    }

    /// As [`add_poller`](Self::add_poller), from its monitor.
    ///
    /// # Errors
    /// [`ExportError::Duplicate`] if a poller of that name is exported.
    pub fn add_poller_monitor(&self, monitor: PollerMonitor) -> Result<(), ExportError> {
        let mut r = self.lock();
        if r.pollers.iter().any(|p| p.monitor.name() == monitor.name()) {
            return Err(ExportError::Duplicate {
                kind: "poller",
                name: monitor.name().to_string(),
            });
        }
        r.pollers.push(PollerEntry {
            monitor,
            handles: None,
        });
        Ok(())
    }

    /// Exports a pool's counters: the pool's (label `pool`), each worker's
    /// (`pool`, `worker` = its index) and each sink's (`pool`, `sink` = its
    /// index in the `Vec` the spawn returned).
    ///
    /// # Errors
    /// [`ExportError::Duplicate`] if a pool of that name is exported.
    pub fn add_pool(&self, pool: &Pool) -> Result<(), ExportError> {
        self.add_pool_monitor(pool.monitor())
    }

    /// As [`add_pool`](Self::add_pool), from its monitor.
    ///
    /// # Errors
    /// [`ExportError::Duplicate`] if a pool of that name is exported.
    pub fn add_pool_monitor(&self, monitor: PoolMonitor) -> Result<(), ExportError> {
        let mut r = self.lock();
        if r.pools.iter().any(|p| p.monitor.name() == monitor.name()) {
            return Err(ExportError::Duplicate {
                kind: "pool",
                name: monitor.name().to_string(),
            });
        }
        r.pools.push(PoolEntry {
            monitor,
            handles: None,
        });
        Ok(())
    }

    /// Stops sampling the CQ named `name` (the recorder keeps its series as
    /// they were); returns whether it was exported.
    pub fn remove_cq(&self, name: &str) -> bool {
        let mut r = self.lock();
        let before = r.cqs.len();
        r.cqs.retain(|c| &*c.name != name);
        r.cqs.len() != before
    }

    /// Stops sampling the poller named `name`; returns whether it was
    /// exported.
    pub fn remove_poller(&self, name: &str) -> bool {
        let mut r = self.lock();
        let before = r.pollers.len();
        r.pollers.retain(|p| p.monitor.name() != name);
        r.pollers.len() != before
    }

    /// Stops sampling the pool named `name`; returns whether it was
    /// exported.
    pub fn remove_pool(&self, name: &str) -> bool {
        let mut r = self.lock();
        let before = r.pools.len();
        r.pools.retain(|p| p.monitor.name() != name);
        r.pools.len() != before
    }

    /// Samples every registered object once and publishes it through the
    /// recorder in force on this thread — a local one (as in tests) or the
    /// global one — describing every metric of [`catalog`] to it. Its
    /// handles are registered at each call (a lookup in the recorder per
    /// metric); the thread of [`spawn`](Self::spawn) keeps its handles.
    pub fn publish(&self) {
        self.publish_with(None);
    }

    /// Publishes through handles kept from one call to the next, registered
    /// again when the recorder in force changes: for the exporter's thread
    /// (see [`recorder_id`]).
    fn publish_kept(&self) {
        self.publish_with(Some(recorder_id()));
    }

    fn publish_with(&self, cached: Option<usize>) {
        let now = Instant::now();
        let mut r = self.lock();
        if cached.is_none() || r.described != cached {
            ::metrics::with_recorder(|rec| {
                for def in catalog() {
                    describe(rec, def);
                }
            });
            r.described = cached;
        }
        let options = r.options;
        for cq in &mut r.cqs {
            cq.publish(cached, &options, now);
        }
        for p in &mut r.pollers {
            p.publish(cached);
        }
        for p in &mut r.pools {
            p.publish(cached);
        }
    }

    /// Publishes every `period` from a thread of its own (named
    /// `cqd-metrics`), through the global recorder, until the returned
    /// handle is stopped or dropped (which publishes one last time).
    ///
    /// # Errors
    /// [`ExportError::Period`] below [`MIN_PERIOD`] (refused, not raised);
    /// [`ExportError::Spawn`] if the OS refuses a thread.
    pub fn spawn(&self, period: Duration) -> Result<ExporterThread, ExportError> {
        if period < MIN_PERIOD {
            return Err(ExportError::Period {
                given: period,
                min: MIN_PERIOD,
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (exporter, flag) = (self.clone(), Arc::clone(&stop));
        let join = std::thread::Builder::new()
            .name("cqd-metrics".into())
            .spawn(move || {
                let mut next = Instant::now();
                loop {
                    exporter.publish_kept();
                    next += period;
                    loop {
                        if flag.load(Ordering::Acquire) {
                            // The last publication: the final counters.
                            exporter.publish_kept();
                            return;
                        }
                        let now = Instant::now();
                        if now >= next {
                            break;
                        }
                        std::thread::park_timeout(next - now);
                    }
                    // Fell behind (a slow recorder): skip, do not burst.
                    next = next.max(Instant::now());
                }
            })
            .map_err(ExportError::Spawn)?;
        Ok(ExporterThread {
            stop,
            join: Some(join),
        })
    }
}

/// The thread of [`MetricsExporter::spawn`]. Dropping it stops it.
#[derive(Debug)]
pub struct ExporterThread {
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl ExporterThread {
    /// Publishes one last time and joins the thread.
    pub fn stop(mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(join) = self.join.take() {
            join.thread().unpark();
            if join.join().is_err() {
                tracing::error!("the metrics thread panicked (a recorder's bug)");
            }
        }
    }
}

impl Drop for ExporterThread {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, VecDeque};
    use std::os::fd::{AsFd, BorrowedFd};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};
    use parking_lot::Mutex;

    use super::*;
    use crate::completion::{Completion, Opcode, Status};
    use crate::cq::{split, CqOptions};
    use crate::handler::{Failed, Handler, Outbox, RecvDone, SendDone};
    use crate::mode::PollMode;
    use crate::poller::PollerBuilder;
    use crate::sink::{NoWork, Route};
    use crate::source::{ArmKind, AsyncEvent, CompletionSource, SourceError};
    use crate::sys::Doorbell;
    use crate::topology::{PoolConfig, TopologyConfig};
    use crate::wr_id::OpKind;

    /// A CQ fed by the test: polls return what was pushed, in order.
    struct Feed {
        name: &'static str,
        wcs: Arc<Mutex<VecDeque<Completion>>>,
        fd: Doorbell,
    }

    fn feed(name: &'static str) -> (Arc<Mutex<VecDeque<Completion>>>, Feed) {
        let wcs = Arc::new(Mutex::new(VecDeque::new()));
        let source = Feed {
            name,
            wcs: Arc::clone(&wcs),
            fd: Doorbell::new().unwrap(),
        };
        (wcs, source)
    }

    impl CompletionSource for Feed {
        fn name(&self) -> &str {
            self.name
        }
        fn capacity(&self) -> u32 {
            256
        }
        fn poll(&mut self, out: &mut [Completion]) -> Result<usize, SourceError> {
            let mut wcs = self.wcs.lock();
            let n = out.len().min(wcs.len());
            for (slot, wc) in out.iter_mut().zip(wcs.drain(..n)) {
                *slot = wc;
            }
            Ok(n)
        }
        fn arm(&mut self, _: ArmKind) -> Result<(), SourceError> {
            Ok(())
        }
        fn event_fd(&self) -> BorrowedFd<'_> {
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
            None
        }
        fn destroy(&mut self) -> Result<(), SourceError> {
            Ok(())
        }
    }

    /// Hands every receive to a worker, as a `u64`.
    struct Relay;

    impl Handler<u64> for Relay {
        fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, u64>) {}
        fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, u64>) {
            out.push_to(Route::LeastLoaded, u64::from(d.tag()));
        }
        fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, u64>) {}
    }

    struct Quiet;

    impl Handler for Quiet {
        fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
        fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
        fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
    }

    /// What a recorder holds, by `name{label=value,…}` (labels sorted).
    fn values(s: &Snapshotter) -> HashMap<String, DebugValue> {
        s.snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, _, _, value)| {
                let mut labels: Vec<String> = key
                    .key()
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                labels.sort();
                (
                    format!("{}{{{}}}", key.key().name(), labels.join(",")),
                    value,
                )
            })
            .collect()
    }

    fn counter(v: &HashMap<String, DebugValue>, key: &str) -> u64 {
        match v.get(key) {
            Some(DebugValue::Counter(n)) => *n,
            other => panic!("{key}: not a counter: {other:?}"),
        }
    }

    fn gauge(v: &HashMap<String, DebugValue>, key: &str) -> f64 {
        match v.get(key) {
            Some(DebugValue::Gauge(g)) => g.into_inner(),
            other => panic!("{key}: not a gauge: {other:?}"),
        }
    }

    fn samples(v: &HashMap<String, DebugValue>, key: &str) -> Vec<f64> {
        match v.get(key) {
            Some(DebugValue::Histogram(h)) => h.iter().map(|x| x.into_inner()).collect(),
            other => panic!("{key}: not a histogram: {other:?}"),
        }
    }

    fn drain(p: &mut crate::cq::CqPoller<NoWork>) {
        let mut out = VecDeque::new();
        while p.poll_once(&mut out).unwrap() > 0 {}
    }

    #[test]
    fn a_cqs_counters_reach_the_recorder_under_their_names() {
        let (wcs, source) = feed("rx0");
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
        let reg = handle.register(Quiet).unwrap();
        let mut p = unbound.bind();
        // 5 receives, 2 flushed sends, a remote access error, a foreign wr_id.
        assert!(reg.track(OpKind::Recv, 5) && reg.track(OpKind::Send, 3));
        {
            let mut q = wcs.lock();
            for t in 0..5 {
                let id = reg.wr_id(OpKind::Recv, t).unwrap();
                q.push_back(Completion::success(id, Opcode::Recv, 1));
            }
            for t in 0..2 {
                let id = reg.wr_id(OpKind::Send, t).unwrap();
                q.push_back(Completion::error(id, Status::WrFlush, 1));
            }
            let id = reg.wr_id(OpKind::Send, 9).unwrap();
            q.push_back(Completion::error(id, Status::RemoteAccess, 1));
            q.push_back(Completion::success(0x1234, Opcode::Send, 1));
        }
        drain(&mut p); // one batch of 9, one empty poll
        p.arm().unwrap();

        let exporter = MetricsExporter::new().batch_histogram(true);
        exporter.add_cq(&handle).unwrap();
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || exporter.publish());
        let v = values(&snapshotter);
        assert_eq!(counter(&v, "cqd_cq_completions_total{cq=rx0}"), 9);
        assert_eq!(counter(&v, "cqd_cq_polls_total{cq=rx0}"), 2);
        assert_eq!(counter(&v, "cqd_cq_empty_polls_total{cq=rx0}"), 1);
        assert_eq!(counter(&v, "cqd_cq_arms_total{cq=rx0}"), 1);
        assert_eq!(counter(&v, "cqd_cq_flushes_total{cq=rx0}"), 2);
        assert_eq!(counter(&v, "cqd_cq_foreign_wr_ids_total{cq=rx0}"), 1);
        assert_eq!(counter(&v, "cqd_cq_stale_wr_ids_total{cq=rx0}"), 0);
        assert_eq!(counter(&v, "cqd_cq_overflows_total{cq=rx0}"), 0);
        assert_eq!(
            counter(&v, "cqd_cq_errors_total{cq=rx0,status=wr_flush}"),
            2
        );
        assert_eq!(
            counter(&v, "cqd_cq_errors_total{cq=rx0,status=remote_access}"),
            1
        );
        assert_eq!(counter(&v, "cqd_cq_registrations_total{cq=rx0}"), 1);
        assert_eq!(gauge(&v, "cqd_cq_handlers_live{cq=rx0}"), 1.0);
        assert_eq!(gauge(&v, "cqd_cq_in_error{cq=rx0}"), 0.0);
        assert_eq!(gauge(&v, "cqd_cq_capacity{cq=rx0}"), 256.0);
        for (i, size) in BATCH_SIZE_LABELS.iter().enumerate() {
            let key = format!("cqd_cq_batches_total{{cq=rx0,size={size}}}");
            assert_eq!(counter(&v, &key), u64::from(i == 3), "{key}");
        }
        assert_eq!(samples(&v, "cqd_cq_batch_size{cq=rx0}"), [8.0]);
        // No ledger is attached (the source gave none): no ledger metrics.
        assert!(!v.contains_key("cqd_cq_outstanding_wrs{cq=rx0}"));

        // More traffic: counters move to the new totals, the histogram gets
        // only the batches since.
        {
            let mut q = wcs.lock();
            for t in 5..7 {
                let id = reg.wr_id(OpKind::Recv, t).unwrap();
                q.push_back(Completion::success(id, Opcode::Recv, 1));
            }
        }
        assert!(reg.track(OpKind::Recv, 2));
        drain(&mut p);
        ::metrics::with_local_recorder(&recorder, || exporter.publish());
        let v = values(&snapshotter);
        assert_eq!(counter(&v, "cqd_cq_completions_total{cq=rx0}"), 11);
        assert_eq!(counter(&v, "cqd_cq_polls_total{cq=rx0}"), 4);
        assert_eq!(
            counter(&v, "cqd_cq_batches_total{cq=rx0,size=2-3}"),
            1,
            "the second batch held 2"
        );
        assert_eq!(samples(&v, "cqd_cq_batch_size{cq=rx0}"), [2.0]);
        drop(reg);
    }

    #[test]
    fn kept_handles_follow_the_recorder_and_a_new_one_gets_everything() {
        let (wcs, source) = feed("cq");
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
        let mut p = unbound.bind();
        wcs.lock()
            .extend([Completion::success(7, Opcode::Send, 1); 40]);
        drain(&mut p); // batches of 32 and 8
        let exporter = MetricsExporter::new().batch_histogram(true);
        exporter.add_cq(&handle).unwrap();
        // The thread's way: handles kept for a recorder, registered again
        // for another (both alive: two addresses).
        let first = DebuggingRecorder::new();
        let s1 = first.snapshotter();
        ::metrics::with_local_recorder(&first, || exporter.publish_kept());
        assert_eq!(counter(&values(&s1), "cqd_cq_completions_total{cq=cq}"), 40);
        wcs.lock()
            .push_back(Completion::success(7, Opcode::Send, 1));
        drain(&mut p); // a batch of 1
        ::metrics::with_local_recorder(&first, || exporter.publish_kept());
        let v = values(&s1);
        assert_eq!(counter(&v, "cqd_cq_completions_total{cq=cq}"), 41);
        assert_eq!(samples(&v, "cqd_cq_batch_size{cq=cq}"), [1.0]);
        let second = DebuggingRecorder::new();
        let s2 = second.snapshotter();
        ::metrics::with_local_recorder(&second, || exporter.publish_kept());
        let v = values(&s2);
        assert_eq!(counter(&v, "cqd_cq_completions_total{cq=cq}"), 41);
        let mut h = samples(&v, "cqd_cq_batch_size{cq=cq}");
        h.sort_by(f64::total_cmp);
        assert_eq!(h, [1.0, 8.0, 32.0], "everything so far");
        drop(first);
    }

    #[test]
    fn names_label_series_so_duplicates_are_refused() {
        let (_, a) = feed("same");
        let (_, b) = feed("same");
        let (_ua, ha) = split::<NoWork>(a, CqOptions::default()).unwrap();
        let (_ub, hb) = split::<NoWork>(b, CqOptions::default()).unwrap();
        let exporter = MetricsExporter::new();
        exporter.add_cq(&ha).unwrap();
        let err = exporter.add_cq(&hb).unwrap_err();
        assert!(
            matches!(&err, ExportError::Duplicate { kind: "cq", name } if name == "same"),
            "{err}"
        );
        assert!(exporter.remove_cq("same"));
        assert!(!exporter.remove_cq("same"));
        exporter.add_cq(&hb).unwrap();
    }

    #[test]
    fn a_period_below_the_minimum_is_refused() {
        let err = MetricsExporter::new()
            .spawn(Duration::from_micros(10))
            .unwrap_err();
        assert!(matches!(err, ExportError::Period { .. }), "{err}");
    }

    #[test]
    fn a_poller_and_a_pool_publish_with_their_labels() {
        const N: u64 = 100;
        let mut topology = TopologyConfig::new()
            .pool(PoolConfig::new("io", 2))
            .validate()
            .unwrap();
        let handled = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let h = Arc::clone(&handled);
        let (pool, mut sinks) = topology
            .take_pool("io")
            .unwrap()
            .spawn(1, move |_| {
                let h = Arc::clone(&h);
                move |_: u64| {
                    h.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            })
            .unwrap();
        let (wcs, source) = feed("rx1");
        let (unbound, handle) = split::<u64>(source, CqOptions::default()).unwrap();
        let reg = handle.register(Relay).unwrap();
        assert!(reg.track(OpKind::Recv, N));
        wcs.lock().extend((0..N).map(|t| {
            let id = reg.wr_id(OpKind::Recv, t as u32).unwrap();
            Completion::success(id, Opcode::Recv, 1)
        }));
        let thread = PollerBuilder::new("p", sinks.pop().unwrap())
            .mode(PollMode::Busy)
            .cq(unbound)
            .spawn()
            .unwrap();
        let exporter = MetricsExporter::new();
        exporter.add_cq(&handle).unwrap();
        exporter.add_poller(&thread).unwrap();
        exporter.add_pool(&pool).unwrap();
        assert!(exporter.add_poller(&thread).is_err());
        let deadline = Instant::now() + Duration::from_secs(20);
        while handled.load(std::sync::atomic::Ordering::Relaxed) < N && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
        let report = thread.stop().unwrap();
        assert_eq!(report.poller.handed_off, N);
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        ::metrics::with_local_recorder(&recorder, || exporter.publish());
        let v = values(&snapshotter);
        // Stopped, the poller's final counters are still published.
        assert_eq!(counter(&v, "cqd_poller_handed_off_total{poller=p}"), N);
        assert_eq!(counter(&v, "cqd_poller_spills_total{poller=p}"), 0);
        assert_eq!(gauge(&v, "cqd_poller_spill_len{poller=p}"), 0.0);
        assert!(counter(&v, "cqd_poller_loops_total{poller=p}") > 0);
        assert!(gauge(&v, "cqd_poller_cpu_seconds_total{poller=p}") > 0.0);
        assert_eq!(counter(&v, "cqd_cq_completions_total{cq=rx1}"), N);
        let pool = pool.join().unwrap();
        ::metrics::with_local_recorder(&recorder, || exporter.publish());
        let v = values(&snapshotter);
        let items: u64 = (0..2)
            .map(|w| {
                counter(
                    &v,
                    &format!("cqd_pool_worker_items_total{{pool=io,worker={w}}}"),
                )
            })
            .sum();
        assert_eq!(items, N);
        assert_eq!(items, pool.items());
        assert_eq!(
            counter(&v, "cqd_pool_sink_accepted_total{pool=io,sink=0}"),
            N
        );
        assert_eq!(gauge(&v, "cqd_pool_queued_items{pool=io}"), 0.0);
        assert_eq!(gauge(&v, "cqd_pool_workers{pool=io}"), 2.0);
        assert_eq!(
            gauge(&v, "cqd_pool_ring_capacity{pool=io}"),
            pool.ring_capacity as f64
        );
        // Every name published is in the catalog, with its kind.
        for (key, value) in &v {
            let name = &key[..key.find('{').unwrap()];
            let def = catalog().iter().find(|d| d.name == name);
            let kind = match value {
                DebugValue::Counter(_) => MetricKind::Counter,
                DebugValue::Gauge(_) => MetricKind::Gauge,
                DebugValue::Histogram(_) => MetricKind::Histogram,
            };
            assert_eq!(def.map(|d| d.kind), Some(kind), "{key}");
        }
        drop(reg);
    }

    #[test]
    fn the_catalog_names_are_unique_and_prefixed() {
        let mut names: Vec<&str> = catalog().iter().map(|d| d.name).collect();
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a name appears twice");
        for d in catalog() {
            let prefix = match d.labels.first() {
                Some(&"cq") => "cqd_cq_",
                Some(&"poller") => "cqd_poller_",
                Some(&"pool") => "cqd_pool_",
                other => panic!("{}: unexpected labels {other:?}", d.name),
            };
            assert!(d.name.starts_with(prefix), "{}", d.name);
            let monotonic = d.kind == MetricKind::Counter || d.unit == SECONDS;
            if d.name.ends_with("_total") {
                assert!(monotonic, "{}: _total on a level", d.name);
            }
        }
    }

    #[test]
    fn status_labels_are_snake_case_variant_names() {
        assert_eq!(status_label(Status::WrFlush), "wr_flush");
        assert_eq!(
            status_label(Status::RemoteInvalidRdRequest),
            "remote_invalid_rd_request"
        );
        assert_eq!(status_label(Status::from_raw(300)), "unknown");
        assert_eq!(
            &*status_label_of_text(Status::RnrRetryExceeded.as_str()),
            "rnr_retry_exceeded"
        );
        assert_eq!(&*status_label_of_text("unknown"), "unknown");
    }
}
