//! `--prometheus ADDR` (cargo feature `prometheus`): cqd's metrics and
//! the demo's own on a Prometheus HTTP endpoint.
//!
//! [`start`] installs `metrics-exporter-prometheus`'s recorder with its
//! HTTP listener on ADDR and spawns cqd-core's
//! `MetricsExporter` (`cqd_core::export`) publisher every
//! [`PERIOD`], plus a sampler of the demo's counters. Each half of a run
//! registers what it made through a [`Watched`] (every CQ, poller and pool,
//! and its counters) and releases it when it stops (one last publication,
//! then its names are free for the next run of `--compare-modes`). The
//! latency histogram is recorded per request by the load's handler
//! ([`Latency`]).
//!
//! Without the feature every item here is an empty stand-in: the default
//! build has no dependency on the metrics facade, and the flag is refused
//! in [`crate::config`].

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use cqd_core::pool::Pool;
use cqd_core::{CqHandle, PollerThread};

use crate::load::LoadShared;
use crate::server::ServerStats;
use crate::DemoError;

/// How often cqd's snapshots and the demo's counters are published.
pub const PERIOD: Duration = Duration::from_millis(100);

/// The demo's own metrics: (name, help).
pub const DEMO_METRICS: &[(&str, &str)] = &[
    (
        "cqd_demo_ops_total",
        "Requests the load completed successfully, by op (read, write).",
    ),
    (
        "cqd_demo_failures_total",
        "Requests the load recorded failed (error completions, refused, timed out, killed).",
    ),
    (
        "cqd_demo_timeouts_total",
        "Requests older than --op-timeout (each failed its connection).",
    ),
    (
        "cqd_demo_dead_connections_total",
        "Load connections failed by an error.",
    ),
    ("cqd_demo_inflight", "Requests the load has in flight now."),
    (
        "cqd_demo_latency_seconds",
        "Latency of each request the load completed, by op (read, write).",
    ),
    (
        "cqd_demo_server_requests_total",
        "Requests a server served, by server and op (read, write).",
    ),
    (
        "cqd_demo_server_errors_total",
        "A server's error completions (flushes excluded), by server.",
    ),
];

/// The running endpoint: stops the publishers when dropped (one last
/// publication each). The HTTP listener serves until the process exits.
#[derive(Debug)]
pub struct Endpoint {
    #[cfg(feature = "prometheus")]
    _cqd: cqd_core::export::ExporterThread,
    #[cfg(feature = "prometheus")]
    _demo: imp::SamplerThread,
    addr: SocketAddr,
}

impl Endpoint {
    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Installs the recorder and its HTTP listener on `addr` and starts the
/// publishers.
///
/// # Errors
/// [`DemoError::Setup`] if the address cannot be listened on (in use, not
/// this machine's) or a recorder is installed already;
/// [`DemoError::Config`] without the feature.
pub fn start(addr: SocketAddr) -> Result<Endpoint, DemoError> {
    #[cfg(feature = "prometheus")]
    {
        let (cqd, demo) = imp::start(addr)?;
        Ok(Endpoint {
            _cqd: cqd,
            _demo: demo,
            addr,
        })
    }
    #[cfg(not(feature = "prometheus"))]
    {
        let _ = addr;
        Err(DemoError::Config(crate::config::NO_PROMETHEUS.into()))
    }
}

/// What one half of a run registered with the endpoint (nothing when no
/// endpoint runs, or without the feature).
#[derive(Debug, Default)]
pub struct Watched {
    #[cfg(feature = "prometheus")]
    inner: Option<imp::Registered>,
}

impl Watched {
    /// Starts watching, if an endpoint runs.
    pub fn new() -> Self {
        Watched {
            #[cfg(feature = "prometheus")]
            inner: imp::exporter().map(|_| imp::Registered::default()),
        }
    }

    /// Exports a CQ's metrics (label `cq`).
    pub fn cq<W: Send + 'static>(&mut self, cq: &CqHandle<W>) {
        #[cfg(feature = "prometheus")]
        if let (Some(r), Some(e)) = (&mut self.inner, imp::exporter()) {
            match e.add_cq(cq) {
                Ok(()) => r.cqs.push(cq.name().to_string()),
                Err(err) => tracing::warn!("prometheus: {err}"),
            }
        }
        #[cfg(not(feature = "prometheus"))]
        let _ = cq;
    }

    /// Exports a poller's metrics (label `poller`).
    pub fn poller(&mut self, poller: &PollerThread) {
        #[cfg(feature = "prometheus")]
        if let (Some(r), Some(e)) = (&mut self.inner, imp::exporter()) {
            match e.add_poller(poller) {
                Ok(()) => r.pollers.push(poller.monitor().name().to_string()),
                Err(err) => tracing::warn!("prometheus: {err}"),
            }
        }
        #[cfg(not(feature = "prometheus"))]
        let _ = poller;
    }

    /// Exports a pool's metrics (labels `pool`, `worker`, `sink`).
    pub fn pool(&mut self, pool: &Pool) {
        #[cfg(feature = "prometheus")]
        if let (Some(r), Some(e)) = (&mut self.inner, imp::exporter()) {
            match e.add_pool(pool) {
                Ok(()) => r.pools.push(pool.monitor().name().to_string()),
                Err(err) => tracing::warn!("prometheus: {err}"),
            }
        }
        #[cfg(not(feature = "prometheus"))]
        let _ = pool;
    }

    /// Publishes the load's counters every period.
    pub fn load(&mut self, shared: &Arc<LoadShared>) {
        #[cfg(feature = "prometheus")]
        if let Some(r) = &mut self.inner {
            let shared = Arc::clone(shared);
            r.samplers.push(imp::add_sampler(Box::new(move || {
                imp::publish_load(&shared)
            })));
        }
        #[cfg(not(feature = "prometheus"))]
        let _ = shared;
    }

    /// Publishes a server's counters every period (label `server`).
    pub fn server(&mut self, name: &str, stats: &Arc<ServerStats>) {
        #[cfg(feature = "prometheus")]
        if let Some(r) = &mut self.inner {
            let (name, stats) = (name.to_string(), Arc::clone(stats));
            r.samplers.push(imp::add_sampler(Box::new(move || {
                imp::publish_server(&name, &stats)
            })));
        }
        #[cfg(not(feature = "prometheus"))]
        let _ = (name, stats);
    }

    /// Publishes everything once more (the final values), then stops
    /// sampling it; the endpoint keeps the last values.
    pub fn release(self) {
        #[cfg(feature = "prometheus")]
        if let Some(r) = self.inner {
            r.release();
        }
    }
}

/// The load's per-request latency histogram, by op.
#[derive(Debug, Clone)]
pub struct Latency {
    #[cfg(feature = "prometheus")]
    read: metrics::Histogram,
    #[cfg(feature = "prometheus")]
    write: metrics::Histogram,
}

impl Latency {
    /// The histogram handles (no-ops when no endpoint runs).
    pub fn new() -> Self {
        Latency {
            #[cfg(feature = "prometheus")]
            read: metrics::histogram!("cqd_demo_latency_seconds", "op" => "read"),
            #[cfg(feature = "prometheus")]
            write: metrics::histogram!("cqd_demo_latency_seconds", "op" => "write"),
        }
    }

    /// Records one request's latency.
    #[inline]
    pub fn record(&self, read: bool, latency: Duration) {
        #[cfg(feature = "prometheus")]
        if read {
            self.read.record(latency);
        } else {
            self.write.record(latency);
        }
        #[cfg(not(feature = "prometheus"))]
        let _ = (read, latency);
    }
}

impl Default for Latency {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(feature = "prometheus")]
mod imp {
    use std::net::SocketAddr;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
    use std::thread::JoinHandle;
    use std::time::Instant;

    use cqd_core::export::{ExporterThread, MetricsExporter};
    use metrics_exporter_prometheus::{BuildError, PrometheusBuilder};

    use super::{DEMO_METRICS, PERIOD};
    use crate::load::LoadShared;
    use crate::server::ServerStats;
    use crate::DemoError;

    static EXPORTER: OnceLock<MetricsExporter> = OnceLock::new();

    type Sample = Box<dyn Fn() + Send>;

    static SAMPLERS: Mutex<Vec<(u64, Sample)>> = Mutex::new(Vec::new());
    static NEXT_ID: AtomicU64 = AtomicU64::new(0);

    fn samplers() -> MutexGuard<'static, Vec<(u64, Sample)>> {
        SAMPLERS.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The exporter, once an endpoint runs.
    pub(super) fn exporter() -> Option<&'static MetricsExporter> {
        EXPORTER.get()
    }

    pub(super) fn start(addr: SocketAddr) -> Result<(ExporterThread, SamplerThread), DemoError> {
        // Latency buckets from 10 µs to 1 s (the default's start at 5 ms).
        let buckets = [
            10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
            100e-3, 250e-3, 1.0,
        ];
        PrometheusBuilder::new()
            .with_http_listener(addr)
            .set_buckets(&buckets)
            .and_then(PrometheusBuilder::install)
            .map_err(|e| {
                DemoError::Setup(match e {
                    BuildError::FailedToCreateHTTPListener(why) => {
                        format!("--prometheus {addr}: cannot listen there: {why}")
                    }
                    other => format!("--prometheus {addr}: {other}"),
                })
            })?;
        for (name, help) in DEMO_METRICS {
            if name.ends_with("_seconds") {
                metrics::describe_histogram!(*name, metrics::Unit::Seconds, *help);
            } else if name.ends_with("_total") {
                metrics::describe_counter!(*name, *help);
            } else {
                metrics::describe_gauge!(*name, *help);
            }
        }
        let exporter = EXPORTER.get_or_init(MetricsExporter::new);
        let cqd = exporter
            .spawn(PERIOD)
            .map_err(|e| DemoError::Setup(format!("metrics publisher: {e}")))?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let join = std::thread::Builder::new()
            .name("cqd-demo-metrics".into())
            .spawn(move || {
                let mut next = Instant::now();
                while !flag.load(Ordering::Acquire) {
                    for (_, f) in samplers().iter() {
                        f();
                    }
                    next += PERIOD;
                    let now = Instant::now();
                    if next > now {
                        std::thread::park_timeout(next - now);
                    }
                    next = next.max(Instant::now());
                }
                for (_, f) in samplers().iter() {
                    f();
                }
            })
            .map_err(|e| DemoError::Setup(format!("metrics sampler: {e}")))?;
        Ok((
            cqd,
            SamplerThread {
                stop,
                join: Some(join),
            },
        ))
    }

    /// The demo's sampler thread; dropping it stops it.
    #[derive(Debug)]
    pub(super) struct SamplerThread {
        stop: Arc<AtomicBool>,
        join: Option<JoinHandle<()>>,
    }

    impl Drop for SamplerThread {
        fn drop(&mut self) {
            self.stop.store(true, Ordering::Release);
            if let Some(j) = self.join.take() {
                j.thread().unpark();
                let _ = j.join();
            }
        }
    }

    pub(super) fn add_sampler(f: Sample) -> u64 {
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        samplers().push((id, f));
        id
    }

    #[derive(Debug, Default)]
    pub(super) struct Registered {
        pub(super) cqs: Vec<String>,
        pub(super) pollers: Vec<String>,
        pub(super) pools: Vec<String>,
        pub(super) samplers: Vec<u64>,
    }

    impl Registered {
        pub(super) fn release(self) {
            let mut s = samplers();
            for (id, f) in s.iter() {
                if self.samplers.contains(id) {
                    f();
                }
            }
            s.retain(|(id, _)| !self.samplers.contains(id));
            drop(s);
            if let Some(e) = exporter() {
                e.publish();
                for n in &self.cqs {
                    e.remove_cq(n);
                }
                for n in &self.pollers {
                    e.remove_poller(n);
                }
                for n in &self.pools {
                    e.remove_pool(n);
                }
            }
        }
    }

    pub(super) fn publish_load(shared: &LoadShared) {
        let c = shared.counts();
        metrics::counter!("cqd_demo_ops_total", "op" => "read").absolute(c.reads);
        metrics::counter!("cqd_demo_ops_total", "op" => "write").absolute(c.writes);
        metrics::counter!("cqd_demo_failures_total").absolute(c.failed);
        metrics::counter!("cqd_demo_timeouts_total").absolute(c.timeouts);
        metrics::counter!("cqd_demo_dead_connections_total").absolute(c.dead_connections);
        metrics::gauge!("cqd_demo_inflight").set(shared.inflight().max(0) as f64);
    }

    pub(super) fn publish_server(name: &str, stats: &ServerStats) {
        let c = stats.counts();
        let server = name.to_string();
        metrics::counter!("cqd_demo_server_requests_total", "server" => server.clone(), "op" => "read")
            .absolute(c.reads);
        metrics::counter!("cqd_demo_server_requests_total", "server" => server.clone(), "op" => "write")
            .absolute(c.writes);
        metrics::counter!("cqd_demo_server_errors_total", "server" => server).absolute(c.errors);
    }
}
