//! The verdicts are computed, never printed blindly: a server that sends
//! the wrong block fails the data verdict (and says what the block held),
//! and queues reset instead of flushed fail the accounts verdict (and name
//! the handler and kind). Both runs use the library with a faulty backend
//! wrapped around the simulated one.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};

use clap::Parser;
use cqd_core::{CqHandle, CqOptions, Registration, UnboundCq};
use cqd_demo::backend::sim::{SimEndpoint, SimFabric, SimLink, SimNode, SimRegion, SimSrq};
use cqd_demo::backend::{BackendError, Depths, Exposure, Link, Node, Op, Region, SharedRq, Verb};
use cqd_demo::config::Args;
use cqd_demo::run::run_on;
use cqd_sim::Modify;

#[derive(Debug, Clone, Copy)]
enum Fault {
    None,
    /// Every 20th RDMA WRITE (a read's data) comes from the next block.
    Misdirect,
    /// `to_error` resets the QP: its queued requests vanish without a
    /// completion, as on hardware.
    ResetInsteadOfFlush,
    /// Copies into regions take a millisecond (a slow host).
    SlowWrites,
    /// The server never moves a read's data (its RDMA WRITEs are dropped;
    /// the reply still goes): the client's buffer keeps what was there.
    DropWrites,
}

/// A region that may be slow to write.
#[derive(Debug)]
struct FRegion {
    inner: SimRegion,
    slow: bool,
}

impl Region for FRegion {
    fn len(&self) -> u64 {
        self.inner.len()
    }
    fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), BackendError> {
        self.inner.read(offset, out)
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        if self.slow {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.inner.write(offset, data)
    }
    fn remote(&self, offset: u64) -> cqd_demo::backend::Remote {
        self.inner.remote(offset)
    }
}

#[derive(Debug)]
struct Faulty {
    inner: SimNode,
    fault: Fault,
}

#[derive(Debug)]
struct FaultyLink {
    inner: SimLink,
    fault: Fault,
    writes: AtomicU64,
}

impl Link for FaultyLink {
    type Region = FRegion;
    type Endpoint = SimEndpoint;

    fn qpn(&self) -> u32 {
        self.inner.qpn()
    }
    fn endpoint(&self) -> Result<SimEndpoint, BackendError> {
        self.inner.endpoint()
    }
    fn connect(&self, peer: &SimEndpoint) -> Result<(), BackendError> {
        self.inner.connect(peer)
    }
    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &FRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        self.inner.post_recv(reg, tag, &region.inner, offset, len)
    }
    fn post_send(&self, reg: &Registration, ops: &[Op<'_, FRegion>]) -> Result<(), BackendError> {
        let ops: Vec<Op<'_, SimRegion>> = ops
            .iter()
            .filter(|op| {
                !(matches!(self.fault, Fault::DropWrites) && matches!(op.verb, Verb::Write(_)))
            })
            .map(|op| {
                let mut offset = op.offset;
                if matches!(self.fault, Fault::Misdirect)
                    && matches!(op.verb, Verb::Write(_))
                    && self.writes.fetch_add(1, Ordering::Relaxed) % 20 == 19
                    && op.offset + 2 * u64::from(op.len) <= op.region.len()
                {
                    offset += u64::from(op.len);
                }
                Op {
                    tag: op.tag,
                    verb: op.verb,
                    region: &op.region.inner,
                    offset,
                    len: op.len,
                    signaled: op.signaled,
                }
            })
            .collect();
        self.inner.post_send(reg, &ops)
    }
    fn to_error(&self) {
        match self.fault {
            Fault::ResetInsteadOfFlush => {
                let _ = self.inner.qp().modify(Modify::Reset);
            }
            _ => self.inner.to_error(),
        }
    }
    fn close(self, timeout: std::time::Duration) -> Result<(), BackendError> {
        self.inner.close(timeout)
    }
}

#[derive(Debug)]
struct FSrq(SimSrq);

impl SharedRq for FSrq {
    type Region = FRegion;

    fn srqn(&self) -> u32 {
        self.0.srqn()
    }
    fn depth(&self) -> u32 {
        self.0.depth()
    }
    fn post_recv(
        &self,
        reg: &Registration,
        tag: u32,
        region: &FRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        self.0.post_recv(reg, tag, &region.inner, offset, len)
    }
}

impl Node for Faulty {
    type Cq = cqd_sim::Cq;
    type Region = FRegion;
    type Link = FaultyLink;
    type Srq = FSrq;

    fn name(&self) -> &str {
        self.inner.name()
    }
    fn max_srq_wr(&self) -> u32 {
        self.inner.max_srq_wr()
    }
    fn create_srq(&self, depth: u32) -> Result<FSrq, BackendError> {
        self.inner.create_srq(depth).map(FSrq)
    }
    fn create_link_on_srq(
        &self,
        cq: &cqd_sim::Cq,
        send_depth: u32,
        srq: &FSrq,
        exposure: Exposure,
        owner: &Registration,
    ) -> Result<FaultyLink, BackendError> {
        Ok(FaultyLink {
            inner: self
                .inner
                .create_link_on_srq(cq, send_depth, &srq.0, exposure, owner)?,
            fault: self.fault,
            writes: AtomicU64::new(0),
        })
    }
    fn max_cqe(&self) -> u32 {
        self.inner.max_cqe()
    }
    fn max_qp_wr(&self) -> u32 {
        self.inner.max_qp_wr()
    }
    fn create_cq<W: Send + 'static>(
        &self,
        name: &str,
        depth: u32,
        options: CqOptions,
    ) -> Result<(cqd_sim::Cq, UnboundCq<W>, CqHandle<W>), BackendError> {
        self.inner.create_cq(name, depth, options)
    }
    fn reg_region(&self, len: u64, exposure: Exposure) -> Result<FRegion, BackendError> {
        Ok(FRegion {
            inner: self.inner.reg_region(len, exposure)?,
            slow: matches!(self.fault, Fault::SlowWrites),
        })
    }
    fn create_link(
        &self,
        cq: &cqd_sim::Cq,
        depths: Depths,
        exposure: Exposure,
    ) -> Result<FaultyLink, BackendError> {
        Ok(FaultyLink {
            inner: self.inner.create_link(cq, depths, exposure)?,
            fault: self.fault,
            writes: AtomicU64::new(0),
        })
    }
}

fn config(extra: &[&str]) -> cqd_demo::config::Config {
    // Defaults a test may override.
    let mut v = vec!["cqd-demo", "--no-progress"];
    if !extra.contains(&"--device-size") {
        v.extend_from_slice(&["--device-size", "2MiB"]);
    }
    if !extra.contains(&"--ops") {
        v.extend_from_slice(&["--duration", "500ms"]);
    }
    v.extend_from_slice(extra);
    Args::try_parse_from(v).unwrap().check().unwrap()
}

#[test]
fn the_same_wrapper_without_a_fault_passes() {
    let fabric = SimFabric::new(0.0, 1);
    let r = run_on(&config(&[]), None, |name| {
        Ok(Faulty {
            inner: fabric.open(name),
            fault: Fault::None,
        })
    })
    .unwrap();
    assert!(r.passed(), "{}", r.text());
}

#[test]
fn a_server_that_sends_the_wrong_block_fails_the_data_verdict() {
    let fabric = SimFabric::new(0.0, 1);
    let r = run_on(&config(&[]), None, |name| {
        Ok(Faulty {
            inner: fabric.open(name),
            fault: if name.starts_with("srv") {
                Fault::Misdirect
            } else {
                Fault::None
            },
        })
    })
    .unwrap();
    let text = r.text();
    assert!(!r.verdicts.data.passed, "{text}");
    assert!(!r.passed());
    assert!(r.verify.mismatches > 0, "{text}");
    assert!(text.contains("verdict data:     FAILED"), "{text}");
    assert!(
        r.mismatches
            .iter()
            .any(|m| m.contains("returned version") || m.contains("returned zeros")),
        "{:?}",
        r.mismatches
    );
    // The transport itself was sound: every request is accounted for.
    assert!(r.verdicts.accounts.passed, "{}", r.verdicts.accounts.detail);
}

#[test]
fn queues_reset_instead_of_flushed_fail_the_accounts_verdict() {
    let fabric = SimFabric::new(0.0, 1);
    let r = run_on(&config(&["--drain-timeout", "200ms"]), None, |name| {
        Ok(Faulty {
            inner: fabric.open(name),
            fault: if name == "load" {
                Fault::ResetInsteadOfFlush
            } else {
                Fault::None
            },
        })
    })
    .unwrap();
    let text = r.text();
    assert!(!r.verdicts.accounts.passed, "{text}");
    assert!(text.contains("verdict accounts: FAILED"), "{text}");
    let d = &r.verdicts.accounts.detail;
    assert!(d.contains("load/c0->srv0 recv: posted"), "{d}");
    assert!(d.contains("drain timed out"), "{d}");
    // The data was fine.
    assert!(r.verdicts.data.passed, "{}", r.verdicts.data.detail);
}

#[test]
fn a_single_slot_on_a_slow_host_still_reads_back_every_block() {
    // One slot, and every copy into a buffer takes a millisecond: the
    // read-back ends when every block was read, not when the in-flight
    // count happens to read 0 between two requests.
    let fabric = SimFabric::new(0.0, 1);
    let cfg = config(&[
        "--qd",
        "1",
        "--connections",
        "1",
        "--device-size",
        "1MiB",
        "--ops",
        "50",
    ]);
    let r = run_on(&cfg, None, |name| {
        Ok(Faulty {
            inner: fabric.open(name),
            fault: if name == "load" {
                Fault::SlowWrites
            } else {
                Fault::None
            },
        })
    })
    .unwrap();
    assert_eq!(r.load.verify_matched, 256, "{}", r.text());
    assert!(r.verdicts.data.passed, "{}", r.text());
    // A copy that sleeps a millisecond in the load's handler is a handler
    // that blocks its poller: the accounts verdict may name it, and then
    // for nothing else.
    let a = &r.verdicts.accounts;
    assert!(
        a.passed || a.detail.starts_with("CQ load0: ") && a.detail.contains("blocked the poller"),
        "{}",
        r.text()
    );
}

#[test]
fn reads_whose_data_never_arrives_fail_the_data_verdict() {
    // Reads only, of a device nobody wrote: the expected data is zeros,
    // which is also what a fresh client buffer holds. A server that never
    // moves the data must still fail (the client poisons each read's
    // buffer first).
    let fabric = SimFabric::new(0.0, 1);
    let r = run_on(
        &config(&["--read-pct", "100", "--ops", "200"]),
        None,
        |name| {
            Ok(Faulty {
                inner: fabric.open(name),
                fault: if name.starts_with("srv") {
                    Fault::DropWrites
                } else {
                    Fault::None
                },
            })
        },
    )
    .unwrap();
    let text = r.text();
    assert!(!r.verdicts.data.passed, "{text}");
    assert!(!r.passed());
    assert!(r.verify.mismatches > 0, "{text}");
    assert!(
        r.mismatches.iter().any(|m| m.contains("delivered no data")),
        "{:?}",
        r.mismatches
    );
}

#[test]
fn connections_that_come_and_go_keep_both_verdicts_in_every_mode() {
    // 8 connections on one server (its CQ from its pool, its receives
    // from its SRQ); 300 closes a second, each replaced at once.
    for mode in ["busy", "event", "hybrid", "adaptive"] {
        let fabric = SimFabric::new(0.0, 1);
        let cfg = config(&[
            "--mode",
            mode,
            "--connections",
            "8",
            "--qd",
            "4",
            "--churn",
            "300",
        ]);
        let r = run_on(&cfg, None, |name| Ok(fabric.open(name))).unwrap();
        let text = r.text();
        assert!(r.passed(), "{mode}: {text}");
        let churn = r.churn.as_ref().expect("a churn line");
        // How many cycles fit in the run depends on the machine's load;
        // the first is due 1/300 s into the run, so at least one runs.
        assert!(churn.cycles >= 1, "{mode}: {text}");
        assert_eq!(churn.failed, 0, "{mode}: {text}");
        assert_eq!(r.servers[0].closed, churn.cycles, "{mode}: {text}");
        assert_eq!(r.load.dead_connections, 0, "{mode}: {text}");
        assert_eq!(r.load.failed, 0, "{mode}: {text}");
        // The stop handed back what was still posted on the SRQ: 8 × 4.
        let srv_cq = &r.system.pollers[0].cqs[0];
        assert_eq!(srv_cq.name, "srv0-0", "{mode}: {text}");
        assert_eq!(srv_cq.srq_returned, 32, "{mode}: {text}");
        assert!(text.contains("churn "), "{text}");
    }
}
