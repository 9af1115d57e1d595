//! Burn's CubeCL backend (`burn::backend::Cube`, which is [`Fusion`] over [`CubeBackend`]:
//! WGPU, Vulkan, CUDA): hashing, K-means, the top-k and the sparse products as CubeCL
//! kernels, each `#[cube]` kernel beside its launcher, a free function on [`CubeTensor`]s.
//!
//! - `hash.rs`: `lsh_hash`; `kmeans.rs`: `hamming_kmeans` (the whole Lloyd loop);
//!   `topk.rs`: `topk_indices`; `sparse.rs`: `sparse_dot`, `sparse_weighted_sum`,
//!   `sparse_scatter`; `centroid.rs`: `centroid_attention`, and its backward in
//!   `centroid/backward.rs`, flash-style (no `[C, S]` tensor);
//!   `top.rs`: `top_attention` and the cluster means, over the queries sorted by cluster, which
//!   the improved attention's forward sorts once for both; `mma.rs`: the score tiles of both
//!   attention ops on cooperative matrices (`cmma` feature, `f16` and `bf16`); `dropout.rs`:
//!   the attention-dropout masks in the kernels (Philox4x32-10, the host's bit for bit) and
//!   `attention_dropout_factors`.
//! - This file: the crate's traits for `Fusion<CubeBackend>`, each op with a kernel registered
//!   on the Fusion stream by `fusion.rs`'s `defer` and run by its launcher when the stream
//!   executes (`CubeBackend` itself is not a backend that Burn's `Dispatch` reaches when fusion
//!   is on, so the traits, whose default bodies go through `Dispatch`, are not implemented for
//!   it).
//! - `offline.rs` (the crate's tests): every kernel built for an A100 and an H100 and compiled
//!   to CUDA C++ without a GPU, through the `launch!` macro's capture (below).
//!
//! The other ops (the softmax, the backward passes of the top-k attention and of the whole
//! improved attention), and the calls whose sizes the kernels do not take, run their default
//! bodies on `Fusion<CubeBackend>`, made of Burn's own kernels. Nothing is read back to the
//! host but the query lengths, when given (the initial centroids are drawn on the host). The
//! kernels reproduce the default bodies ([`crate::ops::reference`]) bit for bit where the
//! result is integer: the codes whenever the projections are computed exactly (the summation
//! order differs from a matrix product), the K-means always (integer arithmetic only), the
//! top-k given the same scores (same order, ties to the lower index); the sparse products up
//! to rounding (they accumulate in `f32`, in another order).
//!
//! The kernels index every buffer linearly, so each one they read or write is contiguous:
//! inputs go through `into_contiguous`, and outputs and scratch buffers are allocated with
//! `empty_device_contiguous_dtype`. Burn's default allocation (`empty_device_dtype`) may pad
//! each row: on CUDA, cubecl-runtime's `PitchedMemoryLayoutPolicy` rounds a row's bytes up to
//! a multiple of a power of two between 16 and 512, and a linear write then lands partly in the
//! padding and partly in the wrong rows.

/// Launches the kernel of the `#[cube(launch, create_dummy_kernel)]` module `$kernel` on
/// `$client`: `launch!(kernel(client, cube_count, cube_dim, args..))`, the arguments of
/// `kernel::launch`. In the crate's own tests, while an `offline` capture is open on the
/// thread, the kernel is instead built for the capture's device (a CUDA GPU's properties) and
/// recorded, not launched: the CUDA sources are checked at the configurations the launchers
/// choose, without a GPU.
macro_rules! launch {
    ($kernel:ident($client:expr, $count:expr, $dim:expr $(, $arg:expr)* $(,)?)) => {{
        #[cfg(test)]
        {
            if let Some(capture) = $crate::backends::cube::offline::Capture::open() {
                capture.record(
                    stringify!($kernel),
                    $kernel::create_dummy_kernel(
                        capture.properties(),
                        capture.target(),
                        $count,
                        $dim
                        $(, $arg)*
                    ),
                );
            } else {
                $kernel::launch($client, $count, $dim $(, $arg)*)
            }
        }
        #[cfg(not(test))]
        $kernel::launch($client, $count, $dim $(, $arg)*)
    }};
}

mod centroid;
mod dropout;
mod fusion;
mod hash;
mod kmeans;
mod mma;
#[cfg(test)]
mod offline;
mod sparse;
mod top;
mod topk;

use burn::backend::get_or_init_device_settings;
use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::tensor::{DType, Shape, TensorData};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl::prelude::*;
use std::sync::Arc;

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn_fusion::Fusion;
use burn_fusion::custom::{OperationOutput, ScalarIr};

use crate::dropout::AttentionDropout;
use crate::ops::checks::{
    check_centroid_attention, check_cluster_top, check_planes, check_query_clusters, check_topk,
};
use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusterTop, ClusteredAttentionBackend,
    ClusteredAttentionBackward, ImprovedForward, Lengths, QueryClusters, ScoreProducts, reference,
};
use fusion::{Tensor, defer, uint};

/// How the attention kernels compute their scores in `dtype` on `device` (see
/// [`crate::ops::ScoreProducts`]): on cooperative matrices where the `cmma` feature is on and
/// the device reports a tile shape for `dtype` (`f16` or `bf16`) into `f32`, by multiply-adds
/// otherwise.
pub fn score_products(device: &CubeDevice, dtype: DType) -> ScoreProducts {
    mma::score_products(&device.client(), dtype)
}

/// The dtype of the int tensors the ops create on `tensor`'s device (see [`int_dtype`]).
fn int_dtype_of(tensor: &Tensor) -> DType {
    int_dtype(tensor.client.device())
}

/// The crate's ops on `Cube`: the kernels, each call registered by `fusion::defer` and run
/// by its launcher, the shapes checked where the call is made; the softmax and the calls
/// whose sizes the kernels do not take keep their default bodies on `Fusion<CubeBackend>`.
impl ClusteredAttentionBackend for Fusion<CubeBackend> {
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        let [batch, heads, len, dim] = queries.shape().dims();
        check_planes([batch, heads, len, dim], planes.shape().dims());
        let int = int_dtype_of(&queries);
        let codes = (Shape::new([batch, heads, len]), int);
        let inputs = [Some(queries), Some(planes)];
        defer(
            LSH_HASH,
            inputs,
            vec![codes],
            vec![],
            move |[queries, planes]| Some(vec![hash::lsh_hash(queries?, planes?, int)]),
        )
        .output()
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Lengths<Self>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        assert!(clusters > 0, "clusters must be at least 1, got 0");
        let [batch, heads, len] = codes.shape().dims();
        let dtype = codes.dtype;
        let scalars = vec![uint(clusters), uint(iterations), ScalarIr::UInt(seed)];
        let outputs = vec![
            (Shape::new([batch, heads, len]), dtype),
            (Shape::new([batch, heads, clusters]), dtype),
        ];
        let known = query_lengths.host().map(<[usize]>::to_vec);
        let inputs = [Some(codes), query_lengths.into_option()];
        let [assignments, counts] = defer(
            HAMMING_KMEANS,
            inputs,
            outputs,
            scalars,
            move |[codes, lengths]| {
                let (assignments, counts) = kmeans::hamming_kmeans(
                    codes?,
                    lengths,
                    known.as_deref(),
                    clusters,
                    iterations,
                    seed,
                );
                Some(vec![assignments, counts])
            },
        )
        .outputs();
        (assignments, counts)
    }

    fn centroid_attention(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
        dropout: Option<AttentionDropout>,
    ) -> (
        FloatTensor<Self>,
        Option<(IntTensor<Self>, FloatTensor<Self>)>,
    ) {
        let attention =
            Self::centroid_attention_forward(centroids, keys, values, key_lengths, topk, dropout);
        (attention.values, attention.top)
    }

    fn top_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: ClusterTop<Self>,
        key_lengths: Lengths<Self>,
        scale: f64,
        dropout: Option<AttentionDropout>,
    ) -> FloatTensor<Self> {
        check_cluster_top::<Self>(&queries, &keys, &values, &clusters);
        let [batch, heads, len, dim] = queries.shape().dims();
        let dim_v = values.shape()[3];
        let [_, _, num_clusters, k] = clusters.topk.shape().dims();
        if !top::supported(dim, dim_v, k, num_clusters) {
            return reference::top_attention::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                scale,
                dropout,
            );
        }
        let output = (Shape::new([batch, heads, len, dim_v]), queries.dtype);
        let inputs = [
            Some(queries),
            Some(keys),
            Some(values),
            Some(clusters.assignments),
            Some(clusters.topk),
            Some(clusters.mass),
            Some(clusters.rest),
            key_lengths.into_option(),
        ];
        let mut scalars = vec![ScalarIr::Float(scale)];
        scalars.extend(dropout_scalars(dropout));
        defer(
            TOP_ATTENTION,
            inputs,
            vec![output],
            scalars,
            move |inputs| {
                let [
                    queries,
                    keys,
                    values,
                    assignments,
                    topk,
                    mass,
                    rest,
                    lengths,
                ] = inputs;
                let sorted = top::Sorted::new(assignments?, num_clusters);
                let output = top::top_attention(
                    queries?, keys?, values?, topk?, mass?, rest?, lengths, scale, &sorted, dropout,
                );
                Some(vec![output])
            },
        )
        .output()
    }

    #[allow(clippy::too_many_arguments)]
    fn improved_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
        scale: f64,
        dropout: Option<AttentionDropout>,
    ) -> FloatTensor<Self> {
        Self::improved_attention_forward(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            topk,
            scale,
            dropout,
        )
        .0
    }

    fn attention_dropout_factors(
        dropout: AttentionDropout,
        stream: u32,
        like: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        if !matches!(like.dtype, DType::F32 | DType::F16 | DType::BF16) {
            return reference::attention_dropout_factors::<Self>(dropout, stream, like);
        }
        let output = (like.shape(), like.dtype);
        let mut scalars = vec![ScalarIr::UInt(stream as u64)];
        scalars.extend(dropout_scalars(Some(dropout)));
        defer(
            DROPOUT_FACTORS,
            [Some(like)],
            vec![output],
            scalars,
            move |[like]| Some(vec![dropout::dropout_factors(like?, dropout, stream)]),
        )
        .output()
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        let [batch, heads, rows, len] = scores.shape().dims();
        check_topk(k, len);
        if k > topk::MAX_K {
            // Each unit's list of k would pass CUDA's default stack a thread: the default
            // body, which sorts on the host.
            return reference::topk_indices::<Self>(scores, k);
        }
        let int = int_dtype_of(&scores);
        let indices = (Shape::new([batch, heads, rows, k]), int);
        defer(
            TOPK_INDICES,
            [Some(scores)],
            vec![indices],
            vec![uint(k)],
            move |[scores]| Some(vec![topk::topk_indices(scores?, k, int)]),
        )
        .output()
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let k = topk.shape()[3];
        let inputs = [queries, keys, topk, assignments];
        defer_sparse_product(SPARSE_DOT, inputs, k, sparse::sparse_dot)
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let dim = values.shape()[3];
        let inputs = [weights, values, topk, assignments];
        defer_sparse_product(
            SPARSE_WEIGHTED_SUM,
            inputs,
            dim,
            sparse::sparse_weighted_sum,
        )
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        if topk.shape()[2] > sparse::SORT_CLUSTERS {
            // Too many clusters for the counting sort's shared memory: the default body.
            return reference::sparse_scatter::<Self>(weights, x, topk, assignments, keys_len);
        }
        let [batch, heads, _, features] = x.shape().dims();
        let output = (
            Shape::new([batch, heads, keys_len, features]),
            weights.dtype,
        );
        let inputs = [weights, x, topk, assignments].map(Some);
        let scalars = vec![uint(keys_len)];
        defer(
            SPARSE_SCATTER,
            inputs,
            vec![output],
            scalars,
            move |[w, x, topk, a]| Some(vec![sparse::sparse_scatter(w?, x?, topk?, a?, keys_len)]),
        )
        .output()
    }
}

/// The backward passes on `Cube`: the centroid attention's forward (with its top-k) and
/// backward and the improved attention's forward by the kernels; the top-k attention's and the
/// whole improved attention's backward keep their default bodies on `Fusion<CubeBackend>`.
impl ClusteredAttentionBackward for Fusion<CubeBackend> {
    fn centroid_attention_forward(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
        dropout: Option<AttentionDropout>,
    ) -> CentroidAttention<Self> {
        let ([batch, heads, clusters, dim], [_, _, _, dim_v]) = check_centroid_attention(
            centroids.shape().dims(),
            keys.shape().dims(),
            values.shape().dims(),
            topk,
        );
        if !centroid::supported(dim, dim_v, topk) {
            // Rows too wide for registers, or a top-k list too long: the default body.
            let (values, top) = reference::centroid_attention::<Self>(
                centroids,
                keys,
                values,
                key_lengths,
                topk,
                dropout,
            );
            return CentroidAttention {
                values,
                top,
                log_sum_exp: None,
            };
        }
        let (float, int) = (centroids.dtype, int_dtype_of(&centroids));
        let shape = |last: usize| Shape::new([batch, heads, clusters, last]);
        let mut outputs = vec![(shape(dim_v), float)];
        if topk > 0 {
            outputs.extend([(shape(topk), int), (shape(topk), float)]);
        }
        let inputs = [
            Some(centroids),
            Some(keys),
            Some(values),
            key_lengths.into_option(),
        ];
        let mut scalars = vec![uint(topk)];
        scalars.extend(dropout_scalars(dropout));
        let mut outputs = defer(
            CENTROID_ATTENTION,
            inputs,
            outputs,
            scalars,
            move |[centroids, keys, values, lengths]| {
                let attention = centroid::centroid_attention(
                    centroids?, keys?, values?, lengths, topk, int, dropout,
                );
                let top = attention.top.into_iter().flat_map(|(i, w)| [i, w]);
                Some([attention.values].into_iter().chain(top).collect())
            },
        )
        .into_iter();
        let values = outputs.next().expect("the values");
        let top = outputs.next().zip(outputs.next());
        CentroidAttention {
            values,
            top,
            log_sum_exp: None,
        }
    }

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
        check_centroid_attention(
            centroids.shape().dims(),
            keys.shape().dims(),
            values.shape().dims(),
            0,
        );
        assert!(
            forward.top.is_some() == grad_top_weights.is_some(),
            "forward.top and grad_top_weights must both be given or both be None"
        );
        let dim = centroids.shape()[3];
        let dim_v = values.shape()[3];
        let topk = forward.top.as_ref().map_or(0, |(top, _)| top.shape()[3]);
        let empty = [&centroids, &keys]
            .iter()
            .any(|x| x.shape().num_elements() == 0);
        if empty || !centroid::supported(dim, dim_v, topk) {
            return reference::centroid_attention_backward::<Self>(
                centroids,
                keys,
                values,
                key_lengths,
                forward,
                grad_values,
                grad_top_weights,
                dropout,
            );
        }
        let like = |x: &Tensor| (x.shape(), x.dtype);
        let outputs = vec![like(&centroids), like(&keys), like(&values)];
        // The log-sum-exp is not an input: the kernels recompute the softmax statistics (and
        // neither the kernels nor the default body produce it on this backend).
        let (top_indices, top_weights) = forward.top.unzip();
        let inputs = [
            Some(centroids),
            Some(keys),
            Some(values),
            key_lengths.into_option(),
            Some(forward.values),
            top_indices,
            top_weights,
            Some(grad_values),
            grad_top_weights,
        ];
        let [centroids, keys, values] = defer(
            CENTROID_ATTENTION_BACKWARD,
            inputs,
            outputs,
            dropout_scalars(dropout),
            move |inputs| {
                let [c, k, v, lengths, forward, top, weights, grad, grad_top] = inputs;
                let forward = CentroidAttention {
                    values: forward?,
                    top: top.zip(weights),
                    log_sum_exp: None,
                };
                let grads = centroid::centroid_attention_backward(
                    c?, k?, v?, lengths, forward, grad?, grad_top, dropout,
                );
                Some(vec![grads.centroids, grads.keys, grads.values])
            },
        )
        .outputs();
        CentroidAttentionGrads {
            centroids,
            keys,
            values,
        }
    }

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
        assert!(topk > 0, "topk must be at least 1, got 0");
        let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
        let [batch, heads, len, dim] = queries.shape().dims();
        let [_, _, keys_len, dim_v] = values.shape().dims();
        check_centroid_attention(
            [batch, heads, num_clusters, dim],
            keys.shape().dims(),
            [batch, heads, keys_len, dim_v],
            topk,
        );
        if !top::supported(dim, dim_v, topk, num_clusters) || !centroid::supported(dim, dim_v, topk)
        {
            return reference::improved_attention_forward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                topk,
                scale,
                dropout,
            );
        }
        let (float, int) = (queries.dtype, int_dtype_of(&queries));
        let shape = |rows: usize, last: usize| Shape::new([batch, heads, rows, last]);
        let outputs = vec![
            (shape(len, dim_v), float),
            (shape(num_clusters, dim), float),
            (shape(num_clusters, dim_v), float),
            (shape(num_clusters, topk), int),
            (shape(num_clusters, topk), float),
            (shape(num_clusters, 1), float),
        ];
        let mut scalars = vec![uint(topk), ScalarIr::Float(scale)];
        scalars.extend(dropout_scalars(dropout));
        let QueryClusters {
            assignments,
            inverse_counts,
        } = clusters;
        let inputs = [
            Some(queries),
            Some(keys),
            Some(values),
            Some(assignments),
            Some(inverse_counts),
            key_lengths.into_option(),
        ];
        let [output, centroids, rest, indices, weights, mass] = defer(
            IMPROVED_ATTENTION_FORWARD,
            inputs,
            outputs,
            scalars,
            move |inputs| {
                let [queries, keys, values, assignments, inverse_counts, lengths] = inputs;
                let clusters = QueryClusters {
                    assignments: assignments?,
                    inverse_counts: inverse_counts?,
                };
                let (output, forward) = improved_forward(
                    queries?, keys?, values?, clusters, lengths, topk, scale, int, dropout,
                );
                let (indices, weights) = forward.centroid_attention.top?;
                Some(vec![
                    output,
                    forward.centroids,
                    forward.centroid_attention.values,
                    indices,
                    weights,
                    forward.mass,
                ])
            },
        )
        .outputs();
        let forward = ImprovedForward {
            centroids,
            centroid_attention: CentroidAttention {
                values: rest,
                top: Some((indices, weights)),
                log_sum_exp: None,
            },
            mass,
        };
        (output, forward)
    }
}

/// Defers a sparse product of the Cube ops, [`sparse::sparse_dot`] or
/// [`sparse::sparse_weighted_sum`], of `[rows, operand, topk, assignments]`: its output is
/// `[batch, heads, len, width]` (`rows`' first three dimensions) in `rows`' dtype.
fn defer_sparse_product(
    id: &'static str,
    inputs: [Tensor; 4],
    width: usize,
    product: fn(CubeTensor, CubeTensor, CubeTensor, CubeTensor) -> CubeTensor,
) -> Tensor {
    let [batch, heads, len, _] = inputs[0].shape().dims();
    let output = (Shape::new([batch, heads, len, width]), inputs[0].dtype);
    defer(
        id,
        inputs.map(Some),
        vec![output],
        vec![],
        move |[x, y, topk, a]| Some(vec![product(x?, y?, topk?, a?)]),
    )
    .output()
}

/// The scalars a custom operation's result depends on through `dropout`: its probability and
/// seed (none without dropout).
fn dropout_scalars(dropout: Option<AttentionDropout>) -> Vec<ScalarIr> {
    dropout
        .map(|dropout| vec![ScalarIr::Float(dropout.prob), ScalarIr::UInt(dropout.seed)])
        .unwrap_or_default()
}

/// The names of the custom operations ([`fusion::defer`]).
const LSH_HASH: &str = "clustered_attention::lsh_hash";
const HAMMING_KMEANS: &str = "clustered_attention::hamming_kmeans";
const TOPK_INDICES: &str = "clustered_attention::topk_indices";
const SPARSE_DOT: &str = "clustered_attention::sparse_dot";
const SPARSE_WEIGHTED_SUM: &str = "clustered_attention::sparse_weighted_sum";
const SPARSE_SCATTER: &str = "clustered_attention::sparse_scatter";
const CENTROID_ATTENTION: &str = "clustered_attention::centroid_attention";
const CENTROID_ATTENTION_BACKWARD: &str = "clustered_attention::centroid_attention_backward";
const TOP_ATTENTION: &str = "clustered_attention::top_attention";
const IMPROVED_ATTENTION_FORWARD: &str = "clustered_attention::improved_attention_forward";
const DROPOUT_FACTORS: &str = "clustered_attention::attention_dropout_factors";

/// The improved attention's forward by the kernels: the cluster means, the centroid attention
/// with the top-k (indices of dtype `int_dtype`) and the top-k attention, over one sort of the
/// queries by cluster. The shapes are checked by the caller; call only with `topk ≥ 1` and
/// when both [`top::supported`] and [`centroid::supported`].
#[allow(clippy::too_many_arguments)]
fn improved_forward(
    queries: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    clusters: QueryClusters<CubeBackend>,
    key_lengths: Option<CubeTensor>,
    topk: usize,
    scale: f64,
    int_dtype: DType,
    dropout: Option<AttentionDropout>,
) -> (CubeTensor, ImprovedForward<CubeBackend>) {
    let num_clusters = clusters.inverse_counts.meta.shape()[2];
    // One sort of the queries by cluster serves the cluster means and the top-k attention,
    // and one lengths tensor both attentions.
    let sorted = top::Sorted::new(clusters.assignments.clone(), num_clusters);
    let [batch, _, keys_len, _] = keys.meta.shape().dims();
    let key_lengths = Some(key_lengths_or_all(
        key_lengths,
        batch,
        keys_len,
        &keys.device,
        int_dtype,
    ));
    let centroids = top::cluster_means(queries.clone(), clusters.inverse_counts, &sorted, scale);
    let attention = centroid::centroid_attention(
        centroids.clone(),
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
        int_dtype,
        dropout,
    );
    let rest = attention.values;
    let (top, top_weights) = attention.top.expect("topk ≥ 1 gives the top-k");
    let mass = CubeBackend::float_sum_dim(top_weights.clone(), 3);
    let output = top::top_attention(
        queries,
        keys,
        values,
        top.clone(),
        mass.clone(),
        rest.clone(),
        key_lengths,
        scale,
        &sorted,
        dropout,
    );
    let forward = ImprovedForward {
        centroids,
        centroid_attention: CentroidAttention {
            values: rest,
            top: Some((top, top_weights)),
            log_sum_exp: None,
        },
        mass,
    };
    (output, forward)
}

/// `tensor` as the argument of a kernel, which indexes it linearly.
///
/// # Panics
/// If `tensor` is not contiguous (row-major, no padding): a pitched buffer, as CUDA allocates by
/// default, would be read and written at the wrong places.
pub(super) fn linear(tensor: CubeTensor) -> TensorArg {
    assert!(
        tensor.is_contiguous(),
        "a kernel argument must be contiguous, got shape {:?} with strides {:?}",
        tensor.meta.shape(),
        tensor.meta.strides(),
    );
    tensor.into_tensor_arg()
}

/// The properties of the device the launchers plan their kernels for (the plane size and the
/// cooperative-matrix shapes, see `mma::mma_shape`): `client`'s; in the crate's own tests,
/// those of an open `offline` capture.
fn device_properties(client: &Client) -> Arc<DeviceProperties> {
    #[cfg(test)]
    if let Some(capture) = offline::Capture::open() {
        return capture.properties();
    }
    client.properties_shared()
}

/// Whether the kernels may compute their scores on cooperative matrices: the `cmma` feature;
/// in the crate's own tests, what an open `offline` capture says.
fn cmma_feature() -> bool {
    #[cfg(test)]
    if let Some(capture) = offline::Capture::open() {
        return capture.cmma();
    }
    cfg!(feature = "cmma")
}

/// `f32`s of shared memory a cube of the attention kernels may use: 16 KiB, WebGPU's
/// guaranteed minimum.
const SHARED_FLOATS: usize = 4096;

/// Most bytes of shared memory a cube of the kernels that need more than [`SHARED_FLOATS`]
/// takes (the top-k attention's scores, the products on cooperative matrices, the parts of the
/// scores of the centroid attention's kernels that split rows over units: its backward's and
/// its `rest` pass at wide rows): 32 KiB, the least of the drivers the crate runs on
/// (lavapipe's; CUDA gives 48 KiB per block).
const MAX_SHARED_BYTES: usize = 32 * 1024;

/// Most features `E` or `D` the attention kernels keep in registers per row.
const MAX_DIM: usize = 128;

/// The dtype of the int tensors the ops create on `device` (the indices of the top-k, the
/// codes, the key lengths when none are given): the device's settings' `int_dtype`, `i32`
/// unless the device is configured otherwise.
fn int_dtype(device: &CubeDevice) -> DType {
    DType::from(get_or_init_device_settings::<CubeBackend>(device).int_dtype)
}

/// A contiguous int tensor of dtype `dtype` on `device` holding `values` (row-major) in the
/// shape `shape`.
fn ints(values: Vec<i64>, shape: Shape, device: &CubeDevice, dtype: DType) -> CubeTensor {
    let data = TensorData::new(values, shape).convert_dtype(dtype);
    into_contiguous(CubeBackend::int_from_data(data, device))
}

/// `key_lengths` as a contiguous `[batch]` tensor of dtype `int_dtype`: the one given (cast to
/// `int_dtype` when it has another), or every key valid (`keys_len`) when `None`.
fn key_lengths_or_all(
    key_lengths: Option<CubeTensor>,
    batch: usize,
    keys_len: usize,
    device: &CubeDevice,
    int_dtype: DType,
) -> CubeTensor {
    match key_lengths {
        Some(lengths) => into_contiguous(cast(lengths, int_dtype)),
        None => ints(
            vec![keys_len as i64; batch],
            Shape::new([batch]),
            device,
            int_dtype,
        ),
    }
}

/// Most cubes a grid dimension may hold on every runtime (WebGPU's limit).
const MAX_CUBES_PER_DIM: u32 = 65_535;

/// A 2-D grid of at least `cubes` cubes along X (folded into Y beyond the per-dimension
/// limit), times `rows` along Z.
fn cube_count(cubes: usize, rows: usize) -> CubeCount {
    let cubes = cubes.max(1) as u32;
    let x = cubes.min(MAX_CUBES_PER_DIM);
    CubeCount::Static(x, cubes.div_ceil(x), rows.max(1) as u32)
}
