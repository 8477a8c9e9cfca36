//! The report of a run: figures, metrics and the two verdicts, as text and
//! as JSON.
//!
//! The verdicts are computed from what the run recorded, never assumed:
//!
//! - **data**: no read (during the load or the read-back) returned data
//!   other than the last completed write, and the read-back matched every
//!   block of every server;
//! - **accounts**: for every handler and kind, on every poller, posted ==
//!   completed + flushed (cqd's ledgers, `PollerReport::accounts`), the
//!   drains did not time out, and the shutdown lost nothing
//!   (`SystemReport::is_clean`).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::Duration;

use cqd_core::topology::ModeConfig;
use cqd_core::SystemReport;

use crate::backend::Node;
use crate::config::Config;
use crate::load::{Load, LoadCounts};
use crate::server::{Server, ServerCounts};
use crate::verify::VerifyCounts;

/// Latency percentiles, in microseconds.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Latency {
    /// Requests measured.
    pub count: u64,
    /// Mean.
    pub mean_us: f64,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th.
    pub p99_us: f64,
    /// 99.9th.
    pub p999_us: f64,
    /// Largest.
    pub max_us: f64,
}

/// What the simulated NIC did.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct NicCounts {
    /// Requests executed.
    pub executed: u64,
    /// Error completions.
    pub errors: u64,
    /// Flushes.
    pub flushed: u64,
    /// Errors injected by --fault-rate.
    pub injected_errors: u64,
}

/// One verdict.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Verdict {
    /// Passed?
    pub passed: bool,
    /// Why, in words.
    pub detail: String,
}

/// Both verdicts.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Verdicts {
    /// Every block read back matches what was written.
    pub data: Verdict,
    /// posted == completed + flushed for every handler and kind.
    pub accounts: Verdict,
}

/// What a server process reported of its side (two-process runs).
#[derive(Debug, Clone, serde::Serialize)]
pub struct PeerVerdict {
    /// The server's address (`--server`).
    pub server: String,
    /// Its accounts verdict and session, passed?
    pub passed: bool,
    /// Its words, or why there are none. The words are the peer's: the
    /// text report prints them escaped ([`crate::net::escaped`]).
    pub detail: String,
}

/// One poller's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PollerRow {
    /// Its name in the topology.
    pub name: String,
    /// "server" or "load".
    pub role: String,
    /// Its mode.
    pub mode: String,
    /// CPU time over the run's wall time, percent of one CPU.
    pub cpu_pct: f64,
    /// Completions polled.
    pub completions: u64,
    /// Poll calls.
    pub polls: u64,
    /// Poll calls that found nothing.
    pub empty_polls: u64,
    /// Completion events (notifications).
    pub events: u64,
    /// Sleeps.
    pub sleeps: u64,
    /// Work items spilled (a full ring).
    pub spills: u64,
    /// Items handed to workers.
    pub handed_off: u64,
}

/// One handler's account of one kind.
#[derive(Debug, Clone, serde::Serialize)]
pub struct AccountRow {
    /// The connection the handler serves.
    pub handler: String,
    /// The operation kind.
    pub kind: String,
    /// Posted.
    pub posted: u64,
    /// Completed by a success or an error (flushes not included).
    pub completed: u64,
    /// Completed by a flush.
    pub flushed: u64,
    /// posted − completed − flushed.
    pub missing: u64,
}

/// Everything a run reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// The mode ("topology": as the file says).
    pub mode: String,
    /// The configuration.
    pub config: Config,
    /// Seconds of load.
    pub elapsed_s: f64,
    /// Seconds of read-back.
    pub verify_s: f64,
    /// Requests per second (successful, load phase).
    pub ops_per_s: f64,
    /// Data moved per second, MiB.
    pub mib_per_s: f64,
    /// Latencies of successful requests.
    pub latency: Latency,
    /// The load generator's counters.
    pub load: LoadCounts,
    /// The verifier's counters.
    pub verify: VerifyCounts,
    /// Mismatches described (the first few).
    pub mismatches: Vec<String>,
    /// Blocks left unknown by failed writes.
    pub unknown_blocks: u64,
    /// Per server.
    pub servers: Vec<ServerCounts>,
    /// Per poller.
    pub pollers: Vec<PollerRow>,
    /// Per handler and kind.
    pub accounts: Vec<AccountRow>,
    /// The simulated NIC.
    pub nic: Option<NicCounts>,
    /// The verdicts.
    pub verdicts: Verdicts,
    /// `load`: what each server process said of its own side at the end.
    pub peers: Vec<PeerVerdict>,
    /// `--churn`: the connections closed and reopened during the load.
    pub churn: Option<ChurnCounts>,
    /// What went wrong along the way.
    pub notes: Vec<String>,
    /// The topology used, as TOML.
    pub topology: String,
    /// Its warnings.
    pub topology_warnings: Vec<String>,
    /// cqd's full shutdown report (pollers, CQs, pools).
    pub system: SystemReport,
}

/// What `--churn` did during the load.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ChurnCounts {
    /// Closes a second asked for.
    pub asked_per_s: f64,
    /// Connections closed and reopened (both sides).
    pub cycles: u64,
    /// Of those a second, over the load phase.
    pub per_s: f64,
    /// Closes that did not end in time or opens that failed (each named in
    /// the notes).
    pub failed: u64,
    /// One cycle (the client's drain and close, the server's close, the
    /// new connection's open), µs: median.
    pub cycle_p50_us: f64,
    /// 99th percentile.
    pub cycle_p99_us: f64,
    /// Longest.
    pub cycle_max_us: f64,
}

/// What [`build`] needs.
#[derive(Debug)]
pub struct Inputs<'a, N: Node> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The mode's name.
    pub mode: String,
    /// The load generator.
    pub load: &'a Load<N>,
    /// The servers.
    pub servers: &'a [Server<N>],
    /// cqd's shutdown report.
    pub system: SystemReport,
    /// Handler names by (poller, slot, generation).
    pub names: HashMap<(usize, u32, u16), String>,
    /// Each poller's (name, role, mode), in the system report's order.
    pub roles: Vec<Role>,
    /// The load phase.
    pub load_elapsed: Duration,
    /// The read-back.
    pub verify_elapsed: Duration,
    /// Pollers' lifetime.
    pub wall: Duration,
    /// The topology as TOML.
    pub topology_toml: String,
    /// Its warnings.
    pub topology_warnings: Vec<String>,
    /// What went wrong along the way.
    pub notes: Vec<String>,
    /// `--churn`'s counts.
    pub churn: Option<ChurnCounts>,
}

fn mode_name(m: &ModeConfig) -> &'static str {
    match m {
        ModeConfig::Busy => "busy",
        ModeConfig::Event { .. } => "event",
        ModeConfig::Hybrid { .. } => "hybrid",
        ModeConfig::Adaptive { .. } => "adaptive",
    }
}

/// Gathers the report and computes the verdicts.
pub fn build<N: Node>(i: Inputs<'_, N>) -> Report {
    let shared = i.load.shared();
    let load = shared.counts();
    let verifier = shared.verifier();
    let verify = verifier.counts();
    let us = |ns: u64| ns as f64 / 1e3;
    let latency = i
        .load
        .latencies()
        .map_or_else(Latency::default, |h| Latency {
            count: h.len(),
            mean_us: h.mean() / 1e3,
            p50_us: us(h.value_at_quantile(0.5)),
            p90_us: us(h.value_at_quantile(0.9)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        });
    let secs = i.load_elapsed.as_secs_f64().max(1e-9);
    let pollers = poller_rows(&i.system, &i.roles, i.wall);
    let accounts = account_rows(&i.system, &i.names);
    let blocks = verifier.blocks();
    let unknown = verifier.unknown_blocks();
    let data = {
        let mut why = Vec::new();
        if verify.mismatches > 0 {
            why.push(format!(
                "{} reads returned data that was not written",
                verify.mismatches
            ));
        }
        if load.verify_matched < blocks {
            why.push(format!(
                "read back {} of {blocks} blocks matching ({} unknown after failed writes, {} read-backs failed)",
                load.verify_matched, load.verify_unknown, load.verify_failed
            ));
        }
        if verify.reads_matched == 0 {
            why.push("no read was verified".into());
        }
        if why.is_empty() {
            Verdict {
                passed: true,
                detail: format!(
                    "{} reads during the load and all {blocks} blocks read back match what was written \
                     ({} writes)",
                    verify.reads_matched - load.verify_matched,
                    verify.writes_ok
                ),
            }
        } else {
            Verdict {
                passed: false,
                detail: why.join("; "),
            }
        }
    };
    let accounts_verdict = accounts_verdict(&accounts, &i.system);
    Report {
        mode: i.mode,
        config: i.cfg.clone(),
        elapsed_s: secs,
        verify_s: i.verify_elapsed.as_secs_f64(),
        ops_per_s: load.completed as f64 / secs,
        mib_per_s: load.completed as f64 * f64::from(i.cfg.block_size) / secs / (1 << 20) as f64,
        latency,
        load,
        verify,
        mismatches: verifier.mismatch_notes(),
        unknown_blocks: unknown,
        servers: i.servers.iter().map(|s| s.counts()).collect(),
        pollers,
        accounts,
        nic: None,
        verdicts: Verdicts {
            data,
            accounts: accounts_verdict,
        },
        peers: Vec::new(),
        churn: i.churn,
        notes: i.notes,
        topology: i.topology_toml,
        topology_warnings: i.topology_warnings,
        system: i.system,
    }
}

/// Each poller's figures, in the system report's order.
pub fn poller_rows(system: &SystemReport, roles: &[Role], wall: Duration) -> Vec<PollerRow> {
    let wall = wall.as_secs_f64().max(1e-9);
    system
        .pollers
        .iter()
        .zip(roles)
        .map(|(p, (name, role, mode))| PollerRow {
            name: name.clone(),
            role: role.to_string(),
            mode: mode_name(mode).to_string(),
            cpu_pct: 100.0 * p.poller.cpu_ns as f64 / 1e9 / wall,
            completions: p.cqs.iter().map(|c| c.completions).sum(),
            polls: p.cqs.iter().map(|c| c.polls).sum(),
            empty_polls: p.cqs.iter().map(|c| c.empty_polls).sum(),
            events: p.cqs.iter().map(|c| c.events).sum(),
            sleeps: p.poller.sleeps,
            spills: p.poller.spills,
            handed_off: p.poller.handed_off,
        })
        .collect()
}

/// Every handler's account of every kind, named.
pub fn account_rows(
    system: &SystemReport,
    names: &HashMap<(usize, u32, u16), String>,
) -> Vec<AccountRow> {
    let mut accounts = Vec::new();
    for (pi, p) in system.pollers.iter().enumerate() {
        for a in &p.accounts.accounts {
            let handler = names
                .get(&(pi, a.handler.0, a.handler.1))
                .cloned()
                .unwrap_or_else(|| format!("poller {pi} handler {}.{}", a.handler.0, a.handler.1));
            accounts.push(AccountRow {
                handler,
                kind: a.kind.name().to_string(),
                posted: a.posted,
                completed: a.completed.saturating_sub(a.flushed),
                flushed: a.flushed,
                missing: a.missing(),
            });
        }
    }
    accounts
}

/// The accounts verdict: every account balances, no drain timed out, the
/// shutdown was clean, and there were accounts at all.
pub fn accounts_verdict(accounts: &[AccountRow], system: &SystemReport) -> Verdict {
    let posted: u64 = accounts.iter().map(|a| a.posted).sum();
    let completed: u64 = accounts.iter().map(|a| a.completed).sum();
    let flushed: u64 = accounts.iter().map(|a| a.flushed).sum();
    let bad: Vec<String> = accounts
        .iter()
        .filter(|a| a.posted != a.completed + a.flushed)
        .map(|a| {
            format!(
                "{} {}: posted {} != completed {} + flushed {}",
                a.handler, a.kind, a.posted, a.completed, a.flushed
            )
        })
        .collect();
    // Everything the shutdown found wrong: missing requests and timeouts,
    // handler and worker panics (a caught panic counts its completion as
    // delivered, but the request's work was lost), foreign and stale
    // wr_ids, dry receive queues, blocking handlers, errors.
    let findings = system.findings();
    if bad.is_empty() && findings.is_empty() && !accounts.is_empty() {
        Verdict {
            passed: true,
            detail: format!(
                "{} handler accounts: posted {posted} == completed {completed} + flushed {flushed}",
                accounts.len()
            ),
        }
    } else {
        // Requests missing are named per handler (with the demo's names)
        // when the rows show them; a timeout alone comes from the findings.
        let named = !bad.is_empty();
        let mut why = bad;
        why.extend(
            findings
                .iter()
                .filter(|f| !(named && f.kind == cqd_core::FindingKind::Unbalanced))
                .map(ToString::to_string),
        );
        if accounts.is_empty() {
            why.push("no accounts were reported".into());
        }
        Verdict {
            passed: false,
            detail: why.join("; "),
        }
    }
}

fn word(v: &Verdict) -> &'static str {
    if v.passed {
        "PASSED"
    } else {
        "FAILED"
    }
}

fn server_line(s: &mut String, i: usize, sv: &ServerCounts) {
    let _ = writeln!(
        s,
        "server {i}  {} reads, {} writes, {} MiB moved, {} malformed, {} refused, {} deferred replies, {} errors, {} flushed, {} connections closed",
        sv.reads, sv.writes, sv.bytes >> 20, sv.malformed, sv.rejected, sv.deferred, sv.errors, sv.flushed, sv.closed
    );
    for b in &sv.broken_connections {
        let _ = writeln!(s, "server {i}  broke {b}");
    }
}

/// The pollers table, the CQ lines and the pool lines.
fn threads_text(s: &mut String, pollers: &[PollerRow], system: &SystemReport) {
    let _ = writeln!(
        s,
        "{:<10} {:<7} {:<9} {:>6} {:>11} {:>11} {:>11} {:>9} {:>9} {:>7}",
        "poller",
        "role",
        "mode",
        "cpu%",
        "completions",
        "polls",
        "empty",
        "events",
        "sleeps",
        "spills"
    );
    for p in pollers {
        let _ = writeln!(
            s,
            "{:<10} {:<7} {:<9} {:>6.1} {:>11} {:>11} {:>11} {:>9} {:>9} {:>7}",
            p.name,
            p.role,
            p.mode,
            p.cpu_pct,
            p.completions,
            p.polls,
            p.empty_polls,
            p.events,
            p.sleeps,
            p.spills
        );
    }
    for cq in system.pollers.iter().flat_map(|p| &p.cqs) {
        let b = cq.budget.as_ref();
        let _ = writeln!(
            s,
            "cq {:<7} capacity {}, {} completions, {} flushes, {} other errors, {} stale, overflows {}, credits high water {}",
            cq.name,
            cq.capacity,
            cq.completions,
            cq.flushes,
            cq.errors().saturating_sub(cq.flushes),
            cq.stale_wr_ids,
            cq.overflows,
            b.map_or(0, |b| b.credits_high_water)
        );
    }
    for pool in &system.pools {
        let _ = writeln!(s, "{pool}");
    }
}

/// A handler name's poller/role/mode, as [`Inputs::roles`] holds them.
pub type Role = (String, &'static str, ModeConfig);

/// What a `serve` process reports of its side: its server, pollers, pool,
/// accounts and the session.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ServeReport {
    /// The configuration.
    pub config: Config,
    /// The load that was served (its address).
    pub peer: Option<String>,
    /// The server's counters.
    pub server: ServerCounts,
    /// Per poller.
    pub pollers: Vec<PollerRow>,
    /// Per handler and kind.
    pub accounts: Vec<AccountRow>,
    /// The accounts verdict (the data verdict is the load's).
    pub accounts_verdict: Verdict,
    /// The session: the load said goodbye (passed) or went away.
    pub session: Verdict,
    /// What went wrong along the way.
    pub notes: Vec<String>,
    /// With `--cm rdmacm`: the connection requests its gate rejected (a
    /// stranger's, another address's, a replay; `crate::net`, H5).
    pub cm_rejected: Option<CmRejected>,
    /// The topology used, as TOML.
    pub topology: String,
    /// cqd's full shutdown report.
    pub system: SystemReport,
}

/// The rdma_cm requests a server rejected.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CmRejected {
    /// How many.
    pub count: u64,
    /// The first few, each with where it came from and why.
    pub named: Vec<String>,
}

/// What [`build_serve`] needs.
#[derive(Debug)]
pub struct ServeInputs<'a, N: Node> {
    /// The configuration.
    pub cfg: &'a Config,
    /// The load's address.
    pub peer: Option<String>,
    /// The server.
    pub server: &'a Server<N>,
    /// cqd's shutdown report.
    pub system: SystemReport,
    /// Handler names.
    pub names: HashMap<(usize, u32, u16), String>,
    /// Each poller's (name, role, mode).
    pub roles: Vec<Role>,
    /// Pollers' lifetime.
    pub wall: Duration,
    /// The session verdict.
    pub session: Verdict,
    /// The topology as TOML.
    pub topology_toml: String,
    /// Notes.
    pub notes: Vec<String>,
    /// With `--cm rdmacm`: what the gate rejected.
    pub cm_rejected: Option<crate::net::Rejected>,
}

/// Gathers a server process's report.
pub fn build_serve<N: Node>(i: ServeInputs<'_, N>) -> ServeReport {
    let pollers = poller_rows(&i.system, &i.roles, i.wall);
    let accounts = account_rows(&i.system, &i.names);
    let accounts_verdict = accounts_verdict(&accounts, &i.system);
    ServeReport {
        config: i.cfg.clone(),
        peer: i.peer,
        server: i.server.counts(),
        pollers,
        accounts,
        accounts_verdict,
        session: i.session,
        notes: i.notes,
        cm_rejected: i.cm_rejected.map(|r| CmRejected {
            count: r.count,
            named: r.named,
        }),
        topology: i.topology_toml,
        system: i.system,
    }
}

impl ServeReport {
    /// The accounts balanced and the load ended the session.
    pub fn passed(&self) -> bool {
        self.accounts_verdict.passed && self.session.passed
    }

    /// The report as text.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let c = &self.config;
        let _ = writeln!(
            s,
            "cqd-demo serve: 1 server × {} blocks of {} B, up to {} connection(s) × qd {}, load {}",
            c.blocks_per_server,
            c.block_size,
            c.connections,
            c.qd,
            self.peer.as_deref().unwrap_or("(none)")
        );
        server_line(&mut s, 0, &self.server);
        threads_text(&mut s, &self.pollers, &self.system);
        for n in &self.notes {
            let _ = writeln!(s, "note      {n}");
        }
        if let Some(r) = &self.cm_rejected {
            let _ = writeln!(s, "rdma_cm   {} request(s) rejected", r.count);
            for n in &r.named {
                let _ = writeln!(s, "rejected  {n}");
            }
        }
        let _ = writeln!(
            s,
            "verdict session:  {} — {}",
            word(&self.session),
            self.session.detail
        );
        let _ = writeln!(
            s,
            "verdict accounts: {} — {}",
            word(&self.accounts_verdict),
            self.accounts_verdict.detail
        );
        s
    }
}

impl Report {
    /// Both verdicts passed, no request failed, no reply was malformed or
    /// late, no connection died (even with nothing in flight), and every
    /// server process (two-process runs) passed its own.
    pub fn passed(&self) -> bool {
        self.verdicts.data.passed
            && self.verdicts.accounts.passed
            && self.load.failed == 0
            && self.load.bad_replies == 0
            && self.load.timeouts == 0
            && self.load.dead_connections == 0
            && self.peers.iter().all(|p| p.passed)
            && self.churn.as_ref().is_none_or(|c| c.failed == 0)
    }

    /// The report as text.
    pub fn text(&self) -> String {
        let mut s = String::new();
        let c = &self.config;
        let _ = writeln!(
            s,
            "cqd-demo: {} server(s) × {} blocks of {} B, {} connection(s) × qd {}, {}% reads, mode {}",
            c.servers, c.blocks_per_server, c.block_size, c.connections, c.qd, c.read_pct, self.mode
        );
        let l = &self.load;
        let _ =
            writeln!(
            s,
            "load      {:.2} s: {} ops ({} reads, {} writes), {:.0} ops/s, {:.1} MiB/s; {} failed",
            self.elapsed_s, l.completed, l.reads, l.writes, self.ops_per_s, self.mib_per_s, l.failed
        );
        let _ = writeln!(
            s,
            "exposure  {}",
            if l.windows {
                "each request's buffer through a memory window bound for it alone (type 2, invalidated at its reply)"
            } else {
                "each slot's data buffer, a region of its own, by its key for the whole run (--exposure keys, or no type-2 memory windows here)"
            }
        );
        let t = &self.latency;
        let _ = writeln!(
            s,
            "latency   p50 {:.1} µs  p90 {:.1} µs  p99 {:.1} µs  p99.9 {:.1} µs  max {:.1} µs  ({} samples)",
            t.p50_us, t.p90_us, t.p99_us, t.p999_us, t.max_us, t.count
        );
        if let Some(c) = &self.churn {
            let _ = writeln!(
                s,
                "churn     {} connections closed and reopened, {:.0}/s (asked {:.0}/s), {} failed; a cycle p50 {:.0} µs  p99 {:.0} µs  max {:.0} µs; the latency above is the other connections' meanwhile",
                c.cycles, c.per_s, c.asked_per_s, c.failed, c.cycle_p50_us, c.cycle_p99_us, c.cycle_max_us
            );
        }
        let v = &self.verify;
        let _ = writeln!(
            s,
            "verify    {} reads matched, {} mismatched, {} unverifiable; read-back {} blocks in {:.2} s: {} matched",
            v.reads_matched, v.mismatches, v.reads_unverifiable, l.verify_read, self.verify_s, l.verify_matched
        );
        for (i, sv) in self.servers.iter().enumerate() {
            server_line(&mut s, i, sv);
        }
        threads_text(&mut s, &self.pollers, &self.system);
        if let Some(n) = &self.nic {
            let _ = writeln!(
                s,
                "nic       {} executed, {} errors ({} injected), {} flushed",
                n.executed, n.errors, n.injected_errors, n.flushed
            );
        }
        for n in &self.notes {
            let _ = writeln!(s, "note      {n}");
        }
        for m in &self.mismatches {
            let _ = writeln!(s, "mismatch  {m}");
        }
        for p in &self.peers {
            let _ = writeln!(
                s,
                "server {:<20} (its own side) {} — {}",
                p.server,
                if p.passed { "PASSED" } else { "FAILED" },
                crate::net::escaped(&p.detail)
            );
        }
        let _ = writeln!(
            s,
            "verdict data:     {} — {}",
            word(&self.verdicts.data),
            self.verdicts.data.detail
        );
        let _ = writeln!(
            s,
            "verdict accounts: {} — {}",
            word(&self.verdicts.accounts),
            self.verdicts.accounts.detail
        );
        if l.failed > 0 {
            let _ = writeln!(
                s,
                "{} requests failed (reported as failed, never as done)",
                l.failed
            );
        }
        s
    }
}

/// One row of the mode comparison.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CompareRow {
    /// The mode.
    pub mode: String,
    /// Requests per second.
    pub ops_per_s: f64,
    /// Median latency, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// All pollers' CPU, percent of one CPU.
    pub poller_cpu_pct: f64,
    /// Completion events.
    pub events: u64,
    /// Empty polls.
    pub empty_polls: u64,
    /// Spills.
    pub spills: u64,
    /// Both verdicts passed, no request failed.
    pub passed: bool,
}

impl CompareRow {
    /// The row of a report.
    pub fn of(r: &Report) -> CompareRow {
        CompareRow {
            mode: r.mode.clone(),
            ops_per_s: r.ops_per_s,
            p50_us: r.latency.p50_us,
            p99_us: r.latency.p99_us,
            p999_us: r.latency.p999_us,
            poller_cpu_pct: r.pollers.iter().map(|p| p.cpu_pct).sum(),
            events: r.pollers.iter().map(|p| p.events).sum(),
            empty_polls: r.pollers.iter().map(|p| p.empty_polls).sum(),
            spills: r.pollers.iter().map(|p| p.spills).sum(),
            passed: r.passed(),
        }
    }
}

/// The comparison table.
pub fn compare_table(rows: &[CompareRow]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<9} {:>10} {:>9} {:>9} {:>9} {:>11} {:>9} {:>11} {:>7}  verdicts",
        "mode",
        "ops/s",
        "p50 µs",
        "p99 µs",
        "p99.9 µs",
        "poller cpu%",
        "events",
        "empty polls",
        "spills",
    );
    for r in rows {
        let _ = writeln!(
            s,
            "{:<9} {:>10.0} {:>9.1} {:>9.1} {:>9.1} {:>11.1} {:>9} {:>11} {:>7}  {}",
            r.mode,
            r.ops_per_s,
            r.p50_us,
            r.p99_us,
            r.p999_us,
            r.poller_cpu_pct,
            r.events,
            r.empty_polls,
            r.spills,
            if r.passed { "passed" } else { "FAILED" }
        );
    }
    s
}
