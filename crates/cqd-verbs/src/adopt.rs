//! Adopting a CQ an application already made, so a project on rdma-sys or
//! another verbs binding gets cqd's poller without rewriting its setup.

use std::ptr::NonNull;
use std::sync::Arc;

use cqd_core::budget::BudgetOptions;

use crate::cq::{adopt_parts, ChannelInner, Cq, VerbsCqSource};
use crate::device::Context;
use crate::error::VerbsError;
use crate::sys::{self, CqFlavor};

impl Context {
    /// Wraps an application's `ibv_cq` and its `ibv_comp_channel` as a
    /// [`Cq`] handle and the [`VerbsCqSource`] one poller owns.
    ///
    /// cqd then polls, arms and acknowledges the CQ; it never destroys the
    /// CQ or the channel (they are the application's), and before it lets
    /// go of the CQ it acknowledges every event it read, so the
    /// application's `ibv_destroy_cq` never waits. The channel is made
    /// non-blocking. The budget admits against the entries the CQ really
    /// has (`cq->cqe`).
    ///
    /// # Safety
    /// The caller promises, for as long as the returned `Cq`, the source,
    /// any QP made on the `Cq` or any clone of them lives:
    ///
    /// 1. `cq` and `channel` are live objects created on this context
    ///    (`self.as_raw()`), and `channel` is the CQ's completion channel;
    /// 2. nothing else polls or arms the CQ, reads the channel
    ///    (`ibv_get_cq_event`) or acknowledges its events — the poller is
    ///    the only consumer, as cqd's one-poller rule requires;
    /// 3. the CQ's `cq_context` was set, at creation, to the value
    ///    `token` (any value unique among the CQs of this channel), since
    ///    `ibv_get_cq_event` reports CQs by it;
    /// 4. the CQ and the channel are destroyed only after all of the
    ///    above are dropped;
    /// 5. requests whose completions come to this CQ are posted through
    ///    cqd's posting call (QPs made with [`Pd::create_qp`] on the
    ///    returned `Cq`), or accounted by the application through
    ///    `Registration::track` (the expert path).
    ///
    /// [`Pd::create_qp`]: crate::Pd::create_qp
    ///
    /// # Errors
    /// A null pointer, or a provider without `poll_cq`/`req_notify_cq`
    /// ([`VerbsError::Invalid`] / [`VerbsError::Verb`]).
    pub unsafe fn adopt_cq(
        &self,
        name: impl Into<String>,
        cq: *mut sys::ibv_cq,
        channel: *mut sys::ibv_comp_channel,
        token: u64,
        budget: BudgetOptions,
    ) -> Result<(Cq, VerbsCqSource), VerbsError> {
        let name = name.into();
        let (Some(cq), Some(ch)) = (NonNull::new(cq), NonNull::new(channel)) else {
            return Err(VerbsError::Invalid(format!(
                "adopt_cq({name}): null CQ or channel"
            )));
        };
        // SAFETY: the caller's contract (1): the channel is live.
        let fd = unsafe { sys::channel_fd(ch) };
        sys::make_nonblocking(fd)
            .map_err(|e| VerbsError::verb("fcntl(channel fd)", name.clone(), e))?;
        let chan = ChannelInner::new(&self.inner, ch, false, true)?;
        // SAFETY: the caller's contract (1–3): a live CQ of this context on
        // this channel with `cq_context == token`, polled by nobody else.
        unsafe {
            adopt_parts(
                &self.inner,
                cq,
                CqFlavor::Adopted,
                Arc::clone(&chan),
                token,
                name,
                budget,
            )
        }
    }
}
