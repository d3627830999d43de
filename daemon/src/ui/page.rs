//! The page's HTML: the whole document for a first load (it reads without JavaScript), and
//! each of its live sections (`head`, `folders`, `peers`, `conflicts`, `rows`) alone, which
//! the event stream sends again as they change. Every word comes from `readout` (the same as
//! `meshfs status`, `status --watch` and `meshfs journal` print); every value is escaped here.
//! Pure: takes the status document and what the journal gave, returns text.

use super::http::encode;
use crate::conflicts::ConflictFile;
use crate::readout::journal::Row;
use crate::readout::on_demand as od;
use crate::readout::rates::{bytes, folder_work, peer_link, History};
use crate::readout::status::{
    first_of, folder_summary, last_error_line, local_time, peer_name, peer_state, plural, s,
    source_words, u,
};
use crate::versions::listing::Content;
use serde_json::Value;
use std::collections::HashMap;
use std::fmt::Write as _;
use time::UtcOffset;

/// The live sections, by element id, in page order.
pub const SECTIONS: [&str; 5] = ["head", "folders", "peers", "conflicts", "rows"];

/// `s` escaped for HTML text and attribute values.
pub fn esc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// `UTC` or `UTC+01:00`.
pub fn zone(tz: UtcOffset) -> String {
    if tz == UtcOffset::UTC {
        return "UTC".into();
    }
    let (h, m, _) = tz.as_hms();
    let sign = if tz.is_negative() { '-' } else { '+' };
    format!("UTC{sign}{:02}:{:02}", h.abs(), m.abs())
}

/// Device names by short id: this device's and its peers'.
pub struct Names(HashMap<String, String>);

impl Names {
    /// The names `st` knows.
    pub fn of(st: &Value) -> Names {
        let mut by = HashMap::new();
        let dev = &st["device"];
        by.insert(
            s(dev, "short_id").to_string(),
            format!("{} (this device)", s(dev, "name")),
        );
        for p in st["peers"].as_array().into_iter().flatten() {
            by.insert(s(p, "short_id").to_string(), peer_name(p));
        }
        Names(by)
    }

    /// `laptop (EXAK3F4)`, or the short id alone for a device not known here.
    pub fn device(&self, short: &str) -> String {
        match self.0.get(short) {
            Some(name) => format!("{name} ({short})"),
            None => short.to_string(),
        }
    }
}

/// The header: this device, whether everything is in sync, when this was taken.
pub fn head(st: &Value, tz: UtcOffset, now_unix: u64) -> String {
    let dev = &st["device"];
    let folders: Vec<&Value> = st["folders"].as_array().into_iter().flatten().collect();
    let behind = folders.iter().filter(|f| f["in_sync"] != true).count();
    let (class, words) = if folders.is_empty() {
        ("idle", "no folders".to_string())
    } else if behind == 0 {
        ("ok", "in sync".to_string())
    } else {
        (
            "bad",
            format!(
                "not in sync: {behind} of {}",
                plural(folders.len() as u64, "folder", "folders")
            ),
        )
    };
    let clock = time::OffsetDateTime::from_unix_timestamp(now_unix as i64)
        .map(|t| {
            let t = t.to_offset(tz);
            format!("{:02}:{:02}:{:02}", t.hour(), t.minute(), t.second())
        })
        .unwrap_or_default();
    format!(
        "<h1>{name} <small>{short}</small></h1>\
         <p class=\"sync {class}\" data-in-sync=\"{all}\">{words}</p>\
         <p class=\"meta\">updated {clock} {zone}; daemon up since {since}</p>",
        name = esc(s(dev, "name")),
        short = esc(s(dev, "short_id")),
        all = st["in_sync"] == true,
        words = esc(&words),
        zone = zone(tz),
        since = esc(&local_time(u(dev, "started_unix"), tz)),
    )
}

/// Each folder: in sync or why not, what it holds, the work going on with rate and ETA, where
/// it is mounted, what it cannot replicate, its last error, each peer sharing it.
pub fn folders(st: &Value, h: &History, tz: UtcOffset) -> String {
    let started = u(&st["device"], "started_unix");
    let mut o = String::from("<h2>Folders</h2>");
    let folders: Vec<&Value> = st["folders"].as_array().into_iter().flatten().collect();
    if folders.is_empty() {
        o.push_str(
            "<p class=\"none\">No folders (add one with <code>meshfs folder add PATH</code>).</p>",
        );
    }
    for f in folders {
        let id = s(f, "id");
        let synced = f["in_sync"] == true;
        let _ = write!(
            o,
            "<article class=\"folder\" data-folder=\"{id}\" data-in-sync=\"{synced}\">\
             <h3>{id} <span class=\"badge {class}\">{state}</span></h3>\
             <p class=\"path\">{path}</p><p class=\"why\">{why}</p>\
             <p>{files}, {dirs}, {size}, {conflicts}</p>",
            id = esc(id),
            class = if synced { "ok" } else { "bad" },
            state = if synced { "in sync" } else { "not in sync" },
            path = esc(s(f, "path")),
            why = esc(&folder_summary(f, started, tz)),
            files = plural(u(f, "files"), "file", "files"),
            dirs = plural(u(f, "dirs"), "directory", "directories"),
            size = bytes(u(f, "bytes") as f64),
            conflicts = plural(u(f, "conflicts"), "conflict", "conflicts"),
        );
        let work = folder_work(f, st, h);
        if !work.is_empty() {
            o.push_str("<ul class=\"work\">");
            for w in work {
                let _ = write!(o, "<li>{}</li>", esc(&w));
            }
            o.push_str("</ul>");
        }
        let m = &f["mount"];
        if m.is_object() {
            let _ = write!(
                o,
                "<p class=\"mount\">mounted at <code>{}</code> ({}, {} open handle(s))</p>",
                esc(s(m, "mountpoint")),
                esc(s(m, "mode")),
                u(m, "open_handles")
            );
        } else {
            o.push_str("<p class=\"mount\">not mounted</p>");
        }
        o.push_str(&on_demand(f));
        if let Some(first) = first_of(&f["unreadable"], id) {
            let _ = write!(
                o,
                "<p class=\"warn\">not replicated, cannot be read: {}</p>",
                esc(&first)
            );
        }
        if let Some(first) = first_of(&f["skipped"], id) {
            let _ = write!(
                o,
                "<p class=\"warn\">remote version skipped, cannot be applied: {}</p>",
                esc(&first)
            );
        }
        if let Some(e) = last_error_line(f, tz) {
            let _ = write!(o, "<p class=\"warn\">{}</p>", esc(&e));
        }
        let peers: Vec<&Value> = f["peers"].as_array().into_iter().flatten().collect();
        if !peers.is_empty() {
            o.push_str("<ul class=\"with\">");
            for p in peers {
                let _ = write!(
                    o,
                    "<li>with {}: {}</li>",
                    esc(&peer_name(p)),
                    esc(&peer_state(p, started, tz))
                );
            }
            o.push_str("</ul>");
        }
        let _ = write!(
            o,
            "<form method=\"post\" action=\"/scan?folder={}\"><button>Rescan now</button></form></article>",
            super::http::encode(id)
        );
    }
    o
}

/// An on-demand folder's facts (nothing for a folder kept whole), in the words of `meshfs
/// status`: what is local and what is online only, the budget with a gauge, the disk's free
/// floor, pins, each file being fetched with the process whose open asked for it and a gauge
/// of what is here, what is over the budget and what could not be fetched.
fn on_demand(f: &Value) -> String {
    let d = &f["on_demand"];
    if !d.is_object() {
        return String::new();
    }
    let mut o = format!(
        "<div class=\"ondemand\"><p class=\"od-summary\">{}</p>",
        esc(&od::summary_line(d))
    );
    if let Some(words) = od::budget_line(d) {
        let _ = write!(
            o,
            "<p class=\"od-budget\"><meter min=\"0\" max=\"{max}\" value=\"{local}\" \
             high=\"{high}\" optimum=\"0\"></meter> {words}</p>",
            max = u(d, "cache_max"),
            local = u(d, "local_bytes"),
            high = u(d, "cache_max") / 10 * 9,
            words = esc(&words),
        );
    }
    if let Some(floor) = od::floor_line(d) {
        let _ = write!(
            o,
            "<p class=\"od-floor{}\">{}</p>",
            if od::below_floor(d) { " warn" } else { "" },
            esc(&floor)
        );
    }
    if let Some(over) = od::over_budget_line(d) {
        let _ = write!(o, "<p class=\"warn\">{}</p>", esc(&over));
    }
    if let Some(under) = od::under_line(d) {
        let _ = write!(o, "<p>{}</p>", esc(&under));
    }
    if let Some(pins) = od::pins_line(d) {
        let _ = write!(o, "<p>{}</p>", esc(&pins));
    }
    let fetching: Vec<&Value> = d["fetching"].as_array().into_iter().flatten().collect();
    if !fetching.is_empty() {
        o.push_str("<ul class=\"fetching\">");
        for x in fetching {
            let _ = write!(
                o,
                "<li data-path=\"{path}\" data-pid=\"{pid}\">{words} \
                 <progress max=\"{size}\" value=\"{done}\"></progress></li>",
                path = esc(s(x, "path")),
                pid = u(x, "pid"),
                words = esc(&od::fetching_line(x)),
                size = u(x, "size").max(1),
                done = u(x, "done"),
            );
        }
        o.push_str("</ul>");
    }
    let unavailable = od::unavailable_lines(d);
    if !unavailable.is_empty() {
        o.push_str("<ul class=\"unavailable warn\">");
        for line in unavailable {
            let _ = write!(o, "<li>{}</li>", esc(&line));
        }
        o.push_str("</ul>");
    }
    o.push_str("</div>");
    o
}

/// Each peer: connected or since when not, where, round trip, rates, folders, last error; and
/// the unknown devices that tried to connect.
pub fn peers(st: &Value, h: &History, tz: UtcOffset) -> String {
    let mut o = String::from("<h2>Peers</h2>");
    let peers: Vec<&Value> = st["peers"].as_array().into_iter().flatten().collect();
    if peers.is_empty() {
        o.push_str("<p class=\"none\">No peers (add one with <code>meshfs peer add</code>).</p>");
    }
    for p in peers {
        let connected = p["connected"] == true;
        let how = p["address_source"]
            .as_str()
            .map_or(String::new(), |src| format!(" ({})", source_words(src)));
        let at = match (
            p["address"].as_str().or(p["last_seen_addr"].as_str()),
            connected,
        ) {
            (Some(a), true) => format!("at {a}{how}"),
            (Some(a), false) => format!("last at {a}"),
            (None, _) => String::new(),
        };
        let listed: Vec<&str> = crate::readout::status::strs(&p["addresses"]).collect();
        let fixed: Vec<&str> = listed.iter().copied().filter(|a| *a != "dynamic").collect();
        let dynamic = listed.contains(&"dynamic");
        let dials = match (fixed.is_empty(), dynamic) {
            (true, false) => "it dials this device".to_string(),
            (true, true) => "found wherever it is".to_string(),
            (false, false) => format!("dialed at {}", fixed.join(", ")),
            (false, true) => format!("dialed at {} or wherever it is found", fixed.join(", ")),
        };
        let folders: Vec<&str> = crate::readout::status::strs(&p["folders"]).collect();
        let _ = write!(
            o,
            "<article class=\"peer\" data-peer=\"{short}\" data-connected=\"{connected}\">\
             <h3>{name} <small>{short}</small> <span class=\"badge {class}\">{state}</span></h3>\
             <p class=\"link\">{link}</p><p>{at}{sep}{dials}; shares {folders}</p>",
            short = esc(s(p, "short_id")),
            name = esc(&peer_name(p)),
            class = if connected { "ok" } else { "bad" },
            state = if connected { "connected" } else { "offline" },
            link = esc(&peer_link(p, h, tz)),
            at = esc(&at),
            sep = if at.is_empty() { "" } else { "; " },
            dials = esc(&dials),
            folders = if folders.is_empty() {
                "no folder".to_string()
            } else {
                esc(&folders.join(", "))
            },
        );
        if let Some(e) = last_error_line(p, tz) {
            let _ = write!(o, "<p class=\"warn\">{}</p>", esc(&e));
        }
        o.push_str("</article>");
    }
    for r in crate::readout::status::strs(&st["refused_devices"]) {
        let _ = write!(
            o,
            "<p class=\"warn\">refused unknown device <code>{r}</code> (add it with <code>meshfs peer add {r} --addr HOST:PORT</code>)</p>",
            r = esc(r)
        );
    }
    o
}

/// The most conflicts listed per folder; the rest are counted.
pub const MAX_CONFLICTS_SHOWN: usize = 100;

/// Each folder's live conflicts: both versions, which device made each.
pub fn conflicts(list: &[(String, Vec<ConflictFile>)], names: &Names) -> String {
    let mut o = String::from("<h2>Conflicts</h2>");
    let total: usize = list.iter().map(|(_, c)| c.len()).sum();
    if total == 0 {
        o.push_str("<p class=\"none\">No conflicts.</p>");
        return o;
    }
    for (folder, files) in list.iter().filter(|(_, c)| !c.is_empty()) {
        let _ = write!(
            o,
            "<h3>{} <small>{}</small></h3><ul class=\"conflicts\">",
            esc(folder),
            plural(files.len() as u64, "conflict", "conflicts")
        );
        for c in files.iter().take(MAX_CONFLICTS_SHOWN) {
            let kept = match (&c.winner_device, c.winner_size) {
                (Some(d), Some(size)) => format!(
                    "kept as {}: by {}, {}{}",
                    c.original,
                    names.device(d),
                    plural(size, "byte", "bytes"),
                    c.winner_mtime_ns
                        .map(|ns| format!(", modified {} UTC", ns_time(ns)))
                        .unwrap_or_default()
                ),
                _ => format!("{} no longer exists", c.original),
            };
            let other = format!(
                "other version as {}: by {}, {}, modified {} UTC",
                c.path,
                names.device(&c.loser_device),
                plural(c.size, "byte", "bytes"),
                name_time(&c.loser_time)
            );
            let _ = write!(
                o,
                "<li data-path=\"{}\" data-original=\"{}\"><b>{}</b><br>{}<br>{}</li>",
                esc(&c.path),
                esc(&c.original),
                esc(&c.original),
                esc(&kept),
                esc(&other)
            );
        }
        if files.len() > MAX_CONFLICTS_SHOWN {
            let _ = write!(
                o,
                "<li>… and {} more (<code>meshfs conflicts {}</code>)</li>",
                files.len() - MAX_CONFLICTS_SHOWN,
                esc(folder)
            );
        }
        o.push_str("</ul>");
    }
    o
}

/// `2026-11-25 19:17:40` from ns since the epoch (UTC).
fn ns_time(ns: i64) -> String {
    crate::readout::journal::time_str(ns)
        .split('.')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// `2026-11-25 19:17:40` from a conflict name's `20261125-191740`.
fn name_time(t: &str) -> String {
    let d: Vec<char> = t.chars().filter(char::is_ascii_digit).collect();
    if d.len() != 14 {
        return t.to_string();
    }
    let p = |a: usize, b: usize| d[a..b].iter().collect::<String>();
    format!(
        "{}-{}-{} {}:{}:{}",
        p(0, 4),
        p(4, 6),
        p(6, 8),
        p(8, 10),
        p(10, 12),
        p(12, 14)
    )
}

/// The journal filter as typed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FilterForm {
    /// The folder whose journal is shown.
    pub folder: String,
    /// `--path`.
    pub path: String,
    /// `--device`.
    pub device: String,
    /// `--since`.
    pub since: String,
}

/// The journal's rows for a filter, newest first, or why the filter chooses none.
pub struct Rows {
    /// The folder.
    pub folder: String,
    /// The rows, each with where its content is, or the filter's error.
    pub rows: Result<Vec<(Row, Content)>, String>,
    /// At most this many are shown.
    pub limit: usize,
}

/// The journal table: the same columns and rows as `meshfs journal`, newest first, with where
/// each version's content is and, where it can be brought back (kept here, or asked of the
/// peers), a "restore" button: a form that posts `/restore?folder=ID&sequence=N`.
pub fn rows(r: &Rows, names: &Names) -> String {
    let mut o = String::new();
    let rows = match &r.rows {
        Ok(rows) => rows,
        Err(e) => {
            let _ = write!(o, "<p class=\"warn\" id=\"filter-error\">{}</p>", esc(e));
            return o;
        }
    };
    let _ = write!(
        o,
        "<p class=\"meta\">{} of folder {}, newest first{}; times UTC</p>",
        plural(rows.len() as u64, "entry", "entries"),
        esc(&r.folder),
        if rows.len() >= r.limit {
            format!(
                " (the newest {}; narrow the filter to see older ones)",
                r.limit
            )
        } else {
            String::new()
        }
    );
    o.push_str("<div class=\"scroll\"><table><thead><tr>");
    for c in Row::COLUMNS {
        let _ = write!(o, "<th>{c}</th>");
    }
    o.push_str("<th>content</th></tr></thead><tbody>");
    for (row, content) in rows {
        let action = match content {
            Content::Kept | Content::Partial | Content::NotHere => format!(
                "<form method=\"post\" action=\"/restore?folder={folder}&amp;sequence={seq}\">\
                 <button title=\"{title}\">restore</button></form>",
                folder = esc(&encode(&r.folder)),
                seq = row.sequence,
                title = if *content == Content::Kept {
                    "bring this version back (kept here)"
                } else {
                    "bring this version back (asks the connected peers for what is not here)"
                },
            ),
            _ => String::new(),
        };
        let _ = write!(
            o,
            "<tr data-seq=\"{seq}\" data-path=\"{path}\" data-op=\"{op}\" data-content=\"{content}\"><td>{seq}</td><td>{time}</td>\
             <td title=\"{who}\">{device}</td><td>{op}</td><td class=\"p\">{path}</td>\
             <td class=\"n\">{size}</td><td><code>{hash}</code></td><td class=\"v\"><code>{version}</code></td>\
             <td class=\"c\">{content}{action}</td></tr>",
            seq = row.sequence,
            time = esc(&row.time),
            who = esc(&names.device(&row.device)),
            device = esc(&row.device),
            op = row.op,
            path = esc(&row.path),
            size = row.size,
            hash = esc(&row.hash),
            version = esc(&row.version),
            content = content.as_str(),
        );
    }
    o.push_str("</tbody></table></div>");
    o
}

/// The journal's filter form: a plain `GET` form (it works without JavaScript; the script
/// turns it into a new event stream).
pub fn filter_form(form: &FilterForm, folders: &[String]) -> String {
    let mut o = String::from(
        "<form id=\"filter\" method=\"get\" action=\"/\"><label>folder <select name=\"folder\">",
    );
    for f in folders {
        let _ = write!(
            o,
            "<option value=\"{v}\"{sel}>{v}</option>",
            v = esc(f),
            sel = if *f == form.folder { " selected" } else { "" }
        );
    }
    let _ = write!(
        o,
        "</select></label>\
         <label>path <input name=\"path\" value=\"{}\" placeholder=\"docs/report.txt\"></label>\
         <label>device <input name=\"device\" value=\"{}\" placeholder=\"name, short id or self\"></label>\
         <label>since <input name=\"since\" value=\"{}\" placeholder=\"2h, today, 2026-11-22\"></label>\
         <input type=\"hidden\" name=\"tz\" value=\"\">\
         <button>Filter</button> <a href=\"/\">clear</a></form>",
        esc(&form.path),
        esc(&form.device),
        esc(&form.since)
    );
    o
}

/// The whole page: the sections as given (by [`SECTIONS`] id), the filter form, and a notice
/// (the outcome of a rescan) if any.
pub fn document(
    title: &str,
    sections: &HashMap<&'static str, String>,
    form: &str,
    notice: Option<&str>,
) -> String {
    let get = |id: &str| sections.get(id).map(String::as_str).unwrap_or_default();
    let notice = notice
        .map(|n| format!("<p class=\"notice\">{}</p>", esc(n)))
        .unwrap_or_default();
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>meshfs · {title}</title><link rel=\"stylesheet\" href=\"/app.css\">\
         <script src=\"/app.js\" defer></script></head><body>\
         <header><div id=\"head\">{head}</div><p id=\"live\" class=\"live off\">static view: reload for news</p></header>\
         {notice}<main>\
         <section id=\"folders\">{folders}</section>\
         <section id=\"peers\">{peers}</section>\
         <section id=\"conflicts\">{conflicts}</section>\
         <section id=\"journal\"><h2>Journal</h2>{form}<div id=\"rows\">{rows}</div></section>\
         </main></body></html>",
        title = esc(title),
        head = get("head"),
        folders = get("folders"),
        peers = get("peers"),
        conflicts = get("conflicts"),
        rows = get("rows"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn status() -> Value {
        json!({
            "device": {"id": "X", "short_id": "AAAAAAA", "name": "b<script>", "started_unix": 0},
            "in_sync": false,
            "folders": [{
                "id": "work", "path": "/w/<b>", "files": 2, "dirs": 1, "bytes": 2048,
                "conflicts": 1, "in_sync": false, "scanning": false, "capture_pending": 0,
                "waiting_for_writers": 0,
                "progress": {"scan": {"done": 0, "left": 0}, "receive": {"done": 0, "left": 0}},
                "mount": {"mountpoint": "/m", "mode": "read-write", "open_handles": 0},
                "unreadable": [], "skipped": [], "last_error": null,
                "peers": [{"device_id": "P", "name": "a", "connected": false,
                           "last_seen_unix": null, "in_sync": false}]
            }],
            "peers": [{"device_id": "P", "short_id": "BBBBBBB", "name": "a", "addresses": [],
                       "connected": false, "last_seen_unix": null, "folders": ["work"]}],
            "refused_devices": []
        })
    }

    #[test]
    fn text_from_the_daemon_or_peers_is_escaped_everywhere() {
        let st = status();
        let h = History::default();
        let all = [
            head(&st, UtcOffset::UTC, 0),
            folders(&st, &h, UtcOffset::UTC),
            peers(&st, &h, UtcOffset::UTC),
        ]
        .join("");
        assert!(!all.contains("<script>") && !all.contains("<b>"), "{all}");
        assert!(all.contains("b&lt;script&gt;") && all.contains("/w/&lt;b&gt;"));
        let form = filter_form(
            &FilterForm {
                path: "\"><img src=x>".into(),
                ..Default::default()
            },
            &["work".into()],
        );
        assert!(
            form.contains("value=\"&quot;&gt;&lt;img src=x&gt;\""),
            "{form}"
        );
    }

    #[test]
    fn a_folder_says_whether_it_is_in_sync_why_not_and_where_it_is_mounted() {
        let st = status();
        let html = folders(&st, &History::default(), UtcOffset::UTC);
        assert!(html.contains("data-folder=\"work\" data-in-sync=\"false\""));
        assert!(html.contains("not in sync"));
        assert!(html.contains("up to date with 0 of 1 peer; a never connected"));
        assert!(html.contains("mounted at <code>/m</code> (read-write"));
        assert!(html.contains("2 files, 1 directory, 2.0 KiB, 1 conflict"));
        assert!(html.contains("action=\"/scan?folder=work\""));
    }

    #[test]
    fn an_on_demand_folder_shows_its_budget_what_is_local_the_free_floor_and_each_fetch_with_its_process(
    ) {
        let mut st = status();
        let h = History::default();
        assert!(!folders(&st, &h, UtcOffset::UTC).contains("ondemand"));
        st["folders"][0]["on_demand"] = json!({
            "cache_max": 64u64 << 20, "local_files": 2, "local_bytes": 16u64 << 20,
            "online_files": 10, "online_bytes": 1u64 << 30, "over_budget": 0,
            "min_free": "5%", "min_free_bytes": 5u64 << 30, "disk_free_bytes": 4u64 << 30,
            "pins": [], "unavailable_unlisted": 0,
            "fetching": [{"path": "<b>ig.bin", "pid": 4242, "size": 8u64 << 20, "done": 2u64 << 20}],
            "unavailable": [{"path": "c.bin", "error": "no connected peer holds it",
                             "errno": "EHOSTUNREACH", "at_unix": 1}]});
        let html = folders(&st, &h, UtcOffset::UTC);
        assert!(
            html.contains(
                "on demand: 16MiB local in 2 files, 1GiB online only in 10 files (budget 64MiB)"
            ),
            "{html}"
        );
        assert!(html.contains("<meter min=\"0\" max=\"67108864\" value=\"16777216\""));
        assert!(html.contains("budget: 16MiB of 64MiB used (25%)"));
        assert!(
            html.contains(
                "<p class=\"od-floor warn\">disk: 4GiB free, kept above 5GiB (5%) by evicting</p>"
            ),
            "{html}"
        );
        assert!(html.contains(
            "<li data-path=\"&lt;b&gt;ig.bin\" data-pid=\"4242\">fetching &lt;b&gt;ig.bin for pid 4242: 2MiB of 8MiB \
             <progress max=\"8388608\" value=\"2097152\"></progress></li>"
        ), "{html}");
        assert!(html.contains("could not fetch c.bin (EHOSTUNREACH): no connected peer holds it"));
    }

    #[test]
    fn a_conflict_shows_both_versions_and_the_device_of_each() {
        let st = status();
        let c = ConflictFile {
            path: "r.sync-conflict-20261125-191740-BBBBBBB.txt".into(),
            original: "r.txt".into(),
            size: 17,
            loser_device: "BBBBBBB".into(),
            loser_time: "20261125-191740".into(),
            winner_device: Some("AAAAAAA".into()),
            winner_mtime_ns: Some(1_790_000_000_000_000_000),
            winner_size: Some(31),
            recorded_ns: None,
        };
        let html = conflicts(&[("work".into(), vec![c])], &Names::of(&st));
        assert!(html.contains("kept as r.txt: by b&lt;script&gt; (this device) (AAAAAAA), 31 bytes, modified 2026-09-21"), "{html}");
        assert!(html.contains("other version as r.sync-conflict-20261125-191740-BBBBBBB.txt: by a (BBBBBBB), 17 bytes, modified 2026-11-25 19:17:40 UTC"), "{html}");
    }

    #[test]
    fn journal_rows_have_the_columns_of_meshfs_journal() {
        let row = |sequence, op| Row {
            sequence,
            time: "2026-11-25 19:17:40.000".into(),
            device: "BBBBBBB".into(),
            op,
            path: "a&b.txt".into(),
            size: 5,
            hash: "0123abcd".into(),
            version: "{BBBBBBB:1}".into(),
        };
        let r = Rows {
            folder: "w&rk".into(),
            rows: Ok(vec![
                (row(9, "delete"), Content::None),
                (row(8, "modify"), Content::Current),
                (row(7, "create"), Content::Kept),
                (row(6, "modify"), Content::NotHere),
                (row(5, "modify"), Content::Pruned),
            ]),
            limit: 100,
        };
        let html = rows(&r, &Names::of(&status()));
        for c in Row::COLUMNS.iter().chain(&["content"]) {
            assert!(html.contains(&format!("<th>{c}</th>")), "{c}");
        }
        assert!(html.contains(
            "data-seq=\"7\" data-path=\"a&amp;b.txt\" data-op=\"create\" data-content=\"kept\""
        ));
        assert!(html.contains("title=\"a (BBBBBBB)\""));
        // Only a version kept here or asked of the peers can be brought back (not a deletion,
        // the current version or a pruned one); the folder id is encoded, then escaped.
        assert_eq!(
            html.matches("<form method=\"post\" action=\"/restore?")
                .count(),
            2
        );
        assert!(html.contains("action=\"/restore?folder=w%26rk&amp;sequence=6\""));
        assert!(
            html.contains("action=\"/restore?folder=w%26rk&amp;sequence=7\""),
            "{html}"
        );
        let err = rows(
            &Rows {
                rows: Err("bad <since>".into()),
                ..r
            },
            &Names::of(&status()),
        );
        assert!(err.contains("bad &lt;since&gt;"));
    }

    #[test]
    fn zones_read_as_offsets_from_utc() {
        assert_eq!(zone(UtcOffset::UTC), "UTC");
        assert_eq!(zone(UtcOffset::from_hms(1, 0, 0).unwrap()), "UTC+01:00");
        assert_eq!(zone(UtcOffset::from_hms(-5, -30, 0).unwrap()), "UTC-05:30");
        assert_eq!(name_time("20261125-191740"), "2026-11-25 19:17:40");
        assert_eq!(name_time("garbage"), "garbage");
    }
}
