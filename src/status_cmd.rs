//! `meshfs status`: asks the daemon for its state and says in words whether each folder is in
//! sync with every peer that shares it, and if not, why; `--wait-synced` waits for it (and for
//! the daemon to come up), with a progress bar on a terminal. The daemon reports facts
//! (`status --json`); the words are made here. `--watch` is `status_watch`, `--pending`
//! `status_pending`.

use crate::{EXIT_NOT_SHARED, EXIT_NO_DAEMON, EXIT_TIMEOUT};
use meshfs_daemon::config::{Config, ConfigError, Home};
use meshfs_daemon::control::{self, Request};
use serde_json::Value;
use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::{Duration, Instant};

use meshfs_daemon::readout::status::{first_of, folder_summary, last_error_line, local_time};
use meshfs_daemon::readout::status::{pairing_hint, pairing_questions, source_words};
use meshfs_daemon::readout::status::{peer_name, peer_state, peers_by_id, plural, s, t, u};
use time::UtcOffset;

/// What `meshfs status` was asked.
pub struct StatusArgs {
    /// Print the JSON document.
    pub json: bool,
    /// Wait until in sync (exit 4 on timeout).
    pub wait_synced: bool,
    /// With `wait_synced`: only the connected peers count (the old meaning).
    pub connected: bool,
    /// Seconds to wait, for the daemon and for sync; with `watch`, to watch.
    pub timeout: Option<f64>,
    /// Refresh a view every second.
    pub watch: bool,
    /// List what waits, path by path.
    pub pending: bool,
    /// With `pending`: only this folder.
    pub folder: Option<meshfs_protocol::FolderId>,
}

/// How long `--wait-synced` waits by default.
const WAIT_SYNCED_TIMEOUT: f64 = 60.0;

/// Runs `status`; returns the exit code.
pub fn run(home: &Home, a: StatusArgs) -> anyhow::Result<u8> {
    // A home that was never initialised will never have a daemon: say what to do now.
    if let Err(e @ ConfigError::Missing(_)) = Config::load(home) {
        return Err(e.into());
    }
    if a.watch {
        return crate::status_watch::run(home, a.timeout);
    }
    if a.pending {
        return crate::status_pending::run(home, a.folder, a.json);
    }
    let timeout = a.timeout.unwrap_or(WAIT_SYNCED_TIMEOUT);
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(timeout.max(0.0));
    // On a terminal, a bar shows what is left while it waits; nothing extra on a pipe.
    let bar = (a.wait_synced && !a.json && std::io::stdout().is_terminal()).then(WaitBar::new);
    let key = if a.connected {
        "in_sync_with_connected"
    } else {
        "in_sync"
    };
    let mut stable = 0;
    let mut waited_for_daemon = false;
    loop {
        let Some(st) = control::request(home, &Request::Status)? else {
            // Started a moment ago (`meshfs daemon &`), its socket may not be up yet.
            if a.wait_synced && Instant::now() < deadline {
                waited_for_daemon = true;
                if let Some(bar) = &bar {
                    bar.waiting_for_daemon();
                }
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            drop(bar);
            if waited_for_daemon {
                eprintln!(
                    "meshfs: no daemon came up for {} within {timeout} s (start it with `meshfs daemon`)",
                    home.config_dir.display(),
                );
            } else {
                eprintln!(
                    "meshfs: no daemon is running for {} (start it with `meshfs daemon`)",
                    home.config_dir.display()
                );
            }
            return Ok(EXIT_NO_DAEMON);
        };
        // A peer that does not share a folder back will not start to while we wait: that is a
        // question for the user, answered on the other device.
        let questions = if a.wait_synced {
            pairing_questions(&st)
        } else {
            Vec::new()
        };
        if !questions.is_empty() {
            drop(bar);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                print!("{}", render(&st));
            }
            for q in questions {
                eprintln!("meshfs: {q}");
            }
            return Ok(EXIT_NOT_SHARED);
        }
        let synced = st.get(key).and_then(Value::as_bool).unwrap_or(false);
        // In sync must hold on three polls in a row, so a change captured a moment ago counts.
        stable = if synced { stable + 1 } else { 0 };
        if let Some(bar) = &bar {
            bar.show(&st, synced);
        }
        if !a.wait_synced || stable >= 3 || Instant::now() >= deadline {
            drop(bar);
            if a.json {
                println!("{}", serde_json::to_string_pretty(&st)?);
            } else {
                print!("{}", render(&st));
            }
            if a.wait_synced && stable < 3 {
                eprintln!(
                    "meshfs: not in sync after {timeout} s: {}",
                    not_synced_summary(&st)
                );
                return Ok(EXIT_TIMEOUT);
            }
            return Ok(0);
        }
        // While syncing, poll gently (each poll reads the journal); once in sync, confirm soon.
        std::thread::sleep(Duration::from_millis(if synced { 10 } else { 25 }));
    }
}

/// The bar `--wait-synced` draws on a terminal: the work left (records to send, records and
/// files to receive, to hash and to record) against the most there was, and in words what
/// it waits for. Cleared before the status is printed.
struct WaitBar {
    bar: indicatif::ProgressBar,
    /// The most work seen left: the bar's length.
    most: std::cell::Cell<u64>,
}

impl WaitBar {
    /// Before any work is counted: a spinner and the words.
    const WAITING: &str = "{spinner} waiting to be in sync: {wide_msg}";
    /// With work counted: how much of it is done.
    const COUNTING: &str = "{spinner} waiting to be in sync [{bar:24}] {pos}/{len} {wide_msg}";

    fn style(template: &str) -> indicatif::ProgressStyle {
        indicatif::ProgressStyle::with_template(template)
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner())
            .progress_chars("=> ")
    }

    fn new() -> WaitBar {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(0),
            indicatif::ProgressDrawTarget::stdout(),
        );
        bar.set_style(Self::style(Self::WAITING));
        bar.enable_steady_tick(Duration::from_millis(120));
        WaitBar {
            bar,
            most: std::cell::Cell::new(0),
        }
    }

    fn waiting_for_daemon(&self) {
        self.bar.set_message("waiting for the daemon to start");
    }

    /// Shows where `st` stands; `synced`: it is in sync, and only being confirmed.
    fn show(&self, st: &Value, synced: bool) {
        let left = work_left(st);
        if self.most.get() == 0 && left > 0 {
            self.bar.set_style(Self::style(Self::COUNTING));
        }
        self.most.set(self.most.get().max(left));
        self.bar.set_length(self.most.get());
        self.bar.set_position(self.most.get() - left);
        self.bar.set_message(if synced {
            "in sync; confirming".to_string()
        } else {
            not_synced_summary(st)
        });
    }
}

impl Drop for WaitBar {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// The work a status document shows left, in records and files (a peer's first scan: the files
/// it has left to hash).
fn work_left(st: &Value) -> u64 {
    st["folders"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|f| {
            // A peer says how many files its scan has left (any u64): the sums saturate.
            let to_send: u64 = f["peers"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|p| u(p, "pending_records").saturating_add(u(&p["scan"], "left")))
                .fold(0, u64::saturating_add);
            [
                u(f, "capture_pending"),
                u(f, "waiting_for_writers"),
                u(f, "waiting_for_content"),
                u(&f["progress"]["scan"], "left"),
                u(&f["progress"]["receive"], "left"),
                to_send,
            ]
            .into_iter()
            .fold(0, u64::saturating_add)
        })
        .fold(0, u64::saturating_add)
}

/// Why the device is not in sync: each folder that is not, with its reasons.
fn not_synced_summary(st: &Value) -> String {
    let started = u(&st["device"], "started_unix");
    let tz = crate::local_offset();
    let out: Vec<String> = st["folders"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["in_sync"] != true)
        .map(|f| format!("folder {}: {}", s(f, "id"), folder_summary(f, started, tz)))
        .collect();
    if out.is_empty() {
        "it became in sync only just now".into()
    } else {
        out.join("; ")
    }
}

/// The human status.
pub fn render(st: &Value) -> String {
    use std::fmt::Write as _;
    let mut o = String::new();
    let dev = &st["device"];
    let started = u(dev, "started_unix");
    let discovery = if dev["discovery"]["local"] == true {
        format!("local discovery on (UDP {})", u(&dev["discovery"], "port"))
    } else {
        "local discovery off".to_string()
    };
    let tz = crate::local_offset();
    let _ = writeln!(
        o,
        "device  {} ({})  listening on {}, {discovery}",
        t(dev, "name"),
        s(dev, "id"),
        s(dev, "listen")
    );
    let folders: Vec<&Value> = st["folders"].as_array().into_iter().flatten().collect();
    let behind = folders.iter().filter(|f| f["in_sync"] != true).count();
    let sync = if folders.is_empty() {
        "no folders (add one with `meshfs folder add PATH`)".to_string()
    } else if behind == 0 {
        "in sync: every folder is up to date with every peer that shares it".to_string()
    } else {
        format!(
            "not in sync: {behind} of {} (see below)",
            plural(folders.len() as u64, "folder", "folders")
        )
    };
    let _ = writeln!(o, "sync    {sync}");
    let peers = peers_by_id(st);
    for f in &folders {
        render_folder(&mut o, f, &peers, (started, tz), s(dev, "id"));
    }
    for p in st["peers"].as_array().into_iter().flatten() {
        render_peer(&mut o, p, tz);
    }
    for r in st["refused_devices"].as_array().into_iter().flatten() {
        let r = r.as_str().unwrap_or("");
        let _ = writeln!(
            o,
            "refused unknown device {r} (add it with `meshfs peer add {r}`)"
        );
    }
    o
}

/// A folder's lines of the human status.
fn render_folder(
    o: &mut String,
    f: &Value,
    peers: &HashMap<&str, &Value>,
    (started, tz): (u64, UtcOffset),
    me: &str,
) {
    use std::fmt::Write as _;
    let id = s(f, "id");
    let _ = writeln!(
        o,
        "folder  {:<12} {}  {} files, {} dirs, {} bytes, {}",
        id,
        t(f, "path"),
        u(f, "files"),
        u(f, "dirs"),
        u(f, "bytes"),
        plural(u(f, "conflicts"), "conflict", "conflicts"),
    );
    let _ = writeln!(o, "          {}", folder_summary(f, started, tz));
    let m = &f["mount"];
    if m.is_object() {
        let _ = writeln!(
            o,
            "          mounted at {} ({}{}, {}, io_uring {}, {} open handle(s))",
            t(m, "mountpoint"),
            s(m, "mode"),
            crate::others_text(m),
            crate::passthrough_text(m),
            crate::on_off(m["io_uring"] == true),
            u(m, "open_handles")
        );
    }
    if let Some(first) = first_of(&f["unreadable"], id) {
        let _ = writeln!(o, "          not replicated, cannot be read: {first}");
    }
    if let Some(first) = first_of(&f["skipped"], id) {
        let _ = writeln!(
            o,
            "          remote version skipped, cannot be applied: {first}"
        );
    }
    if let Some(e) = last_error_line(f, tz) {
        let _ = writeln!(o, "          {e}");
    }
    for line in meshfs_daemon::readout::status::versions_lines(f) {
        let _ = writeln!(o, "          {line}");
    }
    for line in meshfs_daemon::readout::on_demand::on_demand_lines(f) {
        let _ = writeln!(o, "          {line}");
    }
    for p in f["peers"].as_array().into_iter().flatten() {
        let name = peers
            .get(s(p, "device_id"))
            .map_or_else(|| peer_name(p), |q| peer_name(q));
        let _ = writeln!(o, "          with {name}: {}", peer_state(p, started, tz));
        if p["connected"] == true && p["not_shared"] == true {
            let _ = writeln!(o, "            {}", pairing_hint(id, me, &name));
        }
    }
}

/// A peer's lines of the human status.
fn render_peer(o: &mut String, p: &Value, tz: UtcOffset) {
    use std::fmt::Write as _;
    let at = p["last_seen_addr"].as_str();
    let state = if p["connected"] == true {
        let rtt = p["rtt_ms"]
            .as_f64()
            .map_or("-".into(), |r| format!("{r:.1} ms"));
        let how = p["address_source"]
            .as_str()
            .map_or(String::new(), |src| format!(" ({})", source_words(src)));
        let lane = &p["bulk_lane"];
        let lane = match (lane["up"].as_bool(), lane["down"].as_str()) {
            (Some(true), _) => format!(
                ", bulk lane up ({} fetches, {})",
                lane["fetches"].as_u64().unwrap_or(0),
                meshfs_daemon::readout::rates::bytes(lane["bytes"].as_f64().unwrap_or(0.0))
            ),
            (_, Some(why)) => format!(", no bulk lane ({why})"),
            _ => String::new(),
        };
        match p["address"].as_str().or(at) {
            Some(a) => format!("connected at {a}{how}, rtt {rtt}{lane}"),
            None => format!("connected, rtt {rtt}{lane}"),
        }
    } else {
        match (p["last_seen_unix"].as_u64(), at) {
            (Some(t), Some(a)) => format!("offline since {}, last at {a}", local_time(t, tz)),
            (Some(t), None) => format!("offline since {}", local_time(t, tz)),
            (None, _) => "never connected".into(),
        }
    };
    let listed: Vec<&str> = meshfs_daemon::readout::status::strs(&p["addresses"]).collect();
    let addr = match listed.join(",") {
        a if a.is_empty() => "(dials us)".to_string(),
        a => meshfs_daemon::readout::journal::printable(&a),
    };
    let _ = writeln!(
        o,
        "peer    {} {:<12} {:<22} {state}  sent {} B  received {} B",
        s(p, "short_id"),
        t(p, "name"),
        addr,
        u(p, "bytes_sent"),
        u(p, "bytes_received")
    );
    if let Some(e) = last_error_line(p, tz) {
        let _ = writeln!(o, "          {e}");
    }
}
