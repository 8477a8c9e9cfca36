//! What a completion future costs, side by side in one run, per operation
//! (an RDMA WRITE of 64 bytes on a loopback RC pair, posted through cqd's
//! posting call, its completion delivered by a Busy poller thread pinned
//! to CPU 1; the posting side pinned to CPU 0):
//!
//! - `handler`: a plain handler counts completions into an atomic; the
//!   posting thread keeps `WINDOW` requests outstanding, spinning on the
//!   count — the handler path, no future;
//! - `futures`: `Ops::post_send` returns a future per request; a task on
//!   a current-thread tokio runtime keeps `WINDOW` outstanding and awaits
//!   them in order, woken from the poller thread;
//! - `mutex map + oneshot`: the pattern of async-rdma and of crates that
//!   allocate a channel per request — the poster makes a
//!   `tokio::sync::oneshot` pair, inserts its sender in a
//!   `Mutex<HashMap<wr_id, Sender>>`, posts with the plain handler's tag;
//!   the handler, on the poller thread, removes the sender and sends the
//!   completion; the task awaits the receivers in order.
//!
//! Two settings: `one task` (one task, window 32) and `8 tasks` (eight
//! tasks on the same runtime, window 4 each: the map's lock is taken by
//! several posters between the poller's removals).
//!
//! ```text
//! cargo bench --bench futures                      # the simulated NIC
//! cargo bench --bench futures -- --quick           # smoke run
//! cargo bench --bench futures -- --profile futures # one contender alone, for perf
//! softverbs-run target/release/deps/futures-* --bench --verbs   # built with --features verbs
//! ```
//!
//! Each contender runs `REPS` times, alternated; the table gives the median
//! [min–max] of the runs, ns per operation, and the ratios the async issue
//! sets goals on: futures / handler (goal ≤ 1.3) and mutex map / futures
//! (goal ≥ 5 under concurrency). Figures are recorded in docs/benchmarks.md.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cqd::core::future::Ops;
use cqd::core::{
    CqHandle, CqOptions, Failed, Handler, NoSink, NoWork, Outbox, PollMode, PollerBuilder,
    PollerThread, RecvDone, Registration, SendDone, UnboundCq,
};
use tokio::sync::oneshot;

const WINDOW: usize = 32;
const REPS: usize = 5;

/// One request's outcome as the map's channel carries it.
type Outcome = Result<u32, String>;
type Map = Arc<Mutex<HashMap<u32, oneshot::Sender<Outcome>>>>;

/// Counts completions; with a map, also hands each to its channel.
struct Count {
    done: Arc<AtomicU64>,
    map: Option<Map>,
}

impl Handler for Count {
    fn on_send(&mut self, d: &SendDone<'_>, _: &mut Outbox<'_, NoWork>) {
        if let Some(map) = &self.map {
            if let Some(tx) = map.lock().unwrap().remove(&d.tag()) {
                let _ = tx.send(Ok(d.byte_len()));
            }
        }
        self.done.fetch_add(1, Ordering::Release);
    }
    fn on_recv(&mut self, _: &RecvDone<'_>, _: &mut Outbox<'_, NoWork>) {}
    fn on_error(&mut self, f: &Failed<'_>, _: &mut Outbox<'_, NoWork>) {
        if let Some(map) = &self.map {
            if let Some(tx) = map.lock().unwrap().remove(&f.tag()) {
                let _ = tx.send(Err(format!("{:?}", f.status())));
            }
        }
        panic!("a benchmark request failed: {:?}", f.status());
    }
}

/// The network: a loopback RC pair and a region, on the simulated NIC or
/// on verbs.
trait Net: Send + Sync + 'static {
    /// Posts one 64-byte WRITE through `reg` with `tag`.
    fn write(&self, reg: &Registration, tag: u32);
    /// Posts one 64-byte WRITE as a future.
    fn write_op(&self, ops: &Ops<u64>, hold: u64) -> cqd::core::future::Op<u64>;
}

type Setup = (Arc<dyn Net>, UnboundCq<NoWork>, CqHandle<NoWork>);

fn sim_net() -> Setup {
    use cqd::sim::{connect, Access, CqConfig, Device, QpCap, QpInit, SendWr, WrOp};
    let dev = Device::open("futb0");
    let (cq, unbound, handle) = dev
        .create_dispatched_cq("futb", 4096, CqConfig::default(), CqOptions::default())
        .unwrap();
    let pd = dev.alloc_pd();
    let cap = QpCap {
        max_send_wr: 512,
        max_recv_wr: 16,
        ..QpCap::default()
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    connect(&a, &b).unwrap();
    let mr = pd.reg_mr(8192, Access::ALL).unwrap();
    struct Sim {
        _dev: Device,
        a: cqd::sim::Qp,
        _b: cqd::sim::Qp,
        mr: cqd::sim::Mr,
    }
    impl Net for Sim {
        fn write(&self, reg: &Registration, tag: u32) {
            let src = [self.mr.sge(0, 64)];
            let mut wr = [SendWr::new(
                u64::from(tag),
                WrOp::Write(self.mr.remote(4096)),
                &src,
            )];
            reg.post_send(&self.a, &mut wr).unwrap();
        }
        fn write_op(&self, ops: &Ops<u64>, hold: u64) -> cqd::core::future::Op<u64> {
            let src = [self.mr.sge(0, 64)];
            let wr = SendWr::new(0, WrOp::Write(self.mr.remote(4096)), &src);
            ops.post_send(&self.a, wr, hold).unwrap()
        }
    }
    (
        Arc::new(Sim {
            _dev: dev,
            a,
            _b: b,
            mr,
        }),
        unbound,
        handle,
    )
}

#[cfg(feature = "verbs")]
fn verbs_net() -> Setup {
    use cqd::verbs::{Access, ConnectOptions, Context, CqSpec, QpCap, QpInit, SendWr, WrOp};
    let ctx = Context::open_first().expect("a verbs device (run under softverbs-run)");
    let pd = ctx.alloc_pd().unwrap();
    let (cq, unbound, handle) = ctx
        .create_dispatched_cq::<NoWork>("futb", 4096, CqSpec::default(), CqOptions::default())
        .unwrap();
    let cap = QpCap {
        max_send_wr: 512,
        max_recv_wr: 16,
        ..QpCap::default()
    };
    let a = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let b = pd.create_qp(&QpInit::new(&cq, &cq, cap)).unwrap();
    let opts = ConnectOptions::default();
    let (ea, eb) = (a.endpoint(&opts, 1).unwrap(), b.endpoint(&opts, 2).unwrap());
    a.connect(&eb, 1, &opts).unwrap();
    b.connect(&ea, 2, &opts).unwrap();
    let mr = pd.reg_mr(8192, Access::ALL_RDMA).unwrap();
    struct Verbs {
        a: cqd::verbs::Qp,
        _b: cqd::verbs::Qp,
        mr: cqd::verbs::Mr,
    }
    impl Net for Verbs {
        fn write(&self, reg: &Registration, tag: u32) {
            let src = [self.mr.sge(0, 64)];
            let mut wr = [SendWr::new(
                u64::from(tag),
                WrOp::Write(self.mr.remote(4096)),
                &src,
            )];
            reg.post_send(&self.a, &mut wr).unwrap();
        }
        fn write_op(&self, ops: &Ops<u64>, hold: u64) -> cqd::core::future::Op<u64> {
            let src = [self.mr.sge(0, 64)];
            let wr = SendWr::new(0, WrOp::Write(self.mr.remote(4096)), &src);
            ops.post_send(&self.a, wr, hold).unwrap()
        }
    }
    (Arc::new(Verbs { a, _b: b, mr }), unbound, handle)
}

#[cfg(not(feature = "verbs"))]
fn verbs_net() -> Setup {
    panic!("--verbs needs the bench built with --features verbs")
}

fn pin(cpu: usize) {
    core_affinity::set_for_current(core_affinity::CoreId { id: cpu });
}

struct Rig {
    net: Arc<dyn Net>,
    poller: PollerThread,
    done: Arc<AtomicU64>,
    reg: Registration,
    map: Map,
    map_reg: Registration,
    ops: Ops<u64>,
}

fn rig(verbs: bool) -> Rig {
    let (net, unbound, handle) = if verbs { verbs_net() } else { sim_net() };
    let done = Arc::new(AtomicU64::new(0));
    let map: Map = Arc::default();
    let reg = handle
        .register(Count {
            done: Arc::clone(&done),
            map: None,
        })
        .unwrap();
    let map_reg = handle
        .register(Count {
            done: Arc::clone(&done),
            map: Some(Arc::clone(&map)),
        })
        .unwrap();
    let ops = handle.register_futures::<u64>(1024).unwrap();
    let poller = PollerBuilder::new("futb", NoSink)
        .mode(PollMode::Busy)
        .busy_naps(false)
        .on_start(|| {
            pin(1);
            Ok(())
        })
        .cq(unbound)
        .spawn()
        .unwrap();
    Rig {
        net,
        poller,
        done,
        reg,
        map,
        map_reg,
        ops,
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Who {
    Handler,
    Futures,
    Map,
}

impl Who {
    fn name(self) -> &'static str {
        match self {
            Who::Handler => "handler",
            Who::Futures => "futures",
            Who::Map => "mutex map + oneshot",
        }
    }
}

/// The handler path: `n` WRITEs, `WINDOW` outstanding, ns per operation.
fn run_handler(r: &Rig, n: u64) -> f64 {
    let start_done = r.done.load(Ordering::Acquire);
    let t = Instant::now();
    let mut posted = 0u64;
    while posted < n {
        while posted - (r.done.load(Ordering::Acquire) - start_done) < WINDOW as u64 && posted < n {
            r.net.write(&r.reg, (posted % 1000) as u32);
            posted += 1;
        }
        std::hint::spin_loop();
    }
    while r.done.load(Ordering::Acquire) - start_done < n {
        std::hint::spin_loop();
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// One task's share: `n` operations, `window` outstanding, awaited in
/// order.
async fn task(r: Arc<Rig>, who: Who, n: u64, window: usize, first_tag: u32) {
    match who {
        Who::Futures => {
            let mut q = VecDeque::with_capacity(window);
            for i in 0..n {
                if q.len() == window {
                    let op: cqd::core::future::Op<u64> = q.pop_front().unwrap();
                    let (out, _) = op.await;
                    out.unwrap();
                }
                q.push_back(r.net.write_op(&r.ops, i));
            }
            for op in q {
                op.await.0.unwrap();
            }
        }
        Who::Map => {
            let mut q = VecDeque::with_capacity(window);
            for i in 0..n {
                if q.len() == window {
                    let rx: oneshot::Receiver<Outcome> = q.pop_front().unwrap();
                    rx.await.unwrap().unwrap();
                }
                let tag = first_tag + (i % 100_000) as u32;
                let (tx, rx) = oneshot::channel();
                r.map.lock().unwrap().insert(tag, tx);
                r.net.write(&r.map_reg, tag);
                q.push_back(rx);
            }
            for rx in q {
                rx.await.unwrap().unwrap();
            }
        }
        Who::Handler => unreachable!(),
    }
}

/// `tasks` tasks on a current-thread runtime (this thread), `n` operations
/// in all; ns per operation.
fn run_async(r: &Arc<Rig>, who: Who, n: u64, tasks: usize) -> f64 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let local = tokio::task::LocalSet::new();
    let window = WINDOW / tasks;
    let each = n / tasks as u64;
    let t = Instant::now();
    local.block_on(&rt, async {
        let hs: Vec<_> = (0..tasks)
            .map(|k| {
                tokio::task::spawn_local(task(
                    Arc::clone(r),
                    who,
                    each,
                    window,
                    (k as u32) * 1_000_000,
                ))
            })
            .collect();
        for h in hs {
            h.await.unwrap();
        }
    });
    t.elapsed().as_nanos() as f64 / (each * tasks as u64) as f64
}

fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (v[v.len() / 2], v[0], v[v.len() - 1])
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let verbs = args.iter().any(|a| a == "--verbs");
    let n: u64 = if quick { 20_000 } else { 400_000 };
    let reps = if quick { 1 } else { REPS };
    pin(0);
    let r = Arc::new(rig(verbs));
    // Warm-up: every path once.
    run_handler(&r, n / 10);
    run_async(&r, Who::Futures, n / 10, 1);
    run_async(&r, Who::Map, n / 10, 1);
    // `--profile futures|map|handler`: that contender alone, one task,
    // for a profiler.
    if let Some(at) = args.iter().position(|a| a == "--profile") {
        let who = match args.get(at + 1).map(String::as_str) {
            Some("futures") => Who::Futures,
            Some("map") => Who::Map,
            Some("handler") => Who::Handler,
            other => panic!("--profile takes futures, map or handler, not {other:?}"),
        };
        for _ in 0..10 {
            let ns = match who {
                Who::Handler => run_handler(&r, n),
                _ => run_async(&r, who, n, 1),
            };
            println!("{}: {ns:.1} ns per operation", who.name());
        }
        return;
    }
    let settings = [("one task", 1usize), ("8 tasks", 8usize)];
    let whos = [Who::Handler, Who::Futures, Who::Map];
    let mut res: HashMap<(usize, usize), Vec<f64>> = HashMap::new();
    for _ in 0..reps {
        for (s, &(_, tasks)) in settings.iter().enumerate() {
            for (w, &who) in whos.iter().enumerate() {
                let ns = match who {
                    Who::Handler => run_handler(&r, n),
                    _ => run_async(&r, who, n, tasks),
                };
                res.entry((s, w)).or_default().push(ns);
            }
        }
    }
    let nic = if verbs { "verbs" } else { "the simulated NIC" };
    println!(
        "Completion futures on {nic}: ns per RDMA WRITE (post to completion consumed), {reps} runs of {n}, median [min–max]"
    );
    println!(
        "{:<24} {:>30} {:>30}",
        "path", "one task (window 32)", "8 tasks (window 4 each)"
    );
    let mut med = HashMap::new();
    for (w, &who) in whos.iter().enumerate() {
        let mut line = format!("{:<24}", who.name());
        for s in 0..settings.len() {
            let (m, lo, hi) = stats(res.get_mut(&(s, w)).unwrap());
            med.insert((s, w), m);
            line += &format!(" {:>10.1} [{:>7.1}–{:>7.1}]", m, lo, hi);
        }
        println!("{line}");
    }
    for (s, &(name, _)) in settings.iter().enumerate() {
        let fut_vs_handler = med[&(s, 1)] / med[&(s, 0)];
        let map_vs_fut = med[&(s, 2)] / med[&(s, 1)];
        println!(
            "{name:<10} futures / handler = {fut_vs_handler:.2} (goal <= 1.3): {}; mutex map / futures = {map_vs_fut:.2} (goal >= 5): {}",
            if fut_vs_handler <= 1.3 { "met" } else { "not met" },
            if map_vs_fut >= 5.0 { "met" } else { "not met" },
        );
    }
    let r = Arc::into_inner(r).expect("tasks are done");
    let report = r.poller.stop().unwrap();
    assert!(report.accounts.is_balanced(), "{}", report.accounts);
}
