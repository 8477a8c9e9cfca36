//! The command line and the checks of its combinations.

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
    /// Real RDMA through cqd-verbs (not in this build yet).
    Verbs,
}

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

/// A block-storage server and its load generator on cqd (simulated NIC,
/// one process). The bare command runs about ten seconds of mixed load and
/// prints a report with two verdicts.
#[derive(Debug, Clone, Parser)]
#[command(name = "cqd-demo", version)]
pub struct Args {
    /// Transport.
    #[arg(long, value_enum, default_value = "sim")]
    pub backend: BackendKind,
    /// Thread layout (TOML, docs/topology.md); default: the built-in copy
    /// of examples/demo-topology.toml.
    #[arg(long, value_name = "FILE")]
    pub topology: Option<PathBuf>,
    /// Servers, each with its own device, CQ and connections; blocks are
    /// striped over them.
    #[arg(long, default_value_t = 1)]
    pub servers: u32,
    /// Connections in all, spread over the servers.
    #[arg(long, default_value_t = 4)]
    pub connections: u32,
    /// Requests in flight per connection.
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
    /// Transport.
    pub backend: BackendKind,
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
        if self.backend == BackendKind::Verbs {
            return bad(
                "--backend verbs is not in this build yet (the two-process serve/load \
                        over cqd-verbs comes next); use --backend sim"
                    .into(),
            );
        }
        if !(1..=16).contains(&self.servers) {
            return bad(format!("--servers {}: must be 1 to 16", self.servers));
        }
        if !(1..=256).contains(&self.connections) {
            return bad(format!(
                "--connections {}: must be 1 to 256",
                self.connections
            ));
        }
        if self.connections < self.servers {
            return bad(format!(
                "--connections {} is fewer than --servers {}: every server needs a connection",
                self.connections, self.servers
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
        if device < bs || device % bs != 0 {
            return bad(format!(
                "--device-size {device} is not a whole number of {bs}-byte blocks"
            ));
        }
        if device > MAX_DEVICE {
            return bad(format!(
                "--device-size {device}: the simulated NIC registers at most {MAX_DEVICE} bytes"
            ));
        }
        let total = device.saturating_mul(u64::from(self.servers));
        if total > MAX_TOTAL_DEVICE {
            return bad(format!(
                "{} servers of {device} bytes need {total} bytes of memory; at most {MAX_TOTAL_DEVICE}",
                self.servers
            ));
        }
        let blocks = device / bs;
        // Connections are spread round-robin: the busiest server has this
        // many. Each request in flight claims a block of its server, and a
        // new request must find a free one quickly: twice as many blocks.
        let per_server = self.connections.div_ceil(self.servers);
        let inflight = u64::from(per_server) * u64::from(self.qd);
        if blocks < 2 * inflight {
            return bad(format!(
                "a device of {blocks} blocks cannot keep {inflight} requests in flight on distinct \
                 blocks ({per_server} connections × queue depth {}); it needs at least {} blocks: \
                 raise --device-size to {} or lower --connections/--qd",
                self.qd,
                2 * inflight,
                2 * inflight * bs
            ));
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
            backend: self.backend,
            servers: self.servers,
            connections: self.connections,
            qd: self.qd,
            read_pct: self.read_pct,
            block_size: bs as u32,
            device_size: device,
            blocks_per_server: blocks,
            stop,
            mode: self.mode,
            workers: self.workers,
            op_timeout: self.op_timeout,
            drain_timeout: self.drain_timeout,
            fault_rate: self.fault_rate,
            seed: self.seed,
            topology: self.topology.clone(),
            progress: !self.no_progress,
        })
    }
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
        let e = args(&["--backend", "verbs"]).check().unwrap_err();
        assert!(e.to_string().contains("not in this build"), "{e}");
        assert_eq!(e.exit_code(), 2);
    }
}
