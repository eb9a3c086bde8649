//! Id options: `rdma_set_option` (type of service, REUSEADDR, AFONLY, ACK timeout, the
//! IB path record).

use std::ffi::{c_int, c_void};

use softrdma_cm::cma::IdOption;

use super::{done, with_id, CmId};
use crate::guard;
use crate::rdmacm::abi;

/// Read an option value of exactly `T`'s size.
///
/// # Safety
/// `v` points at `len` readable bytes.
unsafe fn opt<T: Copy>(v: *const c_void, len: usize) -> Result<T, c_int> {
    if v.is_null() || len != std::mem::size_of::<T>() {
        return Err(libc::EINVAL);
    }
    // SAFETY: per the contract and the size check.
    Ok(unsafe { v.cast::<T>().read_unaligned() })
}

#[no_mangle]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut abi::rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    guard(-1, || {
        // SAFETY: the caller passes a live id and `optlen` bytes at `optval`.
        done(
            unsafe {
                with_id(id, |me| {
                    let o = match (level, optname) {
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_TOS) => {
                            IdOption::Tos(opt::<u8>(optval, optlen)?)
                        }
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_REUSEADDR) => {
                            IdOption::ReuseAddr(opt::<c_int>(optval, optlen)? != 0)
                        }
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_AFONLY) => {
                            IdOption::AfOnly(opt::<c_int>(optval, optlen)? != 0)
                        }
                        (abi::RDMA_OPTION_ID, abi::RDMA_OPTION_ID_ACK_TIMEOUT) => {
                            IdOption::AckTimeout(opt::<u8>(optval, optlen)?)
                        }
                        (abi::RDMA_OPTION_IB, abi::RDMA_OPTION_IB_PATH) => {
                            return set_ib_path(me, optval, optlen);
                        }
                        _ => return Err(libc::ENOSYS),
                    };
                    me.model(|c, _, h| c.set_option(h, o))
                })
            }
            .map(|()| 0),
        )
    })
}

/// `RDMA_OPTION_IB_PATH`: the program supplies the route (as `rdma_create_ep` does with
/// `ai_route`); the RoCE path needs nothing from it but a primary bidirectional record,
/// and the route is resolved (ROUTE_RESOLVED), as Linux does.
///
/// # Safety
/// `optval` points at `optlen` readable bytes.
unsafe fn set_ib_path(me: &CmId, optval: *const c_void, optlen: usize) -> Result<(), c_int> {
    const PRIMARY: u32 = 1 << 4;
    const GMP: u32 = 1 << 5;
    const BIDIRECTIONAL: u32 = (1 << 2) | (1 << 3);
    let n = std::mem::size_of::<abi::ibv_path_data>();
    if optval.is_null() || optlen == 0 || optlen % n != 0 {
        return Err(libc::EINVAL);
    }
    let found = (0..optlen / n).any(|i| {
        // SAFETY: per the contract, record `i` lies within `optlen`.
        let d = unsafe { optval.cast::<abi::ibv_path_data>().add(i).read_unaligned() };
        d.flags & (PRIMARY | GMP) == PRIMARY | GMP && d.flags & BIDIRECTIONAL == BIDIRECTIONAL
    });
    if !found {
        return Err(libc::EINVAL);
    }
    me.model(|c, _, h| c.resolve_route(h))
}
