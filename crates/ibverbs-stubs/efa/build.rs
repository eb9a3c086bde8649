//! SONAME `libefa.so.1` and the version node perftest imports.
fn main() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    let map = out.join("libefa.map");
    std::fs::write(
        &map,
        "EFA_1.1 { global: efadv_create_qp_ex; efadv_query_device; efadv_create_driver_qp; };\n",
    )
    .expect("write map");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libefa.so.1");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
}
