//! Extended reliable connections: XRC domains (`ibv_open_xrcd`), XRC SRQs
//! (`ibv_create_srq_ex`, `ibv_get_srq_num`); the XRC QPs themselves are
//! made by `create_qp`/`create_qp_ex` (provider::qp) and served by the RC
//! data path (provider::send, `Remote::open_xrc`).
//!
//! An XRC domain is an id: private (`fd` -1) or the same for every
//! context, in any process, that opens it with the same file (its device
//! and inode name it; a locked registry entry in the fabric marks it
//! held). An XRC SRQ belongs to a domain and has its own CQ; an XRC_RECV
//! QP belongs to a domain and has no queues: an XRC_SEND requester names
//! the SRQ (`remote_srqn`) each request goes to, which must belong to the
//! target QP's domain.

use std::ffi::c_int;
use std::os::fd::{AsRawFd, OwnedFd};

use super::context::inner;
use super::qp::fail;
use super::srq::{make_srq, SvSrq};
use crate::shm::fabric;
use crate::shm::segment::IdKind;
use crate::shm::Ids;
use crate::sys::ibv;

/// `struct verbs_xrcd` with the domain's id.
#[repr(C)]
pub struct SvXrcd {
    /// `verbs_xrcd.xrcd`.
    pub xrcd: ibv::ibv_xrcd,
    /// `verbs_xrcd.comp_mask`.
    pub comp_mask: u32,
    /// `verbs_xrcd.handle`.
    pub handle: u32,
    /// The domain's id (SRQ and QP headers carry it).
    pub id: u32,
    /// A file-named domain's entry in the fabric's registry: the
    /// descriptor whose shared lock holds the domain (closed with it).
    entry: Option<OwnedFd>,
}

/// The registry entry of the file-named domain `id`: the file
/// `xrcd-<id>` in the fabric's directory. Every context holding the domain,
/// in any process, holds a shared open-file-description lock on it through
/// a descriptor of its own; the domain exists while one such lock is held,
/// which is what `O_CREAT`/`O_EXCL` and their absence ask about. The kernel
/// releases a lock when its last descriptor closes, also when a process
/// dies or exits without closing the domain, so a holder that is gone
/// never keeps a domain alive (the kernel's domain holds the file's inode,
/// so no later file can meet a stale domain there; here a later file can
/// reuse the inode of a removed one and so its id, and a count left behind
/// by a dead holder would then answer `O_EXCL` with EEXIST). The file
/// itself stays; an unlocked file is a domain nobody holds.
fn entry_name(id: u32) -> String {
    format!("xrcd-{id:08x}")
}

/// Set an open-file-description lock of `kind` on all of `fd`; `wait`
/// blocks until it is granted. The errno on failure (EAGAIN: held).
fn ofd_lock(fd: c_int, kind: c_int, wait: bool) -> Result<(), i32> {
    // SAFETY: an all-zero flock is valid; the fields below make it a lock
    // of the whole file with l_pid 0, as open-file-description locks need.
    let mut fl: libc::flock = unsafe { std::mem::zeroed() };
    fl.l_type = kind as libc::c_short;
    fl.l_whence = libc::SEEK_SET as libc::c_short;
    let cmd = if wait {
        libc::F_OFD_SETLKW
    } else {
        libc::F_OFD_SETLK
    };
    loop {
        // SAFETY: `fd` is an open descriptor and `fl` a valid flock.
        if unsafe { libc::fcntl(fd, cmd, &fl) } == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO);
        if e != libc::EINTR {
            return Err(e);
        }
    }
}

/// Enter the registry entry of `id` as `oflags` ask: a descriptor holding
/// a shared lock on it, or an errno when `O_EXCL` finds the domain held or
/// no `O_CREAT` finds it unheld (ENOENT).
///
/// Whoever takes the exclusive lock is alone, so the domain is not held:
/// it creates it (or, without `O_CREAT`, finds nothing) and turns the lock
/// into a shared one in place, which never lets another exclusive lock in
/// between. An opener that finds the exclusive lock refused sees a holder,
/// and waits for its shared lock (a creator holds the exclusive one only
/// for these few lines).
fn enter_registry(id: u32, oflags: i32) -> Result<OwnedFd, i32> {
    let err = |e: std::io::Error| fabric::errno(&e, libc::EIO);
    let dir = fabric::ensure().map_err(err)?;
    // Created exclusively by the first context to name the domain, opened
    // (never through a symbolic link) by the others: fabric step 3.
    let path = fabric::file_path(&dir, &entry_name(id)).map_err(err)?;
    let (fd, _) = fabric::open_or_create(&path).map_err(err)?;
    let raw = fd.as_raw_fd();
    match ofd_lock(raw, libc::F_WRLCK as c_int, false) {
        Ok(()) => {
            if oflags & libc::O_CREAT == 0 {
                return Err(libc::ENOENT);
            }
            ofd_lock(raw, libc::F_RDLCK as c_int, false)?;
        }
        Err(e) if e == libc::EAGAIN || e == libc::EACCES => {
            if oflags & libc::O_CREAT != 0 && oflags & libc::O_EXCL != 0 {
                return Err(libc::EEXIST);
            }
            ofd_lock(raw, libc::F_RDLCK as c_int, true)?;
        }
        Err(e) => return Err(e),
    }
    Ok(fd)
}

impl std::fmt::Debug for SvXrcd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SvXrcd").field("id", &self.id).finish()
    }
}

/// `enum ibv_xrcd_init_attr_mask`.
const XRCD_FD: u32 = 1;
const XRCD_OFLAGS: u32 = 1 << 1;

/// The id of the domain a file names: its device and inode, hashed
/// (FNV-1a) into 31 bits with the top bit set, so that it never equals a
/// private domain's.
pub fn file_domain_id(dev: u64, ino: u64) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in dev.to_le_bytes().iter().chain(ino.to_le_bytes().iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    0x8000_0000 | ((h ^ (h >> 32)) as u32 & 0x7fff_ffff)
}

/// `open_xrcd` (`ibv_open_xrcd(3)`): both attributes are required; `oflags`
/// may hold `O_CREAT` and `O_EXCL` only, and `fd` -1 (a private domain)
/// needs `O_CREAT` (EINVAL otherwise); a bad `fd` is EBADF. For a file,
/// `O_CREAT` creates the domain when no context holds one for it,
/// `O_CREAT | O_EXCL` fails with EEXIST when one does, and without
/// `O_CREAT` opening a domain nobody holds is ENOENT.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid.
pub unsafe extern "C" fn open_xrcd(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_xrcd_init_attr,
) -> *mut ibv::ibv_xrcd {
    // SAFETY: caller contract.
    if unsafe { inner(ctx) }.dead() {
        return super::dead();
    }
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: caller contract.
    let a = unsafe { &*attr };
    if a.comp_mask & !(XRCD_FD | XRCD_OFLAGS) != 0
        || a.comp_mask & (XRCD_FD | XRCD_OFLAGS) != (XRCD_FD | XRCD_OFLAGS)
        || a.oflags & !(libc::O_CREAT | libc::O_EXCL) != 0
    {
        return fail(libc::EINVAL);
    }
    let (id, entry) = if a.fd == -1 {
        if a.oflags & libc::O_CREAT == 0 {
            return fail(libc::EINVAL);
        }
        let Ok(ids) = Ids::get() else {
            return fail(libc::EIO);
        };
        ((ids.next(IdKind::Srq) & 0x7fff_ffff).max(1), None)
    } else {
        // SAFETY: an all-zero stat is valid; fstat fills it or fails.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `st` is writable; a bad fd is an error return.
        if unsafe { libc::fstat(a.fd, &mut st) } != 0 {
            return fail(libc::EBADF);
        }
        let id = file_domain_id(st.st_dev, st.st_ino);
        match enter_registry(id, a.oflags) {
            Ok(fd) => (id, Some(fd)),
            Err(e) => return fail(e),
        }
    };
    let x = Box::new(SvXrcd {
        xrcd: ibv::ibv_xrcd { context: ctx },
        comp_mask: 0,
        handle: id,
        id,
        entry,
    });
    Box::into_raw(x).cast()
}

/// `close_xrcd`.
///
/// # Safety
/// `x` was made by [`open_xrcd`]; not used afterwards.
pub unsafe extern "C" fn close_xrcd(x: *mut ibv::ibv_xrcd) -> c_int {
    // SAFETY: caller contract: the box of open_xrcd, last use. Dropping it
    // closes the entry's descriptor, which releases this context's lock.
    drop(unsafe { Box::from_raw(x.cast::<SvXrcd>()) });
    0
}

/// The domain id of an XRCD of this provider.
///
/// # Safety
/// `x` was made by [`open_xrcd`] and is live.
pub unsafe fn xrcd_id(x: *mut ibv::ibv_xrcd) -> u32 {
    // SAFETY: caller contract.
    unsafe { (*x.cast::<SvXrcd>()).id }
}

/// `enum ibv_srq_init_attr_mask`.
mod srq_mask {
    pub const TYPE: u32 = 1;
    pub const PD: u32 = 1 << 1;
    pub const XRCD: u32 = 1 << 2;
    pub const CQ: u32 = 1 << 3;
}

/// `enum ibv_srq_type`.
const SRQT_BASIC: u32 = 0;
const SRQT_XRC: u32 = 1;

/// `create_srq_ex`: a basic SRQ (PD) or an XRC SRQ (PD, XRC domain and
/// CQ, all required: EINVAL); tag-matching SRQs and unknown attributes
/// are EOPNOTSUPP.
///
/// # Safety
/// `ctx` is a live softverbs context; `attr` is valid, its objects ours.
pub unsafe extern "C" fn create_srq_ex(
    ctx: *mut ibv::ibv_context,
    attr: *mut ibv::ibv_srq_init_attr_ex,
) -> *mut ibv::ibv_srq {
    if attr.is_null() {
        return fail(libc::EINVAL);
    }
    // SAFETY: caller contract.
    let a = unsafe { &mut *attr };
    let known = srq_mask::TYPE | srq_mask::PD | srq_mask::XRCD | srq_mask::CQ;
    let ty = if a.comp_mask & srq_mask::TYPE != 0 {
        a.srq_type
    } else {
        SRQT_BASIC
    };
    if a.comp_mask & !known != 0 || (ty != SRQT_BASIC && ty != SRQT_XRC) {
        return fail(libc::EOPNOTSUPP);
    }
    // SAFETY: a non-null PD the caller passes is a live PD.
    if a.comp_mask & srq_mask::PD == 0 || a.pd.is_null() || unsafe { (*a.pd).context } != ctx {
        return fail(libc::EINVAL);
    }
    let (xrcd, cq) = if ty == SRQT_XRC {
        let ok = a.comp_mask & (srq_mask::XRCD | srq_mask::CQ) == srq_mask::XRCD | srq_mask::CQ
            && !a.xrcd.is_null()
            && !a.cq.is_null()
            // SAFETY: non-null objects the caller passes are live.
            && unsafe { (*a.xrcd).context == ctx && (*a.cq).context == ctx };
        if !ok {
            return fail(libc::EINVAL);
        }
        // SAFETY: an XRCD of this context.
        (unsafe { xrcd_id(a.xrcd) }, a.cq)
    } else {
        (0, std::ptr::null_mut())
    };
    // SAFETY: the PD and CQ are ours (checked against the context).
    let s = unsafe { make_srq(a.pd, &mut a.attr, xrcd, cq) };
    if s.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the fresh SRQ; libibverbs fills nothing on this path.
    unsafe {
        let v = &mut (*s).vsrq;
        v.srq.context = ctx;
        v.srq.pd = a.pd;
        v.srq.srq_context = a.srq_context;
        v.srq_type = ty;
        if ty == SRQT_XRC {
            v.xrcd = a.xrcd.cast();
            v.cq = cq;
        }
    }
    s.cast()
}

/// `get_srq_num`: the number requesters name the SRQ with
/// (`remote_srqn`).
///
/// # Safety
/// `srq` is a live SRQ of this provider; `num` is writable.
pub unsafe extern "C" fn get_srq_num(srq: *mut ibv::ibv_srq, num: *mut u32) -> c_int {
    if num.is_null() {
        return libc::EINVAL;
    }
    // SAFETY: caller contract.
    unsafe { *num = (*srq.cast::<SvSrq>()).id };
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_domains_are_stable_and_apart_from_private_ones() {
        let a = file_domain_id(2049, 1234);
        assert_eq!(a, file_domain_id(2049, 1234));
        assert_ne!(a, file_domain_id(2049, 1235));
        assert_ne!(a & 0x8000_0000, 0);
    }
}
