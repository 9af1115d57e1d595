use burn::tensor::Tensor;

use super::{
    AttentionInput, AttentionOptions, HostLengths, attention_options_builders, clustering_builders,
    inverse_counts,
};
use crate::clustering::{ClusteringOptions, cluster_queries_host};
use crate::dropout::AttentionDropout;
use crate::ops::centroid_attention;
use crate::ops::grouping::QueryGroups;

/// Clustered attention (paper §3.2, eqs. 3–6).
///
/// The queries of each `(batch, head)` are hashed and grouped into `C` clusters
/// ([`cluster_queries`](crate::cluster_queries)); each centroid is the mean of its member
/// queries (eq. 3), attends to all keys (eqs. 4–5), and every query receives its cluster's
/// output (eq. 6). Costs `O(L · C · E + C · S · (E + D))` instead of `O(L · S · (E + D))`.
///
/// When a sequence has no more valid queries than `C`, each query is its own cluster and the
/// result equals [`FullAttention`](super::FullAttention). Gradients reach the queries through
/// the centroids, and the keys and values through the attention.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionInput, ClusteredAttention};
///
/// let device = Device::default();
/// let q = Tensor::<4>::random([1, 2, 64, 8], Distribution::Default, &device);
/// let k = Tensor::<4>::random([1, 2, 50, 8], Distribution::Default, &device);
/// let v = Tensor::<4>::random([1, 2, 50, 3], Distribution::Default, &device);
/// let out = ClusteredAttention::new(8).with_seed(7).forward(AttentionInput::new(q, k, v));
/// assert_eq!(out.dims(), [1, 2, 64, 3]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct ClusteredAttention {
    /// The clusters `C` and how the queries are hashed and grouped.
    pub clustering: ClusteringOptions,
    /// The scale and the dropout.
    pub options: AttentionOptions,
}

impl ClusteredAttention {
    /// Clustered attention with `clusters` clusters (`C ≥ 1`) per sequence and head, 32 hash
    /// bits, 10 Lloyd iterations, seed 0, the scale `1 / sqrt(E)` and no dropout.
    pub fn new(clusters: usize) -> Self {
        Self {
            clustering: ClusteringOptions::new(clusters),
            options: AttentionOptions::new(),
        }
    }

    clustering_builders!();
    attention_options_builders!();

    /// The clustered attention of `input`'s queries on its keys and values.
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
    /// tensor is not `[batch]`, a length exceeds its sequence, `clusters` is 0
    /// or `bits` is outside `1..=32`.
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        self.forward_host(input, &HostLengths::default())
    }

    /// [`Self::forward`] given the host copies of the input's lengths where the caller has
    /// them ([`HostLengths`]), which are then not read back.
    pub(crate) fn forward_host(&self, input: AttentionInput, host: &HostLengths) -> Tensor<4> {
        let (clustering, options) = (&self.clustering, &self.options);
        clustering.check();
        let (queries, keys, values, input) = input.checked(options, host);
        let clusters = cluster_queries_host(
            queries.clone(),
            input.query_lengths.clone(),
            input.query_host.as_deref(),
            clustering,
        );
        let (num_clusters, dtype) = (clusters.counts.dims()[2], queries.dtype());
        let groups = QueryGroups::new(clusters.assignments, num_clusters, dtype);

        // eq. 3, [batch, heads, C, E]; scaling the centroids rather than the scores: C × E
        // products instead of C × S.
        let centroids = groups
            .centroids(queries, inverse_counts(clusters.counts, dtype))
            .mul_scalar(input.scale);
        // Eqs. 4–5 in one op; under autodiff, with the dropout of the centroids' weights drawn
        // inside it ([`AttentionDropout`]).
        let dropout = AttentionDropout::for_forward(options.dropout, &centroids.device());
        let key_lengths = input.batch_key_lengths();
        let cluster_values = centroid_attention(centroids, keys, values, key_lengths, 0, dropout).0;
        groups.broadcast(cluster_values) // eq. 6
    }
}
