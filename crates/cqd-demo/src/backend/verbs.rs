//! The backend on cqd-verbs: real RDMA through libibverbs (a NIC, or
//! softverbs under `softverbs-run`).
//!
//! A node is a protection domain on an open device (nodes of one process
//! share the device's `Context`); a region is an `Mr`; a link is an RC `Qp`
//! whose send and receive completions go to one CQ; its endpoint is
//! cqd-verbs' serde `Endpoint` (LID, GID, QPN, PSN, MTU), exchanged over
//! TCP by `serve` / `load` (or in memory by a one-process run).
//!
//! Bounds are checked here before `Mr::read` / `write` / `sge`, which panic
//! on a range outside the region (a programming error there; here the
//! offsets come from requests, so they are errors).

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cqd_core::{CqHandle, CqOptions, Registration, UnboundCq};
use cqd_verbs::{
    Access, ConnectOptions, Context, Cq, CqSpec, Endpoint, Mr, Pd, Qp, QpCap, QpInit, RecvWr,
    RemoteAddr, SendWr, Sge, Srq, SrqInit, WrOp,
};

use super::{
    BackendError, Depths, Exposure, Grant, Link, Node, Op, Region, Remote, SharedRq, Verb,
};

/// How links of this process connect: the port and, for RoCE or routed
/// InfiniBand, the GID index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct VerbsOptions {
    /// The local port (1 when `None`).
    pub port: Option<u8>,
    /// The GID index for a global route (RoCE needs one; InfiniBand in one
    /// subnet does not).
    pub gid_index: Option<u8>,
    /// Transport retries of every RC QP, 0-7 (`None`: cqd-verbs' default,
    /// 7, which the kernel's rxe takes as retrying for ever).
    pub retry_cnt: Option<u8>,
}

impl VerbsOptions {
    fn connect_options(self) -> ConnectOptions {
        ConnectOptions {
            port: self.port.unwrap_or(1),
            gid_index: self.gid_index,
            retry_cnt: self
                .retry_cnt
                .unwrap_or(ConnectOptions::default().retry_cnt),
            ..ConnectOptions::default()
        }
    }
}

/// An open RDMA device, from which nodes are made.
#[derive(Debug, Clone)]
pub struct VerbsDevice {
    ctx: Context,
    options: VerbsOptions,
}

impl VerbsDevice {
    /// Opens the device `name` (`None`: the first one libibverbs lists)
    /// and checks its port.
    ///
    /// # Errors
    /// No such device (cqd-verbs' `NoDevice`, naming the devices seen), or
    /// the port cannot be queried.
    pub fn open(name: Option<&str>, options: VerbsOptions) -> Result<VerbsDevice, BackendError> {
        let ctx = match name {
            Some(n) => Context::open(n),
            None => Context::open_first(),
        }
        .map_err(|e| BackendError::new("open the RDMA device", e))?;
        let port = options.port.unwrap_or(1);
        let info = ctx
            .port(port)
            .map_err(|e| BackendError::new(format!("query port {port} of {}", ctx.name()), e))?;
        if !info.active {
            tracing::warn!(device = ctx.name(), port, "the port is not active");
        }
        Ok(VerbsDevice { ctx, options })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        self.ctx.name()
    }

    /// A node (a new protection domain) called `name`.
    ///
    /// # Errors
    /// `ibv_alloc_pd` failed.
    pub fn node(&self, name: &str) -> Result<VerbsNode, BackendError> {
        let pd = self
            .ctx
            .alloc_pd()
            .map_err(|e| BackendError::new(format!("protection domain for {name}"), e))?;
        Ok(VerbsNode {
            name: name.to_string(),
            ctx: self.ctx.clone(),
            pd,
            connect: self.options.connect_options(),
        })
    }
}

/// A protection domain on a verbs device.
#[derive(Debug)]
pub struct VerbsNode {
    name: String,
    ctx: Context,
    pd: Pd,
    connect: ConnectOptions,
}

/// A registered memory region.
#[derive(Debug)]
pub struct VerbsRegion(Mr);

/// An RC queue pair.
#[derive(Debug)]
pub struct VerbsLink {
    qp: std::sync::Arc<Qp>,
    psn: u32,
    connect: ConnectOptions,
    /// The rdma_cm connection (`--cm rdmacm`); dropped with the link.
    cm: std::sync::Mutex<Option<cqd_verbs::cm::Connection>>,
    /// Memory windows, one per request slot ([`Link::open_windows`]).
    windows: std::sync::OnceLock<Vec<cqd_verbs::Window>>,
}

/// The process's rdma_cm connection manager (one event channel and CM
/// thread for every link), made at first use.
pub(crate) fn cm_manager() -> Result<&'static cqd_verbs::cm::ConnectionManager, BackendError> {
    static CM: std::sync::OnceLock<cqd_verbs::cm::ConnectionManager> = std::sync::OnceLock::new();
    if let Some(cm) = CM.get() {
        return Ok(cm);
    }
    let made = cqd_verbs::cm::ConnectionManager::new()
        .map_err(|e| BackendError::new("open rdma_cm (an event channel)", e))?;
    Ok(CM.get_or_init(|| made))
}

/// One receive of `len` bytes at `offset` of `region` on `queue` (a QP's
/// own receive queue or an SRQ), through `reg`'s posting call; `what`
/// names it in an error.
fn post_one_recv<Q>(
    reg: &Registration,
    queue: &Q,
    tag: u32,
    region: &VerbsRegion,
    offset: u64,
    len: u32,
    what: impl FnOnce() -> String,
) -> Result<(), BackendError>
where
    Q: cqd_core::PostRecv + ?Sized,
    for<'a> Q: cqd_core::PostRecv<Wr<'a> = RecvWr<'a>>,
    Q::Error: std::error::Error + Send + Sync + 'static,
{
    let sge = [region.sge(offset, len)?];
    reg.post_recv(queue, &mut [RecvWr::new(u64::from(tag), &sge)])
        .map_err(|e| BackendError::new(what(), e))
}

/// A shared receive queue.
#[derive(Debug)]
pub struct VerbsSrq(Srq);

impl SharedRq for VerbsSrq {
    type Region = VerbsRegion;

    fn srqn(&self) -> u32 {
        self.0.number()
    }

    fn depth(&self) -> u32 {
        self.0.depth()
    }

    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &VerbsRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        post_one_recv(reg, &self.0, tag, region, offset, len, || {
            format!("post a receive on SRQ {}", self.0.number())
        })
    }
}

impl VerbsLink {
    /// The queue pair (its state, outstanding requests).
    pub fn qp(&self) -> &Qp {
        &self.qp
    }
}

impl VerbsRegion {
    /// `offset..offset + len` as a `usize` range inside the region.
    fn range(&self, offset: u64, len: usize) -> Result<usize, BackendError> {
        let size = self.0.len();
        match usize::try_from(offset) {
            Ok(start) if start.checked_add(len).is_some_and(|end| end <= size) => Ok(start),
            _ => Err(BackendError::new(
                "a memory region access",
                format!("{len} bytes at offset {offset} are outside the {size}-byte region"),
            )),
        }
    }

    fn sge(&self, offset: u64, len: u32) -> Result<Sge<'_>, BackendError> {
        let start = self.range(offset, len as usize)?;
        Ok(self.0.sge(start, len))
    }
}

impl Region for VerbsRegion {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        let start = self.range(offset, out.len())?;
        self.0.read(start, out);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        let start = self.range(offset, data.len())?;
        self.0.write(start, data);
        Ok(())
    }

    fn remote(&self, offset: u64) -> Remote {
        // Computed, not `Mr::remote` (which panics out of range): a wrong
        // address is the peer's to refuse with a remote access error.
        Remote {
            addr: self.0.addr().wrapping_add(offset),
            rkey: self.0.rkey(),
        }
    }
}

/// The scatter/gather entry of `op`.
fn verbs_sge<'a>(op: &Op<'a, VerbsRegion>) -> Result<[Sge<'a>; 1], BackendError> {
    Ok([op.region.sge(op.offset, op.len)?])
}

/// The verbs work request of `op`, gathering `sge` (a bind: over it);
/// `windows` are the link's.
fn verbs_wr<'a>(
    op: &Op<'_, VerbsRegion>,
    sge: &'a [Sge<'a>; 1],
    windows: &'a [cqd_verbs::Window],
) -> Result<SendWr<'a>, BackendError> {
    let tag = u64::from(op.tag);
    let window = |slot: u32| {
        windows.get(slot as usize).ok_or_else(|| {
            BackendError::new(
                format!("window {slot}"),
                format!("the link has {} windows", windows.len()),
            )
        })
    };
    let wr = match op.verb {
        Verb::Send => SendWr::new(tag, WrOp::Send, sge),
        Verb::Write(r) => SendWr::new(tag, WrOp::Write(remote_of(r)), sge),
        Verb::Read(r) => SendWr::new(tag, WrOp::Read(remote_of(r)), sge),
        Verb::Bind { slot, grant } => {
            let access = match grant {
                Grant::Read => Access::REMOTE_READ,
                Grant::Write => Access::REMOTE_WRITE,
            };
            SendWr::bind(tag, window(slot)?, sge[0], access).0
        }
        Verb::Invalidate { slot } => SendWr::invalidate(tag, window(slot)?),
    };
    Ok(if op.signaled { wr } else { wr.unsignaled() })
}

fn remote_of(r: Remote) -> RemoteAddr {
    RemoteAddr {
        addr: r.addr,
        rkey: r.rkey,
    }
}

/// The access flags of a region of `exposure`: local write always
/// (receives, READ responses), remote read and write only for a peer that
/// names the region's key, window binding (and nothing remote) for one
/// reached through windows.
fn region_access(exposure: Exposure) -> Access {
    match exposure {
        Exposure::Local => Access::LOCAL_WRITE,
        Exposure::Peer => Access::ALL_RDMA,
        Exposure::Windows => Access::LOCAL_WRITE | Access::MW_BIND,
    }
}

/// The access flags of a QP of `exposure`: none remote for a local one,
/// remote read and write otherwise (through windows, the window decides
/// what is reachable).
fn qp_access(exposure: Exposure) -> Access {
    match exposure {
        Exposure::Local => Access::LOCAL_WRITE,
        Exposure::Peer | Exposure::Windows => Access::ALL_RDMA,
    }
}

/// A first packet sequence number: 24 bits, different per QP and run.
fn new_psn(qpn: u32) -> u32 {
    static N: AtomicU32 = AtomicU32::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let n = N.fetch_add(1, Ordering::Relaxed);
    (t ^ qpn.rotate_left(7) ^ n.wrapping_mul(0x9e37_79b9)) & 0xff_ffff
}

impl Link for VerbsLink {
    type Region = VerbsRegion;
    type Endpoint = Endpoint;

    fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    fn endpoint(&self) -> Result<Endpoint, BackendError> {
        self.qp
            .endpoint(&self.connect, self.psn)
            .map_err(|e| BackendError::new(format!("the endpoint of QP {}", self.qp.qpn()), e))
    }

    fn connect(&self, peer: &Endpoint) -> Result<(), BackendError> {
        self.qp.connect(peer, self.psn, &self.connect).map_err(|e| {
            BackendError::new(
                format!(
                    "connect QP {} to QP {} (LID {})",
                    self.qp.qpn(),
                    peer.qpn,
                    peer.lid
                ),
                e,
            )
        })
    }

    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &VerbsRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        post_one_recv(reg, &*self.qp, tag, region, offset, len, || {
            format!("post a receive on QP {}", self.qp.qpn())
        })
    }

    fn post_send(
        &self,
        reg: &Registration,
        ops: &[Op<'_, VerbsRegion>],
    ) -> Result<(), BackendError> {
        // The demo posts one or two requests at a time: those lists live
        // on the stack, not in two allocations per post.
        let w: &[cqd_verbs::Window] = self.windows.get().map_or(&[], Vec::as_slice);
        let posted = match ops {
            [a] => {
                let s = [verbs_sge(a)?];
                reg.post_send(&*self.qp, &mut [verbs_wr(a, &s[0], w)?])
            }
            [a, b] => {
                let s = [verbs_sge(a)?, verbs_sge(b)?];
                reg.post_send(
                    &*self.qp,
                    &mut [verbs_wr(a, &s[0], w)?, verbs_wr(b, &s[1], w)?],
                )
            }
            _ => {
                let sges = ops
                    .iter()
                    .map(verbs_sge)
                    .collect::<Result<Vec<[Sge<'_>; 1]>, BackendError>>()?;
                let mut wrs = ops
                    .iter()
                    .zip(&sges)
                    .map(|(op, s)| verbs_wr(op, s, w))
                    .collect::<Result<Vec<SendWr<'_>>, BackendError>>()?;
                reg.post_send(&*self.qp, &mut wrs)
            }
        };
        posted.map_err(|e| BackendError::new(format!("post on QP {}", self.qp.qpn()), e))
    }

    fn open_windows(&self, count: u32) -> Result<(), BackendError> {
        let made = (0..count)
            .map(|_| self.qp.alloc_window())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                BackendError::new(
                    format!("allocate {count} memory windows on QP {}", self.qp.qpn()),
                    e,
                )
            })?;
        self.windows.set(made).map_err(|_| {
            BackendError::new(
                format!("memory windows on QP {}", self.qp.qpn()),
                "opened already",
            )
        })
    }

    fn window_remote(&self, slot: u32, region: &VerbsRegion, offset: u64) -> Option<Remote> {
        let w = self.windows.get()?.get(slot as usize)?;
        Some(Remote {
            addr: region.remote(offset).addr,
            rkey: w.next_rkey(),
        })
    }

    fn cm_connect(
        &self,
        dst: std::net::SocketAddr,
        conn: u32,
        mac: &[u8; crate::auth::CM_MAC_LEN],
    ) -> Result<(), BackendError> {
        let cm = cm_manager()?;
        let params = cqd_verbs::cm::CmParams {
            private_data: super::cm::request_data(conn, mac),
            // The REQ carries it: both sides' QPs retry this often.
            retry_count: self.connect.retry_cnt,
            // This link's exposure, not rdma_cm's remote write and read.
            qp_access: Some(self.connect.access),
            ..cqd_verbs::cm::CmParams::default()
        };
        let c = cm
            .connect(dst, std::sync::Arc::clone(&self.qp), &params)
            .map_err(|e| {
                BackendError::new(
                    format!("connect QP {} to {dst} through rdma_cm", self.qp.qpn()),
                    e,
                )
            })?;
        *self.cm.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
        Ok(())
    }

    fn cm_accept(&self, req: super::cm::PendingCm) -> Result<(), BackendError> {
        let req = req
            .0
            .downcast::<cqd_verbs::cm::ConnRequest>()
            .map_err(|_| BackendError::new("accept through rdma_cm", "not an rdma_cm request"))?;
        let c = req
            .accept(
                std::sync::Arc::clone(&self.qp),
                &cqd_verbs::cm::CmParams {
                    // This link's exposure, not rdma_cm's remote write and
                    // read.
                    qp_access: Some(self.connect.access),
                    ..cqd_verbs::cm::CmParams::default()
                },
            )
            .map_err(|e| {
                BackendError::new(format!("accept on QP {} through rdma_cm", self.qp.qpn()), e)
            })?;
        *self.cm.lock().unwrap_or_else(|e| e.into_inner()) = Some(c);
        Ok(())
    }

    fn to_error(&self) {
        if let Err(e) = self.qp.to_error() {
            // A dead device refuses the transition; its requests fail by
            // the device's own rule (and the load's timeout).
            tracing::warn!(qpn = self.qp.qpn(), error = %e, "QP to error refused");
        }
    }

    fn close(self, timeout: Duration) -> Result<(), BackendError> {
        let qpn = self.qp.qpn();
        // The windows and the rdma_cm connection go first: the connection
        // holds the QP too.
        drop(self.windows);
        drop(self.cm);
        let qp = std::sync::Arc::try_unwrap(self.qp).map_err(|_| {
            BackendError::new(
                format!("close QP {qpn}"),
                "the QP is still shared: it is destroyed when its last holder lets it go",
            )
        })?;
        qp.close()
            .wait(timeout)
            .map_err(|e| BackendError::new(format!("close QP {qpn}"), e))
    }
}

impl Node for VerbsNode {
    type Cq = Cq;
    type Region = VerbsRegion;
    type Link = VerbsLink;
    type Srq = VerbsSrq;

    fn name(&self) -> &str {
        &self.name
    }

    fn max_cqe(&self) -> u32 {
        self.ctx.attr().max_cqe
    }

    fn has_windows(&self) -> bool {
        self.ctx.attr().type2_windows
    }

    fn max_qp_wr(&self) -> u32 {
        self.ctx.attr().max_qp_wr
    }

    fn max_srq_wr(&self) -> u32 {
        self.ctx.attr().max_srq_wr
    }

    fn stop_closes_srq_users(&self) -> bool {
        self.ctx.teardown() == cqd_verbs::Teardown::DestroyThenQuiesce
    }

    fn create_cq<W: Send + 'static>(
        &self,
        name: &str,
        depth: u32,
        options: CqOptions,
    ) -> Result<(Cq, UnboundCq<W>, CqHandle<W>), BackendError> {
        self.ctx
            .create_dispatched_cq(name, depth, CqSpec::default(), options)
            .map_err(|e| {
                BackendError::new(
                    format!("create CQ {name} of {depth} entries on {}", self.ctx.name()),
                    e,
                )
            })
    }

    fn reg_region(&self, len: u64, exposure: Exposure) -> Result<VerbsRegion, BackendError> {
        let what = || format!("register {len} bytes on {}", self.name);
        self.pd
            .reg_mr(len, region_access(exposure))
            .map(VerbsRegion)
            .map_err(|e| BackendError::new(what(), e))
    }

    fn create_link(
        &self,
        cq: &Cq,
        depths: Depths,
        exposure: Exposure,
    ) -> Result<VerbsLink, BackendError> {
        self.link(QpInit::new(cq, cq, qp_cap(depths)), exposure)
            .map_err(|e| BackendError::new(format!("create a QP on {}", self.name), e))
    }

    fn create_srq(&self, depth: u32) -> Result<VerbsSrq, BackendError> {
        self.pd
            .create_srq(SrqInit {
                max_wr: depth,
                max_sge: 1,
                owner: None,
            })
            .map(VerbsSrq)
            .map_err(|e| BackendError::new(format!("create an SRQ of {depth} on {}", self.name), e))
    }

    fn create_link_on_srq(
        &self,
        cq: &Cq,
        send_depth: u32,
        srq: &VerbsSrq,
        exposure: Exposure,
        owner: &Registration,
    ) -> Result<VerbsLink, BackendError> {
        let cap = qp_cap(Depths {
            send: send_depth,
            recv: 0,
        });
        let init = QpInit::new(cq, cq, cap).with_srq(&srq.0).owned_by(owner);
        self.link(init, exposure).map_err(|e| {
            BackendError::new(
                format!("create a QP on SRQ {} on {}", srq.0.number(), self.name),
                e,
            )
        })
    }
}

fn qp_cap(depths: Depths) -> QpCap {
    QpCap {
        max_send_wr: depths.send,
        max_recv_wr: depths.recv,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    }
}

impl VerbsNode {
    fn link(
        &self,
        init: QpInit<'_>,
        exposure: Exposure,
    ) -> Result<VerbsLink, cqd_verbs::VerbsError> {
        let qp = self.pd.create_qp(&init)?;
        let psn = new_psn(qp.qpn());
        Ok(VerbsLink {
            qp: std::sync::Arc::new(qp),
            psn,
            connect: ConnectOptions {
                access: qp_access(exposure),
                ..self.connect
            },
            cm: std::sync::Mutex::new(None),
            windows: std::sync::OnceLock::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_retry_count_reaches_every_qp_connect() {
        let default = VerbsOptions::default().connect_options();
        assert_eq!(default.retry_cnt, ConnectOptions::default().retry_cnt);
        let o = VerbsOptions {
            retry_cnt: Some(3),
            gid_index: Some(1),
            ..VerbsOptions::default()
        };
        let c = o.connect_options();
        assert_eq!((c.retry_cnt, c.gid_index, c.port), (3, Some(1), 1));
    }
}
