//! `.meshignore`: gitignore-syntax patterns at a folder's root. Ignored paths are never
//! journaled; the `.meshignore` file itself is replicated like any other file.

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use meshfs_protocol::RelPath;
use std::path::Path;

/// The file's name at the folder root.
pub const IGNORE_FILE: &str = ".meshignore";

/// A folder's ignore rules.
#[derive(Debug)]
pub struct IgnoreRules {
    matcher: Gitignore,
}

impl IgnoreRules {
    /// Loads `root/.meshignore` (no file: nothing ignored). Bad lines are skipped with a warning.
    pub fn load(root: &Path) -> IgnoreRules {
        let mut b = GitignoreBuilder::new(root);
        let file = root.join(IGNORE_FILE);
        if file.exists() {
            if let Some(e) = b.add(&file) {
                tracing::warn!(file = %file.display(), error = %e, "some .meshignore lines were skipped");
            }
        }
        let matcher = b.build().unwrap_or_else(|e| {
            tracing::warn!(file = %file.display(), error = %e, ".meshignore ignored");
            Gitignore::empty()
        });
        IgnoreRules { matcher }
    }

    /// No rules.
    pub fn none() -> IgnoreRules {
        IgnoreRules {
            matcher: Gitignore::empty(),
        }
    }

    /// Whether `path` (or one of its parents) is ignored.
    pub fn is_ignored(&self, path: &RelPath, is_dir: bool) -> bool {
        if path.as_str() == IGNORE_FILE {
            return false;
        }
        self.matcher
            .matched_path_or_any_parents(path.as_str(), is_dir)
            .is_ignore()
    }
}
