//! [`CubeBackend`] (WGPU, Vulkan, CUDA without fusion) and [`Fusion`](burn_fusion::Fusion)
//! over it (`burn::backend::Wgpu`, `Cuda`): hashing, K-means, the top-k and the sparse products
//! as CubeCL kernels, each `#[cube]` kernel beside its launcher.
//!
//! - `hash.rs`: `lsh_hash`; `kmeans.rs`: `hamming_kmeans` (the whole Lloyd loop);
//!   `topk.rs`: `topk_indices`; `sparse.rs`: `sparse_dot`, `sparse_weighted_sum`,
//!   `sparse_scatter`; `centroid.rs`: `centroid_attention`, and its backward in
//!   `centroid/backward.rs`, flash-style (no `[C, S]` tensor);
//!   `top.rs`: `top_attention` and the cluster means, over the queries sorted by cluster, which
//!   `improved_attention_forward` sorts once for both; `mma.rs`: the score tiles of both
//!   attention ops on cooperative matrices (`cmma` feature, `f16` and `bf16`).
//! - `fusion.rs`: the same ops registered as Fusion custom operations.
//!
//! The other ops keep their default bodies, made of Burn's own kernels. Nothing is read back
//! to the host but the query lengths, when given (the initial centroids are drawn on the
//! host). The kernels reproduce the default bodies ([`crate::ops::reference`]) bit for bit
//! where the result is integer: the codes whenever the projections are computed exactly (the
//! summation order differs from a matrix product), the K-means always (integer arithmetic
//! only), the top-k given the same scores (same order, ties to the lower index); the sparse
//! products up to rounding (they accumulate in `f32`, in another order).
//!
//! The kernels index every buffer linearly, so each one they read or write is contiguous:
//! inputs go through `into_contiguous`, and outputs and scratch buffers are allocated with
//! `empty_device_contiguous_dtype`. Burn's default allocation (`empty_device_dtype`) may pad
//! each row: on CUDA, cubecl-runtime's `PitchedMemoryLayoutPolicy` rounds a row's bytes up to
//! a multiple of a power of two between 16 and 512, and a linear write then lands partly in the
//! padding and partly in the wrong rows.

mod centroid;
mod fusion;
mod hash;
mod kmeans;
mod mma;
mod sparse;
mod top;
mod topk;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use burn::tensor::{
    DType, Int as IntKind, Tensor as BurnTensor, TensorData, TensorMetadata, TensorPrimitive,
};
use burn_cubecl::kernel::into_contiguous;

use crate::ClusteredAttentionBackend;
use crate::ops::checks::{check_cluster_top, check_query_clusters};
use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusterTop, ImprovedForward, QueryClusters,
    ScoreProducts, reference,
};

impl<R, F, I, BT> ClusteredAttentionBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn score_products(device: &Self::Device, dtype: DType) -> ScoreProducts {
        mma::score_products(&R::client(device), dtype)
    }

    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        hash::lsh_hash::<R>(queries, planes, I::dtype())
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        kmeans::hamming_kmeans::<R, F, I, BT>(codes, query_lengths, clusters, iterations, seed)
    }

    fn centroid_attention(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Option<IntTensor<Self>>,
        topk: usize,
    ) -> CentroidAttention<Self> {
        let dim = centroids.meta.shape()[3];
        let dim_v = values.meta.shape()[3];
        if !centroid::supported(dim, dim_v, topk) {
            // Rows too wide for registers, or a top-k list too long: the default body.
            return reference::centroid_attention::<Self>(
                centroids,
                keys,
                values,
                key_lengths,
                topk,
            );
        }
        centroid::centroid_attention::<R, F, I, BT>(centroids, keys, values, key_lengths, topk)
    }

    fn centroid_attention_backward(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Option<IntTensor<Self>>,
        forward: CentroidAttention<Self>,
        grad_values: FloatTensor<Self>,
        grad_top_weights: Option<FloatTensor<Self>>,
    ) -> CentroidAttentionGrads<Self> {
        let dim = centroids.meta.shape()[3];
        let dim_v = values.meta.shape()[3];
        let topk = forward
            .top
            .as_ref()
            .map_or(0, |(top, _)| top.meta.shape()[3]);
        let empty = [&centroids, &keys]
            .iter()
            .any(|x| x.meta.shape().num_elements() == 0);
        if empty || !centroid::supported(dim, dim_v, topk) {
            return reference::centroid_attention_backward::<Self>(
                centroids,
                keys,
                values,
                key_lengths,
                forward,
                grad_values,
                grad_top_weights,
            );
        }
        centroid::centroid_attention_backward::<R, F, I, BT>(
            centroids,
            keys,
            values,
            key_lengths,
            forward,
            grad_values,
            grad_top_weights,
        )
    }

    fn top_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: ClusterTop<Self>,
        key_lengths: Option<IntTensor<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        check_cluster_top::<Self>(&queries, &keys, &values, &clusters);
        let [_, _, num_clusters, k] = clusters.topk.shape().dims();
        let (dim, dim_v) = (queries.shape()[3], values.shape()[3]);
        if !top::supported(dim, dim_v, k, num_clusters) {
            return reference::top_attention::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                scale,
            );
        }
        let sorted = top::Sorted::new(clusters.assignments, num_clusters);
        top::top_attention::<R, F, I, BT>(
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

    fn improved_attention_forward(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Option<IntTensor<Self>>,
        topk: usize,
        scale: f64,
    ) -> (FloatTensor<Self>, ImprovedForward<Self>) {
        assert!(topk > 0, "topk must be at least 1, got 0");
        let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
        let (dim, dim_v) = (queries.shape()[3], values.shape()[3]);
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
            );
        }
        // One sort of the queries by cluster serves the cluster means and the top-k attention,
        // and one lengths tensor both attentions.
        let sorted = top::Sorted::new(clusters.assignments.clone(), num_clusters);
        let [batch, _, keys_len, _] = keys.shape().dims();
        let key_lengths = Some(key_lengths_or_all::<R, F, I, BT>(
            key_lengths,
            batch,
            keys_len,
            &keys.device,
            I::dtype(),
        ));
        let centroids =
            top::cluster_means(queries.clone(), clusters.inverse_counts, &sorted, scale);
        let attention = Self::centroid_attention(
            centroids.clone(),
            keys.clone(),
            values.clone(),
            key_lengths.clone(),
            topk,
        );
        let (top, top_weights) = attention.top.clone().expect("topk ≥ 1 gives the top-k");
        let mass = BurnTensor::<Self, 4>::from_primitive(TensorPrimitive::Float(top_weights))
            .sum_dim(3)
            .into_primitive()
            .tensor();
        let output = top::top_attention::<R, F, I, BT>(
            queries,
            keys,
            values,
            top,
            mass.clone(),
            attention.values.clone(),
            key_lengths,
            scale,
            &sorted,
        );
        let forward = ImprovedForward {
            centroids,
            centroid_attention: attention,
            mass,
        };
        (output, forward)
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        if k > topk::TOPK_SHARED {
            // One sorted list of k would not fit in the merge's shared memory: the default
            // body, which sorts on the host.
            return reference::topk_indices::<Self>(scores, k);
        }
        topk::topk_indices::<R>(scores, k, I::dtype())
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        sparse::sparse_dot::<R>(queries, keys, topk, assignments)
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        sparse::sparse_weighted_sum::<R>(weights, values, topk, assignments)
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        sparse::sparse_scatter::<R, F, I, BT>(weights, x, topk, assignments, keys_len)
    }
}

/// `tensor` as the argument of a kernel, which indexes it linearly.
///
/// # Panics
/// If `tensor` is not contiguous (row-major, no padding): a pitched buffer, as CUDA allocates by
/// default, would be read and written at the wrong places.
pub(super) fn linear<R: CubeRuntime>(tensor: CubeTensor<R>) -> TensorArg<R> {
    assert!(
        tensor.is_contiguous(),
        "a kernel argument must be contiguous, got shape {:?} with strides {:?}",
        tensor.meta.shape(),
        tensor.meta.strides(),
    );
    tensor.into_tensor_arg()
}

/// `f32`s of shared memory a cube of the attention kernels may use: 16 KiB, WebGPU's
/// guaranteed minimum.
const SHARED_FLOATS: usize = 4096;

/// Most bytes of shared memory a cube of the kernels that need more than [`SHARED_FLOATS`]
/// takes (the top-k attention's scores, the products on cooperative matrices): 32 KiB, the
/// least of the drivers the crate runs on (lavapipe's; CUDA gives 48 KiB per block).
const MAX_SHARED_BYTES: usize = 32 * 1024;

/// Most features `E` or `D` the attention kernels keep in registers per row.
const MAX_DIM: usize = 128;

/// `key_lengths` as a contiguous `[batch]` tensor of dtype `int_dtype`: the one given, or
/// every key valid (`keys_len`) when `None`.
fn key_lengths_or_all<R: CubeRuntime, F: FloatElement, I: IntElement, BT: BoolElement>(
    key_lengths: Option<CubeTensor<R>>,
    batch: usize,
    keys_len: usize,
    device: &R::Device,
    int_dtype: DType,
) -> CubeTensor<R> {
    match key_lengths {
        Some(lengths) => into_contiguous(lengths),
        None => into_contiguous(
            BurnTensor::<CubeBackend<R, F, I, BT>, 1, IntKind>::from_data(
                TensorData::new(vec![keys_len as i64; batch], [batch]),
                (device, int_dtype),
            )
            .into_primitive(),
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
