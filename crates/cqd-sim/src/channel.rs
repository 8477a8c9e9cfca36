//! Shared completion channels (`ibv_comp_channel`): one descriptor for
//! every simulated CQ made on it. The channel's descriptor becomes readable
//! when any of its CQs fires; [`SimChannel::take_ready`] says which (the
//! bookkeeping and its protocol are `cqd_core::notifier`'s); each CQ takes
//! and acknowledges only its own notifications. The CQs' asynchronous
//! events share the channel's second descriptor.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use cqd_core::ledger::WrLedger;
use cqd_core::notifier::FiredSet;
use cqd_core::source::{SharedNotifier, SourceError};
use rustix::event::{eventfd, EventfdFlags};

use crate::cq::{check_capacity, make_cq, Faults, Notify, SimCq, SimCqError, SimCqSource};

/// A shared completion channel (`ibv_comp_channel`): one descriptor for
/// every CQ made on it; see the module documentation.
#[derive(Debug, Clone)]
pub struct SimChannel {
    inner: Arc<ChannelInner>,
}

#[derive(Debug)]
pub(crate) struct ChannelInner {
    pub(crate) fired: FiredSet,
    pub(crate) event_fd: OwnedFd,
    pub(crate) async_fd: OwnedFd,
    /// Asynchronous events pending on the channel's CQs.
    pub(crate) async_total: AtomicUsize,
    next_token: AtomicU64,
}

impl SharedNotifier for ChannelInner {
    fn fd(&self) -> BorrowedFd<'_> {
        self.event_fd.as_fd()
    }

    fn take_ready(&self, out: &mut Vec<u64>) -> Result<(), SourceError> {
        // Step 4 of `cqd_core::notifier`: drain, then step 5.
        let mut buf = [0u8; 8];
        match rustix::io::read(&self.event_fd, &mut buf) {
            Ok(_) | Err(rustix::io::Errno::AGAIN) => {}
            Err(e) => {
                return Err(SourceError::Os {
                    op: "read channel eventfd",
                    source: e.into(),
                })
            }
        }
        self.fired.take_ready(out);
        Ok(())
    }
}

impl SimChannel {
    /// A channel with no CQ yet: two descriptors (notifications and
    /// asynchronous events) for all the CQs it will serve.
    ///
    /// # Errors
    /// An eventfd failure.
    pub fn new() -> Result<Self, SimCqError> {
        let flags = EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC;
        Ok(SimChannel {
            inner: Arc::new(ChannelInner {
                fired: FiredSet::new(),
                event_fd: eventfd(0, flags).map_err(std::io::Error::from)?,
                async_fd: eventfd(0, flags).map_err(std::io::Error::from)?,
                async_total: AtomicUsize::new(0),
                next_token: AtomicU64::new(0),
            }),
        })
    }

    /// As [`sim_cq`](crate::sim_cq), on this channel: the CQ has no descriptor of its own.
    ///
    /// # Errors
    /// [`SimCqError::BadCapacity`].
    pub fn cq(
        &self,
        name: impl Into<String>,
        capacity: u32,
        faults: Faults,
    ) -> Result<(SimCq, SimCqSource), SimCqError> {
        self.cq_with_ledger(name, capacity, faults, WrLedger::new())
    }

    /// As [`sim_cq_with_ledger`](crate::sim_cq_with_ledger), on this channel.
    ///
    /// # Errors
    /// [`SimCqError::BadCapacity`].
    pub fn cq_with_ledger(
        &self,
        name: impl Into<String>,
        capacity: u32,
        faults: Faults,
        ledger: WrLedger,
    ) -> Result<(SimCq, SimCqSource), SimCqError> {
        check_capacity(capacity)?;
        let token = self.inner.next_token.fetch_add(1, Ordering::Relaxed);
        let member = self.inner.fired.member(token);
        make_cq(
            name.into(),
            capacity,
            faults,
            ledger,
            Notify::Channel {
                chan: Arc::clone(&self.inner),
                member,
            },
        )
    }

    /// The channel's notification descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.event_fd.as_fd()
    }

    /// Drains the descriptor and appends the tokens of the CQs that fired
    /// (see [`SharedNotifier::take_ready`]).
    ///
    /// # Errors
    /// A failed read.
    pub fn take_ready(&self, out: &mut Vec<u64>) -> Result<(), SourceError> {
        self.inner.take_ready(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cqd_core::completion::{Completion, Opcode};
    use cqd_core::source::{ArmKind, CompletionSource};
    use std::os::fd::AsRawFd;

    fn wc(i: u64) -> Completion {
        Completion::success(i, Opcode::Send, 1)
    }

    #[test]
    fn a_channel_says_which_cq_fired_and_each_takes_its_own() {
        let chan = SimChannel::new().unwrap();
        let (a, mut sa) = chan.cq("a", 8, Faults::default()).unwrap();
        let (b, mut sb) = chan.cq("b", 8, Faults::default()).unwrap();
        let (ta, tb) = (sa.notifier().unwrap().1, sb.notifier().unwrap().1);
        assert_ne!(ta, tb);
        assert_eq!(sa.event_fd().as_raw_fd(), chan.fd().as_raw_fd());
        sa.arm(ArmKind::Next).unwrap();
        sb.arm(ArmKind::Next).unwrap();
        b.push(wc(1), false).unwrap();
        let mut fired = Vec::new();
        chan.take_ready(&mut fired).unwrap();
        assert_eq!(fired, [tb]);
        assert_eq!(sa.take_events().unwrap(), 0, "a takes none of b's events");
        assert_eq!(sb.take_events().unwrap(), 1);
        a.push(wc(2), false).unwrap();
        fired.clear();
        chan.take_ready(&mut fired).unwrap();
        assert_eq!(fired, [ta]);
        assert_eq!(
            (sa.take_events().unwrap(), sb.take_events().unwrap()),
            (1, 0)
        );
        assert!(matches!(
            sa.destroy(),
            Err(SourceError::UnackedEvents { unacked: 1 })
        ));
        sa.ack_events(1).unwrap();
        sb.ack_events(1).unwrap();
        sa.destroy().unwrap();
        sb.destroy().unwrap();
    }
}
