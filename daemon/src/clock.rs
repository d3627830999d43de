//! The wall clock the journal stamps its rows with and retention measures ages against: when
//! a change was journaled, when a version left the tree, when a tombstone was made, and "now"
//! for the pruning of versions, history, prunings and tombstones.
//!
//! It is the system clock. For tests and benches only, `MESHFS_TEST_CLOCK`, read once when
//! the daemon starts, moves it: `offset=35d` (signed; units `s`, `m`, `h`, `d`) shifts it,
//! `rate=3600` makes each real second count as an hour, both may be given (`offset=2d,rate=60`).
//! A test then sees retention act on days and months of journal time in seconds of real time
//! (D66). It is a testing knob, never a user feature: nothing documents it as one, and a daemon
//! that has it says so in its log at start.
//!
//! **What it never does:** move the clocks sync depends on. Version-vector counters
//! (`folder::now_secs`), file mtimes, timeouts and peers' last-seen times read the system
//! clock or `Instant` as before; only the journal's own stamps and retention's "now" move.

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The environment variable of the knob.
pub const ENV: &str = "MESHFS_TEST_CLOCK";

/// A moved clock: `base_ns` at `start`, running `rate` times as fast as real time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Moved {
    base_ns: i64,
    rate: u32,
    start: Instant,
}

fn system_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn moved() -> Option<&'static Moved> {
    static MOVED: OnceLock<Option<Moved>> = OnceLock::new();
    MOVED
        .get_or_init(|| {
            let spec = std::env::var(ENV).ok()?;
            match parse(&spec) {
                Ok((offset_ns, rate)) => {
                    tracing::warn!(%spec, "the journal's clock is moved for a test ({ENV})");
                    Some(Moved {
                        base_ns: system_ns().saturating_add(offset_ns),
                        rate,
                        start: Instant::now(),
                    })
                }
                Err(e) => {
                    tracing::warn!(%spec, error = %e, "{ENV} ignored");
                    None
                }
            }
        })
        .as_ref()
}

/// Reads `offset=±N[smhd],rate=N` (either or both): the offset in ns and the rate.
fn parse(spec: &str) -> Result<(i64, u32), String> {
    let mut offset = 0i64;
    let mut rate = 1u32;
    for item in spec.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let (key, value) = item
            .split_once('=')
            .ok_or_else(|| format!("{item:?} is not KEY=VALUE"))?;
        match key.trim() {
            "offset" => offset = duration_ns(value.trim())?,
            "rate" => {
                rate = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|r| *r >= 1)
                    .ok_or_else(|| format!("rate {value:?} is not a whole number from 1"))?
            }
            other => return Err(format!("unknown key {other:?}")),
        }
    }
    Ok((offset, rate))
}

/// `35d`, `-2h`, `+90s`, `10m` in ns.
fn duration_ns(text: &str) -> Result<i64, String> {
    let bad = || format!("{text:?} is not a duration like 35d, -2h, 90s");
    let (sign, rest) = match text.strip_prefix('-') {
        Some(r) => (-1i64, r),
        None => (1, text.strip_prefix('+').unwrap_or(text)),
    };
    let unit = rest.chars().last().ok_or_else(bad)?;
    let secs: i64 = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return Err(bad()),
    };
    let n: i64 = rest[..rest.len() - 1].parse().map_err(|_| bad())?;
    n.checked_mul(secs)
        .and_then(|s| s.checked_mul(1_000_000_000))
        .map(|ns| sign * ns)
        .ok_or_else(bad)
}

/// Now, in ns since the Unix epoch, on the journal's clock.
pub fn now_ns() -> i64 {
    match moved() {
        None => system_ns(),
        Some(m) => {
            let run = m
                .start
                .elapsed()
                .as_nanos()
                .saturating_mul(u128::from(m.rate));
            m.base_ns
                .saturating_add(i64::try_from(run).unwrap_or(i64::MAX))
        }
    }
}

/// How long `period` of the journal's clock lasts in real time (the same, unless the clock
/// runs faster; a tenth of a second at least).
pub fn real(period: Duration) -> Duration {
    match moved() {
        None => period,
        Some(m) => (period / m.rate).max(Duration::from_millis(100)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_offset_and_a_rate_read_in_either_order_and_anything_else_is_refused() {
        assert_eq!(parse("offset=35d"), Ok((35 * 86_400 * 1_000_000_000, 1)));
        assert_eq!(
            parse("rate=60, offset=-2h"),
            Ok((-2 * 3600 * 1_000_000_000, 60))
        );
        assert_eq!(parse("offset=+90s"), Ok((90 * 1_000_000_000, 1)));
        assert_eq!(parse(""), Ok((0, 1)));
        for bad in [
            "offset=3w",
            "rate=0",
            "rate=-5",
            "speed=2",
            "35d",
            "offset=d",
        ] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
