//! The two-process tests' plumbing: the test binary re-runs itself as the
//! child (one test, `--exact`), and the two exchange numbers line by line
//! over a socketpair, as verbs programs exchange QPNs and keys over TCP.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::net::UnixStream;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// One end of the socketpair: lines of numbers.
pub struct Chan {
    r: BufReader<UnixStream>,
    w: UnixStream,
}

impl Chan {
    pub fn new(s: UnixStream) -> Chan {
        let w = s.try_clone().expect("clone socket");
        Chan {
            r: BufReader::new(s),
            w,
        }
    }
    pub fn send(&mut self, line: &str) {
        writeln!(self.w, "{line}").expect("send line");
    }
    pub fn recv(&mut self) -> Vec<u64> {
        let mut l = String::new();
        self.r.read_line(&mut l).expect("recv line");
        l.split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect()
    }
}

/// In the child: its end of the socketpair; `None` in the parent.
pub fn child_chan() -> Option<Chan> {
    if std::env::var("SOFTVERBS_TEST_ROLE").ok()? != "child" {
        return None;
    }
    let fd: i32 = std::env::var("SOFTVERBS_TEST_FD").ok()?.parse().ok()?;
    // SAFETY: the parent passed its end of the socketpair open across exec
    // under this number (`spawn`), and nothing else in the child owns it.
    Some(Chan::new(unsafe { UnixStream::from_raw_fd(fd) }))
}

/// In the parent: the binary re-run as the child for `test`, and the
/// parent's end of the socketpair.
pub fn spawn(test: &str) -> (Child, Chan) {
    spawn_env(test, &[])
}

/// [`spawn`] with extra environment variables for the child.
pub fn spawn_env(test: &str, env: &[(&str, &str)]) -> (Child, Chan) {
    let (a, b) = UnixStream::pair().expect("socketpair");
    let fd = b.as_raw_fd();
    // SAFETY: `fd` is `b`, open until dropped below; clearing FD_CLOEXEC
    // lets the child inherit it.
    unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    let child = Command::new(std::env::current_exe().expect("exe"))
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("SOFTVERBS_TEST_ROLE", "child")
        .env("SOFTVERBS_TEST_FD", fd.to_string())
        .envs(env.iter().copied())
        .spawn()
        .expect("spawn child");
    drop(b);
    (child, Chan::new(a))
}

/// Wait (10 s at most) until the child stopped itself in the claim hook.
pub fn wait_stopped(child: &Child) {
    let pid = child.id() as libc::pid_t;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let mut st = 0;
        let r = unsafe { libc::waitpid(pid, &mut st, libc::WUNTRACED | libc::WNOHANG) };
        assert!(r >= 0, "waitpid: {}", std::io::Error::last_os_error());
        if r == pid {
            assert!(
                libc::WIFSTOPPED(st),
                "the requester ended (status {st:#x}) instead of stopping after its claim"
            );
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the requester never claimed a receive"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// SIGKILL the stopped child and wait until it is dead (a zombie, not
/// reaped: `child.wait()` reaps it later).
pub fn kill_and_wait_dead(child: &Child) {
    let pid = child.id() as libc::pid_t;
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let r = unsafe {
        libc::waitid(
            libc::P_PID,
            pid as libc::id_t,
            &mut info,
            libc::WEXITED | libc::WNOWAIT,
        )
    };
    assert_eq!(r, 0, "waitid: {}", std::io::Error::last_os_error());
}
