//! cqd: RDMA completion dispatch.
//!
//! cqd turns the completions of RDMA completion queues (CQs) into calls on
//! your handlers and work for your worker pools. Each CQ is polled by exactly
//! one poller thread, each completion reaches the handler that posted its
//! request exactly once (routed by its wr_id), and a stop accounts for every
//! request ever posted. This crate is the facade: it re-exports the parts.
//!
//! | module | feature | what |
//! |---|---|---|
//! | [`core`] | always | the dispatcher: CQ rights, handlers, pollers and poll modes, the posting call, worker pools, topology, shutdown, metrics (crate `cqd-core`) |
//! | [`sim`] | `sim` (default) | a simulated RDMA NIC with hardware semantics and fault injection (crate `cqd-sim`) |
//! | [`verbs`] | `verbs` | real RDMA through libibverbs (crate `cqd-verbs`); needs rdma-core's headers and libclang to build |
//! | `core::export` | `metrics` | cqd's counters published through the `metrics` crate's facade |
//!
//! The repository's `docs/guide.md` is the user's guide (choosing a poll
//! mode, sizing, handlers, shutdown, metrics); `docs/architecture.md`
//! explains how the parts fit.
//!
//! # A tour
//!
//! The path of a completion, and the item you meet at each step:
//!
//! 1. **A CQ and its two rights.** A backend makes the CQ:
//!    `Device::create_dispatched_cq` on the simulated NIC,
//!    `Context::create_dispatched_cq` on a real one. You get the backend's
//!    CQ object (to make queue pairs on), an
//!    [`UnboundCq`](crate::core::UnboundCq) (the right to poll it, moved to
//!    the one thread that will) and a [`CqHandle`](crate::core::CqHandle)
//!    (cloneable: registers handlers, reads metrics). The CQ's budget and
//!    ledger come attached, so a queue pair that could overflow it is
//!    refused at creation ([`core::budget`]).
//! 2. **Handlers.** A [`Handler`](crate::core::Handler) has three callbacks,
//!    `on_send`, `on_recv` and `on_error` (flushes included), called on the
//!    poller thread. It must not block: heavy work goes through its
//!    [`Outbox`](crate::core::Outbox) to a worker pool ([`core::pool`]),
//!    routed by [`Route`](crate::core::Route). Registering one gives a
//!    [`Registration`](crate::core::Registration).
//! 3. **Posting.** The registration's `post_send` and `post_recv` are the one
//!    way to post: each request's tag goes in its wr_id field, and the call
//!    keeps the handler's ledger, the queue's account and the CQ's credits
//!    ([`core::post`]).
//! 4. **Pollers.** A [`PollerBuilder`](crate::core::PollerBuilder) starts a
//!    poller thread over a group of CQs in a
//!    [`PollMode`](crate::core::PollMode): Busy, Event, Hybrid or Adaptive
//!    (the default; [`core::mode`]). In a server the threads come from a
//!    topology file checked before any thread starts ([`core::topology`]).
//! 5. **Stopping.** [`shutdown`](crate::core::shutdown()) flushes, stops
//!    the pollers (each drains its CQs until every request is accounted for),
//!    then joins the pools, and returns a
//!    [`SystemReport`](crate::core::SystemReport): posted == completed for
//!    every handler and kind, or exactly what is missing.
//! 6. **Metrics.** Every CQ, poller, budget, ledger and pool has a serde
//!    snapshot ([`core::metrics`]); with the `metrics` feature,
//!    `core::export::MetricsExporter` also publishes them through the
//!    `metrics` crate's facade (the repository's `docs/metrics.md`).
//!
//! The whole path on the simulated NIC: a topology with one poller and a
//! pool of two workers, a handler per connection that hands each received
//! message to the pool keyed by its connection, and a stop that flushes and
//! accounts for everything.
//!
//! ```
//! # #[cfg(feature = "sim")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::atomic::{AtomicU64, Ordering};
//! use std::sync::Arc;
//!
//! use cqd::core::topology::{ModeConfig, PollerConfig, PoolConfig, TopologyConfig};
//! use cqd::core::{Failed, Handler, Outbox, RecvDone, Route, SendDone};
//! use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit, RecvWr, SendWr, WrOp};
//!
//! /// What a handler hands to a worker.
//! struct Job {
//!     conn: u64,
//!     bytes: u32,
//! }
//!
//! /// One connection: runs on the poller thread, never blocks.
//! struct Conn(u64);
//! impl Handler<Job> for Conn {
//!     fn on_send(&mut self, _: &SendDone<'_>, _: &mut Outbox<'_, Job>) {}
//!     fn on_recv(&mut self, d: &RecvDone<'_>, out: &mut Outbox<'_, Job>) {
//!         // The default route given at registration: Route::Key(connection).
//!         out.push(Job { conn: self.0, bytes: d.byte_len() });
//!     }
//!     fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, Job>) {
//!         assert!(f.is_flush(), "{}", f.status()); // release what the request held
//!     }
//! }
//!
//! // Threads: plain data, checked once (a TOML file in a real server).
//! let mut topology = TopologyConfig::new()
//!     .poller(PollerConfig::new("net").cq("cq0").pool("io").mode(ModeConfig::Event { timeout_ms: 100 }))
//!     .pool(PoolConfig::new("io", 2))
//!     .validate()?;
//! let bytes = Arc::new(AtomicU64::new(0));
//! // One feed per poller that names the pool ("net"): counted by the topology.
//! let (pool, mut feeds) = topology.take_pool("io").unwrap().spawn_feeds(|_worker| {
//!     let bytes = Arc::clone(&bytes);
//!     move |job: Job| {
//!         assert_eq!(job.conn, 1);
//!         bytes.fetch_add(u64::from(job.bytes), Ordering::Relaxed);
//!     }
//! })?;
//!
//! // A CQ of 1,024 entries on the simulated NIC, its poller, a handler.
//! let net = topology.take_poller("net").unwrap();
//! let dev = Device::open("sim0");
//! let (cq, unbound, handle) =
//!     dev.create_dispatched_cq::<Job>("cq0", 1024, CqConfig::default(), net.cq_options())?;
//! // Named "net" in its reports; a CQ the topology gives another poller is refused.
//! let poller = net.poller_builder_fed(&mut feeds)?.cq(unbound).spawn()?;
//! let conn = handle.register_routed(Conn(1), Some(Route::Key(1)))?;
//!
//! // Two connected queue pairs on that CQ (each reserves its depths on it).
//! let pd = dev.alloc_pd();
//! let a = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?;
//! let b = pd.create_qp(&QpInit::new(&cq, &cq, QpCap::default()))?;
//! connect(&a, &b)?;
//! let mr = pd.reg_mr(16 * 1024, Access::ALL)?;
//!
//! // Eight receives on b (tag = buffer index), eight 64-byte SENDs from a,
//! // all but the last unsignaled: cqd retires those with the last one.
//! let bufs: Vec<_> = (0..8).map(|i| [mr.sge(i * 1024, 1024)]).collect();
//! let mut recvs: Vec<_> = (0..8).map(|i| RecvWr::new(i as u64, &bufs[i])).collect();
//! conn.post_recv(&b, &mut recvs)?;
//! let data = [mr.sge(8 * 1024, 64)];
//! let send = |t: u64| SendWr::new(100 + t, WrOp::Send, &data);
//! let mut sends: Vec<_> = (0..7).map(|t| send(t).unsignaled()).chain([send(7)]).collect();
//! conn.post_send(&a, &mut sends)?;
//!
//! // Stop: flush (every QP to the error state), pollers, then the pool.
//! let report = cqd::core::shutdown(|| a.force_error(), [poller], [pool]);
//! assert!(report.is_clean(), "{:?}", report.errors);
//! let cq0 = &report.pollers[0].cqs[0];
//! assert_eq!((cq0.overflows, cq0.stale_wr_ids, cq0.handler_panics), (0, 0, 0));
//! assert_eq!(report.pools[0].items(), 8);
//! assert_eq!(bytes.load(Ordering::Relaxed), 8 * 64);
//! # Ok(())
//! # }
//! # #[cfg(not(feature = "sim"))]
//! # fn main() {}
//! ```
//!
//! The repository's `examples/readme.rs` is the shortest program (a handler
//! and a poller), and `crates/cqd-demo` a whole block-storage server.
// Inlined, so that `cargo doc -p cqd --no-deps` renders the whole public
// API under the facade's own paths (`cqd::core::…`), with working links.
#[doc(inline)]
pub use cqd_core as core;
#[cfg(feature = "sim")]
#[doc(inline)]
pub use cqd_sim as sim;
#[cfg(feature = "verbs")]
#[doc(inline)]
pub use cqd_verbs as verbs;

/// Real RDMA is behind the `verbs` feature, so that the default build needs
/// no system library. In a build without it, naming anything here fails
/// with a message that says what to add:
///
/// ```compile_fail
/// // Fails: cqd was built without the `verbs` feature.
/// let ctx = cqd::verbs::Context::open("mlx5_0");
/// ```
#[cfg(not(feature = "verbs"))]
pub mod verbs {
    /// Implemented by nothing: `Context::open`'s argument must implement
    /// it, so a call fails to compile with this message.
    #[diagnostic::on_unimplemented(
        message = "cqd was built without the `verbs` feature: real RDMA needs `cqd = {{ features = [\"verbs\"] }}` in Cargo.toml",
        label = "needs the `verbs` feature",
        note = "the feature builds rdma-sys against the system's libibverbs: on Debian, `apt-get install libibverbs-dev librdmacm-dev libclang-dev pkg-config`",
        note = "without RDMA hardware, run the program under softverbs-run (docs/softverbs.md)"
    )]
    pub trait VerbsFeature {}

    /// Stands for `cqd_verbs::Context` in a build without the feature.
    #[derive(Debug)]
    pub struct Context;

    impl Context {
        /// Never callable: see the module documentation.
        pub fn open<N: VerbsFeature>(_name: N) -> Context {
            Context
        }
    }
}
