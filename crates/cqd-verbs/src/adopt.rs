//! Adopting a CQ an application already made, so a project on rdma-sys or
//! another verbs binding gets cqd's poller without rewriting its setup.

use std::ptr::NonNull;
use std::sync::Arc;

use cqd_core::budget::BudgetOptions;

use crate::cq::{adopt_parts, ChannelInner, CompChannel, Cq, VerbsCqSource};
use crate::device::Context;
use crate::error::VerbsError;
use crate::sys::{self, CqFlavor};

impl Context {
    /// Wraps an application's `ibv_comp_channel` so that the CQs it serves
    /// can be adopted ([`adopt_cq`](Self::adopt_cq)). Adopt each channel
    /// once, and give all its CQs to one poller, as for any shared channel.
    /// cqd never destroys it; its descriptor is made non-blocking.
    ///
    /// # Safety
    /// `channel` is a live completion channel of this context, destroyed
    /// only after the returned `CompChannel`, its clones and every CQ
    /// adopted on it are dropped; nothing but cqd reads it
    /// (`ibv_get_cq_event`) from now on.
    ///
    /// # Errors
    /// A null pointer; `fcntl` failed.
    pub unsafe fn adopt_comp_channel(
        &self,
        channel: *mut sys::ibv_comp_channel,
    ) -> Result<CompChannel, VerbsError> {
        let Some(ch) = NonNull::new(channel) else {
            return Err(VerbsError::Invalid(
                "adopt_comp_channel: null channel".into(),
            ));
        };
        // SAFETY: the caller's contract: the channel is live.
        let fd = unsafe { sys::channel_fd(ch) };
        sys::make_nonblocking(fd)
            .map_err(|e| VerbsError::verb("fcntl(channel fd)", self.name().to_string(), e))?;
        Ok(CompChannel {
            inner: ChannelInner::new(&self.inner, ch, true, true)?,
        })
    }

    /// Wraps an application's `ibv_cq` (on a channel adopted with
    /// [`adopt_comp_channel`](Self::adopt_comp_channel)) as a [`Cq`] handle
    /// and the [`VerbsCqSource`] one poller owns.
    ///
    /// cqd then polls, arms and acknowledges the CQ; it never destroys the
    /// CQ, and before it lets go of it it acknowledges every event it read,
    /// so the application's `ibv_destroy_cq` never waits. The budget admits
    /// against the entries the CQ really has (`cq->cqe`).
    ///
    /// # Safety
    /// The caller promises, for as long as the returned `Cq`, the source,
    /// any QP made on the `Cq` or any clone of them lives:
    ///
    /// 1. `cq` is a live CQ created on this context (`self.as_raw()`) with
    ///    `channel`'s `ibv_comp_channel` as its completion channel;
    /// 2. nothing else polls or arms the CQ or acknowledges its events —
    ///    the poller is the only consumer, as cqd's one-poller rule
    ///    requires;
    /// 3. the CQ's `cq_context` was set, at creation, to `token`, a value
    ///    no other CQ of the channel uses (`ibv_get_cq_event` reports CQs
    ///    by it);
    /// 4. the CQ is destroyed only after all of the above are dropped;
    /// 5. requests whose completions come to this CQ are posted through
    ///    cqd's posting call (QPs made with [`Pd::create_qp`] on the
    ///    returned `Cq`), or accounted by the application through
    ///    `Registration::track` (the expert path).
    ///
    /// [`Pd::create_qp`]: crate::Pd::create_qp
    ///
    /// # Errors
    /// A null pointer, a token already used on the channel, a channel of
    /// another context ([`VerbsError::Invalid`]); a provider without
    /// `poll_cq`/`req_notify_cq` ([`VerbsError::Verb`]).
    pub unsafe fn adopt_cq(
        &self,
        name: impl Into<String>,
        cq: *mut sys::ibv_cq,
        channel: &CompChannel,
        token: u64,
        budget: BudgetOptions,
    ) -> Result<(Cq, VerbsCqSource), VerbsError> {
        let name = name.into();
        let Some(cq) = NonNull::new(cq) else {
            return Err(VerbsError::Invalid(format!("adopt_cq({name}): null CQ")));
        };
        if !Arc::ptr_eq(&channel.inner.ctx, &self.inner) {
            return Err(VerbsError::Invalid(format!(
                "adopt_cq({name}): the channel belongs to another context"
            )));
        }
        if channel.inner.has_token(token) {
            return Err(VerbsError::Invalid(format!(
                "adopt_cq({name}): token {token:#x} is already used on this channel"
            )));
        }
        // SAFETY: the caller's contract (1–3): a live CQ of this context on
        // this channel with `cq_context == token`, polled by nobody else.
        unsafe {
            adopt_parts(
                &self.inner,
                cq,
                CqFlavor::Adopted,
                Arc::clone(&channel.inner),
                token,
                name,
                budget,
            )
        }
    }
}
