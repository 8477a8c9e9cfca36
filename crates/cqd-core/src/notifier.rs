//! Shared completion channels: several CQs, one notification descriptor.
//!
//! On real verbs many CQs share one `ibv_comp_channel`, and
//! `ibv_get_cq_event` says which CQ fired. [`FiredSet`] is that bookkeeping
//! for a backend: each source on the channel is a [`Member`] with its own
//! count of pending notifications, and the channel keeps the list of members
//! that fired. A backend pairs it with one descriptor (an eventfd) and
//! exposes both as a [`SharedNotifier`](crate::source::SharedNotifier); the
//! poller registers that one descriptor for the whole group.
//!
//! # The protocol
//!
//! **Fire** (the backend, when an armed CQ's notification fires):
//!
//! 1. `pending += 1` on the member (Release).
//! 2. If `queued.swap(true)` on the member returned false, push the member
//!    on the channel's ready list (under the list's lock: once per
//!    notification, never per completion).
//! 3. Make the channel's descriptor readable (the backend does).
//!
//! **Take ready** (the channel's one poller, after the descriptor was ready):
//!
//! 4. Drain the descriptor (the backend does, before step 5).
//! 5. Pop every member from the ready list; for each, `queued.swap(false)`
//!    (AcqRel) and report its token.
//!
//! **Take events** (a member's own source, never another's):
//!
//! 6. `pending.swap(0)` (Acquire): the member's notifications, which its
//!    source then counts as its own unacknowledged events (acked per CQ, as
//!    `ibv_ack_cq_events` does).
//!
//! Why nothing is lost: a fire whose step 2 finds `queued` false pushes the
//! member and (step 3) wakes the descriptor after the push, so a later
//! wake-up finds it. A fire whose step 2 finds `queued` true was read by the
//! swap of step 5 only if that swap comes later, and then (AcqRel on both
//! swaps) its step 1 happens before step 5 and so before step 6, which
//! takes it; otherwise the member is still on the list and a later step 5
//! reports it. A member reported with nothing pending (a fire raced steps
//! 5–6) costs one empty take. Step 6 touches one member's counter only, so
//! no source takes another's events. The loom model
//! `tests/loom_notifier.rs` checks this with two members and two firers.

use crate::sync::{Arc, AtomicBool, AtomicU32, Mutex, Ordering};

/// One source on a shared channel: its pending notifications.
#[derive(Debug)]
pub struct Member {
    token: u64,
    pending: AtomicU32,
    queued: AtomicBool,
}

impl Member {
    /// The token the channel reports when this member fired.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Step 6: takes this member's pending notifications (non-blocking);
    /// returns how many.
    pub fn take(&self) -> u32 {
        self.pending.swap(0, Ordering::Acquire)
    }
}

/// The members of a shared channel that fired, in firing order.
#[derive(Debug, Default)]
pub struct FiredSet {
    ready: Mutex<Vec<Arc<Member>>>,
}

impl FiredSet {
    /// An empty set.
    pub fn new() -> Self {
        FiredSet::default()
    }

    /// A new member reported as `token`.
    pub fn member(&self, token: u64) -> Arc<Member> {
        Arc::new(Member {
            token,
            pending: AtomicU32::new(0),
            queued: AtomicBool::new(false),
        })
    }

    /// Steps 1–2: records one notification of `m`. The caller then makes
    /// the channel's descriptor readable (step 3).
    pub fn fire(&self, m: &Arc<Member>) {
        // 1.
        m.pending.fetch_add(1, Ordering::Release);
        // 2.
        if !m.queued.swap(true, Ordering::AcqRel) {
            let mut ready = match self.ready.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            ready.push(Arc::clone(m));
        }
    }

    /// Step 5: appends the tokens of the members that fired since the last
    /// call to `out` (the caller drained the descriptor first, step 4). A
    /// token may come with nothing pending; no member with something
    /// pending is left out.
    pub fn take_ready(&self, out: &mut Vec<u64>) {
        let mut ready = match self.ready.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        for m in ready.drain(..) {
            m.queued.swap(false, Ordering::AcqRel);
            out.push(m.token);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn fired_members_are_reported_once_with_their_own_counts() {
        let set = FiredSet::new();
        let (a, b) = (set.member(1), set.member(2));
        set.fire(&a);
        set.fire(&a);
        set.fire(&b);
        let mut out = Vec::new();
        set.take_ready(&mut out);
        assert_eq!(out, [1, 2]);
        assert_eq!((a.take(), b.take()), (2, 1));
        out.clear();
        set.take_ready(&mut out);
        assert!(out.is_empty());
        set.fire(&b);
        set.take_ready(&mut out);
        assert_eq!(out, [2]);
        assert_eq!((a.take(), b.take()), (0, 1));
    }
}
