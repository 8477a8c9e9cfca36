//! Dispatcher integration tests on the simulated CQ. Every test runs in
//! every poll mode (`all_modes!`).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use cqd::core::wr_id::MAX_GENERATION;
use cqd::core::{
    split, CqHandle, CqOptions, NoSink, NoWork, OpKind, Opcode, PollMode, PollerBuilder,
    PollerThread, Registration, Status, UnboundCq,
};
use cqd::sim::{sim_cq, Faults, SimCq};

fn cq(name: &str, capacity: u32, faults: Faults) -> (SimCq, UnboundCq<NoWork>, CqHandle<NoWork>) {
    let (producer, source) = sim_cq(name, capacity, faults).unwrap();
    let (poller, handle) = split(source, CqOptions::default()).unwrap();
    (producer, poller, handle)
}

fn spawn(mode: PollMode, cqs: Vec<UnboundCq<NoWork>>, timeout: Duration) -> PollerThread {
    let mut b = PollerBuilder::new(format!("t-{}", mode.name()), NoSink)
        .mode(mode)
        .wake_timeout(timeout);
    for c in cqs {
        b = b.cq(c);
    }
    b.spawn().unwrap()
}

fn register(h: &CqHandle<NoWork>, record: &Arc<Record>, id: u64) -> Registration {
    h.register(Recorder {
        id,
        record: Arc::clone(record),
        panic_every: None,
    })
    .unwrap()
}

/// Completions for `tags` of one kind and outcome: each tracked as posted by
/// `reg` (before it can complete, as a poster would) and recorded as owned
/// by handler `owner`.
fn tracked(
    reg: &Registration,
    record: &Record,
    owner: u64,
    kind: OpKind,
    opcode: Opcode,
    tags: std::ops::Range<u32>,
) -> Vec<cqd::core::Completion> {
    tags.map(|t| {
        record.owner[t as usize].store(owner, Ordering::Relaxed);
        reg.track(kind, 1);
        completion(reg.wr_id(kind, t).unwrap(), Status::Success, opcode)
    })
    .collect()
}

/// Pushes without overflowing: waits while the CQ is nearly full, as a
/// sender holding CQ credits would.
fn push_paced(cq: &SimCq, wc: cqd::core::Completion, solicited: bool) {
    while cq.len() + 1 >= cq.capacity() as usize {
        std::thread::yield_now();
    }
    cq.push(wc, solicited).unwrap();
}

/// 100,000 random completions (success, error, flush; send and receive side
/// mixed on one CQ) across 64 handlers: each delivered exactly once, to the
/// right handler and callback.
fn exactly_once(mode: PollMode) {
    const N: usize = 100_000;
    const HANDLERS: usize = 64;
    let (producer, poller, handle) = cq("once", 4096, Faults::default());
    let record = Record::new(N);
    let regs: Vec<Registration> = (0..HANDLERS as u64)
        .map(|i| register(&handle, &record, i))
        .collect();
    let thread = spawn(mode, vec![poller], Duration::from_millis(100));

    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut expected = vec![0u8; N];
    let mut per_kind = [0u64; OpKind::COUNT];
    for (tag, want) in expected.iter_mut().enumerate() {
        let r = next();
        let h = (r % HANDLERS as u64) as usize;
        record.owner[tag].store(h as u64, Ordering::Relaxed);
        let kind = OpKind::ALL[((r >> 8) % 5) as usize];
        let (status, cb) = match (r >> 16) % 10 {
            0 => (Status::WrFlush, ERROR),
            1 => (Status::RemoteAccess, ERROR),
            2 => (Status::RnrRetryExceeded, ERROR),
            _ if kind == OpKind::Recv => (Status::Success, RECV),
            _ => (Status::Success, SEND),
        };
        let opcode = match kind {
            OpKind::Send => Opcode::Send,
            OpKind::Recv => Opcode::Recv,
            OpKind::Write => Opcode::RdmaWrite,
            OpKind::Read => Opcode::RdmaRead,
            _ => Opcode::FetchAdd,
        };
        *want = cb;
        per_kind[kind.index()] += 1;
        regs[h].track(kind, 1);
        let wr_id = regs[h].wr_id(kind, tag as u32).unwrap();
        push_paced(&producer, completion(wr_id, status, opcode), false);
    }
    assert!(
        wait_until(Duration::from_secs(60), || record.delivered() == N as u64),
        "delivered {} of {N} in {}",
        record.delivered(),
        mode.name()
    );
    if sleeps(mode) {
        // Idle now: a sleeping mode arms and sleeps (Hybrid after its
        // spin). Stopped at once, a fast machine can stop it inside the
        // spin, with every completion delivered before the first arm.
        assert!(
            wait_until(Duration::from_secs(5), || thread.snapshot().sleeps > 0),
            "an idle sleeping mode sleeps"
        );
    }
    let report = thread.stop().unwrap();
    for (tag, want) in expected.iter().enumerate() {
        assert_eq!(
            record.hits[tag].load(Ordering::Relaxed),
            1,
            "tag {tag} not exactly once"
        );
        assert_eq!(
            record.callback[tag].load(Ordering::Relaxed),
            *want,
            "tag {tag} wrong callback"
        );
    }
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    let snap = &report.cqs[0];
    assert_eq!(snap.completions, N as u64);
    assert_eq!(
        snap.stale_wr_ids + snap.foreign_wr_ids + snap.unknown_status + snap.unknown_opcode,
        0
    );
    assert_eq!(snap.handler_panics, 0);
    assert!(snap.errors() > 0 && snap.flushes > 0);
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    for r in &regs {
        assert_eq!(r.ledger().outstanding(), 0);
    }
    let completed: u64 = regs
        .iter()
        .map(|r| {
            OpKind::ALL
                .iter()
                .map(|k| r.ledger().completed(*k))
                .sum::<u64>()
        })
        .sum();
    assert_eq!(completed, N as u64);
    assert_eq!(per_kind.iter().sum::<u64>(), N as u64);
    if sleeps(mode) {
        assert!(snap.arms > 0, "a sleeping mode arms");
    } else {
        assert_eq!(snap.arms, 0, "busy mode never arms");
    }
}
all_modes!(exactly_once);

/// A burst that lands while the poller sleeps coalesces into one
/// notification; the poller drains all of it, not one entry per event.
fn coalesced_notifications_drain_to_empty(mode: PollMode) {
    const N: usize = 2000;
    let (producer, poller, handle) = cq("coalesce", 4096, Faults::default());
    let record = Record::new(N);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_secs(30));
    // Let the poller go idle (and, if it sleeps, arm and sleep).
    std::thread::sleep(Duration::from_millis(50));
    let wcs = tracked(&reg, &record, 0, OpKind::Recv, Opcode::Recv, 0..N as u32);
    producer.push_all(&wcs).unwrap();
    assert!(wait_until(Duration::from_secs(10), || record.delivered() == N as u64));
    let report = thread.stop().unwrap();
    let snap = &report.cqs[0];
    assert_eq!(snap.completions, N as u64);
    if sleeps(mode) {
        assert!(snap.events <= 3, "one burst, {} events", snap.events);
        assert_eq!(snap.acks, snap.events, "every event acked by the stop");
        assert_eq!(snap.recovered_missed_events, 0, "no timeout was needed");
    }
}
all_modes!(coalesced_notifications_drain_to_empty);

/// Every notification is lost: the wake-up timeout finds the completions,
/// and each find is counted as a recovered missed event.
fn dropped_notification_is_recovered(mode: PollMode) {
    let (producer, poller, handle) = cq(
        "drop",
        64,
        Faults {
            drop: 1.0,
            ..Faults::default()
        },
    );
    let record = Record::new(10);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_millis(20));
    for round in 0..5u32 {
        std::thread::sleep(Duration::from_millis(30));
        let tag = round * 2;
        for t in [tag, tag + 1] {
            let wc = tracked(&reg, &record, 0, OpKind::Send, Opcode::Send, t..t + 1);
            producer.push(wc[0], false).unwrap();
        }
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 10));
    let report = thread.stop().unwrap();
    let snap = &report.cqs[0];
    if sleeps(mode) {
        assert!(producer.stats().dropped >= 1, "the fault fired");
        assert!(snap.recovered_missed_events >= 1, "{snap:?}");
        assert_eq!(snap.events, 0, "no notification was ever delivered");
    } else {
        assert_eq!(snap.recovered_missed_events, 0);
    }
}
all_modes!(dropped_notification_is_recovered);

/// Spurious notifications cost nothing but a counted wake-up.
fn spurious_notifications_are_counted(mode: PollMode) {
    let faults = Faults {
        spurious: 1.0,
        ..Faults::default()
    };
    let (producer, poller, handle) = cq("spurious", 64, faults);
    let record = Record::new(20);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_millis(100));
    std::thread::sleep(Duration::from_millis(20));
    for t in 0..20u32 {
        let wc = tracked(&reg, &record, 0, OpKind::Recv, Opcode::Recv, t..t + 1);
        producer.push(wc[0], false).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 20));
    let report = thread.stop().unwrap();
    let snap = &report.cqs[0];
    assert!((0..20).all(|t| record.hits[t].load(Ordering::Relaxed) == 1));
    if sleeps(mode) {
        assert!(snap.spurious_wakeups >= 1, "{snap:?}");
        assert_eq!(snap.acks, snap.events);
    }
}
all_modes!(spurious_notifications_are_counted);

/// A completion landing after the last empty poll but before the arm is
/// not notified; the re-poll after arming finds it, long before the
/// safety timeout.
fn completion_between_poll_and_arm(mode: PollMode) {
    let (producer, poller, handle) = cq("race", 64, Faults::default());
    let record = Record::new(1);
    let reg = register(&handle, &record, 0);
    record.owner[0].store(0, Ordering::Relaxed);
    reg.track(OpKind::Send, 1);
    producer.inject_before_next_arm(&[completion(
        reg.wr_id(OpKind::Send, 0).unwrap(),
        Status::Success,
        Opcode::Send,
    )]);
    let start = Instant::now();
    let thread = spawn(mode, vec![poller], Duration::from_secs(30));
    if sleeps(mode) {
        assert!(wait_until(Duration::from_secs(5), || record.delivered() == 1));
        assert!(start.elapsed() < Duration::from_secs(5));
        let snap = thread.stop().unwrap().cqs[0].clone();
        assert_eq!(snap.recovered_missed_events, 0);
        assert_eq!(producer.stats().injected, 1);
    } else {
        // Busy mode never arms, so the injection never happens.
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(record.delivered(), 0);
        assert_eq!(thread.stop().unwrap().cqs[0].arms, 0);
    }
}
all_modes!(completion_between_poll_and_arm);

/// Stale generations and foreign wr_ids: counted, never dispatched. Unknown
/// statuses and opcodes of a live handler: counted, and delivered to its
/// `on_error` so it can release what the request held. Never a panic.
fn anomalies_are_counted_and_never_misrouted(mode: PollMode) {
    let (producer, poller, handle) = cq("anomaly", 64, Faults::default());
    let record = Record::new(8);
    let old = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_millis(20));
    handle.unregister(old.key()).unwrap();
    assert!(wait_until(Duration::from_secs(5), || handle
        .snapshot()
        .unregistrations
        == 1));
    let new = register(&handle, &record, 1);
    assert_eq!(new.key().slot(), old.key().slot(), "the slot was reused");
    assert_ne!(new.key().generation(), old.key().generation());
    new.track(OpKind::Recv, 2);
    for t in [2, 3] {
        record.owner[t].store(1, Ordering::Relaxed);
    }
    let stale = completion(
        old.wr_id(OpKind::Send, 1).unwrap(),
        Status::Success,
        Opcode::Send,
    );
    let mut unknown_status = completion(
        new.wr_id(OpKind::Recv, 2).unwrap(),
        Status::Success,
        Opcode::Recv,
    );
    unknown_status.status = Status::from_raw(99);
    let unknown_opcode = completion(
        new.wr_id(OpKind::Recv, 3).unwrap(),
        Status::Success,
        Opcode::from_raw(77),
    );
    let foreign = [0u64, u64::MAX, 0xB000_0000_0000_0000 | (7 << 57)]
        .map(|w| completion(w, Status::Success, Opcode::Send));
    producer
        .push_all(&[stale, unknown_status, unknown_opcode])
        .unwrap();
    producer.push_all(&foreign).unwrap();
    assert!(wait_until(Duration::from_secs(5), || handle
        .snapshot()
        .completions
        == 6));
    let snap = thread.stop().unwrap().cqs[0].clone();
    assert_eq!(snap.stale_wr_ids, 1);
    assert_eq!(snap.unknown_status, 1);
    assert_eq!(snap.unknown_opcode, 1);
    assert_eq!(snap.foreign_wr_ids, 3);
    assert_eq!(
        record.delivered(),
        2,
        "only the two anomalies of the live handler were delivered"
    );
    for t in [2, 3] {
        assert_eq!(record.hits[t].load(Ordering::Relaxed), 1, "tag {t}");
        assert_eq!(record.callback[t].load(Ordering::Relaxed), ERROR, "tag {t}");
    }
    assert_eq!(record.hits[1].load(Ordering::Relaxed), 0, "stale dropped");
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    assert_eq!(
        new.ledger().outstanding(),
        0,
        "anomalies still resolve their requests"
    );
}
all_modes!(anomalies_are_counted_and_never_misrouted);

/// A slot is not reused while work posted under it can still complete.
fn retiring_handler_keeps_its_slot_until_drained(mode: PollMode) {
    let (producer, poller, handle) = cq("retire", 64, Faults::default());
    let record = Record::new(8);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_millis(20));
    for t in 0..4 {
        record.owner[t].store(0, Ordering::Relaxed);
    }
    reg.track(OpKind::Recv, 4);
    handle.unregister(reg.key()).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let other = register(&handle, &record, 1);
    assert_ne!(other.key().slot(), reg.key().slot(), "slot still in use");
    for t in 0..4u32 {
        producer
            .push(
                completion(
                    reg.wr_id(OpKind::Recv, t).unwrap(),
                    Status::WrFlush,
                    Opcode::Recv,
                ),
                false,
            )
            .unwrap();
    }
    assert!(wait_until(Duration::from_secs(5), || handle
        .snapshot()
        .unregistrations
        == 1));
    assert_eq!(
        record.delivered(),
        4,
        "flushes reached the retiring handler"
    );
    let snap = thread.stop().unwrap().cqs[0].clone();
    assert_eq!(snap.handlers_live, 1);
    assert_eq!(snap.flushes, 4);
}
all_modes!(retiring_handler_keeps_its_slot_until_drained);

/// The generation cannot wrap onto a key in use: one handler registered and
/// retired through a whole cycle of generations (32,768 registrations of
/// one slot), then a late, untracked wr_id of the very first registration
/// arrives. It is counted stale, never delivered to the current handler.
/// (Polled on this thread: the poll mode plays no part in slot allocation.)
#[test]
fn generation_wrap_does_not_reissue_a_key() {
    let (producer, poller, handle) = cq("wrap", 64, Faults::default());
    let mut poller = poller.bind();
    let record = Record::new(8);
    let first = register(&handle, &record, 0);
    // A raw post under the first key, never tracked (as a duplicate or a
    // post that bypassed the ledger would be).
    let late = first.wr_id(OpKind::Send, 1).unwrap();
    handle.unregister(first.key()).unwrap();
    poller.apply_commands();
    // The rest of a generation cycle: 32,768 registrations in all.
    for _ in 0..MAX_GENERATION {
        let reg = register(&handle, &record, 0);
        handle.unregister(reg.key()).unwrap();
        poller.apply_commands();
    }
    assert_eq!(
        handle.snapshot().unregistrations,
        u64::from(MAX_GENERATION) + 1
    );
    let current = register(&handle, &record, 1);
    assert_ne!(current.key(), first.key(), "a key was issued twice");
    producer
        .push(completion(late, Status::Success, Opcode::Send), false)
        .unwrap();
    let mut out = std::collections::VecDeque::new();
    assert_eq!(poller.poll_once(&mut out).unwrap(), 1);
    let snap = handle.snapshot();
    assert_eq!(snap.stale_wr_ids, 1);
    assert_eq!(record.delivered(), 0, "the late wr_id reached a handler");
}

/// A panicking handler is caught and counted; the poller keeps running and
/// every completion is still accounted.
fn panicking_handler_is_contained(mode: PollMode) {
    const N: usize = 1000;
    let (producer, poller, handle) = cq("panic", 2048, Faults::default());
    let record = Record::new(N);
    let reg = handle
        .register(Recorder {
            id: 0,
            record: Arc::clone(&record),
            panic_every: Some(10),
        })
        .unwrap();
    let thread = spawn(mode, vec![poller], Duration::from_millis(20));
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    for t in 0..N as u32 {
        record.owner[t as usize].store(0, Ordering::Relaxed);
        reg.track(OpKind::Send, 1);
        push_paced(
            &producer,
            completion(
                reg.wr_id(OpKind::Send, t).unwrap(),
                Status::Success,
                Opcode::Send,
            ),
            false,
        );
    }
    let ok = wait_until(Duration::from_secs(10), || record.delivered() == N as u64);
    let report = thread.stop().unwrap();
    std::panic::set_hook(prev);
    assert!(ok);
    assert_eq!(report.cqs[0].handler_panics, (N / 10) as u64);
    assert_eq!(reg.ledger().outstanding(), 0);
}
all_modes!(panicking_handler_is_contained);

/// A CQ that overflows raises an asynchronous event that the poller turns
/// into a counter and an error trace.
fn overflow_is_loud(mode: PollMode) {
    let (producer, poller, handle) = cq("overflow", 8, Faults::default());
    let record = Record::new(32);
    let reg = register(&handle, &record, 0);
    let mut lost = 0;
    for t in 0..20u32 {
        record.owner[t as usize].store(0, Ordering::Relaxed);
        let wc = completion(
            reg.wr_id(OpKind::Recv, t).unwrap(),
            Status::Success,
            Opcode::Recv,
        );
        if producer.push(wc, false).is_err() {
            lost += 1;
        }
    }
    assert_eq!(lost, 12);
    let thread = spawn(mode, vec![poller], Duration::from_millis(20));
    assert!(wait_until(Duration::from_secs(5), || handle
        .snapshot()
        .overflows
        >= 1));
    let snap = thread.stop().unwrap().cqs[0].clone();
    assert!(snap.async_events >= 1);
    assert_eq!(snap.completions, 8, "what fitted is still delivered");
}
all_modes!(overflow_is_loud);

/// A poll group arms all its CQs, each until it fires: completions on the
/// second CQ alone are delivered.
fn poll_group_serves_every_cq(mode: PollMode) {
    let (p1, c1, h1) = cq("send-cq", 64, Faults::default());
    let (p2, c2, h2) = cq("recv-cq", 64, Faults::default());
    let record = Record::new(40);
    let r1 = register(&h1, &record, 1);
    let r2 = register(&h2, &record, 2);
    let thread = spawn(mode, vec![c1, c2], Duration::from_secs(30));
    for round in 0..10u32 {
        std::thread::sleep(Duration::from_millis(5));
        let (p, r, id, kind, op) = if round % 3 == 0 {
            (&p1, &r1, 1, OpKind::Send, Opcode::Send)
        } else {
            (&p2, &r2, 2, OpKind::Recv, Opcode::Recv)
        };
        for k in 0..4 {
            let t = round * 4 + k;
            record.owner[t as usize].store(id, Ordering::Relaxed);
            r.track(kind, 1);
            p.push(
                completion(r.wr_id(kind, t).unwrap(), Status::Success, op),
                false,
            )
            .unwrap();
        }
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 40));
    let report = thread.stop().unwrap();
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    assert_eq!(report.cqs.len(), 2);
    assert_eq!(
        report.cqs[0].recovered_missed_events + report.cqs[1].recovered_missed_events,
        0
    );
    if sleeps(mode) {
        for c in &report.cqs {
            // An arm stays in force until it fires: a CQ is armed once at
            // first, then once per notification, not once per sleep.
            assert!(c.arms >= 1, "{}: never armed", c.name);
            assert!(
                c.arms <= c.events + 1,
                "{}: {} arms for {} notifications",
                c.name,
                c.arms,
                c.events
            );
        }
    }
}
all_modes!(poll_group_serves_every_cq);

/// A stop drains every CQ to empty and acknowledges every event before it
/// destroys the CQs.
fn stop_drains_acks_and_destroys(mode: PollMode) {
    const N: usize = 3000;
    let (producer, poller, handle) = cq("stop", 4096, Faults::default());
    let record = Record::new(N);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_millis(100));
    std::thread::sleep(Duration::from_millis(10));
    let wcs = tracked(
        &reg,
        &record,
        0,
        OpKind::Write,
        Opcode::RdmaWrite,
        0..N as u32,
    );
    producer.push_all(&wcs).unwrap();
    let report = thread.stop().unwrap();
    assert_eq!(record.delivered(), N as u64, "stop drained everything");
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.cqs[0].acks, report.cqs[0].events);
    assert!(
        producer.push(wcs[0], false).is_err(),
        "the CQ was destroyed"
    );
    assert!(handle
        .register(Recorder {
            id: 9,
            record,
            panic_every: None
        })
        .is_err());
}
all_modes!(stop_drains_acks_and_destroys);

/// Registration and unregistration ring the poller's doorbell: a poller
/// asleep with a 30 s safety timeout applies them at once.
fn control_requests_wake_a_sleeping_poller(mode: PollMode) {
    let (_producer, poller, handle) = cq("doorbell", 64, Faults::default());
    let record = Record::new(1);
    let thread = spawn(mode, vec![poller], Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(20));
    let reg = register(&handle, &record, 0);
    handle.unregister(reg.key()).unwrap();
    assert!(
        wait_until(Duration::from_secs(2), || handle.snapshot().unregistrations
            == 1),
        "the poller did not wake for a control request"
    );
    let start = Instant::now();
    let report = thread.stop().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "stop woke the poller"
    );
    if sleeps(mode) {
        assert!(report.poller.control_wakeups >= 1, "{:?}", report.poller);
    }
}
all_modes!(control_requests_wake_a_sleeping_poller);

/// A receive CQ armed for solicited completions only: a solicited
/// completion wakes the poller, and the drain takes the unsolicited ones
/// queued before it too.
fn solicited_only_arming(mode: PollMode) {
    let (producer, source) = sim_cq("solicited", 64, Faults::default()).unwrap();
    let options = CqOptions {
        arm: cqd::core::ArmKind::Solicited,
        ..CqOptions::default()
    };
    let (poller, handle) = split::<NoWork>(source, options).unwrap();
    let record = Record::new(4);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(20));
    for t in 0..4u32 {
        record.owner[t as usize].store(0, Ordering::Relaxed);
        reg.track(OpKind::Recv, 1);
        let wc = completion(
            reg.wr_id(OpKind::Recv, t).unwrap(),
            Status::Success,
            Opcode::Recv,
        );
        producer.push(wc, t == 3).unwrap();
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 4));
    let snap = thread.stop().unwrap().cqs[0].clone();
    assert_eq!(snap.recovered_missed_events, 0);
    if sleeps(mode) {
        assert!(producer.stats().notified >= 1);
    }
}
all_modes!(solicited_only_arming);

/// Every notification arrives late: nothing is lost, nothing needs the
/// safety timeout.
fn delayed_notifications(mode: PollMode) {
    let faults = Faults {
        delay: 1.0,
        delay_by: Duration::from_millis(5),
        ..Faults::default()
    };
    let (producer, poller, handle) = cq("delay", 64, faults);
    let record = Record::new(10);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_secs(30));
    for t in 0..10u32 {
        std::thread::sleep(Duration::from_millis(3));
        let wc = tracked(&reg, &record, 0, OpKind::Send, Opcode::Send, t..t + 1);
        producer.push(wc[0], false).unwrap();
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 10));
    // Let the last delayed notifications land, so the stop acks them.
    std::thread::sleep(Duration::from_millis(20));
    let report = thread.stop().unwrap();
    assert!(report.errors.is_empty(), "{:?}", report.errors);
    assert_eq!(report.cqs[0].recovered_missed_events, 0);
    assert_eq!(report.cqs[0].acks, report.cqs[0].events);
    if sleeps(mode) {
        assert!(producer.stats().delayed >= 1);
    }
}
all_modes!(delayed_notifications);

/// The device vanishes under a running poller: what was delivered stays
/// delivered, the poller counts the failures and the fatal event, backs
/// off instead of spinning on errors, and still stops cleanly.
fn vanished_device_is_reported_not_a_panic(mode: PollMode) {
    let (producer, poller, handle) = cq("vanish", 64, Faults::default());
    let record = Record::new(5);
    let reg = register(&handle, &record, 0);
    let thread = spawn(mode, vec![poller], Duration::from_millis(20));
    for t in 0..5u32 {
        let wc = tracked(&reg, &record, 0, OpKind::Send, Opcode::Send, t..t + 1);
        producer.push(wc[0], false).unwrap();
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 5));
    producer.vanish();
    assert!(producer
        .push(completion(0, Status::Success, Opcode::Send), false)
        .is_err());
    assert!(wait_until(Duration::from_secs(5), || {
        let s = handle.snapshot();
        s.poll_errors >= 1 && s.async_events >= 1
    }));
    std::thread::sleep(Duration::from_millis(50));
    let polls_before = handle.snapshot().poll_errors;
    std::thread::sleep(Duration::from_millis(50));
    let polls_after = handle.snapshot().poll_errors;
    assert!(
        polls_after - polls_before < 50,
        "the poller backs off on a dead device ({polls_before} -> {polls_after})"
    );
    let report = thread.stop().unwrap();
    assert_eq!(report.cqs[0].completions, 5);
    assert_eq!(record.delivered(), 5);
}
all_modes!(vanished_device_is_reported_not_a_panic);
