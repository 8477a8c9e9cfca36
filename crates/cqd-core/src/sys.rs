//! The few OS calls the poller needs, through rustix's safe wrappers: an
//! eventfd to wake a sleeping poller, an epoll set in which each
//! notification descriptor of a poll group is registered once (a wake-up
//! returns only the ready ones); and two hints, `madvise(MADV_HUGEPAGE)` on
//! the handler slab and ledger arena and a cache-line prefetch for
//! dispatch (the only `unsafe` here).

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::Duration;

use rustix::event::{epoll, eventfd, EventfdFlags};

/// A non-blocking eventfd used as a doorbell.
#[derive(Debug)]
pub(crate) struct Doorbell(OwnedFd);

impl Doorbell {
    pub(crate) fn new() -> io::Result<Self> {
        let fd = eventfd(0, EventfdFlags::NONBLOCK | EventfdFlags::CLOEXEC)?;
        Ok(Doorbell(fd))
    }

    /// Rings the bell: the descriptor becomes readable.
    pub(crate) fn ring(&self) {
        // A full counter (2^64 - 2 rings) is the only failure, and then the
        // descriptor is readable anyway, which is all a ring means.
        let _ = rustix::io::write(&self.0, &1u64.to_ne_bytes());
    }

    /// Silences the bell; returns how many rings were pending.
    pub(crate) fn drain(&self) -> u64 {
        let mut buf = [0u8; 8];
        match rustix::io::read(&self.0, &mut buf) {
            Ok(8) => u64::from_ne_bytes(buf),
            _ => 0,
        }
    }
}

impl AsFd for Doorbell {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// An epoll set: descriptors are registered once, level-triggered, each
/// with a 64-bit token; a wait returns the tokens of the ready ones.
pub(crate) struct Epoll {
    fd: OwnedFd,
}

/// Ready descriptors taken per wait; more stay ready (level-triggered) for
/// the next one.
const EVENTS_PER_WAIT: usize = 256;

impl std::fmt::Debug for Epoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Epoll").field("fd", &self.fd).finish()
    }
}

impl Epoll {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Epoll {
            fd: epoll::create(epoll::CreateFlags::CLOEXEC)?,
        })
    }

    /// Registers `fd` (readable, level-triggered) under `token`.
    pub(crate) fn add(&mut self, fd: BorrowedFd<'_>, token: u64) -> io::Result<()> {
        epoll::add(
            &self.fd,
            fd,
            epoll::EventData::new_u64(token),
            epoll::EventFlags::IN,
        )?;
        Ok(())
    }

    /// Removes `fd` (registered by [`add`](Self::add)).
    pub(crate) fn delete(&mut self, fd: BorrowedFd<'_>) -> io::Result<()> {
        epoll::delete(&self.fd, fd)?;
        Ok(())
    }

    /// Blocks until a registered descriptor is ready or `timeout` passes
    /// (`None`: do not block). Appends the ready tokens to `ready`
    /// (cleared first); returns how many.
    pub(crate) fn wait(
        &mut self,
        timeout: Option<Duration>,
        ready: &mut Vec<u64>,
    ) -> io::Result<usize> {
        let ts = rustix::event::Timespec {
            tv_sec: timeout.map_or(0, |t| t.as_secs() as _),
            tv_nsec: timeout.map_or(0, |t| t.subsec_nanos() as _),
        };
        let mut events = [std::mem::MaybeUninit::<epoll::Event>::uninit(); EVENTS_PER_WAIT];
        let (got, _) = loop {
            match epoll::wait(&self.fd, &mut events, Some(&ts)) {
                Ok(r) => break r,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
        };
        ready.clear();
        ready.extend(got.iter().map(|e| e.data.u64()));
        Ok(ready.len())
    }
}

impl AsFd for Epoll {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// Times the calling thread gave up its CPU of its own accord (slept,
/// waited on a lock or I/O): `getrusage(RUSAGE_THREAD)`'s `ru_nvcsw`, 0 if
/// the kernel refuses. A preempted thread's switches are involuntary and
/// not counted.
pub(crate) fn voluntary_switches() -> u64 {
    // SAFETY: an all-zero `rusage` is a valid value of this plain C struct.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid, writable `rusage` for the call's duration.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) } != 0 {
        return 0;
    }
    u.ru_nvcsw.max(0) as u64
}

/// CPU time consumed by the calling thread.
pub(crate) fn thread_cpu_time() -> Duration {
    let ts = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// Huge pages' size on x86_64 and aarch64 (with 4 KiB base pages).
const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the whole huge pages inside `v`'s buffer with
/// transparent huge pages (`MADV_HUGEPAGE`), so that a slab or arena of
/// hundreds of thousands of handlers costs a few TLB entries instead of a
/// TLB miss per cold handler. Call it before the buffer is touched (pages
/// are backed when first written). A hint: a buffer smaller than a huge
/// page, a kernel without transparent huge pages, or a refusal changes
/// nothing.
pub(crate) fn advise_huge_pages<T>(v: &Vec<T>) {
    let start = v.as_ptr() as usize;
    let end = start + v.capacity() * std::mem::size_of::<T>();
    let first = start.next_multiple_of(HUGE_PAGE);
    let last = end / HUGE_PAGE * HUGE_PAGE;
    if last <= first {
        return;
    }
    // SAFETY: [first, last) lies inside `v`'s allocation, which `v` keeps
    // alive for the call, and is page-aligned. MADV_HUGEPAGE changes only
    // how the kernel backs the range — never its contents, mapping or
    // protection — so no reference into it is affected.
    let _ = unsafe {
        rustix::mm::madvise(
            first as *mut std::ffi::c_void,
            last - first,
            rustix::mm::Advice::LinuxHugepage,
        )
    };
}

/// Asks the CPU to bring the cache line of `r` in, owned for writing (a
/// hint: a poster that pops a free slot asks for the next one, which the
/// poller's CPU wrote last, so that its next pop and fill do not wait for
/// the line to cross; `prefetchw`, which x86-64 CPUs of the last decade
/// run and older ones treat as a no-op).
#[inline(always)]
pub(crate) fn prefetch_write<T: ?Sized>(r: &T) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: `prefetchw` reads and writes nothing the program observes
    // and cannot fault whatever the address; `r` is a live reference
    // anyway. The instruction touches no register but its address.
    unsafe {
        std::arch::asm!(
            "prefetchw [{}]",
            in(reg) (r as *const T).cast::<u8>(),
            options(nostack, preserves_flags, readonly)
        );
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = r;
}

/// Asks the CPU to bring the cache line of `r` in (a hint: a completion
/// for a cold handler misses the cache; the poller asks for a batch's
/// lines before it needs them, so that the misses overlap).
#[inline(always)]
pub(crate) fn prefetch<T: ?Sized>(r: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `_mm_prefetch` reads nothing the program observes and cannot
    // fault whatever the address; `r` is a live reference anyway. SSE is
    // part of the x86_64 baseline.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>((r as *const T).cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = r;
}
