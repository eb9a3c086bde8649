//! Stand-in `libmlx5.so.1`: the mlx5 direct-verbs entry points perftest imports. No
//! softrdma device is an mlx5 device, so each one fails: NULL or an errno of
//! `EOPNOTSUPP`, never a crash.

use std::ffi::{c_int, c_void};

fn fail_null() -> *mut c_void {
    // SAFETY: __errno_location returns the calling thread's errno slot.
    unsafe { *libc_errno() = EOPNOTSUPP };
    std::ptr::null_mut()
}

const EOPNOTSUPP: c_int = 95;

extern "C" {
    #[link_name = "__errno_location"]
    fn libc_errno() -> *mut c_int;
}

// The symbol versions (`name@@MLX5_1.x`) that perftest binds to.
#[cfg(not(test))]
core::arch::global_asm!(
    ".symver mlx5dv_create_qp, mlx5dv_create_qp@@MLX5_1.3",
    ".symver mlx5dv_devx_general_cmd, mlx5dv_devx_general_cmd@@MLX5_1.7",
    ".symver mlx5dv_open_device, mlx5dv_open_device@@MLX5_1.7",
    ".symver mlx5dv_create_mkey, mlx5dv_create_mkey@@MLX5_1.10",
    ".symver mlx5dv_destroy_mkey, mlx5dv_destroy_mkey@@MLX5_1.10",
    ".symver mlx5dv_qp_ex_from_ibv_qp_ex, mlx5dv_qp_ex_from_ibv_qp_ex@@MLX5_1.10",
    ".symver mlx5dv_crypto_login, mlx5dv_crypto_login@@MLX5_1.21",
    ".symver mlx5dv_dek_create, mlx5dv_dek_create@@MLX5_1.21",
    ".symver mlx5dv_dek_destroy, mlx5dv_dek_destroy@@MLX5_1.21",
    ".symver mlx5dv_is_supported, mlx5dv_is_supported@@MLX5_1.21",
);

/// No device is an mlx5 device.
#[no_mangle]
pub extern "C" fn mlx5dv_is_supported(_device: *mut c_void) -> bool {
    false
}

#[no_mangle]
pub extern "C" fn mlx5dv_create_qp(
    _ctx: *mut c_void,
    _attr: *mut c_void,
    _mlx5_attr: *mut c_void,
) -> *mut c_void {
    fail_null()
}

#[no_mangle]
pub extern "C" fn mlx5dv_open_device(_device: *mut c_void, _attr: *mut c_void) -> *mut c_void {
    fail_null()
}

#[no_mangle]
pub extern "C" fn mlx5dv_devx_general_cmd(
    _ctx: *mut c_void,
    _in: *const c_void,
    _inlen: usize,
    _out: *mut c_void,
    _outlen: usize,
) -> c_int {
    EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn mlx5dv_create_mkey(_attr: *mut c_void) -> *mut c_void {
    fail_null()
}

#[no_mangle]
pub extern "C" fn mlx5dv_destroy_mkey(_mkey: *mut c_void) -> c_int {
    EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn mlx5dv_qp_ex_from_ibv_qp_ex(_qp: *mut c_void) -> *mut c_void {
    fail_null()
}

#[no_mangle]
pub extern "C" fn mlx5dv_crypto_login(_ctx: *mut c_void, _attr: *mut c_void) -> c_int {
    EOPNOTSUPP
}

#[no_mangle]
pub extern "C" fn mlx5dv_dek_create(_ctx: *mut c_void, _attr: *mut c_void) -> *mut c_void {
    fail_null()
}

#[no_mangle]
pub extern "C" fn mlx5dv_dek_destroy(_dek: *mut c_void) -> c_int {
    EOPNOTSUPP
}
