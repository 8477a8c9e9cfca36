//! cqd on real RDMA: libibverbs through rdma-sys.
//!
//! Everything a storage server needs to run cqd's dispatcher on a NIC:
//!
//! - [`Context`]: a device opened by name ([`VerbsError::NoDevice`] with
//!   the errno when there is none), its ports and GIDs, and the reader of
//!   its asynchronous events ([`device`]);
//! - [`Pd`] and [`Mr`]: protection domains and regions that own their
//!   buffers and stay alive until the last request naming them is over;
//! - [`Cq`] + [`VerbsCqSource`]: a CQ (extended and single-threaded where
//!   the device allows) with its completion channel, own or shared
//!   ([`CompChannel`]), as a [`cqd_core::CompletionSource`] for one poller;
//! - [`Qp`]: RC queue pairs with INIT → RTR → RTS from an [`Endpoint`]
//!   exchanged out of band, admitted on their CQs, posted to only through
//!   cqd's posting call (`Registration::post_send` / `post_recv`) — SEND,
//!   RDMA WRITE / READ, atomics ([`WrOp::CompareSwap`], [`WrOp::FetchAdd`]);
//!   UD queue pairs with address handles ([`ah`]); [`Srq`];
//! - [`Context::adopt_cq`]: an application's own CQ under cqd's poller;
//! - [`cm`]: connections through rdma_cm (listen, accept, connect,
//!   disconnect with the QP drained), CM events on a thread of their own.
//!
//! All FFI is in `sys` (and `sys_cm` for rdma_cm). docs/verbs.md walks through it; the
//! tests run on softverbs (a userspace device) under `softverbs-run`.

pub mod adopt;
pub mod ah;
pub mod cm;
pub mod cq;
pub mod device;
pub mod error;
mod inbox;
pub mod pd;
pub mod qp;
pub mod srq;
mod sys;
mod sys_cm;
pub mod window;
pub mod wr;

pub use ah::{Ah, AhOptions, UdDest};
pub use cq::{completion_of, CompChannel, Cq, CqSpec, VerbsCqSource};
pub use device::{devices, Context, DeviceAttr, DeviceEvent, EventCounts, PortInfo, Teardown};
pub use error::{PostError, VerbsError};
pub use pd::{Access, Mr, Pd, RemoteAddr, Sge};
pub use qp::{ConnectOptions, Endpoint, Mtu, Qp, QpCap, QpInit, QpType, RecvWr, SendWr, WrOp};
pub use srq::{Srq, SrqInit};
pub use sys::{CqFlavor, DeviceName};
pub use window::Window;

/// The raw libibverbs types, for adoption and for verbs cqd does not wrap.
pub mod raw {
    pub use rdma_sys::{ibv_comp_channel, ibv_context, ibv_cq, ibv_mr, ibv_pd, ibv_qp, ibv_wc};
}
