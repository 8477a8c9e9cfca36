//! Completion futures: post a request, `.await` its completion.
//!
//! [`CqHandle::register_futures`] registers a handler whose requests are
//! futures: [`Ops::post_send`] and [`Ops::post_recv`] post one request
//! (a SEND, an RDMA WRITE or READ, an atomic: whatever the work request
//! says; a receive) and return an [`Op`], a future of its outcome. The
//! request holds a value of the caller's type `B` (the buffer it names,
//! a pooled region, a guard) from the post until the device is done with
//! it, and the future hands it back with the outcome: `(Result<Done,
//! OpError>, B)`.
//!
//! - **Cancel-safe.** Dropping an `Op` before its completion never frees
//!   the held value early: the value stays with the request until the
//!   completion or the flush retires it, and is dropped then (on the
//!   thread that retired it). The completion is counted in the handler's
//!   ledger as any other and never reaches another request.
//! - **Lock-free and allocation-free.** The waking thread (the poller, a
//!   tokio driver) and the awaiting task share one state word and a waker
//!   cell per request, in a table made at registration; nothing allocates
//!   per operation.
//! - **Lists.** [`Ops::post_send_list`] and [`Ops::post_recv_list`] post
//!   `N` requests in one posting call, a future each.
//! - **Driven by either.** The futures are woken by whatever drives the
//!   CQ: a poller thread or a `TokioDriver` (feature `tokio`).
//! - **Bounded, in order.** At most `capacity` requests are outstanding
//!   or unresolved; [`Ops::send`] and [`Ops::recv`] wait for room, in the
//!   order they began to wait, where [`Ops::post_send`] and
//!   [`Ops::post_recv`] are refused.
//! - **Accounted.** A request outstanding when its handler is dropped (the
//!   poller stopped without a flush) resolves with
//!   [`OpError::Abandoned`] and its held value; the stop's report counts
//!   it missing.
//!
//! **The state protocol** (the SAFETY comments and the loom models
//! `future::loom_op` cite these numbers):
//!
//! 1. **Reserve.** A poster pops a free state slot (a Treiber stack whose
//!    top carries a counter against ABA). Its state word is 0.
//! 2. **Post.** The held value and the slot's index travel as the
//!    request's context (the context table's protocol, docs/posting.md
//!    C1–C5); a refused post hands the value back and pushes the slot.
//! 3. **Complete.** The callback that receives the context (on the
//!    poller's thread) writes the outcome and the value into the slot —
//!    it alone writes there: the word has no `DONE` — then sets `DONE`
//!    (AcqRel). If `GONE` was already set, the future is gone: it moves
//!    the outcome back out, drops it and frees the slot (6). Otherwise it
//!    wakes the registered waker (4) and then sets `WOKEN` (AcqRel); if
//!    `GONE` was set by then, it frees the slot.
//! 4. **The waker cell** follows the atomic-waker protocol: the future
//!    registers under a `REGISTERING` bit, the waker takes the waker under
//!    a `WAKING` bit; a registration that meets a wake in progress wakes
//!    its own task, and a wake that meets a registration leaves it to the
//!    registration to wake.
//! 5. **Resolve or drop.** The future, polled, sees `DONE` (Acquire),
//!    moves the outcome out and sets `GONE`; otherwise it registers its
//!    waker and looks again. Dropped unresolved, it sets `GONE`: if `DONE`
//!    was set it moves the outcome out and drops it. Either way, if
//!    `WOKEN` was already set, it frees the slot.
//! 6. **Free.** Exactly one side frees a slot: the one that sets the last
//!    of `GONE` and `WOKEN`, or the completing side when `GONE` came
//!    first. It owns the slot then: it clears the waker cell and the word
//!    and pushes the index (Release).
//! 7. **Waiting for room.** The stack's word carries a `WAIT` bit beside
//!    its top. With every slot taken, [`Ops::reserve`] (and [`Ops::send`]
//!    / [`Ops::recv`], which use it) takes the queue's lock and, in one
//!    compare-and-swap on the word, either pops a slot that came free or
//!    sets `WAIT`; then it queues. A push reads `WAIT` in the
//!    compare-and-swap that pushes (AcqRel): if set, the pusher *tries*
//!    the lock — it never waits for it, so the poller that frees a slot
//!    never blocks — and hands free slots to the oldest waits that have
//!    none, waking them, and clears `WAIT` once none is left unserved.
//!    Both sides meet on one word, so either the push sees `WAIT` or the
//!    wait sees the pushed slot: no wait sleeps beside a free slot.
//! 8. **A hand-on owed.** Outside the lock, `WAIT` beside a non-empty
//!    stack means slots are owed to waits. Every holder of the lock,
//!    having released it, reads the word with a read-modify-write
//!    (AcqRel) and, while a hand-on is owed, tries the lock again and
//!    serves. A pusher whose try found the lock held leaves the hand-on
//!    to that holder: either the holder's read-modify-write comes after
//!    the push in the word's order (it sees the owed slot), or before it
//!    (then the release happens before the pusher's try, which found a
//!    later holder, who looks in turn). The lock is taken only while a
//!    reservation waits. A post while `WAIT` is set does not overtake the
//!    waits (it is refused, or waits in turn); a dropped wait leaves the
//!    queue and hands on a slot it was given.

use std::cell::UnsafeCell;
use std::fmt;
use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crossbeam_utils::CachePadded;

use crate::completion::{Completion, Opcode, Status, WcFlags};
use crate::context::ContextHandler;
use crate::cq::{ContextRegistration, CqHandle};
use crate::handler::{Failed, Outbox, RecvDone, SendDone, Silent};
use crate::post::{PostRecv, PostSend, Refused};
use crate::slab::RegisterError;
use crate::sync::{Arc, AtomicU32, AtomicU64, AtomicU8, Ordering};
use crate::wr_id::{HandlerKey, OpKind};

/// A request's completion, as its future resolves with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    kind: OpKind,
    wc: Option<Completion>,
}

impl Done {
    /// The kind posted.
    pub fn kind(&self) -> OpKind {
        self.kind
    }
    /// The completion, or `None` for an unsignaled send that a later
    /// completion of its queue retired (it had none of its own).
    pub fn completion(&self) -> Option<&Completion> {
        self.wc.as_ref()
    }
    /// True for an unsignaled send retired by a later completion.
    pub fn is_silent(&self) -> bool {
        self.wc.is_none()
    }
    /// Bytes transferred (receives, RDMA READ, atomics); 0 when silent.
    pub fn byte_len(&self) -> u32 {
        self.wc.map_or(0, |w| w.byte_len)
    }
    /// The immediate data of a receive that carried it (host order).
    pub fn imm(&self) -> Option<u32> {
        self.wc
            .filter(|w| w.wc_flags.contains(WcFlags::WITH_IMM))
            .map(|w| u32::from_be(w.imm_data))
    }
    /// The device's opcode (`None` when silent).
    pub fn opcode(&self) -> Option<Opcode> {
        self.wc.map(|w| w.opcode)
    }
    /// The local QP number (0 when silent).
    pub fn qp_num(&self) -> u32 {
        self.wc.map_or(0, |w| w.qp_num)
    }
    /// The sender's QP number (UD receives).
    pub fn src_qp(&self) -> u32 {
        self.wc.map_or(0, |w| w.src_qp)
    }
}

/// Why a request's future resolved without success.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpError {
    /// The device completed it with an error status, flushes included
    /// ([`Status::is_flush`]), or reported what cqd does not know.
    Status {
        /// The kind posted.
        kind: OpKind,
        /// The completion.
        wc: Completion,
    },
    /// Its handler was dropped (the poller stopped) while it was still
    /// outstanding: it never completed and was never flushed, so the
    /// device may still hold what it names. The stop's report counts it
    /// missing.
    Abandoned,
}

impl OpError {
    /// The error status, if the device gave one.
    pub fn status(&self) -> Option<Status> {
        match self {
            OpError::Status { wc, .. } => Some(wc.status),
            OpError::Abandoned => None,
        }
    }
    /// True for a flush (the QP went to the error state; never executed).
    pub fn is_flush(&self) -> bool {
        matches!(self, OpError::Status { wc, .. } if wc.status.is_flush())
    }
}

impl fmt::Display for OpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OpError::Status { kind, wc } => write!(
                f,
                "{kind:?} on QP {} completed with {:?} (vendor error {:#x})",
                wc.qp_num, wc.status, wc.vendor_err
            ),
            OpError::Abandoned => {
                write!(
                    f,
                    "abandoned: the poller stopped with the request outstanding"
                )
            }
        }
    }
}

impl std::error::Error for OpError {}

/// What an [`Op`] resolves with: the outcome, and the value the request
/// held.
pub type OpOutput<B> = (Result<Done, OpError>, B);

/// A post refused: why, and the value it would have held, handed back.
pub struct OpRefused<E, B> {
    /// Why (the posting call's error; [`Refused::Contexts`] when every
    /// state slot is taken).
    pub error: E,
    /// The value the request would have held.
    pub hold: B,
}

impl<E: fmt::Debug, B> fmt::Debug for OpRefused<E, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpRefused")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<E: fmt::Display, B> fmt::Display for OpRefused<E, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not posted: {}", self.error)
    }
}

impl<E: std::error::Error + 'static, B> std::error::Error for OpRefused<E, B> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A list post refused, in part or whole: why, the futures of the requests
/// that were posted, and the values of those that were not.
pub struct OpListRefused<E, B, const N: usize> {
    /// Why.
    pub error: E,
    /// `Some` for each request posted (verbs: before `bad_wr`): its future.
    pub posted: [Option<Op<B>>; N],
    /// `Some` for each request not posted: the value it would have held.
    pub back: [Option<B>; N],
}

impl<E: fmt::Debug, B, const N: usize> fmt::Debug for OpListRefused<E, B, N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let posted: Vec<bool> = self.posted.iter().map(Option::is_some).collect();
        f.debug_struct("OpListRefused")
            .field("error", &self.error)
            .field("posted", &posted)
            .finish_non_exhaustive()
    }
}

impl<E: fmt::Display, B, const N: usize> fmt::Display for OpListRefused<E, B, N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.back.iter().filter(|b| b.is_some()).count();
        write!(f, "{} ({n} of {N} requests not posted)", self.error)
    }
}

impl<E: std::error::Error + 'static, B, const N: usize> std::error::Error
    for OpListRefused<E, B, N>
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// The state word's bits (steps 3, 5).
const DONE: u32 = 1;
const WOKEN: u32 = 2;
const GONE: u32 = 4;
/// The waker cell's bits (step 4).
const REGISTERING: u8 = 1;
const WAKING: u8 = 2;
/// A free list's end.
const NONE: u32 = u32::MAX;
/// The stack's word: the top index in the low 32 bits, this bit when
/// reservations wait for a slot (step 7), a counter against ABA above.
const WAIT: u64 = 1 << 32;

/// The stack word's counter, moved on (the index and `WAIT` bits cleared).
fn bump(top: u64) -> u64 {
    ((top >> 33).wrapping_add(1)) << 33
}

struct Slot<B> {
    state: AtomicU32,
    /// The next free slot while this one is free (step 1).
    next: AtomicU32,
    cell: AtomicU8,
    waker: UnsafeCell<Option<Waker>>,
    out: UnsafeCell<MaybeUninit<OpOutput<B>>>,
}

/// The state slots of one registration's futures.
pub(crate) struct States<B> {
    slots: Box<[Slot<B>]>,
    /// On a line of its own: its neighbours in the heap may be the
    /// poller's (the posters pop here every request).
    top: CachePadded<AtomicU64>,
    /// The queue itself, locked only while a reservation waits (step 7).
    queue: crate::sync::Mutex<WaitQueue>,
}

/// Reservations waiting for a slot, in arrival order (step 7).
#[derive(Default)]
struct WaitQueue {
    entries: std::collections::VecDeque<Waiter>,
    next_id: u64,
}

struct Waiter {
    id: u64,
    waker: Option<Waker>,
    /// The slot handed to it, once one is.
    given: Option<u32>,
}

/// The queue's lock, held by a reservation's poll or drop; released, it
/// looks for a hand-on owed (step 8).
struct Queue<'a, B> {
    states: &'a States<B>,
    guard: Option<crate::sync::MutexGuard<'a, WaitQueue>>,
}

impl<B> std::ops::Deref for Queue<'_, B> {
    type Target = WaitQueue;
    fn deref(&self) -> &WaitQueue {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl<B> std::ops::DerefMut for Queue<'_, B> {
    fn deref_mut(&mut self) -> &mut WaitQueue {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl<B> Drop for Queue<'_, B> {
    fn drop(&mut self) {
        drop(self.guard.take());
        self.states.settle();
    }
}

// SAFETY: a slot's `out` is written only by the completing side before
// `DONE` and read only by the side that saw `DONE` (steps 3, 5), its
// `waker` only under the cell's bits (step 4), and a free slot only by
// the side that owns it (steps 1, 6); values are `Send`.
unsafe impl<B: Send> Sync for States<B> {}
// SAFETY: as above.
unsafe impl<B: Send> Send for States<B> {}

impl<B> States<B> {
    pub(crate) fn new(capacity: u32) -> Self {
        let slots: Box<[Slot<B>]> = (0..capacity)
            .map(|i| Slot {
                state: AtomicU32::new(0),
                next: AtomicU32::new(if i + 1 < capacity { i + 1 } else { NONE }),
                cell: AtomicU8::new(0),
                waker: UnsafeCell::new(None),
                out: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        States {
            slots,
            top: CachePadded::new(AtomicU64::new(if capacity == 0 {
                u64::from(NONE)
            } else {
                0
            })),
            queue: crate::sync::Mutex::new(WaitQueue::default()),
        }
    }

    fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Step 1: a free slot, if any (whether or not reservations wait).
    #[cfg(test)]
    fn reserve(&self) -> Option<u32> {
        self.pop(false)
    }

    /// Step 1 without overtaking: none while reservations are queued
    /// (step 7).
    fn try_reserve(&self) -> Option<u32> {
        self.pop(true)
    }

    /// Pops a free slot; none if the stack is empty, or if `polite` and
    /// the stack's word says reservations wait (step 7).
    fn pop(&self, polite: bool) -> Option<u32> {
        let mut top = self.top.load(Ordering::Acquire);
        loop {
            let index = top as u32;
            if index == NONE || (polite && top & WAIT != 0) {
                return None;
            }
            let next = self.slots[index as usize].next.load(Ordering::Relaxed);
            let new = bump(top) | (top & WAIT) | u64::from(next);
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(index),
                Err(now) => top = now,
            }
        }
    }

    /// Step 6: the caller owns slot `index` (no side will touch it again):
    /// clear it and push it.
    fn free(&self, index: u32) {
        let slot = &self.slots[index as usize];
        // SAFETY: step 6: the freeing side owns the slot, its waker cell
        // included (the waking side set WOKEN after its last touch, or
        // never woke: GONE came first).
        drop(unsafe { (*slot.waker.get()).take() });
        slot.cell.store(0, Ordering::Relaxed);
        slot.state.store(0, Ordering::Relaxed);
        self.give_up(index);
    }

    /// A slot back on the stack; if the stack's word says reservations
    /// wait, they are handed what is free (steps 7, 8) — without waiting
    /// for the queue's lock.
    fn give_up(&self, index: u32) {
        if self.push(index) {
            self.settle();
        }
    }

    /// Pushes a free slot; true if reservations wait (the word's `WAIT`,
    /// read by the same compare-and-swap that pushed).
    fn push(&self, index: u32) -> bool {
        let slot = &self.slots[index as usize];
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            slot.next.store(top as u32, Ordering::Relaxed);
            let new = bump(top) | (top & WAIT) | u64::from(index);
            // AcqRel: the acquiring half orders this push after a lock
            // holder's release when the holder's look came first (step 8).
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return top & WAIT != 0,
                Err(now) => top = now,
            }
        }
    }

    /// Step 7, under the queue's lock: a slot popped from the stack, or,
    /// the stack empty, `WAIT` set in its word by the same
    /// compare-and-swap that found it empty (a later push sees it).
    fn wait_or_pop(&self) -> Option<u32> {
        let mut top = self.top.load(Ordering::Acquire);
        loop {
            let index = top as u32;
            let (new, got) = if index == NONE {
                (bump(top) | WAIT | u64::from(NONE), None)
            } else {
                let next = self.slots[index as usize].next.load(Ordering::Relaxed);
                (bump(top) | (top & WAIT) | u64::from(next), Some(index))
            };
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return got,
                Err(now) => top = now,
            }
        }
    }

    /// Step 7, under the queue's lock: clears `WAIT` (no reservation is
    /// left without a slot).
    fn clear_wait(&self) {
        let mut top = self.top.load(Ordering::Acquire);
        while top & WAIT != 0 {
            match self.top.compare_exchange_weak(
                top,
                bump(top) | (top & (u64::from(u32::MAX))),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(now) => top = now,
            }
        }
    }

    /// Step 7, under the queue's lock: free slots to the queued
    /// reservations, oldest first; `WAIT` cleared once none is left
    /// without one.
    #[cold]
    fn serve(&self, q: &mut WaitQueue) {
        let mut unserved = false;
        for w in q.entries.iter_mut().filter(|w| w.given.is_none()) {
            let Some(index) = self.wait_or_pop() else {
                unserved = true;
                break;
            };
            w.given = Some(index);
            if let Some(waker) = w.waker.take() {
                waker.wake();
            }
        }
        if !unserved {
            self.clear_wait();
        }
    }

    /// Step 8: true if slots are owed to waits (`WAIT` beside a free
    /// slot), read with a read-modify-write so that it is ordered against
    /// every push.
    fn owed(&self) -> bool {
        let top = self.top.fetch_add(0, Ordering::AcqRel);
        top & WAIT != 0 && top as u32 != NONE
    }

    /// Step 8: while a hand-on is owed, serve it if the lock is free;
    /// if it is held, its holder looks after releasing it. Never waits.
    #[cold]
    fn settle(&self) {
        while self.owed() {
            let mut q = match self.queue.try_lock() {
                Ok(q) => q,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return,
            };
            self.serve(&mut q);
        }
    }

    /// Step 7, a reservation's side: the queue's lock (a waiting task may
    /// wait for it; the poller never takes it this way). Its release looks
    /// for a hand-on owed (step 8).
    fn lock_queue(&self) -> Queue<'_, B> {
        Queue {
            states: self,
            guard: Some(self.queue.lock().unwrap_or_else(|p| p.into_inner())),
        }
    }

    /// Step 7, a reservation's poll: a slot, or a place in the queue.
    fn poll_reserve(&self, queued: &mut Option<u64>, cx: &mut Context<'_>) -> Poll<u32> {
        if queued.is_none() {
            if let Some(index) = self.try_reserve() {
                return Poll::Ready(index);
            }
        }
        let mut q = self.lock_queue();
        if let Some(id) = *queued {
            let Some(at) = q.entries.iter().position(|w| w.id == id) else {
                unreachable!("a queued reservation leaves the queue only by its own poll or drop")
            };
            if let Some(index) = q.entries[at].given {
                q.entries.remove(at);
                *queued = None;
                return Poll::Ready(index);
            }
            match &mut q.entries[at].waker {
                Some(w) if w.will_wake(cx.waker()) => {}
                w => *w = Some(cx.waker().clone()),
            }
            return Poll::Pending;
        }
        // Behind others still unserved: wait in turn (WAIT is set).
        if q.entries.iter().all(|w| w.given.is_some()) {
            // Nobody unserved: take a free slot, or set WAIT in the same
            // compare-and-swap that finds none — a later push then sees it.
            if let Some(index) = self.wait_or_pop() {
                return Poll::Ready(index);
            }
        }
        let id = q.next_id;
        q.next_id += 1;
        q.entries.push_back(Waiter {
            id,
            waker: Some(cx.waker().clone()),
            given: None,
        });
        *queued = Some(id);
        Poll::Pending
    }

    /// Step 7, a queued reservation dropped: leaves the queue, and a slot
    /// it was handed goes to the next.
    fn cancel_reserve(&self, id: u64) {
        let given = {
            let mut q = self.lock_queue();
            let Some(at) = q.entries.iter().position(|w| w.id == id) else {
                return;
            };
            let w = q.entries.remove(at);
            if q.entries.iter().all(|w| w.given.is_some()) {
                self.clear_wait();
            }
            w.and_then(|w| w.given)
        };
        if let Some(index) = given {
            self.give_up(index);
        }
    }

    /// Step 3, by the side that received the request's context.
    fn complete(&self, index: u32, output: OpOutput<B>) {
        let Some(slot) = self.slots.get(index as usize) else {
            return;
        };
        // SAFETY: step 3: the slot is reserved and its word has no DONE, so
        // no other side reads or writes `out` now.
        unsafe { (*slot.out.get()).write(output) };
        let prev = slot.state.fetch_or(DONE, Ordering::AcqRel);
        if prev & GONE != 0 {
            // SAFETY: the future is gone (it never reads `out` again) and
            // the write above is this thread's.
            drop(unsafe { (*slot.out.get()).assume_init_read() });
            self.free(index);
            return;
        }
        if let Some(waker) = self.take_waker(slot) {
            waker.wake();
        }
        let prev = slot.state.fetch_or(WOKEN, Ordering::AcqRel);
        if prev & GONE != 0 {
            self.free(index);
        }
    }

    /// Step 4, the waking side: the registered waker, unless a
    /// registration is in progress (it will see DONE and not sleep).
    fn take_waker(&self, slot: &Slot<B>) -> Option<Waker> {
        if slot.cell.fetch_or(WAKING, Ordering::AcqRel) != 0 {
            return None;
        }
        // SAFETY: step 4: WAKING set over a clear cell: no registration
        // touches the waker until the bit is cleared.
        let waker = unsafe { (*slot.waker.get()).take() };
        slot.cell.fetch_and(!WAKING, Ordering::Release);
        waker
    }

    /// Step 4, the future's side: registers `waker` for slot `index`.
    fn register(&self, slot: &Slot<B>, waker: &Waker) {
        match slot
            .cell
            .compare_exchange(0, REGISTERING, Ordering::Acquire, Ordering::Acquire)
        {
            Ok(_) => {
                // SAFETY: step 4: REGISTERING set over a clear cell: the
                // waking side does not touch the waker until it is cleared.
                let cell = unsafe { &mut *slot.waker.get() };
                match cell {
                    Some(w) if w.will_wake(waker) => {}
                    _ => *cell = Some(waker.clone()),
                }
                if slot
                    .cell
                    .compare_exchange(REGISTERING, 0, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    // A wake came while registering: it left the waker to
                    // us. Take it and wake.
                    // SAFETY: the cell still has REGISTERING: ours.
                    let w = unsafe { (*slot.waker.get()).take() };
                    slot.cell.swap(0, Ordering::AcqRel);
                    if let Some(w) = w {
                        w.wake();
                    }
                }
            }
            // A wake in progress: wake ourselves rather than sleep on it.
            Err(_) => waker.wake_by_ref(),
        }
    }

    /// Step 5 for a future at `index`: its output, if done.
    fn poll_slot(&self, index: u32, cx: &mut Context<'_>) -> Poll<OpOutput<B>> {
        let slot = &self.slots[index as usize];
        if slot.state.load(Ordering::Acquire) & DONE == 0 {
            self.register(slot, cx.waker());
            if slot.state.load(Ordering::Acquire) & DONE == 0 {
                return Poll::Pending;
            }
        }
        Poll::Ready(self.resolve(index))
    }

    /// Step 5: the output of a slot whose word has DONE; the future is
    /// gone after this.
    fn resolve(&self, index: u32) -> OpOutput<B> {
        let slot = &self.slots[index as usize];
        // SAFETY: DONE was seen (Acquire) after the completing side's write,
        // and GONE is not set yet: nobody else reads `out`.
        let output = unsafe { (*slot.out.get()).assume_init_read() };
        if slot.state.fetch_or(GONE, Ordering::AcqRel) & WOKEN != 0 {
            self.free(index);
        }
        output
    }

    /// Step 5 for a future dropped unresolved.
    fn abandon_future(&self, index: u32) {
        let slot = &self.slots[index as usize];
        let prev = slot.state.fetch_or(GONE, Ordering::AcqRel);
        if prev & DONE != 0 {
            // SAFETY: DONE was seen (AcqRel) and this is the future's only
            // read: the output is ours to drop.
            drop(unsafe { (*slot.out.get()).assume_init_read() });
            if prev & WOKEN != 0 {
                self.free(index);
            }
        }
    }
}

impl<B> Drop for States<B> {
    fn drop(&mut self) {
        // The last owner: every future and the handler are gone. An output
        // still in a slot (DONE and never read: impossible once every
        // future is gone, but cheap to be sure of) is dropped.
        for slot in self.slots.iter() {
            let s = slot.state.load(Ordering::Acquire);
            if s & DONE != 0 && s & GONE == 0 {
                // SAFETY: as in `resolve`, and nobody else is left.
                drop(unsafe { (*slot.out.get()).assume_init_read() });
            }
        }
    }
}

/// A request's context: its state slot and what it holds (step 2).
pub(crate) struct Ticket<B> {
    index: u32,
    hold: B,
}

/// The handler behind [`Ops`]: each context goes to its state slot.
struct Resolver<B> {
    states: Arc<States<B>>,
}

impl<B: Send + 'static, W> ContextHandler<W> for Resolver<B> {
    type Ctx = Ticket<B>;

    fn on_send(&mut self, done: &SendDone<'_>, t: Ticket<B>, _: &mut Outbox<'_, W>) {
        let d = Done {
            kind: done.kind(),
            wc: Some(*done.completion()),
        };
        self.states.complete(t.index, (Ok(d), t.hold));
    }
    fn on_recv(&mut self, done: &RecvDone<'_>, t: Ticket<B>, _: &mut Outbox<'_, W>) {
        let d = Done {
            kind: OpKind::Recv,
            wc: Some(*done.completion()),
        };
        self.states.complete(t.index, (Ok(d), t.hold));
    }
    fn on_error(&mut self, failed: &Failed<'_>, t: Ticket<B>, _: &mut Outbox<'_, W>) {
        let e = OpError::Status {
            kind: failed.kind(),
            wc: *failed.completion(),
        };
        self.states.complete(t.index, (Err(e), t.hold));
    }
    fn on_silent(&mut self, silent: &Silent, t: Ticket<B>, _: &mut Outbox<'_, W>) {
        let d = Done {
            kind: silent.kind(),
            wc: None,
        };
        self.states.complete(t.index, (Ok(d), t.hold));
    }
    fn on_abandoned(&mut self, t: Ticket<B>) {
        self.states
            .complete(t.index, (Err(OpError::Abandoned), t.hold));
    }
}

/// A registration whose requests are futures (see the module
/// documentation). Cloneable, `Send` and `Sync`: post from any task.
pub struct Ops<B> {
    reg: ContextRegistration<Ticket<B>>,
    states: Arc<States<B>>,
}

impl<B> Clone for Ops<B> {
    fn clone(&self) -> Self {
        Ops {
            reg: self.reg.clone(),
            states: Arc::clone(&self.states),
        }
    }
}

impl<B> fmt::Debug for Ops<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ops")
            .field("key", &self.reg.reg.key())
            .field("capacity", &self.states.capacity())
            .finish()
    }
}

impl<W: Send + 'static> CqHandle<W> {
    /// Registers a handler whose requests are futures ([`Ops`]): at most
    /// `capacity` of them outstanding or unresolved at a time (a future
    /// keeps its slot until it resolves or is dropped, and its request
    /// until the device is done with it).
    ///
    /// # Errors
    /// As [`register_with_contexts`](Self::register_with_contexts).
    pub fn register_futures<B: Send + 'static>(
        &self,
        capacity: u32,
    ) -> Result<Ops<B>, RegisterError> {
        let states = Arc::new(States::new(capacity));
        let resolver = Resolver {
            states: Arc::clone(&states),
        };
        let reg = self.register_with_contexts(resolver, capacity)?;
        Ok(Ops { reg, states })
    }
}

impl<B: Send + 'static> Ops<B> {
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.reg.key()
    }

    /// The handler's ledger (posted, completed, flushed per kind).
    pub fn ledger(&self) -> &crate::slab::SlotLedger {
        self.reg.ledger()
    }

    /// The most requests outstanding or unresolved at a time.
    pub fn capacity(&self) -> u32 {
        self.states.capacity()
    }

    /// Posts `wr` on `qp`'s send queue through the posting call (its
    /// wr_id field is set by the call), holding `hold` until the device is
    /// done with the request; the [`Op`] resolves with the outcome and
    /// `hold`.
    ///
    /// # Errors
    /// The posting call's errors, and [`Refused::Contexts`] when
    /// `capacity` futures are outstanding or unresolved (or others wait
    /// for room: [`send`](Self::send) waits in turn); `hold` comes back in
    /// the error.
    pub fn post_send<Q: PostSend + ?Sized>(
        &self,
        qp: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<Op<B>, OpRefused<Q::Error, B>> {
        let Some(index) = self.states.try_reserve() else {
            return Err(self.full(hold));
        };
        self.send_at(index, qp, wr, hold)
    }

    /// Posts a list of requests on `qp`'s send queue in one posting call
    /// (one doorbell), request `i` holding `holds[i]`: a future per
    /// request. All or nothing on the table: with fewer than `N` slots
    /// free (or waits queued), none is posted.
    ///
    /// # Errors
    /// [`OpListRefused`]: the posting call's error, the futures of the
    /// requests it did post (verbs' `bad_wr`: those before it) and the
    /// values of the others.
    pub fn post_send_list<Q: PostSend + ?Sized, const N: usize>(
        &self,
        qp: &Q,
        mut wrs: [Q::Wr<'_>; N],
        holds: [B; N],
    ) -> Result<[Op<B>; N], OpListRefused<Q::Error, B, N>> {
        let (indices, tickets) = self.reserve_list(holds)?;
        let result = self.reg.post_send(qp, &mut wrs, tickets);
        self.settle_list(indices, result)
    }

    /// As [`post_send_list`](Self::post_send_list), on a receive queue.
    ///
    /// # Errors
    /// As [`post_send_list`](Self::post_send_list).
    pub fn post_recv_list<Q: PostRecv + ?Sized, const N: usize>(
        &self,
        queue: &Q,
        mut wrs: [Q::Wr<'_>; N],
        holds: [B; N],
    ) -> Result<[Op<B>; N], OpListRefused<Q::Error, B, N>> {
        let (indices, tickets) = self.reserve_list(holds)?;
        let result = self.reg.post_recv(queue, &mut wrs, tickets);
        self.settle_list(indices, result)
    }

    /// Step 1 for a list: `N` slots, or none.
    #[allow(clippy::type_complexity)]
    fn reserve_list<E: From<Refused>, const N: usize>(
        &self,
        holds: [B; N],
    ) -> Result<([u32; N], [Ticket<B>; N]), OpListRefused<E, B, N>> {
        let mut indices = [NONE; N];
        for i in 0..N {
            match self.states.try_reserve() {
                Some(index) => indices[i] = index,
                None => {
                    for &index in &indices[..i] {
                        self.states.give_up(index);
                    }
                    let refused: OpRefused<E, ()> = self.full(());
                    return Err(OpListRefused {
                        error: refused.error,
                        posted: [const { None }; N],
                        back: holds.map(Some),
                    });
                }
            }
        }
        let mut holds = holds.into_iter();
        let tickets = indices.map(|index| Ticket {
            index,
            hold: holds.next().expect("N values for N slots"),
        });
        Ok((indices, tickets))
    }

    /// Step 2's end for a list.
    fn settle_list<E, const N: usize>(
        &self,
        indices: [u32; N],
        result: Result<(), crate::cq::PostRefused<E, Ticket<B>, N>>,
    ) -> Result<[Op<B>; N], OpListRefused<E, B, N>> {
        let op = |index| Op {
            states: Arc::clone(&self.states),
            index,
            resolved: false,
        };
        match result {
            Ok(()) => Ok(indices.map(op)),
            Err(refused) => {
                let mut posted: [Option<Op<B>>; N] = [const { None }; N];
                let mut back: [Option<B>; N] = [const { None }; N];
                for (i, t) in refused.back.into_iter().enumerate() {
                    match t {
                        Some(t) => {
                            self.states.give_up(indices[i]);
                            back[i] = Some(t.hold);
                        }
                        None => posted[i] = Some(op(indices[i])),
                    }
                }
                Err(OpListRefused {
                    error: refused.error,
                    posted,
                    back,
                })
            }
        }
    }

    /// Waits for room (a state slot, in the order the waits began; then a
    /// slot on the send queue, [`PostSend::send_room`]), then posts as
    /// [`post_send`](Self::post_send) and awaits the outcome.
    ///
    /// # Errors
    /// The posting call's errors, with `hold` back; the outcome's own
    /// error is in the `Ok` output. [`Refused::Full`] only when another
    /// poster of the same QP took the slot between the wait and the post.
    pub async fn send<Q: PostSend + ?Sized>(
        &self,
        qp: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<OpOutput<B>, OpRefused<Q::Error, B>> {
        let room = self.reserve().await;
        // A wait that ends without room (the queue closed, its poller
        // ended) leaves the post to say why.
        let _ = qp.send_room(1).await;
        Ok(room.post_send(qp, wr, hold)?.await)
    }

    /// As [`send`](Self::send), on a receive queue.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub async fn recv<Q: PostRecv + ?Sized>(
        &self,
        queue: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<OpOutput<B>, OpRefused<Q::Error, B>> {
        let room = self.reserve().await;
        Ok(room.post_recv(queue, wr, hold)?.await)
    }

    /// A future of room for one request: a state slot, taken in the order
    /// the waits began (step 7). Post through the [`Reserved`] it resolves
    /// with; dropped, it gives the slot to the next.
    pub fn reserve(&self) -> Reserve<'_, B> {
        Reserve {
            ops: self,
            queued: None,
        }
    }

    fn send_at<Q: PostSend + ?Sized>(
        &self,
        index: u32,
        qp: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<Op<B>, OpRefused<Q::Error, B>> {
        let ticket = Ticket { index, hold };
        self.settle(index, self.reg.post_send(qp, &mut [wr], [ticket]))
    }

    fn recv_at<Q: PostRecv + ?Sized>(
        &self,
        index: u32,
        queue: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<Op<B>, OpRefused<Q::Error, B>> {
        let ticket = Ticket { index, hold };
        self.settle(index, self.reg.post_recv(queue, &mut [wr], [ticket]))
    }

    /// As [`post_send`](Self::post_send), on a receive queue (a QP's or an
    /// SRQ).
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn post_recv<Q: PostRecv + ?Sized>(
        &self,
        queue: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<Op<B>, OpRefused<Q::Error, B>> {
        let Some(index) = self.states.try_reserve() else {
            return Err(self.full(hold));
        };
        self.recv_at(index, queue, wr, hold)
    }

    /// Step 1 found no free slot.
    #[cold]
    fn full<E: From<Refused>, H>(&self, hold: H) -> OpRefused<E, H> {
        OpRefused {
            error: Refused::Contexts {
                handler: self.reg.key(),
                capacity: self.states.capacity(),
            }
            .into(),
            hold,
        }
    }

    /// Step 2's end: the future of a posted request, or the value back.
    fn settle<E>(
        &self,
        index: u32,
        result: Result<(), crate::cq::PostRefused<E, Ticket<B>, 1>>,
    ) -> Result<Op<B>, OpRefused<E, B>> {
        match result {
            Ok(()) => Ok(Op {
                states: Arc::clone(&self.states),
                index,
                resolved: false,
            }),
            Err(refused) => {
                let [back] = refused.back;
                match back {
                    Some(t) => {
                        // Never posted: the slot was never used.
                        self.states.free(index);
                        Err(OpRefused {
                            error: refused.error,
                            hold: t.hold,
                        })
                    }
                    // Posted after all (the error came after it): its
                    // completion resolves the future.
                    None => Ok(Op {
                        states: Arc::clone(&self.states),
                        index,
                        resolved: false,
                    }),
                }
            }
        }
    }
}

/// Room for one request, on its way ([`Ops::reserve`]): resolves with a
/// [`Reserved`] slot once one is free and every wait begun before it has
/// been served.
#[must_use = "a reservation does nothing unless awaited"]
pub struct Reserve<'a, B> {
    ops: &'a Ops<B>,
    /// Its place in the queue, once it has one.
    queued: Option<u64>,
}

impl<B> fmt::Debug for Reserve<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reserve")
            .field("queued", &self.queued)
            .finish()
    }
}

impl<B> Unpin for Reserve<'_, B> {}

impl<'a, B> Future for Reserve<'a, B> {
    type Output = Reserved<'a, B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let ops = self.ops;
        ops.states
            .poll_reserve(&mut self.queued, cx)
            .map(|index| Reserved {
                ops,
                index: Some(index),
            })
    }
}

impl<B> Drop for Reserve<'_, B> {
    fn drop(&mut self) {
        if let Some(id) = self.queued {
            self.ops.states.cancel_reserve(id);
        }
    }
}

/// A state slot reserved for one request: post through it; dropped
/// unposted, the slot goes to the next wait.
pub struct Reserved<'a, B> {
    ops: &'a Ops<B>,
    index: Option<u32>,
}

impl<B> fmt::Debug for Reserved<'_, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reserved")
            .field("slot", &self.index)
            .finish()
    }
}

impl<B: Send + 'static> Reserved<'_, B> {
    /// As [`Ops::post_send`], in the reserved slot.
    ///
    /// # Errors
    /// The posting call's errors, `hold` back; the slot goes to the next.
    pub fn post_send<Q: PostSend + ?Sized>(
        mut self,
        qp: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<Op<B>, OpRefused<Q::Error, B>> {
        let index = self.index.take().expect("a reservation posts once");
        self.ops.send_at(index, qp, wr, hold)
    }

    /// As [`Ops::post_recv`], in the reserved slot.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn post_recv<Q: PostRecv + ?Sized>(
        mut self,
        queue: &Q,
        wr: Q::Wr<'_>,
        hold: B,
    ) -> Result<Op<B>, OpRefused<Q::Error, B>> {
        let index = self.index.take().expect("a reservation posts once");
        self.ops.recv_at(index, queue, wr, hold)
    }
}

impl<B> Drop for Reserved<'_, B> {
    fn drop(&mut self) {
        if let Some(index) = self.index.take() {
            self.ops.states.give_up(index);
        }
    }
}

/// The future of one posted request: resolves with its outcome and the
/// value it held. Dropping it before then is safe (see the module
/// documentation).
#[must_use = "dropping an Op does not cancel its request; await it to learn its outcome"]
pub struct Op<B> {
    states: Arc<States<B>>,
    index: u32,
    resolved: bool,
}

impl<B> fmt::Debug for Op<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Op")
            .field("slot", &self.index)
            .field("resolved", &self.resolved)
            .finish()
    }
}

impl<B> Unpin for Op<B> {}

impl<B> Future for Op<B> {
    type Output = OpOutput<B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        assert!(!self.resolved, "cqd: an Op polled after it resolved");
        let out = self.states.poll_slot(self.index, cx);
        if out.is_ready() {
            self.resolved = true;
        }
        out
    }
}

impl<B> Drop for Op<B> {
    fn drop(&mut self) {
        if !self.resolved {
            self.states.abandon_future(self.index);
        }
    }
}

/// The state machine on its own (also run under Miri in CI): every order
/// of poll, completion and drop gives the output once, drops the held
/// value once, and frees the slot once.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;
    use std::task::Wake;

    struct CountWake(AtomicUsize);
    impl Wake for CountWake {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    struct Held(Arc<AtomicUsize>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn silent() -> Result<Done, OpError> {
        Ok(Done {
            kind: OpKind::Send,
            wc: None,
        })
    }

    fn rig() -> (Arc<States<Held>>, Arc<AtomicUsize>, Arc<CountWake>, Waker) {
        let count = Arc::new(CountWake(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&count));
        (Arc::new(States::new(2)), Arc::default(), count, waker)
    }

    fn free_slots(states: &States<Held>) -> usize {
        let mut n = Vec::new();
        while let Some(i) = states.reserve() {
            n.push(i);
        }
        for &i in &n {
            states.free(i);
        }
        n.len()
    }

    #[test]
    fn pending_then_woken_then_ready() {
        let (states, drops, count, waker) = rig();
        let mut cx = Context::from_waker(&waker);
        let i = states.reserve().unwrap();
        assert!(states.poll_slot(i, &mut cx).is_pending());
        assert!(
            states.poll_slot(i, &mut cx).is_pending(),
            "a second poll keeps one waker"
        );
        states.complete(i, (silent(), Held(Arc::clone(&drops))));
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "woken once");
        let Poll::Ready((out, held)) = states.poll_slot(i, &mut cx) else {
            panic!("done")
        };
        assert!(out.unwrap().is_silent());
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(free_slots(&states), 2);
    }

    #[test]
    fn dropped_before_or_after_the_completion() {
        let (states, drops, _, _) = rig();
        let a = states.reserve().unwrap();
        let b = states.reserve().unwrap();
        // a: dropped first, then completed: the completion drops the value.
        states.abandon_future(a);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        states.complete(a, (silent(), Held(Arc::clone(&drops))));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // b: completed first, then dropped: the drop drops the value.
        states.complete(b, (silent(), Held(Arc::clone(&drops))));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        states.abandon_future(b);
        assert_eq!(drops.load(Ordering::SeqCst), 2);
        assert_eq!(free_slots(&states), 2);
    }

    #[test]
    fn across_threads_each_value_once() {
        let (states, drops, _, waker) = rig();
        let rounds = if cfg!(miri) { 20 } else { 200 };
        for round in 0..rounds {
            let i = states.reserve().unwrap();
            let s2 = Arc::clone(&states);
            let d2 = Arc::clone(&drops);
            let t = std::thread::spawn(move || s2.complete(i, (silent(), Held(d2))));
            if round % 2 == 0 {
                states.abandon_future(i);
            } else {
                let mut cx = Context::from_waker(&waker);
                loop {
                    if let Poll::Ready((_, held)) = states.poll_slot(i, &mut cx) {
                        drop(held);
                        break;
                    }
                    std::thread::yield_now();
                }
            }
            t.join().unwrap();
        }
        assert_eq!(drops.load(Ordering::SeqCst), rounds);
        assert_eq!(free_slots(&states), 2);
    }

    /// Step 8 on one thread: a slot freed while the queue's lock is held
    /// (the poller freeing while a task polls its wait) does not wait for
    /// the lock — with a waiting lock this test would deadlock — and the
    /// holder's release serves the wait and wakes it.
    #[test]
    fn a_free_never_waits_for_the_queue_lock() {
        let (states, drops, count, waker) = rig();
        let mut cx = Context::from_waker(&waker);
        let (a, b) = (states.reserve().unwrap(), states.reserve().unwrap());
        let mut queued = None;
        assert!(states.poll_reserve(&mut queued, &mut cx).is_pending());
        let held = states.lock_queue();
        states.complete(a, (silent(), Held(Arc::clone(&drops))));
        states.abandon_future(a);
        assert_eq!(count.0.load(Ordering::SeqCst), 0, "not served while held");
        drop(held);
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "served at the release");
        assert_eq!(states.poll_reserve(&mut queued, &mut cx), Poll::Ready(a));
        assert_eq!(states.top.load(Ordering::SeqCst) & WAIT, 0, "WAIT cleared");
        states.free(a);
        states.free(b);
        assert_eq!(free_slots(&states), 2);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn outputs_left_in_a_dropped_table_are_dropped() {
        let (states, drops, _, _) = rig();
        let i = states.reserve().unwrap();
        states.complete(i, (silent(), Held(Arc::clone(&drops))));
        drop(states);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }
}

/// Loom models of the state protocol. `poll_races_the_completion`: a
/// future's poll (step 5, with its waker's registration, step 4) races the
/// completion (step 3); whatever the interleaving, a poll that returned
/// `Pending` was woken, the output comes out once and the slot is freed
/// once. Its mutation (no second look at `DONE` after registering) loses
/// the wake-up, and loom finds it. `drop_races_the_completion`: a future
/// dropped unresolved races the completion; the held value is dropped
/// once, and the slot freed once. Its mutation (the completion sets `DONE`
/// with a load and a store) loses the future's `GONE`, leaks the value,
/// and loom finds it. `a_wait_for_room_races_a_free`: step 7, with its
/// mutation; `a_free_races_a_held_queue`: step 8, with its mutation.
#[cfg(all(test, loom))]
mod loom_op {
    use super::*;
    use crate::sync::{Arc, AtomicUsize};
    use std::task::Wake;

    struct CountWake(AtomicUsize);
    impl Wake for CountWake {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
        fn wake_by_ref(self: &std::sync::Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn silent() -> Result<Done, OpError> {
        Ok(Done {
            kind: OpKind::Send,
            wc: None,
        })
    }

    impl<B> States<B> {
        /// The mutation of step 5: registers, and sleeps without looking
        /// at DONE again.
        fn poll_without_recheck(&self, index: u32, cx: &mut Context<'_>) -> Poll<OpOutput<B>> {
            let slot = &self.slots[index as usize];
            if slot.state.load(Ordering::Acquire) & DONE == 0 {
                self.register(slot, cx.waker());
                return Poll::Pending;
            }
            Poll::Ready(self.resolve(index))
        }

        /// The mutation of step 3: DONE set by a load and a store.
        fn complete_without_rmw(&self, index: u32, output: OpOutput<B>) {
            let slot = &self.slots[index as usize];
            // SAFETY: (the mutation) as in `complete`.
            unsafe { (*slot.out.get()).write(output) };
            let prev = slot.state.load(Ordering::Acquire);
            slot.state.store(prev | DONE, Ordering::Release);
            if prev & GONE != 0 {
                // SAFETY: as in `complete`.
                drop(unsafe { (*slot.out.get()).assume_init_read() });
                self.free(index);
                return;
            }
            if let Some(w) = self.take_waker(slot) {
                w.wake();
            }
            if slot.state.fetch_or(WOKEN, Ordering::AcqRel) & GONE != 0 {
                self.free(index);
            }
        }
    }

    fn poll_race(recheck: bool) {
        loom::model(move || {
            let states = Arc::new(States::<u32>::new(1));
            let index = states.reserve().unwrap();
            let s2 = Arc::clone(&states);
            let poller = loom::thread::spawn(move || s2.complete(index, (silent(), 5)));
            let count = std::sync::Arc::new(CountWake(AtomicUsize::new(0)));
            let waker = Waker::from(std::sync::Arc::clone(&count));
            let mut cx = Context::from_waker(&waker);
            let first = if recheck {
                states.poll_slot(index, &mut cx)
            } else {
                states.poll_without_recheck(index, &mut cx)
            };
            poller.join().unwrap();
            let out = match first {
                Poll::Ready(out) => out,
                Poll::Pending => {
                    assert!(
                        count.0.load(Ordering::SeqCst) > 0,
                        "lost wake-up: pending and never woken"
                    );
                    match states.poll_slot(index, &mut cx) {
                        Poll::Ready(out) => out,
                        Poll::Pending => panic!("woken, yet not done"),
                    }
                }
            };
            assert_eq!(out.1, 5);
            assert_eq!(states.reserve(), Some(index), "freed once");
            assert_eq!(states.reserve(), None);
        });
    }

    #[test]
    fn poll_races_the_completion() {
        poll_race(true);
    }

    #[test]
    #[should_panic(expected = "lost wake-up")]
    fn without_the_second_look_a_wake_up_is_lost() {
        poll_race(false);
    }

    struct Held(Arc<AtomicUsize>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn drop_race(rmw: bool) {
        loom::model(move || {
            let states = Arc::new(States::<Held>::new(1));
            let index = states.reserve().unwrap();
            let drops = Arc::new(AtomicUsize::new(0));
            let held = Held(Arc::clone(&drops));
            let s2 = Arc::clone(&states);
            let poller = loom::thread::spawn(move || {
                if rmw {
                    s2.complete(index, (silent(), held));
                } else {
                    s2.complete_without_rmw(index, (silent(), held));
                }
            });
            states.abandon_future(index);
            poller.join().unwrap();
            assert_eq!(
                drops.load(Ordering::SeqCst),
                1,
                "the held value leaked or dropped twice"
            );
            assert_eq!(states.reserve(), Some(index), "freed once");
            assert_eq!(states.reserve(), None);
        });
    }

    /// Step 7: a wait for room queues while the only slot is freed.
    /// Whatever the interleaving, the wait gets the slot: at once, or on
    /// its next poll after a wake-up. The mutation (a free that pushes
    /// and never looks for waits) leaves the wait asleep beside a free
    /// slot, and loom finds it.
    fn room_race(look: bool) {
        loom::model(move || {
            let states = Arc::new(States::<u32>::new(1));
            let index = states.reserve().unwrap();
            let s2 = Arc::clone(&states);
            let freer = loom::thread::spawn(move || {
                if look {
                    s2.give_up(index);
                } else {
                    let _ = s2.push(index);
                }
            });
            let count = std::sync::Arc::new(CountWake(AtomicUsize::new(0)));
            let waker = Waker::from(std::sync::Arc::clone(&count));
            let mut cx = Context::from_waker(&waker);
            let mut queued = None;
            let first = states.poll_reserve(&mut queued, &mut cx);
            freer.join().unwrap();
            let got = match first {
                Poll::Ready(i) => i,
                Poll::Pending => match states.poll_reserve(&mut queued, &mut cx) {
                    Poll::Ready(i) => {
                        assert!(count.0.load(Ordering::SeqCst) > 0, "given but not woken");
                        i
                    }
                    Poll::Pending => panic!("asleep beside a free slot"),
                },
            };
            assert_eq!(got, index);
            assert_eq!(states.top.load(Ordering::SeqCst) & WAIT, 0, "WAIT left set");
        });
    }

    /// Step 8: the only slot is freed (on the poller's side, which only
    /// tries the queue's lock) while another reservation's drop holds the
    /// lock. Whatever the interleaving, the first wait gets the slot and
    /// is woken: by the freer, or by the holder looking after its
    /// release. The mutation (a holder that releases without looking)
    /// strands the wait when the freer's try found the lock held, and
    /// loom finds it.
    fn held_race(look: bool) {
        loom::model(move || {
            let states = Arc::new(States::<u32>::new(1));
            let index = states.reserve().unwrap();
            let count = std::sync::Arc::new(CountWake(AtomicUsize::new(0)));
            let waker = Waker::from(std::sync::Arc::clone(&count));
            let mut cx = Context::from_waker(&waker);
            let (mut first, mut second) = (None, None);
            assert!(states.poll_reserve(&mut first, &mut cx).is_pending());
            assert!(states.poll_reserve(&mut second, &mut cx).is_pending());
            let second = second.unwrap();
            let s2 = Arc::clone(&states);
            let freer = loom::thread::spawn(move || s2.give_up(index));
            // The second reservation's drop, as `cancel_reserve` does it,
            // with a schedule point while it holds the lock (loom switches
            // threads only at such points; a real holder can be preempted
            // anywhere). The mutation releases with a plain guard.
            let mut held = look.then(|| states.lock_queue());
            let mut plain = (!look).then(|| states.queue.lock().unwrap());
            let q: &mut WaitQueue = match (&mut held, &mut plain) {
                (Some(q), _) => q,
                (None, Some(q)) => q,
                _ => unreachable!(),
            };
            let _ = states.top.load(Ordering::Relaxed);
            let at = q.entries.iter().position(|w| w.id == second).unwrap();
            q.entries.remove(at);
            if q.entries.iter().all(|w| w.given.is_some()) {
                states.clear_wait();
            }
            drop(held);
            drop(plain);
            freer.join().unwrap();
            match states.poll_reserve(&mut first, &mut cx) {
                Poll::Ready(got) => {
                    assert_eq!(got, index);
                    assert!(count.0.load(Ordering::SeqCst) > 0, "given but not woken");
                }
                Poll::Pending => panic!("asleep beside a free slot"),
            }
            assert_eq!(states.top.load(Ordering::SeqCst) & WAIT, 0, "WAIT left set");
        });
    }

    #[test]
    fn a_free_races_a_held_queue() {
        held_race(true);
    }

    #[test]
    #[should_panic(expected = "asleep beside a free slot")]
    fn a_holder_that_never_looks_strands_a_wait() {
        held_race(false);
    }

    #[test]
    fn a_wait_for_room_races_a_free() {
        room_race(true);
    }

    #[test]
    #[should_panic(expected = "asleep beside a free slot")]
    fn a_free_that_never_looks_for_waits_strands_one() {
        room_race(false);
    }

    #[test]
    fn drop_races_the_completion() {
        drop_race(true);
    }

    #[test]
    #[should_panic(expected = "leaked")]
    fn without_the_read_modify_write_the_value_leaks() {
        drop_race(false);
    }
}
