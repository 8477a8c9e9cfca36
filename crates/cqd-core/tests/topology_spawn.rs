//! Spawning from a validated topology: names, pinning, fences, priorities,
//! and failures that are errors, never silent successes.
#![cfg(not(loom))]

use std::collections::BTreeSet;

use cqd_core::topology::{
    ModeConfig, OnPriorityError, Placement, PollerConfig, PoolConfig, Priority, SpawnError,
    TopologyConfig,
};

fn this_threads_cpus() -> BTreeSet<usize> {
    let set = rustix::thread::sched_getaffinity(None).unwrap();
    (0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&c| set.is_set(c))
        .collect()
}

fn this_threads_nice() -> i32 {
    rustix::process::getpriority_process(Some(rustix::thread::gettid())).unwrap()
}

/// A nice value `by` steps lower in priority than this thread's (at most
/// 19), which any thread may take without privilege. The tests assert
/// against it, so they hold whatever nice value the test runner was started
/// with (`nice -n 5 cargo nextest run`). At 19 already there is no room: the
/// priority check then cannot tell applied from inherited, and says so.
fn nicer_than_now(by: i32) -> i8 {
    let now = this_threads_nice();
    let nice = (now + by).min(19);
    if nice == now {
        eprintln!("SKIPPED (priority part): this thread already runs at nice {now}");
    }
    i8::try_from(nice).unwrap()
}

fn last_allowed_cpu() -> usize {
    *this_threads_cpus().iter().next_back().unwrap()
}

#[test]
fn poller_thread_is_named_pinned_and_prioritised() {
    let nice = nicer_than_now(7);
    let cpu = last_allowed_cpu();
    let mut topology = TopologyConfig::new()
        .poller(PollerConfig::new("rx").cq("rx0"))
        .poller(
            PollerConfig::new("tx")
                .cq("tx0")
                .mode(ModeConfig::Event { timeout_ms: 10 })
                .placement(Placement::Fixed(cpu))
                .priority(Priority::Nice(nice)),
        )
        .validate()
        .unwrap();
    let plan = topology.take_poller("tx").unwrap();
    assert_eq!(plan.mode(), ModeConfig::Event { timeout_ms: 10 });
    assert_eq!(plan.cqs(), ["tx0"]);
    let handle = plan
        .spawn(|| {
            (
                std::thread::current().name().map(str::to_owned),
                this_threads_cpus(),
                this_threads_nice(),
            )
        })
        .unwrap();
    assert_eq!(handle.name(), "cqd-poller-tx");
    let (name, cpus, applied) = handle.join().unwrap();
    assert_eq!(name.as_deref(), Some("cqd-poller-tx"));
    assert_eq!(cpus, BTreeSet::from([cpu]));
    assert_eq!(applied, i32::from(nice));
}

#[test]
fn pool_workers_are_fenced_and_named() {
    let nice = nicer_than_now(3);
    let allowed = this_threads_cpus();
    let mut topology = TopologyConfig::new()
        .pool(
            PoolConfig::new("io", 3)
                .placement(Placement::Fenced(allowed.clone()))
                .priority(Priority::Nice(nice)),
        )
        .validate()
        .unwrap();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (pool, mut sinks) = topology
        .take_pool("io")
        .unwrap()
        .spawn(1, |_| {
            let seen = seen.clone();
            move |_: ()| {
                let name = std::thread::current().name().unwrap_or("").to_owned();
                seen.lock()
                    .unwrap()
                    .push((name, this_threads_cpus(), this_threads_nice()));
            }
        })
        .unwrap();
    let mut items: std::collections::VecDeque<_> = (0..3)
        .map(|i| cqd_core::sink::Routed {
            route: cqd_core::sink::Route::Key(i),
            item: (),
        })
        .collect();
    sinks[0]
        .flush(&mut items, std::time::Duration::from_secs(10))
        .unwrap();
    drop(sinks);
    let snapshot = pool.join().unwrap();
    let names: BTreeSet<_> = snapshot.workers.iter().map(|w| w.name.clone()).collect();
    assert_eq!(
        names,
        BTreeSet::from([
            "cqd-worker-io-0".into(),
            "cqd-worker-io-1".into(),
            "cqd-worker-io-2".into()
        ])
    );
    for (name, cpus, applied) in seen.lock().unwrap().iter() {
        assert!(name.starts_with("cqd-worker-io-"), "{name}");
        assert_eq!(cpus, &allowed);
        assert_eq!(*applied, i32::from(nice));
    }
}

#[test]
fn a_failed_pin_is_an_error_naming_thread_and_cpu() {
    // Plan for a bigger machine than this one, then spawn here.
    let big: BTreeSet<usize> = (0..1024).collect();
    let mut topology = TopologyConfig::new()
        .poller(
            PollerConfig::new("a")
                .cq("x")
                .placement(Placement::Fixed(1000)),
        )
        .pool(PoolConfig::new("io", 2).placement(Placement::fenced([1001])))
        .validate_for(&big)
        .unwrap();
    let e = topology.take_poller("a").unwrap().spawn(|| ()).unwrap_err();
    assert!(
        matches!(&e, SpawnError::Pin { thread, cpu: 1000 } if thread == "cqd-poller-a"),
        "{e}"
    );
    let e = topology
        .take_pool("io")
        .unwrap()
        .spawn(1, |_| |_: ()| {})
        .unwrap_err();
    assert!(
        matches!(&e, SpawnError::Fence { thread, errno, .. } if thread == "cqd-worker-io-0" && *errno != 0),
        "{e}"
    );
}

#[test]
fn a_pool_needs_a_producer() {
    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("io", 1))
        .validate()
        .unwrap();
    let e = topology
        .take_pool("io")
        .unwrap()
        .spawn(0, |_| |_: ()| {})
        .unwrap_err();
    assert!(matches!(e, SpawnError::NoProducers { .. }), "{e}");
}

/// Runs `f` on a thread without `CAP_SYS_NICE` in its effective set (threads
/// it spawns inherit that), as an unprivileged service would run.
fn without_sys_nice<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        use rustix::thread::{capabilities, set_capabilities, CapabilitySet};
        let mut caps = capabilities(None).unwrap();
        caps.effective.remove(CapabilitySet::SYS_NICE);
        set_capabilities(None, caps).unwrap();
        f()
    })
    .join()
    .unwrap()
}

#[test]
fn without_privilege_a_priority_is_an_error_or_a_warning_never_ignored() {
    let rt_limit = rustix::process::getrlimit(rustix::process::Resource::Rtprio);
    if rt_limit.current.unwrap_or(u64::MAX) > 0 {
        eprintln!("SKIPPED: RLIMIT_RTPRIO allows real-time priorities without privilege here");
        return;
    }
    // A nice value below this thread's needs privilege (or an RLIMIT_NICE
    // grant reaching it), whatever value the runner started at.
    let inherited = this_threads_nice();
    let Some(raised) = i8::try_from(inherited - 1).ok().filter(|&n| n >= -20) else {
        eprintln!("SKIPPED: this thread already runs at nice -20");
        return;
    };
    let nice_limit = rustix::process::getrlimit(rustix::process::Resource::Nice);
    let ceiling = 20 - i64::try_from(nice_limit.current.unwrap_or(40)).unwrap_or(40);
    if i64::from(raised) >= ceiling {
        eprintln!("SKIPPED: RLIMIT_NICE allows nice {raised} without privilege here");
        return;
    }
    let config = move |on: OnPriorityError| {
        TopologyConfig::new()
            .on_priority_error(on)
            .poller(PollerConfig::new("rt").cq("x").priority(Priority::Fifo(10)))
            .pool(PoolConfig::new("io", 1).priority(Priority::Nice(raised)))
    };
    let (poller, pool) = without_sys_nice(move || {
        let mut topology = config(OnPriorityError::Error).validate().unwrap();
        let poller = topology.take_poller("rt").unwrap().spawn(|| ()).map(|_| ());
        let pool = topology
            .take_pool("io")
            .unwrap()
            .spawn(1, |_| |_: ()| {})
            .map(|_| ());
        (poller, pool)
    });
    let e = poller.unwrap_err();
    assert!(
        matches!(&e, SpawnError::Priority { thread, errno, .. } if thread == "cqd-poller-rt" && *errno != 0),
        "{e}"
    );
    assert!(e.to_string().contains("CAP_SYS_NICE"), "{e}");
    let e = pool.unwrap_err();
    assert!(
        matches!(&e, SpawnError::Priority { thread, .. } if thread == "cqd-worker-io-0"),
        "{e}"
    );

    // With on_priority_error = "warn" the threads run, at the inherited priority.
    let (policy, nice) = without_sys_nice(move || {
        let mut topology = config(OnPriorityError::Warn).validate().unwrap();
        let poller = topology
            .take_poller("rt")
            .unwrap()
            .spawn(|| thread_priority::unix::thread_schedule_policy().unwrap())
            .unwrap();
        let policy = poller.join().unwrap();
        let nice = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(i32::MIN));
        let seen = nice.clone();
        let (pool, mut sinks) = topology
            .take_pool("io")
            .unwrap()
            .spawn(1, move |_| {
                let seen = seen.clone();
                move |_: ()| seen.store(this_threads_nice(), std::sync::atomic::Ordering::Relaxed)
            })
            .unwrap();
        let mut one: std::collections::VecDeque<_> = [cqd_core::sink::Routed {
            route: cqd_core::sink::Route::LeastLoaded,
            item: (),
        }]
        .into();
        sinks[0]
            .flush(&mut one, std::time::Duration::from_secs(10))
            .unwrap();
        drop(sinks);
        pool.join().unwrap();
        (policy, nice.load(std::sync::atomic::Ordering::Relaxed))
    });
    assert!(
        !matches!(
            policy,
            thread_priority::unix::ThreadSchedulePolicy::Realtime(_)
        ),
        "{policy:?}"
    );
    assert_eq!(nice, inherited);
}

/// The round budget: 256 by default, from TOML, into the CQ options.
#[test]
fn round_budget_reaches_the_cq_options() {
    let text = r#"
        [[poller]]
        name = "rx"
        cqs = ["rx0"]
        round_budget = 64

        [[poller]]
        name = "tx"
        cqs = ["tx0"]
    "#;
    let mut topology = TopologyConfig::from_toml(text).unwrap().validate().unwrap();
    let rx = topology.take_poller("rx").unwrap();
    let tx = topology.take_poller("tx").unwrap();
    assert_eq!(rx.cq_options().round_budget, 64);
    assert_eq!(
        tx.cq_options().round_budget,
        cqd_core::cq::DEFAULT_ROUND_BUDGET
    );
}
