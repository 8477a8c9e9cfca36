//! The block server: an in-memory block device exported over RC QPs.
//!
//! A server is one poll group, as SPDK's NVMe-oF target has one per core:
//! its connections' QPs take their receives from **one SRQ**, and send and
//! receive completions all go to **one CQ** (an SRQ serves one CQ's
//! handlers), which one poller polls. The CQ comes from a [`CqPool`] over
//! the server's poller: the pool makes it at the first connection, sized
//! for the connections the server expects and the SRQ, and grows it in
//! place (`ibv_resize_cq`, [`CqPool::resize_up_to`]) if more come; a
//! closed connection's admission comes back for the next one. (The naive
//! baseline polls its CQ by hand: its server makes the CQ up front,
//! [`Server::fixed`].)
//!
//! Two kinds of handler run on the poller thread: the SRQ's
//! ([`SrqHandler`]) takes every request's receive, and per connection one
//! ([`SrvHandler`]) takes the completions of what its workers post.
//!
//! 1. A request's receive completes: the SRQ's handler copies the 64 bytes
//!    out, reposts the receive at once, finds the connection by the
//!    completion's QP number, decodes the request and hands it to the
//!    worker pool keyed by block (requests on one block are served in
//!    order, by one worker).
//! 2. The worker moves the data with one-sided RDMA between the device
//!    region and the client's buffer named in the request:
//!    - read: RDMA WRITE (unsignaled) into the client's buffer, then the
//!      reply by SEND, posted together; the send queue executes in order,
//!      so the data lands before the reply;
//!    - write: RDMA READ from the client's buffer into the block. Its
//!      completion comes back to the connection's handler, which hands the
//!      reply to a worker again (same key).
//! 3. Replies come from a small pool of reply buffers per connection (a
//!    buffer is free again when its SEND completes); a worker that finds
//!    none defers the job, and the connection's handler re-issues it when a
//!    reply completes.
//!
//! A connection closes by [`Server::close`] (its QP closed by cqd's
//! `Qp::close`, its handler retired), while the others run.
//!
//! Errors: a request that does not decode is answered `Malformed` (when its
//! slot can be read) and counted; an out-of-range block or a wrong length
//! is answered with its status. A failed transfer or post breaks the
//! connection: its QP goes to error, so that everything outstanding is
//! flushed and the client sees its requests fail (never hang).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use cqd_core::cq_pool::CqPool;
use cqd_core::event::QpEvent;
use cqd_core::topology::CqPoolPlan;
use cqd_core::{
    AsyncEvent, CqHandle, CqJoiner, CqOptions, Failed, Handler, OpKind, Outbox, RecvDone,
    Registration, Route, SendDone, UnboundCq,
};
use parking_lot::{Mutex, RwLock};

use crate::backend::{Exposure, Link, Node, Op, Region, SharedRq, Verb};
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
    closed: AtomicU64,
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
    /// Jobs dropped because their connection broke, closed, or the server
    /// closed (a request that came on no open connection included).
    pub dropped: u64,
    /// Connections closed while the server ran ([`Server::close`]).
    pub closed: u64,
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
            closed: l(&self.closed),
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
    /// The CQ its handler is on.
    handle: CqHandle<ServerWork<N>>,
    /// Reply buffers, `2 depth` of them.
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
    /// Closed ([`Server::close`]): its flushes end it, they do not break
    /// it.
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
        if self.broken.load(Ordering::Acquire)
            || self.closing.load(Ordering::Acquire)
            || self.released.load(Ordering::Acquire)
        {
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
        let at = u64::from(slot) * MSG;
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

    /// True when none of its own requests is outstanding: every reply
    /// buffer free (its SEND, and a read's WRITE before it, completed) and
    /// no write's RDMA READ in flight.
    fn idle(&self) -> bool {
        self.replies.lock().free.len() == 2 * self.depth as usize
            && self.reading.iter().all(|r| r.lock().is_none())
    }

    /// Hands `job` to the workers.
    fn hand(self: &Arc<Self>, job: Job, out: &mut Outbox<'_, ServerWork<N>>) {
        self.stats.jobs.fetch_add(1, Ordering::AcqRel);
        out.push_to(
            job.route(),
            ServerWork {
                conn: Arc::clone(self),
                job,
            },
        );
    }

    /// A request arrived (`buf`, of the `byte_len` the completion gave):
    /// decode it and hand it to the workers, or answer `Malformed`.
    fn on_request(
        self: &Arc<Self>,
        buf: &[u8],
        byte_len: u32,
        out: &mut Outbox<'_, ServerWork<N>>,
    ) {
        if self.released.load(Ordering::Acquire) || self.broken.load(Ordering::Acquire) {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let parsed = if byte_len as usize > MSG_LEN {
            Err(crate::wire::WireError::Length {
                len: byte_len as usize,
            })
        } else {
            Request::decode(buf)
        };
        match parsed {
            Ok(req) => self.hand(Job::Serve(req), out),
            Err(e) => {
                self.stats.malformed.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(conn = %self.name, bytes = byte_len, "malformed request: {e}");
                if let Some((slot, id)) = Request::salvage(buf) {
                    let reply = Reply {
                        op: BlockOp::Read,
                        slot,
                        id,
                        status: ReplyStatus::Malformed,
                        block: 0,
                    };
                    self.hand(Job::Answer(reply), out);
                } else {
                    self.break_conn("a request whose slot cannot be read");
                }
            }
        }
    }
}

/// QP numbers are the map's keys: small integers, each once among the
/// live QPs; one multiply spreads them over the table (no SipHash per
/// request).
#[derive(Debug, Default, Clone, Copy)]
struct Qpn(u64);

impl std::hash::Hasher for Qpn {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

type ByQpn<V> = HashMap<u32, V, std::hash::BuildHasherDefault<Qpn>>;

/// What a server's SRQ handler and its connections share: the SRQ, its
/// receive buffers, and the open connections by QP number.
#[derive(Debug)]
struct SrqSide<N: Node> {
    srq: N::Srq,
    /// `depth` receive buffers of [`MSG_LEN`] bytes.
    bufs: N::Region,
    depth: u32,
    /// The SRQ handler's registration, made on the server's CQ when its
    /// first connection is made there ([`SrqSide::bind`]).
    reg: OnceLock<Registration>,
    conns: RwLock<ByQpn<Arc<SrvConn<N>>>>,
    stats: Arc<ServerStats>,
    closing: Arc<AtomicBool>,
}

impl<N: Node> SrqSide<N> {
    /// Registers the SRQ's handler on `handle`'s CQ and posts every
    /// receive buffer, once; later calls find it done.
    fn bind(self: &Arc<Self>, handle: &CqHandle<ServerWork<N>>) -> Result<(), crate::DemoError> {
        if self.reg.get().is_some() {
            return Ok(());
        }
        let reg = handle
            .register(SrqHandler {
                side: Arc::clone(self),
            })
            .map_err(|e| crate::DemoError::Setup(format!("{}: register: {e}", handle.name())))?;
        for slot in 0..self.depth {
            self.srq.post_recv(
                &reg,
                slot,
                &self.bufs,
                u64::from(slot) * MSG,
                MSG_LEN as u32,
            )?;
        }
        // Only `Server::accept` binds, under `&mut Server`.
        let _ = self.reg.set(reg);
        Ok(())
    }

    /// Gives receive buffer `slot` back to the SRQ (not once the server
    /// closes: the stop hands back what is posted).
    fn repost(&self, slot: u32) {
        if self.closing.load(Ordering::Acquire) {
            return;
        }
        let Some(reg) = self.reg.get() else { return };
        if let Err(e) =
            self.srq
                .post_recv(reg, slot, &self.bufs, u64::from(slot) * MSG, MSG_LEN as u32)
        {
            self.stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(srq = self.srq.srqn(), slot, "SRQ receive not reposted: {e}");
        }
    }

    fn conn(&self, qpn: u32) -> Option<Arc<SrvConn<N>>> {
        self.conns.read().get(&qpn).cloned()
    }
}

/// The handler of a server's SRQ: every request's receive.
#[derive(Debug)]
pub struct SrqHandler<N: Node> {
    side: Arc<SrqSide<N>>,
}

impl<N: Node> Handler<ServerWork<N>> for SrqHandler<N> {
    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, ServerWork<N>>) {
        let side = &self.side;
        let slot = d.tag();
        if slot >= side.depth {
            side.stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(slot, "an SRQ receive completed with an unknown tag");
            return;
        }
        let len = (d.byte_len() as usize).min(MSG_LEN);
        let mut buf = [0u8; MSG_LEN];
        let read = side.bufs.read(u64::from(slot) * MSG, &mut buf[..len]);
        // The buffer is copied out: give it back to the NIC first.
        side.repost(slot);
        // Under the map's read lock (a close or an accept takes the write
        // lock, rarely): no clone of the connection's Arc per request.
        let conns = side.conns.read();
        let Some(conn) = conns.get(&d.qp_num()) else {
            side.stats.dropped.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                qpn = d.qp_num(),
                "a request on a QP that is no open connection"
            );
            return;
        };
        match read {
            Ok(()) => conn.on_request(&buf[..len], d.byte_len(), out),
            Err(e) => conn.break_conn(&e.to_string()),
        }
    }

    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, ServerWork<N>>) {
        tracing::warn!(tag = d.tag(), "a send completed on the SRQ's handler");
    }

    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, ServerWork<N>>) {
        let side = &self.side;
        if f.is_flush() {
            side.stats.flushed.fetch_add(1, Ordering::Relaxed);
        } else {
            side.stats.errors.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(qpn = f.qp_num(), status = ?f.status(), "an SRQ receive failed");
        }
        if let Some(c) = side.conn(f.qp_num()) {
            let ended = c.closing.load(Ordering::Acquire) || c.released.load(Ordering::Acquire);
            if !(f.is_flush() && ended) {
                c.break_conn(&format!("a receive completed with {:?}", f.status()));
            }
        }
        // The QP that took it is gone or broken; the buffer serves the
        // others.
        if f.tag() < side.depth {
            side.repost(f.tag());
        }
    }
}

/// The handler of one server connection, on the server's poller: the
/// completions of what its workers post, and its QP's asynchronous events.
/// Registered before the connection is made (its QP names it as owner),
/// so it holds the connection through a cell set once after.
#[derive(Debug)]
pub struct SrvHandler<N: Node> {
    conn: Arc<OnceLock<Arc<SrvConn<N>>>>,
}

impl<N: Node> Handler<ServerWork<N>> for SrvHandler<N> {
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, ServerWork<N>>) {
        let Some(c) = self.conn.get() else { return };
        // Its QP takes its receives from the SRQ, whose handler they go to.
        c.break_conn(&format!(
            "a receive completed on the connection's own handler (tag {})",
            d.tag()
        ));
    }

    fn on_send(&mut self, d: &SendDone<'_>, out: &mut Outbox<'_, ServerWork<N>>) {
        let Some(c) = self.conn.get() else { return };
        match d.kind() {
            OpKind::Send => c.reply_done(d.tag(), out),
            OpKind::Read => {
                let req = c
                    .reading
                    .get(d.tag() as usize)
                    .and_then(|slot| slot.lock().take());
                match req {
                    Some(req) => c.hand(Job::Written(req), out),
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
        let Some(c) = self.conn.get() else { return };
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
        // A flush at the close, or of a connection closed, is the end of
        // the connection's life, not a failure.
        let ended = c.closing.load(Ordering::Acquire) || c.released.load(Ordering::Acquire);
        if !(f.is_flush() && ended) {
            c.break_conn(&format!(
                "{} completed with {:?}",
                f.kind().name(),
                f.status()
            ));
        }
    }

    fn on_async(&mut self, event: &AsyncEvent) {
        let Some(c) = self.conn.get() else { return };
        // A peer's request that broke the QP on the responder side (a
        // guessed key) leaves no completion here: the receives are the
        // SRQ's. The device says it by an event where it raises one: the
        // error state (`LAST_WQE_REACHED` for a QP on an SRQ; an access
        // or request error first on some devices).
        let AsyncEvent::Qp { kind, .. } = event else {
            return;
        };
        if c.closing.load(Ordering::Acquire) || c.released.load(Ordering::Acquire) {
            return;
        }
        match kind {
            // The error state, whatever put it there: with requests of its
            // own outstanding, their completions name the cause (they may
            // come after the event); with none, nothing else will.
            QpEvent::LastWqeReached => {
                if c.idle() {
                    c.break_conn(
                        "its QP went to the error state with nothing of its own outstanding \
                         (LAST_WQE_REACHED): a peer's request broke it",
                    );
                }
            }
            other => c.break_conn(&format!("its QP raised {other:?}")),
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
    /// The send queue of one server connection: up to two WRs (WRITE +
    /// SEND) per reply buffer, plus one READ per request. Its receives
    /// come from the server's SRQ.
    pub fn send_depth(&self) -> u32 {
        5 * self.depth
    }

    /// The server's SRQ: a receive for each request every connection may
    /// have in flight, at most what the device makes (a client that finds
    /// none waits: its QPs retry receiver-not-ready for ever).
    pub fn srq_depth(&self, max_srq_wr: u32) -> u32 {
        self.connections
            .max(1)
            .saturating_mul(self.depth)
            .min(max_srq_wr)
            .max(1)
    }

    /// The server's CQ pool: its CQ is made for every connection the
    /// server expects and the SRQ (their sum: admission keeps it from
    /// overflowing), at the first connection; more connections than that
    /// grow it in place, up to twice.
    pub fn pool_sizes(&self) -> crate::topo::PoolSizes {
        let (send, srq) = (
            u64::from(self.send_depth()),
            u64::from(self.srq_depth(u32::MAX)),
        );
        let all = send * u64::from(self.connections.max(1)) + srq;
        let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
        crate::topo::PoolSizes {
            cqe: clamp(all),
            resize_up_to: clamp(2 * all),
        }
    }
}

/// Where a server's connections' CQ comes from.
#[derive(Debug)]
enum Cqs<N: Node> {
    /// Made up front, sized for every connection (the naive baseline's,
    /// which polls it by hand).
    Fixed(Box<FixedCq<N>>),
    /// A pool over the server's poller: one CQ (the SRQ serves one),
    /// made at the first connection and grown in place.
    Pool(CqPool<N::Cq, ServerWork<N>>),
}

/// A CQ made up front ([`Cqs::Fixed`]).
#[derive(Debug)]
struct FixedCq<N: Node> {
    cq: N::Cq,
    handle: CqHandle<ServerWork<N>>,
    unbound: Option<UnboundCq<ServerWork<N>>>,
}

/// One block server.
#[derive(Debug)]
pub struct Server<N: Node> {
    name: String,
    node: Arc<N>,
    cqs: Cqs<N>,
    /// Every CQ its connections are on, as they are made.
    handles: Arc<Mutex<Vec<CqHandle<ServerWork<N>>>>>,
    srq: Arc<SrqSide<N>>,
    device: Arc<N::Region>,
    spec: ServerSpec,
    /// Connections made so far, closed ones included (their names stay
    /// unique).
    made: u32,
    stats: Arc<ServerStats>,
    closing: Arc<AtomicBool>,
}

/// What both kinds of server start from: the checked geometry, the SRQ
/// and the device region.
struct Parts<N: Node> {
    node: Arc<N>,
    srq: Arc<SrqSide<N>>,
    device: Arc<N::Region>,
    stats: Arc<ServerStats>,
    closing: Arc<AtomicBool>,
    /// The CQ size every connection needs at once.
    all: u32,
}

impl<N: Node> Parts<N> {
    fn new(node: N, cq_name: &str, spec: ServerSpec) -> Result<Parts<N>, crate::DemoError> {
        let send = spec.send_depth();
        if send > node.max_qp_wr() {
            return Err(crate::DemoError::Config(format!(
                "queue depth {} needs send queues of {send} entries on the server, the device \
                 makes at most {}: lower --qd",
                spec.depth,
                node.max_qp_wr()
            )));
        }
        let srq_depth = spec.srq_depth(node.max_srq_wr());
        let mut all: Vec<u32> = vec![send; spec.connections as usize];
        all.push(srq_depth);
        let all = cqd_core::cq_depth_for(&all, 2, node.max_cqe()).map_err(|needed| {
            crate::DemoError::Config(format!(
                "server CQ {cq_name} needs {needed} entries for {} connections at queue depth {} \
                 and their SRQ, the device makes at most {}: lower --connections or --qd",
                spec.connections,
                spec.depth,
                node.max_cqe()
            ))
        })?;
        let srq = node.create_srq(srq_depth)?;
        let bufs = node.reg_region(u64::from(srq.depth()) * MSG, Exposure::Local)?;
        // The server moves every block itself: no peer reaches its device.
        let device = Arc::new(node.reg_region(spec.device_bytes, Exposure::Local)?);
        let stats = Arc::new(ServerStats::default());
        let closing = Arc::new(AtomicBool::new(false));
        let srq = Arc::new(SrqSide {
            depth: srq.depth(),
            srq,
            bufs,
            reg: OnceLock::new(),
            conns: RwLock::new(ByQpn::default()),
            stats: Arc::clone(&stats),
            closing: Arc::clone(&closing),
        });
        Ok(Parts {
            node: Arc::new(node),
            srq,
            device,
            stats,
            closing,
            all,
        })
    }

    fn server(
        self,
        cqs: Cqs<N>,
        handles: Arc<Mutex<Vec<CqHandle<ServerWork<N>>>>>,
        spec: ServerSpec,
    ) -> Server<N> {
        Server {
            name: self.node.name().to_string(),
            node: self.node,
            cqs,
            handles,
            srq: self.srq,
            device: self.device,
            spec,
            made: 0,
            stats: self.stats,
            closing: self.closing,
        }
    }
}

impl<N: Node> Server<N> {
    /// A server on `node` whose connections take their CQ from the CQ
    /// pool `plan` (the topology's `srv<i>`, over the poller of `joiner`),
    /// with its SRQ and its device region.
    ///
    /// # Errors
    /// The connections and their SRQ need a CQ larger than the device
    /// makes, the plan's pollers are not the joiner's, or the device
    /// refused.
    pub fn pooled(
        node: N,
        spec: ServerSpec,
        options: CqOptions,
        plan: CqPoolPlan,
        joiner: CqJoiner<ServerWork<N>>,
    ) -> Result<Server<N>, crate::DemoError> {
        let name = plan.name().to_string();
        let parts = Parts::new(node, &name, spec)?;
        let max_cqe = parts.node.max_cqe();
        let c = plan.config();
        if let Some(n) = Some(c.cqe).filter(|&n| n > max_cqe) {
            return Err(crate::DemoError::Config(format!(
                "CQ pool {name} asks CQs of {n} entries, the device makes at most {max_cqe}: \
                 lower --connections or --qd"
            )));
        }
        let handles = Arc::new(Mutex::new(Vec::new()));
        let (node, made) = (Arc::clone(&parts.node), Arc::clone(&handles));
        let pool = CqPool::from_plan(plan, vec![joiner], move |name, cqe| {
            let m = node
                .create_cq(name, cqe, options.clone())
                .map_err(|e| e.to_string())?;
            made.lock().push(m.2.clone());
            Ok(m)
        })
        .map_err(|e| crate::DemoError::Topology(e.to_string()))?;
        Ok(parts.server(Cqs::Pool(pool), handles, spec))
    }

    /// A server on `node` with its CQ `cq_name` made now, sized for every
    /// connection and the SRQ (take its polling right with
    /// [`take_cq`](Self::take_cq)), with its SRQ and its device region.
    ///
    /// # Errors
    /// The CQ is too large for the device, or the device refused.
    pub fn fixed(
        node: N,
        cq_name: &str,
        spec: ServerSpec,
        options: CqOptions,
    ) -> Result<Server<N>, crate::DemoError> {
        let parts = Parts::new(node, cq_name, spec)?;
        let (cq, unbound, handle) = parts.node.create_cq(cq_name, parts.all, options)?;
        parts.srq.bind(&handle)?;
        let handles = Arc::new(Mutex::new(vec![handle.clone()]));
        let cqs = Cqs::Fixed(Box::new(FixedCq {
            cq,
            handle,
            unbound: Some(unbound),
        }));
        Ok(parts.server(cqs, handles, spec))
    }

    /// The server's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The CQ's polling right, for its poller thread (once; a pooled
    /// server's pool hands its CQ to its poller itself).
    pub fn take_cq(&mut self) -> Option<UnboundCq<ServerWork<N>>> {
        match &mut self.cqs {
            Cqs::Fixed(f) => f.unbound.take(),
            Cqs::Pool(_) => None,
        }
    }

    /// The server's geometry.
    pub fn spec(&self) -> ServerSpec {
        self.spec
    }

    /// Blocks on the device.
    pub fn blocks(&self) -> u64 {
        self.spec.device_bytes / u64::from(self.spec.block_size)
    }

    /// A new connection: its QP on the SRQ, its reply buffers and its
    /// handler, on the CQ the pool gives (connect its link; its receives
    /// are the SRQ's).
    ///
    /// # Errors
    /// The pool or the device refused, or the handler could not be
    /// registered.
    pub fn accept(&mut self) -> Result<Arc<SrvConn<N>>, crate::DemoError> {
        let name = format!("{}/c{}", self.name, self.made);
        // Its message buffers are the server's alone: the load only SENDs
        // to it, and the server reads and writes the load's buffers.
        let msgs = self
            .node
            .reg_region(u64::from(2 * self.spec.depth) * MSG, Exposure::Local)?;
        let conn = match &self.cqs {
            Cqs::Fixed(f) => self.make_conn(&f.cq, &f.handle, &name, msgs)?,
            Cqs::Pool(pool) => {
                let srq = (self.srq.srq.srqn(), self.srq.srq.depth());
                pool.open(self.spec.send_depth(), Some(srq), |cq, handle| {
                    self.make_conn(cq, handle, &name, msgs)
                })
                .map_err(|e| match e {
                    cqd_core::cq_pool::PoolError::Open { source, .. } => source,
                    other => crate::DemoError::Setup(format!("{name}: {other}")),
                })?
            }
        };
        self.made += 1;
        Ok(conn)
    }

    fn make_conn(
        &self,
        cq: &N::Cq,
        handle: &CqHandle<ServerWork<N>>,
        name: &str,
        msgs: N::Region,
    ) -> Result<Arc<SrvConn<N>>, crate::DemoError> {
        let depth = self.spec.depth;
        // The handler first: the QP names it as its owner (its
        // asynchronous events go there); the connection follows.
        let cell = Arc::new(OnceLock::new());
        let reg = handle
            .register(SrvHandler {
                conn: Arc::clone(&cell),
            })
            .map_err(|e| crate::DemoError::Setup(format!("{name}: register: {e}")))?;
        let made = self
            .node
            .create_link_on_srq(
                cq,
                self.spec.send_depth(),
                &self.srq.srq,
                Exposure::Local,
                &reg,
            )
            .map_err(crate::DemoError::from)
            .and_then(|link| {
                self.srq.bind(handle)?;
                Ok(link)
            });
        let link = match made {
            Ok(link) => link,
            Err(e) => {
                // Nothing posted through it: it goes at once.
                let _ = handle.unregister(reg.key());
                return Err(e);
            }
        };
        let qpn = link.qpn();
        let conn = Arc::new(SrvConn {
            name: name.to_string(),
            link,
            reg,
            handle: handle.clone(),
            msgs,
            depth,
            device: Arc::clone(&self.device),
            blocks: self.blocks(),
            block_size: self.spec.block_size,
            replies: Mutex::new(Replies {
                free: (0..2 * depth).rev().collect(),
                deferred: VecDeque::new(),
            }),
            reading: (0..depth).map(|_| Mutex::new(None)).collect(),
            stats: Arc::clone(&self.stats),
            closing: Arc::clone(&self.closing),
            broken: AtomicBool::new(false),
            released: AtomicBool::new(false),
        });
        // Only this call sets it: the handler was registered empty above.
        let _ = cell.set(Arc::clone(&conn));
        self.srq.conns.write().insert(qpn, Arc::clone(&conn));
        Ok(conn)
    }

    /// Closes a connection while the others run: off the server's list
    /// (a request that still comes on its QP is dropped, counted), its QP
    /// to error, its handler retired once its flushes are in, then its QP
    /// closed ([`Link::close`]: destroyed once its completions and its SRQ
    /// use are accounted, its admission on the CQ given back). Waits for
    /// all of it, at most `timeout`. `conn` must be the caller's only
    /// hold on the connection besides the server's and its workers'.
    ///
    /// # Errors
    /// What did not end within `timeout`, naming the connection (the close
    /// goes on in the background where it can).
    pub fn close(&self, conn: Arc<SrvConn<N>>, timeout: Duration) -> Result<(), String> {
        self.end(conn, timeout)?;
        self.stats.closed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The stop's flush step: every connection's QP to error at once; on
    /// a device that raises no `LAST_WQE_REACHED` (rxe,
    /// [`Node::stop_closes_srq_users`]), which says only by the destroy
    /// that a QP takes no more of the SRQ's receives, each is then closed
    /// as [`close`](Self::close) does (not counted as a close), so that
    /// the stop can hand back the receives still posted. Elsewhere the
    /// connections stay, with their handlers' accounts in the report.
    /// What did not close within `timeout` (each) is named in the return.
    pub fn stop_connections(&self, timeout: Duration) -> Vec<String> {
        if !self.node.stop_closes_srq_users() {
            self.flush();
            return Vec::new();
        }
        self.closing.store(true, Ordering::Release);
        let conns: Vec<_> = self.srq.conns.write().drain().map(|(_, c)| c).collect();
        for c in &conns {
            c.released.store(true, Ordering::Release);
            c.link.to_error();
        }
        conns
            .into_iter()
            .filter_map(|c| self.end(c, timeout).err())
            .collect()
    }

    /// [`close`](Self::close) without the count.
    fn end(&self, conn: Arc<SrvConn<N>>, timeout: Duration) -> Result<(), String> {
        let deadline = Instant::now() + timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let name = conn.name.clone();
        conn.released.store(true, Ordering::Release);
        self.srq.conns.write().remove(&conn.link.qpn());
        conn.link.to_error();
        let retired = conn
            .handle
            .unregister(conn.reg.key())
            .map_err(|e| format!("{name}: unregister: {e}"))?;
        retired.wait(left()).map_err(|e| format!("{name}: {e}"))?;
        // The handler is gone; the workers drop what they still hold of
        // the connection (it is released).
        while Arc::strong_count(&conn) > 1 {
            if left().is_zero() {
                return Err(format!(
                    "{name}: still held {timeout:?} after its close began"
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let conn = Arc::try_unwrap(conn).map_err(|_| format!("{name}: still held"))?;
        let deferred = conn.replies.into_inner().deferred.len() as u64;
        if deferred > 0 {
            self.stats.dropped.fetch_add(deferred, Ordering::Relaxed);
            self.stats.jobs.fetch_sub(deferred as i64, Ordering::AcqRel);
        }
        conn.link.close(left()).map_err(|e| e.to_string())
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

    /// Every connection's QP to error (the shutdown's flush step); the
    /// stop then hands back the receives still on the SRQ.
    pub fn flush(&self) {
        self.closing.store(true, Ordering::Release);
        for c in self.srq.conns.read().values() {
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

    /// The CQs its connections are on so far (for the metrics exporter).
    pub fn cq_handles(&self) -> Vec<CqHandle<ServerWork<N>>> {
        self.handles.lock().clone()
    }

    /// The SRQ handler's registration, once its CQ is made (for the
    /// report's names).
    pub fn srq_registration(&self) -> Option<&Registration> {
        self.srq.reg.get()
    }

    /// Jobs with the workers now.
    pub fn jobs(&self) -> i64 {
        self.stats.jobs.load(Ordering::Acquire)
    }

    /// The open connections.
    pub fn conns(&self) -> Vec<Arc<SrvConn<N>>> {
        self.srq.conns.read().values().cloned().collect()
    }
}
