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
//!    is counted as stale and never reaches the slot's next owner.

use crossbeam_utils::CachePadded;

use crate::handler::Handler;
use crate::sink::Route;
use crate::sync::{AtomicU64, Ordering};
use crate::wr_id::{HandlerKey, OpKind, MAX_GENERATION, MAX_SLOT};
use std::sync::Arc;

/// Posted and completed counts of one handler, per operation kind.
///
/// `posted` is written by whoever posts (through
/// [`Registration::track`](crate::cq::Registration::track)); `completed` only
/// by the poller.
#[derive(Debug, Default)]
pub struct SlotLedger {
    /// Written by posting threads; on its own cache line so that posts and
    /// completions do not bounce one line between poster and poller.
    posted: CachePadded<[AtomicU64; OpKind::COUNT]>,
    /// Written by the poller only.
    completed: CachePadded<[AtomicU64; OpKind::COUNT]>,
    /// Written by the poller only (flushes are rare).
    flushed: [AtomicU64; OpKind::COUNT],
}

impl SlotLedger {
    /// Work requests of `kind` recorded as posted.
    pub fn posted(&self, kind: OpKind) -> u64 {
        self.posted[kind.index()].load(Ordering::Acquire)
    }

    /// Work requests of `kind` completed (success, error or flush).
    pub fn completed(&self, kind: OpKind) -> u64 {
        self.completed[kind.index()].load(Ordering::Acquire)
    }

    /// Work requests of `kind` that completed with a flush error (a subset
    /// of [`completed`](Self::completed)).
    pub fn flushed(&self, kind: OpKind) -> u64 {
        self.flushed[kind.index()].load(Ordering::Acquire)
    }

    /// Requests posted and not yet completed, all kinds.
    pub fn outstanding(&self) -> u64 {
        OpKind::ALL
            .iter()
            .map(|k| self.posted(*k).saturating_sub(self.completed(*k)))
            .sum()
    }

    pub(crate) fn add_posted(&self, kind: OpKind, n: u64) {
        self.posted[kind.index()].fetch_add(n, Ordering::AcqRel);
    }

    pub(crate) fn sub_posted(&self, kind: OpKind, n: u64) {
        self.posted[kind.index()].fetch_sub(n, Ordering::AcqRel);
    }

    /// Owner-only (the poller thread).
    pub(crate) fn add_flushed(&self, kind: OpKind) {
        let c = &self.flushed[kind.index()];
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Release);
    }

    /// Owner-only (the poller thread).
    #[inline]
    pub(crate) fn add_completed(&self, kind: OpKind) {
        let c = &self.completed[kind.index()];
        c.store(c.load(Ordering::Relaxed) + 1, Ordering::Release);
    }
}

/// Errors of handler registration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegisterError {
    /// Every slot the wr_id layout can name is taken.
    #[error("handler slab of CQ {cq} is full ({max} handlers)")]
    SlabFull {
        /// The CQ.
        cq: String,
        /// The most handlers one CQ can hold.
        max: u32,
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
}

#[derive(Debug, Clone, Copy)]
struct SlotInfo {
    generation: u16,
    live: bool,
}

/// Slot allocation, shared by every handle of a CQ (behind a lock: it is
/// taken on registration and retirement only, never per completion).
#[derive(Debug, Default)]
pub(crate) struct SlotTable {
    slots: Vec<SlotInfo>,
    free: Vec<u32>,
}

impl SlotTable {
    pub(crate) fn alloc(&mut self, cq: &str) -> Result<HandlerKey, RegisterError> {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = self.slots.len() as u32;
                if slot > MAX_SLOT {
                    return Err(RegisterError::SlabFull {
                        cq: cq.to_string(),
                        max: MAX_SLOT + 1,
                    });
                }
                self.slots.push(SlotInfo {
                    generation: 0,
                    live: false,
                });
                slot
            }
        };
        let info = &mut self.slots[slot as usize];
        info.live = true;
        HandlerKey::new(slot, info.generation).ok_or(RegisterError::SlabFull {
            cq: cq.to_string(),
            max: MAX_SLOT + 1,
        })
    }

    pub(crate) fn is_live(&self, key: HandlerKey) -> bool {
        self.slots
            .get(key.slot() as usize)
            .is_some_and(|s| s.live && s.generation == key.generation())
    }

    /// Releases a retired slot; its generation moves on (wrapping).
    pub(crate) fn release(&mut self, key: HandlerKey) {
        if let Some(info) = self.slots.get_mut(key.slot() as usize) {
            if info.live && info.generation == key.generation() {
                info.live = false;
                info.generation = if info.generation == MAX_GENERATION {
                    0
                } else {
                    info.generation + 1
                };
                self.free.push(key.slot());
            }
        }
    }
}

/// One installed handler.
pub(crate) struct Entry<W> {
    pub(crate) generation: u16,
    pub(crate) handler: Box<dyn Handler<W>>,
    pub(crate) ledger: Arc<SlotLedger>,
    pub(crate) route: Route,
    pub(crate) retiring: bool,
}

/// The poller's slab: handlers by slot, no lock.
pub(crate) struct Slab<W> {
    entries: Vec<Option<Entry<W>>>,
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
        }
    }
}

impl<W> Slab<W> {
    pub(crate) fn install(&mut self, key: HandlerKey, entry: Entry<W>) {
        let i = key.slot() as usize;
        if self.entries.len() <= i {
            self.entries.resize_with(i + 1, || None);
        }
        self.entries[i] = Some(entry);
    }

    /// The live entry `key` names, if its generation matches.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: HandlerKey) -> Option<&mut Entry<W>> {
        match self.entries.get_mut(key.slot() as usize) {
            Some(Some(e)) if e.generation == key.generation() => Some(e),
            _ => None,
        }
    }

    pub(crate) fn remove(&mut self, key: HandlerKey) -> Option<Entry<W>> {
        let slot = self.entries.get_mut(key.slot() as usize)?;
        match slot {
            Some(e) if e.generation == key.generation() => slot.take(),
            _ => None,
        }
    }

    /// Every installed entry with its key.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (HandlerKey, &Entry<W>)> + '_ {
        self.entries.iter().enumerate().filter_map(|(i, e)| {
            let e = e.as_ref()?;
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
}
