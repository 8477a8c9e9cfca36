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
//! 5. A consumer that excludes every other consumer (the caller of
//!    [`Ring::retain`]) may remove entries in place while producers go on.
//!    It reads `head` and takes `end = tail`: positions from `end` on are
//!    the producers' to fill, and none of them touches a slot of
//!    `head..end` (each holds the sequence `pos + 1` or is being filled,
//!    and only a consumer hands it back).
//! 6. It waits until every slot of `head..end` is published (sequence
//!    `pos + 1`): a producer that took one before step 5 is a few
//!    instructions from publishing it. One that never publishes (its
//!    process died inside the push) stops the ring for every consumer
//!    anyway: after the caller's patience, `end` becomes that position.
//! 7. Newest first, it moves each entry it keeps toward `end`, over the
//!    ones it removes (rdma-core's mlx5 cleans its CQ this way,
//!    `__mlx5_cq_clean`), so the kept entries keep their order.
//! 8. It hands the `n` slots freed at the front back to producers
//!    (sequence `pos + cap`, as in step 3), then moves `head` by `n`. The
//!    next consumer reads the moved entries after it takes over from this
//!    one (the lock that excludes consumers orders them); their sequences
//!    did not change.

use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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

    /// Remove, in place, every entry `keep` refuses, keeping the order of
    /// the others (steps 5–8); producers may push meanwhile. Waits up to
    /// `patience` for entries claimed by producers to be published; an
    /// entry still unpublished then, and every entry after it, is left as
    /// it is. Returns how many entries were removed.
    ///
    /// # Safety
    /// No other consumer pops from the ring (or calls this) until this
    /// returns: the caller holds whatever excludes them.
    pub unsafe fn retain(&self, mut keep: impl FnMut(&T) -> bool, patience: Duration) -> usize {
        let h = self.hdr();
        // Step 5.
        let head = h.head.load(Ordering::Acquire);
        let mut end = h.tail.load(Ordering::Acquire);
        // Step 6.
        let deadline = Instant::now() + patience;
        let mut spins = 0u32;
        let mut pos = head;
        while pos < end {
            // SAFETY: `slot` is in the mapped region; `seq` is only
            // accessed atomically.
            if unsafe { (*self.slot(pos)).seq.load(Ordering::Acquire) } == pos + 1 {
                pos += 1;
                continue;
            }
            if Instant::now() >= deadline {
                end = pos;
                break;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // Step 7.
        let mut removed = 0u64;
        for pos in (head..end).rev() {
            let s = self.slot(pos);
            // SAFETY: step 6 saw the slot published (Acquire), so its
            // value is written; no producer writes it before step 8 hands
            // it back, and the caller excludes other consumers.
            let v = unsafe { std::ptr::addr_of!((*s).val).read() };
            if !keep(&v) {
                removed += 1;
            } else if removed > 0 {
                let to = self.slot(pos + removed);
                // SAFETY: `pos + removed` < `end`: a published slot of
                // `head..end`, which only this consumer touches (as above).
                unsafe { std::ptr::addr_of_mut!((*to).val).write(v) };
            }
        }
        // Step 8.
        for pos in head..head + removed {
            // SAFETY: a slot of `head..end` whose entry was removed or moved
            // toward `end` in step 7; handed to the producer one lap later.
            unsafe {
                (*self.slot(pos))
                    .seq
                    .store(pos + self.mask + 1, Ordering::Release)
            };
        }
        h.head.store(head + removed, Ordering::Release);
        removed as usize
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
    fn retain_removes_in_place_and_keeps_the_order() {
        let mut b = Box::new(Buf([0; 4096]));
        // SAFETY: the buffer is aligned, large enough for 8 u64 slots, ours alone.
        let r = unsafe { Ring::<u64>::init(b.0.as_mut_ptr(), 8) };
        for lap in 0..3u64 {
            // Wrap around: some laps start mid-ring.
            for i in 0..lap {
                r.push(100 + i).unwrap();
                assert_eq!(r.pop(), Some(100 + i));
            }
            for i in 0..8 {
                r.push(i).unwrap();
            }
            // SAFETY: this thread is the only consumer.
            let n = unsafe { r.retain(|&v| v % 3 != 0, Duration::ZERO) };
            assert_eq!(n, 3, "0, 3 and 6 removed");
            assert_eq!(r.len(), 5);
            // The freed slots take new entries, after the kept ones.
            for v in 20..23 {
                r.push(v).unwrap();
            }
            assert_eq!(r.push(99), Err(99), "full again: 8 entries");
            let got: Vec<u64> = std::iter::from_fn(|| r.pop()).collect();
            assert_eq!(got, vec![1, 2, 4, 5, 7, 20, 21, 22]);
        }
        // Nothing to remove, and an empty ring.
        r.push(1).unwrap();
        // SAFETY: as above.
        assert_eq!(unsafe { r.retain(|_| true, Duration::ZERO) }, 0);
        assert_eq!(r.pop(), Some(1));
        // SAFETY: as above.
        assert_eq!(unsafe { r.retain(|_| false, Duration::ZERO) }, 0);
        assert!(r.pop().is_none());
    }

    /// A slot a producer claimed and never published (its process died
    /// inside the push): after the patience, what lies before it is
    /// cleaned and the rest is left as it is.
    #[test]
    fn retain_stops_at_a_slot_never_published() {
        let mut b = Box::new(Buf([0; 4096]));
        // SAFETY: the buffer is aligned, large enough for 8 u64 slots, ours alone.
        let r = unsafe { Ring::<u64>::init(b.0.as_mut_ptr(), 8) };
        r.push(1).unwrap();
        r.push(2).unwrap();
        // A producer takes position 2 and stops there.
        r.hdr().tail.fetch_add(1, Ordering::Relaxed);
        r.push(3).unwrap();
        // SAFETY: this thread is the only consumer.
        let n = unsafe { r.retain(|&v| v == 2, Duration::from_millis(5)) };
        assert_eq!(n, 1, "1 removed; 3, beyond the gap, is not looked at");
        assert_eq!(r.pop(), Some(2));
        assert_eq!(r.pop(), None, "the gap stops the consumer, as before");
    }

    /// Producers push while the only consumer pops and removes one
    /// producer's entries once that producer stopped: every other entry
    /// comes out exactly once, in each producer's order.
    #[test]
    fn retain_with_producers_pushing_keeps_every_other_entry_in_order() {
        let mut b = Box::new(Buf([0; 4096]));
        // SAFETY: as above; the threads are scoped and end before `b`.
        let r = unsafe { Ring::<u64>::init(b.0.as_mut_ptr(), 16) };
        const ITEMS: u64 = if cfg!(miri) { 100 } else { 5_000 };
        const GONE: u64 = 2;
        let gone_done = std::sync::atomic::AtomicBool::new(false);
        let mut got = Vec::new();
        std::thread::scope(|s| {
            for t in 0..=GONE {
                let (r, gone_done) = (&r, &gone_done);
                s.spawn(move || {
                    let n = if t == GONE { 8 } else { ITEMS };
                    for i in 0..n {
                        let mut v = t << 32 | i;
                        while let Err(back) = r.push(v) {
                            v = back;
                            std::thread::yield_now();
                        }
                    }
                    if t == GONE {
                        gone_done.store(true, Ordering::Release);
                    }
                });
            }
            let mut cleaned = false;
            while got.len() < 2 * ITEMS as usize {
                if !cleaned && gone_done.load(Ordering::Acquire) {
                    // SAFETY: this thread is the ring's only consumer.
                    unsafe { r.retain(|&v| v >> 32 != GONE, Duration::from_secs(1)) };
                    cleaned = true;
                }
                match r.pop() {
                    Some(v) if v >> 32 == GONE => {
                        assert!(!cleaned, "an entry of the stopped producer after the clean");
                    }
                    Some(v) => got.push(v),
                    None => std::thread::yield_now(),
                }
            }
        });
        for t in 0..GONE {
            let mine: Vec<u64> = got
                .iter()
                .filter(|&&v| v >> 32 == t)
                .map(|&v| v & 0xffff_ffff)
                .collect();
            assert_eq!(mine, (0..ITEMS).collect::<Vec<_>>(), "producer {t}");
        }
        drop(b);
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
