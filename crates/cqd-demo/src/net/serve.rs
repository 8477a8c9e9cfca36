//! serve's half of the protocol in `crate::net`: one handshake, H1 to H5
//! ([`handshake`], on its own thread under A1–A3 of `admit`), then the
//! session, H6 and H7 ([`serve_on`]).

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::admit::{self, Claim, TicketState};
use super::gate::{Bound, Gate};
use super::{escaped, judge_hello, net, Limits, Msg, Wire, VERSION};
use crate::auth::{self, Direction, Secret, SessionKey};
use crate::backend::{Link, Node};
use crate::config::{CmKind, Config};
use crate::report::{self, ServeReport, Verdict};
use crate::run::ServerSide;
use crate::server::SrvConn;
use crate::topo::{self, Side};
use crate::DemoError;

/// How long a refusal may take to send.
const REFUSE_GRACE: Duration = Duration::from_secs(1);

/// A load's endpoint on nodes `N`.
type Endpoint<N> = <<N as Node>::Link as Link>::Endpoint;

/// What every handshake of a server needs.
pub(crate) struct Offer<'a, N: Node> {
    pub(crate) side: &'a Mutex<ServerSide<N>>,
    pub(crate) claim: &'a Claim,
    pub(crate) gate: Option<&'a Gate>,
    pub(crate) secret: Option<&'a Secret>,
    pub(crate) limits: Limits,
    pub(crate) blocks: u64,
    pub(crate) timeout: Duration,
}

/// A handshake that established the session (A3).
pub(crate) struct Established {
    addr: SocketAddr,
    wire: Wire,
    /// With `--cm rdmacm`: the session's place at the gate, which rejects
    /// any later request for its connections.
    bound: Option<Bound>,
}

/// Why a handshake ends without a session, and whether to tell the load.
struct Refusal {
    reason: String,
    tell: bool,
}

fn told(reason: impl ToString) -> Refusal {
    Refusal {
        reason: reason.to_string(),
        tell: true,
    }
}

/// One handshake on `stream` from `addr`, H1 to H5, under one deadline:
/// the session it establishes, if it does; a refusal is answered (A2) and
/// printed.
pub(crate) fn handshake<N: Node>(
    offer: &Offer<'_, N>,
    stream: TcpStream,
    addr: SocketAddr,
    ticket: &TicketState,
) -> Option<Established> {
    let until = Instant::now() + offer.timeout;
    let mut wire = match Wire::new(stream, format!("load {addr}")) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("cqd-demo serve: refused load {addr}: {e}");
            return None;
        }
    };
    wire.set_deadline(Some(until));
    match attempt(offer, &mut wire, addr, until, ticket) {
        Ok(bound) => Some(Established { addr, wire, bound }),
        Err(Refusal { reason, tell }) => {
            let reason = ticket.ended().unwrap_or(reason);
            if tell {
                // The deadline may have passed: the refusal has a moment
                // of its own.
                wire.set_deadline(Some(Instant::now() + REFUSE_GRACE));
                wire.refuse(&reason);
            }
            tracing::warn!(peer = %addr, "handshake refused: {reason}");
            eprintln!("cqd-demo serve: refused load {addr}: {reason}");
            wire.shutdown();
            None
        }
    }
}

/// H1 to H5: the session's gate binding (rdmacm) once its last QP is
/// connected.
fn attempt<N: Node>(
    offer: &Offer<'_, N>,
    wire: &mut Wire,
    addr: SocketAddr,
    until: Instant,
    ticket: &TicketState,
) -> Result<Option<Bound>, Refusal> {
    // H1.
    let hello = wire.recv::<Endpoint<N>>().map_err(told)?;
    let (connections, l) = judge_hello(hello, &offer.limits).map_err(told)?;
    // H2, and the session's key (auth step 5).
    let s = auth::nonce().map_err(told)?;
    let (key, proof, token) = match offer.secret {
        Some(secret) => {
            wire.send(&Msg::<()>::Challenge {
                nonce: auth::nonce_hex(&s),
            })
            .map_err(told)?;
            match wire.recv::<Endpoint<N>>() {
                Ok(Msg::Answer { mac }) if secret.check_answer(&s, &l, &mac) => {}
                Ok(Msg::Answer { .. }) => {
                    return Err(told(
                        "wrong answer to the challenge: the load's --secret-file differs from \
                         this server's",
                    ))
                }
                Ok(other) => {
                    return Err(told(format!(
                        "this server requires a shared secret (--secret-file): expected answer, \
                         got {}",
                        other.name()
                    )))
                }
                Err(e) => return Err(told(format!("no answer to the challenge: {e}"))),
            }
            let key = SessionKey::with_secret(secret, &l, &s);
            (key, Some(secret.proof(&l, &s)), None)
        }
        None => (
            SessionKey::from_token(&l, &s),
            None,
            Some(auth::nonce_hex(&s)),
        ),
    };
    // H5 with rdmacm: the gate passes this handshake's requests on from
    // the moment the load can make them.
    let bound = offer
        .gate
        .map(|g| g.bind(key.clone(), addr.ip(), connections));
    // H3.
    let limits = &offer.limits;
    wire.send(&Msg::<()>::Welcome {
        version: VERSION,
        block_size: limits.block_size,
        blocks: offer.blocks,
        max_qd: limits.depth,
        max_connections: limits.connections,
        proof,
        token,
    })
    .map_err(told)?;
    wire.seal(key, Direction::ServerToLoad);
    // H4: a sealed join, or the load's own (unsealed) refusal.
    match wire.recv_unopened::<Endpoint<N>>().map_err(told)? {
        Msg::Refused { reason } => {
            return Err(Refusal {
                reason: format!("the load refused this server: {}", escaped(&reason)),
                tell: false,
            })
        }
        m => match wire.open(m).map_err(told)? {
            Msg::Join => {}
            other => return Err(told(format!("expected join, got {}", other.name()))),
        },
    }
    // H5.
    match bound {
        None => {
            connect_tcp(offer, wire, connections, until, ticket)?;
            Ok(None)
        }
        Some(b) => {
            connect_cm(offer, connections, until, ticket, &b)?;
            Ok(Some(b))
        }
    }
}

/// H5 with `--cm tcp`: every `connect`, the claim, then every QP.
fn connect_tcp<N: Node>(
    offer: &Offer<'_, N>,
    wire: &mut Wire,
    connections: u32,
    until: Instant,
    ticket: &TicketState,
) -> Result<(), Refusal> {
    let mut endpoints = Vec::with_capacity(connections as usize);
    for want in 0..connections {
        match wire.recv::<Endpoint<N>>().map_err(told)? {
            Msg::Connect { conn, endpoint } if conn == want => endpoints.push(endpoint),
            Msg::Connect { conn, .. } => {
                return Err(told(format!(
                    "expected connect for connection {want}, got connect for connection {conn}"
                )))
            }
            other => {
                return Err(told(format!(
                    "expected connect for connection {want}, got {}",
                    other.name()
                )))
            }
        }
    }
    let claimed = offer.claim.take(until, ticket).map_err(told)?;
    ticket.hold();
    let mut side = offer.side.lock();
    let mut made = Vec::new();
    match make_tcp(&mut side, wire, &endpoints, &mut made) {
        Ok(()) => {
            side.hold_session(made);
            drop(side);
            claimed.establish();
            Ok(())
        }
        Err(e) => {
            give_back(&mut side, made);
            Err(told(e))
        }
    }
}

/// Makes, connects and answers each connection of `endpoints` on server 0
/// of `side`; each QP made is in `made`, whatever happens.
fn make_tcp<N: Node>(
    side: &mut ServerSide<N>,
    wire: &mut Wire,
    endpoints: &[Endpoint<N>],
    made: &mut Vec<Arc<SrvConn<N>>>,
) -> Result<(), DemoError> {
    for (conn, endpoint) in (0u32..).zip(endpoints) {
        let c = side.accept(0)?;
        made.push(Arc::clone(&c));
        c.link().connect(endpoint)?;
        wire.send(&Msg::Accepted {
            conn,
            endpoint: c.link().endpoint()?,
        })?;
    }
    Ok(())
}

/// H5 with `--cm rdmacm`: each request the gate passes on; the first
/// takes the claim.
fn connect_cm<N: Node>(
    offer: &Offer<'_, N>,
    connections: u32,
    until: Instant,
    ticket: &TicketState,
    bound: &Bound,
) -> Result<(), Refusal> {
    let mut claimed = None;
    let mut made = Vec::new();
    for want in 0..connections {
        let accepted = bound.next(until, ticket).and_then(|(conn, req)| {
            if conn != want {
                return Err(net(format!(
                    "rdma_cm request for connection {conn}, expected {want}"
                )));
            }
            if claimed.is_none() {
                claimed = Some(offer.claim.take(until, ticket).map_err(net)?);
                ticket.hold();
            }
            let mut side = offer.side.lock();
            let c = side.accept(0)?;
            made.push(Arc::clone(&c));
            c.link().cm_accept(req)?;
            Ok(())
        });
        if let Err(e) = accepted {
            give_back(&mut offer.side.lock(), made);
            return Err(told(e));
        }
    }
    if let Some(c) = claimed {
        c.establish();
    }
    Ok(())
}

/// A3: gives back the QPs of a handshake that failed holding the claim.
fn give_back<N: Node>(side: &mut ServerSide<N>, made: Vec<Arc<SrvConn<N>>>) {
    if made.is_empty() {
        return;
    }
    for note in side.close(0, made) {
        tracing::warn!("{note}");
        eprintln!("cqd-demo serve: {note}");
    }
}

/// Serves one load session on nodes from `open`: starts the server and
/// its pollers, admits handshakes on `listener` until one establishes the
/// session (A1–A4), waits for its `done` (or its disappearance), stops
/// and reports. `ready` is called with the bound address once it listens.
///
/// # Errors
/// Setup failures, no session before `cfg.accept_timeout`. A load that
/// went away mid-run is not an error: the report's session verdict fails.
pub fn serve_on<N: Node>(
    cfg: &Config,
    listener: TcpListener,
    open: impl Fn(&str) -> Result<N, DemoError>,
    ready: impl FnOnce(SocketAddr),
) -> Result<ServeReport, DemoError> {
    let layout = topo::resolve_side(
        topo::load(cfg.topology.as_deref())?,
        1,
        cfg.mode,
        cfg.workers,
        &|_| crate::run::server_spec(cfg, cfg.connections).pool_sizes(),
        Side::Server,
    )?;
    let started = Instant::now();
    let side = ServerSide::start(
        cfg,
        layout.server_pollers,
        layout.server_pools,
        layout.pool,
        |_| cfg.connections,
        &open,
    )?;
    let local = match listener.local_addr() {
        Ok(a) => a,
        Err(e) => {
            let _ = side.stop();
            return Err(net(format!("listening socket: {e}")));
        }
    };
    // --cm rdmacm: the queue pairs' listener, on the same address, behind
    // the gate.
    let gate = match cfg.cm {
        CmKind::Rdmacm => {
            match crate::backend::cm::listen(local)
                .map_err(DemoError::from)
                .and_then(Gate::start)
            {
                Ok(g) => Some(g),
                Err(e) => {
                    let _ = side.stop();
                    return Err(e);
                }
            }
        }
        CmKind::Tcp => None,
    };
    let Some((spec, blocks)) = side.server(0).map(|s| (s.spec(), s.blocks())) else {
        let _ = side.stop();
        return Err(DemoError::Setup("no server".into()));
    };
    ready(local);
    let side = Mutex::new(side);
    let claim = Claim::new();
    let offer = Offer {
        side: &side,
        claim: &claim,
        gate: gate.as_ref(),
        secret: cfg.secret.as_ref(),
        limits: Limits {
            block_size: spec.block_size,
            depth: spec.depth,
            connections: spec.connections,
            rdmacm: gate.is_some(),
        },
        blocks,
        timeout: cfg.handshake_timeout,
    };
    let until = cfg.accept_timeout.map(|t| Instant::now() + t);
    let established = admit::run(&listener, until, &offer);
    // A4: one session per process; a second load is refused at once
    // rather than left waiting for a handshake.
    drop(listener);
    let mut side = side.into_inner();
    let Established {
        addr: peer,
        mut wire,
        bound,
    } = match established {
        Ok(s) => s,
        Err(e) => {
            // Nobody came: stop the threads before saying so.
            let _ = side.stop();
            return Err(e);
        }
    };
    eprintln!("cqd-demo serve: load {peer} connected; serving");
    // H6: the session runs until the load says done or goes away.
    wire.set_deadline(None);
    let outcome = session::<N>(&mut wire, peer, &mut side);
    let session_verdict = match &outcome {
        Ok(()) => Verdict {
            passed: true,
            detail: format!("load {peer} ran and said done"),
        },
        Err(why) => {
            eprintln!("cqd-demo serve: {why}");
            Verdict {
                passed: false,
                detail: why.clone(),
            }
        }
    };
    let stopped = side.stop();
    drop(bound);
    let rejected = gate.map(Gate::stop);
    let wall = started.elapsed();
    let server = stopped
        .state
        .first()
        .ok_or_else(|| DemoError::Setup("the server vanished".into()))?;
    let report = report::build_serve(report::ServeInputs {
        cfg,
        peer: Some(peer.to_string()),
        server,
        system: stopped.system,
        names: stopped.names,
        roles: stopped.roles,
        wall,
        session: session_verdict,
        topology_toml: layout.toml,
        notes: stopped.notes,
        cm_rejected: rejected,
    });
    // H7.
    if outcome.is_ok() {
        let bye = Msg::<serde_json::Value>::Bye {
            passed: report.passed(),
            detail: report.accounts_verdict.detail.clone(),
        };
        if let Err(e) = wire.send(&bye) {
            tracing::warn!("bye: {e}");
        }
    }
    Ok(report)
}

/// H6 and H7 on the server: each `reconnect` (`--churn`), then the load's
/// `done`, or why the session ended without it (a message refused by S2,
/// or a reconnect that failed, is answered, S3).
fn session<N: Node>(
    wire: &mut Wire,
    peer: SocketAddr,
    side: &mut ServerSide<N>,
) -> Result<(), String> {
    loop {
        let m = wire
            .recv_unopened::<Endpoint<N>>()
            .map_err(|e| format!("the load went away mid-session: {e}"))?;
        let why = match wire.open(m) {
            Ok(Msg::Done) => return Ok(()),
            Ok(Msg::Reconnect { conn, endpoint }) => match side.reconnect(conn, &endpoint) {
                Ok(ours) => {
                    wire.send(&Msg::Reconnected {
                        conn,
                        endpoint: ours,
                    })
                    .map_err(|e| format!("the load went away mid-session: {e}"))?;
                    continue;
                }
                Err(e) => format!("reconnect of connection {conn}: {e}"),
            },
            Ok(other) => format!("load {peer} sent {} where done was expected", other.name()),
            Err(e) => format!("a control message from the load was refused: {e}"),
        };
        wire.refuse(&why);
        return Err(why);
    }
}
