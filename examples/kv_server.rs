//! A key-value server on cqd, the guide's tutorial as one file
//! (docs/guide.md builds it step by step).
//!
//! ```text
//! cargo run --release --example kv_server                  # a clean run: its report and verdicts
//! cargo run --release --example kv_server -- --mistake all  # each mistake in turn, each named
//! ```
//!
//! Four client connections send GET and PUT requests to four server
//! connections, on the simulated NIC. The server's handlers share one CQ;
//! each copies its request out of the receive buffer, reposts the receive
//! and hands the request to a pool of two workers keyed by its key, so that
//! one key is always one worker's (each worker owns its shard of the map:
//! no lock). The worker replies on the request's connection through the
//! connection's registration; the reply's buffer comes back with the send's
//! completion, as its context. The threads come from `kv_server.toml`. The
//! client checks every reply against its own model of the map. At the end
//! one call stops everything and prints the report and its verdict.
//!
//! `--mistake NAME` commits one of the mistakes a new server makes, and the
//! run must end with a verdict that names it: `raw-post` (a reply posted
//! around the accounts), `no-repost` (receives never reposted),
//! `slow-handler` (a handler that blocks 2 ms), `unassigned-cq` (a CQ whose
//! name in the code is not the topology file's), `oversubscribe` (a
//! CQ too small for its queues). `--mistake all` runs the clean run and
//! each mistake in turn, and exits non-zero unless every verdict is right.

use std::collections::HashMap;
use std::error::Error;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::topology::TopologyConfig;
use cqd::core::{shutdown, ContextHandler, FindingKind, NoSink, NoWork, Route};
use cqd::core::{ContextRegistration, Failed, Outbox, RecvDone, SendDone, Silent};
use cqd::sim::{connect, Access, CqConfig, Device, Mr, Qp, QpCap, QpInit, RecvWr, SendWr, WrOp};
use crossbeam::queue::ArrayQueue;

const CONNS: u64 = 4;
/// Requests in flight per connection.
const DEPTH: u64 = 16;
/// Bytes per message: three little-endian words (op and slot, key, value).
const MSG: u64 = 24;
/// Keys per connection (each connection's keys are its own, so that its
/// model of them is exact).
const KEYS: u64 = 64;
const GET: u64 = 0;
const PUT: u64 = 1;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mistake {
    None,
    RawPost,
    NoRepost,
    SlowHandler,
    UnassignedCq,
    Oversubscribe,
}

fn encode(op: u64, slot: u64, key: u64, value: u64) -> [u8; MSG as usize] {
    let mut b = [0; MSG as usize];
    for (i, w) in [op | slot << 8, key, value].into_iter().enumerate() {
        b[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    b
}

/// (op, slot, key, value); `None` for a malformed message.
fn decode(mr: &Mr, offset: u64) -> Option<(u64, u64, u64, u64)> {
    let mut b = [0; MSG as usize];
    mr.read(offset, &mut b).ok()?;
    let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or([0; 8]));
    let (op, slot) = (w(0) & 0xff, w(0) >> 8);
    (op <= PUT && slot < DEPTH).then_some((op, slot, w(1), w(2)))
}

// ---------------------------------------------------------------- server

/// One server connection: receive buffers `0..DEPTH`, then `2 * DEPTH`
/// reply buffers, whose free ones wait in `free`.
struct SrvConn {
    reg: ContextRegistration<SrvCtx>,
    qp: Arc<Qp>,
    mr: Arc<Mr>,
    free: ArrayQueue<u64>,
    mistake: Mistake,
    raw_posted: AtomicBool,
}

/// What each server request carries: the buffer it holds.
enum SrvCtx {
    Recv(u64),
    Reply(u64),
}

/// A request, handed to the worker that owns its key.
struct Job {
    conn: Arc<SrvConn>,
    op: u64,
    slot: u64,
    key: u64,
    value: u64,
}

impl Job {
    /// On a worker: apply the request to the worker's shard, reply.
    fn run(self, shard: &mut HashMap<u64, u64>) {
        let value = match self.op {
            PUT => *shard.entry(self.key).insert_entry(self.value).get(),
            _ => shard.get(&self.key).copied().unwrap_or(0),
        };
        let c = &self.conn;
        // Free within a reply's send completion: at most DEPTH replies of
        // this connection are unsent, and there are 2 * DEPTH buffers.
        let b = loop {
            match c.free.pop() {
                Some(b) => break b,
                None => std::thread::yield_now(),
            }
        };
        let at = (DEPTH + b) * MSG;
        let sge = [c.mr.sge(at, MSG as u32)];
        if c.mr
            .write(at, &encode(self.op, self.slot, self.key, value))
            .is_err()
        {
            return; // cannot happen: the buffer is inside the region
        }
        if c.mistake == Mistake::RawPost && !c.raw_posted.swap(true, Relaxed) {
            // MISTAKE: the backend's raw post, around cqd's accounts.
            let _ =
                c.qp.post_send_unaccounted(&[SendWr::new(b, WrOp::Send, &sge)]);
            return;
        }
        let sent = c.reg.post_send(
            &*c.qp,
            &mut [SendWr::new(0, WrOp::Send, &sge)],
            [SrvCtx::Reply(b)],
        );
        if sent.is_err() {
            let _ = c.free.push(b); // the connection is closing
        }
    }
}

/// The server's handler, one per connection, on the server's poller.
struct Server(Arc<SrvConn>);

impl ContextHandler<Job> for Server {
    type Ctx = SrvCtx;
    fn on_recv(&mut self, _: &RecvDone<'_>, ctx: SrvCtx, out: &mut Outbox<'_, Job>) {
        let SrvCtx::Recv(r) = ctx else { return };
        let c = &self.0;
        let request = decode(&c.mr, r * MSG);
        if c.mistake == Mistake::SlowHandler {
            std::thread::sleep(Duration::from_millis(2)); // MISTAKE: blocks the poller
        }
        if c.mistake != Mistake::NoRepost {
            let buf = [c.mr.sge(r * MSG, MSG as u32)];
            let _ = c
                .reg
                .post_recv(&*c.qp, &mut [RecvWr::new(0, &buf)], [SrvCtx::Recv(r)]);
        } // else MISTAKE: the receive is never posted again
        if let Some((op, slot, key, value)) = request {
            let conn = Arc::clone(c);
            out.push_to(
                Route::Key(key),
                Job {
                    conn,
                    op,
                    slot,
                    key,
                    value,
                },
            );
        }
    }
    fn on_send(&mut self, _: &SendDone<'_>, ctx: SrvCtx, _: &mut Outbox<'_, Job>) {
        self.on_abandoned(ctx);
    }
    fn on_error(&mut self, _: &Failed<'_>, ctx: SrvCtx, _: &mut Outbox<'_, Job>) {
        self.on_abandoned(ctx); // flushes at the stop; the report counts the rest
    }
    fn on_silent(&mut self, _: &Silent, ctx: SrvCtx, _: &mut Outbox<'_, Job>) {
        self.on_abandoned(ctx);
    }
    fn on_abandoned(&mut self, ctx: SrvCtx) {
        if let SrvCtx::Reply(b) = ctx {
            let _ = self.0.free.push(b);
        }
    }
}

// ---------------------------------------------------------------- client

#[derive(Default)]
struct Tally {
    replies: AtomicU64,
    wrong: AtomicU64,
    failed: AtomicU64,
}

/// What each client request carries: its slot, or its reply buffer.
enum CliCtx {
    Request(u64),
    Reply(u64),
}

/// A request slot: what its reply must say, and which of its two
/// completions (the send's, the reply's) are in.
#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    expect: u64,
    sent: bool,
    replied: bool,
}

/// One client connection, on the client's poller: buffers `0..DEPTH` send
/// the slots' requests, `DEPTH..2 * DEPTH` receive replies.
struct Client {
    reg: ContextRegistration<CliCtx>,
    qp: Arc<Qp>,
    mr: Arc<Mr>,
    conn: u64,
    left: u64,
    rng: u64,
    model: HashMap<u64, u64>,
    slots: [Slot; DEPTH as usize],
    tally: Arc<Tally>,
}

impl Client {
    /// Sends slot `s`'s next request: a GET or a PUT of one of this
    /// connection's keys (or, for the first DEPTH, a GET of a key nobody
    /// writes).
    fn issue(&mut self, s: u64) {
        if self.left == 0 {
            return;
        }
        self.left -= 1;
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let key = self.conn + CONNS * (self.rng % KEYS);
        let (op, value) = if self.rng >> 63 == 1 {
            (PUT, self.rng >> 1)
        } else {
            (GET, 0)
        };
        let expect = if op == PUT {
            value
        } else {
            self.model.get(&key).copied().unwrap_or(0)
        };
        if op == PUT {
            self.model.insert(key, value);
        }
        self.post(s, op, key, value, expect);
    }

    fn post(&mut self, s: u64, op: u64, key: u64, value: u64, expect: u64) {
        self.slots[s as usize] = Slot {
            key,
            expect,
            sent: false,
            replied: false,
        };
        let sge = [self.mr.sge(s * MSG, MSG as u32)];
        let written = self.mr.write(s * MSG, &encode(op, s, key, value));
        let sent = written.is_ok()
            && (self.reg)
                .post_send(
                    &*self.qp,
                    &mut [SendWr::new(0, WrOp::Send, &sge)],
                    [CliCtx::Request(s)],
                )
                .is_ok();
        if !sent {
            self.tally.failed.fetch_add(1, Relaxed);
        }
    }

    /// Both completions of slot `s` are in: its buffer is free again.
    fn settle(&mut self, s: u64) {
        let slot = self.slots[s as usize];
        if slot.sent && slot.replied {
            self.issue(s);
        }
    }
}

impl ContextHandler for Client {
    type Ctx = CliCtx;
    fn on_send(&mut self, _: &SendDone<'_>, ctx: CliCtx, _: &mut Outbox<'_, NoWork>) {
        if let CliCtx::Request(s) = ctx {
            self.slots[s as usize].sent = true;
            self.settle(s);
        }
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, ctx: CliCtx, _: &mut Outbox<'_, NoWork>) {
        let CliCtx::Reply(r) = ctx else { return };
        let reply = decode(&self.mr, (DEPTH + r) * MSG);
        let buf = [self.mr.sge((DEPTH + r) * MSG, MSG as u32)];
        let _ = self
            .reg
            .post_recv(&*self.qp, &mut [RecvWr::new(0, &buf)], [CliCtx::Reply(r)]);
        let Some((_, s, key, value)) = reply else {
            self.tally.wrong.fetch_add(1, Relaxed);
            return;
        };
        let slot = self.slots[s as usize];
        if slot.replied || key != slot.key || value != slot.expect {
            self.tally.wrong.fetch_add(1, Relaxed);
        }
        self.tally.replies.fetch_add(1, Relaxed);
        self.slots[s as usize].replied = true;
        self.settle(s);
    }
    fn on_error(&mut self, f: &Failed<'_>, _: CliCtx, _: &mut Outbox<'_, NoWork>) {
        if !f.is_flush() {
            self.tally.failed.fetch_add(1, Relaxed);
        }
    }
    fn on_silent(&mut self, _: &Silent, _: CliCtx, _: &mut Outbox<'_, NoWork>) {}
    fn on_abandoned(&mut self, _: CliCtx) {
        self.tally.failed.fetch_add(1, Relaxed);
    }
}

// ------------------------------------------------------------------ main

/// What a run ended with.
struct Outcome {
    /// The data and the accounts checked out.
    right: bool,
    /// What the stop's verdict found.
    findings: Vec<FindingKind>,
}

/// One run: serves `per_conn` requests on each connection (or until
/// `deadline`), stops, prints the report and the verdicts.
fn run(mistake: Mistake, per_conn: u64, deadline: Duration) -> Result<Outcome, Box<dyn Error>> {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/kv_server.toml");
    let mut topology = TopologyConfig::from_file(file)?.validate()?;
    let (pool, mut feeds) =
        topology
            .take_pool("kv")
            .ok_or("no pool kv")?
            .spawn_feeds(|_worker| {
                let mut shard = HashMap::new();
                move |job: Job| job.run(&mut shard)
            })?;
    let (server, client) = (
        topology.take_poller("server"),
        topology.take_poller("client"),
    );
    let (server, client) = server
        .zip(client)
        .ok_or("the topology needs pollers server and client")?;

    let dev = Device::open("kv0");
    let cqe = if mistake == Mistake::Oversubscribe {
        64
    } else {
        256
    };
    // MISTAKE (unassigned-cq): code and topology file disagree on the CQ's name.
    let name = if mistake == Mistake::UnassignedCq {
        "kv-srv"
    } else {
        "kv-server"
    };
    let (scq, s_unbound, s_handle) =
        dev.create_dispatched_cq(name, cqe, CqConfig::default(), server.cq_options())?;
    let (ccq, c_unbound, c_handle) =
        dev.create_dispatched_cq("kv-client", 256, CqConfig::default(), client.cq_options())?;
    let server = server.poller_builder_fed(&mut feeds)?.cq(s_unbound);
    let client = client.poller_builder(NoSink).cq(c_unbound);
    let pollers = [server.spawn()?, client.spawn()?];

    let pd = dev.alloc_pd();
    let tally = Arc::new(Tally::default());
    let mut qps = Vec::new();
    for conn in 0..CONNS {
        let cap = |send| QpCap {
            max_send_wr: send,
            max_recv_wr: DEPTH as u32,
            ..QpCap::default()
        };
        let sqp = Arc::new(pd.create_qp(&QpInit::new(&scq, &scq, cap(2 * DEPTH as u32)))?);
        let cqp = Arc::new(pd.create_qp(&QpInit::new(&ccq, &ccq, cap(DEPTH as u32)))?);
        connect(&sqp, &cqp)?;
        // SEND and RECV only: no peer reads or writes these (least
        // privilege; docs/verbs.md, "Access: what a peer can reach").
        let smr = Arc::new(pd.reg_mr(3 * DEPTH * MSG, Access::LOCAL_WRITE)?);
        let cmr = Arc::new(pd.reg_mr(2 * DEPTH * MSG, Access::LOCAL_WRITE)?);
        let srv = s_handle.register_contexts_with(3 * DEPTH as u32, |reg| {
            let free = ArrayQueue::new(2 * DEPTH as usize);
            (0..2 * DEPTH).for_each(|b| free.push(b).unwrap_or(()));
            let (qp, raw_posted) = (Arc::clone(&sqp), AtomicBool::new(false));
            Server(Arc::new(SrvConn {
                reg: reg.clone(),
                qp,
                mr: Arc::clone(&smr),
                free,
                mistake,
                raw_posted,
            }))
        })?;
        let cli = c_handle.register_contexts_with(2 * DEPTH as u32, |reg| Client {
            reg: reg.clone(),
            qp: Arc::clone(&cqp),
            mr: Arc::clone(&cmr),
            conn,
            left: per_conn - DEPTH,
            rng: 0x9e37_79b9_7f4a_7c15 ^ conn,
            model: HashMap::new(),
            slots: std::array::from_fn(|s| Slot {
                key: u64::MAX - s as u64,
                ..Slot::default()
            }),
            tally: Arc::clone(&tally),
        })?;
        for r in 0..DEPTH {
            let (sb, cb) = (
                [smr.sge(r * MSG, MSG as u32)],
                [cmr.sge((DEPTH + r) * MSG, MSG as u32)],
            );
            srv.post_recv(&*sqp, &mut [RecvWr::new(0, &sb)], [SrvCtx::Recv(r)])?;
            cli.post_recv(&*cqp, &mut [RecvWr::new(0, &cb)], [CliCtx::Reply(r)])?;
        }
        // The first DEPTH requests: GETs of keys nobody writes (0 expected);
        // every later one is sent from the client's callbacks.
        for s in 0..DEPTH {
            cmr.write(s * MSG, &encode(GET, s, u64::MAX - s, 0))?;
            let sge = [cmr.sge(s * MSG, MSG as u32)];
            cli.post_send(
                &*cqp,
                &mut [SendWr::new(0, WrOp::Send, &sge)],
                [CliCtx::Request(s)],
            )?;
        }
        qps.extend([sqp, cqp]);
    }

    let total = CONNS * per_conn;
    let started = Instant::now();
    while tally.replies.load(Relaxed) < total && started.elapsed() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let secs = started.elapsed().as_secs_f64();
    let report = shutdown(|| qps.iter().for_each(|q| q.force_error()), pollers, [pool]);
    println!("{report}");
    let (replies, wrong, failed) = (
        tally.replies.load(Relaxed),
        tally.wrong.load(Relaxed),
        tally.failed.load(Relaxed),
    );
    let data_ok = replies == total && wrong == 0 && failed == 0;
    println!(
        "verdict data: {} — {replies} of {total} replies in {secs:.2} s ({:.0}/s), {wrong} wrong, {failed} failed",
        if data_ok { "PASSED" } else { "FAILED" },
        replies as f64 / secs
    );
    let findings = report.findings().into_iter().map(|f| f.kind).collect();
    Ok(Outcome {
        right: data_ok && report.is_clean(),
        findings,
    })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let which = match args.as_slice() {
        [] => vec![Mistake::None],
        [flag, name] if flag == "--mistake" => match name.as_str() {
            "raw-post" => vec![Mistake::RawPost],
            "no-repost" => vec![Mistake::NoRepost],
            "slow-handler" => vec![Mistake::SlowHandler],
            "unassigned-cq" => vec![Mistake::UnassignedCq],
            "oversubscribe" => vec![Mistake::Oversubscribe],
            "all" => vec![
                Mistake::None,
                Mistake::RawPost,
                Mistake::NoRepost,
                Mistake::SlowHandler,
                Mistake::UnassignedCq,
                Mistake::Oversubscribe,
            ],
            _ => return usage(),
        },
        _ => return usage(),
    };
    let mut right = true;
    for mistake in which {
        println!("=== {mistake:?}");
        let (per_conn, deadline) = match mistake {
            Mistake::SlowHandler => (DEPTH * 6, Duration::from_secs(20)),
            Mistake::NoRepost => (DEPTH * 4, Duration::from_secs(2)),
            _ => (20_000, Duration::from_secs(60)),
        };
        let outcome = run(mistake, per_conn, deadline).map_err(|e| e.to_string());
        // Each mistake must end in the verdict that names it.
        let named = match (&outcome, mistake) {
            (Ok(o), Mistake::None) => o.right,
            (Ok(o), Mistake::RawPost) => o.findings.contains(&FindingKind::ForeignWrId),
            (Ok(o), Mistake::NoRepost) => o.findings.contains(&FindingKind::RecvQueueDry),
            (Ok(o), Mistake::SlowHandler) => o.findings.contains(&FindingKind::SlowHandler),
            (Err(e), Mistake::UnassignedCq) => e.contains("\"kv-srv\"") && e.contains("\"server\""),
            (Err(e), Mistake::Oversubscribe) => e.contains("kv-server") && e.contains("needs"),
            _ => false,
        };
        if let Err(e) = &outcome {
            println!("refused: {e}");
        }
        let (yes, no) = match mistake {
            Mistake::None => ("clean, as it should be", "NOT CLEAN"),
            _ => ("named by the verdict, as it should be", "NOT NAMED"),
        };
        println!("{mistake:?}: {}", if named { yes } else { no });
        right &= named;
    }
    if right {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn usage() -> ExitCode {
    eprintln!("usage: kv_server [--mistake raw-post|no-repost|slow-handler|unassigned-cq|oversubscribe|all]");
    ExitCode::from(2)
}
