//! `meshfs status --watch`: the daemon's status, refreshed every second until Ctrl-C (or
//! `--timeout`): per folder what is done and what is left, with its rate and ETA; per peer its
//! connection, round trip and transfer rates. The daemon only counts; rates come from the
//! status documents of the last few seconds. On a terminal the view is redrawn in place; on a
//! pipe or a file each refresh is one plain line.

use crate::EXIT_NO_DAEMON;
use meshfs_daemon::config::{Config, ConfigError, Home};
use meshfs_daemon::control::{self, Request};
use meshfs_daemon::readout::rates::{bytes, folder_work, peer_words, History};
use meshfs_daemon::readout::status::{folder_summary, plural, s, u};
use serde_json::Value;
use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};
use time::UtcOffset;

/// How often the view is refreshed.
const EVERY: Duration = Duration::from_secs(1);

/// Runs `status --watch`; returns the exit code.
pub fn run(home: &Home, timeout: Option<f64>) -> anyhow::Result<u8> {
    if let Err(e @ ConfigError::Missing(_)) = Config::load(home) {
        return Err(e.into());
    }
    let tty = std::io::stdout().is_terminal();
    let deadline = timeout.map(|t| Instant::now() + Duration::from_secs_f64(t.max(0.0)));
    let mut history = History::default();
    let mut out = std::io::stdout();
    for round in 0u64.. {
        let started = Instant::now();
        let st = control::request(home, &Request::Status)?;
        if st.is_none() && round == 0 {
            eprintln!(
                "meshfs: no daemon is running for {} (start it with `meshfs daemon`)",
                home.config_dir.display()
            );
            return Ok(EXIT_NO_DAEMON);
        }
        if let Some(st) = st {
            history.push(started, st);
        } else {
            // Stopped while watched: say so, and show it again when it is back.
            history = History::default();
        }
        let tz = crate::local_offset();
        let text = match (history.latest(), tty) {
            (Some(st), true) => frame(st, &history, tz),
            (Some(st), false) => line(st, &history, tz),
            (None, true) => "no daemon is running (waiting for one to start)\n".into(),
            (None, false) => format!("{} no daemon is running\n", clock()),
        };
        if tty {
            // Home, each line cleared to its end, then the rest of the screen: no flicker.
            let body: String = text.lines().map(|l| format!("{l}\x1b[K\n")).collect();
            let clear = if round == 0 { "\x1b[2J" } else { "" };
            write!(out, "{clear}\x1b[H{body}\x1b[J")?;
        } else {
            write!(out, "{text}")?;
        }
        out.flush()?;
        let next = started + EVERY;
        match deadline {
            Some(d) if next >= d => {
                std::thread::sleep(d.saturating_duration_since(Instant::now()));
                return Ok(0);
            }
            _ => std::thread::sleep(next.saturating_duration_since(Instant::now())),
        }
    }
    Ok(0)
}

/// The local time of day, `HH:MM:SS`.
fn clock() -> String {
    let now = time::OffsetDateTime::now_utc();
    let t = now.to_offset(time::UtcOffset::local_offset_at(now).unwrap_or(time::UtcOffset::UTC));
    format!("{:02}:{:02}:{:02}", t.hour(), t.minute(), t.second())
}

/// The terminal view.
fn frame(st: &Value, h: &History, tz: UtcOffset) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let started = u(&st["device"], "started_unix");
    let _ = writeln!(
        o,
        "meshfs status --watch   {}   {}   (Ctrl-C to stop)",
        s(&st["device"], "name"),
        clock()
    );
    let sync = if st["in_sync"] == true {
        "in sync: every folder is up to date with every peer that shares it"
    } else {
        "not in sync"
    };
    let _ = writeln!(o, "sync    {sync}\n");
    for f in st["folders"].as_array().into_iter().flatten() {
        let _ = writeln!(
            o,
            "folder  {}  {}  {}, {}",
            s(f, "id"),
            s(f, "path"),
            plural(u(f, "files"), "file", "files"),
            bytes(u(f, "bytes") as f64)
        );
        let _ = writeln!(o, "        {}", folder_summary(f, started, tz));
        for w in folder_work(f, st, h) {
            let _ = writeln!(o, "        {w}");
        }
        let _ = writeln!(o);
    }
    for p in st["peers"].as_array().into_iter().flatten() {
        let _ = writeln!(o, "peer    {}", peer_words(p, h, tz));
    }
    o
}

/// One plain line per refresh, for a pipe or a file.
fn line(st: &Value, h: &History, tz: UtcOffset) -> String {
    let started = u(&st["device"], "started_unix");
    let mut parts = Vec::new();
    for f in st["folders"].as_array().into_iter().flatten() {
        let state = if f["in_sync"] == true {
            "in sync".to_string()
        } else {
            format!("not in sync ({})", folder_summary(f, started, tz))
        };
        let mut words = vec![format!("folder {}: {state}", s(f, "id"))];
        words.extend(folder_work(f, st, h));
        parts.push(words.join("; "));
    }
    for p in st["peers"].as_array().into_iter().flatten() {
        parts.push(format!("peer {}", peer_words(p, h, tz)));
    }
    format!("{} {}\n", clock(), parts.join(" | "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// This device's first scan of folder `work`, `done` of 3,000 files hashed; no peers.
    fn first_scan(done: u64) -> Value {
        let scan = json!({"done": done, "bytes_done": done << 12, "left": 3000 - done});
        json!({
            "device": {"name": "a", "started_unix": 0},
            "folders": [{"id": "work", "path": "/w", "files": done, "bytes": done << 12,
                         "scanning": true, "progress": {"scan": scan}, "peers": []}],
            "peers": [],
        })
    }

    #[test]
    fn a_pipe_gets_one_plain_line_per_refresh_with_the_work_and_its_rate() {
        let mut h = History::default();
        let t = Instant::now();
        h.push(t, first_scan(1000));
        h.push(t + Duration::from_secs(4), first_scan(2000));
        let st = h.latest().unwrap().clone();
        let l = line(&st, &h, UtcOffset::UTC);
        assert!(
            l.contains("folder work: not in sync (first scan running)")
                && l.contains("scan: 2000 files hashed (7.8 MiB), 1000 left, 250 files/s, ETA 4s")
                && l.ends_with('\n')
                && !l.contains('\x1b'),
            "{l}"
        );
        let f = frame(&st, &h, UtcOffset::UTC);
        assert!(f.contains("folder  work  /w  2000 files, 7.8 MiB"), "{f}");
    }
}
