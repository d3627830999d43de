//! `meshfs status [FOLDER-ID] --pending`: what waits in a folder, path by path, and why, as
//! the daemon lists it (the control socket's `pending` op; fields in `docs/cli.md`).

use crate::EXIT_NO_DAEMON;
use anyhow::bail;
use meshfs_daemon::config::{Config, Home};
use meshfs_daemon::control::{self, Request};
use meshfs_daemon::readout::journal::printable;
use meshfs_daemon::readout::status::t;
use meshfs_protocol::FolderId;
use serde_json::Value;
use std::fmt::Write as _;

/// Runs `status --pending`; returns the exit code.
pub fn run(home: &Home, folder: Option<FolderId>, json: bool) -> anyhow::Result<u8> {
    let config = Config::load(home)?;
    if let Some(id) = &folder {
        if config.folder(id).is_none() {
            bail!("no folder {:?} (see `meshfs folder list`)", id.as_str());
        }
    }
    let Some(reply) = control::request(home, &Request::Pending { folder })? else {
        eprintln!(
            "meshfs: no daemon is running for {} (start it with `meshfs daemon`); what waits is known only to it",
            home.config_dir.display()
        );
        return Ok(EXIT_NO_DAEMON);
    };
    if !crate::reply_ok(&reply) {
        bail!(
            "{}",
            crate::reply_error(&reply, "the daemon did not answer")
        );
    }
    if json {
        let doc = serde_json::json!({"folders": reply["folders"]});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        for f in reply["folders"].as_array().into_iter().flatten() {
            print!("{}", render(f, &config));
        }
    }
    Ok(0)
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or("")
}

fn n(v: &Value, k: &str) -> u64 {
    v.get(k).and_then(Value::as_u64).unwrap_or(0)
}

/// A peer's name from the config, or its short id.
fn peer_name(config: &Config, device_id: &str) -> String {
    config
        .peers
        .iter()
        .find(|p| p.id.to_string() == device_id && !p.name.is_empty())
        .map_or_else(
            || device_id.chars().take(7).collect(),
            |p| printable(&p.name),
        )
}

/// One section: its heading with the count, its lines, and how many are not shown.
fn section(o: &mut String, heading: &str, count: u64, lines: Vec<String>) {
    if count == 0 {
        return;
    }
    let _ = writeln!(o, "  {heading} ({count}):");
    let shown = lines.len() as u64;
    for l in lines {
        let _ = writeln!(o, "    {l}");
    }
    if count > shown {
        let _ = writeln!(o, "    … and {} more", count - shown);
    }
}

/// The human listing of one folder's `pending` document.
pub fn render(f: &Value, config: &Config) -> String {
    let mut o = String::new();
    let mut body = String::new();
    if f["scanning"] == true {
        let _ = writeln!(
            body,
            "  first scan running: files not hashed yet are not listed"
        );
    }
    if let Some(b) = f["blocked"].as_str() {
        let _ = writeln!(body, "  receiving stopped: {}", printable(b));
    }
    if f["rescan_waiting"] == true {
        let _ = writeln!(body, "  a rescan of the whole folder waits");
    }
    let items = |k: &str| -> Vec<Value> { f[k]["items"].as_array().cloned().unwrap_or_default() };
    let capture = items("capture")
        .iter()
        .map(|c| {
            if c["open_for_writing"] == true {
                format!(
                    "{}  (written; waits for its writer to close it)",
                    t(c, "path")
                )
            } else {
                t(c, "path")
            }
        })
        .collect();
    section(
        &mut body,
        "local changes being recorded",
        n(&f["capture"], "count"),
        capture,
    );
    let errors = |k: &str| -> Vec<String> {
        items(k)
            .iter()
            .map(|e| format!("{}  {}", t(e, "path"), t(e, "error")))
            .collect()
    };
    section(
        &mut body,
        "remote versions skipped, they cannot be applied here",
        n(&f["skipped"], "count"),
        errors("skipped"),
    );
    section(
        &mut body,
        "files not replicated, they cannot be read",
        n(&f["unreadable"], "count"),
        errors("unreadable"),
    );
    let deferred = items("waiting_for_writers")
        .iter()
        .map(|d| {
            let why = match s(d, "waits_for") {
                "content" => "  (its conflict's local version is fetched first)",
                _ => "",
            };
            format!(
                "{}  from {}{why}",
                t(d, "path"),
                peer_name(config, s(d, "from"))
            )
        })
        .collect();
    section(
        &mut body,
        "remote versions waiting for a writer through the mount or for a local version",
        n(&f["waiting_for_writers"], "count"),
        deferred,
    );
    for p in f["unacknowledged"].as_array().into_iter().flatten() {
        let name = match s(p, "name") {
            "" => s(p, "device_id").chars().take(7).collect(),
            _ => t(p, "name"),
        };
        let state = if p["connected"] == true {
            "connected"
        } else {
            "not connected"
        };
        let paths = meshfs_daemon::readout::status::strs(&p["paths"])
            .map(printable)
            .collect();
        let heading = format!(
            "not yet acknowledged by {name} ({state}; acknowledged up to sequence {})",
            n(p, "acked")
        );
        section(&mut body, &heading, n(p, "count"), paths);
    }
    if body.is_empty() {
        let _ = writeln!(o, "folder {}: nothing waits", s(f, "id"));
    } else {
        let _ = writeln!(o, "folder {}:", s(f, "id"));
        o.push_str(&body);
    }
    o
}
