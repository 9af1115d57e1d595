//! Grouping the queries: LSH hashing followed by K-means in Hamming space (paper §3.2.2).

use burn::config::Config;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use rand::SeedableRng;
use rand::rngs::Xoshiro256PlusPlus;
use rand_distr::{Distribution, StandardNormal};

use crate::ClusteringBackend;
use crate::ops::reference::check_bits;

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

/// The result of clustering the queries of every `(batch, head)`.
#[derive(Debug, Clone)]
pub struct Clusters<B: Backend> {
    /// Cluster of each query, `[batch, heads, L]`, in `0..C`; `-1` for padded queries.
    pub assignments: Tensor<B, 3, Int>,
    /// Number of valid queries in each cluster, `[batch, heads, C]`.
    pub counts: Tensor<B, 3, Int>,
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

/// Hashes the queries: bit `b` of a code is set when `q · planes[b, ..E] > planes[b, E]`.
/// See [`ClusteringBackend::lsh_hash`]. Carries no gradient.
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `planes`: `[bits, E + 1]`
/// - output: `[batch, heads, L]`, 32-bit codes (read as `u32`)
///
/// # Panics
/// If `bits` is outside `1..=32` or `planes` does not have `E + 1` columns.
pub fn lsh_hash<B: ClusteringBackend>(
    queries: Tensor<B, 4>,
    planes: Tensor<B, 2>,
) -> Tensor<B, 3, Int> {
    let planes = planes.cast(queries.dtype());
    Tensor::from_primitive(B::lsh_hash(
        queries.into_primitive().tensor(),
        planes.into_primitive().tensor(),
    ))
}

/// K-means in Hamming space over the codes of the valid queries.
/// See [`ClusteringBackend::hamming_kmeans`] for the exact definition.
///
/// # Shapes
/// - `codes`: `[batch, heads, L]`
/// - `query_lengths`: `[batch]`
/// - output: [`Clusters`] with assignments `[batch, heads, L]` and counts `[batch, heads, C]`
///
/// # Panics
/// If `clusters` is 0 or a query length is outside `0..=L`.
pub fn hamming_kmeans<B: ClusteringBackend>(
    codes: Tensor<B, 3, Int>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> Clusters<B> {
    let (assignments, counts) = B::hamming_kmeans(
        codes.into_primitive(),
        query_lengths.map(Tensor::into_primitive),
        clusters,
        iterations,
        seed,
    );
    Clusters {
        assignments: Tensor::from_primitive(assignments),
        counts: Tensor::from_primitive(counts),
    }
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
pub fn cluster_queries<B: ClusteringBackend>(
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
