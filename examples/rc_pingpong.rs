//! `ibv_rc_pingpong` on cqd: rdma-core's RC ping-pong (wire protocol, TCP
//! address exchange, message pattern, command line and result lines), with
//! every completion going through cqd's dispatcher. It stands in for either
//! side of the unmodified `ibv_rc_pingpong`:
//!
//! ```text
//! cargo run --release --features verbs --example rc_pingpong -- [options]         # server
//! cargo run --release --features verbs --example rc_pingpong -- [options] <host>  # client
//! ```
//!
//! Options as the real tool's: `-p`, `-d`, `-i`, `-s`, `-m`, `-r`, `-n`,
//! `-l`, `-e`, `-g`, `-c` (`rc_pingpong/wire.rs` has the details and what
//! the real tool does, byte for byte). Without RDMA hardware, run it under
//! `softverbs-run` (docs/softverbs.md).
//!
//! How it uses cqd:
//!
//! - the CQ is made with `create_dispatched_cq`; its polling half goes to a
//!   poller thread ([`PollerBuilder`]) in [`PollMode::Busy`] without naps
//!   (the real tool's polling loop spins and never sleeps) or, with `-e`,
//!   [`PollMode::Event`]: the poller arms the CQ, re-polls, sleeps on the
//!   completion channel, takes and acknowledges the events — the real
//!   tool's `ibv_get_cq_event` loop;
//! - one handler ([`PingPong`]) is registered on the CQ and owns the QP; the
//!   tags `RECV_WRID` (1) and `SEND_WRID` (2) ride in the wr_ids, so the
//!   poller routes each completion to it and hands back the tag. On each
//!   completion it runs the real tool's loop body ([`Pattern`]): count,
//!   refill the receive queue when it runs low, and post the next send
//!   once the last one completed and a new message arrived — all through
//!   `Registration::post_send` / `post_recv`, from the poller thread;
//! - the main thread only sets up, exchanges addresses, posts the client's
//!   first send, and waits for the handler to report the end of the run (or
//!   a failure); then it moves the QP to the error state and stops the
//!   poller, which collects the flushed receives before it reports.
//!
//! Differences from the real tool that a peer cannot see: the CQ is larger
//! than `rx_depth + 1` (cqd admits the QP's granted depths on it, and
//! devices round depths up), receives are posted once the QP is connected
//! (cqd's `Qp::connect` does INIT, RTR and RTS in one call), and with `-c`
//! the client checks the echo it got back as the server checks what it
//! received (same `invalid data in page N` line).

#[path = "rc_pingpong/wire.rs"]
mod wire;

use std::hash::{BuildHasher, Hasher};
use std::process::ExitCode;
use std::sync::mpsc;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use cqd::core::{
    cq_depth_for, AsyncEvent, CqOptions, Failed, Handler, NoSink, NoWork, Outbox, PollMode,
    PollerBuilder, QpEvent, RecvDone, Registration, SendDone,
};
use cqd::verbs::{
    Access, ConnectOptions, Context, CqSpec, Endpoint, Mr, Mtu, Qp, QpCap, QpInit, RecvWr, SendWr,
    WrOp,
};

use wire::{Options, WireDest, RECV_WRID, SEND_WRID};

/// `IBV_LINK_LAYER_ETHERNET`: a port without LIDs (RoCE).
const LINK_LAYER_ETHERNET: u8 = 2;

/// What a side does after a completion (the real tool's loop body).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
struct Step {
    /// Receives to post first, to bring the receive queue back to
    /// `rx_depth`.
    refill: u32,
    /// Post the next send.
    send: bool,
    /// Both counts reached `iters`: the run is over.
    done: bool,
}

/// The message pattern of `ibv_rc_pingpong`'s main loop, without the verbs:
/// `routs` receives posted, `rcnt` received, `scnt` sent, and `pending`,
/// the completions still awaited before the next send.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    iters: u32,
    rx_depth: u32,
    routs: u32,
    rcnt: u32,
    scnt: u32,
    pending: u64,
}

impl Pattern {
    /// A side with `rx_depth` receives posted. The client has posted its
    /// first send (before the loop, unconditionally) and awaits both its
    /// completion and the answer; the server awaits the first message.
    fn new(client: bool, iters: u32, rx_depth: u32) -> Pattern {
        Pattern {
            iters,
            rx_depth,
            routs: rx_depth,
            rcnt: 0,
            scnt: 0,
            pending: if client {
                RECV_WRID | SEND_WRID
            } else {
                RECV_WRID
            },
        }
    }

    /// True once the loop `while (rcnt < iters || scnt < iters)` ends.
    fn is_done(&self) -> bool {
        self.rcnt >= self.iters && self.scnt >= self.iters
    }

    /// One successful completion with tag `wr_id`: what to post next. The
    /// refill it asks for counts as posted (a failed post is fatal).
    ///
    /// # Errors
    /// An unknown wr_id, or a receive completion with no receive posted
    /// (neither can come from a working device: the text says which).
    fn completed(&mut self, wr_id: u64) -> Result<Step, String> {
        let mut step = Step::default();
        match wr_id {
            SEND_WRID => self.scnt += 1,
            RECV_WRID => {
                self.routs = self.routs.checked_sub(1).ok_or_else(|| {
                    "receive completion with no receive posted (device error)".to_string()
                })?;
                if self.routs <= 1 {
                    step.refill = self.rx_depth - self.routs;
                    self.routs = self.rx_depth;
                }
                self.rcnt += 1;
            }
            other => return Err(format!("Completion for unknown wr_id {other}")),
        }
        self.pending &= !wr_id;
        if self.scnt < self.iters && self.pending == 0 {
            step.send = true;
            self.pending = RECV_WRID | SEND_WRID;
        }
        step.done = self.is_done();
        Ok(step)
    }
}

/// How the run ended, from the handler to the main thread.
#[derive(Debug)]
enum Outcome {
    /// Every message sent and received, at this instant.
    Done(Instant),
    /// A fatal error, in the real tool's words where it has some.
    Failed(String),
}

/// What the handler posts with, set once the QP exists.
struct Link {
    qp: Qp,
    mr: Mr,
    reg: Registration,
    size: u32,
    inline: bool,
}

impl Link {
    fn post_recvs(&self, n: u32) -> Result<(), String> {
        if n == 0 {
            return Ok(());
        }
        let sge = [self.mr.sge(0, self.size)];
        let mut wrs = vec![RecvWr::new(RECV_WRID, &sge); n as usize];
        self.reg
            .post_recv(&self.qp, &mut wrs)
            .map_err(|e| format!("Couldn't post receive ({n}): {e}"))
    }

    fn post_send(&self) -> Result<(), String> {
        let sge = [self.mr.sge(0, self.size)];
        let mut wr = SendWr::new(SEND_WRID, WrOp::Send, &sge);
        if self.inline {
            wr = wr.inline();
        }
        self.reg
            .post_send(&self.qp, &mut [wr])
            .map_err(|e| format!("Couldn't post send: {e}"))
    }
}

/// The handler registered on the CQ: runs [`Pattern`] on every completion
/// the poller routes to it and posts what it asks for.
struct PingPong {
    link: Arc<OnceLock<Link>>,
    pattern: Pattern,
    /// Set once the outcome was sent: later completions (the flushed
    /// receives of the stop) are ignored.
    over: bool,
    outcome: mpsc::Sender<Outcome>,
}

impl PingPong {
    fn finish(&mut self, outcome: Outcome) {
        if !std::mem::replace(&mut self.over, true) {
            // The main thread may be gone already; nothing else to tell.
            let _ = self.outcome.send(outcome);
        }
    }

    fn completed(&mut self, wr_id: u64) {
        if self.over {
            return;
        }
        let result = self.pattern.completed(wr_id).and_then(|step| {
            let link = self
                .link
                .get()
                .ok_or("completion before the QP was set up (device error)")?;
            link.post_recvs(step.refill)?;
            if step.send {
                link.post_send()?;
            }
            Ok(step.done)
        });
        match result {
            Ok(true) => self.finish(Outcome::Done(Instant::now())),
            Ok(false) => {}
            Err(e) => self.finish(Outcome::Failed(e)),
        }
    }
}

impl Handler for PingPong {
    fn on_send(&mut self, done: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.completed(u64::from(done.tag()));
    }

    fn on_recv(&mut self, done: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.completed(u64::from(done.tag()));
    }

    fn on_error(&mut self, failed: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        let status = failed.status();
        self.finish(Outcome::Failed(format!(
            "Failed status {status} ({}) for wr_id {}",
            status.to_raw(),
            failed.tag()
        )));
    }

    /// The QP's errors end the run; its other events (communication
    /// established, path migrated …) are informational, as for the real
    /// tool, which does not read them.
    fn on_async(&mut self, event: &AsyncEvent) {
        if let AsyncEvent::Qp {
            kind: kind @ (QpEvent::Fatal | QpEvent::RequestError | QpEvent::AccessError),
            qp_num,
            ..
        } = event
        {
            self.finish(Outcome::Failed(format!(
                "asynchronous event on QP {qp_num:#x}: {kind:?}"
            )));
        }
    }
}

/// A 24-bit packet sequence number, different in every run (the real tool
/// uses `lrand48()` seeded with the pid and the time).
fn random_psn() -> u32 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    (h.finish() & 0xff_ffff) as u32
}

fn main() -> ExitCode {
    let argv0 = std::env::args()
        .next()
        .unwrap_or_else(|| "rc_pingpong".into());
    let o = match wire::parse_args(std::env::args().skip(1)) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("{argv0}: {e}");
            print!("{}", wire::usage(&argv0));
            return ExitCode::FAILURE;
        }
    };
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{argv0}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(o: &Options) -> Result<(), String> {
    if o.rx_depth == 0 {
        return Err("-r/--rx-depth: 0 receives cannot take a message (at least 1)".into());
    }
    let client = o.server_name.is_some();
    let page_size = rustix::param::page_size();
    let mtu = Mtu::from_bytes(o.mtu).ok_or_else(|| format!("-m {}: not an IB MTU", o.mtu))?;
    let ctx = match &o.ib_dev {
        Some(name) => Context::open(name),
        None => Context::open_first(),
    }
    .map_err(|e| e.to_string())?;
    let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;

    // One buffer, the source of every send and the target of every receive,
    // filled as the real tool fills it. A region needs at least one byte.
    let mr = pd
        .reg_mr(u64::from(o.size).max(1), Access::LOCAL_WRITE)
        .map_err(|e| format!("Couldn't register MR: {e}"))?;
    mr.fill(0, mr.len(), wire::INITIAL_FILL);

    // The CQ, with room for what the device grants the QP (cqd admits the
    // granted depths: a device that rounds `rx_depth` up would not fit in
    // the real tool's `rx_depth + 1`).
    let cqe = cq_depth_for(&[1, o.rx_depth], 2, ctx.attr().max_cqe).map_err(|need| {
        format!(
            "Couldn't create CQ: {need} entries needed, the device allows {}",
            ctx.attr().max_cqe
        )
    })?;
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("rc_pingpong", cqe, CqSpec::default(), CqOptions::default())
        .map_err(|e| format!("Couldn't create CQ: {e}"))?;

    // The handler first: the QP is made owned by it (its asynchronous
    // events go to its `on_async`), and it posts on the QP.
    let link = Arc::new(OnceLock::new());
    let (tx, outcome) = mpsc::channel();
    let reg = handle
        .register(PingPong {
            link: Arc::clone(&link),
            pattern: Pattern::new(client, o.iters, o.rx_depth),
            over: false,
            outcome: tx,
        })
        .map_err(|e| format!("Couldn't register the handler: {e}"))?;
    let cap = QpCap {
        max_send_wr: 1,
        max_recv_wr: o.rx_depth,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let qp = pd
        .create_qp(&QpInit::new(&cq, &cq, cap).owned_by(&reg))
        .map_err(|e| format!("Couldn't create QP: {e}"))?;
    let inline = qp.cap().max_inline_data >= o.size;

    let port = ctx.port(o.ib_port).map_err(|e| e.to_string())?;
    if port.lid == 0 && port.link_layer != LINK_LAYER_ETHERNET {
        return Err("Couldn't get local LID".into());
    }
    let gid = match o.gid_index() {
        Some(i) => {
            let i = u8::try_from(i)
                .map_err(|_| format!("-g {i}: beyond the GID table (at most 255)"))?;
            ctx.gid(o.ib_port, i)
                .map_err(|e| format!("can't read sgid of index {i}: {e}"))?
        }
        None => [0; 16],
    };
    let psn = random_psn();
    let local = WireDest {
        lid: port.lid,
        qpn: qp.qpn(),
        psn,
        gid,
    };
    println!("{}", wire::address_line(true, &local));

    let link = {
        let l = Link {
            qp,
            mr,
            reg,
            size: o.size,
            inline,
        };
        if link.set(l).is_err() {
            return Err("the handler's link was set twice".into());
        }
        link
    };
    let Some(l) = link.get() else {
        return Err("the handler's link is not set".into());
    };

    // The poller, before the exchange (the real tool arms its CQ then too):
    // the server's first message may follow the exchange at once.
    let mode = if o.events {
        PollMode::Event
    } else {
        PollMode::Busy
    };
    let poller = PollerBuilder::new("rc_pingpong", NoSink)
        .mode(mode)
        // Polling mode spins as the real tool does: an idle Busy poller
        // would nap after 100 µs, and on a loaded machine each nap would
        // add its timer slack to a round trip.
        .busy_naps(false)
        .cq(unbound)
        .spawn()
        .map_err(|e| e.to_string())?;

    // To RTR and RTS as `pp_connect_ctx` does, then the receives.
    let connect = |remote: &WireDest| -> Result<(), String> {
        let grh = remote.needs_grh();
        let endpoint = Endpoint {
            lid: remote.lid,
            gid: if grh { remote.gid } else { [0; 16] },
            qpn: remote.qpn,
            psn: remote.psn,
            mtu,
        };
        let opts = ConnectOptions {
            port: o.ib_port,
            gid_index: grh.then(|| u8::try_from(o.gid_idx.max(0)).unwrap_or(0)),
            mtu: Some(mtu),
            access: Access(0),
            sl: o.sl,
            ..ConnectOptions::default()
        };
        l.qp.connect(&endpoint, psn, &opts)
            .map_err(|e| format!("Failed to modify QP: {e}"))?;
        l.post_recvs(o.rx_depth)
    };
    let exchanged = match &o.server_name {
        Some(host) => wire::client_exchange(host, o.port, &local).and_then(|(_, remote)| {
            connect(&remote).map_err(std::io::Error::other)?;
            Ok(remote)
        }),
        None => wire::server_exchange(o.port, &local, |remote| {
            connect(remote).map_err(std::io::Error::other)
        })
        .map(|(_, remote)| remote),
    };
    let remote = match exchanged {
        Ok(r) => r,
        Err(e) => return Err(stop(poller, l, Err(e.to_string()))),
    };
    println!("{}", wire::address_line(false, &remote));

    // The client fills the page starts for the server's check, posts the
    // first send and starts its clock; the server starts its clock now.
    if client {
        if o.chk {
            let mut buf = vec![0; o.size as usize];
            l.mr.read(0, &mut buf);
            wire::fill_check_pattern(&mut buf, page_size);
            l.mr.write(0, &buf);
        }
        if let Err(e) = l.post_send() {
            return Err(stop(poller, l, Err(e)));
        }
    }
    let start = Instant::now();
    let end = if o.iters == 0 {
        Ok(Instant::now())
    } else {
        match outcome.recv() {
            Ok(Outcome::Done(end)) => Ok(end),
            Ok(Outcome::Failed(e)) => Err(e),
            Err(_) => Err("the poller thread ended before the run did".into()),
        }
    };
    let end = match end {
        Ok(end) => end,
        Err(e) => return Err(stop(poller, l, Err(e))),
    };
    let usec = end.saturating_duration_since(start).as_micros();
    println!(
        "{}",
        wire::summary(o.size, o.iters, u64::try_from(usec).unwrap_or(u64::MAX))
    );
    if o.chk {
        let buf = l.mr.to_vec();
        for page in wire::check_pattern(&buf[..o.size as usize], page_size) {
            println!("invalid data in page {page}");
        }
    }
    let stopped = stop(poller, l, Ok(()));
    if stopped.is_empty() {
        Ok(())
    } else {
        Err(stopped)
    }
}

/// Ends the run: the QP to the error state (every receive still posted
/// flushes), then the poller's stop, which collects those flushes before
/// it reports. Returns `result`'s error, or what went wrong stopping (empty
/// if nothing did).
fn stop(poller: cqd::core::PollerThread, l: &Link, result: Result<(), String>) -> String {
    let mut problems: Vec<String> = result.err().into_iter().collect();
    let report = poller.stop_with(|| {
        if let Err(e) = l.qp.to_error() {
            problems.push(format!("Couldn't move the QP to the error state: {e}"));
        }
    });
    match report {
        Ok(r) => {
            problems.extend(r.errors);
            if !r.accounts.is_balanced() {
                problems.push(format!(
                    "requests still outstanding after the stop: {:?}",
                    r.accounts.missing().collect::<Vec<_>>()
                ));
            }
        }
        Err(e) => problems.push(e.to_string()),
    }
    problems.join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both sides' patterns against each other, messages delivered in
    /// order; each side sends and receives exactly `iters` messages and
    /// keeps its receive queue between 1 and `rx_depth`.
    fn run_pair(iters: u32, rx_depth: u32) -> (Pattern, Pattern, u32) {
        let mut sides = [
            Pattern::new(true, iters, rx_depth),
            Pattern::new(false, iters, rx_depth),
        ];
        // Completions awaiting each side, in order: (side, wr_id).
        let mut queue = std::collections::VecDeque::new();
        // The client's first send: its completion, the server's receive.
        queue.push_back((0usize, SEND_WRID));
        queue.push_back((1usize, RECV_WRID));
        let mut refills = 0;
        let mut steps = 0;
        while let Some((side, wr_id)) = queue.pop_front() {
            steps += 1;
            assert!(steps < 10 * (iters + 2), "no end");
            let step = sides[side].completed(wr_id).unwrap();
            assert!(sides[side].routs >= 1 && sides[side].routs <= rx_depth);
            if step.refill > 0 {
                refills += 1;
            }
            if step.send {
                queue.push_back((side, SEND_WRID));
                queue.push_back((1 - side, RECV_WRID));
            }
        }
        let [c, s] = sides;
        (c, s, refills)
    }

    #[test]
    fn each_side_sends_and_receives_iters() {
        for (iters, rx_depth) in [(1, 1), (5, 2), (1000, 500), (7, 3), (5000, 500)] {
            let (c, s, _) = run_pair(iters, rx_depth);
            for p in [&c, &s] {
                assert!(p.is_done(), "{iters} {rx_depth}: {p:?}");
                assert_eq!((p.scnt, p.rcnt), (iters, iters));
            }
        }
    }

    #[test]
    fn receives_are_refilled_when_one_is_left() {
        let mut p = Pattern::new(false, 10, 4);
        assert_eq!(p.completed(RECV_WRID).unwrap().refill, 0);
        assert_eq!(p.completed(SEND_WRID).unwrap(), Step::default());
        assert_eq!(p.completed(RECV_WRID).unwrap().refill, 0);
        p.completed(SEND_WRID).unwrap();
        // Down to 1: back to 4.
        assert_eq!(p.completed(RECV_WRID).unwrap().refill, 3);
        assert_eq!(p.routs, 4);
        let (_, _, refills) = run_pair(1000, 500);
        assert_eq!(refills, 4);
    }

    #[test]
    fn a_side_sends_after_its_send_completed_and_a_message_arrived() {
        let mut s = Pattern::new(false, 3, 8);
        let step = s.completed(RECV_WRID).unwrap();
        assert!(step.send && !step.done);
        // The answer's send completes: nothing to send until the next
        // message.
        assert!(!s.completed(SEND_WRID).unwrap().send);
        let mut c = Pattern::new(true, 3, 8);
        // The answer may come before the first send's completion.
        assert!(!c.completed(RECV_WRID).unwrap().send);
        assert!(c.completed(SEND_WRID).unwrap().send);
    }

    #[test]
    fn the_last_completion_ends_the_run() {
        let mut c = Pattern::new(true, 1, 8);
        assert!(!c.completed(SEND_WRID).unwrap().done);
        let step = c.completed(RECV_WRID).unwrap();
        assert_eq!(
            step,
            Step {
                refill: 0,
                send: false,
                done: true
            }
        );
        // With 0 iterations the loop never runs.
        assert!(Pattern::new(true, 0, 8).is_done());
    }

    #[test]
    fn device_nonsense_is_an_error_not_a_panic() {
        let mut p = Pattern::new(false, 10, 1);
        assert_eq!(
            p.completed(3).unwrap_err(),
            "Completion for unknown wr_id 3"
        );
        p.routs = 0;
        assert!(p.completed(RECV_WRID).is_err());
    }

    #[test]
    fn psn_is_24_bits() {
        for _ in 0..100 {
            assert!(random_psn() <= 0xff_ffff);
        }
    }

    /// The whole exchange, our server against our client, over loopback,
    /// with made-up addresses, the server connecting before it answers.
    #[test]
    fn exchange_over_loopback() {
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server_dest = WireDest {
            lid: 1,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: [0; 16],
        };
        let client_dest = WireDest {
            lid: 1,
            qpn: 0x12,
            psn: random_psn(),
            gid: [0; 16],
        };
        let server = std::thread::spawn(move || {
            let mut connected = None;
            let (_, remote) = wire::server_accept_exchange(listener, &server_dest, |r| {
                connected = Some(*r);
                Ok(())
            })
            .unwrap();
            assert_eq!(connected, Some(remote));
            remote
        });
        let (_, remote) = wire::client_exchange("127.0.0.1", port, &client_dest).unwrap();
        assert_eq!(remote, server_dest);
        assert_eq!(server.join().unwrap(), client_dest);
    }
}
