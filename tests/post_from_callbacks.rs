//! Handlers that post from their own callbacks (`CqHandle::register_with`,
//! `CqHandle::register_contexts_with`), on the simulated NIC, in every poll
//! mode: an echo server reposts each receive and replies from `on_recv`; its
//! client, a context handler, reposts with a context from its own `on_recv`
//! and sends the next message. No `OnceLock`, no accessor that can be used
//! too early: a post from inside the closure is refused by name, and a
//! closure that panics gives its slot back.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cqd::core::*;
use cqd::sim::{
    connect, Access, CqConfig, Device, Mr, PostError, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp,
};

const MSG: u32 = 64;
/// Messages the client sends, one at a time (each sent from the callback
/// of the previous reply).
const ROUNDS: u64 = 500;
/// Receives each side keeps posted.
const DEPTH: u64 = 4;

/// The echo server: every message received is reposted and answered.
struct Echo {
    reg: Registration,
    qp: Arc<Qp>,
    mr: Arc<Mr>,
    errors: Arc<AtomicU64>,
}

impl Handler for Echo {
    fn on_recv(&mut self, done: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let slot = u64::from(done.tag());
        let buf = [self.mr.sge(slot * u64::from(MSG), MSG)];
        let reply = [self.mr.sge(4096 + slot * u64::from(MSG), MSG)];
        let reposted = self
            .reg
            .post_recv(&*self.qp, &mut [RecvWr::new(slot, &buf)]);
        let replied = self
            .reg
            .post_send(&*self.qp, &mut [SendWr::new(slot, WrOp::Send, &reply)]);
        if reposted.is_err() || replied.is_err() {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }
}

/// The client: each reply's context is its round; the reply's buffer is
/// reposted with a context and the next round is sent.
struct Client {
    reg: ContextRegistration<u64>,
    qp: Arc<Qp>,
    mr: Arc<Mr>,
    replies: Arc<AtomicU64>,
    errors: Arc<AtomicU64>,
    sent: u64,
}

impl Client {
    fn send_next(&mut self) {
        if self.sent == ROUNDS {
            return;
        }
        let src = [self.mr.sge(8192, MSG)];
        self.sent += 1;
        if self
            .reg
            .post_send(
                &*self.qp,
                &mut [SendWr::new(0, WrOp::Send, &src)],
                [self.sent],
            )
            .is_err()
        {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl ContextHandler for Client {
    type Ctx = u64;
    fn on_recv(&mut self, _: &RecvDone<'_>, round: u64, _: &mut Outbox<'_, NoWork>) {
        self.replies.fetch_add(1, Ordering::Relaxed);
        let buf = [self.mr.sge(12288 + (round % DEPTH) * u64::from(MSG), MSG)];
        if self
            .reg
            .post_recv(&*self.qp, &mut [RecvWr::new(0, &buf)], [round + DEPTH])
            .is_err()
        {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        self.send_next();
    }
    fn on_send(&mut self, _: &SendDone<'_>, _: u64, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }
    fn on_silent(&mut self, _: &Silent, _: u64, _: &mut Outbox<'_, NoWork>) {}
    fn on_abandoned(&mut self, _: u64) {
        self.errors.fetch_add(1, Ordering::Relaxed);
    }
}

fn echo_posted_from_the_callbacks(mode: PollMode) {
    let dev = Device::open("cb0");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("cq0", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let poller = PollerBuilder::new("p0", NoSink)
        .mode(mode)
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: 16,
        max_recv_wr: 16,
        ..QpCap::default()
    };
    let server = Arc::new(pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap());
    let client = Arc::new(pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap());
    connect(&server, &client).unwrap();
    let mr = Arc::new(pd.reg_mr(16384, Access::ALL).unwrap());
    let (errors, replies) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));

    let echo = handle
        .register_with(|reg| Echo {
            reg: reg.clone(),
            qp: Arc::clone(&server),
            mr: Arc::clone(&mr),
            errors: Arc::clone(&errors),
        })
        .unwrap();
    for slot in 0..DEPTH {
        let buf = [mr.sge(slot * u64::from(MSG), MSG)];
        echo.post_recv(&*server, &mut [RecvWr::new(slot, &buf)])
            .unwrap();
    }
    // The client's first round is sent from outside; every later one from
    // its callback.
    let creg = handle
        .register_contexts_with(64, |reg| Client {
            reg: reg.clone(),
            qp: Arc::clone(&client),
            mr: Arc::clone(&mr),
            replies: Arc::clone(&replies),
            errors: Arc::clone(&errors),
            sent: 1,
        })
        .unwrap();
    for round in 1..=DEPTH {
        let buf = [mr.sge(12288 + (round % DEPTH) * u64::from(MSG), MSG)];
        creg.post_recv(&*client, &mut [RecvWr::new(0, &buf)], [round])
            .unwrap();
    }
    let src = [mr.sge(8192, MSG)];
    creg.post_send(&*client, &mut [SendWr::new(0, WrOp::Send, &src)], [1])
        .unwrap();

    assert!(
        common::wait_until(Duration::from_secs(20), || replies.load(Ordering::Relaxed)
            == ROUNDS),
        "{} replies of {ROUNDS}, {} errors",
        replies.load(Ordering::Relaxed),
        errors.load(Ordering::Relaxed)
    );
    assert_eq!(errors.load(Ordering::Relaxed), 0);
    // The receives still posted (DEPTH on each side) go as flushes.
    server.modify(cqd::sim::Modify::Err).unwrap();
    client.modify(cqd::sim::Modify::Err).unwrap();
    let flushed = 2 * DEPTH;
    assert!(common::wait_until(Duration::from_secs(5), || {
        errors.load(Ordering::Relaxed) == flushed
    }));
    let report = poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert!(report.is_clean(), "{:?}", report.findings());
    // Every request of both handlers: posted == completed.
    for l in [echo.ledger(), creg.ledger()] {
        let (sends, recvs) = (ROUNDS, ROUNDS + DEPTH);
        assert_eq!(l.posted(OpKind::Send), sends);
        assert_eq!(l.posted(OpKind::Recv), recvs);
        assert_eq!(l.outstanding(), 0);
    }
}
all_modes!(echo_posted_from_the_callbacks);

struct Nothing;
impl Handler for Nothing {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

#[test]
fn a_post_from_inside_the_closure_is_refused_by_name() {
    let dev = Device::open("cb1");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("cq1", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let poller = PollerBuilder::new("p1", NoSink)
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let qp = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let peer = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect(&qp, &peer).unwrap();
    let mr = pd.reg_mr(4096, Access::ALL).unwrap();
    let buf = [mr.sge(0, 64)];
    let mut inside = None;
    let reg = handle
        .register_with(|reg| {
            inside = Some(reg.post_recv(&qp, &mut [RecvWr::new(7, &buf)]));
            Nothing
        })
        .unwrap();
    let err = inside.unwrap().unwrap_err();
    assert!(
        matches!(err, PostError::Refused(Refused::NotInstalled { handler }) if handler == reg.key()),
        "{err}"
    );
    assert!(err.to_string().contains("not installed yet"), "{err}");
    assert_eq!(reg.ledger().posted(OpKind::Recv), 0, "nothing counted");
    // Once register_with has returned, the same call posts.
    reg.post_recv(&qp, &mut [RecvWr::new(7, &buf)]).unwrap();
    assert_eq!(reg.ledger().posted(OpKind::Recv), 1);
    qp.modify(cqd::sim::Modify::Err).unwrap();
    assert!(common::wait_until(Duration::from_secs(5), || reg
        .ledger()
        .outstanding()
        == 0));
    let report = poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
}

#[test]
fn a_closure_that_panics_gives_its_slot_back() {
    let dev = Device::open("cb2");
    let (_cq, unbound, handle) = dev
        .create_dispatched_cq("cq2", 64, CqConfig::default(), CqOptions::default())
        .unwrap();
    let poller = PollerBuilder::new("p2", NoSink)
        .cq(unbound)
        .spawn()
        .unwrap();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        handle.register_with(|_| -> Nothing { panic!("the handler could not be made") })
    }));
    assert!(panicked.is_err(), "the panic goes on to the caller");
    // The poller installs the stand-in and retires it: nothing is live.
    assert!(common::wait_until(Duration::from_secs(5), || {
        let m = handle.snapshot();
        m.handlers_live == 0 && m.unregistrations == 1
    }));
    // And registration still works.
    let _reg = handle.register(Nothing).unwrap();
    let report = poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
}
