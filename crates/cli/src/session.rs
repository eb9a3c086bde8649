//! What every command that runs traffic needs: its device, MTUs, completion
//! polling with a back-off and deadline, and error lines for failed completions.

use std::time::{Duration, Instant};

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
    Ok(match bytes {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => {
            return Err(format!(
                "invalid MTU {bytes} (256, 512, 1024, 2048 or 4096)"
            ))
        }
    })
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

/// Poll loop with a back-off: spin briefly, then yield, then nap — and a deadline that
/// is pushed forward by every completion.
pub struct Poller {
    idle_since: Instant,
    timeout: Duration,
}

impl Poller {
    pub fn new(timeout: Duration) -> Poller {
        Poller {
            idle_since: Instant::now(),
            timeout,
        }
    }
    /// Poll `cq` into `wcs`; waits (with back-off) until at least one completion or the
    /// idle timeout.
    pub fn poll(&mut self, cq: &CompletionQueue, wcs: &mut [WorkCompletion]) -> CmdResult<usize> {
        loop {
            let n = cq.poll(wcs).map_err(|e| format!("poll CQ failed: {e}"))?;
            if n > 0 {
                self.idle_since = Instant::now();
                return Ok(n);
            }
            self.idle()?;
        }
    }
    /// One back-off step; an error once idle for longer than the timeout.
    pub fn idle(&mut self) -> CmdResult {
        self.check_timeout()?;
        let e = self.idle_since.elapsed();
        if e < Duration::from_micros(100) {
            std::hint::spin_loop();
        } else if e < Duration::from_millis(5) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }
    /// An error once idle for longer than the timeout (no back-off).
    pub fn check_timeout(&self) -> CmdResult {
        if self.idle_since.elapsed() > self.timeout {
            return Err(format!(
                "no completion for {} s: the peer is gone or unreachable",
                self.timeout.as_secs()
            ));
        }
        Ok(())
    }
    /// Note progress made outside `poll`.
    pub fn progress(&mut self) {
        self.idle_since = Instant::now();
    }
}
