//! Shared receive queues: one pool of receives many QPs draw on, as storage
//! servers with many connections use them.
//!
//! A receive taken by a QP completes on that QP's receive CQ with its
//! `qp_num`. When a QP goes to error its SRQ's receives stay in the SRQ
//! (only the QP's own queues flush). A receive's slot is freed when its
//! completion is polled, whichever CQ it went to.

use std::sync::Arc;

use cqd_core::ledger::QueueAccount;
use cqd_core::post::PostRecv;

use crate::error::PostError;
use crate::fabric::Fabric;
use crate::qp::RecvWr;
use crate::state::PendingRecv;

/// A shared receive queue. Dropping it destroys it (QPs still using it
/// then find no receives).
#[derive(Debug)]
pub struct Srq {
    pub(crate) fabric: Fabric,
    pub(crate) id: u32,
    /// What is outstanding on the SRQ, for the posting call and the
    /// pollers of the CQs of the QPs that draw on it.
    pub(crate) account: Arc<QueueAccount>,
}

impl Srq {
    /// The SRQ's number.
    pub fn srqn(&self) -> u32 {
        self.id
    }

    /// Receives posted and not yet consumed.
    pub fn available(&self) -> usize {
        let st = self.fabric.core.state.lock();
        st.srqs.get(&self.id).map_or(0, |s| s.rq.len())
    }

    /// QPs drawing on this SRQ.
    pub fn users(&self) -> usize {
        let st = self.fabric.core.state.lock();
        st.srqs.get(&self.id).map_or(0, |s| s.users)
    }

    /// Posts receives, in order, unaccounted: the raw post under
    /// `Registration::post_recv` (the [`PostRecv`] implementation), which
    /// is how applications post. Receives posted here directly are not in
    /// the SRQ's account.
    ///
    /// Credits are not taken for SRQ receives (their CQ is known only when a
    /// QP consumes them); admission covers them, counted once per CQ.
    ///
    /// # Errors
    /// [`PostError::TooManySge`], [`PostError::QueueFull`],
    /// [`PostError::Destroyed`]; nothing was posted then.
    pub fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut st = self.fabric.core.state.lock();
        let id = self.id;
        let Some(s) = st.srqs.get_mut(&id) else {
            return Err(PostError::Destroyed { qpn: id });
        };
        for (index, wr) in wrs.iter().enumerate() {
            if wr.sg_list.len() > s.max_sge as usize {
                return Err(PostError::TooManySge {
                    qpn: id,
                    index,
                    sges: wr.sg_list.len(),
                    max: s.max_sge,
                });
            }
        }
        let used = s.used(wrs.len());
        if used + wrs.len() > s.max_wr as usize {
            return Err(PostError::QueueFull {
                qpn: id,
                queue: "srq",
                depth: s.max_wr,
                outstanding: used as u32,
                posting: wrs.len() as u32,
            });
        }
        s.rq.extend(wrs.iter().map(|w| PendingRecv {
            wr_id: w.wr_id,
            sges: crate::state::Sges::from_slice(w.sg_list),
        }));
        let now = st.now(matches!(
            self.fabric.core.engine,
            crate::engine::Engine::Timed(_)
        ));
        self.fabric.kick(&mut st, now);
        Ok(())
    }
}

impl PostRecv for Srq {
    type Wr<'a> = RecvWr<'a>;
    type Error = PostError;

    fn recv_account(&self) -> &QueueAccount {
        &self.account
    }

    fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, PostError)> {
        Srq::post_recv_unaccounted(self, wrs).map_err(|e| (0, e))
    }
}

impl Drop for Srq {
    fn drop(&mut self) {
        self.account.close();
        self.fabric.core.state.lock().srqs.remove(&self.id);
    }
}
