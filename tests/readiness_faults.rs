//! The readiness poller under faults: a CQ that fails does not slow its
//! healthy neighbours, a failed re-poll is not taken for an empty CQ, a
//! shared channel serves one poller, and a retiring handler drained by a
//! failed post is released.

use std::os::fd::BorrowedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    split, ArmKind, AsyncEvent, Completion, CompletionSource, CqOptions, Failed, Handler, NoSink,
    NoWork, OpKind, Opcode, Outbox, PollMode, PollerBuilder, RecvDone, SendDone, SourceError,
};
use cqd::sim::{sim_cq, Faults, SimChannel, SimCq, SimCqSource};

struct Vanisher(SimCq);
impl Handler for Vanisher {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.vanish();
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

struct Stamped(Arc<AtomicU64>, Instant);
impl Handler for Stamped {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0
            .store(self.1.elapsed().as_micros() as u64 + 1, Ordering::SeqCst);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

#[test]
fn a_vanished_cq_does_not_delay_its_quiet_neighbours() {
    let t0 = Instant::now();
    let stamp = Arc::new(AtomicU64::new(0));
    let (pa, sa) = sim_cq("a", 64, Faults::default()).unwrap();
    let (pb, sb) = sim_cq("b", 64, Faults::default()).unwrap();
    let (ua, ha) = split::<NoWork>(sa, CqOptions::default()).unwrap();
    let (ub, hb) = split::<NoWork>(sb, CqOptions::default()).unwrap();
    let ra = ha.register(Stamped(Arc::clone(&stamp), t0)).unwrap();
    let rb = hb.register(Vanisher(pb.clone())).unwrap();
    let wake = Duration::from_secs(2);
    let thread = PollerBuilder::new("v", NoSink)
        .mode(PollMode::Event)
        .wake_timeout(wake)
        .cq(ua)
        .cq(ub)
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(50)); // both quiet and armed
    rb.track(OpKind::Send, 1);
    pb.push(
        Completion::success(rb.wr_id(OpKind::Send, 1).unwrap(), Opcode::Send, 1),
        false,
    )
    .unwrap();
    std::thread::sleep(Duration::from_millis(50)); // b vanished while active
    let pushed = t0.elapsed().as_micros() as u64;
    ra.track(OpKind::Send, 1);
    pa.push(
        Completion::success(ra.wr_id(OpKind::Send, 1).unwrap(), Opcode::Send, 1),
        false,
    )
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while stamp.load(Ordering::SeqCst) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(100));
    }
    let latency = Duration::from_micros(stamp.load(Ordering::SeqCst).saturating_sub(pushed));
    let snap = thread.snapshot();
    let _ = thread.stop();
    eprintln!("latency of a's completion: {latency:?}; poller {snap:?}");
    assert!(
        latency < Duration::from_millis(500),
        "a waited {latency:?} (wake timeout {wake:?})"
    );
}

struct Flaky {
    inner: SimCqSource,
    trigger: Arc<AtomicBool>,
    fail_next: bool,
}
impl CompletionSource for Flaky {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capacity(&self) -> u32 {
        self.inner.capacity()
    }
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, SourceError> {
        if std::mem::take(&mut self.fail_next) {
            return Err(SourceError::Backend("transient (injected)".into()));
        }
        self.inner.poll(out)
    }
    fn arm(&mut self, kind: ArmKind) -> Result<(), SourceError> {
        let r = self.inner.arm(kind);
        if self.trigger.swap(false, Ordering::SeqCst) {
            self.fail_next = true;
        }
        r
    }
    fn event_fd(&self) -> BorrowedFd<'_> {
        self.inner.event_fd()
    }
    fn async_fd(&self) -> Option<BorrowedFd<'_>> {
        self.inner.async_fd()
    }
    fn take_events(&mut self) -> Result<u32, SourceError> {
        self.inner.take_events()
    }
    fn ack_events(&mut self, n: u32) -> Result<(), SourceError> {
        self.inner.ack_events(n)
    }
    fn unacked_events(&self) -> u32 {
        self.inner.unacked_events()
    }
    fn take_async_event(&mut self) -> Option<AsyncEvent> {
        self.inner.take_async_event()
    }
    fn destroy(&mut self) -> Result<(), SourceError> {
        self.inner.destroy()
    }
}

struct Stamp(Arc<AtomicU64>);
impl Handler for Stamp {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        if d.tag() == 2 {
            self.0.store(1, Ordering::SeqCst);
        }
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

#[test]
fn a_failed_repoll_is_not_taken_for_an_empty_cq() {
    let trigger = Arc::new(AtomicBool::new(false));
    let (p, s) = sim_cq("a", 64, Faults::default()).unwrap();
    let flaky = Flaky {
        inner: s,
        trigger: Arc::clone(&trigger),
        fail_next: false,
    };
    let (u, h) = split::<NoWork>(flaky, CqOptions::default()).unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let r = h.register(Stamp(Arc::clone(&done))).unwrap();
    let thread = PollerBuilder::new("r", NoSink)
        .mode(PollMode::Event)
        .wake_timeout(Duration::from_secs(2))
        .cq(u)
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(50)); // quiet, armed
    r.track(OpKind::Send, 2);
    p.inject_before_next_arm(&[Completion::success(
        r.wr_id(OpKind::Send, 2).unwrap(),
        Opcode::Send,
        1,
    )]);
    trigger.store(true, Ordering::SeqCst);
    let start = Instant::now();
    p.push(
        Completion::success(r.wr_id(OpKind::Send, 1).unwrap(), Opcode::Send, 1),
        false,
    )
    .unwrap();
    while done.load(Ordering::SeqCst) == 0 && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_micros(100));
    }
    let waited = start.elapsed();
    let rep = thread.stop().unwrap();
    eprintln!(
        "tag 2 after {waited:?}; recovered {}",
        rep.cqs[0].recovered_missed_events
    );
    assert!(waited < Duration::from_millis(1000), "waited {waited:?}");
}

struct DropFlag(Arc<AtomicBool>);
impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}
impl Handler for DropFlag {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

#[test]
fn a_retiring_handler_drained_by_a_failed_post_is_released() {
    let dropped = Arc::new(AtomicBool::new(false));
    let (_p, s) = sim_cq("a", 64, Faults::default()).unwrap();
    let (u, h) = split::<NoWork>(s, CqOptions::default()).unwrap();
    let thread = PollerBuilder::new("l", NoSink)
        .mode(PollMode::Event)
        .wake_timeout(Duration::from_millis(10))
        .cq(u)
        .spawn()
        .unwrap();
    let reg = h.register(DropFlag(Arc::clone(&dropped))).unwrap();
    // A post's step 2: counted.
    assert!(reg.track(OpKind::Send, 1));
    h.unregister(reg.key()).unwrap();
    std::thread::sleep(Duration::from_millis(50)); // applied: retiring, 1 outstanding
                                                   // The post's step 3 is refused (no credits): its count is taken back.
    reg.untrack(OpKind::Send, 1);
    assert_eq!(reg.ledger().outstanding(), 0);
    std::thread::sleep(Duration::from_millis(300));
    let live = h.snapshot().handlers_live;
    let was_dropped = dropped.load(Ordering::SeqCst);
    let _ = thread.stop();
    assert!(
        was_dropped && live == 0,
        "retiring handler with nothing outstanding never released (handlers_live {live})"
    );
}

struct Count(Arc<AtomicU64>);
impl Handler for Count {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

/// A channel reports the CQs that fired and forgets them: a second poller
/// taking its tokens would lose the first one's notifications. The second
/// poller is refused; once the first stops, the channel can be claimed again.
#[test]
fn a_shared_channel_serves_one_poller() {
    let chan = SimChannel::new().unwrap();
    let (_pa, sa) = chan.cq("a", 64, Faults::default()).unwrap();
    let (pb, sb) = chan.cq("b", 64, Faults::default()).unwrap();
    let (ua, _ha) = split::<NoWork>(sa, CqOptions::default()).unwrap();
    let (ub, hb) = split::<NoWork>(sb, CqOptions::default()).unwrap();
    let t1 = PollerBuilder::new("p1", NoSink)
        .mode(PollMode::Event)
        .cq(ua)
        .spawn()
        .unwrap();
    let err = PollerBuilder::new("p2", NoSink)
        .mode(PollMode::Event)
        .cq(ub)
        .spawn()
        .unwrap_err();
    assert!(err.to_string().contains("one poller"), "{err}");
    t1.stop().unwrap();
    // The refused spawn dropped b (finishing it); a new CQ on the channel
    // is served by a new poller once the first one has gone.
    drop((pb, hb));
    let (pc, sc) = chan.cq("c", 64, Faults::default()).unwrap();
    let (uc, hc) = split::<NoWork>(sc, CqOptions::default()).unwrap();
    let got = Arc::new(AtomicU64::new(0));
    let rc = hc.register(Count(Arc::clone(&got))).unwrap();
    let t3 = PollerBuilder::new("p3", NoSink)
        .mode(PollMode::Event)
        .cq(uc)
        .spawn()
        .unwrap();
    rc.track(OpKind::Send, 1);
    pc.push(
        Completion::success(rc.wr_id(OpKind::Send, 1).unwrap(), Opcode::Send, 1),
        false,
    )
    .unwrap();
    let start = Instant::now();
    while got.load(Ordering::SeqCst) == 0 && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_micros(100));
    }
    assert_eq!(got.load(Ordering::SeqCst), 1);
    t3.stop().unwrap();
}
