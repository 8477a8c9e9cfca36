//! A completion queue with hardware semantics.
//!
//! - Fixed capacity. A completion arriving when the CQ is full overflows
//!   it: the entry is lost, the CQ enters the error state, an asynchronous
//!   [`AsyncEvent::CqOverflow`] is raised (its own descriptor becomes
//!   readable) and every later entry is lost too — as on hardware, so that
//!   tests can show an overflow is loud.
//! - An arm fires at most one notification, for the first matching
//!   completion added *after* it (IB semantics): `Next` matches any
//!   completion, `Solicited` a solicited one or any error. Completions
//!   already queued at arm time do not fire it, which is why pollers re-poll
//!   after arming.
//! - Notifications coalesce: the descriptor is an eventfd whose counter is
//!   the number of notifications not yet taken.
//! - Notifications must be acknowledged; `destroy` refuses (instead of
//!   hanging like `ibv_destroy_cq`) while any is not.
//! - Fault injection ([`Faults`]): spurious, dropped and delayed
//!   notifications, and completions injected between a poller's last empty
//!   poll and its arm.
//! - Shared channels ([`SimChannel`], like `ibv_comp_channel`): CQs made on
//!   one channel have no descriptor of their own. The channel's descriptor
//!   becomes readable when any of them fires, taking its events says which
//!   fired ([`SharedNotifier::take_ready`]), and each CQ still counts and
//!   acknowledges only its own notifications (as `ibv_ack_cq_events` does).
//!   Their asynchronous events share the channel's second descriptor (as a
//!   verbs context has one async descriptor).
//! - Polling an empty CQ takes no lock (one atomic load), as reading an
//!   empty CQE's owner bit does on hardware.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cqd_core::completion::Completion;
use cqd_core::ledger::{Graveyard, WrLedger};
use cqd_core::notifier::Member;
use cqd_core::source::{ArmKind, AsyncEvent, CompletionSource, SharedNotifier, SourceError};

use crate::channel::ChannelInner;
pub use crate::channel::SimChannel;
use parking_lot::Mutex;
use rustix::event::{eventfd, EventfdFlags};

/// Notification faults, each a probability in `0.0..=1.0`, drawn from a
/// seeded generator so a run is reproducible.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Faults {
    /// On each arm, the chance of an immediate notification with nothing new
    /// in the CQ.
    pub spurious: f64,
    /// On each fired arm, the chance that the notification is lost.
    pub drop: f64,
    /// On each fired arm, the chance that the notification is delivered
    /// only after `delay_by`.
    pub delay: f64,
    /// How late a delayed notification is.
    pub delay_by: Duration,
    /// On each completion added, the chance that the device writes it
    /// twice: a second entry with the same wr_id right behind it, as a
    /// faulty NIC or driver might. A copy is written only while the CQ has
    /// room for it beside every completion its budget's credits still owe,
    /// so that the fault never overflows a CQ that admission protects.
    /// Drawn from a generator of its own, so that adding it leaves the
    /// notification faults' draws as they were.
    pub duplicate: f64,
    /// Seed of the generators.
    pub seed: u64,
}

/// Counters of what the simulated CQ did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SimCqStats {
    /// Completions accepted.
    pub pushed: u64,
    /// Completions lost to overflow.
    pub lost: u64,
    /// Arms requested.
    pub arms: u64,
    /// Notifications delivered (including spurious and delayed ones).
    pub notified: u64,
    /// Notifications dropped by fault injection.
    pub dropped: u64,
    /// Notifications delayed by fault injection.
    pub delayed: u64,
    /// Spurious notifications injected.
    pub spurious: u64,
    /// Completions injected between poll and arm.
    pub injected: u64,
    /// Copies written by the `duplicate` fault (each also counted in
    /// `pushed`).
    pub duplicated: u64,
    /// Entries removed with their QP when it was destroyed (as mlx5's
    /// `ibv_destroy_qp` cleans its CQs).
    pub purged: u64,
}

/// Why a completion was not accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PushError {
    /// The CQ is (now) overflowed; the entry is lost.
    #[error("CQ overflow: capacity {capacity}, entry lost")]
    Overflow {
        /// The CQ's capacity.
        capacity: u32,
    },
    /// The CQ was destroyed, or its device vanished.
    #[error("CQ destroyed or device gone")]
    Destroyed,
}

/// Errors making a simulated CQ.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SimCqError {
    /// Capacity 0, or above the device limit.
    #[error("CQ capacity {requested} is outside 1..={max}")]
    BadCapacity {
        /// What was asked.
        requested: u32,
        /// The largest allowed.
        max: u32,
    },
    /// The eventfd could not be made.
    #[error("eventfd: {0}")]
    Os(#[from] std::io::Error),
}

/// The largest CQ the simulator makes.
pub const MAX_CQE: u32 = 4 * 1024 * 1024;

#[derive(Debug)]
struct State {
    /// The entries, each with its sequence number (the count of entries
    /// ever added before it).
    ring: VecDeque<(u64, Completion)>,
    arm: Option<ArmKind>,
    overflowed: bool,
    destroyed: bool,
    vanished: bool,
    async_events: VecDeque<AsyncEvent>,
    inject_before_arm: Vec<Completion>,
    faults: Faults,
    rng: u64,
    /// The `duplicate` fault's generator.
    dup_rng: u64,
    stats: SimCqStats,
}

impl State {
    fn chance(&mut self, p: f64) -> bool {
        draw(&mut self.rng, p)
    }
}

/// The `duplicate` fault's seed, from the faults' seed.
fn dup_seed(seed: u64) -> u64 {
    (seed ^ 0x9E37_79B9_7F4A_7C15) | 1
}

/// True with probability `p`, from the xorshift64* generator `rng`
/// (deterministic for a seed); draws nothing when `p` is 0.
fn draw(rng: &mut u64, p: f64) -> bool {
    if p <= 0.0 {
        return false;
    }
    let mut x = *rng;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *rng = x;
    let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
    (v as f64 / (1u64 << 53) as f64) < p
}

/// How a CQ notifies: its own descriptors, or a channel's.
#[derive(Debug)]
pub(crate) enum Notify {
    Own {
        event_fd: OwnedFd,
        async_fd: OwnedFd,
    },
    Channel {
        chan: Arc<ChannelInner>,
        member: Arc<Member>,
    },
}

#[derive(Debug)]
struct Shared {
    name: String,
    /// Written under `state`'s lock (a resize), read under it by pushes;
    /// atomic so that `capacity()` reads it without the lock.
    capacity: AtomicU32,
    /// The accounts of the queues completing here (with the CQ's budget,
    /// when it has one); `split` attaches it.
    ledger: WrLedger,
    state: Mutex<State>,
    notify: Notify,
    /// Asynchronous events queued in `state`: the poller checks this every
    /// loop, so with none pending it costs one load, no lock, no syscall.
    async_pending: AtomicUsize,
    /// Entries in the ring (written under the lock): an empty poll reads
    /// only this.
    queued: AtomicUsize,
    /// Destroyed or vanished (written under the lock).
    dead: AtomicBool,
    /// QPs waiting for their completions here to be accounted before the
    /// NIC destroys them; reaped by the consumer side between polls.
    grave: Arc<Graveyard>,
    /// Cleared when the consumer side goes.
    source_alive: AtomicBool,
}

impl Shared {
    /// Queues an asynchronous event (with the state locked) and makes its
    /// descriptor readable.
    fn raise(&self, st: &mut State, ev: AsyncEvent) {
        st.async_events.push_back(ev);
        self.async_pending.fetch_add(1, Ordering::Release);
        match &self.notify {
            Notify::Own { async_fd, .. } => Shared::signal(async_fd),
            Notify::Channel { chan, .. } => {
                chan.async_total.fetch_add(1, Ordering::SeqCst);
                Shared::signal(&chan.async_fd);
            }
        }
    }

    /// An asynchronous event was taken; `empty`: none left on this CQ.
    fn async_taken(&self, empty: bool) {
        let mut buf = [0u8; 8];
        match &self.notify {
            Notify::Own { async_fd, .. } => {
                if empty {
                    let _ = rustix::io::read(async_fd, &mut buf);
                }
            }
            Notify::Channel { chan, .. } => {
                // The shared descriptor is drained when no CQ of the channel
                // has one left, and signalled again if one was raised
                // meanwhile.
                if chan.async_total.fetch_sub(1, Ordering::SeqCst) == 1 {
                    let _ = rustix::io::read(&chan.async_fd, &mut buf);
                    if chan.async_total.load(Ordering::SeqCst) > 0 {
                        Shared::signal(&chan.async_fd);
                    }
                }
            }
        }
    }

    /// Delivers one notification (no faults applied).
    fn notify(&self) {
        match &self.notify {
            Notify::Own { event_fd, .. } => Shared::signal(event_fd),
            Notify::Channel { chan, member } => {
                chan.fired.fire(member);
                Shared::signal(&chan.event_fd);
            }
        }
    }

    /// Mirrors the ring's length and liveness for the lock-free empty poll.
    fn publish(&self, st: &State) {
        self.queued.store(st.ring.len(), Ordering::Release);
        self.dead
            .store(st.destroyed || st.vanished, Ordering::Release);
    }

    fn signal(fd: &OwnedFd) {
        // Only a counter at its maximum fails, and then it is readable anyway.
        let _ = rustix::io::write(fd, &1u64.to_ne_bytes());
    }

    /// Fires the armed notification, applying the faults. Called with the
    /// state locked.
    fn fire(self: &Arc<Self>, st: &mut State) {
        st.arm = None;
        let (drop, delay) = (st.faults.drop, st.faults.delay);
        if st.chance(drop) {
            st.stats.dropped += 1;
            return;
        }
        st.stats.notified += 1;
        if st.chance(delay) {
            st.stats.delayed += 1;
            let me = Arc::clone(self);
            let by = st.faults.delay_by;
            std::thread::spawn(move || {
                std::thread::sleep(by);
                me.notify();
            });
            return;
        }
        self.notify();
    }
}

/// The producer side of a simulated CQ: what the NIC (or a test) uses to
/// add completions. Cloneable.
#[derive(Debug, Clone)]
pub struct SimCq {
    shared: Arc<Shared>,
}

/// Makes a simulated CQ: the producer side and the [`CompletionSource`] a
/// poller owns. Its queue ledger has no budget (see [`sim_cq_with_ledger`]
/// for one with credits).
///
/// # Errors
/// [`SimCqError::BadCapacity`], or an eventfd failure.
pub fn sim_cq(
    name: impl Into<String>,
    capacity: u32,
    faults: Faults,
) -> Result<(SimCq, SimCqSource), SimCqError> {
    sim_cq_with_ledger(name, capacity, faults, WrLedger::new())
}

/// As [`sim_cq`], with `ledger` as the CQ's queue ledger (for example
/// `WrLedger::with_budget`, so that posts take the budget's credits). The
/// source hands it to `split`, which attaches it and its budget.
///
/// # Errors
/// [`SimCqError::BadCapacity`], or an eventfd failure.
pub fn sim_cq_with_ledger(
    name: impl Into<String>,
    capacity: u32,
    faults: Faults,
    ledger: WrLedger,
) -> Result<(SimCq, SimCqSource), SimCqError> {
    let flags = EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC;
    check_capacity(capacity)?;
    let event_fd = eventfd(0, flags).map_err(std::io::Error::from)?;
    let async_fd = eventfd(0, flags).map_err(std::io::Error::from)?;
    make_cq(
        name.into(),
        capacity,
        faults,
        ledger,
        Notify::Own { event_fd, async_fd },
    )
}

pub(crate) fn check_capacity(capacity: u32) -> Result<(), SimCqError> {
    if capacity == 0 || capacity > MAX_CQE {
        return Err(SimCqError::BadCapacity {
            requested: capacity,
            max: MAX_CQE,
        });
    }
    Ok(())
}

pub(crate) fn make_cq(
    name: String,
    capacity: u32,
    faults: Faults,
    ledger: WrLedger,
    notify: Notify,
) -> Result<(SimCq, SimCqSource), SimCqError> {
    let seed = faults.seed | 1;
    let shared = Arc::new(Shared {
        name,
        capacity: AtomicU32::new(capacity),
        ledger,
        state: Mutex::new(State {
            ring: VecDeque::with_capacity(capacity.min(1 << 16) as usize),
            arm: None,
            overflowed: false,
            destroyed: false,
            vanished: false,
            async_events: VecDeque::new(),
            inject_before_arm: Vec::new(),
            dup_rng: dup_seed(faults.seed),
            faults,
            rng: seed,
            stats: SimCqStats::default(),
        }),
        notify,
        async_pending: AtomicUsize::new(0),
        queued: AtomicUsize::new(0),
        dead: AtomicBool::new(false),
        grave: Graveyard::new(),
        source_alive: AtomicBool::new(true),
    });
    Ok((
        SimCq {
            shared: Arc::clone(&shared),
        },
        SimCqSource { shared, unacked: 0 },
    ))
}

impl SimCq {
    /// The CQ's queue ledger: QPs completing here open their queues'
    /// accounts in it.
    pub fn ledger(&self) -> &WrLedger {
        &self.shared.ledger
    }

    /// Adds one completion. `solicited` marks a receive completion of a
    /// request sent with the solicited-event flag.
    ///
    /// # Errors
    /// [`PushError::Overflow`] when the CQ is full or already overflowed
    /// (the entry is lost, as on hardware); [`PushError::Destroyed`].
    pub fn push(&self, wc: Completion, solicited: bool) -> Result<(), PushError> {
        let mut st = self.shared.state.lock();
        self.push_locked(&mut st, wc, solicited)
    }

    /// Adds a batch under one lock; stops at the first error.
    ///
    /// # Errors
    /// As [`push`](Self::push); entries before the failing one were added.
    pub fn push_all(&self, wcs: &[Completion]) -> Result<(), PushError> {
        let mut st = self.shared.state.lock();
        for wc in wcs {
            self.push_locked(&mut st, *wc, false)?;
        }
        Ok(())
    }

    fn push_locked(
        &self,
        st: &mut State,
        wc: Completion,
        solicited: bool,
    ) -> Result<(), PushError> {
        if st.destroyed || st.vanished {
            return Err(PushError::Destroyed);
        }
        let capacity = self.shared.capacity.load(Ordering::Relaxed);
        if st.overflowed || st.ring.len() >= capacity as usize {
            st.stats.lost += 1;
            if !st.overflowed {
                // One asynchronous event, on the transition, as hardware
                // raises IBV_EVENT_CQ_ERR once.
                st.overflowed = true;
                tracing::error!(cq = %self.shared.name, capacity, "simulated CQ overflow");
                let lost = st.stats.lost;
                self.shared
                    .raise(st, AsyncEvent::CqOverflow { capacity, lost });
            }
            return Err(PushError::Overflow { capacity });
        }
        let seq = st.stats.pushed;
        st.ring.push_back((seq, wc));
        st.stats.pushed += 1;
        let p = st.faults.duplicate;
        if draw(&mut st.dup_rng, p) {
            self.duplicate(st, wc);
        }
        self.shared.publish(st);
        let fires = match st.arm {
            Some(ArmKind::Next) => true,
            Some(ArmKind::Solicited) => solicited || !wc.status.is_success(),
            None => false,
        };
        if fires {
            self.shared.fire(st);
        }
        Ok(())
    }

    /// The `duplicate` fault: `wc` written a second time, if the CQ has
    /// room for it beside what its credits owe.
    #[cold]
    fn duplicate(&self, st: &mut State, wc: Completion) {
        let owed = self
            .shared
            .ledger
            .budget()
            .map_or(0, |b| b.credits_in_use());
        if st.ring.len() as u64 + 1 + owed
            <= u64::from(self.shared.capacity.load(Ordering::Relaxed))
        {
            let seq = st.stats.pushed;
            st.ring.push_back((seq, wc));
            st.stats.pushed += 1;
            st.stats.duplicated += 1;
        }
    }

    /// As [`push`](Self::push), returning the entry's sequence number: the
    /// count of entries ever added before it. The entry has been polled once
    /// [`consumed`](Self::consumed) exceeds it; the NIC frees a queue slot
    /// only then, as hardware does.
    ///
    /// # Errors
    /// As [`push`](Self::push).
    pub fn push_seq(&self, wc: Completion, solicited: bool) -> Result<u64, PushError> {
        let mut st = self.shared.state.lock();
        let seq = st.stats.pushed;
        self.push_locked(&mut st, wc, solicited).map(|()| seq)
    }

    /// Every entry whose sequence number is below this has left the CQ
    /// (polled, or purged with its QP): the sequence number of the oldest
    /// entry still queued, or of the next one.
    pub fn consumed(&self) -> u64 {
        let st = self.shared.state.lock();
        st.ring.front().map_or(st.stats.pushed, |e| e.0)
    }

    /// What a device does with a QP it destroys: removes the entries of
    /// QP `qpn` still queued, keeping the others in order, and returns
    /// their sequence numbers (so that the NIC frees the queue slots they
    /// held; mlx5's `ibv_destroy_qp` cleans its CQs this way). With the
    /// fabric's state locked.
    pub(crate) fn purge_qp(&self, qpn: u32) -> Vec<u64> {
        let mut st = self.shared.state.lock();
        let mut gone = Vec::new();
        st.ring.retain(|(seq, wc)| {
            let keep = wc.qp_num != qpn;
            if !keep {
                gone.push(*seq);
            }
            keep
        });
        if !gone.is_empty() {
            st.stats.purged += gone.len() as u64;
            self.shared.publish(&st);
        }
        gone
    }

    /// Raises an asynchronous event on this CQ (a QP's, routed to the
    /// poller of its receive CQ).
    pub(crate) fn raise_async(&self, ev: AsyncEvent) {
        let mut st = self.shared.state.lock();
        if st.destroyed || st.vanished {
            return;
        }
        self.shared.raise(&mut st, ev);
    }

    /// The QPs the application let go whose completions here are not all
    /// accounted yet (`cqd_core::ledger::Graveyard`): this CQ's poller
    /// reaps them between polls.
    pub(crate) fn grave(&self) -> &Arc<Graveyard> {
        &self.shared.grave
    }

    /// True while the consumer side is held (a poller may still account
    /// what is queued here).
    pub(crate) fn source_alive(&self) -> bool {
        self.shared.source_alive.load(Ordering::Acquire)
    }

    /// Makes `wcs` land in the CQ at the start of the next arm, before the
    /// arm takes effect: after the poller's last empty poll, not notified.
    /// A poller that does not re-poll after arming would miss them.
    pub fn inject_before_next_arm(&self, wcs: &[Completion]) {
        self.shared
            .state
            .lock()
            .inject_before_arm
            .extend_from_slice(wcs);
    }

    /// Changes the fault probabilities.
    pub fn set_faults(&self, faults: Faults) {
        let mut st = self.shared.state.lock();
        st.rng = faults.seed | 1;
        st.dup_rng = dup_seed(faults.seed);
        st.faults = faults;
    }

    /// Entries currently queued.
    pub fn len(&self) -> usize {
        self.shared.state.lock().ring.len()
    }

    /// True when nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// True after an overflow.
    pub fn is_overflowed(&self) -> bool {
        self.shared.state.lock().overflowed
    }

    /// The CQ's capacity.
    pub fn capacity(&self) -> u32 {
        self.shared.capacity.load(Ordering::Relaxed)
    }

    /// What the CQ did so far.
    pub fn stats(&self) -> SimCqStats {
        self.shared.state.lock().stats
    }

    /// Simulates the device going away (hot unplug, a driver reset): an
    /// asynchronous `DeviceFatal` event is raised, and from now on polls and
    /// arms fail with [`SourceError::DeviceGone`] and pushes are refused.
    /// Entries still queued are gone with the device.
    pub fn vanish(&self) {
        let mut st = self.shared.state.lock();
        if !st.vanished {
            st.vanished = true;
            self.shared.publish(&st);
            self.shared.raise(&mut st, AsyncEvent::DeviceFatal);
        }
    }
}

fn gone(name: &str) -> SourceError {
    SourceError::DeviceGone(format!("simulated device of CQ {name} vanished"))
}

/// The consumer side of a simulated CQ, owned by one poller.
#[derive(Debug)]
pub struct SimCqSource {
    shared: Arc<Shared>,
    unacked: u32,
}

impl Drop for SimCqSource {
    fn drop(&mut self) {
        // Nobody will account what is queued here any more: the QPs that
        // wait for it are destroyed now (what they owed is reported
        // missing by the stop).
        self.shared.source_alive.store(false, Ordering::Release);
        self.shared.grave.release_all();
    }
}

impl SimCqSource {
    /// The producer side of the same CQ.
    pub fn producer(&self) -> SimCq {
        SimCq {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl SimCqSource {
    /// Whether the CQ can still be armed or resized: not vanished, not
    /// destroyed, not overflowed (as on hardware, an overflowed CQ stays in
    /// error).
    fn armable(&self, st: &State) -> Result<(), SourceError> {
        if st.vanished {
            return Err(gone(&self.shared.name));
        }
        if st.destroyed {
            return Err(SourceError::Backend("CQ destroyed".into()));
        }
        if st.overflowed {
            return Err(SourceError::CqInError);
        }
        Ok(())
    }
}

impl CompletionSource for SimCqSource {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn ledger(&self) -> Option<WrLedger> {
        Some(self.shared.ledger.clone())
    }

    fn capacity(&self) -> u32 {
        self.shared.capacity.load(Ordering::Relaxed)
    }

    /// Grows the ring's limit under the CQ's lock: the completions in it
    /// stay, in order, and so does an arm. An overflowed CQ stays in
    /// error (as on hardware, a resize does not revive it).
    fn resize(&mut self, cqe: u32) -> Result<u32, SourceError> {
        check_capacity(cqe).map_err(|e| SourceError::Backend(e.to_string()))?;
        let st = self.shared.state.lock();
        self.armable(&st)?;
        let now = self.shared.capacity.load(Ordering::Relaxed).max(cqe);
        self.shared.capacity.store(now, Ordering::Relaxed);
        Ok(now)
    }

    fn poll(&mut self, out: &mut [Completion]) -> Result<usize, SourceError> {
        if !self.shared.grave.is_empty() {
            self.shared.grave.reap();
        }
        if self.shared.queued.load(Ordering::Acquire) == 0
            && !self.shared.dead.load(Ordering::Acquire)
        {
            // Empty: no lock. A push under way lands after this poll; the
            // arm / re-poll order holds because a push publishes the length
            // before it releases the lock an arm takes.
            return Ok(0);
        }
        let mut st = self.shared.state.lock();
        if st.vanished {
            return Err(gone(&self.shared.name));
        }
        if st.destroyed {
            return Err(SourceError::Backend("CQ destroyed".into()));
        }
        let n = out.len().min(st.ring.len());
        for (slot, (_, wc)) in out.iter_mut().zip(st.ring.drain(..n)) {
            *slot = wc;
        }
        self.shared.publish(&st);
        Ok(n)
    }

    fn arm(&mut self, kind: ArmKind) -> Result<(), SourceError> {
        let mut st = self.shared.state.lock();
        self.armable(&st)?;
        st.stats.arms += 1;
        if !st.inject_before_arm.is_empty() {
            // Land after the last empty poll, before the arm: not notified.
            let injected = std::mem::take(&mut st.inject_before_arm);
            for wc in injected {
                if st.ring.len() < self.shared.capacity.load(Ordering::Relaxed) as usize {
                    let seq = st.stats.pushed;
                    st.ring.push_back((seq, wc));
                    st.stats.pushed += 1;
                    st.stats.injected += 1;
                }
            }
            self.shared.publish(&st);
        }
        st.arm = Some(kind);
        let spurious = st.faults.spurious;
        if st.chance(spurious) {
            st.stats.spurious += 1;
            st.stats.notified += 1;
            st.arm = None;
            self.shared.notify();
        }
        Ok(())
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        match &self.shared.notify {
            Notify::Own { event_fd, .. } => event_fd.as_fd(),
            Notify::Channel { chan, .. } => chan.event_fd.as_fd(),
        }
    }

    fn notifier(&self) -> Option<(Arc<dyn SharedNotifier>, u64)> {
        match &self.shared.notify {
            Notify::Own { .. } => None,
            Notify::Channel { chan, member } => {
                let chan: Arc<dyn SharedNotifier> = Arc::clone(chan) as _;
                Some((chan, member.token()))
            }
        }
    }

    fn take_events(&mut self) -> Result<u32, SourceError> {
        let event_fd = match &self.shared.notify {
            Notify::Own { event_fd, .. } => event_fd,
            Notify::Channel { member, .. } => {
                // Only this CQ's notifications, never another's.
                let n = member.take();
                self.unacked = self.unacked.saturating_add(n);
                return Ok(n);
            }
        };
        let mut buf = [0u8; 8];
        match rustix::io::read(event_fd, &mut buf) {
            Ok(8) => {
                let n = u64::from_ne_bytes(buf).min(u64::from(u32::MAX)) as u32;
                self.unacked = self.unacked.saturating_add(n);
                Ok(n)
            }
            Ok(_) => Ok(0),
            Err(rustix::io::Errno::AGAIN) => Ok(0),
            Err(e) => Err(SourceError::Os {
                op: "read eventfd",
                source: e.into(),
            }),
        }
    }

    fn ack_events(&mut self, n: u32) -> Result<(), SourceError> {
        self.unacked = self.unacked.saturating_sub(n);
        Ok(())
    }

    fn unacked_events(&self) -> u32 {
        self.unacked
    }

    fn async_fd(&self) -> Option<BorrowedFd<'_>> {
        Some(match &self.shared.notify {
            Notify::Own { async_fd, .. } => async_fd.as_fd(),
            Notify::Channel { chan, .. } => chan.async_fd.as_fd(),
        })
    }

    fn take_async_event(&mut self) -> Option<AsyncEvent> {
        if self.shared.async_pending.load(Ordering::Acquire) == 0 {
            return None;
        }
        let mut st = self.shared.state.lock();
        let ev = st.async_events.pop_front();
        if ev.is_some() {
            self.shared.async_pending.fetch_sub(1, Ordering::Release);
            self.shared.async_taken(st.async_events.is_empty());
        }
        ev
    }

    fn destroy(&mut self) -> Result<(), SourceError> {
        if self.unacked > 0 {
            return Err(SourceError::UnackedEvents {
                unacked: self.unacked,
            });
        }
        let mut st = self.shared.state.lock();
        st.destroyed = true;
        st.ring.clear();
        self.shared.publish(&st);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cqd_core::completion::Opcode;

    fn wc(i: u64) -> Completion {
        Completion::success(i, Opcode::Send, 1)
    }

    #[test]
    fn arm_fires_once_for_new_completions_only() {
        let (cq, mut src) = sim_cq("t", 8, Faults::default()).unwrap();
        cq.push(wc(1), false).unwrap();
        src.arm(ArmKind::Next).unwrap();
        assert_eq!(
            src.take_events().unwrap(),
            0,
            "queued entries do not fire an arm"
        );
        cq.push(wc(2), false).unwrap();
        cq.push(wc(3), false).unwrap();
        assert_eq!(src.take_events().unwrap(), 1, "one notification per arm");
        assert_eq!(src.unacked_events(), 1);
        assert!(matches!(
            src.destroy(),
            Err(SourceError::UnackedEvents { unacked: 1 })
        ));
        src.ack_events(1).unwrap();
        let mut buf = [Completion::default(); 8];
        assert_eq!(src.poll(&mut buf).unwrap(), 3);
        src.destroy().unwrap();
        assert_eq!(cq.push(wc(4), false), Err(PushError::Destroyed));
    }

    #[test]
    fn solicited_arm() {
        let (cq, mut src) = sim_cq("t", 8, Faults::default()).unwrap();
        src.arm(ArmKind::Solicited).unwrap();
        cq.push(wc(1), false).unwrap();
        assert_eq!(src.take_events().unwrap(), 0);
        cq.push(wc(2), true).unwrap();
        assert_eq!(src.take_events().unwrap(), 1);
        src.arm(ArmKind::Solicited).unwrap();
        cq.push(Completion::error(3, cqd_core::Status::WrFlush, 1), false)
            .unwrap();
        assert_eq!(
            src.take_events().unwrap(),
            1,
            "errors notify a solicited arm"
        );
    }

    #[test]
    fn overflow_is_loud_and_sticky() {
        let (cq, mut src) = sim_cq("t", 2, Faults::default()).unwrap();
        cq.push(wc(1), false).unwrap();
        cq.push(wc(2), false).unwrap();
        assert_eq!(
            cq.push(wc(3), false),
            Err(PushError::Overflow { capacity: 2 })
        );
        let mut buf = [Completion::default(); 4];
        assert_eq!(src.poll(&mut buf).unwrap(), 2);
        assert_eq!(
            cq.push(wc(4), false),
            Err(PushError::Overflow { capacity: 2 })
        );
        assert!(matches!(
            src.take_async_event(),
            Some(AsyncEvent::CqOverflow { capacity: 2, .. })
        ));
        assert!(matches!(
            src.arm(ArmKind::Next),
            Err(SourceError::CqInError)
        ));
        assert_eq!(cq.stats().lost, 2);
    }

    #[test]
    fn faults_drop_and_spurious() {
        let faults = Faults {
            drop: 1.0,
            ..Faults::default()
        };
        let (cq, mut src) = sim_cq("t", 8, faults).unwrap();
        src.arm(ArmKind::Next).unwrap();
        cq.push(wc(1), false).unwrap();
        assert_eq!(src.take_events().unwrap(), 0);
        assert_eq!(cq.stats().dropped, 1);
        cq.set_faults(Faults {
            spurious: 1.0,
            ..Faults::default()
        });
        src.arm(ArmKind::Next).unwrap();
        assert_eq!(src.take_events().unwrap(), 1);
        assert_eq!(cq.stats().spurious, 1);
    }

    #[test]
    fn the_duplicate_fault_writes_a_completion_twice_while_there_is_room() {
        let faults = Faults {
            duplicate: 1.0,
            ..Faults::default()
        };
        let (cq, mut src) = sim_cq("t", 3, faults).unwrap();
        cq.push(wc(1), false).unwrap();
        // The copy of the second would not fit beside it: not written.
        cq.push(wc(2), false).unwrap();
        let mut out = [Completion::default(); 4];
        let n = src.poll(&mut out).unwrap();
        let ids: Vec<u64> = out[..n].iter().map(|c| c.wr_id).collect();
        assert_eq!(ids, [1, 1, 2]);
        let st = cq.stats();
        assert_eq!((st.pushed, st.duplicated, st.lost), (3, 1, 0));
    }

    #[test]
    fn injected_before_arm_is_not_notified() {
        let (cq, mut src) = sim_cq("t", 8, Faults::default()).unwrap();
        cq.inject_before_next_arm(&[wc(9)]);
        src.arm(ArmKind::Next).unwrap();
        assert_eq!(src.take_events().unwrap(), 0);
        let mut buf = [Completion::default(); 4];
        assert_eq!(src.poll(&mut buf).unwrap(), 1);
        assert_eq!(buf[0].wr_id, 9);
    }

    #[test]
    fn an_empty_poll_sees_a_push_and_a_vanish() {
        let (cq, mut src) = sim_cq("t", 8, Faults::default()).unwrap();
        let mut buf = [Completion::default(); 4];
        assert_eq!(src.poll(&mut buf).unwrap(), 0);
        cq.push(wc(1), false).unwrap();
        assert_eq!(src.poll(&mut buf).unwrap(), 1);
        cq.vanish();
        assert!(matches!(
            src.poll(&mut buf),
            Err(SourceError::DeviceGone(_))
        ));
    }
}
