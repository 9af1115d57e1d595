//! Default bodies of [`ClusteredAttentionBackend::top_attention`] and its backward.

use burn::backend::tensor::FloatTensor;
use burn::tensor::{Int, Tensor};

use super::{device_ints, padded_keys};
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackward;
use crate::ops::checks::check_top_attention;
use crate::ops::grouping::QueryGroups;
use crate::ops::{
    ClusterTop, ClusteredAttentionBackend, Lengths, TopAttentionGrads, attention_softmax,
    sparse_dot, sparse_scatter, sparse_weighted_sum,
};

/// The top-k attention's inputs as tensors (the int ones in the device's int dtype), their
/// shapes checked against each other.
struct TopInputs {
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    topk: Tensor<4, Int>,
    mass: Tensor<4>,
    rest: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
}

impl TopInputs {
    /// # Panics
    /// If the shapes disagree.
    fn new<B: ClusteredAttentionBackend>(
        queries: FloatTensor<B>,
        keys: FloatTensor<B>,
        values: FloatTensor<B>,
        clusters: ClusterTop<B>,
        key_lengths: Lengths<B>,
    ) -> Self {
        let inputs = Self {
            queries: B::float_tensor::<4>(queries),
            keys: B::float_tensor::<4>(keys),
            values: B::float_tensor::<4>(values),
            assignments: device_ints(B::int_tensor::<3>(clusters.assignments)),
            topk: device_ints(B::int_tensor::<4>(clusters.topk)),
            mass: B::float_tensor::<4>(clusters.mass),
            rest: B::float_tensor::<4>(clusters.rest),
            key_lengths: key_lengths.into_option().map(B::int_tensor::<1>),
        };
        check_top_attention(
            inputs.queries.dims(),
            inputs.keys.dims(),
            inputs.values.dims(),
            inputs.assignments.dims(),
            inputs.topk.dims(),
            inputs.mass.dims(),
            inputs.rest.dims(),
        );
        inputs
    }
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
) -> FloatTensor<B> {
    let x = TopInputs::new::<B>(queries, keys, values, clusters, key_lengths);
    let groups = QueryGroups::new(x.assignments.clone(), x.topk.dims()[2], x.queries.dtype());
    let weights = top_softmax(x.queries, x.keys, &x.topk, &groups, x.key_lengths, scale)
        * groups.broadcast(x.mass);
    let top = sparse_weighted_sum(weights, x.values, x.topk, x.assignments);
    B::float_primitive(top + groups.broadcast(x.rest))
}

/// Default body of [`ClusteredAttentionBackward::top_attention_backward`]: the softmax
/// recomputed as [`top_attention`] computes it, then the products of its gradient, each a
/// sparse product or a sum over each cluster's members (the query grouping's aggregate).
///
/// # Panics
/// If the shapes disagree.
pub fn top_attention_backward<B: ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Lengths<B>,
    scale: f64,
    grad: FloatTensor<B>,
) -> TopAttentionGrads<B> {
    let x = TopInputs::new::<B>(queries, keys, values, clusters, key_lengths);
    let grad = B::float_tensor::<4>(grad);
    let [batch, heads, len, _] = x.queries.dims();
    let [_, _, keys_len, dim_v] = x.values.dims();
    let num_clusters = x.topk.dims()[2];
    assert!(
        grad.dims() == [batch, heads, len, dim_v],
        "grad {:?} must be [batch, heads, L, D] = {:?}",
        grad.dims(),
        [batch, heads, len, dim_v]
    );
    let padded = x.assignments.clone().lower_elem(0).unsqueeze_dim::<4>(3);
    let grad = grad.mask_fill(padded.expand([batch, heads, len, dim_v]), 0.0);
    let groups = QueryGroups::new(x.assignments.clone(), num_clusters, x.queries.dtype());
    let probs = top_softmax(
        x.queries.clone(),
        x.keys.clone(),
        &x.topk,
        &groups,
        x.key_lengths,
        scale,
    );
    let query_mass = groups.broadcast(x.mass);
    // grad_i · values[t_r], [batch, heads, L, k] (zero for padded queries).
    let grad_weights = sparse_dot(
        grad.clone(),
        x.values,
        x.topk.clone(),
        x.assignments.clone(),
    );
    let delta = (grad_weights.clone() * probs.clone()).sum_dim(3);
    let grad_scores =
        (probs.clone() * (grad_weights - delta.clone()) * query_mass.clone()).mul_scalar(scale);
    let weights = probs * query_mass;
    let grad_queries = sparse_weighted_sum(
        grad_scores.clone(),
        x.keys,
        x.topk.clone(),
        x.assignments.clone(),
    );
    let grad_keys = sparse_scatter(
        grad_scores,
        x.queries,
        x.topk.clone(),
        x.assignments.clone(),
        keys_len,
    );
    let grad_values = sparse_scatter(weights, grad.clone(), x.topk, x.assignments, keys_len);
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
