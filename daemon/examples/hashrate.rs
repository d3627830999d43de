//! Single-core throughput of each pass the scanner makes over new content, on 256 MiB in
//! memory (no I/O): the FastCDC cut search (ours, and the fastcdc crate's that it reproduces),
//! blake3 of the chunks, and `chunker::chunk_bytes`
//! (both; the file's hash comes from the chunk list). blake3 of the whole buffer is printed
//! for comparison with `b3sum` (whole-file blake3 only, every core, memory-mapped):
//! `cargo run --release -p meshfs-daemon --example hashrate`. With a file's path, it times that
//! file's chunking as the scanner does it (`hashrate [--read] FILE`, see `main`).

use meshfs_daemon::chunker;
use std::time::Instant;

fn rate(name: &str, bytes: usize, f: impl FnOnce()) {
    let t = Instant::now();
    f();
    let s = t.elapsed().as_secs_f64();
    println!(
        "{name:<40} {:>7.0} MiB/s",
        bytes as f64 / (1 << 20) as f64 / s
    );
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(path) = args.last() {
        // `hashrate [--read] FILE`: one file on disk through `chunker::chunk_file`, as the
        // scanner reads it, or through `chunk_reader` (`read(2)` alone) with `--read`. Drop the
        // page cache first for a cold read: `echo 3 > /proc/sys/vm/drop_caches`.
        let file = std::fs::File::open(path).expect("open");
        let size = file.metadata().expect("stat").len();
        let read = args.iter().any(|a| a == "--read");
        let t = Instant::now();
        let c = if read {
            chunker::chunk_reader(file, size).expect("chunk_reader")
        } else {
            chunker::chunk_file(&file, size).expect("chunk_file")
        };
        let s = t.elapsed().as_secs_f64();
        println!(
            "{} {path}: {} chunks, {size} bytes in {s:.3} s, {:.0} MiB/s",
            if read { "chunk_reader" } else { "chunk_file" },
            c.chunks.len(),
            size as f64 / (1 << 20) as f64 / s
        );
        return;
    }
    let n = 256 << 20;
    let mut data = vec![0u8; n];
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    let (min, avg, max) = chunker::chunk_sizes(n as u64);
    let mut cuts = Vec::new();
    rate("cut search (meshfs_protocol::cdc)", n, || {
        let mut lens = Vec::new();
        meshfs_protocol::cdc::chunk_lengths(
            &data,
            min as usize,
            avg as usize,
            max as usize,
            &mut lens,
        );
        std::hint::black_box(lens);
    });
    rate("cut search (fastcdc crate)", n, || {
        cuts = fastcdc::v2020::FastCDC::new(&data, min as usize, avg as usize, max as usize)
            .map(|c| (c.offset, c.length))
            .collect();
    });
    rate("blake3 of each chunk", n, || {
        for (o, l) in &cuts {
            std::hint::black_box(blake3::hash(&data[*o..o + l]));
        }
    });
    rate("blake3 of the whole file (b3sum's pass)", n, || {
        std::hint::black_box(blake3::hash(&data));
    });
    rate("chunk_bytes (cut search + chunk hashes)", n, || {
        std::hint::black_box(chunker::chunk_bytes(&data));
    });
}
