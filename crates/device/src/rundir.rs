//! The per-user directory where softrdma keeps what it shares on the host: stats files,
//! the rdma_cm port registry (DESIGN decision 13).
//!
//! Another local user must not be able to redirect what a softrdma process writes or
//! reads there, so the directory is opened once and checked on the opened descriptor (a
//! directory, owned by this user, writable by nobody else), and everything in it is made
//! relative to that descriptor: files are created exclusively with `O_NOFOLLOW`, opened
//! with `O_NOFOLLOW`, renamed and removed with the `*at` calls. Once the descriptor is
//! checked, renames of its path (by whoever owns the parent) change nothing: the
//! descriptor still names the checked directory.
//!
//! Where it is ([`default_path`]): `$SOFTRDMA_STATS_DIR`, else `$XDG_RUNTIME_DIR/softrdma`,
//! else `/run/user/UID/softrdma` when that user runtime directory exists and is this
//! user's, else `/run/softrdma` for root, else `/dev/shm/softrdma-UID`. Only the last can
//! be made by someone else first (`/dev/shm` is world-writable): a directory there that
//! another user owns is refused with an error that says so, and nothing is written
//! through it.

use std::ffi::{CStr, OsStr};
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, Dir, FileType, Mode, OFlags, CWD};
use rustix::io::Errno;

/// Environment variable naming the directory outright (tests, unusual setups).
pub const DIR_ENV: &str = "SOFTRDMA_STATS_DIR";

/// Where softrdma keeps its host-shared files for this user (see the module docs).
pub fn default_path() -> PathBuf {
    choose(
        std::env::var_os(DIR_ENV),
        std::env::var_os("XDG_RUNTIME_DIR"),
        rustix::process::geteuid().as_raw(),
        |p| {
            rustix::fs::lstat(p).is_ok_and(|st| {
                FileType::from_raw_mode(st.st_mode) == FileType::Directory
                    && st.st_uid == rustix::process::geteuid().as_raw()
            })
        },
    )
}

/// [`default_path`] from its inputs; `own_dir(p)` tells whether `p` is a directory of
/// this user's.
fn choose(
    explicit: Option<std::ffi::OsString>,
    xdg: Option<std::ffi::OsString>,
    uid: u32,
    own_dir: impl Fn(&Path) -> bool,
) -> PathBuf {
    if let Some(d) = explicit.filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = xdg.filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("softrdma");
    }
    // systemd-logind's per-user directory: made by root, mode 0700, so nobody else can
    // have made it or anything in it.
    let user_run = PathBuf::from(format!("/run/user/{uid}"));
    if own_dir(&user_run) {
        return user_run.join("softrdma");
    }
    // /run is root's: a service, cron or sudo without a login session lands here, where
    // no other user can plant anything.
    if uid == 0 && own_dir(Path::new("/run")) {
        return PathBuf::from("/run/softrdma");
    }
    PathBuf::from(format!("/dev/shm/softrdma-{uid}"))
}

/// An open, checked directory of this user's; see the module docs.
#[derive(Debug)]
pub struct RunDir {
    fd: OwnedFd,
    path: PathBuf,
}

/// The error for a directory that fails the ownership or mode check, naming the way out.
fn refused(path: &Path, why: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "{}: {why}; softrdma will not keep its files there (another user could redirect \
             them): remove it, or set XDG_RUNTIME_DIR or {DIR_ENV} to a directory of your own",
            path.display()
        ),
    )
}

/// Check that `fd` is a directory owned by this user that nobody else may write to.
fn vet(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let st = rustix::fs::fstat(fd)?;
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory {
        return Err(io::Error::other(format!(
            "{}: not a directory",
            path.display()
        )));
    }
    let me = rustix::process::geteuid().as_raw();
    if st.st_uid != me {
        return Err(refused(
            path,
            format!("owned by uid {}, not by this user (uid {me})", st.st_uid),
        ));
    }
    if st.st_mode & 0o022 != 0 {
        return Err(refused(
            path,
            format!("writable by other users (mode {:o})", st.st_mode & 0o7777),
        ));
    }
    Ok(())
}

impl RunDir {
    /// The directory at [`default_path`], made if missing.
    pub fn open_default() -> io::Result<RunDir> {
        RunDir::open(&default_path())
    }

    /// The directory `path`, made (mode 0700) if missing, its parents too. Refused if
    /// `path` is a symbolic link, or not a directory of this user's that nobody else may
    /// write to.
    pub fn open(path: &Path) -> io::Result<RunDir> {
        RunDir::open_at(path, true)
    }

    /// The directory `path` if it exists (None if not), checked as [`RunDir::open`]
    /// checks it: for readers, which should not leave directories behind.
    pub fn open_existing(path: &Path) -> io::Result<Option<RunDir>> {
        match RunDir::open_at(path, false) {
            Ok(d) => Ok(Some(d)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn open_at(path: &Path, create: bool) -> io::Result<RunDir> {
        if create {
            if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(|e| with_path(e, parent))?;
            }
            match rustix::fs::mkdirat(CWD, path, Mode::from_raw_mode(0o700)) {
                Ok(()) | Err(Errno::EXIST) => {}
                Err(e) => return Err(with_path(e.into(), path)),
            }
        }
        // No link is followed at the leaf: a link planted there would send the files into
        // a directory of someone else's choosing.
        let fd = rustix::fs::openat(
            CWD,
            path,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            if e == Errno::LOOP || e == Errno::NOTDIR {
                refused(path, "a symbolic link or not a directory".into())
            } else {
                with_path(e.into(), path)
            }
        })?;
        vet(fd.as_fd(), path)?;
        Ok(RunDir {
            fd,
            path: path.to_path_buf(),
        })
    }

    /// The subdirectory `name`, made (mode 0700) if missing, never through a symbolic link,
    /// and checked as the top one is.
    pub fn subdir(&self, name: &str) -> io::Result<RunDir> {
        let path = self.path.join(name);
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(with_path(e.into(), &path)),
        }
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| {
            if e == Errno::LOOP || e == Errno::NOTDIR {
                refused(&path, "a symbolic link or not a directory".into())
            } else {
                with_path(e.into(), &path)
            }
        })?;
        vet(fd.as_fd(), &path)?;
        Ok(RunDir { fd, path })
    }

    /// The directory's path, for messages and for other processes to find it.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the directory still has its path (it may have been removed or renamed since
    /// it was opened, leaving this descriptor on an orphan).
    pub fn is_current(&self) -> bool {
        match (
            rustix::fs::fstat(&self.fd),
            rustix::fs::statat(CWD, &self.path, AtFlags::SYMLINK_NOFOLLOW),
        ) {
            (Ok(a), Ok(b)) => a.st_dev == b.st_dev && a.st_ino == b.st_ino && a.st_nlink > 0,
            _ => false,
        }
    }

    /// Create the file `name` for writing; fails if anything (a file, a link) has that
    /// name already.
    pub fn create_new(&self, name: &str, mode: u32) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        Ok(File::from(fd))
    }

    /// Open the regular file `name` for reading and writing, creating it (`mode`) if
    /// missing; never through a symbolic link, never another user's file.
    pub fn open_rw(&self, name: &str, mode: u32) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDWR | OFlags::CREATE | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(mode),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile
            || st.st_uid != rustix::process::geteuid().as_raw()
        {
            return Err(refused(
                &self.path.join(name),
                "not a regular file of this user's".into(),
            ));
        }
        Ok(File::from(fd))
    }

    /// Open the regular file `name` for reading, never through a symbolic link (a FIFO or
    /// device planted there is not opened for long: the open does not block, and anything
    /// but a regular file is refused).
    pub fn open_read(&self, name: &str) -> io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        )?;
        let st = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(st.st_mode) != FileType::RegularFile {
            return Err(io::Error::from(io::ErrorKind::InvalidInput));
        }
        Ok(File::from(fd))
    }

    /// Rename `from` to `to` within the directory (replacing `to`, never following it).
    pub fn rename(&self, from: &str, to: &str) -> io::Result<()> {
        Ok(rustix::fs::renameat(&self.fd, from, &self.fd, to)?)
    }

    /// Remove the file `name` (a link is removed, not followed).
    pub fn remove(&self, name: &str) -> io::Result<()> {
        Ok(rustix::fs::unlinkat(&self.fd, name, AtFlags::empty())?)
    }

    /// Remove `name` if it is still the file open as `f` (not a successor of that name).
    pub fn remove_if_same(&self, name: &str, f: &File) {
        if let (Ok(a), Ok(b)) = (
            rustix::fs::fstat(f),
            rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW),
        ) {
            if a.st_dev == b.st_dev && a.st_ino == b.st_ino {
                let _ = self.remove(name);
            }
        }
    }

    /// The names of the regular files in the directory (as the directory lists them: a
    /// file may be gone by the time it is opened).
    pub fn files(&self) -> io::Result<Vec<String>> {
        let mut out = Vec::new();
        for e in Dir::read_from(&self.fd)? {
            let e = e?;
            let t = e.file_type();
            // Unknown: a file system that does not say; the open checks it anyway.
            if t != FileType::RegularFile && t != FileType::Unknown {
                continue;
            }
            if let Some(n) = name_of(e.file_name()) {
                out.push(n);
            }
        }
        Ok(out)
    }
}

impl AsFd for RunDir {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// A UTF-8 file name; others are not softrdma's.
fn name_of(c: &CStr) -> Option<String> {
    let b = c.to_bytes();
    if b == b"." || b == b".." {
        return None;
    }
    OsStr::from_bytes(b).to_str().map(str::to_string)
}

fn with_path(e: io::Error, path: &Path) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// A name for a temporary file that another process cannot predict.
pub fn tmp_name(stem: &str) -> String {
    format!(".{stem}.{:016x}.tmp", crate::sys::random_seed())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{symlink, PermissionsExt};

    fn temp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("softrdma-rundir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn the_choice_of_directory() {
        let own =
            |want: &'static [&'static str]| move |p: &Path| want.iter().any(|w| p == Path::new(w));
        let os = |s: &str| Some(std::ffi::OsString::from(s));
        assert_eq!(choose(os("/x"), os("/r"), 5, own(&[])), Path::new("/x"));
        assert_eq!(
            choose(os(""), os("/r"), 5, own(&[])),
            Path::new("/r/softrdma")
        );
        assert_eq!(
            choose(None, None, 5, own(&["/run/user/5"])),
            Path::new("/run/user/5/softrdma")
        );
        assert_eq!(
            choose(None, None, 5, own(&["/run"])),
            Path::new("/dev/shm/softrdma-5")
        );
        assert_eq!(
            choose(None, os(""), 0, own(&["/run"])),
            Path::new("/run/softrdma")
        );
        assert_eq!(
            choose(None, None, 0, own(&[])),
            Path::new("/dev/shm/softrdma-0")
        );
    }

    #[test]
    fn makes_a_private_directory_and_refuses_loose_ones() {
        let d = temp("mk");
        let r = RunDir::open(&d.join("a")).unwrap();
        let md = std::fs::metadata(r.path()).unwrap();
        assert_eq!(md.permissions().mode() & 0o777, 0o700);
        assert!(r.is_current());
        let s = r.subdir("sub").unwrap();
        assert_eq!(s.path(), d.join("a/sub"));

        let loose = d.join("loose");
        std::fs::create_dir(&loose).unwrap();
        std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = RunDir::open(&loose).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::PermissionDenied);
        assert!(e.to_string().contains("writable by other users"), "{e}");

        // A link in place of a subdirectory is never followed.
        symlink(&loose, d.join("a/link")).unwrap();
        let e = r.subdir("link").unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // Nor is one in place of a top directory.
        let e = RunDir::open(&d.join("a/link")).unwrap_err();
        assert!(e.to_string().contains("symbolic link"), "{e}");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn files_are_made_and_opened_without_following_links() {
        let d = temp("files");
        let r = RunDir::open(&d).unwrap();
        let target = d.join("target");
        std::fs::write(&target, "keep").unwrap();
        symlink(&target, d.join("planted")).unwrap();
        assert!(r.create_new("planted", 0o600).is_err());
        assert!(r.open_rw("planted", 0o600).is_err());
        assert!(r.open_read("planted").is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        // Removing or renaming over a link touches the link only.
        let mut f = r.create_new("new", 0o600).unwrap();
        std::io::Write::write_all(&mut f, b"fresh").unwrap();
        r.rename("new", "planted").unwrap();
        assert_eq!(std::fs::read_to_string(d.join("planted")).unwrap(), "fresh");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
        let mut names = r.files().unwrap();
        names.sort();
        assert_eq!(names, ["planted", "target"]);
        r.remove_if_same("planted", &f);
        assert!(!d.join("planted").exists());
        assert_ne!(tmp_name("x"), tmp_name("x"));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_removed_directory_is_no_longer_current() {
        let d = temp("gone");
        assert!(RunDir::open_existing(&d).unwrap().is_none());
        let r = RunDir::open(&d).unwrap();
        std::fs::remove_dir(&d).unwrap();
        assert!(!r.is_current());
        std::fs::create_dir(&d).unwrap();
        assert!(
            !r.is_current(),
            "a new directory of that name is another one"
        );
        let _ = std::fs::remove_dir_all(&d);
    }
}
