//! cqd-demo: a block-storage server and its load generator on cqd.
//!
//! The server exports in-memory block devices over RC queue pairs: clients
//! send READ and WRITE requests by SEND, the server's handler hands them
//! to a worker pool keyed by block, and the workers move the data with
//! one-sided RDMA (WRITE into the client's buffer for reads, READ from it
//! for writes, as NVMe over Fabrics does) and reply by SEND. The load
//! generator drives N connections at a queue depth with a read/write mix,
//! checks every read against what it wrote ([`verify`]), and the run ends
//! with two verdicts: the data, and the pollers' accounts (every request
//! posted was completed or flushed).
//!
//! The transport is behind [`backend`]: the simulated NIC (`backend::sim`,
//! one process) and, with the cargo feature `verbs`, real RDMA through
//! cqd-verbs (`backend::verbs`), in one process or as separate `serve` and
//! `load` processes joined over TCP ([`net`]).

pub mod auth;
pub mod backend;
pub mod config;
pub mod load;
pub mod naive;
pub mod net;
pub mod prom;
pub mod report;
pub mod run;
pub mod server;
pub mod topo;
pub mod verify;
pub mod wire;

/// Why a run could not be made or finished.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// A bad flag value or a bad combination of them.
    #[error("{0}")]
    Config(String),
    /// The topology file or its use.
    #[error("topology: {0}")]
    Topology(String),
    /// Setting up devices, CQs, threads.
    #[error("setup: {0}")]
    Setup(String),
    /// The backend refused.
    #[error("{0}")]
    Backend(#[from] backend::BackendError),
    /// Writing the report.
    #[error("{0}")]
    Output(String),
    /// The TCP side of `serve` / `load`: a peer not there, refusing, or
    /// talking nonsense.
    #[error("{0}")]
    Net(String),
}

impl DemoError {
    /// The process exit code for this error: 2 for bad input, 1 otherwise.
    pub fn exit_code(&self) -> i32 {
        match self {
            DemoError::Config(_) | DemoError::Topology(_) => 2,
            _ => 1,
        }
    }
}
