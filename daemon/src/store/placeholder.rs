//! Placeholders: the files of an on-demand folder whose content is not here
//! (docs/decisions.md, D90). A placeholder is a regular file with the version's size, mode and
//! mtime and no data (sparse), marked with the `user.meshfs.placeholder` extended attribute,
//! whose value is the content hash of the version it stands for.
//!
//! The store makes them ([`Store::make_placeholder`], for a temp file the apply installs as it
//! installs any), tells them ([`placeholder_of`]) and swaps one in for a local file
//! ([`Store::evict`]). It never reads a placeholder's bytes as content: readers that take
//! content from local files verify every chunk by its hash.

use super::{io_err, DirCache, Expect, LocalStat, Store, StoreError, TempFile};
use meshfs_protocol::{FileRecord, Hash, RelPath};
use meshfs_sys as sys;
use std::ffi::CStr;
use std::os::fd::{AsFd, BorrowedFd};

/// The mark, as the system calls want it (`meshfs_fuse::PLACEHOLDER_XATTR`).
pub(crate) const PLACEHOLDER: &CStr = c"user.meshfs.placeholder";

/// The content hash the placeholder `fd` stands for; `None` when it is no placeholder (or the
/// filesystem keeps no user attributes).
pub fn placeholder_of(fd: BorrowedFd<'_>) -> Option<Hash> {
    let mut buf = [0u8; 32];
    match sys::fgetxattr_into(fd, PLACEHOLDER, &mut buf) {
        Ok(32) => Some(Hash(buf)),
        // A mark of another length is not one this daemon made: still not content.
        Ok(_) => Some(Hash::ZERO),
        Err(_) => None,
    }
}

impl Store {
    /// Makes the new, empty temp file `t` a placeholder of `size` bytes for the content `hash`:
    /// sparse, marked, and covered (no byte of it is ever served as content, so there is no
    /// chunk to verify). [`Store::finish_temp`] then gives it its mode and mtime.
    pub fn make_placeholder(
        &self,
        t: &mut TempFile,
        size: u64,
        hash: &Hash,
    ) -> Result<(), StoreError> {
        if t.written != 0 {
            return Err(StoreError::Incomplete {
                path: t.target.clone(),
                written: t.written,
                size: 0,
            });
        }
        let f = self.writable(t)?;
        let made = f
            .set_len(size)
            .and_then(|()| sys::fsetxattr(f.as_fd(), PLACEHOLDER, &hash.0));
        made.map_err(|e| io_err(&t.target, e))?;
        t.written = size;
        Ok(())
    }

    /// Whether the file at `path` is a placeholder now: the hash it stands for. `None` for a
    /// local file, for nothing there, and for what is not a regular file.
    pub fn placeholder_at(&self, cache: &mut DirCache, path: &RelPath) -> Option<Hash> {
        let dir = self.dir_in(cache, path.parent().as_ref(), false).ok()?;
        let name = super::cstr(path.file_name()).ok()?;
        let flags = libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK;
        let fd = sys::openat(dir.as_fd(), &name, flags, 0).ok()?;
        let st = sys::fstat(fd.as_fd()).ok()?;
        if st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return None;
        }
        placeholder_of(fd.as_fd())
    }

    /// Whether this replica's filesystem keeps the placeholder mark (user extended attributes):
    /// an on-demand folder needs it. Tried on an unnamed temp file, left nowhere.
    pub fn keeps_placeholders(&self) -> Result<(), StoreError> {
        let probe = RelPath::new("probe").map_err(|e| io_err("probe", std::io::Error::other(e)))?;
        let mut t = self.create_temp_in(&mut DirCache::default(), &probe, true)?;
        let made = self.make_placeholder(&mut t, 0, &Hash::ZERO);
        self.discard_temp(t);
        made
    }

    /// Evicts the content of `record` at its path: a placeholder of it replaces the local file,
    /// which must still be the one the journal knows (`expect`), under the same checks as any
    /// install (a read lease: a writer anywhere refuses it, [`StoreError::Busy`]). The old file
    /// is kept aside for the grace period and then dropped; it is the same version, so it is not
    /// handed over as one that leaves. Returns the placeholder's stat.
    pub fn evict(&self, record: &FileRecord, expect: LocalStat) -> Result<LocalStat, StoreError> {
        let mut dirs = DirCache::default();
        let mut t = self.create_temp_in(&mut dirs, &record.path, true)?;
        t.same_version = true;
        let made = self
            .make_placeholder(&mut t, record.size, &record.hash)
            .and_then(|()| self.finish_temp(&mut t, record.size, record.mode, record.mtime_ns));
        if let Err(e) = made {
            self.discard_temp(t);
            return Err(e);
        }
        self.sync_temps(&[&t]);
        self.install_synced_in(&mut dirs, vec![(t, Expect::Matches(expect))], &|_, _| {})
            .pop()
            .unwrap_or_else(|| Err(StoreError::Changed(record.path.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> RelPath {
        RelPath::new(s).unwrap()
    }

    #[test]
    fn the_mark_is_the_one_the_mount_knows() {
        assert_eq!(
            PLACEHOLDER.to_bytes(),
            meshfs_fuse::PLACEHOLDER_XATTR.as_bytes()
        );
    }

    #[test]
    fn a_placeholder_has_the_size_and_no_blocks_and_an_eviction_swaps_one_in_for_a_local_file() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        if store.keeps_placeholders().is_err() {
            eprintln!("no user extended attributes here; skipped");
            return;
        }
        let hash = Hash::of(b"whatever");
        let mut t = store.create_temp(&p("d/f")).unwrap();
        store.make_placeholder(&mut t, 10 << 20, &hash).unwrap();
        store
            .finish_temp(&mut t, 10 << 20, 0o640, 7_000_000_000)
            .unwrap();
        let st = store
            .install(vec![(t, Expect::Absent)])
            .pop()
            .unwrap()
            .unwrap();
        assert_eq!(st.size, 10 << 20);
        assert_eq!(st.mtime_ns, 7_000_000_000);
        let md = std::fs::metadata(dir.path().join("d/f")).unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(md.blocks(), 0, "nothing of it is on disk");
        assert_eq!(
            store.placeholder_at(&mut DirCache::default(), &p("d/f")),
            Some(hash)
        );

        let data = vec![7u8; 100_000];
        std::fs::write(dir.path().join("g"), &data).unwrap();
        let before = store.stat(&p("g")).unwrap().unwrap().local;
        let record = FileRecord {
            path: p("g"),
            kind: meshfs_protocol::FileKind::File,
            deleted: false,
            mode: 0o644,
            mtime_ns: before.mtime_ns,
            size: data.len() as u64,
            hash: Hash::of(&data),
            chunks: Vec::new(),
            target: String::new(),
            version: Default::default(),
            modified_by: Default::default(),
            sequence: 0,
        };
        let after = store.evict(&record, before).unwrap();
        assert_ne!(after.inode, before.inode);
        assert_eq!((after.size, after.mtime_ns), (before.size, before.mtime_ns));
        assert_eq!(
            store.placeholder_at(&mut DirCache::default(), &p("g")),
            Some(record.hash)
        );
        // A file that changed since the journal saw it is not evicted.
        std::fs::write(dir.path().join("h"), b"x").unwrap();
        let h = store.stat(&p("h")).unwrap().unwrap().local;
        std::fs::write(dir.path().join("h"), b"xy").unwrap();
        let mut r2 = record.clone();
        r2.path = p("h");
        assert!(matches!(store.evict(&r2, h), Err(StoreError::Changed(_))));
        assert_eq!(std::fs::read(dir.path().join("h")).unwrap(), b"xy");
    }
}
