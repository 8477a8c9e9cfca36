//! Multicast (`ibv_attach_mcast` / `ibv_detach_mcast`, model::ud): the
//! fabric's group table and the verbs that change it.
//!
//! The table is one machine-wide segment (`mcast`, created zeroed on first
//! use, never unlinked) that every process of the fabric maps: a lock word,
//! then [`MAX_MCAST_GRP`] groups of [`MAX_MCAST_QP_ATTACH`] members. A
//! member is a QP (its QPN), the process that attached it and the LID it was
//! attached with. The lock word holds the pid of its holder, so a process
//! that dies holding it does not block the fabric: a waiter that finds the
//! holder gone takes the lock over. A process that dies with attached QPs
//! leaves their members behind; senders skip a member whose QP or process
//! is gone, and an attach that needs the room removes such members.

use std::ffi::c_int;
use std::io;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};

use super::qp::sv;
use super::xfer::my_pid;
use crate::model::device::DEAD_ERRNO;
use crate::model::qp::QpType;
use crate::model::ud::{is_mcast_gid, is_mcast_lid, MAX_MCAST_GRP, MAX_MCAST_QP_ATTACH};
use crate::shm::segment::open_shared;
use crate::shm::Segment;
use crate::sys::ibv;

/// One attached QP.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Member {
    /// QPN; 0 marks a free slot (QPNs start at 16).
    pub qpn: u32,
    /// The attaching process.
    pub pid: u32,
    /// The LID given to `ibv_attach_mcast`.
    pub lid: u16,
    _pad: u16,
}

#[repr(C)]
struct Group {
    mgid: [u8; 16],
    /// Members in use; 0: the group slot is free.
    used: u32,
    _pad: u32,
    members: [Member; MAX_MCAST_QP_ATTACH],
}

#[repr(C)]
struct Table {
    lock: AtomicU32,
    _pad: [u32; 15],
    groups: [Group; MAX_MCAST_GRP],
}

/// Bytes of the `mcast` segment.
const TABLE_BYTES: usize = std::mem::size_of::<Table>().next_multiple_of(4096);

fn segment() -> io::Result<&'static Arc<Segment>> {
    static SEG: OnceLock<Arc<Segment>> = OnceLock::new();
    if let Some(s) = SEG.get() {
        return Ok(s);
    }
    let s = open_shared("mcast", TABLE_BYTES)?;
    Ok(SEG.get_or_init(|| s))
}

fn pid_gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r != 0 && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// The table, locked.
struct Locked {
    t: *mut Table,
}

impl Locked {
    fn take() -> io::Result<Self> {
        let t = segment()?.base().cast::<Table>();
        // SAFETY: the segment is TABLE_BYTES long, page aligned, and its
        // first word is only ever accessed atomically.
        let lock = unsafe { &(*t).lock };
        let me = my_pid();
        loop {
            match lock.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return Ok(Self { t }),
                Err(h) if h != me && pid_gone(h) => {
                    // The holder died inside: whatever it left is a table
                    // of whole members (each is written before `used`
                    // counts it), so take over.
                    if lock
                        .compare_exchange(h, me, Ordering::Acquire, Ordering::Relaxed)
                        .is_ok()
                    {
                        return Ok(Self { t });
                    }
                }
                Err(_) => std::thread::yield_now(),
            }
        }
    }

    fn groups(&mut self) -> &mut [Group; MAX_MCAST_GRP] {
        // SAFETY: we hold the lock, so no process touches the groups; the
        // segment is mapped for the life of the process.
        unsafe { &mut (*self.t).groups }
    }
}

impl Drop for Locked {
    fn drop(&mut self) {
        // SAFETY: as in `take`.
        unsafe { (*self.t).lock.store(0, Ordering::Release) };
    }
}

fn find(groups: &mut [Group; MAX_MCAST_GRP], mgid: &[u8; 16]) -> Option<usize> {
    groups.iter().position(|g| g.used > 0 && g.mgid == *mgid)
}

/// Drop the members of `g` whose process is gone.
fn prune(g: &mut Group) {
    for m in g.members.iter_mut() {
        if m.qpn != 0 && pid_gone(m.pid) {
            *m = Member::default();
            g.used -= 1;
        }
    }
}

/// Attach QP `qpn` of this process to `mgid`.
///
/// # Errors
/// ENOMEM when the table or the group is full, or the OS error of mapping
/// the table.
pub fn attach(qpn: u32, mgid: &[u8; 16], lid: u16) -> Result<(), c_int> {
    let me = my_pid();
    let mut l = Locked::take().map_err(|e| crate::shm::fabric::errno(&e, libc::EIO))?;
    let groups = l.groups();
    let gi = match find(groups, mgid) {
        Some(i) => i,
        None => {
            let free = match groups.iter().position(|g| g.used == 0) {
                Some(i) => Some(i),
                None => {
                    groups.iter_mut().for_each(prune);
                    groups.iter().position(|g| g.used == 0)
                }
            };
            let Some(i) = free else {
                return Err(libc::ENOMEM);
            };
            groups[i].mgid = *mgid;
            groups[i].members = [Member::default(); MAX_MCAST_QP_ATTACH];
            i
        }
    };
    let g = &mut groups[gi];
    let want = Member {
        qpn,
        pid: me,
        lid,
        _pad: 0,
    };
    // Attaching again what is attached succeeds and changes nothing (as the
    // kernel's uverbs answers).
    if g.members.contains(&want) {
        return Ok(());
    }
    let mut slot = g.members.iter().position(|m| m.qpn == 0);
    if slot.is_none() {
        prune(g);
        slot = g.members.iter().position(|m| m.qpn == 0);
    }
    let Some(s) = slot else {
        return Err(libc::ENOMEM);
    };
    g.members[s] = want;
    g.used += 1;
    Ok(())
}

/// Detach QP `qpn` of this process from `mgid`.
///
/// # Errors
/// EINVAL when it is not attached with `lid`.
pub fn detach(qpn: u32, mgid: &[u8; 16], lid: u16) -> Result<(), c_int> {
    let me = my_pid();
    let mut l = Locked::take().map_err(|e| crate::shm::fabric::errno(&e, libc::EIO))?;
    let groups = l.groups();
    let Some(gi) = find(groups, mgid) else {
        return Err(libc::EINVAL);
    };
    let g = &mut groups[gi];
    let Some(s) = g
        .members
        .iter()
        .position(|m| m.qpn == qpn && m.pid == me && m.lid == lid)
    else {
        return Err(libc::EINVAL);
    };
    g.members[s] = Member::default();
    g.used -= 1;
    Ok(())
}

/// How many groups QP `qpn` of this process is attached to.
pub fn attachments(qpn: u32) -> usize {
    let me = my_pid();
    let Ok(mut l) = Locked::take() else {
        return 0;
    };
    l.groups()
        .iter()
        .filter(|g| g.used > 0)
        .flat_map(|g| g.members.iter())
        .filter(|m| m.qpn == qpn && m.pid == me)
        .count()
}

/// Detach QP `qpn` of this process from every group (the QP of a dead
/// context is destroyed whatever it was attached to).
pub fn detach_all(qpn: u32) {
    let me = my_pid();
    let Ok(mut l) = Locked::take() else {
        return;
    };
    for g in l.groups().iter_mut().filter(|g| g.used > 0) {
        for m in g.members.iter_mut() {
            if m.qpn == qpn && m.pid == me {
                *m = Member::default();
                g.used -= 1;
            }
        }
    }
}

/// The members of `mgid` (each QP once, whatever LIDs it attached with).
pub fn members(mgid: &[u8; 16]) -> Vec<Member> {
    let Ok(mut l) = Locked::take() else {
        return Vec::new();
    };
    let groups = l.groups();
    let Some(gi) = find(groups, mgid) else {
        return Vec::new();
    };
    let mut out: Vec<Member> = Vec::new();
    for m in groups[gi].members.iter().filter(|m| m.qpn != 0) {
        if !out.iter().any(|o| o.qpn == m.qpn && o.pid == m.pid) {
            out.push(*m);
        }
    }
    out
}

/// Check an attach or detach: a UD QP of a live context, a multicast GID
/// and LID.
///
/// # Safety
/// `qp` is a live QP of this provider; `gid` is readable or null.
unsafe fn checked(
    qp: *mut ibv::ibv_qp,
    gid: *const ibv::ibv_gid,
    lid: u16,
) -> Result<(u32, [u8; 16]), c_int> {
    // SAFETY: caller contract.
    let q = unsafe { sv(qp) };
    if q.ctx().dead() {
        return Err(DEAD_ERRNO);
    }
    if gid.is_null() || q.qp_type != QpType::Ud || !is_mcast_lid(lid) {
        return Err(libc::EINVAL);
    }
    // SAFETY: non-null, readable (caller contract); `raw` is the plain
    // 16-byte arm of the union.
    let mgid = unsafe { (*gid).raw };
    if !is_mcast_gid(&mgid) {
        return Err(libc::EINVAL);
    }
    Ok((q.qpn, mgid))
}

/// `attach_mcast`: EINVAL for a QP that is not UD, a GID that is not
/// multicast or a LID that is not; attaching twice succeeds; ENOMEM when
/// the fabric's table ([`MAX_MCAST_GRP`] groups) or the group
/// ([`MAX_MCAST_QP_ATTACH`] QPs) is full.
///
/// # Safety
/// `qp` is a live QP of this provider; `gid` is readable.
pub unsafe extern "C" fn attach_mcast(
    qp: *mut ibv::ibv_qp,
    gid: *const ibv::ibv_gid,
    lid: u16,
) -> c_int {
    // SAFETY: caller contract.
    match unsafe { checked(qp, gid, lid) }.and_then(|(qpn, mgid)| attach(qpn, &mgid, lid)) {
        Ok(()) => 0,
        Err(e) => e,
    }
}

/// `detach_mcast`: EINVAL as for attach, and for a QP not attached to the
/// group with this LID.
///
/// # Safety
/// `qp` is a live QP of this provider; `gid` is readable.
pub unsafe extern "C" fn detach_mcast(
    qp: *mut ibv::ibv_qp,
    gid: *const ibv::ibv_gid,
    lid: u16,
) -> c_int {
    // SAFETY: caller contract.
    match unsafe { checked(qp, gid, lid) }.and_then(|(qpn, mgid)| detach(qpn, &mgid, lid)) {
        Ok(()) => 0,
        Err(e) => e,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_layout() {
        assert_eq!(std::mem::size_of::<Member>(), 12);
        assert_eq!(std::mem::size_of::<Group>(), 24 + 12 * MAX_MCAST_QP_ATTACH);
        assert_eq!(std::mem::offset_of!(Table, groups), 64);
        assert!(TABLE_BYTES >= std::mem::size_of::<Table>());
    }
}
