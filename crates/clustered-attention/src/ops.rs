//! The backend extension trait holding the two non-differentiable clustering ops.
//!
//! Clustered attention (Vyas et al., 2020, §3.2.2) groups the queries in two steps:
//! [`lsh_hash`](ClusteringBackend::lsh_hash) turns each query into a `bits`-bit code with
//! random hyperplanes, and [`hamming_kmeans`](ClusteringBackend::hamming_kmeans) runs Lloyd's
//! algorithm on those codes in Hamming space. Both ops produce integer tensors and carry no
//! gradient; everything differentiable (centroids, attention, top-k, broadcast) is made of
//! ordinary Burn tensor ops in [`crate::attention`].
//!
//! The default method bodies ([`reference`](mod@reference)) are Burn tensor ops, so every backend gets a
//! working implementation by writing `impl ClusteringBackend for MyBackend {}`. They are the
//! specification: any other implementation must reproduce their codes, assignments and counts
//! bit for bit.

pub mod reference;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;

/// Largest number of hash bits: codes are read as `u32` (WGSL has no 64-bit integers).
pub const MAX_BITS: usize = 32;

/// Marker stored in `assignments` for a padded query (position ≥ its sequence's length).
pub const NO_CLUSTER: i64 = -1;

/// A backend that can hash queries and cluster their codes.
///
/// Both methods have default bodies made of Burn tensor ops ([`reference`](mod@reference)); a backend may
/// override them with custom kernels but must then reproduce the default bodies bit for bit.
pub trait ClusteringBackend: Backend {
    /// Hashes every query with random hyperplanes (sign of random projections, paper §3.2.2).
    ///
    /// Bit `b` of the code of a query `q` is set when `q · planes[b, ..E] > planes[b, E]`,
    /// i.e. when the projection of the query on plane `b` exceeds that plane's threshold.
    /// The codes are 32-bit words stored in the backend's int type as the `i32` two's
    /// complement pattern; read them as `u32` (`code as i32 as u32`). Bits `≥ bits` are zero.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`
    /// - `planes`: `[bits, E + 1]`, the last column being the thresholds
    /// - output codes: `[batch, heads, L]`
    ///
    /// # Panics
    /// If `bits` is 0 or above [`MAX_BITS`], or `planes` does not have `E + 1` columns.
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        reference::lsh_hash::<Self>(queries, planes)
    }

    /// K-means in Hamming space over the codes of the valid queries (paper §3.2.2).
    ///
    /// The one definition every backend reproduces bit for bit, per `(batch, head)` with
    /// `n` valid queries (positions `< query_lengths[batch]`, all `L` when `None`):
    /// - if `n ≤ clusters`, query `i` is alone in cluster `i` (so clustered attention equals
    ///   full attention) and k-means does not run;
    /// - otherwise the initial centroids are the codes of `clusters` distinct valid positions
    ///   drawn by [`initial_centroid_positions`] from `seed`;
    /// - an assignment step gives each valid query the centroid nearest in Hamming distance
    ///   (popcount of xor), ties going to the lowest cluster index;
    /// - an update step sets each centroid bit to the majority of its members' bits; an exact
    ///   tie keeps the previous bit, so an empty cluster keeps its previous centroid;
    /// - exactly `iterations` (assign, update) rounds run, then a final assignment.
    ///
    /// Padded queries belong to no cluster: their assignment is [`NO_CLUSTER`] (`-1`).
    ///
    /// # Shapes
    /// - `codes`: `[batch, heads, L]`, 32-bit codes as produced by [`Self::lsh_hash`]
    /// - `query_lengths`: `[batch]`, each in `0..=L`
    /// - output `assignments`: `[batch, heads, L]`, in `0..clusters` or `-1`
    /// - output `counts`: `[batch, heads, clusters]`, summing to `query_lengths[batch]`
    ///
    /// # Panics
    /// If `clusters` is 0, if `query_lengths` is not `[batch]`, or a length is negative or
    /// greater than `L`.
    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        reference::hamming_kmeans::<Self>(codes, query_lengths, clusters, iterations, seed)
    }
}

/// Positions of the initial centroids of [`ClusteringBackend::hamming_kmeans`], drawn on the
/// host so that every backend starts from the same ones.
///
/// For each `(batch, head)` with `n = lengths[batch]` valid queries, a
/// [`Xoshiro256PlusPlus`] generator seeded from `(seed, batch, head)` draws `clusters`
/// distinct positions in `0..n` (Floyd's algorithm as implemented by
/// [`rand::seq::index::sample`]). When `n ≤ clusters` no k-means runs and the row holds
/// `0, 1, …, n − 1` followed by zeros.
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
    for (batch, &n) in lengths.iter().enumerate() {
        for head in 0..heads {
            if n <= clusters {
                positions.extend((0..clusters).map(|c| if c < n { c as i64 } else { 0 }));
            } else {
                let mut rng = Xoshiro256PlusPlus::seed_from_u64(stream_seed(seed, batch, head));
                let picked = rand::seq::index::sample(&mut rng, n, clusters);
                positions.extend(picked.iter().map(|p| p as i64));
            }
        }
    }
    positions
}

/// Mixes `(seed, batch, head)` into one 64-bit seed (SplitMix64 finaliser), so that each
/// sequence and head draws from its own stream.
fn stream_seed(seed: u64, batch: usize, head: usize) -> u64 {
    let mut z = seed
        ^ (batch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (head as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Reads `query_lengths` to the host and checks it against the codes' shape.
///
/// Returns one length per batch item (all `seq_len` when `None`).
///
/// # Panics
/// If `query_lengths` is not `[batch]` or holds a length outside `0..=seq_len`.
pub(crate) fn host_lengths<B: Backend>(
    name: &str,
    lengths: Option<burn::tensor::Tensor<B, 1, burn::tensor::Int>>,
    batch: usize,
    seq_len: usize,
) -> Vec<usize> {
    let Some(lengths) = lengths else {
        return vec![seq_len; batch];
    };
    let dims = lengths.dims();
    assert!(
        dims == [batch],
        "{name} must have shape [batch] = [{batch}], got {dims:?}"
    );
    let data = lengths.into_data();
    data.iter::<i64>()
        .enumerate()
        .map(|(b, len)| {
            assert!(
                (0..=seq_len as i64).contains(&len),
                "{name}[{b}] = {len} is outside 0..={seq_len} (the sequence length)"
            );
            len as usize
        })
        .collect()
}
