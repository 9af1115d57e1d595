//! Default bodies of [`ClusteringBackend`], made of Burn tensor ops.
//!
//! They serve every backend that has no kernel of its own (NdArray, Flex, LibTorch, Candle,
//! …) and are the specification that kernels must reproduce bit for bit. All arithmetic
//! on bits and counts is done on small integers held exactly by the backend's float type
//! (Hamming distances ≤ 32, counts ≤ L < 2²⁴ for `f32`).

use core::ops::Range;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{
    Bool, ElementConversion, IndexingUpdateOp, Int, Tensor, TensorData, TensorMetadata,
    TensorPrimitive,
};

use super::{
    AttentionGrads, CentroidAttention, CentroidAttentionGrads, ClusterTop, ClusteringBackend,
    ImprovedForward, MAX_BITS, NO_CLUSTER, QueryClusters, TopAttentionGrads, host_lengths,
    initial_centroid_positions,
};

/// Panics unless `1 ≤ bits ≤ 32`.
pub(crate) fn check_bits(bits: usize) {
    assert!(
        (1..=MAX_BITS).contains(&bits),
        "bits must be in 1..={MAX_BITS} (codes are u32 words), got {bits}"
    );
}

/// Checks `bits` ([`check_bits`]) and that `planes [bits, E + 1]` fit `queries [batch, heads, L, E]`.
///
/// # Panics
/// If `bits` is outside `1..=32` or `planes` does not have `E + 1` columns.
pub(crate) fn check_planes(queries: [usize; 4], planes: [usize; 2]) {
    let [bits, columns] = planes;
    check_bits(bits);
    assert!(
        columns == queries[3] + 1,
        "planes must have shape [bits, E + 1] = [{bits}, {}] for queries of shape {:?}, got {:?}",
        queries[3] + 1,
        queries,
        planes
    );
}

/// The value of bit `b` in a code held as an `i32` two's complement pattern:
/// `2^b` for `b < 31` and `-2^31` for the sign bit.
fn bit_values(bits: usize) -> Vec<i64> {
    (0..bits)
        .map(|b| if b == 31 { i32::MIN as i64 } else { 1i64 << b })
        .collect()
}

/// Default body of [`ClusteringBackend::lsh_hash`].
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `planes`: `[bits, E + 1]`
/// - output: `[batch, heads, L]`
///
/// # Panics
/// If `bits` is outside `1..=32` or `planes` does not have `E + 1` columns.
pub fn lsh_hash<B: Backend>(queries: FloatTensor<B>, planes: FloatTensor<B>) -> IntTensor<B> {
    let queries = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(queries));
    let planes = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(planes));
    let [batch, heads, len, dim] = queries.dims();
    let [bits, _] = planes.dims();
    check_planes(queries.dims(), planes.dims());
    let device = queries.device();
    let rows = batch * heads * len;

    let normals = planes.clone().slice([0..bits, 0..dim]).transpose(); // [E, bits]
    let thresholds = planes.slice([0..bits, dim..dim + 1]).reshape([1, bits]);
    let projections = queries.reshape([rows, dim]).matmul(normals); // [rows, bits]
    let set = projections.greater(thresholds.expand([rows, bits]));
    let values = Tensor::<B, 1, Int>::from_data(TensorData::new(bit_values(bits), [bits]), &device)
        .reshape([1, bits]);
    set.int()
        .mul(values)
        .sum_dim(1)
        .reshape([batch, heads, len])
        .into_primitive()
}

/// Unpacks 32-bit codes `[batch, heads, n]` into their bits `[batch, heads, n, 32]` as 0/1
/// integers, bit `b` in column `b`.
fn unpack_bits<B: Backend>(codes: Tensor<B, 3, Int>) -> Tensor<B, 4, Int> {
    let [batch, heads, n] = codes.dims();
    let shifts = Tensor::<B, 1, Int>::arange(0..MAX_BITS as i64, &codes.device())
        .reshape([1, 1, 1, MAX_BITS])
        .expand([batch, heads, n, MAX_BITS]);
    codes
        .unsqueeze_dim::<4>(3)
        .expand([batch, heads, n, MAX_BITS])
        .bitwise_right_shift(shifts)
        .bitwise_and_scalar(1.elem())
}

/// Default body of [`ClusteringBackend::hamming_kmeans`].
///
/// Hamming distances come from a matrix product of ±1 bit vectors
/// (`popcount(a xor b) = (32 − s_a · s_b) / 2`), the per-bit majority vote from a product of
/// the one-hot assignment matrix with the 0/1 bit matrix. All of it is integer tensor
/// arithmetic, so the result does not depend on the backend's float type.
///
/// # Shapes
/// - `codes`: `[batch, heads, L]`
/// - `query_lengths`: `[batch]`
/// - outputs: assignments `[batch, heads, L]`, counts `[batch, heads, clusters]`
///
/// # Panics
/// If `clusters` is 0 or a query length is outside `0..=L`.
pub fn hamming_kmeans<B: Backend>(
    codes: IntTensor<B>,
    query_lengths: Option<IntTensor<B>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (IntTensor<B>, IntTensor<B>) {
    assert!(clusters > 0, "clusters must be at least 1, got 0");
    let codes = Tensor::<B, 3, Int>::from_primitive(codes);
    let [batch, heads, len] = codes.dims();
    let device = codes.device();
    let lengths = host_lengths::<B>(
        "query_lengths",
        query_lengths.map(Tensor::from_primitive),
        batch,
        len,
    );

    // valid[b, 0, i] = i < lengths[b]
    let lengths_tensor = Tensor::<B, 1, Int>::from_data(
        TensorData::new(lengths.iter().map(|&n| n as i64).collect(), [batch]),
        &device,
    );
    let valid = Tensor::<B, 1, Int>::arange(0..len as i64, &device)
        .reshape([1, 1, len])
        .expand([batch, heads, len])
        .lower(
            lengths_tensor
                .clone()
                .reshape([batch, 1, 1])
                .expand([batch, heads, len]),
        );

    let positions = initial_centroid_positions(&lengths, heads, clusters, seed);
    let positions = Tensor::<B, 3, Int>::from_data(
        TensorData::new(positions, [batch, heads, clusters]),
        &device,
    );
    let mut centroids = unpack_bits(codes.clone().gather(2, positions)); // [b, h, C, 32]

    // Bits of the valid queries (padded rows zeroed so they never vote) and their ±1 signs.
    let valid_int = valid.clone().int().unsqueeze_dim::<4>(3);
    let code_bits = unpack_bits(codes) * valid_int.clone(); // [b, h, L, 32]
    let code_signs = code_bits.clone().mul_scalar(2).sub_scalar(1);
    let cluster_index = Tensor::<B, 1, Int>::arange(0..clusters as i64, &device)
        .reshape([1, 1, 1, clusters])
        .expand([batch, heads, len, clusters]);

    // Nearest centroid, ties to the lowest index: minimise distance · C + index.
    let assign = |centroids: &Tensor<B, 4, Int>| -> Tensor<B, 3, Int> {
        let centroid_signs = centroids.clone().mul_scalar(2).sub_scalar(1);
        let dots = code_signs.clone().matmul(centroid_signs.swap_dims(2, 3)); // [b, h, L, C]
        let distance = dots.neg().add_scalar(MAX_BITS as i64).div_scalar(2);
        let key = distance
            .mul_scalar(clusters as i64)
            .add(cluster_index.clone())
            .min_dim(3);
        key.remainder_scalar(clusters as i64).squeeze_dim::<3>(3)
    };
    // One-hot membership of the valid queries, [b, h, L, C].
    let members = |assignments: Tensor<B, 3, Int>| -> Tensor<B, 4, Int> {
        assignments
            .unsqueeze_dim::<4>(3)
            .expand([batch, heads, len, clusters])
            .equal(cluster_index.clone())
            .int()
            * valid_int.clone()
    };

    for _ in 0..iterations {
        let members = members(assign(&centroids));
        let counts = members.clone().sum_dim(2).swap_dims(2, 3); // [b, h, C, 1]
        let ones = members.swap_dims(2, 3).matmul(code_bits.clone()); // [b, h, C, 32]
        let twice = ones.mul_scalar(2);
        let counts = counts.expand([batch, heads, clusters, MAX_BITS]);
        let set = twice.clone().greater(counts.clone());
        let clear = twice.lower(counts);
        centroids = centroids.mask_fill(set, 1).mask_fill(clear, 0);
    }

    let assignments = assign(&centroids);
    let counts = members(assignments.clone()).sum_dim(2).squeeze_dim::<3>(2);

    // Sequences with no more valid queries than clusters: query i is cluster i.
    let exact = Tensor::<B, 1, Int>::from_data(
        TensorData::new(
            lengths.iter().map(|&n| i64::from(n <= clusters)).collect(),
            [batch],
        ),
        &device,
    )
    .bool()
    .reshape([batch, 1, 1]);
    let identity = Tensor::<B, 1, Int>::arange(0..len as i64, &device)
        .reshape([1, 1, len])
        .expand([batch, heads, len]);
    let assignments = assignments
        .mask_where(exact.clone().expand([batch, heads, len]), identity)
        .mask_fill(valid.bool_not(), NO_CLUSTER);
    let singletons = Tensor::<B, 1, Int>::arange(0..clusters as i64, &device)
        .reshape([1, 1, clusters])
        .expand([batch, heads, clusters])
        .lower(
            lengths_tensor
                .reshape([batch, 1, 1])
                .expand([batch, heads, clusters]),
        )
        .int();
    let counts = counts.mask_where(exact.expand([batch, heads, clusters]), singletons);

    (assignments.into_primitive(), counts.into_primitive())
}

/// Default body of [`ClusteringBackend::topk_indices`]:
/// a descending sort of each row, then its first `k` indices.
///
/// # Panics
/// If `k` is 0 or greater than `S`.
pub fn topk_indices<B: Backend>(scores: FloatTensor<B>, k: usize) -> IntTensor<B> {
    let scores = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(scores));
    let [batch, heads, rows, len] = scores.dims();
    check_topk(k, len);
    let (_, order) = scores.sort_descending_with_indices(3);
    order
        .slice([0..batch, 0..heads, 0..rows, 0..k])
        .into_primitive()
}

/// Default body of [`ClusteringBackend::centroid_attention`]: the scores as a `[C, S]`
/// matrix product, the padded keys filled with `-inf`, [`ClusteringBackend::attention_softmax`]
/// and [`ClusteringBackend::topk_indices`] (all keys in order when `topk = S`).
///
/// # Panics
/// If the shapes disagree or `topk > S`.
pub fn centroid_attention<B: ClusteringBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
) -> CentroidAttention<B> {
    let float = |x| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let (centroids, keys, values) = (float(centroids), float(keys), float(values));
    let [batch, heads, clusters, _] = centroids.dims();
    let [_, _, keys_len, _] = keys.dims();
    check_centroid_attention(centroids.dims(), keys.dims(), values.dims(), topk);
    let device = centroids.device();
    let scores = centroid_scores(centroids, keys, key_lengths);
    let weights = float(B::attention_softmax(
        scores.clone().into_primitive().tensor(),
    ));
    let top = (topk > 0).then(|| {
        let top = if topk == keys_len {
            Tensor::<B, 1, Int>::arange(0..topk as i64, &device)
                .reshape([1, 1, 1, topk])
                .expand([batch, heads, clusters, topk])
        } else {
            Tensor::<B, 4, Int>::from_primitive(B::topk_indices(
                scores.into_primitive().tensor(),
                topk,
            ))
        };
        let top_weights = weights.clone().gather(3, top.clone());
        (top, top_weights)
    });
    let values = match &top {
        Some((top, top_weights)) => rest_weights(weights, top.clone(), top_weights.clone()),
        None => weights,
    }
    .matmul(values);
    CentroidAttention {
        values: values.into_primitive().tensor(),
        top: top.map(|(top, weights)| (top.into_primitive(), weights.into_primitive().tensor())),
        log_sum_exp: None,
    }
}

/// `weights` with each row's top-k entries set to exactly zero (`w + (−w) = 0`; a row's top-k
/// keys are distinct), the weights of the rest of `Aᶜ V`: subtracting the top-k share from all
/// of `Aᶜ V` instead would cancel when the top-k mass is near 1.
pub(crate) fn rest_weights<B: Backend>(
    weights: Tensor<B, 4>,
    top: Tensor<B, 4, Int>,
    top_weights: Tensor<B, 4>,
) -> Tensor<B, 4> {
    weights.scatter(3, top, top_weights.neg(), IndexingUpdateOp::Add)
}

/// `centroids · keysᵀ` with the keys at or past `key_lengths[b]` at `-inf`,
/// `[batch, heads, C, S]`.
fn centroid_scores<B: Backend>(
    centroids: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    key_lengths: Option<IntTensor<B>>,
) -> Tensor<B, 4> {
    let [batch, heads, clusters, _] = centroids.dims();
    let keys_len = keys.dims()[2];
    let device = centroids.device();
    let scores = centroids.matmul(keys.swap_dims(2, 3));
    let Some(lengths) = key_lengths else {
        return scores;
    };
    let positions = Tensor::<B, 1, Int>::arange(0..keys_len as i64, &device)
        .reshape([1, 1, 1, keys_len])
        .expand([batch, 1, 1, keys_len]);
    let padded = padded_keys(lengths, positions);
    scores.mask_fill(
        padded.expand([batch, heads, clusters, keys_len]),
        f32::NEG_INFINITY,
    )
}

/// Default body of [`ClusteringBackend::centroid_attention_backward`]: `Aᶜ` recomputed as
/// [`centroid_attention`] computes it, then the softmax's Jacobian and three products.
///
/// Uses `forward`'s top-k indices only.
///
/// # Panics
/// If the shapes disagree, or `forward.top` and `grad_top_weights` are not both given or both
/// `None`.
pub fn centroid_attention_backward<B: ClusteringBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Option<IntTensor<B>>,
    forward: CentroidAttention<B>,
    grad_values: FloatTensor<B>,
    grad_top_weights: Option<FloatTensor<B>>,
) -> CentroidAttentionGrads<B> {
    let (centroids, keys, values) = (
        float4::<B>(centroids),
        float4::<B>(keys),
        float4::<B>(values),
    );
    let grad_values = float4::<B>(grad_values);
    let [batch, heads, clusters, _] = centroids.dims();
    let dim_v = values.dims()[3];
    check_centroid_attention(centroids.dims(), keys.dims(), values.dims(), 0);
    assert!(
        grad_values.dims() == [batch, heads, clusters, dim_v],
        "grad_values {:?} must be [batch, heads, C, D] = {:?}",
        grad_values.dims(),
        [batch, heads, clusters, dim_v]
    );
    let scores = centroid_scores(centroids.clone(), keys.clone(), key_lengths);
    let weights = float4::<B>(B::attention_softmax(scores.into_primitive().tensor()));
    let mut grad_weights = grad_values.clone().matmul(values.swap_dims(2, 3));
    let mut rest = weights.clone();
    match (forward.top.map(|(top, _)| top), grad_top_weights) {
        (Some(top), Some(grad_top)) => {
            let (top, grad_top) = (
                Tensor::<B, 4, Int>::from_primitive(top),
                float4::<B>(grad_top),
            );
            assert!(
                top.dims() == grad_top.dims() && top.dims()[..3] == [batch, heads, clusters],
                "top {:?} and grad_top_weights {:?} must both be [batch, heads, C, k] with \
                 [batch, heads, C] = {:?}",
                top.dims(),
                grad_top.dims(),
                [batch, heads, clusters]
            );
            // A top-k key's weight reaches the output through the top-k weights only: its
            // entry of dA is its weight's gradient, and the rest's weights leave it out (a
            // row's top-k keys are distinct, so each adds to its own entry).
            let in_top = weights
                .zeros_like()
                .scatter(3, top.clone(), grad_top.ones_like(), IndexingUpdateOp::Add)
                .greater_elem(0.5);
            grad_weights = grad_weights.mask_fill(in_top.clone(), 0.0).scatter(
                3,
                top,
                grad_top,
                IndexingUpdateOp::Add,
            );
            rest = rest.mask_fill(in_top, 0.0);
        }
        (None, None) => {}
        _ => panic!("top and grad_top_weights must be both given or both None"),
    }
    let delta = (weights.clone() * grad_weights.clone()).sum_dim(3);
    let grad_scores = weights.clone() * (grad_weights - delta);
    CentroidAttentionGrads {
        centroids: float_out(grad_scores.clone().matmul(keys)),
        keys: float_out(grad_scores.swap_dims(2, 3).matmul(centroids)),
        values: float_out(rest.swap_dims(2, 3).matmul(grad_values)),
    }
}

/// Whether each key index of `keys` (`[batch, …]`) is padding, at or past its sequence's
/// `key_lengths[b]`.
///
/// # Panics
/// If `key_lengths` is not `[batch]`.
fn padded_keys<B: Backend>(
    key_lengths: IntTensor<B>,
    keys: Tensor<B, 4, Int>,
) -> Tensor<B, 4, Bool> {
    let lengths = Tensor::<B, 1, Int>::from_primitive(key_lengths);
    let shape = keys.dims();
    let batch = shape[0];
    assert!(
        lengths.dims() == [batch],
        "key_lengths must have shape [batch] = [{batch}], got {:?}",
        lengths.dims()
    );
    keys.greater_equal(lengths.reshape([batch, 1, 1, 1]).expand(shape))
}

/// Checks the shapes of a [`ClusteringBackend::centroid_attention`] call.
///
/// # Panics
/// If `centroids [batch, heads, C, E]`, `keys [batch, heads, S, E]` and
/// `values [batch, heads, S, D]` disagree, or `topk > S`.
pub(crate) fn check_centroid_attention(
    centroids: [usize; 4],
    keys: [usize; 4],
    values: [usize; 4],
    topk: usize,
) {
    assert!(
        centroids[..2] == keys[..2]
            && keys[..3] == values[..3]
            && centroids[3] == keys[3]
            && keys[2] > 0,
        "centroids {centroids:?}, keys {keys:?} and values {values:?} must be \
         [batch, heads, C, E], [batch, heads, S, E] and [batch, heads, S, D] with S > 0"
    );
    assert!(
        topk <= keys[2],
        "topk must be in 0..={} (the number of keys), got {topk}",
        keys[2]
    );
}

/// The clustering as the sparse products take it: each cluster a one-key "top-k" of its own
/// index, `[batch, heads, C, 1]`, and unit weights for the queries, `[batch, heads, L, 1]` (in
/// the queries' float type).
fn cluster_identity<B: Backend>(
    queries: &FloatTensor<B>,
    clusters: usize,
) -> (IntTensor<B>, FloatTensor<B>) {
    let [batch, heads, len, _] = queries.shape().dims();
    let device = B::float_device(queries);
    let identity = Tensor::<B, 1, Int>::arange(0..clusters as i64, &device)
        .reshape([1, 1, clusters, 1])
        .expand([batch, heads, clusters, 1]);
    let ones = Tensor::<B, 4>::ones([batch, heads, len, 1], (&device, queries.dtype()));
    (identity.into_primitive(), float_out(ones))
}

/// Checks the shapes of a [`ClusteringBackend::improved_attention`] call's clustering and
/// returns `C`.
///
/// # Panics
/// If `assignments` is not `[batch, heads, L]` or `inverse_counts` not `[batch, heads, C, 1]`.
pub(crate) fn check_query_clusters(
    queries: [usize; 4],
    clusters: &QueryClusters<impl Backend>,
) -> usize {
    let [batch, heads, len, _] = queries;
    let assignments: [usize; 3] = clusters.assignments.shape().dims();
    let inverse: [usize; 4] = clusters.inverse_counts.shape().dims();
    assert!(
        assignments == [batch, heads, len] && inverse[..2] == [batch, heads] && inverse[3] == 1,
        "clusters.assignments {assignments:?} must be [batch, heads, L] = {:?} and \
         clusters.inverse_counts {inverse:?} [batch, heads, C, 1]",
        [batch, heads, len]
    );
    inverse[2]
}

/// Default body of [`ClusteringBackend::improved_attention`]: [`improved_attention_forward`]'s
/// output.
pub fn improved_attention<B: ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
    scale: f64,
) -> FloatTensor<B> {
    improved_attention_forward::<B>(queries, keys, values, clusters, key_lengths, topk, scale).0
}

/// [`ClusteringBackend::improved_attention`] composed of the backend's ops, with the
/// intermediate results its backward pass takes: the centroids' sums by
/// [`ClusteringBackend::sparse_scatter`], times the inverse counts and `scale`, their
/// [`ClusteringBackend::centroid_attention`] with the top-k keys, the top-k weights' sum (the
/// mass) and [`ClusteringBackend::top_attention`].
///
/// # Panics
/// As [`ClusteringBackend::improved_attention`].
pub fn improved_attention_forward<B: ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
    scale: f64,
) -> (FloatTensor<B>, ImprovedForward<B>) {
    assert!(topk > 0, "topk must be at least 1, got 0");
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let (identity, ones) = cluster_identity::<B>(&queries, num_clusters);
    let sums = B::sparse_scatter(
        ones,
        queries.clone(),
        identity,
        clusters.assignments.clone(),
        num_clusters,
    );
    let centroids =
        float_out((float4::<B>(sums) * float4::<B>(clusters.inverse_counts)).mul_scalar(scale));
    let attention = B::centroid_attention(
        centroids.clone(),
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
    );
    let (top, top_weights) = attention.top.clone().expect("topk ≥ 1 gives the top-k");
    let mass = float_out(float4::<B>(top_weights).sum_dim(3));
    let output = B::top_attention(
        queries,
        keys,
        values,
        ClusterTop {
            assignments: clusters.assignments,
            topk: top,
            mass: mass.clone(),
            rest: attention.values.clone(),
        },
        key_lengths,
        scale,
    );
    let forward = ImprovedForward {
        centroids,
        centroid_attention: attention,
        mass,
    };
    (output, forward)
}

/// Default body of [`ClusteringBackend::improved_attention_backward`]:
/// [`ClusteringBackend::top_attention_backward`], [`ClusteringBackend::centroid_attention_backward`]
/// of the rest's gradient and of the mass's spread over the top-k weights, the centroids'
/// gradient spread to their member queries by [`ClusteringBackend::sparse_weighted_sum`], and
/// the sums of the gradients.
///
/// # Panics
/// As [`ClusteringBackend::improved_attention_backward`].
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<B: ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: QueryClusters<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    forward: ImprovedForward<B>,
    grad: FloatTensor<B>,
) -> AttentionGrads<B> {
    let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
    let ImprovedForward {
        centroids,
        centroid_attention,
        mass,
    } = forward;
    let (top, top_weights) = centroid_attention
        .top
        .clone()
        .expect("the forward pass of improved attention has the top-k");
    let top_grads = B::top_attention_backward(
        queries.clone(),
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
    let grad_top_weights = float4::<B>(top_grads.mass).expand(top_weights.shape().dims::<4>());
    let centroid_grads = B::centroid_attention_backward(
        centroids,
        keys,
        values,
        key_lengths,
        centroid_attention,
        top_grads.rest,
        Some(float_out(grad_top_weights)),
    );
    let grad_sums = float4::<B>(centroid_grads.centroids)
        * float4::<B>(clusters.inverse_counts).mul_scalar(scale);
    let (identity, ones) = cluster_identity::<B>(&queries, num_clusters);
    let grad_queries =
        B::sparse_weighted_sum(ones, float_out(grad_sums), identity, clusters.assignments);
    AttentionGrads {
        queries: float_out(float4::<B>(top_grads.queries) + float4::<B>(grad_queries)),
        keys: float_out(float4::<B>(top_grads.keys) + float4::<B>(centroid_grads.keys)),
        values: float_out(float4::<B>(top_grads.values) + float4::<B>(centroid_grads.values)),
    }
}

/// Default body of [`ClusteringBackend::top_attention`]: the top-k scores by
/// [`ClusteringBackend::sparse_dot`], the padded keys' `-inf` and the mass gathered from each
/// query's cluster row, [`ClusteringBackend::attention_softmax`],
/// [`ClusteringBackend::sparse_weighted_sum`] and the cluster's `rest` row (zero for padded
/// queries).
///
/// # Panics
/// If the shapes disagree.
pub fn top_attention<B: ClusteringBackend>(
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
    let [batch, heads, len, _] = queries.shape().dims();
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
    let rows = ClusterRows::new(&assignments);
    let weights = top_softmax::<B>(
        queries,
        keys,
        &topk,
        &assignments,
        &rows,
        key_lengths,
        scale,
    ) * rows.per_query(mass);
    let top = B::sparse_weighted_sum(
        weights.into_primitive().tensor(),
        values,
        topk.into_primitive(),
        assignments.clone().into_primitive(),
    );
    let padded = assignments
        .lower_elem(0)
        .unsqueeze_dim::<4>(3)
        .expand([batch, heads, len, dim_v]);
    float_out(float4::<B>(top) + rows.per_query(rest).mask_fill(padded, 0.0))
}

/// Default body of [`ClusteringBackend::top_attention_backward`]: the softmax recomputed as
/// [`top_attention`] computes it, then the products of its gradient, each a sparse product or
/// a sum over each cluster's members.
///
/// # Panics
/// If the shapes disagree.
pub fn top_attention_backward<B: ClusteringBackend>(
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
    let rows = ClusterRows::new(&assignments);
    let probs = top_softmax::<B>(
        queries.clone(),
        keys.clone(),
        &topk,
        &assignments,
        &rows,
        key_lengths,
        scale,
    );
    let query_mass = rows.per_query(mass);
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
        mass: float_out(rows.per_cluster(delta, num_clusters)),
        rest: float_out(rows.per_cluster(grad, num_clusters)),
    }
}

/// Each query's softmax over its cluster's top-k keys (paper eq. 10 before the mass),
/// `[batch, heads, L, k]`: `scale · q · k` by [`ClusteringBackend::sparse_dot`], the padded keys
/// at `-inf`, [`ClusteringBackend::attention_softmax`]. Rows of padded queries are finite.
fn top_softmax<B: ClusteringBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: &Tensor<B, 4, Int>,
    assignments: &Tensor<B, 3, Int>,
    rows: &ClusterRows<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
) -> Tensor<B, 4> {
    let mut scores = float4::<B>(B::sparse_dot(
        queries,
        keys,
        topk.clone().into_primitive(),
        assignments.clone().into_primitive(),
    ))
    .mul_scalar(scale);
    if let Some(lengths) = key_lengths {
        let padded = padded_keys(lengths, topk.clone());
        let bias = Tensor::<B, 4>::zeros(topk.dims(), (&scores.device(), scores.dtype()))
            .mask_fill(padded, f32::NEG_INFINITY);
        scores = scores + rows.per_query(bias);
    }
    float4::<B>(B::attention_softmax(scores.into_primitive().tensor()))
}

/// Each query's cluster row, `[batch, heads, L, 1]` (cluster 0 for a padded query, whose
/// output and gradients are zeroed by the caller).
struct ClusterRows<B: Backend>(Tensor<B, 4, Int>);

impl<B: Backend> ClusterRows<B> {
    fn new(assignments: &Tensor<B, 3, Int>) -> Self {
        Self(assignments.clone().clamp_min(0).unsqueeze_dim::<4>(3))
    }

    fn expand(&self, width: usize) -> Tensor<B, 4, Int> {
        let [batch, heads, len, _] = self.0.dims();
        self.0.clone().expand([batch, heads, len, width])
    }

    /// Each query's row of the per-cluster `x`, `[batch, heads, C, F]` → `[batch, heads, L, F]`.
    fn per_query(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let width = x.dims()[3];
        x.gather(2, self.expand(width))
    }

    /// The sums of `x` over each cluster's members, `[batch, heads, L, F]` →
    /// `[batch, heads, clusters, F]`.
    fn per_cluster(&self, x: Tensor<B, 4>, clusters: usize) -> Tensor<B, 4> {
        let [batch, heads, _, width] = x.dims();
        Tensor::<B, 4>::zeros([batch, heads, clusters, width], (&x.device(), x.dtype())).scatter(
            2,
            self.expand(width),
            x,
            IndexingUpdateOp::Add,
        )
    }
}

/// Checks the shapes of a [`ClusteringBackend::top_attention`] call.
///
/// # Panics
/// If `queries [batch, heads, L, E]`, `keys [batch, heads, S, E]`, `values [batch, heads, S, D]`,
/// `assignments [batch, heads, L]`, `topk [batch, heads, C, k]`, `mass [batch, heads, C, 1]`
/// and `rest [batch, heads, C, D]` disagree, or `k` is 0 or above `S`.
pub(crate) fn check_top_attention(
    queries: [usize; 4],
    keys: [usize; 4],
    values: [usize; 4],
    assignments: [usize; 3],
    topk: [usize; 4],
    mass: [usize; 4],
    rest: [usize; 4],
) {
    let [batch, heads, len, dim] = queries;
    let [_, _, keys_len, dim_v] = values;
    let [_, _, clusters, k] = topk;
    assert!(
        keys == [batch, heads, keys_len, dim]
            && assignments == [batch, heads, len]
            && topk[..2] == [batch, heads]
            && mass == [batch, heads, clusters, 1]
            && rest == [batch, heads, clusters, dim_v],
        "queries {queries:?}, keys {keys:?}, values {values:?}, assignments {assignments:?}, \
         topk {topk:?}, mass {mass:?} and rest {rest:?} must be [batch, heads, L, E], \
         [batch, heads, S, E], [batch, heads, S, D], [batch, heads, L], [batch, heads, C, k], \
         [batch, heads, C, 1] and [batch, heads, C, D]"
    );
    check_topk(k, keys_len);
}

/// Panics unless `1 ≤ k ≤ len`.
pub(crate) fn check_topk(k: usize, len: usize) {
    assert!(
        (1..=len).contains(&k),
        "topk must be in 1..={len} (the number of keys), got {k}"
    );
}

/// The top-k indices of each query's cluster, `[batch, heads, L, k]` (padded queries read
/// cluster 0), and the `[batch, heads, L, 1]` mask of the padded queries.
fn query_topk<B: Backend>(
    topk: Tensor<B, 4, Int>,
    assignments: Tensor<B, 3, Int>,
) -> (Tensor<B, 4, Int>, Tensor<B, 4, Bool>) {
    let [batch, heads, len] = assignments.dims();
    let [_, _, _, k] = topk.dims();
    let padded = assignments.clone().lower_elem(0).unsqueeze_dim::<4>(3);
    let index = assignments
        .clamp_min(0)
        .unsqueeze_dim::<4>(3)
        .expand([batch, heads, len, k]);
    (topk.gather(2, index), padded)
}

/// Rows `index[b, h, i, r]` of `x[b, h]`: `[batch, heads, N, k, F]`.
fn gather_rows<B: Backend>(x: Tensor<B, 4>, index: Tensor<B, 4, Int>) -> Tensor<B, 5> {
    let [batch, heads, rows, features] = x.dims();
    let [_, _, n, k] = index.dims();
    let offsets = Tensor::<B, 1, Int>::arange(0..(batch * heads) as i64, &index.device())
        .mul_scalar(rows as i64)
        .reshape([batch, heads, 1, 1]);
    let flat_index = (index + offsets).reshape([batch * heads * n * k]);
    x.reshape([batch * heads * rows, features])
        .select(0, flat_index)
        .reshape([batch, heads, n, k, features])
}

fn float4<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

fn float_out<B: Backend>(x: Tensor<B, 4>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

/// Largest tensor a sparse product materialises at once, in bytes: the gathered rows are built
/// for a chunk of queries at a time. (Below WebGPU's guaranteed 128 MiB storage binding.)
const GATHER_BYTES: usize = 64 << 20;

/// Ranges of queries whose gathered `[batch, heads, chunk, k, features]` rows fit in
/// [`GATHER_BYTES`].
fn query_chunks(len: usize, rows: usize, k: usize, features: usize) -> Vec<Range<usize>> {
    query_chunks_within(GATHER_BYTES, len, rows, k, features)
}

fn query_chunks_within(
    budget: usize,
    len: usize,
    rows: usize,
    k: usize,
    features: usize,
) -> Vec<Range<usize>> {
    #[cfg(all(test, feature = "ndarray"))]
    let budget = tests::BUDGET.with(|b| b.get().unwrap_or(budget));
    let per_query = (rows * k * features * 4).max(1);
    let chunk = (budget / per_query).clamp(1, len.max(1));
    (0..len)
        .step_by(chunk)
        .map(|start| start..(start + chunk).min(len))
        .collect()
}

/// Default body of [`ClusteringBackend::sparse_dot`]:
/// gathers the `[batch, heads, chunk, k, E]` keys of a chunk of queries at a time.
pub fn sparse_dot<B: Backend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    let (queries, keys) = (float4::<B>(queries), float4::<B>(keys));
    let [batch, heads, len, dim] = queries.dims();
    let (index, padded) = query_topk(
        Tensor::from_primitive(topk),
        Tensor::from_primitive(assignments),
    );
    let [_, _, _, k] = index.dims();
    let parts = query_chunks(len, batch * heads, k, dim)
        .into_iter()
        .map(|r| {
            let queries = queries
                .clone()
                .slice([0..batch, 0..heads, r.clone(), 0..dim]);
            let index = index.clone().slice([0..batch, 0..heads, r, 0..k]);
            (queries.unsqueeze_dim::<5>(3) * gather_rows(keys.clone(), index))
                .sum_dim(4)
                .squeeze_dim::<4>(4)
        })
        .collect();
    let dots = Tensor::cat(parts, 2);
    let shape = dots.dims();
    float_out(dots.mask_fill(padded.expand(shape), 0.0))
}

/// Default body of
/// [`ClusteringBackend::sparse_weighted_sum`]:
/// gathers the `[batch, heads, chunk, k, D]` values of a chunk of queries at a time.
pub fn sparse_weighted_sum<B: Backend>(
    weights: FloatTensor<B>,
    values: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
) -> FloatTensor<B> {
    let (weights, values) = (float4::<B>(weights), float4::<B>(values));
    let [batch, heads, len, k] = weights.dims();
    let [_, _, _, dim] = values.dims();
    let (index, padded) = query_topk(
        Tensor::from_primitive(topk),
        Tensor::from_primitive(assignments),
    );
    let parts = query_chunks(len, batch * heads, k, dim)
        .into_iter()
        .map(|r| {
            let weights = weights.clone().slice([0..batch, 0..heads, r.clone(), 0..k]);
            let index = index.clone().slice([0..batch, 0..heads, r, 0..k]);
            (weights.unsqueeze_dim::<5>(4) * gather_rows(values.clone(), index))
                .sum_dim(3)
                .squeeze_dim::<4>(3)
        })
        .collect();
    let sums = Tensor::cat(parts, 2);
    let shape = sums.dims();
    float_out(sums.mask_fill(padded.expand(shape), 0.0))
}

/// Default body of [`ClusteringBackend::sparse_scatter`]:
/// scatter-adds the `[batch, heads, chunk · k, F]` products `weights[i, r] · x[i]` of a chunk
/// of queries at a time into the key rows.
pub fn sparse_scatter<B: Backend>(
    weights: FloatTensor<B>,
    x: FloatTensor<B>,
    topk: IntTensor<B>,
    assignments: IntTensor<B>,
    keys_len: usize,
) -> FloatTensor<B> {
    let (weights, x) = (float4::<B>(weights), float4::<B>(x));
    let [batch, heads, len, k] = weights.dims();
    let [_, _, _, features] = x.dims();
    let (index, padded) = query_topk(
        Tensor::from_primitive(topk),
        Tensor::from_primitive(assignments),
    );
    // Padded rows may hold anything, even NaN: zero them (and their weights) before summing.
    let x = x.mask_fill(padded.clone().expand([batch, heads, len, features]), 0.0);
    let weights = weights.mask_fill(padded.expand([batch, heads, len, k]), 0.0);
    let mut out =
        Tensor::<B, 4>::zeros([batch, heads, keys_len, features], (&x.device(), x.dtype()));
    for r in query_chunks(len, batch * heads, k, features) {
        let n = r.len();
        let weights = weights.clone().slice([0..batch, 0..heads, r.clone(), 0..k]);
        let x = x
            .clone()
            .slice([0..batch, 0..heads, r.clone(), 0..features]);
        let products = weights.unsqueeze_dim::<5>(4) * x.unsqueeze_dim::<5>(3); // [b, h, n, k, F]
        let index = index
            .clone()
            .slice([0..batch, 0..heads, r, 0..k])
            .unsqueeze_dim::<5>(4)
            .expand([batch, heads, n, k, features])
            .reshape([batch, heads, n * k, features]);
        out = out.scatter(
            2,
            index,
            products.reshape([batch, heads, n * k, features]),
            burn::tensor::IndexingUpdateOp::Add,
        );
    }
    float_out(out)
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use std::cell::Cell;

    use burn::backend::NdArray;
    use burn::tensor::{Distribution, Int, Tensor, TensorData};

    thread_local! {
        /// Overrides [`super::GATHER_BYTES`] on this thread.
        pub(super) static BUDGET: Cell<Option<usize>> = const { Cell::new(None) };
    }

    type B = NdArray;

    /// The sparse products give the same result whether the gathered rows are built for all
    /// queries at once or for chunks of 3 queries (a budget of 3 queries' rows).
    #[test]
    fn chunked_sparse_products_match_unchunked() {
        let device = Default::default();
        let (batch, heads, len, keys_len, dim, clusters, k) = (2, 2, 10, 7, 5, 3, 4);
        let q = Tensor::<B, 4>::random([batch, heads, len, dim], Distribution::Default, &device);
        let keys = Tensor::<B, 4>::random(
            [batch, heads, keys_len, dim],
            Distribution::Default,
            &device,
        );
        let w = Tensor::<B, 4>::random([batch, heads, len, k], Distribution::Default, &device);
        let top: Vec<i64> = (0..batch * heads * clusters * k)
            .map(|i| (i % keys_len) as i64)
            .collect();
        let top = Tensor::<B, 4, Int>::from_data(
            TensorData::new(top, [batch, heads, clusters, k]),
            &device,
        );
        let assign: Vec<i64> = (0..batch * heads * len)
            .map(|i| {
                if i % len == len - 1 {
                    -1
                } else {
                    (i % clusters) as i64
                }
            })
            .collect();
        let assign =
            Tensor::<B, 3, Int>::from_data(TensorData::new(assign, [batch, heads, len]), &device);
        let run = |budget: Option<usize>| {
            BUDGET.with(|b| b.set(budget));
            let f = |x: burn::tensor::ops::FloatTensor<B>| {
                Tensor::<B, 4>::from_primitive(burn::tensor::TensorPrimitive::Float(x))
            };
            let p = |x: &Tensor<B, 4>| x.clone().into_primitive().tensor();
            [
                f(super::sparse_dot::<B>(
                    p(&q),
                    p(&keys),
                    top.clone().into_primitive(),
                    assign.clone().into_primitive(),
                )),
                f(super::sparse_weighted_sum::<B>(
                    p(&w),
                    p(&keys),
                    top.clone().into_primitive(),
                    assign.clone().into_primitive(),
                )),
                f(super::sparse_scatter::<B>(
                    p(&w),
                    p(&q),
                    top.clone().into_primitive(),
                    assign.clone().into_primitive(),
                    keys_len,
                )),
            ]
        };
        let whole = run(None);
        let chunked = run(Some(3 * batch * heads * k * dim * 4));
        BUDGET.with(|b| b.set(None));
        for (a, b) in whole.into_iter().zip(chunked) {
            let diff: f32 = (a - b).abs().max().into_scalar();
            assert!(diff <= 1e-6, "chunked and whole results differ by {diff}");
        }
    }
}
