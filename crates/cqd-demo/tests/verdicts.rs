//! The verdicts are computed, never printed blindly: a server that sends
//! the wrong block fails the data verdict (and says what the block held),
//! and queues reset instead of flushed fail the accounts verdict (and name
//! the handler and kind). Both runs use the library with a faulty backend
//! wrapped around the simulated one.
#![allow(missing_docs)]

use std::sync::atomic::{AtomicU64, Ordering};

use clap::Parser;
use cqd_core::{CqHandle, CqOptions, Registration, UnboundCq};
use cqd_demo::backend::sim::{SimEndpoint, SimFabric, SimLink, SimNode, SimRegion};
use cqd_demo::backend::{BackendError, Depths, Link, Node, Op, Region, Verb};
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
    type Region = SimRegion;
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
        region: &SimRegion,
        offset: u64,
        len: u32,
    ) -> Result<(), BackendError> {
        self.inner.post_recv(reg, tag, region, offset, len)
    }
    fn post_send(&self, reg: &Registration, ops: &[Op<'_, SimRegion>]) -> Result<(), BackendError> {
        if !matches!(self.fault, Fault::Misdirect) {
            return self.inner.post_send(reg, ops);
        }
        let ops: Vec<Op<'_, SimRegion>> = ops
            .iter()
            .map(|op| {
                let mut offset = op.offset;
                if matches!(op.verb, Verb::Write(_))
                    && self.writes.fetch_add(1, Ordering::Relaxed) % 20 == 19
                    && op.offset + 2 * u64::from(op.len) <= op.region.len()
                {
                    offset += u64::from(op.len);
                }
                Op {
                    tag: op.tag,
                    verb: op.verb,
                    region: op.region,
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
}

impl Node for Faulty {
    type Cq = cqd_sim::Cq;
    type Region = SimRegion;
    type Link = FaultyLink;

    fn name(&self) -> &str {
        self.inner.name()
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
    fn reg_region(&self, len: u64) -> Result<SimRegion, BackendError> {
        self.inner.reg_region(len)
    }
    fn create_link(&self, cq: &cqd_sim::Cq, depths: Depths) -> Result<FaultyLink, BackendError> {
        Ok(FaultyLink {
            inner: self.inner.create_link(cq, depths)?,
            fault: self.fault,
            writes: AtomicU64::new(0),
        })
    }
}

fn config(extra: &[&str]) -> cqd_demo::config::Config {
    let mut v = vec![
        "cqd-demo",
        "--duration",
        "500ms",
        "--device-size",
        "2MiB",
        "--no-progress",
    ];
    v.extend_from_slice(extra);
    Args::try_parse_from(v).unwrap().check().unwrap()
}

#[test]
fn the_same_wrapper_without_a_fault_passes() {
    let fabric = SimFabric::new(0.0, 1);
    let r = run_on(&config(&[]), None, |name| Faulty {
        inner: fabric.open(name),
        fault: Fault::None,
    })
    .unwrap();
    assert!(r.passed(), "{}", r.text());
}

#[test]
fn a_server_that_sends_the_wrong_block_fails_the_data_verdict() {
    let fabric = SimFabric::new(0.0, 1);
    let r = run_on(&config(&[]), None, |name| Faulty {
        inner: fabric.open(name),
        fault: if name.starts_with("srv") {
            Fault::Misdirect
        } else {
            Fault::None
        },
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
        Faulty {
            inner: fabric.open(name),
            fault: if name == "load" {
                Fault::ResetInsteadOfFlush
            } else {
                Fault::None
            },
        }
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
