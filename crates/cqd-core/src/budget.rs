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
//!    oversubscribed designs. A post takes one credit per request or fails with
//!    [`BudgetError::WouldOverflow`]; each completion returns credits; an
//!    unsignaled send's credit returns with the next completion of the same
//!    send queue (send queues complete in order), see [`CqBudget::complete`].
//! 3. **Detection** anyway: the backend reports overflows with
//!    [`CqBudget::record_overflow`]; with admission on the count stays 0.
//!
//! [`cq_depth_for`] sizes a CQ from QP depths (the 2–4× guidance), clamped to
//! the device's `max_cqe`.
//!
//! Admission and credits take a lock; they run on QP creation and (credits
//! only) per post and per completion — credits are for designs that chose
//! oversubscription, and cost one uncontended lock each way.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::handler::{Failed, Handler, Outbox, RecvDone, SendDone};
use crate::wr_id::Side;

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

#[derive(Debug, Default)]
struct State {
    reserved: u64,
    refused: u64,
    srqs: HashMap<u32, (u64, u32)>,
    credits_in_use: u64,
    credits_high_water: u64,
    would_overflow: u64,
    overflows: u64,
    lost: u64,
    /// Per send queue: wr_ids posted and not yet accounted, in post order.
    sends: HashMap<u32, VecDeque<u64>>,
    /// Per receive queue: credited receives not yet completed.
    recvs: HashMap<u32, u64>,
}

#[derive(Debug)]
struct Inner {
    cq: String,
    capacity: u32,
    options: BudgetOptions,
    state: Mutex<State>,
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
                capacity,
                options,
                state: Mutex::new(State::default()),
            }),
        }
    }

    /// The options this budget was made with.
    pub fn options(&self) -> BudgetOptions {
        self.inner.options
    }

    /// The CQ's capacity.
    pub fn capacity(&self) -> u32 {
        self.inner.capacity
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

    fn check(&self, st: &mut State, what: &str, needed: u64) -> Result<(), BudgetError> {
        let capacity = u64::from(self.inner.capacity);
        let available = capacity.saturating_sub(st.reserved);
        if self.inner.options.admission && needed > available {
            st.refused += 1;
            return Err(BudgetError::Oversubscribed {
                cq: self.inner.cq.clone(),
                what: what.to_string(),
                needed,
                available,
                reserved: st.reserved,
                capacity: self.inner.capacity,
            });
        }
        Ok(())
    }

    /// True when posts must take credits.
    #[inline]
    pub fn has_credits(&self) -> bool {
        self.inner.options.credits.is_some()
    }

    fn take(&self, st: &mut State, n: u32) -> Result<(), BudgetError> {
        let Some(limit) = self.inner.options.credits else {
            return Ok(());
        };
        let available = u64::from(limit).saturating_sub(st.credits_in_use);
        if u64::from(n) > available {
            st.would_overflow += 1;
            return Err(BudgetError::WouldOverflow {
                cq: self.inner.cq.clone(),
                needed: n,
                available: available as u32,
                limit,
            });
        }
        st.credits_in_use += u64::from(n);
        st.credits_high_water = st.credits_high_water.max(st.credits_in_use);
        Ok(())
    }

    /// Takes a credit for each of `wr_ids`, posted in this order on the send
    /// queue of QP `qp_num`. All or nothing.
    ///
    /// # Errors
    /// [`BudgetError::WouldOverflow`] when too few credits are left.
    pub fn take_send(&self, qp_num: u32, wr_ids: &[u64]) -> Result<(), BudgetError> {
        if !self.has_credits() {
            return Ok(());
        }
        let mut st = self.inner.state.lock();
        self.take(&mut st, wr_ids.len() as u32)?;
        st.sends.entry(qp_num).or_default().extend(wr_ids);
        Ok(())
    }

    /// Takes `n` credits for receives posted on QP `qp_num`'s own receive
    /// queue. (Receives of an SRQ take none: admission covers them.)
    ///
    /// # Errors
    /// [`BudgetError::WouldOverflow`] when too few credits are left.
    pub fn take_recv(&self, qp_num: u32, n: u32) -> Result<(), BudgetError> {
        if !self.has_credits() {
            return Ok(());
        }
        let mut st = self.inner.state.lock();
        self.take(&mut st, n)?;
        *st.recvs.entry(qp_num).or_default() += u64::from(n);
        Ok(())
    }

    /// Gives back the credits of a post that failed: the last `n` requests
    /// taken by [`take_send`](Self::take_send) or
    /// [`take_recv`](Self::take_recv) for QP `qp_num`'s `side`.
    pub fn untake(&self, qp_num: u32, side: Side, n: u32) {
        if !self.has_credits() {
            return;
        }
        let mut st = self.inner.state.lock();
        let n = match side {
            Side::Send => st.sends.get_mut(&qp_num).map_or(0, |q| {
                let n = (n as usize).min(q.len());
                q.truncate(q.len() - n);
                n as u64
            }),
            Side::Recv => st.recvs.get_mut(&qp_num).map_or(0, |r| {
                let n = u64::from(n).min(*r);
                *r -= n;
                n
            }),
        };
        st.credits_in_use = st.credits_in_use.saturating_sub(n);
    }

    /// Accounts one polled completion of QP `qp_num`: a receive returns its
    /// credit if it took one (not an SRQ receive); a send-side completion returns the credits of every request
    /// of that send queue up to and including `wr_id` (the unsignaled ones
    /// before it completed silently, in order). Returns the credits given
    /// back. A `wr_id` the queue does not hold returns nothing (counted by
    /// nobody: the poller counts foreign wr_ids).
    pub fn complete(&self, qp_num: u32, side: Side, wr_id: u64) -> u32 {
        if !self.has_credits() {
            return 0;
        }
        let mut st = self.inner.state.lock();
        let n = match side {
            Side::Recv => match st.recvs.get_mut(&qp_num) {
                Some(r) if *r > 0 => {
                    *r -= 1;
                    1
                }
                _ => 0,
            },
            Side::Send => {
                let Some(q) = st.sends.get_mut(&qp_num) else {
                    return 0;
                };
                match q.iter().position(|w| *w == wr_id) {
                    Some(i) => {
                        q.drain(..=i);
                        i as u32 + 1
                    }
                    None => 0,
                }
            }
        };
        st.credits_in_use = st.credits_in_use.saturating_sub(u64::from(n));
        n
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
            capacity: self.inner.capacity,
            reserved: st.reserved,
            refused: st.refused,
            credits_in_use: st.credits_in_use,
            credits_high_water: st.credits_high_water,
            would_overflow: st.would_overflow,
            overflows: st.overflows,
            lost: st.lost,
        }
    }
}

/// A handler wrapper that returns credits for every completion it sees,
/// then calls the wrapped handler. Until the poller returns credits itself,
/// wrap each handler of a CQ whose budget has credits.
///
/// Completions the poller does not dispatch (stale or foreign wr_ids,
/// unknown statuses) do not reach it; their credits are not returned.
#[derive(Debug)]
pub struct CreditReturn<H> {
    budget: CqBudget,
    inner: H,
}

impl<H> CreditReturn<H> {
    /// Wraps `inner`, returning credits to `budget`.
    pub fn new(budget: CqBudget, inner: H) -> Self {
        CreditReturn { budget, inner }
    }
}

impl<W, H: Handler<W>> Handler<W> for CreditReturn<H> {
    fn on_send(&mut self, done: &SendDone<'_>, out: &mut Outbox<'_, W>) {
        let wc = done.completion();
        self.budget.complete(wc.qp_num, Side::Send, wc.wr_id);
        self.inner.on_send(done, out);
    }

    fn on_recv(&mut self, done: &RecvDone<'_>, out: &mut Outbox<'_, W>) {
        let wc = done.completion();
        self.budget.complete(wc.qp_num, Side::Recv, wc.wr_id);
        self.inner.on_recv(done, out);
    }

    fn on_error(&mut self, failed: &Failed<'_>, out: &mut Outbox<'_, W>) {
        let wc = failed.completion();
        self.budget.complete(wc.qp_num, failed.side(), wc.wr_id);
        self.inner.on_error(failed, out);
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
    fn credits_unsignaled_return_with_next_completion() {
        let opts = BudgetOptions {
            admission: false,
            credits: Some(4),
        };
        let b = CqBudget::new("cq", 4, opts);
        b.take_send(1, &[10, 11, 12]).unwrap();
        b.take_recv(1, 1).unwrap();
        let err = b.take_send(1, &[13]).unwrap_err();
        assert!(matches!(
            err,
            BudgetError::WouldOverflow {
                needed: 1,
                available: 0,
                limit: 4,
                ..
            }
        ));
        // 10 and 11 were unsignaled; 12's completion returns all three.
        assert_eq!(b.complete(1, Side::Send, 12), 3);
        assert_eq!(b.complete(1, Side::Recv, 99), 1);
        assert_eq!(
            b.complete(5, Side::Recv, 98),
            0,
            "an SRQ receive took no credit"
        );
        let s = b.snapshot();
        assert_eq!(
            (s.credits_in_use, s.credits_high_water, s.would_overflow),
            (0, 4, 1)
        );
        assert_eq!(b.complete(1, Side::Send, 12), 0, "already accounted");
        b.take_send(2, &[1, 2]).unwrap();
        b.untake(2, Side::Send, 2);
        assert_eq!(b.snapshot().credits_in_use, 0);
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
