//! The CQ budget: overflow made impossible, not just detected.
//!
//! A CQ has a real capacity (what the device allocated). Every work request
//! posted on a queue whose completions go to that CQ may produce one entry
//! there — signaled or not, because a QP in error flushes every outstanding
//! request with a completion. A queue holds at most its depth of requests
//! (a slot is freed only when its completion is polled), so:
//!
//! 1. **Admission** ([`CqBudget::admit`]): attaching a queue reserves its
//!    depth against the CQ's capacity. A send queue and a receive queue
//!    reserve their depths; a shared receive queue reserves its depth once per
//!    CQ however many QPs draw on it ([`CqBudget::admit_srq`]). An attach that
//!    would oversubscribe fails with [`BudgetError::Oversubscribed`], naming
//!    needed vs available. The reservation is an [`Admission`] released on
//!    drop.
//! 2. **Credits** (optional, [`BudgetOptions::credits`]): for deliberately
//!    oversubscribed designs. The posting call
//!    ([`Registration::post_send`](crate::cq::Registration::post_send)) takes
//!    one credit per request or fails with [`BudgetError::WouldOverflow`];
//!    the poller returns each request's credit when the completion that
//!    covers it is polled — an unsignaled send's with the next signaled
//!    completion of its send queue (send queues complete in order). Which
//!    request holds a credit is recorded in its queue's account
//!    ([`QueueAccount`](crate::ledger::QueueAccount)); the budget itself is
//!    one atomic counter, so posters and the poller never share a lock.
//! 3. **Detection** anyway: the backend reports overflows with
//!    [`CqBudget::record_overflow`]; with admission on the count stays 0.
//!
//! [`cq_depth_for`] sizes a CQ from QP depths (the 2–4× guidance), clamped to
//! the device's `max_cqe`.
//!
//! Admission takes a lock (it runs on QP creation only). Credits are one
//! atomic counter: a post call takes its requests' credits with one
//! compare-and-swap, the poller returns them with one subtraction per run
//! of completions of one queue.

use std::collections::HashMap;
use std::sync::Arc;

// The credit counters come from the loom shim (tests/loom_credits.rs).
use crate::sync::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

/// Budget switches of one CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct BudgetOptions {
    /// Refuse attaches that would oversubscribe the CQ (default on). Off
    /// only to demonstrate overflow detection, or together with credits.
    pub admission: bool,
    /// Credits available for posts (`None`: no credit check). Usually the
    /// CQ's capacity.
    pub credits: Option<u32>,
}

impl Default for BudgetOptions {
    fn default() -> Self {
        BudgetOptions {
            admission: true,
            credits: None,
        }
    }
}

/// Errors of the CQ budget.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BudgetError {
    /// Attaching would reserve more entries than the CQ holds.
    #[error("CQ {cq}: attaching {what} needs {needed} entries but only {available} of {capacity} are free ({reserved} reserved)")]
    Oversubscribed {
        /// The CQ.
        cq: String,
        /// What was being attached (for example `QP 12 send queue`).
        what: String,
        /// Entries the attach needs.
        needed: u64,
        /// Entries still free.
        available: u64,
        /// Entries already reserved.
        reserved: u64,
        /// The CQ's real capacity.
        capacity: u32,
    },
    /// No credit is left: the post could overflow the CQ.
    #[error("CQ {cq}: posting {needed} requests would overflow it ({available} credits left of {limit})")]
    WouldOverflow {
        /// The CQ.
        cq: String,
        /// Credits the post needs.
        needed: u32,
        /// Credits left.
        available: u32,
        /// The credit limit.
        limit: u32,
    },
}

/// A copy of a budget's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct BudgetSnapshot {
    /// The CQ's name.
    pub cq: String,
    /// Its real capacity.
    pub capacity: u32,
    /// Entries reserved by attached queues (may exceed capacity only with
    /// admission off).
    pub reserved: u64,
    /// Attaches refused.
    pub refused: u64,
    /// Credits currently taken (0 without credits).
    pub credits_in_use: u64,
    /// The most credits ever taken at once.
    pub credits_high_water: u64,
    /// Posts refused for want of a credit.
    pub would_overflow: u64,
    /// Overflow events the backend reported (a CQ stays in error after its
    /// first, so at most one per CQ). 0 whenever admission is on.
    pub overflows: u64,
    /// Completions lost to overflows, if the backend knows.
    pub lost: u64,
}

#[derive(Debug)]
struct State {
    /// The CQ's capacity: what it was made with, then what a resize made
    /// it ([`CqBudget::grown_to`]). Under the lock with `reserved`, so that
    /// an admission compares with the capacity of one moment.
    capacity: u32,
    reserved: u64,
    refused: u64,
    srqs: HashMap<u32, (u64, u32)>,
    overflows: u64,
    lost: u64,
}

/// The credit counters: written by posters (take) and the poller (give
/// back), never under a lock.
#[derive(Debug, Default)]
struct Credits {
    in_use: AtomicU64,
    high_water: AtomicU64,
    would_overflow: AtomicU64,
}

#[derive(Debug)]
struct Inner {
    cq: String,
    options: BudgetOptions,
    state: Mutex<State>,
    credits: Credits,
}

/// The budget of one CQ: admission, credits and overflow counts. Cloneable;
/// every clone is the same budget.
#[derive(Debug, Clone)]
pub struct CqBudget {
    inner: Arc<Inner>,
}

/// A reservation of CQ entries; released when dropped.
#[derive(Debug)]
#[must_use = "the reservation is released when the Admission is dropped"]
pub struct Admission {
    inner: Arc<Inner>,
    entries: u64,
    srq: Option<u32>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        let mut st = self.inner.state.lock();
        match self.srq {
            Some(id) => {
                let release = match st.srqs.get_mut(&id) {
                    Some((depth, refs)) => {
                        *refs -= 1;
                        (*refs == 0).then_some(*depth)
                    }
                    None => None,
                };
                if let Some(depth) = release {
                    st.srqs.remove(&id);
                    st.reserved -= depth;
                }
            }
            None => st.reserved -= self.entries,
        }
    }
}

impl Admission {
    /// Entries this admission stands for (an SRQ's depth for every holder).
    pub fn entries(&self) -> u64 {
        self.entries
    }
}

impl CqBudget {
    /// The budget of CQ `cq` holding `capacity` entries.
    pub fn new(cq: impl Into<String>, capacity: u32, options: BudgetOptions) -> Self {
        CqBudget {
            inner: Arc::new(Inner {
                cq: cq.into(),
                options,
                state: Mutex::new(State {
                    capacity,
                    reserved: 0,
                    refused: 0,
                    srqs: HashMap::new(),
                    overflows: 0,
                    lost: 0,
                }),
                credits: Credits::default(),
            }),
        }
    }

    /// The options this budget was made with.
    pub fn options(&self) -> BudgetOptions {
        self.inner.options
    }

    /// The CQ's capacity (after any resize).
    pub fn capacity(&self) -> u32 {
        self.inner.state.lock().capacity
    }

    /// The CQ was resized and now holds `capacity` entries: admission
    /// counts them from now on. Called by the CQ's poller once the
    /// device's resize returned (a capacity below the one admission
    /// counts is ignored: a CQ only grows here). The credit limit
    /// ([`BudgetOptions::credits`]) stays as it was made: below the old
    /// capacity, it is below the new one too.
    pub fn grown_to(&self, capacity: u32) {
        let mut st = self.inner.state.lock();
        st.capacity = st.capacity.max(capacity);
    }

    /// Reserves `entries` for a queue named `what` (for the error message).
    ///
    /// # Errors
    /// [`BudgetError::Oversubscribed`] when admission is on and fewer than
    /// `entries` are free; nothing is reserved then.
    pub fn admit(&self, what: &str, entries: u32) -> Result<Admission, BudgetError> {
        let mut st = self.inner.state.lock();
        self.check(&mut st, what, u64::from(entries))?;
        st.reserved += u64::from(entries);
        Ok(Admission {
            inner: Arc::clone(&self.inner),
            entries: u64::from(entries),
            srq: None,
        })
    }

    /// Reserves a shared receive queue's `depth` once for this CQ: the first
    /// QP drawing on SRQ `srq` with this CQ reserves it, later ones share the
    /// reservation (released with the last holder).
    ///
    /// # Errors
    /// [`BudgetError::Oversubscribed`] as [`admit`](Self::admit).
    pub fn admit_srq(&self, srq: u32, depth: u32) -> Result<Admission, BudgetError> {
        let mut st = self.inner.state.lock();
        if let Some((d, refs)) = st.srqs.get_mut(&srq) {
            *refs += 1;
            let entries = *d;
            return Ok(Admission {
                inner: Arc::clone(&self.inner),
                entries,
                srq: Some(srq),
            });
        }
        self.check(&mut st, &format!("SRQ {srq}"), u64::from(depth))?;
        st.reserved += u64::from(depth);
        st.srqs.insert(srq, (u64::from(depth), 1));
        Ok(Admission {
            inner: Arc::clone(&self.inner),
            entries: u64::from(depth),
            srq: Some(srq),
        })
    }

    /// Entries a new QP would reserve here: `entries` of its own, and
    /// `srq`'s depth (number, depth) unless this CQ holds that SRQ's
    /// reservation already; `None` if admission is on and they do not fit
    /// now. (A look, not a reservation: the QP's creation admits.)
    pub fn fits(&self, entries: u32, srq: Option<(u32, u32)>) -> Option<u64> {
        let st = self.inner.state.lock();
        let srq_part = match srq {
            Some((n, depth)) if !st.srqs.contains_key(&n) => u64::from(depth),
            _ => 0,
        };
        let needed = u64::from(entries) + srq_part;
        let available = u64::from(st.capacity).saturating_sub(st.reserved);
        (!self.inner.options.admission || needed <= available).then_some(needed)
    }

    /// Entries reserved now.
    pub fn reserved(&self) -> u64 {
        self.inner.state.lock().reserved
    }

    fn check(&self, st: &mut State, what: &str, needed: u64) -> Result<(), BudgetError> {
        let capacity = u64::from(st.capacity);
        let available = capacity.saturating_sub(st.reserved);
        if self.inner.options.admission && needed > available {
            st.refused += 1;
            return Err(BudgetError::Oversubscribed {
                cq: self.inner.cq.clone(),
                what: what.to_string(),
                needed,
                available,
                reserved: st.reserved,
                capacity: st.capacity,
            });
        }
        Ok(())
    }

    /// True when posts must take credits.
    #[inline]
    pub fn has_credits(&self) -> bool {
        self.inner.options.credits.is_some()
    }

    /// Takes `n` credits, all or nothing. Without credits it always
    /// succeeds. The posting call takes them; code that posts outside it
    /// (the expert path) takes and gives back its own.
    ///
    /// # Errors
    /// [`BudgetError::WouldOverflow`] when fewer than `n` are left; nothing
    /// is taken then.
    pub fn try_take(&self, n: u32) -> Result<(), BudgetError> {
        let Some(limit) = self.inner.options.credits else {
            return Ok(());
        };
        let c = &self.inner.credits;
        let want = u64::from(n);
        let taken = c
            .in_use
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used + want <= u64::from(limit)).then_some(used + want)
            });
        match taken {
            Ok(before) => {
                let now = before + want;
                if now > c.high_water.load(Ordering::Relaxed) {
                    c.high_water.fetch_max(now, Ordering::Relaxed);
                }
                Ok(())
            }
            Err(used) => {
                c.would_overflow.fetch_add(1, Ordering::Relaxed);
                Err(BudgetError::WouldOverflow {
                    cq: self.inner.cq.clone(),
                    needed: n,
                    available: u64::from(limit).saturating_sub(used) as u32,
                    limit,
                })
            }
        }
    }

    /// Gives back `n` credits (completions polled, or a post that failed).
    #[inline]
    pub fn give_back(&self, n: u64) {
        if n > 0 && self.has_credits() {
            // Never below zero, whatever a caller of the expert path does.
            let _ = self.inner.credits.in_use.fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                |used| Some(used.saturating_sub(n)),
            );
        }
    }

    /// Credits currently taken.
    pub fn credits_in_use(&self) -> u64 {
        self.inner.credits.in_use.load(Ordering::Acquire)
    }

    /// Records the CQ's overflow (`IBV_EVENT_CQ_ERR` on verbs, the async
    /// event on the sim). A CQ overflows once — it stays in error after
    /// it — so however many parties report it (the backend counting its
    /// losses, the poller seeing the event), it counts once.
    pub fn record_overflow(&self) {
        let mut st = self.inner.state.lock();
        st.overflows = 1;
    }

    /// Records `n` completions lost to overflow; the first loss is also the
    /// CQ's overflow ([`record_overflow`](Self::record_overflow)).
    pub fn record_lost(&self, n: u64) {
        let mut st = self.inner.state.lock();
        if n > 0 {
            st.overflows = 1;
        }
        st.lost += n;
    }

    /// A copy of the counters.
    pub fn snapshot(&self) -> BudgetSnapshot {
        let st = self.inner.state.lock();
        BudgetSnapshot {
            cq: self.inner.cq.clone(),
            capacity: st.capacity,
            reserved: st.reserved,
            refused: st.refused,
            credits_in_use: self.inner.credits.in_use.load(Ordering::Acquire),
            credits_high_water: self.inner.credits.high_water.load(Ordering::Relaxed),
            would_overflow: self.inner.credits.would_overflow.load(Ordering::Relaxed),
            overflows: st.overflows,
            lost: st.lost,
        }
    }
}

/// Sizes a CQ for queues of the given depths: `factor` (2–4 is the usual
/// guidance; clamped to that range) times the sum of the depths, never below
/// the sum itself, clamped to the device's `max_cqe`.
///
/// Returns `Err(needed)` when even the plain sum exceeds `max_cqe`: no CQ of
/// this device can admit those queues, so split them over several CQs.
///
/// # Errors
/// The entries needed, when more than `max_cqe`.
pub fn cq_depth_for(depths: &[u32], factor: u32, max_cqe: u32) -> Result<u32, u64> {
    let sum: u64 = depths.iter().map(|d| u64::from(*d)).sum();
    if sum > u64::from(max_cqe) {
        return Err(sum);
    }
    let want = sum.saturating_mul(u64::from(factor.clamp(2, 4)));
    Ok(want.clamp(sum.max(1), u64::from(max_cqe)) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_names_needed_and_available() {
        let b = CqBudget::new("cq", 100, BudgetOptions::default());
        let a = b.admit("QP 1 send queue", 60).unwrap();
        let err = b.admit("QP 2 send queue", 50).unwrap_err();
        assert!(matches!(
            err,
            BudgetError::Oversubscribed {
                needed: 50,
                available: 40,
                ..
            }
        ));
        assert!(err.to_string().contains("needs 50"));
        drop(a);
        let _b = b.admit("QP 2 send queue", 50).unwrap();
        assert_eq!(b.snapshot().reserved, 50);
        assert_eq!(b.snapshot().refused, 1);
    }

    #[test]
    fn a_resize_grows_what_admission_counts_and_never_shrinks_it() {
        let b = CqBudget::new(
            "cq",
            100,
            BudgetOptions {
                admission: true,
                credits: Some(100),
            },
        );
        let _a = b.admit("QP 1", 100).unwrap();
        assert!(b.fits(10, None).is_none());
        b.grown_to(200);
        assert_eq!(b.capacity(), 200);
        assert_eq!(b.fits(10, None), Some(10));
        let _c = b.admit("QP 2", 100).unwrap();
        assert!(b.admit("QP 3", 1).is_err());
        b.grown_to(150);
        assert_eq!(b.snapshot().capacity, 200, "never below a capacity counted");
        // The credit limit is the one the budget was made with.
        assert!(b.try_take(100).is_ok());
        assert!(b.try_take(1).is_err());
    }

    #[test]
    fn srq_counts_once() {
        let b = CqBudget::new("cq", 100, BudgetOptions::default());
        let a1 = b.admit_srq(7, 80).unwrap();
        let a2 = b.admit_srq(7, 80).unwrap();
        assert_eq!(b.snapshot().reserved, 80);
        drop(a1);
        assert_eq!(b.snapshot().reserved, 80);
        drop(a2);
        assert_eq!(b.snapshot().reserved, 0);
    }

    #[test]
    fn admission_off_lets_oversubscription_through() {
        let opts = BudgetOptions {
            admission: false,
            credits: None,
        };
        let b = CqBudget::new("cq", 4, opts);
        let _a = b.admit("q", 16).unwrap();
        assert_eq!(b.snapshot().reserved, 16);
    }

    #[test]
    fn credits_are_all_or_nothing_and_come_back() {
        let opts = BudgetOptions {
            admission: false,
            credits: Some(4),
        };
        let b = CqBudget::new("cq", 4, opts);
        b.try_take(3).unwrap();
        let err = b.try_take(2).unwrap_err();
        assert!(matches!(
            err,
            BudgetError::WouldOverflow {
                needed: 2,
                available: 1,
                limit: 4,
                ..
            }
        ));
        b.try_take(1).unwrap();
        b.give_back(3);
        let s = b.snapshot();
        assert_eq!(
            (s.credits_in_use, s.credits_high_water, s.would_overflow),
            (1, 4, 1)
        );
        let none = CqBudget::new("cq", 4, BudgetOptions::default());
        none.try_take(100).unwrap();
        none.give_back(100);
        assert_eq!(none.credits_in_use(), 0, "no credits, no count");
    }

    #[test]
    fn sizing_helper() {
        assert_eq!(cq_depth_for(&[128, 128], 2, 1 << 20), Ok(512));
        assert_eq!(cq_depth_for(&[128, 128], 9, 1 << 20), Ok(1024));
        assert_eq!(cq_depth_for(&[128, 128], 4, 300), Ok(300));
        assert_eq!(cq_depth_for(&[200, 200], 2, 300), Err(400));
        assert_eq!(cq_depth_for(&[], 2, 300), Ok(1));
    }
}
