//! Topology config: the example file, TOML errors, one test per rejection,
//! the warnings, and what `validate` hands to spawning.
#![cfg(not(loom))]

use std::collections::BTreeSet;
use std::time::Duration;

use cqd_core::mode::MIN_WAKE_TIMEOUT;
use cqd_core::topology::{
    CqPoolConfig, FitConfig, ModeConfig, OnPriorityError, OnSharedCpu, Placement, PollerConfig,
    PoolConfig, Priority, Routing, TopologyConfig, TopologyError, Warning, WorkerIdle, LONG_SPIN,
};

const EXAMPLE: &str = include_str!("../../../examples/topology.toml");

fn cpus(n: usize) -> BTreeSet<usize> {
    (0..n).collect()
}

fn poller(name: &str, cq: &str) -> PollerConfig {
    PollerConfig::new(name).cq(cq)
}

fn busy(name: &str, cq: &str, cpu: usize) -> PollerConfig {
    poller(name, cq)
        .mode(ModeConfig::Busy)
        .placement(Placement::Fixed(cpu))
}

#[test]
fn example_file_round_trips_and_matches_the_builder() {
    let parsed = TopologyConfig::from_toml(EXAMPLE).unwrap();
    let again = TopologyConfig::from_toml(&parsed.to_toml().unwrap()).unwrap();
    assert_eq!(parsed, again);

    let built = TopologyConfig::new()
        .on_priority_error(OnPriorityError::Error)
        .on_shared_cpu(OnSharedCpu::Error)
        .poller(
            busy("rx", "rx0", 1)
                .batch(32)
                .priority(Priority::Fifo(10))
                .pool("io"),
        )
        .poller(
            PollerConfig::new("tx")
                .cq("tx0")
                .cq("tx1")
                .pool("io")
                .batch(64)
                .placement(Placement::fenced([2, 3]))
                .priority(Priority::Nice(-5))
                .mode(ModeConfig::Adaptive {
                    min_window_us: 0,
                    max_window_us: 50,
                    cpu_budget_percent: 25,
                    timeout_ms: 100,
                }),
        )
        .poller(
            poller("ctl", "ctl")
                .placement(Placement::fenced([2, 3]))
                .mode(ModeConfig::Event { timeout_ms: 100 }),
        )
        .pool(
            PoolConfig::new("io", 4)
                .placement(Placement::fenced(4..8))
                .capacity(1024),
        )
        .pool(
            PoolConfig::new("bg", 2)
                .placement(Placement::fenced(4..8))
                .capacity(256)
                .routing(Routing::LeastLoaded)
                .priority(Priority::Nice(10)),
        );
    assert_eq!(parsed, built);

    let mut topology = parsed.validate_for(&cpus(8)).unwrap();
    assert!(topology.warnings().is_empty(), "{:?}", topology.warnings());
    let names: Vec<_> = topology
        .take_pollers()
        .iter()
        .map(|p| (p.name().to_owned(), p.thread_name()))
        .collect();
    assert_eq!(
        names,
        [
            ("rx".into(), "cqd-poller-rx".into()),
            ("tx".into(), "cqd-poller-tx".into()),
            ("ctl".into(), "cqd-poller-ctl".into())
        ]
    );
    let io = topology.take_pool("io").unwrap();
    assert_eq!((io.threads(), io.capacity()), (4, 1024));
    assert_eq!(io.feeders(), ["rx", "tx"], "the pollers that name it");
    assert!(topology.take_pool("bg").unwrap().feeders().is_empty());
    assert!(topology.take_pool("io").is_none(), "a plan is taken once");
}

#[test]
fn parse_errors_report_line_and_column() {
    let text = "[[pool]]\nname = \"io\"\nthreads = \"four\"\n";
    match TopologyConfig::from_toml(text) {
        Err(TopologyError::Parse {
            line,
            column,
            message,
        }) => {
            assert_eq!((line, column), (3, 11), "{message}");
            assert!(
                message.contains("usize") || message.contains("integer"),
                "{message}"
            );
        }
        other => panic!("expected a parse error, got {other:?}"),
    }
    let e = TopologyConfig::from_toml("[[poller]]\nname = \"a\"\ncqs = [\"x\"]\nbogus = 1\n")
        .unwrap_err();
    assert!(e.to_string().contains("line 4"), "{e}");
    let e = TopologyConfig::from_toml("[[pool]\n").unwrap_err();
    assert!(e.to_string().contains("line 1"), "{e}");
}

#[test]
fn missing_file_names_the_path() {
    let e = TopologyConfig::from_file("/nonexistent/topology.toml").unwrap_err();
    assert!(matches!(e, TopologyError::Io { .. }));
    assert!(e.to_string().contains("/nonexistent/topology.toml"));
}

#[test]
fn rejects_cpu_outside_the_affinity_mask() {
    let config = TopologyConfig::new().poller(poller("a", "x").placement(Placement::Fixed(5)));
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(&e, TopologyError::CpuNotAllowed { field, cpu: 5, .. } if field == "poller[0].placement"),
        "{e}"
    );
    let config =
        TopologyConfig::new().pool(PoolConfig::new("io", 2).placement(Placement::fenced([1, 9])));
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(&e, TopologyError::CpuNotAllowed { field, cpu: 9, .. } if field == "pool[0].placement"),
        "{e}"
    );
    // Against the real mask of this process.
    let config =
        TopologyConfig::new().poller(poller("a", "x").placement(Placement::Fixed(100_000)));
    assert!(matches!(
        config.validate(),
        Err(TopologyError::CpuNotAllowed { cpu: 100_000, .. })
    ));
}

#[test]
fn rejects_a_cpu_claimed_by_two_busy_pollers() {
    let config = TopologyConfig::new()
        .poller(busy("a", "x", 2))
        .poller(busy("b", "y", 2));
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(&e, TopologyError::CpuClaimedTwice { field, cpu: 2, claimed_by }
            if field == "poller[1].placement" && claimed_by == "poller[0].placement"),
        "{e}"
    );
    // Sharing a CPU is allowed when at most one of them spins (with a
    // warning, `warns_when_a_spinning_poller_may_share_its_cpu`).
    let config = TopologyConfig::new()
        .poller(busy("a", "x", 2))
        .poller(poller("b", "y").placement(Placement::Fixed(2)));
    let topology = config.validate_for(&cpus(4)).unwrap();
    assert!(
        matches!(topology.warnings(), [Warning::SpinnerSharesCpu { .. }]),
        "{:?}",
        topology.warnings()
    );
}

#[test]
fn rejects_a_cq_owned_by_two_pollers() {
    let config = TopologyConfig::new()
        .poller(poller("a", "rx0"))
        .poller(poller("b", "tx0").cq("rx0"));
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(&e, TopologyError::CqOwnedTwice { field, cq, owned_by }
            if field == "poller[1].cqs[1]" && cq == "rx0" && owned_by == "poller[0].cqs[0]"),
        "{e}"
    );
}

#[test]
fn rejects_zero_threads() {
    let config = TopologyConfig::new().pool(PoolConfig::new("io", 0));
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(&e, TopologyError::ZeroThreads { field } if field == "pool[0].threads"),
        "{e}"
    );
}

#[test]
fn rejects_zero_capacity() {
    let config = TopologyConfig::new()
        .pool(PoolConfig::new("a", 1))
        .pool(PoolConfig::new("b", 1).capacity(0));
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(&e, TopologyError::ZeroCapacity { field } if field == "pool[1].capacity"),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        "pool[1].capacity: ring capacity must be at least 1"
    );
}

#[test]
fn rejects_other_nonsense_naming_the_field() {
    let check = |config: TopologyConfig, want: &str| {
        let e = config.validate_for(&cpus(4)).unwrap_err();
        assert!(e.to_string().starts_with(want), "{e} (wanted {want})");
    };
    check(
        TopologyConfig::new().poller(PollerConfig::new("a")),
        "poller[0].cqs",
    );
    check(
        TopologyConfig::new().poller(poller("a", "x").batch(0)),
        "poller[0].batch",
    );
    check(
        TopologyConfig::new()
            .poller(poller("a", "x"))
            .poller(poller("a", "y")),
        "poller[1].name",
    );
    check(
        TopologyConfig::new().pool(PoolConfig::new("", 1)),
        "pool[0].name",
    );
    check(
        TopologyConfig::new().pool(PoolConfig::new("io", 1).placement(Placement::fenced([]))),
        "pool[0].placement",
    );
    check(
        TopologyConfig::new().pool(PoolConfig::new("io", 1).priority(Priority::Nice(30))),
        "pool[0].priority.nice",
    );
    check(
        TopologyConfig::new().poller(poller("a", "x").priority(Priority::Fifo(0))),
        "poller[0].priority.fifo",
    );
    check(
        TopologyConfig::new().poller(poller("a", "x").mode(ModeConfig::Adaptive {
            min_window_us: 10,
            max_window_us: 5,
            cpu_budget_percent: 50,
            timeout_ms: 100,
        })),
        "poller[0].mode.min_window_us",
    );
    check(
        TopologyConfig::new().pool(PoolConfig::new("io", 1).capacity(usize::MAX)),
        "pool[0].capacity",
    );
}

#[test]
fn rejects_a_wake_timeout_the_poller_would_not_honour() {
    let sleeping = [
        ModeConfig::Event { timeout_ms: 0 },
        ModeConfig::Hybrid {
            spin_window_us: 10,
            timeout_ms: 0,
        },
        ModeConfig::Adaptive {
            min_window_us: 2,
            max_window_us: 200,
            cpu_budget_percent: 50,
            timeout_ms: 0,
        },
    ];
    for mode in sleeping {
        let e = TopologyConfig::new()
            .poller(poller("ok", "x"))
            .poller(poller("net", "y").mode(mode))
            .validate_for(&cpus(4))
            .unwrap_err();
        match &e {
            TopologyError::WakeTimeoutTooShort {
                field,
                poller,
                timeout,
                min,
            } => {
                assert_eq!(field, "poller[1].mode.timeout_ms");
                assert_eq!(poller, "net");
                assert_eq!(*timeout, Duration::ZERO);
                assert_eq!(*min, MIN_WAKE_TIMEOUT);
            }
            other => panic!("{mode:?}: wanted WakeTimeoutTooShort, got {other:?}"),
        }
        let text = e.to_string();
        for part in ["poller[1].mode.timeout_ms", "\"net\"", "0ns", "100µs"] {
            assert!(text.contains(part), "{text:?} lacks {part:?}");
        }
    }

    // The same from TOML.
    let e = TopologyConfig::from_toml(
        r#"
        [[poller]]
        name = "ctl"
        cqs = ["c"]
        mode = { kind = "event", timeout_ms = 0 }
        "#,
    )
    .unwrap()
    .validate_for(&cpus(4))
    .unwrap_err();
    assert!(
        matches!(&e, TopologyError::WakeTimeoutTooShort { poller, .. } if poller == "ctl"),
        "{e}"
    );

    // Config timeouts are whole milliseconds: the smallest non-zero one is
    // honoured as written, so everything `validate` accepts is what runs.
    assert!(Duration::from_millis(1) >= MIN_WAKE_TIMEOUT);
    TopologyConfig::new()
        .poller(poller("net", "y").mode(ModeConfig::Event { timeout_ms: 1 }))
        .poller(poller("spin", "z").mode(ModeConfig::Busy))
        .validate_for(&cpus(4))
        .unwrap();
}

#[test]
fn warns_for_busy_poller_on_cpu0() {
    let topology = TopologyConfig::new()
        .poller(busy("a", "x", 0))
        .validate_for(&cpus(8))
        .unwrap();
    assert_eq!(
        topology.warnings(),
        [Warning::BusyOnCpu0 {
            field: "poller[0].placement".into()
        }]
    );
    // An unpinned busy poller may land on CPU 0 too.
    let topology = TopologyConfig::new()
        .poller(poller("a", "x").mode(ModeConfig::Busy))
        .validate_for(&cpus(8))
        .unwrap();
    assert!(matches!(topology.warnings(), [Warning::BusyOnCpu0 { .. }]));
    // Not when CPU 0 is out of reach.
    let topology = TopologyConfig::new()
        .poller(poller("a", "x").mode(ModeConfig::Busy))
        .validate_for(&(1..8).collect())
        .unwrap();
    assert!(topology.warnings().is_empty());
}

#[test]
fn warns_when_busy_pollers_take_more_than_half_the_cpus() {
    let topology = TopologyConfig::new()
        .poller(busy("a", "x", 1))
        .poller(busy("b", "y", 2))
        .poller(busy("c", "z", 3))
        .validate_for(&cpus(4))
        .unwrap();
    assert_eq!(
        topology.warnings(),
        [Warning::BusyOverHalf {
            busy: 3,
            allowed: 4
        }]
    );
    let topology = TopologyConfig::new()
        .poller(busy("a", "x", 1))
        .poller(busy("b", "y", 2))
        .validate_for(&cpus(4))
        .unwrap();
    assert!(topology.warnings().is_empty(), "exactly half is allowed");
}

#[test]
fn a_busy_poller_fenced_to_one_cpu_claims_it() {
    let config = TopologyConfig::new().poller(busy("a", "x", 3)).poller(
        poller("b", "y")
            .mode(ModeConfig::Busy)
            .placement(Placement::fenced([3])),
    );
    let e = config.validate_for(&cpus(4)).unwrap_err();
    assert!(
        matches!(e, TopologyError::CpuClaimedTwice { cpu: 3, .. }),
        "{e}"
    );
}

#[test]
fn unknown_fields_are_errors_even_inside_a_mode() {
    let text =
        "[[poller]]\nname = \"a\"\ncqs = [\"x\"]\nmode = { kind = \"event\", timout_ms = 5 }\n";
    let e = TopologyConfig::from_toml(text).unwrap_err();
    assert!(e.to_string().contains("timout_ms"), "{e}");
    let e = TopologyConfig::from_toml("[[pool]]\nname = \"io\"\nthreads = 1\ncapcity = 8\n")
        .unwrap_err();
    assert!(
        e.to_string().contains("capcity") && e.to_string().contains("line 4"),
        "{e}"
    );
}

fn shares(field: &str, poller: &str, mode: &'static str, cpus: &[usize], with: &str) -> Warning {
    Warning::SpinnerSharesCpu {
        field: field.into(),
        poller: poller.into(),
        mode,
        cpus: cpus.iter().copied().collect(),
        shares_with: with.into(),
    }
}

#[test]
fn warns_when_a_spinning_poller_may_share_its_cpu() {
    let topology = TopologyConfig::new()
        .poller(busy("rx", "x", 1))
        .poller(poller("ctl", "y").placement(Placement::fenced([1, 2])))
        .pool(PoolConfig::new("io", 2).placement(Placement::Fixed(1)))
        .pool(PoolConfig::new("bg", 2))
        .pool(PoolConfig::new("far", 2).placement(Placement::fenced([2, 3])))
        .validate_for(&cpus(4))
        .unwrap();
    assert_eq!(
        topology.warnings(),
        [
            Warning::WorkersShareCpu {
                field: "pool[0].placement".into(),
                threads: 2
            },
            shares(
                "poller[0].placement",
                "rx",
                "busy",
                &[1],
                "poller \"ctl\" at poller[1].placement"
            ),
            shares(
                "poller[0].placement",
                "rx",
                "busy",
                &[1],
                "pool \"io\" at pool[0].placement"
            ),
            // An unpinned pool may run anywhere, on CPU 1 too.
            shares(
                "poller[0].placement",
                "rx",
                "busy",
                &[1],
                "pool \"bg\" at pool[1].placement"
            ),
        ]
    );
    let text = topology.warnings()[1].to_string();
    assert_eq!(
        text,
        "poller[0].placement: busy poller \"rx\" may share CPU 1 with poller \"ctl\" at \
         poller[1].placement; while it spins, they wait for their turn"
    );

    // An unpinned busy poller may share every CPU its neighbours may use.
    let topology = TopologyConfig::new()
        .poller(poller("rx", "x").mode(ModeConfig::Busy))
        .pool(PoolConfig::new("io", 4).placement(Placement::fenced(4..8)))
        .validate_for(&(1..8).collect())
        .unwrap();
    assert_eq!(
        topology.warnings(),
        [shares(
            "poller[0].placement",
            "rx",
            "busy",
            &[4, 5, 6, 7],
            "pool \"io\" at pool[0].placement"
        )]
    );
    assert!(topology.warnings()[0].to_string().contains("CPUs 4-7"));

    // Nothing to say when the spinner has its CPUs to itself.
    let topology = TopologyConfig::new()
        .poller(busy("rx", "x", 1))
        .poller(poller("ctl", "y").placement(Placement::fenced([2, 3])))
        .pool(PoolConfig::new("io", 2).placement(Placement::fenced([2, 3])))
        .validate_for(&cpus(4))
        .unwrap();
    assert!(topology.warnings().is_empty(), "{:?}", topology.warnings());
}

#[test]
fn two_spinners_that_may_share_are_reported_once() {
    let topology = TopologyConfig::new()
        .poller(
            poller("a", "x")
                .mode(ModeConfig::Busy)
                .placement(Placement::fenced([1, 2])),
        )
        .poller(busy("b", "y", 2))
        .validate_for(&cpus(4))
        .unwrap();
    assert_eq!(
        topology.warnings(),
        [shares(
            "poller[0].placement",
            "a",
            "busy",
            &[2],
            "poller \"b\" at poller[1].placement"
        )]
    );
}

#[test]
fn a_long_spin_window_spins_like_busy() {
    let hybrid = |us| ModeConfig::Hybrid {
        spin_window_us: us,
        timeout_ms: 100,
    };
    let adaptive = |max_us| ModeConfig::Adaptive {
        min_window_us: 2,
        max_window_us: max_us,
        cpu_budget_percent: 50,
        timeout_ms: 100,
    };
    let long = LONG_SPIN.as_micros() as u64;
    let cases = [
        (hybrid(long), Some("hybrid")),
        (hybrid(long - 1), None),
        (adaptive(5 * long), Some("adaptive")),
        (adaptive(long - 1), None),
        (ModeConfig::default(), None),
        (ModeConfig::Event { timeout_ms: 100 }, None),
    ];
    for (mode, warned) in cases {
        let topology = TopologyConfig::new()
            .poller(poller("p", "x").mode(mode).placement(Placement::Fixed(1)))
            .pool(PoolConfig::new("io", 1).placement(Placement::Fixed(1)))
            .validate_for(&cpus(4))
            .unwrap();
        let got: Vec<_> = topology
            .warnings()
            .iter()
            .map(|w| match w {
                Warning::SpinnerSharesCpu { mode, .. } => *mode,
                other => panic!("{other}"),
            })
            .collect();
        assert_eq!(got, warned.into_iter().collect::<Vec<_>>(), "{mode:?}");
    }
}

#[test]
fn on_shared_cpu_error_refuses_what_would_be_a_warning() {
    let text = r#"
        on_shared_cpu = "error"

        [[poller]]
        name = "rx"
        cqs = ["rx0"]
        placement = { fixed = 3 }
        mode = { kind = "busy" }

        [[pool]]
        name = "io"
        threads = 2
        placement = { fenced = [2, 3] }
    "#;
    let config = TopologyConfig::from_toml(text).unwrap();
    assert_eq!(config.on_shared_cpu, OnSharedCpu::Error);
    let e = config.validate_for(&cpus(4)).unwrap_err();
    match &e {
        TopologyError::SpinnerSharesCpu {
            field,
            poller,
            mode,
            cpus,
            shares_with,
        } => {
            assert_eq!(field, "poller[0].placement");
            assert_eq!(poller, "rx");
            assert_eq!(*mode, "busy");
            assert_eq!(cpus, &BTreeSet::from([3]));
            assert_eq!(shares_with, "pool \"io\" at pool[0].placement");
        }
        other => panic!("wanted SpinnerSharesCpu, got {other:?}"),
    }
    assert_eq!(
        e.to_string(),
        "poller[0].placement: busy poller \"rx\" may share CPU 3 with pool \"io\" at \
         pool[0].placement (on_shared_cpu = \"error\")"
    );
    // The default warns and accepts the same topology.
    let relaxed = TopologyConfig {
        on_shared_cpu: OnSharedCpu::default(),
        ..config
    };
    let topology = relaxed.validate_for(&cpus(4)).unwrap();
    assert!(matches!(
        topology.warnings(),
        [Warning::SpinnerSharesCpu { .. }]
    ));
    // And a config that writes neither reads back as the default.
    let config = TopologyConfig::from_toml("[[pool]]\nname = \"io\"\nthreads = 1\n").unwrap();
    assert_eq!(config.on_shared_cpu, OnSharedCpu::Warn);
}

#[test]
fn spinning_workers_are_read_and_warned_about_like_spinning_pollers() {
    let text = r#"
        [[poller]]
        name = "rx"
        cqs = ["rx0"]
        placement = { fixed = 1 }
        mode = { kind = "event" }

        [[pool]]
        name = "hot"
        threads = 2
        idle = "spin"
        placement = { fenced = [2, 3] }

        [[pool]]
        name = "crowd"
        threads = 3
        idle = "spin"
        placement = { fenced = [1, 4] }
    "#;
    let config = TopologyConfig::from_toml(text).unwrap();
    assert_eq!(config.pools[0].idle, WorkerIdle::Spin);
    assert_eq!(
        config.pools[0],
        PoolConfig::new("hot", 2)
            .idle(WorkerIdle::Spin)
            .placement(Placement::fenced([2, 3]))
    );
    // Written back, the field survives; a parking pool does not write it.
    let back = TopologyConfig::from_toml(&config.to_toml().unwrap()).unwrap();
    assert_eq!(back, config);
    assert!(!TopologyConfig::new()
        .pool(PoolConfig::new("p", 1))
        .to_toml()
        .unwrap()
        .contains("idle"));

    let topology = config.validate_for(&cpus(5)).unwrap();
    let w = |cpus: &[usize], with: &str| Warning::SpinningWorkersShareCpu {
        field: "pool[1].placement".into(),
        pool: "crowd".into(),
        cpus: cpus.iter().copied().collect(),
        shares_with: with.into(),
    };
    // "hot" has a CPU per worker and shares with nobody; "crowd" has three
    // workers for two CPUs and overlaps the poller on CPU 1.
    assert_eq!(
        topology.warnings(),
        [
            w(&[1, 4], "each other (3 workers)"),
            w(&[1], "poller \"rx\" at poller[0].placement"),
        ]
    );
    assert_eq!(
        topology.warnings()[1].to_string(),
        "pool[1].placement: spinning workers of pool \"crowd\" may share CPU 1 with poller \
         \"rx\" at poller[0].placement; they never give their CPU away"
    );

    // An unpinned spinning pool may run anywhere the other pool does.
    let config = TopologyConfig::new()
        .pool(PoolConfig::new("a", 1).idle(WorkerIdle::Spin))
        .pool(PoolConfig::new("b", 1).placement(Placement::Fixed(0)));
    let topology = config.validate_for(&cpus(2)).unwrap();
    assert!(matches!(
        topology.warnings(),
        [Warning::SpinningWorkersShareCpu { pool, shares_with, .. }]
            if pool == "a" && shares_with == "pool \"b\" at pool[1].placement"
    ));
    // on_shared_cpu = "error" refuses it.
    let e = config
        .on_shared_cpu(OnSharedCpu::Error)
        .validate_for(&cpus(2))
        .unwrap_err();
    assert!(
        matches!(&e, TopologyError::SpinningWorkersShareCpu { field, .. } if field == "pool[0].placement"),
        "{e:?}"
    );
}

/// A pool's parking workers spin briefly before they back off only when
/// its CPUs are its own: a CPU per worker, and no poller or other pool
/// that may run there (an unpinned placement may run anywhere).
#[test]
fn a_pool_has_cpus_of_its_own_only_when_nothing_else_may_run_there() {
    let own = |config: TopologyConfig| {
        config
            .validate_for(&cpus(4))
            .unwrap()
            .take_pool("io")
            .unwrap()
            .has_own_cpus()
    };
    let poller = |cpu: Option<usize>| {
        let p = PollerConfig::new("p").cq("cq");
        match cpu {
            Some(c) => p.placement(Placement::Fixed(c)),
            None => p,
        }
    };
    let pool =
        |placement: Placement, threads: usize| PoolConfig::new("io", threads).placement(placement);
    // Alone, unpinned: every CPU is its own.
    assert!(own(TopologyConfig::new().pool(pool(Placement::Unpinned, 2))));
    // Unpinned beside a poller: the poller may run anywhere it does.
    assert!(!own(TopologyConfig::new()
        .poller(poller(None))
        .pool(pool(Placement::Unpinned, 1))));
    // Fenced apart from the poller: its own.
    assert!(own(TopologyConfig::new()
        .poller(poller(Some(0)))
        .pool(pool(Placement::Fixed(1), 1))));
    // On the poller's CPU: shared.
    assert!(!own(TopologyConfig::new()
        .poller(poller(Some(1)))
        .pool(pool(Placement::Fixed(1), 1))));
    // Fenced apart but unpinned poller: shared.
    assert!(!own(TopologyConfig::new()
        .poller(poller(None))
        .pool(pool(Placement::Fixed(1), 1))));
    // Two workers on one CPU: they would take turns.
    assert!(!own(TopologyConfig::new()
        .poller(poller(Some(0)))
        .pool(pool(Placement::Fixed(1), 2))));
    // Another pool on its CPUs.
    assert!(!own(TopologyConfig::new()
        .pool(pool(Placement::Fixed(1), 1))
        .pool(PoolConfig::new("bg", 1).placement(Placement::Fixed(1)))));
}

#[test]
fn a_poller_naming_a_pool_that_does_not_exist_is_rejected() {
    let e = TopologyConfig::new()
        .poller(poller("net", "cq0").pool("oi"))
        .pool(PoolConfig::new("io", 1))
        .validate_for(&cpus(4))
        .unwrap_err();
    assert!(
        matches!(&e, TopologyError::UnknownPool { field, poller, pool }
            if field == "poller[0].pool" && poller == "net" && pool == "oi"),
        "{e:?}"
    );
}

#[test]
fn a_pools_feeds_go_to_the_pollers_that_name_it_once_each() {
    let mut topology = TopologyConfig::new()
        .poller(poller("a", "a0").pool("io"))
        .poller(poller("b", "b0").pool("io"))
        .poller(poller("c", "c0").pool("bg"))
        .poller(poller("d", "d0"))
        .pool(PoolConfig::new("io", 1))
        .pool(PoolConfig::new("bg", 1))
        .validate_for(&cpus(4))
        .unwrap();
    let (pool, mut feeds) = topology
        .take_pool("io")
        .unwrap()
        .spawn_feeds(|_| |_: u32| {})
        .unwrap();
    assert_eq!(feeds.pool(), "io");
    let a = topology.take_poller("a").unwrap();
    let c = topology.take_poller("c").unwrap();
    let d = topology.take_poller("d").unwrap();
    let sink_a = feeds.take(&a).unwrap();
    let again = feeds.take(&a).unwrap_err().to_string();
    assert!(again.contains("already"), "{again}");
    let other = feeds.take(&c).unwrap_err().to_string();
    assert!(
        other.contains("\"bg\"") && other.contains("\"io\""),
        "{other}"
    );
    let none = feeds.take(&d).unwrap_err().to_string();
    assert!(none.contains("names no pool"), "{none}");
    // Two producers, derived: b's feed is still there, untaken.
    assert!(format!("{feeds:?}").contains("\"b\""), "{feeds:?}");
    drop((sink_a, feeds));
    pool.join().unwrap();

    let lonely = topology
        .take_pool("bg")
        .unwrap()
        .spawn_feeds(|_| |_: u32| {})
        .map(|_| ());
    assert!(lonely.is_ok(), "c feeds bg");
    let mut t = TopologyConfig::new()
        .poller(poller("x", "x0"))
        .pool(PoolConfig::new("idle", 1))
        .validate_for(&cpus(4))
        .unwrap();
    let e = t
        .take_pool("idle")
        .unwrap()
        .spawn_feeds(|_| |_: u32| {})
        .map(|_| ())
        .unwrap_err();
    assert!(e.to_string().contains("nothing feeds it"), "{e}");
}

/// A `[[cq_pool]]`: its pollers may own no CQ of their own (they start
/// empty); it names only pollers the topology has, each once; its sizes
/// make sense. The file form and the builder are the same, and the plan
/// carries what the file says.
#[test]
fn a_cq_pool_names_its_pollers_which_may_start_empty() {
    let text = r#"
        [[poller]]
        name = "p0"
        cqs = []
        mode = { kind = "event", timeout_ms = 100 }

        [[poller]]
        name = "p1"
        cqs = ["fixed"]

        [[cq_pool]]
        name = "conns"
        cqe = 4096
        pollers = ["p0", "p1"]
        fit = "first"
        max_cqs = 16
        resize_up_to = 16384
    "#;
    let from_file = TopologyConfig::from_toml(text).unwrap();
    let from_code = TopologyConfig::new()
        .poller(PollerConfig::new("p0").mode(ModeConfig::Event { timeout_ms: 100 }))
        .poller(poller("p1", "fixed"))
        .cq_pool(
            CqPoolConfig::new("conns", 4096, ["p0", "p1"])
                .fit(FitConfig::First)
                .max_cqs(16)
                .resize_up_to(16384),
        );
    assert_eq!(from_file, from_code);
    assert_eq!(
        TopologyConfig::from_toml(&from_file.to_toml().unwrap()).unwrap(),
        from_file
    );
    let mut t = from_file.validate_for(&cpus(4)).unwrap();
    let plan = t.take_cq_pool("conns").unwrap();
    assert_eq!(plan.pollers(), ["p0", "p1"]);
    assert_eq!(plan.config().resize_up_to, Some(16384));
    assert!(t.take_cq_pool("conns").is_none(), "taken once");

    let check = |config: TopologyConfig, want: &str| {
        let e = config.validate_for(&cpus(4)).unwrap_err();
        assert!(e.to_string().starts_with(want), "{e} (wanted {want})");
    };
    // An empty poller no pool names.
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .poller(PollerConfig::new("p1"))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0"])),
        "poller[1].cqs",
    );
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0", "nobody"])),
        "cq_pool[0].pollers[1]: CQ pool c names poller nobody",
    );
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0", "p0"])),
        "cq_pool[0].pollers[1]",
    );
    check(
        TopologyConfig::new()
            .poller(poller("p0", "x"))
            .cq_pool(CqPoolConfig::new("c", 64, Vec::<String>::new())),
        "cq_pool[0].pollers",
    );
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .cq_pool(CqPoolConfig::new("c", 0, ["p0"])),
        "cq_pool[0].cqe",
    );
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0"]).resize_up_to(32)),
        "cq_pool[0].resize_up_to",
    );
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0"]).max_cqs(0)),
        "cq_pool[0].max_cqs",
    );
    check(
        TopologyConfig::new()
            .poller(PollerConfig::new("p0"))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0"]))
            .cq_pool(CqPoolConfig::new("c", 64, ["p0"])),
        "cq_pool[1].name",
    );
}
