//! Shared test rig: a fabric, two connected QPs on one CQ, a real
//! `CqPoller`, and a handler that records every callback.
#![allow(dead_code, missing_docs)]

use std::collections::VecDeque;
use std::sync::Arc;

use cqd_core::{
    CqHandle, CqOptions, CqPoller, Failed, Handler, NoWork, OpKind, Opcode, Outbox, RecvDone,
    Registration, SendDone, SendRequest, Side, Status, UnboundCq,
};
use cqd_sim::{
    connect, Access, Cq, CqConfig, Device, Fabric, Mr, Pd, PostError, Qp, QpCap, QpInit, RecvWr,
    SendWr, Sge,
};
use parking_lot::Mutex;

/// One recorded callback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ev {
    pub side: Side,
    pub ok: bool,
    pub kind: OpKind,
    pub tag: u32,
    pub status: Status,
    pub opcode: Opcode,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub qp: u32,
}

#[derive(Clone, Default)]
pub struct Log(pub Arc<Mutex<Vec<Ev>>>);

impl Log {
    pub fn take(&self) -> Vec<Ev> {
        std::mem::take(&mut *self.0.lock())
    }
}

pub struct Recorder(pub Log);

impl Handler for Recorder {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let wc = d.completion();
        self.0 .0.lock().push(Ev {
            side: Side::Send,
            ok: true,
            kind: d.kind(),
            tag: d.tag(),
            status: wc.status,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            imm: wc.imm(),
            qp: wc.qp_num,
        });
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let wc = d.completion();
        self.0 .0.lock().push(Ev {
            side: Side::Recv,
            ok: true,
            kind: OpKind::Recv,
            tag: d.tag(),
            status: wc.status,
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            imm: wc.imm(),
            qp: wc.qp_num,
        });
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        let wc = f.completion();
        self.0 .0.lock().push(Ev {
            side: f.side(),
            ok: false,
            kind: f.kind(),
            tag: f.tag(),
            status: f.status(),
            opcode: wc.opcode,
            byte_len: wc.byte_len,
            imm: None,
            qp: wc.qp_num,
        });
    }
}

pub struct Rig {
    pub fabric: Fabric,
    pub dev: Device,
    pub pd: Pd,
    pub cq: Cq,
    /// The CQ's polling right until a test binds it ([`Rig::poller`]) or
    /// hands it to a poller thread ([`Rig::take_poller`]).
    unbound: Option<UnboundCq<NoWork>>,
    bound: Option<CqPoller<NoWork>>,
    pub handle: CqHandle<NoWork>,
    pub a: Qp,
    pub b: Qp,
    pub reg: Registration,
    pub log: Log,
    pub mr_a: Mr,
    pub mr_b: Mr,
}

pub const MR_LEN: u64 = 4096;

impl Rig {
    pub fn new() -> Rig {
        Rig::with(
            Fabric::inline(),
            QpCap::default(),
            1024,
            CqConfig::default(),
        )
    }

    pub fn with(fabric: Fabric, cap: QpCap, cqe: u32, config: CqConfig) -> Rig {
        let dev = fabric.open_device("sim0", cqd_sim::DeviceAttr::default());
        let (cq, poller, handle) = dev
            .create_dispatched_cq::<NoWork>("cq", cqe, config, CqOptions::default())
            .unwrap();
        let pd = dev.alloc_pd();
        let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
        let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
        connect(&a, &b).unwrap();
        let log = Log::default();
        let reg = handle.register(Recorder(log.clone())).unwrap();
        let mr_a = pd.reg_mr(MR_LEN, Access::ALL).unwrap();
        let mr_b = pd.reg_mr(MR_LEN, Access::ALL).unwrap();
        Rig {
            fabric,
            dev,
            pd,
            cq,
            unbound: Some(poller),
            bound: None,
            handle,
            a,
            b,
            reg,
            log,
            mr_a,
            mr_b,
        }
    }

    /// The CQ's poller, bound to the calling thread on first use.
    pub fn poller(&mut self) -> &mut CqPoller<NoWork> {
        if let Some(u) = self.unbound.take() {
            self.bound = Some(u.bind());
        }
        self.bound.as_mut().expect("bound above")
    }

    /// The CQ's unbound polling right, for a poller thread.
    pub fn take_poller(&mut self) -> UnboundCq<NoWork> {
        self.unbound
            .take()
            .expect("the rig's CQ was already bound or taken")
    }

    /// Polls until the CQ is empty; returns completions polled.
    pub fn poll_all(&mut self) -> usize {
        let mut out = VecDeque::new();
        let mut total = 0;
        loop {
            let n = self.poller().poll_once(&mut out).unwrap();
            if n == 0 {
                return total;
            }
            total += n;
        }
    }

    /// Posts one request of `kind` (checked against its op) through the
    /// posting call; `f` gets the tag to put in the wr_id field.
    pub fn send(
        &self,
        qp: &Qp,
        kind: OpKind,
        tag: u32,
        f: impl FnOnce(u64) -> SendWr<'static>,
    ) -> Result<(), PostError> {
        let mut wr = [f(u64::from(tag))];
        assert_eq!(wr[0].kind(), kind, "the op's kind");
        self.reg.post_send(qp, &mut wr)
    }

    pub fn recv(&self, qp: &Qp, tag: u32, sges: &[Sge]) -> Result<(), PostError> {
        self.reg
            .post_recv(qp, &mut [RecvWr::new(u64::from(tag), sges)])
    }
}

/// Leaks a slice so a `SendWr<'static>` can borrow it in a closure.
pub fn sges(s: &[Sge]) -> &'static [Sge] {
    Box::leak(s.to_vec().into_boxed_slice())
}
