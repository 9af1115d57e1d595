//! The initial centroids of the Hamming K-means, drawn on the host so that every backend
//! starts from the same ones.

use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

#[cfg(doc)]
use super::ClusteredAttentionBackend;

/// Positions of the initial centroids of [`ClusteredAttentionBackend::hamming_kmeans`], drawn on
/// the host so that every backend starts from the same ones.
///
/// For each `(batch, head)` with `n = lengths[batch]` valid queries, a
/// [`Xoshiro256PlusPlus`] generator (`seed_from_u64`) seeded from `(seed, n, head)` draws
/// `clusters` distinct positions in `0..n` (Floyd's algorithm as implemented by
/// [`rand::seq::index::sample`]). When `n ≤ clusters` no k-means runs and the row holds
/// `0, 1, …, n − 1` followed by zeros.
///
/// The draw depends on the seed, the head and the sequence's valid length, never on the
/// sequence's place in the batch or on the batch's padding: a sequence gets the same clusters,
/// and so the same attention output, alone or batched with any others. (Sequences of the same
/// length and head draw the same positions.)
///
/// The generator's seed is SplitMix64's finaliser of
/// `z = seed ^ n · 0x9E3779B97F4A7C15 ^ head · 0xC2B2AE3D27D4EB4F` (wrapping products):
/// `z ← (z ^ z >> 30) · 0xBF58476D1CE4E5B9`, `z ← (z ^ z >> 27) · 0x94D049BB133111EB`,
/// `z ^ z >> 31`.
///
/// # Shapes
/// Returns `batch × heads × clusters` positions in row-major order.
pub fn initial_centroid_positions(
    lengths: &[usize],
    heads: usize,
    clusters: usize,
    seed: u64,
) -> Vec<i64> {
    let mut positions = Vec::with_capacity(lengths.len() * heads * clusters);
    for &n in lengths {
        for head in 0..heads {
            if n <= clusters {
                positions.extend((0..clusters).map(|c| if c < n { c as i64 } else { 0 }));
            } else {
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(stream_seed(seed, n, head));
                let picked = rand::seq::index::sample(&mut rng, n, clusters);
                positions.extend(picked.iter().map(|p| p as i64));
            }
        }
    }
    positions
}

/// Mixes `(seed, length, head)` into one 64-bit seed (SplitMix64 finaliser), so that each
/// head and sequence length draws from its own stream.
fn stream_seed(seed: u64, length: usize, head: usize) -> u64 {
    let mut z = seed
        ^ (length as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (head as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
