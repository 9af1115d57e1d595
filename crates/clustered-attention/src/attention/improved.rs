use burn::tensor::activation::softmax;
use burn::tensor::{Int, Tensor};

use super::{AttentionOptions, centroids, check_input, cluster_index, dropout, gather_rows};
use crate::ClusteringBackend;
use crate::clustering::{ClusteringOptions, cluster_queries};

/// Improved clustered attention (paper §3.3, eqs. 9–11).
///
/// Clusters the queries and computes the centroid attention `Aᶜ` as
/// [`clustered_attention`](super::clustered_attention) does. For each cluster `j` it then takes
/// the `topk` keys `T_j` with the highest centroid attention and their mass
/// `m̂_j = Σ_{l ∈ T_j} Aᶜ_{jl}` (eq. 9). Each query `i` of cluster `j` attends to `T_j` with
/// its own exact dot products, softmaxed over `T_j` and scaled by `m̂_j`, and to the other keys
/// with `Aᶜ_j` (eq. 10); the output is `Aᵗ V` (eq. 11). Padded keys are masked per sequence,
/// head and cluster. Costs `O(L · k · (E + D))` on top of clustered attention.
///
/// Proposition 2 of the paper holds: `‖Aᵗ_i − A_i‖₁ ≤ ‖Aᶜ_j − A_i‖₁` for every query. With
/// `topk ≥ S` the result equals [`full_attention`](super::full_attention), whatever `C`; so it
/// does when every sequence has no more valid queries than `C`.
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
///
/// # Example
/// ```
/// use burn::backend::NdArray;
/// use burn::tensor::{Distribution, Tensor};
/// use clustered_attention::{AttentionOptions, ClusteringOptions, improved_clustered_attention};
///
/// let device = Default::default();
/// let q = Tensor::<NdArray, 4>::random([1, 2, 64, 8], Distribution::Default, &device);
/// let k = Tensor::<NdArray, 4>::random([1, 2, 50, 8], Distribution::Default, &device);
/// let v = Tensor::<NdArray, 4>::random([1, 2, 50, 3], Distribution::Default, &device);
/// let clustering = ClusteringOptions::new(8);
/// let out = improved_clustered_attention(
///     q, k, v, None, None, &clustering, 16, &AttentionOptions::new(),
/// );
/// assert_eq!(out.dims(), [1, 2, 64, 3]);
/// ```
#[allow(clippy::too_many_arguments)]
pub fn improved_clustered_attention<B: ClusteringBackend>(
    queries: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    clustering: &ClusteringOptions,
    topk: usize,
    options: &AttentionOptions,
) -> Tensor<B, 4> {
    assert!(topk > 0, "topk must be at least 1, got 0");
    clustering.check();
    let [_, _, _, value_dim] = values.dims();
    let input = check_input(
        &queries,
        &keys,
        &values,
        query_lengths,
        key_lengths,
        options,
    );
    let (batch, heads, len, keys_len) =
        (input.batch, input.heads, input.queries_len, input.keys_len);
    let clusters = cluster_queries(queries.clone(), input.query_lengths.clone(), clustering);
    let num_clusters = clustering.clusters;
    let device = queries.device();

    // Centroid attention Aᶜ (eqs. 3–4), [batch, heads, C, S].
    let centroids = centroids(
        queries.clone(),
        &clusters.assignments,
        &clusters.counts,
        &input,
    );
    let scores = input.mask_keys(
        centroids
            .matmul(keys.clone().swap_dims(2, 3))
            .mul_scalar(input.scale),
    );
    let weights = softmax(scores.clone(), 3);

    // Top-k keys per cluster, [batch, heads, C, k]; ranking by score ranks by Aᶜ.
    let k = topk.min(keys_len);
    let top = if k == keys_len {
        Tensor::<B, 1, Int>::arange(0..keys_len as i64, &device)
            .reshape([1, 1, 1, keys_len])
            .expand([batch, heads, num_clusters, keys_len])
    } else {
        // argtopk is unimplemented on NdArray and Flex: sort, then keep the first k.
        let (_, order) = scores.detach().sort_descending_with_indices(3);
        order.slice([0..batch, 0..heads, 0..num_clusters, 0..k])
    };
    let top_mass = weights.clone().gather(3, top.clone()).sum_dim(3); // eq. 9, [batch, heads, C, 1]

    // Keys outside the top-k keep Aᶜ: their contribution per cluster, [batch, heads, C, D].
    let in_top = Tensor::<B, 4, Int>::zeros([batch, heads, num_clusters, keys_len], &device)
        .scatter(
            3,
            top.clone(),
            Tensor::ones([batch, heads, num_clusters, k], &device),
            burn::tensor::IndexingUpdateOp::Add,
        )
        .bool();
    let rest = dropout(weights.mask_fill(in_top, 0.0), options.dropout);
    let rest_values = rest.matmul(values.clone());

    // Top-k keys: exact dot products per query, renormalised to the cluster's mass (eq. 10).
    let query_top = top.gather(2, cluster_index(&clusters.assignments, k)); // [batch, heads, L, k]
    let top_keys = gather_rows(keys, query_top.clone()); // [batch, heads, L, k, E]
    let top_scores = (queries.unsqueeze_dim::<5>(3) * top_keys)
        .sum_dim(4)
        .squeeze_dim::<4>(4)
        .mul_scalar(input.scale);
    let top_scores = match &input.key_lengths {
        Some(lengths) => {
            let padded = query_top
                .clone()
                .greater_equal(lengths.clone().expand([batch, heads, len, k]));
            top_scores.mask_fill(padded, f32::NEG_INFINITY)
        }
        None => top_scores,
    };
    let query_mass = top_mass.gather(2, cluster_index(&clusters.assignments, 1)); // [batch, heads, L, 1]
    let top_weights = dropout(softmax(top_scores, 3) * query_mass, options.dropout);
    let top_values = gather_rows(values, query_top); // [batch, heads, L, k, D]
    let top_output = (top_weights.unsqueeze_dim::<5>(4) * top_values)
        .sum_dim(3)
        .squeeze_dim::<4>(3);

    // eq. 11: Aᵗ V = top-k part + the rest of the cluster's attention.
    let output =
        top_output + rest_values.gather(2, cluster_index(&clusters.assignments, value_dim));
    input.zero_padded_queries(output)
}
