//! The rdma_cm (librdmacm) calls the connection helper ([`crate::cm`])
//! makes, each wrapped once with its invariant. Like `sys`, this is the
//! only place these functions are called.

use std::ffi::c_void;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ptr::NonNull;

use rdma_sys as r;

pub use r::{ibv_qp_attr, rdma_cm_id};

/// `enum rdma_cm_event_type` values the helper tells apart.
pub mod ev {
    pub use rdma_sys::rdma_cm_event_type::*;
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

fn check(ret: i32) -> Result<(), i32> {
    if ret == 0 {
        Ok(())
    } else {
        Err(last_errno())
    }
}

/// A `sockaddr_storage` holding `a`, and its length.
fn to_sockaddr(a: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    match a {
        SocketAddr::V4(v) => {
            // SAFETY: sockaddr_storage is large and aligned enough for a
            // sockaddr_in; we write through the cast pointer once.
            let sin = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>()
            };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = v.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(v.ip().octets());
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        }
        SocketAddr::V6(v) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe {
                &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>()
            };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = v.port().to_be();
            sin6.sin6_flowinfo = v.flowinfo();
            sin6.sin6_addr.s6_addr = v.ip().octets();
            sin6.sin6_scope_id = v.scope_id();
            (
                ss,
                std::mem::size_of::<libc::sockaddr_in6>() as libc::socklen_t,
            )
        }
    }
}

/// Read a `struct sockaddr` (IPv4 or IPv6) librdmacm owns.
///
/// # Safety
/// `sa` is null or points at a sockaddr of its family's size.
unsafe fn from_sockaddr(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's contract: a readable sockaddr.
    match i32::from(unsafe { (*sa).sa_family }) {
        libc::AF_INET => {
            // SAFETY: the family says sockaddr_in.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in>() };
            let ip = Ipv4Addr::from(s.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(s.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says sockaddr_in6.
            let s = unsafe { &*sa.cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(s.sin6_addr.s6_addr),
                u16::from_be(s.sin6_port),
                s.sin6_flowinfo,
                s.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// An rdma_cm event channel (its descriptor is made non-blocking).
#[derive(Debug)]
pub struct EventChannel(NonNull<r::rdma_event_channel>);

// SAFETY: the channel is a descriptor and a heap object of librdmacm's,
// usable from any thread; `get_event` is called by one thread only (the
// helper's CM thread).
unsafe impl Send for EventChannel {}
// SAFETY: as above; the id calls that name the channel are thread-safe in
// librdmacm (each is one command on the descriptor).
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub fn new() -> Result<EventChannel, i32> {
        // librdmacm initialises itself in the first call that needs it
        // (`ucma_init`, here): it publishes its device count, then probes
        // AF_IB support by setting a process-wide flag to 1, binding, and
        // setting the flag to the answer. A thread that passes the
        // published count in that window and binds sees the flag at 1 and
        // takes the AF_IB bind path, whose address query a device without
        // it answers with ENOSYS (seen as `rdma_bind_addr` failing with
        // errno 38 on softverbs, once in a few runs of tests/cm.rs). Every
        // bind follows its channel's creation, so channels are made one at
        // a time: none before the first one's initialisation has finished.
        static CREATE: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let guard = CREATE.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: no arguments; returns null with errno on failure.
        let c = unsafe { r::rdma_create_event_channel() };
        // errno read before the unlock, which may make a system call.
        let c = NonNull::new(c).ok_or_else(last_errno);
        drop(guard);
        let c = c?;
        // SAFETY: `c` is a live channel; its fd field is its descriptor.
        let fd = unsafe { (*c.as_ptr()).fd };
        // SAFETY: plain fcntl on the channel's descriptor.
        unsafe {
            let fl = libc::fcntl(fd, libc::F_GETFL);
            libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
        }
        Ok(EventChannel(c))
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: the channel is live while `self` is.
        unsafe { (*self.0.as_ptr()).fd }
    }

    /// A new RC id (port space TCP) on this channel, with a fresh key in
    /// its context ([`id::key`]).
    pub fn create_id(&self) -> Result<NonNull<rdma_cm_id>, i32> {
        let mut id = std::ptr::null_mut();
        // SAFETY: live channel; `id` receives the new id; the context is a
        // number, never dereferenced.
        check(unsafe {
            r::rdma_create_id(
                self.0.as_ptr(),
                &mut id,
                fresh_key() as *mut c_void,
                r::rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        NonNull::new(id).ok_or(libc::ENOMEM)
    }

    /// The next event, copied out and acknowledged; `Ok(None)` when none
    /// is pending.
    pub fn get_event(&self) -> Result<Option<Event>, i32> {
        let mut e = std::ptr::null_mut();
        // SAFETY: live channel; `e` receives an event we ack below.
        if unsafe { r::rdma_get_cm_event(self.0.as_ptr(), &mut e) } != 0 {
            let err = last_errno();
            return if err == libc::EAGAIN || err == libc::EWOULDBLOCK {
                Ok(None)
            } else {
                Err(err)
            };
        }
        // SAFETY: `e` is the event librdmacm just returned; everything we
        // keep is copied before the ack frees it. Its ids are live until the
        // ack (rdma_destroy_id waits for it); a request's new id is known to
        // nobody else yet, so writing its context races with nothing.
        let out = unsafe {
            let ev = &*e;
            let conn = ev.param.conn;
            let pdata = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    conn.private_data_len.into(),
                )
                .to_vec()
            };
            // The ids' keys are read before the ack: until then librdmacm
            // does not let either id be destroyed. A request's new id
            // inherits its listener's context; it gets a key of its own.
            if ev.event == r::rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST && !ev.id.is_null()
            {
                (*ev.id).context = fresh_key() as *mut c_void;
            }
            let key_of = |id: *mut rdma_cm_id| {
                if id.is_null() {
                    0
                } else {
                    (*id).context as usize
                }
            };
            Event {
                kind: ev.event,
                status: ev.status,
                id: ev.id as usize,
                key: key_of(ev.id),
                listen_key: key_of(ev.listen_id),
                private_data: pdata,
                peer_qpn: conn.qp_num,
            }
        };
        // SAFETY: acking the event we got, once.
        unsafe { r::rdma_ack_cm_event(e) };
        Ok(Some(out))
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id of the channel was destroyed before (they hold
        // the channel's owner alive); destroyed once.
        unsafe { r::rdma_destroy_event_channel(self.0.as_ptr()) };
    }
}

/// An event, copied out of librdmacm's.
#[derive(Debug, Clone)]
pub struct Event {
    pub kind: u32,
    pub status: i32,
    /// The id the event is for (for a request: the new id).
    pub id: usize,
    /// That id's key ([`id::key`]): what the helper looks ids up by. An
    /// address can be reused by a new id once the old one is destroyed;
    /// a key never is.
    pub key: usize,
    /// For a connection request: the listening id's key.
    pub listen_key: usize,
    pub private_data: Vec<u8>,
    pub peer_qpn: u32,
}

/// Connection parameters.
#[derive(Debug, Clone, Copy)]
pub struct Param<'a> {
    pub qpn: u32,
    pub private_data: &'a [u8],
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
}

impl Param<'_> {
    fn raw(&self) -> r::rdma_conn_param {
        // SAFETY: plain C data; all-zero is valid.
        let mut c: r::rdma_conn_param = unsafe { std::mem::zeroed() };
        c.private_data = self.private_data.as_ptr().cast::<c_void>();
        c.private_data_len = self.private_data.len().min(255) as u8;
        c.responder_resources = self.responder_resources;
        c.initiator_depth = self.initiator_depth;
        c.retry_count = self.retry_count;
        c.rnr_retry_count = self.rnr_retry_count;
        c.qp_num = self.qpn;
        c
    }
}

/// Keys of ids, unique in the process (0 is none).
fn fresh_key() -> usize {
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// The id calls. Each takes a live id (the helper destroys an id only
/// after its last use).
pub mod id {
    use super::*;

    /// The id's key, set at creation (`create_id`) or, for a request's
    /// new id, when its request was read (`get_event`).
    pub fn key(id: NonNull<rdma_cm_id>) -> usize {
        // SAFETY: live id; its context is only ever written by us, before
        // anyone else knows the id.
        unsafe { (*id.as_ptr()).context as usize }
    }

    pub fn resolve_addr(id: NonNull<rdma_cm_id>, dst: &SocketAddr, ms: i32) -> Result<(), i32> {
        let (mut ss, _) = to_sockaddr(dst);
        // SAFETY: live id; `ss` outlives the call.
        check(unsafe {
            r::rdma_resolve_addr(
                id.as_ptr(),
                std::ptr::null_mut(),
                (&mut ss as *mut libc::sockaddr_storage).cast(),
                ms,
            )
        })
    }

    pub fn resolve_route(id: NonNull<rdma_cm_id>, ms: i32) -> Result<(), i32> {
        // SAFETY: live id.
        check(unsafe { r::rdma_resolve_route(id.as_ptr(), ms) })
    }

    pub fn bind(id: NonNull<rdma_cm_id>, a: &SocketAddr) -> Result<(), i32> {
        let (mut ss, _) = to_sockaddr(a);
        // SAFETY: live id; `ss` outlives the call.
        check(unsafe {
            r::rdma_bind_addr(id.as_ptr(), (&mut ss as *mut libc::sockaddr_storage).cast())
        })
    }

    pub fn listen(id: NonNull<rdma_cm_id>, backlog: i32) -> Result<(), i32> {
        // SAFETY: live, bound id.
        check(unsafe { r::rdma_listen(id.as_ptr(), backlog) })
    }

    pub fn local_addr(id: NonNull<rdma_cm_id>) -> Option<SocketAddr> {
        // SAFETY: live id; librdmacm returns a pointer into the id.
        unsafe { from_sockaddr(r::rdma_get_local_addr(&*id.as_ptr()) as *const libc::sockaddr) }
    }

    pub fn peer_addr(id: NonNull<rdma_cm_id>) -> Option<SocketAddr> {
        // SAFETY: as above.
        unsafe { from_sockaddr(r::rdma_get_peer_addr(&*id.as_ptr()) as *const libc::sockaddr) }
    }

    pub fn connect(id: NonNull<rdma_cm_id>, p: &Param<'_>) -> Result<(), i32> {
        let mut c = p.raw();
        // SAFETY: live id; `c` and the private data outlive the call.
        check(unsafe { r::rdma_connect(id.as_ptr(), &mut c) })
    }

    pub fn accept(id: NonNull<rdma_cm_id>, p: &Param<'_>) -> Result<(), i32> {
        let mut c = p.raw();
        // SAFETY: as above.
        check(unsafe { r::rdma_accept(id.as_ptr(), &mut c) })
    }

    pub fn reject(id: NonNull<rdma_cm_id>, private_data: &[u8]) -> Result<(), i32> {
        // SAFETY: live id; the slice outlives the call.
        check(unsafe {
            r::rdma_reject(
                id.as_ptr(),
                private_data.as_ptr().cast(),
                private_data.len().min(255) as u8,
            )
        })
    }

    /// Confirms the peer's reply (RTU) for an id whose QP is the
    /// application's own.
    pub fn establish(id: NonNull<rdma_cm_id>) -> Result<(), i32> {
        // SAFETY: live id without a librdmacm QP.
        check(unsafe { r::rdma_establish(id.as_ptr()) })
    }

    pub fn disconnect(id: NonNull<rdma_cm_id>) -> Result<(), i32> {
        // SAFETY: live id.
        check(unsafe { r::rdma_disconnect(id.as_ptr()) })
    }

    /// The attributes (and mask) the CM gives for moving a QP to `state`.
    pub fn init_qp_attr(id: NonNull<rdma_cm_id>, state: u32) -> Result<(ibv_qp_attr, u32), i32> {
        // SAFETY: plain C data; all-zero is valid.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        let mut mask = 0;
        // SAFETY: live id; `a` and `mask` receive the answer.
        check(unsafe { r::rdma_init_qp_attr(id.as_ptr(), &mut a, &mut mask) })?;
        Ok((a, mask as u32))
    }

    /// Destroy the id: no call may name it afterwards.
    pub fn destroy(id: NonNull<rdma_cm_id>) {
        // SAFETY: live id, destroyed once; every event read for it was
        // acked by `get_event`, so this does not wait.
        unsafe { r::rdma_destroy_id(id.as_ptr()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddrs_round_trip() {
        for s in ["127.0.0.1:7471", "[fe80::1%2]:9"] {
            let a: SocketAddr = s.parse().unwrap();
            let (ss, len) = to_sockaddr(&a);
            assert!(len as usize <= std::mem::size_of::<libc::sockaddr_storage>());
            // SAFETY: `ss` holds the sockaddr just written.
            let back = unsafe { from_sockaddr((&ss as *const libc::sockaddr_storage).cast()) };
            assert_eq!(back, Some(a));
        }
        // SAFETY: null is accepted.
        assert_eq!(unsafe { from_sockaddr(std::ptr::null()) }, None);
    }
}
