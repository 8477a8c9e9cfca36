//! The NIC engine: executes send-side requests in order per send queue,
//! produces completions, and flushes QPs that go to the error state.
//!
//! Two engines ([`Engine`]):
//! - **Inline**: requests execute inside the post call (and on
//!   [`Fabric::progress`](crate::Fabric::progress) for those delayed by fault
//!   injection or waiting for a receive). Deterministic, for tests.
//! - **Timed**: a NIC thread executes each request when the latency and
//!   bandwidth model ([`TimedModel`]) says it has crossed the wire.
//!
//! Execution of one request, in order:
//! 1. Local SGEs checked (key, protection domain, bounds, local write for
//!    READ and atomic results): else `LocalProtection`.
//! 2. The peer must be connected and accepting (RTR or RTS): else
//!    `RetryExceeded`.
//! 3. Remote checks (rkey, domain, bounds, region and QP permissions):
//!    else `RemoteAccess` and the peer goes to error; misaligned atomics:
//!    `RemoteInvalidRequest`.
//! 4. A receive is taken for SEND and WRITE with immediate. None posted:
//!    with `rnr_retry` 7 the request waits (and its queue behind it) until
//!    one is; otherwise the timed engine retries `rnr_retry` times an RNR
//!    timer apart and the inline engine does not retry, then it fails with
//!    `RnrRetryExceeded`. One too small
//!    fails it with `LocalLength` on the peer and `RemoteInvalidRequest`
//!    here; one with a bad SGE, `LocalProtection` there and
//!    `RemoteOperation` here. Both QPs go to error.
//! 5. Data moves; completions are pushed (the send side only if signaled).
//!
//! An error completion is always produced, signaled or not, and its QP goes
//! to error: every request still queued on both its queues is flushed with
//! `WR_FLUSH_ERR` (receives of an SRQ stay in the SRQ).

use std::time::{Duration, Instant};

use cqd_core::completion::{Completion, Status};
use cqd_core::source::{AsyncEvent, QpEvent};

use crate::cq::PushError;
use crate::device::Cq;
use crate::fabric::Core;
use crate::qp::QpState;
use crate::state::{Done, FabricState, PendingRecv, PendingSend};

/// Which engine runs a fabric's NIC.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Engine {
    /// Completions are produced at post time. Deterministic.
    Inline,
    /// A NIC thread applies a latency and bandwidth model.
    Timed(TimedModel),
}

/// The timed engine's model: a request completes when the link has carried
/// it (requests share one link per fabric, in post order) plus the latency.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimedModel {
    /// One-way latency added to every request.
    pub latency: Duration,
    /// Link bandwidth in bytes per second (0: unlimited).
    pub bandwidth: u64,
    /// Per-request processing time on the link.
    pub per_wr: Duration,
    /// The RNR timer: a send finding no receive is retried this much later,
    /// up to `rnr_retry` times (7: until a receive is posted).
    pub rnr_timer: Duration,
}

impl Default for TimedModel {
    fn default() -> Self {
        TimedModel {
            latency: Duration::from_micros(2),
            bandwidth: 12_500_000_000,
            per_wr: Duration::from_nanos(10),
            rnr_timer: Duration::from_micros(10),
        }
    }
}

/// NIC fault injection; probabilities in `0.0..=1.0`, drawn from a seeded
/// generator so a run is reproducible.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NicFaults {
    /// Per executed request: the chance it fails with `RetryExceeded` (a
    /// transport error, as a flapping link gives), sending its QP to error.
    pub error_rate: f64,
    /// Per post: the chance the QP is forced to the error state.
    pub qp_error_rate: f64,
    /// Per posted send-side request: the chance it is delayed by `delay_by`
    /// (later requests of its queue wait behind it: order holds).
    pub delay_rate: f64,
    /// How late a delayed request is.
    pub delay_by: Duration,
    /// Seed of the generator.
    pub seed: u64,
}

/// What a fabric's NIC did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NicStats {
    /// Send-side requests executed successfully.
    pub executed: u64,
    /// Error completions (flushes excluded).
    pub errors: u64,
    /// Flush completions.
    pub flushed: u64,
    /// Completions removed from their CQ when their QP was destroyed before
    /// they were polled.
    pub purged: u64,
    /// Completions lost to CQ overflow.
    pub lost: u64,
    /// Errors injected (`error_rate`).
    pub injected_errors: u64,
    /// QPs forced to error (`qp_error_rate`).
    pub forced_qp_errors: u64,
    /// Requests delayed (`delay_rate`).
    pub delayed: u64,
    /// RNR retries (timed engine).
    pub rnr_retries: u64,
    /// Datagrams dropped (UD: unreachable or wrong destination, wrong
    /// Q_Key, no receive posted); their sends succeeded.
    pub dropped: u64,
}

pub(crate) use crate::exec::Outcome;

enum Step {
    Idle,
    Blocked,
    Due(Instant),
}

impl FabricState {
    /// Executes every due request of every active QP; returns when the next
    /// not-blocked request is due, if any.
    pub(crate) fn run(&mut self, now: Instant) -> Option<Instant> {
        // The list being run and the list being refilled swap buffers, so
        // that a run allocates nothing in steady state.
        let spare = std::mem::take(&mut self.active_spare);
        let mut active = std::mem::replace(&mut self.active, spare);
        let mut next: Option<Instant> = None;
        for qpn in active.drain(..) {
            match self.step(qpn, now) {
                Step::Idle => {}
                Step::Blocked => self.activate(qpn),
                Step::Due(t) => {
                    self.activate(qpn);
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
        }
        self.active_spare = active;
        next
    }

    pub(crate) fn activate(&mut self, qpn: u32) {
        if !self.active.contains(&qpn) {
            self.active.push(qpn);
        }
    }

    fn step(&mut self, qpn: u32, now: Instant) -> Step {
        loop {
            let Some(q) = self.qps.get_mut(&qpn) else {
                return Step::Idle;
            };
            let Some(front) = q.sq_pending.front() else {
                return Step::Idle;
            };
            if front.ready_at > now {
                return Step::Due(front.ready_at);
            }
            let Some(wr) = q.sq_pending.pop_front() else {
                return Step::Idle;
            };
            let outcome = if self.chance(self.faults.error_rate) {
                self.stats.injected_errors += 1;
                Outcome::Fail(Status::RetryExceeded)
            } else {
                self.execute(qpn, &wr)
            };
            match outcome {
                Outcome::RnrRetry => {
                    let mut wr = wr;
                    wr.rnr_tries += 1;
                    wr.ready_at = now + self.rnr_timer.unwrap_or_default();
                    self.stats.rnr_retries += 1;
                    let at = wr.ready_at;
                    if let Some(q) = self.qps.get_mut(&qpn) {
                        q.sq_pending.push_front(wr);
                    }
                    return Step::Due(at);
                }
                Outcome::RnrWait => {
                    if let Some(q) = self.qps.get_mut(&qpn) {
                        q.sq_pending.push_front(wr);
                    }
                    return Step::Blocked;
                }
                Outcome::Ok { opcode, byte_len } => {
                    self.stats.executed += 1;
                    let Some(q) = self.qps.get_mut(&qpn) else {
                        return Step::Idle;
                    };
                    if wr.signaled || q.sq_sig_all {
                        let mut wc = Completion::success(wr.wr_id, opcode, qpn);
                        wc.byte_len = byte_len;
                        let cq = q.send_cq.clone();
                        let done = self.push_cqe(&cq, wc, false);
                        if let Some(q) = self.qps.get_mut(&qpn) {
                            q.sq_done.push_back(done);
                        }
                    } else {
                        q.sq_done.push_back(Done::Silent);
                    }
                }
                Outcome::Fail(status) => {
                    self.stats.errors += 1;
                    self.fail_send(qpn, wr.wr_id, status);
                    self.enter_error(qpn);
                }
            }
        }
    }

    fn push_cqe(&mut self, cq: &Cq, wc: Completion, solicited: bool) -> Done {
        match cq.producer().push_seq(wc, solicited) {
            Ok(seq) => Done::Cqe(seq),
            Err(PushError::Overflow { .. }) => {
                cq.budget().record_lost(1);
                self.stats.lost += 1;
                Done::Lost
            }
            Err(_) => Done::Lost,
        }
    }

    fn fail_send(&mut self, qpn: u32, wr_id: u64, status: Status) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let cq = q.send_cq.clone();
        let done = self.push_cqe(&cq, Completion::error(wr_id, status, qpn), false);
        if let Some(q) = self.qps.get_mut(&qpn) {
            q.sq_done.push_back(done);
        }
    }

    /// Completes a receive taken from `qpn`'s receive queue or SRQ.
    pub(crate) fn complete_recv(&mut self, qpn: u32, wc: Completion, solicited: bool) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let (cq, srq) = (q.recv_cq.clone(), q.srq);
        if !wc.status.is_success() {
            self.stats.errors += 1;
        }
        let done = self.push_cqe(&cq, wc, solicited || !wc.status.is_success());
        match srq {
            Some(s) => {
                if let Some(s) = self.srqs.get_mut(&s) {
                    s.record(&cq, done);
                }
            }
            None => {
                if let Some(q) = self.qps.get_mut(&qpn) {
                    q.rq_done.push_back(done);
                }
            }
        }
    }

    /// Moves a QP to the error state and flushes both its queues.
    pub(crate) fn enter_error(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.state = QpState::Err;
        let sends: Vec<PendingSend> = q.sq_pending.drain(..).collect();
        let recvs: Vec<PendingRecv> = q.rq.drain(..).collect();
        let (scq, rcq) = (q.send_cq.clone(), q.recv_cq.clone());
        for wr in sends {
            let done = self.push_cqe(
                &scq,
                Completion::error(wr.wr_id, Status::WrFlush, qpn),
                false,
            );
            self.stats.flushed += 1;
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.sq_done.push_back(done);
            }
        }
        for r in recvs {
            let done = self.push_cqe(&rcq, Completion::error(r.wr_id, Status::WrFlush, qpn), true);
            self.stats.flushed += 1;
            if let Some(q) = self.qps.get_mut(&qpn) {
                q.rq_done.push_back(done);
            }
        }
        // A QP on an SRQ takes no more of its receives from here on (the
        // simulated NIC completes a receive whole, so none is half taken,
        // and the completions of those it took are in the CQ already):
        // IBV_EVENT_QP_LAST_WQE_REACHED, once, on its receive CQ.
        if let Some(q) = self.qps.get_mut(&qpn) {
            if q.srq.is_some() && !std::mem::replace(&mut q.last_wqe, true) {
                rcq.producer().raise_async(AsyncEvent::Qp {
                    qp_num: qpn,
                    kind: QpEvent::LastWqeReached,
                    owner: None,
                });
            }
        }
    }

    /// What the NIC does when it destroys QP `qpn`: the QP goes to error,
    /// its completions still queued in its CQs are removed (mlx5's
    /// `ibv_destroy_qp` cleans them), the queue slots they held are freed
    /// (an SRQ's too: those receives are gone, and no completion will name
    /// them), and the context goes once nothing holds a slot. Returns the
    /// completions removed.
    pub(crate) fn destroy_qp(&mut self, qpn: u32) -> usize {
        self.enter_error(qpn);
        let Some(q) = self.qps.get_mut(&qpn) else {
            return 0;
        };
        let (scq, rcq, srq) = (q.send_cq.clone(), q.recv_cq.clone(), q.srq);
        let sgone = scq.producer().purge_qp(qpn);
        let rgone = if rcq.same(&scq) {
            Vec::new()
        } else {
            rcq.producer().purge_qp(qpn)
        };
        let purged = sgone.len() + rgone.len();
        let unlist = |d: &mut std::collections::VecDeque<Done>, gone: &[u64]| {
            d.retain(|x| !matches!(x, Done::Cqe(seq) if gone.contains(seq)));
        };
        q.destroyed = true;
        if purged > 0 {
            unlist(&mut q.sq_done, &sgone);
            let own = if rcq.same(&scq) { &sgone } else { &rgone };
            unlist(&mut q.rq_done, own);
            if let Some(s) = srq.and_then(|s| self.srqs.get_mut(&s)) {
                for (cq, d) in &mut s.done {
                    if cq.same(&rcq) {
                        unlist(d, if rcq.same(&scq) { &sgone } else { &rgone });
                    }
                }
            }
            self.stats.purged += purged as u64;
        }
        self.sweep_destroyed();
        purged
    }

    /// Takes the next receive of `qpn` (its queue or its SRQ).
    pub(crate) fn take_recv(&mut self, qpn: u32) -> Option<PendingRecv> {
        let q = self.qps.get_mut(&qpn)?;
        match q.srq {
            Some(s) => self.srqs.get_mut(&s)?.rq.pop_front(),
            None => q.rq.pop_front(),
        }
    }
}

/// The timed engine's thread: runs due requests, sleeps until the next one
/// is due or a post wakes it, exits when the fabric is dropped.
pub(crate) fn timed_loop(core: &Core) {
    let mut st = core.state.lock();
    loop {
        if core.stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let now = Instant::now();
        match st.run(now) {
            Some(t) if t > now => {
                let _ = core.wake.wait_until(&mut st, t);
            }
            Some(_) => {}
            None => core.wake.wait(&mut st),
        }
    }
}

/// When a request posted now is due under `model` (advancing the link).
pub(crate) fn due(st: &mut FabricState, model: &TimedModel, bytes: u64, now: Instant) -> Instant {
    let start = st.link_free_at.max(now);
    let wire = bytes
        .saturating_mul(1_000_000_000)
        .checked_div(model.bandwidth)
        .map_or(Duration::ZERO, |ns| {
            Duration::from_nanos(ns.min(u64::from(u32::MAX)))
        });
    st.link_free_at = start + model.per_wr + wire;
    st.link_free_at + model.latency
}
