//! An on-demand folder's lines of `meshfs status`, from its `on_demand` object (D90–D94): what
//! is local against the budget and the disk's free floor (D97), what is being fetched and for which process, and what could
//! not be fetched.

use super::journal::printable;
use super::status::{plural, s, u};
use crate::config::format_size;
use serde_json::Value;

/// A size for a person: `64MiB`, `1.5GiB`, `12KiB`, `900 bytes`.
pub fn size_words(bytes: u64) -> String {
    for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift {
            return if bytes.is_multiple_of(1 << shift) {
                format_size(bytes)
            } else {
                format!("{:.1}{unit}", bytes as f64 / (1u64 << shift) as f64)
            };
        }
    }
    format!("{bytes} bytes")
}

/// The lines (none when the folder is not on demand).
pub fn on_demand_lines(f: &Value) -> Vec<String> {
    let d = &f["on_demand"];
    if !d.is_object() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let budget = match d["cache_max"].as_u64() {
        Some(max) => format!(" (budget {})", size_words(max)),
        None => " (no budget)".into(),
    };
    out.push(format!(
        "on demand: {} local in {}, {} online only in {}{budget}",
        size_words(u(d, "local_bytes")),
        plural(u(d, "local_files"), "file", "files"),
        size_words(u(d, "online_bytes")),
        plural(u(d, "online_files"), "file", "files"),
    ));
    if let Some(floor) = d["min_free_bytes"].as_u64().filter(|&b| b > 0) {
        let free = match d["disk_free_bytes"].as_u64() {
            Some(f) => format!("{} free", size_words(f)),
            None => "free space unknown".into(),
        };
        out.push(format!(
            "disk: {free}, kept above {} ({}) by evicting",
            size_words(floor),
            s(d, "min_free")
        ));
    }
    let over = u(d, "over_budget");
    if over > 0 {
        out.push(format!(
            "over its budget by {}: the rest is pinned, open, outside its on-demand subtrees, or held by no connected peer",
            size_words(over)
        ));
    }
    let under: Vec<String> = d["under"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(printable)
        .collect();
    if !under.is_empty() {
        out.push(format!(
            "on demand only under: {} (the rest is kept here)",
            under.join(", ")
        ));
    }
    let pins: Vec<String> = d["pins"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .map(printable)
        .collect();
    if !pins.is_empty() {
        out.push(format!("pinned: {}", pins.join(", ")));
    }
    for x in d["fetching"].as_array().into_iter().flatten() {
        let pid = u(x, "pid");
        let who = if pid == 0 {
            "for a pin".to_string()
        } else {
            format!("for pid {pid}")
        };
        out.push(format!(
            "fetching {} {who}: {} of {}",
            printable(s(x, "path")),
            size_words(u(x, "done")),
            size_words(u(x, "size"))
        ));
    }
    for x in d["unavailable"].as_array().into_iter().flatten().take(5) {
        out.push(format!(
            "could not fetch {} ({}): {}",
            printable(s(x, "path")),
            s(x, "errno"),
            printable(s(x, "error"))
        ));
    }
    let listed = d["unavailable"].as_array().map_or(0, |a| a.len() as u64);
    let more = listed.saturating_sub(5) + u(d, "unavailable_unlisted");
    if more > 0 {
        out.push(format!("and {more} more that could not be fetched"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_on_demand_folder_says_what_is_local_what_is_fetched_and_what_could_not_be() {
        let f = serde_json::json!({"on_demand": {
            "cache_max": 64u64 << 20, "local_files": 2, "local_bytes": 3u64 << 20,
            "online_files": 10, "online_bytes": 1u64 << 30, "over_budget": 0,
            "pins": ["photos"], "fetching": [{"path": "a.bin", "pid": 42, "size": 100, "done": 50}],
            "unavailable": [{"path": "b.bin", "error": "no connected peer", "errno": "EHOSTUNREACH", "at_unix": 1}],
            "unavailable_unlisted": 0, "min_free_bytes": 5u64 << 30, "min_free": "5%",
            "disk_free_bytes": 40u64 << 30}});
        let lines = on_demand_lines(&f);
        assert_eq!(
            lines[0],
            "on demand: 3MiB local in 2 files, 1GiB online only in 10 files (budget 64MiB)"
        );
        assert_eq!(
            lines[1],
            "disk: 40GiB free, kept above 5GiB (5%) by evicting"
        );
        assert_eq!(lines[2], "pinned: photos");
        assert_eq!(lines[3], "fetching a.bin for pid 42: 50 bytes of 100 bytes");
        assert_eq!(
            lines[4],
            "could not fetch b.bin (EHOSTUNREACH): no connected peer"
        );
        assert!(on_demand_lines(&serde_json::json!({"on_demand": null})).is_empty());
        let f = serde_json::json!({"on_demand": {"local_files": 1, "local_bytes": 1,
            "online_files": 0, "online_bytes": 0, "under": ["big", "archive/2019"], "pins": []}});
        assert_eq!(
            on_demand_lines(&f)[1],
            "on demand only under: big, archive/2019 (the rest is kept here)"
        );
    }
}
