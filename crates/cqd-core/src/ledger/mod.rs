//! The outstanding-work ledger, its watchdog, and the shutdown report.
//!
//! Two accounts are kept of every request posted through the posting call
//! ([`Registration::post_send`](crate::cq::Registration::post_send) and
//! [`post_recv`](crate::cq::Registration::post_recv)):
//!
//! - **Per handler and kind**, the handler's [`SlotLedger`]: `posted`,
//!   `completed` and `flushed`. One meaning everywhere: **completed counts
//!   every completion — successes, errors and flushes — and flushed is the
//!   subset of completed that came back with a flush error.** An unsignaled
//!   send that succeeded has no completion of its own; it counts completed
//!   when the signaled completion after it on its send queue is polled. A
//!   handler's outstanding requests are `posted - completed`.
//! - **Per queue**, a [`QueueAccount`]: the ring of (wr_id, post time,
//!   credit taken) of the requests outstanding on that queue, in post order
//!   (see [`crate::account`]). A CQ's [`WrLedger`] maps each QP (and side)
//!   whose completions go to that CQ to its queue's account; the poller
//!   retires entries as it polls, the watchdog reports the old ones.
//!
//! - The watchdog ([`WrLedger::scan`], or a [`Watchdog`] thread): every
//!   request outstanding longer than a threshold is reported — a `tracing`
//!   warning naming handler, QP and wr_id, and the `stuck` metric.
//! - [`ShutdownReport`]: at the end, per handler and kind, posted ==
//!   completed, or exactly what is missing and which requests are stuck.
//!   [`drain`] polls until everything is resolved or a timeout.

use crate::sync::{AtomicBool, Ordering};
use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use crate::account::{CtxWord, Home, RetireHeld, RetireLock};
pub use crate::account::{DrainMarker, Queue, QueueAccount};
use crate::budget::CqBudget;
use crate::slab::SlotLedger;

pub(crate) mod cache;
mod teardown;
use crate::wr_id::{HandlerKey, OpKind, Side, WrId};
pub(crate) use cache::AccountCache;
pub use teardown::{
    CloseSignal, CloseTimedOut, CloseWait, Graveyard, NotDrained, Retired, SrqUser, Zombie,
};

/// The QP number under which a ledger maps an SRQ of its own to that
/// SRQ's account, `SRQ_SELF | srq number` (above every QP number, which
/// has 24 bits): the stop hands the SRQ's unused receives back through it
/// ([`WrLedger::unused_srq_receives`]).
pub(crate) const SRQ_SELF: u32 = 1 << 31;

/// An SRQ serves the handlers of one CQ (see
/// [`WrLedger::attach_srq_user`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("SRQ {srq} already serves the handlers of another CQ: its receives complete on the CQ of the QP that consumes them, and a wr_id names a handler of one CQ")]
#[non_exhaustive]
pub struct SrqOnOtherCq {
    /// The SRQ.
    pub srq: u32,
}

/// A request outstanding longer than the watchdog's threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckWr {
    /// The QP it was posted on.
    pub qp_num: u32,
    /// Its queue.
    pub side: Side,
    /// Its wr_id, raw.
    pub wr_id: u64,
    /// The handler, kind and tag, if the wr_id is one cqd made.
    pub decoded: Option<WrId>,
    /// How long it has been outstanding.
    pub age: Duration,
}

impl fmt::Display for StuckWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "QP {} {:?} wr_id {:#x}",
            self.qp_num, self.side, self.wr_id
        )?;
        if let Some(id) = self.decoded {
            write!(f, " (handler {}, {}, tag {})", id.key, id.kind, id.tag)?;
        }
        write!(f, " outstanding for {:?}", self.age)
    }
}

/// A copy of a ledger's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LedgerSnapshot {
    /// Requests outstanding, all QPs.
    pub outstanding: u64,
    /// Age of the oldest outstanding request (nanoseconds; 0 if none).
    pub oldest_ns: u64,
    /// Stuck requests the watchdog reported (each once).
    pub stuck: u64,
    /// Watchdog scans.
    pub scans: u64,
}

/// The shared part of a [`WrLedger`].
#[derive(Debug, Default)]
pub(crate) struct LedgerInner {
    /// The CQ's budget, which accounts opened here take credits from.
    budget: Option<CqBudget>,
    /// (qp_num, side) → the account of the queue whose completions carry
    /// that QP number on that side. Read by the poller on a cache miss;
    /// written when queues are made and destroyed.
    queues: RwLock<HashMap<(u32, Side), Arc<QueueAccount>>>,
    /// Moves on at every change of `queues`: pollers then empty their
    /// caches.
    epoch: AtomicU64,
    /// The retiring lock of every queue opened here (`account::ring`):
    /// the poller takes it once per batch.
    retire: Arc<RetireLock>,
    /// The SRQs whose home this ledger became (`owns`), attached to a QP
    /// or not yet: a receive can be posted to an SRQ before any QP draws
    /// on it, and a context handler's end (R8) must find it.
    srqs: parking_lot::Mutex<Vec<Arc<QueueAccount>>>,
    /// The QPs whose receives come from an SRQ, by QP number, until they
    /// are quiesced (`teardown`, steps 1-3).
    srq_users: parking_lot::Mutex<HashMap<u32, Arc<SrqUser>>>,
    /// Context words of requests that [`WrLedger::retire`] retired (the
    /// expert path), with their wr_ids: no completion will carry them, so
    /// their handler's end (R8) hands them to `on_abandoned`.
    orphans: parking_lot::Mutex<Vec<(u64, CtxWord)>>,
    stuck: AtomicU64,
    scans: AtomicU64,
}

impl Home for LedgerInner {
    fn detach(&self, qp_num: u32, side: Side, account: &Arc<QueueAccount>) {
        let mut q = self.queues.write();
        let mut keys = vec![(qp_num, side)];
        if account.queue() == Queue::Srq {
            keys.push((SRQ_SELF | account.number(), Side::Recv));
        }
        let mut changed = false;
        for key in keys {
            if q.get(&key).is_some_and(|a| Arc::ptr_eq(a, account)) {
                q.remove(&key);
                changed = true;
            }
        }
        drop(q);
        if changed {
            self.epoch.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// The ledger of one CQ: which queue account each completion belongs to.
/// Cloneable; every clone is the same ledger. The backend attaches a queue
/// when it makes a QP or SRQ; the posting call and the poller keep the
/// accounts; the watchdog scans them.
#[derive(Clone, Default)]
pub struct WrLedger {
    pub(crate) inner: Arc<LedgerInner>,
}

impl fmt::Debug for WrLedger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WrLedger")
            .field("queues", &self.inner.queues.read().len())
            .field(
                "budget",
                &self.inner.budget.as_ref().map(CqBudget::capacity),
            )
            .finish()
    }
}

impl WrLedger {
    /// An empty ledger whose queues take no credits.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty ledger whose queues take credits from `budget` (if it has
    /// credits): the ledger of the CQ that budget belongs to.
    pub fn with_budget(budget: CqBudget) -> Self {
        WrLedger {
            inner: Arc::new(LedgerInner {
                budget: Some(budget),
                ..LedgerInner::default()
            }),
        }
    }

    /// The budget accounts of this ledger take credits from.
    pub fn budget(&self) -> Option<&CqBudget> {
        self.inner.budget.as_ref()
    }

    /// True if both are the same ledger (clones of one CQ's).
    pub fn same_as(&self, other: &WrLedger) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Binds `account` to this ledger's CQ if it belongs to none yet (an
    /// SRQ's first user); true if it belongs to this CQ.
    pub(crate) fn owns(&self, account: &QueueAccount) -> bool {
        let mut bound = false;
        let home = account.home.get_or_init(|| {
            bound = true;
            let weak: Weak<dyn Home> = Arc::downgrade(&self.inner) as Weak<dyn Home>;
            weak
        });
        if bound {
            // An SRQ's first user (a QP's queue is born with its home).
            if let Some(me) = account.me.upgrade() {
                self.inner
                    .queues
                    .write()
                    .insert((SRQ_SELF | me.number(), Side::Recv), Arc::clone(&me));
                let mut srqs = self.inner.srqs.lock();
                // Those whose queue is gone and whose requests are all
                // retired need no visit.
                srqs.retain(|a| Arc::strong_count(a) > 1 || a.outstanding() > 0);
                srqs.push(me);
                drop(srqs);
                self.changed();
            }
        }
        std::ptr::addr_eq(home.as_ptr(), Arc::as_ptr(&self.inner))
    }

    /// Takes the retiring lock of the queues opened here (the poller's
    /// accounting pass).
    #[inline]
    pub(crate) fn lock_retiring(&self) -> RetireHeld<'_> {
        self.inner.retire.lock()
    }

    /// The bell the posters of the send queues opened here wait for room
    /// on (`account::room`): the poller rings it after a batch that
    /// retired send requests, and ends it when it stops.
    #[inline]
    pub(crate) fn room_bell(&self) -> &crate::account::RoomBell {
        self.inner.retire.bell()
    }

    pub(crate) fn epoch(&self) -> u64 {
        self.inner.epoch.load(Ordering::Acquire)
    }

    fn changed(&self) {
        self.inner.epoch.fetch_add(1, Ordering::AcqRel);
    }

    /// Makes the account of QP `qp_num`'s send or receive queue, whose
    /// completions go to this ledger's CQ, and attaches it. If a destroyed
    /// queue with the same number still holds requests, the new account
    /// keeps it as its predecessor (step 6 of [`crate::account`]).
    pub fn open_queue(&self, qp_num: u32, queue: Queue) -> Arc<QueueAccount> {
        let key = (qp_num, queue.side());
        let mut queues = self.inner.queues.write();
        let prev = queues
            .get(&key)
            .filter(|old| old.queue() != Queue::Srq && old.outstanding() > 0)
            .cloned();
        let account = Arc::new(QueueAccount::new(
            qp_num,
            queue,
            self.inner.budget.as_ref(),
            Some(Arc::downgrade(&self.inner) as Weak<dyn Home>),
            prev,
            Arc::clone(&self.inner.retire),
        ));
        queues.insert(key, Arc::clone(&account));
        drop(queues);
        self.changed();
        account
    }

    /// Attaches QP `qp_num`, whose receives come from the SRQ of `srq`, to
    /// that SRQ's account: its receive completions (which carry `qp_num`)
    /// retire the SRQ's entries.
    ///
    /// # Errors
    /// [`SrqOnOtherCq`] when the SRQ already serves another CQ: a receive
    /// completes on the CQ of whichever QP consumes it, and its wr_id names
    /// a handler of one CQ, so all of an SRQ's QPs must complete their
    /// receives on one CQ.
    ///
    /// Returns the QP's [`SrqUser`] (step 1 of `teardown`): the backend
    /// keeps it, and destroys the QP only once it is
    /// [quiesced](SrqUser::quiesced), when the poller of this CQ has
    /// accounted every completion of the QP's SRQ receives and detached
    /// the QP from the SRQ's account.
    pub fn attach_srq_user(
        &self,
        qp_num: u32,
        srq: &Arc<QueueAccount>,
    ) -> Result<Arc<SrqUser>, SrqOnOtherCq> {
        if !self.owns(srq) {
            return Err(SrqOnOtherCq { srq: srq.number() });
        }
        let user = Arc::new(SrqUser::new(qp_num, srq.number()));
        self.inner
            .queues
            .write()
            .insert((qp_num, Side::Recv), Arc::clone(srq));
        self.inner
            .srq_users
            .lock()
            .insert(qp_num, Arc::clone(&user));
        self.changed();
        Ok(user)
    }

    /// Step 2 of `teardown`: the device will take no more SRQ receives for
    /// QP `qp_num` (its `LAST_WQE_REACHED`, taken by this CQ's poller).
    /// True if the QP is an SRQ user here that had not seen it yet: the
    /// poller then quiesces it after its next short poll.
    pub(crate) fn last_wqe_reached(&self, qp_num: u32) -> bool {
        self.inner
            .srq_users
            .lock()
            .get(&qp_num)
            .is_some_and(|u| u.mark_last_wqe())
    }

    /// Step 2' of `teardown`: QP `qp_num` is destroyed, on a device that
    /// keeps a destroyed QP's completions in its CQs (its
    /// [`AsyncEvent::QpDestroyed`](crate::source::AsyncEvent::QpDestroyed),
    /// taken by this CQ's poller). True if the QP is an SRQ user here that
    /// its backend marked destroyed ([`SrqUser::mark_destroyed`]): the
    /// poller then quiesces it after its next short poll.
    pub(crate) fn qp_destroyed(&self, qp_num: u32) -> bool {
        self.inner
            .srq_users
            .lock()
            .get(&qp_num)
            .is_some_and(|u| u.destroyed())
    }

    /// True while QP number `qp_num` is attached here as an SRQ user that
    /// is not quiesced yet. A backend whose device keeps a destroyed QP's
    /// completions gives a new QP of a number for which this is true no
    /// account here (step 2' of `teardown`): the destroyed QP's
    /// completions under that number are still to be polled.
    pub fn has_srq_user(&self, qp_num: u32) -> bool {
        self.inner.srq_users.lock().contains_key(&qp_num)
    }

    /// Step 3 of `teardown`, for the QPs of `qp_nums` (each past step 2 or
    /// 2'): called by this CQ's poller after a poll that began after their
    /// events and found the CQ empty, once that poll's batch is accounted.
    pub(crate) fn quiesce(&self, qp_nums: &[u32]) {
        for &qp_num in qp_nums {
            let user = self.inner.srq_users.lock().get(&qp_num).cloned();
            if let Some(user) = user {
                self.release_srq_user(&user);
            }
        }
    }

    /// Forgets `user` (a QP the backend destroys): detaches it from the
    /// SRQ's account and marks it quiesced, if the poller has not already.
    /// A backend calls it when it destroys the QP without step 3: the
    /// SRQ's account held nothing once the QP was in the error state (so
    /// no completion of the QP can retire anything of it), or the CQ's
    /// poller is gone.
    pub fn release_srq_user(&self, user: &Arc<SrqUser>) {
        let qp_num = user.qp_num();
        {
            let mut users = self.inner.srq_users.lock();
            if !users.get(&qp_num).is_some_and(|u| Arc::ptr_eq(u, user)) {
                return;
            }
            users.remove(&qp_num);
        }
        {
            let mut q = self.inner.queues.write();
            if q.get(&(qp_num, Side::Recv))
                .is_some_and(|a| a.queue() == Queue::Srq && a.number() == user.srq())
            {
                q.remove(&(qp_num, Side::Recv));
            }
        }
        self.changed();
        user.mark_quiesced();
    }

    /// The receives still posted on this ledger's SRQs that no QP can take
    /// any more, as (QP number, wr_id) of the flush that hands each back:
    /// those of every SRQ homed here with no SRQ user left to quiesce (its
    /// QPs all destroyed, or in the error state and quiesced, step 3 of
    /// `teardown`). The QP number is `SRQ_SELF` (bit 31) | the SRQ's number, which
    /// this ledger maps to the SRQ's account. For the stop.
    pub fn unused_srq_receives(&self) -> Vec<(u32, u64)> {
        let srqs = self.inner.srqs.lock().clone();
        let busy: Vec<u32> = self
            .inner
            .srq_users
            .lock()
            .values()
            .map(|u| u.srq())
            .collect();
        let mut out = Vec::new();
        for a in srqs.iter().filter(|a| !busy.contains(&a.number())) {
            let key = SRQ_SELF | a.number();
            let mut r = a.retiring();
            out.extend(r.live().map(|(_, seen)| (key, seen.wr_id)));
        }
        out
    }

    /// The QPs attached here as SRQ users and not quiesced yet.
    pub fn srq_users(&self) -> usize {
        self.inner.srq_users.lock().len()
    }

    /// The (QP, side) pairs this ledger maps to an account: one per live
    /// queue, one per SRQ user, and one per destroyed queue whose requests
    /// are not all retired yet.
    pub fn queue_count(&self) -> usize {
        self.inner.queues.read().len()
    }

    /// Detaches `account` from (qp_num, side), if it is still the one
    /// attached there.
    pub(crate) fn detach(&self, qp_num: u32, side: Side, account: &Arc<QueueAccount>) {
        self.inner.detach(qp_num, side, account);
    }

    /// The account completions of (qp_num, side) retire.
    pub fn lookup(&self, qp_num: u32, side: Side) -> Option<Arc<QueueAccount>> {
        self.inner.queues.read().get(&(qp_num, side)).cloned()
    }

    fn account(&self, qp_num: u32, side: Side) -> Arc<QueueAccount> {
        if let Some(a) = self.lookup(qp_num, side) {
            return a;
        }
        let queue = match side {
            Side::Send => Queue::Send,
            Side::Recv => Queue::Recv,
        };
        self.open_queue(qp_num, queue)
    }

    /// The expert path, for code that posts outside the posting call:
    /// records requests posted on QP `qp_num`'s `side` queue at `now`, in
    /// post order (opening an account for the queue if it has none). No
    /// credit is taken. Record before posting; [`retire`](Self::retire)
    /// them if the post fails.
    pub fn posted(&self, qp_num: u32, side: Side, wr_ids: &[u64], now: Instant) {
        let account = self.account(qp_num, side);
        let mut post = account.posting();
        let at = crate::account::stamp(now);
        for &wr_id in wr_ids {
            // Signaled as far as the ledger knows: a later completion of
            // the queue retires it anyway if it was not.
            post.write_stamped(wr_id, at, true);
        }
        post.publish();
        post.commit();
    }

    /// Retires as the poller does for a completion of `wr_id` (of any
    /// status: the oldest entry with that wr_id): on a send queue every
    /// entry up to and including it, on a receive queue that entry alone.
    /// Returns the entries retired. (Credits are given back; handler
    /// ledgers are not touched.) A request retired here that was posted
    /// with a context has no completion to carry that context: it is
    /// handed to its handler's `on_abandoned` when the handler ends.
    pub fn retire(&self, qp_num: u32, side: Side, wr_id: u64) -> usize {
        let Some(account) = self.lookup(qp_num, side) else {
            return 0;
        };
        let mut silent = Vec::new();
        let mut ctx = None;
        let mut ring = account.retiring();
        let (credits, found) = ring.retire(wr_id, false, &mut silent, &mut ctx);
        ring.give_back(credits);
        // A request posted with a context is retired here without its
        // completion: its word waits for its handler's end (R8), which
        // looks here after every queue. Kept while the retiring lock is
        // held, so that an end that has visited this queue sees it.
        let words = silent.iter().filter_map(|&(id, w)| Some((id, w?)));
        let words = words.chain(ctx.map(|w| (wr_id, w)));
        let mut words = words.peekable();
        if words.peek().is_some() {
            self.inner.orphans.lock().extend(words);
        }
        drop(ring);
        silent.len() + usize::from(found)
    }

    /// Requests outstanding on one queue.
    pub fn outstanding(&self, qp_num: u32, side: Side) -> usize {
        self.lookup(qp_num, side).map_or(0, |a| a.outstanding())
    }

    /// Age of the oldest request outstanding on one queue.
    pub fn oldest(&self, qp_num: u32, side: Side, now: Instant) -> Option<Duration> {
        self.lookup(qp_num, side)?.oldest(now)
    }

    /// Every distinct account, with a QP number and side it is attached
    /// under (an SRQ's once).
    pub(crate) fn accounts(&self) -> Vec<(u32, Side, Arc<QueueAccount>)> {
        let q = self.inner.queues.read();
        let mut srqs = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(q.len());
        for (&(qp, side), a) in q.iter() {
            if a.queue() == Queue::Srq && !srqs.insert(Arc::as_ptr(a)) {
                continue;
            }
            out.push((qp, side, Arc::clone(a)));
        }
        drop(q);
        // SRQs no QP draws on (yet, or any more), under their own number.
        for a in self.inner.srqs.lock().iter() {
            if srqs.insert(Arc::as_ptr(a)) {
                out.push((a.number(), Side::Recv, Arc::clone(a)));
            }
        }
        out
    }

    /// The context words [`retire`](Self::retire) kept whose wr_id
    /// satisfies `mine` (a context handler's end, R8).
    pub(crate) fn take_orphans(&self, mine: &dyn Fn(u64) -> bool) -> Vec<CtxWord> {
        let mut orphans = self.inner.orphans.lock();
        let mut out = Vec::new();
        orphans.retain(|&(wr_id, w)| {
            let m = mine(wr_id);
            if m {
                out.push(w);
            }
            !m
        });
        out
    }

    /// The receive queues (QP numbers; an SRQ's number) that a batch left
    /// dry and that have stayed dry for at least `grace` (see
    /// [`CqOptions::recv_low_water`](crate::CqOptions::recv_low_water)).
    pub fn dry_receive_queues(&self, now: Instant, grace: Duration) -> Vec<u32> {
        let mut out: Vec<u32> = self
            .accounts()
            .into_iter()
            .filter(|(_, _, a)| a.queue() != Queue::Send)
            .filter(|(_, _, a)| a.dry_since(now).is_some_and(|d| d >= grace))
            .map(|(qp, _, a)| {
                if a.queue() == Queue::Srq {
                    a.number()
                } else {
                    qp
                }
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Every request outstanding for at least `threshold`, receives
    /// included (the stop's report: what never came back). Those not
    /// reported before are traced at warning level and counted as stuck.
    pub fn scan(&self, now: Instant, threshold: Duration) -> Vec<StuckWr> {
        self.scan_queues(now, threshold, true)
    }

    /// The watchdog's scan: as [`scan`](Self::scan), on send queues only.
    /// A receive posted ahead waits for its peer's SEND by design, however
    /// long: it is idle, not stuck (a receive queue's trouble is running
    /// dry, which the poller reports: `CqSnapshot::recv_queues_dry`).
    pub fn watch(&self, now: Instant, threshold: Duration) -> Vec<StuckWr> {
        self.scan_queues(now, threshold, false)
    }

    fn scan_queues(&self, now: Instant, threshold: Duration, receives: bool) -> Vec<StuckWr> {
        self.inner.scans.fetch_add(1, Ordering::Relaxed);
        let mut out = Vec::new();
        let mut newly = 0;
        for (qp_num, side, account) in self.accounts() {
            if !receives && account.queue() != Queue::Send {
                continue;
            }
            let in_order = account.queue() == Queue::Send;
            let mut ring = account.retiring();
            let mut report = Vec::new();
            for (pos, e) in ring.live() {
                let age = now.saturating_duration_since(e.at());
                if age < threshold {
                    if in_order {
                        break; // later ones are younger
                    }
                    continue;
                }
                let qp_num = if account.queue() == Queue::Srq {
                    account.number()
                } else {
                    qp_num
                };
                let stuck = StuckWr {
                    qp_num,
                    side,
                    wr_id: e.wr_id,
                    decoded: WrId::decode(e.wr_id).ok(),
                    age,
                };
                if !e.reported() {
                    report.push(pos);
                    newly += 1;
                    tracing::warn!(qp = qp_num, side = ?side, wr_id = format_args!("{:#x}", e.wr_id),
                        handler = %stuck.decoded.map_or_else(|| "foreign".to_string(), |d| d.key.to_string()),
                        kind = %stuck.decoded.map_or("?", |d| d.kind.name()), ?age, "work request stuck");
                }
                out.push(stuck);
            }
            for pos in report {
                ring.mark_reported(pos);
            }
        }
        self.inner.stuck.fetch_add(newly, Ordering::Relaxed);
        out.sort_by_key(|s| std::cmp::Reverse(s.age));
        out
    }

    /// A copy of the counters.
    pub fn snapshot(&self, now: Instant) -> LedgerSnapshot {
        let mut outstanding = 0;
        let mut oldest_ns = 0;
        for (_, _, a) in self.accounts() {
            outstanding += a.outstanding() as u64;
            if let Some(age) = a.oldest(now) {
                oldest_ns = oldest_ns.max(age.as_nanos() as u64);
            }
        }
        LedgerSnapshot {
            outstanding,
            oldest_ns,
            stuck: self.inner.stuck.load(Ordering::Relaxed),
            scans: self.inner.scans.load(Ordering::Relaxed),
        }
    }
}

/// A thread that scans a ledger every `period` for requests older than
/// `threshold`. Stops when dropped.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the watchdog.
    ///
    /// # Errors
    /// When the OS refuses a thread.
    pub fn spawn(
        ledger: WrLedger,
        threshold: Duration,
        period: Duration,
    ) -> std::io::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let join = std::thread::Builder::new()
            .name("cqd-watchdog".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    std::thread::park_timeout(period);
                    ledger.watch(Instant::now(), threshold);
                }
            })?;
        Ok(Watchdog {
            stop,
            join: Some(join),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(j) = self.join.take() {
            j.thread().unpark();
            let _ = j.join();
        }
    }
}

/// One handler's account of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindAccount {
    /// The handler.
    pub handler: (u32, u16),
    /// The kind.
    #[serde(with = "kind_name")]
    pub kind: OpKind,
    /// Requests posted.
    pub posted: u64,
    /// Requests completed: every completion, successes, errors and
    /// flushes alike (and unsignaled sends retired by a later completion).
    pub completed: u64,
    /// The completed requests that came back with a flush error (a subset
    /// of `completed`).
    pub flushed: u64,
}

impl KindAccount {
    /// Posted requests with no completion yet: `posted - completed`.
    pub fn missing(&self) -> u64 {
        self.posted.saturating_sub(self.completed)
    }
}

/// OpKind is serialised by name.
mod kind_name {
    use super::OpKind;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(k: &OpKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(k.name())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<OpKind, D::Error> {
        let name = String::deserialize(d)?;
        OpKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown kind {name}")))
    }
}

/// The final account of a shutdown (or of any moment).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Per handler and kind, every kind with something posted.
    pub accounts: Vec<KindAccount>,
    /// Requests still outstanding when the report was made (from the
    /// [`WrLedger`], oldest first).
    #[serde(skip)]
    pub stuck: Vec<StuckWr>,
    /// How long the drain waited.
    pub waited: Duration,
    /// True if the drain gave up at its timeout.
    pub timed_out: bool,
}

impl ShutdownReport {
    /// The accounts of `handlers` (key and ledger).
    pub fn from_ledgers<'a>(
        handlers: impl IntoIterator<Item = (HandlerKey, &'a SlotLedger)>,
    ) -> Self {
        let mut accounts = Vec::new();
        for (key, ledger) in handlers {
            for kind in OpKind::ALL {
                let posted = ledger.posted(kind);
                let completed = ledger.completed(kind);
                if posted == 0 && completed == 0 {
                    continue;
                }
                accounts.push(KindAccount {
                    handler: (key.slot(), key.generation()),
                    kind,
                    posted,
                    completed,
                    flushed: ledger.flushed(kind),
                });
            }
        }
        ShutdownReport {
            accounts,
            ..Default::default()
        }
    }

    /// True when every posted request completed (flushes included) and the
    /// drain did not time out.
    pub fn is_balanced(&self) -> bool {
        self.accounts.iter().all(|a| a.missing() == 0) && !self.timed_out
    }

    /// The accounts with requests missing.
    pub fn missing(&self) -> impl Iterator<Item = &KindAccount> {
        self.accounts.iter().filter(|a| a.missing() > 0)
    }
}

impl fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_balanced() {
            let n: u64 = self.accounts.iter().map(|a| a.posted).sum();
            let flushed: u64 = self.accounts.iter().map(|a| a.flushed).sum();
            return write!(
                f,
                "all {n} requests completed, {flushed} of them flushed (waited {:?})",
                self.waited
            );
        }
        writeln!(
            f,
            "requests missing after {:?}{}:",
            self.waited,
            if self.timed_out { " (timed out)" } else { "" }
        )?;
        for a in self.missing() {
            writeln!(
                f,
                "  handler {}#{} {}: posted {}, completed {} ({} flushed), missing {}",
                a.handler.0,
                a.handler.1,
                a.kind,
                a.posted,
                a.completed,
                a.flushed,
                a.missing()
            )?;
        }
        for s in &self.stuck {
            writeln!(f, "  stuck: {s}")?;
        }
        Ok(())
    }
}

/// Step 3 of the shutdown protocol: calls `poll` until no handler has
/// outstanding requests, or `timeout` passes; then reports. `ledger`, if
/// given, names the requests still stuck.
pub fn drain(
    handlers: &[(HandlerKey, &SlotLedger)],
    ledger: Option<&WrLedger>,
    timeout: Duration,
    mut poll: impl FnMut(),
) -> ShutdownReport {
    let start = Instant::now();
    let mut timed_out = false;
    while handlers.iter().any(|(_, l)| l.outstanding() > 0) {
        if start.elapsed() >= timeout {
            timed_out = true;
            break;
        }
        poll();
    }
    let mut report = ShutdownReport::from_ledgers(handlers.iter().copied());
    report.waited = start.elapsed();
    report.timed_out = timed_out;
    if let Some(l) = ledger {
        report.stuck = l.scan(Instant::now(), Duration::ZERO);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_side_retires_in_order_receive_side_by_id() {
        let l = WrLedger::new();
        let t0 = Instant::now();
        l.posted(1, Side::Send, &[10, 11, 12], t0);
        l.posted(1, Side::Recv, &[20, 21], t0);
        assert_eq!(l.retire(1, Side::Send, 11), 2);
        assert_eq!(l.outstanding(1, Side::Send), 1);
        assert_eq!(l.retire(1, Side::Recv, 21), 1);
        assert_eq!(l.retire(1, Side::Recv, 99), 0);
        assert_eq!(l.outstanding(1, Side::Recv), 1);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(l.oldest(1, Side::Send, later), Some(Duration::from_secs(2)));
        let stuck = l.scan(later, Duration::from_secs(1));
        assert_eq!(stuck.len(), 2);
        assert_eq!(l.snapshot(later).stuck, 2);
        l.scan(later, Duration::from_secs(1));
        assert_eq!(
            l.snapshot(later).stuck,
            2,
            "each stuck request is counted once"
        );
    }

    #[test]
    fn report_balances_or_names_what_is_missing() {
        let key = HandlerKey::new(3, 1).unwrap();
        let ledger = SlotLedger::default();
        ledger.add_posted(OpKind::Send, 3);
        ledger.add_completed(OpKind::Send);
        ledger.add_completed(OpKind::Send);
        ledger.add_flushed(OpKind::Send);
        let r = ShutdownReport::from_ledgers([(key, &ledger)]);
        assert!(!r.is_balanced());
        assert_eq!(
            r.accounts[0],
            KindAccount {
                handler: (3, 1),
                kind: OpKind::Send,
                posted: 3,
                completed: 2,
                flushed: 1
            }
        );
        assert!(
            r.to_string().contains("completed 2 (1 flushed), missing 1"),
            "{r}"
        );
        ledger.add_completed(OpKind::Send);
        let r = ShutdownReport::from_ledgers([(key, &ledger)]);
        assert!(r.is_balanced(), "{r}");
        assert!(
            r.to_string()
                .contains("all 3 requests completed, 1 of them flushed"),
            "{r}"
        );
    }
}
