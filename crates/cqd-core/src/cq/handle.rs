//! The shared side of a CQ: [`CqHandle`] (register handlers, read
//! metrics, attach the budget and ledger) and [`Registration`] (a handler's
//! posting side: the one posting call, and the expert path).

use std::sync::{Arc, OnceLock};

use super::posting;
use super::{Command, CqShared};
use crate::account::QueueAccount;
use crate::budget::{BudgetSnapshot, CqBudget};
use crate::handler::Handler;
use crate::ledger::WrLedger;
use crate::metrics::CqSnapshot;
use crate::post::{PostRecv, PostSend, Refused};
use crate::sink::Route;
use crate::slab::{Entry, RegisterError, SlotLedger};
use crate::sync::Ordering;
use crate::wr_id::{HandlerKey, OpKind, WrIdError};

/// How long a receive queue stays dry before the snapshot names it
/// ([`CqSnapshot::left_dry`]): longer than the last exchange of a finite
/// run takes to reach its stop, shorter than a load that hangs on RNR.
pub const DRY_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// The cloneable, `Sync` right to register handlers on a CQ and read its
/// metrics.
pub struct CqHandle<W> {
    pub(super) shared: Arc<CqShared<W>>,
}

impl<W> Clone for CqHandle<W> {
    fn clone(&self) -> Self {
        CqHandle {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<W> std::fmt::Debug for CqHandle<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqHandle")
            .field("name", &self.shared.name)
            .finish()
    }
}

impl<W: Send + 'static> CqHandle<W> {
    /// The CQ's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The CQ's real capacity (after any resize).
    pub fn capacity(&self) -> u32 {
        self.shared.resizes.capacity()
    }

    /// Grows the CQ to at least `cqe` entries (`ibv_resize_cq`), on its
    /// poller's thread between two polls (the protocol `cq::resize`): the
    /// [`Resizing`](super::Resizing) fires with the new capacity once the
    /// device made it, and from then on the CQ's admission counts it. A
    /// CQ not yet bound to a poller is resized when it is bound.
    ///
    /// A CQ only grows: a size not above its capacity is refused
    /// ([`ResizeError::NotLarger`](super::ResizeError::NotLarger)), as is
    /// a resize on a backend that has none.
    pub fn resize(&self, cqe: u32) -> super::Resizing {
        match self.shared.resizes.ask(&self.shared.name, cqe) {
            Some(r) => {
                if super::resize::Resizes::flag(&self.shared.commands_rung) {
                    self.shared.ring();
                }
                r
            }
            None => super::Resizing::refused(
                &self.shared.name,
                super::ResizeError::Stopped {
                    cq: self.shared.name.clone(),
                },
            ),
        }
    }

    /// Registers a handler whose work goes, by default, to the worker its
    /// key hashes to (per-handler order). Applied by the poller between
    /// batches (waking it if it sleeps); the key is usable at once.
    ///
    /// A handler that posts from its own callbacks (a repost, a reply) is
    /// made with [`register_with`](Self::register_with), which hands it
    /// its registration.
    ///
    /// # Errors
    /// [`RegisterError::SlabFull`], [`RegisterError::Closed`].
    pub fn register(&self, handler: impl Handler<W>) -> Result<Registration, RegisterError> {
        self.register_inner(None, false, |_| handler)
    }

    /// As [`register`](Self::register), with an explicit default route.
    ///
    /// # Errors
    /// [`RegisterError::SlabFull`], [`RegisterError::Closed`].
    pub fn register_routed(
        &self,
        handler: impl Handler<W>,
        route: Option<Route>,
    ) -> Result<Registration, RegisterError> {
        self.register_inner(route, false, |_| handler)
    }

    /// Registers the handler `make` builds from its own registration, so
    /// that it can post from its callbacks (keep a clone of the
    /// registration in the handler; workers post through clones as well).
    ///
    /// The handler is installed when `make` returns. A post from inside
    /// `make` is refused ([`Refused::NotInstalled`](crate::Refused::NotInstalled)): no handler
    /// would be there to receive its completion. If `make` panics, the slot
    /// is released and the panic goes on.
    ///
    /// `handle.register_with(|reg| Echo { reg: reg.clone(), .. })` gives the
    /// handler its registration to keep; its `on_recv` then reposts and
    /// replies through `self.reg` (the repository's test
    /// `tests/post_from_callbacks.rs` is a whole echo server so).
    ///
    /// # Errors
    /// [`RegisterError::SlabFull`], [`RegisterError::Closed`].
    pub fn register_with<H: Handler<W>>(
        &self,
        make: impl FnOnce(&Registration) -> H,
    ) -> Result<Registration, RegisterError> {
        self.register_inner(None, true, make)
    }

    /// One registration: a slot and its ledger, the registration, the
    /// handler made from it, the command that installs it. `pending`: the
    /// slot's posts are refused until the command is queued (the handler
    /// is made by user code that holds the registration meanwhile).
    fn register_inner<H: Handler<W>>(
        &self,
        route: Option<Route>,
        pending: bool,
        make: impl FnOnce(&Registration) -> H,
    ) -> Result<Registration, RegisterError> {
        if self.shared.closed.load(Ordering::Acquire) {
            return Err(RegisterError::Closed {
                cq: self.shared.name.clone(),
            });
        }
        let (key, ledger) = self
            .shared
            .table()
            .alloc_ledger_as(&self.shared.name, pending)?;
        let route = route.unwrap_or(Route::Key(u64::from(key.slot())));
        let m = &self.shared.metrics.0;
        m.handlers_live.fetch_add(1, Ordering::Relaxed);
        m.registrations.fetch_add(1, Ordering::Relaxed);
        let weak = Arc::downgrade(&self.shared);
        let reg = Registration {
            key,
            ledger: ledger.clone(),
            cq: Arc::from(self.shared.name.as_str()),
            cq_ledger: Arc::clone(&self.shared.ledger),
            recheck: Arc::new(move |key| {
                if let Some(shared) = weak.upgrade() {
                    push_command(&shared, Command::Recheck { key });
                }
            }),
        };
        let handler = if pending {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| make(&reg))) {
                Ok(h) => h,
                Err(panic) => {
                    // Nothing was posted (the slot is pending): an empty
                    // handler takes the slot and retires at once, so the
                    // poller releases it as any other.
                    push_command(
                        &self.shared,
                        Command::Register {
                            key,
                            entry: Entry::boxed(key, Vacant, route, ledger),
                        },
                    );
                    let _ = self.unregister(key);
                    std::panic::resume_unwind(panic);
                }
            }
        } else {
            make(&reg)
        };
        push_command(
            &self.shared,
            Command::Register {
                key,
                entry: Entry::boxed(key, handler, route, ledger.clone()),
            },
        );
        if pending {
            // After the command: a completion of a post from now on finds
            // the handler, or the command still queued (dispatch applies
            // queued commands before it calls a wr_id stale).
            ledger.activate();
        }
        Ok(reg)
    }

    /// Registers a [`ContextHandler`](crate::context::ContextHandler): each
    /// request it posts carries a context, handed back to exactly one of
    /// its callbacks (`crate::context`). A context of at most 8 bytes (an
    /// integer, an index, a `Box`, an `Arc`) travels in its request's
    /// entry of the queue's ring: nothing is made here and `capacity` is
    /// not enforced (the CQ's credits and the queues' depths bound what is
    /// outstanding). A larger one lives in a table, with room for
    /// `capacity` outstanding requests (at most
    /// [`MAX_TAG`](crate::wr_id::MAX_TAG) + 1), made here, once; a post
    /// that finds no free slot is refused
    /// ([`Refused::Contexts`](crate::Refused::Contexts)). The table holds
    /// up to 15 slots more than `capacity` (an eighth of it, at most),
    /// which the poller returns in groups
    /// ([`ContextRegistration::capacity`](super::ContextRegistration::capacity)
    /// says how many in all). A capacity of the handler's queues' depths
    /// never refuses a post that the queues would take.
    /// [`ContextRegistration::in_ring`](super::ContextRegistration::in_ring)
    /// says which storage the handler has.
    ///
    /// # Errors
    /// As [`register`](Self::register); [`RegisterError::Contexts`] for a
    /// capacity of 0 or above `MAX_TAG + 1`.
    pub fn register_with_contexts<H: crate::context::ContextHandler<W>>(
        &self,
        handler: H,
        capacity: u32,
    ) -> Result<super::ContextRegistration<H::Ctx>, RegisterError> {
        self.register_contexts_inner(capacity, false, |_| handler)
    }

    /// As [`register_with`](Self::register_with) for a
    /// [`ContextHandler`](crate::context::ContextHandler): `make` builds
    /// the handler from its context registration, to post with contexts
    /// from its callbacks. As
    /// [`register_with_contexts`](Self::register_with_contexts) for the
    /// table.
    ///
    /// # Errors
    /// As [`register_with_contexts`](Self::register_with_contexts).
    pub fn register_contexts_with<H: crate::context::ContextHandler<W>>(
        &self,
        capacity: u32,
        make: impl FnOnce(&super::ContextRegistration<H::Ctx>) -> H,
    ) -> Result<super::ContextRegistration<H::Ctx>, RegisterError> {
        self.register_contexts_inner(capacity, true, make)
    }

    fn register_contexts_inner<H: crate::context::ContextHandler<W>>(
        &self,
        capacity: u32,
        pending: bool,
        make: impl FnOnce(&super::ContextRegistration<H::Ctx>) -> H,
    ) -> Result<super::ContextRegistration<H::Ctx>, RegisterError> {
        if capacity == 0 || capacity > crate::wr_id::MAX_TAG + 1 {
            return Err(RegisterError::Contexts { capacity });
        }
        // A context of at most 8 bytes travels in its queue's ring; a
        // larger one lives in a table made here, once.
        let table = (!crate::context::in_ring::<H::Ctx>())
            .then(|| Arc::new(crate::context::Table::new(capacity)));
        let shared = Arc::new(crate::context::Shared::default());
        let reg = self.register_inner(None, pending, |reg| {
            let creg = super::ContextRegistration {
                reg: reg.clone(),
                table: table.clone(),
                shared: Arc::clone(&shared),
                capacity,
            };
            crate::context::WithContexts::new(
                make(&creg),
                table.clone(),
                Arc::clone(&shared),
                reg.key(),
                reg.cq_ledger_cell(),
            )
        })?;
        Ok(super::ContextRegistration {
            reg,
            table,
            shared,
            capacity,
        })
    }

    /// Retires a handler: it keeps receiving the completions of what it
    /// posted (flushes included) and is dropped once none is outstanding.
    /// The returned [`Retired`](crate::ledger::Retired) says when: wait on
    /// it (not on the poller's thread) or await it.
    ///
    /// # Errors
    /// [`RegisterError::UnknownKey`] if `key` names no live handler.
    pub fn unregister(&self, key: HandlerKey) -> Result<crate::ledger::Retired, RegisterError> {
        if !self.shared.table().is_live(key) {
            return Err(RegisterError::UnknownKey {
                cq: self.shared.name.clone(),
                key,
            });
        }
        let signal = crate::ledger::CloseSignal::new();
        self.shared.retiring.lock().push((key, Arc::clone(&signal)));
        if self.shared.closed.load(Ordering::Acquire) {
            // The poller has finished: nothing will retire it.
            self.shared.retired(Some(key));
        }
        push_command(&self.shared, Command::Unregister { key });
        Ok(crate::ledger::Retired::new(key, signal))
    }

    /// A copy of the CQ's counters (with its budget's, if attached).
    pub fn snapshot(&self) -> CqSnapshot {
        let mut snap = self
            .shared
            .metrics
            .snapshot(&self.shared.name, self.shared.resizes.capacity());
        snap.budget = self.budget_snapshot();
        if let Some(l) = self.shared.ledger.get() {
            snap.left_dry = l.dry_receive_queues(std::time::Instant::now(), DRY_GRACE);
        }
        snap
    }

    /// The CQ's ledger of queue accounts, if one is attached.
    pub fn ledger(&self) -> Option<&WrLedger> {
        self.shared.ledger.get()
    }

    /// The CQ's budget, if one is attached.
    pub fn budget(&self) -> Option<&CqBudget> {
        self.shared.budget.get()
    }

    /// The budget's counters, if a budget is attached.
    pub fn budget_snapshot(&self) -> Option<BudgetSnapshot> {
        self.shared.budget.get().map(CqBudget::snapshot)
    }

    /// Attaches the CQ's budget: its counters join the CQ's snapshot and
    /// overflow events are recorded in it. (Credits are returned through
    /// the queue accounts, see [`attach_ledger`](Self::attach_ledger).) A
    /// CQ has one budget for life. `split` attaches the one the source
    /// gives ([`CompletionSource::ledger`](crate::source::CompletionSource::ledger)).
    ///
    /// # Errors
    /// Gives the budget back if one is already attached.
    pub fn attach_budget(&self, budget: CqBudget) -> Result<(), CqBudget> {
        self.shared.budget.set(budget)
    }

    /// Attaches the CQ's ledger of queue accounts (the backend's, which
    /// maps each QP whose completions come here to its queues' accounts):
    /// the poller then retires their entries and returns their credits as
    /// it polls, counts unsignaled sends completed when a later completion
    /// covers them, and the watchdog and the stop report name what is
    /// still outstanding. `split` attaches the one the source gives
    /// ([`CompletionSource::ledger`](crate::source::CompletionSource::ledger));
    /// this is for a source that gives none.
    ///
    /// # Errors
    /// Gives the ledger back if one is already attached.
    pub fn attach_ledger(&self, ledger: WrLedger) -> Result<(), WrLedger> {
        if let Some(b) = ledger.budget() {
            let _ = self.shared.budget.set(b.clone());
        }
        self.shared.ledger.set(ledger)
    }
}

/// Sends a command to the poller, ringing its doorbell only if no push
/// since the poller last began to apply commands has rung it.
///
/// # Registration doorbell protocol
///
/// A registration costs one doorbell write (an eventfd write, about
/// 700 ns) only when the poller may not know there is work; a burst of
/// registrations costs one. The parts:
///
/// 1. A pusher pushes its command, then swaps `commands_rung` to true
///    (AcqRel); it rings the doorbell only if the flag was false.
/// 2. The poller, applying commands, first swaps the flag to false
///    (AcqRel), then pops until the queue is empty.
/// 3. The poller looks at the flag at the start of every poll (and
///    applies commands if it is set). A ring notes the CQ in its poller's
///    one doorbell (`cq::bell`): the poller drains the bell, then applies
///    the commands of every CQ noted (step 2 for each), whether or not it
///    polls that CQ (a quiet CQ of the sleep protocol is not polled). A CQ
///    not yet bound notes nothing; binding it applies every queued
///    command.
///
/// No command is stranded. Take a command `c` whose pusher found the flag
/// already true (and did not ring). The flag was set by a ring-bearing
/// push (step 1) and is still set: the poller has not cleared it since.
/// The poller clears it only at step 2, after which it pops everything
/// pushed before the clear — the clear reads the flag's latest value, so
/// it synchronizes with `c`'s swap, which follows `c`'s push. So `c` is
/// applied by the next step 2, and step 3 makes one happen: the poller's
/// next poll sees the flag set (it stays set until a step 2), and the
/// ring that set it carries the CQ's note, so the poller that drains that
/// ring applies this CQ's commands (or, before the CQ is bound, the
/// binding does). A command pushed after a clear finds the flag false (or
/// set by another push after the clear, which rang) and rings.
pub(super) fn push_command<W>(shared: &CqShared<W>, command: Command<W>) {
    shared.commands.push(command);
    if !shared.commands_rung.swap(true, Ordering::AcqRel) {
        shared.ring();
    }
}

/// A registered handler's posting side: posts work requests with every
/// account kept, in one call ([`post_send`](Self::post_send),
/// [`post_recv`](Self::post_recv)). Cloneable; use it from any thread that
/// posts.
#[derive(Clone)]
pub struct Registration {
    key: HandlerKey,
    ledger: SlotLedger,
    cq: Arc<str>,
    cq_ledger: Arc<OnceLock<WrLedger>>,
    /// Asks the poller to re-check the handler for retirement.
    recheck: Arc<dyn Fn(HandlerKey) + Send + Sync>,
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Registration")
            .field("key", &self.key)
            .field("cq", &self.cq)
            .field("ledger", &self.ledger)
            .finish()
    }
}

impl Registration {
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.key
    }

    /// Posts send-side requests on `qp`, in order, accounted (see
    /// [`crate::post`]). Each request's wr_id field carries its tag on the
    /// way in (at most [`MAX_TAG`](crate::wr_id::MAX_TAG)) and the encoded
    /// wr_id on the way out. Tracks the handler's ledger and the send
    /// queue's account, takes the CQ's credits, posts, and takes all of it
    /// back for the requests that were not posted (whose wr_id fields get
    /// their tags back).
    ///
    /// # Errors
    /// The backend's error: a [`Refused`] (tag too large, no credits, the
    /// queue's completions go to another CQ, a request the queue's
    /// [`check_send`](PostSend::check_send) finds invalid), or the backend's post error;
    /// requests before the failed one were posted (verbs' `bad_wr`), the
    /// others not (the simulated NIC posts all or nothing).
    pub fn post_send<Q: PostSend + ?Sized>(
        &self,
        qp: &Q,
        wrs: &mut [Q::Wr<'_>],
    ) -> Result<(), Q::Error> {
        self.post_send_with(qp, wrs, None)
    }

    /// [`post_send`](Self::post_send), with a context word per request.
    #[inline]
    pub(crate) fn post_send_with<Q: PostSend + ?Sized>(
        &self,
        qp: &Q,
        wrs: &mut [Q::Wr<'_>],
        ctx: Option<&mut posting::Words<'_>>,
    ) -> Result<(), Q::Error> {
        posting::post(
            self,
            qp.send_account(),
            wrs,
            crate::post::SendRequest::kind,
            crate::post::SendRequest::signaled,
            |w| qp.check_send(w),
            |w| qp.post_send_unaccounted(w),
            ctx,
        )
    }

    /// Posts receives on `queue` (a QP's receive queue or an SRQ), in
    /// order, accounted, as [`post_send`](Self::post_send) does.
    ///
    /// # Errors
    /// As [`post_send`](Self::post_send).
    pub fn post_recv<Q: PostRecv + ?Sized>(
        &self,
        queue: &Q,
        wrs: &mut [Q::Wr<'_>],
    ) -> Result<(), Q::Error> {
        self.post_recv_with(queue, wrs, None)
    }

    /// [`post_recv`](Self::post_recv), with a context word per request.
    #[inline]
    pub(crate) fn post_recv_with<Q: PostRecv + ?Sized>(
        &self,
        queue: &Q,
        wrs: &mut [Q::Wr<'_>],
        ctx: Option<&mut posting::Words<'_>>,
    ) -> Result<(), Q::Error> {
        posting::post(
            self,
            queue.recv_account(),
            wrs,
            |_| OpKind::Recv,
            |_| true,
            |_| Ok(()),
            |w| queue.post_recv_unaccounted(w),
            ctx,
        )
    }

    /// Checks that the queue's completions come to this handler's CQ (an
    /// SRQ that serves no CQ yet is bound to this one).
    /// True if the handler belongs to the CQ whose ledger is `ledger` (a
    /// backend checks this before it routes a queue's events to the
    /// handler).
    pub fn is_on(&self, ledger: &crate::ledger::WrLedger) -> bool {
        self.cq_ledger.get().is_some_and(|l| l.same_as(ledger))
    }

    #[inline]
    pub(crate) fn attach(&self, account: &QueueAccount) -> Result<(), Refused> {
        let Some(ledger) = self.cq_ledger.get() else {
            return Err(Refused::Unattached {
                handler: self.key,
                cq: self.cq.to_string(),
            });
        };
        if ledger.owns(account) {
            Ok(())
        } else {
            Err(Refused::WrongCq {
                handler: self.key,
                cq: self.cq.to_string(),
            })
        }
    }

    /// The expert path, for adopting code that posts by itself: a wr_id
    /// for a request of `kind` carrying `tag`. Such a post must be
    /// [`track`](Self::track)ed; the posting call does all of this.
    ///
    /// # Errors
    /// [`WrIdError::TagTooLarge`]; [`WrIdError::Reserved`] for
    /// [`OpKind::Internal`] (cqd's own requests).
    #[inline]
    pub fn wr_id(&self, kind: OpKind, tag: u32) -> Result<u64, WrIdError> {
        if matches!(kind, OpKind::Internal) {
            return Err(WrIdError::Reserved);
        }
        self.key.wr_id(kind, tag)
    }

    /// The expert path: records `n` requests of `kind` as posted in the
    /// handler's ledger. Call it *before* posting (a completion can arrive
    /// before the post call returns) and [`untrack`](Self::untrack) them if
    /// the post fails; the slot then stays alive until each one has
    /// completed. On a queue whose account is attached, a request posted
    /// this way must also be recorded there ([`WrLedger::posted`], before
    /// posting): its completion is otherwise counted unmatched and never
    /// reaches the handler; unsignaled sends never complete without it
    /// either. Prefer [`post_send`](Self::post_send).
    ///
    /// Returns false, recording nothing, once the handler has been released
    /// (unregistered and drained): its slot may hold another handler, and
    /// a request posted now would never reach this one.
    pub fn track(&self, kind: OpKind, n: u64) -> bool {
        self.ledger.add_posted(kind, n)
    }

    /// The expert path: takes back `n` requests recorded by
    /// [`track`](Self::track) whose post failed.
    pub fn untrack(&self, kind: OpKind, n: u64) {
        self.ledger.sub_posted(kind, n);
        self.taken_back();
    }

    /// Counts were taken back (a post that failed): if nothing is
    /// outstanding now, a retiring handler is drained with no completion
    /// coming to say so; the poller re-checks it.
    pub(crate) fn taken_back(&self) {
        if self.ledger.outstanding_raw() == 0 {
            (self.recheck)(self.key);
        }
    }

    /// Posted, completed and flushed counts of this handler (final once it
    /// has been released, and all 0 once its slot holds another handler).
    pub fn ledger(&self) -> &SlotLedger {
        &self.ledger
    }

    /// The cell of the CQ's ledger of queue accounts (set once attached).
    pub(crate) fn cq_ledger_cell(&self) -> Arc<OnceLock<WrLedger>> {
        Arc::clone(&self.cq_ledger)
    }
}

/// The handler that holds a slot whose real handler was never made
/// (`register_with`'s closure panicked): it retires at once.
struct Vacant;

impl<W> Handler<W> for Vacant {
    fn on_send(&mut self, _: &crate::handler::SendDone<'_>, _: &mut crate::handler::Outbox<'_, W>) {
    }
    fn on_recv(&mut self, _: &crate::handler::RecvDone<'_>, _: &mut crate::handler::Outbox<'_, W>) {
    }
    fn on_error(&mut self, _: &crate::handler::Failed<'_>, _: &mut crate::handler::Outbox<'_, W>) {}
}
