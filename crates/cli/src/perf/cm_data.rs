//! The `--cm` set-up protocol.
//!
//! The request and the answer ride in the CM's private data instead of the text lines of
//! the side channel, big-endian:
//!
//! ```text
//!   REQ (36 of its 56 bytes): "SRP1", test (1), flags (1: bit 0 wait=memory, bit 1 -a),
//!                             0 (2), size (4; with -a unused), iters (4),
//!                             addr (8), rkey (4), len (8)
//!   REP (24 of 196):          "SRP1", addr (8), rkey (4), len (8)
//! ```
//!
//! QP numbers and PSNs are the CM's own. A request the server refuses is rejected with
//! the reason as text in the REJ; the end of the run is the client's disconnect.

use softrdma::RemoteMemory;

use crate::{CmdResult, PerfTest};

use super::{sizes_of, MAX_SIZE};

const CM_MAGIC: &[u8; 4] = b"SRP1";
const CM_REQ_LEN: usize = 36;
const CM_REP_LEN: usize = 24;
const CM_WAIT_MEMORY: u8 = 1;
const CM_ALL_SIZES: u8 = 2;
/// The tests in the order of their codes in a request.
const CM_TESTS: [PerfTest; 8] = [
    PerfTest::WriteBw,
    PerfTest::ReadBw,
    PerfTest::SendBw,
    PerfTest::AtomicBw,
    PerfTest::WriteLat,
    PerfTest::ReadLat,
    PerfTest::SendLat,
    PerfTest::AtomicLat,
];

/// What a `--cm` client asks for.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct CmRequest {
    pub(super) test: PerfTest,
    /// None: every size (-a).
    pub(super) size: Option<u32>,
    pub(super) iters: u32,
    pub(super) memory_wait: bool,
    pub(super) mem: RemoteMemory,
}

fn put_mem(v: &mut Vec<u8>, m: &RemoteMemory) {
    v.extend_from_slice(&m.addr.to_be_bytes());
    v.extend_from_slice(&m.rkey.to_be_bytes());
    v.extend_from_slice(&m.len.to_be_bytes());
}

fn get_mem(b: &[u8]) -> RemoteMemory {
    let u64_at = |i: usize| u64::from_be_bytes(b[i..i + 8].try_into().unwrap_or([0; 8]));
    RemoteMemory {
        addr: u64_at(0),
        rkey: u32::from_be_bytes(b[8..12].try_into().unwrap_or([0; 4])),
        len: u64_at(12),
    }
}

impl CmRequest {
    pub(super) fn encode(&self) -> Vec<u8> {
        let code = CM_TESTS.iter().position(|&t| t == self.test).unwrap_or(0);
        let mut flags = 0;
        if self.memory_wait {
            flags |= CM_WAIT_MEMORY;
        }
        if self.size.is_none() {
            flags |= CM_ALL_SIZES;
        }
        let mut v = CM_MAGIC.to_vec();
        v.extend_from_slice(&[code as u8, flags, 0, 0]);
        v.extend_from_slice(&self.size.unwrap_or(0).to_be_bytes());
        v.extend_from_slice(&self.iters.to_be_bytes());
        put_mem(&mut v, &self.mem);
        v
    }

    pub(super) fn decode(b: &[u8]) -> CmdResult<CmRequest> {
        if b.len() < CM_REQ_LEN || &b[..4] != CM_MAGIC {
            return Err("not a softrdma perf client".into());
        }
        let test = *CM_TESTS
            .get(usize::from(b[4]))
            .ok_or_else(|| format!("unknown test {}", b[4]))?;
        let u32_at = |i: usize| u32::from_be_bytes(b[i..i + 4].try_into().unwrap_or([0; 4]));
        let (flags, size, iters) = (b[5], u32_at(8), u32_at(12));
        let size = (flags & CM_ALL_SIZES == 0).then_some(size);
        if size.is_some_and(|s| !(1..=MAX_SIZE).contains(&s)) {
            return Err("bad sizes".into());
        }
        if iters == 0 {
            return Err("bad iters".into());
        }
        Ok(CmRequest {
            test,
            size,
            iters,
            memory_wait: flags & CM_WAIT_MEMORY != 0,
            mem: get_mem(&b[16..CM_REQ_LEN]),
        })
    }

    pub(super) fn sizes(&self) -> CmdResult<Vec<u32>> {
        sizes_of(self.test, self.size, self.size.is_none())
    }
}

pub(super) fn encode_answer(m: &RemoteMemory) -> Vec<u8> {
    let mut v = CM_MAGIC.to_vec();
    put_mem(&mut v, m);
    v
}

pub(super) fn decode_answer(b: &[u8]) -> CmdResult<RemoteMemory> {
    if b.len() < CM_REP_LEN || &b[..4] != CM_MAGIC {
        return Err("the peer is not a softrdma perf server".into());
    }
    Ok(get_mem(&b[4..CM_REP_LEN]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use softrdma::cm;

    #[test]
    fn cm_request_and_answer_fit_and_round_trip() {
        let mem = RemoteMemory {
            addr: 0x7f00_1234_5678,
            rkey: 0xdead_beef,
            len: 1 << 23,
        };
        for (test, size) in [(PerfTest::WriteLat, None), (PerfTest::SendBw, Some(4096))] {
            let q = CmRequest {
                test,
                size,
                iters: 5000,
                memory_wait: size.is_none(),
                mem,
            };
            let b = q.encode();
            assert_eq!(b.len(), CM_REQ_LEN);
            assert!(b.len() <= cm::MAX_CONNECT_PRIVATE);
            // The REQ arrives zero-padded to its 56 bytes.
            let mut padded = b.clone();
            padded.resize(cm::MAX_CONNECT_PRIVATE, 0);
            assert_eq!(CmRequest::decode(&padded).unwrap(), q);
        }
        let a = encode_answer(&mem);
        assert_eq!(a.len(), CM_REP_LEN);
        assert_eq!(decode_answer(&a).unwrap(), mem);
        assert!(CmRequest::decode(b"SRP1").is_err());
        assert!(decode_answer(&[0; 24]).is_err());
        let mut bad = CmRequest {
            test: PerfTest::ReadBw,
            size: Some(MAX_SIZE + 1),
            iters: 1,
            memory_wait: false,
            mem,
        }
        .encode();
        assert!(CmRequest::decode(&bad).is_err(), "size out of range");
        bad[4] = 99;
        assert!(CmRequest::decode(&bad).is_err(), "unknown test");
    }
}
