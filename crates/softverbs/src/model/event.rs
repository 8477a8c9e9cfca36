//! Affiliated asynchronous events of queue pairs and shared receive queues
//! (`enum ibv_event_type`), and when the responder raises them.
//!
//! Responder errors (InfiniBand RC responder behaviour): when the responder
//! detects that an incoming request cannot be executed, it NAKs it (the
//! requester's completion), moves its own QP to ERR (its posted receives are
//! flushed, a QP on an SRQ later gets [`QP_LAST_WQE_REACHED`]) and reports
//! the error on its side:
//!
//! | requester completion | responder side |
//! |---|---|
//! | `REM_ACCESS_ERR` (R_Key, range, access, QP access flags) | [`QP_ACCESS_ERR`]; a WRITE-with-immediate's receive, if consumed, completes `LOC_PROT_ERR` |
//! | `REM_INV_REQ_ERR` (SEND longer than the receive WQE) | the receive completes `LOC_LEN_ERR`, and [`QP_REQ_ERR`] |
//! | `REM_OP_ERR` (the responder's own receive WQE is unusable: bad L_Key, unmapped) | the receive completes `LOC_PROT_ERR`; no event (the completion reports it) |
//!
//! Last WQE reached: a QP attached to an SRQ that enters ERR (by
//! `ibv_modify_qp` or by an error) gets one [`QP_LAST_WQE_REACHED`] once no
//! receive WQE it took from the SRQ is still being completed; one per stay
//! in ERR (RESET re-arms it).

use super::wc::WcStatus;

/// `IBV_EVENT_QP_REQ_ERR`: invalid request local work queue error.
pub const QP_REQ_ERR: u32 = 2;
/// `IBV_EVENT_QP_ACCESS_ERR`: local access violation work queue error.
pub const QP_ACCESS_ERR: u32 = 3;
/// `IBV_EVENT_SRQ_LIMIT_REACHED`.
pub const SRQ_LIMIT_REACHED: u32 = 15;
/// `IBV_EVENT_QP_LAST_WQE_REACHED`.
pub const QP_LAST_WQE_REACHED: u32 = 16;

/// Whether an event type names a QP (`element.qp`), as libibverbs decodes
/// the record: QP_FATAL .. PATH_MIG_ERR and QP_LAST_WQE_REACHED.
pub fn names_qp(ty: u32) -> bool {
    matches!(ty, 1..=7 | QP_LAST_WQE_REACHED)
}

/// Whether an event type names an SRQ (`element.srq`): SRQ_ERR and
/// SRQ_LIMIT_REACHED.
pub fn names_srq(ty: u32) -> bool {
    matches!(ty, 14 | SRQ_LIMIT_REACHED)
}

/// What the responder does when a request fails with the requester-side
/// status `requester`: `None` when the responder is not involved (the
/// error is the requester's own or the responder never answered),
/// `Some(event)` when its QP goes to ERR, with the event it raises, if any.
pub fn responder_error(requester: WcStatus) -> Option<Option<u32>> {
    match requester {
        WcStatus::RemAccessErr => Some(Some(QP_ACCESS_ERR)),
        WcStatus::RemInvReqErr => Some(Some(QP_REQ_ERR)),
        WcStatus::RemOpErr => Some(None),
        _ => None,
    }
}

/// The SRQ limit rule (`ibv_modify_srq(3)`): an SRQ armed with `limit` > 0
/// raises one [`SRQ_LIMIT_REACHED`] when a receive is taken from it and
/// fewer than `limit` remain; the limit is then disarmed (reads back 0)
/// until armed again. Arming while already below the limit fires at the
/// next receive taken.
pub fn srq_limit_fires(limit: u32, outstanding: usize) -> bool {
    limit != 0 && outstanding < limit as usize
}

/// Whether `limit` may arm an SRQ of `capacity` receives (0 disarms).
pub fn srq_limit_ok(limit: u32, capacity: usize) -> bool {
    limit as usize <= capacity
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_the_abi_ones() {
        assert_eq!((QP_REQ_ERR, QP_ACCESS_ERR), (2, 3));
        assert_eq!((SRQ_LIMIT_REACHED, QP_LAST_WQE_REACHED), (15, 16));
        assert!(names_qp(QP_ACCESS_ERR) && names_qp(QP_LAST_WQE_REACHED));
        assert!(!names_qp(0) && !names_qp(8) && !names_qp(SRQ_LIMIT_REACHED));
        assert!(names_srq(SRQ_LIMIT_REACHED) && !names_srq(QP_LAST_WQE_REACHED));
    }

    #[test]
    fn responder_rule() {
        assert_eq!(
            responder_error(WcStatus::RemAccessErr),
            Some(Some(QP_ACCESS_ERR))
        );
        assert_eq!(
            responder_error(WcStatus::RemInvReqErr),
            Some(Some(QP_REQ_ERR))
        );
        assert_eq!(responder_error(WcStatus::RemOpErr), Some(None));
        assert_eq!(responder_error(WcStatus::RetryExcErr), None);
        assert_eq!(responder_error(WcStatus::LocProtErr), None);
    }

    #[test]
    fn limit_rule() {
        assert!(!srq_limit_fires(0, 0));
        assert!(!srq_limit_fires(4, 4));
        assert!(srq_limit_fires(4, 3));
        assert!(srq_limit_ok(0, 8) && srq_limit_ok(8, 8) && !srq_limit_ok(9, 8));
    }
}
