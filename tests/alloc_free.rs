//! Zero heap allocations per request and per completion in steady state, on
//! the simulated NIC: 100,000 requests of each stream (SEND/RECV, signaled
//! RDMA WRITEs, WRITEs of which 7 in 8 are unsignaled, SEND/RECV carrying a
//! request context each, and SEND/RECV as completion futures awaited on a
//! tokio runtime) go through the
//! posting call and a Busy poller thread while a counting global allocator
//! counts every allocation of the process. After a warm-up (the queue accounts' segments, the poller's
//! scratch buffers, the CQ's first batch), the count must not move.
//!
//! The softverbs twin is `crates/cqd-verbs/tests/alloc_free.rs`.

#[path = "support/counting.rs"]
mod counting;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use counting::{counted_window, Handlers, Stream, LIST, REQUESTS, WARM_UP};
use cqd::core::*;
use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit, RecvWr, SendWr, WrOp};

#[test]
fn steady_state_posting_and_dispatch_allocate_nothing() {
    let dev = Device::open("alloc0");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("cq0", 1024, CqConfig::default(), CqOptions::default())
        .unwrap();
    let poller = PollerBuilder::new("p0", NoSink)
        .mode(PollMode::Busy)
        .cq(unbound)
        .spawn()
        .unwrap();
    let Handlers {
        done,
        errors,
        reg,
        ctx_reg,
    } = Handlers::register(&handle);
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: 128,
        max_recv_wr: 128,
        ..QpCap::default()
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    connect(&a, &b).unwrap();
    let mr_a = pd.reg_mr(4096, Access::ALL).unwrap();
    let mr_b = pd.reg_mr(4096, Access::ALL).unwrap();
    let (src, dst) = ([mr_a.sge(0, 64)], [mr_b.sge(0, 64)]);
    let remote = mr_b.remote(1024);

    let mut posted = 0u64;
    // Keeps at most `window` completions outstanding, so the queues (128
    // deep) never refuse a post.
    let wait = |posted: u64, window: u64| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::Acquire) + window < posted {
            assert!(Instant::now() < deadline, "completions stopped coming");
            std::hint::spin_loop();
        }
    };
    let round = |posted: &mut u64, tag: u32, stream: Stream| {
        if stream == Stream::Contexts {
            let n = *posted;
            let mut rs = [RecvWr::new(0, &dst); LIST / 2];
            ctx_reg
                .post_recv(&b, &mut rs, std::array::from_fn(|i| n + i as u64))
                .unwrap();
            let mut ss = [SendWr::new(0, WrOp::Send, &src); LIST / 2];
            ctx_reg
                .post_send(&a, &mut ss, std::array::from_fn(|i| n + i as u64))
                .unwrap();
            *posted += LIST as u64;
        } else if stream == Stream::Write || stream == Stream::Unsignaled {
            let mut wrs = [SendWr::new(u64::from(tag), WrOp::Write(remote), &src); LIST];
            if stream == Stream::Unsignaled {
                for w in &mut wrs[..LIST - 1] {
                    *w = w.unsignaled();
                }
            }
            reg.post_send(&a, &mut wrs).unwrap();
            *posted += LIST as u64;
        } else {
            let mut rs = [RecvWr::new(u64::from(tag), &dst); LIST / 2];
            reg.post_recv(&b, &mut rs).unwrap();
            let mut ss = [SendWr::new(u64::from(tag), WrOp::Send, &src); LIST / 2];
            reg.post_send(&a, &mut ss).unwrap();
            *posted += LIST as u64;
        }
        wait(*posted, 64);
    };
    for stream in [
        Stream::SendRecv,
        Stream::Write,
        Stream::Unsignaled,
        Stream::Contexts,
    ] {
        let start = posted;
        while posted - start < WARM_UP {
            let tag = (posted % 1000) as u32;
            round(&mut posted, tag, stream);
        }
        wait(posted, 0);
        let start = posted;
        counted_window(stream, "the simulator", || {
            while posted - start < REQUESTS {
                let tag = (posted % 1000) as u32;
                round(&mut posted, tag, stream);
            }
            wait(posted, 0);
        });
    }
    // Completion futures: a current-thread runtime (made before the
    // window) awaits each request's future; 4 receives and 4 sends a round,
    // one posting call each.
    let ops = handle.register_futures::<u64>(256).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut futures_posted = 0u64;
    let future_round = |n: &mut u64| {
        let base = *n;
        rt.block_on(async {
            let recvs: [_; LIST / 2] = std::array::from_fn(|i| {
                ops.post_recv(&b, RecvWr::new(0, &dst), base + i as u64)
                    .unwrap()
            });
            let sends: [_; LIST / 2] = std::array::from_fn(|i| {
                ops.post_send(&a, SendWr::new(0, WrOp::Send, &src), base + i as u64)
                    .unwrap()
            });
            for (i, op) in sends.into_iter().enumerate() {
                let (out, held) = op.await;
                assert!(out.is_ok(), "{out:?}");
                assert_eq!(held, base + i as u64);
            }
            for (i, op) in recvs.into_iter().enumerate() {
                let (out, held) = op.await;
                assert_eq!(out.map(|d| d.byte_len()), Ok(64));
                assert_eq!(held, base + i as u64);
            }
        });
        *n += LIST as u64;
    };
    while futures_posted < WARM_UP {
        future_round(&mut futures_posted);
    }
    let start = futures_posted;
    counted_window(Stream::Futures, "the simulator", || {
        while futures_posted - start < REQUESTS {
            future_round(&mut futures_posted);
        }
    });
    assert_eq!(ops.ledger().outstanding(), 0);
    assert_eq!(errors.load(Ordering::Acquire), 0);
    drop((a, b));
    let report = poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    assert_eq!(done.load(Ordering::Acquire), posted);
}
