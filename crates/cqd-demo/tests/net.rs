//! `serve` and `load` joined over real TCP sockets, on the simulated NIC:
//! the handshake, the striping over several servers, refusals, a server
//! that is not there and a control connection that dies mid-run; then
//! the attacks on the handshake and the session (issue 42): silent, slow
//! and flooding clients, malformed, replayed and altered messages after
//! `join`, each refused while the server stays up and an honest load
//! passes. Both halves run in this process (the simulated fabric is
//! in-process); the same code runs the two-process verbs form
//! (tests/verbs.rs and tests/hostile.rs, on a device).
#![allow(missing_docs)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use clap::Parser;
use common::attack::{
    self, proxy, refusal_on, sealed_of, sealed_refusal, Seen, Trickle, Way, JOIN_BOUND,
};
use cqd_demo::auth::{self, Direction, Secret, SessionKey};
use cqd_demo::backend::sim::{SimFabric, SimNode};
use cqd_demo::config::{Args, Command, Config};
use cqd_demo::net::{load_on, seal, serve_on, Msg, Wire, MAX_HANDSHAKES};
use cqd_demo::report::{Report, ServeReport};
use cqd_demo::DemoError;
use serde_json::{json, Value};

fn config(extra: &[&str]) -> Config {
    let mut v = vec!["cqd-demo", "--no-progress"];
    v.extend_from_slice(extra);
    Args::try_parse_from(v).unwrap().check().unwrap()
}

fn serve_cfg(extra: &[&str]) -> Config {
    let mut c = config(extra);
    c.command = Command::Serve;
    c.servers = 1;
    c.accept_timeout = Some(Duration::from_secs(60));
    c
}

fn load_cfg(servers: &[String], extra: &[&str]) -> Config {
    let mut c = config(extra);
    c.command = Command::Load;
    c.servers = servers.len() as u32;
    c.server_addrs = servers.to_vec();
    c
}

/// A server thread on `fabric`; returns its address and its end.
fn server(
    fabric: &SimFabric,
    name: &'static str,
    cfg: Config,
) -> (String, JoinHandle<Result<ServeReport, DemoError>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let fabric = fabric.clone();
    let (tx, rx) = mpsc::channel();
    let h = std::thread::spawn(move || {
        serve_on(
            &cfg,
            listener,
            |_: &str| Ok::<SimNode, DemoError>(fabric.open(name)),
            |addr| tx.send(addr.to_string()).unwrap(),
        )
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the server listens");
    (addr, h)
}

fn load(fabric: &SimFabric, cfg: &Config) -> Result<Report, DemoError> {
    let fabric = fabric.clone();
    load_on(cfg, move || Ok(move |name: &str| Ok(fabric.open(name))))
}

#[test]
fn a_load_and_a_server_over_tcp_both_pass_and_each_reports_its_side() {
    let fabric = SimFabric::new(0.0, 1);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let r = load(
        &fabric,
        &load_cfg(std::slice::from_ref(&addr), &["--duration", "500ms"]),
    )
    .unwrap();
    let text = r.text();
    assert!(r.passed(), "{text}");
    assert!(text.contains("verdict data:     PASSED"), "{text}");
    assert!(text.contains("verdict accounts: PASSED"), "{text}");
    // The load learnt the geometry in the handshake.
    assert_eq!(r.config.blocks_per_server, 512);
    assert_eq!(r.load.verify_matched, 512, "{text}");
    assert!(r.load.reads > 0 && r.load.writes > 0, "{text}");
    // Its accounts are its own: only load handlers, only load pollers.
    assert!(
        r.accounts.iter().all(|a| a.handler.starts_with("load/")),
        "{:?}",
        r.accounts
    );
    assert!(
        r.pollers.iter().all(|p| p.role == "load"),
        "{:?}",
        r.pollers
    );
    assert!(r.servers.is_empty());
    // The server's word came back.
    assert_eq!(r.peers.len(), 1);
    assert!(r.peers[0].passed, "{:?}", r.peers);
    assert!(r.peers[0].detail.contains("posted"), "{:?}", r.peers);
    let s = srv.join().unwrap().unwrap();
    let stext = s.text();
    assert!(s.passed(), "{stext}");
    assert!(stext.contains("verdict accounts: PASSED"), "{stext}");
    assert!(stext.contains("verdict session:  PASSED"), "{stext}");
    assert!(
        s.pollers.iter().all(|p| p.role == "server"),
        "{:?}",
        s.pollers
    );
    assert!(
        s.accounts.iter().all(|a| a.handler.starts_with("srv0/")),
        "{:?}",
        s.accounts
    );
    assert_eq!(
        s.server.reads + s.server.writes,
        r.load.completed + r.load.verify_read
    );
}

#[test]
fn blocks_are_striped_over_two_server_processes() {
    let fabric = SimFabric::new(0.0, 2);
    let (a, sa) = server(&fabric, "srv0", serve_cfg(&["--device-size", "1MiB"]));
    let (b, sb) = server(&fabric, "srv1", serve_cfg(&["--device-size", "2MiB"]));
    let r = load(
        &fabric,
        &load_cfg(&[a, b], &["--ops", "2000", "--connections", "2"]),
    )
    .unwrap();
    assert!(r.passed(), "{}", r.text());
    // The smaller server sets the blocks per server: 2 × 256 read back.
    assert_eq!(r.config.blocks_per_server, 256);
    assert_eq!(r.load.verify_matched, 512, "{}", r.text());
    for h in [sa, sb] {
        let s = h.join().unwrap().unwrap();
        assert!(s.passed(), "{}", s.text());
        assert!(s.server.reads > 0 && s.server.writes > 0, "{}", s.text());
    }
}

#[test]
fn connections_come_and_go_between_a_load_and_two_server_processes() {
    // --churn over the control connections: the load closes its side, each
    // server closes and replaces its own on `reconnect`.
    let fabric = SimFabric::new(0.0, 3);
    let (a, sa) = server(&fabric, "srv0", serve_cfg(&["--device-size", "1MiB"]));
    let (b, sb) = server(&fabric, "srv1", serve_cfg(&["--device-size", "1MiB"]));
    let r = load(
        &fabric,
        &load_cfg(
            &[a, b],
            &[
                "--connections",
                "4",
                "--qd",
                "4",
                "--churn",
                "200",
                "--duration",
                "600ms",
            ],
        ),
    )
    .unwrap();
    let text = r.text();
    assert!(r.passed(), "{text}");
    let churn = r.churn.as_ref().expect("a churn line");
    // How many cycles fit in the run depends on the machine's load; the
    // first is due 1/200 s into the run, so at least one runs.
    assert!(churn.cycles >= 1 && churn.failed == 0, "{text}");
    assert_eq!(r.load.dead_connections, 0, "{text}");
    let mut closed = 0;
    for h in [sa, sb] {
        let s = h.join().unwrap().unwrap();
        assert!(s.passed(), "{}", s.text());
        closed += s.server.closed;
    }
    assert_eq!(closed, churn.cycles, "{text}");
}

#[test]
fn a_server_that_is_not_there_fails_fast_with_its_address() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let fabric = SimFabric::new(0.0, 3);
    let started = Instant::now();
    let e = load(&fabric, &load_cfg(&[format!("127.0.0.1:{port}")], &[])).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("cannot reach server"), "{msg}");
    assert!(msg.contains(&format!("127.0.0.1:{port}")), "{msg}");
    assert_eq!(e.exit_code(), 1);
    assert!(
        started.elapsed() < Duration::from_secs(6),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn refused_handshakes_and_garbage_do_not_end_the_server() {
    let fabric = SimFabric::new(0.0, 4);
    let (addr, srv) = server(
        &fabric,
        "srv0",
        serve_cfg(&["--device-size", "2MiB", "--qd", "8"]),
    );
    // A deeper queue than the server takes: refused, with the way out.
    let e = load(
        &fabric,
        &load_cfg(std::slice::from_ref(&addr), &["--qd", "16"]),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("refused the load"), "{msg}");
    assert!(msg.contains("--qd 16"), "{msg}");
    // Another block size.
    let e = load(
        &fabric,
        &load_cfg(
            std::slice::from_ref(&addr),
            &["--qd", "8", "--block-size", "8KiB"],
        ),
    )
    .unwrap_err();
    assert!(e.to_string().contains("block size 8192"), "{e}");
    // Not JSON: refused with the reason.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"GET / HTTP/1.0\n").unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.contains("refused"), "{answer:?}");
    assert!(answer.contains("not a cqd-demo message"), "{answer:?}");
    // A line longer than any message (the server stops reading it at
    // 64 KiB: its answer may be lost in the reset), then a peer that
    // connects and says nothing before closing: neither ends the server.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let _ = s.write_all(&vec![b'x'; 100_000]);
    let _ = s.shutdown(Shutdown::Write);
    let _ = s.read_to_string(&mut String::new());
    drop(TcpStream::connect(&addr).unwrap());
    // A fitting load is then served.
    let r = load(
        &fabric,
        &load_cfg(std::slice::from_ref(&addr), &["--qd", "8", "--ops", "500"]),
    )
    .unwrap();
    assert!(r.passed(), "{}", r.text());
    let s = srv.join().unwrap().unwrap();
    assert!(s.passed(), "{}", s.text());
}

/// Forwards one TCP connection to `to` until `cut` fires, then closes
/// both sides (as a dying peer's kernel does).
fn cutting_proxy(to: String, cut: mpsc::Receiver<()>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (a, _) = l.accept().unwrap();
        let b = TcpStream::connect(&to).unwrap();
        let pipe = |mut from: TcpStream, mut to: TcpStream| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = from.read(&mut buf) {
                    if n == 0 || to.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            })
        };
        pipe(a.try_clone().unwrap(), b.try_clone().unwrap());
        pipe(b.try_clone().unwrap(), a.try_clone().unwrap());
        let _ = cut.recv();
        let _ = a.shutdown(Shutdown::Both);
        let _ = b.shutdown(Shutdown::Both);
    });
    addr
}

#[test]
fn a_control_connection_lost_mid_run_fails_the_requests_in_flight_on_both_sides() {
    let fabric = SimFabric::new(0.0, 5);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let (cut, when) = mpsc::channel();
    let via = cutting_proxy(addr, when);
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(400));
        let _ = cut.send(());
    });
    let started = Instant::now();
    let r = load(&fabric, &load_cfg(&[via], &["--duration", "20s"])).unwrap();
    let text = r.text();
    // Ended by the loss, not by the 20 s.
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}\n{text}",
        started.elapsed()
    );
    assert!(!r.passed(), "{text}");
    assert!(r.load.failed > 0, "{text}");
    assert!(r.load.dead_connections > 0, "{text}");
    assert!(!r.peers[0].passed, "{:?}", r.peers);
    // Nothing failed was taken for data, and the load's own accounts
    // balance (its requests completed or were flushed).
    assert_eq!(r.verify.mismatches, 0, "{text}");
    assert!(r.verdicts.accounts.passed, "{text}");
    let s = srv.join().unwrap().unwrap();
    assert!(!s.passed(), "{}", s.text());
    assert!(!s.session.passed);
    assert!(
        s.session.detail.contains("went away"),
        "{}",
        s.session.detail
    );
    assert!(s.accounts_verdict.passed, "{}", s.text());
}

#[test]
fn a_second_load_is_turned_away_at_once_while_a_session_runs() {
    let fabric = SimFabric::new(0.0, 6);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let first = {
        let fabric = fabric.clone();
        let cfg = load_cfg(std::slice::from_ref(&addr), &["--duration", "3s"]);
        std::thread::spawn(move || load(&fabric, &cfg))
    };
    // Wait until the session runs (the server stops listening then).
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(&addr).is_ok() {
        assert!(Instant::now() < deadline, "the server still listens");
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = Instant::now();
    let e = load(&fabric, &load_cfg(std::slice::from_ref(&addr), &[])).unwrap_err();
    assert!(e.to_string().contains("cannot reach server"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(6));
    let r = first.join().unwrap().unwrap();
    assert!(r.passed(), "{}", r.text());
    assert!(srv.join().unwrap().unwrap().passed());
}

/// `cfg` with the secret in `file` (as `--secret-file` gives it: these
/// configurations are checked as `run` and then made serve or load).
fn with_secret(mut cfg: Config, file: &str) -> Config {
    cfg.secret = Some(Secret::from_file(std::path::Path::new(file)).unwrap());
    cfg
}

/// A secret file in a fresh temporary directory (kept for the test's
/// life), readable and writable by its owner only (mode 0600, as
/// `--secret-file` requires).
fn secret_file(dir: &std::path::Path, name: &str, secret: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, format!("{secret}\n")).unwrap();
    set_mode(&p, 0o600);
    p.to_string_lossy().into_owned()
}

fn set_mode(p: &std::path::Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("cqd-demo-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn with_a_shared_secret_a_stranger_cannot_join_and_the_server_stays_up() {
    let dir = temp_dir("secret");
    let right = secret_file(&dir, "right", "a shared secret of some length");
    let wrong = secret_file(&dir, "wrong", "another secret, just as long");
    let fabric = SimFabric::new(0.0, 4);
    let (addr, srv) = server(
        &fabric,
        "srv0",
        with_secret(serve_cfg(&["--device-size", "2MiB"]), &right),
    );
    let one = std::slice::from_ref(&addr);
    // No secret: refused before any queue pair, with the way in.
    let e = load(&fabric, &load_cfg(one, &["--ops", "100"])).unwrap_err();
    assert!(e.to_string().contains("requires a shared secret"), "{e}");
    // The wrong secret: the server refuses the answer, with the reason.
    let e = load(
        &fabric,
        &with_secret(load_cfg(one, &["--ops", "100"]), &wrong),
    )
    .unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("refused the load"), "{msg}");
    assert!(msg.contains("wrong answer to the challenge"), "{msg}");
    // A raw client that skips the answer: refused too.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let hello = format!(
        "{{\"msg\":\"hello\",\"protocol\":\"cqd-demo\",\"version\":{},\"block_size\":4096,\"qd\":16,\"connections\":4,\"nonce\":\"{}\"}}\n{{\"msg\":\"done\"}}\n",
        cqd_demo::net::VERSION,
        "ab".repeat(32)
    );
    s.write_all(hello.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(answer.contains("challenge"), "{answer:?}");
    assert!(answer.contains("expected answer, got done"), "{answer:?}");
    // A hello whose nonce is not 64 hex digits: refused.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let hello = hello.replace(&"ab".repeat(32), "not-a-nonce");
    s.write_all(hello.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    assert!(
        answer.contains("a nonce must be 64 hex digits"),
        "{answer:?}"
    );
    // The right secret: served, both sides pass.
    let r = load(
        &fabric,
        &with_secret(load_cfg(one, &["--ops", "500"]), &right),
    )
    .unwrap();
    assert!(r.passed(), "{}", r.text());
    let s = srv.join().unwrap().unwrap();
    assert!(s.passed(), "{}", s.text());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_load_with_a_secret_does_not_join_a_server_without_one() {
    let dir = temp_dir("nosecret");
    let right = secret_file(&dir, "right", "a shared secret of some length");
    let fabric = SimFabric::new(0.0, 4);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let one = std::slice::from_ref(&addr);
    let e = load(
        &fabric,
        &with_secret(load_cfg(one, &["--ops", "100"]), &right),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("did not prove it knows the shared secret"),
        "{e}"
    );
    // The server, whose session never started, serves the next load.
    let r = load(&fabric, &load_cfg(one, &["--ops", "300"])).unwrap();
    assert!(r.passed(), "{}", r.text());
    assert!(srv.join().unwrap().unwrap().passed());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_secret_file_is_checked_before_anything_starts() {
    let dir = temp_dir("badsecret");
    let short = secret_file(&dir, "short", "short");
    let e = Secret::from_file(std::path::Path::new(&short)).unwrap_err();
    assert!(e.to_string().contains("give 16 to 4096"), "{e}");
    let e = Secret::from_file(std::path::Path::new("/nonexistent/secret")).unwrap_err();
    assert!(e.to_string().contains("/nonexistent/secret"), "{e}");
    // Only serve and load take one (checked with the other options).
    let fine = secret_file(&dir, "fine", "sixteen bytes ok");
    let e = Args::try_parse_from(["cqd-demo", "--secret-file", &fine])
        .unwrap()
        .check()
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("--secret-file is for `serve` and `load`"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_secret_file_its_group_or_others_may_read_or_write_is_refused() {
    let dir = temp_dir("secretmode");
    let file = secret_file(&dir, "secret", "a shared secret of some length");
    let path = std::path::Path::new(&file);
    // Any bit of group or others, read or write (mode & 0o077 != 0).
    for mode in [0o644, 0o640, 0o604, 0o620, 0o602, 0o610, 0o666] {
        set_mode(path, mode);
        let e = Secret::from_file(path).unwrap_err();
        let msg = e.to_string();
        assert_eq!(e.exit_code(), 2, "{msg}");
        assert!(msg.contains(&file), "names the file: {msg}");
        assert!(msg.contains(&format!("mode {mode:04o}")), "{mode:o}: {msg}");
        assert!(
            msg.contains(&format!("chmod 600 {file}")),
            "{mode:o}: {msg}"
        );
    }
    // Private to its owner: taken.
    for mode in [0o600, 0o400] {
        set_mode(path, mode);
        let s = Secret::from_file(path);
        assert!(s.is_ok(), "mode {mode:04o}: {s:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The forged reason of the tests below: a terminal escape (clear the
/// screen), then a line that looks like a verdict.
const FORGED: &str = "\u{1b}[2J\nverdict accounts: PASSED";

/// What a process prints of `text` passed on from a peer: no raw escape
/// byte, and exactly `own` lines that start as the forged one does (the
/// process's own verdicts, none from the peer); the peer's words are still
/// there, escaped.
fn assert_escaped(text: &str, own: usize) {
    assert!(!text.contains('\u{1b}'), "a raw ESC: {text:?}");
    assert_eq!(
        text.lines()
            .filter(|l| l.starts_with("verdict accounts: PASSED"))
            .count(),
        own,
        "a forged verdict line: {text:?}"
    );
    assert!(
        text.contains(r"\u{1b}[2J\nverdict accounts: PASSED"),
        "the peer's words, escaped: {text:?}"
    );
}

/// One reply of a fake server: made from what it has read so far.
type Reply = Box<dyn FnOnce(&mut Seen) -> String + Send>;

/// A fake server on a free port: for each `(expect, reply)` in turn, reads
/// lines (noting their nonces) until one is the message `expect`, then
/// sends `reply`; then reads until the load closes the connection.
fn fake_server(script: Vec<(&'static str, Reply)>) -> (String, JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut w = s.try_clone().unwrap();
        let mut lines = BufReader::new(s).lines();
        let mut seen = Seen::default();
        for (expect, reply) in script {
            let tag = format!("\"msg\":\"{expect}\"");
            loop {
                let line = lines.next().expect("the load speaks").unwrap();
                seen.observe(&line);
                if line.contains(&tag) {
                    break;
                }
            }
            w.write_all(reply(&mut seen).as_bytes()).unwrap();
            w.write_all(b"\n").unwrap();
        }
        for _ in lines.by_ref() {}
    });
    (addr, h)
}

/// A fake server's welcome without a secret: its token noted in `seen`.
fn fake_welcome(seen: &mut Seen) -> String {
    let token = auth::nonce().unwrap();
    seen.s = Some(token);
    json!({
        "msg": "welcome", "version": cqd_demo::net::VERSION, "block_size": 4096,
        "blocks": 512, "max_qd": 64, "max_connections": 64,
        "token": auth::nonce_hex(&token),
    })
    .to_string()
}

/// `m` sealed as the server's message `seq`, with the key of `seen`.
fn sealed_by_server(seen: &Seen, seq: u64, m: &Msg<Value>) -> String {
    let key = seen.key().expect("the proxy saw the nonce and the token");
    serde_json::to_string(&seal(&key, Direction::ServerToLoad, seq, m).unwrap()).unwrap()
}

#[test]
fn a_forged_refusal_is_printed_escaped() {
    let refused = || Msg::<Value>::Refused {
        reason: FORGED.into(),
    };
    // Refused at hello.
    let fabric = SimFabric::new(0.0, 7);
    let (addr, h) = fake_server(vec![(
        "hello",
        Box::new(move |_: &mut Seen| serde_json::to_string(&refused()).unwrap()),
    )]);
    let e = load(&fabric, &load_cfg(&[addr], &["--ops", "100"])).unwrap_err();
    // What `cqd-demo load` prints of it (main.rs).
    let printed = format!("cqd-demo: {e}");
    assert!(printed.contains("refused the load"), "{printed}");
    assert_escaped(&printed, 0);
    h.join().unwrap();
    // Welcomed, then refused after the join, sealed (a server without a
    // secret: the fake knows the token it sent) and unsealed.
    for sealed in [true, false] {
        let (addr, h) = fake_server(vec![
            ("hello", Box::new(fake_welcome)),
            (
                "sealed",
                Box::new(move |seen: &mut Seen| {
                    if sealed {
                        sealed_by_server(seen, 0, &refused())
                    } else {
                        serde_json::to_string(&refused()).unwrap()
                    }
                }),
            ),
        ]);
        let e = load(&fabric, &load_cfg(&[addr], &["--ops", "100"])).unwrap_err();
        let printed = format!("cqd-demo: {e}");
        let said = if sealed {
            "refused connection 0"
        } else {
            "an unsealed refused, where only sealed messages are taken"
        };
        assert!(printed.contains(said), "{printed}");
        assert_escaped(&printed, 0);
        h.join().unwrap();
    }
}

/// `line` with its `bye`'s detail replaced by `FORGED`, re-sealed with the
/// key a proxy on the path made from the token, as the server's `seq`-th
/// message.
fn forged_bye(line: &str, seen: &Seen) -> String {
    let Ok(Msg::Sealed { seq, .. }) = serde_json::from_str::<Msg<Value>>(line) else {
        panic!("not sealed: {line}")
    };
    let bye = Msg::Bye {
        passed: true,
        detail: FORGED.into(),
    };
    sealed_by_server(seen, seq, &bye)
}

#[test]
fn a_forged_bye_is_printed_escaped_in_the_loads_report() {
    // Without a secret, a proxy on the path reads the token and re-seals
    // what it likes (docs/demo.md, "Trust and exposure"): its forged bye
    // is taken, and printed escaped.
    let fabric = SimFabric::new(0.0, 8);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let via = proxy(
        addr,
        Box::new(|way, line, seen| match way {
            Way::ToLoad if sealed_of(&line, "bye") => vec![forged_bye(&line, seen)],
            _ => vec![line],
        }),
    );
    let r = load(&fabric, &load_cfg(&[via], &["--ops", "300"])).unwrap();
    assert_eq!(r.peers[0].detail, FORGED, "the proxy forged the bye");
    // The load's own accounts verdict is the one line that says it.
    let text = r.text();
    assert!(r.verdicts.accounts.passed, "{text}");
    assert_escaped(&text, 1);
    assert!(srv.join().unwrap().unwrap().passed());
}

#[test]
fn an_altered_or_unsealed_bye_is_no_word_from_the_server() {
    let fabric = SimFabric::new(0.0, 9);
    // Altered: its detail changed under the server's MAC. Unsealed: a bye
    // in the clear in its place.
    type Swap = fn(&str) -> String;
    let cases: [(Swap, &str); 2] = [
        (
            |line| line.replace("posted", "PASSED"),
            "its MAC is not this session's",
        ),
        (
            |_| json!({"msg": "bye", "passed": true, "detail": FORGED}).to_string(),
            "an unsealed bye, where only sealed messages are taken",
        ),
    ];
    for (swap, why) in cases {
        let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
        let via = proxy(
            addr,
            Box::new(move |way, line, _| match way {
                Way::ToLoad if sealed_of(&line, "bye") => vec![swap(&line)],
                _ => vec![line],
            }),
        );
        let r = load(&fabric, &load_cfg(&[via], &["--ops", "300"])).unwrap();
        let text = r.text();
        assert!(!r.peers[0].passed, "{text}");
        assert!(r.peers[0].detail.contains(why), "{:?}", r.peers[0]);
        assert!(!r.passed(), "{text}");
        // The load's own verdicts still pass, and nothing forged is
        // printed.
        assert!(
            r.verdicts.data.passed && r.verdicts.accounts.passed,
            "{text}"
        );
        assert!(!text.contains('\u{1b}'), "{text:?}");
        assert!(srv.join().unwrap().unwrap().passed());
    }
}

#[test]
fn silent_slow_and_flooding_clients_delay_no_honest_join() {
    let fabric = SimFabric::new(0.0, 10);
    let mut cfg = serve_cfg(&["--device-size", "2MiB"]);
    cfg.handshake_timeout = Duration::from_secs(30);
    let (addr, srv) = server(&fabric, "srv0", cfg);
    let honest = load_cfg(std::slice::from_ref(&addr), &["--ops", "500"]);
    let mut joins = Vec::new();
    let mut measure = |what: &str| {
        let (took, wire) = attack::timed_join(&addr, &honest, 1);
        eprintln!("honest join during {what}: {took:?}");
        assert!(took < JOIN_BOUND, "{what}: the honest join took {took:?}");
        joins.push(wire);
    };
    // A silent handshake; one that sends a byte a second.
    let silent = attack::silent(&addr);
    measure("a silent handshake");
    let trickle = Trickle::start(&addr, Duration::from_secs(1));
    measure("a handshake sending one byte a second");
    // 100 idle connections: past the cap, each pushes out the oldest
    // pending handshake (the silent one and the trickle first), which is
    // refused, saying why.
    let idle = attack::idle(&addr, 100);
    for s in [&silent, &trickle.stream] {
        let why = refusal_on(s);
        assert!(why.contains("is ended to make room"), "{why}");
    }
    measure("100 idle connections");
    // The joins measured never connect: each is refused by its deadline
    // or, earlier, pushed out; the idle ones still hold their threads. An
    // honest load runs through all of it and passes.
    drop(joins);
    let r = load(&fabric, &honest).unwrap();
    assert!(r.passed(), "{}", r.text());
    // Its session started: every handshake still pending is ended, with
    // the reason; the others were pushed out before.
    assert!(idle.len() > MAX_HANDSHAKES);
    for s in &idle {
        let why = refusal_on(s);
        assert!(
            why.contains("session has started") || why.contains("is ended to make room"),
            "{why}"
        );
    }
    drop(trickle);
    let s = srv.join().unwrap().unwrap();
    assert!(s.passed(), "{}", s.text());
}

#[test]
fn one_deadline_bounds_the_whole_handshake() {
    let fabric = SimFabric::new(0.0, 11);
    let deadline = Duration::from_secs(3);
    let mut cfg = serve_cfg(&["--device-size", "2MiB"]);
    cfg.handshake_timeout = deadline;
    let (addr, srv) = server(&fabric, "srv0", cfg);
    let honest = load_cfg(std::slice::from_ref(&addr), &["--ops", "300"]);
    let started = Instant::now();
    // A byte every 200 ms: no read waits long, but the handshake does.
    let trickle = Trickle::start(&addr, Duration::from_millis(200));
    // A hello, then nothing after the welcome; a join, then no connect.
    let mut hello_only = TcpStream::connect(&addr).unwrap();
    let nonce = auth::nonce_hex(&auth::nonce().unwrap());
    let hello = json!({
        "msg": "hello", "protocol": "cqd-demo", "version": cqd_demo::net::VERSION,
        "block_size": 4096, "qd": 16, "connections": 1, "nonce": nonce,
    });
    hello_only
        .write_all(format!("{hello}\n").as_bytes())
        .unwrap();
    let (_, mut joined) = attack::timed_join(&addr, &honest, 1);
    for (what, why) in [
        ("the trickle", refusal_on(&trickle.stream)),
        ("the hello", refusal_on(&hello_only)),
        ("the join", sealed_refusal(&mut joined)),
    ] {
        let took = started.elapsed();
        assert!(why.contains("deadline"), "{what}: {why}");
        assert!(
            took >= deadline - Duration::from_millis(50) && took < deadline * 4,
            "{what}: refused after {took:?}"
        );
    }
    drop(trickle);
    let r = load(&fabric, &honest).unwrap();
    assert!(r.passed(), "{}", r.text());
    assert!(srv.join().unwrap().unwrap().passed());
}

/// A client that joined (H1–H4) for `connections` connections, and a raw
/// handle on its socket.
fn joined(addr: &str, connections: u32) -> (Wire, TcpStream) {
    attack::joined(addr, &load_cfg(&[addr.to_string()], &[]), connections)
}

#[test]
fn a_malformed_message_after_join_is_refused_and_the_server_goes_on() {
    let fabric = SimFabric::new(0.0, 12);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    // A load that joins, then says nothing: it holds its own handshake,
    // not the session.
    let (mut stalled, _) = joined(&addr, 4);
    // Garbage, an unsealed connect, a sealed one out of turn, another
    // message, and a connect whose endpoint is not one: each refused with
    // the reason, sealed.
    let unsealed = json!({"msg": "connect", "conn": 0, "endpoint": {"qpn": 1}});
    let lines: [(&str, &str); 2] = [
        ("garbage\n", "not a cqd-demo message"),
        (
            &format!("{unsealed}\n"),
            "an unsealed connect, where only sealed messages are taken",
        ),
    ];
    for (line, why) in lines {
        let (mut wire, mut raw) = joined(&addr, 1);
        raw.write_all(line.as_bytes()).unwrap();
        let reason = sealed_refusal(&mut wire);
        assert!(reason.contains(why), "{reason}");
    }
    let sealed: [(Msg<Value>, &str); 3] = [
        (
            Msg::Connect {
                conn: 1,
                endpoint: json!({"qpn": 1}),
            },
            "expected connect for connection 0, got connect for connection 1",
        ),
        (Msg::Done, "expected connect for connection 0, got done"),
        (
            Msg::Connect {
                conn: 0,
                endpoint: json!("not an endpoint"),
            },
            "sealed message 1: not a cqd-demo message",
        ),
    ];
    for (m, why) in sealed {
        let (mut wire, _) = joined(&addr, 1);
        wire.send(&m).unwrap();
        let reason = sealed_refusal(&mut wire);
        assert!(reason.contains(why), "{reason}");
    }
    // Endpoints the device refuses, for all four connections the server
    // takes: it makes the first QP, fails to connect it, and gives it
    // back, waiting until the poller has dropped it (a QP still held after
    // 5 s would be named, and would cost those 5 s).
    let releasing = Instant::now();
    for _ in 0..3 {
        let (mut wire, _) = joined(&addr, 4);
        for conn in 0..4 {
            wire.send(&Msg::Connect {
                conn,
                endpoint: json!({"qpn": 4_000_000 + conn}),
            })
            .unwrap();
        }
        let reason = sealed_refusal(&mut wire);
        assert!(reason.contains("connect QP"), "{reason}");
    }
    assert!(
        releasing.elapsed() < Duration::from_secs(5),
        "{:?}",
        releasing.elapsed()
    );
    // The stalled one delays nobody: an honest load, on every connection
    // the server takes, runs and passes.
    let r = load(
        &fabric,
        &load_cfg(std::slice::from_ref(&addr), &["--ops", "500"]),
    )
    .unwrap();
    assert!(r.passed(), "{}", r.text());
    let reason = sealed_refusal(&mut stalled);
    assert!(reason.contains("session has started"), "{reason}");
    let s = srv.join().unwrap().unwrap();
    assert!(s.passed(), "{}", s.text());
    // The QPs given back broke nothing, and the session's are the ones
    // after them.
    assert_eq!(s.server.broken, 0, "{}", s.text());
    assert!(
        s.accounts.iter().any(|a| a.handler.starts_with("srv0/c3")),
        "{:?}",
        s.accounts
    );
}

#[test]
fn a_replayed_or_altered_control_message_is_refused_and_the_server_goes_on() {
    let fabric = SimFabric::new(0.0, 13);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let one = |via: String| load_cfg(&[via], &["--ops", "300", "--connections", "2"]);
    // Replayed: the proxy sends the first connect twice.
    let mut replayed = false;
    let via = proxy(
        addr.clone(),
        Box::new(move |way, line, _| {
            if way == Way::ToServer && sealed_of(&line, "connect") && !replayed {
                replayed = true;
                return vec![line.clone(), line];
            }
            vec![line]
        }),
    );
    let e = load(&fabric, &one(via)).unwrap_err().to_string();
    assert!(e.contains("refused connection 0"), "{e}");
    assert!(e.contains("where 2 was next (replayed"), "{e}");
    // Altered: the proxy changes the endpoint in a connect, under its MAC.
    let via = proxy(
        addr.clone(),
        Box::new(|way, line, _| match way {
            Way::ToServer if sealed_of(&line, "connect") => {
                vec![line.replacen("\\\"qpn\\\":", "\\\"qpn\\\":1", 1)]
            }
            _ => vec![line],
        }),
    );
    let e = load(&fabric, &one(via)).unwrap_err().to_string();
    assert!(e.contains("its MAC is not this session's"), "{e}");
    // The server stayed up: an honest load runs and passes.
    let r = load(&fabric, &one(addr)).unwrap();
    assert!(r.passed(), "{}", r.text());
    let s = srv.join().unwrap().unwrap();
    assert!(s.passed(), "{}", s.text());
}

#[test]
fn an_altered_done_ends_the_session_cleanly() {
    let fabric = SimFabric::new(0.0, 14);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    // The proxy flips a digit of the done's MAC.
    let via = proxy(
        addr,
        Box::new(|way, line, _| match way {
            Way::ToServer if sealed_of(&line, "done") => {
                let at = line.rfind("\"mac\":\"").unwrap() + 7;
                let mut b = line.into_bytes();
                b[at] = if b[at] == b'0' { b'1' } else { b'0' };
                vec![String::from_utf8(b).unwrap()]
            }
            _ => vec![line],
        }),
    );
    let r = load(&fabric, &load_cfg(&[via], &["--ops", "300"])).unwrap();
    // The load's own verdicts pass; the server refused its done.
    assert!(
        r.verdicts.data.passed && r.verdicts.accounts.passed,
        "{}",
        r.text()
    );
    assert!(!r.peers[0].passed, "{:?}", r.peers);
    assert!(
        r.peers[0].detail.contains("refused the session"),
        "{:?}",
        r.peers
    );
    let s = srv.join().unwrap().unwrap();
    assert!(!s.session.passed, "{}", s.text());
    assert!(
        s.session.detail.contains("its MAC is not this session's"),
        "{}",
        s.session.detail
    );
    assert!(s.accounts_verdict.passed, "{}", s.text());
}

#[test]
fn a_stalled_connect_phase_does_not_hold_the_session() {
    // A load that joins and sends one of its two connects, then stalls:
    // it claims nothing (the claim waits for every connect), so an honest
    // load is served at once.
    let fabric = SimFabric::new(0.0, 15);
    let (addr, srv) = server(&fabric, "srv0", serve_cfg(&["--device-size", "2MiB"]));
    let (mut half, _) = joined(&addr, 2);
    half.send(&Msg::Connect {
        conn: 0,
        endpoint: json!({"qpn": 1}),
    })
    .unwrap();
    let started = Instant::now();
    let r = load(
        &fabric,
        &load_cfg(std::slice::from_ref(&addr), &["--ops", "300"]),
    )
    .unwrap();
    assert!(r.passed(), "{}", r.text());
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let reason = sealed_refusal(&mut half);
    assert!(reason.contains("session has started"), "{reason}");
    assert!(srv.join().unwrap().unwrap().passed());
}

/// The session key a client computes is the server's: a proxy that knows
/// the token seals a message the server takes (the limit of a server
/// without a secret, said in docs/demo.md).
#[test]
fn without_a_secret_the_key_comes_from_the_token() {
    let l = auth::nonce().unwrap();
    let s = auth::nonce().unwrap();
    let seen = Seen {
        l: Some(l),
        s: Some(s),
    };
    let key: SessionKey = seen.key().unwrap();
    let m = seal(&key, Direction::LoadToServer, 0, &Msg::<Value>::Join).unwrap();
    let mut open =
        cqd_demo::net::Open::new(SessionKey::from_token(&l, &s), Direction::LoadToServer);
    assert!(matches!(open.open(m), Ok(Msg::Join)));
}
