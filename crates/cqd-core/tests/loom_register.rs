//! Loom model of handler registration and retirement across threads (the
//! registration doorbell protocol in `cq::handle`): threads register and
//! unregister handlers through a `CqHandle` while the poller's thread
//! polls; a command pushed while the poller was applying others is never
//! stranded — once the pushers are done, the poller's next poll has
//! installed every registered handler and released every retired one.
//!
//! Everything is the real code — `split`, `CqHandle::register` /
//! `unregister`, `CqPoller::poll_once`, the `commands_rung` flag from the
//! loom shim — over a completion source that is always empty. The command
//! queue (crossbeam's `SegQueue`) is not instrumented: each push and pop is
//! one step of the model.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p cqd-core --test loom_register --release`
#![cfg(loom)]

use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};

use loom::thread;

use cqd_core::source::AsyncEvent;
use cqd_core::{
    split, ArmKind, Completion, CompletionSource, CqOptions, Failed, Handler, NoWork, Outbox,
    RecvDone, SendDone, SourceError,
};

/// A CQ with nothing in it.
struct Quiet(File);

impl CompletionSource for Quiet {
    fn name(&self) -> &str {
        "quiet"
    }
    fn capacity(&self) -> u32 {
        16
    }
    fn poll(&mut self, _: &mut [Completion]) -> Result<usize, SourceError> {
        Ok(0)
    }
    fn arm(&mut self, _: ArmKind) -> Result<(), SourceError> {
        Ok(())
    }
    fn event_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
    fn take_events(&mut self) -> Result<u32, SourceError> {
        Ok(0)
    }
    fn ack_events(&mut self, _: u32) -> Result<(), SourceError> {
        Ok(())
    }
    fn unacked_events(&self) -> u32 {
        0
    }
    fn take_async_event(&mut self) -> Option<AsyncEvent> {
        None
    }
    fn destroy(&mut self) -> Result<(), SourceError> {
        Ok(())
    }
}

struct Nop;

impl Handler for Nop {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, _: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {}
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

/// Two threads register while the poller polls: both handlers are
/// installed by the poll after they return, whichever of them rang.
#[test]
fn concurrent_registrations_are_never_stranded() {
    model(|| {
        let source = Quiet(File::open("/dev/null").unwrap());
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
        let mut poller = unbound.bind();
        let pushers: Vec<_> = (0..2)
            .map(|_| {
                let h = handle.clone();
                thread::spawn(move || h.register(Nop).unwrap().key())
            })
            .collect();
        let mut out = VecDeque::new();
        poller.poll_once(&mut out).unwrap();
        let keys: Vec<_> = pushers.into_iter().map(|t| t.join().unwrap()).collect();
        poller.poll_once(&mut out).unwrap();
        let installed = poller.handler_keys();
        for k in keys {
            assert!(installed.contains(&k), "{k} stranded");
        }
    });
}

/// A handler registered, then retired from another thread while the
/// poller polls: after the next poll it is gone (nothing was outstanding),
/// and a registration racing with the retirement is installed.
#[test]
fn retirement_across_threads_releases_the_handler() {
    model(|| {
        let source = Quiet(File::open("/dev/null").unwrap());
        let (unbound, handle) = split::<NoWork>(source, CqOptions::default()).unwrap();
        let mut poller = unbound.bind();
        let mut out = VecDeque::new();
        let old = handle.register(Nop).unwrap().key();
        poller.poll_once(&mut out).unwrap();
        assert!(poller.handler_keys().contains(&old));
        let retirer = {
            let h = handle.clone();
            thread::spawn(move || h.unregister(old).unwrap())
        };
        let registrar = {
            let h = handle.clone();
            thread::spawn(move || h.register(Nop).unwrap().key())
        };
        poller.poll_once(&mut out).unwrap();
        retirer.join().unwrap();
        let new = registrar.join().unwrap();
        poller.poll_once(&mut out).unwrap();
        let installed = poller.handler_keys();
        assert!(!installed.contains(&old), "{old} not released");
        assert!(installed.contains(&new), "{new} stranded");
    });
}
