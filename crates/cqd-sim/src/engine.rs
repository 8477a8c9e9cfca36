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
//! 4. A receive is taken for SEND and WRITE with immediate: none posted
//!    waits (`rnr_retry` 7) or fails with `RnrRetryExceeded`; one too small
//!    fails it with `LocalLength` on the peer and `RemoteInvalidRequest`
//!    here; one with a bad SGE, `LocalProtection` there and
//!    `RemoteOperation` here. Both QPs go to error.
//! 5. Data moves; completions are pushed (the send side only if signaled).
//!
//! An error completion is always produced, signaled or not, and its QP goes
//! to error: every request still queued on both its queues is flushed with
//! `WR_FLUSH_ERR` (receives of an SRQ stay in the SRQ).

use std::time::{Duration, Instant};

use cqd_core::completion::{Completion, Opcode, Status, WcFlags};

use crate::cq::PushError;
use crate::device::{Core, Cq};
use crate::qp::QpState;
use crate::state::{Done, FabricState, Op, PendingRecv, PendingSend};

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
}

impl Default for TimedModel {
    fn default() -> Self {
        TimedModel {
            latency: Duration::from_micros(2),
            bandwidth: 12_500_000_000,
            per_wr: Duration::from_nanos(10),
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
    /// Completions lost to CQ overflow.
    pub lost: u64,
    /// Errors injected (`error_rate`).
    pub injected_errors: u64,
    /// QPs forced to error (`qp_error_rate`).
    pub forced_qp_errors: u64,
    /// Requests delayed (`delay_rate`).
    pub delayed: u64,
}

enum Outcome {
    Ok { opcode: Opcode, byte_len: u32 },
    Fail(Status),
    RnrWait,
}

enum Step {
    Idle,
    Blocked,
    Due(Instant),
}

impl FabricState {
    /// Executes every due request of every active QP; returns when the next
    /// not-blocked request is due, if any.
    pub(crate) fn run(&mut self, now: Instant) -> Option<Instant> {
        let active = std::mem::take(&mut self.active);
        let mut next: Option<Instant> = None;
        for qpn in active {
            match self.step(qpn, now) {
                Step::Idle => {}
                Step::Blocked => self.activate(qpn),
                Step::Due(t) => {
                    self.activate(qpn);
                    next = Some(next.map_or(t, |n| n.min(t)));
                }
            }
        }
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
                cq.budget().record_overflow();
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
    fn complete_recv(&mut self, qpn: u32, wc: Completion, solicited: bool) {
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
    }

    /// Takes the next receive of `qpn` (its queue or its SRQ).
    fn take_recv(&mut self, qpn: u32) -> Option<PendingRecv> {
        let q = self.qps.get_mut(&qpn)?;
        match q.srq {
            Some(s) => self.srqs.get_mut(&s)?.rq.pop_front(),
            None => q.rq.pop_front(),
        }
    }

    fn execute(&mut self, qpn: u32, wr: &PendingSend) -> Outcome {
        let Some(q) = self.qps.get(&qpn) else {
            return Outcome::Fail(Status::Fatal);
        };
        let (pd, remote, rnr_retry, max_msg) = (q.pd, q.remote, q.rnr_retry, q.max_msg);
        // 1. Local SGEs.
        let local_write = matches!(
            wr.op,
            Op::Read { .. } | Op::CompareSwap { .. } | Op::FetchAdd { .. }
        );
        let Some(len) = self.check_sges(pd, &wr.sges, local_write) else {
            return Outcome::Fail(Status::LocalProtection);
        };
        if len > u64::from(max_msg) {
            return Outcome::Fail(Status::LocalLength);
        }
        let atomic = matches!(wr.op, Op::CompareSwap { .. } | Op::FetchAdd { .. });
        if atomic && len != 8 {
            return Outcome::Fail(Status::LocalLength);
        }
        // 2. The peer.
        let peer = match remote.and_then(|r| self.qps.get(&r).map(|p| (r, p))) {
            Some((r, p)) if matches!(p.state, QpState::Rtr | QpState::Rts) && !p.destroyed => {
                (r, p.pd, p.access)
            }
            _ => return Outcome::Fail(Status::RetryExceeded),
        };
        let (peer, peer_pd, peer_access) = peer;
        let len32 = len as u32;
        match wr.op {
            Op::Send { imm } => {
                let Some(data) = self.gather(&wr.sges) else {
                    return Outcome::Fail(Status::LocalProtection);
                };
                let Some(recv) = self.take_recv(peer) else {
                    return self.rnr(rnr_retry);
                };
                let mut wc = Completion::success(recv.wr_id, Opcode::Recv, peer);
                wc.src_qp = qpn;
                match self.check_sges(peer_pd, &recv.sges, true) {
                    None => {
                        return self.responder_fail(
                            peer,
                            wc,
                            Status::LocalProtection,
                            Status::RemoteOperation,
                        )
                    }
                    Some(room) if room < len => {
                        return self.responder_fail(
                            peer,
                            wc,
                            Status::LocalLength,
                            Status::RemoteInvalidRequest,
                        )
                    }
                    Some(_) => {}
                }
                self.scatter(&recv.sges, &data);
                wc.byte_len = len32;
                if let Some(imm) = imm {
                    wc.imm_data = imm;
                    wc.wc_flags = WcFlags(WcFlags::WITH_IMM);
                }
                self.complete_recv(peer, wc, wr.solicited);
                Outcome::Ok {
                    opcode: Opcode::Send,
                    byte_len: 0,
                }
            }
            Op::Write { remote, imm } => {
                let need = crate::mr::Access::REMOTE_WRITE;
                let Some((buf, off)) = self.check_remote(peer_pd, peer_access, remote, len, need)
                else {
                    return self.remote_access(peer);
                };
                let recv = match imm {
                    Some(_) => match self.take_recv(peer) {
                        Some(r) => Some(r),
                        None => return self.rnr(rnr_retry),
                    },
                    None => None,
                };
                let Some(data) = self.gather(&wr.sges) else {
                    return Outcome::Fail(Status::LocalProtection);
                };
                buf.lock()[off..off + data.len()].copy_from_slice(&data);
                if let (Some(recv), Some(imm)) = (recv, imm) {
                    let mut wc = Completion::success(recv.wr_id, Opcode::RecvRdmaWithImm, peer);
                    wc.src_qp = qpn;
                    wc.byte_len = len32;
                    wc.imm_data = imm;
                    wc.wc_flags = WcFlags(WcFlags::WITH_IMM);
                    self.complete_recv(peer, wc, wr.solicited);
                }
                Outcome::Ok {
                    opcode: Opcode::RdmaWrite,
                    byte_len: 0,
                }
            }
            Op::Read { remote } => {
                let need = crate::mr::Access::REMOTE_READ;
                let Some((buf, off)) = self.check_remote(peer_pd, peer_access, remote, len, need)
                else {
                    return self.remote_access(peer);
                };
                let data = buf.lock()[off..off + len as usize].to_vec();
                self.scatter(&wr.sges, &data);
                Outcome::Ok {
                    opcode: Opcode::RdmaRead,
                    byte_len: len32,
                }
            }
            Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => {
                if remote.addr % 8 != 0 {
                    self.enter_error(peer);
                    return Outcome::Fail(Status::RemoteInvalidRequest);
                }
                let need = crate::mr::Access::REMOTE_ATOMIC;
                let Some((buf, off)) = self.check_remote(peer_pd, peer_access, remote, 8, need)
                else {
                    return self.remote_access(peer);
                };
                let (old, opcode) = {
                    let mut b = buf.lock();
                    let mut cur = [0u8; 8];
                    cur.copy_from_slice(&b[off..off + 8]);
                    let old = u64::from_ne_bytes(cur);
                    let (new, opcode) = match wr.op {
                        Op::CompareSwap { compare, swap, .. } => {
                            (if old == compare { swap } else { old }, Opcode::CompareSwap)
                        }
                        Op::FetchAdd { add, .. } => (old.wrapping_add(add), Opcode::FetchAdd),
                        _ => (old, Opcode::FetchAdd),
                    };
                    b[off..off + 8].copy_from_slice(&new.to_ne_bytes());
                    (old, opcode)
                };
                self.scatter(&wr.sges, &old.to_ne_bytes());
                Outcome::Ok {
                    opcode,
                    byte_len: 8,
                }
            }
        }
    }

    fn rnr(&self, rnr_retry: u8) -> Outcome {
        if rnr_retry >= 7 {
            Outcome::RnrWait
        } else {
            Outcome::Fail(Status::RnrRetryExceeded)
        }
    }

    fn remote_access(&mut self, peer: u32) -> Outcome {
        self.enter_error(peer);
        Outcome::Fail(Status::RemoteAccess)
    }

    /// The receive consumed on `peer` fails with `theirs`; the requester's
    /// request fails with `ours`; both QPs go to error (the caller's QP when
    /// its failure is handled).
    fn responder_fail(
        &mut self,
        peer: u32,
        mut wc: Completion,
        theirs: Status,
        ours: Status,
    ) -> Outcome {
        wc.status = theirs;
        wc.opcode = Opcode::Unknown(u32::MAX);
        self.complete_recv(peer, wc, false);
        self.enter_error(peer);
        Outcome::Fail(ours)
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
        .map_or(Duration::ZERO, |ns| Duration::from_nanos(ns.min(u64::from(u32::MAX))));
    st.link_free_at = start + model.per_wr + wire;
    st.link_free_at + model.latency
}
