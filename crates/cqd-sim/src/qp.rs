//! Queue pairs — reliable connected (RC) and unreliable datagram (UD,
//! [`crate::ah`]) — the state machine, posting, and connecting pairs.
//!
//! States: RESET → INIT → RTR → RTS (RC: INIT with the remote access, RTR
//! with the peer; UD: INIT with the Q_Key, RTR alone), and ERR from
//! anywhere (a transition back to RESET discards every queued request without a completion, as
//! hardware does). Sends are accepted in RTS, receives from INIT on. A QP in
//! ERR accepts posts and completes them at once with `WR_FLUSH_ERR`, as
//! hardware does, so a request posted during shutdown is never lost.
//!
//! Posting checks the whole list first — state, SGE counts, queue depth —
//! and queues nothing if any check fails. Applications post through
//! `cqd_core::Registration::post_send` / `post_recv` (the [`PostSend`] and
//! [`PostRecv`] implementations below), which keep every account and take
//! the CQ's credits; [`Qp::post_send_unaccounted`] and [`Qp::post_recv_unaccounted`] are the raw
//! posts under them.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cqd_core::ledger::{
    CloseSignal, CloseWait, DrainMarker, Queue, QueueAccount, SrqUser, WrLedger, Zombie,
};
use cqd_core::post::{
    check_atomic, check_datagram, Invalid, PostRecv, PostSend, SendRequest, WorkRequest,
};
use cqd_core::OpKind;

use crate::device::DeviceInner;
use crate::engine::{due, Engine};
use crate::error::{PostError, VerbsError};
use crate::fabric::Fabric;
use crate::mr::Access;
use crate::state::{PendingRecv, PendingSend};
use crate::wr::op_of;
pub use crate::wr::{RecvWr, SendWr, WrOp};

/// The state of a QP (`ibv_qp_state`; SQD and SQE are not modelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QpState {
    /// Just created, or reset: nothing accepted.
    Reset,
    /// Receives accepted; not connected.
    Init,
    /// Ready to receive: connected to its peer.
    Rtr,
    /// Ready to send.
    Rts,
    /// In error: everything queued was flushed; new posts are flushed.
    Err,
}

/// Queue depths and SGE limits (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send-side request.
    pub max_send_sge: u32,
    /// SGEs per receive.
    pub max_recv_sge: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 4,
            max_recv_sge: 4,
        }
    }
}

/// The transport of a QP (`ibv_qp_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QpType {
    /// Reliable connected: one peer, every operation, acknowledged.
    #[default]
    Rc,
    /// Unreliable datagram: SEND (with immediate) to any UD QP named per
    /// request, at most one MTU, no acknowledgement.
    Ud,
}

impl QpType {
    /// `RC` or `UD`.
    pub fn name(self) -> &'static str {
        match self {
            QpType::Rc => "RC",
            QpType::Ud => "UD",
        }
    }
}

/// A state transition and its attributes (`ibv_modify_qp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Modify {
    /// RESET → INIT (or INIT → INIT): the remote access the QP allows.
    Init {
        /// `qp_access_flags`: REMOTE_WRITE / REMOTE_READ / REMOTE_ATOMIC.
        access: Access,
    },
    /// RESET → INIT (or INIT → INIT) of a UD QP: its Q_Key.
    InitUd {
        /// The Q_Key datagrams must carry to be delivered.
        qkey: u32,
    },
    /// INIT → RTR of a UD QP: receives are delivered from here on.
    RtrUd,
    /// INIT → RTR: connect to a peer QP of the same fabric.
    Rtr {
        /// The peer's QP number.
        remote_qpn: u32,
    },
    /// RTR → RTS (or RTS → RTS).
    Rts {
        /// Receiver-not-ready retries, 0..=7; 7 means retry forever (the
        /// send waits until the peer posts a receive).
        rnr_retry: u8,
        /// Transport retries, 0..=7 (the sim has no lossy wire; kept for
        /// checks).
        retry_cnt: u8,
    },
    /// Any → ERR: flushes both queues.
    Err,
    /// Any → RESET: discards both queues without completions.
    Reset,
}

/// An RC queue pair. Dropping it destroys it: it goes to ERR (flushing what
/// is queued) and its CQ reservations are released once every completion
/// it produced has been polled.
#[derive(Debug)]
pub struct Qp {
    pub(crate) fabric: Fabric,
    pub(crate) qpn: u32,
    pub(crate) qp_type: QpType,
    /// The port's MTU (the largest datagram of a UD QP).
    pub(crate) mtu: u32,
    pub(crate) device: Arc<DeviceInner>,
    /// The send queue's account (on the send CQ's ledger).
    pub(crate) send_account: Arc<QueueAccount>,
    /// The receive queue's account (on the receive CQ's ledger), or the
    /// SRQ's.
    pub(crate) recv_account: Arc<QueueAccount>,
    /// Its use of an SRQ, as the receive CQ's ledger keeps it.
    pub(crate) srq_user: Option<Arc<SrqUser>>,
    /// The receive CQ's ledger.
    pub(crate) recv_ledger: WrLedger,
    /// Fired once the NIC has destroyed it ([`Qp::close`]).
    pub(crate) closed: Arc<CloseSignal>,
}

impl Qp {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    fn present(&self) -> Result<(), PostError> {
        if self.device.vanished.load(Ordering::Acquire) {
            return Err(PostError::DeviceGone { qpn: self.qpn });
        }
        Ok(())
    }

    /// The transport.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// Closes the QP, as dropping it does, and returns the wait for its
    /// end. It goes to the error state (its requests flush, a drain
    /// marker follows a silent tail of sends); once its CQs' pollers have
    /// accounted every completion of it, its SRQ use included
    /// (`cqd_core::ledger`, module `teardown`), the NIC destroys it and its
    /// admission comes back. Never blocks; the wait does, or is awaited.
    pub fn close(self) -> CloseWait {
        let wait = CloseWait::new(
            self.qpn,
            &self.closed,
            &self.send_account,
            &self.recv_account,
            self.srq_user.as_ref(),
        );
        drop(self);
        wait
    }

    /// The largest datagram a UD QP sends (the port's MTU).
    pub fn mtu(&self) -> u32 {
        self.mtu
    }

    /// RESET → INIT (Q_Key `qkey`) → RTR → RTS of a UD QP.
    ///
    /// # Errors
    /// As [`Qp::modify`].
    pub fn ready_ud(&self, qkey: u32) -> Result<(), VerbsError> {
        self.modify(Modify::InitUd { qkey })?;
        self.modify(Modify::RtrUd)?;
        self.modify(Modify::Rts {
            rnr_retry: 0,
            retry_cnt: 0,
        })
    }

    /// The current state.
    ///
    /// # Errors
    /// [`VerbsError::Destroyed`] (not possible while `self` lives).
    pub fn state(&self) -> Result<QpState, VerbsError> {
        let st = self.fabric.core.state.lock();
        st.qps
            .get(&self.qpn)
            .map(|q| q.state)
            .ok_or(VerbsError::Destroyed { what: "QP" })
    }

    /// Applies a state transition (see [`Modify`]).
    ///
    /// # Errors
    /// [`VerbsError::BadTransition`] for a transition RC does not have;
    /// [`VerbsError::BadAttr`] for an attribute out of range;
    /// [`VerbsError::NoSuchQp`] for an unknown peer. Nothing changes then.
    pub fn modify(&self, m: Modify) -> Result<(), VerbsError> {
        let mut st = self.fabric.core.state.lock();
        let qpn = self.qpn;
        if let Modify::Rtr { remote_qpn } = m {
            if st.qps.get(&remote_qpn).is_none_or(|p| p.destroyed) {
                return Err(VerbsError::NoSuchQp { qpn: remote_qpn });
            }
        }
        let q = st
            .qps
            .get_mut(&qpn)
            .ok_or(VerbsError::Destroyed { what: "QP" })?;
        let from = q.state;
        let bad = |to| VerbsError::BadTransition { qpn, from, to };
        let ud_only = matches!(m, Modify::InitUd { .. } | Modify::RtrUd);
        let rc_only = matches!(m, Modify::Init { .. } | Modify::Rtr { .. });
        if (ud_only && q.qp_type != QpType::Ud) || (rc_only && q.qp_type != QpType::Rc) {
            return Err(VerbsError::WrongQpType {
                qpn,
                qp_type: q.qp_type,
                what: if ud_only {
                    "a UD transition (Q_Key, no peer)"
                } else {
                    "an RC transition (access, peer)"
                },
            });
        }
        match m {
            Modify::InitUd { qkey } => {
                if !matches!(from, QpState::Reset | QpState::Init) {
                    return Err(bad(QpState::Init));
                }
                q.qkey = qkey;
                q.state = QpState::Init;
            }
            Modify::RtrUd => {
                if from != QpState::Init {
                    return Err(bad(QpState::Rtr));
                }
                q.state = QpState::Rtr;
            }
            Modify::Init { access } => {
                if !matches!(from, QpState::Reset | QpState::Init) {
                    return Err(bad(QpState::Init));
                }
                q.access = access;
                q.state = QpState::Init;
            }
            Modify::Rtr { remote_qpn } => {
                if from != QpState::Init {
                    return Err(bad(QpState::Rtr));
                }
                q.remote = Some(remote_qpn);
                q.state = QpState::Rtr;
            }
            Modify::Rts {
                rnr_retry,
                retry_cnt,
            } => {
                if !matches!(from, QpState::Rtr | QpState::Rts) {
                    return Err(bad(QpState::Rts));
                }
                for (what, v) in [("rnr_retry", rnr_retry), ("retry_cnt", retry_cnt)] {
                    if v > 7 {
                        return Err(VerbsError::BadAttr {
                            qpn,
                            what,
                            value: u64::from(v),
                            max: 7,
                        });
                    }
                }
                q.rnr_retry = rnr_retry;
                q.state = QpState::Rts;
            }
            Modify::Err => {
                st.enter_error(qpn);
                return Ok(());
            }
            Modify::Reset => {
                q.sq_pending.clear();
                q.rq.clear();
                q.sq_done.clear();
                q.rq_done.clear();
                q.remote = None;
                q.state = QpState::Reset;
            }
        }
        Ok(())
    }

    /// Forces the QP to the error state (as a fault would): flushes both
    /// queues. Same as `modify(Modify::Err)`.
    pub fn force_error(&self) {
        self.fabric.core.state.lock().enter_error(self.qpn);
    }

    /// Posts send-side requests, in order, unaccounted (the raw post; see
    /// the module documentation). With the inline engine they execute
    /// before this returns.
    ///
    /// # Errors
    /// [`PostError::WrongState`], [`PostError::TooManySge`],
    /// [`PostError::QueueFull`], [`PostError::Destroyed`],
    /// [`PostError::DeviceGone`]; nothing was posted then.
    pub fn post_send_unaccounted(&self, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        self.present()?;
        let core = &self.fabric.core;
        let mut st = core.state.lock();
        let qpn = self.qpn;
        let q = match st.qps.get_mut(&qpn) {
            Some(q) if !q.destroyed => q,
            _ => return Err(PostError::Destroyed { qpn }),
        };
        if !matches!(q.state, QpState::Rts | QpState::Err) {
            return Err(PostError::WrongState {
                qpn,
                queue: "send",
                state: q.state,
            });
        }
        let (qp_type, pd) = (q.qp_type, q.pd);
        if let Some((index, source)) = wrs
            .iter()
            .enumerate()
            .find_map(|(i, w)| transport_check(qp_type, w).err().map(|e| (i, e)))
        {
            return Err(PostError::Invalid { qpn, index, source });
        }
        if let Some(index) = wrs.iter().position(|w| w.ud.is_some_and(|d| d.ah.pd != pd)) {
            return Err(PostError::ForeignAh { qpn, index });
        }
        let used = q.sq_used(wrs.len());
        check_list(
            qpn,
            "send",
            wrs.iter().map(|w| w.sg_list.len()),
            q.cap.max_send_sge,
            used,
            q.cap.max_send_wr,
        )?;
        let in_error = q.state == QpState::Err;
        let now = st.now(matches!(core.engine, Engine::Timed(_)));
        for wr in wrs {
            let mut ready_at = match core.engine {
                Engine::Inline => now,
                Engine::Timed(model) => {
                    let bytes = wr.sg_list.iter().map(|s| u64::from(s.length)).sum();
                    due(&mut st, &model, bytes, now)
                }
            };
            let delay = st.faults.delay_rate;
            if st.chance(delay) {
                st.stats.delayed += 1;
                ready_at += st.faults.delay_by;
            }
            let pending = PendingSend {
                wr_id: wr.wr_id,
                op: op_of(wr),
                sges: crate::state::Sges::from_slice(wr.sg_list),
                signaled: wr.signaled,
                solicited: wr.solicited,
                ready_at,
                rnr_tries: 0,
            };
            if let Some(q) = st.qps.get_mut(&qpn) {
                q.sq_pending.push_back(pending);
            }
        }
        let forced = st.faults.qp_error_rate;
        if in_error {
            st.enter_error(qpn);
        } else if st.chance(forced) {
            st.stats.forced_qp_errors += 1;
            st.enter_error(qpn);
        } else {
            st.activate(qpn);
        }
        self.fabric.kick(&mut st, now);
        Ok(())
    }

    /// Posts receives, in order, unaccounted (the raw post).
    ///
    /// # Errors
    /// [`PostError::WrongState`] in RESET, [`PostError::HasSrq`],
    /// [`PostError::TooManySge`], [`PostError::QueueFull`],
    /// [`PostError::Destroyed`], [`PostError::DeviceGone`]; nothing was
    /// posted then.
    pub fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.present()?;
        let mut st = self.fabric.core.state.lock();
        let qpn = self.qpn;
        let q = match st.qps.get_mut(&qpn) {
            Some(q) if !q.destroyed => q,
            _ => return Err(PostError::Destroyed { qpn }),
        };
        if q.srq.is_some() {
            return Err(PostError::HasSrq { qpn });
        }
        if q.state == QpState::Reset {
            return Err(PostError::WrongState {
                qpn,
                queue: "recv",
                state: q.state,
            });
        }
        let used = q.rq_used(wrs.len());
        check_list(
            qpn,
            "recv",
            wrs.iter().map(|w| w.sg_list.len()),
            q.cap.max_recv_sge,
            used,
            q.cap.max_recv_wr,
        )?;
        q.rq.extend(wrs.iter().map(|w| PendingRecv {
            wr_id: w.wr_id,
            sges: crate::state::Sges::from_slice(w.sg_list),
        }));
        if q.state == QpState::Err {
            st.enter_error(qpn);
        }
        let now = st.now(matches!(self.fabric.core.engine, Engine::Timed(_)));
        self.fabric.kick(&mut st, now);
        Ok(())
    }
}

impl WorkRequest for SendWr<'_> {
    fn wr_id(&self) -> u64 {
        self.wr_id
    }

    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

impl SendRequest for SendWr<'_> {
    fn kind(&self) -> OpKind {
        match self.op {
            WrOp::Send | WrOp::SendWithImm(_) => OpKind::Send,
            WrOp::Write(_) | WrOp::WriteWithImm(..) => OpKind::Write,
            WrOp::Read(_) => OpKind::Read,
            WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => OpKind::Atomic,
        }
    }

    fn signaled(&self) -> bool {
        self.signaled
    }
}

impl WorkRequest for RecvWr<'_> {
    fn wr_id(&self) -> u64 {
        self.wr_id
    }

    fn set_wr_id(&mut self, wr_id: u64) {
        self.wr_id = wr_id;
    }
}

/// The simulated NIC posts a list all or nothing: a failure posted none.
impl PostSend for Qp {
    type Wr<'a> = SendWr<'a>;
    type Error = PostError;

    fn send_account(&self) -> &QueueAccount {
        &self.send_account
    }

    fn check_send(&self, wr: &SendWr<'_>) -> Result<(), Invalid> {
        transport_check(self.qp_type, wr)?;
        match (self.qp_type, wr.op) {
            (_, WrOp::CompareSwap { remote, .. } | WrOp::FetchAdd { remote, .. }) => {
                check_atomic(remote.addr, wr.len())
            }
            (QpType::Ud, _) => check_datagram(wr.len(), self.mtu),
            (QpType::Rc, _) => Ok(()),
        }
    }

    fn post_send_unaccounted(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, PostError)> {
        Qp::post_send_unaccounted(self, wrs).map_err(|e| (0, e))
    }
}

impl PostRecv for Qp {
    type Wr<'a> = RecvWr<'a>;
    type Error = PostError;

    fn recv_account(&self) -> &QueueAccount {
        &self.recv_account
    }

    fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, PostError)> {
        Qp::post_recv_unaccounted(self, wrs).map_err(|e| (0, e))
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // To ERR first: what is in flight is flushed, in order. Then, if
        // the send queue ends in unsignaled requests that ran silently, a
        // drain marker behind them (flushed at once), whose completion
        // retires them; a UD marker would need a destination, so UD QPs
        // have none (their silent tail stays outstanding).
        self.force_error();
        if self.qp_type == QpType::Rc {
            let marker = self.send_account.post_drain_marker(|wr_id| {
                Qp::post_send_unaccounted(self, &[SendWr::new(wr_id, WrOp::Send, &[])])
            });
            if let DrainMarker::NoCredit | DrainMarker::Failed(_) = marker {
                tracing::warn!(qpn = self.qpn, ?marker,
                    "no drain marker: the unsignaled requests at the end of the send queue stay outstanding");
            }
        }
        self.send_account.close();
        let own_recv = self.recv_account.queue() == Queue::Recv;
        if own_recv {
            self.recv_account.close();
        }
        // The NIC destroys the QP (and purges what is left of it in its
        // CQs) once every completion of it is accounted: until then it
        // waits in its send CQ's graveyard (`cqd_core::ledger::Graveyard`).
        let tomb = Tomb {
            fabric: self.fabric.clone(),
            qpn: self.qpn,
            send: Arc::clone(&self.send_account),
            recv: own_recv.then(|| Arc::clone(&self.recv_account)),
            srq: self.srq_user.as_ref().map(|u| {
                (
                    Arc::clone(u),
                    Arc::clone(&self.recv_account),
                    self.recv_ledger.clone(),
                )
            }),
            closed: Arc::clone(&self.closed),
        };
        let send_cq = {
            let mut st = self.fabric.core.state.lock();
            st.enter_error(self.qpn);
            st.qps.get(&self.qpn).map(|q| q.send_cq.clone())
        };
        match send_cq {
            Some(cq) if cq.producer().source_alive() && !tomb.ready() => {
                let grave = cq.producer().grave();
                if let Some(u) = &self.srq_user {
                    u.waits_in(grave);
                }
                grave.bury(Box::new(tomb));
            }
            _ => drop(tomb),
        }
    }
}

/// A dropped QP whose completions are not all accounted yet. Dropping it
/// destroys the QP in the NIC.
struct Tomb {
    fabric: Fabric,
    qpn: u32,
    send: Arc<QueueAccount>,
    recv: Option<Arc<QueueAccount>>,
    /// Its SRQ user, the SRQ's account and the receive CQ's ledger.
    srq: Option<(Arc<SrqUser>, Arc<QueueAccount>, WrLedger)>,
    closed: Arc<CloseSignal>,
}

impl Zombie for Tomb {
    /// Checked only once the QP is in the error state, where it takes no
    /// more receives from its SRQ: an SRQ account that holds nothing then
    /// means that no completion of the QP can retire anything of it.
    fn ready(&self) -> bool {
        self.send.outstanding() == 0
            && self.recv.as_ref().is_none_or(|r| r.outstanding() == 0)
            && self
                .srq
                .as_ref()
                .is_none_or(|(u, srq, _)| u.quiesced() || srq.outstanding() == 0)
    }
}

impl Drop for Tomb {
    fn drop(&mut self) {
        if let Some((u, _, ledger)) = &self.srq {
            ledger.release_srq_user(u);
        }
        let purged = self.fabric.core.state.lock().destroy_qp(self.qpn);
        if purged > 0 {
            tracing::warn!(
                qpn = self.qpn,
                purged,
                "QP destroyed with completions not polled: the NIC removed them"
            );
        }
        self.closed.fire();
    }
}

/// Connects two QPs of one fabric to each other: RESET → INIT (all remote
/// access) → RTR → RTS, with `rnr_retry` 7 (a send waits for its receive).
///
/// # Errors
/// As [`Qp::modify`].
pub fn connect(a: &Qp, b: &Qp) -> Result<(), VerbsError> {
    connect_with(a, b, 7)
}

/// As [`connect`], with the given `rnr_retry` (0..=7).
///
/// # Errors
/// As [`Qp::modify`].
pub fn connect_with(a: &Qp, b: &Qp, rnr_retry: u8) -> Result<(), VerbsError> {
    let access = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
    for (x, y) in [(a, b), (b, a)] {
        x.modify(Modify::Init { access })?;
        x.modify(Modify::Rtr { remote_qpn: y.qpn })?;
    }
    for x in [a, b] {
        x.modify(Modify::Rts {
            rnr_retry,
            retry_cnt: 7,
        })?;
    }
    Ok(())
}

/// The operation against the transport: UD sends SEND (with immediate) to
/// a destination, RC everything but datagrams.
fn transport_check(qp_type: QpType, wr: &SendWr<'_>) -> Result<(), Invalid> {
    let op = match wr.op {
        WrOp::Send | WrOp::SendWithImm(_) => "SEND",
        WrOp::Write(_) | WrOp::WriteWithImm(..) => "RDMA WRITE",
        WrOp::Read(_) => "RDMA READ",
        WrOp::CompareSwap { .. } | WrOp::FetchAdd { .. } => "an atomic",
    };
    let wrong = |op| {
        Err(Invalid::Transport {
            op,
            transport: qp_type.name(),
        })
    };
    match (qp_type, wr.ud.is_some(), op) {
        (QpType::Ud, true, "SEND") | (QpType::Rc, false, _) => Ok(()),
        (QpType::Ud, false, "SEND") => wrong("a SEND without destination (address handle)"),
        (QpType::Ud, _, op) => wrong(op),
        (QpType::Rc, true, _) => wrong("a datagram (address handle)"),
    }
}

/// Checks a work-request list against a queue's SGE limit and depth before
/// anything is posted (a refused list changes nothing). `sges` gives each
/// request's SGE count; `used` is the queue's occupied slots.
fn check_list(
    qpn: u32,
    queue: &'static str,
    sges: impl ExactSizeIterator<Item = usize>,
    max_sge: u32,
    used: usize,
    depth: u32,
) -> Result<(), PostError> {
    let posting = sges.len();
    for (index, n) in sges.enumerate() {
        if n > max_sge as usize {
            return Err(PostError::TooManySge {
                qpn,
                index,
                sges: n,
                max: max_sge,
            });
        }
    }
    if used + posting > depth as usize {
        return Err(PostError::QueueFull {
            qpn,
            queue,
            depth,
            outstanding: used as u32,
            posting: posting as u32,
        });
    }
    Ok(())
}
