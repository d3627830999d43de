//! Unmounting as root or as an ordinary user.
//!
//! **What it owns.** The two ways a mount point is let go of: `umount2(2)`, which needs
//! `CAP_SYS_ADMIN`, and `fusermount3 -u` (the setuid-root helper of the `fuse3` package, which
//! lets a user unmount a FUSE mount of their own), with what its exit means.
//!
//! **What it never does.** It never decides when to unmount (`mount.rs` does), and never
//! unmounts a mount point that is not a FUSE mount of this user: fusermount3 refuses that.

use crate::sys;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::process::Command;

/// The helpers tried, in order (`FUSERMOUNT_PATH`, as fuser reads it, first).
fn helpers() -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    if let Some(p) = std::env::var_os("FUSERMOUNT_PATH") {
        out.push(p);
    }
    out.extend(["fusermount3", "fusermount"].map(Into::into));
    out
}

/// `fusermount3 -u [-z] -- mp`. Its refusals become errnos: `EBUSY` for a busy mount, `EINVAL`
/// for a mount point it does not find mounted, `EPERM` otherwise (not the user's mount);
/// `ENOENT` when no helper is installed.
fn fusermount(mp: &Path, lazy: bool) -> io::Result<()> {
    for helper in helpers() {
        let mut cmd = Command::new(&helper);
        cmd.arg("-u");
        if lazy {
            cmd.arg("-z");
        }
        let out = match cmd.arg("--").arg(mp).output() {
            Ok(o) => o,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e),
        };
        if out.status.success() {
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr);
        let errno = if err.contains("busy") {
            libc::EBUSY
        } else if err.contains("not found") || err.contains("not mounted") {
            libc::EINVAL
        } else {
            libc::EPERM
        };
        tracing::debug!(helper = ?helper, stderr = %err.trim(), "fusermount refused");
        return Err(io::Error::from_raw_os_error(errno));
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        "neither fusermount3 nor fusermount is installed (Debian: apt install fuse3)",
    ))
}

fn cpath(mp: &Path) -> CString {
    // A path from the OS never holds a NUL; an empty one fails its syscall instead.
    CString::new(mp.as_os_str().as_bytes()).unwrap_or_default()
}

/// Detaches the mount at `mp` lazily (`umount -l`): gone from the mount point now, its last
/// users served until they leave. As root `umount2(MNT_DETACH)`, otherwise `fusermount3 -u
/// -z`.
pub(crate) fn detach(mp: &Path) -> io::Result<()> {
    match sys::umount2(&cpath(mp), libc::MNT_DETACH) {
        Ok(()) => Ok(()),
        Err(libc::EPERM) => fusermount(mp, true),
        Err(e) => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Unmounts `mp` as an ordinary user (`fusermount3 -u`): `EBUSY` while a file is open in it
/// or a process has its working directory there.
pub(crate) fn unmount_as_user(mp: &Path) -> io::Result<()> {
    fusermount(mp, false)
}
