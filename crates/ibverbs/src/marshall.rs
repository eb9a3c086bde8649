//! <infiniband/marshall.h>: copies between the kernel's uverbs structs and the verbs ones,
//! for programs that speak the kernel ABI themselves (ibacm, kernel-ABI tools). Pure
//! field-by-field conversions; the kernel structs (`<rdma/ib_user_verbs.h>`,
//! `<rdma/ib_user_sa.h>`) are laid out here, pinned by size and offset checks.

use std::mem::{offset_of, size_of};

use crate::{guard, sys};

/// `struct ib_uverbs_global_route`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernGlobalRoute {
    dgid: [u8; 16],
    flow_label: u32,
    sgid_index: u8,
    hop_limit: u8,
    traffic_class: u8,
    reserved: u8,
}

/// `struct ib_uverbs_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernAhAttr {
    grh: KernGlobalRoute,
    dlid: u16,
    sl: u8,
    src_path_bits: u8,
    static_rate: u8,
    is_global: u8,
    port_num: u8,
    reserved: u8,
}

/// `struct ib_uverbs_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernQpAttr {
    qp_attr_mask: u32,
    qp_state: u32,
    cur_qp_state: u32,
    path_mtu: u32,
    path_mig_state: u32,
    qkey: u32,
    rq_psn: u32,
    sq_psn: u32,
    dest_qp_num: u32,
    qp_access_flags: u32,
    ah_attr: KernAhAttr,
    alt_ah_attr: KernAhAttr,
    max_send_wr: u32,
    max_recv_wr: u32,
    max_send_sge: u32,
    max_recv_sge: u32,
    max_inline_data: u32,
    pkey_index: u16,
    alt_pkey_index: u16,
    en_sqd_async_notify: u8,
    sq_draining: u8,
    max_rd_atomic: u8,
    max_dest_rd_atomic: u8,
    min_rnr_timer: u8,
    port_num: u8,
    timeout: u8,
    retry_cnt: u8,
    rnr_retry: u8,
    alt_port_num: u8,
    alt_timeout: u8,
    reserved: [u8; 5],
}

/// `struct ib_user_path_rec` (big-endian fields stay as they are, in both structs).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct KernPathRec {
    dgid: [u8; 16],
    sgid: [u8; 16],
    dlid: u16,
    slid: u16,
    raw_traffic: u32,
    flow_label: u32,
    reversible: u32,
    mtu: u32,
    pkey: u16,
    hop_limit: u8,
    traffic_class: u8,
    numb_path: u8,
    sl: u8,
    mtu_selector: u8,
    rate_selector: u8,
    rate: u8,
    packet_life_time_selector: u8,
    packet_life_time: u8,
    preference: u8,
}

/// `struct ibv_sa_path_rec` of <infiniband/sa.h>.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct SaPathRec {
    dgid: [u8; 16],
    sgid: [u8; 16],
    dlid: u16,
    slid: u16,
    raw_traffic: i32,
    flow_label: u32,
    hop_limit: u8,
    traffic_class: u8,
    reversible: i32,
    numb_path: u8,
    pkey: u16,
    sl: u8,
    mtu_selector: u8,
    mtu: u8,
    rate_selector: u8,
    rate: u8,
    packet_life_time_selector: u8,
    packet_life_time: u8,
    preference: u8,
}

// The layouts of the C headers (x86-64 and every LP64 target: no pointers here).
const _: () = {
    assert!(size_of::<KernGlobalRoute>() == 24);
    assert!(size_of::<KernAhAttr>() == 32);
    assert!(size_of::<KernQpAttr>() == 144);
    assert!(offset_of!(KernQpAttr, ah_attr) == 40);
    assert!(offset_of!(KernQpAttr, max_send_wr) == 104);
    assert!(offset_of!(KernQpAttr, pkey_index) == 124);
    assert!(offset_of!(KernQpAttr, alt_timeout) == 138);
    assert!(size_of::<KernPathRec>() == 64);
    assert!(offset_of!(KernPathRec, pkey) == 52);
    assert!(size_of::<SaPathRec>() == 64);
    assert!(offset_of!(SaPathRec, reversible) == 48);
    assert!(offset_of!(SaPathRec, pkey) == 54);
    assert!(offset_of!(SaPathRec, preference) == 63);
};

fn ah_from_kern(dst: &mut sys::ibv_ah_attr, src: &KernAhAttr) {
    dst.grh.dgid.raw = src.grh.dgid;
    dst.grh.flow_label = src.grh.flow_label;
    dst.grh.sgid_index = src.grh.sgid_index;
    dst.grh.hop_limit = src.grh.hop_limit;
    dst.grh.traffic_class = src.grh.traffic_class;
    dst.dlid = src.dlid;
    dst.sl = src.sl;
    dst.src_path_bits = src.src_path_bits;
    dst.static_rate = src.static_rate;
    dst.is_global = src.is_global;
    dst.port_num = src.port_num;
}

/// `ibv_copy_ah_attr_from_kern`.
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_ah_attr_from_kern(
    dst: *mut sys::ibv_ah_attr,
    src: *const KernAhAttr,
) {
    guard((), || {
        // SAFETY: the caller passes valid structs of these types (null is refused).
        if let (Some(d), Some(s)) = unsafe { (dst.as_mut(), src.as_ref()) } {
            ah_from_kern(d, s);
        }
    })
}

/// `ibv_copy_qp_attr_from_kern`: every field of `struct ibv_qp_attr` the kernel struct
/// has (not `rate_limit`, which it lacks and which is left as it was).
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_qp_attr_from_kern(
    dst: *mut sys::ibv_qp_attr,
    src: *const KernQpAttr,
) {
    guard((), || {
        // SAFETY: the caller passes valid structs of these types (null is refused).
        let (Some(d), Some(s)) = (unsafe { (dst.as_mut(), src.as_ref()) }) else {
            return;
        };
        d.qp_state = s.qp_state;
        d.cur_qp_state = s.cur_qp_state;
        d.path_mtu = s.path_mtu;
        d.path_mig_state = s.path_mig_state;
        d.qkey = s.qkey;
        d.rq_psn = s.rq_psn;
        d.sq_psn = s.sq_psn;
        d.dest_qp_num = s.dest_qp_num;
        d.qp_access_flags = s.qp_access_flags;
        d.cap.max_send_wr = s.max_send_wr;
        d.cap.max_recv_wr = s.max_recv_wr;
        d.cap.max_send_sge = s.max_send_sge;
        d.cap.max_recv_sge = s.max_recv_sge;
        d.cap.max_inline_data = s.max_inline_data;
        ah_from_kern(&mut d.ah_attr, &s.ah_attr);
        ah_from_kern(&mut d.alt_ah_attr, &s.alt_ah_attr);
        d.pkey_index = s.pkey_index;
        d.alt_pkey_index = s.alt_pkey_index;
        d.en_sqd_async_notify = s.en_sqd_async_notify;
        d.sq_draining = s.sq_draining;
        d.max_rd_atomic = s.max_rd_atomic;
        d.max_dest_rd_atomic = s.max_dest_rd_atomic;
        d.min_rnr_timer = s.min_rnr_timer;
        d.port_num = s.port_num;
        d.timeout = s.timeout;
        d.retry_cnt = s.retry_cnt;
        d.rnr_retry = s.rnr_retry;
        d.alt_port_num = s.alt_port_num;
        d.alt_timeout = s.alt_timeout;
    })
}

/// The fields a path record has by the same name and type in both layouts (the
/// integers that differ in width, `raw_traffic`, `reversible` and `mtu`, are converted by
/// each direction).
macro_rules! same_path_fields {
    ($d:ident, $s:ident) => {
        $d.dgid = $s.dgid;
        $d.sgid = $s.sgid;
        $d.dlid = $s.dlid;
        $d.slid = $s.slid;
        $d.flow_label = $s.flow_label;
        $d.pkey = $s.pkey;
        $d.hop_limit = $s.hop_limit;
        $d.traffic_class = $s.traffic_class;
        $d.numb_path = $s.numb_path;
        $d.sl = $s.sl;
        $d.mtu_selector = $s.mtu_selector;
        $d.rate_selector = $s.rate_selector;
        $d.rate = $s.rate;
        $d.packet_life_time_selector = $s.packet_life_time_selector;
        $d.packet_life_time = $s.packet_life_time;
        $d.preference = $s.preference;
    };
}

/// `ibv_copy_path_rec_from_kern`.
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_path_rec_from_kern(dst: *mut SaPathRec, src: *const KernPathRec) {
    guard((), || {
        // SAFETY: the caller passes valid structs of these types (null is refused).
        let (Some(d), Some(s)) = (unsafe { (dst.as_mut(), src.as_ref()) }) else {
            return;
        };
        same_path_fields!(d, s);
        d.raw_traffic = s.raw_traffic as i32;
        d.reversible = s.reversible as i32;
        d.mtu = s.mtu as u8;
    })
}

/// `ibv_copy_path_rec_to_kern`.
#[no_mangle]
pub unsafe extern "C" fn ibv_copy_path_rec_to_kern(dst: *mut KernPathRec, src: *const SaPathRec) {
    guard((), || {
        // SAFETY: the caller passes valid structs of these types (null is refused).
        let (Some(d), Some(s)) = (unsafe { (dst.as_mut(), src.as_ref()) }) else {
            return;
        };
        same_path_fields!(d, s);
        d.raw_traffic = s.raw_traffic as u32;
        d.reversible = s.reversible as u32;
        d.mtu = u32::from(s.mtu);
    })
}
