//! Spawning one named thread with its placement and priority applied.
//!
//! Start-up handshake (so that a failed pin is an error at spawn, never a
//! silent success):
//!
//! 1. The spawner creates a gate and starts the named thread.
//! 2. The new thread applies its placement (core_affinity for one CPU,
//!    `sched_setaffinity` for a fence), then its priority.
//! 3. It reports the outcome through the gate; on failure it returns
//!    without running its body.
//! 4. The spawner waits on the gate and returns the error, or the handle.

use std::collections::BTreeSet;

use super::config::{OnPriorityError, Placement, Priority};
use super::error::{SpawnError, TopologyError};
use crate::sync::{thread, Arc, Condvar, Mutex};

/// The CPUs this process may run on (`sched_getaffinity`).
pub(crate) fn allowed_cpus() -> Result<BTreeSet<usize>, TopologyError> {
    let set = rustix::thread::sched_getaffinity(None).map_err(|e| TopologyError::Affinity {
        errno: e.raw_os_error(),
    })?;
    Ok((0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&cpu| set.is_set(cpu))
        .collect())
}

/// Everything needed to start one thread of the topology.
#[derive(Debug, Clone)]
pub(crate) struct ThreadSpec {
    pub(crate) name: String,
    pub(crate) placement: Placement,
    pub(crate) priority: Option<Priority>,
    pub(crate) on_priority_error: OnPriorityError,
}

impl ThreadSpec {
    /// Step 2, on the new thread.
    pub(crate) fn apply(&self) -> Result<(), SpawnError> {
        match &self.placement {
            Placement::Unpinned => {}
            Placement::Fixed(cpu) => {
                if !core_affinity::set_for_current(core_affinity::CoreId { id: *cpu }) {
                    return Err(SpawnError::Pin {
                        thread: self.name.clone(),
                        cpu: *cpu,
                    });
                }
            }
            Placement::Fenced(cpus) => {
                let mut set = rustix::thread::CpuSet::new();
                for &cpu in cpus
                    .iter()
                    .filter(|&&c| c < rustix::thread::CpuSet::MAX_CPU)
                {
                    set.set(cpu);
                }
                rustix::thread::sched_setaffinity(None, &set).map_err(|e| SpawnError::Fence {
                    thread: self.name.clone(),
                    cpus: cpus.clone(),
                    errno: e.raw_os_error(),
                })?;
            }
        }
        let Some(priority) = self.priority else {
            return Ok(());
        };
        match (set_priority(priority), self.on_priority_error) {
            (Ok(()), _) => Ok(()),
            (Err(errno), OnPriorityError::Warn) => {
                tracing::warn!(
                    target: "cqd::topology",
                    thread = %self.name,
                    errno,
                    "cannot apply priority {priority:?}; running with the inherited one \
                     (on_priority_error = \"warn\")"
                );
                Ok(())
            }
            (Err(errno), OnPriorityError::Error) => Err(SpawnError::Priority {
                thread: self.name.clone(),
                priority: format!("{priority:?}"),
                errno,
            }),
        }
    }
}

/// Applies `priority` to the calling thread; the errno on failure.
fn set_priority(priority: Priority) -> Result<(), i32> {
    match priority {
        Priority::Nice(nice) => {
            // On Linux PRIO_PROCESS with a thread id sets that thread's nice.
            let tid = rustix::thread::gettid();
            rustix::process::setpriority_process(Some(tid), i32::from(nice))
                .map_err(|e| e.raw_os_error())
        }
        Priority::Fifo(level) => {
            use thread_priority::unix::{
                set_thread_priority_and_policy, thread_native_id, RealtimeThreadSchedulePolicy,
                ThreadSchedulePolicy,
            };
            let value = thread_priority::ThreadPriorityValue::try_from(level)
                .map_err(|_| rustix::io::Errno::INVAL.raw_os_error())?;
            set_thread_priority_and_policy(
                thread_native_id(),
                thread_priority::ThreadPriority::Crossplatform(value),
                ThreadSchedulePolicy::Realtime(RealtimeThreadSchedulePolicy::Fifo),
            )
            .map_err(|e| match e {
                thread_priority::Error::OS(errno) => errno,
                _ => rustix::io::Errno::INVAL.raw_os_error(),
            })
        }
    }
}

type Outcome = Option<Result<(), SpawnError>>;

/// The start-up gate of steps 3 and 4.
#[derive(Debug, Default)]
struct Gate {
    outcome: Mutex<Outcome>,
    ready: Condvar,
}

/// Starts `body` on a thread named and placed by `spec` (steps 1 to 4).
pub(crate) fn spawn<T, F>(spec: ThreadSpec, body: F) -> Result<ThreadHandle<T>, SpawnError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    // 1. Gate and thread.
    let gate = Arc::new(Gate::default());
    let theirs = gate.clone();
    let child = spec.clone();
    let inner = thread::Builder::new()
        .name(spec.name.clone())
        .spawn(move || {
            // 2. Placement and priority.
            let outcome = child.apply();
            let ok = outcome.is_ok();
            // 3. Report.
            {
                let mut slot = theirs.outcome.lock().unwrap_or_else(|e| e.into_inner());
                *slot = Some(outcome);
                theirs.ready.notify_all();
            }
            drop(theirs);
            ok.then(body)
        })
        .map_err(|source| SpawnError::Thread {
            thread: spec.name.clone(),
            source,
        })?;
    // 4. Wait for the report.
    let mut slot = gate.outcome.lock().unwrap_or_else(|e| e.into_inner());
    let outcome = loop {
        if let Some(outcome) = slot.take() {
            break outcome;
        }
        slot = gate.ready.wait(slot).unwrap_or_else(|e| e.into_inner());
    };
    drop(slot);
    match outcome {
        Ok(()) => Ok(ThreadHandle {
            name: spec.name,
            inner,
        }),
        Err(e) => {
            // The thread returns at once without running its body.
            let _ = inner.join();
            Err(e)
        }
    }
}

/// A running topology thread: its name, its `Thread` and its result.
#[derive(Debug)]
pub struct ThreadHandle<T> {
    name: String,
    inner: thread::JoinHandle<Option<T>>,
}

impl<T> ThreadHandle<T> {
    /// The thread's name, e.g. `cqd-poller-0`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The thread, e.g. to unpark it.
    pub fn thread(&self) -> &thread::Thread {
        self.inner.thread()
    }

    /// Waits for the thread to finish and returns what its body returned.
    ///
    /// # Errors
    ///
    /// The panic payload if the body panicked.
    pub fn join(self) -> std::thread::Result<T> {
        match self.inner.join()? {
            Some(value) => Ok(value),
            // Unreachable: a handle exists only for a thread whose start-up
            // succeeded, and such a thread always runs its body.
            None => Err(Box::new("thread did not run its body")),
        }
    }
}
