//! cqd-core: the backend-agnostic heart of cqd.
//!
//! A completion travels: CQ → [`CqPoller`] (owned by one
//! poller thread) → [`wr_id`] decode → the handler slab (generation
//! checked) → a typed [`Handler`] callback → work in an
//! [`Outbox`] → a [`WorkSink`] (worker
//! pools).
//!
//! ```
//! use cqd_core::completion::{Completion, Opcode};
//! use cqd_core::handler::{Failed, Handler, Outbox, RecvDone, SendDone};
//! use cqd_core::sink::NoWork;
//! use cqd_core::wr_id::{OpKind, WrId};
//!
//! struct Counter(u64);
//! impl Handler for Counter {
//!     fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) { self.0 += 1 }
//!     fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) { self.0 += u64::from(d.byte_len()) }
//!     fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) { assert!(f.is_flush()) }
//! }
//!
//! // A wr_id carries the kind, the handler's slot and generation, and a tag.
//! let key = cqd_core::wr_id::HandlerKey::new(3, 1).unwrap();
//! let raw = key.wr_id(OpKind::Recv, 42).unwrap();
//! let back = WrId::decode(raw).unwrap();
//! assert_eq!((back.kind, back.key, back.tag), (OpKind::Recv, key, 42));
//! # let _ = (Counter(0), Completion::success(raw, Opcode::Recv, 1));
//! ```
//!
//! The `cqd` facade crate has a runnable tour on the simulated NIC.

pub mod account;
pub mod budget;
pub mod completion;
pub mod context;
pub mod cq;
pub mod cq_pool;
#[cfg(feature = "tokio")]
pub mod driver;
pub mod event;
#[cfg(feature = "metrics")]
pub mod export;
pub mod future;
pub mod handler;
pub mod ledger;
pub mod metrics;
pub mod mode;
pub mod notifier;
pub mod poller;
pub mod pool;
pub mod post;
mod reply;
pub mod shutdown;
pub mod sink;
pub mod slab;
pub mod source;
#[doc(hidden)]
pub mod sync;
mod sys;
mod thread;
pub mod topology;
pub mod verdict;
pub mod wr_id;

pub use account::{RoomError, SendRoom};
pub use budget::{cq_depth_for, Admission, BudgetError, BudgetOptions, BudgetSnapshot, CqBudget};
pub use completion::{Completion, Opcode, Status, WcFlags};
pub use context::ContextHandler;
pub use cq::{
    split, ContextRegistration, CqHandle, CqOptions, CqPoller, PostRefused, Registration,
    ResizeError, Resizing, UnboundCq,
};
pub use cq_pool::{CqPool, Fit, PoolError};
#[cfg(feature = "metrics")]
pub use export::MetricsExporter;
pub use handler::{Failed, Handler, Outbox, RecvDone, SendDone, Silent};
pub use ledger::{
    drain, KindAccount, Queue, QueueAccount, ShutdownReport, StuckWr, Watchdog, WrLedger,
};
pub use mode::{Adaptive, PollMode};
pub use poller::{
    CqJoiner, CustomStop, JoinError, Joining, NotJoined, PollerBuilder, PollerMonitor,
    PollerReport, PollerThread,
};
pub use post::{Invalid, PostRecv, PostSend, Refused, SendRequest, WorkRequest};
pub use shutdown::{shutdown, shutdown_with, ShutdownOptions, Stopper, SystemReport};
pub use sink::{Burst, NoSink, NoWork, Route, Routed, SpaceWait, SpaceWaker, WorkSink};
pub use source::{ArmKind, AsyncEvent, CompletionSource, QpEvent, SourceError, SrqEvent};
pub use verdict::{Finding, FindingKind};
pub use wr_id::{HandlerKey, OpKind, Side, WrId};
