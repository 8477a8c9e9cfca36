//! Completion futures (`cqd::core::future`) on the simulated NIC, driven
//! by a poller thread in every poll mode, and by the tokio driver: each
//! future resolves once, with its outcome and the value its request held;
//! a future dropped early never releases that value before the device is
//! done with it; errors, flushes and abandonment resolve with their cause;
//! 10,000 outstanding at once; a multi-thread runtime; waits for room in
//! order; lists; a runtime shut down with futures outstanding.

mod common;

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use cqd::core::future::{OpError, Ops};
use cqd::core::*;
use cqd::sim::{
    connect, Access, CqConfig, Device, Modify, Mr, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp,
};

/// What a request holds: counts its own drops, so that a value dropped
/// while its request is outstanding, dropped twice or never, shows.
#[derive(Debug)]
struct Held {
    id: u64,
    drops: Arc<AtomicU64>,
}

impl Drop for Held {
    fn drop(&mut self) {
        self.drops.fetch_add(1, SeqCst);
    }
}

struct Rig {
    _dev: Device,
    poller: Option<PollerThread>,
    ops: Ops<Held>,
    a: Qp,
    b: Qp,
    mr: Mr,
    drops: Arc<AtomicU64>,
}

impl Rig {
    fn held(&self, id: u64) -> Held {
        Held {
            id,
            drops: Arc::clone(&self.drops),
        }
    }
    fn drops(&self) -> u64 {
        self.drops.load(SeqCst)
    }
    /// Stops the poller; its accounts must balance. The rig stays to be
    /// looked at.
    fn stop_balanced(mut self) -> Self {
        let report = self.poller.take().expect("running").stop().unwrap();
        assert!(report.accounts.is_balanced(), "{}", report.accounts);
        self
    }
}

fn rig(mode: PollMode, depth: u32, capacity: u32) -> Rig {
    let dev = Device::open("fut0");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq(
            "cq0",
            4 * depth + 16,
            CqConfig::default(),
            CqOptions::default(),
        )
        .unwrap();
    let poller = PollerBuilder::new("p0", NoSink)
        .mode(mode)
        .drain_timeout(Duration::from_millis(200))
        .cq(unbound)
        .spawn()
        .unwrap();
    let ops = handle.register_futures::<Held>(capacity).unwrap();
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCap::default()
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(1 << 16, Access::ALL).unwrap();
    Rig {
        _dev: dev,
        poller: Some(poller),
        ops,
        a,
        b,
        mr,
        drops: Arc::default(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn a_send_and_its_receive_resolve_with_what_they_held(mode: PollMode) {
    let r = rig(mode, 64, 64);
    r.mr.write(0, b"hello, futures").unwrap();
    let dst = [r.mr.sge(1024, 64)];
    let src = [r.mr.sge(0, 14)];
    let recv = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    let send = r
        .ops
        .post_send(
            &r.a,
            SendWr::new(0, WrOp::SendWithImm(7u32.to_be()), &src),
            r.held(2),
        )
        .unwrap();
    let ((sent, h2), (got, h1)) = runtime().block_on(async { (send.await, recv.await) });
    assert_eq!((h1.id, h2.id), (1, 2), "each value back to its own request");
    let sent = sent.unwrap();
    assert_eq!(sent.kind(), OpKind::Send);
    assert!(!sent.is_silent());
    let got = got.unwrap();
    assert_eq!(got.kind(), OpKind::Recv);
    assert_eq!(got.byte_len(), 14);
    assert_eq!(got.imm(), Some(7));
    assert_eq!(got.qp_num(), r.b.qpn());
    let mut buf = [0u8; 14];
    r.mr.read(1024, &mut buf).unwrap();
    assert_eq!(&buf, b"hello, futures");
    assert_eq!(r.drops(), 0, "both values came back, none dropped");
    drop((h1, h2));
    r.stop_balanced();
}
all_modes!(a_send_and_its_receive_resolve_with_what_they_held);

fn rdma_write_read_and_atomics_resolve(mode: PollMode) {
    let r = rig(mode, 64, 64);
    r.mr.write(0, b"abcdefgh").unwrap();
    r.mr.write_u64(4096, 40).unwrap();
    let rt = runtime();
    // WRITE bytes 0..8 to 2048, READ them back into 3072, fetch-add 2 at
    // 4096 (the old value lands at 4104).
    let src = [r.mr.sge(0, 8)];
    let (w, _) = rt.block_on(
        r.ops
            .post_send(
                &r.a,
                SendWr::new(0, WrOp::Write(r.mr.remote(2048)), &src),
                r.held(1),
            )
            .unwrap(),
    );
    assert_eq!(w.unwrap().kind(), OpKind::Write);
    let dst = [r.mr.sge(3072, 8)];
    let (rd, _) = rt.block_on(
        r.ops
            .post_send(
                &r.a,
                SendWr::new(0, WrOp::Read(r.mr.remote(2048)), &dst),
                r.held(2),
            )
            .unwrap(),
    );
    assert_eq!(rd.unwrap().byte_len(), 8);
    let mut buf = [0u8; 8];
    r.mr.read(3072, &mut buf).unwrap();
    assert_eq!(&buf, b"abcdefgh");
    let old = [r.mr.sge(4104, 8)];
    let op = WrOp::FetchAdd {
        remote: r.mr.remote(4096),
        add: 2,
    };
    let (fa, _) = rt.block_on(
        r.ops
            .post_send(&r.a, SendWr::new(0, op, &old), r.held(3))
            .unwrap(),
    );
    assert_eq!(fa.unwrap().kind(), OpKind::Atomic);
    let mut v = [0u8; 8];
    r.mr.read(4104, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 40);
    r.mr.read(4096, &mut v).unwrap();
    assert_eq!(u64::from_ne_bytes(v), 42);
    assert_eq!(r.drops(), 3, "each value came back and was dropped here");
    r.stop_balanced();
}
all_modes!(rdma_write_read_and_atomics_resolve);

fn dropped_before_its_completion_the_value_waits_for_the_device(mode: PollMode) {
    let r = rig(mode, 64, 64);
    let dst = [r.mr.sge(0, 64)];
    let op = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    drop(op);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(
        r.drops(),
        0,
        "the receive is outstanding: its buffer's holder must live"
    );
    // The flush retires it: now the value goes.
    r.b.modify(Modify::Err).unwrap();
    assert!(
        common::wait_until(Duration::from_secs(5), || r.drops() == 1),
        "dropped {} times",
        r.drops()
    );
    assert_eq!(r.ops.ledger().flushed(OpKind::Recv), 1);
    let r = r.stop_balanced();
    assert_eq!(r.drops(), 1, "once");
}
all_modes!(dropped_before_its_completion_the_value_waits_for_the_device);

fn dropped_after_its_completion_before_a_poll(mode: PollMode) {
    let r = rig(mode, 64, 64);
    let dst = [r.mr.sge(0, 64)];
    let src = [r.mr.sge(64, 16)];
    let recv = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    let send = r
        .ops
        .post_send(&r.a, SendWr::new(0, WrOp::Send, &src), r.held(2))
        .unwrap();
    assert!(common::wait_until(Duration::from_secs(5), || {
        r.ops.ledger().completed(OpKind::Recv) == 1 && r.ops.ledger().completed(OpKind::Send) == 1
    }));
    assert_eq!(r.drops(), 0, "completed, not yet taken");
    drop(recv);
    drop(send);
    assert!(
        common::wait_until(Duration::from_secs(5), || r.drops() == 2),
        "dropped {}",
        r.drops()
    );
    // Both slots are free again: the table takes its whole capacity.
    let ops: Vec<_> = (0..64)
        .map(|i| {
            r.ops
                .post_recv(&r.b, RecvWr::new(0, &dst), r.held(10 + i))
                .unwrap()
        })
        .collect();
    r.b.modify(Modify::Err).unwrap();
    let outs = runtime().block_on(async {
        let mut v = Vec::new();
        for op in ops {
            v.push(op.await);
        }
        v
    });
    assert!(outs.iter().all(|(o, _)| o.as_ref().unwrap_err().is_flush()));
    drop(outs);
    assert_eq!(r.drops(), 66);
    r.stop_balanced();
}
all_modes!(dropped_after_its_completion_before_a_poll);

fn errors_and_flushes_resolve_with_their_status(mode: PollMode) {
    let r = rig(mode, 64, 64);
    let rt = runtime();
    // A WRITE past the region: a remote access error; the QP goes to the
    // error state, so the receive behind it on the peer is flushed.
    let src = [r.mr.sge(0, 8)];
    let bad = WrOp::Write(r.mr.remote(1 << 20));
    let dst = [r.mr.sge(0, 8)];
    let recv = r
        .ops
        .post_recv(&r.a, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    let (out, held) = rt.block_on(
        r.ops
            .post_send(&r.a, SendWr::new(0, bad, &src), r.held(2))
            .unwrap(),
    );
    assert_eq!(held.id, 2);
    let e = out.unwrap_err();
    assert_eq!(e.status(), Some(Status::RemoteAccess), "{e}");
    assert!(!e.is_flush());
    let (out, held) = rt.block_on(recv);
    assert_eq!(held.id, 1);
    assert!(out.unwrap_err().is_flush());
    r.stop_balanced();
}
all_modes!(errors_and_flushes_resolve_with_their_status);

fn a_full_table_refuses_and_hands_the_value_back(mode: PollMode) {
    let r = rig(mode, 64, 2);
    let dst = [r.mr.sge(0, 8)];
    let one = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    let two = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(2))
        .unwrap();
    let e = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(3))
        .unwrap_err();
    assert!(
        matches!(
            e.error,
            cqd::sim::PostError::Refused(Refused::Contexts { capacity: 2, .. })
        ),
        "{e}"
    );
    assert_eq!(e.hold.id, 3);
    drop(e);
    // A queue's refusal hands it back too.
    let many = [r.mr.sge(0, 8); 64];
    let e = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &many), r.held(4))
        .unwrap_err();
    assert_eq!(e.hold.id, 4);
    drop(e);
    assert_eq!(r.drops(), 2, "the refused values, and only they");
    r.b.modify(Modify::Err).unwrap();
    let rt = runtime();
    assert!(rt.block_on(one).0.unwrap_err().is_flush());
    assert!(rt.block_on(two).0.unwrap_err().is_flush());
    r.stop_balanced();
}
all_modes!(a_full_table_refuses_and_hands_the_value_back);

#[test]
fn ten_thousand_outstanding_each_resolves_once() {
    const N: u64 = 10_000;
    let r = rig(PollMode::Event, N as u32, 2 * N as u32);
    let rt = runtime();
    let dst = [r.mr.sge(0, 8)];
    let ops: Vec<_> = (0..N)
        .map(|i| {
            r.ops
                .post_recv(&r.b, RecvWr::new(0, &dst), r.held(i))
                .unwrap()
        })
        .collect();
    // Half of them receive a SEND, the rest are flushed.
    let src = [r.mr.sge(64, 8)];
    let sends: Vec<_> = (0..N / 2)
        .map(|i| {
            r.ops
                .post_send(&r.a, SendWr::new(0, WrOp::Send, &src), r.held(N + i))
                .unwrap()
        })
        .collect();
    let sent = rt.block_on(async {
        let mut n = 0;
        for s in sends {
            let (o, h) = s.await;
            o.unwrap();
            assert!(h.id >= N);
            n += 1;
        }
        n
    });
    assert_eq!(sent, N / 2);
    r.b.modify(Modify::Err).unwrap();
    let (ok, flushed, ids) = rt.block_on(async {
        let (mut ok, mut flushed, mut ids) = (0, 0, Vec::new());
        for op in ops {
            let (o, h) = op.await;
            match o {
                Ok(d) => {
                    assert_eq!(d.byte_len(), 8);
                    ok += 1;
                }
                Err(e) => {
                    assert!(e.is_flush(), "{e}");
                    flushed += 1;
                }
            }
            ids.push(h.id);
        }
        (ok, flushed, ids)
    });
    assert_eq!((ok, flushed), (N / 2, N / 2));
    assert_eq!(
        ids,
        (0..N).collect::<Vec<_>>(),
        "each value to its own request"
    );
    assert_eq!(r.drops(), N + N / 2, "every value, once");
    r.stop_balanced();
}

#[test]
fn tasks_of_a_multi_thread_runtime_post_and_await_at_once() {
    const TASKS: u64 = 4;
    const EACH: u64 = 2_000;
    let r = Arc::new(rig(PollMode::Event, 1024, 1024));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let total = rt.block_on(async {
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let r = Arc::clone(&r);
            tasks.push(tokio::spawn(async move {
                let mut done = 0;
                for i in 0..EACH {
                    let src = [r.mr.sge(8 * t, 8)];
                    let dst = [r.mr.sge(4096 + 8 * t, 8)];
                    let wr = SendWr::new(0, WrOp::Write(r.mr.remote(8192 + 8 * t)), &src);
                    let (o, h) = r
                        .ops
                        .post_send(&r.a, wr, r.held(t * EACH + i))
                        .unwrap()
                        .await;
                    o.unwrap();
                    assert_eq!(h.id, t * EACH + i);
                    let wr = SendWr::new(0, WrOp::Read(r.mr.remote(8192 + 8 * t)), &dst);
                    let (o, _) = r.ops.post_send(&r.a, wr, r.held(0)).unwrap().await;
                    assert_eq!(o.unwrap().byte_len(), 8);
                    done += 1;
                }
                done
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await.unwrap();
        }
        n
    });
    assert_eq!(total, TASKS * EACH);
    assert_eq!(r.drops(), 2 * TASKS * EACH);
    Arc::into_inner(r).unwrap().stop_balanced();
}

#[test]
fn outstanding_at_the_stop_resolves_abandoned_with_its_value() {
    let mut r = rig(PollMode::Event, 64, 64);
    let dst = [r.mr.sge(0, 8)];
    let op = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    // Stopped without a flush: the receive never completes.
    let report = r.poller.take().unwrap().stop().unwrap();
    assert!(!report.accounts.is_balanced(), "the receive is missing");
    let (o, h) = runtime().block_on(op);
    assert_eq!(o.unwrap_err(), OpError::Abandoned);
    assert_eq!(h.id, 1);
}

#[test]
fn driven_by_the_tokio_driver() {
    use cqd::core::driver::TokioDriver;
    let dev = Device::open("fut1");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("cq0", 256, CqConfig::default(), CqOptions::default())
        .unwrap();
    let ops = handle.register_futures::<u64>(64).unwrap();
    let pd = dev.alloc_pd();
    let a = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    let b = pd
        .create_qp(&QpInit::new(&cq, &cq, QpCap::default()))
        .unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(4096, Access::ALL).unwrap();
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let report = local.block_on(&rt, async {
        let driver = TokioDriver::new("net", NoSink)
            .cq(unbound)
            .spawn_local()
            .unwrap();
        let dst = [mr.sge(0, 64)];
        let src = [mr.sge(64, 32)];
        for i in 0..200u64 {
            let recv = ops.post_recv(&b, RecvWr::new(0, &dst), i).unwrap();
            let send = ops
                .post_send(&a, SendWr::new(0, WrOp::Send, &src), 1000 + i)
                .unwrap();
            let ((s, hs), (g, hg)) = (send.await, recv.await);
            s.unwrap();
            assert_eq!(g.unwrap().byte_len(), 32);
            assert_eq!((hs, hg), (1000 + i, i));
        }
        let pending = ops.post_recv(&b, RecvWr::new(0, &dst), 7).unwrap();
        b.modify(Modify::Err).unwrap();
        let (o, h) = pending.await;
        assert!(o.unwrap_err().is_flush());
        assert_eq!(h, 7);
        driver.stop().await
    });
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    // 200 received and 1 flushed (a flush counts as completed too).
    assert_eq!(ops.ledger().completed(OpKind::Recv), 201);
    assert_eq!(ops.ledger().flushed(OpKind::Recv), 1);
}

/// Polls `f` once with a waker that does nothing.
fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::Pin::new(f).poll(&mut cx)
}

/// Polls `f` until it is ready (another thread makes it so).
fn ready<F: std::future::Future + Unpin>(f: &mut F) -> F::Output {
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        if let std::task::Poll::Ready(out) = poll_once(f) {
            return out;
        }
        assert!(std::time::Instant::now() < deadline, "never ready");
        std::thread::yield_now();
    }
}

/// Awaits `op` by polling (the poller thread resolves it).
fn resolve<B>(op: &mut cqd::core::future::Op<B>) -> cqd::core::future::OpOutput<B> {
    ready(op)
}

#[test]
fn waits_for_room_are_served_in_order_and_never_overtaken() {
    let r = rig(PollMode::Event, 64, 1);
    let dst = [r.mr.sge(0, 8)];
    let mut first = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(0))
        .unwrap();
    // Three waits, queued in this order.
    let (mut w1, mut w2, mut w3) = (r.ops.reserve(), r.ops.reserve(), r.ops.reserve());
    assert!(poll_once(&mut w1).is_pending());
    assert!(poll_once(&mut w2).is_pending());
    assert!(poll_once(&mut w3).is_pending());
    // A post that would overtake them is refused, its value back.
    let e = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(9))
        .unwrap_err();
    assert_eq!(e.hold.id, 9);
    drop(e);
    // The only slot comes free (the receive is flushed): it goes to the
    // first wait, not the others.
    r.b.modify(Modify::Err).unwrap();
    assert!(resolve(&mut first).0.unwrap_err().is_flush());
    // (The slot is freed by whichever side finishes last: here, or on the
    // poller's thread a moment later.)
    let room = ready(&mut w1);
    assert!(
        poll_once(&mut w3).is_pending(),
        "the third does not overtake"
    );
    assert!(
        poll_once(&mut w2).is_pending(),
        "the second does not overtake"
    );
    // The second wait is dropped while queued: it leaves the queue.
    drop(w2);
    // The first posts (on the QP in the error state: flushed at once).
    let mut op = room
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(1))
        .unwrap();
    assert!(poll_once(&mut w3).is_pending(), "the slot is the first's");
    let (out, held) = resolve(&mut op);
    assert!(out.unwrap_err().is_flush());
    assert_eq!(held.id, 1);
    drop(held);
    let room = ready(&mut w3);
    // Dropped unposted: the slot is free again for anyone.
    drop(room);
    drop(w3);
    let mut op = r
        .ops
        .post_recv(&r.b, RecvWr::new(0, &dst), r.held(2))
        .expect("a slot was free");
    assert!(resolve(&mut op).0.unwrap_err().is_flush());
    assert_eq!(r.drops(), 4, "every value, once");
    drop(w1);
    r.stop_balanced();
}

#[test]
fn send_and_recv_wait_for_room_instead_of_failing() {
    // 4 slots, 64 tasks each sending and receiving 50 messages through
    // them: every one gets its turn, nothing is refused.
    const TASKS: u64 = 64;
    const EACH: u64 = 50;
    let r = Arc::new(rig(PollMode::Event, 64, 4));
    let rt = runtime();
    let local = tokio::task::LocalSet::new();
    let total = local.block_on(&rt, async {
        let mut tasks = Vec::new();
        for t in 0..TASKS {
            let r = Arc::clone(&r);
            tasks.push(tokio::task::spawn_local(async move {
                let src = [r.mr.sge(8 * t, 8)];
                let dst = [r.mr.sge(4096 + 8 * t, 8)];
                for i in 0..EACH {
                    let wr = SendWr::new(0, WrOp::Write(r.mr.remote(8192 + 8 * t)), &src);
                    let (o, h) = r.ops.send(&r.a, wr, r.held(t * EACH + i)).await.unwrap();
                    o.unwrap();
                    assert_eq!(h.id, t * EACH + i);
                    let wr = SendWr::new(0, WrOp::Read(r.mr.remote(8192 + 8 * t)), &dst);
                    let (o, _) = r.ops.send(&r.a, wr, r.held(0)).await.unwrap();
                    assert_eq!(o.unwrap().byte_len(), 8);
                }
                EACH
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await.unwrap();
        }
        n
    });
    assert_eq!(total, TASKS * EACH);
    assert_eq!(r.drops(), 2 * TASKS * EACH);
    Arc::into_inner(r).unwrap().stop_balanced();
}

#[test]
fn a_runtime_shut_down_with_futures_outstanding_loses_nothing() {
    const N: u64 = 16;
    let r = Arc::new(rig(PollMode::Event, 64, 64));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    for i in 0..N {
        let r = Arc::clone(&r);
        rt.spawn(async move {
            let dst = [r.mr.sge(8 * i, 8)];
            // No SEND ever comes: this waits until the runtime goes.
            let _ = r.ops.recv(&r.b, RecvWr::new(0, &dst), r.held(i)).await;
            unreachable!("nothing completes these receives before the flush");
        });
    }
    assert!(
        common::wait_until(Duration::from_secs(5), || r
            .ops
            .ledger()
            .posted(OpKind::Recv)
            == N),
        "the tasks posted"
    );
    // The runtime goes: every task, and so every future, is dropped.
    rt.shutdown_timeout(Duration::from_secs(5));
    assert_eq!(
        r.drops(),
        0,
        "the receives are on the device: their buffers stay"
    );
    // The flush retires them: each value is dropped once, by the poller.
    r.b.modify(Modify::Err).unwrap();
    assert!(
        common::wait_until(Duration::from_secs(5), || r.drops() == N),
        "dropped {} of {N}",
        r.drops()
    );
    let r = Arc::into_inner(r).unwrap().stop_balanced();
    assert_eq!(r.ops.ledger().flushed(OpKind::Recv), N);
    assert_eq!(r.drops(), N, "once each");
}

fn lists_post_in_one_call_with_a_future_each(mode: PollMode) {
    let r = rig(mode, 64, 6);
    let rt = runtime();
    let dst: Vec<_> = (0..4).map(|i| [r.mr.sge(1024 + 64 * i, 64)]).collect();
    let src = [r.mr.sge(0, 16)];
    let recvs = r
        .ops
        .post_recv_list(
            &r.b,
            std::array::from_fn::<_, 4, _>(|i| RecvWr::new(0, &dst[i])),
            std::array::from_fn(|i| r.held(i as u64)),
        )
        .unwrap();
    // Six slots, four taken: a list of four is refused whole, every value
    // back, nothing posted.
    let e = r
        .ops
        .post_send_list(
            &r.a,
            std::array::from_fn::<_, 4, _>(|_| SendWr::new(0, WrOp::Send, &src)),
            std::array::from_fn(|i| r.held(10 + i as u64)),
        )
        .unwrap_err();
    assert!(e.posted.iter().all(Option::is_none));
    let back: Vec<u64> = e.back.iter().map(|b| b.as_ref().unwrap().id).collect();
    assert_eq!(back, [10, 11, 12, 13]);
    drop(e);
    assert_eq!(r.ops.ledger().posted(OpKind::Send), 0);
    // Two fit.
    let sends = r
        .ops
        .post_send_list(
            &r.a,
            std::array::from_fn::<_, 2, _>(|_| SendWr::new(0, WrOp::Send, &src)),
            std::array::from_fn(|i| r.held(20 + i as u64)),
        )
        .unwrap();
    let [r0, r1, r2, r3] = recvs;
    let outs = rt.block_on(async {
        let mut v = Vec::new();
        for op in sends.into_iter().chain([r0, r1]) {
            let (o, h) = op.await;
            v.push((o.map(|d| d.kind()).ok(), h.id));
        }
        v
    });
    assert_eq!(
        outs,
        [
            (Some(OpKind::Send), 20),
            (Some(OpKind::Send), 21),
            (Some(OpKind::Recv), 0),
            (Some(OpKind::Recv), 1),
        ],
        "the two sends, and the two receives they filled"
    );
    r.b.modify(Modify::Err).unwrap();
    for op in [r2, r3] {
        let (o, h) = rt.block_on(op);
        assert!(o.unwrap_err().is_flush());
        assert!(h.id == 2 || h.id == 3);
    }
    assert_eq!(r.drops(), 10, "every value once");
    r.stop_balanced();
}
all_modes!(lists_post_in_one_call_with_a_future_each);
