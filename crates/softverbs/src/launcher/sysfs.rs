//! The fake sysfs tree libibverbs' sysfs discovery reads (see
//! docs/softverbs.md for the files and why each is needed).

use std::path::Path;

use super::{os, LaunchError};
use crate::provider::DEVICE_NAME;

/// The files of the tree, relative to its root: (path, content).
pub fn files() -> Vec<(String, String)> {
    let ib = format!("class/infiniband/{DEVICE_NAME}");
    let guid = "0200:00ff:fe00:0001";
    vec![
        ("class/infiniband_verbs/abi_version".into(), "6".into()),
        (
            "class/infiniband_verbs/uverbs0/ibdev".into(),
            DEVICE_NAME.into(),
        ),
        ("class/infiniband_verbs/uverbs0/dev".into(), "1:7".into()),
        (
            "class/infiniband_verbs/uverbs0/abi_version".into(),
            "1".into(),
        ),
        // librdmacm's ABI check (rdma_cm, emulated by `crate::cm`).
        (
            "class/misc/rdma_cm/abi_version".into(),
            crate::cm::abi::ABI_VERSION.to_string(),
        ),
        // The device's network interface (every local address maps to the
        // device): loopback.
        (format!("{ib}/device/net/lo/ifindex"), "1".into()),
        (format!("{ib}/node_type"), "1: CA".into()),
        (format!("{ib}/node_guid"), guid.into()),
        (format!("{ib}/sys_image_guid"), guid.into()),
        (format!("{ib}/board_id"), "SOFTVERBS".into()),
        (format!("{ib}/fw_ver"), "0.1.0".into()),
        (format!("{ib}/hw_rev"), "1".into()),
        (format!("{ib}/hca_type"), "softverbs".into()),
        (
            format!("{ib}/node_desc"),
            "softverbs userspace device".into(),
        ),
        (
            format!("{ib}/device/modalias"),
            format!("rdma_device:N{DEVICE_NAME}"),
        ),
        (
            format!("{ib}/ports/1/gids/0"),
            "fe80:0000:0000:0000:0200:00ff:fe00:0001".into(),
        ),
        (
            format!("{ib}/ports/1/gid_attrs/types/0"),
            "IB/RoCE v1".into(),
        ),
        // A GID table of two entries with the second empty, as real ports
        // have unpopulated entries (gid_tbl_len in query_port).
        (
            format!("{ib}/ports/1/gids/1"),
            "0000:0000:0000:0000:0000:0000:0000:0000".into(),
        ),
        (
            format!("{ib}/ports/1/gid_attrs/types/1"),
            "IB/RoCE v1".into(),
        ),
        (format!("{ib}/ports/1/pkeys/0"), "0xffff".into()),
        (format!("{ib}/ports/1/link_layer"), "InfiniBand".into()),
        (format!("{ib}/ports/1/state"), "4: ACTIVE".into()),
        (format!("{ib}/ports/1/phys_state"), "5: LinkUp".into()),
        (format!("{ib}/ports/1/lid"), "0x1".into()),
        (format!("{ib}/ports/1/rate"), "100 Gb/sec (4X EDR)".into()),
    ]
}

/// Write the tree under `root`.
///
/// # Errors
/// [`LaunchError::Os`] on a failed write.
pub fn build(root: &Path) -> Result<(), LaunchError> {
    for (rel, content) in files() {
        let p = root.join(rel);
        if let Some(d) = p.parent() {
            std::fs::create_dir_all(d).map_err(os(format!("creating {}", d.display())))?;
        }
        std::fs::write(&p, format!("{content}\n"))
            .map_err(os(format!("writing {}", p.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn tree_has_the_discovery_files() {
        let f = super::files();
        for need in [
            "class/infiniband_verbs/abi_version",
            "class/infiniband_verbs/uverbs0/dev",
        ] {
            assert!(f.iter().any(|(p, _)| p == need), "{need}");
        }
    }
}
