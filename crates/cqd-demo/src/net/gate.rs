//! serve's rdma_cm gate (H5 of the protocol in `crate::net`, with `--cm
//! rdmacm`): one thread takes every connection request from the CM
//! listener and passes on only the requests of a handshake that reached
//! H3, or of the session it became: the MAC of that handshake's key, from
//! its load's address, for its next connection ([`judge_request`]). It
//! rejects any other with the reason as the reject's private data, counts
//! it and names it for the server's report. A request for a connection
//! that is already connected (a replay) is such another.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::admit::TicketState;
use super::net;
use crate::auth::SessionKey;
use crate::backend::cm::{self, CmListener, CmRequest, PendingCm};
use crate::DemoError;

/// How long the gate and a handshake waiting on it sleep at most before
/// they look whether they should stop.
const POLL: Duration = Duration::from_millis(100);

/// The rejected requests a report names (the rest are counted).
pub const NAMED: usize = 16;

/// What the gate knows of one handshake or session.
#[derive(Debug)]
pub struct Binding {
    key: SessionKey,
    peer: IpAddr,
    connections: u32,
    next: u32,
    route: Option<(u64, mpsc::Sender<(u32, PendingCm)>)>,
}

impl Binding {
    /// A handshake with session key `key`, whose TCP peer is at `peer`,
    /// for `connections` connections, none connected yet.
    pub fn new(key: SessionKey, peer: IpAddr, connections: u32) -> Binding {
        Binding {
            key,
            peer,
            connections,
            next: 0,
            route: None,
        }
    }
}

/// The gate's judgement of a request with private data `data` from `from`
/// (pure: unit tests and the fuzz target `handshake` run it): the index in
/// `bindings` of the handshake it belongs to and its connection number,
/// that handshake's next connection then being the one after.
///
/// # Errors
/// Why it is rejected, in words for the reject and the report: not a
/// cqd-demo request, a MAC no handshake's key made, another address than
/// the handshake's load, a connection already connected, out of order or
/// beyond the handshake's count.
pub fn judge_request(
    bindings: &mut [Binding],
    data: &[u8],
    from: Option<SocketAddr>,
) -> Result<(usize, u32), String> {
    let Some((conn, mac)) = cm::parse_request(data) else {
        return Err("not a cqd-demo connection request".into());
    };
    let Some(i) = bindings.iter().position(|b| b.key.check_cm_mac(conn, &mac)) else {
        return Err(format!(
            "connection {conn}: its MAC is no session's of this server"
        ));
    };
    let b = &mut bindings[i];
    let ip = from.map(|a| a.ip().to_canonical());
    if ip != Some(b.peer.to_canonical()) {
        return Err(format!(
            "connection {conn}: from {}, not from its session's load {}",
            ip.map_or_else(|| "an unknown address".to_string(), |a| a.to_string()),
            b.peer
        ));
    }
    if conn < b.next {
        return Err(format!(
            "connection {conn}: already connected in its session"
        ));
    }
    if conn >= b.connections {
        return Err(format!(
            "connection {conn}: its session has {} connection(s)",
            b.connections
        ));
    }
    if conn > b.next {
        return Err(format!(
            "connection {conn}: its session's next is connection {}",
            b.next
        ));
    }
    b.next += 1;
    Ok((i, conn))
}

/// The requests the gate rejected: how many, and the first 16 in
/// words.
#[derive(Debug, Clone, Default)]
pub struct Rejected {
    /// How many.
    pub count: u64,
    /// Each: from where, for which connection, why.
    pub named: Vec<String>,
}

#[derive(Debug, Default)]
struct Shared {
    bindings: Mutex<Vec<Binding>>,
    next_id: AtomicU64,
    rejected: Mutex<Rejected>,
    stop: AtomicBool,
}

impl Shared {
    fn judge(&self, req: CmRequest) {
        let from = req.peer_addr();
        let judged = {
            let mut b = self.bindings.lock();
            judge_request(&mut b, req.private_data(), from)
                .map(|(i, conn)| (b[i].route.as_ref().map(|(_, tx)| tx.clone()), conn))
        };
        let reason = match judged {
            Ok((Some(tx), conn)) => match tx.send((conn, req.pending())) {
                Ok(()) => return,
                // Dropping the request rejects it.
                Err(_) => format!("connection {conn}: its handshake has ended"),
            },
            Ok((None, conn)) => format!("connection {conn}: its handshake has ended"),
            Err(reason) => {
                if let Err(e) = req.reject(&reason) {
                    tracing::warn!("rdma_cm gate: {e}");
                }
                reason
            }
        };
        let from = from.map_or_else(|| "an unknown address".to_string(), |a| a.to_string());
        tracing::warn!(%from, "rdma_cm request rejected: {reason}");
        eprintln!("cqd-demo serve: rejected an rdma_cm request from {from}: {reason}");
        let mut r = self.rejected.lock();
        r.count += 1;
        if r.named.len() < NAMED {
            r.named
                .push(format!("rdma_cm request from {from}: {reason}"));
        }
    }
}

/// The gate: its thread and what it shares with the handshakes.
#[derive(Debug)]
pub(crate) struct Gate {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Gate {
    /// Starts the gate's thread on `listener`.
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub(crate) fn start(listener: CmListener) -> Result<Gate, DemoError> {
        let shared = Arc::new(Shared::default());
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("cqd-demo-cm-gate".into())
            .spawn(move || {
                while !sh.stop.load(Ordering::Acquire) {
                    match listener.next(POLL) {
                        Ok(Some(req)) => sh.judge(req),
                        Ok(None) => {}
                        Err(e) => {
                            tracing::warn!("rdma_cm gate: {e}");
                            std::thread::sleep(POLL);
                        }
                    }
                }
                // The listener is dropped here: requests still queued are
                // rejected with it.
            })
            .map_err(|e| DemoError::Setup(format!("rdma_cm gate thread: {e}")))?;
        Ok(Gate {
            shared,
            thread: Some(thread),
        })
    }

    /// Binds a handshake that reached H3 (session key `key`, its load at
    /// `peer`, `connections` connections): its requests are passed on to
    /// the [`Bound`] returned, for as long as that lives.
    pub(crate) fn bind(&self, key: SessionKey, peer: IpAddr, connections: u32) -> Bound {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        let mut b = Binding::new(key, peer, connections);
        b.route = Some((id, tx));
        self.shared.bindings.lock().push(b);
        Bound {
            id,
            rx,
            shared: Arc::clone(&self.shared),
        }
    }

    /// Stops the gate (its listener with it) and says what it rejected.
    pub(crate) fn stop(mut self) -> Rejected {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        self.shared.rejected.lock().clone()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A handshake's (then its session's) place at the gate
/// ([`Gate::bind`]); dropped, the gate forgets it.
#[derive(Debug)]
pub(crate) struct Bound {
    id: u64,
    rx: mpsc::Receiver<(u32, PendingCm)>,
    shared: Arc<Shared>,
}

impl Bound {
    /// The handshake's next request passed on, with its connection
    /// number, before `until` and unless the server ends the handshake
    /// (`ticket`).
    ///
    /// # Errors
    /// Why none came, in words.
    pub(crate) fn next(
        &self,
        until: Instant,
        ticket: &TicketState,
    ) -> Result<(u32, PendingCm), DemoError> {
        loop {
            if let Some(why) = ticket.ended() {
                return Err(net(why));
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(net(
                    "no rdma_cm connection request before the handshake's deadline".into(),
                ));
            }
            match self.rx.recv_timeout(left.min(POLL)) {
                Ok(x) => return Ok(x),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(net("the rdma_cm gate stopped".into()))
                }
            }
        }
    }
}

impl Drop for Bound {
    fn drop(&mut self) {
        self.shared
            .bindings
            .lock()
            .retain(|b| b.route.as_ref().is_none_or(|(id, _)| *id != self.id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{nonce, CM_MAC_LEN};

    fn at(ip: &str) -> Option<SocketAddr> {
        Some(SocketAddr::new(ip.parse().unwrap(), 40000))
    }

    #[test]
    fn a_request_passes_only_with_its_sessions_mac_from_its_load_in_order() {
        let (k, other) = (
            SessionKey::from_token(&nonce().unwrap(), &nonce().unwrap()),
            SessionKey::from_token(&nonce().unwrap(), &nonce().unwrap()),
        );
        let mut b = vec![
            Binding::new(other.clone(), "10.0.0.9".parse().unwrap(), 1),
            Binding::new(k.clone(), "10.0.0.1".parse().unwrap(), 2),
        ];
        let req = |key: &SessionKey, conn: u32| cm::request_data(conn, &key.cm_mac(conn));
        // Not ours, a stranger's MAC, another connection's MAC.
        let e = judge_request(&mut b, b"garbage", at("10.0.0.1")).unwrap_err();
        assert!(e.contains("not a cqd-demo"), "{e}");
        let forged = cm::request_data(0, &[0u8; CM_MAC_LEN]);
        let e = judge_request(&mut b, &forged, at("10.0.0.1")).unwrap_err();
        assert!(e.contains("MAC is no session's"), "{e}");
        let mut swapped = req(&k, 1);
        swapped[8..12].copy_from_slice(&0u32.to_le_bytes());
        assert!(judge_request(&mut b, &swapped, at("10.0.0.1")).is_err());
        // The right MAC from another address (the check loopback tests
        // cannot make: their requests all come from 127.0.0.1).
        let e = judge_request(&mut b, &req(&k, 0), at("10.0.0.2")).unwrap_err();
        assert!(
            e.contains("from 10.0.0.2, not from its session's load 10.0.0.1"),
            "{e}"
        );
        let e = judge_request(&mut b, &req(&k, 0), None).unwrap_err();
        assert!(e.contains("an unknown address"), "{e}");
        // Out of order, then in order; a replay; beyond the count.
        let e = judge_request(&mut b, &req(&k, 1), at("10.0.0.1")).unwrap_err();
        assert!(e.contains("next is connection 0"), "{e}");
        assert_eq!(
            judge_request(&mut b, &req(&k, 0), at("10.0.0.1")),
            Ok((1, 0))
        );
        let e = judge_request(&mut b, &req(&k, 0), at("10.0.0.1")).unwrap_err();
        assert!(e.contains("already connected"), "{e}");
        // An IPv4 load seen through an IPv6 socket is the same load.
        assert_eq!(
            judge_request(&mut b, &req(&k, 1), at("::ffff:10.0.0.1")),
            Ok((1, 1))
        );
        let e = judge_request(&mut b, &req(&k, 2), at("10.0.0.1")).unwrap_err();
        assert!(e.contains("has 2 connection(s)"), "{e}");
        // The other session is untouched, and rdma_cm's zero padding is
        // ignored.
        let mut padded = req(&other, 0);
        padded.resize(56, 0);
        assert_eq!(judge_request(&mut b, &padded, at("10.0.0.9")), Ok((0, 0)));
    }
}
