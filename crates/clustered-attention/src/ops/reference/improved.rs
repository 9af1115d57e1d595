//! Default bodies of [`ClusteredAttentionBackend::improved_attention`], its forward with the
//! intermediate results and its backward: compositions of the backend's ops.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorMetadata};

use super::{float_out, float4};
use crate::ops::checks::check_query_clusters;
use crate::ops::grouping::QueryGroups;
use crate::ops::{
    AttentionGrads, ClusterTop, ClusteredAttentionBackend, ImprovedForward, QueryClusters,
};

/// Default body of [`ClusteredAttentionBackend::improved_attention`]:
/// [`improved_attention_forward`]'s output.
pub fn improved_attention<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
    scale: f64,
) -> FloatTensor<B> {
    improved_attention_forward::<B>(queries, keys, values, clusters, key_lengths, topk, scale).0
}

/// [`ClusteredAttentionBackend::improved_attention`] composed of the backend's ops, with the
/// intermediate results its backward pass takes: the centroids (the members' sums by
/// [`ClusteredAttentionBackend::sparse_scatter`], times the inverse counts) times `scale`, their
/// [`ClusteredAttentionBackend::centroid_attention`] with the top-k keys, the top-k weights' sum
/// (the mass) and [`ClusteredAttentionBackend::top_attention`].
///
/// # Panics
/// As [`ClusteredAttentionBackend::improved_attention`].
pub fn improved_attention_forward<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
    scale: f64,
) -> (FloatTensor<B>, ImprovedForward<B>) {
    assert!(topk > 0, "topk must be at least 1, got 0");
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let groups = QueryGroups::<B>::new(
        Tensor::from_primitive(clusters.assignments.clone()),
        num_clusters,
        queries.dtype(),
    );
    let centroids = groups
        .centroids(
            float4::<B>(queries.clone()),
            float4::<B>(clusters.inverse_counts),
        )
        .mul_scalar(scale);
    let centroids = float_out(centroids);
    let attention = B::centroid_attention(
        centroids.clone(),
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
    );
    let (top, top_weights) = attention.top.clone().expect("topk ≥ 1 gives the top-k");
    let mass = float_out(float4::<B>(top_weights).sum_dim(3));
    let output = B::top_attention(
        queries,
        keys,
        values,
        ClusterTop {
            assignments: clusters.assignments,
            topk: top,
            mass: mass.clone(),
            rest: attention.values.clone(),
        },
        key_lengths,
        scale,
    );
    let forward = ImprovedForward {
        centroids,
        centroid_attention: attention,
        mass,
    };
    (output, forward)
}

/// Default body of [`ClusteredAttentionBackend::improved_attention_backward`]:
/// [`ClusteredAttentionBackend::top_attention_backward`],
/// [`ClusteredAttentionBackend::centroid_attention_backward`] of the rest's gradient and of the
/// mass's spread over the top-k weights, the centroids' gradient spread to their member queries by
/// [`ClusteredAttentionBackend::sparse_weighted_sum`], and the sums of the gradients.
///
/// # Panics
/// As [`ClusteredAttentionBackend::improved_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    forward: ImprovedForward<B>,
    grad: FloatTensor<B>,
) -> AttentionGrads<B> {
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let ImprovedForward {
        centroids,
        centroid_attention,
        mass,
    } = forward;
    let (top, top_weights) = centroid_attention
        .top
        .clone()
        .expect("the forward pass of improved attention has the top-k");
    let top_grads = B::top_attention_backward(
        queries.clone(),
        keys.clone(),
        values.clone(),
        ClusterTop {
            assignments: clusters.assignments.clone(),
            topk: top,
            mass,
            rest: centroid_attention.values.clone(),
        },
        key_lengths.clone(),
        scale,
        grad,
    );
    // m̂ is the sum of the top-k weights: each weight gets the mass's gradient.
    let grad_top_weights = float4::<B>(top_grads.mass).expand(top_weights.shape().dims::<4>());
    let centroid_grads = B::centroid_attention_backward(
        centroids,
        keys,
        values,
        key_lengths,
        centroid_attention,
        top_grads.rest,
        Some(float_out(grad_top_weights)),
    );
    let grad_sums = float4::<B>(centroid_grads.centroids)
        * float4::<B>(clusters.inverse_counts).mul_scalar(scale);
    let groups = QueryGroups::<B>::new(
        Tensor::from_primitive(clusters.assignments),
        num_clusters,
        queries.dtype(),
    );
    let grad_queries = float_out(groups.broadcast(grad_sums));
    AttentionGrads {
        queries: float_out(float4::<B>(top_grads.queries) + float4::<B>(grad_queries)),
        keys: float_out(float4::<B>(top_grads.keys) + float4::<B>(centroid_grads.keys)),
        values: float_out(float4::<B>(top_grads.values) + float4::<B>(centroid_grads.values)),
    }
}
