//! Shared helpers of the dispatcher integration tests.
#![allow(dead_code)]

pub mod share;

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd::core::{
    Completion, Failed, Handler, NoWork, Outbox, PollMode, RecvDone, SendDone, Status,
};

/// Runs a test body once per poll mode, as its own `#[test]`.
#[macro_export]
macro_rules! all_modes {
    ($body:ident) => {
        mod $body {
            use cqd::core::{Adaptive, PollMode};
            use std::time::Duration;
            #[test]
            fn busy() {
                super::$body(PollMode::Busy)
            }
            #[test]
            fn event() {
                super::$body(PollMode::Event)
            }
            #[test]
            fn hybrid() {
                super::$body(PollMode::Hybrid {
                    spin: Duration::from_micros(50),
                })
            }
            #[test]
            fn adaptive() {
                super::$body(PollMode::Adaptive(Adaptive::default()))
            }
        }
    };
}

/// True for the modes that sleep on notifications.
pub fn sleeps(mode: PollMode) -> bool {
    !matches!(mode, PollMode::Busy)
}

/// Which callback a completion reached.
pub const SEND: u8 = 1;
/// Receive callback.
pub const RECV: u8 = 2;
/// Error callback.
pub const ERROR: u8 = 3;

/// What every recording handler writes: per tag, how often it arrived and
/// through which callback, and whether it reached the right handler.
#[derive(Debug)]
pub struct Record {
    pub hits: Vec<AtomicU8>,
    pub callback: Vec<AtomicU8>,
    pub wrong_handler: AtomicU64,
    pub delivered: AtomicU64,
    pub owner: Vec<AtomicU64>,
}

impl Record {
    pub fn new(n: usize) -> Arc<Self> {
        Arc::new(Record {
            hits: (0..n).map(|_| AtomicU8::new(0)).collect(),
            callback: (0..n).map(|_| AtomicU8::new(0)).collect(),
            wrong_handler: AtomicU64::new(0),
            delivered: AtomicU64::new(0),
            owner: (0..n).map(|_| AtomicU64::new(u64::MAX)).collect(),
        })
    }

    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::Acquire)
    }
}

/// A handler that records each completion by tag.
pub struct Recorder {
    pub id: u64,
    pub record: Arc<Record>,
    pub panic_every: Option<u32>,
}

impl Recorder {
    fn hit(&self, tag: u32, cb: u8) {
        let t = tag as usize;
        let Some(h) = self.record.hits.get(t) else {
            self.record.wrong_handler.fetch_add(1, Ordering::Relaxed);
            return;
        };
        h.fetch_add(1, Ordering::Relaxed);
        self.record.callback[t].store(cb, Ordering::Relaxed);
        let owner = self.record.owner[t].load(Ordering::Relaxed);
        if owner != self.id {
            self.record.wrong_handler.fetch_add(1, Ordering::Relaxed);
        }
        self.record.delivered.fetch_add(1, Ordering::Release);
        if let Some(every) = self.panic_every {
            if tag % every == 0 {
                panic!("handler {} fails on tag {tag} (injected)", self.id);
            }
        }
    }
}

impl Handler for Recorder {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.hit(d.tag(), SEND)
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.hit(d.tag(), RECV)
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        // Only an anomaly (unknown opcode) reaches on_error with Success.
        assert!(f.status() != Status::Success || f.is_anomaly());
        self.hit(f.tag(), ERROR)
    }
}

/// Polls `cond` until it holds or `timeout` passes.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    cond()
}

/// A completion for a tag with a chosen outcome.
pub fn completion(wr_id: u64, status: Status, opcode: cqd::core::Opcode) -> Completion {
    if status.is_success() {
        let mut c = Completion::success(wr_id, opcode, 1);
        c.byte_len = 64;
        c
    } else {
        Completion::error(wr_id, status, 1)
    }
}
