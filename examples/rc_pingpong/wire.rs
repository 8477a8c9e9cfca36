//! Command line and TCP endpoint exchange of rdma-core's `ibv_rc_pingpong`
//! (libibverbs/examples/rc_pingpong.c with pingpong.c, rdma-core v44), so
//! that cqd's `rc_pingpong` example can stand in for either side of it.
//!
//! Everything here is written from a reading of the C source; what follows
//! is what the real binary does, and what our side has to do to interoperate
//! with it.
//!
//! # Set-up, before any TCP traffic
//!
//! * One buffer of `size` bytes (page aligned), filled with `0x7b`
//!   ([`INITIAL_FILL`]), registered with `IBV_ACCESS_LOCAL_WRITE` only. The
//!   same buffer is the source of every send and the target of every
//!   receive.
//! * One CQ of `rx_depth + 1` entries, shared by send and receive; with `-e`
//!   it is bound to a completion channel (vector 0).
//! * An RC QP: `max_send_wr` 1, `max_recv_wr` `rx_depth`, one SGE each way.
//!   Sends are `IBV_WR_SEND`, `IBV_SEND_SIGNALED`, plus `IBV_SEND_INLINE`
//!   when the QP's `max_inline_data >= size`. Every send and every receive
//!   covers the whole buffer (`length = size`), so both sides must use the
//!   same `-s` (a larger incoming message is a local length error).
//! * QP to INIT: pkey index 0, port `ib_port`, access flags 0.
//! * Post `rx_depth` receives (wr_id [`RECV_WRID`]); fewer accepted is fatal
//!   ("Couldn't post receive (%d)").
//! * With `-e`: `ibv_req_notify_cq(cq, 0)` (any completion) now, still
//!   before the exchange.
//! * Local address: LID from `ibv_query_port` (LID 0 is fatal unless the
//!   link layer is Ethernet, "Couldn't get local LID"); GID from
//!   `ibv_query_gid(port, gid_idx)` when `-g` is `>= 0`, else all zero; QPN
//!   of the QP; PSN `lrand48() & 0xffffff`. It is printed as
//!   `"  local address:  LID 0x%04x, QPN 0x%06x, PSN 0x%06x, GID %s\n"` (GID
//!   through `inet_ntop(AF_INET6)`, see [`address_line`]).
//!
//! # The TCP exchange
//!
//! The message ([`encode`]) is `sprintf("%04x:%06x:%06x:%s", lid, qpn, psn,
//! wire_gid)`: 51 characters, always sent with its terminating NUL, so
//! exactly [`MSG_LEN`] = 52 bytes (`sizeof
//! "0000:000000:000000:00000000000000000000000000000000"`). Hex digits are
//! lowercase. The GID part is the 16 GID bytes in their stored (network)
//! order as 32 hex digits: `gid_to_wire_gid` takes the GID as four `u32`,
//! byte-swaps each with `htobe32` and prints it with `%08x`, and
//! `wire_gid_to_gid` undoes that with `sscanf("%x")` on each 8-digit group
//! and `be32toh`, which on every host comes to "raw bytes in order". The
//! receiver parses with `sscanf("%x:%x:%x:%s")`.
//!
//! * **Server** (no host argument): `getaddrinfo(NULL, port)` with
//!   `AI_PASSIVE`, `AF_UNSPEC`, `SOCK_STREAM`; binds the first result it can
//!   (`SO_REUSEADDR` set) — glibc lists `0.0.0.0` before `::`, so in practice
//!   the server listens on IPv4 only — `listen(fd, 1)`, accepts one
//!   connection and closes the listening socket at once. Then:
//!   1. reads the client's message (one `read` that must return 52 bytes,
//!      else "%d/%d: Couldn't read remote address");
//!   2. **brings its own QP to RTR and RTS** against the client's address
//!      (`pp_connect_ctx`) — before answering, so that the client's first
//!      send, which may follow right after the answer, finds a ready QP. On
//!      failure it closes the socket without answering;
//!   3. writes its own 52-byte message;
//!   4. reads the client's `"done\0"`: one `read` of up to 52 bytes that must
//!      return exactly 5 (the content is not checked);
//!   5. closes the socket.
//! * **Client**: `getaddrinfo(host, port)` with `AF_UNSPEC`, `SOCK_STREAM`
//!   and connects to the first result that accepts ("Couldn't connect to
//!   %s:%d" if none). Then writes its 52-byte message, reads the server's
//!   (one `read` of 52), writes `"done\0"` (5 bytes, [`DONE_MSG`]) at once,
//!   closes the socket, and only then brings its QP to RTR and RTS.
//!
//! So the `"done"` message is **not** an after-the-run synchronisation: it
//! ends the exchange, and the real server does not start its run until it
//! has read it. Neither side touches TCP after the exchange; there is no
//! barrier at the end of the run. [`client_exchange`] and
//! [`server_exchange`] therefore do the whole exchange including "done", and
//! the stream they hand back has nothing more to say: drop it.
//!
//! `pp_connect_ctx`: to RTR with `path_mtu` from `-m`, `dest_qp_num` = remote
//! QPN, `rq_psn` = remote PSN, `max_dest_rd_atomic` 1, `min_rnr_timer` 12,
//! address vector `dlid` = remote LID, `sl` from `-l`, `src_path_bits` 0,
//! `port_num` = `ib_port`; the GRH is used only if the remote GID's
//! interface id (bytes 8..16) is non-zero: then `is_global`, `hop_limit` 1,
//! `dgid` = remote GID, `sgid_index` = our `-g` value. Then to RTS with
//! `timeout` 14, `retry_cnt` 7, `rnr_retry` 7, `sq_psn` = own PSN,
//! `max_rd_atomic` 1. After the exchange each side prints
//! `"  remote address: LID 0x%04x, QPN 0x%06x, PSN 0x%06x, GID %s\n"`.
//!
//! # The run
//!
//! Work request ids: [`RECV_WRID`] = 1 for every receive, [`SEND_WRID`] = 2
//! for every send. A bit mask `pending` starts as `RECV_WRID`.
//!
//! * The **client**, with `-c`, first writes byte 0 at every page start of
//!   its buffer (`buf[i] = i / page_size % sizeof(char)`, and `x % 1` is
//!   always 0; the rest stays `0x7b`); then posts one send and sets `pending
//!   = RECV_WRID | SEND_WRID`. This first send is posted unconditionally,
//!   even with `-n 0`.
//! * The **server** posts nothing: it waits for the client's first message.
//! * Each side then takes its start time (the client after its first post,
//!   the server right after the exchange) and loops while `rcnt < iters ||
//!   scnt < iters`, polling at most 2 completions at a time (busy polling;
//!   see `-e` below). For each completion:
//!   - status not success: "Failed status %s (%d) for wr_id %d", fatal;
//!   - `SEND_WRID`: `scnt += 1`;
//!   - `RECV_WRID`: `routs -= 1`; if `routs <= 1`, post `rx_depth - routs`
//!     receives and fail unless `routs` is back to `rx_depth`; then
//!     `rcnt += 1`;
//!   - any other wr_id is fatal ("Completion for unknown wr_id %d");
//!   - `pending &= !wr_id`; if `scnt < iters && pending == 0`, post a send
//!     and set `pending = RECV_WRID | SEND_WRID`.
//!
//!   So a side sends when both its previous send has completed and a new
//!   message has arrived (the server's first send needs only the first
//!   arrival), and each side sends exactly `iters` messages (the client's
//!   first one included) and receives `iters`. Both sides must use the same
//!   `-n`, or the one with more iterations waits for ever.
//! * What is sent is whatever the buffer holds: the server's buffer has just
//!   been overwritten by the message it answers, so it echoes the client's
//!   bytes back, and the client's next send carries that echo.
//! * End of run: `usec` as a C `float` from `gettimeofday`, `bytes = size *
//!   iters * 2`, printed as `"%lld bytes in %.2f seconds = %.2f
//!   Mbit/sec\n"` (`bytes`, `usec / 1e6`, `bytes * 8 / usec`) and `"%d iters
//!   in %.2f seconds = %.2f usec/iter\n"` (`iters`, `usec / 1e6`, `usec /
//!   iters`) — see [`summary`].
//! * `-c` check: only the **server** checks, after printing those lines: for
//!   every page start `i` of its buffer, `buf[i]` must be 0, else it prints
//!   `"invalid data in page %d\n"` (to stdout; exit status stays 0). Only
//!   those bytes are looked at — see [`fill_check_pattern`] and
//!   [`check_pattern`]. The client never checks; against a real server with
//!   `-c`, our client must send zeros at page starts (it must do the `-c`
//!   fill, or leave no `0x7b` at page starts).
//! * `-e`: a completion channel, the CQ armed before the exchange, and each
//!   loop turn first blocks in `ibv_get_cq_event`, counts the event, checks
//!   it is our CQ, re-arms (`ibv_req_notify_cq(cq, 0)`) and then polls
//!   **once** (up to 2 completions, possibly none) instead of spinning. At
//!   the end `ibv_ack_cq_events(cq, events)`. Nothing on the wire changes.
//!
//! # Command line
//!
//! `getopt_long` with `"p:d:i:s:m:r:n:l:eg:oOPtcjN"`; see [`parse_args`].
//! Note that v44's letters differ from what one might guess: `-P` is
//! `--prefetch`, `-N` is `--new_send` and `-O` is `--iodp`.

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};

/// Work request id of every receive.
pub const RECV_WRID: u64 = 1;
/// Work request id of every send.
pub const SEND_WRID: u64 = 2;
/// Byte the buffer is filled with before anything else.
pub const INITIAL_FILL: u8 = 0x7b;
/// Printable length of an address message.
pub const TEXT_LEN: usize = 51;
/// Bytes of an address message on the wire: the text and its NUL.
pub const MSG_LEN: usize = TEXT_LEN + 1;
/// The message that ends the exchange, NUL included, client to server.
pub const DONE_MSG: &[u8; 5] = b"done\0";

/// One side's address as exchanged over TCP (`struct pingpong_dest`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WireDest {
    /// Port LID (0 on RoCE).
    pub lid: u16,
    /// QP number, 24 bits.
    pub qpn: u32,
    /// Initial packet sequence number, 24 bits.
    pub psn: u32,
    /// Raw GID bytes, network order; all zero when `-g` was not given.
    pub gid: [u8; 16],
}

impl WireDest {
    /// Whether the real tool would address this destination with a GRH:
    /// `dest->gid.global.interface_id` (the last 8 bytes) is non-zero.
    pub fn needs_grh(&self) -> bool {
        self.gid[8..].iter().any(|&b| b != 0)
    }
}

/// The 51 printable characters of `d`'s message: `%04x:%06x:%06x:` and the
/// GID as 32 hex digits, lowercase. QPN and PSN are 24-bit quantities; only
/// their low 24 bits are sent (the C code would overflow its buffer).
pub fn encode(d: &WireDest) -> String {
    debug_assert!(d.qpn <= 0xff_ffff && d.psn <= 0xff_ffff);
    let mut s = format!(
        "{:04x}:{:06x}:{:06x}:",
        d.lid,
        d.qpn & 0xff_ffff,
        d.psn & 0xff_ffff
    );
    for b in d.gid {
        s.push_str(&format!("{b:02x}"));
    }
    s
}

/// The 52 bytes that go on the wire for `d`: [`encode`] and a NUL.
pub fn encode_wire(d: &WireDest) -> [u8; MSG_LEN] {
    let mut out = [0u8; MSG_LEN];
    out[..TEXT_LEN].copy_from_slice(encode(d).as_bytes());
    out
}

/// Parses a message. Accepts the 51-character text, alone or followed by
/// its NUL (anything after the first NUL is ignored, as C would). Fields
/// must have exactly the widths the real tool prints; hex digits of either
/// case.
pub fn decode(s: &str) -> Result<WireDest, String> {
    let text = s.split('\0').next().unwrap_or("");
    if !text.is_ascii() {
        return Err(format!("malformed address message {text:?}: not ASCII"));
    }
    if text.len() != TEXT_LEN {
        return Err(format!(
            "malformed address message {text:?}: {} characters, expected {TEXT_LEN} \
             (LLLL:QQQQQQ:PPPPPP:<32 hex digits of GID>)",
            text.len()
        ));
    }
    let fields: Vec<&str> = text.split(':').collect();
    if fields.len() != 4
        || fields[0].len() != 4
        || fields[1].len() != 6
        || fields[2].len() != 6
        || fields[3].len() != 32
    {
        return Err(format!(
            "malformed address message {text:?}: expected LLLL:QQQQQQ:PPPPPP:<32 hex digits of GID>"
        ));
    }
    let hex = |name: &str, f: &str| -> Result<u32, String> {
        if !f.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "malformed address message {text:?}: {name} {f:?} is not hexadecimal"
            ));
        }
        u32::from_str_radix(f, 16).map_err(|e| format!("malformed address message {text:?}: {e}"))
    };
    let lid = hex("LID", fields[0])? as u16;
    let qpn = hex("QPN", fields[1])?;
    let psn = hex("PSN", fields[2])?;
    let mut gid = [0u8; 16];
    for (i, b) in gid.iter_mut().enumerate() {
        *b = hex("GID", &fields[3][2 * i..2 * i + 2])? as u8;
    }
    Ok(WireDest { lid, qpn, psn, gid })
}

/// [`decode`] of the 52 bytes read from the wire.
pub fn decode_wire(buf: &[u8; MSG_LEN]) -> Result<WireDest, String> {
    let text = buf.split(|&b| b == 0).next().unwrap_or(&[]);
    let text = std::str::from_utf8(text)
        .map_err(|_| format!("malformed address message {:?}: not ASCII", buf))?;
    decode(text)
}

fn invalid(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

fn context(e: io::Error, what: &str) -> io::Error {
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

/// Writes the 5-byte `"done\0"` in one write: the real server reads it with
/// one `read` and insists on getting exactly 5 bytes.
pub fn send_done(stream: &mut TcpStream) -> io::Result<()> {
    stream
        .write_all(DONE_MSG)
        .map_err(|e| context(e, "Couldn't read/write remote address"))
}

/// Reads the client's 5-byte end-of-exchange message. Like the real server,
/// only its length is checked, not its content.
pub fn recv_done(stream: &mut TcpStream) -> io::Result<()> {
    let mut buf = [0u8; DONE_MSG.len()];
    stream
        .read_exact(&mut buf)
        .map_err(|e| context(e, "Couldn't send/recv local address"))
}

/// Client side of the exchange: connects to `host:port` (every address
/// `getaddrinfo` gives, in order), sends `local`, reads the server's
/// address, sends `"done"` — all as the real client does. The caller brings
/// its QP to RTR/RTS after this returns. The stream is finished with.
pub fn client_exchange(
    host: &str,
    port: u16,
    local: &WireDest,
) -> io::Result<(TcpStream, WireDest)> {
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| context(e, &format!("{host}:{port}")))?
        .collect();
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    let mut stream = None;
    for a in &addrs {
        match TcpStream::connect(a) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = e,
        }
    }
    let mut stream =
        stream.ok_or_else(|| context(last, &format!("Couldn't connect to {host}:{port}")))?;
    // One write of all 52 bytes: the real server takes it with one read.
    stream
        .write_all(&encode_wire(local))
        .map_err(|e| context(e, "Couldn't send local address"))?;
    let mut buf = [0u8; MSG_LEN];
    stream
        .read_exact(&mut buf)
        .map_err(|e| context(e, "Couldn't read/write remote address"))?;
    send_done(&mut stream)?;
    let remote = decode_wire(&buf).map_err(invalid)?;
    Ok((stream, remote))
}

/// Binds the server's listening socket as `getaddrinfo(NULL, port,
/// AI_PASSIVE)` on glibc would have it: `0.0.0.0` first, `[::]` if that
/// fails; `SO_REUSEADDR` is set by the standard library.
pub fn listen(port: u16) -> io::Result<TcpListener> {
    let candidates = [
        SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)),
        SocketAddr::from((Ipv6Addr::UNSPECIFIED, port)),
    ];
    TcpListener::bind(&candidates[..])
        .map_err(|e| context(e, &format!("Couldn't listen to port {port}")))
}

/// Server side of the exchange: listens on `port` (see [`listen`]) and runs
/// [`server_accept_exchange`].
pub fn server_exchange<F>(
    port: u16,
    local: &WireDest,
    connect_qp: F,
) -> io::Result<(TcpStream, WireDest)>
where
    F: FnOnce(&WireDest) -> io::Result<()>,
{
    server_accept_exchange(listen(port)?, local, connect_qp)
}

/// Accepts one connection (and closes `listener`), reads the client's
/// address, calls `connect_qp` with it — the caller brings its QP to RTR and
/// RTS there, as `pp_connect_ctx` does at this point in the real server —
/// then sends `local` and reads the client's `"done"`. If `connect_qp`
/// fails the connection is closed without an answer and its error returned.
/// The stream is finished with.
pub fn server_accept_exchange<F>(
    listener: TcpListener,
    local: &WireDest,
    connect_qp: F,
) -> io::Result<(TcpStream, WireDest)>
where
    F: FnOnce(&WireDest) -> io::Result<()>,
{
    let (mut stream, _) = listener
        .accept()
        .map_err(|e| context(e, "accept() failed"))?;
    drop(listener);
    let mut buf = [0u8; MSG_LEN];
    stream
        .read_exact(&mut buf)
        .map_err(|e| context(e, "Couldn't read remote address"))?;
    let remote = decode_wire(&buf).map_err(invalid)?;
    connect_qp(&remote).map_err(|e| context(e, "Couldn't connect to remote QP"))?;
    stream
        .write_all(&encode_wire(local))
        .map_err(|e| context(e, "Couldn't send/recv local address"))?;
    recv_done(&mut stream)?;
    Ok((stream, remote))
}

/// A GID as `inet_ntop(AF_INET6)` of glibc prints it: longest run (first of
/// equal ones, at least two groups) of zero groups as `::`, lowercase hex
/// without leading zeros, and a dotted IPv4 tail for `::a.b.c.d` and
/// `::ffff:a.b.c.d`.
pub fn gid_text(gid: &[u8; 16]) -> String {
    let w: Vec<u16> = gid
        .chunks(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    // Runs of zero groups as (first group, length).
    let mut best: Option<(usize, usize)> = None;
    let mut cur: Option<(usize, usize)> = None;
    for (i, &v) in w.iter().enumerate() {
        if v == 0 {
            cur = Some(cur.map_or((i, 1), |(b, l)| (b, l + 1)));
        } else if let Some(c) = cur.take() {
            if best.is_none_or(|b| c.1 > b.1) {
                best = Some(c);
            }
        }
    }
    if let Some(c) = cur {
        if best.is_none_or(|b| c.1 > b.1) {
            best = Some(c);
        }
    }
    let best = best.filter(|b| b.1 >= 2);
    let mut s = String::new();
    let mut i = 0;
    while i < 8 {
        if let Some((b, l)) = best {
            if i == b {
                s.push(':');
                i += l;
                if i == 8 {
                    s.push(':');
                }
                continue;
            }
        }
        if i != 0 {
            s.push(':');
        }
        if i == 6 && best.is_some_and(|(b, l)| b == 0 && (l == 6 || (l == 5 && w[5] == 0xffff))) {
            s.push_str(&format!("{}.{}.{}.{}", gid[12], gid[13], gid[14], gid[15]));
            break;
        }
        s.push_str(&format!("{:x}", w[i]));
        i += 1;
    }
    s
}

/// The line the real tool prints for its own (`local`) or the peer's
/// address, without the newline.
pub fn address_line(local: bool, d: &WireDest) -> String {
    format!(
        "  {} LID 0x{:04x}, QPN 0x{:06x}, PSN 0x{:06x}, GID {}",
        if local {
            "local address: "
        } else {
            "remote address:"
        },
        d.lid,
        d.qpn,
        d.psn,
        gid_text(&d.gid)
    )
}

/// The two result lines, without the final newline, computed as the real
/// tool does: elapsed microseconds held in a C `float`, `bytes = size *
/// iters * 2`.
pub fn summary(size: u32, iters: u32, elapsed_usec: u64) -> String {
    let usec = elapsed_usec as f32;
    let bytes = u64::from(size) * u64::from(iters) * 2;
    let secs = f64::from(usec) / 1_000_000.0;
    format!(
        "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec\n{} iters in {secs:.2} seconds = {:.2} usec/iter",
        bytes as f64 * 8.0 / f64::from(usec),
        iters as i32,
        f64::from(usec / iters as f32),
    )
}

/// What the client does to its buffer with `-c` before its first send:
/// byte 0 at every page start (the C expression `i / page_size %
/// sizeof(char)` is always 0).
pub fn fill_check_pattern(buf: &mut [u8], page_size: usize) {
    for b in buf.iter_mut().step_by(page_size) {
        *b = 0;
    }
}

/// The server's `-c` check after the run: the pages whose first byte is
/// not 0. The real tool prints `invalid data in page N` for each.
pub fn check_pattern(buf: &[u8], page_size: usize) -> Vec<usize> {
    buf.iter()
        .step_by(page_size)
        .enumerate()
        .filter(|&(_, &b)| b != 0)
        .map(|(page, _)| page)
        .collect()
}

/// Default TCP port.
pub const DEFAULT_PORT: u16 = 18515;

/// The command line of `ibv_rc_pingpong`, as far as cqd's version takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// `-p`, `--port`: TCP port to listen on or connect to (18515).
    pub port: u16,
    /// `-d`, `--ib-dev`: device name (first device found).
    pub ib_dev: Option<String>,
    /// `-i`, `--ib-port`: port of the device, at least 1 (1).
    pub ib_port: u8,
    /// `-s`, `--size`: message size in bytes (4096).
    pub size: u32,
    /// `-m`, `--mtu`: path MTU in bytes, 256/512/1024/2048/4096 (1024).
    pub mtu: u32,
    /// `-r`, `--rx-depth`: receives posted at a time (500).
    pub rx_depth: u32,
    /// `-n`, `--iters`: exchanges (1000).
    pub iters: u32,
    /// `-l`, `--sl`: service level (0).
    pub sl: u8,
    /// `-e`, `--events`: sleep on CQ events instead of polling.
    pub events: bool,
    /// `-g`, `--gid-idx`: local GID index; negative (default -1) means no
    /// GID, as in the real tool.
    pub gid_idx: i32,
    /// `-c`, `--chk`: client fills, server checks the page-start bytes.
    pub chk: bool,
    /// Positional argument: the server to connect to; `None` makes a server.
    pub server_name: Option<String>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            port: DEFAULT_PORT,
            ib_dev: None,
            ib_port: 1,
            size: 4096,
            mtu: 1024,
            rx_depth: 500,
            iters: 1000,
            sl: 0,
            events: false,
            gid_idx: -1,
            chk: false,
            server_name: None,
        }
    }
}

impl Options {
    /// The GID index to query, if any (`gid_idx >= 0`).
    pub fn gid_index(&self) -> Option<u32> {
        u32::try_from(self.gid_idx).ok()
    }
}

/// The usage text, as the real tool prints it (to stdout) on any
/// command-line error.
pub fn usage(argv0: &str) -> String {
    format!(
        "Usage:\n\
         \x20 {argv0}            start a server and wait for connection\n\
         \x20 {argv0} <host>     connect to server at <host>\n\
         \n\
         Options:\n\
         \x20 -p, --port=<port>      listen on/connect to port <port> (default 18515)\n\
         \x20 -d, --ib-dev=<dev>     use IB device <dev> (default first device found)\n\
         \x20 -i, --ib-port=<port>   use port <port> of IB device (default 1)\n\
         \x20 -s, --size=<size>      size of message to exchange (default 4096)\n\
         \x20 -m, --mtu=<size>       path MTU (default 1024)\n\
         \x20 -r, --rx-depth=<dep>   number of receives to post at a time (default 500)\n\
         \x20 -n, --iters=<iters>    number of exchanges (default 1000)\n\
         \x20 -l, --sl=<sl>          service level value\n\
         \x20 -e, --events           sleep on CQ events (default poll)\n\
         \x20 -g, --gid-idx=<gid index> local port gid index\n\
         \x20 -c, --chk              validate received buffer\n\
         \x20 -o, --odp, -O, --iodp, -P, --prefetch, -t, --ts, -j, --dm, -N, --new_send\n\
         \x20                        accepted by ibv_rc_pingpong, not supported here\n"
    )
}

/// Long options: name, short letter, takes an argument.
const LONG: [(&str, char, bool); 17] = [
    ("port", 'p', true),
    ("ib-dev", 'd', true),
    ("ib-port", 'i', true),
    ("size", 's', true),
    ("mtu", 'm', true),
    ("rx-depth", 'r', true),
    ("iters", 'n', true),
    ("sl", 'l', true),
    ("events", 'e', false),
    ("gid-idx", 'g', true),
    ("odp", 'o', false),
    ("iodp", 'O', false),
    ("prefetch", 'P', false),
    ("ts", 't', false),
    ("chk", 'c', false),
    ("dm", 'j', false),
    ("new_send", 'N', false),
];

/// Whether short option `c` exists and takes an argument
/// (`"p:d:i:s:m:r:n:l:eg:oOPtcjN"`).
fn short_opt(c: char) -> Option<bool> {
    LONG.iter().find(|o| o.1 == c).map(|o| o.2)
}

/// A number as `strtol`/`strtoul` with base 0 reads it (`0x` hex, leading
/// `0` octal, else decimal; optional sign; surrounding blanks), except that
/// anything left over, an empty number or a value out of `i64` is an error
/// instead of being silently ignored.
fn c_number(opt: &str, s: &str) -> Result<i64, String> {
    let bad = || format!("invalid number {s:?} for {opt}");
    let t = s.trim_matches(|c: char| c.is_ascii_whitespace());
    let (neg, t) = match t.as_bytes().first() {
        Some(b'-') => (true, &t[1..]),
        Some(b'+') => (false, &t[1..]),
        _ => (false, t),
    };
    let (radix, digits) = if let Some(h) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        (16, h)
    } else if t.len() > 1 && t.starts_with('0') {
        (8, &t[1..])
    } else {
        (10, t)
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return Err(bad());
    }
    let v = i64::from_str_radix(digits, radix).map_err(|_| bad())?;
    Ok(if neg { -v } else { v })
}

fn in_range<T: TryFrom<i64>>(opt: &str, v: i64, what: &str) -> Result<T, String> {
    T::try_from(v).map_err(|_| format!("{opt}: {v} is out of range ({what})"))
}

fn apply(o: &mut Options, c: char, arg: Option<String>) -> Result<(), String> {
    let name = LONG.iter().find(|l| l.1 == c).map_or("", |l| l.0);
    let opt = format!("-{c}/--{name}");
    let num = |arg: &Option<String>| c_number(&opt, arg.as_deref().unwrap_or(""));
    match c {
        'p' => {
            let v = num(&arg)?;
            o.port = in_range(&opt, v, "0 to 65535")?;
        }
        'd' => o.ib_dev = arg,
        'i' => {
            let v = num(&arg)?;
            o.ib_port = in_range::<u8>(&opt, v, "1 to 255").and_then(|p| {
                if p >= 1 {
                    Ok(p)
                } else {
                    Err(format!("{opt}: {v} is out of range (1 to 255)"))
                }
            })?;
        }
        's' => o.size = in_range(&opt, num(&arg)?, "0 to 4294967295")?,
        'm' => {
            let v = num(&arg)?;
            if ![256, 512, 1024, 2048, 4096].contains(&v) {
                return Err(format!(
                    "{opt}: {v} is not an IB MTU (256, 512, 1024, 2048 or 4096)"
                ));
            }
            o.mtu = v as u32;
        }
        'r' => o.rx_depth = in_range(&opt, num(&arg)?, "0 to 4294967295")?,
        'n' => o.iters = in_range(&opt, num(&arg)?, "0 to 4294967295")?,
        'l' => {
            let v = num(&arg)?;
            o.sl = in_range::<u8>(&opt, v, "0 to 15").and_then(|s| {
                if s <= 15 {
                    Ok(s)
                } else {
                    Err(format!("{opt}: {v} is out of range (0 to 15)"))
                }
            })?;
        }
        'e' => o.events = true,
        'g' => o.gid_idx = in_range(&opt, num(&arg)?, "a C int")?,
        'c' => o.chk = true,
        'o' | 'O' | 'P' | 't' | 'j' | 'N' => {
            let what = match c {
                'o' => "on-demand paging",
                'O' => "implicit on-demand paging",
                'P' => "ODP MR prefetch",
                't' => "completion timestamps",
                'j' => "device memory",
                _ => "the new post send API",
            };
            return Err(format!(
                "option {opt} ({what}) is not supported by cqd's rc_pingpong"
            ));
        }
        _ => unreachable!("option table and apply() disagree on -{c}"),
    }
    Ok(())
}

/// Parses the arguments after the program name the way `getopt_long` does
/// for `ibv_rc_pingpong`: short options clustered (`-ec`) with their
/// argument attached or next (`-p18515`, `-p 18515`, `-ecp 18515`), long
/// options with `=` or the next argument (`--port=18515`, `--port 18515`)
/// and by any unambiguous prefix (`--it=5`), options and the server name in
/// any order (GNU permutation), `--` ending the options, a lone `-` being a
/// server name. The error texts of getopt are kept.
///
/// Differences from the real tool, all on input it would misread: numbers
/// must be whole (`strtoul` takes `"12abc"` as 12 and `"abc"` as 0), must
/// not be negative where unsigned, must fit their field; `-i` must fit a
/// port number (1..255) and `-l` an SL (0..15). The flags cqd's version
/// does not implement (`-o`, `-O`, `-P`, `-t`, `-j`, `-N`) are errors.
/// `POSIXLY_CORRECT` is not looked at.
pub fn parse_args<I>(args: I) -> Result<Options, String>
where
    I: IntoIterator<Item = String>,
{
    let mut o = Options::default();
    let mut positional = Vec::new();
    let mut args = args.into_iter();
    while let Some(a) = args.next() {
        if a == "--" {
            positional.extend(args.by_ref());
            break;
        }
        if let Some(body) = a.strip_prefix("--") {
            let (name, inline) = match body.split_once('=') {
                Some((n, v)) => (n, Some(v.to_string())),
                None => (body, None),
            };
            let exact = LONG.iter().find(|l| l.0 == name);
            let found = match exact {
                Some(l) => l,
                None => {
                    let matches: Vec<_> = LONG.iter().filter(|l| l.0.starts_with(name)).collect();
                    match matches.len() {
                        0 => return Err(format!("unrecognized option '--{body}'")),
                        1 => matches[0],
                        _ => {
                            let list: Vec<String> =
                                matches.iter().map(|l| format!("'--{}'", l.0)).collect();
                            return Err(format!(
                                "option '--{body}' is ambiguous; possibilities: {}",
                                list.join(" ")
                            ));
                        }
                    }
                }
            };
            let (long, c, has_arg) = *found;
            let arg = if has_arg {
                match inline {
                    Some(v) => Some(v),
                    None => Some(
                        args.next()
                            .ok_or_else(|| format!("option '--{long}' requires an argument"))?,
                    ),
                }
            } else {
                if inline.is_some() {
                    return Err(format!("option '--{long}' doesn't allow an argument"));
                }
                None
            };
            apply(&mut o, c, arg)?;
        } else if a.len() > 1 && a.starts_with('-') {
            let cluster: Vec<char> = a[1..].chars().collect();
            let mut k = 0;
            while k < cluster.len() {
                let c = cluster[k];
                k += 1;
                match short_opt(c) {
                    None => return Err(format!("invalid option -- '{c}'")),
                    Some(false) => apply(&mut o, c, None)?,
                    Some(true) => {
                        let arg = if k < cluster.len() {
                            cluster[k..].iter().collect()
                        } else {
                            args.next()
                                .ok_or_else(|| format!("option requires an argument -- '{c}'"))?
                        };
                        apply(&mut o, c, Some(arg))?;
                        break;
                    }
                }
            }
        } else {
            positional.push(a);
        }
    }
    match positional.len() {
        0 => {}
        1 => o.server_name = positional.pop(),
        _ => {
            return Err(format!(
                "expected at most one server name, got {}: {}",
                positional.len(),
                positional.join(" ")
            ))
        }
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::thread;

    fn args(s: &str) -> Result<Options, String> {
        parse_args(s.split_whitespace().map(String::from))
    }

    fn sample() -> WireDest {
        WireDest {
            lid: 0x0003,
            qpn: 0x000123,
            psn: 0x4a5b6c,
            gid: [0; 16],
        }
    }

    fn roce() -> WireDest {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[192, 168, 1, 10]);
        WireDest {
            lid: 0,
            qpn: 0x0011a2,
            psn: 0xc0ffee,
            gid,
        }
    }

    #[test]
    fn encode_is_what_sprintf_makes() {
        assert_eq!(
            encode(&sample()),
            "0003:000123:4a5b6c:00000000000000000000000000000000"
        );
        assert_eq!(
            encode(&roce()),
            "0000:0011a2:c0ffee:00000000000000000000ffffc0a8010a"
        );
        let w = encode_wire(&sample());
        assert_eq!(w.len(), 52);
        assert_eq!(w[51], 0);
        assert_eq!(
            MSG_LEN,
            "0000:000000:000000:00000000000000000000000000000000".len() + 1
        );
    }

    #[test]
    fn round_trip() {
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = (i as u8) * 16 + 1;
        }
        for d in [
            sample(),
            roce(),
            WireDest {
                lid: 0xffff,
                qpn: 0xff_ffff,
                psn: 0xff_ffff,
                gid,
            },
            WireDest {
                lid: 0,
                qpn: 0,
                psn: 0,
                gid: [0; 16],
            },
        ] {
            assert_eq!(decode(&encode(&d)), Ok(d));
            assert_eq!(decode_wire(&encode_wire(&d)), Ok(d));
        }
    }

    #[test]
    fn decodes_the_real_tools_bytes() {
        // What an ibv_rc_pingpong on RoCE with -g 3 sends: the text and its
        // NUL, 52 bytes.
        let raw = b"0000:0011a2:c0ffee:00000000000000000000ffffc0a8010a\0";
        let d = decode_wire(raw).unwrap();
        assert_eq!(d, roce());
        assert!(d.needs_grh());
        // Link-local IB-style GID, upper-case hex tolerated.
        let d = decode("0011:000abc:000001:FE800000000000000002C9FFFE001234").unwrap();
        assert_eq!(d.lid, 0x11);
        assert_eq!(d.qpn, 0xabc);
        assert_eq!(d.psn, 1);
        assert_eq!(
            d.gid,
            [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0, 0x02, 0xc9, 0xff, 0xfe, 0, 0x12, 0x34]
        );
        assert!(!sample().needs_grh());
    }

    #[test]
    fn rejects_malformed() {
        for bad in [
            "",
            "done",
            "0003:000123:4a5b6c:0000000000000000000000000000000",
            "0003:000123:4a5b6c:000000000000000000000000000000000",
            "0003-000123:4a5b6c:00000000000000000000000000000000",
            "003:0000123:4a5b6c:00000000000000000000000000000000",
            "0003:000123:4a5b6g:00000000000000000000000000000000",
            "0003:000123:4a5b6c:0000000000000000000000000000000z",
            "0003:000123:4a5b6c:+0000000000000000000000000000000",
            " 003:000123:4a5b6c:00000000000000000000000000000000",
            "0003:000123:4a5b6c:00000000000000000000000000000000:",
            "0003:000123:4a5b6c:000000000000000000000000000000é",
            "0003:000123:4a5b6c:00000000000000000000000000000\u{2603}",
        ] {
            assert!(decode(bad).is_err(), "{bad:?} accepted");
        }
        let mut raw = encode_wire(&sample());
        raw[20] = 0xff;
        assert!(decode_wire(&raw).is_err());
    }

    #[test]
    fn gid_text_matches_glibc_inet_ntop() {
        let g = |h: &str| {
            let mut gid = [0u8; 16];
            for (i, b) in gid.iter_mut().enumerate() {
                *b = u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap();
            }
            gid_text(&gid)
        };
        // Expected values from glibc's inet_ntop.
        assert_eq!(g("00000000000000000000000000000000"), "::");
        assert_eq!(g("00000000000000000000000000000001"), "::1");
        assert_eq!(g("00000000000000000000000000000102"), "::102");
        assert_eq!(g("00000000000000000000000001020304"), "::1.2.3.4");
        assert_eq!(g("00000000000000000000ffffc0a8010a"), "::ffff:192.168.1.10");
        assert_eq!(
            g("fe800000000000000002c9fffe001234"),
            "fe80::2:c9ff:fe00:1234"
        );
        assert_eq!(g("00010000000100000000000000000000"), "1:0:1::");
        assert_eq!(g("00010000000000010000000000000000"), "1:0:0:1::");
        assert_eq!(g("00010000000100010000000000010000"), "1:0:1:1::1:0");
        assert_eq!(g("00000000000000000001ffffc0a8010a"), "::1:ffff:c0a8:10a");
        assert_eq!(g("0000000000000000ffff0000c0a8010a"), "::ffff:0:c0a8:10a");
        assert_eq!(
            address_line(true, &sample()),
            "  local address:  LID 0x0003, QPN 0x000123, PSN 0x4a5b6c, GID ::"
        );
        assert_eq!(
            address_line(false, &roce()),
            "  remote address: LID 0x0000, QPN 0x0011a2, PSN 0xc0ffee, GID ::ffff:192.168.1.10"
        );
    }

    #[test]
    fn summary_lines() {
        assert_eq!(
            summary(4096, 1000, 1_234_567),
            "8192000 bytes in 1.23 seconds = 53.08 Mbit/sec\n1000 iters in 1.23 seconds = 1234.57 usec/iter"
        );
    }

    #[test]
    fn check_pattern_is_page_start_zeros() {
        let mut buf = vec![INITIAL_FILL; 3 * 4096 + 10];
        assert_eq!(check_pattern(&buf, 4096), vec![0, 1, 2, 3]);
        fill_check_pattern(&mut buf, 4096);
        assert_eq!(check_pattern(&buf, 4096), Vec::<usize>::new());
        assert_eq!(buf.iter().filter(|&&b| b == 0).count(), 4);
        buf[4096] = 1;
        assert_eq!(check_pattern(&buf, 4096), vec![1]);
    }

    #[test]
    fn defaults() {
        let o = args("").unwrap();
        assert_eq!(o, Options::default());
        assert_eq!(o.port, 18515);
        assert_eq!(o.ib_port, 1);
        assert_eq!(o.size, 4096);
        assert_eq!(o.mtu, 1024);
        assert_eq!(o.rx_depth, 500);
        assert_eq!(o.iters, 1000);
        assert_eq!(o.sl, 0);
        assert_eq!(o.gid_idx, -1);
        assert_eq!(o.gid_index(), None);
        assert!(!o.events && !o.chk && o.server_name.is_none() && o.ib_dev.is_none());
    }

    #[test]
    fn forms_getopt_accepts() {
        for s in [
            "-p 1234",
            "-p1234",
            "--port=1234",
            "--port 1234",
            "--po=1234",
            "--por 1234",
            "-p 0x4d2",
            "-p 02322",
        ] {
            assert_eq!(args(s).unwrap().port, 1234, "{s}");
        }
        let o =
            args("-ecp 7000 -g3 host -n5 --it=7 -s 64 --rx-depth=8 -m 4096 -l 2 -i 2 -d mlx5_0")
                .unwrap();
        assert!(o.events && o.chk);
        assert_eq!(o.port, 7000);
        assert_eq!(o.gid_idx, 3);
        assert_eq!(o.gid_index(), Some(3));
        assert_eq!(o.server_name.as_deref(), Some("host"));
        assert_eq!(o.iters, 7);
        assert_eq!(o.size, 64);
        assert_eq!(o.rx_depth, 8);
        assert_eq!(o.mtu, 4096);
        assert_eq!(o.sl, 2);
        assert_eq!(o.ib_port, 2);
        assert_eq!(o.ib_dev.as_deref(), Some("mlx5_0"));
        assert_eq!(args("-- -p").unwrap().server_name.as_deref(), Some("-p"));
        assert_eq!(args("-").unwrap().server_name.as_deref(), Some("-"));
        assert_eq!(args("-d -e").unwrap().ib_dev.as_deref(), Some("-e"));
        assert_eq!(args("-g -1").unwrap().gid_index(), None);
        assert_eq!(args("--gid-idx=-5").unwrap().gid_idx, -5);
        assert!(args("--events --chk").map(|o| o.events && o.chk).unwrap());
        assert_eq!(args("-p 0").unwrap().port, 0);
        assert_eq!(args("-s 0").unwrap().size, 0);
    }

    #[test]
    fn errors() {
        let err = |s: &str| args(s).unwrap_err();
        assert_eq!(err("-x"), "invalid option -- 'x'");
        assert_eq!(err("-p"), "option requires an argument -- 'p'");
        assert_eq!(err("--port"), "option '--port' requires an argument");
        assert_eq!(err("--foo"), "unrecognized option '--foo'");
        assert_eq!(
            err("--events=1"),
            "option '--events' doesn't allow an argument"
        );
        assert_eq!(err("--foo=1"), "unrecognized option '--foo=1'");
        assert_eq!(
            err("--i=1"),
            "option '--i=1' is ambiguous; possibilities: '--ib-dev' '--ib-port' '--iters' '--iodp'"
        );
        assert_eq!(
            err("--p=1"),
            "option '--p=1' is ambiguous; possibilities: '--port' '--prefetch'"
        );
        assert!(err("-p 65536").contains("out of range"));
        assert!(err("-p -1").contains("out of range"));
        assert!(err("-p abc").contains("invalid number"));
        assert!(err("-p 12abc").contains("invalid number"));
        assert!(err("-p 08").contains("invalid number"));
        assert!(err("-i 0").contains("out of range"));
        assert!(err("-i 256").contains("out of range"));
        assert!(err("-m 1000").contains("not an IB MTU"));
        assert!(err("-l 16").contains("out of range"));
        assert!(err("-n -1").contains("out of range"));
        assert!(err("a b").contains("at most one server name"));
        for f in [
            "-o",
            "--odp",
            "-O",
            "--iodp",
            "-P",
            "--prefetch",
            "-t",
            "--ts",
            "-j",
            "--dm",
            "-N",
            "--new_send",
            "-eo",
        ] {
            assert!(
                err(f).contains("not supported by cqd's rc_pingpong"),
                "{f}: {}",
                err(f)
            );
        }
    }

    /// Our server against a client that does exactly what the C client
    /// does, byte for byte; the server answers only after `connect_qp`.
    #[test]
    fn server_against_c_style_client() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let connected = Arc::new(AtomicBool::new(false));
        let seen = connected.clone();
        let client = thread::spawn(move || {
            let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
            s.write_all(b"0003:000123:4a5b6c:00000000000000000000000000000000\0")
                .unwrap();
            let mut buf = [0u8; 52];
            s.read_exact(&mut buf).unwrap();
            assert!(seen.load(Ordering::SeqCst), "answer before connect_qp");
            s.write_all(b"done\0").unwrap();
            buf
        });
        let (_s, remote) = server_accept_exchange(listener, &roce(), |r| {
            assert_eq!(*r, sample());
            connected.store(true, Ordering::SeqCst);
            Ok(())
        })
        .unwrap();
        assert_eq!(remote, sample());
        assert_eq!(
            &client.join().unwrap(),
            b"0000:0011a2:c0ffee:00000000000000000000ffffc0a8010a\0"
        );
    }

    /// Our client against a server that does exactly what the C server does.
    #[test]
    fn client_against_c_style_server() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut buf = [0u8; 52];
            s.read_exact(&mut buf).unwrap();
            s.write_all(b"0000:0011a2:c0ffee:00000000000000000000ffffc0a8010a\0")
                .unwrap();
            let mut done = [0u8; 52];
            let n = s.read(&mut done).unwrap();
            (buf, done[..n].to_vec())
        });
        let (_s, remote) = client_exchange("127.0.0.1", port, &sample()).unwrap();
        assert_eq!(remote, roce());
        let (got, done) = server.join().unwrap();
        assert_eq!(
            &got,
            b"0003:000123:4a5b6c:00000000000000000000000000000000\0"
        );
        assert_eq!(done, b"done\0");
    }

    #[test]
    fn ours_against_ours_and_failed_connect() {
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            server_accept_exchange(listener, &roce(), |_| Ok(())).map(|(_, r)| r)
        });
        let (_s, r) = client_exchange("localhost", port, &sample()).unwrap();
        assert_eq!(r, roce());
        assert_eq!(server.join().unwrap().unwrap(), sample());

        // connect_qp fails: the server hangs up without answering.
        let listener = TcpListener::bind(("127.0.0.1", 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        let server = thread::spawn(move || {
            server_accept_exchange(listener, &roce(), |_| {
                Err(io::Error::other("Failed to modify QP to RTR"))
            })
        });
        assert!(client_exchange("127.0.0.1", port, &sample()).is_err());
        let e = server.join().unwrap().unwrap_err();
        assert!(e.to_string().contains("Couldn't connect to remote QP"));
    }
}
