//! The handshake's shared secret (`--secret-file`): a stranger who reaches
//! `serve`'s port cannot join, and a load does not trust a server that
//! cannot prove it knows the secret either.
//!
//! The exchange (docs/demo.md, "Trust and exposure"), inside the TCP
//! handshake of [`crate::net`]:
//!
//! 1. the load's `hello` carries a fresh nonce `L` (32 random bytes, hex);
//! 2. a server with a secret answers `challenge` with its own nonce `S`;
//! 3. the load answers `answer` with `HMAC-SHA-256(secret, "cqd-demo load" ‖
//!    S ‖ L)`; the server compares it in constant time and refuses a wrong
//!    or missing one, with the reason;
//! 4. the server's `welcome` carries `HMAC-SHA-256(secret, "cqd-demo
//!    server" ‖ L ‖ S)`, which the load checks before it connects a queue
//!    pair.
//!
//! Fresh nonces on both sides make an answer or a proof useless in another
//! session (a replayed `answer` meets a new `S`); the labels keep a load's
//! answer from passing as a server's proof. The secret itself never
//! crosses the wire. It is read from a file (not the command line, which
//! other users can see), 16 to 4,096 bytes, a trailing newline ignored; a
//! file its group or others may read or write is refused.
//!
//! After the `welcome`, both sides hold the session's key ([`SessionKey`]),
//! from which every later MAC is made:
//!
//! 5. `K = HMAC-SHA-256(ikm, "cqd-demo session" ‖ L ‖ S)`, where `ikm` is
//!    the secret, or, for a server without one, `S` itself: the server's
//!    nonce, which it then sends in its `welcome` as the session's token.
//!    Without a secret, whoever reads the TCP session can compute `K`.
//! 6. A control message's MAC ([`SessionKey::control_mac`]):
//!    `HMAC-SHA-256(K, label ‖ seq ‖ body)`, the label naming the
//!    direction ("cqd-demo load to server", "cqd-demo server to load"),
//!    `seq` its number in that direction (u64, big-endian).
//! 7. An rdma_cm request's MAC ([`SessionKey::cm_mac`]): the first
//!    [`CM_MAC_LEN`] bytes of `HMAC-SHA-256(K, "cqd-demo rdma_cm" ‖ L ‖ S ‖
//!    conn)`, `conn` the connection's number (u32, little-endian): a
//!    request's private data holds 56 bytes, and 128 bits of HMAC are as
//!    hard to forge as the key is to guess.

use std::fmt;
use std::io::Read;
use std::path::Path;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::DemoError;

/// Bytes of a nonce.
pub const NONCE_LEN: usize = 32;
/// Hex digits of a nonce or a MAC on the wire.
pub const HEX_LEN: usize = 64;
/// The shortest secret taken.
pub const MIN_SECRET: usize = 16;
/// The longest secret taken.
pub const MAX_SECRET: usize = 4096;

/// Bytes of the MAC an rdma_cm request carries (step 7).
pub const CM_MAC_LEN: usize = 16;

const LOAD: &[u8] = b"cqd-demo load";
const SERVER: &[u8] = b"cqd-demo server";
const SESSION: &[u8] = b"cqd-demo session";
const LOAD_TO_SERVER: &[u8] = b"cqd-demo load to server";
const SERVER_TO_LOAD: &[u8] = b"cqd-demo server to load";
const RDMA_CM: &[u8] = b"cqd-demo rdma_cm";

fn hmac_of(key: &[u8]) -> Hmac<Sha256> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes a key of any length")
}

/// A shared secret. Its bytes are never printed.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// The secret in `path` (a trailing newline dropped).
    ///
    /// # Errors
    /// The file cannot be read, its group or others may read or write it
    /// (any of the mode bits `0o077`, as ssh refuses a private key; the
    /// mode is that of the opened file, the one read), or it holds fewer
    /// than [`MIN_SECRET`] or more than [`MAX_SECRET`] bytes.
    pub fn from_file(path: &Path) -> Result<Secret, DemoError> {
        let bad = |e: String| DemoError::Config(format!("--secret-file {}: {e}", path.display()));
        let mut file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
        let meta = file.metadata().map_err(|e| bad(e.to_string()))?;
        private_to_owner(&meta, path).map_err(bad)?;
        let mut bytes = Vec::new();
        (&mut file)
            .take(MAX_SECRET as u64 + 2)
            .read_to_end(&mut bytes)
            .map_err(|e| bad(e.to_string()))?;
        Secret::from_bytes(bytes).map_err(bad)
    }

    /// A secret from its bytes (a trailing newline dropped).
    ///
    /// # Errors
    /// Fewer than [`MIN_SECRET`] or more than [`MAX_SECRET`] bytes.
    pub fn from_bytes(mut bytes: Vec<u8>) -> Result<Secret, String> {
        if bytes.last() == Some(&b'\n') {
            bytes.pop();
            if bytes.last() == Some(&b'\r') {
                bytes.pop();
            }
        }
        if bytes.len() < MIN_SECRET || bytes.len() > MAX_SECRET {
            return Err(format!(
                "a secret of {} bytes: give {MIN_SECRET} to {MAX_SECRET} (e.g. `head -c 32 /dev/urandom | base64 > FILE`)",
                bytes.len()
            ));
        }
        Ok(Secret(bytes))
    }

    fn mac(&self, label: &[u8], first: &[u8; NONCE_LEN], second: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
        let mut m = hmac_of(&self.0);
        m.update(label);
        m.update(first);
        m.update(second);
        m
    }

    /// Step 3: the load's answer to the server's nonce `s`, for its own
    /// nonce `l`.
    pub fn answer(&self, s: &[u8; NONCE_LEN], l: &[u8; NONCE_LEN]) -> String {
        hex(&self.mac(LOAD, s, l).finalize().into_bytes())
    }

    /// Step 3, the server's check of an answer (constant time). False for
    /// anything that is not 64 hex digits.
    pub fn check_answer(&self, s: &[u8; NONCE_LEN], l: &[u8; NONCE_LEN], answer: &str) -> bool {
        unhex(answer).is_some_and(|mac| self.mac(LOAD, s, l).verify_slice(&mac).is_ok())
    }

    /// Step 4: the server's proof for the load's nonce `l` and its own `s`.
    pub fn proof(&self, l: &[u8; NONCE_LEN], s: &[u8; NONCE_LEN]) -> String {
        hex(&self.mac(SERVER, l, s).finalize().into_bytes())
    }

    /// Step 4, the load's check of a proof (constant time).
    pub fn check_proof(&self, l: &[u8; NONCE_LEN], s: &[u8; NONCE_LEN], proof: &str) -> bool {
        unhex(proof).is_some_and(|mac| self.mac(SERVER, l, s).verify_slice(&mac).is_ok())
    }
}

/// Which way a control message goes: its MAC's label (step 6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Sent by the load.
    LoadToServer,
    /// Sent by the server.
    ServerToLoad,
}

impl Direction {
    fn label(self) -> &'static [u8] {
        match self {
            Direction::LoadToServer => LOAD_TO_SERVER,
            Direction::ServerToLoad => SERVER_TO_LOAD,
        }
    }
}

/// A session's key and its two nonces (steps 5 to 7). Its bytes are never
/// printed.
#[derive(Clone)]
pub struct SessionKey {
    key: [u8; 32],
    l: [u8; NONCE_LEN],
    s: [u8; NONCE_LEN],
}

impl fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SessionKey(..)")
    }
}

impl SessionKey {
    /// Step 5 with a shared secret: the key of the session whose load
    /// nonce is `l` and server nonce `s`.
    pub fn with_secret(secret: &Secret, l: &[u8; NONCE_LEN], s: &[u8; NONCE_LEN]) -> SessionKey {
        SessionKey {
            key: secret.mac(SESSION, l, s).finalize().into_bytes().into(),
            l: *l,
            s: *s,
        }
    }

    /// Step 5 without a secret: the server's nonce `s` is the session's
    /// token and the key's only secret (whoever read the `welcome` knows
    /// it).
    pub fn from_token(l: &[u8; NONCE_LEN], s: &[u8; NONCE_LEN]) -> SessionKey {
        let mut m = hmac_of(s);
        m.update(SESSION);
        m.update(l);
        m.update(s);
        SessionKey {
            key: m.finalize().into_bytes().into(),
            l: *l,
            s: *s,
        }
    }

    fn control(&self, dir: Direction, seq: u64, body: &[u8]) -> Hmac<Sha256> {
        let mut m = hmac_of(&self.key);
        m.update(dir.label());
        m.update(&seq.to_be_bytes());
        m.update(body);
        m
    }

    /// Step 6: the MAC of control message `seq` going `dir` with `body`,
    /// as 64 hex digits.
    pub fn control_mac(&self, dir: Direction, seq: u64, body: &[u8]) -> String {
        hex(&self.control(dir, seq, body).finalize().into_bytes())
    }

    /// Step 6, the receiver's check (constant time). False for anything
    /// that is not 64 hex digits.
    pub fn check_control_mac(&self, dir: Direction, seq: u64, body: &[u8], mac: &str) -> bool {
        unhex(mac).is_some_and(|m| self.control(dir, seq, body).verify_slice(&m).is_ok())
    }

    fn cm(&self, conn: u32) -> Hmac<Sha256> {
        let mut m = hmac_of(&self.key);
        m.update(RDMA_CM);
        m.update(&self.l);
        m.update(&self.s);
        m.update(&conn.to_le_bytes());
        m
    }

    /// Step 7: the MAC of this session's rdma_cm request for connection
    /// `conn`.
    pub fn cm_mac(&self, conn: u32) -> [u8; CM_MAC_LEN] {
        let full = self.cm(conn).finalize().into_bytes();
        let mut out = [0u8; CM_MAC_LEN];
        out.copy_from_slice(&full[..CM_MAC_LEN]);
        out
    }

    /// Step 7, the server's check (constant time): `mac` is this
    /// session's for connection `conn`. False for any other length.
    pub fn check_cm_mac(&self, conn: u32, mac: &[u8]) -> bool {
        mac.len() == CM_MAC_LEN && self.cm(conn).verify_truncated_left(mac).is_ok()
    }
}

/// The mode bits of group and others: a secret file with any of them set
/// is refused.
const SHARED_MODE_BITS: u32 = 0o077;

/// Whether the opened file `meta` (of `path`, named in the reason) is
/// private to its owner: no bit of [`SHARED_MODE_BITS`] set.
///
/// # Errors
/// Its mode lets the group or others read or write it; the reason gives
/// the mode and the `chmod` that fixes it.
#[cfg(unix)]
fn private_to_owner(meta: &std::fs::Metadata, path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & SHARED_MODE_BITS == 0 {
        return Ok(());
    }
    Err(format!(
        "mode {mode:04o} lets its group or others read or write it; a shared secret must be \
         private to its owner: chmod 600 {}",
        path.display()
    ))
}

/// Non-Unix systems have no mode bits to check.
#[cfg(not(unix))]
fn private_to_owner(_: &std::fs::Metadata, _: &Path) -> Result<(), String> {
    Ok(())
}

/// A fresh nonce from the kernel's random source.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub fn nonce() -> Result<[u8; NONCE_LEN], DemoError> {
    let mut n = [0u8; NONCE_LEN];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .map_err(|e| DemoError::Setup(format!("/dev/urandom: {e}")))?;
    Ok(n)
}

/// A nonce as the wire carries it.
pub fn nonce_hex(n: &[u8; NONCE_LEN]) -> String {
    hex(n)
}

/// A nonce read from the wire: exactly 64 hex digits, or why not.
///
/// # Errors
/// Anything else (in words, for the refusal).
pub fn parse_nonce(s: &str) -> Result<[u8; NONCE_LEN], String> {
    unhex(s).ok_or_else(|| {
        format!(
            "a nonce must be {HEX_LEN} hex digits, not {} characters",
            s.len()
        )
    })
}

fn hex(bytes: &[u8]) -> String {
    const D: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(2 * bytes.len());
    for b in bytes {
        s.push(D[usize::from(b >> 4)] as char);
        s.push(D[usize::from(b & 15)] as char);
    }
    s
}

fn unhex(s: &str) -> Option<[u8; NONCE_LEN]> {
    let b = s.as_bytes();
    if b.len() != HEX_LEN {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    let mut out = [0u8; NONCE_LEN];
    for (i, o) in out.iter_mut().enumerate() {
        *o = digit(b[2 * i])? << 4 | digit(b[2 * i + 1])?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> Secret {
        Secret::from_bytes(s.as_bytes().to_vec()).unwrap()
    }

    #[test]
    fn the_right_secret_answers_and_proves_and_no_other_does() {
        let (a, b) = (
            secret("correct horse battery"),
            secret("correct horse battery!"),
        );
        let (s, l) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(s, l);
        let ans = a.answer(&s, &l);
        assert_eq!(ans.len(), HEX_LEN);
        assert!(a.check_answer(&s, &l, &ans));
        assert!(
            a.check_answer(&s, &l, &ans.to_uppercase()),
            "hex in either case"
        );
        assert!(!b.check_answer(&s, &l, &ans), "another secret");
        assert!(!a.check_answer(&l, &s, &ans), "nonces swapped");
        let other = nonce().unwrap();
        assert!(
            !a.check_answer(&other, &l, &ans),
            "a replay meets a new nonce"
        );
        let proof = a.proof(&l, &s);
        assert!(a.check_proof(&l, &s, &proof));
        assert!(!a.check_proof(&l, &s, &ans), "an answer is no proof");
        assert!(!a.check_answer(&s, &l, &proof), "a proof is no answer");
        for bad in ["", "zz", &ans[..63], &format!("{ans}0"), &"g".repeat(64)] {
            assert!(!a.check_answer(&s, &l, bad), "{bad:?}");
        }
    }

    #[test]
    fn session_keys_bind_both_nonces_the_secret_and_the_direction() {
        let a = secret("correct horse battery");
        let (s, l) = (nonce().unwrap(), nonce().unwrap());
        let k = SessionKey::with_secret(&a, &l, &s);
        let others = [
            SessionKey::with_secret(&secret("correct horse battery!"), &l, &s),
            SessionKey::with_secret(&a, &s, &l),
            SessionKey::with_secret(&a, &nonce().unwrap(), &s),
            SessionKey::from_token(&l, &s),
        ];
        let dir = Direction::LoadToServer;
        let mac = k.control_mac(dir, 3, b"{\"msg\":\"done\"}");
        assert!(k.check_control_mac(dir, 3, b"{\"msg\":\"done\"}", &mac));
        assert!(
            !k.check_control_mac(dir, 4, b"{\"msg\":\"done\"}", &mac),
            "seq"
        );
        assert!(
            !k.check_control_mac(dir, 3, b"{\"msg\":\"join\"}", &mac),
            "body"
        );
        assert!(
            !k.check_control_mac(Direction::ServerToLoad, 3, b"{\"msg\":\"done\"}", &mac),
            "direction"
        );
        assert!(!k.check_control_mac(dir, 3, b"{\"msg\":\"done\"}", &mac[..63]));
        let cm = k.cm_mac(0);
        assert!(k.check_cm_mac(0, &cm));
        assert!(!k.check_cm_mac(1, &cm), "another connection");
        assert!(!k.check_cm_mac(0, &cm[..15]), "shorter");
        assert!(!k.check_cm_mac(0, &[0u8; CM_MAC_LEN]));
        for o in &others {
            assert!(!o.check_control_mac(dir, 3, b"{\"msg\":\"done\"}", &mac));
            assert!(!o.check_cm_mac(0, &cm));
        }
        // Without a secret, both sides derive the same key from the token.
        let t = SessionKey::from_token(&l, &s);
        assert!(SessionKey::from_token(&l, &s).check_cm_mac(7, &t.cm_mac(7)));
        assert_eq!(format!("{k:?}"), "SessionKey(..)", "never printed");
    }

    #[test]
    fn secrets_and_nonces_are_bounded() {
        assert!(Secret::from_bytes(b"short\n".to_vec()).is_err());
        assert!(Secret::from_bytes(vec![b'x'; MAX_SECRET + 1]).is_err());
        assert!(Secret::from_bytes(vec![b'x'; MAX_SECRET]).is_ok());
        let s = Secret::from_bytes(b"sixteen bytes!!!\r\n".to_vec()).unwrap();
        assert_eq!(format!("{s:?}"), "Secret(16 bytes)", "never printed");
        let n = nonce().unwrap();
        assert_eq!(parse_nonce(&nonce_hex(&n)), Ok(n));
        assert!(parse_nonce("abc").is_err());
        assert!(parse_nonce(&"é".repeat(32)).is_err());
    }
}
