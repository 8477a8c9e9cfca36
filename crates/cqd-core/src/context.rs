//! Request contexts: each posted request carries a value of the handler's
//! own type, handed back to exactly one callback.
//!
//! A tag is 24 bits; a server's request is a buffer, a client, a deadline.
//! Instead of keeping its own table from tag to request, a
//! [`ContextHandler`] declares its request type ([`ContextHandler::Ctx`]),
//! each post moves one value in, and the value comes back, moved out, to
//! exactly one of:
//!
//! - [`on_send`](ContextHandler::on_send) / [`on_recv`](ContextHandler::on_recv):
//!   the request succeeded;
//! - [`on_error`](ContextHandler::on_error): it failed, or was flushed;
//! - [`on_silent`](ContextHandler::on_silent): an unsignaled send that a
//!   later completion of its queue retired (it had no completion of its
//!   own);
//! - [`on_abandoned`](ContextHandler::on_abandoned): the handler is dropped
//!   (its poller stopped) with the request still outstanding — it never
//!   completed nor was flushed; the value is handed back rather than
//!   dropped unseen;
//!
//! or, if the post itself is refused, back to the caller (in the
//! refusal, `PostRefused::back`). A value is never dropped unseen and never handed
//! out twice, so a buffer held in a context stays alive until the device is
//! done with it.
//!
//! **Storage.** A context of at most 8 bytes (`in_ring`: an integer, an
//! index, a `Box`, an `Arc`) travels in its request's entry of the queue's
//! ring (`account::ring`): the posting call writes its word beside the
//! entry (R1), the claim that retires the entry, or the tombstone that
//! takes it back at `bad_wr`, owns the word (R4, R5), and the handler's end
//! hands back what the rings still hold (R8). Such a request's tag is its
//! position on its queue. Nothing per request is shared between the
//! posters and the poller but the ring, and nothing is allocated.
//!
//! A larger context lives in a table of `capacity` slots (and a few more,
//! step 4) made once, at registration
//! ([`CqHandle::register_with_contexts`](crate::CqHandle::register_with_contexts)):
//! no allocation per request. The slot's index is the request's tag. A
//! table with no free slot refuses the post ([`Refused::Contexts`](crate::post::Refused::Contexts)), as
//! credits refuse one on a full CQ.
//!
//! Posts go through the `ContextRegistration` the registration returns
//! (`crate::cq`), which has no tag-based posting call. Plain tags
//! ([`Handler`]) cost what they always did: no table, no word.
//!
//! **The slot protocol of a table** (C1–C5 in docs/posting.md; the SAFETY
//! comments and the loom models `context::loom_table` cite these numbers):
//!
//! 1. **Take a slot.** A poster pops a free index from the table's free
//!    stack (a Treiber stack of indices, its top tagged with a counter
//!    against ABA: posters of several queues pop at once).
//! 2. **Fill.** The poster, which alone owns a popped slot, writes the value
//!    and then marks the slot full (Release) — before the post, so that a
//!    completion arriving inside the post finds it.
//! 3. **Empty.** Whoever finds the slot full first takes the value: it
//!    swaps the mark to empty (AcqRel) and, if it was full, reads the value.
//!    The poller does so for the completion (or silent retirement) naming
//!    the slot; a poster does so for the requests of its list that were not
//!    posted. The swap decides once, so a foreign completion naming a slot
//!    races a poster's take harmlessly, and one naming an empty slot finds
//!    nothing (counted).
//! 4. **Return.** A poster pushes the slot it emptied back on the free
//!    stack at once (Release). The poller links the slots it empties into
//!    a chain of its own (plain stores: it owns them) and pushes the whole
//!    chain with one compare-and-swap (Release) when it holds `batch` of
//!    them, so the stack's top, which the posters pop, moves between the
//!    CPUs once per `batch` completions rather than once per completion.
//!    The table has `batch - 1` slots beyond the capacity asked for, so
//!    the slots a chain holds never make a post fail that the capacity
//!    admits.
//! 5. **The end.** The handler is dropped on its poller thread after the
//!    poller's last poll; its chain is pushed, and every slot still full is
//!    emptied as in 3 and handed to `on_abandoned`.

use std::cell::UnsafeCell;
use std::fmt;
use std::mem::MaybeUninit;
use std::sync::Arc;

use crossbeam_utils::CachePadded;

use crate::account::CtxWord;
use crate::handler::{Failed, Handler, Outbox, RecvDone, SendDone, Silent};
use crate::sink::NoWork;
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use crate::wr_id::HandlerKey;

/// A handler whose requests carry a context (see the module
/// documentation). Register it with
/// [`CqHandle::register_with_contexts`](crate::CqHandle::register_with_contexts);
/// post through the `ContextRegistration` it returns.
pub trait ContextHandler<W = NoWork>: Send + 'static {
    /// The value each request carries.
    type Ctx: Send + 'static;

    /// A send-side request completed successfully.
    fn on_send(&mut self, done: &SendDone<'_>, ctx: Self::Ctx, out: &mut Outbox<'_, W>);
    /// A receive completed successfully.
    fn on_recv(&mut self, done: &RecvDone<'_>, ctx: Self::Ctx, out: &mut Outbox<'_, W>);
    /// A request failed, was flushed, or the device reported what cqd does
    /// not know ([`Failed::is_anomaly`]).
    fn on_error(&mut self, failed: &Failed<'_>, ctx: Self::Ctx, out: &mut Outbox<'_, W>);
    /// An unsignaled send ran silently: a later completion of its queue
    /// retired it.
    fn on_silent(&mut self, silent: &Silent, ctx: Self::Ctx, out: &mut Outbox<'_, W>);
    /// The handler is being dropped (its poller stopped) with this request
    /// outstanding: it never completed and was never flushed, so the device
    /// may still hold what it names (the stop's report counts it missing).
    fn on_abandoned(&mut self, ctx: Self::Ctx);
    /// An asynchronous event of a queue this handler owns (as
    /// [`Handler::on_async`]).
    fn on_async(&mut self, event: &crate::event::AsyncEvent) {
        let _ = event;
    }
}

/// A free list's end: no slot.
const NONE: u32 = u32::MAX;

struct Slot<C> {
    full: AtomicBool,
    /// The next free slot while this one is free (step 1).
    next: AtomicU32,
    value: UnsafeCell<MaybeUninit<C>>,
}

/// Most slots the poller returns in one chain (step 4).
const RETURN_BATCH: u32 = 16;

/// The slots the poller has emptied and not yet pushed (step 4): a chain
/// linked through the slots' `next`, owned by the poller's handler.
#[derive(Debug)]
pub(crate) struct Returns {
    head: u32,
    tail: u32,
    len: u32,
}

impl Default for Returns {
    fn default() -> Self {
        Returns {
            head: NONE,
            tail: NONE,
            len: 0,
        }
    }
}

/// The table of one handler's contexts (see the module documentation).
pub(crate) struct Table<C> {
    slots: Box<[Slot<C>]>,
    /// Slots the poller returns in one chain (step 4).
    batch: u32,
    /// The free stack's top: index in the low 32 bits, a counter above
    /// (step 1).
    /// On a line of its own: its neighbours in the heap may be the
    /// poller's (the posters pop here every request).
    top: CachePadded<AtomicU64>,
    /// Completions that named an empty slot (step 3).
    pub(crate) empty_hits: AtomicU64,
}

// SAFETY: a slot's value is reached only by the thread that owns the slot
// under the protocol (steps 1–5): a poster between its pop and the full
// mark, or the one that swapped the mark from full; values are `Send`.
unsafe impl<C: Send> Sync for Table<C> {}
// SAFETY: as above.
unsafe impl<C: Send> Send for Table<C> {}

impl<C> fmt::Debug for Table<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Table")
            .field("capacity", &self.slots.len())
            .finish()
    }
}

impl<C> Table<C> {
    /// A table with room for `capacity` outstanding requests (at most
    /// `MAX_TAG + 1`): the poller returns slots in chains of up to 16, an
    /// eighth of the capacity (step 4).
    pub(crate) fn new(capacity: u32) -> Self {
        let batch = (capacity / 8).clamp(1, RETURN_BATCH);
        Self::with_batch(capacity, batch)
    }

    /// As [`new`](Self::new), returning slots in chains of `batch`.
    pub(crate) fn with_batch(capacity: u32, batch: u32) -> Self {
        let room = crate::wr_id::MAX_TAG + 1 - capacity.min(crate::wr_id::MAX_TAG + 1);
        let batch = batch.clamp(1, room + 1);
        let len = capacity + (batch - 1);
        let slots: Box<[Slot<C>]> = (0..len)
            .map(|i| Slot {
                full: AtomicBool::new(false),
                next: AtomicU32::new(if i + 1 < len { i + 1 } else { NONE }),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        let top = if len == 0 { NONE } else { 0 };
        Table {
            slots,
            batch,
            top: CachePadded::new(AtomicU64::new(u64::from(top))),
            empty_hits: AtomicU64::new(0),
        }
    }

    /// Slots in the table: the most requests outstanding at once (the
    /// capacity asked for, and the `batch - 1` of step 4).
    pub(crate) fn capacity(&self) -> u32 {
        self.slots.len() as u32
    }

    /// Steps 1–2: a slot holding `value`, or the value back if none is
    /// free.
    pub(crate) fn put(&self, value: C) -> Result<u32, C> {
        let mut top = self.top.load(Ordering::Acquire);
        let index = loop {
            let index = top as u32;
            if index == NONE {
                return Err(value);
            }
            let next = self.slots[index as usize].next.load(Ordering::Relaxed);
            let new = ((top >> 32).wrapping_add(1) << 32) | u64::from(next);
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    // The next pop's slot, likely linked by the poller's
                    // CPU (step 4): ask for its line now.
                    if let Some(s) = self.slots.get(next as usize) {
                        crate::sys::prefetch_write(s);
                    }
                    break index;
                }
                Err(now) => top = now,
            }
        };
        let slot = &self.slots[index as usize];
        // SAFETY: step 1 made this poster the slot's only owner: it left the
        // free stack, and its mark is empty, so nobody else reads the value.
        unsafe { (*slot.value.get()).write(value) };
        slot.full.store(true, Ordering::Release);
        Ok(index)
    }

    /// Step 3: the value of slot `index`, if it is full (and this call
    /// emptied it).
    #[inline]
    fn empty(&self, index: u32) -> Option<C> {
        let slot = self.slots.get(index as usize)?;
        if !slot.full.swap(false, Ordering::AcqRel) {
            return None;
        }
        // SAFETY: the swap from full made this thread the slot's owner
        // (step 3); the poster's write happened before its Release mark.
        Some(unsafe { (*slot.value.get()).assume_init_read() })
    }

    /// Steps 3–4 by a poster: the value of slot `index`, if it is full, its
    /// slot pushed back at once.
    pub(crate) fn take(&self, index: u32) -> Option<C> {
        let value = self.empty(index)?;
        self.push_chain(index, index);
        Some(value)
    }

    /// Steps 3–4 by the poller: the value of slot `index`, if it is full,
    /// its slot added to the poller's chain `returns` (pushed when it holds
    /// `batch`).
    #[inline]
    pub(crate) fn take_returning(&self, index: u32, returns: &mut Returns) -> Option<C> {
        let value = self.empty(index)?;
        // Step 4: the slot is the poller's (its swap emptied it), so its
        // link is a plain store; the push publishes it.
        self.slots[index as usize]
            .next
            .store(returns.head, Ordering::Relaxed);
        if returns.len == 0 {
            returns.tail = index;
        }
        returns.head = index;
        returns.len += 1;
        if returns.len >= self.batch {
            self.give_back(returns);
        }
        Some(value)
    }

    /// Step 4: pushes the poller's chain, if it holds any slot.
    pub(crate) fn give_back(&self, returns: &mut Returns) {
        if returns.len != 0 {
            self.push_chain(returns.head, returns.tail);
            *returns = Returns::default();
        }
    }

    /// Step 4's push of a chain of emptied slots, linked `head` to `tail`
    /// through their `next`, onto the free stack.
    fn push_chain(&self, head: u32, tail: u32) {
        let last = &self.slots[tail as usize];
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            last.next.store(top as u32, Ordering::Relaxed);
            let new = ((top >> 32).wrapping_add(1) << 32) | u64::from(head);
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => top = now,
            }
        }
    }

    /// Step 5: every value still in the table.
    fn drain(&self, mut each: impl FnMut(C)) {
        for i in 0..self.capacity() {
            if let Some(v) = self.take(i) {
                each(v);
            }
        }
    }
}

impl<C> Drop for Table<C> {
    fn drop(&mut self) {
        // Values left here (the handler was never dropped: a poller that
        // never ran) are dropped now rather than leaked.
        for slot in self.slots.iter() {
            if slot.full.swap(false, Ordering::AcqRel) {
                // SAFETY: the last owner of the table: the swap from full
                // makes the value ours (step 3).
                unsafe { (*slot.value.get()).assume_init_drop() };
            }
        }
    }
}

/// True when a context of type `C` travels in its request's entry of the
/// queue's ring (`account::ring`, R1 and R5) rather than in a table: it
/// fits the entry's 8-byte word (an integer, a `Box`, an `Arc`, an index).
pub(crate) const fn in_ring<C>() -> bool {
    std::mem::size_of::<C>() <= 8 && std::mem::align_of::<C>() <= 8
}

/// Moves `value` into a ring word ([`in_ring`] types only).
#[inline(always)]
pub(crate) fn to_word<C>(value: C) -> CtxWord {
    // Folded away for every type (a constant per type); a type too large
    // never reaches here (its registration made a table).
    assert!(in_ring::<C>(), "a context of more than 8 bytes has a table");
    let mut word = CtxWord::uninit();
    // SAFETY: a `MaybeUninit<u64>` has room and alignment for a `C` (the
    // assertion above); the value's bytes, padding included, are kept as
    // they are.
    unsafe { word.as_mut_ptr().cast::<C>().write(value) };
    word
}

/// Moves a value back out of a ring word.
///
/// # Safety
/// `word` was made by [`to_word::<C>`](to_word) and the value has not been
/// moved out of it (nor out of a copy of it) before: the ring's claim
/// (R4/R5) gives each word to one owner.
#[inline(always)]
pub(crate) unsafe fn from_word<C>(word: CtxWord) -> C {
    // SAFETY: the caller's.
    unsafe { word.as_ptr().cast::<C>().read() }
}

/// What a context handler's registration and its handler share.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// The handler's end has come (ring contexts: its drop handed back
    /// what the rings held); posts with contexts are refused from then on.
    pub(crate) gone: AtomicBool,
    /// Completions that carried no context of this handler (ring
    /// contexts; a table counts its own).
    pub(crate) empty_hits: AtomicU64,
}

/// The [`Handler`] cqd registers for a [`ContextHandler`]: it takes each
/// request's context out of the completion (a context of at most 8 bytes,
/// which the queue's ring carried) or out of the table, and hands it to
/// the callback.
pub(crate) struct WithContexts<H: ContextHandler<W>, W> {
    pub(crate) inner: H,
    /// The table, for a context too large for the ring.
    pub(crate) table: Option<Arc<Table<H::Ctx>>>,
    /// The slots emptied and not yet pushed back (step 4).
    pub(crate) returns: Returns,
    pub(crate) shared: Arc<Shared>,
    /// The handler's key and its CQ's ledger (once attached), for the end
    /// (ring contexts).
    pub(crate) key: HandlerKey,
    pub(crate) cq_ledger: Arc<std::sync::OnceLock<crate::ledger::WrLedger>>,
}

impl<H: ContextHandler<W>, W> WithContexts<H, W> {
    pub(crate) fn new(
        inner: H,
        table: Option<Arc<Table<H::Ctx>>>,
        shared: Arc<Shared>,
        key: HandlerKey,
        cq_ledger: Arc<std::sync::OnceLock<crate::ledger::WrLedger>>,
    ) -> Self {
        WithContexts {
            inner,
            table,
            returns: Returns::default(),
            shared,
            key,
            cq_ledger,
        }
    }

    /// The context of a completion: its word (R5), or its table slot.
    #[inline(always)]
    fn take(&mut self, ctx: Option<CtxWord>, tag: u32) -> Option<H::Ctx> {
        if in_ring::<H::Ctx>() {
            // SAFETY: a word reaches a completion only from an entry
            // posted with one (R1), and an entry names its poster's
            // handler in its wr_id, which routed this completion here: the
            // word was made by this handler's registration from an
            // `H::Ctx`. The claim (R5) gave it to this completion alone.
            return ctx.map(|w| unsafe { from_word::<H::Ctx>(w) });
        }
        let table = self.table.as_ref()?;
        table.take_returning(tag, &mut self.returns)
    }
}

impl<H: ContextHandler<W>, W> WithContexts<H, W> {
    /// A completion that carries no context: a foreign or corrupted wr_id
    /// (the wr_id decoded, the handler matched, no request of its matched).
    #[cold]
    #[inline(never)]
    fn empty(&self, key: HandlerKey, tag: u32) {
        match &self.table {
            Some(t) => t.empty_hits.fetch_add(1, Ordering::Relaxed),
            None => self.shared.empty_hits.fetch_add(1, Ordering::Relaxed),
        };
        tracing::error!(handler = %key, tag, "completion names a request context that is not posted: not delivered");
    }
}

impl<H: ContextHandler<W>, W: 'static> Handler<W> for WithContexts<H, W> {
    #[inline]
    fn on_send(&mut self, done: &SendDone<'_>, out: &mut Outbox<'_, W>) {
        match self.take(done.ctx, done.tag()) {
            Some(ctx) => self.inner.on_send(done, ctx, out),
            None => self.empty(done.key(), done.tag()),
        }
    }
    #[inline]
    fn on_recv(&mut self, done: &RecvDone<'_>, out: &mut Outbox<'_, W>) {
        match self.take(done.ctx, done.tag()) {
            Some(ctx) => self.inner.on_recv(done, ctx, out),
            None => self.empty(done.key(), done.tag()),
        }
    }
    fn on_error(&mut self, failed: &Failed<'_>, out: &mut Outbox<'_, W>) {
        match self.take(failed.ctx, failed.tag()) {
            Some(ctx) => self.inner.on_error(failed, ctx, out),
            None => self.empty(failed.key(), failed.tag()),
        }
    }
    fn on_silent(&mut self, silent: &Silent, out: &mut Outbox<'_, W>) {
        match self.take(silent.ctx, silent.tag()) {
            Some(ctx) => self.inner.on_silent(silent, ctx, out),
            None => self.empty(silent.key(), silent.tag()),
        }
    }
    fn on_async(&mut self, event: &crate::event::AsyncEvent) {
        self.inner.on_async(event);
    }
}

impl<H: ContextHandler<W>, W> Drop for WithContexts<H, W> {
    fn drop(&mut self) {
        // Step 5.
        let inner = &mut self.inner;
        if let Some(table) = &self.table {
            table.give_back(&mut self.returns);
            table.drain(|ctx| inner.on_abandoned(ctx));
            return;
        }
        // Ring contexts (R8 of `account::ring`): posts are refused from
        // now on (each queue's posting lock, taken below after this store,
        // orders it before any later post's check), then every live entry
        // of this handler's gives its context back, once.
        self.shared.gone.store(true, Ordering::SeqCst);
        let Some(ledger) = self.cq_ledger.get() else {
            return;
        };
        let key = self.key;
        let mine = |wr_id: u64| crate::wr_id::WrId::decode(wr_id).is_ok_and(|id| id.key == key);
        let mut left: Vec<H::Ctx> = Vec::new();
        for (_, _, account) in ledger.accounts() {
            account.abandon_where(&mine, &mut |w| {
                // SAFETY: as in `take`: an entry of this handler's posted
                // with a word; `abandon_where` hands each word out once and
                // clears its flag under both locks.
                left.push(unsafe { from_word::<H::Ctx>(w) });
            });
        }
        // After every queue: words the expert path retired (kept under a
        // queue's retiring lock, so none retired before a visit is missed).
        for w in ledger.take_orphans(&mine) {
            // SAFETY: as above: the word of a request of this handler's
            // posted with a context, taken out of the ledger once.
            left.push(unsafe { from_word::<H::Ctx>(w) });
        }
        // Outside the queues' locks: a callback that panics leaves the
        // rest to be dropped with `left`.
        for ctx in left {
            inner.on_abandoned(ctx);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_given_once_and_comes_back() {
        let t: Table<String> = Table::new(2);
        let a = t.put("a".into()).unwrap();
        let b = t.put("b".into()).unwrap();
        assert_eq!(t.put("c".into()), Err("c".to_string()), "full");
        assert_eq!(t.take(a).as_deref(), Some("a"));
        assert_eq!(t.take(a), None, "not twice");
        assert_eq!(t.take(99), None, "out of range: nothing, no panic");
        let c = t.put("c".into()).unwrap();
        assert_eq!(c, a, "the freed slot is used again");
        let mut left = Vec::new();
        t.drain(|v| left.push(v));
        left.sort();
        assert_eq!(left, ["b", "c"]);
        let _ = b;
    }

    #[test]
    fn the_poller_returns_slots_in_chains() {
        // Room for 2, chains of 3: 4 slots.
        let t: Table<u32> = Table::with_batch(2, 3);
        assert_eq!(t.capacity(), 4);
        let all: Vec<u32> = (0..4).map(|v| t.put(v).unwrap()).collect();
        assert_eq!(t.put(9), Err(9), "full");
        let mut r = Returns::default();
        assert_eq!(t.take_returning(all[0], &mut r), Some(0));
        assert_eq!(t.take_returning(all[1], &mut r), Some(1));
        assert_eq!(t.take_returning(all[1], &mut r), None, "not twice");
        assert_eq!(t.put(9), Err(9), "two slots in the poller's chain");
        assert_eq!(t.take_returning(all[2], &mut r), Some(2));
        assert_eq!(r.len, 0, "the third pushed the chain");
        let again: Vec<u32> = (10..13).map(|v| t.put(v).unwrap()).collect();
        let mut sorted = again.clone();
        sorted.sort();
        assert_eq!(sorted, all[..3], "each returned slot once");
        assert_eq!(t.put(9), Err(9));
        // A chain of one, pushed by hand (the handler's drop does so).
        assert_eq!(t.take_returning(all[3], &mut r), Some(3));
        t.give_back(&mut r);
        assert_eq!(t.put(13), Ok(all[3]));
        // A poster's take pushes at once.
        assert_eq!(t.take(again[0]), Some(10));
        assert_eq!(t.put(14), Ok(again[0]));
    }

    #[test]
    fn a_chain_never_strands_the_capacity_asked_for() {
        // Whatever the poller holds in its chain, `capacity` requests can
        // be outstanding.
        let rounds = if cfg!(miri) { 20 } else { 1000 };
        for capacity in [1, 2, 7, 8, 16, 100, 300] {
            let t: Table<u32> = Table::new(capacity);
            let mut r = Returns::default();
            let mut out = std::collections::VecDeque::new();
            for round in 0..rounds {
                while out.len() < capacity as usize {
                    out.push_back(t.put(round).expect("room for the capacity"));
                }
                let n = 1 + round as usize % out.len();
                for _ in 0..n {
                    let i = out.pop_front().unwrap();
                    assert!(t.take_returning(i, &mut r).is_some());
                }
            }
        }
    }

    #[test]
    fn values_left_in_a_dropped_table_are_dropped() {
        let v = std::sync::Arc::new(());
        let t: Table<std::sync::Arc<()>> = Table::new(4);
        t.put(std::sync::Arc::clone(&v)).unwrap();
        drop(t);
        assert_eq!(std::sync::Arc::strong_count(&v), 1);
    }
}

/// Loom model of the slot protocol: a poster fills a slot and, its post
/// refused, takes it back, while the poller takes the same slot for a
/// completion naming it (a foreign wr_id, the worst case). Whatever the
/// interleaving, the value is handed out exactly once. The mutation (a
/// load-then-store in place of the swap of step 3) hands it out twice,
/// and loom finds it.
#[cfg(all(test, loom))]
mod loom_table {
    use super::*;
    use loom::sync::Arc;

    fn race(swap: bool) {
        loom::model(move || {
            let t = Arc::new(Table::<u32>::new(1));
            let index = t.put(7).unwrap();
            let got = Arc::new(AtomicU32::new(0));
            let (t2, got2) = (Arc::clone(&t), Arc::clone(&got));
            let poller = loom::thread::spawn(move || {
                let mut returns = Returns::default();
                let v = if swap {
                    t2.take_returning(index, &mut returns)
                } else {
                    t2.take_twice_mutation(index)
                };
                t2.give_back(&mut returns);
                if v.is_some() {
                    got2.fetch_add(1, Ordering::AcqRel);
                }
            });
            let v = if swap {
                t.take(index)
            } else {
                t.take_twice_mutation(index)
            };
            if v.is_some() {
                got.fetch_add(1, Ordering::AcqRel);
            }
            poller.join().unwrap();
            assert_eq!(got.load(Ordering::Acquire), 1, "handed out twice or lost");
            // The slot is free again, once.
            assert_eq!(t.put(8), Ok(index));
            assert!(t.put(9).is_err());
        });
    }

    #[test]
    fn a_context_is_handed_out_once() {
        race(true);
    }

    #[test]
    #[should_panic(expected = "handed out twice")]
    fn without_the_swap_a_context_is_handed_out_twice() {
        race(false);
    }

    /// Step 4: the poller pushes a chain of two slots while a poster pops
    /// the one slot left on the stack (or, later, the chain's head). Every
    /// slot comes back exactly once, whatever the interleaving. The
    /// mutation pushes the chain with a load and a store in place of the
    /// compare-and-swap: a pop between the two is undone, and the popped
    /// slot is both the poster's and on the stack — loom finds it.
    fn chain(cas: bool) {
        loom::model(move || {
            let t = Arc::new(Table::<u32>::with_batch(2, 2));
            let a = t.put(1).unwrap();
            let b = t.put(2).unwrap();
            let t2 = Arc::clone(&t);
            let poller = loom::thread::spawn(move || {
                let mut returns = Returns::default();
                if cas {
                    assert_eq!(t2.take_returning(a, &mut returns), Some(1));
                    assert_eq!(t2.take_returning(b, &mut returns), Some(2));
                    assert_eq!(returns.len, 0, "the chain was pushed");
                } else {
                    assert_eq!(t2.empty(a), Some(1));
                    assert_eq!(t2.empty(b), Some(2));
                    t2.slots[b as usize].next.store(a, Ordering::Relaxed);
                    t2.push_chain_mutation(b, a);
                }
            });
            let popped = t.put(3).unwrap();
            poller.join().unwrap();
            assert_eq!(t.take(popped), Some(3));
            let mut free = Vec::new();
            while let Ok(i) = t.put(0) {
                free.push(i);
                if free.len() > 3 {
                    break;
                }
            }
            free.sort();
            assert_eq!(free, [0, 1, 2], "a slot lost or given twice");
        });
    }

    #[test]
    fn a_chain_comes_back_whole() {
        chain(true);
    }

    #[test]
    #[should_panic(expected = "a slot lost or given twice")]
    fn a_chain_pushed_without_the_cas_gives_a_slot_twice() {
        chain(false);
    }

    impl<C> Table<C> {
        /// The chain's mutation: the push as a load and a store.
        fn push_chain_mutation(&self, head: u32, tail: u32) {
            let top = self.top.load(Ordering::Acquire);
            self.slots[tail as usize]
                .next
                .store(top as u32, Ordering::Relaxed);
            let new = ((top >> 32).wrapping_add(1) << 32) | u64::from(head);
            self.top.store(new, Ordering::Release);
        }

        /// The mutation: test, then clear, in two steps.
        fn take_twice_mutation(&self, index: u32) -> Option<C> {
            let slot = self.slots.get(index as usize)?;
            if !slot.full.load(Ordering::Acquire) {
                return None;
            }
            slot.full.store(false, Ordering::Release);
            // SAFETY: (the mutation) as in `take`, if it were the only one.
            let value = unsafe { (*slot.value.get()).assume_init_read() };
            self.push_chain(index, index);
            Some(value)
        }
    }
}
