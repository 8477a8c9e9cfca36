//! Hand-off throughput: one producer (a poller) to 1 and to 2 workers,
//! cqd's pool side by side with the usual alternatives, in one run.
//!
//! ```text
//! cargo bench --bench handoff                 # 10 million items per run
//! CQD_BENCH_QUICK=1 cargo bench --bench handoff   # CI smoke, a few seconds
//! cargo bench --bench handoff -- --items 2000000  # any count
//! CQD_BENCH_ONLY=cqd cargo bench --bench handoff  # contenders whose name has `cqd`
//! CQD_BENCH_WORKERS=1 cargo bench --bench handoff  # only producer -> 1 worker
//! cargo bench --bench handoff -- --pin        # 1 worker: producer on CPU 0, consumer on CPU 1
//! ```
//!
//! Every contender moves `u64`s from one producer thread to `workers`
//! consumer threads through queues of 1024 slots per worker (so memory is
//! bounded the same way), and each consumer sums what it gets. A run ends
//! when every consumer has handled every item and exited. Each figure is the
//! median of three runs. Results and the goals are in
//! docs/benchmarks-handoff.md.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use cqd::core::pool::Work;
use cqd::core::sink::{Burst, Route, Routed, WorkSink};
use cqd::core::topology::{Placement, PoolConfig, TopologyConfig, WorkerIdle};

const CAPACITY: usize = 1024;

/// `--pin` (and examples/bench_report): with one worker, the producer runs
/// on CPU 0 and every contender's consumer on CPU 1.
static PINNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Pins the producer (the calling thread) to CPU 0 and, from now on, each
/// contender's single consumer to CPU 1. False when the OS refuses.
pub fn pin_one_to_one() -> bool {
    PINNED.store(true, Relaxed);
    core_affinity::set_for_current(core_affinity::CoreId { id: 0 })
}

/// Runs `f` with this thread's affinity widened to every online CPU (the
/// disruptor's builder checks that the core it pins a consumer to is in the
/// building thread's mask), then pins it back to CPU 0.
fn unpinned_for<T>(f: impl FnOnce() -> T) -> T {
    if !PINNED.load(Relaxed) {
        return f();
    }
    // SAFETY: sysconf has no preconditions.
    let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize;
    // SAFETY: an all-zero `cpu_set_t` is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for id in 0..online {
        // SAFETY: `set` is a valid set; CPU_SET ignores ids past its size.
        unsafe { libc::CPU_SET(id, &mut set) };
    }
    // SAFETY: pid 0 is the calling thread; `set` is a valid set of the
    // size passed.
    unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    let out = f();
    core_affinity::set_for_current(core_affinity::CoreId { id: 0 });
    out
}

/// The consumer's CPU, when pinned and there is one consumer.
fn consumer_cpu(workers: usize) -> Option<usize> {
    (PINNED.load(Relaxed) && workers == 1).then_some(1)
}

/// Called first on each consumer thread of the non-cqd contenders.
fn pin_consumer(workers: usize) {
    if let Some(id) = consumer_cpu(workers) {
        core_affinity::set_for_current(core_affinity::CoreId { id });
    }
}
/// Items per poller batch (the default poll batch).
const BATCH: usize = 32;

/// Sums what a worker receives; publishes the sum once per batch.
struct Summer {
    local: u64,
    total: Arc<AtomicU64>,
}

impl Work<u64> for Summer {
    fn run(&mut self, item: u64) {
        self.local = self.local.wrapping_add(black_box(item));
    }

    fn batch_done(&mut self) {
        self.total
            .fetch_add(std::mem::take(&mut self.local), Relaxed);
    }
}

fn cqd_pool(items: u64, workers: usize) -> u64 {
    cqd_pool_idle(items, workers, WorkerIdle::Park)
}

/// The pool with `idle = "spin"`: workers never park, offers skip the
/// fence (the configuration to compare with the disruptor, whose consumers
/// spin too).
fn cqd_pool_spinning(items: u64, workers: usize) -> u64 {
    cqd_pool_idle(items, workers, WorkerIdle::Spin)
}

fn cqd_pool_idle(items: u64, workers: usize, idle: WorkerIdle) -> u64 {
    let placement = consumer_cpu(workers).map_or(Placement::Unpinned, Placement::Fixed);
    let topology = TopologyConfig::new().pool(
        PoolConfig::new("bench", workers)
            .capacity(CAPACITY)
            .idle(idle)
            .placement(placement),
    );
    // Pinned, this thread's affinity mask is CPU 0 alone, which `validate`
    // would read as the process's: check against the two CPUs used.
    let mut topology = match consumer_cpu(workers) {
        Some(cpu) => topology.validate_for(&[0, cpu].into_iter().collect()),
        None => topology.validate(),
    }
    .expect("valid topology");
    let total = Arc::new(AtomicU64::new(0));
    let (pool, mut sinks) = topology
        .take_pool("bench")
        .expect("pool")
        .spawn(1, |_| Summer {
            local: 0,
            total: total.clone(),
        })
        .expect("spawn");
    let mut sink = sinks.pop().expect("one sink");
    // The poller's loop: append a drained batch to the spill queue, offer;
    // a round that drained a batch offers as a burst (`Burst::offer`), one
    // that found nothing new offers plainly, as the poller's rounds do.
    let mut burst = Burst::new(&mut sink);
    let mut spill = VecDeque::with_capacity(4 * CAPACITY);
    let pinned = consumer_cpu(workers).is_some();
    let mut next = 0;
    while next < items || !spill.is_empty() {
        let mut found = false;
        let fresh = spill.len();
        if next < items && spill.len() < CAPACITY {
            let end = (next + BATCH as u64).min(items);
            spill.extend((next..end).map(|item| Routed {
                route: Route::LeastLoaded,
                item,
            }));
            next = end;
            found = true;
        }
        let before = spill.len();
        if found {
            burst.offer(&mut spill, fresh);
        } else {
            burst.sink().offer(&mut spill);
        }
        if spill.len() == before && (spill.len() >= CAPACITY || next >= items) {
            // Every ring full and the spill at its bound: a poller would go
            // on polling its CQ; here there is nothing else to do. Pinned
            // to a CPU of its own, the producer spins, as the disruptor's
            // does when its ring is full (a yield on a loaded machine can
            // give the CPU away for a whole time slice); otherwise it
            // yields to the consumers it may share a CPU with.
            if pinned {
                std::hint::spin_loop();
            } else {
                thread::yield_now();
            }
        }
    }
    // The round after the last finds nothing: the burst ends, which
    // completes what it deferred.
    drop(burst);
    drop(sink);
    let snapshot = pool.join().expect("join");
    if std::env::var_os("CQD_BENCH_STATS").is_some() {
        eprintln!("{snapshot:?}");
    }
    total.load(Relaxed)
}

fn std_sync_channel(items: u64, workers: usize) -> u64 {
    let total = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (tx, rx) = std::sync::mpsc::sync_channel::<u64>(CAPACITY);
        senders.push(tx);
        let total = total.clone();
        handles.push(thread::spawn(move || {
            pin_consumer(workers);
            let sum = rx.iter().fold(0u64, |s, v| s.wrapping_add(black_box(v)));
            total.fetch_add(sum, Relaxed);
        }));
    }
    for item in 0..items {
        senders[item as usize % workers].send(item).expect("send");
    }
    drop(senders);
    handles.into_iter().for_each(|h| h.join().expect("join"));
    total.load(Relaxed)
}

#[derive(Default)]
struct Locked {
    queue: Mutex<(VecDeque<u64>, bool)>,
    not_empty: Condvar,
    not_full: Condvar,
}

fn mutex_condvar(items: u64, workers: usize) -> u64 {
    let total = Arc::new(AtomicU64::new(0));
    let queues: Vec<Arc<Locked>> = (0..workers).map(|_| Arc::default()).collect();
    let handles: Vec<_> = queues
        .iter()
        .map(|q| {
            let (q, total) = (q.clone(), total.clone());
            thread::spawn(move || {
                pin_consumer(workers);
                let mut sum = 0u64;
                let mut guard = q.queue.lock().expect("lock");
                loop {
                    if let Some(v) = guard.0.pop_front() {
                        q.not_full.notify_one();
                        sum = sum.wrapping_add(black_box(v));
                    } else if guard.1 {
                        break;
                    } else {
                        guard = q.not_empty.wait(guard).expect("wait");
                    }
                }
                total.fetch_add(sum, Relaxed);
            })
        })
        .collect();
    for item in 0..items {
        let q = &queues[item as usize % workers];
        let mut guard = q.queue.lock().expect("lock");
        while guard.0.len() >= CAPACITY {
            guard = q.not_full.wait(guard).expect("wait");
        }
        guard.0.push_back(item);
        drop(guard);
        q.not_empty.notify_one();
    }
    for q in &queues {
        q.queue.lock().expect("lock").1 = true;
        q.not_empty.notify_one();
    }
    handles.into_iter().for_each(|h| h.join().expect("join"));
    total.load(Relaxed)
}

fn crossbeam_bounded(items: u64, workers: usize) -> u64 {
    let total = Arc::new(AtomicU64::new(0));
    let mut senders = Vec::new();
    let mut handles = Vec::new();
    for _ in 0..workers {
        let (tx, rx) = crossbeam::channel::bounded::<u64>(CAPACITY);
        senders.push(tx);
        let total = total.clone();
        handles.push(thread::spawn(move || {
            pin_consumer(workers);
            let sum = rx.iter().fold(0u64, |s, v| s.wrapping_add(black_box(v)));
            total.fetch_add(sum, Relaxed);
        }));
    }
    for item in 0..items {
        senders[item as usize % workers].send(item).expect("send");
    }
    drop(senders);
    handles.into_iter().for_each(|h| h.join().expect("join"));
    total.load(Relaxed)
}

/// crossbeam's `ArrayQueue` as the ring (the alternative to our own ring):
/// per-item push and pop, consumers yield when empty (no parking).
fn crossbeam_array_queue(items: u64, workers: usize) -> u64 {
    use crossbeam::queue::ArrayQueue;
    let total = Arc::new(AtomicU64::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let queues: Vec<Arc<ArrayQueue<u64>>> = (0..workers)
        .map(|_| Arc::new(ArrayQueue::new(CAPACITY)))
        .collect();
    let handles: Vec<_> = queues
        .iter()
        .map(|q| {
            let (q, total, done) = (q.clone(), total.clone(), done.clone());
            thread::spawn(move || {
                pin_consumer(workers);
                let mut sum = 0u64;
                loop {
                    match q.pop() {
                        Some(v) => sum = sum.wrapping_add(black_box(v)),
                        None if done.load(std::sync::atomic::Ordering::Acquire) && q.is_empty() => {
                            break
                        }
                        None => thread::yield_now(),
                    }
                }
                total.fetch_add(sum, Relaxed);
            })
        })
        .collect();
    for item in 0..items {
        let mut v = item;
        while let Err(back) = queues[item as usize % workers].push(v) {
            v = back;
            thread::yield_now();
        }
    }
    done.store(true, std::sync::atomic::Ordering::Release);
    handles.into_iter().for_each(|h| h.join().expect("join"));
    total.load(Relaxed)
}

fn disruptor_batched(items: u64, workers: usize) -> u64 {
    use disruptor::{
        build_single_producer, BusySpinWithSpinLoopHint, ProcessorSettings, Producer, Sequence,
    };
    struct Event {
        value: u64,
    }
    let total = Arc::new(AtomicU64::new(0));
    let handler = |index: usize| {
        let total = total.clone();
        let mut sum = 0u64;
        move |e: &Event, seq: Sequence, end_of_batch: bool| {
            // Every consumer sees every event; each takes its share.
            if seq as usize % workers == index {
                sum = sum.wrapping_add(black_box(e.value));
            }
            if end_of_batch {
                total.fetch_add(std::mem::take(&mut sum), Relaxed);
            }
        }
    };
    let factory = || Event { value: 0 };
    let mut next = 0u64;
    /// Publishes `n` events, filling each with the closure.
    type Publish<'a> = dyn FnMut(usize, &mut dyn FnMut(&mut Event)) + 'a;
    let mut publish = |producer: &mut Publish<'_>| {
        while next < items {
            let n = BATCH.min((items - next) as usize);
            producer(n, &mut |e: &mut Event| {
                e.value = next;
                next += 1;
            });
        }
    };
    if let Some(cpu) = consumer_cpu(workers) {
        let mut producer = unpinned_for(|| {
            build_single_producer(CAPACITY, factory, BusySpinWithSpinLoopHint)
                .pin_at_core(cpu)
                .handle_events_with(handler(0))
                .build()
        });
        publish(&mut |n, set| producer.batch_publish(n, |iter| iter.for_each(&mut *set)));
    } else if workers == 1 {
        let mut producer = build_single_producer(CAPACITY, factory, BusySpinWithSpinLoopHint)
            .handle_events_with(handler(0))
            .build();
        publish(&mut |n, set| producer.batch_publish(n, |iter| iter.for_each(&mut *set)));
    } else {
        let mut producer = build_single_producer(CAPACITY, factory, BusySpinWithSpinLoopHint)
            .handle_events_with(handler(0))
            .handle_events_with(handler(1))
            .build();
        publish(&mut |n, set| producer.batch_publish(n, |iter| iter.for_each(&mut *set)));
    }
    total.load(Relaxed)
}

/// A contender: its name, and the function that hands `items` to
/// `workers` consumers and returns the sum they saw.
pub type Contender = (&'static str, fn(u64, usize) -> u64);

/// Every contender, cqd's pool first (examples/bench_report runs them too).
pub const CONTENDERS: [Contender; 7] = [
    ("cqd pool (batch offer)", cqd_pool),
    ("cqd pool, spinning workers", cqd_pool_spinning),
    ("std mpsc::sync_channel", std_sync_channel),
    ("Mutex<VecDeque>+Condvar", mutex_condvar),
    ("crossbeam_channel::bounded", crossbeam_bounded),
    ("crossbeam ArrayQueue (yield)", crossbeam_array_queue),
    ("disruptor (batch publish)", disruptor_batched),
];

/// Contenders whose consumers spin and never sleep.
pub fn spins(name: &str) -> bool {
    name.starts_with("disruptor") || name.contains("spinning")
}

fn measure(f: fn(u64, usize) -> u64, items: u64, workers: usize) -> f64 {
    let expected = (0..items).fold(0u64, |s, v| s.wrapping_add(v));
    let mut rates: Vec<f64> = (0..3)
        .map(|_| {
            let started = Instant::now();
            let sum = f(items, workers);
            let elapsed = started.elapsed().max(Duration::from_nanos(1));
            assert_eq!(sum, expected, "every item exactly once");
            items as f64 / elapsed.as_secs_f64()
        })
        .collect();
    rates.sort_by(f64::total_cmp);
    rates[1]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick =
        std::env::var_os("CQD_BENCH_QUICK").is_some() || args.iter().any(|a| a == "--quick");
    let items = args
        .iter()
        .position(|a| a == "--items")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(if quick { 200_000 } else { 10_000_000 });
    let cpus = thread::available_parallelism().map_or(1, |n| n.get());
    if args.iter().any(|a| a == "--pin") && !pin_one_to_one() {
        eprintln!("--pin: cannot pin the producer to CPU 0");
    }
    println!("hand-off: 1 producer, {items} u64 items, {CAPACITY} slots per worker queue, median of 3, {cpus} CPUs");
    let worker_counts: Vec<usize> = match std::env::var("CQD_BENCH_WORKERS") {
        Ok(v) => v.split(',').filter_map(|w| w.trim().parse().ok()).collect(),
        Err(_) => vec![1, 2],
    };
    for workers in worker_counts {
        println!("\nproducer -> {workers} worker(s)");
        println!("{:<30} {:>14} {:>12}", "contender", "items/s", "cqd / this");
        let only = std::env::var("CQD_BENCH_ONLY").ok();
        let mut notes: Vec<String> = Vec::new();
        let rates: Vec<f64> = CONTENDERS
            .iter()
            .map(|(name, f)| match &only {
                Some(only) if !name.contains(only.as_str()) => f64::NAN,
                // Busy-spinning consumers plus a producer on fewer CPUs crawl
                // (they spin away each other's time slices); measure the rate
                // on a twentieth of the items so the run ends in minutes.
                _ if spins(name) && workers + 1 > cpus => {
                    notes.push(format!(
                        "({name}: {} spinning threads on {cpus} CPUs; rate measured on {} items)",
                        workers + 1,
                        items / 20
                    ));
                    measure(*f, (items / 20).max(1), workers)
                }
                _ => measure(*f, items, workers),
            })
            .collect();
        for ((name, _), rate) in CONTENDERS.iter().zip(&rates) {
            println!("{name:<30} {:>14.0} {:>11.2}x", rate, rates[0] / rate);
        }
        notes.iter().for_each(|n| println!("{n}"));
        let goal = |i: usize, want: f64| {
            let ratio = rates[0] / rates[i];
            let verdict = if ratio >= want { "met" } else { "NOT met" };
            println!(
                "goal: cqd >= {want}x {:<28} {ratio:>6.2}x {verdict}",
                CONTENDERS[i].0
            );
        };
        goal(2, 3.0);
        goal(3, 3.0);
        goal(6, 0.7);
        let ratio = rates[1] / rates[6];
        let verdict = if ratio >= 1.0 { "met" } else { "NOT met" };
        println!(
            "goal: {} >= 1.0x {:<20} {ratio:>6.2}x {verdict}",
            CONTENDERS[1].0, CONTENDERS[6].0
        );
    }
    let ring_bytes = CAPACITY * std::mem::size_of::<u64>();
    println!(
        "\nmemory: cqd holds at most producers x workers x {CAPACITY} slots = {ring_bytes} bytes per worker here, plus the poller's spill (bounded by the producer)"
    );
}
