//! `meshfs pin`, `unpin`, `evict` and `folder set`: files on demand (docs/decisions.md,
//! D90–D94). The first three ask the running daemon; `folder set` edits the config and has a
//! running daemon read it again.

use crate::versions_cmd::{ask, require_folder};
use anyhow::bail;
use meshfs_daemon::config::{format_size, parse_size, Config, FreeFloor, Home};
use meshfs_daemon::control::Request;
use meshfs_protocol::FolderId;

/// Exit code: no daemon (as in main).
const EXIT_NO_DAEMON: u8 = 3;

/// A `--on-demand-under` argument: a path in the folder, written back normalized.
pub fn parse_subtree(s: &str) -> Result<String, String> {
    meshfs_daemon::config::subtree(s).map(|p| p.as_str().to_string())
}

/// What `folder add` asks of files on demand.
#[derive(Clone, Debug, Default)]
pub struct Demand {
    /// On demand.
    pub on: bool,
    /// Only these subtrees (empty: the whole folder).
    pub under: Vec<String>,
    /// The budget.
    pub cache_max: Option<u64>,
    /// The free floor.
    pub min_free: Option<FreeFloor>,
}

/// A `--cache-max` argument: a size (`64MiB`, `2GiB`, bytes).
pub fn parse_cache_max(s: &str) -> Result<u64, String> {
    parse_size(s)
}

/// A `folder set --cache-max` value: a size, or none (no budget).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budget(pub Option<u64>);

/// A `folder set --cache-max` argument: a size, or `none` (no budget).
pub fn parse_cache_max_or_none(s: &str) -> Result<Budget, String> {
    if s.eq_ignore_ascii_case("none") {
        return Ok(Budget(None));
    }
    parse_size(s).map(|b| Budget(Some(b)))
}

/// A `--min-free` argument: a share of the disk (`5%`) or a size.
pub fn parse_min_free(s: &str) -> Result<FreeFloor, String> {
    FreeFloor::parse(s)
}

/// A `folder set --min-free` value: a floor, or the default.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Floor(pub Option<FreeFloor>);

/// A `folder set --min-free` argument: a share, a size, or `default`.
pub fn parse_min_free_or_default(s: &str) -> Result<Floor, String> {
    if s.eq_ignore_ascii_case("default") {
        return Ok(Floor(None));
    }
    FreeFloor::parse(s).map(|f| Floor(Some(f)))
}

/// `meshfs folder set ID [--on-demand | --on-demand-under PATH... | --no-on-demand]
/// [--cache-max SIZE|none] [--min-free N%|SIZE|default]`. Turning on demand on or off sets
/// the subtrees too: `under` (empty: the whole folder).
pub fn folder_set(
    home: &Home,
    id: &FolderId,
    on_demand: Option<bool>,
    under: Vec<String>,
    cache_max: Option<Budget>,
    min_free: Option<Floor>,
) -> anyhow::Result<u8> {
    if on_demand.is_none() && cache_max.is_none() && min_free.is_none() {
        bail!("nothing to set: give --on-demand, --on-demand-under, --no-on-demand, --cache-max or --min-free");
    }
    let old = require_folder(home, id)?;
    let mut new: Config = old.clone();
    let Some(f) = new.folders.iter_mut().find(|f| &f.id == id) else {
        bail!("no folder {:?} (see `meshfs folder list`)", id.as_str());
    };
    if let Some(on) = on_demand {
        f.on_demand = on;
        f.on_demand_under = under;
    }
    if let Some(Budget(max)) = cache_max {
        f.cache_max = max;
    }
    if let Some(Floor(floor)) = min_free {
        f.min_free = floor;
    }
    if (f.cache_max.is_some() || f.min_free.is_some()) && !f.on_demand {
        eprintln!(
            "meshfs: note: --cache-max and --min-free are kept only while the folder is on demand (`--on-demand`)"
        );
    }
    new.validate(home)?;
    new.save(home)?;
    if let Err(e) = crate::reload_if_running(home) {
        let _ = old.save(home);
        let _ = crate::reload_if_running(home);
        return Err(e);
    }
    Ok(0)
}

/// `meshfs pin FOLDER PATH`.
pub fn pin(home: &Home, folder: FolderId, path: String, json: bool) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let req = Request::Pin {
        folder: folder.clone(),
        path: path.clone(),
    };
    let Some(r) = ask(home, &req, "pin")? else {
        return Ok(EXIT_NO_DAEMON);
    };
    let failed = r["pin"]["failed"].as_array().cloned().unwrap_or_default();
    if json {
        println!("{}", serde_json::to_string_pretty(&r["pin"])?);
    } else {
        println!(
            "pinned {path} in {folder}: {} file(s) fetched now; kept here from now on",
            r["pin"]["fetched"].as_u64().unwrap_or(0)
        );
        for f in &failed {
            eprintln!(
                "meshfs: not fetched: {} ({}: {}); it is fetched when opened, or by `meshfs pin` again",
                f["path"].as_str().unwrap_or("?"),
                f["errno"].as_str().unwrap_or("?"),
                f["error"].as_str().unwrap_or("?")
            );
        }
    }
    Ok(if failed.is_empty() { 0 } else { 1 })
}

/// `meshfs unpin FOLDER PATH`.
pub fn unpin(home: &Home, folder: FolderId, path: String) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let req = Request::Unpin {
        folder: folder.clone(),
        path: path.clone(),
    };
    let Some(r) = ask(home, &req, "unpin")? else {
        return Ok(EXIT_NO_DAEMON);
    };
    if r["unpinned"].as_bool() == Some(true) {
        println!(
            "unpinned {path} in {folder}: its files stay here until the budget needs the room"
        );
        Ok(0)
    } else {
        eprintln!("meshfs: {path} is not pinned in {folder} (a pin covers what is below it: unpin the directory that was pinned)");
        Ok(1)
    }
}

/// `meshfs evict FOLDER PATH`.
pub fn evict(home: &Home, folder: FolderId, path: String, json: bool) -> anyhow::Result<u8> {
    require_folder(home, &folder)?;
    let req = Request::Evict {
        folder: folder.clone(),
        path: path.clone(),
    };
    let Some(r) = ask(home, &req, "evict")? else {
        return Ok(EXIT_NO_DAEMON);
    };
    let e = &r["evict"];
    if json {
        println!("{}", serde_json::to_string_pretty(e)?);
        return Ok(0);
    }
    let evicted = e["evicted"].as_array().map_or(0, |a| a.len());
    println!(
        "evicted {evicted} file(s) of {path} in {folder}, {} freed; {} of content local now{}",
        format_size(e["freed_bytes"].as_u64().unwrap_or(0)),
        format_size(e["local_bytes"].as_u64().unwrap_or(0)),
        e["cache_max"]
            .as_u64()
            .map(|m| format!(" (budget {})", format_size(m)))
            .unwrap_or_default()
    );
    for k in e["kept"].as_array().cloned().unwrap_or_default() {
        println!(
            "kept {}: {}",
            k["path"].as_str().unwrap_or("?"),
            k["why"].as_str().unwrap_or("?")
        );
    }
    Ok(0)
}
