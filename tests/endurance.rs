//! The tests that run for a minute on purpose (a minute of outage, a minute of writes). They
//! live in a module of their own whose name sorts early: libtest starts tests in name order,
//! and started last they would set the end of the whole run (CI time); their helpers stay with
//! their kin in resilience.rs and live_mount.rs.

use crate::common;
use crate::live_mount::{two_mounts, walk};
use crate::resilience::outage_then_back_in_sync;
use common::*;
use std::time::{Duration, Instant};

#[test]
fn a_network_outage_of_5_s_and_of_60_s_ends_in_sync_soon_after_the_link_returns() {
    for (tag, secs) in [("s", 5), ("l", 60)] {
        let took = outage_then_back_in_sync(tag, Duration::from_secs(secs));
        eprintln!("after a {secs} s outage, in sync {took:?} after the link came back");
        // A bound on the design, not a speed: the dial is retried within a second or two of
        // the link's return, never after an idle timeout or a long backoff. (1.5 s failed a
        // loaded CI run at 1.70 s; the figure itself is printed above.)
        assert!(
            took < Duration::from_secs(5),
            "{secs} s outage: {took:?} after the link came back"
        );
    }
}

#[test]
fn one_mount_writing_and_renaming_while_the_other_is_read_for_a_while_never_hangs_or_fails() {
    let t = tmp();
    let (a, b) = two_mounts(&t);
    // A minute, as the live-mount issue asks; `MESHFS_STRESS_SECS` runs it longer (or
    // shorter while iterating).
    let secs: u64 = std::env::var("MESHFS_STRESS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (mnt, stop) = (b.mnt.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut reads = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for e in walk(&mnt) {
                    match std::fs::read(&e) {
                        Ok(_) => reads += 1,
                        // Renamed or replaced between the listing and the read: fine.
                        Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                        Err(err) => panic!("reading {} in mount b: {err}", e.display()),
                    }
                }
            }
            reads
        })
    };
    let t0 = Instant::now();
    let mut i = 0u64;
    while t0.elapsed() < Duration::from_secs(secs) {
        let d = a.mnt.join(format!("d{}", i % 7));
        write(
            &d.join(format!("f{}.txt", i % 23)),
            format!("write {i}").as_bytes(),
        );
        if i.is_multiple_of(5) {
            let _ = std::fs::rename(
                d.join(format!("f{}.txt", i % 23)),
                d.join(format!("g{}.txt", i % 11)),
            );
        }
        i += 1;
        std::thread::sleep(Duration::from_millis(2));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let reads = reader.join().expect("the reader of mount b failed");
    eprintln!("{i} writes in mount a, {reads} reads in mount b");
    wait_synced(&[&a.dev, &b.dev], 60);
    assert_eq!(tree(&a.mnt), tree(&b.mnt));
}
