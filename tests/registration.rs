//! Registration at scale: the registration doorbell (one ring per burst,
//! no command ever stranded while the poller sleeps) and the ledger arena
//! (a registration kept after its handler was released counts and posts
//! nothing, and never touches the slot's next handler).

mod common;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use cqd::core::{
    split, CqHandle, CqOptions, NoSink, NoWork, OpKind, Opcode, PollMode, PollerBuilder,
    PollerThread, Refused, Registration, Status, UnboundCq,
};
use cqd::sim::{sim_cq, sim_cq_with_ledger, Faults, LoopWr, Loopback, LoopbackError, SimCq};

/// A wake timeout far beyond every wait of these tests: a command the
/// doorbell failed to announce would sit until it and fail the test.
const NEVER: Duration = Duration::from_secs(120);

fn cq(name: &str, capacity: u32) -> (SimCq, UnboundCq<NoWork>, CqHandle<NoWork>) {
    let (producer, source) = sim_cq(name, capacity, Faults::default()).unwrap();
    let (poller, handle) = split(source, CqOptions::default()).unwrap();
    (producer, poller, handle)
}

fn spawn(mode: PollMode, cq: UnboundCq<NoWork>) -> PollerThread {
    PollerBuilder::new(format!("reg-{}", mode.name()), NoSink)
        .mode(mode)
        .wake_timeout(NEVER)
        .cq(cq)
        .spawn()
        .unwrap()
}

fn register(h: &CqHandle<NoWork>, record: &Arc<Record>, id: u64) -> Registration {
    h.register(Recorder {
        id,
        record: Arc::clone(record),
        panic_every: None,
    })
    .unwrap()
}

/// Many threads register at once while the poller sleeps in a mode that
/// sleeps: every command reaches it without a completion to wake it (each
/// thread also unregisters a handler at once, which the poller applies
/// only if woken: `unregistrations` counts the applied ones), and then
/// each kept handler receives its completion.
fn concurrent_registrations_while_asleep(mode: PollMode) {
    const THREADS: usize = 8;
    const EACH: usize = 250;
    let (producer, poller, handle) = cq("reg", 8192);
    let record = Record::new(THREADS * EACH);
    let thread = spawn(mode, poller);
    // Let it go to sleep (Event at once; Adaptive after its window).
    std::thread::sleep(Duration::from_millis(50));
    let barrier = Arc::new(Barrier::new(THREADS));
    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let (handle, record, barrier) = (handle.clone(), record.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                (0..EACH)
                    .map(|i| {
                        let id = (t * EACH + i) as u64;
                        let gone = register(&handle, &record, u64::MAX);
                        handle.unregister(gone.key()).unwrap();
                        (id, register(&handle, &record, id))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let regs: Vec<(u64, Registration)> = workers
        .into_iter()
        .flat_map(|w| w.join().unwrap())
        .collect();
    let total = (THREADS * EACH) as u64;
    assert!(
        wait_until(Duration::from_secs(20), || handle
            .snapshot()
            .unregistrations
            == total),
        "{} of {total} unregistrations applied in {}: a command was stranded",
        handle.snapshot().unregistrations,
        mode.name()
    );
    for (id, reg) in &regs {
        record.owner[*id as usize].store(*id, Ordering::Relaxed);
        assert!(reg.track(OpKind::Recv, 1));
        let wr_id = reg.wr_id(OpKind::Recv, *id as u32).unwrap();
        producer
            .push(completion(wr_id, Status::Success, Opcode::Recv), false)
            .unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(20), || record.delivered() == total),
        "delivered {} of {total} in {}",
        record.delivered(),
        mode.name()
    );
    for (id, reg) in &regs {
        assert_eq!(record.hits[*id as usize].load(Ordering::Relaxed), 1);
        assert_eq!(reg.ledger().outstanding(), 0);
    }
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    let snap = handle.snapshot();
    assert_eq!(snap.stale_wr_ids + snap.foreign_wr_ids, 0);
    thread.stop().unwrap();
}
all_modes!(concurrent_registrations_while_asleep);

/// A registration kept after its handler was unregistered and released:
/// its counts read 0, tracking and posting through it are refused, and
/// the slot's next handler keeps an exact ledger.
fn a_released_registration_counts_nothing(mode: PollMode) {
    let ledger = cqd::core::WrLedger::new();
    let (producer, source) =
        sim_cq_with_ledger("stale", 64, Faults::default(), ledger.clone()).unwrap();
    let (poller, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
    let record = Record::new(8);
    let qp = Loopback::new(producer.clone(), 1);
    let old = register(&handle, &record, 0);
    let thread = spawn(mode, poller);
    // One request completed under the old handler, then it goes.
    record.owner[0].store(0, Ordering::Relaxed);
    old.post_recv(&qp, &mut [LoopWr::new(0, OpKind::Recv)])
        .unwrap();
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 1));
    assert_eq!(old.ledger().completed(OpKind::Recv), 1);
    handle.unregister(old.key()).unwrap();
    assert!(wait_until(Duration::from_secs(5), || handle
        .snapshot()
        .unregistrations
        == 1));
    assert_eq!(
        (
            old.ledger().posted(OpKind::Recv),
            old.ledger().outstanding()
        ),
        (1, 0),
        "released: the final counts, until the slot is reused"
    );
    assert!(!old.track(OpKind::Send, 5), "released: tracking refused");

    let new = register(&handle, &record, 1);
    assert_eq!(new.key().slot(), old.key().slot(), "the slot was reused");
    assert_eq!(
        new.ledger().outstanding(),
        0,
        "the slot's ledger starts at 0"
    );
    assert_eq!(old.ledger().completed(OpKind::Recv), 0, "reused: reads 0");
    assert!(!old.track(OpKind::Send, 5));
    old.untrack(OpKind::Send, 5);
    let refused = old.post_recv(&qp, &mut [LoopWr::new(1, OpKind::Recv)]);
    assert!(
        matches!(
            refused,
            Err(LoopbackError::Refused(Refused::Released { .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(new.ledger().posted(OpKind::Send), 0);
    assert_eq!(new.ledger().posted(OpKind::Recv), 0);

    record.owner[2].store(1, Ordering::Relaxed);
    new.post_recv(&qp, &mut [LoopWr::new(2, OpKind::Recv)])
        .unwrap();
    assert!(wait_until(Duration::from_secs(5), || record.delivered() == 2));
    assert_eq!(new.ledger().completed(OpKind::Recv), 1);
    assert_eq!(new.ledger().outstanding(), 0);
    assert_eq!(old.ledger().completed(OpKind::Recv), 0);
    assert_eq!(record.wrong_handler.load(Ordering::Relaxed), 0);
    let report = thread.stop().unwrap();
    assert_eq!(handle.snapshot().stale_wr_ids, 0);
    drop(report);
}
all_modes!(a_released_registration_counts_nothing);
