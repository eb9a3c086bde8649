//! sysfs paths and files (the view `softrdma run` mounts for the program).

use std::ffi::{c_char, c_int, CStr};

use crate::{guard, minus_one};

#[no_mangle]
pub unsafe extern "C" fn ibv_get_sysfs_path() -> *const c_char {
    c"/sys".as_ptr()
}

/// Read `dir/file` into `buf` (NUL-terminated, a trailing newline removed); -1 if absent.
/// Under `softrdma run` the devices' entries (`ibdev_path`, `dev_path`) are the view it
/// mounts for the program; elsewhere they are absent and this reads only real files.
#[no_mangle]
pub unsafe extern "C" fn ibv_read_sysfs_file(
    dir: *const c_char,
    file: *const c_char,
    buf: *mut c_char,
    size: usize,
) -> c_int {
    guard(-1, || {
        if dir.is_null() || file.is_null() || buf.is_null() || size == 0 {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: the caller passes NUL-terminated strings.
        let (d, f) = unsafe { (CStr::from_ptr(dir), CStr::from_ptr(file)) };
        let path = format!("{}/{}", d.to_string_lossy(), f.to_string_lossy());
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) => return minus_one(e.raw_os_error().unwrap_or(libc::ENOENT)),
        };
        let mut n = data.len().min(size - 1);
        if n > 0 && data[n - 1] == b'\n' {
            n -= 1;
        }
        // SAFETY: `buf` has `size` bytes; we write n + 1 <= size.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
        n as c_int
    })
}
