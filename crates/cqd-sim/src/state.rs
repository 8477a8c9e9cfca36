//! The NIC's state of one fabric: QP, SRQ and memory-region contexts, and
//! the queue-slot accounting that makes the CQ budget hold.
//!
//! A queue slot is taken at post and freed only when the completion that
//! covers it has been *polled* from its CQ — as hardware frees a send queue
//! slot when the driver polls the CQE. A successful unsignaled send has no
//! completion; its slot is freed with the next polled completion of the same
//! send queue. So a queue never has more than its depth of entries in
//! flight or sitting in its CQ, and admission (depth reserved per queue)
//! bounds the CQ's occupancy.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use cqd_core::budget::Admission;

use crate::device::Cq;
use crate::engine::{NicFaults, NicStats};
use crate::mr::{Access, MrCtx, RemoteAddr, Sge};
use crate::qp::{QpCap, QpState, QpType};

/// What a send-side request is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Send {
        imm: Option<u32>,
    },
    Write {
        remote: RemoteAddr,
        imm: Option<u32>,
    },
    Read {
        remote: RemoteAddr,
    },
    CompareSwap {
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    },
    FetchAdd {
        remote: RemoteAddr,
        add: u64,
    },
    /// A UD send.
    Datagram(crate::ah::Datagram),
}

/// A send-side request waiting to execute.
#[derive(Debug, Clone)]
pub(crate) struct PendingSend {
    pub(crate) wr_id: u64,
    pub(crate) op: Op,
    pub(crate) sges: Sges,
    pub(crate) signaled: bool,
    pub(crate) solicited: bool,
    pub(crate) ready_at: Instant,
    /// RNR retries made so far.
    pub(crate) rnr_tries: u8,
}

/// A posted receive.
#[derive(Debug, Clone)]
pub(crate) struct PendingRecv {
    pub(crate) wr_id: u64,
    pub(crate) sges: Sges,
}

/// A request's scatter/gather list, held with the request: inline up to
/// four entries (the common case), so that posting allocates nothing.
pub(crate) type Sges = smallvec::SmallVec<[Sge; 4]>;

/// An executed request still holding its queue slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Done {
    /// Succeeded without a completion; freed with the next polled one.
    Silent,
    /// Its completion has this sequence number in the queue's CQ.
    Cqe(u64),
    /// Its completion was lost to an overflow: nothing will poll it.
    Lost,
}

/// Frees the slots of `done` whose completions (or a later one) were
/// polled. `consumed` is the CQ's count of entries polled.
pub(crate) fn reclaim(done: &mut VecDeque<Done>, consumed: u64) {
    let mut upto = None;
    for (i, d) in done.iter().enumerate() {
        match d {
            Done::Silent => {}
            Done::Cqe(seq) if *seq < consumed => upto = Some(i),
            Done::Lost => upto = Some(i),
            Done::Cqe(_) => break,
        }
    }
    if let Some(i) = upto {
        done.drain(..=i);
    }
}

pub(crate) struct QpCtx {
    pub(crate) qpn: u32,
    pub(crate) device: u32,
    pub(crate) pd: u32,
    pub(crate) state: QpState,
    pub(crate) qp_type: QpType,
    /// The Q_Key (UD; set on INIT).
    pub(crate) qkey: u32,
    /// The port's MTU: the largest datagram (UD).
    pub(crate) mtu: u32,
    pub(crate) cap: QpCap,
    pub(crate) send_cq: Cq,
    pub(crate) recv_cq: Cq,
    pub(crate) srq: Option<u32>,
    pub(crate) sq_sig_all: bool,
    /// Remote access the QP allows (set on INIT).
    pub(crate) access: Access,
    pub(crate) remote: Option<u32>,
    pub(crate) rnr_retry: u8,
    /// The device's largest message.
    pub(crate) max_msg: u32,
    /// Executed send requests holding slots, in order.
    pub(crate) sq_done: VecDeque<Done>,
    /// Send requests not executed yet, in order.
    pub(crate) sq_pending: VecDeque<PendingSend>,
    /// Receives waiting for a message.
    pub(crate) rq: VecDeque<PendingRecv>,
    /// Consumed receives whose completion is not polled yet.
    pub(crate) rq_done: VecDeque<Done>,
    /// CQ reservations, released when the context goes.
    pub(crate) _admissions: Vec<Admission>,
    /// Destroyed by the user; kept until its slots are reclaimed.
    pub(crate) destroyed: bool,
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` was raised (a QP on an SRQ, once).
    pub(crate) last_wqe: bool,
}

impl std::fmt::Debug for QpCtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QpCtx")
            .field("qpn", &self.qpn)
            .field("state", &self.state)
            .field("sq", &(self.sq_done.len(), self.sq_pending.len()))
            .field("rq", &(self.rq.len(), self.rq_done.len()))
            .finish()
    }
}

impl QpCtx {
    /// Send slots in use, after freeing what was polled if `posting` more
    /// would not fit otherwise.
    pub(crate) fn sq_used(&mut self, posting: usize) -> usize {
        if self.sq_done.len() + self.sq_pending.len() + posting > self.cap.max_send_wr as usize {
            reclaim(&mut self.sq_done, self.send_cq.producer().consumed());
        }
        self.sq_done.len() + self.sq_pending.len()
    }

    /// Receive slots in use, after freeing what was polled if `posting`
    /// more would not fit otherwise.
    pub(crate) fn rq_used(&mut self, posting: usize) -> usize {
        if self.rq.len() + self.rq_done.len() + posting > self.cap.max_recv_wr as usize {
            reclaim(&mut self.rq_done, self.recv_cq.producer().consumed());
        }
        self.rq.len() + self.rq_done.len()
    }

    /// True when nothing holds a slot any more (a destroyed QP can go).
    pub(crate) fn drained(&mut self) -> bool {
        reclaim(&mut self.sq_done, self.send_cq.producer().consumed());
        reclaim(&mut self.rq_done, self.recv_cq.producer().consumed());
        self.sq_done.iter().all(|d| *d == Done::Silent)
            && self.sq_pending.is_empty()
            && self.rq.is_empty()
            && self.rq_done.is_empty()
    }
}

#[derive(Debug)]
pub(crate) struct SrqCtx {
    pub(crate) pd: u32,
    pub(crate) device: u32,
    pub(crate) max_wr: u32,
    pub(crate) max_sge: u32,
    pub(crate) rq: VecDeque<PendingRecv>,
    /// Consumed receives whose completion is not polled, per CQ (a QP's
    /// receive CQ), each in CQ order.
    pub(crate) done: Vec<(Cq, VecDeque<Done>)>,
    pub(crate) users: usize,
}

impl SrqCtx {
    pub(crate) fn used(&mut self, posting: usize) -> usize {
        let mut n = self.rq.len();
        let full = n + self.done.iter().map(|(_, d)| d.len()).sum::<usize>() + posting
            > self.max_wr as usize;
        for (cq, d) in &mut self.done {
            if full {
                reclaim(d, cq.producer().consumed());
            }
            n += d.len();
        }
        n
    }

    pub(crate) fn record(&mut self, cq: &Cq, done: Done) {
        if let Some((_, d)) = self.done.iter_mut().find(|(c, _)| c.same(cq)) {
            d.push_back(done);
        } else {
            self.done.push((cq.clone(), VecDeque::from([done])));
        }
    }
}

/// A hasher for the NIC's own small integer ids (QP numbers, SRQ and
/// region ids, all handed out by the fabric): one multiply instead of
/// SipHash, whose flood resistance a table of ids this process made does
/// not need. Every request looks several of them up under the fabric's
/// lock.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        // hashbrown takes the bucket from the low bits and a tag from the
        // top seven: a multiply by an odd constant spreads the id over both.
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

/// Tables keyed by the fabric's ids.
pub(crate) type IdMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<IdHasher>>;

#[derive(Debug)]
pub(crate) struct FabricState {
    pub(crate) qps: IdMap<QpCtx>,
    pub(crate) srqs: IdMap<SrqCtx>,
    pub(crate) mrs: IdMap<MrCtx>,
    pub(crate) next_qpn: u32,
    pub(crate) next_srq: u32,
    pub(crate) next_mr: u32,
    pub(crate) next_pd: u32,
    pub(crate) next_device: u32,
    /// QPs with send requests not executed yet.
    pub(crate) active: Vec<u32>,
    /// `active`'s other buffer (see `FabricState::run`).
    pub(crate) active_spare: Vec<u32>,
    pub(crate) faults: NicFaults,
    pub(crate) rng: u64,
    /// When the simulated link is free again (timed engine).
    pub(crate) link_free_at: Instant,
    /// When the fabric was made: the inline engine's "now" while no
    /// request has ever been delayed (see [`FabricState::now`]).
    pub(crate) epoch: Instant,
    pub(crate) stats: NicStats,
    /// The RNR timer (timed engine only).
    pub(crate) rnr_timer: Option<std::time::Duration>,
    /// A SEND's bytes between its gather and the receive's scatter, kept
    /// so that a transfer allocates nothing in steady state.
    pub(crate) scratch: Vec<u8>,
}

impl FabricState {
    pub(crate) fn new() -> Self {
        FabricState {
            qps: IdMap::default(),
            srqs: IdMap::default(),
            mrs: IdMap::default(),
            next_qpn: 0x100,
            next_srq: 0,
            next_mr: 0,
            next_pd: 0,
            next_device: 0,
            active: Vec::new(),
            active_spare: Vec::new(),
            faults: NicFaults::default(),
            rng: 1,
            link_free_at: Instant::now(),
            scratch: Vec::new(),
            epoch: Instant::now(),
            stats: NicStats::default(),
            rnr_timer: None,
        }
    }

    /// xorshift64*, deterministic for a seed.
    /// The time a post stamps its requests with and runs the engine at.
    /// Only delayed requests (fault injection) and the timed engine have
    /// a due time in the future; until one exists every request is due at
    /// once, and the fabric's epoch stands for now (a clock read per post
    /// saved). From the first delay on it is the clock.
    pub(crate) fn now(&self, timed: bool) -> Instant {
        if timed || self.faults.delay_rate > 0.0 || self.stats.delayed > 0 {
            Instant::now()
        } else {
            self.epoch
        }
    }

    pub(crate) fn chance(&mut self, p: f64) -> bool {
        if p <= 0.0 {
            return false;
        }
        let mut x = self.rng;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng = x;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        (v as f64 / (1u64 << 53) as f64) < p
    }

    /// Drops destroyed QPs whose slots are all reclaimed (releasing their
    /// CQ reservations).
    pub(crate) fn sweep_destroyed(&mut self) {
        let gone: Vec<u32> = self
            .qps
            .iter_mut()
            .filter_map(|(n, q)| (q.destroyed && q.drained()).then_some(*n))
            .collect();
        for n in gone {
            if let Some(q) = self.qps.remove(&n) {
                if let Some(s) = q.srq.and_then(|s| self.srqs.get_mut(&s)) {
                    s.users = s.users.saturating_sub(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reclaim_frees_silent_before_polled_cqe() {
        let mut d = VecDeque::from([
            Done::Silent,
            Done::Cqe(0),
            Done::Silent,
            Done::Cqe(1),
            Done::Silent,
        ]);
        reclaim(&mut d, 0);
        assert_eq!(d.len(), 5);
        reclaim(&mut d, 1);
        assert_eq!(
            d,
            VecDeque::from([Done::Silent, Done::Cqe(1), Done::Silent])
        );
        reclaim(&mut d, 2);
        assert_eq!(d, VecDeque::from([Done::Silent]));
        let mut d = VecDeque::from([Done::Silent, Done::Lost, Done::Cqe(5)]);
        reclaim(&mut d, 0);
        assert_eq!(d, VecDeque::from([Done::Cqe(5)]));
    }
}
