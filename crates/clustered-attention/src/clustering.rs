//! Grouping the queries: LSH hashing followed by K-means in Hamming space (paper §3.2.2),
//! with the options of both and the hashing planes; the two ops themselves are
//! [`lsh_hash`] and [`hamming_kmeans`].

use burn::config::Config;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};

use crate::ClusteredAttentionBackend;
use crate::ops::checks::check_bits;
pub use crate::ops::{Clusters, hamming_kmeans, lsh_hash};

/// How the queries are grouped into clusters.
///
/// Defaults follow the reference implementation (fast-transformers): 10 Lloyd iterations,
/// hashing with a bias term; `bits` is 32 so that a code is one `u32` word.
#[derive(Config, Debug, PartialEq)]
pub struct ClusteringOptions {
    /// Number of clusters `C` per sequence and head (`≥ 1`). When a sequence has no more
    /// valid queries than `C`, each query is its own cluster and the attention is exact.
    pub clusters: usize,
    /// Number of hash bits `B`, in `1..=32`.
    #[config(default = 32)]
    pub bits: usize,
    /// Number of Lloyd iterations of the Hamming K-means.
    #[config(default = 10)]
    pub iterations: usize,
    /// With a random threshold per plane the Hamming distance tracks the L2 distance between
    /// queries; without it (threshold 0) it tracks their cosine distance.
    #[config(default = true)]
    pub hash_bias: bool,
    /// Seed of the hyperplanes and of the initial centroids: the same seed gives
    /// bit-identical clusters, run after run.
    #[config(default = 0)]
    pub seed: u64,
}

impl ClusteringOptions {
    /// Checks the options.
    ///
    /// # Panics
    /// If `clusters` is 0 or `bits` is outside `1..=32`.
    pub fn check(&self) {
        assert!(self.clusters > 0, "clusters must be at least 1, got 0");
        check_bits(self.bits);
    }
}

/// Random hyperplanes for [`lsh_hash`], drawn on the host from a standard normal with a
/// [`Xoshiro256PlusPlus`] generator seeded by `seed`, so every backend hashes with the same
/// planes. Columns `0..dim` are the plane normals, column `dim` the thresholds (zero when
/// `hash_bias` is false), as in the sign-of-random-projections hash of the paper (§3.2.2).
///
/// # Shapes
/// Returns `[bits, dim + 1]` in the default float dtype of `device`.
///
/// # Panics
/// If `bits` is outside `1..=32`.
pub fn lsh_planes<B: Backend>(
    bits: usize,
    dim: usize,
    hash_bias: bool,
    seed: u64,
    device: &B::Device,
) -> Tensor<B, 2> {
    check_bits(bits);
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(seed);
    let mut values: Vec<f32> = (0..bits * (dim + 1))
        .map(|_| StandardNormal.sample(&mut rng))
        .collect();
    if !hash_bias {
        for row in values.chunks_mut(dim + 1) {
            row[dim] = 0.0;
        }
    }
    Tensor::from_data(TensorData::new(values, [bits, dim + 1]), device)
}

/// Hashes and clusters the queries with the given options (paper §3.2.2).
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `query_lengths`: `[batch]`
/// - output: [`Clusters`] with assignments `[batch, heads, L]` and counts `[batch, heads, C]`
///
/// # Panics
/// If the options are invalid ([`ClusteringOptions::check`]) or a query length is outside
/// `0..=L`.
pub fn cluster_queries<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    options: &ClusteringOptions,
) -> Clusters<B> {
    options.check();
    let [_, _, _, dim] = queries.dims();
    let planes = lsh_planes::<B>(
        options.bits,
        dim,
        options.hash_bias,
        options.seed,
        &queries.device(),
    );
    let codes = lsh_hash(queries.detach(), planes);
    hamming_kmeans(
        codes,
        query_lengths,
        options.clusters,
        options.iterations,
        options.seed,
    )
}
