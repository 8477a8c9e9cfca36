//! `serve` and `load` with `--cm rdmacm` (cargo feature `verbs`): the queue
//! pairs connect through rdma_cm. Two servers striped with data
//! verification, a `--cm` mismatch refused with both settings named, and a
//! server killed mid-run (the CM's disconnect and the TCP watcher fail the
//! load fast). Run under `softverbs-run`; SKIPPED elsewhere.
#![cfg(feature = "verbs")]
#![allow(missing_docs)]

mod common;
use common::served::{
    assert_accounts_balanced, kill_server_mid_run, launcher_or_skip, serve, KilledServer,
};
use common::{run_for as run, text};
use std::time::{Duration, Instant};

#[test]
fn serve_and_load_connect_through_rdma_cm_with_data_verified() {
    if !launcher_or_skip("serve_and_load_connect_through_rdma_cm_with_data_verified") {
        return;
    }
    let a = serve(&["--device-size", "2MiB", "--cm", "rdmacm"]);
    let b = serve(&[
        "--device-size",
        "2MiB",
        "--cm",
        "rdmacm",
        "--connections",
        "4",
    ]);
    let out = run(
        &[
            "load",
            "--device",
            "softverbs0",
            "--cm",
            "rdmacm",
            "--server",
            &a.addr,
            "--server",
            &b.addr,
            "--connections",
            "4",
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
    assert!(stdout.contains("1024 matched"), "{stdout}");
    for s in [a, b] {
        let (code, sout, serr) = s.end(Duration::from_secs(60));
        assert_eq!(code, Some(0), "{sout}\n{serr}");
        assert!(sout.contains("verdict accounts: PASSED"), "{sout}");
        assert!(sout.contains("verdict session:  PASSED"), "{sout}");
    }
}

#[test]
fn a_cm_mismatch_is_refused_naming_both_settings() {
    if !launcher_or_skip("a_cm_mismatch_is_refused_naming_both_settings") {
        return;
    }
    let mut s = serve(&["--device-size", "2MiB", "--cm", "rdmacm"]);
    let out = run(
        &[
            "load",
            "--device",
            "softverbs0",
            "--server",
            &s.addr,
            "--ops",
            "10",
        ],
        Duration::from_secs(60),
    );
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr
            .contains("the load connects with --cm tcp, this server was started with --cm rdmacm"),
        "{stderr}"
    );
    // A refused handshake is no session: the server says so and goes on
    // waiting.
    let deadline = Instant::now() + Duration::from_secs(20);
    let said = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match s.err.recv_timeout(left) {
            Ok(l) if l.contains("refused load") => break l,
            Ok(_) => {}
            Err(_) => panic!("the server never said it refused the load"),
        }
    };
    assert!(said.contains("--cm rdmacm"), "{said}");
    assert!(
        s.child.try_wait().expect("wait").is_none(),
        "the server kept waiting"
    );
    s.child.kill().expect("kill the server");
    let _ = s.end(Duration::from_secs(30));
}

#[test]
fn a_server_killed_mid_run_under_rdma_cm_fails_the_load_fast() {
    if !launcher_or_skip("a_server_killed_mid_run_under_rdma_cm_fails_the_load_fast") {
        return;
    }
    let KilledServer {
        code,
        stdout,
        stderr,
        load_took,
    } = kill_server_mid_run(
        &["--device-size", "4MiB", "--cm", "rdmacm"],
        &["--cm", "rdmacm"],
    );
    assert!(load_took < Duration::from_secs(20), "{load_took:?}");
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("verdict data:     FAILED"), "{stdout}");
    assert!(stdout.contains("0 mismatched"), "{stdout}");
    assert_accounts_balanced(&stdout);
}
