//! The stop's verdict names the field's mistakes (`cqd_core::verdict`): a
//! post that bypassed the accounts, a completion for a handler that is gone,
//! a handler that panicked. Each leaves the report unclean with a finding
//! that names the CQ, the QP and the handler; a run without them is clean.

use std::time::Duration;

use cqd::core::*;
use cqd::sim::{connect, Access, CqConfig, Device, Mr, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp};

struct Quiet {
    panic_on_recv: bool,
}

/// A handler that blocks in every receive.
struct Blocking;

impl Handler for Blocking {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        std::thread::sleep(Duration::from_millis(3));
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

impl Handler for Quiet {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        if self.panic_on_recv {
            panic!("a handler bug");
        }
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

struct Rig {
    _dev: Device,
    poller: PollerThread,
    handle: CqHandle<NoWork>,
    a: Qp,
    b: Qp,
    mr: Mr,
}

fn rig(name: &str) -> Rig {
    rig_with(name, |b| b)
}

/// A rig whose poller `more` configures further.
fn rig_with(
    name: &str,
    more: impl FnOnce(PollerBuilder<NoWork, NoSink>) -> PollerBuilder<NoWork, NoSink>,
) -> Rig {
    let dev = Device::open(name);
    let (cq, unbound, handle) = dev
        .create_dispatched_cq(name, 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let builder = PollerBuilder::new(format!("{name}-poller"), NoSink)
        .drain_timeout(Duration::from_millis(200))
        .cq(unbound);
    let poller = more(builder).spawn().unwrap();
    let pd = dev.alloc_pd();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(4096, Access::ALL).unwrap();
    Rig {
        _dev: dev,
        poller,
        handle,
        a,
        b,
        mr,
    }
}

/// One SEND from `a` to a receive on `b`, both through `reg`.
fn exchange(r: &Rig, reg: &Registration) {
    let (src, dst) = ([r.mr.sge(0, 64)], [r.mr.sge(1024, 64)]);
    reg.post_recv(&r.b, &mut [RecvWr::new(1, &dst)]).unwrap();
    reg.post_send(&r.a, &mut [SendWr::new(2, WrOp::Send, &src)])
        .unwrap();
}

fn stop(r: Rig) -> PollerReport {
    std::thread::sleep(Duration::from_millis(50));
    r.poller.stop().unwrap()
}

#[test]
fn a_run_without_mistakes_is_clean() {
    let r = rig("clean");
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    exchange(&r, &reg);
    let report = stop(r);
    assert_eq!(report.findings(), [], "{:?}", report.findings());
    assert!(report.is_clean());
    // Printed as the demo prints it.
    let text = report.to_string();
    for line in [
        "poller clean-poller: 2 completions",
        "  cq clean capacity 256, 2 completions, 0 flushes, 0 other errors, 0 stale, 0 foreign, overflows 0",
        "  accounts: all 2 requests completed, 0 of them flushed",
        "verdict: clean",
    ] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }
}

#[test]
fn the_system_report_prints_every_poller_and_one_verdict() {
    let r = rig("sys");
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    exchange(&r, &reg);
    let dst = [r.mr.sge(1024, 64)];
    r.b.post_recv_unaccounted(&[RecvWr::new(7, &dst)]).unwrap();
    r.b.modify(cqd::sim::Modify::Err).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let system = shutdown(|| {}, [r.poller], []);
    assert!(!system.is_clean());
    let text = system.to_string();
    assert!(text.contains("poller sys-poller:"), "{text}");
    assert!(
        text.contains(
            "verdict: 1 finding\n  - CQ sys: 1 completions with a wr_id cqd did not make"
        ),
        "{text}"
    );
    assert_eq!(text.matches("verdict:").count(), 1, "{text}");
}

#[test]
fn an_unaccounted_post_is_named_with_its_cq_and_qp() {
    let r = rig("raw");
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    exchange(&r, &reg);
    // The backend's own post: no handler, no account. Before the verdict
    // named it, this run was clean.
    let (src, dst) = ([r.mr.sge(0, 64)], [r.mr.sge(1024, 64)]);
    r.b.post_recv_unaccounted(&[RecvWr::new(7, &dst)]).unwrap();
    r.a.post_send_unaccounted(&[SendWr::new(8, WrOp::Send, &src)])
        .unwrap();
    let (qa, qb) = (r.a.qpn(), r.b.qpn());
    let report = stop(r);
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert!(!report.is_clean());
    let f = report.findings();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].kind, FindingKind::ForeignWrId);
    let text = f[0].to_string();
    assert!(text.contains("CQ raw: 2 completions"), "{text}");
    assert!(
        text.contains(&format!("QP {qa}")) || text.contains(&format!("QP {qb}")),
        "{text}"
    );
    assert!(text.contains("post_send_unaccounted"), "{text}");
}

#[test]
fn a_completion_for_a_handler_that_is_gone_is_named() {
    let r = rig("stale");
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    exchange(&r, &reg);
    // A wr_id for the handler's slot one generation on: decodes, names no
    // live handler.
    let key = reg.key();
    let gone = HandlerKey::new(key.slot(), key.generation().wrapping_add(1)).unwrap();
    let wr_id = gone.wr_id(OpKind::Recv, 3).unwrap();
    let dst = [r.mr.sge(1024, 64)];
    r.b.post_recv_unaccounted(&[RecvWr::new(wr_id, &dst)])
        .unwrap();
    r.b.modify(cqd::sim::Modify::Err).unwrap();
    let qb = r.b.qpn();
    let report = stop(r);
    let f = report.findings();
    assert!(
        f.iter().any(|f| f.kind == FindingKind::StaleWrId
            && f.detail.contains(&format!("handler {gone} from QP {qb}"))),
        "{f:?}"
    );
    assert!(!report.is_clean());
}

#[test]
fn a_handler_that_panicked_is_named() {
    let r = rig("panic");
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: true,
        })
        .unwrap();
    exchange(&r, &reg);
    let report = stop(r);
    // The completion still counted as delivered: the accounts balance, and
    // the verdict is not clean all the same.
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let f = report.findings();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].kind, FindingKind::HandlerPanic);
    assert!(
        f[0].detail.contains(&format!(
            "CQ panic: 1 handler callbacks panicked, the last in handler {}",
            reg.key()
        )),
        "{}",
        f[0]
    );
}

#[test]
fn a_handler_that_forgets_to_repost_is_named_with_its_queue() {
    let r = rig("dry");
    // Quiet never reposts: the server's two receives are consumed, its
    // queue is left empty, and the client's third SEND waits on RNR.
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    let (src, dst) = ([r.mr.sge(0, 64)], [r.mr.sge(1024, 64)]);
    reg.post_recv(&r.b, &mut [RecvWr::new(1, &dst), RecvWr::new(2, &dst)])
        .unwrap();
    for t in 0..2 {
        reg.post_send(&r.a, &mut [SendWr::new(t, WrOp::Send, &src)])
            .unwrap();
    }
    assert!(wait(|| r.handle.snapshot().recv_queues_dry == 1));
    // Still dry a grace period later: the snapshot names the queue.
    std::thread::sleep(cqd::core::cq::DRY_GRACE + Duration::from_millis(100));
    let qb = r.b.qpn();
    assert_eq!(r.handle.snapshot().left_dry, [qb]);
    let report = stop(r);
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let f = report.findings();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].kind, FindingKind::RecvQueueDry);
    assert!(
        f[0].detail.contains(&format!("QP {qb} left dry"))
            && f[0].detail.contains(&format!("handler {}", reg.key())),
        "{}",
        f[0]
    );
}

#[test]
fn pre_posted_receives_are_idle_for_the_watchdog_and_a_reposting_server_is_clean() {
    let r = rig_with("idle", |b| {
        b.watchdog(Duration::from_millis(1))
            .wake_timeout(Duration::from_millis(5))
    });
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    let dst = [r.mr.sge(1024, 64)];
    reg.post_recv(&r.b, &mut [RecvWr::new(1, &dst), RecvWr::new(2, &dst)])
        .unwrap();
    // Many watchdog periods with the receives waiting for a SEND.
    std::thread::sleep(Duration::from_millis(100));
    let ledger = r.handle.ledger().unwrap().clone();
    assert!(ledger.snapshot(std::time::Instant::now()).scans > 3);
    assert_eq!(
        ledger.snapshot(std::time::Instant::now()).stuck,
        0,
        "a receive posted ahead is idle, not stuck"
    );
    // The shutdown's flush: the receives come back flushed, nothing stuck.
    r.b.modify(cqd::sim::Modify::Err).unwrap();
    assert!(wait(|| reg.ledger().outstanding() == 0));
    let report = stop(r);
    assert!(report.accounts.stuck.is_empty(), "{}", report.accounts);
    assert!(report.is_clean(), "{:?}", report.findings());
}

fn wait(mut cond: impl FnMut() -> bool) -> bool {
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    cond()
}

#[test]
fn a_handler_that_blocks_is_named() {
    let r = rig("slow");
    let fast = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    let slow = r.handle.register(Blocking).unwrap();
    let (src, dst) = ([r.mr.sge(0, 64)], [r.mr.sge(1024, 64)]);
    // One message at a time, so that the slow batch of one call is
    // followed by the next call of the same handler.
    // (The poller times its rounds, and a slow one has the CQ's next batch
    // timed; besides, one batch in 8 at random is: enough messages for a
    // timed slow batch and three slow calls after it.)
    for t in 0..40 {
        let who = if t == 0 { &fast } else { &slow };
        who.post_recv(&r.b, &mut [RecvWr::new(t, &dst)]).unwrap();
        fast.post_send(&r.a, &mut [SendWr::new(t, WrOp::Send, &src)])
            .unwrap();
        let done = t + 1;
        assert!(wait(|| fast.ledger().completed(OpKind::Send) == done));
        assert!(wait(|| slow.ledger().outstanding() == 0));
    }
    assert!(wait(|| r.handle.snapshot().slow_handler_calls >= 3));
    let report = stop(r);
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let f: Vec<_> = report
        .findings()
        .into_iter()
        .filter(|f| f.kind == FindingKind::SlowHandler)
        .collect();
    assert_eq!(f.len(), 1, "{:?}", report.findings());
    assert!(
        f[0].detail
            .contains(&format!("the last in handler {}", slow.key())),
        "{}",
        f[0]
    );
    let cq = &report.cqs[0];
    assert!(
        cq.slow_batches >= 1 && cq.max_slow_ns >= 3_000_000,
        "{cq:?}"
    );
}

#[test]
fn a_queue_refilled_from_another_thread_is_not_left_dry() {
    let r = rig("refill");
    let reg = r
        .handle
        .register(Quiet {
            panic_on_recv: false,
        })
        .unwrap();
    exchange(&r, &reg);
    assert!(wait(|| r.handle.snapshot().recv_queues_dry == 1));
    // A worker (here: this thread) posts the receive again after the
    // handler ran: the queue is no longer dry, though no batch consumed
    // from it since.
    let dst = [r.mr.sge(1024, 64)];
    reg.post_recv(&r.b, &mut [RecvWr::new(3, &dst)]).unwrap();
    std::thread::sleep(cqd::core::cq::DRY_GRACE + Duration::from_millis(100));
    assert_eq!(r.handle.snapshot().left_dry, Vec::<u32>::new());
    r.b.modify(cqd::sim::Modify::Err).unwrap();
    let report = stop(r);
    assert!(report.is_clean(), "{:?}", report.findings());
}
