//! Connections through the RDMA connection manager (rdma_cm, librdmacm):
//! listen, accept, connect and disconnect as NVMe over Fabrics and most RDMA
//! middleware do, with cqd's own queue pairs.
//!
//! ```rust,ignore
//! let cm = ConnectionManager::new()?;                 // one CM thread
//! // server
//! let l = cm.listen("0.0.0.0:4420".parse()?, 16)?;
//! let req = l.next_request(Duration::from_secs(10))?; // CONNECT_REQUEST
//! let qp = pd.create_qp(&QpInit::new(&cq, &cq, cap))?;
//! let conn = req.accept(qp, &CmParams::default())?;   // ESTABLISHED
//! // client
//! let conn = cm.connect(addr, qp, &CmParams::default())?;
//! reg.post_send(conn.qp(), ...)?;                      // as any cqd QP
//! conn.disconnect(Duration::from_secs(5))?;            // drained
//! ```
//!
//! - The QP (given as a `Qp` or an `Arc<Qp>` the application keeps a
//!   handle of) is cqd's ([`Pd::create_qp`](crate::Pd::create_qp): admitted on
//!   its CQs, posted through the registration), not librdmacm's: the CM only
//!   carries its number and gives the attributes of each transition
//!   (`rdma_init_qp_attr`), which the helper applies — INIT, RTR, RTS before
//!   `rdma_accept` on the passive side, after the reply
//!   (`RDMA_CM_EVENT_CONNECT_RESPONSE`) then `rdma_establish` on the active
//!   side.
//! - CM events are read by one thread per [`ConnectionManager`]
//!   (`cqd-cm`), never by a poller: the hot path does not see them. The
//!   thread sorts them to the listener or connection they belong to; the
//!   caller that waits (for a request, an address, an accept) is woken.
//! - When the peer disconnects (or its process dies: the CM reports that
//!   as a disconnect), the thread moves the connection's QP to the error
//!   state at once: every request still outstanding completes flushed and
//!   the poller retires it with its credits, as for any QP cqd shuts down.
//!   [`Connection::disconnect`] does the same from this side, then waits
//!   until the QP has nothing outstanding and the CM has confirmed.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::sys_cm::{self, ev, rdma_cm_id, EventChannel};
use crate::{Qp, VerbsError};

/// What went wrong while connecting or disconnecting.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CmError {
    /// An rdma_cm call failed.
    #[error("{call}: {}", std::io::Error::from_raw_os_error(*errno))]
    Call {
        /// The librdmacm function.
        call: &'static str,
        /// Its errno.
        errno: i32,
    },
    /// The peer refused the connection (`RDMA_CM_EVENT_REJECTED`): status
    /// is the InfiniBand CM reason (8: nobody listens there; 28: the
    /// peer's application rejected), with the peer's private data.
    #[error("connection rejected by the peer (reason {status})")]
    Rejected {
        /// The reject reason.
        status: i32,
        /// The peer's private data.
        private_data: Vec<u8>,
    },
    /// The peer's CM did not answer (`RDMA_CM_EVENT_UNREACHABLE`).
    #[error("peer unreachable (status {status})")]
    Unreachable {
        /// The event's status (a negative errno).
        status: i32,
    },
    /// Address or route resolution failed.
    #[error("{what} failed (status {status})")]
    Resolve {
        /// "address" or "route".
        what: &'static str,
        /// The event's status (a negative errno).
        status: i32,
    },
    /// An event other than the one awaited arrived.
    #[error("unexpected CM event {event} (status {status}) while waiting for {wanted}")]
    Unexpected {
        /// The event type (`enum rdma_cm_event_type`).
        event: u32,
        /// Its status.
        status: i32,
        /// What was awaited.
        wanted: &'static str,
    },
    /// Nothing within the time allowed.
    #[error("timed out waiting for {0}")]
    Timeout(&'static str),
    /// The QP still had requests outstanding when the drain time ran out.
    #[error("drain timed out with {outstanding} request(s) outstanding on QP {qpn}")]
    DrainTimeout {
        /// The QP.
        qpn: u32,
        /// Requests not yet retired.
        outstanding: usize,
    },
    /// A verbs call on the QP failed.
    #[error(transparent)]
    Verbs(#[from] VerbsError),
}

fn call(call: &'static str) -> impl FnOnce(i32) -> CmError {
    move |errno| CmError::Call { call, errno }
}

/// Parameters of a connect or accept.
#[derive(Debug, Clone)]
pub struct CmParams {
    /// Private data for the peer (REQ: at most 56 bytes; REP: 196).
    pub private_data: Vec<u8>,
    /// RDMA READ / atomic operations this side accepts at once.
    pub responder_resources: u8,
    /// RDMA READ / atomic operations this side issues at once.
    pub initiator_depth: u8,
    /// Transport retries (0–7).
    pub retry_count: u8,
    /// RNR retries (0–7; 7 is infinite).
    pub rnr_retry_count: u8,
    /// How long address/route resolution and each answer may take.
    pub timeout: Duration,
    /// The QP's remote access flags, in place of what rdma_cm chooses at
    /// INIT (remote write, and remote read when it accepts reads):
    /// `Some(Access::LOCAL_WRITE)` for a side that no peer may read or
    /// write. `None` (the default): rdma_cm's.
    pub qp_access: Option<crate::Access>,
}

impl Default for CmParams {
    fn default() -> Self {
        CmParams {
            private_data: Vec::new(),
            responder_resources: 1,
            initiator_depth: 1,
            retry_count: 7,
            rnr_retry_count: 7,
            timeout: Duration::from_secs(10),
            qp_access: None,
        }
    }
}

#[derive(Default)]
struct SlotState {
    events: VecDeque<sys_cm::Event>,
    requests: VecDeque<sys_cm::Event>,
    /// The connection's QP, moved to ERR when the peer disconnects.
    qp: Option<Weak<Qp>>,
    disconnected: bool,
    /// A peer disconnect that moved the QP to ERR (the drain started).
    peer_flushed: bool,
}

#[derive(Default)]
struct Slot {
    st: Mutex<SlotState>,
    cv: Condvar,
}

impl Slot {
    fn lock(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next event, within `timeout`.
    fn next(&self, timeout: Duration, what: &'static str) -> Result<sys_cm::Event, CmError> {
        let end = Instant::now() + timeout;
        let mut g = self.lock();
        loop {
            if let Some(e) = g.events.pop_front() {
                return Ok(e);
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CmError::Timeout(what));
            }
            g = self
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

struct Shared {
    chan: EventChannel,
    slots: Mutex<HashMap<usize, Arc<Slot>>>,
    stop: std::sync::atomic::AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Shared {
    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<usize, Arc<Slot>>> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, id: NonNull<rdma_cm_id>) -> Arc<Slot> {
        let s = Arc::new(Slot::default());
        self.slots().insert(sys_cm::id::key(id), Arc::clone(&s));
        s
    }

    /// Forget and destroy `id`, under the map's lock: the CM thread, which
    /// looks ids up under the same lock before calling librdmacm on them,
    /// never names a destroyed id.
    fn forget(&self, id: NonNull<rdma_cm_id>) {
        let mut g = self.slots();
        g.remove(&sys_cm::id::key(id));
        sys_cm::id::destroy(id);
    }

    /// Sort one event to its slot (the CM thread).
    fn dispatch(&self, e: sys_cm::Event) {
        if e.kind == ev::RDMA_CM_EVENT_CONNECT_REQUEST {
            // Under the map's lock throughout: a listener found here is not
            // being dropped until the request is in its queue, and its drop
            // (after `forget`) finds every request queued.
            let mut slots = self.slots();
            match slots.get(&e.listen_key).cloned() {
                Some(l) => {
                    // The new id's own events go to its slot from now on.
                    slots.insert(e.key, Arc::new(Slot::default()));
                    l.lock().requests.push_back(e);
                    drop(slots);
                    l.cv.notify_all();
                }
                None => {
                    // A listener being dropped: refuse and forget the id.
                    if let Some(id) = NonNull::new(e.id as *mut rdma_cm_id) {
                        let _ = sys_cm::id::reject(id, &[]);
                        sys_cm::id::destroy(id);
                    }
                }
            }
            return;
        }
        // By key, not by address: an id destroyed after its event was read
        // is not in the map, and a new id at its address has another key.
        let slots = self.slots();
        let Some(slot) = slots.get(&e.key).cloned() else {
            return;
        };
        let mut g = slot.lock();
        if e.kind == ev::RDMA_CM_EVENT_DISCONNECTED {
            g.disconnected = true;
            if let Some(qp) = g.qp.as_ref().and_then(Weak::upgrade) {
                // The drain: every outstanding request flushes, the
                // poller retires it.
                if qp.to_error().is_ok() {
                    g.peer_flushed = true;
                }
            }
            // Answer the peer's disconnect request at once (DREP), so that
            // its side completes without waiting for ours to be dropped;
            // after our own request this is the CM's EINVAL, ignored.
            if let Some(id) = NonNull::new(e.id as *mut rdma_cm_id) {
                let _ = sys_cm::id::disconnect(id);
            }
        }
        g.events.push_back(e);
        drop(g);
        drop(slots);
        slot.cv.notify_all();
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        let t = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(t) = t {
            if t.thread().id() != std::thread::current().id() {
                let _ = t.join();
            }
        }
    }
}

fn cm_thread(w: Weak<Shared>) {
    loop {
        let Some(sh) = w.upgrade() else { return };
        if sh.stop.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        let mut p = libc::pollfd {
            fd: sh.chan.fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one pollfd of a descriptor `sh` keeps open.
        let n = unsafe { libc::poll(&mut p, 1, 100) };
        if n > 0 {
            while let Ok(Some(e)) = sh.chan.get_event() {
                sh.dispatch(e);
            }
        }
    }
}

/// One rdma_cm event channel and the thread that reads it. Listeners and
/// connections made from it keep it alive.
#[derive(Clone)]
pub struct ConnectionManager {
    sh: Arc<Shared>,
}

impl std::fmt::Debug for ConnectionManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectionManager")
            .field("fd", &self.sh.chan.fd())
            .finish()
    }
}

impl ConnectionManager {
    /// A new event channel and its CM thread.
    ///
    /// # Errors
    /// `rdma_create_event_channel` failed (no rdma_cm on this machine).
    pub fn new() -> Result<ConnectionManager, CmError> {
        let chan = EventChannel::new().map_err(call("rdma_create_event_channel"))?;
        let sh = Arc::new(Shared {
            chan,
            slots: Mutex::new(HashMap::new()),
            stop: std::sync::atomic::AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let w = Arc::downgrade(&sh);
        let t = std::thread::Builder::new()
            .name("cqd-cm".into())
            .spawn(move || cm_thread(w))
            .map_err(|e| CmError::Call {
                call: "spawning the CM thread",
                errno: e.raw_os_error().unwrap_or(libc::EAGAIN),
            })?;
        *sh.thread.lock().unwrap_or_else(|e| e.into_inner()) = Some(t);
        Ok(ConnectionManager { sh })
    }

    /// Listen on `addr` (`0.0.0.0:port` for every local address; port 0
    /// picks one, see [`Listener::local_addr`]).
    ///
    /// # Errors
    /// Binding (address not local, port in use) or listening failed.
    pub fn listen(&self, addr: SocketAddr, backlog: i32) -> Result<Listener, CmError> {
        let id = self.sh.chan.create_id().map_err(call("rdma_create_id"))?;
        let slot = self.sh.add(id);
        let r = sys_cm::id::bind(id, &addr)
            .map_err(call("rdma_bind_addr"))
            .and_then(|()| sys_cm::id::listen(id, backlog).map_err(call("rdma_listen")));
        if let Err(e) = r {
            self.sh.forget(id);
            return Err(e);
        }
        Ok(Listener {
            id,
            slot,
            sh: Arc::clone(&self.sh),
        })
    }

    /// Connect `qp` (cqd's, in RESET) to the listener at `dst`: resolve
    /// the address and route, send the request, and on the reply move the
    /// QP to RTS and confirm.
    ///
    /// # Errors
    /// [`CmError::Rejected`] (nobody listens, or the peer refused),
    /// [`CmError::Unreachable`], [`CmError::Resolve`], [`CmError::Timeout`],
    /// a refused QP transition. The QP is dropped with the error.
    pub fn connect(
        &self,
        dst: SocketAddr,
        qp: impl Into<Arc<Qp>>,
        p: &CmParams,
    ) -> Result<Connection, CmError> {
        let id = self.sh.chan.create_id().map_err(call("rdma_create_id"))?;
        let slot = self.sh.add(id);
        let mut conn = Connection {
            id: Some(id),
            slot,
            qp: qp.into(),
            sh: Arc::clone(&self.sh),
            peer_private_data: Vec::new(),
            peer: None,
            closed: false,
        };
        conn.active(dst, p)?;
        Ok(conn)
    }
}

/// A listening id.
pub struct Listener {
    id: NonNull<rdma_cm_id>,
    slot: Arc<Slot>,
    sh: Arc<Shared>,
}

// SAFETY: the id is used through librdmacm calls, which are thread-safe;
// its events are read by the CM thread only.
unsafe impl Send for Listener {}
// SAFETY: as above.
unsafe impl Sync for Listener {}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("addr", &self.local_addr())
            .finish()
    }
}

impl Listener {
    /// The address and port listened on.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        sys_cm::id::local_addr(self.id)
    }

    /// The next connection request, within `timeout`.
    ///
    /// # Errors
    /// [`CmError::Timeout`].
    pub fn next_request(&self, timeout: Duration) -> Result<ConnRequest, CmError> {
        let end = Instant::now() + timeout;
        let mut g = self.slot.lock();
        loop {
            if let Some(e) = g.requests.pop_front() {
                // The slot's lock is released before the map's is taken
                // (the CM thread takes the map's, then a slot's).
                drop(g);
                let id = NonNull::new(e.id as *mut rdma_cm_id).ok_or(CmError::Unexpected {
                    event: e.kind,
                    status: e.status,
                    wanted: "a request with an id",
                })?;
                let slot = self.sh.slots().get(&e.key).cloned().unwrap_or_default();
                return Ok(ConnRequest {
                    id: Some(id),
                    slot,
                    sh: Arc::clone(&self.sh),
                    private_data: e.private_data,
                    peer_qpn: e.peer_qpn,
                });
            }
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CmError::Timeout("a connection request"));
            }
            g = self
                .slot
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        // Out of the map first: no request is queued after this. Those
        // queued before are refused, as dropping a request does.
        self.sh.forget(self.id);
        let queued = std::mem::take(&mut self.slot.lock().requests);
        for e in queued {
            if let Some(id) = NonNull::new(e.id as *mut rdma_cm_id) {
                let _ = sys_cm::id::reject(id, &[]);
                self.sh.forget(id);
            }
        }
    }
}

/// A connection request, to accept or reject (dropping it rejects).
pub struct ConnRequest {
    id: Option<NonNull<rdma_cm_id>>,
    slot: Arc<Slot>,
    sh: Arc<Shared>,
    private_data: Vec<u8>,
    peer_qpn: u32,
}

// SAFETY: as for Listener.
unsafe impl Send for ConnRequest {}

impl std::fmt::Debug for ConnRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnRequest")
            .field("peer_qpn", &self.peer_qpn)
            .field("private_data_len", &self.private_data.len())
            .finish()
    }
}

impl ConnRequest {
    /// The requester's private data (rdma_cm pads it to the REQ's 56
    /// bytes).
    pub fn private_data(&self) -> &[u8] {
        &self.private_data
    }

    /// The requester's QP number.
    pub fn peer_qpn(&self) -> u32 {
        self.peer_qpn
    }

    /// The requester's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.id.and_then(sys_cm::id::peer_addr)
    }

    /// Accept with `qp` (cqd's, in RESET): INIT → RTR → RTS from the CM's
    /// attributes, `rdma_accept`, then wait for ESTABLISHED.
    ///
    /// # Errors
    /// A refused transition, the accept refused (the requester gave up), no
    /// ESTABLISHED in time, or the requester's rejection.
    pub fn accept(mut self, qp: impl Into<Arc<Qp>>, p: &CmParams) -> Result<Connection, CmError> {
        let id = self.id.take().ok_or(CmError::Timeout("an id"))?;
        let mut conn = Connection {
            id: Some(id),
            slot: Arc::clone(&self.slot),
            qp: qp.into(),
            sh: Arc::clone(&self.sh),
            peer_private_data: std::mem::take(&mut self.private_data),
            peer: None,
            closed: false,
        };
        conn.slot.lock().qp = Some(Arc::downgrade(&conn.qp));
        for (state, what) in [
            (rdma_sys::ibv_qp_state::IBV_QPS_INIT, "ibv_modify_qp(INIT)"),
            (rdma_sys::ibv_qp_state::IBV_QPS_RTR, "ibv_modify_qp(RTR)"),
            (rdma_sys::ibv_qp_state::IBV_QPS_RTS, "ibv_modify_qp(RTS)"),
        ] {
            conn.transition(state, what, p.qp_access)?;
        }
        sys_cm::id::accept(id, &conn.param(p)).map_err(call("rdma_accept"))?;
        let e = conn.slot.next(p.timeout, "ESTABLISHED")?;
        conn.expect(e, ev::RDMA_CM_EVENT_ESTABLISHED, "ESTABLISHED")?;
        conn.peer = sys_cm::id::peer_addr(id);
        Ok(conn)
    }

    /// Refuse with private data (the requester sees REJECTED, reason 28).
    ///
    /// # Errors
    /// `rdma_reject` failed (the requester already gave up).
    pub fn reject(mut self, private_data: &[u8]) -> Result<(), CmError> {
        let id = self.id.take().ok_or(CmError::Timeout("an id"))?;
        let r = sys_cm::id::reject(id, private_data).map_err(call("rdma_reject"));
        self.sh.forget(id);
        r
    }
}

impl Drop for ConnRequest {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let _ = sys_cm::id::reject(id, &[]);
            self.sh.forget(id);
        }
    }
}

/// An established connection: cqd's QP, connected through the CM.
pub struct Connection {
    id: Option<NonNull<rdma_cm_id>>,
    slot: Arc<Slot>,
    qp: Arc<Qp>,
    sh: Arc<Shared>,
    peer_private_data: Vec<u8>,
    peer: Option<SocketAddr>,
    closed: bool,
}

// SAFETY: as for Listener; the QP is Send + Sync.
unsafe impl Send for Connection {}
// SAFETY: as above.
unsafe impl Sync for Connection {}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("qpn", &self.qp.qpn())
            .field("peer", &self.peer)
            .field("disconnected", &self.is_disconnected())
            .finish()
    }
}

/// What a disconnect found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Drained {
    /// The peer disconnected first (its DREQ, or its process died).
    pub by_peer: bool,
    /// Requests that were outstanding when the QP went to the error state
    /// from this call (0 if the CM thread had already flushed it).
    pub flushed: usize,
}

impl Connection {
    fn param<'a>(&self, p: &'a CmParams) -> sys_cm::Param<'a> {
        sys_cm::Param {
            qpn: self.qp.qpn(),
            private_data: &p.private_data,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            retry_count: p.retry_count.min(7),
            rnr_retry_count: p.rnr_retry_count.min(7),
        }
    }

    fn transition(
        &self,
        state: u32,
        what: &'static str,
        access: Option<crate::Access>,
    ) -> Result<(), CmError> {
        let id = self.id.ok_or(CmError::Timeout("an id"))?;
        let (mut a, mut mask) =
            sys_cm::id::init_qp_attr(id, state).map_err(call("rdma_init_qp_attr"))?;
        if let (Some(access), rdma_sys::ibv_qp_state::IBV_QPS_INIT) = (access, state) {
            a.qp_access_flags = access.0;
            mask |= rdma_sys::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
        }
        self.qp.modify(&mut a, mask, what)?;
        Ok(())
    }

    fn expect(&self, e: sys_cm::Event, want: u32, wanted: &'static str) -> Result<(), CmError> {
        if e.kind == want && e.status == 0 {
            return Ok(());
        }
        Err(match e.kind {
            ev::RDMA_CM_EVENT_REJECTED => CmError::Rejected {
                status: e.status,
                private_data: e.private_data,
            },
            ev::RDMA_CM_EVENT_UNREACHABLE => CmError::Unreachable { status: e.status },
            ev::RDMA_CM_EVENT_ADDR_ERROR => CmError::Resolve {
                what: "address",
                status: e.status,
            },
            ev::RDMA_CM_EVENT_ROUTE_ERROR => CmError::Resolve {
                what: "route",
                status: e.status,
            },
            k => CmError::Unexpected {
                event: k,
                status: e.status,
                wanted,
            },
        })
    }

    fn active(&mut self, dst: SocketAddr, p: &CmParams) -> Result<(), CmError> {
        let id = self.id.ok_or(CmError::Timeout("an id"))?;
        let ms = p.timeout.as_millis().min(i32::MAX as u128) as i32;
        sys_cm::id::resolve_addr(id, &dst, ms).map_err(call("rdma_resolve_addr"))?;
        let e = self.slot.next(p.timeout, "ADDR_RESOLVED")?;
        self.expect(e, ev::RDMA_CM_EVENT_ADDR_RESOLVED, "ADDR_RESOLVED")?;
        sys_cm::id::resolve_route(id, ms).map_err(call("rdma_resolve_route"))?;
        let e = self.slot.next(p.timeout, "ROUTE_RESOLVED")?;
        self.expect(e, ev::RDMA_CM_EVENT_ROUTE_RESOLVED, "ROUTE_RESOLVED")?;
        sys_cm::id::connect(id, &self.param(p)).map_err(call("rdma_connect"))?;
        let e = self.slot.next(p.timeout, "the reply")?;
        let pdata = e.private_data.clone();
        self.expect(e, ev::RDMA_CM_EVENT_CONNECT_RESPONSE, "CONNECT_RESPONSE")?;
        self.slot.lock().qp = Some(Arc::downgrade(&self.qp));
        for (state, what) in [
            (rdma_sys::ibv_qp_state::IBV_QPS_INIT, "ibv_modify_qp(INIT)"),
            (rdma_sys::ibv_qp_state::IBV_QPS_RTR, "ibv_modify_qp(RTR)"),
            (rdma_sys::ibv_qp_state::IBV_QPS_RTS, "ibv_modify_qp(RTS)"),
        ] {
            if let Err(err) = self.transition(state, what, p.qp_access) {
                let _ = sys_cm::id::reject(id, &[]);
                return Err(err);
            }
        }
        sys_cm::id::establish(id).map_err(call("rdma_establish"))?;
        self.peer_private_data = pdata;
        self.peer = sys_cm::id::peer_addr(id);
        Ok(())
    }

    /// The connection's QP: post on it through the registration, as on any
    /// cqd QP.
    pub fn qp(&self) -> &Qp {
        &self.qp
    }

    /// The peer's private data (its REQ or REP, padded by rdma_cm).
    pub fn peer_private_data(&self) -> &[u8] {
        &self.peer_private_data
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer
    }

    /// Whether the CM reported the connection gone.
    pub fn is_disconnected(&self) -> bool {
        self.slot.lock().disconnected
    }

    /// Wait up to `timeout` for the peer's disconnect.
    pub fn wait_disconnected(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut g = self.slot.lock();
        while !g.disconnected {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            g = self
                .slot
                .cv
                .wait_timeout(g, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Disconnect and drain: `rdma_disconnect`, the QP to the error state
    /// (every outstanding request flushes), then wait — up to `timeout` —
    /// until the poller retired every request of the QP and the CM
    /// confirmed the disconnect. Works as well after the peer
    /// disconnected first.
    ///
    /// # Errors
    /// [`CmError::DrainTimeout`] with what is still outstanding,
    /// [`CmError::Timeout`] if the CM never confirmed.
    pub fn disconnect(mut self, timeout: Duration) -> Result<Drained, CmError> {
        self.closed = true;
        let id = self.id.ok_or(CmError::Timeout("an id"))?;
        let (by_peer, flushed_by_peer) = {
            let g = self.slot.lock();
            (g.disconnected, g.peer_flushed)
        };
        // EINVAL here means the CM already finished (both sides sent
        // theirs): nothing to send.
        let _ = sys_cm::id::disconnect(id);
        let flushed = if flushed_by_peer {
            0
        } else {
            let n = self.qp.outstanding();
            self.qp.to_error()?;
            n
        };
        let end = Instant::now() + timeout;
        while self.qp.outstanding() > 0 {
            if Instant::now() >= end {
                return Err(CmError::DrainTimeout {
                    qpn: self.qp.qpn(),
                    outstanding: self.qp.outstanding(),
                });
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        if !self.wait_disconnected(end.saturating_duration_since(Instant::now())) {
            return Err(CmError::Timeout("the CM's disconnect"));
        }
        Ok(Drained { by_peer, flushed })
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        if !self.closed {
            let _ = sys_cm::id::disconnect(id);
            let _ = self.qp.to_error();
        }
        self.sh.forget(id);
    }
}
