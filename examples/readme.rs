//! The README's example: a handler and a poller on the simulated NIC.
//! tests/readme.rs checks that README.md shows this file as it is, and runs
//! `main` (hence `pub`).
use cqd::core::*;
use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit, RecvWr, SendWr, WrOp};

/// What each request carries, moved in at the post and back out, once.
enum Req {
    // 8 bytes: it travels in its request's entry of the queue's ring (a
    // larger context gets a table of `capacity` slots at registration)
    Buffer { offset: u32 }, // a receive buffer to hand on, or post again
    Reply { client: u32 },
}

struct Conn; // one per connection; runs on the poller thread and must not block
impl ContextHandler for Conn {
    type Ctx = Req;
    fn on_send(&mut self, _: &SendDone<'_>, req: Req, _: &mut Outbox<'_, NoWork>) {
        if let Req::Reply { client } = req {
            println!("reply to client {client} sent");
        }
    }
    fn on_recv(&mut self, d: &RecvDone<'_>, req: Req, _: &mut Outbox<'_, NoWork>) {
        if let Req::Buffer { offset } = req {
            println!("{} bytes in the buffer at {offset}", d.byte_len());
        }
    }
    fn on_error(&mut self, f: &Failed<'_>, _: Req, _: &mut Outbox<'_, NoWork>) {
        println!("a request failed: {}", f.status()); // flushes too: release what it held
    }
    fn on_silent(&mut self, _: &Silent, _: Req, _: &mut Outbox<'_, NoWork>) {} // unsignaled, done
    fn on_abandoned(&mut self, _: Req) {} // outstanding when the poller stopped
}

/// Connects two queue pairs, sends one message, stops with balanced accounts.
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::open("sim0"); // the simulated NIC
    let (cq, unbound, handle) =
        dev.create_dispatched_cq("cq0", 256, CqConfig::default(), CqOptions::default())?;
    let poller = PollerBuilder::new("p0", NoSink).cq(unbound).spawn()?; // mode: Adaptive
    let conn = handle.register_with_contexts(Conn, 256)?; // from any thread; 256 outstanding
    let pd = dev.alloc_pd();
    let a = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?; // admitted on the CQ
    let b = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?;
    connect(&a, &b)?;
    let mr = pd.reg_mr(4096, Access::ALL)?;
    // The one posting call: a context per request; ledger, queue account and
    // credits kept; on a refusal the contexts come back in the error.
    let (buffer, reply) = ([mr.sge(0, 2048)], [mr.sge(2048, 64)]);
    conn.post_recv(
        &b,
        &mut [RecvWr::new(0, &buffer)],
        [Req::Buffer { offset: 0 }],
    )?;
    conn.post_send(
        &a,
        &mut [SendWr::new(0, WrOp::Send, &reply)],
        [Req::Reply { client: 7 }],
    )?;
    let report = poller.stop()?; // drains, acks every event, destroys the CQ
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    Ok(())
}
