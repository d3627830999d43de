//! The scanner: state-based change detection, the safety net under trace-based capture.
//!
//! It compares a subtree on disk with the journal's current records by (inode, size, mtime,
//! mode) and reads contents only for files that differ, so a scan of an unchanged tree reads
//! no file contents. It never follows symlinks, never enters `.meshfs*` names, skips special
//! files with a warning, and turns a new path whose (inode, size, mtime) matches a path that
//! just vanished into a rename that re-uses the known content instead of hashing it again.
//!
//! The scanner only *detects*: it returns journal [`Change`]s; the engine commits them.

use crate::chunker;
use crate::ignore::IgnoreRules;
use crate::journal::{Change, Journal, JournalError, Op, RecordSummary};
use crate::store::{stat_of, DirCache, LocalStat, Store};
use meshfs_protocol::{FileKind, FileRecord, FolderId, Hash, RelPath, ShortId, INTERNAL_PREFIX};
use meshfs_sync::reconcile::{new_local_version, Context};
use meshfs_sys as sys;
use std::collections::{HashMap, HashSet};
use std::ops::ControlFlow;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What a scan looked at and found.
#[derive(Debug, Default)]
pub struct ScanReport {
    /// The changes to journal, in a safe order: new directories parent-first, then files, then
    /// deletions deepest-first.
    pub changes: Vec<Change>,
    /// Entries examined on disk.
    pub entries: u64,
    /// Files whose content was read.
    pub hashed_files: u64,
    /// Bytes read for hashing.
    pub hashed_bytes: u64,
    /// Paths whose stat changed but content did not (journal stat refreshed, no version).
    pub restat: Vec<(RelPath, LocalStat)>,
    /// Files that could not be read (unreadable, or vanished while hashing): no version.
    pub unread: Vec<RelPath>,
    /// Inodes of placeholders found standing for their record's content (files on demand,
    /// D90): the journal notes them as not local.
    pub placeholders: Vec<u64>,
    /// Inodes of files read for their content: not placeholders (any more: a placeholder
    /// truncated to nothing through the mount and written is local content in the same inode).
    pub contents: Vec<u64>,
    /// Files seen with more than one name (hard links): a change of one changed the content
    /// under its other names too, which the caller looks up (the watcher names only the path
    /// that was written).
    pub linked: Vec<RelPath>,
}

/// What reading a file for its content found.
enum Read {
    /// Its content.
    Content(chunker::Content),
    /// A placeholder (D90) of the content with this hash: not read, never taken for content.
    Placeholder(Hash),
}

/// What a scan needs to know about a folder.
pub struct ScanTarget<'a> {
    /// The folder.
    pub folder: &'a FolderId,
    /// Its replica directory.
    pub store: &'a Store,
    /// Its ignore rules.
    pub ignore: &'a IgnoreRules,
    /// This device (the author of every version a scan finds).
    pub local: ShortId,
    /// Unix seconds now (floor for new version counters).
    pub now_secs: u64,
}

/// Why a scan failed.
#[derive(Debug, thiserror::Error)]
pub enum ScanError {
    /// The journal could not be read.
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// A slice of a streamed scan could not be journaled.
    #[error("journaling scanned changes: {0}")]
    Commit(JournalError),
    /// The folder root is missing or unreadable.
    #[error("{path}: {source}")]
    Root {
        /// The folder root.
        path: String,
        /// What happened.
        source: std::io::Error,
    },
}

/// What the journal knows of a path: the summary always, the full record when it was loaded
/// anyway (targeted scans); otherwise it is fetched only for paths that changed.
#[derive(Clone, Debug)]
struct Known {
    s: RecordSummary,
    full: Option<FileRecord>,
}

impl Known {
    fn from_stored(st: crate::journal::StoredRecord) -> Known {
        let r = &st.record;
        Known {
            s: RecordSummary {
                path: r.path.clone(),
                kind: r.kind,
                deleted: r.deleted,
                mode: r.mode,
                mtime_ns: r.mtime_ns,
                hash: r.hash,
                local: st.local,
            },
            full: Some(st.record),
        }
    }
}

/// Fetches full records from the journal on demand (`None`: a folder the journal has nothing
/// of yet).
struct Lookup<'a> {
    journal: Option<&'a Journal>,
    folder: &'a FolderId,
}

impl Lookup<'_> {
    fn full(&self, k: &Known) -> Option<FileRecord> {
        k.full.clone().or_else(|| {
            self.journal?
                .get(self.folder, &k.s.path)
                .ok()
                .flatten()
                .map(|s| s.record)
        })
    }

    fn full_of(&self, k: Option<&Known>) -> Option<FileRecord> {
        k.and_then(|k| self.full(k))
    }
}

struct Seen {
    path: RelPath,
    kind: FileKind,
    local: LocalStat,
    /// Names its inode has (a file with more than one is a hard link).
    nlink: u64,
}

/// Scans the given scopes (each a path whose subtree is examined; empty = the whole folder).
pub fn scan(
    t: &ScanTarget<'_>,
    journal: &Journal,
    scopes: &[RelPath],
) -> Result<ScanReport, ScanError> {
    let mut known: HashMap<RelPath, Known> = HashMap::new();
    let mut seen: Vec<Seen> = Vec::new();
    let mut report = ScanReport::default();
    let whole = scopes.is_empty();
    if whole {
        journal.for_each_summary(t.folder, &mut |s| {
            known.insert(s.path.clone(), Known { s, full: None });
            ControlFlow::Continue(())
        })?;
        walk(t, None, &mut seen, &mut report).map_err(|source| ScanError::Root {
            path: t.store.root().display().to_string(),
            source,
        })?;
    } else {
        // Scopes inside another scope are dropped (by their ancestors: a pass under a steady
        // stream of changes has hundreds of scopes).
        let all: HashSet<&RelPath> = scopes.iter().collect();
        let mut kept: Vec<&RelPath> = all
            .iter()
            .copied()
            .filter(|s| !s.ancestors().iter().any(|a| all.contains(a)))
            .collect();
        kept.sort();
        // The scopes' parents are walked to once per scan, not once per scope.
        let mut dirs = DirCache::default();
        for &scope in &kept {
            // Nothing is journaled below a file: one query instead of two.
            let mut leaf = false;
            if let Some(s) = journal.get(t.folder, scope)? {
                leaf = !s.record.deleted && s.record.kind != FileKind::Dir;
                known.insert(scope.clone(), Known::from_stored(s));
            }
            if !leaf {
                for s in journal.below(t.folder, scope)? {
                    known.insert(s.record.path.clone(), Known::from_stored(s));
                }
            }
            if let Ok(Some(st)) = t.store.stat_in(&mut dirs, scope) {
                if let Some(kind) = st.kind {
                    if t.ignore.is_ignored(scope, kind == FileKind::Dir) {
                        continue;
                    }
                    report.entries += 1;
                    seen.push(Seen {
                        path: scope.clone(),
                        kind,
                        local: st.local,
                        nlink: st.nlink,
                    });
                    if kind == FileKind::Dir {
                        let _ = walk(t, Some(scope), &mut seen, &mut report);
                    }
                }
            }
        }
    }
    let lk = Lookup {
        journal: Some(journal),
        folder: t.folder,
    };
    diff(t, &lk, known, seen, report, None)
}

/// Files hashed per slice of a streamed first scan.
pub const FIRST_SCAN_SLICE: usize = 1000;

/// What a streamed scan hands over as soon as it has it: changes in a safe order (every
/// directory before anything below it), and how many files are still to be hashed after them.
/// The first call comes as soon as the tree is walked, before any file is read (its changes
/// may be none).
pub type Emit<'a> = dyn FnMut(Vec<Change>, usize) -> Result<(), JournalError> + 'a;

/// The first scan of a folder the journal has nothing of: the whole tree is new, so nothing can
/// have been deleted or renamed, and no journal is read. Changes are handed to `emit` as they
/// are found — directories and symlinks first, then files [`FIRST_SCAN_SLICE`] at a time as
/// they are hashed — so they can be journaled and sent to peers while the rest is still being
/// read. The returned report's `changes` is empty.
pub fn scan_new(t: &ScanTarget<'_>, emit: &mut Emit<'_>) -> Result<ScanReport, ScanError> {
    let mut seen: Vec<Seen> = Vec::new();
    let mut report = ScanReport::default();
    walk(t, None, &mut seen, &mut report).map_err(|source| ScanError::Root {
        path: t.store.root().display().to_string(),
        source,
    })?;
    let lk = Lookup {
        journal: None,
        folder: t.folder,
    };
    diff(t, &lk, HashMap::new(), seen, report, Some(emit))
}

/// Walks the subtree at `dir` (the folder root when `None`), adding every entry below it to
/// `seen`. An unreadable root is an error; an unreadable directory below it is skipped with a
/// warning. Once several directories are waiting to be read, they are read on every core: with
/// the cache cold, an unchanged tree's scan is the kernel reading inodes, one thread's worth of
/// CPU per directory.
fn walk(
    t: &ScanTarget<'_>,
    dir: Option<&RelPath>,
    seen: &mut Vec<Seen>,
    report: &mut ScanReport,
) -> std::io::Result<()> {
    let before = seen.len();
    let mut dirs = Vec::new();
    read_dir_into(t, dir, seen, &mut dirs)?;
    while dirs.len() == 1 {
        let d = dirs.pop();
        let _ = read_dir_into(t, d.as_ref(), seen, &mut dirs);
    }
    if !dirs.is_empty() {
        walk_parallel(t, dirs, seen);
    }
    report.entries += (seen.len() - before) as u64;
    Ok(())
}

/// Directories waiting to be read, and how many threads are reading one (and may add more).
struct WalkQueue {
    dirs: Vec<RelPath>,
    busy: usize,
}

/// Threads that walk a tree: beyond the cores, a few more keep the disk busy while a thread
/// waits for an inode.
const WALK_THREADS: usize = 4;

fn walk_parallel(t: &ScanTarget<'_>, dirs: Vec<RelPath>, seen: &mut Vec<Seen>) {
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .clamp(2, WALK_THREADS)
        .min(dirs.len());
    let queue = std::sync::Mutex::new(WalkQueue { dirs, busy: 0 });
    let wake = std::sync::Condvar::new();
    let parts: Vec<Vec<Seen>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|_| s.spawn(|| walk_worker(t, &queue, &wake)))
            .collect();
        workers.into_iter().filter_map(|w| w.join().ok()).collect()
    });
    for part in parts {
        seen.extend(part);
    }
}

/// One walking thread: takes a directory, reads it, queues its subdirectories, until no
/// directory is waiting and no other thread is reading one.
fn walk_worker(
    t: &ScanTarget<'_>,
    queue: &std::sync::Mutex<WalkQueue>,
    wake: &std::sync::Condvar,
) -> Vec<Seen> {
    let mut seen = Vec::new();
    let mut found = Vec::new();
    let Ok(mut q) = queue.lock() else {
        return seen;
    };
    loop {
        if let Some(d) = q.dirs.pop() {
            q.busy += 1;
            drop(q);
            let _ = read_dir_into(t, Some(&d), &mut seen, &mut found);
            q = match queue.lock() {
                Ok(q) => q,
                Err(_) => return seen,
            };
            q.busy -= 1;
            let more = !found.is_empty();
            q.dirs.append(&mut found);
            if more || q.busy == 0 {
                wake.notify_all();
            }
        } else if q.busy == 0 {
            return seen;
        } else {
            q = match wake.wait(q) {
                Ok(q) => q,
                Err(_) => return seen,
            };
        }
    }
}

/// Reads one directory (the folder root when `dir` is `None`): adds its entries to `seen` and
/// its subdirectories to `dirs`. Only the root's failure to open is returned; any other
/// directory that cannot be read is skipped with a warning.
fn read_dir_into(
    t: &ScanTarget<'_>,
    dir: Option<&RelPath>,
    seen: &mut Vec<Seen>,
    dirs: &mut Vec<RelPath>,
) -> std::io::Result<()> {
    let abs = match dir {
        Some(p) => t.store.root().join(p.as_str()),
        None => t.store.root().to_path_buf(),
    };
    let rd = match std::fs::read_dir(&abs) {
        Ok(rd) => rd,
        Err(e) if dir.is_none() => return Err(e),
        Err(e) => {
            tracing::warn!(path = %abs.display(), error = %e, "cannot read directory; skipped");
            return Ok(());
        }
    };
    for entry in rd.flatten() {
        let name = entry.file_name();
        let bytes = name.as_bytes();
        if bytes.starts_with(INTERNAL_PREFIX.as_bytes()) {
            continue;
        }
        let Ok(name) = std::str::from_utf8(bytes) else {
            tracing::warn!(path = %entry.path().display(), "file name is not UTF-8; not replicated");
            continue;
        };
        let rel = match dir {
            Some(p) => p.join(name),
            None => RelPath::new(name),
        };
        let rel = match rel {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(path = %entry.path().display(), error = %e, "not replicated");
                continue;
            }
        };
        let st = match lstat(&entry.path()) {
            Ok(st) => stat_of(&st),
            Err(_) => continue,
        };
        let Some(kind) = st.kind else {
            tracing::warn!(path = %entry.path().display(), "special file (fifo, socket or device); not replicated");
            continue;
        };
        if t.ignore.is_ignored(&rel, kind == FileKind::Dir) {
            continue;
        }
        if kind == FileKind::Dir {
            dirs.push(rel.clone());
        }
        seen.push(Seen {
            path: rel,
            kind,
            local: st.local,
            nlink: st.nlink,
        });
    }
    Ok(())
}

fn lstat(p: &Path) -> std::io::Result<libc::stat> {
    let c = std::ffi::CString::new(p.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    sys::fstatat(sys::cwd(), &c, libc::AT_SYMLINK_NOFOLLOW)
}

/// A file whose content must be read.
struct HashJob {
    path: RelPath,
    local: LocalStat,
    prev: Option<Known>,
}

/// Creations first: directories parent-first, then the rest by depth and path.
fn sort_creates(creates: &mut [Change]) {
    creates.sort_by_key(|c| {
        (
            c.record.kind != FileKind::Dir,
            c.record.path.components().count(),
            c.record.path.clone(),
        )
    });
}

/// Compares what the walk saw with what the journal knows. With `emit`, creations are handed
/// over in slices as they are found (see [`scan_new`]) instead of returned.
fn diff(
    t: &ScanTarget<'_>,
    lk: &Lookup<'_>,
    mut known: HashMap<RelPath, Known>,
    seen: Vec<Seen>,
    report: ScanReport,
    emit: Option<&mut Emit<'_>>,
) -> Result<ScanReport, ScanError> {
    let mut d = Diff {
        t,
        lk,
        ctx: Context {
            local_device: t.local,
            now_secs: t.now_secs,
        },
        creates: Vec::new(),
        jobs: Vec::new(),
        new_files: Vec::new(),
        vanished: Vec::new(),
        report,
    };
    for s in seen {
        let prev = known.remove(&s.path);
        match s.kind {
            FileKind::File => d.file(s, prev),
            FileKind::Dir => d.dir(s, prev),
            FileKind::Symlink => d.symlink(s, prev),
        }
    }
    // Whatever the journal knows as live but the disk no longer has: deleted (or renamed).
    let mut vanished: Vec<Known> = known.into_values().filter(|k| !k.s.deleted).collect();
    d.renames(&vanished);
    d.vanished = vanished
        .iter()
        .filter(|k| k.s.kind == FileKind::File)
        .cloned()
        .collect();
    // Hash what must be hashed, on every core. Streamed, a slice at a time after what needs no
    // reading, and one slice ahead: the next slice is read while this one is journaled and
    // handed over.
    match emit {
        None => d.hash(),
        Some(emit) => d.hash_streamed(emit)?,
    }
    sort_creates(&mut d.creates);
    vanished.sort_by_key(|k| std::cmp::Reverse((k.s.path.components().count(), k.s.path.clone())));
    let deletes = d.deletions(vanished);
    let mut report = d.report;
    // The deletions below a path that is now a file or a symlink go first: a peer that gets
    // the new file before those deletions keeps the directory for them, and the file is lost
    // to the directory's newer version (`sync::pipeline::order` does the same with a batch).
    let replaced: Vec<&RelPath> = d
        .creates
        .iter()
        .filter(|c| !c.record.deleted && c.record.kind != FileKind::Dir)
        .map(|c| &c.record.path)
        .collect();
    let (first, later): (Vec<Change>, Vec<Change>) = deletes.into_iter().partition(|c| {
        replaced
            .iter()
            .any(|d| c.record.path.is_within(d) && c.record.path != **d)
    });
    report.changes = first;
    report.changes.extend(d.creates);
    report.changes.extend(later);
    Ok(report)
}

/// A [`diff`] under way: what it compares with, and what it has found so far.
struct Diff<'a> {
    t: &'a ScanTarget<'a>,
    lk: &'a Lookup<'a>,
    ctx: Context,
    /// New versions, deletions aside.
    creates: Vec<Change>,
    /// Files whose content must be read.
    jobs: Vec<HashJob>,
    /// New files, with the tombstone at their path if there is one: a version made there must
    /// dominate it, or peers that hold the tombstone take the new file for an older version.
    new_files: Vec<(RelPath, LocalStat, Option<Known>)>,
    /// The files that vanished in this scan: where a placeholder renamed over another file
    /// came from ([`placeholder_content`]).
    vanished: Vec<Known>,
    report: ScanReport,
}

impl Diff<'_> {
    /// A file seen on disk, against what the journal knows at its path.
    fn file(&mut self, s: Seen, prev: Option<Known>) {
        if s.nlink > 1 {
            self.report.linked.push(s.path.clone());
        }
        let live_prev = prev.as_ref().filter(|k| !k.s.deleted);
        match live_prev {
            Some(k) if k.s.kind == FileKind::File => {
                let l = k.s.local.unwrap_or_default();
                if l.inode == s.local.inode
                    && l.size == s.local.size
                    && l.mtime_ns == s.local.mtime_ns
                {
                    if !self
                        .t
                        .store
                        .same_mode(k.s.mode, s.local.mode, FileKind::File)
                    {
                        let Some(mut r) = self.lk.full(k) else { return };
                        r.mode = s.local.mode;
                        self.creates.push(version(
                            &self.ctx,
                            self.lk.full_of(prev.as_ref()).as_ref(),
                            r,
                            Op::Metadata,
                            s.local,
                            None,
                        ));
                    } else if l != s.local {
                        self.report.restat.push((s.path.clone(), s.local));
                    }
                    return;
                }
                // A new inode is read even with the old size and mtime: two files of one size
                // written in the same clock tick share an mtime, and one renamed over the
                // other looks unchanged but is not. The same content (a restore by a copy
                // keeping the times) is still no version (`add_hashed`).
                self.jobs.push(HashJob {
                    path: s.path,
                    local: s.local,
                    prev,
                });
            }
            _ => self.new_files.push((s.path, s.local, prev)),
        }
    }

    /// A directory seen on disk, against what the journal knows at its path.
    fn dir(&mut self, s: Seen, prev: Option<Known>) {
        let live_prev = prev.as_ref().filter(|k| !k.s.deleted);
        let changed = match live_prev {
            Some(k) if k.s.kind == FileKind::Dir => {
                !self
                    .t
                    .store
                    .same_mode(k.s.mode, s.local.mode, FileKind::Dir)
            }
            _ => true,
        };
        if changed {
            let op = if live_prev.is_some_and(|k| k.s.kind == FileKind::Dir) {
                Op::Metadata
            } else {
                Op::Create
            };
            let r = base_record(&s.path, FileKind::Dir, &s.local, &self.ctx);
            self.creates.push(version(
                &self.ctx,
                self.lk.full_of(prev.as_ref()).as_ref(),
                r,
                op,
                s.local,
                None,
            ));
        } else if live_prev.is_some_and(|k| k.s.local != Some(s.local)) {
            self.report.restat.push((s.path.clone(), s.local));
        }
    }

    /// A symlink seen on disk, against what the journal knows at its path.
    fn symlink(&mut self, s: Seen, prev: Option<Known>) {
        let live_prev = prev.as_ref().filter(|k| !k.s.deleted);
        let target = match self.t.store.read_link(&s.path) {
            Ok(x) if !x.is_empty() && !x.contains('\0') => x,
            _ => {
                tracing::warn!(path = %s.path, "symlink target unreadable or not UTF-8; not replicated");
                return;
            }
        };
        if let Some(k) = live_prev
            .filter(|k| k.s.kind == FileKind::Symlink && k.s.hash == Hash::of(target.as_bytes()))
        {
            if k.s.local != Some(s.local) {
                self.report.restat.push((s.path.clone(), s.local));
            }
            return;
        }
        let op = if live_prev.is_some() {
            Op::Modify
        } else {
            Op::Create
        };
        let mut r = base_record(&s.path, FileKind::Symlink, &s.local, &self.ctx);
        r.hash = Hash::of(target.as_bytes());
        r.target = target;
        r.mode = 0o777;
        self.creates.push(version(
            &self.ctx,
            self.lk.full_of(prev.as_ref()).as_ref(),
            r,
            op,
            s.local,
            None,
        ));
    }

    /// Rename detection: a new file with the (inode, size, mtime) of a vanished file. The
    /// other new files are to be hashed.
    fn renames(&mut self, vanished: &[Known]) {
        // The walk's order depends on its threads: sorted, a rename is found the same way every
        // time, and a first scan hashes (and announces) a directory's files together.
        let mut new_files = std::mem::take(&mut self.new_files);
        new_files.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut by_inode: HashMap<(u64, u64, i64), usize> = HashMap::new();
        for (i, k) in vanished.iter().enumerate() {
            if let (FileKind::File, Some(l)) = (k.s.kind, k.s.local) {
                by_inode.insert((l.inode, l.size, l.mtime_ns), i);
            }
        }
        for (path, local, tombstone) in new_files {
            let renamed_from = by_inode
                .get(&(local.inode, local.size, local.mtime_ns))
                .and_then(|&i| self.lk.full(&vanished[i]));
            if let Some(old) = renamed_from {
                let mut r = old.clone();
                r.path = path.clone();
                if !self.t.store.same_mode(old.mode, local.mode, FileKind::File) {
                    r.mode = local.mode;
                }
                self.creates.push(version(
                    &self.ctx,
                    self.lk.full_of(tombstone.as_ref()).as_ref(),
                    r,
                    Op::Rename,
                    local,
                    Some(format!("from {}", old.path)),
                ));
                continue;
            }
            self.jobs.push(HashJob {
                path,
                local,
                prev: tombstone,
            });
        }
    }

    /// Hashes every file at once and adds the versions they make.
    fn hash(&mut self) {
        let hashed = hash_all(self.t.store, std::mem::take(&mut self.jobs));
        add_hashed(
            self.lk,
            &self.ctx,
            self.t.store,
            hashed,
            &self.vanished,
            &mut self.creates,
            &mut self.report,
        );
    }

    /// Hands what needs no reading to `emit`, then hashes files a slice at a time, one slice
    /// ahead, handing each slice's versions over as it is done.
    fn hash_streamed(&mut self, emit: &mut Emit<'_>) -> Result<(), ScanError> {
        let jobs = std::mem::take(&mut self.jobs);
        let mut to_hash = jobs.len();
        let mut slices: Vec<Vec<HashJob>> = Vec::new();
        let mut jobs = jobs.into_iter().peekable();
        while jobs.peek().is_some() {
            slices.push(jobs.by_ref().take(FIRST_SCAN_SLICE).collect());
        }
        std::thread::scope(|s| -> Result<(), ScanError> {
            let (tx, rx) = std::sync::mpsc::sync_channel(1);
            let store = self.t.store;
            s.spawn(move || {
                for part in slices {
                    // The receiver is gone when emitting failed: stop reading.
                    if tx.send(hash_all(store, part)).is_err() {
                        break;
                    }
                }
            });
            let mut first = true;
            loop {
                if first || !self.creates.is_empty() {
                    sort_creates(&mut self.creates);
                    emit(std::mem::take(&mut self.creates), to_hash).map_err(ScanError::Commit)?;
                    first = false;
                }
                let Ok(hashed) = rx.recv() else { break };
                to_hash -= hashed.len();
                add_hashed(
                    self.lk,
                    &self.ctx,
                    store,
                    hashed,
                    &self.vanished,
                    &mut self.creates,
                    &mut self.report,
                );
            }
            Ok(())
        })
    }

    /// The deletions of what vanished, in the order given.
    fn deletions(&self, vanished: Vec<Known>) -> Vec<Change> {
        let mut deletes = Vec::with_capacity(vanished.len());
        for k in vanished {
            let Some(full) = self.lk.full(&k) else {
                continue;
            };
            let mut r = full.clone();
            r.deleted = true;
            r.size = 0;
            r.hash = Hash::ZERO;
            r.chunks.clear();
            r.target.clear();
            let mut c = version(
                &self.ctx,
                Some(&full),
                r,
                Op::Delete,
                LocalStat::default(),
                None,
            );
            c.local = None;
            deletes.push(c);
        }
        deletes
    }
}

/// Adds the versions that hashed files make to `creates`; `vanished`: the files that vanished
/// in this scan.
fn add_hashed(
    lk: &Lookup<'_>,
    ctx: &Context,
    store: &Store,
    hashed: Vec<(HashJob, Option<Read>)>,
    vanished: &[Known],
    creates: &mut Vec<Change>,
    report: &mut ScanReport,
) {
    for (job, read) in hashed {
        let content = match read {
            None => None,
            Some(Read::Content(c)) => {
                report.contents.push(job.local.inode);
                report.hashed_files += 1;
                report.hashed_bytes += c.size;
                Some(c)
            }
            Some(Read::Placeholder(hash)) => {
                let c = placeholder_content(lk, &job, hash, vanished);
                match &c {
                    Some(_) => report.placeholders.push(job.local.inode),
                    None => {
                        tracing::warn!(path = %job.path, "a placeholder that stands for no version journaled at its path (its content is not here); left alone, not replicated")
                    }
                }
                c
            }
        };
        let Some(content) = content else {
            report.unread.push(job.path);
            continue;
        };
        let live_prev = job.prev.as_ref().filter(|k| !k.s.deleted);
        if let Some(k) = live_prev {
            if k.s.kind == FileKind::File
                && k.s.hash == content.hash
                && store.same_mode(k.s.mode, job.local.mode, FileKind::File)
                && k.s.mtime_ns == job.local.mtime_ns
            {
                report.restat.push((job.path.clone(), job.local));
                continue;
            }
        }
        let op = match live_prev {
            Some(k) if k.s.kind == FileKind::File && k.s.hash == content.hash => Op::Metadata,
            Some(_) => Op::Modify,
            None => Op::Create,
        };
        let mut r = base_record(&job.path, FileKind::File, &job.local, ctx);
        // A mode the umask made from the record's is not a change: the record's stays.
        if let Some(k) = live_prev.filter(|k| k.s.kind == FileKind::File) {
            if store.same_mode(k.s.mode, job.local.mode, FileKind::File) {
                r.mode = k.s.mode;
            }
        }
        r.size = content.size;
        r.hash = content.hash;
        r.chunks = content.chunks;
        let mut local = job.local;
        local.size = content.size;
        creates.push(version(
            ctx,
            lk.full_of(job.prev.as_ref()).as_ref(),
            r,
            op,
            local,
            None,
        ));
    }
}

/// The content a placeholder at `job.path` stands for: the journal's live file there, when the
/// mark names its hash and the placeholder has its size (a chmod or `touch` of a placeholder, a
/// new inode after an interrupted eviction); else a file with that hash and size that vanished
/// in the same scan (a placeholder renamed over another file). Anything else is not known
/// content (D90).
fn placeholder_content(
    lk: &Lookup<'_>,
    job: &HashJob,
    hash: Hash,
    vanished: &[Known],
) -> Option<chunker::Content> {
    // The record at its path, or else a file that vanished in this scan with that content: a
    // placeholder renamed over another file (an editor's save through the mount) is no new
    // file, so rename detection never sees it; its content is the vanished file's, and the
    // vanished file's deletion goes with it, as for a local file renamed over another.
    let stands_for = |k: &&Known| !k.s.deleted && k.s.kind == FileKind::File && k.s.hash == hash;
    let full = match job.prev.as_ref().filter(stands_for) {
        Some(prev) => lk.full(prev)?,
        None => vanished
            .iter()
            .filter(stands_for)
            .filter_map(|k| lk.full(k))
            .find(|r| r.size == job.local.size)?,
    };
    (full.size == job.local.size).then_some(chunker::Content {
        hash: full.hash,
        size: full.size,
        chunks: full.chunks,
    })
}

fn base_record(path: &RelPath, kind: FileKind, local: &LocalStat, ctx: &Context) -> FileRecord {
    FileRecord {
        path: path.clone(),
        kind,
        deleted: false,
        mode: local.mode,
        mtime_ns: local.mtime_ns,
        size: 0,
        hash: Hash::ZERO,
        chunks: Vec::new(),
        target: String::new(),
        version: Default::default(),
        modified_by: ctx.local_device,
        sequence: 0,
    }
}

fn version(
    ctx: &Context,
    prev: Option<&FileRecord>,
    mut r: FileRecord,
    op: Op,
    local: LocalStat,
    detail: Option<String>,
) -> Change {
    r.version = new_local_version(prev, ctx);
    r.modified_by = ctx.local_device;
    Change {
        record: r,
        op,
        local: Some(local),
        source: None,
        detail,
    }
}

/// Below this average size a set of new files is hashed with [`IO_THREADS`] threads.
const SMALL_FILE_AVG: u64 = 1 << 20;
/// Reads in flight when hashing many small files.
const IO_THREADS: usize = 8;

fn hash_all(store: &Store, jobs: Vec<HashJob>) -> Vec<(HashJob, Option<Read>)> {
    if jobs.is_empty() {
        return Vec::new();
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    // Small files are bound by the disk's latency, not the CPU: with caches cold, keeping
    // several reads in flight is what makes 10,000 small files fast. Large files are bound by
    // hashing (and each thread keeps a window of up to 8 MiB): one thread per core.
    let bytes: u64 = jobs.iter().map(|j| j.local.size).sum();
    let small = bytes / (jobs.len() as u64) < SMALL_FILE_AVG;
    let threads = if small { cores.max(IO_THREADS) } else { cores }.min(jobs.len());
    let jobs = std::sync::Mutex::new(jobs.into_iter().collect::<std::collections::VecDeque<_>>());
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut dirs = DirCache::default();
                loop {
                let job = match jobs.lock() {
                    Ok(mut q) => q.pop_front(),
                    Err(_) => None,
                };
                let Some(job) = job else { break };
                let content = store
                    .open_file_in(&mut dirs, &job.path)
                    .ok()
                    .and_then(|f| {
                        // A placeholder is never read (D90): its bytes are not its content.
                        if let Some(h) = crate::store::placeholder_of(std::os::fd::AsFd::as_fd(&f)) {
                            return Some(Read::Placeholder(h));
                        }
                        // A file written while it is hashed has content the stat taken before
                        // does not describe: no version now (its writer's events bring it
                        // back), rather than a version whose stat a later scan finds changed
                        // and journals again as a metadata change (a version of its own, that
                        // a peer's next version then conflicts with).
                        let (c, kept) = if job.local.size <= crate::store::Fresh::FILE_BYTES {
                            // Small enough to ride its index batch: the bytes read are kept
                            // for it (D113), so the batch need not read the file again.
                            let (c, data) = chunker::chunk_whole(&f, job.local.size).ok()?;
                            (c, Some(data))
                        } else {
                            (chunker::chunk_file(&f, job.local.size).ok()?, None)
                        };
                        let after = sys::fstat(std::os::fd::AsFd::as_fd(&f)).ok()?;
                        let now = crate::store::stat_of(&after).local;
                        if now.size != job.local.size || now.mtime_ns != job.local.mtime_ns {
                            return None;
                        }
                        if let Some(data) = kept.filter(|_| c.chunks.len() == 1) {
                            store.fresh().put(c.hash, data);
                        }
                        Some(Read::Content(c))
                    });
                if content.is_none() {
                    tracing::debug!(path = %job.path, "vanished, unreadable or written while hashing; will be picked up by the next event");
                }
                if let Ok(mut r) = results.lock() {
                    r.push((job, content));
                }
                }
            });
        }
    });
    let mut out = results.into_inner().unwrap_or_default();
    out.sort_by(|a, b| a.0.path.cmp(&b.0.path));
    out
}
