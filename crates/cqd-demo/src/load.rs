//! The load generator: closed-loop block requests over N connections to
//! one or more servers, with every read checked by the [`Verifier`].
//!
//! Blocks are striped over the servers: global block `g` lives on server
//! `g % S` as its block `g / S`. A connection talks to one server; each of
//! its `depth` request slots owns a request buffer and a data buffer, and
//! issues the next request as soon as its last one finished (the reply and
//! the request's own SEND completion both arrived). Every request first
//! claims its block in the verifier, so at most one request per block is in
//! flight in the whole load generator (see `verify`).
//!
//! The handler of a connection runs on a load poller: it checks replies,
//! verifies read data, records latencies and issues the next request, all
//! without blocking. A connection dies on the first error (a failed or
//! flushed completion, a reply that does not decode or names no request in
//! flight, a request older than the op timeout): its QP goes to error and
//! every request in flight on it is recorded as **failed** at once; later
//! completions for them are ignored.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd_core::{
    CqHandle, CqOptions, Failed, Handler, NoWork, OpKind, Outbox, RecvDone, Registration, SendDone,
    UnboundCq,
};
use hdrhistogram::Histogram;
use parking_lot::Mutex;

use crate::backend::{BackendError, Depths, Exposure, Grant, Link, Node, Op, Region, Verb};
use crate::verify::{ReadOutcome, Verifier};
use crate::wire::{BlockOp, Reply, ReplyStatus, Request, MSG_LEN};

const MSG: u64 = MSG_LEN as u64;

/// What the load generator is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Phase {
    /// Random reads and writes.
    Run = 0,
    /// No new requests; in-flight ones finish.
    Drain = 1,
    /// Reading back every block once.
    Verify = 2,
}

/// Settings of the load.
#[derive(Debug, Clone, Copy)]
pub struct LoadSpec {
    /// Servers (blocks are striped over them).
    pub servers: u32,
    /// Blocks per server.
    pub blocks_per_server: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Requests in flight per connection.
    pub depth: u32,
    /// Percentage of reads (0–100).
    pub read_pct: u32,
    /// Stop issuing after this many requests (0: no limit).
    pub op_limit: u64,
    /// Seed of the block choice and the data patterns.
    pub seed: u64,
    /// Expose each request's buffer through a memory window of its own
    /// where the device has type-2 windows (`--exposure windows`).
    pub windows: bool,
}

/// Counters of the load generator (a snapshot).
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct LoadCounts {
    /// Requests issued in the run phase.
    pub issued: u64,
    /// Requests that completed successfully in the run phase.
    pub completed: u64,
    /// Of those, reads.
    pub reads: u64,
    /// Of those, writes.
    pub writes: u64,
    /// Requests that failed (error reply, failed or flushed transfer, dead
    /// connection, timeout), both phases.
    pub failed: u64,
    /// Replies that did not decode or matched no request.
    pub bad_replies: u64,
    /// Requests that timed out.
    pub timeouts: u64,
    /// Connections that died.
    pub dead_connections: u64,
    /// Blocks read back in the verify phase.
    pub verify_read: u64,
    /// Of those, matching what was written.
    pub verify_matched: u64,
    /// Of those, not matching.
    pub verify_mismatched: u64,
    /// Of those, unknown after a failed write.
    pub verify_unknown: u64,
    /// Read-backs that failed.
    pub verify_failed: u64,
    /// The server reached each request's buffer through a memory window
    /// bound for that request alone (else through the key of the buffer's
    /// own region).
    pub windows: bool,
}

/// State shared by every connection of the load generator.
#[derive(Debug)]
pub struct LoadShared {
    spec: LoadSpec,
    verifier: Arc<Verifier>,
    phase: AtomicU8,
    closing: AtomicBool,
    issued: AtomicU64,
    completed: AtomicU64,
    reads: AtomicU64,
    writes: AtomicU64,
    failed: AtomicU64,
    bad_replies: AtomicU64,
    timeouts: AtomicU64,
    dead: AtomicU64,
    inflight: AtomicI64,
    verify_cursor: Vec<AtomicU64>,
    verify_read: AtomicU64,
    verify_matched: AtomicU64,
    verify_mismatched: AtomicU64,
    verify_unknown: AtomicU64,
    verify_failed: AtomicU64,
    /// Requests expose their buffers through per-request memory windows.
    windows: bool,
}

impl LoadShared {
    fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Acquire) {
            0 => Phase::Run,
            2 => Phase::Verify,
            _ => Phase::Drain,
        }
    }

    /// The counters now.
    pub fn counts(&self) -> LoadCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        LoadCounts {
            issued: l(&self.issued).min(if self.spec.op_limit > 0 {
                self.spec.op_limit
            } else {
                u64::MAX
            }),
            completed: l(&self.completed),
            reads: l(&self.reads),
            writes: l(&self.writes),
            failed: l(&self.failed),
            bad_replies: l(&self.bad_replies),
            timeouts: l(&self.timeouts),
            dead_connections: l(&self.dead),
            verify_read: l(&self.verify_read),
            verify_matched: l(&self.verify_matched),
            verify_mismatched: l(&self.verify_mismatched),
            verify_unknown: l(&self.verify_unknown),
            verify_failed: l(&self.verify_failed),
            windows: self.windows,
        }
    }

    /// Requests in flight now.
    pub fn inflight(&self) -> i64 {
        self.inflight.load(Ordering::Acquire)
    }

    /// The verifier.
    pub fn verifier(&self) -> &Verifier {
        &self.verifier
    }
}

#[derive(Debug, Clone, Copy)]
struct InFlight {
    op: BlockOp,
    global: u64,
    version: u64,
    sum: u64,
    id: u64,
    started: Instant,
    verify: bool,
}

#[derive(Debug)]
struct Slot {
    op: Option<InFlight>,
    sent: bool,
    reply: Option<ReplyStatus>,
    rng: u64,
    next_id: u64,
    scratch: Vec<u8>,
}

/// The load generator's side of one connection.
#[derive(Debug)]
pub struct LoadConn<N: Node> {
    name: String,
    server: u32,
    link: N::Link,
    reg: Registration,
    /// Requests `[0, depth)`, reply receives `[depth, 2 depth)` (64 bytes
    /// each): local access only (SENDs and receives need no more).
    region: N::Region,
    /// One data buffer per slot, each a region of its own: the narrowest
    /// a key can name (with windows, rxe's window then reaches exactly
    /// its buffer too: it checks ranges against the region).
    data: Vec<N::Region>,
    depth: u32,
    block_size: u32,
    slots: Vec<Mutex<Slot>>,
    dead: AtomicBool,
    /// Closing ([`Load::close`]): issues nothing more, and its flushes
    /// are its end, not a failure.
    retiring: AtomicBool,
    /// The load CQ it is on.
    cq: usize,
    shared: Arc<LoadShared>,
    hist: Mutex<Histogram<u64>>,
    latency: crate::prom::Latency,
}

thread_local! {
    /// A load poller's buffer for the data of a finished read.
    static READ_BACK: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A load QP's send queue: a request's SEND, and with windows its bind and
/// invalidate too.
fn send_depth(depth: u32, windows: bool) -> u32 {
    if windows {
        depth.saturating_mul(3)
    } else {
        depth
    }
}

fn next(rng: &mut u64) -> u64 {
    *rng ^= *rng << 13;
    *rng ^= *rng >> 7;
    *rng ^= *rng << 17;
    *rng
}

impl<N: Node> LoadConn<N> {
    /// The link (to connect it).
    pub fn link(&self) -> &N::Link {
        &self.link
    }

    /// The connection's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The server (index) the connection talks to.
    pub fn server(&self) -> u32 {
        self.server
    }

    /// The connection's handler registration (for the report).
    pub fn registration(&self) -> &Registration {
        &self.reg
    }

    /// Slot `slot`'s data buffer.
    fn data(&self, slot: u32) -> Result<&N::Region, BackendError> {
        self.data.get(slot as usize).ok_or_else(|| {
            BackendError::new(
                format!("slot {slot}'s data buffer"),
                format!("the connection has {} slots", self.data.len()),
            )
        })
    }

    /// Posts every reply receive (after `connect`).
    ///
    /// # Errors
    /// A refused post.
    pub fn post_receives(&self) -> Result<(), BackendError> {
        let reg = &self.reg;
        for i in 0..self.depth {
            let at = u64::from(self.depth + i) * MSG;
            self.link
                .post_recv(reg, i, &self.region, at, MSG_LEN as u32)?;
        }
        Ok(())
    }

    /// Whether the connection died.
    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// The load CQ it is on.
    pub fn cq(&self) -> usize {
        self.cq
    }

    /// True when no request is in flight on it.
    fn is_idle(&self) -> bool {
        self.slots.iter().all(|s| s.lock().op.is_none())
    }

    /// Issues a request on every idle slot.
    pub fn kick(&self) {
        for slot in 0..self.depth {
            self.issue(slot);
        }
    }

    /// Issues the next request on `slot` if the phase wants one; false if
    /// nothing was issued.
    fn issue(&self, slot: u32) -> bool {
        let sh = &*self.shared;
        let v = &*sh.verifier;
        let spec = &sh.spec;
        let mut s = self.slots[slot as usize].lock();
        if s.op.is_some() || self.is_dead() || self.retiring.load(Ordering::Acquire) {
            return false;
        }
        let phase = sh.phase();
        let (op, local, verify) = match phase {
            Phase::Run => {
                if spec.op_limit > 0 && sh.issued.fetch_add(1, Ordering::Relaxed) >= spec.op_limit {
                    return false;
                }
                if spec.op_limit == 0 {
                    sh.issued.fetch_add(1, Ordering::Relaxed);
                }
                let r = next(&mut s.rng);
                let op = if (r % 100) < u64::from(spec.read_pct) {
                    BlockOp::Read
                } else {
                    BlockOp::Write
                };
                // Probe from a random block for one nobody has in flight;
                // there are more blocks than requests in flight (checked by
                // the config), so one is free.
                let start = (r >> 8) % spec.blocks_per_server;
                let found = (0..spec.blocks_per_server)
                    .map(|i| (start + i) % spec.blocks_per_server)
                    .find(|&b| v.claim(b * u64::from(spec.servers) + u64::from(self.server)));
                match found {
                    Some(b) => (op, b, false),
                    None => {
                        // Not issued after all: give the count back.
                        sh.issued.fetch_sub(1, Ordering::Relaxed);
                        return false;
                    }
                }
            }
            Phase::Verify => {
                let local = sh.verify_cursor[self.server as usize].fetch_add(1, Ordering::Relaxed);
                if local >= spec.blocks_per_server {
                    return false;
                }
                if !v.claim(local * u64::from(spec.servers) + u64::from(self.server)) {
                    // Nothing else runs now: a claimed block is a bug; say so.
                    tracing::error!(conn = %self.name, block = local, "block still claimed in the verify phase");
                    sh.verify_failed.fetch_add(1, Ordering::Relaxed);
                    return false;
                }
                (BlockOp::Read, local, true)
            }
            Phase::Drain => return false,
        };
        let global = local * u64::from(spec.servers) + u64::from(self.server);
        let data = match self.data(slot) {
            Ok(d) => d,
            Err(e) => {
                drop(s);
                self.kill(&e.to_string());
                return false;
            }
        };
        let (version, sum) = match op {
            BlockOp::Write => {
                let mut scratch = std::mem::take(&mut s.scratch);
                let vs = v.prepare_write(global, &mut scratch);
                let wrote = data.write(0, &scratch);
                s.scratch = scratch;
                if let Err(e) = wrote {
                    v.finish_write(global, vs.0, vs.1, false);
                    drop(s);
                    self.kill(&e.to_string());
                    return false;
                }
                vs
            }
            BlockOp::Read => {
                // Poison the buffer first: a read whose data never arrives
                // must not match what an earlier request left there (zeros,
                // or this slot's last write of the same block). The poison
                // names version u64::MAX, which no write ever has.
                let mut scratch = std::mem::take(&mut s.scratch);
                scratch.resize(self.block_size as usize, 0);
                v.poison(global, &mut scratch);
                let wrote = data.write(0, &scratch);
                s.scratch = scratch;
                if let Err(e) = wrote {
                    drop(s);
                    self.kill(&e.to_string());
                    return false;
                }
                (0, 0)
            }
        };
        s.next_id += 1;
        let id = (u64::from(slot) << 48) | s.next_id;
        let windows = self.shared.windows;
        let remote = if windows {
            self.link.window_remote(slot, data, 0)
        } else {
            Some(data.remote(0))
        };
        let req = Request {
            op,
            slot: slot as u16,
            id,
            block: local,
            len: self.block_size,
            remote: remote.unwrap_or_default(),
        };
        let req_off = u64::from(slot) * MSG;
        let flight = InFlight {
            op,
            global,
            version,
            sum,
            id,
            started: Instant::now(),
            verify,
        };
        s.op = Some(flight);
        s.sent = false;
        s.reply = None;
        sh.inflight.fetch_add(1, Ordering::AcqRel);
        let posted = match remote {
            Some(_) => self.region.write(req_off, &req.encode()),
            // Failed like a refused post: the request is counted failed.
            None => Err(BackendError::new(
                format!("slot {slot}"),
                "no memory window for it",
            )),
        }
        .and_then(|()| {
            let send = Op {
                tag: slot,
                verb: Verb::Send,
                region: &self.region,
                offset: req_off,
                len: MSG_LEN as u32,
                signaled: true,
            };
            if !windows {
                return self.link.post_send(&self.reg, &[send]);
            }
            // The window over this request's buffer alone, with what the
            // server must do there, bound before the SEND that names it
            // (a QP runs its requests in order).
            let grant = match op {
                BlockOp::Read => Grant::Write,
                BlockOp::Write => Grant::Read,
            };
            let bind = Op {
                tag: slot,
                verb: Verb::Bind { slot, grant },
                region: data,
                offset: 0,
                len: self.block_size,
                signaled: true,
            };
            self.link.post_send(&self.reg, &[bind, send])
        });
        if let Err(e) = posted {
            let flight = s.op.take();
            drop(s);
            if let Some(f) = flight {
                self.fail(f);
            }
            self.kill(&e.to_string());
            return false;
        }
        true
    }

    /// Records a failed request and releases its block.
    fn fail(&self, f: InFlight) {
        let sh = &*self.shared;
        match f.op {
            BlockOp::Write => sh.verifier.finish_write(f.global, f.version, f.sum, false),
            BlockOp::Read => {
                sh.verifier.finish_read(f.global, None);
            }
        }
        sh.failed.fetch_add(1, Ordering::Relaxed);
        if f.verify {
            sh.verify_failed.fetch_add(1, Ordering::Relaxed);
        }
        sh.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    /// A request finished with `status`: check it, count it, go on.
    fn finish(&self, slot: u32, f: InFlight, status: ReplyStatus) {
        let sh = &*self.shared;
        // Throughout: the next request is issued before this one leaves
        // the in-flight count, so the count never reads 0 while the slot
        // goes on (the read-back's end is "nothing in flight").
        if status != ReplyStatus::Ok {
            tracing::warn!(conn = %self.name, ?status, op = ?f.op, "request refused by the server");
            self.issue(slot);
            self.fail(f);
            return;
        }
        match f.op {
            BlockOp::Write => sh.verifier.finish_write(f.global, f.version, f.sum, true),
            BlockOp::Read => {
                // The data is copied out of the buffer to be checked (the
                // next request of the slot reuses the buffer), into this
                // thread's scratch rather than a fresh allocation per read.
                let outcome = READ_BACK.with(|cell| {
                    let mut data = cell.take();
                    data.resize(self.block_size as usize, 0);
                    let outcome = match self.data(slot).and_then(|d| d.read(0, &mut data)) {
                        Ok(()) => sh.verifier.finish_read(f.global, Some(&data)),
                        Err(e) => {
                            tracing::error!(conn = %self.name, "read back the data buffer: {e}");
                            sh.verifier.finish_read(f.global, None)
                        }
                    };
                    cell.set(data);
                    outcome
                });
                if f.verify {
                    sh.verify_read.fetch_add(1, Ordering::Relaxed);
                    let c = match outcome {
                        ReadOutcome::Matched => &sh.verify_matched,
                        ReadOutcome::Mismatch(_) => &sh.verify_mismatched,
                        ReadOutcome::Unverifiable => &sh.verify_unknown,
                        ReadOutcome::Failed => &sh.verify_failed,
                    };
                    c.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if !f.verify {
            let elapsed = f.started.elapsed();
            let ns = elapsed.as_nanos().min(u128::from(u64::MAX)) as u64;
            self.hist.lock().saturating_record(ns.max(1));
            self.latency.record(f.op == BlockOp::Read, elapsed);
            sh.completed.fetch_add(1, Ordering::Relaxed);
            let c = match f.op {
                BlockOp::Read => &sh.reads,
                BlockOp::Write => &sh.writes,
            };
            c.fetch_add(1, Ordering::Relaxed);
        }
        self.issue(slot);
        sh.inflight.fetch_sub(1, Ordering::AcqRel);
    }

    /// Kills the connection: QP to error, every request in flight failed.
    pub fn kill(&self, why: &str) {
        if self.dead.swap(true, Ordering::AcqRel) {
            return;
        }
        self.shared.dead.fetch_add(1, Ordering::Relaxed);
        if !self.shared.closing.load(Ordering::Acquire) {
            tracing::warn!(conn = %self.name, "connection failed: {why}");
        }
        self.link.to_error();
        for slot in &self.slots {
            let f = slot.lock().op.take();
            if let Some(f) = f {
                self.fail(f);
            }
        }
    }

    /// Kills the connection if a request has waited longer than `limit`.
    pub fn check_timeouts(&self, limit: Duration) {
        let now = Instant::now();
        let late = self.slots.iter().any(|s| {
            s.lock()
                .op
                .is_some_and(|f| now.saturating_duration_since(f.started) > limit)
        });
        if late && !self.is_dead() {
            self.shared.timeouts.fetch_add(1, Ordering::Relaxed);
            self.kill(&format!(
                "a request waited more than {limit:?} for its reply"
            ));
        }
    }

    /// Marks the slot's SEND or reply done; finishes the request when both
    /// are.
    /// What slot `slot` holds, for the message of a reply that matched
    /// nothing.
    fn slot_state(&self, slot: u32) -> String {
        let Some(cell) = self.slots.get(slot as usize) else {
            return format!("this connection has no slot {slot}");
        };
        let s = cell.lock();
        let last = (u64::from(slot) << 48) | s.next_id;
        match &s.op {
            None => format!("the slot is idle, its last request id {last:#x}"),
            Some(f) => format!(
                "the slot holds id {:#x}, {}, {}",
                f.id,
                if s.sent {
                    "sent"
                } else {
                    "its send not completed"
                },
                if s.reply.is_some() {
                    "replied"
                } else {
                    "no reply yet"
                }
            ),
        }
    }

    fn progress(&self, slot: u32, id: Option<u64>, reply: Option<ReplyStatus>) -> bool {
        let Some(cell) = self.slots.get(slot as usize) else {
            return false;
        };
        let mut s = cell.lock();
        let Some(f) = s.op else {
            return false;
        };
        if let Some(id) = id {
            if f.id != id {
                return false;
            }
        }
        match reply {
            Some(status) => s.reply = Some(status),
            None => s.sent = true,
        }
        if let (true, Some(status)) = (s.sent, s.reply) {
            s.op = None;
            drop(s);
            if self.shared.windows {
                // The server is done with the buffer: its window closes
                // before the slot's next bind (posted after this, on the
                // same queue).
                let invalidate = Op {
                    tag: slot,
                    verb: Verb::Invalidate { slot },
                    region: &self.region,
                    offset: 0,
                    len: 0,
                    signaled: true,
                };
                if let Err(e) = self.link.post_send(&self.reg, &[invalidate]) {
                    self.kill(&e.to_string());
                }
            }
            self.finish(slot, f, status);
        }
        true
    }
}

/// The handler of one load connection.
#[derive(Debug)]
pub struct LoadHandler<N: Node> {
    conn: Arc<LoadConn<N>>,
}

impl<N: Node> Handler for LoadHandler<N> {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        if d.kind() == OpKind::Send {
            // A SEND of a request that already failed is not an error.
            self.conn.progress(d.tag(), None, None);
        }
    }

    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let c = &self.conn;
        let i = d.tag();
        if i >= c.depth {
            c.kill(&format!("a receive completed with unknown tag {i}"));
            return;
        }
        let at = u64::from(c.depth + i) * MSG;
        let mut buf = [0u8; MSG_LEN];
        let len = (d.byte_len() as usize).min(MSG_LEN);
        if let Err(e) = c.region.read(at, &mut buf[..len]) {
            c.kill(&e.to_string());
            return;
        }
        if let Err(e) = c.link.post_recv(&c.reg, i, &c.region, at, MSG_LEN as u32) {
            c.kill(&e.to_string());
            return;
        }
        let reply = if d.byte_len() as usize > MSG_LEN {
            Err(crate::wire::WireError::Length {
                len: d.byte_len() as usize,
            })
        } else {
            Reply::decode(&buf[..len])
        };
        match reply {
            Ok(r) => {
                if !c.progress(u32::from(r.slot), Some(r.id), Some(r.status)) && !c.is_dead() {
                    c.shared.bad_replies.fetch_add(1, Ordering::Relaxed);
                    c.kill(&format!(
                        "a reply for slot {} id {:#x} that matches no request in flight ({}; \
                         receive {i}, {} bytes)",
                        r.slot,
                        r.id,
                        c.slot_state(u32::from(r.slot)),
                        d.byte_len()
                    ));
                }
            }
            Err(e) => {
                c.shared.bad_replies.fetch_add(1, Ordering::Relaxed);
                c.kill(&format!("malformed reply: {e}"));
            }
        }
    }

    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        let c = &self.conn;
        if f.is_flush()
            && (c.is_dead()
                || c.retiring.load(Ordering::Acquire)
                || c.shared.closing.load(Ordering::Acquire))
        {
            return;
        }
        c.kill(&format!(
            "{} completed with {:?}",
            f.kind().name(),
            f.status()
        ));
    }
}

/// The load generator: its node, CQs and connections.
#[derive(Debug)]
pub struct Load<N: Node> {
    node: N,
    cqs: Vec<N::Cq>,
    unbound: Vec<Option<UnboundCq<NoWork>>>,
    handles: Vec<CqHandle<NoWork>>,
    conns: Vec<Arc<LoadConn<N>>>,
    /// Connections made so far, closed ones included (names stay unique).
    made: usize,
    /// The latencies of the connections closed so far.
    closed_hist: Option<Histogram<u64>>,
    shared: Arc<LoadShared>,
}

impl<N: Node> Load<N> {
    /// A load generator on `node` with one CQ per name, each sized for
    /// `conns_per_cq` connections.
    ///
    /// # Errors
    /// A CQ too large for the device, or the device refused.
    pub fn new(
        node: N,
        cqs: &[(String, CqOptions)],
        conns_per_cq: u32,
        spec: LoadSpec,
    ) -> Result<Load<N>, crate::DemoError> {
        // With windows, each request takes three send-queue entries: the
        // bind, the request's SEND and, at its reply, the invalidate.
        let windows = spec.windows && node.has_windows();
        let send_depth = send_depth(spec.depth, windows);
        if send_depth > node.max_qp_wr() {
            return Err(crate::DemoError::Config(format!(
                "queue depth {} needs send queues of {send_depth}, deeper than the device's ({}): lower --qd",
                spec.depth,
                node.max_qp_wr()
            )));
        }
        let all: Vec<u32> = (0..conns_per_cq)
            .flat_map(|_| [send_depth, spec.depth])
            .collect();
        let depth = cqd_core::cq_depth_for(&all, 2, node.max_cqe()).map_err(|needed| {
            crate::DemoError::Config(format!(
                "a load CQ needs {needed} entries for {conns_per_cq} connections at queue depth {}, \
                 the device makes at most {}: lower --connections or --qd, or add load CQs to the topology",
                spec.depth,
                node.max_cqe()
            ))
        })?;
        let mut made = Vec::new();
        let mut unbound = Vec::new();
        let mut handles = Vec::new();
        for (name, options) in cqs {
            let (cq, u, h) = node.create_cq::<NoWork>(name, depth, options.clone())?;
            made.push(cq);
            unbound.push(Some(u));
            handles.push(h);
        }
        let verifier = Arc::new(Verifier::new(
            spec.blocks_per_server * u64::from(spec.servers),
            spec.block_size as usize,
            spec.seed,
        ));
        let shared = Arc::new(LoadShared {
            spec,
            verifier,
            phase: AtomicU8::new(Phase::Drain as u8),
            closing: AtomicBool::new(false),
            issued: AtomicU64::new(0),
            completed: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            bad_replies: AtomicU64::new(0),
            timeouts: AtomicU64::new(0),
            dead: AtomicU64::new(0),
            inflight: AtomicI64::new(0),
            verify_cursor: (0..spec.servers).map(|_| AtomicU64::new(0)).collect(),
            verify_read: AtomicU64::new(0),
            verify_matched: AtomicU64::new(0),
            verify_mismatched: AtomicU64::new(0),
            verify_unknown: AtomicU64::new(0),
            verify_failed: AtomicU64::new(0),
            windows,
        });
        Ok(Load {
            node,
            cqs: made,
            unbound,
            handles,
            conns: Vec::new(),
            made: 0,
            closed_hist: None,
            shared,
        })
    }

    /// The CQs' handles, `load0` … (for the metrics exporter).
    pub fn cq_handles(&self) -> &[CqHandle<NoWork>] {
        &self.handles
    }

    /// The polling right of load CQ `i`, for its poller (once).
    pub fn take_cq(&mut self, i: usize) -> Option<UnboundCq<NoWork>> {
        self.unbound.get_mut(i)?.take()
    }

    /// A new connection to server `server`, on load CQ `cq` (connect its
    /// link, then [`LoadConn::post_receives`]).
    ///
    /// # Errors
    /// The device refused, or the handler could not be registered.
    pub fn connect(
        &mut self,
        server: u32,
        cq: usize,
    ) -> Result<Arc<LoadConn<N>>, crate::DemoError> {
        let spec = self.shared.spec;
        let depth = spec.depth;
        let cq_ref = self
            .cqs
            .get(cq)
            .ok_or_else(|| crate::DemoError::Setup(format!("no load CQ {cq}")))?;
        // The server writes read blocks into the load's buffers and reads
        // written ones from them: through a window per request where the
        // device has them, else with the region's key.
        let windows = self.shared.windows;
        let exposure = if windows {
            Exposure::Windows
        } else {
            Exposure::Peer
        };
        let link = self.node.create_link(
            cq_ref,
            Depths {
                send: send_depth(depth, windows),
                recv: depth,
            },
            exposure,
        )?;
        if windows {
            link.open_windows(depth)?;
        }
        let region = self
            .node
            .reg_region(2 * u64::from(depth) * MSG, Exposure::Local)?;
        let data = (0..depth)
            .map(|_| self.node.reg_region(u64::from(spec.block_size), exposure))
            .collect::<Result<Vec<_>, _>>()?;
        let index = self.made;
        let hist = Histogram::new_with_bounds(1, 3_600_000_000_000, 3)
            .map_err(|e| crate::DemoError::Setup(format!("histogram: {e}")))?;
        let name = format!("load/c{index}->srv{server}");
        let shared = Arc::clone(&self.shared);
        let mut made = None;
        self.handles[cq]
            .register_with(|reg| {
                let conn = Arc::new(LoadConn {
                    name: name.clone(),
                    server,
                    link,
                    reg: reg.clone(),
                    region,
                    data,
                    depth,
                    block_size: spec.block_size,
                    slots: (0..depth)
                        .map(|s| {
                            let mut rng = spec.seed
                                ^ ((index as u64) << 32 | u64::from(s))
                                ^ 0x2545_f491_4f6c_dd1d;
                            if rng == 0 {
                                rng = 1;
                            }
                            next(&mut rng);
                            Mutex::new(Slot {
                                op: None,
                                sent: false,
                                reply: None,
                                rng,
                                next_id: 0,
                                scratch: vec![0u8; spec.block_size as usize],
                            })
                        })
                        .collect(),
                    dead: AtomicBool::new(false),
                    retiring: AtomicBool::new(false),
                    cq,
                    shared,
                    hist: Mutex::new(hist),
                    latency: crate::prom::Latency::new(),
                });
                made = Some(Arc::clone(&conn));
                LoadHandler { conn }
            })
            .map_err(|e| crate::DemoError::Setup(format!("{name}: register: {e}")))?;
        let conn = made.ok_or_else(|| crate::DemoError::Setup(format!("{name}: not made")))?;
        self.made += 1;
        self.conns.push(Arc::clone(&conn));
        Ok(conn)
    }

    /// Closes a connection while the others run, as a client that is done
    /// with it: it takes no new request, the requests in flight finish
    /// (their replies come), then its QP goes to error, its handler is
    /// retired and its QP closed ([`Link::close`]: its admission on its
    /// load CQ comes back). Waits at most `timeout`; its requests still in
    /// flight then fail. `conn` must be the caller's only hold on it
    /// besides the load's.
    ///
    /// # Errors
    /// What did not end within `timeout`, naming the connection.
    pub fn close(&mut self, conn: Arc<LoadConn<N>>, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let name = conn.name.clone();
        conn.retiring.store(true, Ordering::Release);
        while !conn.is_idle() {
            if left().is_zero() {
                conn.kill("its requests were not answered before its close's deadline");
                return Err(format!(
                    "{name}: requests still in flight {timeout:?} after its close began"
                ));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
        self.conns.retain(|c| !Arc::ptr_eq(c, &conn));
        conn.link.to_error();
        let cq = &self.handles[conn.cq];
        let retired = cq
            .unregister(conn.reg.key())
            .map_err(|e| format!("{name}: unregister: {e}"))?;
        retired.wait(left()).map_err(|e| format!("{name}: {e}"))?;
        let conn = Arc::try_unwrap(conn).map_err(|_| format!("{name}: still held"))?;
        let hist = conn.hist.into_inner();
        match &mut self.closed_hist {
            Some(all) => {
                if all.add(&hist).is_err() {
                    tracing::warn!(conn = %name, "latency histogram out of range");
                }
            }
            None => self.closed_hist = Some(hist),
        }
        conn.link.close(left()).map_err(|e| e.to_string())
    }

    /// The shared state and counters.
    pub fn shared(&self) -> &Arc<LoadShared> {
        &self.shared
    }

    /// The connections.
    pub fn conns(&self) -> &[Arc<LoadConn<N>>] {
        &self.conns
    }

    /// Enters `phase` and, for the run and verify phases, fills every slot.
    pub fn enter(&self, phase: Phase) {
        self.shared.phase.store(phase as u8, Ordering::Release);
        if phase != Phase::Drain {
            for c in &self.conns {
                c.kick();
            }
        }
    }

    /// True when every connection is dead.
    pub fn all_dead(&self) -> bool {
        self.conns.iter().all(|c| c.is_dead())
    }

    /// Kills connections with requests older than `limit`.
    pub fn check_timeouts(&self, limit: Duration) {
        for c in &self.conns {
            c.check_timeouts(limit);
        }
    }

    /// True when the read-back is over: nothing in flight, and every
    /// server's blocks were all issued or its connections are all dead.
    pub fn verify_done(&self) -> bool {
        let sh = &self.shared;
        sh.inflight() == 0
            && (0..sh.spec.servers).all(|s| {
                sh.verify_cursor[s as usize].load(Ordering::Acquire) >= sh.spec.blocks_per_server
                    || self
                        .conns
                        .iter()
                        .filter(|c| c.server == s)
                        .all(|c| c.is_dead())
            })
    }

    /// Waits until nothing is in flight; on `timeout`, kills every
    /// connection (their requests fail) and returns false.
    pub fn wait_idle(&self, timeout: Duration, tick: &mut dyn FnMut()) -> bool {
        self.wait_until(timeout, tick, &|| self.shared.inflight() == 0)
    }

    /// Waits until `done`; on `timeout`, kills every connection (their
    /// requests fail) and returns false.
    pub fn wait_until(
        &self,
        timeout: Duration,
        tick: &mut dyn FnMut(),
        done: &dyn Fn() -> bool,
    ) -> bool {
        let deadline = Instant::now() + timeout;
        while !done() {
            if Instant::now() >= deadline {
                for c in &self.conns {
                    c.kill("still waiting for replies at the drain deadline");
                }
                return false;
            }
            tick();
            std::thread::sleep(Duration::from_millis(1));
        }
        true
    }

    /// The run is over (no request will be issued): from now on a flush
    /// is the teardown's, not a failure — also one the peer caused (with
    /// `--cm rdmacm` a server's exit disconnects its connections, which
    /// flushes this side's receives before its own flush).
    pub fn closing(&self) {
        self.shared.closing.store(true, Ordering::Release);
    }

    /// The shutdown's flush step: every QP to error.
    pub fn flush(&self) {
        self.shared.closing.store(true, Ordering::Release);
        for c in &self.conns {
            c.dead.store(true, Ordering::Release);
            c.link.to_error();
        }
    }

    /// Every connection's latencies, closed ones included, merged
    /// (nanoseconds); `None` without connections.
    pub fn latencies(&self) -> Option<Histogram<u64>> {
        let mut all = match &self.closed_hist {
            Some(h) => h.clone(),
            None => self.conns.first()?.hist.lock().clone(),
        };
        let skip = usize::from(self.closed_hist.is_none());
        for c in self.conns.iter().skip(skip) {
            // Same bounds everywhere: adding cannot fail; saturate anyway.
            if all.add(&*c.hist.lock()).is_err() {
                tracing::warn!(conn = %c.name, "latency histogram out of range");
            }
        }
        Some(all)
    }
}
