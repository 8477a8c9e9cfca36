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
//! Storage is a table of `capacity` slots made once, at registration
//! ([`CqHandle::register_with_contexts`](crate::CqHandle::register_with_contexts)):
//! no allocation per request. The slot's index is the request's tag. A
//! table with no free slot refuses the post ([`Refused::Contexts`](crate::post::Refused::Contexts)), as
//! credits refuse one on a full CQ. Posts go through the
//! `ContextRegistration` the registration returns (`crate::cq`), which
//! has no tag-based posting call. Plain tags
//! ([`Handler`]) cost what they always did: no table.
//!
//! **The slot protocol** (the SAFETY comments and the loom model
//! `context::loom_table` cite these numbers):
//!
//! 1. **Take a slot.** A poster pops a free index from the table's free
//!    stack (a Treiber stack of indices, its top tagged with a counter
//!    against ABA: posters of several queues pop at once).
//! 2. **Fill.** The poster, which alone owns a popped slot, writes the value
//!    and then marks the slot full (Release) — before the post, so that a
//!    completion arriving inside the post finds it.
//! 3. **Empty.** Whoever finds the slot full first takes the value: it
//!    swaps the mark to empty (AcqRel) and, if it was full, reads the value
//!    and pushes the index back (Release). The poller does so for the
//!    completion (or silent retirement) naming the slot; a poster does so
//!    for the requests of its list that were not posted. The swap decides
//!    once, so a foreign completion naming a slot races a poster's take
//!    harmlessly, and one naming an empty slot finds nothing (counted).
//! 4. **The end.** The handler is dropped on its poller thread after the
//!    poller's last poll; every slot still full is emptied as in 3 and
//!    handed to `on_abandoned`.

use std::cell::UnsafeCell;
use std::fmt;
use std::mem::MaybeUninit;

use crate::handler::{Failed, Handler, Outbox, RecvDone, SendDone, Silent};
use crate::sink::NoWork;
use std::sync::Arc;

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

/// The table of one handler's contexts (see the module documentation).
pub(crate) struct Table<C> {
    slots: Box<[Slot<C>]>,
    /// The free stack's top: index in the low 32 bits, a counter above
    /// (step 1).
    top: AtomicU64,
    /// Completions that named an empty slot (step 3).
    pub(crate) empty_hits: AtomicU64,
}

// SAFETY: a slot's value is reached only by the thread that owns the slot
// under the protocol (steps 1–4): a poster between its pop and the full
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
    pub(crate) fn new(capacity: u32) -> Self {
        let slots: Box<[Slot<C>]> = (0..capacity)
            .map(|i| Slot {
                full: AtomicBool::new(false),
                next: AtomicU32::new(if i + 1 < capacity { i + 1 } else { NONE }),
                value: UnsafeCell::new(MaybeUninit::uninit()),
            })
            .collect();
        let top = if capacity == 0 { NONE } else { 0 };
        Table {
            slots,
            top: AtomicU64::new(u64::from(top)),
            empty_hits: AtomicU64::new(0),
        }
    }

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
                Ok(_) => break index,
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
    pub(crate) fn take(&self, index: u32) -> Option<C> {
        let slot = self.slots.get(index as usize)?;
        if !slot.full.swap(false, Ordering::AcqRel) {
            return None;
        }
        // SAFETY: the swap from full made this thread the slot's owner
        // (step 3); the poster's write happened before its Release mark.
        let value = unsafe { (*slot.value.get()).assume_init_read() };
        self.push(index);
        Some(value)
    }

    /// Step 3's return of an emptied slot to the free stack.
    fn push(&self, index: u32) {
        let slot = &self.slots[index as usize];
        let mut top = self.top.load(Ordering::Relaxed);
        loop {
            slot.next.store(top as u32, Ordering::Relaxed);
            let new = ((top >> 32).wrapping_add(1) << 32) | u64::from(index);
            match self
                .top
                .compare_exchange_weak(top, new, Ordering::Release, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(now) => top = now,
            }
        }
    }

    /// Step 4: every value still in the table.
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

/// The [`Handler`] cqd registers for a [`ContextHandler`]: it takes each
/// request's context out of the table and hands it to the callback.
pub(crate) struct WithContexts<H: ContextHandler<W>, W> {
    pub(crate) inner: H,
    pub(crate) table: Arc<Table<H::Ctx>>,
}

impl<H: ContextHandler<W>, W> WithContexts<H, W> {
    /// A completion that names an empty slot: a foreign or corrupted tag
    /// (the wr_id decoded, the handler matched, its tag did not).
    #[cold]
    #[inline(never)]
    fn empty(&self, key: HandlerKey, tag: u32) {
        self.table.empty_hits.fetch_add(1, Ordering::Relaxed);
        tracing::error!(handler = %key, tag, "completion names a request context that is not posted: not delivered");
    }
}

impl<H: ContextHandler<W>, W: 'static> Handler<W> for WithContexts<H, W> {
    #[inline]
    fn on_send(&mut self, done: &SendDone<'_>, out: &mut Outbox<'_, W>) {
        match self.table.take(done.tag()) {
            Some(ctx) => self.inner.on_send(done, ctx, out),
            None => self.empty(done.key(), done.tag()),
        }
    }
    #[inline]
    fn on_recv(&mut self, done: &RecvDone<'_>, out: &mut Outbox<'_, W>) {
        match self.table.take(done.tag()) {
            Some(ctx) => self.inner.on_recv(done, ctx, out),
            None => self.empty(done.key(), done.tag()),
        }
    }
    fn on_error(&mut self, failed: &Failed<'_>, out: &mut Outbox<'_, W>) {
        match self.table.take(failed.tag()) {
            Some(ctx) => self.inner.on_error(failed, ctx, out),
            None => self.empty(failed.key(), failed.tag()),
        }
    }
    fn on_silent(&mut self, silent: &Silent, out: &mut Outbox<'_, W>) {
        match self.table.take(silent.tag()) {
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
        // Step 4.
        let inner = &mut self.inner;
        self.table.drain(|ctx| inner.on_abandoned(ctx));
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
                let v = if swap {
                    t2.take(index)
                } else {
                    t2.take_twice_mutation(index)
                };
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

    impl<C> Table<C> {
        /// The mutation: test, then clear, in two steps.
        fn take_twice_mutation(&self, index: u32) -> Option<C> {
            let slot = self.slots.get(index as usize)?;
            if !slot.full.load(Ordering::Acquire) {
                return None;
            }
            slot.full.store(false, Ordering::Release);
            // SAFETY: (the mutation) as in `take`, if it were the only one.
            let value = unsafe { (*slot.value.get()).assume_init_read() };
            self.push(index);
            Some(value)
        }
    }
}
