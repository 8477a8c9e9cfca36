//! Queue accounts: what is outstanding on one queue, in post order.
//!
//! Every queue a request can be posted to — a QP's send queue, a QP's
//! receive queue, a shared receive queue — has one [`QueueAccount`]: a ring
//! of (wr_id, post time, credit taken, signaled) in post order. Its posters
//! and its poller share no lock: posters serialise among themselves on the
//! ring's posting lock, the poller holds its retiring lock, and the two
//! sides meet only in atomics (the protocol, numbered, is in
//! `account::ring`; its steps are cited as R1–R8 here and in
//! [`crate::post`]).
//!
//! 1. **Posting** (the posting call, [`crate::post`]): the poster takes the
//!    posting lock and the CQ credits, writes its requests' entries and
//!    publishes them (R1–R2) *before* the backend's post (R3), so that a
//!    completion arriving inside the post finds them; if the backend took
//!    only the first `k`, it tombstones the rest (R4). The posting lock is
//!    held across the backend's post, so the ring's order is the queue's
//!    order whatever the number of posting threads, and the poller never
//!    waits for it.
//! 2. **Completing** (the poller, once per batch): the poller finds the
//!    account of each completion's queue through a poller-local table
//!    (qp_num and side → account, filled from the CQ's
//!    `WrLedger` (`crate::ledger`) only on a miss), then takes the CQ's
//!    retiring lock (which no poster takes, and which every queue of the
//!    CQ's ledger shares) once and retires the batch in order. A send-side completion retires every entry
//!    up to and including its wr_id: send queues complete in order, so the
//!    unsignaled requests before it completed silently. A receive retires
//!    its own entry (an SRQ's receives are consumed in any order). The
//!    credits of every retired entry go back to the CQ's budget, one atomic
//!    subtraction per batch.
//! 3. **Silent completions**: the unsignaled requests retired by a later
//!    completion are handed back to the dispatcher, which counts each one
//!    completed in its own handler's ledger (and retires a retiring handler
//!    whose ledger is then clean).
//! 4. A completion of a queue with no account attached retires nothing
//!    and is dispatched as any other. A completion of an attached queue
//!    that matches no request in flight there (the device wrote it twice,
//!    or it names a request posted past the account: a raw post without
//!    [`WrLedger::posted`](crate::ledger::WrLedger::posted)) retires
//!    nothing and is not delivered: it is counted unmatched (stale, if its
//!    handler is gone), so that no handler sees a request complete twice.
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

mod clock;
mod ring;
mod room;

use std::fmt;
use std::sync::{Arc, OnceLock, Weak};
use std::time::Instant;

use parking_lot::Mutex as PlainMutex;

use crate::budget::CqBudget;
use crate::sync::Ordering;
use crate::wr_id::{HandlerKey, OpKind, Side, WrId};
#[cfg(all(test, loom))]
pub(crate) use ring::HEAD_BOUND_IS_TAIL;
pub(crate) use ring::{
    stamp, stamp_now, AtHead, CtxWord, Flags, RetireHeld, RetireLock, SilentEntry,
};
use ring::{NewEntry, Poster, Retirer, Ring};
pub(crate) use room::RoomBell;
pub use room::{RoomError, SendRoom};

/// Where an account belongs: its CQ's ledger (`crate::ledger`), which
/// detaches the account from its map once the queue is closed and
/// drained. A trait, so that accounts need not know the ledger's type.
pub(crate) trait Home: Send + Sync {
    /// Detaches `account` from (number, side), if it is still the one
    /// attached there.
    fn detach(&self, number: u32, side: Side, account: &Arc<QueueAccount>);
}

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

/// The account of one queue (see the module documentation). Made by the
/// backend when it makes the queue (`WrLedger::open_queue`,
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
    pub(crate) home: OnceLock<Weak<dyn Home>>,
    /// This account itself, for an SRQ's (empty for a QP's queue): the
    /// ledger that becomes its home keeps it, so that a handler's end
    /// finds its requests before any QP is attached to it.
    pub(crate) me: Weak<QueueAccount>,
    /// The account of a destroyed queue whose number this queue reuses,
    /// while it still holds requests (step 6 of the module documentation).
    /// Locked by the poller only. (Whether there is one, and whether the
    /// queue is closed, are flags on the ring's retiring line, which the
    /// poller reads with every completion: `Ring::has_prev`,
    /// `Ring::closed`. "closed" is set by [`close`](Self::close) under
    /// the ring's two locks and read by the poller under the retiring
    /// lock: "drained and closed" is one observation, so no request posted
    /// between the two can be detached with the account.)
    prev: PlainMutex<Option<Arc<QueueAccount>>>,
    /// When it went dry (nanoseconds since the ring's base, `stamp`).
    dry_at: std::sync::atomic::AtomicU64,
    /// The posters' tail when it went dry: a receive posted since moves it.
    dry_tail: std::sync::atomic::AtomicU64,
    /// The depth [`reserve`](Self::reserve) prepared the account for (0
    /// before it): the most requests the queue holds at once.
    depth: std::sync::atomic::AtomicU32,
    /// The outstanding requests (`account::ring`): its atomics and locks
    /// come from the synchronisation shim, so that loom checks the post,
    /// the close and the drain.
    ring: Ring,
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
    /// An account retired under `lock` (its CQ's: see
    /// `ring::RetireLock`).
    pub(crate) fn new(
        number: u32,
        queue: Queue,
        budget: Option<&CqBudget>,
        home: Option<Weak<dyn Home>>,
        prev: Option<Arc<QueueAccount>>,
        lock: Arc<RetireLock>,
    ) -> Self {
        let had_prev = prev.is_some();
        let cell = OnceLock::new();
        if let Some(h) = home {
            let _ = cell.set(h);
        }
        QueueAccount {
            number,
            queue,
            credits: budget.filter(|b| b.has_credits()).cloned(),
            home: cell,
            me: Weak::new(),
            dry_at: std::sync::atomic::AtomicU64::new(0),
            dry_tail: std::sync::atomic::AtomicU64::new(0),
            depth: std::sync::atomic::AtomicU32::new(0),
            prev: PlainMutex::new(prev),
            ring: {
                let ring = Ring::new(lock, queue == Queue::Send);
                ring.has_prev().store(had_prev, Ordering::Relaxed);
                ring
            },
        }
    }

    /// The account of shared receive queue `srq_num`. Its receives take no
    /// credits (their CQ is known only when a QP consumes them; admission
    /// covers them). Attach it for each QP that draws on it with
    /// `WrLedger::attach_srq_user`. Made before its CQ is known, it has a
    /// retiring lock of its own.
    pub fn srq(srq_num: u32) -> Arc<QueueAccount> {
        Arc::new_cyclic(|me| QueueAccount {
            me: me.clone(),
            ..QueueAccount::new(srq_num, Queue::Srq, None, None, None, RetireLock::new())
        })
    }

    /// True when `held` is this account's retiring lock.
    #[inline]
    pub(crate) fn retires_under(&self, held: &RetireHeld<'_>) -> bool {
        held.holds(self.ring.retire_lock())
    }

    /// This account's retiring lock.
    #[inline]
    pub(crate) fn retire_lock(&self) -> &RetireLock {
        self.ring.retire_lock()
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
        self.ring.retirer().count()
    }

    /// Age of the oldest outstanding request.
    pub fn oldest(&self, now: Instant) -> Option<std::time::Duration> {
        self.ring
            .retirer()
            .live()
            .map(|(_, e)| now.saturating_duration_since(e.at()))
            .max()
    }

    /// Marks the queue destroyed (the backend calls it when the queue
    /// goes): it is detached from its CQ's ledger now if nothing is
    /// outstanding (its predecessor's requests included), else by the
    /// poller once its last request is retired. It waits for a post in
    /// flight on the queue (the posting lock), so a post and a close never
    /// overlap.
    pub fn close(self: &Arc<Self>) {
        let poster = self.ring.poster();
        let mut r = self.ring.retirer();
        self.ring.closed().store(true, Ordering::Release);
        let drained = r.drained() && !self.has_prev();
        drop(r);
        drop(poster);
        // A poster waiting for room on it (`account::room`) learns that
        // none will come.
        if self.queue == Queue::Send {
            self.ring.retire_lock().bell().ring();
        }
        let home = self.home.get().and_then(Weak::upgrade);
        if let (true, Some(home)) = (drained, home) {
            home.detach(self.number, self.queue.side(), self);
        }
    }

    /// Step 7 of the module documentation, for a backend destroying a QP:
    /// if this send queue's last request is unsignaled, records a drain
    /// marker behind it (taking a credit if the CQ has credits) and calls
    /// `post` with the marker's wr_id, under the queue's posting lock;
    /// `post` must post a signaled request with that wr_id on the QP,
    /// **which must be in the error state** (a QP that is not would execute
    /// it). If `post` fails, the marker's entry and credit are taken back.
    ///
    /// Without a marker (none could be posted), the silent requests stay
    /// outstanding: the stop reports them missing.
    pub fn post_drain_marker<E>(&self, post: impl FnOnce(u64) -> Result<(), E>) -> DrainMarker<E> {
        if self.queue != Queue::Send {
            return DrainMarker::NotNeeded;
        }
        let mut p = self.posting();
        if !p.poster.ends_silently() {
            return DrainMarker::NotNeeded;
        }
        if p.take_credits(1).is_err() {
            return DrainMarker::NoCredit;
        }
        let wr_id = DRAIN_MARKER;
        p.write(wr_id, Instant::now(), true);
        p.publish();
        match post(wr_id) {
            Ok(()) => {
                p.commit();
                DrainMarker::Posted
            }
            Err(e) => {
                p.settle(0, |_, _| {});
                DrainMarker::Failed(e)
            }
        }
    }

    /// Prepares the account for a queue `depth` requests deep: it then
    /// holds them, and a poller's batch of completions not yet retired
    /// (`CqOptions::batch` up to 64), without allocating. Backends call it
    /// when they make the queue; without it the account grows to its
    /// high-water mark the first time it is reached, then allocates no
    /// more.
    pub fn reserve(&self, depth: u32) {
        self.ring.reserve(u64::from(depth) + 64);
        self.depth
            .fetch_max(depth, std::sync::atomic::Ordering::Relaxed);
    }

    /// Waits until this send queue has room for `n` more requests within
    /// its depth (the poller has retired enough of its requests), at most
    /// `timeout`: the wait a caller makes after the posting call refused a
    /// list with [`Refused::Full`](crate::post::Refused::Full). Another
    /// poster may take the room first: post again, and wait again on
    /// `Full`. A receive queue, an SRQ and a queue never reserved have no
    /// such limit: the wait returns at once. The poller is never blocked
    /// by a wait (the protocol is `account::room`'s).
    ///
    /// # Errors
    /// [`RoomError::TooMany`] (`n` exceeds the depth: it never fits),
    /// [`RoomError::TimedOut`], [`RoomError::Closed`] (the queue was
    /// destroyed), [`RoomError::Stopped`] (its CQ's poller ended).
    pub fn wait_room(&self, n: usize, timeout: std::time::Duration) -> Result<(), RoomError> {
        let start = Instant::now();
        self.room_fits(n)?;
        let deadline = start.checked_add(timeout);
        let end = self
            .ring
            .retire_lock()
            .bell()
            .wait(|| self.look_room(n), deadline);
        end.map_err(|e| self.room_error(n, e, start.elapsed()))
    }

    /// As [`wait_room`](Self::wait_room), as a future with no deadline of
    /// its own (wrap it in the runtime's timeout). Dropped, it leaves
    /// nothing behind.
    pub fn room(&self, n: usize) -> SendRoom<'_> {
        SendRoom::new(self, n)
    }

    /// What a waiter's re-check finds (`account::room` step 3).
    pub(crate) fn look_room(&self, n: usize) -> room::Look {
        if self.ring.closed().load(Ordering::Acquire) {
            return room::Look::Closed;
        }
        let depth = u64::from(self.depth());
        if self.queue != Queue::Send || depth == 0 {
            return room::Look::Room;
        }
        if self.ring.tail() + n as u64 <= self.ring.head() + depth {
            room::Look::Room
        } else {
            room::Look::Full
        }
    }

    /// `Err` when `n` requests can never be on the queue at once.
    pub(crate) fn room_fits(&self, n: usize) -> Result<(), RoomError> {
        let depth = self.depth();
        if self.queue == Queue::Send && depth != 0 && n as u64 > u64::from(depth) {
            return Err(RoomError::TooMany {
                qp_num: self.number,
                depth,
                wanted: n,
            });
        }
        Ok(())
    }

    pub(crate) fn room_error(
        &self,
        n: usize,
        end: room::WaitEnd,
        waited: std::time::Duration,
    ) -> RoomError {
        let qp_num = self.number;
        match end {
            room::WaitEnd::Closed => RoomError::Closed { qp_num },
            room::WaitEnd::Ended => RoomError::Stopped { qp_num },
            room::WaitEnd::TimedOut => RoomError::TimedOut {
                qp_num,
                depth: self.depth(),
                outstanding: self.ring.ahead(),
                wanted: n,
                waited,
            },
        }
    }

    /// The bell this queue's posters wait for room on (`account::room`).
    pub(crate) fn bell(&self) -> &room::RoomBell {
        self.ring.retire_lock().bell()
    }

    /// The depth [`reserve`](Self::reserve) prepared the account for, 0
    /// if it was never called: a poller sizes its scratch for the
    /// unsignaled requests one completion of this queue can retire.
    pub(crate) fn depth(&self) -> u32 {
        self.depth.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The posting lock, for one post (steps R1–R4 of `account::ring`).
    #[inline]
    pub(crate) fn posting(&self) -> Posting<'_> {
        Posting {
            account: self,
            poster: self.ring.poster(),
            credit: false,
            done: false,
        }
    }

    /// The retiring lock, for readers beside the poller and tests (R5–R6).
    #[inline]
    pub(crate) fn retiring(&self) -> Retiring<'_> {
        Retiring {
            in_order: self.ring.in_order(),
            account: self,
            r: self.ring.retirer(),
        }
    }

    /// R5–R6 under the retiring lock the caller holds (the poller's pass:
    /// [`retires_under`](Self::retires_under) is true of `held`).
    #[inline]
    pub(crate) fn retiring_under<'a>(&'a self, held: &'a mut RetireHeld<'_>) -> Retiring<'a> {
        Retiring {
            in_order: self.ring.in_order(),
            account: self,
            r: self.ring.retirer_under(held),
        }
    }

    /// Gives `credits` back to the CQ's budget.
    #[inline]
    pub(crate) fn give_back(&self, credits: u64) {
        if let (Some(b), true) = (&self.credits, credits > 0) {
            b.give_back(credits);
        }
    }

    /// Requests waiting on the queue, about (see `Ring::ahead`): no lock.
    pub(crate) fn ahead(&self) -> u64 {
        self.ring.ahead()
    }

    /// True while the poller last found the queue dry.
    #[inline]
    pub(crate) fn is_dry(&self) -> bool {
        self.ring.dry().load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records whether the queue is dry now; true if it just became so
    /// (and then when, for [`dry_since`](Self::dry_since)).
    pub(crate) fn went_dry(&self, dry: bool) -> bool {
        let was = self
            .ring
            .dry()
            .swap(dry, std::sync::atomic::Ordering::Relaxed);
        let went = dry && !was;
        if went {
            self.dry_tail
                .store(self.ring.tail(), std::sync::atomic::Ordering::Relaxed);
            self.dry_at
                .store(stamp(Instant::now()), std::sync::atomic::Ordering::Relaxed);
        }
        went
    }

    /// How long the queue has been dry, if it is (the poller's last check
    /// after a batch consumed from it).
    pub(crate) fn dry_since(&self, now: Instant) -> Option<std::time::Duration> {
        // Still dry now: a receive posted since (by a worker, say) ends
        // it, although no batch has consumed from the queue since; a flush
        // posts nothing and does not.
        let since = self.dry_tail.load(std::sync::atomic::Ordering::Relaxed);
        if !self.is_dry() || self.ring.tail() > since {
            return None;
        }
        let at = self.dry_at.load(std::sync::atomic::Ordering::Relaxed);
        Some(now.saturating_duration_since(clock::instant(at >> ring::AT_SHIFT)))
    }

    /// The common case of R5 under a retiring lock the caller holds
    /// (`account::ring`'s `take_head`): whether `held` is this account's
    /// lock, and if so whether the completion of `wr_id` names the live
    /// entry at `head` (then retired). [`AtHead::Slow`]: take
    /// [`retiring_under`](Self::retiring_under)'s general path (or
    /// [`retire_chained`](Self::retire_chained) with a predecessor).
    #[inline(always)]
    pub(crate) fn retire_head(
        &self,
        held: &mut RetireHeld<'_>,
        wr_id: u64,
        success: bool,
    ) -> AtHead {
        self.ring.retire_head(held, wr_id, success)
    }

    /// The flags the poller's pass reads after a retirement.
    #[inline(always)]
    pub(crate) fn flags(&self) -> Flags {
        self.ring.flags()
    }

    /// True while a predecessor (step 6) still holds requests.
    #[inline]
    pub(crate) fn has_prev(&self) -> bool {
        self.ring.has_prev().load(Ordering::Acquire)
    }

    /// Step 6 for one completion of a queue with a predecessor: the
    /// predecessor first; a completion of this queue ends it. Returns the
    /// credits retired (not yet given back). `held` is this account's
    /// retiring lock, which is its predecessor's too (the two are queues
    /// of one CQ's ledger, under one QP number).
    #[cold]
    #[inline(never)]
    pub(crate) fn retire_chained(
        &self,
        held: &mut RetireHeld<'_>,
        wr_id: u64,
        success: bool,
        silent: &mut Vec<SilentEntry>,
        ctx: &mut Option<CtxWord>,
    ) -> (u64, bool) {
        let mut prev = self.prev.lock();
        if let Some(p) = prev.as_ref() {
            let (credits, found) = p.retiring_under(held).retire(wr_id, success, silent, ctx);
            if found {
                return (credits, true);
            }
        }
        let (mut credits, found) = self
            .retiring_under(held)
            .retire(wr_id, success, silent, ctx);
        if found {
            if let Some(p) = prev.take() {
                self.ring.has_prev().store(false, Ordering::Release);
                credits += p.retiring_under(held).r.take_all(silent);
            }
        }
        (credits, found)
    }

    /// The end of a context handler (`crate::context`): every live request
    /// of this queue (and of its predecessor) whose wr_id has a context
    /// and satisfies `mine` gives its context word to `each`, once (see
    /// `Retirer::abandon_where`). Takes the posting lock, then the
    /// retiring lock (as [`close`](Self::close) does): no post is in
    /// flight while it looks.
    pub(crate) fn abandon_where(&self, mine: &dyn Fn(u64) -> bool, each: &mut dyn FnMut(CtxWord)) {
        // The predecessor is taken out of its lock first: the poller takes
        // that lock under the retiring lock (`retire_chained`), so holding
        // it while waiting for the retiring lock could deadlock.
        let prev = self.prev.lock().clone();
        if let Some(p) = prev {
            p.abandon_where(mine, each);
        }
        let _posting = self.ring.poster();
        self.ring.retirer().abandon_where(mine, each);
    }
}

/// A post on one queue, holding its posting lock (the posting call's
/// steps; R1–R4 of `account::ring`). Dropped unfinished (a backend's post
/// that panicked), what it published stays recorded as posted: the stop
/// then reports what never completed.
pub(crate) struct Posting<'a> {
    account: &'a QueueAccount,
    poster: Poster<'a>,
    /// The entries take credits.
    credit: bool,
    done: bool,
}

impl Posting<'_> {
    /// Takes `n` of the CQ's credits, if it has credits.
    ///
    /// # Errors
    /// Too few are left.
    #[inline]
    pub(crate) fn take_credits(&mut self, n: u32) -> Result<(), crate::budget::BudgetError> {
        if let Some(b) = &self.account.credits {
            b.try_take(n)?;
            self.credit = true;
        }
        Ok(())
    }

    /// The send queue's room for `n` more requests within its reserved
    /// depth: `Err((depth, outstanding))` when there is none. A receive
    /// queue, an SRQ (whose receives complete in any order) and a queue
    /// never reserved are not checked.
    #[inline]
    pub(crate) fn room(&mut self, n: usize) -> Result<(), (u32, u64)> {
        let depth = self.account.depth();
        if self.account.queue != Queue::Send || depth == 0 {
            return Ok(());
        }
        if self.poster.has_room(n as u64, u64::from(depth)) {
            Ok(())
        } else {
            Err((depth, self.poster.in_flight()))
        }
    }

    /// R1: writes one request's entry.
    #[inline]
    pub(crate) fn write(&mut self, wr_id: u64, at: Instant, signaled: bool) {
        self.write_stamped(wr_id, ring::stamp(at), signaled);
    }

    /// R1 with the post time already converted (`stamp`), once per
    /// list.
    #[inline]
    pub(crate) fn write_stamped(&mut self, wr_id: u64, at: u64, signaled: bool) {
        self.poster
            .write(NewEntry::new(wr_id, at, self.credit, signaled));
    }

    /// R1 for a request with a context: `ctx` is the context's word.
    #[inline]
    pub(crate) fn write_ctx(&mut self, wr_id: u64, at: u64, signaled: bool, ctx: CtxWord) {
        self.poster
            .write_ctx(NewEntry::new(wr_id, at, self.credit, signaled), ctx);
    }

    /// The position the next write takes (a context tag is made from it).
    #[inline]
    pub(crate) fn next_pos(&self) -> u64 {
        self.poster.next_pos()
    }

    /// True when a context tag might repeat an outstanding request's (see
    /// `Poster::tags_wrap`).
    #[inline]
    pub(crate) fn tags_wrap(&self) -> bool {
        self.poster.tags_wrap()
    }

    /// R2: publishes the entries written, before the backend's post.
    #[inline]
    pub(crate) fn publish(&self) {
        self.poster.publish();
    }

    /// R4: the backend took the whole list.
    #[inline]
    pub(crate) fn commit(mut self) {
        self.done = true;
        self.poster.commit();
    }

    /// R4: the backend took only the first `posted` requests. The others
    /// are tombstoned and their credits given back; `each(i, taken_back)`
    /// is called for each of them, `i` counted from the first of the list
    /// (`taken_back` false: a completion retired it first, it counts as
    /// posted).
    pub(crate) fn settle(mut self, posted: usize, mut each: impl FnMut(usize, bool)) {
        self.done = true;
        let mut credits = 0;
        let mut i = posted;
        self.poster.settle(posted, |taken_back, credit| {
            if taken_back && credit {
                credits += 1;
            }
            each(i, taken_back);
            i += 1;
        });
        self.account.give_back(credits);
    }
}

#[cfg(all(test, loom))]
impl Posting<'_> {
    /// The loom models' mutation of R1 for a context: the entry is
    /// written flagged, and its word only by
    /// [`write_word_late`](Self::write_word_late).
    pub(crate) fn write_flagged(&mut self, wr_id: u64, at: Instant, signaled: bool) {
        self.poster
            .write_flagged(wr_id, ring::stamp(at), self.credit, signaled);
    }

    /// The mutation's late write of the word at `pos`.
    pub(crate) fn write_word_late(&mut self, pos: u64, ctx: CtxWord) {
        self.poster.write_word_late(pos, ctx);
    }

    /// The loom models' mutation of R4: tombstones with a plain store, as
    /// if no completion could race with it, and gives the credits back.
    pub(crate) fn settle_without_cas(mut self, posted: usize) {
        self.done = true;
        let credits = self.poster.settle_without_cas(posted);
        self.account.give_back(credits);
    }
}

impl Drop for Posting<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.poster.commit();
        }
    }
}

/// One queue's retiring lock held (the poller, the watchdog, a report).
pub(crate) struct Retiring<'a> {
    account: &'a QueueAccount,
    in_order: bool,
    r: Retirer<'a>,
}

impl Retiring<'_> {
    /// Retires what the completion of `wr_id` covers (see the module
    /// documentation; `success` is the completion's status, step 5); the
    /// wr_ids of send-queue entries before it, which completed silently,
    /// are appended to `silent`. Returns the credits of the retired entries
    /// (not yet given back) and whether anything was retired.
    #[inline(always)]
    pub(crate) fn retire(
        &mut self,
        wr_id: u64,
        success: bool,
        silent: &mut Vec<SilentEntry>,
        ctx: &mut Option<CtxWord>,
    ) -> (u64, bool) {
        self.r.retire(wr_id, success, self.in_order, silent, ctx)
    }

    /// True when nothing is outstanding (R6 first).
    pub(crate) fn drained(&mut self) -> bool {
        self.r.drained()
    }

    /// Requests waiting, at most, as this lock saw the posters' tail (see
    /// `Retirer::left`).
    #[inline]
    pub(crate) fn left(&self) -> u64 {
        self.r.left()
    }

    /// Gives `credits` back to the CQ's budget.
    pub(crate) fn give_back(&self, credits: u64) {
        self.account.give_back(credits);
    }

    /// The live entries (position, entry), oldest first.
    pub(crate) fn live(&mut self) -> impl Iterator<Item = (u64, ring::Seen)> + '_ {
        self.r.live()
    }

    /// Marks the entry at `pos` reported stuck.
    pub(crate) fn mark_reported(&mut self, pos: u64) {
        self.r.mark_reported(pos);
    }
}
