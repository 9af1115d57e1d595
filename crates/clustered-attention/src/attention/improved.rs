use burn::tensor::{DType, Int, Tensor};

use super::{
    AttentionInput, AttentionOptions, attention_options_builders, clustering_builders, dropout,
    inverse_counts, top_keys,
};
use crate::clustering::{ClusteringOptions, cluster_queries};
use crate::ops::grouping::QueryGroups;
use crate::ops::tensor::rest_weights;
use crate::ops::{attention_softmax, improved_attention, sparse_dot, sparse_weighted_sum};

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
    /// tensor is not `[batch]`, a length exceeds its sequence, a key length is 0, `clusters` or
    /// `topk` is 0, or `bits` is outside `1..=32`.
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        let (clustering, topk, options) = (&self.clustering, self.topk, &self.options);
        assert!(topk > 0, "topk must be at least 1, got 0");
        clustering.check();
        let (queries, keys, values, input) = input.checked(options);
        let clusters = cluster_queries(queries.clone(), input.query_lengths.clone(), clustering);
        // Dropout applies only under autodiff; without it, one op serves both passes.
        if options.dropout == 0.0 || !queries.device().is_autodiff() {
            // Eqs. 3–5 and 9–11: the centroids, their attention with each cluster's top-k keys
            // T_j, the mass m̂_j (eq. 9) and the rest of Aᶜ V (eq. 10, second case), then each
            // query's exact dot products with T_j, softmaxed over T_j, scaled by m̂_j (eq. 10).
            let k = topk.min(keys.dims()[2]);
            let inverse_counts = inverse_counts(clusters.counts, queries.dtype());
            return improved_attention(
                queries,
                keys,
                values,
                clusters.assignments,
                inverse_counts,
                input.batch_key_lengths(),
                k,
                input.scale,
            );
        }
        let (num_clusters, dtype) = (clusters.counts.dims()[2], queries.dtype());
        let grouping = QueryGroups::new(clusters.assignments, num_clusters, dtype);
        let assignments = grouping.assignments();

        // With dropout, which masks the weights between the softmaxes and the products, step by
        // step. Centroids (eq. 3), scaled: C × E products instead of C × S.
        let centroids = grouping
            .centroids(queries.clone(), inverse_counts(clusters.counts, dtype))
            .mul_scalar(input.scale);
        // Centroid attention Aᶜ (eq. 4), [batch, heads, C, S]; per cluster the top-k keys,
        // [batch, heads, C, k], their mass m̂ (eq. 9), [batch, heads, C, 1], and the rest of Aᶜ V,
        // the keys outside the top-k keeping Aᶜ (eq. 10, second case), [batch, heads, C, D].
        let scores = input.mask_keys(centroids.matmul(keys.clone().swap_dims(2, 3)));
        let weights = attention_softmax(scores.clone());
        // Ranking by score ranks by Aᶜ.
        let top = top_keys(scores, topk);
        let top_mass = weights.clone().gather(3, top.clone()).sum_dim(3);
        let weights = dropout(weights, options.dropout);
        let top_weights = weights.clone().gather(3, top.clone());
        let rest_values = if matches!(weights.dtype(), DType::F16 | DType::BF16) {
            // Subtracting the top-k share from Aᶜ V would cancel when the top-k mass is near
            // 1 and lose most of the rest's 8 or 11 bits.
            rest_weights(weights, top.clone(), top_weights).matmul(values.clone())
        } else {
            weights.matmul(values.clone()) - top_share(&grouping, top_weights, &values, &top)
        };

        // Top-k keys: exact dot products per query, softmaxed over T_j and scaled by m̂_j (eq. 10).
        // A cluster's top-k holds padded keys only when the sequence has fewer than k keys.
        let mut top_scores =
            sparse_dot(queries, keys, top.clone(), assignments.clone()).mul_scalar(input.scale);
        if let Some(lengths) = &input.key_lengths {
            let padded = top
                .clone()
                .greater_equal(lengths.clone().expand(top.dims()));
            let bias = Tensor::<4>::zeros(top.dims(), (&top.device(), top_scores.dtype()))
                .mask_fill(padded, f32::NEG_INFINITY);
            top_scores = top_scores + grouping.broadcast(bias);
        }
        let query_mass = grouping.broadcast(top_mass); // [batch, heads, L, 1]
        let top_attention = dropout(attention_softmax(top_scores) * query_mass, options.dropout);
        let top_output = sparse_weighted_sum(top_attention, values, top, assignments);

        // eq. 11: Aᵗ V = top-k part + the rest of the cluster's attention (padded rows are zero).
        top_output + grouping.broadcast(rest_values)
    }
}

/// The top-k keys' share of each cluster's `Aᶜ V`, `[batch, heads, C, D]`: subtracted from all
/// of `Aᶜ V` it leaves the rest without a second `[C, S]` tensor. The cancellation costs at
/// most a few `f32` roundings of `|Aᶜ V|`, below the output's own in practice.
fn top_share(
    grouping: &QueryGroups,
    top_weights: Tensor<4>,
    values: &Tensor<4>,
    top: &Tensor<4, Int>,
) -> Tensor<4> {
    sparse_weighted_sum(
        top_weights,
        values.clone(),
        top.clone(),
        grouping.cluster_rows(),
    )
}
