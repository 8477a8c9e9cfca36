//! The README's example: a handler and a poller on the simulated NIC.
//! tests/readme.rs checks that README.md shows this file as it is, and runs
//! `main` (hence `pub`).
use cqd::core::*;
use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit, RecvWr, SendWr, WrOp};

struct Conn; // one per connection; runs on the poller thread and must not block
impl Handler for Conn {
    fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
        println!("{} bytes in buffer {}", d.byte_len(), d.tag());
    }
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        println!("request {} failed: {}", f.tag(), f.status()); // flushes too
    }
}

/// Connects two queue pairs, sends one message, stops with balanced accounts.
pub fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::open("sim0"); // the simulated NIC
    let (cq, unbound, handle) =
        dev.create_dispatched_cq("cq0", 256, CqConfig::default(), CqOptions::default())?;
    let poller = PollerBuilder::new("p0", NoSink).cq(unbound).spawn()?; // mode: Adaptive
    let conn = handle.register(Conn)?; // from any thread, at any time
    let pd = dev.alloc_pd();
    let a = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?; // admitted on the CQ
    let b = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?;
    connect(&a, &b)?;
    let mr = pd.reg_mr(4096, Access::ALL)?;
    // The one posting call: tag in, ledger + queue account + credits kept.
    conn.post_recv(&b, &mut [RecvWr::new(7, &[mr.sge(0, 2048)])])?;
    conn.post_send(&a, &mut [SendWr::new(8, WrOp::Send, &[mr.sge(2048, 64)])])?;
    let report = poller.stop()?; // drains, acks every event, destroys the CQ
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
    Ok(())
}
