//! The dispatcher's integration scenarios, written once and run against
//! three backends — the simulated NIC (cqd-sim), libibverbs on the
//! softverbs device (cqd-verbs) and libibverbs on the kernel's Soft-RoCE
//! (rxe, in a VM) — in every poll mode where it makes sense.
//!
//! Each scenario is one generic function over [`backend::Backend`] (a
//! device, CQs, connected QP pairs, memory, work requests); handlers post
//! through their `Registration`, generic over cqd_core's `PostSend` /
//! `PostRecv`. The `matrix!` table at the end makes one `#[test]` per
//! scenario, backend and mode: `exactly_once::sim::busy`,
//! `device_gone::verbs::event`, … The verbs half needs the device: run it
//! under the launcher (you are root):
//!
//! ```sh
//! cargo build -p softverbs --release
//! cp $CARGO_TARGET_DIR/release/libsoftverbs.so $CARGO_TARGET_DIR/release/libsoftverbs-rdmav34.so
//! $CARGO_TARGET_DIR/release/softverbs-run cargo test -p cqd-verbs --release --test two_backends
//! ```
//!
//! The test command (scripts/test.sh) does that by itself as root: nextest
//! runs each verbs cell under the launcher (.config/nextest.toml), or,
//! where the launcher cannot run, leaves the verbs cells out and counts
//! them skipped. Under `cargo test` outside the launcher, each verbs test
//! prints `SKIPPED: <name> (needs softverbs-run, root)` to fd 2 and passes;
//! the sim half always runs. `CQD_SUITE_TIMES=1` prints each test's run
//! time to fd 2.
//!
//! The rxe third runs where `CQD_RXE` names an rxe device, which
//! scripts/rxe-vm.sh sets up in a VM (docs/verbs.md, "Running on
//! Soft-RoCE in a VM"); it runs the binary built on the host:
//!
//! ```sh
//! cargo test -p cqd-verbs --release --test two_backends --no-run   # prints the binary
//! scripts/rxe-vm.sh target/release/deps/two_backends-HASH ::rxe:: --test-threads=1
//! ```
//!
//! Elsewhere each rxe test prints `SKIPPED: <name> (needs rxe, ...)`; nextest
//! leaves the rxe cells out and counts them skipped.
//! Under TCG the rxe third runs every scenario at full size (about 80 s
//! for the 78 tests), with every wait's limit multiplied by
//! `support::slow()`; the device-death scenarios say why they cannot run
//! there ([`backend::Backend::cannot_run`]).
//!
//! Every cell runs on every backend; none is ignored.
#![allow(missing_docs)]

#[path = "two_backends/backend.rs"]
mod backend;
#[path = "two_backends/grow.rs"]
mod grow;
#[path = "two_backends/windows.rs"]
mod memory_windows;
#[path = "two_backends/support.rs"]
mod support;
#[path = "two_backends/teardown.rs"]
mod teardown;
#[path = "two_backends/ud_atomic.rs"]
mod ud_atomic;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use backend::{Backend, Cap, Op};
use cqd_core::source::{ArmKind, SourceError};
use cqd_core::{
    split, CompletionSource, CqOptions, KindAccount, NoWork, OpKind, PollerReport, Registration,
    Side, Status, SystemReport,
};
use grow::{
    cq_pool, cq_pool_first_fit, cq_pool_from_topology, cq_pool_resize, grow_running,
    join_as_it_stops, resize_running,
};
use support::{
    device_or_skip, mode, poller, poller_with, readable, retry, wait_until, within, Ev, Log,
    Recorder, Spy,
};
use teardown::{churn, close_own, close_srq, full_send_queue};
use ud_atomic::{atomics, mixed_kinds, ud_routing};

/// Runs one cell of the matrix: skips a verbs backend without its device
/// (and a scenario the backend cannot run, saying why), times the run.
fn run<B: Backend>(test: &str, scenario: impl FnOnce()) {
    if !device_or_skip(B::NAME, test) {
        return;
    }
    let name = test.split("::").next().unwrap_or(test);
    if let Some(why) = B::cannot_run(name) {
        support::say(&format!("SKIPPED: {test} ({why})\n"));
        return;
    }
    let start = Instant::now();
    scenario();
    if std::env::var_os("CQD_SUITE_TIMES").is_some() {
        let line = format!("TIME {test} {} ms\n", start.elapsed().as_millis());
        // SAFETY: writes a live buffer of `line.len()` bytes to fd 2.
        unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
    }
}

/// Each of `tags` appears exactly once among the events of `kind` in
/// `evs`, and no other tag does.
fn assert_each_once(who: &str, evs: &[Ev], kind: OpKind, tags: impl IntoIterator<Item = u32>) {
    let mut seen: HashMap<u32, u32> = HashMap::new();
    for e in evs.iter().filter(|e| e.kind == kind) {
        *seen.entry(e.tag).or_default() += 1;
    }
    for t in tags {
        assert_eq!(
            seen.remove(&t),
            Some(1),
            "{who}: {kind} tag {t} must be delivered exactly once"
        );
    }
    assert!(
        seen.is_empty(),
        "{who}: {kind} tags delivered that were never posted: {:?}",
        seen.keys().take(8).collect::<Vec<_>>()
    );
}

/// The report's account of `reg`'s handler for `kind`.
fn account(report: &PollerReport, reg: &Registration, kind: OpKind) -> Option<KindAccount> {
    let key = (reg.key().slot(), reg.key().generation());
    report
        .accounts
        .accounts
        .iter()
        .find(|a| a.handler == key && a.kind == kind)
        .copied()
}

fn assert_clean(who: &str, report: &SystemReport) {
    assert!(
        report.is_clean(),
        "{who}: the stop found something wrong:\n{report}"
    );
    for p in &report.pollers {
        for a in &p.accounts.accounts {
            assert_eq!(a.posted, a.completed, "{who}: {a:?}");
            assert!(a.flushed <= a.completed, "{who}: {a:?}");
        }
        for c in &p.cqs {
            assert_eq!(
                (
                    c.stale_wr_ids,
                    c.foreign_wr_ids,
                    c.handler_panics,
                    c.overflows
                ),
                (0, 0, 0, 0),
                "{who}: CQ {}",
                c.name
            );
        }
    }
}

/// The handler's own record agrees with the ledger: per kind, successes
/// plus errors is what was posted, and the flushes it saw are the ledger's.
fn assert_log_matches_ledger(who: &str, log: &Log, reg: &Registration) {
    for kind in [OpKind::Send, OpKind::Recv, OpKind::Write, OpKind::Read] {
        let (ok, err, flush) = log.counts(kind);
        let l = reg.ledger();
        assert_eq!(
            ok + err,
            l.posted(kind),
            "{who}: {kind}: successes + errors == posted"
        );
        assert_eq!(l.completed(kind), l.posted(kind), "{who}: {kind}");
        assert_eq!(flush, l.flushed(kind), "{who}: {kind}: flushes");
    }
}

// ---------------------------------------------------------------------
// Exactly-once delivery: ≥ 100,000 completions, 64 handlers, two CQs on
// one poller, two posting threads.
// ---------------------------------------------------------------------

const EO_HANDLERS: usize = 64;
const EO_ROUNDS: u32 = 800;
const EO_PAIRS: usize = 4;

fn exactly_once<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq0, u0, h0) = B::dispatched_cq(&dev, "eo0", 4096, true);
    let (cq1, u1, h1) = B::dispatched_cq(&dev, "eo1", 4096, true);
    let cqs = [(cq0, h0), (cq1, h1)];
    // EO_PAIRS pairs per CQ; 8 handlers share each pair.
    let pairs: Vec<Vec<(B::Qp, B::Qp)>> = cqs
        .iter()
        .map(|(cq, _)| {
            (0..EO_PAIRS)
                .map(|_| B::pair(&dev, cq, cq, Cap::default()))
                .collect()
        })
        .collect();
    let mr = B::reg_mr(&dev, 8192);
    let thread = poller("eo", mode(mode_name), vec![u0, u1]);
    let handlers: Vec<(Registration, Log)> = (0..EO_HANDLERS)
        .map(|i| {
            let log = Log::default();
            let reg = cqs[i % 2].1.register(Recorder(log.clone())).unwrap();
            (reg, log)
        })
        .collect();
    // Handler i is on CQ i % 2 and pair (i / 2) % EO_PAIRS of it; posting
    // thread (i / 8) % 2 posts for it, so both threads post on every pair
    // at once. Round-robin, each handler with at most 4 (receive, send)
    // rounds in flight: a receive on b, then a send on a (which consumes
    // the oldest receive on b, whichever handler posted it).
    std::thread::scope(|s| {
        for c in 0..2 {
            let (handlers, pairs, mr) = (&handlers, &pairs, &mr);
            s.spawn(move || {
                let mine: Vec<usize> = (0..EO_HANDLERS).filter(|i| (i / 8) % 2 == c).collect();
                let mut next = [0u32; EO_HANDLERS];
                let ssg = [B::sge(mr, 0, 8)];
                let rsg = [B::sge(mr, 4096, 64)];
                let deadline = Instant::now() + support::secs(30);
                loop {
                    let (mut left, mut posted) = (false, false);
                    for &i in &mine {
                        if next[i] == EO_ROUNDS {
                            continue;
                        }
                        left = true;
                        let reg = &handlers[i].0;
                        if reg.ledger().outstanding() >= 8 {
                            continue;
                        }
                        let (a, b) = &pairs[i % 2][(i / 2) % EO_PAIRS];
                        let t = next[i];
                        retry::<B>(|| reg.post_recv(b, &mut [B::recv_wr(t, &rsg)]));
                        retry::<B>(|| reg.post_send(a, &mut [B::send_wr(t, Op::Send, &ssg, true)]));
                        next[i] += 1;
                        posted = true;
                    }
                    if !left {
                        break;
                    }
                    assert!(Instant::now() < deadline, "posting took over 30 s");
                    if !posted {
                        std::thread::yield_now();
                    }
                }
            });
        }
    });
    assert!(
        wait_until(Duration::from_secs(30), || handlers
            .iter()
            .all(|(r, _)| r.ledger().outstanding() == 0)),
        "{}: completions still outstanding after 30 s",
        B::NAME
    );
    // Every round consumes its receive, so the workload ends with each
    // receive queue empty; the stop's verdict names a receive queue left
    // dry for more than DRY_GRACE, and a loaded machine can put that much
    // between a queue's last receive and the stop. A server keeps receives
    // posted: one spare per queue, from a handler of its own, stays there
    // until the stop flushes it.
    let spare_log = Log::default();
    let spares: Vec<Registration> = cqs
        .iter()
        .map(|(_, h)| h.register(Recorder(spare_log.clone())).unwrap())
        .collect();
    let rsg = [B::sge(&mr, 4096, 64)];
    for (c, of_cq) in pairs.iter().enumerate() {
        for (p, (_, b)) in of_cq.iter().enumerate() {
            let tag = (c * EO_PAIRS + p) as u32;
            retry::<B>(|| spares[c].post_recv(b, &mut [B::recv_wr(tag, &rsg)]));
        }
    }
    let report = cqd_core::shutdown(
        || {
            for (_, b) in pairs.iter().flatten() {
                B::to_error(b);
            }
        },
        [thread],
        [],
    );
    assert_clean("exactly_once", &report);
    let mut spare_evs = spare_log.snapshot();
    spare_evs.sort_by_key(|e| e.tag);
    assert_eq!(
        spare_evs
            .iter()
            .map(|e| (e.kind, e.tag, e.status))
            .collect::<Vec<_>>(),
        (0..2 * EO_PAIRS as u32)
            .map(|t| (OpKind::Recv, t, Status::WrFlush))
            .collect::<Vec<_>>(),
        "{}: each spare receive is flushed once, at the stop",
        B::NAME
    );
    let mut total = spare_evs.len();
    for (i, (reg, log)) in handlers.iter().enumerate() {
        let evs = log.snapshot();
        let who = format!("{} handler {i}", B::NAME);
        assert!(evs.iter().all(|e| e.ok), "{who}: an error: {evs:?}");
        assert_each_once(&who, &evs, OpKind::Send, 0..EO_ROUNDS);
        assert_each_once(&who, &evs, OpKind::Recv, 0..EO_ROUNDS);
        assert_log_matches_ledger(&who, log, reg);
        total += evs.len();
    }
    let polled: u64 = report.pollers[0].cqs.iter().map(|c| c.completions).sum();
    assert_eq!(
        polled, total as u64,
        "every polled completion was delivered"
    );
    assert!(total >= 100_000, "{total} completions");
    for (cq, _) in &cqs {
        assert_eq!(B::credits_in_use(cq), 0);
    }
}

// ---------------------------------------------------------------------
// Send and receive on one CQ: both sides of a connection complete on one
// CQ, each to the right callback, with the right data.
// ---------------------------------------------------------------------

fn payload(i: usize) -> Vec<u8> {
    format!("message {i:02} from a").into_bytes()
}

fn send_recv_one_cq<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "one", 1024, true);
    let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
    let (ma, mb) = (B::reg_mr(&dev, 8192), B::reg_mr(&dev, 8192));
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("one", mode(mode_name), vec![u]);
    let len = payload(0).len();
    // 16 receives for the sends, one for the RDMA WRITE with immediate.
    let rsg: Vec<_> = (0..17).map(|i| [B::sge(&mb, i * 64, 64)]).collect();
    let mut rwrs: Vec<_> = rsg
        .iter()
        .enumerate()
        .map(|(i, s)| B::recv_wr(100 + i as u32, s))
        .collect();
    reg.post_recv(&b, &mut rwrs).unwrap();
    for i in 0..16 {
        B::write(&ma, i * 64, &payload(i));
    }
    B::write(&ma, 2048, b"written!");
    B::write(&mb, 4096, b"readback");
    let ssg: Vec<_> = (0..16).map(|i| [B::sge(&ma, i * 64, len as u32)]).collect();
    let (wsg, rdsg) = ([B::sge(&ma, 2048, 8)], [B::sge(&ma, 3072, 8)]);
    let wisg = [B::sge(&ma, 2056, 8)];
    B::write(&ma, 2056, b"with imm");
    let mut swrs: Vec<_> = (0..16u32)
        .map(|i| {
            let op = if i % 2 == 0 {
                Op::Send
            } else {
                Op::SendImm(1000 + i)
            };
            B::send_wr(i, op, &ssg[i as usize], true)
        })
        .collect();
    swrs.push(B::send_wr(16, Op::Write(B::remote(&mb, 2048)), &wsg, true));
    swrs.push(B::send_wr(17, Op::Read(B::remote(&mb, 4096)), &rdsg, true));
    swrs.push(B::send_wr(
        18,
        Op::WriteImm(B::remote(&mb, 2560), 77),
        &wisg,
        true,
    ));
    reg.post_send(&a, &mut swrs).unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || log.len() == 36),
        "{}: {} of 36 completions",
        B::NAME,
        log.len()
    );
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("send_recv_one_cq", &report);
    let evs = log.snapshot();
    assert!(evs.iter().all(|e| e.ok), "{evs:?}");
    assert_each_once("recv", &evs, OpKind::Recv, 100..117);
    assert_each_once("send", &evs, OpKind::Send, 0..16);
    assert_each_once("write", &evs, OpKind::Write, [16, 18]);
    assert_each_once("read", &evs, OpKind::Read, [17]);
    for e in &evs {
        match e.side {
            Side::Recv if e.tag == 116 => {
                // The WRITE with immediate: its bytes at the remote address,
                // its length and immediate in the receive it consumed.
                assert_eq!((e.qp, e.byte_len, e.imm), (B::qpn(&b), 8, Some(77)));
                let mut got = [0u8; 8];
                B::read(&mb, 2560, &mut got);
                assert_eq!(&got, b"with imm");
            }
            Side::Recv => {
                // RC delivers in order: receive 100 + i holds message i.
                let i = (e.tag - 100) as usize;
                assert_eq!(e.qp, B::qpn(&b), "{e:?}");
                assert_eq!(e.byte_len as usize, len, "{e:?}");
                let imm = (i % 2 == 1).then_some(1000 + i as u32);
                assert_eq!(e.imm, imm, "{e:?}");
                let mut got = vec![0u8; len];
                B::read(&mb, i * 64, &mut got);
                assert_eq!(got, payload(i), "receive {i}");
            }
            Side::Send => assert_eq!(e.qp, B::qpn(&a), "{e:?}"),
        }
    }
    let mut got = [0u8; 8];
    B::read(&mb, 2048, &mut got);
    assert_eq!(&got, b"written!");
    B::read(&ma, 3072, &mut got);
    assert_eq!(&got, b"readback");
    assert_eq!(B::credits_in_use(&cq), 0);
    assert_eq!(B::outstanding(&a) + B::outstanding(&b), 0);
}

// ---------------------------------------------------------------------
// A shared receive queue: four QPs draw on one SRQ; each receive reaches
// the handler that posted it, named by the QP that consumed it, with that
// QP's message.
// ---------------------------------------------------------------------

fn srq_shared<B: Backend>(mode_name: &str) {
    const QPS: usize = 4;
    const EACH: usize = 10;
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "srq", 1024, true);
    let srq = B::srq(&dev, 64);
    let pairs: Vec<(B::Qp, B::Qp)> = (0..QPS)
        .map(|_| {
            let a = B::qp(&dev, &cq, &cq, Cap::default());
            let b = B::qp_on_srq(&dev, &cq, &cq, &srq, Cap::default());
            B::connect(&a, &B::endpoint(&b));
            B::connect(&b, &B::endpoint(&a));
            (a, b)
        })
        .collect();
    let (ma, mb) = (B::reg_mr(&dev, 4096), B::reg_mr(&dev, 8192));
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("srq", mode(mode_name), vec![u]);
    let n = QPS * EACH;
    let rsg: Vec<_> = (0..n).map(|i| [B::sge(&mb, i * 64, 64)]).collect();
    let mut r: Vec<_> = (0..n).map(|i| B::srq_recv_wr(i as u32, &rsg[i])).collect();
    reg.post_recv(&srq, &mut r).unwrap();
    // Message k of QP i: 8 bytes naming both.
    let msg = |i: usize, k: usize| [b'q', i as u8, b'm', k as u8, 0xa5, 0x5a, i as u8, k as u8];
    for (i, (a, _)) in pairs.iter().enumerate() {
        for k in 0..EACH {
            B::write(&ma, (i * EACH + k) * 8, &msg(i, k));
        }
        let ssg: Vec<_> = (0..EACH)
            .map(|k| [B::sge(&ma, (i * EACH + k) * 8, 8)])
            .collect();
        let mut s: Vec<_> = (0..EACH)
            .map(|k| B::send_wr(1000 + (i * EACH + k) as u32, Op::Send, &ssg[k], true))
            .collect();
        reg.post_send(a, &mut s).unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(10), || log.len() == 2 * n),
        "{}: {} of {} completions",
        B::NAME,
        log.len(),
        2 * n
    );
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("srq_shared", &report);
    let evs = log.snapshot();
    assert!(evs.iter().all(|e| e.ok), "{evs:?}");
    assert_each_once("srq", &evs, OpKind::Recv, 0..n as u32);
    assert_each_once("srq", &evs, OpKind::Send, (0..n as u32).map(|t| 1000 + t));
    let qpns: Vec<u32> = pairs.iter().map(|(_, b)| B::qpn(b)).collect();
    let mut got: HashMap<(usize, usize), u32> = HashMap::new();
    for e in evs.iter().filter(|e| e.kind == OpKind::Recv) {
        let i = qpns
            .iter()
            .position(|q| *q == e.qp)
            .unwrap_or_else(|| panic!("{}: receive {e:?} names no SRQ user", B::NAME));
        assert_eq!(e.byte_len, 8, "{e:?}");
        let mut buf = [0u8; 8];
        B::read(&mb, e.tag as usize * 64, &mut buf);
        assert_eq!(
            (buf[0], buf[1] as usize),
            (b'q', i),
            "receive {e:?} holds {buf:?}"
        );
        assert_eq!(buf, msg(i, buf[3] as usize), "receive {e:?}");
        *got.entry((i, buf[3] as usize)).or_default() += 1;
    }
    assert_eq!(got.len(), n, "every message arrived once");
    assert!(got.values().all(|c| *c == 1));
    let p = &report.pollers[0];
    let acc = |k| account(p, &reg, k).map(|a| (a.posted, a.completed, a.flushed));
    assert_eq!(acc(OpKind::Recv), Some((n as u64, n as u64, 0)));
    assert_eq!(B::credits_in_use(&cq), 0);
}

// ---------------------------------------------------------------------
// Errors and flushes routed by side: a QP moved to ERR flushes both of its
// queues; errors of either side reach on_error with the side and kind
// given at post time (the device's opcode is undefined there).
// ---------------------------------------------------------------------

fn sorted(mut v: Vec<(Side, OpKind, u32, Status)>) -> Vec<(Side, OpKind, u32, Status)> {
    v.sort_by_key(|e| (e.0 as u8, e.1.index(), e.2));
    v
}

fn errors_by_side<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "err", 1024, true);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("err", mode(mode_name), vec![u]);
    let (a1, b1) = B::pair(&dev, &cq, &cq, Cap::default());
    let (a2, b2) = B::pair(&dev, &cq, &cq, Cap::default());
    let (a3, b3) = B::pair(&dev, &cq, &cq, Cap::default());
    let m = B::reg_mr(&dev, 8192);
    let rs = [B::sge(&m, 0, 64)];
    let ss = [B::sge(&m, 1024, 8)];
    // 1. a1 holds 5 receives (nothing is sent to it) and 3 sends that wait
    //    for receives b1 never posts: ERR flushes both queues.
    let mut r: Vec<_> = (0..5).map(|t| B::recv_wr(t, &rs)).collect();
    reg.post_recv(&a1, &mut r).unwrap();
    let mut s: Vec<_> = (10..13)
        .map(|t| B::send_wr(t, Op::Send, &ss, true))
        .collect();
    reg.post_send(&a1, &mut s).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(log.len(), 0, "nothing completes before the flush");
    assert_eq!(reg.ledger().outstanding(), 8);
    B::to_error(&a1);
    assert!(wait_until(Duration::from_secs(10), || log.len() == 8));
    let mut expected: Vec<_> = (0..5)
        .map(|t| (Side::Recv, OpKind::Recv, t, Status::WrFlush))
        .chain((10..13).map(|t| (Side::Send, OpKind::Send, t, Status::WrFlush)))
        .collect();
    assert_eq!(log.errors(), sorted(expected.clone()), "{}", B::NAME);
    // Posts to a QP in ERR are accepted and flush at once, on their side.
    reg.post_recv(&a1, &mut [B::recv_wr(5, &rs)]).unwrap();
    reg.post_send(&a1, &mut [B::send_wr(13, Op::Send, &ss, true)])
        .unwrap();
    expected.push((Side::Recv, OpKind::Recv, 5, Status::WrFlush));
    expected.push((Side::Send, OpKind::Send, 13, Status::WrFlush));
    if !B::RECV_IN_ERR_FLUSHED {
        // rxe: the send flushed, the receive waits (Backend::
        // RECV_IN_ERR_FLUSHED); it must not complete on its own, and the
        // next move to ERR flushes it.
        assert!(
            wait_until(Duration::from_secs(10), || log.len() == 9),
            "{}: the send posted in ERR: {:?}",
            B::NAME,
            log.errors()
        );
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(log.len(), 9, "{}: {:?}", B::NAME, log.errors());
        support::say(&format!(
            "NOTE: errors_by_side::{}::{mode_name}: a receive posted in ERR was not flushed; moving the QP to ERR again\n",
            B::NAME
        ));
        B::to_error(&a1);
    }
    assert!(
        wait_until(Duration::from_secs(10), || log.len() == 10),
        "{}: posts to a QP in ERR: {:?}",
        B::NAME,
        log.errors()
    );
    assert_eq!(log.errors(), sorted(expected.clone()), "{}", B::NAME);
    // 2. An RDMA WRITE beyond the peer's region: a send-side error.
    let (addr, rkey) = B::remote_parts(B::remote(&m, 0));
    let beyond = B::remote_from(addr + 8192, rkey);
    reg.post_send(&a2, &mut [B::send_wr(20, Op::Write(beyond), &ss, true)])
        .unwrap();
    expected.push((Side::Send, OpKind::Write, 20, Status::RemoteAccess));
    // 3. A receive too short for the message: a receive-side error on b3
    //    and the responder's rejection on a3's send.
    let short = [B::sge(&m, 2048, 4)];
    reg.post_recv(&b3, &mut [B::recv_wr(30, &short)]).unwrap();
    reg.post_send(&a3, &mut [B::send_wr(31, Op::Send, &ss, true)])
        .unwrap();
    // (rxe 6.1 reports other statuses for it: Backend::SHORT_RECV.)
    let (recv_status, send_status) = B::SHORT_RECV;
    expected.push((Side::Recv, OpKind::Recv, 30, recv_status));
    expected.push((Side::Send, OpKind::Send, 31, send_status));
    assert!(wait_until(Duration::from_secs(10), || log.len() == 13));
    assert_eq!(log.errors(), sorted(expected), "{}", B::NAME);
    assert!(log.snapshot().iter().all(|e| !e.ok), "no success expected");
    let qps = [&a1, &b1, &a2, &b2, &a3, &b3];
    let report = cqd_core::shutdown(
        || {
            for q in qps {
                B::to_error(q);
            }
        },
        [t],
        [],
    );
    assert_clean("errors_by_side", &report);
    let p = &report.pollers[0];
    let acc = |k| account(p, &reg, k).map(|a| (a.posted, a.completed, a.flushed));
    assert_eq!(acc(OpKind::Send), Some((5, 5, 4)));
    assert_eq!(acc(OpKind::Recv), Some((7, 7, 6)));
    assert_eq!(acc(OpKind::Write), Some((1, 1, 0)));
    assert_log_matches_ledger("errors_by_side", &log, &reg);
    assert_eq!(p.cqs[0].flushes, 10);
}

// ---------------------------------------------------------------------
// Unsignaled sends: retired by the next signaled completion of their
// queue; flushed each exactly once when their QP goes to ERR.
// ---------------------------------------------------------------------

fn unsignaled<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "unsig", 1024, true);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("unsig", mode(mode_name), vec![u]);
    let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
    let (c, d) = B::pair(&dev, &cq, &cq, Cap::default());
    let m = B::reg_mr(&dev, 4096);
    let src = [B::sge(&m, 0, 8)];
    let dst = B::remote(&m, 1024);
    for round in 0..50u32 {
        let base = round * 4;
        retry::<B>(|| {
            let mut l: Vec<_> = (0..4)
                .map(|k| B::send_wr(base + k, Op::Write(dst), &src, k == 3))
                .collect();
            reg.post_send(&a, &mut l)
        });
    }
    assert!(
        wait_until(Duration::from_secs(10), || reg
            .ledger()
            .completed(OpKind::Write)
            == 200),
        "{}: {} of 200 writes retired",
        B::NAME,
        reg.ledger().completed(OpKind::Write)
    );
    let evs = log.snapshot();
    assert_eq!(evs.len(), 50, "one completion per signaled write");
    assert!(evs.iter().all(|e| e.ok && e.kind == OpKind::Write));
    assert_each_once("signaled", &evs, OpKind::Write, (0..50).map(|r| r * 4 + 3));
    assert_eq!(B::outstanding(&a), 0, "the unsignaled writes were retired");
    assert_eq!(B::credits_in_use(&cq), 0);
    // Another handler's unsignaled writes on the same send queue are
    // retired by this handler's next signaled one, in both ledgers; the
    // other handler, unregistered meanwhile, retires once they are.
    let x = h.register(Recorder(Log::default())).unwrap();
    let mut l: Vec<_> = (500..503)
        .map(|t| B::send_wr(t, Op::Write(dst), &src, false))
        .collect();
    x.post_send(&a, &mut l).unwrap();
    h.unregister(x.key()).unwrap();
    std::thread::sleep(Duration::from_millis(10));
    assert_eq!(x.ledger().outstanding(), 3, "no completion of their own");
    assert_eq!(h.snapshot().handlers_live, 2, "retiring, not gone");
    reg.post_send(&a, &mut [B::send_wr(600, Op::Write(dst), &src, true)])
        .unwrap();
    assert!(
        wait_until(Duration::from_secs(10), || x.ledger().outstanding() == 0
            && h.snapshot().handlers_live == 1),
        "{}: the other handler's unsignaled writes were not retired",
        B::NAME
    );
    assert_eq!(x.ledger().completed(OpKind::Write), 3);
    assert!(wait_until(Duration::from_secs(10), || log.len() == 51));
    // Unsignaled sends waiting for receives d never posts: each flushes
    // exactly once (an error always completes).
    let mut l: Vec<_> = (1000..1004)
        .map(|t| B::send_wr(t, Op::Send, &src, false))
        .collect();
    reg.post_send(&c, &mut l).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(reg.ledger().outstanding(), 4, "nothing hidden: 4 in flight");
    B::to_error(&c);
    assert!(wait_until(Duration::from_secs(10), || log.len() == 55));
    let flushed: Vec<_> = (1000..1004)
        .map(|t| (Side::Send, OpKind::Send, t, Status::WrFlush))
        .collect();
    assert_eq!(log.errors(), flushed);
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("unsignaled", &report);
    let p = &report.pollers[0];
    let acc = |k| account(p, &reg, k).map(|a| (a.posted, a.completed, a.flushed));
    assert_eq!(acc(OpKind::Write), Some((201, 201, 0)));
    assert_eq!(acc(OpKind::Send), Some((4, 4, 4)));
    assert_eq!(B::credits_in_use(&cq), 0);
    drop((b, d));
}

// ---------------------------------------------------------------------
// Drain and shutdown accounting: 8 handlers on two CQs, every kind, some
// of it outstanding at shutdown; the flush and the drain account for all
// of it, per handler and kind.
// ---------------------------------------------------------------------

fn drain_and_shutdown<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq0, u0, h0) = B::dispatched_cq(&dev, "drain0", 1024, true);
    let (cq1, u1, h1) = B::dispatched_cq(&dev, "drain1", 1024, true);
    let pairs = [
        B::pair(&dev, &cq0, &cq0, Cap::default()),
        B::pair(&dev, &cq1, &cq1, Cap::default()),
    ];
    let t = poller("drain", mode(mode_name), vec![u0, u1]);
    let m = B::reg_mr(&dev, 16384);
    let handlers: Vec<(Registration, Log)> = (0..8)
        .map(|i| {
            let log = Log::default();
            let h = if i < 4 { &h0 } else { &h1 };
            (h.register(Recorder(log.clone())).unwrap(), log)
        })
        .collect();
    let (ss, rs) = ([B::sge(&m, 0, 8)], [B::sge(&m, 8192, 64)]);
    let (wsg, rdsg) = ([B::sge(&m, 64, 8)], [B::sge(&m, 4096, 8)]);
    for (i, (reg, _)) in handlers.iter().enumerate() {
        let (a, b) = &pairs[i / 4];
        // 5 receives on b and 3 sends a → b: per pair 20 receives, 12 used.
        let mut r: Vec<_> = (0..5).map(|t| B::recv_wr(t, &rs)).collect();
        reg.post_recv(b, &mut r).unwrap();
        let mut s: Vec<_> = (10..13)
            .map(|t| B::send_wr(t, Op::Send, &ss, true))
            .collect();
        reg.post_send(a, &mut s).unwrap();
        // 2 writes and 2 reads a → b.
        let mut w: Vec<_> = (20..22)
            .map(|t| B::send_wr(t, Op::Write(B::remote(&m, 512)), &wsg, true))
            .chain((30..32).map(|t| B::send_wr(t, Op::Read(B::remote(&m, 1024)), &rdsg, true)))
            .collect();
        reg.post_send(a, &mut w).unwrap();
        // 2 sends b → a, which has no receive: they wait until the flush.
        let mut s: Vec<_> = (40..42)
            .map(|t| B::send_wr(t, Op::Send, &ss, true))
            .collect();
        reg.post_send(b, &mut s).unwrap();
    }
    // Per pair: 12 sends, 12 receives, 8 writes and 8 reads succeed.
    let ok = || {
        handlers
            .iter()
            .map(|(_, l)| l.snapshot().iter().filter(|e| e.ok).count())
            .sum::<usize>()
    };
    assert!(
        wait_until(Duration::from_secs(10), || ok() == 80),
        "{}: {} of 80 successes",
        B::NAME,
        ok()
    );
    let outstanding: u64 = handlers.iter().map(|(r, _)| r.ledger().outstanding()).sum();
    assert_eq!(
        outstanding,
        2 * 8 + 8 * 2,
        "8 receives per pair and 2 sends per handler wait"
    );
    // One handler per CQ is unregistered with work outstanding: it keeps
    // receiving its completions (the flushes) and retires once they came.
    h0.unregister(handlers[0].0.key()).unwrap();
    h1.unregister(handlers[4].0.key()).unwrap();
    // The flush: b first, so its waiting sends flush (rather than fail on a
    // peer already in error), then a.
    let report = cqd_core::shutdown(
        || {
            for (a, b) in &pairs {
                B::to_error(b);
                B::to_error(a);
            }
        },
        [t],
        [],
    );
    assert_clean("drain_and_shutdown", &report);
    let p = &report.pollers[0];
    let mut flushed = HashMap::new();
    for (i, (reg, log)) in handlers.iter().enumerate() {
        let who = format!("{} handler {i}", B::NAME);
        assert_log_matches_ledger(&who, log, reg);
        assert!(
            log.snapshot()
                .iter()
                .all(|e| e.ok || e.status == Status::WrFlush),
            "{who}: only flushes fail"
        );
        for (kind, posted) in [
            (OpKind::Send, 5),
            (OpKind::Recv, 5),
            (OpKind::Write, 2),
            (OpKind::Read, 2),
        ] {
            let (n_posted, n_completed, n_flushed) = match account(p, reg, kind) {
                Some(a) => (a.posted, a.completed, a.flushed),
                None => {
                    // Retired handlers leave the report (balanced by
                    // definition); their ledger is final.
                    assert!(i % 4 == 0, "{who}: no {kind} account");
                    let l = reg.ledger();
                    (l.posted(kind), l.completed(kind), l.flushed(kind))
                }
            };
            assert_eq!((n_posted, n_completed), (posted, posted), "{who}: {kind}");
            *flushed.entry(kind).or_insert(0) += n_flushed;
        }
    }
    for c in &p.cqs {
        assert_eq!(
            (c.unregistrations, c.handlers_live),
            (1, 3),
            "{}: the unregistered handler retired after its flushes",
            c.name
        );
    }
    assert_eq!(flushed[&OpKind::Send], 16, "the waiting b → a sends");
    assert_eq!(flushed[&OpKind::Recv], 16, "the unused receives");
    assert_eq!(flushed[&OpKind::Write] + flushed[&OpKind::Read], 0);
}

// ---------------------------------------------------------------------
// Stop with 10,000 requests in flight: traffic running, 10,000 receives
// parked; the stop (flush, drain) loses nothing.
// ---------------------------------------------------------------------

const PARK_PAIRS: usize = 10;
const PARKED: u32 = 1000;

fn stop_in_flight<B: Backend>(mode_name: &str) {
    let dev = B::open();
    // 32,768 entries, or the device's most (rxe: 32,767); both admit the
    // 21,760 the queues below need.
    let cqe = 32768.min(B::max_cqe(&dev));
    let (cq, u, h) = B::dispatched_cq(&dev, "stop", cqe, true);
    // Depths the device grants as asked (softverbs rounds up to a power
    // of two: 1024 is exact).
    let cap = Cap {
        send: 64,
        recv: 1024,
    };
    let pairs: Arc<Vec<(B::Qp, B::Qp)>> = Arc::new(
        (0..PARK_PAIRS)
            .map(|_| B::pair(&dev, &cq, &cq, cap))
            .collect(),
    );
    let m = Arc::new(B::reg_mr(&dev, 8192));
    // The poller thread notes its kernel thread id first thing, so that
    // the end can check it is gone.
    let name = format!("stop-{}-{mode_name}", B::NAME);
    let tid = Arc::new(std::sync::atomic::AtomicI32::new(0));
    let t = {
        let tid = Arc::clone(&tid);
        cqd_core::PollerBuilder::new(name.as_str(), cqd_core::NoSink)
            .mode(mode(mode_name))
            .wake_timeout(Duration::from_millis(50))
            .drain_timeout(Duration::from_secs(10))
            .stop_timeout(Duration::from_secs(5))
            .on_start(move || {
                // SAFETY: gettid has no preconditions.
                tid.store(unsafe { libc::gettid() }, Ordering::Release);
                Ok(())
            })
            .cq(u)
            .spawn()
            .expect("spawn the poller")
    };
    let tid = tid.load(Ordering::Acquire);
    assert!(thread_alive(tid), "{name}: the poller thread runs as {tid}");
    let handlers: Vec<(Registration, Log)> = (0..PARK_PAIRS)
        .map(|_| {
            let log = Log::default();
            (h.register(Recorder(log.clone())).unwrap(), log)
        })
        .collect();
    // 1000 receives parked on each a, which is never sent to.
    for (i, (reg, _)) in handlers.iter().enumerate() {
        let rs = [B::sge(&m, 0, 64)];
        let mut r: Vec<_> = (0..PARKED).map(|t| B::recv_wr(t, &rs)).collect();
        reg.post_recv(&pairs[i].0, &mut r).unwrap();
    }
    // Traffic a → b until told to stop, at most 16 in flight per handler.
    let stop = Arc::new(AtomicBool::new(false));
    let poster = {
        let (pairs, m, stop) = (Arc::clone(&pairs), Arc::clone(&m), Arc::clone(&stop));
        let regs: Vec<Registration> = handlers.iter().map(|(r, _)| r.clone()).collect();
        std::thread::spawn(move || {
            let (ss, rs) = ([B::sge(&m, 0, 8)], [B::sge(&m, 4096, 64)]);
            let mut next = vec![PARKED; PARK_PAIRS];
            while !stop.load(Ordering::Acquire) {
                let mut posted = false;
                for (i, reg) in regs.iter().enumerate() {
                    if reg.ledger().outstanding() >= u64::from(PARKED) + 16 {
                        continue;
                    }
                    let (a, b) = &pairs[i];
                    let t = next[i];
                    retry::<B>(|| reg.post_recv(b, &mut [B::recv_wr(t, &rs)]));
                    retry::<B>(|| reg.post_send(a, &mut [B::send_wr(t, Op::Send, &ss, true)]));
                    next[i] += 1;
                    posted = true;
                }
                if !posted {
                    std::thread::yield_now();
                }
            }
            next
        })
    };
    assert!(
        wait_until(Duration::from_secs(10), || handlers
            .iter()
            .map(|(_, l)| l.len())
            .sum::<usize>()
            >= 2000),
        "traffic flows"
    );
    let mut sent = Vec::new();
    let mut in_flight = 0;
    let report = cqd_core::shutdown(
        || {
            stop.store(true, Ordering::Release);
            sent = poster.join().expect("the posting thread");
            in_flight = handlers.iter().map(|(r, _)| r.ledger().outstanding()).sum();
            for (a, b) in pairs.iter() {
                B::to_error(b);
                B::to_error(a);
            }
        },
        [t],
        [],
    );
    assert!(in_flight >= 10_000, "{in_flight} in flight at the stop");
    assert_clean("stop_in_flight", &report);
    let p = &report.pollers[0];
    // Nothing left running, nothing left unacknowledged: the poller's
    // thread is gone (the posting thread was joined in the flush step), it
    // acknowledged every notification it took and so could destroy its CQ.
    // A joined thread's task entry can outlive the join by a moment (the
    // join is woken at the thread's exit, before the kernel releases the
    // task): gone within the bound, or leaked.
    assert!(
        wait_until(Duration::from_secs(5), || !thread_alive(tid)),
        "{name}: the poller thread {tid} leaked"
    );
    assert!(p.errors.is_empty(), "{name}: {:?}", p.errors);
    let c = &p.cqs[0];
    assert_eq!(c.acks, c.events, "{name}: every notification acked");
    let mut flushed = 0;
    for (i, (reg, log)) in handlers.iter().enumerate() {
        let who = format!("{} handler {i}", B::NAME);
        assert_log_matches_ledger(&who, log, reg);
        let evs = log.snapshot();
        let mut per: HashMap<(OpKind, u32), u32> = HashMap::new();
        for e in &evs {
            *per.entry((e.kind, e.tag)).or_default() += 1;
        }
        assert!(per.values().all(|n| *n == 1), "{who}: a duplicate");
        for t in 0..sent[i] {
            assert!(per.contains_key(&(OpKind::Recv, t)), "{who}: recv {t} lost");
        }
        for t in PARKED..sent[i] {
            assert!(per.contains_key(&(OpKind::Send, t)), "{who}: send {t} lost");
        }
        assert_eq!(per.len() as u32, sent[i] + (sent[i] - PARKED), "{who}");
        flushed += account(p, reg, OpKind::Recv).map_or(0, |a| a.flushed);
    }
    assert!(flushed >= 10_000, "{flushed} receives flushed");
}

/// Whether this process still has a thread `tid` (a cqd poller: its name
/// starts `cqd-poller`, so a thread id reused by another thread in the
/// meantime is not taken for it).
fn thread_alive(tid: i32) -> bool {
    std::fs::read(format!("/proc/self/task/{tid}/comm"))
        .is_ok_and(|comm| comm.starts_with(b"cqd-poller"))
}

// ---------------------------------------------------------------------
// A QP's life ends while its CQ's poller runs: flushed, drained and
// dropped, its accounts leave the CQ's ledger and a new QP takes over; or
// dropped with requests outstanding, which must not leave them
// unaccounted for.
// ---------------------------------------------------------------------

fn qp_dropped_after_flush<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "drop", 256, true);
    let m = B::reg_mr(&dev, 4096);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("drop", mode(mode_name), vec![u]);
    let rs = [B::sge(&m, 0, 64)];
    let src = [B::sge(&m, 1024, 8)];
    for round in 0..5u32 {
        let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
        let base = round * 10;
        let mut r: Vec<_> = (base..base + 5).map(|t| B::recv_wr(t, &rs)).collect();
        reg.post_recv(&b, &mut r).unwrap();
        reg.post_send(&a, &mut [B::send_wr(base, Op::Send, &src, true)])
            .unwrap();
        // The documented end of a connection: ERR, wait for the poller to
        // retire everything, drop.
        B::to_error(&b);
        B::to_error(&a);
        assert!(
            wait_until(Duration::from_secs(10), || B::outstanding(&a)
                + B::outstanding(&b)
                == 0),
            "{}: round {round}: the flushes were not retired",
            B::NAME
        );
        drop((a, b));
    }
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("qp_dropped_after_flush", &report);
    let p = &report.pollers[0];
    let acc = |k| account(p, &reg, k).map(|a| (a.posted, a.completed, a.flushed));
    assert_eq!(acc(OpKind::Recv), Some((25, 25, 20)));
    assert_eq!(acc(OpKind::Send), Some((5, 5, 0)));
    assert_eq!(B::credits_in_use(&cq), 0);
}

fn qp_dropped_unflushed<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "drop-unflushed", 256, true);
    let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
    let m = B::reg_mr(&dev, 4096);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller_with("drop", mode(mode_name), vec![u], Duration::from_secs(2));
    let rs = [B::sge(&m, 0, 64)];
    let mut r: Vec<_> = (0..5).map(|t| B::recv_wr(t, &rs)).collect();
    reg.post_recv(&b, &mut r).unwrap();
    // Dropped with 5 receives outstanding, no flush first.
    drop(b);
    let report = within("stopping", Duration::from_secs(10), move || {
        cqd_core::shutdown(|| {}, [t], [])
    });
    assert!(
        report.is_clean(),
        "{}: receives of a dropped QP left unaccounted for: {}",
        B::NAME,
        report.pollers[0].accounts
    );
    assert_eq!(
        log.errors(),
        (0..5)
            .map(|t| (Side::Recv, OpKind::Recv, t, Status::WrFlush))
            .collect::<Vec<_>>()
    );
    drop((a, cq));
}

/// A QP dropped right after requests that completed unannounced (its
/// send queue's last requests unsignaled): no completion of their own and
/// none after them will retire them, so the backend closes the queue's
/// order with a drain marker, whose flush retires them as completed.
/// Nothing is reported missing, the credits come back, and no user
/// handler sees the marker.
fn qp_dropped_with_silent_tail<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "silent-tail", 256, true);
    let m = B::reg_mr(&dev, 4096);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller_with("tail", mode(mode_name), vec![u], Duration::from_secs(2));
    let src = [B::sge(&m, 0, 8)];
    for round in 0..3u32 {
        let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
        let dst = B::remote(&m, 1024);
        let base = round * 10;
        // A signaled write, then three unsignaled ones: the signaled one
        // completes, the others run silently.
        let mut l: Vec<_> = (base..base + 4)
            .map(|t| B::send_wr(t, Op::Write(dst), &src, t == base))
            .collect();
        reg.post_send(&a, &mut l).unwrap();
        assert!(
            wait_until(Duration::from_secs(10), || log.len() == round as usize + 1),
            "{}: round {round}: the signaled write did not complete",
            B::NAME
        );
        // Let the unsignaled ones run (nothing will announce them).
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(B::outstanding(&a), 3, "the silent tail is outstanding");
        drop((a, b));
        // Retired, and the QP gone: both backends destroy it at the poll
        // after the marker's flush is accounted, its admission with it
        // (the next pair needs that admission: wait for it, not only for
        // the accounts).
        assert!(
            wait_until(Duration::from_secs(10), || reg.ledger().outstanding() == 0
                && B::reserved(&cq) == 0),
            "{}: round {round}: the silent tail of a dropped QP was never retired ({} outstanding), or the QP never went ({} CQ entries still admitted)",
            B::NAME,
            reg.ledger().outstanding(),
            B::reserved(&cq)
        );
    }
    let report = within("stopping", Duration::from_secs(10), move || {
        cqd_core::shutdown(|| {}, [t], [])
    });
    assert_clean("qp_dropped_with_silent_tail", &report);
    let p = &report.pollers[0];
    let acc = |k| account(p, &reg, k).map(|a| (a.posted, a.completed, a.flushed));
    assert_eq!(acc(OpKind::Write), Some((12, 12, 0)));
    assert!(
        log.errors().is_empty(),
        "no handler saw a flush: {:?}",
        log.errors()
    );
    assert_eq!(
        log.len(),
        3,
        "one completion per signaled write, nothing else"
    );
    assert_eq!(B::credits_in_use(&cq), 0);
}

// ---------------------------------------------------------------------
// Overflow with admission off: the CQ error event reaches the poller and
// is counted as an overflow; the stop reports exactly what was lost.
// ---------------------------------------------------------------------

fn overflow<B: Backend>(mode_name: &str) {
    const N: u32 = 512;
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "tiny", 4, false);
    let (a, b) = B::pair(&dev, &cq, &cq, Cap { send: N, recv: 4 });
    let m = B::reg_mr(&dev, 4096);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let src = [B::sge(&m, 0, 8)];
    let mut l: Vec<_> = (0..N)
        .map(|t| B::send_wr(t, Op::Write(B::remote(&m, 1024)), &src, true))
        .collect();
    reg.post_send(&a, &mut l).unwrap();
    // The poller starts only once the device has had time to run ahead of
    // it. A device that completes inside the post (the simulator,
    // softverbs) has already overflowed the CQ; one that completes
    // asynchronously (rxe) might otherwise meet a poller that keeps up
    // with it, and never overflow (seen once in CI, hybrid mode on rxe).
    std::thread::sleep(Duration::from_millis(25) * support::slow());
    let t = poller_with(
        "overflow",
        mode(mode_name),
        vec![u],
        Duration::from_millis(300),
    );
    assert!(
        wait_until(Duration::from_secs(5), || h.snapshot().overflows >= 1),
        "{}: {N} completions into a CQ of {}: no overflow reached the poller ({:?})",
        B::NAME,
        B::capacity(&cq),
        h.snapshot()
    );
    let snap = h.snapshot();
    assert!(snap.in_error, "the CQ is in the error state");
    assert!(snap.async_events >= 1);
    assert!(B::budget_overflows(&cq) >= 1, "the budget counts it too");
    let report = cqd_core::shutdown(|| B::to_error(&a), [t], []);
    let p = &report.pollers[0];
    assert!(p.cqs[0].overflows >= 1);
    let delivered = log.len() as u64;
    assert!(delivered < u64::from(N), "completions were lost");
    let w = account(p, &reg, OpKind::Write).expect("the writes' account");
    assert_eq!(w.posted, u64::from(N));
    if B::OVERFLOW_STICKY {
        // Nothing arrives after the overflow: the report counts what the
        // handler got and names every lost write as missing.
        assert_eq!(w.completed, delivered, "the report counts what arrived");
        assert_eq!(w.missing(), u64::from(N) - delivered);
        assert!(!report.is_clean(), "lost writes are never a clean stop");
    } else {
        // The CQ produces again once polled: a later write's completion
        // retires the earlier ones by the send queue's in-order rule
        // (cqd_core::account, rule 2), the lost signaled ones included,
        // so the ledger counts at least what arrived.
        assert!(w.completed >= delivered, "{w:?}, {delivered} delivered");
    }
    // Either way, an overflow is never a clean stop.
    assert!(!report.is_clean(), "an overflow is never a clean stop");
    drop(b);
}

// ---------------------------------------------------------------------
// Destroy with unacknowledged events: refused (never a hang) while a
// notification is unacked, clean after the ack; and a poller that stops
// with notifications pending acks them before it destroys its CQ.
// ---------------------------------------------------------------------

fn destroy_unacked<B: Backend>(_: &str) {
    within(
        "destroy with unacked events",
        Duration::from_secs(20),
        || {
            let dev = B::open();
            let (cq, source) = B::cq(&dev, "unacked", 256, true);
            let spy = Spy::new(source);
            let side = spy.side();
            let (unbound, handle) = split::<NoWork>(spy, CqOptions::default()).unwrap();
            let log = Log::default();
            let reg = handle.register(Recorder(log)).unwrap();
            let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
            let m = B::reg_mr(&dev, 4096);
            let lock = || side.lock().unwrap_or_else(|p| p.into_inner());
            lock().arm(ArmKind::Next).unwrap();
            let src = [B::sge(&m, 0, 8)];
            reg.post_send(
                &a,
                &mut [B::send_wr(1, Op::Write(B::remote(&m, 64)), &src, true)],
            )
            .unwrap();
            assert!(
                readable(lock().event_fd(), Duration::from_secs(5)),
                "the armed CQ notifies"
            );
            let mut n = 0;
            assert!(wait_until(Duration::from_secs(5), || {
                n += lock().take_events().unwrap();
                n >= 1
            }));
            assert_eq!(lock().unacked_events(), n);
            match lock().destroy() {
                Err(SourceError::UnackedEvents { unacked }) => assert_eq!(unacked, n),
                other => panic!("destroy with {n} unacked events: {other:?}"),
            }
            lock().ack_events(n).unwrap();
            assert_eq!(lock().unacked_events(), 0);
            lock().destroy().expect("destroy after the ack");
            // The rest goes without a hang: the polling right (its finish
            // destroys again, a no-op), the QPs, the CQ, the device.
            drop(unbound);
            drop((a, b, m, cq, dev));
        },
    );
}

fn events_acked_at_stop<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "acked", 256, true);
    let (a, _b) = B::pair(&dev, &cq, &cq, Cap::default());
    let m = B::reg_mr(&dev, 4096);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("acked", mode(mode_name), vec![u]);
    let src = [B::sge(&m, 0, 8)];
    // Ten bursts 5 ms apart: the poller sleeps between them and each wakes
    // it with a notification (fewer than the ack batch of 16: some are
    // still unacked at the stop).
    for burst in 0..10 {
        std::thread::sleep(Duration::from_millis(5));
        let mut l: Vec<_> = (0..4)
            .map(|k| B::send_wr(burst * 4 + k, Op::Write(B::remote(&m, 64)), &src, true))
            .collect();
        reg.post_send(&a, &mut l).unwrap();
    }
    assert!(wait_until(Duration::from_secs(10), || log.len() == 40));
    let report = within(
        "a stop with unacked events",
        Duration::from_secs(10),
        move || cqd_core::shutdown(|| {}, [t], []),
    );
    assert_clean("events_acked_at_stop", &report);
    let c = &report.pollers[0].cqs[0];
    assert!(
        c.events >= 1,
        "{}: the poller slept on notifications",
        B::NAME
    );
    assert_eq!(c.acks, c.events, "every notification was acked");
    assert!(report.pollers[0].errors.is_empty(), "the CQ was destroyed");
}

// ---------------------------------------------------------------------
// CQs sharing one completion channel: one descriptor for the poller,
// each notification taken and acknowledged by its own CQ, each completion
// to its own CQ's handler.
// ---------------------------------------------------------------------

fn shared_channel<B: Backend>(mode_name: &str) {
    const CQS: usize = 4;
    let dev = B::open();
    let chan = B::channel(&dev);
    let mut unbound = Vec::new();
    let mut cqs = Vec::new();
    for k in 0..CQS {
        let (cq, u, h) = B::dispatched_cq_on(&dev, &format!("shared{k}"), 256, &chan);
        let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
        let log = Log::default();
        let reg = h.register(Recorder(log.clone())).unwrap();
        unbound.push(u);
        cqs.push((cq, a, b, reg, log));
    }
    let t = poller("shared", mode(mode_name), unbound);
    let m = B::reg_mr(&dev, 4096);
    let src = [B::sge(&m, 0, 8)];
    // Bursts 3 ms apart, each on one CQ: the poller sleeps in between (but
    // in Busy mode) and the channel says which CQ woke it.
    for burst in 0..20u32 {
        std::thread::sleep(Duration::from_millis(3));
        let (_, a, _, reg, _) = &cqs[burst as usize % CQS];
        let mut l: Vec<_> = (0..2)
            .map(|k| B::send_wr(burst * 2 + k, Op::Write(B::remote(&m, 64)), &src, true))
            .collect();
        reg.post_send(a, &mut l).unwrap();
    }
    assert!(
        wait_until(Duration::from_secs(10), || cqs
            .iter()
            .map(|c| c.4.len())
            .sum::<usize>()
            == 40),
        "{}: completions missing",
        B::NAME
    );
    let report = within("stopping", Duration::from_secs(10), move || {
        cqd_core::shutdown(|| {}, [t], [])
    });
    assert_clean("shared_channel", &report);
    for (k, (_, a, _, _, log)) in cqs.iter().enumerate() {
        let evs = log.snapshot();
        let tags = (0..20u32)
            .filter(|b| *b as usize % CQS == k)
            .flat_map(|b| [b * 2, b * 2 + 1]);
        assert_each_once(&format!("CQ {k}"), &evs, OpKind::Write, tags);
        assert!(evs.iter().all(|e| e.ok && e.qp == B::qpn(a)), "CQ {k}");
    }
    let c = &report.pollers[0].cqs;
    let events: u64 = c.iter().map(|c| c.events).sum();
    for c in c {
        assert_eq!(c.acks, c.events, "{}: every notification acked", c.name);
    }
    if mode_name == "busy" {
        assert_eq!(events, 0, "Busy never arms");
    } else {
        assert!(events >= 1, "{}: the poller slept on the channel", B::NAME);
    }
}

// ---------------------------------------------------------------------
// A device that goes away: its poller sees DeviceGone and DeviceFatal,
// posts fail and change nothing, a peer's request fails, and nothing
// hangs; the stop names what died with the device.
// ---------------------------------------------------------------------

fn device_gone<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let peer = B::open_peer(&dev);
    let (cq, u, h) = B::dispatched_cq(&dev, "gone", 256, true);
    let (pcq, pu, ph) = B::dispatched_cq(&peer, "peer", 256, true);
    let a = B::qp(&dev, &cq, &cq, Cap::default());
    let p = B::qp(&peer, &pcq, &pcq, Cap::default());
    B::connect(&a, &B::endpoint(&p));
    B::connect(&p, &B::endpoint(&a));
    let (m, pm) = (B::reg_mr(&dev, 4096), B::reg_mr(&peer, 4096));
    let (log, plog) = (Log::default(), Log::default());
    let reg = h.register(Recorder(log.clone())).unwrap();
    let preg = ph.register(Recorder(plog.clone())).unwrap();
    let t = poller_with("gone", mode(mode_name), vec![u], Duration::from_millis(300));
    let pt = poller("peer", mode(mode_name), vec![pu]);
    // Before: one message a → p.
    let (src, psrc) = ([B::sge(&m, 0, 8)], [B::sge(&pm, 0, 64)]);
    preg.post_recv(&p, &mut [B::recv_wr(1, &psrc)]).unwrap();
    reg.post_send(&a, &mut [B::send_wr(2, Op::Send, &src, true)])
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || log.len() == 1
        && plog.len() == 1));
    // Ten receives parked on a, then the device dies.
    let rs = [B::sge(&m, 1024, 64)];
    let mut r: Vec<_> = (10..20).map(|t| B::recv_wr(t, &rs)).collect();
    reg.post_recv(&a, &mut r).unwrap();
    B::kill(&dev);
    assert!(
        wait_until(Duration::from_secs(5), || {
            let s = h.snapshot();
            s.async_events >= 1 && s.poll_errors + s.arm_errors >= 1
        }),
        "{}: the poller saw neither the fatal event nor a failing poll: {:?}",
        B::NAME,
        h.snapshot()
    );
    // A post on the dead device fails and leaves the ledger as it was.
    let before = reg.ledger().posted(OpKind::Recv);
    assert!(reg.post_recv(&a, &mut [B::recv_wr(30, &rs)]).is_err());
    assert_eq!(reg.ledger().posted(OpKind::Recv), before);
    // The peer's request to the dead QP fails.
    preg.post_send(&p, &mut [B::send_wr(3, Op::Send, &psrc, true)])
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || plog.len() == 2));
    assert_eq!(
        plog.errors(),
        vec![(Side::Send, OpKind::Send, 3, Status::RetryExceeded)]
    );
    // Nothing hangs: both stop, the dead one after its drain timeout.
    let (report, preport) = within("stopping", Duration::from_secs(15), move || {
        let r = t.stop().expect("the dead device's poller");
        let pr = pt.stop_with(|| B::to_error(&p)).expect("the peer's poller");
        (r, pr)
    });
    assert!(preport.accounts.is_balanced(), "{}", preport.accounts);
    assert!(report.accounts.timed_out, "the parked receives never come");
    let recv = account(&report, &reg, OpKind::Recv).expect("receives");
    assert_eq!(
        (recv.posted, recv.completed, recv.missing()),
        (10, 0, 10),
        "no completion after a fatal error: the report names the 10 receives"
    );
    assert!(report.cqs[0].async_events >= 1);
    drop((a, cq, pcq));
}

/// A dead device's CQ in a poller's group with a living device's CQ: the
/// dead one must not hold the group back (a failing source makes a
/// poller back off for a tenth of its wake timeout when nothing else had
/// work; a CQ whose device is gone leaves the active list for that).
fn device_gone_group<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let peer = B::open_peer(&dev);
    let (dcq, du, dh) = B::dispatched_cq(&dev, "dying", 256, true);
    let (lcq, lu, lh) = B::dispatched_cq(&peer, "living", 256, true);
    let (da, db) = B::pair(&dev, &dcq, &dcq, Cap::default());
    let (la, lb) = B::pair(&peer, &lcq, &lcq, Cap::default());
    let (dm, lm) = (B::reg_mr(&dev, 4096), B::reg_mr(&peer, 4096));
    let (dlog, llog) = (Log::default(), Log::default());
    let dreg = dh.register(Recorder(dlog.clone())).unwrap();
    let lreg = lh.register(Recorder(llog.clone())).unwrap();
    // Back-off pauses of 10 ms: 100 round trips held back by them would
    // take a second.
    let t = cqd_core::PollerBuilder::new("group", cqd_core::NoSink)
        .mode(mode(mode_name))
        .wake_timeout(Duration::from_millis(100))
        .drain_timeout(Duration::from_millis(300))
        .cq(du)
        .cq(lu)
        .spawn()
        .expect("spawn the poller");
    let rs = [B::sge(&dm, 0, 64)];
    let mut r: Vec<_> = (0..4).map(|t| B::recv_wr(t, &rs)).collect();
    dreg.post_recv(&da, &mut r).unwrap();
    B::kill(&dev);
    // Known gone, and noticed by the poller.
    assert!(wait_until(Duration::from_secs(5), || B::is_gone(&dev)
        && dh.snapshot().poll_errors + dh.snapshot().arm_errors >= 1));
    let src = [B::sge(&lm, 0, 8)];
    // Every back-off the failing CQ causes is counted (`backoffs`); a CQ
    // known to be in error leaves the active set, so the living CQ's round
    // trips must not be paced by them.
    let backoffs = || t.snapshot().backoffs;
    let before = backoffs();
    for i in 0..100u32 {
        lreg.post_send(
            &la,
            &mut [B::send_wr(i, Op::Write(B::remote(&lm, 64)), &src, true)],
        )
        .unwrap();
        assert!(wait_until(Duration::from_secs(5), || llog.len() == i as usize + 1));
    }
    let during = backoffs() - before;
    assert!(
        during <= 2,
        "{}: {during} back-offs during 100 round trips on the living CQ: the dead CQ holds its group back",
        B::NAME
    );
    let report = within("stopping", Duration::from_secs(10), move || {
        cqd_core::shutdown(
            || {
                B::to_error(&la);
                B::to_error(&lb);
            },
            [t],
            [],
        )
    });
    let p = &report.pollers[0];
    let w = account(p, &lreg, OpKind::Write).expect("the living writes");
    assert_eq!((w.posted, w.completed), (100, 100));
    let r = account(p, &dreg, OpKind::Recv).expect("the dead receives");
    assert_eq!((r.posted, r.completed), (4, 0), "died with the device");
    assert!(dlog.snapshot().is_empty());
    drop((da, db, dcq, lcq));
}

/// The source's side of a dying device, without a poller: once the
/// device is known to be gone, polls and arms fail with `DeviceGone`, and
/// the fatal event is there to take.
fn device_gone_source<B: Backend>(_: &str) {
    let dev = B::open();
    let (cq, mut source) = B::cq(&dev, "gone-source", 256, true);
    B::kill(&dev);
    // The device says so too (cqd-verbs: once its event reader has read
    // IBV_EVENT_DEVICE_FATAL; `device_gone_first_poll` polls before that).
    assert!(wait_until(Duration::from_secs(5), || B::is_gone(&dev)));
    let mut buf = [cqd_core::Completion::default(); 4];
    let polled = source.poll(&mut buf);
    assert!(
        matches!(polled, Err(SourceError::DeviceGone(_))),
        "{}: a poll after the death: {polled:?}",
        B::NAME
    );
    let armed = source.arm(ArmKind::Next);
    assert!(
        matches!(armed, Err(SourceError::DeviceGone(_))),
        "{}: an arm after the death: {armed:?}",
        B::NAME
    );
    let mut fatal = false;
    assert!(wait_until(Duration::from_secs(5), || {
        fatal |= source.take_async_event() == Some(cqd_core::AsyncEvent::DeviceFatal);
        fatal
    }));
    source.destroy().expect("destroying a dead device's CQ");
    drop((source, cq, dev));
}

/// The very first poll and arm after the death, before anything has read
/// the fatal event: `DeviceGone` as well (a poller cannot tell a dead
/// device from a passing failure otherwise).
fn device_gone_first_poll<B: Backend>(_: &str) {
    let dev = B::open();
    let (cq, mut source) = B::cq(&dev, "gone-first", 256, true);
    B::kill(&dev);
    let mut buf = [cqd_core::Completion::default(); 4];
    let polled = source.poll(&mut buf);
    let armed = source.arm(ArmKind::Next);
    assert!(
        matches!(polled, Err(SourceError::DeviceGone(_)))
            && matches!(armed, Err(SourceError::DeviceGone(_))),
        "{}: right after the death, poll: {polled:?}, arm: {armed:?}",
        B::NAME
    );
    drop((source, cq, dev));
}

// ---------------------------------------------------------------------
// Two processes: the verbs half re-executes this test binary as the peer
// (CQD_PEER_ADDR selects the role), exchanges endpoints and regions as
// JSON over TCP, runs traffic both ways and checks the bytes. The
// simulator has no processes (its fabric lives in one address space): its
// half runs the same two roles on two threads, on two devices of one
// fabric, exchanging the same JSON over a socket pair.
// ---------------------------------------------------------------------

const MSGS: usize = 256;
const SLOT: usize = 64;
const ECHO: usize = MSGS * SLOT;
const READ_BACK: usize = 2 * MSGS * SLOT;

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(bound = "")]
enum Msg<B: Backend> {
    Hello {
        ep: B::Endpoint,
        addr: u64,
        rkey: u32,
    },
    Ready,
    Done,
    Bye,
}

struct Link<S> {
    r: BufReader<S>,
    w: S,
}

impl<S: std::io::Read + Write> Link<S> {
    fn send<B: Backend>(&mut self, m: &Msg<B>) {
        let mut line = serde_json::to_vec(m).expect("serialise");
        line.push(b'\n');
        self.w.write_all(&line).expect("send to the peer");
        self.w.flush().expect("flush");
    }
    fn recv<B: Backend>(&mut self) -> Msg<B> {
        let mut line = String::new();
        let n = self.r.read_line(&mut line).expect("read from the peer");
        assert!(n > 0, "the peer hung up");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("bad message {line:?}: {e}"))
    }
}

fn message(i: usize) -> Vec<u8> {
    (0..SLOT).map(|k| (i * 7 + k * 13) as u8).collect()
}

/// Sends MSGS messages with immediate data, then checks the responder's
/// RDMA WRITE echo and RDMA READs the responder's region back.
fn initiator<B: Backend, S: std::io::Read + Write>(dev: &B::Dev, link: &mut Link<S>, m: &str) {
    let (cq, u, h) = B::dispatched_cq(dev, "initiator", 1024, true);
    let qp = B::qp(dev, &cq, &cq, Cap::default());
    let mr = B::reg_mr(dev, 3 * MSGS * SLOT);
    let (addr, rkey) = B::remote_parts(B::remote(&mr, 0));
    link.send::<B>(&Msg::Hello {
        ep: B::endpoint(&qp),
        addr,
        rkey,
    });
    let Msg::<B>::Hello {
        ep,
        addr: paddr,
        rkey: prkey,
    } = link.recv::<B>()
    else {
        panic!("expected the responder's hello")
    };
    B::connect(&qp, &ep);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("initiator", mode(m), vec![u]);
    for i in 0..MSGS {
        B::write(&mr, i * SLOT, &message(i));
    }
    assert!(matches!(link.recv::<B>(), Msg::Ready));
    let sg: Vec<_> = (0..MSGS)
        .map(|i| [B::sge(&mr, i * SLOT, SLOT as u32)])
        .collect();
    for chunk in (0..MSGS).collect::<Vec<_>>().chunks(16) {
        retry::<B>(|| {
            let mut l: Vec<_> = chunk
                .iter()
                .map(|&i| B::send_wr(i as u32, Op::SendImm(i as u32), &sg[i], true))
                .collect();
            reg.post_send(&qp, &mut l)
        });
    }
    assert!(wait_until(Duration::from_secs(20), || log.len() == MSGS));
    assert!(matches!(link.recv::<B>(), Msg::Done));
    // The echo the responder wrote into our region.
    let mut echo = vec![0u8; MSGS * SLOT];
    B::read(&mr, ECHO, &mut echo);
    let mut sent = vec![0u8; MSGS * SLOT];
    B::read(&mr, 0, &mut sent);
    assert!(echo == sent, "the responder's RDMA WRITE echo differs");
    // And what it received, read back from its region.
    let dst = [B::sge(&mr, READ_BACK, (MSGS * SLOT) as u32)];
    reg.post_send(
        &qp,
        &mut [B::send_wr(
            9999,
            Op::Read(B::remote_from(paddr, prkey)),
            &dst,
            true,
        )],
    )
    .unwrap();
    assert!(wait_until(Duration::from_secs(10), || log.len() == MSGS + 1));
    let mut back = vec![0u8; MSGS * SLOT];
    B::read(&mr, READ_BACK, &mut back);
    assert!(
        back == sent,
        "the RDMA READ of the responder's region differs"
    );
    link.send::<B>(&Msg::Bye);
    let report = cqd_core::shutdown(|| B::to_error(&qp), [t], []);
    assert_clean("initiator", &report);
    let evs = log.snapshot();
    assert!(evs.iter().all(|e| e.ok), "{evs:?}");
    assert_each_once("initiator", &evs, OpKind::Send, 0..MSGS as u32);
    assert_each_once("initiator", &evs, OpKind::Read, [9999]);
}

/// Receives MSGS messages, checks each, writes them all back.
fn responder<B: Backend, S: std::io::Read + Write>(dev: &B::Dev, link: &mut Link<S>, m: &str) {
    let (cq, u, h) = B::dispatched_cq(dev, "responder", 1024, true);
    let qp = B::qp(
        dev,
        &cq,
        &cq,
        Cap {
            send: 64,
            recv: MSGS as u32,
        },
    );
    let mr = B::reg_mr(dev, MSGS * SLOT);
    let (addr, rkey) = B::remote_parts(B::remote(&mr, 0));
    let Msg::<B>::Hello {
        ep,
        addr: paddr,
        rkey: prkey,
    } = link.recv::<B>()
    else {
        panic!("expected the initiator's hello")
    };
    link.send::<B>(&Msg::Hello {
        ep: B::endpoint(&qp),
        addr,
        rkey,
    });
    B::connect(&qp, &ep);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("responder", mode(m), vec![u]);
    let sg: Vec<_> = (0..MSGS)
        .map(|i| [B::sge(&mr, i * SLOT, SLOT as u32)])
        .collect();
    let mut r: Vec<_> = (0..MSGS).map(|i| B::recv_wr(i as u32, &sg[i])).collect();
    reg.post_recv(&qp, &mut r).unwrap();
    link.send::<B>(&Msg::Ready);
    assert!(wait_until(Duration::from_secs(20), || log.len() == MSGS));
    let evs = log.snapshot();
    assert_each_once("responder", &evs, OpKind::Recv, 0..MSGS as u32);
    for e in &evs {
        let i = e.tag as usize;
        assert!(e.ok, "{e:?}");
        assert_eq!((e.byte_len as usize, e.imm), (SLOT, Some(e.tag)), "{e:?}");
        let mut got = vec![0u8; SLOT];
        B::read(&mr, i * SLOT, &mut got);
        assert_eq!(got, message(i), "message {i}");
    }
    let all = [B::sge(&mr, 0, (MSGS * SLOT) as u32)];
    let echo = B::remote_from(paddr + ECHO as u64, prkey);
    reg.post_send(&qp, &mut [B::send_wr(1, Op::Write(echo), &all, true)])
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || log.len() == MSGS + 1));
    link.send::<B>(&Msg::Done);
    // Keep the region until the initiator has read it back.
    assert!(matches!(link.recv::<B>(), Msg::Bye));
    let report = cqd_core::shutdown(|| B::to_error(&qp), [t], []);
    assert_clean("responder", &report);
    assert_each_once("responder", &log.snapshot(), OpKind::Write, [1]);
}

/// Set in the child: the parent's address; the child is the responder.
const PEER_ENV: &str = "CQD_TWO_BACKENDS_PEER";

fn two_processes_sim(m: &str) {
    // No processes on the simulator: two threads, two devices of one
    // fabric, the same JSON over a socket pair.
    use std::os::unix::net::UnixStream;
    let dev = backend::Sim::open();
    let peer = backend::Sim::open_peer(&dev);
    let (x, y) = UnixStream::pair().expect("socketpair");
    let mode_name = m.to_string();
    let responder_thread = std::thread::spawn(move || {
        let mut link = Link {
            r: BufReader::new(y.try_clone().expect("clone")),
            w: y,
        };
        responder::<backend::Sim, _>(&peer, &mut link, &mode_name);
    });
    let mut link = Link {
        r: BufReader::new(x.try_clone().expect("clone")),
        w: x,
    };
    initiator::<backend::Sim, _>(&dev, &mut link, m);
    responder_thread.join().expect("the responder thread");
}

fn two_processes_verbs<B: Backend>(test: &str, m: &str) {
    use std::net::{TcpListener, TcpStream};
    if let Ok(addr) = std::env::var(PEER_ENV) {
        // The child: the responder.
        let s = TcpStream::connect(addr).expect("connect to the parent");
        let mut link = Link {
            r: BufReader::new(s.try_clone().expect("clone")),
            w: s,
        };
        let dev = B::open();
        responder::<B, _>(&dev, &mut link, m);
        return;
    }
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let exe = std::env::current_exe().expect("the test binary");
    let child = std::process::Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(PEER_ENV, addr.to_string())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn the peer process");
    let (s, _) = listener.accept().expect("the peer connects");
    s.set_read_timeout(Some(support::secs(30)))
        .expect("timeout");
    let mut link = Link {
        r: BufReader::new(s.try_clone().expect("clone")),
        w: s,
    };
    let dev = B::open();
    initiator::<B, _>(&dev, &mut link, m);
    let out = child.wait_with_output().expect("the peer process");
    assert!(
        out.status.success(),
        "the peer process failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("1 passed"),
        "the peer ran its role: {stdout}"
    );
}

// ---------------------------------------------------------------------
// The matrix: one test per scenario, backend and mode.
// ---------------------------------------------------------------------

macro_rules! matrix {
    ($scenario:ident: $($mode:ident),+) => {
        mod $scenario {
            mod sim {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!(stringify!($scenario), "::sim::", stringify!($mode));
                        crate::run::<crate::backend::Sim>(name, || {
                            crate::$scenario::<crate::backend::Sim>(stringify!($mode))
                        });
                    }
                )+
            }
            mod verbs {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!(stringify!($scenario), "::verbs::", stringify!($mode));
                        crate::run::<crate::backend::Verbs>(name, || {
                            crate::$scenario::<crate::backend::Verbs>(stringify!($mode))
                        });
                    }
                )+
            }
            mod rxe {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!(stringify!($scenario), "::rxe::", stringify!($mode));
                        crate::run::<crate::backend::Rxe>(name, || {
                            crate::$scenario::<crate::backend::Rxe>(stringify!($mode))
                        });
                    }
                )+
            }
        }
    };
}

/// A scenario of the verbs devices alone (the simulator lacks what it
/// tests): cells for softverbs and rxe.
macro_rules! verbs_matrix {
    ($scenario:ident: $($mode:ident),+) => {
        mod $scenario {
            mod verbs {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!(stringify!($scenario), "::verbs::", stringify!($mode));
                        crate::run::<crate::backend::Verbs>(name, || {
                            crate::memory_windows::$scenario::<crate::backend::Soft>(stringify!($mode))
                        });
                    }
                )+
            }
            mod rxe {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!(stringify!($scenario), "::rxe::", stringify!($mode));
                        crate::run::<crate::backend::Rxe>(name, || {
                            crate::memory_windows::$scenario::<crate::backend::RxeDevice>(stringify!($mode))
                        });
                    }
                )+
            }
        }
    };
}

matrix!(exactly_once: busy, event, hybrid, adaptive);
matrix!(send_recv_one_cq: busy, event, hybrid, adaptive);
matrix!(srq_shared: busy, event, hybrid, adaptive);
matrix!(close_own: busy, event, hybrid, adaptive);
matrix!(close_srq: busy, event, hybrid, adaptive);
matrix!(full_send_queue: direct);
matrix!(churn: event);
matrix!(grow_running: busy, event, hybrid, adaptive);
matrix!(resize_running: busy, event, hybrid, adaptive);
matrix!(join_as_it_stops: busy, event);
matrix!(cq_pool: busy, event, hybrid, adaptive);
matrix!(cq_pool_first_fit: event);
matrix!(cq_pool_resize: busy, event);
matrix!(cq_pool_from_topology: busy, event, hybrid, adaptive);
matrix!(errors_by_side: busy, event, hybrid, adaptive);
matrix!(unsignaled: busy, event, hybrid, adaptive);
matrix!(drain_and_shutdown: busy, event, hybrid, adaptive);
matrix!(stop_in_flight: busy, event, hybrid, adaptive);
matrix!(qp_dropped_after_flush: busy, event, hybrid, adaptive);

// A QP dropped with requests outstanding: both backends flush them and
// account every flush (cqd-verbs keeps the QP, in ERR, until its CQ's
// poller has retired them; devices discard a destroyed QP's completions).
matrix!(qp_dropped_unflushed: busy, event, hybrid, adaptive);
// Dropped with a tail of unsignaled requests that ran silently: a drain
// marker retires them (every backend, every mode).
matrix!(qp_dropped_with_silent_tail: busy, event, hybrid, adaptive);

matrix!(overflow: busy, event, hybrid, adaptive);

// Memory windows: bound per request, refused after the invalidate and
// through another QP; the QP's drop deallocates them first.
verbs_matrix!(windows: busy, event);

// UD receives routed by handler with each sender's src_qp and GRH;
// atomics from several QPs exact; RC, UD and atomics mixed on one CQ.
matrix!(ud_routing: busy, event, hybrid, adaptive);
matrix!(atomics: busy, event, hybrid, adaptive);
matrix!(mixed_kinds: busy, event, hybrid, adaptive);
// The source's own contract: no poller, no mode.
matrix!(destroy_unacked: direct);
// Busy never arms, so it takes no notification to acknowledge.
matrix!(events_acked_at_stop: event, hybrid, adaptive);
matrix!(shared_channel: busy, event, hybrid, adaptive);
matrix!(device_gone: busy, event, hybrid, adaptive);
// A dead CQ must not slow the living CQs of its group (it leaves the
// polled set for the errored list, polled once per safety round).
matrix!(device_gone_group: busy, event, hybrid, adaptive);
matrix!(device_gone_source: direct);

matrix!(device_gone_first_poll: direct);

macro_rules! two_processes {
    ($($mode:ident),+) => {
        mod two_processes {
            mod sim {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!("two_processes::sim::", stringify!($mode));
                        crate::run::<crate::backend::Sim>(name, || {
                            crate::two_processes_sim(stringify!($mode))
                        });
                    }
                )+
            }
            mod verbs {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!("two_processes::verbs::", stringify!($mode));
                        crate::run::<crate::backend::Verbs>(name, || {
                            crate::two_processes_verbs::<crate::backend::Verbs>(name, stringify!($mode))
                        });
                    }
                )+
            }
            mod rxe {
                $(
                    #[test]
                    fn $mode() {
                        let name = concat!("two_processes::rxe::", stringify!($mode));
                        crate::run::<crate::backend::Rxe>(name, || {
                            crate::two_processes_verbs::<crate::backend::Rxe>(name, stringify!($mode))
                        });
                    }
                )+
            }
        }
    };
}

two_processes!(busy, event, hybrid, adaptive);
