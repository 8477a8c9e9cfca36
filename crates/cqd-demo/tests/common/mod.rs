//! Running the cqd-demo binary from a test: started with piped output and
//! no input, waited for at most a limit (a hang is a failure, never a wait).
#![allow(dead_code)] // each test file uses its own part

pub mod attack;
#[cfg(feature = "verbs")]
pub mod served;

use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The binary with `args`, logging at `rust_log`, output piped, no colour.
pub fn demo(args: &[&str], rust_log: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cqd-demo"));
    c.args(args)
        .env("RUST_LOG", rust_log)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    c
}

/// Starts the binary with `args`, logging errors only.
pub fn spawn(args: &[&str]) -> Child {
    demo(args, "error").spawn().expect("the binary starts")
}

/// Waits for `child` at most `limit`; past it, kills it and fails the test
/// with its output (`what` names it).
pub fn finish(mut child: Child, what: &str, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!(
                "{what} still running after {limit:?}\nstdout:\n{}\nstderr:\n{}",
                text(&out.stdout),
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// Runs the binary with `args` to its end, within `limit`.
pub fn run_for(args: &[&str], limit: Duration) -> Output {
    finish(spawn(args), &format!("cqd-demo {args:?}"), limit)
}

/// Output bytes as text.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}
