//! The soak on real verbs: cqd-verbs over softverbs, two processes, RC
//! QPs, random faults, and the peer process killed and restarted.
//!
//! ```text
//! cargo build --release --features verbs --example soak_verbs
//! SOFTVERBS_DIR=/dev/shm/x target/release/softverbs-run \
//!     target/release/examples/soak_verbs --seconds 120 [--kill-every 5]
//! ```
//!
//! The process started by the command is the *initiator*; it starts itself
//! again as the *peer* (`--role peer --connect ADDR`), and the two talk
//! over TCP on 127.0.0.1: the peer sends its region's address and rkey,
//! and for every QP the initiator makes, the peer makes one, parks 256
//! receives on it (its handler posts each back as it completes) and the
//! two exchange endpoints and connect.
//!
//! The initiator has four lanes, one CQ each with its own poller thread
//! in busy, event, hybrid and adaptive mode (admission on), one RC QP per
//! lane and one live handler per lane; the main thread posts, through the
//! registration's `post_send` only, at most 32 requests in flight per
//! lane: SENDs to the peer's receives, RDMA WRITEs and READs on the
//! peer's region. Faults:
//!
//! - a WRITE or READ with a bad rkey (1 in 2,000): the remote access error
//!   puts the QP in error, the requests behind it flush; the lane waits
//!   until every request of the QP completed, drops it and connects a new
//!   one to a new QP of the peer;
//! - the lane's handler unregistered with requests in flight (every 5,000
//!   posts) and replaced: the retired handler still receives its
//!   completions, flushes included;
//! - every `--kill-every` seconds the peer process is SIGKILLed. The
//!   requests in flight on the first lane to post to it complete with
//!   `RETRY_EXC_ERR` after the short transport timeout set at connect
//!   (4 ms × 2 tries), the rest of its QP flushes; that lane starts the
//!   peer again, and every lane still connected to the dead one is moved
//!   to error, drained (timeouts and flushes) and reconnected to it.
//!
//! At the end (QPs to error, `cqd_core::shutdown`): each handler, live or
//! retired, received every tag it posted exactly once (success, error or
//! flush); every poller's accounts balance (posted == completed); no
//! overflow, stale or foreign wr_id, panic or undelivered completion;
//! every notification acknowledged; no poller thread left; resident memory
//! after warm-up (the first fifth of the 5-second samples) grew by less
//! than 8 MiB. Exit status 1 otherwise.
//!
//! On the kernel's rxe (in the VM of scripts/rxe-vm.sh, which sets
//! `CQD_RXE` and `RXE_GID_INDEX`) it runs as under the launcher, on the
//! first device with that GID index. Elsewhere it prints `SKIPPED:
//! soak_verbs (needs softverbs-run, root, or rxe: CQD_RXE)` and exits 0.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cqd::core::{
    CqHandle, CqOptions, Failed, Handler, NoSink, NoWork, Outbox, PollMode, PollerBuilder,
    RecvDone, Registration, SendDone,
};
use cqd::verbs::{
    Access, ConnectOptions, Context, Cq, CqSpec, Endpoint, Mr, Mtu, Pd, Qp, QpCap, QpInit, RecvWr,
    RemoteAddr, SendWr, WrOp,
};

const LANES: usize = 4;
/// Requests in flight per lane at most.
const WINDOW: u64 = 32;
/// Receives the peer keeps posted per QP.
const PEER_RX: u32 = 256;
/// The peer's region (receives land in its first 4 KiB).
const REGION: u64 = 1 << 20;
/// Posts through one handler before it is unregistered and replaced.
const ROTATE: u32 = 5_000;
/// One WRITE or READ in this many carries a bad rkey.
const BAD_RKEY_ONE_IN: u64 = 2_000;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Short transport timeout so that a dead peer is found in milliseconds:
/// 4.096 µs × 2^10 × (1 + 1) ≈ 8 ms. On the kernel's rxe (RoCE) the GID
/// index comes from `RXE_GID_INDEX` (scripts/rxe-vm.sh sets it).
fn connect_options() -> ConnectOptions {
    ConnectOptions {
        timeout: 10,
        retry_cnt: 1,
        gid_index: std::env::var("RXE_GID_INDEX")
            .ok()
            .and_then(|v| v.parse().ok()),
        ..ConnectOptions::default()
    }
}

fn endpoint_line(e: &Endpoint) -> String {
    let gid: String = e.gid.iter().map(|b| format!("{b:02x}")).collect();
    format!("{} {} {} {} {gid}", e.lid, e.qpn, e.psn, e.mtu.to_raw())
}

fn parse_endpoint(f: &[&str]) -> Result<Endpoint, String> {
    if f.len() != 5 || f[4].len() != 32 {
        return Err(format!("bad endpoint {f:?}"));
    }
    let n = |s: &str| s.parse::<u32>().map_err(|e| format!("{s}: {e}"));
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = u8::from_str_radix(&f[4][2 * i..2 * i + 2], 16).map_err(err)?;
    }
    Ok(Endpoint {
        lid: n(f[0])? as u16,
        qpn: n(f[1])?,
        psn: n(f[2])?,
        mtu: Mtu::from_raw(n(f[3])?),
        gid,
    })
}

fn read_line(r: &mut impl BufRead) -> Result<String, String> {
    let mut line = String::new();
    if r.read_line(&mut line).map_err(err)? == 0 {
        return Err("connection closed".into());
    }
    Ok(line.trim().to_string())
}

// ---------------------------------------------------------------------
// The peer process.
// ---------------------------------------------------------------------

/// The peer's handler of one QP: posts each receive back.
struct Reposter {
    qp: Arc<Qp>,
    mr: Mr,
    reg: Registration,
}

impl Handler for Reposter {
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let sge = [self.mr.sge(0, 4096)];
        // A QP gone to error refuses or flushes it: either is fine.
        let _ = self
            .reg
            .post_recv(&*self.qp, &mut [RecvWr::new(u64::from(d.tag()), &sge)]);
    }
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

fn peer(addr: &str) -> Result<(), String> {
    let stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let mut w = stream.try_clone().map_err(err)?;
    let mut r = BufReader::new(stream);
    let ctx = Context::open_first().map_err(err)?;
    let pd = ctx.alloc_pd().map_err(err)?;
    let access = Access(Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0);
    let mr = pd.reg_mr(REGION, access).map_err(err)?;
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("peer", 8192, CqSpec::default(), CqOptions::default())
        .map_err(err)?;
    let poller = PollerBuilder::new("peer", NoSink)
        .mode(PollMode::Event)
        .cq(unbound)
        .spawn()
        .map_err(err)?;
    writeln!(w, "M {} {}", mr.addr(), mr.rkey()).map_err(err)?;
    let mut lanes: Vec<Option<(Arc<Qp>, Registration)>> = (0..LANES).map(|_| None).collect();
    let mut graveyard: Vec<(Arc<Qp>, Registration)> = Vec::new();
    let opts = connect_options();
    let mut psn = 0x10_0000u32;
    // Until the initiator closes the connection (it is done).
    while let Ok(line) = read_line(&mut r) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() != 7 || f[0] != "Q" || f[1].parse::<usize>().map_or(true, |l| l >= LANES) {
            return Err(format!("peer: bad command {line:?}"));
        }
        let lane: usize = f[1].parse().map_err(err)?;
        let theirs = parse_endpoint(&f[2..])?;
        if let Some((old, reg)) = lanes.get_mut(lane).and_then(Option::take) {
            let _ = old.to_error();
            graveyard.push((old, reg));
        }
        // QPs whose receives have all flushed: their handler goes (it
        // holds the last reference) and the QP with it, giving its CQ
        // reservation back.
        let mut kept = Vec::new();
        for (qp, reg) in graveyard.drain(..) {
            if reg.ledger().outstanding() == 0 {
                handle.unregister(reg.key()).map_err(err)?;
            } else {
                kept.push((qp, reg));
            }
        }
        graveyard = kept;
        let cap = QpCap {
            max_send_wr: 16,
            max_recv_wr: PEER_RX,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = Arc::new(pd.create_qp(&QpInit::new(&cq, &cq, cap)).map_err(err)?);
        let reg = handle
            .register_with(|reg| Reposter {
                qp: Arc::clone(&qp),
                mr: mr.clone(),
                reg: reg.clone(),
            })
            .map_err(err)?;
        psn = psn.wrapping_add(0x1000) & 0xff_ffff;
        let mine = qp.endpoint(&opts, psn).map_err(err)?;
        qp.connect(&theirs, psn, &opts).map_err(err)?;
        // Receives are posted once the QP is out of RESET, before the
        // initiator learns the endpoint (so before its first SEND).
        for t in 0..PEER_RX {
            let sge = [mr.sge(0, 4096)];
            reg.post_recv(&*qp, &mut [RecvWr::new(u64::from(t), &sge)])
                .map_err(err)?;
        }
        writeln!(w, "{}", endpoint_line(&mine)).map_err(err)?;
        lanes[lane] = Some((qp, reg));
    }
    for (qp, _) in lanes.iter().flatten().chain(graveyard.iter()) {
        let _ = qp.to_error();
    }
    let report = poller.stop().map_err(err)?;
    drop(cq);
    if !report.accounts.is_balanced() {
        return Err(format!("peer: unbalanced accounts: {}", report.accounts));
    }
    Ok(())
}

// ---------------------------------------------------------------------
// The initiator.
// ---------------------------------------------------------------------

/// What one handler posted and got, tag by tag.
#[derive(Default)]
struct Tally {
    posted: AtomicU64,
    completed: AtomicU64,
    /// Completions this handler never posted a request for (receives).
    unexpected: AtomicU64,
    /// Completions per tag (tags are 0, 1, 2, … in posting order).
    seen: Mutex<Vec<u8>>,
}

/// Counts over the whole run.
#[derive(Default)]
struct Totals {
    ok: AtomicU64,
    flushed: AtomicU64,
    retry_exceeded: AtomicU64,
    remote_access: AtomicU64,
    other_errors: AtomicU64,
}

struct Counter {
    tally: Arc<Tally>,
    totals: Arc<Totals>,
    /// The lane's QP needs replacing (an error other than a flush).
    broken: Arc<AtomicBool>,
}

impl Counter {
    fn got(&self, tag: u32) {
        let mut seen = self.tally.seen.lock().unwrap_or_else(|p| p.into_inner());
        let i = tag as usize;
        if seen.len() <= i {
            seen.resize(i + 1, 0);
        }
        seen[i] = seen[i].saturating_add(1);
        self.tally.completed.fetch_add(1, Relaxed);
    }
}

impl Handler for Counter {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.totals.ok.fetch_add(1, Relaxed);
        self.got(d.tag());
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        // The initiator posts no receives: one is counted as unexpected,
        // which the check at the end reports.
        self.tally.unexpected.fetch_add(1, Relaxed);
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        if f.is_flush() {
            self.totals.flushed.fetch_add(1, Relaxed);
        } else {
            let s = format!("{:?}", f.status()).to_ascii_lowercase();
            let c = if s.contains("retry") {
                &self.totals.retry_exceeded
            } else if s.contains("access") {
                &self.totals.remote_access
            } else {
                &self.totals.other_errors
            };
            c.fetch_add(1, Relaxed);
            self.broken.store(true, Relaxed);
        }
        self.got(f.tag());
    }
}

/// Checks a handler that has nothing outstanding: each tag posted
/// completed once, nothing else. Frees its per-tag record.
fn check_tally(t: &Tally) -> Result<u64, String> {
    let posted = t.posted.load(Relaxed);
    let mut seen = t.seen.lock().unwrap_or_else(|p| p.into_inner());
    let unexpected = t.unexpected.load(Relaxed);
    if unexpected != 0 {
        return Err(format!("{unexpected} completions of requests never posted"));
    }
    if seen.len() as u64 != posted || seen.iter().any(|&n| n != 1) {
        let lost = seen.iter().filter(|&&n| n == 0).count() as u64
            + posted.saturating_sub(seen.len() as u64);
        let dup = seen.iter().filter(|&&n| n > 1).count();
        return Err(format!(
            "{posted} posted, {} completions for {} tags: {lost} lost, {dup} duplicated",
            t.completed.load(Relaxed),
            seen.len()
        ));
    }
    *seen = Vec::new();
    Ok(posted)
}

struct PeerProc {
    child: Child,
    w: TcpStream,
    r: BufReader<TcpStream>,
    remote: RemoteAddr,
}

fn spawn_peer(listener: &TcpListener) -> Result<PeerProc, String> {
    let addr = listener.local_addr().map_err(err)?;
    let exe = std::env::current_exe().map_err(err)?;
    let child = Command::new(exe)
        .args(["--role", "peer", "--connect", &addr.to_string()])
        .spawn()
        .map_err(|e| format!("spawn the peer: {e}"))?;
    let (s, _) = listener.accept().map_err(err)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(err)?;
    let _ = s.set_nodelay(true);
    let mut r = BufReader::new(s.try_clone().map_err(err)?);
    let line = read_line(&mut r)?;
    let f: Vec<&str> = line.split_whitespace().collect();
    if f.len() != 3 || f[0] != "M" {
        return Err(format!("bad region line {line:?}"));
    }
    let remote = RemoteAddr {
        addr: f[1].parse().map_err(err)?,
        rkey: f[2].parse().map_err(err)?,
    };
    Ok(PeerProc {
        child,
        w: s,
        r,
        remote,
    })
}

struct Lane {
    name: &'static str,
    cq: Cq,
    handle: CqHandle<NoWork>,
    qp: Option<Qp>,
    reg: Registration,
    tally: Arc<Tally>,
    next_tag: u32,
    retired: Vec<(Registration, Arc<Tally>)>,
    broken: Arc<AtomicBool>,
    remote: RemoteAddr,
    /// The peer generation this lane's QP is connected to.
    peer_gen: u64,
}

impl Lane {
    fn new_handler(&mut self, totals: &Arc<Totals>) -> Result<(), String> {
        let tally = Arc::new(Tally::default());
        let reg = self
            .handle
            .register(Counter {
                tally: Arc::clone(&tally),
                totals: Arc::clone(totals),
                broken: Arc::clone(&self.broken),
            })
            .map_err(err)?;
        let old_reg = std::mem::replace(&mut self.reg, reg);
        let old_tally = std::mem::replace(&mut self.tally, tally);
        self.next_tag = 0;
        self.handle.unregister(old_reg.key()).map_err(err)?;
        self.retired.push((old_reg, old_tally));
        Ok(())
    }

    fn outstanding(&self) -> u64 {
        self.reg.ledger().outstanding()
            + self
                .retired
                .iter()
                .map(|(r, _)| r.ledger().outstanding())
                .sum::<u64>()
    }
}

/// A new QP for `lane`, connected to a new QP of the peer.
fn connect_lane(
    pd: &Pd,
    lane: &mut Lane,
    idx: usize,
    peer: &mut PeerProc,
    psn: u32,
) -> Result<(), String> {
    let cap = QpCap {
        max_send_wr: WINDOW as u32 * 2,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd
        .create_qp(&QpInit::new(&lane.cq, &lane.cq, cap))
        .map_err(err)?;
    let opts = connect_options();
    let mine = qp.endpoint(&opts, psn).map_err(err)?;
    writeln!(peer.w, "Q {idx} {}", endpoint_line(&mine)).map_err(err)?;
    let line = read_line(&mut peer.r)?;
    let f: Vec<&str> = line.split_whitespace().collect();
    let theirs = parse_endpoint(&f)?;
    qp.connect(&theirs, psn, &opts).map_err(err)?;
    lane.qp = Some(qp);
    lane.remote = peer.remote;
    lane.broken.store(false, Relaxed);
    Ok(())
}

/// Resident memory in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4)
}

fn poller_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter(|e| {
                    std::fs::read(e.path().join("comm")).is_ok_and(|c| c.starts_with(b"cqd-poller"))
                })
                .count()
        })
        .unwrap_or(0)
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn initiator(seconds: u64, kill_every: u64) -> Result<(), String> {
    let started = Instant::now();
    let ctx = Context::open_first().map_err(err)?;
    let pd = ctx.alloc_pd().map_err(err)?;
    let local = pd.reg_mr(64 * 1024, Access::LOCAL_WRITE).map_err(err)?;
    let listener = TcpListener::bind("127.0.0.1:0").map_err(err)?;
    let totals = Arc::new(Totals::default());
    let mut threads = Vec::new();
    let mut lanes = Vec::new();
    for mode in PollMode::all() {
        let name = mode.name();
        let (cq, unbound, handle) = ctx
            .create_dispatched_cq::<NoWork>(name, 512, CqSpec::default(), CqOptions::default())
            .map_err(err)?;
        threads.push(
            PollerBuilder::new(name, NoSink)
                .mode(mode)
                .cq(unbound)
                .spawn()
                .map_err(err)?,
        );
        let tally = Arc::new(Tally::default());
        let broken = Arc::new(AtomicBool::new(true));
        let reg = handle
            .register(Counter {
                tally: Arc::clone(&tally),
                totals: Arc::clone(&totals),
                broken: Arc::clone(&broken),
            })
            .map_err(err)?;
        lanes.push(Lane {
            name,
            cq,
            handle,
            qp: None,
            reg,
            tally,
            next_tag: 0,
            retired: Vec::new(),
            broken,
            remote: RemoteAddr::default(),
            peer_gen: 0,
        });
    }

    let mut peer: Option<PeerProc> = None;
    let mut peer_gen = 0u64;
    let mut restarts = 0u64;
    let mut kills = 0u64;
    let mut qps_replaced = 0u64;
    let mut handlers_retired = 0u64;
    let mut bad_rkeys = 0u64;
    let mut post_refused = 0u64;
    let mut posted_total = 0u64;
    let mut checked = 0u64;
    let mut psn = 0x100u32;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rss = vec![rss_kib()];
    let mut next_sample = Instant::now() + Duration::from_secs(5);
    let mut next_kill = Instant::now() + Duration::from_secs(kill_every);
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut kill_to_reconnect = Vec::new();
    let mut killed_at: Option<Instant> = None;

    while Instant::now() < end {
        // The peer: killed on schedule, started again when a lane needs it.
        if Instant::now() >= next_kill {
            if let Some(mut p) = peer.take() {
                p.child.kill().map_err(|e| format!("kill the peer: {e}"))?;
                let _ = p.child.wait();
                kills += 1;
                killed_at = Some(Instant::now());
            }
            next_kill = Instant::now() + Duration::from_secs(kill_every);
        }
        for (idx, lane) in lanes.iter_mut().enumerate() {
            // A lane whose QP failed, or whose peer was killed and whose
            // requests have all completed (the in-flight ones with
            // RETRY_EXC_ERR or flushed): the QP to error, everything
            // retired, a new QP.
            let stale_peer = lane.qp.is_some() && lane.peer_gen != peer_gen;
            if !lane.broken.load(Relaxed) && !stale_peer {
                continue;
            }
            if let Some(qp) = lane.qp.as_ref() {
                let _ = qp.to_error();
                let deadline = Instant::now() + Duration::from_secs(10);
                while lane.outstanding() > 0 {
                    if Instant::now() > deadline {
                        return Err(format!(
                            "lane {}: {} requests never completed after the QP went to error",
                            lane.name,
                            lane.outstanding()
                        ));
                    }
                    std::thread::sleep(Duration::from_micros(200));
                }
                lane.qp = None;
                qps_replaced += 1;
            }
            if peer.is_none() {
                let p = spawn_peer(&listener)?;
                if let Some(t) = killed_at.take() {
                    kill_to_reconnect.push(t.elapsed());
                    restarts += 1;
                }
                peer_gen += 1;
                peer = Some(p);
            }
            let p = peer.as_mut().expect("started above");
            psn = psn.wrapping_add(0x1000) & 0xff_ffff;
            connect_lane(&pd, lane, idx, p, psn)?;
            lane.peer_gen = peer_gen;
        }
        // Retired handlers with nothing outstanding: checked and dropped.
        for lane in lanes.iter_mut() {
            let mut i = 0;
            while i < lane.retired.len() {
                if lane.retired[i].0.ledger().outstanding() == 0 {
                    let (_, t) = lane.retired.swap_remove(i);
                    checked += check_tally(&t).map_err(|e| format!("lane {}: {e}", lane.name))?;
                } else {
                    i += 1;
                }
            }
        }
        // Traffic.
        let mut posted_now = false;
        for lane in lanes.iter_mut() {
            let Some(qp) = lane.qp.as_ref() else { continue };
            if lane.broken.load(Relaxed) || lane.reg.ledger().outstanding() >= WINDOW {
                continue;
            }
            let r = rng.next();
            let off = (r >> 8) % (REGION - 8192) + 4096;
            let mut remote = lane.remote.offset(off & !7);
            let bad = (r >> 40) % BAD_RKEY_ONE_IN == 0 && r % 3 != 0;
            if bad {
                remote.rkey ^= 0x5a5a_5a5a;
            }
            let len = 8 + ((r >> 20) % 1024) as u32;
            let sge = [local.sge(((r >> 32) % 32_768) as usize, len)];
            let op = match r % 3 {
                0 => WrOp::Send,
                1 => WrOp::Write(remote),
                _ => WrOp::Read(remote),
            };
            let tag = lane.next_tag;
            match lane
                .reg
                .post_send(qp, &mut [SendWr::new(u64::from(tag), op, &sge)])
            {
                Ok(()) => {
                    lane.next_tag += 1;
                    lane.tally.posted.fetch_add(1, Relaxed);
                    posted_total += 1;
                    bad_rkeys += u64::from(bad);
                    posted_now = true;
                }
                Err(_) => post_refused += 1,
            }
            if lane.next_tag >= ROTATE {
                lane.new_handler(&totals)?;
                handlers_retired += 1;
            }
        }
        if !posted_now {
            std::thread::yield_now();
        }
        if Instant::now() >= next_sample {
            rss.push(rss_kib());
            next_sample += Duration::from_secs(5);
        }
    }

    // The stop: every QP to error, then the pollers stop (they drain the
    // flushes first).
    let report = cqd::core::shutdown(
        || {
            for lane in &lanes {
                if let Some(qp) = lane.qp.as_ref() {
                    let _ = qp.to_error();
                }
            }
        },
        threads,
        [],
    );
    rss.push(rss_kib());
    let mut failures = Vec::new();
    if !report.is_clean() {
        failures.push(format!("stop report not clean: {:?}", report.errors));
    }
    let (mut events, mut acks, mut overflows, mut anomalies) = (0u64, 0u64, 0u64, 0u64);
    let mut completions = 0u64;
    for p in &report.pollers {
        if !p.accounts.is_balanced() {
            failures.push(format!("unbalanced accounts: {}", p.accounts));
        }
        for a in &p.accounts.accounts {
            if a.posted != a.completed {
                failures.push(format!("account {a:?}: posted != completed"));
            }
        }
        if p.undelivered != 0 || !p.errors.is_empty() {
            failures.push(format!(
                "{} undelivered, errors {:?}",
                p.undelivered, p.errors
            ));
        }
        for c in &p.cqs {
            events += c.events;
            acks += c.acks;
            overflows += c.overflows;
            anomalies += c.stale_wr_ids + c.foreign_wr_ids + c.handler_panics;
            completions += c.completions;
            if c.acks != c.events {
                failures.push(format!(
                    "CQ {}: {} events, {} acked",
                    c.name, c.events, c.acks
                ));
            }
        }
    }
    if overflows != 0 || anomalies != 0 {
        failures.push(format!(
            "{overflows} overflows, {anomalies} stale/foreign/panics"
        ));
    }
    for lane in lanes.iter_mut() {
        let mut all = std::mem::take(&mut lane.retired);
        all.push((lane.reg.clone(), Arc::clone(&lane.tally)));
        for (reg, t) in all {
            if reg.ledger().outstanding() != 0 {
                failures.push(format!(
                    "lane {}: {} outstanding after the stop",
                    lane.name,
                    reg.ledger().outstanding()
                ));
            }
            match check_tally(&t) {
                Ok(n) => checked += n,
                Err(e) => failures.push(format!("lane {}: {e}", lane.name)),
            }
        }
    }
    if checked != posted_total {
        failures.push(format!("{checked} checked, {posted_total} posted"));
    }
    // A joined thread's task entry can outlive the join by a moment (the
    // join is woken at the thread's exit, before the kernel releases the
    // task): gone within the bound, or leaked.
    let gone_by = Instant::now() + Duration::from_secs(5);
    let leaked = loop {
        let n = poller_threads();
        if n == 0 || Instant::now() >= gone_by {
            break n;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if leaked != 0 {
        failures.push(format!("{leaked} poller threads left"));
    }
    // The peer sees the connection close and stops cleanly.
    if let Some(mut p) = peer.take() {
        drop(p.w);
        drop(p.r);
        match p.child.wait() {
            Ok(s) if s.success() => {}
            other => failures.push(format!("the last peer ended with {other:?}")),
        }
    }
    for lane in lanes.iter_mut() {
        lane.qp = None;
    }
    drop(lanes);

    let warm = rss[rss.len() / 5];
    let max_after = rss[rss.len() / 5..].iter().copied().max().unwrap_or(0);
    if max_after > warm + 8 * 1024 {
        failures.push(format!(
            "RSS grew from {warm} KiB to {max_after} KiB after warm-up"
        ));
    }
    let t = &totals;
    let mut k: Vec<u128> = kill_to_reconnect.iter().map(Duration::as_millis).collect();
    k.sort_unstable();
    println!(
        "soak_verbs: {:.0} s, 4 lanes (busy, event, hybrid, adaptive), two processes",
        started.elapsed().as_secs_f64()
    );
    println!("  requests posted           {posted_total}, each completed exactly once: {checked} checked");
    println!(
        "  completions               {completions} ({} ok, {} flushed, {} RETRY_EXC_ERR, {} remote access errors, {} other errors)",
        t.ok.load(Relaxed),
        t.flushed.load(Relaxed),
        t.retry_exceeded.load(Relaxed),
        t.remote_access.load(Relaxed),
        t.other_errors.load(Relaxed)
    );
    println!("  peer killed / restarted   {kills} / {restarts} (kill to new peer up: median {} ms, max {} ms)",
        k.get(k.len() / 2).copied().unwrap_or(0),
        k.last().copied().unwrap_or(0));
    println!("  bad-rkey requests         {bad_rkeys}");
    println!("  QPs replaced              {qps_replaced}");
    println!("  handlers retired in flight {handlers_retired}");
    println!("  posts refused (retried)   {post_refused}");
    println!("  notifications             {events} taken, {acks} acked");
    println!("  overflows, stale/foreign/panics {overflows}, {anomalies}");
    println!("  poller threads left       {leaked}");
    println!(
        "  RSS KiB                   first {}, after warm-up {warm}, max after warm-up {max_after}, last {} ({} samples)",
        rss[0],
        rss[rss.len() - 1],
        rss.len()
    );
    if failures.is_empty() {
        println!("soak_verbs: OK, nothing lost");
        Ok(())
    } else {
        Err(failures.join("\n"))
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
    };
    if get("--role").as_deref() == Some("peer") {
        let Some(addr) = get("--connect") else {
            eprintln!("soak_verbs peer: --connect ADDR");
            std::process::exit(2);
        };
        if let Err(e) = peer(&addr) {
            eprintln!("soak_verbs peer: {e}");
            std::process::exit(1);
        }
        return;
    }
    if std::env::var_os("SOFTVERBS_RUN").is_none() && std::env::var_os("CQD_RXE").is_none() {
        println!("SKIPPED: soak_verbs (needs softverbs-run, root, or rxe: CQD_RXE)");
        return;
    }
    let num = |flag: &str, default: u64| -> u64 {
        match get(flag).map(|v| v.parse::<u64>()) {
            None => default,
            Some(Ok(v)) => v,
            Some(Err(e)) => {
                eprintln!("soak_verbs: {flag}: {e}");
                std::process::exit(2);
            }
        }
    };
    let seconds = num("--seconds", 30);
    let kill_every = num("--kill-every", 5).max(1);
    if let Err(e) = initiator(seconds, kill_every) {
        eprintln!("soak_verbs: FAILED\n{e}");
        std::process::exit(1);
    }
}
