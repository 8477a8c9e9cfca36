//! Connections that come and go, beside the ones that stay (issue 41): how
//! many closes and opens per second one thread gets through while other
//! connections carry traffic, and what that churn costs those
//! connections' latency, with churn against without, in one run.
//!
//! On the simulated NIC (inline engine): a server CQ with its poller, one
//! SRQ, and `L` live connections (64 by default), each a server QP drawing
//! its receives from the SRQ and a client QP on a client CQ polled by a
//! second poller. The server's handler tops the SRQ up (one receive posted
//! for each one consumed) and answers each request of a steady connection
//! with a SEND on its QP.
//!
//! - **Steady traffic**: `K` of the connections (8) each keep one request
//!   in flight, closed loop: the client's handler, on a reply, records the
//!   round trip (from the `Instant` taken before the request's post to the
//!   reply's receive completion), posts the next receive and the next
//!   request. p50 and p99 of the round trips of each run's window.
//! - **Churn**: a thread closes the oldest of the other connections
//!   (`close()` on its server and client QPs, and waits for both closes),
//!   and opens a new one (two QPs, connected; its client sends one
//!   message, which the server receives through the SRQ) as fast as it can,
//!   or at `--rate N` cycles per second. The figure is close+open cycles
//!   per second over the window.
//!
//! Each run builds its connections, lets traffic settle for a warm-up,
//! measures over a window (1 s; 250 ms with `--quick`), stops the traffic
//! and the churn, closes every connection and stops both pollers with
//! `cqd::core::shutdown`: the reports must be clean, every account
//! balanced, every request and reply accounted, and the SRQ's receives
//! still posted at the stop handed back by it (`srq_returned`) as flushes
//! to the server's handler. A run that loses a completion panics.
//!
//! Runs without churn and with churn alternate, 5 of each (1 with
//! `--quick`); each figure is the median of the runs [min–max], and the
//! ratio column divides the median with churn by the one without. The
//! server's poller is pinned to CPU 1 when the machine has two; the
//! client's poller and the churn thread are left to the scheduler.
//!
//! `taskset -c 0,1 cargo bench --bench churn` (add `-- --quick` for a CI
//! smoke run; `-- --mode busy|event|hybrid|adaptive` for the pollers' mode,
//! event by default; `-- --rate N` to pace the churn at N cycles per
//! second; `-- --live L` for the number of live connections). Figures are
//! recorded in docs/benchmarks.md, "Connections that come and go".

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};

use cqd::core::{
    CqOptions, Failed, Handler, NoSink, NoWork, OpKind, Outbox, PollMode, PollerBuilder,
    PollerThread, RecvDone, Registration, SendDone,
};
use cqd::sim::{
    Access, Cq, CqConfig, Fabric, Modify, Mr, Pd, Qp, QpCap, QpInit, RecvWr, SendWr, Srq, WrOp,
};

#[path = "common/pin.rs"]
mod pin;
use pin::pin;

/// Connections that keep one request in flight each.
const STEADY: usize = 8;
/// The SRQ's receives, all kept posted.
const SRQ_DEPTH: u32 = 1024;
/// Completions each CQ holds.
const CQE: u32 = 16 * 1024;
/// Bytes of a message.
const MSG: u32 = 8;
/// The tags of the churned clients' messages carry this bit; a steady
/// client's carry its index.
const CHURN_TAG: u32 = 1 << 23;
/// Longest wait for anything in a run: past it, something was lost.
const PATIENCE: Duration = Duration::from_secs(30);

/// What the two handlers and the churn thread count, checked at the end of
/// a run.
#[derive(Default)]
struct Counts {
    /// Steady requests the clients posted.
    requests: AtomicU64,
    /// Steady requests the server received.
    served: AtomicU64,
    /// Replies the server's sends completed.
    replies_sent: AtomicU64,
    /// Replies the clients received.
    replies: AtomicU64,
    /// Client send completions (steady requests and churn messages).
    client_sends: AtomicU64,
    /// Churned clients' messages sent.
    churn_sent: AtomicU64,
    /// Churned clients' messages the server received.
    churn_received: AtomicU64,
    /// SRQ receives posted (the initial fill and the top-ups).
    srq_posted: AtomicU64,
    /// SRQ receives handed back by the stop, as flushes.
    srq_flushed: AtomicU64,
    /// Steady requests in flight.
    in_flight: AtomicU64,
    /// Close+open cycles done.
    cycles: AtomicU64,
}

/// The flags a run's threads read.
#[derive(Default)]
struct Flags {
    /// The steady clients post their next request.
    traffic: AtomicBool,
    /// Round trips are recorded.
    recording: AtomicBool,
    /// The churn thread keeps going.
    churn: AtomicBool,
}

/// The server's handler: tops the SRQ up, answers the steady connections.
struct Server {
    reg: Registration,
    srq: Arc<Srq>,
    mr: Arc<Mr>,
    /// The steady connections' server QPs, by index; emptied at the end of
    /// a run, when they close.
    qps: Arc<RwLock<Vec<Qp>>>,
    /// Server QP number → steady index.
    steady: HashMap<u32, usize>,
    counts: Arc<Counts>,
}

impl Server {
    fn top_up(&self) {
        let n = self.counts.srq_posted.fetch_add(1, Ordering::Relaxed);
        let sge = [self.mr.sge(slot(n), MSG)];
        self.reg
            .post_recv(&*self.srq, &mut [RecvWr::new(n & 0xff_ffff, &sge)])
            .expect("SRQ top-up");
    }
}

impl Handler for Server {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.counts.replies_sent.fetch_add(1, Ordering::Relaxed);
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.top_up();
        match self.steady.get(&d.qp_num()) {
            Some(&i) => {
                self.counts.served.fetch_add(1, Ordering::Relaxed);
                let qps = self.qps.read();
                let sge = [self.mr.sge(0, MSG)];
                self.reg
                    .post_send(&qps[i], &mut [SendWr::new(i as u64, WrOp::Send, &sge)])
                    .expect("reply");
            }
            None => {
                self.counts.churn_received.fetch_add(1, Ordering::Release);
            }
        }
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        assert!(
            f.is_flush() && f.kind() == OpKind::Recv,
            "server: unexpected error completion: {} ({:?})",
            f.status(),
            f.kind()
        );
        self.counts.srq_flushed.fetch_add(1, Ordering::Relaxed);
    }
}

/// The clients' handler: closes each steady connection's loop and records
/// its round trips.
struct Client {
    reg: Registration,
    mr: Arc<Mr>,
    /// The steady connections' client QPs, by index.
    qps: Arc<RwLock<Vec<Qp>>>,
    /// When each steady connection's request in flight was posted.
    posted_at: Vec<Instant>,
    /// Round trips of the window, in ns.
    rtts: Arc<Mutex<Vec<u64>>>,
    counts: Arc<Counts>,
    flags: Arc<Flags>,
}

impl Client {
    /// Posts steady connection `i`'s receive for its reply, then its
    /// request.
    fn request(&mut self, i: usize) {
        let qps = self.qps.read();
        let sge = [self.mr.sge(4096 + slot(i as u64), MSG)];
        self.reg
            .post_recv(&qps[i], &mut [RecvWr::new(i as u64, &sge)])
            .expect("client receive");
        self.counts.requests.fetch_add(1, Ordering::Relaxed);
        self.posted_at[i] = Instant::now();
        self.reg
            .post_send(&qps[i], &mut [SendWr::new(i as u64, WrOp::Send, &sge)])
            .expect("request");
    }
}

impl Handler for Client {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.counts.client_sends.fetch_add(1, Ordering::Relaxed);
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let i = d.tag() as usize;
        let rtt = self.posted_at[i].elapsed().as_nanos() as u64;
        self.counts.replies.fetch_add(1, Ordering::Relaxed);
        if self.flags.recording.load(Ordering::Relaxed) {
            self.rtts.lock().push(rtt);
        }
        if self.flags.traffic.load(Ordering::Acquire) {
            self.request(i);
        } else {
            self.counts.in_flight.fetch_sub(1, Ordering::Release);
        }
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        panic!(
            "client: unexpected error completion: {} ({:?})",
            f.status(),
            f.kind()
        );
    }
}

/// The buffer offset of receive `n` (64 bytes each, in the first 64 KiB).
fn slot(n: u64) -> u64 {
    (n % 1024) * 64
}

/// RESET → INIT → RTR → RTS towards `peer`; a send waits for its receive.
fn connect(qp: &Qp, peer: u32) {
    let access = Access::REMOTE_WRITE | Access::REMOTE_READ;
    qp.modify(Modify::Init { access }).expect("INIT");
    qp.modify(Modify::Rtr { remote_qpn: peer }).expect("RTR");
    qp.modify(Modify::Rts {
        rnr_retry: 7,
        retry_cnt: 7,
    })
    .expect("RTS");
}

/// What opening a connection needs.
struct Side {
    pd: Pd,
    scq: Cq,
    ccq: Cq,
    srq: Arc<Srq>,
}

impl Side {
    /// A connection: a server QP on the SRQ (send queue of `send`), a
    /// client QP with a receive queue of one.
    fn open(&self, send: u32) -> (Qp, Qp) {
        let server = self
            .pd
            .create_qp(
                &QpInit::new(
                    &self.scq,
                    &self.scq,
                    QpCap {
                        max_send_wr: send,
                        max_recv_wr: 0,
                        ..QpCap::default()
                    },
                )
                .with_srq(&self.srq),
            )
            .expect("server QP");
        let client = self
            .pd
            .create_qp(&QpInit::new(
                &self.ccq,
                &self.ccq,
                QpCap {
                    max_send_wr: 2,
                    max_recv_wr: 1,
                    ..QpCap::default()
                },
            ))
            .expect("client QP");
        connect(&server, client.qpn());
        connect(&client, server.qpn());
        (server, client)
    }
}

/// Closes a connection's two QPs and waits for both closes.
fn close(server: Qp, client: Qp) {
    let (s, c) = (server.close(), client.close());
    s.wait(PATIENCE).expect("server QP close");
    c.wait(PATIENCE).expect("client QP close");
}

/// One run's figures.
struct Run {
    p50_us: f64,
    p99_us: f64,
    /// Steady round trips per second of the window.
    per_s: f64,
    cycles_per_s: f64,
}

fn run(mode: PollMode, live: usize, churn: bool, rate: Option<f64>, window: Duration) -> Run {
    let warm = Duration::from_millis(100);
    let dev = Fabric::inline().open_device("sim0", Default::default());
    let pd = dev.alloc_pd();
    let (scq, server_poller, server_handle) = dev
        .create_dispatched_cq::<NoWork>("server", CQE, CqConfig::default(), CqOptions::default())
        .expect("server CQ");
    let (ccq, client_poller, client_handle) = dev
        .create_dispatched_cq::<NoWork>("clients", CQE, CqConfig::default(), CqOptions::default())
        .expect("client CQ");
    let srq = Arc::new(pd.create_srq(SRQ_DEPTH, 1).expect("SRQ"));
    let mr = Arc::new(pd.reg_mr(64 * 1024, Access::ALL).expect("MR"));
    let side = Side { pd, scq, ccq, srq };
    let counts = Arc::new(Counts::default());
    let flags = Arc::new(Flags::default());
    let rtts = Arc::new(Mutex::new(Vec::with_capacity(1 << 20)));

    // The steady connections, then the others.
    let (mut servers, mut clients) = (Vec::new(), Vec::new());
    for _ in 0..STEADY {
        let (s, c) = side.open(2);
        servers.push(s);
        clients.push(c);
    }
    let steady: HashMap<u32, usize> = servers
        .iter()
        .enumerate()
        .map(|(i, q)| (q.qpn(), i))
        .collect();
    let server_qps = Arc::new(RwLock::new(servers));
    let client_qps = Arc::new(RwLock::new(clients));
    let server_reg = server_handle
        .register_with(|reg| Server {
            reg: reg.clone(),
            srq: Arc::clone(&side.srq),
            mr: Arc::clone(&mr),
            qps: Arc::clone(&server_qps),
            steady,
            counts: Arc::clone(&counts),
        })
        .expect("register the server");
    let client_reg = client_handle
        .register_with(|reg| Client {
            reg: reg.clone(),
            mr: Arc::clone(&mr),
            qps: Arc::clone(&client_qps),
            posted_at: vec![Instant::now(); STEADY],
            rtts: Arc::clone(&rtts),
            counts: Arc::clone(&counts),
            flags: Arc::clone(&flags),
        })
        .expect("register the clients");
    let server_thread = PollerBuilder::new("server", NoSink)
        .mode(mode)
        .on_start(|| pin(1))
        .cq(server_poller)
        .spawn()
        .expect("server poller");
    let client_thread: PollerThread = PollerBuilder::new("clients", NoSink)
        .mode(mode)
        .cq(client_poller)
        .spawn()
        .expect("client poller");
    // The SRQ full, kept so by the server's handler.
    let fill: Vec<u64> = (0..u64::from(SRQ_DEPTH)).collect();
    counts
        .srq_posted
        .store(u64::from(SRQ_DEPTH), Ordering::Relaxed);
    let sges: Vec<_> = fill.iter().map(|&n| [mr.sge(slot(n), MSG)]).collect();
    let mut wrs: Vec<_> = fill
        .iter()
        .zip(&sges)
        .map(|(&n, sge)| RecvWr::new(n, sge))
        .collect();
    server_reg
        .post_recv(&*side.srq, &mut wrs)
        .expect("SRQ fill");
    drop(wrs);

    let mut churned: VecDeque<(Qp, Qp)> = (STEADY..live).map(|_| side.open(1)).collect();
    let msg = [mr.sge(0, MSG)];

    // The steady loops start: one request each, posted as the client's
    // handler posts the next ones.
    flags.traffic.store(true, Ordering::Release);
    counts.in_flight.store(STEADY as u64, Ordering::Release);
    {
        let qps = client_qps.read();
        for (i, qp) in qps.iter().enumerate() {
            let sge = [mr.sge(4096 + slot(i as u64), MSG)];
            client_reg
                .post_recv(qp, &mut [RecvWr::new(i as u64, &sge)])
                .expect("client receive");
            counts.requests.fetch_add(1, Ordering::Relaxed);
            client_reg
                .post_send(qp, &mut [SendWr::new(i as u64, WrOp::Send, &sge)])
                .expect("request");
        }
    }

    let (mut cycles, mut elapsed) = (0.0, 1.0);
    std::thread::scope(|s| {
        let churner = churn.then(|| {
            flags.churn.store(true, Ordering::Release);
            s.spawn(|| {
                let started = Instant::now();
                let mut done = 0u64;
                while flags.churn.load(Ordering::Acquire) {
                    if let Some(rate) = rate {
                        let due = started + Duration::from_secs_f64(done as f64 / rate);
                        if let Some(wait) = due.checked_duration_since(Instant::now()) {
                            std::thread::sleep(wait);
                        }
                    }
                    let (server, client) = side.open(1);
                    let n = counts.churn_sent.fetch_add(1, Ordering::Relaxed);
                    client_reg
                        .post_send(
                            &client,
                            &mut [SendWr::new(
                                u64::from(CHURN_TAG | (n as u32 & 0x7f_ffff)),
                                WrOp::Send,
                                &msg,
                            )],
                        )
                        .expect("churned client's message");
                    churned.push_back((server, client));
                    let (server, client) = churned.pop_front().expect("a churned connection");
                    // The oldest one's message has arrived before it
                    // closes (those before it arrived first).
                    let want = done + 1;
                    let t0 = Instant::now();
                    while counts.churn_received.load(Ordering::Acquire) < want {
                        assert!(t0.elapsed() < PATIENCE, "churned message {want} lost");
                        std::thread::yield_now();
                    }
                    close(server, client);
                    done += 1;
                    counts.cycles.store(done, Ordering::Release);
                }
            })
        });
        std::thread::sleep(warm);
        flags.recording.store(true, Ordering::Release);
        let c0 = counts.cycles.load(Ordering::Acquire);
        let t0 = Instant::now();
        std::thread::sleep(window);
        flags.recording.store(false, Ordering::Release);
        let c1 = counts.cycles.load(Ordering::Acquire);
        elapsed = t0.elapsed().as_secs_f64();
        cycles = (c1 - c0) as f64 / elapsed;
        flags.churn.store(false, Ordering::Release);
        if let Some(h) = churner {
            h.join().expect("the churn thread");
        }
    });

    // The steady loops end with their last replies.
    flags.traffic.store(false, Ordering::Release);
    let t0 = Instant::now();
    while counts.in_flight.load(Ordering::Acquire) > 0 {
        assert!(t0.elapsed() < PATIENCE, "steady replies lost");
        std::thread::sleep(Duration::from_micros(100));
    }
    let churn_sent = counts.churn_sent.load(Ordering::Relaxed);
    let t0 = Instant::now();
    while counts.churn_received.load(Ordering::Acquire) < churn_sent
        || counts.client_sends.load(Ordering::Acquire)
            < counts.requests.load(Ordering::Relaxed) + churn_sent
        || counts.replies_sent.load(Ordering::Acquire) < counts.served.load(Ordering::Relaxed)
    {
        assert!(t0.elapsed() < PATIENCE, "completions lost");
        std::thread::sleep(Duration::from_micros(100));
    }
    // Every connection closes, then both pollers stop.
    for (server, client) in churned {
        close(server, client);
    }
    let servers = std::mem::take(&mut *server_qps.write());
    let clients = std::mem::take(&mut *client_qps.write());
    for (server, client) in servers.into_iter().zip(clients) {
        close(server, client);
    }
    let report = cqd::core::shutdown(|| {}, [server_thread, client_thread], []);
    assert!(
        report.is_clean(),
        "the stop found something wrong:\n{report}"
    );
    for p in &report.pollers {
        for a in &p.accounts.accounts {
            assert_eq!(a.posted, a.completed, "{a:?}");
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
                "CQ {}",
                c.name
            );
        }
    }
    let n = |a: &AtomicU64| a.load(Ordering::Acquire);
    let requests = n(&counts.requests);
    assert_eq!(n(&counts.served), requests, "steady requests received");
    assert_eq!(n(&counts.replies_sent), requests, "replies sent");
    assert_eq!(n(&counts.replies), requests, "replies received");
    assert_eq!(n(&counts.churn_received), churn_sent, "churned messages");
    assert_eq!(
        n(&counts.client_sends),
        requests + churn_sent,
        "client sends completed"
    );
    let consumed = requests + churn_sent;
    let srq_left = n(&counts.srq_posted) - consumed;
    assert_eq!(srq_left, u64::from(SRQ_DEPTH), "the SRQ kept full");
    let returned: u64 = report.pollers[0].cqs.iter().map(|c| c.srq_returned).sum();
    assert_eq!(
        returned, srq_left,
        "the SRQ's receives handed back by the stop"
    );
    assert_eq!(n(&counts.srq_flushed), srq_left, "as flushes to the server");

    let mut v = std::mem::take(&mut *rtts.lock());
    assert!(!v.is_empty(), "no round trip in the window");
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1e3;
    Run {
        p50_us: at(0.50),
        p99_us: at(0.99),
        per_s: v.len() as f64 / elapsed,
        cycles_per_s: cycles,
    }
}

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

/// A median [min-max] to `digits` decimals.
fn cell((m, lo, hi): (f64, f64, f64), digits: usize) -> String {
    format!("{m:.digits$} [{lo:.digits$}-{hi:.digits$}]")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let quick = args.iter().any(|a| a == "--quick");
    let mode_name = value("--mode").unwrap_or_else(|| "event".into());
    let mode = *PollMode::all()
        .iter()
        .find(|m| m.name() == mode_name)
        .unwrap_or_else(|| panic!("no poll mode {mode_name} (busy, event, hybrid, adaptive)"));
    let rate: Option<f64> = value("--rate").map(|r| r.parse().expect("--rate N"));
    let live: usize = value("--live").map_or(64, |l| l.parse().expect("--live L"));
    assert!(
        live > STEADY,
        "--live must exceed the {STEADY} steady connections"
    );
    let reps = if quick { 1 } else { 5 };
    let window = Duration::from_millis(if quick { 250 } else { 1000 });
    println!(
        "churn: {live} live connections on one server CQ and one SRQ, {STEADY} of them \
         steady (one request in flight each), {} pollers, churn {}; median of {reps} \
         runs [min-max], {} ms windows",
        mode.name(),
        rate.map_or("as fast as it goes".to_string(), |r| format!("at {r}/s")),
        window.as_millis()
    );
    let (mut calm, mut busy) = (Vec::new(), Vec::new());
    for _ in 0..reps {
        // Alternated, so that both meet the same machine load.
        calm.push(run(mode, live, false, rate, window));
        busy.push(run(mode, live, true, rate, window));
    }
    let col = |v: &[Run], f: fn(&Run) -> f64| stats(v.iter().map(f).collect());
    println!(
        "{:<32} {:>22} {:>22} {:>8}",
        "measure", "without churn", "with churn", "ratio"
    );
    type Measure = (&'static str, fn(&Run) -> f64, usize);
    let measures: [Measure; 3] = [
        ("steady RTT p50 (us)", |r| r.p50_us, 1),
        ("steady RTT p99 (us)", |r| r.p99_us, 1),
        ("steady round trips per s (k)", |r| r.per_s / 1e3, 1),
    ];
    for (name, f, digits) in measures {
        let (a, b) = (col(&calm, f), col(&busy, f));
        println!(
            "{:<32} {:>22} {:>22} {:>7.2}x",
            name,
            cell(a, digits),
            cell(b, digits),
            b.0 / a.0
        );
    }
    let c = col(&busy, |r| r.cycles_per_s);
    println!(
        "{:<32} {:>22} {:>22}",
        "churn cycles (close+open)/s",
        "-",
        cell(c, 0)
    );
}
