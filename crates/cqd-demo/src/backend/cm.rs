//! Connections through rdma_cm (`--cm rdmacm`, verbs only), as NVMe over
//! Fabrics connects its queues: the server listens on its `--listen`
//! address, the load connects each of its connections there, naming the
//! connection in the request's private data. The TCP session still carries
//! the handshake (geometry, `done`, `bye`); only the queue pairs' endpoints
//! go through the CM instead of the TCP messages.

use std::any::Any;
use std::net::SocketAddr;
use std::time::Duration;

use super::BackendError;

/// The private data of a connection request: this tag, then the
/// connection's number (little-endian u32).
pub const REQ_TAG: &[u8; 8] = b"cqd-demo";

/// The request's private data for connection `conn`.
pub fn request_data(conn: u32) -> Vec<u8> {
    let mut v = REQ_TAG.to_vec();
    v.extend_from_slice(&conn.to_le_bytes());
    v
}

/// The connection number in a request's private data, if it is one of
/// ours (rdma_cm pads private data with zeros).
pub fn conn_of(private_data: &[u8]) -> Option<u32> {
    let rest = private_data.strip_prefix(&REQ_TAG[..])?;
    let b: [u8; 4] = rest.get(..4)?.try_into().ok()?;
    Some(u32::from_le_bytes(b))
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

impl CmListener {
    /// The next request within `timeout`: its connection number and the
    /// request. A request that is not a cqd-demo one is rejected.
    ///
    /// # Errors
    /// Nothing within `timeout`; a request without a connection number.
    pub fn next(&self, timeout: Duration) -> Result<(u32, PendingCm), BackendError> {
        #[cfg(feature = "verbs")]
        {
            let req = self
                .inner
                .next_request(timeout)
                .map_err(|e| BackendError::new("wait for an rdma_cm connection request", e))?;
            match conn_of(req.private_data()) {
                Some(n) => Ok((n, PendingCm(Box::new(req)))),
                None => {
                    let _ = req.reject(b"not a cqd-demo connection");
                    Err(BackendError::new(
                        "an rdma_cm connection request",
                        "its private data does not name a cqd-demo connection",
                    ))
                }
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
    fn request_data_names_the_connection() {
        let mut d = request_data(7);
        d.resize(56, 0);
        assert_eq!(conn_of(&d), Some(7));
        assert_eq!(conn_of(b"cqd-demo"), None);
        assert_eq!(conn_of(b"something else entirely"), None);
    }
}
