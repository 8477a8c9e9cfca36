//! The block server: an in-memory block device exported over RC QPs.
//!
//! One CQ per server takes the send and the receive completions of all its
//! connections (on purpose: one poller sees a connection's whole life).
//! Per connection, one handler ([`SrvHandler`]) runs on the poller thread:
//!
//! 1. A request's receive completes: the handler copies the 64 bytes out,
//!    reposts the receive at once, decodes the request and hands it to the
//!    worker pool keyed by block (requests on one block are served in
//!    order, by one worker).
//! 2. The worker moves the data with one-sided RDMA between the device
//!    region and the client's buffer named in the request:
//!    - read: RDMA WRITE (unsignaled) into the client's buffer, then the
//!      reply by SEND, posted together; the send queue executes in order,
//!      so the data lands before the reply;
//!    - write: RDMA READ from the client's buffer into the block. Its
//!      completion comes back to the handler, which hands the reply to a
//!      worker again (same key).
//! 3. Replies come from a small pool of reply buffers per connection (a
//!    buffer is free again when its SEND completes); a worker that finds
//!    none defers the job, and the handler re-issues it when a reply
//!    completes.
//!
//! Errors: a request that does not decode is answered `Malformed` (when its
//! slot can be read) and counted; an out-of-range block or a wrong length
//! is answered with its status. A failed transfer or post breaks the
//! connection: its QP goes to error, so that everything outstanding is
//! flushed and the client sees its requests fail (never hang).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd_core::{
    CqHandle, CqOptions, Failed, Handler, OpKind, Outbox, RecvDone, Registration, Route, SendDone,
    UnboundCq,
};
use parking_lot::Mutex;

use crate::backend::{BackendError, Depths, Exposure, Link, Node, Op, Region, Verb};
use crate::wire::{BlockOp, Reply, ReplyStatus, Request, MSG_LEN};

const MSG: u64 = MSG_LEN as u64;

/// How many broken connections a server's counters name.
pub const BROKEN_NAMED: usize = 64;

/// Counters of one server.
#[derive(Debug, Default)]
pub struct ServerStats {
    reads: AtomicU64,
    writes: AtomicU64,
    bytes: AtomicU64,
    malformed: AtomicU64,
    rejected: AtomicU64,
    deferred: AtomicU64,
    errors: AtomicU64,
    flushed: AtomicU64,
    broken: AtomicU64,
    /// Which connections broke, and why (the first [`BROKEN_NAMED`]).
    broken_why: parking_lot::Mutex<Vec<String>>,
    dropped: AtomicU64,
    /// Jobs handed to workers and not finished (deferred ones included).
    jobs: AtomicI64,
}

/// A snapshot of [`ServerStats`].
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ServerCounts {
    /// Read requests served.
    pub reads: u64,
    /// Write requests served.
    pub writes: u64,
    /// Bytes moved by RDMA.
    pub bytes: u64,
    /// Requests that did not decode.
    pub malformed: u64,
    /// Requests answered with an error status.
    pub rejected: u64,
    /// Replies that waited for a reply buffer.
    pub deferred: u64,
    /// Error completions (flushes excluded).
    pub errors: u64,
    /// Flush completions.
    pub flushed: u64,
    /// Connections broken by an error.
    pub broken: u64,
    /// Each broken connection with what broke it ("srv0/c2: RDMA READ
    /// completed with RemoteAccess"), the first [`BROKEN_NAMED`]: a client
    /// that misbehaved is named here.
    pub broken_connections: Vec<String>,
    /// Jobs dropped because their connection broke or the server closed.
    pub dropped: u64,
}

impl ServerStats {
    /// The counters now.
    pub fn counts(&self) -> ServerCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ServerCounts {
            reads: l(&self.reads),
            writes: l(&self.writes),
            bytes: l(&self.bytes),
            malformed: l(&self.malformed),
            rejected: l(&self.rejected),
            deferred: l(&self.deferred),
            errors: l(&self.errors),
            flushed: l(&self.flushed),
            broken: l(&self.broken),
            broken_connections: self.broken_why.lock().clone(),
            dropped: l(&self.dropped),
        }
    }
}

/// What a worker does.
#[derive(Debug, Clone, Copy)]
enum Job {
    /// Serve a decoded request.
    Serve(Request),
    /// The RDMA READ of a write completed: reply OK.
    Written(Request),
    /// Send this reply (an error status).
    Answer(Reply),
}

impl Job {
    fn route(&self) -> Route {
        match self {
            Job::Serve(r) | Job::Written(r) => Route::Key(r.block),
            Job::Answer(r) => Route::Key(r.block),
        }
    }
}

/// A work item of the server's pool.
#[derive(Debug)]
pub struct ServerWork<N: Node> {
    conn: Arc<SrvConn<N>>,
    job: Job,
}

impl<N: Node> ServerWork<N> {
    /// Runs the item (the pool's work function).
    pub fn run(self) {
        let ServerWork { conn, job } = self;
        conn.run(job);
        conn.stats.jobs.fetch_sub(1, Ordering::AcqRel);
    }
}

#[derive(Debug)]
struct Replies {
    free: Vec<u32>,
    deferred: VecDeque<Job>,
}

/// The server side of one connection.
#[derive(Debug)]
pub struct SrvConn<N: Node> {
    name: String,
    link: N::Link,
    reg: Registration,
    /// Receive buffers `[0, depth)`, then reply buffers.
    msgs: N::Region,
    depth: u32,
    device: Arc<N::Region>,
    blocks: u64,
    block_size: u32,
    replies: Mutex<Replies>,
    /// Writes waiting for their RDMA READ, by client slot.
    reading: Vec<Mutex<Option<Request>>>,
    stats: Arc<ServerStats>,
    closing: Arc<AtomicBool>,
    broken: AtomicBool,
    /// Given back before its session started ([`Server::release`]): its
    /// flushes end it, they do not break it.
    released: AtomicBool,
}

impl<N: Node> SrvConn<N> {
    /// The link (to connect it).
    pub fn link(&self) -> &N::Link {
        &self.link
    }

    /// The connection's handler registration (for the report).
    pub fn registration(&self) -> &Registration {
        &self.reg
    }

    /// The connection's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Posts every receive buffer (after `connect`).
    ///
    /// # Errors
    /// A refused post.
    pub fn post_receives(&self) -> Result<(), BackendError> {
        let reg = &self.reg;
        for slot in 0..self.depth {
            self.link
                .post_recv(reg, slot, &self.msgs, u64::from(slot) * MSG, MSG_LEN as u32)?;
        }
        Ok(())
    }

    /// Breaks the connection: its QP to error, so everything outstanding
    /// is flushed and the client's requests fail.
    fn break_conn(&self, why: &str) {
        if !self.broken.swap(true, Ordering::AcqRel) {
            self.stats.broken.fetch_add(1, Ordering::Relaxed);
            let dropped = self.replies.lock().deferred.drain(..).count();
            self.stats
                .dropped
                .fetch_add(dropped as u64, Ordering::Relaxed);
            self.stats.jobs.fetch_sub(dropped as i64, Ordering::AcqRel);
            if !self.closing.load(Ordering::Acquire) {
                tracing::warn!(conn = %self.name, "connection broken: {why}");
                let mut named = self.stats.broken_why.lock();
                if named.len() < BROKEN_NAMED {
                    named.push(format!("{}: {why}", self.name));
                }
            }
            self.link.to_error();
        }
    }

    fn run(self: &Arc<Self>, job: Job) {
        if self.broken.load(Ordering::Acquire) || self.closing.load(Ordering::Acquire) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        match job {
            Job::Serve(req) => self.serve(req, job),
            Job::Written(req) => self.reply(Reply::to(&req, ReplyStatus::Ok), None, job),
            Job::Answer(reply) => self.reply(reply, None, job),
        }
    }

    fn serve(self: &Arc<Self>, req: Request, job: Job) {
        let status = if req.len != self.block_size {
            ReplyStatus::BadLength
        } else if req.block >= self.blocks {
            ReplyStatus::OutOfRange
        } else if u32::from(req.slot) >= self.depth {
            ReplyStatus::Malformed
        } else {
            ReplyStatus::Ok
        };
        if status != ReplyStatus::Ok {
            self.stats.rejected.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(conn = %self.name, ?req, ?status, "request refused");
            return self.reply(Reply::to(&req, status), None, job);
        }
        let offset = req.block * u64::from(self.block_size);
        match req.op {
            BlockOp::Read => {
                self.reply(Reply::to(&req, ReplyStatus::Ok), Some((&req, offset)), job)
            }
            BlockOp::Write => {
                {
                    let mut slot = self.reading[usize::from(req.slot)].lock();
                    if slot.is_some() {
                        drop(slot);
                        self.stats.rejected.fetch_add(1, Ordering::Relaxed);
                        return self.reply(Reply::to(&req, ReplyStatus::SlotBusy), None, job);
                    }
                    *slot = Some(req);
                }
                let op = Op {
                    tag: u32::from(req.slot),
                    verb: Verb::Read(req.remote),
                    region: &*self.device,
                    offset,
                    len: req.len,
                    signaled: true,
                };
                let posted = self.link.post_send(&self.reg, &[op]);
                if let Err(e) = posted {
                    self.reading[usize::from(req.slot)].lock().take();
                    self.break_conn(&e.to_string());
                }
            }
        }
    }

    /// Sends `reply` from a free reply buffer, after an RDMA WRITE of the
    /// block at `data` if given; defers `job` if no buffer is free.
    fn reply(&self, reply: Reply, data: Option<(&Request, u64)>, job: Job) {
        let slot = {
            let mut r = self.replies.lock();
            match r.free.pop() {
                Some(slot) => slot,
                None if self.broken.load(Ordering::Acquire) => {
                    // break_conn set the flag before it emptied the queue
                    // under this lock: nobody would re-issue the job.
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                None => {
                    r.deferred.push_back(job);
                    self.stats.deferred.fetch_add(1, Ordering::Relaxed);
                    // Still counted in `jobs`: the handler re-issues it.
                    self.stats.jobs.fetch_add(1, Ordering::AcqRel);
                    return;
                }
            }
        };
        let at = u64::from(self.depth + slot) * MSG;
        let result = self.msgs.write(at, &reply.encode()).and_then(|()| {
            let reg = &self.reg;
            let send = Op {
                tag: slot,
                verb: Verb::Send,
                region: &self.msgs,
                offset: at,
                len: MSG_LEN as u32,
                signaled: true,
            };
            match data {
                Some((req, offset)) => {
                    let write = Op {
                        tag: slot,
                        verb: Verb::Write(req.remote),
                        region: &*self.device,
                        offset,
                        len: req.len,
                        signaled: false,
                    };
                    self.link.post_send(reg, &[write, send])
                }
                None => self.link.post_send(reg, &[send]),
            }
        });
        match result {
            Ok(()) => {
                if reply.status == ReplyStatus::Ok {
                    let stat = match reply.op {
                        BlockOp::Read => &self.stats.reads,
                        BlockOp::Write => &self.stats.writes,
                    };
                    stat.fetch_add(1, Ordering::Relaxed);
                    self.stats
                        .bytes
                        .fetch_add(u64::from(self.block_size), Ordering::Relaxed);
                }
            }
            Err(e) => {
                self.replies.lock().free.push(slot);
                self.break_conn(&e.to_string());
            }
        }
    }

    /// A reply buffer is free again: re-issue the oldest deferred job.
    fn reply_done(self: &Arc<Self>, slot: u32, out: &mut Outbox<'_, ServerWork<N>>) {
        let next = {
            let mut r = self.replies.lock();
            r.free.push(slot);
            r.deferred.pop_front()
        };
        if let Some(job) = next {
            // Still counted in `jobs` since its deferral; the run of this
            // item ends that count.
            out.push_to(
                job.route(),
                ServerWork {
                    conn: Arc::clone(self),
                    job,
                },
            );
        }
    }
}

/// The handler of one server connection, on the server's poller.
#[derive(Debug)]
pub struct SrvHandler<N: Node> {
    conn: Arc<SrvConn<N>>,
}

impl<N: Node> SrvHandler<N> {
    fn hand(&self, job: Job, out: &mut Outbox<'_, ServerWork<N>>) {
        self.conn.stats.jobs.fetch_add(1, Ordering::AcqRel);
        out.push_to(
            job.route(),
            ServerWork {
                conn: Arc::clone(&self.conn),
                job,
            },
        );
    }
}

impl<N: Node> Handler<ServerWork<N>> for SrvHandler<N> {
    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, ServerWork<N>>) {
        let c = &self.conn;
        let slot = d.tag();
        let len = (d.byte_len() as usize).min(MSG_LEN);
        let mut buf = [0u8; MSG_LEN];
        let at = u64::from(slot) * MSG;
        if slot >= c.depth {
            c.break_conn(&format!("a receive completed with unknown tag {slot}"));
            return;
        }
        if let Err(e) = c.msgs.read(at, &mut buf[..len]) {
            c.break_conn(&e.to_string());
            return;
        }
        // The buffer is copied out: give it back to the NIC first.
        if let Err(e) = c.link.post_recv(&c.reg, slot, &c.msgs, at, MSG_LEN as u32) {
            c.break_conn(&e.to_string());
        }
        let parsed = if d.byte_len() as usize > MSG_LEN {
            Err(crate::wire::WireError::Length {
                len: d.byte_len() as usize,
            })
        } else {
            Request::decode(&buf[..len])
        };
        match parsed {
            Ok(req) => self.hand(Job::Serve(req), out),
            Err(e) => {
                c.stats.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(conn = %c.name, bytes = d.byte_len(), "malformed request: {e}");
                if let Some((slot, id)) = Request::salvage(&buf[..len]) {
                    let reply = Reply {
                        op: BlockOp::Read,
                        slot,
                        id,
                        status: ReplyStatus::Malformed,
                        block: 0,
                    };
                    self.hand(Job::Answer(reply), out);
                } else {
                    c.break_conn("a request whose slot cannot be read");
                }
            }
        }
    }

    fn on_send(&mut self, d: &SendDone<'_>, out: &mut Outbox<'_, ServerWork<N>>) {
        let c = &self.conn;
        match d.kind() {
            OpKind::Send => c.reply_done(d.tag(), out),
            OpKind::Read => {
                let req = c
                    .reading
                    .get(d.tag() as usize)
                    .and_then(|slot| slot.lock().take());
                match req {
                    Some(req) => self.hand(Job::Written(req), out),
                    None => {
                        c.break_conn(&format!("an RDMA READ completed for idle slot {}", d.tag()))
                    }
                }
            }
            // RDMA WRITEs are unsignaled: retired by their reply's SEND.
            _ => {}
        }
    }

    fn on_error(&mut self, f: &Failed<'_>, out: &mut Outbox<'_, ServerWork<N>>) {
        let c = &self.conn;
        if f.is_flush() {
            c.stats.flushed.fetch_add(1, Ordering::Relaxed);
        } else {
            c.stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(conn = %c.name, kind = f.kind().name(), status = ?f.status(), "request failed");
        }
        // Release what the request held.
        match f.kind() {
            OpKind::Send => c.reply_done(f.tag(), out),
            OpKind::Read => {
                if let Some(slot) = c.reading.get(f.tag() as usize) {
                    slot.lock().take();
                }
            }
            _ => {}
        }
        // A flush at the close, or of a connection given back, is the end
        // of the connection's life, not a failure.
        let ended = c.closing.load(Ordering::Acquire) || c.released.load(Ordering::Acquire);
        if !(f.is_flush() && ended) {
            c.break_conn(&format!(
                "{} completed with {:?}",
                f.kind().name(),
                f.status()
            ));
        }
    }
}

/// Geometry of a server.
#[derive(Debug, Clone, Copy)]
pub struct ServerSpec {
    /// Device size in bytes (a multiple of the block size).
    pub device_bytes: u64,
    /// Block size in bytes.
    pub block_size: u32,
    /// Requests in flight per connection (the client's queue depth).
    pub depth: u32,
    /// Connections this server will accept.
    pub connections: u32,
}

impl ServerSpec {
    /// Queue depths of one server connection: the receives, and on the
    /// send side up to two WRs (WRITE + SEND) per reply buffer plus one
    /// READ per request.
    pub fn depths(&self) -> Depths {
        Depths {
            send: 5 * self.depth,
            recv: self.depth,
        }
    }
}

/// One block server.
#[derive(Debug)]
pub struct Server<N: Node> {
    name: String,
    node: N,
    cq: N::Cq,
    handle: CqHandle<ServerWork<N>>,
    unbound: Option<UnboundCq<ServerWork<N>>>,
    device: Arc<N::Region>,
    spec: ServerSpec,
    conns: Vec<Arc<SrvConn<N>>>,
    /// Connections made so far, given back ones included (their names
    /// stay unique).
    made: u32,
    stats: Arc<ServerStats>,
    closing: Arc<AtomicBool>,
}

impl<N: Node> Server<N> {
    /// A server on `node` with its CQ `cq_name` and its device region.
    ///
    /// # Errors
    /// The CQ is too large for the device, or the device refused.
    pub fn new(
        node: N,
        cq_name: &str,
        spec: ServerSpec,
        options: CqOptions,
    ) -> Result<Server<N>, crate::DemoError> {
        let d = spec.depths();
        if d.send > node.max_qp_wr() {
            return Err(crate::DemoError::Config(format!(
                "queue depth {} needs send queues of {} entries on the server, the device makes at \
                 most {}: lower --qd",
                spec.depth,
                d.send,
                node.max_qp_wr()
            )));
        }
        let per_conn = [d.send, d.recv];
        let all: Vec<u32> = (0..spec.connections).flat_map(|_| per_conn).collect();
        let depth = cqd_core::cq_depth_for(&all, 2, node.max_cqe()).map_err(|needed| {
            crate::DemoError::Config(format!(
                "server CQ {cq_name} needs {needed} entries for {} connections at queue depth {}, \
                 the device makes at most {}: lower --connections or --qd",
                spec.connections,
                spec.depth,
                node.max_cqe()
            ))
        })?;
        let (cq, unbound, handle) = node.create_cq(cq_name, depth, options)?;
        // The server moves every block itself: no peer reaches its device.
        let device = Arc::new(node.reg_region(spec.device_bytes, Exposure::Local)?);
        Ok(Server {
            name: node.name().to_string(),
            node,
            cq,
            handle,
            unbound: Some(unbound),
            device,
            spec,
            conns: Vec::new(),
            made: 0,
            stats: Arc::new(ServerStats::default()),
            closing: Arc::new(AtomicBool::new(false)),
        })
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The CQ's polling right, for its poller thread (once).
    pub fn take_cq(&mut self) -> Option<UnboundCq<ServerWork<N>>> {
        self.unbound.take()
    }

    /// The server's geometry.
    pub fn spec(&self) -> ServerSpec {
        self.spec
    }

    /// Blocks on the device.
    pub fn blocks(&self) -> u64 {
        self.spec.device_bytes / u64::from(self.spec.block_size)
    }

    /// A new connection: its QP, buffers and handler (connect its link,
    /// then [`SrvConn::post_receives`]).
    ///
    /// # Errors
    /// The device refused, or the handler could not be registered.
    pub fn accept(&mut self) -> Result<Arc<SrvConn<N>>, crate::DemoError> {
        let depth = self.spec.depth;
        // Its QP and message buffers are the server's alone: the load only
        // SENDs to it, and the server reads and writes the load's buffers.
        let link = self
            .node
            .create_link(&self.cq, self.spec.depths(), Exposure::Local)?;
        let msgs = self
            .node
            .reg_region(u64::from(3 * depth) * MSG, Exposure::Local)?;
        let name = format!("{}/c{}", self.name, self.made);
        let (device, stats, closing) = (
            Arc::clone(&self.device),
            Arc::clone(&self.stats),
            Arc::clone(&self.closing),
        );
        let blocks = self.blocks();
        let block_size = self.spec.block_size;
        let mut made = None;
        self.handle
            .register_with(|reg| {
                let conn = Arc::new(SrvConn {
                    name: name.clone(),
                    link,
                    reg: reg.clone(),
                    msgs,
                    depth,
                    device,
                    blocks,
                    block_size,
                    replies: Mutex::new(Replies {
                        free: (0..2 * depth).rev().collect(),
                        deferred: VecDeque::new(),
                    }),
                    reading: (0..depth).map(|_| Mutex::new(None)).collect(),
                    stats,
                    closing,
                    broken: AtomicBool::new(false),
                    released: AtomicBool::new(false),
                });
                made = Some(Arc::clone(&conn));
                SrvHandler { conn }
            })
            .map_err(|e| crate::DemoError::Setup(format!("{name}: register: {e}")))?;
        let conn = made.ok_or_else(|| crate::DemoError::Setup(format!("{name}: not made")))?;
        self.made += 1;
        self.conns.push(Arc::clone(&conn));
        Ok(conn)
    }

    /// Gives back a connection of a session that did not start: its QP to
    /// error (what it posted comes back flushed), off the server's list,
    /// its handler unregistered. The poller drops the handler once its
    /// flushes are in, and with it the QP and the QP's admission on the
    /// CQ: [`Arc::strong_count`] of `conn` falls to the caller's own.
    pub fn release(&mut self, conn: &Arc<SrvConn<N>>) {
        conn.released.store(true, Ordering::Release);
        conn.link.to_error();
        self.conns.retain(|c| !Arc::ptr_eq(c, conn));
        if let Err(e) = self.handle.unregister(conn.reg.key()) {
            tracing::warn!(conn = %conn.name, "unregister: {e}");
        }
    }

    /// Waits until no job is with the workers (or `timeout`), then closes:
    /// from now on workers drop what they are given. True if it went idle.
    pub fn quiesce(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let idle = loop {
            if self.stats.jobs.load(Ordering::Acquire) <= 0 {
                break true;
            }
            if Instant::now() >= deadline {
                break false;
            }
            std::thread::sleep(Duration::from_millis(1));
        };
        self.closing.store(true, Ordering::Release);
        idle
    }

    /// Every connection's QP to error (the shutdown's flush step).
    pub fn flush(&self) {
        self.closing.store(true, Ordering::Release);
        for c in &self.conns {
            c.link.to_error();
        }
    }

    /// The counters now.
    pub fn counts(&self) -> ServerCounts {
        self.stats.counts()
    }

    /// The counters, shared (for a sampler).
    pub fn stats(&self) -> &Arc<ServerStats> {
        &self.stats
    }

    /// The CQ's handle (for the metrics exporter).
    pub fn cq_handle(&self) -> &CqHandle<ServerWork<N>> {
        &self.handle
    }

    /// Jobs with the workers now.
    pub fn jobs(&self) -> i64 {
        self.stats.jobs.load(Ordering::Acquire)
    }

    /// The connections.
    pub fn conns(&self) -> &[Arc<SrvConn<N>>] {
        &self.conns
    }
}
