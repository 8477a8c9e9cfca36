//! The machine-wide lock table behind remote atomics (segment `atomics`).
//!
//! A remote atomic (compare-and-swap, fetch-and-add) is a read-modify-write
//! of 8 bytes in the responder's memory, which the requester reaches with
//! `process_vm_readv`/`process_vm_writev` (another process) or a pointer
//! (this process). Neither is atomic with respect to a requester in a third
//! process doing the same, so every atomic, whatever process it comes from
//! and whatever process it targets, first takes the lock of its target in
//! this table: slot `hash(responder pid, address) % SLOTS`, held across the
//! read, the compare/add and the write. Two atomics on one address always
//! meet on one slot (distinct addresses may share a slot: that only
//! serialises them). The guarantee is the one `IBV_ATOMIC_HCA` states:
//! atomics are atomic among themselves — on this device, from any process
//! — not against plain CPU loads and stores of the memory owner.
//!
//! A slot holds 0 (free) or the pid of the holder. A holder that dies with
//! the lock held (killed between its read and its write: the lock is held
//! for two system calls at most) is detected by a waiter that has spun for
//! a while: the pid no longer exists, and the waiter takes the slot over
//! with a compare-and-swap of that very pid.

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use super::segment::{open_shared, Segment};

/// Lock slots in the table.
pub const SLOTS: usize = 4096;

/// The lock table.
#[derive(Debug)]
pub struct AtomicLocks {
    seg: Arc<Segment>,
}

/// The table slot of an 8-byte word at `addr` in process `pid`'s address
/// space.
pub fn slot_of(pid: u32, addr: u64) -> usize {
    let k = (u64::from(pid) << 40) ^ (addr >> 3);
    // Fibonacci hashing: the top bits of a multiplication by 2^64/φ.
    (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SLOTS.trailing_zeros())) as usize
}

/// Spins (with `sched_yield` after the first few) before a waiter asks
/// whether the holder is still alive.
const SPINS_BEFORE_LIVENESS: u32 = 1024;

fn pid_gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

impl AtomicLocks {
    /// The table, mapped once per process (created zeroed — all free — by
    /// whoever comes first).
    ///
    /// # Errors
    /// The OS error of creating or mapping `atomics`.
    pub fn get() -> io::Result<&'static AtomicLocks> {
        static T: OnceLock<AtomicLocks> = OnceLock::new();
        if let Some(t) = T.get() {
            return Ok(t);
        }
        let seg = open_shared("atomics", SLOTS * 4)?;
        Ok(T.get_or_init(|| AtomicLocks { seg }))
    }

    fn word(&self, slot: usize) -> &AtomicU32 {
        // SAFETY: the mapping is SLOTS * 4 bytes, page-aligned; `slot %
        // SLOTS` is in range; every process only accesses it atomically.
        unsafe { &*self.seg.base().cast::<AtomicU32>().add(slot % SLOTS) }
    }

    /// Lock the slot of (`pid`, `addr`) for this process until the guard
    /// drops.
    pub fn lock(&self, pid: u32, addr: u64) -> AtomicGuard<'_> {
        let me = crate::provider::xfer::my_pid();
        let w = self.word(slot_of(pid, addr));
        let mut spins = 0u32;
        loop {
            let cur = w.load(Ordering::Relaxed);
            if cur == 0 {
                if w.compare_exchange_weak(0, me, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
                {
                    return AtomicGuard { w };
                }
                continue;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
            if spins >= SPINS_BEFORE_LIVENESS {
                spins = 0;
                if cur != me
                    && pid_gone(cur)
                    && w.compare_exchange(cur, me, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                {
                    // The holder died inside its read-modify-write: its
                    // write either happened or not, the word is whole.
                    return AtomicGuard { w };
                }
            }
        }
    }
}

/// A held slot of [`AtomicLocks`].
#[derive(Debug)]
pub struct AtomicGuard<'a> {
    w: &'a AtomicU32,
}

impl Drop for AtomicGuard<'_> {
    fn drop(&mut self) {
        self.w.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_one_slot_and_spread() {
        assert_eq!(slot_of(7, 0x1000), slot_of(7, 0x1000));
        assert!(slot_of(7, 0x1000) < SLOTS);
        let mut seen = std::collections::HashSet::new();
        for i in 0..256u64 {
            seen.insert(slot_of(1234, 0x7f00_0000_0000 + i * 8));
        }
        assert!(
            seen.len() > 200,
            "neighbouring words spread: {}",
            seen.len()
        );
    }
}
