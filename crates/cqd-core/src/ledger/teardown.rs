//! Tearing a QP down without losing what its CQs still hold.
//!
//! A device may drop a destroyed QP's completions that are still in its
//! CQs: mlx5's `ibv_destroy_qp` purges them from both CQs, and frees the
//! SRQ receives they consumed, so that no completion will ever retire
//! those receives' entries. On such a device a QP is therefore destroyed
//! only once every completion of it has been polled and accounted:
//!
//! - its send queue and its own receive queue: once their accounts, closed,
//!   hold nothing (the error state flushed everything, and a drain marker
//!   follows a silent tail);
//! - its use of an SRQ: once the device said it will take no more of the
//!   SRQ's receives for the QP (`IBV_EVENT_QP_LAST_WQE_REACHED`, which it
//!   raises after the completions of the receives it took), and the poller
//!   of the QP's receive CQ has then polled that CQ empty.
//!
//! Another device keeps a destroyed QP's completions in its CQs and may
//! never raise `LAST_WQE_REACHED` (the kernel's rxe on 6.1: its destroy
//! stops the QP's tasks before it returns, and its CQ has no clean). There
//! the destroy itself is what says that the QP adds nothing more: the
//! backend destroys the QP once its own queues are accounted, and its SRQ
//! use is quiesced by the same short poll, after the destroy (step 2').
//! Which of the two a device is, the backend knows (cqd-verbs:
//! `cqd_verbs::Teardown`).
//!
//! **The protocol of an SRQ user** (cited by the poller and the backends):
//!
//! 1. **Attach.** Making a QP on an SRQ, the backend attaches it in the
//!    receive CQ's ledger ([`super::WrLedger::attach_srq_user`]), which
//!    maps (QP, receive) to the SRQ's account and keeps an [`SrqUser`]
//!    for the QP, *attached*.
//! 2. **Last WQE.** The receive CQ's poller takes the device's
//!    `LAST_WQE_REACHED` for the QP from its asynchronous events and marks
//!    the user *last WQE seen* (`WrLedger::last_wqe_reached`).
//!
//!    **2'. Destroyed** (a device that keeps a destroyed QP's
//!    completions). The backend destroys the QP once its own queues'
//!    accounts hold nothing, marks the user *destroyed*
//!    ([`SrqUser::mark_destroyed`]) and hands the receive CQ's poller
//!    [`AsyncEvent::QpDestroyed`](crate::source::AsyncEvent::QpDestroyed)
//!    for it; the poller takes it as it takes a last WQE
//!    (`WrLedger::qp_destroyed`). The user stays attached, under its QP
//!    number, until step 3: a backend gives a new QP of that number (the
//!    device may reuse it) no account on this ledger while the user is
//!    here ([`super::WrLedger::has_srq_user`]), so the destroyed QP's
//!    completions still in the CQ retire the SRQ's entries and nothing of
//!    a new QP's.
//! 3. **Quiesce.** The same poller, at the end of its next poll that began
//!    after step 2 (or 2') and came back short of a full batch (the CQ was
//!    empty when it read it), after that batch is accounted, marks the user
//!    *quiesced*, detaches (QP, receive) from the ledger's map and forgets
//!    the user (`WrLedger::quiesce`). Every completion the device wrote
//!    for the QP before the event (before the destroy returned) was in the
//!    CQ before that poll began, so it has been accounted.
//! 4. **Destroy.** A QP the application let go waits in its CQ's
//!    [`Graveyard`] until it is [`Zombie::ready`] (its accounts empty, its
//!    SRQ user quiesced). Whichever thread makes the last condition true
//!    reaps it: the send CQ's poller between polls, or the receive CQ's
//!    poller at step 3 (the user holds the graveyard it waits in).
//!    `Graveyard::reap` takes the graveyard's lock, so of the two threads
//!    that each make one condition true, the second to take it sees both.
//!    After step 2' the device's QP is gone already: what waits in the
//!    receive CQ's graveyard until step 3 is the rest of it (its admission
//!    and the signal its close waits for), reaped the same way.
//!
//! A device that never raises the event and is not known to keep a
//! destroyed QP's completions (or a poller that is gone) leaves the user
//! attached: the backend then destroys the QP when its CQ goes, and the
//! stop reports what is missing.

use std::sync::{Arc, Weak};

use crate::sync::{AtomicBool, AtomicU8, Ordering, ShortMutex as Mutex};

const ATTACHED: u8 = 0;
const LAST_WQE: u8 = 1;
const DESTROYED: u8 = 2;
const QUIESCED: u8 = 3;

/// One QP's use of an SRQ, as its receive CQ's ledger keeps it (see the
/// module documentation for the protocol).
#[derive(Debug)]
pub struct SrqUser {
    qp_num: u32,
    srq: u32,
    state: AtomicU8,
    /// The graveyard the QP waits in, once the application let it go: the
    /// poller that quiesces the user reaps it (step 4).
    grave: Mutex<Option<Weak<Graveyard>>>,
}

impl SrqUser {
    pub(crate) fn new(qp_num: u32, srq: u32) -> Self {
        SrqUser {
            qp_num,
            srq,
            state: AtomicU8::new(ATTACHED),
            grave: Mutex::new(None),
        }
    }

    /// The QP.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// The SRQ's number.
    pub fn srq(&self) -> u32 {
        self.srq
    }

    /// True once past step 2: the device said it takes no more receives
    /// for the QP (`LAST_WQE_REACHED`), or the QP is destroyed on a device
    /// that keeps a destroyed QP's completions (step 2').
    pub fn last_wqe_seen(&self) -> bool {
        self.state.load(Ordering::Acquire) >= LAST_WQE
    }

    /// True between step 2' and step 3: the device's QP is destroyed and
    /// its receive CQ's poller has not yet polled that CQ empty since.
    pub fn destroyed(&self) -> bool {
        self.state.load(Ordering::Acquire) == DESTROYED
    }

    /// True once every completion of the QP's SRQ receives has been
    /// polled and accounted (step 3): the QP can be destroyed as far as
    /// the SRQ is concerned.
    pub fn quiesced(&self) -> bool {
        self.state.load(Ordering::Acquire) == QUIESCED
    }

    /// Step 2; false if the user was past it already.
    pub(crate) fn mark_last_wqe(&self) -> bool {
        self.state
            .compare_exchange(ATTACHED, LAST_WQE, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Step 2', the backend's part: the QP is destroyed (its device keeps
    /// a destroyed QP's completions and wrote all of them before the
    /// destroy returned). The backend then hands the receive CQ's poller
    /// [`AsyncEvent::QpDestroyed`](crate::source::AsyncEvent::QpDestroyed)
    /// for it. False if the user was past step 2 already (the device
    /// raised `LAST_WQE_REACHED`: its quiesce is under way, and needs no
    /// event).
    pub fn mark_destroyed(&self) -> bool {
        self.state
            .compare_exchange(ATTACHED, DESTROYED, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Step 3, then step 4's reap of the graveyard the QP waits in (after
    /// the store: a reap that ran before it would find the QP not ready,
    /// and the thread that made the other conditions true may have reaped
    /// already).
    pub(crate) fn mark_quiesced(&self) {
        #[cfg(all(test, loom))]
        let early = REAP_BEFORE_QUIESCED.with(|m| m.get());
        #[cfg(not(all(test, loom)))]
        let early = false;
        if !early {
            self.state.store(QUIESCED, Ordering::Release);
        }
        let grave = self.grave.lock().take().and_then(|g| g.upgrade());
        if let Some(g) = grave {
            g.reap();
        }
        if early {
            self.state.store(QUIESCED, Ordering::Release);
        }
    }

    /// Names the graveyard the QP waits in (step 4).
    pub fn waits_in(&self, grave: &Arc<Graveyard>) {
        *self.grave.lock() = Some(Arc::downgrade(grave));
    }
}

/// A QP the application let go, waiting for its completions to be
/// accounted before the device may destroy it. Dropping it destroys it.
pub trait Zombie: Send {
    /// True when it may be destroyed: every completion of it polled and
    /// accounted.
    fn ready(&self) -> bool;
}

/// Fired once a closed QP is destroyed (its zombie dropped): what a
/// [`CloseWait`] waits for. The backend holds one per QP and fires it after
/// the device's destroy.
#[derive(Debug, Default)]
pub struct CloseSignal {
    done: std::sync::Mutex<bool>,
    cv: std::sync::Condvar,
    wakers: std::sync::Mutex<Vec<std::task::Waker>>,
}

impl CloseSignal {
    /// A signal not fired yet.
    pub fn new() -> Arc<Self> {
        Arc::new(CloseSignal::default())
    }

    /// The QP is destroyed: wakes every waiter (once; later calls do
    /// nothing).
    pub fn fire(&self) {
        {
            let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
            if *done {
                return;
            }
            *done = true;
        }
        self.cv.notify_all();
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|p| p.into_inner()));
        for w in wakers {
            w.wake();
        }
    }

    /// True once fired.
    pub fn is_fired(&self) -> bool {
        *self.done.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits until fired, at most `timeout`; whether it was.
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + timeout;
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while !*done {
            let now = std::time::Instant::now();
            if now >= deadline {
                return false;
            }
            done = self
                .cv
                .wait_timeout(done, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        true
    }

    /// A future's poll: ready once fired, else the task's waker is kept
    /// (once) for [`fire`](Self::fire).
    pub fn poll_fired(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.is_fired() {
            return std::task::Poll::Ready(());
        }
        {
            let mut w = self.wakers.lock().unwrap_or_else(|p| p.into_inner());
            if !w.iter().any(|x| x.will_wake(cx.waker())) {
                w.push(cx.waker().clone());
            }
        }
        // Fired between the check and the registration: `fire` took the
        // wakers before or after the push; look again.
        if self.is_fired() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    }
}

/// A QP's close under way: the QP is in the error state and waits, in its
/// send CQ's graveyard, for its completions to be accounted; it is
/// destroyed (its admission given back) by its CQs' pollers. Wait with
/// [`wait`](Self::wait) on a thread that is not one of those pollers, or
/// await it (it is a future; bound it with the runtime's timeout and name
/// what was missing with [`timed_out`](Self::timed_out)). Dropping it
/// does not stop the close.
#[must_use = "the close goes on without it; wait on it to know the QP is gone"]
#[derive(Debug)]
pub struct CloseWait {
    qp_num: u32,
    signal: Arc<CloseSignal>,
    send: Arc<crate::account::QueueAccount>,
    recv: Option<Arc<crate::account::QueueAccount>>,
    srq_user: Option<Arc<SrqUser>>,
}

impl CloseWait {
    /// The wait for QP `qp_num`'s `signal`; its accounts (its send
    /// queue's, and its receive queue's or its SRQ's) and its SRQ user say
    /// what is missing when it times out.
    pub fn new(
        qp_num: u32,
        signal: &Arc<CloseSignal>,
        send: &Arc<crate::account::QueueAccount>,
        recv: &Arc<crate::account::QueueAccount>,
        srq_user: Option<&Arc<SrqUser>>,
    ) -> Self {
        let own = recv.queue() == crate::account::Queue::Recv;
        CloseWait {
            qp_num,
            signal: Arc::clone(signal),
            send: Arc::clone(send),
            recv: own.then(|| Arc::clone(recv)),
            srq_user: srq_user.cloned(),
        }
    }

    /// The QP.
    pub fn qp_num(&self) -> u32 {
        self.qp_num
    }

    /// True once the QP is destroyed.
    pub fn is_done(&self) -> bool {
        self.signal.is_fired()
    }

    /// Waits until the QP is destroyed, at most `timeout`.
    ///
    /// # Errors
    /// [`CloseTimedOut`], naming the QP and what it still waits for; the
    /// close goes on.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<(), CloseTimedOut> {
        if self.signal.wait(timeout) {
            Ok(())
        } else {
            Err(self.timed_out())
        }
    }

    /// What the QP still waits for, as an error (for a wait bounded by the
    /// caller, an async one).
    pub fn timed_out(&self) -> CloseTimedOut {
        CloseTimedOut {
            qp_num: self.qp_num,
            sends: self.send.outstanding(),
            recvs: self.recv.as_ref().map_or(0, |r| r.outstanding()),
            srq: self
                .srq_user
                .as_ref()
                .filter(|u| !u.quiesced())
                .map(|u| (u.srq(), u.last_wqe_seen())),
            destroyed: self.srq_user.as_ref().is_some_and(|u| u.destroyed()),
        }
    }
}

impl std::future::Future for CloseWait {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.signal.poll_fired(cx)
    }
}

/// A handler's retirement under way ([`CqHandle::unregister`]): it keeps
/// receiving the completions and flushes of what it posted, and its
/// poller drops it once none is outstanding. Wait with
/// [`wait`](Self::wait) on a thread that is not its poller, or await it.
/// It also ends when the poller stops with the handler still there (the
/// stop's report says what it left). Dropping it does not stop the
/// retirement.
///
/// [`CqHandle::unregister`]: crate::CqHandle::unregister
#[derive(Debug)]
pub struct Retired {
    key: crate::wr_id::HandlerKey,
    signal: Arc<CloseSignal>,
}

impl Retired {
    pub(crate) fn new(key: crate::wr_id::HandlerKey, signal: Arc<CloseSignal>) -> Self {
        Retired { key, signal }
    }

    /// The handler.
    pub fn key(&self) -> crate::wr_id::HandlerKey {
        self.key
    }

    /// True once the handler is gone.
    pub fn is_done(&self) -> bool {
        self.signal.is_fired()
    }

    /// Waits until the handler is gone, at most `timeout`.
    ///
    /// # Errors
    /// [`NotDrained`]: requests it posted are still outstanding.
    pub fn wait(&self, timeout: std::time::Duration) -> Result<(), NotDrained> {
        if self.signal.wait(timeout) {
            Ok(())
        } else {
            Err(NotDrained { key: self.key })
        }
    }
}

impl std::future::Future for Retired {
    type Output = ();

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        self.signal.poll_fired(cx)
    }
}

/// A retirement that did not end in time ([`Retired::wait`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("handler {key} has not drained yet: requests it posted are still outstanding (their completions or flushes not polled)")]
#[non_exhaustive]
pub struct NotDrained {
    /// The handler.
    pub key: crate::wr_id::HandlerKey,
}

/// A close that did not end in time ([`CloseWait::wait`]): the QP is still
/// waiting to be destroyed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("QP {qp_num} is not closed yet: {}", self.waiting_for())]
#[non_exhaustive]
pub struct CloseTimedOut {
    /// The QP.
    pub qp_num: u32,
    /// Its send requests not completed (flushes not yet polled).
    pub sends: usize,
    /// Its own receive queue's requests not completed.
    pub recvs: usize,
    /// Its SRQ, if its use of it is not quiesced, and whether it is past
    /// step 2 of the protocol: the device said `LAST_WQE_REACHED` for it,
    /// or (a device that keeps a destroyed QP's completions) it is
    /// destroyed.
    pub srq: Option<(u32, bool)>,
    /// The device's QP is destroyed already and its SRQ use waits for its
    /// receive CQ's poller to poll that CQ empty (step 2' of the
    /// protocol).
    pub destroyed: bool,
}

impl CloseTimedOut {
    fn waiting_for(&self) -> String {
        let mut parts = Vec::new();
        if self.sends > 0 {
            parts.push(format!("{} send requests not completed", self.sends));
        }
        if self.recvs > 0 {
            parts.push(format!("{} receives not completed", self.recvs));
        }
        match self.srq {
            Some((srq, false)) => parts.push(format!(
                "no IBV_EVENT_QP_LAST_WQE_REACHED from the device for its use of SRQ {srq}"
            )),
            Some((srq, true)) if self.destroyed => parts.push(format!(
                "destroyed; its receive CQ's poller has not polled it empty since (SRQ {srq})"
            )),
            Some((srq, true)) => parts.push(format!(
                "its receive CQ's poller has not polled it empty since its last WQE (SRQ {srq})"
            )),
            None => {}
        }
        if parts.is_empty() {
            parts.push("its CQ's poller has not reaped it yet".into());
        }
        parts.join("; ")
    }
}

#[cfg(all(test, loom))]
std::thread_local! {
    /// The loom model's mutation of [`SrqUser::mark_quiesced`]: the reap
    /// before the store.
    static REAP_BEFORE_QUIESCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The QPs waiting to be destroyed (step 4), kept by a CQ whose poller
/// reaps them between polls.
pub struct Graveyard {
    zombies: Mutex<Vec<Box<dyn Zombie>>>,
    any: AtomicBool,
}

impl Default for Graveyard {
    fn default() -> Self {
        Graveyard {
            zombies: Mutex::new(Vec::new()),
            any: AtomicBool::new(false),
        }
    }
}

impl std::fmt::Debug for Graveyard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graveyard")
            .field("zombies", &self.zombies.lock().len())
            .finish()
    }
}

impl Graveyard {
    /// An empty graveyard.
    pub fn new() -> Arc<Self> {
        Arc::new(Graveyard::default())
    }

    /// Keeps `z` until it is ready (then a reap drops it), or drops it now
    /// if it is ready already.
    pub fn bury(&self, z: Box<dyn Zombie>) {
        if z.ready() {
            drop(z);
            return;
        }
        self.zombies.lock().push(z);
        self.any.store(true, Ordering::Release);
        // A condition made true between the check above and the push found
        // nothing to reap: look again, under the lock.
        self.reap();
    }

    /// Keeps `z` until a reap finds it ready, ready or not now: for a
    /// backend whose destroy must run on the CQ's poller thread, which it
    /// asks to reap.
    pub fn keep(&self, z: Box<dyn Zombie>) {
        self.zombies.lock().push(z);
        self.any.store(true, Ordering::Release);
    }

    /// True when something waits (one load: the poller's check between
    /// polls).
    #[inline]
    pub fn is_empty(&self) -> bool {
        !self.any.load(Ordering::Acquire)
    }

    /// Drops (destroys) every zombie that is ready, outside the lock.
    pub fn reap(&self) {
        let ready: Vec<Box<dyn Zombie>> = {
            let mut z = self.zombies.lock();
            let (ready, keep): (Vec<_>, Vec<_>) =
                std::mem::take(&mut *z).into_iter().partition(|q| q.ready());
            *z = keep;
            self.any.store(!z.is_empty(), Ordering::Release);
            ready
        };
        drop(ready);
    }

    /// Zombies waiting.
    pub fn len(&self) -> usize {
        self.zombies.lock().len()
    }

    /// Drops every zombie, ready or not (the CQ's poller is gone, or the
    /// CQ goes): what they still owed is reported missing by the stop.
    pub fn release_all(&self) {
        let all = std::mem::take(&mut *self.zombies.lock());
        self.any.store(false, Ordering::Release);
        drop(all);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    struct Z {
        ready: Arc<AtomicBool>,
        dropped: Arc<AtomicUsize>,
    }
    impl Zombie for Z {
        fn ready(&self) -> bool {
            self.ready.load(Ordering::Acquire)
        }
    }
    impl Drop for Z {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, Ordering::AcqRel);
        }
    }

    #[test]
    fn a_zombie_goes_when_ready_and_a_quiesced_user_reaps_its_grave() {
        let g = Graveyard::new();
        let (ready, dropped) = (Arc::new(AtomicBool::new(false)), Arc::default());
        g.bury(Box::new(Z {
            ready: Arc::clone(&ready),
            dropped: Arc::clone(&dropped),
        }));
        assert!(!g.is_empty());
        g.reap();
        assert_eq!(dropped.load(Ordering::Acquire), 0);
        let user = SrqUser::new(7, 1);
        user.waits_in(&g);
        assert!(user.mark_last_wqe());
        assert!(!user.mark_last_wqe(), "once");
        assert!(!user.mark_destroyed(), "past step 2 already");
        assert!(user.last_wqe_seen() && !user.destroyed());
        ready.store(true, Ordering::Release);
        user.mark_quiesced();
        assert!(user.quiesced());
        assert_eq!(dropped.load(Ordering::Acquire), 1);
        assert!(g.is_empty());
        // A ready zombie is dropped at once.
        let d2: Arc<AtomicUsize> = Arc::default();
        g.bury(Box::new(Z {
            ready: Arc::new(AtomicBool::new(true)),
            dropped: Arc::clone(&d2),
        }));
        assert_eq!((d2.load(Ordering::Acquire), g.len()), (1, 0));
        // release_all drops what is not ready.
        let d3: Arc<AtomicUsize> = Arc::default();
        g.bury(Box::new(Z {
            ready: Arc::new(AtomicBool::new(false)),
            dropped: Arc::clone(&d3),
        }));
        g.release_all();
        assert_eq!(d3.load(Ordering::Acquire), 1);
    }

    #[test]
    fn a_destroyed_user_is_past_step_2_until_quiesced() {
        let user = SrqUser::new(8, 1);
        assert!(!user.last_wqe_seen() && !user.destroyed());
        assert!(user.mark_destroyed());
        assert!(!user.mark_destroyed(), "once");
        assert!(!user.mark_last_wqe(), "a late LAST_WQE changes nothing");
        assert!(user.last_wqe_seen() && user.destroyed() && !user.quiesced());
        user.mark_quiesced();
        assert!(user.quiesced() && !user.destroyed());
    }
}

/// Step 4 under loom: the send CQ's poller empties the QP's send account
/// and reaps; the receive CQ's poller quiesces its SRQ user, which reaps
/// the graveyard too. Whatever the interleaving, the QP is destroyed, once.
#[cfg(all(test, loom))]
mod loom_teardown {
    use super::*;
    use crate::sync::AtomicUsize;

    struct Z {
        sent: Arc<AtomicBool>,
        user: Arc<SrqUser>,
        destroyed: Arc<AtomicUsize>,
    }
    impl Zombie for Z {
        fn ready(&self) -> bool {
            self.sent.load(Ordering::Acquire) && self.user.quiesced()
        }
    }
    impl Drop for Z {
        fn drop(&mut self) {
            if self.ready() {
                self.destroyed.fetch_add(1, Ordering::AcqRel);
            }
        }
    }

    fn model(reap_before_quiesced: bool) {
        loom::model(move || {
            REAP_BEFORE_QUIESCED.with(|m| m.set(reap_before_quiesced));
            let grave = Graveyard::new();
            let user = Arc::new(SrqUser::new(9, 1));
            let sent = Arc::new(AtomicBool::new(false));
            let destroyed = Arc::new(AtomicUsize::new(0));
            user.waits_in(&grave);
            grave.bury(Box::new(Z {
                sent: Arc::clone(&sent),
                user: Arc::clone(&user),
                destroyed: Arc::clone(&destroyed),
            }));
            let (g2, s2) = (Arc::clone(&grave), Arc::clone(&sent));
            let send_poller = loom::thread::spawn(move || {
                s2.store(true, Ordering::Release);
                g2.reap();
            });
            let u2 = Arc::clone(&user);
            let recv_poller = loom::thread::spawn(move || {
                REAP_BEFORE_QUIESCED.with(|m| m.set(reap_before_quiesced));
                assert!(u2.mark_last_wqe());
                u2.mark_quiesced();
            });
            send_poller.join().unwrap();
            recv_poller.join().unwrap();
            assert_eq!(
                (destroyed.load(Ordering::Acquire), grave.len()),
                (1, 0),
                "the QP is destroyed once, by whichever poller came second"
            );
        });
    }

    #[test]
    fn loom_teardown_reaps_once() {
        model(false);
    }

    /// Step 2' then 4: the rest of a QP destroyed first is buried by the
    /// thread that destroyed it while the receive CQ's poller quiesces its
    /// user. Whatever the interleaving, it is dropped once, and only once
    /// the user is quiesced.
    #[test]
    fn loom_destroyed_first_rest_reaped_once() {
        struct Rest {
            user: Arc<SrqUser>,
            dropped: Arc<AtomicUsize>,
        }
        impl Zombie for Rest {
            fn ready(&self) -> bool {
                self.user.quiesced()
            }
        }
        impl Drop for Rest {
            fn drop(&mut self) {
                assert!(self.user.quiesced(), "dropped before its user is quiesced");
                self.dropped.fetch_add(1, Ordering::AcqRel);
            }
        }
        loom::model(|| {
            let grave = Graveyard::new();
            let user = Arc::new(SrqUser::new(9, 1));
            let dropped = Arc::new(AtomicUsize::new(0));
            assert!(user.mark_destroyed());
            let (g2, u2, d2) = (Arc::clone(&grave), Arc::clone(&user), Arc::clone(&dropped));
            let destroyer = loom::thread::spawn(move || {
                u2.waits_in(&g2);
                g2.bury(Box::new(Rest {
                    user: u2,
                    dropped: d2,
                }));
            });
            let u3 = Arc::clone(&user);
            let recv_poller = loom::thread::spawn(move || u3.mark_quiesced());
            destroyer.join().unwrap();
            recv_poller.join().unwrap();
            assert_eq!(
                (dropped.load(Ordering::Acquire), grave.len()),
                (1, 0),
                "the rest is dropped once, by whichever thread came second"
            );
        });
    }

    #[test]
    #[should_panic(expected = "destroyed once")]
    fn loom_teardown_mutation_reap_before_quiesced() {
        model(true);
    }
}
