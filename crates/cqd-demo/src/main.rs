//! `cqd-demo`: a block-storage server and its load generator on cqd.
//!
//! ```text
//! cargo run --release -p cqd-demo                     # ~10 s, report and verdicts
//! cargo run --release -p cqd-demo -- --quick          # 2 s, for CI
//! cargo run --release -p cqd-demo -- --compare-modes  # one table, every poll mode
//! ```
//!
//! Exit codes: 0 when both verdicts passed and no request failed; 1 when a
//! verdict failed, a request failed or the run could not finish; 2 for bad
//! input (flags, topology).

use std::process::ExitCode;

use clap::Parser;
use cqd_demo::config::{Args, ModeArg};
use cqd_demo::report::{compare_table, CompareRow};
use cqd_demo::run::run_sim;
use cqd_demo::DemoError;

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
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

fn run(args: &Args) -> Result<bool, DemoError> {
    let cfg = args.check()?;
    if args.compare_modes {
        let mut rows = Vec::new();
        let mut reports = Vec::new();
        for mode in ModeArg::ALL {
            eprintln!("cqd-demo: mode {} ...", mode.name());
            let r = run_sim(&cfg, Some(mode))?;
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
    let report = run_sim(&cfg, None)?;
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
