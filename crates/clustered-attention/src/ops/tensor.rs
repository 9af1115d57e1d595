//! The ops of [`ClusteredAttentionBackend`] on [`Tensor`]s: hashing and K-means (paper
//! §3.2.2), the softmax, the top-k selection, the fused centroid, top-k and improved attention
//! ops and the sparse top-k products of improved clustered attention (§3.3, eqs. 9–11); see
//! the trait for their definitions. Each calls `Dispatch`'s implementation of the trait, which
//! runs the implementation of the tensors' backend (`Autodiff`'s on an autodiff device).

use burn::backend::Dispatch;
use burn::tensor::{DType, Device, IndexingUpdateOp, Int, Tensor};

use crate::dropout::AttentionDropout;

#[cfg(doc)]
use super::ClusteredAttentionBackward;
use super::{
    ClusterTop, ClusteredAttentionBackend, Clusters, Lengths, QueryClusters, ScoreProducts,
};

/// A lengths tensor as the ops of `Dispatch` take it.
fn dispatch_lengths(lengths: Option<Tensor<1, Int>>) -> Lengths<Dispatch> {
    Lengths::<Dispatch>::from(lengths.map(Tensor::into_dispatch))
}

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
pub fn lsh_hash(queries: Tensor<4>, planes: Tensor<2>) -> Tensor<3, Int> {
    let planes = planes.cast(queries.dtype());
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::lsh_hash(
        queries.into_dispatch(),
        planes.into_dispatch(),
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
pub fn hamming_kmeans(
    codes: Tensor<3, Int>,
    query_lengths: Option<Tensor<1, Int>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> Clusters {
    hamming_kmeans_host(codes, query_lengths, None, clusters, iterations, seed)
}

/// [`hamming_kmeans`] given the values of `query_lengths` on the host (`known`), passed to the
/// backend as [`Lengths::Known`] so that it need not read them back.
pub(crate) fn hamming_kmeans_host(
    codes: Tensor<3, Int>,
    query_lengths: Option<Tensor<1, Int>>,
    known: Option<&[usize]>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> Clusters {
    let query_lengths = match (query_lengths, known) {
        (Some(lengths), Some(known)) => Lengths::Known {
            lengths: lengths.into_dispatch(),
            host: known.to_vec(),
        },
        (lengths, _) => dispatch_lengths(lengths),
    };
    let (assignments, counts) = <Dispatch as ClusteredAttentionBackend>::hamming_kmeans(
        codes.into_dispatch(),
        query_lengths,
        clusters,
        iterations,
        seed,
    );
    Clusters {
        assignments: Tensor::from_dispatch(assignments),
        counts: Tensor::from_dispatch(counts),
    }
}

/// Softmax over the last dimension with a division-free gradient
/// (see [`ClusteredAttentionBackend::attention_softmax`]).
///
/// # Shapes
/// - `x`: `[batch, heads, rows, S]`, output of the same shape
pub fn attention_softmax(x: Tensor<4>) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::attention_softmax(
        x.into_dispatch(),
    ))
}

/// The factors of the attention dropout `dropout` on `stream` for weights shaped like `like`
/// (see [`ClusteredAttentionBackend::attention_dropout_factors`]): 0 or `1 / (1 − p)`, drawn
/// on `like`'s device, in its float type. No gradient.
///
/// # Shapes
/// - `like`: `[batch, heads, rows, keys]`, output of the same shape
pub fn attention_dropout_factors(
    dropout: AttentionDropout,
    stream: u32,
    like: &Tensor<4>,
) -> Tensor<4> {
    Tensor::from_dispatch(
        <Dispatch as ClusteredAttentionBackend>::attention_dropout_factors(
            dropout,
            stream,
            like.clone().detach().into_dispatch(),
        ),
    )
}

/// Dropout of activations with a counter-based mask (see
/// [`ClusteredAttentionBackend::activation_dropout`]): `x` times 0 or `1 / (1 − p)` by
/// Philox4x32-10 on `[column / 8, row, 0, stream]` under `dropout`'s seed, rows being `x`'s
/// rows (every dimension but the last) and columns its last dimension. Applied whatever the
/// device (the caller decides whether it trains); on an autodiff device the backward pass
/// draws the mask again instead of keeping it.
///
/// # Shapes
/// - `x`: any rank ≥ 1, output of the same shape
///
/// # Panics
/// If `x` has rank 0, or `2³²` rows or columns or more.
pub fn activation_dropout<const D: usize>(
    x: Tensor<D>,
    dropout: AttentionDropout,
    stream: u32,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::activation_dropout(
        x.into_dispatch(),
        dropout,
        stream,
    ))
}

/// `forward(input, parameters)` as one node that keeps `input` and `parameters` only and runs
/// `forward` again in the backward pass (see [`ClusteredAttentionBackend::recompute`]); on a
/// device without autodiff, `forward` once.
///
/// # Shapes
/// - `input`: `[batch, L, d_model]`; `parameters`: `[n]`; output: `forward`'s
///
/// # Panics
/// If `input` and `parameters` are on different backends.
pub fn recompute(
    input: Tensor<3>,
    parameters: Tensor<1>,
    forward: crate::recompute::RecomputedForward,
) -> Tensor<3> {
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::recompute(
        input.into_dispatch(),
        parameters.into_dispatch(),
        forward,
    ))
}

/// Indices of the `k` largest scores of every row, in descending order of score. No gradient.
///
/// # Shapes
/// - `scores`: `[batch, heads, C, S]`
/// - output: `[batch, heads, C, k]`
///
/// # Panics
/// If `k` is 0 or greater than `S`.
pub fn topk_indices(scores: Tensor<4>, k: usize) -> Tensor<4, Int> {
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::topk_indices(
        scores.into_dispatch(),
        k,
    ))
}

/// Centroid attention and each cluster's top-k keys in one op (paper eqs. 4–5 and 9; see
/// [`ClusteredAttentionBackend::centroid_attention`]): returns `Aᶜ · values` with
/// `Aᶜ = softmax(centroids · keysᵀ)` (keys at or past `key_lengths[b]` masked out), and with
/// `topk > 0` the indices of each row's `topk` highest scores in descending order and the
/// weights `Aᶜ` at them; then the first output leaves those keys out (the rest of eq. 10,
/// `Σ_{l ∉ T_j} Aᶜ_jl v_l`, with no cancellation). The centroids come scaled by the softmax
/// temperature. Differentiable on `Autodiff` with respect to the centroids, keys and values
/// (by [`ClusteredAttentionBackward::centroid_attention_backward`]). With `dropout`, the weights
/// of the first output are dropped ([`AttentionDropout`], stream
/// [`AttentionDropout::CLUSTER_ROWS`]); the top-k weights are not.
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
pub fn centroid_attention(
    centroids: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    topk: usize,
    dropout: Option<AttentionDropout>,
) -> (Tensor<4>, Option<(Tensor<4, Int>, Tensor<4>)>) {
    let (values, top) = <Dispatch as ClusteredAttentionBackend>::centroid_attention(
        centroids.into_dispatch(),
        keys.into_dispatch(),
        values.into_dispatch(),
        dispatch_lengths(key_lengths),
        topk,
        dropout,
    );
    let top =
        top.map(|(top, weights)| (Tensor::from_dispatch(top), Tensor::from_dispatch(weights)));
    (Tensor::from_dispatch(values), top)
}

/// The per-query part of improved clustered attention in one op (paper eqs. 10–11; see
/// [`ClusteredAttentionBackend::top_attention`]): for every query `i` of cluster `j`,
/// `m̂_j · Σ_r softmax_r(scale · q_i · k_{t_r}) · v_{t_r} + rest_j` over the cluster's top-k
/// keys `t_r` (keys at or past `key_lengths[b]` take no weight), zero for padded queries.
/// Differentiable on `Autodiff` with respect to the queries, keys, values, mass and rest (by
/// [`ClusteredAttentionBackward::top_attention_backward`]). With `dropout`, the top-k weights
/// `m̂_j · softmax_r` are dropped ([`AttentionDropout`], stream [`AttentionDropout::QUERY_TOP`]).
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
pub fn top_attention(
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    topk: Tensor<4, Int>,
    mass: Tensor<4>,
    rest: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> Tensor<4> {
    let clusters = ClusterTop::<Dispatch> {
        assignments: assignments.into_dispatch(),
        topk: topk.into_dispatch(),
        mass: mass.into_dispatch(),
        rest: rest.into_dispatch(),
    };
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::top_attention(
        queries.into_dispatch(),
        keys.into_dispatch(),
        values.into_dispatch(),
        clusters,
        dispatch_lengths(key_lengths),
        scale,
        dropout,
    ))
}

/// [`ClusteredAttentionBackend::improved_attention`] on tensors: improved clustered attention
/// (paper eqs. 3–5 and 9–11) once the queries are clustered; `inverse_counts` is `1 / count` of
/// each cluster's members. `Autodiff` differentiates it as one node with respect to `queries`,
/// `keys` and `values` (by [`ClusteredAttentionBackward::improved_attention_backward`]). With
/// `dropout`, both sets of weights are dropped, as [`centroid_attention`] and [`top_attention`]
/// drop them.
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
pub fn improved_attention(
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    inverse_counts: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    topk: usize,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> Tensor<4> {
    let clusters = QueryClusters::<Dispatch> {
        assignments: assignments.into_dispatch(),
        inverse_counts: inverse_counts.into_dispatch(),
    };
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::improved_attention(
        queries.into_dispatch(),
        keys.into_dispatch(),
        values.into_dispatch(),
        clusters,
        dispatch_lengths(key_lengths),
        topk,
        scale,
        dropout,
    ))
}

/// `out[b, h, i, r] = queries[b, h, i] · keys[b, h, topk[b, h, a_i, r]]`, zero for padded
/// queries (`a_i = -1`). Differentiable in `queries` and `keys`.
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`
/// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
/// - output: `[batch, heads, L, k]`
pub fn sparse_dot(
    queries: Tensor<4>,
    keys: Tensor<4>,
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::sparse_dot(
        queries.into_dispatch(),
        keys.into_dispatch(),
        topk.into_dispatch(),
        assignments.into_dispatch(),
    ))
}

/// `out[b, h, i] = Σ_r weights[b, h, i, r] · values[b, h, topk[b, h, a_i, r]]`, zero for
/// padded queries. Differentiable in `weights` and `values`.
///
/// # Shapes
/// - `weights`: `[batch, heads, L, k]`, `values`: `[batch, heads, S, D]`
/// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
/// - output: `[batch, heads, L, D]`
pub fn sparse_weighted_sum(
    weights: Tensor<4>,
    values: Tensor<4>,
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
) -> Tensor<4> {
    Tensor::from_dispatch(
        <Dispatch as ClusteredAttentionBackend>::sparse_weighted_sum(
            weights.into_dispatch(),
            values.into_dispatch(),
            topk.into_dispatch(),
            assignments.into_dispatch(),
        ),
    )
}

/// `out[b, h, l] = Σ_{i, r : topk[b, h, a_i, r] = l} weights[b, h, i, r] · x[b, h, i]`, the
/// transpose of [`sparse_dot`] and [`sparse_weighted_sum`]. Differentiable in `weights` and `x`.
///
/// # Shapes
/// - `weights`: `[batch, heads, L, k]`, `x`: `[batch, heads, L, F]`
/// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
/// - output: `[batch, heads, keys_len, F]`
pub fn sparse_scatter(
    weights: Tensor<4>,
    x: Tensor<4>,
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
    keys_len: usize,
) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as ClusteredAttentionBackend>::sparse_scatter(
        weights.into_dispatch(),
        x.into_dispatch(),
        topk.into_dispatch(),
        assignments.into_dispatch(),
        keys_len,
    ))
}

/// How [`centroid_attention`] and [`top_attention`] compute their scores in `dtype` on
/// `device`: [`ScoreProducts::Cmma`] where the CubeCL kernels run them on cooperative matrices
/// (the crate's `cmma` feature, `f16` or `bf16`, a device that reports a tile shape for that
/// type into `f32`), [`ScoreProducts::MultiplyAdd`] otherwise. Even then, a call whose tiles
/// would not fit the kernels' shared memory (wide `E` or `D`, a large `topk`) computes its
/// scores by multiply-adds.
///
/// Asks the CubeCL backend for a `Cube` device (one with autodiff included); every other
/// device answers [`ScoreProducts::MultiplyAdd`].
#[allow(unreachable_patterns)] // A build whose only backend is `Cube`.
pub fn score_products(device: &Device, dtype: DType) -> ScoreProducts {
    match device.as_dispatch().clone().inner() {
        #[cfg(feature = "cube")]
        burn::backend::DispatchDevice::Cube(device) => {
            crate::backends::cube::score_products(&device, dtype)
        }
        _ => {
            let _ = dtype;
            ScoreProducts::MultiplyAdd
        }
    }
}

/// `weights` (`[batch, heads, C, S]`) with each row's top-k entries set to exactly zero
/// (`w + (−w) = 0`; a row's top-k keys are distinct): the weights of the rest of `Aᶜ V` (paper
/// eq. 10, second case). Subtracting the top-k share from all of `Aᶜ V` instead would cancel
/// when the top-k mass is near 1.
///
/// # Shapes
/// - `weights`: `[batch, heads, C, S]`, `top` and `top_weights`: `[batch, heads, C, k]`
/// - output: `[batch, heads, C, S]`
pub(crate) fn rest_weights(
    weights: Tensor<4>,
    top: Tensor<4, Int>,
    top_weights: Tensor<4>,
) -> Tensor<4> {
    weights.scatter(3, top, top_weights.neg(), IndexingUpdateOp::Add)
}
