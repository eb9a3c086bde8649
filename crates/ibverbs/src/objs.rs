//! PDs, MRs, CQs and completion channels, QPs, SRQs, AHs, async events (milestone 2:
//! not yet implemented; each returns EOPNOTSUPP).

use std::ffi::{c_int, c_void};

use crate::{null_errno, set_errno, sys};

pub(crate) fn init_ops(_v: &mut sys::verbs_context) {}

macro_rules! todo_null {
    ($($name:ident($($a:ident: $t:ty),*) -> $r:ty;)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name($($a: $t),*) -> *mut $r {
            $(let _ = $a;)*
            null_errno(libc::EOPNOTSUPP)
        }
    )*};
}
macro_rules! todo_int {
    ($($name:ident($($a:ident: $t:ty),*);)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name($($a: $t),*) -> c_int {
            $(let _ = $a;)*
            set_errno(libc::EOPNOTSUPP);
            libc::EOPNOTSUPP
        }
    )*};
}

todo_null! {
    ibv_alloc_pd(c: *mut sys::ibv_context) -> sys::ibv_pd;
    ibv_reg_mr(p: *mut sys::ibv_pd, a: *mut c_void, l: usize, f: c_int) -> sys::ibv_mr;
    ibv_reg_mr_iova(p: *mut sys::ibv_pd, a: *mut c_void, l: usize, i: u64, f: c_int) -> sys::ibv_mr;
    ibv_reg_mr_iova2(p: *mut sys::ibv_pd, a: *mut c_void, l: usize, i: u64, f: u32) -> sys::ibv_mr;
    ibv_create_comp_channel(c: *mut sys::ibv_context) -> sys::ibv_comp_channel;
    ibv_create_cq(c: *mut sys::ibv_context, n: c_int, x: *mut c_void, ch: *mut sys::ibv_comp_channel, v: c_int) -> sys::ibv_cq;
    ibv_create_qp(p: *mut sys::ibv_pd, a: *mut sys::ibv_qp_init_attr) -> sys::ibv_qp;
    ibv_create_srq(p: *mut sys::ibv_pd, a: *mut sys::ibv_srq_init_attr) -> sys::ibv_srq;
    ibv_create_ah(p: *mut sys::ibv_pd, a: *mut sys::ibv_ah_attr) -> sys::ibv_ah;
    ibv_create_ah_from_wc(p: *mut sys::ibv_pd, w: *const sys::ibv_wc, g: *const sys::ibv_grh, n: u8) -> sys::ibv_ah;
}
todo_int! {
    ibv_dealloc_pd(p: *mut sys::ibv_pd);
    ibv_dereg_mr(m: *mut sys::ibv_mr);
    ibv_destroy_comp_channel(c: *mut sys::ibv_comp_channel);
    ibv_destroy_cq(c: *mut sys::ibv_cq);
    ibv_resize_cq(c: *mut sys::ibv_cq, n: c_int);
    ibv_get_cq_event(c: *mut sys::ibv_comp_channel, q: *mut *mut sys::ibv_cq, x: *mut *mut c_void);
    ibv_modify_qp(q: *mut sys::ibv_qp, a: *mut sys::ibv_qp_attr, m: c_int);
    ibv_query_qp(q: *mut sys::ibv_qp, a: *mut sys::ibv_qp_attr, m: c_int, i: *mut sys::ibv_qp_init_attr);
    ibv_destroy_qp(q: *mut sys::ibv_qp);
    ibv_modify_srq(s: *mut sys::ibv_srq, a: *mut sys::ibv_srq_attr, m: c_int);
    ibv_query_srq(s: *mut sys::ibv_srq, a: *mut sys::ibv_srq_attr);
    ibv_destroy_srq(s: *mut sys::ibv_srq);
    ibv_destroy_ah(a: *mut sys::ibv_ah);
    ibv_init_ah_from_wc(c: *mut sys::ibv_context, n: u8, w: *mut sys::ibv_wc, g: *mut sys::ibv_grh, a: *mut sys::ibv_ah_attr);
    ibv_get_async_event(c: *mut sys::ibv_context, e: *mut sys::ibv_async_event);
}

#[no_mangle]
pub extern "C" fn ibv_ack_cq_events(_cq: *mut sys::ibv_cq, _n: u32) {}

#[no_mangle]
pub extern "C" fn ibv_ack_async_event(_e: *mut sys::ibv_async_event) {}
