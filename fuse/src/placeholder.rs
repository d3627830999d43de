//! Placeholders as the mount sees them: how a backing file is told to be one, and meshfs's own
//! extended attributes, which the mount hides (docs/decisions.md, D90 and D94).
//!
//! Owns the rules only; what to do about a placeholder (fetch it, answer its state) is the
//! engine's, asked through [`crate::ContentSource`] by `fs`.

use crate::sys::{self, XattrAt};
use crate::{OWN_XATTR_PREFIX, STATE_XATTR};
use std::ffi::CStr;
use std::os::unix::ffi::OsStrExt;

/// The placeholder attribute's name ([`PLACEHOLDER_XATTR`]), as the system calls want it.
const MARK: &CStr = c"user.meshfs.placeholder";

/// Whether the file reached through `at` is a placeholder: it carries the mark. An error
/// other than "no such attribute" (a filesystem without user attributes) says no.
pub(crate) fn is_placeholder(at: &XattrAt<'_>) -> bool {
    sys::getxattr(at, MARK, 0).is_ok()
}

/// Removes the mark (the placeholder was emptied: its content, nothing, is known).
pub(crate) fn unmark(at: &XattrAt<'_>) -> sys::SysResult<()> {
    match sys::removexattr(at, MARK) {
        Err(libc::ENODATA) => Ok(()),
        r => r,
    }
}

/// Whether `name` is one of meshfs's own attributes (hidden, never set or removed through the
/// mount).
pub(crate) fn is_own(name: &CStr) -> bool {
    name.to_bytes().starts_with(OWN_XATTR_PREFIX.as_bytes())
}

/// Whether `name` is the state attribute the mount answers itself.
pub(crate) fn is_state(name: &CStr) -> bool {
    name.to_bytes() == STATE_XATTR.as_bytes()
}

/// A `listxattr` result (names, each NUL-terminated) without meshfs's own names, with the state
/// attribute added when `with_state`.
pub(crate) fn filter_list(list: &[u8], with_state: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(list.len() + STATE_XATTR.len() + 1);
    for name in list.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        if !name.starts_with(OWN_XATTR_PREFIX.as_bytes()) {
            out.extend_from_slice(name);
            out.push(0);
        }
    }
    if with_state {
        out.extend_from_slice(std::ffi::OsStr::new(STATE_XATTR).as_bytes());
        out.push(0);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meshfs_own_attributes_are_hidden_from_a_listing_and_the_state_is_added() {
        let list = b"user.a\0user.meshfs.placeholder\0security.selinux\0user.meshfs.displaced\0";
        assert_eq!(
            filter_list(list, false),
            b"user.a\0security.selinux\0".to_vec()
        );
        assert_eq!(
            filter_list(list, true),
            b"user.a\0security.selinux\0user.meshfs.state\0".to_vec()
        );
        assert!(is_own(c"user.meshfs.placeholder"));
        assert!(is_own(c"user.meshfs.state"));
        assert!(!is_own(c"user.meshfsx"));
        assert!(is_state(c"user.meshfs.state"));
        assert_eq!(MARK.to_bytes(), crate::PLACEHOLDER_XATTR.as_bytes());
    }
}
