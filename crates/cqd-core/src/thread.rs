//! Starting a named thread that sets itself up before it runs its body: the
//! one start-up path of every thread cqd starts (pollers, pool workers, the
//! threads a topology plans).
//!
//! A leaf: it knows threads, CPUs and priorities, nothing of pollers, pools
//! or topologies, which all build on it.
//!
//! Start-up handshake (so that a failed set-up — a CPU pin, a priority, a
//! user hook — is an error at spawn, never a silent success):
//!
//! 1. The spawner creates a gate and starts the named thread.
//! 2. The new thread runs its set-up step (for a [`ThreadSpec`]: placement,
//!    then priority), catching a panic.
//! 3. It reports the outcome through the gate; on failure (or panic) it
//!    returns without running its body, which it drops.
//! 4. The spawner waits on the gate and returns the error, or the handle:
//!    [`start`] returns only once the thread has started or failed.

use std::collections::BTreeSet;
use std::panic::{catch_unwind, AssertUnwindSafe};

use serde::{Deserialize, Serialize};

use crate::sync::{thread, Arc, Condvar, Mutex};

/// Where a thread may run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    /// Anywhere the process may run (`"unpinned"`).
    #[default]
    Unpinned,
    /// Pinned to one CPU (`{ fixed = 3 }`).
    Fixed(usize),
    /// Confined to a set of CPUs (`{ fenced = [2, 3] }`).
    Fenced(BTreeSet<usize>),
}

impl Placement {
    /// A fence from any list of CPUs.
    pub fn fenced(cpus: impl IntoIterator<Item = usize>) -> Self {
        Placement::Fenced(cpus.into_iter().collect::<BTreeSet<_>>())
    }

    /// The CPUs this placement names (empty when unpinned).
    pub fn cpus(&self) -> BTreeSet<usize> {
        match self {
            Placement::Unpinned => BTreeSet::new(),
            Placement::Fixed(cpu) => BTreeSet::from([*cpu]),
            Placement::Fenced(set) => set.clone(),
        }
    }
}

/// A thread's scheduling priority.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Priority {
    /// A nice value, -20 (highest) to 19 (lowest); below the current value
    /// needs `CAP_SYS_NICE` (`{ nice = -5 }`).
    Nice(i8),
    /// Real-time `SCHED_FIFO` at 1 to 99; needs `CAP_SYS_NICE` or an
    /// `RLIMIT_RTPRIO` grant (`{ fifo = 50 }`). For a latency-critical poller
    /// on an isolated core only: a spinning FIFO thread starves its CPU.
    Fifo(u8),
}

/// What happens when a priority cannot be applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPriorityError {
    /// The spawn fails with [`SpawnError::Priority`].
    #[default]
    Error,
    /// A `tracing` warning names the thread and the errno; the thread runs
    /// with the priority it inherited.
    Warn,
}

/// A thread that could not be started as planned.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpawnError {
    /// The OS refused to create the thread.
    #[error("cannot spawn thread {thread}: {source}")]
    Thread {
        /// The thread name.
        thread: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Pinning to one CPU failed.
    #[error("thread {thread}: cannot pin to CPU {cpu}")]
    Pin {
        /// The thread name.
        thread: String,
        /// The CPU.
        cpu: usize,
    },
    /// Confining to a CPU set failed.
    #[error("thread {thread}: cannot confine to CPUs {cpus:?} (errno {errno})")]
    Fence {
        /// The thread name.
        thread: String,
        /// The CPU set.
        cpus: BTreeSet<usize>,
        /// The errno of `sched_setaffinity`.
        errno: i32,
    },
    /// The priority could not be applied (typically no `CAP_SYS_NICE`);
    /// set `on_priority_error = "warn"` to run without it.
    #[error("thread {thread}: cannot apply priority {priority} (errno {errno}); needs CAP_SYS_NICE or an RLIMIT_RTPRIO/RLIMIT_NICE grant")]
    Priority {
        /// The thread name.
        thread: String,
        /// The priority, as written in the config.
        priority: String,
        /// The errno of the failed call.
        errno: i32,
    },
    /// The thread panicked while setting itself up (a bug in cqd).
    #[error("thread {thread} panicked while setting itself up")]
    SetupPanicked {
        /// The thread name.
        thread: String,
    },
    /// A pool was spawned with no producer, so nothing could ever reach it.
    #[error("pool {pool}: nothing feeds it: name it as the `pool` of the pollers that hand it work (spawn_feeds), or give spawn a producer count")]
    NoProducers {
        /// The pool name.
        pool: String,
    },
}

/// The CPUs this process may run on (`sched_getaffinity`).
pub(crate) fn allowed_cpus() -> Result<BTreeSet<usize>, rustix::io::Errno> {
    let set = rustix::thread::sched_getaffinity(None)?;
    Ok((0..rustix::thread::CpuSet::MAX_CPU)
        .filter(|&cpu| set.is_set(cpu))
        .collect())
}

/// A thread's name, placement and priority: the plain data [`spawn`] starts
/// it from.
#[derive(Debug, Clone)]
pub(crate) struct ThreadSpec {
    pub(crate) name: String,
    pub(crate) placement: Placement,
    pub(crate) priority: Option<Priority>,
    pub(crate) on_priority_error: OnPriorityError,
}

impl ThreadSpec {
    /// Step 2 for a spec, on the new thread: placement, then priority.
    pub(crate) fn apply(&self) -> Result<(), SpawnError> {
        match &self.placement {
            Placement::Unpinned => {}
            Placement::Fixed(cpu) => {
                // A CPU past the kernel's set size cannot be pinned (and
                // would index past core_affinity's set).
                let fits = *cpu < rustix::thread::CpuSet::MAX_CPU;
                if !fits || !core_affinity::set_for_current(core_affinity::CoreId { id: *cpu }) {
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

/// Why [`start`] returned no thread.
#[derive(Debug)]
pub(crate) enum StartError<E> {
    /// Step 1: the OS refused to create the thread.
    Spawn(std::io::Error),
    /// Step 2: the set-up step failed with this error.
    Setup(E),
    /// Step 2: the set-up step panicked.
    SetupPanicked,
}

/// What the new thread reports in step 3: `Err(None)` for a panic.
type Outcome<E> = Option<Result<(), Option<E>>>;

/// The start-up gate of steps 3 and 4.
struct Gate<E> {
    outcome: Mutex<Outcome<E>>,
    ready: Condvar,
}

/// Starts `body` on a new thread named `name`, after `setup` succeeded on
/// that thread (steps 1 to 4). Returns once the thread has started its body
/// or failed its set-up.
pub(crate) fn start<T, E, S, F>(
    name: String,
    setup: S,
    body: F,
) -> Result<ThreadHandle<T>, StartError<E>>
where
    T: Send + 'static,
    E: Send + 'static,
    S: FnOnce() -> Result<(), E> + Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    // 1. Gate and thread.
    let gate = Arc::new(Gate {
        outcome: Mutex::new(None),
        ready: Condvar::new(),
    });
    let theirs = Arc::clone(&gate);
    let inner = thread::Builder::new()
        .name(name.clone())
        .spawn(move || {
            // 2. Set up; a panic is reported, not left to hang the spawner.
            let outcome = match catch_unwind(AssertUnwindSafe(setup)) {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(Some(e)),
                Err(_panic) => Err(None),
            };
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
        .map_err(StartError::Spawn)?;
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
        Ok(()) => Ok(ThreadHandle { name, inner }),
        Err(failed) => {
            // The thread returns at once without running its body.
            let _ = inner.join();
            Err(failed.map_or(StartError::SetupPanicked, StartError::Setup))
        }
    }
}

/// Starts `body` on a thread named, placed and prioritised by `spec`.
///
/// # Errors
///
/// [`SpawnError`] naming the thread when it cannot be created, pinned,
/// fenced or given its priority (unless `on_priority_error` is `Warn`).
pub(crate) fn spawn<T, F>(spec: ThreadSpec, body: F) -> Result<ThreadHandle<T>, SpawnError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let thread = spec.name.clone();
    start(spec.name.clone(), move || spec.apply(), body).map_err(|e| match e {
        StartError::Spawn(source) => SpawnError::Thread { thread, source },
        StartError::Setup(e) => e,
        StartError::SetupPanicked => SpawnError::SetupPanicked { thread },
    })
}

/// A running thread started by cqd: its name, its `Thread` and its result.
#[derive(Debug)]
pub struct ThreadHandle<T> {
    name: String,
    inner: thread::JoinHandle<Option<T>>,
}

impl<T> ThreadHandle<T> {
    /// The thread's name, e.g. `cqd-poller-rx`.
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn the_body_runs_on_the_named_thread_after_setup() {
        let handle = start(
            "cqd-test-ok".into(),
            || Ok::<(), String>(()),
            || std::thread::current().name().map(str::to_owned),
        )
        .unwrap();
        assert_eq!(handle.name(), "cqd-test-ok");
        assert_eq!(handle.join().unwrap().as_deref(), Some("cqd-test-ok"));
    }

    #[test]
    fn a_failed_setup_is_returned_and_the_body_never_runs() {
        let ran = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = ran.clone();
        let e = start(
            "cqd-test-fail".into(),
            || Err::<(), _>("no such CPU".to_owned()),
            move || seen.store(true, std::sync::atomic::Ordering::SeqCst),
        )
        .unwrap_err();
        assert!(
            matches!(&e, StartError::Setup(m) if m == "no such CPU"),
            "{e:?}"
        );
        // `start` joined the thread before returning: the body is gone.
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
    }

    #[test]
    fn a_panicking_setup_is_an_error_not_a_hang() {
        let e = start(
            "cqd-test-panic".into(),
            || -> Result<(), String> { panic!("set-up bug") },
            || (),
        )
        .unwrap_err();
        assert!(matches!(e, StartError::SetupPanicked), "{e:?}");
    }

    #[test]
    fn a_cpu_past_the_kernels_set_is_a_pin_error_naming_the_thread() {
        let e = spawn(
            ThreadSpec {
                name: "cqd-test-spec".into(),
                placement: Placement::Fixed(usize::MAX),
                priority: None,
                on_priority_error: OnPriorityError::Error,
            },
            || (),
        )
        .unwrap_err();
        assert!(
            matches!(&e, SpawnError::Pin { thread, .. } if thread == "cqd-test-spec"),
            "{e}"
        );
    }
}
