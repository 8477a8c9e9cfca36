//! The asynchronous events waiting for the CQs of one completion channel.
//!
//! The device's event reader ([`crate::device`]) pushes; the CQs' one
//! poller takes, each CQ only its own. The inbox has an eventfd, in the
//! poller's epoll set as the CQs' `async_fd`, and keeps one invariant under
//! its lock: **the eventfd is readable if and only if the inbox holds an
//! event**. The push makes it readable on the empty → non-empty step; the
//! take that empties the inbox drains it. So a poller asleep in epoll is
//! woken for every event, and never spins on an eventfd left readable
//! with nothing to take. With nothing pending, a take is one atomic load
//! (the poller calls it on every loop in Busy mode).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};

use cqd_core::source::AsyncEvent;
use parking_lot::Mutex;
use rustix::event::{eventfd, EventfdFlags};

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct AsyncInbox {
    efd: OwnedFd,
    len: AtomicUsize,
    events: Mutex<Vec<(u64, AsyncEvent)>>,
}

impl AsyncInbox {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(AsyncInbox {
            efd: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?,
            len: AtomicUsize::new(0),
            events: Mutex::new(Vec::new()),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.efd.as_fd()
    }

    /// Queues `ev` for the CQ `token`.
    pub(crate) fn push(&self, token: u64, ev: AsyncEvent) {
        let mut events = self.events.lock();
        events.push((token, ev));
        self.len.store(events.len(), Ordering::Release);
        if events.len() == 1 {
            // Empty → non-empty: readable (under the lock: the invariant).
            if let Err(e) = rustix::io::write(&self.efd, &1u64.to_ne_bytes()) {
                tracing::error!(error = %e, "async inbox: eventfd write failed");
            }
        }
    }

    /// The oldest event of CQ `token`, if any.
    #[inline]
    pub(crate) fn take(&self, token: u64) -> Option<AsyncEvent> {
        if self.len.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.take_slow(token)
    }

    #[cold]
    fn take_slow(&self, token: u64) -> Option<AsyncEvent> {
        let mut events = self.events.lock();
        let i = events.iter().position(|(t, _)| *t == token)?;
        let (_, ev) = events.remove(i);
        self.len.store(events.len(), Ordering::Release);
        if events.is_empty() {
            // Non-empty → empty: drained (under the lock: the invariant).
            let mut buf = [0u8; 8];
            let _ = rustix::io::read(&self.efd, &mut buf);
        }
        Some(ev)
    }

    /// Events waiting (for tests and metrics).
    pub(crate) fn len(&self) -> usize {
        self.len.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn readable(i: &AsyncInbox) -> bool {
        let mut fds = [rustix::event::PollFd::new(
            &i.efd,
            rustix::event::PollFlags::IN,
        )];
        rustix::event::poll(&mut fds, Some(&rustix::time::Timespec::default())).unwrap() == 1
    }

    #[test]
    fn readable_exactly_while_something_is_pending() {
        let i = AsyncInbox::new().unwrap();
        assert!(!readable(&i));
        assert_eq!(i.take(1), None);
        i.push(1, AsyncEvent::DeviceFatal);
        i.push(
            2,
            AsyncEvent::CqOverflow {
                capacity: 4,
                lost: 0,
            },
        );
        assert!(readable(&i));
        // CQ 3 has nothing; the others' events stay, and so does readiness.
        assert_eq!(i.take(3), None);
        assert!(readable(&i));
        assert_eq!(
            i.take(2),
            Some(AsyncEvent::CqOverflow {
                capacity: 4,
                lost: 0
            })
        );
        assert!(readable(&i));
        assert_eq!(i.take(1), Some(AsyncEvent::DeviceFatal));
        assert!(!readable(&i));
        assert_eq!(i.len(), 0);
        i.push(1, AsyncEvent::Other(99));
        assert!(readable(&i));
    }

    #[test]
    fn each_cq_takes_its_own_in_order() {
        let i = AsyncInbox::new().unwrap();
        for n in 0..4 {
            i.push(n % 2, AsyncEvent::Other(n as u32));
        }
        assert_eq!(i.take(1), Some(AsyncEvent::Other(1)));
        assert_eq!(i.take(1), Some(AsyncEvent::Other(3)));
        assert_eq!(i.take(1), None);
        assert_eq!(i.take(0), Some(AsyncEvent::Other(0)));
        assert_eq!(i.take(0), Some(AsyncEvent::Other(2)));
        assert!(!readable(&i));
    }
}
