//! What every command that runs traffic needs: its device, MTUs, waiting for
//! completions with the device's policy and an idle limit, and error lines for failed completions.

use std::time::Duration;

use softrdma::{CompletionQueue, Device, DeviceAddr, DeviceConfig, Mtu, WcStatus, WorkCompletion};

use crate::{CmdResult, DevOpts};

/// The configuration of device `name` (or the default one) with the command's options.
pub fn device_config(opts: &DevOpts) -> CmdResult<DeviceConfig> {
    let list = softrdma::devices().map_err(|e| format!("device configuration: {e}"))?;
    let info = match &opts.device {
        Some(n) => list.iter().find(|d| &d.name == n).ok_or_else(|| {
            let names: Vec<&str> = list.iter().map(|d| d.name.as_str()).collect();
            format!("no device named {n:?} (configured: {})", names.join(", "))
        })?,
        None => list.first().ok_or("no device configured")?,
    };
    let addr = if info.auto {
        DeviceAddr::AutoLoopback(info.addr.port())
    } else {
        DeviceAddr::Fixed(info.addr)
    };
    let mut cfg = DeviceConfig::new(&info.name, addr);
    if let Some(p) = &opts.pcap {
        cfg.pcap = Some(p.clone());
    }
    if opts.busy_poll {
        cfg.busy_poll = true;
    }
    Ok(cfg)
}

/// Open the device the options name.
pub fn open_device(opts: &DevOpts) -> CmdResult<Device> {
    let cfg = device_config(opts)?;
    Device::open_with(&cfg).map_err(|e| format!("cannot open device: {e}"))
}

/// Path MTU from its byte count.
pub fn mtu_of(bytes: u32) -> CmdResult<Mtu> {
    Mtu::from_bytes(bytes)
        .ok_or_else(|| format!("invalid MTU {bytes} (256, 512, 1024, 2048 or 4096)"))
}

/// An error line for a failed completion.
pub fn wc_error(wc: &WorkCompletion) -> String {
    let hint = match wc.status {
        WcStatus::RetryExcErr => " (the peer stopped answering)",
        WcStatus::RnrRetryExcErr => " (the peer posted no receive)",
        _ => "",
    };
    format!(
        "failed status {} ({}) for wr_id {}{hint}",
        wc.status.as_str(),
        wc.status as u32,
        wc.wr_id
    )
}

/// Waiting for completions with the device's policy ([`CompletionQueue::wait_or`]: spin
/// driving progress, then block until a datagram or a completion), every face alike, and
/// an idle limit: an error once nothing happened for `timeout`.
pub struct Poller {
    timeout: Duration,
}

impl Poller {
    pub fn new(timeout: Duration) -> Poller {
        Poller { timeout }
    }
    /// How long a wait may find nothing before it is an error.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
    /// Take up to `wcs.len()` completions of `cq`, at least one, waiting for them; an
    /// error once none came within the timeout.
    pub fn poll(&self, cq: &CompletionQueue, wcs: &mut [WorkCompletion]) -> CmdResult<usize> {
        self.poll_or(cq, wcs, || Ok(false))
    }
    /// Like [`Poller::poll`], or 0 as soon as `ready` says so (an error of `ready` ends
    /// the wait too).
    pub fn poll_or(
        &self,
        cq: &CompletionQueue,
        wcs: &mut [WorkCompletion],
        mut ready: impl FnMut() -> CmdResult<bool>,
    ) -> CmdResult<usize> {
        let mut failed = None;
        let r = cq.wait_or(wcs, self.timeout, || match ready() {
            Ok(r) => r,
            Err(e) => {
                failed = Some(e);
                true
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        match r {
            Ok(n) => Ok(n),
            Err(e) if e.is_timeout() => Err(format!(
                "no completion for {} s: the peer is gone or unreachable",
                self.timeout.as_secs()
            )),
            Err(e) => Err(format!("poll CQ failed: {e}")),
        }
    }
}

/// Take up to `wcs.len()` completions of `cq`, waiting for them with the device's policy
/// for no longer than `wait`: 0 when none came.
pub fn poll_within(
    cq: &CompletionQueue,
    wcs: &mut [WorkCompletion],
    wait: Duration,
) -> CmdResult<usize> {
    match cq.wait_or(wcs, wait, || false) {
        Ok(n) => Ok(n),
        Err(e) if e.is_timeout() => Ok(0),
        Err(e) => Err(format!("poll CQ failed: {e}")),
    }
}
