//! Conflict siblings that still exist: what `meshfs conflicts` and `status` report.
//!
//! A conflict sibling is an ordinary replicated file whose name carries
//! `.sync-conflict-YYYYMMDD-HHMMSS-SHORTID`; deleting it is an ordinary change that propagates.

use crate::journal::{HistoryQuery, Journal, Op};
use meshfs_protocol::{FileRecord, FolderId, RelPath};

/// The marker in a conflict sibling's name.
pub const MARKER: &str = crate::journal::CONFLICT_MARKER;

/// One existing conflict sibling.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ConflictFile {
    /// The sibling's path.
    pub path: String,
    /// The path it belongs to (the name without the marker).
    pub original: String,
    /// Size of the sibling (the losing version).
    pub size: u64,
    /// The losing version's author (short id, from the name).
    pub loser_device: String,
    /// The losing version's mtime, from the name (UTC `YYYYMMDD-HHMMSS`).
    pub loser_time: String,
    /// The winning version now at `original`, if it exists: its author.
    pub winner_device: Option<String>,
    /// The winning version's mtime (ns).
    pub winner_mtime_ns: Option<i64>,
    /// The winning version's size.
    pub winner_size: Option<u64>,
    /// When this device journaled the sibling (ns), from history.
    pub recorded_ns: Option<i64>,
}

/// Splits `name.sync-conflict-DATE-TIME-ID[-HASH].ext` into (original name, time, device).
pub fn parse_name(name: &str) -> Option<(String, String, String)> {
    let i = name.find(MARKER)?;
    let stem = &name[..i];
    let rest = &name[i + MARKER.len()..];
    let (tag, ext) = match rest.find('.') {
        Some(d) => (&rest[..d], &rest[d..]),
        None => (rest, ""),
    };
    let parts: Vec<&str> = tag.split('-').collect();
    if parts.len() < 3 {
        return None;
    }
    Some((
        format!("{stem}{ext}"),
        format!("{}-{}", parts[0], parts[1]),
        parts[2].to_string(),
    ))
}

/// The records of live conflict siblings (SQLite filters the paths through a partial index;
/// the marker may also sit in a directory's name, and only the file name counts).
fn siblings(journal: &Journal, folder: &FolderId) -> impl Iterator<Item = FileRecord> {
    journal
        .conflict_records(folder)
        .unwrap_or_default()
        .into_iter()
        .map(|s| s.record)
        .filter(|r| is_conflict(&r.path))
}

/// Every live conflict sibling in `folder`.
pub fn list(journal: &Journal, folder: &FolderId) -> Vec<ConflictFile> {
    siblings(journal, folder)
        .filter_map(|r| {
            let (orig_name, time, dev) = parse_name(r.path.file_name())?;
            let original = r.path.with_file_name(&orig_name).ok()?;
            let winner = journal
                .get(folder, &original)
                .ok()
                .flatten()
                .filter(|w| !w.record.deleted);
            let recorded = journal
                .history(
                    folder,
                    &HistoryQuery {
                        path: Some(r.path.clone()),
                        limit: Some(8),
                        ..Default::default()
                    },
                )
                .ok()
                .and_then(|h| {
                    h.into_iter()
                        .rev()
                        .find(|e| e.op == Op::Conflict || e.op == Op::Create)
                        .map(|e| e.time_ns)
                });
            Some(ConflictFile {
                path: r.path.to_string(),
                original: original.to_string(),
                size: r.size,
                loser_device: dev,
                loser_time: time,
                winner_device: winner.as_ref().map(|w| w.record.modified_by.display7()),
                winner_mtime_ns: winner.as_ref().map(|w| w.record.mtime_ns),
                winner_size: winner.as_ref().map(|w| w.record.size),
                recorded_ns: recorded,
            })
        })
        .collect()
}

/// How many conflict siblings exist in `folder`: cheap enough for every `status` call.
pub fn count(journal: &Journal, folder: &FolderId) -> usize {
    siblings(journal, folder).count()
}

/// Whether a path is a conflict sibling.
pub fn is_conflict(path: &RelPath) -> bool {
    path.file_name().contains(MARKER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        let (o, t, d) = parse_name("report.sync-conflict-20261122-141503-ABCDEF1.txt").unwrap();
        assert_eq!(
            (o.as_str(), t.as_str(), d.as_str()),
            ("report.txt", "20261122-141503", "ABCDEF1")
        );
        let (o, _, _) =
            parse_name("Makefile.sync-conflict-20261122-141503-ABCDEF1-0a1b2c3d").unwrap();
        assert_eq!(o, "Makefile");
        assert!(parse_name("plain.txt").is_none());
    }
}
