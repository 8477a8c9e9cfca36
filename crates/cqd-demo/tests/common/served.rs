//! A `serve` process of the demo on the softverbs device, for the tests
//! that need one (feature `verbs`, under `softverbs-run`).

use super::{finish, spawn};
use std::io::{BufRead, BufReader, Read};
use std::process::Child;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Whether the test runs under `softverbs-run`; if not, says loudly that
/// `test` is skipped.
pub fn launcher_or_skip(test: &str) -> bool {
    if std::env::var_os("SOFTVERBS_RUN").is_some() {
        return true;
    }
    // nextest runs this test under the launcher or leaves it out
    // (.config/nextest.toml): run here, it would pass without testing.
    assert!(
        std::env::var_os("NEXTEST").is_none(),
        "{test} needs softverbs-run (root), but nextest ran it outside the launcher: \
         .config/nextest.toml must count it in the softverbs set"
    );
    // Straight to the stderr handle: the harness captures eprintln! of
    // passing tests, not writes to the handle.
    use std::io::Write as _;
    let line = format!("SKIPPED: {test} (needs softverbs-run, root)\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    false
}

/// A `serve` process on a free port: the child, its address, and its
/// stdout and stderr as they come (line by line, on channels).
pub struct Served {
    pub child: Child,
    pub addr: String,
    pub out: mpsc::Receiver<String>,
    pub err: mpsc::Receiver<String>,
}

pub fn lines(r: impl Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for l in BufReader::new(r).lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    rx
}

pub fn serve(extra: &[&str]) -> Served {
    let mut args = vec![
        "serve",
        "--device",
        "softverbs0",
        "--listen",
        "127.0.0.1:0",
        "--accept-timeout",
        "60s",
    ];
    args.extend_from_slice(extra);
    let mut child = spawn(&args);
    let out = lines(child.stdout.take().expect("stdout"));
    let err = lines(child.stderr.take().expect("stderr"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let addr = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match out.recv_timeout(left) {
            Ok(l) => {
                if let Some(rest) = l.strip_prefix("cqd-demo serve: listening on ") {
                    break rest.split_whitespace().next().unwrap_or("").to_string();
                }
            }
            Err(_) => {
                let _ = child.kill();
                let rest: Vec<String> = err.try_iter().collect();
                panic!("serve did not listen:\n{}", rest.join("\n"));
            }
        }
    };
    Served {
        child,
        addr,
        out,
        err,
    }
}

impl Served {
    /// Waits for the server's exit; its exit code and all it printed.
    pub fn end(self, limit: Duration) -> (Option<i32>, String, String) {
        let out = finish(self.child, "serve", limit);
        let stdout: Vec<String> = self.out.iter().collect();
        let stderr: Vec<String> = self.err.iter().collect();
        (out.status.code(), stdout.join("\n"), stderr.join("\n"))
    }
}

/// What a load printed after its server was killed mid-run.
pub struct KilledServer {
    /// The load's exit code.
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// From the kill to the load's exit.
    pub load_took: Duration,
}

/// A server (`serve` with `extra`) and a 30 s load against it (with the
/// same `extra_load`), the server killed 0.8 s after it starts serving; the
/// load waited for at most 25 s.
pub fn kill_server_mid_run(extra: &[&str], extra_load: &[&str]) -> KilledServer {
    let mut s = serve(extra);
    let mut args = vec!["load", "--device", "softverbs0"];
    args.extend_from_slice(extra_load);
    args.extend_from_slice(&["--server", &s.addr, "--duration", "30s"]);
    let load = spawn(&args);
    // Wait until the server serves, let the load run, then kill it.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match s.err.recv_timeout(left) {
            Ok(l) if l.contains("serving") => break,
            Ok(_) => {}
            Err(_) => panic!("the server never served"),
        }
    }
    std::thread::sleep(Duration::from_millis(800));
    s.child.kill().expect("kill the server");
    let killed = Instant::now();
    let _ = s.child.wait();
    let out = finish(load, "load after its server died", Duration::from_secs(25));
    KilledServer {
        code: out.status.code(),
        stdout: super::text(&out.stdout),
        stderr: super::text(&out.stderr),
        load_took: killed.elapsed(),
    }
}

/// The accounts verdict of a process whose peer was killed mid-run: every
/// request accounted for — completed, failed or flushed — with nothing
/// missing. This includes a receive the killed peer had already taken in
/// the middle of a SEND (softverbs' data path is driven by the requester):
/// softverbs flushes it when this side's QP fails, as a NIC would
/// (docs/softverbs.md, "Receives taken by a requester that dies").
pub fn assert_accounts_balanced(stdout: &str) {
    assert!(
        stdout.contains("verdict accounts: PASSED"),
        "every request must be accounted for, none missing:\n{stdout}"
    );
}
