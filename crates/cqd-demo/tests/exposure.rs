//! The least a role needs (`backend::Exposure`), on the simulated NIC: a
//! peer that knows a region's key still cannot RDMA WRITE or READ it unless
//! both the region and the QP it reaches it through are `Peer`. The server
//! registers everything `Local`, so a client holding any of its keys (it
//! is given none) reaches nothing.

use std::collections::VecDeque;
use std::sync::Arc;

use cqd_core::{CqOptions, CqPoller};
use cqd_core::{Failed, Handler, NoWork, Outbox, RecvDone, SendDone, Status};
use cqd_demo::backend::sim::SimFabric;
use cqd_demo::backend::{Depths, Exposure, Link, Node, Op, Region, Verb};
use parking_lot::Mutex;

/// Each send-side completion's status.
struct Statuses(Arc<Mutex<Vec<Status>>>);

impl Handler for Statuses {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.lock().push(Status::Success);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.0.lock().push(f.status());
    }
}

/// The first status a request from the peer to a region of `region`
/// exposure, through a QP of `qp` exposure, comes back with, and whether
/// the target's bytes changed (`write`: an RDMA WRITE; otherwise a READ).
fn attempt(region: Exposure, qp: Exposure, write: bool) -> (Status, bool) {
    let fabric = SimFabric::new(0.0, 7);
    let (target, peer) = (fabric.open("target"), fabric.open("peer"));
    let depths = Depths { send: 4, recv: 4 };
    let (t_cq, _t_unbound, _t_handle) = target
        .create_cq::<NoWork>("t", 16, CqOptions::default())
        .unwrap();
    let (p_cq, p_unbound, p_handle) = peer
        .create_cq::<NoWork>("p", 16, CqOptions::default())
        .unwrap();
    let t_region = target.reg_region(4096, region).unwrap();
    let t_link = target.create_link(&t_cq, depths, qp).unwrap();
    let p_region = peer.reg_region(4096, Exposure::Peer).unwrap();
    let p_link = peer.create_link(&p_cq, depths, Exposure::Peer).unwrap();
    t_link.connect(&p_link.endpoint().unwrap()).unwrap();
    p_link.connect(&t_link.endpoint().unwrap()).unwrap();
    t_region.write(0, &[0x11; 64]).unwrap();
    p_region.write(0, &[0x22; 64]).unwrap();

    let seen = Arc::new(Mutex::new(Vec::new()));
    let reg = p_handle.register(Statuses(Arc::clone(&seen))).unwrap();
    let remote = t_region.remote(0);
    let verb = if write {
        Verb::Write(remote)
    } else {
        Verb::Read(remote)
    };
    p_link
        .post_send(
            &reg,
            &[Op {
                tag: 1,
                verb,
                region: &p_region,
                offset: 0,
                len: 64,
                signaled: true,
            }],
        )
        .unwrap();
    let mut poller: CqPoller<NoWork> = p_unbound.bind();
    let mut out = VecDeque::new();
    for _ in 0..10_000 {
        if !seen.lock().is_empty() {
            break;
        }
        poller.poll_once(&mut out).unwrap();
    }
    let status = *seen.lock().first().expect("the request completed");
    let mut now = [0u8; 64];
    t_region.read(0, &mut now).unwrap();
    (status, now != [0x11; 64])
}

#[test]
fn a_peer_reaches_only_what_is_exposed_to_it() {
    use Exposure::{Local, Peer};
    for write in [true, false] {
        // Both exposed: the load's buffers, which the server moves data
        // into and out of.
        assert_eq!(attempt(Peer, Peer, write), (Status::Success, write));
        // A region kept local: its key reaches nothing.
        assert_eq!(
            attempt(Local, Peer, write),
            (Status::RemoteAccess, false),
            "write {write}"
        );
        // A QP not enabled for remote access: an invalid request, whatever
        // the region allows (the server's QPs).
        for region in [Local, Peer] {
            assert_eq!(
                attempt(region, Local, write),
                (Status::RemoteInvalidRequest, false),
                "write {write}, region {region:?}"
            );
        }
    }
}
