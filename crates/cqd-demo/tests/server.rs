//! The server against a hand-written client on the simulated NIC: good
//! requests move data both ways; malformed, out-of-range and wrong-length
//! requests get their error status (or break the connection when not even
//! the slot can be read), and nothing panics.
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use cqd_core::topology::{PoolConfig, TopologyConfig};
use cqd_core::{
    CqOptions, Failed, Handler, NoSink, NoWork, Outbox, PollerBuilder, RecvDone, Registration,
    SendDone,
};
use cqd_demo::backend::sim::{SimFabric, SimLink, SimRegion};
use cqd_demo::backend::{Depths, Exposure, Link, Node, Op, Region, Verb};
use cqd_demo::server::{Server, ServerSpec, ServerWork};
use cqd_demo::wire::{BlockOp, Reply, ReplyStatus, Request, WireError, MSG_LEN};
use parking_lot::Mutex;

const BS: u32 = 4096;
const RECVS: u32 = 8;
/// Client region: receives at [0, 8 × 64), requests at 1024.., data at 4096.
const REQ_AT: u64 = 1024;
const DATA_AT: u64 = 4096;

type Seen = Arc<Mutex<Vec<Result<Reply, WireError>>>>;

struct Client {
    region: Arc<SimRegion>,
    link: Arc<SimLink>,
    reg: Arc<Mutex<Option<Registration>>>,
    seen: Seen,
    errors: Arc<Mutex<Vec<String>>>,
}

impl Handler for Client {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        let at = u64::from(d.tag()) * MSG_LEN as u64;
        let mut b = [0u8; MSG_LEN];
        self.region.read(at, &mut b).unwrap();
        if let Some(reg) = self.reg.lock().as_ref() {
            self.link
                .post_recv(reg, d.tag(), &self.region, at, MSG_LEN as u32)
                .unwrap();
        }
        self.seen
            .lock()
            .push(Reply::decode(&b[..d.byte_len() as usize]));
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        self.errors
            .lock()
            .push(format!("{:?} {:?}", f.kind(), f.status()));
    }
}

struct Rig {
    server: Server<cqd_demo::backend::sim::SimNode>,
    region: Arc<SimRegion>,
    link: Arc<SimLink>,
    reg: Registration,
    seen: Seen,
    errors: Arc<Mutex<Vec<String>>>,
    next: u64,
}

impl Rig {
    /// Sends raw request bytes (from the next request buffer).
    fn send_raw(&mut self, bytes: &[u8; MSG_LEN]) {
        let at = REQ_AT + (self.next % 40) * MSG_LEN as u64;
        self.next += 1;
        self.region.write(at, bytes).unwrap();
        let op = Op {
            tag: 1,
            verb: Verb::Send,
            region: &*self.region,
            offset: at,
            len: MSG_LEN as u32,
            signaled: true,
        };
        self.link.post_send(&self.reg, &[op]).unwrap();
    }

    fn request(&self, op: BlockOp, slot: u16, id: u64, block: u64, len: u32) -> Request {
        Request {
            op,
            slot,
            id,
            block,
            len,
            remote: self.region.remote(DATA_AT),
        }
    }

    /// Waits for the `n`-th reply (1-based).
    fn reply(&self, n: usize) -> Result<Reply, WireError> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(r) = self.seen.lock().get(n - 1) {
                return *r;
            }
            assert!(
                Instant::now() < deadline,
                "no reply {n}; errors {:?}",
                self.errors.lock()
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

#[test]
fn the_server_answers_good_and_bad_requests_and_never_panics() {
    let fabric = SimFabric::new(0.0, 1);
    let spec = ServerSpec {
        device_bytes: 16 * u64::from(BS),
        block_size: BS,
        depth: 4,
        connections: 1,
    };
    let mut server =
        Server::fixed(fabric.open("srv0"), "srv0", spec, CqOptions::default()).unwrap();
    let conn = server.accept().unwrap();

    let node = fabric.open("client");
    let (cq, unbound, handle) = node
        .create_cq::<NoWork>("client", 64, CqOptions::default())
        .unwrap();
    // The client's side, as the load's: the server reaches its buffers.
    let region = Arc::new(
        node.reg_region(DATA_AT + u64::from(BS), Exposure::Peer)
            .unwrap(),
    );
    let link = Arc::new(
        node.create_link(
            &cq,
            Depths {
                send: 16,
                recv: RECVS,
            },
            Exposure::Peer,
        )
        .unwrap(),
    );
    let seen = Seen::default();
    let errors = Arc::new(Mutex::new(Vec::new()));
    let reg_cell = Arc::new(Mutex::new(None));
    let reg = handle
        .register(Client {
            region: Arc::clone(&region),
            link: Arc::clone(&link),
            reg: Arc::clone(&reg_cell),
            seen: Arc::clone(&seen),
            errors: Arc::clone(&errors),
        })
        .unwrap();
    *reg_cell.lock() = Some(reg.clone());
    conn.link().connect(&link.endpoint().unwrap()).unwrap();
    link.connect(&conn.link().endpoint().unwrap()).unwrap();
    for i in 0..RECVS {
        link.post_recv(
            &reg,
            i,
            &region,
            u64::from(i) * MSG_LEN as u64,
            MSG_LEN as u32,
        )
        .unwrap();
    }

    let mut topology = TopologyConfig::new()
        .pool(PoolConfig::new("io", 2))
        .validate()
        .unwrap();
    let (pool, mut sinks) = topology
        .take_pool("io")
        .unwrap()
        .spawn(1, |_| |w: ServerWork<_>| w.run())
        .unwrap();
    let server_poller = PollerBuilder::new("srv", sinks.remove(0))
        .cq(server.take_cq().unwrap())
        .spawn()
        .unwrap();
    let client_poller = PollerBuilder::new("cli", NoSink)
        .cq(unbound)
        .spawn()
        .unwrap();

    let mut rig = Rig {
        server,
        region,
        link,
        reg,
        seen,
        errors,
        next: 0,
    };

    // A write moves the client's buffer into block 3 (RDMA READ) ...
    let pattern: Vec<u8> = (0..BS).map(|i| (i * 7 + 1) as u8).collect();
    rig.region.write(DATA_AT, &pattern).unwrap();
    let w = rig.request(BlockOp::Write, 0, 11, 3, BS);
    rig.send_raw(&w.encode());
    assert_eq!(rig.reply(1), Ok(Reply::to(&w, ReplyStatus::Ok)));
    // ... and a read brings it back (RDMA WRITE) into a cleared buffer.
    rig.region.write(DATA_AT, &vec![0u8; BS as usize]).unwrap();
    let r = rig.request(BlockOp::Read, 1, 12, 3, BS);
    rig.send_raw(&r.encode());
    assert_eq!(rig.reply(2), Ok(Reply::to(&r, ReplyStatus::Ok)));
    let mut back = vec![0u8; BS as usize];
    rig.region.read(DATA_AT, &mut back).unwrap();
    assert_eq!(back, pattern, "the block came back as written");

    // Past the end, a wrong length, a slot beyond the queue depth.
    let past = rig.request(BlockOp::Read, 2, 13, 16, BS);
    rig.send_raw(&past.encode());
    assert_eq!(rig.reply(3), Ok(Reply::to(&past, ReplyStatus::OutOfRange)));
    let short = rig.request(BlockOp::Write, 2, 14, 0, 512);
    rig.send_raw(&short.encode());
    assert_eq!(rig.reply(4), Ok(Reply::to(&short, ReplyStatus::BadLength)));
    let slot = rig.request(BlockOp::Read, 99, 15, 0, BS);
    rig.send_raw(&slot.encode());
    assert_eq!(rig.reply(5), Ok(Reply::to(&slot, ReplyStatus::Malformed)));

    // Undecodable but with a readable slot: answered Malformed to it.
    for (i, corrupt) in [(5usize, 0u8), (4, 9), (50, 1)].into_iter().enumerate() {
        let mut b = rig
            .request(BlockOp::Read, 3, 100 + i as u64, 0, BS)
            .encode();
        b[corrupt.0] = corrupt.1;
        rig.send_raw(&b);
        let got = rig.reply(6 + i).unwrap();
        assert_eq!(
            (got.slot, got.id, got.status),
            (3, 100 + i as u64, ReplyStatus::Malformed)
        );
    }
    assert_eq!(rig.server.counts().malformed, 3);
    assert_eq!(rig.server.counts().rejected, 3);

    // Not this protocol at all: no slot to answer; the connection breaks
    // (its QP to error), and the client's next request fails instead of
    // waiting forever.
    rig.send_raw(&[0xab; MSG_LEN]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while rig.server.counts().broken == 0 {
        assert!(Instant::now() < deadline, "the connection was not broken");
        std::thread::sleep(Duration::from_millis(1));
    }
    rig.send_raw(&rig.request(BlockOp::Read, 0, 200, 0, BS).encode());
    while rig.errors.lock().is_empty() {
        assert!(
            Instant::now() < deadline,
            "the request after the break did not fail"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(rig.seen.lock().len(), 8, "no reply after the break");

    // Shutdown: flush, stop, and every account balances; nothing panicked.
    assert!(rig.server.quiesce(Duration::from_secs(5)));
    rig.server.flush();
    rig.link.to_error();
    let report = cqd_core::shutdown(|| {}, [server_poller, client_poller], [pool]);
    assert!(report.is_clean(), "{:?}", report.errors);
    for p in &report.pollers {
        assert!(p.accounts.is_balanced(), "{}", p.accounts);
        assert!(p.cqs.iter().all(|c| c.handler_panics == 0));
    }
    assert_eq!(report.pools[0].panics(), 0);
    assert_eq!(rig.server.counts().reads, 1);
    assert_eq!(rig.server.counts().writes, 1);
}
