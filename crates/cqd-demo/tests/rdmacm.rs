//! `serve` and `load` with `--cm rdmacm` (cargo feature `verbs`): the queue
//! pairs connect through rdma_cm. Two servers striped with data
//! verification, a `--cm` mismatch refused with both settings named, a
//! server killed mid-run (the CM's disconnect and the TCP watcher fail the
//! load fast), and a stranger's rdma_cm requests rejected while a session
//! runs. Run under `softverbs-run`, or on rxe in the VM of
//! scripts/rxe-vm.sh on the device and address `CQD_RXE_CM` and
//! `CQD_RXE_CM_ADDR` name (`.ci/rxe.sh`: rxe1 on a dummy interface; rxe0 on
//! `lo` cannot resolve an rdma_cm route); SKIPPED elsewhere, saying why.
#![cfg(feature = "verbs")]
#![allow(missing_docs)]

mod common;
use common::served::{
    assert_accounts_balanced, cm_place_or_skip, kill_server_mid_run_at, serve_at, KilledServer,
    Place,
};
use common::{run_for as run, text};
use std::time::{Duration, Instant};

#[test]
fn serve_and_load_connect_through_rdma_cm_with_data_verified() {
    let Some(place) = cm_place_or_skip("serve_and_load_connect_through_rdma_cm_with_data_verified")
    else {
        return;
    };
    let a = serve_at(&place, &["--device-size", "2MiB", "--cm", "rdmacm"]);
    let b = serve_at(
        &place,
        &[
            "--device-size",
            "2MiB",
            "--cm",
            "rdmacm",
            "--connections",
            "4",
        ],
    );
    let device = place.device_args();
    let out = run(
        &place.load_args(
            &device,
            &[
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
        ),
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
    let Some(place) = cm_place_or_skip("a_cm_mismatch_is_refused_naming_both_settings") else {
        return;
    };
    let mut s = serve_at(&place, &["--device-size", "2MiB", "--cm", "rdmacm"]);
    let device = place.device_args();
    let out = run(
        &place.load_args(&device, &["--server", &s.addr, "--ops", "10"]),
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
    let Some(place) = cm_place_or_skip("a_server_killed_mid_run_under_rdma_cm_fails_the_load_fast")
    else {
        return;
    };
    let KilledServer {
        code,
        stdout,
        stderr,
        load_took,
    } = kill_server_mid_run_at(
        &place,
        &["--device-size", "4MiB", "--cm", "rdmacm"],
        &["--cm", "rdmacm"],
    );
    assert!(load_took < Duration::from_secs(20), "{load_took:?}");
    assert_eq!(code, Some(1), "{stdout}\n{stderr}");
    assert!(stdout.contains("verdict data:     FAILED"), "{stdout}");
    assert!(stdout.contains("0 mismatched"), "{stdout}");
    assert_accounts_balanced(&stdout);
}

/// A stranger's rdma_cm request for connection 0 of the server at `addr`,
/// with private data `data`, from `place`'s device: the reason the server
/// gave in its reject.
fn strangers_request(place: &Place, addr: &str, data: Vec<u8>) -> String {
    use cqd_core::{CqOptions, NoWork};
    use cqd_verbs::cm::{CmError, CmParams, ConnectionManager};
    use cqd_verbs::{Context, CqSpec, QpCap, QpInit};
    let ctx = Context::open(&place.device).expect("the device");
    let pd = ctx.alloc_pd().unwrap();
    let (cq, _unbound, _handle) = ctx
        .create_dispatched_cq::<NoWork>("stranger", 64, CqSpec::default(), CqOptions::default())
        .unwrap();
    let cap = QpCap {
        max_send_wr: 4,
        max_recv_wr: 4,
        ..QpCap::default()
    };
    let qp = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let cm = ConnectionManager::new().unwrap();
    let params = CmParams {
        private_data: data,
        ..CmParams::default()
    };
    match cm.connect(addr.parse().unwrap(), qp, &params) {
        Err(CmError::Rejected { private_data, .. }) => {
            let end = private_data
                .iter()
                .position(|&b| b == 0)
                .unwrap_or(private_data.len());
            String::from_utf8_lossy(&private_data[..end]).into_owned()
        }
        Err(e) => panic!("the stranger's request: {e}"),
        Ok(_) => panic!("a stranger's request was accepted"),
    }
}

#[test]
fn a_strangers_rdma_cm_request_is_rejected_and_the_session_goes_on() {
    let Some(place) =
        cm_place_or_skip("a_strangers_rdma_cm_request_is_rejected_and_the_session_goes_on")
    else {
        return;
    };
    use cqd_demo::auth::CM_MAC_LEN;
    use cqd_demo::backend::cm::request_data;
    let s = serve_at(&place, &["--device-size", "2MiB", "--cm", "rdmacm"]);
    // Before any session: a request for connection 0 with a MAC of no
    // session's key.
    let forged = request_data(0, &[0x5a; CM_MAC_LEN]);
    let why = strangers_request(&place, &s.addr, forged.clone());
    assert!(why.contains("its MAC is no session's"), "{why}");
    // A session runs.
    let device = place.device_args();
    let load = common::spawn(&place.load_args(
        &device,
        &[
            "--cm",
            "rdmacm",
            "--server",
            &s.addr,
            "--connections",
            "2",
            "--duration",
            "3s",
        ],
    ));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match s.err.recv_timeout(left) {
            Ok(l) if l.contains("serving") => break,
            Ok(_) => {}
            Err(_) => panic!("the server never served"),
        }
    }
    // A request for its connection 0 with the forged MAC again, and one
    // that is not the demo's. Both rejected; the session goes on.
    let why = strangers_request(&place, &s.addr, forged);
    assert!(
        why.contains("connection 0: its MAC is no session's"),
        "{why}"
    );
    let why = strangers_request(&place, &s.addr, b"another protocol".to_vec());
    assert!(why.contains("not a cqd-demo connection request"), "{why}");
    let out = common::finish(load, "the honest load", Duration::from_secs(120));
    let stdout = text(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}\n{}",
        text(&out.stderr)
    );
    assert!(stdout.contains("verdict data:     PASSED"), "{stdout}");
    assert!(stdout.contains("verdict accounts: PASSED"), "{stdout}");
    // The server's report counts and names each.
    let (code, sout, serr) = s.end(Duration::from_secs(60));
    assert_eq!(code, Some(0), "{sout}\n{serr}");
    assert!(sout.contains("rdma_cm   3 request(s) rejected"), "{sout}");
    let from = format!("rejected  rdma_cm request from {}", place.ip);
    assert_eq!(
        sout.lines().filter(|l| l.starts_with(&from)).count(),
        3,
        "{sout}"
    );
    assert!(sout.contains("verdict session:  PASSED"), "{sout}");
}
