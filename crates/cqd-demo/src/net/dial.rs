//! The load's half of the protocol in `crate::net`: each server's
//! handshake (H1–H5, [`join`]), then the run (H6) and its end (H7,
//! [`load_on`]).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::control::Incoming;
use super::{escaped, net, reach, Msg, Wire, BYE_TIMEOUT, PROTOCOL, VERSION};
use crate::auth::{self, Direction, SessionKey};
use crate::backend::{Link, Node};
use crate::config::{check_blocks, CmKind, Config};
use crate::load::LoadConn;
use crate::report::{self, PeerVerdict, Report};
use crate::run::{ChurnStep, LoadSide};
use crate::topo::{self, Side};
use crate::DemoError;

/// What a server's handshake agreed.
struct Agreed {
    blocks: u64,
    key: SessionKey,
}

/// The load's half of the handshake, H1 to H4 (hello; with a secret, the
/// challenge's answer and the server's proof; welcome; join), on `wire`,
/// for a client of its own (the hostile-client tests): the server's block
/// count. The wire is sealed from then on, and its deadline
/// (`cfg.handshake_timeout` from now) stays set for H5: send one `connect`
/// per connection, every one before reading any `accepted`, then clear it
/// ([`Wire::set_deadline`]).
///
/// # Errors
/// The server refused, or did not prove the secret, or answered out of
/// turn, or not before the deadline.
pub fn join<E: DeserializeOwned + Serialize>(
    wire: &mut Wire,
    cfg: &Config,
    connections: u32,
) -> Result<u64, DemoError> {
    hello::<E>(wire, cfg, connections).map(|a| a.blocks)
}

/// H1 to H4 with one server.
fn hello<E: DeserializeOwned + Serialize>(
    wire: &mut Wire,
    cfg: &Config,
    connections: u32,
) -> Result<Agreed, DemoError> {
    wire.set_deadline(Some(Instant::now() + cfg.handshake_timeout));
    let mine = auth::nonce()?;
    wire.send(&Msg::<E>::Hello {
        protocol: PROTOCOL.into(),
        version: VERSION,
        block_size: cfg.block_size,
        qd: cfg.qd,
        connections,
        rdmacm: cfg.cm == CmKind::Rdmacm,
        nonce: auth::nonce_hex(&mine),
    })?;
    let mut theirs = None;
    let mut reply = wire.recv::<E>()?;
    if let Msg::Challenge { nonce } = &reply {
        let Some(secret) = &cfg.secret else {
            return Err(net(format!(
                "{} requires a shared secret: give this load the server's --secret-file",
                wire.peer()
            )));
        };
        let s = auth::parse_nonce(nonce)
            .map_err(|e| net(format!("{}: challenge: {e}", wire.peer())))?;
        wire.send(&Msg::<E>::Answer {
            mac: secret.answer(&s, &mine),
        })?;
        theirs = Some(s);
        reply = wire.recv::<E>()?;
    }
    let (version, block_size, blocks, proof, token) = match reply {
        Msg::Welcome {
            version,
            block_size,
            blocks,
            proof,
            token,
            ..
        } => (version, block_size, blocks, proof, token),
        Msg::Refused { reason } => {
            return Err(net(format!(
                "{} refused the load: {}",
                wire.peer(),
                escaped(&reason)
            )))
        }
        other => {
            return Err(net(format!(
                "{}: expected welcome, got {}",
                wire.peer(),
                other.name()
            )))
        }
    };
    // The load's refusal of a welcome is not sealed: it does not trust
    // this server (H4).
    let refuse = |wire: &mut Wire, reason: String| {
        let _ = wire.send_unsealed(&Msg::<E>::Refused {
            reason: reason.clone(),
        });
        Err(net(format!("{}: {reason}", wire.peer())))
    };
    // A load with a secret joins only a server that proves it knows it
    // (and so challenged this load).
    let key = match (&cfg.secret, theirs) {
        (Some(secret), Some(s)) if proof.is_some_and(|p| secret.check_proof(&mine, &s, &p)) => {
            SessionKey::with_secret(secret, &mine, &s)
        }
        (Some(_), _) => {
            return refuse(
                wire,
                "the server did not prove it knows the shared secret (--secret-file): not \
                 joining it"
                    .into(),
            )
        }
        (None, _) => match token.as_deref().map(auth::parse_nonce) {
            Some(Ok(s)) => SessionKey::from_token(&mine, &s),
            Some(Err(e)) => return refuse(wire, format!("welcome: its token: {e}")),
            None => return refuse(wire, "welcome without a token".into()),
        },
    };
    // Nothing read from a socket is trusted: the device the server
    // announces must fit what this load can verify.
    let bytes = blocks.checked_mul(u64::from(block_size));
    if bytes.is_none_or(|b| b > crate::config::MAX_DEVICE) {
        return refuse(
            wire,
            format!(
                "welcome announces {blocks} blocks of {block_size} bytes; at most {} bytes per \
                 server",
                crate::config::MAX_DEVICE
            ),
        );
    }
    if version != VERSION || block_size != cfg.block_size || blocks == 0 {
        return refuse(
            wire,
            format!(
                "welcome with version {version}, block size {block_size}, {blocks} blocks; this \
                 load speaks version {VERSION} with {}-byte blocks",
                cfg.block_size
            ),
        );
    }
    wire.seal(key.clone(), Direction::LoadToServer);
    wire.send(&Msg::<E>::Join)?;
    Ok(Agreed { blocks, key })
}

/// Runs the load against `cfg.server_addrs`: reaches every server (a
/// missing one fails fast), opens the device (`device` gives the node
/// maker; a missing device fails before any handshake, so the servers go
/// on waiting), the handshakes, the connections, the load and read-back,
/// `done`, each server's `bye`, the stop and the report of this side.
///
/// # Errors
/// A server not there or refusing, no device, setup failures. A server
/// that dies mid-run is not an error: its requests fail and the report
/// says so.
pub fn load_on<N: Node, F: Fn(&str) -> Result<N, DemoError>>(
    cfg: &Config,
    device: impl FnOnce() -> Result<F, DemoError>,
) -> Result<Report, DemoError> {
    let setup_started = Instant::now();
    let servers = cfg.server_addrs.len() as u32;
    if servers == 0 || servers != cfg.servers {
        return Err(DemoError::Config("load needs its --server list".into()));
    }
    // Reach every server first: a missing one fails fast, before any
    // device or thread.
    let mut wires = Vec::new();
    let mut peers = Vec::new();
    for (s, addr) in cfg.server_addrs.iter().enumerate() {
        let stream = reach(addr)?;
        peers.push(
            stream
                .peer_addr()
                .map_err(|e| net(format!("server {s} ({addr}): {e}")))?,
        );
        wires.push(Wire::new(stream, format!("server {s} ({addr})"))?);
    }
    let open = device()?;
    let per_server = |s: u32| (0..cfg.connections).filter(|c| c % servers == s).count() as u32;
    let mut blocks = u64::MAX;
    let mut keys = Vec::new();
    for (s, wire) in wires.iter_mut().enumerate() {
        let agreed = hello::<<N::Link as Link>::Endpoint>(wire, cfg, per_server(s as u32))?;
        blocks = blocks.min(agreed.blocks);
        keys.push(agreed.key);
    }
    let mut cfg = cfg.clone();
    cfg.blocks_per_server = blocks;
    cfg.device_size = blocks * u64::from(cfg.block_size);
    check_blocks(blocks, servers, cfg.connections, cfg.qd, cfg.block_size)?;
    let cfg = &cfg;
    let layout = topo::resolve_side(
        topo::load(cfg.topology.as_deref())?,
        servers,
        cfg.mode,
        cfg.workers,
        &|_| crate::run::server_spec(cfg, cfg.connections).pool_sizes(),
        Side::Load,
    )?;
    let mode_name = cfg
        .mode
        .map_or_else(|| "topology".to_string(), |m| m.name().to_string());
    let threads_started = Instant::now();
    let mut side = LoadSide::start(cfg, layout.load_pollers, layout.load_cqs, &open)?;
    let mut by_server: Vec<Vec<Arc<LoadConn<N>>>> = vec![Vec::new(); servers as usize];
    let joined = connect_all(cfg, &mut side, &mut wires, &peers, &keys, &mut by_server);
    if let Err(e) = joined {
        let _ = side.stop();
        return Err(e);
    }
    tracing::info!(setup = ?setup_started.elapsed(), "connected to every server");
    let topology = (layout.toml, layout.warnings);
    run_and_report(
        cfg,
        side,
        wires,
        by_server,
        topology,
        mode_name,
        threads_started,
    )
}

/// H5 with every server: connection `c` to server `c % S`, as that
/// server's next.
fn connect_all<N: Node>(
    cfg: &Config,
    side: &mut LoadSide<N>,
    wires: &mut [Wire],
    peers: &[SocketAddr],
    keys: &[SessionKey],
    by_server: &mut [Vec<Arc<LoadConn<N>>>],
) -> Result<(), DemoError> {
    let servers = wires.len() as u32;
    let mut next = vec![0u32; servers as usize];
    let mut sent = Vec::new();
    for c in 0..cfg.connections {
        let s = (c % servers) as usize;
        let conn = side.connect(s as u32)?;
        let n = next[s];
        next[s] += 1;
        if cfg.cm == CmKind::Rdmacm {
            // The server's rdma_cm listener is on its TCP address.
            conn.link().cm_connect(peers[s], n, &keys[s].cm_mac(n))?;
            conn.post_receives()?;
            by_server[s].push(conn);
            continue;
        }
        wires[s].send(&Msg::Connect {
            conn: n,
            endpoint: conn.link().endpoint()?,
        })?;
        sent.push((s, n, conn));
    }
    // Every `connect` is out: now each server's answers, in order.
    for (s, n, conn) in sent {
        let wire = &mut wires[s];
        let theirs = match wire.recv::<<N::Link as Link>::Endpoint>()? {
            Msg::Accepted { conn, endpoint } if conn == n => endpoint,
            Msg::Refused { reason } => {
                return Err(net(format!(
                    "{} refused connection {n}: {}",
                    wire.peer(),
                    escaped(&reason)
                )))
            }
            other => {
                return Err(net(format!(
                    "{}: expected accepted for connection {n}, got {}",
                    wire.peer(),
                    other.name()
                )))
            }
        };
        conn.link().connect(&theirs)?;
        conn.post_receives()?;
        by_server[s].push(conn);
    }
    Ok(())
}

/// H6 and H7: one watcher per server, the run, `done`, the servers'
/// `bye`, the stop and the report.
fn run_and_report<N: Node>(
    cfg: &Config,
    mut side: LoadSide<N>,
    wires: Vec<Wire>,
    by_server: Vec<Vec<Arc<LoadConn<N>>>>,
    (topology_toml, topology_warnings): (String, Vec<String>),
    mode_name: String,
    threads_started: Instant,
) -> Result<Report, DemoError> {
    let servers = wires.len();
    // One watcher per server: EOF before `done` means the server died;
    // its connections are failed at once (their requests with them). It
    // also hands the churn its `reconnected` answers. Each server's
    // connections, by their numbers in its session: the churn takes one
    // out while it closes and replaces it.
    let done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<(usize, Result<(bool, String), String>)>();
    let mut writers = Vec::new();
    let mut answers = Vec::new();
    let mut lists: Vec<Conns<N>> = Vec::new();
    for (s, mut wire) in wires.into_iter().enumerate() {
        let peer = wire.peer().to_string();
        wire.set_deadline(None);
        let (writer, mut reader) = wire.split();
        writers.push((peer.clone(), writer));
        let conns: Conns<N> = Arc::new(parking_lot::Mutex::new(
            by_server[s].iter().cloned().map(Some).collect(),
        ));
        lists.push(Arc::clone(&conns));
        let (answer_tx, answer_rx) = mpsc::channel();
        answers.push(answer_rx);
        let done = Arc::clone(&done);
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("cqd-demo-watch-{s}"))
            .spawn(move || {
                let got = watch::<N>(&mut reader, &peer, &answer_tx);
                if got.is_err() && !done.load(Ordering::Acquire) {
                    let why = format!(
                        "{peer} went away mid-run ({}); its requests in flight fail",
                        got.as_ref().err().map_or("", |e| e.as_str())
                    );
                    eprintln!("cqd-demo load: {why}");
                    for c in conns.lock().iter().flatten() {
                        c.kill(&why);
                    }
                }
                let _ = tx.send((s, got));
            });
        if let Err(e) = spawned {
            let _ = side.stop();
            return Err(DemoError::Setup(format!("watcher thread: {e}")));
        }
    }
    drop(tx);
    drop(by_server);

    // --churn: the oldest connection closes on this side, the server closes
    // and replaces its side (H6 `reconnect`), the new one takes its place.
    let mut order: VecDeque<(usize, u32)> = (0..cfg.connections)
        .map(|c| ((c as usize) % servers, c / servers as u32))
        .collect();
    let mut step = |ls: &mut LoadSide<N>| -> Result<(), String> {
        let (s, n) = order
            .pop_front()
            .ok_or_else(|| "no connection left to close".to_string())?;
        let peer = writers[s].0.clone();
        let old = lists[s]
            .lock()
            .get_mut(n as usize)
            .and_then(Option::take)
            .ok_or_else(|| format!("{peer}: connection {n} is gone"))?;
        let k = old.cq();
        ls.close(old)?;
        let new = ls.connect_on(s as u32, k).map_err(|e| e.to_string())?;
        let endpoint = new.link().endpoint().map_err(|e| e.to_string())?;
        writers[s]
            .1
            .send(&Msg::Reconnect { conn: n, endpoint })
            .map_err(|e| format!("{peer}: reconnect {n}: {e}"))?;
        let theirs = match answers[s].recv_timeout(RECONNECT_TIMEOUT) {
            Ok((c, theirs)) if c == n => theirs,
            Ok((c, _)) => return Err(format!("{peer}: reconnected {c}, asked {n}")),
            Err(_) => {
                return Err(format!(
                    "{peer}: no reconnected for connection {n} within {RECONNECT_TIMEOUT:?}"
                ))
            }
        };
        new.link().connect(&theirs).map_err(|e| e.to_string())?;
        new.post_receives().map_err(|e| e.to_string())?;
        new.kick();
        if let Some(slot) = lists[s].lock().get_mut(n as usize) {
            *slot = Some(new);
        }
        order.push_back((s, n));
        Ok(())
    };
    let churn: Option<&mut ChurnStep<'_, N>> = cfg.churn.map(|_| &mut step as _);
    let driven = side.drive(cfg, churn);
    done.store(true, Ordering::Release);
    // The servers tear down after `done` (with --cm rdmacm their exit
    // flushes our receives through the CM): flushes are no failure now.
    side.closing();
    let mut notes = driven.notes;
    for (peer, w) in &mut writers {
        if let Err(e) = w.send(&Msg::<()>::Done) {
            notes.push(format!("{peer}: could not say done: {e}"));
        }
    }
    let mut peers: Vec<Option<PeerVerdict>> = vec![None; servers];
    let deadline = Instant::now() + BYE_TIMEOUT;
    while peers.iter().any(Option::is_none) {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((s, got)) => {
                let server = cfg.server_addrs[s].clone();
                peers[s] = Some(match got {
                    Ok((passed, detail)) => PeerVerdict {
                        server,
                        passed,
                        detail,
                    },
                    Err(why) => PeerVerdict {
                        server,
                        passed: false,
                        detail: format!("no word from the server: {why}"),
                    },
                });
            }
            Err(_) => break,
        }
    }
    for (_, w) in &writers {
        w.shutdown();
    }
    let peers: Vec<PeerVerdict> = peers
        .into_iter()
        .enumerate()
        .map(|(s, p)| {
            p.unwrap_or_else(|| PeerVerdict {
                server: cfg.server_addrs[s].clone(),
                passed: false,
                detail: format!("no bye within {BYE_TIMEOUT:?}"),
            })
        })
        .collect();
    let stopped = side.stop();
    let wall = threads_started.elapsed();
    notes.extend(stopped.notes);
    let mut report = report::build(report::Inputs {
        churn: driven.churn,
        cfg,
        mode: mode_name,
        load: &stopped.state,
        servers: &[],
        system: stopped.system,
        names: stopped.names,
        roles: stopped.roles,
        load_elapsed: driven.load_elapsed,
        verify_elapsed: driven.verify_elapsed,
        wall,
        topology_toml,
        topology_warnings,
        notes,
    });
    report.peers = peers;
    Ok(report)
}

/// Each server's connections by their numbers in its session (`None`
/// while the churn replaces one).
type Conns<N> = Arc<parking_lot::Mutex<Vec<Option<Arc<LoadConn<N>>>>>>;

/// How long a `reconnect` waits for its answer.
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The watcher's reads: each `reconnected` handed to the churn, then the
/// server's `bye` (sealed, S1–S2), or why there is none.
fn watch<N: Node>(
    reader: &mut Incoming,
    peer: &str,
    answers: &mpsc::Sender<(u32, <N::Link as Link>::Endpoint)>,
) -> Result<(bool, String), String> {
    loop {
        match reader.recv::<<N::Link as Link>::Endpoint>() {
            Ok(Msg::Reconnected { conn, endpoint }) => {
                let _ = answers.send((conn, endpoint));
            }
            Ok(Msg::Bye { passed, detail }) => return Ok((passed, detail)),
            Ok(Msg::Refused { reason }) => {
                return Err(format!("{peer} refused the session: {}", escaped(&reason)))
            }
            Ok(other) => {
                return Err(format!(
                    "{peer} sent {} where bye was expected",
                    other.name()
                ))
            }
            Err(e) => return Err(format!("its control connection: {e}")),
        }
    }
}
