//! `validate()`: the one check between plain data and threads.

use std::collections::{BTreeMap, BTreeSet};

use std::time::Duration;

use super::config::{CqPoolConfig, ModeConfig, OnSharedCpu, PoolConfig, TopologyConfig};
use super::error::{TopologyError, Warning};
use super::plan::{CqPoolPlan, PollerPlan, PoolPlan, Topology};
use crate::mode::MIN_WAKE_TIMEOUT;
use crate::pool::WorkerIdle;
use crate::thread::{Placement, Priority};

/// The largest ring capacity accepted (2^24 slots per ring).
pub const MAX_CAPACITY: usize = 1 << 24;

/// A Hybrid spin window, or an Adaptive `max_window_us`, at least this long
/// makes the poller a *spinner* for the shared-CPU check, as Busy is: after
/// each completion it spins (pause hints, yields, never a nap) for up to
/// that long, so with completions arriving more often than that it never
/// leaves its CPU. The defaults (50 µs, 2–200 µs) are well below.
pub const LONG_SPIN: Duration = Duration::from_millis(1);

impl TopologyConfig {
    /// Checks the whole topology against the CPUs this process may use
    /// (`sched_getaffinity`) and returns the only type that can spawn its
    /// threads. Warnings are logged with `tracing::warn!` and kept in
    /// [`Topology::warnings`].
    ///
    /// # Errors
    ///
    /// The first problem found, naming its field: see [`TopologyError`].
    pub fn validate(&self) -> Result<Topology, TopologyError> {
        let allowed = crate::thread::allowed_cpus().map_err(|e| TopologyError::Affinity {
            errno: e.raw_os_error(),
        })?;
        self.validate_for(&allowed)
    }

    /// [`validate`](Self::validate) against a given set of allowed CPUs, for
    /// planning a machine other than this one (and for tests).
    ///
    /// # Errors
    ///
    /// As [`validate`](Self::validate).
    pub fn validate_for(&self, allowed: &BTreeSet<usize>) -> Result<Topology, TopologyError> {
        let mut warnings = Vec::new();
        let mut names = BTreeSet::new();
        let mut cq_owner: BTreeMap<&str, String> = BTreeMap::new();
        let mut claimed: BTreeMap<usize, String> = BTreeMap::new();
        let mut busy = 0;

        for (i, p) in self.pollers.iter().enumerate() {
            let at = format!("poller[{i}]");
            check_name(&format!("{at}.name"), &p.name, &mut names)?;
            let pooled = self
                .cq_pools
                .iter()
                .any(|c| c.pollers.iter().any(|q| q == &p.name));
            if p.cqs.is_empty() && !pooled {
                return Err(TopologyError::NoCq {
                    field: format!("{at}.cqs"),
                });
            }
            for (j, cq) in p.cqs.iter().enumerate() {
                let field = format!("{at}.cqs[{j}]");
                if let Some(owner) = cq_owner.get(cq.as_str()) {
                    return Err(TopologyError::CqOwnedTwice {
                        field,
                        cq: cq.clone(),
                        owned_by: owner.clone(),
                    });
                }
                cq_owner.insert(cq, field);
            }
            if p.batch == 0 || p.batch > 4096 {
                return Err(out_of_range(&format!("{at}.batch"), p.batch, "1 to 4096"));
            }
            check_mode(&format!("{at}.mode"), &p.name, &p.mode)?;
            let field = format!("{at}.placement");
            check_placement(&field, &p.placement, allowed)?;
            check_priority(&format!("{at}.priority"), p.priority)?;
            if p.mode.is_busy() {
                busy += 1;
                // A busy poller claims its CPU when it can run on only one.
                let only = match &p.placement {
                    Placement::Fixed(cpu) => Some(*cpu),
                    Placement::Fenced(set) if set.len() == 1 => set.first().copied(),
                    _ => None,
                };
                if let Some(cpu) = only {
                    if let Some(first) = claimed.insert(cpu, field.clone()) {
                        return Err(TopologyError::CpuClaimedTwice {
                            field,
                            cpu,
                            claimed_by: first,
                        });
                    }
                }
                let may_use_0 = match &p.placement {
                    Placement::Unpinned => allowed.contains(&0),
                    placement => placement.cpus().contains(&0),
                };
                if may_use_0 {
                    warnings.push(Warning::BusyOnCpu0 { field });
                }
            }
        }
        if busy * 2 > allowed.len() {
            warnings.push(Warning::BusyOverHalf {
                busy,
                allowed: allowed.len(),
            });
        }

        let mut cq_pool_names = BTreeSet::new();
        for (i, c) in self.cq_pools.iter().enumerate() {
            self.check_cq_pool(&format!("cq_pool[{i}]"), c, &mut cq_pool_names)?;
        }
        let mut names = BTreeSet::new();
        for (i, p) in self.pools.iter().enumerate() {
            check_pool(&format!("pool[{i}]"), p, allowed, &mut names, &mut warnings)?;
        }
        for (i, p) in self.pollers.iter().enumerate() {
            if let Some(pool) = &p.pool {
                if !self.pools.iter().any(|q| &q.name == pool) {
                    return Err(TopologyError::UnknownPool {
                        field: format!("poller[{i}].pool"),
                        poller: p.name.clone(),
                        pool: pool.clone(),
                    });
                }
            }
        }
        self.check_shared_cpus(allowed, &mut warnings)?;
        self.check_spinning_pools(allowed, &mut warnings)?;

        for w in &warnings {
            tracing::warn!(target: "cqd::topology", "{w}");
        }
        // Which poller the topology gives each CQ, for the check at a
        // poller's spawn (a CQ attached elsewhere is refused, naming both).
        let owners: std::sync::Arc<BTreeMap<String, String>> = std::sync::Arc::new(
            self.pollers
                .iter()
                .flat_map(|p| p.cqs.iter().map(|cq| (cq.clone(), p.name.clone())))
                .collect(),
        );
        let pollers = self
            .pollers
            .iter()
            .map(|p| {
                PollerPlan::new(
                    p.clone(),
                    self.on_priority_error,
                    std::sync::Arc::clone(&owners),
                )
            })
            .collect();
        let pools = self
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let feeders = self
                    .pollers
                    .iter()
                    .filter(|q| q.pool.as_deref() == Some(p.name.as_str()))
                    .map(|q| q.name.clone())
                    .collect();
                PoolPlan::new(p.clone(), self.on_priority_error, feeders)
                    .with_own_cpus(self.pool_has_own_cpus(i, allowed))
            })
            .collect();
        let cq_pools = self.cq_pools.iter().cloned().map(CqPoolPlan::new).collect();
        Ok(Topology::new(pollers, pools, warnings).with_cq_pools(cq_pools))
    }

    /// A CQ pool: a unique name, pollers the topology has (each once),
    /// CQs of at least one entry, a resize limit not below them.
    fn check_cq_pool<'a>(
        &self,
        at: &str,
        c: &'a CqPoolConfig,
        names: &mut BTreeSet<&'a str>,
    ) -> Result<(), TopologyError> {
        check_name(&format!("{at}.name"), &c.name, names)?;
        if c.cqe == 0 {
            return Err(out_of_range(&format!("{at}.cqe"), c.cqe, "at least 1"));
        }
        if c.max_cqs == 0 {
            return Err(out_of_range(
                &format!("{at}.max_cqs"),
                c.max_cqs,
                "at least 1",
            ));
        }
        if let Some(max) = c.resize_up_to {
            if max < c.cqe {
                return Err(out_of_range(
                    &format!("{at}.resize_up_to"),
                    max,
                    "at least the pool's cqe",
                ));
            }
        }
        if c.pollers.is_empty() {
            return Err(TopologyError::NoCq {
                field: format!("{at}.pollers"),
            });
        }
        let mut seen = BTreeSet::new();
        for (j, poller) in c.pollers.iter().enumerate() {
            let field = format!("{at}.pollers[{j}]");
            if !self.pollers.iter().any(|p| &p.name == poller) {
                return Err(TopologyError::UnknownPoller {
                    field,
                    pool: c.name.clone(),
                    poller: poller.clone(),
                });
            }
            if !seen.insert(poller.as_str()) {
                return Err(TopologyError::BadName {
                    field,
                    name: poller.clone(),
                });
            }
        }
        Ok(())
    }
}

impl TopologyConfig {
    /// Each spinning poller against every other poller and pool whose
    /// placement may overlap its own (an unpinned one may run on any
    /// allowed CPU): a warning each, or with `on_shared_cpu = "error"` an
    /// error for the first. Two spinners are reported once, at the first.
    fn check_shared_cpus(
        &self,
        allowed: &BTreeSet<usize>,
        warnings: &mut Vec<Warning>,
    ) -> Result<(), TopologyError> {
        let reach = |placement: &Placement| reach(placement, allowed);
        let pollers = self.pollers.iter().enumerate().map(|(k, p)| {
            let with = format!("poller {:?} at poller[{k}].placement", p.name);
            (k, with, reach(&p.placement), spins_long(&p.mode))
        });
        let pools = self.pools.iter().enumerate().map(|(j, p)| {
            let with = format!("pool {:?} at pool[{j}].placement", p.name);
            (usize::MAX, with, reach(&p.placement), false)
        });
        let others: Vec<_> = pollers.chain(pools).collect();
        for (i, p) in self.pollers.iter().enumerate() {
            if !spins_long(&p.mode) {
                continue;
            }
            let mine = reach(&p.placement);
            for (k, shares_with, theirs, spinner) in &others {
                // Itself, or a spinner already reported with this one.
                if *k == i || (*spinner && *k < i) {
                    continue;
                }
                let cpus: BTreeSet<usize> = mine.intersection(theirs).copied().collect();
                if cpus.is_empty() {
                    continue;
                }
                let field = format!("poller[{i}].placement");
                let (poller, mode) = (p.name.clone(), p.mode.poll_mode().name());
                let shares_with = shares_with.clone();
                if self.on_shared_cpu == OnSharedCpu::Error {
                    return Err(TopologyError::SpinnerSharesCpu {
                        field,
                        poller,
                        mode,
                        cpus,
                        shares_with,
                    });
                }
                warnings.push(Warning::SpinnerSharesCpu {
                    field,
                    poller,
                    mode,
                    cpus,
                    shares_with,
                });
            }
        }
        Ok(())
    }
}

impl TopologyConfig {
    /// Each pool of spinning workers (`idle = "spin"`) against its own
    /// workers (more workers than CPUs to run them on), every poller that
    /// does not spin itself (a spinning poller reported the overlap in
    /// [`check_shared_cpus`](Self::check_shared_cpus)) and every other pool
    /// whose placement may overlap: a warning each, or with
    /// `on_shared_cpu = "error"` an error for the first. Two spinning pools
    /// are reported once, at the first.
    fn check_spinning_pools(
        &self,
        allowed: &BTreeSet<usize>,
        warnings: &mut Vec<Warning>,
    ) -> Result<(), TopologyError> {
        let reach = |placement: &Placement| reach(placement, allowed);
        for (i, p) in self.pools.iter().enumerate() {
            if p.idle != WorkerIdle::Spin {
                continue;
            }
            let field = format!("pool[{i}].placement");
            let mine = reach(&p.placement);
            let mut found: Vec<(BTreeSet<usize>, String)> = Vec::new();
            if p.threads > mine.len() {
                found.push((mine.clone(), format!("each other ({} workers)", p.threads)));
            }
            for (k, q) in self.pollers.iter().enumerate() {
                if spins_long(&q.mode) {
                    continue;
                }
                let cpus: BTreeSet<usize> =
                    mine.intersection(&reach(&q.placement)).copied().collect();
                if !cpus.is_empty() {
                    found.push((
                        cpus,
                        format!("poller {:?} at poller[{k}].placement", q.name),
                    ));
                }
            }
            for (j, q) in self.pools.iter().enumerate() {
                if j == i || (q.idle == WorkerIdle::Spin && j < i) {
                    continue;
                }
                let cpus: BTreeSet<usize> =
                    mine.intersection(&reach(&q.placement)).copied().collect();
                if !cpus.is_empty() {
                    found.push((cpus, format!("pool {:?} at pool[{j}].placement", q.name)));
                }
            }
            for (cpus, shares_with) in found {
                let (field, pool) = (field.clone(), p.name.clone());
                if self.on_shared_cpu == OnSharedCpu::Error {
                    return Err(TopologyError::SpinningWorkersShareCpu {
                        field,
                        pool,
                        cpus,
                        shares_with,
                    });
                }
                warnings.push(Warning::SpinningWorkersShareCpu {
                    field,
                    pool,
                    cpus,
                    shares_with,
                });
            }
        }
        Ok(())
    }
}

impl TopologyConfig {
    /// Whether pool `i` has CPUs of its own: a CPU per worker in its reach
    /// (an unpinned placement reaches every allowed CPU), and no poller or
    /// other pool that may run on any of them.
    fn pool_has_own_cpus(&self, i: usize, allowed: &BTreeSet<usize>) -> bool {
        let reach = |placement: &Placement| reach(placement, allowed);
        let Some(pool) = self.pools.get(i) else {
            return false;
        };
        let mine = reach(&pool.placement);
        pool.threads <= mine.len()
            && self
                .pollers
                .iter()
                .all(|p| mine.is_disjoint(&reach(&p.placement)))
            && self
                .pools
                .iter()
                .enumerate()
                .all(|(j, q)| j == i || mine.is_disjoint(&reach(&q.placement)))
    }
}

/// The CPUs a thread with `placement` may run on: an unpinned one, every
/// allowed CPU.
fn reach(placement: &Placement, allowed: &BTreeSet<usize>) -> BTreeSet<usize> {
    match placement {
        Placement::Unpinned => allowed.clone(),
        placement => placement.cpus(),
    }
}

/// Whether a poller in `mode` may spin for [`LONG_SPIN`] or more without
/// giving its CPU away: Busy always (it spins as long as completions
/// flow), Hybrid and Adaptive with a window that long.
fn spins_long(mode: &ModeConfig) -> bool {
    let window_us = match *mode {
        ModeConfig::Busy => return true,
        ModeConfig::Event { .. } => return false,
        ModeConfig::Hybrid { spin_window_us, .. } => spin_window_us,
        ModeConfig::Adaptive { max_window_us, .. } => max_window_us,
    };
    Duration::from_micros(window_us) >= LONG_SPIN
}

fn check_pool<'a>(
    at: &str,
    p: &'a PoolConfig,
    allowed: &BTreeSet<usize>,
    names: &mut BTreeSet<&'a str>,
    warnings: &mut Vec<Warning>,
) -> Result<(), TopologyError> {
    check_name(&format!("{at}.name"), &p.name, names)?;
    if p.threads == 0 {
        return Err(TopologyError::ZeroThreads {
            field: format!("{at}.threads"),
        });
    }
    if p.capacity == 0 {
        return Err(TopologyError::ZeroCapacity {
            field: format!("{at}.capacity"),
        });
    }
    if p.capacity > MAX_CAPACITY {
        return Err(out_of_range(
            &format!("{at}.capacity"),
            p.capacity,
            "at most 16777216 slots per ring",
        ));
    }
    let field = format!("{at}.placement");
    check_placement(&field, &p.placement, allowed)?;
    if matches!(p.placement, Placement::Fixed(_)) && p.threads > 1 {
        warnings.push(Warning::WorkersShareCpu {
            field,
            threads: p.threads,
        });
    }
    check_priority(&format!("{at}.priority"), p.priority)
}

fn check_name<'a>(
    field: &str,
    name: &'a str,
    names: &mut BTreeSet<&'a str>,
) -> Result<(), TopologyError> {
    if name.is_empty() || !names.insert(name) {
        return Err(TopologyError::BadName {
            field: field.to_owned(),
            name: name.to_owned(),
        });
    }
    Ok(())
}

fn check_placement(
    field: &str,
    placement: &Placement,
    allowed: &BTreeSet<usize>,
) -> Result<(), TopologyError> {
    if let Placement::Fenced(set) = placement {
        if set.is_empty() {
            return Err(out_of_range(field, "[]", "a fence names at least one CPU"));
        }
    }
    for cpu in placement.cpus() {
        if !allowed.contains(&cpu) {
            return Err(TopologyError::CpuNotAllowed {
                field: field.to_owned(),
                cpu,
                allowed: allowed.clone(),
            });
        }
    }
    Ok(())
}

fn check_mode(field: &str, poller: &str, mode: &ModeConfig) -> Result<(), TopologyError> {
    if let Some(timeout) = mode.timeout() {
        if timeout < MIN_WAKE_TIMEOUT {
            return Err(TopologyError::WakeTimeoutTooShort {
                field: format!("{field}.timeout_ms"),
                poller: poller.to_owned(),
                timeout,
                min: MIN_WAKE_TIMEOUT,
            });
        }
    }
    if let ModeConfig::Adaptive {
        min_window_us,
        max_window_us,
        cpu_budget_percent,
        ..
    } = *mode
    {
        if min_window_us > max_window_us {
            return Err(out_of_range(
                &format!("{field}.min_window_us"),
                min_window_us,
                "at most max_window_us",
            ));
        }
        if cpu_budget_percent == 0 || cpu_budget_percent > 100 {
            return Err(out_of_range(
                &format!("{field}.cpu_budget_percent"),
                cpu_budget_percent,
                "1 to 100",
            ));
        }
    }
    Ok(())
}

fn check_priority(field: &str, priority: Option<Priority>) -> Result<(), TopologyError> {
    match priority {
        Some(Priority::Nice(n)) if !(-20..=19).contains(&n) => {
            Err(out_of_range(&format!("{field}.nice"), n, "-20 to 19"))
        }
        Some(Priority::Fifo(p)) if !(1..=99).contains(&p) => {
            Err(out_of_range(&format!("{field}.fifo"), p, "1 to 99"))
        }
        _ => Ok(()),
    }
}

fn out_of_range(field: &str, value: impl ToString, expected: &'static str) -> TopologyError {
    TopologyError::OutOfRange {
        field: field.to_owned(),
        value: value.to_string(),
        expected,
    }
}
