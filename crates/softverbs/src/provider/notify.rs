//! A completion queue as seen by whoever adds completions to it: the owner
//! (send completions, flushes) or a peer process (receive completions).
//!
//! Adding a completion follows the arm rule of [`crate::model::cq`]:
//! 1. push the CQE into the shared ring; if full, set `overflow` and, the
//!    first time, write one `IBV_EVENT_CQ_ERR` record to the owner's async
//!    pipe; the CQE is lost, as on hardware;
//! 2. otherwise, if the arm fires for this CQE, CAS it back to DISARMED and,
//!    on success, write one `ib_uverbs_comp_event_desc` (the owner's
//!    `ibv_cq *`) into the owner's completion-channel pipe.
//!
//! Pipes of another process are reached through `/proc/<pid>/fd/<n>`, which
//! opens the same pipe; the write ends are opened once and cached.
//!
//! Arm and fire: the protocol of [`crate::model::notify`], whose steps
//! are numbered N1–N5 here and which that module checks over every
//! interleaving:
//! - N1. [`CqPort::arm`] (`ibv_req_notify_cq`) stores the arm state into
//!   the newest ring's `armed`, then a SeqCst fence;
//! - N2. the owner's `ibv_poll_cq` then loads the head slot's sequence
//!   (shm::ring step 3) and, finding the ring empty,
//! - N3. waits in `ibv_get_cq_event` for a record in the channel's pipe;
//! - N4. a producer publishes its CQE (shm::ring step 2, Release), then a
//!   SeqCst fence — one per [`Batch`] of CQEs, none for a CQ without a
//!   completion channel, where nobody can wait for an event;
//! - N5. it then loads `moved_to` and `armed` of the newest ring and, if
//!   the arm fires, CASes it to DISARMED; the CAS that succeeds writes the
//!   one record.
//!
//! N1 and N4 each store one word and then load the other side's (store
//! buffering): with a fence on each side, either the poll sees the CQE or
//! the producer sees the arm. Without them both can miss (on x86-64, each
//! store still in its core's store buffer), and the owner sleeps with a
//! completion in its CQ and no event coming — the `rping -V` stalls of
//! docs/reliability.md item 5.
//!
//! A CQ grown by `ibv_resize_cq` is a chain of rings: each full-grown
//! ring's header names the next (`moved_to`); completions go to the
//! newest, the owner drains the older ones first (provider::cq), and a
//! producer that raced with the move (it pushed into an older ring) applies
//! the arm rule of the newest, where the owner arms. N5 reads `moved_to`
//! after N4's fence, so the fence covers that race too: a producer whose
//! CQE the owner's poll missed in an older ring sees the move and the arm
//! made on the newest ring before the owner's fence.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{fence, Ordering};
use std::sync::{Arc, OnceLock};

use crate::model::cq::{fires, DISARMED, EVENT_CQ_ERR};
use crate::shm::layout::{ring_offset, CqHeader, Cqe, MAGIC};
use crate::shm::ring::Ring;
use crate::shm::Segment;

/// Producer-side handle of a CQ.
#[derive(Debug)]
pub struct CqPort {
    seg: Arc<Segment>,
    ring: Ring<Cqe>,
    ev: OnceLock<Option<OwnedFd>>,
    asy: OnceLock<Option<OwnedFd>>,
    /// The next ring of a grown CQ, attached when first needed.
    next: OnceLock<Option<Box<CqPort>>>,
}

fn open_peer_fd(pid: u32, fd: i32) -> Option<OwnedFd> {
    if fd < 0 {
        return None;
    }
    let path = std::ffi::CString::new(format!("/proc/{pid}/fd/{fd}")).ok()?;
    // SAFETY: valid C string; the result is checked.
    let r = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC,
        )
    };
    // SAFETY: a fresh fd we own when non-negative.
    (r >= 0).then(|| unsafe { OwnedFd::from_raw_fd(r) })
}

fn write_all(fd: &OwnedFd, rec: &[u8]) {
    // SAFETY: `rec` is a valid buffer; records are <= PIPE_BUF so the write
    // is atomic; a full pipe (EAGAIN) drops the record, which cannot happen
    // with one record per arm.
    unsafe { libc::write(fd.as_raw_fd(), rec.as_ptr().cast(), rec.len()) };
}

impl CqPort {
    /// Attach to the CQ segment `seg`.
    pub fn attach(seg: Arc<Segment>) -> Option<Self> {
        let hdr = seg.base().cast::<CqHeader>();
        // SAFETY: the segment is at least a CqHeader long when created by
        // create_cq; its magic is checked before anything else is trusted.
        if seg.len() < ring_offset::<CqHeader>() || unsafe { (*hdr).magic } != MAGIC {
            return None;
        }
        let off = ring_offset::<CqHeader>();
        // SAFETY: the ring was initialised by the creator at `off`; the view
        // keeps `seg` alive alongside it in this struct.
        let ring = unsafe { Ring::attach(seg.base().add(off), seg.len() - off)? };
        Some(Self {
            seg,
            ring,
            ev: OnceLock::new(),
            asy: OnceLock::new(),
            next: OnceLock::new(),
        })
    }

    /// The next ring when the CQ grew past this one (None: this is the
    /// newest, or the next one cannot be mapped any more).
    pub fn next(&self) -> Option<&CqPort> {
        let id = self.hdr().moved_to.load(Ordering::Acquire);
        if id == 0 {
            return None;
        }
        self.next
            .get_or_init(|| {
                crate::shm::Segment::open(&format!("cq-{id}"))
                    .ok()
                    .and_then(CqPort::attach)
                    .map(Box::new)
            })
            .as_deref()
    }

    /// The header's address in this mapping (for its creator, to finish
    /// it before anybody else knows the CQ).
    pub fn hdr_ptr(&self) -> *mut CqHeader {
        self.seg.base().cast::<CqHeader>()
    }

    /// The ring completions go to now.
    pub fn newest(&self) -> &CqPort {
        let mut p = self;
        while let Some(n) = p.next() {
            p = n;
        }
        p
    }

    /// Owner side of `ibv_resize_cq`: `next` is the new ring, whose segment
    /// id is `id`; from now on completions go there.
    pub fn grow_into(&self, next: CqPort, id: u32) -> bool {
        if self.next.set(Some(Box::new(next))).is_err() {
            return false;
        }
        self.hdr().moved_to.store(id, Ordering::Release);
        true
    }

    /// Every ring of the chain, oldest first.
    pub fn chain(&self) -> Vec<&CqPort> {
        let mut v = vec![self];
        let mut p = self;
        while let Some(n) = p.next() {
            v.push(n);
            p = n;
        }
        v
    }

    /// The header.
    pub fn hdr(&self) -> &CqHeader {
        // SAFETY: checked in attach; lives as long as `seg`.
        unsafe { &*self.seg.base().cast::<CqHeader>() }
    }

    /// The ring (the owner pops from it).
    pub fn ring(&self) -> &Ring<Cqe> {
        &self.ring
    }

    /// Add a completion, firing the arm or raising CQ_ERR as the model says.
    pub fn push(&self, cqe: Cqe) {
        self.push_with(cqe, || {});
    }

    /// [`CqPort::push`], calling `before_publish` once the CQE is written
    /// but before the owner can poll it — also when the CQ overflows and
    /// the CQE is lost. A receive completion releases the receive's claim
    /// there (shm::claim): a requester dying after publishing its CQE has
    /// released the claim already, so no flush completes that receive a
    /// second time.
    pub fn push_with(&self, cqe: Cqe, before_publish: impl FnOnce()) {
        let mut b = Batch::new();
        b.push_with(self, cqe, before_publish);
    }

    /// Publish `cqe` into this ring (N4 without its fence); whether it was
    /// pushed (false: the CQ overflowed, the CQE is lost).
    fn push_here(&self, mut cqe: Cqe, before_publish: impl FnOnce()) -> bool {
        let h = self.hdr();
        // Only a CQ that asked for timestamps pays for the clock read.
        if cqe.ts == 0 && h.stamp.load(Ordering::Relaxed) != 0 {
            cqe.ts = super::clock::device_ns();
        }
        let mut once = Some(before_publish);
        let pushed = self.ring.push_with(cqe, || {
            if let Some(f) = once.take() {
                f();
            }
        });
        if let Some(f) = once.take() {
            f();
        }
        if pushed.is_err() {
            if h.overflow.swap(1, Ordering::AcqRel) == 0 {
                let fd = self
                    .asy
                    .get_or_init(|| open_peer_fd(h.pid, h.async_fd.load(Ordering::Relaxed)));
                if let Some(fd) = fd {
                    write_all(fd, &super::fatal::async_record(h.cq_ptr, EVENT_CQ_ERR));
                }
            }
            return false;
        }
        true
    }

    /// N4's fence and N5, after CQEs were published into this CQ: fire the
    /// newest ring's arm if it fires for a CQE that is `solicited` and
    /// `success` (a batch's summary: see [`Batch`]).
    fn notify(&self, solicited: bool, success: bool) {
        // The channel descriptor is written once, at creation, before the
        // segment is known to anyone; every ring of the chain has the
        // same.
        if self.hdr().chan_fd >= 0 {
            // N4: orders the publish before the loads of `moved_to` and
            // `armed` below (model::notify step 4).
            fence(Ordering::SeqCst);
        }
        self.newest().maybe_fire(solicited, success);
    }

    fn maybe_fire(&self, solicited: bool, success: bool) {
        let h = self.hdr();
        let mut arm = h.armed.load(Ordering::Acquire);
        loop {
            if !fires(arm, solicited, success) {
                return;
            }
            match h
                .armed
                .compare_exchange(arm, DISARMED, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => break,
                Err(a) => arm = a,
            }
        }
        if let Some(fd) = self.ev.get_or_init(|| open_peer_fd(h.pid, h.chan_fd)) {
            write_all(fd, &h.cq_ptr.to_ne_bytes());
        }
    }

    /// Arm (owner side, N1): the next completion that satisfies the rule
    /// fires.
    pub fn arm(&self, state: u32) {
        self.newest().hdr().armed.store(state, Ordering::Release);
        // N1: orders the arm before the application's next poll of the
        // ring (model::notify step 1).
        fence(Ordering::SeqCst);
    }
}

/// CQEs added to one CQ together, whose arm is checked once, when the
/// batch ends (dropped): N4's fence and N5 once for all of them. The arm
/// fires if it fires for one of them (one event at most, as one by one):
/// with [`crate::model::cq::fires`] asked for a CQE that is solicited if
/// one of them is, and successful if all of them are. The batch must end
/// before the caller returns to the application, which may wait for the
/// event next (a drop at the end of the caller's scope does it).
#[derive(Debug)]
pub struct Batch<'a> {
    /// The CQ pushed to since the last check.
    port: Option<&'a CqPort>,
    solicited: bool,
    success: bool,
}

impl<'a> Batch<'a> {
    /// An empty batch.
    pub fn new() -> Self {
        Self {
            port: None,
            solicited: false,
            success: true,
        }
    }

    /// [`CqPort::push`] into `port`, the arm checked when the batch ends
    /// (a batch moving to another CQ checks the first one's arm first).
    pub fn push(&mut self, port: &'a CqPort, cqe: Cqe) {
        self.push_with(port, cqe, || {});
    }

    /// [`CqPort::push_with`] into `port`, the arm checked when the batch
    /// ends.
    pub fn push_with(&mut self, port: &'a CqPort, cqe: Cqe, before_publish: impl FnOnce()) {
        if self.port.is_some_and(|p| !std::ptr::eq(p, port)) {
            self.check();
        }
        if port.newest().push_here(cqe, before_publish) {
            self.port = Some(port);
            self.solicited |= cqe.solicited != 0;
            self.success &= cqe.status == 0;
        }
    }

    fn check(&mut self) {
        if let Some(p) = self.port.take() {
            p.notify(self.solicited, self.success);
        }
        self.solicited = false;
        self.success = true;
    }
}

impl Default for Batch<'_> {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        self.check();
    }
}
