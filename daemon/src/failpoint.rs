//! Fault injection: named points in the code where a test can make the process die (or stall)
//! on purpose, so that a crash between two steps of a sequence is a test, not a race.
//!
//! **What it owns.** The parsing of `MESHFS_FAILPOINTS` and the action taken at a point. A
//! point is a call `failpoint::hit("area.step")` placed between two steps whose order matters
//! (the journal's WAL identity, an install's rename and fsync...); its name says what is done
//! and what is not yet. Nothing happens at a point unless the variable names it: without the
//! variable, a hit is one atomic load.
//!
//! **What it never does.** It decides nothing and touches no file: a test sets the variable
//! on the process it starts and checks what the next start finds.
//!
//! # The variable
//!
//! `MESHFS_FAILPOINTS=NAME=ACTION[@N],NAME=ACTION[@N],...`, read once, at the first hit:
//!
//! - `abort`: `abort(3)` (SIGABRT, no destructor runs, nothing is flushed);
//! - `kill`: SIGKILL to itself, exactly what `kill -9` does;
//! - `exit(CODE)`: `_exit(CODE)` at once, without unwinding or flushing;
//! - `panic`: a Rust panic on the calling thread (destructors run: the point's caller unwinds);
//! - `sleep(MS)`: waits MS milliseconds, then goes on (a window for a test to act in);
//! - `off`: nothing (to switch one point off in a longer list).
//!
//! `@N` acts at the N-th hit of that point only (counted from 1); without it, at every hit.
//! Before acting the process writes `failpoint NAME: ACTION` to stderr, so a test can tell
//! that it died at the point it named and not elsewhere. A malformed variable is a panic at
//! the first hit: a test that names an action wrongly must not pass by testing nothing.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that arms points.
pub const ENV: &str = "MESHFS_FAILPOINTS";

/// What a point does when it is hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// `abort(3)`.
    Abort,
    /// SIGKILL to this process.
    Kill,
    /// `_exit(code)`.
    Exit(i32),
    /// A panic on the calling thread.
    Panic,
    /// Sleep this long, then continue.
    Sleep(Duration),
    /// Nothing.
    Off,
}

/// One armed point.
#[derive(Debug)]
struct Armed {
    name: String,
    action: Action,
    /// Act at this hit only (1-based); `None`: at every hit.
    at: Option<u64>,
    hits: AtomicU64,
}

static ARMED: OnceLock<Vec<Armed>> = OnceLock::new();

/// Parses `MESHFS_FAILPOINTS`' value.
fn parse(spec: &str) -> Result<Vec<Armed>, String> {
    let mut out = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (name, rest) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?}: expected NAME=ACTION"))?;
        let (action, at) = match rest.rsplit_once('@') {
            Some((a, n)) => {
                let n: u64 = n
                    .parse()
                    .map_err(|_| format!("{item:?}: @{n} is not a hit count"))?;
                if n == 0 {
                    return Err(format!("{item:?}: hits are counted from 1"));
                }
                (a, Some(n))
            }
            None => (rest, None),
        };
        out.push(Armed {
            name: name.trim().to_string(),
            action: parse_action(action.trim()).map_err(|e| format!("{item:?}: {e}"))?,
            at,
            hits: AtomicU64::new(0),
        });
    }
    Ok(out)
}

fn parse_action(s: &str) -> Result<Action, String> {
    let arg = |prefix: &str| {
        s.strip_prefix(prefix)
            .and_then(|r| r.strip_prefix('('))
            .and_then(|r| r.strip_suffix(')'))
    };
    Ok(match s {
        "abort" => Action::Abort,
        "kill" => Action::Kill,
        "panic" => Action::Panic,
        "off" => Action::Off,
        _ => {
            if let Some(code) = arg("exit") {
                Action::Exit(
                    code.parse()
                        .map_err(|_| format!("exit({code}): not a code"))?,
                )
            } else if let Some(ms) = arg("sleep") {
                let ms: u64 = ms
                    .parse()
                    .map_err(|_| format!("sleep({ms}): not milliseconds"))?;
                Action::Sleep(Duration::from_millis(ms))
            } else {
                return Err(format!(
                    "unknown action {s:?} (abort, kill, exit(CODE), panic, sleep(MS), off)"
                ));
            }
        }
    })
}

fn armed() -> &'static [Armed] {
    ARMED.get_or_init(|| match std::env::var(ENV) {
        Ok(spec) => parse(&spec).unwrap_or_else(|e| panic!("{ENV}: {e}")),
        Err(_) => Vec::new(),
    })
}

/// The point `name` is reached: does what `MESHFS_FAILPOINTS` says for it, if anything.
pub fn hit(name: &str) {
    let points = armed();
    if !points.is_empty() {
        hit_in(points, name);
    }
}

fn hit_in(points: &[Armed], name: &str) {
    for p in points.iter().filter(|p| p.name == name) {
        let n = p.hits.fetch_add(1, Ordering::SeqCst) + 1;
        if p.at.is_some_and(|at| at != n) || p.action == Action::Off {
            continue;
        }
        eprintln!("failpoint {name}: {:?}", p.action);
        act(name, p.action);
    }
}

fn act(name: &str, action: Action) {
    match action {
        Action::Abort => std::process::abort(),
        Action::Kill => {
            // SAFETY: getpid and kill take integers and touch no memory.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            // SIGKILL to oneself is delivered before kill(2) returns; never reached.
            std::process::abort();
        }
        // SAFETY: _exit ends the process at once; nothing of this process runs after it.
        Action::Exit(code) => unsafe { libc::_exit(code) },
        Action::Panic => panic!("failpoint {name}"),
        Action::Sleep(d) => std::thread::sleep(d),
        Action::Off => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_of_points_parses_with_actions_and_hit_counts() {
        let p = parse("journal.a=abort, journal.b=kill@3,x=exit(7),y=sleep(250),z=off").unwrap();
        let got: Vec<_> = p
            .iter()
            .map(|a| (a.name.as_str(), a.action, a.at))
            .collect();
        assert_eq!(
            got,
            vec![
                ("journal.a", Action::Abort, None),
                ("journal.b", Action::Kill, Some(3)),
                ("x", Action::Exit(7), None),
                ("y", Action::Sleep(Duration::from_millis(250)), None),
                ("z", Action::Off, None),
            ]
        );
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn a_point_with_a_hit_count_acts_at_that_hit_only() {
        let points = parse("p=panic@2").unwrap();
        let hit = || std::panic::catch_unwind(|| hit_in(&points, "p")).is_err();
        assert_eq!([hit(), hit(), hit()], [false, true, false]);
        // Other names pass.
        assert!(std::panic::catch_unwind(|| hit_in(&points, "q")).is_ok());
    }

    #[test]
    fn a_misspelled_action_or_count_is_an_error_not_a_silent_no_op() {
        for bad in [
            "a=abrot",
            "a",
            "a=kill@0",
            "a=kill@x",
            "a=exit(x)",
            "a=sleep()",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
