//! Completion queues: a shared ring of CQEs per CQ, filled by the owner and
//! by peers, polled by the owner.

use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use super::context::{inner, limits, ContextInner};
use super::cq_iter::CqIter;
use super::notify::CqPort;
use super::qp::SvQp;
use super::set_errno;
use crate::model::cq::arm_state;
use crate::model::device::DEAD_ERRNO;
use crate::shm::layout::{ring_offset, seg_bytes, CqHeader, Cqe, MAGIC};
use crate::shm::ring::Ring;
use crate::shm::segment::IdKind;
use crate::shm::Ids;
use crate::sys::ibv;

/// A completion queue.
#[repr(C)]
pub struct SvCq {
    /// The libibverbs part: an `ibv_cq_ex`, whose prefix is an `ibv_cq`, so
    /// one layout serves `ibv_create_cq` and `ibv_create_cq_ex`.
    pub cq: ibv::ibv_cq_ex,
    /// The current completion of an extended CQ and its lock
    /// (`start_poll` … `end_poll`).
    pub iter: CqIter,
    /// CQ id (segment `cq-<id>`).
    pub id: u32,
    /// Owning context (its `dead` flag).
    pub ctx: *const ContextInner,
    /// The ring and its notification state.
    pub port: CqPort,
    /// QPs using this CQ as send CQ (their send queues progress on poll).
    pub send_qps: Mutex<Vec<usize>>,
    /// Number of those QPs that have sends waiting for the responder.
    pub waiting: AtomicU32,
    /// QPs using this CQ as receive CQ (destroy_cq answers EBUSY meanwhile).
    pub recv_users: AtomicU32,
    /// Consecutive empty polls (see [`EMPTY_POLLS_BEFORE_YIELD`]).
    pub empty_polls: AtomicU32,
    /// Whether consumers take the consumer lock (`iter`, cq_iter step 1):
    /// false only for a CQ created with `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`.
    pub locked: bool,
    /// CQEs taken off an older ring of a grown CQ ahead of a newer one's
    /// ([`SvCq::pop`]) that are still to be polled, ahead of everything in
    /// the rings.
    stash: Mutex<VecDeque<Cqe>>,
    /// Whether `stash` may be non-empty (the fast path skips its lock).
    stashed: AtomicBool,
}

/// After this many consecutive empty polls, `poll_cq` yields the CPU once.
/// On a machine with fewer cores than spinning processes, the peer that
/// would produce the next completion may be waiting for this very core; a
/// yield now and then costs nothing measurable when cores are free.
pub const EMPTY_POLLS_BEFORE_YIELD: u32 = 128;

/// How long [`SvCq::clean`] waits for a producer that took a slot of the
/// ring to publish it (shm::ring step 6). A live producer is a few
/// instructions from it; one that died inside its push stopped the ring for
/// every consumer already.
const PUBLISH_PATIENCE: Duration = Duration::from_secs(1);

impl SvCq {
    /// Whether the device died for the owning context (model::device).
    pub fn dead(&self) -> bool {
        // SAFETY: a context outlives its CQs (verbs rule: destroy before
        // close).
        unsafe { &*self.ctx }.dead()
    }

    /// Retry the waiting sends of QPs that use this CQ as send CQ.
    pub fn progress_waiting(&self) {
        let s = self;
        if s.waiting.load(Ordering::Relaxed) != 0 {
            let qps = s.send_qps.lock().unwrap_or_else(|e| e.into_inner());
            for &q in qps.iter() {
                // SAFETY: destroy_qp removes its QP from send_qps under this lock
                // before freeing it, so every entry is live while we hold it.
                unsafe { (*(q as *const SvQp)).try_progress() };
            }
        }
    }

    /// The next completion: the stash first, then the rings of the CQ,
    /// oldest first (a CQ grown by `ibv_resize_cq` has several,
    /// provider::notify). The caller is the CQ's consumer: it holds the
    /// consumer lock (cq_iter step 1) or polls a single-threaded CQ.
    ///
    /// The common case — nothing stashed, never resized — is the ring's own
    /// pop, inlined into the extended CQ's `take`; the rest is
    /// `SvCq::pop_slow`, out of line. (When the whole of this was one
    /// function, the compiler stopped inlining it into `poll_cq`: every
    /// completion paid a call and two copies of the CQE through the stack,
    /// 18–20 ns per completion in benches/verbs_dispatch.rs's hand-written
    /// loop instead of 10–11, docs/benchmarks-softverbs.md.)
    #[inline(always)]
    pub fn pop(&self) -> Option<Cqe> {
        if !self.stashed.load(Ordering::Acquire)
            && self.port.hdr().moved_to.load(Ordering::Acquire) == 0
        {
            return self.port.ring().pop();
        }
        self.pop_slow()
    }

    /// [`SvCq::pop`] when something is stashed or the CQ was resized.
    #[cold]
    #[inline(never)]
    fn pop_slow(&self) -> Option<Cqe> {
        if self.stashed.load(Ordering::Acquire) {
            let mut st = self.stash.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(e) = st.pop_front() {
                return Some(e);
            }
            self.stashed.store(false, Ordering::Release);
        }
        if self.port.hdr().moved_to.load(Ordering::Acquire) == 0 {
            return self.port.ring().pop();
        }
        let chain = self.port.chain();
        let (newest, older) = chain.split_last()?;
        for p in older {
            if let Some(e) = p.ring().pop() {
                return Some(e);
            }
        }
        let e = newest.ring().pop()?;
        // A producer that saw no move yet may have pushed into an older
        // ring after we looked, then the completions after it into the
        // newest: those come first.
        if older.iter().all(|p| p.ring().is_empty()) {
            return Some(e);
        }
        let mut st = self.stash.lock().unwrap_or_else(|e| e.into_inner());
        for p in older {
            while let Some(x) = p.ring().pop() {
                st.push_back(x);
            }
        }
        st.push_back(e);
        let first = st.pop_front();
        self.stashed.store(!st.is_empty(), Ordering::Release);
        first
    }

    /// Remove every completion of QP `qpn` not yet polled, keeping the
    /// order of the others (a QP destroyed or moved to RESET, as mlx5's
    /// `__mlx5_cq_clean` does; provider::purge step P5): from the stash, and
    /// in place from every ring of the CQ (shm::ring steps 5–8), as the CQ's
    /// only consumer (cq_iter step 1). Producers of other QPs may push
    /// meanwhile; the caller made sure that nothing naming `qpn` is still
    /// to come. Returns how many were removed.
    ///
    /// The calling thread must not be inside an `ibv_start_poll` …
    /// `ibv_end_poll` of this CQ (it would wait for itself, as with mlx5).
    pub fn clean(&self, qpn: u32) -> usize {
        let _consumer = self.iter.hold(self.locked);
        let mut removed = {
            let mut st = self.stash.lock().unwrap_or_else(|e| e.into_inner());
            let before = st.len();
            st.retain(|e| e.qp_num != qpn);
            self.stashed.store(!st.is_empty(), Ordering::Release);
            before - st.len()
        };
        for p in self.port.chain() {
            // SAFETY: this thread is the ring's only consumer: it holds the
            // consumer lock, or the CQ was created single-threaded and the
            // application promised that one thread uses it (what mlx5's
            // unlocked clean relies on too).
            removed += unsafe { p.ring().retain(|e| e.qp_num != qpn, PUBLISH_PATIENCE) };
        }
        removed
    }

    /// Completions waiting to be polled.
    pub fn pending(&self) -> usize {
        let stashed = self.stash.lock().unwrap_or_else(|e| e.into_inner()).len();
        stashed
            + self
                .port
                .chain()
                .iter()
                .map(|p| p.ring().len())
                .sum::<usize>()
    }

    /// Count an empty poll; yield the CPU every [`EMPTY_POLLS_BEFORE_YIELD`].
    pub fn empty_poll(&self) {
        let n = self.empty_polls.load(Ordering::Relaxed) + 1;
        if n >= EMPTY_POLLS_BEFORE_YIELD {
            self.empty_polls.store(0, Ordering::Relaxed);
            std::thread::yield_now();
        } else {
            self.empty_polls.store(n, Ordering::Relaxed);
        }
    }
}

/// `create_cq`.
///
/// # Safety
/// `ctx` is a live softverbs context; `channel` is null or a channel.
pub unsafe extern "C" fn create_cq(
    ctx: *mut ibv::ibv_context,
    cqe: c_int,
    channel: *mut ibv::ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv::ibv_cq {
    // SAFETY: caller contract.
    unsafe { make_cq(ctx, cqe, channel, comp_vector, false) }.cast()
}

/// Build a CQ (both creation paths); `stamp`: its completions carry
/// timestamps ([`CqHeader::stamp`]). EINVAL for a size outside
/// 1..=`MAX_CQE` or a `comp_vector` outside 0..`num_comp_vectors`.
///
/// # Safety
/// As [`create_cq`].
pub unsafe fn make_cq(
    ctx: *mut ibv::ibv_context,
    cqe: c_int,
    channel: *mut ibv::ibv_comp_channel,
    comp_vector: c_int,
    stamp: bool,
) -> *mut SvCq {
    // SAFETY: caller contract.
    let c = unsafe { inner(ctx) };
    if c.dead() {
        return super::dead();
    }
    // SAFETY: caller contract: a live context (alloc_context set the count).
    let vectors = unsafe { (*ctx).num_comp_vectors };
    if cqe <= 0 || cqe as u32 > limits::MAX_CQE || !(0..vectors).contains(&comp_vector) {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    let chan_fd = if channel.is_null() {
        -1
    } else if super::channel::is_ours(channel) {
        // SAFETY: a live channel built by the interposer.
        unsafe { (*channel).fd }
    } else {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    };
    let cap = Ring::<Cqe>::capacity_for(cqe as usize);
    let (id, port) = match new_ring(c, cap, chan_fd, 0, stamp) {
        Ok(x) => x,
        Err(e) => {
            set_errno(e);
            return std::ptr::null_mut();
        }
    };
    let hdr = port.hdr_ptr();
    let cq = Box::new(SvCq {
        // SAFETY: all-zero is valid for ibv_cq_ex (pointers, ints, glibc
        // pthread objects whose zero value is the static initialiser).
        cq: unsafe { std::mem::zeroed() },
        id,
        ctx: c,
        port,
        send_qps: Mutex::new(Vec::new()),
        waiting: AtomicU32::new(0),
        empty_polls: AtomicU32::new(0),
        recv_users: AtomicU32::new(0),
        locked: true,
        iter: CqIter::new(),
        stash: Mutex::new(VecDeque::new()),
        stashed: AtomicBool::new(false),
    });
    let raw = Box::into_raw(cq);
    // SAFETY: `raw` is the live box; the header is ours to finish.
    unsafe {
        (*raw).cq.cqe = reported(cap);
        (*raw).cq.handle = id;
        (*hdr).cq_ptr = std::ptr::addr_of_mut!((*raw).cq) as u64;
    }
    raw
}

/// A fresh CQ segment `cq-<id>` with a ring of `cap` entries, its header
/// filled (the `ibv_cq *` may be 0 and set later by the creator); the id
/// and the owner's port, or an errno.
fn new_ring(
    c: &ContextInner,
    cap: usize,
    chan_fd: i32,
    cq_ptr: u64,
    stamp: bool,
) -> Result<(u32, CqPort), i32> {
    let ids = Ids::get().map_err(|e| crate::shm::fabric::errno(&e, libc::EIO))?;
    let (id, seg) = crate::shm::segment::create_fresh(
        "cq-",
        || ids.next(IdKind::Cq),
        seg_bytes::<CqHeader, Cqe>(cap),
    )
    .map_err(|e| crate::shm::fabric::errno(&e, libc::EIO))?;
    // SAFETY: the fresh, zeroed segment is large enough for the ring at
    // ring_offset and unknown to anyone else until its id is published.
    unsafe { Ring::<Cqe>::init(seg.base().add(ring_offset::<CqHeader>()), cap) };
    let hdr = seg.base().cast::<CqHeader>();
    // SAFETY: as above; the header fits at the start.
    unsafe {
        (*hdr).pid = std::process::id();
        (*hdr).ctx = c.id;
        (*hdr).chan_fd = chan_fd;
        (*hdr).cq_ptr = cq_ptr;
        (*hdr).async_fd.store(c.async_r, Ordering::Relaxed);
        (*hdr).stamp.store(u32::from(stamp), Ordering::Relaxed);
        (*hdr).magic = MAGIC;
    }
    let port = CqPort::attach(seg).ok_or(libc::EIO)?;
    Ok((id, port))
}

/// `resize_cq` (`ibv_resize_cq(3)`): at least `cqe` entries. EINVAL for a
/// size outside 1..=`MAX_CQE` or below the completions waiting to be
/// polled. A size the current ring holds keeps it (`cq->cqe` reports what
/// the CQ holds, at least `cqe`); a larger one grows the CQ into a new
/// ring (provider::notify): completions go there from then on, and
/// those still in the old ring are polled first, in order.
///
/// # Safety
/// `cq` is live; the application does not poll or resize it from another
/// thread meanwhile (as for every provider).
pub unsafe extern "C" fn resize_cq(cq: *mut ibv::ibv_cq, cqe: c_int) -> c_int {
    // SAFETY: caller contract.
    let s = unsafe { sv(cq) };
    if s.dead() {
        return DEAD_ERRNO;
    }
    if cqe <= 0 || cqe as u32 > limits::MAX_CQE || (cqe as usize) < s.pending() {
        return libc::EINVAL;
    }
    let newest = s.port.newest();
    let cap = newest.ring().capacity();
    if cqe as usize <= cap {
        // SAFETY: `cq` is live (caller contract).
        unsafe { (*cq).cqe = reported(cap) };
        return 0;
    }
    let want = Ring::<Cqe>::capacity_for(cqe as usize);
    let h = newest.hdr();
    // SAFETY: the context outlives its CQs.
    let c = unsafe { &*s.ctx };
    let stamp = h.stamp.load(Ordering::Relaxed) != 0;
    let (id, port) = match new_ring(c, want, h.chan_fd, h.cq_ptr, stamp) {
        Ok(x) => x,
        Err(e) => return e,
    };
    // An arm made before the resize still holds.
    port.hdr()
        .armed
        .store(h.armed.load(Ordering::Acquire), Ordering::Release);
    if !newest.grow_into(port, id) {
        return libc::EIO;
    }
    // SAFETY: as above.
    unsafe { (*cq).cqe = reported(want) };
    0
}

/// What `cq->cqe` says of a ring of `cap` slots: all of them, but never
/// more than `max_cqe` (a CQ of `MAX_CQE` = 4Mi - 1 entries has 4Mi
/// slots), so that the size a CQ reports can always be asked for again
/// (`ibv_resize_cq(cq, cq->cqe)`, a new CQ of that size). It is still at
/// least what was asked for.
fn reported(cap: usize) -> c_int {
    cap.min(limits::MAX_CQE as usize) as c_int
}

/// The SvCq of an `ibv_cq` of this provider.
///
/// # Safety
/// `cq` was made by [`create_cq`] and is live.
pub unsafe fn sv<'a>(cq: *mut ibv::ibv_cq) -> &'a SvCq {
    // SAFETY: `cq` is the first field of a boxed SvCq.
    unsafe { &*cq.cast::<SvCq>() }
}

/// `destroy_cq`. EBUSY while a QP uses the CQ (as send or receive CQ) or
/// an XRC SRQ completes into it, as the kernel answers. Never waits for
/// event acknowledgements: the events were written to a pipe that the
/// application drains itself.
///
/// # Safety
/// `cq` was made by [`create_cq`]; not used afterwards.
pub unsafe extern "C" fn destroy_cq(cq: *mut ibv::ibv_cq) -> c_int {
    // SAFETY: caller contract.
    let s = unsafe { sv(cq) };
    if !s
        .send_qps
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_empty()
        || s.recv_users.load(Ordering::Acquire) != 0
    {
        return libc::EBUSY;
    }
    // SAFETY: caller contract: last use of the box.
    drop(unsafe { Box::from_raw(cq.cast::<SvCq>()) });
    0
}

/// `poll_cq`: progress waiting sends of QPs on this CQ, then drain the ring.
/// On a dead context: `-EIO` (model::device), whatever the ring holds.
///
/// # Safety
/// `cq` is live; `wc` has room for `n` entries.
pub unsafe extern "C" fn poll_cq(cq: *mut ibv::ibv_cq, n: c_int, wc: *mut ibv::ibv_wc) -> c_int {
    // SAFETY: caller contract.
    let s = unsafe { sv(cq) };
    if s.dead() {
        return -DEAD_ERRNO;
    }
    s.progress_waiting();
    // The CQ's only consumer until the polls are done (cq_iter step 1).
    let consumer = s.iter.hold(s.locked);
    let n = n.max(0);
    let mut got = 0;
    // The common case in a loop of its own, which the compiler keeps
    // tight (each CQE read from its slot straight into `wc`, no call, no
    // copy through the stack; see SvCq::pop): one ring — the CQ was never
    // resized, and a resize is not concurrent with a poll (verbs
    // contract) — and nothing stashed (only a consumer stashes, and this
    // call is the only one).
    let slow =
        s.port.hdr().moved_to.load(Ordering::Acquire) != 0 || s.stashed.load(Ordering::Acquire);
    if !slow {
        let ring = s.port.ring();
        while got < n {
            let Some(e) = ring.pop() else { break };
            // SAFETY: `wc` has room for n entries (caller contract), got < n.
            unsafe { fill_wc(wc.add(got as usize), &e) };
            got += 1;
        }
    } else {
        while got < n {
            let Some(e) = s.pop() else { break };
            // SAFETY: as above.
            unsafe { fill_wc(wc.add(got as usize), &e) };
            got += 1;
        }
    }
    // An empty poll may yield the CPU: not while holding the lock.
    drop(consumer);
    if got == 0 {
        s.empty_poll();
    } else {
        s.empty_polls.store(0, Ordering::Relaxed);
    }
    got
}

/// Write a CQE into a user `ibv_wc`.
///
/// # Safety
/// `wc` is writable.
unsafe fn fill_wc(wc: *mut ibv::ibv_wc, e: &Cqe) {
    // SAFETY: caller contract; every field is written through the pointer.
    unsafe {
        let w = &mut *wc;
        w.wr_id = e.wr_id;
        w.status = e.status;
        w.opcode = e.opcode;
        w.vendor_err = 0;
        w.byte_len = e.byte_len;
        w.imm_data_invalidated_rkey_union.imm_data = e.imm;
        w.qp_num = e.qp_num;
        w.src_qp = e.src_qp;
        w.wc_flags = e.wc_flags;
        w.pkey_index = e.pkey_index as u16;
        w.slid = crate::model::ud::PORT_LID;
        w.sl = e.sl as u8;
        w.dlid_path_bits = 0;
    }
}

/// `req_notify_cq`.
///
/// # Safety
/// `cq` is live.
pub unsafe extern "C" fn req_notify_cq(cq: *mut ibv::ibv_cq, solicited_only: c_int) -> c_int {
    // SAFETY: caller contract.
    let s = unsafe { sv(cq) };
    if s.dead() {
        return DEAD_ERRNO;
    }
    s.port.arm(arm_state(solicited_only != 0));
    0
}

/// `cq_event`: called by `ibv_get_cq_event`; nothing to account here.
///
/// # Safety
/// Any argument.
pub unsafe extern "C" fn cq_event(_cq: *mut ibv::ibv_cq) {}

crate::opaque_debug!(SvCq);
