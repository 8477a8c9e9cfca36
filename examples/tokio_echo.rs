//! An echo client and server on tokio, written with cqd's completion
//! futures: each request is posted and `.await`ed; no handler, no table of
//! its own, no `unsafe`.
//!
//! ```text
//! cargo run --example tokio_echo                            # the simulated NIC
//! cargo run --example tokio_echo -- --conns 8 --msgs 20000 --poller
//! cargo run --features verbs --example tokio_echo -- --verbs   # under softverbs-run, or on rxe / a NIC
//! ```
//!
//! `--conns` connections (RC QP pairs on one CQ); on each, a client task
//! sends `--msgs` messages of `--size` bytes and awaits each echo, and a
//! server task keeps `DEPTH` receives posted, awaits them in order and
//! sends each message back from the very buffer it arrived in, reposting
//! that receive only once the echo's send has completed (the buffer is the
//! request's until then: the future hands it back with the outcome). The
//! CQ is driven by cqd's tokio driver on the same runtime, or with
//! `--poller` by a cqd poller thread (Event mode) while the tasks run on a
//! multi-thread runtime.
//!
//! At the end every QP goes to the error state: the server's receives left
//! posted come back flushed (their futures resolve with the flush and their
//! buffers), the driver or poller stops, and the example checks every echo
//! byte for byte, that the accounts balance, and that the stop's verdict is
//! clean; it exits non-zero otherwise.

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::future::{Done, Op, OpError, Ops};
use cqd::core::{CqHandle, CqOptions, NoSink, PollMode, PollerBuilder, PollerReport, UnboundCq};

/// Receives each server connection keeps posted (and the messages a client
/// may have in flight: one, here).
const DEPTH: usize = 16;

/// What a request holds: a buffer of the connection's registered region,
/// by its offset. The region outlives every request; the buffer is the
/// request's from its post until its future resolves (or, for a future
/// dropped early, until the device is done with it).
#[derive(Debug)]
struct Buf {
    off: u64,
    len: u32,
}

/// The network under the example: the simulated NIC or verbs. `qp` 2i is
/// connection i's client side, 2i + 1 its server side.
trait Net: Send + Sync + 'static {
    fn post_send(&self, ops: &Ops<Buf>, qp: usize, buf: Buf) -> Result<Op<Buf>, String>;
    fn post_recv(&self, ops: &Ops<Buf>, qp: usize, buf: Buf) -> Result<Op<Buf>, String>;
    fn write(&self, off: u64, data: &[u8]);
    fn read(&self, off: u64, out: &mut [u8]);
    /// Every QP to the error state: what is posted comes back flushed.
    fn flush(&self);
}

struct Args {
    conns: usize,
    msgs: u64,
    size: u32,
    poller: bool,
    verbs: bool,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        conns: 4,
        msgs: 5_000,
        size: 256,
        poller: false,
        verbs: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut num = |what: &str| -> Result<u64, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{what} takes a number"))
        };
        match flag.as_str() {
            "--conns" => a.conns = num("--conns")?.clamp(1, 64) as usize,
            "--msgs" => a.msgs = num("--msgs")?,
            "--size" => a.size = num("--size")?.clamp(8, 4096) as u32,
            "--poller" => a.poller = true,
            "--verbs" => a.verbs = true,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(a)
}

/// Each connection's part of the region: the client's send and receive
/// buffers, then the server's `DEPTH` receive buffers.
fn layout(conn: usize, size: u32) -> (u64, u64, u64) {
    let per = u64::from(size) * (2 + DEPTH as u64);
    let base = conn as u64 * per;
    (base, base + u64::from(size), base + 2 * u64::from(size))
}

/// The message `n` of connection `conn`: its bytes say which, so that a
/// reply crossed with another shows.
fn message(conn: usize, n: u64, size: u32) -> Vec<u8> {
    let mut m = vec![0u8; size as usize];
    m[..8].copy_from_slice(&n.to_le_bytes());
    for (i, b) in m[8..].iter_mut().enumerate() {
        *b = (conn as u64 * 31 + n * 7 + i as u64) as u8;
    }
    m
}

/// The client of connection `conn`: send, await the echo, check it.
async fn client(
    net: Arc<dyn Net>,
    ops: Ops<Buf>,
    conn: usize,
    msgs: u64,
    size: u32,
) -> Result<u64, String> {
    let (send_at, recv_at, _) = layout(conn, size);
    let mut got = vec![0u8; size as usize];
    for n in 0..msgs {
        let m = message(conn, n, size);
        net.write(send_at, &m);
        let reply = net.post_recv(
            &ops,
            2 * conn,
            Buf {
                off: recv_at,
                len: size,
            },
        )?;
        let sent = net.post_send(
            &ops,
            2 * conn,
            Buf {
                off: send_at,
                len: size,
            },
        )?;
        let (out, _buf) = sent.await;
        out.map_err(|e| format!("conn {conn}: send {n}: {e}"))?;
        let (out, buf) = reply.await;
        let done: Done = out.map_err(|e| format!("conn {conn}: echo {n}: {e}"))?;
        if done.byte_len() != size {
            return Err(format!(
                "conn {conn}: echo {n} is {} bytes, not {size}",
                done.byte_len()
            ));
        }
        net.read(buf.off, &mut got);
        if got != m {
            return Err(format!("conn {conn}: echo {n} differs from what was sent"));
        }
    }
    Ok(msgs)
}

/// The server of connection `conn`: keeps `DEPTH` receives posted, and
/// echoes each message from the buffer it arrived in. Ends when its
/// receives come back flushed (the QP went to the error state).
async fn server(net: Arc<dyn Net>, ops: Ops<Buf>, conn: usize, size: u32) -> Result<u64, String> {
    let (_, _, bufs) = layout(conn, size);
    let qp = 2 * conn + 1;
    let mut posted: VecDeque<Op<Buf>> = VecDeque::with_capacity(DEPTH);
    for i in 0..DEPTH as u64 {
        posted.push_back(net.post_recv(
            &ops,
            qp,
            Buf {
                off: bufs + i * u64::from(size),
                len: size,
            },
        )?);
    }
    let mut echoed = 0;
    while let Some(next) = posted.pop_front() {
        let (out, buf) = next.await;
        match out {
            Ok(done) => {
                let echo = Buf {
                    off: buf.off,
                    len: done.byte_len(),
                };
                let (out, echo) = net.post_send(&ops, qp, echo)?.await;
                if let Err(e) = out {
                    // The peer went away mid-echo: its QP is in the error
                    // state; what is left comes back flushed.
                    if e.is_flush() {
                        continue;
                    }
                    return Err(format!("conn {conn}: echo send: {e}"));
                }
                echoed += 1;
                posted.push_back(net.post_recv(
                    &ops,
                    qp,
                    Buf {
                        off: echo.off,
                        len: size,
                    },
                )?);
            }
            Err(e) if e.is_flush() => {}
            Err(OpError::Abandoned) => return Err(format!("conn {conn}: a receive was abandoned")),
            Err(e) => return Err(format!("conn {conn}: receive: {e}")),
        }
    }
    Ok(echoed)
}

/// Runs the clients to the end, then flushes: the servers end on their
/// flushed receives.
async fn run_all(
    net: Arc<dyn Net>,
    ops: Ops<Buf>,
    a: &Args,
    spawn: impl Fn(
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<u64, String>> + Send>>,
    ) -> tokio::task::JoinHandle<Result<u64, String>>,
) -> Result<(u64, u64), String> {
    let servers: Vec<_> = (0..a.conns)
        .map(|c| spawn(Box::pin(server(Arc::clone(&net), ops.clone(), c, a.size))))
        .collect();
    let clients: Vec<_> = (0..a.conns)
        .map(|c| {
            spawn(Box::pin(client(
                Arc::clone(&net),
                ops.clone(),
                c,
                a.msgs,
                a.size,
            )))
        })
        .collect();
    let mut sent = 0;
    for c in clients {
        sent += c.await.map_err(|e| e.to_string())??;
    }
    net.flush();
    let mut echoed = 0;
    for s in servers {
        echoed += s.await.map_err(|e| e.to_string())??;
    }
    Ok((sent, echoed))
}

fn main() -> ExitCode {
    let a = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tokio_echo: {e}");
            return ExitCode::from(2);
        }
    };
    let region = layout(a.conns, a.size).0;
    let setup = if a.verbs {
        verbs_net(a.conns, region)
    } else {
        sim_net(a.conns, region)
    };
    let (net, unbound, handle) = match setup {
        Ok(s) => s,
        Err(e) => {
            eprintln!("tokio_echo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let ops = match handle.register_futures::<Buf>((a.conns * (DEPTH + 4)) as u32) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("tokio_echo: {e}");
            return ExitCode::FAILURE;
        }
    };
    let start = Instant::now();
    let (result, report) = if a.poller {
        // A cqd poller thread drives the CQ; the tasks run on a
        // multi-thread runtime and are woken from the poller.
        let poller = PollerBuilder::new("echo", NoSink)
            .mode(PollMode::Event)
            .drain_timeout(Duration::from_secs(1))
            .cq(unbound)
            .spawn()
            .expect("poller");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .build()
            .expect("runtime");
        let result = rt.block_on(run_all(Arc::clone(&net), ops.clone(), &a, |f| {
            tokio::spawn(f)
        }));
        net.flush();
        (result, poller.stop().map_err(|e| e.to_string()))
    } else {
        // The tokio driver drives the CQ on the tasks' own thread.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let local = tokio::task::LocalSet::new();
        local.block_on(&rt, async {
            let driver = cqd::core::driver::TokioDriver::new("echo", NoSink)
                .cq(unbound)
                .spawn_local()
                .expect("driver");
            let result = run_all(Arc::clone(&net), ops.clone(), &a, |f| {
                tokio::task::spawn_local(f)
            })
            .await;
            net.flush();
            (result, Ok::<PollerReport, String>(driver.stop().await))
        })
    };
    let took = start.elapsed();
    let report = match report {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tokio_echo: stop: {e}");
            return ExitCode::FAILURE;
        }
    };
    print!("{report}");
    let (sent, echoed) = match result {
        Ok(r) => r,
        Err(e) => {
            eprintln!("tokio_echo: FAILED: {e}");
            return ExitCode::FAILURE;
        }
    };
    let driven = if a.poller {
        "a poller thread (Event)"
    } else {
        "the tokio driver"
    };
    let nic = if a.verbs {
        "verbs"
    } else {
        "the simulated NIC"
    };
    println!(
        "tokio_echo: {} connections, {sent} messages of {} bytes echoed and checked on {nic}, driven by {driven}: {:.0} round trips/s",
        a.conns,
        a.size,
        sent as f64 / took.as_secs_f64()
    );
    let expected = a.conns as u64 * a.msgs;
    if sent != expected || echoed != expected {
        eprintln!("tokio_echo: FAILED: {sent} sent, {echoed} echoed, {expected} expected");
        return ExitCode::FAILURE;
    }
    if !report.accounts.is_balanced() || !report.is_clean() {
        eprintln!("tokio_echo: FAILED: the stop's report is not clean");
        return ExitCode::FAILURE;
    }
    if ops.ledger().outstanding() != 0 {
        eprintln!(
            "tokio_echo: FAILED: {} requests outstanding",
            ops.ledger().outstanding()
        );
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

type Setup = (
    Arc<dyn Net>,
    UnboundCq<cqd::core::NoWork>,
    CqHandle<cqd::core::NoWork>,
);

/// The simulated NIC: one device, one CQ, `conns` connected QP pairs.
fn sim_net(conns: usize, region: u64) -> Result<Setup, String> {
    use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit};
    let dev = Device::open("echo0");
    let depth = DEPTH as u32 + 4;
    let (cq, unbound, handle) = dev
        .create_dispatched_cq(
            "echo",
            4 * depth * conns as u32 + 16,
            CqConfig::default(),
            CqOptions::default(),
        )
        .map_err(|e| e.to_string())?;
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCap::default()
    };
    let mut qps = Vec::new();
    for _ in 0..conns {
        let c = pd
            .create_qp(&QpInit::new(&cq, &cq, cap))
            .map_err(|e| e.to_string())?;
        let s = pd
            .create_qp(&QpInit::new(&cq, &cq, cap))
            .map_err(|e| e.to_string())?;
        connect(&c, &s).map_err(|e| e.to_string())?;
        qps.push(c);
        qps.push(s);
    }
    let mr = pd
        .reg_mr(region, Access::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    struct Sim {
        _dev: Device,
        qps: Vec<cqd::sim::Qp>,
        mr: cqd::sim::Mr,
    }
    impl Net for Sim {
        fn post_send(&self, ops: &Ops<Buf>, qp: usize, buf: Buf) -> Result<Op<Buf>, String> {
            let sge = [self.mr.sge(buf.off, buf.len)];
            let wr = cqd::sim::SendWr::new(0, cqd::sim::WrOp::Send, &sge);
            ops.post_send(&self.qps[qp], wr, buf)
                .map_err(|e| e.to_string())
        }
        fn post_recv(&self, ops: &Ops<Buf>, qp: usize, buf: Buf) -> Result<Op<Buf>, String> {
            let sge = [self.mr.sge(buf.off, buf.len)];
            ops.post_recv(&self.qps[qp], cqd::sim::RecvWr::new(0, &sge), buf)
                .map_err(|e| e.to_string())
        }
        fn write(&self, off: u64, data: &[u8]) {
            self.mr.write(off, data).expect("inside the region");
        }
        fn read(&self, off: u64, out: &mut [u8]) {
            self.mr.read(off, out).expect("inside the region");
        }
        fn flush(&self) {
            for qp in &self.qps {
                let _ = qp.modify(cqd::sim::Modify::Err);
            }
        }
    }
    Ok((Arc::new(Sim { _dev: dev, qps, mr }), unbound, handle))
}

/// Verbs: the first device (softverbs under softverbs-run, rxe, a NIC),
/// one CQ, `conns` QP pairs connected to each other in this process.
#[cfg(feature = "verbs")]
fn verbs_net(conns: usize, region: u64) -> Result<Setup, String> {
    use cqd::verbs::{Access, ConnectOptions, Context, CqSpec, QpCap, QpInit};
    let ctx = Context::open_first().map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let depth = DEPTH as u32 + 4;
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq(
            "echo",
            4 * depth * conns as u32 + 16,
            CqSpec::default(),
            CqOptions::default(),
        )
        .map_err(|e| e.to_string())?;
    let cap = QpCap {
        max_send_wr: depth,
        max_recv_wr: depth,
        ..QpCap::default()
    };
    let opts = ConnectOptions::default();
    let mut qps = Vec::new();
    for i in 0..conns as u32 {
        let c = pd
            .create_qp(&QpInit::new(&cq, &cq, cap))
            .map_err(|e| e.to_string())?;
        let s = pd
            .create_qp(&QpInit::new(&cq, &cq, cap))
            .map_err(|e| e.to_string())?;
        let (ec, es) = (
            c.endpoint(&opts, 2 * i + 1).map_err(|e| e.to_string())?,
            s.endpoint(&opts, 2 * i + 2).map_err(|e| e.to_string())?,
        );
        c.connect(&es, 2 * i + 1, &opts)
            .map_err(|e| e.to_string())?;
        s.connect(&ec, 2 * i + 2, &opts)
            .map_err(|e| e.to_string())?;
        qps.push(c);
        qps.push(s);
    }
    // Local access only: nothing here is reachable by a peer's RDMA.
    let mr = pd
        .reg_mr(region, Access::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    struct Verbs {
        qps: Vec<cqd::verbs::Qp>,
        mr: cqd::verbs::Mr,
    }
    impl Net for Verbs {
        fn post_send(&self, ops: &Ops<Buf>, qp: usize, buf: Buf) -> Result<Op<Buf>, String> {
            let sge = [self.mr.sge(buf.off as usize, buf.len)];
            let wr = cqd::verbs::SendWr::new(0, cqd::verbs::WrOp::Send, &sge);
            ops.post_send(&self.qps[qp], wr, buf)
                .map_err(|e| e.to_string())
        }
        fn post_recv(&self, ops: &Ops<Buf>, qp: usize, buf: Buf) -> Result<Op<Buf>, String> {
            let sge = [self.mr.sge(buf.off as usize, buf.len)];
            ops.post_recv(&self.qps[qp], cqd::verbs::RecvWr::new(0, &sge), buf)
                .map_err(|e| e.to_string())
        }
        fn write(&self, off: u64, data: &[u8]) {
            self.mr.write(off as usize, data);
        }
        fn read(&self, off: u64, out: &mut [u8]) {
            self.mr.read(off as usize, out);
        }
        fn flush(&self) {
            for qp in &self.qps {
                let _ = qp.to_error();
            }
        }
    }
    Ok((Arc::new(Verbs { qps, mr }), unbound, handle))
}

#[cfg(not(feature = "verbs"))]
fn verbs_net(_: usize, _: u64) -> Result<Setup, String> {
    Err("--verbs needs the verbs feature: cargo run --features verbs --example tokio_echo -- --verbs".into())
}
