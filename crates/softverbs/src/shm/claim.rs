//! The receive queue of a QP or SRQ: a bounded ring in shared memory
//! whose entries are *claimed* by the requester that consumes them and
//! freed only when that requester completed them, so that a receive taken
//! by a requester that dies before completing it is never lost.
//!
//! The ring is D. Vyukov's sequence-numbered queue ([`super::ring`]) with
//! one more word per slot, the *claim word*:
//!
//! 1. A producer (the owner's `post_recv`) at position `pos` waits for the
//!    slot's sequence to be `pos`, takes `pos` by CAS on `tail`, writes the
//!    WQE, stores the claim word `pos + 1` ("free at this lap"), then the
//!    sequence `pos + 1` (Release).
//! 2. A consumer (a requester taking a receive, or the owner flushing it)
//!    finds a slot whose sequence is `pos + 1` and claims it by **CAS of the
//!    claim word from `pos + 1` to its claim token** ([`Token`], in
//!    [`super::claimer`]: bit 63
//!    set, the claimer's pid, the start time of its process and the QPN the
//!    receive is taken for). The CAS is the claim: exactly one consumer
//!    wins it, and the winner's identity is in shared memory from that
//!    instant on. `head` is then advanced past `pos` — by the claimer or by
//!    any consumer that finds `pos` claimed (so a claimer dying between
//!    the two steps stops nobody).
//! 3. The slot keeps its WQE and its sequence `pos + 1` while claimed.
//!    The ring has twice the queue's depth in slots, so that the owner,
//!    which may post again as soon as it polled a completion (before the
//!    claimer's release below), finds a free slot: a push is refused when
//!    `depth` receives wait unclaimed (`tail - head`), as before, and only
//!    waits for a slot when a live claimer is a whole extra depth behind.
//! 4. The claimer completes the receive and **releases** the slot
//!    (sequence `pos + slots`, handing it to the producer one lap later)
//!    *inside* the push of its CQE: after writing the CQE into the CQ
//!    ring, before publishing it (`CqPort::push_with`). So no completion
//!    is ever visible while its claim is still held: a claimer that dies
//!    before the release has published nothing, and one that dies after
//!    it has nothing left to flush. (Dying between the two, like dying
//!    anywhere inside a CQ push, leaves that CQ slot unpublished and the
//!    CQ stuck — a hazard of the CQ ring that this protocol does not add.)
//! 5. Whoever flushes the queue (its QP went to the error state) walks the
//!    positions that may be in use, oldest first, and claims, completes
//!    and releases (a) every free slot and (b) every slot claimed by a
//!    process that is **proven dead** ([`Token::claimer_dead`]), taking
//!    the claim over by CAS of the claim word from the dead token to its
//!    own. A claim by a live process is left to it: its completion is
//!    the only one. Two flushers (the owner and a requester that moved
//!    the QP to error) race on the same CAS, so each receive completes
//!    exactly once, in posting order.
//!
//! The claim word values are unique per lap (`pos + 1` is written for one
//! lap only, and a token only replaces it by CAS), so a consumer that read
//! a slot a lap ago can never claim it by mistake (no ABA).

use std::marker::PhantomData;
use std::mem::size_of;
use std::sync::atomic::{AtomicU64, Ordering};

pub use super::claimer::Token;
use super::ring::RingHeader;

#[repr(C)]
struct Slot<T> {
    seq: AtomicU64,
    claim: AtomicU64,
    val: T,
}

/// The two atomic words of a slot.
struct SlotWords<'a> {
    seq: &'a AtomicU64,
    claim: &'a AtomicU64,
}

/// A receive taken from a [`ClaimRing`]: the WQE and the position to
/// release once its completion is written.
#[derive(Debug, Clone, Copy)]
pub struct Claimed<T> {
    /// Position in the ring.
    pub pos: u64,
    /// The WQE.
    pub val: T,
}

/// A view of a claim ring living at a fixed address.
#[derive(Debug)]
pub struct ClaimRing<T: Copy> {
    hdr: *const RingHeader,
    slots: *mut u8,
    mask: u64,
    _t: PhantomData<T>,
}

// SAFETY: the ring is only accessed through the atomic protocol above; the
// payload type is `Copy` plain data. The memory outlives the view (callers
// keep the owning Segment alive alongside).
unsafe impl<T: Copy + Send> Send for ClaimRing<T> {}
// SAFETY: as above; all shared mutation goes through atomics.
unsafe impl<T: Copy + Send> Sync for ClaimRing<T> {}

impl<T: Copy> ClaimRing<T> {
    /// Bytes a ring of depth `cap` needs (`2 × cap` slots, step 3).
    pub fn bytes(cap: usize) -> usize {
        size_of::<RingHeader>() + 2 * cap * size_of::<Slot<T>>()
    }

    /// Round a requested depth up to a usable capacity (a power of two of
    /// at least 2, as [`super::ring::Ring::capacity_for`]).
    pub fn capacity_for(depth: usize) -> usize {
        depth.max(2).next_power_of_two()
    }

    /// Initialise a ring of depth `cap` (power of two, at least 2) at `at`.
    ///
    /// # Safety
    /// 1. `at` is 64-byte aligned, writable, and [`ClaimRing::bytes`]`(cap)` long.
    /// 2. No other view of this memory is in use during initialisation.
    /// 3. The memory outlives every view made from it.
    pub unsafe fn init(at: *mut u8, cap: usize) -> Self {
        assert!(
            cap >= 2 && cap.is_power_of_two(),
            "ring capacity {cap}: a power of two of at least 2"
        );
        let hdr = at.cast::<RingHeader>();
        let phys = 2 * cap;
        // SAFETY: (1) the header fits at `at`; (2) nobody else reads it yet.
        unsafe { (*hdr).init(phys as u64) };
        // SAFETY: (1) the slots follow the header within the region.
        let slots = unsafe { at.add(size_of::<RingHeader>()) };
        for i in 0..phys {
            // SAFETY: slot `i` is within the region (1), exclusively ours (2).
            unsafe {
                let s = &*slots.cast::<Slot<T>>().add(i);
                s.claim.store(0, Ordering::Relaxed);
                s.seq.store(i as u64, Ordering::Release);
            }
        }
        Self {
            hdr,
            slots,
            mask: phys as u64 - 1,
            _t: PhantomData,
        }
    }

    /// View an initialised ring at `at`, checking it fits in `avail` bytes.
    ///
    /// # Safety
    /// 1. `at` points to a ring made by [`ClaimRing::init`] for the same `T`,
    ///    or to memory another process initialised that way.
    /// 2. The memory outlives the view.
    pub unsafe fn attach(at: *mut u8, avail: usize) -> Option<Self> {
        if avail < size_of::<RingHeader>() {
            return None;
        }
        let hdr = at.cast::<RingHeader>();
        // SAFETY: (1) the header is initialised and within `avail`.
        let phys = unsafe { (*hdr).cap() };
        if phys < 4 || !phys.is_power_of_two() || Self::bytes(phys as usize / 2) > avail {
            return None;
        }
        // SAFETY: the slots follow the header within `avail` (checked above).
        let slots = unsafe { at.add(size_of::<RingHeader>()) };
        Some(Self {
            hdr,
            slots,
            mask: phys - 1,
            _t: PhantomData,
        })
    }

    /// The queue's depth: receives that may wait unclaimed.
    pub fn capacity(&self) -> usize {
        (self.slots() / 2) as usize
    }

    fn slots(&self) -> u64 {
        self.mask + 1
    }

    fn hdr(&self) -> &RingHeader {
        // SAFETY: the header stays mapped for the life of the view (init/attach contract).
        unsafe { &*self.hdr }
    }

    fn slot_ptr(&self, pos: u64) -> *mut Slot<T> {
        // SAFETY: `pos & mask` < the number of slots, so the slot lies in
        // the region.
        unsafe { self.slots.cast::<Slot<T>>().add((pos & self.mask) as usize) }
    }

    /// The atomic words of the slot of `pos` (never a reference to the
    /// whole slot: its value is written through a raw pointer).
    fn words(&self, pos: u64) -> SlotWords<'_> {
        let p = self.slot_ptr(pos);
        // SAFETY: the slot is in the mapped region for the life of the
        // view; its two words are only ever accessed atomically.
        unsafe {
            SlotWords {
                seq: &*std::ptr::addr_of!((*p).seq),
                claim: &*std::ptr::addr_of!((*p).claim),
            }
        }
    }

    fn val(&self, pos: u64) -> T {
        let p = self.slot_ptr(pos);
        // SAFETY: called by the holder of the claim of `pos` (or a
        // consumer that saw the sequence `pos + 1` with Acquire): the
        // producer finished writing before publishing, and nobody writes
        // the value again before the slot is released.
        unsafe { std::ptr::addr_of!((*p).val).read() }
    }

    /// Append `v` (step 1); `Err(v)` when [`ClaimRing::capacity`]
    /// entries wait unclaimed, or when the slot is still held a whole
    /// extra depth behind by a claimer that is dead or does not release it
    /// within a second (step 3).
    ///
    /// # Errors
    /// Returns the value back when full.
    pub fn push(&self, v: T) -> Result<(), T> {
        let h = self.hdr();
        let mut pos = h.tail().load(Ordering::Relaxed);
        let mut deadline = None;
        loop {
            if pos.saturating_sub(h.head().load(Ordering::Acquire)) >= self.capacity() as u64 {
                return Err(v);
            }
            let s = self.words(pos);
            let seq = s.seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos) as i64;
            if dif == 0 {
                match h.tail().compare_exchange_weak(
                    pos,
                    pos + 1,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                ) {
                    Ok(_) => {
                        let p = self.slot_ptr(pos);
                        // SAFETY: step 1: the CAS gave us exclusive use of
                        // the slot until we publish `pos + 1`.
                        unsafe { std::ptr::addr_of_mut!((*p).val).write(v) };
                        s.claim.store(pos + 1, Ordering::Relaxed);
                        s.seq.store(pos + 1, Ordering::Release);
                        return Ok(());
                    }
                    Err(p) => pos = p,
                }
            } else if dif < 0 {
                // The slot's previous lap is still claimed: wait for a live
                // claimer's release (it is past its completion by now).
                let holder = Token::from_word(s.claim.load(Ordering::Acquire));
                if holder.is_none_or(Token::claimer_dead) {
                    return Err(v);
                }
                let end = *deadline.get_or_insert_with(|| {
                    std::time::Instant::now() + std::time::Duration::from_secs(1)
                });
                if std::time::Instant::now() >= end {
                    return Err(v);
                }
                std::thread::yield_now();
                pos = h.tail().load(Ordering::Relaxed);
            } else {
                pos = h.tail().load(Ordering::Relaxed);
            }
        }
    }

    /// Move `head` past `pos` if it is still there (any consumer may: `pos`
    /// is claimed).
    fn help_head(&self, pos: u64) {
        let _ =
            self.hdr()
                .head()
                .compare_exchange(pos, pos + 1, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Claim the oldest free entry for `token` (step 2), if any.
    pub fn claim(&self, token: Token) -> Option<Claimed<T>> {
        let h = self.hdr();
        let mut pos = h.head().load(Ordering::Acquire);
        loop {
            let s = self.words(pos);
            let seq = s.seq.load(Ordering::Acquire);
            let dif = seq.wrapping_sub(pos + 1) as i64;
            if dif == 0 {
                match s.claim.compare_exchange(
                    pos + 1,
                    token.word(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => {
                        let val = self.val(pos);
                        self.help_head(pos);
                        return Some(Claimed { pos, val });
                    }
                    // Claimed by someone else at this lap, or already
                    // released and refilled: `pos` is taken either way.
                    Err(_) => {
                        self.help_head(pos);
                        pos += 1;
                    }
                }
            } else if dif < 0 {
                // Empty at `pos`, or still claimed from the lap before
                // (not released: nothing was produced at `pos`).
                return None;
            } else {
                // Released (and maybe reused) since: `pos` was consumed.
                self.help_head(pos);
                let now = h.head().load(Ordering::Acquire);
                pos = if now > pos { now } else { pos + 1 };
            }
        }
    }

    /// Release the claimed position `pos` (step 4): only its claimer, or
    /// the flusher that took the claim over, calls this, once.
    pub fn release(&self, pos: u64) {
        self.words(pos)
            .seq
            .store(pos + self.slots(), Ordering::Release);
    }

    /// Flush (step 5): oldest first, claim for `token` every entry for
    /// which `take` says so — given `None` for a free entry, or the token
    /// of the process holding it when that process is proven dead — and
    /// call `f` with its WQE and a function releasing it, to be called
    /// once the flush completion is written but before it is published
    /// (`CqPort::push_with`); it is released after `f` otherwise. Returns
    /// how many were flushed. Claims of live processes are left to them.
    pub fn flush(
        &self,
        token: Token,
        take: impl Fn(Option<Token>) -> bool,
        mut f: impl FnMut(T, &dyn Fn()),
    ) -> usize {
        let tail = self.hdr().tail().load(Ordering::Acquire);
        let mut n = 0;
        // A claimed slot is at most one lap behind `tail`: the producer
        // cannot pass it before it is released.
        for pos in tail.saturating_sub(self.slots())..tail {
            let s = self.words(pos);
            if s.seq.load(Ordering::Acquire) != pos + 1 {
                continue;
            }
            let cur = s.claim.load(Ordering::Acquire);
            let holder = Token::from_word(cur);
            let ours = match holder {
                None if cur == pos + 1 => take(None),
                None => false,
                Some(t) if t == token => false,
                Some(t) => take(Some(t)) && t.claimer_dead(),
            };
            if !ours
                || s.claim
                    .compare_exchange(cur, token.word(), Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
            {
                continue;
            }
            self.help_head(pos);
            let done = std::cell::Cell::new(false);
            let release = || {
                if !done.replace(true) {
                    self.release(pos);
                }
            };
            f(self.val(pos), &release);
            release();
            n += 1;
        }
        n
    }

    /// Entries waiting to be claimed (a racy snapshot).
    pub fn len(&self) -> usize {
        let h = self.hdr();
        let head = h.head().load(Ordering::Acquire);
        h.tail().load(Ordering::Acquire).saturating_sub(head) as usize
    }

    /// Whether nothing waits to be claimed (a racy hint).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Where [`stall_hook`] may stop a requester.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StallAt {
    /// Right after claiming a receive (`SOFTVERBS_TEST_STALL_AFTER_CLAIM=1`).
    Claim,
    /// Right after publishing a receive's completion
    /// (`SOFTVERBS_TEST_STALL_AFTER_CLAIM=complete`).
    Complete,
}

/// A test-only fault hook: with `SOFTVERBS_TEST_STALL_AFTER_CLAIM` in its
/// environment (read once per process) set to `1`, a requester that has
/// just claimed a receive — set to `complete`, one that has just published
/// a receive's completion — stops itself (`SIGSTOP`, which its parent sees
/// with `waitpid(WUNTRACED)`) and, if continued, sleeps for ever, so that a
/// test can kill it at exactly that point (tests/taken_receives.rs).
/// Nothing else reads the variable.
pub fn stall_hook(at: StallAt) {
    static STALL: std::sync::OnceLock<Option<StallAt>> = std::sync::OnceLock::new();
    let stall = *STALL.get_or_init(|| {
        match std::env::var_os("SOFTVERBS_TEST_STALL_AFTER_CLAIM")?.to_str()? {
            "1" => Some(StallAt::Claim),
            "complete" => Some(StallAt::Complete),
            _ => None,
        }
    });
    if stall == Some(at) {
        // SAFETY: raising a signal at ourselves has no memory effects.
        unsafe { libc::raise(libc::SIGSTOP) };
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C, align(64))]
    struct Buf([u8; 8192]);

    fn ring(b: &mut Buf, cap: usize) -> ClaimRing<u64> {
        assert!(ClaimRing::<u64>::bytes(cap) <= b.0.len());
        // SAFETY: aligned, large enough (checked), ours alone.
        unsafe { ClaimRing::<u64>::init(b.0.as_mut_ptr(), cap) }
    }

    #[test]
    fn claims_hold_slots_until_released() {
        let mut b = Box::new(Buf([0; 8192]));
        let r = ring(&mut b, 2);
        assert_eq!(r.capacity(), 2);
        let me = Token::mine(1);
        // pid 0 names no process: a dead claimer.
        let dead = Token::of(0, 1, 1);
        assert!(r.claim(me).is_none());
        r.push(10).unwrap();
        r.push(11).unwrap();
        assert_eq!(r.push(12), Err(12), "two wait unclaimed: the depth");
        let a = r.claim(dead).unwrap();
        assert_eq!((a.pos, a.val), (0, 10));
        assert_eq!(r.len(), 1);
        // The owner may post again before the claimer's release.
        r.push(12).unwrap();
        let c = r.claim(me).unwrap();
        assert_eq!(c.val, 11);
        r.push(13).unwrap();
        // Slot 0 comes round again while still claimed by the dead
        // claimer: refused at once, not overwritten.
        let d = r.claim(me).unwrap();
        assert_eq!(d.val, 12);
        assert_eq!(r.push(14), Err(14), "slot 0 still held");
        r.release(a.pos);
        r.push(14).unwrap();
        r.release(c.pos);
        r.release(d.pos);
        assert_eq!(r.claim(me).map(|c| c.val), Some(13));
        assert_eq!(r.claim(me).map(|c| c.val), Some(14));
        assert!(r.claim(me).is_none());
    }

    #[test]
    fn flush_takes_free_and_dead_claims_in_order_and_leaves_live_ones() {
        let mut b = Box::new(Buf([0; 8192]));
        let r = ring(&mut b, 8);
        for v in 1..=5 {
            r.push(v).unwrap();
        }
        // Slot 0: claimed by a process that cannot exist (pid 0 is never a
        // user process: /proc/0 does not exist).
        let dead = Token::of(0, 1, 9);
        let d = r.claim(dead).unwrap();
        assert_eq!(d.val, 1);
        // Slot 1: claimed by a live process (a thread of ours under
        // another QPN, so not the flusher's own token).
        let live = Token::mine(3);
        let l = r.claim(live).unwrap();
        assert_eq!(l.val, 2);
        let flusher = Token::mine(9);
        let mut got = Vec::new();
        let n = r.flush(flusher, |_| true, |v, _| got.push(v));
        assert_eq!(n, 4);
        assert_eq!(
            got,
            vec![1, 3, 4, 5],
            "dead claim first, then posted, in order"
        );
        assert!(r.claim(live).is_none());
        // A second flush finds nothing more; the live claim completes once.
        assert_eq!(
            r.flush(flusher, |_| true, |_, _| panic!("flushed twice")),
            0
        );
        r.release(l.pos);
        assert_eq!(r.flush(flusher, |_| true, |_, _| panic!("released")), 0);
        // Every slot is reusable.
        for v in 0..8 {
            r.push(v).unwrap();
        }
    }

    #[test]
    fn flush_filter_selects_dead_claims_by_qpn() {
        let mut b = Box::new(Buf([0; 8192]));
        let r = ring(&mut b, 4);
        for v in 1..=3 {
            r.push(v).unwrap();
        }
        let _a = r.claim(Token::of(0, 1, 5)).unwrap();
        let _b = r.claim(Token::of(0, 1, 6)).unwrap();
        let mut got = Vec::new();
        let n = r.flush(
            Token::mine(6),
            |t| t.is_some_and(|t| t.qpn() == 6),
            |v, _| got.push(v),
        );
        assert_eq!(
            (n, got),
            (1, vec![2]),
            "only QP 6's dead claim; the free one stays"
        );
        assert_eq!(r.claim(Token::mine(7)).map(|c| c.val), Some(3));
    }

    /// The race the claim word exists for: requesters claiming and
    /// completing while a flusher flushes; every entry is completed by
    /// exactly one of them.
    #[test]
    fn claimers_and_a_flusher_complete_each_entry_once() {
        const ITEMS: u64 = if cfg!(miri) { 100 } else { 20_000 };
        let mut b = Box::new(Buf([0; 8192]));
        let r = ring(&mut b, 16);
        let done: Vec<std::sync::atomic::AtomicU32> = (0..ITEMS)
            .map(|_| std::sync::atomic::AtomicU32::new(0))
            .collect();
        let produced = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            let (r, done, produced) = (&r, &done, &produced);
            s.spawn(move || {
                for v in 0..ITEMS {
                    while r.push(v).is_err() {
                        std::thread::yield_now();
                    }
                }
                produced.store(true, Ordering::Release);
            });
            for q in 0..2u32 {
                s.spawn(move || loop {
                    if let Some(c) = r.claim(Token::mine(q)) {
                        done[c.val as usize].fetch_add(1, Ordering::Relaxed);
                        r.release(c.pos);
                    } else if produced.load(Ordering::Acquire) && r.is_empty() {
                        break;
                    } else {
                        std::thread::yield_now();
                    }
                });
            }
            s.spawn(move || loop {
                let fin = produced.load(Ordering::Acquire);
                r.flush(
                    Token::mine(99),
                    |_| true,
                    |v, _| {
                        done[v as usize].fetch_add(1, Ordering::Relaxed);
                    },
                );
                if fin && r.is_empty() {
                    break;
                }
                std::thread::yield_now();
            });
        });
        for (i, d) in done.iter().enumerate() {
            assert_eq!(d.load(Ordering::Relaxed), 1, "entry {i}");
        }
        drop(b);
    }
}
