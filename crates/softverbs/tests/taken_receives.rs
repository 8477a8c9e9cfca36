//! Receives taken by a requester (softverbs' data path is driven by the
//! requester, which claims the responder's receive WQE in shared memory,
//! copies the data and writes the completion): a requester killed between
//! taking a receive and completing it must not lose it — the responder's
//! QP flushes it, once, in order, when it goes to the error state, as a
//! NIC flushes a WQE of a message that never finished; a requester that is
//! alive completes its own and is never flushed over.
//!
//! The killed requester is made deterministic with the provider's test
//! hook `SOFTVERBS_TEST_STALL_AFTER_CLAIM` (src/shm/claim.rs): the child
//! stops itself (`SIGSTOP`) right after claiming (`1`) or right after
//! publishing the receive's completion (`complete`), and the parent kills
//! it there. Run under `softverbs-run`; skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::child::{child_chan, kill_and_wait_dead, spawn, spawn_env, wait_stopped, Chan};
use common::*;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

/// Short transport timeout (4.096 µs × 2^10 × 4 ≈ 17 ms): the responder's
/// own send to the dead requester gives up quickly.
const DEAD_TIMEOUT: u8 = 10;
const DEAD_RETRY: u8 = 3;

const STALL: (&str, &str) = ("SOFTVERBS_TEST_STALL_AFTER_CLAIM", "1");

const FLUSH: u32 = ibv_wc_status::IBV_WC_WR_FLUSH_ERR;
const OK: u32 = ibv_wc_status::IBV_WC_SUCCESS;

fn ids(wcs: &[Wc]) -> Vec<(u64, u32)> {
    wcs.iter().map(|w| (w.wr_id, w.status)).collect()
}

/// The requester of the two tests below: connects its QPs to the QPNs the
/// parent sends, answers with its own, and on "go" SENDs on the `which`-th
/// — and, with the stall hook, stops inside `ibv_post_send` right after
/// taking the receive.
fn stalling_requester(mut ch: Chan) {
    let dev = Dev::open();
    let cq = dev.cq(16, null_mut());
    let peers = ch.recv();
    let qps: Vec<_> = peers.iter().map(|_| dev.qp(cq, cq, null_mut())).collect();
    let mine: Vec<String> = qps.iter().map(|&q| qpn(q).to_string()).collect();
    ch.send(&mine.join(" "));
    for (&q, &p) in qps.iter().zip(&peers) {
        connect_with(q, p as u32, DEAD_TIMEOUT, DEAD_RETRY);
    }
    let src = Buf::new(&dev, 64, 9);
    let which = ch.recv()[0] as usize;
    post_send(qps[which], &src, 0, 8, 77, send(WR_SEND, SIGNALED));
    panic!("the stall hook did not stop the requester after its claim");
}

const WR_SEND: u32 = ibv_wr_opcode::IBV_WR_SEND;

/// A requester killed between taking a receive and completing it: the
/// receive neither completes nor vanishes; when the responder's QP fails
/// (here as in a real server: its own SEND to the dead peer times out)
/// the taken receive flushes with its wr_id, before the receives posted
/// after it, exactly once.
#[test]
fn receive_taken_by_a_killed_requester_is_flushed_once() {
    const NAME: &str = "receive_taken_by_a_killed_requester_is_flushed_once";
    if let Some(ch) = child_chan() {
        return stalling_requester(ch);
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let (mut child, mut ch) = spawn_env(NAME, &[STALL]);
    let dev = Dev::open();
    let (scq, rcq) = (dev.cq(16, null_mut()), dev.cq(16, null_mut()));
    let qp = dev.qp(scq, rcq, null_mut());
    ch.send(&qpn(qp).to_string());
    let peer = ch.recv()[0] as u32;
    connect_with(qp, peer, DEAD_TIMEOUT, DEAD_RETRY);
    let dst = Buf::new(&dev, 256, 0);
    for id in 1..=3 {
        post_recv(qp, &dst, 64 * (id as usize - 1), 64, id);
    }
    ch.send("0");
    wait_stopped(&child);
    // Taken, not completed: nothing arrives.
    poll_none(rcq, Duration::from_millis(30));
    kill_and_wait_dead(&child);
    assert!(!child.wait().expect("reap").success());
    poll_none(rcq, Duration::from_millis(30));
    assert_eq!(dst.data[..8], [0; 8], "no data was written");
    // The responder's own SEND to the dead peer times out: its QP goes to
    // ERR and flushes every receive, the taken one first.
    let src = Buf::new(&dev, 64, 5);
    assert_eq!(post_send(qp, &src, 0, 8, 50, send(WR_SEND, SIGNALED)), 0);
    assert_eq!(
        ids(&poll(scq, 1)),
        vec![(50, ibv_wc_status::IBV_WC_RETRY_EXC_ERR)]
    );
    let wcs = poll(rcq, 3);
    assert_eq!(ids(&wcs), vec![(1, FLUSH), (2, FLUSH), (3, FLUSH)]);
    assert!(wcs.iter().all(|w| w.qp_num == qpn(qp)));
    // Exactly once: a second flush finds nothing.
    poll_none(rcq, Duration::from_millis(30));
    to_error(qp);
    poll_none(rcq, Duration::from_millis(30));
    assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
    for cq in [scq, rcq] {
        assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    }
}

/// The other side of the same window: a requester killed right after
/// publishing a receive's completion (before it completes its own send,
/// and before any system call that follows, as the completion channel's
/// write) must not see that receive flushed again: the claim was released
/// before the completion became visible. Receive 1 completes once, with
/// success and the data; 2 and 3 flush.
#[test]
fn receive_completed_by_a_requester_killed_afterwards_is_not_flushed_again() {
    const NAME: &str = "receive_completed_by_a_requester_killed_afterwards_is_not_flushed_again";
    if let Some(ch) = child_chan() {
        return stalling_requester(ch);
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let (mut child, mut ch) = spawn_env(NAME, &[("SOFTVERBS_TEST_STALL_AFTER_CLAIM", "complete")]);
    let dev = Dev::open();
    let rcq = dev.cq(16, null_mut());
    let qp = dev.qp(rcq, rcq, null_mut());
    ch.send(&qpn(qp).to_string());
    let peer = ch.recv()[0] as u32;
    connect_with(qp, peer, DEAD_TIMEOUT, DEAD_RETRY);
    let dst = Buf::new(&dev, 256, 0);
    for id in 1..=3 {
        post_recv(qp, &dst, 64 * (id as usize - 1), 64, id);
    }
    ch.send("0");
    wait_stopped(&child);
    kill_and_wait_dead(&child);
    let done = poll(rcq, 1);
    assert_eq!(ids(&done), vec![(1, OK)]);
    assert_eq!(done[0].byte_len, 8);
    assert_eq!(dst.data[..8], [9; 8], "the data arrived");
    to_error(qp);
    assert_eq!(ids(&poll(rcq, 2)), vec![(2, FLUSH), (3, FLUSH)]);
    poll_none(rcq, Duration::from_millis(30));
    assert!(!child.wait().expect("reap").success());
    assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(rcq) }, 0);
}

/// On an SRQ a taken receive belongs to the QP it was taken for: a NIC
/// completes in error, on that QP's CQ, a WQE that QP consumed for a
/// message that never finished, and leaves the SRQ's other WQEs to the
/// other QPs. So the receive a killed requester took for `qb` is flushed
/// when `qb` fails — not when `qa` on the same SRQ fails — with `qb`'s
/// QPN on `qb`'s CQ, once; the SRQ's other receives still serve another QP.
#[test]
fn srq_receive_taken_by_a_killed_requester_flushes_on_its_qp() {
    const NAME: &str = "srq_receive_taken_by_a_killed_requester_flushes_on_its_qp";
    if let Some(ch) = child_chan() {
        return stalling_requester(ch);
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let (mut child, mut ch) = spawn_env(NAME, &[STALL]);
    let dev = Dev::open();
    let srq = dev.srq(16);
    let scq = dev.cq(16, null_mut());
    let (rcq_a, rcq_b, rcq_c) = (
        dev.cq(16, null_mut()),
        dev.cq(16, null_mut()),
        dev.cq(16, null_mut()),
    );
    let qa = dev.qp(scq, rcq_a, srq);
    let qb = dev.qp(scq, rcq_b, srq);
    // A local pair: qd sends to qc, which is on the SRQ too.
    let qc = dev.qp(scq, rcq_c, srq);
    let qd = dev.qp(scq, scq, null_mut());
    connect(qc, qpn(qd));
    connect(qd, qpn(qc));
    ch.send(&format!("{} {}", qpn(qa), qpn(qb)));
    let p = ch.recv();
    connect_with(qa, p[0] as u32, DEAD_TIMEOUT, DEAD_RETRY);
    connect_with(qb, p[1] as u32, DEAD_TIMEOUT, DEAD_RETRY);
    let dst = Buf::new(&dev, 256, 0);
    for id in 1..=3 {
        post_srq_recv(srq, &dst, 64 * (id as usize - 1), 64, id);
    }
    // The requester sends to qb and is stopped holding receive 1.
    ch.send("1");
    wait_stopped(&child);
    // Dead but not yet reaped (a zombie) while the QPs fail.
    kill_and_wait_dead(&child);
    to_error(qa);
    poll_none(rcq_a, Duration::from_millis(30));
    poll_none(rcq_b, Duration::from_millis(10));
    to_error(qb);
    let wcs = poll(rcq_b, 1);
    assert_eq!(ids(&wcs), vec![(1, FLUSH)]);
    assert_eq!(wcs[0].qp_num, qpn(qb));
    poll_none(rcq_b, Duration::from_millis(30));
    poll_none(rcq_a, Duration::from_millis(10));
    assert!(!child.wait().expect("reap").success());
    // Receives 2 and 3 stayed in the SRQ, for qc.
    let src = Buf::new(&dev, 64, 5);
    for id in [60, 61] {
        assert_eq!(post_send(qd, &src, 0, 8, id, send(WR_SEND, SIGNALED)), 0);
    }
    assert_eq!(ids(&poll(scq, 2)), vec![(60, OK), (61, OK)]);
    let wcs = poll(rcq_c, 2);
    assert_eq!(ids(&wcs), vec![(2, OK), (3, OK)]);
    assert!(wcs.iter().all(|w| w.qp_num == qpn(qc)));
    // qb's flush never comes twice; the slot the dead requester held was
    // released: the SRQ takes its full depth again.
    to_error(qb);
    poll_none(rcq_b, Duration::from_millis(10));
    for id in 0..16 {
        post_srq_recv(srq, &dst, 0, 64, 100 + id);
    }
    for q in [qa, qb, qc, qd] {
        assert_eq!(unsafe { ibv_destroy_qp(q) }, 0);
    }
    assert_eq!(unsafe { ibv_destroy_srq(srq) }, 0);
    for cq in [scq, rcq_a, rcq_b, rcq_c] {
        assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    }
}

const RACE_ROUNDS: u64 = 300;
const RACE_RECVS: u64 = 64;

/// The race between a live requester completing a receive it took and
/// the responder flushing its queue: each round the requester (another
/// process) SENDs as fast as it can while the responder moves its QP to
/// ERR at a varying moment. Every receive completes exactly once —
/// success for those the requester took (a prefix, in order), flush for
/// the rest — and the successes are exactly the requester's successful
/// sends.
#[test]
fn live_requester_and_flush_complete_each_receive_once() {
    const NAME: &str = "live_requester_and_flush_complete_each_receive_once";
    if let Some(ch) = child_chan() {
        return racing_requester(ch);
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let (mut child, mut ch) = spawn(NAME);
    let dev = Dev::open();
    let dst = Buf::new(&dev, 64 * RACE_RECVS as usize, 0);
    let (mut flushed_some, mut succeeded_some) = (0, 0);
    for round in 0..RACE_ROUNDS {
        let (scq, rcq) = (dev.cq(16, null_mut()), dev.cq(128, null_mut()));
        let qp = dev.qp(scq, rcq, null_mut());
        ch.send(&qpn(qp).to_string());
        let peer = ch.recv()[0] as u32;
        connect_with(qp, peer, 1, 1);
        for i in 0..RACE_RECVS {
            post_recv(qp, &dst, 64 * i as usize, 64, round * 1000 + i);
        }
        ch.send("go");
        // Fail the QP as soon as the requester completed 1..=48 receives
        // (varying by round): it is sending the next ones meanwhile.
        let mut wcs = poll(rcq, 1 + (round % 48) as usize);
        to_error(qp);
        wcs.extend(poll(rcq, RACE_RECVS as usize - wcs.len()));
        let sent_ok = ch.recv()[0];
        // The requester's last receive completion precedes its send's.
        poll_none(rcq, Duration::from_millis(1));
        let mut seen: Vec<u64> = wcs.iter().map(|w| w.wr_id - round * 1000).collect();
        seen.sort_unstable();
        assert_eq!(
            seen,
            (0..RACE_RECVS).collect::<Vec<_>>(),
            "round {round}: every receive exactly once: {:?}",
            ids(&wcs)
        );
        let ok: Vec<u64> = wcs
            .iter()
            .filter(|w| w.status == OK)
            .map(|w| w.wr_id - round * 1000)
            .collect();
        let flushed: Vec<u64> = wcs
            .iter()
            .filter(|w| w.status == FLUSH)
            .map(|w| w.wr_id - round * 1000)
            .collect();
        assert_eq!(
            ok.len() + flushed.len(),
            RACE_RECVS as usize,
            "round {round}: {:?}",
            ids(&wcs)
        );
        assert_eq!(
            ok,
            (0..ok.len() as u64).collect::<Vec<_>>(),
            "round {round}: taken in order"
        );
        assert!(
            flushed.windows(2).all(|w| w[0] < w[1]),
            "round {round}: flushed in order"
        );
        assert_eq!(
            ok.len() as u64,
            sent_ok,
            "round {round}: receives vs the requester's sends"
        );
        flushed_some += u32::from(!flushed.is_empty() && !ok.is_empty());
        succeeded_some += u32::from(!ok.is_empty());
        assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
        for cq in [scq, rcq] {
            assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
        }
    }
    ch.send("0");
    assert!(child.wait().expect("wait").success(), "requester failed");
    // The flush must really have met the requester mid-queue.
    println!("rounds with both completions and flushes: {flushed_some} of {RACE_ROUNDS}; with completions: {succeeded_some}");
    assert!(
        flushed_some > 0,
        "the error never came while the requester sent"
    );
}

fn racing_requester(mut ch: Chan) {
    let dev = Dev::open();
    let src = Buf::new(&dev, 64, 3);
    loop {
        let peer = ch.recv()[0] as u32;
        if peer == 0 {
            return;
        }
        let cq = dev.cq(64, null_mut());
        let qp = dev.qp(cq, cq, null_mut());
        ch.send(&qpn(qp).to_string());
        connect_with(qp, peer, 1, 1);
        let _go = ch.recv();
        let mut ok = 0u64;
        for id in 0.. {
            assert_eq!(post_send(qp, &src, 0, 8, id, send(WR_SEND, SIGNALED)), 0);
            if poll(cq, 1)[0].status == OK {
                ok += 1;
            } else {
                break;
            }
            // Paced (10..=41 µs apart), so that the responder's error lands
            // anywhere in the stream, inside a SEND as well as between two.
            let until = Instant::now() + Duration::from_micros(10 + id % 32);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
        ch.send(&ok.to_string());
        assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
        assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    }
}
