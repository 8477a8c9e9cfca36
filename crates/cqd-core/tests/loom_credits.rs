//! Loom model of credit return (`budget`): posters take a CQ's credits
//! before their requests can complete, the poller gives them back only
//! after it has taken the completions out of the CQ. In no interleaving
//! does the CQ hold more entries than the credit limit, a take is all or
//! nothing, and when everything is polled every credit is back.
//!
//! The credits are the real `CqBudget::try_take` / `give_back` (one atomic
//! from the loom shim); the CQ is a counter standing in for the device
//! queue, and the poller's order — remove the entries, then give back —
//! is the one `cq::dispatch` keeps (credits return as an account retires
//! what was polled). The second model gives back before removing and
//! shows loom finding the overflow that order would allow.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p cqd-core --test loom_credits --release`
#![cfg(loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

use cqd_core::budget::BudgetOptions;
use cqd_core::CqBudget;

const LIMIT: u32 = 3;

struct Cq {
    budget: CqBudget,
    /// Entries in the CQ.
    queued: AtomicUsize,
    /// Entries ever completed into it.
    completed: AtomicUsize,
}

impl Cq {
    fn new() -> Self {
        let budget = CqBudget::new(
            "loom",
            LIMIT,
            BudgetOptions {
                admission: false,
                credits: Some(LIMIT),
            },
        );
        Cq {
            budget,
            queued: AtomicUsize::new(0),
            completed: AtomicUsize::new(0),
        }
    }

    /// A post of `n` requests that complete at once: credits first.
    fn post(&self, n: u32) -> bool {
        if self.budget.try_take(n).is_err() {
            return false;
        }
        let now = self.queued.fetch_add(n as usize, Ordering::AcqRel) + n as usize;
        assert!(now <= LIMIT as usize, "CQ overflow: {now} entries");
        self.completed.fetch_add(n as usize, Ordering::AcqRel);
        true
    }

    /// One poll of up to `max` entries; credits back after they left.
    fn poll(&self, max: usize, give_back_first: bool) -> usize {
        let n = self.queued.load(Ordering::Acquire).min(max);
        if n == 0 {
            return 0;
        }
        if give_back_first {
            self.budget.give_back(n as u64);
        }
        self.queued.fetch_sub(n, Ordering::AcqRel);
        if !give_back_first {
            self.budget.give_back(n as u64);
        }
        n
    }
}

fn run(give_back_first: bool) {
    let cq = Arc::new(Cq::new());
    let posters: Vec<_> = [2u32, 1]
        .into_iter()
        .map(|n| {
            let cq = Arc::clone(&cq);
            thread::spawn(move || {
                let mut posted = 0;
                for _ in 0..2 {
                    if cq.post(n) {
                        posted += n as usize;
                    }
                }
                posted
            })
        })
        .collect();
    let poller = {
        let cq = Arc::clone(&cq);
        thread::spawn(move || {
            let mut polled = 0;
            for _ in 0..2 {
                polled += cq.poll(2, give_back_first);
            }
            polled
        })
    };
    let posted: usize = posters.into_iter().map(|h| h.join().unwrap()).sum();
    let mut polled = poller.join().unwrap();
    // Drain what is left, as the poller's next rounds would.
    while cq.queued.load(Ordering::Acquire) > 0 {
        polled += cq.poll(usize::MAX, give_back_first);
    }
    assert_eq!(posted, cq.completed.load(Ordering::Acquire));
    assert_eq!(polled, posted, "every completion polled once");
    assert_eq!(cq.budget.credits_in_use(), 0, "every credit returned");
    assert!(cq.budget.snapshot().credits_high_water <= u64::from(LIMIT));
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

#[test]
fn credits_keep_the_cq_from_overflowing_and_all_come_back() {
    model(|| run(false));
}

/// Giving credits back before the entries leave the CQ lets a poster fill
/// the slots that are still occupied: loom finds the overflow (in a child
/// process, since a failed model panics).
#[test]
fn giving_back_before_polling_overflows() {
    if std::env::var_os("CQD_LOOM_CHILD").is_some() {
        model(|| run(true));
        return;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "giving_back_before_polling_overflows",
            "--nocapture",
        ])
        .env("CQD_LOOM_CHILD", "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "loom found nothing:\n{text}");
    assert!(text.contains("CQ overflow"), "not the overflow:\n{text}");
}
