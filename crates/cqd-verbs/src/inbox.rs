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
//!
//! Besides events, a CQ can be asked to reap its graveyard on its poller's
//! thread ([`push_reap`](AsyncInbox::push_reap)): a QP whose CQs are
//! single-threaded may be destroyed only there (its destroy cleans the
//! CQs, which would race the poller's poll). A reap request counts as
//! pending for the invariant, like an event.
//!
//! Only CQs whose source is alive take events, so the inbox keeps their
//! tokens ([`open`](AsyncInbox::open) / [`close`](AsyncInbox::close)):
//! an event for any other CQ is dropped (traced) rather than kept where no
//! one would take it — which would leave the eventfd readable forever and
//! spin a level-triggered poller.

use std::collections::HashSet;
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
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    events: Vec<(u64, AsyncEvent)>,
    /// CQs asked to reap their graveyard.
    reaps: HashSet<u64>,
    live: HashSet<u64>,
}

impl State {
    fn pending(&self) -> usize {
        self.events.len() + self.reaps.len()
    }
}

impl AsyncInbox {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(AsyncInbox {
            efd: eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?,
            len: AtomicUsize::new(0),
            state: Mutex::new(State::default()),
        })
    }

    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.efd.as_fd()
    }

    /// A source for CQ `token` exists: its events are kept.
    pub(crate) fn open(&self, token: u64) {
        self.state.lock().live.insert(token);
    }

    /// CQ `token`'s source is gone: its events are dropped, now and later.
    pub(crate) fn close(&self, token: u64) {
        let mut st = self.state.lock();
        st.live.remove(&token);
        st.events.retain(|(t, _)| *t != token);
        st.reaps.remove(&token);
        self.settle(&st);
    }

    /// Queues `ev` for the CQ `token` (dropped if it has no source).
    pub(crate) fn push(&self, token: u64, ev: AsyncEvent) {
        let mut st = self.state.lock();
        if !st.live.contains(&token) {
            tracing::warn!(event = ?ev, "asynchronous event for a CQ nobody polls: dropped");
            return;
        }
        st.events.push((token, ev));
        self.raise(&st);
    }

    /// Asks CQ `token`'s poller to reap its graveyard (once, however many
    /// asks come before it takes it); nothing if the CQ has no source.
    /// False then: the caller reaps itself, nobody polls the CQ.
    pub(crate) fn push_reap(&self, token: u64) -> bool {
        let mut st = self.state.lock();
        if !st.live.contains(&token) {
            return false;
        }
        if st.reaps.insert(token) {
            self.raise(&st);
        }
        true
    }

    /// After an addition: publishes the length and, on empty → non-empty,
    /// makes the eventfd readable (under the lock: the invariant).
    fn raise(&self, st: &State) {
        self.len.store(st.pending(), Ordering::Release);
        if st.pending() == 1 {
            if let Err(e) = rustix::io::write(&self.efd, &1u64.to_ne_bytes()) {
                tracing::error!(error = %e, "async inbox: eventfd write failed");
            }
        }
    }

    /// After a removal: publishes the length and, if empty, drains the
    /// eventfd (non-empty → empty, under the lock: the invariant).
    fn settle(&self, st: &State) {
        let was = self.len.swap(st.pending(), Ordering::AcqRel);
        if was > 0 && st.pending() == 0 {
            let mut buf = [0u8; 8];
            let _ = rustix::io::read(&self.efd, &mut buf);
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

    /// Whether CQ `token` was asked to reap (the ask is taken).
    #[cold]
    pub(crate) fn take_reap(&self, token: u64) -> bool {
        let mut st = self.state.lock();
        let asked = st.reaps.remove(&token);
        if asked {
            self.settle(&st);
        }
        asked
    }

    #[cold]
    fn take_slow(&self, token: u64) -> Option<AsyncEvent> {
        let mut st = self.state.lock();
        let i = st.events.iter().position(|(t, _)| *t == token)?;
        let (_, ev) = st.events.remove(i);
        self.settle(&st);
        Some(ev)
    }

    /// Events and reap requests waiting (one load: the poller's check).
    #[inline]
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
        for t in 1..=3 {
            i.open(t);
        }
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
    fn a_reap_request_is_pending_until_taken_and_asked_once() {
        let i = AsyncInbox::new().unwrap();
        i.open(1);
        assert!(!i.push_reap(2), "no source: the caller reaps");
        assert!(i.push_reap(1));
        assert!(i.push_reap(1));
        assert!(readable(&i));
        assert_eq!(i.len(), 1, "asked once");
        i.push(1, AsyncEvent::DeviceFatal);
        assert!(i.take_reap(1));
        assert!(!i.take_reap(1));
        assert!(readable(&i), "the event is still there");
        assert_eq!(i.take(1), Some(AsyncEvent::DeviceFatal));
        assert!(!readable(&i));
        assert!(i.push_reap(1));
        i.close(1);
        assert!(!readable(&i) && i.len() == 0);
    }

    #[test]
    fn each_cq_takes_its_own_in_order() {
        let i = AsyncInbox::new().unwrap();
        i.open(0);
        i.open(1);
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

    #[test]
    fn events_of_a_cq_without_a_source_never_keep_the_fd_readable() {
        let i = AsyncInbox::new().unwrap();
        i.open(1);
        // No source for CQ 2: dropped at once.
        i.push(2, AsyncEvent::DeviceFatal);
        assert!(!readable(&i));
        assert_eq!(i.len(), 0);
        // CQ 1's source goes with an event pending: purged, fd drained.
        i.push(1, AsyncEvent::DeviceFatal);
        assert!(readable(&i));
        i.close(1);
        assert!(!readable(&i));
        assert_eq!(i.take(1), None);
        i.push(1, AsyncEvent::DeviceFatal);
        assert!(!readable(&i), "a closed CQ gets nothing more");
    }
}
