//! Named shared-memory segments (files in a tmpfs directory, mapped shared).

use std::collections::HashMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// The per-machine directory holding every segment: `$SOFTVERBS_DIR`, or
/// `/dev/shm/softverbs`.
pub fn dir() -> PathBuf {
    std::env::var_os("SOFTVERBS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/dev/shm/softverbs"))
}

/// One mapped segment. The creator unlinks the name when the object it
/// holds is destroyed ([`unlink`](Self::unlink)), or at the latest on
/// drop; mappings held by peers (and by this process's progress thread)
/// stay valid until they drop theirs.
#[derive(Debug)]
pub struct Segment {
    base: *mut u8,
    len: usize,
    name: String,
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

fn cpath(name: &str) -> io::Result<CString> {
    let mut p = dir();
    p.push(name);
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn map(fd: libc::c_int, len: usize) -> io::Result<*mut u8> {
    // SAFETY: mapping `len` bytes of an open file shared; the result is
    // checked against MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        Err(io::Error::last_os_error())
    } else {
        Ok(p.cast())
    }
}

impl Segment {
    /// Create `name` with `len` zeroed bytes (fails if it exists).
    ///
    /// # Errors
    /// The OS error of mkdir/open/ftruncate/mmap.
    pub fn create(name: &str, len: usize) -> io::Result<Arc<Self>> {
        std::fs::create_dir_all(dir())?;
        let path = cpath(name)?;
        // SAFETY: valid C string; the fd is checked and closed below.
        let fd = unsafe {
            libc::open(
                path.as_ptr(),
                libc::O_RDWR | libc::O_CREAT | libc::O_EXCL | libc::O_CLOEXEC,
                0o600,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is the file just created.
        let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        let res = if r != 0 {
            Err(io::Error::last_os_error())
        } else {
            map(fd, len)
        };
        // SAFETY: `fd` is ours; the mapping (if any) does not need it.
        unsafe { libc::close(fd) };
        match res {
            Ok(base) => {
                let seg = Arc::new(Self {
                    base,
                    len,
                    name: name.to_owned(),
                    owner: true,
                    unlinked: AtomicBool::new(false),
                });
                cache_insert(&seg);
                Ok(seg)
            }
            Err(e) => {
                // SAFETY: valid C string of the file we created.
                unsafe { libc::unlink(path.as_ptr()) };
                Err(e)
            }
        }
    }

    /// Map an existing segment, sharing one mapping per process and name.
    ///
    /// # Errors
    /// The OS error of open/fstat/mmap (ENOENT when nobody created it).
    pub fn open(name: &str) -> io::Result<Arc<Self>> {
        if let Some(s) = cache_get(name) {
            return Ok(s);
        }
        let path = cpath(name)?;
        // SAFETY: valid C string; fd checked and closed below.
        let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: an all-zero `stat` is a valid out-parameter.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is open and `st` is writable.
        let res = if unsafe { libc::fstat(fd, &mut st) } != 0 {
            Err(io::Error::last_os_error())
        } else if st.st_size <= 0 {
            Err(io::Error::from_raw_os_error(libc::ENODATA))
        } else {
            map(fd, st.st_size as usize).map(|b| (b, st.st_size as usize))
        };
        // SAFETY: `fd` is ours.
        unsafe { libc::close(fd) };
        let (base, len) = res?;
        let seg = Arc::new(Self {
            base,
            len,
            name: name.to_owned(),
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
            if let Ok(p) = cpath(&self.name) {
                // SAFETY: valid C string.
                unsafe { libc::unlink(p.as_ptr()) };
            }
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

type Cache = Mutex<HashMap<String, Weak<Segment>>>;

fn cache() -> &'static Cache {
    static C: OnceLock<Cache> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
}

fn cache_get(name: &str) -> Option<Arc<Segment>> {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    let s = c.get(name).and_then(Weak::upgrade);
    if s.is_none() {
        c.remove(name);
    }
    s
}

fn cache_insert(seg: &Arc<Segment>) {
    let mut c = cache().lock().unwrap_or_else(|e| e.into_inner());
    c.retain(|_, w| w.strong_count() > 0);
    c.insert(seg.name.clone(), Arc::downgrade(seg));
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
/// bytes that no process owns and nobody unlinks (`ids`, `atomics`): racing
/// creators share the file, and zero is every such segment's initial state.
///
/// # Errors
/// The OS error of mkdir/open/ftruncate/mmap.
pub fn open_shared(name: &str, len: usize) -> io::Result<Arc<Segment>> {
    std::fs::create_dir_all(dir())?;
    let path = cpath(name)?;
    // SAFETY: valid C string; O_CREAT without O_EXCL so racing creators
    // share the file; fd closed below.
    let fd = unsafe {
        libc::open(
            path.as_ptr(),
            libc::O_RDWR | libc::O_CREAT | libc::O_CLOEXEC,
            0o600,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: extending to `len` bytes; concurrent ftruncates to the same
    // size are harmless, and a fresh file reads as zeros.
    let r = unsafe { libc::ftruncate(fd, len as libc::off_t) };
    let res = if r != 0 {
        Err(io::Error::last_os_error())
    } else {
        map(fd, len)
    };
    // SAFETY: `fd` is ours.
    unsafe { libc::close(fd) };
    let base = res?;
    Ok(Arc::new(Segment {
        base,
        len,
        name: name.into(),
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
    let Ok(rd) = std::fs::read_dir(dir()) else {
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
        let Ok(mut f) = std::fs::File::open(e.path()) else {
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
