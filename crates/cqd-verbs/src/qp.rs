//! Queue pairs — reliable connected (RC) and unreliable datagram (UD, see
//! [`crate::ah`]): creation with admission, the endpoint exchange,
//! INIT → RTR → RTS, and posting through cqd's posting call.
//!
//! A QP is made on a send CQ and a receive CQ (or an SRQ); its depths are
//! admitted on those CQs' budgets against the entries the device really
//! granted, so a CQ cannot overflow, and its queues' accounts are opened in
//! the CQs' ledgers, so every request posted through
//! [`Registration::post_send`](cqd_core::Registration::post_send) /
//! [`post_recv`](cqd_core::Registration::post_recv) is retired by the
//! poller with its credits. There is no other way to post on a [`Qp`]:
//! the posting call is the only door.

use std::collections::HashMap;
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use cqd_core::account::{DrainMarker, Queue, QueueAccount};
use cqd_core::budget::Admission;
use cqd_core::cq::Registration;
use cqd_core::ledger::{CloseSignal, CloseWait, SrqUser, Zombie};
use cqd_core::post::{check_atomic, check_datagram, Invalid, PostRecv, PostSend};
use parking_lot::Mutex;

use crate::ah::AhInner;
use crate::cq::{Cq, CqInner};
use crate::device::{Route, Teardown};
use crate::error::{PostError, VerbsError};
use crate::pd::{Access, MrInner, Pd, PdInner, Sge};
use crate::srq::{Srq, SrqInner};
use crate::sys;
use crate::wr::{raw_send_wr, transport_check, write_send_wr, WindowUse};
pub use crate::wr::{RecvWr, SendWr, WrOp};

/// A path MTU (`enum ibv_mtu`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Mtu {
    /// 256 bytes.
    M256,
    /// 512 bytes.
    M512,
    /// 1024 bytes.
    M1024,
    /// 2048 bytes.
    M2048,
    /// 4096 bytes.
    M4096,
}

impl Mtu {
    /// From `enum ibv_mtu` (1..=5); anything else is 1024 (the verbs
    /// default a port reports before it is up).
    pub fn from_raw(raw: u32) -> Mtu {
        match raw {
            1 => Mtu::M256,
            2 => Mtu::M512,
            4 => Mtu::M2048,
            5 => Mtu::M4096,
            _ => Mtu::M1024,
        }
    }

    /// As `enum ibv_mtu`.
    pub fn to_raw(self) -> u32 {
        match self {
            Mtu::M256 => 1,
            Mtu::M512 => 2,
            Mtu::M1024 => 3,
            Mtu::M2048 => 4,
            Mtu::M4096 => 5,
        }
    }

    /// From a size in bytes (256, 512, 1024, 2048, 4096).
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        Some(match bytes {
            256 => Mtu::M256,
            512 => Mtu::M512,
            1024 => Mtu::M1024,
            2048 => Mtu::M2048,
            4096 => Mtu::M4096,
            _ => return None,
        })
    }

    /// The size in bytes.
    pub fn bytes(self) -> u32 {
        128 << self.to_raw()
    }
}

/// What a peer needs to connect to a QP, exchanged out of band (TCP,
/// a file, rdma_cm's private data): serde makes it any format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Endpoint {
    /// The port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// The GID used for a global route (RoCE, or routed InfiniBand); all
    /// zero for none.
    pub gid: [u8; 16],
    /// The QP number.
    pub qpn: u32,
    /// The first packet sequence number the QP sends (24 bits).
    pub psn: u32,
    /// The path MTU this side can use.
    pub mtu: Mtu,
}

impl Endpoint {
    /// True if a global route header is needed (a non-zero GID).
    pub fn has_gid(&self) -> bool {
        self.gid != [0; 16]
    }
}

/// The depths of a QP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpCap {
    /// Send queue depth.
    pub max_send_wr: u32,
    /// Receive queue depth (ignored with an SRQ).
    pub max_recv_wr: u32,
    /// SGEs per send request.
    pub max_send_sge: u32,
    /// SGEs per receive.
    pub max_recv_sge: u32,
    /// Inline bytes per send.
    pub max_inline_data: u32,
}

impl Default for QpCap {
    fn default() -> Self {
        QpCap {
            max_send_wr: 64,
            max_recv_wr: 64,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        }
    }
}

/// The transport of a QP (`ibv_qp_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum QpType {
    /// Reliable connected (`IBV_QPT_RC`): one peer, every operation.
    #[default]
    Rc,
    /// Unreliable datagram (`IBV_QPT_UD`): SEND (with immediate) to any
    /// UD QP named per request, one MTU at most.
    Ud,
}

impl QpType {
    /// `RC` or `UD`.
    pub fn name(self) -> &'static str {
        match self {
            QpType::Rc => "RC",
            QpType::Ud => "UD",
        }
    }
}

/// How to make a QP.
#[derive(Debug, Clone)]
pub struct QpInit<'a> {
    /// The CQ of its send completions.
    pub send_cq: &'a Cq,
    /// The CQ of its receive completions (may be the same).
    pub recv_cq: &'a Cq,
    /// An SRQ to draw receives from.
    pub srq: Option<&'a Srq>,
    /// Depths.
    pub cap: QpCap,
    /// The handler that owns the QP: its asynchronous events (fatal, access
    /// errors, last WQE reached) go to its `on_async`. It must be
    /// registered on the send or the receive CQ (checked).
    pub owner: Option<&'a Registration>,
    /// The transport: RC (the default) or UD.
    pub qp_type: QpType,
}

impl<'a> QpInit<'a> {
    /// A QP on `send_cq` and `recv_cq` with the given depths.
    pub fn new(send_cq: &'a Cq, recv_cq: &'a Cq, cap: QpCap) -> Self {
        QpInit {
            send_cq,
            recv_cq,
            srq: None,
            cap,
            owner: None,
            qp_type: QpType::Rc,
        }
    }

    /// An unreliable-datagram QP (see [`crate::ah`]).
    pub fn datagram(mut self) -> Self {
        self.qp_type = QpType::Ud;
        self
    }

    /// Receives from `srq`.
    pub fn with_srq(mut self, srq: &'a Srq) -> Self {
        self.srq = Some(srq);
        self
    }

    /// Owned by `handler` (see [`QpInit::owner`]).
    pub fn owned_by(mut self, handler: &'a Registration) -> Self {
        self.owner = Some(handler);
        self
    }
}

/// How to bring a QP to RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectOptions {
    /// The local port.
    pub port: u8,
    /// The local GID index for a global route; `None`: no GRH unless the
    /// peer sent a GID (then index 0).
    pub gid_index: Option<u8>,
    /// The path MTU; `None`: the smaller of the two endpoints'.
    pub mtu: Option<Mtu>,
    /// What the peer may do to our memory through this QP.
    pub access: Access,
    /// Service level.
    pub sl: u8,
    /// Local ACK timeout (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Transport retries.
    pub retry_cnt: u8,
    /// RNR retries (7: forever).
    pub rnr_retry: u8,
    /// Minimal RNR NAK timer.
    pub min_rnr_timer: u8,
    /// Outstanding RDMA READs / atomics as initiator and as target.
    pub max_rd_atomic: u8,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        ConnectOptions {
            port: 1,
            gid_index: None,
            mtu: None,
            access: Access(Access::REMOTE_WRITE.0 | Access::REMOTE_READ.0 | Access::LOCAL_WRITE.0),
            sl: 0,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            max_rd_atomic: 1,
        }
    }
}

/// The regions a queue posted with, kept until the queue is destroyed (see
/// `pd`'s module documentation).
#[derive(Default)]
pub(crate) struct Pins {
    regions: Mutex<HashMap<usize, Arc<MrInner>>>,
    /// The region pinned last: a queue that posts with one region (the
    /// usual case) takes no lock after its first post.
    last: std::sync::atomic::AtomicUsize,
    /// The address handles UD sends named (a device reads the AH when it
    /// sends, which may be after the post returned).
    ahs: Mutex<HashMap<usize, Arc<AhInner>>>,
    last_ah: std::sync::atomic::AtomicUsize,
}

impl Pins {
    /// Pins the regions of `sges` (inline: a post with the region pinned
    /// last costs a load and a compare per SGE).
    #[inline]
    pub(crate) fn pin(&self, sges: &[Sge<'_>]) {
        use std::sync::atomic::Ordering;
        for s in sges {
            let key = Arc::as_ptr(&s.mr.inner) as usize;
            // A region once pinned stays pinned while the queue lives.
            if self.last.load(Ordering::Relaxed) != key {
                self.pin_new(s, key);
            }
        }
    }

    /// Out of line: a region other than the one pinned last.
    #[cold]
    #[inline(never)]
    fn pin_new(&self, s: &Sge<'_>, key: usize) {
        use std::sync::atomic::Ordering;
        self.regions
            .lock()
            .entry(key)
            .or_insert_with(|| Arc::clone(&s.mr.inner));
        self.last.store(key, Ordering::Relaxed);
    }

    pub(crate) fn pin_ah(&self, ah: &Arc<AhInner>) {
        use std::sync::atomic::Ordering;
        let key = Arc::as_ptr(ah) as usize;
        if self.last_ah.load(Ordering::Relaxed) == key {
            return;
        }
        self.ahs.lock().entry(key).or_insert_with(|| Arc::clone(ah));
        self.last_ah.store(key, Ordering::Relaxed);
    }
}

/// Per-thread scratch lists for building `ibv_*_wr` chains: a post
/// allocates nothing once its thread has posted a list as long.
struct Scratch {
    sges: Vec<sys::ibv_sge>,
    send: Vec<sys::ibv_send_wr>,
    recv: Vec<sys::ibv_recv_wr>,
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = const {
        std::cell::RefCell::new(Scratch { sges: Vec::new(), send: Vec::new(), recv: Vec::new() })
    };
}

/// Runs `f` with this thread's scratch lists, emptied (fresh ones if the
/// thread's are in use).
fn with_scratch<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
    SCRATCH.with(|cell| match cell.try_borrow_mut() {
        Ok(mut s) => {
            s.sges.clear();
            s.send.clear();
            s.recv.clear();
            f(&mut s)
        }
        Err(_) => f(&mut Scratch {
            sges: Vec::new(),
            send: Vec::new(),
            recv: Vec::new(),
        }),
    })
}

/// Checks the SGEs of request `index` against the queue's limits and the
/// queue's domain.
#[inline]
pub(crate) fn check_sges(
    queue: &dyn Fn() -> String,
    index: usize,
    sges: &[Sge<'_>],
    max: u32,
    pd: &Arc<PdInner>,
) -> Result<(), PostError> {
    if sges.len() <= max as usize && sges.iter().all(|s| s.mr.same_pd(pd)) {
        return Ok(());
    }
    sges_refused(queue, index, sges, max, pd)
}

/// Out of line: why [`check_sges`] refused.
#[cold]
#[inline(never)]
fn sges_refused(
    queue: &dyn Fn() -> String,
    index: usize,
    sges: &[Sge<'_>],
    max: u32,
    pd: &Arc<PdInner>,
) -> Result<(), PostError> {
    if sges.len() > max as usize {
        return Err(PostError::Invalid {
            queue: queue(),
            index,
            why: format!("{} SGEs, the queue allows {max}", sges.len()),
        });
    }
    if let Some(s) = sges.iter().find(|s| !s.mr.same_pd(pd)) {
        return Err(PostError::Invalid {
            queue: queue(),
            index,
            why: format!(
                "SGE of region lkey {:#x} of another protection domain",
                s.mr.lkey()
            ),
        });
    }
    Ok(())
}

/// Builds the linked `ibv_recv_wr` list of `wrs` and posts it.
pub(crate) fn post_recv_list(
    target: sys::RecvTarget,
    queue: &dyn Fn() -> String,
    max_sge: u32,
    pd: &Arc<PdInner>,
    pins: &Pins,
    wrs: &[RecvWr<'_>],
) -> Result<(), (usize, PostError)> {
    with_scratch(|sc| {
        let Scratch {
            sges, recv: raw, ..
        } = sc;
        // Checked whole before the device sees any (a refusal posted nothing).
        for (i, w) in wrs.iter().enumerate() {
            check_sges(queue, i, w.sg_list, max_sge, pd).map_err(|e| (0, e))?;
            sges.extend(w.sg_list.iter().map(Sge::raw));
        }
        let mut at = 0usize;
        for w in wrs {
            raw.push(sys::ibv_recv_wr {
                wr_id: w.wr_id,
                next: std::ptr::null_mut(),
                sg_list: if w.sg_list.is_empty() {
                    std::ptr::null_mut()
                } else {
                    // SAFETY: `at` is within `sges` (sum of the lengths).
                    unsafe { sges.as_mut_ptr().add(at) }
                },
                num_sge: w.sg_list.len() as i32,
            });
            at += w.sg_list.len();
            pins.pin(w.sg_list);
        }
        link(raw, |w, next| w.next = next);
        let verb = match target {
            sys::RecvTarget::Qp(_) => "ibv_post_recv",
            sys::RecvTarget::Srq(_) => "ibv_post_srq_recv",
        };
        // SAFETY: the target is live (its owner holds it); the list is linked
        // with a null tail; its SGEs name regions pinned above until the queue
        // is destroyed.
        unsafe { sys::post_recv(target, raw) }
            .map_err(|(i, e)| (i, device_error(pd, verb, queue(), i, e)))
    })
}

/// A post the device refused: a gone device (its fatal event read, or
/// EIO / ENODEV) or the refused request named with its errno.
fn device_error(
    pd: &PdInner,
    verb: &'static str,
    queue: String,
    index: usize,
    e: std::io::Error,
) -> PostError {
    if pd.ctx.fatal.load(std::sync::atomic::Ordering::Acquire)
        || matches!(e.raw_os_error(), Some(libc::EIO | libc::ENODEV))
    {
        return PostError::DeviceGone {
            device: pd.ctx.name.clone(),
            queue,
        };
    }
    PostError::Device {
        verb,
        queue,
        index,
        source: e,
    }
}

/// Links `v[i]` to `v[i + 1]`, the last to null.
fn link<T>(v: &mut [T], set: impl Fn(&mut T, *mut T)) {
    let n = v.len();
    let base = v.as_mut_ptr();
    for i in 0..n {
        let next = if i + 1 < n {
            // SAFETY: `i + 1 < n`: inside the slice.
            unsafe { base.add(i + 1) }
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: `i < n`: inside the slice; no other reference is live.
        set(unsafe { &mut *base.add(i) }, next);
    }
}

pub(crate) struct QpInner {
    qp: NonNull<sys::ibv_qp>,
    qpn: u32,
    pd: Arc<PdInner>,
    send_cq: Arc<CqInner>,
    recv_cq: Arc<CqInner>,
    srq: Option<Arc<SrqInner>>,
    cap: QpCap,
    qp_type: QpType,
    /// The largest datagram (UD: the port's active MTU, read by
    /// `ready_ud`; 0 before).
    mtu: std::sync::atomic::AtomicU32,
    send_account: Arc<QueueAccount>,
    recv_account: Arc<QueueAccount>,
    /// Its use of an SRQ, as the receive CQ's ledger keeps it.
    pub(crate) srq_user: Option<Arc<SrqUser>>,
    /// How it is torn down (its device's, when it was made).
    teardown: Teardown,
    /// Fired once it is destroyed and its admission given back
    /// ([`Qp::close`]).
    closed: Arc<CloseSignal>,
    pins: Pins,
    /// Its memory windows, deallocated before it is destroyed.
    windows: crate::window::Windows,
    pub(crate) _admissions: Vec<Admission>,
}

// SAFETY: libibverbs QPs may be posted to and modified from any thread;
// the pointer is only used through `sys`.
unsafe impl Send for QpInner {}
// SAFETY: as above.
unsafe impl Sync for QpInner {}

impl QpInner {
    /// Requests posted on the QP (an SRQ's counted separately) and not yet
    /// retired by the poller.
    pub(crate) fn outstanding(&self) -> usize {
        let recv = if self.srq.is_some() {
            0
        } else {
            self.recv_account.outstanding()
        };
        self.send_account.outstanding() + recv
    }

    /// True when the device may destroy it: nothing outstanding on its own
    /// queues, and (under [`Teardown::QuiesceThenDestroy`]) its SRQ use
    /// quiesced (`cqd_core::ledger::Graveyard`). Asked only once the QP is
    /// in the error state, where it takes no more of its SRQ's receives:
    /// an SRQ account that holds nothing then means that no completion of
    /// the QP can retire anything of it. Under
    /// [`Teardown::DestroyThenQuiesce`] the SRQ use is quiesced after the
    /// destroy (the drop below).
    pub(crate) fn ready(&self) -> bool {
        self.outstanding() == 0
            && self.srq_user.as_ref().is_none_or(|u| {
                self.teardown == Teardown::DestroyThenQuiesce
                    || u.quiesced()
                    || self.recv_account.outstanding() == 0
            })
    }
}

impl Zombie for QpInner {
    fn ready(&self) -> bool {
        QpInner::ready(self)
    }
}

impl Drop for QpInner {
    fn drop(&mut self) {
        let quiesce_later = self.teardown == Teardown::DestroyThenQuiesce;
        if !quiesce_later {
            // Quiesced (step 3), or nothing of the SRQ to account, or its
            // poller gone: the user goes before the number does.
            if let Some(u) = &self.srq_user {
                self.recv_cq.ledger.release_srq_user(u);
            }
        }
        self.pd.ctx.remove_route(self.qp.as_ptr() as usize);
        // Windows first: a type-2 window still bound to a destroyed QP is
        // a device error (rxe waits, then frees the QP under the window).
        self.windows.dealloc_all();
        // SAFETY: the QP is live; after this the device touches none of the
        // memory its requests named (the pins go with `self`).
        if let Err(e) = unsafe { sys::destroy_qp(self.qp) } {
            tracing::error!(qpn = self.qpn, error = %e, "ibv_destroy_qp failed");
        }
        self.send_account.close();
        if self.recv_account.queue() == Queue::Recv {
            self.recv_account.close();
        }
        let admissions = std::mem::take(&mut self._admissions);
        if let (true, Some(user)) = (quiesce_later, &self.srq_user) {
            // Step 2' of `cqd_core::ledger`'s `teardown`: the device wrote
            // every completion of the QP before the destroy returned and
            // keeps them. With receives still outstanding on the SRQ some
            // may be the QP's, unpolled: the receive CQ's poller quiesces
            // the user after its next short poll, and the rest of the QP
            // waits for that. Asked after the destroy, so that the QP took
            // nothing after the count was read.
            if !user.quiesced()
                && self.recv_account.outstanding() > 0
                && self.recv_cq.poller_alive()
            {
                self.recv_cq.quiesce_destroyed(Husk {
                    qpn: self.qpn,
                    user: Arc::clone(user),
                    recv_cq: Arc::clone(&self.recv_cq),
                    _srq: self.srq.clone(),
                    admissions,
                    closed: Arc::clone(&self.closed),
                });
                return;
            }
            self.recv_cq.ledger.release_srq_user(user);
        }
        drop(admissions);
        self.closed.fire();
    }
}

/// What is left of a QP on an SRQ destroyed under
/// [`Teardown::DestroyThenQuiesce`] before its SRQ use is quiesced: its
/// admission and the signal its close waits for. It waits in its receive
/// CQ's graveyard until that CQ's poller has polled the CQ empty after
/// the destroy (step 3 of `cqd_core::ledger`'s `teardown`, which reaps
/// it), or until that poller is gone.
pub(crate) struct Husk {
    pub(crate) qpn: u32,
    pub(crate) user: Arc<SrqUser>,
    recv_cq: Arc<CqInner>,
    /// The SRQ outlives the QP's completions' accounting, as it outlives a
    /// QP destroyed after it.
    _srq: Option<Arc<SrqInner>>,
    admissions: Vec<Admission>,
    closed: Arc<CloseSignal>,
}

impl Zombie for Husk {
    fn ready(&self) -> bool {
        self.user.quiesced()
    }
}

impl Drop for Husk {
    fn drop(&mut self) {
        // Quiesced (the user is detached already: this does nothing), or
        // the receive CQ's poller is gone (what the QP's completions still
        // owed is reported missing by the stop).
        self.recv_cq.ledger.release_srq_user(&self.user);
        drop(std::mem::take(&mut self.admissions));
        self.closed.fire();
    }
}

/// A reliable-connected queue pair.
///
/// Dropped with requests outstanding, it is moved to the error state and
/// kept (not yet destroyed) until its send CQ's poller has retired every
/// flush, so that the accounts stay exact: devices discard the completions
/// of a destroyed QP. If that poller is gone, it is destroyed at once.
pub struct Qp {
    inner: std::mem::ManuallyDrop<QpInner>,
}

impl fmt::Debug for Qp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.inner.qpn)
            .field("send_cq", &self.inner.send_cq.name)
            .field("recv_cq", &self.inner.recv_cq.name)
            .field("cap", &self.inner.cap)
            .finish()
    }
}

impl Pd {
    /// `ibv_create_qp` with `attr` (which it updates with what the device
    /// granted), giving a QP whose number no destroyed QP still holds in
    /// the ledgers of the new QP's CQs. A QP on an SRQ destroyed under
    /// [`Teardown::DestroyThenQuiesce`](crate::Teardown) keeps its number
    /// attached in its receive CQ's ledger until that CQ's poller has
    /// polled its completions (`cqd_core::ledger`, module `teardown`, step
    /// 2'), while the device may give the number to a new QP at once. A
    /// new QP with such a number is kept aside (in RESET it has posted
    /// nothing and completes nothing) while the device makes another, so
    /// that the next one cannot get that number; those kept aside are
    /// destroyed once a QP with a free number is made. Each one kept aside
    /// holds a different number attached in one of the two ledgers, so
    /// this makes at most one QP more than those ledgers have SRQ users.
    fn create_raw_qp(
        &self,
        init: &QpInit<'_>,
        attr: &mut sys::ibv_qp_init_attr,
    ) -> Result<(NonNull<sys::ibv_qp>, u32), VerbsError> {
        let asked = *attr;
        let held = |qpn: u32| {
            init.send_cq.ledger().has_srq_user(qpn) || init.recv_cq.ledger().has_srq_user(qpn)
        };
        let mut aside = Vec::new();
        let made = loop {
            *attr = asked;
            // SAFETY: the domain, CQs and SRQ are live objects of one
            // device (checked by the caller), held by `self` and `init`.
            let qp = match unsafe { sys::create_qp(self.inner.pd, attr) } {
                Ok(qp) => qp,
                Err(e) => {
                    break Err(VerbsError::verb(
                        "ibv_create_qp",
                        format!("{} QP on {}", init.qp_type.name(), init.send_cq.name()),
                        e,
                    ))
                }
            };
            // SAFETY: `qp` is live.
            let qpn = unsafe { sys::qp_num(qp) };
            if !held(qpn) {
                break Ok((qp, qpn));
            }
            tracing::debug!(
                qpn,
                "new QP got the number of a destroyed QP whose completions are still to be polled; kept aside"
            );
            aside.push(qp);
        };
        for qp in aside {
            // SAFETY: made above and never posted on or shared.
            if let Err(e) = unsafe { sys::destroy_qp(qp) } {
                tracing::error!(error = %e, "ibv_destroy_qp of a QP kept aside failed");
            }
        }
        made
    }

    /// Creates an RC QP in RESET and admits its depths on its CQs: the
    /// send depth the device granted on the send CQ, the receive depth (or
    /// the SRQ's) on the receive CQ. A CQ that cannot hold them refuses
    /// the QP ([`VerbsError::Budget`]) and nothing is left behind.
    ///
    /// # Errors
    /// CQs or SRQ of another device or domain ([`VerbsError::Invalid`]);
    /// `ibv_create_qp` failed; admission refused.
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<Qp, VerbsError> {
        self.inner.ctx.check()?;
        for cq in [init.send_cq, init.recv_cq] {
            if !Arc::ptr_eq(&cq.inner.channel.ctx, &self.inner.ctx) {
                return Err(VerbsError::Invalid(format!(
                    "CQ {} belongs to another device context",
                    cq.name()
                )));
            }
        }
        if let Some(srq) = init.srq {
            if !Arc::ptr_eq(&srq.inner.pd, &self.inner) {
                return Err(VerbsError::Invalid(
                    "the SRQ belongs to another protection domain".into(),
                ));
            }
        }
        if let Some(reg) = init.owner {
            if !reg.is_on(init.send_cq.ledger()) && !reg.is_on(init.recv_cq.ledger()) {
                return Err(VerbsError::Invalid(format!(
                    "QP owner {} is registered on neither of the QP's CQs",
                    reg.key()
                )));
            }
        }
        // SAFETY: plain C data; all-zero is a valid value.
        let mut attr: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = init.send_cq.inner.cq.as_ptr();
        attr.recv_cq = init.recv_cq.inner.cq.as_ptr();
        attr.srq = init
            .srq
            .map_or(std::ptr::null_mut(), |s| s.inner.srq.as_ptr());
        attr.qp_type = match init.qp_type {
            QpType::Rc => sys::ibv_qp_type::IBV_QPT_RC,
            QpType::Ud => sys::ibv_qp_type::IBV_QPT_UD,
        };
        // Signaling is per request (`SendWr::signaled`), which the posting
        // call records; a QP-wide `sq_sig_all` would make unsignaled-marked
        // requests complete unannounced, so cqd never sets it.
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = init.cap.max_send_wr;
        attr.cap.max_recv_wr = if init.srq.is_some() {
            0
        } else {
            init.cap.max_recv_wr
        };
        attr.cap.max_send_sge = init.cap.max_send_sge;
        attr.cap.max_recv_sge = if init.srq.is_some() {
            0
        } else {
            init.cap.max_recv_sge
        };
        attr.cap.max_inline_data = init.cap.max_inline_data;
        let (qp, qpn) = self.create_raw_qp(init, &mut attr)?;
        // From here a failure destroys the QP.
        let destroy = |e: VerbsError| {
            // SAFETY: nothing was posted on the new QP.
            let _ = unsafe { sys::destroy_qp(qp) };
            e
        };
        // The device may grant more than asked: admit what it granted.
        let granted = QpCap {
            max_send_wr: attr.cap.max_send_wr.max(init.cap.max_send_wr),
            max_recv_wr: if init.srq.is_some() {
                0
            } else {
                attr.cap.max_recv_wr.max(init.cap.max_recv_wr)
            },
            max_send_sge: attr.cap.max_send_sge.max(init.cap.max_send_sge),
            max_recv_sge: attr.cap.max_recv_sge.max(init.cap.max_recv_sge),
            max_inline_data: attr.cap.max_inline_data.max(init.cap.max_inline_data),
        };
        let mut admissions = Vec::with_capacity(2);
        let mut srq_user = None;
        admissions.push(
            init.send_cq
                .budget()
                .admit(&format!("QP {qpn} send queue"), granted.max_send_wr)
                .map_err(|e| destroy(e.into()))?,
        );
        match init.srq {
            Some(srq) => {
                admissions.push(
                    init.recv_cq
                        .budget()
                        .admit_srq(srq.number(), srq.depth())
                        .map_err(|e| destroy(e.into()))?,
                );
                srq_user = Some(
                    init.recv_cq
                        .ledger()
                        .attach_srq_user(qpn, &srq.inner.account)
                        .map_err(|e| destroy(e.into()))?,
                );
            }
            None => admissions.push(
                init.recv_cq
                    .budget()
                    .admit(&format!("QP {qpn} receive queue"), granted.max_recv_wr)
                    .map_err(|e| destroy(e.into()))?,
            ),
        }
        let send_account = init.send_cq.ledger().open_queue(qpn, Queue::Send);
        send_account.reserve(granted.max_send_wr);
        let recv_account = match init.srq {
            Some(srq) => Arc::clone(&srq.inner.account),
            None => {
                let a = init.recv_cq.ledger().open_queue(qpn, Queue::Recv);
                a.reserve(granted.max_recv_wr);
                a
            }
        };
        // The QP's events go to the poller of its owner's CQ.
        let (owner, event_cq) = match init.owner {
            Some(reg) if reg.is_on(init.send_cq.ledger()) => (Some(reg.key()), init.send_cq),
            Some(reg) if reg.is_on(init.recv_cq.ledger()) => (Some(reg.key()), init.recv_cq),
            // Checked before the QP was made.
            Some(_) | None => (None, init.send_cq),
        };
        self.inner.ctx.add_route(
            qp.as_ptr() as usize,
            Route::Qp {
                qp_num: qpn,
                owner,
                inbox: Arc::downgrade(&event_cq.inner.channel.inbox),
                token: event_cq.inner.token,
                srq_recv: (srq_user.is_some()
                    && !Arc::ptr_eq(&event_cq.inner, &init.recv_cq.inner))
                .then(|| {
                    (
                        Arc::downgrade(&init.recv_cq.inner.channel.inbox),
                        init.recv_cq.inner.token,
                    )
                }),
            },
        );
        Ok(Qp {
            inner: std::mem::ManuallyDrop::new(QpInner {
                qp,
                qpn,
                pd: Arc::clone(&self.inner),
                send_cq: Arc::clone(&init.send_cq.inner),
                recv_cq: Arc::clone(&init.recv_cq.inner),
                srq: init.srq.map(|s| Arc::clone(&s.inner)),
                cap: granted,
                qp_type: init.qp_type,
                mtu: std::sync::atomic::AtomicU32::new(0),
                send_account,
                recv_account,
                srq_user,
                teardown: self.inner.ctx.teardown(),
                closed: CloseSignal::new(),
                pins: Pins::default(),
                windows: crate::window::Windows::default(),
                _admissions: admissions,
            }),
        })
    }
}

impl Qp {
    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.inner.qpn
    }

    /// Closes the QP, as dropping it does, and returns the wait for its
    /// end: it goes to the error state (its requests flush, with their
    /// contexts; a drain marker follows a silent tail of sends), and once
    /// its CQs' pollers have accounted every completion of it, its SRQ use
    /// included (`cqd_core::ledger`, module `teardown`), it is destroyed
    /// and its admission comes back. Never blocks: the wait does (not on
    /// one of its CQs' poller threads), or is awaited.
    pub fn close(self) -> CloseWait {
        let q = &self.inner;
        let wait = CloseWait::new(
            q.qpn,
            &q.closed,
            &q.send_account,
            &q.recv_account,
            q.srq_user.as_ref(),
        );
        drop(self);
        wait
    }

    /// A type-2 memory window of this QP (`ibv_alloc_mw`), unbound: bind
    /// it per request with [`SendWr::bind`] and close it with
    /// [`SendWr::invalidate`], both posted on this QP (see
    /// [`crate::window`]). Allocate windows once (one per request slot,
    /// say) and rebind them: each lives until it is dropped or the QP is.
    ///
    /// # Errors
    /// [`VerbsError::Invalid`] on a UD QP; `ibv_alloc_mw` failed (a device
    /// without type-2 windows answers EOPNOTSUPP).
    pub fn alloc_window(&self) -> Result<crate::Window, VerbsError> {
        let q = &self.inner;
        q.pd.ctx.check()?;
        if q.qp_type != QpType::Rc {
            return Err(VerbsError::Invalid(format!(
                "QP {}: memory windows are bound on RC QPs only",
                q.qpn
            )));
        }
        // SAFETY: the PD is live (the QP holds it).
        let mw = unsafe { sys::alloc_mw_type2(q.pd.pd) }.map_err(|e| {
            VerbsError::verb(
                "ibv_alloc_mw",
                format!("{}: a type-2 window for QP {}", q.pd.ctx.name, q.qpn),
                e,
            )
        })?;
        let inner = Arc::new(crate::window::WindowInner::new(
            mw,
            q.qp.as_ptr() as usize,
            q.qpn,
            q.pd.ctx.name.clone(),
        ));
        q.windows.add(&inner);
        Ok(crate::Window { inner })
    }

    /// The depths the device granted.
    pub fn cap(&self) -> QpCap {
        self.inner.cap
    }

    /// The transport.
    pub fn qp_type(&self) -> QpType {
        self.inner.qp_type
    }

    /// The largest datagram of a UD QP: its port's active MTU, known once
    /// [`ready_ud`](Self::ready_ud) ran (0 before, and on RC).
    pub fn mtu(&self) -> u32 {
        self.inner.mtu.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn set_mtu(&self, bytes: u32) {
        self.inner
            .mtu
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn pd_inner(&self) -> &Arc<PdInner> {
        &self.inner.pd
    }

    /// This side's endpoint, to send to the peer: the port's LID, the GID
    /// at `opts.gid_index` (if any), the QP number, `psn` and the port's
    /// active MTU.
    ///
    /// # Errors
    /// The port or GID query failed.
    pub fn endpoint(&self, opts: &ConnectOptions, psn: u32) -> Result<Endpoint, VerbsError> {
        let ctx = crate::device::Context {
            inner: Arc::clone(&self.inner.pd.ctx),
        };
        let port = ctx.port(opts.port)?;
        let gid = match opts.gid_index {
            Some(i) => ctx.gid(opts.port, i)?,
            None => [0; 16],
        };
        Ok(Endpoint {
            lid: port.lid,
            gid,
            qpn: self.inner.qpn,
            psn: psn & 0xff_ffff,
            mtu: port.active_mtu,
        })
    }

    pub(crate) fn modify(
        &self,
        attr: &mut sys::ibv_qp_attr,
        mask: u32,
        what: &'static str,
    ) -> Result<(), VerbsError> {
        self.inner.pd.ctx.check()?;
        // SAFETY: the QP is live while `self` is.
        unsafe { sys::modify_qp(self.inner.qp, attr, mask) }
            .map_err(|e| VerbsError::verb(what, format!("QP {}", self.inner.qpn), e))
    }

    /// RESET → INIT → RTR → RTS towards `remote`, this side sending from
    /// `local_psn`.
    ///
    /// # Errors
    /// A transition the device refused (the error names it).
    pub fn connect(
        &self,
        remote: &Endpoint,
        local_psn: u32,
        opts: &ConnectOptions,
    ) -> Result<(), VerbsError> {
        use sys::ibv_qp_attr_mask as m;
        if self.inner.qp_type != QpType::Rc {
            return Err(VerbsError::Invalid(format!(
                "QP {} is UD: it connects to no peer (make it ready with ready_ud)",
                self.inner.qpn
            )));
        }
        // SAFETY: plain C data; all-zero is a valid value.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_INIT;
        a.pkey_index = 0;
        a.port_num = opts.port;
        a.qp_access_flags = opts.access.0;
        self.modify(
            &mut a,
            (m::IBV_QP_STATE | m::IBV_QP_PKEY_INDEX | m::IBV_QP_PORT | m::IBV_QP_ACCESS_FLAGS).0,
            "ibv_modify_qp(INIT)",
        )?;
        let ctx = crate::device::Context {
            inner: Arc::clone(&self.inner.pd.ctx),
        };
        let local_mtu = ctx.port(opts.port)?.active_mtu;
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTR;
        a.path_mtu = opts.mtu.unwrap_or(local_mtu.min(remote.mtu)).to_raw();
        a.dest_qp_num = remote.qpn;
        a.rq_psn = remote.psn & 0xff_ffff;
        a.max_dest_rd_atomic = opts.max_rd_atomic;
        a.min_rnr_timer = opts.min_rnr_timer;
        a.ah_attr.dlid = remote.lid;
        a.ah_attr.sl = opts.sl;
        a.ah_attr.port_num = opts.port;
        if remote.has_gid() || opts.gid_index.is_some() {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = remote.gid;
            a.ah_attr.grh.hop_limit = 64;
            a.ah_attr.grh.sgid_index = opts.gid_index.unwrap_or(0);
        }
        self.modify(
            &mut a,
            (m::IBV_QP_STATE
                | m::IBV_QP_AV
                | m::IBV_QP_PATH_MTU
                | m::IBV_QP_DEST_QPN
                | m::IBV_QP_RQ_PSN
                | m::IBV_QP_MAX_DEST_RD_ATOMIC
                | m::IBV_QP_MIN_RNR_TIMER)
                .0,
            "ibv_modify_qp(RTR)",
        )?;
        // SAFETY: as above.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_RTS;
        a.timeout = opts.timeout;
        a.retry_cnt = opts.retry_cnt;
        a.rnr_retry = opts.rnr_retry;
        a.sq_psn = local_psn & 0xff_ffff;
        a.max_rd_atomic = opts.max_rd_atomic;
        self.modify(
            &mut a,
            (m::IBV_QP_STATE
                | m::IBV_QP_TIMEOUT
                | m::IBV_QP_RETRY_CNT
                | m::IBV_QP_RNR_RETRY
                | m::IBV_QP_SQ_PSN
                | m::IBV_QP_MAX_QP_RD_ATOMIC)
                .0,
            "ibv_modify_qp(RTS)",
        )
    }

    /// Moves the QP to the error state: every outstanding request, both
    /// sides, completes flushed (`IBV_WC_WR_FLUSH_ERR`) and later posts
    /// flush at once. The way to stop a connection with its accounting
    /// intact: flush, let the poller retire everything
    /// ([`outstanding`](Self::outstanding) reaches 0), then drop.
    ///
    /// # Errors
    /// The device refused the transition.
    pub fn to_error(&self) -> Result<(), VerbsError> {
        // SAFETY: plain C data; all-zero is a valid value.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        self.modify(
            &mut a,
            sys::ibv_qp_attr_mask::IBV_QP_STATE.0,
            "ibv_modify_qp(ERR)",
        )
    }

    /// Requests posted on the QP (both sides; an SRQ's count separately)
    /// and not yet retired by the poller.
    pub fn outstanding(&self) -> usize {
        self.inner.outstanding()
    }

    /// The raw `ibv_qp`, for verbs cqd does not wrap (never post on it:
    /// the posting call keeps the accounts).
    pub fn as_raw(&self) -> *mut sys::ibv_qp {
        self.inner.qp.as_ptr()
    }

    fn queue_name(&self, side: &str) -> String {
        format!("QP {} {side} queue", self.inner.qpn)
    }
}

impl PostSend for Qp {
    type Wr<'a> = SendWr<'a>;
    type Error = PostError;

    fn send_account(&self) -> &QueueAccount {
        &self.inner.send_account
    }

    #[inline]
    fn check_send(&self, wr: &SendWr<'_>) -> Result<(), Invalid> {
        let qp_type = self.inner.qp_type;
        transport_check(qp_type, wr)?;
        match (qp_type, wr.op) {
            (_, WrOp::CompareSwap { remote, .. } | WrOp::FetchAdd { remote, .. }) => {
                check_atomic(remote.addr, wr.len())
            }
            (QpType::Ud, _) => check_datagram(wr.len(), self.mtu()),
            (QpType::Rc, _) => Ok(()),
        }
    }

    fn post_send_unaccounted(&self, wrs: &[SendWr<'_>]) -> Result<(), (usize, PostError)> {
        let q = &self.inner;
        let name = || self.queue_name("send");
        // The whole list is checked before the device sees any of it: a
        // refusal here posted nothing (0), whichever request is bad.
        with_scratch(|sc| {
            let Scratch {
                sges, send: raw, ..
            } = sc;
            // Window requests are rare: their checks, pins and state
            // updates run only for a list that has one.
            let mut windows = false;
            for (i, w) in wrs.iter().enumerate() {
                self.check_raw(i, w).map_err(|e| (0, e))?;
                if w.window.is_some() || matches!(w.op, WrOp::Bind(_) | WrOp::Invalidate(_)) {
                    windows = true;
                    self.check_window(i, w, &wrs[..i]).map_err(|e| (0, e))?;
                }
                sges.extend(w.sg_list.iter().map(Sge::raw));
            }
            let mut at = 0usize;
            raw.reserve(wrs.len());
            for w in wrs {
                let sg = if w.sg_list.is_empty() {
                    std::ptr::null_mut()
                } else {
                    // SAFETY: `at` is within `sges` (sum of the lengths).
                    unsafe { sges.as_mut_ptr().add(at) }
                };
                at += w.sg_list.len();
                // Built in place (see `write_send_wr`).
                // SAFETY: plain C data; all-zero is a valid value.
                raw.push(unsafe { std::mem::zeroed() });
                if let Some(r) = raw.last_mut() {
                    write_send_wr(r, w, sg);
                }
                if !w.inline {
                    q.pins.pin(w.sg_list);
                }
                if let Some(d) = &w.ud {
                    q.pins.pin_ah(&d.ah.inner);
                }
            }
            link(raw, |w, next| w.next = next);
            if windows {
                for w in wrs {
                    if let Some(WindowUse {
                        over: Some((over, _)),
                        ..
                    }) = &w.window
                    {
                        q.pins.pin(std::slice::from_ref(over));
                    }
                }
            }
            // SAFETY: the QP is live; the list is linked with a null tail; its
            // SGEs name regions, and its UD requests address handles, pinned
            // above until the QP is destroyed (inline data is copied by the
            // call); its binds name live windows of this QP (checked) over
            // regions pinned above.
            let result = unsafe { sys::post_send(q.qp, raw) };
            if windows {
                // The windows' states follow the requests posted, in order
                // (still under the queue's posting lock).
                let posted = match &result {
                    Ok(()) => wrs.len(),
                    Err((i, _)) => *i,
                };
                for w in &wrs[..posted] {
                    match (w.op, &w.window) {
                        (WrOp::Bind(remote), Some(u)) => u.window.inner.posted_bind(remote.rkey),
                        (WrOp::Invalidate(_), Some(u)) => u.window.inner.posted_invalidate(),
                        _ => {}
                    }
                }
            }
            result.map_err(|(i, e)| (i, device_error(&q.pd, "ibv_post_send", name(), i, e)))
        })
    }
}

impl Qp {
    /// What the raw post checks of request `index` before the device sees
    /// the list: SGEs, inline length, transport, the AH's domain.
    #[inline]
    fn check_raw(&self, index: usize, w: &SendWr<'_>) -> Result<(), PostError> {
        let q = &self.inner;
        let name = || self.queue_name("send");
        check_sges(&name, index, w.sg_list, q.cap.max_send_sge, &q.pd)?;
        let invalid = |why: String| PostError::Invalid {
            queue: name(),
            index,
            why,
        };
        if w.inline && w.len() > u64::from(q.cap.max_inline_data) {
            return Err(invalid(format!(
                "{} inline bytes, the QP allows {}",
                w.len(),
                q.cap.max_inline_data
            )));
        }
        transport_check(q.qp_type, w).map_err(|e| invalid(e.to_string()))?;
        if let Some(d) = &w.ud {
            if !Arc::ptr_eq(&d.ah.inner.pd, &q.pd) {
                return Err(invalid(
                    "the address handle belongs to another protection domain".into(),
                ));
            }
        }
        Ok(())
    }
}

impl Qp {
    /// The window rules of `cqd_verbs::window` for request `index`, with
    /// the requests before it in the same list (`earlier`) taken as posted.
    fn check_window(
        &self,
        index: usize,
        w: &SendWr<'_>,
        earlier: &[SendWr<'_>],
    ) -> Result<(), PostError> {
        let q = &self.inner;
        let invalid = |why: String| PostError::Invalid {
            queue: self.queue_name("send"),
            index,
            why,
        };
        let u = match (w.op, &w.window) {
            (WrOp::Bind(_) | WrOp::Invalidate(_), Some(u)) => u,
            (WrOp::Bind(_) | WrOp::Invalidate(_), None) => {
                return Err(invalid(format!(
                    "{} is made with SendWr::bind or SendWr::invalidate",
                    w.op.name()
                )))
            }
            _ => return Ok(()),
        };
        let win = &u.window.inner;
        if win.qp != q.qp.as_ptr() as usize {
            return Err(invalid(format!(
                "the window belongs to QP {}, not this one",
                win.qpn
            )));
        }
        if win.raw().is_none() {
            return Err(invalid("the window was deallocated".into()));
        }
        // The window's state after the earlier requests of this list.
        let (mut bound, mut key) = (win.is_bound(), win.key());
        for e in earlier {
            match (e.op, &e.window) {
                (WrOp::Bind(r), Some(eu)) if Arc::ptr_eq(&eu.window.inner, win) => {
                    (bound, key) = (true, r.rkey);
                }
                (WrOp::Invalidate(_), Some(eu)) if Arc::ptr_eq(&eu.window.inner, win) => {
                    bound = false;
                }
                _ => {}
            }
        }
        match (w.op, u.over) {
            (WrOp::Bind(remote), Some((over, access))) => {
                if bound {
                    return Err(invalid(format!(
                        "the window (key {key:#x}) is bound: invalidate it first"
                    )));
                }
                if remote.rkey != crate::window::next_key(key) {
                    return Err(invalid(format!(
                        "a stale bind: made for key {:#x}, the window is at {key:#x}",
                        remote.rkey
                    )));
                }
                if !over.mr.same_pd(&q.pd) {
                    return Err(invalid(
                        "the window's region belongs to another protection domain".into(),
                    ));
                }
                let mr_access = over.mr.access().0;
                if mr_access & Access::MW_BIND.0 == 0 {
                    return Err(invalid(format!(
                        "region rkey {:#x} was not registered with Access::MW_BIND",
                        over.mr.rkey()
                    )));
                }
                let grant = access.0;
                if grant == 0 || grant & !crate::window::GRANTABLE != 0 {
                    return Err(invalid(format!(
                        "a window grants remote read, write or atomic access, not {grant:#x}"
                    )));
                }
                let needs_local = Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0;
                if grant & needs_local != 0 && mr_access & Access::LOCAL_WRITE.0 == 0 {
                    return Err(invalid(
                        "remote write or atomic through a window needs the region's local write"
                            .into(),
                    ));
                }
                if over.is_empty() {
                    return Err(invalid("a window over no bytes".into()));
                }
            }
            (WrOp::Invalidate(k), None) => {
                if !bound {
                    return Err(invalid(format!(
                        "the window (key {key:#x}) is not bound: nothing to invalidate"
                    )));
                }
                if k != key {
                    return Err(invalid(format!(
                        "a stale invalidate: made for key {k:#x}, the window is at {key:#x}"
                    )));
                }
            }
            _ => return Err(invalid(format!("{} without its window", w.op.name()))),
        }
        Ok(())
    }
}

impl PostRecv for Qp {
    type Wr<'a> = RecvWr<'a>;
    type Error = PostError;

    fn recv_account(&self) -> &QueueAccount {
        &self.inner.recv_account
    }

    fn post_recv_unaccounted(&self, wrs: &[RecvWr<'_>]) -> Result<(), (usize, PostError)> {
        let q = &self.inner;
        if let Some(srq) = &q.srq {
            return Err((
                0,
                PostError::Invalid {
                    queue: self.queue_name("receive"),
                    index: 0,
                    why: format!("the QP draws on SRQ {}: post receives to the SRQ", srq.srqn),
                },
            ));
        }
        post_recv_list(
            sys::RecvTarget::Qp(q.qp),
            &|| self.queue_name("receive"),
            q.cap.max_recv_sge,
            &q.pd,
            &q.pins,
            wrs,
        )
    }
}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: `drop` runs once and `self.inner` is not used after.
        let inner = unsafe { std::mem::ManuallyDrop::take(&mut self.inner) };
        // Nobody polls its CQ: the destroy races no poll.
        if !inner.send_cq.poller_alive() {
            drop(inner);
            return;
        }
        // Nothing to flush: destroyed now on a device that keeps a
        // destroyed QP's completions (its destroy touches no CQ), else by
        // its send CQ's poller, on its own thread (`CqInner::bury`). A QP
        // on an SRQ goes to the error state first whatever it holds: only
        // then does it take no more of the SRQ's receives.
        if inner.outstanding() == 0 && inner.srq_user.is_none() {
            if inner.teardown == Teardown::DestroyThenQuiesce {
                drop(inner);
            } else {
                let cq = Arc::clone(&inner.send_cq);
                cq.bury(inner);
            }
            return;
        }
        // Flush everything, and let the poller retire the flushes before
        // the QP goes (its CQ reaps it: `CqInner::reap`).
        // SAFETY: plain C data; all-zero is a valid value.
        let mut a: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = sys::ibv_qp_state::IBV_QPS_ERR;
        let state = sys::ibv_qp_attr_mask::IBV_QP_STATE.0;
        // SAFETY: the QP is live (destroyed only by `QpInner`'s drop).
        let moved = unsafe { sys::modify_qp(inner.qp, &mut a, state) };
        if let Err(e) = moved {
            tracing::warn!(qpn = inner.qpn, error = %e, "dropped QP could not be moved to ERR; destroyed with requests outstanding");
            drop(inner);
            return;
        }
        // In ERR: a send queue that ends in unsignaled requests (which
        // may have run silently) gets a drain marker, flushed after them,
        // whose completion retires them. A UD marker would need an
        // address handle, so a UD QP has none.
        if inner.qp_type == QpType::Rc {
            let marker = inner.send_account.post_drain_marker(|wr_id| {
                let mut wr =
                    raw_send_wr(&SendWr::new(wr_id, WrOp::Send, &[]), std::ptr::null_mut());
                // SAFETY: the QP is live (destroyed only by `QpInner`'s
                // drop); one signaled SEND naming no memory, `next` null.
                unsafe { sys::post_send(inner.qp, std::slice::from_mut(&mut wr)) }
            });
            if let DrainMarker::NoCredit | DrainMarker::Failed(_) = marker {
                tracing::warn!(qpn = inner.qpn, ?marker,
                    "no drain marker: the unsignaled requests at the end of the send queue stay outstanding");
            }
        }
        if inner.ready() && inner.teardown == Teardown::DestroyThenQuiesce {
            drop(inner);
            return;
        }
        let cq = Arc::clone(&inner.send_cq);
        cq.bury(inner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_serde_round_trip() {
        let e = Endpoint {
            lid: 7,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            mtu: Mtu::M4096,
        };
        let text = serde_json::to_string(&e).unwrap();
        assert_eq!(serde_json::from_str::<Endpoint>(&text).unwrap(), e);
        assert!(e.has_gid());
        assert_eq!(Mtu::M4096.bytes(), 4096);
        for m in [Mtu::M256, Mtu::M512, Mtu::M1024, Mtu::M2048, Mtu::M4096] {
            assert_eq!(Mtu::from_raw(m.to_raw()), m);
            assert_eq!(Mtu::from_bytes(m.bytes()), Some(m));
        }
        assert!(serde_json::from_str::<Endpoint>("{\"lid\":1}").is_err());
    }
}
