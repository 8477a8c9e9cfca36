//! A running CQ resized (`ibv_resize_cq`) on its poller's thread.
//!
//! A device's resize is not safe beside a poll of the same CQ (softverbs
//! moves its ring to a new one; mlx5 swaps its buffer under the CQ's
//! lock, which a single-threaded poll does not take), so the thread that
//! polls the CQ makes it, between two polls:
//!
//! 1. **Ask.** [`CqHandle::resize`](super::CqHandle::resize) pushes the
//!    request on the CQ's resize queue under its mutex, unless the CQ has
//!    finished (then it fails at once, [`ResizeError::Stopped`]), marks
//!    the queue asked, then sets the CQ's commands flag and rings its
//!    poller's doorbell as a registration does (the registration doorbell
//!    protocol of `handle`: a CQ not yet bound finds it when it binds).
//! 2. **Resize.** The poller, applying the CQ's commands (before its next
//!    poll, or on the doorbell's note), takes the queue under its mutex
//!    and, for each request, calls the source's
//!    [`resize`](crate::source::CompletionSource::resize). On success the
//!    CQ's budget counts the new capacity ([`CqBudget::grown_to`]: an
//!    admission counts entries only once the device holds them) and the
//!    handle's [`capacity`](super::CqHandle::capacity) reads it. Then it
//!    answers. A command pass that runs inside a batch's dispatch (a
//!    handler's slot not yet installed) leaves the queue to the next pass:
//!    it sets the commands flag again while the queue is asked, so that
//!    the next poll makes it.
//! 3. **End.** Finishing the CQ marks the queue ended under its mutex and
//!    answers what is queued with [`ResizeError::Stopped`]; a request
//!    after that finds the mark (step 1). No request is left unanswered.

use std::time::Duration;

use crate::reply::{self, Replier, Reply};
use crate::sync::{AtomicBool, AtomicU32, Ordering, ShortMutex};

#[cfg(all(test, loom))]
std::thread_local! {
    /// The loom model's mutation of [`Resizes::after_pass`]: no re-ring.
    static NO_RE_RING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Why a CQ was not resized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResizeError {
    /// The size asked is not above the CQ's capacity: a CQ only grows
    /// (its admission already counts what it holds).
    #[error("CQ {cq}: a resize to {asked} entries does not grow its {capacity}")]
    NotLarger {
        /// The CQ.
        cq: String,
        /// The entries asked for.
        asked: u32,
        /// Its capacity now.
        capacity: u32,
    },
    /// The backend cannot resize this CQ (cqd-sim's CQs can; rxe's and
    /// softverbs' can; a device whose provider has no resize cannot).
    #[error("CQ {cq}: resize is not supported: {reason}")]
    Unsupported {
        /// The CQ.
        cq: String,
        /// What the backend said.
        reason: String,
    },
    /// The device refused (no memory, above its `max_cqe`, ...): the CQ is
    /// as it was.
    #[error("CQ {cq}: resize to {asked} entries failed: {reason}")]
    Failed {
        /// The CQ.
        cq: String,
        /// The entries asked for.
        asked: u32,
        /// The device's error.
        reason: String,
    },
    /// The CQ's poller has stopped, or the CQ finished: not resized.
    #[error("CQ {cq}: its poller has stopped; not resized")]
    Stopped {
        /// The CQ.
        cq: String,
    },
    /// No answer within the wait's timeout: the CQ's poller is busy, or
    /// the CQ is not bound to one yet; the resize may still be made (wait
    /// on the [`Resizing`] again).
    #[error("CQ {cq}: not resized within {waited:?}")]
    TimedOut {
        /// The CQ.
        cq: String,
        /// How long the wait was.
        waited: Duration,
    },
}

/// A resize on its way to a CQ's poller: fires once the poller made it
/// (or refused). Wait with [`wait`](Self::wait), or await it; the output is
/// the CQ's new capacity.
#[must_use = "a resize can fail: wait for it"]
#[derive(Debug)]
pub struct Resizing {
    cq: String,
    reply: Reply<u32, ResizeError>,
}

impl Resizing {
    fn new(cq: &str) -> (Self, Answer) {
        let (reply, answer) = reply::pair(Err(ResizeError::Stopped { cq: cq.to_string() }));
        (
            Resizing {
                cq: cq.to_string(),
                reply,
            },
            answer,
        )
    }

    /// A request refused before it was queued.
    pub(crate) fn refused(cq: &str, error: ResizeError) -> Self {
        let (r, answer) = Self::new(cq);
        answer.answer(Err(error));
        r
    }

    /// Waits until the poller has resized the CQ, at most `timeout`;
    /// returns its new capacity.
    ///
    /// # Errors
    /// Why it was not resized; [`ResizeError::TimedOut`] if the poller had
    /// not answered by then.
    pub fn wait(&self, timeout: Duration) -> Result<u32, ResizeError> {
        self.reply.wait(timeout).unwrap_or_else(|| {
            Err(ResizeError::TimedOut {
                cq: self.cq.clone(),
                waited: timeout,
            })
        })
    }
}

impl std::future::Future for Resizing {
    type Output = Result<u32, ResizeError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.reply.poll(cx)
    }
}

/// The poller's side of one [`Resizing`]; dropped unanswered (a panic
/// between take and answer), the resize reads `Stopped`.
pub(crate) type Answer = Replier<u32, ResizeError>;

struct Queue {
    asked: Vec<(u32, Answer)>,
    ended: bool,
}

/// A CQ's resize requests (see the module documentation) and the capacity
/// its handle reads.
pub(crate) struct Resizes {
    queue: ShortMutex<Queue>,
    /// True while the queue holds a request (step 1 sets it, step 2's take
    /// clears it): a command pass inside a dispatch rings again for it.
    asked: AtomicBool,
    /// The CQ's capacity: the source's at the split, then each resize's.
    capacity: AtomicU32,
}

impl Resizes {
    pub(crate) fn new(capacity: u32) -> Self {
        Resizes {
            queue: ShortMutex::new(Queue {
                asked: Vec::new(),
                ended: false,
            }),
            asked: AtomicBool::new(false),
            capacity: AtomicU32::new(capacity),
        }
    }

    pub(crate) fn capacity(&self) -> u32 {
        self.capacity.load(Ordering::Acquire)
    }

    /// Step 1's push: `None` if the CQ has finished.
    pub(crate) fn ask(&self, cq: &str, cqe: u32) -> Option<Resizing> {
        let mut q = self.queue.lock();
        if q.ended {
            return None;
        }
        let (resizing, answer) = Resizing::new(cq);
        q.asked.push((cqe, answer));
        self.asked.store(true, Ordering::Release);
        Some(resizing)
    }

    /// True while a request waits (step 2's re-ring).
    pub(crate) fn waiting(&self) -> bool {
        self.asked.load(Ordering::Acquire)
    }

    /// Step 1 after the push: sets the CQ's commands flag `rung`; true if
    /// this set it, and so the caller rings the doorbell (the registration
    /// doorbell protocol).
    pub(crate) fn flag(rung: &AtomicBool) -> bool {
        !rung.swap(true, Ordering::AcqRel)
    }

    /// Step 2's re-ring, at the end of every command pass (which began by
    /// clearing `rung`): while a request waits, the flag is set again, so
    /// that a pass that does not resize (one inside a dispatch) leaves the
    /// request to the next poll.
    pub(crate) fn after_pass(&self, rung: &AtomicBool) {
        #[cfg(all(test, loom))]
        if NO_RE_RING.with(std::cell::Cell::get) {
            return;
        }
        if self.waiting() {
            rung.store(true, Ordering::Release);
        }
    }

    /// Step 2's take.
    pub(crate) fn take(&self) -> Vec<(u32, Answer)> {
        let mut q = self.queue.lock();
        self.asked.store(false, Ordering::Release);
        std::mem::take(&mut q.asked)
    }

    /// Step 2's new capacity, after the device's resize.
    pub(crate) fn set_capacity(&self, capacity: u32) {
        self.capacity.store(capacity, Ordering::Release);
    }

    /// Step 3.
    pub(crate) fn end(&self, cq: &str) {
        let left = {
            let mut q = self.queue.lock();
            q.ended = true;
            self.asked.store(false, Ordering::Release);
            std::mem::take(&mut q.asked)
        };
        for (_, a) in left {
            a.answer(Err(ResizeError::Stopped { cq: cq.to_string() }));
        }
    }
}

/// The protocol under loom: a handle asks for a resize while the poller
/// runs a command pass inside a dispatch (which does not resize) and then
/// its own pass. Whatever the interleaving, the request is answered, or
/// the flag is set with the request queued (the next poll takes it);
/// without the re-ring, loom finds the request stranded. And a request
/// made as the CQ finishes is refused or answered, never left.
#[cfg(all(test, loom))]
mod loom_resize {
    use super::*;
    use crate::sync::Arc;

    fn model(no_re_ring: bool) {
        loom::model(move || {
            let res = Arc::new(Resizes::new(8));
            let rung = Arc::new(AtomicBool::new(false));
            let asker = {
                let (res, rung) = (Arc::clone(&res), Arc::clone(&rung));
                loom::thread::spawn(move || {
                    let r = res.ask("c", 16).expect("not ended");
                    let _ring = Resizes::flag(&rung);
                    r
                })
            };
            NO_RE_RING.with(|m| m.set(no_re_ring));
            // A pass inside a dispatch: commands only.
            rung.swap(false, Ordering::AcqRel);
            res.after_pass(&rung);
            // The poller's own pass, at its next poll.
            if rung.load(Ordering::Acquire) {
                rung.swap(false, Ordering::AcqRel);
                res.after_pass(&rung);
                if res.waiting() {
                    for (cqe, a) in res.take() {
                        a.answer(Ok(cqe));
                    }
                }
            }
            let r = asker.join().unwrap();
            let answered = r.reply.is_answered();
            assert!(
                answered || (rung.load(Ordering::Acquire) && res.waiting()),
                "a resize request stranded: unanswered, and no poll will look"
            );
        });
    }

    #[test]
    fn loom_resize_is_never_stranded() {
        model(false);
    }

    #[test]
    #[should_panic(expected = "stranded")]
    fn loom_resize_mutation_no_re_ring() {
        model(true);
    }

    #[test]
    fn loom_resize_as_the_cq_finishes() {
        loom::model(|| {
            let res = Arc::new(Resizes::new(8));
            let asker = {
                let res = Arc::clone(&res);
                loom::thread::spawn(move || res.ask("c", 16))
            };
            res.end("c");
            match asker.join().unwrap() {
                None => {}
                Some(r) => assert!(r.reply.is_answered(), "a request left unanswered"),
            }
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn an_ended_queue_refuses_and_answers_what_it_held() {
        let r = Resizes::new(8);
        let first = r.ask("c", 16).unwrap();
        assert!(r.waiting());
        r.end("c");
        assert!(!r.waiting());
        assert_eq!(
            first.wait(Duration::from_secs(1)),
            Err(ResizeError::Stopped { cq: "c".into() })
        );
        assert!(r.ask("c", 32).is_none());
    }

    #[test]
    fn an_answer_dropped_unanswered_reads_stopped() {
        let r = Resizes::new(8);
        let w = r.ask("c", 16).unwrap();
        let taken = r.take();
        assert!(!r.waiting());
        drop(taken);
        assert_eq!(
            w.wait(Duration::from_secs(1)),
            Err(ResizeError::Stopped { cq: "c".into() })
        );
    }

    #[test]
    fn a_wait_times_out_then_finds_the_answer() {
        let r = Resizes::new(8);
        let w = r.ask("c", 16).unwrap();
        assert!(matches!(
            w.wait(Duration::from_millis(1)),
            Err(ResizeError::TimedOut { .. })
        ));
        for (cqe, a) in r.take() {
            r.set_capacity(cqe);
            a.answer(Ok(cqe));
        }
        assert_eq!(w.wait(Duration::from_secs(1)), Ok(16));
        assert_eq!(r.capacity(), 16);
    }
}
