//! The words of `meshfs status`: reading fields of the status document and the summary
//! lines the plain view, `status --watch` and the page (`meshfs ui`) show. Made from the
//! `status --json` document only; times are shown at the reader's UTC offset, which the caller
//! knows (the CLI its own, the page the browser's) and this module never looks up.

use super::journal::printable;
use serde_json::Value;
use std::collections::HashMap;
use time::UtcOffset;

/// A string field, or "".
pub fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

/// A text field for a terminal, or "": control characters escaped as `meshfs journal` shows
/// them ([`printable`]). Paths, errors and names can be a peer's words: a file name or an
/// error message holding escape sequences must not move the cursor or retitle the terminal.
pub fn t(v: &Value, k: &str) -> String {
    printable(s(v, k))
}

/// A number field, or 0.
pub fn u(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// The strings of the JSON array `v` (nothing when it is not an array; other items skipped).
pub fn strs(v: &Value) -> impl Iterator<Item = &str> {
    v.as_array().into_iter().flatten().filter_map(Value::as_str)
}

/// `1 file`, `2 files`.
pub fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// A Unix time as `HH:MM` at `offset`, with the date when it is not today there.
pub fn local_time(unix: u64, offset: UtcOffset) -> String {
    let Ok(t) = time::OffsetDateTime::from_unix_timestamp(unix as i64) else {
        return "?".into();
    };
    let t = t.to_offset(offset);
    let today = time::OffsetDateTime::now_utc().to_offset(offset).date();
    let hm = format!("{:02}:{:02}", t.hour(), t.minute());
    if t.date() == today {
        hm
    } else {
        format!("{} {hm}", t.date())
    }
}

/// Peers of the `peers` array by device id.
pub fn peers_by_id(st: &Value) -> HashMap<&str, &Value> {
    st["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|p| (s(p, "device_id"), p))
        .collect()
}

/// A peer's name (escaped, [`t`]), or its short id.
pub fn peer_name(p: &Value) -> String {
    match s(p, "name") {
        "" => s(p, "device_id").chars().take(7).collect(),
        n => printable(n),
    }
}

/// How far a peer's first scan got, from a folder peer's `scan`: `1000 files hashed so far,
/// 1400 left`.
pub fn scan_words(scan: &Value) -> String {
    let hashed = format!("{} hashed so far", plural(u(scan, "done"), "file", "files"));
    match u(scan, "left") {
        0 => hashed,
        left => format!("{hashed}, {left} left"),
    }
}

/// Where a folder's peer stands, in words: `up to date`, `syncing (3 records to send)`,
/// `waiting for its first scan: 1000 files hashed so far, 1400 left`, `offline since 10:42`,
/// `connected, but it does not share this folder with this device`.
pub fn peer_state(p: &Value, started_unix: u64, tz: UtcOffset) -> String {
    if p["connected"] != true {
        return match p["last_seen_unix"].as_u64() {
            Some(t) => format!("offline since {}", local_time(t, tz)),
            None => format!(
                "never connected since the daemon started at {}",
                local_time(started_unix, tz)
            ),
        };
    }
    if p["in_sync"] == true {
        return "up to date".into();
    }
    if p["not_shared"] == true {
        return "connected, but it does not share this folder with this device".into();
    }
    if p["scanning"] == true {
        return format!("waiting for its first scan: {}", scan_words(&p["scan"]));
    }
    let pending = u(p, "pending_records");
    if pending > 0 {
        format!("syncing ({} to send)", plural(pending, "record", "records"))
    } else {
        "syncing".into()
    }
}

/// One folder's sync state in words: `in sync with every peer that shares it (b)`, or `up to
/// date with 1 of 2 peers; b offline since 10:42`, or `up to date with 0 of 1 peer; waiting for
/// a's first scan: 1000 files hashed so far, 1400 left`.
pub fn folder_summary(f: &Value, started_unix: u64, tz: UtcOffset) -> String {
    let mut why = Vec::new();
    if f["scanning"] == true {
        why.push("first scan running".to_string());
    }
    let pending = u(f, "capture_pending");
    if pending > 0 {
        why.push(format!(
            "{} being recorded",
            plural(pending, "local change", "local changes")
        ));
    }
    if let Some(b) = f["blocked"].as_str() {
        why.push(format!("receiving stopped ({})", printable(b)));
    }
    let writers = u(f, "waiting_for_writers");
    if writers > 0 {
        why.push(format!(
            "{} {} for files open for writing through the mount",
            plural(writers, "remote version", "remote versions"),
            if writers == 1 { "waits" } else { "wait" }
        ));
    }
    let content = u(f, "waiting_for_content");
    if content > 0 {
        why.push(format!(
            "{} {} for the local version {} with to be fetched",
            plural(content, "remote version", "remote versions"),
            if content == 1 { "waits" } else { "wait" },
            if content == 1 {
                "it conflicts"
            } else {
                "they conflict"
            }
        ));
    }
    let peers: Vec<&Value> = f["peers"].as_array().into_iter().flatten().collect();
    let up: Vec<String> = peers
        .iter()
        .filter(|p| p["connected"] == true && p["in_sync"] == true)
        .map(|p| peer_name(p))
        .collect();
    if why.is_empty() && up.len() == peers.len() {
        return if peers.is_empty() {
            "up to date (shared with no peer)".into()
        } else {
            format!("in sync with every peer that shares it ({})", up.join(", "))
        };
    }
    if !peers.is_empty() {
        why.push(format!(
            "up to date with {} of {}",
            up.len(),
            plural(peers.len() as u64, "peer", "peers")
        ));
    }
    for p in peers
        .iter()
        .filter(|p| !(p["connected"] == true && p["in_sync"] == true))
    {
        if p["connected"] == true && p["scanning"] == true {
            why.push(format!(
                "waiting for {}'s first scan: {}",
                peer_name(p),
                scan_words(&p["scan"])
            ));
        } else {
            why.push(format!(
                "{} {}",
                peer_name(p),
                peer_state(p, started_unix, tz)
            ));
        }
    }
    why.join("; ")
}

/// How a peer's address was learned, in words (`address_source` in `status --json`).
pub fn source_words(source: &str) -> &'static str {
    match source {
        "static" => "its configured address",
        "lan" => "found on the LAN",
        "peer" => "learned from a peer",
        "incoming" => "it dialed this device",
        "remembered" => "where it was last time",
        _ => "learned",
    }
}

/// What to run on `peer` so that it shares `folder` with this device (`me`): the answer to a
/// pairing question (a connected peer that does not share the folder back).
pub fn pairing_hint(folder: &str, me: &str, peer: &str) -> String {
    format!(
        "on {peer} run `meshfs share {folder} {me}` (first `meshfs folder add PATH --id {folder}` if it has no folder {folder})"
    )
}

/// Every connected peer that does not share a folder back, with what to run on it, or none.
pub fn pairing_questions(st: &Value) -> Vec<String> {
    let me = s(&st["device"], "id");
    let peers = peers_by_id(st);
    let mut out = Vec::new();
    for f in st["folders"].as_array().into_iter().flatten() {
        for p in f["peers"].as_array().into_iter().flatten() {
            if p["connected"] == true && p["not_shared"] == true {
                let name = peers
                    .get(s(p, "device_id"))
                    .map_or_else(|| peer_name(p), |q| peer_name(q));
                out.push(format!(
                    "{name} is connected but does not share folder {} with this device: {}",
                    s(f, "id"),
                    pairing_hint(s(f, "id"), me, &name)
                ));
            }
        }
    }
    out
}

/// A folder's role and past versions in words: `past versions: 12 (3.4 MiB kept here, for 30
/// days)`, `send-only: 2 changes of peers not applied here (meshfs override …): a.txt, b.txt`,
/// `receive-only: 1 local change not sent (meshfs revert …): notes.txt`.
pub fn versions_lines(f: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let v = &f["versions"];
    let days = u(v, "max_age_days");
    let kept = if days == 0 {
        "keeping is off".to_string()
    } else {
        format!(
            "{:.1} MiB kept here, for {}",
            u(v, "bytes") as f64 / (1 << 20) as f64,
            plural(days, "day", "days")
        )
    };
    out.push(format!("past versions: {} ({kept})", u(v, "count")));
    let list = |l: &Value| -> String {
        let items: Vec<String> = strs(&l["items"]).take(5).map(printable).collect();
        let more = u(l, "count").saturating_sub(items.len() as u64);
        let mut t = items.join(", ");
        if more > 0 {
            t.push_str(&format!(" and {more} more"));
        }
        t
    };
    let id = s(f, "id");
    match s(f, "role") {
        "send-only" => {
            let n = u(&f["not_applied"], "count");
            if n > 0 {
                out.push(format!(
                    "send-only: {} of peers not applied here (`meshfs override {id}` makes this device's state win): {}",
                    plural(n, "change", "changes"),
                    list(&f["not_applied"])
                ));
            } else {
                out.push("send-only: every peer change is in this device's state".into());
            }
        }
        "receive-only" => {
            let n = u(&f["not_sent"], "count");
            if n > 0 {
                out.push(format!(
                    "receive-only: {} not sent (`meshfs revert {id}` brings the shared state back): {}",
                    plural(n, "local change", "local changes"),
                    list(&f["not_sent"])
                ));
            } else {
                out.push("receive-only: no local change".into());
            }
        }
        _ => {}
    }
    out
}

/// `last error at 10:42: …` (the message escaped: it can hold a peer's words), or nothing
/// when there was none.
pub fn last_error_line(v: &Value, tz: UtcOffset) -> Option<String> {
    let e = &v["last_error"];
    let message = printable(e["message"].as_str()?);
    Some(format!(
        "last error at {}: {message}",
        local_time(u(e, "unix"), tz)
    ))
}

/// `secret.txt (Permission denied)` for the first of `items`, and how many more there are.
pub fn first_of(items: &Value, folder: &str) -> Option<String> {
    let all = items.as_array()?;
    let first = all.first()?;
    let more = match all.len() - 1 {
        0 => String::new(),
        n => format!(" and {n} more (`meshfs status {folder} --pending`)"),
    };
    Some(format!(
        "{} ({}){more}",
        t(first, "path"),
        t(first, "error")
    ))
}
