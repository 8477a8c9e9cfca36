//! The connection manager itself: the rdma_cm ids of this process, their
//! states, the commands librdmacm writes, and the CM thread that handles
//! what peers send.
//!
//! One mutex guards everything; commands run in the caller's thread, socket
//! traffic and timers in the CM thread. A `GET_EVENT` waits for its channel's
//! token byte without the lock.

use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use super::abi::{self, cmd, event, Pod};
use super::addr;
use super::peer;
use super::wire::{Msg, Params};

/// The node GUID the fake sysfs and `ibv_query_device` report, as the
/// kernel returns it (big-endian).
const NODE_GUID_BE: u64 = 0x0200_00ff_fe00_0001_u64.to_be();
/// The port's GID (`fe80::200:ff:fe00:1`).
const GID: [u8; 16] = [
    0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x00, 0x00, 0xff, 0xfe, 0x00, 0x00, 0x01,
];
/// `RDMA_UDP_QKEY`.
const UDP_QKEY: u32 = 0x0123_4567;
/// InfiniBand CM reject reasons.
const REJ_TIMEOUT: u16 = 1;
const REJ_INVALID_SERVICE_ID: u16 = 8;
const REJ_CONSUMER_DEFINED: u16 = 28;
/// Private data sizes of the InfiniBand CM messages as rdma_cm reports
/// them (REQ: 92 bytes less rdma_cm's 36-byte header for IP port spaces).
const REQ_PDATA: usize = 56;
const REQ_PDATA_IB: usize = 92;
const REP_PDATA: usize = 196;
const REJ_PDATA: usize = 148;
/// SIDR REQ: 216 bytes less rdma_cm's header.
const SIDR_REQ_PDATA: usize = 180;
/// SIDR REP.
const SIDR_REP_PDATA: usize = 136;
/// How long the time-wait state lasts before `TIMEWAIT_EXIT`.
const TIMEWAIT: Duration = Duration::from_millis(100);
/// The packet life time of every path (the RTS `timeout` is one more:
/// 4.096 µs × 2^14 ≈ 67 ms per try).
const PACKET_LIFE_TIME: u8 = 13;

/// How long a CM message may go unanswered by a peer whose CM does not run
/// (a stopped or hung process) before the connection is given up:
/// `$SOFTVERBS_CM_TIMEOUT_MS`, default 5 s. A REQ the peer's CM
/// acknowledged (MRA) is sent again each time this runs out, and each copy
/// must be acknowledged within it in turn, so a requester whose peer's CM
/// stops answering, at whatever step, gives up at most twice this after
/// the last answer.
fn cm_timeout() -> Duration {
    static T: OnceLock<Duration> = OnceLock::new();
    *T.get_or_init(|| {
        std::env::var("SOFTVERBS_CM_TIMEOUT_MS")
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .map_or(Duration::from_secs(5), Duration::from_millis)
    })
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum St {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listen,
    /// REQ sent; `mra` says whether the peer's CM acknowledged it, and
    /// `acked` whether it acknowledged the latest copy.
    ReqSent,
    /// Passive: REQ received, not yet accepted or rejected.
    ReqRcvd,
    RepSent,
    RepRcvd,
    Established,
    DreqSent,
    DreqRcvd,
    TimeWait,
    /// Rejected, unreachable or otherwise finished.
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Timer {
    /// No answer to REQ/REP/DREQ from the peer's CM.
    Response,
    /// Time-wait is over.
    TimeWait,
}

struct Id {
    chan: RawFd,
    uid: u64,
    ps: u16,
    qp_type: u8,
    state: St,
    src: Option<SocketAddr>,
    dst: Option<SocketAddr>,
    /// Bound to the device (a specific local address, a resolved
    /// destination or a connection).
    device: bool,
    route: bool,
    /// The reserved/listening socket of a bound id.
    reserve: Option<OwnedFd>,
    conn: Option<OwnedFd>,
    /// The peer's CM acknowledged this connection's REQ (MRA): a live
    /// listener holds the request.
    mra: bool,
    /// The peer's CM acknowledged the latest copy of the REQ: when the
    /// response timer runs out, the REQ is sent again instead of given up.
    acked: bool,
    reported: u32,
    local_psn: u32,
    /// Our parameters (CONNECT or ACCEPT).
    mine: Params,
    /// The peer's (REQ or REP).
    peer: Option<Params>,
    deadline: Option<(Instant, Timer)>,
    tos: u8,
    /// `RDMA_OPTION_ID_ACK_TIMEOUT`: the RTS `timeout` instead of the
    /// path's.
    ack_timeout: Option<u8>,
}

impl Id {
    fn new(chan: RawFd, uid: u64, ps: u16, qp_type: u8) -> Id {
        Id {
            chan,
            uid,
            ps,
            qp_type,
            state: St::Idle,
            src: None,
            dst: None,
            device: false,
            route: false,
            reserve: None,
            conn: None,
            mra: false,
            acked: false,
            reported: 0,
            local_psn: random_u32() & 0xff_ffff,
            mine: Params::default(),
            peer: None,
            deadline: None,
            tos: 0,
            ack_timeout: None,
        }
    }
}

struct Ev {
    /// The id the event is counted against (`events_reported`).
    owner: u32,
    /// For CONNECT_REQUEST: the new id (destroyed with the event if the
    /// event is dropped unreported).
    new_id: Option<u32>,
    /// For MULTICAST_JOIN/ERROR: the group's handle (its own count).
    mc: Option<u32>,
    resp: abi::EventResp,
}

/// A group joined through an id (`rdma_join_multicast`).
struct Mc {
    /// The id that joined.
    id: u32,
    /// Events reported for the group (LEAVE_MCAST waits for their acks).
    reported: u32,
}

struct Chan {
    serial: u64,
    /// The pty number of the master the application holds.
    ptn: u32,
    slave: OwnedFd,
    events: VecDeque<Ev>,
    token: bool,
}

/// Epoll key kinds.
const K_LISTEN: u64 = 1;
const K_CONN: u64 = 2;
const K_PENDING: u64 = 3;
const K_CHAN: u64 = 4;
const K_WAKE: u64 = 5;
fn key(kind: u64, v: u64) -> u64 {
    (kind << 56) | (v & ((1 << 56) - 1))
}

pub(super) struct Cm {
    chans: HashMap<RawFd, Chan>,
    ids: HashMap<u32, Id>,
    /// Accepted sockets whose REQ has not arrived: serial → (listener, fd).
    pending: HashMap<u64, (u32, OwnedFd)>,
    /// Joined multicast groups by handle.
    mcs: HashMap<u32, Mc>,
    next_handle: u32,
    next_serial: u64,
    epoll: OwnedFd,
    wake: OwnedFd,
}

fn random_u32() -> u32 {
    let mut v = 0u32;
    // SAFETY: getrandom writes at most 4 bytes into `v`.
    let n = unsafe { libc::getrandom((&mut v as *mut u32).cast(), 4, 0) };
    if n != 4 {
        // Not cryptographic: PSNs and ephemeral ports only need to vary.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        // SAFETY: getpid has no preconditions.
        v = t ^ (unsafe { libc::getpid() } as u32).rotate_left(16);
    }
    v
}

/// `write(2)` as a system call: the CM's own writes must not go through
/// the interposed `write`, which takes the CM's lock for a descriptor
/// number that was once a channel.
///
/// # Safety
/// `buf` is readable for `n` bytes.
unsafe fn raw_write(fd: RawFd, buf: *const libc::c_void, n: usize) -> isize {
    // SAFETY: the caller's buffer; the kernel checks the descriptor.
    unsafe { libc::syscall(libc::SYS_write, fd, buf, n) as isize }
}

fn errno() -> i32 {
    io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn new_fd(r: libc::c_int) -> io::Result<OwnedFd> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        // SAFETY: `r` is a descriptor just returned to us, owned by no one else.
        Ok(unsafe { OwnedFd::from_raw_fd(r) })
    }
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: plain socket creation.
    new_fd(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })
}

fn abstract_addr(name: &[u8]) -> (libc::sockaddr_un, libc::socklen_t) {
    // SAFETY: sockaddr_un is plain data; zero is a valid value.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let n = name.len().min(sa.sun_path.len() - 1);
    for (d, s) in sa.sun_path[1..].iter_mut().zip(&name[..n]) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + n;
    (sa, len as libc::socklen_t)
}

/// Bind a fresh socket to the abstract `name`.
fn bind_name(name: &[u8]) -> io::Result<OwnedFd> {
    let s = seqpacket()?;
    let (sa, len) = abstract_addr(name);
    // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
    let r = unsafe { libc::bind(s.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(s)
}

/// Connect a fresh socket to the abstract `name`, refusing a listener of
/// another uid (step 2 of `peer`).
fn connect_name(name: &[u8]) -> io::Result<OwnedFd> {
    let s = seqpacket()?;
    let (sa, len) = abstract_addr(name);
    // SAFETY: `sa` is a valid sockaddr_un of `len` bytes.
    let r = unsafe { libc::connect(s.as_raw_fd(), (&sa as *const libc::sockaddr_un).cast(), len) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    peer::same_user(&s)?;
    Ok(s)
}

fn send_msg(fd: &OwnedFd, m: &Msg) -> bool {
    let b = m.encode();
    // SAFETY: `b` is a live buffer of b.len() bytes.
    let n = unsafe {
        libc::send(
            fd.as_raw_fd(),
            b.as_ptr().cast(),
            b.len(),
            libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
        )
    };
    n == b.len() as isize
}

/// What a socket read produced.
enum Recv {
    Msg(Msg),
    Nothing,
    Gone,
}

fn recv_msg(fd: RawFd) -> Recv {
    let mut b = [0u8; 1024];
    // SAFETY: `b` is a writable buffer of its length.
    let n = unsafe { libc::recv(fd, b.as_mut_ptr().cast(), b.len(), libc::MSG_DONTWAIT) };
    if n < 0 {
        return if errno() == libc::EAGAIN {
            Recv::Nothing
        } else {
            Recv::Gone
        };
    }
    if n == 0 {
        return Recv::Gone;
    }
    match Msg::decode(&b[..n as usize]) {
        Ok(m) => Recv::Msg(m),
        // A peer speaking something else is a broken connection.
        Err(_) => Recv::Gone,
    }
}

fn epoll_add(ep: &OwnedFd, fd: RawFd, k: u64, events: u32) -> io::Result<()> {
    let mut ev = libc::epoll_event { events, u64: k };
    // SAFETY: valid epoll and target descriptors, `ev` lives for the call.
    if unsafe { libc::epoll_ctl(ep.as_raw_fd(), libc::EPOLL_CTL_ADD, fd, &mut ev) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn epoll_del(ep: &OwnedFd, fd: RawFd) {
    // SAFETY: removing a descriptor; failure (not registered) is harmless.
    unsafe {
        libc::epoll_ctl(
            ep.as_raw_fd(),
            libc::EPOLL_CTL_DEL,
            fd,
            std::ptr::null_mut(),
        )
    };
}

/// Read `T` from the application's memory at `ptr` (`len` bytes of it,
/// the rest zero), with the kernel's EFAULT for a bad pointer.
fn read_user<T: Pod>(ptr: usize, len: usize) -> Result<T, i32> {
    let mut v = T::zeroed();
    let n = len.min(std::mem::size_of::<T>());
    if n == 0 {
        return Ok(v);
    }
    let local = libc::iovec {
        iov_base: (&mut v as *mut T).cast(),
        iov_len: n,
    };
    let remote = libc::iovec {
        iov_base: ptr as *mut libc::c_void,
        iov_len: n,
    };
    // SAFETY: reading our own process's memory through the kernel (which
    // checks the remote range); `local` is `v`, n ≤ size_of::<T>() bytes.
    let r = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if r != n as isize {
        return Err(libc::EFAULT);
    }
    Ok(v)
}

/// Write the first `out` bytes of `v` to the application's `ptr`.
fn write_user<T: Pod>(ptr: u64, out: u16, v: &T) -> Result<(), i32> {
    let n = usize::from(out).min(std::mem::size_of::<T>());
    if n == 0 {
        return Ok(());
    }
    let local = libc::iovec {
        iov_base: (v as *const T).cast_mut().cast(),
        iov_len: n,
    };
    let remote = libc::iovec {
        iov_base: ptr as usize as *mut libc::c_void,
        iov_len: n,
    };
    // SAFETY: writing our own process's memory through the kernel, which
    // checks the destination range; `local` is n bytes of `v`.
    let r = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
    if r != n as isize {
        return Err(libc::EFAULT);
    }
    Ok(())
}

fn is_ud(qp_type: u8) -> bool {
    u32::from(qp_type) == rdma_sys::ibv_qp_type::IBV_QPT_UD
}

/// Private data a REQ (or SIDR REQ, for UD) carries for the consumer.
fn req_pdata(ps: u16, qp_type: u8) -> usize {
    if is_ud(qp_type) {
        SIDR_REQ_PDATA
    } else if ps == abi::ps::IB {
        REQ_PDATA_IB
    } else {
        REQ_PDATA
    }
}

/// The UD parameters of a SIDR exchange: the peer's QP and Q_Key and the
/// address handle that reaches it (every port is LID 1 on port 1).
fn ud_param(p: &Params, pdata_len: usize) -> abi::UdParam {
    let mut u = abi::UdParam::zeroed();
    u.qp_num = p.qpn;
    u.qkey = p.qkey;
    u.ah_attr.dlid = 1;
    u.ah_attr.port_num = 1;
    let n = p.pdata.len().min(pdata_len);
    u.private_data[..n].copy_from_slice(&p.pdata[..n]);
    u.private_data_len = pdata_len as u8;
    u
}

fn conn_param(p: &Params, pdata_len: usize) -> abi::ConnParam {
    let mut c = abi::ConnParam::zeroed();
    c.qp_num = p.qpn;
    c.qkey = p.qkey;
    let n = p.pdata.len().min(pdata_len);
    c.private_data[..n].copy_from_slice(&p.pdata[..n]);
    c.private_data_len = pdata_len as u8;
    c.srq = p.srq;
    c.responder_resources = p.responder_resources;
    c.initiator_depth = p.initiator_depth;
    c.flow_control = p.flow_control;
    c.retry_count = p.retry_count;
    c.rnr_retry_count = p.rnr_retry_count;
    c
}

fn params_from(c: &abi::ConnParam, psn: u32) -> Params {
    Params {
        qpn: c.qp_num & 0xff_ffff,
        psn,
        qkey: c.qkey,
        responder_resources: c.responder_resources,
        initiator_depth: c.initiator_depth,
        flow_control: c.flow_control,
        retry_count: c.retry_count.min(7),
        rnr_retry_count: c.rnr_retry_count.min(7),
        srq: c.srq,
        ece_vendor: 0,
        ece_attr: 0,
        pdata: c.pdata().to_vec(),
    }
}

impl Cm {
    fn new() -> io::Result<Cm> {
        // SAFETY: plain epoll/eventfd creation.
        let epoll = new_fd(unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) })?;
        // SAFETY: as above.
        let wake = new_fd(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })?;
        epoll_add(
            &epoll,
            wake.as_raw_fd(),
            key(K_WAKE, 0),
            libc::EPOLLIN as u32,
        )?;
        Ok(Cm {
            chans: HashMap::new(),
            ids: HashMap::new(),
            pending: HashMap::new(),
            mcs: HashMap::new(),
            next_handle: 1,
            next_serial: 1,
            epoll,
            wake,
        })
    }

    fn poke(&self) {
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our eventfd; failure (counter full)
        // still leaves it readable.
        unsafe { raw_write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    fn set_deadline(&mut self, h: u32, d: Option<(Instant, Timer)>) {
        if let Some(id) = self.ids.get_mut(&h) {
            id.deadline = d;
        }
        if d.is_some() {
            self.poke();
        }
    }

    fn token(&mut self, chan: RawFd) {
        if let Some(c) = self.chans.get_mut(&chan) {
            if !c.token && !c.events.is_empty() {
                let b = 1u8;
                // SAFETY: one byte to our pty slave; the master becomes readable.
                let n = unsafe { raw_write(c.slave.as_raw_fd(), (&b as *const u8).cast(), 1) };
                c.token = n == 1;
            }
        }
    }

    /// Take back channel `chan`'s byte once the events it announced are
    /// gone unread (their id destroyed, their group left, the id moved to
    /// another channel): the kernel's channel polls readable only while it
    /// has an event, and a `GET_EVENT` it wakes with none waits again — a
    /// program that polls before it asks (rping's newer CM thread) would
    /// then wait for ever. Run in commands, whose caller names `chan` by
    /// its own descriptor; the byte is flushed from a duplicate checked to
    /// be the channel (the number may name another file by now).
    fn withdraw_token(&mut self, chan: RawFd) {
        let Some(c) = self.chans.get_mut(&chan) else {
            return;
        };
        if !c.token || !c.events.is_empty() {
            return;
        }
        // SAFETY: F_DUPFD_CLOEXEC takes no pointer; the result is checked.
        let d = unsafe { libc::fcntl(chan, libc::F_DUPFD_CLOEXEC, 0) };
        if d < 0 {
            return;
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let dup = unsafe { OwnedFd::from_raw_fd(d) };
        if ptn(dup.as_raw_fd()) != Some(c.ptn) {
            return;
        }
        // SAFETY: TCFLSH takes an int argument; it discards the bytes
        // waiting to be read from this pty master (ours: checked above).
        unsafe { libc::tcflush(dup.as_raw_fd(), libc::TCIFLUSH) };
        c.token = false;
    }

    /// Queue an event for id `h` (on its channel).
    fn push(&mut self, h: u32, ev: u32, status: i32, param: Option<abi::ConnParam>) {
        let Some(id) = self.ids.get(&h) else { return };
        let mut resp = abi::EventResp {
            uid: id.uid,
            id: h,
            event: ev,
            status: status as u32,
            param: abi::EventParam {
                conn: abi::ConnParam::zeroed(),
            },
            reserved: 0,
            ece: abi::Ece::default(),
        };
        if let Some(p) = param {
            resp.param.conn = p;
        }
        let chan = id.chan;
        if let Some(c) = self.chans.get_mut(&chan) {
            c.events.push_back(Ev {
                owner: h,
                new_id: None,
                mc: None,
                resp,
            });
        }
        self.token(chan);
    }

    /// Queue an event carrying UD parameters (SIDR).
    fn push_ud(&mut self, h: u32, ev: u32, status: i32, ud: abi::UdParam) {
        let Some(id) = self.ids.get(&h) else { return };
        let resp = abi::EventResp {
            uid: id.uid,
            id: h,
            event: ev,
            status: status as u32,
            param: abi::EventParam { ud },
            reserved: 0,
            ece: abi::Ece::default(),
        };
        let chan = id.chan;
        if let Some(c) = self.chans.get_mut(&chan) {
            c.events.push_back(Ev {
                owner: h,
                new_id: None,
                mc: None,
                resp,
            });
        }
        self.token(chan);
    }

    fn remove_id(&mut self, h: u32) -> Option<Id> {
        let id = self.ids.remove(&h)?;
        if let Some(s) = &id.conn {
            epoll_del(&self.epoll, s.as_raw_fd());
        }
        if let Some(s) = &id.reserve {
            epoll_del(&self.epoll, s.as_raw_fd());
        }
        // Unreported events go; requests they carried are refused (the
        // new ids are destroyed, closing their sockets).
        let mut doomed = Vec::new();
        if let Some(c) = self.chans.get_mut(&id.chan) {
            c.events.retain(|e| {
                if e.owner == h {
                    doomed.extend(e.new_id);
                    false
                } else {
                    true
                }
            });
        }
        self.withdraw_token(id.chan);
        for d in doomed {
            self.remove_id(d);
        }
        // Its groups go with it, as the kernel's CM leaves them; detaching
        // the QP is the application's (rdma_leave_multicast does it).
        self.mcs.retain(|_, m| m.id != h);
        Some(id)
    }

    /// The id `h` of channel `chan` (the kernel finds ids through the file
    /// they were created on).
    fn id_on(&mut self, chan: RawFd, h: u32) -> Result<&mut Id, i32> {
        match self.ids.get_mut(&h) {
            Some(id) if id.chan == chan => Ok(id),
            _ => Err(libc::EINVAL),
        }
    }

    // ----- commands -----

    fn create_id(&mut self, chan: RawFd, c: &abi::CreateId) -> Result<u32, i32> {
        match c.ps {
            abi::ps::TCP | abi::ps::UDP | abi::ps::IB | abi::ps::IPOIB => {}
            _ => return Err(libc::EINVAL),
        }
        let h = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        self.ids.insert(h, Id::new(chan, c.uid, c.ps, c.qp_type));
        Ok(h)
    }

    fn bind(&mut self, chan: RawFd, h: u32, a: SocketAddr) -> Result<(), i32> {
        let a = addr::canonical(a);
        let ps = self.id_on(chan, h)?.ps;
        if self.id_on(chan, h)?.state != St::Idle {
            return Err(libc::EINVAL);
        }
        let wildcard = a.ip().is_unspecified();
        if !wildcard && !addr::is_local(a.ip()) {
            return Err(libc::EADDRNOTAVAIL);
        }
        let (sock, port) = if a.port() == 0 {
            let mut got = None;
            for _ in 0..64 {
                let p = 32768 + (random_u32() % 28232) as u16;
                if let Ok(s) = bind_name(&addr::listener_name(ps, a.ip(), p)) {
                    got = Some((s, p));
                    break;
                }
            }
            got.ok_or(libc::EADDRINUSE)?
        } else {
            if !wildcard {
                // A wildcard bind on the port covers this address too.
                let w = match a.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                    IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
                };
                if let Err(e) = bind_name(&addr::listener_name(ps, w, a.port())) {
                    if e.raw_os_error() == Some(libc::EADDRINUSE) {
                        return Err(libc::EADDRINUSE);
                    }
                }
            }
            let s = bind_name(&addr::listener_name(ps, a.ip(), a.port()))
                .map_err(|e| e.raw_os_error().unwrap_or(libc::EADDRINUSE))?;
            (s, a.port())
        };
        let mut a = a;
        a.set_port(port);
        let id = self.id_on(chan, h)?;
        id.reserve = Some(sock);
        id.src = Some(a);
        id.device = !wildcard;
        id.state = St::Bound;
        Ok(())
    }

    fn resolve_ip(
        &mut self,
        chan: RawFd,
        h: u32,
        src: Option<SocketAddr>,
        dst: SocketAddr,
    ) -> Result<(), i32> {
        let dst = addr::canonical(dst);
        let st = self.id_on(chan, h)?.state;
        if st == St::Idle {
            if let Some(s) = src {
                self.bind(chan, h, SocketAddr::new(s.ip(), s.port()))?;
            }
        } else if st != St::Bound {
            return Err(libc::EINVAL);
        }
        let id = self.id_on(chan, h)?;
        // The kernel resolves asynchronously; the answer is immediate here.
        // A multicast destination is reached through the local port
        // (rdma_join_multicast resolves the group's address first).
        let local =
            dst.ip().is_unspecified() || dst.ip().is_multicast() || addr::is_local(dst.ip());
        if !local {
            id.dst = Some(dst);
            self.push(h, event::ADDR_ERROR, -libc::ENODEV, None);
            return Ok(());
        }
        let dst = if dst.ip().is_unspecified() {
            SocketAddr::new(
                match dst.ip() {
                    IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                    IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
                },
                dst.port(),
            )
        } else {
            dst
        };
        // The source of a multicast destination is the port's: loopback
        // when the id has none.
        let own = if dst.ip().is_multicast() {
            match dst.ip() {
                IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            }
        } else {
            dst.ip()
        };
        let src = match id.src {
            Some(s) if !s.ip().is_unspecified() => s,
            Some(s) => SocketAddr::new(own, s.port()),
            None => SocketAddr::new(own, 32768 + (random_u32() % 28232) as u16),
        };
        id.src = Some(src);
        id.dst = Some(dst);
        id.device = true;
        id.state = St::AddrResolved;
        self.push(h, event::ADDR_RESOLVED, 0, None);
        Ok(())
    }

    /// JOIN_IP_MCAST / JOIN_MCAST: the id (bound to the device: a local
    /// address or a resolved one) joins the group of IP address `a`. There
    /// is no subnet manager to ask: the group exists as soon as it is
    /// named, so MULTICAST_JOIN follows at once with the group's address
    /// handle (its MGID from [`addr::mc_gid`], its MLID, global) and Q_Key
    /// (`RDMA_UDP_QKEY`), remote QPN 0xFFFFFF. librdmacm attaches the QP
    /// when it reads the event (`ibv_attach_mcast`, provider::mcast) and
    /// reports MULTICAST_ERROR itself when that fails.
    fn join(
        &mut self,
        chan: RawFd,
        h: u32,
        uid: u64,
        a: SocketAddr,
        flags: u16,
    ) -> Result<u32, i32> {
        if flags != abi::join_flag::FULLMEMBER && flags != abi::join_flag::SENDONLY_FULLMEMBER {
            return Err(libc::EINVAL);
        }
        let id = self.id_on(chan, h)?;
        if !id.device {
            return Err(libc::ENODEV);
        }
        if id.state != St::Bound && id.state != St::AddrResolved {
            return Err(libc::EINVAL);
        }
        let a = addr::canonical(a);
        let mgid = addr::mc_gid(a.ip(), id.ps).ok_or(libc::EINVAL)?;
        let tos = id.tos;
        let mh = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        self.mcs.insert(mh, Mc { id: h, reported: 0 });
        let mut u = abi::UdParam::zeroed();
        u.qp_num = crate::model::ud::MULTICAST_QPN;
        u.qkey = UDP_QKEY;
        u.ah_attr.dlid = addr::mc_lid(&mgid);
        u.ah_attr.is_global = 1;
        u.ah_attr.port_num = 1;
        u.ah_attr.grh.dgid = mgid;
        u.ah_attr.grh.traffic_class = tos;
        let resp = abi::EventResp {
            uid,
            id: mh,
            event: event::MULTICAST_JOIN,
            status: 0,
            param: abi::EventParam { ud: u },
            reserved: 0,
            ece: abi::Ece::default(),
        };
        if let Some(c) = self.chans.get_mut(&chan) {
            c.events.push_back(Ev {
                owner: h,
                new_id: None,
                mc: Some(mh),
                resp,
            });
        }
        self.token(chan);
        Ok(mh)
    }

    /// LEAVE_MCAST: forget group `mh` and its unreported events; the
    /// number of its events reported so far.
    fn leave(&mut self, chan: RawFd, mh: u32) -> Result<u32, i32> {
        let id = self.mcs.get(&mh).ok_or(libc::ENOENT)?.id;
        self.id_on(chan, id)?;
        let m = self.mcs.remove(&mh).ok_or(libc::ENOENT)?;
        if let Some(c) = self.chans.get_mut(&chan) {
            c.events.retain(|e| e.mc != Some(mh));
        }
        self.withdraw_token(chan);
        Ok(m.reported)
    }

    fn resolve_route(&mut self, chan: RawFd, h: u32) -> Result<(), i32> {
        let id = self.id_on(chan, h)?;
        if id.state != St::AddrResolved && id.state != St::RouteResolved {
            return Err(libc::EINVAL);
        }
        id.route = true;
        id.state = St::RouteResolved;
        self.push(h, event::ROUTE_RESOLVED, 0, None);
        Ok(())
    }

    fn query_route(&mut self, chan: RawFd, h: u32) -> Result<abi::QueryRouteResp, i32> {
        let id = self.id_on(chan, h)?;
        let mut r = abi::QueryRouteResp::zeroed();
        r.ibdev_index = u32::MAX;
        addr::write(id.src.as_ref(), bytes_of_mut(&mut r.src_addr));
        addr::write(id.dst.as_ref(), bytes_of_mut(&mut r.dst_addr));
        if id.device {
            r.node_guid = NODE_GUID_BE;
            r.port_num = 1;
            let p = &mut r.ib_route[0];
            p.sgid = GID;
            p.dgid = GID;
            p.pkey = 0xffff_u16.to_be();
            if id.route {
                r.num_paths = 1;
                p.dlid = 1u16.to_be();
                p.slid = 1u16.to_be();
                p.reversible = 1;
                p.mtu = 5;
                p.traffic_class = id.tos;
                p.numb_path = 1;
                p.mtu_selector = 2;
                p.rate_selector = 2;
                p.rate = 16;
                p.packet_life_time_selector = 2;
                p.packet_life_time = PACKET_LIFE_TIME;
            }
        }
        Ok(r)
    }

    fn listen(&mut self, chan: RawFd, h: u32, backlog: u32) -> Result<(), i32> {
        let st = self.id_on(chan, h)?.state;
        match st {
            St::Idle => self.bind(chan, h, "0.0.0.0:0".parse().map_err(|_| libc::EINVAL)?)?,
            St::Bound | St::Listen => {}
            _ => return Err(libc::EINVAL),
        }
        let ep = self.epoll.as_raw_fd();
        let id = self.id_on(chan, h)?;
        let s = id.reserve.as_ref().ok_or(libc::EINVAL)?.as_raw_fd();
        let bl = backlog.clamp(1, 4096) as i32;
        // SAFETY: `s` is the id's bound socket.
        if unsafe { libc::listen(s, bl) } != 0 {
            return Err(errno());
        }
        if id.state != St::Listen {
            id.state = St::Listen;
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: key(K_LISTEN, u64::from(h)),
            };
            // SAFETY: valid epoll and socket descriptors.
            if unsafe { libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, s, &mut ev) } != 0 {
                return Err(errno());
            }
        }
        Ok(())
    }

    fn connect(&mut self, chan: RawFd, h: u32, c: &abi::Connect) -> Result<(), i32> {
        let id = self.id_on(chan, h)?;
        if id.state != St::RouteResolved {
            return Err(libc::EINVAL);
        }
        let max = req_pdata(id.ps, id.qp_type);
        if usize::from(c.conn_param.private_data_len) > max {
            return Err(libc::EINVAL);
        }
        let (Some(src), Some(dst)) = (id.src, id.dst) else {
            return Err(libc::EINVAL);
        };
        let ps = id.ps;
        id.mine = params_from(&c.conn_param, id.local_psn);
        if is_ud(id.qp_type) {
            id.mine.qkey = UDP_QKEY;
        }
        id.mine.ece_vendor = c.ece.vendor_id;
        id.mine.ece_attr = c.ece.attr_mod;
        let sock = addr::candidates(ps, dst)
            .iter()
            .find_map(|n| connect_name(n).ok());
        let Some(sock) = sock else {
            // Nobody listens there: the passive side's CM rejects the
            // unknown service ID.
            self.push(
                h,
                event::REJECTED,
                i32::from(REJ_INVALID_SERVICE_ID),
                Some(conn_param(&Params::default(), REJ_PDATA)),
            );
            return Ok(());
        };
        let id = self.id_on(chan, h)?;
        let req = Msg::Req {
            src,
            dst,
            ps,
            params: id.mine.clone(),
        };
        if !send_msg(&sock, &req) {
            return Err(libc::ENOMEM);
        }
        epoll_add(
            &self.epoll,
            sock.as_raw_fd(),
            key(K_CONN, u64::from(h)),
            libc::EPOLLIN as u32,
        )
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
        let id = self.id_on(chan, h)?;
        id.conn = Some(sock);
        id.mra = false;
        id.acked = false;
        id.state = St::ReqSent;
        self.set_deadline(h, Some((Instant::now() + cm_timeout(), Timer::Response)));
        Ok(())
    }

    fn accept(&mut self, chan: RawFd, c: &abi::Accept) -> Result<(), i32> {
        let h = c.id;
        let id = self.id_on(chan, h)?;
        match id.state {
            // The active side's librdmacm confirms the REP: send RTU.
            St::RepRcvd => {
                let ok = id.conn.as_ref().is_some_and(|s| send_msg(s, &Msg::Rtu));
                if !ok {
                    return Err(libc::EINVAL);
                }
                id.state = St::Established;
                Ok(())
            }
            St::ReqRcvd => {
                if id.conn.is_none() {
                    return Err(libc::EINVAL);
                }
                let ud = is_ud(id.qp_type);
                let max = if ud { SIDR_REP_PDATA } else { REP_PDATA };
                if usize::from(c.conn_param.private_data_len) > max {
                    return Err(libc::EINVAL);
                }
                if c.uid != 0 {
                    id.uid = c.uid;
                }
                id.mine = params_from(&c.conn_param, id.local_psn);
                if ud {
                    // SIDR: the reply names our QP and Q_Key; no RTU, no
                    // event on this side, nothing left to tear down.
                    id.mine.qkey = UDP_QKEY;
                    let rep = Msg::Rep(id.mine.clone());
                    let ok = id.conn.as_ref().is_some_and(|s| send_msg(s, &rep));
                    if !ok {
                        return Err(libc::EINVAL);
                    }
                    id.state = St::Done;
                    self.close_conn(h);
                    return Ok(());
                }
                id.mine.ece_vendor = c.ece.vendor_id;
                id.mine.ece_attr = c.ece.attr_mod;
                let rep = Msg::Rep(id.mine.clone());
                let ok = id.conn.as_ref().is_some_and(|s| send_msg(s, &rep));
                if !ok {
                    return Err(libc::EINVAL);
                }
                id.state = St::RepSent;
                self.set_deadline(h, Some((Instant::now() + cm_timeout(), Timer::Response)));
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    fn reject(&mut self, chan: RawFd, c: &abi::Reject) -> Result<(), i32> {
        let id = self.id_on(chan, c.id)?;
        if !matches!(id.state, St::ReqRcvd | St::RepRcvd) || id.conn.is_none() {
            return Err(libc::EINVAL);
        }
        let n = usize::from(c.private_data_len);
        if n > REJ_PDATA {
            return Err(libc::EINVAL);
        }
        let reason = if c.reason == 0 {
            REJ_CONSUMER_DEFINED
        } else {
            u16::from(c.reason)
        };
        let m = Msg::Rej {
            reason,
            pdata: c.private_data[..n].to_vec(),
        };
        if let Some(s) = id.conn.take() {
            send_msg(&s, &m);
            epoll_del(&self.epoll, s.as_raw_fd());
        }
        let id = self.id_on(chan, c.id)?;
        id.state = St::Done;
        id.deadline = None;
        Ok(())
    }

    fn disconnect(&mut self, chan: RawFd, h: u32) -> Result<(), i32> {
        let id = self.id_on(chan, h)?;
        match id.state {
            St::Established | St::RepSent | St::RepRcvd => {
                let ok = id.conn.as_ref().is_some_and(|s| send_msg(s, &Msg::Dreq));
                if !ok {
                    // The peer is gone: disconnected at once.
                    id.state = St::TimeWait;
                    self.push(h, event::DISCONNECTED, 0, Some(abi::ConnParam::zeroed()));
                    self.set_deadline(h, Some((Instant::now() + TIMEWAIT, Timer::TimeWait)));
                    return Ok(());
                }
                id.state = St::DreqSent;
                self.set_deadline(h, Some((Instant::now() + cm_timeout(), Timer::Response)));
                Ok(())
            }
            St::DreqRcvd => {
                if let Some(s) = &id.conn {
                    send_msg(s, &Msg::Drep);
                }
                id.state = St::TimeWait;
                self.set_deadline(h, Some((Instant::now() + TIMEWAIT, Timer::TimeWait)));
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    fn init_qp_attr(&mut self, chan: RawFd, h: u32, state: u32) -> Result<abi::KernQpAttr, i32> {
        use rdma_sys::ibv_qp_attr_mask as m;
        let id = self.id_on(chan, h)?;
        if !id.device {
            return Err(libc::EINVAL);
        }
        let ud = is_ud(id.qp_type);
        let mut a = abi::KernQpAttr {
            qp_state: state,
            ..Default::default()
        };
        let mut mask = m::IBV_QP_STATE.0;
        match state {
            // INIT
            1 => {
                a.pkey_index = 0;
                a.port_num = 1;
                mask |= m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0;
                if ud {
                    a.qkey = UDP_QKEY;
                    mask |= m::IBV_QP_QKEY.0;
                } else {
                    // Before a connection exists the QP gets no remote
                    // access; with one, what the CM grants (write, read,
                    // atomics: the responder resources are negotiated).
                    if id.peer.is_some() {
                        a.qp_access_flags = rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                            | rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0
                            | rdma_sys::ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;
                    }
                    mask |= m::IBV_QP_ACCESS_FLAGS.0;
                }
            }
            // RTR
            2 => {
                if !ud {
                    let p = id.peer.as_ref().ok_or(libc::EINVAL)?;
                    a.path_mtu = 5;
                    a.dest_qp_num = p.qpn;
                    a.rq_psn = p.psn;
                    a.max_dest_rd_atomic = p.initiator_depth;
                    a.min_rnr_timer = 0;
                    a.ah_attr.dlid = 1;
                    a.ah_attr.port_num = 1;
                    a.ah_attr.sl = 0;
                    mask |= m::IBV_QP_AV.0
                        | m::IBV_QP_PATH_MTU.0
                        | m::IBV_QP_DEST_QPN.0
                        | m::IBV_QP_RQ_PSN.0
                        | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                        | m::IBV_QP_MIN_RNR_TIMER.0;
                }
            }
            // RTS
            3 => {
                a.sq_psn = id.local_psn;
                mask |= m::IBV_QP_SQ_PSN.0;
                if !ud {
                    let p = id.peer.as_ref().ok_or(libc::EINVAL)?;
                    let passive = matches!(id.state, St::ReqRcvd | St::RepSent);
                    a.timeout = id.ack_timeout.unwrap_or(PACKET_LIFE_TIME + 1);
                    // The retry count is the requester's (REQ), the RNR
                    // retry count the other side's.
                    a.retry_cnt = if passive {
                        p.retry_count
                    } else {
                        id.mine.retry_count
                    }
                    .min(7);
                    a.rnr_retry = p.rnr_retry_count.min(7);
                    a.max_rd_atomic = p.responder_resources;
                    mask |= m::IBV_QP_TIMEOUT.0
                        | m::IBV_QP_RETRY_CNT.0
                        | m::IBV_QP_RNR_RETRY.0
                        | m::IBV_QP_MAX_QP_RD_ATOMIC.0;
                }
            }
            _ => return Err(libc::EINVAL),
        }
        a.qp_attr_mask = mask;
        Ok(a)
    }

    fn migrate(&mut self, new_chan: RawFd, h: u32, old_fd: RawFd) -> Result<u32, i32> {
        let id = self.ids.get_mut(&h).ok_or(libc::EINVAL)?;
        if id.chan != old_fd {
            return Err(libc::EINVAL);
        }
        let reported = id.reported;
        id.chan = new_chan;
        let moved: Vec<Ev> = match self.chans.get_mut(&old_fd) {
            Some(c) => {
                let (mv, keep): (VecDeque<Ev>, VecDeque<Ev>) =
                    c.events.drain(..).partition(|e| e.owner == h);
                c.events = keep;
                mv.into_iter().collect()
            }
            None => Vec::new(),
        };
        self.withdraw_token(old_fd);
        if let Some(c) = self.chans.get_mut(&new_chan) {
            c.events.extend(moved);
        }
        self.token(new_chan);
        Ok(reported)
    }

    /// Pop the next event of `chan`, counting it as reported.
    fn pop_event(&mut self, chan: RawFd) -> Option<abi::EventResp> {
        let c = self.chans.get_mut(&chan)?;
        c.token = false;
        let ev = c.events.pop_front()?;
        if let Some(id) = self.ids.get_mut(&ev.owner) {
            id.reported += 1;
        }
        if let Some(m) = ev.mc.and_then(|m| self.mcs.get_mut(&m)) {
            m.reported += 1;
        }
        self.token(chan);
        Some(ev.resp)
    }

    // ----- the CM thread's side -----

    /// A message or the end of the connection socket of id `h`.
    fn on_conn(&mut self, h: u32, r: Recv) {
        let Some(id) = self.ids.get_mut(&h) else {
            return;
        };
        let st = id.state;
        match r {
            Recv::Nothing => {}
            Recv::Msg(Msg::Mra) if st == St::ReqSent => {
                id.mra = true;
                id.acked = true;
            }
            // The requester's CM asks again while our application has not
            // answered: acknowledged at once, as the first copy was.
            Recv::Msg(Msg::Req { .. }) if st == St::ReqRcvd => {
                if let Some(s) = &id.conn {
                    send_msg(s, &Msg::Mra);
                }
            }
            Recv::Msg(Msg::Rep(p)) if st == St::ReqSent && is_ud(id.qp_type) => {
                let up = ud_param(&p, SIDR_REP_PDATA);
                id.peer = Some(p);
                id.state = St::Done;
                id.deadline = None;
                self.close_conn(h);
                self.push_ud(h, event::ESTABLISHED, 0, up);
            }
            Recv::Msg(Msg::Rep(p)) if st == St::ReqSent => {
                let cp = conn_param(&p, REP_PDATA);
                id.peer = Some(p);
                id.state = St::RepRcvd;
                // Our CM got the REP: acknowledge it while the application
                // takes its time to confirm.
                if let Some(s) = &id.conn {
                    send_msg(s, &Msg::Mra);
                }
                id.deadline = None;
                self.push(h, event::CONNECT_RESPONSE, 0, Some(cp));
            }
            Recv::Msg(Msg::Rej { reason, pdata })
                if matches!(st, St::ReqSent | St::RepSent | St::RepRcvd) =>
            {
                self.close_conn(h);
                let p = Params {
                    pdata,
                    ..Default::default()
                };
                self.finish(
                    h,
                    st,
                    event::REJECTED,
                    i32::from(reason),
                    Some(conn_param(&p, REJ_PDATA)),
                );
            }
            Recv::Msg(Msg::Rtu) if st == St::RepSent => {
                id.state = St::Established;
                id.deadline = None;
                self.push(h, event::ESTABLISHED, 0, Some(abi::ConnParam::zeroed()));
            }
            Recv::Msg(Msg::Dreq) => match st {
                St::Established | St::RepSent | St::RepRcvd => {
                    id.state = St::DreqRcvd;
                    id.deadline = None;
                    self.push(h, event::DISCONNECTED, 0, Some(abi::ConnParam::zeroed()));
                }
                // Both sides asked at once: each answers the other.
                St::DreqSent => {
                    if let Some(s) = &id.conn {
                        send_msg(s, &Msg::Drep);
                    }
                }
                _ => {}
            },
            Recv::Msg(Msg::Drep) if st == St::DreqSent => {
                id.state = St::TimeWait;
                self.push(h, event::DISCONNECTED, 0, Some(abi::ConnParam::zeroed()));
                self.set_deadline(h, Some((Instant::now() + TIMEWAIT, Timer::TimeWait)));
            }
            // Out of place (a REQ on a connection, a late message): ignored.
            Recv::Msg(_) => {}
            Recv::Gone => {
                let mra = id.mra;
                self.close_conn(h);
                self.peer_gone(h, st, mra);
            }
        }
    }

    fn close_conn(&mut self, h: u32) {
        if let Some(id) = self.ids.get_mut(&h) {
            if let Some(s) = id.conn.take() {
                epoll_del(&self.epoll, s.as_raw_fd());
            }
        }
    }

    /// End a connection attempt with `ev` (REJECTED, UNREACHABLE).
    fn finish(&mut self, h: u32, st: St, ev: u32, status: i32, p: Option<abi::ConnParam>) {
        if let Some(id) = self.ids.get_mut(&h) {
            id.deadline = None;
            // An active id may connect again from ROUTE_RESOLVED.
            id.state = if st == St::ReqSent {
                St::RouteResolved
            } else {
                St::Done
            };
            if st == St::ReqSent || st == St::RepRcvd {
                id.peer = None;
            }
        }
        self.push(h, ev, status, p);
    }

    /// The peer's side of the connection was destroyed (destroy_id, closed
    /// channel, dead process): what its CM would have sent, by our state.
    fn peer_gone(&mut self, h: u32, st: St, mra: bool) {
        let rej = |r: u16| Some((event::REJECTED, i32::from(r)));
        let what = match st {
            // The request never reached a live listener: unknown service.
            St::ReqSent if !mra => rej(REJ_INVALID_SERVICE_ID),
            St::ReqSent | St::RepSent | St::RepRcvd => rej(REJ_CONSUMER_DEFINED),
            // The requester gave up before we answered (reported with the
            // id's uid, 0 until accepted: librdmacm drops it; ACCEPT then
            // fails with EINVAL as the kernel's does).
            St::ReqRcvd => rej(REJ_TIMEOUT),
            St::Established => {
                if let Some(id) = self.ids.get_mut(&h) {
                    id.state = St::DreqRcvd;
                }
                self.push(h, event::DISCONNECTED, 0, Some(abi::ConnParam::zeroed()));
                return;
            }
            St::DreqSent => {
                if let Some(id) = self.ids.get_mut(&h) {
                    id.state = St::TimeWait;
                }
                self.push(h, event::DISCONNECTED, 0, Some(abi::ConnParam::zeroed()));
                self.set_deadline(h, Some((Instant::now() + TIMEWAIT, Timer::TimeWait)));
                return;
            }
            _ => None,
        };
        if let Some((ev, status)) = what {
            self.finish(
                h,
                st,
                ev,
                status,
                Some(conn_param(&Params::default(), REJ_PDATA)),
            );
        }
    }

    fn on_timer(&mut self, h: u32, t: Timer) {
        let Some(id) = self.ids.get_mut(&h) else {
            return;
        };
        id.deadline = None;
        let st = id.state;
        match (t, st) {
            (Timer::TimeWait, St::TimeWait) => {
                id.state = St::Done;
                self.close_conn(h);
                self.push(h, event::TIMEWAIT_EXIT, 0, None);
            }
            // The peer's CM acknowledged the REQ, its application has not
            // answered yet: ask again, as the InfiniBand CM repeats a REQ.
            // A CM that runs acknowledges the copy at once; one that has
            // stopped since (a process stopped after its MRA) leaves it
            // unanswered, and the next round gives up.
            (Timer::Response, St::ReqSent) if id.acked => {
                id.acked = false;
                if let (Some(src), Some(dst), Some(s)) = (id.src, id.dst, id.conn.as_ref()) {
                    let req = Msg::Req {
                        src,
                        dst,
                        ps: id.ps,
                        params: id.mine.clone(),
                    };
                    send_msg(s, &req);
                }
                id.deadline = Some((Instant::now() + cm_timeout(), Timer::Response));
            }
            // The peer's CM did not answer the REQ (or its latest copy).
            (Timer::Response, St::ReqSent) => {
                self.close_conn(h);
                self.finish(h, st, event::UNREACHABLE, -libc::ETIMEDOUT, None);
            }
            (Timer::Response, St::RepSent) => {
                self.close_conn(h);
                self.finish(h, st, event::UNREACHABLE, -libc::ETIMEDOUT, None);
            }
            (Timer::Response, St::DreqSent) => {
                if let Some(id) = self.ids.get_mut(&h) {
                    id.state = St::TimeWait;
                }
                self.push(h, event::DISCONNECTED, 0, Some(abi::ConnParam::zeroed()));
                self.set_deadline(h, Some((Instant::now() + TIMEWAIT, Timer::TimeWait)));
            }
            _ => {}
        }
    }

    fn on_listen(&mut self, h: u32) {
        let Some(s) = self.ids.get(&h).and_then(|i| i.reserve.as_ref()) else {
            return;
        };
        let ls = s.as_raw_fd();
        loop {
            // SAFETY: accepting on our listening socket.
            let r = unsafe {
                libc::accept4(
                    ls,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            let Ok(fd) = new_fd(r) else { break };
            if peer::same_user(&fd).is_err() {
                // A process of another uid (step 1 of `peer`): closed unread.
                continue;
            }
            let serial = self.next_serial;
            self.next_serial += 1;
            if epoll_add(
                &self.epoll,
                fd.as_raw_fd(),
                key(K_PENDING, serial),
                libc::EPOLLIN as u32,
            )
            .is_ok()
            {
                self.pending.insert(serial, (h, fd));
            }
        }
    }

    fn on_pending(&mut self, serial: u64) {
        let Some((lh, fd)) = self.pending.remove(&serial) else {
            return;
        };
        match recv_msg(fd.as_raw_fd()) {
            Recv::Nothing => {
                self.pending.insert(serial, (lh, fd));
            }
            Recv::Msg(Msg::Req {
                src,
                dst,
                ps,
                params,
            }) => {
                epoll_del(&self.epoll, fd.as_raw_fd());
                let Some(l) = self.ids.get(&lh) else { return };
                if l.state != St::Listen || l.ps != ps {
                    return; // dropped: the requester sees an unknown service
                }
                let (chan, luid, qp_type) = (l.chan, l.uid, l.qp_type);
                let nh = self.next_handle;
                self.next_handle = self.next_handle.wrapping_add(1).max(1);
                let mut id = Id::new(chan, 0, ps, qp_type);
                id.state = St::ReqRcvd;
                id.src = Some(dst);
                id.dst = Some(src);
                id.device = true;
                id.route = true;
                // The passive side's view: its responder resources are the
                // requester's initiator depth and the other way round.
                let mut cp = conn_param(&params, req_pdata(ps, qp_type));
                cp.responder_resources = params.initiator_depth;
                cp.initiator_depth = params.responder_resources;
                let param = if is_ud(qp_type) {
                    abi::EventParam {
                        ud: ud_param(&params, SIDR_REQ_PDATA),
                    }
                } else {
                    abi::EventParam { conn: cp }
                };
                let ece = abi::Ece {
                    vendor_id: params.ece_vendor,
                    attr_mod: params.ece_attr,
                };
                id.peer = Some(params);
                send_msg(&fd, &Msg::Mra);
                if epoll_add(
                    &self.epoll,
                    fd.as_raw_fd(),
                    key(K_CONN, u64::from(nh)),
                    libc::EPOLLIN as u32,
                )
                .is_err()
                {
                    return;
                }
                id.conn = Some(fd);
                self.ids.insert(nh, id);
                let mut resp = abi::EventResp {
                    uid: luid,
                    id: nh,
                    event: event::CONNECT_REQUEST,
                    status: 0,
                    param,
                    reserved: 0,
                    ece,
                };
                resp.ece = ece;
                if let Some(c) = self.chans.get_mut(&chan) {
                    c.events.push_back(Ev {
                        owner: lh,
                        new_id: Some(nh),
                        mc: None,
                        resp,
                    });
                }
                self.token(chan);
            }
            // Anything else first, or nothing at all: drop the socket.
            _ => epoll_del(&self.epoll, fd.as_raw_fd()),
        }
    }

    /// The application closed channel `chan` (its pty master): destroy its
    /// ids, as closing the kernel's file does.
    fn close_chan(&mut self, chan: RawFd) {
        let hs: Vec<u32> = self
            .ids
            .iter()
            .filter(|(_, i)| i.chan == chan)
            .map(|(h, _)| *h)
            .collect();
        for h in hs {
            self.remove_id(h);
        }
        if let Some(c) = self.chans.remove(&chan) {
            epoll_del(&self.epoll, c.slave.as_raw_fd());
            super::mark(chan, false);
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.ids
            .values()
            .filter_map(|i| i.deadline.map(|d| d.0))
            .min()
    }
}

fn bytes_of_mut(a: &mut libc::sockaddr_in6) -> &mut [u8] {
    // SAFETY: sockaddr_in6 is 28 bytes of plain data; the slice borrows it.
    unsafe { std::slice::from_raw_parts_mut((a as *mut libc::sockaddr_in6).cast::<u8>(), 28) }
}

fn bytes_of(a: &libc::sockaddr_in6) -> &[u8] {
    // SAFETY: as above, shared.
    unsafe { std::slice::from_raw_parts((a as *const libc::sockaddr_in6).cast::<u8>(), 28) }
}

fn cm() -> Option<&'static Mutex<Cm>> {
    static CM: OnceLock<Option<Mutex<Cm>>> = OnceLock::new();
    CM.get_or_init(|| {
        let c = Cm::new().ok()?;
        let ep = c.epoll.as_raw_fd();
        std::thread::Builder::new()
            .name("softverbs-cm".into())
            .spawn(move || cm_thread(ep))
            .ok()?;
        Some(Mutex::new(c))
    })
    .as_ref()
}

fn lock() -> Option<MutexGuard<'static, Cm>> {
    cm().map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
}

fn cm_thread(ep: RawFd) {
    let mut evs = [libc::epoll_event { events: 0, u64: 0 }; 32];
    loop {
        let timeout = lock().and_then(|g| g.next_deadline()).map_or(-1, |d| {
            let ms = d.saturating_duration_since(Instant::now()).as_millis();
            (ms.min(60_000) as i32) + 1
        });
        // SAFETY: `evs` is a writable array of its length; `ep` lives as
        // long as the process (the Cm is never dropped).
        let n = unsafe { libc::epoll_wait(ep, evs.as_mut_ptr(), evs.len() as i32, timeout) };
        let Some(mut g) = lock() else { return };
        for e in evs.iter().take(n.max(0) as usize) {
            let k = e.u64;
            let v = k & ((1 << 56) - 1);
            match k >> 56 {
                K_WAKE => {
                    let mut b = 0u64;
                    // SAFETY: draining our eventfd into `b`.
                    unsafe { libc::read(g.wake.as_raw_fd(), (&mut b as *mut u64).cast(), 8) };
                }
                K_LISTEN => g.on_listen(v as u32),
                K_PENDING => g.on_pending(v),
                K_CONN => {
                    let h = v as u32;
                    // Every queued message, then the end if there is one.
                    for _ in 0..64 {
                        let Some(fd) = g
                            .ids
                            .get(&h)
                            .and_then(|i| i.conn.as_ref())
                            .map(|s| s.as_raw_fd())
                        else {
                            break;
                        };
                        let r = recv_msg(fd);
                        let stop = matches!(r, Recv::Nothing | Recv::Gone);
                        g.on_conn(h, r);
                        if stop {
                            break;
                        }
                    }
                }
                K_CHAN => {
                    let chan = g
                        .chans
                        .iter()
                        .find(|(_, c)| c.serial == v)
                        .map(|(fd, _)| *fd);
                    if let Some(chan) = chan {
                        g.close_chan(chan);
                    }
                }
                _ => {}
            }
        }
        let now = Instant::now();
        let due: Vec<(u32, Timer)> = g
            .ids
            .iter()
            .filter_map(|(h, i)| i.deadline.filter(|d| d.0 <= now).map(|d| (*h, d.1)))
            .collect();
        for (h, t) in due {
            g.on_timer(h, t);
        }
    }
}

/// The pty number of master `fd`, or None if it is not a pty master.
fn ptn(fd: RawFd) -> Option<u32> {
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes one unsigned int.
    let r = unsafe { libc::ioctl(fd, libc::TIOCGPTN, &mut n) };
    (r == 0).then_some(n)
}

/// Open a new event channel: a pty whose master the application gets (a
/// character device, pollable, readable while events are pending) and
/// whose slave this CM keeps to signal it.
pub(super) fn open_channel() -> Result<RawFd, i32> {
    let mut g = lock().ok_or(libc::ENOMEM)?;
    let mut master: libc::c_int = -1;
    let mut slave: libc::c_int = -1;
    // SAFETY: openpty writes two descriptors; no name, termios or size.
    let r = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    if r != 0 {
        return Err(errno());
    }
    // SAFETY: openpty returned these two descriptors to us.
    let slave = unsafe { OwnedFd::from_raw_fd(slave) };
    // SAFETY: termios is plain data; filled by tcgetattr before use.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: valid descriptors and termios buffer; raw mode so the token
    // bytes pass unchanged; close-on-exec as librdmacm asks.
    unsafe {
        libc::tcgetattr(slave.as_raw_fd(), &mut t);
        libc::cfmakeraw(&mut t);
        libc::tcsetattr(slave.as_raw_fd(), libc::TCSANOW, &t);
        libc::fcntl(master, libc::F_SETFD, libc::FD_CLOEXEC);
        libc::fcntl(slave.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC);
        let fl = libc::fcntl(slave.as_raw_fd(), libc::F_GETFL);
        libc::fcntl(slave.as_raw_fd(), libc::F_SETFL, fl | libc::O_NONBLOCK);
    }
    let Some(n) = ptn(master) else {
        // SAFETY: closing the master we just opened.
        unsafe { libc::close(master) };
        return Err(libc::ENOTTY);
    };
    // A stale channel at this number (closed, its hang-up not yet seen).
    if g.chans.contains_key(&master) {
        g.close_chan(master);
    }
    let serial = g.next_serial;
    g.next_serial += 1;
    // Hang-up of the slave = the application closed the master.
    if epoll_add(&g.epoll, slave.as_raw_fd(), key(K_CHAN, serial), 0).is_err() {
        // SAFETY: closing the master we just opened.
        unsafe { libc::close(master) };
        return Err(libc::ENOMEM);
    }
    g.chans.insert(
        master,
        Chan {
            serial,
            ptn: n,
            slave,
            events: VecDeque::new(),
            token: false,
        },
    );
    Ok(master)
}

/// A channel held for one command, as the kernel's `write(2)` holds the
/// file from its entry until it returns: a duplicate of the application's
/// descriptor `fd`, taken before anything else (a lock may make the
/// command wait, and the application may close `fd` meanwhile), and the
/// serial of the channel it is. A `GET_EVENT` waits on the duplicate.
pub(super) struct Held {
    fd: RawFd,
    dup: OwnedFd,
    serial: u64,
}

/// Why [`hold`] did not hold a channel.
pub(super) enum NotHeld {
    /// The duplicate failed (`fd` is closed: EBADF, as from the kernel).
    Errno(i32),
    /// `fd` names another file now: the channel that had the number was
    /// closed, and the caller forgets it.
    Other,
}

/// Hold channel `fd` for a command (see [`Held`]).
pub(super) fn hold(fd: RawFd) -> Result<Held, NotHeld> {
    // SAFETY: F_DUPFD_CLOEXEC takes no pointer; the result is checked.
    let d = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if d < 0 {
        return Err(NotHeld::Errno(errno()));
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    let dup = unsafe { OwnedFd::from_raw_fd(d) };
    let Some(g) = lock() else {
        return Err(NotHeld::Errno(libc::ENOMEM));
    };
    // The file duplicated is the channel registered under `fd`, not a
    // descriptor that took the number after the channel was closed: the
    // pty number names the file.
    match g.chans.get(&fd) {
        Some(c) if ptn(dup.as_raw_fd()) == Some(c.ptn) => Ok(Held {
            fd,
            dup,
            serial: c.serial,
        }),
        _ => Err(NotHeld::Other),
    }
}

/// Forget channel `fd` (closed; its number now names something else).
pub(super) fn forget_channel(fd: RawFd) {
    if let Some(mut g) = lock() {
        g.close_chan(fd);
    }
}

/// Execute one command written to the channel `held`: the command header
/// and its input (`buf`, `len` bytes). Returns `len` or a negative errno.
pub(super) fn command(held: &Held, buf: usize, len: usize) -> isize {
    match command_inner(held, buf, len) {
        Ok(()) => len as isize,
        Err(e) => -(e as isize),
    }
}

fn command_inner(held: &Held, buf: usize, len: usize) -> Result<(), i32> {
    let fd = held.fd;
    let hdr_len = std::mem::size_of::<abi::CmdHdr>();
    if len < hdr_len {
        return Err(libc::EINVAL);
    }
    let hdr: abi::CmdHdr = read_user(buf, hdr_len)?;
    if usize::from(hdr.in_) + hdr_len > len {
        return Err(libc::EINVAL);
    }
    let inp = buf + hdr_len;
    let n = usize::from(hdr.in_);
    if hdr.cmd == cmd::GET_EVENT {
        let c: abi::GetEvent = read_user(inp, n)?;
        return get_event(held, c.response, hdr.out);
    }
    let mut g = lock().ok_or(libc::ENOMEM)?;
    match hdr.cmd {
        cmd::CREATE_ID => {
            let c: abi::CreateId = read_user(inp, n)?;
            let h = g.create_id(fd, &c)?;
            if let Err(e) = write_user(c.response, hdr.out, &abi::CreateIdResp { id: h }) {
                g.remove_id(h);
                return Err(e);
            }
            Ok(())
        }
        cmd::DESTROY_ID => {
            let c: abi::DestroyId = read_user(inp, n)?;
            g.id_on(fd, c.id)?;
            let id = g.remove_id(c.id).ok_or(libc::EINVAL)?;
            write_user(
                c.response,
                hdr.out,
                &abi::EventsReported {
                    events_reported: id.reported,
                },
            )
        }
        cmd::BIND_IP => {
            let c: abi::BindIp = read_user(inp, n)?;
            let a = addr::parse(bytes_of(&c.addr)).ok_or(libc::EAFNOSUPPORT)?;
            g.bind(fd, c.id, a)
        }
        cmd::BIND => {
            let c: abi::Bind = read_user(inp, n)?;
            let b = &c.addr.bytes[..usize::from(c.addr_size).min(128)];
            if addr::family(b) == addr::AF_IB {
                return Err(libc::EAFNOSUPPORT);
            }
            let a = addr::parse(b).ok_or(libc::EAFNOSUPPORT)?;
            g.bind(fd, c.id, a)
        }
        cmd::RESOLVE_IP => {
            let c: abi::ResolveIp = read_user(inp, n)?;
            let src = addr::parse(bytes_of(&c.src_addr));
            let dst = addr::parse(bytes_of(&c.dst_addr)).ok_or(libc::EAFNOSUPPORT)?;
            g.resolve_ip(fd, c.id, src, dst)
        }
        cmd::RESOLVE_ADDR => {
            let c: abi::ResolveAddr = read_user(inp, n)?;
            let src = addr::parse(&c.src_addr.bytes[..usize::from(c.src_size).min(128)]);
            let dst = addr::parse(&c.dst_addr.bytes[..usize::from(c.dst_size).min(128)])
                .ok_or(libc::EAFNOSUPPORT)?;
            g.resolve_ip(fd, c.id, src, dst)
        }
        cmd::RESOLVE_ROUTE => {
            let c: abi::ResolveRoute = read_user(inp, n)?;
            g.resolve_route(fd, c.id)
        }
        cmd::QUERY_ROUTE => {
            let c: abi::Query = read_user(inp, n)?;
            let r = g.query_route(fd, c.id)?;
            write_user(c.response, hdr.out, &r)
        }
        cmd::CONNECT => {
            let c: abi::Connect = read_user(inp, n)?;
            g.connect(fd, c.id, &c)
        }
        cmd::LISTEN => {
            let c: abi::Listen = read_user(inp, n)?;
            g.listen(fd, c.id, c.backlog)
        }
        cmd::ACCEPT => {
            let c: abi::Accept = read_user(inp, n)?;
            g.accept(fd, &c)
        }
        cmd::REJECT => {
            let c: abi::Reject = read_user(inp, n)?;
            g.reject(fd, &c)
        }
        cmd::DISCONNECT => {
            let c: abi::Disconnect = read_user(inp, n)?;
            g.disconnect(fd, c.id)
        }
        cmd::INIT_QP_ATTR => {
            let c: abi::InitQpAttr = read_user(inp, n)?;
            let a = g.init_qp_attr(fd, c.id, c.qp_state)?;
            write_user(c.response, hdr.out, &a)
        }
        cmd::NOTIFY => {
            let c: abi::Notify = read_user(inp, n)?;
            g.id_on(fd, c.id).map(|_| ())
        }
        cmd::SET_OPTION => {
            let c: abi::SetOption = read_user(inp, n)?;
            let id = g.id_on(fd, c.id)?;
            match (c.level, c.optname) {
                // TOS: one byte of traffic class.
                (0, 0) => {
                    if c.optlen != 1 {
                        return Err(libc::EINVAL);
                    }
                    let v: [u8; 1] = read_user(c.optval as usize, 1)?;
                    id.tos = v[0];
                    Ok(())
                }
                // REUSEADDR, AFONLY: accepted (ports are per address and
                // port space; IPv6 wildcards take IPv4 too).
                (0, 1 | 2) => Ok(()),
                // ACK_TIMEOUT: one byte, 5 bits used.
                (0, 3) => {
                    if c.optlen != 1 {
                        return Err(libc::EINVAL);
                    }
                    let v: [u8; 1] = read_user(c.optval as usize, 1)?;
                    id.ack_timeout = Some(v[0].min(31));
                    Ok(())
                }
                // IB path records: the route is known.
                (1, 1) => {
                    if id.state == St::AddrResolved {
                        id.route = true;
                        id.state = St::RouteResolved;
                    }
                    Ok(())
                }
                _ => Err(libc::ENOSYS),
            }
        }
        cmd::MIGRATE_ID => {
            let c: abi::MigrateId = read_user(inp, n)?;
            let old = c.fd as RawFd;
            if !g.chans.contains_key(&old) {
                return Err(libc::EBADF);
            }
            let r = g.migrate(fd, c.id, old)?;
            write_user(
                c.response,
                hdr.out,
                &abi::EventsReported { events_reported: r },
            )
        }
        cmd::JOIN_IP_MCAST => {
            let c: abi::JoinIpMcast = read_user(inp, n)?;
            let a = addr::parse(bytes_of(&c.addr)).ok_or(libc::EAFNOSUPPORT)?;
            let mh = g.join(fd, c.id, c.uid, a, abi::join_flag::FULLMEMBER)?;
            join_answer(&mut g, fd, mh, c.response, hdr.out)
        }
        cmd::JOIN_MCAST => {
            let c: abi::JoinMcast = read_user(inp, n)?;
            let b = &c.addr.bytes[..usize::from(c.addr_size).min(128)];
            if addr::family(b) == addr::AF_IB {
                return Err(libc::EAFNOSUPPORT);
            }
            let a = addr::parse(b).ok_or(libc::EINVAL)?;
            let mh = g.join(fd, c.id, c.uid, a, c.join_flags)?;
            join_answer(&mut g, fd, mh, c.response, hdr.out)
        }
        cmd::LEAVE_MCAST => {
            let c: abi::DestroyId = read_user(inp, n)?;
            let r = g.leave(fd, c.id)?;
            write_user(
                c.response,
                hdr.out,
                &abi::EventsReported { events_reported: r },
            )
        }
        // The AF_IB queries are not offered.
        cmd::QUERY | cmd::GET_OPTION => Err(libc::ENOSYS),
        _ => Err(libc::EINVAL),
    }
}

/// Write a join's answer (the group's handle); a caller whose answer
/// cannot be written has not joined.
fn join_answer(g: &mut Cm, fd: RawFd, mh: u32, response: u64, out: u16) -> Result<(), i32> {
    if let Err(e) = write_user(response, out, &abi::CreateIdResp { id: mh }) {
        let _ = g.leave(fd, mh);
        return Err(e);
    }
    Ok(())
}

// SAFETY: a one-byte array: any bit pattern is valid.
unsafe impl Pod for [u8; 1] {}

/// `GET_EVENT` on the channel `held`: wait for its token byte (blocking or
/// EAGAIN as the application set the descriptor), then take its next
/// event.
///
/// The wait holds the channel, as the kernel's `write(2)` holds the file
/// for the whole command: it reads the duplicate [`hold`] took, and takes
/// events only from the channel it started on. A byte may wake it with no
/// event behind it (the event's id was destroyed after its byte was
/// written, as rping's main thread destroys its id while its CM thread
/// waits); it then waits again on the same file, even if another thread
/// closed the descriptor meanwhile — whose number it used to read again,
/// failing with EBADF (rping's client exited 255, docs/reliability.md
/// item 5), or reading whatever file took the number. While the duplicate
/// is open the channel stays open, as the kernel's file does: its ids live
/// on, and its next event ends the wait.
fn get_event(held: &Held, response: u64, out: u16) -> Result<(), i32> {
    if usize::from(out) < std::mem::size_of::<abi::EventResp>() {
        return Err(libc::ENOSPC);
    }
    let fd = held.fd;
    loop {
        let mut b = 0u8;
        // SAFETY: reading one byte from the channel's pty master (our
        // duplicate of it, open until the command returns).
        let r = unsafe { libc::read(held.dup.as_raw_fd(), (&mut b as *mut u8).cast(), 1) };
        if r < 0 {
            let e = errno();
            if e == libc::EINTR {
                return Err(libc::EINTR);
            }
            return Err(e);
        }
        if r == 0 {
            return Err(libc::EIO);
        }
        woken_hook(fd);
        let mut g = lock().ok_or(libc::ENOMEM)?;
        if g.chans.get(&fd).is_none_or(|c| c.serial != held.serial) {
            // The channel ended under us: the application closed its
            // descriptor, another file took the number, and the CM forgot
            // the channel (`forget_channel`, `open_channel`), destroying
            // its ids (the slave's end closed: a read finding no byte
            // fails with EIO instead). No event can come any more.
            return Err(libc::EBADF);
        }
        if let Some(ev) = g.pop_event(fd) {
            drop(g);
            return write_user(response, out, &ev);
        }
    }
}

/// A test-only hook: with `SOFTVERBS_TEST_CM_WAKE_WAITS_FOR_CLOSE=<name>`
/// in its environment (read once per process), a `GET_EVENT` of a thread
/// named `<name>` that took a byte waits, before it looks for the event,
/// until the application's descriptor `fd` is closed (at most 10 s), so
/// that a test can destroy the event's id and close the channel at exactly
/// that point (tests/rdma_cm.rs, `a_wait_holds_its_channel_across_a_close`).
/// Nothing else reads the variable.
fn woken_hook(fd: RawFd) {
    static NAME: OnceLock<Option<Vec<u8>>> = OnceLock::new();
    let Some(name) = NAME.get_or_init(|| {
        std::env::var_os("SOFTVERBS_TEST_CM_WAKE_WAITS_FOR_CLOSE")
            .map(|v| std::os::unix::ffi::OsStrExt::as_bytes(v.as_os_str()).to_vec())
    }) else {
        return;
    };
    let mut comm = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (NUL included) into
    // `comm`, which has 16.
    unsafe { libc::prctl(libc::PR_GET_NAME, comm.as_mut_ptr()) };
    if comm.split(|b| *b == 0).next() != Some(name.as_slice()) {
        return;
    }
    let end = Instant::now() + Duration::from_secs(10);
    // SAFETY: F_GETFD only asks whether `fd` is open; no memory is passed.
    while unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(1));
    }
}
