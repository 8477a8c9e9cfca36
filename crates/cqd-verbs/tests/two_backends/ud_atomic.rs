//! UD receives and atomics through the dispatcher, written once for both
//! backends: who sent each datagram (`src_qp`), its GRH or none, its
//! payload after the 40-byte GRH, the MTU and the Q_Key; fetch-and-add
//! and compare-and-swap from several QPs at once; and RC, UD and atomics
//! mixed on one CQ, each completion routed to its handler exactly once.

use std::collections::HashMap;
use std::time::Duration;

use cqd_core::completion::GRH_LEN;
use cqd_core::{Invalid, OpKind, Opcode, Registration, Side};

use crate::backend::{Backend, Cap, Op};
use crate::support::{mode, poller, retry, wait_until, Ev, Log, Recorder};
use crate::{assert_clean, assert_each_once, assert_log_matches_ledger};

const QKEY: u32 = 0x1234_5678;
const BAD_QKEY: u32 = 0x0bad_0bad;
/// Bytes per UD receive buffer: the GRH, then up to 216 bytes of payload.
const SLOT: usize = 256;
const UD_PAYLOAD: usize = 64;
const UD_SENDERS: usize = 4;
const UD_PER_SENDER: usize = 24;
/// Every `BAD_EVERY`th datagram of a sender is followed by one with the
/// wrong Q_Key, which must vanish.
const BAD_EVERY: usize = 8;
/// The first payload byte of a wrong-Q_Key datagram.
const BAD_MARK: u8 = 0xee;

/// The payload of datagram `k` of sender `j`.
fn datagram(j: usize, k: usize) -> Vec<u8> {
    let mut p = vec![0u8; UD_PAYLOAD];
    p[0] = j as u8;
    p[1] = k as u8;
    for (i, b) in p.iter_mut().enumerate().skip(2) {
        *b = (i * 7 + j * 31 + k * 13) as u8;
    }
    p
}

/// Several UD senders to one receiver: each datagram delivered once, to
/// the receiver's handler, with the sender's QPN, the GRH exactly when the
/// address handle was global, the payload after the GRH; wrong Q_Keys
/// dropped; a datagram over the MTU refused before the device.
pub fn ud_routing<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let total = UD_SENDERS * UD_PER_SENDER;
    let (cq, u, h) = B::dispatched_cq(&dev, "ud", 2048, true);
    let rx = B::ud_qp(&dev, &cq, &cq, Cap { send: 8, recv: 256 });
    B::ud_ready(&rx, QKEY);
    let senders: Vec<B::Qp> = (0..UD_SENDERS)
        .map(|_| {
            let q = B::ud_qp(&dev, &cq, &cq, Cap { send: 64, recv: 8 });
            B::ud_ready(&q, QKEY);
            q
        })
        .collect();
    let (by_lid, by_gid) = (B::ah(&dev, &dev, false), B::ah(&dev, &dev, true));
    let rmr = B::reg_mr(&dev, SLOT * total);
    let smr = B::reg_mr(&dev, 16 << 10);
    let (rlog, slog) = (Log::default(), Log::default());
    let rreg = h.register(Recorder(rlog.clone())).unwrap();
    let sreg = h.register(Recorder(slog.clone())).unwrap();
    let t = poller("ud", mode(mode_name), vec![u]);

    // One receive per good datagram: a delivered wrong-Q_Key datagram would
    // take one, and a good one would then be missing.
    let rsg: Vec<_> = (0..total)
        .map(|i| [B::sge(&rmr, i * SLOT, SLOT as u32)])
        .collect();
    let mut rwrs: Vec<_> = rsg
        .iter()
        .enumerate()
        .map(|(i, s)| B::recv_wr(i as u32, s))
        .collect();
    rreg.post_recv(&rx, &mut rwrs).unwrap();

    // Over the MTU: refused untouched, nothing counted.
    let mtu = B::mtu(&senders[0]);
    assert!(mtu >= 256, "{}: MTU {mtu}", B::NAME);
    let big = [B::sge(&smr, 0, mtu + 1)];
    let err = sreg
        .post_send(
            &senders[0],
            &mut [B::ud_send_wr(9999, &by_lid, B::qpn(&rx), QKEY, &big, None)],
        )
        .unwrap_err();
    assert_eq!(
        B::invalid(&err),
        Some(Invalid::DatagramTooLong {
            len: u64::from(mtu) + 1,
            mtu
        }),
        "{}: {err}",
        B::NAME
    );
    // Exactly the MTU is a datagram (not sent here: it would take a
    // receive); RDMA on a UD QP is refused too.
    let wsg = [B::sge(&smr, 0, 8)];
    let err = sreg
        .post_send(
            &senders[0],
            &mut [B::send_wr(9998, Op::Write(B::remote(&rmr, 0)), &wsg, true)],
        )
        .unwrap_err();
    assert!(
        matches!(B::invalid(&err), Some(Invalid::Transport { .. })),
        "{}: {err}",
        B::NAME
    );
    assert_eq!(sreg.ledger().posted(OpKind::Send), 0);
    assert_eq!(sreg.ledger().posted(OpKind::Write), 0);

    // Payloads: sender j's datagram k at (j * UD_PER_SENDER + k) * 64, the
    // bad ones' in the last 4 KiB.
    for j in 0..UD_SENDERS {
        for k in 0..UD_PER_SENDER {
            B::write(&smr, (j * UD_PER_SENDER + k) * UD_PAYLOAD, &datagram(j, k));
        }
    }
    let bad_off = 12 << 10;
    B::write(&smr, bad_off, &[BAD_MARK; UD_PAYLOAD]);
    let bad_per_sender = UD_PER_SENDER / BAD_EVERY;
    std::thread::scope(|s| {
        for (j, q) in senders.iter().enumerate() {
            let (sreg, smr, rx) = (&sreg, &smr, &rx);
            let (by_lid, by_gid) = (&by_lid, &by_gid);
            s.spawn(move || {
                let bad_sg = [B::sge(smr, bad_off, UD_PAYLOAD as u32)];
                for k in 0..UD_PER_SENDER {
                    let off = (j * UD_PER_SENDER + k) * UD_PAYLOAD;
                    let sg = [B::sge(smr, off, UD_PAYLOAD as u32)];
                    let ah = if (j + k) % 2 == 0 { by_gid } else { by_lid };
                    let imm = (k % 3 == 0).then_some(0x1000 + (j * 100 + k) as u32);
                    let tag = (j * 100 + k) as u32;
                    retry::<B>(|| {
                        sreg.post_send(q, &mut [B::ud_send_wr(tag, ah, B::qpn(rx), QKEY, &sg, imm)])
                    });
                    if k % BAD_EVERY == BAD_EVERY - 1 {
                        let tag = (5000 + j * 100 + k) as u32;
                        retry::<B>(|| {
                            sreg.post_send(
                                q,
                                &mut [B::ud_send_wr(
                                    tag,
                                    by_gid,
                                    B::qpn(rx),
                                    BAD_QKEY,
                                    &bad_sg,
                                    None,
                                )],
                            )
                        });
                    }
                }
            });
        }
    });
    let sends = total + UD_SENDERS * bad_per_sender;
    assert!(
        wait_until(Duration::from_secs(20), || rlog.len() >= total
            && slog.len() >= sends),
        "{}: {} of {total} datagrams received, {} of {sends} sends complete",
        B::NAME,
        rlog.len(),
        slog.len()
    );
    // Anything late (a wrong-Q_Key datagram delivered after all) would
    // show up here.
    std::thread::sleep(Duration::from_millis(50));
    let report = cqd_core::shutdown(
        || {
            B::to_error(&rx);
            senders.iter().for_each(B::to_error);
        },
        [t],
        [],
    );
    assert_clean("ud_routing", &report);

    // The senders' side: every send (wrong Q_Keys too: UD does not know)
    // succeeded, once.
    let sevs = slog.snapshot();
    assert!(
        sevs.iter().all(|e| e.ok && e.opcode == Opcode::Send),
        "{sevs:?}"
    );
    let good = (0..UD_SENDERS).flat_map(|j| (0..UD_PER_SENDER).map(move |k| (j * 100 + k) as u32));
    let bad = (0..UD_SENDERS).flat_map(|j| {
        (0..UD_PER_SENDER)
            .filter(|k| k % BAD_EVERY == BAD_EVERY - 1)
            .map(move |k| (5000 + j * 100 + k) as u32)
    });
    assert_each_once("UD sends", &sevs, OpKind::Send, good.chain(bad));

    // The receiver's side.
    let revs = rlog.snapshot();
    assert_each_once("UD receives", &revs, OpKind::Recv, 0..total as u32);
    let qpn_of: HashMap<u32, usize> = senders
        .iter()
        .enumerate()
        .map(|(j, q)| (B::qpn(q), j))
        .collect();
    let gid = B::gid(&dev);
    let mut seen = vec![0u32; total];
    let mut per_sender = [0usize; UD_SENDERS];
    for e in &revs {
        assert!(e.ok && e.opcode == Opcode::Recv, "{e:?}");
        assert_eq!(e.qp, B::qpn(&rx), "{e:?}");
        assert_eq!(e.byte_len as usize, GRH_LEN as usize + UD_PAYLOAD, "{e:?}");
        let mut buf = vec![0u8; SLOT];
        B::read(&rmr, e.tag as usize * SLOT, &mut buf);
        let payload = &buf[GRH_LEN as usize..GRH_LEN as usize + UD_PAYLOAD];
        assert_ne!(payload[0], BAD_MARK, "a wrong-Q_Key datagram was delivered");
        let (j, k) = (payload[0] as usize, payload[1] as usize);
        assert!(j < UD_SENDERS && k < UD_PER_SENDER, "{e:?}: {payload:?}");
        assert_eq!(payload, &datagram(j, k)[..], "datagram {j}/{k}");
        assert_eq!(
            qpn_of.get(&e.src_qp),
            Some(&j),
            "{e:?}: src_qp of sender {j}"
        );
        per_sender[j] += 1;
        let global = (j + k) % 2 == 0;
        // On RoCE every handle is global, so every datagram has one.
        let global = global || B::GRH_ALWAYS;
        assert_eq!(e.grh, global, "{e:?}: GRH flag of datagram {j}/{k}");
        let imm = (k % 3 == 0).then_some(0x1000 + (j * 100 + k) as u32);
        assert_eq!(e.imm, imm, "{e:?}");
        if global {
            B::check_grh(&buf[..GRH_LEN as usize], &gid);
        }
        seen[j * UD_PER_SENDER + k] += 1;
    }
    assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    assert_eq!(per_sender, [UD_PER_SENDER; UD_SENDERS]);
    assert_log_matches_ledger("UD receiver", &rlog, &rreg);
    assert_log_matches_ledger("UD senders", &slog, &sreg);
}

const AT_QPS: usize = 4;
const AT_FADDS: usize = 64;
const AT_CAS: usize = 12;
/// Tags of compare-and-swap attempts: thread i's n-th is
/// `CAS_TAG + i * 1000 + n`.
const CAS_TAG: u32 = 100_000;

/// Reads the 8-byte word at `off` (host order: both devices' byte order).
fn word<B: Backend>(mr: &B::Mr, off: usize) -> u64 {
    let mut b = [0u8; 8];
    B::read(mr, off, &mut b);
    u64::from_ne_bytes(b)
}

fn assert_atomic_refused<B: Backend>(
    reg: &Registration,
    qp: &B::Qp,
    op: Op<B::Remote>,
    sg: &[B::Sge<'_>],
    want: Invalid,
) {
    let err = reg
        .post_send(qp, &mut [B::send_wr(7, op, sg, true)])
        .unwrap_err();
    assert_eq!(B::invalid(&err), Some(want), "{}: {err}", B::NAME);
}

/// Waits until `log` holds the completion of `tag`; returns it.
fn completion_of(log: &Log, tag: u32) -> Ev {
    let mut found = None;
    let ok = wait_until(Duration::from_secs(10), || {
        found = log.lock().iter().find(|e| e.tag == tag).copied();
        found.is_some()
    });
    assert!(ok, "completion of tag {tag} never came");
    found.expect("found")
}

/// Fetch-and-add and compare-and-swap on one word from `AT_QPS` QPs at
/// once: the total is exact, every old value returned once; misaligned
/// targets and local lists of the wrong length refused before the device.
pub fn atomics<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "atomic", 2048, true);
    let pairs: Vec<(B::Qp, B::Qp)> = (0..AT_QPS)
        .map(|_| B::pair(&dev, &cq, &cq, Cap::default()))
        .collect();
    let target = B::reg_mr(&dev, 64);
    let local = B::reg_mr(&dev, AT_QPS * (AT_FADDS + 1) * 8);
    let handlers: Vec<(Registration, Log)> = (0..AT_QPS)
        .map(|_| {
            let log = Log::default();
            (h.register(Recorder(log.clone())).unwrap(), log)
        })
        .collect();
    let t = poller("atomic", mode(mode_name), vec![u]);

    // Refused untouched: a misaligned target, a local list of 4 or 16
    // bytes, for both operations.
    let (reg0, qp0) = (&handlers[0].0, &pairs[0].0);
    let at4 = B::remote(&target, 4);
    let addr4 = B::remote_parts(at4).0;
    let sg8 = [B::sge(&local, 0, 8)];
    let misaligned = Invalid::AtomicMisaligned { addr: addr4 };
    assert_atomic_refused::<B>(reg0, qp0, Op::Fadd(at4, 1), &sg8, misaligned);
    assert_atomic_refused::<B>(reg0, qp0, Op::Cas(at4, 0, 1), &sg8, misaligned);
    let at0 = B::remote(&target, 0);
    let sg4 = [B::sge(&local, 0, 4)];
    let sg16 = [B::sge(&local, 0, 16)];
    assert_atomic_refused::<B>(
        reg0,
        qp0,
        Op::Fadd(at0, 1),
        &sg4,
        Invalid::AtomicLocalLength { len: 4 },
    );
    assert_atomic_refused::<B>(
        reg0,
        qp0,
        Op::Cas(at0, 0, 1),
        &sg16,
        Invalid::AtomicLocalLength { len: 16 },
    );
    assert_eq!(reg0.ledger().posted(OpKind::Atomic), 0);

    std::thread::scope(|s| {
        for (i, ((reg, log), (a, _))) in handlers.iter().zip(&pairs).enumerate() {
            let (local, target) = (&local, &target);
            s.spawn(move || {
                // Fetch-and-adds, at most 8 in flight, each old value in its
                // own 8 bytes.
                let at = B::remote(target, 0);
                for k in 0..AT_FADDS {
                    let tag = (i * AT_FADDS + k) as u32;
                    let sg = [B::sge(local, tag as usize * 8, 8)];
                    assert!(wait_until(Duration::from_secs(10), || reg
                        .ledger()
                        .outstanding()
                        < 8));
                    retry::<B>(|| {
                        reg.post_send(a, &mut [B::send_wr(tag, Op::Fadd(at, 1), &sg, true)])
                    });
                }
                // Compare-and-swap increments of the word at 8: each
                // attempt waits for its old value and retries with it.
                let cas_at = B::remote(target, 8);
                let slot = (AT_QPS * AT_FADDS + i) * 8;
                let sg = [B::sge(local, slot, 8)];
                let (mut guess, mut done, mut n) = (0u64, 0, 0u32);
                while done < AT_CAS {
                    assert!(n < 1000, "thread {i}: {n} compare-and-swap attempts");
                    let tag = CAS_TAG + i as u32 * 1000 + n;
                    n += 1;
                    let op = Op::Cas(cas_at, guess, guess + 1);
                    retry::<B>(|| reg.post_send(a, &mut [B::send_wr(tag, op, &sg, true)]));
                    let e = completion_of(log, tag);
                    assert!(e.ok, "{e:?}");
                    let old = word::<B>(local, slot);
                    if old == guess {
                        done += 1;
                        guess += 1;
                    } else {
                        // Another thread got there first: retry from the
                        // value it left.
                        guess = old;
                    }
                }
            });
        }
    });
    let expect: Vec<usize> = handlers
        .iter()
        .map(|(reg, _)| reg.ledger().posted(OpKind::Atomic) as usize)
        .collect();
    assert!(
        wait_until(Duration::from_secs(20), || handlers
            .iter()
            .zip(&expect)
            .all(|((_, log), &n)| log.len() >= n)),
        "{}: atomics missing",
        B::NAME
    );
    let report = cqd_core::shutdown(
        || {
            for (a, b) in &pairs {
                B::to_error(a);
                B::to_error(b);
            }
        },
        [t],
        [],
    );
    assert_clean("atomics", &report);

    assert_eq!(
        word::<B>(&target, 0),
        (AT_QPS * AT_FADDS) as u64,
        "fetch-and-add total"
    );
    assert_eq!(
        word::<B>(&target, 8),
        (AT_QPS * AT_CAS) as u64,
        "compare-and-swap total"
    );
    let mut olds: Vec<u64> = (0..AT_QPS * AT_FADDS)
        .map(|t| word::<B>(&local, t * 8))
        .collect();
    olds.sort_unstable();
    assert_eq!(
        olds,
        (0..(AT_QPS * AT_FADDS) as u64).collect::<Vec<_>>(),
        "each old value once"
    );
    for (i, (reg, log)) in handlers.iter().enumerate() {
        let evs = log.snapshot();
        for e in &evs {
            assert!(
                e.ok && e.side == Side::Send && e.kind == OpKind::Atomic,
                "{e:?}"
            );
            let want = if e.tag >= CAS_TAG {
                Opcode::CompareSwap
            } else {
                Opcode::FetchAdd
            };
            assert_eq!((e.opcode, e.byte_len), (want, 8), "{e:?}");
        }
        let fadds = (0..AT_FADDS).map(|k| (i * AT_FADDS + k) as u32);
        let cas = (0..evs.iter().filter(|e| e.tag >= CAS_TAG).count() as u32)
            .map(|n| CAS_TAG + i as u32 * 1000 + n);
        assert_each_once("atomics", &evs, OpKind::Atomic, fadds.chain(cas));
        let l = reg.ledger();
        assert_eq!(l.completed(OpKind::Atomic), l.posted(OpKind::Atomic));
    }
}

/// RC SEND/RECV, WRITE, READ, atomics and UD datagrams on one CQ, two
/// handlers posting the same tags: each completion reaches its own
/// handler once, with the opcode of its kind.
pub fn mixed_kinds<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "mixed", 2048, true);
    let (a, b) = B::pair(&dev, &cq, &cq, Cap::default());
    let (tx, rx) = (
        B::ud_qp(&dev, &cq, &cq, Cap::default()),
        B::ud_qp(&dev, &cq, &cq, Cap::default()),
    );
    B::ud_ready(&tx, QKEY);
    B::ud_ready(&rx, QKEY);
    let ah = B::ah(&dev, &dev, true);
    let (ma, mb) = (B::reg_mr(&dev, 8192), B::reg_mr(&dev, 8192));
    let mu = B::reg_mr(&dev, 8 * SLOT + 4096);
    let (rc_log, ud_log) = (Log::default(), Log::default());
    let rc = h.register(Recorder(rc_log.clone())).unwrap();
    let ud = h.register(Recorder(ud_log.clone())).unwrap();
    let t = poller("mixed", mode(mode_name), vec![u]);

    let rsg: Vec<_> = (0..8).map(|i| [B::sge(&mb, i * 64, 64)]).collect();
    let mut rwrs: Vec<_> = rsg
        .iter()
        .enumerate()
        .map(|(i, s)| B::recv_wr(i as u32, s))
        .collect();
    rc.post_recv(&b, &mut rwrs).unwrap();
    let usg: Vec<_> = (0..8)
        .map(|i| [B::sge(&mu, i * SLOT, SLOT as u32)])
        .collect();
    let mut uwrs: Vec<_> = usg
        .iter()
        .enumerate()
        .map(|(i, s)| B::recv_wr(i as u32, s))
        .collect();
    ud.post_recv(&rx, &mut uwrs).unwrap();

    let ssg = [B::sge(&ma, 0, 32)];
    let wsg = [B::sge(&ma, 1024, 16)];
    let rdsg = [B::sge(&ma, 2048, 16)];
    let asg: Vec<_> = (0..12).map(|i| [B::sge(&ma, 4096 + i * 8, 8)]).collect();
    let target = B::remote(&mb, 4096);
    let mut list = Vec::new();
    for i in 0..8u32 {
        list.push(B::send_wr(i, Op::Send, &ssg, true));
    }
    for i in 0..4u32 {
        list.push(B::send_wr(
            100 + i,
            Op::Write(B::remote(&mb, 1024 + i as usize * 16)),
            &wsg,
            true,
        ));
        list.push(B::send_wr(
            200 + i,
            Op::Read(B::remote(&mb, 2048)),
            &rdsg,
            true,
        ));
    }
    for i in 0..8u32 {
        list.push(B::send_wr(
            300 + i,
            Op::Fadd(target, 2),
            &asg[i as usize],
            true,
        ));
    }
    for i in 0..4u32 {
        // Swaps 16 → 17 once; the other three find 17 and leave it.
        list.push(B::send_wr(
            400 + i,
            Op::Cas(target, 16, 17),
            &asg[8 + i as usize],
            true,
        ));
    }
    rc.post_send(&a, &mut list).unwrap();
    let dsg = [B::sge(&mu, 8 * SLOT, 48)];
    let mut dl: Vec<_> = (0..8u32)
        .map(|i| B::ud_send_wr(i, &ah, B::qpn(&rx), QKEY, &dsg, None))
        .collect();
    ud.post_send(&tx, &mut dl).unwrap();

    let (rc_n, ud_n) = (8 + 8 + 4 + 4 + 8 + 4, 16);
    assert!(
        wait_until(Duration::from_secs(10), || rc_log.len() >= rc_n
            && ud_log.len() >= ud_n),
        "{}: RC handler {}/{rc_n}, UD handler {}/{ud_n}",
        B::NAME,
        rc_log.len(),
        ud_log.len()
    );
    std::thread::sleep(Duration::from_millis(20));
    let report = cqd_core::shutdown(
        || [&a, &b, &tx, &rx].into_iter().for_each(B::to_error),
        [t],
        [],
    );
    assert_clean("mixed_kinds", &report);

    let revs = rc_log.snapshot();
    assert_eq!(revs.len(), rc_n, "{revs:?}");
    assert_each_once("RC recv", &revs, OpKind::Recv, 0..8);
    assert_each_once("RC send", &revs, OpKind::Send, 0..8);
    assert_each_once("RC write", &revs, OpKind::Write, 100..104);
    assert_each_once("RC read", &revs, OpKind::Read, 200..204);
    assert_each_once(
        "RC atomic",
        &revs,
        OpKind::Atomic,
        (300..308).chain(400..404),
    );
    for e in &revs {
        assert!(e.ok, "{e:?}");
        let (want, qp) = match e.kind {
            OpKind::Recv => (Opcode::Recv, B::qpn(&b)),
            OpKind::Send => (Opcode::Send, B::qpn(&a)),
            OpKind::Write => (Opcode::RdmaWrite, B::qpn(&a)),
            OpKind::Read => (Opcode::RdmaRead, B::qpn(&a)),
            OpKind::Atomic if e.tag >= 400 => (Opcode::CompareSwap, B::qpn(&a)),
            OpKind::Atomic => (Opcode::FetchAdd, B::qpn(&a)),
            OpKind::Internal | OpKind::Window => panic!("{e:?}"),
        };
        assert_eq!((e.opcode, e.qp), (want, qp), "{e:?}");
    }
    // 8 × 2 = 16, then one swap to 17.
    assert_eq!(word::<B>(&mb, 4096), 17);
    let uevs = ud_log.snapshot();
    assert_eq!(uevs.len(), ud_n, "{uevs:?}");
    assert_each_once("UD recv", &uevs, OpKind::Recv, 0..8);
    assert_each_once("UD send", &uevs, OpKind::Send, 0..8);
    for e in &uevs {
        assert!(e.ok, "{e:?}");
        match e.side {
            Side::Recv => {
                assert_eq!(
                    (e.qp, e.src_qp, e.grh),
                    (B::qpn(&rx), B::qpn(&tx), true),
                    "{e:?}"
                );
                assert_eq!(e.byte_len, GRH_LEN + 48, "{e:?}");
            }
            Side::Send => assert_eq!((e.qp, e.opcode), (B::qpn(&tx), Opcode::Send), "{e:?}"),
        }
    }
    assert_log_matches_ledger("RC handler", &rc_log, &rc);
    assert_log_matches_ledger("UD handler", &ud_log, &ud);
    for reg in [&rc, &ud] {
        let l = reg.ledger();
        assert_eq!(l.completed(OpKind::Atomic), l.posted(OpKind::Atomic));
    }
}
