//! The centroid attention's backward on the device: the kernels and their launcher described
//! in the parent module's docs (`prepare`, `grad_rows`, `grad_keys`), over the forward's
//! `scan`, `merge` and `finish`.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::super::dropout::{KernelDropout, kernel_dropout};
use super::super::linear;
use super::{
    EMPTY, Scan, centroid_finish_kernel, group_sum, load_row, load_tile, row_group, row_units,
    scan_and_merge, split_tile, store_row, supported, tile_add, tile_dot, tiles_per_chunk,
    top_slot,
};
use crate::dropout::AttentionDropout;
use crate::ops::checks::check_centroid_attention;
use crate::ops::{CentroidAttention, CentroidAttentionGrads};

/// Backward pass 1. One unit per row, [`PREPARE_UNITS`] rows per cube: the row's log-sum-exp
/// `M + ln Z`, its `δ = rowsum(Aᶜ ⊙ dA) = grad_values · rest + grad_top · top weights` (the
/// forward outputs stand for `Aᶜ`) and, with `topk > 0`, its k-th key and that key's score
/// computed as `scan` computes it (by [`tile_dot`], the key in shared memory), `f32::MIN`
/// for a padded key as `scan` scores it.
///
/// - `stats`: from [`centroid_merge_kernel`]; `grad_values`, `rest`: `[B, H, C, D]`;
///   `top_indices`, `top_weights`, `grad_top`: `[B, H, C, topk]` (unused with `topk = 0`)
/// - `row_stats`: `[B·H·C, 3]`: the log-sum-exp, `δ`, the k-th score; `kth_keys`: `[B·H·C]`
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
fn centroid_grad_prepare_kernel<F: Float, I: Int>(
    centroids: &Tensor<F>,
    keys: &Tensor<F>,
    key_lengths: &Tensor<I>,
    stats: &Tensor<f32>,
    grad_values: &Tensor<F>,
    rest: &Tensor<F>,
    top_indices: &Tensor<I>,
    top_weights: &Tensor<F>,
    grad_top: &Tensor<F>,
    row_stats: &mut Tensor<f32>,
    kth_keys: &mut Tensor<u32>,
    #[comptime] dim: usize,
    #[comptime] topk: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let rows = centroids.shape(0) * heads * clusters;
    let keys_len = keys.shape(2);
    let dim_v = grad_values.shape(3);
    let unit = UNIT_POS_X as usize;
    let flat = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize + unit;
    let active = flat < rows;
    let bh = flat / clusters;
    let mut delta = 0.0f32;
    let mut kth = 0.0f32;
    let mut kth_key = 0u32;
    if active {
        let base = flat * dim_v;
        for d in 0..dim_v {
            delta += f32::cast_from(grad_values[base + d]) * f32::cast_from(rest[base + d]);
        }
    }
    if topk > 0 {
        let mut shared = Shared::<[f32]>::new_slice(comptime!(PREPARE_UNITS * dim));
        if active {
            let base = flat * topk;
            for r in 0..topk {
                delta += f32::cast_from(top_weights[base + r]) * f32::cast_from(grad_top[base + r]);
            }
            kth_key = u32::cast_from(top_indices[base + comptime!(topk - 1)]);
            let key_base = (bh * keys_len + kth_key as usize) * dim;
            #[unroll]
            for e in 0..dim {
                shared[unit * dim + e] = f32::cast_from(keys[key_base + e]);
            }
        }
        sync_cube();
        if active {
            let query = load_row::<F>(centroids, bh, flat % clusters, true, 0usize, dim, 1usize);
            kth = tile_dot(&query, &shared, unit, 0usize, dim, 1usize);
            let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
            if kth_key as usize >= valid {
                kth = f32::min_value();
            }
        }
    }
    if active {
        row_stats[flat * 3] = stats[flat * 2] + stats[flat * 2 + 1].ln();
        row_stats[flat * 3 + 1] = delta;
        row_stats[flat * 3 + 2] = kth;
        kth_keys[flat] = kth_key;
    }
}

/// Backward pass 2, the centroids' gradient `dS · keys`. Grid laid out as
/// [`centroid_rest_kernel`]'s (X over chunks of keys, Y over blocks of `units` rows, Z over
/// `bh`; its own `units`, tile and chunks), with `group` units per row: each holds every `group`-th feature of its row's centroid, of its
/// `grad_values` row and of its sums in registers ([`load_row`]), and the cube streams the
/// chunk's keys and values through shared memory. For each tile the units first write their
/// parts of each key's score and of `grad_values · value` to shared memory, then, after a
/// barrier, each sums its group's parts ([`group_sum`]) and recomputes
/// `Aᶜ = exp(s − (M + ln Z))` key by key; `dA = grad_values · value` outside the row's top-k and
/// the top-k weight's gradient at it, `dS = Aᶜ (dA − δ)`; with `dropout` on, `dA` outside
/// the top-k times the weight's factor, drawn again as the forward's `rest` pass draws it (for
/// a tile of keys at once into shared memory, `[tile, units]`, before the keys' loop).
/// `partial[row, chunk] = Σ dS · key` over the chunk's valid keys.
///
/// - `row_stats`, `kth_keys`: from [`centroid_grad_prepare_kernel`]
/// - `partial`: `[B·H·C, chunks · E]`
/// - cube: `units · group` units over `units` rows
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
fn centroid_grad_rows_kernel<F: Float, I: Int>(
    centroids: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    key_lengths: &Tensor<I>,
    grad_values: &Tensor<F>,
    top_indices: &Tensor<I>,
    grad_top: &Tensor<F>,
    row_stats: &Tensor<f32>,
    kth_keys: &Tensor<u32>,
    partial: &mut Tensor<f32>,
    dropout: KernelDropout,
    #[comptime] dim: usize,
    #[comptime] dim_v: usize,
    #[comptime] topk: usize,
    #[comptime] tile: usize,
    #[comptime] tiles: usize,
    #[comptime] units: usize,
    #[comptime] group: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let keys_len = keys.shape(2);
    let (chunk, chunks) = (CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let bh = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let (local, lane) = (unit / group, unit % group);
    let cube = comptime!(units * group);
    let row = CUBE_POS_Y as usize * units + local;
    let active = row < clusters;
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let query = load_row::<F>(centroids, bh, row, active, lane, dim, group);
    let gradient = load_row::<F>(grad_values, bh, row, active, lane, dim_v, group);
    let flat = bh * clusters + row;
    let mut log_sum_exp = 0.0f32;
    let mut delta = 0.0f32;
    let mut kth = 0.0f32;
    let mut kth_key = 0u32;
    if active {
        log_sum_exp = row_stats[flat * 3];
        delta = row_stats[flat * 3 + 1];
        if topk > 0 {
            kth = row_stats[flat * 3 + 2];
            kth_key = kth_keys[flat];
        }
    }

    let mut shared_keys = Shared::<[f32]>::new_slice(comptime!(tile * dim));
    let mut shared_values = Shared::<[f32]>::new_slice(comptime!(tile * dim_v));
    // Each unit's parts of the tile's scores, then of its `grad_values · value`; with dropout,
    // then the factors of the tile's keys at the cube's rows, `[tile, units]`: the rows' Philox
    // blocks drawn once per cube rather than by every unit of a row's group (in the same
    // buffer: a second one, even of one float, would pass the shared memory the tile fills).
    let on = comptime!(dropout.on);
    let factors = comptime!(2 * tile * units * group);
    let mut parts =
        Shared::<[f32]>::new_slice(comptime!(factors + if on { tile * units } else { 0 }));
    let mut sums = Array::<f32>::new(comptime!(dim.div_ceil(group)));
    #[unroll]
    for e in 0..comptime!(dim.div_ceil(group)) {
        sums[e] = 0.0f32;
    }
    let first = chunk * comptime!(tile * tiles);
    let stream = u32::new(AttentionDropout::CLUSTER_ROWS as i64);
    for t in 0..tiles {
        let start = first + t * tile;
        if start < keys_len {
            load_tile::<F>(keys, &mut shared_keys, bh, start, tile, dim);
            load_tile::<F>(values, &mut shared_values, bh, start, tile, dim_v);
            if on {
                // The tile's Philox blocks (`tile` and `start` are multiples of 8 with dropout)
                // for each of the cube's rows.
                let mut i = unit;
                while i < comptime!(tile / 8 * units) {
                    let (b, local_row) = (i / units, i % units);
                    let factor_row = CUBE_POS_Y as usize * units + local_row;
                    if factor_row < clusters {
                        dropout.block_factors(
                            &mut parts,
                            stream,
                            bh as u32,
                            factor_row as u32,
                            (start / 8 + b) as u32,
                            factors + b * comptime!(8 * units) + local_row,
                            units,
                        );
                    }
                    i += CUBE_DIM_X as usize;
                }
            }
            sync_cube();
            let end = min(min(start + tile, keys_len), valid);
            if active {
                for key in start..end {
                    let at = key - start;
                    parts[at * cube + unit] = tile_dot(&query, &shared_keys, at, lane, dim, group);
                    parts[(at + tile) * cube + unit] =
                        tile_dot(&gradient, &shared_values, at, lane, dim_v, group);
                }
            }
            sync_cube();
            if active {
                for key in start..end {
                    let at = key - start;
                    let score = group_sum(&parts, at, local * group, cube, group);
                    let weight = (score - log_sum_exp).exp();
                    let mut slot = u32::new(EMPTY as i64);
                    if topk > 0 {
                        slot =
                            top_slot::<I>(top_indices, flat, score, key as u32, kth, kth_key, topk);
                    }
                    let mut grad_weight = 0.0f32;
                    if slot != u32::new(EMPTY as i64) {
                        grad_weight = f32::cast_from(grad_top[flat * topk + slot as usize]);
                    } else {
                        let mut factor = 1.0f32;
                        if on {
                            factor = parts[factors + at * units + local];
                        }
                        grad_weight +=
                            factor * group_sum(&parts, at + tile, local * group, cube, group);
                    }
                    let grad_score = weight * (grad_weight - delta);
                    tile_add(&mut sums, grad_score, &shared_keys, at, lane, dim, group);
                }
            }
            sync_cube();
        }
    }
    if active {
        store_row::<f32>(
            partial,
            &sums,
            (flat * chunks + chunk) * dim,
            lane,
            dim,
            group,
        );
    }
}

/// Backward pass 3, the keys' gradient `dSᵀ · centroids` and the values' `Rᵀ · grad_values`.
/// Grid: X (and Y) over blocks of `units` keys, Z over `bh`, `group` units per key: each holds
/// every `group`-th feature of its key, its value and their sums in registers, and the cube
/// streams the rows' centroids and `grad_values` through shared memory, `tile` rows at a time
/// with their log-sum-exps, `δ`s and k-th scores and keys; the parts of the scores and of
/// `grad_values · value` go through shared memory as in [`centroid_grad_rows_kernel`], which
/// this recomputes `Aᶜ`, `dA` and `dS` as; a row's top-k keys take no part in its `R`. Keys
/// at or past `key_lengths[b]` get zeros. With `dropout` on, `dA` and `R` outside the top-k
/// take each weight's factor, which the cube draws for a tile of rows at once into shared
/// memory (`[tile, units]`, one Philox block per row and eight keys) before the rows' loop.
///
/// - `grad_keys`: `[B, H, S, E]`, `grad_vals`: `[B, H, S, D]`
/// - cube: `units · group` units over `units` keys
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
fn centroid_grad_keys_kernel<F: Float, I: Int>(
    centroids: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    key_lengths: &Tensor<I>,
    grad_values: &Tensor<F>,
    top_indices: &Tensor<I>,
    grad_top: &Tensor<F>,
    row_stats: &Tensor<f32>,
    kth_keys: &Tensor<u32>,
    grad_keys: &mut Tensor<F>,
    grad_vals: &mut Tensor<F>,
    dropout: KernelDropout,
    #[comptime] dim: usize,
    #[comptime] dim_v: usize,
    #[comptime] topk: usize,
    #[comptime] tile: usize,
    #[comptime] units: usize,
    #[comptime] group: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let keys_len = keys.shape(2);
    let bh = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let (local, lane) = (unit / group, unit % group);
    let cube = comptime!(units * group);
    let block = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let key = block * units + local;
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let active = key < valid;
    let key_row = load_row::<F>(keys, bh, key, active, lane, dim, group);
    let value_row = load_row::<F>(values, bh, key, active, lane, dim_v, group);
    let mut sums_k = Array::<f32>::new(comptime!(dim.div_ceil(group)));
    let mut sums_v = Array::<f32>::new(comptime!(dim_v.div_ceil(group)));
    #[unroll]
    for e in 0..comptime!(dim.div_ceil(group)) {
        sums_k[e] = 0.0f32;
    }
    #[unroll]
    for d in 0..comptime!(dim_v.div_ceil(group)) {
        sums_v[d] = 0.0f32;
    }
    let mut shared_centroids = Shared::<[f32]>::new_slice(comptime!(tile * dim));
    let mut shared_grads = Shared::<[f32]>::new_slice(comptime!(tile * dim_v));
    let mut shared_rows = Shared::<[f32]>::new_slice(comptime!(tile * 3));
    let mut shared_kth_keys = Shared::<[u32]>::new_slice(tile);
    // The parts of the scores and of `grad_values · value`; with dropout, then the factors of
    // the tile's rows at the cube's keys, `[tile, units]` (one buffer, as in
    // `centroid_grad_rows_kernel`).
    let on = comptime!(dropout.on);
    let factors = comptime!(2 * tile * units * group);
    let mut parts =
        Shared::<[f32]>::new_slice(comptime!(factors + if on { tile * units } else { 0 }));
    let stream = u32::new(AttentionDropout::CLUSTER_ROWS as i64);
    let mut start = 0usize;
    while start < clusters {
        load_tile::<F>(centroids, &mut shared_centroids, bh, start, tile, dim);
        load_tile::<F>(grad_values, &mut shared_grads, bh, start, tile, dim_v);
        let mut i = unit;
        while i < tile {
            if start + i < clusters {
                let flat = bh * clusters + start + i;
                #[unroll]
                for j in 0..3 {
                    shared_rows[i * 3 + j] = row_stats[flat * 3 + j];
                }
                shared_kth_keys[i] = kth_keys[flat];
            }
            i += CUBE_DIM_X as usize;
        }
        if on {
            // One Philox block per row and eight keys (`units` is a multiple of 8).
            let blocks = comptime!(units / 8);
            let mut i = unit;
            while i < comptime!(tile * units / 8) {
                let (at, b) = (i / blocks, i % blocks);
                if start + at < clusters {
                    dropout.block_factors(
                        &mut parts,
                        stream,
                        bh as u32,
                        (start + at) as u32,
                        (block * blocks + b) as u32,
                        factors + at * units + b * 8,
                        1usize,
                    );
                }
                i += CUBE_DIM_X as usize;
            }
        }
        sync_cube();
        let end = min(start + tile, clusters);
        if active {
            for row in start..end {
                let at = row - start;
                parts[at * cube + unit] =
                    tile_dot(&key_row, &shared_centroids, at, lane, dim, group);
                parts[(at + tile) * cube + unit] =
                    tile_dot(&value_row, &shared_grads, at, lane, dim_v, group);
            }
        }
        sync_cube();
        if active {
            for row in start..end {
                let flat = bh * clusters + row;
                let at = row - start;
                let score = group_sum(&parts, at, local * group, cube, group);
                let weight = (score - shared_rows[at * 3]).exp();
                let mut slot = u32::new(EMPTY as i64);
                if topk > 0 {
                    let (kth, kth_key) = (shared_rows[at * 3 + 2], shared_kth_keys[at]);
                    slot = top_slot::<I>(top_indices, flat, score, key as u32, kth, kth_key, topk);
                }
                let mut grad_weight = 0.0f32;
                if slot != u32::new(EMPTY as i64) {
                    grad_weight = f32::cast_from(grad_top[flat * topk + slot as usize]);
                } else {
                    let mut factor = 1.0f32;
                    if on {
                        factor = parts[factors + at * units + local];
                    }
                    grad_weight +=
                        factor * group_sum(&parts, at + tile, local * group, cube, group);
                    tile_add(
                        &mut sums_v,
                        weight * factor,
                        &shared_grads,
                        at,
                        lane,
                        dim_v,
                        group,
                    );
                }
                let grad_score = weight * (grad_weight - shared_rows[at * 3 + 1]);
                tile_add(
                    &mut sums_k,
                    grad_score,
                    &shared_centroids,
                    at,
                    lane,
                    dim,
                    group,
                );
            }
        }
        sync_cube();
        start += tile;
    }
    if key < keys_len {
        let base = bh * keys_len + key;
        store_row::<F>(grad_keys, &sums_k, base * dim, lane, dim, group);
        store_row::<F>(grad_vals, &sums_v, base * dim_v, lane, dim_v, group);
    }
}

/// Rows per cube of [`centroid_grad_prepare_kernel`] (its shared memory holds one key per row).
const PREPARE_UNITS: usize = 32;

/// Keys per cube of [`centroid_grad_keys_kernel`], at most.
const KEY_UNITS: usize = 64;

/// Most units per cube of [`centroid_grad_rows_kernel`] and [`centroid_grad_keys_kernel`].
const GRAD_UNITS: usize = 128;

/// Most floats of registers a unit of the gradient kernels holds of its row (its features of
/// the row and of the sums): see [`row_group`].
const GRAD_REGISTERS: usize = 96;

/// The centroid attention's backward by kernels that recompute `Aᶜ` tile by tile, as flash
/// attention's backward does: `scan` and `merge` again for each row's softmax statistics
/// (the forward's are not kept), then [`centroid_grad_prepare_kernel`],
/// [`centroid_grad_rows_kernel`] with the finish pass for the centroids' gradient and
/// [`centroid_grad_keys_kernel`] for the keys' and values'; no `[C, S]` tensor and no matrix
/// product. See
/// [`ClusteredAttentionBackward::centroid_attention_backward`](crate::ops::ClusteredAttentionBackward::centroid_attention_backward)
/// for the contract. The kernels read the lengths and the top-k indices as one int type: that of
/// `forward.top`'s indices, or with `topk = 0` that of `key_lengths` (`I32` when `None`);
/// `key_lengths` is cast to it. Call only when [`supported`] (with `forward`'s `topk`).
///
/// # Panics
/// As the default body: if the shapes disagree, or `forward.top` and `grad_top_weights` are
/// not both given or both `None`.
#[allow(clippy::too_many_arguments)]
pub(in crate::backends::cube) fn centroid_attention_backward(
    centroids: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    key_lengths: Option<CubeTensor>,
    forward: CentroidAttention<CubeBackend>,
    grad_values: CubeTensor,
    grad_top_weights: Option<CubeTensor>,
    dropout: Option<AttentionDropout>,
) -> CentroidAttentionGrads<CubeBackend> {
    let ([batch, heads, clusters, dim], [_, _, keys_len, dim_v]) = check_centroid_attention(
        centroids.shape().dims(),
        keys.shape().dims(),
        values.shape().dims(),
        0,
    );
    for (name, x) in [
        ("grad_values", &grad_values),
        ("forward.values", &forward.values),
    ] {
        assert!(
            x.shape().dims::<4>() == [batch, heads, clusters, dim_v],
            "{name} {:?} must be [batch, heads, C, D] = {:?}",
            x.shape().dims::<4>(),
            [batch, heads, clusters, dim_v]
        );
    }
    let top = match (forward.top, grad_top_weights) {
        (Some((indices, weights)), Some(grad_top)) => {
            let shape = indices.shape().dims::<4>();
            assert!(
                shape == weights.shape().dims::<4>()
                    && shape == grad_top.shape().dims::<4>()
                    && shape[..3] == [batch, heads, clusters]
                    && shape[3] <= keys_len,
                "forward.top {shape:?}, its weights {:?} and grad_top_weights {:?} must all be \
                 [batch, heads, C, k] with [batch, heads, C] = {:?} and k ≤ S = {keys_len}",
                weights.shape().dims::<4>(),
                grad_top.shape().dims::<4>(),
                [batch, heads, clusters]
            );
            Some((indices, weights, grad_top))
        }
        (None, None) => None,
        _ => panic!("forward.top and grad_top_weights must be both given or both None"),
    };
    let topk = top.as_ref().map_or(0, |(indices, _, _)| indices.shape()[3]);
    debug_assert!(supported(dim, dim_v, topk));
    let (client, device) = (centroids.client.clone(), centroids.device.clone());
    let float_dtype = centroids.dtype;
    let int_dtype = match (&top, &key_lengths) {
        (Some((indices, _, _)), _) => indices.dtype,
        (None, Some(lengths)) => lengths.dtype,
        (None, None) => DType::I32,
    };
    let dtypes = [
        dtype_to_storage_type(float_dtype),
        dtype_to_storage_type(int_dtype),
    ];
    let key_lengths = key_lengths.map(|lengths| cast(lengths, int_dtype));
    let key_lengths =
        super::super::key_lengths_or_all(key_lengths, batch, keys_len, &device, int_dtype);
    let (centroids, keys, values) = (
        into_contiguous(centroids),
        into_contiguous(keys),
        into_contiguous(values),
    );
    let grad_values = into_contiguous(grad_values);
    let rest = into_contiguous(forward.values);
    // With `topk = 0` the kernels read none of the top-k tensors: any of the right types.
    let (top_indices, top_weights, grad_top) = match top {
        Some((indices, weights, grad_top)) => (
            into_contiguous(indices),
            into_contiguous(weights),
            into_contiguous(grad_top),
        ),
        None => (key_lengths.clone(), rest.clone(), grad_values.clone()),
    };
    let rows = batch * heads * clusters;
    let empty = |shape: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::from(shape), dtype)
    };
    let Scan { stats, .. } = scan_and_merge(&centroids, &keys, &key_lengths, 0, int_dtype);

    let row_stats = empty(vec![rows, 3], DType::F32);
    let kth_keys = empty(vec![rows], DType::U32);
    launch!(centroid_grad_prepare_kernel(
        &client,
        super::super::cube_count(rows.div_ceil(PREPARE_UNITS), 1),
        CubeDim::new_1d(PREPARE_UNITS as u32),
        linear(centroids.clone()),
        linear(keys.clone()),
        linear(key_lengths.clone()),
        linear(stats.clone()),
        linear(grad_values.clone()),
        linear(rest),
        linear(top_indices.clone()),
        linear(top_weights),
        linear(grad_top.clone()),
        linear(row_stats.clone()),
        linear(kth_keys.clone()),
        dim,
        topk,
        dtypes,
    ));

    let group = row_group([dim, dim_v], 2, GRAD_REGISTERS);
    let units = row_units(clusters).min(GRAD_UNITS / group);
    let row_blocks = clusters.div_ceil(units);
    // Each key's key and value, the parts, and with dropout its factors at the cube's rows,
    // whole Philox blocks of eight keys a tile.
    let tile = match dropout {
        Some(_) => (split_tile(dim + dim_v + units, 2 * units * group) / 8 * 8).max(8),
        None => split_tile(dim + dim_v, 2 * units * group),
    };
    let tiles = tiles_per_chunk(keys_len, tile, row_blocks * batch * heads);
    let chunks = keys_len.div_ceil(tile * tiles);
    let partial = empty(vec![rows, chunks * dim], DType::F32);
    launch!(centroid_grad_rows_kernel(
        &client,
        CubeCount::Static(chunks as u32, row_blocks as u32, (batch * heads) as u32),
        CubeDim::new_1d((units * group) as u32),
        linear(centroids.clone()),
        linear(keys.clone()),
        linear(values.clone()),
        linear(key_lengths.clone()),
        linear(grad_values.clone()),
        linear(top_indices.clone()),
        linear(grad_top.clone()),
        linear(row_stats.clone()),
        linear(kth_keys.clone()),
        linear(partial.clone()),
        kernel_dropout(dropout),
        dim,
        dim_v,
        topk,
        tile,
        tiles,
        units,
        group,
        dtypes,
    ));
    let grad_centroids = empty(vec![rows, dim], float_dtype);
    let finish_units = 256;
    launch!(centroid_finish_kernel(
        &client,
        super::super::cube_count((rows * dim).div_ceil(finish_units), 1),
        CubeDim::new_1d(finish_units as u32),
        linear(partial),
        linear(stats.clone()),
        linear(grad_centroids.clone()),
        false,
        dtype_to_storage_type(float_dtype),
    ));

    let grad_keys = empty(vec![batch, heads, keys_len, dim], float_dtype);
    let grad_vals = empty(vec![batch, heads, keys_len, dim_v], float_dtype);
    let key_units = KEY_UNITS.min(GRAD_UNITS / group);
    debug_assert!(key_units.is_multiple_of(8), "a Philox block per eight keys");
    // Each row's centroid, gradient, three statistics and k-th key, and with dropout its
    // factors at the cube's keys.
    let dropped_keys = if dropout.is_some() { key_units } else { 0 };
    let key_tile = split_tile(dim + dim_v + 4 + dropped_keys, 2 * key_units * group);
    launch!(centroid_grad_keys_kernel(
        &client,
        super::super::cube_count(keys_len.div_ceil(key_units), batch * heads),
        CubeDim::new_1d((key_units * group) as u32),
        linear(centroids),
        linear(keys),
        linear(values),
        linear(key_lengths),
        linear(grad_values),
        linear(top_indices),
        linear(grad_top),
        linear(row_stats),
        linear(kth_keys),
        linear(grad_keys.clone()),
        linear(grad_vals.clone()),
        kernel_dropout(dropout),
        dim,
        dim_v,
        topk,
        key_tile,
        key_units,
        group,
        dtypes,
    ));
    CentroidAttentionGrads {
        centroids: reshape(grad_centroids, Shape::new([batch, heads, clusters, dim])),
        keys: grad_keys,
        values: grad_vals,
    }
}
