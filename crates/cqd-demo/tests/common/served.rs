//! A `serve` process of the demo on a verbs device, for the tests that
//! need one (feature `verbs`): softverbs under `softverbs-run`, or (the
//! rdma_cm tests) the kernel's rxe in the VM of scripts/rxe-vm.sh.

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

/// Where a served test runs: the device, the GID index its endpoints use
/// (RoCE needs one; none on softverbs) and the IPv4 address the server
/// listens on (its rdma_cm address too, with `--cm rdmacm`).
#[derive(Debug, Clone)]
pub struct Place {
    pub device: String,
    pub gid: Option<u8>,
    pub ip: String,
}

impl Place {
    /// softverbs0 under the launcher, on 127.0.0.1.
    pub fn softverbs() -> Place {
        Place {
            device: "softverbs0".into(),
            gid: None,
            ip: "127.0.0.1".into(),
        }
    }

    /// The flags that put a `serve` or a `load` on this device.
    pub fn device_args(&self) -> Vec<String> {
        let mut v = vec!["--device".to_string(), self.device.clone()];
        if let Some(g) = self.gid {
            v.extend(["--gid-index".to_string(), g.to_string()]);
        }
        v
    }

    /// A `load` with `rest` after this place's device flags.
    pub fn load_args<'a>(&'a self, owned: &'a [String], rest: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec!["load"];
        v.extend(owned.iter().map(String::as_str));
        v.extend_from_slice(rest);
        v
    }
}

/// The environment variables naming the rxe device the rdma_cm tests run
/// on in the VM and its address (`.ci/rxe.sh` sets both: rxe1 on a dummy
/// interface). rxe0 is on `lo`, where `rdma_resolve_route` fails with
/// ENODEV (rdma-core's rping too), so rdma_cm needs a device of its own.
pub const RXE_CM_ENV: (&str, &str) = ("CQD_RXE_CM", "CQD_RXE_CM_ADDR");

/// Where an rdma_cm test runs: rxe in the VM when `CQD_RXE_CM` and
/// `CQD_RXE_CM_ADDR` name a device and its address; in the VM without
/// them, nowhere (SKIPPED, saying why); softverbs under the launcher; else
/// SKIPPED.
pub fn cm_place_or_skip(test: &str) -> Option<Place> {
    use std::io::Write as _;
    let (dev_var, addr_var) = RXE_CM_ENV;
    if let (Ok(device), Ok(ip)) = (std::env::var(dev_var), std::env::var(addr_var)) {
        let gid = std::env::var("RXE_GID_INDEX")
            .ok()
            .and_then(|g| g.parse().ok())
            .unwrap_or(1);
        return Some(Place {
            device,
            gid: Some(gid),
            ip,
        });
    }
    if std::env::var_os("CQD_RXE").is_some() {
        let line = format!(
            "SKIPPED: {test} (rdma_cm on rxe needs a device on an interface other than lo, \
             where rdma_resolve_route fails with ENODEV: {dev_var} and {addr_var} name none)\n"
        );
        let _ = std::io::stderr().write_all(line.as_bytes());
        return None;
    }
    launcher_or_skip(test).then(Place::softverbs)
}

/// A `serve` process on a free port of softverbs0: the child, its address,
/// and its stdout and stderr as they come (line by line, on channels).
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
    serve_at(&Place::softverbs(), extra)
}

/// [`serve`] at `place`: on its device, listening on a free port of its
/// address.
pub fn serve_at(place: &Place, extra: &[&str]) -> Served {
    let device = place.device_args();
    let listen = format!("{}:0", place.ip);
    let mut args = vec!["serve"];
    args.extend(device.iter().map(String::as_str));
    args.extend_from_slice(&["--listen", &listen, "--accept-timeout", "60s"]);
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
    kill_server_mid_run_at(&Place::softverbs(), extra, extra_load)
}

/// [`kill_server_mid_run`] at `place`.
pub fn kill_server_mid_run_at(place: &Place, extra: &[&str], extra_load: &[&str]) -> KilledServer {
    let mut s = serve_at(place, extra);
    let device = place.device_args();
    let mut args = place.load_args(&device, &[]);
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
