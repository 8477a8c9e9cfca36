//! The device-death rule (hot unplug, fatal firmware error), modelled on
//! what rdma-core providers and the kernel do once a device is gone:
//!
//! 1. the context gets one asynchronous `IBV_EVENT_DEVICE_FATAL`
//!    (`element.port_num` 0, as the kernel reports a disassociated device);
//! 2. every verb that would reach the device or the kernel fails with
//!    [`DEAD_ERRNO`]: posting (`bad_wr` = the first WR), arming a CQ,
//!    creating, modifying or querying objects; polling a CQ fails too
//!    (the queues are gone, nothing will ever complete);
//! 3. destroying, deregistering and deallocating still succeed, as
//!    libibverbs treats a destroy command failing with EIO after a device
//!    disassociation when `RDMAV_ALLOW_DISASSOC_DESTROY` is set: the
//!    application can always clean up;
//! 4. a requester of another context (any process) that targets a QP of the
//!    dead context gets `IBV_WC_RETRY_EXC_ERR`, as for a responder that
//!    stopped answering; sends already waiting for it complete the same way.
//!
//! Death is one-way: a context never comes back; close it and open another.

/// `IBV_EVENT_DEVICE_FATAL` (`enum ibv_event_type`).
pub const EVENT_DEVICE_FATAL: u32 = 8;

/// The errno of every verb refused on a dead context.
pub const DEAD_ERRNO: i32 = libc::EIO;

#[cfg(test)]
mod tests {
    #[test]
    fn numbers_are_the_abi_ones() {
        assert_eq!(super::EVENT_DEVICE_FATAL, 8);
        assert_eq!(super::DEAD_ERRNO, 5);
    }
}
