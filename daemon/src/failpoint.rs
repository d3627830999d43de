//! Named fault-injection points, for tests that must hit one instant of a multi-step operation
//! deterministically (a local write between an install's check and its rename, a crash between
//! a journal's note and its commit) instead of hoping a sleep lands there.
//!
//! A point is a name in the code: `failpoint::hit("install.after_rename", detail)`, where
//! `detail` narrows it (a path). Nothing happens unless the environment variable
//! `MESHFS_FAILPOINTS` was set when the daemon started; it is read once, so a point costs one
//! atomic load in production. Its value is a comma-separated list of `POINT=ACTION`, where
//! `POINT` is a name or `name@detail` (only that detail), and `ACTION` is:
//!
//! - `abort`: the process dies at once (`abort(3)`, as a SIGKILL would leave things);
//! - `pause`: the thread writes `POINT.reached` (`@` kept, `/` as `%`) into the directory
//!   `MESHFS_FAILPOINT_DIR` and waits until a file `POINT.go` appears there, which it removes
//!   before going on — the test acts at that instant, then lets the daemon continue. A point
//!   pauses at most [`PAUSE_LIMIT`] before it goes on by itself, so a test that failed never
//!   leaves a daemon stuck forever.
//!
//! Each action fires on the point's first hit only (then the point is spent), so a test can
//! name a point that an operation passes many times and still act exactly once.
//!
//! It never changes what an operation does when no point is set, and never reads the disk or
//! the environment after start-up except to pause.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The longest a `pause` waits for its `go` file.
pub const PAUSE_LIMIT: Duration = Duration::from_secs(60);

/// What a point does when hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Action {
    Abort,
    Pause,
}

struct Points {
    /// Armed points (spent ones are removed).
    armed: Mutex<HashMap<String, Action>>,
    /// Where `pause` reports and waits.
    dir: Option<PathBuf>,
}

fn points() -> Option<&'static Points> {
    static POINTS: OnceLock<Option<Points>> = OnceLock::new();
    POINTS
        .get_or_init(|| {
            let spec = std::env::var("MESHFS_FAILPOINTS").ok()?;
            let armed = parse(&spec);
            if armed.is_empty() {
                return None;
            }
            tracing::warn!(points = %spec, "fault injection armed (MESHFS_FAILPOINTS)");
            Some(Points {
                armed: Mutex::new(armed),
                dir: std::env::var_os("MESHFS_FAILPOINT_DIR").map(PathBuf::from),
            })
        })
        .as_ref()
}

fn parse(spec: &str) -> HashMap<String, Action> {
    spec.split(',')
        .filter_map(|item| {
            let (point, action) = item.trim().split_once('=')?;
            let action = match action.trim() {
                "abort" => Action::Abort,
                "pause" => Action::Pause,
                other => {
                    tracing::warn!(
                        point,
                        action = other,
                        "unknown fault-injection action; ignored"
                    );
                    return None;
                }
            };
            Some((point.trim().to_string(), action))
        })
        .collect()
}

/// The file name a point's `reached`/`go` files start with.
pub fn file_stem(point: &str) -> String {
    point.replace('/', "%")
}

/// Passes the point `name` (narrowed by `detail`, e.g. a path; empty for none).
pub fn hit(name: &str, detail: &str) {
    let Some(p) = points() else { return };
    let (key, action) = {
        let mut armed = p.armed.lock().unwrap_or_else(|e| e.into_inner());
        let narrow = format!("{name}@{detail}");
        let key = if armed.contains_key(&narrow) {
            narrow
        } else if armed.contains_key(name) {
            name.to_string()
        } else {
            return;
        };
        let Some(action) = armed.remove(&key) else {
            return;
        };
        (key, action)
    };
    match action {
        Action::Abort => {
            tracing::error!(point = %key, "fault injection: aborting");
            std::process::abort();
        }
        Action::Pause => pause(p, &key),
    }
}

fn pause(p: &Points, key: &str) {
    let Some(dir) = &p.dir else {
        tracing::warn!(point = %key, "fault injection: pause without MESHFS_FAILPOINT_DIR; going on");
        return;
    };
    let stem = file_stem(key);
    let go = dir.join(format!("{stem}.go"));
    if let Err(e) = std::fs::write(dir.join(format!("{stem}.reached")), b"") {
        tracing::warn!(point = %key, error = %e, "fault injection: cannot report a pause; going on");
        return;
    }
    tracing::info!(point = %key, "fault injection: paused");
    let until = Instant::now() + PAUSE_LIMIT;
    while Instant::now() < until {
        if std::fs::remove_file(&go).is_ok() {
            tracing::info!(point = %key, "fault injection: resumed");
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    tracing::warn!(point = %key, "fault injection: nobody resumed the pause; going on");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_names_points_with_or_without_a_detail_and_drops_unknown_actions() {
        let a = parse("install.after_rename@d/f=pause, journal.note=abort ,x=explode,junk");
        assert_eq!(a.len(), 2);
        assert_eq!(a["install.after_rename@d/f"], Action::Pause);
        assert_eq!(a["journal.note"], Action::Abort);
    }
}
