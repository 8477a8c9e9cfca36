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
