//! `meshfs journal`: the change history of a folder, read straight from the journal database
//! (SQLite in WAL mode lets readers run beside the daemon), optionally followed live.

use anyhow::{anyhow, bail};
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::journal::{HistoryEntry, HistoryQuery, Journal, PrunedEvent};
use meshfs_daemon::versions::listing::{Content, ContentCheck};
use meshfs_protocol::{DeviceId, FolderId, RelPath, ShortId};
use std::time::Duration;

/// Arguments of `meshfs journal`.
#[derive(clap::Args)]
pub struct JournalArgs {
    /// The folder id.
    folder: String,
    /// Only this path (and, for a directory, everything below it).
    #[arg(long)]
    path: Option<String>,
    /// Only changes made by this device: a device id, its 7-character short id, a peer name, or "self".
    #[arg(long)]
    device: Option<String>,
    /// Only entries after a sequence number (e.g. 1042), or since a time: an age (90s, 10m, 2h,
    /// 3d, 1w), today, yesterday, a date (2026-11-22), a local time (2026-11-22 14:00) or RFC
    /// 3339 (2026-11-22T14:00:00Z).
    #[arg(long, value_parser = parse_since)]
    since: Option<Since>,
    /// At most this many entries (the most recent, unless --since is given).
    #[arg(long)]
    limit: Option<usize>,
    /// Keep printing new entries as they are journaled.
    #[arg(long)]
    follow: bool,
    /// Also show bookkeeping entries (op `merged`: two devices' versions of the same state
    /// met and only the version vector changed) and the past versions retention pruned (op
    /// `pruned`).
    #[arg(long)]
    all: bool,
    /// One JSON object per entry.
    #[arg(long)]
    json: bool,
}

fn parse_device(home: &Home, config: &Config, s: &str) -> anyhow::Result<ShortId> {
    if s == "self" {
        return Ok(
            meshfs_daemon::identity::Identity::load(&home.identity_dir())?
                .device_id
                .short(),
        );
    }
    if let Ok(id) = s.parse::<DeviceId>() {
        return Ok(id.short());
    }
    for p in &config.peers {
        if p.name == s {
            return Ok(p.id.short());
        }
    }
    let up = s.to_ascii_uppercase();
    if up.len() == 7 {
        let mut ids: Vec<DeviceId> = config.peer_ids();
        if let Ok(me) = meshfs_daemon::identity::Identity::load(&home.identity_dir()) {
            ids.push(me.device_id);
        }
        if let Some(id) = ids.into_iter().find(|i| i.short().display7() == up) {
            return Ok(id.short());
        }
    }
    bail!("--device {s:?} is not a device id, a short id or a peer name of this device")
}

/// Where `--since` starts the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Since {
    /// After this journal sequence.
    Sequence(u64),
    /// At or after this time (ns since the Unix epoch).
    TimeNs(i64),
}

/// The forms `--since` takes, for its error message.
const SINCE_FORMS: &str = "a sequence number (1042), an age (90s, 10m, 2h, 3d, 1w), today, yesterday, a date (2026-11-22), a local time (2026-11-22 14:00 or 2026-11-22T14:00:00) or an RFC 3339 time (2026-11-22T14:00:00Z)";

/// A `--since` argument (clap reports a bad one as a usage error, exit 2). Dates and times
/// without an offset are the user's local time.
fn parse_since(s: &str) -> Result<Since, String> {
    let now = time::OffsetDateTime::now_utc();
    let offset = time::UtcOffset::local_offset_at(now).unwrap_or(time::UtcOffset::UTC);
    parse_since_at(s, now.to_offset(offset))
        .ok_or_else(|| format!("{s:?} is not a sequence or a time: use {SINCE_FORMS}"))
}

/// [`parse_since`] at the local time `now`.
fn parse_since_at(s: &str, now: time::OffsetDateTime) -> Option<Since> {
    use time::macros::format_description;
    let s = s.trim();
    if let Ok(seq) = s.parse::<u64>() {
        return Some(Since::Sequence(seq));
    }
    let at = |t: time::OffsetDateTime| Some(Since::TimeNs(t.unix_timestamp_nanos() as i64));
    let midnight = |d: time::Date| {
        d.with_hms(0, 0, 0)
            .ok()
            .map(|t| t.assume_offset(now.offset()))
    };
    let units = [
        ("s", 1i64),
        ("m", 60),
        ("h", 3600),
        ("d", 86400),
        ("w", 7 * 86400),
    ];
    for (u, secs) in units {
        if let Some(n) = s.strip_suffix(u).and_then(|n| n.parse::<i64>().ok()) {
            return at(now - time::Duration::seconds(n.checked_mul(secs)?));
        }
    }
    match s {
        "today" => return at(midnight(now.date())?),
        "yesterday" => return at(midnight(now.date().previous_day()?)?),
        _ => {}
    }
    if let Ok(t) = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339) {
        return at(t);
    }
    if let Ok(d) = time::Date::parse(s, format_description!("[year]-[month]-[day]")) {
        return at(midnight(d)?);
    }
    let local = [
        format_description!("[year]-[month]-[day] [hour]:[minute]"),
        format_description!("[year]-[month]-[day]T[hour]:[minute]"),
        format_description!("[year]-[month]-[day] [hour]:[minute]:[second]"),
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]"),
    ];
    local.iter().find_map(|f| {
        let t = time::PrimitiveDateTime::parse(s, f).ok()?;
        at(t.assume_offset(now.offset()))
    })
}

/// A time as `restore --at` and `mount --at` take it: RFC 3339 (`2026-11-27T18:50:00Z`) or a
/// local `YYYY-MM-DD HH:MM:SS` (also with a `T`, or without seconds); ns since the epoch.
pub fn parse_time(s: &str) -> Result<i64, String> {
    let now = time::OffsetDateTime::now_utc();
    let offset = time::UtcOffset::local_offset_at(now).unwrap_or(time::UtcOffset::UTC);
    parse_time_at(s, offset).ok_or_else(|| {
        format!("{s:?} is not a time: use RFC 3339 (2026-11-27T18:50:00Z) or a local time (2026-11-27 18:50:00)")
    })
}

/// [`parse_time`] with the local time zone at `offset`.
fn parse_time_at(s: &str, offset: time::UtcOffset) -> Option<i64> {
    use time::macros::format_description;
    let s = s.trim();
    if let Ok(t) = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339) {
        return Some(t.unix_timestamp_nanos() as i64);
    }
    let local = [
        format_description!("[year]-[month]-[day] [hour]:[minute]:[second]"),
        format_description!("[year]-[month]-[day]T[hour]:[minute]:[second]"),
        format_description!("[year]-[month]-[day] [hour]:[minute]"),
    ];
    local.iter().find_map(|f| {
        let t = time::PrimitiveDateTime::parse(s, f).ok()?;
        Some(t.assume_offset(offset).unix_timestamp_nanos() as i64)
    })
}

/// A time as the journal shows it (UTC, to the millisecond).
pub fn time_str(ns: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(ns as i128)
        .ok()
        .and_then(|t| {
            t.format(&time::macros::format_description!(
                "[year]-[month]-[day] [hour]:[minute]:[second].[subsecond digits:3]"
            ))
            .ok()
        })
        .unwrap_or_else(|| ns.to_string())
}

fn to_json(folder: &FolderId, e: &HistoryEntry, content: Content) -> serde_json::Value {
    serde_json::json!({
        "folder": folder.to_string(),
        "sequence": e.sequence,
        "time_ns": e.time_ns,
        "time": time_str(e.time_ns),
        "path": e.path.to_string(),
        "op": e.op.as_str(),
        "kind": e.kind.as_str(),
        "deleted": e.deleted,
        "modified_by": e.modified_by.display7(),
        "source": e.source.map(|s| s.short().display7()),
        "version": e.version.to_string(),
        "hash": e.hash.to_string(),
        "size": e.size,
        "mode": format!("{:o}", e.mode),
        "detail": e.detail,
        "content": content.as_str(),
    })
}

fn pruned_json(folder: &FolderId, p: &PrunedEvent) -> serde_json::Value {
    serde_json::json!({
        "folder": folder.to_string(),
        "sequence": null,
        "time_ns": p.time_ns,
        "time": time_str(p.time_ns),
        "path": p.path.to_string(),
        "op": "pruned",
        "version_sequence": p.sequence,
        "hash": p.hash.to_string(),
        "size": p.size,
        "detail": p.reason,
    })
}

/// A peer-chosen name for a terminal: control characters (which could move the cursor,
/// recolour or retitle the user's terminal) shown as escapes. JSON output escapes them itself.
fn printable(name: &str) -> String {
    name.chars()
        .flat_map(|c| {
            let escaped: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            escaped
        })
        .collect()
}

/// One line of the journal's output: a history row and where its content is, or a pruning.
enum Line<'a> {
    Row(&'a HistoryEntry, Content),
    Pruned(&'a PrunedEvent),
}

impl Line<'_> {
    fn time_ns(&self) -> i64 {
        match self {
            Line::Row(e, _) => e.time_ns,
            Line::Pruned(p) => p.time_ns,
        }
    }
}

fn print(folder: &FolderId, lines: &[Line<'_>], json: bool) {
    for l in lines {
        match (l, json) {
            (Line::Row(e, c), true) => println!("{}", to_json(folder, e, *c)),
            (Line::Pruned(p), true) => println!("{}", pruned_json(folder, p)),
            (Line::Row(e, c), false) => {
                let hash = if e.deleted || e.hash == meshfs_protocol::Hash::ZERO {
                    "-".to_string()
                } else {
                    e.hash.short()
                };
                let content = match c {
                    Content::None => "-",
                    c => c.as_str(),
                };
                println!(
                    "{:>6}  {}  {}  {:<8} {:<40} {:>10}  {}  {:<8}  {}",
                    e.sequence,
                    time_str(e.time_ns),
                    e.modified_by.display7(),
                    e.op.as_str(),
                    printable(e.path.as_str()),
                    e.size,
                    hash,
                    content,
                    e.version
                );
            }
            (Line::Pruned(p), false) => println!(
                "{:>6}  {}  {:<7}  {:<8} {:<40} {:>10}  {}  {:<8}  version {} ({})",
                "-",
                time_str(p.time_ns),
                "",
                "pruned",
                printable(p.path.as_str()),
                p.size,
                p.hash.short(),
                "-",
                p.sequence,
                p.reason
            ),
        }
    }
}

/// The lines of `entries` (with their content marks) and, with `--all`, the prunings of the
/// same span, by time.
fn lines<'a>(
    check: &mut ContentCheck<'_>,
    entries: &'a [HistoryEntry],
    pruned: &'a [PrunedEvent],
) -> anyhow::Result<Vec<Line<'a>>> {
    let mut out = Vec::with_capacity(entries.len() + pruned.len());
    for e in entries {
        out.push(Line::Row(e, check.of(e)?));
    }
    out.extend(pruned.iter().map(Line::Pruned));
    out.sort_by_key(|l| l.time_ns());
    Ok(out)
}

/// Runs `meshfs journal`.
pub fn run(home: &Home, a: JournalArgs) -> anyhow::Result<u8> {
    let config = Config::load(home)?;
    let folder = FolderId::new(&a.folder)?;
    config
        .folder(&folder)
        .ok_or_else(|| anyhow!("no folder {:?} (see `meshfs folder list`)", a.folder))?;
    let path = a
        .path
        .as_deref()
        .map(|p| RelPath::normalized(p.trim_end_matches('/')))
        .transpose()
        .map_err(|e| anyhow!("--path: {e}"))?;
    let device = a
        .device
        .as_deref()
        .map(|d| parse_device(home, &config, d))
        .transpose()?;
    let (since_sequence, since_time_ns) = match a.since {
        Some(Since::Sequence(seq)) => (Some(seq), None),
        Some(Since::TimeNs(ns)) => (None, Some(ns)),
        None => (None, None),
    };
    let journal = Journal::open(&home.journal_file())?;
    let vault = meshfs_daemon::vault::Vault::open_read_only(&home.vault_file(&folder))?;
    let mut check = ContentCheck::new(&journal, &folder, vault.as_ref());
    let mut q = HistoryQuery {
        path,
        device,
        since_time_ns,
        since_sequence,
        limit: a.limit,
        bookkeeping: a.all,
    };
    if !a.json && !a.follow {
        println!(
            "{:>6}  {:<23}  {:<7}  {:<8} {:<40} {:>10}  {:<8}  {:<8}  version",
            "seq", "time", "device", "op", "path", "size", "hash", "content"
        );
    }
    let first = journal.history(&folder, &q)?;
    // With --all, the prunings since the first row shown (all of them when none is).
    let pruned = if a.all && q.device.is_none() {
        let since = first.first().map_or(0, |e| e.time_ns);
        journal
            .pruned_since(&folder, since, a.limit)?
            .into_iter()
            .filter(|p| q.path.as_ref().is_none_or(|w| p.path.is_within(w)))
            .collect()
    } else {
        Vec::new()
    };
    print(&folder, &lines(&mut check, &first, &pruned)?, a.json);
    if !a.follow {
        return Ok(0);
    }
    let mut last = first.last().map(|e| e.sequence).unwrap_or_else(|| {
        journal
            .history(
                &folder,
                &HistoryQuery {
                    limit: Some(1),
                    ..Default::default()
                },
            )
            .ok()
            .and_then(|h| h.last().map(|e| e.sequence))
            .unwrap_or(0)
    });
    q.limit = Some(1000);
    q.since_time_ns = None;
    loop {
        std::thread::sleep(Duration::from_millis(100));
        q.since_sequence = Some(last);
        let more = journal.history(&folder, &q)?;
        if let Some(e) = more.last() {
            last = e.sequence;
        }
        print(&folder, &lines(&mut check, &more, &[])?, a.json);
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
}

#[cfg(test)]
mod tests {
    use super::{parse_since_at, printable, Since};
    use time::macros::datetime;

    /// 2026-11-22 14:30:00 at UTC+01:00.
    fn now() -> time::OffsetDateTime {
        datetime!(2026-11-22 14:30:00 +1)
    }

    fn at(t: time::OffsetDateTime) -> Option<Since> {
        Some(Since::TimeNs(t.unix_timestamp_nanos() as i64))
    }

    #[test]
    fn since_takes_sequences_ages_days_dates_and_times_in_local_time() {
        let cases = [
            ("1042", Some(Since::Sequence(1042))),
            ("90s", at(datetime!(2026-11-22 14:28:30 +1))),
            ("10m", at(datetime!(2026-11-22 14:20:00 +1))),
            ("2h", at(datetime!(2026-11-22 12:30:00 +1))),
            ("3d", at(datetime!(2026-11-19 14:30:00 +1))),
            ("1w", at(datetime!(2026-11-15 14:30:00 +1))),
            ("today", at(datetime!(2026-11-22 00:00:00 +1))),
            ("yesterday", at(datetime!(2026-11-21 00:00:00 +1))),
            ("2026-11-01", at(datetime!(2026-11-01 00:00:00 +1))),
            ("2026-11-01 09:15", at(datetime!(2026-11-01 09:15:00 +1))),
            ("2026-11-01T09:15:30", at(datetime!(2026-11-01 09:15:30 +1))),
            (
                "2026-11-01T09:15:30Z",
                at(datetime!(2026-11-01 09:15:30 UTC)),
            ),
            (
                "2026-11-01T09:15:30-05:00",
                at(datetime!(2026-11-01 09:15:30 -5)),
            ),
        ];
        for (arg, want) in cases {
            assert_eq!(parse_since_at(arg, now()), want, "{arg}");
        }
        for bad in [
            "",
            "soon",
            "10x",
            "2026-13-01",
            "-5m1",
            "99999999999999999w",
        ] {
            assert_eq!(parse_since_at(bad, now()), None, "{bad}");
        }
    }

    #[test]
    fn times_for_restore_and_mount_are_rfc_3339_or_local() {
        let plus_one = time::UtcOffset::from_hms(1, 0, 0).unwrap();
        let ns = |t: time::OffsetDateTime| Some(t.unix_timestamp_nanos() as i64);
        assert_eq!(
            super::parse_time_at("2026-11-27T18:50:00Z", plus_one),
            ns(datetime!(2026-11-27 18:50:00 UTC))
        );
        for local in ["2026-11-27 18:50:00", "2026-11-27T18:50:00", "2026-11-27 18:50"] {
            assert_eq!(
                super::parse_time_at(local, plus_one),
                ns(datetime!(2026-11-27 18:50:00 +1)),
                "{local}"
            );
        }
        for bad in ["", "10m", "yesterday", "2026-11-27", "27/11/2026 18:50"] {
            assert_eq!(super::parse_time_at(bad, plus_one), None, "{bad}");
        }
    }

    #[test]
    fn control_characters_in_names_are_shown_escaped() {
        assert_eq!(printable("a\u{1b}[2Jb\tc"), "a\\u{1b}[2Jb\\tc");
        assert_eq!(printable("plain é name"), "plain é name");
    }
}
