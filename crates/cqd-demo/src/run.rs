//! One run: the two halves — [`ServerSide`] (servers, their pollers and
//! the worker pool) and [`LoadSide`] (the load generator and its pollers) —
//! joined by connections, then the load, the read-back, each half's
//! shutdown and the report.
//!
//! [`run_on`] puts both halves in one process and hands each connection's
//! endpoints over in memory. A two-process transport runs `ServerSide` in
//! `serve` and `LoadSide` in `load`, exchanging the endpoints of each
//! [`SrvConn`] / [`LoadConn`] pair over a socket instead; each half stops
//! on its own (load first: it stops posting before the servers close).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd_core::pool::Pool;
use cqd_core::topology::{CqPoolPlan, ModeConfig, PoolPlan};
use cqd_core::{NoSink, NoWork, PollerThread, Registration, ShutdownOptions, SystemReport};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::backend::sim::SimFabric;
use crate::backend::{Link, Node};
use crate::config::{Config, ModeArg, Stop};
use crate::load::{Load, LoadConn, LoadSpec, Phase};
use crate::naive::NaiveSide;
use crate::report::{self, Report};
use crate::server::{Server, ServerSpec, ServerWork, SrvConn};
use crate::topo::{self, Assigned};
use crate::DemoError;

/// How long the load may take to finish what is in flight.
const DRAIN: Duration = Duration::from_secs(10);

/// How long a connection's close may take ([`ServerSide::close`]).
const RELEASE: Duration = Duration::from_secs(5);

/// Runs the demo once on the simulated NIC, in `mode` (None: the
/// topology's modes).
///
/// # Errors
/// Bad topology, setup failures. Failed requests and failed verdicts are
/// in the report, not errors.
pub fn run_sim(cfg: &Config, mode: Option<ModeArg>) -> Result<Report, DemoError> {
    let fabric = SimFabric::new(cfg.fault_rate, cfg.seed);
    let open = |name: &str| Ok(fabric.open(name));
    let mut report = run_on(cfg, mode, open)?;
    let nic = fabric.stats();
    report.nic = Some(report::NicCounts {
        executed: nic.executed,
        errors: nic.errors,
        flushed: nic.flushed,
        injected_errors: nic.injected_errors,
    });
    Ok(report)
}

/// Runs the demo once on a real RDMA device, both halves in this process
/// (`--backend verbs`): every node is a protection domain on the device
/// `cfg.device`.
///
/// # Errors
/// No such device, setup failures (as [`run_sim`]).
#[cfg(feature = "verbs")]
pub fn run_verbs(cfg: &Config, mode: Option<ModeArg>) -> Result<Report, DemoError> {
    let device =
        crate::backend::verbs::VerbsDevice::open(cfg.device.as_deref(), verbs_options(cfg))?;
    tracing::info!(device = device.name(), "verbs: one process, both halves");
    run_on(cfg, mode, |name: &str| Ok(device.node(name)?))
}

/// The verbs options of a configuration.
#[cfg(feature = "verbs")]
pub fn verbs_options(cfg: &Config) -> crate::backend::verbs::VerbsOptions {
    crate::backend::verbs::VerbsOptions {
        port: cfg.ib_port,
        gid_index: cfg.gid_index,
        retry_cnt: cfg.retry_cnt,
    }
}

/// Handler names by (poller index, slot, generation), for the accounts.
pub type Names = HashMap<(usize, u32, u16), String>;

/// A poller's (name, role, mode), for the report.
pub type Role = (String, &'static str, ModeConfig);

fn name_of(names: &mut Names, poller: usize, cq: &str, reg: &Registration, name: &str) {
    let k = reg.key();
    // What a completion's wr_id names (its slot and generation fields),
    // for reading --trace-completions' lines.
    tracing::debug!(
        cq,
        handler = name,
        slot = k.slot(),
        generation = k.generation(),
        "handler registered"
    );
    names
        .entry((poller, k.slot(), k.generation()))
        .and_modify(|n| {
            n.push('|');
            n.push_str(name);
        })
        .or_insert_with(|| name.to_string());
}

/// The server half: cqd's pollers and pool, or the naive baseline.
enum Side<N: Node> {
    Cqd(Box<ServerSide<N>>),
    Naive(NaiveSide<N>),
}

impl<N: Node> Side<N> {
    fn accept(&mut self, server: u32) -> Result<Arc<SrvConn<N>>, DemoError> {
        match self {
            Side::Cqd(s) => s.accept(server),
            Side::Naive(s) => s.accept(server),
        }
    }

    fn stop(self) -> Stopped<Vec<Server<N>>> {
        match self {
            Side::Cqd(s) => (*s).stop(),
            Side::Naive(s) => s.stop(),
        }
    }

    fn close(&mut self, server: u32, conn: Arc<SrvConn<N>>) -> Result<(), String> {
        match self {
            Side::Cqd(s) => match s.close(server, vec![conn]).pop() {
                None => Ok(()),
                Some(e) => Err(e),
            },
            Side::Naive(_) => Err("the naive baseline closes no connection".into()),
        }
    }
}

/// What a stopped half leaves for the report.
#[derive(Debug)]
pub struct Stopped<T> {
    /// The half's state (servers, or the load generator).
    pub state: T,
    /// Its pollers' and pool's final reports.
    pub system: SystemReport,
    /// Its pollers, in `system`'s order.
    pub roles: Vec<Role>,
    /// Its handlers' names, by poller index in `system`.
    pub names: Names,
    /// What went wrong while stopping.
    pub notes: Vec<String>,
}

/// The servers of a run, their pollers and their worker pool.
#[derive(Debug)]
pub struct ServerSide<N: Node> {
    servers: Vec<Server<N>>,
    pollers: Vec<PollerThread>,
    pool: Pool,
    roles: Vec<Role>,
    poller_of: HashMap<u32, usize>,
    names: Names,
    watched: crate::prom::Watched,
    /// Of each server's CQs, how many are watched (and named) so far.
    cqs_watched: Vec<usize>,
    /// `serve`: the session's connections on server 0, by number (for
    /// `reconnect`).
    session: Vec<Option<Arc<SrvConn<N>>>>,
}

impl<N: Node> ServerSide<N> {
    /// Makes `cfg.servers` servers on nodes from `open` (server `i` on
    /// node `srv<i>`, sized for `conns(i)` connections), spawns the pool
    /// and the pollers of `plans`.
    ///
    /// # Errors
    /// Setup failures.
    pub fn start(
        cfg: &Config,
        plans: Vec<Assigned>,
        cq_pools: Vec<CqPoolPlan>,
        pool: PoolPlan,
        conns: impl Fn(u32) -> u32,
        open: &impl Fn(&str) -> Result<N, DemoError>,
    ) -> Result<Self, DemoError> {
        let mut poller_of = HashMap::new();
        for (pi, a) in plans.iter().enumerate() {
            for &s in &a.cqs {
                poller_of.insert(s, pi);
            }
        }
        // One feed per server poller: the topology names the pool of each.
        let (pool, mut feeds) = pool
            .spawn_feeds(|_| |w: ServerWork<N>| w.run())
            .map_err(|e| DemoError::Setup(format!("pool {}: {e}", topo::POOL)))?;
        // The pollers start empty: each server's CQ pool adds its CQ to its
        // poller at the server's first connection.
        let mut pollers = Vec::new();
        let mut roles = Vec::new();
        let mut options = Vec::new();
        for a in plans {
            let name = a.plan.name().to_string();
            let mode = a.plan.mode();
            options.push(cq_options(cfg, &a));
            let b = a
                .plan
                .poller_builder_fed(&mut feeds)
                .map_err(|e| DemoError::Topology(e.to_string()))?
                .drain_timeout(cfg.drain_timeout)
                .starts_empty(true);
            pollers.push(
                b.spawn()
                    .map_err(|e| DemoError::Setup(format!("poller {name}: {e}")))?,
            );
            roles.push((name, "server", mode));
        }
        let mut servers = Vec::new();
        for (s, plan) in (0..cfg.servers).zip(cq_pools) {
            let pi = *poller_of
                .get(&s)
                .ok_or_else(|| DemoError::Topology(format!("no poller for srv{s}")))?;
            let name = format!("srv{s}");
            let joiner = pollers[pi]
                .joiner()
                .ok_or_else(|| DemoError::Setup(format!("poller of {name}: no joiner")))?;
            servers.push(Server::pooled(
                open(&name)?,
                server_spec(cfg, conns(s)),
                options[pi].clone(),
                plan,
                joiner,
            )?);
        }
        let mut watched = crate::prom::Watched::new();
        for s in &servers {
            watched.server(s.name(), s.stats());
        }
        for p in &pollers {
            watched.poller(p);
        }
        watched.pool(&pool);
        Ok(ServerSide {
            servers,
            pollers,
            pool,
            roles,
            poller_of,
            names: Names::new(),
            watched,
            cqs_watched: vec![0; cfg.servers as usize],
            session: Vec::new(),
        })
    }

    /// A new connection on server `server` (connect its link to the
    /// peer's endpoint; its receives come from the server's SRQ).
    ///
    /// # Errors
    /// No such server, or the device refused.
    pub fn accept(&mut self, server: u32) -> Result<Arc<SrvConn<N>>, DemoError> {
        let srv = self
            .servers
            .get_mut(server as usize)
            .ok_or_else(|| DemoError::Setup(format!("no server {server}")))?;
        let conn = srv.accept()?;
        let pi = self.poller_of.get(&server).copied().unwrap_or(0);
        let cq = format!("srv{server}");
        name_of(&mut self.names, pi, &cq, conn.registration(), conn.name());
        // The CQ its pool made for it, and the SRQ's handler bound there
        // with its first connection.
        let handles = srv.cq_handles();
        let watched = &mut self.cqs_watched[server as usize];
        if handles.len() > *watched {
            if *watched == 0 {
                if let Some(reg) = srv.srq_registration() {
                    name_of(&mut self.names, pi, &cq, reg, &format!("{cq}/srq"));
                }
            }
            for h in &handles[*watched..] {
                self.watched.cq(h);
            }
            *watched = handles.len();
        }
        Ok(conn)
    }

    /// Closes `conns` of server `server` ([`Server::close`]), each within
    /// `RELEASE`, while the others run: made for a session that did not
    /// start, or closed by the load's churn. What did not close is named
    /// in the return.
    pub fn close(&mut self, server: u32, conns: Vec<Arc<SrvConn<N>>>) -> Vec<String> {
        let Some(srv) = self.servers.get(server as usize) else {
            return Vec::new();
        };
        conns
            .into_iter()
            .filter_map(|c| srv.close(c, RELEASE).err())
            .collect()
    }

    /// `serve`: the session's connections on server 0, by their numbers
    /// in the session (H5).
    pub fn hold_session(&mut self, conns: Vec<Arc<SrvConn<N>>>) {
        self.session = conns.into_iter().map(Some).collect();
    }

    /// `serve`, H6 `reconnect`: closes the session's connection `conn` on
    /// server 0 while the others run, makes its replacement, connects it
    /// to the load's `endpoint` and returns its own.
    ///
    /// # Errors
    /// No such connection, or its close or the new one failed (in words).
    pub fn reconnect(
        &mut self,
        conn: u32,
        endpoint: &<N::Link as Link>::Endpoint,
    ) -> Result<<N::Link as Link>::Endpoint, String> {
        let old = self
            .session
            .get_mut(conn as usize)
            .and_then(Option::take)
            .ok_or_else(|| format!("the session has no connection {conn}"))?;
        if let Some(e) = self.close(0, vec![old]).pop() {
            return Err(e);
        }
        let new = self.accept(0).map_err(|e| e.to_string())?;
        new.link().connect(endpoint).map_err(|e| e.to_string())?;
        let ours = new.link().endpoint().map_err(|e| e.to_string())?;
        self.session[conn as usize] = Some(new);
        Ok(ours)
    }

    /// Server `i`.
    pub fn server(&self, i: u32) -> Option<&Server<N>> {
        self.servers.get(i as usize)
    }

    /// Closes: waits for the workers to go idle, moves every QP to error,
    /// stops the pollers (which collect every flush), joins the pool.
    pub fn stop(mut self) -> Stopped<Vec<Server<N>>> {
        self.session.clear();
        let mut notes = Vec::new();
        for s in &self.servers {
            if !s.quiesce(Duration::from_secs(5)) {
                notes.push(format!("{}: workers still busy at the close", s.name()));
            }
        }
        let servers = self.servers;
        // The flush step: every QP to error; on a device that raises no
        // LAST_WQE_REACHED (rxe), every connection closed, which alone
        // frees the SRQ's receives for the stop's hand-back.
        let mut closes = Vec::new();
        let system = cqd_core::shutdown_with(
            ShutdownOptions::default().pool_join_timeout(Duration::from_secs(10)),
            || {
                for s in &servers {
                    closes.extend(s.stop_connections(RELEASE));
                }
            },
            self.pollers,
            [self.pool],
        );
        notes.extend(closes.into_iter().map(|e| format!("at the stop: {e}")));
        self.watched.release();
        Stopped {
            state: servers,
            system,
            roles: self.roles,
            names: self.names,
            notes,
        }
    }
}

/// The load generator of a run and its pollers.
#[derive(Debug)]
pub struct LoadSide<N: Node> {
    load: Load<N>,
    pollers: Vec<PollerThread>,
    roles: Vec<Role>,
    poller_of: HashMap<u32, usize>,
    load_cqs: u32,
    names: Names,
    watched: crate::prom::Watched,
}

/// How the load went.
#[derive(Debug, Clone)]
pub struct Driven {
    /// The load phase.
    pub load_elapsed: Duration,
    /// The read-back.
    pub verify_elapsed: Duration,
    /// What went wrong.
    pub notes: Vec<String>,
    /// `--churn`'s counts.
    pub churn: Option<report::ChurnCounts>,
}

/// One close-and-open of a connection during the load (`--churn`): the
/// load side's, given the load side; what failed, in words.
pub type ChurnStep<'a, N> = dyn FnMut(&mut LoadSide<N>) -> Result<(), String> + 'a;

impl<N: Node> LoadSide<N> {
    /// Makes the load generator on node `load` from `open`, with the CQs
    /// `load0` … of `plans`, and spawns its pollers.
    ///
    /// # Errors
    /// Setup failures.
    pub fn start(
        cfg: &Config,
        plans: Vec<Assigned>,
        load_cqs: u32,
        open: &impl Fn(&str) -> Result<N, DemoError>,
    ) -> Result<Self, DemoError> {
        let mut poller_of = HashMap::new();
        for (pi, a) in plans.iter().enumerate() {
            for &k in &a.cqs {
                poller_of.insert(k, pi);
            }
        }
        let specs = (0..load_cqs)
            .map(|k| {
                let pi = poller_of.get(&k).copied().unwrap_or(0);
                let options = plans
                    .get(pi)
                    .map(|a| cq_options(cfg, a))
                    .ok_or_else(|| DemoError::Topology(format!("no poller for load{k}")))?;
                Ok((format!("load{k}"), options))
            })
            .collect::<Result<Vec<_>, DemoError>>()?;
        let spec = LoadSpec {
            servers: cfg.servers,
            blocks_per_server: cfg.blocks_per_server,
            block_size: cfg.block_size,
            depth: cfg.qd,
            read_pct: cfg.read_pct,
            op_limit: match cfg.stop {
                Stop::Ops(n) => n,
                Stop::After(_) => 0,
            },
            seed: cfg.seed,
            windows: cfg.exposure == crate::config::ExposureKind::Windows,
        };
        let conns_per_cq = cfg.connections.div_ceil(load_cqs.max(1));
        let mut load = Load::new(open("load")?, &specs, conns_per_cq, spec)?;
        let mut pollers = Vec::new();
        let mut roles = Vec::new();
        for a in plans {
            let name = a.plan.name().to_string();
            let mode = a.plan.mode();
            let mut b = a
                .plan
                .poller_builder::<NoWork, NoSink>(NoSink)
                .drain_timeout(cfg.drain_timeout);
            for k in &a.cqs {
                if let Some(cq) = load.take_cq(*k as usize) {
                    b = b.cq(cq);
                }
            }
            pollers.push(
                b.spawn()
                    .map_err(|e| DemoError::Setup(format!("poller {name}: {e}")))?,
            );
            roles.push((name, "load", mode));
        }
        let mut watched = crate::prom::Watched::new();
        for h in load.cq_handles() {
            watched.cq(h);
        }
        for p in &pollers {
            watched.poller(p);
        }
        watched.load(load.shared());
        Ok(LoadSide {
            load,
            pollers,
            roles,
            poller_of,
            load_cqs,
            names: Names::new(),
            watched,
        })
    }

    /// A new connection to server `server`, on the load CQs in turn
    /// (connect its link to the peer's endpoint, then
    /// [`LoadConn::post_receives`]).
    ///
    /// # Errors
    /// The device refused.
    pub fn connect(&mut self, server: u32) -> Result<Arc<LoadConn<N>>, DemoError> {
        let k = self.load.conns().len() as u32 % self.load_cqs.max(1);
        self.connect_on(server, k as usize)
    }

    /// A new connection to server `server` on load CQ `k` (as
    /// [`connect`](Self::connect)).
    ///
    /// # Errors
    /// The device refused.
    pub fn connect_on(&mut self, server: u32, k: usize) -> Result<Arc<LoadConn<N>>, DemoError> {
        let conn = self.load.connect(server, k)?;
        let k = k as u32;
        let pi = self.poller_of.get(&k).copied().unwrap_or(0);
        let cq = format!("load{k}");
        name_of(&mut self.names, pi, &cq, conn.registration(), conn.name());
        Ok(conn)
    }

    /// The load generator.
    pub fn load(&self) -> &Load<N> {
        &self.load
    }

    /// Closes a connection while the others run ([`Load::close`]).
    ///
    /// # Errors
    /// What did not end within `RELEASE`.
    pub fn close(&mut self, conn: Arc<LoadConn<N>>) -> Result<(), String> {
        self.load.close(conn, RELEASE)
    }

    /// The run is over: later flushes are the teardown's
    /// ([`Load::closing`](crate::load::Load::closing)).
    pub fn closing(&self) {
        self.load.closing();
    }

    /// Runs the load (progress bar on a terminal), drains it and reads
    /// every block back. With `churn` (`--churn`), calls it
    /// `cfg.churn` times a second during the load.
    pub fn drive(&mut self, cfg: &Config, mut churn: Option<&mut ChurnStep<'_, N>>) -> Driven {
        let bar = progress_bar(cfg);
        let shared = Arc::clone(self.load.shared());
        let started = Instant::now();
        tracing::info!(stop = ?cfg.stop, "load: run");
        self.load.enter(Phase::Run);
        let mut last = (Instant::now(), 0u64);
        let mut rate = 0.0;
        let mut notes = Vec::new();
        let mut cycles = Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).ok();
        let mut churned = ChurnTally::default();
        loop {
            let tick = Instant::now() + Duration::from_millis(50);
            // The churn due by now, then a sleep to the tick.
            if let (Some(step), Some(rate)) = (churn.as_mut(), cfg.churn) {
                while Instant::now() < tick {
                    let due = (started.elapsed().as_secs_f64() * rate) as u64;
                    if churned.done >= due {
                        let next =
                            started + Duration::from_secs_f64((churned.done + 1) as f64 / rate);
                        std::thread::sleep(
                            next.min(tick).saturating_duration_since(Instant::now()),
                        );
                        continue;
                    }
                    let t = Instant::now();
                    if let Err(e) = step(self) {
                        churned.failed += 1;
                        if notes.len() < 16 {
                            notes.push(format!("churn: {e}"));
                        }
                    }
                    churned.done += 1;
                    if let Some(h) = cycles.as_mut() {
                        h.saturating_record(t.elapsed().as_nanos() as u64);
                    }
                }
            }
            std::thread::sleep(tick.saturating_duration_since(Instant::now()));
            let load = &self.load;
            let now = Instant::now();
            let counts = shared.counts();
            if now.duration_since(last.0) >= Duration::from_millis(250) {
                rate =
                    (counts.completed - last.1) as f64 / now.duration_since(last.0).as_secs_f64();
                last = (now, counts.completed);
            }
            let elapsed = started.elapsed();
            match cfg.stop {
                Stop::After(d) => bar.set_position(elapsed.min(d).as_millis() as u64),
                Stop::Ops(_) => bar.set_position(counts.completed + counts.failed),
            }
            bar.set_message(format!(
                "{:>7.0} ops/s {:>9} ops {} failed",
                rate, counts.completed, counts.failed
            ));
            load.check_timeouts(cfg.op_timeout);
            let done = match cfg.stop {
                Stop::After(d) => elapsed >= d,
                Stop::Ops(n) => counts.issued >= n && shared.inflight() == 0,
            };
            if done || load.all_dead() {
                if load.all_dead() && !done {
                    tracing::error!("every connection failed: the load stops early");
                }
                break;
            }
        }
        let load = &self.load;
        tracing::info!(inflight = shared.inflight(), "load: drain");
        load.enter(Phase::Drain);
        let timeout = cfg.op_timeout;
        let drained = load.wait_idle(DRAIN, &mut || load.check_timeouts(timeout));
        let load_elapsed = started.elapsed();
        bar.finish_and_clear();

        let verify_started = Instant::now();
        tracing::info!(
            blocks = cfg.blocks_per_server * u64::from(cfg.servers),
            "load: read back every block"
        );
        load.enter(Phase::Verify);
        // A backstop only (stuck requests fail by the op timeout): room
        // for 5,000 blocks a second, however large the devices.
        let blocks = cfg.blocks_per_server * u64::from(cfg.servers);
        let verified = load.wait_until(
            DRAIN + Duration::from_secs(20) + Duration::from_secs(blocks / 5_000),
            &mut || load.check_timeouts(timeout),
            &|| load.verify_done(),
        );
        load.enter(Phase::Drain);
        if !drained {
            notes.push(
                "requests were still in flight at the drain deadline: their connections were failed"
                    .into(),
            );
        }
        if !verified {
            notes.push(
                "the read-back did not finish by its deadline: its connections were failed".into(),
            );
        }
        let us = |ns: u64| ns as f64 / 1e3;
        let churn = cfg.churn.map(|asked| {
            let h = cycles.as_ref();
            let q = |x: f64| h.map_or(0.0, |h| us(h.value_at_quantile(x)));
            report::ChurnCounts {
                asked_per_s: asked,
                cycles: churned.done,
                per_s: churned.done as f64 / load_elapsed.as_secs_f64().max(1e-9),
                failed: churned.failed,
                cycle_p50_us: q(0.5),
                cycle_p99_us: q(0.99),
                cycle_max_us: h.map_or(0.0, |h| us(h.max())),
            }
        });
        Driven {
            load_elapsed,
            verify_elapsed: verify_started.elapsed(),
            notes,
            churn,
        }
    }

    /// Stops: every QP to error, the pollers collect every flush.
    pub fn stop(self) -> Stopped<Load<N>> {
        let load = self.load;
        let system = cqd_core::shutdown(|| load.flush(), self.pollers, []);
        self.watched.release();
        Stopped {
            state: load,
            system,
            roles: self.roles,
            names: self.names,
            notes: Vec::new(),
        }
    }
}

/// The geometry of a server of `cfg` with `connections`.
pub fn server_spec(cfg: &Config, connections: u32) -> ServerSpec {
    ServerSpec {
        device_bytes: cfg.device_size,
        block_size: cfg.block_size,
        depth: cfg.qd,
        connections,
    }
}

/// How many churn cycles ran and failed.
#[derive(Debug, Default)]
struct ChurnTally {
    done: u64,
    failed: u64,
}

/// The options of a CQ served by `poller`: the topology's, and
/// `--trace-completions`.
fn cq_options(cfg: &Config, poller: &Assigned) -> cqd_core::CqOptions {
    let mut options = poller.plan.cq_options();
    options.trace_completions = cfg.trace_completions;
    options
}

/// Runs the demo once on nodes made by `open`: both halves in this
/// process, endpoints exchanged in memory.
///
/// # Errors
/// As [`run_sim`].
pub fn run_on<N: Node>(
    cfg: &Config,
    mode: Option<ModeArg>,
    open: impl Fn(&str) -> Result<N, DemoError>,
) -> Result<Report, DemoError> {
    let setup_started = Instant::now();
    let conns = |s: u32| {
        (0..cfg.connections)
            .filter(|c| c % cfg.servers == s)
            .count() as u32
    };
    let layout = topo::resolve(
        topo::load(cfg.topology.as_deref())?,
        cfg.servers,
        mode.or(cfg.mode),
        cfg.workers,
        &|s| server_spec(cfg, conns(s)).pool_sizes(),
    )?;
    // validate() logged its warnings already; the report lists them too.
    let mode_name = mode
        .or(cfg.mode)
        .map_or_else(|| "topology".to_string(), |m| m.name().to_string());
    let threads_started = Instant::now();
    let mut server_side = if cfg.naive_server {
        let workers = layout.pool.threads();
        Side::Naive(NaiveSide::start(cfg, workers, conns, &open)?)
    } else {
        Side::Cqd(Box::new(ServerSide::start(
            cfg,
            layout.server_pollers,
            layout.server_pools,
            layout.pool,
            conns,
            &open,
        )?))
    };
    let mut load_side = LoadSide::start(cfg, layout.load_pollers, layout.load_cqs, &open)?;
    // Each connection's two sides, oldest first (what `--churn` closes).
    let mut pairs = std::collections::VecDeque::new();
    for c in 0..cfg.connections {
        let s = c % cfg.servers;
        let srv = server_side.accept(s)?;
        let cli = load_side.connect(s)?;
        join(&srv, &cli)?;
        pairs.push_back((s, srv, cli));
    }
    tracing::info!(setup = ?setup_started.elapsed(), "servers, load and threads up");

    let mut step = |ls: &mut LoadSide<N>| -> Result<(), String> {
        let (s, srv, cli) = pairs
            .pop_front()
            .ok_or_else(|| "no connection left to close".to_string())?;
        let k = cli.cq();
        // The client is done with it: its requests finish, it closes; then
        // the server's side closes, and a new connection takes its place.
        ls.close(cli)?;
        server_side.close(s, srv)?;
        let srv = server_side.accept(s).map_err(|e| e.to_string())?;
        let cli = ls.connect_on(s, k).map_err(|e| e.to_string())?;
        join(&srv, &cli).map_err(|e| e.to_string())?;
        cli.kick();
        pairs.push_back((s, srv, cli));
        Ok(())
    };
    let churn: Option<&mut ChurnStep<'_, N>> = cfg.churn.map(|_| &mut step as _);
    let driven = load_side.drive(cfg, churn);
    // The stop closes the servers' connections: nothing else holds them.
    drop(pairs);
    tracing::info!("shutdown: the load side, then the servers");
    let load = load_side.stop();
    let servers = server_side.stop();
    let wall = threads_started.elapsed();

    // One system report: the servers' pollers first, then the load's.
    let offset = servers.system.pollers.len();
    let mut system = servers.system;
    system.pollers.extend(load.system.pollers);
    system.pools.extend(load.system.pools);
    system.errors.extend(load.system.errors);
    let mut names = servers.names;
    names.extend(
        load.names
            .into_iter()
            .map(|((p, slot, gen), n)| ((p + offset, slot, gen), n)),
    );
    let mut roles = servers.roles;
    roles.extend(load.roles);
    let mut notes = driven.notes;
    notes.extend(servers.notes);
    notes.extend(load.notes);
    Ok(report::build(report::Inputs {
        churn: driven.churn,
        cfg,
        mode: mode_name,
        load: &load.state,
        servers: &servers.state,
        system,
        names,
        roles,
        load_elapsed: driven.load_elapsed,
        verify_elapsed: driven.verify_elapsed,
        wall,
        topology_toml: layout.toml,
        topology_warnings: layout.warnings,
        notes,
    }))
}

/// Connects a new connection's two sides (the exchange a two-process run
/// does over its socket) and posts the load side's receives (the server's
/// come from its SRQ).
fn join<N: Node>(srv: &SrvConn<N>, cli: &LoadConn<N>) -> Result<(), DemoError> {
    let (a, b) = (srv.link().endpoint()?, cli.link().endpoint()?);
    srv.link().connect(&b)?;
    cli.link().connect(&a)?;
    cli.post_receives()?;
    Ok(())
}

fn progress_bar(cfg: &Config) -> ProgressBar {
    let visible = cfg.progress && std::io::stdout().is_terminal();
    let len = match cfg.stop {
        Stop::After(d) => d.as_millis() as u64,
        Stop::Ops(n) => n,
    };
    let bar = ProgressBar::with_draw_target(
        Some(len),
        if visible {
            ProgressDrawTarget::stdout()
        } else {
            ProgressDrawTarget::hidden()
        },
    );
    if let Ok(style) = ProgressStyle::with_template("{spinner} [{bar:20}] {percent:>3}% {msg}") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar
}
