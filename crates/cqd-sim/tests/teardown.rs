//! QPs on an SRQ that go away while their CQ still holds completions of
//! theirs: the simulated NIC purges a destroyed QP's completions, as mlx5
//! does, so a QP is destroyed only once every completion of it is
//! accounted (`cqd_core::ledger` module `teardown`).

mod common;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use common::{Log, Recorder};
use cqd_core::{CqOptions, NoWork, PollMode, PollerBuilder, Side};
use cqd_sim::{
    connect, Access, Cq, CqConfig, Device, Pd, Qp, QpCap, QpInit, RecvWr, SendWr, Srq, WrOp,
};

const SERVER_CAP: QpCap = QpCap {
    max_send_wr: 16,
    max_recv_wr: 0,
    max_send_sge: 1,
    max_recv_sge: 1,
};

/// A server QP on `srq` completing on `cq`, connected to a client whose
/// CQ nobody polls (its sends are unsignaled).
fn pair(pd: &Pd, cq: &Cq, ccq: &Cq, srq: &Srq) -> (Qp, Qp) {
    let server = pd
        .create_qp(&QpInit::new(cq, cq, SERVER_CAP).with_srq(srq))
        .unwrap();
    let client = pd
        .create_qp(&QpInit::new(ccq, ccq, QpCap::default()))
        .unwrap();
    connect(&server, &client).unwrap();
    (server, client)
}

fn send(client: &Qp, pd: &Pd, n: u64) {
    let msg = pd.reg_mr(8, Access::LOCAL_WRITE).unwrap();
    let sge = [msg.sge(0, 8)];
    for i in 0..n {
        client
            .post_send_unaccounted(&[SendWr::new(i, WrOp::Send, &sge).unsignaled()])
            .unwrap();
    }
}

/// Dropped with five of its receive completions (and two of another QP's)
/// still in the CQ, a QP on an SRQ waits until they are accounted: every
/// one reaches the handler, the NIC purges nothing, and nothing of the QP
/// stays in the CQ's ledger. (Destroyed at once, as before, the NIC purged
/// those five completions and their five receives stayed outstanding in
/// the SRQ's account for good.)
#[test]
fn a_qp_on_an_srq_dropped_with_completions_queued_waits_for_them() {
    let dev = Device::open("sim0");
    let (cq, poller, handle) = dev
        .create_dispatched_cq::<NoWork>("server", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 256, CqConfig::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let mut poller = poller.bind();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(64, 1).unwrap();
    let (s1, c1) = pair(&pd, &cq, &ccq, &srq);
    let (queues, users) = (cq.ledger().queue_count(), cq.ledger().srq_users());
    let (s0, c0) = pair(&pd, &cq, &ccq, &srq);
    let bufs = pd.reg_mr(64 * 8, Access::LOCAL_WRITE).unwrap();
    let sges: Vec<_> = (0..8u64).map(|i| [bufs.sge(i * 64, 64)]).collect();
    let mut recvs: Vec<_> = (0..8u32)
        .map(|i| RecvWr::new(u64::from(i), &sges[i as usize]))
        .collect();
    reg.post_recv(&srq, &mut recvs).unwrap();
    send(&c0, &pd, 3);
    send(&c1, &pd, 2);
    send(&c0, &pd, 2);
    assert_eq!(cq.producer().len(), 7, "nothing polled yet");
    let s0_qpn = s0.qpn();
    drop(s0);
    let nic = dev.fabric().stats();
    assert_eq!(nic.purged, 0, "not destroyed while its completions wait");
    assert_eq!(cq.producer().len(), 7);
    // The poller accounts the batch, takes LAST_WQE_REACHED, and quiesces
    // the QP at its next short poll, which destroys it.
    let mut out = VecDeque::new();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    assert_eq!(poller.check_async(), 1, "the QP's last WQE");
    assert_eq!(poller.poll_once(&mut out).unwrap(), 0);
    let evs = log.take();
    assert_eq!(evs.len(), 7, "each completion once");
    assert!(evs.iter().all(|e| e.side == Side::Recv && e.ok));
    assert_eq!(evs.iter().filter(|e| e.qp == s0_qpn).count(), 5);
    let mut tags: Vec<u32> = evs.iter().map(|e| e.tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, (0..7).collect::<Vec<_>>());
    assert_eq!(dev.fabric().stats().purged, 0);
    assert_eq!(reg.ledger().outstanding(), 1, "one receive left in the SRQ");
    assert_eq!(srq.available(), 1);
    assert_eq!(srq.users(), 1, "the QP is gone from the NIC");
    assert_eq!(
        (cq.ledger().queue_count(), cq.ledger().srq_users()),
        (queues, users),
        "nothing of the QP is left in the ledger"
    );
    drop((s1, c0, c1));
}

/// When the CQ's poller is gone, nobody can account what the CQ holds: a
/// dropped QP is destroyed at once, and the NIC purges its completions.
#[test]
fn without_a_poller_the_nic_purges_a_dropped_qps_completions() {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("server", 256, CqConfig::default()).unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 256, CqConfig::default()).unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(8, 1).unwrap();
    let (s0, c0) = pair(&pd, &cq, &ccq, &srq);
    let (s1, c1) = pair(&pd, &cq, &ccq, &srq);
    let bufs = pd.reg_mr(64 * 8, Access::LOCAL_WRITE).unwrap();
    let sges: Vec<_> = (0..8u64).map(|i| [bufs.sge(i * 64, 64)]).collect();
    let recvs: Vec<_> = (0..8u64)
        .map(|i| RecvWr::new(i, &sges[i as usize]))
        .collect();
    srq.post_recv_unaccounted(&recvs).unwrap();
    send(&c0, &pd, 2);
    send(&c1, &pd, 1);
    send(&c0, &pd, 1);
    assert_eq!((cq.producer().len(), srq.available()), (4, 4));
    drop(src);
    drop(s0);
    let nic = dev.fabric().stats();
    assert_eq!(nic.purged, 3, "s0's three completions");
    assert_eq!(cq.producer().len(), 1, "s1's is still there");
    // The three receives the purged completions consumed are gone, and
    // their slots are free: the SRQ (depth 8: four still posted, s1's
    // receive held until its completion is polled) takes three more.
    let more: Vec<_> = (0..4u64).map(|i| RecvWr::new(8 + i, &sges[0])).collect();
    srq.post_recv_unaccounted(&more[..3]).unwrap();
    assert_eq!(srq.available(), 7);
    assert!(
        srq.post_recv_unaccounted(&more[3..]).is_err(),
        "s1's unpolled completion still holds its slot"
    );
    assert_eq!(srq.users(), 1);
    drop(s1);
    assert_eq!(dev.fabric().stats().purged, 4, "and s1's");
    assert_eq!((cq.producer().len(), srq.users()), (0, 0));
    srq.post_recv_unaccounted(&more[3..]).unwrap();
    drop((c0, c1));
}

/// Connections that come and go on one SRQ, with a poller thread in each
/// mode: each closed connection's QP is destroyed by the poller once its
/// completions are accounted (its admission then comes back, so the next
/// one fits); after 200 closes the CQ's ledger holds what it held with the
/// live connections alone, every message reached the handler once, and
/// the stop balances.
fn churn_leaves_nothing_behind(mode: PollMode) {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("server", 1024, CqConfig::default()).unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 1024, CqConfig::default()).unwrap();
    let (unbound, handle) = cqd_core::split::<NoWork>(src, CqOptions::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let thread = PollerBuilder::new("churn", cqd_core::NoSink)
        .mode(mode)
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(256, 1).unwrap();
    let bufs = pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = [bufs.sge(0, 64)];
    let live: Vec<_> = (0..4).map(|_| pair(&pd, &cq, &ccq, &srq)).collect();
    let (queues, users) = (cq.ledger().queue_count(), cq.ledger().srq_users());
    const CYCLES: u64 = 200;
    const PER: u64 = 3;
    let mut tag = 0u64;
    for _ in 0..CYCLES {
        let (s, c) = pair(&pd, &cq, &ccq, &srq);
        let mut recvs: Vec<_> = (0..PER).map(|i| RecvWr::new(tag + i, &sge)).collect();
        reg.post_recv(&srq, &mut recvs).unwrap();
        tag += PER;
        send(&c, &pd, PER);
        drop((s, c));
        // The poller destroys it once it has accounted its completions
        // and quiesced it.
        let started = Instant::now();
        while srq.users() > live.len() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "never destroyed: {} SRQ users in the NIC, {} in the ledger",
                srq.users(),
                cq.ledger().srq_users()
            );
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let want = (CYCLES * PER) as usize;
    assert_eq!(
        log.0.lock().len(),
        want,
        "all accounted before each destroy"
    );
    assert_eq!(
        (cq.ledger().queue_count(), cq.ledger().srq_users()),
        (queues, users),
        "the ledger holds the live connections only"
    );
    assert_eq!(dev.fabric().stats().purged, 0);
    let report = thread.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    let mut tags: Vec<u32> = log.take().iter().map(|e| e.tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, (0..want as u32).collect::<Vec<_>>(), "each once");
    drop(live);
}

mod churn {
    use super::*;
    use cqd_core::Adaptive;

    #[test]
    fn busy() {
        churn_leaves_nothing_behind(PollMode::Busy)
    }
    #[test]
    fn event() {
        churn_leaves_nothing_behind(PollMode::Event)
    }
    #[test]
    fn hybrid() {
        churn_leaves_nothing_behind(PollMode::Hybrid {
            spin: Duration::from_micros(50),
        })
    }
    #[test]
    fn adaptive() {
        churn_leaves_nothing_behind(PollMode::Adaptive(Adaptive::default()))
    }
}

/// The stop hands back the receives still posted on an SRQ once no QP
/// can take them (its QPs dropped, or in the error state and quiesced):
/// each reaches its handler as a flush, once, is counted returned, and the
/// stop balances. While a QP that could still take one is live, they stay
/// missing.
fn the_stop_hands_back_an_srqs_unused_receives(mode: PollMode) {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("server", 256, CqConfig::default()).unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 256, CqConfig::default()).unwrap();
    let (unbound, handle) = cqd_core::split::<NoWork>(src, CqOptions::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let thread = PollerBuilder::new("stop", cqd_core::NoSink)
        .mode(mode)
        .drain_timeout(Duration::from_secs(20))
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(64, 1).unwrap();
    let bufs = pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = [bufs.sge(0, 64)];
    let (s0, c0) = pair(&pd, &cq, &ccq, &srq);
    let (s1, c1) = pair(&pd, &cq, &ccq, &srq);
    let mut recvs: Vec<_> = (0..16u64).map(|t| RecvWr::new(t, &sge)).collect();
    reg.post_recv(&srq, &mut recvs).unwrap();
    send(&c0, &pd, 3);
    send(&c1, &pd, 2);
    // One connection closed, the other in the error state (still held).
    drop((s0, c0));
    s1.force_error();
    let started = Instant::now();
    while log.0.lock().len() < 5 || cq.ledger().srq_users() > 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "never quiesced"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    let report = thread.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(report.cqs[0].srq_returned, 11);
    let evs = log.take();
    let (done, flushed): (Vec<&common::Ev>, Vec<_>) = evs.iter().partition(|e| e.ok);
    assert_eq!((done.len(), flushed.len()), (5, 11));
    assert!(flushed
        .iter()
        .all(|e| e.side == Side::Recv && e.status == cqd_core::Status::WrFlush));
    let mut tags: Vec<u32> = evs.iter().map(|e| e.tag).collect();
    tags.sort_unstable();
    assert_eq!(tags, (0..16).collect::<Vec<_>>(), "each receive once");
    drop((s1, c1));
}

/// A QP still able to take the SRQ's receives keeps them posted: the stop
/// cannot hand them back, and says they are missing.
#[test]
fn a_live_srq_user_keeps_the_stop_from_handing_back() {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("server", 256, CqConfig::default()).unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 256, CqConfig::default()).unwrap();
    let (unbound, handle) = cqd_core::split::<NoWork>(src, CqOptions::default()).unwrap();
    let reg = handle.register(Recorder(Log::default())).unwrap();
    let thread = PollerBuilder::new("stop", cqd_core::NoSink)
        .drain_timeout(Duration::from_millis(50))
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(8, 1).unwrap();
    let bufs = pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = [bufs.sge(0, 64)];
    let (s0, c0) = pair(&pd, &cq, &ccq, &srq);
    let mut recvs: Vec<_> = (0..4u64).map(|t| RecvWr::new(t, &sge)).collect();
    reg.post_recv(&srq, &mut recvs).unwrap();
    let report = thread.stop().unwrap();
    assert!(!report.accounts.is_balanced());
    assert_eq!(report.cqs[0].srq_returned, 0);
    assert_eq!(
        report.accounts.missing().map(|a| a.missing()).sum::<u64>(),
        4
    );
    drop((s0, c0));
}

mod stop_hands_back {
    use super::*;
    use cqd_core::Adaptive;

    #[test]
    fn busy() {
        the_stop_hands_back_an_srqs_unused_receives(PollMode::Busy)
    }
    #[test]
    fn event() {
        the_stop_hands_back_an_srqs_unused_receives(PollMode::Event)
    }
    #[test]
    fn hybrid() {
        the_stop_hands_back_an_srqs_unused_receives(PollMode::Hybrid {
            spin: Duration::from_micros(50),
        })
    }
    #[test]
    fn adaptive() {
        the_stop_hands_back_an_srqs_unused_receives(PollMode::Adaptive(Adaptive::default()))
    }
}

/// A future's executor for one future: parks the thread until woken.
fn block_on<F: std::future::Future>(f: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let std::task::Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

/// One call closes a connection while another keeps running: its
/// outstanding requests come back as flushes, once each, the wait (and
/// the future) ends when the QP is destroyed, its admission is back, and
/// the other connection goes on.
fn close_one_connection_while_another_runs(mode: PollMode) {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("server", 512, CqConfig::default()).unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 512, CqConfig::default()).unwrap();
    let (unbound, handle) = cqd_core::split::<NoWork>(src, CqOptions::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let thread = PollerBuilder::new("close", cqd_core::NoSink)
        .mode(mode)
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(64, 1).unwrap();
    let bufs = pd.reg_mr(4096, Access::LOCAL_WRITE).unwrap();
    let sge = [bufs.sge(0, 64)];
    let own = QpCap {
        max_send_wr: 16,
        max_recv_wr: 16,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let reserved = cq.budget_snapshot().reserved;
    // A connection with its own receive queue, four receives posted and
    // never used; one on the SRQ.
    let a = pd.create_qp(&QpInit::new(&cq, &cq, own)).unwrap();
    let ca = pd
        .create_qp(&QpInit::new(&ccq, &ccq, QpCap::default()))
        .unwrap();
    connect(&a, &ca).unwrap();
    let mut recvs: Vec<_> = (0..4u64).map(|t| RecvWr::new(t, &sge)).collect();
    reg.post_recv(&a, &mut recvs).unwrap();
    let (b, cb) = pair(&pd, &cq, &ccq, &srq);
    let mut srecvs: Vec<_> = (10..20u64).map(|t| RecvWr::new(t, &sge)).collect();
    reg.post_recv(&srq, &mut srecvs).unwrap();
    assert!(cq.budget_snapshot().reserved > reserved);
    // Close the first: blocking wait.
    a.close().wait(Duration::from_secs(30)).unwrap();
    let flushed: Vec<u32> = log.take().iter().filter(|e| !e.ok).map(|e| e.tag).collect();
    assert_eq!(
        flushed,
        [0, 1, 2, 3],
        "each outstanding receive flushed once"
    );
    // The other still receives.
    send(&cb, &pd, 2);
    let started = Instant::now();
    while log.0.lock().len() < 2 {
        assert!(started.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(1));
    }
    assert!(log.take().iter().all(|e| e.ok && e.qp == b.qpn()));
    // Close the second: awaited.
    block_on(b.close());
    assert_eq!(cq.ledger().srq_users(), 0);
    drop((ca, cb));
    let snap = cq.budget_snapshot();
    assert_eq!(
        snap.reserved, reserved,
        "every admission came back, the SRQ's with its last QP"
    );
    let report = thread.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(report.cqs[0].srq_returned, 8);
}

/// A close whose completions nobody accounts says which QP and what it
/// waits for, and ends once they are.
#[test]
fn a_close_that_cannot_end_names_the_qp_and_what_it_waits_for() {
    let dev = Device::open("sim0");
    let (cq, poller, handle) = dev
        .create_dispatched_cq::<NoWork>("server", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let (ccq, _csrc) = dev.create_cq("clients", 256, CqConfig::default()).unwrap();
    let reg = handle.register(Recorder(Log::default())).unwrap();
    let mut poller = poller.bind();
    let pd = dev.alloc_pd();
    let srq = pd.create_srq(16, 1).unwrap();
    let bufs = pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = [bufs.sge(0, 64)];
    let (s, c) = pair(&pd, &cq, &ccq, &srq);
    let qpn = s.qpn();
    let mut recvs: Vec<_> = (0..4u64).map(|t| RecvWr::new(t, &sge)).collect();
    reg.post_recv(&srq, &mut recvs).unwrap();
    send(&c, &pd, 1);
    let wait = s.close();
    let e = wait.wait(Duration::from_millis(20)).unwrap_err();
    assert_eq!(
        (e.qp_num, e.sends, e.recvs, e.srq),
        (qpn, 0, 0, Some((1, false)))
    );
    let text = e.to_string();
    assert!(
        text.contains(&format!("QP {qpn}")) && text.contains("LAST_WQE_REACHED"),
        "{text}"
    );
    // The poller accounts the receive and takes the event; the short poll
    // after it destroys the QP.
    let mut out = VecDeque::new();
    while poller.poll_once(&mut out).unwrap() > 0 {}
    poller.check_async();
    let e = wait.wait(Duration::ZERO).unwrap_err();
    assert_eq!(e.srq, Some((1, true)), "{e}");
    poller.poll_once(&mut out).unwrap();
    wait.wait(Duration::from_secs(5)).unwrap();
    assert!(wait.is_done());
    drop(c);
}

mod close {
    use super::*;
    use cqd_core::Adaptive;

    #[test]
    fn busy() {
        close_one_connection_while_another_runs(PollMode::Busy)
    }
    #[test]
    fn event() {
        close_one_connection_while_another_runs(PollMode::Event)
    }
    #[test]
    fn hybrid() {
        close_one_connection_while_another_runs(PollMode::Hybrid {
            spin: Duration::from_micros(50),
        })
    }
    #[test]
    fn adaptive() {
        close_one_connection_while_another_runs(PollMode::Adaptive(Adaptive::default()))
    }
}

/// A retired handler's end can be waited for, or awaited, without polling
/// a flag: not while its requests are outstanding, at once when their
/// flushes are polled; a retirement the stop cuts short ends with it.
fn a_retired_handlers_end_can_be_waited_for(mode: PollMode) {
    let dev = Device::open("sim0");
    let (cq, src) = dev.create_cq("server", 256, CqConfig::default()).unwrap();
    let (unbound, handle) = cqd_core::split::<NoWork>(src, CqOptions::default()).unwrap();
    let log = Log::default();
    let reg = handle.register(Recorder(log.clone())).unwrap();
    let idle = handle.register(Recorder(Log::default())).unwrap();
    let other = handle.register(Recorder(Log::default())).unwrap();
    let thread = PollerBuilder::new("retire", cqd_core::NoSink)
        .mode(mode)
        .drain_timeout(Duration::from_millis(50))
        .cq(unbound)
        .spawn()
        .unwrap();
    let pd = dev.alloc_pd();
    let own = QpCap {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, own)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, own)).unwrap();
    connect(&a, &b).unwrap();
    let bufs = pd.reg_mr(64, Access::LOCAL_WRITE).unwrap();
    let sge = [bufs.sge(0, 64)];
    let mut recvs: Vec<_> = (0..3u64).map(|t| RecvWr::new(t, &sge)).collect();
    reg.post_recv(&a, &mut recvs).unwrap();
    let mut parked: Vec<_> = (0..2u64).map(|t| RecvWr::new(t, &sge)).collect();
    other.post_recv(&b, &mut parked).unwrap();
    // A handler with nothing outstanding goes at once.
    block_on(handle.unregister(idle.key()).unwrap());
    let retired = handle.unregister(reg.key()).unwrap();
    let e = retired.wait(Duration::from_millis(20)).unwrap_err();
    assert_eq!(e.key, reg.key());
    assert!(!retired.is_done());
    // Its receives flush: it drains, and is gone.
    a.close().wait(Duration::from_secs(30)).unwrap();
    retired.wait(Duration::from_secs(30)).unwrap();
    assert_eq!(log.take().len(), 3, "its three flushes first");
    // One the stop cuts short (its receives on a live QP never complete).
    let cut = handle.unregister(other.key()).unwrap();
    let report = thread.stop().unwrap();
    assert!(
        !report.accounts.is_balanced(),
        "b's two receives are missing"
    );
    cut.wait(Duration::from_secs(5)).unwrap();
    drop(b);
}

mod retire {
    use super::*;
    use cqd_core::Adaptive;

    #[test]
    fn busy() {
        a_retired_handlers_end_can_be_waited_for(PollMode::Busy)
    }
    #[test]
    fn event() {
        a_retired_handlers_end_can_be_waited_for(PollMode::Event)
    }
    #[test]
    fn hybrid() {
        a_retired_handlers_end_can_be_waited_for(PollMode::Hybrid {
            spin: Duration::from_micros(50),
        })
    }
    #[test]
    fn adaptive() {
        a_retired_handlers_end_can_be_waited_for(PollMode::Adaptive(Adaptive::default()))
    }
}
