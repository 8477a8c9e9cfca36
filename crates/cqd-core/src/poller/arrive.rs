//! CQs that join a running group (a poller thread's, or a tokio driver's):
//! a group's CQ set grows while it runs, in every mode.
//!
//! 1. **Hand over.** [`PollerThread::add_cq`](crate::PollerThread::add_cq)
//!    (or the driver's) pushes the unbound CQ on the group's
//!    arrivals, under their mutex, unless the group has ended (then the
//!    CQ comes back at once, with the error), and rings the group's doorbell
//!    with the arrival note: a poller that sleeps wakes; a busy one finds
//!    the doorbell at its next readiness check (every 50 µs).
//! 2. **Join.** The group, on that note, takes every arrival and, on its
//!    own thread, registers the CQ's notification descriptor (and its
//!    channel's, and its asynchronous events') in its readiness, binds it
//!    and places it last, active: polled in the next round, armed by the
//!    next sleep's step 1 like any CQ that found nothing. Then it fires
//!    the arrival's [`Joining`].
//! 3. **End.** A group that ends marks its arrivals ended under the mutex
//!    and takes what is still queued: each such CQ is dropped (which
//!    finishes it: events acknowledged, CQ destroyed) and its `Joining`
//!    fires with [`JoinError::Ended`]. A hand-over after that finds the
//!    mark (step 1), so no arrival is left unanswered.

use std::any::Any;
use std::sync::Arc;
use std::time::Duration;

use crate::cq::{GroupBell, UnboundCq};
use crate::reply::{self, Replier, Reply};

/// The doorbell note that says "arrivals" (no CQ has this index).
pub(crate) const ARRIVAL: usize = usize::MAX;

/// Why a CQ did not join a group.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JoinError {
    /// The group has stopped (or is stopping). Returned with the CQ when
    /// the hand-over finds it so; a CQ still queued when the group ended
    /// was finished as a CQ dropped without a stop is (its handlers
    /// dropped: a context handler hands back what it holds).
    #[error("poller {poller} has stopped: CQ {cq} was not added")]
    Ended {
        /// The group.
        poller: String,
        /// The CQ.
        cq: String,
    },
    /// The group has a CQ of that name already (names say which CQ a
    /// report line is about): the CQ was finished.
    #[error("poller {poller} already polls a CQ named {cq}")]
    Duplicate {
        /// The group.
        poller: String,
        /// The CQ.
        cq: String,
    },
    /// Registering the CQ's descriptors failed: it was finished.
    #[error("poller {poller} could not watch CQ {cq}'s notifications: {reason}")]
    Os {
        /// The group.
        poller: String,
        /// The CQ.
        cq: String,
        /// The OS error.
        reason: String,
    },
    /// A tokio driver serves only CQs with a completion channel of their
    /// own (see `TokioDriver::spawn_local`): the CQ was finished.
    #[error("driver {poller} cannot serve CQ {cq}: its completion channel is shared with other CQs (give such CQs a poller thread)")]
    SharedChannel {
        /// The group.
        poller: String,
        /// The CQ.
        cq: String,
    },
    /// The CQ's work type is not the group's (a `PollerThread` handed an
    /// `UnboundCq` of another `W`): returned with the CQ.
    #[error("poller {poller} hands out work of another type than CQ {cq}'s")]
    WorkType {
        /// The group.
        poller: String,
        /// The CQ.
        cq: String,
    },
    /// The wait for the group passed its timeout: the group is busy or
    /// blocked; the CQ may still join (wait on the `Joining` again).
    #[error("poller {poller} did not take CQ {cq} within {waited:?}")]
    TimedOut {
        /// The group.
        poller: String,
        /// The CQ.
        cq: String,
        /// How long the wait was.
        waited: Duration,
    },
}

/// A CQ a running group would not take, handed back with the reason.
pub struct NotJoined<W> {
    error: JoinError,
    cq: Box<UnboundCq<W>>,
}

impl<W> NotJoined<W> {
    fn new(error: JoinError, cq: UnboundCq<W>) -> Self {
        NotJoined {
            error,
            cq: Box::new(cq),
        }
    }

    /// Why.
    pub fn error(&self) -> &JoinError {
        &self.error
    }

    /// The CQ, as it was handed over.
    pub fn into_cq(self) -> UnboundCq<W> {
        *self.cq
    }
}

impl<W> std::fmt::Debug for NotJoined<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NotJoined")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<W> std::fmt::Display for NotJoined<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl<W> std::error::Error for NotJoined<W> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// A CQ on its way into a running group: fires once the group polls it
/// (or refused it). Wait with [`wait`](Self::wait), or await it.
#[must_use = "a CQ's join can fail: wait for it"]
#[derive(Debug)]
pub struct Joining {
    poller: String,
    cq: String,
    reply: Reply<(), JoinError>,
}

impl Joining {
    fn new(poller: &str, cq: &str) -> (Self, Answer) {
        // Unanswered (the group's side dropped in a panic): as if the group
        // had ended with the CQ queued.
        let (reply, answer) = reply::pair(Err(JoinError::Ended {
            poller: poller.to_string(),
            cq: cq.to_string(),
        }));
        let joining = Joining {
            poller: poller.to_string(),
            cq: cq.to_string(),
            reply,
        };
        (joining, answer)
    }

    /// Waits until the group has taken the CQ (it is then polled), at most
    /// `timeout`.
    ///
    /// # Errors
    /// Why it did not join; [`JoinError::TimedOut`] if the group had not
    /// answered by then.
    pub fn wait(&self, timeout: Duration) -> Result<(), JoinError> {
        self.reply.wait(timeout).unwrap_or_else(|| {
            Err(JoinError::TimedOut {
                poller: self.poller.clone(),
                cq: self.cq.clone(),
                waited: timeout,
            })
        })
    }
}

impl std::future::Future for Joining {
    type Output = Result<(), JoinError>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        self.reply.poll(cx)
    }
}

/// The group's side of one [`Joining`].
pub(crate) type Answer = Replier<(), JoinError>;

struct Queue<W> {
    queued: Vec<(UnboundCq<W>, Answer)>,
    ended: bool,
}

/// A group's arrivals (see the module documentation).
pub(crate) struct Arrivals<W> {
    poller: String,
    queue: parking_lot::Mutex<Queue<W>>,
    doorbell: Arc<GroupBell>,
}

impl<W: Send + 'static> Arrivals<W> {
    pub(crate) fn new(poller: &str, doorbell: Arc<GroupBell>) -> Arc<Self> {
        Arc::new(Arrivals {
            poller: poller.to_string(),
            queue: parking_lot::Mutex::new(Queue {
                queued: Vec::new(),
                ended: false,
            }),
            doorbell,
        })
    }

    /// Step 1: the CQ back, with the reason, if the group has ended.
    pub(crate) fn hand_over(&self, cq: UnboundCq<W>) -> Result<Joining, NotJoined<W>> {
        let name = cq.name().to_string();
        let mut q = self.queue.lock();
        if q.ended {
            drop(q);
            let e = JoinError::Ended {
                poller: self.poller.clone(),
                cq: name,
            };
            return Err(NotJoined::new(e, cq));
        }
        let (joining, answer) = Joining::new(&self.poller, &name);
        q.queued.push((cq, answer));
        drop(q);
        self.doorbell.note(ARRIVAL);
        Ok(joining)
    }

    /// Step 2's take: what has arrived.
    pub(crate) fn take(&self) -> Vec<(UnboundCq<W>, Answer)> {
        std::mem::take(&mut self.queue.lock().queued)
    }

    /// Step 3.
    pub(crate) fn end(&self) {
        let left = {
            let mut q = self.queue.lock();
            q.ended = true;
            std::mem::take(&mut q.queued)
        };
        for (cq, answer) in left {
            let name = cq.name().to_string();
            drop(cq);
            answer.answer(Err(JoinError::Ended {
                poller: self.poller.clone(),
                cq: name,
            }));
        }
    }
}

/// A handle that adds CQs to one running group (a poller thread's or a
/// tokio driver's), typed by its work: what a CQ pool keeps for each
/// poller it grows onto. Cheap to clone; it does not keep the group
/// running (once the group ends, an add gets the CQ back).
pub struct CqJoiner<W> {
    arrivals: Arc<Arrivals<W>>,
}

impl<W> Clone for CqJoiner<W> {
    fn clone(&self) -> Self {
        CqJoiner {
            arrivals: Arc::clone(&self.arrivals),
        }
    }
}

impl<W> std::fmt::Debug for CqJoiner<W> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CqJoiner")
            .field("poller", &self.arrivals.poller)
            .finish()
    }
}

impl<W: Send + 'static> CqJoiner<W> {
    /// The group's name.
    pub fn poller(&self) -> &str {
        &self.arrivals.poller
    }

    /// As [`PollerThread::add_cq`](crate::PollerThread::add_cq).
    ///
    /// # Errors
    /// As [`PollerThread::add_cq`](crate::PollerThread::add_cq).
    pub fn add_cq(&self, cq: UnboundCq<W>) -> Result<Joining, NotJoined<W>> {
        self.arrivals.hand_over(cq)
    }
}

/// The typed joiner of an erased handle, if `W` is its work type.
pub(crate) fn joiner<W: Send + 'static>(arrivals: &AnyArrivals) -> Option<CqJoiner<W>> {
    Arc::clone(arrivals)
        .downcast::<Arrivals<W>>()
        .ok()
        .map(|arrivals| CqJoiner { arrivals })
}

/// A group's arrivals with their work type erased, for a handle that is
/// not generic over it (`PollerThread`, `DriverHandle`).
pub(crate) type AnyArrivals = Arc<dyn Any + Send + Sync>;

/// Step 1 through an erased handle.
pub(crate) fn hand_over<W: Send + 'static>(
    arrivals: &AnyArrivals,
    poller: &str,
    cq: UnboundCq<W>,
) -> Result<Joining, NotJoined<W>> {
    match Arc::clone(arrivals).downcast::<Arrivals<W>>() {
        Ok(a) => a.hand_over(cq),
        Err(_) => {
            let e = JoinError::WorkType {
                poller: poller.to_string(),
                cq: cq.name().to_string(),
            };
            Err(NotJoined::new(e, cq))
        }
    }
}
