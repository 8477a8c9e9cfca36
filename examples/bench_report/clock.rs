//! Clocks shared by the report's measurements: one monotonic epoch for
//! every timestamp, thread pinning, and another thread's CPU clock.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Nanoseconds since the report's epoch (the first call), on the
/// monotonic clock (`clock_gettime` through the vDSO, about 20 ns).
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// Pins the calling thread to `cpu`; false when the OS refuses (the
/// report says so rather than measuring unpinned silently). The first call
/// records the thread's mask before it, for [`with_process_mask`].
pub fn pin(cpu: usize) -> bool {
    process_mask();
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu })
}

/// The main thread's CPU mask before the report pinned anything: the
/// process's (read by `main` first thing, or at the first pin).
pub fn process_mask() -> &'static libc::cpu_set_t {
    static MASK: OnceLock<libc::cpu_set_t> = OnceLock::new();
    MASK.get_or_init(current_mask)
}

fn current_mask() -> libc::cpu_set_t {
    // SAFETY: an all-zero `cpu_set_t` is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: pid 0 is the calling thread; `set` is a valid out-parameter
    // of the size passed. On failure the set stays empty and is not used.
    let ok = unsafe { libc::sched_getaffinity(0, std::mem::size_of_val(&set), &mut set) } == 0;
    if !ok {
        // Every CPU the set can name.
        for id in 0..libc::CPU_SETSIZE as usize {
            // SAFETY: `set` is a valid set and `id` below its size.
            unsafe { libc::CPU_SET(id, &mut set) };
        }
    }
    set
}

/// Runs `f` with the calling thread's mask widened back to the process's
/// (threads `f` spawns inherit it: the end-to-end runs place the demo's
/// threads themselves, and an unpinned one must be free to use every CPU),
/// then restores the thread's mask.
pub fn with_process_mask<T>(f: impl FnOnce() -> T) -> T {
    let mine = current_mask();
    let set = |m: &libc::cpu_set_t| {
        // SAFETY: pid 0 is the calling thread; `m` is a valid set of the
        // size passed.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(m), m) }
    };
    set(process_mask());
    let out = f();
    set(&mine);
    out
}

/// Waits until `now_ns() >= at`: sleeps while more than 200 µs remain
/// (so a slow schedule does not burn the generator's CPU), then spins.
pub fn wait_until(at: u64) {
    loop {
        let now = now_ns();
        if now >= at {
            return;
        }
        let left = at - now;
        if left > 200_000 {
            std::thread::sleep(Duration::from_nanos(left - 150_000));
        } else {
            std::hint::spin_loop();
        }
    }
}

/// A thread's CPU clock (`CLOCK_THREAD_CPUTIME_ID` of that thread), read
/// from any thread of the process.
#[derive(Debug, Clone, Copy)]
pub struct ThreadCpu(libc::clockid_t);

impl ThreadCpu {
    /// The calling thread's clock, to be read later from elsewhere.
    pub fn current() -> Option<Self> {
        let mut id: libc::clockid_t = 0;
        // SAFETY: `pthread_self()` is the calling, live thread; `id` is a
        // valid place for the result.
        let rc = unsafe { libc::pthread_getcpuclockid(libc::pthread_self(), &mut id) };
        (rc == 0).then_some(ThreadCpu(id))
    }

    /// CPU time the thread has used so far; `None` once the thread has
    /// exited (the clock is gone).
    pub fn read(self) -> Option<Duration> {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid out-parameter; an invalid clock id gives
        // an error return, not undefined behaviour.
        let rc = unsafe { libc::clock_gettime(self.0, &mut ts) };
        (rc == 0).then(|| Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
    }
}

/// Median, min and max of `v` (sorted in place); NaN for an empty slice.
pub fn spread(v: &mut [f64]) -> Spread {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return Spread {
            median: f64::NAN,
            min: f64::NAN,
            max: f64::NAN,
        };
    }
    Spread {
        median: v[v.len() / 2],
        min: v[0],
        max: v[v.len() - 1],
    }
}

/// A figure over repeated runs.
#[derive(Debug, Clone, Copy)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// `12.3 [11.9–13.0]` with `prec` decimals.
    pub fn show(&self, prec: usize) -> String {
        format!(
            "{:.p$} [{:.p$}–{:.p$}]",
            self.median,
            self.min,
            self.max,
            p = prec
        )
    }
}
