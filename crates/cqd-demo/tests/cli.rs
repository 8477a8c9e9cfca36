//! The binary, as a user runs it: good runs pass both verdicts, bad input
//! gets a clear message and a non-zero exit, failures are reported as
//! failures and never hang. With the `verbs` feature, also the verbs
//! failures that need no device (tests/verbs.rs has those that do).
#![allow(missing_docs)]

use std::path::PathBuf;
mod common;
use common::{run_for, text};
use std::process::Output;
use std::time::Duration;

fn run(args: &[&str]) -> Output {
    run_for(args, Duration::from_secs(120))
}

fn tmp(name: &str) -> PathBuf {
    // Inside the build directory (cargo cleans it), not the system /tmp.
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cqd-demo-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir.join(name)
}

/// Asserts a bad-input exit: code 2, nothing on stdout, and a message on
/// stderr containing every one of `words`.
fn refused(args: &[&str], words: &[&str]) {
    let out = run(args);
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: stderr:\n{err}");
    assert!(
        !text(&out.stdout).contains("verdict"),
        "{args:?} ran anyway"
    );
    for w in words {
        assert!(err.contains(w), "{args:?}: {w:?} not in stderr:\n{err}");
    }
}

fn json(path: &PathBuf) -> serde_json::Value {
    let s = std::fs::read_to_string(path).expect("the JSON report was written");
    serde_json::from_str(&s).expect("the JSON report parses")
}

#[test]
fn a_short_run_passes_both_verdicts_and_writes_json() {
    let path = tmp("short.json");
    let p = path.to_str().unwrap();
    let out = run(&["--duration", "1s", "--device-size", "4MiB", "--json", p]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("verdict data:     PASSED"), "{stdout}");
    assert!(stdout.contains("verdict accounts: PASSED"), "{stdout}");
    // stdout is a pipe here, as in CI: no progress bar, no escapes.
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\r'),
        "{stdout:?}"
    );
    let r = json(&path);
    assert_eq!(r["verdicts"]["data"]["passed"], true);
    assert_eq!(r["verdicts"]["accounts"]["passed"], true);
    assert!(r["load"]["completed"].as_u64().unwrap() > 0);
    assert!(r["load"]["reads"].as_u64().unwrap() > 0);
    assert!(r["load"]["writes"].as_u64().unwrap() > 0);
    assert_eq!(r["load"]["failed"], 0);
    assert_eq!(r["verify"]["mismatches"], 0);
    // The close flushed the receives; that broke no connection.
    assert_eq!(r["servers"][0]["broken"], 0, "{}", r["servers"]);
    assert_eq!(r["servers"][0]["errors"], 0, "{}", r["servers"]);
    assert_eq!(r["load"]["dead_connections"], 0);
    // Every block of the 4 MiB device was read back and matched.
    assert_eq!(r["load"]["verify_matched"], 1024);
    assert!(r["latency"]["p99_us"].as_f64().unwrap() > 0.0);
    // Accounts: both sides' handlers, every kind that was posted, and
    // each balances.
    let accounts = r["accounts"].as_array().unwrap();
    let kinds: std::collections::BTreeSet<&str> = accounts
        .iter()
        .map(|a| a["kind"].as_str().unwrap())
        .collect();
    for k in ["send", "recv", "rdma_read", "rdma_write"] {
        assert!(
            kinds
                .iter()
                .any(|x| x.contains(k.trim_start_matches("rdma_"))),
            "{k} in {kinds:?}"
        );
    }
    for a in accounts {
        let posted = a["posted"].as_u64().unwrap();
        let done = a["completed"].as_u64().unwrap() + a["flushed"].as_u64().unwrap();
        assert_eq!(posted, done, "{a}");
    }
}

#[test]
fn an_operation_count_stops_the_load() {
    let path = tmp("ops.json");
    let out = run(&[
        "--ops",
        "3000",
        "--device-size",
        "4MiB",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    let r = json(&path);
    assert_eq!(r["load"]["completed"], 3000);
    assert_eq!(r["load"]["issued"], 3000);
}

#[test]
fn blocks_are_striped_over_several_servers() {
    let path = tmp("servers.json");
    let out = run(&[
        "--servers",
        "3",
        "--connections",
        "3",
        "--qd",
        "8",
        "--device-size",
        "2MiB",
        "--duration",
        "1s",
        "--json",
        path.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    let r = json(&path);
    let servers = r["servers"].as_array().unwrap();
    assert_eq!(servers.len(), 3);
    for s in servers {
        assert!(s["reads"].as_u64().unwrap() > 0, "{s}");
        assert!(s["writes"].as_u64().unwrap() > 0, "{s}");
    }
    // 3 servers × 512 blocks, all read back.
    assert_eq!(r["load"]["verify_matched"], 1536);
}

#[test]
fn compare_modes_prints_one_row_per_mode() {
    let out = run(&[
        "--compare-modes",
        "--duration",
        "300ms",
        "--device-size",
        "2MiB",
    ]);
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    for mode in ["busy", "event", "hybrid", "adaptive"] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(mode))
            .unwrap_or_else(|| panic!("no {mode} row in\n{stdout}"));
        assert!(row.ends_with("passed"), "{row}");
    }
    assert!(stdout.contains("p99.9"), "{stdout}");
    assert!(stdout.contains("spills"), "{stdout}");
}

#[test]
fn transport_errors_fail_requests_without_hanging_and_keep_the_accounts() {
    let path = tmp("faults.json");
    let out = run_for(
        &[
            "--fault-rate",
            "0.001",
            "--duration",
            "1s",
            "--device-size",
            "4MiB",
            "--op-timeout",
            "200ms",
            "--json",
            path.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("requests failed"), "{stdout}");
    let r = json(&path);
    assert!(
        r["nic"]["injected_errors"].as_u64().unwrap() > 0,
        "{}",
        r["nic"]
    );
    assert!(r["load"]["failed"].as_u64().unwrap() > 0, "{}", r["load"]);
    assert!(r["load"]["dead_connections"].as_u64().unwrap() > 0);
    // Nothing that failed was taken for data: no mismatch, and the
    // accounts balance (every request completed, failed or flushed).
    assert_eq!(r["verify"]["mismatches"], 0, "{}", r["mismatches"]);
    assert_eq!(
        r["verdicts"]["accounts"]["passed"], true,
        "{}",
        r["verdicts"]["accounts"]["detail"]
    );
}

#[test]
fn bad_flags_are_refused() {
    refused(&["--qd", "many"], &["--qd", "many"]);
    refused(&["--frobnicate"], &["--frobnicate"]);
    refused(&["--mode", "sideways"], &["sideways"]);
    refused(&["--duration", "10"], &["unit"]);
    refused(&["--block-size", "4 parsecs"], &["unknown unit"]);
    refused(
        &["--ops", "5", "--duration", "1s"],
        &["cannot be used with"],
    );
    refused(&["--read-pct", "150"], &["--read-pct 150"]);
    refused(&["--ops", "0"], &["--ops 0"]);
    refused(&["--workers", "0"], &["--workers 0"]);
    if cfg!(feature = "verbs") {
        refused(
            &["--backend", "verbs", "--fault-rate", "0.01"],
            &["--fault-rate", "--backend sim"],
        );
    } else {
        // The default build has no verbs: the way to get it, named.
        for args in [
            &["--backend", "verbs"][..],
            &["serve"],
            &["load", "--server", "127.0.0.1:1"],
        ] {
            refused(
                args,
                &[
                    "`verbs` cargo feature",
                    "--features verbs",
                    "libibverbs-dev",
                ],
            );
        }
    }
    refused(&["serve", "--backend", "sim"], &["verbs only"]);
    refused(
        &["--device", "mlx5_0"],
        &["--device is for --backend verbs"],
    );
    refused(&["--server", "127.0.0.1:1"], &["--server is for `load`"]);
    refused(&["--listen", "0.0.0.0:1"], &["--listen"]);
}

#[test]
fn bad_size_combinations_are_refused() {
    refused(
        &["--device-size", "64KiB", "--qd", "32"],
        &["cannot keep 128 requests in flight", "--device-size"],
    );
    refused(
        &["--device-size", "5000"],
        &["whole number of 4096-byte blocks"],
    );
    refused(&["--block-size", "1000"], &["multiple of 512"]);
    refused(&["--block-size", "2MiB"], &["1 MiB"]);
    refused(
        &["--servers", "4", "--connections", "2"],
        &["every server needs a connection"],
    );
    refused(&["--device-size", "8GiB"], &["at most"]);
    refused(
        &[
            "--servers",
            "16",
            "--connections",
            "16",
            "--device-size",
            "1GiB",
        ],
        &["need 17179869184 bytes"],
    );
}

#[test]
fn bad_topology_files_are_refused() {
    let missing = tmp("no-such-topology.toml");
    refused(
        &["--topology", missing.to_str().unwrap()],
        &["topology", "no-such-topology.toml"],
    );
    let write = |name: &str, body: &str| {
        let p = tmp(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let parse = write(
        "parse.toml",
        "[[poller]]\nname = \"server\"\ncqs = [\"srv0\"]\n[[pool]]\nname = \"io\"\nthreads = \"four\"\n",
    );
    refused(
        &["--topology", parse.to_str().unwrap()],
        &["line 6", "four"],
    );
    let unknown = write(
        "unknown.toml",
        "[[poller]]\nname = \"server\"\ncqs = [\"srv0\"]\nspeed = 11\n",
    );
    refused(&["--topology", unknown.to_str().unwrap()], &["speed"]);
    let foreign = write(
        "foreign.toml",
        "[[poller]]\nname = \"a\"\ncqs = [\"srv0\", \"rx0\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load0\"]\n\
         [[pool]]\nname = \"io\"\nthreads = 1\n",
    );
    refused(
        &["--topology", foreign.to_str().unwrap()],
        &["\"rx0\"", "srv<i>"],
    );
    let no_pool = write(
        "nopool.toml",
        "[[poller]]\nname = \"a\"\ncqs = [\"srv0\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load0\"]\n",
    );
    refused(
        &["--topology", no_pool.to_str().unwrap()],
        &["no pool named \"io\""],
    );
    let zero = write(
        "zero.toml",
        "[[poller]]\nname = \"a\"\ncqs = [\"srv0\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load0\"]\n\
         [[pool]]\nname = \"io\"\nthreads = 0\n",
    );
    refused(&["--topology", zero.to_str().unwrap()], &["pool[0]"]);
    let twice = write(
        "twice.toml",
        "[[poller]]\nname = \"a\"\ncqs = [\"srv0\"]\n[[poller]]\nname = \"b\"\ncqs = [\"load0\", \"srv0\"]\n\
         [[pool]]\nname = \"io\"\nthreads = 1\n",
    );
    refused(
        &["--topology", twice.to_str().unwrap()],
        &["both server and load"],
    );
}

#[test]
fn the_shipped_topology_file_runs() {
    let file = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/demo-topology.toml"
    );
    let out = run(&[
        "--topology",
        file,
        "--ops",
        "500",
        "--device-size",
        "2MiB",
        "--mode",
        "event",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
    assert!(text(&out.stdout).contains("mode event"));
}

#[test]
fn one_request_in_flight_still_reads_back_every_block() {
    // With a single slot, the in-flight count would touch 0 between two
    // requests if the next were counted only after the last one left; the
    // read-back must not take that for its end (it did, in two runs of
    // three with the release build, before the fix).
    for n in 0..3 {
        let path = tmp(&format!("qd1-{n}.json"));
        let out = run(&[
            "--qd",
            "1",
            "--connections",
            "1",
            "--device-size",
            "1MiB",
            "--duration",
            "200ms",
            "--json",
            path.to_str().unwrap(),
        ]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stdout));
        assert_eq!(json(&path)["load"]["verify_matched"], 256);
    }
}

#[cfg(feature = "verbs")]
#[test]
fn a_device_that_does_not_exist_is_named() {
    // Runs everywhere: outside the launcher libibverbs lists no device,
    // under it none has this name; either way the same message.
    let out = run_for(
        &["--backend", "verbs", "--device", "nosuch9", "--quick"],
        Duration::from_secs(30),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no RDMA device nosuch9"), "{err}");
    assert!(!text(&out.stdout).contains("verdict"));
    let out = run_for(
        &["serve", "--device", "nosuch9", "--listen", "127.0.0.1:0"],
        Duration::from_secs(30),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no RDMA device nosuch9"), "{err}");
    // The load reaches its servers first, then opens the device: the
    // device is what it reports (and the server is left waiting).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let out = run_for(
        &["load", "--device", "nosuch9", "--server", &addr],
        Duration::from_secs(30),
    );
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("no RDMA device nosuch9"), "{err}");
}

#[cfg(feature = "verbs")]
#[test]
fn a_server_that_is_not_there_fails_fast() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let started = std::time::Instant::now();
    let out = run_for(&["load", "--server", &addr], Duration::from_secs(30));
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!("cannot reach server {addr}")),
        "{err}"
    );
    assert!(err.contains("cqd-demo serve"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
}
