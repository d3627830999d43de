//! The rows of `meshfs journal`, and the filters that choose them: what the CLI prints and the
//! page (`meshfs ui`) shows are made here, from the journal's [`HistoryEntry`]s, so the two
//! cannot differ. A filter is read from the words a person types (`--path`, `--device`,
//! `--since`) into a [`HistoryQuery`]; this module reads no database itself.

use crate::config::Config;
use crate::journal::{HistoryEntry, HistoryQuery};
use meshfs_protocol::{DeviceId, FolderId, Hash, RelPath, ShortId};
use time::{OffsetDateTime, UtcOffset};

/// Where `--since` starts the history.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Since {
    /// After this journal sequence.
    Sequence(u64),
    /// At or after this time (ns since the Unix epoch).
    TimeNs(i64),
}

/// The forms `--since` takes, for its error message.
pub const SINCE_FORMS: &str = "a sequence number (1042), an age (90s, 10m, 2h, 3d, 1w), today, yesterday, a date (2026-11-22), a local time (2026-11-22 14:00 or 2026-11-22T14:00:00) or an RFC 3339 time (2026-11-22T14:00:00Z)";

/// Why a filter's words choose no rows.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    /// The path is not a path inside a folder.
    #[error("{0}")]
    Path(#[from] meshfs_protocol::PathError),
    /// The device is none this device knows.
    #[error("{0:?} is not a device id, a short id or a peer name of this device")]
    Device(String),
    /// The time is in none of the forms [`SINCE_FORMS`] lists.
    #[error("{0:?} is not a sequence or a time: use {SINCE_FORMS}")]
    Since(String),
}

/// What a person asked of the history, in their words.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// Only this path (and, for a directory, everything below it).
    pub path: Option<String>,
    /// Only versions made by this device: a device id, its short id, a peer name, or `self`.
    pub device: Option<String>,
    /// Only entries after this.
    pub since: Option<Since>,
    /// At most this many entries.
    pub limit: Option<usize>,
    /// Bookkeeping entries too (op `merged`).
    pub all: bool,
}

impl Filter {
    /// The query these words mean on a device whose own id is `me`, with `config`'s peers.
    pub fn query(&self, config: &Config, me: DeviceId) -> Result<HistoryQuery, FilterError> {
        let (since_sequence, since_time_ns) = match self.since {
            Some(Since::Sequence(seq)) => (Some(seq), None),
            Some(Since::TimeNs(ns)) => (None, Some(ns)),
            None => (None, None),
        };
        Ok(HistoryQuery {
            path: self.path.as_deref().map(path).transpose()?,
            device: self
                .device
                .as_deref()
                .map(|d| device(d, config, me))
                .transpose()?,
            since_time_ns,
            since_sequence,
            limit: self.limit,
            bookkeeping: self.all,
            newest: false,
        })
    }
}

/// A `--path` argument: a path inside the folder, a trailing `/` allowed.
pub fn path(s: &str) -> Result<RelPath, FilterError> {
    Ok(RelPath::normalized(s.trim_end_matches('/'))?)
}

/// A `--device` argument: `self`, a device id, a peer's name, or a known device's short id.
pub fn device(s: &str, config: &Config, me: DeviceId) -> Result<ShortId, FilterError> {
    if s == "self" {
        return Ok(me.short());
    }
    if let Ok(id) = s.parse::<DeviceId>() {
        return Ok(id.short());
    }
    if let Some(p) = config.peers.iter().find(|p| p.name == s) {
        return Ok(p.id.short());
    }
    let up = s.to_ascii_uppercase();
    if up.len() == 7 {
        let mut ids = config.peer_ids();
        ids.push(me);
        if let Some(id) = ids.into_iter().find(|i| i.short().display7() == up) {
            return Ok(id.short());
        }
    }
    Err(FilterError::Device(s.to_string()))
}

/// A `--since` argument read at the reader's time `now` (its offset is the one dates and
/// times without an offset are taken in).
pub fn since(s: &str, now: OffsetDateTime) -> Result<Since, FilterError> {
    since_at(s, now).ok_or_else(|| FilterError::Since(s.to_string()))
}

fn since_at(s: &str, now: OffsetDateTime) -> Option<Since> {
    use time::macros::format_description;
    let s = s.trim();
    if let Ok(seq) = s.parse::<u64>() {
        return Some(Since::Sequence(seq));
    }
    let at = |t: OffsetDateTime| Some(Since::TimeNs(t.unix_timestamp_nanos() as i64));
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
    if let Ok(t) = OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339) {
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

/// Now, at `offset`.
pub fn now_at(offset: UtcOffset) -> OffsetDateTime {
    OffsetDateTime::now_utc().to_offset(offset)
}

/// A journal time (ns since the epoch) as `2026-11-22 14:15:03.120`, in UTC.
pub fn time_str(ns: i64) -> String {
    OffsetDateTime::from_unix_timestamp_nanos(ns as i128)
        .ok()
        .and_then(|t| {
            t.format(&time::macros::format_description!(
                "[year]-[month]-[day] [hour]:[minute]:[second].[subsecond digits:3]"
            ))
            .ok()
        })
        .unwrap_or_else(|| ns.to_string())
}

/// One history entry as `meshfs journal --json` prints it.
pub fn to_json(folder: &FolderId, e: &HistoryEntry) -> serde_json::Value {
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
pub fn printable(name: &str) -> String {
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

/// One row of `meshfs journal`'s table: its columns as text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// `seq`: the local sequence.
    pub sequence: u64,
    /// `time`: when it was journaled here, UTC.
    pub time: String,
    /// `device`: the short id of the version's author.
    pub device: String,
    /// `op`: create, modify, delete, rename, metadata, conflict, merged.
    pub op: &'static str,
    /// `path`, control characters escaped.
    pub path: String,
    /// `size` in bytes.
    pub size: u64,
    /// `hash`: the short content hash, `-` for a deletion.
    pub hash: String,
    /// `version`: the version vector.
    pub version: String,
}

impl Row {
    /// The column names, in order.
    pub const COLUMNS: [&'static str; 8] = [
        "seq", "time", "device", "op", "path", "size", "hash", "version",
    ];

    /// The row of `e`.
    pub fn of(e: &HistoryEntry) -> Row {
        Row {
            sequence: e.sequence,
            time: time_str(e.time_ns),
            device: e.modified_by.display7(),
            op: e.op.as_str(),
            path: printable(e.path.as_str()),
            size: e.size,
            hash: if e.deleted || e.hash == Hash::ZERO {
                "-".to_string()
            } else {
                e.hash.short()
            },
            version: e.version.to_string(),
        }
    }

    /// The header line of the text table.
    pub fn header() -> String {
        let c = Row::COLUMNS;
        format!(
            "{:>6}  {:<23}  {:<7}  {:<8} {:<40} {:>10}  {:<8}  {}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]
        )
    }

    /// The row as one line of the text table.
    pub fn line(&self) -> String {
        format!(
            "{:>6}  {}  {}  {:<8} {:<40} {:>10}  {}  {}",
            self.sequence,
            self.time,
            self.device,
            self.op,
            self.path,
            self.size,
            self.hash,
            self.version
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use time::macros::datetime;

    /// 2026-11-22 14:30:00 at UTC+01:00.
    fn now() -> OffsetDateTime {
        datetime!(2026-11-22 14:30:00 +1)
    }

    fn at(t: OffsetDateTime) -> Option<Since> {
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
            assert_eq!(since_at(arg, now()), want, "{arg}");
        }
        for bad in [
            "",
            "soon",
            "10x",
            "2026-13-01",
            "-5m1",
            "99999999999999999w",
        ] {
            assert_eq!(since_at(bad, now()), None, "{bad}");
            assert!(since(bad, now())
                .unwrap_err()
                .to_string()
                .contains("is not a sequence or a time: use a sequence number"));
        }
    }

    #[test]
    fn control_characters_in_names_are_shown_escaped() {
        assert_eq!(printable("a\u{1b}[2Jb\tc"), "a\\u{1b}[2Jb\\tc");
        assert_eq!(printable("plain é name"), "plain é name");
    }

    #[test]
    fn a_device_is_named_by_id_short_id_peer_name_or_self() {
        let me: DeviceId = DeviceId::from_bytes([1; 32]);
        let peer: DeviceId = DeviceId::from_bytes([2; 32]);
        let mut config = Config::new("a", "127.0.0.1:1");
        config.peers.push(crate::config::PeerConfig {
            name: "server".into(),
            ..crate::config::PeerConfig::new(peer)
        });
        assert_eq!(device("self", &config, me).unwrap(), me.short());
        assert_eq!(device("server", &config, me).unwrap(), peer.short());
        let short = peer.short().display7().to_ascii_lowercase();
        assert_eq!(device(&short, &config, me).unwrap(), peer.short());
        assert_eq!(device(&me.to_string(), &config, me).unwrap(), me.short());
        assert!(matches!(
            device("laptop", &config, me),
            Err(FilterError::Device(d)) if d == "laptop"
        ));
    }
}
