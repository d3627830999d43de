//! `meshfs journal`: the change history of a folder, read straight from the journal database
//! (SQLite in WAL mode lets readers run beside the daemon), optionally followed live.

use anyhow::{anyhow, bail};
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::journal::{HistoryEntry, HistoryQuery, Journal};
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
    /// Also show bookkeeping entries (op `merged`): two devices' versions of the same state
    /// met and only the version vector changed.
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

fn time_str(ns: i64) -> String {
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

fn to_json(folder: &FolderId, e: &HistoryEntry) -> serde_json::Value {
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

fn print(folder: &FolderId, entries: &[HistoryEntry], json: bool) {
    for e in entries {
        if json {
            println!("{}", to_json(folder, e));
        } else {
            let hash = if e.deleted || e.hash == meshfs_protocol::Hash::ZERO {
                "-".to_string()
            } else {
                e.hash.short()
            };
            println!(
                "{:>6}  {}  {}  {:<8} {:<40} {:>10}  {}  {}",
                e.sequence,
                time_str(e.time_ns),
                e.modified_by.display7(),
                e.op.as_str(),
                printable(e.path.as_str()),
                e.size,
                hash,
                e.version
            );
        }
    }
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
    let journal = Journal::open_reader(&home.journal_file())?;
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
            "{:>6}  {:<23}  {:<7}  {:<8} {:<40} {:>10}  {:<8}  version",
            "seq", "time", "device", "op", "path", "size", "hash"
        );
    }
    let first = journal.history(&folder, &q)?;
    print(&folder, &first, a.json);
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
        print(&folder, &more, a.json);
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
    fn control_characters_in_names_are_shown_escaped() {
        assert_eq!(printable("a\u{1b}[2Jb\tc"), "a\\u{1b}[2Jb\\tc");
        assert_eq!(printable("plain é name"), "plain é name");
    }
}
