//! Host [`improved_attention_backward`]: the top-k and centroid attentions' backward passes,
//! their gradients of the keys, values and queries summed in place.

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{FloatTensor, IntTensor};

use super::access::{HostAccess, dims, on_host, write_float};
use super::centroid::centroid_backward_into;
use super::parallel::for_each_row;
use super::top::top_backward_buffers;
use crate::ops::checks::check_query_clusters;
use crate::ops::{
    AttentionGrads, ClusterTop, ClusteredAttentionBackend, ImprovedForward, NO_CLUSTER,
    QueryClusters, reference,
};

/// Host
/// [`ClusteredAttentionBackend::improved_attention_backward`](ClusteredAttentionBackend::improved_attention_backward)
/// in `f32` (`f16` and `bf16` widened): the top-k attention's backward
/// ([`top_attention_backward`](super::top_attention_backward)'s loops), then the centroid
/// attention's ([`centroid_attention_backward`](super::centroid_attention_backward)'s loops) adding
/// its keys' and values' gradients to the top-k attention's in place, then each valid query's row
/// of the centroids' gradient, times `scale` and its cluster's inverse count, added to its
/// gradient: no gradient tensor of the keys, values or queries is made twice and summed. Falls back
/// to the default body when an input is not `f32`, `f16` or `bf16`, or the forward pass has no
/// log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<B: HostAccess + ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    forward: ImprovedForward<B>,
    grad: FloatTensor<B>,
) -> AttentionGrads<B> {
    let attention = &forward.centroid_attention;
    let floats = [
        &queries,
        &keys,
        &values,
        &grad,
        &clusters.inverse_counts,
        &forward.centroids,
        &forward.mass,
        &attention.values,
    ];
    let host = floats.iter().all(|x| on_host::<B>(x))
        && attention.top.as_ref().is_some_and(|(_, w)| on_host::<B>(w))
        && attention
            .log_sum_exp
            .as_ref()
            .is_some_and(|x| on_host::<B>(x));
    let empty = [&queries, &keys, &values]
        .iter()
        .any(|x| x.shape().num_elements() == 0);
    if !host || empty {
        return reference::improved_attention_backward::<B>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            forward,
            grad,
        );
    }
    let (device, dtype) = (B::float_device(&queries), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let num_clusters = check_query_clusters([batch, heads, len, dim], &clusters);
    let ImprovedForward {
        centroids,
        centroid_attention,
        mass,
    } = forward;
    let (top, top_weights) = centroid_attention.top.clone().expect("checked above");
    let top_shape = dims::<B, 4>(&top_weights);
    let mut g = top_backward_buffers::<B>(
        queries,
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
    let k = top_shape[3];
    let grad_top: Vec<f32> = g
        .mass
        .iter()
        .flat_map(|&m| std::iter::repeat_n(m, k))
        .collect();
    let grad_rest = std::mem::take(&mut g.rest);
    let grad_centroids = centroid_backward_into::<B>(
        [centroids, keys, values],
        key_lengths,
        centroid_attention,
        write_float::<B, 4>(
            grad_rest,
            [batch, heads, num_clusters, dim_v],
            &device,
            dtype,
        ),
        Some(write_float::<B, 4>(grad_top, top_shape, &device, dtype)),
        (&mut g.keys, &mut g.values),
    );
    // Each query's share of its cluster's centroid: scale / count of the centroid's gradient.
    let assignments = B::ints_to_vec(clusters.assignments);
    B::with_f32(&clusters.inverse_counts, |inverse_counts| {
        for_each_row(&mut g.queries, batch * heads, len * dim, |bh, dq| {
            let assignments = &assignments[bh * len..(bh + 1) * len];
            let grad_centroids = &grad_centroids[bh * num_clusters * dim..][..num_clusters * dim];
            let inverse_counts = &inverse_counts[bh * num_clusters..(bh + 1) * num_clusters];
            for (row, &a) in dq.chunks_exact_mut(dim).zip(assignments) {
                if a == NO_CLUSTER {
                    continue;
                }
                let a = a as usize;
                let factor = inverse_counts[a] * scale as f32;
                for (o, &x) in row.iter_mut().zip(&grad_centroids[a * dim..(a + 1) * dim]) {
                    *o += factor * x;
                }
            }
        })
    });
    AttentionGrads {
        queries: write_float::<B, 4>(g.queries, [batch, heads, len, dim], &device, dtype),
        keys: write_float::<B, 4>(g.keys, [batch, heads, keys_len, dim], &device, dtype),
        values: write_float::<B, 4>(g.values, [batch, heads, keys_len, dim_v], &device, dtype),
    }
}
