//! The outstanding-work ledger, its watchdog, and the shutdown report.
//!
//! Per handler and kind, the posted and completed counts live in the
//! handler's [`SlotLedger`] (kept by [`Registration::track`](crate::cq::Registration::track) and the
//! poller); this module does not count them again. It adds:
//!
//! - [`WrLedger`]: per QP and side, a ring of (wr_id, post time) of the
//!   requests outstanding. A send queue completes in order, so a completion
//!   retires every entry up to its wr_id (the unsignaled requests before it
//!   completed silently); a receive retires its own entry (SRQ receives may
//!   complete out of order). The ring's front is the oldest outstanding
//!   request: [`WrLedger::oldest`] is its age.
//! - The watchdog ([`WrLedger::scan`], or a [`Watchdog`] thread): every
//!   request outstanding longer than a threshold is reported — a `tracing`
//!   warning naming handler, QP and wr_id, and the `stuck` metric.
//! - [`Accounted`]: a handler wrapper that retires ledger entries and counts
//!   flushes per kind ([`FlushCounts`]) until the poller does both itself.
//! - [`ShutdownReport`]: at the end, per handler and kind, posted ==
//!   completed + flushed, or exactly what is missing and which requests are
//!   stuck. [`drain`] polls until everything is resolved or a timeout.

use crate::sync::{AtomicBool, AtomicU64, Ordering};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::handler::{Failed, Handler, Outbox, RecvDone, SendDone};
use crate::slab::SlotLedger;
use crate::wr_id::{HandlerKey, OpKind, Side, WrId};

/// A request outstanding longer than the watchdog's threshold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StuckWr {
    /// The QP it was posted on.
    pub qp_num: u32,
    /// Its queue.
    pub side: Side,
    /// Its wr_id, raw.
    pub wr_id: u64,
    /// The handler, kind and tag, if the wr_id is one cqd made.
    pub decoded: Option<WrId>,
    /// How long it has been outstanding.
    pub age: Duration,
}

impl fmt::Display for StuckWr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "QP {} {:?} wr_id {:#x}",
            self.qp_num, self.side, self.wr_id
        )?;
        if let Some(id) = self.decoded {
            write!(f, " (handler {}, {}, tag {})", id.key, id.kind, id.tag)?;
        }
        write!(f, " outstanding for {:?}", self.age)
    }
}

/// A copy of a ledger's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[non_exhaustive]
pub struct LedgerSnapshot {
    /// Requests outstanding, all QPs.
    pub outstanding: u64,
    /// Age of the oldest outstanding request (nanoseconds; 0 if none).
    pub oldest_ns: u64,
    /// Stuck requests the watchdog reported (each once).
    pub stuck: u64,
    /// Watchdog scans.
    pub scans: u64,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    wr_id: u64,
    at: Instant,
    reported: bool,
}

#[derive(Debug, Default)]
struct Inner {
    rings: HashMap<(u32, bool), VecDeque<Entry>>,
    stuck: u64,
    scans: u64,
}

/// Per-QP rings of outstanding requests and their post times. Cloneable;
/// posters record, the poller retires, the watchdog scans.
#[derive(Debug, Clone, Default)]
pub struct WrLedger {
    inner: Arc<Mutex<Inner>>,
}

fn key(qp_num: u32, side: Side) -> (u32, bool) {
    (qp_num, side == Side::Recv)
}

impl WrLedger {
    /// An empty ledger.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records requests posted on QP `qp_num`'s `side` queue at `now`, in
    /// post order. Call it before posting, and [`retire`](Self::retire)
    /// them if the post fails.
    pub fn posted(&self, qp_num: u32, side: Side, wr_ids: &[u64], now: Instant) {
        let mut g = self.inner.lock();
        let ring = g.rings.entry(key(qp_num, side)).or_default();
        ring.extend(wr_ids.iter().map(|&wr_id| Entry {
            wr_id,
            at: now,
            reported: false,
        }));
    }

    /// Retires on a completion: on the send side every entry up to and
    /// including `wr_id` (in-order completion), on the receive side that
    /// entry alone. Returns the entries retired.
    pub fn retire(&self, qp_num: u32, side: Side, wr_id: u64) -> usize {
        let mut g = self.inner.lock();
        let Some(ring) = g.rings.get_mut(&key(qp_num, side)) else {
            return 0;
        };
        let Some(i) = ring.iter().position(|e| e.wr_id == wr_id) else {
            return 0;
        };
        match side {
            Side::Send => {
                ring.drain(..=i);
                i + 1
            }
            Side::Recv => {
                ring.remove(i);
                1
            }
        }
    }

    /// Requests outstanding on one queue.
    pub fn outstanding(&self, qp_num: u32, side: Side) -> usize {
        self.inner
            .lock()
            .rings
            .get(&key(qp_num, side))
            .map_or(0, VecDeque::len)
    }

    /// Age of the oldest request outstanding on one queue.
    pub fn oldest(&self, qp_num: u32, side: Side, now: Instant) -> Option<Duration> {
        let g = self.inner.lock();
        let ring = g.rings.get(&key(qp_num, side))?;
        ring.iter()
            .map(|e| now.saturating_duration_since(e.at))
            .max()
    }

    /// Every request outstanding for at least `threshold`. Those not reported
    /// before are traced at warning level and counted as stuck.
    pub fn scan(&self, now: Instant, threshold: Duration) -> Vec<StuckWr> {
        let mut g = self.inner.lock();
        g.scans += 1;
        let mut out = Vec::new();
        let mut newly = 0;
        for (&(qp_num, recv), ring) in g.rings.iter_mut() {
            let side = if recv { Side::Recv } else { Side::Send };
            for e in ring.iter_mut() {
                let age = now.saturating_duration_since(e.at);
                if age < threshold {
                    if side == Side::Send {
                        break; // later ones are younger
                    }
                    continue;
                }
                let stuck = StuckWr {
                    qp_num,
                    side,
                    wr_id: e.wr_id,
                    decoded: WrId::decode(e.wr_id).ok(),
                    age,
                };
                if !e.reported {
                    e.reported = true;
                    newly += 1;
                    tracing::warn!(qp = qp_num, side = ?side, wr_id = format_args!("{:#x}", e.wr_id),
                        handler = %stuck.decoded.map_or_else(|| "foreign".to_string(), |d| d.key.to_string()),
                        kind = %stuck.decoded.map_or("?", |d| d.kind.name()), ?age, "work request stuck");
                }
                out.push(stuck);
            }
        }
        g.stuck += newly;
        out.sort_by_key(|s| std::cmp::Reverse(s.age));
        out
    }

    /// A copy of the counters.
    pub fn snapshot(&self, now: Instant) -> LedgerSnapshot {
        let g = self.inner.lock();
        let all = g.rings.values().flatten();
        LedgerSnapshot {
            outstanding: g.rings.values().map(|r| r.len() as u64).sum(),
            oldest_ns: all
                .map(|e| now.saturating_duration_since(e.at).as_nanos() as u64)
                .max()
                .unwrap_or(0),
            stuck: g.stuck,
            scans: g.scans,
        }
    }
}

/// A thread that scans a ledger every `period` for requests older than
/// `threshold`. Stops when dropped.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    join: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts the watchdog.
    ///
    /// # Errors
    /// When the OS refuses a thread.
    pub fn spawn(
        ledger: WrLedger,
        threshold: Duration,
        period: Duration,
    ) -> std::io::Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let s = Arc::clone(&stop);
        let join = std::thread::Builder::new()
            .name("cqd-watchdog".into())
            .spawn(move || {
                while !s.load(Ordering::Acquire) {
                    std::thread::park_timeout(period);
                    ledger.scan(Instant::now(), threshold);
                }
            })?;
        Ok(Watchdog {
            stop,
            join: Some(join),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(j) = self.join.take() {
            j.thread().unpark();
            let _ = j.join();
        }
    }
}

/// Flush completions per kind of one handler.
#[derive(Debug, Default)]
pub struct FlushCounts([AtomicU64; OpKind::COUNT]);

impl FlushCounts {
    /// Flushes of `kind`.
    pub fn get(&self, kind: OpKind) -> u64 {
        self.0[kind.index()].load(Ordering::Relaxed)
    }

    fn add(&self, kind: OpKind) {
        self.0[kind.index()].fetch_add(1, Ordering::Relaxed);
    }
}

/// A handler wrapper that retires [`WrLedger`] entries and counts flushes
/// per kind, then calls the wrapped handler.
#[derive(Debug)]
pub struct Accounted<H> {
    ledger: Option<WrLedger>,
    flushes: Arc<FlushCounts>,
    inner: H,
}

impl<H> Accounted<H> {
    /// Wraps `inner`; `ledger`, if given, is retired on every completion.
    pub fn new(ledger: Option<WrLedger>, inner: H) -> Self {
        Accounted {
            ledger,
            flushes: Arc::default(),
            inner,
        }
    }

    /// The flush counts (share them with the shutdown report).
    pub fn flushes(&self) -> Arc<FlushCounts> {
        Arc::clone(&self.flushes)
    }

    fn retire(&self, qp_num: u32, side: Side, wr_id: u64) {
        if let Some(l) = &self.ledger {
            l.retire(qp_num, side, wr_id);
        }
    }
}

impl<W, H: Handler<W>> Handler<W> for Accounted<H> {
    fn on_send(&mut self, d: &SendDone<'_>, out: &mut Outbox<'_, W>) {
        self.retire(d.qp_num(), Side::Send, d.completion().wr_id);
        self.inner.on_send(d, out);
    }

    fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, W>) {
        self.retire(d.qp_num(), Side::Recv, d.completion().wr_id);
        self.inner.on_recv(d, out);
    }

    fn on_error(&mut self, f: &Failed<'_>, out: &mut Outbox<'_, W>) {
        self.retire(f.qp_num(), f.side(), f.completion().wr_id);
        if f.is_flush() {
            self.flushes.add(f.kind());
        }
        self.inner.on_error(f, out);
    }
}

/// One handler's account of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct KindAccount {
    /// The handler.
    pub handler: (u32, u16),
    /// The kind.
    #[serde(with = "kind_name")]
    pub kind: OpKind,
    /// Requests posted (tracked).
    pub posted: u64,
    /// Requests completed, success or error, flushes excluded.
    pub completed: u64,
    /// Requests flushed.
    pub flushed: u64,
}

impl KindAccount {
    /// Posted requests with no completion: `posted - (completed + flushed)`.
    pub fn missing(&self) -> u64 {
        self.posted.saturating_sub(self.completed + self.flushed)
    }
}

/// OpKind is serialised by name.
mod kind_name {
    use super::OpKind;
    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(k: &OpKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(k.name())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<OpKind, D::Error> {
        let name = String::deserialize(d)?;
        OpKind::ALL
            .into_iter()
            .find(|k| k.name() == name)
            .ok_or_else(|| serde::de::Error::custom(format!("unknown kind {name}")))
    }
}

/// The final account of a shutdown (or of any moment).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[non_exhaustive]
pub struct ShutdownReport {
    /// Per handler and kind, every kind with something posted.
    pub accounts: Vec<KindAccount>,
    /// Requests still outstanding when the report was made (from the
    /// [`WrLedger`], oldest first).
    #[serde(skip)]
    pub stuck: Vec<StuckWr>,
    /// How long the drain waited.
    pub waited: Duration,
    /// True if the drain gave up at its timeout.
    pub timed_out: bool,
}

impl ShutdownReport {
    /// The accounts of `handlers` (key, posted/completed ledger, and flush
    /// counts kept by an [`Accounted`] wrapper; `None` reads the flushes
    /// the poller counts in the [`SlotLedger`] itself).
    pub fn from_ledgers<'a>(
        handlers: impl IntoIterator<Item = (HandlerKey, &'a SlotLedger, Option<&'a FlushCounts>)>,
    ) -> Self {
        let mut accounts = Vec::new();
        for (key, ledger, flushes) in handlers {
            for kind in OpKind::ALL {
                let posted = ledger.posted(kind);
                let done = ledger.completed(kind);
                if posted == 0 && done == 0 {
                    continue;
                }
                let flushed = flushes
                    .map_or_else(|| ledger.flushed(kind), |f| f.get(kind))
                    .min(done);
                accounts.push(KindAccount {
                    handler: (key.slot(), key.generation()),
                    kind,
                    posted,
                    completed: done - flushed,
                    flushed,
                });
            }
        }
        ShutdownReport {
            accounts,
            ..Default::default()
        }
    }

    /// True when every posted request completed or was flushed.
    pub fn is_balanced(&self) -> bool {
        self.accounts.iter().all(|a| a.missing() == 0) && !self.timed_out
    }

    /// The accounts with requests missing.
    pub fn missing(&self) -> impl Iterator<Item = &KindAccount> {
        self.accounts.iter().filter(|a| a.missing() > 0)
    }
}

impl fmt::Display for ShutdownReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_balanced() {
            let n: u64 = self.accounts.iter().map(|a| a.posted).sum();
            return write!(
                f,
                "all {n} requests accounted for (waited {:?})",
                self.waited
            );
        }
        writeln!(
            f,
            "requests missing after {:?}{}:",
            self.waited,
            if self.timed_out { " (timed out)" } else { "" }
        )?;
        for a in self.missing() {
            writeln!(
                f,
                "  handler {}#{} {}: posted {}, completed {}, flushed {}, missing {}",
                a.handler.0,
                a.handler.1,
                a.kind,
                a.posted,
                a.completed,
                a.flushed,
                a.missing()
            )?;
        }
        for s in &self.stuck {
            writeln!(f, "  stuck: {s}")?;
        }
        Ok(())
    }
}

/// Step 3 of the shutdown protocol: calls `poll` until no handler has
/// outstanding requests, or `timeout` passes; then reports. `ledger`, if
/// given, names the requests still stuck.
pub fn drain<'a>(
    handlers: &[(HandlerKey, &'a SlotLedger, Option<&'a FlushCounts>)],
    ledger: Option<&WrLedger>,
    timeout: Duration,
    mut poll: impl FnMut(),
) -> ShutdownReport {
    let start = Instant::now();
    let mut timed_out = false;
    while handlers.iter().any(|(_, l, _)| l.outstanding() > 0) {
        if start.elapsed() >= timeout {
            timed_out = true;
            break;
        }
        poll();
    }
    let mut report = ShutdownReport::from_ledgers(handlers.iter().copied());
    report.waited = start.elapsed();
    report.timed_out = timed_out;
    if let Some(l) = ledger {
        report.stuck = l.scan(Instant::now(), Duration::ZERO);
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn send_side_retires_in_order_receive_side_by_id() {
        let l = WrLedger::new();
        let t0 = Instant::now();
        l.posted(1, Side::Send, &[10, 11, 12], t0);
        l.posted(1, Side::Recv, &[20, 21], t0);
        assert_eq!(l.retire(1, Side::Send, 11), 2);
        assert_eq!(l.outstanding(1, Side::Send), 1);
        assert_eq!(l.retire(1, Side::Recv, 21), 1);
        assert_eq!(l.retire(1, Side::Recv, 99), 0);
        assert_eq!(l.outstanding(1, Side::Recv), 1);
        let later = t0 + Duration::from_secs(2);
        assert_eq!(l.oldest(1, Side::Send, later), Some(Duration::from_secs(2)));
        let stuck = l.scan(later, Duration::from_secs(1));
        assert_eq!(stuck.len(), 2);
        assert_eq!(l.snapshot(later).stuck, 2);
        l.scan(later, Duration::from_secs(1));
        assert_eq!(
            l.snapshot(later).stuck,
            2,
            "each stuck request is counted once"
        );
    }

    #[test]
    fn report_balances_or_names_what_is_missing() {
        let key = HandlerKey::new(3, 1).unwrap();
        let ledger = SlotLedger::default();
        ledger.add_posted(OpKind::Send, 3);
        ledger.add_completed(OpKind::Send);
        ledger.add_completed(OpKind::Send);
        let flushes = FlushCounts::default();
        flushes.add(OpKind::Send);
        let r = ShutdownReport::from_ledgers([(key, &ledger, Some(&flushes))]);
        assert!(!r.is_balanced());
        assert_eq!(
            r.accounts[0],
            KindAccount {
                handler: (3, 1),
                kind: OpKind::Send,
                posted: 3,
                completed: 1,
                flushed: 1
            }
        );
        assert!(r.to_string().contains("missing 1"), "{r}");
        ledger.add_completed(OpKind::Send);
        let r = ShutdownReport::from_ledgers([(key, &ledger, Some(&flushes))]);
        assert!(r.is_balanced(), "{r}");
    }
}
