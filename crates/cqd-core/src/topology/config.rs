//! The plain-data topology: what the TOML file says, field by field.
//!
//! Nothing here spawns a thread; [`TopologyConfig::validate`] checks the whole
//! thing once and returns the [`Topology`](super::Topology) that can.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::pool::{Routing, WorkerIdle};
use crate::thread::{OnPriorityError, Placement, Priority};

/// The whole thread topology of a dispatcher: every poller thread and every
/// worker pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopologyConfig {
    /// What to do when a priority cannot be applied (no privilege):
    /// `"error"` (the default) fails the spawn; `"warn"` logs and goes on.
    #[serde(default)]
    pub on_priority_error: OnPriorityError,
    /// What `validate` does with a spinning poller that may share a CPU
    /// with another thread of the topology: `"warn"` (the default) or
    /// `"error"`.
    #[serde(default)]
    pub on_shared_cpu: OnSharedCpu,
    /// Poller threads, one `[[poller]]` table each; each thread is named
    /// `cqd-poller-<name>`.
    #[serde(default, rename = "poller")]
    pub pollers: Vec<PollerConfig>,
    /// Worker pools, one `[[pool]]` table each; worker `i` of pool `io` is
    /// named `cqd-worker-io-<i>`.
    #[serde(default, rename = "pool")]
    pub pools: Vec<PoolConfig>,
    /// CQ pools, one `[[cq_pool]]` table each: CQs made at run time for
    /// connections that come and go, on the pollers each names
    /// ([`CqPool::from_plan`](crate::CqPool::from_plan)).
    #[serde(default, rename = "cq_pool", skip_serializing_if = "Vec::is_empty")]
    pub cq_pools: Vec<CqPoolConfig>,
}

/// One CQ pool (`[[cq_pool]]`): its CQs are made at run time, as
/// connections need them, and added to the running pollers it names. A
/// poller named by a CQ pool may own no CQ of its own (`cqs = []`): it
/// starts empty and polls the pool's CQs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CqPoolConfig {
    /// The pool's name, unique among CQ pools; its CQs are named
    /// `<name>-<n>`.
    pub name: String,
    /// Entries asked for each CQ it makes.
    pub cqe: u32,
    /// The pollers its CQs go to, by name (at least one).
    pub pollers: Vec<String>,
    /// How it chooses among CQs with room: `"least-used"` (the default)
    /// or `"first"`.
    #[serde(default)]
    pub fit: FitConfig,
    /// The most CQs it makes.
    #[serde(default = "default_max_cqs")]
    pub max_cqs: usize,
    /// Grow a CQ in place (`ibv_resize_cq`) up to this many entries
    /// before making a new one; absent: new CQs only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resize_up_to: Option<u32>,
}

/// A CQ pool's fit, as the topology file writes it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FitConfig {
    /// The CQ with the fewest entries reserved.
    #[default]
    LeastUsed,
    /// The first CQ made with room.
    First,
}

fn default_max_cqs() -> usize {
    1024
}

/// What [`TopologyConfig::validate`] does with a spinning poller (Busy, or
/// a spin window of [`LONG_SPIN`](super::LONG_SPIN) or more) whose
/// placement may share a CPU with another thread of the topology.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnSharedCpu {
    /// A [`Warning::SpinnerSharesCpu`](super::Warning::SpinnerSharesCpu)
    /// for each thread it may share with; the topology is accepted.
    #[default]
    Warn,
    /// [`TopologyError::SpinnerSharesCpu`](super::TopologyError::SpinnerSharesCpu)
    /// for the first one.
    Error,
}

/// One poller thread.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollerConfig {
    /// The poller's name, unique among pollers.
    pub name: String,
    /// The completion queues this poller owns, by name. A CQ has one poller.
    /// Empty only for a poller a CQ pool names (`[[cq_pool]]`): it then
    /// starts with no CQ and polls the pool's.
    pub cqs: Vec<String>,
    /// How the poller waits for completions.
    #[serde(default)]
    pub mode: ModeConfig,
    /// Completions taken per poll call.
    #[serde(default = "default_batch")]
    pub batch: u32,
    /// Completions taken from one CQ per round at most: it is polled again
    /// while it returns full batches, up to this
    /// ([`CqOptions::round_budget`](crate::cq::CqOptions::round_budget));
    /// 0 or less than a batch means one batch.
    #[serde(default = "default_round_budget")]
    pub round_budget: u32,
    /// Busy mode: nap when idle so other threads on the CPU run (default
    /// true); false only for a poller pinned alone on its core
    /// (`PollerBuilder::busy_naps`).
    #[serde(default = "default_busy_naps")]
    pub busy_naps: bool,
    /// Where the thread may run.
    #[serde(default)]
    pub placement: Placement,
    /// Scheduling priority applied at spawn; absent keeps the inherited one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
    /// The worker pool this poller hands work to, by name. The pool's
    /// [`spawn_feeds`](super::PoolPlan::spawn_feeds) makes one feed per
    /// poller that names it, so the producer count is the topology's, never
    /// a number written by hand. Absent: the poller's sink is your own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
}

/// One worker pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// The pool's name, unique among pools; part of the thread names.
    pub name: String,
    /// Worker threads.
    pub threads: usize,
    /// Where the workers may run (every worker gets the same placement).
    #[serde(default)]
    pub placement: Placement,
    /// Slots per ring (one ring per worker and producer), rounded up to a
    /// power of two.
    #[serde(default = "default_capacity")]
    pub capacity: usize,
    /// How items are spread over the workers.
    #[serde(default)]
    pub routing: Routing,
    /// What an idle worker does: `"park"` (the default) or `"spin"` (never
    /// park: for workers pinned to CPUs of their own).
    #[serde(default, skip_serializing_if = "WorkerIdle::is_park")]
    pub idle: WorkerIdle,
    /// Scheduling priority applied at spawn; absent keeps the inherited one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<Priority>,
}

fn default_busy_naps() -> bool {
    true
}

fn default_round_budget() -> u32 {
    crate::cq::DEFAULT_ROUND_BUDGET as u32
}

fn default_batch() -> u32 {
    32
}

fn default_capacity() -> usize {
    1024
}

/// How a poller waits for completions; the poller's own mode type is built
/// from this. Durations are whole microseconds or milliseconds, as named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
pub enum ModeConfig {
    /// Poll without blocking on a notification: lowest latency, one whole
    /// CPU while completions flow; naps when idle (`cqd_core::mode`).
    Busy,
    /// Arm, re-poll, sleep on the completion channel.
    Event {
        /// Safety-net wake-up when no event arrives, in milliseconds.
        #[serde(default = "default_timeout_ms")]
        timeout_ms: u64,
    },
    /// Busy for a window after the last completion, then Event.
    Hybrid {
        /// How long to keep polling after the last completion, in µs
        /// (default 50).
        #[serde(default = "default_spin_window_us")]
        spin_window_us: u64,
        /// Safety-net wake-up when sleeping, in milliseconds.
        #[serde(default = "default_timeout_ms")]
        timeout_ms: u64,
    },
    /// Hybrid whose window follows the measured inter-arrival time.
    Adaptive {
        /// Smallest spin window, in µs (default 2).
        #[serde(default = "default_min_window_us")]
        min_window_us: u64,
        /// Largest spin window, in µs (default 200).
        #[serde(default = "default_max_window_us")]
        max_window_us: u64,
        /// Most of one CPU the spinning may waste (in windows that ended
        /// without a completion), in percent (1 to 100; default 50).
        #[serde(default = "default_cpu_budget_percent")]
        cpu_budget_percent: u8,
        /// Safety-net wake-up when sleeping, in milliseconds.
        #[serde(default = "default_timeout_ms")]
        timeout_ms: u64,
    },
}

fn default_timeout_ms() -> u64 {
    100
}

fn default_spin_window_us() -> u64 {
    50
}

fn default_min_window_us() -> u64 {
    2
}

fn default_max_window_us() -> u64 {
    200
}

fn default_cpu_budget_percent() -> u8 {
    50
}

impl Default for ModeConfig {
    /// Adaptive, the recommended mode, with the poller's own defaults:
    /// 2–200 µs window, 50% CPU, 100 ms.
    fn default() -> Self {
        ModeConfig::Adaptive {
            min_window_us: default_min_window_us(),
            max_window_us: default_max_window_us(),
            cpu_budget_percent: default_cpu_budget_percent(),
            timeout_ms: default_timeout_ms(),
        }
    }
}

impl ModeConfig {
    /// Whether the poller spins without ever blocking on a notification,
    /// and so claims a CPU.
    pub fn is_busy(&self) -> bool {
        matches!(self, ModeConfig::Busy)
    }

    /// The poller's mode type for this config (the safety-net timeout is
    /// separate: [`timeout`](Self::timeout), for `PollerBuilder::wake_timeout`).
    pub fn poll_mode(&self) -> crate::mode::PollMode {
        use crate::mode::{Adaptive, PollMode};
        match *self {
            ModeConfig::Busy => PollMode::Busy,
            ModeConfig::Event { .. } => PollMode::Event,
            ModeConfig::Hybrid { spin_window_us, .. } => PollMode::Hybrid {
                spin: Duration::from_micros(spin_window_us),
            },
            ModeConfig::Adaptive {
                min_window_us,
                max_window_us,
                cpu_budget_percent,
                ..
            } => PollMode::Adaptive(Adaptive {
                min_spin: Duration::from_micros(min_window_us),
                max_spin: Duration::from_micros(max_window_us),
                cpu_budget: f64::from(cpu_budget_percent) / 100.0,
                ..Adaptive::default()
            }),
        }
    }

    /// The safety-net timeout, if the mode sleeps.
    pub fn timeout(&self) -> Option<Duration> {
        match *self {
            ModeConfig::Busy => None,
            ModeConfig::Event { timeout_ms }
            | ModeConfig::Hybrid { timeout_ms, .. }
            | ModeConfig::Adaptive { timeout_ms, .. } => Some(Duration::from_millis(timeout_ms)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mode::PollMode;

    #[test]
    fn default_mode_is_the_pollers_default() {
        assert_eq!(ModeConfig::default().poll_mode(), PollMode::default());
        assert_eq!(
            ModeConfig::default().timeout(),
            Some(crate::poller::DEFAULT_WAKE_TIMEOUT)
        );
    }

    /// Every mode given by its kind alone takes the documented defaults
    /// (`mode = { kind = "adaptive" }` was refused: missing field).
    #[test]
    fn every_mode_parses_from_its_kind_alone_with_the_documented_defaults() {
        #[derive(Deserialize)]
        struct P {
            mode: ModeConfig,
        }
        let m = |kind: &str| {
            toml::from_str::<P>(&format!("mode = {{ kind = \"{kind}\" }}"))
                .unwrap_or_else(|e| panic!("{kind}: {e}"))
                .mode
        };
        assert_eq!(m("busy"), ModeConfig::Busy);
        assert_eq!(m("event"), ModeConfig::Event { timeout_ms: 100 });
        assert_eq!(
            m("hybrid"),
            ModeConfig::Hybrid {
                spin_window_us: 50,
                timeout_ms: 100
            }
        );
        assert_eq!(m("adaptive"), ModeConfig::default());
        assert_eq!(m("hybrid").poll_mode(), PollMode::all()[2]);
    }

    #[test]
    fn every_mode_maps() {
        assert_eq!(ModeConfig::Busy.poll_mode(), PollMode::Busy);
        assert_eq!(ModeConfig::Busy.timeout(), None);
        assert_eq!(
            ModeConfig::Event { timeout_ms: 7 }.poll_mode(),
            PollMode::Event
        );
        assert_eq!(
            ModeConfig::Hybrid {
                spin_window_us: 30,
                timeout_ms: 9
            }
            .poll_mode(),
            PollMode::Hybrid {
                spin: Duration::from_micros(30)
            }
        );
        assert_eq!(
            ModeConfig::Hybrid {
                spin_window_us: 30,
                timeout_ms: 9
            }
            .timeout(),
            Some(Duration::from_millis(9))
        );
    }
}
