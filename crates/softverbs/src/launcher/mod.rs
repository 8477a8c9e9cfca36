//! What `softverbs-run` does, step by step:
//!
//! 1. refuse clearly when not root, when libibverbs is missing, when it
//!    does not export the private ABI this provider needs, or when the
//!    fabric directory is not this user's alone (`shm::fabric`: made with
//!    mode 0700 when missing);
//! 2. enter a private mount namespace (mount propagation private);
//! 3. mount a tmpfs on [`STAGE`] (the same path in every namespace, so
//!    nothing is left behind on the host) and write there the fake sysfs tree
//!    and two copies of the provider named `libsoftverbs-rdmav34.so`, `lib/`
//!    (preloaded) and `lib/driver/` (named by `RDMAV_DRIVERS`);
//! 4. overlay `/dev` (upper layer in the tmpfs) and add
//!    `/dev/infiniband/uverbs0 -> /dev/full`, moving `/dev/shm`, `/dev/pts`
//!    and `/dev/mqueue` back in; the host's `/dev` is untouched;
//! 5. set `SYSFS_PATH`, `RDMAV_DRIVERS`, `LD_PRELOAD` and `SOFTVERBS_RUN=1`
//!    and exec the command.

pub mod ns;
pub mod sysfs;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// What `softverbs-run --help` prints.
pub const HELP: &str = "\
usage: softverbs-run COMMAND [ARGS...]

Runs COMMAND on softverbs, a userspace libibverbs device (and rdma_cm),
in a private mount namespace; needs root.

softverbs is a test device for one user's processes; it is not a security
boundary between users.

Environment:
  SOFTVERBS_DIR  the fabric directory every program run this way shares
                 (default /dev/shm/softverbs); made with mode 0700, and
                 refused when it is not a directory, belongs to another
                 user, or is writable by group or others
  SOFTVERBS_LIB  the provider library (default: libsoftverbs-rdmav34.so
                 or libsoftverbs.so next to softverbs-run)
";

/// Where the launcher stages its files (a tmpfs private to the namespace).
pub const STAGE: &str = "/tmp/softverbs-run";

/// Why the launcher could not run a program.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// No command given.
    #[error("usage: softverbs-run COMMAND [ARGS...] (softverbs-run --help says more)")]
    Usage,
    /// Not root.
    #[error(
        "softverbs-run needs root (CAP_SYS_ADMIN) to make a private mount namespace and \
         overlay /dev; effective uid is {0}"
    )]
    NotPrivileged(u32),
    /// libibverbs is not installed.
    #[error("libibverbs.so.1 cannot be loaded ({0}); install libibverbs1 (Debian: apt-get install ibverbs-utils)")]
    NoLibibverbs(String),
    /// Wrong private ABI.
    #[error("{0}")]
    Abi(#[from] crate::sys::private::AbiError),
    /// The provider library was not found.
    #[error("provider library not found (looked for {0}); build it with cargo build -p softverbs or set SOFTVERBS_LIB")]
    NoProvider(String),
    /// The fabric directory was refused.
    #[error("{0}")]
    Fabric(#[from] crate::shm::fabric::FabricError),
    /// A system call failed.
    #[error("{what}: {err}")]
    Os {
        /// What was being done.
        what: String,
        /// The OS error.
        err: std::io::Error,
    },
}

/// Attach context to an io error.
pub fn os(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> LaunchError {
    let what = what.into();
    move |err| LaunchError::Os { what, err }
}

/// Find the provider `.so`: `$SOFTVERBS_LIB`, else next to the launcher
/// (`libsoftverbs-rdmav34.so` or cargo's `libsoftverbs.so`).
///
/// # Errors
/// [`LaunchError::NoProvider`].
pub fn find_provider() -> Result<PathBuf, LaunchError> {
    if let Some(p) = std::env::var_os("SOFTVERBS_LIB") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(LaunchError::NoProvider(p.display().to_string()))
        };
    }
    let exe = std::env::current_exe().map_err(os("locating softverbs-run"))?;
    let dir = exe.parent().unwrap_or(Path::new("."));
    let cands = [
        dir.join("libsoftverbs-rdmav34.so"),
        dir.join("libsoftverbs.so"),
    ];
    cands.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        LaunchError::NoProvider(format!("{} or {}", cands[0].display(), cands[1].display()))
    })
}

/// Step 1: privilege and libibverbs checks (the fabric directory's follow
/// in [`launch`]).
///
/// # Errors
/// [`LaunchError::NotPrivileged`], [`LaunchError::NoLibibverbs`], [`LaunchError::Abi`].
pub fn preflight() -> Result<(), LaunchError> {
    // SAFETY: geteuid has no preconditions.
    let uid = unsafe { libc::geteuid() };
    if uid != 0 {
        return Err(LaunchError::NotPrivileged(uid));
    }
    // SAFETY: valid C string; the handle is kept (the process execs soon).
    let h = unsafe {
        libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_GLOBAL,
        )
    };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let e = unsafe { libc::dlerror() };
        let msg = if e.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: non-null dlerror result is a valid C string.
            unsafe { std::ffi::CStr::from_ptr(e) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(LaunchError::NoLibibverbs(msg));
    }
    crate::sys::private::check_abi()?;
    Ok(())
}

/// Run the whole launch; only returns on failure (success is `exec`).
///
/// # Errors
/// Any [`LaunchError`].
pub fn launch(args: Vec<OsString>) -> Result<std::convert::Infallible, LaunchError> {
    if args.is_empty() {
        return Err(LaunchError::Usage);
    }
    preflight()?;
    crate::shm::fabric::prepare(&crate::shm::fabric::dir())?;
    let provider = find_provider()?;
    ns::enter_private_namespace()?;
    let stage = Path::new(STAGE);
    ns::mount_stage(stage)?;
    sysfs::build(&stage.join("sys"))?;
    let lib_dir = stage.join("lib");
    std::fs::create_dir_all(&lib_dir).map_err(os("creating the staging lib dir"))?;
    let lib = lib_dir.join("libsoftverbs-rdmav34.so");
    std::fs::copy(&provider, &lib).map_err(os(format!("copying {}", provider.display())))?;
    // The copy libibverbs loads from RDMAV_DRIVERS: a file of its own (not a
    // link: the loader would find the preloaded object by inode and run no
    // constructor), whose constructor registers the preloaded copy whenever
    // libibverbs loads its providers — also in programs that `dlopen`
    // libibverbs after start, when the preloaded copy's constructor found
    // no libibverbs to register with.
    let driver_dir = lib_dir.join("driver");
    std::fs::create_dir_all(&driver_dir).map_err(os("creating the staging driver dir"))?;
    let driver = driver_dir.join("libsoftverbs-rdmav34.so");
    std::fs::copy(&provider, &driver).map_err(os(format!("copying {}", provider.display())))?;
    ns::overlay_dev(stage)?;
    ns::shadow_sys_class(stage, crate::provider::DEVICE_NAME)?;
    let mut preload = OsString::from(lib.as_os_str());
    if let Some(old) = std::env::var_os("LD_PRELOAD").filter(|v| !v.is_empty()) {
        preload.push(" ");
        preload.push(old);
    }
    let env = [
        ("SYSFS_PATH", OsString::from(stage.join("sys").as_os_str())),
        (
            "RDMAV_DRIVERS",
            OsString::from(driver_dir.join("libsoftverbs").as_os_str()),
        ),
        ("LD_PRELOAD", preload),
        ("SOFTVERBS_RUN", OsString::from("1")),
    ];
    ns::exec(&args, &env)
}
