//! `shutdown` covers a CQ driven by a loop of your own: the loop's thread
//! ends with `CqPoller::stop`, the system report holds its CQ and its
//! accounts beside the poller threads', and a request it never saw complete
//! makes the verdict name it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cqd::core::*;
use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit, RecvWr, SendWr, WrOp};

struct Count(Arc<AtomicU64>);

impl Handler for Count {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }
}

/// A loop of the user's own on its own thread, polling until told to stop,
/// then stopping the CQ as a poller thread would; the `Stopper` that ends
/// it for `shutdown`.
fn custom_loop(unbound: UnboundCq<NoWork>, drain: Duration) -> Stopper {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let thread = std::thread::spawn(move || {
        let mut cq = unbound.bind();
        let mut out = VecDeque::new();
        while !flag.load(Ordering::Acquire) {
            if cq.poll_once(&mut out).expect("poll") == 0 {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        let how = CustomStop {
            drain_timeout: drain,
            ..CustomStop::default()
        };
        cq.stop(&mut NoSink, &mut out, how)
    });
    Stopper::custom("my-loop", move || {
        stop.store(true, Ordering::Release);
        thread.join().map_err(|_| "the loop panicked".to_string())
    })
}

#[test]
fn a_custom_loops_cq_is_in_the_system_report_beside_a_poller_thread() {
    let dev = Device::open("custom0");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("mine", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let (cq2, unbound2, handle2) = dev
        .create_dispatched_cq("theirs", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let thread = PollerBuilder::new("pt", NoSink)
        .cq(unbound2)
        .spawn()
        .unwrap();
    let mine = custom_loop(unbound, Duration::from_secs(5));
    let seen = Arc::new(AtomicU64::new(0));
    let conn = handle.register(Count(Arc::clone(&seen))).unwrap();
    let other = handle2.register(Count(Arc::clone(&seen))).unwrap();
    let pd = dev.alloc_pd();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq2, &cq2, QpCap::default()))
        .unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(8192, Access::ALL).unwrap();
    let bufs: Vec<_> = (0..4).map(|i| [mr.sge(i * 1024, 1024)]).collect();
    let mut recvs: Vec<_> = (0..4).map(|i| RecvWr::new(i as u64, &bufs[i])).collect();
    other.post_recv(&b, &mut recvs).unwrap();
    // Two more receives on a, which never come back but as flushes.
    let more: Vec<_> = (4..6).map(|i| [mr.sge(i * 1024, 1024)]).collect();
    let mut recvs: Vec<_> = (0..2).map(|i| RecvWr::new(i as u64, &more[i])).collect();
    conn.post_recv(&a, &mut recvs).unwrap();
    let data = [mr.sge(7168, 64)];
    let mut sends: Vec<_> = (0..4).map(|t| SendWr::new(t, WrOp::Send, &data)).collect();
    conn.post_send(&a, &mut sends).unwrap();
    let report = shutdown(
        || {
            a.force_error();
            b.force_error();
        },
        [Stopper::from(thread), mine],
        [],
    );
    assert!(report.is_clean(), "{report}");
    let names: Vec<&str> = report
        .pollers
        .iter()
        .map(|p| p.poller.name.as_str())
        .collect();
    assert_eq!(names, ["pt", "mine"]);
    let custom = &report.pollers[1];
    assert_eq!(custom.cqs[0].name, "mine");
    assert!(custom.accounts.is_balanced(), "{}", custom.accounts);
    let posted: u64 = custom.accounts.accounts.iter().map(|a| a.posted).sum();
    assert_eq!(posted, 6, "4 sends and 2 receives, on the custom loop's CQ");
    assert_eq!(seen.load(Ordering::Relaxed), 4 + 4 + 2);
}

#[test]
fn a_request_a_custom_loop_never_saw_complete_is_a_finding() {
    let dev = Device::open("custom1");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("lonely", 1024, CqConfig::default(), CqOptions::default())
        .unwrap();
    let mine = custom_loop(unbound, Duration::from_millis(50));
    let conn = handle.register(Count(Arc::new(AtomicU64::new(0)))).unwrap();
    let pd = dev.alloc_pd();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(1024, Access::ALL).unwrap();
    let buf = [mr.sge(0, 1024)];
    conn.post_recv(&a, &mut [RecvWr::new(0, &buf)]).unwrap();
    // No flush: the receive is still outstanding at the stop.
    let report = shutdown(|| {}, [mine], []);
    assert!(!report.is_clean());
    let findings = report.findings();
    assert!(
        findings
            .iter()
            .any(|f| f.kind == FindingKind::DrainTimedOut && f.detail.contains("lonely")),
        "{report}"
    );
}
