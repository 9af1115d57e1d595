//! Burn's CubeCL backend (`burn::backend::Cube`, which is [`Fusion`](burn_fusion::Fusion) over
//! [`CubeBackend`]: WGPU, Vulkan, CUDA): hashing, K-means, the top-k and the sparse products as
//! CubeCL kernels, each `#[cube]` kernel beside its launcher, the launchers free functions on
//! [`CubeTensor`]s (one per op, below).
//!
//! - `hash.rs`: `lsh_hash`; `kmeans.rs`: `hamming_kmeans` (the whole Lloyd loop);
//!   `topk.rs`: `topk_indices`; `sparse.rs`: `sparse_dot`, `sparse_weighted_sum`,
//!   `sparse_scatter`; `centroid.rs`: `centroid_attention`, and its backward in
//!   `centroid/backward.rs`, flash-style (no `[C, S]` tensor);
//!   `top.rs`: `top_attention` and the cluster means, over the queries sorted by cluster, which
//!   `improved_attention_forward` sorts once for both; `mma.rs`: the score tiles of both
//!   attention ops on cooperative matrices (`cmma` feature, `f16` and `bf16`).
//! - `offline.rs` (the crate's tests): every kernel built for an A100 and an H100 and compiled
//!   to CUDA C++ without a GPU, through the `launch!` macro's capture (below).
//! - `fusion.rs`: the same ops registered as Fusion custom operations, the implementation of
//!   the crate's traits for `Fusion<CubeBackend>` (`CubeBackend` itself is not a backend that
//!   Burn's `Dispatch` reaches when fusion is on).
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

use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusterTop, ImprovedForward, QueryClusters,
    ScoreProducts,
};

/// How the attention kernels compute their scores in `dtype` on `device` (see
/// [`crate::ops::ScoreProducts`]): on cooperative matrices where the `cmma` feature is on and
/// the device reports a tile shape for `dtype` (`f16` or `bf16`) into `f32`, by multiply-adds
/// otherwise.
pub fn score_products(device: &CubeDevice, dtype: DType) -> ScoreProducts {
    mma::score_products(&device.client(), dtype)
}

/// [`ClusteredAttentionBackend::lsh_hash`](crate::ClusteredAttentionBackend::lsh_hash) by its
/// kernel: codes `[batch, heads, L]` of dtype `int_dtype`.
pub(crate) fn lsh_hash(queries: CubeTensor, planes: CubeTensor, int_dtype: DType) -> CubeTensor {
    hash::lsh_hash(queries, planes, int_dtype)
}

/// [`ClusteredAttentionBackend::hamming_kmeans`](crate::ClusteredAttentionBackend::hamming_kmeans)
/// by its kernels: the assignments and counts in the dtype of `codes`. Reads `query_lengths`
/// to the host.
pub(crate) fn hamming_kmeans(
    codes: CubeTensor,
    query_lengths: Option<CubeTensor>,
    clusters: usize,
    iterations: usize,
    seed: u64,
) -> (CubeTensor, CubeTensor) {
    kmeans::hamming_kmeans(codes, query_lengths, clusters, iterations, seed)
}

/// [`ClusteredAttentionBackend::centroid_attention`](crate::ClusteredAttentionBackend::centroid_attention)
/// by its kernels: the values and, with `topk > 0`, the top-k indices (of dtype `int_dtype`,
/// which `key_lengths` is cast to) and weights. Call only when [`centroid::supported`]
/// (otherwise the caller runs the default body).
pub(crate) fn centroid_attention(
    centroids: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    key_lengths: Option<CubeTensor>,
    topk: usize,
    int_dtype: DType,
) -> (CubeTensor, Option<(CubeTensor, CubeTensor)>) {
    let attention =
        centroid::centroid_attention(centroids, keys, values, key_lengths, topk, int_dtype);
    (attention.values, attention.top)
}

/// [`ClusteredAttentionBackward::centroid_attention_backward`](crate::ops::ClusteredAttentionBackward::centroid_attention_backward)
/// by its kernels. Call only when [`centroid::supported`] (with `forward`'s `topk`) and the
/// centroids and keys are not empty (otherwise the caller runs the default body).
#[allow(clippy::too_many_arguments)]
pub(crate) fn centroid_attention_backward(
    centroids: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    key_lengths: Option<CubeTensor>,
    forward: CentroidAttention<CubeBackend>,
    grad_values: CubeTensor,
    grad_top_weights: Option<CubeTensor>,
) -> CentroidAttentionGrads<CubeBackend> {
    centroid::centroid_attention_backward(
        centroids,
        keys,
        values,
        key_lengths,
        forward,
        grad_values,
        grad_top_weights,
    )
}

/// [`ClusteredAttentionBackend::top_attention`](crate::ClusteredAttentionBackend::top_attention)
/// by its kernels, after a sort of the queries by cluster. The shapes are checked by the
/// caller; call only when [`top::supported`] (otherwise the caller runs the default body).
pub(crate) fn top_attention(
    queries: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    clusters: ClusterTop<CubeBackend>,
    key_lengths: Option<CubeTensor>,
    scale: f64,
) -> CubeTensor {
    let num_clusters = clusters.topk.meta.shape()[2];
    let sorted = top::Sorted::new(clusters.assignments, num_clusters);
    top::top_attention(
        queries,
        keys,
        values,
        clusters.topk,
        clusters.mass,
        clusters.rest,
        key_lengths,
        scale,
        &sorted,
    )
}

/// [`ClusteredAttentionBackward::improved_attention_forward`](crate::ops::ClusteredAttentionBackward::improved_attention_forward)
/// by the kernels: the cluster means, [`centroid_attention`] with the top-k (indices of dtype
/// `int_dtype`) and [`top_attention`]. The shapes are checked by the caller; call only with
/// `topk ≥ 1` and when both [`top::supported`] and [`centroid::supported`] (otherwise the
/// caller runs the default body).
#[allow(clippy::too_many_arguments)]
pub(crate) fn improved_attention_forward(
    queries: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    clusters: QueryClusters<CubeBackend>,
    key_lengths: Option<CubeTensor>,
    topk: usize,
    scale: f64,
    int_dtype: DType,
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
    let (rest, top) = centroid_attention(
        centroids.clone(),
        keys.clone(),
        values.clone(),
        key_lengths.clone(),
        topk,
        int_dtype,
    );
    let (top, top_weights) = top.expect("topk ≥ 1 gives the top-k");
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

/// [`ClusteredAttentionBackend::topk_indices`](crate::ClusteredAttentionBackend::topk_indices)
/// by its kernel: indices of dtype `int_dtype`. Call only with `k ≤` [`topk::TOPK_SHARED`]
/// (otherwise the caller runs the default body, which sorts on the host).
pub(crate) fn topk_indices(scores: CubeTensor, k: usize, int_dtype: DType) -> CubeTensor {
    topk::topk_indices(scores, k, int_dtype)
}

/// [`ClusteredAttentionBackend::sparse_dot`](crate::ClusteredAttentionBackend::sparse_dot) by
/// its kernel.
pub(crate) fn sparse_dot(
    queries: CubeTensor,
    keys: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
) -> CubeTensor {
    sparse::sparse_dot(queries, keys, topk, assignments)
}

/// [`ClusteredAttentionBackend::sparse_weighted_sum`](crate::ClusteredAttentionBackend::sparse_weighted_sum)
/// by its kernel.
pub(crate) fn sparse_weighted_sum(
    weights: CubeTensor,
    values: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
) -> CubeTensor {
    sparse::sparse_weighted_sum(weights, values, topk, assignments)
}

/// [`ClusteredAttentionBackend::sparse_scatter`](crate::ClusteredAttentionBackend::sparse_scatter)
/// by its kernels. Call only with at most [`sparse::SORT_CLUSTERS`] clusters (otherwise the
/// caller runs the default body).
pub(crate) fn sparse_scatter(
    weights: CubeTensor,
    x: CubeTensor,
    topk: CubeTensor,
    assignments: CubeTensor,
    keys_len: usize,
) -> CubeTensor {
    sparse::sparse_scatter(weights, x, topk, assignments, keys_len)
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
