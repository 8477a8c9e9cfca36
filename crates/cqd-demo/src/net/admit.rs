//! serve's admission of handshakes: A1–A4 of the protocol in `crate::net`.
//! The accepting loop (this thread) gives each TCP connection a thread of
//! its own and a [`Ticket`] it keeps; the [`Claim`] makes one session of
//! all the handshakes.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::serve::{handshake, Established, Offer};
use super::{net, Msg, MAX_HANDSHAKES};
use crate::backend::Node;
use crate::DemoError;

/// How long the accepting loop waits between looks at the listener.
const POLL: Duration = Duration::from_millis(20);

/// The most handshake threads alive at once, those being ended included
/// (A1 ends the oldest; its thread is gone within a moment).
const MAX_THREADS: usize = 2 * MAX_HANDSHAKES;

/// Why the server ended a pending handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Ended {
    /// Not ended.
    No = 0,
    /// A1: the oldest of [`MAX_HANDSHAKES`], ended to make room.
    Crowded = 1,
    /// A4: another load's session started.
    SessionStarted = 2,
    /// The server stops (no session before `--accept-timeout`, an accept
    /// error).
    Stopping = 3,
}

/// What a handshake's thread and the accepting loop share.
#[derive(Debug, Default)]
pub(crate) struct TicketState {
    /// An [`Ended`].
    ended: AtomicU8,
    /// The thread is done with the handshake.
    finished: AtomicBool,
    /// The handshake holds the claim (A3): A1 does not push it out.
    holding: AtomicBool,
}

impl TicketState {
    /// Why the server ended this handshake, if it did.
    pub(crate) fn ended(&self) -> Option<String> {
        let why = match self.ended.load(Ordering::Acquire) {
            x if x == Ended::Crowded as u8 => format!(
                "{MAX_HANDSHAKES} handshakes were pending on this server: the oldest, this one, \
                 is ended to make room"
            ),
            x if x == Ended::SessionStarted as u8 => {
                "another load's session has started on this server (it serves one)".to_string()
            }
            x if x == Ended::Stopping as u8 => "this server is stopping".to_string(),
            _ => return None,
        };
        Some(why)
    }

    fn finished(&self) -> bool {
        self.finished.load(Ordering::Acquire)
    }

    /// The handshake took the claim: from now on it ends by itself, by its
    /// deadline at the latest.
    pub(crate) fn hold(&self) {
        self.holding.store(true, Ordering::Release);
    }
}

/// The accepting loop's hold on one handshake: its thread's state and a
/// handle on its socket, to end it.
#[derive(Debug)]
struct Ticket {
    stream: TcpStream,
    state: Arc<TicketState>,
}

impl Ticket {
    /// Pending, and not being ended.
    fn pending(&self) -> bool {
        !self.state.finished() && self.state.ended.load(Ordering::Acquire) == Ended::No as u8
    }

    /// Pending and not holding the claim: one A1 may push out.
    fn live(&self) -> bool {
        self.pending() && !self.state.holding.load(Ordering::Acquire)
    }

    /// Ends the handshake: its thread, waiting on the socket, reads the
    /// end of the stream (or sees `why` where it waits for the claim or
    /// the CM gate) and answers `refused` with `why`.
    fn end(&self, why: Ended) {
        if self.state.finished() {
            return;
        }
        let _ = self.state.ended.compare_exchange(
            Ended::No as u8,
            why as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        let _ = self.stream.shutdown(Shutdown::Read);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ClaimState {
    /// No handshake holds the session.
    Free,
    /// A handshake is making its connections.
    Held,
    /// A session was established, or the server stops.
    Closed,
}

/// The server's one session (A3): held by one handshake at a time while it
/// makes its connections.
#[derive(Debug)]
pub(crate) struct Claim {
    state: Mutex<ClaimState>,
    cv: Condvar,
}

impl Claim {
    pub(crate) fn new() -> Claim {
        Claim {
            state: Mutex::new(ClaimState::Free),
            cv: Condvar::new(),
        }
    }

    /// Takes the claim, waiting while another handshake holds it, until
    /// `until` or until the server ends this handshake (`ticket`).
    ///
    /// # Errors
    /// The session was established or the server stops, the deadline
    /// passed, or the handshake was ended: why, in words.
    pub(crate) fn take(&self, until: Instant, ticket: &TicketState) -> Result<Claimed<'_>, String> {
        let mut g = self.state.lock();
        loop {
            match *g {
                ClaimState::Free => {
                    *g = ClaimState::Held;
                    return Ok(Claimed {
                        claim: self,
                        established: false,
                    });
                }
                ClaimState::Closed => {
                    return Err(ticket.ended().unwrap_or_else(|| {
                        "another load's session has started on this server (it serves one)".into()
                    }))
                }
                ClaimState::Held => {}
            }
            if let Some(why) = ticket.ended() {
                return Err(why);
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(
                    "the handshake's deadline passed while another load's session was starting"
                        .into(),
                );
            }
            let _ = self
                .cv
                .wait_for(&mut g, left.min(Duration::from_millis(100)));
        }
    }

    /// Closes the claim unless a handshake holds it: true when it is
    /// closed.
    fn close_unless_held(&self) -> bool {
        let mut g = self.state.lock();
        if *g == ClaimState::Held {
            return false;
        }
        *g = ClaimState::Closed;
        self.cv.notify_all();
        true
    }
}

/// A held claim: established ([`Claimed::establish`]) or, dropped, given
/// back.
#[derive(Debug)]
pub(crate) struct Claimed<'a> {
    claim: &'a Claim,
    established: bool,
}

impl Claimed<'_> {
    /// The handshake connected its last QP: the session is established and
    /// no other handshake will claim one.
    pub(crate) fn establish(mut self) {
        self.established = true;
        *self.claim.state.lock() = ClaimState::Closed;
        self.claim.cv.notify_all();
    }
}

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        if !self.established {
            let mut g = self.claim.state.lock();
            if *g == ClaimState::Held {
                *g = ClaimState::Free;
            }
            self.claim.cv.notify_all();
        }
    }
}

/// Says `reason` to a connection this loop cannot take, without waiting on
/// it, and closes it.
fn turn_away(stream: &TcpStream, addr: SocketAddr, reason: &str) {
    eprintln!("cqd-demo serve: refused load {addr}: {reason}");
    let _ = stream.set_nonblocking(true);
    if let Ok(mut line) = serde_json::to_vec(&Msg::<()>::Refused {
        reason: reason.to_string(),
    }) {
        line.push(b'\n');
        let _ = (&*stream).write_all(&line);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Runs admission (A1–A4) on `listener` until a handshake establishes the
/// session, or `until` (`--accept-timeout`) passes with no handshake
/// holding the claim.
///
/// # Errors
/// No session before `until`, an accept error.
pub(crate) fn run<N: Node>(
    listener: &TcpListener,
    until: Option<Instant>,
    offer: &Offer<'_, N>,
) -> Result<Established, DemoError> {
    listener
        .set_nonblocking(true)
        .map_err(|e| net(format!("listening socket: {e}")))?;
    let (tx, rx) = mpsc::channel::<Established>();
    std::thread::scope(|scope| {
        let mut pending: VecDeque<Ticket> = VecDeque::new();
        let result = loop {
            if let Ok(s) = rx.try_recv() {
                break Ok(s);
            }
            pending.retain(|t| !t.state.finished());
            let (stream, addr) = match listener.accept() {
                Ok(x) => x,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if until.is_some_and(|d| Instant::now() >= d) && offer.claim.close_unless_held()
                    {
                        break Err(net(
                            "no load session started before --accept-timeout; stopping".into(),
                        ));
                    }
                    if let Ok(s) = rx.recv_timeout(POLL) {
                        break Ok(s);
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => break Err(net(format!("accept: {e}"))),
            };
            // A1: room for this one, at the oldest's expense.
            if pending.iter().filter(|t| t.pending()).count() >= MAX_HANDSHAKES {
                if let Some(oldest) = pending.iter().find(|t| t.live()) {
                    oldest.end(Ended::Crowded);
                }
            }
            if pending.len() >= MAX_THREADS {
                turn_away(&stream, addr, "too many handshakes at once; try again");
                continue;
            }
            let handle = match stream
                .set_nonblocking(false)
                .and_then(|()| stream.try_clone())
            {
                Ok(h) => h,
                Err(e) => {
                    turn_away(&stream, addr, &format!("socket: {e}"));
                    continue;
                }
            };
            let state = Arc::new(TicketState::default());
            let (st, tx) = (Arc::clone(&state), tx.clone());
            let spawned = std::thread::Builder::new()
                .name("cqd-demo-handshake".into())
                .spawn_scoped(scope, move || {
                    let established = handshake(offer, stream, addr, &st);
                    // Finished before the session is handed over: ending
                    // the pending handshakes (A4) leaves this one alone.
                    st.finished.store(true, Ordering::Release);
                    if let Some(s) = established {
                        let _ = tx.send(s);
                    }
                });
            match spawned {
                Ok(_) => pending.push_back(Ticket {
                    stream: handle,
                    state,
                }),
                Err(e) => turn_away(&handle, addr, &format!("no thread for its handshake: {e}")),
            }
        };
        // A4: no handshake claims a session from now on; every pending one
        // ends, and the scope waits for their threads.
        let _ = offer.claim.close_unless_held();
        let why = if result.is_ok() {
            Ended::SessionStarted
        } else {
            Ended::Stopping
        };
        for t in &pending {
            t.end(why);
        }
        result
    })
}
