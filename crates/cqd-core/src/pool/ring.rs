//! The bounded single-producer single-consumer ring behind each hand-off.
//!
//! This is the only module of the pool with `unsafe` code: it moves values in
//! and out of uninitialised slots (and out of the poller's spill queue,
//! [`Producer::stage_front`]), and issues a write prefetch. Everything else
//! uses its safe API.
//!
//! Layout: a power-of-two array of slots and two free-running counters, `tail`
//! (written only by the producer) and `head` (written only by the consumer),
//! each on its own cache line. Slot `i` lives at `i & mask`. The ring holds
//! `tail - head` values, never more than the capacity.
//!
//! Protocol, in the order the code follows it:
//!
//! 1. The producer *stages* values: it writes them into free slots at
//!    `staged, staged + 1, ...` without telling anyone. Free means
//!    `staged - head < capacity`, checked against a cached copy of `head`
//!    that [`Producer::refresh`] reloads with `Acquire` (pairing with step 4).
//! 2. The producer *publishes* the whole staged batch with one `Release`
//!    store of `tail` (one publication per batch, not per value).
//! 3. The consumer loads `tail` with `Acquire` (pairing with step 2), so the
//!    slot writes of step 1 are visible, and moves values out of
//!    `head .. tail`.
//! 4. The consumer frees the batch with one `Release` store of `head`, so the
//!    producer's next writes into those slots happen after the reads.
//!
//! Values still in the ring when both ends are gone are dropped by the ring.

use std::collections::VecDeque;
use std::marker::PhantomData;
use std::mem::MaybeUninit;

use crossbeam_utils::CachePadded;

use crate::sink::Routed;
use crate::sync::{Arc, AtomicUsize, Ordering};

/// A cell that loom can check for data races; a thin wrapper over the std
/// cell otherwise. (The `sync` shim has no cell; this is the only user.)
#[cfg(loom)]
use loom::cell::UnsafeCell;

#[cfg(not(loom))]
#[derive(Debug)]
struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(loom))]
impl<T> UnsafeCell<T> {
    fn new(value: T) -> Self {
        Self(std::cell::UnsafeCell::new(value))
    }

    fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

struct Ring<T> {
    /// The slots, and a few more: slot `i` is `cells[offset + i]`, where
    /// `offset` puts slot 0 on a cache-line boundary (see [`ring`]).
    cells: Box<[UnsafeCell<MaybeUninit<T>>]>,
    offset: usize,
    mask: usize,
    /// Next slot the consumer reads; written only by the consumer.
    head: CachePadded<AtomicUsize>,
    /// One past the last published slot; written only by the producer.
    tail: CachePadded<AtomicUsize>,
}

// SAFETY: the ring hands each value from exactly one producer thread to exactly
// one consumer thread (the split into `Producer` and `Consumer`, neither of which
// is `Clone`, upholds this), so sharing the ring needs only `T: Send`. Slot
// accesses never overlap: the producer touches only `head+cap .. ` free slots and
// the consumer only `head .. tail`, ordered by the Release/Acquire pairs of
// protocol steps 2-3 and 4-1.
unsafe impl<T: Send> Sync for Ring<T> {}
// SAFETY: as above; the values themselves are `Send`.
unsafe impl<T: Send> Send for Ring<T> {}

impl<T> Ring<T> {
    /// The `mask + 1` slots, the first on a cache-line boundary.
    #[inline]
    fn slots(&self) -> &[UnsafeCell<MaybeUninit<T>>] {
        &self.cells[self.offset..self.offset + self.mask + 1]
    }
}

impl<T> Drop for Ring<T> {
    fn drop(&mut self) {
        // Both ends are gone (this is the last `Arc`), so nobody else touches
        // the slots; the Arc's release/acquire makes their last writes visible.
        let head = self.head.load(Ordering::Acquire);
        let tail = self.tail.load(Ordering::Acquire);
        for i in head..tail {
            self.slots()[i & self.mask].with_mut(|slot| {
                // SAFETY: slots `head .. tail` hold published, not yet consumed
                // values (invariant of steps 2 and 4); nobody reads them again.
                unsafe { (*slot).assume_init_drop() }
            });
        }
    }
}

/// Creates a ring of at least `capacity` slots (rounded up to a power of two,
/// at least 1) and returns its two ends.
pub(crate) fn ring<T>(capacity: usize) -> (Producer<T>, Consumer<T>) {
    let capacity = capacity.max(1).next_power_of_two();
    // Slot 0 on a line boundary (of 128 bytes, the pair of lines that
    // Intel's spatial prefetcher moves together), so that a batch of whole
    // lines shares none with the next batch: a worker that reads a batch
    // the moment it is published does not pull in the line the producer
    // is writing next. Allocated with spare slots and indexed from an
    // offset, in safe code.
    const LINE: usize = 128;
    let size = std::mem::size_of::<T>();
    let spare = if size == 0 || size >= LINE {
        0
    } else {
        LINE.div_ceil(size)
    };
    let cells: Box<[UnsafeCell<MaybeUninit<T>>]> = (0..capacity + spare)
        .map(|_| UnsafeCell::new(MaybeUninit::uninit()))
        .collect();
    let offset = (0..spare)
        .find(|&i| cells.as_ptr().wrapping_add(i).addr() % LINE == 0)
        .unwrap_or(0);
    let ring = Arc::new(Ring {
        cells,
        offset,
        mask: capacity - 1,
        head: CachePadded::new(AtomicUsize::new(0)),
        tail: CachePadded::new(AtomicUsize::new(0)),
    });
    let producer = Producer {
        ring: ring.clone(),
        published: 0,
        staged: 0,
        cached_head: 0,
        #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
        prefetchw: has_prefetchw(),
        _not_sync: PhantomData,
    };
    let consumer = Consumer {
        ring,
        head: 0,
        cached_tail: 0,
        _not_sync: PhantomData,
    };
    (producer, consumer)
}

/// How far ahead of a publication the producer prefetches free slots for
/// writing ([`Producer::publish`]).
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
const PREFETCH_BYTES: usize = 512;

/// The writing end. `Send`, not `Sync`, not `Clone`.
pub(crate) struct Producer<T> {
    ring: Arc<Ring<T>>,
    published: usize,
    staged: usize,
    cached_head: usize,
    /// The CPU has `prefetchw` ([`Producer::prefetch_free`]).
    #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
    prefetchw: bool,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<T> Producer<T> {
    /// Slots in the ring.
    pub(crate) fn capacity(&self) -> usize {
        self.ring.mask + 1
    }

    /// Reloads the consumer's position (step 1) and returns the free slots.
    pub(crate) fn refresh(&mut self) -> usize {
        self.cached_head = self.ring.head.load(Ordering::Acquire);
        self.free()
    }

    /// Free slots as of the last [`refresh`](Self::refresh), minus staged values.
    pub(crate) fn free(&self) -> usize {
        self.capacity() - (self.staged - self.cached_head)
    }

    /// Writes `value` into the next free slot without publishing it (step 1);
    /// a full ring returns the value.
    pub(crate) fn stage(&mut self, value: T) -> Result<(), T> {
        if self.free() == 0 {
            return Err(value);
        }
        let slot = &self.ring.slots()[self.staged & self.ring.mask];
        slot.with_mut(|slot| {
            // SAFETY: `staged - cached_head < capacity`, and the consumer never
            // reads past the published tail, which is <= staged, so this slot is
            // free and only this producer (the single owner) touches it until
            // it is published in step 2.
            unsafe { (*slot).write(value) };
        });
        self.staged += 1;
        Ok(())
    }

    /// Stages the first [`free`](Self::free) values of `values` (step 1) in
    /// one tight loop and returns how many it took; it consumes no more than
    /// that from the iterator, so a caller that passes at most `free()`
    /// values loses none.
    #[inline(always)]
    pub(crate) fn stage_all(&mut self, mut values: impl Iterator<Item = T>) -> usize {
        let free = self.free();
        let start = self.staged & self.ring.mask;
        // The free slots run from `start` to the end of the array, then
        // wrap to its front: two contiguous runs, each walked as a slice
        // (no per-value bounds check or reload of the ring's fields).
        let (back, front) = self.ring.slots().split_at(start);
        let first = front.len().min(free);
        let mut taken = 0;
        for run in [&front[..first], &back[..free - first]] {
            for cell in run {
                let Some(value) = values.next() else {
                    self.staged += taken;
                    return taken;
                };
                cell.with_mut(|slot| {
                    // SAFETY: as in `stage`: at most `free` slots past
                    // `staged` are written, all of them free (the consumer
                    // reads only up to the published tail), and only this
                    // producer writes them.
                    unsafe { (*slot).write(value) };
                });
                taken += 1;
            }
        }
        self.staged += taken;
        taken
    }

    /// Moves the first `n` routed items of `items` (at most the free slots)
    /// into the ring (step 1) and removes them from `items`; returns how
    /// many. The same as staging `items.drain(..n).map(|r| r.item)`, but
    /// the values are read off the deque's two contiguous runs in tight
    /// loops (a load and a store per item), and what is left to the deque
    /// is the removal of the moved-out items, which does nothing per item.
    #[inline]
    pub(crate) fn stage_front(&mut self, items: &mut VecDeque<Routed<T>>, n: usize) -> usize {
        let n = n.min(self.free()).min(items.len());
        let (a, b) = items.as_slices();
        let a = &a[..n.min(a.len())];
        let b = &b[..n - a.len()];
        // SAFETY: each value read here is moved, not copied: the maps are
        // lazy, so exactly the `taken` values that `stage_all` consumed are
        // read, once each, front first, and the first `taken` items are
        // then removed from `items` with `mem::forget`, so their originals
        // are never dropped or used again. Nothing between the reads and
        // the removal can unwind (slot writes, slice iteration, and the
        // drain of a range within `len`).
        let read = |r: &Routed<T>| unsafe { std::ptr::read(&r.item) };
        let taken = self.stage_all(a.iter().map(read)) + self.stage_all(b.iter().map(read));
        items.drain(..taken).for_each(std::mem::forget);
        taken
    }

    /// Publishes every staged value with one `Release` store (step 2).
    /// Returns the tail before publication when there was anything to publish.
    pub(crate) fn publish(&mut self) -> Option<usize> {
        if self.staged == self.published {
            return None;
        }
        let old = self.published;
        self.ring.tail.store(self.staged, Ordering::Release);
        self.published = self.staged;
        self.prefetch_free();
        Some(old)
    }

    /// Asks for write ownership of the lines of the next free slots (up to
    /// [`PREFETCH_BYTES`]), so that the next batch's slot writes do not
    /// queue in the store buffer behind a fetch of each line from the
    /// worker's cache, which last read them (stalling every store after
    /// them). Only free slots, which the worker has finished with, so no
    /// line it still has to read is taken from it. A hint: no effect on
    /// what any thread sees. Only where the CPU has `prefetchw` (without
    /// it, the intrinsic falls back to a read prefetch, which fetches the
    /// line shared and so does not help the write).
    #[inline]
    fn prefetch_free(&self) {
        #[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
        if self.prefetchw {
            let size = std::mem::size_of::<T>();
            if size == 0 {
                return;
            }
            let slots = self.ring.slots();
            let start = self.staged & self.ring.mask;
            let n = self
                .free()
                .min(PREFETCH_BYTES / size)
                .min(slots.len() - start);
            prefetch_for_write(slots[start..].as_ptr().cast(), n * size);
        }
    }

    /// One past the last published slot (the producer's own copy of `tail`).
    pub(crate) fn published(&self) -> usize {
        self.published
    }

    /// The consumer's position, loaded `Relaxed`; the wake-up protocol orders
    /// this load with a `SeqCst` fence of its own.
    pub(crate) fn consumer_position(&self) -> usize {
        self.ring.head.load(Ordering::Relaxed)
    }
}

/// Whether the CPU has `prefetchw` (CPUID leaf 0x8000_0001, ECX bit 8).
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
fn has_prefetchw() -> bool {
    use std::arch::x86_64::__cpuid;
    // Leaf 0x8000_0000 gives the highest extended leaf, checked before
    // leaf 0x8000_0001 is read.
    __cpuid(0x8000_0000).eax >= 0x8000_0001 && __cpuid(0x8000_0001).ecx & (1 << 8) != 0
}

/// Prefetches `bytes` bytes from `first` for writing (`prefetchw`); only
/// called where the CPU has the instruction (`Producer::prefetchw`).
#[cfg(all(target_arch = "x86_64", not(loom), not(miri)))]
#[inline]
fn prefetch_for_write(first: *const u8, bytes: usize) {
    let mut offset = 0;
    while offset < bytes {
        // SAFETY: `prefetchw` is a hint: it never faults, whatever the
        // address, and changes no memory and no register; the caller
        // checked that the CPU has it (`has_prefetchw`).
        unsafe {
            std::arch::asm!(
                "prefetchw [{0}]",
                in(reg) first.wrapping_add(offset),
                options(nostack, preserves_flags, readonly)
            );
        }
        offset += 64;
    }
}

impl<T> Drop for Producer<T> {
    fn drop(&mut self) {
        // Staged values are never abandoned: publish them so that the consumer
        // (or the ring's own drop) takes care of them.
        self.publish();
    }
}

impl<T> std::fmt::Debug for Producer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("capacity", &self.capacity())
            .field("published", &self.published)
            .field("staged", &self.staged)
            .finish()
    }
}

/// The reading end. `Send`, not `Sync`, not `Clone`.
pub(crate) struct Consumer<T> {
    ring: Arc<Ring<T>>,
    head: usize,
    cached_tail: usize,
    _not_sync: PhantomData<std::cell::Cell<()>>,
}

impl<T> Consumer<T> {
    /// Values ready to read, reloading the producer's tail (step 3).
    pub(crate) fn ready(&mut self) -> usize {
        self.cached_tail = self.ring.tail.load(Ordering::Acquire);
        self.cached_tail - self.head
    }

    /// Whether the ring is empty, reloading the tail only when the cached
    /// copy says so.
    pub(crate) fn is_empty(&mut self) -> bool {
        self.head == self.cached_tail && self.ready() == 0
    }

    /// Moves up to `max` published values out, front first, handing each to
    /// `f`, then frees their slots with one `Release` store (steps 3 and 4).
    /// Uses the tail seen by the last [`ready`](Self::ready) unless that
    /// showed nothing, so a caller that just called `ready` pays no reload.
    /// Returns how many were moved. Should `f` unwind, the values already
    /// moved out are freed and the rest stay in the ring.
    #[inline]
    pub(crate) fn pop_batch(&mut self, max: usize, mut f: impl FnMut(T)) -> usize {
        let mut ready = self.cached_tail - self.head;
        if ready == 0 {
            ready = self.ready();
        }
        let n = ready.min(max);
        if n == 0 {
            return 0;
        }
        let start = self.head & self.ring.mask;
        let ring: &Ring<T> = &self.ring;
        let mut guard = Release {
            ring,
            head: &mut self.head,
            next: 0,
        };
        guard.next = *guard.head;
        // Slots `head .. head + n` are two contiguous runs of the array
        // (the second after the wrap), each walked as a slice.
        let (back, front) = ring.slots().split_at(start);
        let first = front.len().min(n);
        for run in [&front[..first], &back[..n - first]] {
            for cell in run {
                let value = cell.with_mut(|slot| {
                    // SAFETY: the slot is one of `head .. head + n`, below
                    // the tail loaded with Acquire in step 3, so the
                    // producer wrote and published it; the producer does
                    // not write it again until `head` moves past it (step
                    // 4), and this single consumer reads it exactly once
                    // because `next` advances before anything can unwind.
                    unsafe { (*slot).assume_init_read() }
                });
                guard.next += 1;
                f(value);
            }
        }
        n
    }
}

/// Stores the consumer's new position on drop, so that an unwinding `f` in
/// [`Consumer::pop_batch`] never leaves read slots marked as full.
struct Release<'a, T> {
    ring: &'a Ring<T>,
    head: &'a mut usize,
    next: usize,
}

impl<T> Drop for Release<'_, T> {
    fn drop(&mut self) {
        *self.head = self.next;
        self.ring.head.store(self.next, Ordering::Release);
    }
}

impl<T> std::fmt::Debug for Consumer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("capacity", &(self.ring.mask + 1))
            .field("head", &self.head)
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn full_ring_returns_the_value_and_order_holds() {
        let (mut p, mut c) = ring::<u32>(3);
        assert_eq!(p.capacity(), 4);
        for i in 0..4 {
            p.stage(i).unwrap();
        }
        assert_eq!(p.stage(9), Err(9));
        assert!(c.is_empty(), "nothing is visible before publication");
        assert_eq!(p.publish(), Some(0));
        let mut seen = Vec::new();
        assert_eq!(c.pop_batch(3, |v| seen.push(v)), 3);
        assert_eq!(p.free(), 0, "stale head until refresh");
        assert_eq!(p.refresh(), 3);
        p.stage(4).unwrap();
        p.publish();
        assert_eq!(c.ready(), 2, "a reload sees the new tail");
        c.pop_batch(usize::MAX, |v| seen.push(v));
        assert_eq!(seen, [0, 1, 2, 3, 4]);
    }

    #[test]
    fn stage_all_takes_no_more_than_fits() {
        let (mut p, mut c) = ring::<u32>(4);
        let mut values = 0..10;
        assert_eq!(p.stage_all(&mut values), 4);
        assert_eq!(
            values.next(),
            Some(4),
            "nothing consumed beyond the free slots"
        );
        p.publish();
        let mut seen = Vec::new();
        c.pop_batch(2, |v| seen.push(v));
        p.refresh();
        assert_eq!(p.stage_all([7, 8, 9].into_iter()), 2);
        p.publish();
        c.pop_batch(usize::MAX, |v| seen.push(v));
        c.ready();
        c.pop_batch(usize::MAX, |v| seen.push(v));
        assert_eq!(seen, [0, 1, 2, 3, 7, 8]);
    }

    #[test]
    fn slot_zero_starts_a_line_pair() {
        for _ in 0..8 {
            let (p, _c) = ring::<u64>(1024);
            assert_eq!(p.ring.slots().as_ptr().addr() % 128, 0);
            assert_eq!(p.ring.slots().len(), 1024);
        }
        let (p, _c) = ring::<[u8; 3]>(4);
        assert_eq!(p.ring.slots().len(), 4);
    }

    #[test]
    fn stage_front_moves_each_item_once_across_the_wrap() {
        use crate::sink::Route;
        let marker = std::sync::Arc::new(());
        let (mut p, mut c) = ring(4);
        let routed = |v: usize| Routed {
            route: Route::LeastLoaded,
            item: (v, marker.clone()),
        };
        // A deque whose contents wrap: pop from the front, push at the back.
        let mut items: VecDeque<_> = VecDeque::with_capacity(4);
        items.extend((0..4).map(routed));
        items.drain(..3);
        items.extend((4..7).map(routed));
        assert_eq!(items.as_slices().1.len(), 3, "the deque wraps");
        assert_eq!(p.stage_front(&mut items, usize::MAX), 4);
        assert_eq!(items.len(), 0);
        p.publish();
        let mut seen = Vec::new();
        c.pop_batch(2, |(v, _)| seen.push(v));
        p.refresh();
        items.extend((7..10).map(routed));
        assert_eq!(p.stage_front(&mut items, 1), 1, "at most n");
        assert_eq!(
            p.stage_front(&mut items, usize::MAX),
            1,
            "at most the free slots"
        );
        assert_eq!(items.len(), 1);
        p.publish();
        c.pop_batch(usize::MAX, |(v, _)| seen.push(v));
        c.ready();
        c.pop_batch(usize::MAX, |(v, _)| seen.push(v));
        assert_eq!(seen, [3, 4, 5, 6, 7, 8]);
        drop(items);
        drop((p, c));
        assert_eq!(
            std::sync::Arc::strong_count(&marker),
            1,
            "no leak, no double drop"
        );
    }

    #[test]
    fn leftovers_are_dropped_once() {
        let marker = std::sync::Arc::new(());
        let (mut p, mut c) = ring(8);
        for _ in 0..5 {
            p.stage(marker.clone()).unwrap();
        }
        p.publish();
        c.pop_batch(2, drop);
        drop(p);
        drop(c);
        assert_eq!(std::sync::Arc::strong_count(&marker), 1);
    }

    #[test]
    fn unwinding_consumer_frees_what_it_took() {
        let marker = std::sync::Arc::new(());
        let (mut p, mut c) = ring(8);
        for _ in 0..4 {
            p.stage(marker.clone()).unwrap();
        }
        p.publish();
        let mut n = 0;
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            c.pop_batch(4, |_v| {
                n += 1;
                if n == 2 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        assert_eq!(c.ready(), 2);
        drop((p, c));
        assert_eq!(std::sync::Arc::strong_count(&marker), 1);
    }
}
