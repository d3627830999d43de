//! [`RelPath`]: the only way to name a file inside a replicated folder.
//!
//! Everything that arrives from a peer or a user goes through [`RelPath::new`]; a path that
//! exists is relative, `/`-separated, UTF-8 in NFC, free of empty, `.` and `..` components and
//! NUL bytes, within the length limits, and outside meshfs's internal names (any component
//! starting with [`INTERNAL_PREFIX`]: the `.meshfs` state directory and the store's temp files).

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use unicode_normalization::{is_nfc_quick, IsNormalized, UnicodeNormalization};

/// Longest whole path, in bytes (Linux PATH_MAX less room for the folder root).
pub const MAX_PATH_LEN: usize = 3072;
/// Longest single component, in bytes (Linux NAME_MAX).
pub const MAX_NAME_LEN: usize = 255;
/// Components starting with this are meshfs's own (state dir, temp files): never replicated.
pub const INTERNAL_PREFIX: &str = ".meshfs";

/// A validated path relative to a folder root.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RelPath(String);

/// Why a path was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    /// The empty string names the root, which is not a file.
    #[error("empty path")]
    Empty,
    /// Starts with `/`.
    #[error("path {0:?} is absolute; meshfs paths are relative to the folder root")]
    Absolute(String),
    /// `a//b` or a trailing `/`.
    #[error("path {0:?} has an empty component")]
    EmptyComponent(String),
    /// `.` or `..`.
    #[error("path {0:?} has a '.' or '..' component")]
    DotComponent(String),
    /// Contains a NUL byte.
    #[error("path {0:?} contains a NUL byte")]
    Nul(String),
    /// Not in Unicode normalization form C.
    #[error("path {0:?} is not in Unicode NFC form")]
    NotNfc(String),
    /// A component is longer than [`MAX_NAME_LEN`] bytes.
    #[error("a component of path {0:?} is longer than {MAX_NAME_LEN} bytes")]
    NameTooLong(String),
    /// The whole path is longer than [`MAX_PATH_LEN`] bytes.
    #[error("path is longer than {MAX_PATH_LEN} bytes")]
    TooLong,
    /// Names meshfs's internal state or temp files.
    #[error("path {0:?} is inside meshfs's internal names ({INTERNAL_PREFIX}*)")]
    Internal(String),
    /// Not valid UTF-8 (from a local file name).
    #[error("file name is not valid UTF-8: {0}")]
    NotUtf8(String),
}

impl RelPath {
    /// Validates `s` as it is (it must already be NFC).
    pub fn new(s: &str) -> Result<RelPath, PathError> {
        if s.is_empty() {
            return Err(PathError::Empty);
        }
        if s.len() > MAX_PATH_LEN {
            return Err(PathError::TooLong);
        }
        if s.starts_with('/') {
            return Err(PathError::Absolute(s.to_string()));
        }
        if s.contains('\0') {
            return Err(PathError::Nul(s.replace('\0', "\\0")));
        }
        for comp in s.split('/') {
            if comp.is_empty() {
                return Err(PathError::EmptyComponent(s.to_string()));
            }
            if comp == "." || comp == ".." {
                return Err(PathError::DotComponent(s.to_string()));
            }
            if comp.len() > MAX_NAME_LEN {
                return Err(PathError::NameTooLong(s.to_string()));
            }
            if comp.starts_with(INTERNAL_PREFIX) {
                return Err(PathError::Internal(s.to_string()));
            }
        }
        let nfc = match is_nfc_quick(s.chars()) {
            IsNormalized::Yes => true,
            _ => s.nfc().eq(s.chars()),
        };
        if !nfc {
            return Err(PathError::NotNfc(s.to_string()));
        }
        Ok(RelPath(s.to_string()))
    }

    /// Normalizes `s` to NFC, then validates it.
    pub fn normalized(s: &str) -> Result<RelPath, PathError> {
        let n: String = s.nfc().collect();
        RelPath::new(&n)
    }

    /// The path as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The components, root first.
    pub fn components(&self) -> impl Iterator<Item = &str> {
        self.0.split('/')
    }

    /// The last component.
    pub fn file_name(&self) -> &str {
        self.0.rsplit('/').next().unwrap_or(&self.0)
    }

    /// The containing directory, or `None` at the top level.
    pub fn parent(&self) -> Option<RelPath> {
        self.0.rfind('/').map(|i| RelPath(self.0[..i].to_string()))
    }

    /// Every ancestor directory, nearest first.
    pub fn ancestors(&self) -> Vec<RelPath> {
        let mut out = Vec::new();
        let mut cur = self.parent();
        while let Some(p) = cur {
            cur = p.parent();
            out.push(p);
        }
        out
    }

    /// `self/name`, validated.
    pub fn join(&self, name: &str) -> Result<RelPath, PathError> {
        RelPath::new(&format!("{}/{}", self.0, name))
    }

    /// A sibling of this path named `name` (same parent), validated.
    pub fn with_file_name(&self, name: &str) -> Result<RelPath, PathError> {
        match self.parent() {
            Some(p) => p.join(name),
            None => RelPath::new(name),
        }
    }

    /// Whether `self` is `ancestor` or lies below it.
    pub fn is_within(&self, ancestor: &RelPath) -> bool {
        self.0 == ancestor.0
            || (self.0.len() > ancestor.0.len()
                && self.0.starts_with(&ancestor.0)
                && self.0.as_bytes()[ancestor.0.len()] == b'/')
    }

    /// Rewrites the prefix `from` (an ancestor or self) into `to`.
    pub fn rebase(&self, from: &RelPath, to: &RelPath) -> Option<RelPath> {
        if !self.is_within(from) {
            return None;
        }
        let rest = &self.0[from.0.len()..];
        RelPath::new(&format!("{}{}", to.0, rest)).ok()
    }
}

impl fmt::Display for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for RelPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

impl std::str::FromStr for RelPath {
    type Err = PathError;
    fn from_str(s: &str) -> Result<RelPath, PathError> {
        RelPath::new(s)
    }
}

impl Serialize for RelPath {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for RelPath {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        RelPath::new(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn component() -> impl Strategy<Value = String> {
        "[a-zA-Z0-9 _éü中-][a-zA-Z0-9 ._éü中-]{0,20}"
            .prop_filter("not a dot component or internal", |c| {
                c != "." && c != ".." && !c.starts_with(INTERNAL_PREFIX)
            })
            .prop_map(|c| c.nfc().collect())
    }

    proptest! {
        #[test]
        fn accepts_every_valid_path(comps in prop::collection::vec(component(), 1..8)) {
            let s = comps.join("/");
            let p = RelPath::new(&s).unwrap();
            prop_assert_eq!(p.as_str(), s.as_str());
            prop_assert_eq!(p.to_string().parse::<RelPath>().unwrap(), p.clone());
            prop_assert_eq!(p.components().count(), comps.len());
            prop_assert_eq!(p.file_name(), comps.last().unwrap().as_str());
        }

        #[test]
        fn rejects_dotdot_anywhere(comps in prop::collection::vec(component(), 0..4), at in 0usize..4) {
            let mut c = comps.clone();
            c.insert(at.min(c.len()), "..".to_string());
            prop_assert!(matches!(RelPath::new(&c.join("/")), Err(PathError::DotComponent(_))));
        }

        #[test]
        fn rejects_absolute_and_empty_components(comps in prop::collection::vec(component(), 1..4)) {
            let s = comps.join("/");
            let bad = [format!("/{s}"), format!("{s}/"), format!("{s}//x"), format!("{s}\0x")];
            for b in bad {
                prop_assert!(RelPath::new(&b).is_err(), "accepted {:?}", b);
            }
        }

        #[test]
        fn rejects_over_long_names(n in (MAX_NAME_LEN + 1)..600) {
            prop_assert!(matches!(RelPath::new(&"a".repeat(n)), Err(PathError::NameTooLong(_))));
        }

        #[test]
        fn never_panics_on_any_string(s in ".*") {
            let _ = RelPath::new(&s);
            let _ = RelPath::normalized(&s);
        }
    }

    #[test]
    fn rejects_each_rule() {
        assert_eq!(RelPath::new(""), Err(PathError::Empty));
        assert!(matches!(RelPath::new("."), Err(PathError::DotComponent(_))));
        assert!(matches!(
            RelPath::new("a/./b"),
            Err(PathError::DotComponent(_))
        ));
        assert!(matches!(
            RelPath::new(".meshfs/db"),
            Err(PathError::Internal(_))
        ));
        assert!(matches!(
            RelPath::new("a/.meshfs-tmp-1"),
            Err(PathError::Internal(_))
        ));
        assert!(matches!(
            RelPath::new(&"a/".repeat(2000)),
            Err(PathError::TooLong)
        ));
        // "e" + combining acute is NFD; its NFC form is accepted.
        assert!(matches!(
            RelPath::new("cafe\u{301}"),
            Err(PathError::NotNfc(_))
        ));
        assert_eq!(
            RelPath::normalized("cafe\u{301}").unwrap().as_str(),
            "caf\u{e9}"
        );
        assert!(RelPath::new(".meshignore").is_ok());
    }

    #[test]
    fn navigation() {
        let p = RelPath::new("a/b/c.txt").unwrap();
        assert_eq!(p.parent().unwrap().as_str(), "a/b");
        assert_eq!(p.ancestors().len(), 2);
        assert!(p.is_within(&RelPath::new("a").unwrap()));
        assert!(!p.is_within(&RelPath::new("a/b/c").unwrap()));
        let moved = p.rebase(&RelPath::new("a/b").unwrap(), &RelPath::new("z").unwrap());
        assert_eq!(moved.unwrap().as_str(), "z/c.txt");
    }
}
