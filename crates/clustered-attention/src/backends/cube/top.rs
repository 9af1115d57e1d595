//! The per-query part of improved clustered attention on the device (paper eqs. 8–10), and the
//! cluster means it starts from, both over the queries sorted by cluster
//! ([`sort_by_cluster`]).
//!
//! - `top_attention`: one cube per (cluster, `bh`) loads the cluster's top-k keys and values
//!   into shared memory once, then each unit takes member queries in turn: the `k` scores and
//!   their maximum in a first pass (the scores in a shared-memory column of the unit's own),
//!   then `m̂ · Σ p_r v_r + rest` in a second (padded keys left out), written straight to the
//!   query's output row. Padded queries (cluster `-1`) get zeros.
//! - `cluster_means`: one cube per (cluster, `bh`), one unit per feature, summing the members'
//!   queries in sorted order, times the inverse count and the softmax scale.
//!
//! Sums accumulate in `f32`; every tensor is contiguous; `bh` is the flattened `(batch, head)`.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::{empty_device_contiguous_dtype, zeros_client};
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::dropout::AttentionDropout;

use super::device_properties;
use super::dropout::{KernelDropout, RowDraws, kernel_dropout};
use super::mma::{Mma, mma_shape, score_tile};
use super::sparse::{SORT_CLUSTERS, sort_by_cluster};
use super::{MAX_DIM, MAX_SHARED_BYTES, SHARED_FLOATS, linear};

/// One cube per (cluster, `bh`): grid X (folded into Y) over clusters, Z over `bh`.
///
/// With cooperative matrices (`mma`), the cluster's top-k keys go to shared memory in the float
/// type, `k_pad` rows of `dim_pad` (zero-padded to whole tiles), and the members go by in blocks
/// of `units`: the block's queries are copied next to them and [`score_tile`] computes the
/// block's scores, which the units then scale. Otherwise each unit takes member queries in
/// turn and sums their scores itself from the keys in `f32`. The softmax and the weighted sum
/// are the same code after that.
///
/// - `queries`: `[B, H, L, E]`, `keys`: `[B, H, S, E]`, `values`: `[B, H, S, D]`
/// - `topk`: `[B, H, C, k]`, `mass`: `[B, H, C, 1]`, `rest`: `[B, H, C, D]`
/// - `key_lengths`: `[B]`; `order`: `[bh, L]`, `starts`: `[bh, C + 1]`
/// - `output`: `[B, H, L, D]`, zero on entry (rows of padded queries are not written)
/// - `units`: `CUBE_DIM_X`; shared memory: the keys (`k · E` in `f32`, or `k_pad · dim_pad` in
///   the float type and `units · dim_pad` queries), `k · D` values, `k · units` scores (`k_pad`)
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
fn top_attention_kernel<F: Float, I: Int>(
    queries: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    topk: &Tensor<I>,
    mass: &Tensor<F>,
    rest: &Tensor<F>,
    key_lengths: &Tensor<I>,
    order: &Tensor<u32>,
    starts: &Tensor<u32>,
    output: &mut Tensor<F>,
    scale: f32,
    dropout: KernelDropout,
    #[comptime] dim: usize,
    #[comptime] dim_v: usize,
    #[comptime] k: usize,
    #[comptime] units: usize,
    #[comptime] mma: Mma,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (heads, len) = (queries.shape(1), queries.shape(2));
    let keys_len = keys.shape(2);
    let clusters = topk.shape(2);
    let cluster = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let bh = CUBE_POS_Z as usize;
    if cluster >= clusters {
        terminate!();
    }
    let first = starts[bh * (clusters + 1) + cluster] as usize;
    let last = starts[bh * (clusters + 1) + cluster + 1] as usize;
    if first == last {
        terminate!();
    }
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let unit = UNIT_POS_X as usize;
    let row = bh * clusters + cluster;
    let on = comptime!(mma.is_some());
    let dim_pad = comptime!(if on { mma.pad_depth(dim) } else { dim });
    let k_pad = comptime!(if on { mma.pad_cols(k) } else { k });

    let mut shared_keys = Shared::<[f32]>::new_slice(comptime!(if on { 1 } else { k * dim }));
    let mut shared_keys_mma =
        Shared::<[F]>::new_aligned_slice(comptime!(if on { k_pad * dim_pad } else { 1 }), 32usize);
    let mut shared_queries =
        Shared::<[F]>::new_aligned_slice(comptime!(if on { units * dim_pad } else { 1 }), 32usize);
    let mut shared_values = Shared::<[f32]>::new_slice(comptime!(k * dim_v));
    if on {
        let mut i = unit;
        while i < comptime!(k_pad * dim_pad) {
            let (slot, e) = (i / dim_pad, i % dim_pad);
            let mut x = F::new(0.0_f32);
            if slot < k && e < dim {
                let key = u32::cast_from(topk[row * k + slot]) as usize;
                x = keys[(bh * keys_len + key) * dim + e];
            }
            shared_keys_mma[i] = x;
            i += units;
        }
    } else {
        let mut i = unit;
        while i < comptime!(k * dim) {
            let key = u32::cast_from(topk[row * k + i / dim]) as usize;
            shared_keys[i] = f32::cast_from(keys[(bh * keys_len + key) * dim + i % dim]);
            i += units;
        }
    }
    let mut i = unit;
    while i < comptime!(k * dim_v) {
        let key = u32::cast_from(topk[row * k + i / dim_v]) as usize;
        shared_values[i] = f32::cast_from(values[(bh * keys_len + key) * dim_v + i % dim_v]);
        i += units;
    }
    // Which of the k keys are valid (not padded), one flag per slot, in shared memory: a
    // per-unit array indexed in a loop would sit in scratch memory on some drivers.
    let mut valid_slot = Shared::<[u32]>::new_slice(k);
    let mut i = unit;
    while i < k {
        let mut flag = 0u32;
        if (u32::cast_from(topk[row * k + i]) as usize) < valid {
            flag = 1u32;
        }
        valid_slot[i] = flag;
        i += units;
    }
    let cluster_mass = f32::cast_from(mass[row]);
    // Slot `r`'s score of this unit's query at `r · units + unit`: the units of a plane touch
    // consecutive words.
    let mut shared_scores = Shared::<[f32]>::new_aligned_slice(comptime!(k_pad * units), 32usize);
    sync_cube();

    if on {
        // Every unit runs every block (the products take whole planes).
        let mut block = first;
        while block < last {
            let mut i = unit;
            while i < comptime!(units * dim_pad) {
                let (p, e) = (block + i / dim_pad, i % dim_pad);
                let mut x = F::new(0.0_f32);
                if p < last && e < dim {
                    let index = order[bh * len + p] as usize;
                    x = queries[(bh * len + index) * dim + e];
                }
                shared_queries[i] = x;
                i += units;
            }
            sync_cube();
            score_tile::<F>(
                &shared_queries,
                &shared_keys_mma,
                &mut shared_scores,
                units,
                k_pad,
                dim_pad,
                comptime!(mma.m),
                comptime!(mma.n),
                comptime!(mma.k),
            );
            sync_cube();
            let p = block + unit;
            if p < last {
                let mut maximum = f32::min_value();
                for r in 0..k {
                    if valid_slot[r] != 0 {
                        let score = shared_scores[r * units + unit] * scale;
                        shared_scores[r * units + unit] = score;
                        maximum = max(maximum, score);
                    }
                }
                let index = order[bh * len + p] as usize;
                weighted_sum::<F>(
                    &shared_scores,
                    &shared_values,
                    &valid_slot,
                    rest,
                    output,
                    maximum,
                    cluster_mass,
                    row,
                    (bh * len + index) * dim_v,
                    &dropout,
                    bh as u32,
                    index as u32,
                    unit,
                    units,
                    k,
                    dim_v,
                );
            }
            sync_cube();
            block += units;
        }
    } else {
        let mut query = Array::<f32>::new(dim);
        let mut p = first + unit;
        while p < last {
            let index = order[bh * len + p] as usize;
            let query_base = (bh * len + index) * dim;
            #[unroll]
            for e in 0..dim {
                query[e] = f32::cast_from(queries[query_base + e]) * scale;
            }
            // The softmax in two passes: the scores and their maximum, then the weights and
            // the sums (one exponential per key, no rescaling).
            let mut maximum = f32::min_value();
            for r in 0..k {
                if valid_slot[r] != 0 {
                    let mut score = 0.0f32;
                    #[unroll]
                    for e in 0..dim {
                        score += query[e] * shared_keys[r * dim + e];
                    }
                    shared_scores[r * units + unit] = score;
                    maximum = max(maximum, score);
                }
            }
            weighted_sum::<F>(
                &shared_scores,
                &shared_values,
                &valid_slot,
                rest,
                output,
                maximum,
                cluster_mass,
                row,
                (bh * len + index) * dim_v,
                &dropout,
                bh as u32,
                index as u32,
                unit,
                units,
                k,
                dim_v,
            );
            p += units;
        }
    }
}

/// One query's output row at `out_base`: `m̂ · Σ_r p_r v_r + rest[row]`, with `p_r` the softmax
/// of the unit's scores (`scores[r · units + unit]`, maximum `maximum`) over the valid slots.
/// With `dropout` on, each `p_r v_r` times the factor of rank `r` of query `query` of `bh` on
/// [`AttentionDropout::QUERY_TOP`] (the softmax's denominator undropped), a Philox block drawn
/// per eight ranks.
#[allow(clippy::too_many_arguments)]
#[cube]
fn weighted_sum<F: Float>(
    scores: &Shared<[f32]>,
    values: &Shared<[f32]>,
    valid_slot: &Shared<[u32]>,
    rest: &Tensor<F>,
    output: &mut Tensor<F>,
    maximum: f32,
    cluster_mass: f32,
    row: usize,
    out_base: usize,
    dropout: &KernelDropout,
    bh: u32,
    query: u32,
    unit: usize,
    #[comptime] units: usize,
    #[comptime] k: usize,
    #[comptime] dim_v: usize,
) {
    let mut sums = Array::<f32>::new(dim_v);
    #[unroll]
    for d in 0..dim_v {
        sums[d] = 0.0f32;
    }
    let mut total = 0.0f32;
    let mut draws = RowDraws::new();
    let stream = u32::new(AttentionDropout::QUERY_TOP as i64);
    for r in 0..k {
        if valid_slot[r] != 0 {
            let weight = (scores[r * units + unit] - maximum).exp();
            total += weight;
            let kept = weight * dropout.row_factor(&mut draws, stream, bh, query, r as u32);
            #[unroll]
            for d in 0..dim_v {
                sums[d] += kept * values[r * dim_v + d];
            }
        }
    }
    let factor = cluster_mass / total;
    #[unroll]
    for d in 0..dim_v {
        output[out_base + d] =
            F::cast_from(sums[d] * factor + f32::cast_from(rest[row * dim_v + d]));
    }
}

/// `centroids[bh, c] = scale · inverse_counts[bh, c] · Σ_{i in c} queries[bh, i]`, one cube per
/// (cluster, `bh`) as [`top_attention_kernel`], one unit per feature (a loop past `CUBE_DIM_X`).
///
/// - `queries`: `[B, H, L, E]`, `inverse_counts`: `[B, H, C, 1]`, `centroids`: `[B, H, C, E]`
#[cube(launch, create_dummy_kernel)]
fn cluster_means_kernel<F: Float>(
    queries: &Tensor<F>,
    inverse_counts: &Tensor<F>,
    order: &Tensor<u32>,
    starts: &Tensor<u32>,
    centroids: &mut Tensor<F>,
    scale: f32,
    #[define(F)] _dtype: ElemType,
) {
    let (len, dim) = (queries.shape(2), queries.shape(3));
    let clusters = centroids.shape(2);
    let cluster = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let bh = CUBE_POS_Z as usize;
    if cluster >= clusters {
        terminate!();
    }
    let first = starts[bh * (clusters + 1) + cluster] as usize;
    let last = starts[bh * (clusters + 1) + cluster + 1] as usize;
    let row = bh * clusters + cluster;
    let factor = f32::cast_from(inverse_counts[row]) * scale;
    let mut e = UNIT_POS_X as usize;
    while e < dim {
        let mut sum = 0.0f32;
        for p in first..last {
            let index = order[bh * len + p] as usize;
            sum += f32::cast_from(queries[(bh * len + index) * dim + e]);
        }
        centroids[row * dim + e] = F::cast_from(sum * factor);
        e += CUBE_DIM_X as usize;
    }
}

/// Units per cube of the two kernels (of [`top_attention_kernel`] at most).
const UNITS: u32 = 64;

/// Units per cube of [`top_attention_kernel`]: [`UNITS`], or [`MIN_TOP_UNITS`] where the
/// scores of 64 units would take its shared memory past [`MAX_SHARED_BYTES`].
fn top_units(dim: usize, dim_v: usize, k: usize) -> usize {
    if k * (dim + dim_v + UNITS as usize + 1) * 4 <= MAX_SHARED_BYTES {
        UNITS as usize
    } else {
        MIN_TOP_UNITS
    }
}

/// The tile shape and units per cube of [`top_attention_kernel`] on cooperative matrices: where
/// [`mma_shape`] gives a shape for `dtype` and the kernel's shared memory fits
/// [`MAX_SHARED_BYTES`] with 64 or 32 units (the keys in the float type, padded to whole tiles).
fn top_mma(
    client: &Client,
    dtype: DType,
    dim: usize,
    dim_v: usize,
    k: usize,
) -> Option<(Mma, usize)> {
    let mma = mma_shape(&device_properties(client), dtype);
    if !mma.is_some() {
        return None;
    }
    let (dim_pad, k_pad, half) = (mma.pad_depth(dim), mma.pad_cols(k), 2);
    [UNITS as usize, MIN_TOP_UNITS]
        .into_iter()
        .find(|&units| {
            let bytes = k_pad * dim_pad * half
                + k * dim_v * 4
                + units * dim_pad * half
                + units * k_pad * 4
                + k * 4;
            bytes <= MAX_SHARED_BYTES
        })
        .map(|units| (mma, units))
}

/// The fewest units per cube of [`top_attention_kernel`].
const MIN_TOP_UNITS: usize = 32;

/// Whether [`top_attention`] takes these sizes (`E, D ≤ 128`, the top-k keys and values in
/// 16 KiB, with the scores of [`MIN_TOP_UNITS`] units in 32 KiB, at most [`SORT_CLUSTERS`]
/// clusters); otherwise the caller uses the default body.
pub(super) fn supported(dim: usize, dim_v: usize, k: usize, clusters: usize) -> bool {
    dim > 0
        && dim_v > 0
        && dim <= MAX_DIM
        && dim_v <= MAX_DIM
        && k > 0
        && k * (dim + dim_v) <= SHARED_FLOATS
        && k * (dim + dim_v + MIN_TOP_UNITS + 1) * 4 <= MAX_SHARED_BYTES
        && clusters <= SORT_CLUSTERS
}

/// The queries sorted by cluster: [`sort_by_cluster`] of `assignments` (`[B, H, L]`).
pub(super) struct Sorted {
    order: CubeTensor,
    starts: CubeTensor,
}

impl Sorted {
    pub(super) fn new(assignments: CubeTensor, clusters: usize) -> Self {
        let (order, starts) = sort_by_cluster(into_contiguous(assignments), clusters);
        Self { order, starts }
    }
}

/// A grid of one cube per (cluster, `bh`).
fn cluster_grid(clusters: usize, bh: usize) -> CubeCount {
    super::cube_count(clusters, bh)
}

/// The cluster means times `scale`: `[B, H, L, E]` queries → `[B, H, C, E]` (see
/// [`cluster_means_kernel`]).
pub(super) fn cluster_means(
    queries: CubeTensor,
    inverse_counts: CubeTensor,
    sorted: &Sorted,
    scale: f64,
) -> CubeTensor {
    let [batch, heads, _, dim] = queries.shape().dims();
    let clusters = inverse_counts.shape()[2];
    let dtype = queries.dtype;
    let centroids = empty_device_contiguous_dtype(
        queries.client.clone(),
        queries.device.clone(),
        Shape::new([batch, heads, clusters, dim]),
        dtype,
    );
    launch!(cluster_means_kernel(
        &queries.client.clone(),
        cluster_grid(clusters, batch * heads),
        CubeDim::new_1d(UNITS),
        linear(into_contiguous(queries)),
        linear(into_contiguous(inverse_counts)),
        linear(sorted.order.clone()),
        linear(sorted.starts.clone()),
        linear(centroids.clone()),
        scale as f32,
        dtype_to_storage_type(dtype),
    ));
    centroids
}

/// [`ClusteredAttentionBackend::top_attention`](crate::ClusteredAttentionBackend::top_attention)
/// by [`top_attention_kernel`], given the queries sorted by cluster (with `dropout`, the top-k
/// weights dropped in the kernel). The kernel reads the
/// lengths as `topk`'s int type (`key_lengths`, when given, is cast to it). The shapes are
/// checked by the caller; call only when [`supported`].
#[allow(clippy::too_many_arguments)]
pub(super) fn top_attention(
    queries: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    topk: CubeTensor,
    mass: CubeTensor,
    rest: CubeTensor,
    key_lengths: Option<CubeTensor>,
    scale: f64,
    sorted: &Sorted,
    dropout: Option<AttentionDropout>,
) -> CubeTensor {
    let [batch, heads, len, dim] = queries.shape().dims();
    let [_, _, keys_len, dim_v] = values.shape().dims();
    let [_, _, clusters, k] = topk.shape().dims();
    let (device, float_dtype, int_dtype) = (queries.device.clone(), queries.dtype, topk.dtype);
    let key_lengths = key_lengths.map(|lengths| cast(lengths, int_dtype));
    let key_lengths = super::key_lengths_or_all(key_lengths, batch, keys_len, &device, int_dtype);
    let client = queries.client.clone();
    // Padded queries' rows stay zero; Burn's `zeros` may pitch its rows, the kernel does not.
    let output = into_contiguous(zeros_client(
        client.clone(),
        device,
        Shape::new([batch, heads, len, dim_v]),
        float_dtype,
    ));
    let (mma, units) = top_mma(&client, float_dtype, dim, dim_v, k)
        .unwrap_or((Mma::NONE, top_units(dim, dim_v, k)));
    launch!(top_attention_kernel(
        &client,
        cluster_grid(clusters, batch * heads),
        CubeDim::new_1d(units as u32),
        linear(into_contiguous(queries)),
        linear(into_contiguous(keys)),
        linear(into_contiguous(values)),
        linear(into_contiguous(topk)),
        linear(into_contiguous(mass)),
        linear(into_contiguous(rest)),
        linear(key_lengths),
        linear(sorted.order.clone()),
        linear(sorted.starts.clone()),
        linear(output.clone()),
        scale as f32,
        kernel_dropout(dropout),
        dim,
        dim_v,
        k,
        units,
        mma,
        [
            dtype_to_storage_type(float_dtype),
            dtype_to_storage_type(int_dtype),
        ],
    ));
    reshape(output, Shape::new([batch, heads, len, dim_v]))
}
