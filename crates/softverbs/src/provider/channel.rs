//! The completion-channel interposer.
//!
//! `ibv_create_comp_channel` always issues a kernel command, which a provider
//! cannot override. When this library is preloaded it exports the symbol
//! itself:
//! 1. for a softverbs context it builds the `ibv_comp_channel` (with
//!    `malloc`, as libibverbs frees it with `free`) whose `fd` is the read end
//!    of a pipe; the write end stays open here so reads block instead of
//!    returning EOF; event records are written by [`super::notify`];
//! 2. for any other context it forwards to libibverbs' own symbol
//!    (`IBVERBS_1.0`), found with `dlvsym(RTLD_NEXT)` or, when libibverbs
//!    was `dlopen`ed out of the global scope, through its handle.
//!
//! Programs reach this symbol whenever their call resolves through the
//! global scope, where the preloaded library comes before libibverbs:
//! programs linked with libibverbs and modules linked with it that are
//! `dlopen`ed later (Python extensions such as pyverbs, transport plug-ins).
//! A caller that takes the address from libibverbs' own handle
//! (`dlsym(dlopen("libibverbs.so.1"), …)`) or loads with `RTLD_DEEPBIND`
//! gets libibverbs' function, which issues a kernel command.
//!
//! `ibv_destroy_comp_channel` is interposed the same way to close the write
//! end once libibverbs has released the channel.

use std::collections::HashMap;
use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use super::context::is_ours as ctx_is_ours;
use super::set_errno;
use crate::sys::ibv;

fn channels() -> &'static Mutex<HashMap<usize, OwnedFd>> {
    static M: OnceLock<Mutex<HashMap<usize, OwnedFd>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Whether `ch` was built by this interposer.
pub fn is_ours(ch: *mut ibv::ibv_comp_channel) -> bool {
    channels()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains_key(&(ch as usize))
}

/// libibverbs' own `name@IBVERBS_1.0`: the next definition in the global
/// scope (libibverbs linked or loaded `RTLD_GLOBAL`, or another interposer),
/// else libibverbs' handle (loaded with `dlopen`, `RTLD_LOCAL`: out of the
/// scope `RTLD_NEXT` searches).
fn real(name: &std::ffi::CStr) -> *mut libc::c_void {
    // SAFETY: valid C strings; RTLD_NEXT is a valid pseudo-handle.
    let next = unsafe { libc::dlvsym(libc::RTLD_NEXT, name.as_ptr(), c"IBVERBS_1.0".as_ptr()) };
    if !next.is_null() {
        return next;
    }
    crate::sys::private::libibverbs_symbol(name, c"IBVERBS_1.0").unwrap_or(std::ptr::null_mut())
}

/// Interposed `ibv_create_comp_channel`.
///
/// # Safety
/// `ctx` is a live verbs context.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(
    ctx: *mut ibv::ibv_context,
) -> *mut ibv::ibv_comp_channel {
    if !ctx_is_ours(ctx) {
        let f = real(c"ibv_create_comp_channel");
        if f.is_null() {
            set_errno(libc::ENOSYS);
            return std::ptr::null_mut();
        }
        // SAFETY: `f` is libibverbs' ibv_create_comp_channel@IBVERBS_1.0,
        // whose prototype is this function type.
        let f: unsafe extern "C" fn(*mut ibv::ibv_context) -> *mut ibv::ibv_comp_channel =
            unsafe { std::mem::transmute(f) };
        // SAFETY: forwarding the caller's argument unchanged.
        return unsafe { f(ctx) };
    }
    // SAFETY: `ctx_is_ours`: a live context of this provider.
    if unsafe { super::context::inner(ctx) }.dead() {
        // A creation command on a dead device (model::device).
        set_errno(crate::model::device::DEAD_ERRNO);
        return std::ptr::null_mut();
    }
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is a valid 2-int array.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: malloc of the C struct size; checked for null.
    let ch = unsafe { libc::malloc(std::mem::size_of::<ibv::ibv_comp_channel>()) }
        .cast::<ibv::ibv_comp_channel>();
    if ch.is_null() {
        // SAFETY: both fds are ours.
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    }
    // SAFETY: `ch` is a fresh allocation of the right size; fds[1] is ours.
    unsafe {
        ch.write(ibv::ibv_comp_channel {
            context: ctx,
            fd: fds[0],
            refcnt: 0,
        });
        channels()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(ch as usize, OwnedFd::from_raw_fd(fds[1]));
    }
    ch
}

/// Interposed `ibv_destroy_comp_channel`.
///
/// # Safety
/// `ch` is a live channel.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv::ibv_comp_channel) -> libc::c_int {
    let f = real(c"ibv_destroy_comp_channel");
    if f.is_null() {
        return libc::ENOSYS;
    }
    // SAFETY: libibverbs' ibv_destroy_comp_channel@IBVERBS_1.0.
    let f: unsafe extern "C" fn(*mut ibv::ibv_comp_channel) -> libc::c_int =
        unsafe { std::mem::transmute(f) };
    let key = ch as usize;
    // SAFETY: forwarding the caller's argument; it closes fd and frees `ch`.
    let r = unsafe { f(ch) };
    if r == 0 {
        channels()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&key);
    }
    r
}
