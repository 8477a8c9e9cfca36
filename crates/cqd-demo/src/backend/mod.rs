//! The transport under the demo: what the server and the load generator
//! need from an RDMA device, and nothing more.
//!
//! The demo's logic (handlers, workers, the verifier) is written once
//! against three traits:
//!
//! - [`Node`]: one device and protection domain (a server, or the load
//!   generator): makes dispatched CQs, registered [`Region`]s and RC
//!   [`Link`]s (queue pairs).
//! - [`Region`]: a registered buffer the node owns; its bytes are copied in
//!   and out (never borrowed: the NIC may write it at any time), and it can
//!   be named to a peer ([`Region::remote`]).
//! - [`Link`]: one RC queue pair: an [`Endpoint`](Link::Endpoint) to hand
//!   to the peer, `connect` with the peer's, and posting through a cqd
//!   [`Registration`] only (the posting call keeps every account).
//!
//! `sim` implements them on cqd-sim (every node on one simulated fabric,
//! endpoints exchanged in-process). `verbs` (cargo feature `verbs`) maps
//! them one to one onto cqd-verbs: `Node` = a `Pd` on an open `Context`
//! (`create_dispatched_cq`, `reg_mr`, `create_qp`), `Region` = `Mr`
//! (`read`/`write`/`remote`, bounds checked first), `Link` = `Qp`
//! (`endpoint`/`connect`, `SendWr::new(tag, WrOp::…, &[mr.sge(off, len)])`
//! through `Registration::post_send`/`post_recv`), `Endpoint` = its serde
//! `Endpoint`, exchanged over TCP by `serve`/`load` (`crate::net`).

pub mod cm;
pub mod sim;
#[cfg(feature = "verbs")]
pub mod verbs;

use std::fmt::Debug;
use std::time::Duration;

use cqd_core::{CqHandle, CqOptions, Registration, UnboundCq};

/// A peer's buffer: what a request names for one-sided RDMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct Remote {
    /// The address in the peer's region.
    pub addr: u64,
    /// The peer region's remote key.
    pub rkey: u32,
}

/// The error of a window operation on a backend without windows.
pub(crate) fn no_windows() -> BackendError {
    BackendError::new(
        "memory windows",
        "this backend or device has no type-2 memory windows",
    )
}

/// A send-side operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// SEND the local bytes (consumes a receive on the peer).
    Send,
    /// RDMA WRITE the local bytes to the peer's buffer.
    Write(Remote),
    /// RDMA READ the peer's buffer into the local bytes.
    Read(Remote),
    /// Bind the link's memory window `slot` over the op's bytes, granting
    /// the peer `grant` ([`Link::open_windows`]).
    Bind {
        /// The window (a request slot).
        slot: u32,
        /// What the peer may do there.
        grant: Grant,
    },
    /// Invalidate the link's memory window `slot`.
    Invalidate {
        /// The window (a request slot).
        slot: u32,
    },
}

/// What a memory window lets the peer do to the buffer it is bound over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// RDMA READ it (the buffer of a write request).
    Read,
    /// RDMA WRITE it (the buffer of a read request).
    Write,
}

/// One send-side work request: `verb` on `len` bytes at `offset` of
/// `region`, with the handler's `tag` (at most 2^24 − 1).
#[derive(Debug)]
pub struct Op<'a, R> {
    /// Comes back in the completion.
    pub tag: u32,
    /// What to do.
    pub verb: Verb,
    /// The local memory.
    pub region: &'a R,
    /// Where in it.
    pub offset: u64,
    /// How many bytes.
    pub len: u32,
    /// Whether a success produces a completion (errors always do).
    pub signaled: bool,
}

/// Who may reach a region or a link's queue pair besides its node: the
/// least a role needs (issue "least privilege").
///
/// - The server moves every block itself (RDMA WRITE into the load's
///   buffer, RDMA READ from it), so its device region, its message buffers
///   and its QPs are [`Local`](Exposure::Local): no peer can read or write
///   them, and no key to them leaves the process.
/// - The load's buffers are what the server reaches: on a device with
///   type-2 memory windows they are [`Windows`](Exposure::Windows) (the
///   server reaches one buffer per request, through a window bound for
///   that request alone), elsewhere [`Peer`](Exposure::Peer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exposure {
    /// Local access only (the node's own requests and receives).
    Local,
    /// A connected peer may also RDMA READ and WRITE it, with the
    /// region's own key, for as long as it is registered.
    Peer,
    /// A connected peer reaches it only through memory windows bound per
    /// request: the region has local write and window binding and no
    /// remote access of its own; the QP takes the remote read and write
    /// windows may grant. (The simulator has no windows: there it is
    /// [`Peer`](Exposure::Peer).)
    Windows,
}

/// Queue depths of a link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depths {
    /// Send queue.
    pub send: u32,
    /// Receive queue.
    pub recv: u32,
}

/// What a backend call refused, in words.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct BackendError {
    /// What was being done ("post a receive on QP 12").
    pub what: String,
    /// The backend's error.
    #[source]
    pub source: Box<dyn std::error::Error + Send + Sync>,
}

impl BackendError {
    /// Wraps `source` with what was being done.
    pub fn new(
        what: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        BackendError {
            what: what.into(),
            source: source.into(),
        }
    }
}

/// A registered buffer owned by a node.
pub trait Region: Send + Sync + Debug + 'static {
    /// Its size in bytes.
    fn len(&self) -> u64;
    /// True for an empty region.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies `out.len()` bytes at `offset` out.
    ///
    /// # Errors
    /// Out of bounds.
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError>;
    /// Copies `data` in at `offset`.
    ///
    /// # Errors
    /// Out of bounds.
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError>;
    /// The address of `offset` for a peer's one-sided requests.
    fn remote(&self, offset: u64) -> Remote;
}

/// One RC queue pair.
pub trait Link: Send + Sync + Debug + 'static {
    /// The node's region type.
    type Region: Region;
    /// What the peer needs to connect (serde: a verbs backend sends it
    /// over TCP).
    type Endpoint: Clone + Debug + Send + serde::Serialize + serde::de::DeserializeOwned;

    /// The QP number (for traces and reports).
    fn qpn(&self) -> u32;
    /// This side's endpoint.
    ///
    /// # Errors
    /// The device refused.
    fn endpoint(&self) -> Result<Self::Endpoint, BackendError>;
    /// Connects to the peer's endpoint (RESET → INIT → RTR → RTS).
    ///
    /// # Errors
    /// The device refused a transition.
    fn connect(&self, peer: &Self::Endpoint) -> Result<(), BackendError>;
    /// Posts one receive of `len` bytes at `offset` of `region`, through
    /// `reg`'s posting call.
    ///
    /// # Errors
    /// The post was refused (nothing was posted).
    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &Self::Region,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError>;
    /// Posts `ops` in order, through `reg`'s posting call.
    ///
    /// # Errors
    /// The post was refused; the sim posts all or nothing, verbs may have
    /// posted a prefix (accounted as posted: its completions will come).
    fn post_send(
        &self,
        reg: &Registration,
        ops: &[Op<'_, Self::Region>],
    ) -> Result<(), BackendError>;
    /// Moves the QP to the error state: every outstanding request comes
    /// back flushed.
    fn to_error(&self);

    /// Closes the QP (cqd's `Qp::close`): to the error state, its flushes
    /// and, on an SRQ, its last receive accounted by the pollers, then
    /// destroyed, its admission on the CQ given back; waits for that, at
    /// most `timeout`.
    ///
    /// # Errors
    /// The close did not end in time (it goes on), naming what it waits
    /// for; or the QP is still shared (an rdma_cm connection holds it).
    fn close(self, timeout: Duration) -> Result<(), BackendError>
    where
        Self: Sized;

    /// Allocates `count` memory windows on this link, one per request
    /// slot, for [`Verb::Bind`] and [`Verb::Invalidate`].
    ///
    /// # Errors
    /// The backend or the device has no type-2 windows
    /// ([`Node::has_windows`] says so first), or refused.
    fn open_windows(&self, count: u32) -> Result<(), BackendError> {
        let _ = count;
        Err(no_windows())
    }

    /// What the next bind of window `slot` over `offset` of `region` will
    /// give the peer (its address and the window's next key); `None`
    /// without windows.
    fn window_remote(&self, slot: u32, region: &Self::Region, offset: u64) -> Option<Remote> {
        let _ = (slot, region, offset);
        None
    }

    /// Connect through rdma_cm to the listener at `dst` as the session's
    /// connection `conn`, with the session's `mac` of the request
    /// (`--cm rdmacm`; [`cm::request_data`]); only the verbs backend has
    /// it.
    ///
    /// # Errors
    /// No rdma_cm in this backend, the peer refused or is unreachable.
    fn cm_connect(
        &self,
        dst: std::net::SocketAddr,
        conn: u32,
        mac: &[u8; crate::auth::CM_MAC_LEN],
    ) -> Result<(), BackendError> {
        let _ = (dst, conn, mac);
        Err(cm::unsupported("connect through rdma_cm"))
    }

    /// Accept a request the server's rdma_cm listener took, on this link.
    ///
    /// # Errors
    /// No rdma_cm in this backend, the requester gave up.
    fn cm_accept(&self, req: cm::PendingCm) -> Result<(), BackendError> {
        let _ = req;
        Err(cm::unsupported("accept through rdma_cm"))
    }
}

/// A shared receive queue: one pool of receive buffers for every link
/// made on it ([`Node::create_link_on_srq`]).
pub trait SharedRq: Send + Sync + Debug + 'static {
    /// The node's region type.
    type Region: Region;

    /// The SRQ's number (what a CQ's admission counts it by).
    fn srqn(&self) -> u32;
    /// The receives it holds (what a CQ's admission reserves for it).
    fn depth(&self) -> u32;
    /// Posts one receive of `len` bytes at `offset` of `region`, through
    /// `reg`'s posting call (the SRQ's handler).
    ///
    /// # Errors
    /// The post was refused (nothing was posted).
    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &Self::Region,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError>;
}

/// One device and protection domain.
pub trait Node: Send + Sync + Debug + 'static {
    /// A CQ's backend side (QPs are created on it).
    type Cq: Send + Sync + Debug + 'static;
    /// Registered buffers.
    type Region: Region;
    /// Queue pairs.
    type Link: Link<Region = Self::Region>;
    /// Shared receive queues.
    type Srq: SharedRq<Region = Self::Region>;

    /// The node's name.
    fn name(&self) -> &str;
    /// The largest CQ the device makes.
    fn max_cqe(&self) -> u32;
    /// True when links can bind type-2 memory windows
    /// ([`Link::open_windows`]).
    fn has_windows(&self) -> bool {
        false
    }
    /// The deepest queue the device makes.
    fn max_qp_wr(&self) -> u32;
    /// The deepest SRQ the device makes.
    fn max_srq_wr(&self) -> u32;
    /// True when a QP on an SRQ must be destroyed before the stop can hand
    /// back the SRQ's receives: the device raises no
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` (rxe; cqd-verbs'
    /// `Teardown::DestroyThenQuiesce`), so the error state alone does not
    /// say that a QP takes no more of them.
    fn stop_closes_srq_users(&self) -> bool {
        false
    }
    /// A CQ of `depth` entries with its poller's two halves (budget and
    /// ledger attached).
    ///
    /// # Errors
    /// The device refused.
    #[allow(clippy::type_complexity)]
    fn create_cq<W: Send + 'static>(
        &self,
        name: &str,
        depth: u32,
        options: CqOptions,
    ) -> Result<(Self::Cq, UnboundCq<W>, CqHandle<W>), BackendError>;
    /// A zeroed region of `len` bytes, local write, and remote read and
    /// write when `exposure` is [`Exposure::Peer`].
    ///
    /// # Errors
    /// The device refused (too large).
    fn reg_region(&self, len: u64, exposure: Exposure) -> Result<Self::Region, BackendError>;
    /// An RC QP whose send and receive completions both go to `cq`; its
    /// peer may RDMA READ and WRITE through it only when `exposure` is
    /// [`Exposure::Peer`].
    ///
    /// # Errors
    /// The device refused (admission on the CQ, depths).
    fn create_link(
        &self,
        cq: &Self::Cq,
        depths: Depths,
        exposure: Exposure,
    ) -> Result<Self::Link, BackendError>;
    /// An SRQ of `depth` receives of one gather entry.
    ///
    /// # Errors
    /// The device refused (too deep).
    fn create_srq(&self, depth: u32) -> Result<Self::Srq, BackendError>;
    /// An RC QP whose send completions and whose receives' completions go
    /// to `cq`, its receives taken from `srq` (no receive queue of its
    /// own); exposure as [`create_link`](Node::create_link). Its
    /// asynchronous events (the error state it enters when a peer's
    /// request breaks it, which no completion of its own shows: its
    /// receives are the SRQ's) go to `owner`'s `on_async` where the
    /// backend has them (verbs).
    ///
    /// # Errors
    /// The device refused (admission on the CQ, an SRQ of another CQ).
    fn create_link_on_srq(
        &self,
        cq: &Self::Cq,
        send_depth: u32,
        srq: &Self::Srq,
        exposure: Exposure,
        owner: &Registration,
    ) -> Result<Self::Link, BackendError>;
}
