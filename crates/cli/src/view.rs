//! The device view of `softrdma run`: what a program finds where RDMA software looks for
//! a kernel device — `/sys/class/infiniband/<dev>` (ports, GIDs with their types and
//! netdev, `device/net/<ifname>`), `/sys/class/infiniband_verbs/uverbsN` and
//! `/dev/infiniband/{uverbsN,rdma_cm}` — for that program and its children only.
//!
//! How: the program runs in a private mount namespace (as root; as a regular user in a
//! user namespace too, with the user's own uid and gid mapped to themselves, so the
//! program runs as that user with no privilege on the host). There a tmpfs covers
//! `/sys/class` and another `/dev`; every entry of the originals is bind-mounted back in
//! place (symlinks copied), the generated view is added beside them, and both are made
//! read-only. Nothing changes outside the namespace, and it ends with the program.
//!
//! Mount namespaces rather than interposing `open`/`stat`/`opendir` with LD_PRELOAD: the
//! kernel then answers every way of looking (statx, openat, getdents, realpath, a shell's
//! `ls`, a statically linked or setuid helper, Python's own calls) the same way, and a
//! child the program starts (`mpirun`'s ranks) sees the same view.
//!
//! The device nodes are `/dev/null` bind-mounted at their names: a character device the
//! program may open for reading and writing, which is all a presence check (UCX's stat,
//! S_ISCHR and access(R_OK|W_OK)) asks; softrdma's verbs never go through the kernel, so
//! no ioctl is expected of them. Each `uverbsN/dev` names the node's real numbers.

use std::ffi::{CString, OsStr};
use std::io;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use softrdma::verbs::{Context, Gid};
use softrdma_device::config::{self, DeviceAddr};
use softrdma_device::netdev::{self, NetDev};

/// The environment variable that, set to `0`, runs programs without the view.
pub const VIEW_ENV: &str = "SOFTRDMA_VIEW";

/// The sysfs class directory the view adds to.
const SYS_CLASS: &str = "/sys/class";
/// The device directory the view adds to.
const DEV: &str = "/dev";

/// One device as the view shows it.
#[derive(Debug, Clone)]
pub struct DevInfo {
    /// `softrdma0`, …
    pub name: String,
    /// The address the device takes when the program opens it.
    pub ip: IpAddr,
    /// Its second address (GID index 1), if it will have one.
    pub alt: Option<IpAddr>,
    /// The interface holding that address.
    pub netdev: Option<NetDev>,
}

/// The configured devices, in the drop-in's order (so `uverbsN` agree), with the
/// addresses they will take: a fixed one, or the first free 127.0.0.x now (which the
/// program's device takes when it opens, unless another process on the host takes it
/// first).
pub fn devices() -> Result<Vec<DevInfo>, String> {
    let list = config::devices().map_err(|e| e.to_string())?;
    Ok(list
        .iter()
        .map(|e| {
            let at = match e.addr {
                DeviceAddr::Fixed(a) => a,
                DeviceAddr::AutoLoopback(p) => config::probe_auto_loopback(p),
            };
            let ip = at.ip();
            DevInfo {
                name: e.name.clone(),
                ip,
                alt: config::probe_alt(at),
                netdev: netdev::holding(ip),
            }
        })
        .collect())
}

/// A node of the generated tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A directory.
    Dir,
    /// A file with this content.
    File(String),
    /// A symbolic link to this target.
    Link(String),
}

/// `"4: ACTIVE"`: the kernel's port state names.
fn port_state(s: u32) -> String {
    let n = match s {
        1 => "DOWN",
        2 => "INIT",
        3 => "ARMED",
        4 => "ACTIVE",
        5 => "ACTIVE_DEFER",
        _ => "NOP",
    };
    format!("{s}: {n}")
}

/// `"5: LinkUp"`: the kernel's physical port state names.
fn phys_state(s: u8) -> String {
    let n = match s {
        1 => "Sleep",
        2 => "Polling",
        3 => "Disabled",
        4 => "PortConfigurationTraining",
        5 => "LinkUp",
        6 => "LinkErrorRecovery",
        7 => "Phy Test",
        _ => "<unknown>",
    };
    format!("{s}: {n}")
}

/// `"40 Gb/sec (4X FDR10)"` from the port's width and speed codes.
fn rate(width: u8, speed: u8) -> String {
    let lanes: u32 = match width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => 1,
    };
    // Per-lane rate in units of 100 Mb/s, and the speed's name.
    let (per_lane, name) = match speed {
        2 => (50, " DDR"),
        4 => (100, " QDR"),
        8 => (100, " FDR10"),
        16 => (140, " FDR"),
        32 => (250, " EDR"),
        64 => (500, " HDR"),
        128 => (1000, " NDR"),
        _ => (25, ""),
    };
    let r = per_lane * lanes;
    let half = if r % 10 != 0 { ".5" } else { "" };
    format!("{}{half} Gb/sec ({lanes}X{name})", r / 10)
}

/// A GUID as sysfs writes it: four groups of 16 bits.
fn guid(g: u64) -> String {
    format!(
        "{:04x}:{:04x}:{:04x}:{:04x}",
        g >> 48,
        (g >> 32) & 0xFFFF,
        (g >> 16) & 0xFFFF,
        g & 0xFFFF
    )
}

/// A GID as sysfs writes it: eight groups of four hex digits.
fn gid(g: &Gid) -> String {
    g.0.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// The generated tree, as paths relative to the filesystem root. `null_rdev` is the
/// (major, minor) of the node the device files are.
pub fn tree(devs: &[DevInfo], null_rdev: (u32, u32)) -> Vec<(PathBuf, Node)> {
    let mut t: Vec<(PathBuf, Node)> = Vec::new();
    let mut add = |p: String, n: Node| t.push((PathBuf::from(p), n));
    let ib = "sys/class/infiniband";
    let uv = "sys/class/infiniband_verbs";
    add(ib.into(), Node::Dir);
    add(uv.into(), Node::Dir);
    // The uverbs ABI the kernel speaks; rdma-core's sysfs walk checks it.
    add(format!("{uv}/abi_version"), Node::File("6".into()));
    add("dev/infiniband".into(), Node::Dir);
    for (i, d) in devs.iter().enumerate() {
        // The engine's own attributes for the device at this address: every value the
        // view shows is what the program's verbs queries answer.
        let mut gids = vec![Gid::from_ip(d.ip)];
        gids.extend(d.alt.map(Gid::from_ip));
        let ctx = Context::new(gids, 0);
        let a = ctx.device_attr();
        let Ok(p) = ctx.port_attr(1) else { continue };
        let dir = format!("{ib}/{}", d.name);
        add(dir.clone(), Node::Dir);
        add(format!("{dir}/node_type"), Node::File("1: CA".into()));
        add(format!("{dir}/node_guid"), Node::File(guid(a.node_guid)));
        add(
            format!("{dir}/sys_image_guid"),
            Node::File(guid(a.sys_image_guid)),
        );
        add(format!("{dir}/fw_ver"), Node::File(a.fw_ver.clone()));
        add(
            format!("{dir}/hw_rev"),
            Node::File(format!("0x{:x}", a.hw_ver)),
        );
        add(format!("{dir}/node_desc"), Node::File(d.name.clone()));
        add(format!("{dir}/device"), Node::Dir);
        // A software device is as close to every CPU as to any.
        add(format!("{dir}/device/numa_node"), Node::File("-1".into()));
        add(format!("{dir}/device/net"), Node::Dir);
        if let Some(n) = &d.netdev {
            add(
                format!("{dir}/device/net/{}", n.name),
                Node::Link(format!("/{SYS_CLASS_REL}/net/{}", n.name)),
            );
        }
        let port = format!("{dir}/ports/1");
        add(format!("{dir}/ports"), Node::Dir);
        add(port.clone(), Node::Dir);
        add(format!("{port}/state"), Node::File(port_state(p.state)));
        add(
            format!("{port}/phys_state"),
            Node::File(phys_state(p.phys_state)),
        );
        let ll = if p.link_layer == 2 {
            "Ethernet"
        } else {
            "InfiniBand"
        };
        add(format!("{port}/link_layer"), Node::File(ll.into()));
        add(
            format!("{port}/rate"),
            Node::File(rate(p.active_width, p.active_speed)),
        );
        add(format!("{port}/lid"), Node::File(format!("0x{:x}", p.lid)));
        add(
            format!("{port}/sm_lid"),
            Node::File(format!("0x{:x}", p.sm_lid)),
        );
        add(format!("{port}/lid_mask_count"), Node::File("0".into()));
        add(format!("{port}/sm_sl"), Node::File("0".into()));
        add(
            format!("{port}/cap_mask"),
            Node::File(format!("0x{:08x}", p.port_cap_flags)),
        );
        add(format!("{port}/gids"), Node::Dir);
        add(format!("{port}/gid_attrs"), Node::Dir);
        add(format!("{port}/gid_attrs/types"), Node::Dir);
        add(format!("{port}/gid_attrs/ndevs"), Node::Dir);
        for (k, g) in ctx.gids().iter().enumerate() {
            add(format!("{port}/gids/{k}"), Node::File(gid(g)));
            add(
                format!("{port}/gid_attrs/types/{k}"),
                Node::File("RoCE v2".into()),
            );
            // Both addresses are on one interface (see `netdev::other_version`).
            if let Some(n) = &d.netdev {
                add(
                    format!("{port}/gid_attrs/ndevs/{k}"),
                    Node::File(n.name.clone()),
                );
            }
        }
        add(format!("{port}/pkeys"), Node::Dir);
        for k in 0..p.pkey_tbl_len {
            let v = ctx.pkey(k).unwrap_or(0);
            add(
                format!("{port}/pkeys/{k}"),
                Node::File(format!("0x{v:04x}")),
            );
        }
        let u = format!("{uv}/uverbs{i}");
        add(u.clone(), Node::Dir);
        add(format!("{u}/ibdev"), Node::File(d.name.clone()));
        add(format!("{u}/abi_version"), Node::File("1".into()));
        add(
            format!("{u}/dev"),
            Node::File(format!("{}:{}", null_rdev.0, null_rdev.1)),
        );
        add(format!("{u}/device"), Node::Link(format!("/{dir}/device")));
    }
    t
}

/// `sys/class` without its leading slash, for links in the tree.
const SYS_CLASS_REL: &str = "sys/class";

// ------------------------------------------------------------------ the namespace

fn errno() -> io::Error {
    io::Error::last_os_error()
}

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path with a NUL byte"))
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> io::Result<()> {
    let src = src.map(cstr).transpose()?;
    let target = cstr(target)?;
    let fstype = fstype.map(|s| CString::new(s).unwrap_or_default());
    let data = data.map(|s| CString::new(s).unwrap_or_default());
    let ptr = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: every pointer is null or a NUL-terminated string alive for the call.
    let r = unsafe {
        libc::mount(
            ptr(&src),
            target.as_ptr(),
            ptr(&fstype),
            flags,
            ptr(&data).cast(),
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(errno())
    }
}

fn umount_detach(target: &Path) {
    if let Ok(t) = cstr(target) {
        // SAFETY: `t` is a NUL-terminated path alive for the call.
        unsafe { libc::umount2(t.as_ptr(), libc::MNT_DETACH) };
    }
}

/// Enter a private mount namespace in which this process may mount: as root a new
/// mount namespace; as anyone else a user namespace too, mapping the user's uid and gid
/// to themselves (the program runs as the same user; setuid programs inside gain nothing).
fn private_namespace() -> Result<(), String> {
    // SAFETY: plain system calls without pointers.
    let (euid, egid) = unsafe { (libc::geteuid(), libc::getegid()) };
    if euid == 0 {
        // SAFETY: no pointers; affects only this process (single-threaded here).
        if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
            return Err(format!("cannot create a mount namespace: {}", errno()));
        }
    } else {
        // SAFETY: no pointers; unshare of a user namespace needs a single-threaded
        // process, which the CLI is before it execs.
        if unsafe { libc::unshare(libc::CLONE_NEWUSER | libc::CLONE_NEWNS) } != 0 {
            let e = errno();
            return Err(format!(
                "cannot create a user namespace ({e}; unprivileged user namespaces may be \
                 disabled: sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, \
                 kernel.apparmor_restrict_unprivileged_userns)"
            ));
        }
        let w =
            |f: &str, s: String| std::fs::write(f, s).map_err(|e| format!("cannot write {f}: {e}"));
        w("/proc/self/setgroups", "deny".into())?;
        w("/proc/self/uid_map", format!("{euid} {euid} 1\n"))?;
        w("/proc/self/gid_map", format!("{egid} {egid} 1\n"))?;
    }
    // Nothing mounted here may reach the host's namespace.
    mount(
        None,
        Path::new("/"),
        None,
        libc::MS_REC | libc::MS_PRIVATE,
        None,
    )
    .map_err(|e| format!("cannot make mounts private: {e}"))
}

/// Cover `target` with a tmpfs holding every entry of the original (directories and
/// files bind-mounted back, symlinks copied) except `replace`, then `build` adds the
/// view. On error the tmpfs is detached again, leaving the original.
fn cover(
    target: &Path,
    replace: &[&str],
    build: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    let orig: OwnedFd = std::fs::File::open(target)?.into();
    let mut entries = Vec::new();
    for e in std::fs::read_dir(target)? {
        let e = e?;
        entries.push((e.file_name(), e.file_type()?));
    }
    mount(
        Some(Path::new("softrdma")),
        target,
        Some("tmpfs"),
        libc::MS_NOSUID | libc::MS_NOEXEC,
        Some("mode=755"),
    )?;
    let fill = || -> io::Result<()> {
        // The original, now covered, stays reachable through the descriptor.
        let src_dir = PathBuf::from(format!("/proc/self/fd/{}", orig.as_raw_fd()));
        for (name, ty) in &entries {
            if replace.iter().any(|r| OsStr::new(r) == name) {
                continue;
            }
            let src = src_dir.join(name);
            let dst = target.join(name);
            if ty.is_symlink() {
                std::os::unix::fs::symlink(std::fs::read_link(&src)?, &dst)?;
                continue;
            }
            if ty.is_dir() {
                std::fs::create_dir(&dst)?;
            } else {
                std::fs::File::create(&dst)?;
            }
            mount(Some(&src), &dst, None, libc::MS_BIND | libc::MS_REC, None)
                .map_err(|e| io::Error::new(e.kind(), format!("bind {}: {e}", dst.display())))?;
        }
        build()?;
        // The view is for reading: the program cannot change it (nor add to /dev).
        mount(
            None,
            target,
            None,
            libc::MS_REMOUNT | libc::MS_BIND | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NOEXEC,
            None,
        )
    };
    fill().inspect_err(|_| umount_detach(target))
}

/// Write `tree`'s entries under `top` (`sys/class/…` or `dev/…`); device files under
/// `/dev/infiniband` are bind mounts of `null`.
fn write_tree(tree: &[(PathBuf, Node)], top: &str, null: &Path) -> io::Result<()> {
    for (rel, node) in tree.iter().filter(|(p, _)| p.starts_with(top)) {
        let path = Path::new("/").join(rel);
        match node {
            Node::Dir => std::fs::create_dir_all(&path)?,
            Node::File(s) => std::fs::write(&path, format!("{s}\n"))?,
            Node::Link(t) => std::os::unix::fs::symlink(t, &path)?,
        }
    }
    if top == "dev" {
        let ib = Path::new("/dev/infiniband");
        let mut nodes = vec![ib.join("rdma_cm")];
        for (rel, _) in tree {
            if let Ok(r) = rel.strip_prefix("sys/class/infiniband_verbs") {
                if let Some(n) = r
                    .to_str()
                    .filter(|n| n.starts_with("uverbs") && !n.contains('/'))
                {
                    nodes.push(ib.join(n));
                }
            }
        }
        for n in nodes {
            std::fs::File::create(&n)?;
            mount(Some(null), &n, None, libc::MS_BIND, None)?;
        }
    }
    Ok(())
}

/// Give this process (and so the program it execs) the view of `devs`.
pub fn enter(devs: &[DevInfo]) -> Result<(), String> {
    let null = Path::new("/dev/null");
    let md = std::fs::metadata(null).map_err(|e| format!("/dev/null: {e}"))?;
    let rdev = (libc::major(md.rdev()), libc::minor(md.rdev()));
    let t = tree(devs, rdev);
    private_namespace()?;
    cover(
        Path::new(SYS_CLASS),
        &["infiniband", "infiniband_verbs"],
        || write_tree(&t, SYS_CLASS_REL, null),
    )
    .map_err(|e| format!("cannot cover {SYS_CLASS}: {e}"))?;
    // /dev/null is bind-mounted from the original /dev before the tmpfs hides it, so
    // keep a descriptor-free path to it: the covered original through /proc.
    let orig_null: OwnedFd = std::fs::File::open(null)
        .map_err(|e| format!("/dev/null: {e}"))?
        .into();
    let null_src = PathBuf::from(format!("/proc/self/fd/{}", orig_null.as_raw_fd()));
    cover(Path::new(DEV), &["infiniband"], || {
        write_tree(&t, "dev", &null_src)
    })
    .map_err(|e| {
        umount_detach(Path::new(SYS_CLASS));
        format!("cannot cover {DEV}: {e}")
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn find<'a>(t: &'a [(PathBuf, Node)], p: &str) -> Option<&'a Node> {
        t.iter().find(|(q, _)| q == Path::new(p)).map(|(_, n)| n)
    }

    #[test]
    fn values_as_sysfs_writes_them() {
        assert_eq!(rate(2, 8), "40 Gb/sec (4X FDR10)");
        assert_eq!(rate(1, 1), "2.5 Gb/sec (1X)");
        assert_eq!(rate(2, 32), "100 Gb/sec (4X EDR)");
        assert_eq!(port_state(4), "4: ACTIVE");
        assert_eq!(phys_state(5), "5: LinkUp");
        assert_eq!(guid(0x0200_01ff_fe01_7f01), "0200:01ff:fe01:7f01");
        let g = Gid::from_ip("127.0.0.1".parse().unwrap());
        assert_eq!(gid(&g), "0000:0000:0000:0000:0000:ffff:7f00:0001");
    }

    #[test]
    fn tree_of_one_device() {
        let d = DevInfo {
            name: "softrdma0".into(),
            ip: "127.0.0.5".parse().unwrap(),
            alt: Some("::1".parse().unwrap()),
            netdev: Some(NetDev {
                name: "lo".into(),
                index: 1,
            }),
        };
        let t = tree(&[d], (1, 3));
        let file = |p: &str| match find(&t, p) {
            Some(Node::File(s)) => s.clone(),
            other => panic!("{p}: {other:?}"),
        };
        let ib = "sys/class/infiniband/softrdma0";
        assert_eq!(file(&format!("{ib}/ports/1/state")), "4: ACTIVE");
        assert_eq!(file(&format!("{ib}/ports/1/link_layer")), "Ethernet");
        assert_eq!(
            file(&format!("{ib}/ports/1/gids/0")),
            "0000:0000:0000:0000:0000:ffff:7f00:0005"
        );
        assert_eq!(file(&format!("{ib}/ports/1/gid_attrs/types/0")), "RoCE v2");
        assert_eq!(file(&format!("{ib}/ports/1/gid_attrs/ndevs/0")), "lo");
        assert_eq!(
            file(&format!("{ib}/ports/1/gids/1")),
            "0000:0000:0000:0000:0000:0000:0000:0001"
        );
        assert_eq!(file(&format!("{ib}/ports/1/gid_attrs/types/1")), "RoCE v2");
        assert_eq!(file(&format!("{ib}/ports/1/gid_attrs/ndevs/1")), "lo");
        assert_eq!(find(&t, &format!("{ib}/ports/1/gids/2")), None);
        assert_eq!(file(&format!("{ib}/ports/1/pkeys/0")), "0xffff");
        assert_eq!(file(&format!("{ib}/node_type")), "1: CA");
        assert_eq!(
            find(&t, &format!("{ib}/device/net/lo")),
            Some(&Node::Link("/sys/class/net/lo".into()))
        );
        let uv = "sys/class/infiniband_verbs/uverbs0";
        assert_eq!(file(&format!("{uv}/ibdev")), "softrdma0");
        assert_eq!(file(&format!("{uv}/dev")), "1:3");
        // The engine's GUID rule for that address.
        let ctx = Context::new(vec![Gid::from_ip("127.0.0.5".parse().unwrap())], 0);
        assert_eq!(
            file(&format!("{ib}/node_guid")),
            guid(ctx.device_attr().node_guid)
        );
    }
}
