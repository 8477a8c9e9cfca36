//! The poller fed arbitrary completion streams: requests posted through the
//! posting call (a loopback QP on a simulated CQ with credits) mixed with
//! completions the "device" invents — any status, opcode, wr_id (foreign,
//! bad kind, stale generation, a live handler's key), byte count, QP
//! number, flags — while handlers register and retire, with polls, arms
//! and acknowledgements in any order.
//!
//! Checked on every input: no panic; every request posted through the
//! posting call is delivered exactly once, to its handler, on its side;
//! an invented completion on another QP naming a live handler reaches that
//! handler once, and one naming nothing live is counted (stale or
//! foreign), never dispatched; an invented completion on the loopback QP,
//! whose queues are accounted, matches no request in flight there and is
//! counted unmatched (stale if its handler is gone), never dispatched;
//! every account balances; the CQ's completion counter equals what was
//! pushed; every notification taken is acknowledged before the CQ is
//! destroyed.
#![no_main]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use arbitrary::Arbitrary;
use cqd_core::budget::BudgetOptions;
use cqd_core::ledger::WrLedger;
use cqd_core::post::Refused;
use cqd_core::wr_id::WrIdError;
use cqd_core::{
    split, Completion, CqBudget, CqOptions, CqPoller, Failed, Handler, HandlerKey, NoWork, OpKind,
    Opcode, Outbox, RecvDone, Registration, SendDone, Side, Status,
};
use cqd_sim::{sim_cq_with_ledger, Faults, LoopWr, Loopback, LoopbackError, SimCq};
use libfuzzer_sys::fuzz_target;

const CAPACITY: u32 = 64;
const QPN: u32 = 7;
/// Tags of invented completions have this bit; posted ones do not.
const INVENTED: u32 = 1 << 23;

#[derive(Arbitrary, Debug)]
enum Op {
    /// A request through the posting call.
    Post {
        handler: u8,
        kind: u8,
        status: u32,
        byte_len: u32,
        signaled: bool,
    },
    /// A completion the device makes up.
    Invent {
        target: Target,
        kind: u8,
        status: u32,
        opcode: u32,
        byte_len: u32,
        qp_num: u32,
        wc_flags: u32,
        vendor_err: u32,
    },
    Poll,
    Arm,
    TakeEvents,
    Register,
    Unregister(u8),
}

#[derive(Arbitrary, Debug)]
enum Target {
    /// A handler's current key.
    Handler(u8),
    /// A handler's key with another generation.
    Stale(u8, u16),
    /// Any 64-bit value.
    Raw(u64),
}

/// What each handler saw, by (side, tag).
type Seen = Arc<Mutex<HashMap<(Side, u32), u32>>>;

struct Count(Seen);

impl Count {
    fn saw(&self, side: Side, tag: u32) {
        *self.0.lock().unwrap().entry((side, tag)).or_default() += 1;
    }
}

impl Handler for Count {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.saw(Side::Send, d.tag());
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.saw(Side::Recv, d.tag());
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.saw(f.side(), f.tag());
    }
}

struct Live {
    reg: Registration,
    seen: Seen,
    /// What it must see, by (side, tag).
    expect: HashMap<(Side, u32), u32>,
}

struct World {
    poller: CqPoller<NoWork>,
    producer: SimCq,
    qp: Loopback,
    handle: cqd_core::CqHandle<NoWork>,
    live: Vec<Live>,
    retired: Vec<Live>,
    out: VecDeque<cqd_core::Routed<NoWork>>,
    pushed: u64,
    next_tag: u32,
}

impl World {
    fn drain(&mut self) {
        loop {
            match self.poller.poll_once(&mut self.out) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => panic!("poll failed on a healthy CQ: {e}"),
            }
        }
        self.out.clear();
    }

    /// Room for one more entry without an overflow (the invented ones take
    /// no credit, so the test keeps the CQ from overflowing itself).
    fn room(&mut self) {
        if self.producer.len() + 1 >= CAPACITY as usize {
            self.drain();
        }
    }

    fn register(&mut self) {
        let seen = Seen::default();
        let reg = self.handle.register(Count(Arc::clone(&seen))).unwrap();
        self.poller.apply_commands();
        self.live.push(Live {
            reg,
            seen,
            expect: HashMap::new(),
        });
    }

    fn key_of(&self, i: u8) -> Option<(usize, HandlerKey)> {
        if self.live.is_empty() {
            return None;
        }
        let i = usize::from(i) % self.live.len();
        Some((i, self.live[i].reg.key()))
    }
}

fn kind_of(k: u8) -> OpKind {
    OpKind::ALL[usize::from(k) % OpKind::COUNT]
}

fuzz_target!(|input: (u8, Vec<Op>)| {
    let (batch, ops) = input;
    let budget = CqBudget::new(
        "fuzz",
        CAPACITY,
        BudgetOptions {
            admission: false,
            credits: Some(CAPACITY / 2),
        },
    );
    let (producer, source) = sim_cq_with_ledger(
        "fuzz",
        CAPACITY,
        Faults::default(),
        WrLedger::with_budget(budget),
    )
    .unwrap();
    let (poller, handle) = split::<NoWork>(
        source,
        CqOptions {
            batch: usize::from(batch % 40) + 1,
            ..CqOptions::default()
        },
    )
    .unwrap();
    let mut w = World {
        poller: poller.bind(),
        qp: Loopback::new(producer.clone(), QPN),
        producer,
        handle,
        live: Vec::new(),
        retired: Vec::new(),
        out: VecDeque::new(),
        pushed: 0,
        next_tag: 0,
    };
    w.register();
    // Invented completions on the loopback QP that must be counted
    // unmatched.
    let mut unmatched = 0u64;

    for op in ops.into_iter().take(512) {
        match op {
            Op::Post {
                handler,
                kind,
                status,
                byte_len,
                signaled,
            } => {
                let Some((i, _)) = w.key_of(handler) else {
                    continue;
                };
                w.room();
                let kind = kind_of(kind);
                let tag = w.next_tag;
                w.next_tag = (w.next_tag + 1) % INVENTED;
                let mut wr = LoopWr::new(u64::from(tag), kind).with_len(byte_len);
                let status = Status::from_raw(status % 32);
                if status != Status::Success {
                    wr = wr.failing(status);
                }
                let signaled = signaled || kind == OpKind::Recv;
                if !signaled {
                    wr = wr.unsignaled();
                }
                let l = &mut w.live[i];
                let posted = if kind == OpKind::Recv {
                    l.reg.post_recv(&w.qp, &mut [wr])
                } else {
                    l.reg.post_send(&w.qp, &mut [wr])
                };
                if kind == OpKind::Internal {
                    // cqd's own kind (drain markers): refused untouched.
                    assert!(
                        matches!(
                            posted,
                            Err(LoopbackError::Refused(Refused::Tag {
                                source: WrIdError::Reserved,
                                ..
                            }))
                        ),
                        "a handler posted cqd's internal kind: {posted:?}"
                    );
                } else if posted.is_ok() && (signaled || status != Status::Success) {
                    *l.expect.entry((kind.side(), tag)).or_default() += 1;
                    w.pushed += 1;
                }
            }
            Op::Invent {
                target,
                kind,
                status,
                opcode,
                byte_len,
                qp_num,
                wc_flags,
                vendor_err,
            } => {
                w.room();
                let tag = INVENTED | (w.next_tag % INVENTED);
                w.next_tag = (w.next_tag + 1) % INVENTED;
                let kind = kind_of(kind);
                let (raw, owner) = match target {
                    Target::Handler(h) => match w.key_of(h) {
                        Some((i, key)) => (key.wr_id(kind, tag).unwrap(), Some(i)),
                        None => continue,
                    },
                    Target::Stale(h, g) => match w.key_of(h) {
                        Some((_, key)) => {
                            let g = g & cqd_core::wr_id::MAX_GENERATION;
                            if g == key.generation() {
                                continue;
                            }
                            let k = HandlerKey::new(key.slot(), g).unwrap();
                            (k.wr_id(kind, tag).unwrap(), None)
                        }
                        None => continue,
                    },
                    Target::Raw(r) => (r, None),
                };
                let decoded = cqd_core::WrId::decode(raw).ok();
                // A raw value may name a live handler too.
                let owner = owner.or_else(|| {
                    let d = decoded?;
                    w.live.iter().position(|l| l.reg.key() == d.key)
                });
                // On the loopback QP, only tags no post carries: a completion
                // naming a request posted there is that request's own (or
                // the device writing it twice, which tests/contexts.rs
                // checks), not a stream this target can predict.
                let qp_num = match decoded {
                    Some(d) if qp_num == QPN && d.tag & INVENTED == 0 => QPN + 1,
                    _ => qp_num,
                };
                let mut c = Completion::success(raw, Opcode::from_raw(opcode), qp_num);
                c.status = Status::from_raw(status);
                c.byte_len = byte_len;
                c.vendor_err = vendor_err;
                c.wc_flags = cqd_core::WcFlags(wc_flags);
                w.producer.push(c, false).unwrap();
                w.pushed += 1;
                match (decoded, owner) {
                    // Both of the loopback QP's queues are accounted: a
                    // completion there that retires nothing is unmatched
                    // and reaches no handler, unless it names a handler no
                    // longer registered (then stale).
                    (Some(d), _) if qp_num == QPN => {
                        if owner.is_some() || d.kind == OpKind::Internal {
                            unmatched += 1;
                        }
                    }
                    // Of cqd's own kind (a drain marker's), no handler's.
                    (Some(d), Some(i)) if d.kind != OpKind::Internal => {
                        *w.live[i].expect.entry((d.kind.side(), d.tag)).or_default() += 1;
                    }
                    _ => {}
                }
            }
            Op::Poll => {
                let _ = w.poller.poll_once(&mut w.out).expect("poll");
                w.out.clear();
            }
            Op::Arm => {
                // Arming a CQ that holds entries is allowed; it fires at once.
                w.poller.arm().expect("arm");
            }
            Op::TakeEvents => {
                w.poller.take_events().expect("take events");
                w.poller.ack_all().expect("ack");
            }
            Op::Register => {
                if w.live.len() < 8 {
                    w.drain();
                    w.register();
                }
            }
            Op::Unregister(h) => {
                // Drained first, so that which completions find it live is
                // known: a retired handler with nothing outstanding goes at
                // once, and later completions naming it are stale.
                if let Some((i, key)) = w.key_of(h) {
                    w.drain();
                    w.handle.unregister(key).unwrap();
                    w.poller.apply_commands();
                    let l = w.live.swap_remove(i);
                    w.retired.push(l);
                }
            }
        }
    }
    w.drain();
    // Unsignaled sends are retired by the next completion of their queue:
    // one signaled send closes the stream.
    if let Some(l) = w.live.first_mut() {
        let tag = w.next_tag;
        l.reg
            .post_send(&w.qp, &mut [LoopWr::new(u64::from(tag), OpKind::Send)])
            .expect("a drained CQ has credits");
        *l.expect.entry((Side::Send, tag)).or_default() += 1;
        w.pushed += 1;
        w.drain();
    }

    let snap = w.handle.snapshot();
    assert_eq!(snap.completions, w.pushed, "completions counted");
    assert_eq!(snap.unmatched_wr_ids, unmatched, "unmatched counted");
    for l in w.live.iter().chain(&w.retired) {
        let seen = l.seen.lock().unwrap();
        for (what, n) in &l.expect {
            assert_eq!(seen.get(what), Some(n), "{what:?} delivered");
        }
        for (what, n) in seen.iter() {
            assert_eq!(l.expect.get(what), Some(n), "{what:?} never expected");
        }
    }
    for l in &w.live {
        assert_eq!(l.reg.ledger().outstanding(), 0, "ledger balanced");
    }
    w.poller.take_events().unwrap();
    w.poller.ack_all().unwrap();
    assert_eq!(w.poller.unacked_events(), 0);
    w.poller.destroy().expect("destroy after every event acked");
});
