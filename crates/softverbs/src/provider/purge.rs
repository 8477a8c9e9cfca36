//! What a QP's destroy, and its move to RESET, take back, as rdma-core's
//! mlx5 provider does (`mlx5_destroy_qp`, `__mlx5_cq_clean`): the QP's
//! completions not yet polled leave its CQs, the others' keeping their
//! order, and the SRQ receives that requesters which died took for it go
//! back to the SRQ.
//!
//! mlx5 cleans under the CQ's lock once the kernel's destroy command has
//! returned, when the hardware writes no more CQEs for the QP. Here the
//! producers of a QP's completions take no lock and may live in other
//! processes: the owner's send side (its posts, the progress thread,
//! `poll_cq` retrying waiting sends), the requesters executing a request to
//! the QP, and the flushes. Steps P1–P3 make sure that none of them adds a
//! completion naming the QP after P5 looked; producers of the CQ's other
//! QPs go on pushing, past the end P5 looks up to (shm::ring step 5).
//!
//! P1. The caller stores the QP's new state, ERR (destroy) or RESET, with
//!     SeqCst. A requester enters the QP's insiders before it reads the
//!     state (shm::insiders steps 1, 2): it sees the new state and adds
//!     nothing, or P3 sees it inside (step 4).
//! P2. The caller stops the owner's own producers: under the send side's
//!     lock it drops the waiting sends and, at destroy, leaves the progress
//!     thread's registry; at destroy the QP then leaves its send CQ's
//!     `send_qps`, so no `poll_cq` retries its sends (a QP in RESET keeps
//!     its place: it has nothing to send). The application makes no other
//!     call on a QP it destroys or resets.
//! P3. [`purge`] waits until no insider is left, or only insiders of
//!     processes proven dead (they add nothing more): an insider publishes
//!     its completions before it leaves (shm::insiders step 3). It waits at
//!     most [`PATIENCE`]: a live requester stopped inside for that long
//!     (`SIGSTOP`) may still add a completion after the purge.
//! P4. On an SRQ, the receives that requesters which died took for the QP
//!     (shm::claim) are released without a completion: their slots are free
//!     again. A receive taken by a requester that completed it was released
//!     before its completion was published (shm::claim step 4): a purged
//!     completion holds no slot of the SRQ.
//! P5. The receive CQ, then the send CQ if it is another, is cleaned
//!     (`SvCq::clean`) as the CQ's only consumer (cq_iter step 1): it waits
//!     for every completion whose ring slot was taken before it looked to
//!     be published, then removes those naming the QP in place.

use std::time::{Duration, Instant};

use super::qp::SvQp;
use crate::shm::layout::QpHeader;

/// How long P3 waits for live insiders to leave. A requester is inside for
/// one request: a copy, a few atomics, a push.
pub const PATIENCE: Duration = Duration::from_secs(1);

/// P3–P5 for `q`, whose new state the caller stored (P1) and whose own
/// producers it stopped (P2). Returns how many completions it removed.
pub fn purge(q: &SvQp) -> usize {
    // P3.
    quiesce(q.hdr());
    // P4.
    if !q.srq.is_null() {
        // SAFETY: an SRQ cannot be destroyed while a QP uses it (verbs
        // rule: destroy the QPs first).
        unsafe { &*q.srq }.release_taken_for(q.qpn);
    }
    // P5.
    let mut removed = 0;
    if !q.recv_cq.is_null() {
        removed += q.recv_cq().clean(q.qpn);
    }
    if !q.send_cq.is_null() && q.send_cq != q.recv_cq {
        removed += q.send_cq().clean(q.qpn);
    }
    removed
}

/// P3: wait until nobody but dead processes is inside the QP of header
/// `h`, at most [`PATIENCE`]. Whether they all left in time.
fn quiesce(h: &QpHeader) -> bool {
    let deadline = Instant::now() + PATIENCE;
    let mut spins = 0u32;
    loop {
        if h.insiders.none() {
            return true;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
            continue;
        }
        // Inside for longer than a request takes: dead, or descheduled.
        if h.insiders.only_dead() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::yield_now();
    }
}
