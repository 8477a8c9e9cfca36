//! Clients that attack a `serve` handshake (slow, silent, flooding) and a
//! proxy on the path that rewrites what passes, for `tests/net.rs` and
//! `tests/hostile.rs`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cqd_demo::auth::{self, SessionKey, NONCE_LEN};
use cqd_demo::config::Config;
use cqd_demo::net::{join, Msg, Wire};
use serde_json::Value;

/// How long an honest join may take while a server is under attack: far
/// under the 30 s handshake deadline the attacks would otherwise make it
/// wait, far over what a join takes on a loaded machine.
pub const JOIN_BOUND: Duration = Duration::from_secs(5);

/// A connection that says nothing.
pub fn silent(addr: &str) -> TcpStream {
    TcpStream::connect(addr).expect("connect")
}

/// `n` connections that say nothing.
pub fn idle(addr: &str, n: usize) -> Vec<TcpStream> {
    (0..n).map(|_| silent(addr)).collect()
}

/// A connection that sends a hello one byte every `every`, until dropped.
pub struct Trickle {
    pub stream: TcpStream,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Trickle {
    pub fn start(addr: &str, every: Duration) -> Trickle {
        let stream = silent(addr);
        let mut w = stream.try_clone().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let halt = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let hello = br#"{"msg":"hello","protocol":"cqd-demo","version":5,"block_size":4096,"qd":4,"connections":1,"nonce":"#;
            for b in hello.iter().cycle() {
                if halt.load(Ordering::Acquire) || w.write_all(&[*b]).is_err() {
                    return;
                }
                // Sleep in slices, to stop soon when asked.
                let until = Instant::now() + every;
                while Instant::now() < until && !halt.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        });
        Trickle {
            stream,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Trickle {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the server said on `s` before it closed it, read for at most
/// `within`.
pub fn said(s: &TcpStream, within: Duration) -> String {
    s.set_read_timeout(Some(within)).unwrap();
    let mut got = Vec::new();
    let _ = (&*s).read_to_end(&mut got);
    String::from_utf8_lossy(&got).into_owned()
}

/// An honest client's join (H1–H4) with `cfg` for `connections`
/// connections: how long it took, and its wire (sealed, for what
/// follows).
pub fn timed_join(addr: &str, cfg: &Config, connections: u32) -> (Duration, Wire) {
    let started = Instant::now();
    let mut wire = Wire::new(TcpStream::connect(addr).unwrap(), addr.to_string()).unwrap();
    join::<serde_json::Value>(&mut wire, cfg, connections).expect("an honest join");
    (started.elapsed(), wire)
}

/// Which way a line goes through a [`proxy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    ToServer,
    ToLoad,
}

/// What a proxy on the path has read of a handshake: the load's nonce
/// and, from a server without a secret, the token: enough to make the
/// session's key.
#[derive(Debug, Default)]
pub struct Seen {
    pub l: Option<[u8; NONCE_LEN]>,
    pub s: Option<[u8; NONCE_LEN]>,
}

impl Seen {
    /// Notes the nonces `line` carries.
    pub fn observe(&mut self, line: &str) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            return;
        };
        let field = |k: &str| v.get(k).and_then(|n| n.as_str()).map(auth::parse_nonce);
        match v.get("msg").and_then(|m| m.as_str()) {
            Some("hello") => self.l = field("nonce").and_then(Result::ok),
            Some("welcome") => self.s = field("token").and_then(Result::ok),
            _ => {}
        }
    }

    /// The session's key, once the nonce and the token went by.
    pub fn key(&self) -> Option<SessionKey> {
        Some(SessionKey::from_token(&self.l?, &self.s?))
    }
}

/// What a proxy makes of each line: the lines it forwards instead.
pub type Rewrite = Box<dyn FnMut(Way, String, &Seen) -> Vec<String> + Send>;

/// Forwards one TCP connection to `to`, line by line, each line as
/// `rewrite` makes it; its address.
pub fn proxy(to: String, rewrite: Rewrite) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (a, _) = l.accept().unwrap();
        let b = TcpStream::connect(&to).unwrap();
        let state = Arc::new(Mutex::new((rewrite, Seen::default())));
        let pipe = |from: TcpStream, mut into: TcpStream, way: Way| {
            let state = Arc::clone(&state);
            std::thread::spawn(move || {
                for line in BufReader::new(from).lines().map_while(Result::ok) {
                    let out = {
                        let mut g = state.lock().unwrap();
                        let (rewrite, seen) = &mut *g;
                        seen.observe(&line);
                        rewrite(way, line, seen)
                    };
                    for o in out {
                        if into.write_all(format!("{o}\n").as_bytes()).is_err() {
                            return;
                        }
                    }
                }
                let _ = into.shutdown(Shutdown::Write);
            })
        };
        let up = pipe(
            a.try_clone().unwrap(),
            b.try_clone().unwrap(),
            Way::ToServer,
        );
        let down = pipe(b, a, Way::ToLoad);
        let _ = up.join();
        let _ = down.join();
    });
    addr
}

/// Whether `line` is a sealed message whose body is a `msg` message.
pub fn sealed_of(line: &str, msg: &str) -> bool {
    line.contains("\"msg\":\"sealed\"") && line.contains(&format!("\\\"msg\\\":\\\"{msg}\\\""))
}

/// What a server said on `s` before it closed it: its `refused` reason
/// (sealed, after a welcome: read here without checking the seal).
pub fn refusal_on(s: &TcpStream) -> String {
    let said = said(s, Duration::from_secs(60));
    let refusal = said.lines().find_map(|l| {
        let m = match serde_json::from_str::<Msg<Value>>(l).ok()? {
            Msg::Sealed { body, .. } => serde_json::from_str::<Msg<Value>>(&body).ok()?,
            m => m,
        };
        match m {
            Msg::Refused { reason } => Some(reason),
            _ => None,
        }
    });
    refusal.unwrap_or_else(|| panic!("no refusal: {said:?}"))
}

/// The server's sealed refusal on a joined `wire`.
pub fn sealed_refusal(wire: &mut Wire) -> String {
    match wire.recv::<Value>() {
        Ok(Msg::Refused { reason }) => reason,
        other => panic!("expected a sealed refusal: {other:?}"),
    }
}

/// A client that joined (H1–H4, sealed from then on) with `cfg` for
/// `connections` connections, and a raw handle on its socket.
pub fn joined(addr: &str, cfg: &Config, connections: u32) -> (Wire, TcpStream) {
    let s = TcpStream::connect(addr).unwrap();
    let raw = s.try_clone().unwrap();
    let mut wire = Wire::new(s, addr.to_string()).unwrap();
    join::<Value>(&mut wire, cfg, connections).expect("an honest join");
    (wire, raw)
}
