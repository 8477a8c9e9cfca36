//! Completion channels, CQs and the [`CompletionSource`] of a real CQ.
//!
//! Every CQ notifies through a [`CompChannel`]: its own (the default) or
//! one shared with other CQs ([`CqSpec::channel`]), the way a server with
//! many CQs gives its poller one descriptor. A shared channel's descriptor
//! is drained with `ibv_get_cq_event` to EAGAIN; each event names its CQ
//! (by the `cq_context` cqd set), whose count of pending notifications
//! grows (`cqd_core::notifier`'s protocol); each CQ's source then takes and
//! acknowledges only its own, in batches (`ibv_ack_cq_events`).
//!
//! A CQ is made in two halves, like the simulator's: the [`Cq`] handle that
//! QPs are created on (it holds the CQ's budget and queue ledger) and the
//! [`VerbsCqSource`] that exactly one poller owns (`cqd_core::split`, or
//! directly [`Context::create_dispatched_cq`]). The `ibv_cq` is destroyed
//! when the source is finished and every QP and handle using it is gone;
//! the source refuses to be destroyed while notifications are
//! unacknowledged, and acknowledges every one it read before it lets go, so
//! `ibv_destroy_cq` never waits.

use std::collections::HashMap;
use std::fmt;
use std::os::fd::BorrowedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use cqd_core::budget::{BudgetOptions, BudgetSnapshot, CqBudget};
use cqd_core::completion::{Completion, Opcode, Status, WcFlags};
use cqd_core::cq::{split, CqHandle, CqOptions, UnboundCq};
use cqd_core::ledger::{Graveyard, WrLedger};
use cqd_core::notifier::{FiredSet, Member};
use cqd_core::source::{ArmKind, AsyncEvent, CompletionSource, SharedNotifier, SourceError};
use parking_lot::Mutex;

use crate::device::{Context, ContextInner, Route};
use crate::error::VerbsError;
use crate::inbox::AsyncInbox;
use crate::qp::{Husk, QpInner};
use crate::sys::{self, CqFlavor};

pub(crate) struct ChannelInner {
    pub(crate) ctx: Arc<ContextInner>,
    ch: NonNull<sys::ibv_comp_channel>,
    fired: FiredSet,
    members: Mutex<HashMap<u64, Arc<Member>>>,
    next_token: AtomicU64,
    pub(crate) inbox: Arc<AsyncInbox>,
    /// False for a CQ's own channel (made by `create_cq` without a channel).
    shared: bool,
    /// An application's channel ([`crate::adopt`]): not destroyed by cqd.
    adopted: bool,
}

// SAFETY: a completion channel may be read from any thread; the pointers
// (channel, CQs) are only used through `sys`, and the members map is
// locked.
unsafe impl Send for ChannelInner {}
// SAFETY: as above.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        if self.adopted {
            return;
        }
        // SAFETY: every CQ on the channel holds an `Arc` to it: all gone.
        if let Err(e) = unsafe { sys::destroy_comp_channel(self.ch) } {
            tracing::error!(device = %self.ctx.name, error = %e, "ibv_destroy_comp_channel failed");
        }
    }
}

impl ChannelInner {
    pub(crate) fn new(
        ctx: &Arc<ContextInner>,
        ch: NonNull<sys::ibv_comp_channel>,
        shared: bool,
        adopted: bool,
    ) -> Result<Arc<Self>, VerbsError> {
        let inbox =
            AsyncInbox::new().map_err(|e| VerbsError::verb("eventfd", ctx.name.clone(), e))?;
        Ok(Arc::new(ChannelInner {
            ctx: Arc::clone(ctx),
            ch,
            fired: FiredSet::new(),
            members: Mutex::new(HashMap::new()),
            next_token: AtomicU64::new(1),
            inbox: Arc::new(inbox),
            shared,
            adopted,
        }))
    }

    pub(crate) fn has_token(&self, token: u64) -> bool {
        self.members.lock().contains_key(&token)
    }

    /// A token no CQ of the channel uses (adopted CQs bring their own).
    fn fresh_token(&self) -> u64 {
        loop {
            let t = self.next_token.fetch_add(1, Ordering::Relaxed);
            if !self.has_token(t) {
                return t;
            }
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the channel is live while `self` is; the descriptor is
        // closed only by `ibv_destroy_comp_channel` in our drop.
        unsafe { BorrowedFd::borrow_raw(sys::channel_fd(self.ch)) }
    }

    /// Reads every pending event (`ibv_get_cq_event` to EAGAIN) and counts
    /// each on its CQ (steps 1–4 of `cqd_core::notifier`).
    fn drain(&self) -> Result<(), SourceError> {
        self.drain_up_to(u32::MAX)
    }

    /// As [`drain`](Self::drain), stopping after `limit` events. A CQ's own
    /// channel holds at most one: an arm is one-shot, and its poller arms it
    /// again only after taking the event the last arm raised. So its poller
    /// reads one event and stops, without the read that would only return
    /// EAGAIN (one system call per wake-up fewer; an event left behind,
    /// were there one, keeps the descriptor readable and is read at the
    /// next wake-up).
    fn drain_up_to(&self, limit: u32) -> Result<(), SourceError> {
        if self.ctx.fatal.load(Ordering::Acquire) {
            // A disassociated device's channel may stay readable (an error
            // condition) with nothing to read: say so, do not spin on it.
            return Err(SourceError::DeviceGone(format!(
                "{} (completion channel)",
                self.ctx.name
            )));
        }
        for _ in 0..limit {
            // SAFETY: the channel is live and non-blocking.
            match unsafe { sys::get_cq_event(self.ch) } {
                Ok(Some((cq, token))) => {
                    let members = self.members.lock();
                    match members.get(&(token as u64)) {
                        Some(m) => self.fired.fire(m),
                        None => {
                            drop(members);
                            // A CQ made elsewhere on an adopted channel, or
                            // one whose source is gone: acked at once, so
                            // its destroy never waits.
                            // SAFETY: the event names a live CQ (a CQ is
                            // not destroyed before its events are acked).
                            unsafe { sys::ack_cq_events(cq, 1) };
                            tracing::warn!(device = %self.ctx.name, "completion event for a CQ cqd does not poll; acked");
                        }
                    }
                }
                Ok(None) => return Ok(()),
                Err(e) => {
                    return Err(SourceError::Os {
                        op: "ibv_get_cq_event",
                        source: e,
                    })
                }
            }
        }
        Ok(())
    }
}

impl SharedNotifier for ChannelInner {
    fn fd(&self) -> BorrowedFd<'_> {
        ChannelInner::fd(self)
    }

    fn take_ready(&self, out: &mut Vec<u64>) -> Result<(), SourceError> {
        let r = self.drain();
        self.fired.take_ready(out);
        r
    }
}

/// A completion channel (`ibv_comp_channel`) that several CQs share: one
/// descriptor for all of them, registered once by the one poller that
/// polls them all. Cloning is cheap.
#[derive(Clone)]
pub struct CompChannel {
    pub(crate) inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompChannel")
            .field("device", &self.inner.ctx.name)
            .field("fd", &sys_fd(&self.inner))
            .finish()
    }
}

fn sys_fd(c: &ChannelInner) -> i32 {
    // SAFETY: the channel is live while `c` is.
    unsafe { sys::channel_fd(c.ch) }
}

impl CompChannel {
    /// The channel's descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.inner.fd()
    }
}

/// How to make a CQ.
#[derive(Debug, Clone, Default)]
pub struct CqSpec {
    /// The channel to notify through, shared with other CQs; `None` (the
    /// default): a channel of its own.
    pub channel: Option<CompChannel>,
    /// The completion vector (`comp_vector`, below the device's
    /// `num_comp_vectors`).
    pub comp_vector: u32,
    /// The budget's switches (admission and credits on by default).
    pub budget: BudgetOptions,
}

pub(crate) struct CqInner {
    pub(crate) cq: NonNull<sys::ibv_cq>,
    pub(crate) name: String,
    /// The entries the device granted, as the last resize left them
    /// (shared with the CQ's route, whose overflow event reports it).
    pub(crate) capacity: Arc<AtomicU32>,
    pub(crate) flavor: CqFlavor,
    poll: sys::PollFn,
    notify: sys::NotifyFn,
    pub(crate) channel: Arc<ChannelInner>,
    pub(crate) token: u64,
    member: Arc<Member>,
    pub(crate) budget: CqBudget,
    pub(crate) ledger: WrLedger,
    /// Events read by the source and not yet acked when it let go.
    leftover: Mutex<u32>,
    /// QPs dropped with completions to account, in ERR, destroyed once
    /// the poller has retired their flushes and quiesced their SRQ use
    /// (see [`crate::Qp`] and `cqd_core::ledger::Graveyard`); and the rest
    /// of QPs on an SRQ whose completions come here, destroyed first under
    /// [`Teardown::DestroyThenQuiesce`](crate::Teardown), until their SRQ
    /// use is quiesced.
    pub(crate) grave: Arc<Graveyard>,
    /// The source (the poller's half) exists.
    source_alive: AtomicBool,
}

// SAFETY: the CQ pointer is polled only by the one source (which is Send,
// !Sync by the trait) and otherwise used through `sys` for creation of
// QPs and destruction; the rest is Sync data.
unsafe impl Send for CqInner {}
// SAFETY: as above.
unsafe impl Sync for CqInner {}

impl CqInner {
    /// True while this CQ's source exists (a poller can retire flushes).
    pub(crate) fn poller_alive(&self) -> bool {
        self.source_alive.load(Ordering::Acquire)
    }

    /// Keeps a QP the application let go until its completions are
    /// accounted, and has this CQ's poller destroy it (on its own thread:
    /// the CQ is single-threaded, and the destroy cleans it, which would
    /// race a poll). The poller reaps at its next look at its
    /// asynchronous events, which the inbox's ask wakes it for: a QP ready
    /// already, or made ready by a poller between the check and the keep
    /// (whose reap then found nothing to take), goes then; one not ready
    /// goes with the poll that makes it ready.
    pub(crate) fn bury(&self, mut qp: QpInner) {
        if let Some(u) = &qp.srq_user {
            u.waits_in(&self.grave);
        }
        let ready = qp.ready();
        if ready {
            // It writes no completion any more (nothing outstanding, and
            // its SRQ use, if any, quiesced): its room in the CQs is free
            // now, before the destroy.
            drop(std::mem::take(&mut qp._admissions));
        }
        self.grave.keep(Box::new(qp));
        if !self.channel.inbox.push_reap(self.token) {
            // No source: nobody polls the CQ, the destroy races nothing.
            self.grave.reap();
        }
        if !self.poller_alive() {
            // The source went meanwhile: nobody will reap it.
            self.grave.release_all();
        }
    }

    /// Step 2' of `cqd_core::ledger`'s `teardown`, for a QP on an SRQ
    /// whose completions come here, destroyed under
    /// [`Teardown::DestroyThenQuiesce`](crate::Teardown): keeps the rest
    /// of it until this CQ's poller has quiesced its SRQ use, and tells
    /// the poller the QP is destroyed (through the inbox, whose descriptor
    /// wakes it).
    pub(crate) fn quiesce_destroyed(&self, husk: Husk) {
        let qp_num = husk.qpn;
        // False when the device raised LAST_WQE_REACHED for it already:
        // its quiesce is under way without the event.
        let destroyed = husk.user.mark_destroyed();
        husk.user.waits_in(&self.grave);
        self.grave.bury(Box::new(husk));
        if destroyed {
            self.channel
                .inbox
                .push(self.token, AsyncEvent::QpDestroyed { qp_num });
        }
        if !self.poller_alive() {
            // The source went meanwhile: nobody will quiesce it.
            self.grave.release_all();
        }
    }

    /// The source is gone: every buried QP goes now.
    fn bury_all(&self) {
        self.source_alive.store(false, Ordering::Release);
        self.grave.release_all();
    }
}

impl Drop for CqInner {
    fn drop(&mut self) {
        // Every event read for this CQ is acked before it goes, so
        // `ibv_destroy_cq` never waits: the source's leftovers, and those
        // the channel counted after the source let go.
        let n = *self.leftover.get_mut() + self.member.take();
        self.channel.members.lock().remove(&self.token);
        // A last drain: events already queued for this CQ on its own
        // channel would otherwise be counted by nobody.
        if !self.channel.shared {
            let _ = self.channel.drain();
        }
        let n = n + self.member.take();
        if n > 0 {
            // SAFETY: `n` events were read for this live CQ and not acked.
            unsafe { sys::ack_cq_events(self.cq, n) };
        }
        self.channel.ctx.remove_route(self.cq.as_ptr() as usize);
        if self.flavor == CqFlavor::Adopted {
            return;
        }
        // SAFETY: no QP uses the CQ (each holds an `Arc` to it), and every
        // event read for it was acked above.
        if let Err(e) = unsafe { sys::destroy_cq(self.cq) } {
            tracing::error!(cq = %self.name, error = %e, "ibv_destroy_cq failed");
        }
    }
}

/// A CQ's handle for making queues on it: QPs take their admission from
/// its budget and open their accounts in its ledger. Cloning is cheap.
#[derive(Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for Cq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cq")
            .field("name", &self.inner.name)
            .field("capacity", &self.inner.capacity.load(Ordering::Relaxed))
            .field("flavor", &self.inner.flavor)
            .finish()
    }
}

impl Cq {
    /// The CQ's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The entries the device granted (`ibv_cq.cqe`, at least what was
    /// asked); the budget admits against this.
    pub fn capacity(&self) -> u32 {
        self.inner.capacity.load(Ordering::Relaxed)
    }

    /// How the CQ was made.
    pub fn flavor(&self) -> CqFlavor {
        self.inner.flavor
    }

    /// The CQ's budget (admission, credits, overflows).
    pub fn budget(&self) -> &CqBudget {
        &self.inner.budget
    }

    /// A snapshot of the budget.
    pub fn budget_snapshot(&self) -> BudgetSnapshot {
        self.inner.budget.snapshot()
    }

    /// The ledger of the queues whose completions come here.
    pub fn ledger(&self) -> &WrLedger {
        &self.inner.ledger
    }

    /// Asynchronous events waiting for this CQ's channel's poller.
    pub fn pending_async_events(&self) -> usize {
        self.inner.channel.inbox.len()
    }

    /// The raw `ibv_cq`. Never poll or arm it: its poller does.
    pub fn as_raw(&self) -> *mut sys::ibv_cq {
        self.inner.cq.as_ptr()
    }
}

/// The [`CompletionSource`] of a real CQ, owned by exactly one poller.
pub struct VerbsCqSource {
    cq: Arc<CqInner>,
    unacked: u32,
}

impl fmt::Debug for VerbsCqSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsCqSource")
            .field("cq", &self.cq.name)
            .field("unacked", &self.unacked)
            .finish()
    }
}

impl Context {
    /// A completion channel to share among CQs ([`CqSpec::channel`]).
    ///
    /// # Errors
    /// `ibv_create_comp_channel` failed, or the device is gone.
    pub fn create_comp_channel(&self) -> Result<CompChannel, VerbsError> {
        self.inner.check()?;
        // SAFETY: the context is open while `self` lives.
        let ch = unsafe { sys::create_comp_channel(self.inner.ctx) }
            .map_err(|e| VerbsError::verb("ibv_create_comp_channel", self.inner.name.clone(), e))?;
        let inner = ChannelInner::new(&self.inner, ch, true, false).inspect_err(|_| {
            // SAFETY: `ch` has no CQ yet.
            let _ = unsafe { sys::destroy_comp_channel(ch) };
        })?;
        Ok(CompChannel { inner })
    }

    /// Makes a CQ of at least `cqe` entries: the handle QPs are made on and
    /// the source its poller owns (`cqd_core::split` it, or use
    /// [`create_dispatched_cq`](Self::create_dispatched_cq)). Extended and
    /// single-threaded where the device allows, plain otherwise.
    ///
    /// # Errors
    /// [`VerbsError::Invalid`] for 0 entries, more than `max_cqe` or a
    /// completion vector beyond the device's; a failed verb.
    pub fn create_cq(
        &self,
        name: impl Into<String>,
        cqe: u32,
        spec: CqSpec,
    ) -> Result<(Cq, VerbsCqSource), VerbsError> {
        self.inner.check()?;
        let name = name.into();
        let attr = self.inner.attr;
        if cqe == 0 || cqe > attr.max_cqe {
            return Err(VerbsError::Invalid(format!(
                "CQ {name}: {cqe} entries requested, the device allows 1..={}",
                attr.max_cqe
            )));
        }
        if attr.num_comp_vectors > 0 && spec.comp_vector >= attr.num_comp_vectors {
            return Err(VerbsError::Invalid(format!(
                "CQ {name}: completion vector {} requested, the device has {}",
                spec.comp_vector, attr.num_comp_vectors
            )));
        }
        let channel = match &spec.channel {
            Some(c) => {
                if !Arc::ptr_eq(&c.inner.ctx, &self.inner) {
                    return Err(VerbsError::Invalid(format!(
                        "CQ {name}: the channel belongs to another device context"
                    )));
                }
                Arc::clone(&c.inner)
            }
            None => {
                // SAFETY: the context is open while `self` lives.
                let ch = unsafe { sys::create_comp_channel(self.inner.ctx) }
                    .map_err(|e| VerbsError::verb("ibv_create_comp_channel", name.clone(), e))?;
                ChannelInner::new(&self.inner, ch, false, false).inspect_err(|_| {
                    // SAFETY: `ch` has no CQ yet.
                    let _ = unsafe { sys::destroy_comp_channel(ch) };
                })?
            }
        };
        let token = channel.fresh_token();
        // SAFETY: the context is open; the channel is a live channel of it.
        let (cq, flavor) = unsafe {
            sys::create_cq(
                self.inner.ctx,
                cqe,
                channel.ch,
                token as usize,
                spec.comp_vector as i32,
            )
        }
        .map_err(|e| VerbsError::verb("ibv_create_cq", format!("CQ {name} ({cqe} entries)"), e))?;
        // SAFETY: `cq` is live and has no QP; nothing was read for it.
        unsafe { adopt_parts(&self.inner, cq, flavor, channel, token, name, spec.budget) }
    }

    /// [`create_cq`](Self::create_cq), then split: the CQ handle and the
    /// two halves of its poller, with the CQ's budget and queue ledger
    /// attached so that the poller retires every request posted through a
    /// registration and returns its credits.
    ///
    /// # Errors
    /// As `create_cq`; [`VerbsError::Split`] when the poller's doorbell
    /// cannot be made.
    pub fn create_dispatched_cq<W: Send + 'static>(
        &self,
        name: impl Into<String>,
        cqe: u32,
        spec: CqSpec,
        options: CqOptions,
    ) -> Result<(Cq, UnboundCq<W>, CqHandle<W>), VerbsError> {
        let (cq, source) = self.create_cq(name, cqe, spec)?;
        let (poller, handle) = split::<W>(source, options)?;
        Ok((cq, poller, handle))
    }
}

/// Builds both halves around a live CQ.
///
/// # Safety
/// `cq` is a live CQ of `ctx` whose completion channel is `channel`'s and
/// whose `cq_context` is `token`; no other thread polls it.
pub(crate) unsafe fn adopt_parts(
    ctx: &Arc<ContextInner>,
    cq: NonNull<sys::ibv_cq>,
    flavor: CqFlavor,
    channel: Arc<ChannelInner>,
    token: u64,
    name: String,
    budget: BudgetOptions,
) -> Result<(Cq, VerbsCqSource), VerbsError> {
    // SAFETY: the caller's contract.
    let granted = unsafe { sys::cq_entries(cq) };
    // SAFETY: as above.
    let ops = unsafe { sys::cq_ops(cq) };
    let (poll, notify) = match ops {
        Ok(x) => x,
        Err(e) => {
            if flavor != CqFlavor::Adopted {
                // SAFETY: nothing uses the CQ yet.
                let _ = unsafe { sys::destroy_cq(cq) };
            }
            return Err(VerbsError::verb("poll_cq/req_notify_cq", name, e));
        }
    };
    let capacity = u32::try_from(granted.max(1)).unwrap_or(u32::MAX);
    let budget = CqBudget::new(name.clone(), capacity, budget);
    let capacity = Arc::new(AtomicU32::new(capacity));
    let ledger = WrLedger::with_budget(budget.clone());
    let member = channel.fired.member(token);
    channel.members.lock().insert(token, Arc::clone(&member));
    ctx.add_route(
        cq.as_ptr() as usize,
        Route::Cq {
            inbox: Arc::downgrade(&channel.inbox),
            token,
            capacity: Arc::clone(&capacity),
        },
    );
    let inner = Arc::new(CqInner {
        cq,
        name,
        capacity,
        flavor,
        poll,
        notify,
        channel,
        token,
        member,
        budget,
        ledger,
        leftover: Mutex::new(0),
        grave: Graveyard::new(),
        source_alive: AtomicBool::new(true),
    });
    inner.channel.inbox.open(token);
    let source = VerbsCqSource {
        cq: Arc::clone(&inner),
        unacked: 0,
    };
    Ok((Cq { inner }, source))
}

// The layout promise the poll below relies on: cqd's `Completion` is
// `struct ibv_wc` field for field (same size, alignment and offsets, and
// each field an integer of the C field's width), so an array of
// completions is an array of `ibv_wc` a provider may write.
const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<Completion>() == size_of::<sys::ibv_wc>());
    assert!(align_of::<Completion>() == align_of::<sys::ibv_wc>());
    assert!(offset_of!(Completion, wr_id) == offset_of!(sys::ibv_wc, wr_id));
    assert!(offset_of!(Completion, status) == offset_of!(sys::ibv_wc, status));
    assert!(offset_of!(Completion, opcode) == offset_of!(sys::ibv_wc, opcode));
    assert!(offset_of!(Completion, vendor_err) == offset_of!(sys::ibv_wc, vendor_err));
    assert!(offset_of!(Completion, byte_len) == offset_of!(sys::ibv_wc, byte_len));
    assert!(
        offset_of!(Completion, imm_data)
            == offset_of!(sys::ibv_wc, imm_data_invalidated_rkey_union)
    );
    assert!(offset_of!(Completion, qp_num) == offset_of!(sys::ibv_wc, qp_num));
    assert!(offset_of!(Completion, src_qp) == offset_of!(sys::ibv_wc, src_qp));
    assert!(offset_of!(Completion, wc_flags) == offset_of!(sys::ibv_wc, wc_flags));
    assert!(offset_of!(Completion, pkey_index) == offset_of!(sys::ibv_wc, pkey_index));
    assert!(offset_of!(Completion, slid) == offset_of!(sys::ibv_wc, slid));
    assert!(offset_of!(Completion, sl) == offset_of!(sys::ibv_wc, sl));
    assert!(offset_of!(Completion, dlid_path_bits) == offset_of!(sys::ibv_wc, dlid_path_bits));
    assert!(size_of::<Status>() == size_of::<u32>() && size_of::<Opcode>() == size_of::<u32>());
    assert!(size_of::<WcFlags>() == size_of::<std::ffi::c_uint>());
    assert!(size_of::<rdma_sys::imm_data_invalidated_rkey_union_t>() == size_of::<u32>());
};

/// One `ibv_wc` as cqd's [`Completion`]: every field copied, status and
/// opcode kept as the device gave them (an unknown value stays, and says
/// so; never a panic). The two have one layout, so this is a copy; the
/// verbs source polls into completions directly and never calls it.
#[inline]
pub fn completion_of(wc: &sys::ibv_wc) -> Completion {
    // SAFETY: `Completion` has `ibv_wc`'s layout (checked above when this
    // compiles) and every bit pattern is a valid completion; `wc` is a
    // live, aligned `ibv_wc`.
    unsafe { *(wc as *const sys::ibv_wc).cast::<Completion>() }
}

impl VerbsCqSource {
    fn error(&self, op: &'static str, e: std::io::Error) -> SourceError {
        // EIO / ENODEV from a CQ verb is a dead device, whether or not its
        // reader has handed on the fatal event yet.
        if self.cq.channel.ctx.fatal.load(Ordering::Acquire)
            || matches!(e.raw_os_error(), Some(libc::EIO | libc::ENODEV))
        {
            return SourceError::DeviceGone(format!(
                "{} (CQ {})",
                self.cq.channel.ctx.name, self.cq.name
            ));
        }
        SourceError::Os { op, source: e }
    }

    /// The CQ handle of this source.
    pub fn cq(&self) -> Cq {
        Cq {
            inner: Arc::clone(&self.cq),
        }
    }
}

impl CompletionSource for VerbsCqSource {
    fn name(&self) -> &str {
        &self.cq.name
    }

    fn capacity(&self) -> u32 {
        self.cq.capacity.load(Ordering::Relaxed)
    }

    /// `ibv_resize_cq`, on the polling thread (the trait contract, point
    /// 6). An arm made before is kept by the devices cqd-verbs runs on
    /// (softverbs moves it to the new ring; rxe keeps its `notify` state
    /// in the CQ, not in the queue it replaces; mlx5 keeps its arm
    /// sequence); arming again here would cost a spurious event on each.
    fn resize(&mut self, cqe: u32) -> Result<u32, SourceError> {
        let max = self.cq.channel.ctx.attr.max_cqe;
        if cqe > max {
            return Err(SourceError::Backend(format!(
                "CQ {}: {cqe} entries asked, the device allows at most {max}",
                self.cq.name
            )));
        }
        // SAFETY: the CQ is live while `self.cq` is held, and this is its
        // polling thread, between two polls (the trait's point 6).
        let got =
            unsafe { sys::resize_cq(self.cq.cq, cqe) }.map_err(|e| match e.raw_os_error() {
                Some(libc::EOPNOTSUPP | libc::ENOSYS) => SourceError::Unsupported(format!(
                    "{}'s provider has no ibv_resize_cq",
                    self.cq.channel.ctx.name
                )),
                _ => self.error("ibv_resize_cq", e),
            })?;
        let now = u32::try_from(got.max(1)).unwrap_or(u32::MAX);
        self.cq.capacity.store(now, Ordering::Relaxed);
        Ok(now)
    }

    #[inline]
    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, SourceError> {
        if !self.cq.grave.is_empty() {
            self.cq.grave.reap();
        }
        // SAFETY: this source is the CQ's only poller (it is owned by one
        // thread; CqInner never polls); `poll` is the CQ's provider's. The
        // provider writes `ibv_wc`s into `out`: a completion has that
        // layout and any bits the provider writes (or leaves) are a valid
        // completion (the layout check above).
        unsafe { sys::poll_cq(self.cq.poll, self.cq.cq, out.as_mut_ptr().cast(), out.len()) }
            .map_err(|e| self.error("ibv_poll_cq", e))
    }

    fn arm(&mut self, kind: ArmKind) -> Result<(), SourceError> {
        // SAFETY: the CQ is live while `self.cq` is held.
        unsafe { sys::req_notify_cq(self.cq.notify, self.cq.cq, kind == ArmKind::Solicited) }
            .map_err(|e| self.error("ibv_req_notify_cq", e))
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        self.cq.channel.fd()
    }

    fn notifier(&self) -> Option<(Arc<dyn SharedNotifier>, u64)> {
        if !self.cq.channel.shared {
            return None;
        }
        let chan: Arc<dyn SharedNotifier> = Arc::clone(&self.cq.channel) as _;
        Some((chan, self.cq.token))
    }

    fn ledger(&self) -> Option<WrLedger> {
        Some(self.cq.ledger.clone())
    }

    fn take_events(&mut self) -> Result<u32, SourceError> {
        let drained = if self.cq.channel.shared {
            // The channel's poller drained it (take_ready) and counted this
            // CQ's events on its member.
            Ok(())
        } else {
            self.cq.channel.drain_up_to(1)
        };
        let n = self.cq.member.take();
        self.unacked = self.unacked.saturating_add(n);
        drained.map(|()| n)
    }

    fn ack_events(&mut self, n: u32) -> Result<(), SourceError> {
        let n = n.min(self.unacked);
        if n > 0 {
            // SAFETY: `n` events were read for this live CQ and not acked.
            unsafe { sys::ack_cq_events(self.cq.cq, n) };
            self.unacked -= n;
        }
        Ok(())
    }

    fn unacked_events(&self) -> u32 {
        self.unacked
    }

    fn async_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(self.cq.channel.inbox.fd())
    }

    #[inline]
    fn take_async_event(&mut self) -> Option<AsyncEvent> {
        let inbox = &self.cq.channel.inbox;
        // Nothing pending (the usual case): one load.
        if inbox.len() == 0 {
            return None;
        }
        if inbox.take_reap(self.cq.token) {
            // A QP let go ready to be destroyed (`CqInner::bury`): here, on
            // the CQ's polling thread, between two polls.
            self.cq.grave.reap();
        }
        inbox.take(self.cq.token)
    }

    fn destroy(&mut self) -> Result<(), SourceError> {
        if self.unacked > 0 {
            return Err(SourceError::UnackedEvents {
                unacked: self.unacked,
            });
        }
        Ok(())
    }
}

impl Drop for VerbsCqSource {
    fn drop(&mut self) {
        // Events read and not acked go with the CQ's last holder, which
        // acks them before `ibv_destroy_cq`.
        *self.cq.leftover.lock() += std::mem::take(&mut self.unacked);
        // Nobody takes this CQ's asynchronous events any more.
        self.cq.channel.inbox.close(self.cq.token);
        // Nobody retires flushes any more: buried QPs go now.
        self.cq.bury_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every field of an `ibv_wc` reaches the completion unchanged, an
    /// unknown status and opcode included: the compile-time layout check
    /// compares offsets; this compares values, each field given its own.
    #[test]
    fn a_polled_wc_is_the_completion_field_for_field() {
        // SAFETY: plain C data; all-zero is a valid value.
        let mut wc: sys::ibv_wc = unsafe { std::mem::zeroed() };
        wc.wr_id = 0x0123_4567_89ab_cdef;
        wc.status = 99;
        wc.opcode = 200;
        wc.vendor_err = 0x11;
        wc.byte_len = 0x2222;
        wc.imm_data_invalidated_rkey_union.imm_data = 0x3333_3333;
        wc.qp_num = 0x44_4444;
        wc.src_qp = 0x55_5555;
        wc.wc_flags = WcFlags::WITH_IMM | WcFlags::GRH;
        wc.pkey_index = 0x6666;
        wc.slid = 0x7777;
        wc.sl = 0x8;
        wc.dlid_path_bits = 0x9a;
        let c = completion_of(&wc);
        assert_eq!(c.wr_id, 0x0123_4567_89ab_cdef);
        assert_eq!((c.status.to_raw(), c.status.is_known()), (99, false));
        assert_eq!((c.opcode.to_raw(), c.opcode.is_known()), (200, false));
        assert_eq!((c.vendor_err, c.byte_len), (0x11, 0x2222));
        assert_eq!(c.imm(), Some(0x3333_3333));
        assert_eq!((c.qp_num, c.src_qp), (0x44_4444, 0x55_5555));
        assert!(c.has_grh());
        assert_eq!((c.pkey_index, c.slid), (0x6666, 0x7777));
        assert_eq!((c.sl, c.dlid_path_bits), (0x8, 0x9a));
        wc.status = 5;
        wc.opcode = 128;
        let c = completion_of(&wc);
        assert_eq!((c.status, c.opcode), (Status::WrFlush, Opcode::Recv));
    }
}
