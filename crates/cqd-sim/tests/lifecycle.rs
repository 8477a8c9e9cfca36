//! The polling right finishes its CQ however it ends: dropped bound or
//! unbound, or left behind by a poller thread that failed to start. Finishing
//! closes registration, acknowledges every event and destroys the CQ.

use cqd_core::slab::RegisterError;
use cqd_core::{
    split, Completion, CqHandle, CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Opcode,
    Outbox, PollerBuilder, RecvDone, SendDone,
};
use cqd_sim::{sim_cq, Faults, PushError, SimCq};

struct Nop;
impl Handler for Nop {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

fn recv(producer: &SimCq, handle: &CqHandle<NoWork>) -> Result<(), PushError> {
    let reg = handle.register(Nop).expect("register");
    let wr_id = reg.wr_id(OpKind::Recv, 1).expect("wr_id");
    producer.push(Completion::success(wr_id, Opcode::Recv, 1), false)
}

fn assert_finished(producer: &SimCq, handle: &CqHandle<NoWork>) {
    let wc = Completion::success(0, Opcode::Recv, 1);
    assert_eq!(
        producer.push(wc, false),
        Err(PushError::Destroyed),
        "the CQ was destroyed"
    );
    assert!(
        matches!(handle.register(Nop), Err(RegisterError::Closed { .. })),
        "registration is closed on a CQ nobody polls"
    );
}

#[test]
fn dropping_a_bound_poller_acks_every_event_and_destroys_the_cq() {
    let (producer, source) = sim_cq("bound", 16, Faults::default()).unwrap();
    let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let mut poller = unbound.bind();
    poller.arm().unwrap();
    recv(&producer, &handle).unwrap();
    assert_eq!(poller.take_events().unwrap(), 1);
    assert_eq!(poller.unacked_events(), 1);
    drop(poller);
    assert_finished(&producer, &handle);
    let snap = handle.snapshot();
    assert_eq!(
        (snap.events, snap.acks),
        (1, 1),
        "the taken event was acked"
    );
}

#[test]
fn dropping_an_unbound_cq_destroys_it() {
    let (producer, source) = sim_cq("unbound", 16, Faults::default()).unwrap();
    let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    recv(&producer, &handle).unwrap();
    drop(unbound);
    assert_finished(&producer, &handle);
}

#[test]
fn a_poller_thread_that_fails_to_start_finishes_its_cqs() {
    let (producer, source) = sim_cq("failed-start", 16, Faults::default()).unwrap();
    let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let err = PollerBuilder::new("failing", NoSink)
        .cq(unbound)
        .on_start(|| Err("CPU 99 does not exist".into()))
        .spawn()
        .unwrap_err();
    assert!(err.to_string().contains("CPU 99"), "{err}");
    assert_finished(&producer, &handle);
}

#[test]
fn destroy_then_drop_finishes_once() {
    let (producer, source) = sim_cq("destroy", 16, Faults::default()).unwrap();
    let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let mut poller = unbound.bind();
    poller.arm().unwrap();
    recv(&producer, &handle).unwrap();
    poller.take_events().unwrap();
    poller.destroy().unwrap();
    assert_finished(&producer, &handle);
    assert_eq!(handle.snapshot().acks, 1, "acked once, not again on drop");
}

/// An overflowed CQ is reported once (error, metric, async event), then no
/// longer armed: the poller sleeps its wake timeout instead of retrying the
/// arm (and tracing an error) every few milliseconds.
#[test]
fn an_overflowed_cq_is_reported_once_then_only_polled_on_the_wake_timeout() {
    use cqd_core::PollMode;
    use std::time::Duration;
    let (producer, source) = sim_cq("overflow", 4, Faults::default()).unwrap();
    let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    for _ in 0..4 {
        recv(&producer, &handle).unwrap();
    }
    assert!(matches!(
        recv(&producer, &handle),
        Err(PushError::Overflow { capacity: 4 })
    ));
    let wake = Duration::from_millis(20);
    let thread = PollerBuilder::new("overflowed", NoSink)
        .mode(PollMode::Event)
        .wake_timeout(wake)
        .cq(unbound)
        .spawn()
        .unwrap();
    // Until it has slept on the wake timeout 5 times (however long a
    // loaded machine takes to run it that far), timed.
    let started = std::time::Instant::now();
    while thread.snapshot().timeouts < 5 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "it never slept on the wake timeout"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let report = thread.stop().unwrap();
    let run = started.elapsed();
    let (cq, poller) = (&report.cqs[0], &report.poller);
    assert!(cq.in_error, "the snapshot says the CQ is in error");
    assert_eq!((cq.overflows, cq.async_events), (1, 1), "reported once");
    assert_eq!(cq.completions, 4, "what the CQ held was still polled");
    assert!(
        cq.arm_errors <= 1,
        "one refused arm at most, then never armed again: {}",
        cq.arm_errors
    );
    // One sleep per wake timeout (plus slack for a noisy machine), not a
    // back-off loop of one arm attempt every 2 ms (ten times as many).
    let most = (run.as_millis() / wake.as_millis()) as u64 + 10;
    assert!(
        poller.loops <= most,
        "{} poller loops in {run:?}, at most {most} expected",
        poller.loops
    );
    assert!(poller.timeouts >= 5, "it slept on the wake timeout");
}

#[test]
fn a_wake_timeout_the_poller_cannot_honour_is_refused() {
    use cqd_core::poller::{PollerError, MIN_WAKE_TIMEOUT};
    use std::time::Duration;
    let (producer, source) = sim_cq("short", 16, Faults::default()).unwrap();
    let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let err = PollerBuilder::new("short", NoSink)
        .wake_timeout(Duration::from_micros(10))
        .cq(unbound)
        .spawn()
        .unwrap_err();
    assert!(
        matches!(err, PollerError::WakeTimeout { given, min, .. }
            if given == Duration::from_micros(10) && min == MIN_WAKE_TIMEOUT),
        "{err}"
    );
    assert!(err.to_string().contains("below the minimum"), "{err}");
    assert_finished(&producer, &handle);
}
