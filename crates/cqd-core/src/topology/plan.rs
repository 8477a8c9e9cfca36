//! The validated topology: the only values that can spawn threads.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::config::{ModeConfig, PollerConfig, PoolConfig};
use super::error::{TopologyError, Warning};
use crate::poller::Assignment;
use crate::pool::{Pool, PoolSink, PoolSpec, Routing, Work, WorkerIdle};
use crate::thread::{self, OnPriorityError, Placement, SpawnError, ThreadHandle, ThreadSpec};

/// A checked topology, made only by
/// [`TopologyConfig::validate`](super::TopologyConfig::validate). Each
/// poller and pool plan can be taken once and spawned once, so a validated
/// CPU claim cannot be spawned twice.
///
/// Nothing else makes plans, so no thread escapes validation:
///
/// ```compile_fail
/// use cqd_core::topology::{PoolConfig, PoolPlan};
/// let plan = PoolPlan { config: PoolConfig::new("io", 0), on_priority_error: Default::default() };
/// ```
///
/// ```compile_fail
/// use cqd_core::topology::PoolPlan;
/// let plan = PoolPlan::new(cqd_core::topology::PoolConfig::new("io", 0), Default::default());
/// ```
#[derive(Debug)]
pub struct Topology {
    pollers: Vec<Option<PollerPlan>>,
    pools: Vec<Option<PoolPlan>>,
    cq_pools: Vec<Option<CqPoolPlan>>,
    warnings: Vec<Warning>,
}

impl Topology {
    pub(crate) fn new(
        pollers: Vec<PollerPlan>,
        pools: Vec<PoolPlan>,
        warnings: Vec<Warning>,
    ) -> Self {
        Self {
            pollers: pollers.into_iter().map(Some).collect(),
            pools: pools.into_iter().map(Some).collect(),
            cq_pools: Vec::new(),
            warnings,
        }
    }

    pub(crate) fn with_cq_pools(mut self, cq_pools: Vec<CqPoolPlan>) -> Self {
        self.cq_pools = cq_pools.into_iter().map(Some).collect();
        self
    }

    /// Takes the plan of the CQ pool named `name` (`[[cq_pool]]`); `None`
    /// when there is no such pool or it was already taken. Build it with
    /// [`CqPool::from_plan`](crate::CqPool::from_plan).
    pub fn take_cq_pool(&mut self, name: &str) -> Option<CqPoolPlan> {
        self.cq_pools
            .iter_mut()
            .find(|p| p.as_ref().is_some_and(|p| p.config.name == name))?
            .take()
    }

    /// What `validate` warned about (also logged).
    pub fn warnings(&self) -> &[Warning] {
        &self.warnings
    }

    /// Takes the plan of the poller named `name`; `None` when there is no
    /// such poller or it was already taken.
    pub fn take_poller(&mut self, name: &str) -> Option<PollerPlan> {
        self.pollers
            .iter_mut()
            .find(|p| p.as_ref().is_some_and(|p| p.config.name == name))?
            .take()
    }

    /// Takes every poller plan not yet taken, in config order.
    pub fn take_pollers(&mut self) -> Vec<PollerPlan> {
        self.pollers.iter_mut().filter_map(Option::take).collect()
    }

    /// Takes the plan of the pool named `name`; `None` when there is no such
    /// pool or it was already taken.
    pub fn take_pool(&mut self, name: &str) -> Option<PoolPlan> {
        self.pools
            .iter_mut()
            .find(|p| p.as_ref().is_some_and(|p| p.config.name == name))?
            .take()
    }
}

/// One validated poller thread, ready to spawn.
#[derive(Debug)]
pub struct PollerPlan {
    config: PollerConfig,
    on_priority_error: OnPriorityError,
    /// Every CQ of the topology and the poller it is given to.
    owners: Arc<BTreeMap<String, String>>,
}

impl PollerPlan {
    pub(crate) fn new(
        config: PollerConfig,
        on_priority_error: OnPriorityError,
        owners: Arc<BTreeMap<String, String>>,
    ) -> Self {
        Self {
            config,
            on_priority_error,
            owners,
        }
    }

    /// The pool this poller hands work to, if the topology names one.
    pub fn pool(&self) -> Option<&str> {
        self.config.pool.as_deref()
    }

    /// The poller's name in the config.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The names of the CQs this poller owns.
    pub fn cqs(&self) -> &[String] {
        &self.config.cqs
    }

    /// The poll mode, for the poller to turn into its own mode type.
    pub fn mode(&self) -> ModeConfig {
        self.config.mode
    }

    /// Completions per poll call.
    pub fn batch(&self) -> u32 {
        self.config.batch
    }

    /// CQ options with the planned poll batch and round budget, for
    /// `split`.
    pub fn cq_options(&self) -> crate::cq::CqOptions {
        crate::cq::CqOptions {
            batch: self.config.batch as usize,
            round_budget: self.config.round_budget as usize,
            ..Default::default()
        }
    }

    /// Where the thread will run.
    pub fn placement(&self) -> &Placement {
        &self.config.placement
    }

    /// The thread name, `cqd-poller-<name>`.
    pub fn thread_name(&self) -> String {
        format!("cqd-poller-{}", self.config.name)
    }

    /// A [`PollerBuilder`](crate::poller::PollerBuilder) set up as planned:
    /// named as in the topology (its reports and metrics carry that name,
    /// its thread is `cqd-poller-<name>`), in the planned mode and wake-up
    /// timeout, and placing and prioritising its thread first thing
    /// (`on_start`; a failure aborts the spawn with the [`SpawnError`]
    /// text). Add the CQs named by [`cqs`](Self::cqs) and spawn it: the
    /// spawn refuses a CQ the topology gives another poller, and a CQ of
    /// this one left out, naming both
    /// ([`PollerError::NotAssigned`](crate::poller::PollerError::NotAssigned),
    /// [`NotAttached`](crate::poller::PollerError::NotAttached)).
    pub fn poller_builder<W, S>(self, sink: S) -> crate::poller::PollerBuilder<W, S>
    where
        W: Send + 'static,
        S: crate::sink::WorkSink<W> + 'static,
    {
        let spec = ThreadSpec {
            name: self.thread_name(),
            placement: self.config.placement,
            priority: self.config.priority,
            on_priority_error: self.on_priority_error,
        };
        let mode = self.config.mode;
        // Validated: a poller with no CQ of its own is one a CQ pool names.
        let empty = self.config.cqs.is_empty();
        let assignment = Assignment {
            cqs: self.config.cqs,
            owners: self.owners,
        };
        let builder = crate::poller::PollerBuilder::new(self.config.name, sink)
            .starts_empty(empty)
            .assigned(assignment)
            .mode(mode.poll_mode())
            .busy_naps(self.config.busy_naps)
            .on_start(move || spec.apply().map_err(|e| e.to_string()));
        match mode.timeout() {
            Some(timeout) => builder.wake_timeout(timeout),
            None => builder,
        }
    }

    /// [`poller_builder`](Self::poller_builder) with this poller's feed of
    /// its pool (see [`PoolPlan::spawn_feeds`]).
    ///
    /// # Errors
    ///
    /// [`TopologyError::NotAFeeder`] when the topology does not have this
    /// poller feed `feeds`' pool, or its feed was taken already.
    pub fn poller_builder_fed<W: Send + 'static>(
        self,
        feeds: &mut Feeds<W>,
    ) -> Result<crate::poller::PollerBuilder<W, PoolSink<W>>, TopologyError> {
        let sink = feeds.take(&self)?;
        Ok(self.poller_builder(sink))
    }

    /// Starts a thread for a poll loop of your own: named, placed,
    /// prioritised, then `body`.
    ///
    /// # Errors
    ///
    /// [`SpawnError`] when the thread cannot be created, pinned, fenced or
    /// given its priority (unless `on_priority_error = "warn"`).
    pub fn spawn<T, F>(self, body: F) -> Result<ThreadHandle<T>, SpawnError>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let spec = ThreadSpec {
            name: self.thread_name(),
            placement: self.config.placement,
            priority: self.config.priority,
            on_priority_error: self.on_priority_error,
        };
        thread::spawn(spec, body)
    }
}

/// One validated worker pool, ready to spawn.
#[derive(Debug)]
pub struct PoolPlan {
    config: PoolConfig,
    on_priority_error: OnPriorityError,
    own_cpus: bool,
    /// The pollers that name this pool as theirs, in config order.
    feeders: Vec<String>,
}

impl PoolPlan {
    pub(crate) fn new(
        config: PoolConfig,
        on_priority_error: OnPriorityError,
        feeders: Vec<String>,
    ) -> Self {
        Self {
            config,
            on_priority_error,
            own_cpus: false,
            feeders,
        }
    }

    /// The pollers that name this pool as their `pool`, in config order:
    /// [`spawn_feeds`](Self::spawn_feeds) makes one feed for each.
    pub fn feeders(&self) -> &[String] {
        &self.feeders
    }

    /// Marks the pool's CPUs as its own (no poller or other pool of the
    /// topology may run there, and it has a CPU per worker): its parking
    /// workers then spin briefly before they back off (`pool::park`).
    pub(crate) fn with_own_cpus(mut self, own: bool) -> Self {
        self.own_cpus = own;
        self
    }

    /// Whether the pool has CPUs of its own: no poller or other pool of
    /// the topology may run on them, and there is one per worker. Its
    /// parking workers then spin on their rings for a few µs before they
    /// back off and park, which a worker sharing its CPU would take from
    /// the thread about to hand it work.
    pub fn has_own_cpus(&self) -> bool {
        self.own_cpus
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// Worker threads.
    pub fn threads(&self) -> usize {
        self.config.threads
    }

    /// Slots per ring as configured (rounded up to a power of two at spawn).
    pub fn capacity(&self) -> usize {
        self.config.capacity
    }

    /// The pool's routing.
    pub fn routing(&self) -> Routing {
        self.config.routing
    }

    /// What the pool's idle workers do.
    pub fn idle(&self) -> WorkerIdle {
        self.config.idle
    }

    /// The thread spec of worker `worker`, named `cqd-worker-<pool>-<worker>`.
    fn worker_spec(&self, worker: usize) -> ThreadSpec {
        ThreadSpec {
            name: format!("cqd-worker-{}-{worker}", self.config.name),
            placement: self.config.placement.clone(),
            priority: self.config.priority,
            on_priority_error: self.on_priority_error,
        }
    }

    /// Starts the workers and returns the pool with one [`PoolSink`] per
    /// producer (one per poller that feeds the pool; each sink has its own
    /// ring to every worker, so every ring keeps a single producer).
    ///
    /// `make` is called once per worker, on the calling thread, with the
    /// worker's index; what it returns runs every item that worker takes.
    ///
    /// ```
    /// use cqd_core::pool::Pool;
    /// use cqd_core::sink::{Route, Routed, WorkSink};
    /// use cqd_core::topology::{PoolConfig, TopologyConfig};
    /// use std::collections::VecDeque;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    ///
    /// let mut topology = TopologyConfig::new()
    ///     .pool(PoolConfig::new("io", 2).capacity(64))
    ///     .validate()?;
    /// let sum = Arc::new(AtomicU64::new(0));
    /// let (pool, mut sinks) = topology.take_pool("io").unwrap().spawn(1, |_worker| {
    ///     let sum = sum.clone();
    ///     move |item: u64| { sum.fetch_add(item, Ordering::Relaxed); }
    /// })?;
    /// let mut spill: VecDeque<_> = (1..=10).map(|i| Routed { route: Route::Key(i), item: i }).collect();
    /// sinks[0].offer(&mut spill);
    /// sinks[0].flush(&mut spill, std::time::Duration::from_secs(5))?;
    /// drop(sinks); // the pollers stop first ...
    /// let snapshot = pool.join()?; // ... then the workers drain and join
    /// assert_eq!(sum.load(Ordering::Relaxed), 55);
    /// assert_eq!(snapshot.items(), 10);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`SpawnError`] when a worker cannot be started as configured, or
    /// `producers` is zero; workers already started are stopped and joined.
    pub fn spawn<W, H, M>(
        self,
        producers: usize,
        make: M,
    ) -> Result<(Pool, Vec<PoolSink<W>>), SpawnError>
    where
        W: Send + 'static,
        H: Work<W>,
        M: FnMut(usize) -> H,
    {
        let spec = PoolSpec {
            workers: (0..self.config.threads)
                .map(|w| self.worker_spec(w))
                .collect(),
            name: self.config.name,
            capacity: self.config.capacity,
            routing: self.config.routing,
            idle: self.config.idle,
            spin_before_park: self.own_cpus,
        };
        crate::pool::spawn(spec, producers, make)
    }

    /// Starts the workers for the pollers that feed the pool (those whose
    /// topology entry names it as their `pool`): one feed per poller, so
    /// the producer count is the topology's. Each poller's plan takes its
    /// own feed ([`PollerPlan::poller_builder_fed`]); use
    /// [`spawn`](Self::spawn) only for producers of your own that are not
    /// the topology's pollers.
    ///
    /// ```
    /// use cqd_core::topology::{PollerConfig, PoolConfig, TopologyConfig};
    ///
    /// let mut topology = TopologyConfig::new()
    ///     .poller(PollerConfig::new("net").cq("cq0").pool("io"))
    ///     .pool(PoolConfig::new("io", 2))
    ///     .validate()?;
    /// let (pool, mut feeds) = topology.take_pool("io").unwrap().spawn_feeds(|_worker| |_: u64| {})?;
    /// let net = topology.take_poller("net").unwrap();
    /// let builder = net.poller_builder_fed(&mut feeds)?; // add the CQ "cq0", spawn
    /// # drop((builder, feeds));
    /// # pool.join()?;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    ///
    /// As [`spawn`](Self::spawn); [`SpawnError::NoProducers`] when no
    /// poller names the pool.
    pub fn spawn_feeds<W, H, M>(mut self, make: M) -> Result<(Pool, Feeds<W>), SpawnError>
    where
        W: Send + 'static,
        H: Work<W>,
        M: FnMut(usize) -> H,
    {
        let feeders = std::mem::take(&mut self.feeders);
        let pool = self.config.name.clone();
        let (spawned, sinks) = self.spawn(feeders.len(), make)?;
        Ok((
            spawned,
            Feeds {
                pool,
                sinks: feeders
                    .into_iter()
                    .zip(sinks.into_iter().map(Some))
                    .collect(),
            },
        ))
    }
}

/// The feeds of a pool spawned for its pollers
/// ([`PoolPlan::spawn_feeds`]): one [`PoolSink`] per poller that names the
/// pool, each taken once, by that poller's plan. A feed never taken is
/// dropped with this value (as a stopped poller's is).
pub struct Feeds<W> {
    pool: String,
    sinks: Vec<(String, Option<PoolSink<W>>)>,
}

impl<W> std::fmt::Debug for Feeds<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Feeds")
            .field("pool", &self.pool)
            .field("not_taken", &self.untaken())
            .finish()
    }
}

impl<W> Feeds<W> {
    /// The pollers whose feed was not taken.
    fn untaken(&self) -> Vec<&str> {
        self.sinks
            .iter()
            .filter(|(_, s)| s.is_some())
            .map(|(n, _)| n.as_str())
            .collect()
    }
}

impl<W> Drop for Feeds<W> {
    fn drop(&mut self) {
        let left = self.untaken();
        if !left.is_empty() {
            tracing::warn!(pool = %self.pool, pollers = ?left,
                "feeds never taken: these pollers of the topology never fed the pool");
        }
    }
}

impl<W: Send + 'static> Feeds<W> {
    /// The pool's name.
    pub fn pool(&self) -> &str {
        &self.pool
    }

    /// The feed of the poller `plan` plans.
    ///
    /// # Errors
    ///
    /// [`TopologyError::NotAFeeder`] when the topology does not have that
    /// poller feed this pool, or its feed was taken already.
    pub fn take(&mut self, plan: &PollerPlan) -> Result<PoolSink<W>, TopologyError> {
        let refuse = |why: String| TopologyError::NotAFeeder {
            poller: plan.name().to_string(),
            why,
        };
        match plan.pool() {
            None => {
                return Err(refuse(format!(
                    "names no pool in the topology, so it has no feed of pool {:?}",
                    self.pool
                )))
            }
            Some(p) if p != self.pool => {
                return Err(refuse(format!(
                    "hands work to pool {p:?}, not to pool {:?}",
                    self.pool
                )))
            }
            Some(_) => {}
        }
        self.sinks
            .iter_mut()
            .find(|(n, _)| n == plan.name())
            .and_then(|(_, s)| s.take())
            .ok_or_else(|| refuse(format!("took its feed of pool {:?} already", self.pool)))
    }
}

/// One validated CQ pool (`[[cq_pool]]`), ready to build over its running
/// pollers with [`CqPool::from_plan`](crate::CqPool::from_plan).
#[derive(Debug)]
pub struct CqPoolPlan {
    pub(crate) config: super::config::CqPoolConfig,
}

impl CqPoolPlan {
    pub(crate) fn new(config: super::config::CqPoolConfig) -> Self {
        Self { config }
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.config.name
    }

    /// The pollers its CQs go to, in the topology's order.
    pub fn pollers(&self) -> &[String] {
        &self.config.pollers
    }

    /// Its settings as the topology gives them.
    pub fn config(&self) -> &super::config::CqPoolConfig {
        &self.config
    }
}
