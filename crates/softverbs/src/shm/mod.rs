//! The shared-memory fabric: named segments under one per-machine directory,
//! a lock-free ring that lives inside them, the global id counters, and the
//! layouts of the segments every process can map.
//!
//! Names (all under [`dir`], a directory of one user's: [`fabric`]):
//!
//! | file          | owner     | content                                     |
//! |---------------|-----------|---------------------------------------------|
//! | `ids`         | shared    | atomic counters: QPN, CQ, context, SRQ ids  |
//! | `ctx-<id>`    | a context | [`layout::CtxHeader`] + MR table            |
//! | `cq-<id>`     | a CQ      | [`layout::CqHeader`] + ring of CQEs         |
//! | `qp-<qpn>`    | a QP      | [`layout::QpHeader`] + receive [`claim`] ring |
//! | `srq-<id>`    | an SRQ    | [`layout::SrqHeader`] + receive [`claim`] ring |
//! | `atomics`     | shared    | lock table of remote atomics ([`atomics`])  |
//! | `mcast`       | shared    | multicast group table (`provider::mcast`)   |
//! | `xrcd-<id>`   | shared    | an XRC domain's registry entry (`provider::xrc`) |
//!
//! Peers find a QP by the QPN that verbs programs exchange out of band.
//! QP and SRQ headers carry a [`doorbell::Doorbell`] that wakes requesters
//! waiting on them.

pub mod atomics;
pub mod claim;
pub mod claimer;
pub mod doorbell;
pub mod fabric;
pub mod insiders;
pub mod layout;
pub mod ring;
pub mod segment;

pub use segment::{dir, Ids, Segment};
