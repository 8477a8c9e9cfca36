//! The device clock: what completion timestamps count and
//! `ibv_query_rt_values_ex` reads.
//!
//! Every process of the fabric stamps the completions it adds, the owner's
//! and its peers' alike, so the clock must be one clock for the whole
//! machine: `CLOCK_MONOTONIC`, in nanoseconds (the device reports
//! `hca_core_clock` = 1 000 000 kHz: one tick is one nanosecond, and a
//! 64-bit `completion_timestamp_mask`). A wall-clock timestamp is that
//! tick converted with the current offset between `CLOCK_REALTIME` and
//! `CLOCK_MONOTONIC`, as hardware providers convert their free-running
//! clock with the offset they keep to real time.

/// `hca_core_clock`: the device clock's frequency in kHz.
pub const CORE_CLOCK_KHZ: u64 = 1_000_000;

fn now(clock: libc::clockid_t) -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is writable; these clocks always exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut t) };
    (t.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(t.tv_nsec as u64)
}

/// The device clock now (never 0: a stamp of 0 means "not stamped").
pub fn device_ns() -> u64 {
    now(libc::CLOCK_MONOTONIC).max(1)
}

/// The real time (ns since the epoch) of device clock value `ts`.
pub fn wallclock_ns(ts: u64) -> u64 {
    let offset = now(libc::CLOCK_REALTIME).wrapping_sub(now(libc::CLOCK_MONOTONIC));
    ts.wrapping_add(offset)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_clock_advances_and_converts_to_real_time() {
        let a = device_ns();
        let b = device_ns();
        assert!(a > 0 && b >= a);
        let real = now(libc::CLOCK_REALTIME);
        let w = wallclock_ns(b);
        // Converted within a second of the real time now.
        assert!(w.abs_diff(real) < 1_000_000_000, "{w} vs {real}");
    }
}
