//! Gives the cdylib the SONAME `libibverbs.so.1` and rdma-core's symbol versions: from
//! `exports.txt` it writes a linker version script (the version nodes, in rdma-core's
//! order) and `.symver` directives that make every export `name@@TAG`.

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    let dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    println!("cargo:rerun-if-changed=exports.txt");
    println!("cargo:rerun-if-changed=build.rs");
    let text = std::fs::read_to_string(dir.join("exports.txt")).expect("exports.txt");
    let mut nodes: Vec<(String, Vec<String>)> = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut w = line.split_whitespace();
        let (Some(tag), Some(name)) = (w.next(), w.next()) else {
            panic!("bad exports.txt line: {line}");
        };
        match nodes.iter_mut().find(|(t, _)| t == tag) {
            Some((_, names)) => names.push(name.to_string()),
            None => nodes.push((tag.to_string(), vec![name.to_string()])),
        }
    }
    let mut map = String::new();
    let mut asm = String::new();
    let mut prev: Option<&str> = None;
    for (tag, names) in &nodes {
        let _ = writeln!(map, "{tag} {{\n  global:");
        for n in names {
            let _ = writeln!(map, "    {n};");
            let _ = writeln!(asm, "core::arch::global_asm!(\".symver {n}, {n}@@{tag}\");");
        }
        match prev {
            Some(p) if !tag.starts_with("IBVERBS_PRIVATE") => {
                let _ = writeln!(map, "}} {p};");
            }
            _ => map.push_str("};\n"),
        }
        if !tag.starts_with("IBVERBS_PRIVATE") {
            prev = Some(tag);
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
