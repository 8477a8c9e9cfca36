//! Unreliable datagrams: address handles, making a UD QP ready, and where
//! a UD send goes.
//!
//! A UD QP ([`QpInit::datagram`](crate::QpInit::datagram)) connects to no
//! peer: [`Qp::ready_ud`] takes it RESET → INIT (port, P_Key index 0, its
//! Q_Key) → RTR → RTS (`sq_psn`), and each send names its destination
//! ([`SendWr::to`](crate::SendWr::to) with a [`UdDest`]): an address handle
//! ([`Pd::create_ah`], from the peer's [`Endpoint`]), the destination QP
//! number and the Q_Key the destination was made with. The posting call
//! refuses, before the device sees it, a datagram longer than the port's
//! MTU and any operation but SEND / SEND with immediate
//! ([`cqd_core::post::Invalid`]).
//!
//! Every receive buffer of a UD QP starts with 40 bytes for the Global
//! Routing Header ([`cqd_core::completion::GRH_LEN`]); the payload follows.
//! The handler's [`RecvDone`](cqd_core::RecvDone) says who sent it
//! (`src_qp`, `slid`), whether a GRH is there (`has_grh`), and how long
//! the payload is (`datagram_len`). A datagram no receive is waiting for,
//! or with the wrong Q_Key, is dropped: UD is unreliable, its send still
//! succeeds.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::device::Context;
use crate::error::VerbsError;
use crate::pd::{Pd, PdInner};
use crate::qp::{ConnectOptions, Endpoint, Qp, QpType};
use crate::sys;

/// How to address a peer's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AhOptions {
    /// The local port.
    pub port: u8,
    /// Service level (the receiver sees it in `wc.sl`).
    pub sl: u8,
    /// The local GID index of a global route; `None`: a global route only
    /// if the peer sent a GID (then index 0).
    pub gid_index: Option<u8>,
    /// Hop limit of a global route.
    pub hop_limit: u8,
    /// Traffic class of a global route.
    pub traffic_class: u8,
    /// Flow label of a global route (20 bits).
    pub flow_label: u32,
}

impl Default for AhOptions {
    fn default() -> Self {
        AhOptions {
            port: 1,
            sl: 0,
            gid_index: None,
            hop_limit: 64,
            traffic_class: 0,
            flow_label: 0,
        }
    }
}

pub(crate) struct AhInner {
    pub(crate) ah: NonNull<sys::ibv_ah>,
    pub(crate) pd: Arc<PdInner>,
    global: bool,
}

// SAFETY: an address handle is immutable after creation and libibverbs
// lets any thread name it in a post; the pointer is only used through
// `sys` (destroy) and copied into work requests.
unsafe impl Send for AhInner {}
// SAFETY: as above.
unsafe impl Sync for AhInner {}

impl Drop for AhInner {
    fn drop(&mut self) {
        // SAFETY: the AH is live; every QP that posted with it holds an
        // `Arc` of it until destroyed (`Pins`), so no outstanding send
        // names it.
        if let Err(e) = unsafe { sys::destroy_ah(self.ah) } {
            tracing::error!(error = %e, "ibv_destroy_ah failed");
        }
    }
}

/// An address handle (`ibv_ah`): a path to one port. Cloneable; it lives
/// until its last clone is dropped and every QP that sent with it is
/// destroyed.
#[derive(Clone)]
pub struct Ah {
    pub(crate) inner: Arc<AhInner>,
}

impl fmt::Debug for Ah {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ah")
            .field("global", &self.inner.global)
            .finish()
    }
}

impl Ah {
    /// True if the datagrams carry a GRH (a global route).
    pub fn is_global(&self) -> bool {
        self.inner.global
    }
}

/// Where a UD send goes (`wr.ud`: `ah`, `remote_qpn`, `remote_qkey`).
#[derive(Debug, Clone, Copy)]
pub struct UdDest<'a> {
    /// The address handle of the destination's port.
    pub ah: &'a Ah,
    /// The destination QP.
    pub qpn: u32,
    /// The destination's Q_Key; with its high-order bit set, the sending
    /// QP's own.
    pub qkey: u32,
}

impl Pd {
    /// An address handle towards `to`'s port: its LID, and a global route
    /// (GRH) to its GID if it sent one or `opts.gid_index` is set.
    ///
    /// # Errors
    /// `ibv_create_ah` failed (a port or GID index the device does not
    /// have); the device is gone.
    pub fn create_ah(&self, to: &Endpoint, opts: &AhOptions) -> Result<Ah, VerbsError> {
        self.inner.ctx.check()?;
        if opts.flow_label > 0xf_ffff {
            return Err(VerbsError::Invalid(format!(
                "flow label {:#x} is wider than 20 bits",
                opts.flow_label
            )));
        }
        // SAFETY: plain C data; all-zero is a valid value.
        let mut a: sys::ibv_ah_attr = unsafe { std::mem::zeroed() };
        a.dlid = to.lid;
        a.sl = opts.sl;
        a.port_num = opts.port;
        let global = to.has_gid() || opts.gid_index.is_some();
        if global {
            a.is_global = 1;
            a.grh.dgid.raw = to.gid;
            a.grh.sgid_index = opts.gid_index.unwrap_or(0);
            a.grh.hop_limit = opts.hop_limit;
            a.grh.traffic_class = opts.traffic_class;
            a.grh.flow_label = opts.flow_label;
        }
        // SAFETY: the domain is live while `self` is.
        let ah = unsafe { sys::create_ah(self.inner.pd, &mut a) }.map_err(|e| {
            VerbsError::verb(
                "ibv_create_ah",
                format!("to LID {} QP {}", to.lid, to.qpn),
                e,
            )
        })?;
        Ok(Ah {
            inner: Arc::new(AhInner {
                ah,
                pd: Arc::clone(&self.inner),
                global,
            }),
        })
    }
}

impl Qp {
    /// RESET → INIT → RTR → RTS of a UD QP: on `opts.port` (P_Key index
    /// 0), receiving datagrams that carry `qkey`, sending from `psn`.
    /// Reads the port's active MTU: the largest datagram the posting call
    /// accepts ([`Qp::mtu`]).
    ///
    /// # Errors
    /// The QP is RC; a transition the device refused (the error names it).
    pub fn ready_ud(&self, qkey: u32, psn: u32, opts: &ConnectOptions) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        if self.qp_type() != QpType::Ud {
            return Err(VerbsError::Invalid(format!(
                "QP {} is RC: connect it to its peer (ready_ud is for UD QPs)",
                self.qpn()
            )));
        }
        let ctx = Context {
            inner: Arc::clone(&self.pd_inner().ctx),
        };
        let mtu = ctx.port(opts.port)?.active_mtu;
        // SAFETY: plain C data; all-zero is a valid value.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = opts.port;
        a.qkey = qkey;
        self.modify(
            &mut a,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_QKEY).0,
            "ibv_modify_qp(INIT)",
        )?;
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        self.modify(&mut a, m::IBV_QP_STATE.0, "ibv_modify_qp(RTR)")?;
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.sq_psn = psn & 0xff_ffff;
        self.modify(
            &mut a,
            (m::IBV_QP_STATE | m::IBV_QP_SQ_PSN).0,
            "ibv_modify_qp(RTS)",
        )?;
        self.set_mtu(mtu.bytes());
        Ok(())
    }
}
