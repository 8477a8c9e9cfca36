//! `serve` and `load` as separate processes: the TCP handshake that joins
//! them, then each process runs its own half (`run::ServerSide` or
//! `run::LoadSide`) and reports its own side.
//!
//! - [`Wire`] (`control`): the message socket, JSON lines under one
//!   deadline, sealed after the welcome (S1–S3 below);
//! - `admit`: serve's admission of handshakes (A1–A4);
//! - `serve`: serve's half of the handshake (H1–H5) and of the session
//!   (H6, H7);
//! - `gate`: serve's rdma_cm gate (H5 with `--cm rdmacm`);
//! - `dial`: the load's half.
//!
//! # The protocol (version 5)
//!
//! One TCP connection per (load, server) pair carries newline-delimited
//! JSON messages ([`Msg`]), each at most [`MAX_LINE`] bytes. Each side
//! gives each handshake one deadline (`--handshake-timeout`, default
//! [`HANDSHAKE_TIMEOUT`]) for the whole exchange, H1 to H5, not a time per
//! read: a peer that trickles bytes is cut off as one that says nothing.
//!
//! H1. load → server `hello` {protocol "cqd-demo", version, block size,
//!     queue depth, connections, `rdmacm`, a fresh nonce `L`}.
//! H2. A server started with `--secret-file` answers `challenge` {its fresh
//!     nonce `S`}, and the load `answer` {the keyed hash of both nonces}
//!     ([`crate::auth`], steps 1–3); a wrong or missing answer is refused
//!     with the reason.
//! H3. The server answers `welcome` {its block count, block size, the
//!     deepest queue and most connections it takes; with a secret, its
//!     proof of it, which a load with `--secret-file` requires; without
//!     one, `token`: its fresh nonce `S`} or `refused` {reason} (another
//!     version, another block size, a deeper queue or more connections
//!     than it was started for, a malformed nonce, a wrong answer). From
//!     here on both sides hold the session's key `K` (auth step 5), and
//!     every message is sealed (S1–S3).
//! H4. The load answers the welcome with `join`, or with an unsealed
//!     `refused` {reason} (a server that did not prove the secret, a
//!     geometry it cannot verify). The load uses the smallest block count
//!     of its servers (blocks are striped: global block g is block g / S of
//!     server g % S).
//! H5. The connections; until they come the server makes nothing.
//!     - `--cm tcp`: the load sends `connect` {conn, its QP's endpoint} for
//!       each of its connections, 0, 1, … in order, before it reads any
//!       answer. The server reads them all, claims the session (A3), then
//!       makes each QP, connects it, posts its receives and answers
//!       `accepted` {conn, its endpoint}; the load connects its QP and
//!       posts its receives. (verbs: the endpoint is cqd-verbs' `Endpoint`.)
//!     - `--cm rdmacm`: the load connects each connection in order, one at
//!       a time, through rdma_cm to the address its TCP session reached;
//!       the request's private data names the connection and carries `K`'s
//!       MAC of it (auth step 7, [`crate::backend::cm`]). The server's CM
//!       gate passes a request on only if its MAC is that of a handshake
//!       that reached H3, it comes from that handshake's TCP peer address,
//!       and it names that handshake's next connection; it rejects any
//!       other (`rdma_reject`, the reason as private data), counts it and
//!       names it in the server's report, and the handshake or session it
//!       aimed at goes on. The first request passed on claims the session
//!       (A3); the server accepts each on a new QP and posts its receives.
//! H6. The load runs. The TCP connection stays open: it is how each side
//!     learns the other went away (EOF), and the load then fails every
//!     request in flight to that server at once (the QPs' error
//!     completions and the op timeout are the other two ways).
//!     With `--churn` (`--cm tcp` only) the load closes its side of a
//!     connection (its requests answered first), then sends `reconnect`
//!     {conn, its new QP's endpoint}; the server closes its side of that
//!     connection (`Server::close`), makes its replacement under the same
//!     number, connects it and answers `reconnected` {conn, its endpoint};
//!     the load connects its new QP. A reconnect for a number the session
//!     does not have, or one the server cannot make, ends the session
//!     (S3).
//! H7. load → `done` when its load and read-back are over; the server stops
//!     its half (QPs to error, pollers drain and report), prints its report
//!     and answers `bye` {its accounts verdict}; the load stops its own
//!     half and reports, with each server's word.
//!
//! ## Sealed messages
//!
//! S1. After H3 each message is `sealed` {seq, body, mac}: `body` is the
//!     message's own JSON, `mac` is `K`'s MAC of the direction, `seq` and
//!     `body` (auth step 6). Only the load's refusal of a welcome (H4) is
//!     not: the load does not trust that server.
//! S2. Each direction numbers its sealed messages 0, 1, 2, …; the receiver
//!     takes only the number it expects next. A bad MAC (a message altered,
//!     or not made with this session's key), another number (a message
//!     replayed, dropped or reordered), an unsealed message or a seal
//!     inside a seal is refused, with the reason, in a sealed `refused`.
//! S3. That refusal ends the session cleanly: before the session is
//!     established (A3), the server gives back what it made and goes on
//!     waiting (A2); after, the session ends with a failed session verdict.
//!     The load fails its handshake, or its word from that server.
//!
//! Without a secret, `K` comes from the token, which travels in the clear:
//! sealing then keeps out whoever cannot read the TCP session (an off-path
//! host, a stranger's rdma_cm request), not a host on the path.
//!
//! # Admission (serve)
//!
//! A1. Each TCP connection's handshake runs on a thread of its own, at
//!     most [`MAX_HANDSHAKES`] at once: when another connection comes, the
//!     oldest pending handshake that does not hold the claim (A3) is ended
//!     (`refused`: too many at once) to make room. A silent, slow or
//!     flooding client holds one thread until its deadline or until newer
//!     connections push it out, and delays no other handshake.
//! A2. A failure of a handshake in any phase (H1–H5) is answered `refused`
//!     {reason} when the peer still listens, printed by the server, and
//!     ends that handshake only.
//! A3. A `serve` process serves exactly one load session. A handshake
//!     claims it when its `connect`s are all in (tcp) or its first
//!     connection request is passed on (rdmacm); while one holds the
//!     claim, the others that reach that point wait, within their
//!     deadlines. A handshake that fails holding the claim gives back
//!     every QP it made (`ServerSide::close`), then the claim; one that
//!     connects its last QP establishes the session.
//! A4. Once a session is established the server stops listening (a second
//!     load is turned away at once) and ends every other pending handshake
//!     with `refused`. It exits after the session: 0 when the load said
//!     `done` and its accounts balanced, 1 otherwise (a load that vanished,
//!     unbalanced accounts, a message refused by S2).
//!
//! Nothing read from the socket is trusted: a line too long, not JSON, an
//! unexpected message or an endpoint the device refuses is an error with
//! the peer's address, never a panic.

mod admit;
mod control;
mod dial;
mod gate;
mod serve;

use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::auth;
use crate::DemoError;

pub use control::{seal, Open, Seal, Wire};
pub use dial::{join, load_on};
pub use gate::{judge_request, Binding, Rejected};
pub use serve::serve_on;

/// The protocol's name, first field of `hello`.
pub const PROTOCOL: &str = "cqd-demo";
/// The protocol's version.
pub const VERSION: u32 = 5;
/// The longest message line, in bytes.
pub const MAX_LINE: usize = 64 * 1024;
/// The default deadline of a handshake (`--handshake-timeout`): H1 to H5
/// of the protocol.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// The most handshakes a server runs at once (A1).
pub const MAX_HANDSHAKES: usize = 64;
/// How long the load waits for a server to reach (TCP connect).
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the load waits for the servers' `bye`.
pub const BYE_TIMEOUT: Duration = Duration::from_secs(60);

/// One message of the protocol (see the module documentation).
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
        /// Without a secret: the session's token, the server's nonce (64
        /// hex digits), from which both sides make the session's key.
        #[serde(default)]
        token: Option<String>,
        // No address or key of the server's memory: the server moves every
        // block itself, and its regions and QPs take no remote access
        // (version 1 named its device region, which any client could then
        // write).
    },
    /// Either side: the handshake or the session is refused.
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
    /// load → server, during the run (`--churn`, `--cm tcp`): the load
    /// closed its side of connection `conn`; close the server's and make
    /// its replacement, under the same number, for the load's new QP.
    Reconnect {
        /// The connection's number in this session.
        conn: u32,
        /// The load's new QP.
        endpoint: E,
    },
    /// server → load: connection `conn`'s replacement, connected.
    Reconnected {
        /// The connection's number.
        conn: u32,
        /// The server's new QP.
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
    /// Either side, after the welcome: another message, sealed (S1).
    Sealed {
        /// Its number in its direction (S2).
        seq: u64,
        /// The message's JSON.
        body: String,
        /// The session key's MAC of it, 64 hex digits (auth step 6).
        mac: String,
    },
}

impl<E> Msg<E> {
    /// The message's name, as its `msg` field says it.
    pub fn name(&self) -> &'static str {
        match self {
            Msg::Hello { .. } => "hello",
            Msg::Welcome { .. } => "welcome",
            Msg::Refused { .. } => "refused",
            Msg::Challenge { .. } => "challenge",
            Msg::Answer { .. } => "answer",
            Msg::Join => "join",
            Msg::Connect { .. } => "connect",
            Msg::Accepted { .. } => "accepted",
            Msg::Reconnect { .. } => "reconnect",
            Msg::Reconnected { .. } => "reconnected",
            Msg::Done => "done",
            Msg::Bye { .. } => "bye",
            Msg::Sealed { .. } => "sealed",
        }
    }
}

fn net(m: String) -> DemoError {
    DemoError::Net(m)
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

/// Binds the listening socket of `serve`.
///
/// # Errors
/// The address does not parse or is taken.
pub fn listen(addr: &str) -> Result<TcpListener, DemoError> {
    TcpListener::bind(addr).map_err(|e| net(format!("listen on {addr} (--listen): {e}")))
}

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
