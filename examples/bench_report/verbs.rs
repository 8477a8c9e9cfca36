//! The softverbs backend of the mode curves: one RC QP pair on the device,
//! both ends on one CQ that cqd-verbs dispatches; an arrival is one
//! signaled 8-byte RDMA WRITE posted through the posting call
//! (`Registration::post_send`). softverbs executes the transfer inside
//! `ibv_post_send`, so the completion is in the CQ when the post returns;
//! the arrival stamp is taken before the post, so each latency also counts
//! the post itself (an upper bound).

use std::sync::Arc;

use cqd::core::{CqOptions, NoWork};
use cqd::verbs::{Access, ConnectOptions, Context, CqSpec, QpCap, QpInit, SendWr, WrOp};

use crate::curves::{tag_of, Rig, Stamp};

/// Send queue depth of the requester, and the most arrivals not yet
/// handled: beyond, an arrival waits (a stall) until the poller catches up.
const DEPTH: u32 = 1024;

pub fn backend() -> Result<impl FnMut(Stamp) -> Result<Rig, String>, String> {
    let ctx = Arc::new(Context::open_first().map_err(|e| format!("open the device: {e}"))?);
    Ok(move |stamp: Stamp| {
        let pd = ctx.alloc_pd().map_err(|e| e.to_string())?;
        let (cq, unbound, handle) = ctx
            .create_dispatched_cq::<NoWork>(
                "curve",
                4 * DEPTH,
                CqSpec::default(),
                CqOptions::default(),
            )
            .map_err(|e| e.to_string())?;
        let cap = |send, recv| QpCap {
            max_send_wr: send,
            max_recv_wr: recv,
            ..QpCap::default()
        };
        let a = pd
            .create_qp(&QpInit::new(&cq, &cq, cap(DEPTH, 1)))
            .map_err(|e| e.to_string())?;
        let b = pd
            .create_qp(&QpInit::new(&cq, &cq, cap(1, 1)))
            .map_err(|e| e.to_string())?;
        let opts = ConnectOptions::default();
        let ea = a.endpoint(&opts, 1).map_err(|e| e.to_string())?;
        let eb = b.endpoint(&opts, 2).map_err(|e| e.to_string())?;
        a.connect(&eb, 1, &opts).map_err(|e| e.to_string())?;
        b.connect(&ea, 2, &opts).map_err(|e| e.to_string())?;
        let mr = pd
            .reg_mr(4096, Access::ALL_RDMA)
            .map_err(|e| e.to_string())?;
        let reg = handle.register(stamp).map_err(|e| e.to_string())?;
        let (a, mr2, reg2) = (Arc::new(a), mr.clone(), reg.clone());
        let qp = Arc::clone(&a);
        let deliver = Box::new(move |k: usize| {
            let sge = [mr2.sge(0, 8)];
            let mut wr = [SendWr::new(
                u64::from(tag_of(k)),
                WrOp::Write(mr2.remote(2048)),
                &sge,
            )];
            // A refused post (the send queue full) is a stall: the arrival
            // tries again, and gives up after 10 s with an error.
            reg2.post_send(&*qp, &mut wr).is_ok()
        });
        Ok(Rig {
            cq: unbound,
            deliver,
            keep: Box::new((a, b, mr, reg, handle, cq, pd)),
            // softverbs frees a send queue slot when the transfer is done,
            // not when its completion is polled: bound the CQ's fill here.
            max_outstanding: DEPTH as usize,
        })
    })
}
