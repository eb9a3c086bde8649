//! `softrdma devices` and `softrdma devinfo`, after `ibv_devices` and `ibv_devinfo`.

use std::net::Ipv6Addr;

use serde::Serialize;
use softrdma::{DeviceAttr, DeviceInfo, Gid, Mtu, PortAttr};

use crate::{output, session};
use crate::{CmdResult, DevOpts};

fn gid_text(g: &Gid) -> String {
    Ipv6Addr::from(g.0).to_string()
}

/// A GID in `ibv_devinfo`'s form: eight groups of four hex digits.
fn gid_groups(g: &Gid) -> String {
    g.0.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// A GUID as `ibv_devinfo` prints it: four groups of four hex digits.
fn guid_text(g: u64) -> String {
    let b = g.to_be_bytes();
    b.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

fn list() -> CmdResult<Vec<DeviceInfo>> {
    softrdma::devices().map_err(|e| format!("device configuration: {e}"))
}

fn addr_note(d: &DeviceInfo) -> &'static str {
    if d.auto {
        " (automatic: first free loopback address when opened)"
    } else {
        ""
    }
}

/// The `--json` form of both commands: `{"devices": [...]}`.
#[derive(Serialize)]
struct DeviceList<T> {
    devices: Vec<T>,
}

/// A device in `softrdma devices --json`.
#[derive(Serialize)]
struct DeviceJson<'a> {
    name: &'a str,
    addr: String,
    auto: bool,
    gid: String,
    gid_wire: String,
}

/// `softrdma devices`.
pub fn devices(json: bool) -> CmdResult {
    let l = list()?;
    if json {
        return output::print_json(&DeviceList {
            devices: l
                .iter()
                .map(|d| DeviceJson {
                    name: &d.name,
                    addr: d.addr.to_string(),
                    auto: d.auto,
                    gid: gid_text(&d.gid),
                    gid_wire: softrdma::pingpong::gid_to_hex(&d.gid),
                })
                .collect(),
        });
    }
    outln!("    {:<16}\t{:<22}\tGID[0]", "device", "address");
    outln!("    {:<16}\t{:<22}\t------", "------", "-------");
    for d in &l {
        outln!(
            "    {:<16}\t{:<22}\t{}{}",
            d.name,
            d.addr.to_string(),
            gid_text(&d.gid),
            addr_note(d)
        );
    }
    Ok(())
}

fn mtu_text(m: Mtu) -> String {
    format!("{} ({})", m.bytes(), m as u32)
}

fn port_state(s: u32) -> &'static str {
    match s {
        1 => "PORT_DOWN",
        2 => "PORT_INIT",
        3 => "PORT_ARMED",
        4 => "PORT_ACTIVE",
        5 => "PORT_ACTIVE_DEFER",
        _ => "PORT_NOP",
    }
}

/// A device in `softrdma devinfo --json`.
#[derive(Serialize)]
struct DevinfoJson<'a> {
    name: &'a str,
    /// The configured address (for an automatic device, the one it would take now).
    addr: String,
    auto: bool,
    #[serde(flatten)]
    state: DevState,
}

/// What devinfo learnt by opening the device, or why it could not.
#[derive(Serialize)]
#[serde(untagged)]
enum DevState {
    Opened(Box<OpenedJson>),
    NotOpened {
        /// GID index 0, from the configured address.
        gids: [String; 1],
        error: String,
    },
}

/// The attributes of a device devinfo opened.
#[derive(Serialize)]
struct OpenedJson {
    /// The address the device was bound to when devinfo opened it.
    bound_addr: String,
    fw_ver: String,
    node_guid: String,
    sys_image_guid: String,
    vendor_id: u32,
    vendor_part_id: u32,
    hw_ver: u32,
    phys_port_cnt: u32,
    ports: [PortJson; 1],
    /// Present with `-v`.
    #[serde(flatten)]
    limits: Option<LimitsJson>,
    gids: Vec<GidJson>,
}

/// Port 1 in `devinfo --json`.
#[derive(Serialize)]
struct PortJson {
    port: u32,
    state: &'static str,
    max_mtu: usize,
    active_mtu: usize,
    lid: u16,
    link_layer: &'static str,
    gid_tbl_len: i32,
    max_msg_sz: u32,
}

/// The device limits `devinfo -v --json` adds.
#[derive(Serialize)]
struct LimitsJson {
    max_qp: u32,
    max_qp_wr: u32,
    max_sge: u32,
    max_cq: u32,
    max_cqe: u32,
    max_mr: u32,
    max_mr_size: u64,
    max_pd: u32,
    max_qp_rd_atom: u32,
    max_qp_init_rd_atom: u32,
}

/// One entry of the GID table in `devinfo --json`.
#[derive(Serialize)]
struct GidJson {
    index: i32,
    gid: String,
    ip: String,
    #[serde(rename = "type")]
    ty: &'static str,
}

fn opened_json(
    bound: std::net::SocketAddr,
    attr: &DeviceAttr,
    port: &PortAttr,
    gids: &[(i32, Gid)],
    verbose: bool,
) -> OpenedJson {
    OpenedJson {
        bound_addr: bound.to_string(),
        fw_ver: attr.fw_ver.clone(),
        node_guid: guid_text(attr.node_guid),
        sys_image_guid: guid_text(attr.sys_image_guid),
        vendor_id: attr.vendor_id,
        vendor_part_id: attr.vendor_part_id,
        hw_ver: attr.hw_ver,
        phys_port_cnt: 1,
        ports: [PortJson {
            port: 1,
            state: port_state(port.state),
            max_mtu: port.max_mtu.bytes(),
            active_mtu: port.active_mtu.bytes(),
            lid: port.lid,
            link_layer: "Ethernet",
            gid_tbl_len: port.gid_tbl_len,
            max_msg_sz: port.max_msg_sz,
        }],
        limits: verbose.then_some(LimitsJson {
            max_qp: attr.max_qp,
            max_qp_wr: attr.max_qp_wr,
            max_sge: attr.max_sge,
            max_cq: attr.max_cq,
            max_cqe: attr.max_cqe,
            max_mr: attr.max_mr,
            max_mr_size: attr.max_mr_size,
            max_pd: attr.max_pd,
            max_qp_rd_atom: attr.max_qp_rd_atom,
            max_qp_init_rd_atom: attr.max_qp_init_rd_atom,
        }),
        gids: gids
            .iter()
            .map(|(i, g)| GidJson {
                index: *i,
                gid: gid_text(g),
                ip: g.to_ip().to_string(),
                ty: "RoCE v2",
            })
            .collect(),
    }
}

/// `softrdma devinfo [-v]`: opens each device briefly to query it.
pub fn devinfo(only: Option<&str>, verbose: bool, json: bool) -> CmdResult {
    let l = list()?;
    let l: Vec<&DeviceInfo> = match only {
        Some(n) => {
            let v: Vec<&DeviceInfo> = l.iter().filter(|d| d.name == n).collect();
            if v.is_empty() {
                return Err(format!("IB device {n} not found"));
            }
            v
        }
        None => l.iter().collect(),
    };
    let mut out = Vec::new();
    for d in l {
        let opts = DevOpts {
            device: Some(d.name.clone()),
            ..Default::default()
        };
        let mut cfg = session::device_config(&opts)?;
        cfg.pcap = None;
        let dev = softrdma::Device::open_with(&cfg);
        let state = match dev {
            Err(e) => {
                // The address is taken (the device is open in another process): what the
                // configuration says is still what a peer needs.
                if !json {
                    outln!("hca_id:\t{}", d.name);
                    outln!("\ttransport:\t\t\tRoCEv2 over UDP (softrdma)");
                    outln!("\taddress:\t\t\t{}{}", d.addr, addr_note(d));
                    outln!("\tGID[  0]:\t\t\t{}, RoCE v2", gid_text(&d.gid));
                    outln!("\tstate:\t\t\t\tnot opened here ({e})");
                    outln!();
                }
                DevState::NotOpened {
                    gids: [gid_text(&d.gid)],
                    error: e.to_string(),
                }
            }
            Ok(dev) => {
                let attr = dev.query_device();
                let port = dev
                    .query_port(1)
                    .map_err(|e| format!("{}: query port: {e}", d.name))?;
                let mut gids = Vec::new();
                for i in 0..port.gid_tbl_len.clamp(0, 256) {
                    match dev.query_gid(i as u8) {
                        Ok(g) if g != Gid::default() => gids.push((i, g)),
                        _ => {}
                    }
                }
                if !json {
                    outln!("hca_id:\t{}", d.name);
                    outln!("\ttransport:\t\t\tRoCEv2 over UDP (softrdma)");
                    outln!("\taddress:\t\t\t{}{}", dev.addr(), addr_note(d));
                    outln!("\tfw_ver:\t\t\t\t{}", attr.fw_ver);
                    outln!("\tnode_guid:\t\t\t{}", guid_text(attr.node_guid));
                    outln!("\tsys_image_guid:\t\t\t{}", guid_text(attr.sys_image_guid));
                    outln!("\tvendor_id:\t\t\t0x{:04x}", attr.vendor_id);
                    outln!("\tvendor_part_id:\t\t\t{}", attr.vendor_part_id);
                    outln!("\thw_ver:\t\t\t\t0x{:x}", attr.hw_ver);
                    if verbose {
                        outln!("\tmax_mr_size:\t\t\t0x{:x}", attr.max_mr_size);
                        outln!("\tpage_size_cap:\t\t\t0x{:x}", attr.page_size_cap);
                        outln!("\tmax_qp:\t\t\t\t{}", attr.max_qp);
                        outln!("\tmax_qp_wr:\t\t\t{}", attr.max_qp_wr);
                        outln!("\tdevice_cap_flags:\t\t0x{:08x}", attr.device_cap_flags);
                        outln!("\tmax_sge:\t\t\t{}", attr.max_sge);
                        outln!("\tmax_sge_rd:\t\t\t{}", attr.max_sge_rd);
                        outln!("\tmax_cq:\t\t\t\t{}", attr.max_cq);
                        outln!("\tmax_cqe:\t\t\t{}", attr.max_cqe);
                        outln!("\tmax_mr:\t\t\t\t{}", attr.max_mr);
                        outln!("\tmax_pd:\t\t\t\t{}", attr.max_pd);
                        outln!("\tmax_qp_rd_atom:\t\t\t{}", attr.max_qp_rd_atom);
                        outln!("\tmax_res_rd_atom:\t\t{}", attr.max_res_rd_atom);
                        outln!("\tmax_qp_init_rd_atom:\t\t{}", attr.max_qp_init_rd_atom);
                        outln!("\tatomic_cap:\t\t\t{}", attr.atomic_cap);
                    }
                    outln!("\tphys_port_cnt:\t\t\t1");
                    outln!("\t\tport:\t1");
                    outln!(
                        "\t\t\tstate:\t\t\t{} ({})",
                        port_state(port.state),
                        port.state
                    );
                    outln!("\t\t\tmax_mtu:\t\t{}", mtu_text(port.max_mtu));
                    outln!("\t\t\tactive_mtu:\t\t{}", mtu_text(port.active_mtu));
                    outln!("\t\t\tsm_lid:\t\t\t{}", port.sm_lid);
                    outln!("\t\t\tport_lid:\t\t{}", port.lid);
                    outln!("\t\t\tport_lmc:\t\t0x00");
                    outln!("\t\t\tlink_layer:\t\tEthernet");
                    if verbose {
                        outln!("\t\t\tmax_msg_sz:\t\t0x{:x}", port.max_msg_sz);
                        outln!("\t\t\tport_cap_flags:\t\t0x{:08x}", port.port_cap_flags);
                        outln!("\t\t\tgid_tbl_len:\t\t{}", port.gid_tbl_len);
                        outln!("\t\t\tpkey_tbl_len:\t\t{}", port.pkey_tbl_len);
                        for (i, g) in &gids {
                            outln!(
                                "\t\t\tGID[{i:>3}]:\t\t{}, RoCE v2\t(IP {})",
                                gid_groups(g),
                                g.to_ip()
                            );
                        }
                    } else if let Some((i, g)) = gids.first() {
                        outln!("\t\t\tGID[{i:>3}]:\t\t{} (IP {})", gid_text(g), g.to_ip());
                    }
                    outln!();
                }
                DevState::Opened(Box::new(opened_json(
                    dev.addr(),
                    &attr,
                    &port,
                    &gids,
                    verbose,
                )))
            }
        };
        out.push(DevinfoJson {
            name: &d.name,
            addr: d.addr.to_string(),
            auto: d.auto,
            state,
        });
    }
    if json {
        output::print_json(&DeviceList { devices: out })?;
    }
    Ok(())
}
