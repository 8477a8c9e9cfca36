//! Thread topology: which threads exist, where they run, at what priority.
//!
//! A [`TopologyConfig`] is plain serde data, read from TOML
//! ([`TopologyConfig::from_toml`], [`TopologyConfig::from_file`]) or built in
//! code with the same names (`TopologyConfig::new().poller(..).pool(..)`).
//! [`TopologyConfig::validate`] checks it once against the process's CPU
//! affinity mask and returns a [`Topology`], the only type whose plans can
//! spawn threads. Every field is described in `docs/topology.md`; a complete
//! example is `examples/topology.toml`.
//!
//! ```
//! use cqd_core::topology::{ModeConfig, Placement, PollerConfig, PoolConfig, TopologyConfig};
//!
//! let from_code = TopologyConfig::new()
//!     .poller(PollerConfig::new("net").cq("rx0").cq("tx0").mode(ModeConfig::Event { timeout_ms: 100 }))
//!     .pool(PoolConfig::new("io", 3).capacity(1024).placement(Placement::Unpinned));
//! let from_file = TopologyConfig::from_toml(r#"
//!     [[poller]]
//!     name = "net"
//!     cqs = ["rx0", "tx0"]
//!     mode = { kind = "event", timeout_ms = 100 }
//!
//!     [[pool]]
//!     name = "io"
//!     threads = 3
//!     capacity = 1024
//! "#)?;
//! assert_eq!(from_code, from_file);
//! let mut topology = from_file.validate()?;
//! let poller = topology.take_poller("net").unwrap();
//! assert_eq!(poller.thread_name(), "cqd-poller-net");
//! # Ok::<(), cqd_core::topology::TopologyError>(())
//! ```

mod config;
mod error;
mod plan;
mod validate;

use std::path::Path;

pub use config::{
    CqPoolConfig, FitConfig, ModeConfig, OnSharedCpu, PollerConfig, PoolConfig, TopologyConfig,
};
pub use error::{TopologyError, Warning};
pub use plan::{CqPoolPlan, Feeds, PollerPlan, PoolPlan, Topology};
pub use validate::{LONG_SPIN, MAX_CAPACITY};
// Types the config is written in but that belong to the layers below (pools
// route, threads are placed and prioritised), named here too so that a
// config reads as one vocabulary.
pub use crate::pool::{Routing, WorkerIdle};
pub use crate::thread::{OnPriorityError, Placement, Priority, SpawnError, ThreadHandle};

impl TopologyConfig {
    /// An empty topology: no pollers, no pools, priority errors are errors.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a poller (`[[poller]]`).
    pub fn poller(mut self, poller: PollerConfig) -> Self {
        self.pollers.push(poller);
        self
    }

    /// Adds a worker pool (`[[pool]]`).
    pub fn pool(mut self, pool: PoolConfig) -> Self {
        self.pools.push(pool);
        self
    }

    /// Adds a CQ pool (`[[cq_pool]]`).
    pub fn cq_pool(mut self, cq_pool: CqPoolConfig) -> Self {
        self.cq_pools.push(cq_pool);
        self
    }

    /// Sets `on_priority_error`.
    pub fn on_priority_error(mut self, on_error: OnPriorityError) -> Self {
        self.on_priority_error = on_error;
        self
    }

    /// Sets `on_shared_cpu`.
    pub fn on_shared_cpu(mut self, on_shared: OnSharedCpu) -> Self {
        self.on_shared_cpu = on_shared;
        self
    }

    /// Parses TOML text.
    ///
    /// # Errors
    ///
    /// [`TopologyError::Parse`] with the line and column of the problem.
    pub fn from_toml(text: &str) -> Result<Self, TopologyError> {
        toml::from_str(text).map_err(|e| {
            let offset = e.span().map_or(0, |s| s.start);
            let (line, column) = line_column(text, offset);
            TopologyError::Parse {
                line,
                column,
                message: e.message().to_owned(),
            }
        })
    }

    /// Reads and parses a TOML file.
    ///
    /// # Errors
    ///
    /// [`TopologyError::Io`] naming the path, or [`TopologyError::Parse`].
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| TopologyError::Io {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text)
    }

    /// Writes the config as TOML that [`from_toml`](Self::from_toml) reads back.
    ///
    /// # Errors
    ///
    /// [`TopologyError::Serialize`] (not expected for valid data).
    pub fn to_toml(&self) -> Result<String, TopologyError> {
        toml::to_string_pretty(self).map_err(|e| TopologyError::Serialize {
            message: e.to_string(),
        })
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

impl PollerConfig {
    /// A poller with no CQ yet, the default (adaptive) mode, batch 32,
    /// unpinned, inherited priority.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            cqs: Vec::new(),
            mode: ModeConfig::default(),
            batch: 32,
            round_budget: crate::cq::DEFAULT_ROUND_BUDGET as u32,
            busy_naps: true,
            placement: Placement::Unpinned,
            priority: None,
            pool: None,
        }
    }

    /// Sets `pool`: the worker pool this poller hands work to.
    pub fn pool(mut self, name: impl Into<String>) -> Self {
        self.pool = Some(name.into());
        self
    }

    /// Adds a CQ this poller owns (`cqs`).
    pub fn cq(mut self, name: impl Into<String>) -> Self {
        self.cqs.push(name.into());
        self
    }

    /// Sets `mode`.
    pub fn mode(mut self, mode: ModeConfig) -> Self {
        self.mode = mode;
        self
    }

    /// Sets `batch`.
    pub fn batch(mut self, batch: u32) -> Self {
        self.batch = batch;
        self
    }

    /// Sets `busy_naps`.
    pub fn busy_naps(mut self, on: bool) -> Self {
        self.busy_naps = on;
        self
    }

    /// Sets `round_budget`.
    pub fn round_budget(mut self, completions: u32) -> Self {
        self.round_budget = completions;
        self
    }

    /// Sets `placement`.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Sets `priority`.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }
}

impl PoolConfig {
    /// A pool of `threads` workers, capacity 1024, unpinned, routed as each
    /// item says, inherited priority.
    pub fn new(name: impl Into<String>, threads: usize) -> Self {
        Self {
            name: name.into(),
            threads,
            placement: Placement::Unpinned,
            capacity: 1024,
            routing: Routing::AsRouted,
            idle: WorkerIdle::Park,
            priority: None,
        }
    }

    /// Sets `capacity`.
    pub fn capacity(mut self, capacity: usize) -> Self {
        self.capacity = capacity;
        self
    }

    /// Sets `placement`.
    pub fn placement(mut self, placement: Placement) -> Self {
        self.placement = placement;
        self
    }

    /// Sets `routing`.
    pub fn routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
    }

    /// Sets `idle`: [`WorkerIdle::Spin`] for workers that never park.
    pub fn idle(mut self, idle: WorkerIdle) -> Self {
        self.idle = idle;
        self
    }

    /// Sets `priority`.
    pub fn priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }
}

impl CqPoolConfig {
    /// A CQ pool named `name` of CQs of `cqe` entries over `pollers`
    /// (least used fit, at most 1,024 CQs, no resize).
    pub fn new(
        name: impl Into<String>,
        cqe: u32,
        pollers: impl IntoIterator<Item = impl Into<String>>,
    ) -> Self {
        Self {
            name: name.into(),
            cqe,
            pollers: pollers.into_iter().map(Into::into).collect(),
            fit: FitConfig::default(),
            max_cqs: 1024,
            resize_up_to: None,
        }
    }

    /// Sets `fit`.
    pub fn fit(mut self, fit: FitConfig) -> Self {
        self.fit = fit;
        self
    }

    /// Sets `max_cqs`.
    pub fn max_cqs(mut self, n: usize) -> Self {
        self.max_cqs = n;
        self
    }

    /// Sets `resize_up_to`.
    pub fn resize_up_to(mut self, max_cqe: u32) -> Self {
        self.resize_up_to = Some(max_cqe);
        self
    }
}
