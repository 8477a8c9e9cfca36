//! The metrics exporter (feature `metrics`) on the simulated NIC: after real
//! traffic — posts through the posting call, a poller thread in Event mode,
//! a worker pool — a recorder holds every metric of docs/metrics.md under
//! its documented name, type and labels, with the values of cqd's own
//! snapshots; the alert metrics (overflow, stale wr_ids, stuck requests)
//! move when those things happen; the exporter's thread publishes through
//! the global recorder.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::wait_until;
use cqd::core::budget::{BudgetOptions, CqBudget};
use cqd::core::export::{catalog, MetricKind, MetricsExporter, BATCH_SIZE_LABELS};
use cqd::core::ledger::Queue;
use cqd::core::topology::{PoolConfig, TopologyConfig};
use cqd::core::{
    split, Completion, CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Opcode, Outbox,
    PollMode, PollerBuilder, RecvDone, Route, SendDone, Side, Status, WrLedger,
};
use cqd::sim::{sim_cq, sim_cq_with_ledger, Faults, LoopWr, Loopback};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

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

/// Publishes once through a fresh local recorder and returns what it holds.
fn publish(exporter: &MetricsExporter) -> HashMap<String, DebugValue> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    metrics::with_local_recorder(&recorder, || exporter.publish());
    values(&snapshotter)
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

/// Hands each receive to a worker; counts what it saw.
struct Conn {
    seen: Arc<AtomicU64>,
}

impl Handler<u64> for Conn {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, u64>) {
        self.seen.fetch_add(1, Relaxed);
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, u64>) {
        self.seen.fetch_add(1, Relaxed);
        out.push_to(Route::LeastLoaded, u64::from(d.tag()));
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, u64>) {
        self.seen.fetch_add(1, Relaxed);
    }
}

struct Quiet;

impl Handler for Quiet {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

#[test]
fn sim_traffic_reaches_the_recorder_under_every_documented_name() {
    const N: u64 = 2000;
    const CAPACITY: u32 = 4096;
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("io", 2))
        .validate()
        .unwrap();
    let worked = Arc::new(AtomicU64::new(0));
    let w = Arc::clone(&worked);
    let (pool, mut sinks) = topology
        .take_pool("io")
        .unwrap()
        .spawn(1, move |_| {
            let w = Arc::clone(&w);
            move |_: u64| {
                w.fetch_add(1, Relaxed);
            }
        })
        .unwrap();
    let budget = CqBudget::new(
        "rx0",
        CAPACITY,
        BudgetOptions {
            admission: true,
            credits: Some(CAPACITY),
        },
    );
    let admitted = budget.admit("loopback", CAPACITY).unwrap();
    let (sim, source) = sim_cq_with_ledger(
        "rx0",
        CAPACITY,
        Faults::default(),
        WrLedger::with_budget(budget),
    )
    .unwrap();
    let options = CqOptions {
        measure_handlers: true,
        ..CqOptions::default()
    };
    let (cq, handle) = split::<u64>(source, options).unwrap();
    let seen = Arc::new(AtomicU64::new(0));
    let reg = handle
        .register(Conn {
            seen: Arc::clone(&seen),
        })
        .unwrap();
    let thread = PollerBuilder::new("p0", sinks.pop().unwrap())
        .mode(PollMode::Event)
        .wake_timeout(Duration::from_millis(10))
        .watchdog(Duration::from_secs(60))
        .cq(cq)
        .spawn()
        .unwrap();
    let exporter = MetricsExporter::new().batch_histogram(true);
    exporter.add_cq(&handle).unwrap();
    exporter.add_poller(&thread).unwrap();
    exporter.add_pool(&pool).unwrap();

    // Bursts of 16 with pauses, so that the poller sleeps, is notified and
    // re-arms; every 50th request is a flushed send.
    let qp = Loopback::new(sim.clone(), 1);
    let (mut recvs, mut flushes) = (0, 0);
    for i in 0..N {
        let tag = i % (1 << 20);
        if i % 50 == 0 {
            let wr = LoopWr::new(tag, OpKind::Send).failing(Status::WrFlush);
            reg.post_send(&qp, &mut [wr]).unwrap();
            flushes += 1;
        } else if i % 2 == 0 {
            reg.post_send(&qp, &mut [LoopWr::new(tag, OpKind::Send)])
                .unwrap();
        } else {
            let wr = LoopWr::new(tag, OpKind::Recv).with_len(64);
            reg.post_recv(&qp, &mut [wr]).unwrap();
            recvs += 1;
        }
        if i % 16 == 15 {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let ledger = handle.ledger().unwrap().clone();
    assert!(
        wait_until(Duration::from_secs(30), || seen.load(Relaxed) == N
            && worked.load(Relaxed) == recvs
            && ledger.snapshot(Instant::now()).scans > 0),
        "handled {} of {N}, worked {} of {recvs}",
        seen.load(Relaxed),
        worked.load(Relaxed)
    );

    // While running: the published values are cqd's own snapshots.
    let v = publish(&exporter);
    let snap = handle.snapshot();
    assert_eq!(counter(&v, "cqd_cq_completions_total{cq=rx0}"), N);
    assert_eq!(snap.completions, N);
    for (name, value) in [
        ("cqd_cq_polls_total", snap.polls),
        ("cqd_cq_empty_polls_total", snap.empty_polls),
        ("cqd_cq_events_total", snap.events),
        ("cqd_cq_arms_total", snap.arms),
        ("cqd_cq_acks_total", snap.acks),
    ] {
        // The poller may have moved on since: never behind the snapshot
        // taken before, never ahead of one taken after.
        let published = counter(&v, &format!("{name}{{cq=rx0}}"));
        assert!(published <= value, "{name}: {published} > {value}");
    }
    assert!(
        counter(&v, "cqd_cq_events_total{cq=rx0}") > 0,
        "Event mode slept and was notified"
    );
    assert!(counter(&v, "cqd_cq_arms_total{cq=rx0}") > 0);
    assert_eq!(
        counter(&v, "cqd_cq_errors_total{cq=rx0,status=wr_flush}"),
        flushes
    );
    assert_eq!(counter(&v, "cqd_cq_flushes_total{cq=rx0}"), flushes);
    for alert in [
        "cqd_cq_stale_wr_ids_total",
        "cqd_cq_foreign_wr_ids_total",
        "cqd_cq_overflows_total",
        "cqd_cq_handler_panics_total",
        "cqd_cq_stuck_wrs_total",
        "cqd_cq_lost_completions_total",
    ] {
        assert_eq!(counter(&v, &format!("{alert}{{cq=rx0}}")), 0, "{alert}");
    }
    assert_eq!(gauge(&v, "cqd_cq_in_error{cq=rx0}"), 0.0);
    assert!(gauge(&v, "cqd_cq_handler_seconds_total{cq=rx0}") > 0.0);
    // The ledger and budget: nothing outstanding, every credit back.
    assert_eq!(gauge(&v, "cqd_cq_outstanding_wrs{cq=rx0}"), 0.0);
    assert_eq!(gauge(&v, "cqd_cq_oldest_outstanding_seconds{cq=rx0}"), 0.0);
    assert_eq!(gauge(&v, "cqd_cq_credits_in_use{cq=rx0}"), 0.0);
    assert!(gauge(&v, "cqd_cq_credits_high_water{cq=rx0}") >= 1.0);
    assert_eq!(
        gauge(&v, "cqd_cq_budget_reserved{cq=rx0}"),
        f64::from(CAPACITY)
    );
    assert!(counter(&v, "cqd_cq_watchdog_scans_total{cq=rx0}") > 0);
    // Batches: the size buckets add up to the non-empty polls, and the
    // histogram has one sample per batch.
    let batches: u64 = BATCH_SIZE_LABELS
        .iter()
        .map(|size| counter(&v, &format!("cqd_cq_batches_total{{cq=rx0,size={size}}}")))
        .sum();
    let polls = counter(&v, "cqd_cq_polls_total{cq=rx0}");
    let empty = counter(&v, "cqd_cq_empty_polls_total{cq=rx0}");
    assert_eq!(batches, polls - empty);
    match v.get("cqd_cq_batch_size{cq=rx0}") {
        Some(DebugValue::Histogram(h)) => assert_eq!(h.len() as u64, batches),
        other => panic!("no batch histogram: {other:?}"),
    }
    // The poller and the pool.
    assert_eq!(counter(&v, "cqd_poller_handed_off_total{poller=p0}"), recvs);
    assert!(counter(&v, "cqd_poller_sleeps_total{poller=p0}") > 0);
    assert!(gauge(&v, "cqd_poller_cpu_seconds_total{poller=p0}") > 0.0);
    let items: u64 = (0..2)
        .map(|w| {
            counter(
                &v,
                &format!("cqd_pool_worker_items_total{{pool=io,worker={w}}}"),
            )
        })
        .sum();
    assert_eq!(items, recvs);
    assert_eq!(
        counter(&v, "cqd_pool_sink_accepted_total{pool=io,sink=0}"),
        recvs
    );
    assert_eq!(gauge(&v, "cqd_pool_queued_items{pool=io}"), 0.0);

    // Every metric of the catalog was published, each with its kind and
    // its labels (the budget, the ledger and the histogram included).
    let published: HashMap<&str, (MetricKind, BTreeSet<String>)> = v
        .iter()
        .map(|(key, value)| {
            let (name, labels) = key.split_once('{').unwrap();
            let kind = match value {
                DebugValue::Counter(_) => MetricKind::Counter,
                DebugValue::Gauge(_) => MetricKind::Gauge,
                DebugValue::Histogram(_) => MetricKind::Histogram,
            };
            let keys = labels
                .trim_end_matches('}')
                .split(',')
                .map(|l| l.split('=').next().unwrap().to_string())
                .collect();
            (name, (kind, keys))
        })
        .collect();
    for def in catalog() {
        let labels: BTreeSet<String> = def.labels.iter().map(|l| l.to_string()).collect();
        assert_eq!(
            published.get(def.name),
            Some(&(def.kind, labels)),
            "{}",
            def.name
        );
    }
    assert_eq!(
        published.len(),
        catalog().len(),
        "a name outside the catalog"
    );

    // After the stop, the final counters: every notification acknowledged.
    let report = cqd::core::shutdown(|| {}, [thread], [pool]);
    assert!(report.is_clean(), "{:?}", report.errors);
    let v = publish(&exporter);
    let last = &report.pollers[0].cqs[0];
    assert_eq!(counter(&v, "cqd_cq_events_total{cq=rx0}"), last.events);
    assert_eq!(counter(&v, "cqd_cq_acks_total{cq=rx0}"), last.events);
    assert_eq!(counter(&v, "cqd_cq_polls_total{cq=rx0}"), last.polls);
    assert_eq!(
        counter(&v, "cqd_poller_loops_total{poller=p0}"),
        report.pollers[0].poller.loops
    );
    assert_eq!(
        counter(&v, "cqd_pool_worker_batches_total{pool=io,worker=0}")
            + counter(&v, "cqd_pool_worker_batches_total{pool=io,worker=1}"),
        report.pools[0]
            .workers
            .iter()
            .map(|w| w.batches)
            .sum::<u64>()
    );
    drop((reg, admitted));
}

#[test]
fn overflow_stale_wr_ids_and_stuck_requests_move_the_alert_metrics() {
    let (sim, source) = sim_cq("tiny", 4, Faults::default()).unwrap();
    let (cq, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let thread = PollerBuilder::new("alerts", NoSink)
        .mode(PollMode::Event)
        .wake_timeout(Duration::from_millis(10))
        .watchdog(Duration::from_millis(1))
        .cq(cq)
        .spawn()
        .unwrap();
    let exporter = MetricsExporter::new();
    exporter.add_cq(&handle).unwrap();
    exporter.add_poller(&thread).unwrap();
    let v = publish(&exporter);
    assert_eq!(counter(&v, "cqd_cq_stale_wr_ids_total{cq=tiny}"), 0);
    assert_eq!(counter(&v, "cqd_cq_overflows_total{cq=tiny}"), 0);
    assert_eq!(counter(&v, "cqd_cq_stuck_wrs_total{cq=tiny}"), 0);

    // A stale wr_id: its handler was retired before it came back.
    let reg = handle.register(Quiet).unwrap();
    let stale = reg.wr_id(OpKind::Send, 1).unwrap();
    handle.unregister(reg.key()).unwrap();
    assert!(wait_until(Duration::from_secs(10), || handle
        .snapshot()
        .unregistrations
        == 1));
    sim.push(Completion::success(stale, Opcode::Send, 1), false)
        .unwrap();
    // A send that never completes: the watchdog reports it (a receive
    // posted ahead would be idle, not stuck).
    let ledger = sim.ledger().clone();
    let _queue = ledger.open_queue(9, Queue::Send);
    ledger.posted(9, Side::Send, &[0xabc], Instant::now());
    assert!(wait_until(Duration::from_secs(10), || {
        handle.snapshot().stale_wr_ids == 1 && ledger.snapshot(Instant::now()).stuck == 1
    }));
    let v = publish(&exporter);
    assert_eq!(counter(&v, "cqd_cq_stale_wr_ids_total{cq=tiny}"), 1);
    assert_eq!(counter(&v, "cqd_cq_stuck_wrs_total{cq=tiny}"), 1);
    assert_eq!(gauge(&v, "cqd_cq_outstanding_wrs{cq=tiny}"), 1.0);
    assert!(gauge(&v, "cqd_cq_oldest_outstanding_seconds{cq=tiny}") > 0.0);

    // An overflow: six completions at once on a CQ of four.
    let burst = [Completion::success(0x1234, Opcode::Send, 1); 6];
    assert!(sim.push_all(&burst).is_err(), "the fifth overflows");
    assert!(wait_until(Duration::from_secs(10), || {
        let s = handle.snapshot();
        s.overflows == 1 && s.in_error && s.completions == 5
    }));
    let v = publish(&exporter);
    assert_eq!(counter(&v, "cqd_cq_overflows_total{cq=tiny}"), 1);
    assert_eq!(gauge(&v, "cqd_cq_in_error{cq=tiny}"), 1.0);
    assert!(counter(&v, "cqd_cq_async_events_total{cq=tiny}") >= 1);
    // The four that fit are still polled: foreign wr_ids, never dispatched.
    assert_eq!(counter(&v, "cqd_cq_foreign_wr_ids_total{cq=tiny}"), 4);

    ledger.retire(9, Side::Recv, 0xabc);
    thread.stop().unwrap();
}

#[test]
fn the_exporter_thread_publishes_through_the_global_recorder() {
    // The only test of this binary that installs a global recorder (the
    // others publish through local ones).
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    recorder.install().unwrap();
    let (sim, source) = sim_cq("global", 256, Faults::default()).unwrap();
    let (cq, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let thread = PollerBuilder::new("global", NoSink)
        .mode(PollMode::Event)
        .cq(cq)
        .spawn()
        .unwrap();
    let exporter = MetricsExporter::new();
    exporter.add_cq(&handle).unwrap();
    exporter.add_poller(&thread).unwrap();
    let publisher = exporter.spawn(Duration::from_millis(5)).unwrap();
    let qp = Loopback::new(sim, 1);
    let reg = handle.register(Quiet).unwrap();
    for tag in 0..100 {
        reg.post_send(&qp, &mut [LoopWr::new(tag, OpKind::Send)])
            .unwrap();
    }
    // A snapshot of the debugging recorder takes counters back to 0; the
    // next publication sets them to the total again.
    let mut last = 0;
    assert!(
        wait_until(Duration::from_secs(10), || {
            let v = values(&snapshotter);
            if let Some(DebugValue::Counter(n)) = v.get("cqd_cq_completions_total{cq=global}") {
                last = *n;
            }
            last == 100
        }),
        "published {last} of 100"
    );
    let report = thread.stop().unwrap();
    // Stopping the publisher publishes once more: the final counters.
    publisher.stop();
    let v = values(&snapshotter);
    assert_eq!(
        counter(&v, "cqd_poller_loops_total{poller=global}"),
        report.poller.loops
    );
    assert_eq!(
        counter(&v, "cqd_cq_acks_total{cq=global}"),
        report.cqs[0].acks
    );
    drop(reg);
}

/// docs/metrics.md documents every metric of the catalog — name, type and
/// labels, in a table row — and nothing else.
#[test]
fn docs_metrics_md_documents_the_catalog() {
    let doc = include_str!("../docs/metrics.md");
    let mut rows = HashMap::new();
    for line in doc.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 5 || !cells[1].starts_with("`cqd_") {
            continue;
        }
        let name = cells[1].trim_matches('`');
        let labels: Vec<&str> = cells[3]
            .split(',')
            .map(|l| l.trim().trim_matches('`'))
            .filter(|l| !l.is_empty())
            .collect();
        assert!(
            rows.insert(name, (cells[2], labels)).is_none(),
            "{name} documented twice"
        );
    }
    for def in catalog() {
        let kind = match def.kind {
            MetricKind::Counter => "counter",
            MetricKind::Gauge => "gauge",
            MetricKind::Histogram => "histogram",
            _ => unreachable!("a new kind"),
        };
        let Some((doc_kind, labels)) = rows.remove(def.name) else {
            panic!("{} is not documented in docs/metrics.md", def.name);
        };
        assert_eq!(doc_kind, kind, "{}", def.name);
        assert_eq!(labels, def.labels, "{}", def.name);
    }
    assert!(
        rows.is_empty(),
        "documented but not published: {:?}",
        rows.keys()
    );
}
