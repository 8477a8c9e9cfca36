//! A pool of CQs shared by connections that come and go, across a
//! topology's pollers (the kernel's `ib_cq_pool_get`, as a library).
//!
//! A connection asks the pool for a CQ with room for what its QPs will
//! reserve ([`CqPool::open`]). The pool looks among its CQs by its
//! [`Fit`]; when none has room it **grows**: it makes a CQ with its
//! backend's maker, adds it to a running poller (the least loaded one,
//! through that poller's [`CqJoiner`]: `poller::arrive`), waits until the
//! poller polls it, then places the connection there. With
//! [`CqPool::resize_up_to`] it first grows one of its CQs in place
//! (`ibv_resize_cq` on the CQ's poller's thread, [`CqHandle::resize`]), as
//! SPDK's target grows its poller's CQ, and makes a new CQ only when none
//! can grow enough. Capacity comes back
//! by itself when a connection's QPs are destroyed: it is the CQ's
//! admission (`budget`), which the QPs hold and release.
//!
//! The choice and the QP's creation happen under the pool's lock, so two
//! connections never both take the last room of one CQ. A CQ is never
//! taken out of the pool while it runs: its poller stops it with the rest.

use std::fmt;
use std::time::Duration;

use crate::cq::{CqHandle, UnboundCq};
use crate::poller::{CqJoiner, JoinError};

/// How a pool chooses among its CQs that have room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fit {
    /// The first CQ made (in the order they were made) with room: fills
    /// CQs one after the other, so that each poller's batches are full.
    First,
    /// The CQ with the fewest entries reserved: spreads connections over
    /// the CQs, and so over their pollers.
    #[default]
    LeastUsed,
}

impl Fit {
    /// The name a report gives it.
    pub fn name(self) -> &'static str {
        match self {
            Fit::First => "first fit",
            Fit::LeastUsed => "least used",
        }
    }
}

/// What a pool's maker returns for a new CQ: the backend's CQ (what QPs
/// are created on), its polling right, and its handle.
pub type MadeCq<C, W> = (C, UnboundCq<W>, CqHandle<W>);

type Maker<C, W> = Box<dyn Fn(&str, u32) -> Result<MadeCq<C, W>, String> + Send + Sync>;

/// Why a pool did not place a connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError<E> {
    /// The connection asks for more entries than one of the pool's CQs
    /// holds: no CQ will ever fit it.
    #[error("CQ pool {pool}: a connection needing {needed} entries never fits a CQ of {cqe}")]
    TooLarge {
        /// The pool.
        pool: String,
        /// What the connection would reserve.
        needed: u64,
        /// The size of the pool's CQs.
        cqe: u32,
    },
    /// Every CQ is full and the pool has made as many as it may.
    #[error("CQ pool {pool}: its {cqs} CQs are full (at most {cqs} allowed)")]
    Exhausted {
        /// The pool.
        pool: String,
        /// Its CQs.
        cqs: usize,
    },
    /// The backend could not make a CQ.
    #[error("CQ pool {pool}: making CQ {cq} failed: {reason}")]
    Make {
        /// The pool.
        pool: String,
        /// The CQ's name.
        cq: String,
        /// The backend's error.
        reason: String,
    },
    /// The poller chosen for a new CQ did not take it.
    #[error("CQ pool {pool}: {source}")]
    Join {
        /// The pool.
        pool: String,
        /// Why.
        #[source]
        source: JoinError,
    },
    /// The pool has no running poller to grow onto.
    #[error("CQ pool {pool} has no poller to add a CQ to")]
    NoPoller {
        /// The pool.
        pool: String,
    },
    /// The connection's own opening failed (its QPs' creation), on the CQ
    /// the pool chose.
    #[error("CQ pool {pool}: opening on CQ {cq} failed: {source}")]
    Open {
        /// The pool.
        pool: String,
        /// The CQ chosen.
        cq: String,
        /// The opener's error.
        #[source]
        source: E,
    },
}

struct Member<C, W> {
    cq: C,
    handle: CqHandle<W>,
    /// Index of its poller in the pool's joiners.
    poller: usize,
}

struct State<C, W> {
    members: Vec<Member<C, W>>,
    made: usize,
    /// A resize was refused as unsupported: the backend has none, and
    /// the pool grows by new CQs only.
    no_resize: bool,
}

/// One CQ of a pool, as [`CqPool::snapshot`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCq {
    /// The CQ's name.
    pub name: String,
    /// The poller that polls it.
    pub poller: String,
    /// Its capacity.
    pub capacity: u32,
    /// Entries its QPs reserve now.
    pub reserved: u64,
}

/// A pool of CQs over running pollers (see the module documentation).
pub struct CqPool<C, W> {
    name: String,
    fit: Fit,
    cqe: u32,
    max_cqs: usize,
    resize_up_to: Option<u32>,
    join_timeout: Duration,
    make: Maker<C, W>,
    joiners: Vec<CqJoiner<W>>,
    state: parking_lot::Mutex<State<C, W>>,
}

impl<C, W> fmt::Debug for CqPool<C, W> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqPool")
            .field("name", &self.name)
            .field("fit", &self.fit)
            .field("cqe", &self.cqe)
            .field("cqs", &self.state.lock().members.len())
            .finish_non_exhaustive()
    }
}

impl<C, W: Send + 'static> CqPool<C, W> {
    /// A pool named `name` whose CQs hold `cqe` entries each, made by
    /// `make(name, cqe)` (the backend's CQ, split for dispatch, with its
    /// admission on) and added to the pollers of `joiners` (a running
    /// poller thread's [`PollerThread::joiner`](crate::PollerThread::joiner),
    /// or a driver's). It starts empty: the first connection makes the
    /// first CQ. At most 1,024 CQs unless [`max_cqs`](Self::max_cqs) says
    /// otherwise.
    ///
    /// A device may make a CQ larger than asked (rxe gives 127 entries for
    /// 64, mlx5 a power of two less one): the pool places connections by
    /// each CQ's real capacity, and so fits more of them than `cqe`
    /// suggests. A connection needing more than `cqe` entries is still
    /// refused ([`PoolError::TooLarge`]) before any CQ is looked at, so
    /// that whether it fits never depends on the device.
    pub fn new(
        name: impl Into<String>,
        cqe: u32,
        joiners: Vec<CqJoiner<W>>,
        make: impl Fn(&str, u32) -> Result<MadeCq<C, W>, String> + Send + Sync + 'static,
    ) -> Self {
        CqPool {
            name: name.into(),
            fit: Fit::default(),
            cqe,
            max_cqs: 1024,
            join_timeout: Duration::from_secs(10),
            make: Box::new(make),
            joiners,
            resize_up_to: None,
            state: parking_lot::Mutex::new(State {
                members: Vec::new(),
                made: 0,
                no_resize: false,
            }),
        }
    }

    /// The pool a topology's `[[cq_pool]]` describes
    /// ([`Topology::take_cq_pool`](crate::topology::Topology::take_cq_pool)),
    /// over the joiners of its running pollers (in any order: they are
    /// matched to the pollers it names by their names), making its CQs with
    /// `make` as [`new`](Self::new) does.
    ///
    /// # Errors
    /// [`TopologyError::CqPoolPollers`](crate::topology::TopologyError::CqPoolPollers)
    /// when the joiners are not of exactly the pollers the topology names.
    pub fn from_plan(
        plan: crate::topology::CqPoolPlan,
        joiners: Vec<CqJoiner<W>>,
        make: impl Fn(&str, u32) -> Result<MadeCq<C, W>, String> + Send + Sync + 'static,
    ) -> Result<Self, crate::topology::TopologyError> {
        let c = plan.config;
        let wanted = c.pollers.clone();
        let mut given: Vec<Option<CqJoiner<W>>> = joiners.into_iter().map(Some).collect();
        let mut ordered = Vec::with_capacity(wanted.len());
        for w in &wanted {
            let at = given
                .iter()
                .position(|j| j.as_ref().is_some_and(|j| j.poller() == w));
            match at.and_then(|i| given[i].take()) {
                Some(j) => ordered.push(j),
                None => break,
            }
        }
        if ordered.len() != wanted.len() || given.iter().any(Option::is_some) {
            let mut names: Vec<String> = ordered.iter().map(|j| j.poller().to_string()).collect();
            names.extend(given.iter().flatten().map(|j| j.poller().to_string()));
            return Err(crate::topology::TopologyError::CqPoolPollers {
                pool: c.name,
                wanted,
                given: names,
            });
        }
        let fit = match c.fit {
            crate::topology::FitConfig::LeastUsed => Fit::LeastUsed,
            crate::topology::FitConfig::First => Fit::First,
        };
        let mut pool = CqPool::new(c.name, c.cqe, ordered, make)
            .fit(fit)
            .max_cqs(c.max_cqs);
        if let Some(max) = c.resize_up_to {
            pool = pool.resize_up_to(max);
        }
        Ok(pool)
    }

    /// How the pool chooses among CQs with room ([`Fit::LeastUsed`] by
    /// default).
    #[must_use]
    pub fn fit(mut self, fit: Fit) -> Self {
        self.fit = fit;
        self
    }

    /// The most CQs the pool makes.
    #[must_use]
    pub fn max_cqs(mut self, n: usize) -> Self {
        self.max_cqs = n;
        self
    }

    /// Grow a CQ in place before making a new one: when no CQ has room,
    /// the pool resizes one of its CQs (`ibv_resize_cq`, on its poller's
    /// thread: [`CqHandle::resize`]) to twice its capacity, or to what the
    /// connection needs, at most `max_cqe` entries; the CQ it resizes is
    /// the one its fit would choose among those that can grow enough.
    /// Only when none can (or the backend has no resize, or the device
    /// refused) does it make a new CQ. Off by default: more connections
    /// on one CQ means larger batches for one poller, fewer CQs to poll,
    /// and no spreading over pollers.
    #[must_use]
    pub fn resize_up_to(mut self, max_cqe: u32) -> Self {
        self.resize_up_to = Some(max_cqe);
        self
    }

    /// How long a growth waits for the poller to take its new CQ, or to
    /// resize one (10 s).
    #[must_use]
    pub fn join_timeout(mut self, t: Duration) -> Self {
        self.join_timeout = t;
        self
    }

    /// The pool's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its fit.
    pub fn how(&self) -> Fit {
        self.fit
    }

    /// Places a connection: chooses a CQ with room for `entries` of its
    /// own, plus `srq`'s depth (number, depth) on a CQ that does not hold
    /// that SRQ's reservation yet; grows the pool if none has room; then
    /// calls `open` with the CQ and its handle (create the connection's QPs
    /// there, register its handler), under the pool's lock, and returns
    /// what it returns. Call it from a thread that is not one of the
    /// pool's pollers: a growth waits for a poller to take its new CQ
    /// (at most the join timeout), which a poller blocked here cannot do.
    ///
    /// # Errors
    /// See [`PoolError`].
    pub fn open<T, E>(
        &self,
        entries: u32,
        srq: Option<(u32, u32)>,
        open: impl FnOnce(&C, &CqHandle<W>) -> Result<T, E>,
    ) -> Result<T, PoolError<E>> {
        let needed = u64::from(entries) + srq.map_or(0, |(_, d)| u64::from(d));
        if needed > u64::from(self.cqe) {
            return Err(PoolError::TooLarge {
                pool: self.name.clone(),
                needed,
                cqe: self.cqe,
            });
        }
        let mut st = self.state.lock();
        let chosen = match self.choose(&st, entries, srq) {
            Some(i) => i,
            None => match self.resize_one(&mut st, entries, srq) {
                Some(i) => i,
                None => self.grow(&mut st)?,
            },
        };
        let m = &st.members[chosen];
        open(&m.cq, &m.handle).map_err(|source| PoolError::Open {
            pool: self.name.clone(),
            cq: m.handle.name().to_string(),
            source,
        })
    }

    fn choose(&self, st: &State<C, W>, entries: u32, srq: Option<(u32, u32)>) -> Option<usize> {
        let fits = st.members.iter().enumerate().filter_map(|(i, m)| {
            let b = m.handle.budget()?;
            b.fits(entries, srq)?;
            Some((i, b.reserved()))
        });
        match self.fit {
            Fit::First => fits.map(|(i, _)| i).next(),
            Fit::LeastUsed => fits.min_by_key(|&(i, r)| (r, i)).map(|(i, _)| i),
        }
    }

    /// Resizes the CQ the fit chooses among those that can grow to hold
    /// the connection (see [`resize_up_to`](Self::resize_up_to)); its
    /// index, or `None` to make a new CQ instead.
    fn resize_one(
        &self,
        st: &mut State<C, W>,
        entries: u32,
        srq: Option<(u32, u32)>,
    ) -> Option<usize> {
        let max = self.resize_up_to?;
        if st.no_resize {
            return None;
        }
        let srq_part = srq.map_or(0, |(_, d)| u64::from(d));
        let mut can = st.members.iter().enumerate().filter_map(|(i, m)| {
            let b = m.handle.budget()?;
            let (capacity, reserved) = (b.capacity(), b.reserved());
            let needed = reserved + u64::from(entries) + srq_part;
            let target = u64::from(capacity).saturating_mul(2).max(needed);
            let target = u32::try_from(target.min(u64::from(max))).ok()?;
            (target > capacity && needed <= u64::from(target)).then_some((i, reserved, target))
        });
        let (i, _, target) = match self.fit {
            Fit::First => can.next(),
            Fit::LeastUsed => can.min_by_key(|&(i, r, _)| (r, i)),
        }?;
        let m = &st.members[i];
        match m.handle.resize(target).wait(self.join_timeout) {
            Ok(capacity) => {
                tracing::debug!(pool = %self.name, cq = %m.handle.name(), capacity,
                    "CQ pool grew a CQ in place");
                m.handle
                    .budget()
                    .and_then(|b| b.fits(entries, srq))
                    .map(|_| i)
            }
            Err(crate::cq::ResizeError::Unsupported { reason, .. }) => {
                tracing::info!(pool = %self.name, %reason, "CQ pool: no resize; it makes new CQs");
                st.no_resize = true;
                None
            }
            Err(e) => {
                tracing::warn!(pool = %self.name, error = %e, "CQ pool: resize failed; making a new CQ");
                None
            }
        }
    }

    /// Makes a CQ and adds it to the poller with the fewest of the pool's
    /// entries reserved (then the fewest CQs).
    fn grow<E>(&self, st: &mut State<C, W>) -> Result<usize, PoolError<E>> {
        if st.members.len() >= self.max_cqs {
            return Err(PoolError::Exhausted {
                pool: self.name.clone(),
                cqs: st.members.len(),
            });
        }
        if self.joiners.is_empty() {
            return Err(PoolError::NoPoller {
                pool: self.name.clone(),
            });
        }
        let mut load = vec![(0u64, 0usize); self.joiners.len()];
        for m in &st.members {
            let l = &mut load[m.poller];
            l.0 += m
                .handle
                .budget()
                .map_or(0, crate::budget::CqBudget::reserved);
            l.1 += 1;
        }
        let poller = (0..self.joiners.len())
            .min_by_key(|&p| (load[p], p))
            .unwrap_or(0);
        let name = format!("{}-{}", self.name, st.made);
        st.made += 1;
        let (cq, unbound, handle) =
            (self.make)(&name, self.cqe).map_err(|reason| PoolError::Make {
                pool: self.name.clone(),
                cq: name.clone(),
                reason,
            })?;
        let joined = self.joiners[poller]
            .add_cq(unbound)
            .map_err(|n| n.error().clone())
            .and_then(|j| j.wait(self.join_timeout));
        if let Err(source) = joined {
            return Err(PoolError::Join {
                pool: self.name.clone(),
                source,
            });
        }
        tracing::debug!(pool = %self.name, cq = %name, poller = %self.joiners[poller].poller(),
            "CQ pool grew");
        st.members.push(Member { cq, handle, poller });
        Ok(st.members.len() - 1)
    }

    /// The pool's CQs now: their pollers, capacities and reservations.
    pub fn snapshot(&self) -> Vec<PoolCq> {
        let st = self.state.lock();
        st.members
            .iter()
            .map(|m| PoolCq {
                name: m.handle.name().to_string(),
                poller: self.joiners[m.poller].poller().to_string(),
                capacity: m.handle.capacity(),
                reserved: m
                    .handle
                    .budget()
                    .map_or(0, crate::budget::CqBudget::reserved),
            })
            .collect()
    }
}
