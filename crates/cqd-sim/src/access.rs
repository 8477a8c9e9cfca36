//! Memory checks and data movement of the NIC: local SGEs against the
//! requester's domain, remote addresses against the responder's, and the
//! gather/scatter copies. Values from the user (addresses, keys, lengths) are
//! never trusted: every check is overflow-safe.

use crate::mr::{id_of, Access, Buf, RemoteAddr, Sge};
use crate::state::FabricState;

impl FabricState {
    /// The region and offset an SGE covers, if its lkey is valid in `pd`,
    /// it lies inside the region and, when `write`, the region allows local
    /// writes.
    fn local(&self, pd: u32, sge: &Sge, write: bool) -> Option<(&Buf, usize)> {
        let mr = self.mrs.get(&id_of(sge.lkey, false)?)?;
        if mr.pd != pd || (write && !mr.access.contains(Access::LOCAL_WRITE)) {
            return None;
        }
        let off = sge.addr.checked_sub(mr.base)?;
        let end = off.checked_add(u64::from(sge.length))?;
        (end <= mr.len).then_some((&mr.buf, off as usize))
    }

    /// Total length of `sges` if every one is valid (see [`Self::local`]).
    pub(crate) fn check_sges(&self, pd: u32, sges: &[Sge], write: bool) -> Option<u64> {
        let mut total = 0u64;
        for s in sges {
            self.local(pd, s, write)?;
            total += u64::from(s.length);
        }
        Some(total)
    }

    /// The region and offset `len` bytes at `remote` cover, if the rkey is
    /// valid in the responder's domain `pd`, the range is inside the region,
    /// and both the region and the responder QP (`qp_access`) allow `need`.
    pub(crate) fn check_remote(
        &self,
        pd: u32,
        qp_access: Access,
        remote: RemoteAddr,
        len: u64,
        need: Access,
    ) -> Option<(Buf, usize)> {
        let mr = self.mrs.get(&id_of(remote.rkey, true)?)?;
        if mr.pd != pd || !mr.access.contains(need) || !qp_access.contains(need) {
            return None;
        }
        let off = remote.addr.checked_sub(mr.base)?;
        let end = off.checked_add(len)?;
        (end <= mr.len).then(|| (mr.buf.clone(), off as usize))
    }

    /// Copies the bytes `sges` name (checked before) into one buffer: the
    /// fabric's scratch buffer, to be given back with [`recycle`](Self::recycle).
    pub(crate) fn gather(&mut self, sges: &[Sge]) -> Option<Vec<u8>> {
        let mut out = std::mem::take(&mut self.scratch);
        out.clear();
        out.reserve(sges.iter().map(|s| s.length as usize).sum());
        for s in sges {
            let mr = self.mrs.get(&id_of(s.lkey, false)?)?;
            let off = s.addr.checked_sub(mr.base)? as usize;
            let b = mr.buf.lock();
            out.extend_from_slice(b.get(off..off + s.length as usize)?);
        }
        Some(out)
    }

    /// Gives a gathered buffer back for the next transfer.
    pub(crate) fn recycle(&mut self, buf: Vec<u8>) {
        self.scratch = buf;
    }

    /// Spreads `data` over `sges` (checked before), in order.
    pub(crate) fn scatter(&self, sges: &[Sge], mut data: &[u8]) {
        for s in sges {
            if data.is_empty() {
                return;
            }
            let Some(mr) = id_of(s.lkey, false).and_then(|id| self.mrs.get(&id)) else {
                return;
            };
            let Some(off) = s.addr.checked_sub(mr.base) else {
                return;
            };
            let n = (s.length as usize).min(data.len());
            let off = off as usize;
            let mut b = mr.buf.lock();
            if let Some(dst) = b.get_mut(off..off + n) {
                dst.copy_from_slice(&data[..n]);
            }
            data = &data[n..];
        }
    }

    /// Copies the bytes `sges` name (checked before) to `len` bytes at
    /// `off` of `dst`, region to region, without an intermediate buffer
    /// (RDMA WRITE).
    pub(crate) fn gather_into(&self, sges: &[Sge], dst: &Buf, off: usize, len: usize) -> bool {
        let mut at = off;
        for s in sges {
            let Some(mr) = id_of(s.lkey, false).and_then(|id| self.mrs.get(&id)) else {
                return false;
            };
            let Some(src_off) = s.addr.checked_sub(mr.base) else {
                return false;
            };
            let n = s.length as usize;
            if at + n > off + len || !copy(&mr.buf, src_off as usize, dst, at, n) {
                return false;
            }
            at += n;
        }
        true
    }

    /// Spreads `len` bytes at `off` of `src` over `sges` (checked before),
    /// in order, region to region (RDMA READ).
    pub(crate) fn scatter_from(&self, src: &Buf, off: usize, len: usize, sges: &[Sge]) {
        let mut at = off;
        let end = off + len;
        for s in sges {
            if at >= end {
                return;
            }
            let Some(mr) = id_of(s.lkey, false).and_then(|id| self.mrs.get(&id)) else {
                return;
            };
            let Some(dst_off) = s.addr.checked_sub(mr.base) else {
                return;
            };
            let n = (s.length as usize).min(end - at);
            if !copy(src, at, &mr.buf, dst_off as usize, n) {
                return;
            }
            at += n;
        }
    }
}

/// Copies `n` bytes from `src[from..]` to `dst[to..]`; false if either
/// range is out of its buffer. The same region on both sides is locked
/// once (a region may be both the source and the target).
fn copy(src: &Buf, from: usize, dst: &Buf, to: usize, n: usize) -> bool {
    if std::sync::Arc::ptr_eq(src, dst) {
        let mut b = src.lock();
        if from.checked_add(n).is_some_and(|e| e <= b.len())
            && to.checked_add(n).is_some_and(|e| e <= b.len())
        {
            b.copy_within(from..from + n, to);
            return true;
        }
        return false;
    }
    let s = src.lock();
    let mut d = dst.lock();
    match (s.get(from..from + n), d.get_mut(to..to + n)) {
        (Some(s), Some(d)) => {
            d.copy_from_slice(s);
            true
        }
        _ => false,
    }
}
