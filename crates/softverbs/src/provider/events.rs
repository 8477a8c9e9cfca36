//! Asynchronous events of QPs and SRQs (rules: model::event): raising them
//! from any process, counting them as the owner reads them, and keeping the
//! element pointer valid until every record naming it is read.
//!
//! Records are `ib_uverbs_async_event_desc`s written into the owner
//! context's async pipe (the `async_fd` `ibv_get_async_event` reads), the
//! element being the owner's `struct ibv_qp *` / `struct ibv_srq *`
//! (`QpHeader::qp_ptr`, `SrqHeader::srq_ptr`).
//!
//! Raising (any process; [`raise`]):
//! 1. nothing when the owner's device died (its pipe is closed for good);
//! 2. `events += 1` (SeqCst), then, if `gone` is set, `events -= 1` and
//!    nothing;
//! 3. open `/proc/<pid>/fd/<async_fd>`, check it is the context's pipe
//!    (`CtxHeader::async_ino`), write the 16-byte record (atomic: less than
//!    `PIPE_BUF`), close. On failure `events -= 1`.
//!
//! Reading (owner; [`on_read`], the provider's `async_event` hook, which
//! `ibv_get_async_event` calls after each record): the element's count of
//! records read goes up by one in this process's registry.
//!
//! Destroying (owner; [`retire`]): `gone = 1` (SeqCst) first, then compare
//! `events` (records written) with the records read. SeqCst on both sides
//! means a raiser either sees `gone` or is counted in `events`.
//! - Equal: every record was read. As libibverbs does for kernel devices,
//!   destroy then waits until the application acked them all
//!   (`events_completed` of the `ibv_qp`/`ibv_srq`, under its mutex, which
//!   `ibv_ack_async_event` increments), and frees the object.
//! - Not equal: a record naming the object may still be in the pipe (the
//!   kernel would drop it; a pipe cannot): the object is torn down but its
//!   memory is kept (a "zombie": the `ibv_qp`/`ibv_srq` part stays valid
//!   for `ibv_ack_async_event`) until the context is closed
//!   (closing the context frees them). No allocation reuse can make such a record name a
//!   newer object.
//!
//! Last WQE reached ([`last_wqe`], model::event): a consumer that reads the
//! event and then polls the QP's receive CQ until it is empty has seen
//! every receive completion of the QP (the kernel's `__ib_drain_srq` relies
//! on it). So:
//! 1. whoever may add a receive completion of the QP is counted among its
//!    insiders while it does (shm::insiders): a requester inside a request
//!    to it, and the owner while `SvQp::to_error` flushes, from before it
//!    stores ERR until its flush is published;
//! 2. the QP's state goes to ERR (SeqCst), by the owner or by a requester
//!    inside (`Remote::fail`);
//! 3. whoever leaves the insiders, and the owner after its flush, calls
//!    [`last_wqe`], which raises the event when the QP is in ERR and
//!    nobody is inside, once per stay in ERR (`QpHeader::last_wqe`).
//!    An insider that comes after step 2 sees ERR and adds nothing
//!    (shm::insiders step 4); the one that raises the event saw every
//!    earlier one gone, each with its completions published.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};

use super::fatal::async_record;
use crate::model::event::QP_LAST_WQE_REACHED;
use crate::model::qp::QpState;
use crate::shm::layout::{CtxHeader, QpHeader};

/// Which provider object a registry entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An `SvQp`.
    Qp,
    /// An `SvSrq`.
    Srq,
}

#[derive(Debug)]
struct Entry {
    ctx: usize,
    kind: Kind,
    read: u32,
    zombie: bool,
}

fn registry() -> std::sync::MutexGuard<'static, HashMap<usize, Entry>> {
    static R: OnceLock<Mutex<HashMap<usize, Entry>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Record a new QP or SRQ of context `ctx` (its `ibv_context *`).
pub fn register(obj: usize, ctx: usize, kind: Kind) {
    registry().insert(
        obj,
        Entry {
            ctx,
            kind,
            read: 0,
            zombie: false,
        },
    );
}

/// The `async_event` hook: one record naming `obj` was read. Elements that
/// are not (or no longer) ours are ignored.
pub fn on_read(obj: usize) {
    if let Some(e) = registry().get_mut(&obj) {
        e.read = e.read.wrapping_add(1);
    }
}

/// What destroy does with the object's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retire {
    /// Free it once `read` events are acked.
    Free {
        /// Records the application read (and must ack).
        read: u32,
    },
    /// Keep it until the context closes.
    Zombie,
}

/// Destroy step: `gone` is set, `written` is the object's `events` counter
/// read after that (SeqCst).
pub fn retire(obj: usize, written: u32) -> Retire {
    let mut r = registry();
    match r.get_mut(&obj) {
        Some(e) if e.read != written => {
            e.zombie = true;
            Retire::Zombie
        }
        Some(e) => {
            let read = e.read;
            r.remove(&obj);
            Retire::Free { read }
        }
        None => Retire::Free { read: 0 },
    }
}

/// Forget every object of context `ctx`; returns the zombies to free.
pub fn take_zombies(ctx: usize) -> Vec<(usize, Kind)> {
    let mut r = registry();
    let mine: Vec<usize> = r
        .iter()
        .filter(|(_, e)| e.ctx == ctx)
        .map(|(&k, _)| k)
        .collect();
    let mut out = Vec::new();
    for k in mine {
        if let Some(e) = r.remove(&k) {
            if e.zombie {
                out.push((k, e.kind));
            }
        }
    }
    out
}

/// Wait until `events_completed` (protected by `mutex`, signalled on
/// `cond` by `ibv_ack_async_event`) reaches `read`.
///
/// # Safety
/// The three pointers are the fields of one live `ibv_qp` or `ibv_srq`
/// whose mutex and condition variable are initialised (zeroed, or by
/// libibverbs).
pub unsafe fn wait_acks(
    mutex: *mut libc::pthread_mutex_t,
    cond: *mut libc::pthread_cond_t,
    completed: *const u32,
    read: u32,
) {
    if read == 0 {
        return;
    }
    // SAFETY: caller contract; the loop is libibverbs' own
    // (ibv_cmd_destroy_qp): read the counter under the mutex, sleep on the
    // condition variable the ack signals.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        while std::ptr::read_volatile(completed) < read {
            libc::pthread_cond_wait(cond, mutex);
        }
        libc::pthread_mutex_unlock(mutex);
    }
}

/// Raise event `ty` naming `element` for an object whose shared counters
/// are `events`/`gone`, in the context described by `ctx` (see the module
/// docs). Returns whether a record was written.
pub fn raise(ctx: &CtxHeader, events: &AtomicU32, gone: &AtomicU32, element: u64, ty: u32) -> bool {
    if ctx.dead.load(Ordering::Acquire) != 0 {
        return false;
    }
    events.fetch_add(1, Ordering::SeqCst);
    if gone.load(Ordering::SeqCst) != 0 || !write_record(ctx, &async_record(element, ty)) {
        events.fetch_sub(1, Ordering::SeqCst);
        return false;
    }
    true
}

/// Raise `IBV_EVENT_QP_LAST_WQE_REACHED` for the QP `qp` of context `ctx`
/// if it is due (model::event): the QP is on an SRQ, in ERR, nobody may
/// still add a receive completion of it (its insiders, shm::insiders: none
/// left, or only processes proven dead, which add nothing more, as the
/// purge's P3 takes them), and the event was not raised yet in this stay
/// in ERR (step 3 of "Last WQE reached" above). A requester killed inside
/// a request to the QP never leaves: without the second rule the owner's
/// move to ERR after it would raise nothing, where a NIC raises the event
/// however its peer died.
pub fn last_wqe(ctx: &CtxHeader, qp: &QpHeader) {
    if qp.srq == 0
        || QpState::from_u32(qp.state.load(Ordering::SeqCst)) != Some(QpState::Err)
        || !(qp.insiders.none() || qp.insiders.only_dead())
    {
        return;
    }
    if qp.last_wqe.swap(1, Ordering::AcqRel) == 0 {
        raise(ctx, &qp.events, &qp.gone, qp.qp_ptr, QP_LAST_WQE_REACHED);
    }
}

/// Write one record into the async pipe of the context `ctx` describes,
/// from any process.
fn write_record(ctx: &CtxHeader, rec: &[u8; 16]) -> bool {
    if ctx.async_fd < 0 {
        return false;
    }
    let Ok(path) = std::ffi::CString::new(format!("/proc/{}/fd/{}", ctx.pid, ctx.async_fd)) else {
        return false;
    };
    // SAFETY: valid C string; the result is checked. O_NONBLOCK: a FIFO
    // opened for writing never waits for a reader (the owner holds one).
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return false;
    }
    // SAFETY: a fresh descriptor we own; closed on drop.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: all-zero is a valid `stat`; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open, `st` writable.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0
        || st.st_mode & libc::S_IFMT != libc::S_IFIFO
        || st.st_ino != ctx.async_ino
    {
        return false;
    }
    // SAFETY: `rec` is a valid 16-byte buffer (< PIPE_BUF: one atomic
    // write); a full pipe (EAGAIN) drops the record.
    let n = unsafe { libc::write(fd.as_raw_fd(), rec.as_ptr().cast(), rec.len()) };
    n == rec.len() as isize
}

/// The inode of the pipe end `fd` (for `CtxHeader::async_ino`), 0 on error.
pub fn pipe_ino(fd: i32) -> u64 {
    // SAFETY: all-zero is a valid `stat`.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is writable; a bad fd is reported, not faulted on.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return 0;
    }
    st.st_ino
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retire_frees_when_every_record_was_read() {
        register(0x1000, 7, Kind::Qp);
        on_read(0x1000);
        assert_eq!(retire(0x1000, 1), Retire::Free { read: 1 });
        // Gone from the registry: a stray record is ignored.
        on_read(0x1000);
        assert!(take_zombies(7).is_empty());
    }

    #[test]
    fn retire_keeps_objects_with_unread_records() {
        register(0x2000, 8, Kind::Srq);
        register(0x3000, 8, Kind::Qp);
        assert_eq!(retire(0x2000, 1), Retire::Zombie);
        on_read(0x2000); // read after destroy: still counted, still kept
        assert_eq!(take_zombies(8), vec![(0x2000, Kind::Srq)]);
        assert!(take_zombies(8).is_empty());
    }
}
