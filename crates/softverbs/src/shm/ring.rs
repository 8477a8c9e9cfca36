//! A bounded multi-producer multi-consumer ring laid out in shared memory
//! (D. Vyukov's sequence-numbered queue), usable across processes.
//!
//! Protocol, for a ring of capacity `cap` (a power of two):
//! 1. Every slot holds a sequence number; initially slot `i` holds `i`.
//! 2. A producer at position `pos` may fill slot `pos & mask` when its
//!    sequence equals `pos`: it claims `pos` by CAS on `tail`, writes the
//!    payload, then stores `pos + 1` (Release).
//! 3. A consumer at `pos` may read when the sequence equals `pos + 1`: it
//!    claims `pos` by CAS on `head`, reads the payload, then stores
//!    `pos + cap` (Release), handing the slot to the producer one lap later.
//! 4. A producer that sees a sequence below `pos` finds the ring full; a
//!    consumer that sees one below `pos + 1` finds it empty.

use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering};

/// Ring header, in the segment (cache-line separated indices).
#[repr(C, align(64))]
#[derive(Debug)]
pub struct RingHeader {
    cap: u64,
    _p0: [u64; 7],
    head: AtomicU64,
    _p1: [u64; 7],
    tail: AtomicU64,
    _p2: [u64; 7],
}

impl RingHeader {
    /// Initialise (creator only, before anybody else sees it).
    pub(crate) fn init(&mut self, cap: u64) {
        self.cap = cap;
        self.head.store(0, Ordering::Relaxed);
        self.tail.store(0, Ordering::Relaxed);
    }

    /// Capacity as written at creation.
    pub(crate) fn cap(&self) -> u64 {
        self.cap
    }

    /// The consumers' index.
    pub(crate) fn head(&self) -> &AtomicU64 {
        &self.head
    }

    /// The producers' index.
    pub(crate) fn tail(&self) -> &AtomicU64 {
        &self.tail
    }
}

#[repr(C)]
struct Slot<T> {
    seq: AtomicU64,
    val: T,
}

/// A view of a ring living at a fixed address.
#[derive(Debug)]
pub struct Ring<T: Copy> {
    hdr: *const RingHeader,
    slots: *mut u8,
    mask: u64,
    _t: PhantomData<T>,
}

// SAFETY: the ring is only accessed through the atomic protocol above; the
// payload type is `Copy` plain data. The memory outlives the view (callers
// keep the owning Segment alive alongside).
unsafe impl<T: Copy + Send> Send for Ring<T> {}
// SAFETY: as above; all shared mutation goes through atomics.
unsafe impl<T: Copy + Send> Sync for Ring<T> {}

impl<T: Copy> Ring<T> {
    /// Bytes a ring of `cap` slots needs.
    pub fn bytes(cap: usize) -> usize {
        size_of::<RingHeader>() + cap * size_of::<Slot<T>>()
    }

    /// Round a requested depth up to a usable capacity: a power of two,
    /// at least 2. With one slot the protocol breaks: the sequence a full
    /// slot holds for its consumer (`pos + 1`) is the one that frees it for
    /// the next producer, so a second push would overwrite an entry nobody
    /// read, and a consumer would then spin forever on a sequence two
    /// ahead of it.
    pub fn capacity_for(depth: usize) -> usize {
        depth.max(2).next_power_of_two()
    }

    /// Initialise a ring of `cap` (power of two, at least 2: see
    /// [`Ring::capacity_for`]) slots at `at`.
    ///
    /// # Safety
    /// 1. `at` is 64-byte aligned, writable, and [`Ring::bytes`]`(cap)` long.
    /// 2. No other view of this memory is in use during initialisation.
    /// 3. The memory outlives every view made from it.
    pub unsafe fn init(at: *mut u8, cap: usize) -> Self {
        assert!(
            cap >= 2 && cap.is_power_of_two(),
            "ring capacity {cap}: a power of two of at least 2"
        );
        let hdr = at.cast::<RingHeader>();
        // SAFETY: (1) the header fits at `at`; (2) nobody else reads it yet.
        unsafe {
            (*hdr).cap = cap as u64;
            (*hdr).head.store(0, Ordering::Relaxed);
            (*hdr).tail.store(0, Ordering::Relaxed);
        }
        // SAFETY: (1) the slots follow the header within the region.
        let slots = unsafe { at.add(size_of::<RingHeader>()) };
        for i in 0..cap {
            // SAFETY: slot `i` is within the region (1), exclusively ours (2).
            unsafe {
                (*slots.cast::<Slot<T>>().add(i))
                    .seq
                    .store(i as u64, Ordering::Release)
            };
        }
        Self {
            hdr,
            slots,
            mask: cap as u64 - 1,
            _t: PhantomData,
        }
    }

    /// View an initialised ring at `at`, checking it fits in `avail` bytes.
    ///
    /// # Safety
    /// 1. `at` points to a ring made by [`Ring::init`] for the same `T`, or to
    ///    memory another process initialised that way.
    /// 2. The memory outlives the view.
    pub unsafe fn attach(at: *mut u8, avail: usize) -> Option<Self> {
        if avail < size_of::<RingHeader>() {
            return None;
        }
        let hdr = at.cast::<RingHeader>();
        // SAFETY: (1) the header is initialised and within `avail`.
        let cap = unsafe { (*hdr).cap };
        if cap < 2 || !cap.is_power_of_two() || Self::bytes(cap as usize) > avail {
            return None;
        }
        // SAFETY: the slots follow the header within `avail` (checked above).
        let slots = unsafe { at.add(size_of::<RingHeader>()) };
        Some(Self {
            hdr,
            slots,
            mask: cap - 1,
            _t: PhantomData,
        })
    }

    /// Capacity in entries.
    pub fn capacity(&self) -> usize {
        self.mask as usize + 1
    }

    fn hdr(&self) -> &RingHeader {
        // SAFETY: the header stays mapped for the life of the view (init/attach contract).
        unsafe { &*self.hdr }
    }

    fn slot(&self, pos: u64) -> *mut Slot<T> {
        // SAFETY: `pos & mask` < capacity, so the slot lies in the region.
        unsafe { self.slots.cast::<Slot<T>>().add((pos & self.mask) as usize) }
    }

    /// Append `v`; `Err(v)` when the ring is full.
    ///
    /// # Errors
    /// Returns the value back when full.
    pub fn push(&self, v: T) -> Result<(), T> {
        self.push_with(v, || {})
    }

    /// [`Ring::push`], calling `before_publish` once the entry is written
    /// but before consumers can see it (step 2), and only if it is pushed.
    /// A process that dies inside leaves the slot unpublished.
    ///
    /// # Errors
    /// Returns the value back when full (`before_publish` not called).
    pub fn push_with(&self, v: T, before_publish: impl FnOnce()) -> Result<(), T> {
        let h = self.hdr();
        let mut pos = h.tail.load(Ordering::Relaxed);
        loop {
            let s = self.slot(pos);
            // SAFETY: `s` is a valid slot; `seq` is only accessed atomically.
            let seq = unsafe { (*s).seq.load(Ordering::Acquire) };
            let dif = seq.wrapping_sub(pos) as i64;
            if dif == 0 {
                match h.tail.compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: step 2: the CAS gave us exclusive use of the
                        // slot until we publish `pos + 1`.
                        unsafe { std::ptr::addr_of_mut!((*s).val).write(v) };
                        before_publish();
                        // SAFETY: as above.
                        unsafe { (*s).seq.store(pos + 1, Ordering::Release) };
                        return Ok(());
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                return Err(v);
            } else {
                pos = h.tail.load(Ordering::Relaxed);
            }
        }
    }

    /// Remove the oldest entry, if any.
    pub fn pop(&self) -> Option<T> {
        let h = self.hdr();
        let mut pos = h.head.load(Ordering::Relaxed);
        loop {
            let s = self.slot(pos);
            // SAFETY: valid slot; atomic access.
            let seq = unsafe { (*s).seq.load(Ordering::Acquire) };
            let dif = seq.wrapping_sub(pos + 1) as i64;
            if dif == 0 {
                match h.head.compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        // SAFETY: step 3: the slot is published (Acquire above)
                        // and claimed by our CAS; we hand it back after reading.
                        let v = unsafe { std::ptr::addr_of!((*s).val).read() };
                        // SAFETY: as above.
                        unsafe { (*s).seq.store(pos + self.mask + 1, Ordering::Release) };
                        return Some(v);
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                return None;
            } else {
                pos = h.head.load(Ordering::Relaxed);
            }
        }
    }

    /// Entries in the ring (a racy snapshot: claimed slots count as filled).
    pub fn len(&self) -> usize {
        let h = self.hdr();
        let head = h.head.load(Ordering::Acquire);
        h.tail.load(Ordering::Acquire).saturating_sub(head) as usize
    }

    /// Whether the ring looks empty (a racy hint).
    pub fn is_empty(&self) -> bool {
        let h = self.hdr();
        h.head.load(Ordering::Acquire) >= h.tail.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C, align(64))]
    struct Buf([u8; 4096]);

    #[test]
    fn fifo_full_empty() {
        let mut b = Box::new(Buf([0; 4096]));
        // SAFETY: the buffer is aligned, large enough for 8 u64 slots, ours alone.
        let r = unsafe { Ring::<u64>::init(b.0.as_mut_ptr(), 8) };
        assert!(r.pop().is_none());
        for i in 0..8 {
            assert!(r.push(i).is_ok());
        }
        assert_eq!(r.push(99), Err(99));
        assert_eq!(r.len(), 8);
        for i in 0..8 {
            assert_eq!(r.pop(), Some(i));
        }
        assert!(r.pop().is_none());
        for lap in 0..100u64 {
            assert!(r.push(lap).is_ok());
            assert_eq!(r.pop(), Some(lap));
        }
    }

    /// Regression (found by the `softverbs_wr` fuzz target): a depth of 1
    /// made a one-slot ring, whose second push overwrote the unread first
    /// entry (a receive WQE or a CQE lost) and whose consumer then spun
    /// forever. A depth of 1 now gets two slots; a one-slot header found in
    /// a segment is refused.
    #[test]
    fn a_depth_of_one_keeps_every_entry() {
        let mut b = Box::new(Buf([0; 4096]));
        let cap = Ring::<u64>::capacity_for(1);
        assert_eq!(cap, 2);
        assert_eq!(Ring::<u64>::capacity_for(0), 2);
        // SAFETY: the buffer is aligned, large enough, ours alone.
        let r = unsafe { Ring::<u64>::init(b.0.as_mut_ptr(), cap) };
        assert_eq!(r.push(1), Ok(()));
        assert_eq!(r.push(2), Ok(()));
        assert_eq!(r.push(3), Err(3), "full, nothing overwritten");
        assert_eq!((r.pop(), r.pop(), r.pop()), (Some(1), Some(2), None));
        // A header claiming one slot (another process's bad segment).
        // SAFETY: the header is ours; cap is plain data.
        unsafe { (*b.0.as_mut_ptr().cast::<RingHeader>()).cap = 1 };
        // SAFETY: initialised memory of the right type, alive.
        assert!(unsafe { Ring::<u64>::attach(b.0.as_mut_ptr(), 4096) }.is_none());
    }

    #[test]
    fn threads_preserve_every_item() {
        let mut b = Box::new(Buf([0; 4096]));
        // SAFETY: as above; the threads are scoped and end before `b`.
        let r = unsafe { Ring::<u64>::init(b.0.as_mut_ptr(), 16) };
        // Miri runs every interleaving it picks slowly: fewer items there.
        const ITEMS: u64 = if cfg!(miri) { 200 } else { 10_000 };
        let sum = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|s| {
            for t in 0..2 {
                let r = &r;
                s.spawn(move || {
                    for i in 0..ITEMS {
                        let mut v = t * 100_000 + i;
                        while let Err(back) = r.push(v) {
                            v = back;
                            std::thread::yield_now();
                        }
                    }
                });
            }
            let (r, sum) = (&r, &sum);
            s.spawn(move || {
                let mut n = 0;
                while n < 2 * ITEMS {
                    if let Some(v) = r.pop() {
                        sum.fetch_add(v, Ordering::Relaxed);
                        n += 1;
                    } else {
                        std::thread::yield_now();
                    }
                }
            });
        });
        let expect: u64 = (0..ITEMS).sum::<u64>() * 2 + 100_000 * ITEMS;
        assert_eq!(sum.load(Ordering::Relaxed), expect);
        drop(b);
    }
}
