//! Handler slots: allocation with generations (shared), and the poller's
//! own slab of handlers (owned by the poller thread, no lock).
//!
//! A slot's life:
//!
//! 1. `register` (any thread) allocates a slot under the `SlotTable` lock,
//!    taking the slot's current generation, and sends the handler to the
//!    poller; the key is returned at once.
//! 2. The poller installs the handler in its `Slab` between batches (or
//!    immediately, if a completion names a slot it has not installed yet).
//! 3. `unregister` marks the entry retiring. It stays in the slab, receiving
//!    completions, until every request posted under it has completed —
//!    flushes included — so its buffers are never reused early.
//! 4. The poller then drops the handler and releases the slot: the
//!    generation moves on, so a late completion carrying the old generation
//!    is counted as stale and never reaches the slot's next owner. A slot
//!    released under its last generation ([`MAX_GENERATION`]) is not freed
//!    but quarantined, its generation reset to 0.
//!
//! Allocation (step 1) takes, in this order:
//!
//! 1. the free slot released longest ago (the free list is a FIFO, so reuse
//!    is spread over every free slot rather than cycling one slot's
//!    generations);
//! 2. a new slot, while the table holds fewer than the 262,144 slots the
//!    wr_id layout can name (growing is preferred to reusing a slot whose
//!    generations are spent);
//! 3. the slot quarantined longest ago, if it has been quarantined for at
//!    least [`QUARANTINE`];
//! 4. otherwise none: [`RegisterError::SlabFull`]. Every slot is then live,
//!    retiring, or quarantined for less than [`QUARANTINE`]; the error
//!    says how many are quarantined, and each comes back once its time is
//!    up (it is checked at the next registration, no timer runs).
//!
//! # What is guaranteed
//!
//! A key (slot, generation) names one registration. A completion reaches a
//! handler only if its wr_id carries that handler's key.
//!
//! - **Tracked requests** (recorded with
//!   [`Registration::track`](crate::cq::Registration::track) before being
//!   posted) are never delivered to a later handler, whatever the
//!   generations do: the slot is released only once the handler's ledger
//!   shows nothing outstanding (step 4), so every tracked request has
//!   completed, flush included, and reached its own handler first.
//! - **Untracked wr_ids** (a raw post that bypassed the ledger, a duplicated
//!   or corrupted completion) are kept out by the generation alone. A key is
//!   issued a second time only when all of these hold:
//!   - its slot has since been registered under each of the other 32,767
//!     generations, and released each time;
//!   - the table has grown to all 262,144 slots and none of them is free
//!     with generations left;
//!   - the slot has been in quarantine for at least [`QUARANTINE`] (60 s)
//!     since its release under its last generation, which came after the
//!     release of the key's earlier registration.
//!
//!   So until a CQ has grown to 262,144 slots no key is ever issued twice,
//!   and after that a late wr_id can reach a later handler only if it is
//!   polled more than 60 s after its own handler was released, and after
//!   32,767 further registrations of its slot. The table grows by at most
//!   one slot per 32,768 releases beyond the most handlers ever registered
//!   at once, and the poller's slab grows with it.
//!
//! The generation stays 15 bits wide: more would come out of the slot or
//! tag (limits users see) or out of the magic marker that catches foreign
//! wr_ids, and would only lengthen a cycle that quarantine already keeps
//! from wrapping onto a key in use.

use crate::handler::Handler;
use crate::sink::Route;
use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};
use crate::sys;
use crate::wr_id::{HandlerKey, OpKind, MAX_GENERATION, MAX_SLOT};
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a slot released under its last generation stays out of use
/// before it may be issued again, starting from generation 0 (allocation
/// step 3 in the [module documentation](self)).
///
/// It only matters once a CQ's table holds every slot the wr_id layout can
/// name: until then a new slot is taken instead. 60 s is far beyond the
/// time an RC work request takes to complete, fail or be flushed at common
/// transport settings (local ACK timeout 14, 7 retries: a few seconds at
/// most), and equals Linux's TCP `TIME_WAIT`, which guards reused port
/// pairs the same way. Nothing bounds a request that waits on an infinite
/// RNR retry count; such requests should be tracked.
pub const QUARANTINE: Duration = Duration::from_secs(60);

/// Slots of the arena's first two chunks; each later chunk holds as many
/// slots as all the chunks before it, so 9 chunks cover the 262,144 slots
/// of a CQ, small CQs allocate little, and the large chunks span whole
/// huge pages.
pub(crate) const CHUNK: u32 = 1024;

/// The chunk holding `slot`'s ledger, and its index there: chunk 0 holds
/// slots `0..CHUNK`, chunk `c >= 1` slots `CHUNK << (c - 1) .. CHUNK << c`.
#[inline]
fn chunk_of(slot: u32) -> (usize, u32) {
    let c = (u32::BITS - (slot / CHUNK).leading_zeros()) as usize;
    let start = if c == 0 { 0 } else { CHUNK << (c - 1) };
    (c, slot - start)
}

/// Slots of chunk `c`.
fn chunk_len(c: usize) -> u32 {
    if c == 0 {
        CHUNK
    } else {
        CHUNK << (c - 1)
    }
}

/// The owner word's bit for "a handler holds the slot" (the low 16 bits
/// hold its generation).
const LIVE: u32 = 1 << 16;
/// In the owner word in place of `LIVE`: allocated to a handler that
/// `register_with` is still making; posts are refused until it is
/// installed.
const PENDING: u32 = 1 << 17;

/// One role's counters of one slot, per kind: a cache line of their own.
#[repr(align(64))]
#[derive(Debug, Default)]
struct Counters([AtomicU64; OpKind::COUNT]);

/// The posters' line of one slot: the posted counters, and the word that
/// says which handler may count in them.
#[repr(align(64))]
#[derive(Debug, Default)]
struct PostLine {
    posted: [AtomicU64; OpKind::COUNT],
    /// `LIVE | generation` of the handler that holds the slot; without
    /// `LIVE` while it is free.
    owner: AtomicU32,
    /// Posters between their check of `owner` and the end of their count
    /// (the closing protocol of [`SlotLedger`]).
    entering: AtomicU32,
}

/// The ledgers of [`CHUNK`] consecutive slots, allocated once and never
/// moved: a [`SlotLedger`] is a reference to its chunk and an index, so a
/// handler costs no allocation of its own. Each role has its own array
/// (posted by posting threads, completed by the poller, flushed by the
/// poller on the rare flush), one cache line per slot, so that posters and
/// the poller never write one line and a completion touches one line of
/// the arena.
#[derive(Debug)]
pub(crate) struct LedgerChunk {
    post: Box<[PostLine]>,
    completed: Box<[Counters]>,
    flushed: Box<[Counters]>,
}

impl LedgerChunk {
    fn new(slots: u32) -> Arc<Self> {
        fn lines<T: Default>(n: u32) -> Box<[T]> {
            let mut v = Vec::with_capacity(n as usize);
            crate::sys::advise_huge_pages(&v);
            v.extend((0..n).map(|_| T::default()));
            v.into_boxed_slice()
        }
        Arc::new(LedgerChunk {
            post: lines(slots),
            completed: lines(slots),
            flushed: lines(slots),
        })
    }
}

/// Posted, completed and flushed counts of one handler, per operation kind.
///
/// `posted` is written by whoever posts (the posting call,
/// [`Registration::post_send`](crate::cq::Registration::post_send), or
/// [`Registration::track`](crate::cq::Registration::track) on the expert
/// path); `completed` and `flushed` only by the poller. `completed` counts
/// every completion — success, error or flush — and `flushed` is the subset
/// that came back with a flush error.
///
/// The counts live in the CQ's ledger arena, one slot's worth per handler
/// slot; this is a view of one handler's. Once its handler has been
/// released (unregistered and drained) a post through it is refused, and
/// its counts stay readable, final, until the slot is given to another
/// handler; from then on every count reads 0 through this view (the
/// counts belong to the next handler).
///
/// # Closing protocol
///
/// A stale registration must never count in the next handler's ledger. A
/// poster counts only between a check of the slot's owner word and the
/// end of its count, announced in `entering`; the poller releases a slot
/// only by closing it:
///
/// 1. poster: `entering += 1`, a SeqCst fence, then reads `owner`; not
///    its key's → `entering -= 1`, refused;
/// 2. poster: adds its posted counts, then `entering -= 1` (Release);
/// 3. poller: writes `owner` without `LIVE`, a SeqCst fence, then reads
///    `entering` (Acquire); if it is not 0, or anything is outstanding,
///    writes `owner` back and retries later; else it releases the slot to
///    the table;
/// 4. the slot's next allocation (under the table's lock) writes `owner`
///    with the new generation, zeroes every count, then sets `LIVE`.
///
/// Steps 1 and 3 are a store, a SeqCst fence and a load on both sides: at
/// least one of them sees the other's store. Either the poster sees the
/// slot closed and counts nothing, or the poller sees it entering and does
/// not release; a count made before the poller's read of `entering` is
/// seen by its check of what is outstanding (step 2's Release decrement,
/// step 3's Acquire read). The loom model `slab::loom_close` checks it
/// (SeqCst loads and stores alone are not enough there: loom treats them
/// as acquire/release, and finds the lost count).
#[derive(Clone)]
pub struct SlotLedger {
    chunk: Arc<LedgerChunk>,
    index: u32,
    generation: u16,
}

impl Default for SlotLedger {
    /// A ledger of its own, outside any CQ (for tests and reports).
    fn default() -> Self {
        let chunk = LedgerChunk::new(1);
        chunk.post[0].owner.store(LIVE, Ordering::Release);
        SlotLedger {
            chunk,
            index: 0,
            generation: 0,
        }
    }
}

impl std::fmt::Debug for SlotLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("SlotLedger");
        for k in OpKind::ALL {
            let (p, c) = (self.posted(k), self.completed(k));
            if p != 0 || c != 0 {
                d.field(k.name(), &(p, c, self.flushed(k)));
            }
        }
        d.finish()
    }
}

impl SlotLedger {
    #[inline]
    fn post_line(&self) -> &PostLine {
        &self.chunk.post[self.index as usize]
    }

    /// True while this view's handler holds the slot.
    fn is_current(&self) -> bool {
        self.post_line().owner.load(Ordering::Acquire) == LIVE | u32::from(self.generation)
    }

    /// `value`, or 0 once the slot was given to another handler. The owner
    /// word is read after the value: the next handler's allocation changes
    /// it before it zeroes the counts (both Release), so a zeroed or new
    /// count is only ever seen together with the owner word that says so.
    fn own(&self, value: u64) -> u64 {
        let owner = self.post_line().owner.load(Ordering::Acquire);
        if owner & !(LIVE | PENDING) == u32::from(self.generation) {
            value
        } else {
            0
        }
    }

    /// Work requests of `kind` recorded as posted.
    pub fn posted(&self, kind: OpKind) -> u64 {
        self.own(self.posted_raw(kind))
    }

    /// Work requests of `kind` completed: success, error or flush, and
    /// unsignaled sends retired by a later completion of their send queue.
    pub fn completed(&self, kind: OpKind) -> u64 {
        self.own(self.completed_raw(kind))
    }

    /// Work requests of `kind` that completed with a flush error (a subset
    /// of [`completed`](Self::completed)).
    pub fn flushed(&self, kind: OpKind) -> u64 {
        self.own(self.chunk.flushed[self.index as usize].0[kind.index()].load(Ordering::Acquire))
    }

    /// Requests posted and not yet completed, all kinds.
    pub fn outstanding(&self) -> u64 {
        self.own(self.outstanding_raw())
    }

    fn posted_raw(&self, kind: OpKind) -> u64 {
        self.post_line().posted[kind.index()].load(Ordering::Acquire)
    }

    fn completed_raw(&self, kind: OpKind) -> u64 {
        self.chunk.completed[self.index as usize].0[kind.index()].load(Ordering::Acquire)
    }

    /// Outstanding, without the owner check (the poller, whose handler
    /// holds the slot until it closes it).
    pub(crate) fn outstanding_raw(&self) -> u64 {
        OpKind::ALL
            .iter()
            .map(|k| self.posted_raw(*k).saturating_sub(self.completed_raw(*k)))
            .sum()
    }

    /// Counts `per_kind` requests as posted, if this view's handler still
    /// holds the slot (closing protocol steps 1–2); false, counting
    /// nothing, once it was released.
    pub(crate) fn add_posted_all(&self, per_kind: &[u64; OpKind::COUNT]) -> bool {
        let line = self.post_line();
        line.entering.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let held = self.is_current();
        if held {
            for (c, &n) in line.posted.iter().zip(per_kind) {
                if n > 0 {
                    c.fetch_add(n, Ordering::AcqRel);
                }
            }
        }
        line.entering.fetch_sub(1, Ordering::Release);
        held
    }

    /// As [`add_posted_all`](Self::add_posted_all) for one kind.
    pub(crate) fn add_posted(&self, kind: OpKind, n: u64) -> bool {
        let mut per_kind = [0; OpKind::COUNT];
        per_kind[kind.index()] = n;
        self.add_posted_all(&per_kind)
    }

    /// Takes back counts made by [`add_posted`](Self::add_posted) (whose
    /// requests were not posted). They keep the slot held until taken
    /// back (nothing outstanding, no close), so the slot is still this
    /// handler's: only its generation is checked, not `LIVE`, which a close
    /// being tried clears for a moment. A view whose slot was given to
    /// another handler takes back nothing (it had counted nothing there).
    pub(crate) fn sub_posted(&self, kind: OpKind, n: u64) {
        let line = self.post_line();
        if line.owner.load(Ordering::Acquire) & !LIVE == u32::from(self.generation) {
            line.posted[kind.index()].fetch_sub(n, Ordering::AcqRel);
        }
    }

    /// Owner-only (the poller thread).
    pub(crate) fn add_flushed(&self, kind: OpKind) {
        let c = &self.chunk.flushed[self.index as usize].0[kind.index()];
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// Owner-only (the poller thread).
    #[inline]
    pub(crate) fn add_completed(&self, kind: OpKind) {
        let c = &self.chunk.completed[self.index as usize].0[kind.index()];
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// Closing protocol step 3 (the poller, for a retiring handler): true
    /// if the slot is closed to this view's handler (its counts stay
    /// readable, final, until the slot's next handler is allocated); false
    /// if a poster is entering or something is outstanding (nothing
    /// changed: try again later).
    pub(crate) fn close(&self) -> bool {
        let line = self.post_line();
        let held = LIVE | u32::from(self.generation);
        line.owner
            .store(u32::from(self.generation), Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if line.entering.load(Ordering::Acquire) != 0 || self.outstanding_raw() != 0 {
            line.owner.store(held, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// True while the slot is allocated to a handler still being made
    /// (`register_with`'s closure runs): its posts are refused.
    pub(crate) fn is_pending(&self) -> bool {
        self.post_line().owner.load(Ordering::Acquire) == PENDING | u32::from(self.generation)
    }

    /// The end of a pending allocation: the handler is installed (its
    /// registration command is queued), posts count from now on.
    pub(crate) fn activate(&self) {
        self.post_line()
            .owner
            .store(LIVE | u32::from(self.generation), Ordering::Release);
    }

    /// Closing protocol step 4 (allocation, under the table's lock): hands
    /// the slot to this view's handler, counts zeroed; `pending` holds its
    /// posts back until [`activate`](Self::activate).
    fn open(&self, pending: bool) {
        let line = self.post_line();
        let i = self.index as usize;
        line.owner
            .store(u32::from(self.generation), Ordering::Release);
        for c in line
            .posted
            .iter()
            .chain(&self.chunk.completed[i].0)
            .chain(&self.chunk.flushed[i].0)
        {
            c.store(0, Ordering::Release);
        }
        let state = if pending { PENDING } else { LIVE };
        line.owner
            .store(state | u32::from(self.generation), Ordering::Release);
    }
}

/// Errors of handler registration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// Every slot the wr_id layout can name holds a handler (live or
    /// retiring) or is quarantined after using all its generations.
    #[error(
        "handler slab of CQ {cq} is full: all {max} slots hold a handler or are in \
         generation quarantine ({quarantined} quarantined)"
    )]
    SlabFull {
        /// The CQ.
        cq: String,
        /// The most handlers one CQ can hold.
        max: u32,
        /// Slots quarantined for less than [`QUARANTINE`]: usable again
        /// once their time is up.
        quarantined: u32,
    },
    /// The key names no live handler.
    #[error("CQ {cq} has no live handler {key}")]
    UnknownKey {
        /// The CQ.
        cq: String,
        /// The key given.
        key: HandlerKey,
    },
    /// The CQ's poller has stopped and its CQ was destroyed.
    #[error("CQ {cq} is closed: its poller stopped")]
    Closed {
        /// The CQ.
        cq: String,
    },
    /// A context table's capacity must be 1 to 2^24 (a request's tag names
    /// its slot).
    #[error("a request context table holds 1 to 16777216 contexts, not {capacity}")]
    Contexts {
        /// The capacity asked for.
        capacity: u32,
    },
}

#[derive(Debug, Clone, Copy)]
struct SlotInfo {
    generation: u16,
    live: bool,
}

/// Slot allocation, shared by every handle of a CQ (behind a lock: it is
/// taken on registration and retirement only, never per completion). The
/// allocation order and what it guarantees are in the
/// [module documentation](self).
#[derive(Debug)]
pub(crate) struct SlotTable {
    slots: Vec<SlotInfo>,
    /// Released slots with generations left, oldest release at the front.
    free: VecDeque<u32>,
    /// Slots released under their last generation, with the time of that
    /// release, oldest at the front.
    quarantine: VecDeque<(u32, Instant)>,
    /// The most slots the table may hold: `MAX_SLOT + 1`.
    limit: u32,
    /// A slot's last generation before quarantine: `MAX_GENERATION`.
    last_generation: u16,
    /// The ledger arena: chunk `i` holds the ledgers of slots
    /// `i * CHUNK ..`, made when the table first grows into it.
    chunks: Vec<Arc<LedgerChunk>>,
}

impl Default for SlotTable {
    fn default() -> Self {
        SlotTable::with_limits(MAX_SLOT + 1, MAX_GENERATION)
    }
}

impl SlotTable {
    /// A table of at most `limit` slots whose generations run from 0 to
    /// `last_generation` (smaller than the wr_id layout's in tests).
    fn with_limits(limit: u32, last_generation: u16) -> Self {
        SlotTable {
            slots: Vec::new(),
            free: VecDeque::new(),
            quarantine: VecDeque::new(),
            limit: limit.min(MAX_SLOT + 1),
            last_generation: last_generation.min(MAX_GENERATION),
            chunks: Vec::new(),
        }
    }

    /// Allocates a slot (steps 1–4) and hands its ledger to the new
    /// handler: the slot's counts, zeroed when its last handler was
    /// closed, now count for `key` alone.
    #[cfg(test)]
    pub(crate) fn alloc_ledger(
        &mut self,
        cq: &str,
    ) -> Result<(HandlerKey, SlotLedger), RegisterError> {
        self.alloc_ledger_as(cq, false)
    }

    /// As [`alloc_ledger`](Self::alloc_ledger); `pending`: the slot's posts
    /// are refused until [`SlotLedger::activate`].
    pub(crate) fn alloc_ledger_as(
        &mut self,
        cq: &str,
        pending: bool,
    ) -> Result<(HandlerKey, SlotLedger), RegisterError> {
        let key = self.alloc(cq)?;
        let (chunk, index) = chunk_of(key.slot());
        while self.chunks.len() <= chunk {
            self.chunks
                .push(LedgerChunk::new(chunk_len(self.chunks.len())));
        }
        let ledger = SlotLedger {
            chunk: Arc::clone(&self.chunks[chunk]),
            index,
            generation: key.generation(),
        };
        ledger.open(pending);
        Ok((key, ledger))
    }

    pub(crate) fn alloc(&mut self, cq: &str) -> Result<HandlerKey, RegisterError> {
        self.alloc_with(cq, Instant::now)
    }

    /// Allocation steps 1–4; the clock is read only for step 3.
    fn alloc_with(
        &mut self,
        cq: &str,
        now: impl FnOnce() -> Instant,
    ) -> Result<HandlerKey, RegisterError> {
        let slot = if let Some(slot) = self.free.pop_front() {
            slot
        } else if self.slots.len() < self.limit as usize {
            self.slots.push(SlotInfo {
                generation: 0,
                live: false,
            });
            (self.slots.len() - 1) as u32
        } else if let Some(slot) = self.quarantine.front().and_then(|&(slot, since)| {
            (now().saturating_duration_since(since) >= QUARANTINE).then_some(slot)
        }) {
            self.quarantine.pop_front();
            slot
        } else {
            return Err(RegisterError::SlabFull {
                cq: cq.to_string(),
                max: self.limit,
                quarantined: self.quarantine.len() as u32,
            });
        };
        let info = &mut self.slots[slot as usize];
        info.live = true;
        // Cannot fail: slots stay below `limit <= MAX_SLOT + 1` and
        // generations at or below `last_generation <= MAX_GENERATION`.
        HandlerKey::new(slot, info.generation).ok_or(RegisterError::SlabFull {
            cq: cq.to_string(),
            max: self.limit,
            quarantined: self.quarantine.len() as u32,
        })
    }

    pub(crate) fn is_live(&self, key: HandlerKey) -> bool {
        self.slots
            .get(key.slot() as usize)
            .is_some_and(|s| s.live && s.generation == key.generation())
    }

    /// Releases a retired slot (step 4 of a slot's life): to the back of
    /// the free list under its next generation, or into quarantine after
    /// its last. A key that is not live is ignored.
    pub(crate) fn release(&mut self, key: HandlerKey) {
        self.release_with(key, Instant::now);
    }

    /// As `release`; the clock is read only when the slot is quarantined.
    fn release_with(&mut self, key: HandlerKey, now: impl FnOnce() -> Instant) {
        let Some(info) = self.slots.get_mut(key.slot() as usize) else {
            return;
        };
        if !info.live || info.generation != key.generation() {
            return;
        }
        info.live = false;
        if info.generation >= self.last_generation {
            info.generation = 0;
            self.quarantine.push_back((key.slot(), now()));
        } else {
            info.generation += 1;
            self.free.push_back(key.slot());
        }
    }
}

/// One installed handler, in one allocation with the handler's own state:
/// what the poller reads per completion — generation, retiring flag,
/// route, the handler's state — shares the handler's cache line (two, for
/// a handler of more than about 24 bytes); only the completed counter is
/// elsewhere, in the arena. `H` is the handler's type when the entry is
/// made (at registration) and `dyn Handler<W>` in the slab.
#[repr(align(64))]
pub(crate) struct Entry<W, H: ?Sized = dyn Handler<W>> {
    pub(crate) generation: u16,
    pub(crate) retiring: bool,
    pub(crate) route: Route,
    pub(crate) ledger: SlotLedger,
    pub(crate) work: PhantomData<fn(W)>,
    pub(crate) handler: H,
}

impl<W, H: Handler<W>> Entry<W, H> {
    /// The entry of a new handler, for the slab (boxed, its handler's type
    /// erased).
    pub(crate) fn boxed(
        key: HandlerKey,
        handler: H,
        route: Route,
        ledger: SlotLedger,
    ) -> Box<Entry<W>> {
        Box::new(Entry {
            generation: key.generation(),
            retiring: false,
            route,
            ledger,
            work: PhantomData,
            handler,
        })
    }
}

/// Slab spans (in slots) above which dispatch prefetches: 4,096 handlers'
/// entries, counters and state (about 150 bytes each over three lines)
/// take 600 KiB, well inside a server core's L2; past that, a completion
/// for a random handler misses it.
const PREFETCH_FROM: usize = 1024;

/// The poller's slab: handlers by slot, no lock. A slot is one pointer
/// (16 bytes, four to a cache line), so the table of 262,144 slots takes
/// 4 MiB.
pub(crate) struct Slab<W> {
    entries: Vec<Option<Box<Entry<W>>>>,
    /// The arena's chunks, by chunk number (the poller's copies), to
    /// prefetch a slot's counters from its number alone.
    chunks: Vec<Option<Arc<LedgerChunk>>>,
}

impl<W> std::fmt::Debug for Slab<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slab")
            .field("installed", &self.entries.iter().flatten().count())
            .finish()
    }
}

impl<W> Default for Slab<W> {
    fn default() -> Self {
        Slab {
            entries: Vec::new(),
            chunks: Vec::new(),
        }
    }
}

impl<W> Slab<W> {
    pub(crate) fn install(&mut self, key: HandlerKey, entry: Box<Entry<W>>) {
        let i = key.slot() as usize;
        if self.entries.len() <= i {
            if i >= PREFETCH_FROM && self.entries.capacity() <= PREFETCH_FROM {
                // Past the cache: room for every slot at once (4 MiB of
                // address space, backed as it is written, in huge pages
                // of 2 MiB), so that the table is never moved again.
                let all = MAX_SLOT as usize + 1;
                self.entries.reserve_exact(all - self.entries.len());
                crate::sys::advise_huge_pages(&self.entries);
            }
            self.entries.resize_with(i + 1, || None);
        }
        let (c, _) = chunk_of(key.slot());
        if self.chunks.len() <= c {
            self.chunks.resize_with(c + 1, || None);
        }
        if self.chunks[c].is_none() {
            self.chunks[c] = Some(Arc::clone(&entry.ledger.chunk));
        }
        self.entries[i] = Some(entry);
    }

    /// True when the slab spans more slots than the cache keeps hot
    /// ([`PREFETCH_FROM`]): dispatch then prefetches each batch's lines.
    #[inline(always)]
    pub(crate) fn is_large(&self) -> bool {
        self.entries.len() > PREFETCH_FROM
    }

    /// Prefetches what `slot`'s number alone locates: its place in the
    /// slab and its completed counters.
    #[inline(always)]
    pub(crate) fn prefetch_slot(&self, slot: u32) {
        if let Some(e) = self.entries.get(slot as usize) {
            sys::prefetch(e);
        }
        let (c, i) = chunk_of(slot);
        if let Some(Some(chunk)) = self.chunks.get(c) {
            if let Some(line) = chunk.completed.get(i as usize) {
                sys::prefetch(line);
            }
        }
    }

    /// Prefetches the entry of `slot` (with its handler's state), once its
    /// place in the slab is at hand.
    #[inline(always)]
    pub(crate) fn prefetch_handler(&self, slot: u32) {
        if let Some(Some(e)) = self.entries.get(slot as usize) {
            sys::prefetch(&**e);
        }
    }

    /// The live entry `key` names, if its generation matches.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: HandlerKey) -> Option<&mut Entry<W>> {
        match self.entries.get_mut(key.slot() as usize) {
            Some(Some(e)) if e.generation == key.generation() => Some(e),
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, key: HandlerKey) -> Option<Box<Entry<W>>> {
        let slot = self.entries.get_mut(key.slot() as usize)?;
        match slot {
            Some(e) if e.generation == key.generation() => slot.take(),
            _ => None,
        }
    }

    /// Every installed entry with its key.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (HandlerKey, &Entry<W>)> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            let e = e.as_deref()?;
            Some((HandlerKey::new(i as u32, e.generation)?, e))
        })
    }

    pub(crate) fn keys(&self) -> impl Iterator<Item = HandlerKey> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            e.as_ref()
                .and_then(|e| HandlerKey::new(i as u32, e.generation))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[test]
    fn generations_move_on_release() {
        let mut t = SlotTable::default();
        let a = t.alloc("cq").unwrap();
        assert!(t.is_live(a));
        t.release(a);
        assert!(!t.is_live(a));
        let b = t.alloc("cq").unwrap();
        assert_eq!(b.slot(), a.slot());
        assert_eq!(b.generation(), a.generation() + 1);
        // Releasing a stale key does nothing.
        t.release(a);
        assert!(t.is_live(b));
    }

    /// Releases `key` and allocates again until the slot has used its last
    /// generation; returns the keys issued.
    fn churn(t: &mut SlotTable, mut key: HandlerKey, at: Instant) -> Vec<HandlerKey> {
        let mut issued = vec![key];
        while key.generation() < t.last_generation {
            t.release_with(key, || at);
            key = t.alloc_with("cq", || at).unwrap();
            assert_eq!(key.slot(), issued[0].slot());
            issued.push(key);
        }
        t.release_with(key, || at);
        issued
    }

    #[test]
    fn free_list_is_fifo() {
        let mut t = SlotTable::default();
        let keys: Vec<_> = (0..4).map(|_| t.alloc("cq").unwrap()).collect();
        for i in [2, 0, 3] {
            t.release(keys[i]);
        }
        // Released longest ago first (a LIFO list would give slot 3).
        let again: Vec<_> = (0..3).map(|_| t.alloc("cq").unwrap().slot()).collect();
        assert_eq!(again, [2, 0, 3]);
        // Free list empty: the table grows.
        assert_eq!(t.alloc("cq").unwrap().slot(), 4);
    }

    #[test]
    fn reuse_is_spread_over_free_slots() {
        let mut t = SlotTable::default();
        let keys: Vec<_> = (0..8).map(|_| t.alloc("cq").unwrap()).collect();
        for k in &keys[1..] {
            t.release(*k);
        }
        // One handler at a time: each registration takes the next free slot
        // in turn, so no slot's generation runs ahead of the others.
        let mut slots = Vec::new();
        for _ in 0..14 {
            let k = t.alloc("cq").unwrap();
            slots.push(k.slot());
            t.release(k);
        }
        assert_eq!(slots, [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7]);
    }

    /// The reported bug: 32,768 registrations of one slot issued its first
    /// key again. Now the spent slot is quarantined and a new slot taken.
    #[test]
    fn spent_slot_is_quarantined_and_the_table_grows() {
        let t0 = Instant::now();
        let mut t = SlotTable::default();
        let first = t.alloc_with("cq", || t0).unwrap();
        let issued = churn(&mut t, first, t0);
        assert_eq!(issued.len(), usize::from(MAX_GENERATION) + 1);
        let next = t.alloc_with("cq", || t0 + QUARANTINE * 10).unwrap();
        assert_eq!((next.slot(), next.generation()), (1, 0));
        assert!(!issued.contains(&next));
        assert!(!t.is_live(first));
        assert_eq!(t.quarantine.len(), 1);
    }

    #[test]
    fn quarantine_ends_after_its_time_when_full() {
        let t0 = Instant::now();
        let mut t = SlotTable::with_limits(2, 3);
        let a = t.alloc_with("cq", || t0).unwrap();
        let _held = t.alloc_with("cq", || t0).unwrap();
        churn(&mut t, a, t0);
        let early = t0 + QUARANTINE - Duration::from_nanos(1);
        assert_eq!(
            t.alloc_with("cq", || early),
            Err(RegisterError::SlabFull {
                cq: "cq".into(),
                max: 2,
                quarantined: 1
            })
        );
        let back = t.alloc_with("cq", || t0 + QUARANTINE).unwrap();
        assert_eq!((back.slot(), back.generation()), (a.slot(), 0));
        assert!(t.quarantine.is_empty());
    }

    #[test]
    fn quarantined_slots_come_back_oldest_first() {
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_secs(1);
        let mut t = SlotTable::with_limits(2, 1);
        let a = t.alloc_with("cq", || t0).unwrap();
        let b = t.alloc_with("cq", || t0).unwrap();
        churn(&mut t, b, t0);
        churn(&mut t, a, t1);
        let at = t1 + QUARANTINE;
        assert_eq!(t.alloc_with("cq", || at).unwrap().slot(), b.slot());
        assert_eq!(t.alloc_with("cq", || at).unwrap().slot(), a.slot());
    }

    #[test]
    fn growth_is_preferred_to_an_expired_quarantine() {
        let t0 = Instant::now();
        let mut t = SlotTable::with_limits(3, 1);
        let a = t.alloc_with("cq", || t0).unwrap();
        churn(&mut t, a, t0);
        let late = t0 + QUARANTINE * 2;
        assert_eq!(t.alloc_with("cq", || late).unwrap().slot(), 1);
        assert_eq!(t.alloc_with("cq", || late).unwrap().slot(), 2);
        assert_eq!(t.alloc_with("cq", || late).unwrap().slot(), a.slot());
    }

    #[test]
    fn full_without_quarantine() {
        let mut t = SlotTable::with_limits(1, MAX_GENERATION);
        let a = t.alloc("cq").unwrap();
        assert_eq!(
            t.alloc("cq"),
            Err(RegisterError::SlabFull {
                cq: "cq".into(),
                max: 1,
                quarantined: 0
            })
        );
        t.release(a);
        assert_eq!(t.alloc("cq").unwrap().generation(), 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc,
        /// Releases the live key at this index (modulo the live count).
        Release(usize),
        /// Moves the clock on by this many seconds.
        Wait(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Alloc),
            4 => any::<usize>().prop_map(Op::Release),
            1 => (0u64..90).prop_map(Op::Wait),
        ]
    }

    proptest! {
        /// The documented rule, checked against a model on a small table
        /// (4 slots, 4 generations): a key is issued again only after its
        /// slot went through every other generation, the table was full
        /// and [`QUARANTINE`] passed since the key's release; and
        /// registration fails only when no slot is usable.
        #[test]
        fn keys_are_reissued_only_by_the_rule(ops in proptest::collection::vec(op(), 1..400)) {
            const SLOTS: u32 = 4;
            const LAST: u16 = 3;
            let t0 = Instant::now();
            let mut now = t0;
            let mut t = SlotTable::with_limits(SLOTS, LAST);
            let mut live: Vec<HandlerKey> = Vec::new();
            // Per key: (issues of its slot before it, time of its release).
            let mut history: HashMap<HandlerKey, (u64, Option<Instant>)> = HashMap::new();
            let mut issues = [0u64; SLOTS as usize];
            // Per slot: when it entered quarantine (if it is in quarantine).
            let mut quarantined: [Option<Instant>; SLOTS as usize] = [None; SLOTS as usize];
            for op in ops {
                match op {
                    Op::Alloc => {
                        let usable = (0..SLOTS as usize).any(|s| {
                            let in_use = live.iter().any(|k| k.slot() as usize == s);
                            let waiting = quarantined[s]
                                .is_some_and(|q| now.duration_since(q) < QUARANTINE);
                            !in_use && !waiting
                        });
                        let Ok(key) = t.alloc_with("cq", || now) else {
                            prop_assert!(!usable, "refused with a usable slot");
                            continue;
                        };
                        prop_assert!(usable);
                        let s = key.slot() as usize;
                        if let Some((before, released)) = history.get(&key) {
                            prop_assert_eq!(issues[s] - before, u64::from(LAST) + 1);
                            prop_assert_eq!(t.slots.len(), SLOTS as usize);
                            let released = released.expect("reissued while live");
                            prop_assert!(now.duration_since(released) >= QUARANTINE);
                        }
                        quarantined[s] = None;
                        history.insert(key, (issues[s], None));
                        issues[s] += 1;
                        live.push(key);
                    }
                    Op::Release(i) if !live.is_empty() => {
                        let key = live.swap_remove(i % live.len());
                        t.release_with(key, || now);
                        history.get_mut(&key).unwrap().1 = Some(now);
                        if key.generation() == LAST {
                            quarantined[key.slot() as usize] = Some(now);
                        }
                    }
                    Op::Release(_) => {}
                    Op::Wait(secs) => now += Duration::from_secs(secs),
                }
            }
        }
    }

    #[test]
    fn ledger_outstanding() {
        let l = SlotLedger::default();
        l.add_posted(OpKind::Send, 3);
        l.add_posted(OpKind::Recv, 2);
        l.add_completed(OpKind::Send);
        assert_eq!(l.outstanding(), 4);
        l.sub_posted(OpKind::Recv, 2);
        assert_eq!(l.outstanding(), 2);
    }

    /// Closes `ledger` for its handler and releases its slot, as the
    /// poller does.
    fn retire(t: &mut SlotTable, key: HandlerKey, ledger: &SlotLedger) {
        assert!(ledger.close());
        t.release(key);
    }

    #[test]
    fn arena_ledger_of_a_reused_slot_starts_from_zero() {
        let mut t = SlotTable::default();
        let (a, la) = t.alloc_ledger("cq").unwrap();
        assert!(la.add_posted(OpKind::Send, 3));
        la.add_completed(OpKind::Send);
        assert!(!la.close(), "outstanding: not closed");
        assert_eq!(
            la.posted(OpKind::Send),
            3,
            "a refused close changes nothing"
        );
        la.add_completed(OpKind::Send);
        la.add_completed(OpKind::Send);
        la.add_flushed(OpKind::Send);
        retire(&mut t, a, &la);
        // Released, not yet reused: the final counts, and no more posts.
        assert_eq!(
            (la.posted(OpKind::Send), la.completed(OpKind::Send)),
            (3, 3)
        );
        assert_eq!(la.flushed(OpKind::Send), 1);
        assert!(!la.add_posted(OpKind::Send, 1));
        let (b, lb) = t.alloc_ledger("cq").unwrap();
        assert_eq!(b.slot(), a.slot());
        for k in OpKind::ALL {
            assert_eq!((lb.posted(k), lb.completed(k), lb.flushed(k)), (0, 0, 0));
        }
        // The stale view reads 0 and counts nothing in the new handler's.
        assert_eq!(la.completed(OpKind::Send), 0);
        assert_eq!(la.flushed(OpKind::Send), 0);
        assert!(!la.add_posted(OpKind::Recv, 1));
        la.sub_posted(OpKind::Recv, 1);
        assert!(lb.add_posted(OpKind::Recv, 2));
        assert_eq!(lb.posted(OpKind::Recv), 2);
        assert_eq!(la.posted(OpKind::Recv), 0);
    }

    #[test]
    fn arena_is_chunked_and_shared_by_slot() {
        let mut t = SlotTable::default();
        let ledgers: Vec<_> = (0..CHUNK + 1)
            .map(|_| t.alloc_ledger("cq").unwrap())
            .collect();
        assert_eq!(t.chunks.len(), 2);
        let (k0, l0) = &ledgers[0];
        let (k1, l1) = &ledgers[CHUNK as usize];
        assert!(Arc::ptr_eq(&l0.chunk, &ledgers[1].1.chunk));
        assert!(!Arc::ptr_eq(&l0.chunk, &l1.chunk));
        assert_eq!((k0.slot(), k1.slot()), (0, CHUNK));
        l0.add_posted(OpKind::Write, 1);
        assert_eq!(ledgers[1].1.posted(OpKind::Write), 0);
        assert_eq!(l1.posted(OpKind::Write), 0);
    }

    #[test]
    fn close_waits_for_an_entering_poster() {
        let mut t = SlotTable::default();
        let (a, la) = t.alloc_ledger("cq").unwrap();
        // A poster between its check and the end of its count.
        la.post_line().entering.fetch_add(1, Ordering::SeqCst);
        assert!(!la.close());
        assert!(la.is_current(), "a refused close leaves the slot held");
        la.post_line().entering.fetch_sub(1, Ordering::SeqCst);
        retire(&mut t, a, &la);
        assert!(!la.is_current());
    }

    struct Small(#[allow(dead_code)] u64);
    impl Handler<()> for Small {
        fn on_send(
            &mut self,
            _: &crate::handler::SendDone<'_>,
            _: &mut crate::handler::Outbox<'_, ()>,
        ) {
        }
        fn on_recv(
            &mut self,
            _: &crate::handler::RecvDone<'_>,
            _: &mut crate::handler::Outbox<'_, ()>,
        ) {
        }
        fn on_error(
            &mut self,
            _: &crate::handler::Failed<'_>,
            _: &mut crate::handler::Outbox<'_, ()>,
        ) {
        }
    }

    #[test]
    fn entry_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Option<Box<Entry<()>>>>(), 16);
        assert_eq!(std::mem::size_of::<Entry<(), Small>>(), 64);
        assert_eq!(std::mem::size_of::<PostLine>(), 64);
        assert_eq!(std::mem::size_of::<Counters>(), 64);
    }
}

/// Loom model of the closing protocol (see [`SlotLedger`]): a poster of a
/// retiring, drained handler racing with the poller's close.
///
/// Run: `RUSTFLAGS="--cfg loom" cargo test -p cqd-core --lib --release slab::loom_close`
#[cfg(all(test, loom))]
mod loom_close {
    use super::*;

    #[test]
    fn a_post_and_a_close_never_both_succeed() {
        loom::model(|| {
            let ledger = SlotLedger::default();
            let poster = ledger.clone();
            let t = loom::thread::spawn(move || poster.add_posted(OpKind::Send, 1));
            let closed = ledger.close();
            let counted = t.join().unwrap();
            assert!(!(closed && counted), "a count landed in a closed slot");
            assert_eq!(ledger.posted_raw(OpKind::Send), u64::from(counted));
            if !closed {
                assert!(ledger.is_current(), "a refused close leaves the slot held");
            }
        });
    }
}
