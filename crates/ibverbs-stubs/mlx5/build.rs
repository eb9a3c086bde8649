//! SONAME `libmlx5.so.1` and the version nodes perftest imports.
fn main() {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("out dir"));
    let map = out.join("libmlx5.map");
    std::fs::write(
        &map,
        "MLX5_1.3 { global: mlx5dv_create_qp; };\n\
         MLX5_1.7 { global: mlx5dv_devx_general_cmd; mlx5dv_open_device; } MLX5_1.3;\n\
         MLX5_1.10 { global: mlx5dv_create_mkey; mlx5dv_destroy_mkey; mlx5dv_qp_ex_from_ibv_qp_ex; } MLX5_1.7;\n\
         MLX5_1.21 { global: mlx5dv_crypto_login; mlx5dv_dek_create; mlx5dv_dek_destroy; mlx5dv_is_supported; } MLX5_1.10;\n",
    )
    .expect("write map");
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libmlx5.so.1");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
}
