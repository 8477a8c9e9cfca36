//! The handler trait and the typed views it receives.
//!
//! A handler is called on its poller's thread for every completion of the
//! work requests it posted, once, through exactly one of three callbacks:
//! [`Handler::on_send`] for a successful send-side request (SEND, RDMA WRITE,
//! RDMA READ, atomic), [`Handler::on_recv`] for a successful receive, and
//! [`Handler::on_error`] for any failed request of either side, flushes
//! included. The side is taken from the kind stored in the wr_id at post
//! time, never from `wc.opcode`, which the device leaves undefined on errors.
//!
//! Handlers must not block: heavy work goes to workers through the
//! [`Outbox`].

use std::collections::VecDeque;

use crate::completion::{Completion, Opcode, Status};
use crate::sink::{NoWork, Route, Routed};
use crate::wr_id::{HandlerKey, OpKind, Side};

/// A successful send-side completion (SEND, RDMA WRITE, RDMA READ, atomic).
#[derive(Debug, Clone, Copy)]
pub struct SendDone<'a> {
    pub(crate) kind: OpKind,
    pub(crate) tag: u32,
    pub(crate) key: HandlerKey,
    pub(crate) wc: &'a Completion,
    /// The request's context word, if its queue's ring held one (R5 of
    /// `account::ring`): read only by the handler cqd registers for a
    /// context handler (`crate::context`).
    pub(crate) ctx: Option<crate::account::CtxWord>,
}

impl SendDone<'_> {
    /// The kind given at post time.
    pub fn kind(&self) -> OpKind {
        self.kind
    }
    /// The user tag given at post time.
    pub fn tag(&self) -> u32 {
        self.tag
    }
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.key
    }
    /// The device's opcode (valid: this is a success).
    pub fn opcode(&self) -> Opcode {
        self.wc.opcode
    }
    /// Bytes transferred (RDMA READ and atomics).
    pub fn byte_len(&self) -> u32 {
        self.wc.byte_len
    }
    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num
    }
    /// The whole completion.
    pub fn completion(&self) -> &Completion {
        self.wc
    }
}

/// A successful receive completion.
#[derive(Debug, Clone, Copy)]
pub struct RecvDone<'a> {
    pub(crate) tag: u32,
    pub(crate) key: HandlerKey,
    pub(crate) wc: &'a Completion,
    /// The request's context word, if its queue's ring held one (R5 of
    /// `account::ring`): read only by the handler cqd registers for a
    /// context handler (`crate::context`).
    pub(crate) ctx: Option<crate::account::CtxWord>,
}

impl RecvDone<'_> {
    /// The user tag given when the receive was posted (typically the buffer).
    pub fn tag(&self) -> u32 {
        self.tag
    }
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.key
    }
    /// Bytes received.
    pub fn byte_len(&self) -> u32 {
        self.wc.byte_len
    }
    /// Immediate data, if the sender attached any.
    pub fn imm(&self) -> Option<u32> {
        self.wc.imm()
    }
    /// The device's opcode: `Recv` or `RecvRdmaWithImm`.
    pub fn opcode(&self) -> Opcode {
        self.wc.opcode
    }
    /// The local QP number (useful with an SRQ shared by many QPs).
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num
    }
    /// The sender's QP number (`wc.src_qp`): defined for a UD receive,
    /// where it tells the senders of one QP apart.
    pub fn src_qp(&self) -> u32 {
        self.wc.src_qp
    }
    /// The sender's LID (`wc.slid`; UD).
    pub fn slid(&self) -> u16 {
        self.wc.slid
    }
    /// The sender's service level (`wc.sl`; UD).
    pub fn sl(&self) -> u8 {
        self.wc.sl
    }
    /// The P_Key index (`wc.pkey_index`; UD and GSI).
    pub fn pkey_index(&self) -> u16 {
        self.wc.pkey_index
    }
    /// True if the first [`GRH_LEN`](crate::completion::GRH_LEN) bytes of
    /// the buffer hold the datagram's GRH (`IBV_WC_GRH`; UD).
    pub fn has_grh(&self) -> bool {
        self.wc.has_grh()
    }
    /// The payload of a UD receive: `byte_len` less the
    /// [`GRH_LEN`](crate::completion::GRH_LEN) bytes in front of it (0 if
    /// the device reported less).
    pub fn datagram_len(&self) -> u32 {
        self.wc.byte_len.saturating_sub(crate::completion::GRH_LEN)
    }
    /// The whole completion.
    pub fn completion(&self) -> &Completion {
        self.wc
    }
}

/// A failed work request of either side.
#[derive(Debug, Clone, Copy)]
pub struct Failed<'a> {
    pub(crate) kind: OpKind,
    pub(crate) tag: u32,
    pub(crate) key: HandlerKey,
    pub(crate) wc: &'a Completion,
    /// The request's context word, if its queue's ring held one (R5 of
    /// `account::ring`): read only by the handler cqd registers for a
    /// context handler (`crate::context`).
    pub(crate) ctx: Option<crate::account::CtxWord>,
}

impl Failed<'_> {
    /// The kind given at post time (the device's opcode is undefined here).
    pub fn kind(&self) -> OpKind {
        self.kind
    }
    /// The side of the queue pair the request was posted on.
    pub fn side(&self) -> Side {
        self.kind.side()
    }
    /// The user tag given at post time.
    pub fn tag(&self) -> u32 {
        self.tag
    }
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.key
    }
    /// The status: an error status, or — for the anomalies
    /// ([`is_anomaly`](Self::is_anomaly)) — a status value this cqd does not
    /// know (`is_known()` false), or `Success` with an unknown
    /// [`opcode`](Self::opcode).
    pub fn status(&self) -> Status {
        self.wc.status
    }
    /// The device's opcode (undefined on error completions; see
    /// [`kind`](Self::kind) for what was posted).
    pub fn opcode(&self) -> Opcode {
        self.wc.opcode
    }
    /// True when the device reported something this cqd does not know: an
    /// unknown status, or a success with an unknown opcode. The request is
    /// over either way (release what it held); the anomaly is counted in the
    /// CQ's metrics and traced at error level.
    pub fn is_anomaly(&self) -> bool {
        !self.wc.status.is_known() || (self.wc.status.is_success() && !self.wc.opcode.is_known())
    }
    /// True if the request was flushed because its QP went to the error
    /// state: it was never executed.
    pub fn is_flush(&self) -> bool {
        self.wc.status.is_flush()
    }
    /// The vendor syndrome.
    pub fn vendor_err(&self) -> u32 {
        self.wc.vendor_err
    }
    /// The local QP number.
    pub fn qp_num(&self) -> u32 {
        self.wc.qp_num
    }
    /// The whole completion.
    pub fn completion(&self) -> &Completion {
        self.wc
    }
}

/// An unsignaled send-side request that ran silently: a later completion
/// of its send queue retired it (send queues complete in order), or the
/// flush of a drain marker did when its QP went away. No completion of its
/// own exists; this is how its handler learns it is over.
#[derive(Debug, Clone, Copy)]
pub struct Silent {
    pub(crate) kind: OpKind,
    pub(crate) tag: u32,
    pub(crate) key: HandlerKey,
    /// As [`SendDone`]'s.
    pub(crate) ctx: Option<crate::account::CtxWord>,
}

impl Silent {
    /// The kind given at post time.
    pub fn kind(&self) -> OpKind {
        self.kind
    }
    /// The user tag given at post time.
    pub fn tag(&self) -> u32 {
        self.tag
    }
    /// The handler's key.
    pub fn key(&self) -> HandlerKey {
        self.key
    }
}

/// Where a handler puts work for the worker pools.
///
/// Items are handed to the workers after the batch that produced them, in
/// the order they were pushed. The poller never drops them: a full worker
/// ring makes the poller keep them (a spill) and retry.
#[derive(Debug)]
pub struct Outbox<'a, W> {
    pub(crate) items: &'a mut VecDeque<Routed<W>>,
    pub(crate) route: Route,
}

impl<'a, W> Outbox<'a, W> {
    /// An outbox appending to `items` with `route` as the default route.
    /// The poller makes these; this is public for custom poll loops and tests.
    pub fn new(items: &'a mut VecDeque<Routed<W>>, route: Route) -> Self {
        Outbox { items, route }
    }

    /// Emits `item` on the handler's default route (given at registration).
    #[inline]
    pub fn push(&mut self, item: W) {
        self.items.push_back(Routed {
            route: self.route,
            item,
        });
    }

    /// Emits `item` on an explicit route.
    #[inline]
    pub fn push_to(&mut self, route: Route, item: W) {
        self.items.push_back(Routed { route, item });
    }

    /// The handler's default route.
    pub fn route(&self) -> Route {
        self.route
    }
}

/// The callbacks of one handler. See the module documentation.
///
/// A handler that panics is caught: the panic is counted and traced, the
/// completion counts as delivered, work it pushed before panicking is kept,
/// and it keeps receiving completions.
pub trait Handler<W = NoWork>: Send + 'static {
    /// A send-side request completed successfully.
    fn on_send(&mut self, done: &SendDone<'_>, out: &mut Outbox<'_, W>);
    /// A receive completed successfully.
    fn on_recv(&mut self, done: &RecvDone<'_>, out: &mut Outbox<'_, W>);
    /// A request of either side failed (flushes included), or the device
    /// reported a status or opcode this cqd does not know
    /// ([`Failed::is_anomaly`]): either way the request is over.
    fn on_error(&mut self, failed: &Failed<'_>, out: &mut Outbox<'_, W>);

    /// An unsignaled send-side request of this handler was retired by a
    /// later completion of its queue (see [`Silent`]): called before that
    /// completion's own callback. The default does nothing (the request is
    /// already counted completed in the handler's ledger); a handler that
    /// keeps state per request releases it here.
    /// [`ContextHandler`](crate::context::ContextHandler)s receive the
    /// request's context.
    fn on_silent(&mut self, silent: &Silent, out: &mut Outbox<'_, W>) {
        let _ = (silent, out);
    }

    /// An asynchronous event of a queue this handler owns (a QP or SRQ
    /// made with this handler as its owner): called on the poller thread
    /// within one loop of the event. The requests of a QP in the error
    /// state still come, flushed, to [`on_error`](Self::on_error). The
    /// default does nothing (the poller has already counted and traced
    /// the event).
    fn on_async(&mut self, event: &crate::event::AsyncEvent) {
        let _ = event;
    }
}
