//! Address handles, and the address vectors they are made from.

use std::ffi::c_int;

use softrdma_device::verbs::{self, AhAttr, Gid, GlobalRoute};
use softrdma_device::Rnic;

use crate::object::{ctx_of, destroy, errno, leak, Destroy};
use crate::pd::pd_ctx;
use crate::{guard, minus_one, null_errno, sys, zeroed};

#[repr(C)]
pub(crate) struct Ah {
    pub(crate) c: sys::ibv_ah,
    pub(crate) id: verbs::AhId,
}

impl Destroy for Ah {
    type C = sys::ibv_ah;
    fn context(&self) -> *mut sys::ibv_context {
        self.c.context
    }
    fn destroy_verbs(&self, r: &mut Rnic) -> verbs::Result<()> {
        r.destroy_ah(self.id)
    }
    fn pd(&self) -> *mut sys::ibv_pd {
        self.c.pd
    }
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah(
    pd: *mut sys::ibv_pd,
    attr: *mut sys::ibv_ah_attr,
) -> *mut sys::ibv_ah {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, ctx)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        if attr.is_null() {
            return null_errno(libc::EINVAL);
        }
        // SAFETY: `attr` points at the caller's attributes.
        let a = ah_from_c(unsafe { &*attr });
        let pid = p.id;
        match ctx.dev().create_ah(pid, &a) {
            Ok(id) => {
                let mut c: sys::ibv_ah = zeroed();
                c.context = p.c.context;
                c.pd = pd;
                c.handle = id.0;
                // SAFETY: `pd` is the live PD the AH was made in.
                unsafe { crate::pd::hold(pd) };
                leak(Ah { c, id }).cast()
            }
            Err(e) => null_errno(errno(&e)),
        }
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut sys::ibv_ah) -> c_int {
    // SAFETY: the caller passes an AH of this library and does not use it once destroyed.
    unsafe { destroy::<Ah>(ah) }
}

/// The address vector back to the sender of a received UD message: the 40-byte GRH area
/// holds an IPv6 header, or (RoCEv2 over IPv4, as rxe) an IPv4 header in its last 20
/// bytes.
#[no_mangle]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    context: *mut sys::ibv_context,
    port_num: u8,
    wc: *mut sys::ibv_wc,
    grh: *mut sys::ibv_grh,
    ah_attr: *mut sys::ibv_ah_attr,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live context.
        let Some(ctx) = (unsafe { ctx_of(context) }) else {
            return minus_one(libc::EINVAL);
        };
        if wc.is_null() || grh.is_null() || ah_attr.is_null() {
            return minus_one(libc::EINVAL);
        }
        // SAFETY: `wc` is the caller's completion; `grh` its 40-byte GRH area.
        let (w, g) = unsafe { (*wc, std::slice::from_raw_parts(grh.cast::<u8>(), 40)) };
        if w.wc_flags & sys::IBV_WC_GRH == 0 {
            return minus_one(libc::EINVAL);
        }
        let (sgid, dgid, tclass, flow) = if g[0] >> 4 == 6 {
            let mut s = [0u8; 16];
            let mut d = [0u8; 16];
            s.copy_from_slice(&g[8..24]);
            d.copy_from_slice(&g[24..40]);
            let vtf = u32::from_be_bytes([g[0], g[1], g[2], g[3]]);
            (Gid(s), Gid(d), ((vtf >> 20) & 0xFF) as u8, vtf & 0xF_FFFF)
        } else if g[20] >> 4 == 4 {
            let ip = &g[20..40];
            let src = std::net::Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
            let dst = std::net::Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
            (Gid::from_ipv4(src), Gid::from_ipv4(dst), ip[1], 0)
        } else {
            return minus_one(libc::EINVAL);
        };
        // Our GID the message was sent to is the source GID of the reply.
        let sgid_index = ctx
            .dev()
            .read(|r| r.gids().iter().position(|x| *x == dgid))
            .unwrap_or(0) as u8;
        let mut o: sys::ibv_ah_attr = zeroed();
        o.grh.dgid.raw = sgid.0;
        o.grh.flow_label = flow;
        o.grh.sgid_index = sgid_index;
        o.grh.hop_limit = 0xFF;
        o.grh.traffic_class = tclass;
        o.dlid = w.slid;
        o.sl = w.sl;
        o.src_path_bits = w.dlid_path_bits;
        o.is_global = 1;
        o.port_num = port_num;
        // SAFETY: `ah_attr` points at the caller's struct.
        unsafe { ah_attr.write(o) };
        0
    })
}

#[no_mangle]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut sys::ibv_pd,
    wc: *mut sys::ibv_wc,
    grh: *mut sys::ibv_grh,
    port_num: u8,
) -> *mut sys::ibv_ah {
    guard(std::ptr::null_mut(), || {
        // SAFETY: the caller passes a PD of this library.
        let Some((p, _)) = (unsafe { pd_ctx(pd) }) else {
            return null_errno(libc::EINVAL);
        };
        let mut a: sys::ibv_ah_attr = zeroed();
        // SAFETY: forwarded under the caller's contract; `a` is a live local.
        if unsafe { ibv_init_ah_from_wc(p.c.context, port_num, wc, grh, &mut a) } != 0 {
            return std::ptr::null_mut();
        }
        // SAFETY: as above.
        unsafe { ibv_create_ah(pd, &mut a) }
    })
}

pub(crate) fn ah_from_c(a: &sys::ibv_ah_attr) -> AhAttr {
    // SAFETY: every bit pattern of the 16-byte GID union is a valid byte array.
    let dgid = unsafe { a.grh.dgid.raw };
    AhAttr {
        grh: GlobalRoute {
            dgid: Gid(dgid),
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
    }
}

pub(crate) fn ah_to_c(a: &AhAttr) -> sys::ibv_ah_attr {
    let mut o: sys::ibv_ah_attr = zeroed();
    o.grh.dgid.raw = a.grh.dgid.0;
    o.grh.flow_label = a.grh.flow_label;
    o.grh.sgid_index = a.grh.sgid_index;
    o.grh.hop_limit = a.grh.hop_limit;
    o.grh.traffic_class = a.grh.traffic_class;
    o.dlid = a.dlid;
    o.sl = a.sl;
    o.src_path_bits = a.src_path_bits;
    o.static_rate = a.static_rate;
    o.is_global = a.is_global as u8;
    o.port_num = a.port_num;
    o
}
