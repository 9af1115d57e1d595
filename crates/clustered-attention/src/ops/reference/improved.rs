//! Default bodies of [`ClusteredAttentionBackend::improved_attention`], its forward with the
//! intermediate results and its backward: compositions of the backend's ops.

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;

use super::device_ints;
use crate::dropout::AttentionDropout;
use crate::ops::checks::check_query_clusters;
use crate::ops::grouping::QueryGroups;
use crate::ops::{
    AttentionGrads, ClusteredAttentionBackend, ClusteredAttentionBackward, ImprovedForward,
    Lengths, QueryClusters, centroid_attention, top_attention,
};

/// Default body of [`ClusteredAttentionBackend::improved_attention`]: the centroids (the members'
/// sums by [`ClusteredAttentionBackend::sparse_scatter`], times the inverse counts) times
/// `scale`, their [`ClusteredAttentionBackend::centroid_attention`] with the top-k keys, the
/// top-k weights' sum (the mass) and [`ClusteredAttentionBackend::top_attention`]: the output of
/// [`improved_attention_forward`], from the backend's extension ops alone.
///
/// # Panics
/// As [`ClusteredAttentionBackend::improved_attention`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Lengths<B>,
    topk: usize,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> FloatTensor<B> {
    assert!(topk > 0, "topk must be at least 1, got 0");
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let (queries, keys, values) = (
        B::float_tensor::<4>(queries),
        B::float_tensor::<4>(keys),
        B::float_tensor::<4>(values),
    );
    let assignments = device_ints(B::int_tensor::<3>(clusters.assignments));
    let inverse_counts = B::float_tensor::<4>(clusters.inverse_counts);
    let key_lengths = key_lengths.into_option().map(B::int_tensor::<1>);
    let groups = QueryGroups::new(assignments.clone(), num_clusters, queries.dtype());
    let centroids = groups
        .centroids(queries.clone(), inverse_counts)
        .mul_scalar(scale);
    let (rest, top) = centroid_attention(
        centroids,
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
        dropout,
    );
    let (top, top_weights) = top.expect("topk ≥ 1 gives the top-k");
    let mass = top_weights.sum_dim(3);
    let output = top_attention(
        queries,
        keys,
        values,
        assignments,
        top,
        mass,
        rest,
        key_lengths,
        scale,
        dropout,
    );
    B::float_primitive(output)
}

/// [`ClusteredAttentionBackend::improved_attention`] composed of the backend's ops, with the
/// intermediate results its backward pass takes: the centroids (the members' sums by
/// [`ClusteredAttentionBackend::sparse_scatter`], times the inverse counts) times `scale`, their
/// [`ClusteredAttentionBackward::centroid_attention_forward`] with the top-k keys, the top-k
/// weights' sum (the mass) and [`ClusteredAttentionBackend::top_attention`].
///
/// # Panics
/// As [`ClusteredAttentionBackend::improved_attention`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_forward<B: ClusteredAttentionBackward>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Lengths<B>,
    topk: usize,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> (FloatTensor<B>, ImprovedForward<B>) {
    assert!(topk > 0, "topk must be at least 1, got 0");
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let groups = QueryGroups::new(
        device_ints(B::int_tensor::<3>(clusters.assignments.clone())),
        num_clusters,
        queries.dtype(),
    );
    let centroids = groups
        .centroids(
            B::float_tensor::<4>(queries.clone()),
            B::float_tensor::<4>(clusters.inverse_counts),
        )
        .mul_scalar(scale);
    let centroids = B::float_primitive(centroids);
    let attention = B::centroid_attention_forward(
        centroids.clone(),
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
        dropout,
    );
    let (_, top_weights) = attention.top.clone().expect("topk ≥ 1 gives the top-k");
    let mass = B::float_primitive(B::float_tensor::<4>(top_weights).sum_dim(3));
    let output = B::top_attention(
        queries,
        keys,
        values,
        attention.cluster_top(clusters.assignments, mass.clone()),
        key_lengths,
        scale,
        dropout,
    );
    let forward = ImprovedForward {
        centroids,
        centroid_attention: attention,
        mass,
    };
    (output, forward)
}

/// Default body of [`ClusteredAttentionBackward::improved_attention_backward`]:
/// [`ClusteredAttentionBackward::top_attention_backward`],
/// [`ClusteredAttentionBackward::centroid_attention_backward`] of the rest's gradient and of the
/// mass's spread over the top-k weights, the centroids' gradient spread to their member queries by
/// [`ClusteredAttentionBackend::sparse_weighted_sum`], and the sums of the gradients.
///
/// # Panics
/// As [`ClusteredAttentionBackward::improved_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<B: ClusteredAttentionBackward>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Lengths<B>,
    scale: f64,
    forward: ImprovedForward<B>,
    grad: FloatTensor<B>,
    dropout: Option<AttentionDropout>,
) -> AttentionGrads<B> {
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let dtype = queries.dtype();
    let ImprovedForward {
        centroids,
        centroid_attention,
        mass,
    } = forward;
    let (_, top_weights) = centroid_attention
        .top
        .clone()
        .expect("the forward pass of improved attention has the top-k");
    let top_grads = B::top_attention_backward(
        queries,
        keys.clone(),
        values.clone(),
        centroid_attention.cluster_top(clusters.assignments.clone(), mass),
        key_lengths.clone(),
        scale,
        grad,
        dropout,
    );
    // m̂ is the sum of the top-k weights: each weight gets the mass's gradient.
    let grad_top_weights =
        B::float_tensor::<4>(top_grads.mass).expand(top_weights.shape().dims::<4>());
    let centroid_grads = B::centroid_attention_backward(
        centroids,
        keys,
        values,
        key_lengths,
        centroid_attention,
        top_grads.rest,
        Some(B::float_primitive(grad_top_weights)),
        dropout,
    );
    let grad_sums = B::float_tensor::<4>(centroid_grads.centroids)
        * B::float_tensor::<4>(clusters.inverse_counts).mul_scalar(scale);
    let groups = QueryGroups::new(
        device_ints(B::int_tensor::<3>(clusters.assignments)),
        num_clusters,
        dtype,
    );
    let grad_queries = groups.broadcast(grad_sums);
    let float = B::float_tensor::<4>;
    AttentionGrads {
        queries: B::float_primitive(float(top_grads.queries) + grad_queries),
        keys: B::float_primitive(float(top_grads.keys) + float(centroid_grads.keys)),
        values: B::float_primitive(float(top_grads.values) + float(centroid_grads.values)),
    }
}
