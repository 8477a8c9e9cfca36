//! Moving bytes between registered buffers: a plain copy inside one process
//! (no system call), Linux cross-memory attach (`process_vm_writev` /
//! `process_vm_readv`, one copy) between processes.
//!
//! Callers have validated every span against an MR table first; a span that
//! is nevertheless unmapped in another process yields `false` (EFAULT), never
//! a fault in this process.

use std::sync::atomic::{AtomicU32, Ordering};

/// A byte range in some process's address space.
#[derive(Debug, Clone, Copy, Default)]
pub struct Span {
    /// Address.
    pub addr: u64,
    /// Length.
    pub len: usize,
}

fn total(s: &[Span]) -> usize {
    s.iter().map(|x| x.len).sum()
}

/// Copy `src` spans into `dst` spans, in order, both in this process.
///
/// # Safety
/// Every span is mapped, readable (`src`) or writable (`dst`), in this process.
unsafe fn copy_local(dst: &[Span], src: &[Span]) {
    let (mut di, mut doff) = (0usize, 0usize);
    for s in src {
        let mut soff = 0;
        while soff < s.len {
            let Some(d) = dst.get(di) else { return };
            let n = (s.len - soff).min(d.len - doff);
            // SAFETY: both ranges are within mapped spans (caller contract);
            // `copy` tolerates overlap (a buffer sent to itself).
            unsafe {
                std::ptr::copy(
                    (s.addr as usize + soff) as *const u8,
                    (d.addr as usize + doff) as *mut u8,
                    n,
                );
            }
            soff += n;
            doff += n;
            if doff == d.len {
                di += 1;
                doff = 0;
            }
        }
    }
}

fn iovs(s: &[Span]) -> Vec<libc::iovec> {
    s.iter()
        .filter(|x| x.len > 0)
        .map(|x| libc::iovec {
            iov_base: x.addr as usize as *mut libc::c_void,
            iov_len: x.len,
        })
        .collect()
}

static MY_PID: AtomicU32 = AtomicU32::new(0);

extern "C" fn forget_pid_after_fork() {
    MY_PID.store(0, Ordering::Relaxed);
}

/// This process's id, cached (no system call on the fast path) and
/// forgotten in a forked child.
pub fn my_pid() -> u32 {
    let p = MY_PID.load(Ordering::Relaxed);
    if p != 0 {
        return p;
    }
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registering a child handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forget_pid_after_fork)) };
    });
    let p = std::process::id();
    MY_PID.store(p, Ordering::Relaxed);
    p
}

/// Copy local `src` into `dst` of process `pid`. Returns false on a fault.
///
/// # Safety
/// `src` spans are readable in this process; when `pid` is this process,
/// `dst` spans are writable here too.
pub unsafe fn write_to(pid: u32, dst: &[Span], src: &[Span]) -> bool {
    let n = total(src);
    if n == 0 {
        return true;
    }
    if total(dst) < n {
        return false;
    }
    if pid == my_pid() {
        // SAFETY: caller contract.
        unsafe { copy_local(dst, src) };
        return true;
    }
    let (l, r) = (iovs(src), iovs(dst));
    // SAFETY: iovec arrays are valid for their lengths; the kernel checks
    // the remote ranges and reports EFAULT instead of faulting us.
    let got = unsafe {
        libc::process_vm_writev(
            pid as libc::pid_t,
            l.as_ptr(),
            l.len() as _,
            r.as_ptr(),
            r.len() as _,
            0,
        )
    };
    got >= 0 && got as usize == n
}

/// Copy `src` of process `pid` into local `dst`. Returns false on a fault.
///
/// # Safety
/// `dst` spans are writable in this process; when `pid` is this process,
/// `src` spans are readable here too.
pub unsafe fn read_from(pid: u32, dst: &[Span], src: &[Span]) -> bool {
    let n = total(src);
    if n == 0 {
        return true;
    }
    if total(dst) < n {
        return false;
    }
    if pid == my_pid() {
        // SAFETY: caller contract.
        unsafe { copy_local(dst, src) };
        return true;
    }
    let (l, r) = (iovs(dst), iovs(src));
    // SAFETY: as in write_to.
    let got = unsafe {
        libc::process_vm_readv(
            pid as libc::pid_t,
            l.as_ptr(),
            l.len() as _,
            r.as_ptr(),
            r.len() as _,
            0,
        )
    };
    got >= 0 && got as usize == n
}

/// Execute a remote atomic on the 8-byte word at `addr` in process `pid`
/// under its slot of the machine-wide lock table (shm::atomics), so that
/// it is atomic with respect to every other atomic on that word, from any
/// process. Returns the word's original value, or `None` when the word is
/// unreachable (unmapped in the peer: EFAULT) or the table cannot be
/// mapped.
///
/// # Safety
/// When `pid` is this process, `addr` is a mapped, writable, 8-byte
/// aligned word of it.
pub unsafe fn atomic_rmw(pid: u32, addr: u64, op: crate::model::atomic::AtomicOp) -> Option<u64> {
    let locks = crate::shm::atomics::AtomicLocks::get().ok()?;
    let _held = locks.lock(pid, addr);
    if pid == my_pid() {
        // SAFETY: caller contract: aligned, mapped and writable here. The
        // lock serialises us with atomics of other processes; an atomic
        // access also keeps this thread's access race-free in Rust terms.
        let w = unsafe { &*(addr as usize as *const std::sync::atomic::AtomicU64) };
        let old = w.load(Ordering::Acquire);
        if let Some(new) = op.apply(old) {
            w.store(new, Ordering::Release);
        }
        return Some(old);
    }
    let mut old = 0u64;
    let word = [Span { addr, len: 8 }];
    let here = [Span {
        addr: std::ptr::addr_of_mut!(old) as u64,
        len: 8,
    }];
    // SAFETY: `here` is our local 8-byte variable; the kernel checks the
    // remote range.
    if !unsafe { read_from(pid, &here, &word) } {
        return None;
    }
    if let Some(new) = op.apply(old) {
        let src = [Span {
            addr: std::ptr::addr_of!(new) as u64,
            len: 8,
        }];
        // SAFETY: as above, in the other direction.
        if !unsafe { write_to(pid, &word, &src) } {
            return None;
        }
    }
    Some(old)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scatter_gather_local() {
        let a = *b"hello world";
        let mut b = [0u8; 4];
        let mut c = [0u8; 8];
        let src = [Span {
            addr: a.as_ptr() as u64,
            len: 11,
        }];
        let dst = [
            Span {
                addr: b.as_mut_ptr() as u64,
                len: 4,
            },
            Span {
                addr: c.as_mut_ptr() as u64,
                len: 8,
            },
        ];
        // SAFETY: all spans are live local arrays.
        assert!(unsafe { write_to(my_pid(), &dst, &src) });
        assert_eq!(&b, b"hell");
        assert_eq!(&c[..7], b"o world");
        // SAFETY: as above.
        assert!(!unsafe { write_to(my_pid(), &dst[..1], &src) });
    }
}
