//! Layouts of the shared segments. Every field another process reads or
//! writes concurrently is atomic; the rest is written once by the creator
//! before the segment's name can be known to anybody else.

use std::mem::size_of;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};

use super::doorbell::Doorbell;
use super::insiders::Insiders;
use super::ring::Ring;

/// Magic at the start of every segment header ("SVB1").
pub const MAGIC: u32 = 0x5356_4231;

/// Scatter/gather entries per receive WQE.
pub const MAX_SGE: usize = 8;

/// Memory-region slots per context.
pub const MR_SLOTS: usize = 4096;

/// Bits of an lkey/rkey that index the MR table (bits 8..20; the low 8
/// bits are the consumer's key byte, which `ibv_inc_rkey` changes for a
/// memory window, the top 12 a generation).
pub const MR_INDEX_BITS: u32 = 12;

/// The key of slot `index` with tag `tag` (its low 8 bits become the key
/// byte, the next 12 the generation bits).
pub fn make_key(index: u32, tag: u32) -> u32 {
    (((tag >> 8) & 0xfff) << 20) | ((index & ((1 << MR_INDEX_BITS) - 1)) << 8) | (tag & 0xff)
}

/// The slot a key names.
pub fn key_index(key: u32) -> usize {
    ((key >> 8) & ((1 << MR_INDEX_BITS) - 1)) as usize
}

/// A context's header, followed by the MR table.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct CtxHeader {
    /// [`MAGIC`].
    pub magic: u32,
    /// Owning process.
    pub pid: u32,
    /// Read end of the async-event pipe in the owner (opened by peers through
    /// `/proc/<pid>/fd/<n>` to raise asynchronous events).
    pub async_fd: i32,
    /// Context id.
    pub id: u32,
    /// Non-zero once the device died for this context
    /// (`softverbs_inject_device_fatal`): requesters of every process check
    /// it before touching the context's QPs, MRs or CQs.
    pub dead: AtomicU32,
    _pad: u32,
    /// Inode of the async-event pipe: a peer that opened
    /// `/proc/<pid>/fd/<async_fd>` checks it, so a descriptor number reused
    /// after the context closed never receives an event record.
    pub async_ino: u64,
}

/// One memory-region slot. `key` is 0 when free; readers check it before and
/// after reading the rest, so a concurrent deregistration is detected.
#[repr(C)]
#[derive(Debug)]
pub struct MrSlot {
    /// lkey == rkey of the region, 0 when free.
    pub key: AtomicU32,
    /// Protection domain id.
    pub pd: AtomicU32,
    /// `ibv_access_flags`.
    pub access: AtomicU32,
    /// A type-2 memory window's QP (only that QP may use the key); 0: any.
    pub qpn: AtomicU32,
    /// Start address in the owner's address space.
    pub addr: AtomicU64,
    /// Length in bytes.
    pub len: AtomicU64,
    /// The address the region's users name its first byte with (its I/O
    /// virtual address: `addr` for `ibv_reg_mr`, the caller's for
    /// `ibv_reg_mr_iova`, 0 for zero-based device memory).
    pub iova: AtomicU64,
    /// A memory window: the slot of the region it is bound to; 0 for a
    /// region (slot 0 is never used).
    pub parent: AtomicU32,
    _pad: u32,
}

/// A validated snapshot of a memory region.
#[derive(Debug, Clone, Copy)]
pub struct MrInfo {
    /// Protection domain id.
    pub pd: u32,
    /// Access flags.
    pub access: u32,
    /// Type-2 memory window: the only QP that may use it (0: any).
    pub qpn: u32,
    /// Start address in the owner's address space.
    pub addr: u64,
    /// Length.
    pub len: u64,
    /// The address users name the first byte with ([`MrSlot::iova`]).
    pub iova: u64,
    /// A memory window: its region's slot ([`MrSlot::parent`]); 0: a region.
    pub parent: u32,
}

impl MrInfo {
    /// A region whose users name its bytes by their own addresses.
    pub fn at(pd: u32, access: u32, addr: u64, len: u64) -> Self {
        Self {
            pd,
            access,
            qpn: 0,
            addr,
            len,
            iova: addr,
            parent: 0,
        }
    }

    /// Whether `[iova, iova+len)` (addresses as the region's users name
    /// them) lies inside the region.
    pub fn contains(&self, iova: u64, len: u64) -> bool {
        iova >= self.iova
            && iova
                .checked_add(len)
                .is_some_and(|end| end <= self.iova.saturating_add(self.len))
    }

    /// The owner's address of `iova` (inside the region, [`Self::contains`]).
    pub fn translate(&self, iova: u64) -> u64 {
        self.addr.wrapping_add(iova.wrapping_sub(self.iova))
    }
}

/// Bytes of a context segment.
pub const CTX_BYTES: usize = size_of::<CtxHeader>() + MR_SLOTS * size_of::<MrSlot>();

/// The MR table of a context segment at `base`.
///
/// # Safety
/// `base` is a mapping of at least [`CTX_BYTES`] bytes that outlives `'a`.
pub unsafe fn mr_table<'a>(base: *mut u8) -> &'a [MrSlot] {
    // SAFETY: the table follows the header inside CTX_BYTES (caller contract);
    // MrSlot is all atomics plus padding, valid for any bit pattern.
    unsafe {
        std::slice::from_raw_parts(base.add(size_of::<CtxHeader>()).cast::<MrSlot>(), MR_SLOTS)
    }
}

/// Look up `key` in a table; `None` if absent or changing.
pub fn mr_lookup(table: &[MrSlot], key: u32) -> Option<MrInfo> {
    let slot = table.get(key_index(key))?;
    if key == 0 || slot.key.load(Ordering::Acquire) != key {
        return None;
    }
    let info = MrInfo {
        pd: slot.pd.load(Ordering::Relaxed),
        access: slot.access.load(Ordering::Relaxed),
        qpn: slot.qpn.load(Ordering::Relaxed),
        addr: slot.addr.load(Ordering::Relaxed),
        len: slot.len.load(Ordering::Relaxed),
        iova: slot.iova.load(Ordering::Relaxed),
        parent: slot.parent.load(Ordering::Relaxed),
    };
    (slot.key.load(Ordering::Acquire) == key).then_some(info)
}

/// Publish a region into a free slot.
pub fn mr_publish(slot: &MrSlot, key: u32, info: MrInfo) {
    slot.pd.store(info.pd, Ordering::Relaxed);
    slot.access.store(info.access, Ordering::Relaxed);
    slot.addr.store(info.addr, Ordering::Relaxed);
    slot.len.store(info.len, Ordering::Relaxed);
    slot.qpn.store(info.qpn, Ordering::Relaxed);
    slot.iova.store(info.iova, Ordering::Relaxed);
    slot.parent.store(info.parent, Ordering::Relaxed);
    slot.key.store(key, Ordering::Release);
}

/// A completion as it travels through a CQ ring.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Cqe {
    /// `wr_id`.
    pub wr_id: u64,
    /// `ibv_wc_status`.
    pub status: u32,
    /// `ibv_wc_opcode`.
    pub opcode: u32,
    /// `byte_len`.
    pub byte_len: u32,
    /// Immediate data, network order as posted.
    pub imm: u32,
    /// Local QP number.
    pub qp_num: u32,
    /// Remote QP number.
    pub src_qp: u32,
    /// `ibv_wc_flags`.
    pub wc_flags: u32,
    /// Non-zero when the sender asked for a solicited event.
    pub solicited: u32,
    /// Service level (UD receives: the sender's address handle's).
    pub sl: u32,
    /// P_Key index (UD receives: the receiving QP's).
    pub pkey_index: u32,
    /// The device clock when the completion was added, 0 until then and
    /// in CQs that did not ask for timestamps ([`CqHeader::stamp`],
    /// provider::clock).
    pub ts: u64,
}

/// A CQ's header, followed by a ring of [`Cqe`].
#[repr(C, align(64))]
#[derive(Debug)]
pub struct CqHeader {
    /// [`MAGIC`].
    pub magic: u32,
    /// Owning process.
    pub pid: u32,
    /// Owning context id (its async fd is in that context's header).
    pub ctx: u32,
    /// Read end of the completion channel in the owner, -1 without channel.
    pub chan_fd: i32,
    /// The `struct ibv_cq *` in the owner's address space (event payload).
    pub cq_ptr: u64,
    /// Arm state, see [`crate::model::cq`].
    pub armed: AtomicU32,
    /// Set once the CQ overflowed.
    pub overflow: AtomicU32,
    /// Async fd of the owning context (copied for peers).
    pub async_fd: AtomicI32,
    /// Non-zero once `ibv_resize_cq` grew the CQ into a new ring: the id of
    /// the segment `cq-<id>` completions go to from then on
    /// (provider::notify).
    pub moved_to: AtomicU32,
    /// Non-zero when the CQ's creator asked for completion timestamps
    /// (`ibv_create_cq_ex` with `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP` or
    /// `_WALLCLOCK`): whoever adds a completion stamps it then, and only
    /// then (a clock read per completion added 30–40 ns to every small
    /// post, provider::notify). Set before the CQ is returned, kept by
    /// `ibv_resize_cq`.
    pub stamp: AtomicU32,
}

/// A receive work request as stored in a receive ring.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct RecvWqe {
    /// `wr_id`.
    pub wr_id: u64,
    /// Entries used in `sge`.
    pub num_sge: u32,
    _pad: u32,
    /// Scatter list in the owner's address space.
    pub sge: [Sge; MAX_SGE],
}

impl RecvWqe {
    /// A WQE from a wr_id and a scatter list (at most [`MAX_SGE`] entries).
    pub fn new(wr_id: u64, sges: &[Sge]) -> Self {
        let mut w = Self {
            wr_id,
            num_sge: sges.len().min(MAX_SGE) as u32,
            ..Self::default()
        };
        w.sge[..w.num_sge as usize].copy_from_slice(&sges[..w.num_sge as usize]);
        w
    }

    /// The used scatter entries.
    pub fn sges(&self) -> &[Sge] {
        &self.sge[..(self.num_sge as usize).min(MAX_SGE)]
    }
}

/// `struct ibv_sge` in shared memory.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct Sge {
    /// Address in the owner's space.
    pub addr: u64,
    /// Length.
    pub length: u32,
    /// lkey.
    pub lkey: u32,
}

/// A QP's header, followed by its receive ring.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct QpHeader {
    /// [`MAGIC`].
    pub magic: u32,
    /// Owning process.
    pub pid: u32,
    /// Owning context id (MR table).
    pub ctx: u32,
    /// QP number.
    pub qpn: u32,
    /// Protection domain id.
    pub pd: u32,
    /// Receive CQ id.
    pub recv_cq: u32,
    /// SRQ id, 0 when the QP has its own receive queue.
    pub srq: u32,
    /// [`crate::model::qp::QpState`] as u32.
    pub state: AtomicU32,
    /// `qp_access_flags` (remote access the QP allows).
    pub access: AtomicU32,
    _pad0: u32,
    /// Non-zero once `IBV_EVENT_QP_LAST_WQE_REACHED` was raised for the
    /// current stay in ERR (cleared by RESET).
    pub last_wqe: AtomicU32,
    /// Event records written for this QP (provider::events).
    pub events: AtomicU32,
    /// Non-zero once the owner destroys the QP: no more event records.
    pub gone: AtomicU32,
    /// `ibv_qp_type` ([`crate::model::qp::QpType`]), written at creation:
    /// a message of another transport is not taken.
    pub qp_type: u32,
    /// The `struct ibv_qp *` in the owner's address space (event element).
    pub qp_ptr: u64,
    /// Rung by the owner when requests may now get through: a receive
    /// posted (no SRQ), a state change (RTR, ERR, destroy). Waiting
    /// requesters' progress threads sleep on it (shm::doorbell).
    pub doorbell: Doorbell,
    /// UD: the QP's Q_Key (`IBV_QP_QKEY`), checked by senders.
    pub qkey: AtomicU32,
    /// XRC target: the id of its XRC domain (provider::xrc).
    pub xrcd: u32,
    /// `min_rnr_timer` (`IBV_QP_MIN_RNR_TIMER`, 0..31): the RNR timer a
    /// requester waits between tries when this responder has no receive
    /// (model::qp::rnr_timer). 0, the longest, until set.
    pub min_rnr_timer: AtomicU32,
    /// Who may still add a receive completion of the QP: requesters inside
    /// the responder part of a request, its owner while it flushes
    /// (shm::insiders). Its last-WQE event and the clean of its completions
    /// wait for them (provider::events, provider::purge).
    pub insiders: Insiders,
}

/// An SRQ's header, followed by its receive ring.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct SrqHeader {
    /// [`MAGIC`].
    pub magic: u32,
    /// Owning process.
    pub pid: u32,
    /// Owning context id.
    pub ctx: u32,
    /// Protection domain id.
    pub pd: u32,
    /// Armed limit (`ibv_modify_srq(IBV_SRQ_LIMIT)`), 0 when disarmed
    /// (model::srq).
    pub limit: AtomicU32,
    /// Event records written for this SRQ (provider::events).
    pub events: AtomicU32,
    /// Non-zero once the owner destroys the SRQ: no more event records.
    pub gone: AtomicU32,
    _pad: u32,
    /// The `struct ibv_srq *` in the owner's address space (event element).
    pub srq_ptr: u64,
    /// Rung by the owner after posting receives (shm::doorbell).
    pub doorbell: Doorbell,
    /// XRC SRQ: the id of its XRC domain (0: a basic SRQ).
    pub xrcd: u32,
    /// XRC SRQ: the id of its CQ, where its receives complete.
    pub cq: u32,
}

/// Size of a segment holding header `H` then a ring of `cap` `T`s.
pub fn seg_bytes<H, T: Copy>(cap: usize) -> usize {
    size_of::<H>().next_multiple_of(64) + Ring::<T>::bytes(cap)
}

/// Size of a segment holding header `H` then a receive queue of `cap`
/// WQEs (a [`crate::shm::claim::ClaimRing`]).
pub fn recv_seg_bytes<H>(cap: usize) -> usize {
    size_of::<H>().next_multiple_of(64) + crate::shm::claim::ClaimRing::<RecvWqe>::bytes(cap)
}

/// Offset of the ring after header `H`.
pub fn ring_offset<H>() -> usize {
    size_of::<H>().next_multiple_of(64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_header_starts_with_magic_then_pid() {
        use std::mem::offset_of;
        assert_eq!(
            (offset_of!(CtxHeader, magic), offset_of!(CtxHeader, pid)),
            (0, 4)
        );
        assert_eq!(
            (offset_of!(CqHeader, magic), offset_of!(CqHeader, pid)),
            (0, 4)
        );
        assert_eq!(
            (offset_of!(QpHeader, magic), offset_of!(QpHeader, pid)),
            (0, 4)
        );
        assert_eq!(
            (offset_of!(SrqHeader, magic), offset_of!(SrqHeader, pid)),
            (0, 4)
        );
    }

    #[test]
    fn ctx_header_layout() {
        use std::mem::offset_of;
        // Peers of other processes read `dead` at this offset; the MR table
        // starts right after the 64-byte header.
        assert_eq!(offset_of!(CtxHeader, async_fd), 8);
        assert_eq!(offset_of!(CtxHeader, id), 12);
        assert_eq!(offset_of!(CtxHeader, dead), 16);
        assert_eq!(offset_of!(CtxHeader, async_ino), 24);
        assert_eq!(size_of::<CtxHeader>(), 64);
        assert_eq!(CTX_BYTES, 64 + MR_SLOTS * 48);
    }

    #[test]
    fn qp_and_srq_header_layout() {
        use std::mem::offset_of;
        // Requesters in other processes read and write these fields at
        // these offsets.
        assert_eq!(offset_of!(QpHeader, state), 28);
        assert_eq!(offset_of!(QpHeader, access), 32);
        assert_eq!(offset_of!(QpHeader, insiders), 88);
        assert_eq!(offset_of!(QpHeader, last_wqe), 40);
        assert_eq!(offset_of!(QpHeader, events), 44);
        assert_eq!(offset_of!(QpHeader, gone), 48);
        assert_eq!(offset_of!(QpHeader, qp_type), 52);
        assert_eq!(offset_of!(QpHeader, qkey), 72);
        assert_eq!(offset_of!(QpHeader, xrcd), 76);
        assert_eq!(offset_of!(QpHeader, min_rnr_timer), 80);
        assert_eq!(offset_of!(QpHeader, qp_ptr), 56);
        assert_eq!(offset_of!(QpHeader, doorbell), 64);
        assert_eq!(size_of::<QpHeader>(), 128);
        assert_eq!(offset_of!(SrqHeader, pd), 12);
        assert_eq!(offset_of!(SrqHeader, limit), 16);
        assert_eq!(offset_of!(SrqHeader, events), 20);
        assert_eq!(offset_of!(SrqHeader, gone), 24);
        assert_eq!(offset_of!(SrqHeader, srq_ptr), 32);
        assert_eq!(offset_of!(SrqHeader, doorbell), 40);
        assert_eq!(size_of::<SrqHeader>(), 64);
    }

    #[test]
    fn sizes() {
        assert_eq!(size_of::<MrSlot>(), 48);
        assert_eq!(std::mem::offset_of!(MrSlot, iova), 32);
        assert_eq!(std::mem::offset_of!(MrSlot, parent), 40);
        // Keys: the slot in bits 8..20, the consumer's byte below it.
        for (i, tag) in [(1u32, 1u32), (4095, 0xf_ffff), (77, 0x1234)] {
            let k = make_key(i, tag);
            assert_ne!(k, 0);
            assert_eq!(key_index(k), i as usize);
            assert_eq!(
                key_index((k & !0xff) | (k.wrapping_add(1) & 0xff)),
                i as usize
            );
        }
        assert_eq!(size_of::<Cqe>(), 56);
        assert_eq!(size_of::<Sge>(), 16);
        assert_eq!(size_of::<RecvWqe>(), 16 + 16 * MAX_SGE);
        let m = MrInfo::at(1, 0, 100, 10);
        assert!(m.contains(100, 10));
        assert!(!m.contains(101, 10));
        assert!(!m.contains(99, 1));
        assert!(!m.contains(u64::MAX, 2));
        assert_eq!(m.translate(105), 105);
        // Zero-based (device memory): users name the bytes 0..10.
        let z = MrInfo { iova: 0, ..m };
        assert!(z.contains(0, 10));
        assert!(!z.contains(1, 10));
        assert_eq!(z.translate(4), 104);
        // Implicit ODP: the whole address space.
        let all = MrInfo::at(1, 0, 0, u64::MAX);
        assert!(all.contains(0x7fff_0000_1000, 4096));
        assert_eq!(all.translate(0x1234), 0x1234);
    }
}
