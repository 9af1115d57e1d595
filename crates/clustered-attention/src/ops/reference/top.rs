//! Default bodies of [`ClusteredAttentionBackend::top_attention`] and its backward.

use burn::backend::tensor::FloatTensor;
use burn::tensor::{Int, Tensor};

use super::{device_ints, dropout_factors, padded_keys};
use crate::dropout::AttentionDropout;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackward;
use crate::ops::checks::check_top_attention;
use crate::ops::grouping::QueryGroups;
use crate::ops::{
    ClusterTop, ClusteredAttentionBackend, Lengths, TopAttentionGrads, attention_softmax,
    sparse_dot, sparse_scatter, sparse_weighted_sum,
};

/// The top-k attention's inputs as tensors, the int ones in the device's int dtype: queries,
/// keys, values, assignments, top-k, mass, rest and key lengths.
type TopTensors = (
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Tensor<3, Int>,
    Tensor<4, Int>,
    Tensor<4>,
    Tensor<4>,
    Option<Tensor<1, Int>>,
);

/// The top-k attention's inputs as tensors ([`TopTensors`]), their shapes checked against each
/// other.
///
/// # Panics
/// If the shapes disagree.
fn top_tensors<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Lengths<B>,
) -> TopTensors {
    let (queries, keys, values) = (
        B::float_tensor::<4>(queries),
        B::float_tensor::<4>(keys),
        B::float_tensor::<4>(values),
    );
    let assignments = device_ints(B::int_tensor::<3>(clusters.assignments));
    let topk = device_ints(B::int_tensor::<4>(clusters.topk));
    let (mass, rest) = (
        B::float_tensor::<4>(clusters.mass),
        B::float_tensor::<4>(clusters.rest),
    );
    check_top_attention(
        queries.dims(),
        keys.dims(),
        values.dims(),
        assignments.dims(),
        topk.dims(),
        mass.dims(),
        rest.dims(),
    );
    let key_lengths = key_lengths.into_option().map(B::int_tensor::<1>);
    (
        queries,
        keys,
        values,
        assignments,
        topk,
        mass,
        rest,
        key_lengths,
    )
}

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
    key_lengths: Lengths<B>,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> FloatTensor<B> {
    let (queries, keys, values, assignments, topk, mass, rest, key_lengths) =
        top_tensors::<B>(queries, keys, values, clusters, key_lengths);
    let groups = QueryGroups::new(assignments.clone(), topk.dims()[2], queries.dtype());
    let mut weights =
        top_softmax(queries, keys, &topk, &groups, key_lengths, scale) * groups.broadcast(mass);
    if let Some(dropout) = &dropout {
        weights =
            weights.clone() * dropout_factors::<B>(dropout, AttentionDropout::QUERY_TOP, &weights);
    }
    let top = sparse_weighted_sum(weights, values, topk, assignments);
    B::float_primitive(top + groups.broadcast(rest))
}

/// Default body of [`ClusteredAttentionBackward::top_attention_backward`]: the softmax
/// recomputed as [`top_attention`] computes it, then the products of its gradient, each a
/// sparse product or a sum over each cluster's members (the query grouping's aggregate).
///
/// # Panics
/// If the shapes disagree.
#[allow(clippy::too_many_arguments)]
pub fn top_attention_backward<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Lengths<B>,
    scale: f64,
    grad: FloatTensor<B>,
    dropout: Option<AttentionDropout>,
) -> TopAttentionGrads<B> {
    // The rest is an input of the forward only: its gradient is the members' sum of `grad`.
    let (queries, keys, values, assignments, topk, mass, _, key_lengths) =
        top_tensors::<B>(queries, keys, values, clusters, key_lengths);
    let grad = B::float_tensor::<4>(grad);
    let [batch, heads, len, _] = queries.dims();
    let [_, _, keys_len, dim_v] = values.dims();
    let num_clusters = topk.dims()[2];
    assert!(
        grad.dims() == [batch, heads, len, dim_v],
        "grad {:?} must be [batch, heads, L, D] = {:?}",
        grad.dims(),
        [batch, heads, len, dim_v]
    );
    let padded = assignments.clone().lower_elem(0).unsqueeze_dim::<4>(3);
    let grad = grad.mask_fill(padded.expand([batch, heads, len, dim_v]), 0.0);
    let groups = QueryGroups::new(assignments.clone(), num_clusters, queries.dtype());
    let probs = top_softmax(
        queries.clone(),
        keys.clone(),
        &topk,
        &groups,
        key_lengths,
        scale,
    );
    let query_mass = groups.broadcast(mass);
    // grad_i · values[t_r], [batch, heads, L, k] (zero for padded queries).
    let mut grad_weights = sparse_dot(grad.clone(), values, topk.clone(), assignments.clone());
    // The same factors as the forward pass, on the weights and their gradient.
    let factors = dropout
        .as_ref()
        .map(|dropout| dropout_factors::<B>(dropout, AttentionDropout::QUERY_TOP, &probs));
    if let Some(factors) = &factors {
        grad_weights = grad_weights * factors.clone();
    }
    let delta = (grad_weights.clone() * probs.clone()).sum_dim(3);
    let grad_scores =
        (probs.clone() * (grad_weights - delta.clone()) * query_mass.clone()).mul_scalar(scale);
    let mut weights = probs * query_mass;
    if let Some(factors) = factors {
        weights = weights * factors;
    }
    let grad_queries =
        sparse_weighted_sum(grad_scores.clone(), keys, topk.clone(), assignments.clone());
    let grad_keys = sparse_scatter(
        grad_scores,
        queries,
        topk.clone(),
        assignments.clone(),
        keys_len,
    );
    let grad_values = sparse_scatter(weights, grad.clone(), topk, assignments, keys_len);
    TopAttentionGrads {
        queries: B::float_primitive(grad_queries),
        keys: B::float_primitive(grad_keys),
        values: B::float_primitive(grad_values),
        mass: B::float_primitive(groups.aggregate(delta)),
        rest: B::float_primitive(groups.aggregate(grad)),
    }
}

/// Each query's softmax over its cluster's top-k keys (paper eq. 10 before the mass), `[batch,
/// heads, L, k]`: `scale · q · k` by [`ClusteredAttentionBackend::sparse_dot`], the padded keys at
/// `-inf`, [`ClusteredAttentionBackend::attention_softmax`]. Rows of padded queries are finite.
fn top_softmax(
    queries: Tensor<4>,
    keys: Tensor<4>,
    topk: &Tensor<4, Int>,
    groups: &QueryGroups,
    key_lengths: Option<Tensor<1, Int>>,
    scale: f64,
) -> Tensor<4> {
    let mut scores =
        sparse_dot(queries, keys, topk.clone(), groups.assignments()).mul_scalar(scale);
    if let Some(lengths) = key_lengths {
        let padded = padded_keys(lengths, topk.clone());
        let bias = Tensor::<4>::zeros(topk.dims(), (&scores.device(), scores.dtype()))
            .mask_fill(padded, f32::NEG_INFINITY);
        scores = scores + groups.broadcast(bias);
    }
    attention_softmax(scores)
}
