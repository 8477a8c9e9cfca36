//! One outcome handed from the thread that makes it to the one that asked:
//! a CQ's join ([`Joining`](crate::Joining)) and a CQ's resize
//! ([`Resizing`](crate::Resizing)) are answered this way, waited for with a
//! timeout or awaited.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::ledger::CloseSignal;

type Outcome<T, E> = Arc<parking_lot::Mutex<Option<Result<T, E>>>>;

/// The asker's side: fires once answered (or once the answering side was
/// dropped unanswered, which reads as the outcome given at
/// [`pair`]).
#[derive(Debug)]
pub(crate) struct Reply<T, E> {
    signal: Arc<CloseSignal>,
    outcome: Outcome<T, E>,
    unanswered: Result<T, E>,
}

/// The answering side. Dropped without [`answer`](Self::answer), it fires
/// the reply with its unanswered outcome: no asker waits for good.
pub(crate) struct Replier<T, E> {
    signal: Arc<CloseSignal>,
    outcome: Outcome<T, E>,
}

/// A reply and its replier; `unanswered` is what the reply reads if the
/// replier is dropped without answering.
pub(crate) fn pair<T, E>(unanswered: Result<T, E>) -> (Reply<T, E>, Replier<T, E>) {
    let signal = CloseSignal::new();
    let outcome = Arc::new(parking_lot::Mutex::new(None));
    let replier = Replier {
        signal: Arc::clone(&signal),
        outcome: Arc::clone(&outcome),
    };
    (
        Reply {
            signal,
            outcome,
            unanswered,
        },
        replier,
    )
}

impl<T: Clone, E: Clone> Reply<T, E> {
    /// The outcome, once answered within `timeout`; `None` if not.
    pub(crate) fn wait(&self, timeout: Duration) -> Option<Result<T, E>> {
        self.signal.wait(timeout).then(|| self.outcome())
    }

    /// A future's poll: ready with the outcome once answered.
    pub(crate) fn poll(&self, cx: &mut Context<'_>) -> Poll<Result<T, E>> {
        self.signal.poll_fired(cx).map(|()| self.outcome())
    }

    /// True once answered.
    #[cfg(all(test, loom))]
    pub(crate) fn is_answered(&self) -> bool {
        self.signal.is_fired()
    }

    fn outcome(&self) -> Result<T, E> {
        self.outcome
            .lock()
            .clone()
            .unwrap_or_else(|| self.unanswered.clone())
    }
}

impl<T, E> Replier<T, E> {
    pub(crate) fn answer(self, outcome: Result<T, E>) {
        *self.outcome.lock() = Some(outcome);
        self.signal.fire();
    }
}

impl<T, E> Drop for Replier<T, E> {
    fn drop(&mut self) {
        // Answered: fired already (a second fire does nothing). Not: the
        // reply reads its unanswered outcome.
        self.signal.fire();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn an_answer_a_timeout_and_a_replier_dropped() {
        let (r, a) = pair::<u32, &str>(Err("gone"));
        assert_eq!(r.wait(Duration::from_millis(1)), None);
        a.answer(Ok(7));
        assert_eq!(r.wait(Duration::from_secs(1)), Some(Ok(7)));
        let (r, a) = pair::<u32, &str>(Err("gone"));
        drop(a);
        assert_eq!(r.wait(Duration::from_secs(1)), Some(Err("gone")));
    }
}
