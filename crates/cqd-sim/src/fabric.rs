//! The fabric: the wire between devices and the NIC engine that runs on it.
//! All NIC state of a fabric lives behind one lock; the
//! timed engine's thread waits on a condition variable and stops when the last
//! handle of the fabric goes.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex};

use crate::device::{Device, DeviceAttr, DeviceInner};
use crate::engine::{Engine, NicFaults, NicStats};
use crate::error::VerbsError;
use crate::state::FabricState;

pub(crate) struct Core {
    pub(crate) state: Mutex<FabricState>,
    /// Wakes the timed engine's thread.
    pub(crate) wake: Condvar,
    pub(crate) stop: AtomicBool,
    pub(crate) engine: Engine,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("engine", &self.engine)
            .finish()
    }
}

/// Stops the engine thread when the last handle of the fabric goes.
#[derive(Debug)]
pub(crate) struct EngineGuard {
    core: Arc<Core>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for EngineGuard {
    fn drop(&mut self) {
        self.core.stop.store(true, Ordering::Release);
        {
            let _st = self.core.state.lock();
            self.core.wake.notify_all();
        }
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
    }
}

/// The wire and the NIC engine. Cloneable; the engine thread (timed engine)
/// stops when the last clone, device, QP and region of the fabric is gone.
#[derive(Debug, Clone)]
pub struct Fabric {
    pub(crate) core: Arc<Core>,
    _guard: Arc<EngineGuard>,
}

impl Fabric {
    /// A fabric whose NIC runs `engine`.
    ///
    /// # Errors
    /// [`VerbsError::Spawn`] if the timed engine's thread cannot start.
    pub fn new(engine: Engine) -> Result<Fabric, VerbsError> {
        let model = match engine {
            Engine::Inline => return Ok(Fabric::inline()),
            Engine::Timed(model) => model,
        };
        let core = Fabric::core(engine, Some(model.rnr_timer));
        let c = Arc::clone(&core);
        let thread = std::thread::Builder::new()
            .name("cqd-sim-nic".into())
            .spawn(move || crate::engine::timed_loop(&c))
            .map_err(|source| VerbsError::Spawn { source })?;
        Ok(Fabric::with(core, Some(thread)))
    }

    /// A fabric with the deterministic inline engine.
    pub fn inline() -> Fabric {
        Fabric::with(Fabric::core(Engine::Inline, None), None)
    }

    fn core(engine: Engine, rnr_timer: Option<std::time::Duration>) -> Arc<Core> {
        let mut state = FabricState::new();
        state.rnr_timer = rnr_timer;
        Arc::new(Core {
            state: Mutex::new(state),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            engine,
        })
    }

    fn with(core: Arc<Core>, thread: Option<JoinHandle<()>>) -> Fabric {
        let guard = Arc::new(EngineGuard {
            core: Arc::clone(&core),
            thread: Mutex::new(thread),
        });
        Fabric {
            core,
            _guard: guard,
        }
    }

    /// Opens a device on this fabric.
    pub fn open_device(&self, name: impl Into<String>, attr: DeviceAttr) -> Device {
        let id = {
            let mut st = self.core.state.lock();
            st.next_device += 1;
            st.next_device
        };
        Device {
            fabric: self.clone(),
            inner: Arc::new(DeviceInner {
                id,
                name: name.into(),
                attr,
                cqs: Mutex::new(Vec::new()),
                vanished: AtomicBool::new(false),
            }),
        }
    }

    /// The engine.
    pub fn engine(&self) -> Engine {
        self.core.engine
    }

    /// Sets the NIC's fault injection (reseeding its generator).
    pub fn set_faults(&self, faults: NicFaults) {
        let mut st = self.core.state.lock();
        st.rng = faults.seed | 1;
        st.faults = faults;
    }

    /// Executes every request that is due (delayed by fault injection, or
    /// waiting for a receive), and releases the CQ reservations of destroyed
    /// QPs whose completions have all been polled. The inline engine runs the
    /// former on every post; the timed engine's thread runs it continuously.
    pub fn progress(&self) {
        let mut st = self.core.state.lock();
        let now = std::time::Instant::now();
        st.run(now);
        st.sweep_destroyed();
    }

    /// After a post: the inline engine executes what is due now; the timed
    /// engine's thread is woken.
    pub(crate) fn kick(&self, st: &mut FabricState, now: std::time::Instant) {
        match self.core.engine {
            Engine::Inline => {
                st.run(now);
            }
            Engine::Timed(_) => {
                self.core.wake.notify_one();
            }
        }
    }

    /// What the NIC did so far.
    pub fn stats(&self) -> NicStats {
        self.core.state.lock().stats
    }

    /// True when no request waits to execute (all executed or flushed).
    pub fn is_idle(&self) -> bool {
        self.core
            .state
            .lock()
            .qps
            .values()
            .all(|q| q.sq_pending.is_empty())
    }
}
