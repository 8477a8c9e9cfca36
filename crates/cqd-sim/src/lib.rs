//! cqd-sim: a software RDMA NIC for cqd.
//!
//! Its completion queue ([`sim_cq`]) has hardware semantics — fixed
//! capacity, one-shot arms, coalescing notifications on a real file
//! descriptor, overflow as an error state with an asynchronous event — and
//! fault injection for the notification path. It implements
//! [`cqd_core::CompletionSource`], so a poller cannot tell it from a device.
//!
//! ```
//! use cqd_core::{Completion, Opcode};
//! use cqd_sim::{sim_cq, Faults};
//!
//! let (producer, source) = sim_cq("cq0", 64, Faults::default()).unwrap();
//! producer.push(Completion::success(1, Opcode::Send, 7), false).unwrap();
//! assert_eq!(producer.len(), 1);
//! # drop(source);
//! ```

mod access;
pub mod ah;
pub mod channel;
pub mod cq;
pub mod device;
pub mod engine;
pub mod error;
mod exec;
pub mod fabric;
pub mod loopback;
pub mod mr;
pub mod pd;
pub mod qp;
pub mod srq;
mod state;
pub mod wr;

pub use ah::{Ah, AhAttr, Grh, UdDest};
pub use cq::{
    sim_cq, sim_cq_with_ledger, Faults, PushError, SimChannel, SimCq, SimCqError, SimCqSource,
    SimCqStats, MAX_CQE,
};
pub use device::{Cq, CqConfig, Device, DeviceAttr};
pub use engine::{Engine, NicFaults, NicStats, TimedModel};
pub use error::{PostError, VerbsError};
pub use fabric::Fabric;
pub use loopback::{LoopWr, Loopback, LoopbackError};
pub use mr::{Access, Mr, RemoteAddr, Sge};
pub use pd::{Pd, QpInit};
pub use qp::{connect, connect_with, Modify, Qp, QpCap, QpState, QpType, RecvWr, SendWr, WrOp};
pub use srq::Srq;
