//! One run, every figure a user chooses a poll mode and a thread layout
//! on, side by side as ratios, with the plots redrawn:
//!
//! 1. the machine's floors: an eventfd wake-up, a busy-poll detection;
//! 2. the mode curves: Busy, Event, Hybrid and Adaptive at 1k, 10k, 100k
//!    and 1M completions per second and in bursts: handler latency
//!    p50/p99/p99.9 and the poller thread's CPU seconds per second;
//! 3. the hand-off: cqd's pool with parking and with spinning workers
//!    against the `disruptor` crate (and the other channels of
//!    benches/handoff.rs, whose code this includes);
//! 4. end to end: the storage demo (crates/cqd-demo) against its naive
//!    server (`--naive-server`), same load, same run;
//! 5. the goals, met or not;
//! 6. the existing dispatch (and, on the device, verbs-path) benchmarks,
//!    re-run (benches/dispatch.rs, benches/verbs_dispatch.rs, included).
//!
//! ```text
//! cargo run --release --example bench_report                  # full, plots into docs/
//! cargo run --release --example bench_report -- --quick       # CI smoke, plots into a temp dir
//! cargo build --release --features verbs --example bench_report
//! softverbs-run target/release/examples/bench_report --backend verbs   # on the device
//! ```
//!
//! Options: `--quick` (short runs, 1 rep), `--reps N` (default 5),
//! `--out DIR` (where report-*.md and the PNGs go; default docs/ for a full
//! run, `$TMPDIR/cqd-bench-report` for `--quick`), `--backend sim|verbs`,
//! `--skip-benches` (leave out section 6), `--only e2e` (section 4 alone,
//! with its goals; the report goes to `report-e2e-<backend>.md`, into a
//! temp dir unless `--out` says). Without the device
//! `--backend verbs` prints `SKIPPED` and exits 0.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

mod clock;
mod curves;
mod e2e;
mod floors;
mod plot;
#[cfg(feature = "verbs")]
mod verbs;

#[allow(dead_code)]
#[path = "../../benches/handoff.rs"]
mod handoff;

#[allow(dead_code)]
#[path = "../../benches/dispatch.rs"]
mod dispatch;

// Each bench includes benches/common/handlers.rs, so with both here it is
// two modules of the same file.
#[cfg(feature = "verbs")]
#[allow(dead_code, clippy::duplicate_mod)]
#[path = "../../benches/verbs_dispatch.rs"]
mod verbs_dispatch;

use clock::{spread, Spread};
use curves::{Load, Point};
use floors::Floor;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BackendKind {
    Sim,
    Verbs,
}

struct Args {
    quick: bool,
    reps: usize,
    out: PathBuf,
    backend: BackendKind,
    skip_benches: bool,
    /// Only the end-to-end section (`--only e2e`).
    only_e2e: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut quick = false;
    let mut reps = None;
    let mut out = None;
    let mut backend = BackendKind::Sim;
    let mut skip_benches = false;
    let mut only_e2e = false;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => quick = true,
            "--skip-benches" => skip_benches = true,
            "--only" => match it.next().as_deref() {
                Some("e2e") => only_e2e = true,
                other => {
                    return Err(format!(
                        "--only {}: the one section it takes is e2e",
                        other.unwrap_or("(nothing)")
                    ))
                }
            },
            "--reps" => {
                let v = it.next().ok_or("--reps needs a number")?;
                let n: usize = v.parse().map_err(|e| format!("--reps {v}: {e}"))?;
                if n == 0 {
                    return Err("--reps must be at least 1".into());
                }
                reps = Some(n);
            }
            "--out" => out = Some(PathBuf::from(it.next().ok_or("--out needs a directory")?)),
            "--backend" => {
                backend = match it.next().as_deref() {
                    Some("sim") => BackendKind::Sim,
                    Some("verbs") => BackendKind::Verbs,
                    other => return Err(format!("--backend {other:?}: sim or verbs")),
                }
            }
            // cargo bench/test harness flags, should someone run it so.
            "--bench" => {}
            other => {
                return Err(format!(
                    "unknown argument {other} (--quick, --reps N, --out DIR, --backend sim|verbs, --skip-benches, --only e2e)"
                ))
            }
        }
    }
    let out = out.unwrap_or_else(|| {
        if quick || only_e2e {
            std::env::temp_dir().join("cqd-bench-report")
        } else {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("docs")
        }
    });
    Ok(Args {
        quick,
        reps: reps.unwrap_or(if quick { 1 } else { 5 }),
        out,
        backend,
        skip_benches,
        only_e2e,
    })
}

fn main() {
    // Before any section pins this thread.
    clock::process_mask();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_report: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&args) {
        eprintln!("bench_report: FAILED: {e}");
        std::process::exit(1);
    }
}

/// `YYYY-MM-DD HH:MM UTC` of now.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil from days (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02} UTC",
        rem / 3600,
        (rem % 3600) / 60
    )
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn verdict(met: bool) -> &'static str {
    if met {
        "**met**"
    } else {
        "**NOT met**"
    }
}

fn run(args: &Args) -> Result<(), String> {
    let backend_name = match args.backend {
        BackendKind::Sim => "sim",
        BackendKind::Verbs => "softverbs",
    };
    if args.backend == BackendKind::Verbs && !verbs_available() {
        println!(
            "SKIPPED: bench_report --backend verbs (no RDMA device: run it under softverbs-run, \
             see .ci/softverbs.sh{})",
            if cfg!(feature = "verbs") {
                ""
            } else {
                "; and build it with --features verbs"
            }
        );
        return Ok(());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| format!("{}: {e}", args.out.display()))?;
    plot::init_font()?;
    let started = Instant::now();
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let mut md = String::new();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let _ = writeln!(
        md,
        "<!-- written by examples/bench_report; do not edit by hand -->"
    );
    let _ = writeln!(
        md,
        "Run on {} ({backend_name}), {cpus} CPUs, load average at the start {}; \
         `{command}`; {} run(s) of each contender, median [min–max].\n",
        utc_now(),
        loadavg(),
        args.reps
    );
    if args.only_e2e {
        return only_e2e(args, backend_name, md, started);
    }

    eprintln!("== floors ({} reps)", args.reps);
    let floors = floors::floors(args.quick, args.reps)?;
    let _ = writeln!(md, "### Floors\n");
    let _ = writeln!(md, "| floor | p50 µs | p99 µs |\n|---|---|---|");
    for f in &floors {
        let _ = writeln!(md, "| {} | {} | {} |", f.name, f.p50.show(2), f.p99.show(2));
    }
    let _ = writeln!(
        md,
        "\nAdaptive's own estimate of the wake-up latency (`cqd_core::mode::measured_wake_latency`, \
         once per process): {}.",
        floors::adaptive_estimate()
    );

    eprintln!("== mode curves on {backend_name} ({} reps)", args.reps);
    let floor = floors.first().map_or(Duration::from_micros(5), |f| {
        Duration::from_nanos((f.p50.median * 1e3) as u64)
    });
    let points = match args.backend {
        BackendKind::Sim => {
            curves::curves(&mut curves::sim_backend(), args.quick, args.reps, floor)?
        }
        #[cfg(feature = "verbs")]
        BackendKind::Verbs => {
            let mut b = verbs::backend()?;
            curves::curves(&mut b, args.quick, args.reps, floor)?
        }
        #[cfg(not(feature = "verbs"))]
        BackendKind::Verbs => unreachable!("verbs_available() is false without the feature"),
    };
    write_curves(&mut md, backend_name, &points);
    let lat_png = args
        .out
        .join(format!("bench-modes-latency-{backend_name}.png"));
    let cpu_png = args.out.join(format!("bench-modes-cpu-{backend_name}.png"));
    plot::latency(
        &lat_png,
        &format!("Handler latency by poll mode ({backend_name})"),
        &points,
        &floors,
    )?;
    plot::cpu(
        &cpu_png,
        &format!("Poller CPU by poll mode ({backend_name})"),
        &points,
    )?;

    let mut goals = Vec::new();
    mode_goals(&points, &floors, &mut goals);

    if args.backend == BackendKind::Sim {
        eprintln!("== hand-off ({} reps)", args.reps);
        handoff_section(&mut md, args, &mut goals)?;
    }

    let naive_png = end_to_end(args, backend_name, &mut md, &mut goals)?;
    write_goals(&mut md, &goals);
    let _ = writeln!(
        md,
        "\nPlots: `{}`, `{}`, `{}`. The whole report took {:.0} s; load average at the end {}.",
        lat_png.display(),
        cpu_png.display(),
        naive_png.display(),
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    let report = args.out.join(format!("report-{backend_name}.md"));
    std::fs::write(&report, &md).map_err(|e| format!("{}: {e}", report.display()))?;
    println!("{md}");
    println!("(report written to {})", report.display());

    if !args.skip_benches {
        match args.backend {
            BackendKind::Sim => {
                println!("\n== benches/dispatch.rs, re-run\n");
                dispatch::run(args.quick, false);
            }
            #[cfg(feature = "verbs")]
            BackendKind::Verbs => {
                println!("\n== benches/verbs_dispatch.rs, re-run on the device\n");
                verbs_dispatch::run(args.quick);
            }
            #[cfg(not(feature = "verbs"))]
            BackendKind::Verbs => {}
        }
    }
    Ok(())
}

/// `--only e2e`: section 4 and its goals, written to
/// `report-e2e-<backend>.md`.
fn only_e2e(
    args: &Args,
    backend_name: &str,
    mut md: String,
    started: Instant,
) -> Result<(), String> {
    let mut goals = Vec::new();
    let png = end_to_end(args, backend_name, &mut md, &mut goals)?;
    write_goals(&mut md, &goals);
    let _ = writeln!(
        md,
        "\nPlot: `{}`. The run took {:.0} s; load average at the end {}.",
        png.display(),
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    let report = args.out.join(format!("report-e2e-{backend_name}.md"));
    std::fs::write(&report, &md).map_err(|e| format!("{}: {e}", report.display()))?;
    println!("{md}");
    println!("(report written to {})", report.display());
    Ok(())
}

/// Section 4: runs the comparison, writes its table and plot and adds its
/// goals; returns the plot's path.
fn end_to_end(
    args: &Args,
    backend_name: &str,
    md: &mut String,
    goals: &mut Vec<(String, String, bool)>,
) -> Result<PathBuf, String> {
    eprintln!("== end to end on {backend_name} ({} reps)", args.reps);
    let on = match args.backend {
        BackendKind::Sim => e2e::On::Sim,
        BackendKind::Verbs => e2e::On::Verbs,
    };
    let mut all = Vec::new();
    for layout in [e2e::Layout::Default, e2e::Layout::Fenced] {
        eprintln!("   {}", layout.name());
        match clock::with_process_mask(|| e2e::compare(on, args.quick, args.reps, layout)) {
            Ok(rows) => {
                e2e_section(md, backend_name, layout, &rows, goals)?;
                all.extend(rows);
            }
            Err(e)
                if layout == e2e::Layout::Fenced
                    && e.contains("not in the process affinity mask") =>
            {
                eprintln!("SKIPPED: end to end, fenced layout: {e}");
                let _ = writeln!(
                    md,
                    "\n**SKIPPED: the fenced layout** (it needs CPUs 0 and 1): {e}"
                );
            }
            Err(e) => return Err(e),
        }
    }
    let png = args.out.join(format!("bench-naive-{backend_name}.png"));
    e2e_plot(&png, backend_name, &all)?;
    Ok(png)
}

/// The goals table.
fn write_goals(md: &mut String, goals: &[(String, String, bool)]) {
    let _ = writeln!(
        md,
        "\n### Goals\n\n| goal | measured | verdict |\n|---|---|---|"
    );
    for (goal, measured, met) in goals {
        let _ = writeln!(md, "| {goal} | {measured} | {} |", verdict(*met));
    }
}

fn verbs_available() -> bool {
    #[cfg(feature = "verbs")]
    {
        std::env::var_os("SOFTVERBS_RUN").is_some()
            || cqd::verbs::devices().is_ok_and(|d| !d.is_empty())
    }
    #[cfg(not(feature = "verbs"))]
    {
        false
    }
}

fn write_curves(md: &mut String, backend: &str, points: &[Point]) {
    let _ = writeln!(
        md,
        "\n### Mode curves ({backend})\n\n\
         | load | mode | p50 µs | p99 µs | p99.9 µs | poller CPU s/s | achieved /s | stalls | missed events |\n\
         |---|---|---|---|---|---|---|---|---|"
    );
    for p in points {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} | {:.0} | {} | {} |",
            p.load.label(),
            p.mode,
            p.p50.show(2),
            p.p99.show(1),
            p.p999.show(1),
            p.cpu.show(3),
            p.rate.median,
            p.stalls,
            p.recovered
        );
    }
    let _ = writeln!(
        md,
        "\n*stalls*: arrivals that found the queue full (the poller behind) and waited, over all \
         runs; *achieved* is then below the rate asked. *missed events*: over all runs, sleeps of \
         the poller that its 100 ms safety-net timeout ended with completions waiting \
         (`CqSnapshot::recovered_missed_events`): notifications that never came."
    );
}

fn find<'a>(points: &'a [Point], mode: &str, load: Load) -> Option<&'a Point> {
    points.iter().find(|p| p.mode == mode && p.load == load)
}

fn mode_goals(points: &[Point], floors: &[Floor], goals: &mut Vec<(String, String, bool)>) {
    for (adaptive, rate) in [
        ("adaptive", 100_000),
        ("adaptive", 1_000_000),
        (curves::ADAPTIVE_TOLD, 100_000),
        (curves::ADAPTIVE_TOLD, 1_000_000),
    ] {
        let load = Load::Rate(rate);
        if let (Some(a), Some(b)) = (find(points, adaptive, load), find(points, "busy", load)) {
            let r = a.p50.median / b.p50.median;
            let who = if adaptive == "adaptive" {
                "Adaptive".to_string()
            } else {
                format!("Adaptive ({})", &adaptive[10..])
            };
            goals.push((
                format!("{who} p50 ≤ 1.5× Busy at {}", load.label()),
                format!("{r:.2}× ({:.2} vs {:.2} µs)", a.p50.median, b.p50.median),
                r <= 1.5,
            ));
        }
    }
    let low = Load::Rate(1_000);
    for adaptive in ["adaptive", curves::ADAPTIVE_TOLD] {
        let (Some(a), Some(b)) = (find(points, adaptive, low), find(points, "busy", low)) else {
            continue;
        };
        let who = if adaptive == "adaptive" {
            "Adaptive".to_string()
        } else {
            format!("Adaptive ({})", &adaptive[10..])
        };
        let r = a.cpu.median / b.cpu.median;
        goals.push((
            format!("{who} CPU ≤ 10% of Busy's at 1k/s"),
            format!(
                "{:.1}% ({:.4} vs {:.3} CPU s/s)",
                100.0 * r,
                a.cpu.median,
                b.cpu.median
            ),
            r <= 0.10,
        ));
    }
    if let (Some(e), Some(f)) = (find(points, "event", low), floors.first()) {
        let r = e.p50.median / f.p50.median;
        goals.push((
            "Event p50 ≤ 2× the eventfd wake-up floor (at 1k/s)".into(),
            format!("{r:.2}× ({:.2} vs {:.2} µs)", e.p50.median, f.p50.median),
            r <= 2.0,
        ));
    }
}

fn handoff_section(
    md: &mut String,
    args: &Args,
    goals: &mut Vec<(String, String, bool)>,
) -> Result<(), String> {
    if !handoff::pin_one_to_one() {
        return Err("hand-off: cannot pin the producer to CPU 0".into());
    }
    let items: u64 = if args.quick { 100_000 } else { 2_000_000 };
    let expected = (0..items).fold(0u64, |s, v| s.wrapping_add(v));
    let contenders = handoff::CONTENDERS;
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); contenders.len()];
    for _ in 0..args.reps {
        for (i, (name, f)) in contenders.iter().enumerate() {
            let t = Instant::now();
            let sum = f(items, 1);
            let secs = t.elapsed().as_secs_f64();
            if sum != expected {
                return Err(format!(
                    "hand-off {name}: wrong sum, an item was lost or doubled"
                ));
            }
            rates[i].push(items as f64 / secs);
        }
    }
    let spreads: Vec<Spread> = rates.iter_mut().map(|r| spread(r)).collect();
    let _ = writeln!(
        md,
        "\n### Hand-off, 1 producer (CPU 0) → 1 worker (CPU 1) ({items} u64 items, batches of 32, 1024 slots)\n\n\
         | contender | M items/s | vs cqd pool (parking) |\n|---|---|---|"
    );
    let park = spreads[0].median;
    for ((name, _), s) in contenders.iter().zip(&spreads) {
        let m = Spread {
            median: s.median / 1e6,
            min: s.min / 1e6,
            max: s.max / 1e6,
        };
        let _ = writeln!(md, "| {name} | {} | {:.2}× |", m.show(1), s.median / park);
    }
    let idx = |n: &str| contenders.iter().position(|(c, _)| *c == n);
    let (Some(p), Some(s), Some(d)) = (
        idx("cqd pool (batch offer)"),
        idx("cqd pool, spinning workers"),
        idx("disruptor (batch publish)"),
    ) else {
        return Err("hand-off contenders renamed".into());
    };
    let ratio = |a: usize| spreads[a].median / spreads[d].median;
    // Ratio run by run too, so a drift in the machine's load shows.
    let per_run = |a: usize| {
        let mut r: Vec<f64> = rates[a].iter().zip(&rates[d]).map(|(x, y)| x / y).collect();
        spread(&mut r).show(2)
    };
    goals.push((
        "Hand-off, parking workers ≥ 0.7× the disruptor's batch publish".into(),
        format!("{:.2}× (run by run {})", ratio(p), per_run(p)),
        ratio(p) >= 0.7,
    ));
    goals.push((
        "Hand-off, spinning workers (`idle = \"spin\"`) ≥ 1.0× the disruptor".into(),
        format!("{:.2}× (run by run {})", ratio(s), per_run(s)),
        ratio(s) >= 1.0,
    ));
    Ok(())
}

fn e2e_section(
    md: &mut String,
    backend: &str,
    layout: e2e::Layout,
    rows: &[e2e::Contender],
    goals: &mut Vec<(String, String, bool)>,
) -> Result<(), String> {
    let what = match layout {
        e2e::Layout::Default => format!(
            "The demo's default layout (`examples/demo-topology.toml`, nothing pinned) with \
             `--workers {}`, for both.",
            e2e::WORKERS
        ),
        e2e::Layout::Fenced => format!(
            "The fenced layout (`examples/demo-topology-fenced.toml`): the load generator's \
             poller on CPU 0, cqd's server poller and its worker on CPU 1; the naive server \
             takes the same load poller (its own threads unpinned) and `--workers {}`.",
            e2e::WORKERS
        ),
    };
    let _ = writeln!(
        md,
        "\n### End to end: the storage demo against the naive server ({backend}, {})\n\n\
         {what} CPU µs per op: the whole \
         process's, then the load generator's poller thread and the server's threads \
         (each with the NIC's work for what it posts), sampled over the middle of the load.\n\n\
         | server | ops/s | p99 µs | process CPU µs per op | load poller µs/op | server threads µs/op |\n\
         |---|---|---|---|---|---|",
        layout.name()
    );
    for r in rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {} | {} |",
            r.name,
            r.ops_per_s.show(0),
            r.p99_us.show(0),
            r.cpu_us_per_op.show(2),
            r.load_us_per_op.show(2),
            r.server_us_per_op.show(2)
        );
    }
    let (Some(c), Some(n)) = (rows.first(), rows.get(1)) else {
        return Err("end to end: no figures".into());
    };
    let ratio = c.ops_per_s.median / n.ops_per_s.median;
    // Run by run: each cqd run against the naive run next to it.
    let mut pairs: Vec<f64> = c.runs.iter().zip(&n.runs).map(|(a, b)| a / b).collect();
    let by_run = spread(&mut pairs);
    let _ = writeln!(
        md,
        "\nThroughput ratio run by run (each cqd run over the naive run next to it): {}×; \
         CPU per op, naive over cqd: {:.2}× (process), {:.2}× (server threads).",
        by_run.show(2),
        n.cpu_us_per_op.median / c.cpu_us_per_op.median,
        n.server_us_per_op.median / c.server_us_per_op.median
    );
    goals.push((
        format!(
            "End to end ({backend}, {}): cqd ≥ 3× the naive server's throughput",
            layout.name()
        ),
        format!(
            "{ratio:.2}× ({:.0} vs {:.0} ops/s; run by run {})",
            c.ops_per_s.median,
            n.ops_per_s.median,
            by_run.show(2)
        ),
        ratio >= 3.0,
    ));
    goals.push((
        format!(
            "End to end ({backend}, {}): cqd's p99 below the naive server's",
            layout.name()
        ),
        format!("{:.0} vs {:.0} µs", c.p99_us.median, n.p99_us.median),
        c.p99_us.median < n.p99_us.median,
    ));
    Ok(())
}

/// The plot of every end-to-end contender.
fn e2e_plot(png: &std::path::Path, backend: &str, rows: &[e2e::Contender]) -> Result<(), String> {
    let bars = |metric: &'static str, f: fn(&e2e::Contender) -> Spread| plot::Bars {
        metric,
        values: rows
            .iter()
            .map(|r| {
                let s = f(r);
                let label = match r.name {
                    "cqd (demo server)" => "cqd",
                    "naive server" => "naive",
                    "cqd, fenced layout" => "cqd fenced",
                    "naive, fenced layout" => "naive fenced",
                    other => other,
                };
                (label.to_string(), s.median, s.min, s.max)
            })
            .collect(),
    };
    plot::bars(
        png,
        &format!("Storage demo: cqd vs the naive server ({backend})"),
        &[
            bars("ops per second", |r| r.ops_per_s),
            bars("p99 latency, µs", |r| r.p99_us),
            bars("process CPU µs per op", |r| r.cpu_us_per_op),
        ],
    )
}
