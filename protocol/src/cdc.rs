//! The FastCDC 2020 cut search of meshfs's chunker, producing exactly the chunk boundaries
//! of `fastcdc::v2020::FastCDC::new(data, min, avg, max)` (fastcdc 5.0.0, normalization
//! level 1, its GEAR table) about 1.5× as fast: chunk boundaries are part of the protocol
//! (a file's hash comes from its chunk list), so they must never change, and
//! `protocol/tests/cdc.rs` checks them against the crate's.
//!
//! # How
//!
//! The crate's scan loop (two bytes per iteration with `GEAR_LS`/`mask << 1`)
//! is the byte-wise gear hash `H_p = (H_{p-1} << 1) + GEAR[src[p]]` (wrapping),
//! started at 0 on byte `min`, tested at every position `p` in
//! `min..remaining & !1` with `mask_s` below the centre (`avg`, or the
//! remaining length if smaller) and `mask_l` from it on; the first `p` with
//! `H_p & mask == 0` gives a chunk of length `p`, otherwise the chunk is
//! `remaining = min(len, max)` long.
//!
//! All masks only use bits 12..=47, and bit `k` of `H_p` only depends on bytes
//! `p-k..=p`. So, except for the first few positions after `min` (done with
//! the exact sequential hash), `H_p & mask` equals the masked hash of the 48
//! bytes ending at `p`, whatever the start. That makes positions independent:
//! the scan region is cut into rounds of 4 lanes × `BLOCK` bytes, each lane
//! warmed up on the 48 bytes before it and all 4 stepped in lockstep
//! (instruction-level parallelism instead of the crate's single
//! latency-bound dependency chain). A match in some lane is resolved exactly:
//! the first lane with a match in that group of 8 steps gives a candidate,
//! and only the lanes before it are scanned further.
//!
//! On x86_64 the 4-lane loop is a small inline-assembly kernel (see
//! [`chunk_lengths`]); [`chunk_lengths_portable`] is the same algorithm in safe
//! Rust only.

mod gear;
pub use gear::GEAR;

/// Cut-point masks, copied from `fastcdc::v2020::MASKS` (fastcdc 5.0.0).
pub const MASKS: [u64; 26] = [
    0,                  // padding
    0,                  // padding
    0,                  // padding
    0,                  // padding
    0,                  // padding
    0x0000000001804110, // unused except for NC 3
    0x0000000001803110, // 64B
    0x0000000018035100, // 128B
    0x0000001800035300, // 256B
    0x0000019000353000, // 512B
    0x0000590003530000, // 1KB
    0x0000d90003530000, // 2KB
    0x0000d90103530000, // 4KB
    0x0000d90303530000, // 8KB
    0x0000d90313530000, // 16KB
    0x0000d90f03530000, // 32KB
    0x0000d90303537000, // 64KB
    0x0000d90703537000, // 128KB
    0x0000d90707537000, // 256KB
    0x0000d91707537000, // 512KB
    0x0000d91747537000, // 1MB
    0x0000d91767537000, // 2MB
    0x0000d93767537000, // 4MB
    0x0000d93777537000, // 8MB
    0x0000d93777577000, // 16MB
    0x0000db3777577000, // unused except for NC 3
];

/// `(mask_s, mask_l)` for `avg` at normalization level 1, exactly as
/// `fastcdc::v2020::select_masks(avg, Normalization::Level1)`.
pub fn select_masks(avg: usize) -> (u64, u64) {
    // Same rounded log2 as the crate (f64 based, rounds to nearest).
    let bits = (avg as f64).log2().round() as usize;
    (MASKS[bits + 1], MASKS[bits - 1])
}

/// Highest hash bit any mask uses is 47, and bit `k` of the gear hash at
/// position `p` only depends on bytes `p-k..=p`. Hashing the `WARMUP` bytes
/// before a position therefore reproduces the masked hash bits exactly.
const WARMUP: usize = 48;
/// Positions after `min` checked with the exact, sequential hash (must be
/// `>= WARMUP - 1`); later positions use independent windowed lanes.
const EXACT: usize = 64;
/// Number of interleaved lanes.
const LANES: usize = 4;
/// Bytes per lane per round (assembly kernel).
const BLOCK: usize = 2048;
/// Bytes per lane per round (portable kernel, whose warm-up is slower).
const BLOCK_PORTABLE: usize = 4096;
/// Lanes are tested for a match once per group of `GROUP` steps.
const GROUP: usize = 8;
/// Below this per-lane length a tail is scanned with a single lane.
const MIN_TAIL_BLOCK: usize = 64;
/// Cache lines prefetched at the start of each lane of the next round.
#[cfg(target_arch = "x86_64")]
const PREFETCH_LINES: usize = 4;
const _: () = assert!(
    LANES == 4
        && GROUP == 8
        && WARMUP.is_multiple_of(GROUP)
        && BLOCK.is_multiple_of(GROUP)
        && BLOCK_PORTABLE.is_multiple_of(GROUP)
        && MIN_TAIL_BLOCK >= GROUP
);
const _: () = {
    // Every mask must fit in the bits that WARMUP bytes determine.
    let mut i = 0;
    while i < MASKS.len() {
        assert!(MASKS[i] >> WARMUP == 0);
        i += 1;
    }
};

#[inline(always)]
fn step(h: u64, b: u8) -> u64 {
    (h << 1).wrapping_add(GEAR[b as usize])
}

/// Hash of `bytes` starting from 0 (used to warm a single lane up).
#[inline(always)]
fn warm(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0u64, |h, &b| step(h, b))
}

/// Single lane: first `p` in `from..to` with `W_p & mask == 0`.
/// Requires `from >= WARMUP`.
fn scan_scalar(src: &[u8], from: usize, to: usize, mask: u64) -> Option<usize> {
    let mut h = warm(&src[from - WARMUP..from]);
    for (k, &b) in src[from..to].iter().enumerate() {
        h = step(h, b);
        if h & mask == 0 {
            return Some(from + k);
        }
    }
    None
}

/// Warm-up of `NL` lanes: lane `j` hashes `win[j * stride..j * stride + WARMUP]`.
#[allow(clippy::needless_range_loop)] // all lanes take the same step
#[inline(always)]
fn warm_lanes<const NL: usize>(win: &[u8], stride: usize) -> [u64; NL] {
    let lanes: [&[u8]; NL] = std::array::from_fn(|j| &win[j * stride..j * stride + WARMUP]);
    let mut h = [0u64; NL];
    for i in 0..WARMUP {
        for j in 0..NL {
            h[j] = step(h[j], lanes[j][i]);
        }
    }
    h
}

/// Hot loop (portable). Lane `j < NL` covers `len` positions starting at
/// `WARMUP + j * stride` of `win` (so `win` starts `WARMUP` bytes before the
/// first lane). All lanes are warmed up on their preceding `WARMUP` bytes and
/// then stepped in lockstep; returns the index of the first group of `GROUP`
/// steps in which some lane matched `mask`, or `len / GROUP` if none did.
#[allow(clippy::needless_range_loop)] // all lanes take the same step
#[inline(always)]
fn lockstep<const NL: usize>(win: &[u8], stride: usize, len: usize, mask: u64) -> usize {
    debug_assert!(len.is_multiple_of(GROUP));
    let lanes: [&[u8]; NL] =
        std::array::from_fn(|j| &win[j * stride + WARMUP..j * stride + WARMUP + len]);
    let mut h = warm_lanes::<NL>(win, stride);
    for k in 0..len / GROUP {
        for u in 0..GROUP {
            let i = k * GROUP + u;
            for j in 0..NL {
                h[j] = step(h[j], lanes[j][i]);
                if h[j] & mask == 0 {
                    return k;
                }
            }
        }
    }
    len / GROUP
}

/// Same contract as `lockstep::<4>`, with the stepping loop in assembly.
///
/// Left out of fuzz builds (`cfg(fuzzing)`, set by cargo-fuzz): their stack-depth
/// instrumentation keeps the frame pointer, one register short of the 15 this kernel takes.
/// The fuzzed decoder never chunks.
#[cfg(all(target_arch = "x86_64", not(fuzzing)))]
#[inline(always)]
fn lockstep4_asm(win: &[u8], stride: usize, len: usize, mask: u64) -> usize {
    let need = stride
        .checked_mul(3)
        .and_then(|n| n.checked_add(WARMUP))
        .and_then(|n| n.checked_add(len));
    assert!(len > 0 && len.is_multiple_of(GROUP) && need.is_some_and(|n| n <= win.len()));
    // SAFETY: the assert above guarantees that for every lane j < 4 the bytes
    // `j * stride..j * stride + WARMUP + len` of `win` are in bounds, which is
    // what `x86::lanes4` reads, relative to `win + WARMUP`.
    let i = unsafe { x86::lanes4(win.as_ptr().add(WARMUP), stride, len, mask) };
    i / GROUP
}

#[cfg(all(target_arch = "x86_64", not(fuzzing)))]
mod x86 {
    use super::GEAR;
    use std::arch::asm;

    // One step of one lane: `h = 2 * h + GEAR[byte]` (byte already
    // zero-extended in ecx), then leave the loop (label 3) if `h & mask == 0`.
    #[rustfmt::skip]
    macro_rules! hash_test {
        ($h:literal) => {
            concat!(
                "mov rcx, qword ptr [{g} + 8*rcx]\n",
                "lea {", $h, "}, [rcx + 2*{", $h, "}]\n",
                "test {", $h, "}, {m}\n",
                "je 3f\n",
            )
        };
    }

    // `hash_test` without the test, for the warm-up.
    #[rustfmt::skip]
    macro_rules! hash_only {
        ($h:literal) => {
            concat!(
                "mov rcx, qword ptr [{g} + 8*rcx]\n",
                "lea {", $h, "}, [rcx + 2*{", $h, "}]\n",
            )
        };
    }

    // Two steps (byte offsets `$o` and `$o1 = $o + 1` of the group of 8) of
    // all 4 lanes, each step done by `$step`. Lanes 0 and 1 take their bytes
    // from the 8-byte words in rax / rdx (low byte, then second byte, then
    // shift by 16): that trades loads, the bottleneck here (about 2 per
    // cycle), for spare ALU work. Lanes 2 and 3 load their bytes one by one.
    // The table value is loaded into a register and combined with `lea`
    // (one ALU op for `2 * h + g`, where a folded `add h, [mem]` needs two).
    #[rustfmt::skip]
    macro_rules! two_steps {
        ($step:ident, $o:literal, $o1:literal) => {
            concat!(
                "movzx ecx, al\n", $step!("h0"),
                "movzx ecx, dl\n", $step!("h1"),
                "movzx ecx, byte ptr [{p2} + {i} + ", $o, "]\n", $step!("h2"),
                "movzx ecx, byte ptr [{p3} + {i} + ", $o, "]\n", $step!("h3"),
                "movzx ecx, ah\n", $step!("h0"),
                "movzx ecx, dh\n", $step!("h1"),
                "movzx ecx, byte ptr [{p2} + {i} + ", $o1, "]\n", $step!("h2"),
                "movzx ecx, byte ptr [{p3} + {i} + ", $o1, "]\n", $step!("h3"),
                "shr rax, 16\n",
                "shr rdx, 16\n",
            )
        };
    }

    // One group of 8 positions of all 4 lanes, each step done by `$step`: the 8-byte words of
    // lanes 0 and 1 at offset `i`, then four `two_steps`.
    #[rustfmt::skip]
    macro_rules! group {
        ($step:ident) => {
            concat!(
                "mov rax, qword ptr [{p0} + {i}]\n",
                "mov rdx, qword ptr [{p1} + {i}]\n",
                two_steps!($step, "0", "1"),
                two_steps!($step, "2", "3"),
                two_steps!($step, "4", "5"),
                two_steps!($step, "6", "7"),
            )
        };
    }

    /// Hashes 4 lanes in lockstep, 8 positions per iteration: lane `j` is
    /// warmed up (untested) on the `WARMUP` bytes before `p + j * stride`,
    /// then tested on the `len` positions from `p + j * stride` on. Returns
    /// the offset of the first group of 8 positions in which some lane's
    /// hash had `hash & mask == 0`, or `len` if there was none.
    ///
    /// # Safety
    /// `len` must be a non-zero multiple of 8 and, for each `j < 4`, the
    /// bytes `p + j * stride - WARMUP .. p + j * stride + len` must be
    /// readable (within one allocation). The kernel reads only those bytes
    /// (8-byte loads at 8-aligned offsets of lanes 0 and 1, single bytes of
    /// lanes 2 and 3) and `GEAR[0..256]`, writes no memory and does not use
    /// the stack.
    #[inline(always)]
    pub(super) unsafe fn lanes4(p: *const u8, stride: usize, len: usize, mask: u64) -> usize {
        let mut i = super::WARMUP.wrapping_neg();
        let (mut h0, mut h1, mut h2, mut h3) = (0u64, 0u64, 0u64, 0u64);
        // SAFETY: per the function contract, every address formed below is
        // `p + j * stride + i + o` with `i` a multiple of 8 in
        // `-WARMUP..len` (WARMUP and len are multiples of 8) and `o < 8`.
        // `GEAR` is indexed by a zero-extended byte (< 256). Only the
        // declared registers are modified; no stack use, no memory writes.
        unsafe {
            asm!(
                // Warm-up: the WARMUP (48) bytes before each lane, untested;
                // `i` runs from -48 up to 0.
                "4:",
                group!(hash_only),
                "add {i}, 8",
                "jnz 4b",
                // Main loop over `0..len`, 8 positions per iteration.
                "2:",
                group!(hash_test),
                "add {i}, 8",
                "cmp {i}, {len}",
                "jb 2b",
                "3:",
                p0 = in(reg) p,
                p1 = in(reg) p.wrapping_add(stride),
                p2 = in(reg) p.wrapping_add(2 * stride),
                p3 = in(reg) p.wrapping_add(3 * stride),
                g = in(reg) GEAR.as_ptr(),
                m = in(reg) mask,
                len = in(reg) len,
                i = inout(reg) i,
                h0 = inout(reg) h0,
                h1 = inout(reg) h1,
                h2 = inout(reg) h2,
                h3 = inout(reg) h3,
                out("rax") _,
                out("rcx") _,
                out("rdx") _,
                options(nostack, readonly),
            );
        }
        let _ = (h0, h1, h2, h3);
        i
    }
}

/// One round: `LANES` lanes of `bl` bytes starting at `base`. Returns the
/// first matching position in `base..base + LANES * bl`, if any.
///
/// When some lane matches in a group, the first lane with a match in that
/// group gives a candidate; only lanes before it can still hold an earlier
/// match (later in their blocks), so the scan continues with just those.
#[inline(always)]
fn round<const ASM: bool>(src: &[u8], base: usize, bl: usize, mask: u64) -> Option<usize> {
    let groups = bl / GROUP;
    let mut nl = LANES;
    let mut from = 0;
    let mut found = None;
    while from < groups && nl > 0 {
        let off = from * GROUP;
        let len = bl - off;
        let win = &src[base + off - WARMUP..base + (nl - 1) * bl + bl];
        let k = match nl {
            #[cfg(all(target_arch = "x86_64", not(fuzzing)))]
            4 if ASM => lockstep4_asm(win, bl, len, mask),
            4 => lockstep::<4>(win, bl, len, mask),
            3 => lockstep::<3>(win, bl, len, mask),
            2 => lockstep::<2>(win, bl, len, mask),
            _ => lockstep::<1>(win, bl, len, mask),
        };
        if k == len / GROUP {
            break;
        }
        let g = from + k;
        let (j, p) = first_in_group(src, base + g * GROUP, bl, nl, mask);
        found = Some(p);
        nl = j;
        from = g + 1;
    }
    found
}

/// Slow path: the first lane `j < nl` with a match among its `GROUP`
/// positions starting at `start + j * bl`, and that match. One must exist.
#[cold]
#[inline(never)]
fn first_in_group(src: &[u8], start: usize, bl: usize, nl: usize, mask: u64) -> (usize, usize) {
    for j in 0..nl {
        let s = start + j * bl;
        if let Some(p) = scan_scalar(src, s, s + GROUP, mask) {
            return (j, p);
        }
    }
    unreachable!("lockstep reported a match that is not there")
}

/// Hints the first cache lines of each lane of the round at `base` into the
/// cache: lanes start in the middle of the data, where the hardware
/// prefetchers have not been yet.
#[inline(always)]
fn prefetch_round(src: &[u8], base: usize, bl: usize) {
    #[cfg(target_arch = "x86_64")]
    for j in 0..LANES {
        for l in 0..PREFETCH_LINES {
            let off = base + j * bl + l * 64 - WARMUP;
            if off < src.len() {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                // SAFETY: `off < src.len()`, so the pointer is in bounds; a
                // prefetch is only a hint and never faults anyway.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(src.as_ptr().add(off).cast()) };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (src, base, bl);
}

/// First `p` in `from..to` with `W_p & mask == 0`. Requires `from >= WARMUP`.
#[inline(never)]
fn scan<const ASM: bool>(src: &[u8], from: usize, to: usize, mask: u64) -> Option<usize> {
    if ASM {
        scan_b::<ASM, BLOCK>(src, from, to, mask)
    } else {
        scan_b::<ASM, BLOCK_PORTABLE>(src, from, to, mask)
    }
}

#[inline(always)]
fn scan_b<const ASM: bool, const B: usize>(
    src: &[u8],
    mut from: usize,
    to: usize,
    mask: u64,
) -> Option<usize> {
    while to - from >= LANES * B {
        prefetch_round(src, from + LANES * B, B);
        if let Some(p) = round::<ASM>(src, from, B, mask) {
            return Some(p);
        }
        from += LANES * B;
    }
    let bl = (to - from) / LANES / GROUP * GROUP;
    if bl >= MIN_TAIL_BLOCK {
        if let Some(p) = round::<ASM>(src, from, bl, mask) {
            return Some(p);
        }
        from += LANES * bl;
    }
    if from < to {
        scan_scalar(src, from, to, mask)
    } else {
        None
    }
}

#[inline(always)]
fn cut_impl<const ASM: bool>(
    src: &[u8],
    min: usize,
    avg: usize,
    max: usize,
    mask_s: u64,
    mask_l: u64,
) -> usize {
    let len = src.len();
    if len <= min {
        return len;
    }
    let (remaining, center) = if len > max {
        (max, avg)
    } else if len < avg {
        (len, len)
    } else {
        (len, avg)
    };
    // The crate tests positions in pairs; with odd bounds the pair grid is
    // what matters (an odd `remaining` leaves its last byte untested).
    let start = min & !1;
    let end = remaining & !1;
    let split = (center & !1).clamp(start, end);
    assert!((mask_s | mask_l) >> WARMUP == 0, "mask uses bits above 47");

    let exact_end = (start + EXACT).min(end);
    let mut h = 0u64;
    for (p, &b) in src.iter().enumerate().take(exact_end).skip(start) {
        h = step(h, b);
        let mask = if p < split { mask_s } else { mask_l };
        if h & mask == 0 {
            return p;
        }
    }
    if exact_end < split {
        if let Some(p) = scan::<ASM>(src, exact_end, split, mask_s) {
            return p;
        }
    }
    let from = exact_end.max(split);
    if from < end {
        if let Some(p) = scan::<ASM>(src, from, end, mask_l) {
            return p;
        }
    }
    remaining
}

/// Length of the chunk starting at `src[0]`: for `src = &source[start..]`
/// this is `cutpoint - start` of the crate's `FastCDC::cut(start,
/// source.len() - start)`, given the masks of [`select_masks`]. Masks must
/// only use bits below 48 (all of [`MASKS`] do).
///
/// Parameters follow the crate's rules (even sizes, `min <= avg <= max`);
/// like the crate, they are not otherwise validated.
pub fn cut_with_masks(
    src: &[u8],
    min: usize,
    avg: usize,
    max: usize,
    mask_s: u64,
    mask_l: u64,
) -> usize {
    cut_impl::<true>(src, min, avg, max, mask_s, mask_l)
}

/// [`cut_with_masks`] using only safe, portable Rust.
pub fn cut_with_masks_portable(
    src: &[u8],
    min: usize,
    avg: usize,
    max: usize,
    mask_s: u64,
    mask_l: u64,
) -> usize {
    cut_impl::<false>(src, min, avg, max, mask_s, mask_l)
}

/// Length of the next chunk of `src` (see [`cut_with_masks`]).
pub fn cut(src: &[u8], min: usize, avg: usize, max: usize) -> usize {
    let (mask_s, mask_l) = select_masks(avg);
    cut_with_masks(src, min, avg, max, mask_s, mask_l)
}

#[inline(always)]
fn chunk_lengths_impl<const ASM: bool>(
    data: &[u8],
    min: usize,
    avg: usize,
    max: usize,
    out: &mut Vec<u32>,
) {
    let (mask_s, mask_l) = select_masks(avg);
    let mut pos = 0;
    while pos < data.len() {
        let n = cut_impl::<ASM>(&data[pos..], min, avg, max, mask_s, mask_l);
        out.push(u32::try_from(n).expect("chunk longer than u32::MAX"));
        pos += n;
    }
}

/// Chunk lengths of `data`, identical to
/// `fastcdc::v2020::FastCDC::new(data, min, avg, max)`; appended to `out`.
///
/// On x86_64 the hot loop is inline assembly (baseline x86-64 instructions
/// only, no CPU feature needed); elsewhere this is [`chunk_lengths_portable`].
pub fn chunk_lengths(data: &[u8], min: usize, avg: usize, max: usize, out: &mut Vec<u32>) {
    chunk_lengths_impl::<true>(data, min, avg, max, out);
}

/// [`chunk_lengths`] using only safe, portable Rust.
pub fn chunk_lengths_portable(data: &[u8], min: usize, avg: usize, max: usize, out: &mut Vec<u32>) {
    chunk_lengths_impl::<false>(data, min, avg, max, out);
}
