//! `softrdma devices` and `softrdma devinfo`, after `ibv_devices` and `ibv_devinfo`.

use std::net::Ipv6Addr;

use softrdma::{DeviceInfo, Gid, Mtu};

use crate::json::Json;
use crate::util;
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

/// `softrdma devices`.
pub fn devices(json: bool) -> CmdResult {
    let l = list()?;
    if json {
        let arr: Vec<Json> = l
            .iter()
            .map(|d| {
                Json::obj()
                    .set("name", d.name.as_str())
                    .set("addr", d.addr.to_string())
                    .set("auto", d.auto)
                    .set("gid", gid_text(&d.gid))
                    .set("gid_wire", crate::exch::gid_to_wire(&d.gid))
            })
            .collect();
        println!("{}", Json::obj().set("devices", arr));
        return Ok(());
    }
    println!("    {:<16}\t{:<22}\tGID[0]", "device", "address");
    println!("    {:<16}\t{:<22}\t------", "------", "-------");
    for d in &l {
        println!(
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
        let mut cfg = util::device_config(&opts)?;
        cfg.pcap = None;
        let dev = softrdma::Device::open_with(&cfg);
        let mut j = Json::obj()
            .set("name", d.name.as_str())
            .set("addr", d.addr.to_string())
            .set("auto", d.auto);
        match dev {
            Err(e) => {
                // The address is taken (the device is open in another process): what the
                // configuration says is still what a peer needs.
                if !json {
                    println!("hca_id:\t{}", d.name);
                    println!("\ttransport:\t\t\tRoCEv2 over UDP (softrdma)");
                    println!("\taddress:\t\t\t{}{}", d.addr, addr_note(d));
                    println!("\tGID[  0]:\t\t\t{}, RoCE v2", gid_text(&d.gid));
                    println!("\tstate:\t\t\t\tnot opened here ({e})");
                    println!();
                }
                j.push("gids", vec![Json::Str(gid_text(&d.gid))]);
                j.push("error", e.to_string());
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
                if json {
                    j.push("addr", dev.addr().to_string());
                    j.push("fw_ver", attr.fw_ver.as_str());
                    j.push("node_guid", guid_text(attr.node_guid));
                    j.push("sys_image_guid", guid_text(attr.sys_image_guid));
                    j.push("vendor_id", attr.vendor_id);
                    j.push("vendor_part_id", attr.vendor_part_id);
                    j.push("hw_ver", attr.hw_ver);
                    j.push("phys_port_cnt", 1u32);
                    j.push(
                        "ports",
                        vec![Json::obj()
                            .set("port", 1u32)
                            .set("state", port_state(port.state))
                            .set("max_mtu", port.max_mtu.bytes())
                            .set("active_mtu", port.active_mtu.bytes())
                            .set("lid", port.lid)
                            .set("link_layer", "Ethernet")
                            .set("gid_tbl_len", port.gid_tbl_len)
                            .set("max_msg_sz", port.max_msg_sz)],
                    );
                    if verbose {
                        j.push("max_qp", attr.max_qp);
                        j.push("max_qp_wr", attr.max_qp_wr);
                        j.push("max_sge", attr.max_sge);
                        j.push("max_cq", attr.max_cq);
                        j.push("max_cqe", attr.max_cqe);
                        j.push("max_mr", attr.max_mr);
                        j.push("max_mr_size", attr.max_mr_size);
                        j.push("max_pd", attr.max_pd);
                        j.push("max_qp_rd_atom", attr.max_qp_rd_atom);
                        j.push("max_qp_init_rd_atom", attr.max_qp_init_rd_atom);
                    }
                    j.push(
                        "gids",
                        gids.iter()
                            .map(|(i, g)| {
                                Json::obj()
                                    .set("index", *i)
                                    .set("gid", gid_text(g))
                                    .set("ip", g.to_ip().to_string())
                                    .set("type", "RoCE v2")
                            })
                            .collect::<Vec<_>>(),
                    );
                } else {
                    println!("hca_id:\t{}", d.name);
                    println!("\ttransport:\t\t\tRoCEv2 over UDP (softrdma)");
                    println!("\taddress:\t\t\t{}{}", dev.addr(), addr_note(d));
                    println!("\tfw_ver:\t\t\t\t{}", attr.fw_ver);
                    println!("\tnode_guid:\t\t\t{}", guid_text(attr.node_guid));
                    println!("\tsys_image_guid:\t\t\t{}", guid_text(attr.sys_image_guid));
                    println!("\tvendor_id:\t\t\t0x{:04x}", attr.vendor_id);
                    println!("\tvendor_part_id:\t\t\t{}", attr.vendor_part_id);
                    println!("\thw_ver:\t\t\t\t0x{:x}", attr.hw_ver);
                    if verbose {
                        println!("\tmax_mr_size:\t\t\t0x{:x}", attr.max_mr_size);
                        println!("\tpage_size_cap:\t\t\t0x{:x}", attr.page_size_cap);
                        println!("\tmax_qp:\t\t\t\t{}", attr.max_qp);
                        println!("\tmax_qp_wr:\t\t\t{}", attr.max_qp_wr);
                        println!("\tdevice_cap_flags:\t\t0x{:08x}", attr.device_cap_flags);
                        println!("\tmax_sge:\t\t\t{}", attr.max_sge);
                        println!("\tmax_sge_rd:\t\t\t{}", attr.max_sge_rd);
                        println!("\tmax_cq:\t\t\t\t{}", attr.max_cq);
                        println!("\tmax_cqe:\t\t\t{}", attr.max_cqe);
                        println!("\tmax_mr:\t\t\t\t{}", attr.max_mr);
                        println!("\tmax_pd:\t\t\t\t{}", attr.max_pd);
                        println!("\tmax_qp_rd_atom:\t\t\t{}", attr.max_qp_rd_atom);
                        println!("\tmax_res_rd_atom:\t\t{}", attr.max_res_rd_atom);
                        println!("\tmax_qp_init_rd_atom:\t\t{}", attr.max_qp_init_rd_atom);
                        println!("\tatomic_cap:\t\t\t{}", attr.atomic_cap);
                    }
                    println!("\tphys_port_cnt:\t\t\t1");
                    println!("\t\tport:\t1");
                    println!(
                        "\t\t\tstate:\t\t\t{} ({})",
                        port_state(port.state),
                        port.state
                    );
                    println!("\t\t\tmax_mtu:\t\t{}", mtu_text(port.max_mtu));
                    println!("\t\t\tactive_mtu:\t\t{}", mtu_text(port.active_mtu));
                    println!("\t\t\tsm_lid:\t\t\t{}", port.sm_lid);
                    println!("\t\t\tport_lid:\t\t{}", port.lid);
                    println!("\t\t\tport_lmc:\t\t0x00");
                    println!("\t\t\tlink_layer:\t\tEthernet");
                    if verbose {
                        println!("\t\t\tmax_msg_sz:\t\t0x{:x}", port.max_msg_sz);
                        println!("\t\t\tport_cap_flags:\t\t0x{:08x}", port.port_cap_flags);
                        println!("\t\t\tgid_tbl_len:\t\t{}", port.gid_tbl_len);
                        println!("\t\t\tpkey_tbl_len:\t\t{}", port.pkey_tbl_len);
                        for (i, g) in &gids {
                            println!(
                                "\t\t\tGID[{i:>3}]:\t\t{}, RoCE v2\t(IP {})",
                                gid_groups(g),
                                g.to_ip()
                            );
                        }
                    } else if let Some((i, g)) = gids.first() {
                        println!("\t\t\tGID[{i:>3}]:\t\t{} (IP {})", gid_text(g), g.to_ip());
                    }
                    println!();
                }
            }
        }
        out.push(j);
    }
    if json {
        println!("{}", Json::obj().set("devices", out));
    }
    Ok(())
}
