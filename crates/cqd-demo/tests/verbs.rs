//! The binary on real verbs (cargo feature `verbs`): one process on the
//! device, `serve` and `load` as two processes with data verification, and
//! each peer killed mid-run. Every test here needs the device: they run
//! under `softverbs-run` (`.ci/softverbs.sh`; nextest runs them under it
//! or leaves them out, .config/nextest.toml) and print SKIPPED elsewhere.
//! The bad cases that need no device (a device that does not exist, a
//! server that is not there) are in tests/cli.rs.
#![cfg(feature = "verbs")]
#![allow(missing_docs)]

mod common;
use common::served::{
    assert_accounts_balanced, kill_server_mid_run, launcher_or_skip, serve, KilledServer,
};
use common::{run_for as run, spawn, text};
use std::time::{Duration, Instant};

#[test]
fn one_process_on_the_device_passes_both_verdicts() {
    if !launcher_or_skip("one_process_on_the_device_passes_both_verdicts") {
        return;
    }
    let out = run(
        &[
            "--backend",
            "verbs",
            "--device",
            "softverbs0",
            "--duration",
            "1s",
            "--device-size",
            "4MiB",
        ],
        Duration::from_secs(120),
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("verdict data:     PASSED"), "{stdout}");
    assert!(stdout.contains("verdict accounts: PASSED"), "{stdout}");
    assert!(stdout.contains("1024 matched"), "{stdout}");
    // softverbs has type-2 windows: each request's buffer went through one.
    assert!(
        stdout.contains("exposure  each request's buffer through a memory window"),
        "{stdout}"
    );
}

#[test]
fn serve_and_load_processes_pass_with_data_verification() {
    if !launcher_or_skip("serve_and_load_processes_pass_with_data_verification") {
        return;
    }
    let a = serve(&["--device-size", "2MiB"]);
    let b = serve(&["--device-size", "2MiB", "--qd", "32"]);
    let out = run(
        &[
            "load",
            "--device",
            "softverbs0",
            "--server",
            &a.addr,
            "--server",
            &b.addr,
            "--duration",
            "1s",
        ],
        Duration::from_secs(120),
    );
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("verdict data:     PASSED"), "{stdout}");
    assert!(stdout.contains("verdict accounts: PASSED"), "{stdout}");
    // Striped over both: 2 × 512 blocks read back.
    assert!(stdout.contains("1024 matched"), "{stdout}");
    assert_eq!(
        stdout.matches("(its own side) PASSED").count(),
        2,
        "{stdout}"
    );
    for s in [a, b] {
        let (code, sout, serr) = s.end(Duration::from_secs(60));
        assert_eq!(code, Some(0), "{sout}\n{serr}");
        assert!(sout.contains("verdict accounts: PASSED"), "{sout}");
        assert!(sout.contains("verdict session:  PASSED"), "{sout}");
        // Only its own side: no load poller in its table.
        assert!(!sout.lines().any(|l| l.starts_with("load ")), "{sout}");
        assert!(sout.lines().any(|l| l.starts_with("server ")), "{sout}");
    }
}

#[test]
fn a_server_killed_mid_run_fails_the_load_fast_and_never_hangs() {
    if !launcher_or_skip("a_server_killed_mid_run_fails_the_load_fast_and_never_hangs") {
        return;
    }
    let KilledServer {
        code,
        stdout,
        stderr,
        load_took,
    } = kill_server_mid_run(&["--device-size", "4MiB"], &[]);
    assert!(load_took < Duration::from_secs(20), "{load_took:?}");
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("went away mid-run"), "{stderr}");
    assert!(
        stdout.contains("requests failed (reported as failed, never as done)"),
        "{stdout}"
    );
    assert!(stdout.contains("verdict data:     FAILED"), "{stdout}");
    assert!(stdout.contains("(its own side) FAILED"), "{stdout}");
    // What failed was not taken for data, and the load's own requests are
    // all accounted for (completed, failed or flushed).
    assert!(stdout.contains("0 mismatched"), "{stdout}");
    assert_accounts_balanced(&stdout);
}

#[test]
fn a_load_killed_mid_run_ends_the_server_with_its_verdict() {
    if !launcher_or_skip("a_load_killed_mid_run_ends_the_server_with_its_verdict") {
        return;
    }
    let s = serve(&["--device-size", "4MiB"]);
    let mut load = spawn(&[
        "load",
        "--device",
        "softverbs0",
        "--server",
        &s.addr,
        "--duration",
        "30s",
    ]);
    std::thread::sleep(Duration::from_millis(1500));
    load.kill().expect("kill the load");
    let _ = load.wait();
    let killed = Instant::now();
    let (code, stdout, stderr) = s.end(Duration::from_secs(30));
    assert!(
        killed.elapsed() < Duration::from_secs(25),
        "{:?}",
        killed.elapsed()
    );
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(stderr.contains("went away mid-session"), "{stderr}");
    assert!(stdout.contains("verdict session:  FAILED"), "{stdout}");
    // Its own requests are all accounted for (completed, failed or
    // flushed) even though the peer vanished.
    assert_accounts_balanced(&stdout);
}
