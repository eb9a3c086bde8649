//! Gives the cdylib the SONAME `libibverbs.so.1` and the symbol versions of rdma-core's
//! `libibverbs.so.1` and `librdmacm.so.1` (the same file serves both names): from
//! `exports.txt` it writes a linker version script (the version nodes, in rdma-core's
//! order) and `.symver` directives that make every export `name@@TAG`.
//!
//! A node inherits the node before it of its own family (`IBVERBS_1.1` from `IBVERBS_1.0`,
//! `RDMACM_1.1` from `RDMACM_1.0`), never one of another library's family; private nodes
//! (`IBVERBS_PRIVATE_*`) inherit nothing, as in rdma-core.

use std::fmt::Write as _;
use std::path::PathBuf;

/// The family of a version tag: the tag without its version (`RDMACM_1.2` → `RDMACM`).
fn family(tag: &str) -> &str {
    tag.rsplit_once('_').map_or(tag, |(f, _)| f)
}

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    println!("cargo:rerun-if-changed=exports.txt");
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(dir.join("exports.txt")).expect("exports.txt");
    // A line is `TAG name` (an export) or `TAG` alone (a node that exports nothing yet).
    let mut nodes: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut w = line.split_whitespace();
        let Some(tag) = w.next() else { continue };
        let name = w.next();
        if w.next().is_some() {
            panic!("bad exports.txt line: {line}");
        }
        let i = match nodes.iter().position(|(t, _)| t == tag) {
            Some(i) => i,
            None => {
                nodes.push((tag.to_string(), Vec::new()));
                nodes.len() - 1
            }
        };
        if let Some(n) = name {
            nodes[i].1.push(n.to_string());
        }
    }
    let mut map = String::new();
    let mut asm = String::new();
    // The last node of each family, which the next node of that family inherits.
    let mut prev: Vec<(&str, &str)> = Vec::new();
    for (tag, names) in &nodes {
        let _ = writeln!(map, "{tag} {{\n  global:");
        for n in names {
            let _ = writeln!(map, "    {n};");
            let _ = writeln!(asm, "core::arch::global_asm!(\".symver {n}, {n}@@{tag}\");");
        }
        if tag.contains("_PRIVATE") {
            map.push_str("};\n");
            continue;
        }
        let fam = family(tag);
        match prev.iter_mut().find(|(f, _)| *f == fam) {
            Some((_, p)) => {
                let _ = writeln!(map, "}} {p};");
                *p = tag;
            }
            None => {
                map.push_str("};\n");
                prev.push((fam, tag));
            }
        }
    }
    let map_path = out.join("libibverbs.map");
    std::fs::write(&map_path, map).expect("write map");
    std::fs::write(out.join("symver.rs"), asm).expect("write symver");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map_path.display()
    );
}
