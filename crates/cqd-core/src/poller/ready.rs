//! The group's readiness: which CQs are active or quiet, the epoll set that
//! says which fired, and the safety net — the poller's side of the sleep
//! protocol of `mode` (steps 1–5 and "The safety net" there).
//!
//! # The epoll sets
//!
//! 1. At spawn, every distinct notification descriptor of the group is
//!    registered once in the main set: a CQ's own descriptor under its
//!    index, a shared channel ([`SharedNotifier`]) once under its channel
//!    number, each distinct asynchronous-event descriptor once. A control
//!    set holds the poller's one doorbell (stop, registrations) and, once
//!    the sink took its waker, the space doorbell; the control set is
//!    itself registered in the main set.
//! 2. A block waits on the main set (level-triggered: a descriptor stays
//!    ready until it is drained, so nothing is lost between a wake-up and
//!    the collect); a wait for ring space waits on the control set only.
//! 3. The collect touches only what the wait returned: a CQ's own
//!    descriptor is read by that CQ; a channel says which of its CQs fired
//!    (`SharedNotifier::take_ready`), and each of those takes its own
//!    notifications; a ready control set drains the doorbell (and applies
//!    the queued commands of the CQs whose handles rang it, see
//!    `cq::GroupBell`) and the space doorbell.
//!
//! Every source of a shared channel must belong to the same poller: a
//! token the channel reports for a CQ of no group member is ignored.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::Group;
use crate::cq::GroupBell;
use crate::metrics::bump;
use crate::mode::{PollMode, SleepGroup};
use crate::sink::{SpaceWait, WorkSink};
use crate::source::{CompletionSource, SharedNotifier, SourceError};
use crate::sync::Ordering;
use crate::sys::thread_cpu_time;
use crate::sys::{Doorbell, Epoll};

/// Main-set token of the control set.
const CTL: u64 = u64::MAX;
/// Main-set tokens of shared channels: `NOTIFIER | channel number`.
const NOTIFIER: u64 = 1 << 62;
/// Main-set tokens of asynchronous-event descriptors.
const ASYNC: u64 = 1 << 61;
/// Control-set tokens.
const DOORBELL: u64 = 0;
const SPACE: u64 = 1;

/// The safety net polls at least this many quiet CQs per wake timeout…
pub(super) const SAFETY_MIN_SLICE: usize = 64;
/// …and at least `1 / SAFETY_SWEEP` of the group, so every CQ is polled
/// within this many wake timeouts.
pub(super) const SAFETY_SWEEP: usize = 8;
/// While the poller does not block (it has work, or spins), it still looks
/// at the epoll set this often so that quiet CQs are not starved.
const READY_CHECK: Duration = Duration::from_micros(50);
/// Busy mode: a CQ of a group of several that finds nothing this many
/// polls in a row goes cold…
pub(super) const BUSY_COOL_AFTER: u32 = 64;
/// …and the cold CQs are polled a slice per round, each at least once
/// every this many rounds; one found holding completions is hot again.
pub(super) const BUSY_COLD_SWEEP: usize = 128;

/// One CQ's place in the sleep protocol.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CqState {
    /// Its one-shot arm is in force (not seen firing).
    armed: bool,
    /// Polled every round (on the active list); otherwise quiet.
    active: bool,
    /// In error: never armed, polled by every safety round.
    errored: bool,
    /// Notifications collected since its last poll.
    events: u32,
    /// Busy mode: polls in a row that found nothing, while hot.
    empty: u32,
}

/// The epoll sets and the per-CQ states.
pub(super) struct Readiness {
    /// The shared channels this poller serves, claimed for it alone.
    _claims: Vec<Claimed>,
    epoll: Epoll,
    ctl: Epoll,
    doorbell: Arc<GroupBell>,
    /// CQs whose handles rang the doorbell (commands to apply).
    rung: Vec<usize>,
    notifiers: Vec<(Arc<dyn SharedNotifier>, HashMap<u64, usize>)>,
    /// The asynchronous-event descriptors registered (each once).
    async_fds: std::collections::HashSet<std::os::fd::RawFd>,
    pub(super) st: Vec<CqState>,
    /// Active CQs, by index.
    active: Vec<usize>,
    /// CQs armed by the current step 1.
    just_armed: Vec<usize>,
    errored: Vec<usize>,
    tokens: Vec<u64>,
    ctl_tokens: Vec<u64>,
    scratch: Vec<u64>,
    /// The next CQ the safety net polls.
    cursor: usize,
    /// Busy mode: the next CQ the cold sweep looks at, and the next whose
    /// asynchronous events it checks.
    cold_cursor: usize,
    async_cursor: usize,
    last_safety: Instant,
    last_check: Instant,
    /// An asynchronous-event descriptor was ready: check every CQ.
    async_ready: bool,
}

impl Readiness {
    /// Step 1 of "The epoll sets": registers every distinct descriptor of
    /// `sources` once.
    pub(super) fn new(
        sources: &[&dyn CompletionSource],
        doorbell: Arc<GroupBell>,
    ) -> io::Result<Self> {
        let mut epoll = Epoll::new()?;
        let mut ctl = Epoll::new()?;
        ctl.add(doorbell.as_fd(), DOORBELL)?;
        epoll.add(ctl.as_fd(), CTL)?;
        let now = Instant::now();
        let mut ready = Readiness {
            _claims: Vec::new(),
            epoll,
            ctl,
            doorbell,
            rung: Vec::new(),
            notifiers: Vec::new(),
            async_fds: std::collections::HashSet::new(),
            st: Vec::with_capacity(sources.len()),
            active: Vec::with_capacity(sources.len()),
            just_armed: Vec::new(),
            errored: Vec::new(),
            tokens: Vec::new(),
            ctl_tokens: Vec::new(),
            scratch: Vec::new(),
            cursor: 0,
            cold_cursor: 0,
            async_cursor: 0,
            last_safety: now,
            last_check: now,
            async_ready: false,
        };
        for (i, s) in sources.iter().enumerate() {
            ready.add(i, *s)?;
        }
        Ok(ready)
    }

    /// Registers the descriptors of CQ `i` (the next index: `i` equals
    /// the CQs registered so far), distinct ones once, and places it on
    /// the active list. A CQ joining a running group comes here too
    /// (`poller::arrive`, step 2); on a failure nothing of the CQ stays
    /// registered (a shared channel it would have joined stays, for its
    /// other CQs or a later one).
    pub(super) fn add(&mut self, i: usize, s: &dyn CompletionSource) -> io::Result<()> {
        debug_assert_eq!(i, self.st.len());
        match s.notifier() {
            Some((n, token)) => {
                let k = match self
                    .notifiers
                    .iter()
                    .position(|(m, _)| std::ptr::addr_eq(Arc::as_ptr(m), Arc::as_ptr(&n)))
                {
                    Some(k) => k,
                    None => {
                        claim(&n)?;
                        let claimed = Claimed(Arc::clone(&n));
                        self.epoll
                            .add(n.fd(), NOTIFIER | self.notifiers.len() as u64)?;
                        self.notifiers.push((n, HashMap::new()));
                        self._claims.push(claimed);
                        self.notifiers.len() - 1
                    }
                };
                self.notifiers[k].1.insert(token, i);
            }
            None => self.epoll.add(s.event_fd(), i as u64)?,
        }
        if let Some(fd) = s.async_fd() {
            if !self.async_fds.contains(&fd.as_raw_fd()) {
                if let Err(e) = self
                    .epoll
                    .add(fd, ASYNC | (self.async_fds.len() as u64 + 1))
                {
                    // Undo the CQ's own registration (a channel's stays:
                    // its other CQs, or a later one, use it).
                    match s.notifier() {
                        None => {
                            let _ = self.epoll.delete(s.event_fd());
                        }
                        Some((n, token)) => {
                            for (m, tokens) in &mut self.notifiers {
                                if std::ptr::addr_eq(Arc::as_ptr(m), Arc::as_ptr(&n)) {
                                    tokens.remove(&token);
                                }
                            }
                        }
                    }
                    return Err(e);
                }
                self.async_fds.insert(fd.as_raw_fd());
            }
        }
        self.st.push(CqState {
            active: true,
            ..CqState::default()
        });
        self.active.push(i);
        Ok(())
    }

    /// The group's doorbell (a joining CQ's handle rings it).
    pub(super) fn doorbell(&self) -> Arc<GroupBell> {
        Arc::clone(&self.doorbell)
    }

    /// Registers the space doorbell in the control set.
    pub(super) fn add_space(&mut self, space: &Doorbell) -> io::Result<()> {
        self.ctl.add(space.as_fd(), SPACE)
    }

    fn make_active(&mut self, i: usize) {
        if let Some(s) = self.st.get_mut(i) {
            if !s.active && !s.errored {
                s.active = true;
                self.active.push(i);
            }
        }
    }

    /// Moves CQ `i` to the errored list (polled by every safety round,
    /// never armed again); it leaves the active list at the next arm step.
    fn mark_errored(&mut self, i: usize) {
        if let Some(s) = self.st.get_mut(i) {
            s.active = false;
            if !std::mem::replace(&mut s.errored, true) {
                self.errored.push(i);
            }
        }
    }
}

/// The shared channels claimed by a poller, by address: a channel reports
/// the CQs that fired and forgets them, so a second poller taking its
/// tokens would lose the first one's notifications. One poller per channel.
static CLAIMED: parking_lot::Mutex<Vec<usize>> = parking_lot::Mutex::new(Vec::new());

fn address(n: &Arc<dyn SharedNotifier>) -> usize {
    Arc::as_ptr(n).cast::<()>() as usize
}

/// Claims `n` for the calling poller.
fn claim(n: &Arc<dyn SharedNotifier>) -> io::Result<()> {
    let mut claimed = CLAIMED.lock();
    if claimed.contains(&address(n)) {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "a shared completion channel serves one poller, and this one already serves another: put every CQ of the channel in one poll group",
        ));
    }
    claimed.push(address(n));
    Ok(())
}

/// A claim, released when the poller's readiness goes. It holds the
/// channel, so its address cannot be reused while claimed.
struct Claimed(Arc<dyn SharedNotifier>);

impl Drop for Claimed {
    fn drop(&mut self) {
        let a = address(&self.0);
        CLAIMED.lock().retain(|c| *c != a);
    }
}

impl<W: Send + 'static, S: WorkSink<W>> Group<W, S> {
    /// Polls CQ `i` up to its round budget; a notification collected since
    /// its last poll that finds nothing is counted as spurious.
    fn poll_cq(&mut self, i: usize) -> usize {
        self.try_poll_cq(i).unwrap_or(0)
    }

    /// As [`poll_cq`](Self::poll_cq), telling a failed poll from an empty
    /// one. A CQ whose device is gone leaves the active list for the
    /// errored one (polled by every safety round), so that one dead CQ does
    /// not keep its whole group backing off.
    fn try_poll_cq(&mut self, i: usize) -> Option<usize> {
        let mark = self.spill.mark();
        let cq = self.cqs.get_mut(i)?;
        let n = match cq.poll_round(&mut self.spill.items, mark) {
            Ok(n) => n,
            Err(e) => {
                // Counted by the CQ; traced at 1, 2, 4, 8… so a dead
                // device does not flood the log.
                let count = cq.shared().metrics.0.poll_errors.load(Ordering::Relaxed);
                if count.is_power_of_two() {
                    tracing::error!(cq = cq.name(), error = %e, count, "poll failed");
                }
                // A CQ already on the errored list is polled once per safety
                // round only: its failure is expected, and must not make the
                // group back off.
                let errored = self.ready.st.get(i).is_some_and(|s| s.errored);
                if !errored {
                    self.failing = true;
                }
                if matches!(e, SourceError::DeviceGone(_)) {
                    self.ready.mark_errored(i);
                }
                return None;
            }
        };
        if let Some(s) = self.ready.st.get_mut(i) {
            if s.events > 0 {
                if n == 0 {
                    bump(&cq.shared().metrics.0.spurious_wakeups, 1);
                }
                s.events = 0;
            }
        }
        Some(n)
    }

    /// One round: in Busy mode every CQ, otherwise the active CQs (and the
    /// safety slice when due); then the hand-off.
    pub(super) fn poll_all(&mut self) -> usize {
        let mut total = 0;
        // Due once per wake timeout; the slack keeps a block that ends a
        // hair early from putting it off by a whole timeout.
        let slack = self.wake_timeout / 16;
        let safety_due = self.ready.last_safety.elapsed() + slack >= self.wake_timeout;
        if matches!(self.idle.mode(), PollMode::Busy) {
            total += self.busy_round();
            if safety_due && !self.ready.errored.is_empty() {
                self.ready.last_safety = Instant::now();
                for j in 0..self.ready.errored.len() {
                    let i = self.ready.errored[j];
                    total += self.poll_cq(i);
                }
            }
        } else {
            for j in 0..self.ready.active.len() {
                let i = self.ready.active[j];
                // A CQ marked errored this round leaves the list at the
                // next arm step; until then it is not polled here.
                if !self.ready.st[i].errored {
                    total += self.poll_cq(i);
                }
            }
            if safety_due {
                total += self.safety_round();
            }
        }
        // A round that found completions is followed by another round
        // (the loop's step 5), whose hand-off completes what a burst
        // defers; one that found none may be followed by a sleep.
        if total > 0 {
            self.hand_off_burst();
        } else {
            self.hand_off();
        }
        total
    }

    /// Busy mode's round: every hot CQ (on the active list), each up to its
    /// round budget, so busy CQs share the poller fairly; then a slice of
    /// the cold ones, rotating, so that each is polled at least once every
    /// [`BUSY_COLD_SWEEP`] rounds. A hot CQ that finds nothing
    /// [`BUSY_COOL_AFTER`] polls in a row goes cold (in a group of several;
    /// a lone CQ stays hot), a cold one that finds completions is hot
    /// again. So a round costs the hot CQs and about `1 / BUSY_COLD_SWEEP`
    /// of the quiet ones, not the whole group; CQs in error wait for the
    /// safety time.
    fn busy_round(&mut self) -> usize {
        let mut total = 0;
        let n = self.cqs.len();
        let mut j = 0;
        while j < self.ready.active.len() {
            let i = self.ready.active[j];
            if self.ready.st[i].errored {
                self.ready.st[i].active = false;
                self.ready.active.swap_remove(j);
                continue;
            }
            let got = self.poll_cq(i);
            total += got;
            let s = &mut self.ready.st[i];
            if got > 0 {
                s.empty = 0;
            } else {
                s.empty += 1;
                if s.empty >= BUSY_COOL_AFTER && n > 1 {
                    s.active = false;
                    s.empty = 0;
                    self.ready.active.swap_remove(j);
                    continue;
                }
            }
            j += 1;
        }
        let cold = n - self.ready.active.len();
        let mut want = cold.div_ceil(BUSY_COLD_SWEEP);
        let mut looked = 0;
        while want > 0 && looked < n {
            let i = self.ready.cold_cursor % n;
            self.ready.cold_cursor = i + 1;
            looked += 1;
            let s = self.ready.st[i];
            if s.active || s.errored {
                continue;
            }
            want -= 1;
            let got = self.poll_cq(i);
            if got > 0 {
                total += got;
                self.ready.st[i].active = true;
                self.ready.active.push(i);
            }
        }
        total
    }

    /// Polls every CQ (the stop, step 1 and 2).
    pub(super) fn poll_every_cq(&mut self) -> usize {
        let mut total = 0;
        for i in 0..self.cqs.len() {
            total += self.poll_cq(i);
        }
        self.hand_off();
        total
    }

    /// The safety net (see `mode`): the next slice of quiet CQs, and every
    /// CQ in error. A quiet CQ found holding completions missed a
    /// notification: counted, traced, made active and unarmed.
    fn safety_round(&mut self) -> usize {
        self.ready.last_safety = Instant::now();
        // Take what is already notified first: a CQ whose notification is
        // on its way is active, not a missed one.
        self.ready.last_check = self.ready.last_safety;
        self.collect_now();
        let n = self.cqs.len();
        let slice = n.min(SAFETY_MIN_SLICE.max(n.div_ceil(SAFETY_SWEEP)));
        let mut total = 0;
        for _ in 0..slice {
            let i = self.ready.cursor;
            self.ready.cursor = (i + 1) % n;
            if let Some(cq) = self.cqs.get_mut(i) {
                cq.check_async();
            }
            if self.ready.st[i].active || self.ready.st[i].errored {
                continue;
            }
            let found = self.poll_cq(i);
            if found > 0 {
                // The completions' notification may have been on its way
                // when the round collected: a poll that found them saw the
                // device's state after it fired (a device notifies when it
                // writes the completion), so look once more before calling
                // it missed.
                self.collect_now();
                if self.ready.st[i].active {
                    // Notified late, not missed; what it announced is
                    // already polled.
                    self.ready.st[i].events = 0;
                    total += found;
                    continue;
                }
                let cq = &self.cqs[i];
                bump(&cq.shared().metrics.0.recovered_missed_events, 1);
                tracing::warn!(
                    cq = cq.name(),
                    found,
                    "safety net found completions: a notification was missed and recovered"
                );
                self.ready.st[i].armed = false;
                self.ready.make_active(i);
            }
            total += found;
        }
        for j in 0..self.ready.errored.len() {
            let i = self.ready.errored[j];
            total += self.poll_cq(i);
        }
        total
    }

    /// Asynchronous events: every CQ after an async descriptor was ready;
    /// otherwise the active ones (in Busy mode, the hot ones). The quiet
    /// ones are checked by the safety round slice by slice, in Busy mode
    /// (which looks at no epoll set) an eighth of them every `READY_CHECK`.
    /// True when a CQ took an SRQ user's last WQE and must be polled
    /// before the poller sleeps (step 3 of `ledger::teardown`).
    pub(super) fn check_async(&mut self) -> bool {
        let mut repoll = false;
        if std::mem::take(&mut self.ready.async_ready) {
            for i in 0..self.cqs.len() {
                repoll |= self.check_async_of(i);
            }
        } else {
            for j in 0..self.ready.active.len() {
                let i = self.ready.active[j];
                repoll |= self.check_async_of(i);
            }
        }
        repoll
    }

    /// Every CQ's asynchronous events (the stop's drain).
    pub(super) fn check_async_all(&mut self) {
        for i in 0..self.cqs.len() {
            self.check_async_of(i);
        }
    }

    /// The stop's hand-back of the receives still posted on SRQs no QP can
    /// take from any more (`CqPoller::return_srq_receives`), then the
    /// hand-off. Returns how many.
    pub(super) fn return_srq_receives(&mut self) -> usize {
        let mut total = 0;
        for cq in &mut self.cqs {
            total += cq.return_srq_receives(&mut self.spill.items);
        }
        if total > 0 {
            self.hand_off();
        }
        total
    }

    /// CQ `i`'s asynchronous events. A CQ that took an SRQ user's last WQE
    /// is made active, so that it is polled before the poller sleeps
    /// (step 3 of `ledger::teardown`).
    fn check_async_of(&mut self, i: usize) -> bool {
        if let Some(cq) = self.cqs.get_mut(i) {
            cq.check_async();
            if cq.quiescing() {
                self.ready.make_active(i);
                return true;
            }
        }
        false
    }

    /// While not blocking (work, or spinning), looks at the epoll set every
    /// `READY_CHECK` so a quiet CQ that fired is not left waiting.
    /// In Busy mode (which never blocks), drains the doorbell as often, so
    /// that its notes do not pile up (every round applies commands anyway).
    pub(super) fn check_ready(&mut self, now: Instant) {
        if now.saturating_duration_since(self.ready.last_check) < READY_CHECK {
            return;
        }
        self.ready.last_check = now;
        if matches!(self.idle.mode(), PollMode::Busy) {
            self.on_doorbell();
            // Busy mode looks at no epoll set: the asynchronous events of
            // the cold CQs are checked here (the hot ones' every loop), a
            // rotating eighth of the group each time, so every CQ's within
            // 8 × READY_CHECK.
            let n = self.cqs.len();
            for _ in 0..n.div_ceil(SAFETY_SWEEP) {
                let i = self.ready.async_cursor % n;
                self.ready.async_cursor = i + 1;
                self.check_async_of(i);
            }
        } else {
            self.collect_now();
        }
    }

    /// The back-off of a failing group: waits `pause` on the whole epoll
    /// set, not on the control set only, and collects what fired, so that
    /// healthy quiet CQs of the group keep their latency.
    pub(super) fn back_off_on_events(&mut self, pause: Duration) -> io::Result<()> {
        self.ready.epoll.wait(Some(pause), &mut self.ready.tokens)?;
        self.ready.last_check = Instant::now();
        if self.on_control() {
            self.drain_space();
        }
        if let Err(e) = self.collect_events() {
            tracing::error!(error = %e, "collecting notifications failed");
        }
        Ok(())
    }

    /// Steps 3–4 without blocking: takes what is ready now.
    fn collect_now(&mut self) {
        if self.ready.epoll.wait(None, &mut self.ready.tokens).is_ok()
            && !self.ready.tokens.is_empty()
        {
            if self.on_control() {
                // No space wait is armed outside a block: a late ring.
                self.drain_space();
            }
            if let Err(e) = self.collect_events() {
                tracing::error!(error = %e, "collecting notifications failed");
                self.failing = true;
            }
        }
    }

    /// A ready control set: drains the doorbell (a control wake-up: apply
    /// queued commands) and the space doorbell. Returns whether space was
    /// signalled.
    fn on_control(&mut self) -> bool {
        if !self.ready.tokens.contains(&CTL) {
            return false;
        }
        let _ = self.ready.ctl.wait(None, &mut self.ready.ctl_tokens);
        let space = self.ready.ctl_tokens.contains(&SPACE);
        if self.ready.ctl_tokens.contains(&DOORBELL) {
            self.on_doorbell();
        }
        space
    }

    /// Drains the doorbell; if it rang, a control wake-up: applies the
    /// commands of the CQs whose handles rang it (not of every CQ).
    fn on_doorbell(&mut self) {
        let mut rung = std::mem::take(&mut self.ready.rung);
        if self.ready.doorbell.drain(&mut rung) {
            bump(&self.metrics.0.control_wakeups, 1);
            let mut arrived = false;
            for &i in &rung {
                if let Some(cq) = self.cqs.get_mut(i) {
                    cq.apply_commands();
                }
                arrived |= i == super::ARRIVAL;
            }
            if arrived {
                self.join_arrivals();
            }
        }
        rung.clear();
        self.ready.rung = rung;
    }

    /// Waits on the control set only (the spill's space wait, a back-off):
    /// until the doorbell or the space doorbell rings or `timeout` passes.
    pub(super) fn wait_control(&mut self, timeout: Duration) -> io::Result<()> {
        self.ready
            .ctl
            .wait(Some(timeout), &mut self.ready.ctl_tokens)?;
        self.on_doorbell();
        Ok(())
    }

    /// Drains the space doorbell when no space wait is armed (a late ring).
    fn drain_space(&self) {
        if let Some(d) = &self.spill.space {
            d.drain();
        }
    }
}

impl<W: Send + 'static, S: WorkSink<W>> SleepGroup for Group<W, S> {
    type Error = SourceError;

    /// Step 1. A CQ in error (an overflow) is reported once by
    /// [`CqPoller::arm`](crate::cq::CqPoller::arm) and never armed again:
    /// it leaves the active list for the safety rounds.
    fn arm_unarmed(&mut self) -> Result<usize, SourceError> {
        let r = &mut self.ready;
        r.just_armed.clear();
        let active = std::mem::take(&mut r.active);
        let mut result = Ok(());
        for &i in &active {
            let (Some(cq), Some(s)) = (self.cqs.get_mut(i), r.st.get_mut(i)) else {
                continue;
            };
            if result.is_err() {
                r.active.push(i);
                continue;
            }
            if s.errored {
                s.active = false;
                continue;
            }
            if cq.is_in_error() {
                s.active = false;
                if !std::mem::replace(&mut s.errored, true) {
                    r.errored.push(i);
                }
                continue;
            }
            if s.armed {
                // Armed earlier and polled empty by the last round: quiet.
                s.active = false;
                continue;
            }
            match cq.arm() {
                Ok(()) => {
                    s.armed = true;
                    r.just_armed.push(i);
                    r.active.push(i);
                }
                Err(SourceError::CqInError | SourceError::DeviceGone(_)) => {
                    s.active = false;
                    if !std::mem::replace(&mut s.errored, true) {
                        r.errored.push(i);
                    }
                }
                Err(e) => {
                    r.active.push(i);
                    result = Err(e);
                }
            }
        }
        result.map(|()| self.ready.just_armed.len())
    }

    /// Step 2.
    fn repoll_armed(&mut self) -> Result<usize, SourceError> {
        if self.spill.above_mark() {
            return Ok(0);
        }
        let mut total = 0;
        let armed = std::mem::take(&mut self.ready.just_armed);
        for &i in &armed {
            match self.try_poll_cq(i) {
                Some(0) => self.ready.st[i].active = false,
                Some(n) => total += n,
                // A failed re-poll is no proof of an empty CQ: it stays
                // active, and the sleep does not block on it.
                None => total += 1,
            }
        }
        self.ready.just_armed = armed;
        let st = &self.ready.st;
        self.ready.active.retain(|&i| st[i].active);
        self.hand_off();
        Ok(total)
    }

    /// Step 3: the main epoll set (with a spill, the space doorbell is in
    /// it through the control set: see `spill`, rule 2).
    fn block(&mut self, timeout: Duration) -> Result<bool, SourceError> {
        if self.stop.load(Ordering::Acquire) {
            return Ok(false);
        }
        let mut timeout = timeout;
        let mut retry = false;
        let armed = !self.spill.items.is_empty()
            && match self.arm_space() {
                SpaceWait::Progress => {
                    self.spill.skipped_block = true;
                    return Ok(false);
                }
                SpaceWait::Armed => true,
                _ => {
                    timeout = timeout.min(self.retry_pause());
                    retry = true;
                    false
                }
            };
        let n = self
            .ready
            .epoll
            .wait(Some(timeout), &mut self.ready.tokens)
            .map_err(|source| SourceError::Os {
                op: "epoll_wait",
                source,
            })?;
        self.ready.last_check = Instant::now();
        let space = self.on_control();
        if armed || retry {
            bump(&self.metrics.0.space_waits, 1);
        }
        if armed {
            self.end_space_wait();
        } else if space {
            self.drain_space();
        }
        // A retry pause is not the safety timeout.
        Ok(n == 0 && !retry)
    }

    /// Step 4: only the ready descriptors.
    fn collect_events(&mut self) -> Result<u32, SourceError> {
        let mut total = 0;
        let tokens = std::mem::take(&mut self.ready.tokens);
        let mut result = Ok(());
        for &t in &tokens {
            if t == CTL {
                continue;
            }
            if t & NOTIFIER != 0 {
                let k = (t & !NOTIFIER) as usize;
                let mut fired = std::mem::take(&mut self.ready.scratch);
                fired.clear();
                if let Some((n, map)) = self.ready.notifiers.get(k) {
                    if let Err(e) = n.take_ready(&mut fired) {
                        result = Err(e);
                    }
                    for tok in &mut fired {
                        *tok = map.get(tok).map_or(u64::MAX, |&i| i as u64);
                    }
                }
                for &i in &fired {
                    if i != u64::MAX {
                        match self.take_cq_events(i as usize) {
                            Ok(n) => total += n,
                            Err(e) => result = Err(e),
                        }
                    }
                }
                self.ready.scratch = fired;
            } else if t & ASYNC != 0 {
                self.ready.async_ready = true;
            } else {
                match self.take_cq_events(t as usize) {
                    Ok(n) => total += n,
                    Err(e) => result = Err(e),
                }
            }
        }
        self.ready.tokens = tokens;
        self.ready.tokens.clear();
        result.map(|()| total)
    }

    fn poll_round(&mut self) -> Result<usize, SourceError> {
        // The sleep cycle's own cost ends here; what the handlers do next
        // is not the price of sleeping (Adaptive compares the two).
        self.sleep_cpu_end = Some(thread_cpu_time());
        // A wake-up's round is timed for the slow check as the loop's
        // rounds are (`Group::round_from`): two clock reads beside the
        // wake-up's system calls.
        let Some(threshold) = self.slow_threshold else {
            return Ok(self.round());
        };
        let start = Instant::now();
        let found = self.round();
        let took = start.elapsed();
        if found > 0 && took > threshold {
            self.slow_round(took);
        }
        Ok(found)
    }
}

impl<W: Send + 'static, S: WorkSink<W>> Group<W, S> {
    /// Takes CQ `i`'s own notifications; if any, it fired: unarmed and
    /// active. Acknowledges once `ack_batch` are pending.
    fn take_cq_events(&mut self, i: usize) -> Result<u32, SourceError> {
        let Some(cq) = self.cqs.get_mut(i) else {
            return Ok(0);
        };
        let n = cq.take_events()?;
        // The notification is consumed: the CQ is active before anything
        // else can fail.
        if n > 0 {
            let s = &mut self.ready.st[i];
            s.events = s.events.saturating_add(n);
            s.armed = false;
            self.ready.make_active(i);
        }
        if cq.unacked_events() >= self.ack_batch {
            cq.ack_all()?;
        }
        Ok(n)
    }
}
