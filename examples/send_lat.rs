//! SEND/RECV ping-pong latency through cqd's poller, on real verbs: what
//! perftest's `ib_send_lat` measures, with every completion going through a
//! cqd poller thread and its handler.
//!
//! ```text
//! taskset -c 0 softverbs-run target/release/examples/send_lat --mode busy &           # server
//! taskset -c 1 softverbs-run target/release/examples/send_lat --mode busy 127.0.0.1  # client
//! scripts/verbs-lat.sh    # both modes against ib_send_lat and ib_send_lat -e
//! ```
//!
//! Like `ib_send_lat`, server and client are two processes that exchange
//! their QP endpoints over TCP (`-p PORT`, default 18515), then ping-pong
//! `-n` (default 10,000) SENDs of `-s` bytes (default 2, inline) on one RC
//! QP pair. Each side:
//!
//! - runs one cqd poller thread (`PollerBuilder`, `--mode busy|event`)
//!   over one CQ that takes both its send and its receive completions, or
//!   with `--loop step` a loop of its own on `CqPoller`'s step API (poll;
//!   when empty, spin, or arm, poll again and block on the CQ's
//!   descriptor), or with `--loop tokio` (event mode) cqd's tokio driver
//!   on a current-thread runtime of its own thread. The thread is pinned (core_affinity) to `--cpu`, by
//!   default to the first CPU the process may use (run the two sides under
//!   `taskset -c 0` and `taskset -c 1`); `--no-pin` leaves it to the
//!   scheduler;
//! - has one handler. Its `on_recv` takes a timestamp, as `ib_send_lat`
//!   takes one before each post, and posts the next SEND, then gives the
//!   receive buffer back, in lists of 16 — both through
//!   `Registration::post_send` / `post_recv`, the only posting call. The
//!   client's first SEND is posted by the main thread, which starts the
//!   exchange;
//! - signals one SEND in `--cq-mod` (default 64) and the last one, as
//!   perftest moderates send completions; the unsignaled ones are retired
//!   by the next signaled completion of their queue (cqd's accounting).
//!
//! The report follows `ib_send_lat`'s: the one-way latency of each
//! iteration is half the time between two consecutive SENDs of this side
//! (a round trip); t_typical is their median. The client's handler takes
//! the timestamps from its second SEND on (the first is the main
//! thread's), so there are `n - 2` samples. The last line is
//! `t_typical_us=…` for scripts (scripts/verbs-lat.sh).
//!
//! Without `softverbs-run` (or a real device) it prints
//! `SKIPPED: needs softverbs-run` and exits 0.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    CqOptions, Failed, Handler, NoSink, NoWork, Outbox, PollMode, PollerBuilder, RecvDone,
    Registration, SendDone, UnboundCq,
};
use cqd::verbs::{
    Access, ConnectOptions, Context, CqSpec, Endpoint, Mr, Mtu, Qp, QpCap, QpInit, RecvWr, SendWr,
    Sge, WrOp,
};

/// Receives kept posted.
const RX_DEPTH: u32 = 64;
/// Receives posted again together, in one list.
const REPOST_BATCH: usize = 16;
/// Bytes per buffer slot of the region (the SEND's, then one per receive).
const SLOT: usize = 4096;

struct Args {
    mode: PollMode,
    port: u16,
    iters: u64,
    size: u32,
    cq_mod: u64,
    cpu: Option<usize>,
    pin: bool,
    step: bool,
    /// `--loop tokio`: the CQ driven by cqd's tokio driver.
    tokio: bool,
    /// The GID index to address the peer by (RoCE needs one: rxe's is 1).
    gid_index: Option<u8>,
    host: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        mode: PollMode::Busy,
        port: 18515,
        iters: 10_000,
        size: 2,
        cq_mod: 64,
        cpu: None,
        pin: true,
        step: false,
        tokio: false,
        gid_index: None,
        host: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<String, String> {
            it.next().ok_or(format!("{name} needs a value"))
        };
        let num = |name: &str, v: String| -> Result<u64, String> {
            v.parse().map_err(|e| format!("{name}: {e}"))
        };
        match flag.as_str() {
            "--mode" | "-m" => {
                a.mode = match value("--mode")?.as_str() {
                    "busy" => PollMode::Busy,
                    "event" => PollMode::Event,
                    other => return Err(format!("--mode busy|event, not {other}")),
                }
            }
            "-p" | "--port" => a.port = num("--port", value("--port")?)? as u16,
            "-n" | "--iters" => a.iters = num("--iters", value("--iters")?)?.max(5),
            "-s" | "--size" => {
                a.size = num("--size", value("--size")?)?.clamp(1, SLOT as u64) as u32
            }
            "--cq-mod" => a.cq_mod = num("--cq-mod", value("--cq-mod")?)?.clamp(1, 64),
            "--cpu" => a.cpu = Some(num("--cpu", value("--cpu")?)? as usize),
            "--no-pin" => a.pin = false,
            "-g" | "--gid-index" => {
                a.gid_index = Some(num("--gid-index", value("--gid-index")?)?.min(255) as u8)
            }
            "--loop" => {
                (a.step, a.tokio) = match value("--loop")?.as_str() {
                    "thread" => (false, false),
                    "step" => (true, false),
                    "tokio" => (false, true),
                    other => return Err(format!("--loop thread|step|tokio, not {other}")),
                }
            }
            host if !host.starts_with('-') && a.host.is_none() => a.host = Some(host.into()),
            other => {
                return Err(format!(
                    "unknown argument {other} (send_lat [--mode busy|event] [-p PORT] [-n ITERS] [-s SIZE] [--cq-mod N] [--cpu N | --no-pin] [--loop thread|step|tokio] [-g GID_INDEX] [HOST])"
                ))
            }
        }
    }
    if a.tokio && a.mode != PollMode::Event {
        return Err("--loop tokio runs the Event protocol: add --mode event".into());
    }
    Ok(a)
}

/// What a side's handler hands back when the exchange is over.
type Outcome = Result<Vec<u64>, String>;

/// The one handler of a side (see the module documentation).
struct PingPong {
    reg: Registration,
    qp: Arc<Qp>,
    mr: Mr,
    size: u32,
    inline: bool,
    iters: u64,
    cq_mod: u64,
    /// SENDs posted (the client's main thread posted the first).
    sent: u64,
    recvd: u64,
    last_send_done: bool,
    /// Receive slots consumed and not yet posted again.
    to_repost: [u32; REPOST_BATCH],
    n_repost: usize,
    t0: Instant,
    /// ns since `t0`, taken before each SEND this handler posts.
    stamps: Vec<u64>,
    done: Option<SyncSender<Outcome>>,
}

impl PingPong {
    fn finish(&mut self, outcome: Outcome) {
        if let Some(tx) = self.done.take() {
            let _ = tx.send(outcome);
        }
    }

    fn fail(&mut self, why: String) {
        self.finish(Err(why));
    }

    fn reg(&self) -> &Registration {
        &self.reg
    }

    fn post_next_send(&mut self) {
        self.stamps.push(self.t0.elapsed().as_nanos() as u64);
        self.sent += 1;
        let sge = [self.mr.sge(0, self.size)];
        let mut wr = SendWr::new(self.sent & 0xffff, WrOp::Send, &sge);
        wr.signaled = self.sent % self.cq_mod == 0 || self.sent == self.iters;
        wr.inline = self.inline;
        if let Err(e) = self.reg().post_send(&*self.qp, &mut [wr]) {
            self.fail(format!("post_send {}: {e}", self.sent));
        }
    }

    fn check_done(&mut self) {
        if self.recvd == self.iters && self.last_send_done {
            let stamps = std::mem::take(&mut self.stamps);
            self.finish(Ok(stamps));
        }
    }
}

impl Handler for PingPong {
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.recvd += 1;
        // The reply first: it is what the peer waits for.
        if self.sent < self.iters {
            self.post_next_send();
        }
        // Then the buffer goes back, in lists of REPOST_BATCH.
        self.to_repost[self.n_repost] = d.tag();
        self.n_repost += 1;
        if self.n_repost == REPOST_BATCH {
            self.n_repost = 0;
            let sges: [[Sge<'_>; 1]; REPOST_BATCH] = std::array::from_fn(|i| {
                [self
                    .mr
                    .sge((self.to_repost[i] as usize + 1) * SLOT, self.size)]
            });
            let mut wrs: [RecvWr<'_>; REPOST_BATCH] =
                std::array::from_fn(|i| RecvWr::new(u64::from(self.to_repost[i]), &sges[i]));
            if let Err(e) = self.reg().post_recv(&*self.qp, &mut wrs) {
                return self.fail(format!("post_recv: {e}"));
            }
        }
        self.check_done();
    }

    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        if u64::from(d.tag()) == self.iters & 0xffff && self.sent == self.iters {
            self.last_send_done = true;
            self.check_done();
        }
    }

    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        if !f.is_flush() {
            self.fail(format!("{} {} failed: {}", f.kind(), f.tag(), f.status()));
        }
    }
}

/// Pins the calling thread to `cpu`, if any.
fn pin(cpu: Option<usize>) -> Result<(), String> {
    match cpu {
        None => Ok(()),
        Some(id) => core_affinity::set_for_current(core_affinity::CoreId { id })
            .then_some(())
            .ok_or(format!("could not pin to CPU {id}")),
    }
}

/// The side's poller: cqd's poller thread, a loop of its own over the
/// step API (`--loop step`), or cqd's tokio driver (`--loop tokio`).
enum Poller {
    Thread(cqd::core::PollerThread),
    Step(StepLoop),
    Tokio(TokioLoop),
}

/// A thread running a current-thread tokio runtime on which cqd's tokio
/// driver drives the CQ (the Event protocol as a task), until told to stop.
struct TokioLoop {
    stop: tokio::sync::oneshot::Sender<()>,
    join: std::thread::JoinHandle<Result<cqd::core::PollerReport, String>>,
}

impl TokioLoop {
    /// Stops the driver after the QP was flushed; its report.
    fn stop(self) -> Result<cqd::core::PollerReport, String> {
        let _ = self.stop.send(());
        self.join
            .join()
            .map_err(|_| "the tokio thread panicked".to_string())?
    }
}

fn tokio_loop(unbound: UnboundCq<NoWork>, cpu: Option<usize>) -> Result<TokioLoop, String> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready_tx, ready_rx) = sync_channel(1);
    let join = std::thread::Builder::new()
        .name("send_lat-tokio".into())
        .spawn(move || -> Result<cqd::core::PollerReport, String> {
            let pinned = pin(cpu);
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string());
            let (rt, pinned) = match (rt, pinned) {
                (Ok(rt), Ok(())) => (rt, Ok(())),
                (Err(e), _) | (_, Err(e)) => {
                    let _ = ready_tx.send(Err(e.clone()));
                    return Err(e);
                }
            };
            let local = tokio::task::LocalSet::new();
            local.block_on(&rt, async move {
                let driver = cqd::core::driver::TokioDriver::new("send_lat", NoSink)
                    .cq(unbound)
                    .spawn_local()
                    .map_err(|e| e.to_string());
                let driver = match driver {
                    Ok(d) => {
                        let _ = ready_tx.send(pinned);
                        d
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.clone()));
                        return Err(e);
                    }
                };
                let _ = stopped.await;
                Ok(driver.stop().await)
            })
        })
        .map_err(|e| e.to_string())?;
    ready_rx
        .recv()
        .map_err(|_| "the tokio thread died".to_string())??;
    Ok(TokioLoop { stop, join })
}

/// A poll loop written on `CqPoller`'s step API: poll; when empty, spin
/// (busy) or arm, poll again and block on the CQ's descriptor (event).
struct StepLoop {
    stop: Arc<AtomicBool>,
    join: std::thread::JoinHandle<Result<(), String>>,
}

impl StepLoop {
    /// Stops the loop after the QP was flushed: it polls until nothing is
    /// outstanding, acknowledges every event and destroys the CQ.
    fn stop(self) -> Result<(), String> {
        self.stop.store(true, Ordering::Release);
        self.join
            .join()
            .map_err(|_| "the poll loop panicked".to_string())?
    }
}

fn step_loop(
    unbound: UnboundCq<NoWork>,
    mode: PollMode,
    cpu: Option<usize>,
) -> Result<StepLoop, String> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop);
    let (ready_tx, ready_rx) = sync_channel(1);
    let join = std::thread::Builder::new()
        .name("send_lat-step".into())
        .spawn(move || -> Result<(), String> {
            let pinned = pin(cpu);
            let _ = ready_tx.send(pinned.clone());
            pinned?;
            let e = |e: cqd::core::SourceError| e.to_string();
            let mut p = unbound.bind();
            p.apply_commands();
            let mut out = VecDeque::new();
            let safety = rustix::time::Timespec {
                tv_sec: 0,
                tv_nsec: 100_000_000,
            };
            while !flag.load(Ordering::Acquire) {
                if p.poll_once(&mut out).map_err(e)? > 0 {
                    continue;
                }
                if mode != PollMode::Event {
                    std::hint::spin_loop();
                    continue;
                }
                p.arm().map_err(e)?;
                if p.poll_once(&mut out).map_err(e)? > 0 {
                    continue;
                }
                {
                    let fd = p.event_fd();
                    let mut fds = [rustix::event::PollFd::new(
                        &fd,
                        rustix::event::PollFlags::IN,
                    )];
                    rustix::event::poll(&mut fds, Some(&safety)).map_err(|e| e.to_string())?;
                }
                p.take_events().map_err(e)?;
                if p.unacked_events() >= 16 {
                    p.ack_all().map_err(e)?;
                }
            }
            // The flush: everything posted completes (the QP is in error).
            let deadline = Instant::now() + Duration::from_secs(5);
            while p.outstanding() > 0 && Instant::now() < deadline {
                p.poll_once(&mut out).map_err(e)?;
            }
            let left = p.outstanding();
            let _ = p.take_events();
            p.ack_all().map_err(e)?;
            p.destroy().map_err(e)?;
            if left > 0 {
                return Err(format!("{left} requests never completed"));
            }
            Ok(())
        })
        .map_err(|e| e.to_string())?;
    ready_rx
        .recv()
        .map_err(|_| "the poll loop died".to_string())??;
    Ok(StepLoop { stop, join })
}

/// `lid qpn psn mtu gid` on one line.
fn send_endpoint(s: &mut TcpStream, e: &Endpoint) -> std::io::Result<()> {
    let gid: String = e.gid.iter().map(|b| format!("{b:02x}")).collect();
    writeln!(s, "{} {} {} {} {gid}", e.lid, e.qpn, e.psn, e.mtu.to_raw())
}

fn recv_endpoint(r: &mut impl BufRead) -> Result<Endpoint, String> {
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 5 || f[4].len() != 32 {
        return Err(format!("bad endpoint line {line:?}"));
    }
    let n = |s: &str| s.parse::<u32>().map_err(|e| format!("{s}: {e}"));
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = u8::from_str_radix(&f[4][2 * i..2 * i + 2], 16).map_err(|e| e.to_string())?;
    }
    Ok(Endpoint {
        lid: n(f[0])? as u16,
        qpn: n(f[1])?,
        psn: n(f[2])?,
        mtu: Mtu::from_raw(n(f[3])?),
        gid,
    })
}

/// One byte each way: the other side has reached the same point.
fn sync(s: &mut TcpStream, r: &mut impl BufRead) -> Result<(), String> {
    s.write_all(b"s\n").map_err(|e| e.to_string())?;
    let mut line = String::new();
    r.read_line(&mut line).map_err(|e| e.to_string())?;
    if line.trim() != "s" {
        return Err(format!("out of step: {line:?}"));
    }
    Ok(())
}

fn connect(args: &Args) -> Result<TcpStream, String> {
    match &args.host {
        None => {
            let l = TcpListener::bind(("0.0.0.0", args.port))
                .map_err(|e| format!("listen on {}: {e}", args.port))?;
            Ok(l.accept().map_err(|e| e.to_string())?.0)
        }
        Some(host) => {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                match TcpStream::connect((host.as_str(), args.port)) {
                    Ok(s) => return Ok(s),
                    Err(e) if Instant::now() >= deadline => {
                        return Err(format!("connect to {host}:{}: {e}", args.port))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
    }
}

/// One side's exchange: its one-way latencies in µs, sorted.
fn run(args: &Args) -> Result<Vec<f64>, String> {
    let client = args.host.is_some();
    let ctx = Context::open_first().map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
    let options = CqOptions {
        batch: 16,
        ..CqOptions::default()
    };
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("send_lat", 512, CqSpec::default(), options)
        .map_err(|e| e.to_string())?;
    let inline = args.size <= 236;
    let cap = QpCap {
        max_send_wr: 128,
        max_recv_wr: RX_DEPTH,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: if inline { 236 } else { 0 },
    };
    let qp = Arc::new(
        pd.create_qp(&QpInit::new(&cq, &cq, cap))
            .map_err(|e| e.to_string())?,
    );
    let mr = pd
        .reg_mr(SLOT as u64 * (u64::from(RX_DEPTH) + 1), Access::LOCAL_WRITE)
        .map_err(|e| e.to_string())?;
    mr.fill(0, args.size as usize, 0x5a);

    // The endpoint exchange and the connection.
    let mut stream = connect(args)?;
    let _ = stream.set_nodelay(true);
    let mut reader = BufReader::new(stream.try_clone().map_err(|e| e.to_string())?);
    let opts = ConnectOptions {
        gid_index: args.gid_index,
        ..ConnectOptions::default()
    };
    let psn = if client { 0x1000 } else { 0x2000 };
    let mine = qp.endpoint(&opts, psn).map_err(|e| e.to_string())?;
    send_endpoint(&mut stream, &mine).map_err(|e| e.to_string())?;
    let theirs = recv_endpoint(&mut reader)?;
    qp.connect(&theirs, psn, &opts).map_err(|e| e.to_string())?;

    // The handler, its registration, the receives, the poller.
    let (tx, rx) = sync_channel(1);
    let reg = handle
        .register_with(|reg| PingPong {
            reg: reg.clone(),
            qp: Arc::clone(&qp),
            mr: mr.clone(),
            size: args.size,
            inline,
            iters: args.iters,
            cq_mod: args.cq_mod,
            sent: u64::from(client),
            recvd: 0,
            last_send_done: false,
            to_repost: [0; REPOST_BATCH],
            n_repost: 0,
            t0: Instant::now(),
            stamps: Vec::with_capacity(args.iters as usize),
            done: Some(tx),
        })
        .map_err(|e| e.to_string())?;
    for i in 0..RX_DEPTH as usize {
        let sge = [mr.sge((i + 1) * SLOT, args.size)];
        reg.post_recv(&*qp, &mut [RecvWr::new(i as u64, &sge)])
            .map_err(|e| format!("post_recv: {e}"))?;
    }
    let cpu = match args.cpu {
        Some(id) => Some(id),
        None if args.pin => core_affinity::get_core_ids().and_then(|ids| ids.first().map(|c| c.id)),
        None => None,
    };
    let poller = if args.step {
        Poller::Step(step_loop(unbound, args.mode, cpu)?)
    } else if args.tokio {
        Poller::Tokio(tokio_loop(unbound, cpu)?)
    } else {
        Poller::Thread(
            PollerBuilder::new("send_lat", NoSink)
                .mode(args.mode)
                // Pinned alone on its core: pause and yield, never nap.
                .busy_naps(cpu.is_none())
                .on_start(move || pin(cpu))
                .cq(unbound)
                .spawn()
                .map_err(|e| e.to_string())?,
        )
    };

    // Both sides' receives are posted: the client starts.
    sync(&mut stream, &mut reader)?;
    if client {
        let sge = [mr.sge(0, args.size)];
        let mut wr = SendWr::new(1, WrOp::Send, &sge);
        wr.signaled = args.cq_mod == 1;
        wr.inline = inline;
        reg.post_send(&*qp, &mut [wr])
            .map_err(|e| format!("first post_send: {e}"))?;
    }
    let outcome = rx
        .recv_timeout(Duration::from_secs(60 + args.iters / 10_000))
        .map_err(|_| "the exchange did not finish (timeout)".to_string())?;
    // Both sides are done before either flushes its QP.
    sync(&mut stream, &mut reader)?;
    let _ = qp.to_error();
    let balanced = match poller {
        Poller::Thread(t) => {
            let report = t.stop().map_err(|e| e.to_string())?;
            report
                .accounts
                .is_balanced()
                .then_some(())
                .ok_or(format!("unbalanced accounts: {}", report.accounts))
        }
        Poller::Step(s) => s.stop(),
        Poller::Tokio(t) => {
            let report = t.stop()?;
            report
                .accounts
                .is_balanced()
                .then_some(())
                .ok_or(format!("unbalanced accounts: {}", report.accounts))
        }
    };
    let stamps = outcome?;
    balanced?;
    let mut lat: Vec<f64> = stamps
        .windows(2)
        .map(|w| (w[1] - w[0]) as f64 / 2e3)
        .collect();
    lat.sort_by(f64::total_cmp);
    Ok(lat)
}

fn main() {
    // The arguments first, so that a wrong one (or `--usage`) gets the
    // usage line on any machine.
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("send_lat: {e}");
            std::process::exit(2);
        }
    };
    let device = std::env::var_os("SOFTVERBS_RUN").is_some()
        || cqd::verbs::devices().is_ok_and(|d| !d.is_empty());
    if !device {
        println!("SKIPPED: needs softverbs-run (no RDMA device)");
        return;
    }
    match run(&args) {
        Ok(lat) if !lat.is_empty() => {
            let pct = |p: f64| lat[((lat.len() - 1) as f64 * p) as usize];
            let avg = lat.iter().sum::<f64>() / lat.len() as f64;
            println!(
                "cqd send_lat, {} mode, {} bytes, {} iterations ({} samples), {}",
                args.mode.name(),
                args.size,
                args.iters,
                lat.len(),
                if args.host.is_some() {
                    "client"
                } else {
                    "server"
                }
            );
            println!(
                " {:>7} {:>11} {:>12} {:>12} {:>16} {:>12} {:>8} {:>8}",
                "#bytes",
                "#iterations",
                "t_min[usec]",
                "t_max[usec]",
                "t_typical[usec]",
                "t_avg[usec]",
                "99%",
                "99.9%"
            );
            println!(
                " {:>7} {:>11} {:>12.2} {:>12.2} {:>16.2} {:>12.2} {:>8.2} {:>8.2}",
                args.size,
                args.iters,
                lat[0],
                lat[lat.len() - 1],
                pct(0.5),
                avg,
                pct(0.99),
                pct(0.999)
            );
            println!("t_typical_us={:.2}", pct(0.5));
        }
        Ok(_) => {
            eprintln!("send_lat: no samples");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("send_lat: {e}");
            std::process::exit(1);
        }
    }
}
