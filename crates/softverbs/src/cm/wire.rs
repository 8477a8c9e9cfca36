//! The messages two processes' connection managers exchange over their
//! connection's socket: the InfiniBand CM's REQ, MRA, REP, REJ, RTU, DREQ
//! and DREP, reduced to what the verbs consumer sees. A socket's end of file
//! stands for "the peer's CM destroyed its side" (destroy_id, a closed
//! channel, a process that died); the receiver infers the peer's reaction
//! from its own state (see `engine`).

#![allow(missing_docs)] // field names are the InfiniBand CM's

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// Connection parameters carried by REQ and REP.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Params {
    pub qpn: u32,
    pub psn: u32,
    pub qkey: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub ece_vendor: u32,
    pub ece_attr: u32,
    pub pdata: Vec<u8>,
}

/// One CM message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Msg {
    /// Connection request: the requester's source and destination
    /// addresses, port space and parameters.
    Req {
        src: SocketAddr,
        dst: SocketAddr,
        ps: u16,
        params: Params,
    },
    /// Message receipt acknowledgement: the REQ reached a live CM.
    Mra,
    /// Reply (accept).
    Rep(Params),
    /// Reject with an InfiniBand CM reason and private data.
    Rej { reason: u16, pdata: Vec<u8> },
    /// Ready to use.
    Rtu,
    /// Disconnect request.
    Dreq,
    /// Disconnect reply.
    Drep,
}

/// A message that does not decode.
#[derive(Debug, PartialEq, Eq)]
pub struct Malformed;

struct W(Vec<u8>);
impl W {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        let n = b.len().min(255);
        self.u8(n as u8);
        self.0.extend_from_slice(&b[..n]);
    }
    fn addr(&mut self, a: &SocketAddr) {
        match a {
            SocketAddr::V4(v) => {
                self.u8(4);
                self.0.extend_from_slice(&v.ip().octets());
                self.u16(v.port());
            }
            SocketAddr::V6(v) => {
                self.u8(6);
                self.0.extend_from_slice(&v.ip().octets());
                self.u16(v.port());
                self.u32(v.flowinfo());
                self.u32(v.scope_id());
            }
        }
    }
    fn params(&mut self, p: &Params) {
        self.u32(p.qpn);
        self.u32(p.psn);
        self.u32(p.qkey);
        for b in [
            p.responder_resources,
            p.initiator_depth,
            p.flow_control,
            p.retry_count,
            p.rnr_retry_count,
            p.srq,
        ] {
            self.u8(b);
        }
        self.u32(p.ece_vendor);
        self.u32(p.ece_attr);
        self.bytes(&p.pdata);
    }
}

struct R<'a>(&'a [u8]);
impl R<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], Malformed> {
        if self.0.len() < n {
            return Err(Malformed);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Malformed> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Malformed> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, Malformed> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn bytes(&mut self) -> Result<Vec<u8>, Malformed> {
        let n = usize::from(self.u8()?);
        Ok(self.take(n)?.to_vec())
    }
    fn addr(&mut self) -> Result<SocketAddr, Malformed> {
        match self.u8()? {
            4 => {
                let o = self.take(4)?;
                let ip = Ipv4Addr::new(o[0], o[1], o[2], o[3]);
                Ok(SocketAddr::new(IpAddr::V4(ip), self.u16()?))
            }
            6 => {
                let mut o = [0u8; 16];
                o.copy_from_slice(self.take(16)?);
                let port = self.u16()?;
                let flow = self.u32()?;
                let scope = self.u32()?;
                Ok(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(o),
                    port,
                    flow,
                    scope,
                )))
            }
            _ => Err(Malformed),
        }
    }
    fn params(&mut self) -> Result<Params, Malformed> {
        Ok(Params {
            qpn: self.u32()?,
            psn: self.u32()?,
            qkey: self.u32()?,
            responder_resources: self.u8()?,
            initiator_depth: self.u8()?,
            flow_control: self.u8()?,
            retry_count: self.u8()?,
            rnr_retry_count: self.u8()?,
            srq: self.u8()?,
            ece_vendor: self.u32()?,
            ece_attr: self.u32()?,
            pdata: self.bytes()?,
        })
    }
}

impl Msg {
    /// The message's bytes (one socket datagram).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = W(Vec::with_capacity(128));
        match self {
            Msg::Req {
                src,
                dst,
                ps,
                params,
            } => {
                w.u8(1);
                w.addr(src);
                w.addr(dst);
                w.u16(*ps);
                w.params(params);
            }
            Msg::Mra => w.u8(2),
            Msg::Rep(p) => {
                w.u8(3);
                w.params(p);
            }
            Msg::Rej { reason, pdata } => {
                w.u8(4);
                w.u16(*reason);
                w.bytes(pdata);
            }
            Msg::Rtu => w.u8(5),
            Msg::Dreq => w.u8(6),
            Msg::Drep => w.u8(7),
        }
        w.0
    }

    /// Decode one datagram.
    ///
    /// # Errors
    /// [`Malformed`] for a truncated message, an unknown type or trailing
    /// bytes.
    pub fn decode(b: &[u8]) -> Result<Msg, Malformed> {
        let mut r = R(b);
        let m = match r.u8()? {
            1 => Msg::Req {
                src: r.addr()?,
                dst: r.addr()?,
                ps: r.u16()?,
                params: r.params()?,
            },
            2 => Msg::Mra,
            3 => Msg::Rep(r.params()?),
            4 => Msg::Rej {
                reason: r.u16()?,
                pdata: r.bytes()?,
            },
            5 => Msg::Rtu,
            6 => Msg::Dreq,
            7 => Msg::Drep,
            _ => return Err(Malformed),
        };
        if r.0.is_empty() {
            Ok(m)
        } else {
            Err(Malformed)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_message_round_trips() {
        let p = Params {
            qpn: 0x12_3456,
            psn: 0xab_cdef,
            qkey: 7,
            responder_resources: 4,
            initiator_depth: 3,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 6,
            srq: 1,
            ece_vendor: 9,
            ece_attr: 10,
            pdata: (0..56).collect(),
        };
        let msgs = [
            Msg::Req {
                src: "127.0.0.1:40000".parse().unwrap(),
                dst: "[fe80::1%3]:7471".parse().unwrap(),
                ps: 0x106,
                params: p.clone(),
            },
            Msg::Mra,
            Msg::Rep(p),
            Msg::Rej {
                reason: 28,
                pdata: vec![1, 2, 3],
            },
            Msg::Rtu,
            Msg::Dreq,
            Msg::Drep,
        ];
        for m in msgs {
            assert_eq!(Msg::decode(&m.encode()), Ok(m));
        }
    }

    #[test]
    fn malformed_messages_are_refused() {
        assert_eq!(Msg::decode(&[]), Err(Malformed));
        assert_eq!(Msg::decode(&[99]), Err(Malformed));
        assert_eq!(Msg::decode(&[5, 0]), Err(Malformed));
        let full = Msg::Rep(Params::default()).encode();
        for n in 1..full.len() {
            assert_eq!(Msg::decode(&full[..n]), Err(Malformed), "{n}");
        }
    }
}
