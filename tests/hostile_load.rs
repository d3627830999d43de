//! A trusted peer turned hostile, second pass continued (#45): what it can make the victim
//! hold, queue or redo. Each test is driven by a hostile client built on the protocol crate
//! (`common::hostile`) against a real daemon, and prints the figures it bounds.
//!
//! | item | attack | test |
//! |---|---|---|
//! | connections | 50 connections of one trusted device, none saying its hello, each pushing data | `connections_waiting_for_their_hello_hold_little_of_the_victims_memory` |
//! | empty batches | 50,000 empty index batches with rising `up_to`, the victim's answers never read | `a_flood_of_empty_batches_leaves_one_acknowledgement_waiting_and_few_journal_writes` |
//! | records that never apply | a file where the victim has a FIFO (which it does not sync), then a later batch | `a_record_in_the_way_of_something_not_synced_is_skipped_and_later_batches_apply` |
//! | tiny chunks | a record of 400,000 distinct one-byte chunks (a 14 MB frame for 400 KB) | `a_record_of_chunks_no_meshfs_cuts_is_skipped_before_any_is_looked_up` |
//! | batches held | in each of 16 folders, four batches of the most vector entries a batch may carry, none of which can apply | `the_batches_a_session_holds_are_bounded_in_bytes_whatever_the_folders` |

use crate::common;
use common::hostile::*;
use common::*;
use meshfs_protocol::*;
use std::time::{Duration, Instant};

/// Connections mallory opens without the transport's hello.
const WAITING: usize = 50;

/// The victim's resident memory may grow by at most this much while 50 connections of one
/// device wait for their hello, each pushing data (MiB). Before #45's second pass each could
/// hold 64 MiB of unread stream data (the connection's receive window) for 10 s.
const WAITING_BOUND_MIB: u64 = 48;

#[test]
fn connections_waiting_for_their_hello_hold_little_of_the_victims_memory() {
    let mut s = Scene::new();
    s.start();
    let addr: std::net::SocketAddr = s.a.addr.parse().unwrap();
    let config = resuming_client(&s.mallory, CountingTickets::new());
    let before = s.a.usage();
    let t0 = Instant::now();
    let (opened, welcomed, pushed) = s.rt.block_on(async {
        let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
        ep.set_default_client_config(config);
        let pushed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut conns = Vec::new();
        let mut writers = Vec::new();
        for _ in 0..WAITING {
            // The TLS handshake only: no hello on the first unidirectional stream.
            let Ok(Ok(conn)) = tokio::time::timeout(
                Duration::from_secs(5),
                ep.connect(addr, meshfs_daemon::transport::SERVER_NAME)
                    .unwrap(),
            )
            .await
            else {
                continue;
            };
            // Data on bidirectional streams (chunk requests, the control stream), as fast as
            // the victim takes it; no unidirectional stream, whose first would be its hello.
            for _ in 0..8 {
                let (c, pushed) = (conn.clone(), pushed.clone());
                writers.push(tokio::spawn(async move {
                    let Ok((mut send, _)) = c.open_bi().await else {
                        return;
                    };
                    let block = vec![0x5au8; 64 << 10];
                    while send.write_all(&block).await.is_ok() {
                        pushed.fetch_add(block.len() as u64, std::sync::atomic::Ordering::Relaxed);
                    }
                }));
            }
            conns.push(conn);
        }
        // Long enough for every connection to fill whatever the victim lets it, well within
        // the 10 s it waits for a hello.
        tokio::time::sleep(Duration::from_secs(4)).await;
        let opened = conns.len();
        // The victim welcomes a connection it keeps waiting for the hello (its first
        // unidirectional stream); those beyond what it lets one device keep waiting are closed.
        let mut welcomed = 0;
        for c in &conns {
            if let Ok(Ok(_)) =
                tokio::time::timeout(Duration::from_millis(200), c.accept_uni()).await
            {
                welcomed += 1;
            }
        }
        for w in writers {
            w.abort();
        }
        (
            opened,
            welcomed,
            pushed.load(std::sync::atomic::Ordering::Relaxed),
        )
    });
    let during = s.a.usage();
    let growth = during.peak_kib.saturating_sub(before.rss_kib);
    eprintln!(
        "{opened} connections without a hello ({welcomed} kept waiting), {} MiB written by mallory in {:.1} s (how much the victim took): victim RSS {} -> {} KiB, peak +{growth} KiB (bound {WAITING_BOUND_MIB} MiB)",
        pushed >> 20,
        t0.elapsed().as_secs_f64(),
        before.rss_kib,
        during.rss_kib,
    );
    assert!(
        welcomed <= meshfs_daemon::transport::MAX_WAITING_PER_DEVICE,
        "{welcomed} connections of one device were kept waiting for their hello"
    );
    assert!(
        growth <= WAITING_BOUND_MIB << 10,
        "the victim's peak RSS grew by {growth} KiB with {opened} connections waiting for their hello"
    );
    s.honest_peer_syncs("after");
    // Once those are gone, the device connects, and a second connection of it replaces the
    // first: one connection per device.
    let first = s.connect();
    let second = s.connect();
    assert!(
        s.rt.block_on(first.closed_within(10)),
        "a second connection of the device did not replace the first"
    );
    assert!(!s.rt.block_on(second.closed_within(1)));
}

/// Folders the victim shares with mallory besides `work`.
const FOLDERS: usize = 16;

/// The victim's resident memory may grow by at most this much while mallory's batches wait
/// in 16 folders (MiB): the session's budget (`RECEIVE_BUDGET`, 64 MiB) and a few batches
/// more, the control stream's unread window, allocator slack.
const HELD_BOUND_MIB: u64 = 128;

/// A batch of 1000 directories with 255-byte names and vectors of 262 entries each, together
/// nearly the most a batch may carry (`MAX_VV_ENTRIES_PER_BATCH`): about 1 MB on the wire,
/// 4.6 MB decoded.
fn heavy_batch(n: usize, by: ShortId) -> Vec<FileRecord> {
    let entries = MAX_VV_ENTRIES_PER_BATCH / 1000;
    (0..1000)
        .map(|i| {
            let name = format!("{n:03}-{i:04}-{}", "x".repeat(246));
            let v = VersionVector::from_pairs(
                std::iter::once((by, 1 + n as u64))
                    .chain((1..entries as u64).map(|d| (ShortId(d), 1))),
            );
            FileRecord {
                kind: FileKind::Dir,
                mode: 0o755,
                ..file_record(&name, b"", v, by)
            }
        })
        .collect()
}

#[test]
fn the_batches_a_session_holds_are_bounded_in_bytes_whatever_the_folders() {
    let mut s = Scene::new();
    let folders: Vec<String> = (0..FOLDERS).map(|i| format!("f{i}")).collect();
    for f in &folders {
        let dir = s.t.path().join("a-folders").join(f);
        std::fs::create_dir_all(&dir).unwrap();
        ok(
            &s.a.home,
            &["folder", "add", dir.to_str().unwrap(), "--id", f],
        );
    }
    let mallory_id = s.mallory.device_id.to_string();
    let mut share = vec!["peer", "add", mallory_id.as_str(), "--share", "work"];
    for f in &folders {
        share.extend(["--share", f.as_str()]);
    }
    ok(&s.a.home, &share);
    // Each folder's first batch stops in its decision (the folder's lock held), so nothing
    // mallory sends after it can apply: the batches queue, as many as the session takes.
    let points: Vec<String> = folders
        .iter()
        .map(|f| format!("apply.decided@hold-{f}.txt"))
        .collect();
    s.a.arm(
        &points
            .iter()
            .map(|p| format!("{p}=pause"))
            .collect::<Vec<_>>()
            .join(","),
    );
    s.start();
    let names: Vec<&str> = folders.iter().map(String::as_str).collect();
    let mut m =
        s.rt.block_on(Mallory::connect_sharing(&s.a, &s.mallory, &names));
    let by = m.short();
    for f in &folders {
        let hold = file_record(
            &format!("hold-{f}.txt"),
            b"never served",
            version(&[(by, 1)]),
            by,
        );
        s.rt.block_on(m.send_batch_to(f, vec![hold])).unwrap();
    }
    for p in &points {
        s.a.wait_paused(p, 30);
    }
    let before = s.a.usage();
    s.a.reset_peak_rss();
    // Three more batches per folder (the window is four unacknowledged): as many as the
    // victim reads within a few seconds; the rest waits in mallory's flow control.
    let t0 = Instant::now();
    let sent = s.rt.block_on(async {
        let mut sent = 0usize;
        let all = async {
            for n in 0..3 {
                for f in &folders {
                    if m.send_batch_to(f, heavy_batch(n, by)).await.is_err() {
                        return;
                    }
                    sent += 1;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(4), all).await;
        sent
    });
    // What the victim took in settles once its session stops reading.
    std::thread::sleep(Duration::from_secs(1));
    let during = s.a.usage();
    let growth = during.peak_kib.saturating_sub(before.rss_kib);
    eprintln!(
        "{sent} of {} batches of ~4.6 MB decoded written by mallory in {:.1} s: victim RSS {} -> {} KiB, peak +{growth} KiB (bound {HELD_BOUND_MIB} MiB)",
        3 * FOLDERS,
        t0.elapsed().as_secs_f64(),
        before.rss_kib,
        during.rss_kib
    );
    // The honest peer's folder is not held up.
    s.honest_peer_syncs("during");
    assert!(
        growth <= HELD_BOUND_MIB << 10,
        "the victim's peak RSS grew by {growth} KiB holding mallory's batches"
    );
    for p in &points {
        s.a.resume(p);
    }
    drop(m);
}

/// Empty batches mallory sends.
const EMPTY: u64 = 50_000;

/// The victim's resident memory may grow by at most this much while it answers 50,000 empty
/// batches that mallory does not read (MiB).
const EMPTY_BOUND_MIB: u64 = 16;

#[test]
fn a_flood_of_empty_batches_leaves_one_acknowledgement_waiting_and_few_journal_writes() {
    let mut s = Scene::new();
    s.start();
    // Mallory reads a kilobyte of what the victim says and then nothing, until the end.
    let mut m =
        s.rt.block_on(Mallory::connect_with_window(&s.a, &s.mallory, 1024));
    // Its hello through (the victim says its own), before counting.
    std::thread::sleep(Duration::from_millis(500));
    let before = s.a.usage();
    s.a.reset_peak_rss();
    let (calls0, bytes0) = s.a.writes();
    let t0 = Instant::now();
    let work = FolderId::new("work").unwrap();
    let mut frames = Vec::new();
    for up_to in 1..=EMPTY {
        frames.extend(
            encode_frame(&Message::Index(IndexBatch {
                folder: work.clone(),
                records: Vec::new(),
                up_to,
                inline: Vec::new(),
            }))
            .unwrap(),
        );
    }
    s.rt.block_on(m.ctl.write_all(&frames)).unwrap();
    // Mallory reads nothing until the victim has taken every batch.
    let mallory_id = s.mallory.device_id.to_string();
    wait_until(120, "the victim takes every empty batch", &s.a, || {
        applied_from(&s.a.status(), &mallory_id) == EMPTY
    });
    let took = t0.elapsed();
    // Then it reads what the victim had for it, up to the acknowledgement of the last batch.
    let (acks, last) = s.rt.block_on(async {
        let mut acks = 0u64;
        let mut last = 0;
        while last < EMPTY {
            match tokio::time::timeout(
                Duration::from_secs(30),
                meshfs_daemon::transport::read_message(&mut m.ctl_recv),
            )
            .await
            {
                Ok(Ok(Some(Message::IndexAck(a)))) => {
                    acks += 1;
                    last = a.sequence;
                }
                Ok(Ok(Some(_))) => {}
                other => panic!("the victim stopped answering: {other:?}"),
            }
        }
        (acks, last)
    });
    // The last resume point is written within a second of the last batch.
    std::thread::sleep(Duration::from_millis(1500));
    let after = s.a.usage();
    let (calls1, bytes1) = s.a.writes();
    let growth = after.peak_kib.saturating_sub(before.rss_kib);
    let (calls, bytes) = (calls1 - calls0, bytes1 - bytes0);
    eprintln!(
        "{EMPTY} empty batches taken in {:.1} s: {acks} acknowledgements waited for mallory (the last of {last}); the victim wrote {} KiB to files in {calls} calls; RSS {} -> {} KiB, peak +{growth} KiB (bound {EMPTY_BOUND_MIB} MiB)",
        took.as_secs_f64(),
        bytes >> 10,
        before.rss_kib,
        after.rss_kib,
    );
    assert_eq!(last, EMPTY);
    // A kilobyte holds ~80 acknowledgements, written before mallory's window filled; then one
    // waited, replaced by each newer one.
    assert!(
        acks <= 200,
        "{acks} acknowledgements waited for {EMPTY} batches: one was queued per batch"
    );
    // The resume point is written about once a second. Written per batch, each a page of
    // SQLite's log (4 KiB and a 24-byte header), it would be over 200 MB; what remains is the
    // runtime's wake-ups (8 bytes each) and the log.
    assert!(
        bytes <= 8 << 20,
        "the victim wrote {bytes} bytes to files for {EMPTY} empty batches"
    );
    assert!(
        growth <= EMPTY_BOUND_MIB << 10,
        "the victim's peak RSS grew by {growth} KiB"
    );
    s.honest_peer_syncs("after");
}

/// What the victim's status says it applied of `peer`'s index in folder `work`.
fn applied_from(st: &serde_json::Value, peer: &str) -> u64 {
    st["folders"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["id"] == "work")
        .flat_map(|f| f["peers"].as_array().cloned().unwrap_or_default())
        .find(|p| p["device_id"] == peer)
        .and_then(|p| p["applied_from_peer"].as_u64())
        .unwrap_or(0)
}

#[test]
fn a_record_in_the_way_of_something_not_synced_is_skipped_and_later_batches_apply() {
    let mut s = Scene::new();
    s.start();
    // A FIFO on the victim: a special file, never recorded, so no version of the path exists.
    // (Made once in sync: comparing the two trees would open it and wait for a writer.)
    let fifo = s.a.path("pipe.txt");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let mut m = s.connect();
    let by = m.short();
    let theirs = file_record("pipe.txt", b"theirs", version(&[(by, 1)]), by);
    let fine = file_record("fine.txt", b"fine", version(&[(by, 2)]), by);
    s.rt.block_on(m.send_batch(vec![theirs, fine], vec![inline(b"theirs"), inline(b"fine")]))
        .unwrap();
    let later = file_record("later.txt", b"later", version(&[(by, 3)]), by);
    s.rt.block_on(m.send_batch(vec![later], vec![inline(b"later")]))
        .unwrap();
    // The batch after it applies: the first was acknowledged, with pipe.txt left out.
    wait_until(60, "the later batch applies", &s.a, || {
        s.a.path("later.txt").exists()
    });
    assert!(s.a.path("fine.txt").exists());
    use std::os::unix::fs::FileTypeExt;
    assert!(
        std::fs::symlink_metadata(&fifo)
            .unwrap()
            .file_type()
            .is_fifo(),
        "the FIFO was replaced"
    );
    let st = s.a.status();
    let skipped: Vec<(String, String)> = st["folders"][0]["skipped"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|x| {
            (
                x["path"].as_str().unwrap_or_default().to_string(),
                x["error"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert!(
        skipped
            .iter()
            .any(|(p, e)| p == "pipe.txt" && e.contains("changed at every try")),
        "pipe.txt is not shown as skipped: {skipped:?}"
    );
    // The session goes on: no failure, no reconnect.
    assert!(!s.rt.block_on(m.closed_within(1)), "the session ended");
    assert!(!s.a.log().contains("kept changing"), "{}", s.a.log());
    s.honest_peer_syncs("after");
}

/// The `work` folder's skipped list in the victim's status: (path, error).
fn skipped_in_work(dev: &Device) -> Vec<(String, String)> {
    dev.status()["folders"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|f| f["id"] == "work")
        .flat_map(|f| f["skipped"].as_array().cloned().unwrap_or_default())
        .map(|x| {
            (
                x["path"].as_str().unwrap_or_default().to_string(),
                x["error"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

#[test]
fn a_record_of_chunks_no_meshfs_cuts_is_skipped_before_any_is_looked_up() {
    let mut s = Scene::new();
    s.start();
    let mut m = s.connect();
    let by = m.short();
    // 400,000 one-byte chunks, each its own hash: per chunk, a lookup under the folder's lock
    // (those the index could hold), an entry to fetch, a request, a write.
    const TINY: u32 = 400_000;
    let mut tiny = file_record("tiny.bin", b"", version(&[(by, 1)]), by);
    tiny.chunks = (0..TINY)
        .map(|i| Chunk {
            len: 1,
            hash: Hash::of(&i.to_le_bytes()),
        })
        .collect();
    tiny.size = u64::from(TINY);
    tiny.hash = Hash::of_chunks(&tiny.chunks);
    let fine = file_record("fine.txt", b"fine", version(&[(by, 2)]), by);
    let before = s.a.usage();
    let t0 = Instant::now();
    s.rt.block_on(m.send_batch(vec![tiny, fine], vec![inline(b"fine")]))
        .unwrap();
    let later = file_record("later.txt", b"later", version(&[(by, 3)]), by);
    s.rt.block_on(m.send_batch(vec![later], vec![inline(b"later")]))
        .unwrap();
    wait_until(60, "the rest of the batch and the next apply", &s.a, || {
        s.a.path("fine.txt").exists() && s.a.path("later.txt").exists()
    });
    let took = t0.elapsed();
    let after = s.a.usage();
    let sk = skipped_in_work(&s.a);
    eprintln!(
        "a record of {TINY} one-byte chunks: the batch and the next applied in {:.1} s, the victim spent {:.2} s of CPU; skipped: {sk:?}",
        took.as_secs_f64(),
        after.cpu.saturating_sub(before.cpu).as_secs_f64()
    );
    assert!(!s.a.path("tiny.bin").exists());
    assert!(
        sk.iter()
            .any(|(p, e)| p == "tiny.bin" && e.contains("shorter than")),
        "tiny.bin is not shown as skipped: {sk:?}"
    );
    assert!(!s.rt.block_on(m.closed_within(1)), "the session ended");
    s.honest_peer_syncs("after");
}
