//! Loom model of the arm / re-poll / sleep protocol (`mode::sleep_once`)
//! against a producer: no interleaving loses a wake-up.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p cqd-core --test loom_arm --release`.
//!
//! The CQ model has IB semantics: an arm is one-shot and fires only for a
//! completion added after it. The group has two CQs and keeps the protocol's
//! states: a CQ is *active* (polled every round) or *quiet* (armed and
//! polled empty after its arm); only active CQs are armed and re-polled, and
//! a CQ whose arm did not fire stays armed — and quiet — across sleeps
//! (step 1 of the protocol in `mode`). The producer adds to the first CQ,
//! then the second, then the first again, so the second is armed across the
//! first's wake-ups in some interleavings. The poller runs the real
//! `sleep_once`; its `block` waits with no timeout, so a lost wake-up is a
//! deadlock, which loom reports. The second model removes the re-poll step
//! and shows loom finding exactly that deadlock.
#![cfg(loom)]

use std::time::Duration;

use cqd_core::mode::{sleep_once, SleepGroup};
use loom::sync::{Arc, Condvar, Mutex};

const CQS: usize = 2;

#[derive(Default)]
struct CqState {
    queued: usize,
    armed: bool,
}

#[derive(Default)]
struct Model {
    cqs: [Mutex<CqState>; CQS],
    /// The shared notification descriptor: which CQs fired, in order.
    fired: Mutex<Vec<usize>>,
    ready: Condvar,
}

impl Model {
    fn produce(&self, i: usize) {
        let fire = {
            let mut cq = self.cqs[i].lock().unwrap();
            cq.queued += 1;
            std::mem::replace(&mut cq.armed, false)
        };
        if fire {
            self.fired.lock().unwrap().push(i);
            self.ready.notify_one();
        }
    }
}

struct Poller {
    m: Arc<Model>,
    repoll: bool,
    got: usize,
    /// The group's view: the arm is in force (not seen firing).
    armed: [bool; CQS],
    /// Active (polled every round) or quiet.
    active: [bool; CQS],
    just_armed: Vec<usize>,
}

impl Poller {
    fn poll(&mut self, i: usize) -> usize {
        let n = std::mem::take(&mut self.m.cqs[i].lock().unwrap().queued);
        self.got += n;
        n
    }
}

impl SleepGroup for Poller {
    type Error = ();
    fn arm_unarmed(&mut self) -> Result<usize, ()> {
        self.just_armed.clear();
        for i in 0..CQS {
            if !self.active[i] {
                continue;
            }
            if self.armed[i] {
                // Armed earlier, polled empty by the last round: quiet.
                self.active[i] = false;
                continue;
            }
            self.m.cqs[i].lock().unwrap().armed = true;
            self.armed[i] = true;
            self.just_armed.push(i);
        }
        Ok(self.just_armed.len())
    }
    fn repoll_armed(&mut self) -> Result<usize, ()> {
        let mut total = 0;
        for j in 0..self.just_armed.len() {
            let i = self.just_armed[j];
            // The broken variant skips the re-poll that follows an arm.
            let n = if self.repoll { self.poll(i) } else { 0 };
            if n == 0 {
                self.active[i] = false;
            }
            total += n;
        }
        Ok(total)
    }
    fn block(&mut self, _timeout: Duration) -> Result<bool, ()> {
        // No timeout: a lost wake-up blocks forever and loom sees it.
        let mut fired = self.m.fired.lock().unwrap();
        while fired.is_empty() {
            fired = self.m.ready.wait(fired).unwrap();
        }
        Ok(false)
    }
    fn collect_events(&mut self) -> Result<u32, ()> {
        let fired = std::mem::take(&mut *self.m.fired.lock().unwrap());
        for &i in &fired {
            self.armed[i] = false;
            self.active[i] = true;
        }
        Ok(fired.len() as u32)
    }
    fn poll_round(&mut self) -> Result<usize, ()> {
        let mut total = 0;
        for i in 0..CQS {
            if self.active[i] {
                total += self.poll(i);
            }
        }
        Ok(total)
    }
}

fn run(repoll: bool) {
    const ITEMS: [usize; 3] = [0, 1, 0];
    loom::model(move || {
        let m = Arc::new(Model::default());
        let producer = {
            let m = Arc::clone(&m);
            loom::thread::spawn(move || {
                for i in ITEMS {
                    m.produce(i);
                }
            })
        };
        let mut p = Poller {
            m: Arc::clone(&m),
            repoll,
            got: 0,
            armed: [false; CQS],
            active: [true; CQS],
            just_armed: Vec::new(),
        };
        while p.got < ITEMS.len() {
            // Drain the active CQs to empty, then sleep.
            if p.poll_round().unwrap() == 0 {
                sleep_once(&mut p, Duration::from_millis(100)).unwrap();
            }
        }
        producer.join().unwrap();
        assert_eq!(p.got, ITEMS.len());
    });
}

#[test]
fn arm_repoll_sleep_loses_no_wakeup() {
    run(true);
}

/// The broken protocol, run in a child process by the test below (loom
/// aborts the process on a deadlock, so `should_panic` cannot catch it).
#[test]
#[ignore = "run as a child process by without_the_repoll_a_wakeup_is_lost"]
fn broken_protocol_child() {
    run(false);
}

#[test]
fn without_the_repoll_a_wakeup_is_lost() {
    let exe = std::env::current_exe().expect("test binary path");
    let out = std::process::Command::new(exe)
        .args([
            "broken_protocol_child",
            "--exact",
            "--ignored",
            "--nocapture",
        ])
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run the child test");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the broken protocol passed loom");
    assert!(
        stderr.contains("deadlock"),
        "expected loom to report a deadlock, got:\n{stderr}"
    );
}
