//! The responder of a connected QP as the requester maps it: its QP
//! segment (state, PD, access flags, receive ring), its context's MR table,
//! its receive CQ and, if any, its SRQ — all found from the QPN alone.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::events;
use super::notify::CqPort;
use crate::model::event::{srq_limit_fires, SRQ_LIMIT_REACHED};
use crate::model::qp::QpState;
use crate::model::wc::{opcode, WcStatus};
use crate::shm::claim::{stall_hook, ClaimRing, StallAt, Token};
use crate::shm::doorbell::{Doorbell, Watch};
use crate::shm::insiders::Entry;
use crate::shm::layout::{
    mr_table, ring_offset, Cqe, CtxHeader, MrSlot, QpHeader, RecvWqe, SrqHeader, CTX_BYTES, MAGIC,
};
use crate::shm::{dir, Segment};

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

/// The fields of a QP segment's header [`Remote`] reads first.
struct QpFields {
    qp_type: u32,
    ctx: u32,
    recv_cq: u32,
    srq: u32,
    xrcd: u32,
    pid: u32,
    pd: u32,
}

/// Read the header of the QP segment `qp` and attach its receive ring:
/// the segment's length is checked to hold the header before any field is
/// read, and the ring is given only the bytes after the header.
///
/// # Errors
/// EPROTO when the segment is shorter than its header, its magic is wrong
/// or its ring does not fit in the rest.
fn qp_view(qp: &Segment) -> io::Result<(QpFields, ClaimRing<RecvWqe>)> {
    let off = ring_offset::<QpHeader>();
    let avail = qp.len().checked_sub(off).ok_or_else(seg_err)?;
    let h = qp.base().cast::<QpHeader>();
    // SAFETY: the segment holds at least `off` >= size_of::<QpHeader>()
    // bytes (checked just above); the magic is checked before any other
    // field is trusted.
    let f = unsafe {
        if (*h).magic != MAGIC {
            return Err(seg_err());
        }
        QpFields {
            qp_type: (*h).qp_type,
            ctx: (*h).ctx,
            recv_cq: (*h).recv_cq,
            srq: (*h).srq,
            xrcd: (*h).xrcd,
            pid: (*h).pid,
            pd: (*h).pd,
        }
    };
    // SAFETY: `avail` bytes follow `off` in the mapping (checked above),
    // where the creator initialised the ring; attach checks the ring's own
    // header against `avail`. The caller keeps `qp` alive with the view.
    let rq = unsafe { ClaimRing::attach(qp.base().add(off), avail) }.ok_or_else(seg_err)?;
    Ok((f, rq))
}

/// Read the header of the SRQ segment `s` and attach its receive ring,
/// checked as [`qp_view`] does.
///
/// # Errors
/// EPROTO as for [`qp_view`].
fn srq_view(s: &Segment) -> io::Result<(&SrqHeader, ClaimRing<RecvWqe>)> {
    let off = ring_offset::<SrqHeader>();
    let avail = s.len().checked_sub(off).ok_or_else(seg_err)?;
    // SAFETY: the segment holds at least `off` >= size_of::<SrqHeader>()
    // bytes (checked just above) and stays mapped while `s` is borrowed.
    let h = unsafe { &*s.base().cast::<SrqHeader>() };
    if h.magic != MAGIC {
        return Err(seg_err());
    }
    // SAFETY: as in qp_view, for the SRQ's ring.
    let ring = unsafe { ClaimRing::attach(s.base().add(off), avail) }.ok_or_else(seg_err)?;
    Ok((h, ring))
}

/// Map the context segment `name` of `dir` and check that it holds a
/// whole context (header and MR table).
///
/// # Errors
/// The error of [`Segment::open_in`]; EPROTO when it is short or its magic
/// is wrong.
fn ctx_segment(dir: &Path, id: u32) -> io::Result<Arc<Segment>> {
    let ctx = Segment::open_in(dir, &format!("ctx-{id}"))?;
    // SAFETY: the length is checked (first operand) before the header is read.
    if ctx.len() < CTX_BYTES || unsafe { (*ctx.base().cast::<CtxHeader>()).magic } != MAGIC {
        return Err(seg_err());
    }
    Ok(ctx)
}

impl Remote {
    /// Map the responder of QPN `qpn`.
    ///
    /// # Errors
    /// ENOENT when no such QP exists (any more), EPROTO for a malformed or
    /// truncated segment, ELOOP ([`FabricError::Symlink`](crate::shm::fabric::FabricError))
    /// for a symbolic link in place of one.
    pub fn open(qpn: u32) -> io::Result<Self> {
        Self::open_in(&dir(), qpn)
    }

    /// [`open`](Self::open) in the fabric directory `dir`.
    fn open_in(dir: &Path, qpn: u32) -> io::Result<Self> {
        let qp = Segment::open_in(dir, &format!("qp-{qpn}"))?;
        let (f, rq) = qp_view(&qp)?;
        let ctx = ctx_segment(dir, f.ctx)?;
        let cq = CqPort::attach(Segment::open_in(dir, &format!("cq-{}", f.recv_cq))?)
            .ok_or_else(seg_err)?;
        let srq = if f.srq == 0 {
            None
        } else {
            let s = Segment::open_in(dir, &format!("srq-{}", f.srq))?;
            let (_, r) = srq_view(&s)?;
            Some((s, r))
        };
        Ok(Self {
            qp,
            qp_ctx: Arc::clone(&ctx),
            ctx,
            rq,
            srq,
            cq,
            owner: Owner::of(f.pid),
            pd: f.pd,
            pid: f.pid,
        })
    }

    /// Map the XRC target QP `qpn` with the XRC SRQ `srqn` a request names
    /// (provider::xrc): the SRQ's receive ring, CQ, context (its regions)
    /// and PD serve the request.
    ///
    /// # Errors
    /// ENOENT when the QP does not exist (any more); EINVAL when it is not
    /// an XRC target, when the SRQ does not exist or is not of the QP's
    /// XRC domain; EPROTO for a malformed or truncated segment.
    pub fn open_xrc(qpn: u32, srqn: u32) -> io::Result<Self> {
        let dir = dir();
        let qp = Segment::open_in(&dir, &format!("qp-{qpn}"))?;
        let (f, rq) = qp_view(&qp)?;
        let invalid = || io::Error::from_raw_os_error(libc::EINVAL);
        if f.qp_type != crate::model::qp::QpType::XrcRecv as u32 || f.xrcd == 0 {
            return Err(invalid());
        }
        let s = Segment::open_in(&dir, &format!("srq-{srqn}")).map_err(|_| invalid())?;
        let (sh, ring) = srq_view(&s)?;
        let (s_xrcd, s_ctx, s_cq, s_pd, s_pid) = (sh.xrcd, sh.ctx, sh.cq, sh.pd, sh.pid);
        if s_xrcd != f.xrcd {
            return Err(invalid());
        }
        let ctx = ctx_segment(&dir, s_ctx)?;
        let cq =
            CqPort::attach(Segment::open_in(&dir, &format!("cq-{s_cq}"))?).ok_or_else(seg_err)?;
        let qp_ctx = ctx_segment(&dir, f.ctx)?;
        Ok(Self {
            qp,
            qp_ctx,
            ctx,
            rq,
            srq: Some((s, ring)),
            cq,
            owner: Owner::of(f.pid),
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

    /// The responder's state. SeqCst: read after [`Remote::enter`], it is
    /// step 2 of shm::insiders.
    pub fn state(&self) -> QpState {
        QpState::from_u32(self.hdr().state.load(Ordering::SeqCst)).unwrap_or(QpState::Err)
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

    /// Enter the responder part of a request (shm::insiders step 1) until
    /// the guard drops: the responder's last-WQE event comes after every
    /// receive completion of ours (model::event), and its destroy cleans
    /// its CQs only once we left (provider::purge). Read the state after
    /// this ([`Remote::state`]).
    pub fn enter(&self) -> Inside<'_> {
        let entry = self.hdr().insiders.enter();
        Inside { r: self, entry }
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
    entry: Entry,
}

impl Drop for Inside<'_> {
    fn drop(&mut self) {
        let h = self.r.hdr();
        // shm::insiders step 3: every completion we added is published.
        h.insiders.leave(self.entry);
        events::last_wqe(self.r.qp_ctx_hdr(), h);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::fabric::tests::Scratch;
    use crate::shm::fabric::FabricError;

    /// Write `qp-<qpn>` of `len` bytes into `dir`: the magic, then zeros
    /// (a header whose ids name nothing, a ring of capacity 0).
    fn write_qp(dir: &Path, qpn: u32, len: usize) {
        let mut b = vec![0u8; len];
        let m = MAGIC.to_ne_bytes();
        let n = m.len().min(len);
        b[..n].copy_from_slice(&m[..n]);
        std::fs::write(dir.join(format!("qp-{qpn}")), b).expect("write the segment");
    }

    #[test]
    fn a_truncated_qp_segment_is_an_error_not_a_panic() {
        let s = Scratch::new("truncated-qp");
        let off = ring_offset::<QpHeader>();
        let cases = [
            (1, 4, "the magic alone"),
            (
                2,
                std::mem::size_of::<QpHeader>() - 1,
                "a header one byte short",
            ),
            (3, off - 1, "a byte short of the ring"),
            (4, off, "a header and no ring"),
            (5, off + 8, "a ring header cut short"),
            (6, off + 64, "a ring header of capacity 0"),
        ];
        for (qpn, len, what) in cases {
            write_qp(&s.0, qpn, len);
            let e = Remote::open_in(&s.0, qpn).expect_err(what);
            assert_eq!(
                e.raw_os_error(),
                Some(libc::EPROTO),
                "{what} ({len} bytes): {e}"
            );
        }
        std::fs::write(s.0.join("qp-7"), b"").expect("empty segment");
        let e = Remote::open_in(&s.0, 7).expect_err("an empty segment");
        assert_eq!(e.raw_os_error(), Some(libc::ENODATA), "{e}");
    }

    #[test]
    fn a_symlink_in_place_of_a_qp_segment_is_refused() {
        let s = Scratch::new("qp-symlink");
        let elsewhere = s.0.join("elsewhere");
        std::fs::create_dir(&elsewhere).expect("mkdir");
        write_qp(&elsewhere, 9, ring_offset::<QpHeader>() + 4096);
        std::os::unix::fs::symlink(elsewhere.join("qp-9"), s.0.join("qp-9")).expect("symlink");
        let e = Remote::open_in(&s.0, 9).expect_err("a QP segment reached through a link");
        assert_eq!(crate::shm::fabric::errno(&e, 0), libc::ELOOP, "{e}");
        let inner = e.get_ref().and_then(|i| i.downcast_ref::<FabricError>());
        assert!(
            matches!(inner, Some(FabricError::Symlink { path }) if path.ends_with("qp-9")),
            "{e:?}"
        );
    }
}
