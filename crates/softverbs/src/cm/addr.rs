//! Socket addresses in the kernel's layouts, which addresses are this
//! machine's, and the names listeners are reached by.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

/// `AF_IB`: InfiniBand native addressing, which this CM does not offer
/// (librdmacm then uses the IP commands).
pub const AF_IB: u16 = 27;

/// Parse a `struct sockaddr` given as bytes (at least the family's size).
/// `None` for another family or a short buffer.
pub fn parse(b: &[u8]) -> Option<SocketAddr> {
    if b.len() < 2 {
        return None;
    }
    let fam = u16::from_ne_bytes([b[0], b[1]]);
    match i32::from(fam) {
        libc::AF_INET if b.len() >= 16 => {
            let port = u16::from_be_bytes([b[2], b[3]]);
            let ip = Ipv4Addr::new(b[4], b[5], b[6], b[7]);
            Some(SocketAddr::V4(SocketAddrV4::new(ip, port)))
        }
        libc::AF_INET6 if b.len() >= 28 => {
            let port = u16::from_be_bytes([b[2], b[3]]);
            let flow = u32::from_be_bytes([b[4], b[5], b[6], b[7]]);
            let mut o = [0u8; 16];
            o.copy_from_slice(&b[8..24]);
            let scope = u32::from_ne_bytes([b[24], b[25], b[26], b[27]]);
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(o),
                port,
                flow,
                scope,
            )))
        }
        _ => None,
    }
}

/// The family field of a `struct sockaddr` given as bytes (0 if short).
pub fn family(b: &[u8]) -> u16 {
    if b.len() < 2 {
        0
    } else {
        u16::from_ne_bytes([b[0], b[1]])
    }
}

/// Write `a` as a `sockaddr_in` / `sockaddr_in6` into `out` (zero-filled
/// first; `out` must hold 28 bytes for IPv6, 16 for IPv4).
pub fn write(a: Option<&SocketAddr>, out: &mut [u8]) {
    out.fill(0);
    let Some(a) = a else { return };
    match a {
        SocketAddr::V4(v) if out.len() >= 16 => {
            out[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
            out[2..4].copy_from_slice(&v.port().to_be_bytes());
            out[4..8].copy_from_slice(&v.ip().octets());
        }
        SocketAddr::V6(v) if out.len() >= 28 => {
            out[..2].copy_from_slice(&(libc::AF_INET6 as u16).to_ne_bytes());
            out[2..4].copy_from_slice(&v.port().to_be_bytes());
            out[4..8].copy_from_slice(&v.flowinfo().to_be_bytes());
            out[8..24].copy_from_slice(&v.ip().octets());
            out[24..28].copy_from_slice(&v.scope_id().to_ne_bytes());
        }
        _ => {}
    }
}

/// `a` with an IPv4-mapped IPv6 address turned into IPv4.
pub fn canonical(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v) => match v.ip().to_ipv4_mapped() {
            Some(ip4) => SocketAddr::V4(SocketAddrV4::new(ip4, v.port())),
            None => a,
        },
        SocketAddr::V4(_) => a,
    }
}

/// Whether `ip` belongs to this machine (every local address maps to the
/// softverbs device's port 1): loopback, or an address of an interface.
pub fn is_local(ip: IpAddr) -> bool {
    let ip = match ip {
        IpAddr::V6(v) => v.to_ipv4_mapped().map_or(IpAddr::V6(v), IpAddr::V4),
        v => v,
    };
    if ip.is_loopback() {
        return true;
    }
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list freed below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return false;
    }
    let mut found = false;
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr of its family's size.
            let fam = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            let len = match fam {
                libc::AF_INET => 16,
                libc::AF_INET6 => 28,
                _ => 0,
            };
            if len > 0 {
                // SAFETY: as above, `len` bytes are readable.
                let b = unsafe { std::slice::from_raw_parts(ifa.ifa_addr.cast::<u8>(), len) };
                if parse(b).is_some_and(|a| a.ip() == ip) {
                    found = true;
                    break;
                }
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

fn fnv(s: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// The multicast GID of IP address `ip` for port space `ps`, as the kernel's
/// CM derives it: IPoIB's mapping of an IP multicast address into the
/// IPoIB MGID range (`ff12:401b:ffff::` and the address's low 28 bits for
/// IPv4; `ff12:601b:ffff:` and the last 10 bytes for IPv6; link-local
/// scope, the default P_Key), with the signature `0x01` instead of `0x1b`
/// for `RDMA_PS_UDP` so rdma_cm's groups never meet IPoIB's. An IPv6
/// address that already is an SA-style MGID (`ff1x:a01b::/32`) is taken
/// as it is. `None` for the any-address (a group the subnet manager would
/// name; there is none).
pub fn mc_gid(ip: IpAddr, ps: u16) -> Option<[u8; 16]> {
    if ip.is_unspecified() {
        return None;
    }
    let mut g = [0u8; 16];
    g[0] = 0xff;
    g[1] = 0x12;
    g[4] = 0xff;
    g[5] = 0xff;
    match ip {
        IpAddr::V4(a) => {
            let o = a.octets();
            g[2] = 0x40;
            g[12] = o[0] & 0x0f;
            g[13..16].copy_from_slice(&o[1..4]);
        }
        IpAddr::V6(a) => {
            let o = a.octets();
            if o[0] == 0xff && o[1] & 0xf0 == 0x10 && o[2] == 0xa0 && o[3] == 0x1b {
                return Some(o);
            }
            g[2] = 0x60;
            g[6..16].copy_from_slice(&o[6..16]);
        }
    }
    g[3] = if ps == super::abi::ps::UDP {
        0x01
    } else {
        0x1b
    };
    Some(g)
}

/// The multicast LID of group `mgid`: derived from the GID, so every
/// process names the group's LID alike (0xC000..=0xFFFE).
pub fn mc_lid(mgid: &[u8; 16]) -> u16 {
    0xc000 + (fnv(mgid) % 0x3fff) as u16
}

/// The abstract Unix socket name a listener on `ip:port` in port space
/// `ps` is bound to: unique per fabric directory, so that separate
/// `$SOFTVERBS_DIR`s are separate fabrics.
pub fn listener_name(ps: u16, ip: IpAddr, port: u16) -> Vec<u8> {
    use std::os::unix::ffi::OsStrExt;
    let dir = crate::shm::segment::dir();
    format!(
        "softverbs-cm/{:016x}/{ps:x}/{ip}/{port}",
        fnv(dir.as_os_str().as_bytes())
    )
    .into_bytes()
}

/// The listener names a connection to `dst` tries, in order: the exact
/// address, then the wildcards that cover it.
pub fn candidates(ps: u16, dst: SocketAddr) -> Vec<Vec<u8>> {
    let port = dst.port();
    let mut v = vec![listener_name(ps, dst.ip(), port)];
    if dst.ip().is_ipv4() {
        v.push(listener_name(ps, IpAddr::V4(Ipv4Addr::UNSPECIFIED), port));
    }
    v.push(listener_name(ps, IpAddr::V6(Ipv6Addr::UNSPECIFIED), port));
    v.dedup();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multicast_gids_follow_ipoib() {
        let g = mc_gid("230.1.2.3".parse().unwrap(), super::super::abi::ps::UDP).unwrap();
        assert_eq!(
            g,
            [0xff, 0x12, 0x40, 0x01, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0x06, 1, 2, 3]
        );
        let g = mc_gid("230.1.2.3".parse().unwrap(), super::super::abi::ps::IPOIB).unwrap();
        assert_eq!(&g[..4], &[0xff, 0x12, 0x40, 0x1b]);
        let g = mc_gid("ff05::1:3".parse().unwrap(), super::super::abi::ps::UDP).unwrap();
        assert_eq!(&g[..6], &[0xff, 0x12, 0x60, 0x01, 0xff, 0xff]);
        assert_eq!(&g[14..], &[0, 3]);
        assert!(mc_gid("0.0.0.0".parse().unwrap(), 0).is_none());
        let l = mc_lid(&g);
        assert!((0xc000..0xffff).contains(&l));
    }

    #[test]
    fn sockaddrs_round_trip() {
        for s in ["127.0.0.1:7471", "[fe80::1%2]:9", "[::1]:65535"] {
            let a: SocketAddr = s.parse().unwrap();
            let mut b = [0u8; 28];
            write(Some(&a), &mut b);
            assert_eq!(parse(&b), Some(a), "{s}");
        }
        assert_eq!(parse(&[0u8; 28]), None);
        let mut ib = [0u8; 28];
        ib[..2].copy_from_slice(&AF_IB.to_ne_bytes());
        assert_eq!(parse(&ib), None);
        assert_eq!(family(&ib), AF_IB);
    }

    #[test]
    fn loopback_is_local_and_names_cover_wildcards() {
        assert!(is_local("127.0.0.1".parse().unwrap()));
        assert!(is_local("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!is_local("192.0.2.77".parse().unwrap()));
        let c = candidates(0x106, "127.0.0.1:5".parse().unwrap());
        assert_eq!(c.len(), 3);
        assert!(String::from_utf8_lossy(&c[1]).ends_with("/0.0.0.0/5"));
        assert_eq!(
            canonical("[::ffff:10.0.0.1]:4".parse().unwrap()),
            "10.0.0.1:4".parse().unwrap()
        );
    }
}
