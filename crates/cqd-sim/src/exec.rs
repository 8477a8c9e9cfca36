//! Execution of one send-side request against the fabric's state: the
//! checks in the order hardware makes them (see [`crate::engine`], steps
//! 1–5), the data movement, and the responder's side effects (its receive
//! consumed, its completion, its QP to error).

use cqd_core::completion::{Completion, Opcode, Status, WcFlags};

use crate::mr::Access;
use crate::qp::{QpState, QpType};
use crate::state::{FabricState, Op, PendingSend};

/// What became of a request.
pub(crate) enum Outcome {
    Ok {
        opcode: Opcode,
        byte_len: u32,
    },
    Fail(Status),
    RnrWait,
    /// No receive; retry after the RNR timer (timed engine).
    RnrRetry,
}

impl FabricState {
    pub(crate) fn execute(&mut self, qpn: u32, wr: &PendingSend) -> Outcome {
        let Some(q) = self.qps.get(&qpn) else {
            return Outcome::Fail(Status::Fatal);
        };
        if let Op::Datagram(d) = wr.op {
            return self.execute_ud(qpn, wr, &d);
        }
        if q.qp_type == QpType::Ud {
            // Refused at post; a request of another kind never reaches here.
            return Outcome::Fail(Status::LocalQpOperation);
        }
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
                    return self.rnr(rnr_retry, wr);
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
                self.recycle(data);
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
                let need = Access::REMOTE_WRITE;
                let Some((buf, off)) = self.check_remote(peer_pd, peer_access, remote, len, need)
                else {
                    return self.remote_access(peer, peer_access, need);
                };
                let recv = match imm {
                    Some(_) => match self.take_recv(peer) {
                        Some(r) => Some(r),
                        None => return self.rnr(rnr_retry, wr),
                    },
                    None => None,
                };
                if !self.gather_into(&wr.sges, &buf, off, len as usize) {
                    return Outcome::Fail(Status::LocalProtection);
                }
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
                let need = Access::REMOTE_READ;
                let Some((buf, off)) = self.check_remote(peer_pd, peer_access, remote, len, need)
                else {
                    return self.remote_access(peer, peer_access, need);
                };
                self.scatter_from(&buf, off, len as usize, &wr.sges);
                Outcome::Ok {
                    opcode: Opcode::RdmaRead,
                    byte_len: len32,
                }
            }
            Op::Datagram(_) => Outcome::Fail(Status::LocalQpOperation),
            Op::CompareSwap { remote, .. } | Op::FetchAdd { remote, .. } => {
                if remote.addr % 8 != 0 {
                    self.enter_error(peer);
                    return Outcome::Fail(Status::RemoteInvalidRequest);
                }
                let need = Access::REMOTE_ATOMIC;
                let Some((buf, off)) = self.check_remote(peer_pd, peer_access, remote, 8, need)
                else {
                    return self.remote_access(peer, peer_access, need);
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

    /// No receive on the peer: 7 retries forever (wait for the receive);
    /// the timed engine retries `rnr_retry` times, an RNR timer apart; the
    /// inline engine fails at once.
    fn rnr(&self, rnr_retry: u8, wr: &PendingSend) -> Outcome {
        if rnr_retry >= 7 {
            Outcome::RnrWait
        } else if self.rnr_timer.is_some() && wr.rnr_tries < rnr_retry {
            Outcome::RnrRetry
        } else {
            Outcome::Fail(Status::RnrRetryExceeded)
        }
    }

    /// The responder refused a one-sided request: a QP not enabled for the
    /// operation (its access flags lack `need`) does not support it, an
    /// invalid request (as the kernel's rxe answers); otherwise the key,
    /// range or region's access failed, a remote access error. Either way
    /// the responder goes to error.
    fn remote_access(&mut self, peer: u32, qp_access: Access, need: Access) -> Outcome {
        self.enter_error(peer);
        if qp_access.contains(need) {
            Outcome::Fail(Status::RemoteAccess)
        } else {
            Outcome::Fail(Status::RemoteInvalidRequest)
        }
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
        wc.opcode = Opcode::from_raw(u32::MAX);
        self.complete_recv(peer, wc, false);
        self.enter_error(peer);
        Outcome::Fail(ours)
    }
}
