//! Steps 4–6: under the folder's lock, journal the assembled versions as pending, rename
//! each temp file over a target that still holds what the journal expects, fsync the touched
//! directories once, and commit. And the start-up half: completing installs a crash
//! interrupted ([`recover_pending`]).

use super::transfer::{seen_of, skip_or_fail, ApplyError, Meta};
use crate::failpoint;
use crate::folder::{FolderError, FolderRt, Folders};
use crate::journal::{Change, Journal, Op};
use crate::store::{placeholder_of, DirCache, Expect, LocalStat, StoreError, TempFile};
use meshfs_protocol::{DeviceId, FileKind, FileRecord, FolderId};
use std::os::fd::AsFd;

pub(super) fn install(
    folders: &Folders,
    rt: &FolderRt,
    folder: &FolderId,
    peer: DeviceId,
    dirs: &mut DirCache,
    ready: Vec<(Meta, TempFile)>,
) -> Result<Vec<FileRecord>, ApplyError> {
    let _guard = rt
        .op_lock
        .lock()
        .map_err(|_| FolderError::Poisoned("folder"))?;
    let mut journal = folders.journal()?;
    let t0 = std::time::Instant::now();
    let pending: Vec<(FileRecord, Option<DeviceId>)> = ready
        .iter()
        .map(|(t, _)| (t.record.clone(), t.source))
        .collect();
    journal.put_pending(folder, &pending)?;
    let pending_at = t0.elapsed();
    // Re-read expectations now that the lock is held again: a scan may have run meanwhile. An
    // expectation that moved is turned into one no file can meet, so that path is redone.
    journal.begin_reads();
    let (meta, batch): (Vec<Meta>, Vec<(TempFile, Expect)>) = ready
        .into_iter()
        .map(|(t, temp)| {
            let stored = journal.get(folder, &t.record.path).ok().flatten();
            let (expect, basis) = seen_of(stored.as_ref());
            let same = expect == t.expect && basis == t.basis;
            // A file open for writing through the mount is never replaced under its writer:
            // the remote version waits (it is decided again after the writer's release).
            let e = if same && !rt.writers.has_writer(&t.record.path) {
                t.expect
            } else {
                Expect::Matches(LocalStat {
                    inode: u64::MAX,
                    ..Default::default()
                })
            };
            (t, (temp, e))
        })
        .unzip();
    journal.end_reads();
    // The links and directory syncs need the folder lock, not the journal: others (a
    // session acknowledging, reading its next batch, `status`) use it meanwhile.
    drop(journal);
    let reread_at = t0.elapsed();
    // The watcher's event for a file can come as soon as it is in place: its echo is
    // expected from then on, not after the whole batch (else the event, seen first, is
    // rescanned, waiting for this lock). The mount shows it from then on too: the
    // invalidation is only queued (the notifier thread calls the kernel), and the reader in
    // the mount need not wait for the batch's directory fsyncs and commit.
    let results = rt.store.install_synced_in(dirs, batch, &|path, local| {
        rt.echoes.expect(path.clone(), Some(*local));
        rt.invalidator.invalidate(path);
    });
    let renamed_at = t0.elapsed();
    let mut journal = folders.journal()?;
    let mut changes = Vec::new();
    let mut redo = Vec::new();
    let mut busy = Vec::new();
    let mut cleared = Vec::new();
    // Placeholders installed (D91), and whether content arrived (the budget is checked, D93).
    let mut absent = Vec::new();
    let mut arrived = false;
    for (t, r) in meta.into_iter().zip(results) {
        match r {
            Ok(local) => {
                rt.unskip(&t.record.path);
                if t.placeholder {
                    absent.push(local.inode);
                } else {
                    arrived = true;
                }
                changes.push(Change {
                    record: t.record,
                    op: t.op,
                    local: Some(local),
                    source: t.source,
                    detail: t.detail,
                });
                // The decision's changes that waited for this file go ahead only if their
                // paths still hold what it saw: a local edit or another batch may have
                // journaled a newer version meanwhile, which they would overwrite (losing it:
                // `tests/chaos.rs` seeds 13 and 30 on 3 devices). Else the remote record is
                // decided again; the sibling just installed is what it would keep.
                let mut fresh = true;
                for (c, basis) in &t.then {
                    let now = journal
                        .get(folder, &c.record.path)?
                        .map(|s| s.record.version);
                    fresh &= now == *basis;
                }
                if fresh {
                    changes.extend(t.then.into_iter().map(|(c, _)| c));
                } else {
                    tracing::debug!(%folder, path = %t.remote.path, "changed while its sibling was fetched; decided again");
                    redo.push(t.remote);
                }
            }
            // A directory the file goes into that is gone since its decision (a local `rm -r`)
            // is a changed target too: decided again, it is revived or meets the deletion.
            Err(StoreError::Changed(_)) => {
                tracing::debug!(%folder, path = %t.record.path, "changed before its install; decided again");
                cleared.push(t.record.path.clone());
                redo.push(t.remote);
            }
            Err(StoreError::Io { source, .. }) if source.raw_os_error() == Some(libc::ENOENT) => {
                tracing::debug!(%folder, path = %t.record.path, "its directory is gone; decided again");
                cleared.push(t.record.path.clone());
                redo.push(t.remote);
            }
            // Another program has the file open for writing: the version waits for it, as it
            // does for a writer through the mount (decided again once the writer is gone).
            Err(StoreError::Busy(_)) => {
                cleared.push(t.record.path.clone());
                busy.push(t.remote);
            }
            Err(e) => {
                cleared.push(t.record.path.clone());
                skip_or_fail(rt, &t.remote, e)?;
            }
        }
    }
    journal.clear_pending(folder, &cleared)?;
    for remote in busy {
        tracing::info!(%folder, path = %remote.path, "open for writing by another program; the remote version waits for it");
        journal.put_deferred(folder, &remote, &peer)?;
        rt.defer(remote, peer, crate::folder::Wait::Writer);
    }
    let files = changes.len();
    let touched_ignore = changes
        .iter()
        .any(|c| c.record.path.as_str() == crate::ignore::IGNORE_FILE);
    journal.commit_absent(folder, changes, &absent)?;
    failpoint::hit("apply.installed", "");
    if rt.policy().on_demand {
        rt.demand.changed();
        if arrived {
            rt.demand.arrived.notify_one();
        }
    }
    if touched_ignore {
        // A new shared ignore file: its rules apply from the next decision on (read once the
        // locks are let go; one that does not compile keeps the older shared rules).
        drop(journal);
        drop(_guard);
        folders.reload_ignore(rt);
    }
    if files >= 100 {
        tracing::debug!(%folder, files, pending_ms = pending_at.as_millis() as u64,
            reread_ms = (reread_at - pending_at).as_millis() as u64,
            rename_ms = (renamed_at - reread_at).as_millis() as u64,
            commit_ms = (t0.elapsed() - renamed_at).as_millis() as u64, "batch installed");
    }
    Ok(redo)
}

/// Completes applies interrupted between steps 4 and 6: a file that already holds the pending
/// content becomes that remote version; any other pending row is dropped (the peer sends the
/// record again, since it was never acknowledged).
pub fn recover_pending(
    journal: &mut Journal,
    rt: &FolderRt,
    folder: &FolderId,
) -> Result<usize, ApplyError> {
    let pending = journal.pending(folder)?;
    let mut done = Vec::new();
    let mut dropped = Vec::new();
    let mut absent = Vec::new();
    for (record, source) in pending {
        let ok = match rt.store.stat(&record.path) {
            Ok(Some(st)) if record.deleted || st.kind != Some(record.kind) => None,
            Ok(Some(st)) if record.kind == FileKind::Dir => Some(st.local),
            Ok(Some(st)) if record.kind == FileKind::Symlink => rt
                .store
                .read_link(&record.path)
                .ok()
                .filter(|t| *t == record.target)
                .map(|_| st.local),
            Ok(Some(st)) if st.local.size == record.size => {
                let f = rt.store.open_file(&record.path).ok();
                match f.as_ref().map(|f| placeholder_of(f.as_fd())) {
                    // A placeholder of this very version (D91): installed, its content online.
                    Some(Some(mark)) => (mark == record.hash).then(|| {
                        absent.push(st.local.inode);
                        st.local
                    }),
                    Some(None) => f
                        .and_then(|f| crate::chunker::chunk_file(&f, record.size).ok())
                        .filter(|c| c.hash == record.hash)
                        .map(|_| st.local),
                    None => None,
                }
            }
            _ => None,
        };
        match ok {
            Some(local) => done.push(Change {
                op: Op::Modify,
                local: Some(local),
                source,
                detail: Some("completed after restart".into()),
                record,
            }),
            None => dropped.push(record.path),
        }
    }
    let n = done.len();
    journal.clear_pending(folder, &dropped)?;
    journal.commit_absent(folder, done, &absent)?;
    Ok(n)
}
