//! Doorbells: cross-process wake-ups without a timer.
//!
//! A requester whose send waits for its responder (no receive WQE: RNR; the
//! responder not yet at RTR) is retried by the progress thread of *its*
//! process; what unblocks it happens in the *responder's* process (a
//! `post_recv`, a `modify_qp`). A [`Doorbell`] in the responder's shared
//! header joins the two: the responder [`ring`](Doorbell::ring)s it after
//! every such change, and the waiting progress thread sleeps on it with a
//! futex (shared futexes are keyed by file and offset, so the word wakes
//! sleepers of every process that maps the segment), several at once with
//! `futex_waitv` (Linux 5.16).
//!
//! Protocol (no lost wake-up):
//! - sleeper: [`arm`](Doorbell::arm) (`sleepers += 1`, then read `seq`),
//!   then re-check the condition (retry the send), then wait while `seq`
//!   still has the value read, then [`disarm`](Doorbell::disarm);
//! - ringer: make the change (push the WQE, store the state), `seq += 1`,
//!   then `FUTEX_WAKE` only if `sleepers > 0`.
//!
//! All four steps are sequentially consistent, so either the ringer sees the
//! sleeper counted and wakes it, or the sleeper's read of `seq` comes after
//! the increment (and its re-check after the change): the futex then
//! returns at once. The common case — nobody waiting — costs the ringer two
//! atomic operations and no system call. A sleeper that dies armed leaves
//! `sleepers` high: ringers then make a useless wake call, nothing worse.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A wake-up word pair in a shared header.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Doorbell {
    /// Bumped by every ring; the futex word.
    pub seq: AtomicU32,
    /// Progress threads (of any process) about to sleep or asleep on `seq`.
    pub sleepers: AtomicU32,
}

impl Doorbell {
    /// After a change a sleeper may be waiting for: wake them all.
    pub fn ring(&self) {
        self.seq.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) != 0 {
            wake(&self.seq, false);
        }
    }

    /// Announce a sleeper; returns the `seq` value to wait on. Re-check the
    /// condition after this, before waiting.
    pub fn arm(&self) -> u32 {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        self.seq.load(Ordering::SeqCst)
    }

    /// The sleeper is done (after its wait).
    pub fn disarm(&self) {
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

/// `FUTEX2_SIZE_U32` (linux/futex.h).
const FUTEX2_SIZE_U32: u32 = 0x02;
/// `FUTEX2_PRIVATE` (linux/futex.h).
const FUTEX2_PRIVATE: u32 = 128;
/// `FUTEX_WAITV_MAX` (linux/futex.h).
pub const WAITV_MAX: usize = 128;

/// `struct futex_waitv` (linux/futex.h), mirrored by hand (libc's has a
/// private field).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct FutexWaitv {
    val: u64,
    uaddr: u64,
    flags: u32,
    reserved: u32,
}

/// `FUTEX_WAKE` every waiter of `word`; `private` for a word only this
/// process maps (no shared key lookup).
pub fn wake(word: &AtomicU32, private: bool) {
    let op = if private {
        libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG
    } else {
        libc::FUTEX_WAKE
    };
    // SAFETY: FUTEX_WAKE reads no memory through the address (it is only
    // the key); `word` is a valid, aligned u32.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), op, i32::MAX) };
}

/// One word to sleep on: the futex, the value read, whether it is private.
#[derive(Debug, Clone, Copy)]
pub struct Watch<'a> {
    /// The futex word.
    pub word: &'a AtomicU32,
    /// The value read before the condition was re-checked.
    pub val: u32,
    /// Whether only this process maps the word.
    pub private: bool,
}

/// How [`wait_any`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// A word was rung (or had already changed), or a signal came.
    Woken,
    /// `timeout` passed.
    TimedOut,
    /// The kernel has no `futex_waitv` (before 5.16): nothing slept.
    Unsupported,
}

/// Sleep until one of `watches` changes or is rung, or `timeout` passes
/// (`None`: no limit). At most [`WAITV_MAX`] words are watched (the rest
/// are ignored: callers pass a timeout then).
pub fn wait_any(watches: &[Watch<'_>], timeout: Option<Duration>) -> Waited {
    let v: Vec<FutexWaitv> = watches
        .iter()
        .take(WAITV_MAX)
        .map(|w| FutexWaitv {
            val: u64::from(w.val),
            uaddr: w.word.as_ptr() as u64,
            flags: FUTEX2_SIZE_U32 | if w.private { FUTEX2_PRIVATE } else { 0 },
            reserved: 0,
        })
        .collect();
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    let tsp = match timeout {
        None => std::ptr::null_mut(),
        Some(d) => {
            // futex_waitv takes an absolute time on the given clock.
            // SAFETY: a valid timespec to fill.
            unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
            let nsec = ts.tv_nsec as u64 + u64::from(d.subsec_nanos());
            ts.tv_sec = ts
                .tv_sec
                .saturating_add(d.as_secs().min(i64::MAX as u64 / 2) as libc::time_t)
                .saturating_add((nsec / 1_000_000_000) as libc::time_t);
            ts.tv_nsec = (nsec % 1_000_000_000) as libc::c_long;
            &mut ts as *mut libc::timespec
        }
    };
    // SAFETY: `v` is an array of v.len() futex_waitv entries whose words
    // are live for the call (borrowed from `watches`); `tsp` is null or a
    // valid absolute CLOCK_MONOTONIC time.
    let r = unsafe {
        libc::syscall(
            libc::SYS_futex_waitv,
            v.as_ptr(),
            v.len() as libc::c_uint,
            0 as libc::c_uint,
            tsp,
            libc::CLOCK_MONOTONIC,
        )
    };
    if r >= 0 {
        return Waited::Woken;
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ETIMEDOUT) => Waited::TimedOut,
        Some(libc::ENOSYS) => Waited::Unsupported,
        _ => Waited::Woken, // EAGAIN: a word had changed; EINTR.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn futex_waitv_layout() {
        use std::mem::{offset_of, size_of};
        // linux/futex.h: __u64 val, __u64 uaddr, __u32 flags, __u32 __reserved.
        assert_eq!(size_of::<FutexWaitv>(), 24);
        assert_eq!(offset_of!(FutexWaitv, val), 0);
        assert_eq!(offset_of!(FutexWaitv, uaddr), 8);
        assert_eq!(offset_of!(FutexWaitv, flags), 16);
        assert_eq!(offset_of!(FutexWaitv, reserved), 20);
        assert_eq!(size_of::<Doorbell>(), 8);
    }

    #[test]
    fn changed_word_returns_at_once_and_timeout_expires() {
        let d = Doorbell::default();
        let v = d.arm();
        d.ring();
        let w = [Watch {
            word: &d.seq,
            val: v,
            private: false,
        }];
        let t = Instant::now();
        let r = wait_any(&w, Some(Duration::from_secs(5)));
        if r == Waited::Unsupported {
            return;
        }
        assert_eq!(r, Waited::Woken);
        assert!(t.elapsed() < Duration::from_secs(1));
        let w = [Watch {
            word: &d.seq,
            val: d.seq.load(Ordering::SeqCst),
            private: false,
        }];
        assert_eq!(
            wait_any(&w, Some(Duration::from_millis(5))),
            Waited::TimedOut
        );
        d.disarm();
    }

    #[test]
    fn ring_wakes_a_sleeper() {
        let d = Arc::new(Doorbell::default());
        let d2 = Arc::clone(&d);
        let t = std::thread::spawn(move || {
            let v = d2.arm();
            let w = [Watch {
                word: &d2.seq,
                val: v,
                private: false,
            }];
            let r = wait_any(&w, Some(Duration::from_secs(10)));
            d2.disarm();
            r
        });
        while d.sleepers.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        let t0 = Instant::now();
        d.ring();
        let r = t.join().expect("sleeper");
        assert_ne!(r, Waited::TimedOut, "the ring did not wake the sleeper");
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
}
