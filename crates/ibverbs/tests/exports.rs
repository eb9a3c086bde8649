//! The librdmacm exports, checked from the sources (tests-ext/rdmacm/run.sh checks the
//! built library): `exports.txt` lists exactly the rdma_* functions `src/rdmacm` defines
//! (a function it leaves out would be exported without a version), each with the version
//! Debian's librdmacm gives it (`rdmacm-abi.txt`), and declares rdma-core 44's four
//! RDMACM version nodes.

use std::collections::BTreeSet;
use std::path::Path;

fn manifest() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `(tag, name)` of every export line of a list file; `(tag, "")` for a bare node line.
fn lines(file: &str) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(manifest().join(file)).expect(file);
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let mut w = l.split_whitespace();
            let tag = w.next().unwrap_or_default().to_string();
            let name = w.next().unwrap_or_default().to_string();
            (tag, name)
        })
        .collect()
}

/// The names of the `#[no_mangle]` functions defined under `src/rdmacm`.
fn defined() -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut dirs = vec![manifest().join("src/rdmacm")];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).expect("src/rdmacm") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                dirs.push(p);
                continue;
            }
            if p.extension().and_then(|x| x.to_str()) != Some("rs") {
                continue;
            }
            let text = std::fs::read_to_string(&p).expect("source");
            let mut after_no_mangle = false;
            for l in text.lines().map(str::trim) {
                if l == "#[no_mangle]" {
                    after_no_mangle = true;
                    continue;
                }
                if after_no_mangle && !l.starts_with("#[") && !l.starts_with("///") {
                    if let Some(rest) = l.split("fn ").nth(1) {
                        let name: String = rest
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        out.insert(name);
                    }
                    after_no_mangle = false;
                }
            }
        }
    }
    out
}

#[test]
fn rdmacm_exports_are_the_functions_defined() {
    let listed: BTreeSet<String> = lines("exports.txt")
        .into_iter()
        .filter(|(t, n)| t.starts_with("RDMACM_") && !n.is_empty())
        .map(|(_, n)| n)
        .collect();
    assert!(!listed.is_empty());
    assert_eq!(
        listed,
        defined(),
        "exports.txt's RDMACM lines and src/rdmacm's #[no_mangle] functions differ"
    );
}

#[test]
fn rdmacm_exports_have_debians_versions() {
    let debian: BTreeSet<(String, String)> = lines("rdmacm-abi.txt").into_iter().collect();
    assert_eq!(
        debian.len(),
        68,
        "rdma-core 44's librdmacm exports 68 functions"
    );
    for (tag, name) in lines("exports.txt") {
        if tag.starts_with("RDMACM_") && !name.is_empty() {
            assert!(
                debian.contains(&(tag.clone(), name.clone())),
                "{name}@@{tag} is not in rdmacm-abi.txt (Debian's librdmacm)"
            );
        }
    }
}

#[test]
fn rdmacm_version_nodes_declared_in_order() {
    let mut tags: Vec<String> = Vec::new();
    for (t, _) in lines("exports.txt") {
        if t.starts_with("RDMACM_") && !tags.contains(&t) {
            tags.push(t);
        }
    }
    assert_eq!(
        tags,
        ["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"],
        "build.rs chains a family's nodes in the order exports.txt first names them"
    );
}
