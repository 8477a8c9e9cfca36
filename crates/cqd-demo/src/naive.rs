//! The naive server: the same block servers ([`Server`], the same
//! connections, handlers and worker code), driven the way completion loops
//! are often written by hand, for the benchmark report's end-to-end
//! comparison (`--naive-server`). It is a baseline, not a way to run:
//!
//! - **two threads poll one CQ under a mutex**, each taking the lock for
//!   every poll. cqd's API has no way to do this (a bound `CqPoller` is not
//!   `Send`, and there is no way back to an unbound one), so the baseline
//!   asserts it with an `unsafe impl Send` on a wrapper ([`Relay`]): the
//!   one place in the workspace that breaks the single-poller rule, on
//!   purpose and in plain sight;
//! - **no batching**: the CQ is polled one completion at a time
//!   (`CqOptions::batch = 1`);
//! - **a channel send per completion**: each work item goes to its worker
//!   through a `std::sync::mpsc` channel (one per worker, items keyed by
//!   block as the pool keys them, so per-block order holds);
//! - **a re-arm after each event**: a thread that finds the CQ empty arms
//!   it, polls again, blocks in `poll(2)` on the CQ's descriptor, and on
//!   waking takes and acknowledges the events; both threads wait on the
//!   same descriptor, so both wake for each event.
//!
//! Nothing else is made worse on purpose: the handlers, the workers, the
//! posting and the load generator are the demo's own.

use std::collections::VecDeque;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cqd_core::pool::worker_for_key;
use cqd_core::{CqOptions, CqPoller, Route, Routed, SystemReport, UnboundCq};
use parking_lot::Mutex;

use crate::backend::Node;
use crate::config::Config;
use crate::run::{Names, Stopped};
use crate::server::{Server, ServerSpec, ServerWork, SrvConn};
use crate::DemoError;

/// Threads polling each CQ.
pub const POLL_THREADS: usize = 2;

/// The CQ's polling right, used by whichever thread holds the lock.
type Shared<N> = Arc<Mutex<Relay<ServerWork<N>>>>;

/// A bound poller that the naive baseline moves between its polling
/// threads, behind a mutex.
pub struct Relay<W>(CqPoller<W>);

// SAFETY: `CqPoller` is not `Send` by policy, not for memory safety: it is
// how cqd makes "one poller thread per CQ" a fact of the types. Its state is
// `Send` (the same state moves between threads as an `UnboundCq`; the
// impl's bound has the compiler check that), and every use of a `Relay` is
// under `Shared`'s mutex, so no two threads touch it at once. What the rule
// protects (a CQ's completions seen in order by one thread, no poll racing
// an arm) is what this baseline gives up on purpose, as naive servers do.
unsafe impl<W> Send for Relay<W> where UnboundCq<W>: Send {}

impl<W> std::fmt::Debug for Relay<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Relay").field(&self.0).finish()
    }
}

/// Runs `f` on the CQ, under the lock.
fn with_cq<N: Node, T>(cq: &Shared<N>, f: impl FnOnce(&mut CqPoller<ServerWork<N>>) -> T) -> T {
    f(&mut cq.lock().0)
}

/// The servers of a run on naive completion loops.
#[derive(Debug)]
pub struct NaiveSide<N: Node> {
    servers: Vec<Server<N>>,
    cqs: Vec<Shared<N>>,
    pollers: Vec<JoinHandle<Result<(), String>>>,
    workers: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    drain_timeout: Duration,
}

impl<N: Node> NaiveSide<N> {
    /// Makes `cfg.servers` servers on nodes from `open` (sized for
    /// `conns(i)` connections), `workers` worker threads and two polling
    /// threads per server CQ.
    ///
    /// # Errors
    /// Setup failures.
    pub fn start(
        cfg: &Config,
        workers: usize,
        conns: impl Fn(u32) -> u32,
        open: &impl Fn(&str) -> Result<N, DemoError>,
    ) -> Result<Self, DemoError> {
        let workers = workers.max(1);
        let mut senders = Vec::new();
        let mut worker_threads = Vec::new();
        for w in 0..workers {
            let (tx, rx) = channel::<ServerWork<N>>();
            senders.push(tx);
            worker_threads.push(
                std::thread::Builder::new()
                    .name(format!("naive-worker-{w}"))
                    .spawn(move || rx.into_iter().for_each(ServerWork::run))
                    .map_err(|e| DemoError::Setup(format!("naive worker: {e}")))?,
            );
        }
        let stop = Arc::new(AtomicBool::new(false));
        let mut servers = Vec::new();
        let mut cqs = Vec::new();
        let mut pollers = Vec::new();
        for s in 0..cfg.servers {
            let spec = ServerSpec {
                device_bytes: cfg.device_size,
                block_size: cfg.block_size,
                depth: cfg.qd,
                connections: conns(s),
            };
            let name = format!("srv{s}");
            let options = CqOptions {
                batch: 1,
                ..CqOptions::default()
            };
            let mut server = Server::fixed(open(&name)?, &name, spec, options)?;
            let unbound = server
                .take_cq()
                .ok_or_else(|| DemoError::Setup(format!("{name}: CQ already taken")))?;
            let cq: Shared<N> = Arc::new(Mutex::new(Relay(unbound.bind())));
            for t in 0..POLL_THREADS {
                let fd = with_cq(&cq, |p| p.event_fd().try_clone_to_owned())
                    .map_err(|e| DemoError::Setup(format!("{name}: dup the CQ's fd: {e}")))?;
                let (cq, senders, stop) = (Arc::clone(&cq), senders.clone(), Arc::clone(&stop));
                pollers.push(
                    std::thread::Builder::new()
                        .name(format!("naive-{name}-{t}"))
                        .spawn(move || poll_loop(&cq, &fd, &senders, &stop))
                        .map_err(|e| DemoError::Setup(format!("naive poller: {e}")))?,
                );
            }
            cqs.push(cq);
            servers.push(server);
        }
        Ok(NaiveSide {
            servers,
            cqs,
            pollers,
            workers: worker_threads,
            stop,
            drain_timeout: cfg.drain_timeout,
        })
    }

    /// A new connection on server `server` (as `ServerSide::accept`).
    ///
    /// # Errors
    /// No such server, or the device refused.
    pub fn accept(&mut self, server: u32) -> Result<Arc<SrvConn<N>>, DemoError> {
        let srv = self
            .servers
            .get_mut(server as usize)
            .ok_or_else(|| DemoError::Setup(format!("no server {server}")))?;
        // New registrations reach the poller through its command queue.
        let conn = srv.accept()?;
        if let Some(cq) = self.cqs.get(server as usize) {
            with_cq(cq, |p| p.apply_commands());
        }
        Ok(conn)
    }

    /// Closes as `ServerSide::stop` does: waits for the workers to go idle,
    /// moves every QP to error, lets the polling threads collect every
    /// flush, joins everything. The servers' own accounts are checked here
    /// (nothing outstanding at the end); they have no cqd poller reports.
    pub fn stop(self) -> Stopped<Vec<Server<N>>> {
        let mut notes = Vec::new();
        for s in &self.servers {
            if !s.quiesce(Duration::from_secs(5)) {
                notes.push(format!("{}: workers still busy at the close", s.name()));
            }
        }
        self.servers.iter().for_each(Server::flush);
        let deadline = Instant::now() + self.drain_timeout;
        // The receives still posted on the SRQs come back as flushes once
        // no QP can take them (each QP's LAST_WQE_REACHED, an event cqd's
        // pollers take between polls; here, the stop's loop takes them).
        let outstanding = |c: &Shared<N>| {
            with_cq(c, |p| {
                p.check_async();
                let mut out = VecDeque::new();
                p.return_srq_receives(&mut out);
                p.outstanding()
            })
        };
        while Instant::now() < deadline && self.cqs.iter().any(|c| outstanding(c) > 0) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.stop.store(true, Ordering::Release);
        let mut system = SystemReport::default();
        for p in self.pollers {
            match p.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => system.errors.push(format!("naive poller: {e}")),
                Err(_) => system.errors.push("naive poller panicked".into()),
            }
        }
        // Every sender was moved into a polling thread: they are gone.
        for w in self.workers {
            if w.join().is_err() {
                system.errors.push("naive worker panicked".into());
            }
        }
        for (s, cq) in self.servers.iter().zip(self.cqs) {
            let Some(Relay(mut p)) = Arc::try_unwrap(cq).ok().map(Mutex::into_inner) else {
                system.errors.push(format!("{}: CQ still shared", s.name()));
                continue;
            };
            let left = p.outstanding();
            if left > 0 {
                system.errors.push(format!(
                    "{}: {left} requests neither completed nor flushed at the close",
                    s.name()
                ));
            }
            let _ = p.take_events();
            if let Err(e) = p.ack_all().and_then(|()| p.destroy()) {
                system.errors.push(format!("{}: destroy: {e}", s.name()));
            }
        }
        notes.push(
            "naive server: two threads per CQ under a mutex, batch 1, a channel send per \
             completion, a re-arm per event (no cqd poller reports on the server side)"
                .into(),
        );
        Stopped {
            state: self.servers,
            system,
            roles: Vec::new(),
            names: Names::new(),
            notes,
        }
    }
}

/// One polling thread (see the module documentation).
fn poll_loop<N: Node>(
    cq: &Shared<N>,
    fd: &OwnedFd,
    senders: &[Sender<ServerWork<N>>],
    stop: &AtomicBool,
) -> Result<(), String> {
    let e = |e: cqd_core::SourceError| e.to_string();
    let mut out: VecDeque<Routed<ServerWork<N>>> = VecDeque::new();
    let safety = rustix::time::Timespec {
        tv_sec: 0,
        tv_nsec: 10_000_000,
    };
    let send = |out: &mut VecDeque<Routed<ServerWork<N>>>| {
        for Routed { route, item } in out.drain(..) {
            let w = match route {
                Route::Key(k) => worker_for_key(k, senders.len()),
                _ => 0,
            };
            // A worker is gone only if it panicked; the stop reports that.
            let _ = senders[w].send(item);
        }
    };
    loop {
        // One completion per lock.
        let n = with_cq(cq, |p| p.poll_once(&mut out)).map_err(e)?;
        send(&mut out);
        if n > 0 {
            continue;
        }
        if stop.load(Ordering::Acquire) {
            return Ok(());
        }
        // Empty: arm, poll again (a completion may have come before the
        // arm), then sleep on the descriptor.
        let n = with_cq(cq, |p| p.arm().and_then(|()| p.poll_once(&mut out))).map_err(e)?;
        send(&mut out);
        if n > 0 {
            continue;
        }
        let mut fds = [rustix::event::PollFd::new(fd, rustix::event::PollFlags::IN)];
        rustix::event::poll(&mut fds, Some(&safety)).map_err(|e| e.to_string())?;
        with_cq(cq, |p| p.take_events().and_then(|_| p.ack_all())).map_err(e)?;
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::config::Args;

    fn cfg(args: &[&str]) -> Result<crate::config::Config, crate::DemoError> {
        let mut argv = vec!["cqd-demo", "--no-progress"];
        argv.extend_from_slice(args);
        Args::try_parse_from(argv).unwrap().check()
    }

    #[test]
    fn the_naive_server_serves_the_demo_and_passes_both_verdicts() {
        let cfg = cfg(&["--quick", "--duration", "300ms", "--naive-server"]).unwrap();
        assert!(cfg.naive_server);
        let report = crate::run::run_sim(&cfg, None).unwrap();
        assert!(report.load.completed > 0, "{:?}", report.load);
        assert!(
            report.verdicts.data.passed,
            "{}",
            report.verdicts.data.detail
        );
        assert!(
            report.verdicts.accounts.passed,
            "{}",
            report.verdicts.accounts.detail
        );
        assert!(
            report.notes.iter().any(|n| n.starts_with("naive server")),
            "the report says which server ran: {:?}",
            report.notes
        );
    }

    #[test]
    fn the_naive_server_is_for_one_process_runs_only() {
        let e = cfg(&["serve", "--backend", "verbs", "--naive-server"]).unwrap_err();
        assert!(e.to_string().contains("--naive-server"), "{e}");
    }
}
