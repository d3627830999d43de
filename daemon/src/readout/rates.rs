//! Rates and ETAs of the work a device does, from successive `status --json` documents: the
//! daemon only counts (`progress`, `bytes_sent`, `bytes_received`); how fast those counts grow
//! over the last few seconds is the rate, and what is left at that rate the ETA. Used by
//! `status --watch` and the page (`meshfs ui`); it keeps the documents it is given and reads
//! no clock of its own.

use super::status::{local_time, peer_name, plural, s, u};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};
use time::UtcOffset;

/// Rates are averaged over this long.
pub const WINDOW: Duration = Duration::from_secs(5);

/// The status documents of the last [`WINDOW`], oldest first.
#[derive(Default)]
pub struct History {
    docs: VecDeque<(Instant, Value)>,
    /// Per folder: the bytes of received records applied, and the bytes its peers had sent,
    /// when that count last moved. What arrived since is in the batch being applied.
    applied_at: HashMap<String, (u64, u64)>,
}

/// The bytes the peers sharing `f` sent this device, by `st`.
fn wire(st: &Value, f: &Value) -> u64 {
    f["peers"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| find(st, "peers", "device_id", s(p, "device_id")))
        .map(|p| u(p, "bytes_received"))
        .sum()
}

impl History {
    /// Adds the document taken at `at`, and forgets those older than the window (two are
    /// always kept).
    pub fn push(&mut self, at: Instant, st: Value) {
        for f in st["folders"].as_array().into_iter().flatten() {
            let applied = u(&f["progress"]["receive"], "bytes_done");
            let e = self
                .applied_at
                .entry(s(f, "id").to_string())
                .or_insert((applied, wire(&st, f)));
            if e.0 != applied {
                *e = (applied, wire(&st, f));
            }
        }
        self.docs.push_back((at, st));
        while self.docs.len() > 2
            && self
                .docs
                .front()
                .is_some_and(|(t, _)| at.duration_since(*t) > WINDOW)
        {
            self.docs.pop_front();
        }
    }

    /// The newest document.
    pub fn latest(&self) -> Option<&Value> {
        self.docs.back().map(|(_, v)| v)
    }

    /// How fast `get` grew over the window, per second; `None` with fewer than two documents,
    /// or when a counter went down (the daemon restarted).
    pub fn rate(&self, get: impl Fn(&Value) -> Option<u64>) -> Option<f64> {
        let ((t0, a), (t1, b)) = (self.docs.front()?, self.docs.back()?);
        let dt = t1.duration_since(*t0).as_secs_f64();
        let (a, b) = (get(a)?, get(b)?);
        (dt > 0.0 && b >= a).then(|| (b - a) as f64 / dt)
    }

    /// A peer's upload and download rates (bytes per second), by its device id.
    pub fn peer_rates(&self, device_id: &str) -> (Option<f64>, Option<f64>) {
        let rate = |field: &'static str| {
            self.rate(|d| find(d, "peers", "device_id", device_id).map(|p| u(p, field)))
        };
        (rate("bytes_sent"), rate("bytes_received"))
    }
}

/// The element of `st[list]` whose `key` is `id`.
pub fn find<'a>(st: &'a Value, list: &str, key: &str, id: &str) -> Option<&'a Value> {
    st[list].as_array()?.iter().find(|x| s(x, key) == id)
}

/// `1.5 MiB`.
pub fn bytes(n: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut n = n;
    let mut unit = 0;
    while n >= 1024.0 && unit + 1 < UNITS.len() {
        n /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n:.0} B")
    } else {
        format!("{n:.1} {}", UNITS[unit])
    }
}

/// `1h02m`, `3m20s`, `45s`.
pub fn eta(secs: f64) -> String {
    let s = secs.ceil().max(0.0) as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

/// `, 2.1 MiB/s, ETA 40s` for `left` at `rate` per second (either may be unknown).
fn rate_and_eta(rate: Option<f64>, left: Option<f64>, unit: impl Fn(f64) -> String) -> String {
    match rate {
        Some(r) if r > 0.0 => match left {
            Some(l) if l > 0.0 => format!(", {}/s, ETA {}", unit(r), eta(l / r)),
            _ => format!(", {}/s", unit(r)),
        },
        _ => String::new(),
    }
}

/// What a folder's work looks like now: one entry per kind of work going on (`scan: …`,
/// `receive: …`, `scan on PEER: …`, `send: …`), each with what is done and left, its rate
/// and ETA.
pub fn folder_work(f: &Value, st: &Value, h: &History) -> Vec<String> {
    let id = s(f, "id").to_string();
    let progress = |h: &History, kind: &'static str, field: &'static str| {
        let id = id.clone();
        h.rate(move |d| find(d, "folders", "id", &id)?["progress"][kind][field].as_u64())
    };
    let mut work = Vec::new();
    let scan = &f["progress"]["scan"];
    if f["scanning"] == true || u(scan, "left") > 0 {
        let files = progress(h, "scan", "done");
        let left = u(scan, "left");
        work.push(format!(
            "scan: {} hashed ({}), {left} left{}",
            plural(u(scan, "done"), "file", "files"),
            bytes(u(scan, "bytes_done") as f64),
            rate_and_eta(files, Some(left as f64), |r| format!("{r:.0} files"))
        ));
    }
    let receive = &f["progress"]["receive"];
    if u(receive, "left") > 0 {
        // Counts move when a batch is applied; the bytes arriving from the folder's peers
        // show the pace inside a long batch.
        let applied = progress(h, "receive", "bytes_done");
        let arriving = h.rate(|d| Some(wire(d, find(d, "folders", "id", &id)?)));
        let rate = match (arriving, applied) {
            (Some(w), Some(a)) => Some(w.max(a)),
            (w, a) => w.or(a),
        };
        let waiting = u(receive, "bytes_left");
        // What arrived since the last batch was applied belongs to the batches waiting.
        let arrived = h
            .applied_at
            .get(&id)
            .map_or(0, |(_, at)| wire(st, f).saturating_sub(*at));
        let left = waiting.saturating_sub(arrived) as f64;
        work.push(format!(
            "receive: {} applied ({}), {} ({}) waiting{}",
            plural(u(receive, "done"), "record", "records"),
            bytes(u(receive, "bytes_done") as f64),
            u(receive, "left"),
            bytes(waiting as f64),
            rate_and_eta(rate, Some(left), bytes)
        ));
    }
    for p in f["peers"].as_array().into_iter().flatten() {
        let name = find(st, "peers", "device_id", s(p, "device_id"))
            .map_or_else(|| peer_name(p), peer_name);
        if p["scanning"] == true {
            let (folder, dev) = (id.clone(), s(p, "device_id").to_string());
            let files = h.rate(move |d| {
                find(
                    find(d, "folders", "id", &folder)?,
                    "peers",
                    "device_id",
                    &dev,
                )?["scan"]["done"]
                    .as_u64()
            });
            let scan = &p["scan"];
            let left = u(scan, "left");
            work.push(format!(
                "scan on {name}: {} hashed ({}), {left} left{}",
                plural(u(scan, "done"), "file", "files"),
                bytes(u(scan, "bytes_done") as f64),
                rate_and_eta(files, Some(left as f64), |r| format!("{r:.0} files"))
            ));
        }
        let n = u(p, "pending_records");
        if n > 0 {
            work.push(format!(
                "send: {} not acknowledged by {name}",
                plural(n, "record", "records")
            ));
        }
    }
    work
}

/// A rate as `1.2 MiB/s`, or `-` when unknown.
pub fn per_second(rate: Option<f64>) -> String {
    rate.map_or("-".into(), |r| format!("{}/s", bytes(r)))
}

/// A peer's connection in a few words, without its name: `connected, rtt 0.4 ms, up 1.2
/// MiB/s, down 0 B/s`, `offline since 10:42` or `never connected`.
pub fn peer_link(p: &Value, h: &History, tz: UtcOffset) -> String {
    if p["connected"] != true {
        return match p["last_seen_unix"].as_u64() {
            Some(t) => format!("offline since {}", local_time(t, tz)),
            None => "never connected".into(),
        };
    }
    let (up, down) = h.peer_rates(s(p, "device_id"));
    let rtt = p["rtt_ms"]
        .as_f64()
        .map_or("-".into(), |r| format!("{r:.1} ms"));
    format!(
        "connected, rtt {rtt}, up {}, down {}",
        per_second(up),
        per_second(down)
    )
}

/// A peer in a few words: `b connected, rtt 0.4 ms, up 1.2 MiB/s, down 0 B/s`.
pub fn peer_words(p: &Value, h: &History, tz: UtcOffset) -> String {
    format!("{} {}", peer_name(p), peer_link(p, h, tz))
}

#[cfg(test)]
mod tests {
    use super::super::status::{folder_summary, peer_state};
    use super::*;
    use serde_json::json;

    /// A status document of one folder receiving from peer b, at `received` bytes.
    fn doc(applied: u64, received: u64) -> Value {
        json!({
            "device": {"name": "a", "started_unix": 0},
            "in_sync": false,
            "folders": [{
                "id": "work", "path": "/w", "files": 3, "bytes": 10, "in_sync": false,
                "scanning": false, "capture_pending": 0, "waiting_for_writers": 0,
                "progress": {
                    "scan": {"done": 0, "bytes_done": 0, "left": 0, "bytes_left": null},
                    "receive": {"done": applied, "bytes_done": applied << 20, "left": 10,
                                "bytes_left": 40u64 << 20},
                },
                "peers": [{"device_id": "B", "name": "b", "connected": true, "in_sync": false,
                           "pending_records": 2}],
            }],
            "peers": [{"device_id": "B", "name": "b", "connected": true, "rtt_ms": 0.4,
                       "bytes_sent": 1000, "bytes_received": received}],
        })
    }

    #[test]
    fn rates_and_the_eta_come_from_successive_documents() {
        let mut h = History::default();
        let t = Instant::now();
        h.push(t, doc(0, 0));
        h.push(t + Duration::from_secs(2), doc(0, 8 << 20));
        let st = h.latest().unwrap().clone();
        let work = folder_work(&st["folders"][0], &st, &h);
        assert_eq!(
            work,
            [
                // 8 of the 40 MiB waiting have arrived: 32 MiB at 4 MiB/s.
                "receive: 0 records applied (0 B), 10 (40.0 MiB) waiting, 4.0 MiB/s, ETA 8s",
                "send: 2 records not acknowledged by b",
            ]
        );
        assert_eq!(
            peer_words(&st["peers"][0], &h, UtcOffset::UTC),
            "b connected, rtt 0.4 ms, up 0 B/s, down 4.0 MiB/s"
        );
    }

    #[test]
    fn one_document_has_no_rate_yet() {
        let mut h = History::default();
        h.push(Instant::now(), doc(0, 0));
        let st = h.latest().unwrap().clone();
        let work = folder_work(&st["folders"][0], &st, &h);
        assert_eq!(
            work[0],
            "receive: 0 records applied (0 B), 10 (40.0 MiB) waiting"
        );
        assert!(peer_words(&st["peers"][0], &h, UtcOffset::UTC).ends_with("up -, down -"));
    }

    /// Peer a shares the folder and is in its first scan, `done` files hashed of 2,400.
    pub(crate) fn scanning_doc(done: u64) -> Value {
        json!({
            "device": {"name": "b", "started_unix": 0},
            "in_sync": false,
            "folders": [{
                "id": "work", "path": "/w", "files": 0, "bytes": 0, "in_sync": false,
                "scanning": false, "capture_pending": 0, "waiting_for_writers": 0,
                "progress": {
                    "scan": {"done": 0, "bytes_done": 0, "left": 0, "bytes_left": null},
                    "receive": {"done": 0, "bytes_done": 0, "left": 0, "bytes_left": null},
                },
                "peers": [{"device_id": "A", "name": "a", "connected": true, "in_sync": false,
                           "pending_records": 0, "scanning": true,
                           "scan": {"done": done, "bytes_done": done << 18,
                                    "left": 2400 - done, "bytes_left": null}}],
            }],
            "peers": [{"device_id": "A", "name": "a", "connected": true, "rtt_ms": 0.4,
                       "bytes_sent": 0, "bytes_received": 0}],
        })
    }

    #[test]
    fn a_peer_in_its_first_scan_is_what_the_folder_waits_for_with_its_rate() {
        let mut h = History::default();
        let t = Instant::now();
        h.push(t, scanning_doc(1000));
        h.push(t + Duration::from_secs(2), scanning_doc(1400));
        let st = h.latest().unwrap().clone();
        let f = &st["folders"][0];
        assert_eq!(
            folder_summary(f, 0, UtcOffset::UTC),
            "up to date with 0 of 1 peer; waiting for a's first scan: 1400 files hashed so far, 1000 left"
        );
        assert_eq!(
            peer_state(&f["peers"][0], 0, UtcOffset::UTC),
            "waiting for its first scan: 1400 files hashed so far, 1000 left"
        );
        assert_eq!(
            folder_work(f, &st, &h),
            ["scan on a: 1400 files hashed (350.0 MiB), 1000 left, 200 files/s, ETA 5s"]
        );
    }

    #[test]
    fn etas_and_sizes_read_like_a_person_would_write_them() {
        assert_eq!(eta(44.2), "45s");
        assert_eq!(eta(200.0), "3m20s");
        assert_eq!(eta(3720.0), "1h02m");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(1536.0), "1.5 KiB");
        assert_eq!(bytes(3.0 * 1024.0 * 1024.0 * 1024.0), "3.0 GiB");
    }
}
