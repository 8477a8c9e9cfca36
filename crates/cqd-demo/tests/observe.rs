//! The observability flags, on the binary: `--prometheus` (scraped over a
//! raw HTTP GET while the run goes on; refused with the feature's name in
//! a build without it; a bad address or a port in use is an error) and
//! `--trace-completions` (one trace line per completion with the flag,
//! none without).
#![allow(missing_docs)]

#[cfg(feature = "prometheus")]
use std::io::{Read, Write};
#[cfg(feature = "prometheus")]
use std::net::{TcpListener, TcpStream};
#[cfg(feature = "prometheus")]
use std::time::Instant;
mod common;
use common::{demo, finish, text};
use std::process::Output;
use std::time::Duration;

fn run(args: &[&str], rust_log: &str) -> Output {
    let child = demo(args, rust_log).spawn().expect("the binary starts");
    finish(child, "cqd-demo", Duration::from_secs(120))
}

/// A port nothing listens on now: bound to :0, then closed.
#[cfg(feature = "prometheus")]
fn free_port() -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind :0");
    l.local_addr().expect("local addr").port()
}

/// `GET /metrics` over a raw TCP stream: the body, or `None` if nothing
/// answers (yet).
#[cfg(feature = "prometheus")]
fn scrape(port: u16) -> Option<String> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    let (head, body) = raw.split_once("\r\n\r\n")?;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    Some(body.to_string())
}

/// The value of the sample whose name and labels are exactly `series`.
#[cfg(feature = "prometheus")]
fn value(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(feature = "prometheus")]
#[test]
fn prometheus_endpoint_serves_cqd_and_demo_metrics_during_the_run() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let child = demo(
        &[
            "--prometheus",
            &addr,
            "--duration",
            "4s",
            "--quick",
            "--no-progress",
        ],
        "error",
    )
    .spawn()
    .expect("the binary starts");
    // Scrape while it runs until the server CQ's completions are there.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = String::new();
    let body = loop {
        if let Some(body) = scrape(port) {
            if value(&body, r#"cqd_cq_completions_total{cq="srv0-0"}"#).is_some_and(|v| v > 0.0)
                && value(&body, r#"cqd_demo_ops_total{op="read"}"#).is_some_and(|v| v > 0.0)
            {
                break body;
            }
            last = body;
        }
        assert!(
            Instant::now() < deadline,
            "no positive cqd_cq_completions_total{{cq=\"srv0-0\"}} and cqd_demo_ops_total \
             within 60 s; last body:\n{last}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let out = finish(child, "cqd-demo --prometheus", Duration::from_secs(120));
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // Every kind of object of the run, and the demo's own.
    for series in [
        r#"cqd_cq_completions_total{cq="load0"}"#,
        r#"cqd_pool_workers{pool="io"}"#,
        r#"cqd_demo_failures_total"#,
        r#"cqd_demo_ops_total{op="write"}"#,
    ] {
        assert!(value(&body, series).is_some(), "{series} missing:\n{body}");
    }
    assert!(body.contains("cqd_poller_loops_total{poller="), "{body}");
    assert!(
        body.contains("# TYPE cqd_demo_latency_seconds histogram"),
        "{body}"
    );
    let count = body
        .lines()
        .find_map(|l| l.strip_prefix(r#"cqd_demo_latency_seconds_count{op="read"} "#))
        .and_then(|v| v.trim().parse::<u64>().ok());
    assert!(count.is_some_and(|n| n > 0), "{body}");
    assert_eq!(value(&body, "cqd_demo_failures_total"), Some(0.0));
}

#[cfg(feature = "prometheus")]
#[test]
fn prometheus_bad_address_or_port_in_use_is_a_clear_error() {
    let out = run(&["--prometheus", "not-an-address", "--ops", "10"], "error");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("--prometheus \"not-an-address\""), "{err}");
    assert!(err.contains("HOST:PORT"), "{err}");

    let taken = TcpListener::bind("127.0.0.1:0").expect("bind :0");
    let addr = taken.local_addr().expect("local addr").to_string();
    let out = run(&["--prometheus", &addr, "--ops", "10"], "error");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("cannot listen there"), "{err}");
    assert!(!text(&out.stdout).contains("verdict"), "no run without it");
    assert!(!err.contains("panicked"), "{err}");
}

#[cfg(not(feature = "prometheus"))]
#[test]
fn prometheus_without_the_feature_names_the_feature() {
    let out = run(&["--prometheus", "127.0.0.1:9464", "--ops", "10"], "error");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("`prometheus` cargo feature"), "{err}");
    assert!(err.contains("--features prometheus"), "{err}");
    assert!(!text(&out.stdout).contains("verdict"));
}

/// A tiny run: 10 requests on one connection, a 32-block device to read
/// back.
const TINY: &[&str] = &[
    "--ops",
    "10",
    "--connections",
    "1",
    "--qd",
    "4",
    "--device-size",
    "128KiB",
    "--no-progress",
];

/// stderr's trace lines of completions.
fn completion_lines(err: &str) -> Vec<&str> {
    err.lines()
        .filter(|l| l.contains("cqd_core::cq::dispatch") && l.contains(" completion "))
        .collect()
}

#[test]
fn trace_completions_traces_every_completion_only_when_asked() {
    let mut args = TINY.to_vec();
    args.push("--trace-completions");
    let out = run(&args, "cqd_core=trace,cqd_demo=debug");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let lines = completion_lines(&err);
    // 10 requests and 32 read-backs, each a SEND, its receive and a reply.
    assert!(lines.len() >= 42, "{} lines:\n{err}", lines.len());
    for l in &lines {
        for field in ["cq=", "wr_id=0x", "status=", "opcode=", "qp="] {
            assert!(l.contains(field), "{field} missing: {l}");
        }
    }
    assert!(lines.iter().any(|l| l.contains("cq=srv0")), "{err}");
    assert!(lines.iter().any(|l| l.contains("cq=load0")), "{err}");
    assert!(lines.iter().any(|l| l.contains("status=success")), "{err}");
    // The demo names each handler's slot and generation (the wr_id's).
    assert!(err.contains("handler registered"), "{err}");

    let out = run(TINY, "cqd_core=trace");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert_eq!(
        completion_lines(&err),
        Vec::<&str>::new(),
        "without the flag"
    );
}
