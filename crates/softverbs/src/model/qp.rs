//! The queue-pair state machine (RC, UC, UD, XRC) and its flush rule.
//!
//! States and numbers are those of `enum ibv_qp_state`. A QP moved to ERR
//! flushes both queues: every outstanding receive (not those of an SRQ) and
//! every pending send completes with `IBV_WC_WR_FLUSH_ERR`, and anything
//! posted later completes the same way at once. RESET discards the queues
//! without completions.

/// `enum ibv_qp_type`: the transports this device implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum QpType {
    /// `IBV_QPT_RC`: reliable connected.
    Rc = 2,
    /// `IBV_QPT_UC`: unreliable connected (SEND, RDMA WRITE; no ACKs, no
    /// retries: a message the responder cannot take is dropped).
    Uc = 3,
    /// `IBV_QPT_UD`: unreliable datagram (SEND to an address handle).
    Ud = 4,
    /// `IBV_QPT_XRC_SEND`: the initiator of an extended reliable connection
    /// (RC semantics; each request names the responder's SRQ).
    XrcSend = 9,
    /// `IBV_QPT_XRC_RECV`: the target of an extended reliable connection,
    /// in an XRC domain; no send or receive queue of its own: requests go
    /// to the SRQ of the domain they name.
    XrcRecv = 10,
}

impl QpType {
    /// Decode an `ibv_qp_type`; others (raw packet, driver...) are `None`.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            2 => Self::Rc,
            3 => Self::Uc,
            4 => Self::Ud,
            9 => Self::XrcSend,
            10 => Self::XrcRecv,
            _ => return None,
        })
    }

    /// Whether a send work-request opcode is valid on this transport
    /// (`ibv_post_send(3)`'s table; others are EINVAL at post time).
    pub fn opcode_ok(self, op: u32) -> bool {
        use super::wc::wr;
        match self {
            Self::Rc => super::wc::send_wc_opcode(op).is_some(),
            Self::Uc => matches!(
                op,
                wr::SEND
                    | wr::SEND_WITH_IMM
                    | wr::RDMA_WRITE
                    | wr::RDMA_WRITE_WITH_IMM
                    | wr::LOCAL_INV
                    | wr::BIND_MW
                    | wr::SEND_WITH_INV
            ),
            Self::Ud => matches!(op, wr::SEND | wr::SEND_WITH_IMM),
            // RC's operations; windows are bound on RC/UC QPs.
            Self::XrcSend => {
                super::wc::send_wc_opcode(op).is_some()
                    && !matches!(op, wr::BIND_MW | wr::LOCAL_INV | wr::SEND_WITH_INV)
            }
            Self::XrcRecv => false,
        }
    }

    /// The transport a responder of this QP must have.
    pub fn peer(self) -> Self {
        match self {
            Self::XrcSend => Self::XrcRecv,
            t => t,
        }
    }

    /// Whether the responder acknowledges (RC and XRC): it NAKs what it
    /// cannot execute and enters ERR.
    pub fn reliable(self) -> bool {
        matches!(self, Self::Rc | Self::XrcSend | Self::XrcRecv)
    }

    /// Whether the QP has a receive queue of its own or an SRQ of its own
    /// (not the XRC QPs).
    pub fn has_recv_queue(self) -> bool {
        !matches!(self, Self::XrcSend | Self::XrcRecv)
    }

    /// The state a send-queue error leaves the QP in: ERR for RC (which
    /// also flushes the receive queue), SQE for UC and UD (InfiniBand's
    /// Send Queue Error state: later sends flush, receives go on, and
    /// `ibv_modify_qp` to RTS resumes).
    pub fn send_error_state(self) -> QpState {
        match self {
            Self::Rc | Self::XrcSend | Self::XrcRecv => QpState::Err,
            Self::Uc | Self::Ud => QpState::Sqe,
        }
    }
}

/// `enum ibv_qp_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum QpState {
    /// `IBV_QPS_RESET`.
    Reset = 0,
    /// `IBV_QPS_INIT`.
    Init = 1,
    /// `IBV_QPS_RTR`.
    Rtr = 2,
    /// `IBV_QPS_RTS`.
    Rts = 3,
    /// `IBV_QPS_SQD`.
    Sqd = 4,
    /// `IBV_QPS_SQE`.
    Sqe = 5,
    /// `IBV_QPS_ERR`.
    Err = 6,
}

impl QpState {
    /// Decode a state number; unknown values are `None`.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Reset,
            1 => Self::Init,
            2 => Self::Rtr,
            3 => Self::Rts,
            4 => Self::Sqd,
            5 => Self::Sqe,
            6 => Self::Err,
            _ => return None,
        })
    }

    /// Whether receives may be posted (INIT and later, ERR flushes them).
    pub fn can_post_recv(self) -> bool {
        !matches!(self, Self::Reset)
    }

    /// Whether sends may be posted (RTS, SQD; ERR flushes them).
    pub fn can_post_send(self) -> bool {
        matches!(self, Self::Rts | Self::Sqd | Self::Sqe | Self::Err)
    }

    /// Whether incoming requests are accepted (the responder side).
    pub fn accepts_incoming(self) -> bool {
        matches!(self, Self::Rtr | Self::Rts | Self::Sqd | Self::Sqe)
    }

    /// Whether incoming requests may still arrive later (not yet RTR).
    pub fn not_ready_yet(self) -> bool {
        matches!(self, Self::Reset | Self::Init)
    }
}

/// The requester's transport timeout of an RC QP: how long a request that
/// draws no answer at all (the responder's QP is gone or in ERR, its process
/// died, its device is dead) is retried before it completes with
/// `IBV_WC_RETRY_EXC_ERR`. From the QP's attributes, as on hardware: each
/// try waits for the local ACK timeout, 4.096 µs × 2^`timeout`, and there
/// are `retry_cnt` + 1 tries (the first send and `retry_cnt` retries).
/// `timeout` 0 means wait for ever (`ibv_modify_qp(3)`): `None`.
/// `timeout` is a 5-bit and `retry_cnt` a 3-bit field; larger values are
/// clamped to 31 and 7.
pub fn transport_timeout(timeout: u8, retry_cnt: u8) -> Option<std::time::Duration> {
    if timeout == 0 {
        return None;
    }
    let per_try_ns = 4096u64 << timeout.min(31);
    let tries = u64::from(retry_cnt.min(7)) + 1;
    Some(std::time::Duration::from_nanos(per_try_ns * tries))
}

/// The RNR NAK timer a responder's `min_rnr_timer` (0..31) encodes (IBA
/// table 45): how long a requester waits before it sends again a request
/// the responder had no receive for. 0 is the longest, 655.36 ms.
pub fn rnr_timer(code: u8) -> std::time::Duration {
    // In units of 10 µs, codes 0..31.
    const TEN_US: [u32; 32] = [
        65536, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
        1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152,
    ];
    std::time::Duration::from_micros(10 * u64::from(TEN_US[usize::from(code.min(31))]))
}

/// How long a requester keeps sending a request its responder has no
/// receive for before it completes it with `IBV_WC_RNR_RETRY_EXC_ERR`:
/// the first try and `rnr_retry` retries, each after the responder's RNR
/// timer. `rnr_retry` 7 retries for ever (`None`).
pub fn rnr_budget(rnr_retry: u8, timer: std::time::Duration) -> Option<std::time::Duration> {
    (rnr_retry < 7).then(|| timer * (u32::from(rnr_retry) + 1))
}

/// `IBV_QP_STATE` attribute-mask bit.
pub const ATTR_STATE: i32 = 1;
/// `IBV_QP_CUR_STATE`.
pub const ATTR_CUR_STATE: i32 = 1 << 1;
/// `IBV_QP_EN_SQD_ASYNC_NOTIFY`.
pub const ATTR_EN_SQD_ASYNC_NOTIFY: i32 = 1 << 2;
/// `IBV_QP_ACCESS_FLAGS`.
pub const ATTR_ACCESS_FLAGS: i32 = 1 << 3;
/// `IBV_QP_PKEY_INDEX`.
pub const ATTR_PKEY_INDEX: i32 = 1 << 4;
/// `IBV_QP_PORT`.
pub const ATTR_PORT: i32 = 1 << 5;
/// `IBV_QP_QKEY`.
pub const ATTR_QKEY: i32 = 1 << 6;
/// `IBV_QP_AV`.
pub const ATTR_AV: i32 = 1 << 7;
/// `IBV_QP_PATH_MTU`.
pub const ATTR_PATH_MTU: i32 = 1 << 8;
/// `IBV_QP_TIMEOUT`.
pub const ATTR_TIMEOUT: i32 = 1 << 9;
/// `IBV_QP_RETRY_CNT`.
pub const ATTR_RETRY_CNT: i32 = 1 << 10;
/// `IBV_QP_RNR_RETRY`.
pub const ATTR_RNR_RETRY: i32 = 1 << 11;
/// `IBV_QP_RQ_PSN`.
pub const ATTR_RQ_PSN: i32 = 1 << 12;
/// `IBV_QP_MAX_QP_RD_ATOMIC`.
pub const ATTR_MAX_QP_RD_ATOMIC: i32 = 1 << 13;
/// `IBV_QP_ALT_PATH`.
pub const ATTR_ALT_PATH: i32 = 1 << 14;
/// `IBV_QP_MIN_RNR_TIMER`.
pub const ATTR_MIN_RNR_TIMER: i32 = 1 << 15;
/// `IBV_QP_SQ_PSN`.
pub const ATTR_SQ_PSN: i32 = 1 << 16;
/// `IBV_QP_MAX_DEST_RD_ATOMIC`.
pub const ATTR_MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
/// `IBV_QP_PATH_MIG_STATE`.
pub const ATTR_PATH_MIG_STATE: i32 = 1 << 18;
/// `IBV_QP_DEST_QPN`.
pub const ATTR_DEST_QPN: i32 = 1 << 20;

/// Whether an RC QP may move from `from` to `to` (IB spec 11.6 / 10.3.1:
/// every state but Reset may go to Error; the kernel's table, which rxe
/// and every kernel driver apply, refuses RESET -> ERR with EINVAL).
pub fn transition_ok(from: QpState, to: QpState) -> bool {
    use QpState::*;
    matches!(
        (from, to),
        (_, Reset)
            | (Init | Rtr | Rts | Sqd | Sqe | Err, Err)
            | (Reset, Init)
            | (Init, Init)
            | (Init, Rtr)
            | (Rtr, Rts)
            | (Rts, Rts)
            | (Rts, Sqd)
            | (Sqd, Sqd)
            | (Sqd, Rts)
            | (Sqe, Rts)
    )
}

/// Whether `mask` is a valid attribute mask for moving a QP of type `ty`
/// from `from` to `to` (`to == from` when the mask has no state): it holds
/// every attribute the transition requires and none that it does not
/// allow, as the kernel's table (`ib_modify_qp_is_ok`, which every kernel
/// driver and rxe apply) has it, and `IBV_QP_CUR_STATE` only from RTR, RTS,
/// SQD or SQE. A mask a real device refuses is refused here too (EINVAL),
/// so a program that works here works there. As the kernel's uverbs layer
/// does before it checks, the fields an XRC QP ignores are taken out
/// first (an initiator's responder attributes, a target's requester ones:
/// perftest sets them on both).
pub fn attrs_ok(ty: QpType, from: QpState, to: QpState, mask: i32) -> bool {
    let mask = match ty {
        QpType::XrcSend => mask & !(ATTR_MAX_DEST_RD_ATOMIC | ATTR_MIN_RNR_TIMER),
        QpType::XrcRecv => mask & !(ATTR_MAX_QP_RD_ATOMIC | ATTR_RETRY_CNT | ATTR_RNR_RETRY),
        _ => mask,
    };
    if mask & ATTR_CUR_STATE != 0
        && !matches!(
            from,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        )
    {
        return false;
    }
    let (req, opt) = transition_attrs(ty, from, to);
    mask & req == req && mask & !(req | opt | ATTR_STATE) == 0
}

/// The attributes a transition requires and those it allows besides
/// (`attrs_ok`).
fn transition_attrs(ty: QpType, from: QpState, to: QpState) -> (i32, i32) {
    use QpState::*;
    use QpType::*;
    const ALT: i32 = ATTR_ALT_PATH;
    const MIG: i32 = ATTR_PATH_MIG_STATE;
    const CUR: i32 = ATTR_CUR_STATE;
    // INIT's attributes: UD's Q_Key where the others have access flags.
    let init = match ty {
        Ud => ATTR_PKEY_INDEX | ATTR_PORT | ATTR_QKEY,
        _ => ATTR_PKEY_INDEX | ATTR_PORT | ATTR_ACCESS_FLAGS,
    };
    // What RTS -> RTS (and SQD -> RTS) may change.
    let rts_opt = match ty {
        Ud => CUR | ATTR_QKEY,
        Uc | XrcSend => CUR | ALT | ATTR_ACCESS_FLAGS | MIG,
        Rc | XrcRecv => CUR | ALT | ATTR_ACCESS_FLAGS | ATTR_MIN_RNR_TIMER | MIG,
    };
    match (from, to) {
        (Reset, Init) => (init, 0),
        (Init, Init) => (0, init),
        (Init, Rtr) => {
            let path = ATTR_AV | ATTR_PATH_MTU | ATTR_DEST_QPN | ATTR_RQ_PSN;
            match ty {
                Ud => (0, ATTR_PKEY_INDEX | ATTR_QKEY),
                Uc | XrcSend => (path, ALT | ATTR_ACCESS_FLAGS | ATTR_PKEY_INDEX),
                Rc | XrcRecv => (
                    path | ATTR_MAX_DEST_RD_ATOMIC | ATTR_MIN_RNR_TIMER,
                    ALT | ATTR_ACCESS_FLAGS | ATTR_PKEY_INDEX,
                ),
            }
        }
        (Rtr, Rts) => {
            let req = match ty {
                Ud | Uc => ATTR_SQ_PSN,
                Rc | XrcSend => {
                    ATTR_TIMEOUT
                        | ATTR_RETRY_CNT
                        | ATTR_RNR_RETRY
                        | ATTR_SQ_PSN
                        | ATTR_MAX_QP_RD_ATOMIC
                }
                XrcRecv => ATTR_TIMEOUT | ATTR_SQ_PSN,
            };
            (req, rts_opt)
        }
        (Rts | Sqd, Rts) => (0, rts_opt),
        (Rts, Sqd) => (0, ATTR_EN_SQD_ASYNC_NOTIFY),
        (Sqd, Sqd) => {
            let common = ALT | ATTR_ACCESS_FLAGS | ATTR_PKEY_INDEX | MIG;
            let opt = match ty {
                Ud => ATTR_PKEY_INDEX | ATTR_QKEY,
                Uc => ATTR_AV | common,
                Rc => {
                    ATTR_PORT
                        | ATTR_AV
                        | ATTR_TIMEOUT
                        | ATTR_RETRY_CNT
                        | ATTR_RNR_RETRY
                        | ATTR_MAX_QP_RD_ATOMIC
                        | ATTR_MAX_DEST_RD_ATOMIC
                        | ATTR_MIN_RNR_TIMER
                        | common
                }
                XrcSend => {
                    ATTR_PORT
                        | ATTR_AV
                        | ATTR_TIMEOUT
                        | ATTR_RETRY_CNT
                        | ATTR_RNR_RETRY
                        | ATTR_MAX_QP_RD_ATOMIC
                        | common
                }
                XrcRecv => {
                    ATTR_PORT
                        | ATTR_AV
                        | ATTR_TIMEOUT
                        | ATTR_MAX_DEST_RD_ATOMIC
                        | ATTR_MIN_RNR_TIMER
                        | common
                }
            };
            (0, opt)
        }
        (Sqe, Rts) => match ty {
            Ud => (0, CUR | ATTR_QKEY),
            Uc => (0, CUR | ATTR_ACCESS_FLAGS),
            _ => (0, 0),
        },
        // To RESET or ERR, and RESET -> RESET: the state alone.
        _ => (0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rc_path_and_errors() {
        use QpState::*;
        assert!(transition_ok(Reset, Init));
        assert!(transition_ok(Init, Rtr));
        assert!(transition_ok(Rtr, Rts));
        assert!(transition_ok(Rts, Err));
        assert!(transition_ok(Err, Reset));
        assert!(!transition_ok(Reset, Rts));
        assert!(!transition_ok(Err, Rts));
        // The kernel's table (measured on rxe by examples/verbs_probe).
        assert!(!transition_ok(Reset, Err));
        assert!(transition_ok(Reset, Reset));
        assert!(transition_ok(Init, Err) && transition_ok(Err, Err));
        assert!(!transition_ok(Rtr, Rtr) && !transition_ok(Rtr, Init));
        let rc_rtr = ATTR_STATE
            | ATTR_AV
            | ATTR_PATH_MTU
            | ATTR_DEST_QPN
            | ATTR_RQ_PSN
            | ATTR_MAX_DEST_RD_ATOMIC
            | ATTR_MIN_RNR_TIMER;
        assert!(attrs_ok(QpType::Rc, Init, Rtr, rc_rtr));
        assert!(!attrs_ok(
            QpType::Rc,
            Init,
            Rtr,
            rc_rtr & !ATTR_MIN_RNR_TIMER
        ));
        let rc_rts = ATTR_STATE
            | ATTR_TIMEOUT
            | ATTR_RETRY_CNT
            | ATTR_RNR_RETRY
            | ATTR_SQ_PSN
            | ATTR_MAX_QP_RD_ATOMIC;
        assert!(attrs_ok(QpType::Rc, Rtr, Rts, rc_rts));
        // RTS -> RTS may not set what RTR -> RTS required (measured on rxe).
        assert!(!attrs_ok(QpType::Rc, Rts, Rts, rc_rts));
        assert!(attrs_ok(
            QpType::Rc,
            Rts,
            Rts,
            ATTR_STATE | ATTR_MIN_RNR_TIMER
        ));
        let ud_init = ATTR_STATE | ATTR_PKEY_INDEX | ATTR_PORT | ATTR_QKEY;
        assert!(attrs_ok(QpType::Ud, Reset, Init, ud_init));
        assert!(!attrs_ok(QpType::Ud, Reset, Init, ud_init & !ATTR_QKEY));
        assert!(attrs_ok(QpType::Ud, Init, Rtr, ATTR_STATE));
        assert!(!attrs_ok(QpType::Ud, Rtr, Rts, ATTR_STATE));
        assert!(attrs_ok(QpType::Ud, Rtr, Rts, ATTR_STATE | ATTR_SQ_PSN));
        // CUR_STATE only from RTR, RTS, SQD, SQE.
        assert!(!attrs_ok(
            QpType::Rc,
            Init,
            Init,
            ATTR_STATE | ATTR_CUR_STATE
        ));
        assert!(attrs_ok(QpType::Rc, Rts, Rts, ATTR_STATE | ATTR_CUR_STATE));
        assert!(attrs_ok(QpType::Rc, Rts, Err, ATTR_STATE));
        // XRC: the fields a side ignores are taken out first, as uverbs
        // does (perftest's -c XRC sets RC's whole RTR and RTS masks).
        assert!(attrs_ok(QpType::XrcSend, Init, Rtr, rc_rtr));
        assert!(attrs_ok(QpType::XrcRecv, Rtr, Rts, rc_rts));
        assert!(!attrs_ok(QpType::XrcSend, Init, Rtr, rc_rtr & !ATTR_RQ_PSN));
        assert!(!attrs_ok(QpType::Rc, Rts, Err, ATTR_STATE | ATTR_TIMEOUT));
        assert!(transition_ok(Sqe, Rts));
        for v in 0..7 {
            assert_eq!(QpState::from_u32(v).map(|s| s as u32), Some(v));
        }
        assert_eq!(QpState::from_u32(99), None);
    }

    #[test]
    fn opcodes_per_transport() {
        use crate::model::wc::wr;
        assert!(QpType::Rc.opcode_ok(wr::ATOMIC_FETCH_AND_ADD));
        assert!(QpType::Uc.opcode_ok(wr::RDMA_WRITE_WITH_IMM));
        assert!(!QpType::Uc.opcode_ok(wr::RDMA_READ));
        assert!(!QpType::Uc.opcode_ok(wr::ATOMIC_CMP_AND_SWP));
        assert!(QpType::Ud.opcode_ok(wr::SEND_WITH_IMM));
        assert!(!QpType::Ud.opcode_ok(wr::RDMA_WRITE));
        assert!(QpType::XrcSend.opcode_ok(wr::RDMA_READ));
        assert!(!QpType::XrcSend.opcode_ok(wr::BIND_MW));
        assert!(!QpType::XrcRecv.opcode_ok(wr::SEND));
        assert_eq!(QpType::XrcSend.peer(), QpType::XrcRecv);
        assert_eq!(QpType::Rc.peer(), QpType::Rc);
        assert_eq!(QpType::from_u32(9), Some(QpType::XrcSend));
        assert_eq!(QpType::from_u32(4), Some(QpType::Ud));
        assert_eq!(QpType::from_u32(8), None, "raw packet");
        assert_eq!(QpType::Ud.send_error_state(), QpState::Sqe);
    }

    #[test]
    fn rnr_budget_is_the_responders_timer_times_tries() {
        use std::time::Duration;
        assert_eq!(rnr_timer(0), Duration::from_micros(655_360));
        assert_eq!(rnr_timer(1), Duration::from_micros(10));
        assert_eq!(rnr_timer(12), Duration::from_micros(640));
        assert_eq!(rnr_timer(31), Duration::from_micros(491_520));
        assert_eq!(rnr_timer(99), rnr_timer(31));
        assert_eq!(rnr_budget(7, rnr_timer(12)), None, "7: for ever");
        assert_eq!(rnr_budget(0, rnr_timer(1)), Some(Duration::from_micros(10)));
        assert_eq!(
            rnr_budget(6, rnr_timer(12)),
            Some(Duration::from_micros(640 * 7))
        );
    }

    #[test]
    fn transport_timeout_is_ack_timeout_times_tries() {
        use std::time::Duration;
        assert_eq!(transport_timeout(0, 7), None, "0: infinite");
        // ibv_rc_pingpong / perftest: 14 and 7: 67.1 ms × 8.
        assert_eq!(
            transport_timeout(14, 7),
            Some(Duration::from_nanos(4096 * (1 << 14) * 8))
        );
        assert_eq!(transport_timeout(1, 0), Some(Duration::from_nanos(8192)));
        assert_eq!(transport_timeout(40, 9), transport_timeout(31, 7));
    }
}
