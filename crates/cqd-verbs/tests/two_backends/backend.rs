//! The one seam between the scenarios and a NIC: what a scenario needs of a
//! backend (a device, CQs, connected QP pairs, memory, work requests), for
//! the simulated NIC (cqd-sim) and for libibverbs (cqd-verbs) on two
//! devices: softverbs, and the kernel's Soft-RoCE (rxe) in a VM
//! (scripts/rxe-vm.sh). The two verbs backends are one implementation,
//! [`VerbsOn`], over a [`Flavour`] that holds what differs.
//! Posting itself is not here: scenarios post through a handler's
//! `Registration`, generic over cqd_core's `PostSend` / `PostRecv`.

use std::fmt::{Debug, Display};

use cqd_core::budget::BudgetOptions;
use cqd_core::post::{PostRecv, PostSend};
use cqd_core::{split, CompletionSource, CqHandle, CqOptions, NoWork, UnboundCq};
use serde::de::DeserializeOwned;
use serde::Serialize;

/// A send-side operation, backend-neutral.
#[derive(Debug, Clone, Copy)]
pub enum Op<R> {
    Send,
    SendImm(u32),
    Write(R),
    WriteImm(R, u32),
    Read(R),
    /// Compare-and-swap: (target, compare, swap).
    Cas(R, u64, u64),
    /// Fetch-and-add: (target, add).
    Fadd(R, u64),
}

/// Queue depths.
#[derive(Debug, Clone, Copy)]
pub struct Cap {
    pub send: u32,
    pub recv: u32,
}

impl Default for Cap {
    fn default() -> Self {
        Cap { send: 64, recv: 64 }
    }
}

pub trait Backend: Sized + 'static {
    /// `sim`, `verbs` (softverbs) or `rxe`, for names and messages.
    const NAME: &'static str;
    /// Every datagram carries a GRH (RoCE: there are no LIDs, an address
    /// handle is always global).
    const GRH_ALWAYS: bool = false;
    /// A receive posted to a QP already in ERR is flushed at once (the
    /// verbs specification; hardware does). False on rxe (kernel 6.1): its
    /// provider writes receives into the queue from userspace and nothing
    /// wakes the kernel's responder, so the receive waits for the next
    /// move to ERR.
    const RECV_IN_ERR_FLUSHED: bool = true;
    /// The statuses of a SEND longer than the receive it lands in: the
    /// receive's and the send's. The specification's (and softverbs'):
    /// local length error and remote invalid request (the responder NAKs
    /// the message as an invalid request). rxe on kernel 6.1 reports a
    /// local QP operation error and a remote operational error instead
    /// (its copy_data fails the copy with EINVAL, not ENOSPC, and the
    /// responder takes that for a malformed WQE).
    const SHORT_RECV: (cqd_core::Status, cqd_core::Status) = (
        cqd_core::Status::LocalLength,
        cqd_core::Status::RemoteInvalidRequest,
    );
    /// The cycles of the `churn` scenario (a connection closed and one
    /// opened, each): 10,000 on the simulator and softverbs, 500 on rxe
    /// (its VM has two vCPUs under TCG, and CI's rxe step must stay short).
    const CHURN_CYCLES: u32 = 10_000;
    /// Why `scenario` cannot run on this backend, if it cannot.
    fn cannot_run(scenario: &str) -> Option<&'static str> {
        let _ = scenario;
        None
    }
    /// Checks the 40 bytes a UD receive's buffer starts with, when the
    /// completion says `IBV_WC_GRH`: an IPv6-shaped GRH from and to `gid`.
    fn check_grh(grh: &[u8], gid: &[u8; 16]) {
        assert_eq!(grh[0] >> 4, 6, "GRH: IP version 6");
        assert_eq!(grh[6], 0x1b, "GRH: next header");
        assert_eq!(&grh[8..24], &gid[..], "GRH: source GID");
        assert_eq!(&grh[24..40], &gid[..], "GRH: destination GID");
    }
    /// True when an overflowed CQ loses every later completion, as
    /// hardware's CQ in error does (the simulator); false when it accepts
    /// completions again once polled (softverbs, docs/softverbs.md
    /// "Limits").
    const OVERFLOW_STICKY: bool;
    /// A device (and, for verbs, its protection domain).
    type Dev: Clone + Send + Sync + 'static;
    /// The NIC's side of a CQ (what QPs are made on).
    type Cq: Clone + Send + Sync + 'static;
    /// The poller's side of a CQ.
    type Source: CompletionSource;
    type Qp: PostSend<Error = Self::PostErr>
        + PostRecv<Error = Self::PostErr>
        + Send
        + Sync
        + 'static;
    /// A shared receive queue.
    type Srq: PostRecv<Error = Self::PostErr> + Send + Sync + 'static;
    type Mr: Send + Sync + 'static;
    type PostErr: Debug + Display;
    type Sge<'a>: Copy
    where
        Self: 'a;
    type Remote: Copy + Send + Sync + Debug + 'static;
    /// What a peer needs to connect to a QP, sent out of band as JSON.
    type Endpoint: Serialize + DeserializeOwned + Clone + Debug;
    /// An address handle.
    type Ah: Send + Sync + 'static;

    /// A fresh device (its own fabric for the simulator).
    fn open() -> Self::Dev;
    /// Another device that can reach `dev`'s QPs (same fabric).
    fn open_peer(dev: &Self::Dev) -> Self::Dev;
    /// A completion channel several CQs can share.
    type Channel: Clone;
    /// A CQ of at least `cqe` entries; admission off lets it overflow.
    fn cq(dev: &Self::Dev, name: &str, cqe: u32, admission: bool) -> (Self::Cq, Self::Source);
    fn channel(dev: &Self::Dev) -> Self::Channel;
    /// A CQ that notifies through `channel` (admission on).
    fn cq_on(
        dev: &Self::Dev,
        name: &str,
        cqe: u32,
        channel: &Self::Channel,
    ) -> (Self::Cq, Self::Source);
    /// The entries the CQ really has.
    fn capacity(cq: &Self::Cq) -> u32;
    /// The most entries a CQ of the device may have.
    fn max_cqe(dev: &Self::Dev) -> u32;
    /// Credits in use on the CQ's budget.
    fn credits_in_use(cq: &Self::Cq) -> u64;
    /// CQ entries the CQ's budget holds admitted for live queues.
    fn reserved(cq: &Self::Cq) -> u64;
    /// The CQ's ledger.
    fn ledger(cq: &Self::Cq) -> cqd_core::ledger::WrLedger {
        Self::ledger_of(cq).clone()
    }
    /// The CQ's ledger, borrowed.
    fn ledger_of(cq: &Self::Cq) -> &cqd_core::ledger::WrLedger;
    /// Overflows the CQ's budget recorded.
    fn budget_overflows(cq: &Self::Cq) -> u64;
    /// An RC QP in RESET on `send_cq` / `recv_cq`.
    fn qp(dev: &Self::Dev, send_cq: &Self::Cq, recv_cq: &Self::Cq, cap: Cap) -> Self::Qp;
    fn qpn(qp: &Self::Qp) -> u32;
    /// An SRQ of `depth` receives.
    fn srq(dev: &Self::Dev, depth: u32) -> Self::Srq;
    /// An RC QP in RESET whose receives come from `srq`.
    fn qp_on_srq(
        dev: &Self::Dev,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        srq: &Self::Srq,
        cap: Cap,
    ) -> Self::Qp;
    fn srq_recv_wr<'a, 'b: 'a>(
        tag: u32,
        sg: &'a [Self::Sge<'b>],
    ) -> <Self::Srq as PostRecv>::Wr<'a>;
    /// Requests of the QP (both queues) not yet retired by its poller.
    fn outstanding(qp: &Self::Qp) -> usize;
    fn endpoint(qp: &Self::Qp) -> Self::Endpoint;
    /// RESET → INIT → RTR → RTS towards `peer`; a send waits for its
    /// receive (RNR retry for ever).
    fn connect(qp: &Self::Qp, peer: &Self::Endpoint);
    /// Moves the QP to the error state (both queues flush).
    fn to_error(qp: &Self::Qp);
    /// Closes `qp` (`Qp::close`): the wait for its end.
    fn close(qp: Self::Qp) -> cqd_core::ledger::CloseWait;
    /// A zeroed region with local write and remote read/write access.
    fn reg_mr(dev: &Self::Dev, len: usize) -> Self::Mr;
    fn sge<'a>(mr: &'a Self::Mr, offset: usize, len: u32) -> Self::Sge<'a>;
    fn remote(mr: &Self::Mr, offset: usize) -> Self::Remote;
    fn remote_parts(r: Self::Remote) -> (u64, u32);
    fn remote_from(addr: u64, rkey: u32) -> Self::Remote;
    fn read(mr: &Self::Mr, offset: usize, out: &mut [u8]);
    fn write(mr: &Self::Mr, offset: usize, data: &[u8]);
    fn send_wr<'a, 'b: 'a>(
        tag: u32,
        op: Op<Self::Remote>,
        sg: &'a [Self::Sge<'b>],
        signaled: bool,
    ) -> <Self::Qp as PostSend>::Wr<'a>;
    fn recv_wr<'a, 'b: 'a>(tag: u32, sg: &'a [Self::Sge<'b>]) -> <Self::Qp as PostRecv>::Wr<'a>;
    /// The queue is full or the CQ has no credits: post again later.
    fn retryable(e: &Self::PostErr) -> bool;
    /// The send queue's depth, if `e` says it is full.
    fn full_depth(e: &Self::PostErr) -> Option<u32>;
    /// The posting call's refusal of an invalid request, if `e` is one.
    fn invalid(e: &Self::PostErr) -> Option<cqd_core::Invalid> {
        match Self::refused(e)? {
            cqd_core::Refused::Invalid { source, .. } => Some(*source),
            _ => None,
        }
    }
    /// The posting call's refusal, if `e` is one.
    fn refused(e: &Self::PostErr) -> Option<&cqd_core::Refused>;
    /// A UD QP in RESET on `send_cq` / `recv_cq`.
    fn ud_qp(dev: &Self::Dev, send_cq: &Self::Cq, recv_cq: &Self::Cq, cap: Cap) -> Self::Qp;
    /// RESET → INIT (`qkey`) → RTR → RTS of a UD QP.
    fn ud_ready(qp: &Self::Qp, qkey: u32);
    /// The largest datagram of a ready UD QP (the port's MTU).
    fn mtu(qp: &Self::Qp) -> u32;
    /// The GID of the device's port (what a GRH names).
    fn gid(dev: &Self::Dev) -> [u8; 16];
    /// An address handle made on `dev` towards `to`'s port: by GID with a
    /// GRH (`global`), or by LID without one.
    fn ah(dev: &Self::Dev, to: &Self::Dev, global: bool) -> Self::Ah;
    /// A signaled SEND (with immediate if `imm`) to UD QP `qpn`.
    fn ud_send_wr<'a, 'b: 'a>(
        tag: u32,
        ah: &'a Self::Ah,
        qpn: u32,
        qkey: u32,
        sg: &'a [Self::Sge<'b>],
        imm: Option<u32>,
    ) -> <Self::Qp as PostSend>::Wr<'a>;
    /// Makes the device go away (hot unplug, fatal error).
    fn kill(dev: &Self::Dev);
    /// True once the device is known to be gone.
    fn is_gone(dev: &Self::Dev) -> bool;

    /// As [`dispatched_cq`](Self::dispatched_cq), on a shared channel.
    fn dispatched_cq_on(
        dev: &Self::Dev,
        name: &str,
        cqe: u32,
        channel: &Self::Channel,
    ) -> (Self::Cq, UnboundCq<NoWork>, CqHandle<NoWork>) {
        let (cq, source) = Self::cq_on(dev, name, cqe, channel);
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).expect("split");
        (cq, unbound, handle)
    }

    /// A CQ split for dispatch: the NIC's side, the polling right, the
    /// handle.
    fn dispatched_cq(
        dev: &Self::Dev,
        name: &str,
        cqe: u32,
        admission: bool,
    ) -> (Self::Cq, UnboundCq<NoWork>, CqHandle<NoWork>) {
        let (cq, source) = Self::cq(dev, name, cqe, admission);
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).expect("split");
        (cq, unbound, handle)
    }

    /// Two QPs connected to each other: `a` on `cq_a`, `b` on `cq_b`.
    fn pair(dev: &Self::Dev, cq_a: &Self::Cq, cq_b: &Self::Cq, cap: Cap) -> (Self::Qp, Self::Qp) {
        let a = Self::qp(dev, cq_a, cq_a, cap);
        let b = Self::qp(dev, cq_b, cq_b, cap);
        let (ea, eb) = (Self::endpoint(&a), Self::endpoint(&b));
        Self::connect(&a, &eb);
        Self::connect(&b, &ea);
        (a, b)
    }
}

fn budget(admission: bool) -> BudgetOptions {
    BudgetOptions {
        admission,
        credits: None,
    }
}

/// The simulated NIC, inline engine.
#[derive(Debug)]
pub struct Sim;

impl Backend for Sim {
    const NAME: &'static str = "sim";
    const OVERFLOW_STICKY: bool = true;
    type Dev = SimDev;
    type Cq = cqd_sim::Cq;
    type Source = cqd_sim::SimCqSource;
    type Qp = cqd_sim::Qp;
    type Srq = cqd_sim::Srq;
    type Mr = cqd_sim::Mr;
    type PostErr = cqd_sim::PostError;
    type Sge<'a> = cqd_sim::Sge;
    type Remote = cqd_sim::RemoteAddr;
    type Endpoint = u32;
    type Ah = cqd_sim::Ah;

    fn open() -> Self::Dev {
        SimDev::new(cqd_sim::Fabric::inline().open_device("sim0", cqd_sim::DeviceAttr::default()))
    }

    fn open_peer(dev: &Self::Dev) -> Self::Dev {
        SimDev::new(
            dev.dev
                .fabric()
                .open_device("sim-peer", cqd_sim::DeviceAttr::default()),
        )
    }

    fn cq(dev: &Self::Dev, name: &str, cqe: u32, admission: bool) -> (Self::Cq, Self::Source) {
        let config = cqd_sim::CqConfig {
            budget: budget(admission),
            ..cqd_sim::CqConfig::default()
        };
        dev.dev.create_cq(name, cqe, config).expect("create_cq")
    }

    type Channel = cqd_sim::SimChannel;

    fn channel(_: &Self::Dev) -> Self::Channel {
        cqd_sim::SimChannel::new().expect("channel")
    }

    fn cq_on(
        dev: &Self::Dev,
        name: &str,
        cqe: u32,
        channel: &Self::Channel,
    ) -> (Self::Cq, Self::Source) {
        let config = cqd_sim::CqConfig {
            channel: Some(channel.clone()),
            ..cqd_sim::CqConfig::default()
        };
        dev.dev.create_cq(name, cqe, config).expect("create_cq")
    }

    fn capacity(cq: &Self::Cq) -> u32 {
        cq.capacity()
    }

    fn max_cqe(_: &Self::Dev) -> u32 {
        u32::MAX
    }

    fn credits_in_use(cq: &Self::Cq) -> u64 {
        cq.budget_snapshot().credits_in_use
    }

    fn ledger_of(cq: &Self::Cq) -> &cqd_core::ledger::WrLedger {
        cq.ledger()
    }

    fn reserved(cq: &Self::Cq) -> u64 {
        cq.budget_snapshot().reserved
    }

    fn budget_overflows(cq: &Self::Cq) -> u64 {
        cq.budget_snapshot().overflows
    }

    fn qp(dev: &Self::Dev, send_cq: &Self::Cq, recv_cq: &Self::Cq, cap: Cap) -> Self::Qp {
        let cap = cqd_sim::QpCap {
            max_send_wr: cap.send,
            max_recv_wr: cap.recv,
            ..cqd_sim::QpCap::default()
        };
        dev.pd
            .create_qp(&cqd_sim::QpInit::new(send_cq, recv_cq, cap))
            .expect("create_qp")
    }

    fn qpn(qp: &Self::Qp) -> u32 {
        qp.qpn()
    }

    fn srq(dev: &Self::Dev, depth: u32) -> Self::Srq {
        dev.pd.create_srq(depth, 4).expect("create_srq")
    }

    fn qp_on_srq(
        dev: &Self::Dev,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        srq: &Self::Srq,
        cap: Cap,
    ) -> Self::Qp {
        let cap = cqd_sim::QpCap {
            max_send_wr: cap.send,
            max_recv_wr: cap.recv,
            ..cqd_sim::QpCap::default()
        };
        dev.pd
            .create_qp(&cqd_sim::QpInit::new(send_cq, recv_cq, cap).with_srq(srq))
            .expect("create_qp on an SRQ")
    }

    fn srq_recv_wr<'a, 'b: 'a>(tag: u32, sg: &'a [cqd_sim::Sge]) -> cqd_sim::RecvWr<'a> {
        cqd_sim::RecvWr::new(u64::from(tag), sg)
    }

    fn outstanding(qp: &Self::Qp) -> usize {
        use cqd_core::post::{PostRecv, PostSend};
        qp.send_account().outstanding() + qp.recv_account().outstanding()
    }

    fn endpoint(qp: &Self::Qp) -> u32 {
        qp.qpn()
    }

    fn connect(qp: &Self::Qp, peer: &u32) {
        use cqd_sim::{Access, Modify};
        let access = Access::REMOTE_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC;
        qp.modify(Modify::Init { access }).expect("INIT");
        qp.modify(Modify::Rtr { remote_qpn: *peer }).expect("RTR");
        qp.modify(Modify::Rts {
            rnr_retry: 7,
            retry_cnt: 7,
        })
        .expect("RTS");
    }

    fn to_error(qp: &Self::Qp) {
        qp.modify(cqd_sim::Modify::Err).expect("ERR");
    }

    fn close(qp: Self::Qp) -> cqd_core::ledger::CloseWait {
        qp.close()
    }

    fn reg_mr(dev: &Self::Dev, len: usize) -> Self::Mr {
        dev.pd
            .reg_mr(len as u64, cqd_sim::Access::ALL)
            .expect("reg_mr")
    }

    fn sge(mr: &Self::Mr, offset: usize, len: u32) -> cqd_sim::Sge {
        mr.sge(offset as u64, len)
    }

    fn remote(mr: &Self::Mr, offset: usize) -> Self::Remote {
        mr.remote(offset as u64)
    }

    fn remote_parts(r: Self::Remote) -> (u64, u32) {
        (r.addr, r.rkey)
    }

    fn remote_from(addr: u64, rkey: u32) -> Self::Remote {
        cqd_sim::RemoteAddr { addr, rkey }
    }

    fn read(mr: &Self::Mr, offset: usize, out: &mut [u8]) {
        mr.read(offset as u64, out).expect("read");
    }

    fn write(mr: &Self::Mr, offset: usize, data: &[u8]) {
        mr.write(offset as u64, data).expect("write");
    }

    fn send_wr<'a, 'b: 'a>(
        tag: u32,
        op: Op<Self::Remote>,
        sg: &'a [cqd_sim::Sge],
        signaled: bool,
    ) -> cqd_sim::SendWr<'a> {
        use cqd_sim::WrOp;
        let op = match op {
            Op::Send => WrOp::Send,
            Op::SendImm(imm) => WrOp::SendWithImm(imm),
            Op::Write(r) => WrOp::Write(r),
            Op::WriteImm(r, imm) => WrOp::WriteWithImm(r, imm),
            Op::Read(r) => WrOp::Read(r),
            Op::Cas(remote, compare, swap) => WrOp::CompareSwap {
                remote,
                compare,
                swap,
            },
            Op::Fadd(remote, add) => WrOp::FetchAdd { remote, add },
        };
        let wr = cqd_sim::SendWr::new(u64::from(tag), op, sg);
        if signaled {
            wr
        } else {
            wr.unsignaled()
        }
    }

    fn recv_wr<'a, 'b: 'a>(tag: u32, sg: &'a [cqd_sim::Sge]) -> cqd_sim::RecvWr<'a> {
        cqd_sim::RecvWr::new(u64::from(tag), sg)
    }

    fn retryable(e: &Self::PostErr) -> bool {
        matches!(
            e,
            cqd_sim::PostError::QueueFull { .. } | cqd_sim::PostError::Credits(_)
        )
    }

    fn full_depth(e: &Self::PostErr) -> Option<u32> {
        match e {
            cqd_sim::PostError::QueueFull { depth, .. } => Some(*depth),
            _ => None,
        }
    }

    fn refused(e: &Self::PostErr) -> Option<&cqd_core::Refused> {
        match e {
            cqd_sim::PostError::Refused(r) => Some(r),
            _ => None,
        }
    }

    fn ud_qp(dev: &Self::Dev, send_cq: &Self::Cq, recv_cq: &Self::Cq, cap: Cap) -> Self::Qp {
        let cap = cqd_sim::QpCap {
            max_send_wr: cap.send,
            max_recv_wr: cap.recv,
            ..cqd_sim::QpCap::default()
        };
        dev.pd
            .create_qp(&cqd_sim::QpInit::new(send_cq, recv_cq, cap).datagram())
            .expect("create a UD QP")
    }

    fn ud_ready(qp: &Self::Qp, qkey: u32) {
        qp.ready_ud(qkey).expect("UD QP to RTS");
    }

    fn mtu(qp: &Self::Qp) -> u32 {
        qp.mtu()
    }

    fn gid(dev: &Self::Dev) -> [u8; 16] {
        dev.dev.gid()
    }

    fn ah(dev: &Self::Dev, to: &Self::Dev, global: bool) -> Self::Ah {
        let attr = if global {
            cqd_sim::AhAttr::to_gid(&to.dev)
        } else {
            cqd_sim::AhAttr::to_lid(&to.dev)
        };
        dev.pd.create_ah(attr).expect("create_ah")
    }

    fn ud_send_wr<'a, 'b: 'a>(
        tag: u32,
        ah: &'a Self::Ah,
        qpn: u32,
        qkey: u32,
        sg: &'a [cqd_sim::Sge],
        imm: Option<u32>,
    ) -> cqd_sim::SendWr<'a> {
        let op = imm.map_or(cqd_sim::WrOp::Send, cqd_sim::WrOp::SendWithImm);
        cqd_sim::SendWr::new(u64::from(tag), op, sg).to(cqd_sim::UdDest { ah, qpn, qkey })
    }

    fn kill(dev: &Self::Dev) {
        dev.dev.vanish();
    }

    fn is_gone(dev: &Self::Dev) -> bool {
        dev.dev.is_gone()
    }
}

/// A simulated device and the one protection domain of a test.
#[derive(Debug, Clone)]
pub struct SimDev {
    pub dev: cqd_sim::Device,
    pub pd: cqd_sim::Pd,
}

impl SimDev {
    fn new(dev: cqd_sim::Device) -> Self {
        let pd = dev.alloc_pd();
        SimDev { dev, pd }
    }
}

/// What differs between the devices cqd-verbs runs on in this suite.
pub trait Flavour: Send + Sync + 'static {
    /// The backend's name in test names and messages.
    const NAME: &'static str;
    /// See [`Backend::OVERFLOW_STICKY`].
    const OVERFLOW_STICKY: bool;
    /// See [`Backend::GRH_ALWAYS`].
    const GRH_ALWAYS: bool;
    /// See [`Backend::RECV_IN_ERR_FLUSHED`].
    const RECV_IN_ERR_FLUSHED: bool;
    /// See [`Backend::SHORT_RECV`].
    const SHORT_RECV: (cqd_core::Status, cqd_core::Status);
    /// See [`Backend::CHURN_CYCLES`].
    const CHURN_CYCLES: u32 = 10_000;
    /// The teardown cqd-verbs detects for the device (asserted at open).
    const TEARDOWN: cqd_verbs::Teardown;
    /// A memory window's range is enforced: a peer's access past the
    /// window but inside its region is a remote access error. softverbs:
    /// yes. rxe on kernel 6.1: no (its responder looks the window up, then
    /// checks the access against the whole region's range).
    const WINDOW_RANGE_CHECKED: bool;
    /// The local GID index every endpoint and address handle uses (`None`:
    /// none, routed by LID).
    fn gid_index() -> Option<u8>;
    /// Opens the device.
    fn open() -> Result<cqd_verbs::Context, cqd_verbs::VerbsError>;
    /// See [`Backend::cannot_run`].
    fn cannot_run(scenario: &str) -> Option<&'static str>;
    /// See [`Backend::check_grh`].
    fn check_grh(grh: &[u8], gid: &[u8; 16]);
    /// See [`Backend::kill`].
    fn kill(dev: &VerbsDev);
}

/// libibverbs on a device of flavour `F`.
#[derive(Debug)]
pub struct VerbsOn<F>(std::marker::PhantomData<F>);

/// libibverbs on the softverbs device (under softverbs-run).
pub type Verbs = VerbsOn<Soft>;
/// libibverbs on the kernel's Soft-RoCE (in the VM of scripts/rxe-vm.sh).
pub type Rxe = VerbsOn<RxeDevice>;

/// softverbs: IB-style addressing by LID, killed on demand.
#[derive(Debug)]
pub struct Soft;

impl Flavour for Soft {
    const NAME: &'static str = "verbs";
    const OVERFLOW_STICKY: bool = false;
    const GRH_ALWAYS: bool = false;
    const RECV_IN_ERR_FLUSHED: bool = true;
    const SHORT_RECV: (cqd_core::Status, cqd_core::Status) = Sim::SHORT_RECV;
    const WINDOW_RANGE_CHECKED: bool = true;
    // softverbs purges a destroyed QP's completions and raises LAST_WQE.
    const TEARDOWN: cqd_verbs::Teardown = cqd_verbs::Teardown::QuiesceThenDestroy;

    fn gid_index() -> Option<u8> {
        None
    }

    fn open() -> Result<cqd_verbs::Context, cqd_verbs::VerbsError> {
        cqd_verbs::Context::open_first()
    }

    fn cannot_run(_: &str) -> Option<&'static str> {
        None
    }

    fn check_grh(grh: &[u8], gid: &[u8; 16]) {
        Sim::check_grh(grh, gid);
    }

    fn kill(dev: &VerbsDev) {
        type Inject = unsafe extern "C" fn(*mut cqd_verbs::raw::ibv_context) -> i32;
        // SAFETY: dlsym with a NUL-terminated name; RTLD_DEFAULT searches
        // the global scope, where softverbs-run preloads the provider.
        let sym = unsafe {
            libc::dlsym(
                libc::RTLD_DEFAULT,
                c"softverbs_inject_device_fatal".as_ptr(),
            )
        };
        assert!(
            !sym.is_null(),
            "softverbs_inject_device_fatal not found: not running on softverbs"
        );
        // SAFETY: the symbol is the function docs/softverbs.md documents,
        // with this signature.
        let inject: Inject = unsafe { std::mem::transmute::<*mut libc::c_void, Inject>(sym) };
        // SAFETY: the context is open while `dev` holds it.
        let rc = unsafe { inject(dev.ctx.as_raw()) };
        assert_eq!(rc, 0, "softverbs_inject_device_fatal failed: {rc}");
    }
}

/// The environment variable naming the rxe device (scripts/rxe-vm.sh sets
/// it to `rxe0`).
pub const RXE_ENV: &str = "CQD_RXE";

/// Why a device-death scenario cannot run on rxe.
pub const RXE_NO_DEATH: &str = "rxe cannot die under an open context: it has no \
    disassociate_ucontext, so `rdma link delete` blocks in the kernel until every \
    process using the device has closed it, and no DEVICE_FATAL reaches a live one \
    (measured in the VM, kernel 6.1)";

/// The kernel's Soft-RoCE device named by `CQD_RXE`: RoCE v2, addressed by
/// the IPv4-mapped GID `RXE_GID_INDEX` (1: `::ffff:127.0.0.1` on `lo`).
#[derive(Debug)]
pub struct RxeDevice;

impl RxeDevice {
    /// The device's name, if this process is meant to run on rxe and the
    /// device exists.
    pub fn name() -> Option<String> {
        let name = std::env::var(RXE_ENV).ok()?;
        std::path::Path::new("/sys/class/infiniband")
            .join(&name)
            .exists()
            .then_some(name)
    }
}

impl Flavour for RxeDevice {
    const NAME: &'static str = "rxe";
    // rxe drops the completion that finds its CQ full (with CQ_ERR) and
    // posts the next ones once there is room, as softverbs does (measured:
    // 14 of 512 writes delivered, 78-81 retired by the ledger).
    const OVERFLOW_STICKY: bool = false;
    const GRH_ALWAYS: bool = true;
    const RECV_IN_ERR_FLUSHED: bool = false;
    const SHORT_RECV: (cqd_core::Status, cqd_core::Status) = (
        cqd_core::Status::LocalQpOperation,
        cqd_core::Status::RemoteOperation,
    );
    const WINDOW_RANGE_CHECKED: bool = false;
    // rxe keeps a destroyed QP's completions and raises no LAST_WQE (6.1).
    const TEARDOWN: cqd_verbs::Teardown = cqd_verbs::Teardown::DestroyThenQuiesce;

    fn gid_index() -> Option<u8> {
        let i = std::env::var("RXE_GID_INDEX").ok();
        Some(i.and_then(|i| i.parse().ok()).unwrap_or(1))
    }

    fn open() -> Result<cqd_verbs::Context, cqd_verbs::VerbsError> {
        let name = Self::name().expect("CQD_RXE names no rxe device");
        cqd_verbs::Context::open(&name)
    }

    const CHURN_CYCLES: u32 = 500;

    fn cannot_run(scenario: &str) -> Option<&'static str> {
        scenario.starts_with("device_gone").then_some(RXE_NO_DEATH)
    }

    fn check_grh(grh: &[u8], gid: &[u8; 16]) {
        // RoCE v2 over IPv4: the 40 bytes hold 20 undefined ones, then the
        // IPv4 header (the verbs specification's RoCE v2 annex).
        assert_eq!(
            &gid[..12],
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff],
            "an IPv4-mapped GID"
        );
        let ip = &grh[20..40];
        assert_eq!(ip[0] >> 4, 4, "IPv4 header: version 4: {ip:?}");
        assert_eq!(ip[9], 17, "IPv4 header: protocol UDP: {ip:?}");
        assert_eq!(&ip[12..16], &gid[12..], "IPv4 header: source address");
        assert_eq!(&ip[16..20], &gid[12..], "IPv4 header: destination address");
    }

    fn kill(_: &VerbsDev) {
        panic!("{RXE_NO_DEATH}");
    }
}

/// A verbs device: its context and one protection domain.
#[derive(Debug, Clone)]
pub struct VerbsDev {
    pub ctx: cqd_verbs::Context,
    pub pd: cqd_verbs::Pd,
}

impl<F: Flavour> Backend for VerbsOn<F> {
    const NAME: &'static str = F::NAME;
    const OVERFLOW_STICKY: bool = F::OVERFLOW_STICKY;
    const GRH_ALWAYS: bool = F::GRH_ALWAYS;
    const RECV_IN_ERR_FLUSHED: bool = F::RECV_IN_ERR_FLUSHED;
    const SHORT_RECV: (cqd_core::Status, cqd_core::Status) = F::SHORT_RECV;
    const CHURN_CYCLES: u32 = F::CHURN_CYCLES;

    fn cannot_run(scenario: &str) -> Option<&'static str> {
        F::cannot_run(scenario)
    }

    fn check_grh(grh: &[u8], gid: &[u8; 16]) {
        F::check_grh(grh, gid);
    }

    type Dev = VerbsDev;
    type Cq = cqd_verbs::Cq;
    type Source = cqd_verbs::VerbsCqSource;
    type Qp = cqd_verbs::Qp;
    type Srq = cqd_verbs::Srq;
    type Mr = cqd_verbs::Mr;
    type PostErr = cqd_verbs::PostError;
    type Sge<'a> = cqd_verbs::Sge<'a>;
    type Remote = cqd_verbs::RemoteAddr;
    type Endpoint = cqd_verbs::Endpoint;
    type Ah = cqd_verbs::Ah;

    fn open() -> Self::Dev {
        let ctx = F::open().unwrap_or_else(|e| panic!("open the {} device: {e}", F::NAME));
        assert_eq!(
            ctx.teardown(),
            F::TEARDOWN,
            "the teardown cqd-verbs detects on {}",
            F::NAME
        );
        let pd = ctx.alloc_pd().expect("alloc_pd");
        VerbsDev { ctx, pd }
    }

    fn open_peer(_: &Self::Dev) -> Self::Dev {
        Self::open()
    }

    fn cq(dev: &Self::Dev, name: &str, cqe: u32, admission: bool) -> (Self::Cq, Self::Source) {
        let spec = cqd_verbs::CqSpec {
            budget: budget(admission),
            ..cqd_verbs::CqSpec::default()
        };
        dev.ctx.create_cq(name, cqe, spec).expect("create_cq")
    }

    type Channel = cqd_verbs::CompChannel;

    fn channel(dev: &Self::Dev) -> Self::Channel {
        dev.ctx.create_comp_channel().expect("channel")
    }

    fn cq_on(
        dev: &Self::Dev,
        name: &str,
        cqe: u32,
        channel: &Self::Channel,
    ) -> (Self::Cq, Self::Source) {
        let spec = cqd_verbs::CqSpec {
            channel: Some(channel.clone()),
            ..cqd_verbs::CqSpec::default()
        };
        dev.ctx.create_cq(name, cqe, spec).expect("create_cq")
    }

    fn capacity(cq: &Self::Cq) -> u32 {
        cq.capacity()
    }

    fn max_cqe(dev: &Self::Dev) -> u32 {
        dev.ctx.attr().max_cqe
    }

    fn credits_in_use(cq: &Self::Cq) -> u64 {
        cq.budget_snapshot().credits_in_use
    }

    fn ledger_of(cq: &Self::Cq) -> &cqd_core::ledger::WrLedger {
        cq.ledger()
    }

    fn reserved(cq: &Self::Cq) -> u64 {
        cq.budget_snapshot().reserved
    }

    fn budget_overflows(cq: &Self::Cq) -> u64 {
        cq.budget_snapshot().overflows
    }

    fn qp(dev: &Self::Dev, send_cq: &Self::Cq, recv_cq: &Self::Cq, cap: Cap) -> Self::Qp {
        let cap = cqd_verbs::QpCap {
            max_send_wr: cap.send,
            max_recv_wr: cap.recv,
            ..cqd_verbs::QpCap::default()
        };
        dev.pd
            .create_qp(&cqd_verbs::QpInit::new(send_cq, recv_cq, cap))
            .expect("create_qp")
    }

    fn qpn(qp: &Self::Qp) -> u32 {
        qp.qpn()
    }

    fn srq(dev: &Self::Dev, depth: u32) -> Self::Srq {
        dev.pd
            .create_srq(cqd_verbs::SrqInit {
                max_wr: depth,
                max_sge: 1,
                owner: None,
            })
            .expect("create_srq")
    }

    fn qp_on_srq(
        dev: &Self::Dev,
        send_cq: &Self::Cq,
        recv_cq: &Self::Cq,
        srq: &Self::Srq,
        cap: Cap,
    ) -> Self::Qp {
        let cap = cqd_verbs::QpCap {
            max_send_wr: cap.send,
            max_recv_wr: cap.recv,
            ..cqd_verbs::QpCap::default()
        };
        dev.pd
            .create_qp(&cqd_verbs::QpInit::new(send_cq, recv_cq, cap).with_srq(srq))
            .expect("create_qp on an SRQ")
    }

    fn srq_recv_wr<'a, 'b: 'a>(tag: u32, sg: &'a [cqd_verbs::Sge<'b>]) -> cqd_verbs::RecvWr<'a> {
        cqd_verbs::RecvWr::new(u64::from(tag), sg)
    }

    fn outstanding(qp: &Self::Qp) -> usize {
        qp.outstanding()
    }

    fn endpoint(qp: &Self::Qp) -> Self::Endpoint {
        let opts = cqd_verbs::ConnectOptions {
            gid_index: F::gid_index(),
            ..cqd_verbs::ConnectOptions::default()
        };
        qp.endpoint(&opts, qp.qpn() & 0xffff).expect("endpoint")
    }

    fn connect(qp: &Self::Qp, peer: &Self::Endpoint) {
        use cqd_verbs::Access;
        let opts = cqd_verbs::ConnectOptions {
            access: Access(Access::ALL_RDMA.0 | Access::REMOTE_ATOMIC.0),
            gid_index: F::gid_index(),
            ..cqd_verbs::ConnectOptions::default()
        };
        qp.connect(peer, qp.qpn() & 0xffff, &opts).expect("connect");
    }

    fn to_error(qp: &Self::Qp) {
        qp.to_error().expect("to_error");
    }

    fn close(qp: Self::Qp) -> cqd_core::ledger::CloseWait {
        qp.close()
    }

    fn reg_mr(dev: &Self::Dev, len: usize) -> Self::Mr {
        dev.pd
            .reg_mr(
                len as u64,
                cqd_verbs::Access(
                    cqd_verbs::Access::ALL_RDMA.0 | cqd_verbs::Access::REMOTE_ATOMIC.0,
                ),
            )
            .expect("reg_mr")
    }

    fn sge<'a>(mr: &'a Self::Mr, offset: usize, len: u32) -> cqd_verbs::Sge<'a> {
        mr.sge(offset, len)
    }

    fn remote(mr: &Self::Mr, offset: usize) -> Self::Remote {
        mr.remote(offset)
    }

    fn remote_parts(r: Self::Remote) -> (u64, u32) {
        (r.addr, r.rkey)
    }

    fn remote_from(addr: u64, rkey: u32) -> Self::Remote {
        cqd_verbs::RemoteAddr { addr, rkey }
    }

    fn read(mr: &Self::Mr, offset: usize, out: &mut [u8]) {
        mr.read(offset, out);
    }

    fn write(mr: &Self::Mr, offset: usize, data: &[u8]) {
        mr.write(offset, data);
    }

    fn send_wr<'a, 'b: 'a>(
        tag: u32,
        op: Op<Self::Remote>,
        sg: &'a [cqd_verbs::Sge<'b>],
        signaled: bool,
    ) -> cqd_verbs::SendWr<'a> {
        use cqd_verbs::WrOp;
        let op = match op {
            Op::Send => WrOp::Send,
            Op::SendImm(imm) => WrOp::SendWithImm(imm),
            Op::Write(r) => WrOp::Write(r),
            Op::WriteImm(r, imm) => WrOp::WriteWithImm(r, imm),
            Op::Read(r) => WrOp::Read(r),
            Op::Cas(remote, compare, swap) => WrOp::CompareSwap {
                remote,
                compare,
                swap,
            },
            Op::Fadd(remote, add) => WrOp::FetchAdd { remote, add },
        };
        let wr = cqd_verbs::SendWr::new(u64::from(tag), op, sg);
        if signaled {
            wr
        } else {
            wr.unsignaled()
        }
    }

    fn recv_wr<'a, 'b: 'a>(tag: u32, sg: &'a [cqd_verbs::Sge<'b>]) -> cqd_verbs::RecvWr<'a> {
        cqd_verbs::RecvWr::new(u64::from(tag), sg)
    }

    fn full_depth(e: &Self::PostErr) -> Option<u32> {
        match e {
            cqd_verbs::PostError::Refused(cqd_core::Refused::Full { depth, .. }) => Some(*depth),
            _ => None,
        }
    }

    fn retryable(e: &Self::PostErr) -> bool {
        match e {
            cqd_verbs::PostError::Refused(
                cqd_core::Refused::Credits(_) | cqd_core::Refused::Full { .. },
            ) => true,
            cqd_verbs::PostError::Device { source, .. } => {
                source.raw_os_error() == Some(libc::ENOMEM)
            }
            _ => false,
        }
    }

    fn refused(e: &Self::PostErr) -> Option<&cqd_core::Refused> {
        match e {
            cqd_verbs::PostError::Refused(r) => Some(r),
            _ => None,
        }
    }

    fn ud_qp(dev: &Self::Dev, send_cq: &Self::Cq, recv_cq: &Self::Cq, cap: Cap) -> Self::Qp {
        let cap = cqd_verbs::QpCap {
            max_send_wr: cap.send,
            max_recv_wr: cap.recv,
            ..cqd_verbs::QpCap::default()
        };
        dev.pd
            .create_qp(&cqd_verbs::QpInit::new(send_cq, recv_cq, cap).datagram())
            .expect("create a UD QP")
    }

    fn ud_ready(qp: &Self::Qp, qkey: u32) {
        let opts = cqd_verbs::ConnectOptions {
            gid_index: F::gid_index(),
            ..cqd_verbs::ConnectOptions::default()
        };
        qp.ready_ud(qkey, qp.qpn() & 0xffff, &opts)
            .expect("UD QP to RTS");
    }

    fn mtu(qp: &Self::Qp) -> u32 {
        qp.mtu()
    }

    fn gid(dev: &Self::Dev) -> [u8; 16] {
        dev.ctx
            .gid(1, F::gid_index().unwrap_or(0))
            .expect("query_gid")
    }

    fn ah(dev: &Self::Dev, to: &Self::Dev, global: bool) -> Self::Ah {
        // RoCE has no LIDs: its handles are always global.
        let global = global || F::GRH_ALWAYS;
        let port = to.ctx.port(1).expect("query_port");
        let to_ep = cqd_verbs::Endpoint {
            lid: port.lid,
            gid: if global { Self::gid(to) } else { [0; 16] },
            qpn: 0,
            psn: 0,
            mtu: port.active_mtu,
        };
        let opts = cqd_verbs::AhOptions {
            gid_index: global.then_some(F::gid_index().unwrap_or(0)),
            ..cqd_verbs::AhOptions::default()
        };
        dev.pd.create_ah(&to_ep, &opts).expect("create_ah")
    }

    fn ud_send_wr<'a, 'b: 'a>(
        tag: u32,
        ah: &'a Self::Ah,
        qpn: u32,
        qkey: u32,
        sg: &'a [cqd_verbs::Sge<'b>],
        imm: Option<u32>,
    ) -> cqd_verbs::SendWr<'a> {
        let op = imm.map_or(cqd_verbs::WrOp::Send, cqd_verbs::WrOp::SendWithImm);
        cqd_verbs::SendWr::new(u64::from(tag), op, sg).to(cqd_verbs::UdDest { ah, qpn, qkey })
    }

    fn kill(dev: &Self::Dev) {
        F::kill(dev);
    }

    fn is_gone(dev: &Self::Dev) -> bool {
        dev.ctx.is_gone()
    }
}
