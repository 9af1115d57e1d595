//! Hashing and Hamming K-means against plain-loop references.

use burn::tensor::{Device, Int, Tensor, TensorData};
use clustered_attention::ops::{ClusteredAttentionBackend, initial_centroid_positions};
use clustered_attention::{hamming_kmeans, lsh_hash, lsh_planes};
use rand::RngExt;
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

use crate::common::*;

/// The initial centroid positions as `initial_centroid_positions` documents them, written here
/// from its docs (not calling it): per `(batch, head)`, `clusters` distinct positions in
/// `0..n` drawn by `rand::seq::index::sample` from a `Xoshiro256PlusPlus` seeded with the
/// SplitMix64 finaliser of `seed ^ n · 0x9E3779B97F4A7C15 ^ head · 0xC2B2AE3D27D4EB4F`;
/// `0, 1, …, n − 1` then zeros when `n ≤ clusters`.
pub(crate) fn initial_positions(
    lengths: &[usize],
    heads: usize,
    clusters: usize,
    seed: u64,
) -> Vec<i64> {
    let mut positions = Vec::new();
    for &n in lengths {
        for head in 0..heads {
            if n <= clusters {
                positions.extend((0..clusters).map(|c| if c < n { c as i64 } else { 0 }));
                continue;
            }
            let mut z = seed
                ^ (n as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                ^ (head as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            let mut rng = Xoshiro256PlusPlus::seed_from_u64(z);
            let picked = rand::seq::index::sample(&mut rng, n, clusters);
            positions.extend(picked.iter().map(|p| p as i64));
        }
    }
    positions
}

/// The crate's initial centroid positions follow their documented rule, for short and long
/// sequences, several heads and seeds.
#[test]
fn initial_centroids_follow_the_documented_rule() {
    for (lengths, heads, clusters, seed) in [
        (vec![5, 3], 2, 4, 0),
        (vec![100, 37, 1], 3, 8, 17),
        (vec![4099], 1, 200, 1000 + 4099),
    ] {
        assert_eq!(
            initial_centroid_positions(&lengths, heads, clusters, seed),
            initial_positions(&lengths, heads, clusters, seed),
            "lengths {lengths:?}, {heads} heads, C {clusters}, seed {seed}"
        );
    }
}

/// The K-means definition of `ClusteredAttentionBackend::hamming_kmeans`, with integer loops and
/// all `iterations` run: returns (assignments, counts) for one sequence's codes, and the first
/// round (from 0) whose update left every centroid unchanged, if one did.
pub(crate) fn kmeans_reference(
    codes: &[u32],
    n: usize,
    clusters: usize,
    iterations: usize,
    initial: &[i64],
) -> (Vec<i64>, Vec<i64>, Option<usize>) {
    let len = codes.len();
    let mut assignments = vec![-1i64; len];
    let mut counts = vec![0i64; clusters];
    if n <= clusters {
        for i in 0..n {
            assignments[i] = i as i64;
            counts[i] = 1;
        }
        return (assignments, counts, None);
    }
    let mut centroids: Vec<u32> = initial.iter().map(|&p| codes[p as usize]).collect();
    let assign = |centroids: &[u32], assignments: &mut [i64]| {
        for i in 0..n {
            let mut best = (u32::MAX, 0usize);
            for (c, centroid) in centroids.iter().enumerate() {
                let d = (codes[i] ^ centroid).count_ones();
                if d < best.0 {
                    best = (d, c);
                }
            }
            assignments[i] = best.1 as i64;
        }
    };
    let mut fixed_point = None;
    for round in 0..iterations {
        assign(&centroids, &mut assignments);
        let before = centroids.clone();
        for (c, centroid) in centroids.iter_mut().enumerate() {
            let members: Vec<u32> = (0..n)
                .filter(|&i| assignments[i] == c as i64)
                .map(|i| codes[i])
                .collect();
            for bit in 0..32 {
                let ones = members.iter().filter(|&&m| m >> bit & 1 == 1).count();
                let zeros = members.len() - ones;
                if ones > zeros {
                    *centroid |= 1 << bit;
                } else if zeros > ones {
                    *centroid &= !(1 << bit);
                }
            }
        }
        if centroids == before {
            fixed_point.get_or_insert(round);
        }
    }
    assign(&centroids, &mut assignments);
    for &a in &assignments[..n] {
        counts[a as usize] += 1;
    }
    (assignments, counts, fixed_point)
}

fn codes_tensor(codes: &[u32], dims: [usize; 3], device: &Device) -> Tensor<3, Int> {
    let values: Vec<i64> = codes.iter().map(|&c| c as i32 as i64).collect();
    Tensor::from_data(TensorData::new(values, dims), device)
}

/// Which implementation of the ops a test runs.
#[derive(Clone, Copy, Debug)]
pub enum Implementation {
    /// The backend's own (host loops on NdArray and Flex).
    Backend,
    /// The default bodies made of Burn tensor ops.
    Reference,
}

/// The K-means of `implementation` on `device`, whose backend is `X`.
#[allow(clippy::too_many_arguments)]
fn run<X: ClusteredAttentionBackend>(
    implementation: Implementation,
    device: &Device,
    codes: &[u32],
    dims: [usize; 3],
    query_lengths: Option<&[usize]>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (Vec<i64>, Vec<i64>) {
    let codes = codes_tensor(codes, dims, device);
    let query_lengths = query_lengths.map(|l| lengths(l, device));
    let (assignments, counts) = match implementation {
        Implementation::Backend => {
            let clusters = hamming_kmeans(codes, query_lengths, clusters, iterations, seed);
            (clusters.assignments, clusters.counts)
        }
        Implementation::Reference => {
            crate::defaults::hamming_kmeans::<X>(codes, query_lengths, clusters, iterations, seed)
        }
    };
    (host_ints(assignments), host_ints(counts))
}

/// The default bodies reproduce the loop reference bit for bit, with and without padding,
/// with more, as many and fewer valid queries than clusters. The 1500-query case reaches a
/// fixed point of the updates after a few rounds that change centroids and before its last
/// round (checked below), where an implementation may stop early.
fn kmeans_matches_reference<X: ClusteredAttentionBackend>(
    implementation: Implementation,
    device: &Device,
) {
    let mut rng = rng(21);
    let mut early_fixed_points = 0;
    for (len, clusters, iterations, bits) in [
        (50, 6, 10, 32),
        (37, 37, 3, 8),
        (64, 100, 10, 31),
        (80, 3, 0, 5),
        (90, 12, 4, 1),
        (1500, 40, 12, 32),
    ] {
        let (batch, heads) = (3, 2);
        let mask = if bits == 32 {
            u32::MAX
        } else {
            (1u32 << bits) - 1
        };
        let codes: Vec<u32> = (0..batch * heads * len)
            .map(|_| rng.random::<u32>() & mask)
            .collect();
        for query_lengths in [None, Some(vec![len, len / 2, 1])] {
            let seed = 1000 + len as u64;
            let (assignments, counts) = run::<X>(
                implementation,
                device,
                &codes,
                [batch, heads, len],
                query_lengths.as_deref(),
                clusters,
                iterations,
                seed,
            );
            let lens = query_lengths.clone().unwrap_or(vec![len; batch]);
            let initial = initial_positions(&lens, heads, clusters, seed);
            for b in 0..batch {
                for h in 0..heads {
                    let row = (b * heads + h) * len;
                    let (ea, ec, fixed_point) = kmeans_reference(
                        &codes[row..row + len],
                        lens[b],
                        clusters,
                        iterations,
                        &initial[(b * heads + h) * clusters..(b * heads + h + 1) * clusters],
                    );
                    assert_eq!(
                        assignments[row..row + len],
                        ea[..],
                        "assignments, L {len}, C {clusters}, batch {b}, head {h}"
                    );
                    assert_eq!(
                        counts[(b * heads + h) * clusters..(b * heads + h + 1) * clusters],
                        ec[..],
                        "counts"
                    );
                    let total: i64 = ec.iter().sum();
                    assert_eq!(total, lens[b] as i64, "counts must sum to the valid length");
                    if len == 1500 && fixed_point.is_some_and(|r| r >= 2 && r + 1 < iterations) {
                        early_fixed_points += 1;
                    }
                }
            }
        }
    }
    // 10 sequences of the 1500-query case have more valid queries than clusters: 6 without
    // query lengths, 4 with lengths 1500 and 750.
    assert!(
        early_fixed_points >= 8,
        "only {early_fixed_points} of the 10 sequences of 750 or 1500 queries reached a fixed \
         point between rounds 2 and 10: the case no longer tests stopping early"
    );
}

/// Hand-made case pinning the tie rules (8-bit codes, C = 2, one Lloyd iteration):
/// A = 0x00 and B = 0xFF are the initial centroids, X = 0x0F is at distance 4 from both and
/// must join cluster 0 (lowest index); cluster 0 = {A, X} then ties on bits 0–3 and must keep
/// 0x00, cluster 1 = {B, W = 0x1F} ties on bits 5–7 and must keep 0xFF. Expected: A, X → 0 and
/// B, W → 1. (Ties to the highest index would send X to 1; ties setting a bit would pull W
/// to cluster 0x0F; ties clearing a bit would pull X to 0x1F.)
fn kmeans_tie_rules<X: ClusteredAttentionBackend>(implementation: Implementation, device: &Device) {
    let (len, clusters, seed) = (4, 2, 5);
    let initial = initial_positions(&[len], 1, clusters, seed);
    let (pa, pb) = (initial[0] as usize, initial[1] as usize);
    let others: Vec<usize> = (0..len).filter(|&p| p != pa && p != pb).collect();
    let (px, pw) = (others[0], others[1]);
    let mut codes = vec![0u32; len];
    codes[pa] = 0x00;
    codes[pb] = 0xFF;
    codes[px] = 0x0F;
    codes[pw] = 0x1F;
    let (assignments, counts) = run::<X>(
        implementation,
        device,
        &codes,
        [1, 1, len],
        None,
        clusters,
        1,
        seed,
    );
    let mut expected = vec![0i64; len];
    expected[pb] = 1;
    expected[pw] = 1;
    assert_eq!(
        assignments, expected,
        "positions A {pa}, B {pb}, X {px}, W {pw}"
    );
    assert_eq!(counts, vec![2, 2]);

    // An empty cluster keeps its centroid: with A picked twice (clusters 0 and 1) and B third,
    // cluster 1 never wins a tie and stays empty; X ties three ways and joins cluster 0.
    let (len, clusters) = (5, 3);
    let initial = initial_positions(&[len], 1, clusters, seed);
    let mut codes = vec![0u32; len];
    codes[initial[0] as usize] = 0x00;
    codes[initial[1] as usize] = 0x00;
    codes[initial[2] as usize] = 0xFF;
    let others: Vec<usize> = (0..len)
        .filter(|p| !initial.contains(&(*p as i64)))
        .collect();
    codes[others[0]] = 0x0F;
    codes[others[1]] = 0x1F;
    let (assignments, counts) = run::<X>(
        implementation,
        device,
        &codes,
        [1, 1, len],
        None,
        clusters,
        3,
        seed,
    );
    let mut expected = vec![0i64; len];
    expected[initial[2] as usize] = 2;
    expected[others[1]] = 2;
    assert_eq!(assignments, expected);
    assert_eq!(counts, vec![3, 0, 2]);
}

/// Planted groups of codes (centres ≥ 16 bits apart, members ≤ 2 bits from their centre) are
/// recovered exactly when each group holds one initial centroid, and never mixed when there
/// are more clusters than groups.
fn kmeans_recovers_planted_groups<X: ClusteredAttentionBackend>(
    implementation: Implementation,
    device: &Device,
) {
    let centres: [u32; 4] = [0x0000_0000, 0xFFFF_0000, 0x0000_FFFF, 0xF0F0_F0F0];
    for (a, b) in [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)] {
        assert!((centres[a] ^ centres[b]).count_ones() >= 16);
    }
    let len = 120;
    let mut rng = rng(5);
    let group: Vec<usize> = (0..len).map(|i| (i * 5 + i / 7) % 4).collect();
    let codes: Vec<u32> = group
        .iter()
        .map(|&g| {
            let mut code = centres[g];
            for _ in 0..rng.random_range(0..=2) {
                code ^= 1 << rng.random_range(0..32);
            }
            code
        })
        .collect();
    // A seed whose initial centroids fall one in each group.
    let seed = (0..1000u64)
        .find(|&s| {
            let initial = initial_positions(&[len], 1, 4, s);
            let mut hit: Vec<usize> = initial.iter().map(|&p| group[p as usize]).collect();
            hit.sort();
            hit == [0, 1, 2, 3]
        })
        .expect("some seed covers the four groups");
    let (assignments, counts) = run::<X>(
        implementation,
        device,
        &codes,
        [1, 1, len],
        None,
        4,
        10,
        seed,
    );
    for i in 0..len {
        for j in 0..len {
            assert_eq!(
                group[i] == group[j],
                assignments[i] == assignments[j],
                "queries {i} and {j}"
            );
        }
    }
    assert_eq!(counts.iter().sum::<i64>(), len as i64);

    for seed in 0..5 {
        let (assignments, _) = run::<X>(
            implementation,
            device,
            &codes,
            [1, 1, len],
            None,
            9,
            10,
            seed,
        );
        for i in 0..len {
            for j in 0..len {
                if assignments[i] == assignments[j] {
                    assert_eq!(
                        group[i], group[j],
                        "seed {seed}: cluster {} mixes groups",
                        assignments[i]
                    );
                }
            }
        }
    }
}

/// Codes (of the backend's `lsh_hash` or of the default body) against a plain-loop hash on
/// dyadic inputs (exact in f32 whatever the summation order), for every bit count class and
/// with and without the bias column.
fn lsh_hash_matches_reference<X: ClusteredAttentionBackend>(
    implementation: Implementation,
    device: &Device,
) {
    let (batch, heads, len, dim) = (2, 3, 17, 8);
    let mut rng = rng(8);
    let queries: Vec<f32> = (0..batch * heads * len * dim)
        .map(|_| rng.random_range(-64i32..64) as f32 / 16.0)
        .collect();
    for (bits, hash_bias) in [(1, true), (8, false), (31, true), (32, true), (32, false)] {
        let planes = lsh_planes(bits, dim, hash_bias, 3, device);
        // Round the planes to multiples of 1/64 so every projection is exact.
        let planes = planes.mul_scalar(64.0).round().div_scalar(64.0);
        let host_planes: Vec<f32> = planes.clone().into_data().iter::<f32>().collect();
        let q = Tensor::<4>::from_data(
            TensorData::new(queries.clone(), [batch, heads, len, dim]),
            device,
        );
        let codes = match implementation {
            Implementation::Backend => lsh_hash(q, planes),
            Implementation::Reference => crate::defaults::lsh_hash::<X>(q, planes),
        };
        let codes: Vec<u32> = host_ints(codes).iter().map(|&c| c as i32 as u32).collect();
        for (n, &code) in codes.iter().enumerate() {
            let mut expected = 0u32;
            for b in 0..bits {
                let plane = &host_planes[b * (dim + 1)..(b + 1) * (dim + 1)];
                let projection: f64 = (0..dim)
                    .map(|e| queries[n * dim + e] as f64 * plane[e] as f64)
                    .sum();
                if projection > plane[dim] as f64 {
                    expected |= 1 << b;
                }
            }
            assert_eq!(code, expected, "bits {bits}, bias {hash_bias}, query {n}");
        }
        if !hash_bias {
            assert!(host_planes.chunks(dim + 1).all(|p| p[dim] == 0.0));
        }
    }
}

macro_rules! kmeans_tests {
    ($module:ident, $backend:ty, $device:expr, $implementation:expr) => {
        mod $module {
            use super::Implementation;
            #[test]
            fn kmeans_matches_reference() {
                super::kmeans_matches_reference::<$backend>($implementation, &$device);
            }
            #[test]
            fn kmeans_tie_rules() {
                super::kmeans_tie_rules::<$backend>($implementation, &$device);
            }
            #[test]
            fn kmeans_recovers_planted_groups() {
                super::kmeans_recovers_planted_groups::<$backend>($implementation, &$device);
            }
            #[test]
            fn lsh_hash_matches_reference() {
                super::lsh_hash_matches_reference::<$backend>($implementation, &$device);
            }
        }
    };
}

// The default bodies (Burn tensor ops) and the host loops of NdArray and Flex; `$backend` is the
// backend of `$device`, whose default bodies `Implementation::Reference` calls.
kmeans_tests!(
    reference_ndarray,
    crate::common::NdArrayBackend,
    crate::common::ndarray(),
    Implementation::Reference
);
kmeans_tests!(
    ndarray,
    crate::common::NdArrayBackend,
    crate::common::ndarray(),
    Implementation::Backend
);
kmeans_tests!(
    flex,
    crate::common::FlexBackend,
    crate::common::flex(),
    Implementation::Backend
);
