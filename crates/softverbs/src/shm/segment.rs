//! Named shared-memory segments (files in a tmpfs directory, mapped shared).
//! The directory and the way its files are made and opened are
//! [`fabric`]'s.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

use super::fabric;
pub use super::fabric::dir;

/// One mapped segment. The creator unlinks the name when the object it
/// holds is destroyed ([`unlink`](Self::unlink)), or at the latest on
/// drop; mappings held by peers (and by this process's progress thread)
/// stay valid until they drop theirs.
#[derive(Debug)]
pub struct Segment {
    base: *mut u8,
    len: usize,
    /// The file's full name (the fabric directory it was made or opened in).
    path: CString,
    owner: bool,
    /// The name was unlinked (once: a name unlinked may by then belong to
    /// a new object's segment).
    unlinked: AtomicBool,
}

// SAFETY: a Segment is a fixed mapping; all access to its bytes goes through
// atomics or the ring protocol in `ring`, never through `&mut` aliasing.
unsafe impl Send for Segment {}
// SAFETY: as above: shared access is by design (the memory is shared with
// other processes too) and goes through atomics.
unsafe impl Sync for Segment {}

fn map(fd: &OwnedFd, len: usize) -> io::Result<*mut u8> {
    // SAFETY: mapping `len` bytes of an open file shared; the result is
    // checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd.as_raw_fd(),
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(p.cast())
    }
}

/// The size of the open file `fd`.
fn file_len(fd: &OwnedFd) -> io::Result<libc::off_t> {
    // SAFETY: an all-zero `stat` is a valid out-parameter.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is open and `st` is writable.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.st_size)
}

/// Extend the open file `fd` to `len` bytes (zeros).
fn extend(fd: &OwnedFd, len: usize) -> io::Result<()> {
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: `fd` is an open file of ours; ftruncate takes any length.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn unlink_path(path: &CStr) {
    // SAFETY: a valid C string.
    unsafe { libc::unlink(path.as_ptr()) };
}

impl Segment {
    /// Create `name` with `len` zeroed bytes (fails with EEXIST if any
    /// file has the name) in the fabric directory, made first if need be
    /// (fabric steps 1 and 2).
    ///
    /// # Errors
    /// A [`fabric::FabricError`] for a refused directory, else the OS error
    /// of mkdir/open/ftruncate/mmap.
    pub fn create(name: &str, len: usize) -> io::Result<Arc<Self>> {
        Self::create_in(&fabric::ensure()?, name, len)
    }

    /// [`create`](Self::create) in the directory `dir`, already prepared.
    ///
    /// # Errors
    /// The OS error of open/ftruncate/mmap.
    pub(crate) fn create_in(dir: &Path, name: &str, len: usize) -> io::Result<Arc<Self>> {
        let path = fabric::file_path(dir, name)?;
        let fd = fabric::create_file(&path)?;
        match extend(&fd, len).and_then(|()| map(&fd, len)) {
            Ok(base) => {
                let seg = Arc::new(Self {
                    base,
                    len,
                    path,
                    owner: true,
                    unlinked: AtomicBool::new(false),
                });
                cache_insert(&seg);
                Ok(seg)
            }
            Err(e) => {
                unlink_path(&path);
                Err(e)
            }
        }
    }

    /// Map an existing segment of the fabric directory, sharing one mapping
    /// per process and name; never through a symbolic link (fabric step 2).
    ///
    /// # Errors
    /// A [`fabric::FabricError`] for a refused directory or a symbolic link,
    /// else the OS error of open/fstat/mmap (ENOENT when nobody created
    /// it, ENODATA when it is empty).
    pub fn open(name: &str) -> io::Result<Arc<Self>> {
        Self::open_in(&fabric::dir(), name)
    }

    /// [`open`](Self::open) in the directory `dir`.
    ///
    /// # Errors
    /// As [`open`](Self::open).
    pub(crate) fn open_in(dir: &Path, name: &str) -> io::Result<Arc<Self>> {
        let path = fabric::file_path(dir, name)?;
        if let Some(s) = cache_get(&path) {
            return Ok(s);
        }
        fabric::check(dir).map_err(fabric::refused)?;
        let fd = fabric::open_file(&path)?;
        let size = file_len(&fd)?;
        let len = match usize::try_from(size) {
            Ok(n) if n > 0 => n,
            _ => return Err(io::Error::from_raw_os_error(libc::ENODATA)),
        };
        let base = map(&fd, len)?;
        let seg = Arc::new(Self {
            base,
            len,
            path,
            owner: false,
            unlinked: AtomicBool::new(false),
        });
        cache_insert(&seg);
        Ok(seg)
    }

    /// Base address of the mapping.
    pub fn base(&self) -> *mut u8 {
        self.base
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the mapping is empty (never, for a live segment).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Segment {
    /// The creator's release of the name, when the object it holds is
    /// destroyed: from then on nobody can open it, while every mapping
    /// made before stays valid until dropped. Once only, and only by the
    /// creator; a no-op for a peer's mapping.
    pub fn unlink(&self) {
        if self.owner && !self.unlinked.swap(true, Ordering::AcqRel) {
            unlink_path(&self.path);
        }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: `base`/`len` are exactly the mapping made at construction,
        // and no reference into it outlives the last Arc (callers hold Arcs).
        unsafe { libc::munmap(self.base.cast(), self.len) };
        self.unlink();
    }
}

/// Mappings by full file name.
type Cache = Mutex<HashMap<CString, Weak<Segment>>>;

fn cache() -> &'static Cache {
    static C: OnceLock<Cache> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

fn cache_get(path: &CStr) -> Option<Arc<Segment>> {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    let s = c.get(path).and_then(Weak::upgrade);
    if s.is_none() {
        c.remove(path);
    }
    s
}

fn cache_insert(seg: &Arc<Segment>) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    c.retain(|_, w| w.strong_count() > 0);
    c.insert(seg.path.clone(), Arc::downgrade(seg));
}

/// The machine-wide id counters (segment `ids`).
#[derive(Debug)]
pub struct Ids {
    seg: Arc<Segment>,
}

/// Which counter of [`Ids`].
#[derive(Debug, Clone, Copy)]
#[repr(usize)]
pub enum IdKind {
    /// Queue-pair numbers.
    Qpn = 0,
    /// Completion queues.
    Cq = 1,
    /// Contexts.
    Ctx = 2,
    /// Shared receive queues.
    Srq = 3,
}

impl Ids {
    /// Open (creating on first use) the counters.
    ///
    /// # Errors
    /// The OS error of creating or mapping `ids`.
    pub fn get() -> io::Result<&'static Ids> {
        static IDS: OnceLock<Ids> = OnceLock::new();
        if let Some(i) = IDS.get() {
            return Ok(i);
        }
        let seg = open_shared("ids", 4096)?;
        Ok(IDS.get_or_init(|| Ids { seg }))
    }

    /// Next value of a counter (starting at 1).
    pub fn next(&self, kind: IdKind) -> u32 {
        // SAFETY: the segment is 4096 bytes; slot `kind * 64` is in range and
        // 4-byte aligned; it is only accessed atomically by every process.
        let a = unsafe { &*(self.seg.base().add(kind as usize * 64) as *const AtomicU32) };
        a.fetch_add(1, Ordering::Relaxed).wrapping_add(1)
    }

    /// A fresh QP number in 16..2^24 (QP0/QP1 and small numbers are skipped).
    pub fn next_qpn(&self) -> u32 {
        (self.next(IdKind::Qpn) % 0x00ff_fff0) + 16
    }
}

/// Open (creating on first use, zeroed) a machine-wide segment of `len`
/// bytes that no process owns and nobody unlinks (`ids`, `atomics`,
/// `mcast`): the first process to need it creates it exclusively, the
/// others open it (fabric step 3); zero is every such segment's initial
/// state.
///
/// # Errors
/// A [`fabric::FabricError`] for a refused directory or a symbolic link,
/// else the OS error of mkdir/open/ftruncate/mmap.
pub fn open_shared(name: &str, len: usize) -> io::Result<Arc<Segment>> {
    open_shared_in(&fabric::ensure()?, name, len)
}

fn open_shared_in(dir: &Path, name: &str, len: usize) -> io::Result<Arc<Segment>> {
    let path = fabric::file_path(dir, name)?;
    let (fd, _) = fabric::open_or_create(&path)?;
    // Every user of the name asks for the same length: whoever finds the
    // file shorter (its creator not yet past this line) extends it, and
    // concurrent extensions to one length are harmless; a fresh file reads
    // as zeros.
    if usize::try_from(file_len(&fd)?).map_or(true, |n| n < len) {
        extend(&fd, len)?;
    }
    let base = map(&fd, len)?;
    Ok(Arc::new(Segment {
        base,
        len,
        path,
        owner: false,
        unlinked: AtomicBool::new(false),
    }))
}

/// Remove segments whose owning process is gone (it exited or crashed
/// without destroying its objects). Every segment header starts with the
/// magic and the owner's pid; a pid of 0 means "being created" and is kept.
/// Peers that still map such a segment keep their mapping.
pub fn sweep_dead() {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let Ok(d) = fabric::checked() else {
        return;
    };
    let Ok(rd) = std::fs::read_dir(d) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name();
        let n = name.to_string_lossy();
        if !["ctx-", "cq-", "qp-", "srq-"]
            .iter()
            .any(|p| n.starts_with(p))
        {
            continue;
        }
        let mut head = [0u8; 8];
        let Ok(mut f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(e.path())
        else {
            continue;
        };
        if f.read_exact(&mut head).is_err() {
            continue;
        }
        let magic = u32::from_ne_bytes([head[0], head[1], head[2], head[3]]);
        let pid = u32::from_ne_bytes([head[4], head[5], head[6], head[7]]);
        if magic != super::layout::MAGIC || pid == 0 {
            continue;
        }
        // SAFETY: kill with signal 0 only checks for existence.
        let gone = unsafe { libc::kill(pid as libc::pid_t, 0) } != 0
            && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if gone {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Create `<prefix><id>` with ids drawn from `next`, skipping ids whose name
/// is taken (a leftover the sweep could not attribute, or a wrapped QPN).
///
/// # Errors
/// The OS error of the last attempt.
pub fn create_fresh(
    prefix: &str,
    mut next: impl FnMut() -> u32,
    len: usize,
) -> io::Result<(u32, Arc<Segment>)> {
    let mut last = io::Error::from_raw_os_error(libc::EEXIST);
    for _ in 0..64 {
        let id = next();
        match Segment::create(&format!("{prefix}{id}"), len) {
            Ok(s) => return Ok((id, s)),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shm::fabric::tests::Scratch;
    use crate::shm::fabric::FabricError;

    fn is_symlink_refusal(e: &io::Error) -> bool {
        matches!(
            e.get_ref().and_then(|i| i.downcast_ref::<FabricError>()),
            Some(FabricError::Symlink { .. })
        )
    }

    #[test]
    fn a_symlink_in_place_of_a_segment_is_refused() {
        let s = Scratch::new("seg-symlink");
        let target = s.0.join("target");
        std::fs::write(&target, [0u8; 4096]).expect("target");
        std::os::unix::fs::symlink(&target, s.0.join("cq-3")).expect("symlink");
        let e = Segment::open_in(&s.0, "cq-3").expect_err("a segment reached through a link");
        assert!(is_symlink_refusal(&e), "{e:?}");
        assert!(e.to_string().contains("cq-3 is a symbolic link"), "{e}");
        // A creator finds the name taken and never writes through the link.
        let e = Segment::create_in(&s.0, "cq-3", 4096).expect_err("create over a link");
        assert_eq!(e.raw_os_error(), Some(libc::EEXIST));
        std::os::unix::fs::symlink(&target, s.0.join("ids")).expect("symlink");
        let e = open_shared_in(&s.0, "ids", 4096).expect_err("a shared segment through a link");
        assert!(is_symlink_refusal(&e), "{e:?}");
        assert_eq!(
            std::fs::read(&target).expect("target"),
            vec![0u8; 4096],
            "the link's target is untouched"
        );
    }

    #[test]
    fn a_shared_segment_is_made_once_and_mapped_by_every_opener() {
        let s = Scratch::new("seg-shared");
        let a = open_shared_in(&s.0, "ids", 4096).expect("first");
        let b = open_shared_in(&s.0, "ids", 4096).expect("second");
        // SAFETY: both map the same 4096-byte file; the test is alone with it.
        unsafe {
            a.base().write(7);
            assert_eq!(b.base().read(), 7);
        }
        let m = std::fs::symlink_metadata(s.0.join("ids")).expect("made");
        assert!(m.file_type().is_file());
        assert_eq!(m.len(), 4096);
    }
}
