//! `meshfs journal`: the change history of a folder, read straight from the journal database
//! (SQLite in WAL mode lets readers run beside the daemon), optionally followed live.

use anyhow::anyhow;
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::identity::Identity;
use meshfs_daemon::journal::{HistoryEntry, HistoryQuery, Journal, PrunedEvent};
use meshfs_daemon::readout::journal::{self, printable, time_str, Filter, FilterError, Row, Since};
use meshfs_daemon::versions::listing::{Content, ContentCheck};
use meshfs_protocol::FolderId;
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

/// A `--since` argument (clap reports a bad one as a usage error, exit 2). Dates and times
/// without an offset are the user's local time.
fn parse_since(s: &str) -> Result<Since, String> {
    journal::since(s, journal::now_at(crate::local_offset())).map_err(|e| e.to_string())
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

fn row_json(folder: &FolderId, e: &HistoryEntry, content: Content) -> serde_json::Value {
    let mut v = journal::to_json(folder, e);
    v["content"] = content.as_str().into();
    v
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

/// The table's columns: the journal's, and where each version's content is (`content`).
fn header() -> String {
    format!("{}  content", Row::header())
}

fn print(folder: &FolderId, lines: &[Line<'_>], json: bool) {
    for l in lines {
        match (l, json) {
            (Line::Row(e, c), true) => println!("{}", row_json(folder, e, *c)),
            (Line::Pruned(p), true) => println!("{}", pruned_json(folder, p)),
            (Line::Row(e, c), false) => {
                let content = match c {
                    Content::None => "-",
                    c => c.as_str(),
                };
                println!("{}  {content}", Row::of(e).line());
            }
            (Line::Pruned(p), false) => println!(
                "{:>6}  {}  {:<7}  {:<8} {:<40} {:>10}  {:<8}  version {} ({})  -",
                "-",
                time_str(p.time_ns),
                "",
                "pruned",
                printable(p.path.as_str()),
                p.size,
                p.hash.short(),
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
    let filter = Filter {
        path: a.path,
        device: a.device,
        since: a.since,
        limit: a.limit,
        all: a.all,
    };
    let me = Identity::load(&home.identity_dir())?.device_id;
    let mut q = filter.query(&config, me).map_err(|e| match e {
        FilterError::Path(e) => anyhow!("--path: {e}"),
        e @ FilterError::Device(_) => anyhow!("--device {e}"),
        e => anyhow!(e),
    })?;
    let journal = Journal::open_reader(&home.journal_file())?;
    let vault = meshfs_daemon::vault::Vault::open_read_only(&home.vault_file(&folder))?;
    let mut check = ContentCheck::new(&journal, &folder, vault.as_ref());
    if !a.json && !a.follow {
        println!("{}", header());
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
