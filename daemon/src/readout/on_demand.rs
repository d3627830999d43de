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
    let mut out = vec![summary_line(d)];
    out.extend(floor_line(d));
    out.extend(over_budget_line(d));
    out.extend(under_line(d));
    out.extend(pins_line(d));
    out.extend(
        d["fetching"]
            .as_array()
            .into_iter()
            .flatten()
            .map(fetching_line),
    );
    out.extend(unavailable_lines(d));
    out
}

/// `on demand: 12MiB local in 3 files, 1GiB online only in 10 files (budget 64MiB)`, of an
/// `on_demand` object.
pub fn summary_line(d: &Value) -> String {
    let budget = match d["cache_max"].as_u64() {
        Some(max) => format!(" (budget {})", size_words(max)),
        None => " (no budget)".into(),
    };
    format!(
        "on demand: {} local in {}, {} online only in {}{budget}",
        size_words(u(d, "local_bytes")),
        plural(u(d, "local_files"), "file", "files"),
        size_words(u(d, "online_bytes")),
        plural(u(d, "online_files"), "file", "files"),
    )
}

/// The disk's free floor (D97) and what is free now: `disk: 40GiB free, kept above 5GiB (5%)
/// by evicting`; none when the floor is 0.
pub fn floor_line(d: &Value) -> Option<String> {
    let floor = d["min_free_bytes"].as_u64().filter(|&b| b > 0)?;
    let free = match d["disk_free_bytes"].as_u64() {
        Some(f) => format!("{} free", size_words(f)),
        None => "free space unknown".into(),
    };
    Some(format!(
        "disk: {free}, kept above {} ({}) by evicting",
        size_words(floor),
        s(d, "min_free")
    ))
}

/// Whether the disk's free space is below its floor now.
pub fn below_floor(d: &Value) -> bool {
    let floor = u(d, "min_free_bytes");
    d["disk_free_bytes"].as_u64().is_some_and(|b| b < floor)
}

/// How far it is over its budget, when it is.
pub fn over_budget_line(d: &Value) -> Option<String> {
    let over = u(d, "over_budget");
    (over > 0).then(|| {
        format!(
            "over its budget by {}: the rest is pinned, open, outside its on-demand subtrees, or held by no connected peer",
            size_words(over)
        )
    })
}

/// `on demand only under: big, archive/2019 (the rest is kept here)`, when only subtrees are
/// on demand (D77).
pub fn under_line(d: &Value) -> Option<String> {
    let under: Vec<String> = super::status::strs(&d["under"]).map(printable).collect();
    (!under.is_empty()).then(|| {
        format!(
            "on demand only under: {} (the rest is kept here)",
            under.join(", ")
        )
    })
}

/// `pinned: photos, docs/a.pdf`, when anything is.
pub fn pins_line(d: &Value) -> Option<String> {
    let pins: Vec<String> = super::status::strs(&d["pins"]).map(printable).collect();
    (!pins.is_empty()).then(|| format!("pinned: {}", pins.join(", ")))
}

/// `fetching a.bin for pid 42: 1MiB of 8MiB`, of one of `on_demand.fetching`.
pub fn fetching_line(x: &Value) -> String {
    let pid = u(x, "pid");
    let who = if pid == 0 {
        "for a pin".to_string()
    } else {
        format!("for pid {pid}")
    };
    format!(
        "fetching {} {who}: {} of {}",
        printable(s(x, "path")),
        size_words(u(x, "done")),
        size_words(u(x, "size"))
    )
}

/// What could not be fetched: the first five, then how many more.
pub fn unavailable_lines(d: &Value) -> Vec<String> {
    let mut out: Vec<String> = d["unavailable"]
        .as_array()
        .into_iter()
        .flatten()
        .take(5)
        .map(|x| {
            format!(
                "could not fetch {} ({}): {}",
                printable(s(x, "path")),
                s(x, "errno"),
                printable(s(x, "error"))
            )
        })
        .collect();
    let listed = d["unavailable"].as_array().map_or(0, |a| a.len() as u64);
    let more = listed.saturating_sub(5) + u(d, "unavailable_unlisted");
    if more > 0 {
        out.push(format!("and {more} more that could not be fetched"));
    }
    out
}

/// `budget: 12MiB of 64MiB used (18%)`, when it has one.
pub fn budget_line(d: &Value) -> Option<String> {
    let max = d["cache_max"].as_u64()?;
    let local = u(d, "local_bytes");
    Some(format!(
        "budget: {} of {} used ({}%)",
        size_words(local),
        size_words(max),
        (local as u128 * 100)
            .checked_div(max as u128)
            .unwrap_or(100)
    ))
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

    #[test]
    fn the_budget_reads_as_used_of_max_and_the_disk_as_free_against_its_floor() {
        let d = serde_json::json!({"cache_max": 64u64 << 20, "local_bytes": 16u64 << 20,
            "min_free": "5%", "min_free_bytes": 5u64 << 30, "disk_free_bytes": 4u64 << 30});
        assert_eq!(
            budget_line(&d).unwrap(),
            "budget: 16MiB of 64MiB used (25%)"
        );
        assert!(below_floor(&d));
        let none = serde_json::json!({"cache_max": null, "local_bytes": 1, "min_free": "0",
            "min_free_bytes": 0, "disk_free_bytes": null});
        assert!(budget_line(&none).is_none());
        assert!(floor_line(&none).is_none());
        assert!(!below_floor(&none));
        let zero = serde_json::json!({"cache_max": 0, "local_bytes": 0});
        assert_eq!(
            budget_line(&zero).unwrap(),
            "budget: 0 bytes of 0 bytes used (100%)"
        );
    }
}
