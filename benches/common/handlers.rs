//! The handlers both dispatch benchmarks give cqd: the same small work per
//! completion as their hand-written contenders do.

use cqd::core::{ContextHandler, Failed, Handler, NoWork, Outbox, RecvDone, SendDone, Silent};

/// A plain handler: adds a send's tag, a receive's length.
pub struct Count(pub u64);

impl Handler for Count {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0 += u64::from(d.tag());
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0 += u64::from(d.byte_len());
    }
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0 += 1;
    }
}

/// A context handler: the same work, with the request's `u64` context
/// (carried in its queue's ring).
pub struct CountCtx(pub u64);

impl ContextHandler for CountCtx {
    type Ctx = u64;
    fn on_send(&mut self, _: &SendDone<'_>, ctx: u64, _: &mut Outbox<'_, NoWork>) {
        self.0 += ctx;
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, ctx: u64, _: &mut Outbox<'_, NoWork>) {
        self.0 += u64::from(d.byte_len()) + ctx;
    }
    fn on_error(&mut self, _: &Failed<'_>, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.0 += 1;
    }
    fn on_silent(&mut self, _: &Silent, _: u64, _: &mut Outbox<'_, NoWork>) {
        self.0 += 1;
    }
    fn on_abandoned(&mut self, _: u64) {
        panic!("a context was abandoned");
    }
}
