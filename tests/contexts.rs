//! Request contexts (`cqd_core::context`) on the simulated NIC, in every
//! poll mode: each context comes back once, to the callback its request's
//! fate calls for — success, error, flush, silent retirement, abandonment
//! at the stop, or refusal at the post — and never twice. Every test runs
//! with a context of 24 bytes (kept in a table) and one of 8 (a `Box`,
//! carried in its queue's ring).

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use cqd::core::*;
use cqd::sim::{
    connect, Access, CqConfig, Device, Faults, Modify, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp,
};

/// A request's context: heap values, so that a double hand-out or a lost
/// one would show (the tests count them, and Miri or a sanitizer would see
/// a double free).
trait Ctx: std::fmt::Debug + PartialEq + Send + 'static {
    /// True when the context travels in its queue's ring.
    const IN_RING: bool;
    fn named(s: &str) -> Self;
    fn name(&self) -> &str;
}

/// 24 bytes: kept in the handler's table.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Req(String);

impl Ctx for Req {
    const IN_RING: bool = false;
    fn named(s: &str) -> Self {
        Req(s.to_string())
    }
    fn name(&self) -> &str {
        &self.0
    }
}

/// 8 bytes: carried in the queue's ring.
#[derive(Debug, PartialEq, Eq, Clone)]
struct Boxed(Box<Req>);

impl Ctx for Boxed {
    const IN_RING: bool = true;
    fn named(s: &str) -> Self {
        Boxed(Box::new(Req(s.to_string())))
    }
    fn name(&self) -> &str {
        &self.0 .0
    }
}

type Log = Arc<Mutex<Vec<String>>>;

struct Server<C> {
    log: Log,
    _ctx: std::marker::PhantomData<fn(C)>,
}

impl<C: Ctx> ContextHandler for Server<C> {
    type Ctx = C;
    fn on_send(&mut self, d: &SendDone<'_>, ctx: C, _: &mut Outbox<'_, NoWork>) {
        self.log
            .lock()
            .unwrap()
            .push(format!("send {} {}", ctx.name(), d.kind()));
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, ctx: C, _: &mut Outbox<'_, NoWork>) {
        self.log
            .lock()
            .unwrap()
            .push(format!("recv {} {}", ctx.name(), d.byte_len()));
    }
    fn on_error(&mut self, f: &Failed<'_>, ctx: C, _: &mut Outbox<'_, NoWork>) {
        let what = if f.is_flush() { "flush" } else { "error" };
        self.log
            .lock()
            .unwrap()
            .push(format!("{what} {}", ctx.name()));
    }
    fn on_silent(&mut self, s: &Silent, ctx: C, _: &mut Outbox<'_, NoWork>) {
        self.log
            .lock()
            .unwrap()
            .push(format!("silent {} {}", ctx.name(), s.kind()));
    }
    fn on_abandoned(&mut self, ctx: C) {
        self.log
            .lock()
            .unwrap()
            .push(format!("abandoned {}", ctx.name()));
    }
}

struct Rig<C> {
    _dev: Device,
    poller: PollerThread,
    reg: ContextRegistration<C>,
    cq: cqd::sim::Cq,
    pd: cqd::sim::Pd,
    a: Qp,
    b: Qp,
    mr: cqd::sim::Mr,
    log: Log,
}

fn rig<C: Ctx>(mode: PollMode, capacity: u32) -> Rig<C> {
    rig_with(mode, capacity, Faults::default())
}

/// A device, a dispatched CQ with the device's `faults` and its poller
/// thread in `mode`, and two connected QPs on that CQ with a region to
/// send from: what every test here starts from, before it registers its
/// handler on `handle`.
struct Wire {
    dev: Device,
    poller: PollerThread,
    handle: CqHandle<NoWork>,
    cq: cqd::sim::Cq,
    pd: cqd::sim::Pd,
    a: Qp,
    b: Qp,
    mr: cqd::sim::Mr,
}

fn wire(mode: PollMode, faults: Faults) -> Wire {
    let dev = Device::open("ctx0");
    let config = CqConfig {
        faults,
        ..CqConfig::default()
    };
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("cq0", 256, config, CqOptions::default())
        .unwrap();
    let poller = PollerBuilder::new("p0", NoSink)
        .mode(mode)
        .drain_timeout(Duration::from_millis(200))
        .cq(unbound)
        .spawn()
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
    Wire {
        dev,
        poller,
        handle,
        cq,
        pd,
        a,
        b,
        mr,
    }
}

/// [`rig`] on a CQ with the simulated device's `faults`.
fn rig_with<C: Ctx>(mode: PollMode, capacity: u32, faults: Faults) -> Rig<C> {
    let w = wire(mode, faults);
    let log = Log::default();
    let reg = w
        .handle
        .register_with_contexts(
            Server::<C> {
                log: Arc::clone(&log),
                _ctx: std::marker::PhantomData,
            },
            capacity,
        )
        .unwrap();
    assert_eq!(reg.in_ring(), C::IN_RING);
    Rig {
        _dev: w.dev,
        poller: w.poller,
        reg,
        cq: w.cq,
        pd: w.pd,
        a: w.a,
        b: w.b,
        mr: w.mr,
        log,
    }
}

fn req<C: Ctx>(s: &str) -> C {
    C::named(s)
}

/// Runs `$body::<Req>` and `$body::<Boxed>` in every poll mode.
macro_rules! both_storages {
    ($body:ident) => {
        mod $body {
            fn table(mode: cqd::core::PollMode) {
                super::$body::<super::Req>(mode)
            }
            fn ring(mode: cqd::core::PollMode) {
                super::$body::<super::Boxed>(mode)
            }
            crate::all_modes!(table);
            crate::all_modes!(ring);
        }
    };
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

/// A receive, then an unsignaled write and a signaled send, whose
/// completion retires the write silently; waits for the three contexts.
fn recv_write_send<C: Ctx>(r: &Rig<C>) {
    let (src, dst) = ([r.mr.sge(0, 64)], [r.mr.sge(1024, 64)]);
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r1")])
        .unwrap();
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
}

fn successes_errors_flushes_and_silent_ones<C: Ctx>(mode: PollMode) {
    let r = rig::<C>(mode, 16);
    recv_write_send(&r);
    let src = [r.mr.sge(0, 64)];
    let dst = [r.mr.sge(1024, 64)];
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
both_storages!(successes_errors_flushes_and_silent_ones);

/// Every completion written twice by the device (the simulator's
/// `duplicate` fault): each context comes back once, the copies match no
/// request in flight, are counted unmatched and reach no callback, and the
/// handler's accounts stay exact.
fn a_completion_written_twice_hands_its_context_back_once<C: Ctx>(mode: PollMode) {
    let faults = Faults {
        duplicate: 1.0,
        ..Faults::default()
    };
    let r = rig_with::<C>(mode, 16, faults);
    recv_write_send(&r);
    let report = r.poller.stop().unwrap();
    assert_eq!(r.log.lock().unwrap().len(), 3, "each context once");
    assert_eq!(r.reg.empty_hits(), 0, "no copy reached the handler");
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let written_twice = r.cq.producer().stats().duplicated;
    assert_eq!(written_twice, 2, "the receive's and the send's");
    let cq = &report.cqs[0];
    assert_eq!((cq.unmatched_wr_ids, cq.stale_wr_ids), (written_twice, 0));
    assert!(report
        .findings()
        .iter()
        .any(|f| f.kind == FindingKind::UnmatchedWrId));
}
both_storages!(a_completion_written_twice_hands_its_context_back_once);

/// The same for a handler without contexts: each completion reaches it
/// once.
fn a_completion_written_twice_reaches_a_plain_handler_once(mode: PollMode) {
    struct Plain(Log);
    impl Handler for Plain {
        fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
            self.0.lock().unwrap().push(format!("send {}", d.tag()));
        }
        fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
            self.0.lock().unwrap().push(format!("recv {}", d.tag()));
        }
        fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
            self.0.lock().unwrap().push(format!("error {}", f.tag()));
        }
    }
    let faults = Faults {
        duplicate: 1.0,
        ..Faults::default()
    };
    let Wire {
        dev: _dev,
        poller,
        handle,
        cq,
        pd: _pd,
        a,
        b,
        mr,
    } = wire(mode, faults);
    let log = Log::default();
    let reg = handle.register(Plain(Arc::clone(&log))).unwrap();
    let (src, dst) = ([mr.sge(0, 64)], [mr.sge(1024, 64)]);
    for t in 0..4 {
        reg.post_recv(&b, &mut [RecvWr::new(t, &dst)]).unwrap();
        reg.post_send(&a, &mut [SendWr::new(t, WrOp::Send, &src)])
            .unwrap();
    }
    let mut want: Vec<String> = (0..4)
        .flat_map(|t| [format!("recv {t}"), format!("send {t}")])
        .collect();
    want.sort();
    assert_eq!(logged(&log, 8), want);
    let report = poller.stop().unwrap();
    assert_eq!(log.lock().unwrap().len(), 8, "each completion once");
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let written_twice = cq.producer().stats().duplicated;
    assert_eq!(written_twice, 8);
    let c = &report.cqs[0];
    assert_eq!((c.unmatched_wr_ids, c.stale_wr_ids), (written_twice, 0));
}
crate::all_modes!(a_completion_written_twice_reaches_a_plain_handler_once);

fn what_never_came_back_is_abandoned_at_the_stop<C: Ctx>(mode: PollMode) {
    let r = rig::<C>(mode, 16);
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
    assert_eq!(logged(&r.log, 2), ["abandoned r1", "abandoned r2"]);
    // The handler has ended: a context posted now would never come back
    // (a ring's handler refuses it; a table keeps it until the table
    // goes, and drops it then).
    if C::IN_RING {
        let e = r
            .reg
            .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("late")])
            .unwrap_err();
        assert!(
            matches!(e.error, cqd::sim::PostError::Refused(Refused::Ended { .. })),
            "{e}"
        );
        assert_eq!(e.back, [Some(req("late"))]);
    }
    drop((r.a, r.b));
    assert_eq!(r.log.lock().unwrap().len(), 2, "each context once");
}
both_storages!(what_never_came_back_is_abandoned_at_the_stop);

/// Receives posted on an SRQ no QP draws on: at the stop no QP can take
/// them any more, so the stop hands them back as flushes, with their
/// contexts, and balances.
fn an_srq_no_qp_draws_on_gives_its_contexts_back_at_the_stop<C: Ctx>(mode: PollMode) {
    let r = rig::<C>(mode, 16);
    let dst = [r.mr.sge(0, 64)];
    // Receives posted before any QP draws on the SRQ (the first post binds
    // it to this handler's CQ).
    let srq = r.pd.create_srq(16, 1).unwrap();
    r.reg
        .post_recv(
            &srq,
            &mut [RecvWr::new(0, &dst), RecvWr::new(0, &dst)],
            [req("s1"), req("s2")],
        )
        .unwrap();
    let report = r.poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(report.cqs[0].srq_returned, 2);
    assert_eq!(logged(&r.log, 2), ["flush s1", "flush s2"]);
    drop(srq);
    assert_eq!(r.log.lock().unwrap().len(), 2, "each context once");
}
both_storages!(an_srq_no_qp_draws_on_gives_its_contexts_back_at_the_stop);

fn a_request_the_expert_path_retires_comes_back_at_the_stop<C: Ctx>(mode: PollMode) {
    let r = rig::<C>(mode, 16);
    let dst = [r.mr.sge(0, 64)];
    let mut wrs = [RecvWr::new(0, &dst), RecvWr::new(0, &dst)];
    r.reg
        .post_recv(&r.b, &mut wrs, [req("r1"), req("r2")])
        .unwrap();
    // The expert path says r1 is done: no completion will carry its
    // context, so it waits for the handler's end.
    let retired =
        r.cq.ledger()
            .retire(r.b.qpn(), cqd::core::wr_id::Side::Recv, wrs[0].wr_id);
    assert_eq!(retired, 1);
    assert_eq!(
        r.cq.ledger()
            .outstanding(r.b.qpn(), cqd::core::wr_id::Side::Recv),
        1
    );
    let report = r.poller.stop().unwrap();
    assert!(!report.accounts.is_balanced(), "neither receive completed");
    assert_eq!(logged(&r.log, 2), ["abandoned r1", "abandoned r2"]);
    drop((r.a, r.b));
    assert_eq!(r.log.lock().unwrap().len(), 2, "each context once");
}
both_storages!(a_request_the_expert_path_retires_comes_back_at_the_stop);

/// A receive queue that posts a list up to its first bad request and
/// says so, as verbs does with `bad_wr` (the simulator's own post takes a
/// list whole or not at all).
struct UpToBad<'a>(&'a Qp);

impl PostRecv for UpToBad<'_> {
    type Wr<'a> = RecvWr<'a>;
    type Error = cqd::sim::PostError;

    fn recv_account(&self) -> &cqd::core::ledger::QueueAccount {
        self.0.recv_account()
    }

    fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, Self::Error)> {
        for (i, wr) in wrs.iter().enumerate() {
            self.0
                .post_recv_unaccounted(std::slice::from_ref(wr))
                .map_err(|e| (i, e))?;
        }
        Ok(())
    }
}

fn a_refused_post_hands_every_context_back<C: Ctx>(mode: PollMode) {
    let r = rig::<C>(mode, 3);
    let dst = [r.mr.sge(0, 64)];
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r1")])
        .unwrap();
    if !C::IN_RING {
        // Three, one more than the table's two free slots: refused whole,
        // all back.
        let e = r
            .reg
            .post_recv(
                &r.b,
                &mut [
                    RecvWr::new(0, &dst),
                    RecvWr::new(0, &dst),
                    RecvWr::new(0, &dst),
                ],
                [req("r2"), req("r3"), req("r3b")],
            )
            .unwrap_err();
        assert!(
            matches!(
                e.error,
                cqd::sim::PostError::Refused(Refused::Contexts { capacity: 3, .. })
            ),
            "{e}"
        );
        assert_eq!(e.back, [Some(req("r2")), Some(req("r3")), Some(req("r3b"))]);
    }
    // A list the queue refuses (too many scatter entries): nothing
    // posted, the context back (its slot free again).
    let many = [r.mr.sge(0, 8); 64];
    let e = r
        .reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &many)], [req("r4")])
        .unwrap_err();
    assert_eq!(e.back, [Some(req("r4"))], "{e}");
    // A list the queue takes up to its second request (`bad_wr` 1, as
    // verbs reports it): the first is posted, its context comes back with
    // its flush; the second comes back now (its slot free again).
    let e = r
        .reg
        .post_recv(
            &UpToBad(&r.b),
            &mut [RecvWr::new(0, &dst), RecvWr::new(0, &many)],
            [req("r6"), req("r7")],
        )
        .unwrap_err();
    assert_eq!(e.back, [None, Some(req("r7"))], "{e}");
    r.reg
        .post_recv(&r.b, &mut [RecvWr::new(0, &dst)], [req("r5")])
        .unwrap();
    r.b.modify(Modify::Err).unwrap();
    let flushed = ["flush r1", "flush r5", "flush r6"];
    assert_eq!(logged(&r.log, flushed.len()), flushed);
    let report = r.poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(
        r.log.lock().unwrap().len(),
        flushed.len(),
        "each context once"
    );
    assert_eq!(r.reg.empty_hits(), 0);
}
both_storages!(a_refused_post_hands_every_context_back);
