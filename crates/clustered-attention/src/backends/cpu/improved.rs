//! Host [`improved_attention_forward`]: the centroids, then the host centroid and top-k
//! attentions; and [`improved_attention_backward`]: the top-k and centroid attentions' backward
//! passes, their gradients of the keys, values and queries summed in place.

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};

use super::access::{HostAccess, dims, on_host, write_float};
use super::centroid::{centroid_attention, centroid_backward_into};
use super::parallel::for_each_row;
use super::top::top_backward_buffers;
use crate::dropout::AttentionDropout;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::checks::check_query_clusters;
use crate::ops::{
    AttentionGrads, ClusteredAttentionBackward, ImprovedForward, Lengths, NO_CLUSTER,
    QueryClusters, reference,
};

/// Host
/// [`ClusteredAttentionBackward::improved_attention_forward`](ClusteredAttentionBackward::improved_attention_forward)
/// (and [`ClusteredAttentionBackend::improved_attention`], its output) in `f32` (`f16` and `bf16`
/// widened): the centroids, `scale · inverse_counts[j] · Σ_{i ∈ j} queries_i` summed in the
/// queries' order per `(batch, head)` on rayon's pool, then the host
/// [`centroid_attention`](super::centroid_attention) of the centroids with the top-k keys (with
/// its log-sum-exps, which [`improved_attention_backward`] uses), the mass (the sum of each
/// row's top-k weights) and the backend's [`ClusteredAttentionBackend::top_attention`] of every
/// query (on NdArray and Flex the host [`top_attention`](super::top_attention)).
/// Falls back to the default body when an input is not `f32`, `f16` or `bf16`.
///
/// # Panics
/// As [`ClusteredAttentionBackend::improved_attention`]; if an assignment is outside `0..C`
/// and not [`NO_CLUSTER`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_forward<B: HostAccess + ClusteredAttentionBackward>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> (FloatTensor<B>, ImprovedForward<B>) {
    let floats = [&queries, &keys, &values, &clusters.inverse_counts];
    if !floats.iter().all(|x| on_host::<B>(x)) {
        return reference::improved_attention_forward::<B>(
            queries,
            keys,
            values,
            clusters,
            Lengths::from(key_lengths),
            topk,
            scale,
            dropout,
        );
    }
    assert!(topk > 0, "topk must be at least 1, got 0");
    let (device, dtype) = (queries.device(), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let num_clusters = check_query_clusters([batch, heads, len, dim], &clusters);
    let assignments = B::ints_to_vec(clusters.assignments.clone());
    if let Some(a) = assignments
        .iter()
        .find(|&&a| a != NO_CLUSTER && !(0..num_clusters as i64).contains(&a))
    {
        panic!("assignments holds {a}, outside 0..{num_clusters} (the clusters) and not -1");
    }
    let mut centroids = vec![0f32; batch * heads * num_clusters * dim];
    B::with_f32(&queries, |queries| {
        B::with_f32(&clusters.inverse_counts, |inverse_counts| {
            for_each_row(&mut centroids, batch * heads, len * dim, |bh, out| {
                let assignments = &assignments[bh * len..(bh + 1) * len];
                let queries = &queries[bh * len * dim..(bh + 1) * len * dim];
                for (&a, query) in assignments.iter().zip(queries.chunks_exact(dim)) {
                    if a == NO_CLUSTER {
                        continue;
                    }
                    let a = a as usize;
                    for (o, &q) in out[a * dim..(a + 1) * dim].iter_mut().zip(query) {
                        *o += q;
                    }
                }
                let inverse_counts = &inverse_counts[bh * num_clusters..(bh + 1) * num_clusters];
                for (row, &inverse) in out.chunks_exact_mut(dim).zip(inverse_counts) {
                    for o in row {
                        *o = *o * inverse * scale as f32;
                    }
                }
            })
        })
    });
    let centroids =
        write_float::<B, 4>(centroids, [batch, heads, num_clusters, dim], &device, dtype);
    let attention = centroid_attention::<B>(
        centroids.clone(),
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
        dropout,
    );
    let (_, top_weights) = attention.top.as_ref().expect("topk ≥ 1 gives the top-k");
    let mass = B::with_f32(top_weights, |weights| {
        weights
            .chunks_exact(topk)
            .map(|row| row.iter().sum::<f32>())
            .collect::<Vec<f32>>()
    });
    let mass = write_float::<B, 4>(mass, [batch, heads, num_clusters, 1], &device, dtype);
    let output = B::top_attention(
        queries,
        keys,
        values,
        attention.cluster_top(clusters.assignments, mass.clone()),
        Lengths::from(key_lengths),
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

/// Host
/// [`ClusteredAttentionBackward::improved_attention_backward`](ClusteredAttentionBackward::improved_attention_backward)
/// in `f32` (`f16` and `bf16` widened): the top-k attention's backward
/// ([`top_attention_backward`](super::top_attention_backward)'s loops), then the centroid
/// attention's ([`centroid_attention_backward`](super::centroid_attention_backward)'s loops) adding
/// its keys' and values' gradients to the top-k attention's in place, then each valid query's row
/// of the centroids' gradient, times `scale` and its cluster's inverse count, added to its
/// gradient: no gradient tensor of the keys, values or queries is made twice and summed. Falls back
/// to the default body when an input is not `f32`, `f16` or `bf16`, or the forward pass has no
/// log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<B: HostAccess + ClusteredAttentionBackward>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    forward: ImprovedForward<B>,
    grad: FloatTensor<B>,
    dropout: Option<AttentionDropout>,
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
            Lengths::from(key_lengths),
            scale,
            forward,
            grad,
            dropout,
        );
    }
    let (device, dtype) = (queries.device(), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let num_clusters = check_query_clusters([batch, heads, len, dim], &clusters);
    let ImprovedForward {
        centroids,
        centroid_attention,
        mass,
    } = forward;
    let (_, top_weights) = centroid_attention.top.clone().expect("checked above");
    let top_shape = dims::<B, 4>(&top_weights);
    let mut g = top_backward_buffers::<B>(
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
        dropout,
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
