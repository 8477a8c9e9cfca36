//! The protocol's message socket ([`Wire`]): JSON lines under one
//! deadline, sealed after the welcome (S1–S3 of the protocol in
//! `crate::net`).

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{escaped, net, parse_message, Msg, MAX_LINE};
use crate::auth::{Direction, SessionKey};
use crate::DemoError;

/// One half of a socket under a deadline: each read or write waits at
/// most until it, however the bytes trickle in.
#[derive(Debug)]
struct Timed {
    stream: TcpStream,
    deadline: Option<Instant>,
}

impl Timed {
    /// The time left (None: no deadline).
    ///
    /// # Errors
    /// `TimedOut` once the deadline has passed.
    fn left(&self) -> io::Result<Option<Duration>> {
        let Some(d) = self.deadline else {
            return Ok(None);
        };
        let left = d.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        Ok(Some(left))
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_read_timeout(left)?;
        self.stream.read(buf)
    }
}

impl Write for Timed {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let left = self.left()?;
        self.stream.set_write_timeout(left)?;
        self.stream.write(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

fn io_error(peer: &str, what: &str, e: &io::Error) -> DemoError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => net(format!(
            "{peer}: {what}: not done before the handshake's deadline"
        )),
        _ => net(format!("{peer}: {what}: {e}")),
    }
}

/// Seals `m` as message `seq` going `dir` under `key` (S1).
///
/// # Errors
/// `m` is itself sealed, or does not encode.
pub fn seal<E: Serialize>(
    key: &SessionKey,
    dir: Direction,
    seq: u64,
    m: &Msg<E>,
) -> Result<Msg<E>, String> {
    if matches!(m, Msg::Sealed { .. }) {
        return Err("a seal inside a seal".into());
    }
    let body = serde_json::to_string(m).map_err(|e| format!("encode {}: {e}", m.name()))?;
    let mac = key.control_mac(dir, seq, body.as_bytes());
    Ok(Msg::Sealed { seq, body, mac })
}

/// The sending side of a session's sealed messages (S1, S2): its key, its
/// direction and the number of its next message.
#[derive(Debug, Clone)]
pub struct Seal {
    key: SessionKey,
    dir: Direction,
    next: u64,
}

impl Seal {
    /// The seal of messages going `dir` under `key`, numbered from 0.
    pub fn new(key: SessionKey, dir: Direction) -> Seal {
        Seal { key, dir, next: 0 }
    }

    /// `m`, sealed as the next message.
    ///
    /// # Errors
    /// As [`seal`] (the number is not used up).
    pub fn seal<E: Serialize>(&mut self, m: &Msg<E>) -> Result<Msg<E>, String> {
        let sealed = seal(&self.key, self.dir, self.next, m)?;
        self.next += 1;
        Ok(sealed)
    }
}

/// The receiving side of a session's sealed messages (S2): its key, the
/// direction it takes and the number it expects next.
#[derive(Debug, Clone)]
pub struct Open {
    key: SessionKey,
    dir: Direction,
    next: u64,
}

impl Open {
    /// The opening of messages coming `dir` under `key`, from number 0.
    pub fn new(key: SessionKey, dir: Direction) -> Open {
        Open { key, dir, next: 0 }
    }

    /// S2: the message inside `m`, if `m` is the next sealed message of
    /// this session in this direction (pure: the fuzz target `handshake`
    /// runs it on anything).
    ///
    /// # Errors
    /// Why not, in words (for the refusal): `m` unsealed, a MAC that is
    /// not this session's, another number than the next, a body that is
    /// not a message or is sealed itself.
    pub fn open<E: DeserializeOwned>(&mut self, m: Msg<E>) -> Result<Msg<E>, String> {
        let (seq, body, mac) = match m {
            Msg::Sealed { seq, body, mac } => (seq, body, mac),
            Msg::Refused { reason } => {
                return Err(format!(
                    "an unsealed refused, where only sealed messages are taken: {}",
                    escaped(&reason)
                ))
            }
            other => {
                return Err(format!(
                    "an unsealed {}, where only sealed messages are taken",
                    other.name()
                ))
            }
        };
        if !self
            .key
            .check_control_mac(self.dir, seq, body.as_bytes(), &mac)
        {
            return Err(format!(
                "sealed message {seq}: its MAC is not this session's (altered, or not sealed \
                 with this session's key)"
            ));
        }
        if seq != self.next {
            return Err(format!(
                "sealed message {seq} where {} was next (replayed, dropped or reordered)",
                self.next
            ));
        }
        let inner = parse_message::<E>(body.as_bytes())
            .map_err(|e| format!("sealed message {seq}: {e}"))?;
        if matches!(inner, Msg::Sealed { .. }) {
            return Err(format!("sealed message {seq}: a seal inside a seal"));
        }
        self.next += 1;
        Ok(inner)
    }
}

/// A wire's sending half.
#[derive(Debug)]
pub(crate) struct Outgoing {
    peer: String,
    stream: Timed,
    seal: Option<Seal>,
}

impl Outgoing {
    /// Sends `m`, sealed once the wire is.
    pub(crate) fn send<E: Serialize>(&mut self, m: &Msg<E>) -> Result<(), DemoError> {
        match &mut self.seal {
            Some(s) => {
                let sealed = s.seal(m).map_err(|e| net(format!("{}: {e}", self.peer)))?;
                self.send_raw(&sealed)
            }
            None => self.send_raw(m),
        }
    }

    fn send_raw<E: Serialize>(&mut self, m: &Msg<E>) -> Result<(), DemoError> {
        let mut line = serde_json::to_vec(m)
            .map_err(|e| net(format!("{}: encode {}: {e}", self.peer, m.name())))?;
        line.push(b'\n');
        self.stream
            .write_all(&line)
            .and_then(|()| self.stream.flush())
            .map_err(|e| io_error(&self.peer, &format!("send {}", m.name()), &e))
    }

    /// Closes both directions of the socket.
    pub(crate) fn shutdown(&self) {
        let _ = self.stream.stream.shutdown(Shutdown::Both);
    }
}

/// A wire's receiving half.
#[derive(Debug)]
pub(crate) struct Incoming {
    peer: String,
    reader: BufReader<Timed>,
    open: Option<Open>,
}

impl Incoming {
    /// The next message, opened once the wire is sealed.
    pub(crate) fn recv<E: DeserializeOwned>(&mut self) -> Result<Msg<E>, DemoError> {
        let m = self.recv_raw()?;
        self.open(m)
    }

    fn open<E: DeserializeOwned>(&mut self, m: Msg<E>) -> Result<Msg<E>, DemoError> {
        match &mut self.open {
            Some(o) => o.open(m).map_err(|e| net(format!("{}: {e}", self.peer))),
            None => Ok(m),
        }
    }

    fn recv_raw<E: DeserializeOwned>(&mut self) -> Result<Msg<E>, DemoError> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|e| io_error(&self.peer, "receive", &e))?;
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
}

/// A message socket: JSON lines to and from one peer, every read and write
/// under the wire's deadline, and after [`Wire::seal`] every message
/// sealed and opened (S1–S3).
#[derive(Debug)]
pub struct Wire {
    peer: String,
    out: Outgoing,
    inc: Incoming,
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
            out: Outgoing {
                peer: peer.clone(),
                stream: Timed {
                    stream,
                    deadline: None,
                },
                seal: None,
            },
            inc: Incoming {
                peer: peer.clone(),
                reader: BufReader::new(Timed {
                    stream: reader,
                    deadline: None,
                }),
                open: None,
            },
            peer,
        })
    }

    /// The peer's name.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Sets the deadline of every later read and write (None: none).
    pub fn set_deadline(&mut self, deadline: Option<Instant>) {
        self.out.stream.deadline = deadline;
        self.inc.reader.get_mut().deadline = deadline;
    }

    /// Seals every later message with `key`: those this side sends go
    /// `sending`, those it takes come the other way (S1, S2).
    pub fn seal(&mut self, key: SessionKey, sending: Direction) {
        let taking = match sending {
            Direction::LoadToServer => Direction::ServerToLoad,
            Direction::ServerToLoad => Direction::LoadToServer,
        };
        self.out.seal = Some(Seal::new(key.clone(), sending));
        self.inc.open = Some(Open::new(key, taking));
    }

    /// Whether the wire is sealed.
    pub fn is_sealed(&self) -> bool {
        self.out.seal.is_some()
    }

    /// Sends one message (sealed, once the wire is).
    ///
    /// # Errors
    /// The peer is gone, or the deadline passed.
    pub fn send<E: Serialize>(&mut self, m: &Msg<E>) -> Result<(), DemoError> {
        self.out.send(m)
    }

    /// Sends one message unsealed, sealed wire or not (the load's refusal
    /// of a welcome, H4).
    ///
    /// # Errors
    /// As [`Wire::send`].
    pub fn send_unsealed<E: Serialize>(&mut self, m: &Msg<E>) -> Result<(), DemoError> {
        self.out.send_raw(m)
    }

    /// Sends `refused` {reason}, if the peer still listens.
    pub fn refuse(&mut self, reason: &str) {
        let _ = self.send(&Msg::<()>::Refused {
            reason: reason.to_string(),
        });
    }

    /// Receives one message (opened, once the wire is sealed).
    ///
    /// # Errors
    /// The peer closed the connection, the deadline passed, the line is too
    /// long or not a message, or it is not the next sealed message (S2).
    pub fn recv<E: DeserializeOwned>(&mut self) -> Result<Msg<E>, DemoError> {
        self.inc.recv()
    }

    /// Receives one message as it came, sealed or not.
    ///
    /// # Errors
    /// As [`Wire::recv`], but for the seal.
    pub fn recv_unopened<E: DeserializeOwned>(&mut self) -> Result<Msg<E>, DemoError> {
        self.inc.recv_raw()
    }

    /// Opens a message [`Wire::recv_unopened`] gave (S2).
    ///
    /// # Errors
    /// As [`Open::open`].
    pub fn open<E: DeserializeOwned>(&mut self, m: Msg<E>) -> Result<Msg<E>, DemoError> {
        self.inc.open(m)
    }

    /// Closes both directions of the socket.
    pub fn shutdown(&self) {
        self.out.shutdown();
    }

    /// The two halves (a reader thread takes one).
    pub(crate) fn split(self) -> (Outgoing, Incoming) {
        (self.out, self.inc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{nonce, SessionKey};

    fn key() -> SessionKey {
        SessionKey::from_token(&nonce().unwrap(), &nonce().unwrap())
    }

    #[test]
    fn sealed_messages_open_once_in_order_and_only_unaltered() {
        let k = key();
        let mut seal = Seal::new(k.clone(), Direction::LoadToServer);
        let mut open = Open::new(k.clone(), Direction::LoadToServer);
        let join = seal.seal(&Msg::<()>::Join).unwrap();
        let done = seal.seal(&Msg::<()>::Done).unwrap();
        assert!(matches!(open.open(join.clone()), Ok(Msg::Join)));
        // Replayed: the number was used.
        let e = open.open(join).unwrap_err();
        assert!(e.contains("where 1 was next"), "{e}");
        // Altered: the body, or the number.
        let Msg::Sealed { seq, body, mac } = done.clone() else {
            unreachable!()
        };
        for altered in [
            Msg::<()>::Sealed {
                seq,
                body: body.replace("done", "join"),
                mac: mac.clone(),
            },
            Msg::Sealed {
                seq: seq + 1,
                body: body.clone(),
                mac: mac.clone(),
            },
        ] {
            let e = open.open(altered).unwrap_err();
            assert!(e.contains("MAC is not this session's"), "{e}");
        }
        // Another direction's, or another session's.
        let mut back = Seal::new(k.clone(), Direction::ServerToLoad);
        let e = open.open(back.seal(&Msg::<()>::Done).unwrap());
        assert!(e.unwrap_err().contains("MAC"));
        let mut other = Seal::new(key(), Direction::LoadToServer);
        other.seal(&Msg::<()>::Join).unwrap();
        assert!(open.open(other.seal(&Msg::<()>::Done).unwrap()).is_err());
        // Unsealed, and sealed twice.
        let e = open.open(Msg::<()>::Done).unwrap_err();
        assert!(e.contains("an unsealed done"), "{e}");
        assert!(seal.seal(&done).is_err());
        let body = serde_json::to_string(&done).unwrap();
        let mac = k.control_mac(Direction::LoadToServer, 1, body.as_bytes());
        let e = open
            .open(Msg::<()>::Sealed { seq: 1, body, mac })
            .unwrap_err();
        assert!(e.contains("a seal inside a seal"), "{e}");
        // The genuine next one still opens.
        assert!(matches!(open.open(done), Ok(Msg::Done)));
    }
}
