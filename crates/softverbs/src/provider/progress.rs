//! The background progress thread: retries sends that wait for a responder
//! (RNR, a peer not yet at RTR, a responder that does not answer) when the
//! application is blocked in `ibv_get_cq_event` rather than polling.
//!
//! It never waits for a timer when something happened: it sleeps on the
//! responders' doorbells (shm::doorbell), which their owners ring when a
//! receive is posted or their QP changes state, in whatever process; the
//! waiting send is retried as soon as the ring arrives. Timers only bound
//! the sleep for what nobody rings: a transport timeout running out
//! (model::qp::transport_timeout), and a responder process dying or its
//! device dying, looked at every [`LIVENESS`].
//!
//! Protocol:
//! 1. A QP whose send queue starts waiting registers itself here (under its
//!    send mutex, then the registry mutex) and rings the thread's own
//!    doorbell; it unregisters the same way.
//! 2. The thread, holding the registry mutex, only *tries* each QP's send
//!    mutex: it never blocks on it, so the two lock orders cannot deadlock.
//!    A QP whose mutex is taken is looked at again after [`BUSY_RETRY`]
//!    (its owner is inside a verb that progresses it anyway).
//! 3. `destroy_qp` unregisters under the registry mutex before freeing
//!    (always, whatever the QP's waiting state), so the thread never sees a
//!    freed QP. This is the contract of the `unsafe` [`set`]. The doorbells
//!    slept on belong to responders' segments, which the sleep keeps mapped.
//! 4. For each QP still waiting, its responder's doorbells are armed before
//!    the retry, then slept on together with the thread's own doorbell
//!    (`futex_waitv`); with nothing registered the thread sleeps on its own
//!    doorbell alone.
//! 5. The thread drops a QP from the registry itself once its queue is
//!    empty (calls to [`set`] made on the thread are ignored: it already
//!    holds the registry lock).
//!
//! On a kernel without `futex_waitv` the thread falls back to retrying every
//! [`FALLBACK_PERIOD`].

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::qp::SvQp;
use super::remote::Armed;
use crate::shm::doorbell::{self, Waited, Watch};

/// How often a waiting send looks whether its responder's process or device
/// died (nothing rings for those).
pub const LIVENESS: Duration = Duration::from_millis(10);
/// How soon a QP whose send mutex was taken is looked at again.
pub const BUSY_RETRY: Duration = Duration::from_micros(100);
/// The retry period without `futex_waitv`.
pub const FALLBACK_PERIOD: Duration = Duration::from_micros(200);

/// The bound [`LIVENESS`] puts on a waiting QP's sleep; `None` under the
/// test-only switch `SOFTVERBS_TEST_NO_LIVENESS=1` (read once per process).
/// Then only a ring, a transport deadline or a [`BUSY_RETRY`] wakes the
/// thread for a waiting QP, so a send that still completes was resumed by
/// its responder's ring (tests/in_process.rs). A process run so does not
/// see a responder's process or device die. Nothing else reads the
/// variable.
fn liveness() -> Option<Duration> {
    static OFF: OnceLock<bool> = OnceLock::new();
    let off = *OFF
        .get_or_init(|| std::env::var_os("SOFTVERBS_TEST_NO_LIVENESS").is_some_and(|v| v == "1"));
    (!off).then_some(LIVENESS)
}

struct Registry {
    qps: Mutex<HashSet<usize>>,
    /// Rung by [`set`] when a QP starts waiting (process-local futex).
    bell: AtomicU32,
}

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    static STARTED: OnceLock<()> = OnceLock::new();
    let r = R.get_or_init(|| Registry {
        qps: Mutex::new(HashSet::new()),
        bell: AtomicU32::new(0),
    });
    STARTED.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("softverbs-progress".into())
            .spawn(run);
    });
    r
}

thread_local! {
    /// True on the progress thread, which already holds the registry lock.
    static ON_THREAD: Cell<bool> = const { Cell::new(false) };
}

/// Step 1: start or stop retrying `qp`'s waiting sends in the background.
/// On the progress thread itself this is a no-op: the thread updates the
/// registry after each pass (step 5).
///
/// The registry keeps `qp` as a raw pointer that the progress thread
/// dereferences later, so registering is `unsafe`:
///
/// ```compile_fail,E0133
/// softverbs::provider::progress::set(std::ptr::null(), true);
/// ```
///
/// # Safety
/// When `on` is true:
/// 1. `qp` points to a live [`SvQp`] made by `create_qp` (the thread locks
///    its send mutex and progresses its sends);
/// 2. `qp` stays live until a later `set(qp, false)`, made off the progress
///    thread, has returned: whoever frees the QP makes that call first
///    (`destroy_qp` does, step 3).
///
/// With `on` false, `qp` is only a key and may be dangling.
pub unsafe fn set(qp: *const SvQp, on: bool) {
    if ON_THREAD.with(Cell::get) {
        return;
    }
    let r = registry();
    let mut g = r.qps.lock().unwrap_or_else(|e| e.into_inner());
    if on {
        g.insert(qp as usize);
        drop(g);
        r.bell.fetch_add(1, Ordering::SeqCst);
        doorbell::wake(&r.bell, true);
    } else {
        g.remove(&(qp as usize));
    }
}

/// What one pass leaves to sleep on.
struct Sleep {
    armed: Vec<Armed>,
    until: Option<Instant>,
}

impl Sleep {
    fn by(&mut self, t: Instant) {
        self.until = Some(self.until.map_or(t, |u| u.min(t)));
    }
}

/// One pass over the registered QPs (step 2, 4, 5).
fn pass(r: &Registry) -> Sleep {
    let mut sleep = Sleep {
        armed: Vec::new(),
        until: None,
    };
    let mut g = r.qps.lock().unwrap_or_else(|e| e.into_inner());
    g.retain(|&q| {
        // SAFETY: step 3: registered QPs are live while the registry lock
        // is held.
        let q = unsafe { &*(q as *const SvQp) };
        let Ok(mut ss) = q.send.try_lock() else {
            sleep.by(Instant::now() + BUSY_RETRY);
            return true;
        };
        // Arm before the retry: a receive posted after it rings us.
        let armed = ss.remote.as_ref().map(|rm| rm.arm());
        super::send::progress(q, &mut ss);
        if ss.pending.is_empty() {
            return false;
        }
        let now = Instant::now();
        match armed {
            Some(a) => sleep.armed.push(a),
            // The responder was mapped during this retry: arm it next pass.
            None if ss.remote.is_some() => sleep.by(now),
            None => {}
        }
        if let Some(l) = liveness() {
            sleep.by(now + l);
        }
        if let Some(d) = super::send::silence_deadline(&ss) {
            sleep.by(d);
        }
        true
    });
    sleep
}

fn run() {
    ON_THREAD.with(|c| c.set(true));
    let r = registry();
    let mut waitv = true;
    loop {
        let own = r.bell.load(Ordering::SeqCst);
        let sleep = pass(r);
        let timeout = sleep
            .until
            .map(|t| t.saturating_duration_since(Instant::now()));
        if timeout == Some(Duration::ZERO) {
            continue;
        }
        if waitv {
            let mut watches = vec![Watch {
                word: &r.bell,
                val: own,
                private: true,
            }];
            watches.extend(sleep.armed.iter().flat_map(Armed::watches));
            // More words than one call takes: bound the sleep instead.
            let timeout = if watches.len() > doorbell::WAITV_MAX {
                Some(timeout.map_or(FALLBACK_PERIOD, |t| t.min(FALLBACK_PERIOD)))
            } else {
                timeout
            };
            if doorbell::wait_any(&watches, timeout) != Waited::Unsupported {
                continue;
            }
            waitv = false;
        }
        drop(sleep);
        let empty = r.qps.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
        if empty {
            // Plain FUTEX_WAIT on our own doorbell (no futex_waitv here).
            // SAFETY: `bell` is a valid aligned u32 of this process; the
            // kernel only compares it with `own`.
            unsafe {
                libc::syscall(
                    libc::SYS_futex,
                    r.bell.as_ptr(),
                    libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                    own,
                    std::ptr::null::<libc::timespec>(),
                )
            };
        } else {
            std::thread::sleep(FALLBACK_PERIOD);
        }
    }
}
