//! Loom model of the shared notifier (`cqd_core::notifier`): two CQs on one
//! channel, each fired by its own thread, and the channel's one poller.
//! No interleaving loses a notification or lets one CQ take another's.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p cqd-core --test loom_notifier --release`.
//!
//! The channel's descriptor is modelled as a counter with a condition
//! variable (step 3 signals it, step 4 drains it). The poller blocks until
//! the descriptor is readable, drains it, takes the ready list (step 5) and
//! lets each reported CQ take its own events (step 6), until it has seen
//! every notification: a notification left pending with the descriptor
//! drained would block it forever, which loom reports as a deadlock.
#![cfg(loom)]

use cqd_core::notifier::{FiredSet, Member};
use loom::sync::{Arc, Condvar, Mutex};

/// Notifications fired on each CQ: the first fires twice (so a fire can
/// race the take of its own earlier one), the second once.
const FIRES: [u32; 2] = [2, 1];

struct Channel {
    set: FiredSet,
    /// The descriptor: pending signals.
    fd: Mutex<u32>,
    readable: Condvar,
}

impl Channel {
    fn fire(&self, m: &Arc<Member>) {
        // Steps 1–2, then 3.
        self.set.fire(m);
        *self.fd.lock().unwrap() += 1;
        self.readable.notify_one();
    }
}

#[test]
fn no_notification_is_lost_or_taken_by_another() {
    let mut model = loom::model::Builder::new();
    // Four preemptions keep the run to seconds (unbounded, it runs for
    // tens of minutes); the races that matter — a fire between the drain,
    // the ready list and the take (steps 4, 5, 6) — need at most two.
    model.preemption_bound = Some(4);
    model.check(|| {
        let chan = Arc::new(Channel {
            set: FiredSet::new(),
            fd: Mutex::new(0),
            readable: Condvar::new(),
        });
        let members = [chan.set.member(10), chan.set.member(20)];
        let firers: Vec<_> = members
            .iter()
            .zip(FIRES)
            .map(|(m, fires)| {
                let (chan, m) = (Arc::clone(&chan), Arc::clone(m));
                loom::thread::spawn(move || {
                    for _ in 0..fires {
                        chan.fire(&m);
                    }
                })
            })
            .collect();
        let mut taken = [0u32; 2];
        let mut ready = Vec::new();
        while taken.iter().sum::<u32>() < FIRES.iter().sum::<u32>() {
            // Block until readable, then drain (step 4).
            {
                let mut fd = chan.fd.lock().unwrap();
                while *fd == 0 {
                    fd = chan.readable.wait(fd).unwrap();
                }
                *fd = 0;
            }
            // Step 5, then each reported CQ takes its own (step 6).
            ready.clear();
            chan.set.take_ready(&mut ready);
            for &t in &ready {
                let i = usize::from(t == 20);
                assert_eq!(members[i].token(), t);
                taken[i] += members[i].take();
            }
        }
        for f in firers {
            f.join().unwrap();
        }
        // Each CQ took exactly its own notifications, and nothing is left.
        assert_eq!(taken, FIRES);
        assert_eq!(members[0].take() + members[1].take(), 0);
    });
}
