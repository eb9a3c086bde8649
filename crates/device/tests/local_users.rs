//! Two real users on one host: another user must not be able to make a softrdma process
//! write files of the first user's (DESIGN decision 13). Needs root, to run processes as
//! other users (`setpriv`); without it the test says so and passes without checking.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use softrdma_device::registry::{BindOptions, PortSpace, Registry};
use softrdma_device::{statsfile, Device, DeviceAddr, DeviceConfig};

/// The user whose files are at stake: no runtime directory, no login session.
const VICTIM: u32 = 4243;
/// The other local user.
const ATTACKER: u32 = 65534;
/// Set in the victim's process: the role it plays.
const ROLE_ENV: &str = "SOFTRDMA_LOCAL_USERS_ROLE";

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn chown(p: &Path, uid: u32) {
    std::os::unix::fs::lchown(p, Some(uid), Some(uid)).unwrap();
}

/// What the victim's process does: open a device (which publishes its counters), reserve
/// an ephemeral port in the rdma_cm registry, wait for the word, reserve another.
#[test]
#[ignore = "the victim's process of another_user_cannot_redirect_a_users_files"]
fn victim() {
    if std::env::var_os(ROLE_ENV).is_none() {
        return;
    }
    let mut cfg = DeviceConfig::new("victim", DeviceAddr::AutoLoopback(4791));
    cfg.stats_dir = statsfile::default_dir();
    let dev = Device::open(&cfg).unwrap();
    let any: std::net::SocketAddr = "0.0.0.0:0".parse().unwrap();
    match Registry::open_default() {
        Ok(reg) => {
            let a = reg.bind(PortSpace::Tcp, any, dev.addr(), BindOptions::default());
            println!("BOUND {}", a.is_ok());
            std::io::stdout().flush().unwrap();
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).unwrap();
            let b = reg.bind(PortSpace::Tcp, any, dev.addr(), BindOptions::default());
            println!("DONE {}", b.is_ok());
        }
        Err(e) => println!("REFUSED {e}"),
    }
    std::io::stdout().flush().unwrap();
    // Long enough for several periodic writes of the stats file.
    std::thread::sleep(statsfile::PERIOD * 5);
    drop(dev);
}

/// Another user made `/dev/shm/softrdma-UID` before the victim's first run (it does not
/// exist after a boot), then plants a link at the stats file's temporary name and, once
/// the victim has a registry, swaps it for one of its own with a `lock` link. The victim's
/// files must come through untouched.
#[test]
fn another_user_cannot_redirect_a_users_files() {
    if euid() != 0 || Command::new("setpriv").arg("--version").output().is_err() {
        eprintln!("skipped: needs root and setpriv to run as two users");
        return;
    }
    let shared = PathBuf::from(format!("/dev/shm/softrdma-{VICTIM}"));
    let _ = std::fs::remove_dir_all(&shared);
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    chown(&shared, ATTACKER);

    // Files only the victim may write.
    let home = std::env::temp_dir().join(format!("softrdma-local-users-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir(&home).unwrap();
    std::fs::set_permissions(&home, std::fs::Permissions::from_mode(0o755)).unwrap();
    let secrets: Vec<PathBuf> = ["stats-target", "lock-target"]
        .iter()
        .map(|n| home.join(n))
        .collect();
    for s in &secrets {
        std::fs::write(s, "secret\n").unwrap();
        std::fs::set_permissions(s, std::fs::Permissions::from_mode(0o600)).unwrap();
        chown(s, VICTIM);
    }

    let mut child = Command::new("setpriv")
        .args([
            format!("--reuid={VICTIM}"),
            format!("--regid={VICTIM}"),
            "--clear-groups".into(),
        ])
        .arg(std::env::current_exe().unwrap())
        .args(["victim", "--exact", "--ignored", "--nocapture"])
        .arg("--test-threads=1")
        .env(ROLE_ENV, "1")
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("SOFTRDMA_STATS_DIR")
        .env_remove("SOFTRDMA_STATS")
        .env_remove("SOFTRDMA_CM_DIR")
        .env_remove("SOFTRDMA_ADDR")
        .env_remove("SOFTRDMA_CONFIG")
        .current_dir("/")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The stats file's temporary name as the victim's device would make it (setpriv
    // execs the test binary in its own process).
    let link = shared.join(format!(".victim-{}-0.stats.tmp", child.id()));
    symlink(&secrets[0], &link).unwrap();
    chown(&link, ATTACKER);

    let mut stdin = child.stdin.take().unwrap();
    let mut said = Vec::new();
    for line in BufReader::new(child.stdout.take().unwrap())
        .lines()
        .map_while(Result::ok)
    {
        if line.contains("BOUND") {
            // Swap the victim's registry for one of the attacker's, with a lock link.
            let reg = shared.join("registry");
            let _ = std::fs::rename(&reg, shared.join("registry.old"));
            std::fs::create_dir(&reg).unwrap();
            std::fs::set_permissions(&reg, std::fs::Permissions::from_mode(0o777)).unwrap();
            chown(&reg, ATTACKER);
            let lock = reg.join("lock");
            symlink(&secrets[1], &lock).unwrap();
            chown(&lock, ATTACKER);
            let _ = writeln!(stdin, "go");
        }
        said.push(line);
    }
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            panic!("the victim's process did not end: {said:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err);
    let contents: Vec<String> = secrets
        .iter()
        .map(|s| std::fs::read_to_string(s).unwrap())
        .collect();
    let _ = std::fs::remove_dir_all(&shared);
    let _ = std::fs::remove_dir_all(&home);

    assert!(status.success(), "victim failed: {said:?}\n{err}");
    assert_eq!(
        contents[0], "secret\n",
        "the stats write went through the link"
    );
    assert_eq!(
        contents[1], "secret\n",
        "the registry lock went through the link"
    );
    let refused = said
        .iter()
        .find(|l| l.contains("REFUSED"))
        .unwrap_or_else(|| {
            panic!("the victim used a directory another user owns: {said:?}\n{err}")
        });
    assert!(
        refused.contains(&format!("owned by uid {ATTACKER}")),
        "{refused}"
    );
    assert!(refused.contains(&shared.display().to_string()), "{refused}");
}
