//! NIC semantics, kept apart from FFI and transport so that they can later be
//! shared with `cqd-sim` through a common model crate.
//!
//! Everything here is plain Rust: the QP state machine, the work-completion
//! statuses and opcodes of the verbs ABI, the completion-queue arm rule,
//! the flush rule, the device-death rule and the rules of QP/SRQ
//! asynchronous events (responder errors, last WQE, SRQ limit). The provider consults these;
//! it never re-states them. [`notify`] states the arm/fire protocol between
//! a CQ's consumer and its producers and checks it over every interleaving.

pub mod atomic;
pub mod cq;
pub mod device;
pub mod event;
pub mod mr;
pub mod notify;
pub mod qp;
pub mod ud;
pub mod wc;
