//! `serve` and `load` as separate processes: the TCP handshake that joins
//! them, then each process runs its own half (`run::ServerSide` or
//! `run::LoadSide`) and reports its own side.
//!
//! # The protocol (version 3)
//!
//! One TCP connection per (load, server) pair carries newline-delimited
//! JSON messages ([`Msg`]), each at most [`MAX_LINE`] bytes:
//!
//! 1. load → server `hello` {protocol "cqd-demo", version, block size,
//!    queue depth, connections, a fresh nonce}. A server started with
//!    `--secret-file` answers `challenge` {its own nonce}, and the load
//!    `answer` {the keyed hash of both nonces} ([`crate::auth`]); a wrong
//!    or missing answer is refused with the reason. The server answers
//!    `welcome` {its block count, block size, the deepest queue and most
//!    connections it takes; with a secret, its proof of the secret, which
//!    a load with `--secret-file` requires} or `refused` {reason} (another
//!    version, another block size, a deeper queue or more connections
//!    than it was started for, a wrong answer). The load answers the
//!    welcome with `join`, or with `refused` {reason} (a server that did
//!    not prove the secret, a geometry it cannot verify); until it joins,
//!    the server makes nothing and the session has not begun. The load uses the smallest block count of
//!    its servers (blocks are striped: global block g is block g / S of
//!    server g % S).
//! 2. Per connection: load → `connect` {conn, its QP's endpoint}; the
//!    server makes the QP, connects it, posts its receives and answers
//!    `accepted` {conn, its endpoint}; the load connects and posts its
//!    receives. (verbs: the endpoint is cqd-verbs' `Endpoint`.)
//! 3. The load runs. The TCP connection stays open: it is how each side
//!    learns the other went away (EOF), and the load then fails every
//!    request in flight to that server at once (the QPs' error
//!    completions and the op timeout are the other two ways).
//! 4. load → `done` when its load and read-back are over; the server stops
//!    its half (QPs to error, pollers drain and report), prints its report
//!    and answers `bye` {its accounts verdict}; the load stops its own half
//!    and reports, with each server's word.
//!
//! A `serve` process serves exactly one load session and exits: 0 when
//! the load said `done` and its accounts balanced, 1 otherwise (a load that
//! vanished, unbalanced accounts). A handshake it refuses does not count
//! as a session: it goes on waiting.
//!
//! Nothing read from the socket is trusted: a line too long, not JSON, an
//! unexpected message or an endpoint the device refuses is an error with
//! the peer's address, never a panic.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::auth::{self, Secret};
use crate::backend::cm::CmListener;
use crate::backend::{Link, Node};
use crate::config::{check_blocks, CmKind, Config};
use crate::load::LoadConn;
use crate::report::{self, PeerVerdict, Report, ServeReport, Verdict};
use crate::run::{LoadSide, ServerSide};
use crate::topo::{self, Side};
use crate::DemoError;

/// The protocol's name, first field of `hello`.
pub const PROTOCOL: &str = "cqd-demo";
/// The protocol's version.
pub const VERSION: u32 = 3;
/// The longest message line, in bytes.
pub const MAX_LINE: usize = 64 * 1024;
/// How long a handshake step may wait for the peer.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the load waits for a server to reach (TCP connect).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the load waits for the servers' `bye`.
pub const BYE_TIMEOUT: Duration = Duration::from_secs(60);

/// One message of the handshake (see the module documentation).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case")]
#[serde(bound(serialize = "E: Serialize", deserialize = "E: DeserializeOwned"))]
pub enum Msg<E> {
    /// load → server: who it is and what it wants.
    Hello {
        /// [`PROTOCOL`].
        protocol: String,
        /// [`VERSION`].
        version: u32,
        /// Block size, bytes.
        block_size: u32,
        /// Requests in flight per connection.
        qd: u32,
        /// Connections the load will open to this server.
        connections: u32,
        /// The queue pairs connect through rdma_cm (`--cm rdmacm`) instead
        /// of `connect`/`accepted` messages. Absent: false.
        #[serde(default)]
        rdmacm: bool,
        /// The load's nonce, 64 hex digits ([`crate::auth`]).
        #[serde(default)]
        nonce: String,
    },
    /// server → load: prove you know the secret (`--secret-file`).
    Challenge {
        /// The server's nonce, 64 hex digits.
        nonce: String,
    },
    /// load → server: the keyed hash of both nonces.
    Answer {
        /// 64 hex digits.
        mac: String,
    },
    /// server → load: the geometry.
    Welcome {
        /// [`VERSION`].
        version: u32,
        /// Block size, bytes.
        block_size: u32,
        /// Blocks on the device.
        blocks: u64,
        /// The deepest queue per connection it takes.
        max_qd: u32,
        /// The most connections it takes.
        max_connections: u32,
        /// With a secret: the server's proof that it knows it.
        #[serde(default)]
        proof: Option<String>,
        // No address or key of the server's memory: the server moves every
        // block itself, and its regions and QPs take no remote access
        // (version 1 named its device region, which any client could then
        // write).
    },
    /// server → load: the handshake is refused.
    Refused {
        /// Why, in words.
        reason: String,
    },
    /// load → server: the welcome suits it; the connections follow.
    Join,
    /// load → server: one connection's endpoint.
    Connect {
        /// The connection's number in this session.
        conn: u32,
        /// The load's QP.
        endpoint: E,
    },
    /// server → load: its side of that connection, connected.
    Accepted {
        /// The connection's number.
        conn: u32,
        /// The server's QP.
        endpoint: E,
    },
    /// load → server: the load is over.
    Done,
    /// server → load: its side, stopped.
    Bye {
        /// Its accounts verdict passed.
        passed: bool,
        /// Its verdict's words.
        detail: String,
    },
}

impl<E> Msg<E> {
    fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "hello",
            Msg::Welcome { .. } => "welcome",
            Msg::Refused { .. } => "refused",
            Msg::Challenge { .. } => "challenge",
            Msg::Answer { .. } => "answer",
            Msg::Join => "join",
            Msg::Connect { .. } => "connect",
            Msg::Accepted { .. } => "accepted",
            Msg::Done => "done",
            Msg::Bye { .. } => "bye",
        }
    }
}

/// A message socket: JSON lines to and from one peer.
#[derive(Debug)]
pub struct Wire {
    peer: String,
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

fn net(m: String) -> DemoError {
    DemoError::Net(m)
}

impl Wire {
    /// Wraps a connected stream; `peer` names it in errors.
    ///
    /// # Errors
    /// The socket cannot be cloned.
    pub fn new(stream: TcpStream, peer: String) -> Result<Wire, DemoError> {
        let reader = stream
            .try_clone()
            .map_err(|e| net(format!("{peer}: socket: {e}")))?;
        let _ = stream.set_nodelay(true);
        Ok(Wire {
            peer,
            writer: stream,
            reader: BufReader::new(reader),
        })
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sets the read timeout (None: block).
    pub fn set_timeout(&self, t: Option<Duration>) {
        let _ = self.writer.set_read_timeout(t);
    }

    /// Sends one message.
    ///
    /// # Errors
    /// The peer is gone.
    pub fn send<E: Serialize>(&mut self, m: &Msg<E>) -> Result<(), DemoError> {
        let mut line = serde_json::to_vec(m)
            .map_err(|e| net(format!("{}: encode {}: {e}", self.peer, m.name())))?;
        line.push(b'\n');
        self.writer
            .write_all(&line)
            .and_then(|()| self.writer.flush())
            .map_err(|e| net(format!("{}: send {}: {e}", self.peer, m.name())))
    }

    /// Receives one message.
    ///
    /// # Errors
    /// The peer closed the connection, the read timed out, or the line is
    /// too long or not a message.
    pub fn recv<E: DeserializeOwned>(&mut self) -> Result<Msg<E>, DemoError> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    net(format!("{}: no answer (timed out)", self.peer))
                }
                _ => net(format!("{}: receive: {e}", self.peer)),
            })?;
        if n == 0 {
            return Err(net(format!("{}: closed the connection", self.peer)));
        }
        if line.last() != Some(&b'\n') {
            return Err(net(if line.len() > MAX_LINE {
                format!("{}: a message longer than {MAX_LINE} bytes", self.peer)
            } else {
                format!("{}: closed the connection mid-message", self.peer)
            }));
        }
        parse_message(&line).map_err(|e| net(format!("{}: {e}", self.peer)))
    }

    /// A second handle on the socket (for a reader thread).
    fn split(self) -> (TcpStream, BufReader<TcpStream>) {
        (self.writer, self.reader)
    }
}

/// One line read from the socket as a message (the fuzz target
/// `handshake` feeds it anything).
///
/// # Errors
/// Not JSON, or not a message of this protocol (the reason quotes the
/// line's first 120 bytes, and the parser's words, which may quote the
/// line too, escaped: see [`escaped`]).
pub fn parse_message<E: DeserializeOwned>(line: &[u8]) -> Result<Msg<E>, String> {
    serde_json::from_slice(line).map_err(|e| {
        format!(
            "not a cqd-demo message ({}): {}",
            escaped(&e.to_string()),
            escaped(&String::from_utf8_lossy(&line[..line.len().min(120)]))
        )
    })
}

/// `text` that came from a peer (or quotes it), as this process prints
/// it: quoted, with control characters, line breaks and other unprintable
/// characters escaped (Rust's `{:?}`), so that a peer can neither send
/// terminal escape codes nor forge a line of the output, such as a
/// verdict.
pub fn escaped(text: &str) -> String {
    format!("{text:?}")
}

/// What a server takes (its side of [`judge_hello`]).
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Its block size, bytes.
    pub block_size: u32,
    /// The deepest queue per connection.
    pub depth: u32,
    /// The most connections.
    pub connections: u32,
    /// Its queue pairs connect through rdma_cm.
    pub rdmacm: bool,
}

/// The server's judgement of the first message of a handshake: the
/// connections asked for and the load's nonce, or the reason for the
/// refusal (pure: the fuzz target `handshake` runs it on anything).
///
/// # Errors
/// Anything but a `hello` that fits `limits` with a well-formed nonce.
pub fn judge_hello<E>(
    hello: Msg<E>,
    limits: &Limits,
) -> Result<(u32, [u8; auth::NONCE_LEN]), String> {
    let Msg::Hello {
        protocol,
        version,
        block_size,
        qd,
        connections,
        rdmacm,
        nonce,
    } = hello
    else {
        return Err(format!("expected hello, got {}", hello.name()));
    };
    if rdmacm != limits.rdmacm {
        let how = |b: bool| if b { "rdmacm" } else { "tcp" };
        return Err(format!(
            "the load connects with --cm {}, this server was started with --cm {}",
            how(rdmacm),
            how(limits.rdmacm)
        ));
    }
    if protocol != PROTOCOL || version != VERSION {
        return Err(format!(
            "protocol {:?} version {version}; this server speaks {PROTOCOL:?} version {VERSION}",
            protocol.chars().take(64).collect::<String>()
        ));
    }
    if block_size != limits.block_size {
        return Err(format!(
            "block size {block_size}: this server's blocks are {} bytes (give both sides the \
             same --block-size)",
            limits.block_size
        ));
    }
    if qd == 0 || qd > limits.depth {
        return Err(format!(
            "queue depth {qd}: this server takes 1 to {} (start it with --qd {qd}, or lower the \
             load's --qd)",
            limits.depth
        ));
    }
    if connections == 0 || connections > limits.connections {
        return Err(format!(
            "{connections} connections: this server takes 1 to {} (start it with --connections \
             {connections})",
            limits.connections
        ));
    }
    let nonce = auth::parse_nonce(&nonce).map_err(|e| format!("hello: {e}"))?;
    Ok((connections, nonce))
}

// ---------------------------------------------------------------- serve

/// Binds the listening socket of `serve`.
///
/// # Errors
/// The address does not parse or is taken.
pub fn listen(addr: &str) -> Result<TcpListener, DemoError> {
    TcpListener::bind(addr).map_err(|e| net(format!("listen on {addr} (--listen): {e}")))
}

/// Serves one load session on nodes from `open`: starts the server and
/// its pollers, waits on `listener` for a load whose handshake fits,
/// connects its QPs, waits for its `done` (or its disappearance), stops
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
        Side::Server,
    )?;
    let started = Instant::now();
    let mut side = ServerSide::start(
        cfg,
        layout.server_pollers,
        layout.pool,
        |_| cfg.connections,
        &open,
    )?;
    let local = listener
        .local_addr()
        .map_err(|e| net(format!("listening socket: {e}")))?;
    // --cm rdmacm: the queue pairs' listener, on the same address.
    let cm = match cfg.cm {
        CmKind::Rdmacm => match crate::backend::cm::listen(local) {
            Ok(l) => Some(l),
            Err(e) => {
                let _ = side.stop();
                return Err(e.into());
            }
        },
        CmKind::Tcp => None,
    };
    ready(local);
    let deadline = cfg.accept_timeout.map(|t| Instant::now() + t);
    let mut notes = Vec::new();
    let (peer, session) = loop {
        let (stream, addr) = match accept_until(&listener, deadline) {
            Ok(x) => x,
            Err(e) => {
                // Nobody came: stop the threads before saying so.
                let _ = side.stop();
                return Err(e);
            }
        };
        let mut wire = Wire::new(stream, format!("load {addr}"))?;
        match session::<N>(&mut side, &mut wire, cm.as_ref(), cfg.secret.as_ref()) {
            Ok(SessionStart::Refused(why)) => {
                tracing::warn!(peer = %addr, "handshake refused: {why}");
                eprintln!("cqd-demo serve: refused load {addr}: {why}");
                continue;
            }
            Ok(SessionStart::Running) => {}
            Err(e) => {
                let _ = side.stop();
                return Err(e);
            }
        }
        eprintln!("cqd-demo serve: load {addr} connected; serving");
        // One session per process: a second load is refused at once
        // rather than left waiting for a handshake.
        drop(listener);
        // The session runs until the load says done or goes away.
        wire.set_timeout(None);
        let outcome = match wire.recv::<serde_json::Value>() {
            Ok(Msg::Done) => Ok(()),
            Ok(other) => Err(format!(
                "load {addr} sent {} where done was expected",
                other.name()
            )),
            Err(e) => Err(format!("the load went away mid-session: {e}")),
        };
        break (addr, (wire, outcome));
    };
    let (mut wire, outcome) = session;
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
    notes.extend(stopped.notes);
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
        notes,
    });
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

fn accept_until(
    listener: &TcpListener,
    deadline: Option<Instant>,
) -> Result<(TcpStream, SocketAddr), DemoError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| net(format!("listening socket: {e}")))?;
    loop {
        match listener.accept() {
            Ok((s, a)) => {
                s.set_nonblocking(false)
                    .map_err(|e| net(format!("load {a}: socket: {e}")))?;
                return Ok((s, a));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    return Err(net(
                        "no load connected before --accept-timeout; stopping".into()
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(net(format!("accept: {e}"))),
        }
    }
}

enum SessionStart {
    Refused(String),
    Running,
}

/// The server's half of the handshake: `hello` → `welcome`, then every
/// `connect` → `accepted`.
fn session<N: Node>(
    side: &mut ServerSide<N>,
    wire: &mut Wire,
    cm: Option<&CmListener>,
    secret: Option<&Secret>,
) -> Result<SessionStart, DemoError> {
    wire.set_timeout(Some(HANDSHAKE_TIMEOUT));
    let server = side
        .server(0)
        .ok_or_else(|| DemoError::Setup("no server".into()))?;
    let spec = server.spec();
    let blocks = server.blocks();
    let hello = match wire.recv::<<N::Link as Link>::Endpoint>() {
        Ok(m) => m,
        Err(e) => {
            // Say why, if the peer still listens.
            let _ = wire.send(&Msg::<()>::Refused {
                reason: e.to_string(),
            });
            return Ok(SessionStart::Refused(e.to_string()));
        }
    };
    let limits = Limits {
        block_size: spec.block_size,
        depth: spec.depth,
        connections: spec.connections,
        rdmacm: cm.is_some(),
    };
    let refuse = |wire: &mut Wire, reason: String| {
        let _ = wire.send(&Msg::<()>::Refused {
            reason: reason.clone(),
        });
        Ok(SessionStart::Refused(reason))
    };
    let (connections, load_nonce) = match judge_hello(hello, &limits) {
        Ok(a) => a,
        Err(reason) => return refuse(wire, reason),
    };
    let proof = match secret {
        None => None,
        Some(secret) => {
            let mine = auth::nonce()?;
            wire.send(&Msg::<()>::Challenge {
                nonce: auth::nonce_hex(&mine),
            })?;
            match wire.recv::<<N::Link as Link>::Endpoint>() {
                Ok(Msg::Answer { mac }) if secret.check_answer(&mine, &load_nonce, &mac) => {}
                Ok(Msg::Answer { .. }) => {
                    return refuse(
                        wire,
                        "wrong answer to the challenge: the load's --secret-file differs from \
                         this server's"
                            .into(),
                    )
                }
                Ok(other) => {
                    return refuse(
                        wire,
                        format!(
                            "this server requires a shared secret (--secret-file): expected \
                             answer, got {}",
                            other.name()
                        ),
                    )
                }
                Err(e) => return refuse(wire, format!("no answer to the challenge: {e}")),
            }
            Some(secret.proof(&load_nonce, &mine))
        }
    };
    wire.send(&Msg::<()>::Welcome {
        version: VERSION,
        block_size: spec.block_size,
        blocks,
        max_qd: spec.depth,
        max_connections: spec.connections,
        proof,
    })?;
    // The load's word on the welcome: until it joins, nothing is made and
    // the session has not begun (a load that refuses this server, or
    // leaves, does not use up the process's one session).
    match wire.recv::<<N::Link as Link>::Endpoint>() {
        Ok(Msg::Join) => {}
        Ok(Msg::Refused { reason }) => {
            return Ok(SessionStart::Refused(format!(
                "the load refused this server: {}",
                escaped(&reason)
            )))
        }
        Ok(other) => return refuse(wire, format!("expected join, got {}", other.name())),
        Err(e) => return Ok(SessionStart::Refused(format!("the load left: {e}"))),
    }
    if let Some(cm) = cm {
        // Each connection's request names its number; the load opens them
        // in order, one at a time.
        for want in 0..connections {
            let (conn, req) = cm.next(HANDSHAKE_TIMEOUT)?;
            if conn != want {
                return Err(net(format!(
                    "{}: rdma_cm request for connection {conn}, expected {want}",
                    wire.peer()
                )));
            }
            let c = side.accept(0)?;
            c.link().cm_accept(req)?;
            c.post_receives()?;
        }
        return Ok(SessionStart::Running);
    }
    for want in 0..connections {
        let (conn, endpoint) = match wire.recv::<<N::Link as Link>::Endpoint>()? {
            Msg::Connect { conn, endpoint } if conn == want => (conn, endpoint),
            other => {
                let reason = format!(
                    "expected connect for connection {want}, got {}",
                    other.name()
                );
                let _ = wire.send(&Msg::<()>::Refused {
                    reason: reason.clone(),
                });
                return Err(net(format!("{}: {reason}", wire.peer())));
            }
        };
        let made = side.accept(0).and_then(|c| {
            c.link().connect(&endpoint)?;
            c.post_receives()?;
            Ok(c.link().endpoint()?)
        });
        match made {
            Ok(mine) => wire.send(&Msg::Accepted {
                conn,
                endpoint: mine,
            })?,
            Err(e) => {
                let _ = wire.send(&Msg::<()>::Refused {
                    reason: format!("connection {conn}: {e}"),
                });
                return Err(e);
            }
        }
    }
    Ok(SessionStart::Running)
}

// ----------------------------------------------------------------- load

/// Connects to a server (`--server HOST:PORT`).
///
/// # Errors
/// The name does not resolve, or nobody answers within
/// [`CONNECT_TIMEOUT`].
pub fn reach(addr: &str) -> Result<TcpStream, DemoError> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| net(format!("server {addr} (--server): {e}")))?
        .collect();
    let mut last = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, CONNECT_TIMEOUT) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(net(format!(
        "cannot reach server {addr} (--server): {}; is `cqd-demo serve` running there?",
        last.map_or_else(|| "no address".to_string(), |e| e.to_string())
    )))
}

struct Agreed {
    blocks: u64,
}

/// The load's half of the handshake (hello; with a secret, the
/// challenge's answer and the server's proof; welcome; join) on `wire`,
/// for a client of its own (the hostile-client tests): the server's block
/// count. Then send one `connect` per connection.
///
/// # Errors
/// The server refused, or did not prove the secret, or answered out of
/// turn.
pub fn join<E: DeserializeOwned + Serialize>(
    wire: &mut Wire,
    cfg: &Config,
    connections: u32,
) -> Result<u64, DemoError> {
    hello::<E>(wire, cfg, connections).map(|a| a.blocks)
}

/// The load's half of the handshake with server `s`.
fn hello<E: DeserializeOwned + Serialize>(
    wire: &mut Wire,
    cfg: &Config,
    connections: u32,
) -> Result<Agreed, DemoError> {
    wire.set_timeout(Some(HANDSHAKE_TIMEOUT));
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
    match reply {
        Msg::Welcome {
            version,
            block_size,
            blocks,
            proof,
            ..
        } => {
            // A load with a secret joins only a server that proves it
            // knows it (and so challenged this load).
            let refuse = |wire: &mut Wire, reason: String| {
                let _ = wire.send(&Msg::<E>::Refused {
                    reason: reason.clone(),
                });
                Err(net(format!("{}: {reason}", wire.peer())))
            };
            if let Some(secret) = &cfg.secret {
                let proved = match (theirs, proof) {
                    (Some(s), Some(p)) => secret.check_proof(&mine, &s, &p),
                    _ => false,
                };
                if !proved {
                    return refuse(
                        wire,
                        "the server did not prove it knows the shared secret (--secret-file): \
                         not joining it"
                            .into(),
                    );
                }
            }
            // Nothing read from a socket is trusted: the device the server
            // announces must fit what this load can verify.
            let bytes = blocks.checked_mul(u64::from(block_size));
            if bytes.is_none_or(|b| b > crate::config::MAX_DEVICE) {
                return refuse(
                    wire,
                    format!(
                        "welcome announces {blocks} blocks of {block_size} bytes; at most {} \
                         bytes per server",
                        crate::config::MAX_DEVICE
                    ),
                );
            }
            if version != VERSION || block_size != cfg.block_size || blocks == 0 {
                return refuse(
                    wire,
                    format!(
                        "welcome with version {version}, block size {block_size}, {blocks} \
                         blocks; this load speaks version {VERSION} with {}-byte blocks",
                        cfg.block_size
                    ),
                );
            }
            wire.send(&Msg::<E>::Join)?;
            Ok(Agreed { blocks })
        }
        Msg::Refused { reason } => Err(net(format!(
            "{} refused the load: {}",
            wire.peer(),
            escaped(&reason)
        ))),
        other => Err(net(format!(
            "{}: expected welcome, got {}",
            wire.peer(),
            other.name()
        ))),
    }
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
    for (s, wire) in wires.iter_mut().enumerate() {
        let agreed = hello::<<N::Link as Link>::Endpoint>(wire, cfg, per_server(s as u32))?;
        blocks = blocks.min(agreed.blocks);
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
        Side::Load,
    )?;
    let mode_name = cfg
        .mode
        .map_or_else(|| "topology".to_string(), |m| m.name().to_string());
    let threads_started = Instant::now();
    let mut side = LoadSide::start(cfg, layout.load_pollers, layout.load_cqs, &open)?;
    let mut by_server: Vec<Vec<Arc<LoadConn<N>>>> = vec![Vec::new(); servers as usize];
    let mut next = vec![0u32; servers as usize];
    let joined = (|| -> Result<(), DemoError> {
        for c in 0..cfg.connections {
            let s = c % servers;
            let conn = side.connect(s)?;
            let wire = &mut wires[s as usize];
            let n = next[s as usize];
            next[s as usize] += 1;
            if cfg.cm == CmKind::Rdmacm {
                // The server's rdma_cm listener is on its TCP address.
                conn.link().cm_connect(peers[s as usize], n)?;
                conn.post_receives()?;
                by_server[s as usize].push(conn);
                continue;
            }
            wire.send(&Msg::Connect {
                conn: n,
                endpoint: conn.link().endpoint()?,
            })?;
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
            by_server[s as usize].push(conn);
        }
        Ok(())
    })();
    if let Err(e) = joined {
        let _ = side.stop();
        return Err(e);
    }
    tracing::info!(setup = ?setup_started.elapsed(), "connected to every server");

    // One watcher per server: EOF before `done` means the server died;
    // its connections are failed at once (their requests with them).
    let done = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<(usize, Result<(bool, String), String>)>();
    let mut writers = Vec::new();
    for (s, wire) in wires.into_iter().enumerate() {
        let peer = wire.peer().to_string();
        wire.set_timeout(None);
        let (writer, mut reader) = wire.split();
        writers.push((peer.clone(), writer));
        let conns = by_server[s].clone();
        let done = Arc::clone(&done);
        let tx = tx.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("cqd-demo-watch-{s}"))
            .spawn(move || {
                let got = read_bye::<N>(&mut reader, &peer);
                if got.is_err() && !done.load(Ordering::Acquire) {
                    let why = format!(
                        "{peer} went away mid-run ({}); its requests in flight fail",
                        got.as_ref().err().map_or("", |e| e.as_str())
                    );
                    eprintln!("cqd-demo load: {why}");
                    for c in &conns {
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

    let driven = side.drive(cfg);
    done.store(true, Ordering::Release);
    // The servers tear down after `done` (with --cm rdmacm their exit
    // flushes our receives through the CM): flushes are no failure now.
    side.closing();
    let mut notes = driven.notes;
    for (peer, w) in &mut writers {
        let mut line = serde_json::to_vec(&Msg::<()>::Done).unwrap_or_default();
        line.push(b'\n');
        if let Err(e) = w.write_all(&line) {
            notes.push(format!("{peer}: could not say done: {e}"));
        }
    }
    let mut peers: Vec<Option<PeerVerdict>> = vec![None; servers as usize];
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
    for (peer, w) in &writers {
        let _ = w.shutdown(Shutdown::Both);
        let _ = peer;
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
        topology_toml: layout.toml,
        topology_warnings: layout.warnings,
        notes,
    });
    report.peers = peers;
    Ok(report)
}

/// The watcher's read: the server's `bye`, or why there is none.
fn read_bye<N: Node>(
    reader: &mut BufReader<TcpStream>,
    peer: &str,
) -> Result<(bool, String), String> {
    let mut line = Vec::new();
    let n = reader
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("its control connection failed: {e}"))?;
    if n == 0 || line.last() != Some(&b'\n') {
        return Err("its control connection closed".into());
    }
    match serde_json::from_slice::<Msg<<N::Link as Link>::Endpoint>>(&line) {
        Ok(Msg::Bye { passed, detail }) => Ok((passed, detail)),
        Ok(other) => Err(format!(
            "{peer} sent {} where bye was expected",
            other.name()
        )),
        Err(e) => Err(format!(
            "{peer} sent something that is not a message: {}",
            escaped(&e.to_string())
        )),
    }
}
