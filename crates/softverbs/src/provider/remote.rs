//! The responder of a connected QP as the requester maps it: its QP
//! segment (state, PD, access flags, receive ring), its context's MR table,
//! its receive CQ and, if any, its SRQ — all found from the QPN alone.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::events;
use super::notify::CqPort;
use crate::model::event::{srq_limit_fires, SRQ_LIMIT_REACHED};
use crate::model::qp::QpState;
use crate::model::wc::{opcode, WcStatus};
use crate::shm::claim::{stall_hook, ClaimRing, StallAt, Token};
use crate::shm::doorbell::{Doorbell, Watch};
use crate::shm::layout::{
    mr_table, ring_offset, Cqe, CtxHeader, MrSlot, QpHeader, RecvWqe, SrqHeader, CTX_BYTES, MAGIC,
};
use crate::shm::Segment;

/// The responder of a connected QP, as mapped by the requester.
#[derive(Debug)]
pub struct Remote {
    pub(crate) cq: CqPort,
    qp: Arc<Segment>,
    /// The context whose regions (and SRQ) serve requests: the QP's, or
    /// for an XRC target the SRQ's.
    ctx: Arc<Segment>,
    /// The QP's own context, where its events go.
    qp_ctx: Arc<Segment>,
    rq: ClaimRing<RecvWqe>,
    srq: Option<(Arc<Segment>, ClaimRing<RecvWqe>)>,
    owner: Owner,
    /// The PD its memory is checked against: the QP's, or for an XRC
    /// target the SRQ's.
    pd: u32,
    /// The process whose memory the request reaches (the owner of the
    /// regions: the QP's, or the XRC SRQ's).
    pid: u32,
}

/// The process owning the responder, for [`Remote::owner_gone`].
#[derive(Debug)]
enum Owner {
    /// This process: alive while we run.
    Me,
    /// A pidfd of the owner taken at [`Remote::open`]: it names that very
    /// process (not a later one reusing the pid) and becomes readable when
    /// it exits, zombies included.
    Fd(OwnedFd),
    /// Already gone when the responder was mapped.
    Gone,
    /// No pidfd (an old kernel): `kill(pid, 0)`.
    Pid(u32),
}

impl Owner {
    fn of(pid: u32) -> Self {
        if pid == super::xfer::my_pid() {
            return Self::Me;
        }
        // SAFETY: pidfd_open takes a pid and flags 0; the result is checked.
        let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if r >= 0 {
            // SAFETY: a fresh descriptor we own.
            return Self::Fd(unsafe { OwnedFd::from_raw_fd(r as i32) });
        }
        match io::Error::last_os_error().raw_os_error() {
            Some(libc::ESRCH) => Self::Gone,
            _ => Self::Pid(pid),
        }
    }

    fn gone(&self) -> bool {
        match self {
            Self::Me => false,
            Self::Gone => true,
            Self::Fd(fd) => {
                let mut p = libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd, zero timeout.
                unsafe { libc::poll(&mut p, 1, 0) > 0 }
            }
            Self::Pid(pid) => {
                // SAFETY: signal 0 only checks for existence.
                let r = unsafe { libc::kill(*pid as libc::pid_t, 0) };
                r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
        }
    }
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
        let (magic, ctx_id, cq_id, srq_id, pid) =
            unsafe { ((*h).magic, (*h).ctx, (*h).recv_cq, (*h).srq, (*h).pid) };
        if magic != MAGIC {
            return Err(seg_err());
        }
        let off = ring_offset::<QpHeader>();
        // SAFETY: the ring was initialised at `off` by the creator; `qp` is
        // kept alive with the view.
        let rq =
            unsafe { ClaimRing::attach(qp.base().add(off), qp.len() - off) }.ok_or_else(seg_err)?;
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
            // SAFETY: the length is checked before the header is read.
            if s.len() < off || unsafe { (*s.base().cast::<SrqHeader>()).magic } != MAGIC {
                return Err(seg_err());
            }
            // SAFETY: as for the QP ring.
            let r = unsafe { ClaimRing::attach(s.base().add(off), s.len() - off) }
                .ok_or_else(seg_err)?;
            Some((s, r))
        };
        // SAFETY: checked above.
        let pd = unsafe { (*h).pd };
        Ok(Self {
            qp,
            qp_ctx: Arc::clone(&ctx),
            ctx,
            rq,
            srq,
            cq,
            owner: Owner::of(pid),
            pd,
            pid,
        })
    }

    /// Map the XRC target QP `qpn` with the XRC SRQ `srqn` a request names
    /// (provider::xrc): the SRQ's receive ring, CQ, context (its regions)
    /// and PD serve the request.
    ///
    /// # Errors
    /// ENOENT when the QP does not exist (any more); EINVAL when it is not
    /// an XRC target, when the SRQ does not exist or is not of the QP's
    /// XRC domain; EPROTO for a malformed segment.
    pub fn open_xrc(qpn: u32, srqn: u32) -> io::Result<Self> {
        let qp = Segment::open(&format!("qp-{qpn}"))?;
        let h = qp.base().cast::<QpHeader>();
        // SAFETY: as in open: the magic is checked before anything else.
        let (magic, qp_type, xrcd, pid, qp_ctx_id) =
            unsafe { ((*h).magic, (*h).qp_type, (*h).xrcd, (*h).pid, (*h).ctx) };
        if magic != MAGIC {
            return Err(seg_err());
        }
        let invalid = || io::Error::from_raw_os_error(libc::EINVAL);
        if qp_type != crate::model::qp::QpType::XrcRecv as u32 || xrcd == 0 {
            return Err(invalid());
        }
        let off = ring_offset::<QpHeader>();
        // SAFETY: as in open.
        let rq =
            unsafe { ClaimRing::attach(qp.base().add(off), qp.len() - off) }.ok_or_else(seg_err)?;
        let s = Segment::open(&format!("srq-{srqn}")).map_err(|_| invalid())?;
        let soff = ring_offset::<SrqHeader>();
        // SAFETY: the length is checked before the header is read.
        if s.len() < soff || unsafe { (*s.base().cast::<SrqHeader>()).magic } != MAGIC {
            return Err(seg_err());
        }
        // SAFETY: checked just above.
        let (s_xrcd, s_ctx, s_cq, s_pd, s_pid) = unsafe {
            let sh = &*s.base().cast::<SrqHeader>();
            (sh.xrcd, sh.ctx, sh.cq, sh.pd, sh.pid)
        };
        if s_xrcd != xrcd {
            return Err(invalid());
        }
        // SAFETY: as for the QP ring.
        let ring =
            unsafe { ClaimRing::attach(s.base().add(soff), s.len() - soff) }.ok_or_else(seg_err)?;
        let ctx = Segment::open(&format!("ctx-{s_ctx}"))?;
        // SAFETY: a context segment starts with its header.
        if ctx.len() < CTX_BYTES || unsafe { (*ctx.base().cast::<CtxHeader>()).magic } != MAGIC {
            return Err(seg_err());
        }
        let cq = CqPort::attach(Segment::open(&format!("cq-{s_cq}"))?).ok_or_else(seg_err)?;
        let qp_ctx = Segment::open(&format!("ctx-{qp_ctx_id}"))?;
        if qp_ctx.len() < CTX_BYTES
            // SAFETY: the segment holds at least a context header (checked
            // just before).
            || unsafe { (*qp_ctx.base().cast::<CtxHeader>()).magic } != MAGIC
        {
            return Err(seg_err());
        }
        Ok(Self {
            qp,
            qp_ctx,
            ctx,
            rq,
            srq: Some((s, ring)),
            cq,
            owner: Owner::of(pid),
            pd: s_pd,
            pid: s_pid,
        })
    }

    /// The PD the responder's memory is checked against.
    pub fn pd(&self) -> u32 {
        self.pd
    }

    /// The process owning the memory a request reaches.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Announce a sleeper on every doorbell that rings when a request to
    /// this responder may get through (its QP's; its SRQ's too), reading
    /// their values (shm::doorbell). Retry the request after this, then
    /// sleep on [`Armed::watches`]; dropping the guard disarms.
    pub fn arm(&self) -> Armed {
        let mut a = Armed {
            bells: Vec::with_capacity(2),
        };
        let qp_bell = std::ptr::addr_of!(self.hdr().doorbell);
        a.bells
            .push((Arc::clone(&self.qp), qp_bell, self.hdr().doorbell.arm()));
        if let Some((seg, _)) = &self.srq {
            // SAFETY: an SRQ segment starts with its header (checked in
            // open); `seg` is kept alive with the pointer in the guard.
            let h = unsafe { &*seg.base().cast::<SrqHeader>() };
            a.bells.push((
                Arc::clone(seg),
                std::ptr::addr_of!(h.doorbell),
                h.doorbell.arm(),
            ));
        }
        a
    }

    /// Whether the process owning the responder exited (or crashed): it
    /// will never answer. A system call on the other-process path, so only
    /// asked when a request is not going through.
    pub fn owner_gone(&self) -> bool {
        self.owner.gone()
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
        self.ctx_hdr().dead.load(Ordering::Acquire) != 0
            || self.qp_ctx_hdr().dead.load(Ordering::Acquire) != 0
    }

    /// The responder's MR table.
    pub fn mrs(&self) -> &[MrSlot] {
        // SAFETY: CTX_BYTES checked in open; lives with `ctx`.
        unsafe { mr_table(self.ctx.base()) }
    }

    fn ctx_hdr(&self) -> &CtxHeader {
        // SAFETY: a context segment starts with its header (checked in
        // open); lives with `ctx`.
        unsafe { &*self.ctx.base().cast::<CtxHeader>() }
    }

    /// The header of the QP's own context (its events go there).
    fn qp_ctx_hdr(&self) -> &CtxHeader {
        // SAFETY: as ctx_hdr, for `qp_ctx`.
        unsafe { &*self.qp_ctx.base().cast::<CtxHeader>() }
    }

    /// Take (claim, shm::claim) a receive WQE from the responder's ring or
    /// SRQ; it is released when the returned guard drops, which the
    /// caller lets happen after writing its completion. Taking one from
    /// an armed SRQ may raise its limit event (model::event).
    pub fn take_recv(&self) -> Option<Taken<'_>> {
        let me = Token::mine(self.hdr().qpn);
        let Some((seg, ring)) = &self.srq else {
            let c = self.rq.claim(me)?;
            stall_hook(StallAt::Claim);
            return Some(Taken {
                ring: &self.rq,
                pos: c.pos,
                wqe: c.val,
            });
        };
        let c = ring.claim(me)?;
        stall_hook(StallAt::Claim);
        let wqe = Taken {
            ring,
            pos: c.pos,
            wqe: c.val,
        };
        // SAFETY: an SRQ segment starts with its header (its ring was
        // attached after it in open); lives with `seg`.
        let h = unsafe { &*seg.base().cast::<SrqHeader>() };
        let limit = h.limit.load(Ordering::Acquire);
        if srq_limit_fires(limit, ring.len())
            && h.limit
                .compare_exchange(limit, 0, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        {
            events::raise(
                self.ctx_hdr(),
                &h.events,
                &h.gone,
                h.srq_ptr,
                SRQ_LIMIT_REACHED,
            );
        }
        Some(wqe)
    }

    /// Enter the responder part of a request. For a responder on an SRQ
    /// this is counted until the guard drops, so that its last-WQE event
    /// comes after every receive completion of ours (model::event).
    pub fn enter(&self) -> Inside<'_> {
        let counted = self.srq.is_some();
        if counted {
            self.hdr().inflight.fetch_add(1, Ordering::SeqCst);
        }
        Inside { r: self, counted }
    }

    /// The responder detected an error (model::event): move its QP to ERR
    /// if it still accepts requests (flushing its own receive queue: the
    /// owner may not run again for a while), then raise `event` for it.
    /// An SRQ responder's last-WQE event follows when the [`Inside`] guard
    /// drops.
    pub fn fail(&self, event: Option<u32>) {
        let h = self.hdr();
        let mut cur = h.state.load(Ordering::Acquire);
        let moved = loop {
            if !QpState::from_u32(cur).is_some_and(QpState::accepts_incoming) {
                break false;
            }
            match h.state.compare_exchange(
                cur,
                QpState::Err as u32,
                Ordering::SeqCst,
                Ordering::Acquire,
            ) {
                Ok(_) => break true,
                Err(now) => cur = now,
            }
        };
        if moved {
            h.doorbell.ring();
        }
        if let Some(ty) = event {
            events::raise(self.qp_ctx_hdr(), &h.events, &h.gone, h.qp_ptr, ty);
        }
        if moved {
            let flush = |w: RecvWqe, release: &dyn Fn()| {
                self.cq.push_with(
                    Cqe {
                        wr_id: w.wr_id,
                        status: WcStatus::WrFlushErr as u32,
                        opcode: opcode::RECV,
                        qp_num: h.qpn,
                        ..Cqe::default()
                    },
                    release,
                );
            };
            match &self.srq {
                None => {
                    // Pairs with the fence of the owner's post_recv: a
                    // receive it pushes is flushed either here or there.
                    std::sync::atomic::fence(Ordering::SeqCst);
                    self.rq.flush(Token::mine(h.qpn), |_| true, flush);
                }
                // Only what a dead requester took for this QP (provider::srq).
                Some((_, ring)) => {
                    super::srq::flush_taken_for(ring, h.qpn, flush);
                }
            }
        }
    }
}

/// A receive WQE claimed by [`Remote::take_recv`]. [`Taken::complete`]
/// writes its completion and releases the claim before publishing it; a
/// receive dropped without a completion (its owner is gone) is released.
#[derive(Debug)]
pub struct Taken<'a> {
    ring: &'a ClaimRing<RecvWqe>,
    pos: u64,
    wqe: RecvWqe,
}

impl Taken<'_> {
    /// Push the receive's completion `cqe` to `cq`, releasing the claim
    /// between writing it and publishing it (`CqPort::push_with`): there
    /// is no moment when the completion is visible and the claim still
    /// held, so a flush never completes the receive a second time.
    pub fn complete(self, cq: &CqPort, cqe: Cqe) {
        cq.push_with(cqe, || self.ring.release(self.pos));
        std::mem::forget(self);
        stall_hook(StallAt::Complete);
    }
}

impl std::ops::Deref for Taken<'_> {
    type Target = RecvWqe;

    fn deref(&self) -> &RecvWqe {
        &self.wqe
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        self.ring.release(self.pos);
    }
}

/// Doorbells armed by [`Remote::arm`]; each keeps its segment mapped, so a
/// sleeper never watches an unmapped word even if the requester QP is
/// destroyed meanwhile.
#[derive(Debug)]
pub struct Armed {
    bells: Vec<(Arc<Segment>, *const Doorbell, u32)>,
}

impl Armed {
    /// The words to sleep on.
    pub fn watches(&self) -> impl Iterator<Item = Watch<'_>> {
        self.bells.iter().map(|&(_, b, val)| Watch {
            // SAFETY: `b` points into the segment held next to it.
            word: unsafe { &(*b).seq },
            val,
            private: false,
        })
    }
}

impl Drop for Armed {
    fn drop(&mut self) {
        for &(_, b, _) in &self.bells {
            // SAFETY: as in `watches`.
            unsafe { (*b).disarm() };
        }
    }
}

/// A requester inside the responder part of a request ([`Remote::enter`]).
#[derive(Debug)]
pub struct Inside<'a> {
    r: &'a Remote,
    counted: bool,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        if self.counted {
            let h = self.r.hdr();
            h.inflight.fetch_sub(1, Ordering::SeqCst);
            events::last_wqe(self.r.qp_ctx_hdr(), h);
        }
    }
}
