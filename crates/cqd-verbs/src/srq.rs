//! Shared receive queues.
//!
//! An SRQ serves the handlers of one CQ (a wr_id names a handler of one
//! CQ, and a receive completes on the CQ of whichever QP consumes it): the
//! first QP attached to it, or its first post, binds it to that CQ, and a
//! QP on another CQ is refused.

use std::fmt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use cqd_core::account::QueueAccount;
use cqd_core::cq::Registration;
use cqd_core::post::PostRecv;

use crate::cq::Cq;
use crate::device::Route;
use crate::error::{PostError, VerbsError};
use crate::pd::{Pd, PdInner};
use crate::qp::{post_recv_list, Pins, RecvWr};
use crate::sys;

pub(crate) struct SrqInner {
    pub(crate) srq: NonNull<sys::ibv_srq>,
    pub(crate) srqn: u32,
    depth: u32,
    max_sge: u32,
    pub(crate) pd: Arc<PdInner>,
    pub(crate) account: Arc<QueueAccount>,
    pins: Pins,
}

// SAFETY: libibverbs SRQs may be posted to from any thread; the pointer is
// only used through `sys`.
unsafe impl Send for SrqInner {}
// SAFETY: as above.
unsafe impl Sync for SrqInner {}

impl Drop for SrqInner {
    fn drop(&mut self) {
        self.pd.ctx.remove_route(self.srq.as_ptr() as usize);
        // SAFETY: every QP on the SRQ holds an `Arc` to it: all gone.
        if let Err(e) = unsafe { sys::destroy_srq(self.srq) } {
            tracing::error!(srq = self.srqn, error = %e, "ibv_destroy_srq failed");
        }
        self.account.close();
    }
}

/// A shared receive queue. Cloning is cheap; it is destroyed when the last
/// clone and the last QP on it are gone.
#[derive(Clone)]
pub struct Srq {
    pub(crate) inner: Arc<SrqInner>,
}

impl fmt::Debug for Srq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Srq")
            .field("srqn", &self.inner.srqn)
            .field("depth", &self.inner.depth)
            .finish()
    }
}

/// How to make an SRQ.
#[derive(Debug, Clone, Copy)]
pub struct SrqInit<'a> {
    /// Receives it can hold.
    pub max_wr: u32,
    /// SGEs per receive.
    pub max_sge: u32,
    /// The handler that owns it and the CQ whose poller gets its events
    /// (limit reached, error): `on_async` of that handler.
    pub owner: Option<(&'a Registration, &'a Cq)>,
}

impl Pd {
    /// Creates a shared receive queue.
    ///
    /// # Errors
    /// `ibv_create_srq` failed.
    pub fn create_srq(&self, init: SrqInit<'_>) -> Result<Srq, VerbsError> {
        self.inner.ctx.check()?;
        // SAFETY: the domain is live while `self` is.
        let (srq, depth, max_sge) = unsafe {
            sys::create_srq(self.inner.pd, init.max_wr, init.max_sge)
        }
        .map_err(|e| VerbsError::verb("ibv_create_srq", format!("{} receives", init.max_wr), e))?;
        // A basic SRQ has no number verbs would give; this one names it in
        // the CQ budgets' admission tables and the ledgers.
        static NEXT: AtomicU32 = AtomicU32::new(1);
        let srqn = NEXT.fetch_add(1, Ordering::Relaxed);
        if let Some((owner, cq)) = init.owner {
            if !owner.is_on(cq.ledger()) {
                // SAFETY: nothing was posted on the new SRQ.
                let _ = unsafe { sys::destroy_srq(srq) };
                return Err(VerbsError::Invalid(format!(
                    "SRQ owner {} is not registered on CQ {}",
                    owner.key(),
                    cq.name()
                )));
            }
            let owner = owner.key();
            self.inner.ctx.add_route(
                srq.as_ptr() as usize,
                Route::Srq {
                    srq_num: srqn,
                    owner: Some(owner),
                    inbox: Arc::downgrade(&cq.inner.channel.inbox),
                    token: cq.inner.token,
                },
            );
        }
        Ok(Srq {
            inner: Arc::new(SrqInner {
                srq,
                srqn,
                // What the device granted: admission covers every receive
                // the SRQ can hold.
                depth,
                max_sge,
                pd: Arc::clone(&self.inner),
                account: {
                    let a = QueueAccount::srq(srqn);
                    a.reserve(depth);
                    a
                },
                pins: Pins::default(),
            }),
        })
    }
}

impl Srq {
    /// The number cqd knows the SRQ by.
    pub fn number(&self) -> u32 {
        self.inner.srqn
    }

    /// Receives it can hold.
    pub fn depth(&self) -> u32 {
        self.inner.depth
    }

    /// Receives posted and not yet retired.
    pub fn outstanding(&self) -> usize {
        self.inner.account.outstanding()
    }

    /// Arms the limit event: one `SrqEvent::LimitReached` to the owner when
    /// fewer than `limit` receives are left.
    ///
    /// # Errors
    /// `ibv_modify_srq` failed (EINVAL: the device has no SRQ limit).
    pub fn arm_limit(&self, limit: u32) -> Result<(), VerbsError> {
        // SAFETY: the SRQ is live while `self` is.
        unsafe { sys::arm_srq_limit(self.inner.srq, limit) }.map_err(|e| {
            VerbsError::verb(
                "ibv_modify_srq(limit)",
                format!("SRQ {}", self.inner.srqn),
                e,
            )
        })
    }
}

impl PostRecv for Srq {
    type Wr<'a> = RecvWr<'a>;
    type Error = PostError;

    fn recv_account(&self) -> &QueueAccount {
        &self.inner.account
    }

    fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, PostError)> {
        let s = &self.inner;
        post_recv_list(
            sys::RecvTarget::Srq(s.srq),
            &|| format!("SRQ {}", s.srqn),
            s.max_sge,
            &s.pd,
            &s.pins,
            wrs,
        )
    }
}
