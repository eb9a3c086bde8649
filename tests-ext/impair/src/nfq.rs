//! The nfnetlink_queue protocol, as bytes: the configuration and verdict messages the
//! impairer sends, and a parser for what the kernel sends back. Pure functions over
//! buffers (the socket lives in the binary), so they are tested without root.
//!
//! Layout (linux/netlink.h, linux/netfilter/nfnetlink.h, nfnetlink_queue.h): every
//! message is a 16-byte `nlmsghdr` in host byte order, then a 4-byte `nfgenmsg` (family,
//! version, queue number big-endian), then attributes (`nlattr`: u16 length including its
//! 4-byte header, u16 type; padded to 4 bytes). Attribute payloads are big-endian.

/// `NETLINK_NETFILTER`, the netlink family of nfnetlink.
pub const NETLINK_NETFILTER: i32 = 12;
const NFNL_SUBSYS_QUEUE: u16 = 3;
const NFQNL_MSG_PACKET: u16 = 0;
const NFQNL_MSG_VERDICT: u16 = 1;
const NFQNL_MSG_CONFIG: u16 = 2;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLM_F_REQUEST: u16 = 1;
const NLM_F_ACK: u16 = 4;
const NLMSG_HDRLEN: usize = 16;
const NFGEN_LEN: usize = 4;

const NFQA_PACKET_HDR: u16 = 1;
const NFQA_VERDICT_HDR: u16 = 2;
const NFQA_MARK: u16 = 3;
const NFQA_PAYLOAD: u16 = 10;
const NFQA_SKB_INFO: u16 = 14;
const NFQA_CFG_CMD: u16 = 1;
const NFQA_CFG_PARAMS: u16 = 2;
const NFQA_CFG_QUEUE_MAXLEN: u16 = 3;
const NFQNL_CFG_CMD_BIND: u8 = 1;
const NFQNL_COPY_PACKET: u8 = 2;
/// `NFQA_SKB_CSUMNOTREADY`: the transport checksum is left to the NIC (CHECKSUM_PARTIAL),
/// so the field holds only the pseudo-header sum.
pub const SKB_CSUM_NOT_READY: u32 = 1;

/// `NF_DROP`.
pub const NF_DROP: u32 = 0;
/// `NF_ACCEPT`.
pub const NF_ACCEPT: u32 = 1;

fn align4(n: usize) -> usize {
    (n + 3) & !3
}

/// A netlink message under construction.
struct Builder {
    buf: Vec<u8>,
}

impl Builder {
    fn new(msg: u16, flags: u16, seq: u32, family: u8, queue: u16) -> Builder {
        let mut buf = Vec::with_capacity(64);
        buf.extend_from_slice(&0u32.to_ne_bytes()); // length, set in finish()
        buf.extend_from_slice(&((NFNL_SUBSYS_QUEUE << 8) | msg).to_ne_bytes());
        buf.extend_from_slice(&flags.to_ne_bytes());
        buf.extend_from_slice(&seq.to_ne_bytes());
        buf.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel
        buf.extend_from_slice(&[family, 0]); // NFNETLINK_V0
        buf.extend_from_slice(&queue.to_be_bytes());
        Builder { buf }
    }

    fn attr(mut self, ty: u16, data: &[u8]) -> Builder {
        // An attribute longer than u16 cannot be said in netlink; callers keep payloads
        // under 64 KiB (the copy range), and a longer one is cut rather than mislabelled.
        let data = &data[..data.len().min(usize::from(u16::MAX) - 4)];
        self.buf
            .extend_from_slice(&((4 + data.len()) as u16).to_ne_bytes());
        self.buf.extend_from_slice(&ty.to_ne_bytes());
        self.buf.extend_from_slice(data);
        self.buf.resize(align4(self.buf.len()), 0);
        self
    }

    fn finish(mut self) -> Vec<u8> {
        let len = self.buf.len() as u32;
        self.buf[..4].copy_from_slice(&len.to_ne_bytes());
        self.buf
    }
}

/// A configuration message for queue `queue`, acknowledged.
fn config(seq: u32, queue: u16) -> Builder {
    Builder::new(
        NFQNL_MSG_CONFIG,
        NLM_F_REQUEST | NLM_F_ACK,
        seq,
        libc::AF_UNSPEC as u8,
        queue,
    )
}

/// Bind this socket to queue `queue` (for IPv4), asking for an acknowledgement.
pub fn bind_msg(seq: u32, queue: u16) -> Vec<u8> {
    let pf = (libc::AF_INET as u16).to_be_bytes();
    config(seq, queue)
        .attr(NFQA_CFG_CMD, &[NFQNL_CFG_CMD_BIND, 0, pf[0], pf[1]])
        .finish()
}

/// Ask for whole packets (up to `copy_range` bytes) and a queue of `maxlen` packets.
pub fn params_msg(seq: u32, queue: u16, copy_range: u32, maxlen: u32) -> Vec<u8> {
    let mut p = copy_range.to_be_bytes().to_vec();
    p.push(NFQNL_COPY_PACKET);
    config(seq, queue)
        .attr(NFQA_CFG_PARAMS, &p)
        .attr(NFQA_CFG_QUEUE_MAXLEN, &maxlen.to_be_bytes())
        .finish()
}

/// The verdict on packet `id`; with `payload`, the packet's bytes are replaced by it;
/// with `mark`, the packet's mark is set.
pub fn verdict_msg(
    seq: u32,
    queue: u16,
    id: u32,
    verdict: u32,
    payload: Option<&[u8]>,
    mark: Option<u32>,
) -> Vec<u8> {
    let mut hdr = verdict.to_be_bytes().to_vec();
    hdr.extend_from_slice(&id.to_be_bytes());
    let mut b = Builder::new(
        NFQNL_MSG_VERDICT,
        NLM_F_REQUEST,
        seq,
        libc::AF_UNSPEC as u8,
        queue,
    )
    .attr(NFQA_VERDICT_HDR, &hdr);
    if let Some(m) = mark {
        b = b.attr(NFQA_MARK, &m.to_be_bytes());
    }
    if let Some(p) = payload {
        b = b.attr(NFQA_PAYLOAD, p);
    }
    b.finish()
}

/// One message the kernel sent.
#[derive(Debug, PartialEq, Eq)]
pub enum Msg<'a> {
    /// A queued packet.
    Packet {
        /// The id its verdict must name.
        id: u32,
        /// Its bytes from the IP header on (empty when the kernel sent none).
        payload: &'a [u8],
        /// `NFQA_SKB_INFO` flags (0 when absent).
        skb_info: u32,
    },
    /// An acknowledgement (`errno` 0) or an error reply to the message `seq`.
    Ack {
        /// The sequence number of the message it answers.
        seq: u32,
        /// 0 for success, else a positive errno.
        errno: i32,
    },
    /// Anything else (another message type, or a packet without its header attribute).
    Other(u16),
}

/// The messages in one datagram from the kernel. Stops at the first malformed header:
/// a length that is too short or runs past the buffer ends the iteration.
pub fn messages(buf: &[u8]) -> Messages<'_> {
    Messages { buf }
}

/// Iterator returned by [`messages`].
pub struct Messages<'a> {
    buf: &'a [u8],
}

fn u16_ne(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn u32_ne(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}
fn u32_be(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_be_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl<'a> Iterator for Messages<'a> {
    type Item = Msg<'a>;

    fn next(&mut self) -> Option<Msg<'a>> {
        let len = u32_ne(self.buf, 0)? as usize;
        if len < NLMSG_HDRLEN || len > self.buf.len() {
            self.buf = &[];
            return None;
        }
        let msg = &self.buf[..len];
        self.buf = self.buf.get(align4(len)..).unwrap_or(&[]);
        let ty = u16_ne(msg, 4)?;
        let seq = u32_ne(msg, 8)?;
        if ty == NLMSG_ERROR {
            // struct nlmsgerr: a negative errno, then the offending message's header.
            let err = u32_ne(msg, NLMSG_HDRLEN)
                .map(|e| e as i32)
                .unwrap_or(-libc::EIO);
            let acked = u32_ne(msg, NLMSG_HDRLEN + 4 + 8).unwrap_or(seq);
            return Some(Msg::Ack {
                seq: acked,
                errno: -err,
            });
        }
        if ty == NLMSG_DONE || ty != ((NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET) {
            return Some(Msg::Other(ty));
        }
        let (mut id, mut payload, mut skb_info) = (None, &msg[..0], 0);
        for (aty, data) in attrs(msg.get(NLMSG_HDRLEN + NFGEN_LEN..).unwrap_or(&[])) {
            match aty {
                NFQA_PACKET_HDR => id = u32_be(data, 0),
                NFQA_PAYLOAD => payload = data,
                NFQA_SKB_INFO => skb_info = u32_be(data, 0).unwrap_or(0),
                _ => {}
            }
        }
        Some(match id {
            Some(id) => Msg::Packet {
                id,
                payload,
                skb_info,
            },
            None => Msg::Other(ty),
        })
    }
}

/// The (type, data) attributes in `b`, the flag bits of the type cleared; stops at the
/// first malformed one.
pub fn attrs(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        let len = usize::from(u16_ne(b, 0)?);
        let ty = u16_ne(b, 2)? & 0x3FFF;
        if len < 4 || len > b.len() {
            b = &[];
            return None;
        }
        let data = &b[4..len];
        b = b.get(align4(len)..).unwrap_or(&[]);
        Some((ty, data))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packet message as the kernel builds it (nfqnl_build_packet_message).
    fn kernel_packet(id: u32, payload: &[u8], skb_info: Option<u32>) -> Vec<u8> {
        let mut hdr = id.to_be_bytes().to_vec();
        hdr.extend_from_slice(&0x0800u16.to_be_bytes());
        hdr.push(3); // NF_INET_LOCAL_OUT
        let mut b = Builder::new(NFQNL_MSG_PACKET, 0, 0, libc::AF_INET as u8, 7)
            .attr(NFQA_PACKET_HDR, &hdr)
            .attr(NFQA_MARK, &0u32.to_be_bytes());
        if let Some(i) = skb_info {
            b = b.attr(NFQA_SKB_INFO, &i.to_be_bytes());
        }
        b.attr(NFQA_PAYLOAD, payload).finish()
    }

    fn nlmsgerr(seq: u32, errno: i32) -> Vec<u8> {
        let mut m = Vec::new();
        m.extend_from_slice(&36u32.to_ne_bytes());
        m.extend_from_slice(&NLMSG_ERROR.to_ne_bytes());
        m.extend_from_slice(&0u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&(-errno).to_ne_bytes());
        // The header of the message it answers.
        m.extend_from_slice(&32u32.to_ne_bytes());
        m.extend_from_slice(&0x0302u16.to_ne_bytes());
        m.extend_from_slice(&5u16.to_ne_bytes());
        m.extend_from_slice(&seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        m
    }

    #[test]
    fn parses_packets_acks_and_several_per_datagram() {
        let p1 = [0x45u8, 1, 2, 3, 4];
        let mut dgram = kernel_packet(0x0102_0304, &p1, None);
        dgram.extend(kernel_packet(9, &[], Some(SKB_CSUM_NOT_READY)));
        dgram.extend(nlmsgerr(77, 0));
        dgram.extend(nlmsgerr(78, libc::EBUSY));
        let got: Vec<Msg> = messages(&dgram).collect();
        assert_eq!(
            got,
            vec![
                Msg::Packet {
                    id: 0x0102_0304,
                    payload: &p1,
                    skb_info: 0
                },
                Msg::Packet {
                    id: 9,
                    payload: &[],
                    skb_info: SKB_CSUM_NOT_READY
                },
                Msg::Ack { seq: 77, errno: 0 },
                Msg::Ack {
                    seq: 78,
                    errno: libc::EBUSY
                },
            ]
        );
    }

    #[test]
    fn built_messages_have_the_kernel_layout() {
        let v = verdict_msg(5, 7, 42, NF_ACCEPT, Some(&[1, 2, 3]), Some(0x4791));
        assert_eq!(u32_ne(&v, 0), Some(v.len() as u32));
        assert_eq!(u16_ne(&v, 4), Some(0x0301));
        assert_eq!(u16_ne(&v, 6), Some(NLM_F_REQUEST));
        assert_eq!(u32_ne(&v, 8), Some(5));
        assert_eq!(&v[16..20], &[0, 0, 0, 7]);
        let a: Vec<(u16, &[u8])> = attrs(&v[20..]).collect();
        assert_eq!(
            a,
            vec![
                (NFQA_VERDICT_HDR, &[0u8, 0, 0, 1, 0, 0, 0, 42][..]),
                (NFQA_MARK, &[0u8, 0, 0x47, 0x91][..]),
                (NFQA_PAYLOAD, &[1u8, 2, 3][..]),
            ]
        );
        let b = bind_msg(1, 7);
        assert_eq!(u16_ne(&b, 4), Some(0x0302));
        assert_eq!(u16_ne(&b, 6), Some(NLM_F_REQUEST | NLM_F_ACK));
        let a: Vec<(u16, &[u8])> = attrs(&b[20..]).collect();
        assert_eq!(a, vec![(NFQA_CFG_CMD, &[1u8, 0, 0, 2][..])]);
        let p = params_msg(2, 7, 0xFFFF, 4096);
        let a: Vec<(u16, &[u8])> = attrs(&p[20..]).collect();
        assert_eq!(
            a,
            vec![
                (NFQA_CFG_PARAMS, &[0u8, 0, 0xFF, 0xFF, 2][..]),
                (NFQA_CFG_QUEUE_MAXLEN, &[0u8, 0, 0x10, 0][..]),
            ]
        );
        // The parser reads back what the builder wrote.
        let v = verdict_msg(1, 1, 1, NF_DROP, None, None);
        assert_eq!(messages(&v).count(), 1);
    }

    #[test]
    fn malformed_input_never_panics() {
        let good = kernel_packet(3, &[0x45; 40], Some(1));
        // Every truncation and every single-byte corruption of a good message.
        for cut in 0..good.len() {
            let _ = messages(&good[..cut]).count();
        }
        for i in 0..good.len() {
            for v in [0u8, 1, 3, 4, 0x7F, 0xFF] {
                let mut b = good.clone();
                b[i] = v;
                let _ = messages(&b).count();
            }
        }
        // Pseudo-random garbage.
        let mut r = softrdma_wire::SplitMix64::new(11);
        for _ in 0..2000 {
            let n = r.below(80) as usize;
            let b: Vec<u8> = (0..n).map(|_| r.next_u64() as u8).collect();
            let _ = messages(&b).count();
            let _ = attrs(&b).count();
        }
        // A header whose length is zero or runs past the end ends the iteration.
        let mut z = good.clone();
        z[..4].copy_from_slice(&0u32.to_ne_bytes());
        assert_eq!(messages(&z).count(), 0);
        let mut long = good;
        long[..4].copy_from_slice(&10_000u32.to_ne_bytes());
        assert_eq!(messages(&long).count(), 0);
    }
}
