//! What can go wrong reading and validating a topology (spawning one fails
//! with a [`SpawnError`](super::SpawnError)).

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

/// A topology that cannot be used as written. Every variant names the field
/// (`poller[1].placement`, `pool[0].threads`, ...) and the values involved.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The TOML text does not parse or does not match the format.
    #[error("topology TOML, line {line} column {column}: {message}")]
    Parse {
        /// 1-based line of the offending text.
        line: usize,
        /// 1-based column (in characters) of the offending text.
        column: usize,
        /// What the parser said.
        message: String,
    },
    /// The topology file could not be read.
    #[error("cannot read topology file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The config could not be written as TOML.
    #[error("cannot write topology as TOML: {message}")]
    Serialize {
        /// What the serializer said.
        message: String,
    },
    /// The process's CPU affinity mask could not be read.
    #[error("cannot read the process CPU affinity mask (errno {errno})")]
    Affinity {
        /// The errno of `sched_getaffinity`.
        errno: i32,
    },
    /// A placement names a CPU outside the process's affinity mask.
    #[error("{field}: CPU {cpu} is not in the process affinity mask {allowed:?}")]
    CpuNotAllowed {
        /// The field, e.g. `poller[0].placement`.
        field: String,
        /// The CPU.
        cpu: usize,
        /// The CPUs the process may use.
        allowed: BTreeSet<usize>,
    },
    /// Two busy-polling threads are pinned to the same CPU.
    #[error("{field}: CPU {cpu} is already claimed by the busy poller at {claimed_by}")]
    CpuClaimedTwice {
        /// The field of the second claim.
        field: String,
        /// The CPU.
        cpu: usize,
        /// The field of the first claim.
        claimed_by: String,
    },
    /// Two pollers own the same completion queue.
    #[error("{field}: CQ {cq:?} is already owned by {owned_by}")]
    CqOwnedTwice {
        /// The field of the second owner, e.g. `poller[1].cqs[0]`.
        field: String,
        /// The CQ's name.
        cq: String,
        /// The field of the first owner.
        owned_by: String,
    },
    /// A pool with no threads.
    #[error("{field}: a pool needs at least one thread")]
    ZeroThreads {
        /// The field, e.g. `pool[0].threads`.
        field: String,
    },
    /// A ring with no slots.
    #[error("{field}: ring capacity must be at least 1")]
    ZeroCapacity {
        /// The field, e.g. `pool[0].capacity`.
        field: String,
    },
    /// A number out of its range (batch size, fence set, mode parameters,
    /// priority, capacity too large).
    #[error("{field}: {value} is out of range: {expected}")]
    OutOfRange {
        /// The field.
        field: String,
        /// The value given.
        value: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A sleeping mode's safety-net timeout is shorter than a poller honours
    /// ([`MIN_WAKE_TIMEOUT`](crate::mode::MIN_WAKE_TIMEOUT)); zero included.
    #[error(
        "{field}: poller {poller:?} has wake-up timeout {timeout:?}, below the minimum {min:?}"
    )]
    WakeTimeoutTooShort {
        /// The field, e.g. `poller[0].mode.timeout_ms`.
        field: String,
        /// The poller's name.
        poller: String,
        /// The timeout given.
        timeout: Duration,
        /// The shortest accepted.
        min: Duration,
    },
    /// Two pollers or two pools share a name, or a name is empty.
    #[error("{field}: name {name:?} is empty or already used")]
    BadName {
        /// The field.
        field: String,
        /// The name.
        name: String,
    },
    /// A poller names a pool the topology does not have.
    #[error(
        "{field}: poller {poller:?} hands work to pool {pool:?}, and there is no pool of that name"
    )]
    UnknownPool {
        /// The field, e.g. `poller[0].pool`.
        field: String,
        /// The poller's name.
        poller: String,
        /// The pool it names.
        pool: String,
    },
    /// A pool's feeds were asked for a poller that does not feed it, or
    /// twice for one poller ([`Feeds::take`](super::Feeds::take)).
    #[error("poller {poller:?} {why}")]
    NotAFeeder {
        /// The poller's name.
        poller: String,
        /// What is wrong, naming the pool(s).
        why: String,
    },
    /// A CQ pool names a poller the topology does not have.
    #[error("{field}: CQ pool {pool} names poller {poller}, which the topology does not have")]
    UnknownPoller {
        /// The field, e.g. `cq_pool[0].pollers[1]`.
        field: String,
        /// The CQ pool.
        pool: String,
        /// The poller named.
        poller: String,
    },
    /// A CQ pool's pollers, as handed to
    /// [`CqPool::from_plan`](crate::CqPool::from_plan), are not the ones
    /// the topology names.
    #[error(
        "CQ pool {pool}: the topology names pollers {wanted:?}, the joiners given are of {given:?}"
    )]
    CqPoolPollers {
        /// The CQ pool.
        pool: String,
        /// The pollers the topology names, in its order.
        wanted: Vec<String>,
        /// The pollers of the joiners given.
        given: Vec<String>,
    },
    /// A poller owns no CQ and no CQ pool names it.
    #[error("{field}: a poller needs at least one CQ, or a [[cq_pool]] that names it")]
    NoCq {
        /// The field, e.g. `poller[0].cqs`.
        field: String,
    },
    /// A spinning poller may share a CPU with another thread of the
    /// topology, and the config asks for that to be an error
    /// (`on_shared_cpu = "error"`); the same as
    /// [`Warning::SpinnerSharesCpu`].
    #[error(
        "{field}: {mode} poller {poller:?} may share {} with {shares_with} \
         (on_shared_cpu = \"error\")",
        cpu_list(.cpus)
    )]
    SpinnerSharesCpu {
        /// The spinning poller's field, e.g. `poller[0].placement`.
        field: String,
        /// The spinning poller's name.
        poller: String,
        /// Its mode: `busy`, `hybrid` or `adaptive`.
        mode: &'static str,
        /// The CPUs both may run on.
        cpus: BTreeSet<usize>,
        /// The other thread(s): `pool "io" at pool[0].placement` or
        /// `poller "tx" at poller[1].placement`.
        shares_with: String,
    },
    /// A pool of spinning workers (`idle = "spin"`) may share a CPU with
    /// another thread of the topology or among its own workers, and the
    /// config asks for that to be an error (`on_shared_cpu = "error"`); the
    /// same as [`Warning::SpinningWorkersShareCpu`].
    #[error(
        "{field}: spinning workers of pool {pool:?} may share {} with {shares_with} \
         (on_shared_cpu = \"error\")",
        cpu_list(.cpus)
    )]
    SpinningWorkersShareCpu {
        /// The pool's field, e.g. `pool[0].placement`.
        field: String,
        /// The pool's name.
        pool: String,
        /// The CPUs shared.
        cpus: BTreeSet<usize>,
        /// The other thread(s), as for [`SpinnerSharesCpu`](Self::SpinnerSharesCpu),
        /// or `each other (4 workers)`.
        shares_with: String,
    },
}

/// A topology that works but is probably not what was meant; each is also
/// logged with `tracing::warn!` by `validate`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Warning {
    /// A busy poller may run on CPU 0, where most interrupts land.
    BusyOnCpu0 {
        /// The field, e.g. `poller[0].placement`.
        field: String,
    },
    /// Busy pollers would take more than half of the allowed CPUs.
    BusyOverHalf {
        /// Busy pollers.
        busy: usize,
        /// CPUs the process may use.
        allowed: usize,
    },
    /// A pool pins several workers to one CPU; they will share it.
    WorkersShareCpu {
        /// The field, e.g. `pool[0].placement`.
        field: String,
        /// Workers in the pool.
        threads: usize,
    },
    /// A spinning poller — Busy, or Hybrid/Adaptive with a spin window of
    /// [`LONG_SPIN`](super::LONG_SPIN) or more — may run on a CPU that
    /// another thread of the topology may run on too (a pool's workers,
    /// another poller; an unpinned placement may run anywhere). While it
    /// spins, that thread waits for its turn on the CPU. One warning per
    /// other poller or pool; `on_shared_cpu = "error"` makes it
    /// [`TopologyError::SpinnerSharesCpu`].
    SpinnerSharesCpu {
        /// The spinning poller's field, e.g. `poller[0].placement`.
        field: String,
        /// The spinning poller's name.
        poller: String,
        /// Its mode: `busy`, `hybrid` or `adaptive`.
        mode: &'static str,
        /// The CPUs both may run on.
        cpus: BTreeSet<usize>,
        /// The other thread(s): `pool "io" at pool[0].placement` or
        /// `poller "tx" at poller[1].placement`.
        shares_with: String,
    },
    /// A pool whose workers spin (`idle = "spin"`) may run on a CPU that
    /// another thread of the topology may run on (a poller, another pool),
    /// or has more workers than CPUs to run them on. A spinning worker
    /// never gives its CPU away, so whoever shares it waits for the
    /// scheduler's time slice. One warning per other poller or pool (a
    /// spinning poller reports the overlap itself, as
    /// [`SpinnerSharesCpu`](Self::SpinnerSharesCpu));
    /// `on_shared_cpu = "error"` makes it
    /// [`TopologyError::SpinningWorkersShareCpu`].
    SpinningWorkersShareCpu {
        /// The pool's field, e.g. `pool[0].placement`.
        field: String,
        /// The pool's name.
        pool: String,
        /// The CPUs shared.
        cpus: BTreeSet<usize>,
        /// The other thread(s), or `each other (4 workers)`.
        shares_with: String,
    },
}

/// `CPU 3`, `CPUs 0-3`, `CPUs 1, 4-7`.
pub(crate) fn cpu_list(cpus: &BTreeSet<usize>) -> String {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &cpu in cpus {
        match runs.last_mut() {
            Some((_, last)) if *last + 1 == cpu => *last = cpu,
            _ => runs.push((cpu, cpu)),
        }
    }
    let list: Vec<String> = runs
        .iter()
        .map(|&(a, b)| {
            if a == b {
                a.to_string()
            } else {
                format!("{a}-{b}")
            }
        })
        .collect();
    let noun = if cpus.len() == 1 { "CPU" } else { "CPUs" };
    format!("{noun} {}", list.join(", "))
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Warning::BusyOnCpu0 { field } => write!(
                f,
                "{field}: a busy poller may run on CPU 0, where interrupts land"
            ),
            Warning::BusyOverHalf { busy, allowed } => write!(
                f,
                "{busy} busy pollers take more than half of the {allowed} allowed CPUs"
            ),
            Warning::WorkersShareCpu { field, threads } => {
                write!(f, "{field}: {threads} workers pinned to one CPU share it")
            }
            Warning::SpinnerSharesCpu {
                field,
                poller,
                mode,
                cpus,
                shares_with,
            } => write!(
                f,
                "{field}: {mode} poller {poller:?} may share {} with {shares_with}; \
                 while it spins, they wait for their turn",
                cpu_list(cpus)
            ),
            Warning::SpinningWorkersShareCpu {
                field,
                pool,
                cpus,
                shares_with,
            } => write!(
                f,
                "{field}: spinning workers of pool {pool:?} may share {} with {shares_with}; \
                 they never give their CPU away",
                cpu_list(cpus)
            ),
        }
    }
}
