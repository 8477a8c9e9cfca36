//! Who may still add a receive completion of a QP: the requesters (of any
//! process) inside the responder part of a request to it
//! (`provider::remote::Remote::enter`), and its owner while it flushes
//! (`SvQp::to_error`). The QP's last-WQE event waits until none is left
//! (provider::events); the clean of its completions at destroy or RESET
//! waits until none is left or only dead ones are (provider::purge): a
//! requester whose process died inside never leaves.
//!
//! The table is [`Insiders`], in the QP's shared header: [`SLOTS`] slots,
//! each 0 or the claim [`Token`] of one process (shm::claimer: its pid and
//! start time) whose QPN field counts that process's threads inside, and a
//! count of the insiders no slot had room for, whose processes are not
//! known.
//!
//! Protocol:
//! 1. Entering is one SeqCst read-modify-write: raise the count of a slot
//!    that holds this process, else take an empty slot (count 1), else
//!    raise `unplaced`. The [`Entry`] says which.
//! 2. Then the insider reads the QP's state (SeqCst) and acts on it.
//! 3. Leaving undoes the entry's read-modify-write (SeqCst); a slot whose
//!    count falls to 0 becomes 0 again. An insider publishes every
//!    completion it adds before it leaves.
//! 4. Whoever changes the QP's state (SeqCst) and then reads the table
//!    (SeqCst, [`Insiders::none`], [`Insiders::only_dead`]) either sees an
//!    insider that entered before, or that insider's step 2 sees the new
//!    state: in the single order of SeqCst operations, the entry (1) comes
//!    before the table is read, or after the state changed, so before its
//!    own state read (2).
//!
//! Slots are only taken (step 1) and freed (step 3) by their own process,
//! so an [`Entry`] names its slot until it leaves. A slot of a process that
//! died inside keeps its count for good.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::claimer::Token;

/// Processes a QP's table can name (a connected QP's requesters are its
/// peer's; more at once are counted in `unplaced`).
pub const SLOTS: usize = 4;

/// The insiders of one QP (in its shared header).
#[repr(C)]
#[derive(Debug)]
pub struct Insiders {
    slots: [AtomicU64; SLOTS],
    unplaced: AtomicU32,
    _pad: u32,
}

/// Where an insider counted itself (step 1), for its leave (step 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry(Option<usize>);

impl Insiders {
    /// Step 1 for this process.
    pub fn enter(&self) -> Entry {
        let me = Token::mine(0);
        // A slot of this process first, so that its threads share one.
        for want_mine in [true, false] {
            for (i, s) in self.slots.iter().enumerate() {
                let mut cur = s.load(Ordering::Relaxed);
                loop {
                    let next = match Token::from_word(cur) {
                        Some(t) if t.with_qpn(0) == me && t.qpn() < MAX_COUNT => {
                            t.with_qpn(t.qpn() + 1)
                        }
                        None if cur == 0 && !want_mine => me.with_qpn(1),
                        _ => break,
                    };
                    match s.compare_exchange(cur, next.word(), Ordering::SeqCst, Ordering::Relaxed)
                    {
                        Ok(_) => return Entry(Some(i)),
                        Err(now) => cur = now,
                    }
                }
            }
        }
        self.unplaced.fetch_add(1, Ordering::SeqCst);
        Entry(None)
    }

    /// Step 3 for the insider that entered with `e`.
    pub fn leave(&self, e: Entry) {
        let Some(i) = e.0 else {
            self.unplaced.fetch_sub(1, Ordering::SeqCst);
            return;
        };
        let s = &self.slots[i];
        let mut cur = s.load(Ordering::Relaxed);
        loop {
            // The slot holds this process's token with a count of at
            // least 1 (steps 1 and 3); anything else (a header another
            // process overwrote) is left alone rather than trusted.
            let Some(t) = Token::from_word(cur).filter(|t| t.qpn() > 0) else {
                return;
            };
            let next = if t.qpn() == 1 {
                0
            } else {
                t.with_qpn(t.qpn() - 1).word()
            };
            match s.compare_exchange(cur, next, Ordering::SeqCst, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// Whether nobody is inside (step 4). An insider of a dead process
    /// counts: it may hold a receive it never completed (shm::claim).
    pub fn none(&self) -> bool {
        self.unplaced.load(Ordering::SeqCst) == 0
            && self.slots.iter().all(|s| s.load(Ordering::SeqCst) == 0)
    }

    /// Whether every insider left or belongs to a process proven dead
    /// ([`Token::claimer_dead`]), which adds nothing more (step 4). Reads
    /// `/proc` for each occupied slot.
    pub fn only_dead(&self) -> bool {
        self.unplaced.load(Ordering::SeqCst) == 0
            && self.slots.iter().all(|s| {
                let w = s.load(Ordering::SeqCst);
                w == 0 || Token::from_word(w).is_some_and(Token::claimer_dead)
            })
    }
}

/// The most threads of one process one slot counts (the QPN field's
/// range); more go to the next slot.
const MAX_COUNT: u32 = (1 << 24) - 1;

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Insiders {
        Insiders {
            slots: Default::default(),
            unplaced: AtomicU32::new(0),
            _pad: 0,
        }
    }

    #[test]
    fn threads_of_one_process_share_a_slot() {
        let t = table();
        assert!(t.none() && t.only_dead());
        let a = t.enter();
        let b = t.enter();
        assert_eq!((a, b), (Entry(Some(0)), Entry(Some(0))));
        assert!(!t.none() && !t.only_dead(), "this process is alive");
        t.leave(a);
        assert!(!t.none());
        t.leave(b);
        assert!(t.none());
        assert_eq!(
            t.slots[0].load(Ordering::Relaxed),
            0,
            "the slot is free again"
        );
    }

    #[test]
    fn dead_processes_are_told_apart_and_full_tables_overflow() {
        let t = table();
        // pid 0 names no process: dead (shm::claimer's tests do the same).
        let dead = Token::of(0, 1, 0).with_qpn(2).word();
        t.slots[0].store(dead, Ordering::Relaxed);
        assert!(!t.none(), "a dead insider still counts for the event");
        assert!(t.only_dead(), "but adds nothing more");
        let mine = t.enter();
        assert_eq!(mine, Entry(Some(1)));
        assert!(!t.only_dead());
        t.leave(mine);
        assert!(t.only_dead());
        // Every slot held by another process: the count of the unplaced.
        for s in &t.slots[1..] {
            s.store(dead, Ordering::Relaxed);
        }
        let over = t.enter();
        assert_eq!(over, Entry(None));
        assert!(
            !t.only_dead(),
            "an unplaced insider is not known to be dead"
        );
        t.leave(over);
        assert!(t.only_dead());
    }

    /// Threads entering and leaving at once leave the table empty.
    #[test]
    fn concurrent_entries_balance() {
        let t = table();
        const ROUNDS: usize = if cfg!(miri) { 50 } else { 20_000 };
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    for _ in 0..ROUNDS {
                        let e = t.enter();
                        assert!(!t.none());
                        t.leave(e);
                    }
                });
            }
        });
        assert!(t.none());
    }
}
