//! The fabric, devices and their CQs.
//!
//! A [`Fabric`] is the wire and the NIC engine: every device opened on it
//! can connect its QPs to every other QP of the fabric, and one engine
//! executes their work requests (see [`crate::engine`]). A [`Device`] has
//! attributes ([`DeviceAttr`]) that every creation is checked against. A
//! [`Cq`] is a simulated CQ ([`crate::cq`]) with its
//! [`CqBudget`]: QPs created on it reserve their
//! depths there (admission), and its producer side is what the NIC pushes
//! completions to.
//!
//! All NIC state of a fabric lives behind one lock; the NIC never calls user
//! code while holding it.
//!
//! A tour: two connected QPs, a receive, a SEND with immediate data, and
//! the completions dispatched by a real poller to a handler.
//!
//! ```
//! use std::collections::VecDeque;
//! use cqd_core::{CqOptions, Failed, Handler, NoWork, Outbox, RecvDone, SendDone};
//! use cqd_sim::{connect, Access, CqConfig, Device, QpCap, QpInit, RecvWr, SendWr, WrOp};
//!
//! struct Print;
//! impl Handler for Print {
//!     fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
//!         assert_eq!(d.tag(), 1);
//!     }
//!     fn on_recv(&mut self, d: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {
//!         assert_eq!((d.tag(), d.byte_len(), d.imm()), (2, 5, Some(7)));
//!     }
//!     fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
//!         panic!("{}", f.status());
//!     }
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = Device::open("sim0");
//! // The CQ, its poller and its handle, with its budget and ledger attached.
//! let (cq, poller, handle) =
//!     dev.create_dispatched_cq::<NoWork>("cq0", 256, CqConfig::default(), CqOptions::default())?;
//! let reg = handle.register(Print)?;
//! let mut poller = poller.bind();
//!
//! let pd = dev.alloc_pd();
//! // Admission: each QP reserves 64 + 64 entries of the CQ's 256.
//! let a = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?;
//! let b = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?;
//! connect(&a, &b)?;
//! let mr = pd.reg_mr(4096, Access::LOCAL_WRITE)?;
//! mr.write(0, b"hello")?;
//!
//! // One call per post: the wr_id field carries the tag in, the encoded
//! // wr_id out; the handler's ledger and the queue's account are kept.
//! reg.post_recv(&b, &mut [RecvWr::new(2, &[mr.sge(1024, 64)])])?;
//! reg.post_send(&a, &mut [SendWr::new(1, WrOp::SendWithImm(7), &[mr.sge(0, 5)])])?;
//!
//! let mut out = VecDeque::new();
//! assert_eq!(poller.poll_once(&mut out)?, 2);
//! let mut got = [0u8; 5];
//! mr.read(1024, &mut got)?;
//! assert_eq!(&got, b"hello");
//! assert_eq!(reg.ledger().outstanding(), 0);
//! # Ok(())
//! # }
//! ```

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cqd_core::budget::{BudgetOptions, BudgetSnapshot, CqBudget};
use cqd_core::ledger::WrLedger;
use cqd_core::{split, CqHandle, CqOptions, UnboundCq};
use parking_lot::Mutex;

use crate::cq::{sim_cq_with_ledger, Faults, SimChannel, SimCq, SimCqSource, MAX_CQE};
use crate::error::VerbsError;
use crate::fabric::Fabric;
use crate::pd::Pd;

/// Device attributes (`ibv_device_attr`), checked on every creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest CQ.
    pub max_cqe: u32,
    /// Most QPs.
    pub max_qp: u32,
    /// Deepest send or receive queue.
    pub max_qp_wr: u32,
    /// Most SGEs per work request.
    pub max_sge: u32,
    /// Most SRQs.
    pub max_srq: u32,
    /// Deepest SRQ.
    pub max_srq_wr: u32,
    /// Largest memory region.
    pub max_mr_size: u64,
    /// Largest message.
    pub max_msg_sz: u32,
    /// The port's MTU: the largest datagram a UD QP sends.
    pub active_mtu: u32,
}

impl Default for DeviceAttr {
    fn default() -> Self {
        DeviceAttr {
            max_cqe: MAX_CQE,
            max_qp: 1 << 17,
            max_qp_wr: 32_768,
            max_sge: 30,
            max_srq: 1 << 12,
            max_srq_wr: 32_768,
            max_mr_size: 1 << 32,
            max_msg_sz: 1 << 30,
            active_mtu: 4096,
        }
    }
}

#[derive(Debug)]
pub(crate) struct DeviceInner {
    pub(crate) id: u32,
    pub(crate) name: String,
    pub(crate) attr: DeviceAttr,
    /// The device's CQs (to make them vanish with it).
    pub(crate) cqs: Mutex<Vec<std::sync::Weak<CqInner>>>,
    pub(crate) vanished: AtomicBool,
}

/// An RDMA device on a fabric. Cloneable.
#[derive(Debug, Clone)]
pub struct Device {
    pub(crate) fabric: Fabric,
    pub(crate) inner: Arc<DeviceInner>,
}

/// How a CQ is made.
#[derive(Debug, Clone, Default)]
pub struct CqConfig {
    /// Notification faults of the CQ.
    pub faults: Faults,
    /// The CQ budget's switches (admission on by default).
    pub budget: BudgetOptions,
    /// The completion channel the CQ notifies through, shared with other
    /// CQs (`ibv_create_cq`'s `channel`); `None` (the default): a
    /// descriptor of its own.
    pub channel: Option<SimChannel>,
}

impl Device {
    /// A device on its own fabric with the inline engine.
    pub fn open(name: impl Into<String>) -> Device {
        Fabric::inline().open_device(name, DeviceAttr::default())
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's attributes.
    pub fn attr(&self) -> DeviceAttr {
        self.inner.attr
    }

    /// The LID of the device's port (what an address handle names).
    pub fn lid(&self) -> u16 {
        crate::ah::lid_of(self.inner.id)
    }

    /// The GID of the device's port (GID index 0; a global address
    /// handle names it).
    pub fn gid(&self) -> [u8; 16] {
        crate::ah::gid_of(self.inner.id)
    }

    /// The fabric the device is on.
    pub fn fabric(&self) -> &Fabric {
        &self.fabric
    }

    /// Makes a CQ of `cqe` entries: the NIC's side ([`Cq`], which QPs are
    /// created on) and the [`SimCqSource`] a poller owns
    /// (`cqd_core::split`).
    ///
    /// # Errors
    /// [`VerbsError::LimitExceeded`] above `max_cqe`; [`VerbsError::Cq`].
    pub fn create_cq(
        &self,
        name: impl Into<String>,
        cqe: u32,
        config: CqConfig,
    ) -> Result<(Cq, SimCqSource), VerbsError> {
        self.check_present()?;
        let max = self.inner.attr.max_cqe;
        if cqe > max {
            return Err(VerbsError::LimitExceeded {
                what: "max_cqe",
                requested: u64::from(cqe),
                max: u64::from(max),
            });
        }
        let name = name.into();
        let budget = CqBudget::new(name.clone(), cqe, config.budget);
        let ledger = WrLedger::with_budget(budget.clone());
        let (producer, source) = match &config.channel {
            Some(chan) => chan.cq_with_ledger(name, cqe, config.faults, ledger.clone())?,
            None => sim_cq_with_ledger(name, cqe, config.faults, ledger.clone())?,
        };
        let cq = Cq {
            inner: Arc::new(CqInner {
                device: self.inner.id,
                producer,
                ledger,
                budget,
            }),
        };
        let mut cqs = self.inner.cqs.lock();
        cqs.retain(|w| w.strong_count() > 0);
        cqs.push(Arc::downgrade(&cq.inner));
        Ok((cq, source))
    }

    /// Makes a CQ ready for dispatch in one step: the NIC's side, and the
    /// two halves of its poller (`cqd_core::split`: the [`UnboundCq`] to
    /// bind on the polling thread, the [`CqHandle`]) with the CQ's budget
    /// and queue ledger already attached, so that the poller retires every
    /// request posted through a registration and returns its credits.
    ///
    /// # Errors
    /// As [`create_cq`](Self::create_cq); [`VerbsError::Split`] when the
    /// poller's doorbell cannot be made.
    pub fn create_dispatched_cq<W: Send + 'static>(
        &self,
        name: impl Into<String>,
        cqe: u32,
        config: CqConfig,
        options: CqOptions,
    ) -> Result<(Cq, UnboundCq<W>, CqHandle<W>), VerbsError> {
        let (cq, source) = self.create_cq(name, cqe, config)?;
        // The source gives split the CQ's ledger and budget.
        let (poller, handle) = split::<W>(source, options)?;
        Ok((cq, poller, handle))
    }

    /// Simulates the device going away (hot unplug, a fatal firmware
    /// error): every CQ of the device vanishes (its poller sees
    /// `SourceError::DeviceGone` and an asynchronous `DeviceFatal`), every QP
    /// of the device goes to ERR with nothing delivered (its CQs are gone),
    /// and later posts and creations fail with `DeviceGone`. Peers on other
    /// devices see their requests fail with `RetryExceeded`.
    pub fn vanish(&self) {
        self.inner.vanished.store(true, Ordering::Release);
        for cq in self
            .inner
            .cqs
            .lock()
            .iter()
            .filter_map(std::sync::Weak::upgrade)
        {
            cq.producer.vanish();
        }
        let mut st = self.fabric.core.state.lock();
        let qps: Vec<u32> = st
            .qps
            .values()
            .filter(|q| q.device == self.inner.id)
            .map(|q| q.qpn)
            .collect();
        for qpn in qps {
            st.enter_error(qpn);
        }
    }

    /// True after [`vanish`](Self::vanish).
    pub fn is_gone(&self) -> bool {
        self.inner.vanished.load(Ordering::Acquire)
    }

    pub(crate) fn check_present(&self) -> Result<(), VerbsError> {
        if self.is_gone() {
            return Err(VerbsError::DeviceGone {
                device: self.inner.name.clone(),
            });
        }
        Ok(())
    }

    /// Allocates a protection domain.
    pub fn alloc_pd(&self) -> Pd {
        let id = {
            let mut st = self.fabric.core.state.lock();
            st.next_pd += 1;
            st.next_pd
        };
        Pd {
            device: self.clone(),
            id,
        }
    }
}

#[derive(Debug)]
pub(crate) struct CqInner {
    pub(crate) device: u32,
    pub(crate) producer: SimCq,
    pub(crate) budget: CqBudget,
    pub(crate) ledger: WrLedger,
}

/// The NIC's side of a CQ: where QPs send their completions, with the CQ's
/// budget. Cloneable.
#[derive(Debug, Clone)]
pub struct Cq {
    pub(crate) inner: Arc<CqInner>,
}

impl Cq {
    /// The producer side (tests may push their own completions).
    pub fn producer(&self) -> &SimCq {
        &self.inner.producer
    }

    /// The CQ's budget.
    pub fn budget(&self) -> &CqBudget {
        &self.inner.budget
    }

    /// The CQ's ledger: the account of every queue whose completions come
    /// here.
    pub fn ledger(&self) -> &WrLedger {
        &self.inner.ledger
    }

    /// The budget's counters.
    pub fn budget_snapshot(&self) -> BudgetSnapshot {
        self.inner.budget.snapshot()
    }

    /// The CQ's capacity.
    pub fn capacity(&self) -> u32 {
        self.inner.producer.capacity()
    }

    pub(crate) fn same(&self, other: &Cq) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
