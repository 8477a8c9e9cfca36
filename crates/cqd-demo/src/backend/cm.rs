//! Connections through rdma_cm (`--cm rdmacm`, verbs only), as NVMe over
//! Fabrics connects its queues: the server listens on its `--listen`
//! address, the load connects each of its connections there, naming the
//! connection and proving its session in the request's private data. The
//! TCP session still carries the handshake (geometry, `done`, `bye`); only
//! the queue pairs' endpoints go through the CM instead of the TCP
//! messages. Which requests the server accepts is the CM gate's decision
//! (`crate::net`, step H5 of the protocol).

use std::any::Any;
use std::net::SocketAddr;
use std::time::Duration;

use super::BackendError;
use crate::auth::CM_MAC_LEN;

/// The private data of a connection request begins with this tag.
pub const REQ_TAG: &[u8; 8] = b"cqd-demo";

/// Bytes of a request's private data: the tag, the connection's number
/// (u32, little-endian), then the session's MAC of the request
/// ([`crate::auth::SessionKey::cm_mac`]). rdma_cm carries at most 56 bytes
/// in a request (RC on InfiniBand and RoCE).
pub const REQ_LEN: usize = REQ_TAG.len() + 4 + CM_MAC_LEN;

const _: () = assert!(REQ_LEN <= 56, "a connection request carries 56 bytes");

/// The most bytes of a rejection's reason sent back in the reject's
/// private data (rdma_cm carries 148 in a reject).
pub const REJECT_LEN: usize = 128;

/// The request's private data for connection `conn` with the session's
/// `mac` of it.
pub fn request_data(conn: u32, mac: &[u8; CM_MAC_LEN]) -> Vec<u8> {
    let mut v = Vec::with_capacity(REQ_LEN);
    v.extend_from_slice(REQ_TAG);
    v.extend_from_slice(&conn.to_le_bytes());
    v.extend_from_slice(mac);
    v
}

/// The connection number and the MAC in a request's private data, if it
/// is one of ours (rdma_cm pads private data with zeros: bytes past
/// [`REQ_LEN`] are ignored).
pub fn parse_request(private_data: &[u8]) -> Option<(u32, [u8; CM_MAC_LEN])> {
    let rest = private_data.strip_prefix(&REQ_TAG[..])?;
    let conn: [u8; 4] = rest.get(..4)?.try_into().ok()?;
    let mac: [u8; CM_MAC_LEN] = rest.get(4..4 + CM_MAC_LEN)?.try_into().ok()?;
    Some((u32::from_le_bytes(conn), mac))
}

/// A connection request the server took, to accept on a link
/// ([`super::Link::cm_accept`]).
pub struct PendingCm(
    // Read by the verbs backend only.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))] pub(crate) Box<dyn Any + Send>,
);

impl std::fmt::Debug for PendingCm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingCm")
    }
}

pub(crate) fn unsupported(what: &str) -> BackendError {
    BackendError::new(
        what.to_string(),
        "rdma_cm needs the verbs backend (cargo feature `verbs`, --backend verbs)",
    )
}

/// The server's rdma_cm listener.
#[derive(Debug)]
pub struct CmListener {
    #[cfg(feature = "verbs")]
    inner: cqd_verbs::cm::Listener,
}

/// Listen on `addr` through rdma_cm.
///
/// # Errors
/// No rdma_cm on this machine, the address not local, the port in use.
pub fn listen(addr: SocketAddr) -> Result<CmListener, BackendError> {
    #[cfg(feature = "verbs")]
    {
        let cm = super::verbs::cm_manager()?;
        let inner = cm
            .listen(addr, 64)
            .map_err(|e| BackendError::new(format!("rdma_cm listen on {addr}"), e))?;
        Ok(CmListener { inner })
    }
    #[cfg(not(feature = "verbs"))]
    {
        let _ = addr;
        Err(unsupported("rdma_cm listen"))
    }
}

/// One connection request, not yet judged: accept it
/// ([`CmRequest::pending`], then [`super::Link::cm_accept`]) or reject it
/// ([`CmRequest::reject`]). Dropped, it is rejected.
pub struct CmRequest {
    #[cfg(feature = "verbs")]
    inner: cqd_verbs::cm::ConnRequest,
    #[cfg(not(feature = "verbs"))]
    inner: std::convert::Infallible,
}

impl std::fmt::Debug for CmRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CmRequest")
            .field("from", &self.peer_addr())
            .finish()
    }
}

impl CmRequest {
    /// The requester's private data.
    pub fn private_data(&self) -> &[u8] {
        #[cfg(feature = "verbs")]
        return self.inner.private_data();
        #[cfg(not(feature = "verbs"))]
        match self.inner {}
    }

    /// The requester's address, as its CM reports it.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        #[cfg(feature = "verbs")]
        return self.inner.peer_addr();
        #[cfg(not(feature = "verbs"))]
        match self.inner {}
    }

    /// The request, to accept on a link.
    pub fn pending(self) -> PendingCm {
        #[cfg(feature = "verbs")]
        return PendingCm(Box::new(self.inner));
        #[cfg(not(feature = "verbs"))]
        match self.inner {}
    }

    /// Rejects the request with `reason` (its first [`REJECT_LEN`] bytes)
    /// as the reject's private data.
    ///
    /// # Errors
    /// The requester already gave up.
    pub fn reject(self, reason: &str) -> Result<(), BackendError> {
        #[cfg(feature = "verbs")]
        {
            let b = reason.as_bytes();
            self.inner
                .reject(&b[..b.len().min(REJECT_LEN)])
                .map_err(|e| BackendError::new("reject an rdma_cm request", e))
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = reason;
            match self.inner {}
        }
    }
}

impl CmListener {
    /// The next request within `timeout`, if one came.
    ///
    /// # Errors
    /// The CM delivered a request without an id.
    pub fn next(&self, timeout: Duration) -> Result<Option<CmRequest>, BackendError> {
        #[cfg(feature = "verbs")]
        {
            match self.inner.next_request(timeout) {
                Ok(inner) => Ok(Some(CmRequest { inner })),
                Err(cqd_verbs::cm::CmError::Timeout(_)) => Ok(None),
                Err(e) => Err(BackendError::new(
                    "wait for an rdma_cm connection request",
                    e,
                )),
            }
        }
        #[cfg(not(feature = "verbs"))]
        {
            let _ = timeout;
            Err(unsupported("rdma_cm request"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_data_names_the_connection_and_carries_its_mac() {
        let mac = [0xa5; CM_MAC_LEN];
        let mut d = request_data(7, &mac);
        assert_eq!(d.len(), REQ_LEN);
        d.resize(56, 0);
        assert_eq!(parse_request(&d), Some((7, mac)));
        assert_eq!(parse_request(&d[..REQ_LEN - 1]), None, "a MAC cut short");
        assert_eq!(parse_request(b"cqd-demo"), None);
        assert_eq!(parse_request(b"something else entirely, long enough"), None);
    }
}
