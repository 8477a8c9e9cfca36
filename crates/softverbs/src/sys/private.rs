//! Run-time resolution of libibverbs' private provider symbols.
//!
//! The provider never links against `IBVERBS_PRIVATE_34` symbols directly: a
//! libibverbs built with another private ABI would then make the dynamic
//! loader refuse the library with an obscure message. Instead the constructor
//! looks the symbols up with `dlvsym` and, when they are missing, prints one
//! clear line and stays inert.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use super::abi::{VerbsContextOps, VerbsDeviceOps};
use super::ibv;

/// The private ABI version this provider was written against.
pub const PRIVATE_ABI: &CStr = c"IBVERBS_PRIVATE_34";

/// `verbs_register_driver_34`.
pub type RegisterFn = unsafe extern "C" fn(*const VerbsDeviceOps);
/// `_verbs_init_and_alloc_context`.
pub type InitAllocFn = unsafe extern "C" fn(
    *mut ibv::ibv_device,
    c_int,
    usize,
    *mut ibv::verbs_context,
    u32,
) -> *mut c_void;
/// `verbs_set_ops`.
pub type SetOpsFn = unsafe extern "C" fn(*mut ibv::verbs_context, *const VerbsContextOps);
/// `verbs_uninit_context`.
pub type UninitFn = unsafe extern "C" fn(*mut ibv::verbs_context);
/// `verbs_init_cq`.
pub type InitCqFn = unsafe extern "C" fn(
    *mut ibv::ibv_cq,
    *mut ibv::ibv_context,
    *mut ibv::ibv_comp_channel,
    *mut c_void,
);

/// The private entry points the provider calls.
#[derive(Debug, Clone, Copy)]
pub struct Private {
    /// `verbs_register_driver_34`.
    pub register_driver: RegisterFn,
    /// `_verbs_init_and_alloc_context`.
    pub init_and_alloc_context: InitAllocFn,
    /// `verbs_set_ops`.
    pub set_ops: SetOpsFn,
    /// `verbs_uninit_context`.
    pub uninit_context: UninitFn,
    /// `verbs_init_cq`.
    pub init_cq: InitCqFn,
}

/// Why the private ABI could not be bound.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AbiError {
    /// libibverbs is not loaded in this process.
    #[error("libibverbs.so.1 is not loaded in this process")]
    NotLoaded,
    /// A private symbol of the expected version is missing.
    #[error(
        "libibverbs does not export {symbol}@IBVERBS_PRIVATE_34: this softverbs build \
         needs rdma-core with private provider ABI 34 (rdma-core v40..v56)"
    )]
    Missing {
        /// The symbol that was not found.
        symbol: &'static str,
    },
}

/// libibverbs' own handle, for symbol look-ups that must not depend on
/// how it was loaded: a program that `dlopen`s libibverbs (Python and its
/// extension modules, transport plug-ins) loads it `RTLD_LOCAL`, out of the
/// global scope that `RTLD_DEFAULT` and `RTLD_NEXT` search from this
/// preloaded library. `None` when libibverbs is not loaded (never loads it).
///
/// The first handle found is kept, with the reference `RTLD_NOLOAD` took:
/// the entry points bound from it stay valid for the life of the process
/// (a program's `dlclose` cannot unload libibverbs under the provider).
pub fn libibverbs_handle() -> Option<*mut c_void> {
    static HANDLE: AtomicUsize = AtomicUsize::new(0);
    let h = HANDLE.load(Ordering::Acquire);
    if h != 0 {
        return Some(h as *mut c_void);
    }
    // SAFETY: a valid C string; RTLD_NOLOAD never loads anything.
    let h = unsafe {
        libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        )
    };
    if h.is_null() {
        return None;
    }
    if let Err(first) = HANDLE.compare_exchange(0, h as usize, Ordering::AcqRel, Ordering::Acquire)
    {
        // Another thread kept one first: drop our extra reference.
        // SAFETY: `h` came from the successful dlopen above.
        unsafe { libc::dlclose(h) };
        return Some(first as *mut c_void);
    }
    Some(h)
}

/// True when libibverbs is already mapped into this process (linked,
/// preloaded or `dlopen`ed, global or local).
pub fn libibverbs_loaded() -> bool {
    libibverbs_handle().is_some()
}

/// `name@version` in libibverbs, wherever it was loaded.
pub fn libibverbs_symbol(name: &CStr, version: &CStr) -> Option<*mut c_void> {
    let h = libibverbs_handle()?;
    // SAFETY: `h` is a live handle (its reference is kept), both strings
    // are valid NUL-terminated C strings.
    let p = unsafe { libc::dlvsym(h, name.as_ptr(), version.as_ptr()) };
    (!p.is_null()).then_some(p)
}

fn lookup(name: &'static CStr) -> Result<*mut c_void, AbiError> {
    libibverbs_symbol(name, PRIVATE_ABI).ok_or_else(|| AbiError::Missing {
        symbol: name.to_str().unwrap_or("?"),
    })
}

fn bind() -> Result<Private, AbiError> {
    if !libibverbs_loaded() {
        return Err(AbiError::NotLoaded);
    }
    let register = lookup(c"verbs_register_driver_34")?;
    let init = lookup(c"_verbs_init_and_alloc_context")?;
    let set_ops = lookup(c"verbs_set_ops")?;
    let uninit = lookup(c"verbs_uninit_context")?;
    let init_cq = lookup(c"verbs_init_cq")?;
    // SAFETY: each pointer is the address of the libibverbs function of that
    // name at version IBVERBS_PRIVATE_34, whose C prototype (driver.h v44)
    // is the function type it is transmuted to.
    unsafe {
        Ok(Private {
            register_driver: std::mem::transmute::<*mut c_void, RegisterFn>(register),
            init_and_alloc_context: std::mem::transmute::<*mut c_void, InitAllocFn>(init),
            set_ops: std::mem::transmute::<*mut c_void, SetOpsFn>(set_ops),
            uninit_context: std::mem::transmute::<*mut c_void, UninitFn>(uninit),
            init_cq: std::mem::transmute::<*mut c_void, InitCqFn>(init_cq),
        })
    }
}

static PRIVATE: OnceLock<Result<Private, String>> = OnceLock::new();

/// The bound private ABI, resolved once.
///
/// # Errors
/// The message of the [`AbiError`] met on the first call.
pub fn private() -> Result<&'static Private, &'static str> {
    match PRIVATE.get_or_init(|| bind().map_err(|e| e.to_string())) {
        Ok(p) => Ok(p),
        Err(e) => Err(e.as_str()),
    }
}

/// Check the ABI without registering anything (used by the launcher).
///
/// # Errors
/// [`AbiError`] when libibverbs is absent or lacks the private ABI.
pub fn check_abi() -> Result<(), AbiError> {
    bind().map(|_| ())
}

/// Print a one-line diagnostic on stderr without allocating.
pub fn warn(msg: &str) {
    let line = format!("softverbs: {msg}\n");
    // SAFETY: writing a valid buffer of the given length to fd 2.
    unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
}

/// A C string pointer for static tables.
pub const fn cstr(s: &'static CStr) -> *const c_char {
    s.as_ptr()
}

#[cfg(test)]
mod tests {
    use super::AbiError;

    #[test]
    fn refusal_names_the_symbol_and_the_needed_abi() {
        let m = AbiError::Missing {
            symbol: "verbs_register_driver_34",
        }
        .to_string();
        assert!(
            m.contains("verbs_register_driver_34@IBVERBS_PRIVATE_34"),
            "{m}"
        );
        assert!(m.contains("rdma-core"), "{m}");
    }
}
