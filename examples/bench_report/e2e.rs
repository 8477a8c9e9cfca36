//! End to end: the storage demo (crates/cqd-demo, its default topology)
//! against the same demo served by its naive baseline (`--naive-server`,
//! `cqd_demo::naive`): two threads polling each CQ under a mutex, one
//! completion per poll, a channel send per completion, a re-arm per event.
//! Same load generator, same load, same run, alternating: throughput, p99
//! latency, and CPU per operation (the whole process's CPU time, load
//! generator included — it is the same for both — divided by the
//! operations done).

use clap::Parser;
use cqd_demo::config::Args;
use cqd_demo::report::Report;

use crate::clock::{spread, Spread};

/// Which transport the demo runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    Sim,
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    Verbs,
}

/// One contender's figures over the runs.
#[derive(Debug, Clone)]
pub struct Contender {
    pub name: &'static str,
    pub ops_per_s: Spread,
    pub p99_us: Spread,
    pub cpu_us_per_op: Spread,
}

fn process_cpu() -> f64 {
    // SAFETY: `ru` is a valid out-parameter for getrusage.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_SELF with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 / 1e6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

fn once(on: On, naive: bool, quick: bool) -> Result<(Report, f64), String> {
    let mut argv = vec!["cqd-demo", "--no-progress"];
    if quick {
        argv.extend(["--quick", "--duration", "1s"]);
    } else {
        argv.extend(["--duration", "4s"]);
    }
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
    Ok((report, cpu * 1e6 / ops))
}

/// cqd's server and the naive one, `reps` runs each, alternating.
pub fn compare(on: On, quick: bool, reps: usize) -> Result<Vec<Contender>, String> {
    let mut cols: [(Vec<f64>, Vec<f64>, Vec<f64>); 2] = Default::default();
    for _ in 0..reps {
        for (i, naive) in [false, true].into_iter().enumerate() {
            let (r, cpu) = once(on, naive, quick)?;
            eprintln!(
                "  {:<6} {:>9.0} ops/s  p99 {:>8.1} µs  {:>6.2} CPU µs/op",
                if naive { "naive" } else { "cqd" },
                r.ops_per_s,
                r.latency.p99_us,
                cpu
            );
            cols[i].0.push(r.ops_per_s);
            cols[i].1.push(r.latency.p99_us);
            cols[i].2.push(cpu);
        }
    }
    Ok(cols
        .iter_mut()
        .zip(["cqd (demo server)", "naive server"])
        .map(|((ops, p99, cpu), name)| Contender {
            name,
            ops_per_s: spread(ops),
            p99_us: spread(p99),
            cpu_us_per_op: spread(cpu),
        })
        .collect())
}
