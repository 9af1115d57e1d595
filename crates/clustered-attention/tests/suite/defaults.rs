//! The default bodies of the backend extension (`clustered_attention::ops::reference`), the
//! specification every backend's own ops are checked against, called on tensors.
//!
//! Burn 0.22's tensors carry no backend type: the default bodies take the primitives of a
//! concrete backend `X`, and each wrapper here hands them over (`X::float_primitive`, …, of the
//! crate's `TensorConversion`) and wraps the outputs back into tensors. `X` must be the backend
//! the tensors live on: `NdArrayBackend` on `common::ndarray()`, `FlexBackend` on
//! `common::flex()`, `burn::backend::Cube` on a GPU device, and `Autodiff<X>` on the autodiff
//! form of each (`common::autodiff`), where the body is differentiated by Burn's autodiff
//! through the ops it is made of.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor};
use clustered_attention::dropout::AttentionDropout;
use clustered_attention::ops::{
    CentroidAttention, ClusterTop, ClusteredAttentionBackend, ClusteredAttentionBackward, Lengths,
    QueryClusters, TopAttentionGrads, reference,
};

/// The rank-4 float tensor of a primitive of `X`.
pub fn float<X: ClusteredAttentionBackend>(x: FloatTensor<X>) -> Tensor<4> {
    X::float_tensor::<4>(x)
}

/// The primitive of `X` of a rank-4 float tensor on `X`'s device.
pub fn float_in<X: ClusteredAttentionBackend>(x: Tensor<4>) -> FloatTensor<X> {
    X::float_primitive::<4>(x)
}

/// The primitive of `X` of an int tensor on `X`'s device.
pub fn int_in<X: ClusteredAttentionBackend, const D: usize>(x: Tensor<D, Int>) -> IntTensor<X> {
    X::int_primitive::<D>(x)
}

/// The int tensor of a primitive of `X`.
pub fn int_out<X: ClusteredAttentionBackend, const D: usize>(x: IntTensor<X>) -> Tensor<D, Int> {
    X::int_tensor::<D>(x)
}

/// Lengths as the ops take them.
fn lengths_of<X: ClusteredAttentionBackend>(lengths: Option<Tensor<1, Int>>) -> Lengths<X> {
    Lengths::from(lengths.map(int_in::<X, 1>))
}

fn cluster_top<X: ClusteredAttentionBackend>(
    assignments: Tensor<3, Int>,
    topk: Tensor<4, Int>,
    mass: Tensor<4>,
    rest: Tensor<4>,
) -> ClusterTop<X> {
    ClusterTop {
        assignments: int_in::<X, 3>(assignments),
        topk: int_in::<X, 4>(topk),
        mass: float_in::<X>(mass),
        rest: float_in::<X>(rest),
    }
}

fn query_clusters<X: ClusteredAttentionBackend>(
    assignments: Tensor<3, Int>,
    inverse_counts: Tensor<4>,
) -> QueryClusters<X> {
    QueryClusters {
        assignments: int_in::<X, 3>(assignments),
        inverse_counts: float_in::<X>(inverse_counts),
    }
}

/// `reference::lsh_hash`.
pub fn lsh_hash<X: ClusteredAttentionBackend>(
    queries: Tensor<4>,
    planes: Tensor<2>,
) -> Tensor<3, Int> {
    int_out::<X, 3>(reference::lsh_hash::<X>(
        float_in::<X>(queries),
        X::float_primitive::<2>(planes),
    ))
}

/// `reference::hamming_kmeans`: (assignments, counts).
pub fn hamming_kmeans<X: ClusteredAttentionBackend>(
    codes: Tensor<3, Int>,
    query_lengths: Option<Tensor<1, Int>>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (Tensor<3, Int>, Tensor<3, Int>) {
    let (assignments, counts) = reference::hamming_kmeans::<X>(
        int_in::<X, 3>(codes),
        lengths_of::<X>(query_lengths),
        clusters,
        iterations,
        seed,
    );
    (int_out::<X, 3>(assignments), int_out::<X, 3>(counts))
}

/// `reference::topk_indices`.
pub fn topk_indices<X: ClusteredAttentionBackend>(scores: Tensor<4>, k: usize) -> Tensor<4, Int> {
    int_out::<X, 4>(reference::topk_indices::<X>(float_in::<X>(scores), k))
}

/// `reference::sparse_dot`.
pub fn sparse_dot<X: ClusteredAttentionBackend>(
    queries: Tensor<4>,
    keys: Tensor<4>,
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
) -> Tensor<4> {
    float::<X>(reference::sparse_dot::<X>(
        float_in::<X>(queries),
        float_in::<X>(keys),
        int_in::<X, 4>(topk),
        int_in::<X, 3>(assignments),
    ))
}

/// `reference::sparse_weighted_sum`.
pub fn sparse_weighted_sum<X: ClusteredAttentionBackend>(
    weights: Tensor<4>,
    values: Tensor<4>,
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
) -> Tensor<4> {
    float::<X>(reference::sparse_weighted_sum::<X>(
        float_in::<X>(weights),
        float_in::<X>(values),
        int_in::<X, 4>(topk),
        int_in::<X, 3>(assignments),
    ))
}

/// `reference::sparse_scatter`.
pub fn sparse_scatter<X: ClusteredAttentionBackend>(
    weights: Tensor<4>,
    x: Tensor<4>,
    topk: Tensor<4, Int>,
    assignments: Tensor<3, Int>,
    keys_len: usize,
) -> Tensor<4> {
    float::<X>(reference::sparse_scatter::<X>(
        float_in::<X>(weights),
        float_in::<X>(x),
        int_in::<X, 4>(topk),
        int_in::<X, 3>(assignments),
        keys_len,
    ))
}

/// `reference::centroid_attention`: `Aᶜ V` (over the keys outside the top-k when `topk > 0`)
/// and the top-k indices and weights.
#[allow(clippy::type_complexity)]
pub fn centroid_attention<X: ClusteredAttentionBackend>(
    centroids: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    topk: usize,
) -> (Tensor<4>, Option<(Tensor<4, Int>, Tensor<4>)>) {
    let (out, top) = reference::centroid_attention::<X>(
        float_in::<X>(centroids),
        float_in::<X>(keys),
        float_in::<X>(values),
        lengths_of::<X>(key_lengths),
        topk,
        None,
    );
    let top = top.map(|(top, weights)| (int_out::<X, 4>(top), float::<X>(weights)));
    (float::<X>(out), top)
}

/// `reference::top_attention`.
#[allow(clippy::too_many_arguments)]
pub fn top_attention<X: ClusteredAttentionBackend>(
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    topk: Tensor<4, Int>,
    mass: Tensor<4>,
    rest: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    scale: f64,
) -> Tensor<4> {
    float::<X>(reference::top_attention::<X>(
        float_in::<X>(queries),
        float_in::<X>(keys),
        float_in::<X>(values),
        cluster_top::<X>(assignments, topk, mass, rest),
        lengths_of::<X>(key_lengths),
        scale,
        None,
    ))
}

/// `reference::improved_attention`.
#[allow(clippy::too_many_arguments)]
pub fn improved_attention<X: ClusteredAttentionBackend>(
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    inverse_counts: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    topk: usize,
    scale: f64,
) -> Tensor<4> {
    float::<X>(reference::improved_attention::<X>(
        float_in::<X>(queries),
        float_in::<X>(keys),
        float_in::<X>(values),
        query_clusters::<X>(assignments, inverse_counts),
        lengths_of::<X>(key_lengths),
        topk,
        scale,
        None,
    ))
}

/// The gradients of the centroid attention with respect to the centroids, keys and values
/// by `reference::centroid_attention_backward`, after the default forward body
/// (`reference::centroid_attention`, wrapped without a log-sum-exp as
/// `ClusteredAttentionBackward::centroid_attention_forward`'s default body does), given the
/// gradient of its first output and, from the top-k indices that forward picked, that of its
/// top-k weights.
pub fn centroid_attention_backward<X: ClusteredAttentionBackward>(
    centroids: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    topk: usize,
    grad_values: Tensor<4>,
    grad_top: impl FnOnce(Tensor<4, Int>) -> Tensor<4>,
) -> [Tensor<4>; 3] {
    let (out, top) = reference::centroid_attention::<X>(
        float_in::<X>(centroids.clone()),
        float_in::<X>(keys.clone()),
        float_in::<X>(values.clone()),
        lengths_of::<X>(key_lengths.clone()),
        topk,
        None,
    );
    // As `ClusteredAttentionBackward::centroid_attention_forward`'s default body wraps it.
    let forward: CentroidAttention<X> = CentroidAttention {
        values: out,
        top,
        log_sum_exp: None,
    };
    let top = forward.top.as_ref().map(|(top, _)| top.clone());
    let grads = reference::centroid_attention_backward::<X>(
        float_in::<X>(centroids),
        float_in::<X>(keys),
        float_in::<X>(values),
        lengths_of::<X>(key_lengths),
        forward,
        float_in::<X>(grad_values),
        top.map(|top| float_in::<X>(grad_top(int_out::<X, 4>(top)))),
        None,
    );
    [grads.centroids, grads.keys, grads.values].map(float::<X>)
}

/// The backward pass of the top-k attention, as `reference::top_attention_backward` and
/// `ClusteredAttentionBackward::top_attention_backward` take it.
pub type TopBackward<X> = fn(
    FloatTensor<X>,
    FloatTensor<X>,
    FloatTensor<X>,
    ClusterTop<X>,
    Lengths<X>,
    f64,
    FloatTensor<X>,
    Option<AttentionDropout>,
) -> TopAttentionGrads<X>;

/// The gradients of the top-k attention with respect to the queries, keys, values, mass and
/// rest by `backward` (`reference::top_attention_backward::<X>` or `X::top_attention_backward`),
/// given the gradient of its output.
#[allow(clippy::too_many_arguments)]
pub fn top_attention_backward<X: ClusteredAttentionBackward>(
    backward: TopBackward<X>,
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    topk: Tensor<4, Int>,
    mass: Tensor<4>,
    rest: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    scale: f64,
    grad: Tensor<4>,
) -> [Tensor<4>; 5] {
    let grads = backward(
        float_in::<X>(queries),
        float_in::<X>(keys),
        float_in::<X>(values),
        cluster_top::<X>(assignments, topk, mass, rest),
        lengths_of::<X>(key_lengths),
        scale,
        float_in::<X>(grad),
        None,
    );
    [
        grads.queries,
        grads.keys,
        grads.values,
        grads.mass,
        grads.rest,
    ]
    .map(float::<X>)
}

/// The gradients of the improved attention with respect to the queries, keys and values by
/// `reference::improved_attention_backward`, after `reference::improved_attention_forward`,
/// given the gradient of its output.
#[allow(clippy::too_many_arguments)]
pub fn improved_attention_backward<X: ClusteredAttentionBackward>(
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    assignments: Tensor<3, Int>,
    inverse_counts: Tensor<4>,
    key_lengths: Option<Tensor<1, Int>>,
    topk: usize,
    scale: f64,
    grad: Tensor<4>,
) -> [Tensor<4>; 3] {
    let (_, forward) = reference::improved_attention_forward::<X>(
        float_in::<X>(queries.clone()),
        float_in::<X>(keys.clone()),
        float_in::<X>(values.clone()),
        query_clusters::<X>(assignments.clone(), inverse_counts.clone()),
        lengths_of::<X>(key_lengths.clone()),
        topk,
        scale,
        None,
    );
    let grads = reference::improved_attention_backward::<X>(
        float_in::<X>(queries),
        float_in::<X>(keys),
        float_in::<X>(values),
        query_clusters::<X>(assignments, inverse_counts),
        lengths_of::<X>(key_lengths),
        scale,
        forward,
        float_in::<X>(grad),
        None,
    );
    [grads.queries, grads.keys, grads.values].map(float::<X>)
}
