//! `softrdma run` and `softrdma env`: run unmodified verbs programs (ibverbs-utils,
//! perftest, your own) on softrdma's C face, the drop-in `libibverbs.so.1` built from
//! `crates/ibverbs`, with stand-ins for Debian's public provider libraries
//! (`libmlx5.so.1`, `libefa.so.1`, `libmlx4.so.1`, `libmana.so.1`, from
//! `crates/ibverbs-stubs`) that perftest, UCX, libfabric and pyverbs link to.
//!
//! The libraries are found in `$SOFTRDMA_LIB_DIR`, else next to the `softrdma` binary
//! (cargo's target directory). Cargo names its outputs `libibverbs.so`, `libmlx5.so`,
//! …; the loader looks for the SONAMEs (`….so.1`), so a directory of symlinks
//! with those names is made beside them (or in the temporary directory when that is
//! read-only) and put first on `LD_LIBRARY_PATH`.
//!
//! The same file is also softrdma's `librdmacm.so.1`: `rdmacm/librdmacm.so.1` in that
//! directory links to it, so a program that loads both names gets one object and one
//! engine. That directory goes first on the path unless `SOFTRDMA_RDMACM=0` asks for the
//! system's librdmacm (which finds no device under `softrdma run`, but a program may
//! want to show that).

use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use clap::Args;

use crate::view;
use crate::CmdResult;

/// `softrdma run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    /// The program and its arguments, after `--` (e.g. `-- ibv_rc_pingpong -g 0`)
    #[arg(required = true, last = true, value_name = "PROGRAM")]
    pub command: Vec<String>,
}

/// `softrdma env`.
#[derive(Args, Debug)]
pub struct EnvArgs {
    /// Print only the library directory
    #[arg(long)]
    pub dir: bool,
}

/// (SONAME the loader wants, file name cargo writes).
/// The stand-ins come after `libibverbs.so.1`: a program linked against Debian's
/// provider libraries would otherwise load the real ones, which need rdma-core's
/// libibverbs and its private provider interface.
const LIBS: [(&str, &str); 5] = [
    ("libibverbs.so.1", "libibverbs.so"),
    ("libmlx5.so.1", "libmlx5.so"),
    ("libefa.so.1", "libefa.so"),
    ("libmlx4.so.1", "libmlx4.so"),
    ("libmana.so.1", "libmana.so"),
];

/// `librdmacm.so.1`, the same file as `libibverbs.so.1`, in this subdirectory of the
/// library directory (on the path unless [`RDMACM_ENV`] is `0`).
const RDMACM: (&str, &str, &str) = ("rdmacm", "librdmacm.so.1", "libibverbs.so");

/// The environment variable that, set to `0`, keeps softrdma's `librdmacm.so.1` off the
/// path.
const RDMACM_ENV: &str = "SOFTRDMA_RDMACM";

/// Whether programs get softrdma's `librdmacm.so.1` (unless [`RDMACM_ENV`] is `0`).
fn rdmacm_enabled() -> bool {
    std::env::var_os(RDMACM_ENV).map_or(true, |v| v != "0")
}

/// Whether programs get the device view (unless [`view::VIEW_ENV`] is `0`).
fn view_enabled() -> bool {
    std::env::var_os(view::VIEW_ENV).map_or(true, |v| v != "0")
}

/// Where to look for the built libraries, in order.
fn candidates() -> Vec<PathBuf> {
    let mut v = Vec::new();
    if let Some(d) = std::env::var_os("SOFTRDMA_LIB_DIR").filter(|d| !d.is_empty()) {
        v.push(PathBuf::from(d));
        return v;
    }
    if let Ok(exe) = std::env::current_exe() {
        let exe = exe.canonicalize().unwrap_or(exe);
        if let Some(dir) = exe.parent() {
            v.push(dir.to_path_buf());
            // Test binaries live in target/<profile>/deps.
            if let Some(up) = dir.parent() {
                v.push(up.to_path_buf());
            }
        }
    }
    v
}

/// A directory holding `libibverbs.so.1` (and the stubs, when built), made if needed.
pub fn lib_dir() -> CmdResult<PathBuf> {
    let cands = candidates();
    for dir in &cands {
        if dir.join(LIBS[0].0).is_file() {
            return Ok(dir.clone());
        }
        if dir.join(LIBS[0].1).is_file() {
            return link_dir(dir);
        }
    }
    let looked: Vec<String> = cands.iter().map(|d| d.display().to_string()).collect();
    Err(format!(
        "softrdma's libibverbs.so.1 not found (looked in {}); build it with \
         `cargo build -p softrdma-ibverbs -p softrdma-stub-mlx5 -p softrdma-stub-efa \
         -p softrdma-stub-mlx4 -p softrdma-stub-mana` \
         or set SOFTRDMA_LIB_DIR",
        if looked.is_empty() {
            "nowhere".to_string()
        } else {
            looked.join(", ")
        }
    ))
}

/// A directory of SONAME symlinks to cargo's outputs in `built`.
fn link_dir(built: &Path) -> CmdResult<PathBuf> {
    let preferred = built.join("softrdma-lib");
    if make_links(&preferred, built).is_ok() {
        return Ok(preferred);
    }
    // A read-only build directory: links in the temporary directory, named after it.
    let tag: u64 = built
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    let fallback = std::env::temp_dir().join(format!("softrdma-lib-{tag:016x}"));
    make_links(&fallback, built)
        .map(|()| fallback.clone())
        .map_err(|e| format!("cannot make {}: {e}", fallback.display()))
}

fn make_links(dir: &Path, built: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for (soname, file) in LIBS {
        make_link(dir, soname, &built.join(file))?;
    }
    let (sub, soname, file) = RDMACM;
    let target = built.join(file);
    if target.is_file() {
        std::fs::create_dir_all(dir.join(sub))?;
        make_link(&dir.join(sub), soname, &target)?;
    }
    Ok(())
}

/// `dir/soname` → `target`, when `target` exists.
fn make_link(dir: &Path, soname: &str, target: &Path) -> std::io::Result<()> {
    if !target.is_file() {
        return Ok(());
    }
    let link = dir.join(soname);
    if std::fs::read_link(&link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    // Replace a stale link atomically: link beside it, then rename over it.
    let tmp = dir.join(format!(".{soname}.{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, &link)
}

/// The directories to put first on the path: `dir`, after the one of `librdmacm.so.1`
/// when `rdmacm`.
fn search_dirs(dir: &Path, rdmacm: bool) -> Vec<PathBuf> {
    let mut v = Vec::new();
    if rdmacm {
        v.push(dir.join(RDMACM.0));
    }
    v.push(dir.to_path_buf());
    v
}

/// `LD_LIBRARY_PATH` with `dirs` first.
fn ld_path(dirs: &[PathBuf]) -> OsString {
    let mut v = OsString::new();
    for (i, d) in dirs.iter().enumerate() {
        if i > 0 {
            v.push(":");
        }
        v.push(d.as_os_str());
    }
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|o| !o.is_empty()) {
        v.push(":");
        v.push(old);
    }
    v
}

fn missing_stubs(dir: &Path) -> Vec<&'static str> {
    LIBS[1..]
        .iter()
        .filter(|(so, _)| !dir.join(so).exists())
        .map(|(so, _)| *so)
        .collect()
}

/// `softrdma run -- PROGRAM ARGS…`: exec the program with softrdma's libibverbs first on
/// the library path. The program replaces this process, so its exit status is the
/// command's.
pub fn run(a: &RunArgs) -> CmdResult {
    let (prog, args) = a.command.split_first().ok_or("no program to run")?;
    let dir = lib_dir()?;
    let missing = missing_stubs(&dir);
    if !missing.is_empty() {
        eprintln!(
            "softrdma: warning: {} not built; programs linked against them (perftest, UCX, libfabric) will not load",
            missing.join(", ")
        );
    }
    let rdmacm = rdmacm_enabled();
    if rdmacm && !dir.join(RDMACM.0).join(RDMACM.1).exists() {
        eprintln!(
            "softrdma: warning: {} has no {}/{}; programs will load the system's librdmacm",
            dir.display(),
            RDMACM.0,
            RDMACM.1
        );
    }
    let exe = if prog == "softrdma" {
        std::env::current_exe().map_err(|e| format!("cannot find softrdma itself: {e}"))?
    } else {
        PathBuf::from(prog)
    };
    if view_enabled() {
        if let Err(e) = view::devices().and_then(|d| view::enter(&d)) {
            eprintln!(
                "softrdma: warning: {prog} runs without the /sys/class/infiniband and \
                 /dev/infiniband view: {e}"
            );
        }
    }
    let err = std::process::Command::new(&exe)
        .args(args)
        .env("LD_LIBRARY_PATH", ld_path(&search_dirs(&dir, rdmacm)))
        .exec();
    Err(format!("cannot run {prog}: {err}"))
}

/// Quote for a POSIX shell.
fn sh_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-+:,=@".contains(&b))
    {
        return s.to_string();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// `softrdma env`: the environment that makes programs use softrdma, as shell
/// assignments (`eval "$(softrdma env)"`).
pub fn env(a: &EnvArgs) -> CmdResult {
    let dir = lib_dir()?;
    if a.dir {
        println!("{}", dir.display());
        return Ok(());
    }
    let path = ld_path(&search_dirs(&dir, rdmacm_enabled()));
    println!(
        "export LD_LIBRARY_PATH={}",
        sh_quote(&path.to_string_lossy())
    );
    println!(
        "export SOFTRDMA_LIB_DIR={}",
        sh_quote(&dir.to_string_lossy())
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(sh_quote("/a/b:/c"), "/a/b:/c");
        assert_eq!(sh_quote("a b"), "'a b'");
        assert_eq!(sh_quote("it's"), "'it'\\''s'");
        assert_eq!(sh_quote(""), "''");
    }

    #[test]
    fn links_made_and_reused() {
        let base = std::env::temp_dir().join(format!("softrdma-cabi-test-{}", std::process::id()));
        let built = base.join("built");
        std::fs::create_dir_all(&built).unwrap();
        std::fs::write(built.join("libibverbs.so"), b"x").unwrap();
        std::fs::write(built.join("libmlx5.so"), b"x").unwrap();
        let dir = link_dir(&built).unwrap();
        assert_eq!(
            std::fs::read_link(dir.join("libibverbs.so.1")).unwrap(),
            built.join("libibverbs.so")
        );
        // librdmacm.so.1 is the same file as libibverbs.so.1, in its own directory.
        let cm = dir.join("rdmacm").join("librdmacm.so.1");
        assert_eq!(
            std::fs::read_link(&cm).unwrap(),
            built.join("libibverbs.so")
        );
        assert_eq!(
            cm.canonicalize().unwrap(),
            dir.join("libibverbs.so.1").canonicalize().unwrap()
        );
        assert_eq!(search_dirs(&dir, false), vec![dir.clone()]);
        assert_eq!(
            search_dirs(&dir, true),
            vec![dir.join("rdmacm"), dir.clone()]
        );
        assert!(dir.join("libmlx5.so.1").exists());
        assert_eq!(
            missing_stubs(&dir),
            vec!["libefa.so.1", "libmlx4.so.1", "libmana.so.1"]
        );
        // A second time finds the links in place.
        assert_eq!(link_dir(&built).unwrap(), dir);
        let _ = std::fs::remove_dir_all(&base);
    }
}
