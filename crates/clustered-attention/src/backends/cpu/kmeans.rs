//! Host [`hamming_kmeans`]: Lloyd's algorithm on the codes of each `(batch, head)`, compiled for
//! AVX-512 (vector popcounts), AVX2 (per-byte distance tables) and the baseline.

use burn::backend::TensorMetadata;
use burn::backend::tensor::IntTensor;

use super::access::{HostAccess, lengths_on_host, read_ints, write_ints};
use super::parallel::for_each_row;
#[cfg(target_arch = "x86_64")]
use super::simd::{SimdLevel, simd_level};
use crate::ops::{ClusteredAttentionBackend, NO_CLUSTER, initial_centroid_positions, reference};

/// Assignment step for fewer than 2¹⁶ clusters: the key `distance · 2¹⁶ + index` of each
/// centroid is unique, so its minimum picks the nearest centroid with ties to the lowest
/// index. Sixteen codes at a time go through all centroids, their minima in one vector.
#[inline(always)]
fn assign(codes: &[u32], centroids: &[u32], out: &mut [u32]) {
    const W: usize = 16;
    let nearest = |code: &[u32; W]| {
        let mut best = [u32::MAX; W];
        for (j, &c) in centroids.iter().enumerate() {
            for l in 0..W {
                best[l] = best[l].min(((code[l] ^ c).count_ones() << 16) | j as u32);
            }
        }
        best.map(|key| key & 0xFFFF)
    };
    let mut chunks = codes.chunks_exact(W);
    let mut outs = out.chunks_exact_mut(W);
    for (code, out) in (&mut chunks).zip(&mut outs) {
        out.copy_from_slice(&nearest(code.try_into().unwrap()));
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut code = [0u32; W];
        code[..tail.len()].copy_from_slice(tail);
        let best = nearest(&code);
        outs.into_remainder().copy_from_slice(&best[..tail.len()]);
    }
}

/// Most clusters [`NearestTable`] handles: a centroid index takes the low 10 bits of its keys.
const TABLE_CLUSTERS: usize = 1 << 10;

/// The assignment step by table lookups, for CPUs without vector popcounts: a code's distance
/// to every centroid is the sum of four table rows, one per byte of the code.
///
/// Row `(p, v)` holds, for each centroid `j`, the Hamming distance of the byte value `v` to
/// byte `p` of centroid `j`, times 2¹⁰; the rows of byte 0 also hold `j` in the low 10 bits.
/// The sum of a code's four rows is then `distance · 2¹⁰ + j` (at most 32 · 2¹⁰ + 1023), and
/// its minimum picks the nearest centroid with ties to the lowest index, as [`assign`] does.
/// The columns past the last centroid, up to a multiple of 16, hold distance 33 and never win.
struct NearestTable {
    /// `[4, 256, padded]` keys.
    rows: Vec<u16>,
    /// Columns per row: the number of clusters rounded up to 16.
    padded: usize,
}

impl NearestTable {
    /// Lanes of the minimum (one AVX2 register of `u16`).
    const W: usize = 16;

    fn new(clusters: usize) -> Self {
        assert!(
            clusters <= TABLE_CLUSTERS,
            "a nearest-centroid table holds at most {TABLE_CLUSTERS} clusters, got {clusters}"
        );
        let padded = clusters.div_ceil(Self::W) * Self::W;
        Self {
            rows: vec![0; 4 * 256 * padded],
            padded,
        }
    }

    /// Fills the rows for `centroids` (as many as the table was made for). Row `v` of a byte
    /// is row `v & (v − 1)` (`v` without its lowest set bit `b`) plus or minus 2¹⁰ where bit
    /// `b` of the centroid's byte is clear or set.
    #[inline(always)]
    fn fill(&mut self, centroids: &[u32]) {
        let cp = self.padded;
        const ONE: u16 = 1 << 10;
        let mut step = vec![0u16; 8 * cp];
        for (p, byte_rows) in self.rows.chunks_exact_mut(256 * cp).enumerate() {
            let (first, later) = byte_rows.split_at_mut(cp);
            for j in 0..cp {
                let byte = centroids.get(j).map(|&c| (c >> (8 * p)) & 0xFF);
                first[j] = match (byte, p) {
                    (Some(byte), 0) => ((byte.count_ones() << 10) | j as u32) as u16,
                    (Some(byte), _) => (byte.count_ones() << 10) as u16,
                    (None, 0) => ((33 << 10) | j as u32) as u16,
                    (None, _) => 0,
                };
                for b in 0..8 {
                    step[b * cp + j] = match byte {
                        Some(byte) if byte >> b & 1 == 1 => ONE.wrapping_neg(),
                        Some(_) => ONE,
                        None => 0,
                    };
                }
            }
            for v in 1..256 {
                let (done, rest) = later.split_at_mut((v - 1) * cp);
                let base = v & (v - 1);
                let from = if base == 0 {
                    &*first
                } else {
                    &done[(base - 1) * cp..base * cp]
                };
                let b = v.trailing_zeros() as usize;
                let step = &step[b * cp..(b + 1) * cp];
                for ((out, &from), &step) in rest[..cp].iter_mut().zip(from).zip(step) {
                    *out = from.wrapping_add(step);
                }
            }
        }
    }

    /// Writes the index of the nearest centroid of each code to `out`.
    #[inline(always)]
    fn assign(&self, codes: &[u32], out: &mut [u32]) {
        const W: usize = NearestTable::W;
        let cp = self.padded;
        for (&code, out) in codes.iter().zip(out) {
            let row = |p: usize| {
                let v = (code >> (8 * p)) as usize & 0xFF;
                &self.rows[(p * 256 + v) * cp..(p * 256 + v + 1) * cp]
            };
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let mut best = [u16::MAX; W];
            for (((a, b), c), d) in r0
                .chunks_exact(W)
                .zip(r1.chunks_exact(W))
                .zip(r2.chunks_exact(W))
                .zip(r3.chunks_exact(W))
            {
                for l in 0..W {
                    best[l] = best[l].min(a[l] + b[l] + c[l] + d[l]);
                }
            }
            let key = best.iter().fold(u16::MAX, |m, &k| m.min(k));
            *out = u32::from(key) & (TABLE_CLUSTERS as u32 - 1);
        }
    }
}

/// The assignment step: by `table` when there is one, else by [`assign`].
#[inline(always)]
fn assign_all(table: &mut Option<NearestTable>, codes: &[u32], centroids: &[u32], out: &mut [u32]) {
    match table {
        Some(table) => {
            table.fill(centroids);
            table.assign(codes, out);
        }
        None => assign(codes, centroids, out),
    }
}

/// K-means of one `(batch, head)` row: `codes` are the `n` valid codes; writes the
/// assignments of the whole row (padded ones `-1`). With `TABLE`, the assignment steps use a
/// [`NearestTable`] when there are at most [`TABLE_CLUSTERS`] clusters. Stops at a fixed
/// point: once an update leaves every centroid as it was, each remaining iteration would
/// repeat it, so the assignments are those of all `iterations` (the benchmark's codes reach
/// one within four).
#[inline(always)]
fn kmeans_row_body<const TABLE: bool>(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    assignments.fill(NO_CLUSTER);
    let clusters = initial.len();
    if n <= clusters {
        for (i, a) in assignments.iter_mut().take(n).enumerate() {
            *a = i as i64;
        }
        return;
    }
    let codes = &codes[..n];
    let mut centroids: Vec<u32> = initial.iter().map(|&p| codes[p as usize]).collect();
    let mut nearest = vec![0u32; n];
    let mut ones = vec![0u32; clusters * 32];
    let mut counts = vec![0u32; clusters];
    let mut table = (TABLE && clusters <= TABLE_CLUSTERS).then(|| NearestTable::new(clusters));
    // `nearest` holds the assignment to the current centroids once an update changes none.
    let mut fixed_point = false;
    for _ in 0..iterations {
        assign_all(&mut table, codes, &centroids, &mut nearest);
        ones.fill(0);
        counts.fill(0);
        for (&code, &c) in codes.iter().zip(&nearest) {
            let c = c as usize;
            counts[c] += 1;
            let bits: &mut [u32; 32] = (&mut ones[c * 32..(c + 1) * 32]).try_into().unwrap();
            for (b, count) in bits.iter_mut().enumerate() {
                *count += (code >> b) & 1;
            }
        }
        let mut changed = false;
        for (c, centroid) in centroids.iter_mut().enumerate() {
            let old = *centroid;
            for b in 0..32 {
                let twice = 2 * ones[c * 32 + b];
                if twice > counts[c] {
                    *centroid |= 1 << b;
                } else if twice < counts[c] {
                    *centroid &= !(1 << b);
                }
            }
            changed |= *centroid != old;
        }
        // Unchanged centroids give the same assignment and update again: every remaining
        // iteration would repeat this one.
        if !changed {
            fixed_point = true;
            break;
        }
    }
    if !fixed_point {
        assign_all(&mut table, codes, &centroids, &mut nearest);
    }
    for (a, &c) in assignments.iter_mut().zip(&nearest) {
        *a = c as i64;
    }
}

/// [`kmeans_row_body`] with AVX-512 vector popcounts (`vpopcntd`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx512bw,avx512vpopcntdq,avx2,popcnt")]
fn kmeans_row_avx512(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    kmeans_row_body::<false>(codes, n, initial, iterations, assignments)
}

/// [`kmeans_row_body`] with AVX2 and a [`NearestTable`] (AVX2 has no vector popcount).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,popcnt")]
fn kmeans_row_avx2(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    kmeans_row_body::<true>(codes, n, initial, iterations, assignments)
}

/// K-means of one row, compiled for the best vector instructions the CPU has.
fn kmeans_row(
    codes: &[u32],
    n: usize,
    initial: &[i64],
    iterations: usize,
    assignments: &mut [i64],
) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        let level = simd_level();
        if level == SimdLevel::Avx512
            && has!("avx512bw")
            && has!("avx512vpopcntdq")
            && has!("popcnt")
        {
            // SAFETY: the CPU supports the features the function is compiled for (AVX-512 F
            // and VL and AVX2 come with the level).
            return unsafe { kmeans_row_avx512(codes, n, initial, iterations, assignments) };
        }
        if level >= SimdLevel::Avx2 && has!("popcnt") {
            // SAFETY: as above.
            return unsafe { kmeans_row_avx2(codes, n, initial, iterations, assignments) };
        }
    }
    kmeans_row_body::<true>(codes, n, initial, iterations, assignments)
}

/// Host [`ClusteredAttentionBackend::hamming_kmeans`](ClusteredAttentionBackend::hamming_kmeans).
pub fn hamming_kmeans<B: HostAccess + ClusteredAttentionBackend>(
    codes: IntTensor<B>,
    query_lengths: Option<IntTensor<B>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (IntTensor<B>, IntTensor<B>) {
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    if clusters >= 1 << 16 {
        return reference::hamming_kmeans::<B>(
            codes,
            query_lengths.into(),
            clusters,
            iterations,
            seed,
        );
    }
    let device = codes.device();
    let (codes, [batch, heads, len]) = read_ints::<B, 3>(codes);
    let codes: Vec<u32> = codes.iter().map(|&c| c as i32 as u32).collect();
    let lengths = lengths_on_host::<B>("query_lengths", query_lengths, batch, len);
    let initial = initial_centroid_positions(&lengths, heads, clusters, seed);

    let mut assignments = vec![0i64; batch * heads * len];
    for_each_row(
        &mut assignments,
        batch * heads,
        len * clusters * (iterations + 1),
        |row, out| {
            let n = lengths[row / heads];
            kmeans_row(
                &codes[row * len..(row + 1) * len],
                n,
                &initial[row * clusters..(row + 1) * clusters],
                iterations,
                out,
            );
        },
    );
    let mut counts = vec![0i64; batch * heads * clusters];
    for (row, chunk) in assignments.chunks(len).enumerate() {
        for &a in chunk.iter().filter(|&&a| a >= 0) {
            counts[row * clusters + a as usize] += 1;
        }
    }
    (
        write_ints::<B, 3>(assignments, [batch, heads, len], &device),
        write_ints::<B, 3>(counts, [batch, heads, clusters], &device),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SplitMix64: a fixed stream of test codes.
    fn codes(n: usize, seed: u64, mask: u32) -> Vec<u32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = state;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) as u32 & mask
            })
            .collect()
    }

    /// The table assignment picks the same centroid as a scan of popcounts with ties to the
    /// lowest index, for cluster counts around the 16-column padding and at the table's limit,
    /// with full 32-bit codes and with codes of 3 bits (many exact ties, repeated centroids).
    #[test]
    fn nearest_table_matches_popcount_scan() {
        for clusters in [1, 2, 15, 16, 17, 100, TABLE_CLUSTERS] {
            for (seed, mask) in [(1, u32::MAX), (2, 0b111), (3, 0xF0F0_0F0F)] {
                let codes = codes(2000, seed + clusters as u64, mask);
                let centroids = self::codes(clusters, seed + 99, mask);
                let expected: Vec<u32> = codes
                    .iter()
                    .map(|&x| {
                        (0..clusters)
                            .min_by_key(|&j| ((x ^ centroids[j]).count_ones(), j))
                            .unwrap() as u32
                    })
                    .collect();
                let mut table = Some(NearestTable::new(clusters));
                let mut out = vec![u32::MAX; codes.len()];
                assign_all(&mut table, &codes, &centroids, &mut out);
                assert_eq!(out, expected, "table, clusters {clusters}, mask {mask:#x}");
                assign_all(&mut None, &codes, &centroids, &mut out);
                assert_eq!(out, expected, "scan, clusters {clusters}, mask {mask:#x}");
            }
        }
    }
}
