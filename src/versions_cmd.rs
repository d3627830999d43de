//! `meshfs versions`, `restore`, `override` and `revert`: past versions and folder roles.
//! `versions` reads the journal and the vault straight from disk (read-only, beside a running
//! daemon or without one); the others ask the daemon, which writes through the store.

use anyhow::{anyhow, bail};
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::control::{self, Request};
use meshfs_daemon::journal::Journal;
use meshfs_daemon::readout::journal::time_str;
use meshfs_daemon::versions::listing::{self, Listed};
use meshfs_protocol::{FolderId, RelPath};

/// Exit code: no daemon (as in main).
const EXIT_NO_DAEMON: u8 = 3;

/// Arguments of `meshfs restore`.
#[derive(clap::Args)]
pub struct RestoreArgs {
    /// The folder id.
    #[arg(value_parser = crate::parse_folder_id)]
    folder: FolderId,
    /// The path, relative to the folder (a file, or a directory with --at).
    path: String,
    /// That version (its sequence, as `meshfs versions` lists it).
    #[arg(long, conflicts_with = "at")]
    seq: Option<u64>,
    /// The path (and everything below it) as it was then: RFC 3339 (2026-11-27T18:50:00Z)
    /// or local time (2026-11-27 18:50:00).
    #[arg(long, value_parser = parse_time)]
    at: Option<i64>,
    /// Put it there instead of at PATH.
    #[arg(long)]
    to: Option<String>,
    /// One JSON document.
    #[arg(long)]
    json: bool,
}

fn rel(p: &str) -> anyhow::Result<RelPath> {
    control::user_path(p).map_err(anyhow::Error::msg)
}

pub(crate) fn require_folder(home: &Home, id: &FolderId) -> anyhow::Result<Config> {
    let c = Config::load(home)?;
    c.folder(id)
        .ok_or_else(|| anyhow!("no folder {:?} (see `meshfs folder list`)", id.as_str()))?;
    Ok(c)
}

fn listed_json(l: &Listed) -> serde_json::Value {
    let e = &l.entry;
    serde_json::json!({
        "sequence": e.sequence,
        "time_ns": e.time_ns,
        "time": time_str(e.time_ns),
        "path": e.path.to_string(),
        "op": e.op.as_str(),
        "kind": e.kind.as_str(),
        "deleted": e.deleted,
        "modified_by": e.modified_by.display7(),
        "source": e.source.map(|s| s.short().display7()),
        "size": e.size,
        "hash": e.hash.to_string(),
        "content": l.content.as_str(),
    })
}

fn listed_line(l: &Listed) {
    let e = &l.entry;
    let hash = if e.deleted || e.hash == meshfs_protocol::Hash::ZERO {
        "-".to_string()
    } else {
        e.hash.short()
    };
    let content = match l.content {
        listing::Content::None => "-",
        c => c.as_str(),
    };
    println!(
        "{:>6}  {}  {}  {:<8} {:>10}  {:<8}  {:<8}  {}",
        e.sequence,
        time_str(e.time_ns),
        e.modified_by.display7(),
        e.op.as_str(),
        e.size,
        hash,
        content,
        e.path
    );
}

/// `meshfs versions FOLDER PATH [--json]`.
pub fn versions(home: &Home, folder: FolderId, path: &str, json: bool) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let path = rel(path)?;
    let journal = Journal::open_reader(&home.journal_file())?;
    let vault = meshfs_daemon::vault::Vault::open_read_only(&home.vault_file(&folder))?;
    let (own, below) = listing::versions(&journal, vault.as_ref(), &folder, &path)?;
    if json {
        let doc = serde_json::json!({
            "folder": folder.to_string(),
            "path": path.to_string(),
            "versions": own.iter().map(listed_json).collect::<Vec<_>>(),
            "below": below.iter().map(listed_json).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
        return Ok(0);
    }
    if own.is_empty() && below.is_empty() {
        bail!("the journal knows no version of {path} in folder {folder}");
    }
    println!(
        "{:>6}  {:<23}  {:<7}  {:<8} {:>10}  {:<8}  {:<8}  path",
        "seq", "time", "device", "op", "size", "hash", "content"
    );
    for l in &own {
        listed_line(l);
    }
    if !below.is_empty() {
        println!("what was below {path} (the last version of each):");
        for l in &below {
            listed_line(l);
        }
    }
    println!("content: current = what is there now, kept = restorable here, partial / not_here = `restore` asks the connected peers, pruned = no longer kept");
    Ok(0)
}

/// Sends `req` to the daemon; `Ok(None)` (after saying so) when none runs.
pub(crate) fn ask(
    home: &Home,
    req: &Request,
    what: &str,
) -> anyhow::Result<Option<serde_json::Value>> {
    match control::request(home, req)? {
        None => {
            eprintln!("meshfs: the daemon is not running; {what} needs it (`meshfs daemon`)");
            Ok(None)
        }
        Some(r) if r.get("ok").and_then(|v| v.as_bool()) == Some(true) => Ok(Some(r)),
        Some(r) => bail!(
            "{}",
            r.get("error")
                .and_then(|v| v.as_str())
                .unwrap_or("the daemon refused")
        ),
    }
}

/// `meshfs restore FOLDER PATH [--seq N | --at TIME] [--to NEWPATH]`.
pub fn restore(home: &Home, a: RestoreArgs) -> anyhow::Result<u8> {
    require_folder(home, &a.folder)?;
    rel(&a.path)?;
    if let Some(t) = &a.to {
        rel(t)?;
    }
    let req = Request::Restore {
        folder: a.folder.clone(),
        path: a.path.clone(),
        seq: a.seq,
        at_ns: a.at,
        to: a.to.clone(),
    };
    let Some(r) = ask(home, &req, "restore")? else {
        return Ok(EXIT_NO_DAEMON);
    };
    let report = &r["restore"];
    if a.json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        let restored = report["restored"].as_array().map_or(0, |v| v.len());
        for p in report["restored"].as_array().into_iter().flatten() {
            println!(
                "restored {} ({}, version {}, {} bytes)",
                p["path"].as_str().unwrap_or("?"),
                p["kind"].as_str().unwrap_or("?"),
                p["from_sequence"],
                p["size"]
            );
        }
        let unchanged = report["unchanged"].as_u64().unwrap_or(0);
        if unchanged > 0 {
            println!("{unchanged} path(s) already held that version");
        }
        let fetched = report["fetched_chunks"].as_u64().unwrap_or(0);
        if fetched > 0 {
            println!("{fetched} chunk(s) fetched from peers");
        }
        println!("{restored} path(s) restored in {}; the restore is a new change of this device, sent to its peers", a.folder);
    }
    let failed = report["failed"].as_array().cloned().unwrap_or_default();
    for f in &failed {
        eprintln!(
            "meshfs: not restored: {}: {}",
            f["path"].as_str().unwrap_or("?"),
            f["error"].as_str().unwrap_or("?")
        );
    }
    Ok(if failed.is_empty() { 0 } else { 1 })
}

/// `meshfs override FOLDER` and `meshfs revert FOLDER`.
pub fn role_command(home: &Home, folder: FolderId, revert: bool) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let (req, what) = if revert {
        (
            Request::Revert {
                folder: folder.clone(),
            },
            "revert",
        )
    } else {
        (
            Request::Override {
                folder: folder.clone(),
            },
            "override",
        )
    };
    let Some(r) = ask(home, &req, what)? else {
        return Ok(EXIT_NO_DAEMON);
    };
    let done = r["report"]["done"].as_array().cloned().unwrap_or_default();
    for p in &done {
        println!("{}", p.as_str().unwrap_or("?"));
    }
    let failed = r["report"]["failed"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    for f in &failed {
        eprintln!("meshfs: {what} failed for {}", f);
    }
    if revert {
        println!("{} path(s) of {folder} back to the shared state; the local edits are kept as past versions (`meshfs versions`)", done.len());
    } else {
        println!(
            "{} path(s) of {folder}: this device's state is sent as the newer version",
            done.len()
        );
    }
    Ok(if failed.is_empty() { 0 } else { 1 })
}

/// The time `--at` gave, for messages.
pub fn at_text(ns: i64) -> String {
    time_str(ns)
}

/// A time as `restore --at` and `mount --at` take it: RFC 3339 (`2026-11-27T18:50:00Z`) or a
/// local `YYYY-MM-DD HH:MM:SS` (also with a `T`, or without seconds); ns since the epoch.
pub fn parse_time(s: &str) -> Result<i64, String> {
    parse_time_at(s, crate::local_offset()).ok_or_else(|| {
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

#[cfg(test)]
mod tests {
    use time::macros::datetime;

    #[test]
    fn times_for_restore_and_mount_are_rfc_3339_or_local() {
        let plus_one = time::UtcOffset::from_hms(1, 0, 0).unwrap();
        let ns = |t: time::OffsetDateTime| Some(t.unix_timestamp_nanos() as i64);
        assert_eq!(
            super::parse_time_at("2026-11-27T18:50:00Z", plus_one),
            ns(datetime!(2026-11-27 18:50:00 UTC))
        );
        for local in [
            "2026-11-27 18:50:00",
            "2026-11-27T18:50:00",
            "2026-11-27 18:50",
        ] {
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
}
