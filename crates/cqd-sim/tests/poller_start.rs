//! A poller's start-up: `on_start` runs first, on the named poller thread,
//! and `spawn` returns only once it has run; a set-up that fails or panics
//! is an error from `spawn`, and the poller never starts.

use std::sync::{Arc, Mutex};

use cqd_core::poller::PollerError;
use cqd_core::topology::{Placement, PollerConfig, TopologyConfig};
use cqd_core::{split, CqOptions, NoSink, NoWork, PollMode, PollerBuilder, UnboundCq};
use cqd_sim::{sim_cq, Faults, SimCq};

fn cq(name: &str) -> (SimCq, UnboundCq<NoWork>) {
    let (sim, source) = sim_cq(name, 16, Faults::default()).unwrap();
    let (poller, _handle) = split(source, CqOptions::default()).unwrap();
    (sim, poller)
}

#[test]
fn on_start_runs_on_the_poller_thread_before_spawn_returns() {
    for mode in PollMode::all() {
        let (_sim, poller) = cq("cq");
        let seen = Arc::new(Mutex::new(None));
        let theirs = seen.clone();
        let thread = PollerBuilder::new("p", NoSink)
            .mode(mode)
            .cq(poller)
            .on_start(move || {
                *theirs.lock().unwrap() = std::thread::current().name().map(str::to_owned);
                Ok(())
            })
            .spawn()
            .unwrap();
        // No waiting: the hook has run by the time spawn returned.
        assert_eq!(
            seen.lock().unwrap().as_deref(),
            Some("cqd-poller-p"),
            "{mode:?}"
        );
        thread.stop().unwrap();
    }
}

#[test]
fn a_failed_on_start_is_a_setup_error() {
    let (_sim, poller) = cq("cq");
    let e = PollerBuilder::new("p", NoSink)
        .cq(poller)
        .on_start(|| Err("no such CPU".into()))
        .spawn()
        .unwrap_err();
    assert!(
        matches!(&e, PollerError::Setup { poller, reason } if poller == "p" && reason == "no such CPU"),
        "{e}"
    );
}

#[test]
fn a_panicking_on_start_is_a_setup_error_not_a_hang() {
    let (_sim, poller) = cq("cq");
    let e = PollerBuilder::new("p", NoSink)
        .cq(poller)
        .on_start(|| panic!("set-up bug"))
        .spawn()
        .unwrap_err();
    assert!(
        matches!(&e, PollerError::Setup { poller, .. } if poller == "p"),
        "{e}"
    );
}

#[test]
fn a_planned_poller_that_cannot_be_pinned_does_not_start() {
    // Plan for a bigger machine than this one, then spawn here.
    let big = (0..1024).collect();
    let mut topology = TopologyConfig::new()
        .poller(
            PollerConfig::new("net")
                .cq("cq")
                .placement(Placement::Fixed(1000)),
        )
        .validate_for(&big)
        .unwrap();
    let plan = topology.take_poller("net").unwrap();
    let (_sim, poller) = cq("cq");
    let e = plan.poller_builder(NoSink).cq(poller).spawn().unwrap_err();
    assert!(
        matches!(&e, PollerError::Setup { reason, .. } if reason.contains("cqd-poller-0") && reason.contains("CPU 1000")),
        "{e}"
    );
}
