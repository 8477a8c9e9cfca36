//! The poller's one doorbell, which every CQ of its group rings.
//!
//! 1. A handle queues its command on its CQ, then (`CqShared::ring`) notes
//!    the CQ's index in the group under the bell's lock and rings the bell.
//! 2. The poller drains the bell, then takes the noted indices and applies
//!    the commands of those CQs only.
//!
//! A note made after step 2's take rings the bell after its drain, so the
//! next wake-up finds it; a note made before is taken.

use crate::sys::Doorbell;

/// A poller's one doorbell, shared by every CQ of its group: a handle that
/// queued a command notes its CQ's index in the group and rings; the
/// poller drains the bell, then takes the noted indices and applies the
/// commands of those CQs only (a control wake-up costs what was rung, not
/// the size of the group). A note made after the take rings the bell after
/// the drain, so the next wake-up finds it.
#[derive(Debug)]
pub(crate) struct GroupBell {
    bell: Doorbell,
    noted: crate::sync::Mutex<Vec<usize>>,
}

impl GroupBell {
    pub(crate) fn new() -> std::io::Result<Self> {
        Ok(GroupBell {
            bell: Doorbell::new()?,
            noted: crate::sync::Mutex::new(Vec::new()),
        })
    }

    /// Notes CQ `index` of the group, then rings.
    pub(crate) fn note(&self, index: usize) {
        self.noted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(index);
        self.bell.ring();
    }

    /// Rings without a note (a stop).
    pub(crate) fn ring(&self) {
        self.bell.ring();
    }

    /// Drains the bell; if it was rung, moves the noted indices to `out`
    /// and returns true.
    pub(crate) fn drain(&self, out: &mut Vec<usize>) -> bool {
        if self.bell.drain() == 0 {
            return false;
        }
        let mut noted = self.noted.lock().unwrap_or_else(|p| p.into_inner());
        out.append(&mut noted);
        true
    }
}

impl std::os::fd::AsFd for GroupBell {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.bell.as_fd()
    }
}
