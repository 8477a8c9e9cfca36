//! The simulated NIC driven by arbitrary sequences of verbs calls: CQs
//! created (any size, admission on) and destroyed, memory regions
//! registered (any length and access) and released, QPs and an SRQ created
//! with any capacities, QPs moved through any transition, connected,
//! forced to error and dropped, sends of every operation and receives with
//! any scatter/gather list (real, wrong or made-up keys, out-of-range
//! offsets and lengths), polls, arms, notifications taken and acknowledged
//! in any amount, NIC faults switched on and off.
//!
//! Checked on every input: no call panics; no completion is invented
//! (every wr_id polled was posted, and accepted) and none is delivered
//! twice; a completion comes on the CQ of its queue; with admission on, no
//! CQ overflows; and at the end, with every QP moved to error and every CQ
//! drained, every accepted signaled send and every receive posted to a
//! QP completed — unless its CQ was destroyed or its QP reset (RESET
//! discards without completions, as on hardware).
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use cqd_core::{ArmKind, Completion, CompletionSource, Opcode};
use cqd_sim::{
    connect_with, Access, Cq, CqConfig, Device, Fabric, Faults, Modify, Mr, NicFaults, Pd, Qp,
    QpCap, QpInit, RecvWr, RemoteAddr, SendWr, Sge, SimCqSource, Srq, WrOp,
};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
struct SgeIn {
    mr: u8,
    offset: u16,
    len: u16,
    /// A key of its own instead of the region's.
    key: Option<u32>,
}

#[derive(Arbitrary, Debug)]
struct RemoteIn {
    mr: u8,
    offset: u16,
    key: Option<u32>,
}

#[derive(Arbitrary, Debug)]
enum OpIn {
    Send,
    SendImm(u32),
    Write(RemoteIn),
    WriteImm(RemoteIn, u32),
    Read(RemoteIn),
    Cas(RemoteIn, u64, u64),
    Add(RemoteIn, u64),
}

#[derive(Arbitrary, Debug)]
enum ModifyIn {
    Init(u8),
    Rtr(u8),
    RtrRaw(u32),
    Rts(u8, u8),
    Err,
    Reset,
}

#[derive(Arbitrary, Debug)]
enum Call {
    CreateCq {
        cqe: u16,
        spurious: bool,
        drop: bool,
    },
    DestroyCq(u8),
    RegMr {
        len: u16,
        access: u8,
    },
    DeregMr(u8),
    CreateQp {
        send_cq: u8,
        recv_cq: u8,
        send_wr: u8,
        recv_wr: u8,
        send_sge: u8,
        recv_sge: u8,
        srq: bool,
    },
    CreateSrq {
        max_wr: u8,
        max_sge: u8,
    },
    DropQp(u8),
    Modify(u8, ModifyIn),
    Connect(u8, u8, u8),
    PostSend {
        qp: u8,
        op: OpIn,
        sges: Vec<SgeIn>,
        signaled: bool,
        solicited: bool,
    },
    PostRecv {
        qp: u8,
        sges: Vec<SgeIn>,
    },
    PostSrqRecv(Vec<SgeIn>),
    Poll(u8, u8),
    Arm(u8, bool),
    TakeEvents(u8),
    Ack(u8, u8),
    ForceError(u8),
    NicFaults(u8, u8),
    Progress,
}

/// Where a posted request's completion must come from.
#[derive(Debug, Clone, Copy)]
struct Posted {
    /// The CQ it completes on; `None` for an SRQ receive (any user's CQ).
    cq: Option<usize>,
    qp: Option<usize>,
    /// A completion is owed even on success.
    must: bool,
    seen: bool,
}

struct CqSlot {
    cq: Cq,
    source: Option<SimCqSource>,
}

struct QpSlot {
    qp: Option<Qp>,
    send_cq: usize,
    recv_cq: usize,
    /// Reset or destroyed after a post: its requests may vanish (a move
    /// to RESET discards them; the NIC purges a destroyed QP's completions
    /// not yet polled from its CQs, as mlx5 does).
    reset: bool,
}

struct World {
    fabric: Fabric,
    pd: Pd,
    cqs: Vec<CqSlot>,
    mrs: Vec<Option<Mr>>,
    qps: Vec<QpSlot>,
    srq: Option<Srq>,
    posted: HashMap<u64, Posted>,
    next: u64,
    buf: Vec<Completion>,
}

fn pick<T>(v: &[T], i: u8) -> Option<usize> {
    (!v.is_empty()).then(|| usize::from(i) % v.len())
}

impl World {
    fn sges(&self, list: &[SgeIn]) -> Vec<Sge> {
        list.iter()
            .take(40)
            .map(
                |s| match pick(&self.mrs, s.mr).and_then(|i| self.mrs[i].as_ref()) {
                    Some(mr) => {
                        let mut g = mr.sge(u64::from(s.offset), u32::from(s.len));
                        if let Some(k) = s.key {
                            g.lkey = k;
                        }
                        g
                    }
                    None => Sge {
                        addr: u64::from(s.offset),
                        length: u32::from(s.len),
                        lkey: s.key.unwrap_or(0),
                    },
                },
            )
            .collect()
    }

    fn remote(&self, r: &RemoteIn) -> RemoteAddr {
        match pick(&self.mrs, r.mr).and_then(|i| self.mrs[i].as_ref()) {
            Some(mr) => {
                let mut a = mr.remote(u64::from(r.offset));
                if let Some(k) = r.key {
                    a.rkey = k;
                }
                a
            }
            None => RemoteAddr {
                addr: u64::from(r.offset),
                rkey: r.key.unwrap_or(0),
            },
        }
    }

    fn qp(&self, i: u8) -> Option<(usize, &Qp)> {
        let i = pick(&self.qps, i)?;
        Some((i, self.qps[i].qp.as_ref()?))
    }

    fn poll(&mut self, c: usize, n: usize) {
        let Some(src) = self.cqs[c].source.as_mut() else {
            return;
        };
        let n = src.poll(&mut self.buf[..n]).expect("poll of a live CQ");
        for wc in &self.buf[..n] {
            let p = self
                .posted
                .get_mut(&wc.wr_id)
                .unwrap_or_else(|| panic!("completion for a wr_id never accepted: {wc:?}"));
            assert!(!p.seen, "completion delivered twice: {wc:?}");
            p.seen = true;
            if let Some(cq) = p.cq {
                assert_eq!(cq, c, "completion on the wrong CQ: {wc:?}");
            }
        }
    }

    fn drain(&mut self, c: usize) {
        for _ in 0..100_000 {
            let before = self.posted.values().filter(|p| p.seen).count();
            self.poll(c, self.buf.len());
            if self.posted.values().filter(|p| p.seen).count() == before {
                return;
            }
        }
        panic!("CQ {c} never drained");
    }

    fn record(&mut self, id: u64, p: Posted) {
        self.posted.insert(id, p);
    }
}

fuzz_target!(|calls: Vec<Call>| {
    let fabric = Fabric::inline();
    let dev: Device = fabric.open_device("fuzz", Default::default());
    let pd = dev.alloc_pd();
    let mut w = World {
        fabric,
        pd,
        cqs: Vec::new(),
        mrs: Vec::new(),
        qps: Vec::new(),
        srq: None,
        posted: HashMap::new(),
        next: 1,
        buf: vec![Completion::success(0, Opcode::Send, 0); 64],
    };
    for call in calls.into_iter().take(256) {
        match call {
            Call::CreateCq {
                cqe,
                spurious,
                drop,
            } => {
                if w.cqs.len() >= 6 {
                    continue;
                }
                let config = CqConfig {
                    faults: Faults {
                        spurious: if spurious { 0.3 } else { 0.0 },
                        drop: if drop { 0.3 } else { 0.0 },
                        ..Faults::default()
                    },
                    ..CqConfig::default()
                };
                if let Ok((cq, source)) =
                    dev.create_cq(format!("cq{}", w.cqs.len()), u32::from(cqe % 2048), config)
                {
                    w.cqs.push(CqSlot {
                        cq,
                        source: Some(source),
                    });
                }
            }
            Call::DestroyCq(i) => {
                if let Some(c) = pick(&w.cqs, i) {
                    if let Some(mut s) = w.cqs[c].source.take() {
                        let n = s.unacked_events();
                        s.ack_events(n).expect("ack what was taken");
                        s.destroy().expect("destroy with every event acked");
                    }
                }
            }
            Call::RegMr { len, access } => {
                if w.mrs.len() < 8 {
                    if let Ok(mr) = w.pd.reg_mr(u64::from(len), Access(u32::from(access))) {
                        w.mrs.push(Some(mr));
                    }
                }
            }
            Call::DeregMr(i) => {
                if let Some(m) = pick(&w.mrs, i) {
                    w.mrs[m] = None;
                }
            }
            Call::CreateQp {
                send_cq,
                recv_cq,
                send_wr,
                recv_wr,
                send_sge,
                recv_sge,
                srq,
            } => {
                let (Some(s), Some(r)) = (pick(&w.cqs, send_cq), pick(&w.cqs, recv_cq)) else {
                    continue;
                };
                if w.qps.len() >= 8 {
                    continue;
                }
                let cap = QpCap {
                    max_send_wr: u32::from(send_wr),
                    max_recv_wr: u32::from(recv_wr),
                    max_send_sge: u32::from(send_sge % 40),
                    max_recv_sge: u32::from(recv_sge % 40),
                };
                let init = QpInit::new(&w.cqs[s].cq, &w.cqs[r].cq, cap);
                let init = match (&w.srq, srq) {
                    (Some(q), true) => init.with_srq(q),
                    _ => init,
                };
                if let Ok(qp) = w.pd.create_qp(&init) {
                    w.qps.push(QpSlot {
                        qp: Some(qp),
                        send_cq: s,
                        recv_cq: r,
                        reset: false,
                    });
                }
            }
            Call::CreateSrq { max_wr, max_sge } => {
                if w.srq.is_none() {
                    w.srq =
                        w.pd.create_srq(u32::from(max_wr), u32::from(max_sge % 40))
                            .ok();
                }
            }
            Call::DropQp(i) => {
                if let Some(q) = pick(&w.qps, i) {
                    if w.qps[q].qp.take().is_some() {
                        w.qps[q].reset = true;
                    }
                }
            }
            Call::Modify(i, m) => {
                let m = match m {
                    ModifyIn::Init(a) => Modify::Init {
                        access: Access(u32::from(a)),
                    },
                    ModifyIn::Rtr(p) => match w.qp(p) {
                        Some((_, peer)) => Modify::Rtr {
                            remote_qpn: peer.qpn(),
                        },
                        None => continue,
                    },
                    ModifyIn::RtrRaw(remote_qpn) => Modify::Rtr { remote_qpn },
                    ModifyIn::Rts(rnr_retry, retry_cnt) => Modify::Rts {
                        rnr_retry,
                        retry_cnt,
                    },
                    ModifyIn::Err => Modify::Err,
                    ModifyIn::Reset => Modify::Reset,
                };
                if let Some((q, qp)) = w.qp(i) {
                    if qp.modify(m).is_ok() && m == Modify::Reset {
                        w.qps[q].reset = true;
                    }
                }
            }
            Call::Connect(a, b, rnr) => {
                if let (Some((_, x)), Some((_, y))) = (w.qp(a), w.qp(b)) {
                    let _ = connect_with(x, y, rnr % 8);
                }
            }
            Call::PostSend {
                qp,
                op,
                sges,
                signaled,
                solicited,
            } => {
                let sg = w.sges(&sges);
                let op = match op {
                    OpIn::Send => WrOp::Send,
                    OpIn::SendImm(i) => WrOp::SendWithImm(i),
                    OpIn::Write(r) => WrOp::Write(w.remote(&r)),
                    OpIn::WriteImm(r, i) => WrOp::WriteWithImm(w.remote(&r), i),
                    OpIn::Read(r) => WrOp::Read(w.remote(&r)),
                    OpIn::Cas(r, compare, swap) => WrOp::CompareSwap {
                        remote: w.remote(&r),
                        compare,
                        swap,
                    },
                    OpIn::Add(r, add) => WrOp::FetchAdd {
                        remote: w.remote(&r),
                        add,
                    },
                };
                let id = w.next;
                w.next += 1;
                let Some((q, x)) = w.qp(qp) else { continue };
                let wr = SendWr {
                    wr_id: id,
                    op,
                    sg_list: &sg,
                    signaled,
                    solicited,
                    ud: None,
                };
                if x.post_send_unaccounted(&[wr]).is_ok() {
                    let p = Posted {
                        cq: Some(w.qps[q].send_cq),
                        qp: Some(q),
                        must: signaled,
                        seen: false,
                    };
                    w.record(id, p);
                }
            }
            Call::PostRecv { qp, sges } => {
                let sg = w.sges(&sges);
                let id = w.next;
                w.next += 1;
                let Some((q, x)) = w.qp(qp) else { continue };
                if x.post_recv_unaccounted(&[RecvWr {
                    wr_id: id,
                    sg_list: &sg,
                }])
                .is_ok()
                {
                    let p = Posted {
                        cq: Some(w.qps[q].recv_cq),
                        qp: Some(q),
                        must: true,
                        seen: false,
                    };
                    w.record(id, p);
                }
            }
            Call::PostSrqRecv(sges) => {
                let sg = w.sges(&sges);
                let id = w.next;
                w.next += 1;
                if let Some(srq) = &w.srq {
                    if srq
                        .post_recv_unaccounted(&[RecvWr {
                            wr_id: id,
                            sg_list: &sg,
                        }])
                        .is_ok()
                    {
                        let p = Posted {
                            cq: None,
                            qp: None,
                            must: false,
                            seen: false,
                        };
                        w.record(id, p);
                    }
                }
            }
            Call::Poll(c, n) => {
                if let Some(c) = pick(&w.cqs, c) {
                    w.poll(c, usize::from(n % 64));
                }
            }
            Call::Arm(c, solicited) => {
                if let Some(c) = pick(&w.cqs, c) {
                    if let Some(s) = w.cqs[c].source.as_mut() {
                        let kind = if solicited {
                            ArmKind::Solicited
                        } else {
                            ArmKind::Next
                        };
                        s.arm(kind).expect("arm a live CQ");
                    }
                }
            }
            Call::TakeEvents(c) => {
                if let Some(c) = pick(&w.cqs, c) {
                    if let Some(s) = w.cqs[c].source.as_mut() {
                        s.take_events().expect("take events");
                    }
                }
            }
            Call::Ack(c, n) => {
                if let Some(c) = pick(&w.cqs, c) {
                    if let Some(s) = w.cqs[c].source.as_mut() {
                        let unacked = s.unacked_events();
                        let n = u32::from(n);
                        // Both backends acknowledge at most what was taken
                        // (more would corrupt libibverbs' count).
                        s.ack_events(n).expect("ack");
                        assert_eq!(s.unacked_events(), unacked.saturating_sub(n));
                    }
                }
            }
            Call::ForceError(i) => {
                if let Some((_, x)) = w.qp(i) {
                    x.force_error();
                }
            }
            Call::NicFaults(e, q) => w.fabric.set_faults(NicFaults {
                error_rate: f64::from(e % 4) * 0.1,
                qp_error_rate: f64::from(q % 4) * 0.1,
                seed: u64::from(e) << 8 | u64::from(q),
                ..NicFaults::default()
            }),
            Call::Progress => w.fabric.progress(),
        }
        for s in &w.cqs {
            assert!(
                !s.cq.producer().is_overflowed(),
                "a CQ overflowed with admission on"
            );
        }
    }

    // The end: every QP to error (flushing what is queued), every CQ
    // drained; nothing owed may be missing.
    for q in &w.qps {
        if let Some(qp) = &q.qp {
            let _ = qp.modify(Modify::Err);
        }
    }
    w.fabric.progress();
    for c in 0..w.cqs.len() {
        w.drain(c);
    }
    for (id, p) in &w.posted {
        let Some(q) = p.qp else { continue };
        let qs = &w.qps[q];
        let cq_alive = p.cq.is_some_and(|c| w.cqs[c].source.is_some());
        if p.must && !p.seen && cq_alive && !qs.reset {
            panic!("wr_id {id} accepted and never completed: {p:?}");
        }
    }
    for c in &mut w.cqs {
        if let Some(s) = c.source.as_mut() {
            s.take_events().expect("take events");
            let n = s.unacked_events();
            s.ack_events(n).expect("ack");
            s.destroy().expect("destroy");
        }
    }
});
