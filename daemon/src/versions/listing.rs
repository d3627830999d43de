//! What `meshfs versions` and the marks of `meshfs journal` show: for a history row, whether
//! its content can be restored from this device. Reads the journal and the vault, both
//! read-only, so the CLI answers beside a running daemon (or without one).

use crate::journal::{HistoryEntry, HistoryQuery, Journal, JournalError};
use crate::vault::Vault;
use meshfs_protocol::{FileKind, FolderId, Hash, RelPath};
use serde::Serialize;
use std::collections::{HashMap, HashSet};

/// Where a version's content is, as far as this device can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Content {
    /// It is what the path holds now.
    Current,
    /// Every chunk is here (the vault, or a live file that shares it): restorable here.
    Kept,
    /// Some chunks are here; the rest must come from a peer that keeps them.
    Partial,
    /// None of it is here; a peer that applied the change may keep it (`restore` asks the
    /// connected peers).
    NotHere,
    /// The journal no longer lists its chunks (pruned): not restorable.
    Pruned,
    /// Nothing to restore: a deletion, or a directory (its entries have versions of their own).
    None,
}

impl Content {
    /// Its name in `--json` and in the text tables.
    pub fn as_str(&self) -> &'static str {
        match self {
            Content::Current => "current",
            Content::Kept => "kept",
            Content::Partial => "partial",
            Content::NotHere => "not_here",
            Content::Pruned => "pruned",
            Content::None => "none",
        }
    }

    /// Whether `restore` can bring it back without a peer.
    pub fn restorable_here(&self) -> bool {
        matches!(self, Content::Current | Content::Kept)
    }
}

/// Tells, row after row, where a version's content is (each (path, hash) looked up once).
pub struct ContentCheck<'a> {
    journal: &'a Journal,
    folder: FolderId,
    vault: InVault<'a>,
    seen: HashMap<(RelPath, Hash), Content>,
}

/// Which chunks the vault holds: all of them read at once (a listing of many rows), or each
/// asked for when a row needs it (a page of a few rows, read again at each change).
enum InVault<'a> {
    All(HashSet<Hash>),
    Ask(Option<&'a Vault>),
}

impl InVault<'_> {
    fn holds(&self, h: &Hash) -> bool {
        match self {
            InVault::All(set) => set.contains(h),
            InVault::Ask(v) => v.is_some_and(|v| {
                v.has(std::slice::from_ref(h))
                    .is_ok_and(|r| r.first() == Some(&true))
            }),
        }
    }
}

impl<'a> ContentCheck<'a> {
    /// A check of `folder` against `journal` and the folder's `vault` (if it has one), whose
    /// chunk list it reads at once.
    pub fn new(journal: &'a Journal, folder: &FolderId, vault: Option<&Vault>) -> Self {
        let in_vault = vault
            .and_then(|v| v.chunk_sizes().ok())
            .map(|c| c.into_iter().map(|(h, _)| h).collect())
            .unwrap_or_default();
        ContentCheck {
            journal,
            folder: folder.clone(),
            vault: InVault::All(in_vault),
            seen: HashMap::new(),
        }
    }

    /// As [`ContentCheck::new`], asking the vault for each chunk a row needs instead (for a
    /// few rows of a large vault).
    pub fn asking(journal: &'a Journal, folder: &FolderId, vault: Option<&'a Vault>) -> Self {
        ContentCheck {
            journal,
            folder: folder.clone(),
            vault: InVault::Ask(vault),
            seen: HashMap::new(),
        }
    }

    /// Where the content of the version `e` names is.
    pub fn of(&mut self, e: &HistoryEntry) -> Result<Content, JournalError> {
        if e.deleted || e.kind == FileKind::Dir {
            return Ok(Content::None);
        }
        let key = (e.path.clone(), e.hash);
        if let Some(c) = self.seen.get(&key) {
            return Ok(*c);
        }
        let c = self.look(e)?;
        self.seen.insert(key, c);
        Ok(c)
    }

    fn look(&self, e: &HistoryEntry) -> Result<Content, JournalError> {
        if let Some(now) = self.journal.get(&self.folder, &e.path)? {
            if !now.record.deleted && now.record.kind == e.kind && now.record.hash == e.hash {
                return Ok(Content::Current);
            }
        }
        let Some(v) = self
            .journal
            .version_with_content(&self.folder, &e.path, &e.hash)?
        else {
            return Ok(Content::Pruned);
        };
        if v.record.kind == FileKind::Symlink {
            return Ok(Content::Kept);
        }
        let mut here = 0;
        for c in &v.record.chunks {
            if self.vault.holds(&c.hash)
                || !self.journal.find_chunk(&self.folder, &c.hash)?.is_empty()
            {
                here += 1;
            }
        }
        Ok(match here {
            _ if here == v.record.chunks.len() => Content::Kept,
            0 => Content::NotHere,
            _ => Content::Partial,
        })
    }
}

/// One version of a path, as `meshfs versions` lists it.
#[derive(Clone, Debug, Serialize)]
pub struct Listed {
    /// The history row (who, when, what).
    #[serde(skip)]
    pub entry: HistoryEntry,
    /// Where its content is.
    pub content: Content,
}

/// `meshfs versions FOLDER PATH`: every version of `path` the journal knows, oldest first,
/// and, when `path` was a directory, the last version of each path that was below it.
pub fn versions(
    journal: &Journal,
    vault: Option<&Vault>,
    folder: &FolderId,
    path: &RelPath,
) -> Result<(Vec<Listed>, Vec<Listed>), JournalError> {
    let rows = journal.history(
        folder,
        &HistoryQuery {
            path: Some(path.clone()),
            ..Default::default()
        },
    )?;
    let mut check = ContentCheck::new(journal, folder, vault);
    let mut own = Vec::new();
    // The last live version of each path below, by path.
    let mut below: std::collections::BTreeMap<RelPath, HistoryEntry> = Default::default();
    for e in rows {
        if &e.path == path {
            let content = check.of(&e)?;
            own.push(Listed { entry: e, content });
        } else if !e.deleted {
            below.insert(e.path.clone(), e);
        }
    }
    let below = below
        .into_values()
        .map(|e| {
            let content = check.of(&e)?;
            Ok(Listed { entry: e, content })
        })
        .collect::<Result<Vec<_>, JournalError>>()?;
    Ok((own, below))
}
