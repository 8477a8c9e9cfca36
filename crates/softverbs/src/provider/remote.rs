//! The responder of a connected QP as the requester maps it: its QP
//! segment (state, PD, access flags, receive ring), its context's MR table,
//! its receive CQ and, if any, its SRQ — all found from the QPN alone.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::notify::CqPort;
use crate::model::qp::QpState;
use crate::shm::layout::{
    mr_table, ring_offset, CtxHeader, MrSlot, QpHeader, RecvWqe, SrqHeader, CTX_BYTES, MAGIC,
};
use crate::shm::ring::Ring;
use crate::shm::Segment;

/// The responder of a connected QP, as mapped by the requester.
#[derive(Debug)]
pub struct Remote {
    pub(crate) cq: CqPort,
    qp: Arc<Segment>,
    ctx: Arc<Segment>,
    rq: Ring<RecvWqe>,
    srq: Option<(Arc<Segment>, Ring<RecvWqe>)>,
}

fn seg_err() -> io::Error {
    io::Error::from_raw_os_error(libc::EPROTO)
}

impl Remote {
    /// Map the responder of QPN `qpn`.
    ///
    /// # Errors
    /// ENOENT when no such QP exists (any more), EPROTO for a malformed segment.
    pub fn open(qpn: u32) -> io::Result<Self> {
        let qp = Segment::open(&format!("qp-{qpn}"))?;
        let h = qp.base().cast::<QpHeader>();
        // SAFETY: the creator wrote the header before the QPN was known; the
        // magic is checked before any other field is trusted.
        let (magic, ctx_id, cq_id, srq_id) =
            unsafe { ((*h).magic, (*h).ctx, (*h).recv_cq, (*h).srq) };
        if magic != MAGIC {
            return Err(seg_err());
        }
        let off = ring_offset::<QpHeader>();
        // SAFETY: the ring was initialised at `off` by the creator; `qp` is
        // kept alive with the view.
        let rq = unsafe { Ring::attach(qp.base().add(off), qp.len() - off) }.ok_or_else(seg_err)?;
        let ctx = Segment::open(&format!("ctx-{ctx_id}"))?;
        // SAFETY: a context segment starts with its header.
        if ctx.len() < CTX_BYTES || unsafe { (*ctx.base().cast::<CtxHeader>()).magic } != MAGIC {
            return Err(seg_err());
        }
        let cq = CqPort::attach(Segment::open(&format!("cq-{cq_id}"))?).ok_or_else(seg_err)?;
        let srq = if srq_id == 0 {
            None
        } else {
            let s = Segment::open(&format!("srq-{srq_id}"))?;
            let off = ring_offset::<SrqHeader>();
            // SAFETY: as for the QP ring.
            let r =
                unsafe { Ring::attach(s.base().add(off), s.len() - off) }.ok_or_else(seg_err)?;
            Some((s, r))
        };
        Ok(Self {
            qp,
            ctx,
            rq,
            srq,
            cq,
        })
    }

    /// The responder's shared header.
    pub fn hdr(&self) -> &QpHeader {
        // SAFETY: checked in open; lives with `qp`.
        unsafe { &*self.qp.base().cast::<QpHeader>() }
    }

    /// The responder's state.
    pub fn state(&self) -> QpState {
        QpState::from_u32(self.hdr().state.load(Ordering::Acquire)).unwrap_or(QpState::Err)
    }

    /// Whether the device died for the responder's context (its shared
    /// `dead` flag, model::device).
    pub fn dead(&self) -> bool {
        // SAFETY: a context segment starts with its header (checked in
        // open); lives with `ctx`.
        let h = unsafe { &*self.ctx.base().cast::<CtxHeader>() };
        h.dead.load(Ordering::Acquire) != 0
    }

    /// The responder's MR table.
    pub fn mrs(&self) -> &[MrSlot] {
        // SAFETY: CTX_BYTES checked in open; lives with `ctx`.
        unsafe { mr_table(self.ctx.base()) }
    }

    /// Take a receive WQE from the responder's ring or SRQ.
    pub fn pop_recv(&self) -> Option<RecvWqe> {
        match &self.srq {
            Some((_, r)) => r.pop(),
            None => self.rq.pop(),
        }
    }
}
