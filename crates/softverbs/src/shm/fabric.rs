//! The fabric directory, where every segment lives, and how its files are
//! made and opened.
//!
//! softverbs is a test device for one user's processes; it is not a
//! security boundary between users. What this module keeps is narrower:
//! the fabric of one user is not a place another user can plant files in
//! or redirect, and no file of it is reached through a symbolic link.
//!
//! 1. The directory is created with mode 0700. One that exists already is
//!    used only when `lstat` shows a directory (a symbolic link in its
//!    place is refused) owned by this process's effective uid and writable
//!    by neither group nor others ([`check`]).
//! 2. A file that one process creates and others open (a segment) is
//!    created with `O_CREAT | O_EXCL | O_NOFOLLOW` ([`create_file`]) and
//!    opened with `O_NOFOLLOW` ([`open_file`]).
//! 3. A file that every process may be the first to need (`ids`,
//!    `atomics`, `mcast`, `xrcd-<id>`) is created exclusively by the one
//!    that finds it missing, and opened with `O_NOFOLLOW` by the others
//!    ([`open_or_create`]).
//!
//! A symbolic link in place of a file is refused with
//! [`FabricError::Symlink`] and never followed.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// The variable that chooses the fabric directory.
pub const DIR_VAR: &str = "SOFTVERBS_DIR";

/// The fabric directory when [`DIR_VAR`] is not set.
pub const DEFAULT_DIR: &str = "/dev/shm/softverbs";

/// The per-machine directory holding every segment: `$SOFTVERBS_DIR`, or
/// `/dev/shm/softverbs`. Only its name: [`ensure`] makes and checks it.
pub fn dir() -> PathBuf {
    std::env::var_os(DIR_VAR)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_DIR))
}

/// Why the fabric directory or a file in it was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FabricError {
    /// The directory's name is a symbolic link.
    #[error(
        "fabric directory {} is a symbolic link (owner uid {uid}, mode {mode:04o}); softverbs \
         does not follow it: remove it, or choose another fabric directory with {DIR_VAR}",
        path.display()
    )]
    DirSymlink {
        /// The directory's name.
        path: PathBuf,
        /// The link's owner.
        uid: u32,
        /// The link's permission bits.
        mode: u32,
    },
    /// The directory's name is some other file than a directory.
    #[error(
        "fabric directory {} is not a directory (owner uid {uid}, mode {mode:04o}): remove it, \
         or choose another fabric directory with {DIR_VAR}",
        path.display()
    )]
    NotADirectory {
        /// The directory's name.
        path: PathBuf,
        /// The file's owner.
        uid: u32,
        /// The file's permission bits.
        mode: u32,
    },
    /// The directory belongs to another user.
    #[error(
        "fabric directory {} is owned by uid {uid}, not by this process's effective uid {euid} \
         (mode {mode:04o}); softverbs shares a fabric only between one user's processes: \
         remove it, or choose another fabric directory with {DIR_VAR}",
        path.display()
    )]
    ForeignOwner {
        /// The directory's name.
        path: PathBuf,
        /// The directory's owner.
        uid: u32,
        /// This process's effective uid.
        euid: u32,
        /// The directory's permission bits.
        mode: u32,
    },
    /// The directory is writable by group or others.
    #[error(
        "fabric directory {} (owner uid {uid}, mode {mode:04o}) is writable by group or \
         others; softverbs creates it with mode 0700: remove it, or choose another fabric \
         directory with {DIR_VAR}",
        path.display()
    )]
    Writable {
        /// The directory's name.
        path: PathBuf,
        /// The directory's owner.
        uid: u32,
        /// The directory's permission bits.
        mode: u32,
    },
    /// A symbolic link stands where a file of the fabric should be.
    #[error(
        "{} is a symbolic link, not a file of the fabric; softverbs does not follow links \
         there: remove it",
        path.display()
    )]
    Symlink {
        /// The file's name.
        path: PathBuf,
    },
    /// A system call on the directory failed.
    #[error("{what} fabric directory {}: {err}", path.display())]
    Os {
        /// What was being done.
        what: &'static str,
        /// The directory's name.
        path: PathBuf,
        /// The OS error.
        err: io::Error,
    },
}

impl FabricError {
    /// The errno a verb that met this refusal answers with.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Symlink { .. } => libc::ELOOP,
            Self::NotADirectory { .. } => libc::ENOTDIR,
            Self::Os { err, .. } => err.raw_os_error().unwrap_or(libc::EIO),
            Self::DirSymlink { .. } | Self::ForeignOwner { .. } | Self::Writable { .. } => {
                libc::EACCES
            }
        }
    }
}

impl From<FabricError> for io::Error {
    fn from(e: FabricError) -> Self {
        let kind = match &e {
            FabricError::Os { err, .. } => err.kind(),
            _ => io::ErrorKind::PermissionDenied,
        };
        io::Error::new(kind, e)
    }
}

/// The errno for `e`: its OS error, a [`FabricError`]'s, else `default`.
pub fn errno(e: &io::Error, default: i32) -> i32 {
    e.raw_os_error()
        .or_else(|| {
            e.get_ref()
                .and_then(|inner| inner.downcast_ref::<FabricError>())
                .map(FabricError::errno)
        })
        .unwrap_or(default)
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Step 1 for a directory that exists: refuse `path` unless `lstat` shows
/// a directory owned by the effective uid and writable by neither group
/// nor others.
///
/// # Errors
/// [`FabricError::DirSymlink`], [`FabricError::NotADirectory`],
/// [`FabricError::ForeignOwner`], [`FabricError::Writable`], or
/// [`FabricError::Os`] when `lstat` fails (ENOENT: it does not exist).
pub fn check(path: &Path) -> Result<(), FabricError> {
    let m = std::fs::symlink_metadata(path).map_err(|err| FabricError::Os {
        what: "examining the",
        path: path.to_owned(),
        err,
    })?;
    let (uid, mode) = (m.uid(), m.mode() & 0o7777);
    let path = path.to_owned();
    if m.file_type().is_symlink() {
        return Err(FabricError::DirSymlink { path, uid, mode });
    }
    if !m.is_dir() {
        return Err(FabricError::NotADirectory { path, uid, mode });
    }
    let euid = euid();
    if uid != euid {
        return Err(FabricError::ForeignOwner {
            path,
            uid,
            euid,
            mode,
        });
    }
    if mode & 0o022 != 0 {
        return Err(FabricError::Writable { path, uid, mode });
    }
    Ok(())
}

/// Step 1: create `path` with mode 0700 (its missing parents as usual)
/// unless it exists, then [`check`] it.
///
/// # Errors
/// What [`check`] refuses, or [`FabricError::Os`] when the directory cannot
/// be made.
pub fn prepare(path: &Path) -> Result<(), FabricError> {
    let os = |what| {
        move |err| FabricError::Os {
            what,
            path: path.to_owned(),
            err,
        }
    };
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).map_err(os("creating the parent of the"))?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(os("creating the")(e)),
    }
    check(path)
}

/// Prepare the fabric directory ([`dir`], step 1) for this process's use
/// and return it. The first refusal in a process is also printed on
/// stderr, since a verb that meets it can only answer with an errno.
///
/// # Errors
/// What [`prepare`] refuses, as an `io::Error` holding the
/// [`FabricError`] ([`errno`] gives its errno).
pub fn ensure() -> io::Result<PathBuf> {
    let d = dir();
    prepare(&d).map_err(refused)?;
    Ok(d)
}

/// [`dir`] after [`check`], for a process that opens what exists
/// (creating nothing).
///
/// # Errors
/// As [`ensure`].
pub fn checked() -> io::Result<PathBuf> {
    let d = dir();
    check(&d).map_err(refused)?;
    Ok(d)
}

/// The refusal `e` as an `io::Error`, printed on stderr the first time in
/// this process. A directory that does not exist is not a refusal: its
/// OS error (ENOENT) is returned as it is, and not printed.
pub fn refused(e: FabricError) -> io::Error {
    static WARNED: AtomicBool = AtomicBool::new(false);
    match e {
        FabricError::Os { err, .. } if err.kind() == io::ErrorKind::NotFound => err,
        e => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                crate::sys::private::warn(&e.to_string());
            }
            e.into()
        }
    }
}

/// The C path of the file `name` in the directory `dir`.
///
/// # Errors
/// EINVAL when the path holds a NUL byte.
pub fn file_path(dir: &Path, name: &str) -> io::Result<CString> {
    CString::new(dir.join(name).into_os_string().into_vec())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// `open(2)` of `path` with `flags | O_NOFOLLOW | O_CLOEXEC` and `mode`.
fn sys_open(path: &CStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    // SAFETY: `path` is a valid C string for the call; the result is checked.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            flags | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            libc::c_uint::from(mode),
        )
    };
    if fd >= 0 {
        // SAFETY: a descriptor just returned to us, owned by nobody else.
        return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ELOOP) {
        return Err(refused_link(path));
    }
    Err(err)
}

/// [`FabricError::Symlink`] for `path`, as [`refused`] gives it.
fn refused_link(path: &CStr) -> io::Error {
    refused(FabricError::Symlink {
        path: PathBuf::from(std::ffi::OsStr::from_bytes(path.to_bytes())),
    })
}

/// Step 2: create `path` read-write with mode 0600, failing with EEXIST
/// when any file (a symbolic link too) has the name.
///
/// # Errors
/// The OS error of `open`.
pub fn create_file(path: &CStr) -> io::Result<OwnedFd> {
    sys_open(path, libc::O_RDWR | libc::O_CREAT | libc::O_EXCL, 0o600)
}

/// Step 2: open the existing `path` read-write, never through a symbolic
/// link.
///
/// # Errors
/// [`FabricError::Symlink`] for a symbolic link, else the OS error of
/// `open` (ENOENT when it does not exist).
pub fn open_file(path: &CStr) -> io::Result<OwnedFd> {
    sys_open(path, libc::O_RDWR, 0)
}

/// Step 3: open `path` read-write, creating it (empty, mode 0600) when it
/// does not exist; `true` with the descriptor when this call created it.
///
/// # Errors
/// [`FabricError::Symlink`] for a symbolic link, else the OS error of
/// `open`.
pub fn open_or_create(path: &CStr) -> io::Result<(OwnedFd, bool)> {
    // A file is never removed between the two opens except by hand; the
    // bound only keeps such a remover from making this spin.
    let mut last = io::Error::from_raw_os_error(libc::ENOENT);
    for _ in 0..8 {
        match create_file(path) {
            Ok(fd) => return Ok((fd, true)),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {}
            Err(e) => return Err(e),
        }
        match open_file(path) {
            Ok(fd) => return Ok((fd, false)),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    /// A fresh directory under /dev/shm (or the temp dir) for one test,
    /// removed on drop.
    pub(crate) struct Scratch(pub PathBuf);

    impl Scratch {
        pub(crate) fn new(test: &str) -> Scratch {
            let base = if Path::new("/dev/shm").is_dir() {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let p = base.join(format!("softverbs-unit-{test}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).expect("scratch directory");
            Scratch(p)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn a_new_directory_is_made_0700_and_accepted_again() {
        let s = Scratch::new("fresh");
        let d = s.0.join("fabric");
        prepare(&d).expect("a fresh fabric directory");
        let m = std::fs::symlink_metadata(&d).expect("made");
        assert!(m.is_dir());
        assert_eq!(m.mode() & 0o7777, 0o700);
        prepare(&d).expect("the same directory, a second time");
    }

    #[test]
    fn a_0777_directory_is_refused() {
        let s = Scratch::new("0777");
        let d = s.0.join("fabric");
        std::fs::create_dir(&d).expect("mkdir");
        std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = prepare(&d).expect_err("a 0777 fabric directory must be refused");
        assert!(
            matches!(e, FabricError::Writable { mode: 0o777, .. }),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(m.contains(&d.display().to_string()), "{m}");
        assert!(m.contains("mode 0777"), "{m}");
        assert!(m.contains(&format!("owner uid {}", euid())), "{m}");
        assert!(m.contains("SOFTVERBS_DIR"), "{m}");
        assert_eq!(e.errno(), libc::EACCES);
    }

    #[test]
    fn a_directory_of_another_user_is_refused() {
        const NOBODY: u32 = 65534;
        let s = Scratch::new("foreign");
        let d = s.0.join("fabric");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&d)
            .expect("mkdir");
        if euid() == NOBODY {
            let line = "SKIPPED: a_directory_of_another_user_is_refused (runs as uid 65534, \
                        the other user this test needs)\n";
            // SAFETY: writing a valid buffer of its length to fd 2.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
            return;
        }
        if let Err(e) = std::os::unix::fs::chown(&d, Some(NOBODY), Some(NOBODY)) {
            // Straight to fd 2: libtest captures the output of passing
            // tests, and a skip must be seen.
            let line = format!(
                "SKIPPED: a_directory_of_another_user_is_refused (chown to uid {NOBODY} not \
                 permitted: {e})\n"
            );
            // SAFETY: writing a valid buffer of its length to fd 2.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
            return;
        }
        let e = prepare(&d).expect_err("a directory owned by uid 65534 must be refused");
        assert!(
            matches!(
                e,
                FabricError::ForeignOwner {
                    uid: NOBODY,
                    mode: 0o700,
                    ..
                }
            ),
            "{e:?}"
        );
        let m = e.to_string();
        assert!(m.contains(&d.display().to_string()), "{m}");
        assert!(m.contains("owned by uid 65534"), "{m}");
        assert!(m.contains("mode 0700"), "{m}");
        assert!(m.contains("remove it"), "{m}");
    }

    #[test]
    fn a_symlink_or_a_file_in_place_of_the_directory_is_refused() {
        let s = Scratch::new("notdir");
        let real = s.0.join("real");
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&real)
            .expect("mkdir");
        let link = s.0.join("fabric");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        let e = prepare(&link).expect_err("a symbolic link must be refused");
        assert!(matches!(e, FabricError::DirSymlink { .. }), "{e:?}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let file = s.0.join("file");
        std::fs::write(&file, b"").expect("file");
        let e = prepare(&file).expect_err("a plain file must be refused");
        assert!(matches!(e, FabricError::NotADirectory { .. }), "{e:?}");
    }

    #[test]
    fn a_symlink_in_place_of_a_file_is_refused_and_not_followed() {
        let s = Scratch::new("filelink");
        let target = s.0.join("target");
        std::fs::write(&target, b"").expect("target");
        std::os::unix::fs::symlink(&target, s.0.join("ids")).expect("symlink");
        let p = file_path(&s.0, "ids").expect("path");
        let e = open_file(&p).expect_err("open through a symbolic link");
        assert_eq!(errno(&e, 0), libc::ELOOP);
        let inner = e.get_ref().and_then(|i| i.downcast_ref::<FabricError>());
        assert!(matches!(inner, Some(FabricError::Symlink { .. })), "{e:?}");
        assert!(e.to_string().contains("is a symbolic link"), "{e}");
        let e = open_or_create(&p).expect_err("open-or-create through a symbolic link");
        assert_eq!(errno(&e, 0), libc::ELOOP);
        assert_eq!(
            create_file(&p).map(drop).map_err(|e| e.raw_os_error()),
            Err(Some(libc::EEXIST))
        );
        assert_eq!(std::fs::metadata(&target).expect("target").len(), 0);
    }

    #[test]
    fn open_or_create_creates_once_then_opens() {
        let s = Scratch::new("shared");
        let p = file_path(&s.0, "atomics").expect("path");
        let (_a, created) = open_or_create(&p).expect("first");
        assert!(created);
        let (_b, created) = open_or_create(&p).expect("second");
        assert!(!created);
        let m = std::fs::symlink_metadata(s.0.join("atomics")).expect("made");
        assert_eq!(m.mode() & 0o777, 0o600);
    }
}
