//! Back in sync quickly after a peer restarts, whichever side it is.

mod common;
use common::*;
use std::time::{Duration, Instant};

/// Waits until `p` holds `want`; returns how long that took.
fn until_content(p: &std::path::Path, want: &[u8], secs: u64) -> Duration {
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(secs) {
        if std::fs::read(p).is_ok_and(|d| d == want) {
            return t0.elapsed();
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("{} never held the edit within {secs} s", p.display());
}

#[test]
fn a_peer_killed_and_restarted_is_back_in_sync_within_two_seconds_in_both_id_orders() {
    let t = tmp();
    let mut devs = [Device::new(&t, "a"), Device::new(&t, "b")];
    pair(&devs[0], &devs[1]);
    Device::start_together(&mut devs.iter_mut().collect::<Vec<_>>());
    wait_synced(&[&devs[0], &devs[1]], 30);
    // Killing each side in turn covers both orders of the two device ids.
    for round in 0..4 {
        let (victim, other) = (round % 2, 1 - round % 2);
        devs[victim].kill();
        let name = format!("offline-{round}.txt");
        let data = format!("written while {} was down", devs[victim].name);
        write(&devs[victim].path(&name), data.as_bytes());
        let started = Instant::now();
        devs[victim].start();
        let took = until_content(&devs[other].path(&name), data.as_bytes(), 30);
        let total = started.elapsed();
        eprintln!(
            "round {round}: {} restarted; its offline edit reached {} {:?} after the restart",
            devs[victim].name, devs[other].name, total
        );
        assert!(
            total < Duration::from_secs(2),
            "the offline edit took {total:?} (poll {took:?}) to reach the surviving peer"
        );
    }
}
