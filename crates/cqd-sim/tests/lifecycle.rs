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
