//! The demo's thread layout: a cqd topology file (docs/topology.md) whose
//! CQ names say what each poller serves.
//!
//! - `srv<i>`: the CQ of server `i` (all its connections, sends and
//!   receives). Every server's CQ must have a poller; a server the file
//!   does not name (`--servers` above the file's count) is given to the
//!   server pollers in turn. The demo makes it a CQ pool: the layout it
//!   validates moves `srv<i>` off its poller into a `[[cq_pool]]` named
//!   `srv<i>` over that poller (one CQ, `srv<i>-0`, made at the server's
//!   first connection and grown in place as connections come; sizes from
//!   the run's flags, [`PoolSizes`]). A file that has `[[cq_pool]]`
//!   tables of its own is refused.
//! - `load<k>`: a CQ of the load generator; connections are spread over
//!   `load0`, `load1`, … in turn. The file must name them from 0 without
//!   gaps.
//! - A poller serves server CQs or load CQs, not both (their handlers hand
//!   different work: servers to the pool, load handlers to no one).
//! - The pool `io` is the servers' worker pool (fed by every server
//!   poller).
//!
//! Flags override the file: `--mode` sets every poller's mode,
//! `--workers` the pool's threads.

use cqd_core::topology::{
    CqPoolConfig, CqPoolPlan, FitConfig, ModeConfig, PollerPlan, PoolPlan, TopologyConfig,
};

use crate::config::ModeArg;
use crate::DemoError;

/// The built-in layout, a copy of `examples/demo-topology.toml`.
pub const BUILT_IN: &str = include_str!("../../../examples/demo-topology.toml");

/// The name of the servers' worker pool.
pub const POOL: &str = "io";

/// A poller's plan and the CQs it serves.
#[derive(Debug)]
pub struct Assigned {
    /// The validated plan.
    pub plan: PollerPlan,
    /// Server indices (server pollers) or load CQ indices (load pollers).
    pub cqs: Vec<u32>,
}

/// A server's CQ pool: the entries of its first CQ, and the most it grows
/// to in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolSizes {
    /// Entries asked for its CQ.
    pub cqe: u32,
    /// The most entries a resize grows it to.
    pub resize_up_to: u32,
}

/// The checked layout of one run.
#[derive(Debug)]
pub struct Layout {
    /// Pollers of server CQs.
    pub server_pollers: Vec<Assigned>,
    /// Each server's CQ pool (over its poller), by server index.
    pub server_pools: Vec<CqPoolPlan>,
    /// Pollers of load CQs.
    pub load_pollers: Vec<Assigned>,
    /// The servers' worker pool.
    pub pool: PoolPlan,
    /// Load CQs (`load0` … `load<n-1>`).
    pub load_cqs: u32,
    /// What `validate` warned about.
    pub warnings: Vec<String>,
    /// The resolved configuration, as TOML (for the report).
    pub toml: String,
}

enum Role {
    Server(u32),
    Load(u32),
}

fn role(cq: &str) -> Option<Role> {
    let num = |rest: &str| -> Option<u32> {
        (!rest.is_empty()
            && rest.bytes().all(|b| b.is_ascii_digit())
            && (rest == "0" || !rest.starts_with('0')))
        .then(|| rest.parse().ok())
        .flatten()
    };
    if let Some(rest) = cq.strip_prefix("srv") {
        return num(rest).map(Role::Server);
    }
    if let Some(rest) = cq.strip_prefix("load") {
        return num(rest).map(Role::Load);
    }
    None
}

/// The mode a `--mode` flag stands for.
pub fn mode_config(mode: ModeArg) -> ModeConfig {
    match mode {
        ModeArg::Busy => ModeConfig::Busy,
        ModeArg::Event => ModeConfig::Event { timeout_ms: 100 },
        ModeArg::Hybrid => ModeConfig::Hybrid {
            spin_window_us: 50,
            timeout_ms: 100,
        },
        ModeArg::Adaptive => ModeConfig::default(),
    }
}

/// Reads the layout (the file, or the built-in one).
///
/// # Errors
/// [`DemoError::Topology`] for a file that cannot be read or parsed.
pub fn load(path: Option<&std::path::Path>) -> Result<TopologyConfig, DemoError> {
    let parsed = match path {
        Some(p) => TopologyConfig::from_file(p),
        None => TopologyConfig::from_toml(BUILT_IN),
    };
    parsed.map_err(|e| match path {
        Some(p) => DemoError::Topology(format!("{}: {e}", p.display())),
        None => DemoError::Topology(format!("built-in layout: {e}")),
    })
}

/// Which half of a run this process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Servers and load in one process.
    Both,
    /// `serve`: server pollers and the pool only.
    Server,
    /// `load`: load pollers only.
    Load,
}

/// Checks `config` against the demo's rules, applies the flags, validates
/// it (cqd's `validate`) and hands out the plans (both halves).
///
/// # Errors
/// [`DemoError::Topology`] naming the poller, CQ or pool at fault.
pub fn resolve(
    config: TopologyConfig,
    servers: u32,
    mode: Option<ModeArg>,
    workers: Option<usize>,
    sizes: &dyn Fn(u32) -> PoolSizes,
) -> Result<Layout, DemoError> {
    resolve_side(config, servers, mode, workers, sizes, Side::Both)
}

/// [`resolve`] for one half: the other half's pollers are checked against
/// the naming rules, then left out (not validated, not spawned), so a
/// `serve` process runs only server pollers and a `load` process only load
/// pollers, from the same file. A `load` side keeps the pool in the
/// validated layout but never spawns it.
///
/// # Errors
/// As [`resolve`]; the side's own pollers must be there.
pub fn resolve_side(
    mut config: TopologyConfig,
    servers: u32,
    mode: Option<ModeArg>,
    workers: Option<usize>,
    sizes: &dyn Fn(u32) -> PoolSizes,
    side: Side,
) -> Result<Layout, DemoError> {
    let bad = |m: String| Err(DemoError::Topology(m));
    if let Some(p) = config.cq_pools.first() {
        return bad(format!(
            "[[cq_pool]] {:?}: the demo makes each server's CQ pool itself (name srv<i> on the \
             poller that serves it)",
            p.name
        ));
    }
    if side != Side::Both {
        // The other half's pollers go; a poller mixing both is refused
        // below as in a one-process run.
        config.pollers.retain(|p| {
            let (mut srv, mut ld) = (false, false);
            for cq in &p.cqs {
                match role(cq) {
                    Some(Role::Server(_)) => srv = true,
                    Some(Role::Load(_)) => ld = true,
                    None => {}
                }
            }
            // Kept: the side's own pollers, mixed ones (refused below)
            // and those naming no demo CQ (refused below).
            match side {
                Side::Server => srv || !ld,
                Side::Load => ld || !srv,
                Side::Both => true,
            }
        });
    }
    let mut server_pollers = Vec::new();
    let mut load_pollers = Vec::new();
    let mut named_servers = vec![false; servers as usize];
    let mut load_cqs = Vec::new();
    for (i, p) in config.pollers.iter().enumerate() {
        let (mut srv, mut ld) = (false, false);
        for cq in &p.cqs {
            match role(cq) {
                Some(Role::Server(s)) if s < servers => {
                    srv = true;
                    named_servers[s as usize] = true;
                }
                Some(Role::Server(_)) => {
                    return bad(format!(
                        "poller[{i}] {:?} names CQ {cq:?}, but the run has {servers} server(s) \
                         (srv0 to srv{}); raise --servers or remove it",
                        p.name,
                        servers - 1
                    ))
                }
                Some(Role::Load(k)) => {
                    ld = true;
                    load_cqs.push(k);
                }
                None => {
                    return bad(format!(
                    "poller[{i}] {:?} names CQ {cq:?}; the demo makes CQs named srv<i> (server i) \
                         and load<k> (the load generator's k-th CQ)",
                    p.name
                ))
                }
            }
        }
        match (srv, ld) {
            (true, true) => {
                return bad(format!(
                    "poller[{i}] {:?} has both server and load CQs; give each its own poller",
                    p.name
                ))
            }
            (true, false) => server_pollers.push(i),
            (false, true) => load_pollers.push(i),
            // An empty list: validate() names it.
            (false, false) => {}
        }
    }
    if server_pollers.is_empty() && side != Side::Load {
        return bad("no poller serves a server CQ (srv0, srv1, …)".into());
    }
    load_cqs.sort_unstable();
    if load_cqs.is_empty() && side != Side::Server {
        return bad("no poller serves a load CQ (load0, load1, …)".into());
    }
    if let Some((k, _)) = load_cqs.iter().enumerate().find(|(k, &c)| *k as u32 != c) {
        return bad(format!(
            "load CQs must be load0 to load<n-1> without gaps; load{k} is missing"
        ));
    }
    for (s, named) in named_servers.iter().enumerate() {
        if !named && !server_pollers.is_empty() {
            let p = server_pollers[s % server_pollers.len()];
            tracing::info!(poller = %config.pollers[p].name, "srv{s} not in the layout: added");
            config.pollers[p].cqs.push(format!("srv{s}"));
        }
    }
    if let Some(mode) = mode {
        for p in &mut config.pollers {
            p.mode = mode_config(mode);
        }
    }
    // The server pollers hand their work to the servers' pool: a file may
    // say so (`pool = "io"`); a file naming another pool is refused, and
    // the load's pollers hand work to no pool.
    for &i in &server_pollers {
        let p = &mut config.pollers[i];
        match p.pool.as_deref() {
            None => p.pool = Some(POOL.to_string()),
            Some(POOL) => {}
            Some(other) => {
                return bad(format!(
                    "poller[{i}] {:?} serves server CQs and names pool {other:?}; the servers' \
                     workers are the pool {POOL:?}",
                    p.name
                ))
            }
        }
    }
    for &i in &load_pollers {
        if let Some(other) = &config.pollers[i].pool {
            return bad(format!(
                "poller[{i}] {:?} serves load CQs, whose handlers hand no work to a pool; \
                 remove its pool = {other:?}",
                config.pollers[i].name
            ));
        }
    }
    match config.pools.iter_mut().find(|p| p.name == POOL) {
        Some(pool) => {
            if let Some(w) = workers {
                pool.threads = w;
            }
        }
        None => return bad(format!("no pool named {POOL:?} (the servers' workers)")),
    }
    let cqs_of = |i: usize| -> Vec<u32> {
        config.pollers[i]
            .cqs
            .iter()
            .filter_map(|c| match role(c) {
                Some(Role::Server(s)) | Some(Role::Load(s)) => Some(s),
                None => None,
            })
            .collect()
    };
    let server_cqs: Vec<(String, Vec<u32>)> = server_pollers
        .iter()
        .map(|&i| (config.pollers[i].name.clone(), cqs_of(i)))
        .collect();
    let load_cqs_of: Vec<(String, Vec<u32>)> = load_pollers
        .iter()
        .map(|&i| (config.pollers[i].name.clone(), cqs_of(i)))
        .collect();
    // Each server's CQ is a pool over its poller, which starts empty.
    for (poller, servers) in &server_cqs {
        for &s in servers {
            let z = sizes(s);
            config.cq_pools.push(
                CqPoolConfig::new(format!("srv{s}"), z.cqe, [poller.clone()])
                    .fit(FitConfig::First)
                    .max_cqs(1)
                    .resize_up_to(z.resize_up_to),
            );
        }
    }
    for &i in &server_pollers {
        config.pollers[i]
            .cqs
            .retain(|c| !matches!(role(c), Some(Role::Server(_))));
    }
    let toml = config
        .to_toml()
        .map_err(|e| DemoError::Topology(e.to_string()))?;
    let mut topology = config
        .validate()
        .map_err(|e| DemoError::Topology(e.to_string()))?;
    let warnings = topology.warnings().iter().map(|w| w.to_string()).collect();
    let mut take = |list: Vec<(String, Vec<u32>)>| -> Result<Vec<Assigned>, DemoError> {
        list.into_iter()
            .map(|(name, cqs)| {
                let plan = topology.take_poller(&name).ok_or_else(|| {
                    DemoError::Topology(format!("poller {name:?} vanished in validation"))
                })?;
                Ok(Assigned { plan, cqs })
            })
            .collect()
    };
    let server_pollers = take(server_cqs)?;
    let load_pollers = take(load_cqs_of)?;
    let server_pools = if side == Side::Load {
        Vec::new()
    } else {
        (0..servers)
            .map(|s| {
                topology.take_cq_pool(&format!("srv{s}")).ok_or_else(|| {
                    DemoError::Topology(format!("CQ pool srv{s} vanished in validation"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?
    };
    let pool = topology
        .take_pool(POOL)
        .ok_or_else(|| DemoError::Topology(format!("no pool named {POOL:?}")))?;
    Ok(Layout {
        server_pollers,
        server_pools,
        load_pollers,
        pool,
        load_cqs: load_cqs.len() as u32,
        warnings,
        toml,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sizes(_: u32) -> PoolSizes {
        PoolSizes {
            cqe: 256,
            resize_up_to: 1024,
        }
    }

    fn layout(text: &str, servers: u32) -> Result<Layout, DemoError> {
        resolve(
            TopologyConfig::from_toml(text).unwrap(),
            servers,
            None,
            None,
            &sizes,
        )
    }

    #[test]
    fn the_built_in_layout_resolves_and_grows_with_servers() {
        let l = resolve(load(None).unwrap(), 3, Some(ModeArg::Busy), Some(3), &sizes).unwrap();
        let served: Vec<u32> = l
            .server_pollers
            .iter()
            .flat_map(|a| a.cqs.clone())
            .collect();
        assert_eq!(served.len(), 3, "srv1 and srv2 were added: {served:?}");
        // Each server's CQ is a pool over its poller, which owns no CQ.
        assert_eq!(l.server_pools.len(), 3);
        assert_eq!(l.server_pools[2].name(), "srv2");
        assert_eq!(l.server_pools[2].config().resize_up_to, Some(1024));
        assert!(
            l.toml.contains("[[cq_pool]]") && l.toml.contains("cqs = []"),
            "{}",
            l.toml
        );
        assert!(l.load_cqs >= 1);
        assert_eq!(l.pool.threads(), 3);
        assert!(l.toml.contains("busy"));
    }

    #[test]
    fn the_fenced_layout_keeps_the_load_apart_from_the_server() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/demo-topology-fenced.toml"
        );
        let l = resolve(
            load(Some(std::path::Path::new(path))).unwrap(),
            1,
            None,
            None,
            &sizes,
        )
        .unwrap();
        assert_eq!(l.server_pollers.len(), 1);
        assert_eq!(l.load_pollers.len(), 1);
        assert_eq!(l.pool.threads(), 1);
        // Placements, as the file writes them (validation against this
        // machine's CPUs comes at spawn).
        assert!(
            l.toml.contains("fixed = 0") && l.toml.contains("fixed = 1"),
            "{}",
            l.toml
        );
    }

    #[test]
    fn each_side_keeps_only_its_own_pollers() {
        let s = resolve_side(load(None).unwrap(), 2, None, None, &sizes, Side::Server).unwrap();
        assert_eq!(s.server_pollers.len(), 1);
        assert!(s.load_pollers.is_empty());
        assert_eq!(s.load_cqs, 0);
        let served: Vec<u32> = s
            .server_pollers
            .iter()
            .flat_map(|a| a.cqs.clone())
            .collect();
        assert_eq!(served, [0, 1]);
        let l = resolve_side(load(None).unwrap(), 1, None, None, &sizes, Side::Load).unwrap();
        assert!(l.server_pollers.is_empty());
        assert_eq!(l.load_pollers.len(), 1);
        assert_eq!(l.load_cqs, 1);
        assert!(!l.toml.contains("srv0"), "{}", l.toml);
        // A file without load pollers is fine for `serve`, not for a
        // one-process run.
        let srv_only =
            "[[poller]]\nname = \"a\"\ncqs = [\"srv0\"]\n[[pool]]\nname = \"io\"\nthreads = 1\n";
        let cfg = TopologyConfig::from_toml(srv_only).unwrap();
        assert!(resolve_side(cfg.clone(), 1, None, None, &sizes, Side::Server).is_ok());
        let e = resolve(cfg.clone(), 1, None, None, &sizes).unwrap_err();
        assert!(e.to_string().contains("no poller serves a load CQ"), "{e}");
        let e = resolve_side(cfg, 1, None, None, &sizes, Side::Load).unwrap_err();
        assert!(e.to_string().contains("no poller serves a load CQ"), "{e}");
    }

    #[test]
    fn names_the_demo_does_not_make_are_refused() {
        let base = "[[pool]]\nname = \"io\"\nthreads = 1\n";
        let e = layout(
            &format!("[[poller]]\nname = \"a\"\ncqs = [\"rx0\"]\n{base}"),
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("\"rx0\""), "{e}");
        let e = layout(
            &format!("[[poller]]\nname = \"a\"\ncqs = [\"srv0\", \"load0\"]\n{base}"),
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("both server and load"), "{e}");
        let e = layout(
            &format!("[[poller]]\nname = \"a\"\ncqs = [\"srv0\", \"srv1\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load0\"]\n{base}"),
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("raise --servers"), "{e}");
        let e = layout(
            &format!("[[poller]]\nname = \"a\"\ncqs = [\"srv0\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load1\"]\n{base}"),
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("load0 is missing"), "{e}");
        let e = layout(
            "[[poller]]\nname = \"a\"\ncqs = [\"srv0\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load0\"]\n",
            1,
        )
        .unwrap_err();
        assert!(e.to_string().contains("no pool named \"io\""), "{e}");
    }
}
