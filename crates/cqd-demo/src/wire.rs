//! The wire format of the block protocol: one fixed-size request (client →
//! server, by SEND) and one fixed-size reply (server → client, by SEND).
//! The data itself never travels in these messages: the request names the
//! client's buffer (address and rkey) and the server moves the block with
//! one-sided RDMA, as NVMe over Fabrics does.
//!
//! Both messages are [`MSG_LEN`] bytes, little-endian, and versioned:
//!
//! ```text
//! request                                 reply
//! 0..4   magic "CQDQ"                     0..4   magic "CQDR"
//! 4      version (1)                      4      version (1)
//! 5      op: 1 read, 2 write              5      op (echoed)
//! 6..8   slot (client's request slot)     6..8   slot (echoed)
//! 8..16  id (opaque, echoed)              8..16  id (echoed)
//! 16..24 block (server-local number)      16..18 status
//! 24..28 len (bytes, = block size)        18..24 zero
//! 28..32 rkey of the client's buffer      24..32 block (echoed)
//! 32..40 address of the client's buffer   32..64 zero
//! 40..64 zero
//! ```
//!
//! Decoding never panics: a short message, a wrong magic, an unknown
//! version, op or status, or a non-zero reserved byte is a [`WireError`].
//! Reserved bytes must be zero so that a later version can use them and an
//! old peer refuses instead of misreading.

use crate::backend::Remote;

/// The size of every request and reply, in bytes.
pub const MSG_LEN: usize = 64;
/// The protocol version this build speaks.
pub const VERSION: u8 = 1;

const REQ_MAGIC: [u8; 4] = *b"CQDQ";
const REPLY_MAGIC: [u8; 4] = *b"CQDR";

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BlockOp {
    /// Copy the block into the client's buffer (the server RDMA WRITEs).
    Read,
    /// Copy the client's buffer into the block (the server RDMA READs).
    Write,
}

impl BlockOp {
    fn code(self) -> u8 {
        match self {
            BlockOp::Read => 1,
            BlockOp::Write => 2,
        }
    }

    fn from_code(code: u8) -> Result<Self, WireError> {
        match code {
            1 => Ok(BlockOp::Read),
            2 => Ok(BlockOp::Write),
            other => Err(WireError::BadOp(other)),
        }
    }
}

/// A block request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Read or write.
    pub op: BlockOp,
    /// The client's request slot (its buffers for this request).
    pub slot: u16,
    /// An opaque id the reply echoes.
    pub id: u64,
    /// The block, numbered on the server.
    pub block: u64,
    /// Bytes to move (the block size).
    pub len: u32,
    /// The client's buffer.
    pub remote: Remote,
}

/// How the server answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ReplyStatus {
    /// Done: the data moved.
    Ok,
    /// The block is past the end of the device.
    OutOfRange,
    /// The length is not the device's block size.
    BadLength,
    /// The request could not be decoded.
    Malformed,
    /// The slot already has a request in progress on the server.
    SlotBusy,
}

impl ReplyStatus {
    fn code(self) -> u16 {
        match self {
            ReplyStatus::Ok => 0,
            ReplyStatus::OutOfRange => 1,
            ReplyStatus::BadLength => 2,
            ReplyStatus::Malformed => 3,
            ReplyStatus::SlotBusy => 4,
        }
    }

    fn from_code(code: u16) -> Result<Self, WireError> {
        Ok(match code {
            0 => ReplyStatus::Ok,
            1 => ReplyStatus::OutOfRange,
            2 => ReplyStatus::BadLength,
            3 => ReplyStatus::Malformed,
            4 => ReplyStatus::SlotBusy,
            other => return Err(WireError::BadStatus(other)),
        })
    }
}

/// The reply to a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    /// The request's op.
    pub op: BlockOp,
    /// The request's slot.
    pub slot: u16,
    /// The request's id.
    pub id: u64,
    /// The outcome.
    pub status: ReplyStatus,
    /// The request's block.
    pub block: u64,
}

/// Why a message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// Fewer bytes than a message.
    #[error("message of {len} bytes, expected {MSG_LEN}")]
    Length {
        /// Bytes received.
        len: usize,
    },
    /// Not a message of this protocol (or of the other direction).
    #[error("bad magic {0:02x?}")]
    BadMagic([u8; 4]),
    /// A version this build does not speak.
    #[error("protocol version {0}, this build speaks {VERSION}")]
    BadVersion(u8),
    /// An unknown op code.
    #[error("unknown op {0}")]
    BadOp(u8),
    /// An unknown reply status.
    #[error("unknown status {0}")]
    BadStatus(u16),
    /// A reserved byte is not zero.
    #[error("reserved byte {offset} is {value:#04x}, must be 0")]
    Reserved {
        /// Where.
        offset: usize,
        /// What it held.
        value: u8,
    },
}

fn u16_at(b: &[u8; MSG_LEN], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8; MSG_LEN], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8; MSG_LEN], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// Checks length, magic, version and reserved ranges; returns the fixed
/// array.
fn header<'a>(
    bytes: &'a [u8],
    magic: [u8; 4],
    reserved: &[(usize, usize)],
) -> Result<&'a [u8; MSG_LEN], WireError> {
    let b: &[u8; MSG_LEN] = bytes
        .try_into()
        .map_err(|_| WireError::Length { len: bytes.len() })?;
    let got = [b[0], b[1], b[2], b[3]];
    if got != magic {
        return Err(WireError::BadMagic(got));
    }
    if b[4] != VERSION {
        return Err(WireError::BadVersion(b[4]));
    }
    for &(from, to) in reserved {
        if let Some(offset) = (from..to).find(|&i| b[i] != 0) {
            return Err(WireError::Reserved {
                offset,
                value: b[offset],
            });
        }
    }
    Ok(b)
}

impl Request {
    /// The request as sent.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&REQ_MAGIC);
        b[4] = VERSION;
        b[5] = self.op.code();
        b[6..8].copy_from_slice(&self.slot.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..24].copy_from_slice(&self.block.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..32].copy_from_slice(&self.remote.rkey.to_le_bytes());
        b[32..40].copy_from_slice(&self.remote.addr.to_le_bytes());
        b
    }

    /// Decodes a received request (exactly [`MSG_LEN`] bytes).
    ///
    /// # Errors
    /// [`WireError`] for anything but a well-formed version-1 request.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let b = header(bytes, REQ_MAGIC, &[(40, MSG_LEN)])?;
        Ok(Request {
            op: BlockOp::from_code(b[5])?,
            slot: u16_at(b, 6),
            id: u64_at(b, 8),
            block: u64_at(b, 16),
            len: u32_at(b, 24),
            remote: Remote {
                rkey: u32_at(b, 28),
                addr: u64_at(b, 32),
            },
        })
    }

    /// The slot and id of a request that failed to decode, when its
    /// header is at least that of this protocol (right length and magic),
    /// so that the server can answer [`ReplyStatus::Malformed`] to the
    /// right slot instead of leaving the client waiting.
    pub fn salvage(bytes: &[u8]) -> Option<(u16, u64)> {
        let b: &[u8; MSG_LEN] = bytes.try_into().ok()?;
        (b[0..4] == REQ_MAGIC).then(|| (u16_at(b, 6), u64_at(b, 8)))
    }
}

impl Reply {
    /// The reply as sent.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..4].copy_from_slice(&REPLY_MAGIC);
        b[4] = VERSION;
        b[5] = self.op.code();
        b[6..8].copy_from_slice(&self.slot.to_le_bytes());
        b[8..16].copy_from_slice(&self.id.to_le_bytes());
        b[16..18].copy_from_slice(&self.status.code().to_le_bytes());
        b[24..32].copy_from_slice(&self.block.to_le_bytes());
        b
    }

    /// Decodes a received reply (exactly [`MSG_LEN`] bytes).
    ///
    /// # Errors
    /// [`WireError`] for anything but a well-formed version-1 reply.
    pub fn decode(bytes: &[u8]) -> Result<Self, WireError> {
        let b = header(bytes, REPLY_MAGIC, &[(18, 24), (32, MSG_LEN)])?;
        Ok(Reply {
            op: BlockOp::from_code(b[5])?,
            slot: u16_at(b, 6),
            id: u64_at(b, 8),
            status: ReplyStatus::from_code(u16_at(b, 16))?,
            block: u64_at(b, 24),
        })
    }

    /// The reply to `req` with `status`.
    pub fn to(req: &Request, status: ReplyStatus) -> Reply {
        Reply {
            op: req.op,
            slot: req.slot,
            id: req.id,
            status,
            block: req.block,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> Request {
        Request {
            op: BlockOp::Write,
            slot: 513,
            id: 0x0102_0304_0506_0708,
            block: 77,
            len: 4096,
            remote: Remote {
                addr: 0xdead_beef_0000,
                rkey: 0x55,
            },
        }
    }

    #[test]
    fn request_round_trips_at_fixed_offsets() {
        let r = req();
        let b = r.encode();
        assert_eq!(b.len(), MSG_LEN);
        assert_eq!(&b[0..4], b"CQDQ");
        assert_eq!(b[4], VERSION);
        assert_eq!(b[5], 2);
        assert_eq!(u16::from_le_bytes([b[6], b[7]]), 513);
        assert_eq!(b[16], 77);
        assert!(b[40..].iter().all(|&x| x == 0));
        assert_eq!(Request::decode(&b), Ok(r));
        let read = Request {
            op: BlockOp::Read,
            ..r
        };
        assert_eq!(Request::decode(&read.encode()), Ok(read));
    }

    #[test]
    fn reply_round_trips_for_every_status() {
        for status in [
            ReplyStatus::Ok,
            ReplyStatus::OutOfRange,
            ReplyStatus::BadLength,
            ReplyStatus::Malformed,
            ReplyStatus::SlotBusy,
        ] {
            let r = Reply::to(&req(), status);
            let b = r.encode();
            assert_eq!(&b[0..4], b"CQDR");
            assert_eq!(Reply::decode(&b), Ok(r));
        }
    }

    #[test]
    fn wrong_lengths_are_refused() {
        let b = req().encode();
        for len in [0, 1, 39, MSG_LEN - 1] {
            assert_eq!(Request::decode(&b[..len]), Err(WireError::Length { len }));
        }
        let mut long = b.to_vec();
        long.push(0);
        assert_eq!(
            Request::decode(&long),
            Err(WireError::Length { len: MSG_LEN + 1 })
        );
        assert!(Reply::decode(&[]).is_err());
    }

    #[test]
    fn a_reply_is_not_a_request_and_back() {
        let reply = Reply::to(&req(), ReplyStatus::Ok).encode();
        assert_eq!(Request::decode(&reply), Err(WireError::BadMagic(*b"CQDR")));
        assert_eq!(
            Reply::decode(&req().encode()),
            Err(WireError::BadMagic(*b"CQDQ"))
        );
    }

    #[test]
    fn other_versions_ops_statuses_and_reserved_bytes_are_refused() {
        let mut b = req().encode();
        b[4] = 2;
        assert_eq!(Request::decode(&b), Err(WireError::BadVersion(2)));
        let mut b = req().encode();
        b[5] = 9;
        assert_eq!(Request::decode(&b), Err(WireError::BadOp(9)));
        let mut b = req().encode();
        b[63] = 1;
        assert_eq!(
            Request::decode(&b),
            Err(WireError::Reserved {
                offset: 63,
                value: 1
            })
        );
        let mut r = Reply::to(&req(), ReplyStatus::Ok).encode();
        r[16] = 200;
        assert_eq!(Reply::decode(&r), Err(WireError::BadStatus(200)));
        let mut r = Reply::to(&req(), ReplyStatus::Ok).encode();
        r[20] = 7;
        assert_eq!(
            Reply::decode(&r),
            Err(WireError::Reserved {
                offset: 20,
                value: 7
            })
        );
    }

    #[test]
    fn salvage_finds_the_slot_of_a_broken_request_only() {
        let mut b = req().encode();
        b[5] = 0;
        assert!(Request::decode(&b).is_err());
        assert_eq!(Request::salvage(&b), Some((513, 0x0102_0304_0506_0708)));
        assert_eq!(Request::salvage(&b[..10]), None);
        assert_eq!(
            Request::salvage(&Reply::to(&req(), ReplyStatus::Ok).encode()),
            None
        );
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap exhaustive-ish sweep: every single-byte corruption of a
        // valid message, and pseudo-random garbage.
        let good = req().encode();
        for i in 0..MSG_LEN {
            for v in [0u8, 1, 0x7f, 0xff] {
                let mut b = good;
                b[i] = v;
                let _ = Request::decode(&b);
                let _ = Reply::decode(&b);
                let _ = Request::salvage(&b);
            }
        }
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            let mut b = [0u8; MSG_LEN];
            for byte in &mut b {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *byte = x as u8;
            }
            assert!(Request::decode(&b).is_err() || b[0..4] == *b"CQDQ");
            let _ = Reply::decode(&b);
        }
    }
}
