//! Which write-ahead log belongs to this journal: SQLite replays whatever WAL file lies under
//! `journal.db-wal`, so a log copied from another journal (or left by one that was replaced)
//! would merge another database's pages into ours. This module reads the WAL file (SQLite's
//! documented format: <https://www.sqlite.org/fileformat2.html#walformat>) and keeps the note
//! beside the database (`journal.db-meshfs-wal`) that says which logs are ours.
//!
//! **What it owns.** The WAL's header and frames as bytes on disk (never through SQLite), the
//! note's format and its durable writes, and the rule [`check`].
//!
//! **What it never does.** It never writes the WAL or the database, and never opens SQLite:
//! the journal (`journal.rs`) decides when to note what, in the order written there.
//!
//! # The rule
//!
//! A WAL is 32 bytes of header (magic, format, page size, checkpoint sequence, salt-1, salt-2,
//! checksum) and frames, each a page image behind 24 bytes (page number, database size for a
//! commit frame, the two salts, a running checksum). A frame counts only if its salts are the
//! header's and its checksum follows the one before; a transaction counts only up to its commit
//! frame. The salts change each time the log starts again: after a checkpoint that copied all of
//! it, salt-1 goes up by one and salt-2 is drawn anew; a log started from nothing (no WAL file,
//! or an empty one, as after a clean close) gets two random salts.
//!
//! The note holds the salts of our log as last seen and a **mark**: 16 random bytes that the
//! journal writes into its own `wal_mark` table right after noting them. A log is ours if
//!
//! 1. it holds no committed frame (SQLite replays nothing from it), or
//! 2. its salts are the noted ones, or salt-1 is at most [`RESTARTS_AHEAD`] above the noted one
//!    (restarts after the note: each is noted after the commit that began it), or
//! 3. a committed frame holds the noted mark: a log started from nothing after the note, whose
//!    random salts nobody could have noted first, but whose first transaction was our marking
//!    write — or later ones, whatever started it.
//!
//! No note at all (a new journal, or one upgraded from before the note) accepts any log.
//!
//! A log from another journal holds neither our salts (64 random bits) nor our mark (128).

use std::fs::File;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

/// How many restarts after the noted salts a log may be. Each restart is noted after the
/// commit that began it, so a crash leaves the note one behind at most; the rest is room for
/// notes that failed to be written (a full disk) without a crash in between.
pub(super) const RESTARTS_AHEAD: u32 = 4;

const WAL_MAGIC: u32 = 0x377f_0682;
const WAL_FORMAT: u32 = 3_007_000;
const HEADER: usize = 32;
const FRAME_HEADER: usize = 24;
/// Length of a mark.
pub(super) const MARK_LEN: usize = 16;

/// The WAL file of `db`.
pub(super) fn wal_path(db: &Path) -> PathBuf {
    PathBuf::from(format!("{}-wal", db.display()))
}

/// The note beside `db`.
pub(super) fn note_path(db: &Path) -> PathBuf {
    PathBuf::from(format!("{}-meshfs-wal", db.display()))
}

/// A WAL header that SQLite would accept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    /// Salt-1 and salt-2 as stored (big-endian).
    pub salts: [u8; 8],
    page_size: usize,
    big_endian: bool,
    checksum: [u32; 2],
}

fn be32(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

/// SQLite's WAL checksum of `data` (a multiple of 8 bytes), continuing from `s`.
fn checksum(big_endian: bool, data: &[u8], mut s: [u32; 2]) -> [u32; 2] {
    for c in data.chunks_exact(8) {
        let (x0, x1) = if big_endian {
            (be32(&c[0..4]), be32(&c[4..8]))
        } else {
            (
                u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
            )
        };
        s[0] = s[0].wrapping_add(x0).wrapping_add(s[1]);
        s[1] = s[1].wrapping_add(x1).wrapping_add(s[0]);
    }
    s
}

/// The header in `h`, if SQLite would read frames after it (magic, page size, checksum and
/// format right).
pub(super) fn parse_header(h: &[u8]) -> Option<Header> {
    if h.len() < HEADER {
        return None;
    }
    let magic = be32(&h[0..4]);
    if magic & !1 != WAL_MAGIC || be32(&h[4..8]) != WAL_FORMAT {
        return None;
    }
    let page_size = be32(&h[8..12]) as usize;
    if !(512..=65536).contains(&page_size) || !page_size.is_power_of_two() {
        return None;
    }
    let big_endian = magic & 1 == 1;
    let sum = checksum(big_endian, &h[..24], [0, 0]);
    if sum != [be32(&h[24..28]), be32(&h[28..32])] {
        return None;
    }
    let mut salts = [0u8; 8];
    salts.copy_from_slice(&h[16..24]);
    Some(Header {
        salts,
        page_size,
        big_endian,
        checksum: sum,
    })
}

/// The header of `db`'s WAL, if it has a valid one.
pub(super) fn header(db: &Path) -> Option<Header> {
    let mut f = File::open(wal_path(db)).ok()?;
    let mut h = [0u8; HEADER];
    f.read_exact(&mut h).ok()?;
    parse_header(&h)
}

/// What the valid frames of a WAL hold.
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct Content {
    /// At least one transaction is committed in it: SQLite would replay something.
    pub committed: bool,
    /// A committed transaction's pages hold the mark looked for.
    pub holds_mark: bool,
}

/// Reads the frames after `header` from `r` (positioned after the header) as SQLite's
/// recovery does, up to the first frame that does not follow, looking for `mark` in the
/// committed ones.
pub(super) fn scan(r: &mut impl Read, header: &Header, mark: Option<&[u8; MARK_LEN]>) -> Content {
    let mut out = Content::default();
    let mut frame = vec![0u8; FRAME_HEADER + header.page_size];
    let mut sum = header.checksum;
    let mut mark_in_open_transaction = false;
    while r.read_exact(&mut frame).is_ok() {
        let (fh, page) = frame.split_at(FRAME_HEADER);
        if be32(&fh[0..4]) == 0 || fh[8..16] != header.salts {
            break;
        }
        sum = checksum(header.big_endian, &fh[..8], sum);
        sum = checksum(header.big_endian, page, sum);
        if sum != [be32(&fh[16..20]), be32(&fh[20..24])] {
            break;
        }
        if let Some(m) = mark {
            mark_in_open_transaction |= page.windows(MARK_LEN).any(|w| w == m);
        }
        if be32(&fh[4..8]) != 0 {
            out.committed = true;
            out.holds_mark |= mark_in_open_transaction;
            mark_in_open_transaction = false;
        }
    }
    out
}

/// What the note beside the database records.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Note {
    /// The salts of our log as last seen.
    pub salts: Option<[u8; 8]>,
    /// The mark our journal writes (or wrote) into `wal_mark` after this note.
    pub mark: Option<[u8; MARK_LEN]>,
}

impl Note {
    /// 8 bytes of salts and 16 of mark, zeros for none (a note of meshfs before marks is the
    /// 8 bytes of salts alone).
    fn encode(&self) -> [u8; 8 + MARK_LEN] {
        let mut b = [0u8; 8 + MARK_LEN];
        if let Some(s) = self.salts {
            b[..8].copy_from_slice(&s);
        }
        if let Some(m) = self.mark {
            b[8..].copy_from_slice(&m);
        }
        b
    }

    fn decode(b: &[u8]) -> Option<Note> {
        let some = |v: &[u8]| v.iter().any(|&x| x != 0);
        match b.len() {
            8 => Some(Note {
                salts: Some(b.try_into().ok()?),
                mark: None,
            }),
            24 => Some(Note {
                salts: some(&b[..8]).then(|| b[..8].try_into().ok()).flatten(),
                mark: some(&b[8..]).then(|| b[8..].try_into().ok()).flatten(),
            }),
            _ => None,
        }
    }
}

/// The note beside `db`, if there is one in a known format.
pub(super) fn read_note(db: &Path) -> Option<Note> {
    Note::decode(&std::fs::read(note_path(db)).ok()?)
}

fn sync_dir(db: &Path) -> io::Result<()> {
    let dir = match db.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir)?.sync_all()
}

/// Writes `note` beside `db` durably: a temp file written and synced, renamed over the note,
/// the directory synced. A crash at any point leaves the old note or the new one. `step` names
/// the caller's step for the failpoints (`journal.note.synced@STEP`).
pub(super) fn write_note(db: &Path, note: &Note, step: &str) -> io::Result<()> {
    let path = note_path(db);
    let tmp = PathBuf::from(format!("{}.tmp", path.display()));
    {
        let mut f = File::create(&tmp)?;
        f.write_all(&note.encode())?;
        f.sync_all()?;
    }
    crate::failpoint::hit("journal.note.synced", step);
    std::fs::rename(&tmp, &path)?;
    crate::failpoint::hit("journal.note.renamed", step);
    sync_dir(db)
}

/// Removes the note beside `db` durably (nothing to do if there is none).
pub(super) fn remove_note(db: &Path) -> io::Result<()> {
    match std::fs::remove_file(note_path(db)) {
        Ok(()) => sync_dir(db),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether salt-1 of `wal` is 1 to [`RESTARTS_AHEAD`] restarts after `noted`'s.
fn restarted_since(noted: &[u8; 8], wal: &[u8; 8]) -> bool {
    let d = be32(&wal[0..4]).wrapping_sub(be32(&noted[0..4]));
    (1..=RESTARTS_AHEAD).contains(&d)
}

/// Whether `db`'s WAL is this journal's (the rule in the module documentation); `Err` says why
/// not.
pub(super) fn check(db: &Path) -> Result<(), String> {
    let Ok(mut f) = File::open(wal_path(db)) else {
        return Ok(());
    };
    let mut h = [0u8; HEADER];
    if f.read_exact(&mut h).is_err() {
        return Ok(());
    }
    // A header SQLite would not read frames after: nothing of the file is replayed.
    let Some(header) = parse_header(&h) else {
        return Ok(());
    };
    let Some(note) = read_note(db) else {
        return Ok(());
    };
    if let Some(noted) = &note.salts {
        if *noted == header.salts || restarted_since(noted, &header.salts) {
            return Ok(());
        }
    }
    let content = scan(&mut io::BufReader::new(f), &header, note.mark.as_ref());
    if !content.committed || content.holds_mark {
        return Ok(());
    }
    Err(format!(
        "its write-ahead log {} belongs to another database (neither its salts nor its content are this journal's)",
        wal_path(db).display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A WAL of `pages` (page number, content byte, commit) with `salts`, as SQLite writes it.
    fn wal(salts: [u8; 8], page_size: usize, frames: &[(u32, u8, bool)]) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&(WAL_MAGIC).to_be_bytes());
        out.extend_from_slice(&WAL_FORMAT.to_be_bytes());
        out.extend_from_slice(&(page_size as u32).to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
        out.extend_from_slice(&salts);
        let mut sum = checksum(false, &out, [0, 0]);
        out.extend_from_slice(&sum[0].to_be_bytes());
        out.extend_from_slice(&sum[1].to_be_bytes());
        for &(pgno, fill, commit) in frames {
            let mut fh = Vec::new();
            fh.extend_from_slice(&pgno.to_be_bytes());
            fh.extend_from_slice(&(if commit { 9u32 } else { 0 }).to_be_bytes());
            fh.extend_from_slice(&salts);
            let page = vec![fill; page_size];
            sum = checksum(false, &fh[..8], sum);
            sum = checksum(false, &page, sum);
            fh.extend_from_slice(&sum[0].to_be_bytes());
            fh.extend_from_slice(&sum[1].to_be_bytes());
            out.extend_from_slice(&fh);
            out.extend_from_slice(&page);
        }
        out
    }

    #[test]
    fn a_header_with_a_wrong_checksum_or_format_is_not_read() {
        let good = wal([1, 2, 3, 4, 5, 6, 7, 8], 512, &[]);
        assert!(parse_header(&good).is_some());
        for (at, byte) in [(0, 0x11), (5, 0), (9, 3), (17, 0), (30, 0)] {
            let mut bad = good.clone();
            bad[at] ^= byte | 1;
            assert!(parse_header(&bad).is_none(), "byte {at}");
        }
    }

    #[test]
    fn only_committed_frames_that_follow_count_and_the_mark_is_found_in_them() {
        let salts = [9, 9, 9, 9, 1, 2, 3, 4];
        let mark = [0x5a; MARK_LEN];
        let w = wal(salts, 512, &[(1, 0, false), (2, 0x5a, true), (3, 0, true)]);
        let h = parse_header(&w).unwrap();
        let c = scan(&mut &w[HEADER..], &h, Some(&mark));
        assert_eq!(
            c,
            Content {
                committed: true,
                holds_mark: true
            }
        );
        // The mark in a transaction never committed does not count.
        let w = wal(salts, 512, &[(1, 0, true), (2, 0x5a, false)]);
        let c = scan(&mut &w[HEADER..], &h, Some(&mark));
        assert!(c.committed && !c.holds_mark);
        // Frames after a broken checksum are not read: nothing committed.
        let mut w = wal(salts, 512, &[(2, 0x5a, true)]);
        w[HEADER + FRAME_HEADER + 7] ^= 1;
        let c = scan(&mut &w[HEADER..], &h, Some(&mark));
        assert_eq!(c, Content::default());
    }

    #[test]
    fn a_note_reads_back_and_a_note_before_marks_is_its_salts() {
        let n = Note {
            salts: Some([1; 8]),
            mark: Some([2; MARK_LEN]),
        };
        assert_eq!(Note::decode(&n.encode()), Some(n));
        let none = Note::default();
        assert_eq!(Note::decode(&none.encode()), Some(none));
        assert_eq!(
            Note::decode(&[3; 8]),
            Some(Note {
                salts: Some([3; 8]),
                mark: None
            })
        );
        assert_eq!(Note::decode(&[3; 9]), None);
    }

    #[test]
    fn a_log_a_few_restarts_after_the_note_is_ours_but_not_one_before_or_far_after() {
        let noted = [0xff, 0xff, 0xff, 0xfe, 1, 1, 1, 1];
        let at = |s1: u32| {
            let mut s = [0u8; 8];
            s[..4].copy_from_slice(&s1.to_be_bytes());
            s
        };
        assert!(restarted_since(&noted, &at(0xffff_ffff)));
        assert!(restarted_since(&noted, &at(2))); // wraps
        assert!(!restarted_since(&noted, &at(3)));
        assert!(!restarted_since(&noted, &at(0xffff_fffe)));
        assert!(!restarted_since(&noted, &at(0xffff_fffd)));
    }
}
