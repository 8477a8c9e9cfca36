//! The backend on cqd-sim: every node is a simulated device on one
//! fabric, in this process; endpoints are QP numbers, exchanged in memory.

use cqd_core::{CqHandle, CqOptions, Registration, UnboundCq};
use std::time::Duration;

use cqd_sim::{
    Access, Cq, CqConfig, Device, DeviceAttr, Fabric, Modify, Mr, NicFaults, Pd, Qp, QpCap, QpInit,
    RecvWr, SendWr, Sge, Srq, WrOp,
};

use super::{BackendError, Depths, Exposure, Link, Node, Op, Region, Remote, SharedRq, Verb};

/// The simulated fabric all nodes of a run share.
#[derive(Debug, Clone)]
pub struct SimFabric {
    fabric: Fabric,
}

impl SimFabric {
    /// A fabric with the inline engine (requests execute inside the post
    /// call) and, if `error_rate` > 0, that chance per executed request of
    /// a transport error (the request fails and its QP goes to error).
    pub fn new(error_rate: f64, seed: u64) -> SimFabric {
        let fabric = Fabric::inline();
        if error_rate > 0.0 {
            fabric.set_faults(NicFaults {
                error_rate,
                seed,
                ..NicFaults::default()
            });
        }
        SimFabric { fabric }
    }

    /// Opens a node (a device and its protection domain).
    pub fn open(&self, name: &str) -> SimNode {
        let device = self.fabric.open_device(name, DeviceAttr::default());
        let pd = device.alloc_pd();
        SimNode {
            name: name.to_string(),
            device,
            pd,
        }
    }

    /// Requests the simulated NIC executed, failed and flushed.
    pub fn stats(&self) -> cqd_sim::NicStats {
        self.fabric.stats()
    }
}

/// A simulated device and its protection domain.
#[derive(Debug)]
pub struct SimNode {
    name: String,
    device: Device,
    pd: Pd,
}

/// A registered simulated region.
#[derive(Debug)]
pub struct SimRegion(Mr);

/// A simulated RC QP.
#[derive(Debug)]
pub struct SimLink(Qp, Exposure);

impl SimLink {
    /// The simulated QP (its state machine, for tests and fault
    /// injection).
    pub fn qp(&self) -> &Qp {
        &self.0
    }
}

/// One receive of `len` bytes at `offset` of `region` on `queue` (a QP's
/// own receive queue or an SRQ), through `reg`'s posting call.
fn post_one_recv<Q>(
    reg: &Registration,
    queue: &Q,
    tag: u32,
    region: &SimRegion,
    offset: u64,
    len: u32,
) -> Result<(), Q::Error>
where
    Q: cqd_core::PostRecv + ?Sized,
    for<'a> Q: cqd_core::PostRecv<Wr<'a> = RecvWr<'a>>,
{
    let sge = [region.0.sge(offset, len)];
    reg.post_recv(queue, &mut [RecvWr::new(u64::from(tag), &sge)])
}

/// A simulated shared receive queue.
#[derive(Debug)]
pub struct SimSrq(Srq, u32);

impl SharedRq for SimSrq {
    type Region = SimRegion;

    fn srqn(&self) -> u32 {
        self.0.srqn()
    }

    fn depth(&self) -> u32 {
        self.1
    }

    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &SimRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        post_one_recv(reg, &self.0, tag, region, offset, len)
            .map_err(|e| BackendError::new(format!("post a receive on SRQ {}", self.0.srqn()), e))
    }
}

/// A simulated QP's endpoint: its number on the shared fabric.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SimEndpoint {
    /// The QP number.
    pub qpn: u32,
}

impl Region for SimRegion {
    fn len(&self) -> u64 {
        self.0.len()
    }

    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.0
            .read(offset, out)
            .map_err(|e| BackendError::new("read a region", e))
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.0
            .write(offset, data)
            .map_err(|e| BackendError::new("write a region", e))
    }

    fn remote(&self, offset: u64) -> Remote {
        let r = self.0.remote(offset);
        Remote {
            addr: r.addr,
            rkey: r.rkey,
        }
    }
}

/// The simulated work request of `op`, gathering `sge`.
fn sim_wr<'a>(op: &Op<'_, SimRegion>, sge: &'a [Sge; 1]) -> SendWr<'a> {
    let verb = match op.verb {
        Verb::Send => WrOp::Send,
        Verb::Write(r) => WrOp::Write(remote_of(r)),
        Verb::Read(r) => WrOp::Read(remote_of(r)),
        // Refused by `post_send` before it gets here.
        Verb::Bind { .. } | Verb::Invalidate { .. } => WrOp::Send,
    };
    let wr = SendWr::new(u64::from(op.tag), verb, sge);
    if op.signaled {
        wr
    } else {
        wr.unsignaled()
    }
}

fn remote_of(r: Remote) -> cqd_sim::RemoteAddr {
    cqd_sim::RemoteAddr {
        addr: r.addr,
        rkey: r.rkey,
    }
}

impl Link for SimLink {
    type Region = SimRegion;
    type Endpoint = SimEndpoint;

    fn qpn(&self) -> u32 {
        self.0.qpn()
    }

    fn endpoint(&self) -> Result<SimEndpoint, BackendError> {
        Ok(SimEndpoint { qpn: self.0.qpn() })
    }

    fn connect(&self, peer: &SimEndpoint) -> Result<(), BackendError> {
        let what = || format!("connect QP {} to QP {}", self.0.qpn(), peer.qpn);
        let access = match self.1 {
            Exposure::Local => Access::default(),
            Exposure::Peer | Exposure::Windows => Access::REMOTE_WRITE | Access::REMOTE_READ,
        };
        for m in [
            Modify::Init { access },
            Modify::Rtr {
                remote_qpn: peer.qpn,
            },
            // rnr_retry 7: a SEND waits for its receive rather than fail.
            Modify::Rts {
                rnr_retry: 7,
                retry_cnt: 7,
            },
        ] {
            self.0.modify(m).map_err(|e| BackendError::new(what(), e))?;
        }
        Ok(())
    }

    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &SimRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        post_one_recv(reg, &self.0, tag, region, offset, len)
            .map_err(|e| BackendError::new(format!("post a receive on QP {}", self.0.qpn()), e))
    }

    fn post_send(&self, reg: &Registration, ops: &[Op<'_, SimRegion>]) -> Result<(), BackendError> {
        if ops
            .iter()
            .any(|op| matches!(op.verb, Verb::Bind { .. } | Verb::Invalidate { .. }))
        {
            // `has_windows` is false and `open_windows` refuses: the load
            // never asks.
            return Err(super::no_windows());
        }
        let sge = |op: &Op<'_, SimRegion>| [op.region.0.sge(op.offset, op.len)];
        // The demo posts one or two requests at a time: those lists live
        // on the stack, not in two allocations per post.
        let posted = match ops {
            [a] => {
                let s = [sge(a)];
                reg.post_send(&self.0, &mut [sim_wr(a, &s[0])])
            }
            [a, b] => {
                let s = [sge(a), sge(b)];
                reg.post_send(&self.0, &mut [sim_wr(a, &s[0]), sim_wr(b, &s[1])])
            }
            _ => {
                let sges: Vec<[Sge; 1]> = ops.iter().map(sge).collect();
                let mut wrs: Vec<SendWr<'_>> =
                    ops.iter().zip(&sges).map(|(op, s)| sim_wr(op, s)).collect();
                reg.post_send(&self.0, &mut wrs)
            }
        };
        posted.map_err(|e| BackendError::new(format!("post on QP {}", self.0.qpn()), e))
    }

    fn to_error(&self) {
        self.0.force_error();
    }

    fn close(self, timeout: Duration) -> Result<(), BackendError> {
        let qpn = self.0.qpn();
        self.0
            .close()
            .wait(timeout)
            .map_err(|e| BackendError::new(format!("close QP {qpn}"), e))
    }
}

impl Node for SimNode {
    type Cq = Cq;
    type Region = SimRegion;
    type Link = SimLink;
    type Srq = SimSrq;

    fn name(&self) -> &str {
        &self.name
    }

    fn max_cqe(&self) -> u32 {
        self.device.attr().max_cqe
    }

    fn max_qp_wr(&self) -> u32 {
        self.device.attr().max_qp_wr
    }

    fn max_srq_wr(&self) -> u32 {
        self.device.attr().max_srq_wr
    }

    fn create_cq<W: Send + 'static>(
        &self,
        name: &str,
        depth: u32,
        options: CqOptions,
    ) -> Result<(Cq, UnboundCq<W>, CqHandle<W>), BackendError> {
        self.device
            .create_dispatched_cq(name, depth, CqConfig::default(), options)
            .map_err(|e| BackendError::new(format!("create CQ {name} of {depth} entries"), e))
    }

    fn reg_region(&self, len: u64, exposure: Exposure) -> Result<SimRegion, BackendError> {
        let what = || format!("register {len} bytes on {}", self.name);
        let access = match exposure {
            Exposure::Local => Access::LOCAL_WRITE,
            Exposure::Peer | Exposure::Windows => {
                Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ
            }
        };
        self.pd
            .reg_mr(len, access)
            .map(SimRegion)
            .map_err(|e| BackendError::new(what(), e))
    }

    fn create_link(
        &self,
        cq: &Cq,
        depths: Depths,
        exposure: Exposure,
    ) -> Result<SimLink, BackendError> {
        let cap = QpCap {
            max_send_wr: depths.send,
            max_recv_wr: depths.recv,
            max_send_sge: 1,
            max_recv_sge: 1,
        };
        self.pd
            .create_qp(&QpInit::new(cq, cq, cap))
            .map(|qp| SimLink(qp, exposure))
            .map_err(|e| BackendError::new(format!("create a QP on {}", self.name), e))
    }

    fn create_srq(&self, depth: u32) -> Result<SimSrq, BackendError> {
        self.pd
            .create_srq(depth, 1)
            .map(|srq| SimSrq(srq, depth))
            .map_err(|e| BackendError::new(format!("create an SRQ of {depth} on {}", self.name), e))
    }

    fn create_link_on_srq(
        &self,
        cq: &Cq,
        send_depth: u32,
        srq: &SimSrq,
        exposure: Exposure,
        _owner: &Registration,
    ) -> Result<SimLink, BackendError> {
        let cap = QpCap {
            max_send_wr: send_depth,
            max_recv_wr: 0,
            max_send_sge: 1,
            max_recv_sge: 1,
        };
        self.pd
            .create_qp(&QpInit::new(cq, cq, cap).with_srq(&srq.0))
            .map(|qp| SimLink(qp, exposure))
            .map_err(|e| {
                BackendError::new(
                    format!("create a QP on SRQ {} on {}", srq.0.srqn(), self.name),
                    e,
                )
            })
    }
}
