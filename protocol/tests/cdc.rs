//! `meshfs_protocol::cdc` must return exactly the chunk lengths of
//! `fastcdc::v2020::FastCDC::new(data, min, avg, max)`.

use std::sync::OnceLock;

use fastcdc::v2020::{FastCDC, Normalization};
use meshfs_protocol::cdc;
use proptest::prelude::*;
use rand::rngs::StdRng;
use rand::{Rng, RngCore, SeedableRng};

const PARAMS: [(usize, usize, usize); 3] = [
    (16384, 65536, 262144),
    (65536, 262144, 1048576),
    (262144, 1048576, 4194304),
];

fn reference(data: &[u8], (min, avg, max): (usize, usize, usize)) -> Vec<u32> {
    FastCDC::new(data, min, avg, max)
        .map(|c| c.length as u32)
        .collect()
}

/// Checks both entry points (and the per-chunk `cut`) against fastcdc.
fn check(data: &[u8], p: (usize, usize, usize)) {
    let (min, avg, max) = p;
    let expect = reference(data, p);
    let mut got = Vec::new();
    cdc::chunk_lengths(data, min, avg, max, &mut got);
    assert_eq!(
        got,
        expect,
        "chunk_lengths, len {}, params {p:?}",
        data.len()
    );
    got.clear();
    cdc::chunk_lengths_portable(data, min, avg, max, &mut got);
    assert_eq!(
        got,
        expect,
        "chunk_lengths_portable, len {}, params {p:?}",
        data.len()
    );
    // Per-chunk `cut` against the crate's `cut(start, remaining)`.
    let chunker = FastCDC::new(data, min, avg, max);
    let (ms, ml) = cdc::select_masks(avg);
    let mut start = 0;
    for &n in &expect {
        let (_, end) = chunker.cut(start, data.len() - start);
        assert_eq!(end - start, n as usize);
        let rest = &data[start..];
        assert_eq!(cdc::cut(rest, min, avg, max), n as usize);
        let portable = cdc::cut_with_masks_portable(rest, min, avg, max, ms, ml);
        assert_eq!(portable, n as usize);
        start = end;
    }
}

fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; len];
    StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

fn xorshift_bytes(len: usize, mut s: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn gear_hash(bytes: &[u8]) -> u64 {
    let gear = gear_table();
    bytes
        .iter()
        .fold(0u64, |h, &b| (h << 1).wrapping_add(gear[b as usize]))
}

/// The GEAR table, recovered from the crate's public `get_gear_with_seed`.
fn gear_table() -> &'static [u64] {
    static G: OnceLock<Vec<u64>> = OnceLock::new();
    G.get_or_init(|| fastcdc::v2020::get_gear_with_seed(0).0.to_vec())
}

/// `find(mask, avg)` for each parameter set, computed once into `cell`, and the entry of `p`.
fn per_params(
    cell: &'static OnceLock<Vec<Vec<Vec<u8>>>>,
    p: (usize, usize, usize),
    find: fn(u64, usize) -> Vec<Vec<u8>>,
) -> &'static [Vec<u8>] {
    let all = cell.get_or_init(|| {
        PARAMS
            .iter()
            .map(|&(_, avg, _)| {
                let (s, l) = fastcdc::v2020::select_masks(avg, Normalization::Level1);
                find(s | l, avg)
            })
            .collect()
    });
    &all[PARAMS.iter().position(|&q| q == p).unwrap()]
}

/// 48-byte windows whose gear hash matches both masks of the parameter set:
/// wherever one ends at a position at least `min + 47` bytes into a chunk,
/// that position is a cut point (if nothing cut earlier).
fn window_triggers(p: (usize, usize, usize)) -> &'static [Vec<u8>] {
    static T: OnceLock<Vec<Vec<Vec<u8>>>> = OnceLock::new();
    per_params(&T, p, |mask, _| {
        let gear = gear_table();
        let mut found = Vec::new();
        let data = xorshift_bytes(64 << 20, 0x1234_5678_9abc_def1);
        let mut h = 0u64;
        for (i, &b) in data.iter().enumerate() {
            h = (h << 1).wrapping_add(gear[b as usize]);
            if i >= 48 && h & mask == 0 {
                found.push(data[i + 1 - 48..=i].to_vec());
                if found.len() == 4 {
                    break;
                }
            }
        }
        assert!(!found.is_empty());
        found
    })
}

/// Short byte strings whose gear hash *from zero* matches both masks: placed
/// right at `chunk start + min`, the chunk is cut at `min + len - 1` by the
/// exact (non-windowed) part of the scan.
fn exact_triggers(p: (usize, usize, usize)) -> &'static [Vec<u8>] {
    static T: OnceLock<Vec<Vec<Vec<u8>>>> = OnceLock::new();
    per_params(&T, p, |mask, avg| {
        let gear = gear_table();
        let mut found: Vec<Vec<u8>> = Vec::new();
        let mut rng = StdRng::seed_from_u64(avg as u64);
        let mut buf = [0u8; 64];
        while found.len() < 6 {
            rng.fill_bytes(&mut buf);
            let mut h = 0u64;
            for (i, &b) in buf.iter().enumerate() {
                h = (h << 1).wrapping_add(gear[b as usize]);
                if h & mask == 0 {
                    found.push(buf[..=i].to_vec());
                    break;
                }
            }
        }
        found.sort_by_key(Vec::len);
        found
    })
}

#[test]
fn gear_table_matches() {
    assert_eq!(&cdc::GEAR[..], gear_table());
    for p in PARAMS {
        let (s, l) = cdc::select_masks(p.1);
        for t in window_triggers(p) {
            assert_eq!(gear_hash(t) & (s | l), 0);
        }
    }
}

#[test]
fn masks_match_crate() {
    for avg in [
        256usize, 1000, 4096, 65536, 100_000, 262144, 1048576, 4194304,
    ] {
        let crate_masks = fastcdc::v2020::select_masks(avg, Normalization::Level1);
        assert_eq!(cdc::select_masks(avg), crate_masks, "avg {avg}");
    }
}

#[test]
fn empty_and_tiny() {
    for p in PARAMS {
        check(&[], p);
        check(&[7], p);
        check(&random_bytes(1000, 1), p);
    }
}

#[test]
fn boundary_lengths() {
    // Lengths around min, avg, max, 2*max, odd and even, random and zeros.
    for p in PARAMS {
        let (min, avg, max) = p;
        let base = random_bytes(2 * max + 200, 99);
        for c in [min, min + 48, avg, max, 2 * max, max + min] {
            for d in [-3i64, -2, -1, 0, 1, 2, 3, 47, 48, 49, 64, 65] {
                let n = (c as i64 + d) as usize;
                check(&base[..n], p);
            }
        }
        let zeros = vec![0u8; max + min + 1];
        for n in [min - 1, min, min + 1, max - 1, max, max + 1, max + min + 1] {
            check(&zeros[..n], p);
        }
    }
}

#[test]
fn zeros_give_max_chunks() {
    for p in PARAMS {
        let data = vec![0u8; 5 * p.2 + 12345];
        let got = reference(&data, p);
        assert!(got[..5].iter().all(|&n| n as usize == p.2));
        check(&data, p);
    }
}

#[test]
fn exact_phase_cuts_at_min() {
    // Cuts at min + k for small k come from the exact sequential hash.
    for p in PARAMS {
        let (min, _, _) = p;
        let mut data: Vec<u8> = Vec::new();
        let mut expect = Vec::new();
        let mut start = 0;
        for (i, t) in exact_triggers(p).iter().enumerate() {
            data.resize(start + min, (i * 37) as u8);
            data.extend_from_slice(t);
            // The cut is at the trigger's last byte, which starts the next chunk.
            expect.push((min + t.len() - 1) as u32);
            start += min + t.len() - 1;
        }
        data.extend(std::iter::repeat_n(0u8, min / 2));
        let got = reference(&data, p);
        assert_eq!(&got[..expect.len()], &expect[..]);
        check(&data, p);
    }
}

#[test]
fn windowed_cuts_everywhere() {
    // A matching window ending at every chunk offset around min + 47 (the
    // first windowed position), the centre, lane / group / round boundaries
    // and max; on zero and on random background.
    let pool = random_bytes(1 << 20, 77);
    for p in PARAMS {
        let (min, avg, max) = p;
        let trig = &window_triggers(p)[0];
        let offsets: Vec<usize> = (min + 30..min + 120)
            .chain(avg - 20..avg + 20)
            .chain((0..40).map(|k| min + 64 + k * 2048 - 3 + (k % 7)))
            .chain((0..40).map(|k| min + 64 + k * 8192 + (k % 9)))
            .chain(max - 20..max + 3)
            .filter(|&o| o >= 47)
            .collect();
        for random_bg in [false, true] {
            let mut data: Vec<u8> = Vec::new();
            let mut start = 0;
            for &o in &offsets {
                let end = start + o + 1;
                while data.len() < end {
                    let n = (end - data.len()).min(pool.len());
                    if random_bg {
                        let s = (data.len() * 31) % (pool.len() - n + 1);
                        data.extend_from_slice(&pool[s..s + n]);
                    } else {
                        data.resize(data.len() + n, 0);
                    }
                }
                data[end - 48..end].copy_from_slice(trig);
                start += o.min(max);
            }
            check(&data, p);
        }
    }
}

#[test]
fn many_triggers_per_round() {
    // Several matching windows close together in different lanes of a round,
    // so lane order (not step order) must decide.
    let mut rng = StdRng::seed_from_u64(5);
    for p in PARAMS {
        let (_, _, max) = p;
        for _ in 0..6 {
            let mut data = vec![0u8; 8 * max];
            let trig = window_triggers(p);
            for _ in 0..200 {
                let t = &trig[rng.gen_range(0..trig.len())];
                let end = rng.gen_range(48..data.len());
                data[end - 48..end].copy_from_slice(t);
            }
            check(&data, p);
        }
    }
}

#[test]
fn deterministic_64mib() {
    let data = xorshift_bytes(64 << 20, 0x9E37_79B9_7F4A_7C15);
    for p in PARAMS {
        check(&data, p);
    }
}

#[derive(Debug, Clone)]
enum Background {
    Random(u64),
    Zeros,
    Pattern(Vec<u8>),
    Runs(u64),
}

fn background(kind: &Background, len: usize) -> Vec<u8> {
    match kind {
        Background::Random(seed) => random_bytes(len, *seed),
        Background::Zeros => vec![0u8; len],
        Background::Pattern(pat) => pat.iter().copied().cycle().take(len).collect(),
        Background::Runs(seed) => {
            // Runs of a repeated byte with random lengths and values.
            let mut rng = StdRng::seed_from_u64(*seed);
            let mut v = Vec::with_capacity(len);
            while v.len() < len {
                let run = rng.gen_range(1..100_000usize).min(len - v.len());
                let b: u8 = if rng.gen_bool(0.5) { 0 } else { rng.r#gen() };
                v.extend(std::iter::repeat_n(b, run));
            }
            v
        }
    }
}

fn background_strategy() -> impl Strategy<Value = Background> {
    prop_oneof![
        any::<u64>().prop_map(Background::Random),
        Just(Background::Zeros),
        prop::collection::vec(any::<u8>(), 1..64).prop_map(Background::Pattern),
        any::<u64>().prop_map(Background::Runs),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn random_data(len in 0usize..3 << 20, seed in any::<u64>(), pi in 0usize..3) {
        check(&random_bytes(len, seed), PARAMS[pi]);
    }

    #[test]
    fn low_entropy(
        len in 0usize..3 << 20,
        bg in background_strategy(),
        pi in 0usize..3,
    ) {
        check(&background(&bg, len), PARAMS[pi]);
    }

    #[test]
    fn planted_triggers(
        len in 0usize..3 << 20,
        bg in background_strategy(),
        pi in 0usize..3,
        plants in prop::collection::vec((any::<prop::sample::Index>(), 0usize..10), 0..60),
    ) {
        let p = PARAMS[pi];
        let mut data = background(&bg, len);
        let wt = window_triggers(p);
        let et = exact_triggers(p);
        for (at, which) in plants {
            let t = if which < wt.len() { &wt[which] } else { &et[(which - wt.len()) % et.len()] };
            if data.len() >= t.len() {
                let s = at.index(data.len() - t.len() + 1);
                data[s..s + t.len()].copy_from_slice(t);
            }
        }
        check(&data, p);
    }
}
