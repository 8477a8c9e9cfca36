//! Request contexts (`cqd_core::context`) on the simulated NIC, in every
//! poll mode: each context comes back once, to the callback its request's
//! fate calls for — success, error, flush, silent retirement, abandonment
//! at the stop, or refusal at the post — and never twice.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cqd::core::*;
use cqd::sim::{
    connect, Access, CqConfig, Device, Modify, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp,
};

/// A request's context: a heap value, so that a double hand-out or a lost
/// one would show (the test counts them).
#[derive(Debug, PartialEq, Eq, Clone)]
struct Req(String);

type Log = Arc<Mutex<Vec<String>>>;

struct Server {
    log: Log,
}

impl ContextHandler for Server {
    type Ctx = Req;
    fn on_send(&mut self, d: &SendDone<'_>, ctx: Req, _: &mut Outbox<'_, NoWork>) {
        self.log
            .lock()
            .unwrap()
            .push(format!("send {} {}", ctx.0, d.kind()));
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, ctx: Req, _: &mut Outbox<'_, NoWork>) {
        self.log
            .lock()
            .unwrap()
            .push(format!("recv {} {}", ctx.0, d.byte_len()));
    }
    fn on_error(&mut self, f: &Failed<'_>, ctx: Req, _: &mut Outbox<'_, NoWork>) {
        let what = if f.is_flush() { "flush" } else { "error" };
        self.log.lock().unwrap().push(format!("{what} {}", ctx.0));
    }
    fn on_silent(&mut self, s: &Silent, ctx: Req, _: &mut Outbox<'_, NoWork>) {
        self.log
            .lock()
            .unwrap()
            .push(format!("silent {} {}", ctx.0, s.kind()));
    }
    fn on_abandoned(&mut self, ctx: Req) {
        self.log
            .lock()
            .unwrap()
            .push(format!("abandoned {}", ctx.0));
    }
}

struct Rig {
    _dev: Device,
    poller: PollerThread,
    reg: ContextRegistration<Req>,
    a: Qp,
    b: Qp,
    mr: cqd::sim::Mr,
    log: Log,
}

fn rig(mode: PollMode, capacity: u32) -> Rig {
    let dev = Device::open("ctx0");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("cq0", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let poller = PollerBuilder::new("p0", NoSink)
        .mode(mode)
        .drain_timeout(Duration::from_millis(200))
        .cq(unbound)
        .spawn()
        .unwrap();
    let log = Log::default();
    let reg = handle
        .register_with_contexts(
            Server {
                log: Arc::clone(&log),
            },
            capacity,
        )
        .unwrap();
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
        reg,
        a,
        b,
        mr,
        log,
    }
}

fn req(s: &str) -> Req {
    Req(s.to_string())
}

/// Waits until `n` entries are logged; returns them sorted.
fn logged(log: &Log, n: usize) -> Vec<String> {
    assert!(
        common::wait_until(Duration::from_secs(5), || log.lock().unwrap().len() >= n),
        "only {:?}",
        log.lock().unwrap()
    );
    let mut v = log.lock().unwrap().clone();
    v.sort();
    v
}

fn successes_errors_flushes_and_silent_ones(mode: PollMode) {
    let r = rig(mode, 16);
    let (src, dst) = ([r.mr.sge(0, 64)], [r.mr.sge(1024, 64)]);
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r1")])
        .unwrap();
    // An unsignaled write, then a signaled send: the send's completion
    // retires the write silently.
    let remote = r.mr.remote(2048);
    r.reg
        .post_send(
            &r.a,
            &mut [
                SendWr::new(0, WrOp::Write(remote), &src).unsignaled(),
                SendWr::new(0, WrOp::Send, &src),
            ],
            [req("w1"), req("s1")],
        )
        .unwrap();
    assert_eq!(
        logged(&r.log, 3),
        ["recv r1 64", "send s1 send", "silent w1 write"]
    );
    // An access error: a write to an address no region holds.
    let mut bad = r.mr.remote(2048);
    bad.addr = 0xdead_0000;
    r.reg
        .post_send(
            &r.a,
            &mut [SendWr::new(0, WrOp::Write(bad), &src)],
            [req("bad")],
        )
        .unwrap();
    // The QP is in error now: the receive posted next is flushed.
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r2")])
        .unwrap();
    r.b.modify(Modify::Err).unwrap();
    let all = logged(&r.log, 5);
    assert!(all.contains(&"error bad".to_string()), "{all:?}");
    assert!(all.contains(&"flush r2".to_string()), "{all:?}");
    let report = r.poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(r.log.lock().unwrap().len(), 5, "each context once");
    assert_eq!(r.reg.empty_hits(), 0);
}
all_modes!(successes_errors_flushes_and_silent_ones);

fn what_never_came_back_is_abandoned_at_the_stop(mode: PollMode) {
    let r = rig(mode, 16);
    let dst = [r.mr.sge(0, 64)];
    // Receives nobody sends to: outstanding at the stop.
    r.reg
        .post_recv(
            &r.b,
            &mut [RecvWr::new(0, &dst), RecvWr::new(0, &dst)],
            [req("r1"), req("r2")],
        )
        .unwrap();
    let report = r.poller.stop().unwrap();
    assert!(!report.accounts.is_balanced(), "two receives are missing");
    drop((r.a, r.b));
    assert_eq!(logged(&r.log, 2), ["abandoned r1", "abandoned r2"]);
}
all_modes!(what_never_came_back_is_abandoned_at_the_stop);

fn a_refused_post_hands_every_context_back(mode: PollMode) {
    let r = rig(mode, 2);
    let dst = [r.mr.sge(0, 64)];
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r1")])
        .unwrap();
    // Two more than the table's one free slot: refused whole, both back.
    let e = r
        .reg
        .post_recv(
            &r.b,
            &mut [RecvWr::new(0, &dst), RecvWr::new(0, &dst)],
            [req("r2"), req("r3")],
        )
        .unwrap_err();
    assert!(
        matches!(
            e.error,
            cqd::sim::PostError::Refused(Refused::Contexts { capacity: 2, .. })
        ),
        "{e}"
    );
    assert_eq!(e.back, [Some(req("r2")), Some(req("r3"))]);
    // A list the queue refuses (too many scatter entries): nothing
    // posted, the context back, its slot free again.
    let many = [r.mr.sge(0, 8); 64];
    let e = r
        .reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &many)], [req("r4")])
        .unwrap_err();
    assert_eq!(e.back, [Some(req("r4"))], "{e}");
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r5")])
        .unwrap();
    r.b.modify(Modify::Err).unwrap();
    assert_eq!(logged(&r.log, 2), ["flush r1", "flush r5"]);
    let report = r.poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
}
all_modes!(a_refused_post_hands_every_context_back);
