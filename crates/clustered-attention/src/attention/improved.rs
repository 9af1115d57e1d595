use burn::tensor::Tensor;

use super::{
    AttentionInput, AttentionOptions, HostLengths, attention_options_builders, clustering_builders,
    inverse_counts,
};
use crate::clustering::{ClusteringOptions, cluster_queries_host};
use crate::dropout::AttentionDropout;
use crate::ops::improved_attention;

/// Improved clustered attention (paper §3.3, eqs. 9–11).
///
/// Clusters the queries and computes the centroid attention `Aᶜ` as
/// [`ClusteredAttention`](super::ClusteredAttention) does. For each cluster `j` it then takes
/// the `topk` keys `T_j` with the highest centroid attention and their mass
/// `m̂_j = Σ_{l ∈ T_j} Aᶜ_{jl}` (eq. 9). Each query `i` of cluster `j` attends to `T_j` with
/// its own exact dot products, softmaxed over `T_j` and scaled by `m̂_j`, and to the other keys
/// with `Aᶜ_j` (eq. 10); the output is `Aᵗ V` (eq. 11). Padded keys are masked per sequence,
/// head and cluster. Costs `O(L · k · (E + D))` on top of clustered attention; the sparse
/// products are backend ops ([`crate::ops`]).
///
/// Proposition 2 of the paper holds: `‖Aᵗ_i − A_i‖₁ ≤ ‖Aᶜ_j − A_i‖₁` for every query. With
/// `topk ≥ S` the result equals [`FullAttention`](super::FullAttention), whatever `C`; so it
/// does when every sequence has no more valid queries than `C`.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionInput, ImprovedClusteredAttention};
///
/// let device = Device::default();
/// let q = Tensor::<4>::random([1, 2, 64, 8], Distribution::Default, &device);
/// let k = Tensor::<4>::random([1, 2, 50, 8], Distribution::Default, &device);
/// let v = Tensor::<4>::random([1, 2, 50, 3], Distribution::Default, &device);
/// // 8 clusters, 16 top keys per cluster.
/// let attention = ImprovedClusteredAttention::new(8, 16);
/// let out = attention.forward(AttentionInput::new(q, k, v));
/// assert_eq!(out.dims(), [1, 2, 64, 3]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ImprovedClusteredAttention {
    /// The clusters `C` and how the queries are hashed and grouped.
    pub clustering: ClusteringOptions,
    /// Keys `k ≥ 1` per cluster whose weights each query recomputes exactly (`min(k, S)` are
    /// used).
    pub topk: usize,
    /// The scale and the dropout.
    pub options: AttentionOptions,
}

impl ImprovedClusteredAttention {
    /// Improved clustered attention with `clusters` clusters (`C ≥ 1`) per sequence and head
    /// and `topk` keys recomputed per query (`k ≥ 1`), 32 hash bits, 10 Lloyd iterations,
    /// seed 0, the scale `1 / sqrt(E)` and no dropout.
    pub fn new(clusters: usize, topk: usize) -> Self {
        Self {
            clustering: ClusteringOptions::new(clusters),
            topk,
            options: AttentionOptions::new(),
        }
    }

    clustering_builders!();
    attention_options_builders!();

    /// The improved clustered attention of `input`'s queries on its keys and values.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`
    /// - `keys`: `[batch, heads, S, E]`
    /// - `values`: `[batch, heads, S, D]`
    /// - `query_lengths`, `key_lengths`: `[batch]`; padded keys get no attention, padded queries
    ///   join no cluster and their output rows are zero
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// If the shapes disagree (batch, heads, E of queries and keys, S of keys and values), a length
    /// tensor is not `[batch]`, a length exceeds its sequence, `clusters` or
    /// `topk` is 0, or `bits` is outside `1..=32`.
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        self.forward_host(input, &HostLengths::default())
    }

    /// [`Self::forward`] given the host copies of the input's lengths where the caller has
    /// them ([`HostLengths`]), which are then not read back.
    pub(crate) fn forward_host(&self, input: AttentionInput, host: &HostLengths) -> Tensor<4> {
        let (clustering, topk, options) = (&self.clustering, self.topk, &self.options);
        assert!(topk > 0, "topk must be at least 1, got 0");
        clustering.check();
        let (queries, keys, values, input) = input.checked(options, host);
        let clusters = cluster_queries_host(
            queries.clone(),
            input.query_lengths.clone(),
            input.query_host.as_deref(),
            clustering,
        );
        // Eqs. 3–5 and 9–11 in one op: the centroids, their attention with each cluster's top-k
        // keys T_j, the mass m̂_j (eq. 9) and the rest of Aᶜ V (eq. 10, second case), then each
        // query's exact dot products with T_j, softmaxed over T_j, scaled by m̂_j (eq. 10). Under
        // autodiff, both sets of weights are dropped inside it ([`AttentionDropout`]).
        let dropout = AttentionDropout::for_forward(options.dropout, &queries.device());
        let k = topk.min(keys.dims()[2]);
        let inverse_counts = inverse_counts(clusters.counts, queries.dtype());
        improved_attention(
            queries,
            keys,
            values,
            clusters.assignments,
            inverse_counts,
            input.batch_key_lengths(),
            k,
            input.scale,
            dropout,
        )
    }
}
