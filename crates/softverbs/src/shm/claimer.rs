//! Who holds a claim on a receive (shm::claim): the claim token a
//! requester writes into a receive queue's claim word, and the check that
//! its process is dead (so that a flusher may take the claim over).

use std::sync::atomic::{AtomicU64, Ordering};

/// Bit 63 of a claim word: claimed (the rest is a [`Token`]).
const CLAIMED: u64 = 1 << 63;
const PID_BITS: u32 = 22;
const QPN_BITS: u32 = 24;
const START_BITS: u32 = 63 - PID_BITS - QPN_BITS;
const _: () = assert!(1 + START_BITS + QPN_BITS + PID_BITS == 64 && START_BITS == 17);

/// A claimer's identity as it stands in a claim word:
///
/// | bits   | field   | meaning                                                  |
/// |--------|---------|----------------------------------------------------------|
/// | 63     | claimed | 1 (a free claim word, `pos + 1`, has it clear)           |
/// | 46..63 | start   | low 17 bits of the claimer process's start time (clock   |
/// |        |         | ticks since boot, `/proc/<pid>/stat` field 22): a later  |
/// |        |         | process reusing the pid is not taken for it              |
/// | 22..46 | qpn     | the QP the receive is taken for (on an SRQ: the QP whose |
/// |        |         | CQ its completion goes to)                               |
/// | 0..22  | pid     | the claimer's pid (Linux pids are below 2^22)            |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token(u64);

impl Token {
    /// The token of this process claiming for QP `qpn`.
    pub fn mine(qpn: u32) -> Self {
        let me = crate::provider::xfer::my_pid();
        Self::of(me, my_start(), qpn)
    }

    pub(crate) fn of(pid: u32, start: u64, qpn: u32) -> Self {
        let pid = u64::from(pid) & ((1 << PID_BITS) - 1);
        let qpn = u64::from(qpn) & ((1 << QPN_BITS) - 1);
        let start = start & ((1 << START_BITS) - 1);
        Self(CLAIMED | start << (PID_BITS + QPN_BITS) | qpn << PID_BITS | pid)
    }

    /// The same process's token with `qpn` in its QPN field (masked to
    /// 24 bits).
    pub(crate) fn with_qpn(self, qpn: u32) -> Self {
        let field = ((1u64 << QPN_BITS) - 1) << PID_BITS;
        Self(self.0 & !field | (u64::from(qpn) << PID_BITS) & field)
    }

    /// The claimer's pid.
    pub fn pid(self) -> u32 {
        (self.0 & ((1 << PID_BITS) - 1)) as u32
    }

    /// The QP the receive was taken for.
    pub fn qpn(self) -> u32 {
        ((self.0 >> PID_BITS) & ((1 << QPN_BITS) - 1)) as u32
    }

    fn start(self) -> u64 {
        (self.0 >> (PID_BITS + QPN_BITS)) & ((1 << START_BITS) - 1)
    }

    pub(crate) fn word(self) -> u64 {
        self.0
    }

    pub(crate) fn from_word(w: u64) -> Option<Self> {
        (w & CLAIMED != 0).then_some(Self(w))
    }

    /// Whether the claimer is proven dead: its process is gone, or none of
    /// its threads will run user code again (each is a zombie, or exiting:
    /// `PF_EXITING`, set as a killed or exiting thread enters the kernel's
    /// exit path, before its files close and its peers hear of it), or its
    /// pid now names a process started at another time. This process is
    /// never dead.
    pub fn claimer_dead(self) -> bool {
        let pid = self.pid();
        if pid == crate::provider::xfer::my_pid() {
            return false;
        }
        if cfg!(miri) {
            // Miri cannot read /proc or signal: there only pid 0, which
            // never names a user process, is dead (the unit tests' dead
            // claimer). The real check runs in the integration tests.
            return pid == 0;
        }
        match proc_stat(pid) {
            Ok(Some(leader)) => {
                (self.start() != 0 && leader.start & ((1 << START_BITS) - 1) != self.start())
                    || !any_thread_runs(pid)
            }
            Ok(None) => true,
            Err(()) => {
                // No readable /proc: only a pid that names nobody is dead.
                // SAFETY: signal 0 only checks for existence.
                let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
                r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
            }
        }
    }
}

/// `PF_EXITING` in a task's flags (`/proc/<pid>/stat` field 9).
const PF_EXITING: u64 = 0x4;

/// What a `stat` line says of a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stat {
    state: u8,
    flags: u64,
    start: u64,
}

impl Stat {
    /// Whether the task may still run user code.
    fn runs(self) -> bool {
        !matches!(self.state, b'Z' | b'X' | b'x') && self.flags & PF_EXITING == 0
    }
}

/// Whether a thread of process `pid` may still run user code (a process
/// whose first thread exited while others run is alive). A thread that
/// vanishes while we look does not run; a task list that cannot be read
/// for another reason than the process being gone proves nothing.
fn any_thread_runs(pid: u32) -> bool {
    let dir = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(d) => d,
        Err(e) => return e.raw_os_error() != Some(libc::ENOENT),
    };
    dir.flatten().any(|t| {
        std::fs::read(t.path().join("stat"))
            .ok()
            .and_then(|s| parse_stat(&s))
            .is_some_and(Stat::runs)
    })
}

/// The `stat` of process `pid` (its first thread's state and flags, the
/// process's start time); `Ok(None)` when there is no such process, `Err`
/// when /proc cannot tell.
fn proc_stat(pid: u32) -> Result<Option<Stat>, ()> {
    let s = match std::fs::read(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e)
            if e.raw_os_error() == Some(libc::ENOENT) || e.raw_os_error() == Some(libc::ESRCH) =>
        {
            return Ok(None)
        }
        Err(_) => return Err(()),
    };
    parse_stat(&s).map(Some).ok_or(())
}

/// Fields 3 (state), 9 (flags) and 22 (start time) of a `stat` line; the
/// command name (field 2) is in parentheses and may contain anything.
fn parse_stat(s: &[u8]) -> Option<Stat> {
    let close = s.iter().rposition(|&b| b == b')')?;
    let rest = std::str::from_utf8(s.get(close + 1..)?).ok()?;
    let mut f = rest.split_ascii_whitespace();
    let state = *f.next()?.as_bytes().first()?;
    // Fields 4..=8, then the flags.
    let flags = f.nth(5)?.parse().ok()?;
    // Fields 10..=21, then the start time.
    let start = f.nth(12)?.parse().ok()?;
    Some(Stat {
        state,
        flags,
        start,
    })
}

static MY_START: AtomicU64 = AtomicU64::new(u64::MAX);

extern "C" fn forget_start_after_fork() {
    MY_START.store(u64::MAX, Ordering::Relaxed);
}

/// This process's start time (0 when /proc cannot tell: its claims are
/// then judged by pid alone), cached and forgotten in a forked child.
fn my_start() -> u64 {
    let s = MY_START.load(Ordering::Relaxed);
    if s != u64::MAX {
        return s;
    }
    static ATFORK: std::sync::Once = std::sync::Once::new();
    ATFORK.call_once(|| {
        // SAFETY: registering a child handler that only stores to an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(forget_start_after_fork)) };
    });
    let s = (!cfg!(miri))
        .then(|| std::fs::read("/proc/self/stat").ok())
        .flatten()
        .and_then(|s| parse_stat(&s))
        .map_or(0, |st| st.start & ((1 << START_BITS) - 1));
    MY_START.store(s, Ordering::Relaxed);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        let t = Token::of(4_194_303, 0x1_2345, 0xFF_FFFF);
        assert_eq!(
            (t.pid(), t.qpn(), t.start()),
            (4_194_303, 0xFF_FFFF, 0x1_2345)
        );
        // Every field at its extremes and a spread of values in between;
        // a start time is cut to its low 17 bits, nothing leaks across.
        let picks = |max: u64| [0, 1, max / 3, max / 2 + 7, max - 1, max];
        for pid in picks((1 << PID_BITS) - 1) {
            for qpn in picks((1 << QPN_BITS) - 1) {
                for start in picks(u64::from(u32::MAX)) {
                    let t = Token::of(pid as u32, start, qpn as u32);
                    assert_eq!(t.pid(), pid as u32);
                    assert_eq!(t.qpn(), qpn as u32);
                    assert_eq!(t.start(), start & ((1 << START_BITS) - 1));
                    assert_eq!(Token::from_word(t.word()), Some(t));
                    let other = (qpn as u32).wrapping_mul(7) & 0xFF_FFFF;
                    assert_eq!(t.with_qpn(other), Token::of(pid as u32, start, other));
                }
            }
        }
        assert!(Token::from_word(12).is_none());
        assert!(!Token::mine(7).claimer_dead(), "this process is alive");
    }

    #[test]
    fn stat_lines_parse() {
        let line =
            b"123 (a (weird) name) S 1 2 3 4 5 4194564 7 8 9 10 11 12 13 14 15 16 17 18 99887 20";
        let st = parse_stat(line).unwrap();
        assert_eq!(
            st,
            Stat {
                state: b'S',
                flags: 4194564,
                start: 99887
            }
        );
        assert!(!st.runs(), "PF_EXITING");
        assert!(Stat { flags: 0, ..st }.runs());
        assert!(!Stat {
            state: b'Z',
            flags: 0,
            ..st
        }
        .runs());
        assert_eq!(parse_stat(b"garbage"), None);
        if !cfg!(miri) {
            let me = parse_stat(&std::fs::read("/proc/self/stat").unwrap()).unwrap();
            assert!(me.runs());
            assert!(any_thread_runs(std::process::id()));
            assert!(!any_thread_runs(0), "no process 0");
        }
    }
}
