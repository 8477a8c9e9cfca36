//! rdma_cm on softverbs: the kernel's `rdma_ucm` command interface,
//! emulated behind `/dev/infiniband/rdma_cm`, so that the unmodified
//! librdmacm (and everything built on it) runs on the userspace device.
//!
//! librdmacm talks to the kernel through a character device: it opens
//! `/dev/infiniband/rdma_cm` (one open file per event channel), writes
//! commands to it (`write(fd, {cmd, in, out, ...})`, the kernel writing
//! answers to the response pointers inside the commands), and polls the
//! descriptor for events. When this library is preloaded (by
//! `softverbs-run`) it exports `open` and `write`:
//!
//! - `open("/dev/infiniband/rdma_cm")` returns the master side of a fresh
//!   pseudo-terminal: a real character device (librdmacm checks), pollable,
//!   with blocking and non-blocking reads as the application sets them. The
//!   CM keeps the slave side and writes one byte into it while events are
//!   pending, so `poll`/`epoll` on the channel work unchanged;
//! - `write` on such a descriptor executes the command (the `engine`
//!   module); every other descriptor goes to the C library's `write` (a
//!   bitmap test).
//!
//! Connections between processes go over Unix sequenced-packet sockets
//! named after the listener's address, port space and the fabric
//! directory: a REQ/MRA/REP/REJ/RTU/DREQ/DREP exchange ([`wire`]). Each
//! process runs one CM thread for what arrives; the end of a socket is the
//! peer's side being destroyed (including its process dying), answered
//! with the events a fabric gives (see docs/softverbs.md, "rdma_cm"). A
//! peer of another uid is refused at both ends (`peer`).

pub mod abi;
pub mod addr;
mod engine;
mod peer;
pub mod wire;

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// The device node librdmacm opens.
pub const CM_NODE: &CStr = c"/dev/infiniband/rdma_cm";

/// Descriptors below this are tracked in the bitmap; above it channels are
/// refused (EMFILE), so the common path of `write` stays one load.
const MAX_FD: usize = 1 << 16;
static CHANNEL_FDS: [AtomicU64; MAX_FD / 64] = [const { AtomicU64::new(0) }; MAX_FD / 64];

pub(crate) fn mark(fd: c_int, on: bool) {
    let Ok(i) = usize::try_from(fd) else { return };
    if i >= MAX_FD {
        return;
    }
    let bit = 1u64 << (i % 64);
    if on {
        CHANNEL_FDS[i / 64].fetch_or(bit, Ordering::AcqRel);
    } else {
        CHANNEL_FDS[i / 64].fetch_and(!bit, Ordering::AcqRel);
    }
}

fn marked(fd: c_int) -> bool {
    let Ok(i) = usize::try_from(fd) else {
        return false;
    };
    i < MAX_FD && CHANNEL_FDS[i / 64].load(Ordering::Acquire) & (1u64 << (i % 64)) != 0
}

type WriteFn = unsafe extern "C" fn(c_int, *const c_void, usize) -> isize;
type OpenFn = unsafe extern "C" fn(*const c_char, c_int, libc::mode_t) -> c_int;

/// The next definition of `name` after this library (the C library's).
fn next(slot: &AtomicPtr<c_void>, name: &CStr) -> *mut c_void {
    let p = slot.load(Ordering::Acquire);
    if !p.is_null() {
        return p;
    }
    // SAFETY: valid C string; RTLD_NEXT is a valid pseudo-handle.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    slot.store(p, Ordering::Release);
    p
}

fn real_write(fd: c_int, buf: *const c_void, n: usize) -> isize {
    static REAL: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let f = next(&REAL, c"write");
    if f.is_null() {
        // SAFETY: the raw system call with the caller's arguments.
        return unsafe { libc::syscall(libc::SYS_write, fd, buf, n) as isize };
    }
    // SAFETY: `f` is the C library's write, of this type.
    let f: WriteFn = unsafe { std::mem::transmute::<*mut c_void, WriteFn>(f) };
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { f(fd, buf, n) }
}

fn real_open(name: &CStr, path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    static REAL_OPEN: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    static REAL_OPEN64: AtomicPtr<c_void> = AtomicPtr::new(std::ptr::null_mut());
    let slot = if name == c"open" {
        &REAL_OPEN
    } else {
        &REAL_OPEN64
    };
    let f = next(slot, name);
    if f.is_null() {
        // SAFETY: the raw system call with the caller's arguments.
        return unsafe {
            libc::syscall(libc::SYS_openat, libc::AT_FDCWD, path, flags, mode) as c_int
        };
    }
    // SAFETY: `f` is the C library's open/open64, of this type (the mode
    // is passed as the variadic third argument's register).
    let f: OpenFn = unsafe { std::mem::transmute::<*mut c_void, OpenFn>(f) };
    // SAFETY: forwarding the caller's arguments unchanged.
    unsafe { f(path, flags, mode) }
}

fn open_common(name: &CStr, path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    // SAFETY: `path` is the caller's NUL-terminated path (or null).
    if !path.is_null() && unsafe { CStr::from_ptr(path) } == CM_NODE && launched() {
        return match engine::open_channel() {
            Ok(fd) if usize::try_from(fd).is_ok_and(|i| i < MAX_FD) => {
                mark(fd, true);
                fd
            }
            Ok(fd) => {
                engine::forget_channel(fd);
                // SAFETY: closing the master we were given.
                unsafe { libc::close(fd) };
                crate::provider::set_errno(libc::EMFILE);
                -1
            }
            Err(e) => {
                crate::provider::set_errno(e);
                -1
            }
        };
    }
    real_open(name, path, flags, mode)
}

/// Whether this process was started by `softverbs-run` (the only place the
/// device node is ours to answer).
fn launched() -> bool {
    std::env::var_os("SOFTVERBS_RUN").is_some()
}

/// Interposed `open`: `/dev/infiniband/rdma_cm` is an event channel of
/// this CM; every other path goes to the C library.
///
/// # Safety
/// As `open(2)`. The mode is read as the third argument, which C passes in
/// the same register whether or not the call is variadic (x86-64, AArch64
/// Linux); it is only used when `flags` ask for it, as the C library does.
// Not exported under Miri, whose own shims of these C functions an
// exported definition would replace (the unit tests run there).
#[cfg_attr(not(miri), no_mangle)]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    open_common(c"open", path, flags, mode)
}

/// Interposed `open64` (same as [`open`]).
///
/// # Safety
/// As [`open`].
// Not exported under Miri, whose own shims of these C functions an
// exported definition would replace (the unit tests run there).
#[cfg_attr(not(miri), no_mangle)]
pub unsafe extern "C" fn open64(path: *const c_char, flags: c_int, mode: libc::mode_t) -> c_int {
    open_common(c"open64", path, flags, mode)
}

/// Interposed `write`: a command when `fd` is an rdma_cm event channel,
/// the C library's `write` otherwise.
///
/// # Safety
/// As `write(2)`.
// Not exported under Miri, whose own shims of these C functions an
// exported definition would replace (the unit tests run there).
#[cfg_attr(not(miri), no_mangle)]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: usize) -> isize {
    if marked(fd) {
        // Held from here until the command returns, as the kernel holds
        // the file of a write(2) (engine::Held).
        match engine::hold(fd) {
            Ok(held) => {
                let r = engine::command(&held, buf as usize, count);
                if r < 0 {
                    crate::provider::set_errno((-r) as i32);
                    return -1;
                }
                return r;
            }
            // Closed: EBADF, as from the kernel. The channel itself ends
            // when its last descriptor closes (the slave's hang-up), as
            // the kernel's file is released.
            Err(engine::NotHeld::Errno(e)) => {
                crate::provider::set_errno(e);
                return -1;
            }
            // The channel was closed and the number reused.
            Err(engine::NotHeld::Other) => {
                mark(fd, false);
                engine::forget_channel(fd);
            }
        }
    }
    real_write(fd, buf, count)
}
