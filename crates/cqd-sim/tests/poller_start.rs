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
        matches!(&e, PollerError::Setup { reason, .. } if reason.contains("cqd-poller-net") && reason.contains("CPU 1000")),
        "{e}"
    );
}

fn two_pollers() -> cqd_core::topology::Topology {
    TopologyConfig::new()
        .poller(PollerConfig::new("rx").cq("rx0").cq("rx1"))
        .poller(PollerConfig::new("tx").cq("tx0"))
        .validate()
        .unwrap()
}

#[test]
fn a_cq_the_topology_gives_another_poller_is_refused_naming_both() {
    let mut topology = two_pollers();
    let plan = topology.take_poller("rx").unwrap();
    let (_a, rx0) = cq("rx0");
    let (_b, tx0) = cq("tx0");
    let e = plan
        .poller_builder(NoSink)
        .cq(rx0)
        .cq(tx0)
        .spawn()
        .unwrap_err();
    assert!(
        matches!(&e, PollerError::NotAssigned { poller, cq, owner }
            if poller == "rx" && cq == "tx0" && owner.as_deref() == Some("tx")),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "CQ \"tx0\" attached to poller \"rx\", but the topology gives it to poller \"tx\""
    );
    let (_c, stray) = cq("stray");
    let e = topology
        .take_poller("tx")
        .unwrap()
        .poller_builder(NoSink)
        .cq(stray)
        .spawn()
        .unwrap_err();
    assert!(
        e.to_string().contains("\"stray\"") && e.to_string().contains("has no CQ of that name"),
        "{e}"
    );
}

#[test]
fn a_cq_the_topology_gives_a_poller_must_be_attached_to_it() {
    let mut topology = two_pollers();
    let (_a, rx0) = cq("rx0");
    let e = topology
        .take_poller("rx")
        .unwrap()
        .poller_builder(NoSink)
        .cq(rx0)
        .spawn()
        .unwrap_err();
    assert!(
        matches!(&e, PollerError::NotAttached { poller, cq } if poller == "rx" && cq == "rx1"),
        "{e:?}"
    );
}

#[test]
fn a_planned_poller_carries_its_topology_name_in_its_thread_and_report() {
    let mut topology = two_pollers();
    let (_a, tx0) = cq("tx0");
    let seen = Arc::new(Mutex::new(None));
    let theirs = seen.clone();
    let thread = topology
        .take_poller("tx")
        .unwrap()
        .poller_builder(NoSink)
        .cq(tx0)
        .on_start(move || {
            *theirs.lock().unwrap() = std::thread::current().name().map(str::to_owned);
            Ok(())
        })
        .spawn()
        .unwrap();
    assert_eq!(thread.name(), "tx");
    let report = thread.stop().unwrap();
    assert_eq!(
        report.poller.name, "tx",
        "the report names the topology's poller"
    );
    assert_eq!(seen.lock().unwrap().as_deref(), Some("cqd-poller-tx"));
}

#[test]
fn a_hook_of_your_own_runs_after_the_plans_placement_not_instead_of_it() {
    let big = (0..1024).collect();
    let mut topology = TopologyConfig::new()
        .poller(
            PollerConfig::new("net")
                .cq("cq")
                .placement(Placement::Fixed(1000)),
        )
        .validate_for(&big)
        .unwrap();
    let ran = Arc::new(Mutex::new(false));
    let theirs = ran.clone();
    let (_sim, poller) = cq("cq");
    let e = topology
        .take_poller("net")
        .unwrap()
        .poller_builder(NoSink)
        .on_start(move || {
            *theirs.lock().unwrap() = true;
            Ok(())
        })
        .cq(poller)
        .spawn()
        .unwrap_err();
    assert!(
        e.to_string().contains("CPU 1000"),
        "the plan's pinning still ran: {e}"
    );
    assert!(
        !*ran.lock().unwrap(),
        "and it failed before the user's hook"
    );
}
