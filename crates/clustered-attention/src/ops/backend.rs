//! The backend extension trait, [`ClusteredAttentionBackend`], and the trait of the backward
//! passes that `Autodiff` asks of the backend it wraps, [`ClusteredAttentionBackward`].
// The `NdArray` selector names the deprecated backend in the generated `Dispatch` impl.
#![cfg_attr(feature = "ndarray", allow(deprecated))]

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, TensorMetadata, backend_extension};

use super::reference;
use super::{
    AttentionGrads, CentroidAttention, CentroidAttentionGrads, ClusterTop, ImprovedForward,
    Lengths, QueryClusters, TensorConversion, TopAttentionGrads,
};
use crate::dropout::AttentionDropout;
use crate::recompute::RecomputedForward;

/// A backend that can hash and cluster queries and compute the sparse top-k products of
/// improved clustered attention.
///
/// Every method has a default body made of Burn tensor ops ([`reference`](mod@reference)); a
/// backend may override them with custom kernels but must then reproduce the default bodies
/// (bit for bit for the integer outputs).
///
/// It is a Burn backend extension: `Dispatch` implements it by routing each call to the
/// backend of its tensors (`NdArray`, `Flex`, `Cube`, and `Autodiff` of each, with the crate
/// features that compile them), which is what the tensor-level functions of [`crate::ops`] call.
/// A backend's own implementation takes and returns its primitives; `Option`al lengths are
/// [`Lengths`].
#[backend_extension(
    NdArray: cfg(feature = "ndarray"),
    Flex: cfg(feature = "flex"),
    Cube: cfg(feature = "cube"),
    Autodiff: cfg(feature = "autodiff"),
)]
pub trait ClusteredAttentionBackend: Backend + TensorConversion {
    /// Hashes every query with random hyperplanes (sign of random projections, paper §3.2.2).
    ///
    /// Bit `b` of the code of a query `q` is set when `q · planes[b, ..E] > planes[b, E]`,
    /// i.e. when the projection of the query on plane `b` exceeds that plane's threshold.
    /// The codes are 32-bit words stored in the backend's int type as the `i32` two's
    /// complement pattern; read them as `u32` (`code as i32 as u32`). Bits `≥ bits` are zero.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`
    /// - `planes`: `[bits, E + 1]`, the last column being the thresholds
    /// - output codes: `[batch, heads, L]`
    ///
    /// # Panics
    /// If `bits` is 0 or above [`MAX_BITS`](super::MAX_BITS), or `planes` does not have `E + 1`
    /// columns.
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        reference::lsh_hash::<Self>(queries, planes)
    }

    /// K-means in Hamming space over the codes of the valid queries (paper §3.2.2).
    ///
    /// The one definition every backend reproduces bit for bit, per `(batch, head)` with
    /// `n` valid queries (positions `< query_lengths[batch]`, all `L` with [`Lengths::All`]):
    /// - if `n ≤ clusters`, query `i` is alone in cluster `i` (so clustered attention equals
    ///   full attention) and k-means does not run;
    /// - otherwise the initial centroids are the codes of `clusters` distinct valid positions
    ///   drawn by [`initial_centroid_positions`](super::initial_centroid_positions) from `seed`;
    /// - an assignment step gives each valid query the centroid nearest in Hamming distance
    ///   (popcount of xor), ties going to the lowest cluster index;
    /// - an update step sets each centroid bit to the majority of its members' bits; an exact
    ///   tie keeps the previous bit, so an empty cluster keeps its previous centroid;
    /// - exactly `iterations` (assign, update) rounds run, then a final assignment; an
    ///   implementation may stop once an update leaves every centroid unchanged, since the
    ///   remaining rounds would then repeat it and the result is the same.
    ///
    /// Padded queries belong to no cluster: their assignment is [`NO_CLUSTER`](super::NO_CLUSTER)
    /// (`-1`).
    ///
    /// # Shapes
    /// - `codes`: `[batch, heads, L]`, 32-bit codes as produced by [`Self::lsh_hash`]
    /// - `query_lengths`: `[batch]`, each in `0..=L`
    /// - output `assignments`: `[batch, heads, L]`, in `0..clusters` or `-1`
    /// - output `counts`: `[batch, heads, clusters]`, summing to `query_lengths[batch]`
    ///
    /// # Panics
    /// If `clusters` is 0, if `query_lengths` is not `[batch]`, or a length is negative or
    /// greater than `L`.
    fn hamming_kmeans(
        codes: IntTensor<Self>,
        #[extension_type] query_lengths: Lengths<Self>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        reference::hamming_kmeans::<Self>(codes, query_lengths, clusters, iterations, seed)
    }

    /// Softmax over the last dimension: the attention weights of paper eqs. 1, 4 and 10.
    ///
    /// Its gradient is `y ⊙ (g − Σ_last g ⊙ y)`, which `Autodiff<B>` computes from the saved
    /// output with a product, a row sum and a subtraction: no division, unlike Burn's
    /// decomposed softmax (NdArray's SIMD division gradient uses a 12-bit reciprocal).
    ///
    /// In `f16` and `bf16` the row sums accumulate in `f32`: in the host loops of the CPU
    /// backends, and in Burn's reductions on the CubeCL backends and Flex.
    ///
    /// # Shapes
    /// - `x`: `[batch, heads, rows, S]`, output of the same shape
    fn attention_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let last = x.shape().num_dims() - 1;
        Self::softmax(x, last)
    }

    /// The factors of the attention dropout `dropout` on `stream` for weights shaped like
    /// `like` (`[batch, heads, rows, keys]`): 0 (dropped) or `1 / (1 − p)`, as
    /// [`AttentionDropout::factors`] gives them (Philox4x32-10 on `[key / 8, row, batch · heads
    /// + head, stream]`), in `like`'s float type and on its device; `like`'s values are not
    /// read. The default bodies of the fused ops multiply their weights by them where a backend
    /// has no kernel for an op with dropout (the CubeCL backends: the top-k attention's
    /// backward). Carries no gradient.
    ///
    /// The default body draws them on the host and uploads them; the CubeCL backends draw them
    /// on the device, one unit per eight keys of a row.
    ///
    /// # Shapes
    /// - `like`: `[batch, heads, rows, keys]`, output of the same shape
    fn attention_dropout_factors(
        dropout: AttentionDropout,
        stream: u32,
        like: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::attention_dropout_factors::<Self>(dropout, stream, like)
    }

    /// Dropout of activations: `x` times the factors of `dropout` on `stream`, the rows of
    /// the mask being `x`'s rows (every dimension but the last, flattened) and its keys `x`'s
    /// last dimension: element `(row, column)` is kept as [`AttentionDropout::factor`]`(stream,
    /// 0, row, column)` says (Philox4x32-10 on `[column / 8, row, 0, stream]`) and scaled by
    /// `1 / (1 − p)`. The mask is a function of `dropout`'s seed, `stream` and the coordinates
    /// alone: `Autodiff<B>` keeps only those for the backward pass and draws the mask again
    /// there (the gradient is the incoming gradient times the same factors), instead of
    /// storing it as burn-nn's `Dropout` does.
    ///
    /// The default body multiplies `x` by [`Self::attention_dropout_factors`] on the view
    /// `[1, 1, rows, columns]`; the CPU backends apply the factors in one pass over a copy.
    ///
    /// # Shapes
    /// - `x`: any rank ≥ 1, output of the same shape
    ///
    /// # Panics
    /// If `x` has rank 0, or `rows` or `columns` is `2³²` or more.
    fn activation_dropout(
        x: FloatTensor<Self>,
        dropout: AttentionDropout,
        stream: u32,
    ) -> FloatTensor<Self> {
        reference::activation_dropout::<Self>(x, dropout, stream)
    }

    /// `forward(input, parameters)`, of which `Autodiff<B>` keeps only `input` and
    /// `parameters` for the backward pass and runs `forward` again there, on fresh leaves with
    /// autodiff, to get their gradients (activation checkpointing, Chen et al., *Training Deep
    /// Nets with Sublinear Memory Cost*, 2016): one node whose parents are `input` and
    /// `parameters`. `forward` must compute the same output both times (the same dropout
    /// masks: see [`RecomputedForward`]). Other backends run `forward` once.
    ///
    /// # Shapes
    /// - `input`: `[batch, L, d_model]`; `parameters`: `[n]`, the layer's parameters
    ///   flattened; output: what `forward` returns, `[batch, L, d_model]`
    fn recompute(
        input: FloatTensor<Self>,
        parameters: FloatTensor<Self>,
        forward: RecomputedForward,
    ) -> FloatTensor<Self> {
        forward.call::<Self>(input, parameters)
    }

    /// The centroid attention of clustered and improved clustered attention in one op (paper
    /// eqs. 4–5 and 9–10): `Aᶜ = softmax(centroids · keysᵀ)` over the keys, with the keys at
    /// or past `key_lengths[b]` masked out, and `Aᶜ · values`; with `topk > 0` also the
    /// indices of the `topk` highest scores of every row, as [`Self::topk_indices`] picks
    /// them, and the weights `Aᶜ` at those keys, and then `values` is the rest of `Aᶜ · values`,
    /// over the keys outside the row's top-k (the second case of eq. 10, times `values`). The
    /// centroids come scaled by the softmax temperature.
    ///
    /// The default body composes `matmul`, [`Self::attention_softmax`] and [`Self::topk_indices`];
    /// the host loops of the CPU backends compute a block of cluster rows at a time in per-thread
    /// scratch memory, without the `[C, S]` scores and weights as tensors. `Autodiff<B>` runs `B`'s
    /// [`ClusteredAttentionBackward::centroid_attention_forward`] forward and
    /// [`ClusteredAttentionBackward::centroid_attention_backward`] backward.
    ///
    /// With `dropout` (training), the weights `Aᶜ` in `Aᶜ · values` (or its rest) are multiplied
    /// by the factors of [`AttentionDropout`] on the stream [`AttentionDropout::CLUSTER_ROWS`]
    /// (rows are the clusters); the top-k weights are returned undropped (they make the mass).
    /// The backward pass takes the same `dropout` and draws the same factors again. The host
    /// loops of the CPU backends and the CubeCL kernels draw them where they compute the
    /// weights, forward and backward.
    ///
    /// # Shapes
    /// - `centroids`: `[batch, heads, C, E]`, `keys`: `[batch, heads, S, E]`,
    ///   `values`: `[batch, heads, S, D]`
    /// - `key_lengths`: `[batch]` in `1..=S` ([`Lengths::All`]: every key is valid)
    /// - output: `values` `[batch, heads, C, D]` and, with `topk > 0`, `top`: the indices and
    ///   the weights, `[batch, heads, C, topk]` each (the fields of [`CentroidAttention`])
    ///
    /// # Panics
    /// If the shapes disagree or `topk > S`; the host loops also when a key length is outside
    /// `1..=S` (the default body does not read the lengths back from the device).
    #[allow(clippy::type_complexity)]
    fn centroid_attention(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        #[extension_type] key_lengths: Lengths<Self>,
        topk: usize,
        dropout: Option<AttentionDropout>,
    ) -> (
        FloatTensor<Self>,
        Option<(IntTensor<Self>, FloatTensor<Self>)>,
    ) {
        reference::centroid_attention::<Self>(centroids, keys, values, key_lengths, topk, dropout)
    }

    /// The per-query part of improved clustered attention in one op (paper eqs. 10–11): for
    /// every query `i` of cluster `j = assignments[b, h, i]`,
    /// `out[b, h, i] = m̂_j · Σ_r softmax_r(scale · queries[b, h, i] · keys[b, h, t_r]) ·
    /// values[b, h, t_r] + rest[b, h, j]` over the cluster's top-k keys
    /// `t_r = topk[b, h, j, r]`, the keys at or past `key_lengths[b]` taking no weight; rows of
    /// padded queries (`j = -1`) are zero.
    ///
    /// The default body composes [`Self::sparse_dot`], [`Self::attention_softmax`] and
    /// [`Self::sparse_weighted_sum`] with gathers of the cluster rows; the host loops of the CPU
    /// backends compute each query's scores, softmax and weighted sum in registers, one cluster's
    /// gathered keys and values at a time. `Autodiff<B>` runs `B`'s op forward and
    /// [`ClusteredAttentionBackward::top_attention_backward`] backward.
    ///
    /// With `dropout` (training), each weight `m̂_j · softmax_r` is multiplied by the factor of
    /// [`AttentionDropout`] on the stream [`AttentionDropout::QUERY_TOP`] at `(batch, head, i, r)`
    /// (rows are the queries, keys the ranks in the top-k); the backward pass takes the same
    /// `dropout`. The host loops of the CPU backends and the CubeCL kernel draw the factors
    /// where they compute the weights.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`,
    ///   `values`: `[batch, heads, S, D]`
    /// - `clusters`: [`ClusterTop`], `assignments` `[batch, heads, L]`, `topk`
    ///   `[batch, heads, C, k]`, `mass` `[batch, heads, C, 1]`, `rest` `[batch, heads, C, D]`
    /// - `key_lengths`: `[batch]` in `1..=S` ([`Lengths::All`]: every key is valid)
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// If the shapes disagree; the host loops also when a key length is outside `1..=S` or an
    /// index is out of range (the default body does not read them back from the device).
    fn top_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        #[extension_type] clusters: ClusterTop<Self>,
        #[extension_type] key_lengths: Lengths<Self>,
        scale: f64,
        dropout: Option<AttentionDropout>,
    ) -> FloatTensor<Self> {
        reference::top_attention::<Self>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            dropout,
        )
    }

    /// Improved clustered attention once the queries are clustered, in one op (paper eqs. 3–5
    /// and 9–11): the centroids `scale · inverse_counts[j] · Σ_{i ∈ j} queries_i` (eq. 3, and
    /// the scale of the scores), their [`Self::centroid_attention`] with the top-k keys, the
    /// mass `m̂` of those keys (eq. 9) and [`Self::top_attention`] of every query.
    ///
    /// The default body composes those ops ([`reference::improved_attention`]). Its use is the
    /// backward pass: `Autodiff<B>` records the whole as one node and differentiates it with
    /// [`ClusteredAttentionBackward::improved_attention_backward`], so that the gradients of the
    /// keys and values of the two fused ops, and of the queries through their centroids, are summed
    /// where the backend can do so in place. Carries no gradient to `clusters`. With `dropout`,
    /// both sets of weights are dropped as the two ops drop them.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`,
    ///   `values`: `[batch, heads, S, D]`
    /// - `clusters`: [`QueryClusters`], `assignments` `[batch, heads, L]`, `inverse_counts`
    ///   `[batch, heads, C, 1]`
    /// - `key_lengths`: `[batch]` in `1..=S` ([`Lengths::All`]: every key is valid)
    /// - `topk`: in `1..=S`
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// As [`Self::centroid_attention`] and [`Self::top_attention`]; if `topk` is 0.
    #[allow(clippy::too_many_arguments)]
    fn improved_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        #[extension_type] clusters: QueryClusters<Self>,
        #[extension_type] key_lengths: Lengths<Self>,
        topk: usize,
        scale: f64,
        dropout: Option<AttentionDropout>,
    ) -> FloatTensor<Self> {
        reference::improved_attention::<Self>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            topk,
            scale,
            dropout,
        )
    }

    /// Indices of the `k` largest scores of every row (the top-k keys of each cluster, paper
    /// §3.3), in descending order of score. Which of several equal scores is taken is up to
    /// the backend (the host loops and the CubeCL kernel take the lowest index; the default
    /// body sorts). Carries no gradient.
    ///
    /// # Shapes
    /// - `scores`: `[batch, heads, C, S]`
    /// - output: `[batch, heads, C, k]`, in `0..S`
    ///
    /// # Panics
    /// If `k` is 0 or greater than `S`.
    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        reference::topk_indices::<Self>(scores, k)
    }

    /// Dot products of every query with the top-k keys of its cluster (the numerators of
    /// paper eq. 10): `out[b, h, i, r] = queries[b, h, i] · keys[b, h, topk[b, h, a_i, r]]`
    /// with `a_i = assignments[b, h, i]`; rows of padded queries (`a_i = -1`) are zero.
    ///
    /// Its gradient is `sparse_weighted_sum(grad, keys)` for the queries and
    /// `sparse_scatter(grad, queries)` for the keys.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`
    /// - `topk`: `[batch, heads, C, k]` in `0..S`, `assignments`: `[batch, heads, L]` in
    ///   `0..C` or `-1`
    /// - output: `[batch, heads, L, k]`
    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::sparse_dot::<Self>(queries, keys, topk, assignments)
    }

    /// Weighted sums of the top-k values of every query's cluster (paper eq. 11, top-k
    /// part): `out[b, h, i] = Σ_r weights[b, h, i, r] · values[b, h, topk[b, h, a_i, r]]`;
    /// rows of padded queries are zero.
    ///
    /// Its gradient is `sparse_dot(grad, values)` for the weights and
    /// `sparse_scatter(weights, grad)` for the values.
    ///
    /// # Shapes
    /// - `weights`: `[batch, heads, L, k]`, `values`: `[batch, heads, S, D]`
    /// - `topk`: `[batch, heads, C, k]`, `assignments`: `[batch, heads, L]`
    /// - output: `[batch, heads, L, D]`
    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        reference::sparse_weighted_sum::<Self>(weights, values, topk, assignments)
    }

    /// The transpose of the two products above:
    /// `out[b, h, l] = Σ_{i, r : topk[b, h, a_i, r] = l} weights[b, h, i, r] · x[b, h, i]`
    /// over the valid queries `i`.
    ///
    /// Its gradient is `sparse_dot(x, grad)` for the weights and
    /// `sparse_weighted_sum(weights, grad)` for `x`.
    ///
    /// Each row of `topk` must hold distinct keys, as [`Self::topk_indices`] gives them (the
    /// CubeCL kernel inverts the rows).
    ///
    /// # Shapes
    /// - `weights`: `[batch, heads, L, k]`, `x`: `[batch, heads, L, F]`
    /// - `topk`: `[batch, heads, C, k]` in `0..keys_len`, `assignments`: `[batch, heads, L]`
    /// - output: `[batch, heads, keys_len, F]`
    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        reference::sparse_scatter::<Self>(weights, x, topk, assignments, keys_len)
    }
}

/// The backward passes of the fused ops of [`ClusteredAttentionBackend`], and their forward
/// passes with what the backward passes take: what `Autodiff<B>` asks of the backend `B` it
/// wraps, on `B`'s primitives (not a backend extension: `Dispatch` does not implement it).
///
/// Every method has a default body made of Burn tensor ops and the backend's own ops
/// ([`reference`](mod@reference)); NdArray, Flex and `Cube` implement it.
pub trait ClusteredAttentionBackward: ClusteredAttentionBackend {
    /// [`ClusteredAttentionBackend::centroid_attention`] with what its backward pass takes
    /// ([`CentroidAttention`]): its two outputs and, where the backend computes it (the host
    /// loops of the CPU backends), each row's log-sum-exp of the scores, so that
    /// [`Self::centroid_attention_backward`] has `Aᶜ` from one product. `Autodiff<B>` runs
    /// `B`'s centroid attention forward through it and keeps the result for
    /// [`Self::centroid_attention_backward`].
    ///
    /// The default body calls [`ClusteredAttentionBackend::centroid_attention`] and gives no
    /// log-sum-exp.
    ///
    /// # Shapes
    /// As [`ClusteredAttentionBackend::centroid_attention`]; the log-sum-exp is `[batch, heads, C, 1]` in `f32`.
    ///
    /// # Panics
    /// As [`ClusteredAttentionBackend::centroid_attention`].
    fn centroid_attention_forward(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
        dropout: Option<AttentionDropout>,
    ) -> CentroidAttention<Self> {
        let (values, top) =
            Self::centroid_attention(centroids, keys, values, key_lengths, topk, dropout);
        CentroidAttention {
            values,
            top,
            log_sum_exp: None,
        }
    }

    /// The gradients of [`ClusteredAttentionBackend::centroid_attention`] with respect to
    /// `centroids`, `keys` and `values`, given its result `forward` and the gradients of its two
    /// float outputs: `grad_values` of its `values` (`R · values`, where `R` is `Aᶜ` without the
    /// top-k keys' entries, or all of `Aᶜ` without `top`) and, with `top`, `grad_top_weights` of
    /// the weights at the top-k keys. With `dA = grad_values · valuesᵀ` outside the top-k keys
    /// and `grad_top_weights` at them, and `dS = Aᶜ ⊙ (dA − rowsum(Aᶜ ⊙ dA))` (the softmax's
    /// Jacobian): `centroids` gets `dS · keys`, `keys` gets `dSᵀ · centroids` and `values` gets
    /// `Rᵀ · grad_values`; padded keys get nothing. `Aᶜ` is recomputed, so the forward pass
    /// keeps no `[C, S]` tensor.
    ///
    /// The default body is made of Burn tensor ops and uses `forward`'s top-k indices only;
    /// the host loops of the CPU backends take `Aᶜ` from the scores and `forward`'s
    /// log-sum-exp, and `rowsum(Aᶜ ⊙ dA)` from `forward`'s outputs (`grad_values · values` of
    /// the rest plus `grad_top_weights · weights`), so that one pass over the keys, a block of
    /// cluster rows against a part of the keys at a time, gives the three gradients. The
    /// CubeCL kernels take `rowsum(Aᶜ ⊙ dA)` the same way and recompute `Aᶜ` tile by tile in
    /// shared memory, one pass over the keys for the centroids' gradient and one over the
    /// cluster rows for the keys' and values' (`E, D ≤ 128`, `k ≤ 64`; the default body
    /// otherwise).
    ///
    /// # Shapes
    /// As [`ClusteredAttentionBackend::centroid_attention`]; `forward`: its result for these
    /// inputs, `grad_top_weights`: `[batch, heads, C, topk]`,
    /// `grad_values`: `[batch, heads, C, D]`; the gradients have the shapes of their inputs
    /// ([`CentroidAttentionGrads`]).
    ///
    /// # Panics
    /// As [`ClusteredAttentionBackend::centroid_attention`]; if `forward.top` and
    /// `grad_top_weights` are not both given or both `None`, or the gradients' shapes disagree with
    /// the inputs'.
    #[allow(clippy::too_many_arguments)]
    fn centroid_attention_backward(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Lengths<Self>,
        forward: CentroidAttention<Self>,
        grad_values: FloatTensor<Self>,
        grad_top_weights: Option<FloatTensor<Self>>,
        dropout: Option<AttentionDropout>,
    ) -> CentroidAttentionGrads<Self> {
        reference::centroid_attention_backward::<Self>(
            centroids,
            keys,
            values,
            key_lengths,
            forward,
            grad_values,
            grad_top_weights,
            dropout,
        )
    }

    /// The gradients of [`ClusteredAttentionBackend::top_attention`] with respect to its five float
    /// inputs, given the gradient `grad` of its output: with `p_r` the softmax over the cluster's
    /// top-k keys, `w_r = m̂_j · p_r` and `δ_i = Σ_r p_r · (grad_i · values[t_r])`,
    /// - `values[t_r]` gets `Σ_i w_r · grad_i` and `rest[j]` gets `Σ_i grad_i`;
    /// - `mass[j]` gets `Σ_i δ_i`;
    /// - with `ds_r = scale · m̂_j · p_r · (grad_i · values[t_r] − δ_i)` (the softmax's
    ///   Jacobian), `queries[i]` gets `Σ_r ds_r · keys[t_r]` and `keys[t_r]` gets
    ///   `Σ_i ds_r · queries[i]`,
    ///
    /// summed over the valid queries `i` of each cluster `j`; padded queries and padded keys get
    /// nothing. `Autodiff<B>` overrides [`ClusteredAttentionBackend::top_attention`] to call it, so
    /// the forward pass keeps no `[L, k]` tensor: the scores and the softmax are recomputed here.
    ///
    /// The default body composes [`ClusteredAttentionBackend::sparse_dot`],
    /// [`ClusteredAttentionBackend::attention_softmax`],
    /// [`ClusteredAttentionBackend::sparse_weighted_sum`] and
    /// [`ClusteredAttentionBackend::sparse_scatter`]; the host loops of the CPU backends compute
    /// each cluster's block in one pass over its members.
    ///
    /// # Shapes
    /// As [`ClusteredAttentionBackend::top_attention`]; `grad`: `[batch, heads, L, D]`; the
    /// gradients have the shapes of their inputs ([`TopAttentionGrads`]).
    ///
    /// # Panics
    /// As [`ClusteredAttentionBackend::top_attention`], and if `grad` is not
    /// `[batch, heads, L, D]`.
    #[allow(clippy::too_many_arguments)]
    fn top_attention_backward(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: ClusterTop<Self>,
        key_lengths: Lengths<Self>,
        scale: f64,
        grad: FloatTensor<Self>,
        dropout: Option<AttentionDropout>,
    ) -> TopAttentionGrads<Self> {
        reference::top_attention_backward::<Self>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            grad,
            dropout,
        )
    }

    /// [`ClusteredAttentionBackend::improved_attention`] with the intermediate results its backward
    /// pass takes ([`ImprovedForward`]): the centroids, their [`Self::centroid_attention_forward`]
    /// with the top-k keys and the mass `m̂` (eq. 9). `Autodiff<B>` runs `B`'s forward through it
    /// and keeps those results for [`Self::improved_attention_backward`].
    ///
    /// The default body composes the backend's ops ([`reference::improved_attention_forward`]).
    ///
    /// # Shapes
    /// As [`ClusteredAttentionBackend::improved_attention`]; the intermediate results are described
    /// at [`ImprovedForward`].
    ///
    /// # Panics
    /// As [`ClusteredAttentionBackend::improved_attention`].
    #[allow(clippy::too_many_arguments)]
    fn improved_attention_forward(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
        scale: f64,
        dropout: Option<AttentionDropout>,
    ) -> (FloatTensor<Self>, ImprovedForward<Self>) {
        reference::improved_attention_forward::<Self>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            topk,
            scale,
            dropout,
        )
    }

    /// The gradients of [`ClusteredAttentionBackend::improved_attention`] with respect to
    /// `queries`, `keys` and `values`, given its intermediate results `forward` (as
    /// [`Self::improved_attention_forward`] returns them) and the gradient `grad` of its output:
    /// [`Self::top_attention_backward`], then [`Self::centroid_attention_backward`] of the rest's
    /// and the mass's gradients (the mass is the sum of the top-k weights), the centroids' gradient
    /// spread back to their member queries (times `scale` and the inverse count), and the sums of
    /// the two ops' gradients.
    ///
    /// The default body composes those ops ([`reference::improved_attention_backward`]); the
    /// host loops of the CPU backends add the centroid attention's gradients of the keys and
    /// values, and the centroids' share of the queries', into the top-k attention's in place.
    ///
    /// # Shapes
    /// As [`ClusteredAttentionBackend::improved_attention`]; `grad`: `[batch, heads, L, D]`; the
    /// gradients have the shapes of their inputs ([`AttentionGrads`]).
    ///
    /// # Panics
    /// As [`ClusteredAttentionBackend::improved_attention`], and if `forward` or `grad` does not
    /// fit the inputs.
    #[allow(clippy::too_many_arguments)]
    fn improved_attention_backward(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Lengths<Self>,
        scale: f64,
        forward: ImprovedForward<Self>,
        grad: FloatTensor<Self>,
        dropout: Option<AttentionDropout>,
    ) -> AttentionGrads<Self> {
        reference::improved_attention_backward::<Self>(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            forward,
            grad,
            dropout,
        )
    }
}
