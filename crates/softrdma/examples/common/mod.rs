//! Helpers shared by the examples: command-line parsing and the self-test launcher. The
//! connection setup is `softrdma::tcp`'s, not here.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Which side this process is: a server with its TCP listener (already bound, its port
/// printed), or a client with the server's host and port. The connection itself is one
/// call of `softrdma::tcp` (`accept_with` / `connect_with`) in each example.
pub enum Role {
    /// Listening for one client.
    Server(TcpListener),
    /// Connecting to (host, port).
    Client((String, u16)),
}

impl Role {
    /// Whether this is the server.
    pub fn is_server(&self) -> bool {
        matches!(self, Role::Server(_))
    }
}

/// The role the command line asks for: a client when it names a host (the first
/// positional argument), else a server listening on `port` (0: any), which prints
/// `listening on PORT` so that a launcher can find it.
pub fn role(
    args: &[String],
    valued: &[&str],
    port: u16,
) -> Result<Role, Box<dyn std::error::Error>> {
    Ok(match positional(args, valued) {
        Some(host) => Role::Client((host, port)),
        None => Role::Server(listen(port)?),
    })
}

/// Listen on `port` (0: any) on all addresses, print `listening on PORT` so a launcher can
/// find it, and return the listener.
pub fn listen(port: u16) -> std::io::Result<TcpListener> {
    let l = TcpListener::bind(("0.0.0.0", port))?;
    println!("listening on {}", l.local_addr()?.port());
    std::io::stdout().flush()?;
    Ok(l)
}

/// The value after `--name` in the arguments.
pub fn arg_value(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Check the command line before anything starts: `-h`/`--help` prints the usage and
/// exits 0 (without this check `--help`, being no host, started a server); an unknown
/// option, an option without its value or a second host prints one line and exits 2.
/// `valued` lists the options that take a value, with what they set.
pub fn check_args(name: &str, args: &[String], valued: &[(&str, &str)]) {
    let usage = || {
        let mut u = format!(
            "Usage: {name} [OPTIONS]              start a server and wait for a client\n       \
             {name} SERVER_IP [OPTIONS]    connect to the server at SERVER_IP\n       \
             {name} --self-test            run a server and its clients on loopback and \
             check them\n\nOptions:\n"
        );
        for (opt, what) in valued {
            u.push_str(&format!("  {:<14}{what}\n", format!("{opt} N")));
        }
        u.push_str("  -h, --help    this text\n");
        u
    };
    let fail = |msg: String| -> ! {
        eprintln!("{name}: {msg} (see --help)");
        std::process::exit(2);
    };
    let mut hosts = 0;
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "-h" || a == "--help" {
            print!("{}", usage());
            std::process::exit(0);
        } else if valued.iter().any(|(o, _)| *o == a) {
            if args.get(i + 1).is_none() {
                fail(format!("{a} needs a value"));
            }
            i += 1;
        } else if a == "--self-test" {
        } else if a.starts_with('-') {
            fail(format!("unknown option {a}"));
        } else {
            hosts += 1;
            if hosts > 1 {
                fail(format!("one SERVER_IP only, got another: {a}"));
            }
        }
        i += 1;
    }
}

/// The first argument that is not an option (nor an option's value).
pub fn positional(args: &[String], valued: &[&str]) -> Option<String> {
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
            continue;
        }
        if valued.contains(&a.as_str()) {
            skip = true;
            continue;
        }
        if !a.starts_with("--") {
            return Some(a.clone());
        }
    }
    None
}

/// Self-test: run this example as a server (`--port 0`), read the port it listens on,
/// then run `clients` copies as clients (each with `client_args`) against it; every
/// process must exit 0 within `timeout`.
pub fn self_test(
    server_args: &[&str],
    client_args: &[&str],
    clients: usize,
    timeout: Duration,
) -> bool {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("self-test: {e}");
            return false;
        }
    };
    let mut server = match Command::new(&exe)
        .args(server_args)
        .args(["--port", "0"])
        .stdout(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("self-test: spawn server: {e}");
            return false;
        }
    };
    let mut out = BufReader::new(server.stdout.take().expect("piped stdout"));
    let mut port = None;
    let mut line = String::new();
    while out.read_line(&mut line).unwrap_or(0) > 0 {
        print!("[server] {line}");
        if let Some(p) = line.trim().strip_prefix("listening on ") {
            port = p.parse::<u16>().ok();
            break;
        }
        line.clear();
    }
    let Some(port) = port else {
        eprintln!("self-test: the server did not say its port");
        let _ = server.kill();
        return false;
    };
    // Keep echoing the server's output.
    let echo = std::thread::spawn(move || {
        let mut line = String::new();
        while out.read_line(&mut line).unwrap_or(0) > 0 {
            print!("[server] {line}");
            line.clear();
        }
    });
    let port_s = port.to_string();
    let mut kids: Vec<(String, Child)> = Vec::new();
    for i in 0..clients {
        match Command::new(&exe)
            .arg("127.0.0.1")
            .args(client_args)
            .args(["--port", &port_s])
            .spawn()
        {
            Ok(c) => kids.push((format!("client {i}"), c)),
            Err(e) => eprintln!("self-test: spawn client: {e}"),
        }
    }
    kids.push(("server".into(), server));
    let ok_spawned = kids.len() == clients + 1;
    let deadline = Instant::now() + timeout;
    let mut ok = ok_spawned;
    for (name, mut c) in kids {
        loop {
            match c.try_wait() {
                Ok(Some(st)) => {
                    if !st.success() {
                        eprintln!("self-test: {name} failed: {st}");
                        ok = false;
                    }
                    break;
                }
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    eprintln!("self-test: {name} timed out");
                    let _ = c.kill();
                    let _ = c.wait();
                    ok = false;
                    break;
                }
            }
        }
    }
    let _ = echo.join();
    ok
}
