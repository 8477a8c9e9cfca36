//! Memory windows (type 2): a key of their own onto part of a region, for
//! one peer, for one request.
//!
//! A region's rkey, once sent, reaches the whole region for as long as it
//! is registered. A [`Window`] narrows that: it belongs to one RC queue
//! pair ([`Qp::alloc_window`](crate::Qp::alloc_window)); a bind work request
//! ([`SendWr::bind`](crate::SendWr::bind)) opens it over one buffer with
//! the remote access one request needs and gives the key to send to the
//! peer; an invalidate ([`SendWr::invalidate`](crate::SendWr::invalidate))
//! closes it. The peer can reach the buffer only through that QP, only
//! between the bind and the invalidate (the device answers anything else
//! with a remote access error on the peer's request, and both QPs go to
//! the error state).
//!
//! The rules the posting call enforces, so that a window is never left
//! in a state the device would refuse (or, on the kernel's rxe of 6.1,
//! crash on: invalidating a window twice dereferences a null QP there):
//!
//! - a window is bound only when it is not bound, and invalidated only
//!   when it is (the posting call tracks the state, in posting order);
//! - it is bound and invalidated only on its own QP, over a region of the
//!   QP's protection domain registered with [`Access::MW_BIND`](crate::Access::MW_BIND), granting
//!   only remote access (remote write or atomic also needs the region's
//!   local write);
//! - each bind takes the next key (the low 8 bits move on), so a key sent
//!   for one request is refused for the next 255 binds of the window (the
//!   key byte is 8 bits: the 256th bind names it again, over whatever
//!   buffer that request binds).
//!
//! The owner closes its windows itself; cqd-verbs has no SEND with
//! invalidate, by which a peer would close them: the owner's state would
//! then follow the peer's (on rxe, kernel 6.1, the receive completion does
//! not even say `IBV_WC_WITH_INV`: it sets the kernel's bit for it, 1 << 2,
//! not libibverbs' 1 << 3), and a local invalidate of a window a peer
//! closed is the double invalidate above.
//!
//! The QP owns its windows' device objects: they are deallocated before
//! the QP is destroyed (a type-2 window bound to a destroyed QP is a
//! device error on rxe), whether the [`Window`] or the QP goes first. A
//! window dropped while its bind is in flight fails that bind (the QP
//! goes to the error state): keep the window until the request is done.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, Ordering};
use std::sync::{Arc, Weak};

use crate::sys;

/// A window's shared state: its device object (null once deallocated),
/// the key its latest bind posted, and whether it is bound.
pub(crate) struct WindowInner {
    mw: AtomicPtr<sys::ibv_mw>,
    /// The QP it belongs to (its `ibv_qp`'s address: unique while it lives,
    /// and the QP outlives the window's device object).
    pub(crate) qp: usize,
    pub(crate) qpn: u32,
    /// The key of the latest bind posted (the device's initial key before).
    key: AtomicU32,
    /// Bound in posting order: set by a posted bind, cleared by a posted
    /// invalidate. Changed only under the QP's posting lock.
    bound: AtomicBool,
    device: String,
}

impl WindowInner {
    pub(crate) fn new(mw: NonNull<sys::ibv_mw>, qp: usize, qpn: u32, device: String) -> Self {
        // SAFETY: `mw` is live (just allocated).
        let key = unsafe { mw.as_ref().rkey };
        WindowInner {
            mw: AtomicPtr::new(mw.as_ptr()),
            qp,
            qpn,
            key: AtomicU32::new(key),
            bound: AtomicBool::new(false),
            device,
        }
    }

    /// The device object, if not yet deallocated.
    pub(crate) fn raw(&self) -> Option<NonNull<sys::ibv_mw>> {
        NonNull::new(self.mw.load(Ordering::Acquire))
    }

    pub(crate) fn key(&self) -> u32 {
        self.key.load(Ordering::Relaxed)
    }

    pub(crate) fn is_bound(&self) -> bool {
        self.bound.load(Ordering::Relaxed)
    }

    /// A bind of key `key` was posted (under the QP's posting lock). The
    /// `ibv_mw`'s own rkey follows: the provider reads it as the window's
    /// current key at the next bind (the kernel updates its copy when the
    /// bind executes, the provider never does).
    pub(crate) fn posted_bind(&self, key: u32) {
        if let Some(mw) = self.raw() {
            // SAFETY: the window is live (deallocation takes the pointer
            // first, and happens only with no post in progress: the QP's
            // drop, or the last `Window` gone); its rkey is written only
            // here, under the QP's posting lock.
            unsafe { (*mw.as_ptr()).rkey = key };
        }
        self.key.store(key, Ordering::Relaxed);
        self.bound.store(true, Ordering::Relaxed);
    }

    /// An invalidate was posted (under the QP's posting lock).
    pub(crate) fn posted_invalidate(&self) {
        self.bound.store(false, Ordering::Relaxed);
    }

    /// Deallocates the device object, once (the QP's drop or the window's).
    pub(crate) fn dealloc(&self) {
        let mw = self.mw.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if let Some(mw) = NonNull::new(mw) {
            // SAFETY: taken out above, so no other call sees it again.
            if let Err(e) = unsafe { sys::dealloc_mw(mw) } {
                tracing::error!(device = %self.device, qpn = self.qpn, error = %e, "ibv_dealloc_mw failed");
            }
        }
    }
}

impl Drop for WindowInner {
    fn drop(&mut self) {
        self.dealloc();
    }
}

/// The windows of one QP, deallocated before it is destroyed.
#[derive(Default)]
pub(crate) struct Windows(parking_lot::Mutex<Vec<Weak<WindowInner>>>);

impl Windows {
    pub(crate) fn add(&self, w: &Arc<WindowInner>) {
        let mut v = self.0.lock();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(w));
    }

    /// Before the QP is destroyed: every window still alive loses its
    /// device object (its `Window` then refuses to be posted).
    pub(crate) fn dealloc_all(&self) {
        for w in self.0.lock().drain(..) {
            if let Some(w) = w.upgrade() {
                w.dealloc();
            }
        }
    }
}

/// A type-2 memory window of one RC queue pair ([`Qp::alloc_window`]).
///
/// [`Qp::alloc_window`]: crate::Qp::alloc_window
pub struct Window {
    pub(crate) inner: Arc<WindowInner>,
}

impl fmt::Debug for Window {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Window")
            .field("qpn", &self.inner.qpn)
            .field("key", &format_args!("{:#x}", self.inner.key()))
            .field("bound", &self.inner.is_bound())
            .finish()
    }
}

impl Window {
    /// The key of the latest bind posted (the one a peer names), or the
    /// device's initial key before any.
    pub fn rkey(&self) -> u32 {
        self.inner.key()
    }

    /// The key the next bind will give (what [`SendWr::bind`] returns),
    /// for a caller that writes the key into its message first.
    ///
    /// [`SendWr::bind`]: crate::SendWr::bind
    pub fn next_rkey(&self) -> u32 {
        next_key(self.inner.key())
    }

    /// True between a posted bind and a posted invalidate.
    pub fn is_bound(&self) -> bool {
        self.inner.is_bound()
    }

    /// The QP number of the QP it belongs to.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }
}

/// The next key of a window (`ibv_inc_rkey`: the low 8 bits move on, the
/// window's index stays).
pub(crate) fn next_key(key: u32) -> u32 {
    (key & 0xffff_ff00) | (key.wrapping_add(1) & 0xff)
}

/// What a bind may grant: remote access only, at least one kind.
pub(crate) const GRANTABLE: u32 = sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
    | sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
    | sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn next_key_moves_the_low_byte_only() {
        assert_eq!(next_key(0x1234_5600), 0x1234_5601);
        assert_eq!(next_key(0x1234_56ff), 0x1234_5600);
        assert_eq!(next_key(u32::MAX), 0xffff_ff00);
    }
}
