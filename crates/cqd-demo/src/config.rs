//! The command line and the checks of its combinations.

use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};

use crate::DemoError;

/// The transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The simulated NIC (cqd-sim): servers and load in this process.
    Sim,
    /// Real RDMA through cqd-verbs (cargo feature `verbs`): one process
    /// on one device, or `serve` / `load` as separate processes.
    Verbs,
}

/// How `serve` and `load` connect their queue pairs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CmKind {
    /// Endpoints (LID, GID, QPN, PSN) exchanged over the TCP session.
    #[default]
    Tcp,
    /// Through the RDMA connection manager (librdmacm), as NVMe over
    /// Fabrics connects: the server listens on its `--listen` address.
    Rdmacm,
}

/// How the load exposes its data buffers to the servers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ExposureKind {
    /// A type-2 memory window per request over that request's buffer
    /// alone, invalidated at its reply (where the device has them; else as
    /// `keys`).
    #[default]
    Windows,
    /// Each slot's data buffer, a region of its own, by its key for the
    /// whole run.
    Keys,
}

/// What the process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Command {
    /// Servers and load in this process (the default).
    Run,
    /// One block server, waiting for one `load` session over TCP (verbs).
    Serve,
    /// The load generator against `serve` processes (`--server`, verbs).
    Load,
}

/// The message for `--backend verbs` in a build without the feature.
pub const NO_VERBS: &str = "this cqd-demo was built without the `verbs` cargo feature, so \
     --backend verbs, serve and load are not available; rebuild with \
     `cargo build --release -p cqd-demo --features verbs` (it needs rdma-core's headers and \
     libclang: on Debian, apt-get install libibverbs-dev librdmacm-dev libclang-dev pkg-config)";

/// The message for `--prometheus` in a build without the feature.
pub const NO_PROMETHEUS: &str = "this cqd-demo was built without the `prometheus` cargo feature, \
     so --prometheus is not available; rebuild with \
     `cargo build --release -p cqd-demo --features prometheus`";

/// The port `serve` listens on by default.
pub const DEFAULT_PORT: u16 = 18520;

/// A poll mode, from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeArg {
    /// Spin.
    Busy,
    /// Sleep on completion events.
    Event,
    /// Spin 50 µs after the last completion, then sleep.
    Hybrid,
    /// Spin for a window that follows the traffic, then sleep.
    Adaptive,
}

impl ModeArg {
    /// Every mode, in table order.
    pub const ALL: [ModeArg; 4] = [
        ModeArg::Busy,
        ModeArg::Event,
        ModeArg::Hybrid,
        ModeArg::Adaptive,
    ];

    /// The mode's name.
    pub fn name(self) -> &'static str {
        match self {
            ModeArg::Busy => "busy",
            ModeArg::Event => "event",
            ModeArg::Hybrid => "hybrid",
            ModeArg::Adaptive => "adaptive",
        }
    }
}

/// A block-storage server and its load generator on cqd. The bare command
/// runs about ten seconds of mixed load on the simulated NIC, in one
/// process, and prints a report with two verdicts. `serve` and `load` run
/// the two halves as separate processes over real RDMA (docs/demo.md).
#[derive(Debug, Clone, Parser)]
#[command(name = "cqd-demo", version)]
pub struct Args {
    /// run (default): both halves here; serve: one block server for one
    /// load session; load: the load generator against `--server`s.
    #[arg(value_enum)]
    pub command: Option<Command>,
    /// Transport [default: sim for run, verbs for serve and load].
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    /// The RDMA device (verbs) [default: the first one listed].
    #[arg(long, value_name = "NAME")]
    pub device: Option<String>,
    /// The device's port (verbs) [default: 1].
    #[arg(long)]
    pub ib_port: Option<u8>,
    /// GID index for a global route (verbs; RoCE needs one).
    #[arg(long)]
    pub gid_index: Option<u8>,
    /// Transport retries of every RC queue pair, 0-7 (verbs; through
    /// rdma_cm the load's sets both sides) [default: 7, cqd-verbs'
    /// default]. The kernel's rxe retries for ever at 7: give 6 or less to
    /// see RETRY_EXC_ERR when a peer goes silent.
    #[arg(long, value_name = "N")]
    pub retry_cnt: Option<u8>,
    /// serve: the TCP address to listen on for the load's handshake
    /// [default: 127.0.0.1:18520 — loopback; give the address of the
    /// interface loads come from, e.g. 0.0.0.0:18520, to serve other
    /// machines].
    #[arg(long, value_name = "ADDR:PORT")]
    pub listen: Option<String>,
    /// serve/load: a file holding a shared secret (16 to 4,096 bytes; no
    /// access for group or others: `chmod 600 FILE`): the server admits
    /// only loads that prove they know it, and a load joins only servers
    /// that prove it back (docs/demo.md, "Trust and exposure") [default:
    /// none — any load that reaches the port joins].
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// serve/load: how the queue pairs connect: `tcp` (endpoints in the
    /// TCP session) or `rdmacm` (through rdma_cm, on the server's
    /// `--listen` address) [default: tcp].
    #[arg(long, value_enum, value_name = "HOW")]
    pub cm: Option<CmKind>,
    /// load: how the servers reach the load's data buffers: `windows` (a
    /// memory window per request, where the device has type-2 windows) or
    /// `keys` (each buffer's region key for the whole run) [default:
    /// windows]. See docs/demo.md, "Trust and exposure".
    #[arg(long, value_enum, value_name = "HOW")]
    pub exposure: Option<ExposureKind>,
    /// load: a server's TCP address (repeat for several; blocks are
    /// striped over them).
    #[arg(long = "server", value_name = "HOST:PORT")]
    pub server_addrs: Vec<String>,
    /// serve: give up (exit 1) if no load session starts within this time
    /// [default: wait for ever].
    #[arg(long, value_parser = parse_duration)]
    pub accept_timeout: Option<Duration>,
    /// serve/load: the one deadline of each handshake, from the TCP
    /// connection to the last queue pair connected [default: 30s].
    #[arg(long, value_parser = parse_duration)]
    pub handshake_timeout: Option<Duration>,
    /// Thread layout (TOML, docs/topology.md); default: the built-in copy
    /// of examples/demo-topology.toml.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,
    /// Servers, each with its own device, CQ and connections; blocks are
    /// striped over them [default: 1; load: one per --server].
    #[arg(long)]
    pub servers: Option<u32>,
    /// Connections in all, spread over the servers (serve: the most it
    /// accepts).
    #[arg(long, default_value_t = 4)]
    pub connections: u32,
    /// Requests in flight per connection (serve: the deepest it accepts).
    #[arg(long, default_value_t = 16)]
    pub qd: u32,
    /// Percentage of reads.
    #[arg(long, default_value_t = 70)]
    pub read_pct: u32,
    /// Block size (bytes; k, KiB, M, MiB suffixes).
    #[arg(long, default_value = "4KiB", value_parser = parse_size)]
    pub block_size: u64,
    /// Device size of each server [default: 64MiB, 16MiB with --quick].
    #[arg(long, value_parser = parse_size)]
    pub device_size: Option<u64>,
    /// How long the load runs (e.g. 10s, 500ms, 1m) [default: 10s, 2s with
    /// --quick, 2.5s per mode with --compare-modes].
    #[arg(long, value_parser = parse_duration)]
    pub duration: Option<Duration>,
    /// Stop after this many requests instead of a duration.
    #[arg(long, conflicts_with = "duration")]
    pub ops: Option<u64>,
    /// A short run for CI: 2 s, 16 MiB devices (explicit flags win).
    #[arg(long)]
    pub quick: bool,
    /// Poll mode of every poller (default: the topology's).
    #[arg(long, value_enum)]
    pub mode: Option<ModeArg>,
    /// Run each mode in turn and print one table.
    #[arg(long, conflicts_with = "mode")]
    pub compare_modes: bool,
    /// Worker threads of the server pool (default: the topology's).
    #[arg(long)]
    pub workers: Option<usize>,
    /// A baseline for benchmarks, not a way to run: serve with the naive
    /// completion loop (two threads polling each CQ under a mutex, one
    /// completion per poll, a channel send per completion, a re-arm per
    /// event; see `cqd_demo::naive`) instead of cqd's pollers and pool.
    /// One-process runs only.
    #[arg(long)]
    pub naive_server: bool,
    /// Close and reopen connections during the load, RATE a second (the
    /// oldest first): each stops taking new requests, finishes those in
    /// flight, closes on both sides while the others run, and a new one
    /// to the same server takes its place. The report gives the closes a
    /// second reached and the other connections' latency meanwhile.
    /// One-process runs of cqd's server, and `load` with `--cm tcp`.
    #[arg(long, value_name = "RATE")]
    pub churn: Option<f64>,
    /// A request older than this fails its connection.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub op_timeout: Duration,
    /// How long each poller's stop waits for outstanding requests (a
    /// longer wait is reported as unbalanced accounts).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub drain_timeout: Duration,
    /// Simulated NIC: chance per executed request of a transport error.
    #[arg(long, default_value_t = 0.0)]
    pub fault_rate: f64,
    /// Seed of the block choice, the data patterns and the faults.
    #[arg(long, default_value_t = 0x5eed)]
    pub seed: u64,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// No progress bar (it is hidden anyway when stdout is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// Serve cqd's metrics (every CQ, poller and pool) and the demo's own
    /// on a Prometheus endpoint, `http://ADDR/metrics` (cargo feature
    /// `prometheus`).
    #[arg(long, value_name = "ADDR:PORT")]
    pub prometheus: Option<String>,
    /// Trace every completion of every CQ (`CqOptions::trace_completions`):
    /// shown with RUST_LOG=cqd_core=trace.
    #[arg(long)]
    pub trace_completions: bool,
}

/// When the load stops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Stop {
    /// After a duration.
    After(#[serde(with = "secs")] Duration),
    /// After a number of requests.
    Ops(u64),
}

mod secs {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

/// A checked configuration.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Config {
    /// What the process is.
    pub command: Command,
    /// Transport.
    pub backend: BackendKind,
    /// The RDMA device (verbs; None: the first).
    pub device: Option<String>,
    /// The device's port (verbs).
    pub ib_port: Option<u8>,
    /// GID index (verbs).
    pub gid_index: Option<u8>,
    /// Transport retries of the RC queue pairs (verbs; None: cqd-verbs'
    /// default).
    pub retry_cnt: Option<u8>,
    /// serve: where to listen.
    pub listen: String,
    /// How the queue pairs connect (serve/load).
    pub cm: CmKind,
    /// How the load exposes its data buffers.
    pub exposure: ExposureKind,
    /// The handshake's shared secret (serve/load; `--secret-file`).
    #[serde(skip)]
    pub secret: Option<crate::auth::Secret>,
    /// load: the servers' addresses.
    pub server_addrs: Vec<String>,
    /// serve: how long to wait for a load session.
    #[serde(skip)]
    pub accept_timeout: Option<Duration>,
    /// serve/load: the one deadline of each handshake.
    #[serde(skip)]
    pub handshake_timeout: Duration,
    /// Servers.
    pub servers: u32,
    /// Connections in all.
    pub connections: u32,
    /// Queue depth per connection.
    pub qd: u32,
    /// Percentage of reads.
    pub read_pct: u32,
    /// Block size.
    pub block_size: u32,
    /// Device size per server.
    pub device_size: u64,
    /// Blocks per server.
    pub blocks_per_server: u64,
    /// When the load stops.
    pub stop: Stop,
    /// Mode override.
    pub mode: Option<ModeArg>,
    /// Worker override.
    pub workers: Option<usize>,
    /// Serve with the naive completion loop (`--naive-server`).
    pub naive_server: bool,
    /// Request timeout.
    #[serde(with = "secs")]
    pub op_timeout: Duration,
    /// Pollers' drain timeout at the stop.
    #[serde(with = "secs")]
    pub drain_timeout: Duration,
    /// Simulated transport error rate.
    pub fault_rate: f64,
    /// Seed.
    pub seed: u64,
    /// Topology file (None: built in).
    pub topology: Option<PathBuf>,
    /// Show the progress bar (when stdout is a terminal).
    pub progress: bool,
    /// Where to serve the Prometheus endpoint (`--prometheus`).
    pub prometheus: Option<SocketAddr>,
    /// Trace every completion of every CQ.
    pub trace_completions: bool,
    /// Connections closed and reopened a second during the load
    /// (`--churn`).
    pub churn: Option<f64>,
}

/// The most memory the devices of one run may take.
pub const MAX_TOTAL_DEVICE: u64 = 8 << 30;
/// The largest device the simulated NIC registers.
pub const MAX_DEVICE: u64 = 4 << 30;

impl Args {
    /// Checks every value and combination.
    ///
    /// # Errors
    /// [`DemoError::Config`] naming the flag and what would work.
    pub fn check(&self) -> Result<Config, DemoError> {
        let bad = |m: String| Err(DemoError::Config(m));
        let command = self.command.unwrap_or(Command::Run);
        let backend = match (command, self.backend) {
            (Command::Run, b) => b.unwrap_or(BackendKind::Sim),
            (_, Some(BackendKind::Sim)) => {
                return bad(format!(
                    "{} runs over --backend verbs only (the simulated NIC lives in one process: \
                     run without a command for it)",
                    command_name(command)
                ))
            }
            (_, _) => BackendKind::Verbs,
        };
        if self.naive_server && command != Command::Run {
            return bad(
                "--naive-server is for one-process runs (no command), the benchmark baseline"
                    .into(),
            );
        }
        if let Some(rate) = self.churn {
            let rdmacm = self.cm == Some(CmKind::Rdmacm);
            let fits = match command {
                Command::Run => !self.naive_server,
                Command::Load => !rdmacm,
                Command::Serve => false,
            };
            if !fits {
                return bad(
                    "--churn is for a one-process run of cqd's server, or for `load` with --cm tcp \
                     (the server follows the load's reconnects; the naive baseline closes no \
                     connection, and rdma_cm's connections are made once per session)"
                        .into(),
                );
            }
            if !(rate.is_finite() && rate > 0.0 && rate <= 100_000.0) {
                return bad(format!(
                    "--churn {rate}: give the closes a second, more than 0 and at most 100000"
                ));
            }
        }
        if backend == BackendKind::Verbs && !cfg!(feature = "verbs") {
            return bad(NO_VERBS.into());
        }
        let prometheus = match &self.prometheus {
            None => None,
            Some(_) if !cfg!(feature = "prometheus") => return bad(NO_PROMETHEUS.into()),
            Some(a) => Some(parse_addr(a)?),
        };
        if backend == BackendKind::Sim {
            for (flag, given) in [
                ("--device", self.device.is_some()),
                ("--ib-port", self.ib_port.is_some()),
                ("--gid-index", self.gid_index.is_some()),
                ("--retry-cnt", self.retry_cnt.is_some()),
            ] {
                if given {
                    return bad(format!("{flag} is for --backend verbs"));
                }
            }
        } else if self.fault_rate != 0.0 {
            return bad(
                "--fault-rate injects errors in the simulated NIC: it needs --backend sim".into(),
            );
        }
        if let Some(n) = self.retry_cnt.filter(|&n| n > 7) {
            return bad(format!(
                "--retry-cnt {n}: the transport retry count is 0 to 7"
            ));
        }
        if command != Command::Serve && (self.listen.is_some() || self.accept_timeout.is_some()) {
            return bad("--listen and --accept-timeout are for `serve`".into());
        }
        if self.secret_file.is_some() && !matches!(command, Command::Serve | Command::Load) {
            return bad("--secret-file is for `serve` and `load`".into());
        }
        if self.handshake_timeout.is_some() && !matches!(command, Command::Serve | Command::Load) {
            return bad("--handshake-timeout is for `serve` and `load`".into());
        }
        if self.handshake_timeout.is_some_and(|t| t.is_zero()) {
            return bad("--handshake-timeout 0: give a deadline longer than zero".into());
        }
        let secret = match &self.secret_file {
            Some(path) => Some(crate::auth::Secret::from_file(path)?),
            None => None,
        };
        if self.cm.is_some() && !matches!(command, Command::Serve | Command::Load) {
            return bad("--cm is for `serve` and `load`".into());
        }
        if command != Command::Load && !self.server_addrs.is_empty() {
            return bad("--server is for `load` (the address of a `serve` process)".into());
        }
        if command != Command::Run && self.compare_modes {
            return bad("--compare-modes runs in one process: no serve/load".into());
        }
        let servers = match command {
            Command::Load => {
                if self.servers.is_some() {
                    return bad(
                        "load takes its servers from --server (one per server), not --servers"
                            .into(),
                    );
                }
                if self.device_size.is_some() {
                    return bad(
                        "--device-size is the server's (serve --device-size); the load learns it \
                         in the handshake"
                            .into(),
                    );
                }
                if self.server_addrs.is_empty() {
                    return bad("load needs at least one --server HOST:PORT".into());
                }
                self.server_addrs.len() as u32
            }
            Command::Serve => {
                if self.servers.is_some_and(|s| s != 1) {
                    return bad("a serve process is one server: start one per server".into());
                }
                if self.ops.is_some() || self.duration.is_some() {
                    return bad("--ops and --duration are the load's (load --duration …)".into());
                }
                1
            }
            Command::Run => self.servers.unwrap_or(1),
        };
        if !(1..=16).contains(&servers) {
            return bad(format!("--servers {servers}: must be 1 to 16"));
        }
        if !(1..=256).contains(&self.connections) {
            return bad(format!(
                "--connections {}: must be 1 to 256",
                self.connections
            ));
        }
        if self.connections < servers {
            return bad(format!(
                "--connections {} is fewer than the {servers} servers: every server needs a connection",
                self.connections
            ));
        }
        if !(1..=1024).contains(&self.qd) {
            return bad(format!("--qd {}: must be 1 to 1024", self.qd));
        }
        if self.read_pct > 100 {
            return bad(format!("--read-pct {}: must be 0 to 100", self.read_pct));
        }
        let bs = self.block_size;
        if !(512..=(1 << 20)).contains(&bs) || bs % 512 != 0 {
            return bad(format!(
                "--block-size {bs}: must be a multiple of 512 from 512 B to 1 MiB"
            ));
        }
        let device = match (self.device_size, self.quick) {
            (Some(d), _) => d,
            (None, true) => 16 << 20,
            (None, false) => 64 << 20,
        };
        let device = if command == Command::Load {
            // Learnt in the handshake (crate::net).
            0
        } else {
            device
        };
        if command != Command::Load && (device < bs || device % bs != 0) {
            return bad(format!(
                "--device-size {device} is not a whole number of {bs}-byte blocks"
            ));
        }
        if device > MAX_DEVICE {
            return bad(format!(
                "--device-size {device}: the simulated NIC registers at most {MAX_DEVICE} bytes"
            ));
        }
        let total = device.saturating_mul(u64::from(servers));
        if total > MAX_TOTAL_DEVICE {
            return bad(format!(
                "{servers} servers of {device} bytes need {total} bytes of memory; at most {MAX_TOTAL_DEVICE}"
            ));
        }
        let blocks = device / bs;
        if command != Command::Load {
            check_blocks(blocks, servers, self.connections, self.qd, bs as u32)?;
        }
        if !(0.0..1.0).contains(&self.fault_rate) {
            return bad(format!(
                "--fault-rate {}: must be in [0, 1)",
                self.fault_rate
            ));
        }
        if self.op_timeout < Duration::from_millis(10) {
            return bad(format!("--op-timeout {:?}: at least 10ms", self.op_timeout));
        }
        if self.drain_timeout < Duration::from_millis(10) {
            return bad(format!(
                "--drain-timeout {:?}: at least 10ms",
                self.drain_timeout
            ));
        }
        if self.workers == Some(0) {
            return bad("--workers 0: the server needs at least one worker".into());
        }
        let stop = match (self.ops, self.duration) {
            (Some(0), _) => return bad("--ops 0: at least one request".into()),
            (Some(n), _) => Stop::Ops(n),
            (None, Some(d)) if d.is_zero() => return bad("--duration 0: must be positive".into()),
            (None, Some(d)) => Stop::After(d),
            (None, None) if self.quick => Stop::After(Duration::from_secs(2)),
            (None, None) if self.compare_modes => Stop::After(Duration::from_millis(2500)),
            (None, None) => Stop::After(Duration::from_secs(10)),
        };
        Ok(Config {
            command,
            backend,
            device: self.device.clone(),
            ib_port: self.ib_port,
            gid_index: self.gid_index,
            retry_cnt: self.retry_cnt,
            listen: self
                .listen
                .clone()
                .unwrap_or_else(|| format!("127.0.0.1:{DEFAULT_PORT}")),
            server_addrs: self.server_addrs.clone(),
            cm: self.cm.unwrap_or_default(),
            exposure: self.exposure.unwrap_or_default(),
            secret,
            accept_timeout: self.accept_timeout,
            handshake_timeout: self
                .handshake_timeout
                .unwrap_or(crate::net::HANDSHAKE_TIMEOUT),
            servers,
            connections: self.connections,
            qd: self.qd,
            read_pct: self.read_pct,
            block_size: bs as u32,
            device_size: device,
            blocks_per_server: blocks,
            stop,
            mode: self.mode,
            workers: self.workers,
            naive_server: self.naive_server,
            churn: self.churn,
            op_timeout: self.op_timeout,
            drain_timeout: self.drain_timeout,
            fault_rate: self.fault_rate,
            seed: self.seed,
            topology: self.topology.clone(),
            progress: !self.no_progress,
            prometheus,
            trace_completions: self.trace_completions,
        })
    }
}

fn command_name(c: Command) -> &'static str {
    match c {
        Command::Run => "run",
        Command::Serve => "serve",
        Command::Load => "load",
    }
}

/// Checks that `blocks` per server can keep every request in flight on a
/// block of its own (connections are spread round-robin over `servers`; a
/// new request must find a free block quickly: twice as many blocks).
///
/// # Errors
/// [`DemoError::Config`] with the way out.
pub fn check_blocks(
    blocks: u64,
    servers: u32,
    connections: u32,
    qd: u32,
    block_size: u32,
) -> Result<(), DemoError> {
    let per_server = connections.div_ceil(servers.max(1));
    let inflight = u64::from(per_server) * u64::from(qd);
    if blocks < 2 * inflight {
        return Err(DemoError::Config(format!(
            "a device of {blocks} blocks cannot keep {inflight} requests in flight on distinct \
             blocks ({per_server} connections × queue depth {qd}); it needs at least {} blocks: \
             raise --device-size to {} or lower --connections/--qd",
            2 * inflight,
            2 * inflight * u64::from(block_size)
        )));
    }
    Ok(())
}

/// Resolves `--prometheus`'s HOST:PORT to the address to listen on.
///
/// # Errors
/// [`DemoError::Config`] naming the text and the form expected.
pub fn parse_addr(s: &str) -> Result<SocketAddr, DemoError> {
    let bad = |why: String| {
        DemoError::Config(format!(
            "--prometheus {s:?}: {why} (give HOST:PORT, e.g. 127.0.0.1:9464 or 0.0.0.0:9464)"
        ))
    };
    let mut addrs = s.to_socket_addrs().map_err(|e| bad(e.to_string()))?;
    addrs
        .next()
        .ok_or_else(|| bad("the name resolves to no address".into()))
}

/// Parses a size: `4096`, `4k`/`4K`/`4KiB`, `64M`/`64MiB`, `1G`/`1GiB`
/// (binary multiples).
///
/// # Errors
/// A message naming the text.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (try 4096, 4KiB, 64MiB)"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("{s:?}: unknown unit {other:?} (try KiB, MiB, GiB)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Parses a duration: `10s`, `500ms`, `1.5s`, `2m`, `100us`.
///
/// # Errors
/// A message naming the text.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (try 10s, 500ms, 2m)"))?;
    let secs = match unit {
        "s" => n,
        "ms" => n / 1e3,
        "us" | "µs" => n / 1e6,
        "m" | "min" => n * 60.0,
        "" => return Err(format!("{s:?}: give a unit (s, ms, m)")),
        other => return Err(format!("{s:?}: unknown unit {other:?} (try s, ms, m)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        let mut v = vec!["cqd-demo"];
        v.extend_from_slice(extra);
        Args::try_parse_from(v).expect("flags parse")
    }

    #[test]
    fn sizes_and_durations_parse_or_say_why() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert!(parse_size("4 parsecs")
            .unwrap_err()
            .contains("unknown unit"));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999999G")
            .unwrap_err()
            .contains("too large"));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("10").unwrap_err().contains("unit"));
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn the_defaults_are_a_valid_ten_second_run() {
        let c = args(&[]).check().unwrap();
        assert_eq!(c.stop, Stop::After(Duration::from_secs(10)));
        assert_eq!(c.blocks_per_server, 16384);
        let q = args(&["--quick"]).check().unwrap();
        assert_eq!(q.stop, Stop::After(Duration::from_secs(2)));
    }

    #[test]
    fn bad_combinations_are_refused_with_the_way_out() {
        let e = args(&["--device-size", "64KiB", "--qd", "64"])
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("cannot keep"), "{e}");
        assert!(e.to_string().contains("--device-size"), "{e}");
        let e = args(&["--device-size", "10000"]).check().unwrap_err();
        assert!(e.to_string().contains("whole number"), "{e}");
        let e = args(&["--block-size", "1000"]).check().unwrap_err();
        assert!(e.to_string().contains("multiple of 512"), "{e}");
        let e = args(&["--servers", "4", "--connections", "2"])
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("every server needs"), "{e}");
        let e = args(&["--read-pct", "101"]).check().unwrap_err();
        assert!(e.to_string().contains("--read-pct"), "{e}");
        let e = args(&["--fault-rate", "0.1", "--backend", "verbs"])
            .check()
            .unwrap_err();
        let want = if cfg!(feature = "verbs") {
            "--backend sim"
        } else {
            "--features verbs"
        };
        assert!(e.to_string().contains(want), "{e}");
        assert_eq!(e.exit_code(), 2);
        let e = args(&["serve", "--backend", "sim"]).check().unwrap_err();
        assert!(e.to_string().contains("verbs only"), "{e}");
        let e = args(&["--device", "mlx5_0"]).check().unwrap_err();
        assert!(
            e.to_string().contains("--device is for --backend verbs"),
            "{e}"
        );
        let e = args(&["--server", "h:1"]).check().unwrap_err();
        assert!(e.to_string().contains("--server is for `load`"), "{e}");
        let e = args(&["--retry-cnt", "6"]).check().unwrap_err();
        assert!(
            e.to_string().contains("--retry-cnt is for --backend verbs"),
            "{e}"
        );
    }

    #[test]
    fn exposure_is_windows_unless_keys_are_asked_for() {
        assert_eq!(args(&[]).check().unwrap().exposure, ExposureKind::Windows);
        let c = args(&["--exposure", "keys"]).check().unwrap();
        assert_eq!(c.exposure, ExposureKind::Keys);
        assert!(Args::try_parse_from(["cqd-demo", "--exposure", "open"]).is_err());
    }

    #[test]
    fn the_retry_count_is_the_transports_three_bits() {
        if !cfg!(feature = "verbs") {
            return;
        }
        let c = args(&["load", "--server", "a:1"]).check().unwrap();
        assert_eq!(c.retry_cnt, None);
        let c = args(&["load", "--server", "a:1", "--retry-cnt", "6"])
            .check()
            .unwrap();
        assert_eq!(c.retry_cnt, Some(6));
        let c = args(&["serve", "--retry-cnt", "0"]).check().unwrap();
        assert_eq!(c.retry_cnt, Some(0));
        let e = args(&["serve", "--retry-cnt", "8"]).check().unwrap_err();
        assert!(e.to_string().contains("0 to 7"), "{e}");
        assert_eq!(e.exit_code(), 2);
    }

    #[test]
    fn serve_and_load_take_their_own_flags() {
        if !cfg!(feature = "verbs") {
            let e = args(&["load", "--server", "h:1"]).check().unwrap_err();
            for w in ["--features verbs", "libibverbs-dev"] {
                assert!(e.to_string().contains(w), "{e}");
            }
            return;
        }
        let c = args(&[
            "load",
            "--server",
            "a:1",
            "--server",
            "b:2",
            "--connections",
            "2",
        ])
        .check()
        .unwrap();
        assert_eq!(
            (c.command, c.backend, c.servers),
            (Command::Load, BackendKind::Verbs, 2)
        );
        let e = args(&["load"]).check().unwrap_err();
        assert!(e.to_string().contains("at least one --server"), "{e}");
        let e = args(&["load", "--server", "a:1", "--device-size", "1MiB"])
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("the server's"), "{e}");
        let s = args(&["serve"]).check().unwrap();
        // Loopback unless told: a stranger on the network cannot even
        // start a handshake.
        assert_eq!(s.listen, format!("127.0.0.1:{DEFAULT_PORT}"));
        let e = args(&["serve", "--duration", "1s"]).check().unwrap_err();
        assert!(e.to_string().contains("the load's"), "{e}");
        // One deadline per handshake: 30 s unless told, never zero, and
        // only where there is a handshake.
        assert_eq!(s.handshake_timeout, crate::net::HANDSHAKE_TIMEOUT);
        let s = args(&["serve", "--handshake-timeout", "5s"])
            .check()
            .unwrap();
        assert_eq!(s.handshake_timeout, std::time::Duration::from_secs(5));
        let e = args(&["serve", "--handshake-timeout", "0s"])
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("longer than zero"), "{e}");
        let e = args(&["--handshake-timeout", "5s"]).check().unwrap_err();
        assert!(
            e.to_string()
                .contains("--handshake-timeout is for `serve` and `load`"),
            "{e}"
        );
    }
}
