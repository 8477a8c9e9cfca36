//! Devices: the list, opening one by name, its attributes and ports, and the
//! reader of its asynchronous events.
//!
//! # Asynchronous events
//!
//! A device has one asynchronous-event descriptor (`ibv_context::async_fd`)
//! for all its objects, while its CQs may be polled by several pollers; a
//! poller that read it would take the others' events. So each open device
//! has one reader thread, blocked in `poll(2)` on that descriptor (it costs
//! nothing while nothing happens). For each event it copies what the event
//! names, acks it at once (`ibv_destroy_qp` and friends wait for the ack),
//! and hands it on:
//!
//! - `IBV_EVENT_CQ_ERR` → [`AsyncEvent::CqOverflow`] in that CQ's inbox;
//!   its poller takes it within one loop (the inbox's descriptor is in the
//!   poller's epoll set) and puts the CQ in the error state;
//! - QP events (fatal, request and access errors, last WQE reached …) →
//!   [`AsyncEvent::Qp`] in the inbox of the QP's send CQ, naming the QP's
//!   owning handler, whose [`on_async`](cqd_core::Handler::on_async) the
//!   poller calls;
//! - SRQ limit and error → [`AsyncEvent::Srq`], likewise, on the CQ of the
//!   SRQ's owner;
//! - port active / down and the other port events, and device fatal → the
//!   device's callback ([`Context::on_device_event`]) and counters
//!   ([`Context::event_counts`]); device fatal also goes to every CQ of the
//!   device as [`AsyncEvent::DeviceFatal`], and later verbs fail with
//!   [`VerbsError::DeviceGone`].

use std::collections::HashMap;
use std::fmt;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use cqd_core::source::{AsyncEvent, QpEvent, SrqEvent};
use cqd_core::wr_id::HandlerKey;
use parking_lot::Mutex;

use crate::error::VerbsError;
use crate::inbox::AsyncInbox;
use crate::pd::Pd;
use crate::sys::{self, event, Element};

/// The devices libibverbs lists, by name.
///
/// # Errors
/// [`VerbsError::NoDevice`] when the list cannot be read (no RDMA support:
/// the errno says why).
pub fn devices() -> Result<Vec<sys::DeviceName>, VerbsError> {
    sys::device_names().map_err(|e| {
        no_device(
            "(any)",
            e.to_string(),
            e.raw_os_error().unwrap_or(0),
            Vec::new(),
        )
    })
}

const HINT: &str =
    "; on a machine without RDMA hardware run the program under softverbs-run (docs/softverbs.md)";

fn no_device(wanted: &str, reason: String, errno: i32, seen: Vec<String>) -> VerbsError {
    VerbsError::NoDevice {
        wanted: wanted.to_string(),
        reason,
        errno,
        seen,
        hint: HINT,
    }
}

/// What a device can do (the part of `ibv_device_attr` cqd uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Largest CQ.
    pub max_cqe: u32,
    /// Largest queue depth.
    pub max_qp_wr: u32,
    /// Most SGEs per request.
    pub max_sge: u32,
    /// Largest SRQ.
    pub max_srq_wr: u32,
    /// Physical ports.
    pub phys_port_cnt: u8,
    /// Completion vectors (`num_comp_vectors`).
    pub num_comp_vectors: u32,
    /// Type-2 memory windows (`IBV_DEVICE_MEM_WINDOW_TYPE_2B` in
    /// `device_cap_flags`): [`Qp::alloc_window`](crate::Qp::alloc_window).
    pub type2_windows: bool,
}

/// A device event that concerns no CQ: a port changed, or the device failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeviceEvent {
    /// `IBV_EVENT_PORT_ACTIVE`
    PortActive(u8),
    /// `IBV_EVENT_PORT_ERR`: the link went down.
    PortDown(u8),
    /// LID, P_Key, GID, SM change or client re-register on a port, by its
    /// `ibv_event_type` number.
    PortChange(u8, u32),
    /// `IBV_EVENT_DEVICE_FATAL`: every object of the device is unusable.
    Fatal,
    /// An event whose object cqd does not track (a QP or SRQ made outside
    /// cqd, a WQ), by its `ibv_event_type` number.
    Unrouted(u32),
}

/// Counts of the asynchronous events a device reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EventCounts {
    /// All events read (each was acked).
    pub total: u64,
    /// CQ errors (overflows).
    pub cq_errors: u64,
    /// QP events.
    pub qp_events: u64,
    /// SRQ events.
    pub srq_events: u64,
    /// Port active.
    pub port_active: u64,
    /// Port down.
    pub port_down: u64,
    /// Device fatal.
    pub device_fatal: u64,
    /// Events naming an object cqd does not track.
    pub unrouted: u64,
}

/// How a QP that draws its receives from an SRQ is torn down when it is
/// closed ([`Qp::close`](crate::Qp::close), or dropped): what the device
/// does with a destroyed QP's completions decides it
/// (`cqd_core::ledger`, module `teardown`). QPs with receive queues of
/// their own are torn down the same way under both: destroyed once every
/// completion of theirs is accounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Teardown {
    /// For a device whose `ibv_destroy_qp` takes the QP's unpolled
    /// completions out of its CQs and which raises
    /// `IBV_EVENT_QP_LAST_WQE_REACHED` (mlx5, softverbs): the QP is
    /// destroyed only once its own queues are accounted, the device's
    /// `LAST_WQE_REACHED` has come, and its receive CQ's poller has polled
    /// that CQ empty since. The default.
    QuiesceThenDestroy,
    /// For a device that keeps a destroyed QP's completions in its CQs and
    /// writes none after `ibv_destroy_qp` returned, and may raise no
    /// `LAST_WQE_REACHED` (the kernel's rxe; detected): the QP is
    /// destroyed once its own queues are accounted (its send queue's
    /// flushes polled), and its SRQ use is quiesced by its receive CQ's
    /// poller's next poll that finds the CQ empty after the destroy. Its
    /// close ends then. On a device that purges, this would lose the
    /// completions of the SRQ receives the QP took and not yet polled
    /// (their receives stay outstanding until the stop hands them back).
    ///
    /// One case rxe 6.1 leaves open itself: a receive its responder took
    /// from the SRQ for a message still arriving (a SEND of several
    /// packets) when the QP moved to the error state is flushed by the
    /// responder's next run, which the move only schedules (a tasklet,
    /// `rxe_qp_error`); a destroy that comes before that run stops the
    /// tasklet with the QP's reference count at zero, where the responder
    /// does nothing, and the receive gets no completion. Its SRQ account
    /// then keeps it until the stop hands it back as a flush (counted in
    /// `srq_returned`): retired once, at the stop.
    DestroyThenQuiesce,
}

impl Teardown {
    /// What cqd-verbs takes for the device whose sysfs directory
    /// (`/sys/class/infiniband/<name>`) is `dir`: a device with a `parent`
    /// attribute there (the network interface it runs on: the kernel's
    /// rxe, `rxe_attr_group` in rxe_verbs.c; hardware devices have none)
    /// keeps a destroyed QP's completions (kernel 6.1: its
    /// `rxe_destroy_qp` waits for the QP's tasks and packets to be done,
    /// and its CQ has no clean); every other device is taken to purge.
    pub fn detect(dir: &std::path::Path) -> Teardown {
        if dir.join("parent").is_file() {
            Teardown::DestroyThenQuiesce
        } else {
            Teardown::QuiesceThenDestroy
        }
    }

    fn to_raw(self) -> u8 {
        match self {
            Teardown::QuiesceThenDestroy => 0,
            Teardown::DestroyThenQuiesce => 1,
        }
    }

    fn from_raw(raw: u8) -> Teardown {
        match raw {
            1 => Teardown::DestroyThenQuiesce,
            _ => Teardown::QuiesceThenDestroy,
        }
    }
}

#[derive(Default)]
struct Counters {
    total: AtomicU64,
    cq_errors: AtomicU64,
    qp_events: AtomicU64,
    srq_events: AtomicU64,
    port_active: AtomicU64,
    port_down: AtomicU64,
    device_fatal: AtomicU64,
    unrouted: AtomicU64,
}

/// Where an object's events go.
pub(crate) enum Route {
    /// A CQ: its inbox and token.
    Cq {
        inbox: Weak<AsyncInbox>,
        token: u64,
        /// The CQ's capacity, as its last resize left it.
        capacity: Arc<AtomicU32>,
    },
    /// A QP: its number, owner and the inbox of its owner's CQ (or its
    /// send CQ's).
    Qp {
        qp_num: u32,
        owner: Option<HandlerKey>,
        inbox: Weak<AsyncInbox>,
        token: u64,
        /// A QP on an SRQ whose receive CQ is another: that CQ's inbox and
        /// token, where its `LAST_WQE_REACHED` goes too (its poller
        /// quiesces the QP's SRQ use: `cqd_core::ledger::Graveyard`).
        srq_recv: Option<(Weak<AsyncInbox>, u64)>,
    },
    /// An SRQ: its number, owner and the inbox of its owner's CQ.
    Srq {
        srq_num: u32,
        owner: Option<HandlerKey>,
        inbox: Weak<AsyncInbox>,
        token: u64,
    },
}

type Callback = Arc<dyn Fn(DeviceEvent) + Send + Sync>;

pub(crate) struct ContextInner {
    pub(crate) ctx: NonNull<sys::ibv_context>,
    pub(crate) name: String,
    pub(crate) attr: DeviceAttr,
    pub(crate) fatal: AtomicBool,
    /// The [`Teardown`] of the QPs made from now on, as `Teardown::to_raw`.
    teardown: AtomicU8,
    routes: Mutex<HashMap<usize, Route>>,
    callback: Mutex<Option<Callback>>,
    counters: Counters,
    stop: OwnedFd,
    reader: Mutex<Option<JoinHandle<()>>>,
}

// SAFETY: libibverbs contexts are thread-safe (every verb may be called
// from any thread); the pointer is only used through `sys`.
unsafe impl Send for ContextInner {}
// SAFETY: as above.
unsafe impl Sync for ContextInner {}

impl fmt::Debug for ContextInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name)
            .field("fatal", &self.fatal.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl ContextInner {
    /// Fails with `DeviceGone` after a fatal event.
    pub(crate) fn check(&self) -> Result<(), VerbsError> {
        if self.fatal.load(Ordering::Acquire) {
            return Err(VerbsError::DeviceGone {
                device: self.name.clone(),
            });
        }
        Ok(())
    }

    /// The teardown of a QP made now.
    pub(crate) fn teardown(&self) -> Teardown {
        Teardown::from_raw(self.teardown.load(Ordering::Acquire))
    }

    pub(crate) fn add_route(&self, ptr: usize, route: Route) {
        self.routes.lock().insert(ptr, route);
    }

    pub(crate) fn remove_route(&self, ptr: usize) {
        self.routes.lock().remove(&ptr);
    }

    /// Hands one event on (see the module documentation).
    fn deliver(&self, ty: u32, element: Element) {
        let c = &self.counters;
        c.total.fetch_add(1, Ordering::Relaxed);
        let device_event = match element {
            Element::Port(port) => Some(match ty {
                event::PORT_ACTIVE => {
                    c.port_active.fetch_add(1, Ordering::Relaxed);
                    DeviceEvent::PortActive(port)
                }
                event::PORT_ERR => {
                    c.port_down.fetch_add(1, Ordering::Relaxed);
                    DeviceEvent::PortDown(port)
                }
                other => DeviceEvent::PortChange(port, other),
            }),
            Element::Device if ty == event::DEVICE_FATAL => {
                c.device_fatal.fetch_add(1, Ordering::Relaxed);
                self.fatal.store(true, Ordering::Release);
                for route in self.routes.lock().values() {
                    if let Route::Cq { inbox, token, .. } = route {
                        if let Some(inbox) = inbox.upgrade() {
                            inbox.push(*token, AsyncEvent::DeviceFatal);
                        }
                    }
                }
                Some(DeviceEvent::Fatal)
            }
            Element::Device => {
                c.unrouted.fetch_add(1, Ordering::Relaxed);
                Some(DeviceEvent::Unrouted(ty))
            }
            Element::Cq(p) | Element::Qp(p) | Element::Srq(p) => {
                let routes = self.routes.lock();
                let routed = match (routes.get(&p), element) {
                    (
                        Some(Route::Cq {
                            inbox,
                            token,
                            capacity,
                        }),
                        Element::Cq(_),
                    ) => {
                        c.cq_errors.fetch_add(1, Ordering::Relaxed);
                        inbox.upgrade().map(|i| {
                            i.push(
                                *token,
                                AsyncEvent::CqOverflow {
                                    capacity: capacity.load(Ordering::Relaxed),
                                    lost: 0,
                                },
                            )
                        })
                    }
                    (
                        Some(Route::Qp {
                            qp_num,
                            owner,
                            inbox,
                            token,
                            srq_recv,
                        }),
                        Element::Qp(_),
                    ) => {
                        c.qp_events.fetch_add(1, Ordering::Relaxed);
                        let kind = qp_event(ty);
                        if let (QpEvent::LastWqeReached, Some((recv, recv_token))) =
                            (kind, srq_recv)
                        {
                            if let Some(i) = recv.upgrade() {
                                i.push(
                                    *recv_token,
                                    AsyncEvent::Qp {
                                        qp_num: *qp_num,
                                        kind,
                                        owner: None,
                                    },
                                );
                            }
                        }
                        let ev = AsyncEvent::Qp {
                            qp_num: *qp_num,
                            kind,
                            owner: *owner,
                        };
                        inbox.upgrade().map(|i| i.push(*token, ev))
                    }
                    (
                        Some(Route::Srq {
                            srq_num,
                            owner,
                            inbox,
                            token,
                        }),
                        Element::Srq(_),
                    ) => {
                        c.srq_events.fetch_add(1, Ordering::Relaxed);
                        let kind = if ty == event::SRQ_LIMIT_REACHED {
                            SrqEvent::LimitReached
                        } else {
                            SrqEvent::Error
                        };
                        let ev = AsyncEvent::Srq {
                            srq_num: *srq_num,
                            kind,
                            owner: *owner,
                        };
                        inbox.upgrade().map(|i| i.push(*token, ev))
                    }
                    _ => None,
                };
                drop(routes);
                if routed.is_some() {
                    None
                } else {
                    c.unrouted.fetch_add(1, Ordering::Relaxed);
                    Some(DeviceEvent::Unrouted(ty))
                }
            }
        };
        if let Some(ev) = device_event {
            match ev {
                DeviceEvent::Fatal => {
                    tracing::error!(device = %self.name, "RDMA device reported a fatal error")
                }
                DeviceEvent::PortDown(port) => {
                    tracing::warn!(device = %self.name, port, "port down")
                }
                other => tracing::info!(device = %self.name, event = ?other, "device event"),
            }
            // Called outside the lock: the callback may set a new one.
            let cb = self.callback.lock().clone();
            if let Some(cb) = cb {
                if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(ev))).is_err() {
                    tracing::error!(device = %self.name, "device event callback panicked");
                }
            }
        }
    }
}

fn qp_event(ty: u32) -> QpEvent {
    match ty {
        event::QP_FATAL => QpEvent::Fatal,
        event::QP_REQ_ERR => QpEvent::RequestError,
        event::QP_ACCESS_ERR => QpEvent::AccessError,
        event::COMM_EST => QpEvent::CommunicationEstablished,
        event::SQ_DRAINED => QpEvent::SendQueueDrained,
        event::PATH_MIG => QpEvent::PathMigrated,
        event::PATH_MIG_ERR => QpEvent::PathMigrationError,
        _ => QpEvent::LastWqeReached,
    }
}

/// The reader thread's loop: wait for the async descriptor (or the stop
/// descriptor), read every pending event, hand each on.
fn read_events(inner: Weak<ContextInner>, async_fd: i32, stop_fd: i32) {
    use rustix::event::{PollFd, PollFlags};
    // SAFETY: both descriptors stay open until this thread has stopped:
    // the context (owner of the async descriptor) and the stop eventfd are
    // closed by ContextInner's drop, after it has joined this thread (or
    // on this thread, when it held the last reference, after the loop).
    let (afd, sfd) = unsafe {
        (
            BorrowedFd::borrow_raw(async_fd),
            BorrowedFd::borrow_raw(stop_fd),
        )
    };
    loop {
        let mut fds = [
            PollFd::new(&afd, PollFlags::IN),
            PollFd::new(&sfd, PollFlags::IN),
        ];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "poll on the async descriptor failed; no more async events");
                return;
            }
        }
        let (async_ev, stop_ev) = (fds[0].revents(), fds[1].revents());
        if !stop_ev.is_empty() {
            return;
        }
        let Some(ctx) = inner.upgrade() else {
            return;
        };
        if !async_ev.contains(PollFlags::IN)
            && async_ev.intersects(PollFlags::ERR | PollFlags::HUP | PollFlags::NVAL)
        {
            tracing::error!(device = %ctx.name, "the async descriptor closed; no more async events");
            return;
        }
        let stop = loop {
            // SAFETY: the context is open while `ctx` is held; its async
            // descriptor was made non-blocking at open.
            match unsafe { sys::get_async_event(ctx.ctx) } {
                Ok(Some((ty, element))) => ctx.deliver(ty, element),
                Ok(None) => break false,
                Err(e) => {
                    // A dead device's descriptor (EIO): nothing more will come.
                    tracing::error!(device = %ctx.name, error = %e, "ibv_get_async_event failed; no more async events");
                    break true;
                }
            }
        };
        // If this was the last reference, the context closes here, on this
        // thread, with the descriptors: do not poll them again.
        drop(ctx);
        if stop || inner.strong_count() == 0 {
            return;
        }
    }
}

impl Drop for ContextInner {
    fn drop(&mut self) {
        let _ = rustix::io::write(&self.stop, &1u64.to_ne_bytes());
        if let Some(h) = self.reader.lock().take() {
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
        // SAFETY: every object of the context holds an `Arc` to it, so all
        // are gone; the reader thread has stopped using it.
        if let Err(e) = unsafe { sys::close_device(self.ctx) } {
            tracing::error!(device = %self.name, error = %e, "ibv_close_device failed");
        }
    }
}

/// An open RDMA device (`ibv_context`), shared by everything made on it.
/// Cloning is cheap; the device is closed when the last clone and the last
/// object made on it are gone.
#[derive(Clone, Debug)]
pub struct Context {
    pub(crate) inner: Arc<ContextInner>,
}

impl Context {
    /// Opens the device called `name`.
    ///
    /// # Errors
    /// [`VerbsError::NoDevice`] (with the errno and the devices seen) when
    /// there is no such device or it cannot be opened.
    pub fn open(name: &str) -> Result<Context, VerbsError> {
        Self::open_inner(Some(name))
    }

    /// Opens the first device libibverbs lists.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub fn open_first() -> Result<Context, VerbsError> {
        Self::open_inner(None)
    }

    fn open_inner(name: Option<&str>) -> Result<Context, VerbsError> {
        let wanted = name.unwrap_or("(any)");
        let sys::Opened {
            ctx,
            name: dev_name,
            sysfs,
        } = match sys::open_device(name) {
            Ok(x) => x,
            Err(sys::OpenFailure::List(e)) => {
                return Err(no_device(
                    wanted,
                    format!("the device list could not be read: {e}"),
                    e.raw_os_error().unwrap_or(0),
                    Vec::new(),
                ))
            }
            Err(sys::OpenFailure::NotFound(seen)) => {
                let reason = if seen.is_empty() {
                    "libibverbs lists no device".to_string()
                } else {
                    "no device has that name".to_string()
                };
                return Err(no_device(wanted, reason, libc::ENODEV, seen));
            }
            Err(sys::OpenFailure::Open(n, e)) => {
                return Err(no_device(
                    wanted,
                    format!("ibv_open_device({n}) failed: {e}"),
                    e.raw_os_error().unwrap_or(0),
                    vec![n],
                ))
            }
        };
        // From here on a failure must close the context.
        let close = |e: VerbsError| {
            // SAFETY: nothing was made on the context yet.
            let _ = unsafe { sys::close_device(ctx) };
            e
        };
        // SAFETY: `ctx` is open.
        let raw = unsafe { sys::query_device(ctx) }
            .map_err(|e| close(VerbsError::verb("ibv_query_device", dev_name.clone(), e)))?;
        // SAFETY: `ctx` is open.
        let comp_vectors = unsafe { ctx.as_ref() }.num_comp_vectors;
        let attr = DeviceAttr {
            max_cqe: raw.max_cqe.max(0) as u32,
            max_qp_wr: raw.max_qp_wr.max(0) as u32,
            max_sge: raw.max_sge.max(0) as u32,
            max_srq_wr: raw.max_srq_wr.max(0) as u32,
            phys_port_cnt: raw.phys_port_cnt,
            num_comp_vectors: comp_vectors.max(0) as u32,
            type2_windows: raw.device_cap_flags
                & rdma_sys::ibv_device_cap_flags::IBV_DEVICE_MEM_WINDOW_TYPE_2B.0
                != 0,
        };
        // SAFETY: `ctx` is open.
        let afd = unsafe { sys::async_fd(ctx) };
        sys::make_nonblocking(afd)
            .map_err(|e| close(VerbsError::verb("fcntl(async_fd)", dev_name.clone(), e)))?;
        let stop = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
            .map_err(|e| close(VerbsError::verb("eventfd", dev_name.clone(), e.into())))?;
        let stop_fd = stop.as_raw_fd();
        let inner = Arc::new(ContextInner {
            ctx,
            name: dev_name.clone(),
            attr,
            fatal: AtomicBool::new(false),
            teardown: AtomicU8::new(Teardown::detect(&sysfs).to_raw()),
            routes: Mutex::new(HashMap::new()),
            callback: Mutex::new(None),
            counters: Counters::default(),
            stop,
            reader: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        let handle = std::thread::Builder::new()
            .name(format!("cqd-async-{dev_name}"))
            .spawn(move || read_events(weak, afd, stop_fd))
            .map_err(|e| VerbsError::verb("spawn (async event reader)", dev_name.clone(), e))?;
        *inner.reader.lock() = Some(handle);
        Ok(Context { inner })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The device's attributes.
    pub fn attr(&self) -> DeviceAttr {
        self.inner.attr
    }

    /// True once the device reported a fatal error.
    pub fn is_gone(&self) -> bool {
        self.inner.fatal.load(Ordering::Acquire)
    }

    /// How the QPs made on this device from now on are torn down: what
    /// [`Teardown::detect`] found at open, or what
    /// [`set_teardown`](Self::set_teardown) set.
    pub fn teardown(&self) -> Teardown {
        self.inner.teardown()
    }

    /// Overrides the detected [`Teardown`] for the QPs made on this device
    /// from now on (a QP keeps the one it was made with): for a device
    /// cqd-verbs does not know, or to test one way on another device.
    /// [`Teardown::DestroyThenQuiesce`] on a device that purges a
    /// destroyed QP's completions loses the completions of the SRQ
    /// receives the QP took and not yet polled;
    /// [`Teardown::QuiesceThenDestroy`] on a device that raises no
    /// `LAST_WQE_REACHED` leaves the close of a QP on an SRQ holding
    /// receives waiting until its CQ goes.
    pub fn set_teardown(&self, teardown: Teardown) {
        self.inner
            .teardown
            .store(teardown.to_raw(), Ordering::Release);
    }

    /// A port's state and addresses.
    ///
    /// # Errors
    /// `ibv_query_port` failed.
    pub fn port(&self, port: u8) -> Result<PortInfo, VerbsError> {
        self.inner.check()?;
        // SAFETY: the context is open while `self` lives.
        let a = unsafe { sys::query_port(self.inner.ctx, port) }.map_err(|e| {
            VerbsError::verb("ibv_query_port", format!("{} port {port}", self.name()), e)
        })?;
        Ok(PortInfo {
            port,
            lid: a.lid,
            active: a.state == rdma_sys::ibv_port_state::IBV_PORT_ACTIVE,
            active_mtu: crate::qp::Mtu::from_raw(a.active_mtu),
            link_layer: a.link_layer,
            gid_table_len: a.gid_tbl_len.max(0) as u32,
        })
    }

    /// A port's GID at `index`.
    ///
    /// # Errors
    /// `ibv_query_gid` failed.
    pub fn gid(&self, port: u8, index: u8) -> Result<[u8; 16], VerbsError> {
        self.inner.check()?;
        // SAFETY: the context is open while `self` lives.
        unsafe { sys::query_gid(self.inner.ctx, port, i32::from(index)) }.map_err(|e| {
            VerbsError::verb(
                "ibv_query_gid",
                format!("{} port {port} index {index}", self.name()),
                e,
            )
        })
    }

    /// Allocates a protection domain.
    ///
    /// # Errors
    /// `ibv_alloc_pd` failed, or the device is gone.
    pub fn alloc_pd(&self) -> Result<Pd, VerbsError> {
        Pd::new(self)
    }

    /// Sets the callback for device-level events (port changes, fatal
    /// error, events of objects cqd does not track). It runs on the
    /// device's event reader thread; a panic is caught and traced. A
    /// callback that holds a clone of this `Context` keeps the device open
    /// (a reference cycle): capture what it needs, not the context.
    pub fn on_device_event(&self, f: impl Fn(DeviceEvent) + Send + Sync + 'static) {
        *self.inner.callback.lock() = Some(Arc::new(f));
    }

    /// The asynchronous events read so far.
    pub fn event_counts(&self) -> EventCounts {
        let c = &self.inner.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EventCounts {
            total: l(&c.total),
            cq_errors: l(&c.cq_errors),
            qp_events: l(&c.qp_events),
            srq_events: l(&c.srq_events),
            port_active: l(&c.port_active),
            port_down: l(&c.port_down),
            device_fatal: l(&c.device_fatal),
            unrouted: l(&c.unrouted),
        }
    }

    /// The raw `ibv_context`, for verbs cqd does not wrap. It stays open
    /// while this `Context` (or anything made on it) lives.
    pub fn as_raw(&self) -> *mut rdma_sys::ibv_context {
        self.inner.ctx.as_ptr()
    }
}

/// A port's state (the part of `ibv_port_attr` an endpoint needs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// The port number.
    pub port: u8,
    /// Its LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// True when the port is `IBV_PORT_ACTIVE`.
    pub active: bool,
    /// The active MTU.
    pub active_mtu: crate::qp::Mtu,
    /// `IBV_LINK_LAYER_*`.
    pub link_layer: u8,
    /// Entries of the GID table.
    pub gid_table_len: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device directory with a `parent` attribute (rxe's: the network
    /// interface it runs on) keeps a destroyed QP's completions; any
    /// other is taken to purge them.
    #[test]
    fn rxe_is_told_by_its_parent_attribute() {
        let dir = std::env::temp_dir().join(format!("cqd-teardown-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(Teardown::detect(&dir), Teardown::QuiesceThenDestroy);
        std::fs::write(dir.join("parent"), "lo\n").unwrap();
        assert_eq!(Teardown::detect(&dir), Teardown::DestroyThenQuiesce);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            Teardown::detect(std::path::Path::new("/nonexistent/rxe0")),
            Teardown::QuiesceThenDestroy
        );
        for t in [Teardown::QuiesceThenDestroy, Teardown::DestroyThenQuiesce] {
            assert_eq!(Teardown::from_raw(t.to_raw()), t);
        }
    }

    /// Runs anywhere: without a device libibverbs lists none, under
    /// softverbs-run none has this name.
    #[test]
    fn a_missing_device_is_an_error_with_its_errno_never_a_panic() {
        let err = Context::open("no-such-rdma-device").unwrap_err();
        match &err {
            VerbsError::NoDevice { wanted, errno, .. } => {
                assert_eq!(wanted, "no-such-rdma-device");
                assert_ne!(*errno, 0);
            }
            other => panic!("expected NoDevice, got {other:?}"),
        }
        assert!(err.to_string().contains("no-such-rdma-device"), "{err}");
        assert!(err.errno().is_some());
    }
}
