//! Content hashing and content-defined chunking (FastCDC 2020, cut search in [`meshfs_protocol::cdc`],
//! + blake3).
//!
//! Boundaries depend on content, not offsets, so inserting bytes into a file changes one or
//! two chunks instead of every chunk after the insert. Chunk sizes scale with the file so a
//! record's chunk list stays small enough for one index frame (see `docs/architecture.md`
//! for the sizes and the measurement behind them).

use crate::mapped::{Mapped, Torn};
use meshfs_protocol::{Chunk, Hash};
use std::fs::{File, Metadata};
use std::io::Read;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;

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

impl Content {
    /// The content of `size` bytes read as `chunks`, counted in [`BYTES_HASHED`].
    fn counted(chunks: Vec<Chunk>, size: u64) -> Content {
        BYTES_HASHED.fetch_add(size, Ordering::Relaxed);
        Content {
            hash: Hash::of_chunks(&chunks),
            size,
            chunks,
        }
    }
}

/// [`chunk_reader`] of a small file read whole into memory, with the bytes read: a file of
/// `size` bytes (from the caller's stat) is one read, and its bytes can go on (D113).
pub fn chunk_whole(mut file: &File, size: u64) -> std::io::Result<(Content, Vec<u8>)> {
    // One byte more than the stat said: a file that grew meanwhile is read as it is now.
    let mut data = Vec::with_capacity(size as usize + 1);
    Read::read_to_end(&mut Read::take(&mut file, size + 1), &mut data)?;
    let content = chunk_reader(&data[..], size)?;
    Ok((content, data))
}

/// Hashes and chunks everything `reader` yields. `size_hint` picks the chunk sizes; the
/// result describes exactly the bytes read.
pub fn chunk_reader(mut reader: impl Read, size_hint: u64) -> std::io::Result<Content> {
    let cut = Cutter::for_size(size_hint);
    let mut chunks = Vec::new();
    // The window must exceed the largest chunk so every cut search sees its full range; a file
    // of up to WINDOW_CAP gets a window of its own size. Larger windows only cost: each refill
    // is read, cut and hashed while it is still in the CPU's cache (warm first scan of 2 GiB in
    // 32 MiB files: 1.24 s with 8 MiB windows, 1.01 s with 1 MiB). The buffer is reused per
    // thread: a scan of 100,000 small files must not allocate a zeroed buffer for each.
    const WINDOW_CAP: usize = 1 << 20;
    let want = (cut.max * 2).max(((size_hint as usize).saturating_add(1)).min(WINDOW_CAP));
    let mut buf = WINDOW.with(|w| std::mem::take(&mut *w.borrow_mut()));
    if buf.len() < want {
        buf.resize(want, 0);
    }
    let result = fill_chunks(&mut reader, &mut buf[..want], &cut, &mut chunks);
    WINDOW.with(|w| *w.borrow_mut() = buf);
    let total = result?;
    Ok(Content::counted(chunks, total))
}

thread_local! {
    static WINDOW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn fill_chunks(
    reader: &mut impl Read,
    buf: &mut [u8],
    cut: &Cutter,
    chunks: &mut Vec<Chunk>,
) -> std::io::Result<u64> {
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
        // A trailing chunk that may only end because the window ended waits for the refill.
        let window = &buf[..filled];
        let mut consumed = 0usize;
        while let Some(n) = cut.next(window, consumed, eof) {
            chunks.push(Chunk {
                len: n as u32,
                hash: Hash::of(&window[consumed..consumed + n]),
            });
            consumed += n;
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

/// Files from this size on may be read through a memory mapping rather than `read(2)`: the cut
/// search and the chunk hashes then read the page cache directly, without a copy, and two
/// threads can share the file. Below it, a mapping's set-up and page faults cost more than the
/// copy they save.
pub const MAP_FROM: u64 = 1 << 20;

/// The most of a file mapped at once: a large file is chunked one segment after another, so the
/// daemon's address space and resident set never hold more than this of it.
const SEGMENT: u64 = 64 << 20;

/// Hashes and chunks an open file: what [`chunk_reader`] yields for it; from [`MAP_FROM`] bytes
/// on, while a core is idle and the file is mostly in the page cache, read through a mapping and
/// cut and hashed on two threads. Fails if the file was truncated or rewritten while it was read (its size, mtime or ctime moved): the caller sees the change
/// again through its watcher and reads the new content then.
pub fn chunk_file(file: &File, size_hint: u64) -> std::io::Result<Content> {
    let _busy = Hashing::enter();
    // The caller's stat already tells a small file: no second one for each of 100,000.
    if size_hint < MAP_FROM {
        return chunk_reader(file, size_hint);
    }
    let before = file.metadata()?;
    // Mapped only while a core would otherwise idle (then it is also cut and hashed on two
    // threads). With every core on a file of its own, `read(2)` is as fast warm and faster
    // cold: 64 files of 32 MiB, cache dropped, 1.96-2.83 s read against 2.45-2.71 s mapped
    // (page faults read ahead less eagerly than 1 MiB reads, even with MADV_WILLNEED).
    if before.len() < MAP_FROM || !Hashing::spare_core() {
        let content = chunk_reader(file, size_hint)?;
        unchanged(file, &before)?;
        return Ok(content);
    }
    // Mapped only where the file is in the page cache already; a cold file is read, with the
    // kernel asked for the next `AHEAD` bytes as the reading nears what it was asked for, and
    // cut here while a helper hashes (D11). A cold 512 MiB file (`hashrate FILE`, 25 rounds):
    // 0.49-0.60 s mapped (page faults bring it in page by page), 0.31-0.44 s read in most
    // rounds (0.48-0.63 s where the page cache landed on memory this VM had given back).
    // Read or mapped, a file that changed meanwhile is refused: a torn read must not become a
    // version that never existed on disk (the watcher's event for the change rescans it).
    if !mostly_cached(file, before.len()) {
        let reader = AdvisedReader {
            file,
            pos: 0,
            advised: 0,
            size: before.len(),
        };
        let content = cut_here_hash_there_read(reader, size_hint)?;
        unchanged(file, &before)?;
        return Ok(content);
    }
    chunk_mapped(file, &before, SEGMENT, Hashing::spare_core)
}

/// Fails if `file`'s size, mtime or ctime moved since its stat `before`: it was written while
/// it was read.
fn unchanged(file: &File, before: &Metadata) -> std::io::Result<()> {
    let stamp = |m: &Metadata| {
        (
            m.len(),
            m.mtime(),
            m.mtime_nsec(),
            m.ctime(),
            m.ctime_nsec(),
        )
    };
    if stamp(&file.metadata()?) != stamp(before) {
        return Err(std::io::Error::other("the file changed while it was read"));
    }
    Ok(())
}

/// [`chunk_reader`] on two threads: this one reads a window and cuts it, a helper hashes the
/// chunks of the window before, each window a buffer of its own (three in turn), so the read
/// and the cut search overlap the hashing. The buffers are kept per thread for the next file
/// (they are above the allocator's mapping threshold: fresh ones would be page-faulted in
/// again for every file).
fn cut_here_hash_there_read(mut reader: impl Read, size_hint: u64) -> std::io::Result<Content> {
    const WINDOW: usize = 4 << 20;
    const BUFFERS: usize = 3;
    let cut = Cutter::for_size(size_hint);
    // A window holds a largest chunk twice (so every cut search sees its full range); a small
    // file gets a window of its own size.
    let size = (cut.max * 2).max(((size_hint as usize).saturating_add(1)).min(WINDOW));
    let mut spare = READ_BUFFERS.with(|b| std::mem::take(&mut *b.borrow_mut()));
    type Work = (Vec<u8>, Vec<(usize, usize)>);
    let (work_tx, work_rx) = std::sync::mpsc::sync_channel::<Work>(BUFFERS);
    let (free_tx, free_rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let result = std::thread::scope(|s| {
        let hasher = s.spawn(move || {
            let _busy = Hashing::enter();
            let mut out = Vec::new();
            for (buf, cuts) in work_rx {
                out.extend(cuts.iter().map(|&(pos, n)| Chunk {
                    len: n as u32,
                    hash: Hash::of(&buf[pos..pos + n]),
                }));
                // The reader may have stopped (an error): then the buffer is just dropped.
                let _ = free_tx.send(buf);
            }
            out
        });
        let read = (|| -> std::io::Result<u64> {
            let mut made = 0;
            let mut carry: Vec<u8> = Vec::new();
            let mut eof = false;
            let mut total = 0u64;
            loop {
                let mut buf = if made < BUFFERS {
                    made += 1;
                    let mut b = spare.pop().unwrap_or_default();
                    if b.len() < size {
                        b.resize(size, 0);
                    }
                    b
                } else {
                    match free_rx.recv() {
                        Ok(b) => b,
                        Err(_) => return Err(std::io::Error::other("the hashing thread stopped")),
                    }
                };
                buf[..carry.len()].copy_from_slice(&carry);
                let mut filled = carry.len();
                while !eof && filled < size {
                    let n = reader.read(&mut buf[filled..size])?;
                    eof = n == 0;
                    filled += n;
                }
                if filled == 0 {
                    spare.push(buf);
                    return Ok(total);
                }
                let mut cuts = Vec::new();
                let mut pos = 0;
                while let Some(n) = cut.next(&buf[..filled], pos, eof) {
                    cuts.push((pos, n));
                    pos += n;
                }
                total += pos as u64;
                carry.clear();
                carry.extend_from_slice(&buf[pos..filled]);
                if work_tx.send((buf, cuts)).is_err() {
                    return Err(std::io::Error::other("the hashing thread stopped"));
                }
                if eof && carry.is_empty() {
                    return Ok(total);
                }
            }
        })();
        drop(work_tx);
        let chunks = match hasher.join() {
            Ok(c) => c,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        (read, chunks)
    });
    // Every buffer is back once the helper is gone: on this thread's spare list or in the
    // channel.
    spare.extend(free_rx.try_iter());
    spare.truncate(BUFFERS);
    READ_BUFFERS.with(|b| *b.borrow_mut() = spare);
    let (read, chunks) = result;
    let total = read?;
    Ok(Content::counted(chunks, total))
}

thread_local! {
    /// [`cut_here_hash_there_read`]'s window buffers, kept for this thread's next file.
    static READ_BUFFERS: std::cell::RefCell<Vec<Vec<u8>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How far ahead of a cold file's reader the kernel is asked to read.
const AHEAD: u64 = 64 << 20;

/// A file read front to back, the kernel asked (`POSIX_FADV_WILLNEED`) for the next [`AHEAD`]
/// bytes whenever the reader is within half of that of the end of what was asked.
struct AdvisedReader<'a> {
    file: &'a File,
    pos: u64,
    advised: u64,
    size: u64,
}

impl Read for AdvisedReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.advised < self.size && self.pos + AHEAD / 2 >= self.advised {
            let _ =
                meshfs_sys::fadvise_willneed(self.file.as_fd(), self.advised as i64, AHEAD as i64);
            self.advised += AHEAD;
        }
        let n = self.file.read(buf)?;
        self.pos += n as u64;
        Ok(n)
    }
}

/// Whether at least half of the first [`SEGMENT`] bytes of a file of `size` bytes are in the
/// page cache (an error counts as not: the read path works for every file).
fn mostly_cached(file: &File, size: u64) -> bool {
    let len = size.min(SEGMENT) as usize;
    len > 0 && crate::mapped::resident_share(file.as_fd(), 0, len).is_ok_and(|share| share >= 0.5)
}

/// [`chunk_file`] through mappings of `segment` bytes (a multiple of the page size; at least a
/// page and a largest chunk are mapped) of a file whose stat before reading is `before`. Each
/// segment is cut and hashed on this thread alone, or, where `spare_core()` says a core is
/// idle, cut here and hashed on a helper thread at the same time (twice as fast for a lone
/// large file: the two passes cost about the same per byte).
fn chunk_mapped(
    file: &File,
    before: &Metadata,
    segment: u64,
    spare_core: impl Fn() -> bool,
) -> std::io::Result<Content> {
    let size = before.len();
    let cut = Cutter::for_size(size);
    let page = crate::mapped::page_size() as u64;
    let mut chunks = Vec::new();
    let mut done = 0u64;
    while done < size {
        let start = done - done % page;
        // At least a page (the alignment) and a largest chunk past `done`, so each mapping cuts.
        let len = (size - start).min(segment.max(page + cut.max as u64));
        let last = start + len == size;
        let map = Mapped::new(file.as_fd(), start, len as usize)?;
        let from = (done - start) as usize;
        let consumed = if spare_core() {
            cut_here_hash_there(&map, &cut, from, last, &mut chunks)
        } else {
            map.guarded(|bytes| {
                let mut pos = from;
                while let Some(n) = cut.next(bytes, pos, last) {
                    chunks.push(Chunk {
                        len: n as u32,
                        hash: Hash::of(&bytes[pos..pos + n]),
                    });
                    pos += n;
                }
                pos
            })
        }
        .map_err(|_: Torn| std::io::Error::other("the file shrank while it was read"))?;
        assert!(start + consumed as u64 > done, "a mapping made no progress");
        done = start + consumed as u64;
    }
    unchanged(file, before)?;
    Ok(Content::counted(chunks, size))
}

/// One segment cut on this thread while a helper thread hashes the chunks found, in batches.
/// Appends the segment's chunks to `chunks`; returns how far into `map` they reach.
fn cut_here_hash_there(
    map: &Mapped,
    cut: &Cutter,
    from: usize,
    last: bool,
    chunks: &mut Vec<Chunk>,
) -> Result<usize, Torn> {
    const BATCH: usize = 16;
    let (tx, rx) = std::sync::mpsc::sync_channel::<Vec<(usize, usize)>>(64);
    std::thread::scope(|s| {
        let hasher = s.spawn(move || {
            let _busy = Hashing::enter();
            map.guarded(|bytes| {
                let mut out = Vec::new();
                for (pos, n) in rx.into_iter().flatten() {
                    out.push(Chunk {
                        len: n as u32,
                        hash: Hash::of(&bytes[pos..pos + n]),
                    });
                }
                out
            })
        });
        let reached = map.guarded(move |bytes| {
            let mut pos = from;
            let mut batch = Vec::with_capacity(BATCH);
            while let Some(n) = cut.next(bytes, pos, last) {
                batch.push((pos, n));
                pos += n;
                if batch.len() == BATCH
                    && tx
                        .send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)))
                        .is_err()
                {
                    break;
                }
            }
            let _ = tx.send(batch);
            pos
        });
        let hashed = match hasher.join() {
            Ok(h) => h,
            Err(panic) => std::panic::resume_unwind(panic),
        };
        chunks.extend(hashed?);
        reached
    })
}

/// The cut search's parameters for one file.
struct Cutter {
    min: usize,
    avg: usize,
    max: usize,
    masks: (u64, u64),
}

impl Cutter {
    fn for_size(size: u64) -> Cutter {
        let (min, avg, max) = chunk_sizes(size);
        let avg = avg as usize;
        Cutter {
            min: min as usize,
            avg,
            max: max as usize,
            masks: meshfs_protocol::cdc::select_masks(avg),
        }
    }

    /// The length of the chunk at `bytes[pos..]`, or `None` at the end, or where fewer than a
    /// largest chunk's bytes remain and more follow (`!last`): a cut is final only with `max`
    /// bytes ahead or at the file's end.
    fn next(&self, bytes: &[u8], pos: usize, last: bool) -> Option<usize> {
        let rest = &bytes[pos..];
        if rest.is_empty() || (!last && rest.len() < self.max) {
            return None;
        }
        Some(meshfs_protocol::cdc::cut_with_masks(
            rest,
            self.min,
            self.avg,
            self.max,
            self.masks.0,
            self.masks.1,
        ))
    }
}

/// Threads now hashing (callers of [`chunk_file`] and their helpers).
static HASHING: AtomicUsize = AtomicUsize::new(0);

/// Counts the current thread in [`HASHING`] while it lives.
struct Hashing;

impl Hashing {
    fn enter() -> Hashing {
        HASHING.fetch_add(1, Ordering::Relaxed);
        Hashing
    }

    /// Whether a core would otherwise sit idle: fewer threads hash than there are cores.
    fn spare_core() -> bool {
        static CORES: OnceLock<usize> = OnceLock::new();
        let cores = *CORES.get_or_init(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        HASHING.load(Ordering::Relaxed) < cores
    }
}

impl Drop for Hashing {
    fn drop(&mut self) {
        HASHING.fetch_sub(1, Ordering::Relaxed);
    }
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

    fn file_of(data: &[u8]) -> File {
        use std::io::{Seek, Write};
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(data).unwrap();
        f.rewind().unwrap();
        f
    }

    #[test]
    fn a_mapped_file_chunks_exactly_as_a_read_one() {
        let data = noise(5 << 20, 3);
        let f = file_of(&data);
        let meta = f.metadata().unwrap();
        let want = chunk_bytes(&data);
        // Segments of 4 MiB, 1 MiB and 256 KiB (the largest chunk, so raised to it and a page):
        // every seam is crossed.
        for segment in [4 << 20, 1 << 20, 256 << 10] {
            for helper in [false, true] {
                let got = chunk_mapped(&f, &meta, segment, || helper).unwrap();
                assert_eq!(got, want, "segment {segment}, helper thread {helper}");
            }
        }
        assert_eq!(
            chunk_file(&file_of(&data), data.len() as u64).unwrap(),
            want
        );
        // Below MAP_FROM the file is read, with the same result.
        let small = &data[..(MAP_FROM - 1) as usize];
        assert_eq!(
            chunk_file(&file_of(small), small.len() as u64).unwrap(),
            chunk_bytes(small)
        );
    }

    #[test]
    fn a_cold_file_read_on_two_threads_chunks_exactly_as_on_one() {
        /// Yields at most `step` bytes per read, so windows fill over several reads.
        struct Trickle<'a>(&'a [u8], usize);
        impl Read for Trickle<'_> {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                let n = buf.len().min(self.1).min(self.0.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let data = noise(13 << 20, 5);
        // Empty, one chunk, a window exactly, a byte past it, several windows.
        for len in [0, 1, 70_000, 4 << 20, (4 << 20) + 1, 13 << 20] {
            let want = chunk_bytes(&data[..len]);
            let got = cut_here_hash_there_read(&data[..len], len as u64).unwrap();
            assert_eq!(got, want, "{len} bytes");
            let got = cut_here_hash_there_read(Trickle(&data[..len], 100_003), len as u64).unwrap();
            assert_eq!(got, want, "{len} bytes, short reads");
        }
        // A cold file takes this path in `chunk_file`; a sparse one is not in the cache.
        let f = tempfile::tempfile().unwrap();
        f.set_len(3 << 20).unwrap();
        let zeros = vec![0u8; 3 << 20];
        assert!(!mostly_cached(&f, 3 << 20));
        assert_eq!(chunk_file(&f, 3 << 20).unwrap(), chunk_bytes(&zeros));
    }

    #[test]
    fn a_file_written_while_it_was_read_is_refused() {
        use std::io::{Seek, Write};
        let mut f = file_of(&noise(2 << 20, 6));
        let before = f.metadata().unwrap();
        unchanged(&f, &before).unwrap();
        // Appended, so the size moves too (timestamps may not, within one clock tick).
        f.seek(std::io::SeekFrom::End(0)).unwrap();
        f.write_all(b"more").unwrap();
        let err = unchanged(&f, &before).unwrap_err();
        assert!(
            err.to_string().contains("changed while it was read"),
            "{err}"
        );
    }

    #[test]
    fn a_file_that_changes_while_mapped_is_refused_not_half_hashed() {
        let data = noise(3 << 20, 4);
        let f = file_of(&data);
        let meta = f.metadata().unwrap();
        f.set_len(1 << 20).unwrap();
        for helper in [false, true] {
            let err = chunk_mapped(&f, &meta, 1 << 20, || helper).unwrap_err();
            assert!(err.to_string().contains("shrank"), "{err}");
        }
        // Rewritten in place at the same size: the stat moved, so the result is refused.
        let f = file_of(&data);
        let meta = f.metadata().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(10));
        std::os::unix::fs::FileExt::write_all_at(&f, b"edit", 100).unwrap();
        let err = chunk_mapped(&f, &meta, SEGMENT, || false).unwrap_err();
        assert!(err.to_string().contains("changed"), "{err}");
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
