//! `cqd-demo`: a block-storage server and its load generator on cqd.
//!
//! ```text
//! cargo run --release -p cqd-demo                     # ~10 s, report and verdicts
//! cargo run --release -p cqd-demo -- --quick          # 2 s, for CI
//! cargo run --release -p cqd-demo -- --compare-modes  # one table, every poll mode
//! # real RDMA (--features verbs): one process, or serve + load
//! cqd-demo --backend verbs --device mlx5_0
//! cqd-demo serve --device mlx5_0 --listen 0.0.0.0:18520
//! cqd-demo load --device mlx5_0 --server host1:18520 --server host2:18520
//! ```
//!
//! Exit codes: 0 when the verdicts passed and no request failed; 1 when a
//! verdict failed, a request failed or the run could not finish (no
//! device, a server not there, a peer that went away); 2 for bad input
//! (flags, topology).

use std::process::ExitCode;

use clap::Parser;
use cqd_demo::config::{Args, BackendKind, Command, Config, ModeArg};
use cqd_demo::report::{compare_table, CompareRow, Report};
use cqd_demo::run::run_sim;
use cqd_demo::DemoError;

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            // --help and --version print and succeed; errors exit 2.
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { 2 } else { 0 });
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("cqd-demo: {e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// One one-process run on the configured backend.
fn run_once(cfg: &Config, mode: Option<ModeArg>) -> Result<Report, DemoError> {
    match cfg.backend {
        BackendKind::Sim => run_sim(cfg, mode),
        #[cfg(feature = "verbs")]
        BackendKind::Verbs => cqd_demo::run::run_verbs(cfg, mode),
        #[cfg(not(feature = "verbs"))]
        BackendKind::Verbs => Err(DemoError::Config(cqd_demo::config::NO_VERBS.into())),
    }
}

#[cfg(feature = "verbs")]
fn serve(cfg: &Config, json: Option<&std::path::Path>) -> Result<bool, DemoError> {
    use std::io::Write as _;
    let listener = cqd_demo::net::listen(&cfg.listen)?;
    let device = cqd_demo::backend::verbs::VerbsDevice::open(
        cfg.device.as_deref(),
        cqd_demo::run::verbs_options(cfg),
    )?;
    let name = device.name().to_string();
    let report = cqd_demo::net::serve_on(
        cfg,
        listener,
        |node: &str| Ok(device.node(node)?),
        |addr| {
            println!(
                "cqd-demo serve: listening on {addr} (device {name}, {} blocks of {} B, up to {} \
                 connection(s) × qd {})",
                cfg.blocks_per_server, cfg.block_size, cfg.connections, cfg.qd
            );
            let _ = std::io::stdout().flush();
        },
    )?;
    print!("{}", report.text());
    if let Some(path) = json {
        write_json(path, &report)?;
    }
    Ok(report.passed())
}

#[cfg(feature = "verbs")]
fn load(cfg: &Config, json: Option<&std::path::Path>) -> Result<bool, DemoError> {
    // The servers are reached first (a missing one fails fast), then the
    // device is opened, then the handshakes.
    let report = cqd_demo::net::load_on(cfg, || {
        let device = cqd_demo::backend::verbs::VerbsDevice::open(
            cfg.device.as_deref(),
            cqd_demo::run::verbs_options(cfg),
        )?;
        Ok(move |node: &str| Ok(device.node(node)?))
    })?;
    print!("{}", report.text());
    if let Some(path) = json {
        write_json(path, &report)?;
    }
    Ok(report.passed())
}

fn run(args: &Args) -> Result<bool, DemoError> {
    let cfg = args.check()?;
    // Up before any CQ is made, so the run's every CQ, poller and pool is
    // exported; stopped (one last publication) when the run returns.
    let _endpoint = match cfg.prometheus {
        Some(addr) => {
            let e = cqd_demo::prom::start(addr)?;
            eprintln!(
                "cqd-demo: Prometheus metrics on http://{}/metrics",
                e.addr()
            );
            Some(e)
        }
        None => None,
    };
    match cfg.command {
        Command::Run => {}
        #[cfg(feature = "verbs")]
        Command::Serve => return serve(&cfg, args.json.as_deref()),
        #[cfg(feature = "verbs")]
        Command::Load => return load(&cfg, args.json.as_deref()),
        #[cfg(not(feature = "verbs"))]
        Command::Serve | Command::Load => {
            return Err(DemoError::Config(cqd_demo::config::NO_VERBS.into()))
        }
    }
    if args.compare_modes {
        let mut rows = Vec::new();
        let mut reports = Vec::new();
        for mode in ModeArg::ALL {
            eprintln!("cqd-demo: mode {} ...", mode.name());
            let r = run_once(&cfg, Some(mode))?;
            if !r.passed() {
                print!("{}", r.text());
            }
            rows.push(CompareRow::of(&r));
            reports.push(r);
        }
        print!("{}", compare_table(&rows));
        let passed = rows.iter().all(|r| r.passed);
        if let Some(path) = &args.json {
            write_json(
                path,
                &serde_json::json!({ "compare": rows, "reports": reports }),
            )?;
        }
        println!(
            "{}",
            if passed {
                "every mode: both verdicts passed"
            } else {
                "a mode FAILED (its report is above)"
            }
        );
        return Ok(passed);
    }
    let report = run_once(&cfg, None)?;
    print!("{}", report.text());
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(report.passed())
}

fn write_json(path: &std::path::Path, value: &impl serde::Serialize) -> Result<(), DemoError> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| DemoError::Output(format!("JSON report: {e}")))?;
    std::fs::write(path, text)
        .map_err(|e| DemoError::Output(format!("write {}: {e}", path.display())))
}
