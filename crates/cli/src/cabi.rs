//! `softrdma run` and `softrdma env`: run unmodified verbs programs (ibverbs-utils,
//! perftest, your own) on softrdma's C face, the drop-in `libibverbs.so.1` built from
//! `crates/ibverbs`, with stand-ins for Debian's public provider libraries
//! (`libmlx5.so.1`, `libefa.so.1`, `libmlx4.so.1`, `libmana.so.1`, from
//! `crates/ibverbs-stubs`) that perftest, UCX, libfabric and pyverbs link to.
//!
//! The libraries are found in `$SOFTRDMA_LIB_DIR`, else next to the `softrdma` binary, in
//! both profiles of the cargo target directory it sits in and in both profiles of the
//! `target` directory of the checkout it was built from; when none has them, they are built
//! there (see [`lib_dir`]). Cargo names its outputs `libibverbs.so`, `libmlx5.so`, …;
//! the loader looks for the SONAMEs (`….so.1`), so a directory of symlinks with those
//! names is made beside them (or in the temporary directory when that is read-only) and
//! put first on `LD_LIBRARY_PATH`.
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
use softrdma_device::rundir::{self, RunDir};

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
    #[arg(long, conflicts_with = "json")]
    pub dir: bool,
    /// The variables as one JSON object instead of shell assignments
    #[arg(long)]
    pub json: bool,
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

/// The cargo packages that build the libraries.
const PACKAGES: [&str; 5] = [
    "softrdma-ibverbs",
    "softrdma-stub-mlx5",
    "softrdma-stub-efa",
    "softrdma-stub-mlx4",
    "softrdma-stub-mana",
];

/// The source checkout this binary was built from (it may since have moved or gone; an
/// installed `softrdma` keeps using it to find and build the libraries).
fn source_dir() -> Option<PathBuf> {
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).parent()?.parent()?;
    ws.join("Cargo.toml").is_file().then(|| ws.to_path_buf())
}

/// The cargo target directory holding `exe` (`<target>/<profile>/softrdma`, or
/// `<target>/<profile>/deps/…` for test binaries), when it is one: cargo marks its target
/// directories with `CACHEDIR.TAG`.
fn target_dir_of(exe_dir: &Path) -> Option<PathBuf> {
    exe_dir
        .ancestors()
        .skip(1)
        .take(2)
        .find(|d| d.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
}

/// Where to look for the built libraries, in order, for a binary in `exe_dir` built from
/// the checkout `source`: the binary's own directory, then both profiles of its cargo
/// target directory (a `cargo run --release` binary finds a `cargo build`'s debug
/// libraries and the other way round), then both profiles of the checkout's `target`
/// (an installed binary finds what `cargo build` made there).
fn candidates_for(exe_dir: Option<&Path>, source: Option<&Path>) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = Vec::new();
    let mut push = |d: PathBuf| {
        if !v.contains(&d) {
            v.push(d);
        }
    };
    if let Some(dir) = exe_dir {
        push(dir.to_path_buf());
        if let Some(t) = target_dir_of(dir) {
            push(t.join("release"));
            push(t.join("debug"));
        }
    }
    if let Some(ws) = source {
        push(ws.join("target").join("release"));
        push(ws.join("target").join("debug"));
    }
    v
}

/// The directory of the running binary.
fn exe_dir() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let exe = exe.canonicalize().unwrap_or(exe);
    exe.parent().map(Path::to_path_buf)
}

/// `$SOFTRDMA_LIB_DIR`, when set: the only place looked at.
fn lib_dir_env() -> Option<PathBuf> {
    std::env::var_os("SOFTRDMA_LIB_DIR")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
}

/// The first of `cands` holding the libraries, with the SONAME links made if needed.
fn find_in(cands: &[PathBuf]) -> Option<CmdResult<PathBuf>> {
    for dir in cands {
        if dir.join(LIBS[0].0).is_file() {
            return Some(Ok(dir.clone()));
        }
        if dir.join(LIBS[0].1).is_file() {
            return Some(link_dir(dir));
        }
    }
    None
}

/// Where a build of the libraries goes: the target directory the binary sits in (so the
/// search finds it next to the binary), else the checkout's own `target`.
fn build_target_dir(exe_dir: Option<&Path>, source: &Path) -> PathBuf {
    exe_dir
        .and_then(target_dir_of)
        .unwrap_or_else(|| source.join("target"))
}

/// The exact command that builds the libraries of `source` into `target`.
fn build_args(source: &Path, target: &Path) -> Vec<String> {
    let mut v = vec![
        "build".to_string(),
        "--release".to_string(),
        "--manifest-path".to_string(),
        source.join("Cargo.toml").display().to_string(),
        "--target-dir".to_string(),
        target.display().to_string(),
    ];
    for p in PACKAGES {
        v.push("-p".to_string());
        v.push(p.to_string());
    }
    v
}

/// The cargo that built this binary when run by it (`cargo run` sets `$CARGO`), else the
/// one on the path.
fn cargo() -> OsString {
    std::env::var_os("CARGO")
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "cargo".into())
}

/// A directory holding `libibverbs.so.1` (and the stubs, when built), made if needed.
///
/// Without `$SOFTRDMA_LIB_DIR` and with no built libraries in reach, the libraries are
/// built once from the checkout the binary came from, so `softrdma run` works right after
/// the quick start's `cargo run` (which builds only the CLI) and after `cargo install`;
/// `SOFTRDMA_BUILD=0` turns that off.
pub fn lib_dir() -> CmdResult<PathBuf> {
    if let Some(d) = lib_dir_env() {
        return find_in(std::slice::from_ref(&d)).unwrap_or_else(|| {
            Err(format!(
                "SOFTRDMA_LIB_DIR={} holds no {} or {}",
                d.display(),
                LIBS[0].0,
                LIBS[0].1
            ))
        });
    }
    let exe = exe_dir();
    let source = source_dir();
    let cands = candidates_for(exe.as_deref(), source.as_deref());
    if let Some(found) = find_in(&cands) {
        return found;
    }
    let looked: Vec<String> = cands.iter().map(|d| d.display().to_string()).collect();
    let looked = if looked.is_empty() {
        "nowhere".to_string()
    } else {
        looked.join(", ")
    };
    let Some(source) = source else {
        return Err(format!(
            "softrdma's libibverbs.so.1 not found (looked in {looked}) and the source \
             checkout this softrdma was built from is gone; build the libraries with \
             `cargo build --release -p {}` in a checkout and set SOFTRDMA_LIB_DIR to its \
             target/release",
            PACKAGES.join(" -p ")
        ));
    };
    let target = build_target_dir(exe.as_deref(), &source);
    let args = build_args(&source, &target);
    let command = format!("cargo {}", args.join(" "));
    if std::env::var_os("SOFTRDMA_BUILD").is_some_and(|v| v == "0") {
        return Err(format!(
            "softrdma's libibverbs.so.1 not found (looked in {looked}); build it with \
             `{command}` or set SOFTRDMA_LIB_DIR"
        ));
    }
    errln!("softrdma: building the drop-in libraries (once): {command}");
    // Cargo's progress goes to stderr; its stdout too, so `softrdma env`'s stays clean.
    let status = std::process::Command::new(cargo())
        .args(&args)
        .stdin(std::process::Stdio::null())
        .stdout(std::io::stderr())
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => return Err(format!("`{command}` failed ({s})")),
        Err(e) => {
            return Err(format!(
                "softrdma's libibverbs.so.1 not found (looked in {looked}) and cargo could \
                 not be run ({e}); build it with `{command}` or set SOFTRDMA_LIB_DIR"
            ))
        }
    }
    let built = target.join("release");
    find_in(std::slice::from_ref(&built))
        .unwrap_or_else(|| Err(format!("`{command}` made no {}", built.display())))
}

/// A directory of SONAME symlinks to cargo's outputs in `built`.
fn link_dir(built: &Path) -> CmdResult<PathBuf> {
    let preferred = built.join("softrdma-lib");
    if make_links(&preferred, built).is_ok() {
        return Ok(preferred);
    }
    // A read-only build directory: links in the user's own runtime directory, named after
    // it. Never in the shared temporary directory, where another user could make the
    // directory first and swap the links for libraries of their own.
    let tag: u64 = built
        .as_os_str()
        .as_encoded_bytes()
        .iter()
        .fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        });
    let fallback = rundir::default_path().join(format!("lib-{tag:016x}"));
    RunDir::open_default()
        .and_then(|d| d.subdir(&format!("lib-{tag:016x}")))
        .and_then(|_| make_links(&fallback, built))
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
        errln!(
            "softrdma: warning: {} not built; programs linked against them (perftest, UCX, libfabric) will not load",
            missing.join(", ")
        );
    }
    let rdmacm = rdmacm_enabled();
    if rdmacm && !dir.join(RDMACM.0).join(RDMACM.1).exists() {
        errln!(
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
            errln!(
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
        outln!("{}", dir.display());
        return Ok(());
    }
    let path = ld_path(&search_dirs(&dir, rdmacm_enabled()));
    if a.json {
        let v = serde_json::json!({
            "LD_LIBRARY_PATH": path.to_string_lossy(),
            "SOFTRDMA_LIB_DIR": dir.to_string_lossy(),
        });
        outln!("{v}");
        return Ok(());
    }
    outln!(
        "export LD_LIBRARY_PATH={}",
        sh_quote(&path.to_string_lossy())
    );
    outln!(
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
    fn both_profiles_of_the_binarys_and_the_checkouts_target_are_searched() {
        let base = std::env::temp_dir().join(format!("softrdma-cabi-cands-{}", std::process::id()));
        let ws = base.join("ws");
        let t = ws.join("target");
        std::fs::create_dir_all(t.join("release").join("deps")).unwrap();
        std::fs::write(t.join("CACHEDIR.TAG"), b"x").unwrap();
        // `cargo run --release`: the debug libraries of a plain `cargo build` count too.
        let c = candidates_for(Some(&t.join("release")), Some(&ws));
        assert_eq!(c, vec![t.join("release"), t.join("debug")]);
        // A test binary in deps.
        let c = candidates_for(Some(&t.join("release").join("deps")), Some(&ws));
        assert_eq!(
            c,
            vec![
                t.join("release").join("deps"),
                t.join("release"),
                t.join("debug")
            ]
        );
        // An installed binary: its directory, then the checkout's target.
        let bin = base.join("bin");
        let c = candidates_for(Some(&bin), Some(&ws));
        assert_eq!(c, vec![bin.clone(), t.join("release"), t.join("debug")]);
        assert_eq!(build_target_dir(Some(&bin), &ws), t);
        // The build command builds exactly what is searched: release, into that target.
        let args = build_args(&ws, &t).join(" ");
        assert!(
            args.starts_with("build --release --manifest-path "),
            "{args}"
        );
        assert!(
            args.contains(&format!("--target-dir {}", t.display())),
            "{args}"
        );
        for p in PACKAGES {
            assert!(args.contains(&format!("-p {p}")), "{args}");
        }
        let _ = std::fs::remove_dir_all(&base);
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
