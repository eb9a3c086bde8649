//! `softrdma`: the command-line face of softrdma — devices, ping-pong (wire-compatible with
//! rdma-core's `ibv_*_pingpong`), perftest-like benchmarks, counters, packet traces and a
//! zero-setup demo.
//!
//! Every failure is one line on stderr and a non-zero exit; nothing panics on bad input.

/// `println!` that never panics: see [`output`].
macro_rules! outln {
    () => {
        $crate::output::write_out(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_out(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that never panics: see [`output`].
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::write_err(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprint!` that never panics: see [`output`].
macro_rules! errout {
    ($($arg:tt)*) => {
        $crate::output::write_err(format_args!($($arg)*))
    };
}

mod cabi;
mod cmconn;
mod demo;
mod exch;
mod info;
mod output;
mod perf;
mod pingpong;
mod rcat;
mod scale;
mod session;
mod stats;
mod tcp;
mod view;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// The result of a subcommand: the error is the one line printed on stderr.
pub type CmdResult<T = ()> = Result<T, String>;

#[derive(Parser, Debug)]
#[command(
    name = "softrdma",
    version,
    about = "softrdma: RDMA over RoCEv2 in user space — devices, ping-pong, benchmarks, traces",
    long_about = "softrdma: RDMA over RoCEv2 in user space.\n\n\
        Every process is its own RDMA device: one UDP endpoint on port 4791. With no \
        configuration a device takes the first free 127.0.0.x, so two processes on one \
        host just work; set SOFTRDMA_ADDR=IP (or a line `NAME IP` in $SOFTRDMA_CONFIG or \
        /etc/softrdma.conf) to talk to another host."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List the configured devices (like ibv_devices)
    Devices(DevicesArgs),
    /// Show device and port attributes and the GID table (like ibv_devinfo)
    Devinfo(DevinfoArgs),
    /// Ping-pong SENDs with a peer; speaks the TCP exchange of ibv_rc_pingpong & co.
    Pingpong(PingpongArgs),
    /// Benchmarks like perftest (ib_write_bw, ib_read_lat, …)
    Perf(PerfArgs),
    /// Scale: create, connect and use N RC QPs on one device; times and memory per QP
    Scale(ScaleArgs),
    /// Counters of the softrdma devices running on this host
    Stats(StatsArgs),
    /// Run a command with its devices' packets traced to a pcapng file
    Trace(TraceArgs),
    /// Quick start: a server and a client process on loopback, round trips and a short benchmark
    Demo(DemoArgs),
    /// Run a verbs program (ibv_*, perftest, your own) on softrdma's libibverbs.so.1
    /// (and on its librdmacm.so.1 unless SOFTRDMA_RDMACM=0)
    Run(cabi::RunArgs),
    /// Print the environment that makes verbs programs use softrdma (eval "$(softrdma env)")
    Env(cabi::EnvArgs),
    /// A byte stream over rsockets, like nc over TCP (peers: rstream, librspreload, this)
    Rsocket(rcat::RsocketArgs),
    /// (internal) the server half of `demo`
    #[command(hide = true, name = "__serve")]
    Serve(ServeArgs),
}

#[derive(Args, Debug)]
struct DevicesArgs {
    /// Machine-readable output
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct DevinfoArgs {
    /// Verbose: every attribute and the GID table
    #[arg(short, long)]
    verbose: bool,
    /// Only this device
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    device: Option<String>,
    /// Machine-readable output
    #[arg(long)]
    json: bool,
}

/// Queue pair flavour of `pingpong`, one per rdma-core example.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PpType {
    /// Reliable connected (ibv_rc_pingpong)
    Rc,
    /// Unreliable connected (ibv_uc_pingpong)
    Uc,
    /// Unreliable datagram (ibv_ud_pingpong)
    Ud,
    /// RC QPs sharing one receive queue (ibv_srq_pingpong)
    Srq,
}

/// Options shared by `pingpong` and `perf` for the device they open.
#[derive(Args, Debug, Clone, Default)]
pub struct DevOpts {
    /// Use this device (default: the first configured)
    #[arg(short = 'd', long = "ib-dev", value_name = "DEV")]
    pub device: Option<String>,
    /// Write every packet of the device to this pcapng file
    #[arg(long, value_name = "FILE")]
    pub pcap: Option<PathBuf>,
    /// Print the device's counters at the end
    #[arg(long)]
    pub stats: bool,
    /// Busy-poll: the device's progress thread never sleeps (lowest latency)
    #[arg(long)]
    pub busy_poll: bool,
}

#[derive(Args, Debug)]
pub struct PingpongArgs {
    /// Server host to connect to; without it, wait for a client
    #[arg(value_name = "PEER")]
    pub peer: Option<String>,
    /// Queue pair type
    #[arg(short = 't', long = "type", value_enum, default_value = "rc")]
    pub qp_type: PpType,
    /// TCP port of the address exchange (with --cm: the rdma_cm port)
    #[arg(short, long, default_value_t = 18515)]
    pub port: u16,
    /// Connect through the rdma_cm (port -p of its TCP port space; UDP for ud, IB for
    /// uc) instead of the TCP exchange; the peer must use --cm too
    #[arg(long)]
    pub cm: bool,
    /// Message size (default 4096; for ud 2048 or the MTU if smaller, as a UD message
    /// must fit in one packet)
    #[arg(short, long)]
    pub size: Option<u32>,
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (ud: the port's active MTU, which bounds
    /// the message size); default 1024. Not with --cm: the connection manager sets it
    #[arg(short, long)]
    pub mtu: Option<u32>,
    /// Receives to post at a time
    #[arg(short, long = "rx-depth", default_value_t = 500)]
    pub rx_depth: u32,
    /// Number of exchanges
    #[arg(short = 'n', long, default_value_t = 1000)]
    pub iters: u32,
    /// Number of QPs (srq only)
    #[arg(short = 'q', long = "num-qp", default_value_t = 16)]
    pub num_qp: u32,
    /// Service level
    #[arg(short = 'l', long = "sl", default_value_t = 0)]
    pub sl: u8,
    /// Sleep on CQ events through a completion channel (default: poll)
    #[arg(short, long)]
    pub events: bool,
    /// Local GID index
    #[arg(short, long = "gid-idx", default_value_t = 0)]
    pub gid_idx: u8,
    /// Give up when no completion arrives for this many seconds
    #[arg(long, default_value_t = 15)]
    pub timeout: u64,
    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub dev: DevOpts,
}

/// The benchmarks of `perf`.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PerfTest {
    /// RDMA WRITE bandwidth
    WriteBw,
    /// RDMA READ bandwidth
    ReadBw,
    /// SEND bandwidth
    SendBw,
    /// FETCH_AND_ADD bandwidth
    AtomicBw,
    /// RDMA WRITE latency (ping-pong of writes)
    WriteLat,
    /// RDMA READ latency
    ReadLat,
    /// SEND latency (ping-pong)
    SendLat,
    /// FETCH_AND_ADD latency
    AtomicLat,
}

#[derive(Args, Debug)]
pub struct PerfArgs {
    /// Which benchmark
    #[arg(value_enum)]
    pub test: PerfTest,
    /// Server host to connect to; without it, serve one client
    #[arg(value_name = "PEER")]
    pub peer: Option<String>,
    /// Message size (default 65536 for bandwidth, 2 for latency, 8 for atomics)
    #[arg(short, long, conflicts_with = "all")]
    pub size: Option<u32>,
    /// Run every size from 2 bytes to 8 MiB in powers of two
    #[arg(short = 'a', long)]
    pub all: bool,
    /// Iterations per size (default 5000 for bandwidth, 1000 for latency)
    #[arg(short = 'n', long)]
    pub iters: Option<u32>,
    /// Outstanding work requests of bandwidth tests
    #[arg(short = 't', long = "tx-depth", default_value_t = 128)]
    pub tx_depth: u32,
    /// TCP port of the exchange (with --cm: the rdma_cm port)
    #[arg(short, long, default_value_t = 18516)]
    pub port: u16,
    /// Connect through the rdma_cm (port -p of its TCP port space) instead of the TCP
    /// exchange; the peer must use --cm too
    #[arg(long)]
    pub cm: bool,
    /// Path MTU: 256, 512, 1024, 2048 or 4096; default 1024. Not with --cm: the
    /// connection manager sets it
    #[arg(short, long)]
    pub mtu: Option<u32>,
    /// Run server and client in this process, on two loopback devices
    #[arg(long = "loopback", visible_alias = "self", conflicts_with = "peer")]
    pub loopback: bool,
    /// write-lat: after each WRITE, collect its completion, then watch only the byte the
    /// peer writes, without calling into the device, as perftest's ib_write_lat does (the
    /// device's progress thread delivers the peer's WRITE; without this flag the waiting
    /// thread polls the CQ too and so delivers it itself)
    #[arg(long)]
    pub memory_wait: bool,
    /// Give up when nothing completes for this many seconds
    #[arg(long, default_value_t = 15)]
    pub timeout: u64,
    /// Machine-readable output
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub dev: DevOpts,
}

#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// Server host to connect to; without it, serve one client
    #[arg(value_name = "PEER")]
    pub peer: Option<String>,
    /// RC QPs on each side (both sides must agree)
    #[arg(short = 'q', long = "qps", default_value_t = 1000)]
    pub qps: u32,
    /// TCP port of the exchange
    #[arg(short, long, default_value_t = 18517)]
    pub port: u16,
    /// Give up when nothing completes for this many seconds
    #[arg(long, default_value_t = 60)]
    pub timeout: u64,
    /// Machine-readable output (client)
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub dev: DevOpts,
}

#[derive(Args, Debug)]
struct StatsArgs {
    /// Machine-readable output
    #[arg(long)]
    json: bool,
    /// Also list devices whose process has exited (last published values)
    #[arg(long)]
    all: bool,
}

#[derive(Args, Debug)]
struct TraceArgs {
    /// The pcapng file to write
    #[arg(short, long, value_name = "FILE.pcap")]
    output: PathBuf,
    /// The command to run, after `--`
    #[arg(required = true, last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Machine-readable output of the benchmark table
    #[arg(long)]
    json: bool,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Sessions to serve before exiting
    #[arg(long, default_value_t = 1)]
    sessions: u32,
}

fn run(cli: Cli) -> CmdResult {
    match cli.cmd {
        Cmd::Devices(a) => info::devices(a.json),
        Cmd::Devinfo(a) => info::devinfo(a.device.as_deref(), a.verbose, a.json),
        Cmd::Pingpong(a) => pingpong::run(&a),
        Cmd::Perf(a) => perf::run(&a),
        Cmd::Scale(a) => scale::run(&a),
        Cmd::Stats(a) => stats::show(a.json, a.all),
        Cmd::Trace(a) => stats::trace(&a.output, &a.command),
        Cmd::Demo(a) => demo::run(a.json),
        Cmd::Serve(a) => demo::serve(a.sessions),
        Cmd::Run(a) => cabi::run(&a),
        Cmd::Env(a) => cabi::env(&a),
        Cmd::Rsocket(a) => rcat::run(&a),
    }
}

/// Clap's error as one line, without its usage block. A missing argument's name is on
/// the lines after "the following required arguments were not provided:", so those are
/// kept, joined.
fn one_line(text: &str) -> String {
    let mut lines = text.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines
        .next()
        .unwrap_or("invalid arguments")
        .trim_start_matches("error: ");
    if !first.ends_with(':') {
        return first.to_string();
    }
    let named: Vec<&str> = lines.take_while(|l| !l.starts_with("Usage:")).collect();
    if named.is_empty() {
        first.to_string()
    } else {
        format!("{first} {}", named.join(", "))
    }
}

fn main() -> ExitCode {
    softrdma_device::log::init_from_env();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion)
                || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            {
                let _ = e.print();
                return if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                    ExitCode::from(2)
                } else {
                    ExitCode::SUCCESS
                };
            }
            errln!(
                "softrdma: {} (see --help)",
                one_line(&e.render().to_string())
            );
            return ExitCode::from(2);
        }
    };
    match run(cli) {
        Ok(()) => {
            // A last line without its newline is still buffered: its write error counts.
            output::flush_stdout();
            ExitCode::SUCCESS
        }
        Err(msg) => {
            output::flush_stdout();
            errln!("softrdma: {msg}");
            ExitCode::FAILURE
        }
    }
}
