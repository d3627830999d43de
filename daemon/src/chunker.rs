//! Content hashing and content-defined chunking (FastCDC 2020, cut search in [`meshfs_protocol::cdc`],
//! + blake3).
//!
//! Boundaries depend on content, not offsets, so inserting bytes into a file changes one or
//! two chunks instead of every chunk after the insert. Chunk sizes scale with the file so a
//! record's chunk list stays small enough for one index frame (see `docs/architecture.md`
//! for the sizes and the measurement behind them).

use meshfs_protocol::{Chunk, Hash};
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes read for hashing since the process started (the scanner's tests read it to prove an
/// unchanged tree is not re-read).
pub static BYTES_HASHED: AtomicU64 = AtomicU64::new(0);

/// (min, avg, max) chunk sizes for a file of `size` bytes.
pub fn chunk_sizes(size: u64) -> (u32, u32, u32) {
    const KIB: u32 = 1024;
    if size <= 1 << 30 {
        (16 * KIB, 64 * KIB, 256 * KIB)
    } else if size <= 16 << 30 {
        (64 * KIB, 256 * KIB, 1024 * KIB)
    } else {
        (256 * KIB, 1024 * KIB, 4096 * KIB)
    }
}

/// A file's content summary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Content {
    /// The content hash, from the chunk list ([`Hash::of_chunks`]).
    pub hash: Hash,
    /// Bytes read.
    pub size: u64,
    /// The chunk list.
    pub chunks: Vec<Chunk>,
}

/// Hashes and chunks everything `reader` yields. `size_hint` picks the chunk sizes; the
/// result describes exactly the bytes read.
pub fn chunk_reader(mut reader: impl Read, size_hint: u64) -> std::io::Result<Content> {
    let (min, avg, max) = chunk_sizes(size_hint);
    let (min, avg, max) = (min as usize, avg as usize, max as usize);
    let mut chunks = Vec::new();
    // The window must exceed the largest chunk so every cut search sees its full range; a file
    // of up to WINDOW_CAP gets a window of its own size. Larger windows only cost: each refill
    // is read, cut and hashed while it is still in the CPU's cache (warm first scan of 2 GiB in
    // 32 MiB files: 1.24 s with 8 MiB windows, 1.01 s with 1 MiB). The buffer is reused per
    // thread: a scan of 100,000 small files must not allocate a zeroed buffer for each.
    const WINDOW_CAP: usize = 1 << 20;
    let want = (max * 2).max(((size_hint as usize).saturating_add(1)).min(WINDOW_CAP));
    let mut buf = WINDOW.with(|w| std::mem::take(&mut *w.borrow_mut()));
    if buf.len() < want {
        buf.resize(want, 0);
    }
    let result = fill_chunks(&mut reader, &mut buf[..want], min, avg, max, &mut chunks);
    WINDOW.with(|w| *w.borrow_mut() = buf);
    let total = result?;
    BYTES_HASHED.fetch_add(total, Ordering::Relaxed);
    Ok(Content {
        hash: Hash::of_chunks(&chunks),
        size: total,
        chunks,
    })
}

thread_local! {
    static WINDOW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn fill_chunks(
    reader: &mut impl Read,
    buf: &mut [u8],
    min: usize,
    avg: usize,
    max: usize,
    chunks: &mut Vec<Chunk>,
) -> std::io::Result<u64> {
    let masks = meshfs_protocol::cdc::select_masks(avg);
    let mut filled = 0usize;
    let mut eof = false;
    let mut total = 0u64;
    loop {
        while !eof && filled < buf.len() {
            let n = reader.read(&mut buf[filled..])?;
            if n == 0 {
                eof = true;
            }
            filled += n;
        }
        if filled == 0 {
            break;
        }
        let mut consumed = 0usize;
        while consumed < filled {
            let rest = &buf[consumed..filled];
            let len = meshfs_protocol::cdc::cut_with_masks(rest, min, avg, max, masks.0, masks.1);
            // Keep a trailing chunk that may only end because the window ended.
            if !eof && len == rest.len() {
                break;
            }
            chunks.push(Chunk {
                len: len as u32,
                hash: Hash::of(&rest[..len]),
            });
            consumed += len;
        }
        total += consumed as u64;
        buf.copy_within(consumed..filled, 0);
        filled -= consumed;
        if eof && filled == 0 {
            break;
        }
    }
    Ok(total)
}

/// Hashes and chunks an in-memory buffer.
pub fn chunk_bytes(data: &[u8]) -> Content {
    chunk_reader(data, data.len() as u64).expect("reading from a slice cannot fail")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::{RngCore, SeedableRng};

    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut v = vec![0u8; len];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
        v
    }

    #[test]
    fn chunks_cover_the_content_and_hash_matches() {
        let data = noise(3 << 20, 1);
        let c = chunk_bytes(&data);
        assert!(c.chunks.len() > 1);
        assert_eq!(c.hash, Hash::of_chunks(&c.chunks));
        // Files of one chunk hash as their content (what `b3sum` prints).
        let small = chunk_bytes(&data[..10_000]);
        assert_eq!(small.hash, Hash::of(&data[..10_000]));
        assert_eq!(chunk_bytes(b"").hash, Hash::of(b""));
        assert_eq!(
            c.chunks.iter().map(|c| c.len as u64).sum::<u64>(),
            data.len() as u64
        );
        let mut off = 0;
        for ch in &c.chunks {
            assert_eq!(ch.hash, Hash::of(&data[off..off + ch.len as usize]));
            off += ch.len as usize;
        }
    }

    #[test]
    fn an_insert_in_the_middle_changes_few_chunks() {
        let data = noise(8 << 20, 2);
        let mut edited = data[..4 << 20].to_vec();
        edited.extend_from_slice(b"inserted bytes");
        edited.extend_from_slice(&data[4 << 20..]);
        let a = chunk_bytes(&data);
        let b = chunk_bytes(&edited);
        let known: std::collections::HashSet<_> = a.chunks.iter().map(|c| c.hash).collect();
        let new = b.chunks.iter().filter(|c| !known.contains(&c.hash)).count();
        assert!(new <= 3, "{new} new chunks");
    }

    proptest! {
        #[test]
        fn windowed_reading_equals_one_pass(len in 0usize..600_000, seed in any::<u64>(), step in 1usize..70_000) {
            let data = noise(len, seed);
            struct Trickle<'a>(&'a [u8], usize);
            impl Read for Trickle<'_> {
                fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
                    let n = self.0.len().min(self.1).min(out.len());
                    out[..n].copy_from_slice(&self.0[..n]);
                    self.0 = &self.0[n..];
                    Ok(n)
                }
            }
            let a = chunk_reader(Trickle(&data, step), len as u64).unwrap();
            prop_assert_eq!(a, chunk_bytes(&data));
        }
    }
}
