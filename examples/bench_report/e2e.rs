//! End to end: the storage demo (crates/cqd-demo, with one worker,
//! [`WORKERS`], in its default layout and in the fenced one, [`Layout`])
//! against the same demo served by its naive baseline (`--naive-server`,
//! `cqd_demo::naive`): two threads polling each CQ under a mutex, one
//! completion per poll, a channel send per completion, a re-arm per event.
//! Same load generator, same load, same layout (the naive server takes the
//! topology's load poller and its number of workers), same run, alternating
//! who goes first: throughput, p99 latency, and CPU per operation (the
//! whole process's CPU time, load generator included — it is the same for
//! both — divided by the operations done).
//!
//! Where the CPU goes: while the load runs, a sampler reads every thread's
//! CPU time (`/proc/self/task/*/schedstat`, nanoseconds) at two points and
//! splits it by role — the load generator's poller thread, and the server's
//! threads (cqd's poller and workers, or the naive server's pollers and
//! workers) — per operation at the run's rate. Either role includes the
//! NIC's work for what it posts (the simulated NIC and softverbs execute a
//! request inside the posting call).

use clap::Parser;
use cqd_demo::config::Args;
use cqd_demo::report::Report;

use std::time::{Duration, Instant};

use crate::clock::{spread, Spread};

/// Which transport the demo runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Sim,
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Verbs,
}

/// The demo's thread layout for a comparison. The naive server takes the
/// layout's load generator poller and its number of workers; its own
/// threads are placed as the naive loop places them (nowhere).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// The demo's default (`examples/demo-topology.toml`): nothing pinned.
    Default,
    /// `examples/demo-topology-fenced.toml`: the load generator's poller on
    /// CPU 0, the server's poller and its one worker on CPU 1.
    Fenced,
}

impl Layout {
    /// What the report calls it.
    pub fn name(self) -> &'static str {
        match self {
            Layout::Default => "default layout",
            Layout::Fenced => "fenced layout",
        }
    }

    /// The demo's `--topology`, if not the built-in one.
    fn file(self) -> Option<&'static str> {
        match self {
            Layout::Default => None,
            Layout::Fenced => Some(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/examples/demo-topology-fenced.toml"
            )),
        }
    }
}

/// One contender's figures over the runs.
#[derive(Debug, Clone)]
pub struct Contender {
    pub name: &'static str,
    pub ops_per_s: Spread,
    pub p99_us: Spread,
    pub cpu_us_per_op: Spread,
    /// CPU µs per operation of the load generator's poller thread.
    pub load_us_per_op: Spread,
    /// CPU µs per operation of the server's threads.
    pub server_us_per_op: Spread,
    /// Each run's ops/s, in order (the other contender's run `i` came
    /// right before or after run `i`).
    pub runs: Vec<f64>,
}

/// Workers of the server pool (`--workers`), for both contenders. The
/// machine has 2 CPUs and the process also runs the load generator and the
/// NIC's work: with one worker the server is two threads (its poller and
/// the worker), the whole process three, and a request waits less often
/// for a descheduled thread (docs/benchmarks.md, "End to end: where the CPU
/// goes": same throughput, a shorter tail than with the topology's two).
pub const WORKERS: &str = "1";

/// The load generator's poller thread: `cqd-poller-<name>`, `name` that of
/// the demo layout's poller of `load0` (`examples/demo-topology.toml`), as
/// Linux shows it: the first 15 bytes.
fn load_thread() -> &'static str {
    static NAME: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let name = cqd_demo::topo::load(None)
            .ok()
            .and_then(|t| {
                t.pollers
                    .into_iter()
                    .find(|p| p.cqs.iter().any(|c| c == "load0"))
                    .map(|p| p.name)
            })
            .unwrap_or_else(|| "load".into());
        format!("cqd-poller-{name}").chars().take(15).collect()
    })
}

/// Which role a thread of the demo has, by name.
fn role(name: &str) -> Option<usize> {
    if name == load_thread() {
        Some(0)
    } else if name.starts_with("cqd-poller-")
        || name.starts_with("cqd-worker-")
        || name.starts_with("naive-")
    {
        Some(1)
    } else {
        None
    }
}

/// CPU nanoseconds of this process's threads by role (load, server), and
/// whether the load generator's poller is running.
fn role_cpu() -> ([u64; 2], bool) {
    let mut out = [0u64; 2];
    let mut load_up = false;
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return (out, false);
    };
    for t in dir.flatten() {
        let p = t.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(p.join("comm")),
            std::fs::read_to_string(p.join("schedstat")),
        ) else {
            continue;
        };
        let comm = comm.trim();
        load_up |= comm == load_thread();
        let ns: u64 = stat
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        if let Some(r) = role(comm) {
            out[r] += ns;
        }
    }
    (out, load_up)
}

/// Samples [`role_cpu`] over the middle of a load phase of `load`: from a
/// fifth of it after the load poller appears to seven tenths; returns the
/// CPU nanoseconds by role and the window's length.
fn sample_roles(load: Duration) -> Option<([u64; 2], Duration)> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !role_cpu().1 {
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(load / 5);
    let (a, t0) = (role_cpu().0, Instant::now());
    std::thread::sleep(load / 2);
    let (b, t1) = (role_cpu().0, Instant::now());
    Some((
        [b[0].saturating_sub(a[0]), b[1].saturating_sub(a[1])],
        t1 - t0,
    ))
}

fn process_cpu() -> f64 {
    // SAFETY: `ru` is a valid out-parameter for getrusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// One run's figures.
struct Once {
    report: Report,
    cpu_us_per_op: f64,
    /// (load, server) CPU µs per operation; NaN if not sampled.
    roles: [f64; 2],
}

fn once(on: On, naive: bool, quick: bool, layout: Layout) -> Result<Once, String> {
    let mut argv = vec!["cqd-demo", "--no-progress", "--workers", WORKERS];
    if let Some(file) = layout.file() {
        argv.extend(["--topology", file]);
    }
    let load = if quick {
        argv.extend(["--quick", "--duration", "1s"]);
        Duration::from_secs(1)
    } else {
        argv.extend(["--duration", "4s"]);
        Duration::from_secs(4)
    };
    if naive {
        argv.push("--naive-server");
    }
    if on == On::Verbs {
        argv.extend(["--backend", "verbs"]);
    }
    let cfg = Args::try_parse_from(&argv)
        .map_err(|e| e.to_string())?
        .check()
        .map_err(|e| e.to_string())?;
    let cpu0 = process_cpu();
    let sampler = std::thread::spawn(move || sample_roles(load));
    let report = match on {
        On::Sim => cqd_demo::run::run_sim(&cfg, None),
        #[cfg(feature = "verbs")]
        On::Verbs => cqd_demo::run::run_verbs(&cfg, None),
        #[cfg(not(feature = "verbs"))]
        On::Verbs => return Err("built without the verbs feature".into()),
    }
    .map_err(|e| e.to_string())?;
    let cpu = process_cpu() - cpu0;
    if !report.verdicts.data.passed || !report.verdicts.accounts.passed {
        return Err(format!(
            "{} server: a verdict failed (data: {}, accounts: {})",
            if naive { "naive" } else { "cqd" },
            report.verdicts.data.detail,
            report.verdicts.accounts.detail
        ));
    }
    let ops = (report.load.completed as f64).max(1.0);
    let roles = match sampler.join().ok().flatten() {
        Some((ns, window)) => {
            let ops = (report.ops_per_s * window.as_secs_f64()).max(1.0);
            [ns[0] as f64 / 1e3 / ops, ns[1] as f64 / 1e3 / ops]
        }
        None => [f64::NAN; 2],
    };
    Ok(Once {
        cpu_us_per_op: cpu * 1e6 / ops,
        report,
        roles,
    })
}

/// cqd's server and the naive one in `layout`, `reps` runs each,
/// alternating.
pub fn compare(on: On, quick: bool, reps: usize, layout: Layout) -> Result<Vec<Contender>, String> {
    #[derive(Default)]
    struct Col {
        ops: Vec<f64>,
        p99: Vec<f64>,
        cpu: Vec<f64>,
        load: Vec<f64>,
        server: Vec<f64>,
    }
    let mut cols: [Col; 2] = Default::default();
    for rep in 0..reps {
        // Alternate who goes first, so neither always runs after the other.
        let order = if rep % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        };
        for naive in order {
            let o = once(on, naive, quick, layout)?;
            let r = &o.report;
            eprintln!(
                "  {:<6} {:>9.0} ops/s  p99 {:>8.1} µs  {:>6.2} CPU µs/op (load poller {:.2}, server threads {:.2})",
                if naive { "naive" } else { "cqd" },
                r.ops_per_s,
                r.latency.p99_us,
                o.cpu_us_per_op,
                o.roles[0],
                o.roles[1]
            );
            let c = &mut cols[usize::from(naive)];
            c.ops.push(r.ops_per_s);
            c.p99.push(r.latency.p99_us);
            c.cpu.push(o.cpu_us_per_op);
            if o.roles.iter().all(|v| v.is_finite()) {
                c.load.push(o.roles[0]);
                c.server.push(o.roles[1]);
            }
        }
    }
    Ok(cols
        .iter_mut()
        .zip(match layout {
            Layout::Default => ["cqd (demo server)", "naive server"],
            Layout::Fenced => ["cqd, fenced layout", "naive, fenced layout"],
        })
        .map(|(c, name)| Contender {
            name,
            runs: c.ops.clone(),
            ops_per_s: spread(&mut c.ops),
            p99_us: spread(&mut c.p99),
            cpu_us_per_op: spread(&mut c.cpu),
            load_us_per_op: spread(&mut c.load),
            server_us_per_op: spread(&mut c.server),
        })
        .collect())
}
