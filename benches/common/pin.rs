//! Pinning a benchmark's poller thread.

/// Pins the calling thread to `cpu` on a machine with two or more CPUs
/// (on one, the thread is left where it is).
pub fn pin(cpu: usize) -> Result<(), String> {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        return Ok(());
    }
    if core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        Ok(())
    } else {
        Err(format!("could not pin to CPU {cpu}"))
    }
}
