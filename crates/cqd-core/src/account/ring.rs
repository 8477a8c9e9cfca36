//! The ring of one queue's outstanding requests: its posters publish entries,
//! its poller retires them, and the two share no lock.
//!
//! A queue's posters serialise among themselves (verbs orders posts per
//! queue, and the provider's queue lock serialises them anyway): they hold
//! the ring's **posting lock**, which the poller never takes. The poller,
//! and the rare reader beside it (the watchdog, a report, a queue's close),
//! hold the **retiring lock**, which posters never take. Between the two
//! sides there are only atomics: the entries and two positions.
//!
//! The retiring lock is not the ring's own: it is a [`RetireLock`] that
//! every queue of one CQ shares (an SRQ has its own until the end), so
//! that the poller takes it once per batch, however many queues the
//! batch's completions come from. The ring's retiring state sits in a
//! cell that only a holder of that lock reaches ([`Ring::retirer_under`]
//! checks that the lock held is the ring's).
//!
//! Positions count the entries ever written on the queue (`u64`). Entries
//! live in segments of [`SEG`], linked in position order; a segment the
//! poller has left goes to a free stack and is used again by a later post,
//! so a queue in steady state allocates nothing, and no segment is freed
//! before the ring is dropped.
//!
//! **The protocol.** The SAFETY comments, `QueueAccount`'s posting call and
//! the loom models (`ledger::cache::loom_post`) cite these numbers.
//!
//! 1. **Write.** A poster, holding the posting lock, writes each request's
//!    entry at the next positions from its tail: wr_id, post time, flags,
//!    state *live*, and, for a request with a context, the context's word
//!    beside it (and the flag that says so in the state word). A position that starts a
//!    segment first links one (popped from the free stack, or allocated)
//!    behind the last.
//! 2. **Publish** `tail` (Release), *before* the provider's post: a
//!    completion that arrives inside the post (an inline NIC, softverbs, a
//!    fast device) finds its entry.
//! 3. **Post** through the provider.
//! 4. **Settle.** If the provider took only the first `k` of the list,
//!    each entry past them is tombstoned, in position order: its state
//!    goes *live → dead* by compare-and-swap. An entry the poller took
//!    first (only a completion naming a request that was never posted can
//!    do that: a foreign wr_id equal to it) stays taken, and counts as
//!    posted. Then `committed` is stored (Release) at the tail. Entries
//!    below `committed` are final for the posters: they never touch them
//!    again.
//! 5. **Retire.** The poller, holding the retiring lock, loads `tail` and
//!    `committed` (Acquire) and looks for the entry a completion names, from
//!    `head` up to `tail`. It keeps what it loaded: both only grow, so the
//!    entries below them stay published and final, and it loads them again
//!    only when `head` reaches the `committed` it kept, or to look past it
//!    (so a queue's poster's line is read about once per batch, not once
//!    per completion). It takes an entry below `committed` with a plain
//!    store, or, at `head`, by moving `head` past it with no write at all;
//!    one at or above `committed` by compare-and-swap *live → taken* (a poster
//!    may be tombstoning it, step 4): each entry is decided once, by
//!    whichever side wins. **The winner owns the entry's context word**:
//!    the poller reads it (the poster wrote it before step 2's Release,
//!    which the poller's Acquire of `tail` saw) and hands it to the
//!    completion; a poster whose tombstone won keeps the value it wrote
//!    and hands it back to its caller. Nobody else reads the word until
//!    the segment is used again (step 7).
//! 6. **Advance.** `head` moves over taken and dead entries (both final).
//!    A segment `head` has left, once the next one is linked, is pushed on
//!    the free stack.
//! 7. **The free stack** is a Treiber stack: pushed by the poller (step 6),
//!    popped only by posters, under the posting lock. With one popper at a
//!    time a pop cannot meet the ABA problem (nobody else removes the head
//!    it read), and a segment's links change only once a poster has popped
//!    it.
//!
//! 8. **A context handler's end** (`crate::context`): its handler, dropped
//!    on the poller thread after the last poll, first marks itself gone,
//!    so that every later post with a context is refused (the posting
//!    call reads the mark under the posting lock). Then, for each queue of
//!    the CQ, it takes the posting lock (no post in flight: every entry is
//!    below `committed`) and the retiring lock, reads the word of each of
//!    its live entries that holds one, and clears that entry's flag: the
//!    entry stays live (the request is still on the device, and the stop
//!    reports it missing), but no later claim reads the word again. The
//!    queues are its CQ ledger's, with every SRQ that ledger is the home
//!    of; last come the words the expert path's retirement
//!    (`WrLedger::retire`) kept, under the retiring lock it held.
//!
//! So a segment is written by one side at a time: posters write positions
//! at or after `head` that they own (steps 1, 4); the poller recycles a
//! segment only when every position in it is below `head`; a poster reuses
//! it only after popping it.

use std::ptr;
use std::time::Instant;

use crossbeam_utils::CachePadded;

use std::mem::MaybeUninit;

use std::cell::UnsafeCell;
use std::sync::Arc;

use super::room::RoomBell;
use crate::sync::{AtomicPtr, AtomicU64, Ordering, ShortGuard, ShortMutex, Word};

/// The retiring lock of a set of rings (those of one CQ's queues, or one
/// SRQ's ring alone): whoever holds it may retire from any of them. Beside
/// it, the bell their posters wait for room on (`account::room`).
pub(crate) struct RetireLock(ShortMutex<()>, RoomBell);

impl Default for RetireLock {
    fn default() -> Self {
        RetireLock(ShortMutex::new(()), RoomBell::default())
    }
}

impl std::fmt::Debug for RetireLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RetireLock")
    }
}

impl RetireLock {
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(RetireLock::default())
    }

    /// The bell of the rings retired under this lock.
    #[inline]
    pub(crate) fn bell(&self) -> &RoomBell {
        &self.1
    }

    /// Takes the lock.
    #[inline]
    pub(crate) fn lock(&self) -> RetireHeld<'_> {
        RetireHeld {
            lock: self,
            _guard: self.0.lock(),
        }
    }
}

/// A [`RetireLock`] held.
pub(crate) struct RetireHeld<'a> {
    lock: &'a RetireLock,
    _guard: ShortGuard<'a, ()>,
}

impl RetireHeld<'_> {
    /// True when this is `lock` held.
    #[inline]
    pub(crate) fn holds(&self, lock: &RetireLock) -> bool {
        ptr::eq(self.lock, lock)
    }
}

/// A request's context, as its entry's word holds it: the bytes of a
/// value of at most 8 (`crate::context`).
pub(crate) type CtxWord = MaybeUninit<u64>;

/// A request retired without a completion of its own (an unsignaled send
/// a later completion covered, a predecessor's leftover): its wr_id, and
/// its context word if it was posted with one.
pub(crate) type SilentEntry = (u64, Option<CtxWord>);

/// Context tags are this many positions wide (a wr_id's tag): the posting
/// call tags a request with a context by its position modulo this.
pub(crate) const TAG_SPAN: u64 = 1 << crate::wr_id::TAG_BITS;

/// Entries per segment (two under loom, so that the models cross
/// segments): a segment is one 4 KiB page, the span a hardware prefetcher
/// streams over, so a queue's entries cost no more to walk than a
/// contiguous ring's: 169 entries of 16 bytes, then their 169 context
/// words (a request without a context leaves its word untouched, so
/// the poller of plain requests never reads those lines), then the
/// watchdog's bits.
#[cfg(not(loom))]
pub(crate) const SEG: u64 = 169;
#[cfg(loom)]
pub(crate) const SEG: u64 = 2;

/// Words of a segment's `reported` bits.
const REPORT_WORDS: usize = (SEG as usize).div_ceil(64);

/// The state of an entry, in the low bits of its word.
const STATE: u64 = 0b11;
const LIVE: u64 = 0;
const TAKEN: u64 = 1;
const DEAD: u64 = 2;
/// The request took a CQ credit.
const CREDIT: u64 = 1 << 2;
/// The request asked for a completion on success.
const SIGNALED: u64 = 1 << 3;
/// The entry's context word holds its request's context (R1).
const HAS_CTX: u64 = 1 << 4;
/// The post time ([`clock`](super::clock)'s reading), above the flags.
pub(crate) const AT_SHIFT: u32 = 64 - super::clock::BITS;

/// A post time, as an entry's word holds it.
#[inline]
pub(crate) fn stamp(at: Instant) -> u64 {
    super::clock::of(at) << AT_SHIFT
}

/// Now, as the posting call stamps its entries (see [`clock`](super::clock)).
#[inline]
pub(crate) fn stamp_now() -> u64 {
    super::clock::now() << AT_SHIFT
}

/// One outstanding request, as read from the ring.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seen {
    pub(crate) wr_id: u64,
    word: u64,
    reported: bool,
}

impl Seen {
    pub(crate) fn at(self) -> Instant {
        super::clock::instant(self.word >> AT_SHIFT)
    }
    pub(crate) fn credit(self) -> bool {
        self.word & CREDIT != 0
    }
    #[cfg(all(test, not(loom)))]
    pub(crate) fn signaled(self) -> bool {
        self.word & SIGNALED != 0
    }
    pub(crate) fn reported(self) -> bool {
        self.reported
    }
}

struct Entry {
    wr_id: AtomicU64,
    word: AtomicU64,
}

#[cfg_attr(not(loom), repr(C, align(4096)))]
struct Segment {
    entries: [Entry; SEG as usize],
    /// The context word of each entry (R1, R5).
    ctx: [Word; SEG as usize],
    /// One bit per entry: the watchdog has reported it stuck. Cleared
    /// when a poster links the segment (R1): nobody else reaches a
    /// segment before a position in it is published.
    reported: [AtomicU64; REPORT_WORDS],
    /// The segment after this one, once a poster links it (step 1).
    next: AtomicPtr<Segment>,
    /// The free stack's link (step 7).
    free_next: AtomicPtr<Segment>,
}

fn alloc_segment() -> *mut Segment {
    Box::into_raw(Box::new(Segment {
        entries: std::array::from_fn(|_| Entry {
            wr_id: AtomicU64::new(0),
            word: AtomicU64::new(DEAD),
        }),
        ctx: std::array::from_fn(|_| Word::new()),
        reported: std::array::from_fn(|_| AtomicU64::new(0)),
        next: AtomicPtr::new(ptr::null_mut()),
        free_next: AtomicPtr::new(ptr::null_mut()),
    }))
}

// A segment is one page (see `SEG`).
#[cfg(not(loom))]
const _: () = assert!(std::mem::size_of::<Segment>() == 4096);

/// A place in the chain of segments: the segment holding positions
/// `start..start + SEG`. Moves forward only.
#[derive(Clone, Copy)]
struct Cursor {
    seg: *mut Segment,
    start: u64,
}

impl Cursor {
    /// The entry at `pos`, at or after the cursor's segment and below the
    /// tail its caller loaded (or wrote, for a poster). The reference is
    /// not tied to the cursor (which moves on): callers use it while they
    /// hold the ring's lock of their side, and segments live as long as
    /// the ring.
    #[inline]
    fn at<'r>(&mut self, pos: u64) -> &'r Entry {
        self.slot(pos).0
    }

    /// As [`at`](Self::at), with the entry's context word.
    #[inline]
    fn slot<'r>(&mut self, pos: u64) -> (&'r Entry, &'r Word) {
        while pos >= self.start + SEG {
            // SAFETY: the segment is live (segments are freed only with the
            // ring) and, since `pos` is below a tail this thread published
            // or loaded with Acquire, its successor was linked before that
            // tail was published (steps 1–2); its link changes only when a
            // poster pops it from the free stack (step 7), which needs the
            // posting lock: a poster holding it is this thread, and the
            // poller never recycles a segment holding a position at or
            // after `head` (step 6).
            let next = unsafe { (*self.seg).next.load(Ordering::Acquire) };
            self.seg = next;
            self.start += SEG;
        }
        let i = (pos - self.start) as usize;
        // SAFETY: as above, the segment is live; `i < SEG`.
        unsafe { (&(*self.seg).entries[i], &(*self.seg).ctx[i]) }
    }

    /// The context word of the entry at `pos`, whose state word is
    /// `word`, if it was posted with one.
    ///
    /// # Safety
    /// The caller owns the entry (R5: its claim won) and holds the
    /// retiring lock.
    #[inline]
    unsafe fn ctx(&mut self, pos: u64, word: u64) -> Option<CtxWord> {
        if word & HAS_CTX == 0 {
            return None;
        }
        // SAFETY: the caller's; the word was written before R2's Release,
        // which the caller's Acquire of `tail` saw.
        Some(unsafe { self.slot(pos).1.read() })
    }

    /// The watchdog's bit of the entry at `pos` (its word, its mask).
    #[inline]
    fn report_bit<'r>(&mut self, pos: u64) -> (&'r AtomicU64, u64) {
        let _ = self.slot(pos);
        let i = (pos - self.start) as usize;
        // SAFETY: `slot` moved the cursor to the live segment holding `pos`.
        (unsafe { &(*self.seg).reported[i / 64] }, 1 << (i % 64))
    }
}

/// What the posters keep, under the posting lock.
pub(crate) struct Producer {
    /// The last segment linked.
    last: Cursor,
    tail: u64,
    /// Where the current post began (step 4 tombstones from there).
    post: Cursor,
    post_from: u64,
    /// The last entry posted and not tombstoned (position, wr_id), and
    /// what it was before the current post.
    last_posted: Option<(Cursor, u64, u64)>,
    before_post: Option<(Cursor, u64, u64)>,
    /// Segments made by [`Ring::reserve`] and the first.
    reserved: u64,
    /// The poller's published `head` as this side last loaded it (it only
    /// grows): the room check loads it again only when this says full.
    head_seen: u64,
    /// The queue's oldest live request was, at the last segment linked,
    /// so far behind the tail that a context tag (23 bits of position)
    /// could repeat one still outstanding (see [`Poster::tags_wrap`]).
    wide: bool,
    /// The positions a context tag tells apart in a test, which cannot
    /// keep 2^24 requests outstanding cheaply ([`TAG_SPAN`] otherwise: a
    /// field here in every build made the producer's state one word
    /// larger, which cost the simulator's poller 0.5 ns a completion).
    #[cfg(test)]
    span: u64,
}

/// What the poller keeps, under the retiring lock (the ring's
/// [`RetireLock`]).
pub(crate) struct Consumer {
    at: Cursor,
    head: u64,
    /// `tail` and `committed` as last loaded (Acquire, step 5): they only
    /// grow, so entries below them stay published and final; the poller
    /// loads them again only when `head` reaches `committed`, or to look
    /// past it.
    tail: u64,
    committed: u64,
}

// SAFETY: the cursors name segments of the ring these states belong to,
// which live as long as it; the states are reached only through the ring's
// posting and retiring locks, so one thread at a time uses each (steps 1–6).
unsafe impl Send for Producer {}
// SAFETY: see `Producer`.
unsafe impl Send for Consumer {}

struct Positions {
    tail: AtomicU64,
    committed: AtomicU64,
}

/// What a retirement reads and writes, on one line that posters read
/// only rarely (`head`, when they link a segment or ask about a drain
/// marker).
struct RetireSide {
    /// Reached only by a [`Retirer`], which holds `lock` (or by `Drop`).
    consumer: UnsafeCell<Consumer>,
    /// `head` as the poller last left it (Release), for a poster asking
    /// whether its last request was retired (a drain marker).
    head: AtomicU64,
    /// The retiring lock: its CQ's, shared with the CQ's other queues.
    lock: Arc<RetireLock>,
    /// The queue's account flags the poller reads with each completion
    /// (`QueueAccount::is_closed`, `QueueAccount::has_prev`).
    closed: crate::sync::AtomicBool,
    has_prev: std::sync::atomic::AtomicBool,
    /// The poller found the queue dry after its last batch (a receive
    /// queue at or below its CQ's low-water mark; `QueueAccount::is_dry`);
    /// written by the poller only.
    dry: std::sync::atomic::AtomicBool,
    /// A send queue: a completion retires every entry before it.
    in_order: bool,
}

/// One queue's ring (see the module documentation).
pub(crate) struct Ring {
    /// Written by posters only, read by the poller: `tail` and
    /// `committed`, on one line.
    pos: CachePadded<Positions>,
    free: CachePadded<AtomicPtr<Segment>>,
    post: CachePadded<ShortMutex<Producer>>,
    retire: CachePadded<RetireSide>,
}

// SAFETY: the raw pointers inside are reached only under the two locks
// (`Producer`; `Consumer` under `lock`, see `Ring::retirer_under`) or
// through atomics; segments are freed only by `Drop`, which has the ring
// to itself.
unsafe impl Sync for Ring {}
// SAFETY: as above.
unsafe impl Send for Ring {}

impl Ring {
    /// A ring retired under `lock`; `in_order` for a send queue's.
    pub(crate) fn new(lock: Arc<RetireLock>, in_order: bool) -> Self {
        let first = Cursor {
            seg: alloc_segment(),
            start: 0,
        };
        Ring {
            pos: CachePadded::new(Positions {
                tail: AtomicU64::new(0),
                committed: AtomicU64::new(0),
            }),
            free: CachePadded::new(AtomicPtr::new(ptr::null_mut())),
            post: CachePadded::new(ShortMutex::new(Producer {
                last: first,
                tail: 0,
                post: first,
                post_from: 0,
                last_posted: None,
                before_post: None,
                reserved: 1,
                head_seen: 0,
                wide: false,
                #[cfg(test)]
                span: TAG_SPAN,
            })),
            retire: CachePadded::new(RetireSide {
                consumer: UnsafeCell::new(Consumer {
                    at: first,
                    head: 0,
                    tail: 0,
                    committed: 0,
                }),
                head: AtomicU64::new(0),
                lock,
                closed: crate::sync::AtomicBool::new(false),
                has_prev: std::sync::atomic::AtomicBool::new(false),
                dry: std::sync::atomic::AtomicBool::new(false),
                in_order,
            }),
        }
    }

    /// True for a send queue's ring (a completion retires every entry
    /// before it).
    #[inline]
    pub(crate) fn in_order(&self) -> bool {
        self.retire.in_order
    }

    /// The account's flag "dry" (`QueueAccount::is_dry`).
    #[inline]
    pub(crate) fn dry(&self) -> &std::sync::atomic::AtomicBool {
        &self.retire.dry
    }

    /// The account's flag "closed" (`QueueAccount::close`).
    #[inline]
    pub(crate) fn closed(&self) -> &crate::sync::AtomicBool {
        &self.retire.closed
    }

    /// The account's flag "has a predecessor" (`QueueAccount`, step 6).
    #[inline]
    pub(crate) fn has_prev(&self) -> &std::sync::atomic::AtomicBool {
        &self.retire.has_prev
    }

    /// Puts segments on the free stack (step 7) until the ring holds at
    /// least `entries` without allocating: a queue `depth` deep, plus the
    /// completions a poller has taken from the CQ but not yet retired,
    /// never needs more, so a queue in steady state allocates nothing even
    /// at its high-water mark.
    pub(crate) fn reserve(&self, entries: u64) {
        let mut p = self.post.lock();
        // Segments this ring has made so far: those are counted here only
        // (a reserve is made once, when the queue is made).
        let want = entries.div_ceil(SEG) + 1;
        while p.reserved < want {
            push_free(self, alloc_segment());
            p.reserved += 1;
        }
    }

    /// `head` as the poller last published it (Acquire): every entry
    /// below it is retired.
    #[inline]
    pub(crate) fn head(&self) -> u64 {
        self.retire.head.load(Ordering::Acquire)
    }

    /// The posters' `tail`: requests ever published on the queue.
    pub(crate) fn tail(&self) -> u64 {
        self.pos.tail.load(Ordering::Acquire)
    }

    /// Entries between the poller's last published `head` and the
    /// posters' `tail`, read without a lock: the requests waiting on the
    /// queue, or more (entries retired out of order or tombstoned above
    /// `head` count until `head` passes them).
    pub(crate) fn ahead(&self) -> u64 {
        let tail = self.pos.tail.load(Ordering::Acquire);
        tail.saturating_sub(self.retire.head.load(Ordering::Acquire))
    }

    /// The posting lock (steps 1–4).
    #[inline]
    pub(crate) fn poster(&self) -> Poster<'_> {
        let mut p = self.post.lock();
        p.post = p.last;
        p.post_from = p.tail;
        p.before_post = p.last_posted;
        Poster { ring: self, p }
    }

    /// The ring's retiring lock.
    #[inline]
    pub(crate) fn retire_lock(&self) -> &Arc<RetireLock> {
        &self.retire.lock
    }

    /// Takes the retiring lock for this ring alone (steps 5–6): the
    /// watchdog, a report, a close. The lock is shared with the CQ's
    /// other queues, so a thread that holds it already (the poller, in
    /// its accounting pass) uses [`retirer_under`](Self::retirer_under).
    #[inline]
    pub(crate) fn retirer(&self) -> Retirer<'_> {
        let held = self.retire.lock.lock();
        // SAFETY: `held` is this ring's lock, held for as long as the
        // retirer, which keeps it.
        unsafe { self.make_retirer(Some(held)) }
    }

    /// Steps 5–6 under a retiring lock the caller holds already (the
    /// poller, once per batch). `held` is borrowed for as long as the
    /// retirer lives, so one retirer at a time uses it.
    ///
    /// # Panics
    /// If `held` is not this ring's lock (a bug in cqd: the caller checks
    /// with [`RetireHeld::holds`] first).
    #[inline]
    pub(crate) fn retirer_under<'a>(&'a self, held: &'a mut RetireHeld<'_>) -> Retirer<'a> {
        assert!(
            held.holds(&self.retire.lock),
            "a retiring lock of another CQ"
        );
        // SAFETY: `held` is this ring's lock, exclusively borrowed for 'a.
        unsafe { self.make_retirer(None) }
    }

    /// # Safety
    /// The caller holds this ring's retiring lock for as long as the
    /// retirer lives, and makes no other retirer of the ring meanwhile
    /// (`own`, if given, is that lock: the retirer keeps it).
    #[inline]
    unsafe fn make_retirer<'a>(&'a self, own: Option<RetireHeld<'a>>) -> Retirer<'a> {
        // SAFETY: the caller's: the lock makes this the only reference to
        // the consumer state while the retirer lives.
        let c = unsafe { &mut *self.retire.consumer.get() };
        let head_at_lock = c.head;
        let fresh = own.is_some();
        let mut r = Retirer {
            ring: self,
            c,
            head_at_lock,
            own,
        };
        // A reader beside the poller looks at the queue as it is now; the
        // poller loads the positions when it needs them (step 5).
        if fresh {
            r.refresh();
        }
        r
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // Every segment is on the chain from the consumer's segment on, or
        // on the free stack (step 6 pushes only segments before it).
        let mut p = self.retire.consumer.get_mut().at.seg;
        while !p.is_null() {
            // SAFETY: a segment of the chain, from `Box::into_raw`, freed
            // once here; nothing else runs during drop.
            let seg = unsafe { Box::from_raw(p) };
            p = seg.next.load(Ordering::Relaxed);
        }
        let mut p = self.free.load(Ordering::Relaxed);
        while !p.is_null() {
            // SAFETY: a segment of the free stack, off the chain, from
            // `Box::into_raw`, freed once here.
            let seg = unsafe { Box::from_raw(p) };
            p = seg.free_next.load(Ordering::Relaxed);
        }
    }
}

/// One request to write (step 1).
#[derive(Clone, Copy, Debug)]
pub(crate) struct NewEntry {
    pub(crate) wr_id: u64,
    word: u64,
}

impl NewEntry {
    /// An entry for `wr_id`, posted at `at` (see [`stamp`]).
    #[inline]
    pub(crate) fn new(wr_id: u64, at: u64, credit: bool, signaled: bool) -> Self {
        let word =
            at | LIVE | if credit { CREDIT } else { 0 } | if signaled { SIGNALED } else { 0 };
        NewEntry { wr_id, word }
    }
}

/// A poster of the queue, holding the posting lock.
pub(crate) struct Poster<'a> {
    ring: &'a Ring,
    p: ShortGuard<'a, Producer>,
}

impl Poster<'_> {
    /// True if `n` more requests keep the queue within `depth` requests
    /// not yet retired (`tail - head`, `head` as the poller last
    /// published it, loaded again only when the one seen last says no).
    /// For a queue that retires in order (a send queue), this is the
    /// device's own occupancy: its slots are freed as their completions
    /// are polled.
    #[inline]
    pub(crate) fn has_room(&mut self, n: u64, depth: u64) -> bool {
        let p = &mut *self.p;
        if p.tail + n <= p.head_seen + depth {
            return true;
        }
        p.head_seen = self.ring.retire.head.load(Ordering::Acquire);
        p.tail + n <= p.head_seen + depth
    }

    /// Requests not yet retired, as [`has_room`](Self::has_room) last saw.
    pub(crate) fn in_flight(&self) -> u64 {
        self.p.tail.saturating_sub(self.p.head_seen)
    }

    /// Step 1 for one entry: writes it at the next position, not yet
    /// published.
    #[inline]
    pub(crate) fn write(&mut self, e: NewEntry) {
        let p = &mut *self.p;
        if p.tail == p.last.start + SEG {
            link(self.ring, &mut p.last);
            let behind = p
                .tail
                .saturating_sub(self.ring.retire.head.load(Ordering::Acquire));
            #[cfg(test)]
            let span = p.span;
            #[cfg(not(test))]
            let span = TAG_SPAN;
            p.wide = behind + 2 * SEG >= span;
        }
        let tail = p.tail;
        let slot = p.last.at(tail);
        slot.wr_id.store(e.wr_id, Ordering::Relaxed);
        slot.word.store(e.word, Ordering::Relaxed);
        p.last_posted = Some((p.last, tail, e.wr_id));
        p.tail += 1;
    }

    /// Step 1 for a request with a context: as [`write`](Self::write),
    /// the entry flagged as holding one, and `ctx` in its word.
    #[inline]
    pub(crate) fn write_ctx(&mut self, e: NewEntry, ctx: CtxWord) {
        let pos = self.p.tail;
        self.write(NewEntry {
            word: e.word | HAS_CTX,
            ..e
        });
        let (_, word) = self.p.last.slot(pos);
        // SAFETY: R1: the position is not published yet (step 2 comes
        // after), in a segment this poster linked or popped (R7), so nobody
        // else reads or writes its word now; R2's Release publishes it.
        unsafe { word.write(ctx) };
    }

    /// The position the next [`write`](Self::write) takes.
    #[inline]
    pub(crate) fn next_pos(&self) -> u64 {
        self.p.tail
    }

    /// True when a context tag, which is 24 bits of the position, might
    /// repeat a request still outstanding: the queue's oldest live request
    /// was, when the last segment was linked, within two segments of
    /// 2^24 positions behind the tail (a receive left outstanding while
    /// millions of others went by). The posting call then refuses
    /// requests with contexts; plain ones go on.
    #[inline]
    pub(crate) fn tags_wrap(&self) -> bool {
        self.p.wide
    }

    /// Whether the queue ends in a live unsignaled request: the last
    /// request posted (tombstoned ones aside) is unsignaled and the poller
    /// has not retired it. A drain marker follows only such a tail.
    pub(crate) fn ends_silently(&mut self) -> bool {
        let Some((mut cur, pos, wr_id)) = self.p.last_posted else {
            return false;
        };
        // The segment may have been recycled since (the poller left it):
        // then that request was retired, and whatever the slot holds now
        // is not it (its wr_id or state differs) or is dead.
        if pos < self.ring.retire.head.load(Ordering::Acquire) {
            return false; // retired (step 6)
        }
        let e = cur.at(pos);
        let w = e.word.load(Ordering::Acquire);
        e.wr_id.load(Ordering::Relaxed) == wr_id && w & STATE == LIVE && w & SIGNALED == 0
    }

    /// Step 2: publishes what was written.
    #[inline]
    pub(crate) fn publish(&self) {
        self.ring.pos.tail.store(self.p.tail, Ordering::Release);
    }

    /// Step 4 when the provider took the whole list.
    #[inline]
    pub(crate) fn commit(&self) {
        self.ring
            .pos
            .committed
            .store(self.p.tail, Ordering::Release);
    }

    /// Step 4 when the provider took only the first `posted` entries of
    /// this post: tombstones the others in order, then commits. `each` is
    /// told, per entry after them, whether it was tombstoned here (false:
    /// the poller took it first, it counts as posted) and whether it held
    /// a credit.
    pub(crate) fn settle(&mut self, posted: usize, mut each: impl FnMut(bool, bool)) {
        let p = &mut *self.p;
        let mut cur = p.post;
        let kept = p.post_from + posted as u64;
        p.last_posted = match kept.checked_sub(1) {
            Some(pos) if pos >= p.post_from => {
                let wr_id = cur.at(pos).wr_id.load(Ordering::Relaxed);
                Some((cur, pos, wr_id))
            }
            _ => p.before_post,
        };
        for pos in kept..p.tail {
            let e = cur.at(pos);
            let (won, word) = set_state(&e.word, DEAD);
            if !won && word & STATE == TAKEN {
                p.last_posted = Some((cur, pos, e.wr_id.load(Ordering::Relaxed)));
            }
            each(won, word & CREDIT != 0);
        }
        self.ring.pos.committed.store(p.tail, Ordering::Release);
    }
}

#[cfg(all(test, loom))]
impl Poster<'_> {
    /// The loom models' mutation of R1: an entry that says it holds a
    /// context, whose word [`write_word_late`](Self::write_word_late)
    /// writes later.
    pub(crate) fn write_flagged(&mut self, wr_id: u64, at: u64, credit: bool, signaled: bool) {
        let mut e = NewEntry::new(wr_id, at, credit, signaled);
        e.word |= HAS_CTX;
        self.write(e);
    }

    /// The mutation's late write of the word of the entry at `pos`.
    pub(crate) fn write_word_late(&mut self, pos: u64, ctx: CtxWord) {
        let mut cur = self.p.post;
        // SAFETY: none: this is the mutation loom must catch (the entry is
        // published, a claim may be reading its word).
        unsafe { cur.slot(pos).1.write(ctx) };
    }

    /// The loom models' mutation of step 4 (plain stores, no
    /// compare-and-swap); returns the credits of the entries it killed.
    pub(crate) fn settle_without_cas(&mut self, posted: usize) -> u64 {
        let p = &mut *self.p;
        let mut cur = p.post;
        let mut credits = 0;
        for pos in p.post_from + posted as u64..p.tail {
            let e = cur.at(pos);
            let w = e.word.load(Ordering::Acquire);
            if w & STATE == DEAD {
                continue;
            }
            e.word.store((w & !STATE) | DEAD, Ordering::Release);
            credits += u64::from(w & CREDIT != 0);
        }
        self.ring.pos.committed.store(p.tail, Ordering::Release);
        credits
    }
}

/// Links a segment behind `last` (step 1): one from the free stack
/// (step 7), else a new one.
#[cold]
#[inline(never)]
fn link(ring: &Ring, last: &mut Cursor) {
    let mut seg = ring.free.load(Ordering::Acquire);
    while !seg.is_null() {
        // SAFETY: a segment on the free stack is live; its `free_next` was
        // written before it was pushed (Release), and is not changed while
        // it is on the stack.
        let next = unsafe { (*seg).free_next.load(Ordering::Relaxed) };
        match ring
            .free
            .compare_exchange(seg, next, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => break,
            Err(now) => seg = now,
        }
    }
    if seg.is_null() {
        seg = alloc_segment();
    }
    // SAFETY: `seg` is this poster's: popped (one popper at a time, step
    // 7) or just made; the poller reaches it only once a position in it is
    // published (step 2), after this store.
    unsafe { (*seg).next.store(ptr::null_mut(), Ordering::Relaxed) };
    // The watchdog's bits of the segment's last use (R1).
    // SAFETY: as above.
    for bits in unsafe { &(*seg).reported } {
        bits.store(0, Ordering::Relaxed);
    }
    // SAFETY: `last.seg` is the last segment linked, live; the poller reads
    // its link only for positions published after this store (the Release
    // of step 2 orders it).
    unsafe { (*last.seg).next.store(seg, Ordering::Release) };
    last.seg = seg;
    last.start += SEG;
}

/// Moves `word`'s state from live to `to`, keeping its other bits;
/// returns whether it did, and the word as it was.
#[inline]
fn set_state(word: &AtomicU64, to: u64) -> (bool, u64) {
    let mut w = word.load(Ordering::Acquire);
    loop {
        if w & STATE != LIVE {
            return (false, w);
        }
        match word.compare_exchange_weak(w, (w & !STATE) | to, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return (true, w),
            Err(now) => w = now,
        }
    }
}

/// Step 5's common case: the entry at `head` is live, below the
/// `committed` last loaded, in the cursor's segment, and the one a
/// completion of `wr_id` (`success`: its status) names; it is retired by
/// moving `head` past it, with no write to it (below `committed` it is
/// final for the posters). Returns its credit and its context word (R5:
/// this claim, the only one, owns it), or `None` if the entry at `head` is
/// not that one (the caller takes the general path).
///
/// The caller holds the ring's retiring lock (`c` is its consumer).
#[inline(always)]
fn take_head(c: &mut Consumer, wr_id: u64, success: bool) -> Option<(u64, Option<CtxWord>)> {
    let bound = c.committed;
    #[cfg(all(test, loom))]
    let bound = if HEAD_BOUND_IS_TAIL.with(|m| m.get()) {
        c.tail
    } else {
        bound
    };
    if c.head >= bound || c.head >= c.at.start + SEG {
        return None;
    }
    let head = c.head;
    let e = c.at.at(head);
    let w = e.word.load(Ordering::Acquire);
    if w & STATE != LIVE
        || e.wr_id.load(Ordering::Relaxed) != wr_id
        || (w & SIGNALED == 0 && success)
    {
        return None;
    }
    // SAFETY: R5: below `committed` the entry is final for the posters,
    // and this claim (`head` moving past it) is the only one; the caller
    // holds the retiring lock.
    let word = unsafe { c.at.ctx(head, w) };
    c.head += 1;
    Some((u64::from(w & CREDIT != 0), word))
}

#[cfg(all(test, loom))]
std::thread_local! {
    /// The loom models' mutation of [`take_head`]: bounded by `tail`.
    pub(crate) static HEAD_BOUND_IS_TAIL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// What [`Ring::retire_head`] found.
pub(crate) enum AtHead {
    /// The ring's retiring lock is not the one held (an SRQ's own).
    OtherLock,
    /// Not the common case (a predecessor, an entry that is not at `head`
    /// or not below `committed`): the caller takes the general path.
    Slow,
    /// Retired: its credit, its context word, the requests left on the
    /// queue at most (the `tail` last loaded less `head`), and the flags
    /// the poller's pass looks at next (see [`Ring::flags`]).
    Taken {
        credit: u64,
        word: Option<CtxWord>,
        left: u64,
        flags: Flags,
    },
}

/// The account's flags on the retiring line, as one look found them.
#[derive(Clone, Copy)]
pub(crate) struct Flags {
    /// A send queue.
    pub(crate) in_order: bool,
    /// The queue is closed (`QueueAccount::close`).
    pub(crate) closed: bool,
    /// The poller last found the queue dry.
    pub(crate) dry: bool,
}

impl Ring {
    /// Step 5's common case under a retiring lock the caller holds (see
    /// [`take_head`]), with no [`Retirer`]: the poller's pass tries it
    /// first for each completion. It tells first whether `held` is this
    /// ring's lock at all ([`AtHead::OtherLock`]).
    #[inline(always)]
    pub(crate) fn retire_head(
        &self,
        held: &mut RetireHeld<'_>,
        wr_id: u64,
        success: bool,
    ) -> AtHead {
        if !held.holds(&self.retire.lock) {
            return AtHead::OtherLock;
        }
        if self.retire.has_prev.load(Ordering::Acquire) {
            return AtHead::Slow;
        }
        // SAFETY: `held` is this ring's lock (checked above), exclusively
        // borrowed for the call: this is the only reference to the
        // consumer state.
        let c = unsafe { &mut *self.retire.consumer.get() };
        let Some((credit, word)) = take_head(c, wr_id, success) else {
            return AtHead::Slow;
        };
        // Published as a retirer's end publishes it (step 6).
        self.retire.head.store(c.head, Ordering::Release);
        AtHead::Taken {
            credit,
            word,
            left: c.tail.saturating_sub(c.head),
            flags: self.flags(),
        }
    }

    /// The account's flags, as the poller reads them with a completion.
    #[inline(always)]
    pub(crate) fn flags(&self) -> Flags {
        Flags {
            in_order: self.retire.in_order,
            closed: self.retire.closed.load(Ordering::Acquire),
            dry: self.retire.dry.load(std::sync::atomic::Ordering::Relaxed),
        }
    }
}

/// The poller (or a reader beside it), holding the retiring lock, with the
/// positions it loaded (step 5).
pub(crate) struct Retirer<'a> {
    ring: &'a Ring,
    c: &'a mut Consumer,
    /// `head` when the lock was taken (published again only if it moved).
    head_at_lock: u64,
    /// The retiring lock, when this retirer took it (dropped after `Drop`
    /// has published `head`).
    own: Option<RetireHeld<'a>>,
}

impl Retirer<'_> {
    /// Step 5's loads: `tail` and `committed` (Acquire) as the posters
    /// left them.
    #[inline]
    fn refresh(&mut self) {
        self.c.tail = self.ring.pos.tail.load(Ordering::Acquire);
        self.c.committed = self.ring.pos.committed.load(Ordering::Acquire);
    }

    /// The live entries from `head`, in order, with their positions.
    pub(crate) fn live(&mut self) -> impl Iterator<Item = (u64, Seen)> + '_ {
        self.refresh();
        let mut cur = self.c.at;
        (self.c.head..self.c.tail).filter_map(move |pos| {
            let e = cur.at(pos);
            let word = e.word.load(Ordering::Acquire);
            if word & STATE != LIVE {
                return None;
            }
            let (bits, bit) = cur.report_bit(pos);
            let seen = Seen {
                wr_id: e.wr_id.load(Ordering::Relaxed),
                word,
                reported: bits.load(Ordering::Relaxed) & bit != 0,
            };
            Some((pos, seen))
        })
    }

    /// Entries live from `head` (requests outstanding).
    pub(crate) fn count(&mut self) -> usize {
        self.live().count()
    }

    /// Marks the entry at `pos` reported (the watchdog).
    pub(crate) fn mark_reported(&mut self, pos: u64) {
        let mut cur = self.c.at;
        let (bits, bit) = cur.report_bit(pos);
        bits.fetch_or(bit, Ordering::Relaxed);
    }

    /// Step 5 for one entry: claims it if it is live; returns it if this
    /// call did. Below `committed` nothing is written: the caller moves
    /// `head` past it, or marks it ([`mark`](Self::mark)) if it is not at
    /// `head` — so the common retirement writes nothing to the lines the
    /// posters wrote. At or above it, the claim is a compare-and-swap
    /// against a poster's tombstone (step 4).
    #[inline]
    fn claim(&self, cur: &mut Cursor, pos: u64) -> Option<Seen> {
        let e = cur.at(pos);
        let wr_id = e.wr_id.load(Ordering::Relaxed);
        if pos < self.c.committed {
            let word = e.word.load(Ordering::Acquire);
            (word & STATE == LIVE).then_some(Seen {
                wr_id,
                word,
                reported: false,
            })
        } else {
            let (won, word) = set_state(&e.word, TAKEN);
            won.then_some(Seen {
                wr_id,
                word,
                reported: false,
            })
        }
    }

    /// Marks a claimed entry below `committed` taken, for one `head` will
    /// not pass now (an out-of-order receive).
    #[inline]
    fn mark(&self, cur: &mut Cursor, pos: u64) {
        if pos < self.c.committed {
            let e = cur.at(pos);
            let w = e.word.load(Ordering::Relaxed);
            e.word.store((w & !STATE) | TAKEN, Ordering::Relaxed);
        }
    }

    /// Retires what a completion of `wr_id` covers (`success`: its status;
    /// `in_order`: a send queue, where it covers every live entry before
    /// it, which completed silently and are appended to `silent`). A
    /// success names the oldest live *signaled* entry with its wr_id, an
    /// error the oldest live one. Returns the credits of what it retired
    /// (not yet given back) and whether it found the named entry; if it
    /// did and that was posted with a context, the context's word is put
    /// in `ctx` (R5: this call's claim owns it).
    #[inline(always)]
    pub(crate) fn retire(
        &mut self,
        wr_id: u64,
        success: bool,
        in_order: bool,
        silent: &mut Vec<SilentEntry>,
        ctx: &mut Option<CtxWord>,
    ) -> (u64, bool) {
        // Entries below the `committed` last loaded are published and
        // final: the positions are loaded again only past them.
        if self.c.head >= self.c.committed {
            self.refresh();
        }
        // The common case: the live entry at `head` (step 6 done here,
        // lazily: the entry at `head` is read anyway).
        if self.at_head().is_some() {
            if let Some((credit, word)) = take_head(self.c, wr_id, success) {
                *ctx = word;
                return (credit, true);
            }
        }
        self.retire_behind(wr_id, success, in_order, silent, ctx)
    }

    /// Out of line: a send completion behind unsignaled sends, an SRQ
    /// receive out of order, a wr_id the ring does not hold.
    #[inline(never)]
    fn retire_behind(
        &mut self,
        wr_id: u64,
        success: bool,
        in_order: bool,
        silent: &mut Vec<SilentEntry>,
        ctx: &mut Option<CtxWord>,
    ) -> (u64, bool) {
        self.refresh();
        let head = self.c.head;
        let mut cur = self.c.at;
        let mut found = None;
        for pos in head..self.c.tail {
            let e = cur.at(pos);
            if e.wr_id.load(Ordering::Relaxed) != wr_id {
                continue;
            }
            let w = e.word.load(Ordering::Acquire);
            if w & STATE == LIVE && (w & SIGNALED != 0 || !success) {
                found = Some(pos);
                break;
            }
        }
        let Some(named) = found else {
            return (0, false);
        };
        let mut credits = 0;
        let mut cur = self.c.at;
        if in_order {
            for pos in head..named {
                if let Some(seen) = self.claim(&mut cur, pos) {
                    credits += u64::from(seen.credit());
                    // SAFETY: R5: the claim just made owns the entry.
                    silent.push((seen.wr_id, unsafe { cur.ctx(pos, seen.word) }));
                }
            }
        }
        let took = self.claim(&mut cur, named);
        if let Some(seen) = took {
            // SAFETY: R5: the claim just made owns the entry.
            *ctx = unsafe { cur.ctx(named, seen.word) };
            credits += u64::from(seen.credit());
            if in_order || named == head {
                // Everything up to it is retired or dead.
                self.c.head = named + 1;
            } else {
                self.mark(&mut cur, named);
            }
        } else if in_order {
            // Lost to a tombstone: what was before it is still retired.
            self.c.head = named;
        }
        self.advance();
        (credits, took.is_some())
    }

    /// Takes every live entry (a predecessor's end, step 6 of
    /// `crate::account`): appends their wr_ids to `silent`, returns their
    /// credits.
    pub(crate) fn take_all(&mut self, silent: &mut Vec<SilentEntry>) -> u64 {
        self.refresh();
        let mut credits = 0;
        let mut cur = self.c.at;
        for pos in self.c.head..self.c.tail {
            if let Some(seen) = self.claim(&mut cur, pos) {
                credits += u64::from(seen.credit());
                // SAFETY: R5: the claim just made owns the entry.
                silent.push((seen.wr_id, unsafe { cur.ctx(pos, seen.word) }));
            }
        }
        self.c.head = self.c.tail;
        self.advance();
        credits
    }

    /// The end of a context handler (its poller stopped): for each live
    /// entry posted with a context whose wr_id satisfies `mine`, hands its
    /// context word to `each` and clears the entry's flag, so that no
    /// later claim reads the word again. The entry itself stays live and
    /// keeps its credit: the request is still outstanding on the device
    /// (the stop reports it missing). The caller holds the posting lock
    /// too, so every entry is below `committed`, final for the posters.
    pub(crate) fn abandon_where(
        &mut self,
        mine: impl Fn(u64) -> bool,
        mut each: impl FnMut(CtxWord),
    ) {
        debug_assert_eq!(self.c.committed, self.c.tail, "the posting lock is held");
        let mut cur = self.c.at;
        for pos in self.c.head..self.c.tail {
            let (e, _) = cur.slot(pos);
            let word = e.word.load(Ordering::Acquire);
            if word & STATE != LIVE || word & HAS_CTX == 0 {
                continue;
            }
            if !mine(e.wr_id.load(Ordering::Relaxed)) {
                continue;
            }
            // SAFETY: the entry is live below `committed` with both locks
            // held: neither a poster (R4) nor a claim (R5) can take it now,
            // and its flag is cleared before the locks are let go.
            if let Some(ctx) = unsafe { cur.ctx(pos, word) } {
                each(ctx);
            }
            e.word.store(word & !HAS_CTX, Ordering::Relaxed);
        }
    }

    /// Entries from `head` to `tail` as this lock saw `tail`: the requests
    /// waiting when it was taken, less those retired since (an upper
    /// bound: out-of-order retirements and tombstones above `head` count).
    #[inline]
    pub(crate) fn left(&self) -> u64 {
        self.c.tail.saturating_sub(self.c.head)
    }

    /// True when no entry from `head` is live.
    pub(crate) fn drained(&mut self) -> bool {
        self.refresh();
        self.at_head().is_none()
    }

    /// Step 6, then the live entry at `head` and its word, if any.
    #[inline]
    fn at_head(&mut self) -> Option<(&'static Entry, u64)> {
        loop {
            let c = &mut *self.c;
            if c.head >= c.tail {
                return None;
            }
            if c.head >= c.at.start + SEG {
                self.recycle();
                continue;
            }
            let e = c.at.at(c.head);
            let w = e.word.load(Ordering::Acquire);
            if w & STATE == LIVE {
                return Some((e, w));
            }
            c.head += 1;
        }
    }

    /// Moves the cursor off the segments `head` has left (the next is
    /// linked: a position in it is below `tail`) and recycles them.
    #[cold]
    #[inline(never)]
    fn recycle(&mut self) {
        let c = &mut *self.c;
        while c.head >= c.at.start + SEG && c.head < c.tail {
            let old = c.at.seg;
            let start = c.at.start;
            let _ = c.at.at(start + SEG);
            push_free(self.ring, old);
        }
    }

    /// Step 6: moves `head` over taken and dead entries, and recycles the
    /// segments it leaves. (Entries below `head` are retired whatever
    /// their state word says.)
    #[inline]
    fn advance(&mut self) {
        let _ = self.at_head();
    }
}

impl Drop for Retirer<'_> {
    fn drop(&mut self) {
        if self.c.head != self.head_at_lock {
            self.ring.retire.head.store(self.c.head, Ordering::Release);
            // A reader beside the poller (the expert path's retire, a
            // close's drain) freed room on a send queue: its waiting
            // posters learn it now (`account::room`; the poller's pass,
            // which holds the lock itself, rings once per batch).
            if self.own.is_some() && self.ring.retire.in_order {
                self.ring.retire.lock.bell().after_retire();
            }
        }
    }
}

/// Step 7: pushes a segment the poller has left.
fn push_free(ring: &Ring, seg: *mut Segment) {
    let mut top = ring.free.load(Ordering::Relaxed);
    loop {
        // SAFETY: `seg` is off the chain's live part (every position in it
        // is below `head`, step 6) and not yet on the stack: nobody else
        // reads or writes its free link now.
        unsafe { (*seg).free_next.store(top, Ordering::Relaxed) };
        match ring
            .free
            .compare_exchange_weak(top, seg, Ordering::AcqRel, Ordering::Relaxed)
        {
            Ok(_) => return,
            Err(now) => top = now,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn ring() -> Ring {
        Ring::new(RetireLock::new(), true)
    }

    fn post(ring: &Ring, ids: &[u64], signaled: bool, posted: usize) -> Vec<(bool, bool)> {
        let mut p = ring.poster();
        for &id in ids {
            p.write(NewEntry::new(id, stamp(Instant::now()), true, signaled));
        }
        p.publish();
        let mut out = Vec::new();
        if posted == ids.len() {
            p.commit();
        } else {
            p.settle(posted, |won, credit| out.push((won, credit)));
        }
        out
    }

    #[test]
    fn in_order_retirement_across_segments_recycles_them() {
        let ring = ring();
        let mut silent = Vec::new();
        // Each round spans three segments. From the second round on, the
        // retirement recycles the two the poller left; from the third on,
        // the posts take their segments from the free stack. Four rounds
        // (Miri's) go through allocation, recycling and reuse; were
        // segments never reused, they would leave six free, more than the
        // four the end allows.
        let rounds = if cfg!(miri) { 4 } else { 10u64 };
        for round in 0..rounds {
            let ids: Vec<u64> = (0..SEG * 2 + 3).map(|i| round * 1000 + i).collect();
            post(&ring, &ids, false, ids.len());
            let last = *ids.last().unwrap();
            // The last is unsignaled too, so a success does not name it:
            // an error (a flush) does, and retires every one before it.
            let mut r = ring.retirer();
            assert_eq!(
                r.retire(last, true, true, &mut silent, &mut None),
                (0, false)
            );
            let (credits, found) = r.retire(last, false, true, &mut silent, &mut None);
            assert!(found);
            assert_eq!(credits, ids.len() as u64);
            assert!(r.drained());
            assert_eq!(silent.len(), ids.len() - 1);
            silent.clear();
        }
        // Steady state: the segments went round the free stack.
        let mut n = 0;
        let mut p = ring.free.load(Ordering::Relaxed);
        while !p.is_null() {
            n += 1;
            // SAFETY: test-only walk of a live free stack, no other thread.
            p = unsafe { (*p).free_next.load(Ordering::Relaxed) };
        }
        assert!(n <= 4, "{n} segments free: allocation did not level off");
    }

    #[test]
    fn context_tags_wrap_while_an_old_request_is_outstanding() {
        let ring = ring();
        // Each out-of-order retirement walks from the old request at
        // `head` to the tail, so the test's cost grows with the span's
        // square. Under Miri, a span of four segments: the first link (one
        // segment behind) leaves the tags apart, the second (two behind)
        // refuses them, and after the old request retires the next link,
        // a reused segment, clears the refusal; at eight segments the same
        // code runs, refusing from the sixth link.
        let span = if cfg!(miri) { 4 * SEG } else { 8 * SEG };
        ring.post.lock().span = span;
        let mut silent = Vec::new();
        // One receive left outstanding, then others posted and retired
        // out of order behind it (an SRQ's): `head` stays at the old one.
        post(&ring, &[u64::MAX], true, 1);
        let mut wrapped_at = None;
        for id in 0..span {
            let mut p = ring.poster();
            if p.tags_wrap() {
                wrapped_at = Some(p.next_pos());
                break;
            }
            p.write(NewEntry::new(id, 0, false, true));
            p.publish();
            p.commit();
            drop(p);
            let mut r = ring.retirer();
            assert_eq!(r.retire(id, true, false, &mut silent, &mut None), (0, true));
        }
        // Refused from the first link at which the old request was within
        // two segments of a span behind: before any tag could repeat it.
        let at = wrapped_at.expect("the tags wrap before a span goes by");
        assert!(at + 2 * SEG >= span && at < span, "wrapped at {at}");
        // The old request retired, the next segment linked clears it.
        assert_eq!(
            ring.retirer()
                .retire(u64::MAX, true, false, &mut silent, &mut None),
            (1, true)
        );
        for id in 0..SEG {
            let mut p = ring.poster();
            p.write(NewEntry::new(id, 0, false, true));
            p.publish();
            p.commit();
            drop(p);
            ring.retirer()
                .retire(id, true, false, &mut silent, &mut None);
        }
        assert!(!ring.poster().tags_wrap());
        assert!(silent.is_empty());
    }

    #[test]
    fn a_refused_tail_is_tombstoned_and_skipped() {
        let ring = ring();
        let settled = post(&ring, &[1, 2, 3, 4], true, 1);
        assert_eq!(settled, [(true, true); 3], "three tombstoned, with credits");
        let mut r = ring.retirer();
        assert_eq!(r.count(), 1);
        let mut silent = Vec::new();
        assert_eq!(
            r.retire(3, true, true, &mut silent, &mut None),
            (0, false),
            "dead"
        );
        assert_eq!(r.retire(1, true, true, &mut silent, &mut None), (1, true));
        assert!(r.drained());
        drop(r);
        post(&ring, &[5], true, 1);
        let mut r = ring.retirer();
        assert_eq!(r.retire(5, true, true, &mut silent, &mut None), (1, true));
        assert!(silent.is_empty());
    }

    #[test]
    fn out_of_order_receives_leave_head_at_the_oldest() {
        let ring = ring();
        let ids: Vec<u64> = (0..SEG + 5).collect();
        post(&ring, &ids, true, ids.len());
        let mut silent = Vec::new();
        let mut r = ring.retirer();
        for id in ids.iter().rev().skip(1) {
            assert_eq!(
                r.retire(*id, true, false, &mut silent, &mut None),
                (1, true)
            );
        }
        assert_eq!(r.count(), 1);
        assert!(!r.drained());
        assert_eq!(
            r.retire(ids[ids.len() - 1], true, false, &mut silent, &mut None),
            (1, true)
        );
        assert!(r.drained() && silent.is_empty());
    }

    #[test]
    fn post_times_round_trip() {
        let t = Instant::now();
        let seen = Seen {
            wr_id: 0,
            word: NewEntry::new(0, stamp(t), false, true).word,
            reported: false,
        };
        assert_eq!(seen.at(), t);
        assert!(seen.signaled() && !seen.credit() && !seen.reported());
        // The posting call's stamp, beside the instants read around it.
        let before = Instant::now();
        let seen = Seen {
            wr_id: 0,
            word: NewEntry::new(0, stamp_now(), false, true).word,
            reported: false,
        };
        let after = Instant::now();
        let slack = std::time::Duration::from_micros(20);
        let at = seen.at();
        assert!(at + slack >= before && at <= after + slack, "{at:?}");
    }
}
