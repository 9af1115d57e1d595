//! Default bodies of [`ClusteredAttentionBackend::top_attention`] and its backward.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorMetadata};

use super::{float_out, float4, padded_keys};
use crate::ops::checks::check_top_attention;
use crate::ops::grouping::QueryGroups;
use crate::ops::{ClusterTop, ClusteredAttentionBackend, TopAttentionGrads};

/// Default body of [`ClusteredAttentionBackend::top_attention`]: the top-k scores by
/// [`ClusteredAttentionBackend::sparse_dot`], the padded keys' `-inf` and the mass of each query's
/// cluster, [`ClusteredAttentionBackend::attention_softmax`],
/// [`ClusteredAttentionBackend::sparse_weighted_sum`] and the cluster's `rest` row, each query's
/// cluster's rows handed to it by the query grouping's broadcast (zero for padded queries).
///
/// # Panics
/// If the shapes disagree.
pub fn top_attention<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
) -> FloatTensor<B> {
    let assignments = Tensor::<B, 3, Int>::from_primitive(clusters.assignments);
    let topk = Tensor::<B, 4, Int>::from_primitive(clusters.topk);
    let (mass, rest) = (float4::<B>(clusters.mass), float4::<B>(clusters.rest));
    let [batch, heads, _, _] = queries.shape().dims();
    let [_, _, keys_len, dim_v] = values.shape().dims();
    check_top_attention(
        queries.shape().dims(),
        keys.shape().dims(),
        [batch, heads, keys_len, dim_v],
        assignments.dims(),
        topk.dims(),
        mass.dims(),
        rest.dims(),
    );
    let groups = QueryGroups::new(assignments.clone(), topk.dims()[2], queries.dtype());
    let weights = top_softmax::<B>(queries, keys, &topk, &groups, key_lengths, scale)
        * groups.broadcast(mass);
    let top = B::sparse_weighted_sum(
        weights.into_primitive().tensor(),
        values,
        topk.into_primitive(),
        assignments.clone().into_primitive(),
    );
    float_out(float4::<B>(top) + groups.broadcast(rest))
}

/// Default body of [`ClusteredAttentionBackend::top_attention_backward`]: the softmax recomputed as
/// [`top_attention`] computes it, then the products of its gradient, each a sparse product or
/// a sum over each cluster's members (the query grouping's aggregate).
///
/// # Panics
/// If the shapes disagree.
pub fn top_attention_backward<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    grad: FloatTensor<B>,
) -> TopAttentionGrads<B> {
    let assignments = Tensor::<B, 3, Int>::from_primitive(clusters.assignments);
    let topk = Tensor::<B, 4, Int>::from_primitive(clusters.topk);
    let (mass, grad) = (float4::<B>(clusters.mass), float4::<B>(grad));
    let [batch, heads, len, _] = queries.shape().dims();
    let [_, _, keys_len, dim_v] = values.shape().dims();
    let num_clusters = topk.dims()[2];
    check_top_attention(
        queries.shape().dims(),
        keys.shape().dims(),
        [batch, heads, keys_len, dim_v],
        assignments.dims(),
        topk.dims(),
        mass.dims(),
        clusters.rest.shape().dims(),
    );
    assert!(
        grad.dims() == [batch, heads, len, dim_v],
        "grad {:?} must be [batch, heads, L, D] = {:?}",
        grad.dims(),
        [batch, heads, len, dim_v]
    );
    let padded = assignments.clone().lower_elem(0).unsqueeze_dim::<4>(3);
    let grad = grad.mask_fill(padded.expand([batch, heads, len, dim_v]), 0.0);
    let sparse = |x: Tensor<B, 4>| x.into_primitive().tensor();
    let groups = QueryGroups::new(assignments.clone(), num_clusters, queries.dtype());
    let probs = top_softmax::<B>(
        queries.clone(),
        keys.clone(),
        &topk,
        &groups,
        key_lengths,
        scale,
    );
    let query_mass = groups.broadcast(mass);
    // grad_i · values[t_r], [batch, heads, L, k] (zero for padded queries).
    let grad_weights = float4::<B>(B::sparse_dot(
        sparse(grad.clone()),
        values,
        topk.clone().into_primitive(),
        assignments.clone().into_primitive(),
    ));
    let delta = (grad_weights.clone() * probs.clone()).sum_dim(3);
    let grad_scores =
        (probs.clone() * (grad_weights - delta.clone()) * query_mass.clone()).mul_scalar(scale);
    let weights = probs * query_mass;
    let sparse_ints = || {
        (
            topk.clone().into_primitive(),
            assignments.clone().into_primitive(),
        )
    };
    let (t, a) = sparse_ints();
    let grad_queries = B::sparse_weighted_sum(sparse(grad_scores.clone()), keys, t, a);
    let (t, a) = sparse_ints();
    let grad_keys = B::sparse_scatter(sparse(grad_scores), queries, t, a, keys_len);
    let (t, a) = sparse_ints();
    let grad_values = B::sparse_scatter(sparse(weights), sparse(grad.clone()), t, a, keys_len);
    TopAttentionGrads {
        queries: grad_queries,
        keys: grad_keys,
        values: grad_values,
        mass: float_out(groups.aggregate(delta)),
        rest: float_out(groups.aggregate(grad)),
    }
}

/// Each query's softmax over its cluster's top-k keys (paper eq. 10 before the mass), `[batch,
/// heads, L, k]`: `scale · q · k` by [`ClusteredAttentionBackend::sparse_dot`], the padded keys at
/// `-inf`, [`ClusteredAttentionBackend::attention_softmax`]. Rows of padded queries are finite.
fn top_softmax<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: &Tensor<B, 4, Int>,
    groups: &QueryGroups<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
) -> Tensor<B, 4> {
    let mut scores = float4::<B>(B::sparse_dot(
        queries,
        keys,
        topk.clone().into_primitive(),
        groups.assignments().into_primitive(),
    ))
    .mul_scalar(scale);
    if let Some(lengths) = key_lengths {
        let padded = padded_keys(lengths, topk.clone());
        let bias = Tensor::<B, 4>::zeros(topk.dims(), (&scores.device(), scores.dtype()))
            .mask_fill(padded, f32::NEG_INFINITY);
        scores = scores + groups.broadcast(bias);
    }
    float4::<B>(B::attention_softmax(scores.into_primitive().tensor()))
}
