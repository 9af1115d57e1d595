//! The attention dropout's masks in the host loops: Philox4x32-10 for [`LANES`] counters at
//! once, in each vector version (the `multiversion!` macro).

use super::{LANES, SimdLevel, simd_level};

/// Philox4x32-10 ([`crate::dropout::philox4x32_10`]) of [`LANES`] counters at once, lane by
/// lane on arrays so that the compiler keeps each word in a vector register (the 32 × 32-bit
/// products as the vector unit's widening multiplies).
#[inline(always)]
fn philox_lanes(counters: [[u32; LANES]; 4], key: [u32; 2]) -> [[u32; LANES]; 4] {
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
        let mut next = [[0u32; LANES]; 4];
        for l in 0..LANES {
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

multiversion! {
    /// [`AttentionDropout::apply_row`](crate::dropout::AttentionDropout::apply_row) with
    /// [`LANES`] Philox counters (`8 · LANES` keys) at a time: `weights[i]` times the factor of
    /// key `first + i` of `(stream, bh, row)`, `coordinates = [stream, bh, row, first]`.
    pub(crate) fn dropout_run<FMA>(
        dropout: &crate::dropout::AttentionDropout,
        coordinates: [u32; 4],
        weights: &mut [f32],
    ) {
        let [stream, bh, row, first] = coordinates;
        let (threshold, scale, key) = (dropout.threshold(), dropout.scale(), dropout.key());
        // Blocks of 8 · LANES keys from the multiple of 8 at or below `first`; the first block
        // skips `first mod 8` keys.
        let (mut counter, mut skip, mut i) = (first >> 3, (first & 7) as usize, 0);
        while i < weights.len() {
            let c0: [u32; LANES] = std::array::from_fn(|l| counter.wrapping_add(l as u32));
            let words = philox_lanes([c0, [row; LANES], [bh; LANES], [stream; LANES]], key);
            // The factors in key order: key 8·l + 2·w + h is half h of word w of counter l.
            let mut factors = [0f32; 8 * LANES];
            for l in 0..LANES {
                for w in 0..4 {
                    for h in 0..2 {
                        let draw = (words[w][l] >> (16 * h)) & 0xFFFF;
                        factors[8 * l + 2 * w + h] = if draw < threshold { 0.0 } else { scale };
                    }
                }
            }
            let n = (8 * LANES - skip).min(weights.len() - i);
            for (x, f) in weights[i..i + n].iter_mut().zip(&factors[skip..skip + n]) {
                *x *= f;
            }
            i += n;
            skip = 0;
            counter = counter.wrapping_add(LANES as u32);
        }
    }
}
