//! Device death on demand, for applications that test their handling of a
//! hot-unplugged device or a fatal firmware error (rules: model::device).
//!
//! The launcher preloads this library, so a test finds the entry point with
//! `dlsym(RTLD_DEFAULT, "softverbs_inject_device_fatal")`:
//!
//! ```c
//! int softverbs_inject_device_fatal(struct ibv_context *ctx);
//! ```
//!
//! Protocol:
//! 1. the context's shared `dead` flag goes from 0 to 1 (an atomic swap, so
//!    concurrent or repeated calls raise one event);
//! 2. the thread that flipped it writes one `ib_uverbs_async_event_desc`
//!    record (element 0, `IBV_EVENT_DEVICE_FATAL`) into the context's async
//!    pipe, which `ibv_get_async_event` reads, then closes the pipe's write
//!    end: once the record is read, the next `ibv_get_async_event` fails
//!    (EOF) instead of blocking for ever, as the kernel's EIO does for a
//!    disassociated device;
//! 3. every verb of this provider checks the flag of its own context
//!    (`ContextInner::dead`), and every requester checks the flag of its
//!    responder's context (`Remote::dead`) before touching the responder:
//!    the flag lives in the shared context segment, so requesters in other
//!    processes see it.

use std::ffi::c_int;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;

use super::context::{inner, is_ours};
use crate::model::device::EVENT_DEVICE_FATAL;
use crate::sys::ibv;

/// One `struct ib_uverbs_async_event_desc` (`element`, `event_type`,
/// `reserved`), as the kernel writes it and `ibv_get_async_event` reads it.
pub fn async_record(element: u64, event_type: u32) -> [u8; 16] {
    let mut rec = [0u8; 16];
    rec[..8].copy_from_slice(&element.to_ne_bytes());
    rec[8..12].copy_from_slice(&event_type.to_ne_bytes());
    rec
}

/// Make the device die for `ctx`: see the module docs.
///
/// Returns 0 (also when the context was already dead: no second event), or
/// EINVAL when `ctx` is null or not an open context of this provider.
///
/// # Safety
/// `ctx` is null or a pointer returned by `ibv_open_device` and not yet
/// closed (any device's: other devices answer EINVAL).
#[no_mangle]
pub unsafe extern "C" fn softverbs_inject_device_fatal(ctx: *mut ibv::ibv_context) -> c_int {
    if ctx.is_null() || !is_ours(ctx) {
        return libc::EINVAL;
    }
    // SAFETY: `is_ours`: a live context made by alloc_context (caller
    // contract: not closed concurrently).
    let c = unsafe { inner(ctx) };
    if c.hdr().dead.swap(1, Ordering::AcqRel) == 0 {
        let rec = async_record(0, EVENT_DEVICE_FATAL);
        let w = c.async_w.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = w {
            // SAFETY: `rec` is a valid 16-byte buffer (<= PIPE_BUF: atomic);
            // the write end is ours and non-blocking.
            unsafe { libc::write(w.as_raw_fd(), rec.as_ptr().cast(), rec.len()) };
        } // `w` is dropped: the write end closes.
    }
    0
}

#[cfg(test)]
mod tests {
    #[test]
    fn record_layout() {
        let r = super::async_record(0x0102_0304_0506_0708, 8);
        assert_eq!(&r[..8], &0x0102_0304_0506_0708u64.to_ne_bytes());
        assert_eq!(&r[8..12], &8u32.to_ne_bytes());
        assert_eq!(&r[12..], &[0; 4]);
    }
}
