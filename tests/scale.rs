//! Many CQs per poller: a shared completion channel serves a whole group
//! through one descriptor, quiet CQs cost nothing per wake-up, and the
//! rotating safety net still recovers a missed notification in a large
//! group. Every test runs in every poll mode (`all_modes!`).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::*;
use cqd::core::{
    split, CqHandle, CqOptions, NoSink, NoWork, OpKind, Opcode, PollMode, PollerBuilder,
    PollerThread, Registration, Status, UnboundCq,
};
use cqd::sim::{sim_cq, Faults, SimChannel, SimCq};

fn spawn(mode: PollMode, cqs: Vec<UnboundCq<NoWork>>, timeout: Duration) -> PollerThread {
    let mut b = PollerBuilder::new(format!("s-{}", mode.name()), NoSink)
        .mode(mode)
        .wake_timeout(timeout);
    for c in cqs {
        b = b.cq(c);
    }
    b.spawn().unwrap()
}

struct Cq {
    producer: SimCq,
    reg: Registration,
    _handle: CqHandle<NoWork>,
}

/// Pushes one tracked completion with tag `t` on `cq`, owned by handler
/// `id`.
fn push(cq: &Cq, record: &Record, id: u64, t: u32) {
    record.owner[t as usize].store(id, Ordering::Relaxed);
    cq.reg.track(OpKind::Send, 1);
    cq.producer
        .push(
            completion(
                cq.reg.wr_id(OpKind::Send, t).unwrap(),
                Status::Success,
                Opcode::Send,
            ),
            false,
        )
        .unwrap();
}

/// A CQ's producer and handle.
type Part = (SimCq, CqHandle<NoWork>);

/// `n` CQs of 64 entries on one channel: their unbound halves for a poller,
/// and each one's producer and handle.
fn channel_group(n: usize) -> (Vec<UnboundCq<NoWork>>, Vec<Part>) {
    let chan = SimChannel::new().unwrap();
    (0..n)
        .map(|i| {
            let (producer, source) = chan.cq(format!("c{i}"), 64, Faults::default()).unwrap();
            let (u, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
            (u, (producer, handle))
        })
        .unzip()
}

/// 100 CQs on one channel: completions on a few of them, at different
/// times, each reach their own handler once; no notification is missed or
/// taken by another CQ, and quiet CQs are armed once, not once per sleep.
fn a_channel_group_serves_every_cq(mode: PollMode) {
    const CQS: usize = 100;
    let record = Record::new(64);
    let (unbound, parts) = channel_group(CQS);
    let cqs: Vec<Cq> = parts
        .into_iter()
        .enumerate()
        .map(|(i, (producer, handle))| Cq {
            producer,
            reg: register_on(&handle, &record, i as u64),
            _handle: handle,
        })
        .collect();
    let thread = spawn(mode, unbound, Duration::from_secs(30));
    let busy = [3usize, 50, 99, 3, 7, 50, 0, 99];
    for (round, &c) in busy.iter().enumerate() {
        std::thread::sleep(Duration::from_millis(3));
        for k in 0..8u32 {
            push(&cqs[c], &record, c as u64, round as u32 * 8 + k);
        }
    }
    assert!(
        wait_until(Duration::from_secs(5), || record.delivered() == 64),
        "{mode:?}: delivered {}",
        record.delivered()
    );
    let report = thread.stop().unwrap();
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    assert!(record.hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
    let recovered: u64 = report.cqs.iter().map(|c| c.recovered_missed_events).sum();
    assert_eq!(recovered, 0, "{mode:?}: no notification is lost");
    if sleeps(mode) {
        for (i, c) in report.cqs.iter().enumerate() {
            assert!(
                c.arms <= c.events + 1,
                "{}: {} arms, {} events",
                c.name,
                c.arms,
                c.events
            );
            if !busy.contains(&i) {
                assert_eq!(c.events, 0, "{}: took another CQ's events", c.name);
                assert!(c.arms <= 1, "{}: an idle CQ stays armed", c.name);
            }
        }
    }
}
all_modes!(a_channel_group_serves_every_cq);

fn register_on(h: &CqHandle<NoWork>, record: &Arc<Record>, id: u64) -> Registration {
    h.register(Recorder {
        id,
        record: Arc::clone(record),
        panic_every: None,
    })
    .unwrap()
}

/// 200 CQs, one of which loses every notification: the rotating safety net
/// (64 CQs per wake timeout here) polls it within 4 wake timeouts and
/// counts the recovery; the others are untouched.
fn safety_net_recovers_in_a_large_group(mode: PollMode) {
    const CQS: usize = 200;
    let record = Record::new(8);
    let mut cqs = Vec::new();
    let mut unbound = Vec::new();
    for i in 0..CQS {
        let faults = if i == 150 {
            Faults {
                drop: 1.0,
                ..Faults::default()
            }
        } else {
            Faults::default()
        };
        let (producer, source) = sim_cq(format!("c{i}"), 64, faults).unwrap();
        let (u, handle) = split(source, CqOptions::default()).unwrap();
        let reg = register_on(&handle, &record, i as u64);
        unbound.push(u);
        cqs.push(Cq {
            producer,
            reg,
            _handle: handle,
        });
    }
    let timeout = Duration::from_millis(5);
    let thread = spawn(mode, unbound, timeout);
    std::thread::sleep(Duration::from_millis(20));
    for t in 0..8 {
        push(&cqs[150], &record, 150, t);
    }
    assert!(
        wait_until(timeout * 4 + Duration::from_secs(2), || record.delivered()
            == 8),
        "{mode:?}: delivered {}",
        record.delivered()
    );
    let report = thread.stop().unwrap();
    if sleeps(mode) {
        assert!(report.cqs[150].recovered_missed_events >= 1);
    }
    let others: u64 = report
        .cqs
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 150)
        .map(|(_, c)| c.recovered_missed_events + c.completions)
        .sum();
    assert_eq!(others, 0);
}
all_modes!(safety_net_recovers_in_a_large_group);

/// A handler registered on a quiet CQ of a sleeping 100-CQ group: the
/// group's one doorbell wakes the poller, which applies that CQ's commands,
/// and the handler receives its completions.
fn late_registration_on_a_quiet_cq(mode: PollMode) {
    const CQS: usize = 100;
    let record = Record::new(4);
    let (unbound, parts) = channel_group(CQS);
    let thread = spawn(mode, unbound, Duration::from_secs(30));
    std::thread::sleep(Duration::from_millis(20));
    let (producer, handle) = &parts[70];
    let cq = Cq {
        producer: producer.clone(),
        reg: register_on(handle, &record, 70),
        _handle: handle.clone(),
    };
    if sleeps(mode) {
        assert!(
            wait_until(Duration::from_secs(5), || thread.snapshot().control_wakeups
                >= 1),
            "{mode:?}: the doorbell did not wake the poller"
        );
    }
    for t in 0..4 {
        push(&cq, &record, 70, t);
    }
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 4));
    let report = thread.stop().unwrap();
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    assert_eq!(report.cqs[70].handlers_live, 1);
}
all_modes!(late_registration_on_a_quiet_cq);
