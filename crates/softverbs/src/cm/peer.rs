//! Who may be at the other end of a CM socket: a process of this
//! process's effective uid only.
//!
//! The CM's sockets have abstract names (`addr::listener_name`), which any
//! process on the machine can connect to or bind first. softverbs is a
//! test device for one user's processes, not a security boundary between
//! users; this check keeps another user's process out of the CM exchange
//! all the same:
//!
//! 1. a listener drops, unread, every connection whose peer is of another
//!    uid (`Engine::on_listen`);
//! 2. a connecting side refuses a listener of another uid, as if nobody
//!    listened under that name (`connect_name`).

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// The effective uid of the process at the other end of the connected Unix
/// socket `fd` (`SO_PEERCRED`: the connecting process's when it connected,
/// or, seen from the connecting side, the listener's when it listened).
///
/// # Errors
/// The OS error of `getsockopt`.
pub fn peer_uid(fd: &OwnedFd) -> io::Result<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: `cred` is a writable `ucred` of `len` bytes, the size
    // SO_PEERCRED writes; `fd` is an open socket.
    let r = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Refuse the peer of the connected Unix socket `fd` unless its uid is
/// this process's effective uid (steps 1 and 2).
///
/// # Errors
/// EACCES for a peer of another uid; the OS error of `getsockopt`.
pub fn same_user(fd: &OwnedFd) -> io::Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    if peer_uid(fd)? == me {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EACCES))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::FromRawFd;

    fn fd(r: libc::c_int) -> OwnedFd {
        assert!(r >= 0, "{}", io::Error::last_os_error());
        // SAFETY: a descriptor just returned to us, owned by nobody else.
        unsafe { OwnedFd::from_raw_fd(r) }
    }

    #[test]
    fn a_peer_of_this_uid_is_accepted() {
        let mut sv = [0; 2];
        // SAFETY: `sv` is a writable array of two descriptors.
        let r = unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
                0,
                sv.as_mut_ptr(),
            )
        };
        assert_eq!(r, 0, "{}", io::Error::last_os_error());
        let (a, _b) = (fd(sv[0]), fd(sv[1]));
        // SAFETY: geteuid has no preconditions.
        assert_eq!(peer_uid(&a).expect("SO_PEERCRED"), unsafe {
            libc::geteuid()
        });
        same_user(&a).expect("a peer of our own uid");
    }

    /// A listener of ours, a child that connects to it as uid 65534: the
    /// accepted connection is refused with EACCES.
    #[test]
    fn a_peer_of_another_uid_is_refused() {
        const NOBODY: libc::uid_t = 65534;
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            let line = "SKIPPED: a_peer_of_another_uid_is_refused (needs root to connect \
                        as uid 65534)\n";
            // Straight to fd 2: libtest captures the output of passing tests.
            // SAFETY: writing a valid buffer of its length to fd 2.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
            return;
        }
        // SAFETY: plain socket creation.
        let ls = fd(unsafe {
            libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0)
        });
        // SAFETY: an all-zero sockaddr_un is valid; the name is set below.
        let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
        let name = format!("softverbs-unit-peer-{}", std::process::id());
        for (d, s) in sa.sun_path[1..].iter_mut().zip(name.as_bytes()) {
            *d = *s as libc::c_char;
        }
        let len = (std::mem::size_of::<libc::sa_family_t>() + 1 + name.len()) as libc::socklen_t;
        let sap = std::ptr::addr_of!(sa).cast::<libc::sockaddr>();
        // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
        assert_eq!(unsafe { libc::bind(ls.as_raw_fd(), sap, len) }, 0);
        // SAFETY: listening on our bound socket.
        assert_eq!(unsafe { libc::listen(ls.as_raw_fd(), 4) }, 0);
        // SAFETY: the child runs only async-signal-safe system calls
        // (setresuid, socket, connect, _exit) on data prepared before the
        // fork, so the other threads of the test harness do not matter.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: as above; the child never returns into the harness.
            unsafe {
                if libc::syscall(libc::SYS_setresuid, NOBODY, NOBODY, NOBODY) != 0 {
                    libc::_exit(2);
                }
                let s = libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET, 0);
                let ok = s >= 0 && libc::connect(s, sap, len) == 0;
                libc::_exit(if ok { 0 } else { 3 });
            }
        }
        let mut status = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        let code = libc::WEXITSTATUS(status);
        if code == 2 {
            let line = "SKIPPED: a_peer_of_another_uid_is_refused (setresuid to 65534 not \
                        permitted)\n";
            // SAFETY: writing a valid buffer of its length to fd 2.
            unsafe { libc::write(2, line.as_ptr().cast(), line.len()) };
            return;
        }
        assert_eq!(code, 0, "the child could not connect");
        // The connection stays queued after the child exits.
        // SAFETY: accepting on our listening socket.
        let c = fd(unsafe {
            libc::accept4(
                ls.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        });
        assert_eq!(peer_uid(&c).expect("SO_PEERCRED"), NOBODY);
        let e = same_user(&c).expect_err("a peer of uid 65534 must be refused");
        assert_eq!(e.raw_os_error(), Some(libc::EACCES));
    }
}
