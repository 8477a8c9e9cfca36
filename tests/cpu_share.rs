//! Idle pollers give their CPU away, in every poll mode (Busy included:
//! after a stretch with nothing found it escalates from pause hints to
//! yields to short sleeps, `cqd_core::mode`).
//!
//! Two pollers on idle CQs are pinned to one CPU, and
//!
//! - with a producer thread pinned there too, counting in a busy loop for
//!   500 ms, they leave it most of the CPU time used on that CPU (its part
//!   of wall time is printed beside it: other load on the machine moves
//!   that one, not the property);
//! - alone there for 500 ms, they use a few percent of it.
//!
//! Skipped, with `SKIPPED:` and the reason, where a thread cannot be pinned.

mod common;

use std::time::Duration;

use common::share::{producer_share, Setup, Share};
use cqd::core::PollMode;

/// The producer's least part of the CPU time used on its CPU. Pollers that
/// spin take their fair share there (two pollers and a producer: a third
/// each) unless `yield_now` hands it over; idle pollers that sleep take a
/// few percent.
const LEAST_PRODUCER_SHARE: f64 = 0.8;

/// The most of their CPU two idle pollers may use between them (a Busy
/// poller that spins takes all of it; one that naps, a few percent in a
/// debug build).
const MOST_IDLE_POLLER_SHARE: f64 = 0.1;

const WINDOW: Duration = Duration::from_millis(500);

fn measure(mode: PollMode, count: bool) -> Option<Share> {
    let setup = Setup {
        window: WINDOW,
        count,
        ..Setup::new(mode, 2)
    };
    match producer_share(&setup) {
        Ok(share) => Some(share),
        Err(reason) => {
            println!("SKIPPED: {reason}");
            None
        }
    }
}

fn idle_pollers_leave_the_cpu_to_a_producer(mode: PollMode) {
    let Some(share) = measure(mode, true) else {
        return;
    };
    println!(
        "{}: CPU {}: producer {:?} of {:?} ({:.0}% of wall time), 2 idle pollers {:?}; \
         producer's part of the CPU time used there {:.0}%",
        mode.name(),
        share.cpu,
        share.producer,
        share.wall,
        100.0 * share.of_wall(),
        share.pollers,
        100.0 * share.of_used(),
    );
    assert!(
        share.of_used() >= LEAST_PRODUCER_SHARE,
        "{}: 2 idle pollers took {:?} of CPU {} while the producer got {:?} \
         ({:.0}% of the CPU time used there; wanted at least {:.0}%)",
        mode.name(),
        share.pollers,
        share.cpu,
        share.producer,
        100.0 * share.of_used(),
        100.0 * LEAST_PRODUCER_SHARE,
    );
}

all_modes!(idle_pollers_leave_the_cpu_to_a_producer);

fn idle_pollers_alone_on_a_cpu_use_little_of_it(mode: PollMode) {
    let Some(share) = measure(mode, false) else {
        return;
    };
    let used = share.pollers_of_wall();
    println!(
        "{}: CPU {}: 2 idle pollers used {:?} in {:?} ({:.1}%), {} naps",
        mode.name(),
        share.cpu,
        share.pollers,
        share.wall,
        100.0 * used,
        share.naps,
    );
    // Only Busy naps; the others sleep on notifications.
    assert_eq!(
        share.naps > 0,
        mode == PollMode::Busy,
        "{} naps",
        share.naps
    );
    assert!(
        used <= MOST_IDLE_POLLER_SHARE,
        "{}: 2 idle pollers used {:?} of CPU {} in {:?} ({:.1}%; wanted at most {:.0}%)",
        mode.name(),
        share.pollers,
        share.cpu,
        share.wall,
        100.0 * used,
        100.0 * MOST_IDLE_POLLER_SHARE,
    );
}

all_modes!(idle_pollers_alone_on_a_cpu_use_little_of_it);
