//! The attention dropout's masks in the host loops: Philox4x32-10 for [`LANES`] counters at
//! once, in each vector version (the `multiversion!` macro); with AVX-512, in its registers
//! by intrinsics, up to four groups of 16 counters with their rounds interleaved, and several
//! short rows (the top-k's) in one group.

use super::{LANES, SimdLevel, simd_level};
use crate::dropout::AttentionDropout;

/// Philox4x32-10 ([`crate::dropout::philox4x32_10`]) of `N` counters at once, lane by lane on
/// arrays so that the compiler keeps each word in a vector register (the 32 × 32-bit products
/// as the vector unit's widening multiplies).
#[inline(always)]
fn philox_lanes<const N: usize>(counters: [[u32; N]; 4], key: [u32; 2]) -> [[u32; N]; 4] {
    const M0: u64 = 0xD251_1F53;
    const M1: u64 = 0xCD9E_8D57;
    const W0: u32 = 0x9E37_79B9;
    const W1: u32 = 0xBB67_AE85;
    let [mut c0, mut c1, mut c2, mut c3] = counters;
    let [mut k0, mut k1] = key;
    for round in 0..10 {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let mut next = [[0u32; N]; 4];
        for l in 0..N {
            let p0 = M0 * c0[l] as u64;
            let p1 = M1 * c2[l] as u64;
            next[0][l] = (p1 >> 32) as u32 ^ c1[l] ^ k0;
            next[1][l] = p1 as u32;
            next[2][l] = (p0 >> 32) as u32 ^ c3[l] ^ k1;
            next[3][l] = p0 as u32;
        }
        [c0, c1, c2, c3] = next;
    }
    [c0, c1, c2, c3]
}

/// Counters one call of [`dropout_blocks`] draws when few keys are left: a top-k row of 32
/// keys takes 4, not [`LANES`].
const SHORT: usize = 4;

/// `weights` (at most `8 · N − skip` of them) times the factors of the `N` Philox blocks from
/// `counter`, the first block's first `skip` keys skipped; returns how many weights it covered.
/// `coordinates` are the counter's other words `[row, bh, stream]`, `draws` the threshold,
/// scale and key of [`AttentionDropout`](crate::dropout::AttentionDropout).
#[inline(always)]
fn dropout_blocks<const N: usize>(
    (threshold, scale, key): (u32, f32, [u32; 2]),
    [row, bh, stream]: [u32; 3],
    (counter, skip): (u32, usize),
    weights: &mut [f32],
) -> usize {
    let c0: [u32; N] = std::array::from_fn(|l| counter.wrapping_add(l as u32));
    let words = philox_lanes([c0, [row; N], [bh; N], [stream; N]], key);
    // The factors in key order: key 8·l + 2·w + h is half h of word w of counter l.
    let mut factors = [[0f32; 8]; N];
    for (l, block) in factors.iter_mut().enumerate() {
        for w in 0..4 {
            for h in 0..2 {
                let draw = (words[w][l] >> (16 * h)) & 0xFFFF;
                block[2 * w + h] = if draw < threshold { 0.0 } else { scale };
            }
        }
    }
    let n = (8 * N - skip).min(weights.len());
    for (x, f) in weights[..n]
        .iter_mut()
        .zip(&factors.as_flattened()[skip..skip + n])
    {
        *x *= f;
    }
    n
}

/// [`dropout_run`]'s loop on arrays (the versions without AVX-512).
#[inline(always)]
fn run_lanes(dropout: &AttentionDropout, coordinates: [u32; 4], weights: &mut [f32]) {
    let [stream, bh, row, first] = coordinates;
    let draws = (dropout.threshold(), dropout.scale(), dropout.key());
    // Blocks from the multiple of 8 at or below `first`; the first block skips `first mod 8`
    // keys.
    let (mut counter, mut skip, mut i) = (first >> 3, (first & 7) as usize, 0);
    while i < weights.len() {
        let (at, rest) = ((counter, skip), &mut weights[i..]);
        let n = if skip + rest.len() <= 8 * SHORT {
            dropout_blocks::<SHORT>(draws, [row, bh, stream], at, rest)
        } else {
            dropout_blocks::<LANES>(draws, [row, bh, stream], at, rest)
        };
        i += n;
        counter = counter.wrapping_add(((skip + n) / 8) as u32);
        skip = 0;
    }
}

/// The AVX-512 versions: Philox4x32-10 of 16 counters in four registers, up to four such
/// groups with their rounds interleaved (one round waits on its multiplies' latency), the
/// products' halves put back in place by masked word swaps (the arrays' version spends most
/// of its time widening and narrowing them), the drop decisions as bit masks, applied 16
/// weights at a time.
#[cfg(target_arch = "x86_64")]
mod wide {
    use std::arch::x86_64::*;

    use crate::dropout::AttentionDropout;

    /// `SPREAD[b]` has bit `8i` set for each bit `i` of `b`.
    const SPREAD: [u64; 256] = {
        let mut table = [0u64; 256];
        let mut b = 0;
        while b < 256 {
            let mut i = 0;
            while i < 8 {
                table[b] |= ((b as u64 >> i) & 1) << (8 * i);
                i += 1;
            }
            b += 1;
        }
        table
    };

    /// The high and low words of the 32 × 32-bit products of `x`'s 16 lanes by `m` (in the
    /// low half of each 64-bit lane of `m`). The halves are put in place by swapping the two
    /// 32-bit words of each 64-bit lane (`vpshufd`, a shuffle port), not by shifts, which share
    /// the multiplier's port.
    ///
    /// # Safety
    /// Only in a function compiled with AVX-512F.
    #[inline(always)]
    unsafe fn products(x: __m512i, m: __m512i) -> (__m512i, __m512i) {
        // SAFETY: the caller's.
        unsafe {
            let even = _mm512_mul_epu32(x, m);
            let odd = _mm512_mul_epu32(_mm512_shuffle_epi32::<0xB1>(x), m);
            // Even lanes: the even products' high words, swapped down; odd lanes: the odd
            // products' high words, in place.
            let high = _mm512_mask_shuffle_epi32::<0xB1>(odd, 0x5555, even);
            // Even lanes: the even products' low words, in place; odd lanes: the odd
            // products' low words, swapped up.
            let low = _mm512_mask_shuffle_epi32::<0xB1>(even, 0xAAAA, odd);
            (high, low)
        }
    }

    /// Bit `8l + 2w + h` of element `g` set where the draw of half `h` of word `w` of
    /// Philox4x32-10 of counter `[c0[g][l], c1[g][l], bh, stream]` is below the threshold: the
    /// dropped keys of `G` groups of 16 blocks, each in key order. The groups' rounds are
    /// interleaved, so that one group's multiplies run while another's wait for theirs.
    ///
    /// # Safety
    /// Only in a function compiled with AVX-512F.
    #[inline(always)]
    unsafe fn dropped<const G: usize>(
        dropout: &AttentionDropout,
        counters: [[__m512i; 2]; G],
        [bh, stream]: [u32; 2],
    ) -> [u128; G] {
        // SAFETY: the caller's.
        unsafe {
            let [mut k0, mut k1] = dropout.key();
            let (m0, m1) = (
                _mm512_set1_epi64(0xD251_1F53),
                _mm512_set1_epi64(0xCD9E_8D57),
            );
            let (c2, c3) = (
                _mm512_set1_epi32(bh as i32),
                _mm512_set1_epi32(stream as i32),
            );
            // No closures below: one would be compiled without AVX-512, and each intrinsic in
            // it called instead of inlined.
            let mut words = [[c2; 4]; G];
            for (words, [c0, c1]) in words.iter_mut().zip(counters) {
                *words = [c0, c1, c2, c3];
            }
            for round in 0..10 {
                if round > 0 {
                    k0 = k0.wrapping_add(0x9E37_79B9);
                    k1 = k1.wrapping_add(0xBB67_AE85);
                }
                let (k0, k1) = (_mm512_set1_epi32(k0 as i32), _mm512_set1_epi32(k1 as i32));
                for [c0, c1, c2, c3] in words.iter_mut() {
                    let (high0, low0) = products(*c0, m0);
                    let (high1, low1) = products(*c2, m1);
                    *c0 = _mm512_ternarylogic_epi32::<0x96>(high1, *c1, k0);
                    *c2 = _mm512_ternarylogic_epi32::<0x96>(high0, *c3, k1);
                    [*c1, *c3] = [low1, low0];
                }
            }
            let threshold = _mm512_set1_epi32(dropout.threshold() as i32);
            let mut dropped = [0u128; G];
            for (dropped, words) in dropped.iter_mut().zip(words) {
                let (mut low, mut high) = (0u64, 0u64);
                for (w, word) in words.into_iter().enumerate() {
                    let halves = [
                        _mm512_and_si512(word, _mm512_set1_epi32(0xFFFF)),
                        _mm512_srli_epi32::<16>(word),
                    ];
                    for (h, draws) in halves.into_iter().enumerate() {
                        // Bit l: block l's key 2w + h is dropped.
                        let bits = _mm512_cmplt_epu32_mask(draws, threshold);
                        low |= SPREAD[(bits & 0xFF) as usize] << (2 * w + h);
                        high |= SPREAD[(bits >> 8) as usize] << (2 * w + h);
                    }
                }
                *dropped = low as u128 | (high as u128) << 64;
            }
            dropped
        }
    }

    /// `weights` (at most 128) times `scale` where the bit of `dropped` is clear, 0 where set.
    ///
    /// # Safety
    /// Only in a function compiled with AVX-512F.
    #[inline(always)]
    unsafe fn apply(dropped: u128, scale: f32, weights: &mut [f32]) {
        debug_assert!(weights.len() <= 128);
        // SAFETY: the caller's; the masked loads and stores touch the first `take` floats of
        // each chunk of `weights` only.
        unsafe {
            let scale = _mm512_set1_ps(scale);
            for (j, chunk) in weights.chunks_mut(16).enumerate() {
                let lanes = ((1u32 << chunk.len()) - 1) as u16;
                let keep = !((dropped >> (16 * j)) as u16) & lanes;
                let x = _mm512_maskz_loadu_ps(lanes, chunk.as_ptr());
                _mm512_mask_storeu_ps(
                    chunk.as_mut_ptr(),
                    lanes,
                    _mm512_maskz_mul_ps(keep, x, scale),
                );
            }
        }
    }

    /// Groups of 16 Philox counters whose rounds one call interleaves: four cover a part of
    /// 512 keys, and keep 16 of the 32 vector registers busy.
    const GROUPS: usize = 4;

    /// [`super::dropout_run`] with AVX-512, up to [`GROUPS`] groups of 16 counters at a time.
    ///
    /// # Safety
    /// Only in a function compiled with AVX-512F.
    #[inline(always)]
    pub(super) unsafe fn dropout_run(
        dropout: &AttentionDropout,
        [stream, bh, row, first]: [u32; 4],
        weights: &mut [f32],
    ) {
        let scale = dropout.scale();
        let (mut counter, mut skip, mut i) = (first >> 3, (first & 7) as usize, 0);
        while i < weights.len() {
            let (at, rest) = ((counter, skip), &mut weights[i..]);
            let coordinates = [stream, bh, row];
            // SAFETY: the caller's.
            let n = unsafe {
                match (skip + rest.len()).div_ceil(128) {
                    1 => run_groups::<1>(dropout, scale, coordinates, at, rest),
                    2 => run_groups::<2>(dropout, scale, coordinates, at, rest),
                    3 => run_groups::<3>(dropout, scale, coordinates, at, rest),
                    _ => run_groups::<GROUPS>(dropout, scale, coordinates, at, rest),
                }
            };
            i += n;
            counter = counter.wrapping_add(((skip + n) / 8) as u32);
            skip = 0;
        }
    }

    /// `weights` (at most `128 · G − skip` of them) times the factors of the `16 · G` blocks
    /// from `counter` of `(stream, bh, row)`, the first block's first `skip` keys skipped;
    /// returns how many weights it covered.
    ///
    /// # Safety
    /// Only in a function compiled with AVX-512F.
    #[inline(always)]
    unsafe fn run_groups<const G: usize>(
        dropout: &AttentionDropout,
        scale: f32,
        [stream, bh, row]: [u32; 3],
        (counter, skip): (u32, usize),
        weights: &mut [f32],
    ) -> usize {
        // SAFETY: the caller's.
        unsafe {
            let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            let c1 = _mm512_set1_epi32(row as i32);
            let mut counters = [[c1; 2]; G];
            for (g, [c0, _]) in counters.iter_mut().enumerate() {
                let first = counter.wrapping_add(16 * g as u32);
                *c0 = _mm512_add_epi32(_mm512_set1_epi32(first as i32), lanes);
            }
            let dropped = dropped::<G>(dropout, counters, [bh, stream]);
            let n = (128 * G - skip).min(weights.len());
            // Group g's keys are the call's 128g..128(g + 1): the weights from 128g − skip on
            // (the first group's from 0, its bits shifted by `skip`) to 128(g + 1) − skip.
            for (g, dropped) in dropped.into_iter().enumerate() {
                let (start, end) = (
                    (128 * g).saturating_sub(skip),
                    (128 * (g + 1) - skip).min(n),
                );
                let dropped = if g == 0 { dropped >> skip } else { dropped };
                if start < end {
                    apply(dropped, scale, &mut weights[start..end]);
                }
            }
            n
        }
    }

    /// [`super::dropout_rows`] with AVX-512, for rows of at most 4 blocks (`k ≤ 32`): `16 /
    /// blocks` rows to a group of 16 counters, one block per lane, [`GROUPS`] groups at a time.
    ///
    /// # Safety
    /// Only in a function compiled with AVX-512F; `k ≤ 32`.
    #[inline(always)]
    pub(super) unsafe fn dropout_rows(
        dropout: &AttentionDropout,
        coordinates: [u32; 3],
        rows: &[u32],
        shape: (usize, usize),
        weights: &mut [f32],
    ) {
        debug_assert!(shape.1 <= 32);
        // SAFETY: the caller's.
        unsafe {
            match shape.1.div_ceil(8) {
                0 | 1 => rows_of::<1>(dropout, coordinates, rows, shape, weights),
                2 => rows_of::<2>(dropout, coordinates, rows, shape, weights),
                3 => rows_of::<3>(dropout, coordinates, rows, shape, weights),
                _ => rows_of::<4>(dropout, coordinates, rows, shape, weights),
            }
        }
    }

    /// [`dropout_rows`] for rows of `B` blocks (the lanes' rows and blocks known at compile
    /// time), [`GROUPS`] groups of `16 / B` rows at a time, the rest a group at a time.
    ///
    /// # Safety
    /// As [`dropout_rows`]; `k ≤ 8 · B`.
    #[inline(always)]
    unsafe fn rows_of<const B: usize>(
        dropout: &AttentionDropout,
        coordinates: [u32; 3],
        rows: &[u32],
        shape: (usize, usize),
        weights: &mut [f32],
    ) {
        let (scale, per_group) = (dropout.scale(), 16 / B);
        let mut chunks = rows.chunks_exact(GROUPS * per_group);
        let mut at = 0;
        // SAFETY: the caller's.
        unsafe {
            for chunk in &mut chunks {
                let end = at + chunk.len();
                row_groups::<B, GROUPS>(dropout, scale, coordinates, (at, chunk), shape, weights);
                at = end;
            }
            for group in chunks.remainder().chunks(per_group) {
                let end = at + group.len();
                row_groups::<B, 1>(dropout, scale, coordinates, (at, group), shape, weights);
                at = end;
            }
        }
    }

    /// The rows `rows` (`G` groups of `16 / B`, or one group of fewer) of [`rows_of`], the
    /// first of them its `at`-th.
    ///
    /// # Safety
    /// As [`rows_of`].
    #[inline(always)]
    unsafe fn row_groups<const B: usize, const G: usize>(
        dropout: &AttentionDropout,
        scale: f32,
        [stream, bh, first]: [u32; 3],
        (at, rows): (usize, &[u32]),
        (stride, k): (usize, usize),
        weights: &mut [f32],
    ) {
        let per_group = 16 / B;
        // SAFETY: the caller's.
        unsafe {
            // Lane l of group g: block l % B of the group's row l / B (lanes past the last row
            // repeat it; their bits are not read).
            let c0: [u32; 16] = std::array::from_fn(|l| (l % B) as u32);
            let c0 = _mm512_loadu_si512(c0.as_ptr().cast());
            let mut counters = [[c0; 2]; G];
            for (g, [_, c1]) in counters.iter_mut().enumerate() {
                let rows: [u32; 16] = std::array::from_fn(|l| {
                    let r = (g * per_group + l / B).min(rows.len() - 1);
                    first.wrapping_add(rows[r])
                });
                *c1 = _mm512_loadu_si512(rows.as_ptr().cast());
            }
            let dropped = dropped::<G>(dropout, counters, [bh, stream]);
            for r in 0..rows.len() {
                let (g, r_in) = (r / per_group, r % per_group);
                let start = (at + r) * stride;
                let row = &mut weights[start..start + k];
                apply(dropped[g] >> (8 * B * r_in), scale, row);
            }
        }
    }
}

multiversion! {
    /// [`AttentionDropout::apply_row`](crate::dropout::AttentionDropout::apply_row) with
    /// [`LANES`] Philox counters (`8 · LANES` keys) at a time: `weights[i]` times the factor of
    /// key `first + i` of `(stream, bh, row)`, `coordinates = [stream, bh, row, first]`.
    pub(crate) fn dropout_run<FMA, WIDE>(
        dropout: &AttentionDropout,
        coordinates: [u32; 4],
        weights: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if WIDE {
            // SAFETY: `WIDE` is true only in the AVX-512 version (`multiversion!`).
            return unsafe { wide::dropout_run(dropout, coordinates, weights) };
        }
        run_lanes(dropout, coordinates, weights)
    }
}

multiversion! {
    /// [`dropout_run`] on the first `k` weights (keys `0..k`) of several rows: row `j` is
    /// `weights[j · stride..j · stride + k]`, of the counter's row `first + rows[j]`;
    /// `coordinates = [stream, bh, first]`. With AVX-512 and `k ≤ 32` (the top-k's rows),
    /// several rows draw their blocks in one Philox call.
    ///
    /// # Panics
    /// When `weights` is shorter than `(rows.len() − 1) · stride + k`.
    pub(crate) fn dropout_rows<FMA, WIDE>(
        dropout: &AttentionDropout,
        coordinates: [u32; 3],
        rows: &[u32],
        shape: (usize, usize),
        weights: &mut [f32],
    ) {
        let [stream, bh, first] = coordinates;
        let (stride, k) = shape;
        #[cfg(target_arch = "x86_64")]
        if WIDE && k <= 32 {
            // SAFETY: `WIDE` is true only in the AVX-512 version (`multiversion!`).
            return unsafe { wide::dropout_rows(dropout, coordinates, rows, shape, weights) };
        }
        for (j, &row) in rows.iter().enumerate() {
            let row = first.wrapping_add(row);
            run_lanes(dropout, [stream, bh, row, 0], &mut weights[j * stride..j * stride + k]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The test rows' weights: 1 + i / 64.
    fn weights(n: usize) -> Vec<f32> {
        (0..n).map(|i| 1.0 + i as f32 / 64.0).collect()
    }

    /// [`weights`] times [`AttentionDropout::factor`] of each key, one scalar Philox call per
    /// key.
    fn expected(
        dropout: &AttentionDropout,
        [stream, bh, row, first]: [u32; 4],
        n: usize,
    ) -> Vec<f32> {
        let factor = |i: usize| dropout.factor(stream, bh, row, first + i as u32);
        weights(n)
            .iter()
            .enumerate()
            .map(|(i, w)| w * factor(i))
            .collect()
    }

    /// The AVX-512 versions, compiled for it, where the CPU has it.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn wide_run(dropout: &AttentionDropout, coordinates: [u32; 4], weights: &mut [f32]) {
        // SAFETY: compiled with AVX-512F.
        unsafe { wide::dropout_run(dropout, coordinates, weights) }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    fn wide_rows(
        dropout: &AttentionDropout,
        coordinates: [u32; 3],
        rows: &[u32],
        shape: (usize, usize),
        weights: &mut [f32],
    ) {
        // SAFETY: compiled with AVX-512F; the caller passes `k ≤ 32`.
        unsafe { wide::dropout_rows(dropout, coordinates, rows, shape, weights) }
    }

    /// Whether the CPU has AVX-512; when not, says that the test skips its AVX-512 checks.
    fn has_avx512(test: &str) -> bool {
        let has = super::super::detected_level() == SimdLevel::Avx512;
        if !has {
            eprintln!("skipped: {test}'s AVX-512 checks (the CPU has no AVX-512)");
        }
        has
    }

    /// Every version of a row's factors (the arrays' loop, AVX-512 where the CPU has it, and
    /// the dispatched one) equals the scalar factors bit for bit: rows starting inside a block
    /// and ending anywhere, short and long, both streams, p = 0.1 and 0.5.
    #[test]
    fn rows_match_the_scalar_factors() {
        let avx512 = has_avx512("rows_match_the_scalar_factors");
        for (prob, seed) in [(0.1, 0x9abc_def0_1234_5678), (0.5, 3)] {
            let dropout = AttentionDropout::new(prob, seed);
            for stream in [AttentionDropout::CLUSTER_ROWS, AttentionDropout::QUERY_TOP] {
                for (n, first) in [
                    (0, 0),
                    (1, 0),
                    (7, 1),
                    (13, 3),
                    (32, 0),
                    (33, 5),
                    (129, 7),
                    (300, 64),
                    (1000, 123),
                ] {
                    let coordinates = [stream, 5, 77, first];
                    let want = expected(&dropout, coordinates, n);
                    let mut got = weights(n);
                    run_lanes(&dropout, coordinates, &mut got);
                    assert_eq!(
                        got, want,
                        "arrays, p = {prob}, stream {stream}, {n} keys from {first}"
                    );
                    let mut got = weights(n);
                    dropout_run(&dropout, coordinates, &mut got);
                    assert_eq!(
                        got, want,
                        "dispatched, p = {prob}, stream {stream}, {n} keys from {first}"
                    );
                    #[cfg(target_arch = "x86_64")]
                    if avx512 {
                        let mut got = weights(n);
                        // SAFETY: the CPU has the features the function is compiled for.
                        unsafe { wide_run(&dropout, coordinates, &mut got) };
                        assert_eq!(
                            got, want,
                            "AVX-512, p = {prob}, stream {stream}, {n} keys from {first}"
                        );
                    }
                }
            }
        }
    }

    /// Several rows' first `k` weights, every version, equal the scalar factors of their own
    /// rows bit for bit, and the weights past `k` of each row stay as they were: `k` from 1
    /// to 40 (one to five blocks), a partial last group of rows.
    #[test]
    fn several_rows_match_the_scalar_factors() {
        let dropout = AttentionDropout::new(0.3, 42);
        let (stream, bh, first) = (AttentionDropout::QUERY_TOP, 9, 1000);
        // 150 rows in no order: with every k, groups of four Philox calls and single ones,
        // and a partial last group.
        let rows: Vec<u32> = (0..150).map(|j| (j * 37 + 3) % 1009).collect();
        let avx512 = has_avx512("several_rows_match_the_scalar_factors");
        for k in [1, 5, 8, 9, 24, 31, 32, 33, 40] {
            let stride = k + 3;
            let base = weights(rows.len() * stride);
            let mut want = base.clone();
            for (j, &r) in rows.iter().enumerate() {
                for i in 0..k {
                    want[j * stride + i] *= dropout.factor(stream, bh, first + r, i as u32);
                }
            }
            let mut got = base.clone();
            dropout_rows(&dropout, [stream, bh, first], &rows, (stride, k), &mut got);
            assert_eq!(got, want, "dispatched, k = {k}");
            #[cfg(target_arch = "x86_64")]
            if avx512 && k <= 32 {
                let mut got = base.clone();
                // SAFETY: the CPU has the features the function is compiled for; k ≤ 32.
                unsafe { wide_rows(&dropout, [stream, bh, first], &rows, (stride, k), &mut got) };
                assert_eq!(got, want, "AVX-512, k = {k}");
            }
        }
    }
}
