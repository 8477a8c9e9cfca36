//! Address handles and the datagram path: where a UD send goes, and what
//! the receiver finds.
//!
//! A UD send names its destination per request: an address handle (the
//! port: a LID, or a GID with a global route), the destination QP number
//! and the Q_Key ([`UdDest`]). The simulated NIC delivers a datagram as a
//! UD QP of real hardware does, in this order:
//!
//! 1. the local SGEs are checked (a bad one: `LOC_PROT_ERR`, the sender's
//!    QP to ERR); a datagram longer than the port's MTU
//!    ([`DeviceAttr::active_mtu`](crate::DeviceAttr::active_mtu)) is not
//!    sent: `LOC_LEN_ERR` (cqd's posting call refuses it before);
//! 2. the datagram is **dropped**, and the send still succeeds (UD is
//!    unreliable, nothing comes back), when the AH does not reach the
//!    destination QP's device (LID, or GID for a global AH), when that QP
//!    does not exist, is not UD, is not at RTR or later, has another Q_Key
//!    (a Q_Key with its high-order bit set means the sender's own), or has
//!    no receive posted (no RNR wait);
//! 3. the receive buffer gets the 40-byte GRH ([`GRH_LEN`]) and then the
//!    payload; `byte_len` is 40 + payload. With a global AH the GRH is
//!    InfiniBand's, in network order (IP version 6, the AH's traffic class
//!    and flow label, `PayLen`, next header 0x1B, hop limit, source GID =
//!    the sender device's, destination GID = the AH's) and `IBV_WC_GRH` is
//!    set; without one the 40 bytes are zeros and the flag is clear;
//! 4. the completion carries `src_qp` = the sender's QPN, `slid` = the
//!    sender device's LID, `sl` = the AH's, `pkey_index` 0, the immediate
//!    for SEND_WITH_IMM; a buffer shorter than 40 + payload completes that
//!    receive with `LOC_LEN_ERR` (nothing written, the QP stays up).

use cqd_core::completion::{Completion, Opcode, Status, WcFlags, GRH_LEN};

use crate::device::Device;
use crate::error::VerbsError;
use crate::exec::Outcome;
use crate::pd::Pd;
use crate::qp::{QpState, QpType};
use crate::state::{FabricState, PendingSend};

/// The global route of an address handle (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grh {
    /// The destination GID.
    pub dgid: [u8; 16],
    /// Flow label (20 bits).
    pub flow_label: u32,
    /// Traffic class.
    pub traffic_class: u8,
    /// Hop limit.
    pub hop_limit: u8,
}

/// What an address handle names (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AhAttr {
    /// The destination port's LID (ignored with a global route).
    pub dlid: u16,
    /// Service level, reported to the receiver.
    pub sl: u8,
    /// A global route: the datagram carries a GRH.
    pub grh: Option<Grh>,
}

impl AhAttr {
    /// Towards `device`'s port by LID (no GRH).
    pub fn to_lid(device: &Device) -> Self {
        AhAttr {
            dlid: device.lid(),
            sl: 0,
            grh: None,
        }
    }

    /// Towards `device`'s port by GID (with a GRH, hop limit 64).
    pub fn to_gid(device: &Device) -> Self {
        AhAttr {
            dlid: 0,
            sl: 0,
            grh: Some(Grh {
                dgid: device.gid(),
                hop_limit: 64,
                ..Grh::default()
            }),
        }
    }
}

/// An address handle (`ibv_create_ah`). Cloneable; holds no resource of
/// the NIC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ah {
    pub(crate) pd: u32,
    pub(crate) attr: AhAttr,
}

impl Ah {
    /// What the handle names.
    pub fn attr(&self) -> AhAttr {
        self.attr
    }
}

/// Where a UD send goes (`wr.ud`: `ah`, `remote_qpn`, `remote_qkey`).
#[derive(Debug, Clone, Copy)]
pub struct UdDest<'a> {
    /// The address handle.
    pub ah: &'a Ah,
    /// The destination QP.
    pub qpn: u32,
    /// The Q_Key; with its high-order bit set, the sending QP's own.
    pub qkey: u32,
}

/// The LID of the device numbered `id` on its fabric.
pub(crate) fn lid_of(id: u32) -> u16 {
    (id as u16).wrapping_add(1).max(1)
}

/// The GID of the device numbered `id`: a link-local address derived from
/// its number, as a port's GID 0 is from its GUID.
pub(crate) fn gid_of(id: u32) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0] = 0xfe;
    g[1] = 0x80;
    g[8..12].copy_from_slice(&[0x02, 0x00, 0x00, 0xff]);
    g[12..16].copy_from_slice(&(id + 1).to_be_bytes());
    g
}

impl Pd {
    /// Creates an address handle.
    ///
    /// # Errors
    /// [`VerbsError::BadAh`] for LID 0 without a global route, or a flow
    /// label wider than 20 bits; [`VerbsError::DeviceGone`].
    pub fn create_ah(&self, attr: AhAttr) -> Result<Ah, VerbsError> {
        self.device.check_present()?;
        match attr.grh {
            None if attr.dlid == 0 => Err(VerbsError::BadAh {
                why: "LID 0 without a global route names no port",
            }),
            Some(g) if g.flow_label > 0xf_ffff => Err(VerbsError::BadAh {
                why: "the flow label is 20 bits",
            }),
            _ => Ok(Ah { pd: self.id, attr }),
        }
    }
}

/// A datagram in flight (the part of a UD send request the NIC keeps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Datagram {
    pub(crate) imm: Option<u32>,
    pub(crate) ah: AhAttr,
    pub(crate) qpn: u32,
    pub(crate) qkey: u32,
}

/// The 40-byte GRH of a datagram of `len` payload bytes (network order).
fn grh_bytes(g: &Grh, sgid: [u8; 16], len: u64, imm: bool) -> [u8; GRH_LEN as usize] {
    let mut h = [0u8; GRH_LEN as usize];
    let word0 = (6u32 << 28) | (u32::from(g.traffic_class) << 20) | (g.flow_label & 0xf_ffff);
    h[0..4].copy_from_slice(&word0.to_be_bytes());
    // BTH 12 + DETH 8 (+ immediate 4) + payload + ICRC 4.
    let paylen = 12 + 8 + if imm { 4 } else { 0 } + len + 4;
    h[4..6].copy_from_slice(&(paylen.min(0xffff) as u16).to_be_bytes());
    h[6] = 0x1b;
    h[7] = g.hop_limit;
    h[8..24].copy_from_slice(&sgid);
    h[24..40].copy_from_slice(&g.dgid);
    h
}

impl FabricState {
    /// Steps 1–4 of the module documentation for one UD send of `qpn`.
    pub(crate) fn execute_ud(&mut self, qpn: u32, wr: &PendingSend, d: &Datagram) -> Outcome {
        let Some(q) = self.qps.get(&qpn) else {
            return Outcome::Fail(Status::Fatal);
        };
        let (pd, own_qkey, device, mtu) = (q.pd, q.qkey, q.device, q.mtu);
        // 1. Local.
        let Some(len) = self.check_sges(pd, &wr.sges, false) else {
            return Outcome::Fail(Status::LocalProtection);
        };
        if len > u64::from(mtu) {
            return Outcome::Fail(Status::LocalLength);
        }
        let sent = Outcome::Ok {
            opcode: Opcode::Send,
            byte_len: 0,
        };
        // 2. The destination, or a silent drop.
        let qkey = if d.qkey & 0x8000_0000 != 0 {
            own_qkey
        } else {
            d.qkey
        };
        let reaches = |dev: u32| match d.ah.grh {
            Some(g) => g.dgid == gid_of(dev),
            None => d.ah.dlid == lid_of(dev),
        };
        let peer = match self.qps.get(&d.qpn) {
            Some(p)
                if p.qp_type == QpType::Ud
                    && !p.destroyed
                    && matches!(p.state, QpState::Rtr | QpState::Rts)
                    && p.qkey == qkey
                    && reaches(p.device) =>
            {
                (d.qpn, p.pd)
            }
            _ => {
                self.stats.dropped += 1;
                return sent;
            }
        };
        let (peer, peer_pd) = peer;
        let Some(data) = self.gather(&wr.sges) else {
            return Outcome::Fail(Status::LocalProtection);
        };
        let Some(recv) = self.take_recv(peer) else {
            self.stats.dropped += 1;
            return sent;
        };
        // 3. GRH and payload.
        let mut wc = Completion::success(recv.wr_id, Opcode::Recv, peer);
        match self.check_sges(peer_pd, &recv.sges, true) {
            Some(room) if room >= u64::from(GRH_LEN) + len => {}
            Some(_) => {
                wc.status = Status::LocalLength;
                wc.opcode = Opcode::from_raw(u32::MAX);
                self.complete_recv(peer, wc, false);
                return sent;
            }
            None => {
                wc.status = Status::LocalProtection;
                wc.opcode = Opcode::from_raw(u32::MAX);
                self.complete_recv(peer, wc, false);
                return sent;
            }
        }
        let mut buf = Vec::with_capacity(GRH_LEN as usize + data.len());
        match &d.ah.grh {
            Some(g) => {
                buf.extend_from_slice(&grh_bytes(g, gid_of(device), len, d.imm.is_some()));
                wc.wc_flags = WcFlags(WcFlags::GRH);
            }
            None => buf.resize(GRH_LEN as usize, 0),
        }
        buf.extend_from_slice(&data);
        self.scatter(&recv.sges, &buf);
        // 4. The receiver's completion.
        wc.byte_len = GRH_LEN + len as u32;
        wc.src_qp = qpn;
        wc.slid = lid_of(device);
        wc.sl = d.ah.sl;
        if let Some(imm) = d.imm {
            wc.imm_data = imm;
            wc.wc_flags = WcFlags(wc.wc_flags.0 | WcFlags::WITH_IMM);
        }
        self.complete_recv(peer, wc, wr.solicited);
        sent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grh_is_infiniband_s_in_network_order() {
        let g = Grh {
            dgid: gid_of(7),
            flow_label: 0xabcde,
            traffic_class: 0x5a,
            hop_limit: 9,
        };
        let h = grh_bytes(&g, gid_of(2), 100, true);
        assert_eq!(h[0] >> 4, 6, "IP version 6");
        assert_eq!(((h[0] & 0xf) << 4) | (h[1] >> 4), 0x5a, "traffic class");
        assert_eq!(
            u32::from_be_bytes([0, h[1] & 0xf, h[2], h[3]]),
            0xabcde,
            "flow label"
        );
        assert_eq!(u16::from_be_bytes([h[4], h[5]]), 12 + 8 + 4 + 100 + 4);
        assert_eq!((h[6], h[7]), (0x1b, 9));
        assert_eq!(h[8..24], gid_of(2));
        assert_eq!(h[24..40], gid_of(7));
    }

    #[test]
    fn addresses_of_devices_differ() {
        assert_ne!(lid_of(0), 0);
        assert_ne!(lid_of(0), lid_of(1));
        assert_ne!(gid_of(0), gid_of(1));
        assert_eq!(gid_of(0)[..2], [0xfe, 0x80]);
    }
}
