//! softrdma's `librdmacm.so.1`: the rdma_cm functions of `<rdma/rdma_cma.h>`, in the same
//! ELF file as the drop-in libibverbs, so that a process has one engine whichever library
//! name it loads. `softrdma run` (unless `SOFTRDMA_RDMACM=0`) puts the file on the library
//! path under both names; the loader recognises the second name as the object already
//! loaded (same file) and the `RDMACM_1.x` version nodes (`exports.txt`) satisfy programs
//! linked against rdma-core's librdmacm.
//!
//! The entry points follow the library's conventions: nothing panics across the C ABI
//! (`crate::guard`), failures are -1 with `errno` (or NULL with `errno`) as librdmacm
//! documents, and `rdma_getaddrinfo` passes getaddrinfo's `EAI_*` codes through as
//! librdmacm does.

pub mod abi;
mod accessors;
mod addrinfo;
mod cm;
mod devices;
mod event;
mod id;
mod mcast;
mod qp;
mod rsocket;
