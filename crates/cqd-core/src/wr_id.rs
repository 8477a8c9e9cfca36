//! The wr_id codec: what a completion carries home.
//!
//! Every work request cqd routes carries a 64-bit `wr_id` laid out as:
//!
//! ```text
//!  63   60 59  57 56          42 41             24 23              0
//! +-------+------+--------------+-----------------+-----------------+
//! |magic:4|kind:3|generation:15 |     slot:18     |     tag:24      |
//! +-------+------+--------------+-----------------+-----------------+
//! ```
//!
//! | field      | bits | meaning |
//! |------------|------|---------|
//! | magic      | 4    | [`MAGIC`]; anything else is a foreign wr_id (posted by code that did not use cqd, or corrupted) |
//! | kind       | 3    | the [`OpKind`] stored at post time; it routes the completion, also when `wc.opcode` is undefined (errors) |
//! | generation | 15   | the handler slot's generation when the request was posted; a mismatch is a stale completion. A slot does not wrap from [`MAX_GENERATION`] to 0 until quarantined (see [`crate::slab`] for when a slot and generation can be issued again) |
//! | slot       | 18   | the handler's index in the poller's slab (up to 262,144 handlers per CQ) |
//! | tag        | 24   | the user's cookie, handed back to the handler (a buffer index, a request id) |
//!
//! Decoding any `u64` never fails with a panic: it returns a [`Malformed`]
//! reason for values cqd did not make, which the poller counts.

use std::fmt;

/// Width of the user tag.
pub const TAG_BITS: u32 = 24;
/// Width of the handler slot.
pub const SLOT_BITS: u32 = 18;
/// Width of the generation.
pub const GEN_BITS: u32 = 15;
/// Width of the operation kind.
pub const KIND_BITS: u32 = 3;
/// Width of the magic marker.
pub const MAGIC_BITS: u32 = 4;

/// Position of the tag.
pub const TAG_SHIFT: u32 = 0;
/// Position of the slot.
pub const SLOT_SHIFT: u32 = TAG_SHIFT + TAG_BITS;
/// Position of the generation.
pub const GEN_SHIFT: u32 = SLOT_SHIFT + SLOT_BITS;
/// Position of the kind.
pub const KIND_SHIFT: u32 = GEN_SHIFT + GEN_BITS;
/// Position of the magic marker.
pub const MAGIC_SHIFT: u32 = KIND_SHIFT + KIND_BITS;

/// Mask of the tag (after shifting down).
pub const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
/// Mask of the slot (after shifting down).
pub const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// Mask of the generation (after shifting down).
pub const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
/// Mask of the kind (after shifting down).
pub const KIND_MASK: u64 = (1 << KIND_BITS) - 1;
/// Mask of the magic marker (after shifting down).
pub const MAGIC_MASK: u64 = (1 << MAGIC_BITS) - 1;

/// The marker in the top bits of every wr_id cqd makes.
pub const MAGIC: u64 = 0b1011;

/// Largest user tag.
pub const MAX_TAG: u32 = TAG_MASK as u32;
/// Largest slot index.
pub const MAX_SLOT: u32 = SLOT_MASK as u32;
/// Largest generation. A slot released under it is quarantined, and
/// restarts at 0 only when it leaves quarantine ([`crate::slab::QUARANTINE`]).
pub const MAX_GENERATION: u16 = GEN_MASK as u16;

const _: () = assert!(MAGIC_SHIFT + MAGIC_BITS == 64, "the fields fill 64 bits");

/// The operation a work request performs, stored in its wr_id at post time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum OpKind {
    /// SEND / SEND with immediate (send queue).
    Send = 0,
    /// RECV (receive queue or SRQ).
    Recv = 1,
    /// RDMA WRITE / WRITE with immediate (send queue).
    Write = 2,
    /// RDMA READ (send queue).
    Read = 3,
    /// Atomic compare-and-swap or fetch-and-add (send queue).
    Atomic = 4,
    /// A request cqd posts for itself (drain markers and the like).
    Internal = 5,
    /// A memory window bound or invalidated by the owner (send queue;
    /// `IBV_WR_BIND_MW`, `IBV_WR_LOCAL_INV`).
    Window = 6,
}

impl OpKind {
    /// Number of kinds (for per-kind tables).
    pub const COUNT: usize = 7;
    /// Every kind, in the order of their codes.
    pub const ALL: [OpKind; OpKind::COUNT] = [
        OpKind::Send,
        OpKind::Recv,
        OpKind::Write,
        OpKind::Read,
        OpKind::Atomic,
        OpKind::Internal,
        OpKind::Window,
    ];

    /// The queue the request was posted on, which decides the callback.
    #[inline]
    pub const fn side(self) -> Side {
        match self {
            OpKind::Recv => Side::Recv,
            _ => Side::Send,
        }
    }

    /// Index for per-kind tables.
    #[inline]
    pub const fn index(self) -> usize {
        self as usize
    }

    /// The kind with this code, if any.
    #[inline]
    pub const fn from_code(code: u8) -> Option<OpKind> {
        match code {
            0 => Some(OpKind::Send),
            1 => Some(OpKind::Recv),
            2 => Some(OpKind::Write),
            3 => Some(OpKind::Read),
            4 => Some(OpKind::Atomic),
            5 => Some(OpKind::Internal),
            6 => Some(OpKind::Window),
            _ => None,
        }
    }

    /// Lower-case name for reports.
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Write => "write",
            OpKind::Read => "read",
            OpKind::Atomic => "atomic",
            OpKind::Internal => "internal",
            OpKind::Window => "window",
        }
    }
}

impl fmt::Display for OpKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The side of a queue pair a completion belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// Send queue: SEND, WRITE, READ, atomics.
    Send,
    /// Receive queue (or SRQ).
    Recv,
}

/// Names a handler: its slab slot and the slot's generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandlerKey {
    slot: u32,
    generation: u16,
}

impl HandlerKey {
    /// A key; `None` if either part is out of its field's range.
    pub const fn new(slot: u32, generation: u16) -> Option<Self> {
        if slot > MAX_SLOT || generation > MAX_GENERATION {
            None
        } else {
            Some(HandlerKey { slot, generation })
        }
    }

    /// The slab slot.
    #[inline]
    pub const fn slot(self) -> u32 {
        self.slot
    }

    /// The slot's generation.
    #[inline]
    pub const fn generation(self) -> u16 {
        self.generation
    }

    /// Encodes a wr_id for a request of `kind` carrying `tag`.
    ///
    /// # Errors
    /// [`WrIdError::TagTooLarge`] if `tag` does not fit in [`TAG_BITS`].
    #[inline]
    pub const fn wr_id(self, kind: OpKind, tag: u32) -> Result<u64, WrIdError> {
        if tag > MAX_TAG {
            return Err(WrIdError::TagTooLarge { tag, max: MAX_TAG });
        }
        Ok(WrId {
            kind,
            key: self,
            tag,
        }
        .encode())
    }
}

impl fmt::Display for HandlerKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.slot, self.generation)
    }
}

/// Every 3-bit kind code, decoded (a table: one load, no branch chain).
const KIND_BY_CODE: [Option<OpKind>; 1 << KIND_BITS] = {
    let mut t = [None; 1 << KIND_BITS];
    let mut code = 0;
    while code < t.len() {
        t[code] = OpKind::from_code(code as u8);
        code += 1;
    }
    t
};

/// A decoded wr_id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WrId {
    /// The operation kind stored at post time.
    pub kind: OpKind,
    /// The handler that posted the request.
    pub key: HandlerKey,
    /// The user's cookie.
    pub tag: u32,
}

impl WrId {
    /// Packs the fields into a `u64`. Fields are masked to their widths;
    /// [`HandlerKey::new`] and [`HandlerKey::wr_id`] check the ranges.
    #[inline]
    pub const fn encode(self) -> u64 {
        (MAGIC << MAGIC_SHIFT)
            | ((self.kind as u64 & KIND_MASK) << KIND_SHIFT)
            | ((self.key.generation as u64 & GEN_MASK) << GEN_SHIFT)
            | ((self.key.slot as u64 & SLOT_MASK) << SLOT_SHIFT)
            | ((self.tag as u64 & TAG_MASK) << TAG_SHIFT)
    }

    /// Unpacks a raw wr_id. Never panics, whatever the value.
    ///
    /// # Errors
    /// [`Malformed`] for values cqd did not make.
    #[inline]
    pub const fn decode(raw: u64) -> Result<WrId, Malformed> {
        if (raw >> MAGIC_SHIFT) & MAGIC_MASK != MAGIC {
            return Err(Malformed::Foreign);
        }
        let code = ((raw >> KIND_SHIFT) & KIND_MASK) as usize;
        let kind = match KIND_BY_CODE[code] {
            Some(kind) => kind,
            None => return Err(Malformed::BadKind(code as u8)),
        };
        Ok(WrId {
            kind,
            key: HandlerKey {
                slot: ((raw >> SLOT_SHIFT) & SLOT_MASK) as u32,
                generation: ((raw >> GEN_SHIFT) & GEN_MASK) as u16,
            },
            tag: ((raw >> TAG_SHIFT) & TAG_MASK) as u32,
        })
    }
}

/// Why a raw wr_id could not be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Malformed {
    /// The magic marker is missing: not a cqd wr_id.
    #[error("foreign wr_id (no cqd marker)")]
    Foreign,
    /// The marker is there but the kind code is not one cqd uses.
    #[error("wr_id has an invalid operation kind code {0}")]
    BadKind(u8),
}

/// Errors while making a wr_id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WrIdError {
    /// The tag needs more than [`TAG_BITS`] bits.
    #[error("wr_id tag {tag} does not fit in {TAG_BITS} bits (max {max})")]
    TagTooLarge {
        /// The tag that was asked for.
        tag: u32,
        /// The largest tag that fits.
        max: u32,
    },
    /// The kind is cqd's own ([`OpKind::Internal`], drain markers): a
    /// handler cannot post it (its completion goes to no handler).
    #[error("kind `internal` is reserved for cqd's own requests (drain markers)")]
    Reserved,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn kind() -> impl Strategy<Value = OpKind> {
        (0u8..6).prop_map(|c| OpKind::from_code(c).unwrap())
    }

    proptest! {
        #[test]
        fn round_trip(kind in kind(), slot in 0..=MAX_SLOT, gen in 0..=MAX_GENERATION, tag in 0..=MAX_TAG) {
            let key = HandlerKey::new(slot, gen).unwrap();
            let raw = key.wr_id(kind, tag).unwrap();
            let back = WrId::decode(raw).unwrap();
            prop_assert_eq!(back, WrId { kind, key, tag });
        }

        #[test]
        fn decode_never_panics(raw in any::<u64>()) {
            match WrId::decode(raw) {
                Ok(w) => prop_assert_eq!(w.encode(), raw),
                Err(Malformed::Foreign) => prop_assert_ne!(raw >> MAGIC_SHIFT, MAGIC),
                Err(Malformed::BadKind(c)) => prop_assert!(c >= 6),
            }
        }
    }

    #[test]
    fn limits() {
        for kind in OpKind::ALL {
            for (slot, gen, tag) in [(0, 0, 0), (MAX_SLOT, MAX_GENERATION, MAX_TAG)] {
                let key = HandlerKey::new(slot, gen).unwrap();
                let w = WrId::decode(key.wr_id(kind, tag).unwrap()).unwrap();
                assert_eq!(
                    (w.kind, w.key.slot(), w.key.generation(), w.tag),
                    (kind, slot, gen, tag)
                );
            }
        }
        assert!(HandlerKey::new(MAX_SLOT + 1, 0).is_none());
        assert!(HandlerKey::new(0, MAX_GENERATION + 1).is_none());
        let key = HandlerKey::new(1, 1).unwrap();
        assert_eq!(
            key.wr_id(OpKind::Send, MAX_TAG + 1),
            Err(WrIdError::TagTooLarge {
                tag: MAX_TAG + 1,
                max: MAX_TAG
            })
        );
    }

    #[test]
    fn foreign_values() {
        assert_eq!(WrId::decode(0), Err(Malformed::Foreign));
        assert_eq!(WrId::decode(u64::MAX), Err(Malformed::Foreign));
        let bad_kind = (MAGIC << MAGIC_SHIFT) | (7 << KIND_SHIFT);
        assert_eq!(WrId::decode(bad_kind), Err(Malformed::BadKind(7)));
    }

    #[test]
    fn side_follows_kind() {
        assert_eq!(OpKind::Recv.side(), Side::Recv);
        for k in [
            OpKind::Send,
            OpKind::Write,
            OpKind::Read,
            OpKind::Atomic,
            OpKind::Internal,
            OpKind::Window,
        ] {
            assert_eq!(k.side(), Side::Send);
        }
    }
}
