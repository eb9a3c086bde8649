//! The sizes a socket is made with, and where they come from: rsockets' defaults, or what
//! the administrator put in rdma-core's rsockets configuration directory.

/// A send waits for this much free send buffer (rsockets' `RS_SNDLOWAT`).
pub const SNDLOWAT: u32 = 2048;
/// The smallest and largest queue depth a socket asks for.
pub const QP_MIN: u16 = 16;
/// See [`QP_MIN`].
pub const QP_MAX: u16 = 0xFFFE;
/// What rsockets ask of the connection when they connect (rdma-core's `rs_do_connect`):
/// flow control, seven transport retries, RNR retries without end. They ask for no READ
/// or atomic depth: the protocol uses neither.
pub const CONNECT_FLOW_CONTROL: u8 = 1;
/// See [`CONNECT_FLOW_CONTROL`].
pub const CONNECT_RETRY: u8 = 7;
/// See [`CONNECT_FLOW_CONTROL`].
pub const CONNECT_RNR_RETRY: u8 = 7;

/// Where rdma-core's rsockets read their defaults (one number per file).
pub const CONF_DIR: &str = "/etc/rdma/rsocket";

/// Sizes a socket is made with (the sockets a listener accepts inherit them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Send queue depth.
    pub sq_size: u16,
    /// Receive queue depth: also the receive credits offered.
    pub rq_size: u16,
    /// Bytes a send may carry inline.
    pub sq_inline: u32,
    /// Send buffer bytes.
    pub sbuf_size: u32,
    /// Receive buffer bytes (offered to the peer in two halves).
    pub rbuf_size: u32,
    /// Entries of the iomap table the peer may fill (`riomap`).
    pub iomap_size: u16,
}

impl Config {
    /// rsockets' own defaults: 384-deep queues, 64 bytes inline, 128 KiB buffers, no
    /// iomap.
    pub const RSOCKETS: Config = Config {
        sq_size: 384,
        rq_size: 384,
        sq_inline: 64,
        sbuf_size: 1 << 17,
        rbuf_size: 1 << 17,
        iomap_size: 0,
    };

    /// The defaults with what [`CONF_DIR`] sets (`sqsize_default`, `rqsize_default`,
    /// `inline_default`, `mem_default`, `wmem_default`, `iomap_size`), within rsockets'
    /// limits (a send buffer below [`SNDLOWAT`] becomes twice it; the iomap size one the
    /// connection data can carry). Read once per process.
    pub fn from_system() -> Config {
        static D: std::sync::OnceLock<Config> = std::sync::OnceLock::new();
        *D.get_or_init(|| Config::from_values(conf_value))
    }

    /// The defaults with the values `get` names (see [`Config::from_system`]).
    pub fn from_values(get: impl Fn(&str) -> Option<u32>) -> Config {
        let u16_of = |v: u32| v.min(u32::from(u16::MAX)) as u16;
        let mut c = Config::RSOCKETS;
        if let Some(v) = get("sqsize_default") {
            c.sq_size = u16_of(v);
        }
        if let Some(v) = get("rqsize_default") {
            c.rq_size = u16_of(v);
        }
        if let Some(v) = get("inline_default") {
            c.sq_inline = v.min(u32::from(u16::MAX));
        }
        if let Some(v) = get("mem_default") {
            c.rbuf_size = v.clamp(1, 1 << 28);
        }
        if let Some(v) = get("wmem_default") {
            c.sbuf_size = if v < SNDLOWAT {
                SNDLOWAT << 1
            } else {
                v.min(1 << 28)
            };
        }
        if let Some(v) = get("iomap_size") {
            c.iomap_size = carried_iomap_size(v);
        }
        c
    }

    /// The RC QP's capacities a socket of these sizes asks for (rsockets'
    /// `rs_create_ep`): its queue depths, two gather entries (a send that wraps the send
    /// buffer), one scatter entry, its inline size. Every send is signaled.
    pub fn qp_cap(&self) -> softrdma_verbs::QpCap {
        softrdma_verbs::QpCap {
            max_send_wr: u32::from(self.sq_size),
            max_recv_wr: u32::from(self.rq_size),
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: self.sq_inline,
        }
    }

    /// Entries of the socket's one CQ (its sends and receives).
    pub fn cq_depth(&self) -> u32 {
        u32::from(self.sq_size) + u32::from(self.rq_size)
    }

    /// The queue depths within what a device allows (`max_qp_wr`), as rsockets clamp
    /// them when they make the QP.
    pub fn fit_device(&mut self, max_qp_wr: u32) {
        let max = (max_qp_wr.min(u32::from(QP_MAX)) as u16).max(QP_MIN);
        self.sq_size = self.sq_size.clamp(QP_MIN, max);
        self.rq_size = self.rq_size.clamp(QP_MIN, max);
    }
}

impl Default for Config {
    /// [`Config::from_system`].
    fn default() -> Config {
        Config::from_system()
    }
}

/// An iomap size as the connection data's one byte carries it (exact up to 128, coarser
/// above), which is what the peer will see.
pub fn carried_iomap_size(v: u32) -> u16 {
    use softrdma_wire::rsocket::{scale_to_value, value_to_scale};
    scale_to_value(value_to_scale(v.min(0xFFFF), 8) & 0xFF, 8) as u16
}

/// A number from rsockets' configuration directory.
pub fn conf_value(name: &str) -> Option<u32> {
    let text = std::fs::read_to_string(format!("{CONF_DIR}/{name}")).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_values_within_rsockets_limits() {
        let c = Config::from_values(|n| match n {
            "wmem_default" => Some(100),
            "mem_default" => Some(1 << 30),
            "sqsize_default" => Some(1 << 20),
            "iomap_size" => Some(1000),
            _ => None,
        });
        assert_eq!(c.sbuf_size, SNDLOWAT << 1);
        assert_eq!(c.rbuf_size, 1 << 28);
        assert_eq!(c.sq_size, u16::MAX);
        assert_eq!(c.iomap_size, 768, "1000 carried in one byte is 3 << 8");
        assert_eq!(c.rq_size, 384);
        let mut c = c;
        c.fit_device(4096);
        assert_eq!((c.sq_size, c.rq_size), (4096, 384));
        c.fit_device(1);
        assert_eq!((c.sq_size, c.rq_size), (QP_MIN, QP_MIN));
    }
}
