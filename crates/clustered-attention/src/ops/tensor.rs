//! The ops of [`ClusteredAttentionBackend`] on [`Tensor`]s: hashing and K-means (paper
//! §3.2.2), the softmax, the top-k selection, the fused centroid, top-k and improved attention
//! ops and the sparse top-k products of improved clustered attention (§3.3, eqs. 9–11); see
//! the trait for their definitions.

use burn::tensor::backend::Backend;
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorPrimitive};

use super::{ClusterTop, ClusteredAttentionBackend, Clusters, QueryClusters};

/// Hashes the queries: bit `b` of a code is set when `q · planes[b, ..E] > planes[b, E]`.
/// See [`ClusteredAttentionBackend::lsh_hash`]. Carries no gradient.
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `planes`: `[bits, E + 1]`
/// - output: `[batch, heads, L]`, 32-bit codes (read as `u32`)
///
/// # Panics
/// If `bits` is outside `1..=32` or `planes` does not have `E + 1` columns.
pub fn lsh_hash<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    planes: Tensor<B, 2>,
) -> Tensor<B, 3, Int> {
    let planes = planes.cast(queries.dtype());
    Tensor::from_primitive(B::lsh_hash(
        queries.into_primitive().tensor(),
        planes.into_primitive().tensor(),
    ))
}

/// K-means in Hamming space over the codes of the valid queries.
/// See [`ClusteredAttentionBackend::hamming_kmeans`] for the exact definition.
///
/// # Shapes
/// - `codes`: `[batch, heads, L]`
/// - `query_lengths`: `[batch]`
/// - output: [`Clusters`] with assignments `[batch, heads, L]` and counts `[batch, heads, C]`
///
/// # Panics
/// If `clusters` is 0 or a query length is outside `0..=L`.
pub fn hamming_kmeans<B: ClusteredAttentionBackend>(
    codes: Tensor<B, 3, Int>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> Clusters<B> {
    let (assignments, counts) = B::hamming_kmeans(
        codes.into_primitive(),
        query_lengths.map(Tensor::into_primitive),
        clusters,
        iterations,
        seed,
    );
    Clusters {
        assignments: Tensor::from_primitive(assignments),
        counts: Tensor::from_primitive(counts),
    }
}

/// Softmax over the last dimension with a division-free gradient
/// (see [`ClusteredAttentionBackend::attention_softmax`]).
///
/// # Shapes
/// - `x`: `[batch, heads, rows, S]`, output of the same shape
pub fn attention_softmax<B: ClusteredAttentionBackend>(x: Tensor<B, 4>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::attention_softmax(
        x.into_primitive().tensor(),
    )))
}

/// Indices of the `k` largest scores of every row, in descending order of score. No gradient.
///
/// # Shapes
/// - `scores`: `[batch, heads, C, S]`
/// - output: `[batch, heads, C, k]`
///
/// # Panics
/// If `k` is 0 or greater than `S`.
pub fn topk_indices<B: ClusteredAttentionBackend>(
    scores: Tensor<B, 4>,
    k: usize,
) -> Tensor<B, 4, Int> {
    Tensor::from_primitive(B::topk_indices(scores.into_primitive().tensor(), k))
}

/// Centroid attention and each cluster's top-k keys in one op (paper eqs. 4–5 and 9; see
/// [`ClusteredAttentionBackend::centroid_attention`]): returns `Aᶜ · values` with
/// `Aᶜ = softmax(centroids · keysᵀ)` (keys at or past `key_lengths[b]` masked out), and with
/// `topk > 0` the indices of each row's `topk` highest scores in descending order and the
/// weights `Aᶜ` at them; then the first output leaves those keys out (the rest of eq. 10,
/// `Σ_{l ∉ T_j} Aᶜ_jl v_l`, with no cancellation). The centroids come scaled by the softmax
/// temperature. Differentiable on `Autodiff` with respect to the centroids, keys and values
/// (by [`ClusteredAttentionBackend::centroid_attention_backward`]).
///
/// # Shapes
/// - `centroids`: `[batch, heads, C, E]`, `keys`: `[batch, heads, S, E]`,
///   `values`: `[batch, heads, S, D]`, `key_lengths`: `[batch]` in `1..=S`
/// - output: `[batch, heads, C, D]`, and `[batch, heads, C, topk]` twice
///
/// # Panics
/// If the shapes disagree or `topk > S` (the CPU backends also when a key length is outside
/// `1..=S`).
#[allow(clippy::type_complexity)]
pub fn centroid_attention<B: ClusteredAttentionBackend>(
    centroids: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    topk: usize,
) -> (Tensor<B, 4>, Option<(Tensor<B, 4, Int>, Tensor<B, 4>)>) {
    let float = |x| Tensor::from_primitive(TensorPrimitive::Float(x));
    let out = B::centroid_attention(
        centroids.into_primitive().tensor(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        key_lengths.map(Tensor::into_primitive),
        topk,
    );
    let top = out
        .top
        .map(|(top, weights)| (Tensor::from_primitive(top), float(weights)));
    (float(out.values), top)
}

/// The per-query part of improved clustered attention in one op (paper eqs. 10–11; see
/// [`ClusteredAttentionBackend::top_attention`]): for every query `i` of cluster `j`,
/// `m̂_j · Σ_r softmax_r(scale · q_i · k_{t_r}) · v_{t_r} + rest_j` over the cluster's top-k
/// keys `t_r` (keys at or past `key_lengths[b]` take no weight), zero for padded queries.
/// Differentiable on `Autodiff` with respect to the queries, keys, values, mass and rest (by
/// [`ClusteredAttentionBackend::top_attention_backward`]).
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`,
///   `values`: `[batch, heads, S, D]`
/// - `assignments`: `[batch, heads, L]` in `0..C` or `-1`, `topk`: `[batch, heads, C, k]` in
///   `0..S`, `mass`: `[batch, heads, C, 1]`, `rest`: `[batch, heads, C, D]`
/// - `key_lengths`: `[batch]` in `1..=S`
/// - output: `[batch, heads, L, D]`
///
/// # Panics
/// If the shapes disagree or `k` is 0 or above `S` (the CPU backends also when an index or a
/// key length is out of range).
#[allow(clippy::too_many_arguments)]
pub fn top_attention<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    assignments: Tensor<B, 3, Int>,
    topk: Tensor<B, 4, Int>,
    mass: Tensor<B, 4>,
    rest: Tensor<B, 4>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    scale: f64,
) -> Tensor<B, 4> {
    let clusters = ClusterTop {
        assignments: assignments.into_primitive(),
        topk: topk.into_primitive(),
        mass: mass.into_primitive().tensor(),
        rest: rest.into_primitive().tensor(),
    };
    Tensor::from_primitive(TensorPrimitive::Float(B::top_attention(
        queries.into_primitive().tensor(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        clusters,
        key_lengths.map(Tensor::into_primitive),
        scale,
    )))
}

/// [`ClusteredAttentionBackend::improved_attention`] on tensors: improved clustered attention
/// (paper eqs. 3–5 and 9–11) once the queries are clustered; `inverse_counts` is `1 / count` of
/// each cluster's members. `Autodiff<B>` differentiates it as one node with respect to `queries`,
/// `keys` and `values`.
///
/// # Shapes
/// `queries` `[batch, heads, L, E]`, `keys` `[batch, heads, S, E]`, `values`
/// `[batch, heads, S, D]`, `assignments` `[batch, heads, L]` (in `0..C`, `-1` for a padded
/// query), `inverse_counts` `[batch, heads, C, 1]`, `key_lengths` `[batch]`; `topk` in
/// `1..=S`; output `[batch, heads, L, D]`.
///
/// # Panics
/// As [`ClusteredAttentionBackend::improved_attention`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    assignments: Tensor<B, 3, Int>,
    inverse_counts: Tensor<B, 4>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    topk: usize,
    scale: f64,
) -> Tensor<B, 4> {
    let clusters = QueryClusters {
        assignments: assignments.into_primitive(),
        inverse_counts: inverse_counts.into_primitive().tensor(),
    };
    Tensor::from_primitive(TensorPrimitive::Float(B::improved_attention(
        queries.into_primitive().tensor(),
        keys.into_primitive().tensor(),
        values.into_primitive().tensor(),
        clusters,
        key_lengths.map(Tensor::into_primitive),
        topk,
        scale,
    )))
}

/// `out[b, h, i, r] = queries[b, h, i] · keys[b, h, topk[b, h, a_i, r]]`, zero for padded
/// queries (`a_i = -1`). Differentiable in `queries` and `keys`.
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`
/// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
/// - output: `[batch, heads, L, k]`
pub fn sparse_dot<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    topk: Tensor<B, 4, Int>,
    assignments: Tensor<B, 3, Int>,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::sparse_dot(
        queries.into_primitive().tensor(),
        keys.into_primitive().tensor(),
        topk.into_primitive(),
        assignments.into_primitive(),
    )))
}

/// `out[b, h, i] = Σ_r weights[b, h, i, r] · values[b, h, topk[b, h, a_i, r]]`, zero for
/// padded queries. Differentiable in `weights` and `values`.
///
/// # Shapes
/// - `weights`: `[batch, heads, L, k]`, `values`: `[batch, heads, S, D]`
/// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
/// - output: `[batch, heads, L, D]`
pub fn sparse_weighted_sum<B: ClusteredAttentionBackend>(
    weights: Tensor<B, 4>,
    values: Tensor<B, 4>,
    topk: Tensor<B, 4, Int>,
    assignments: Tensor<B, 3, Int>,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::sparse_weighted_sum(
        weights.into_primitive().tensor(),
        values.into_primitive().tensor(),
        topk.into_primitive(),
        assignments.into_primitive(),
    )))
}

/// `out[b, h, l] = Σ_{i, r : topk[b, h, a_i, r] = l} weights[b, h, i, r] · x[b, h, i]`, the
/// transpose of [`sparse_dot`] and [`sparse_weighted_sum`]. Differentiable in `weights` and `x`.
///
/// # Shapes
/// - `weights`: `[batch, heads, L, k]`, `x`: `[batch, heads, L, F]`
/// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
/// - output: `[batch, heads, keys_len, F]`
pub fn sparse_scatter<B: ClusteredAttentionBackend>(
    weights: Tensor<B, 4>,
    x: Tensor<B, 4>,
    topk: Tensor<B, 4, Int>,
    assignments: Tensor<B, 3, Int>,
    keys_len: usize,
) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(B::sparse_scatter(
        weights.into_primitive().tensor(),
        x.into_primitive().tensor(),
        topk.into_primitive(),
        assignments.into_primitive(),
        keys_len,
    )))
}

/// `weights` (`[batch, heads, C, S]`) with each row's top-k entries set to exactly zero
/// (`w + (−w) = 0`; a row's top-k keys are distinct): the weights of the rest of `Aᶜ V` (paper
/// eq. 10, second case). Subtracting the top-k share from all of `Aᶜ V` instead would cancel
/// when the top-k mass is near 1.
///
/// # Shapes
/// - `weights`: `[batch, heads, C, S]`, `top` and `top_weights`: `[batch, heads, C, k]`
/// - output: `[batch, heads, C, S]`
pub(crate) fn rest_weights<B: Backend>(
    weights: Tensor<B, 4>,
    top: Tensor<B, 4, Int>,
    top_weights: Tensor<B, 4>,
) -> Tensor<B, 4> {
    weights.scatter(3, top, top_weights.neg(), IndexingUpdateOp::Add)
}
