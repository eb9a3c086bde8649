//! Device and port attributes, the GID table and the P_Key table.

use super::{einval, limits, Context};
use crate::error::Result;
use crate::types::{Gid, Mtu};

/// Device attributes (`ibv_device_attr`), with realistic values.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Firmware version string.
    pub fw_ver: String,
    /// Node GUID.
    pub node_guid: u64,
    /// System image GUID.
    pub sys_image_guid: u64,
    /// Largest MR.
    pub max_mr_size: u64,
    /// Supported page sizes.
    pub page_size_cap: u64,
    /// Vendor id.
    pub vendor_id: u32,
    /// Vendor part id.
    pub vendor_part_id: u32,
    /// Hardware version.
    pub hw_ver: u32,
    /// Max QPs.
    pub max_qp: u32,
    /// Max WRs per queue.
    pub max_qp_wr: u32,
    /// `IBV_DEVICE_*` capability flags.
    pub device_cap_flags: u32,
    /// Max SGEs per WR.
    pub max_sge: u32,
    /// Max SGEs per READ.
    pub max_sge_rd: u32,
    /// Max CQs.
    pub max_cq: u32,
    /// Max CQEs per CQ.
    pub max_cqe: u32,
    /// Max MRs.
    pub max_mr: u32,
    /// Max PDs.
    pub max_pd: u32,
    /// Max outstanding READ/atomic per QP as target.
    pub max_qp_rd_atom: u32,
    /// Max outstanding READ/atomic per EE.
    pub max_ee_rd_atom: u32,
    /// Max READ/atomic resources.
    pub max_res_rd_atom: u32,
    /// Max outstanding READ/atomic per QP as initiator.
    pub max_qp_init_rd_atom: u32,
    /// `IBV_ATOMIC_*` capability.
    pub atomic_cap: u32,
    /// Max memory windows.
    pub max_mw: u32,
    /// Max address handles.
    pub max_ah: u32,
    /// Max SRQs.
    pub max_srq: u32,
    /// Max WRs per SRQ.
    pub max_srq_wr: u32,
    /// Max SGEs per SRQ WR.
    pub max_srq_sge: u32,
    /// Max P_Keys.
    pub max_pkeys: u16,
    /// Local CA ACK delay.
    pub local_ca_ack_delay: u8,
    /// Number of ports.
    pub phys_port_cnt: u8,
    /// Max inline data.
    pub max_inline_data: u32,
    /// Max device memory bytes.
    pub max_dm_size: u64,
    /// Max multicast groups.
    pub max_mcast_grp: u32,
    /// Max QPs attached to one multicast group.
    pub max_mcast_qp_attach: u32,
    /// Max QP attachments to multicast groups in all.
    pub max_total_mcast_qp_attach: u32,
}

impl DeviceAttr {
    /// softrdma's attributes for a device with the given node GUID.
    pub(super) fn softrdma(node_guid: u64) -> DeviceAttr {
        DeviceAttr {
            fw_ver: concat!("softrdma ", env!("CARGO_PKG_VERSION")).to_string(),
            node_guid,
            sys_image_guid: node_guid,
            max_mr_size: u64::MAX,
            page_size_cap: 0xFFFF_F000,
            vendor_id: 0x00FF_FFFF,
            vendor_part_id: 0,
            hw_ver: 0,
            max_qp: 0x10000,
            max_qp_wr: 16384,
            // BAD_PKEY_CNTR | BAD_QKEY_CNTR | UD_AV_PORT_ENFORCE | PORT_ACTIVE_EVENT |
            // SYS_IMAGE_GUID | RC_RNR_NAK_GEN | SRQ_RESIZE | MEM_WINDOW | MEM_WINDOW_TYPE_2B
            device_cap_flags: 2 | 4 | 64 | 1024 | 2048 | 4096 | 8192 | (1 << 17) | (1 << 24),
            max_sge: 32,
            max_sge_rd: 32,
            max_cq: 0x10000,
            // As ConnectX devices report. A CQ holds its completions in a queue that grows
            // as they arrive, so a large size costs nothing until it is used; middleware
            // sizes CQs from its queue sizes times its peers (libfabric's RxM asks for
            // more than rxe's 32767 by default) and fails on a smaller device.
            max_cqe: (1 << 22) - 1,
            max_mr: 0x10000,
            max_pd: 0x10000,
            max_qp_rd_atom: 128,
            max_ee_rd_atom: 0,
            max_res_rd_atom: 0x3F000,
            max_qp_init_rd_atom: 128,
            atomic_cap: 1,
            max_mw: 0x10000,
            max_ah: (1 << 15) - 1,
            max_srq: 0x10000,
            max_srq_wr: 16384,
            max_srq_sge: 27,
            max_pkeys: limits::PKEY_TBL_LEN,
            local_ca_ack_delay: 15,
            phys_port_cnt: 1,
            max_inline_data: 32 * limits::SGE_BYTES,
            max_dm_size: limits::MAX_DM_SIZE,
            max_mcast_grp: limits::MAX_MCAST_GRP,
            max_mcast_qp_attach: limits::MAX_MCAST_QP_ATTACH,
            max_total_mcast_qp_attach: limits::MAX_TOTAL_MCAST_QP_ATTACH,
        }
    }
}

/// Port attributes (`ibv_port_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `IBV_PORT_*` state (4 = ACTIVE).
    pub state: u32,
    /// Largest MTU.
    pub max_mtu: Mtu,
    /// Active MTU.
    pub active_mtu: Mtu,
    /// GID table length.
    pub gid_tbl_len: i32,
    /// Capability flags.
    pub port_cap_flags: u32,
    /// Largest message.
    pub max_msg_sz: u32,
    /// P_Key table length.
    pub pkey_tbl_len: u16,
    /// LID (0 on RoCE).
    pub lid: u16,
    /// SM LID.
    pub sm_lid: u16,
    /// Active width code.
    pub active_width: u8,
    /// Active speed code.
    pub active_speed: u8,
    /// Physical state (5 = LINK_UP).
    pub phys_state: u8,
    /// Link layer (2 = Ethernet).
    pub link_layer: u8,
}

impl PortAttr {
    /// softrdma's port 1 with a GID table of `gid_tbl_len` entries.
    pub(super) fn softrdma(gid_tbl_len: usize) -> PortAttr {
        PortAttr {
            state: 4,
            max_mtu: Mtu::Mtu4096,
            active_mtu: Mtu::Mtu1024,
            gid_tbl_len: gid_tbl_len as i32,
            port_cap_flags: 1 << 16, // IB_PORT_CM_SUP, as rxe
            max_msg_sz: 0x8000_0000,
            pkey_tbl_len: limits::PKEY_TBL_LEN,
            lid: 0,
            sm_lid: 0,
            active_width: 2, // 4X
            active_speed: 8, // FDR10: 4X × 10 Gb/s
            phys_state: 5,
            link_layer: 2,
        }
    }
}

impl Context {
    /// Device attributes.
    pub fn device_attr(&self) -> &DeviceAttr {
        &self.dev
    }
    /// Port attributes (port 1 only).
    pub fn port_attr(&self, port: u8) -> Result<PortAttr> {
        if port != 1 {
            return Err(einval("no such port"));
        }
        Ok(self.port)
    }
    /// Set the port's active MTU (for example from the network MTU); EINVAL above `max_mtu`.
    pub fn set_active_mtu(&mut self, mtu: Mtu) -> Result<()> {
        if mtu > self.port.max_mtu {
            return Err(einval("MTU above the port maximum"));
        }
        self.port.active_mtu = mtu;
        Ok(())
    }
    /// The GID table.
    pub fn gids(&self) -> &[Gid] {
        &self.gids
    }
    /// GID at `index`.
    pub fn gid(&self, index: u8) -> Result<Gid> {
        self.gids
            .get(index as usize)
            .copied()
            .ok_or(einval("GID index out of range"))
    }
    /// P_Key at `index` (index 0 holds the default 0xFFFF).
    pub fn pkey(&self, index: u16) -> Result<u16> {
        self.pkeys
            .get(index as usize)
            .copied()
            .ok_or(einval("P_Key index out of range"))
    }
}
