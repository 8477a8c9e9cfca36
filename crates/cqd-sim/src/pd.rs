//! Protection domains: memory regions, QPs and SRQs are made in one, and a
//! request may only use regions of its QP's domain.

use std::collections::VecDeque;
use std::sync::Arc;

use cqd_core::ledger::{CloseSignal, Queue, QueueAccount};
use parking_lot::Mutex;

use crate::device::{Cq, Device};
use crate::error::VerbsError;
use crate::mr::{Access, Mr, MrCtx, ADDR_SHIFT};
use crate::qp::{Qp, QpCap, QpState, QpType};
use crate::srq::Srq;
use crate::state::{QpCtx, SrqCtx};

/// How a QP is made (`ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy)]
pub struct QpInit<'a> {
    /// Where send-side completions go; its budget admits `max_send_wr`.
    pub send_cq: &'a Cq,
    /// Where receive completions go; its budget admits `max_recv_wr`, or
    /// the SRQ's depth once.
    pub recv_cq: &'a Cq,
    /// Draw receives from this SRQ instead of a receive queue.
    pub srq: Option<&'a Srq>,
    /// Depths and SGE limits.
    pub cap: QpCap,
    /// Every send-side request completes signaled.
    pub sq_sig_all: bool,
    /// The transport: RC (the default) or UD.
    pub qp_type: QpType,
}

/// A zeroed buffer of `len` bytes with every page faulted in, as
/// registration pins a real region's pages (`ibv_reg_mr` faults them in
/// writable). Without it the first write to each page of a fresh region
/// takes a copy-on-write fault and a TLB shoot-down in the middle of the
/// traffic, a cost no registered memory has.
fn pinned(len: usize) -> Vec<u8> {
    const PAGE: usize = 4096;
    let mut buf = vec![0u8; len];
    // black_box: the compiler may not assume the pages are zero and drop
    // the stores.
    let pages = std::hint::black_box(&mut buf[..]);
    for p in pages.chunks_mut(PAGE) {
        p[0] = 0;
    }
    buf
}

impl<'a> QpInit<'a> {
    /// A QP on `send_cq` / `recv_cq` with `cap`, no SRQ, selective signaling.
    pub fn new(send_cq: &'a Cq, recv_cq: &'a Cq, cap: QpCap) -> Self {
        QpInit {
            send_cq,
            recv_cq,
            srq: None,
            cap,
            sq_sig_all: false,
            qp_type: QpType::Rc,
        }
    }

    /// An unreliable-datagram QP (see [`crate::ah`]).
    pub fn datagram(mut self) -> Self {
        self.qp_type = QpType::Ud;
        self
    }

    /// Draws receives from `srq`.
    pub fn with_srq(mut self, srq: &'a Srq) -> Self {
        self.srq = Some(srq);
        self
    }
}

/// A protection domain. Cloneable.
#[derive(Debug, Clone)]
pub struct Pd {
    pub(crate) device: Device,
    pub(crate) id: u32,
}

impl Pd {
    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Registers a zeroed buffer of `len` bytes (`u64`, as every length and
    /// offset into a region is).
    ///
    /// # Errors
    /// [`VerbsError::LimitExceeded`] above `max_mr_size`.
    pub fn reg_mr(&self, len: u64, access: Access) -> Result<Mr, VerbsError> {
        self.device.check_present()?;
        let max = self.device.inner.attr.max_mr_size.min(1 << ADDR_SHIFT);
        let too_big = || VerbsError::LimitExceeded {
            what: "max_mr_size",
            requested: len,
            max,
        };
        if len > max {
            return Err(too_big());
        }
        let len = usize::try_from(len).map_err(|_| too_big())?;
        let fabric = self.device.fabric.clone();
        let buf = Arc::new(Mutex::new(pinned(len)));
        let mut st = fabric.core.state.lock();
        st.next_mr += 1;
        let id = st.next_mr;
        let base = u64::from(id) << ADDR_SHIFT;
        st.mrs.insert(
            id,
            MrCtx {
                pd: self.id,
                base,
                access,
                buf: Arc::clone(&buf),
                len: len as u64,
            },
        );
        drop(st);
        Ok(Mr {
            fabric,
            id,
            base,
            len: len as u64,
            access,
            buf,
        })
    }

    fn check_cap(&self, what: &'static str, v: u32, max: u32) -> Result<(), VerbsError> {
        if v > max {
            return Err(VerbsError::LimitExceeded {
                what,
                requested: u64::from(v),
                max: u64::from(max),
            });
        }
        Ok(())
    }

    /// Creates a QP (RC, or UD with [`QpInit::datagram`]) in RESET, reserving its depths on its CQs' budgets
    /// (admission): `max_send_wr` on the send CQ, `max_recv_wr` on the
    /// receive CQ, or the SRQ's depth once per CQ.
    ///
    /// # Errors
    /// [`VerbsError::LimitExceeded`] beyond the device's attributes;
    /// [`VerbsError::Foreign`] for CQs or an SRQ of another device or
    /// domain; [`VerbsError::Budget`] when a CQ cannot admit the QP (nothing
    /// is reserved then).
    pub fn create_qp(&self, init: &QpInit<'_>) -> Result<Qp, VerbsError> {
        self.device.check_present()?;
        let attr = self.device.inner.attr;
        let cap = init.cap;
        self.check_cap("max_qp_wr", cap.max_send_wr, attr.max_qp_wr)?;
        self.check_cap("max_sge", cap.max_send_sge, attr.max_sge)?;
        self.check_cap("max_sge", cap.max_recv_sge, attr.max_sge)?;
        if init.srq.is_none() {
            self.check_cap("max_qp_wr", cap.max_recv_wr, attr.max_qp_wr)?;
        }
        for cq in [init.send_cq, init.recv_cq] {
            if cq.inner.device != self.device.inner.id {
                return Err(VerbsError::Foreign {
                    what: "CQ",
                    owner: "device",
                });
            }
        }
        let fabric = self.device.fabric.clone();
        let mut st = fabric.core.state.lock();
        st.sweep_destroyed();
        let live = st
            .qps
            .values()
            .filter(|q| q.device == self.device.inner.id)
            .count();
        self.check_cap("max_qp", live as u32 + 1, attr.max_qp)?;
        let qpn = st.next_qpn;
        let mut admissions = Vec::with_capacity(2);
        admissions.push(
            init.send_cq
                .budget()
                .admit(&format!("QP {qpn} send queue"), cap.max_send_wr)?,
        );
        let srq = match init.srq {
            Some(srq) => {
                let s = st
                    .srqs
                    .get_mut(&srq.id)
                    .ok_or(VerbsError::Destroyed { what: "SRQ" })?;
                if s.pd != self.id || s.device != self.device.inner.id {
                    return Err(VerbsError::Foreign {
                        what: "SRQ",
                        owner: "protection domain",
                    });
                }
                admissions.push(init.recv_cq.budget().admit_srq(srq.id, s.max_wr)?);
                s.users += 1;
                Some(srq.id)
            }
            None => {
                admissions.push(
                    init.recv_cq
                        .budget()
                        .admit(&format!("QP {qpn} receive queue"), cap.max_recv_wr)?,
                );
                None
            }
        };
        // An SRQ serves the handlers of one CQ: refused before anything
        // is made.
        let srq_user = match init.srq {
            Some(srq) => Some(init.recv_cq.ledger().attach_srq_user(qpn, &srq.account)?),
            None => None,
        };
        st.next_qpn += 1;
        let send_account = init.send_cq.ledger().open_queue(qpn, Queue::Send);
        send_account.reserve(init.cap.max_send_wr);
        let recv_account = match init.srq {
            Some(srq) => Arc::clone(&srq.account),
            None => {
                let a = init.recv_cq.ledger().open_queue(qpn, Queue::Recv);
                a.reserve(init.cap.max_recv_wr);
                a
            }
        };
        st.qps.insert(
            qpn,
            QpCtx {
                qpn,
                device: self.device.inner.id,
                pd: self.id,
                state: QpState::Reset,
                qp_type: init.qp_type,
                qkey: 0,
                mtu: attr.active_mtu,
                cap,
                send_cq: init.send_cq.clone(),
                recv_cq: init.recv_cq.clone(),
                srq,
                sq_sig_all: init.sq_sig_all,
                access: Access::default(),
                remote: None,
                rnr_retry: 7,
                max_msg: attr.max_msg_sz,
                sq_done: VecDeque::new(),
                sq_pending: VecDeque::new(),
                rq: VecDeque::new(),
                rq_done: VecDeque::new(),
                _admissions: admissions,
                destroyed: false,
                last_wqe: false,
            },
        );
        drop(st);
        Ok(Qp {
            fabric,
            qpn,
            qp_type: init.qp_type,
            mtu: attr.active_mtu,
            device: Arc::clone(&self.device.inner),
            send_account,
            recv_account,
            srq_user,
            recv_ledger: init.recv_cq.ledger().clone(),
            closed: CloseSignal::new(),
        })
    }

    /// Creates a shared receive queue of `max_wr` receives of up to
    /// `max_sge` SGEs.
    ///
    /// # Errors
    /// [`VerbsError::LimitExceeded`] beyond `max_srq`, `max_srq_wr` or
    /// `max_sge`.
    pub fn create_srq(&self, max_wr: u32, max_sge: u32) -> Result<Srq, VerbsError> {
        self.device.check_present()?;
        let attr = self.device.inner.attr;
        self.check_cap("max_srq_wr", max_wr, attr.max_srq_wr)?;
        self.check_cap("max_sge", max_sge, attr.max_sge)?;
        let fabric = self.device.fabric.clone();
        let mut st = fabric.core.state.lock();
        let live = st
            .srqs
            .values()
            .filter(|s| s.device == self.device.inner.id)
            .count();
        self.check_cap("max_srq", live as u32 + 1, attr.max_srq)?;
        st.next_srq += 1;
        let id = st.next_srq;
        st.srqs.insert(
            id,
            SrqCtx {
                pd: self.id,
                device: self.device.inner.id,
                max_wr,
                max_sge,
                rq: VecDeque::new(),
                done: Vec::new(),
                users: 0,
            },
        );
        drop(st);
        let account = QueueAccount::srq(id);
        account.reserve(max_wr);
        Ok(Srq {
            fabric,
            id,
            account,
        })
    }
}
