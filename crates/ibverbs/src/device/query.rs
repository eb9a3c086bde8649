//! What a context tells of its device: attributes, ports, GIDs, P_Keys.

use std::ffi::c_int;

use softrdma_device::verbs::Gid;

use super::*;
use crate::sys;
use crate::{guard, minus_one, zeroed};

pub(crate) fn device_attr(ctx: &Ctx) -> sys::ibv_device_attr {
    let a = ctx.dev().device_attr();
    let mut o: sys::ibv_device_attr = zeroed();
    fill_cstr(&mut o.fw_ver, &a.fw_ver);
    o.node_guid = a.node_guid.to_be();
    o.sys_image_guid = a.sys_image_guid.to_be();
    o.max_mr_size = a.max_mr_size;
    o.page_size_cap = a.page_size_cap;
    o.vendor_id = a.vendor_id;
    o.vendor_part_id = a.vendor_part_id;
    o.hw_ver = a.hw_ver;
    o.max_qp = a.max_qp as c_int;
    o.max_qp_wr = a.max_qp_wr as c_int;
    o.device_cap_flags = a.device_cap_flags;
    o.max_sge = a.max_sge as c_int;
    o.max_sge_rd = a.max_sge_rd as c_int;
    o.max_cq = a.max_cq as c_int;
    o.max_cqe = a.max_cqe as c_int;
    o.max_mr = a.max_mr as c_int;
    o.max_pd = a.max_pd as c_int;
    o.max_qp_rd_atom = a.max_qp_rd_atom as c_int;
    o.max_ee_rd_atom = a.max_ee_rd_atom as c_int;
    o.max_res_rd_atom = a.max_res_rd_atom as c_int;
    o.max_qp_init_rd_atom = a.max_qp_init_rd_atom as c_int;
    o.atomic_cap = a.atomic_cap;
    o.max_mw = a.max_mw as c_int;
    o.max_ah = a.max_ah as c_int;
    o.max_srq = a.max_srq as c_int;
    o.max_srq_wr = a.max_srq_wr as c_int;
    o.max_srq_sge = a.max_srq_sge as c_int;
    o.max_pkeys = a.max_pkeys;
    o.max_mcast_grp = a.max_mcast_grp as c_int;
    o.max_mcast_qp_attach = a.max_mcast_qp_attach as c_int;
    o.max_total_mcast_qp_attach = a.max_total_mcast_qp_attach as c_int;
    o.local_ca_ack_delay = a.local_ca_ack_delay;
    o.phys_port_cnt = a.phys_port_cnt;
    o
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_device(
    context: *mut sys::ibv_context,
    attr: *mut sys::ibv_device_attr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        let o = device_attr(ctx);
        // SAFETY: `attr` points at a caller's ibv_device_attr.
        unsafe { attr.write(o) };
        0
    })
}

/// Completion timestamps are device-clock nanoseconds: a 1 GHz clock (in kHz).
const CORE_CLOCK_KHZ: u64 = 1_000_000;

/// On-demand paging: regions need not be backed when registered, the implicit region
/// covers the whole address space, and every operation of every QP type reaches such
/// memory as any other (the device copies through fault-safe accesses in either case).
/// No XRC, so no `xrc_odp_caps`.
fn odp_caps() -> sys::ibv_odp_caps {
    let all = sys::IBV_ODP_SUPPORT_SEND | sys::IBV_ODP_SUPPORT_RECV | sys::IBV_ODP_SUPPORT_SRQ_RECV;
    let mut c: sys::ibv_odp_caps = zeroed();
    c.general_caps = u64::from(sys::IBV_ODP_SUPPORT | sys::IBV_ODP_SUPPORT_IMPLICIT);
    c.per_transport_caps.rc_odp_caps =
        all | sys::IBV_ODP_SUPPORT_WRITE | sys::IBV_ODP_SUPPORT_READ | sys::IBV_ODP_SUPPORT_ATOMIC;
    c.per_transport_caps.uc_odp_caps = all | sys::IBV_ODP_SUPPORT_WRITE;
    c.per_transport_caps.ud_odp_caps = all;
    c
}

/// `verbs_context.query_rt_values` (`ibv_query_rt_values_ex`): the device clock now, in
/// the units of `ibv_wc_read_completion_ts` (nanoseconds since the device opened; the
/// clock's rate is `hca_core_clock`), as mlx5 reports it: the count in `raw_clock.tv_nsec`
/// and `tv_sec` 0. EINVAL for a mask bit other than IBV_VALUES_MASK_RAW_CLOCK.
pub(crate) unsafe extern "C" fn query_rt_values(
    context: *mut sys::ibv_context,
    values: *mut sys::ibv_values_ex,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if values.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: `values` points at the caller's ibv_values_ex.
        let v = unsafe { &mut *values };
        if v.comp_mask & !sys::IBV_VALUES_MASK_RAW_CLOCK != 0 {
            return libc::EINVAL;
        }
        let mut done = 0;
        if v.comp_mask & sys::IBV_VALUES_MASK_RAW_CLOCK != 0 {
            v.raw_clock.tv_sec = 0;
            v.raw_clock.tv_nsec = ctx.dev().now().min(i64::MAX as u64) as _;
            done |= sys::IBV_VALUES_MASK_RAW_CLOCK;
        }
        v.comp_mask = done;
        0
    })
}

/// `verbs_context.query_device_ex`.
pub(crate) unsafe extern "C" fn query_device_ex(
    context: *mut sys::ibv_context,
    input: *const sys::ibv_query_device_ex_input,
    attr: *mut sys::ibv_device_attr_ex,
    attr_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        // SAFETY: `input` is null or the caller's input struct.
        if attr.is_null() || (!input.is_null() && unsafe { (*input).comp_mask } != 0) {
            return libc::EINVAL;
        }
        if attr_size < std::mem::size_of::<sys::ibv_device_attr>() {
            return libc::EINVAL;
        }
        let mut o: sys::ibv_device_attr_ex = zeroed();
        o.orig_attr = device_attr(ctx);
        o.completion_timestamp_mask = u64::MAX;
        o.hca_core_clock = CORE_CLOCK_KHZ;
        o.max_dm_size = ctx.dev().read(|r| r.device_attr().max_dm_size);
        o.phys_port_cnt_ex = u32::from(o.orig_attr.phys_port_cnt);
        o.odp_caps = odp_caps();
        // The kernel reports every capability here, the 32 bits of `device_cap_flags`
        // among them (`ib_uverbs_ex_query_device`); softrdma has none past them.
        o.device_cap_flags_ex = u64::from(o.orig_attr.device_cap_flags);
        // SAFETY: `attr` has `attr_size` bytes (the caller's sizeof).
        unsafe { crate::copy_prefix(&o, attr, attr_size) };
        0
    })
}

fn port_attr(ctx: &Ctx, port: u8) -> Result<sys::ibv_port_attr, i32> {
    let p = ctx.dev().port_attr(port).map_err(|e| e.errno.code())?;
    let mut o: sys::ibv_port_attr = zeroed();
    o.state = p.state;
    o.max_mtu = p.max_mtu as u32;
    o.active_mtu = p.active_mtu as u32;
    o.gid_tbl_len = p.gid_tbl_len;
    o.port_cap_flags = p.port_cap_flags;
    o.max_msg_sz = p.max_msg_sz;
    o.pkey_tbl_len = p.pkey_tbl_len;
    o.lid = p.lid;
    o.sm_lid = p.sm_lid;
    o.max_vl_num = 1;
    o.active_width = p.active_width;
    o.active_speed = p.active_speed;
    o.phys_state = p.phys_state;
    o.link_layer = p.link_layer;
    Ok(o)
}

/// `verbs_context.query_port`: what the inline `ibv_query_port` calls.
pub(crate) unsafe extern "C" fn query_port_ex(
    context: *mut sys::ibv_context,
    port_num: u8,
    attr: *mut sys::ibv_port_attr,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if attr.is_null() {
            return libc::EINVAL;
        }
        match port_attr(ctx, port_num) {
            Ok(o) => {
                // SAFETY: `attr` has `len` bytes (the caller's sizeof).
                unsafe { crate::copy_prefix(&o, attr, len) };
                0
            }
            Err(e) => e,
        }
    })
}

/// The exported `ibv_query_port` (old binaries, or code that bypasses the inline): the
/// compat struct is `ibv_port_attr` up to `link_layer`.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_port(
    context: *mut sys::ibv_context,
    port_num: u8,
    attr: *mut sys::_compat_ibv_port_attr,
) -> c_int {
    let len = std::mem::offset_of!(sys::ibv_port_attr, flags);
    // SAFETY: forwarded; the compat struct has at least `len` bytes.
    unsafe { query_port_ex(context, port_num, attr.cast::<sys::ibv_port_attr>(), len) }
}

fn gid_of(ctx: &Ctx, port: u32, index: u32) -> Result<Gid, i32> {
    if port != 1 || index > 255 {
        return Err(libc::EINVAL);
    }
    ctx.dev().query_gid(index as u8).map_err(|e| e.errno.code())
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid(
    context: *mut sys::ibv_context,
    port_num: u8,
    index: c_int,
    gid: *mut sys::ibv_gid,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if gid.is_null() || index < 0 {
            return minus_one(libc::EINVAL);
        }
        match gid_of(ctx, port_num as u32, index as u32) {
            Ok(g) => {
                // SAFETY: `gid` points at a caller's 16-byte union.
                unsafe { (*gid).raw = g.0 };
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

fn gid_entry(ctx: &Ctx, port: u32, index: u32) -> Result<sys::ibv_gid_entry, i32> {
    let g = gid_of(ctx, port, index)?;
    let mut e: sys::ibv_gid_entry = zeroed();
    e.gid.raw = g.0;
    e.gid_index = index;
    e.port_num = port;
    e.gid_type = sys::IBV_GID_TYPE_ROCE_V2;
    // The interface holding the GID's address (`lo` for 127.0.0.x), so that programs can
    // name it with if_indextoname as they do for a kernel RoCE device; 0 (none) when no
    // interface of this host holds it.
    e.ndev_ifindex = softrdma_device::netdev::holding(g.to_ip()).map_or(0, |n| n.index);
    Ok(e)
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_ex(
    context: *mut sys::ibv_context,
    port_num: u32,
    gid_index: u32,
    entry: *mut sys::ibv_gid_entry,
    flags: u32,
    entry_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return libc::EINVAL;
        };
        if entry.is_null() || flags != 0 {
            return libc::EINVAL;
        }
        match gid_entry(ctx, port_num, gid_index) {
            Ok(e) => {
                // SAFETY: `entry` has `entry_size` bytes.
                unsafe { crate::copy_prefix(&e, entry, entry_size) };
                0
            }
            Err(_) => libc::ENODATA,
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn _ibv_query_gid_table(
    context: *mut sys::ibv_context,
    entries: *mut sys::ibv_gid_entry,
    max_entries: usize,
    flags: u32,
    entry_size: usize,
) -> isize {
    guard(-(libc::EIO as isize), || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return -(libc::EINVAL as isize);
        };
        if flags != 0 || (entries.is_null() && max_entries > 0) || entry_size == 0 {
            return -(libc::EINVAL as isize);
        }
        let n = ctx.dev().read(|r| r.gids().len());
        if n > max_entries {
            return -(libc::EINVAL as isize);
        }
        for i in 0..n {
            if let Ok(e) = gid_entry(ctx, 1, i as u32) {
                // SAFETY: the caller's array holds `max_entries` entries of `entry_size`.
                unsafe {
                    let dst = entries.cast::<u8>().add(i * entry_size);
                    crate::copy_prefix(&e, dst.cast::<sys::ibv_gid_entry>(), entry_size);
                }
            }
        }
        n as isize
    })
}

/// `ibv_query_gid_type` (IBVERBS_PRIVATE_34, used by ibv_devinfo): every GID is RoCE v2.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_gid_type(
    context: *mut sys::ibv_context,
    port_num: u8,
    index: u32,
    gid_type: *mut u32,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if gid_type.is_null() {
            return minus_one(libc::EINVAL);
        }
        match gid_of(ctx, port_num as u32, index) {
            Ok(_) => {
                // SAFETY: points at the caller's enum ibv_gid_type_sysfs.
                unsafe { *gid_type = 1 }; // IBV_GID_TYPE_SYSFS_ROCE_V2
                0
            }
            Err(e) => minus_one(e),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_query_pkey(
    context: *mut sys::ibv_context,
    port_num: u8,
    index: c_int,
    pkey: *mut u16,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if pkey.is_null() || port_num != 1 || !(0..=0xFFFF).contains(&index) {
            return minus_one(libc::EINVAL);
        }
        match ctx.dev().pkey(index as u16) {
            Ok(p) => {
                // SAFETY: points at the caller's __be16.
                unsafe { *pkey = p.to_be() };
                0
            }
            Err(e) => minus_one(e.errno.code()),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_get_pkey_index(
    context: *mut sys::ibv_context,
    port_num: u8,
    pkey: u16,
) -> c_int {
    guard(-1, || {
        // SAFETY: caller passes a live context.
        let Some(ctx) = (unsafe { Ctx::from_ptr(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if port_num != 1 {
            return minus_one(libc::EINVAL);
        }
        let want = u16::from_be(pkey);
        let found = ctx.dev().read(|r| {
            (0..=u16::MAX)
                .map_while(|i| r.pkey(i).ok().map(|p| (i, p)))
                .find(|&(_, p)| p == want)
        });
        match found {
            Some((i, _)) => i as c_int,
            None => minus_one(libc::ENOENT),
        }
    })
}
