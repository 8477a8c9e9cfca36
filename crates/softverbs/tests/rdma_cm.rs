//! rdma_cm on softverbs through the unmodified librdmacm (rdma-sys): the
//! events of a whole connection's life, private data each way, refused and
//! rejected connections, a peer process that dies, a peer whose CM never
//! answers or stops answering once it acknowledged the request, pollable
//! channels, and the rdma_getaddrinfo/rdma_create_ep helpers. Run under
//! `softverbs-run`; skipped loudly otherwise.
#![allow(clippy::undocumented_unsafe_blocks, missing_docs)]

mod common;
use common::*;
use std::net::SocketAddrV4;
use std::process::Command;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use rdma_sys::rdma_cm_event_type as ev;

fn sin(a: &str) -> libc::sockaddr_in {
    let a: SocketAddrV4 = a.parse().unwrap();
    let mut s: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    s.sin_family = libc::AF_INET as u16;
    s.sin_port = a.port().to_be();
    s.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
    s
}

/// A port of our own per test (tests run in parallel), in 20000–26399:
/// below 32768, where the CM picks the ephemeral ports of ids bound to port
/// 0 (a fixed port up there once met another id's ephemeral one and the
/// bind failed), and below cqd-verbs' `tests/cm.rs` ports.
fn port(n: u16) -> u16 {
    20000 + (std::process::id() % 800) as u16 * 8 + n
}

struct Ch(*mut rdma_event_channel);

impl Ch {
    fn new() -> Ch {
        let c = unsafe { rdma_create_event_channel() };
        assert!(
            !c.is_null(),
            "rdma_create_event_channel: {}",
            std::io::Error::last_os_error()
        );
        Ch(c)
    }
    fn id(&self) -> *mut rdma_cm_id {
        let mut id = null_mut();
        let r =
            unsafe { rdma_create_id(self.0, &mut id, null_mut(), rdma_port_space::RDMA_PS_TCP) };
        assert_eq!(r, 0, "rdma_create_id");
        id
    }
    /// The next event within 10 s: (type, status, id, private data).
    fn next(&self) -> (u32, i32, *mut rdma_cm_id, Vec<u8>) {
        let fd = unsafe { (*self.0).fd };
        assert!(fd_readable(fd, 10_000), "no CM event within 10 s");
        let mut e = null_mut();
        assert_eq!(
            unsafe { rdma_get_cm_event(self.0, &mut e) },
            0,
            "rdma_get_cm_event"
        );
        let (t, st, id) = unsafe { ((*e).event, (*e).status, (*e).id) };
        let conn = unsafe { (*e).param.conn };
        let pd = if conn.private_data.is_null() {
            Vec::new()
        } else {
            unsafe {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    conn.private_data_len.into(),
                )
            }
            .to_vec()
        };
        unsafe { rdma_ack_cm_event(e) };
        (t, st, id, pd)
    }
    fn expect(&self, want: u32) -> (i32, *mut rdma_cm_id, Vec<u8>) {
        let (t, st, id, pd) = self.next();
        assert_eq!(t, want, "event {t} (status {st}), wanted {want}");
        (st, id, pd)
    }
}

fn qp_attr(dev_pd: *mut ibv_pd) -> (ibv_qp_init_attr, *mut ibv_cq) {
    let cq = unsafe { ibv_create_cq((*dev_pd).context, 64, null_mut(), null_mut(), 0) };
    assert!(!cq.is_null());
    let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = ibv_qp_type::IBV_QPT_RC;
    a.cap.max_send_wr = 16;
    a.cap.max_recv_wr = 16;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    (a, cq)
}

fn listen(ch: &Ch, p: u16) -> *mut rdma_cm_id {
    let l = ch.id();
    let mut a = sin(&format!("0.0.0.0:{p}"));
    assert_eq!(
        unsafe { rdma_bind_addr(l, (&mut a as *mut libc::sockaddr_in).cast()) },
        0,
        "bind"
    );
    assert_eq!(unsafe { rdma_listen(l, 8) }, 0, "listen");
    l
}

/// Resolve address and route of a new id towards 127.0.0.1:p.
fn resolved(ch: &Ch, p: u16) -> *mut rdma_cm_id {
    let id = ch.id();
    let mut d = sin(&format!("127.0.0.1:{p}"));
    assert_eq!(
        unsafe {
            rdma_resolve_addr(
                id,
                null_mut(),
                (&mut d as *mut libc::sockaddr_in).cast(),
                2000,
            )
        },
        0
    );
    ch.expect(ev::RDMA_CM_EVENT_ADDR_RESOLVED);
    assert!(
        !unsafe { (*id).verbs }.is_null(),
        "resolved id has no device"
    );
    assert_eq!(unsafe { rdma_resolve_route(id, 2000) }, 0);
    ch.expect(ev::RDMA_CM_EVENT_ROUTE_RESOLVED);
    id
}

fn param(pdata: &[u8]) -> rdma_conn_param {
    let mut c: rdma_conn_param = unsafe { std::mem::zeroed() };
    c.private_data = pdata.as_ptr().cast();
    c.private_data_len = pdata.len() as u8;
    c.responder_resources = 1;
    c.initiator_depth = 1;
    c.retry_count = 7;
    c.rnr_retry_count = 7;
    c
}

#[test]
fn connection_life_events_private_data_and_traffic() {
    if !launcher_or_skip("connection_life_events_private_data_and_traffic") {
        return;
    }
    let p = port(0);
    let (sch, cch) = (Ch::new(), Ch::new());
    let l = listen(&sch, p);
    let c = resolved(&cch, p);
    let (mut ca, ccq) = qp_attr(unsafe { (*c).pd });
    assert_eq!(
        unsafe { rdma_create_qp(c, (*c).pd, &mut ca) },
        0,
        "client create_qp"
    );
    let req_pd: Vec<u8> = (1..=40).collect();
    assert_eq!(
        unsafe { rdma_connect(c, &mut param(&req_pd)) },
        0,
        "connect"
    );
    // The listener gets the request on a new id, with the private data
    // (rdma_cm reports the REQ's whole 56 bytes, zero-padded).
    let (st, s, pd) = sch.expect(ev::RDMA_CM_EVENT_CONNECT_REQUEST);
    assert_eq!(st, 0);
    assert_ne!(s, l);
    assert_eq!(pd.len(), 56);
    assert_eq!(&pd[..40], &req_pd[..]);
    assert!(pd[40..].iter().all(|b| *b == 0));
    let (mut sa, scq) = qp_attr(unsafe { (*s).pd });
    assert_eq!(
        unsafe { rdma_create_qp(s, (*s).pd, &mut sa) },
        0,
        "server create_qp"
    );
    let rep_pd = b"accepted by the server".to_vec();
    assert_eq!(unsafe { rdma_accept(s, &mut param(&rep_pd)) }, 0, "accept");
    let (_, cid, pd) = cch.expect(ev::RDMA_CM_EVENT_ESTABLISHED);
    assert_eq!(cid, c);
    assert_eq!(&pd[..rep_pd.len()], &rep_pd[..]);
    let (_, sid, _) = sch.expect(ev::RDMA_CM_EVENT_ESTABLISHED);
    assert_eq!(sid, s);

    // The QPs are connected to each other: a SEND and an RDMA WRITE.
    let dev = Dev {
        ctx: unsafe { (*c).verbs },
        pd: unsafe { (*c).pd },
    };
    let sbuf = Buf::new(&dev, 4096, 0);
    let cbuf = Buf::new(&dev, 4096, 0x5a);
    post_recv(unsafe { (*s).qp }, &sbuf, 0, 64, 1);
    assert_eq!(
        post_send(
            unsafe { (*c).qp },
            &cbuf,
            0,
            64,
            2,
            send(ibv_wr_opcode::IBV_WR_SEND, SIGNALED)
        ),
        0
    );
    let w = poll(ccq, 1);
    assert_eq!(w[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    let w = poll(scq, 1);
    assert_eq!(
        (w[0].status, w[0].byte_len),
        (ibv_wc_status::IBV_WC_SUCCESS, 64)
    );
    assert!(sbuf.data[..64].iter().all(|b| *b == 0x5a));
    let mut wr = send(ibv_wr_opcode::IBV_WR_RDMA_WRITE, SIGNALED);
    wr.remote_addr = sbuf.addr() + 1024;
    wr.rkey = sbuf.rkey();
    assert_eq!(post_send(unsafe { (*c).qp }, &cbuf, 0, 512, 3, wr), 0);
    assert_eq!(poll(ccq, 1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
    assert!(sbuf.data[1024..1536].iter().all(|b| *b == 0x5a));

    // Disconnect from the client: both sides DISCONNECTED, then both leave
    // time-wait.
    assert_eq!(unsafe { rdma_disconnect(c) }, 0);
    sch.expect(ev::RDMA_CM_EVENT_DISCONNECTED);
    assert_eq!(unsafe { rdma_disconnect(s) }, 0);
    cch.expect(ev::RDMA_CM_EVENT_DISCONNECTED);
    cch.expect(ev::RDMA_CM_EVENT_TIMEWAIT_EXIT);
    sch.expect(ev::RDMA_CM_EVENT_TIMEWAIT_EXIT);
    // librdmacm moved the client QP to ERR at disconnect.
    assert_eq!(qp_state(unsafe { (*c).qp }), ibv_qp_state::IBV_QPS_ERR);
    unsafe {
        rdma_destroy_qp(c);
        rdma_destroy_qp(s);
        assert_eq!(rdma_destroy_id(c), 0);
        assert_eq!(rdma_destroy_id(s), 0);
        assert_eq!(rdma_destroy_id(l), 0);
        ibv_dereg_mr(sbuf.mr);
        ibv_dereg_mr(cbuf.mr);
        ibv_destroy_cq(ccq);
        ibv_destroy_cq(scq);
        rdma_destroy_event_channel(cch.0);
        rdma_destroy_event_channel(sch.0);
    }
}

#[test]
fn nobody_listening_is_rejected_and_sync_connect_refused() {
    if !launcher_or_skip("nobody_listening_is_rejected_and_sync_connect_refused") {
        return;
    }
    let p = port(1);
    let ch = Ch::new();
    let c = resolved(&ch, p);
    assert_eq!(unsafe { rdma_connect(c, &mut param(&[])) }, 0);
    // InfiniBand CM: REJ, reason 8 (invalid service ID).
    let (st, id, _) = ch.expect(ev::RDMA_CM_EVENT_REJECTED);
    assert_eq!((st, id), (8, c));
    unsafe { rdma_destroy_id(c) };
    // The synchronous form (rdma_create_ep, no channel) reports ECONNREFUSED.
    let mut hints: rdma_addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_port_space = rdma_port_space::RDMA_PS_TCP as i32;
    let mut res = null_mut();
    let node = c"127.0.0.1";
    let svc = std::ffi::CString::new(p.to_string()).unwrap();
    assert_eq!(
        unsafe { rdma_getaddrinfo(node.as_ptr(), svc.as_ptr(), &hints, &mut res) },
        0,
        "rdma_getaddrinfo"
    );
    let mut ep = null_mut();
    assert_eq!(
        unsafe { rdma_create_ep(&mut ep, res, null_mut(), null_mut()) },
        0,
        "rdma_create_ep"
    );
    // No QP on the endpoint: the connection parameters name none.
    let r = unsafe { rdma_connect(ep, &mut param(&[])) };
    let e = std::io::Error::last_os_error().raw_os_error();
    assert_eq!((r, e), (-1, Some(libc::ECONNREFUSED)));
    unsafe {
        rdma_destroy_ep(ep);
        rdma_freeaddrinfo(res);
        rdma_destroy_event_channel(ch.0);
    }
}

#[test]
fn reject_carries_private_data_and_the_consumer_reason() {
    if !launcher_or_skip("reject_carries_private_data_and_the_consumer_reason") {
        return;
    }
    let p = port(2);
    let (sch, cch) = (Ch::new(), Ch::new());
    let l = listen(&sch, p);
    let c = resolved(&cch, p);
    assert_eq!(unsafe { rdma_connect(c, &mut param(b"hello")) }, 0);
    let (_, s, pd) = sch.expect(ev::RDMA_CM_EVENT_CONNECT_REQUEST);
    assert_eq!(&pd[..5], b"hello");
    let why = b"server full";
    assert_eq!(
        unsafe { rdma_reject(s, why.as_ptr().cast(), why.len() as u8) },
        0
    );
    let (st, _, pd) = cch.expect(ev::RDMA_CM_EVENT_REJECTED);
    assert_eq!(st, 28, "IB_CM_REJ_CONSUMER_DEFINED");
    assert_eq!(pd.len(), 148);
    assert_eq!(&pd[..why.len()], why);
    unsafe {
        rdma_destroy_id(s);
        rdma_destroy_id(c);
        rdma_destroy_id(l);
    }
}

/// The channel polls readable while an event waits, and only then; a
/// non-blocking GET_EVENT with none answers EAGAIN.
#[test]
fn channel_is_pollable_and_nonblocking() {
    if !launcher_or_skip("channel_is_pollable_and_nonblocking") {
        return;
    }
    let ch = Ch::new();
    let fd = unsafe { (*ch.0).fd };
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    assert_eq!(
        unsafe { libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) },
        0
    );
    let mut e = null_mut();
    assert_eq!(unsafe { rdma_get_cm_event(ch.0, &mut e) }, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EAGAIN)
    );
    assert!(!fd_readable(fd, 50));
    let id = ch.id();
    let mut d = sin("127.0.0.1:9");
    assert_eq!(
        unsafe {
            rdma_resolve_addr(
                id,
                null_mut(),
                (&mut d as *mut libc::sockaddr_in).cast(),
                2000,
            )
        },
        0
    );
    assert!(fd_readable(fd, 5000));
    assert_eq!(unsafe { rdma_get_cm_event(ch.0, &mut e) }, 0);
    assert_eq!(unsafe { (*e).event }, ev::RDMA_CM_EVENT_ADDR_RESOLVED);
    unsafe { rdma_ack_cm_event(e) };
    assert!(!fd_readable(fd, 50), "no event left, yet readable");
    // An address of no local interface has no device: ADDR_ERROR.
    let id2 = ch.id();
    let mut far = sin("192.0.2.1:9");
    assert_eq!(
        unsafe {
            rdma_resolve_addr(
                id2,
                null_mut(),
                (&mut far as *mut libc::sockaddr_in).cast(),
                200,
            )
        },
        0
    );
    assert!(fd_readable(fd, 5000));
    assert_eq!(unsafe { rdma_get_cm_event(ch.0, &mut e) }, 0);
    assert_eq!(
        unsafe { ((*e).event, (*e).status) },
        (ev::RDMA_CM_EVENT_ADDR_ERROR, -libc::ENODEV)
    );
    unsafe { rdma_ack_cm_event(e) };
    // An event whose id is destroyed unread goes, and so does the
    // channel's readiness: readable only while an event waits, as on a
    // kernel (a program that polls before it asks would otherwise block).
    let id3 = ch.id();
    assert_eq!(
        unsafe {
            rdma_resolve_addr(
                id3,
                null_mut(),
                (&mut d as *mut libc::sockaddr_in).cast(),
                2000,
            )
        },
        0
    );
    assert!(fd_readable(fd, 5000));
    assert_eq!(unsafe { rdma_destroy_id(id3) }, 0);
    assert!(!fd_readable(fd, 50), "its event went, yet readable");
    assert_eq!(unsafe { rdma_get_cm_event(ch.0, &mut e) }, -1);
    assert_eq!(
        std::io::Error::last_os_error().raw_os_error(),
        Some(libc::EAGAIN)
    );
    unsafe {
        rdma_destroy_id(id);
        rdma_destroy_id(id2);
        rdma_destroy_event_channel(ch.0);
    }
}

/// The child side of the two-process tests: listen on the port given,
/// print "listening", then as `how` says: `listen-only` sleeps;
/// `stop-at-request` stops its own process once it has read
/// CONNECT_REQUEST; anything else accepts one connection (with a QP) and
/// exits without cleanup.
fn child(how: &str, p: u16) {
    let ch = Ch::new();
    let l = listen(&ch, p);
    println!("listening");
    if how == "listen-only" {
        std::thread::sleep(Duration::from_secs(30));
        return;
    }
    if how == "stop-at-request" {
        // Our CM acknowledged the REQ (MRA) before it queued the event.
        ch.expect(ev::RDMA_CM_EVENT_CONNECT_REQUEST);
        // SAFETY: signalling our own process; no memory is involved.
        unsafe { libc::kill(libc::getpid(), libc::SIGSTOP) };
        std::thread::sleep(Duration::from_secs(30));
        return;
    }
    let (_, s, _) = ch.expect(ev::RDMA_CM_EVENT_CONNECT_REQUEST);
    let (mut a, _cq) = qp_attr(unsafe { (*s).pd });
    assert_eq!(unsafe { rdma_create_qp(s, (*s).pd, &mut a) }, 0);
    assert_eq!(unsafe { rdma_accept(s, &mut param(&[])) }, 0);
    ch.expect(ev::RDMA_CM_EVENT_ESTABLISHED);
    // Die without any cleanup.
    let _ = l;
    unsafe { libc::_exit(0) };
}

fn spawn_child(test: &str, how: &str, p: u16) -> std::process::Child {
    let mut c = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env("RDMA_CM_TEST_CHILD", format!("{how}:{p}"))
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("spawn child");
    // Wait for "listening".
    use std::io::BufRead;
    let out = c.stdout.take().unwrap();
    let mut r = std::io::BufReader::new(out);
    let mut line = String::new();
    while r.read_line(&mut line).unwrap() > 0 {
        if line.contains("listening") {
            break;
        }
        line.clear();
    }
    assert!(line.contains("listening"), "child did not start");
    c
}

fn child_role() -> Option<(String, u16)> {
    let v = std::env::var("RDMA_CM_TEST_CHILD").ok()?;
    let (how, p) = v.split_once(':')?;
    Some((how.to_string(), p.parse().ok()?))
}

#[test]
fn peer_process_death_disconnects() {
    if let Some((how, p)) = child_role() {
        child(&how, p);
        return;
    }
    if !launcher_or_skip("peer_process_death_disconnects") {
        return;
    }
    let p = port(3);
    let mut kid = spawn_child("peer_process_death_disconnects", "die", p);
    let ch = Ch::new();
    let c = resolved(&ch, p);
    let (mut a, _cq) = qp_attr(unsafe { (*c).pd });
    assert_eq!(unsafe { rdma_create_qp(c, (*c).pd, &mut a) }, 0);
    assert_eq!(unsafe { rdma_connect(c, &mut param(&[])) }, 0);
    ch.expect(ev::RDMA_CM_EVENT_ESTABLISHED);
    let st = kid.wait().unwrap();
    assert!(st.success(), "child: {st}");
    // The peer's process is gone: its CM's side of the connection went
    // with it, and ours reports DISCONNECTED (never a hang).
    let t = Instant::now();
    let (_, id, _) = ch.expect(ev::RDMA_CM_EVENT_DISCONNECTED);
    assert_eq!(id, c);
    assert!(t.elapsed() < Duration::from_secs(5));
    assert_eq!(unsafe { rdma_disconnect(c) }, 0);
    ch.expect(ev::RDMA_CM_EVENT_TIMEWAIT_EXIT);
    unsafe {
        rdma_destroy_qp(c);
        rdma_destroy_id(c);
    }
}

/// The connecting side of the unreachable test, in a process of its own
/// (the CM timeout is read from the environment once per process).
fn connect_unreachable(p: u16) {
    let ch = Ch::new();
    let c = resolved(&ch, p);
    let t = Instant::now();
    assert_eq!(unsafe { rdma_connect(c, &mut param(&[])) }, 0);
    let (st, _, _) = ch.expect(ev::RDMA_CM_EVENT_UNREACHABLE);
    assert_eq!(st, -libc::ETIMEDOUT);
    assert!(
        t.elapsed() >= Duration::from_millis(350),
        "{:?}",
        t.elapsed()
    );
    unsafe { rdma_destroy_id(c) };
    println!("unreachable ok");
}

#[test]
fn stopped_peer_is_unreachable_after_the_cm_timeout() {
    const NAME: &str = "stopped_peer_is_unreachable_after_the_cm_timeout";
    if let Some((how, p)) = child_role() {
        if how == "connect" {
            connect_unreachable(p);
        } else {
            child(&how, p);
        }
        return;
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let p = port(4);
    let mut kid = spawn_child(NAME, "listen-only", p);
    // A peer whose CM does not run (a hung or stopped host): no answer.
    unsafe { libc::kill(kid.id() as i32, libc::SIGSTOP) };
    let out = Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env("RDMA_CM_TEST_CHILD", format!("connect:{p}"))
        .env("SOFTVERBS_CM_TIMEOUT_MS", "400")
        .output()
        .expect("run the connecting process");
    unsafe { libc::kill(kid.id() as i32, libc::SIGKILL) };
    let _ = kid.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("unreachable ok"),
        "connecting process: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A UD id (RDMA_PS_UDP) with its address resolved towards multicast
/// address `group` from 127.0.0.1, a UD QP on its device and one receive
/// buffer registered: (id, cq, mr, buffer).
fn mc_member(ch: &Ch, group: &str) -> (*mut rdma_cm_id, *mut ibv_cq, *mut ibv_mr, Vec<u8>) {
    let mut id = null_mut();
    let r = unsafe { rdma_create_id(ch.0, &mut id, null_mut(), rdma_port_space::RDMA_PS_UDP) };
    assert_eq!(r, 0, "rdma_create_id");
    let mut s = sin("127.0.0.1:0");
    let mut d = sin(&format!("{group}:0"));
    assert_eq!(
        unsafe {
            rdma_resolve_addr(
                id,
                (&mut s as *mut libc::sockaddr_in).cast(),
                (&mut d as *mut libc::sockaddr_in).cast(),
                2000,
            )
        },
        0
    );
    ch.expect(ev::RDMA_CM_EVENT_ADDR_RESOLVED);
    let ctx = unsafe { (*id).verbs };
    assert!(!ctx.is_null(), "a multicast address resolves to the device");
    let cq = unsafe { ibv_create_cq(ctx, 16, null_mut(), null_mut(), 0) };
    assert!(!cq.is_null());
    let mut a: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
    a.send_cq = cq;
    a.recv_cq = cq;
    a.qp_type = ibv_qp_type::IBV_QPT_UD;
    a.cap.max_send_wr = 8;
    a.cap.max_recv_wr = 8;
    a.cap.max_send_sge = 1;
    a.cap.max_recv_sge = 1;
    assert_eq!(
        unsafe { rdma_create_qp(id, null_mut(), &mut a) },
        0,
        "rdma_create_qp"
    );
    let mut buf = vec![0u8; 4 * 256];
    let mr = unsafe {
        ibv_reg_mr(
            (*id).pd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32,
        )
    };
    assert!(!mr.is_null(), "reg_mr");
    (id, cq, mr, buf)
}

/// The next event, which must be MULTICAST_JOIN: its UD parameters.
fn join_event(ch: &Ch) -> (rdma_ud_param, *mut rdma_cm_id) {
    let fd = unsafe { (*ch.0).fd };
    assert!(fd_readable(fd, 10_000), "no CM event within 10 s");
    let mut e = null_mut();
    assert_eq!(unsafe { rdma_get_cm_event(ch.0, &mut e) }, 0);
    let (t, st, id, ud) = unsafe { ((*e).event, (*e).status, (*e).id, (*e).param.ud) };
    unsafe { rdma_ack_cm_event(e) };
    assert_eq!((t, st), (ev::RDMA_CM_EVENT_MULTICAST_JOIN, 0));
    (ud, id)
}

/// A peer whose CM acknowledged the REQ (MRA) and whose process then
/// stopped, before its application accepted: the repeated REQ goes
/// unanswered, so the connecting side gets UNREACHABLE, never waits for
/// ever. The peer stops itself once it has read CONNECT_REQUEST, after its
/// CM sent the MRA: the stop lands in that step every time.
#[test]
fn peer_stopped_after_acknowledging_the_request_is_unreachable() {
    const NAME: &str = "peer_stopped_after_acknowledging_the_request_is_unreachable";
    if let Some((how, p)) = child_role() {
        if how == "connect" {
            connect_unreachable(p);
        } else {
            child(&how, p);
        }
        return;
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let p = port(5);
    let mut kid = spawn_child(NAME, "stop-at-request", p);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env("RDMA_CM_TEST_CHILD", format!("connect:{p}"))
        .env("SOFTVERBS_CM_TIMEOUT_MS", "400")
        .output()
        .expect("run the connecting process");
    // The peer stopped (it stops only after reading the request; were it
    // never to, it would exit after its sleep and this would say so).
    let pid = kid.id() as i32;
    let mut status = 0;
    // SAFETY: waiting for our own child; `status` is a writable int.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WUNTRACED) };
    let stopped = r == pid && libc::WIFSTOPPED(status);
    // SAFETY: signalling our own child, not yet reaped.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let _ = kid.wait();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("unreachable ok"),
        "connecting process: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stopped, "the listening process did not stop at the request");
}

/// The waiting side of `a_wait_holds_its_channel_across_a_close`, in a
/// process of its own (the hook is read from the environment once per
/// process).
fn wait_across_close(p: u16) {
    let (a, b) = (Ch::new(), Ch::new());
    let fd = unsafe { (*a.0).fd };
    // `z` (on `a`) connects to `l` (on `b`), which rejects it at the end:
    // an event for the channel after it was closed, from the CM thread.
    let l = listen(&b, p);
    let z = resolved(&a, p);
    // A byte whose event goes unread: queued, taken by the waiter, then
    // its id destroyed (as rping's main thread destroys its id while its
    // CM thread waits).
    let x = a.id();
    let mut d = sin(&format!("127.0.0.1:{p}"));
    assert_eq!(
        unsafe {
            rdma_resolve_addr(
                x,
                null_mut(),
                (&mut d as *mut libc::sockaddr_in).cast(),
                2000,
            )
        },
        0
    );
    assert!(fd_readable(fd, 10_000), "no ADDR_RESOLVED byte");
    let chan = a.0 as usize;
    let (tx, rx) = std::sync::mpsc::channel();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(WAITER.into())
        .spawn(move || {
            let _ = tid_tx.send(unsafe { libc::syscall(libc::SYS_gettid) });
            let mut e = null_mut();
            let r = unsafe { rdma_get_cm_event(chan as *mut rdma_event_channel, &mut e) };
            let got = if r == 0 {
                let t = unsafe { (*e).event };
                unsafe { rdma_ack_cm_event(e) };
                Ok(t)
            } else {
                Err(std::io::Error::last_os_error())
            };
            let _ = tx.send(got);
        })
        .unwrap();
    let tid = tid_rx.recv().unwrap();
    // The waiter took the byte; the hook holds it there until the close.
    let t = Instant::now();
    while fd_readable(fd, 0) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "the waiter never read"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(unsafe { rdma_destroy_id(x) }, 0);
    assert_eq!(unsafe { rdma_connect(z, &mut param(&[])) }, 0);
    let (_, r, _) = b.expect(ev::RDMA_CM_EVENT_CONNECT_REQUEST);
    // Another thread closes the descriptor: not rdma_destroy_event_channel,
    // which would free the channel the waiter still uses.
    assert_eq!(unsafe { libc::close(fd) }, 0);
    // The waiter finds no event and reads again: wait until it blocks in
    // read(2), unless it returned.
    let syscall = format!("/proc/self/task/{tid}/syscall");
    let reading = format!("{} ", libc::SYS_read);
    let t = Instant::now();
    let early = loop {
        if let Ok(got) = rx.try_recv() {
            break Some(got);
        }
        let now = std::fs::read_to_string(&syscall).unwrap_or_default();
        if now.starts_with(&reading) {
            break None;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "waiter: {now}");
        std::thread::sleep(Duration::from_millis(1));
    };
    if let Some(Err(e)) = early {
        panic!("rdma_get_cm_event after the close: {e}");
    }
    assert!(
        early.is_none(),
        "the waiter returned {early:?} with no event"
    );
    // The rejection reaches `z` on the closed channel, and the waiter.
    assert_eq!(unsafe { rdma_reject(r, null_mut(), 0) }, 0);
    let got = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("the waiter did not return");
    match got {
        Ok(t) => assert_eq!(t, ev::RDMA_CM_EVENT_REJECTED, "event {t}"),
        Err(e) => panic!("rdma_get_cm_event: {e}"),
    }
    let _ = l;
    println!("wait ok");
}

/// The waiting thread's name (the hook acts in it only).
const WAITER: &str = "cm-waiter";

/// A thread waiting in `rdma_get_cm_event` holds its channel, as the
/// kernel's `write(2)` holds the file: a byte whose event went unread (its
/// id destroyed after the waiter took the byte) leaves the waiter waiting
/// on the same channel, even after another thread closed the descriptor,
/// and the channel's next event (from the CM thread) reaches it. It used
/// to read the descriptor's number again: rping's client exited 255 with
/// `rdma_get_cm_event: Bad file descriptor` (docs/reliability.md item 5).
/// The hook holds the waiter between taking the byte and looking for its
/// event until the close, so the test fails every time without the fix.
#[test]
fn a_wait_holds_its_channel_across_a_close() {
    const NAME: &str = "a_wait_holds_its_channel_across_a_close";
    if let Some((how, p)) = child_role() {
        assert_eq!(how, "wait");
        wait_across_close(p);
        return;
    }
    if !launcher_or_skip(NAME) {
        return;
    }
    let p = port(6);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env("RDMA_CM_TEST_CHILD", format!("wait:{p}"))
        .env("SOFTVERBS_TEST_CM_WAKE_WAITS_FOR_CLOSE", WAITER)
        .output()
        .expect("run the waiting process");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && text.contains("wait ok"),
        "waiting process: {}\n{text}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// rdma_join_multicast with two ids (two QPs): MULTICAST_JOIN carries the
/// group's address handle (global, the IPoIB-style MGID of the address
/// with rdma_cm's signature, a multicast LID), QPN 0xFFFFFF and
/// RDMA_UDP_QKEY, and the context given to the join; librdmacm attaches
/// each QP, so a send through that address handle reaches the other
/// member; after rdma_leave_multicast it no longer does. The any-address
/// is refused (no subnet manager to name a group).
#[test]
fn multicast_join_traffic_and_leave() {
    if !launcher_or_skip("multicast_join_traffic_and_leave") {
        return;
    }
    let ch = Ch::new();
    let group = "230.9.8.7";
    let (tx, tx_cq, tx_mr, tx_buf) = mc_member(&ch, group);
    let (rx, rx_cq, rx_mr, mut rx_buf) = mc_member(&ch, group);
    // The device writes the buffer through this address.
    let rx_addr = rx_buf.as_mut_ptr() as u64;
    let mut ga = sin(&format!("{group}:0"));
    let ctx_tag = 0x5151usize as *mut libc::c_void;
    for id in [tx, rx] {
        assert_eq!(
            unsafe { rdma_join_multicast(id, (&mut ga as *mut libc::sockaddr_in).cast(), ctx_tag) },
            0,
            "rdma_join_multicast"
        );
    }
    let mut ud = None;
    for want in [tx, rx] {
        let (u, id) = join_event(&ch);
        assert_eq!(id, want);
        assert_eq!((u.qp_num, u.qkey), (0x00ff_ffff, 0x0123_4567));
        assert_eq!(u.private_data, ctx_tag.cast_const(), "the join's context");
        assert_eq!((u.ah_attr.is_global, u.ah_attr.port_num), (1, 1));
        assert!(
            u.ah_attr.dlid >= 0xc000 && u.ah_attr.dlid < 0xffff,
            "multicast LID"
        );
        let want_gid = [
            0xff,
            0x12,
            0x40,
            0x01,
            0xff,
            0xff,
            0,
            0,
            0,
            0,
            0,
            0,
            230 & 0xf,
            9,
            8,
            7,
        ];
        assert_eq!(unsafe { u.ah_attr.grh.dgid.raw }, want_gid);
        ud = Some(u);
    }
    let mut ud = ud.unwrap();
    let ah = unsafe { ibv_create_ah((*tx).pd, &mut ud.ah_attr) };
    assert!(!ah.is_null());
    let post_recv_rx = |wr_id: u64| {
        let mut sge = ibv_sge {
            addr: rx_addr + wr_id * 256,
            length: 256,
            lkey: unsafe { (*rx_mr).lkey },
        };
        let mut wr: ibv_recv_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        let mut bad = null_mut();
        assert_eq!(unsafe { ibv_post_recv((*rx).qp, &mut wr, &mut bad) }, 0);
    };
    let send = |wr_id: u64| {
        let mut sge = ibv_sge {
            addr: tx_buf.as_ptr() as u64,
            length: 32,
            lkey: unsafe { (*tx_mr).lkey },
        };
        let mut wr: ibv_send_wr = unsafe { std::mem::zeroed() };
        wr.wr_id = wr_id;
        wr.sg_list = &mut sge;
        wr.num_sge = 1;
        wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.wr.ud = ud_t {
            ah,
            remote_qpn: ud.qp_num,
            remote_qkey: ud.qkey,
        };
        let mut bad = null_mut();
        assert_eq!(unsafe { ibv_post_send((*tx).qp, &mut wr, &mut bad) }, 0);
        assert_eq!(poll(tx_cq, 1)[0].status, WC_SUCCESS);
    };
    post_recv_rx(0);
    send(1);
    let c = poll(rx_cq, 1)[0];
    assert_eq!(
        (c.status, c.byte_len, c.src_qp),
        (WC_SUCCESS, 40 + 32, unsafe { (*(*tx).qp).qp_num })
    );
    assert_eq!(
        &rx_buf[24..40],
        unsafe { &ud.ah_attr.grh.dgid.raw },
        "GRH DGID"
    );
    // Left: the receiver's QP is detached, nothing more arrives.
    assert_eq!(
        unsafe { rdma_leave_multicast(rx, (&mut ga as *mut libc::sockaddr_in).cast()) },
        0
    );
    post_recv_rx(1);
    send(2);
    poll_none(rx_cq, Duration::from_millis(50));
    // Leaving what was left: librdmacm knows no such group (EADDRNOTAVAIL).
    assert_ne!(
        unsafe { rdma_leave_multicast(rx, (&mut ga as *mut libc::sockaddr_in).cast()) },
        0
    );
    // The any-address names no group here.
    let mut any = sin("0.0.0.0:0");
    assert_ne!(
        unsafe { rdma_join_multicast(rx, (&mut any as *mut libc::sockaddr_in).cast(), null_mut()) },
        0
    );
    assert_eq!(
        unsafe { rdma_leave_multicast(tx, (&mut ga as *mut libc::sockaddr_in).cast()) },
        0
    );
    unsafe {
        ibv_destroy_ah(ah);
        for (id, mr, cq) in [(tx, tx_mr, tx_cq), (rx, rx_mr, rx_cq)] {
            ibv_dereg_mr(mr);
            rdma_destroy_qp(id);
            ibv_destroy_cq(cq);
            assert_eq!(rdma_destroy_id(id), 0);
        }
        rdma_destroy_event_channel(ch.0);
    }
}
