//! Memory regions: registered byte buffers the NIC reads and writes.
//!
//! The simulator owns the memory (one buffer per region, behind its own
//! lock); users read and write it through safe methods. A region has a
//! fabric-unique base address, an `lkey` for local scatter/gather entries
//! and a different `rkey` for remote access, and access flags. Deregistering
//! (dropping the [`Mr`]) invalidates both keys: requests that still name
//! them fail with protection or access errors, as on hardware.

use std::ops::BitOr;
use std::sync::Arc;

use parking_lot::Mutex;

use crate::error::VerbsError;
use crate::fabric::Fabric;

/// Access flags of a memory region or a QP (`ibv_access_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Access(pub u32);

impl Access {
    /// `IBV_ACCESS_LOCAL_WRITE`: the NIC may write it locally (receives,
    /// RDMA READ and atomic results).
    pub const LOCAL_WRITE: Access = Access(1);
    /// `IBV_ACCESS_REMOTE_WRITE`
    pub const REMOTE_WRITE: Access = Access(1 << 1);
    /// `IBV_ACCESS_REMOTE_READ`
    pub const REMOTE_READ: Access = Access(1 << 2);
    /// `IBV_ACCESS_REMOTE_ATOMIC`
    pub const REMOTE_ATOMIC: Access = Access(1 << 3);
    /// Every flag.
    pub const ALL: Access = Access(0b1111);

    /// True if every flag of `other` is set.
    #[inline]
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

/// A local scatter/gather entry (`ibv_sge`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sge {
    /// Start address (within a registered region).
    pub addr: u64,
    /// Length in bytes.
    pub length: u32,
    /// The region's local key.
    pub lkey: u32,
}

/// A remote address and key (the target of RDMA WRITE, READ and atomics).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteAddr {
    /// The remote address.
    pub addr: u64,
    /// The remote region's key.
    pub rkey: u32,
}

pub(crate) type Buf = Arc<Mutex<Vec<u8>>>;

/// The NIC's view of a region.
#[derive(Debug)]
pub(crate) struct MrCtx {
    pub(crate) pd: u32,
    pub(crate) base: u64,
    pub(crate) access: Access,
    pub(crate) buf: Buf,
    pub(crate) len: u64,
}

/// The bits above this hold the region id in an address.
pub(crate) const ADDR_SHIFT: u32 = 32;

/// Keys: `lkey = id << 1`, `rkey = id << 1 | 1`, so neither works as the
/// other.
#[inline]
pub(crate) fn key_of(id: u32, remote: bool) -> u32 {
    (id << 1) | u32::from(remote)
}

/// The region id a key names, if it is of the right kind.
#[inline]
pub(crate) fn id_of(key: u32, remote: bool) -> Option<u32> {
    ((key & 1 == 1) == remote).then_some(key >> 1)
}

/// A registered memory region. Dropping it deregisters it.
#[derive(Debug)]
pub struct Mr {
    pub(crate) fabric: Fabric,
    pub(crate) id: u32,
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    pub(crate) buf: Buf,
}

impl Mr {
    /// The local key.
    pub fn lkey(&self) -> u32 {
        key_of(self.id, false)
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        key_of(self.id, true)
    }

    /// The base address.
    pub fn addr(&self) -> u64 {
        self.base
    }

    /// The size in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The access flags.
    pub fn access(&self) -> Access {
        self.access
    }

    /// A local SGE covering `len` bytes at `offset` (not checked here; the
    /// NIC checks it when it executes the request).
    pub fn sge(&self, offset: u64, len: u32) -> Sge {
        Sge {
            addr: self.base.wrapping_add(offset),
            length: len,
            lkey: self.lkey(),
        }
    }

    /// The remote address of `offset`, with the rkey.
    pub fn remote(&self, offset: u64) -> RemoteAddr {
        RemoteAddr {
            addr: self.base.wrapping_add(offset),
            rkey: self.rkey(),
        }
    }

    fn range(&self, offset: u64, len: usize) -> Result<std::ops::Range<usize>, VerbsError> {
        let len = len as u64;
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(offset as usize..end as usize),
            _ => Err(VerbsError::OutOfBounds {
                offset,
                len,
                size: self.len,
            }),
        }
    }

    /// Copies `out.len()` bytes at `offset` into `out`.
    ///
    /// # Errors
    /// [`VerbsError::OutOfBounds`].
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), VerbsError> {
        let r = self.range(offset, out.len())?;
        out.copy_from_slice(&self.buf.lock()[r]);
        Ok(())
    }

    /// Copies `data` to `offset`.
    ///
    /// # Errors
    /// [`VerbsError::OutOfBounds`].
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), VerbsError> {
        let r = self.range(offset, data.len())?;
        self.buf.lock()[r].copy_from_slice(data);
        Ok(())
    }

    /// The 8 bytes at `offset` as a native-endian `u64` (atomics' targets).
    ///
    /// # Errors
    /// [`VerbsError::OutOfBounds`].
    pub fn read_u64(&self, offset: u64) -> Result<u64, VerbsError> {
        let mut b = [0u8; 8];
        self.read(offset, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Stores `v` native-endian at `offset`.
    ///
    /// # Errors
    /// [`VerbsError::OutOfBounds`].
    pub fn write_u64(&self, offset: u64, v: u64) -> Result<(), VerbsError> {
        self.write(offset, &v.to_ne_bytes())
    }

    /// A copy of the whole region.
    pub fn to_vec(&self) -> Vec<u8> {
        self.buf.lock().clone()
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        self.fabric.core.state.lock().mrs.remove(&self.id);
    }
}
