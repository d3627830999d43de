//! Each test's wall time, kept where anyone can find the slowest tests after a run: the first
//! harness call in a test's thread (`tmp()`) starts a clock, and when that thread ends, passed
//! or failed, one line `NAME SECONDS` is appended to `target/test-times.txt`. `.ci/run` empties
//! the file before the test command and prints the ten slowest after it; by hand:
//! `sort -k2 -g -r target/test-times.txt | head`.
//!
//! libtest runs every test in a thread named after it; threads a test spawns have no name and
//! are not counted. The clock starts at the first `tmp()`, so what a test does before that (in
//! practice nothing slow) is not counted. Never measures anything a test asserts on.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

struct Clock {
    name: String,
    start: Instant,
}

thread_local! {
    static CLOCK: std::cell::OnceCell<Clock> = const { std::cell::OnceCell::new() };
}

/// The file the times go to: `target/test-times.txt` (beside cargo's `target/tmp`).
pub fn times_file() -> PathBuf {
    let tmp = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(&tmp).join("test-times.txt")
}

/// Starts this test's clock, if this is a test's thread and its clock is not running yet.
pub fn start() {
    let Some(name) = std::thread::current().name().map(str::to_owned) else {
        return;
    };
    if name == "main" {
        return;
    }
    // One binary holds every file's tests as modules (`sync::...`); a test built alone is
    // named after its file, so the names read the same either way.
    let name = if name.contains("::") {
        name
    } else {
        format!("{}::{name}", env!("CARGO_CRATE_NAME"))
    };
    CLOCK.with(|c| {
        c.get_or_init(|| Clock {
            name,
            start: Instant::now(),
        });
    });
}

impl Drop for Clock {
    fn drop(&mut self) {
        let line = format!("{} {:.1}\n", self.name, self.start.elapsed().as_secs_f64());
        // One short write to a file opened for appending: lines from tests running at once
        // (in this process or another) do not interleave. A file that cannot be written loses
        // only the timing.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(times_file())
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}
