//! Completion-queue arm rule.
//!
//! 1. `req_notify_cq(solicited_only)` arms the CQ: `ARM_ANY` or `ARM_SOLICITED`.
//! 2. When a completion is added, [`fires`] decides whether the arm fires.
//! 3. A firing arm is consumed (back to `DISARMED`): exactly one event per arm;
//!    without an arm, no event.
//! 4. An arm that does not fire (solicited-only, unsolicited success) stays.
//!
//! Overflow: a completion that finds the CQ full is lost and the CQ enters the
//! error state; the owner gets one asynchronous `IBV_EVENT_CQ_ERR`.

/// Not armed.
pub const DISARMED: u32 = 0;
/// Armed for the next completion.
pub const ARM_ANY: u32 = 1;
/// Armed for the next solicited (or unsuccessful) completion.
pub const ARM_SOLICITED: u32 = 2;

/// `IBV_EVENT_CQ_ERR`, the asynchronous event of an overflowed CQ.
pub const EVENT_CQ_ERR: u32 = 0;

/// The arm state `req_notify_cq` installs.
pub fn arm_state(solicited_only: bool) -> u32 {
    if solicited_only {
        ARM_SOLICITED
    } else {
        ARM_ANY
    }
}

/// Whether a completion fires an arm in state `arm`.
///
/// `solicited` is true for a receive completion of a SEND/WRITE-with-immediate
/// that carried `IBV_SEND_SOLICITED`; `success` is false for error completions,
/// which also satisfy a solicited-only arm.
pub fn fires(arm: u32, solicited: bool, success: bool) -> bool {
    match arm {
        ARM_ANY => true,
        ARM_SOLICITED => solicited || !success,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arm_rule() {
        assert!(!fires(DISARMED, true, true));
        assert!(fires(ARM_ANY, false, true));
        assert!(!fires(ARM_SOLICITED, false, true));
        assert!(fires(ARM_SOLICITED, true, true));
        assert!(fires(ARM_SOLICITED, false, false));
        assert_eq!(arm_state(true), ARM_SOLICITED);
    }
}
