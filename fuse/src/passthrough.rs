//! Whether the kernel passes a mount's reads and writes straight to the backing files (FUSE
//! passthrough, Linux 6.9), and when it does not, why: what `meshfs mount` and `status` say.
//!
//! **What it owns.** The reasons ([`PassthroughOff`]), the check of the one privilege the
//! kernel asks for ([`capable_sys_admin`]) and the probe made once the mount is up
//! ([`probe`]). Where passthrough is off, every read and write is forwarded through the
//! mount's request threads instead (the mount works the same, slower).
//!
//! **What it never does.** It never turns passthrough on: FUSE_INIT asks for it
//! (`fs.rs`), and the first open registers backing files (`handles.rs`).
//!
//! The kernel (`fs/fuse/backing.c`, `fuse_backing_open`) registers a backing file only for a
//! caller with `CAP_SYS_ADMIN` in the initial user namespace, and refuses (`ELOOP`) a backing
//! filesystem stacked deeper than the depth FUSE_INIT declared (overlayfs, another FUSE mount).
//! A daemon run as an ordinary user, as on a laptop under `systemctl --user`, never has that
//! capability and must not be given it: passthrough is then off from FUSE_INIT on, which also
//! leaves the kernel free to keep a file's pages across opens.

use crate::sys;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd};

/// Why kernel passthrough is off on a mount.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PassthroughOff {
    /// The mount was asked not to use it ([`crate::MountOptions::passthrough`]).
    NotAsked,
    /// The kernel does not offer it.
    NotOffered,
    /// Registering a backing file needs `CAP_SYS_ADMIN` (in the initial user namespace),
    /// which this process does not have.
    NeedsCapSysAdmin,
    /// The backing directory is on a stacked filesystem (overlayfs, a FUSE mount).
    Stacked,
    /// The kernel refused to register a backing file, with this errno.
    Refused(i32),
}

impl PassthroughOff {
    /// A short stable name for scripts (`status --json`).
    pub fn code(&self) -> &'static str {
        match self {
            PassthroughOff::NotAsked => "not_asked",
            PassthroughOff::NotOffered => "not_offered",
            PassthroughOff::NeedsCapSysAdmin => "needs_cap_sys_admin",
            PassthroughOff::Stacked => "stacked",
            PassthroughOff::Refused(_) => "refused",
        }
    }

    /// The reason for a refusal of the kernel with `errno`.
    pub(crate) fn from_errno(errno: i32) -> PassthroughOff {
        match errno {
            libc::EPERM => PassthroughOff::NeedsCapSysAdmin,
            libc::ELOOP => PassthroughOff::Stacked,
            e => PassthroughOff::Refused(e),
        }
    }
}

impl fmt::Display for PassthroughOff {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PassthroughOff::NotAsked => write!(f, "not asked for"),
            PassthroughOff::NotOffered => write!(
                f,
                "the kernel does not offer it (Linux 6.9 or later with CONFIG_FUSE_PASSTHROUGH)"
            ),
            PassthroughOff::NeedsCapSysAdmin => {
                write!(f, "registering backing files needs CAP_SYS_ADMIN")
            }
            PassthroughOff::Stacked => {
                write!(f, "the backing directory is on a stacked filesystem")
            }
            PassthroughOff::Refused(e) => write!(
                f,
                "the kernel refused a backing file: {}",
                std::io::Error::from_raw_os_error(*e)
            ),
        }
    }
}

/// Whether this process has `CAP_SYS_ADMIN` in the initial user namespace, as the kernel's
/// `capable()` asks: the capability in the effective set (`CapEff` in `/proc/self/status`,
/// bit 21), and the identity mapping of all user ids (`/proc/self/uid_map`), which only the
/// initial namespace has.
pub(crate) fn capable_sys_admin() -> bool {
    const CAP_SYS_ADMIN: u32 = 21;
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .unwrap_or(0);
    let map = std::fs::read_to_string("/proc/self/uid_map").unwrap_or_default();
    let initial = map.split_whitespace().collect::<Vec<_>>() == ["0", "0", "4294967295"];
    eff & (1 << CAP_SYS_ADMIN) != 0 && initial
}

/// Registers an unnamed file of the backing directory `root` with the kernel through the
/// mount's FUSE device `dev`, and drops it again: what the first open would meet, known
/// before any. `Ok` also where no unnamed file can be made there (the first open decides).
pub(crate) fn probe(dev: BorrowedFd<'_>, root: BorrowedFd<'_>) -> Result<(), PassthroughOff> {
    let Ok(file) = sys::openat(root, c".", libc::O_TMPFILE | libc::O_RDWR, 0o600) else {
        return Ok(());
    };
    match fuser::BackingId::create_raw(dev, file.as_fd()) {
        Ok(id) => {
            if let Err(e) = sys::backing_close(dev, id) {
                tracing::debug!(errno = e, "closing the probe's backing file failed");
            }
            Ok(())
        }
        Err(e) => Err(PassthroughOff::from_errno(
            e.raw_os_error().unwrap_or(libc::EIO),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_privilege_or_the_stacking_it_comes_from() {
        assert_eq!(
            PassthroughOff::from_errno(libc::EPERM),
            PassthroughOff::NeedsCapSysAdmin
        );
        assert_eq!(
            PassthroughOff::from_errno(libc::ELOOP),
            PassthroughOff::Stacked
        );
        let other = PassthroughOff::from_errno(libc::EOPNOTSUPP);
        assert_eq!(other.code(), "refused");
        assert!(other.to_string().contains("refused"), "{other}");
        assert!(PassthroughOff::NeedsCapSysAdmin
            .to_string()
            .contains("CAP_SYS_ADMIN"));
    }
}
