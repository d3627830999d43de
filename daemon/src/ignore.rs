//! Ignore rules: gitignore-syntax patterns. Ignored paths are never journaled.
//!
//! Two files hold them:
//! - `.meshignore` at a folder's root, replicated like any other file (so every device of
//!   the folder shares it — and any of them can change it);
//! - a **local** file, `CONFIG_DIR/ignore/FOLDER-ID`, that never leaves this device and that
//!   no peer can change: the place for what must never be sent (keys, secrets).
//!
//! A peer controls `.meshignore`'s content and kind, so it is read defensively: opened
//! without following a symlink (a link to `/dev/zero`, a FIFO or a private key is not
//! read), only if it is a regular file, and at most [`MAX_IGNORE_BYTES`].

use ignore::gitignore::{Gitignore, GitignoreBuilder};
use ignore::Match;
use meshfs_protocol::RelPath;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The replicated file's name at the folder root.
pub const IGNORE_FILE: &str = ".meshignore";
/// Largest ignore file read; the rest is ignored with a warning.
pub const MAX_IGNORE_BYTES: u64 = 1 << 20;

/// A folder's ignore rules: the local file's and the shared file's, each compiled on its own.
///
/// A peer writes the shared file, so nothing in it can weaken the local rules: they are
/// matched first, and what they ignore (or explicitly keep, `!pattern`) is decided there. A
/// shared file that does not compile (globset refuses a pattern set whose regular
/// expression outgrows its limit: a megabyte of distinct wildcard lines) is reported, and the
/// shared rules in force before it stay.
#[derive(Debug)]
pub struct IgnoreRules {
    local: Gitignore,
    shared: Gitignore,
    /// Why the last load kept older rules (or none) for one of the files, if it did.
    problem: Option<String>,
}

/// Why an ignore file's rules are not applied.
#[derive(Debug, thiserror::Error)]
pub enum IgnoreFileError {
    /// It could not be opened: a symlink (never followed), or unreadable.
    #[error("ignore file {path} not read (a symlink or unreadable: {source}); its rules are not applied")]
    Open {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A directory, FIFO, device or socket in its place.
    #[error("ignore file {path} is not a regular file; its rules are not applied")]
    NotRegular {
        /// The file.
        path: PathBuf,
    },
    /// Reading it failed.
    #[error("ignore file {path} could not be read ({source}); its rules are not applied")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Its patterns could not be compiled together.
    #[error("ignore file {path} could not be compiled ({reason}); {kept}")]
    Compile {
        /// The file.
        path: PathBuf,
        /// The compiler's words.
        reason: String,
        /// What applies instead.
        kept: &'static str,
    },
}

/// The text of an ignore file, read without following a symlink, only from a regular file,
/// and at most [`MAX_IGNORE_BYTES`] (with a warning when it is longer). `None` when there is
/// no such file.
fn read_rules(file: &Path) -> Result<Option<String>, IgnoreFileError> {
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(file)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(IgnoreFileError::Open {
                path: file.to_path_buf(),
                source,
            })
        }
    };
    let read_err = |source| IgnoreFileError::Read {
        path: file.to_path_buf(),
        source,
    };
    let md = f.metadata().map_err(read_err)?;
    if !md.is_file() {
        return Err(IgnoreFileError::NotRegular {
            path: file.to_path_buf(),
        });
    }
    if md.len() > MAX_IGNORE_BYTES {
        tracing::warn!(file = %file.display(), bytes = md.len(), max = MAX_IGNORE_BYTES, "ignore file too large; only its beginning is read");
    }
    let mut bytes = Vec::new();
    f.take(MAX_IGNORE_BYTES)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// The rules of one ignore file, compiled alone: `Ok(None)` when there is no such file.
/// Bad lines are skipped with a warning.
fn compile(root: &Path, file: &Path) -> Result<Option<Gitignore>, (IgnoreFileError, bool)> {
    let text = match read_rules(file) {
        Ok(Some(text)) => text,
        Ok(None) => return Ok(None),
        // A file that is not there as a regular file has no rules: that is what it says.
        Err(e) => return Err((e, false)),
    };
    let mut b = GitignoreBuilder::new(root);
    for line in text.lines() {
        if let Err(e) = b.add_line(Some(file.to_path_buf()), line) {
            tracing::warn!(file = %file.display(), error = %e, "an ignore line was skipped");
        }
    }
    b.build().map(Some).map_err(|e| {
        let e = IgnoreFileError::Compile {
            path: file.to_path_buf(),
            reason: e.to_string(),
            kept: "",
        };
        (e, true)
    })
}

impl IgnoreRules {
    /// Loads `root/.meshignore` and the local `local` file (either may be missing: nothing
    /// ignored). Bad lines are skipped with a warning; a file that does not compile applies
    /// no rules (see [`IgnoreRules::reload`] for keeping older ones).
    pub fn load(root: &Path, local: Option<&Path>) -> IgnoreRules {
        let mut rules = IgnoreRules::none();
        rules.reload(root, local);
        rules
    }

    /// Reads both files again. A file that cannot be compiled leaves its rules as they were
    /// (none at the first load) and says so in the log and in [`IgnoreRules::problem`]; one
    /// that is missing, a symlink or not a regular file has no rules.
    pub fn reload(&mut self, root: &Path, local: Option<&Path>) {
        self.problem = None;
        let shared = root.join(IGNORE_FILE);
        match compile(root, &shared) {
            Ok(g) => self.shared = g.unwrap_or_else(Gitignore::empty),
            Err((e, compiled)) => {
                if !compiled {
                    self.shared = Gitignore::empty();
                }
                self.note(e, "the shared rules in force before it stay");
            }
        }
        if let Some(local) = local {
            match compile(root, local) {
                Ok(g) => self.local = g.unwrap_or_else(Gitignore::empty),
                Err((e, compiled)) => {
                    if !compiled {
                        self.local = Gitignore::empty();
                    }
                    self.note(e, "the local rules in force before it stay");
                }
            }
        }
    }

    fn note(&mut self, e: IgnoreFileError, kept: &'static str) {
        let e = match e {
            IgnoreFileError::Compile { path, reason, .. } => {
                IgnoreFileError::Compile { path, reason, kept }
            }
            other => other,
        };
        tracing::warn!(error = %e, "ignore file skipped");
        self.problem = Some(e.to_string());
    }

    /// Why the last load could not apply a file as it is, if it could not.
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }

    /// No rules.
    pub fn none() -> IgnoreRules {
        IgnoreRules {
            local: Gitignore::empty(),
            shared: Gitignore::empty(),
            problem: None,
        }
    }

    /// Whether `path` (or one of its parents) is ignored: by the local rules if they say
    /// anything of it (`!pattern` there keeps what the shared rules ignore), else by the
    /// shared rules.
    pub fn is_ignored(&self, path: &RelPath, is_dir: bool) -> bool {
        if path.as_str() == IGNORE_FILE {
            return false;
        }
        match self
            .local
            .matched_path_or_any_parents(path.as_str(), is_dir)
        {
            Match::Ignore(_) => true,
            Match::Whitelist(_) => false,
            Match::None => self
                .shared
                .matched_path_or_any_parents(path.as_str(), is_dir)
                .is_ignore(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn a_symlinked_meshignore_is_never_read_through_the_link() {
        let d = tempfile::tempdir().unwrap();
        let secret = d.path().join("secret");
        std::fs::write(&secret, "*.txt\n").unwrap();
        let root = d.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::os::unix::fs::symlink(&secret, root.join(IGNORE_FILE)).unwrap();
        assert!(!IgnoreRules::load(&root, None).is_ignored(&p("a.txt"), false));
        assert!(matches!(
            read_rules(&root.join(IGNORE_FILE)),
            Err(IgnoreFileError::Open { path, .. }) if path == root.join(IGNORE_FILE)
        ));
        std::fs::remove_file(root.join(IGNORE_FILE)).unwrap();
        std::os::unix::fs::symlink("/dev/zero", root.join(IGNORE_FILE)).unwrap();
        assert!(!IgnoreRules::load(&root, None).is_ignored(&p("a.txt"), false));
        std::fs::remove_file(root.join(IGNORE_FILE)).unwrap();
        assert!(matches!(read_rules(&root.join(IGNORE_FILE)), Ok(None)));
    }

    #[test]
    fn a_fifo_meshignore_does_not_hang_and_a_huge_one_is_read_only_to_its_cap() {
        let d = tempfile::tempdir().unwrap();
        let fifo = std::ffi::CString::new(d.path().join(IGNORE_FILE).to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        assert!(!IgnoreRules::load(d.path(), None).is_ignored(&p("x"), false));
        let err = read_rules(&d.path().join(IGNORE_FILE)).unwrap_err();
        assert!(matches!(err, IgnoreFileError::NotRegular { .. }), "{err:?}");
        assert!(err
            .to_string()
            .contains(".meshignore is not a regular file"));
        std::fs::remove_file(d.path().join(IGNORE_FILE)).unwrap();
        let mut big = "*.log\n".to_string();
        big.push_str(&"#".repeat(MAX_IGNORE_BYTES as usize));
        big.push_str("\n*.txt\n");
        std::fs::write(d.path().join(IGNORE_FILE), big).unwrap();
        let rules = IgnoreRules::load(d.path(), None);
        assert!(rules.is_ignored(&p("a.log"), false));
        assert!(!rules.is_ignored(&p("a.txt"), false), "read past the cap");
    }

    #[test]
    fn the_local_ignore_file_applies_beside_the_shared_one() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(IGNORE_FILE), "*.tmp\n").unwrap();
        let local = d.path().join("local-ignore");
        std::fs::write(&local, "secrets/\n").unwrap();
        let rules = IgnoreRules::load(d.path(), Some(&local));
        assert!(rules.is_ignored(&p("x.tmp"), false));
        assert!(rules.is_ignored(&p("secrets/key"), false));
        assert!(!rules.is_ignored(&p("notes.md"), false));
    }

    /// A megabyte of distinct wildcard lines: more than globset compiles into one matcher.
    pub(crate) fn uncompilable() -> String {
        let mut text = String::new();
        let mut i = 0u64;
        while text.len() < MAX_IGNORE_BYTES as usize - 64 {
            text.push_str(&format!("*{i:x}*?[a-f]{}*\n", i * 7919));
            i += 1;
        }
        text
    }

    #[test]
    fn local_rules_hold_and_older_shared_ones_stay_when_a_shared_file_does_not_compile() {
        let d = tempfile::tempdir().unwrap();
        let local = d.path().join("local-ignore");
        std::fs::write(&local, "secret*\n").unwrap();
        std::fs::write(d.path().join(IGNORE_FILE), "*.tmp\n").unwrap();
        let mut rules = IgnoreRules::load(d.path(), Some(&local));
        assert!(rules.problem().is_none());
        std::fs::write(d.path().join(IGNORE_FILE), uncompilable()).unwrap();
        let t0 = std::time::Instant::now();
        rules.reload(d.path(), Some(&local));
        eprintln!("a shared file that does not compile: {:?}", t0.elapsed());
        let problem = rules
            .problem()
            .expect("the failure is reported")
            .to_string();
        assert!(problem.contains("could not be compiled"), "{problem}");
        assert!(problem.contains("in force before it stay"), "{problem}");
        assert!(
            rules.is_ignored(&p("secret.key"), false),
            "the local rules hold"
        );
        assert!(
            rules.is_ignored(&p("x.tmp"), false),
            "the older shared rules stay"
        );
        // Loaded fresh, the same files: the local rules alone.
        let fresh = IgnoreRules::load(d.path(), Some(&local));
        assert!(fresh.is_ignored(&p("secret.key"), false));
        assert!(!fresh.is_ignored(&p("x.tmp"), false));
    }

    #[test]
    fn a_shared_negation_cannot_keep_what_the_local_rules_ignore() {
        let d = tempfile::tempdir().unwrap();
        let local = d.path().join("local-ignore");
        std::fs::write(&local, "secret*\n!keep.log\n").unwrap();
        std::fs::write(d.path().join(IGNORE_FILE), "!secret.key\n*.log\n").unwrap();
        let rules = IgnoreRules::load(d.path(), Some(&local));
        assert!(rules.is_ignored(&p("secret.key"), false));
        assert!(rules.is_ignored(&p("other.log"), false));
        assert!(
            !rules.is_ignored(&p("keep.log"), false),
            "a local negation keeps it"
        );
    }
}
