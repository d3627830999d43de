//! Mounts a directory through meshfs-fuse until SIGINT or SIGTERM, then prints how many
//! change events the mount reported.
//!
//! ```text
//! passthrough_mount [--no-passthrough] [--no-io-uring] [--no-read-ahead] [--no-keep-cache] [--no-write-direct] [--ro] [--allow-other] [--threads N] [--print-events] <backing-dir> <mountpoint>
//! ```
//!
//! Used to run conformance suites (pjdfstest) and timings against the mount.

#[path = "common/mod.rs"]
mod common;

use meshfs_fuse::{ChangeEvent, MountOptions};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let mut opts = MountOptions::default();
    let mut print = false;
    let mut paths = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--threads" => opts.n_threads = args.next().and_then(|n| n.parse().ok()).unwrap_or(2),
            "--no-passthrough" => opts.passthrough = false,
            "--no-io-uring" => opts.io_uring = false,
            "--no-read-ahead" => opts.read_ahead = false,
            "--no-keep-cache" => opts.keep_cache = false,
            "--no-write-direct" => opts.write_direct = false,
            "--ro" => opts.read_only = true,
            "--print-events" => print = true,
            "--allow-other" => opts.allow_other = true,
            _ => paths.push(PathBuf::from(arg)),
        }
    }
    let [backing, mountpoint] = paths.as_slice() else {
        eprintln!("usage: passthrough_mount [--no-passthrough] [--no-io-uring] [--no-read-ahead] [--no-keep-cache] [--no-write-direct] [--ro] [--allow-other] [--threads N] [--print-events] <backing-dir> <mountpoint>");
        std::process::exit(2);
    };

    let stop = common::StopSignals::block();

    let events = Arc::new(AtomicUsize::new(0));
    let counter = events.clone();
    let sink = move |ev: ChangeEvent| {
        counter.fetch_add(1, Ordering::Relaxed);
        if print {
            eprintln!("event {:?} {}", ev.kind, ev.path);
        }
    };
    let mount = match meshfs_fuse::mount(backing, mountpoint, opts, Arc::new(sink)) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let info = mount.info();
    let off = info
        .passthrough_off
        .map(|why| format!(" [{why}]"))
        .unwrap_or_default();
    println!(
        "mounted {} at {} (passthrough: {}{off}, threads: {}, io_uring: {})",
        info.backing.display(),
        info.mountpoint.display(),
        info.passthrough,
        info.threads,
        info.io_uring
    );

    stop.wait();
    let info = mount.info();
    if let Err(e) = mount.unmount() {
        eprintln!("error: {e}");
    }
    println!(
        "unmounted; {} change events, {} inodes known at exit, passthrough: {}",
        events.load(Ordering::Relaxed),
        info.known_inodes,
        info.passthrough
    );
}
