//! One run: servers, load generator, pollers and workers on a topology;
//! the load, the read-back, the shutdown and the report.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use cqd_core::pool::PoolSink;
use cqd_core::{NoSink, PollerThread, Registration, ShutdownOptions};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::backend::sim::SimFabric;
use crate::backend::{Link, Node};
use crate::config::{Config, ModeArg, Stop};
use crate::load::{Load, LoadSpec, Phase};
use crate::report::{self, Report};
use crate::server::{Server, ServerSpec, ServerWork};
use crate::topo;
use crate::DemoError;

/// How long the load may take to finish what is in flight.
const DRAIN: Duration = Duration::from_secs(10);

/// Runs the demo once on the simulated NIC, in `mode` (None: the
/// topology's modes).
///
/// # Errors
/// Bad topology, setup failures. Failed requests and failed verdicts are
/// in the report, not errors.
pub fn run_sim(cfg: &Config, mode: Option<ModeArg>) -> Result<Report, DemoError> {
    let fabric = SimFabric::new(cfg.fault_rate, cfg.seed);
    let open = |name: &str| fabric.open(name);
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

/// Handler names by (poller index, slot, generation), for the accounts.
type Names = HashMap<(usize, u32, u16), String>;

fn name_of(names: &mut Names, poller: usize, reg: Option<&Registration>, name: &str) {
    if let Some(reg) = reg {
        let k = reg.key();
        names
            .entry((poller, k.slot(), k.generation()))
            .and_modify(|n| {
                n.push('|');
                n.push_str(name);
            })
            .or_insert_with(|| name.to_string());
    }
}

/// Runs the demo once on nodes made by `open`.
///
/// # Errors
/// As [`run_sim`].
pub fn run_on<N: Node>(
    cfg: &Config,
    mode: Option<ModeArg>,
    open: impl Fn(&str) -> N,
) -> Result<Report, DemoError> {
    let setup_started = Instant::now();
    let layout = topo::resolve(
        topo::load(cfg.topology.as_deref())?,
        cfg.servers,
        mode.or(cfg.mode),
        cfg.workers,
    )?;
    // validate() logged its warnings already; the report lists them too.
    let mode_name = mode
        .or(cfg.mode)
        .map_or_else(|| "topology".to_string(), |m| m.name().to_string());

    // Servers: one node, CQ and device each; CQ options from the poller
    // that owns the CQ.
    let per_server_conns = |s: u32| {
        (0..cfg.connections)
            .filter(|c| c % cfg.servers == s)
            .count() as u32
    };
    let mut servers: Vec<Server<N>> = Vec::new();
    let mut server_poller_of = HashMap::new();
    for (pi, a) in layout.server_pollers.iter().enumerate() {
        for &s in &a.cqs {
            server_poller_of.insert(s, pi);
        }
    }
    for s in 0..cfg.servers {
        let pi = *server_poller_of
            .get(&s)
            .ok_or_else(|| DemoError::Topology(format!("no poller for srv{s}")))?;
        let options = layout.server_pollers[pi].plan.cq_options();
        let spec = ServerSpec {
            device_bytes: cfg.device_size,
            block_size: cfg.block_size,
            depth: cfg.qd,
            connections: per_server_conns(s),
        };
        servers.push(Server::new(
            open(&format!("srv{s}")),
            &format!("srv{s}"),
            spec,
            options,
        )?);
    }

    // The load generator: one node, CQs load0..; connections round-robin.
    let mut load_poller_of = HashMap::new();
    for (pi, a) in layout.load_pollers.iter().enumerate() {
        for &k in &a.cqs {
            load_poller_of.insert(k, pi);
        }
    }
    let load_cq_specs: Vec<(String, cqd_core::CqOptions)> = (0..layout.load_cqs)
        .map(|k| {
            let pi = load_poller_of.get(&k).copied().unwrap_or(0);
            (
                format!("load{k}"),
                layout.load_pollers[pi].plan.cq_options(),
            )
        })
        .collect();
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
    };
    let conns_per_cq = cfg.connections.div_ceil(layout.load_cqs);
    let mut load = Load::new(open("load"), &load_cq_specs, conns_per_cq, spec)?;

    // Connections: make both ends, exchange endpoints, connect, post the
    // receives.
    let mut names = Names::new();
    for c in 0..cfg.connections {
        let s = c % cfg.servers;
        let k = c % layout.load_cqs;
        let srv = servers[s as usize].accept()?;
        let cli = load.connect(s, k as usize)?;
        let (a, b) = (srv.link().endpoint()?, cli.link().endpoint()?);
        srv.link().connect(&b)?;
        cli.link().connect(&a)?;
        srv.post_receives()?;
        cli.post_receives()?;
        name_of(
            &mut names,
            server_poller_of[&s],
            srv.registration(),
            srv.name(),
        );
        let lp = layout.load_pollers.len() + load_poller_of.get(&k).copied().unwrap_or(0);
        name_of(&mut names, lp, cli.registration(), cli.name());
    }

    // Threads: the pool first (one sink per server poller), then pollers.
    let producers = layout.server_pollers.len();
    let (pool, sinks) = layout
        .pool
        .spawn(producers, |_| |w: ServerWork<N>| w.run())
        .map_err(|e| DemoError::Setup(format!("pool {}: {e}", topo::POOL)))?;
    let started = Instant::now();
    let mut pollers: Vec<PollerThread> = Vec::new();
    let mut roles = Vec::new();
    for (a, sink) in layout.server_pollers.into_iter().zip(sinks) {
        let name = a.plan.name().to_string();
        let mode = a.plan.mode();
        let mut b = a
            .plan
            .poller_builder::<ServerWork<N>, PoolSink<ServerWork<N>>>(sink)
            .drain_timeout(cfg.drain_timeout);
        for s in &a.cqs {
            if let Some(cq) = servers[*s as usize].take_cq() {
                b = b.cq(cq);
            }
        }
        pollers.push(
            b.spawn()
                .map_err(|e| DemoError::Setup(format!("poller {name}: {e}")))?,
        );
        roles.push((name, "server", mode));
    }
    for a in layout.load_pollers {
        let name = a.plan.name().to_string();
        let mode = a.plan.mode();
        let mut b = a
            .plan
            .poller_builder::<cqd_core::NoWork, NoSink>(NoSink)
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
    tracing::info!(setup = ?setup_started.elapsed(), "servers, load and threads up");

    // The load.
    let bar = progress_bar(cfg);
    let shared = std::sync::Arc::clone(load.shared());
    let load_started = Instant::now();
    tracing::info!(stop = ?cfg.stop, "load: run");
    load.enter(Phase::Run);
    let mut last = (Instant::now(), 0u64);
    let mut rate = 0.0;
    loop {
        std::thread::sleep(Duration::from_millis(50));
        let now = Instant::now();
        let counts = shared.counts();
        if now.duration_since(last.0) >= Duration::from_millis(250) {
            rate = (counts.completed - last.1) as f64 / now.duration_since(last.0).as_secs_f64();
            last = (now, counts.completed);
        }
        let elapsed = load_started.elapsed();
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
    tracing::info!(inflight = shared.inflight(), "load: drain");
    load.enter(Phase::Drain);
    let timeout = cfg.op_timeout;
    let drained = load.wait_idle(DRAIN, &mut || load.check_timeouts(timeout));
    let load_elapsed = load_started.elapsed();
    bar.finish_and_clear();

    // Read every block back.
    let verify_started = Instant::now();
    tracing::info!(
        blocks = cfg.blocks_per_server * u64::from(cfg.servers),
        "load: read back every block"
    );
    load.enter(Phase::Verify);
    let verified = load.wait_until(
        DRAIN + Duration::from_secs(20),
        &mut || load.check_timeouts(timeout),
        &|| load.verify_done(),
    );
    load.enter(Phase::Drain);
    let verify_elapsed = verify_started.elapsed();

    // Shutdown: servers' workers idle, then QPs to error, pollers, pool.
    tracing::info!("shutdown: workers idle, QPs to error, pollers, pool");
    let mut quiet = true;
    for s in &servers {
        quiet &= s.quiesce(Duration::from_secs(5));
    }
    let system = cqd_core::shutdown_with(
        ShutdownOptions::default().pool_join_timeout(Duration::from_secs(10)),
        || {
            load.flush();
            for s in &servers {
                s.flush();
            }
        },
        pollers,
        [pool],
    );
    let wall = started.elapsed();

    let mut notes = Vec::new();
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
    if !quiet {
        notes.push("server workers were still busy at the close".into());
    }
    Ok(report::build(report::Inputs {
        cfg,
        mode: mode_name,
        load: &load,
        servers: &servers,
        system,
        names,
        roles,
        load_elapsed,
        verify_elapsed,
        wall,
        topology_toml: layout.toml,
        topology_warnings: layout.warnings,
        notes,
    }))
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
