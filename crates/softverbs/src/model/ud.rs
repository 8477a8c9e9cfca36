//! Unreliable datagram (UD) semantics: address handles, the Global Route
//! Header a receive buffer starts with, Q_Keys and the MTU limit.
//!
//! - **Receive buffer.** Every UD receive gets 40 bytes of GRH first, then
//!   the payload; the completion's `byte_len` is 40 + payload. When the
//!   sender's address handle is global (`is_global`), the GRH is filled as
//!   InfiniBand's GRH (all fields network order): IP version 6, traffic
//!   class and flow label from the AH, `PayLen` (the bytes after the GRH:
//!   BTH 12 + DETH 8 + immediate 4 if any + payload + ICRC 4), next header
//!   0x1B (IBA transport), hop limit from the AH, source GID = the sender
//!   port's GID at `sgid_index`, destination GID from the AH; the
//!   completion has `IBV_WC_GRH`. Otherwise the 40 bytes are zeros (the
//!   verbs say "undefined") and `IBV_WC_GRH` is clear.
//! - **Q_Key.** The message carries `remote_qkey` of the work request, or
//!   the sending QP's own Q_Key when that value has its high-order bit set
//!   (InfiniBand: a "controlled" Q_Key is taken from the QP context). A
//!   receiving QP whose Q_Key differs drops the message silently; so does
//!   one that is not UD, not at RTR or later, or has no receive posted: UD
//!   is unreliable, the sender's completion is a success either way.
//! - **MTU.** A message longer than the port's MTU is not sent; the
//!   sender's completion is `IBV_WC_LOC_LEN_ERR` and its QP enters SQE.
//!   A message longer than the receive buffer (minus the GRH) completes
//!   that receive with `IBV_WC_LOC_LEN_ERR`; the receiving QP stays up.
//! - **Multicast.** A UD QP joins a group with `ibv_attach_mcast(qp, mgid,
//!   mlid)`: the GID must be a multicast GID (first byte 0xFF), the LID a
//!   multicast LID (0xC000..=0xFFFE). A send whose `remote_qpn` is
//!   [`MULTICAST_QPN`] through a global AH whose DGID is a multicast GID and
//!   whose DLID is a multicast LID goes to every QP attached to that MGID,
//!   the sending QP included when it is attached (InfiniBand loops a
//!   multicast back to an attached sender unless the QP was created to
//!   block it); each receiver checks its Q_Key and completes as for a
//!   unicast message (`src_qp` the sender's QPN, `IBV_WC_GRH`, the GRH's
//!   destination GID the MGID). Anything else sent to QPN 0xFFFFFF is
//!   dropped, as a switch drops a multicast packet with no group.
//! - **Completion.** `src_qp` is the sender's QPN, `slid` the sender port's
//!   LID (1), `sl` the AH's service level, `pkey_index` the receiving QP's
//!   (0: the table has one entry).

/// Bytes of the Global Route Header at the start of every UD receive.
pub const GRH_LEN: usize = 40;

/// The port's MTU in bytes (`IBV_MTU_4096`, reported as `active_mtu`).
pub const PORT_MTU: u64 = 4096;

/// The port's LID (every softverbs port has LID 1).
pub const PORT_LID: u16 = 1;

/// The port's only GID (index 0), as the launcher's sysfs tree announces it
/// (`fe80::200:ff:fe00:1`).
pub const PORT_GID: [u8; 16] = [
    0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0, 0, 0xff, 0xfe, 0, 0, 0x01,
];

/// The destination QPN of a multicast send (`remote_qpn`).
pub const MULTICAST_QPN: u32 = 0x00ff_ffff;

/// The first multicast LID; 0xFFFF (the permissive LID) is not one.
pub const MCAST_LID_BASE: u16 = 0xc000;

/// Multicast groups the fabric holds at most (`max_mcast_grp`).
pub const MAX_MCAST_GRP: usize = 64;

/// QPs attached to one group at most (`max_mcast_qp_attach`).
pub const MAX_MCAST_QP_ATTACH: usize = 32;

/// Whether `gid` is a multicast GID (IPv6-style: first byte 0xFF).
pub fn is_mcast_gid(gid: &[u8; 16]) -> bool {
    gid[0] == 0xff
}

/// Whether `lid` is a multicast LID.
pub fn is_mcast_lid(lid: u16) -> bool {
    (MCAST_LID_BASE..0xffff).contains(&lid)
}

/// A Q_Key with this bit set in a work request means "use the QP's Q_Key".
pub const QKEY_FROM_QP: u32 = 0x8000_0000;

/// The Q_Key a UD message carries.
pub fn effective_qkey(wr_qkey: u32, qp_qkey: u32) -> u32 {
    if wr_qkey & QKEY_FROM_QP != 0 {
        qp_qkey
    } else {
        wr_qkey
    }
}

/// What a UD message takes from its address handle.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AhInfo {
    /// Destination LID.
    pub dlid: u16,
    /// Service level.
    pub sl: u8,
    /// Whether the GRH fields are valid.
    pub is_global: bool,
    /// Destination GID.
    pub dgid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Source GID index.
    pub sgid_index: u8,
    /// Hop limit.
    pub hop_limit: u8,
    /// Traffic class.
    pub traffic_class: u8,
}

/// The 40 bytes a UD receive buffer starts with for a message of
/// `payload` bytes (`imm`: with immediate data) sent through `ah`.
pub fn grh(ah: &AhInfo, payload: u32, imm: bool) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    if !ah.is_global {
        return g;
    }
    let vtf = (6u32 << 28) | (u32::from(ah.traffic_class) << 20) | (ah.flow_label & 0xf_ffff);
    g[0..4].copy_from_slice(&vtf.to_be_bytes());
    // BTH + DETH (+ ImmDt) + payload + ICRC, saturated at the 16-bit field.
    let paylen = 12 + 8 + if imm { 4 } else { 0 } + payload + 4;
    g[4..6].copy_from_slice(&(paylen.min(0xffff) as u16).to_be_bytes());
    g[6] = 0x1b;
    g[7] = ah.hop_limit;
    g[8..24].copy_from_slice(&PORT_GID);
    g[24..40].copy_from_slice(&ah.dgid);
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grh_zero_unless_global() {
        let mut ah = AhInfo::default();
        assert_eq!(grh(&ah, 100, false), [0u8; GRH_LEN]);
        ah.is_global = true;
        ah.hop_limit = 64;
        ah.traffic_class = 0x12;
        ah.flow_label = 0x34567;
        ah.dgid = [7; 16];
        let g = grh(&ah, 100, true);
        assert_eq!(&g[0..4], &[0x61, 0x23, 0x45, 0x67]);
        assert_eq!(u16::from_be_bytes([g[4], g[5]]), 12 + 8 + 4 + 100 + 4);
        assert_eq!((g[6], g[7]), (0x1b, 64));
        assert_eq!(&g[8..24], &PORT_GID);
        assert_eq!(&g[24..40], &[7; 16]);
    }

    #[test]
    fn multicast_addresses() {
        let mut g = [0u8; 16];
        assert!(!is_mcast_gid(&g));
        g[0] = 0xff;
        assert!(is_mcast_gid(&g));
        assert!(!is_mcast_lid(1));
        assert!(!is_mcast_lid(0xbfff));
        assert!(is_mcast_lid(0xc000));
        assert!(is_mcast_lid(0xfffe));
        assert!(!is_mcast_lid(0xffff));
    }

    #[test]
    fn controlled_qkey_comes_from_the_qp() {
        assert_eq!(effective_qkey(0x1111_1111, 5), 0x1111_1111);
        assert_eq!(effective_qkey(0x8000_0000, 5), 5);
    }
}
