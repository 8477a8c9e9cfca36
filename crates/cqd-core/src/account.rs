//! Queue accounts: what is outstanding on one queue, in post order.
//!
//! Every queue a request can be posted to — a QP's send queue, a QP's
//! receive queue, a shared receive queue — has one [`QueueAccount`]: a ring
//! of (wr_id, post time, credit taken) under its own small lock. Nothing
//! else is shared between the threads that post on a queue and the poller
//! that completes it.
//!
//! 1. **Posting** (the posting call, [`crate::post`], its steps 2–6): the
//!    poster locks the account, takes the CQ credits, appends its requests,
//!    calls the backend's post and, if the post fails, removes what was not
//!    posted —
//!    all under the lock, so the ring's order is the queue's order even
//!    with several posting threads, and the poller never sees a request
//!    that the post then takes back.
//! 2. **Completing** (the poller, once per batch): the poller finds the
//!    account of each completion's queue through a poller-local cache
//!    (qp_num and side → account, filled from the CQ's
//!    [`WrLedger`] only on a miss), and locks each account once per run of
//!    completions of that queue. A send-side completion retires every entry
//!    up to and including its wr_id: send queues complete in order, so the
//!    unsignaled requests before it completed silently. A receive retires
//!    its own entry (an SRQ's receives are consumed in any order). The
//!    credits of every retired entry go back to the CQ's budget, one atomic
//!    subtraction per run.
//! 3. **Silent completions**: the unsignaled requests retired by a later
//!    completion are handed back to the dispatcher, which counts each one
//!    completed in its own handler's ledger (and retires a retiring handler
//!    whose ledger is then clean).
//! 4. A completion whose wr_id no account holds (a raw post, a stale
//!    request) retires nothing and is dispatched as any other.
//! 5. **Which entry a completion names.** Each entry records whether its
//!    request was signaled. A successful send-side completion names the
//!    oldest *signaled* entry with its wr_id (a success is reported for
//!    signaled requests only); an error or a flush names the oldest entry
//!    with its wr_id, signaled or not. So a wr_id posted twice on one queue
//!    (the same tag for the writes and the final signaled request of one
//!    operation) retires the right entries.
//! 6. **A queue number reused** (a QP destroyed and its number given to a
//!    new QP) before the old queue's account drained: the new account keeps
//!    the old one as its predecessor. Completions go to the predecessor
//!    first — a CQ reports the old QP's completions (its flushes included)
//!    before any of the new one's — and the new queue's first completion
//!    ends the predecessor: what it still holds will never complete
//!    (unsignaled requests that ran silently), so it is retired as silently
//!    completed and its credits come back.
//! 7. **A queue that ends silently** (a send queue whose last requests are
//!    unsignaled, on a QP being destroyed): nothing after them will retire
//!    them. The backend, once the QP is in the error state, posts a *drain
//!    marker* ([`QueueAccount::post_drain_marker`]): a signaled request of
//!    cqd's own kind ([`OpKind::Internal`]) recorded behind them. The QP
//!    in error flushes it after everything before it, in order, so its
//!    completion retires the silent ones as any later completion would;
//!    the dispatcher gives it to no handler.

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::atomic::AtomicBool as PlainAtomicBool;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use crossbeam_utils::CachePadded;
use parking_lot::Mutex as PlainMutex;

use crate::budget::CqBudget;
use crate::completion::Completion;
use crate::ledger::{LedgerInner, WrLedger};
use crate::sync::{AtomicBool, Ordering, ShortGuard, ShortMutex};
use crate::wr_id::{HandlerKey, OpKind, Side, WrId};

/// Which kind of queue an account is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Queue {
    /// A QP's send queue: completes in order.
    Send,
    /// A QP's own receive queue.
    Recv,
    /// A shared receive queue: its receives complete on the CQ of the QP
    /// that consumed them, with that QP's number, in any order.
    Srq,
}

impl Queue {
    /// The side of the completions of this queue.
    pub fn side(self) -> Side {
        match self {
            Queue::Send => Side::Send,
            Queue::Recv | Queue::Srq => Side::Recv,
        }
    }
}

/// What [`QueueAccount::post_drain_marker`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use]
pub enum DrainMarker<E> {
    /// Not a send queue, or its last request is signaled (its completion,
    /// or its flush, retires everything before it): nothing posted.
    NotNeeded,
    /// The marker is posted; its flush retires the silent requests.
    Posted,
    /// The CQ's credits refused the marker's: nothing posted.
    NoCredit,
    /// The backend's post failed: nothing posted.
    Failed(E),
}

/// The wr_id of a drain marker: cqd's own kind, which the dispatcher never
/// gives to a handler, so the key and tag it carries name nobody.
const DRAIN_MARKER: u64 = match HandlerKey::new(0, 0) {
    Some(key) => WrId {
        kind: OpKind::Internal,
        key,
        tag: 0,
    }
    .encode(),
    None => panic!("slot 0, generation 0 is a key"),
};

/// One request outstanding on a queue.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outstanding {
    pub(crate) wr_id: u64,
    pub(crate) at: Instant,
    pub(crate) credit: bool,
    /// False for an unsignaled send: no success will name it.
    pub(crate) signaled: bool,
    pub(crate) reported: bool,
}

/// The account of one queue (see the module documentation). Made by the
/// backend when it makes the queue ([`WrLedger::open_queue`],
/// [`QueueAccount::srq`]); the posting call and the poller keep it.
pub struct QueueAccount {
    number: u32,
    queue: Queue,
    /// The CQ budget credits are taken from, if it has credits.
    credits: Option<CqBudget>,
    /// The CQ ledger this account belongs to: set when a QP's queue is
    /// made; for an SRQ, by the first QP attached to it or the first post
    /// to it, whichever comes first — an SRQ serves the handlers of one CQ
    /// (a wr_id names a handler of one CQ, and a receive completes on the
    /// CQ of whichever QP consumes it).
    pub(crate) ledger: OnceLock<Weak<LedgerInner>>,
    /// Set by [`close`](Self::close) under the ring's lock, and read under
    /// it by the poller: "drained and closed" is one observation, so no
    /// request posted between the two can be detached with the account.
    closed: AtomicBool,
    /// The account of a destroyed queue whose number this queue reuses,
    /// while it still holds requests (step 6 of the module documentation).
    /// Locked by the poller only.
    prev: PlainMutex<Option<Arc<QueueAccount>>>,
    has_prev: PlainAtomicBool,
    /// On its own cache line: posters of this queue and the poller meet
    /// here, posters and pollers of other queues never do. From the
    /// synchronisation shim, so that loom checks the close and the drain.
    ring: CachePadded<ShortMutex<VecDeque<Outstanding>>>,
}

impl fmt::Debug for QueueAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueueAccount")
            .field("number", &self.number)
            .field("queue", &self.queue)
            .field("credits", &self.credits.is_some())
            .field("outstanding", &self.outstanding())
            .finish()
    }
}

impl QueueAccount {
    pub(crate) fn new(
        number: u32,
        queue: Queue,
        budget: Option<&CqBudget>,
        ledger: Option<Weak<LedgerInner>>,
        prev: Option<Arc<QueueAccount>>,
    ) -> Self {
        let home = OnceLock::new();
        if let Some(l) = ledger {
            let _ = home.set(l);
        }
        QueueAccount {
            number,
            queue,
            credits: budget.filter(|b| b.has_credits()).cloned(),
            ledger: home,
            closed: AtomicBool::new(false),
            has_prev: PlainAtomicBool::new(prev.is_some()),
            prev: PlainMutex::new(prev),
            ring: CachePadded::new(ShortMutex::new(VecDeque::new())),
        }
    }

    /// Binds the account to `ledger`'s CQ if it belongs to none yet (an
    /// SRQ's first user); true if it belongs to that CQ.
    pub(crate) fn belongs_to(&self, ledger: &WrLedger) -> bool {
        ledger.same(self.ledger.get_or_init(|| Arc::downgrade(&ledger.inner)))
    }

    /// The account of shared receive queue `srq_num`. Its receives take no
    /// credits (their CQ is known only when a QP consumes them; admission
    /// covers them). Attach it for each QP that draws on it with
    /// [`WrLedger::attach_srq_user`].
    pub fn srq(srq_num: u32) -> Arc<QueueAccount> {
        Arc::new(QueueAccount::new(srq_num, Queue::Srq, None, None, None))
    }

    /// The queue's QP number (the SRQ's number for an SRQ).
    pub fn number(&self) -> u32 {
        self.number
    }

    /// The kind of queue.
    pub fn queue(&self) -> Queue {
        self.queue
    }

    /// Requests posted on the queue and not yet retired by a completion.
    pub fn outstanding(&self) -> usize {
        self.lock_ring().len()
    }

    /// Age of the oldest outstanding request.
    pub fn oldest(&self, now: Instant) -> Option<std::time::Duration> {
        self.lock_ring()
            .iter()
            .map(|e| now.saturating_duration_since(e.at))
            .max()
    }

    /// Marks the queue destroyed (the backend calls it when the queue
    /// goes): it is detached from its CQ's ledger now if nothing is
    /// outstanding (its predecessor's requests included), else by the
    /// poller once its last request is retired.
    pub fn close(self: &Arc<Self>) {
        let ring = self.lock_ring();
        self.closed.store(true, Ordering::Release);
        let drained = ring.is_empty() && !self.has_prev();
        drop(ring);
        let ledger = self.ledger.get().and_then(Weak::upgrade);
        if let (true, Some(inner)) = (drained, ledger) {
            WrLedger { inner }.detach(self.number, self.queue.side(), self);
        }
    }

    /// Step 7 of the module documentation, for a backend destroying a QP:
    /// if this send queue's last request is unsignaled, records a drain
    /// marker behind it (taking a credit if the CQ has credits) and calls
    /// `post` with the marker's wr_id, under the queue's lock; `post` must
    /// post a signaled request with that wr_id on the QP, **which must be
    /// in the error state** (a QP that is not would execute it). If `post`
    /// fails, the marker's entry and credit are taken back.
    ///
    /// Without a marker (none could be posted), the silent requests stay
    /// outstanding: the stop reports them missing.
    pub fn post_drain_marker<E>(&self, post: impl FnOnce(u64) -> Result<(), E>) -> DrainMarker<E> {
        if self.queue != Queue::Send {
            return DrainMarker::NotNeeded;
        }
        let mut ring = self.lock();
        if ring.ring.back().is_none_or(|e| e.signaled) {
            return DrainMarker::NotNeeded;
        }
        let credit = match ring.take_credits(1) {
            Ok(c) => c,
            Err(_) => return DrainMarker::NoCredit,
        };
        let wr_id = DRAIN_MARKER;
        ring.push(wr_id, Instant::now(), credit, true);
        match post(wr_id) {
            Ok(()) => DrainMarker::Posted,
            Err(e) => {
                ring.unpush(1);
                DrainMarker::Failed(e)
            }
        }
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// True while a predecessor (step 6) still holds requests.
    #[inline]
    pub(crate) fn has_prev(&self) -> bool {
        self.has_prev.load(Ordering::Acquire)
    }

    /// Step 6 for one completion of a queue with a predecessor: the
    /// predecessor first; a completion of this queue ends it. Returns the
    /// credits retired (not yet given back).
    #[cold]
    #[inline(never)]
    fn retire_chained(&self, wr_id: u64, success: bool, silent: &mut Vec<u64>) -> u64 {
        let mut prev = self.prev.lock();
        if let Some(p) = prev.as_ref() {
            let (credits, found) = p.lock().retire(wr_id, success, silent);
            if found {
                return credits;
            }
        }
        let (mut credits, found) = self.lock().retire(wr_id, success, silent);
        if found {
            if let Some(p) = prev.take() {
                self.has_prev.store(false, Ordering::Release);
                let mut ring = p.lock();
                for e in ring.ring.drain(..) {
                    credits += u64::from(e.credit);
                    silent.push(e.wr_id);
                }
            }
        }
        credits
    }

    fn lock_ring(&self) -> ShortGuard<'_, VecDeque<Outstanding>> {
        self.ring.lock()
    }

    pub(crate) fn lock(&self) -> Ring<'_> {
        Ring {
            account: self,
            ring: self.lock_ring(),
        }
    }
}

/// A locked account.
pub(crate) struct Ring<'a> {
    account: &'a QueueAccount,
    pub(crate) ring: ShortGuard<'a, VecDeque<Outstanding>>,
}

impl Ring<'_> {
    /// Takes `n` credits if the queue's CQ has credits; returns whether it
    /// did.
    pub(crate) fn take_credits(&self, n: u32) -> Result<bool, crate::budget::BudgetError> {
        match &self.account.credits {
            Some(b) => b.try_take(n).map(|()| true),
            None => Ok(false),
        }
    }

    pub(crate) fn push(&mut self, wr_id: u64, at: Instant, credit: bool, signaled: bool) {
        self.ring.push_back(Outstanding {
            wr_id,
            at,
            credit,
            signaled,
            reported: false,
        });
    }

    /// Takes back the last `n` entries (a post that failed part-way) and
    /// their credits.
    pub(crate) fn unpush(&mut self, n: usize) {
        let keep = self.ring.len().saturating_sub(n);
        let credits = self.ring.range(keep..).filter(|e| e.credit).count() as u64;
        self.ring.truncate(keep);
        self.give_back(credits);
    }

    pub(crate) fn give_back(&self, credits: u64) {
        if let Some(b) = &self.account.credits {
            b.give_back(credits);
        }
    }

    /// Retires what the completion of `wr_id` covers (see the module
    /// documentation; `success` is the completion's status, step 5); the
    /// wr_ids of send-queue entries before it, which completed silently,
    /// are appended to `silent`. Returns the credits of the retired entries
    /// (not yet given back) and whether anything was retired.
    #[inline]
    pub(crate) fn retire(
        &mut self,
        wr_id: u64,
        success: bool,
        silent: &mut Vec<u64>,
    ) -> (u64, bool) {
        // The common case: the oldest entry (a signaled send with nothing
        // unsignaled before it, a receive of a QP's own queue).
        if self
            .ring
            .front()
            .is_some_and(|e| e.wr_id == wr_id && (e.signaled || !success))
        {
            let credit = self.ring.pop_front().is_some_and(|e| e.credit);
            return (u64::from(credit), true);
        }
        self.retire_behind(wr_id, success, silent)
    }

    /// Out of line: a send completion behind unsignaled sends, an SRQ
    /// receive out of order, a wr_id the account does not hold.
    #[inline(never)]
    fn retire_behind(&mut self, wr_id: u64, success: bool, silent: &mut Vec<u64>) -> (u64, bool) {
        let named = |e: &Outstanding| e.wr_id == wr_id && (e.signaled || !success);
        let Some(i) = self.ring.iter().position(named) else {
            return (0, false);
        };
        let mut credits = 0;
        if self.account.queue == Queue::Send {
            for e in self.ring.drain(..i) {
                credits += u64::from(e.credit);
                silent.push(e.wr_id);
            }
            if let Some(e) = self.ring.pop_front() {
                credits += u64::from(e.credit);
            }
        } else if let Some(e) = self.ring.remove(i) {
            credits += u64::from(e.credit);
        }
        (credits, true)
    }
}

/// A multiply-rotate hash for the cache's integer keys (SipHash would cost
/// more than the rest of a look-up).
#[derive(Default, Clone, Copy)]
pub(crate) struct KeyHasher(u64);

impl std::hash::Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

type KeyMap<V> = HashMap<u64, V, std::hash::BuildHasherDefault<KeyHasher>>;

fn cache_key(qp_num: u32, side: Side) -> u64 {
    u64::from(qp_num) << 1 | u64::from(side == Side::Recv)
}

/// The poller's own map from (qp_num, side) to the queue's account, filled
/// from the CQ's [`WrLedger`] on a miss (a miss is remembered too, so a
/// queue nobody attached costs one map look-up per run). Emptied whenever
/// the ledger's attachments change.
#[derive(Default)]
pub(crate) struct AccountCache {
    epoch: u64,
    map: KeyMap<Option<Arc<QueueAccount>>>,
    /// Scratch: silently completed wr_ids of the current batch.
    pub(crate) silent: Vec<u64>,
    /// Scratch: closed accounts the batch drained, to detach.
    closed: Vec<(u32, Side, Arc<QueueAccount>)>,
    /// Scratch: each completion's queue key ([`DONE`] once retired or for
    /// a wr_id that is not cqd's).
    keys: Vec<u64>,
}

/// A completion of the batch that is already accounted (or not cqd's).
const DONE: u64 = u64::MAX;

impl fmt::Debug for AccountCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AccountCache")
            .field("queues", &self.map.len())
            .finish()
    }
}

impl AccountCache {
    /// Step 2 of the module documentation for one batch: retires what each
    /// completion covers, gives the credits back (one subtraction for the
    /// batch: every account of a ledger takes its credits from the ledger's
    /// budget), and leaves the silently completed wr_ids in `self.silent`
    /// for the dispatcher.
    pub(crate) fn account_batch(&mut self, ledger: &WrLedger, wcs: &[Completion]) {
        self.silent.clear();
        let epoch = ledger.epoch();
        if epoch != self.epoch {
            self.map.clear();
            self.epoch = epoch;
        }
        // Each completion's queue, decoded once.
        self.keys.clear();
        self.keys
            .extend(wcs.iter().map(|wc| match WrId::decode(wc.wr_id) {
                Ok(id) => cache_key(wc.qp_num, id.kind.side()),
                Err(_) => DONE,
            }));
        let mut credits = 0;
        for i in 0..wcs.len() {
            let key = self.keys[i];
            if key == DONE {
                continue;
            }
            let (qp, side) = (
                wcs[i].qp_num,
                if key & 1 == 1 { Side::Recv } else { Side::Send },
            );
            let account = self
                .map
                .entry(key)
                .or_insert_with(|| ledger.lookup(qp, side));
            let Some(account) = account else {
                continue;
            };
            // Every completion of this queue in the batch, in batch order
            // (a queue's completions come in its order), under one lock:
            // completions of several queues interleaved in a batch (sends
            // and receives of one QP) cost one lock per queue, not one per
            // completion.
            let mine = self.keys[i..].iter_mut().zip(&wcs[i..]);
            if account.has_prev() {
                for (k, wc) in mine {
                    if *k == key {
                        *k = DONE;
                        let ok = wc.status.is_success();
                        credits += account.retire_chained(wc.wr_id, ok, &mut self.silent);
                    }
                }
                let ring = account.lock();
                if ring.ring.is_empty() && !account.has_prev() && account.is_closed() {
                    self.closed.push((qp, side, Arc::clone(account)));
                }
                continue;
            }
            let mut ring = account.lock();
            for (k, wc) in mine {
                if *k == key {
                    *k = DONE;
                    let ok = wc.status.is_success();
                    credits += ring.retire(wc.wr_id, ok, &mut self.silent).0;
                }
            }
            // Drained and closed, seen under the lock that `close` sets
            // the flag under: requests posted after the last retirement
            // here and before the close keep the account attached.
            if ring.ring.is_empty() && account.is_closed() {
                self.closed.push((qp, side, Arc::clone(account)));
            }
            drop(ring);
        }
        if let Some(b) = ledger.budget() {
            b.give_back(credits);
        }
        for (qp, side, account) in self.closed.drain(..) {
            ledger.detach(qp, side, &account);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::BudgetOptions;
    use proptest::prelude::*;

    fn budget() -> CqBudget {
        let opts = BudgetOptions {
            admission: false,
            credits: Some(100),
        };
        CqBudget::new("cq", 100, opts)
    }

    #[test]
    fn send_queue_retires_in_order_receive_queue_by_id() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let sq = ledger.open_queue(1, Queue::Send);
        let rq = ledger.open_queue(1, Queue::Recv);
        let now = Instant::now();
        for (q, ids) in [(&sq, [10, 11, 12, 13]), (&rq, [20, 21, 22, 23])] {
            let mut ring = q.lock();
            let credit = ring.take_credits(4).unwrap();
            for id in ids {
                // 10 and 11 are unsignaled sends.
                ring.push(id, now, credit, !(10..12).contains(&id));
            }
        }
        assert_eq!(b.credits_in_use(), 8);
        let mut silent = Vec::new();
        let mut ring = sq.lock();
        assert_eq!(ring.retire(12, true, &mut silent), (3, true));
        assert_eq!(silent, [10, 11], "the unsignaled ones before it");
        assert_eq!(ring.retire(99, true, &mut silent), (0, false), "not held");
        ring.give_back(3);
        drop(ring);
        let mut ring = rq.lock();
        assert_eq!(ring.retire(22, true, &mut silent), (1, true));
        assert_eq!(silent.len(), 2, "receives retire only themselves");
        ring.unpush(2);
        drop(ring);
        assert_eq!((sq.outstanding(), rq.outstanding()), (1, 1));
        assert_eq!(
            b.credits_in_use(),
            3,
            "8 taken, 3 given back, 2 unpushed (22's not given back yet)"
        );
    }

    #[test]
    fn a_closed_queue_leaves_its_ledger_once_drained() {
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(7, Queue::Send);
        sq.lock().push(1, Instant::now(), false, false);
        sq.close();
        assert!(ledger.lookup(7, Side::Send).is_some(), "still outstanding");
        let mut cache = AccountCache::default();
        let mut wc = Completion::success(0, crate::completion::Opcode::Send, 7);
        wc.wr_id = 1;
        cache.account_batch(&ledger, &[wc]);
        assert_eq!(sq.outstanding(), 1, "wr_id 1 is foreign: not retired");
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = key.wr_id(crate::wr_id::OpKind::Send, 1).unwrap();
        sq.lock().push(id, Instant::now(), false, true);
        wc.wr_id = id;
        cache.account_batch(&ledger, &[wc]);
        assert_eq!(cache.silent, [1], "the foreign entry before it, silently");
        assert!(ledger.lookup(7, Side::Send).is_none(), "detached");
    }

    #[test]
    fn a_drain_marker_follows_a_silent_tail_only_and_retires_it() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |tag| key.wr_id(OpKind::Write, tag).unwrap();
        let sq = ledger.open_queue(3, Queue::Send);
        let rq = ledger.open_queue(3, Queue::Recv);
        let now = Instant::now();
        let push = |tag, signaled| {
            let mut ring = sq.lock();
            let c = ring.take_credits(1).unwrap();
            ring.push(id(tag), now, c, signaled);
        };
        let never = |_| -> Result<(), ()> { panic!("no marker is needed") };
        assert_eq!(sq.post_drain_marker(never), DrainMarker::NotNeeded, "empty");
        push(1, true);
        assert_eq!(
            sq.post_drain_marker(never),
            DrainMarker::NotNeeded,
            "signaled last"
        );
        assert_eq!(
            rq.post_drain_marker(never),
            DrainMarker::NotNeeded,
            "a receive queue"
        );
        push(2, false);
        push(3, false);
        // The backend's post fails: nothing is left behind.
        assert_eq!(sq.post_drain_marker(|_| Err(7)), DrainMarker::Failed(7));
        assert_eq!((sq.outstanding(), b.credits_in_use()), (3, 3));
        let mut marker = None;
        let posted = sq.post_drain_marker(|wr_id| -> Result<(), ()> {
            marker = Some(wr_id);
            Ok(())
        });
        assert_eq!(posted, DrainMarker::Posted);
        assert_eq!(
            (sq.outstanding(), b.credits_in_use()),
            (4, 4),
            "the marker holds a credit"
        );
        let marker = marker.unwrap();
        assert_eq!(WrId::decode(marker).unwrap().kind, OpKind::Internal);
        // The completions: the signaled write, then the marker's flush,
        // which retires the silent ones before it.
        let mut cache = AccountCache::default();
        let done = Completion::success(id(1), crate::completion::Opcode::RdmaWrite, 3);
        let flush = Completion::error(marker, crate::completion::Status::WrFlush, 3);
        cache.account_batch(&ledger, &[done, flush]);
        assert_eq!(cache.silent, [id(2), id(3)]);
        assert_eq!((sq.outstanding(), b.credits_in_use()), (0, 0));
    }

    #[test]
    fn a_success_names_the_signaled_entry_of_a_wr_id_posted_twice() {
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(1, Queue::Send);
        let now = Instant::now();
        {
            let mut ring = sq.lock();
            ring.push(5, now, false, false); // the write, unsignaled
            ring.push(5, now, false, true); // the final request, signaled
        }
        let mut silent = Vec::new();
        assert_eq!(sq.lock().retire(5, true, &mut silent), (0, true));
        assert_eq!(silent, [5], "the unsignaled one ran silently");
        assert_eq!(sq.outstanding(), 0, "both retired by the one success");
        // An error names the oldest entry, signaled or not.
        {
            let mut ring = sq.lock();
            ring.push(6, now, false, false);
            ring.push(6, now, false, true);
        }
        silent.clear();
        assert_eq!(sq.lock().retire(6, false, &mut silent), (0, true));
        assert!(silent.is_empty());
        assert_eq!(sq.outstanding(), 1, "the flush of the second is to come");
    }

    #[test]
    fn a_reused_queue_number_retires_the_old_queue_first_then_ends_it() {
        let b = budget();
        let ledger = WrLedger::with_budget(b.clone());
        let key = crate::wr_id::HandlerKey::new(0, 0).unwrap();
        let id = |tag| key.wr_id(crate::wr_id::OpKind::Send, tag).unwrap();
        let old = ledger.open_queue(7, Queue::Send);
        let now = Instant::now();
        for (tag, signaled) in [(1, true), (2, false), (3, true), (4, false)] {
            let mut ring = old.lock();
            let c = ring.take_credits(1).unwrap();
            ring.push(id(tag), now, c, signaled);
        }
        old.close();
        // Queue 7 is made again before the old one drained.
        let new = ledger.open_queue(7, Queue::Send);
        {
            let mut ring = new.lock();
            let c = ring.take_credits(1).unwrap();
            ring.push(id(3), now, c, true); // the same wr_id as an old entry
        }
        assert_eq!(b.credits_in_use(), 5);
        let wc = |tag| Completion::success(id(tag), crate::completion::Opcode::Send, 7);
        let mut cache = AccountCache::default();
        // The old queue's completions come first and retire the old entries.
        cache.account_batch(&ledger, &[wc(1), wc(3)]);
        assert!(cache.silent.contains(&id(2)));
        assert_eq!((old.outstanding(), new.outstanding()), (1, 1));
        // The new queue's first completion ends the old one: 4 ran silently.
        cache.account_batch(&ledger, &[wc(3)]);
        assert_eq!(cache.silent, [id(4)]);
        assert_eq!((old.outstanding(), new.outstanding()), (0, 0));
        assert_eq!(b.credits_in_use(), 0, "every credit came back");
    }

    proptest! {
        /// However signaled and unsignaled sends interleave, in-order
        /// completions of the signaled ones (and a final flush of the rest)
        /// retire each entry exactly once and return every credit.
        #[test]
        fn every_entry_retires_once(signaled in proptest::collection::vec(any::<bool>(), 1..64)) {
            let b = budget();
            let ledger = WrLedger::with_budget(b.clone());
            let sq = ledger.open_queue(1, Queue::Send);
            let now = Instant::now();
            for (i, s) in signaled.iter().enumerate() {
                let mut ring = sq.lock();
                let c = ring.take_credits(1).unwrap();
                ring.push(i as u64, now, c, *s);
            }
            let (mut retired, mut credits) = (0usize, 0u64);
            let mut silent = Vec::new();
            for (i, s) in signaled.iter().enumerate() {
                if *s {
                    let (c, found) = sq.lock().retire(i as u64, true, &mut silent);
                    prop_assert!(found);
                    credits += c;
                    retired += 1;
                }
            }
            // A QP in error flushes what is left, each with its own completion.
            let rest: Vec<u64> = sq.lock().ring.iter().map(|e| e.wr_id).collect();
            for id in rest {
                let (c, found) = sq.lock().retire(id, false, &mut silent);
                prop_assert!(found);
                credits += c;
                retired += 1;
            }
            prop_assert_eq!(retired + silent.len(), signaled.len());
            prop_assert_eq!(credits, signaled.len() as u64);
            prop_assert_eq!(sq.outstanding(), 0);
        }
    }
}

#[cfg(all(test, loom))]
mod loom_close {
    use super::*;
    use crate::completion::Opcode;
    use crate::wr_id::{HandlerKey, OpKind};

    /// A queue's last requests posted (an unsignaled send, then a signaled
    /// one) and the queue closed, while the poller retires the request
    /// before them: whatever the interleaving, the account stays attached
    /// until the signaled one's completion retires both, then leaves the
    /// ledger. (Deciding "drained" under the lock and "closed" after it
    /// let the poller detach an account the poster had just refilled: the
    /// next completion then found no account, and the unsignaled send was
    /// never counted completed.)
    #[test]
    fn a_close_after_a_refill_never_detaches_a_live_account() {
        loom::model(|| {
            let key = HandlerKey::new(0, 0).unwrap();
            let id = move |tag| key.wr_id(OpKind::Send, tag).unwrap();
            let ledger = WrLedger::new();
            let sq = ledger.open_queue(7, Queue::Send);
            let now = Instant::now();
            sq.lock().push(id(1), now, false, true);
            let poster = Arc::clone(&sq);
            let t = loom::thread::spawn(move || {
                {
                    let mut ring = poster.lock();
                    ring.push(id(2), now, false, false);
                    ring.push(id(3), now, false, true);
                }
                poster.close();
            });
            let mut cache = AccountCache::default();
            cache.account_batch(&ledger, &[Completion::success(id(1), Opcode::Send, 7)]);
            t.join().unwrap();
            assert!(
                ledger.lookup(7, Side::Send).is_some(),
                "detached with two requests outstanding"
            );
            cache.account_batch(&ledger, &[Completion::success(id(3), Opcode::Send, 7)]);
            assert_eq!(cache.silent, [id(2)], "the unsignaled send, silently");
            assert_eq!(sq.outstanding(), 0);
            assert!(
                ledger.lookup(7, Side::Send).is_none(),
                "detached once drained"
            );
        });
    }
}
