//! A poller's CQ set grows while it runs (`PollerThread::add_cq`).

use std::time::Duration;

use cqd_core::{JoinError, OpKind};

use crate::backend::{Backend, Cap, Op};
use crate::support::{mode, poller, slow, wait_until, Log, Recorder};
use crate::{assert_clean, assert_each_once};

/// A poller over `cq` whose safety net is long (2 s): a completion it
/// finds before the CQ's own notification is counted recovered, which the
/// tests that use it refuse (a device slower than that to notify would
/// fail them, not one that notifies).
fn notified_poller(
    name: &str,
    mode_name: &str,
    cq: cqd_core::UnboundCq<cqd_core::NoWork>,
) -> cqd_core::PollerThread {
    cqd_core::PollerBuilder::new(name, cqd_core::NoSink)
        .mode(mode(mode_name))
        .wake_timeout(Duration::from_secs(2))
        .drain_timeout(Duration::from_secs(10) * slow())
        .cq(cq)
        .spawn()
        .expect("spawn the poller")
}

/// CQs added to a running poller, in every mode, while its first CQ has
/// traffic: one with a notification descriptor of its own, then two on one
/// shared completion channel (the second finds the channel registered).
/// Each is polled from the poller's next round and its notifications wake
/// the poller (no completion is found by the safety net alone); a name the
/// poller polls already is refused, and so is a CQ after the stop (handed
/// back). The stop's report has every CQ, clean.
pub fn grow_running<B: Backend>(mode_name: &str) {
    const N: u32 = 32;
    let dev = B::open();
    let mr = B::reg_mr(&dev, 64 * 1024);
    let (cq_a, ua, ha) = B::dispatched_cq(&dev, "grow-a", 1024, true);
    let log = Log::default();
    let reg_a = ha.register(Recorder(log.clone())).unwrap();
    let t = notified_poller("grow", mode_name, ua);
    let chan = B::channel(&dev);
    let (cq_b, ub, hb) = B::dispatched_cq(&dev, "grow-b", 1024, true);
    let (cq_c, uc, hc) = B::dispatched_cq_on(&dev, "grow-c", 1024, &chan);
    let (cq_d, ud, hd) = B::dispatched_cq_on(&dev, "grow-d", 1024, &chan);
    let joined = [ub, uc, ud].map(|u| t.add_cq(u).map_err(|n| n.error().clone()).unwrap());
    let cqs = [(&cq_a, &ha), (&cq_b, &hb), (&cq_c, &hc), (&cq_d, &hd)];
    let regs = [
        reg_a,
        hb.register(Recorder(log.clone())).unwrap(),
        hc.register(Recorder(log.clone())).unwrap(),
        hd.register(Recorder(log.clone())).unwrap(),
    ];
    let mut pairs = Vec::new();
    let mut tag = 0;
    // Each CQ gets a connection, and its messages; the first CQ's go
    // while the others join.
    for (k, ((cq, _), reg)) in cqs.iter().zip(&regs).enumerate() {
        if k == 1 {
            for j in &joined {
                j.wait(Duration::from_secs(30))
                    .unwrap_or_else(|e| panic!("{}: {e}", B::NAME));
            }
        }
        let (a, b) = B::pair(&dev, cq, cq, Cap { send: 64, recv: 64 });
        let rsg: Vec<_> = (0..N)
            .map(|i| [B::sge(&mr, ((k as u32 * N + i) * 64) as usize, 64)])
            .collect();
        let mut r: Vec<_> = (0..N)
            .map(|i| B::recv_wr(tag + i, &rsg[i as usize]))
            .collect();
        reg.post_recv(&b, &mut r).unwrap();
        let ssg = [B::sge(&mr, 60 * 1024, 8)];
        for i in 0..N {
            // Spaced out, so that the poller goes to sleep between them in
            // the sleeping modes, and must be woken by the CQ's descriptor.
            if i % 8 == 0 {
                std::thread::sleep(Duration::from_millis(2));
            }
            reg.post_send(
                &a,
                &mut [B::send_wr(10_000 + tag + i, Op::Send, &ssg, true)],
            )
            .unwrap();
        }
        tag += N;
        pairs.push((a, b));
    }
    let want = 2 * 4 * N as usize;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == want),
        "{}: {} of {want} completions",
        B::NAME,
        log.len()
    );
    for (cq, h) in &cqs[1..] {
        let _ = cq;
        let s = h.snapshot();
        assert_eq!(
            s.recovered_missed_events,
            0,
            "{}: {}'s completions were found by the safety net, not its notifications",
            B::NAME,
            s.name
        );
    }
    // A second CQ named as one the poller polls.
    let (_cq_b2, ub2, _hb2) = B::dispatched_cq(&dev, "grow-b", 16, false);
    let again = t.add_cq(ub2).map_err(|n| n.error().clone()).unwrap();
    assert!(
        matches!(again.wait(Duration::from_secs(30)), Err(JoinError::Duplicate { ref cq, .. }) if cq == "grow-b"),
        "{}",
        B::NAME
    );
    drop(pairs);
    let mut threads = vec![t];
    let report = cqd_core::shutdown(|| {}, threads.drain(..), []);
    assert_clean("grow_running", &report);
    let names: Vec<_> = report.pollers[0]
        .cqs
        .iter()
        .map(|c| c.name.clone())
        .collect();
    assert_eq!(
        names,
        ["grow-a", "grow-b", "grow-c", "grow-d"],
        "{}",
        B::NAME
    );
    let evs = log.snapshot();
    assert_each_once("grow", &evs, OpKind::Recv, 0..4 * N);
    assert_each_once("grow", &evs, OpKind::Send, 10_000..10_000 + 4 * N);
}

/// A CQ handed over as the poller stops: the `Joining` always gets an
/// answer, and it agrees with the report (joined: the report has the CQ;
/// refused: `Ended`, the CQ finished). Which one depends on whether the
/// poller took its doorbell before its stop flag.
pub fn join_as_it_stops<B: Backend>(mode_name: &str) {
    let dev = B::open();
    let (_cq_a, ua, _ha) = B::dispatched_cq(&dev, "late-a", 64, false);
    let t = poller("late", mode(mode_name), vec![ua]);
    let (_cq_b, ub, _hb) = B::dispatched_cq(&dev, "late-b", 64, false);
    let joining = t.add_cq(ub).map_err(|n| n.error().clone()).unwrap();
    let report = t.stop().unwrap();
    let joined = report.cqs.iter().any(|c| c.name == "late-b");
    match joining.wait(Duration::from_secs(30)) {
        Ok(()) => assert!(joined, "{}: joined, but not in the report", B::NAME),
        Err(JoinError::Ended { cq, .. }) => {
            assert_eq!(cq, "late-b");
            assert!(!joined, "{}: refused, but in the report", B::NAME);
        }
        Err(e) => panic!("{}: {e}", B::NAME),
    }
}

/// A connection from `pool` (a QP pair on the CQ it gives, 32 entries of
/// admission, a handler recording into `log`) with `msgs` messages sent on
/// it: receives tagged from `tag`, sends from `100_000 + tag`.
fn open_with_messages<B: Backend>(
    pool: &cqd_core::CqPool<B::Cq, cqd_core::NoWork>,
    dev: &B::Dev,
    mr: &B::Mr,
    log: &Log,
    tag: u32,
    msgs: u32,
) -> (B::Qp, B::Qp, cqd_core::Registration) {
    let cap = Cap { send: 8, recv: 8 };
    let conn = pool
        .open(32, None, |cq, h| {
            let reg = h
                .register(Recorder(log.clone()))
                .map_err(|e| e.to_string())?;
            let (a, b) = B::pair(dev, cq, cq, cap);
            Ok::<_, String>((a, b, reg))
        })
        .unwrap_or_else(|e| panic!("{}: {e}", B::NAME));
    let (a, b, reg) = &conn;
    post_messages::<B>(reg, a, b, mr, tag, msgs, false);
    conn
}

/// `msgs` messages from `a` to `b`, `b`'s receives posted first: receives
/// tagged from `tag`, sends from `100_000 + tag`. `spaced`: a pause of
/// 1 ms before every fourth send, so that a sleeping poller must be woken
/// by the CQ's notification.
fn post_messages<B: Backend>(
    reg: &cqd_core::Registration,
    a: &B::Qp,
    b: &B::Qp,
    mr: &B::Mr,
    tag: u32,
    msgs: u32,
    spaced: bool,
) {
    let rsg: Vec<_> = (0..msgs)
        .map(|i| [B::sge(mr, (((tag + i) % 512) * 64) as usize, 64)])
        .collect();
    let mut r: Vec<_> = (0..msgs)
        .map(|i| B::recv_wr(tag + i, &rsg[i as usize]))
        .collect();
    reg.post_recv(b, &mut r).unwrap();
    let ssg = [B::sge(mr, 60 * 1024, 8)];
    for i in 0..msgs {
        if spaced && i % 4 == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        reg.post_send(
            a,
            &mut [B::send_wr(100_000 + tag + i, Op::Send, &ssg, true)],
        )
        .unwrap();
    }
}

/// A CQ pool over two running pollers: connections (a QP pair on one CQ,
/// 32 entries of admission) come and go with traffic. The pool grows past
/// its first CQ's capacity onto both pollers, the way its fit says; a
/// closed connection's capacity comes back and is used again without
/// growing; a connection larger than the pool's CQ size is refused. Every
/// message arrives once, and the stop is clean with every pool CQ in its
/// poller's report. A device may give a CQ more entries than asked (rxe
/// gives 127 for 64): the counts follow the capacity the pool reports.
pub fn cq_pool<B: Backend>(mode_name: &str) {
    use cqd_core::{CqPool, Fit, PoolError};
    const MSGS: u32 = 4;
    let dev = std::sync::Arc::new(B::open());
    let mr = B::reg_mr(&dev, 64 * 1024);
    let log = Log::default();
    let (_s0, u0, _h0) = B::dispatched_cq(&dev, "seed-0", 16, false);
    let (_s1, u1, _h1) = B::dispatched_cq(&dev, "seed-1", 16, false);
    let pollers = [
        poller("pool-p0", mode(mode_name), vec![u0]),
        poller("pool-p1", mode(mode_name), vec![u1]),
    ];
    let joiners = pollers.iter().map(|p| p.joiner().unwrap()).collect();
    let maker = std::sync::Arc::clone(&dev);
    let pool = CqPool::new("pool", 64, joiners, move |name, cqe| {
        Ok(B::dispatched_cq(&maker, name, cqe, true))
    })
    .fit(Fit::LeastUsed);
    let mut tag = 0;
    let mut open = |live: &mut Vec<_>| {
        live.push(open_with_messages::<B>(&pool, &dev, &mr, &log, tag, MSGS));
        tag += MSGS;
    };
    let mut live = Vec::new();
    open(&mut live);
    let capacity = pool.snapshot()[0].capacity;
    assert!(capacity >= 64, "{}: a CQ of {capacity} for 64", B::NAME);
    // Connections a CQ, and six CQs' worth of them.
    let per = capacity / 32;
    let total = 6 * per;
    for _ in 1..total {
        open(&mut live);
    }
    let snap = pool.snapshot();
    assert_eq!(
        snap.len(),
        6,
        "{}: {per} connections a CQ: {snap:?}",
        B::NAME
    );
    for p in ["pool-p0", "pool-p1"] {
        assert_eq!(
            snap.iter().filter(|c| c.poller == p).count(),
            3,
            "{}: least used spreads the CQs over the pollers: {snap:?}",
            B::NAME
        );
    }
    assert!(
        snap.iter()
            .all(|c| c.capacity == capacity && c.reserved == u64::from(per * 32)),
        "{snap:?}"
    );
    // Their messages arrive; then half the connections close (nothing
    // outstanding: no flush): their capacity comes back, and the next ones
    // take it without a new CQ.
    let first = (2 * MSGS * total) as usize;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == first),
        "{}: {} of {first} completions",
        B::NAME,
        log.len()
    );
    let half = (total / 2) as usize;
    let closing: Vec<_> = live.drain(..half).collect();
    for (a, b, _reg) in closing {
        B::close(a).wait(Duration::from_secs(30)).unwrap();
        B::close(b).wait(Duration::from_secs(30)).unwrap();
    }
    let freed: u64 = pool
        .snapshot()
        .iter()
        .map(|c| u64::from(per * 32) - c.reserved)
        .sum();
    assert_eq!(
        freed,
        half as u64 * 32,
        "{}: {:?}",
        B::NAME,
        pool.snapshot()
    );
    for _ in 0..half {
        open(&mut live);
    }
    assert_eq!(pool.snapshot().len(), 6, "{}: no growth", B::NAME);
    // A connection larger than the pool's CQ size is refused before any CQ
    // is chosen, whatever a device rounded the CQs up to.
    let big = pool.open(65, None, |_, _| Ok::<(), String>(()));
    assert!(
        matches!(
            big,
            Err(PoolError::TooLarge {
                needed: 65,
                cqe: 64,
                ..
            })
        ),
        "{big:?}"
    );
    let opened = total as usize + half;
    let want = 2 * MSGS as usize * opened;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == want),
        "{}: {} of {want} completions",
        B::NAME,
        log.len()
    );
    drop(live);
    let report = cqd_core::shutdown(|| {}, pollers, []);
    assert_clean("cq_pool", &report);
    let polled: usize = report.pollers.iter().map(|p| p.cqs.len()).sum();
    assert_eq!(polled, 2 + 6, "{}: the seeds and the pool's CQs", B::NAME);
    let evs = log.snapshot();
    let recvs: Vec<_> = evs
        .iter()
        .filter(|e| e.kind == OpKind::Recv && e.ok)
        .map(|e| e.tag)
        .collect();
    assert_eq!(recvs.len(), MSGS as usize * opened, "{}", B::NAME);
    let sends = 100_000..100_000 + MSGS * opened as u32;
    assert_each_once("cq_pool", &evs, OpKind::Send, sends);
}

/// A pool of CQs of 64 entries over one running poller (which polls a
/// seed CQ of its own), with `fit`; the seed is returned to be kept.
fn one_poller_pool<B: Backend>(
    name: &str,
    mode_name: &str,
    fit: cqd_core::Fit,
) -> (
    std::sync::Arc<B::Dev>,
    cqd_core::PollerThread,
    cqd_core::CqPool<B::Cq, cqd_core::NoWork>,
    impl Sized,
) {
    let dev = std::sync::Arc::new(B::open());
    let (s0, u0, h0) = B::dispatched_cq(&dev, &format!("{name}-seed"), 16, false);
    let t = poller(name, mode(mode_name), vec![u0]);
    let maker = std::sync::Arc::clone(&dev);
    let pool = cqd_core::CqPool::new(name, 64, vec![t.joiner().unwrap()], move |name, cqe| {
        Ok(B::dispatched_cq(&maker, name, cqe, true))
    })
    .fit(fit);
    (dev, t, pool, (s0, h0))
}

/// A QP on the CQ `pool` gives, 8 deep each way (16 entries of
/// admission).
fn open_qp16<B: Backend>(
    pool: &cqd_core::CqPool<B::Cq, cqd_core::NoWork>,
    dev: &B::Dev,
    live: &mut Vec<B::Qp>,
) {
    let cap = Cap { send: 8, recv: 8 };
    live.push(
        pool.open(16, None, |cq, _| Ok::<_, String>(B::qp(dev, cq, cq, cap)))
            .unwrap_or_else(|e| panic!("{}: {e}", B::NAME)),
    );
}

/// First fit fills the first CQ before the next: with one connection of
/// a full first CQ closed, the next goes back there, where least used
/// would choose the emptier second CQ.
pub fn cq_pool_first_fit<B: Backend>(mode_name: &str) {
    use cqd_core::{CqPool, Fit};
    let (dev, t, pool, _seed) = one_poller_pool::<B>("ff", mode_name, Fit::First);
    let open = |live: &mut Vec<_>| open_qp16::<B>(&pool, &dev, live);
    let mut live = Vec::new();
    open(&mut live);
    let capacity = pool.snapshot()[0].capacity;
    // 16 each: the first CQ takes as many as fit, the next one grows.
    let per = u64::from(capacity / 16);
    for _ in 1..=per {
        open(&mut live);
    }
    let reserved = |pool: &CqPool<_, _>| {
        pool.snapshot()
            .iter()
            .map(|c| c.reserved)
            .collect::<Vec<_>>()
    };
    assert_eq!(reserved(&pool), [16 * per, 16], "{:?}", pool.snapshot());
    B::close(live.remove(0))
        .wait(Duration::from_secs(30))
        .unwrap();
    assert_eq!(reserved(&pool), [16 * (per - 1), 16]);
    open(&mut live);
    assert_eq!(reserved(&pool), [16 * per, 16], "{:?}", pool.snapshot());
    drop(live);
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("cq_pool_first_fit", &report);
}

/// A running CQ grown in place (`CqHandle::resize`, `ibv_resize_cq` on
/// the poller's thread), in every mode: a CQ whose admission is full takes
/// more connections once resized; completions queued before the resize
/// and traffic after it arrive once, the later ones by notification (an
/// arm made before the resize still holds: nothing is left to the safety
/// net); a size not above the capacity is refused, and so is a resize
/// after the stop. The stop is clean.
pub fn resize_running<B: Backend>(mode_name: &str) {
    use cqd_core::ResizeError;
    const N: u32 = 8;
    let dev = B::open();
    let mr = B::reg_mr(&dev, 64 * 1024);
    let (cq, u, h) = B::dispatched_cq(&dev, "resize", 64, true);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = notified_poller("resize", mode_name, u);
    let budget = h.budget().expect("admission on");
    let before = h.capacity();
    assert_eq!(budget.capacity(), before);
    let cap = Cap { send: 8, recv: 8 };
    let mut pairs = Vec::new();
    let mut tag = 0;
    let traffic = |pairs: &Vec<(B::Qp, B::Qp)>, tag: &mut u32| {
        for (k, (a, b)) in pairs.iter().enumerate() {
            post_messages::<B>(&reg, a, b, &mr, *tag, N, k % 4 == 0);
            *tag += N;
        }
    };
    // Connections (a QP pair, 32 entries of admission) until the CQ is
    // full.
    while budget.fits(32, None).is_some() {
        pairs.push(B::pair(&dev, &cq, &cq, cap));
    }
    assert!(!pairs.is_empty(), "{}: a CQ of {before}", B::NAME);
    let first = pairs.len();
    traffic(&pairs, &mut tag);
    // Half the first round still in the CQ, or on its way, as it grows.
    let grown = h
        .resize(before * 4)
        .wait(Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{}: {e}", B::NAME));
    assert!(
        grown >= before * 4,
        "{}: {grown} for {}",
        B::NAME,
        before * 4
    );
    assert_eq!(h.capacity(), grown);
    assert_eq!(budget.capacity(), grown);
    let want = 2 * tag as usize;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == want),
        "{}: {} of {want} completions",
        B::NAME,
        log.len()
    );
    // The room the resize made takes more connections, with traffic on
    // every one.
    while budget.fits(32, None).is_some() {
        pairs.push(B::pair(&dev, &cq, &cq, cap));
    }
    assert!(
        pairs.len() >= 4 * first,
        "{}: {} connections after the resize, {first} before",
        B::NAME,
        pairs.len()
    );
    traffic(&pairs, &mut tag);
    let want = 2 * tag as usize;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == want),
        "{}: {} of {want} completions",
        B::NAME,
        log.len()
    );
    let s = h.snapshot();
    assert_eq!(
        s.recovered_missed_events,
        0,
        "{}: completions found by the safety net, not by notification",
        B::NAME
    );
    let same = h.resize(grown).wait(Duration::from_secs(30));
    assert!(
        matches!(same, Err(ResizeError::NotLarger { asked, capacity, .. }) if asked == grown && capacity == grown),
        "{same:?}"
    );
    drop(pairs);
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("resize_running", &report);
    assert!(
        matches!(
            h.resize(grown * 2).wait(Duration::from_secs(30)),
            Err(ResizeError::Stopped { .. })
        ),
        "{}",
        B::NAME
    );
    let evs = log.snapshot();
    assert_each_once("resize", &evs, OpKind::Recv, 0..tag);
    assert_each_once("resize", &evs, OpKind::Send, 100_000..100_000 + tag);
}

/// A pool that grows its CQs in place first (`CqPool::resize_up_to`):
/// connections past the first CQ's capacity double it, up to the limit,
/// before the pool makes a second CQ; every CQ's admission counts what its
/// resizes made, and the stop is clean.
pub fn cq_pool_resize<B: Backend>(mode_name: &str) {
    use cqd_core::Fit;
    let (dev, t, pool, _seed) = one_poller_pool::<B>("rp", mode_name, Fit::LeastUsed);
    let mut live = Vec::new();
    let open = |pool: &cqd_core::CqPool<_, _>, live: &mut Vec<_>| open_qp16::<B>(pool, &dev, live);
    open(&pool, &mut live);
    // The limit, from what the device made of the first CQ.
    let first = pool.snapshot()[0].capacity;
    let pool = pool.resize_up_to(first * 4);
    // As many as four times the first capacity holds: one CQ, grown.
    let fit = (first * 4 / 16) as usize;
    while live.len() < fit {
        open(&pool, &mut live);
    }
    let snap = pool.snapshot();
    assert_eq!(snap.len(), 1, "{}: grown in place: {snap:?}", B::NAME);
    assert!(snap[0].capacity >= first * 4, "{snap:?}");
    assert_eq!(snap[0].reserved, 16 * fit as u64, "{snap:?}");
    // One more: past the limit, a new CQ.
    open(&pool, &mut live);
    let snap = pool.snapshot();
    assert_eq!(snap.len(), 2, "{}: {snap:?}", B::NAME);
    assert_eq!(snap[1].reserved, 16, "{snap:?}");
    drop(live);
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("cq_pool_resize", &report);
}

/// A CQ pool from the topology file (`[[cq_pool]]`) over two pollers that
/// own no CQ of their own: they start empty, the pool's CQs join them as
/// connections need, traffic flows on each, and the stop is clean with
/// every pool CQ in its poller's report. Joiners not of the pollers the
/// file names are refused, naming both lists.
pub fn cq_pool_from_topology<B: Backend>(mode_name: &str) {
    use cqd_core::topology::{TopologyConfig, TopologyError};
    use cqd_core::CqPool;
    const MSGS: u32 = 4;
    let text = format!(
        r#"
        [[poller]]
        name = "tp0"
        cqs = []
        mode = {{ kind = "{mode_name}" }}

        [[poller]]
        name = "tp1"
        cqs = []
        mode = {{ kind = "{mode_name}" }}

        [[cq_pool]]
        name = "tp"
        cqe = 64
        pollers = ["tp0", "tp1"]
        "#
    );
    let mut topology = TopologyConfig::from_toml(&text)
        .unwrap()
        .validate()
        .unwrap();
    let pollers: Vec<_> = topology
        .take_pollers()
        .into_iter()
        .map(|plan| {
            plan.poller_builder(cqd_core::NoSink)
                .drain_timeout(Duration::from_secs(10) * slow())
                .spawn()
                .unwrap_or_else(|e| panic!("{}: an empty poller: {e}", B::NAME))
        })
        .collect();
    let dev = std::sync::Arc::new(B::open());
    let make = |dev: &std::sync::Arc<B::Dev>| {
        let maker = std::sync::Arc::clone(dev);
        move |name: &str, cqe: u32| Ok(B::dispatched_cq(&maker, name, cqe, true))
    };
    // Joiners of one poller only: refused.
    let plan = topology.take_cq_pool("tp").unwrap();
    let wrong = CqPool::from_plan(plan, vec![pollers[1].joiner().unwrap()], make(&dev));
    assert!(
        matches!(&wrong, Err(TopologyError::CqPoolPollers { wanted, given, .. })
            if wanted == &["tp0", "tp1"] && given == &["tp1"]),
        "{:?}",
        wrong.err()
    );
    // In another order than the file's: matched by name.
    let mut topology = TopologyConfig::from_toml(&text)
        .unwrap()
        .validate()
        .unwrap();
    let plan = topology.take_cq_pool("tp").unwrap();
    let joiners = pollers.iter().rev().map(|p| p.joiner().unwrap()).collect();
    let pool = CqPool::from_plan(plan, joiners, make(&dev)).unwrap();
    let mr = B::reg_mr(&dev, 64 * 1024);
    let log = Log::default();
    let mut live = Vec::new();
    for c in 0..4u32 {
        live.push(open_with_messages::<B>(
            &pool,
            &dev,
            &mr,
            &log,
            c * MSGS,
            MSGS,
        ));
    }
    let snap = pool.snapshot();
    for p in ["tp0", "tp1"] {
        assert!(
            snap.iter().any(|c| c.poller == p),
            "{}: a CQ on each poller: {snap:?}",
            B::NAME
        );
    }
    let want = (2 * MSGS * 4) as usize;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == want),
        "{}: {} of {want} completions",
        B::NAME,
        log.len()
    );
    drop(live);
    let report = cqd_core::shutdown(|| {}, pollers, []);
    assert_clean("cq_pool_from_topology", &report);
    let polled: usize = report.pollers.iter().map(|p| p.cqs.len()).sum();
    assert_eq!(polled, snap.len(), "{}: the pool's CQs only", B::NAME);
    let evs = log.snapshot();
    assert_each_once("cq_pool_from_topology", &evs, OpKind::Recv, 0..4 * MSGS);
    assert_each_once(
        "cq_pool_from_topology",
        &evs,
        OpKind::Send,
        100_000..100_000 + 4 * MSGS,
    );
}
