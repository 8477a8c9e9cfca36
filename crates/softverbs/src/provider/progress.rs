//! The background progress thread: retries sends that wait for a responder
//! (RNR or a peer not yet at RTR) when the application is blocked in
//! `ibv_get_cq_event` rather than polling.
//!
//! Protocol:
//! 1. A QP whose send queue starts waiting registers itself here (under its
//!    send mutex, then the registry mutex); it unregisters the same way.
//! 2. The thread, holding the registry mutex, only *tries* each QP's send
//!    mutex: it never blocks on it, so the two lock orders cannot deadlock.
//! 3. `destroy_qp` unregisters under the registry mutex before freeing
//!    (always, whatever the QP's waiting state), so the thread never sees a
//!    freed QP. This is the contract of the `unsafe` [`set`].
//! 4. With nothing registered the thread sleeps on a condition variable.
//! 5. The thread drops a QP from the registry itself once its queue is
//!    empty (calls to [`set`] made on the thread are ignored: it already
//!    holds the registry lock).

use std::cell::Cell;
use std::collections::HashSet;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::Duration;

use super::qp::SvQp;

struct Registry {
    qps: Mutex<HashSet<usize>>,
    cv: Condvar,
}

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    static STARTED: OnceLock<()> = OnceLock::new();
    let r = R.get_or_init(|| Registry {
        qps: Mutex::new(HashSet::new()),
        cv: Condvar::new(),
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
        r.cv.notify_one();
    } else {
        g.remove(&(qp as usize));
    }
}

fn run() {
    ON_THREAD.with(|c| c.set(true));
    let r = registry();
    loop {
        {
            let mut g = r.qps.lock().unwrap_or_else(|e| e.into_inner());
            while g.is_empty() {
                g = r.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            g.retain(|&q| {
                // SAFETY: step 3: registered QPs are live while the registry
                // lock is held.
                let q = unsafe { &*(q as *const SvQp) };
                match q.send.try_lock() {
                    Ok(mut ss) => {
                        super::send::progress(q, &mut ss);
                        !ss.pending.is_empty()
                    }
                    Err(_) => true,
                }
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
}
