//! What a stop's report found wrong: each finding names the mistake, and
//! the CQ, QP and handler it was seen on. A report is clean when it has no
//! finding ([`PollerReport::is_clean`](crate::PollerReport::is_clean),
//! [`SystemReport::is_clean`](crate::SystemReport::is_clean)).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::ledger::ShutdownReport;
use crate::metrics::CqSnapshot;

/// The kind of a [`Finding`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[non_exhaustive]
pub enum FindingKind {
    /// An error met while stopping (acknowledging or destroying a CQ,
    /// joining a pool).
    Error,
    /// Requests posted and never completed.
    Unbalanced,
    /// The stop's drain timed out with requests outstanding.
    DrainTimedOut,
    /// Work items the sink never took.
    Undelivered,
    /// The device overflowed a CQ.
    Overflow,
    /// Completions whose wr_id cqd did not make: a post that bypassed the
    /// accounts (`post_send_unaccounted`) or another library's request on
    /// the CQ.
    ForeignWrId,
    /// Completions whose wr_id names a handler that is no longer there.
    StaleWrId,
    /// Completions of an accounted queue that matched no request in flight
    /// on it (a completion written twice, or one for a request never
    /// posted there): counted, not delivered.
    UnmatchedWrId,
    /// Completions with a status this version does not know.
    UnknownStatus,
    /// Successful completions with an opcode this version does not know.
    UnknownOpcode,
    /// Handler callbacks that panicked (caught; the completion was counted).
    HandlerPanic,
    /// A receive queue ran dry after its handler's batch: a peer's SEND
    /// meets RNR (a handler that does not repost).
    RecvQueueDry,
    /// A worker panicked on an item (caught; the item's work was lost).
    WorkerPanic,
    /// A handler call held the poller longer than the slow threshold.
    SlowHandler,
    /// Polls that failed (the device went away).
    PollError,
    /// A CQ ended in the error state.
    CqInError,
}

/// One thing a report found wrong.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct Finding {
    /// What went wrong.
    pub kind: FindingKind,
    /// Where, and how much: names the CQ, the QP and the handler when they
    /// are known.
    pub detail: String,
}

impl Finding {
    pub(crate) fn new(kind: FindingKind, detail: impl Into<String>) -> Self {
        Finding {
            kind,
            detail: detail.into(),
        }
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.detail)
    }
}

/// The findings of one CQ's final counters.
pub(crate) fn of_cq(c: &CqSnapshot, out: &mut Vec<Finding>) {
    let cq = &c.name;
    if c.overflows > 0 {
        out.push(Finding::new(
            FindingKind::Overflow,
            format!("CQ {cq}: the device overflowed it {} times", c.overflows),
        ));
    }
    if c.foreign_wr_ids > 0 {
        let qp = c
            .last_foreign_qp
            .map_or(String::new(), |q| format!(", the last from QP {q}"));
        out.push(Finding::new(
            FindingKind::ForeignWrId,
            format!(
                "CQ {cq}: {} completions with a wr_id cqd did not make{qp} (a post that bypassed the accounts — post_send_unaccounted / post_recv_unaccounted — or another library's request on this CQ): they reached no handler",
                c.foreign_wr_ids
            ),
        ));
    }
    if c.stale_wr_ids > 0 {
        let at = match (&c.last_stale_handler, c.last_stale_qp) {
            (Some(h), Some(q)) => format!(", the last for handler {h} from QP {q}"),
            _ => String::new(),
        };
        out.push(Finding::new(
            FindingKind::StaleWrId,
            format!(
                "CQ {cq}: {} completions named a handler that is no longer registered{at}: they reached no handler",
                c.stale_wr_ids
            ),
        ));
    }
    if c.unmatched_wr_ids > 0 {
        let at = match (&c.last_unmatched_handler, c.last_unmatched_qp) {
            (Some(h), Some(q)) => format!(", the last for handler {h} from QP {q}"),
            _ => String::new(),
        };
        out.push(Finding::new(
            FindingKind::UnmatchedWrId,
            format!(
                "CQ {cq}: {} completions matched no request in flight on their queue{at} (the device wrote a completion twice, or named a request never posted there): they reached no handler",
                c.unmatched_wr_ids
            ),
        ));
    }
    if c.unknown_status > 0 {
        out.push(Finding::new(
            FindingKind::UnknownStatus,
            format!(
                "CQ {cq}: {} completions with a status this version does not know (delivered to on_error)",
                c.unknown_status
            ),
        ));
    }
    if c.unknown_opcode > 0 {
        out.push(Finding::new(
            FindingKind::UnknownOpcode,
            format!(
                "CQ {cq}: {} successful completions with an opcode this version does not know (delivered to on_error)",
                c.unknown_opcode
            ),
        ));
    }
    if c.handler_panics > 0 {
        let who = c
            .last_panicked_handler
            .as_ref()
            .map_or(String::new(), |h| format!(", the last in handler {h}"));
        out.push(Finding::new(
            FindingKind::HandlerPanic,
            format!(
                "CQ {cq}: {} handler callbacks panicked{who}",
                c.handler_panics
            ),
        ));
    }
    if !c.left_dry.is_empty() {
        let qps: Vec<String> = c.left_dry.iter().map(u32::to_string).collect();
        let who = c.last_dry_handler.as_ref().map_or(String::new(), |h| {
            format!(" (the last consumed receive was handler {h}'s)")
        });
        out.push(Finding::new(
            FindingKind::RecvQueueDry,
            format!(
                "CQ {cq}: receive queue of QP {} left dry{who} for more than {:?}, {} times dry in all: its peer's next SEND meets RNR — repost receives from on_recv",
                qps.join(", "),
                crate::cq::DRY_GRACE,
                c.recv_queues_dry
            ),
        ));
    }
    // A handler that blocks does so on most of its calls; a lock met now
    // and then on a loaded machine, or a preemption, does not: the
    // finding needs 3 slow calls and 1 in 20 of the calls timed.
    if c.slow_handler_calls >= 3 && c.slow_handler_calls * 20 >= c.probed_calls {
        let who = c
            .last_slow_handler
            .as_ref()
            .map_or(String::new(), |h| format!(", the last in handler {h}"));
        out.push(Finding::new(
            FindingKind::SlowHandler,
            format!(
                "CQ {cq}: {} of {} handler calls timed blocked the poller past the slow threshold{who} (up to {:.3} ms; {} slow batches): a handler that blocks holds up every CQ of its poller — hand blocking work to a pool",
                c.slow_handler_calls,
                c.probed_calls,
                c.max_slow_ns as f64 / 1e6,
                c.slow_batches
            ),
        ));
    }
    if c.poll_errors > 0 {
        out.push(Finding::new(
            FindingKind::PollError,
            format!("CQ {cq}: {} polls failed (device gone?)", c.poll_errors),
        ));
    }
    if c.in_error {
        out.push(Finding::new(
            FindingKind::CqInError,
            format!("CQ {cq}: ended in the error state"),
        ));
    }
}

/// The findings of a stop's accounts.
pub(crate) fn of_accounts(a: &ShutdownReport, whose: &str, out: &mut Vec<Finding>) {
    for k in a.missing() {
        out.push(Finding::new(
            FindingKind::Unbalanced,
            format!(
                "{whose}: handler {}#{} {}: posted {}, completed {}, missing {}",
                k.handler.0,
                k.handler.1,
                k.kind,
                k.posted,
                k.completed,
                k.missing()
            ),
        ));
    }
    if a.timed_out {
        out.push(Finding::new(
            FindingKind::DrainTimedOut,
            format!(
                "{whose}: the drain timed out after {:?} with requests outstanding",
                a.waited
            ),
        ));
    }
}

/// The lines a report prints for one CQ (its `Display` form): capacity,
/// completions and their anomalies, credits.
pub(crate) fn cq_line(f: &mut fmt::Formatter<'_>, c: &CqSnapshot) -> fmt::Result {
    writeln!(
        f,
        "  cq {} capacity {}, {} completions, {} flushes, {} other errors, {} stale, {} foreign, overflows {}, receive queues dry {}, credits high water {}",
        c.name,
        c.capacity,
        c.completions,
        c.flushes,
        c.errors().saturating_sub(c.flushes),
        c.stale_wr_ids,
        c.foreign_wr_ids,
        c.overflows,
        c.recv_queues_dry,
        c.budget.as_ref().map_or(0, |b| b.credits_high_water)
    )
}

/// The verdict line(s) of a report: clean, or each finding.
pub(crate) fn verdict_lines(f: &mut fmt::Formatter<'_>, findings: &[Finding]) -> fmt::Result {
    if findings.is_empty() {
        return writeln!(f, "verdict: clean");
    }
    let n = findings.len();
    writeln!(f, "verdict: {n} finding{}", if n == 1 { "" } else { "s" })?;
    for x in findings {
        writeln!(f, "  - {x}")?;
    }
    Ok(())
}
