//! Waiting for room on a send queue: a poster whose list the posting call
//! refused with [`Refused::Full`](crate::post::Refused::Full) sleeps until
//! the poller has retired enough of the queue's requests, and is woken
//! then. No lost wake-up, and no cost to the poller beyond one fence per
//! batch unless someone waits.
//!
//! Every queue of one CQ shares one [`RoomBell`] (beside the CQ's retiring
//! lock, which the poller takes once per batch): a `waiting` count on its
//! own cache line, and a mutex over a generation, the wakers of waiting
//! futures and an `ended` mark, with a condition variable for waiting
//! threads. Count accesses are `Relaxed`; the two `SeqCst` fences below
//! (one per side) order the store-then-load pairs, Dekker style, as the
//! worker pool's space wake-up does (`pool::space`).
//!
//! A waiter (a thread in [`QueueAccount::wait_room`], or a
//! [`SendRoom`] future when it would return `Pending`):
//!
//! 1. **Announce**: `waiting += 1`.
//! 2. `fence(SeqCst)`.
//! 3. **Re-check** under the mutex: the queue's room, from its `tail` and
//!    the `head` the poller published (`Acquire`). Room (or the queue
//!    closed, or the bell ended): stop waiting.
//! 4. **Sleep**: a thread waits on the condition variable (which releases
//!    the mutex as it sleeps) until its deadline; a future leaves its waker
//!    in the mutex's list and returns `Pending`. Woken, go back to 3.
//! 5. **Withdraw** (done waiting, or dropped): `waiting -= 1`.
//!
//! The poller, after each batch that retired a send queue's requests:
//!
//! 1. The queues' `head`s are published (`Release`; `account::ring` step
//!    6).
//! 2. `fence(SeqCst)`, once per batch.
//! 3. If `waiting` is not 0 (a `Relaxed` load of a line only waiters
//!    write): take the mutex, bump the generation, take the wakers,
//!    notify every waiting thread, let the mutex go, wake the wakers.
//!
//! Why no wake-up is lost: take the waiter's fence W (its step 2) and the
//! poller's fence P (its step 2) after a batch that freed room. If P
//! precedes W, the waiter's re-check (step 3, after W) loads the new
//! `head` and does not sleep. If W precedes P, the poller's load of
//! `waiting` after P sees the announcement and takes the mutex: either
//! before the waiter's re-check took it (whose lock then follows the
//! poller's release, so the re-check sees the new `head`), or after the
//! waiter went to sleep (the condition variable released the mutex
//! atomically with its sleep; the notification reaches it, and a future's
//! waker is in the list). The loom model `loom_room` checks this on a
//! queue one request deep, and that without the poller's fence it finds
//! the lost wake-up.
//!
//! A close of a queue, and the end of its CQ's poller, ring the bell too
//! (step 3 without the count's check), so that no waiter sleeps past them:
//! the re-check then reports the queue closed or the bell ended.
//!
//! The cost: the poller pays one fence and one load per batch with send
//! completions, and the mutex only while someone waits. All waiters of a
//! CQ are woken together (each re-checks its own queue): waiting for room
//! is the rare, overloaded case.

use std::task::Waker;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::sync::{fence, AtomicUsize, Condvar, Mutex, MutexGuard, Ordering};

#[cfg(all(test, loom))]
std::thread_local! {
    /// The loom model's mutation of [`RoomBell::after_retire`]: the
    /// poller's fence left out.
    pub(crate) static NO_POLLER_FENCE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The waiters of one CQ's send queues (see the module documentation).
pub(crate) struct RoomBell {
    waiting: CachePadded<AtomicUsize>,
    state: Mutex<BellState>,
    cv: Condvar,
}

#[derive(Default)]
struct BellState {
    /// Bumped by every ring: a thread woken sees it moved.
    rung: u64,
    /// The futures waiting (one waker per task).
    wakers: Vec<Waker>,
    /// The poller that retires these queues has ended: no room will come.
    ended: bool,
}

impl std::fmt::Debug for RoomBell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomBell")
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for RoomBell {
    fn default() -> Self {
        RoomBell {
            waiting: CachePadded::new(AtomicUsize::new(0)),
            state: Mutex::new(BellState::default()),
            cv: Condvar::new(),
        }
    }
}

/// What a waiter's re-check (step 3) found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Look {
    /// The queue has room: post again.
    Room,
    /// Not yet.
    Full,
    /// The queue is closed: no completion will free room.
    Closed,
}

/// How a wait ended, when not with room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitEnd {
    /// The queue was closed.
    Closed,
    /// The CQ's poller ended.
    Ended,
    /// The deadline passed.
    TimedOut,
}

impl RoomBell {
    fn lock(&self) -> MutexGuard<'_, BellState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Poller steps 2–3, after a batch that retired send requests.
    #[inline]
    pub(crate) fn after_retire(&self) {
        #[cfg(all(test, loom))]
        let skip = NO_POLLER_FENCE.with(std::cell::Cell::get);
        #[cfg(not(all(test, loom)))]
        let skip = false;
        if !skip {
            fence(Ordering::SeqCst);
        }
        if self.waiting.load(Ordering::Relaxed) != 0 {
            self.ring();
        }
    }

    /// Poller step 3 without the count's check (also a queue's close).
    #[cold]
    pub(crate) fn ring(&self) {
        let mut s = self.lock();
        s.rung = s.rung.wrapping_add(1);
        let wakers = std::mem::take(&mut s.wakers);
        self.cv.notify_all();
        drop(s);
        for w in wakers {
            w.wake();
        }
    }

    /// The poller that retires these queues has ended: every wait ends.
    pub(crate) fn end(&self) {
        self.lock().ended = true;
        self.ring();
    }

    /// Waiter steps 1–2.
    fn announce(&self) {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }

    /// Waiter step 5.
    fn withdraw(&self) {
        self.waiting.fetch_sub(1, Ordering::Relaxed);
    }

    /// A thread's wait (steps 1–5): until `look` says room or closed, the
    /// bell ends, or `deadline` passes (`None`: no deadline).
    pub(crate) fn wait(
        &self,
        look: impl Fn() -> Look,
        deadline: Option<Instant>,
    ) -> Result<(), WaitEnd> {
        self.announce();
        let mut s = self.lock();
        let end = loop {
            match look() {
                Look::Room => break Ok(()),
                Look::Closed => break Err(WaitEnd::Closed),
                Look::Full => {}
            }
            if s.ended {
                break Err(WaitEnd::Ended);
            }
            s = match deadline {
                None => self
                    .cv
                    .wait(s)
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        break Err(WaitEnd::TimedOut);
                    }
                    wait_timeout(&self.cv, s, d - now)
                }
            };
        };
        drop(s);
        self.withdraw();
        end
    }

    /// A future's poll (steps 1–4): `announced` is the future's own mark
    /// of step 1 (withdrawn by [`forget`](Self::forget) when it is done).
    pub(crate) fn poll(
        &self,
        look: impl Fn() -> Look,
        announced: &mut bool,
        waker: &Waker,
    ) -> std::task::Poll<Result<(), WaitEnd>> {
        use std::task::Poll;
        match look() {
            Look::Room => return Poll::Ready(Ok(())),
            Look::Closed => return Poll::Ready(Err(WaitEnd::Closed)),
            Look::Full => {}
        }
        if !*announced {
            self.announce();
            *announced = true;
        }
        let mut s = self.lock();
        match look() {
            Look::Room => return Poll::Ready(Ok(())),
            Look::Closed => return Poll::Ready(Err(WaitEnd::Closed)),
            Look::Full => {}
        }
        if s.ended {
            return Poll::Ready(Err(WaitEnd::Ended));
        }
        if !s.wakers.iter().any(|w| w.will_wake(waker)) {
            s.wakers.push(waker.clone());
        }
        Poll::Pending
    }

    /// A future's step 5.
    pub(crate) fn forget(&self, announced: &mut bool) {
        if std::mem::take(announced) {
            self.withdraw();
        }
    }
}

#[cfg(not(loom))]
fn wait_timeout<'a>(
    cv: &Condvar,
    s: MutexGuard<'a, BellState>,
    d: Duration,
) -> MutexGuard<'a, BellState> {
    cv.wait_timeout(s, d)
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .0
}

// loom's condition variable has no timed wait: a deadline is a plain wait
// there (the models give none).
#[cfg(loom)]
fn wait_timeout<'a>(
    cv: &Condvar,
    s: MutexGuard<'a, BellState>,
    _d: Duration,
) -> MutexGuard<'a, BellState> {
    cv.wait(s)
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Why a wait for room on a send queue ended without room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RoomError {
    /// More requests than the queue is deep: they never fit at once.
    #[error("QP {qp_num}'s send queue is {depth} deep: {wanted} requests never fit at once; post them in lists of at most {depth}")]
    TooMany {
        /// The QP.
        qp_num: u32,
        /// The queue's depth.
        depth: u32,
        /// The requests the wait was for.
        wanted: usize,
    },
    /// The deadline passed first.
    #[error("QP {qp_num}'s send queue had no room for {wanted} more requests after {waited:?}: about {outstanding} of its {depth} slots hold requests not yet completed (is its CQ being polled?)")]
    TimedOut {
        /// The QP.
        qp_num: u32,
        /// The queue's depth.
        depth: u32,
        /// Its requests not yet retired, about (no lock was taken).
        outstanding: u64,
        /// The requests the wait was for.
        wanted: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// The queue was closed (its QP destroyed): no completion will free
    /// room on it.
    #[error("QP {qp_num}'s send queue is closed: no completion will free room on it")]
    Closed {
        /// The QP.
        qp_num: u32,
    },
    /// The poller of the queue's CQ has ended: no completion will be
    /// polled to free room.
    #[error(
        "the poller of QP {qp_num}'s CQ has ended: no completion will free room on its send queue"
    )]
    Stopped {
        /// The QP.
        qp_num: u32,
    },
}

/// A future of room for `n` requests on a send queue
/// ([`QueueAccount::room`](super::QueueAccount::room)).
#[must_use = "a wait for room does nothing unless awaited"]
pub struct SendRoom<'a> {
    account: &'a super::QueueAccount,
    n: usize,
    announced: bool,
    start: Option<Instant>,
}

impl std::fmt::Debug for SendRoom<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SendRoom")
            .field("qp_num", &self.account.number())
            .field("n", &self.n)
            .finish()
    }
}

impl<'a> SendRoom<'a> {
    pub(super) fn new(account: &'a super::QueueAccount, n: usize) -> Self {
        SendRoom {
            account,
            n,
            announced: false,
            start: None,
        }
    }
}

impl std::future::Future for SendRoom<'_> {
    type Output = Result<(), RoomError>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        use std::task::Poll;
        let this = &mut *self;
        let account = this.account;
        let n = this.n;
        if let Err(e) = account.room_fits(n) {
            return Poll::Ready(Err(e));
        }
        let start = *this.start.get_or_insert_with(Instant::now);
        let bell = account.bell();
        match bell.poll(|| account.look_room(n), &mut this.announced, cx.waker()) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(end) => {
                bell.forget(&mut this.announced);
                Poll::Ready(end.map_err(|e| account.room_error(n, e, start.elapsed())))
            }
        }
    }
}

impl Drop for SendRoom<'_> {
    fn drop(&mut self) {
        self.account.bell().forget(&mut self.announced);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::account::{Queue, QueueAccount};
    use crate::completion::{Completion, Opcode};
    use crate::ledger::{AccountCache, WrLedger};
    use crate::wr_id::{HandlerKey, OpKind};
    use std::sync::Arc;

    fn id(tag: u32) -> u64 {
        HandlerKey::new(0, 0)
            .unwrap()
            .wr_id(OpKind::Send, tag)
            .unwrap()
    }

    /// A ledger with send queue 7, `depth` deep and full.
    pub(super) fn full(depth: u32) -> (WrLedger, Arc<QueueAccount>) {
        let ledger = WrLedger::new();
        let sq = ledger.open_queue(7, Queue::Send);
        sq.reserve(depth);
        let mut p = sq.posting();
        for tag in 0..depth {
            p.write(id(tag), Instant::now(), true);
        }
        p.publish();
        p.commit();
        (ledger, sq)
    }

    /// The poller's pass over the completions of the first `n` requests.
    pub(super) fn complete(ledger: &WrLedger, n: u32) {
        let wcs: Vec<_> = (0..n)
            .map(|tag| Completion::success(id(tag), Opcode::Send, 7))
            .collect();
        AccountCache::default().account_batch(ledger, &wcs, 0);
    }

    #[cfg(not(loom))]
    #[test]
    fn a_waiting_poster_is_woken_by_the_batch_that_frees_room() {
        let (ledger, sq) = full(4);
        assert_eq!(sq.look_room(1), Look::Full);
        let sq2 = Arc::clone(&sq);
        let waiter = std::thread::spawn(move || sq2.wait_room(2, Duration::from_secs(60)));
        // The waiter is asleep once it has announced itself.
        while sq.bell().waiting.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        complete(&ledger, 1);
        // One slot free: the waiter, woken, re-checks and sleeps again.
        assert_eq!(sq.look_room(2), Look::Full);
        complete(&ledger, 2);
        assert_eq!(waiter.join().unwrap(), Ok(()));
        assert_eq!(sq.bell().waiting.load(Ordering::Relaxed), 0);
    }

    #[cfg(not(loom))]
    #[test]
    fn a_wait_ends_with_its_reason() {
        let (ledger, sq) = full(2);
        assert_eq!(
            sq.wait_room(3, Duration::from_secs(60)),
            Err(RoomError::TooMany {
                qp_num: 7,
                depth: 2,
                wanted: 3
            })
        );
        match sq.wait_room(1, Duration::from_millis(20)) {
            Err(RoomError::TimedOut {
                qp_num: 7,
                depth: 2,
                outstanding: 2,
                wanted: 1,
                waited,
            }) => assert!(waited >= Duration::from_millis(20)),
            other => panic!("{other:?}"),
        }
        // A close wakes a waiting poster.
        let sq2 = Arc::clone(&sq);
        let waiter = std::thread::spawn(move || sq2.wait_room(1, Duration::from_secs(60)));
        while sq.bell().waiting.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        sq.close();
        assert_eq!(waiter.join().unwrap(), Err(RoomError::Closed { qp_num: 7 }));
        drop(ledger);
        // The poller's end wakes one too.
        let (ledger, sq) = full(2);
        let sq2 = Arc::clone(&sq);
        let waiter = std::thread::spawn(move || sq2.wait_room(1, Duration::from_secs(60)));
        while sq.bell().waiting.load(Ordering::Relaxed) == 0 {
            std::thread::yield_now();
        }
        ledger.room_bell().end();
        assert_eq!(
            waiter.join().unwrap(),
            Err(RoomError::Stopped { qp_num: 7 })
        );
    }

    #[cfg(not(loom))]
    #[test]
    fn a_future_of_room_is_woken_and_withdraws_when_dropped() {
        use std::future::Future;
        use std::task::{Context, Poll, Wake};
        struct Count(std::sync::atomic::AtomicUsize);
        impl Wake for Count {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
        }
        let (ledger, sq) = full(2);
        let count = std::sync::Arc::new(Count(Default::default()));
        let waker = Waker::from(std::sync::Arc::clone(&count));
        let mut cx = Context::from_waker(&waker);
        let mut room = sq.room(1);
        assert!(std::pin::Pin::new(&mut room).poll(&mut cx).is_pending());
        assert!(std::pin::Pin::new(&mut room).poll(&mut cx).is_pending());
        assert_eq!(sq.bell().lock().wakers.len(), 1, "one waker per task");
        complete(&ledger, 1);
        assert_eq!(count.0.load(Ordering::Relaxed), 1);
        assert_eq!(
            std::pin::Pin::new(&mut room).poll(&mut cx),
            Poll::Ready(Ok(()))
        );
        assert_eq!(sq.bell().waiting.load(Ordering::Relaxed), 0);
        // A dropped wait withdraws its announcement.
        let mut p = sq.posting();
        p.write(id(9), Instant::now(), true);
        p.publish();
        p.commit();
        let mut room = sq.room(1);
        assert!(std::pin::Pin::new(&mut room).poll(&mut cx).is_pending());
        assert_eq!(sq.bell().waiting.load(Ordering::Relaxed), 1);
        drop(room);
        assert_eq!(sq.bell().waiting.load(Ordering::Relaxed), 0);
    }
}

/// The protocol under loom: a poster on a full queue one request deep
/// waits for room while the poller's pass retires the request. Whatever
/// the interleaving, the waiter wakes with room; without the poller's
/// fence, loom finds the execution where it sleeps for good.
#[cfg(all(test, loom))]
mod loom_room {
    use super::tests::{complete, full};
    use super::*;

    fn model(no_fence: bool) {
        loom::model(move || {
            let (ledger, sq) = full(1);
            let poller = loom::thread::spawn(move || {
                NO_POLLER_FENCE.with(|m| m.set(no_fence));
                complete(&ledger, 1);
            });
            let end = sq.bell().wait(|| sq.look_room(1), None);
            assert_eq!(end, Ok(()), "the waiter wakes with room");
            poller.join().unwrap();
        });
    }

    #[test]
    fn loom_room_wakes_the_waiter() {
        model(false);
    }

    #[test]
    #[should_panic(expected = "deadlock")]
    fn loom_room_mutation_no_poller_fence() {
        model(true);
    }
}
