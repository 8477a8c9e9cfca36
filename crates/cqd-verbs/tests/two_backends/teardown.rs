//! Connections that come and go on one CQ, written once for every
//! backend: one call closes a connection while the others keep traffic
//! flowing, its outstanding requests come back as flushes, once each, its
//! admission comes back, and nothing of it stays in the CQ's ledger.

use std::time::Duration;

use cqd_core::{CompletionSource, OpKind, PostSend};

use crate::backend::{Backend, Cap, Op};
use crate::support::{mode, poller, wait_until, Log, Recorder};
use crate::{assert_clean, assert_each_once};

/// Closes and opens connections with their own receive queues, 24 times,
/// beside one that keeps receiving: each closed connection's receives
/// (posted, never used) come back flushed, the other's messages arrive,
/// the CQ's admission and ledger end where they began, the stop is clean.
pub fn close_own<B: Backend>(mode_name: &str) {
    const CYCLES: u32 = 24;
    const RECVS: u32 = 4;
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "close", 1024, true);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("close", mode(mode_name), vec![u]);
    let mr = B::reg_mr(&dev, 64 * 1024);
    let (keep_a, keep_b) = B::pair(&dev, &cq, &cq, Cap::default());
    let (reserved, queues) = (B::reserved(&cq), B::ledger(&cq).queue_count());
    let mut tag = 0u32;
    for cycle in 0..CYCLES {
        let (a, b) = B::pair(&dev, &cq, &cq, Cap { send: 16, recv: 16 });
        let sg: Vec<_> = (0..RECVS)
            .map(|i| [B::sge(&mr, (i * 64) as usize, 64)])
            .collect();
        let mut r: Vec<_> = (0..RECVS)
            .map(|i| B::recv_wr(tag + i, &sg[i as usize]))
            .collect();
        reg.post_recv(&b, &mut r).unwrap();
        tag += RECVS;
        // The connection that stays: one message per cycle.
        let rsg = [B::sge(&mr, 8192 + cycle as usize * 64, 64)];
        reg.post_recv(&keep_b, &mut [B::recv_wr(10_000 + cycle, &rsg)])
            .unwrap();
        let ssg = [B::sge(&mr, 4096, 8)];
        reg.post_send(
            &keep_a,
            &mut [B::send_wr(20_000 + cycle, Op::Send, &ssg, true)],
        )
        .unwrap();
        B::close(b).wait(Duration::from_secs(30)).unwrap();
        B::close(a).wait(Duration::from_secs(30)).unwrap();
    }
    let want = (CYCLES * RECVS + 2 * CYCLES) as usize;
    assert!(
        wait_until(Duration::from_secs(10), || log.len() == want),
        "{}: {} of {want} completions",
        B::NAME,
        log.len()
    );
    assert_eq!(
        B::reserved(&cq),
        reserved,
        "{}: every admission back",
        B::NAME
    );
    assert_eq!(
        B::ledger(&cq).queue_count(),
        queues,
        "{}: nothing of the closed connections in the ledger",
        B::NAME
    );
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("close_own", &report);
    let evs = log.snapshot();
    let flushed: Vec<_> = evs.iter().filter(|e| !e.ok).map(|e| e.tag).collect();
    assert_eq!(flushed.len(), (CYCLES * RECVS) as usize, "{evs:?}");
    assert_each_once(
        "close",
        &evs,
        OpKind::Recv,
        (0..CYCLES * RECVS).chain(10_000..10_000 + CYCLES),
    );
    assert_each_once("close", &evs, OpKind::Send, 20_000..20_000 + CYCLES);
    drop((keep_a, keep_b));
}

/// The same with connections on one SRQ that still holds receives when
/// they close: each close ends once the CQ's poller has taken the QP's
/// last WQE and polled its CQ empty after it (on rxe, which raises no
/// such event and keeps a destroyed QP's completions: once the QP is
/// destroyed and the CQ polled empty after); the stop hands the SRQ's
/// unused receives back and is clean.
pub fn close_srq<B: Backend>(mode_name: &str) {
    const CYCLES: u32 = 24;
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "close-srq", 1024, true);
    let srq = B::srq(&dev, 64);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("close-srq", mode(mode_name), vec![u]);
    let mr = B::reg_mr(&dev, 64 * 1024);
    let sg: Vec<_> = (0..32usize).map(|i| [B::sge(&mr, i * 64, 64)]).collect();
    let mut r: Vec<_> = (0..32u32)
        .map(|i| B::srq_recv_wr(i, &sg[i as usize]))
        .collect();
    reg.post_recv(&srq, &mut r).unwrap();
    let (reserved, queues) = (B::reserved(&cq), B::ledger(&cq).queue_count());
    for cycle in 0..CYCLES {
        let a = B::qp(&dev, &cq, &cq, Cap { send: 16, recv: 16 });
        let b = B::qp_on_srq(&dev, &cq, &cq, &srq, Cap { send: 16, recv: 0 });
        B::connect(&a, &B::endpoint(&b));
        B::connect(&b, &B::endpoint(&a));
        if cycle % 3 == 0 {
            // Every third connection receives one message before it goes.
            let ssg = [B::sge(&mr, 4096, 8)];
            reg.post_send(&a, &mut [B::send_wr(20_000 + cycle, Op::Send, &ssg, true)])
                .unwrap();
            let want = 2 * (cycle / 3 + 1) as usize;
            assert!(
                wait_until(Duration::from_secs(10), || log.len() == want),
                "{}: {} of {want} completions",
                B::NAME,
                log.len()
            );
        }
        B::close(b).wait(Duration::from_secs(30)).unwrap();
        B::close(a).wait(Duration::from_secs(30)).unwrap();
    }
    let sent = CYCLES.div_ceil(3);
    assert!(
        wait_until(Duration::from_secs(10), || log.len() == 2 * sent as usize),
        "{}: {} of {} completions",
        B::NAME,
        log.len(),
        2 * sent
    );
    assert_eq!(B::ledger(&cq).srq_users(), 0, "{}", B::NAME);
    assert_eq!(B::ledger(&cq).queue_count(), queues, "{}", B::NAME);
    assert_eq!(B::reserved(&cq), reserved, "{}", B::NAME);
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("close_srq", &report);
    assert_eq!(report.pollers[0].cqs[0].srq_returned, u64::from(32 - sent));
    let evs = log.snapshot();
    assert_each_once("close_srq", &evs, OpKind::Recv, 0..32);
    assert_each_once(
        "close_srq",
        &evs,
        OpKind::Send,
        (0..sent).map(|k| 20_000 + 3 * k),
    );
}

/// A send queue filled beyond its depth by several threads: each post that
/// would overfill it is refused whole with `Refused::Full` before the
/// device sees it; the thread waits for room (`PostSend::wait_send_room`,
/// woken by the poller's batch that retires completions of the queue) and
/// posts it again. Every message reaches the peer once, each thread's in
/// its order, and no request fails.
pub fn full_send_queue<B: Backend>(mode_name: &str) {
    const THREADS: u32 = 4;
    const EACH: u32 = 50;
    let _ = mode_name;
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "full", 2048, true);
    let mut poller = u.bind();
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let (a, b) = B::pair(&dev, &cq, &cq, Cap { send: 8, recv: 256 });
    let (ma, mb) = (B::reg_mr(&dev, 4096), B::reg_mr(&dev, 8 * 256));
    let n = THREADS * EACH;
    let rsg: Vec<_> = (0..n as usize).map(|i| [B::sge(&mb, i * 8, 8)]).collect();
    let mut r: Vec<_> = (0..n).map(|i| B::recv_wr(i, &rsg[i as usize])).collect();
    reg.post_recv(&b, &mut r).unwrap();
    // Message k of thread t: [t, k, ...], a slot of its own.
    for t in 0..THREADS {
        for k in 0..EACH {
            B::write(
                &ma,
                ((t * EACH + k) * 8) as usize,
                &[t as u8, k as u8, 0xa5, 0, 0, 0, 0, 0],
            );
        }
    }
    use std::sync::atomic::{AtomicU32, Ordering::Relaxed};
    // Refusals, and the threads refused at least once: the poller polls
    // only once every thread has met the full queue.
    let (full, refused) = (AtomicU32::new(0), AtomicU32::new(0));
    let mut out = std::collections::VecDeque::new();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (reg, a, ma, full, refused) = (&reg, &a, &ma, &full, &refused);
            s.spawn(move || {
                let mut met = false;
                for k in 0..EACH {
                    let tag = 1000 + t * EACH + k;
                    let sg = [B::sge(ma, ((t * EACH + k) * 8) as usize, 8)];
                    while let Err(e) = reg.post_send(a, &mut [B::send_wr(tag, Op::Send, &sg, true)])
                    {
                        assert_eq!(B::full_depth(&e), Some(8), "{}: {e}", B::NAME);
                        full.fetch_add(1, Relaxed);
                        if !std::mem::replace(&mut met, true) {
                            refused.fetch_add(1, Relaxed);
                        }
                        a.wait_send_room(1, Duration::from_secs(60))
                            .unwrap_or_else(|e| panic!("{}: {e}", B::NAME));
                    }
                }
            });
        }
        assert!(
            wait_until(Duration::from_secs(30), || refused.load(Relaxed) == THREADS),
            "{}: {} threads met the full queue",
            B::NAME,
            refused.load(Relaxed)
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while log.len() < 2 * n as usize {
            assert!(
                std::time::Instant::now() < deadline,
                "{}: {} of {}",
                B::NAME,
                log.len(),
                2 * n
            );
            poller.poll_once(&mut out).unwrap();
        }
    });
    assert!(full.into_inner() >= THREADS, "every thread was refused");
    let evs = log.snapshot();
    assert!(evs.iter().all(|e| e.ok), "{}: {evs:?}", B::NAME);
    assert_each_once("full", &evs, OpKind::Send, 1000..1000 + n);
    // The receives in arrival order: each thread's messages in its order.
    let mut next = vec![0u32; THREADS as usize];
    for e in evs.iter().filter(|e| e.kind == OpKind::Recv) {
        let mut buf = [0u8; 8];
        B::read(&mb, e.tag as usize * 8, &mut buf);
        let (t, k) = (buf[0] as usize, u32::from(buf[1]));
        assert!(t < THREADS as usize && buf[2] == 0xa5, "{buf:?}");
        assert_eq!(
            k,
            next[t],
            "{}: thread {t}'s messages out of order",
            B::NAME
        );
        next[t] += 1;
    }
    assert_eq!(next, vec![EACH; THREADS as usize]);
    while poller.poll_once(&mut out).unwrap() > 0 {}
    drop((a, b));
}

/// Resident memory of this process, in pages (`/proc/self/statm`).
fn resident_pages() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0)
}

/// A server's day on one CQ and one SRQ: 64 live connections;
/// [`Backend::CHURN_CYCLES`] times (10,000; 500 on rxe) the oldest closes
/// and a new one opens, the new one's client sending one message first.
/// Every message reaches the server once; at the end the SRQ holds what
/// was posted minus what was consumed (handed back by the stop), the CQ's
/// admission is 64 connections' worth, its ledger holds the live
/// connections only, and resident memory at the end is within 10% of what
/// it was after the first tenth of the cycles. The rates of the first and
/// the last tenth are printed, not asserted (a timing).
pub fn churn<B: Backend>(mode_name: &str) {
    const LIVE: usize = 64;
    const SRQ_DEPTH: u32 = 1024;
    let cycles = B::CHURN_CYCLES;
    let dev = B::open();
    let (cq, u, h) = B::dispatched_cq(&dev, "churn", 16 * 1024, true);
    let (ccq, mut csrc) = B::cq(&dev, "churn-clients", 16 * 1024, true);
    let srq = B::srq(&dev, SRQ_DEPTH);
    let log = Log::default();
    let reg = h.register(Recorder(log.clone())).unwrap();
    let t = poller("churn", mode(mode_name), vec![u]);
    let mr = B::reg_mr(&dev, 64 * 1024);
    let slot = |i: u32| ((i % SRQ_DEPTH) * 64) as usize;
    let sg: Vec<_> = (0..SRQ_DEPTH).map(|i| [B::sge(&mr, slot(i), 64)]).collect();
    let open = || {
        let server = B::qp_on_srq(&dev, &cq, &cq, &srq, Cap { send: 4, recv: 0 });
        let client = B::qp(&dev, &ccq, &ccq, Cap { send: 4, recv: 4 });
        B::connect(&server, &B::endpoint(&client));
        B::connect(&client, &B::endpoint(&server));
        (server, client)
    };
    let (reserved0, queues0) = (B::reserved(&cq), B::ledger(&cq).queue_count());
    let mut live: std::collections::VecDeque<_> = (0..LIVE).map(|_| open()).collect();
    let (reserved, queues) = (B::reserved(&cq), B::ledger(&cq).queue_count());
    assert!(reserved > reserved0 && queues > queues0);
    // The SRQ is kept topped up: a receive per message, posted ahead.
    let mut posted = 0u32;
    let post = |n: u32, posted: &mut u32| {
        let mut r: Vec<_> = (*posted..*posted + n)
            .map(|i| B::srq_recv_wr(i, &sg[(i % SRQ_DEPTH) as usize]))
            .collect();
        reg.post_recv(&srq, &mut r).unwrap();
        *posted += n;
    };
    post(SRQ_DEPTH / 2, &mut posted);
    let msg = [B::sge(&mr, 0, 8)];
    let mut rss_tenth = 0;
    let started = std::time::Instant::now();
    let (mut first_tenth, mut last_tenth_from) = (Duration::ZERO, started);
    for cycle in 0..cycles {
        if cycle == cycles - cycles / 10 {
            last_tenth_from = std::time::Instant::now();
        }
        let (server, client) = open();
        // The client's message, unsignaled and posted raw: nobody polls
        // the clients' CQ, and the client's one send holds its one slot.
        client
            .post_send_unaccounted(&[B::send_wr(0, Op::Send, &msg, false)])
            .unwrap_or_else(|(_, e)| panic!("{}: cycle {cycle}: {e}", B::NAME));
        live.push_back((server, client));
        let (old_server, old_client) = live.pop_front().unwrap();
        // Its message must have arrived before its server closes.
        let want = (cycle as usize + 1).saturating_sub(LIVE);
        assert!(
            wait_until(Duration::from_secs(30), || log.len() >= want),
            "{}: cycle {cycle}: {} of {want} messages",
            B::NAME,
            log.len()
        );
        B::close(old_server).wait(Duration::from_secs(30)).unwrap();
        drop(old_client);
        // A QP let go is destroyed on the thread that polls its CQ (a
        // destroy cleans the CQ): this one, for the clients' CQ, between
        // two looks at its events.
        while csrc.take_async_event().is_some() {}
        if posted - (log.len() as u32) < SRQ_DEPTH / 4 {
            post(SRQ_DEPTH / 4, &mut posted);
        }
        if cycle + 1 == cycles / 10 {
            first_tenth = started.elapsed();
        }
        if cycle == cycles / 10 {
            rss_tenth = resident_pages();
        }
    }
    let last_tenth = last_tenth_from.elapsed();
    let sent = cycles as usize;
    assert!(
        wait_until(Duration::from_secs(30), || log.len() == sent),
        "{}: {} of {sent} messages",
        B::NAME,
        log.len()
    );
    let rss_end = resident_pages();
    let took = started.elapsed();
    let tenth = f64::from(cycles / 10);
    crate::support::say(&format!(
        "churn {}: {cycles} closes and opens beside {LIVE} live connections in {took:.2?} \
         ({:.0}/s; first tenth {:.0}/s, last tenth {:.0}/s); resident {rss_tenth} pages \
         after a tenth, {rss_end} at the end\n",
        B::NAME,
        f64::from(cycles) / took.as_secs_f64(),
        tenth / first_tenth.as_secs_f64(),
        tenth / last_tenth.as_secs_f64(),
    ));
    assert_eq!(
        B::reserved(&cq),
        reserved,
        "{}: 64 connections' worth",
        B::NAME
    );
    assert_eq!(
        B::ledger(&cq).queue_count(),
        queues,
        "{}: the live ones only",
        B::NAME
    );
    assert!(
        rss_end * 10 <= rss_tenth * 11,
        "{}: resident memory grew from {rss_tenth} to {rss_end} pages",
        B::NAME
    );
    drop(live);
    let report = cqd_core::shutdown(|| {}, [t], []);
    assert_clean("churn", &report);
    assert_eq!(
        report.pollers[0].cqs[0].srq_returned,
        u64::from(posted) - sent as u64,
        "{}: the SRQ's receives at the end are those posted and not consumed",
        B::NAME
    );
    let evs = log.snapshot();
    assert_each_once("churn", &evs, OpKind::Recv, 0..posted);
}
