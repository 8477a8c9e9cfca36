//! cqd-sim: a software RDMA NIC for cqd.
