//! `meshfs journal`: the change history of a folder, read straight from the journal database
//! (SQLite in WAL mode lets readers run beside the daemon), optionally followed live.

use anyhow::anyhow;
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::identity::Identity;
use meshfs_daemon::journal::{HistoryEntry, HistoryQuery, Journal};
use meshfs_daemon::readout::journal::{self, Filter, FilterError, Row, Since};
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
    /// Also show bookkeeping entries (op `merged`): two devices' versions of the same state
    /// met and only the version vector changed.
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

fn print(folder: &FolderId, entries: &[HistoryEntry], json: bool) {
    for e in entries {
        if json {
            println!("{}", journal::to_json(folder, e));
        } else {
            println!("{}", Row::of(e).line());
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
    if !a.json && !a.follow {
        println!("{}", Row::header());
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
