//! Centroid attention on the device, flash-style (paper eqs. 4–5, and for improved attention
//! the per-cluster top-k of eq. 9 and the rest of eq. 10): no `[C, S]` scores or weights are
//! ever written to memory.
//!
//! Four launches, each over every (batch, head) row at once:
//! 1. `scan`: one cube per (chunk of keys, block of cluster rows, `bh`). Each unit owns one
//!    centroid row, held in registers, and streams the chunk's keys through shared memory a
//!    tile at a time: it keeps the running maximum and sum of `exp(score − max)` (an online
//!    softmax) and, with `topk > 0`, its chunk's `topk` best scores, sorted, in registers.
//! 2. `merge`: one unit per row combines its chunks: the row's maximum `M`, the softmax
//!    denominator `Z`, the row's top-k (by score, descending, ties to the lower index, as the
//!    top-k kernel orders them) and their weights `exp(s − M) / Z`.
//! 3. `rest`: the same grid as `scan`, with keys and values in shared memory: each unit sums
//!    `exp(s − M) · v` over the chunk's valid keys outside its row's top-k, in `f32`. A key's
//!    score is recomputed by the same code as in `scan`, so it compares bit for bit with the
//!    k-th best score: the rest is summed without the top-k keys, not as a difference.
//! 4. `finish`: `values = Σ_chunks rest / Z`, cast to the float type.
//!
//! Scores, sums and products accumulate in `f32` whatever the float type; every tensor is
//! contiguous; `bh` is the flattened `(batch, head)` index. Padded keys (at or past
//! `key_lengths[b]`) take no weight; they stay candidates of the top-k with the lowest score,
//! as the default body's `-inf` makes them, so a row with fewer valid keys than `topk` gets
//! them last, lower indices first, at weight 0.

use burn::tensor::{
    DType, Int as IntKind, Shape, Tensor as BurnTensor, TensorData, TensorMetadata,
};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use cubecl::prelude::*;

use super::linear;
use crate::ops::CentroidAttention;
use crate::ops::checks::check_centroid_attention;

/// Marks an empty top-k slot (a chunk with fewer keys than `topk`).
const EMPTY: u32 = u32::MAX;

/// One centroid row's score against key `key` of the tile in `shared` (`dim` floats per key).
/// `scan` and `rest` both call it, so a key's score is the same bits in both.
#[cube]
fn tile_score(
    query: &Array<f32>,
    shared: &SharedMemory<f32>,
    key: usize,
    #[comptime] dim: usize,
) -> f32 {
    let base = key * dim;
    let mut score = 0.0f32;
    #[unroll]
    for e in 0..dim {
        score += query[e] * shared[base + e];
    }
    score
}

/// Inserts `(score, key)` into the sorted list `best[..filled]` of at most `topk`: higher score
/// first; keys arrive in increasing order, so an equal score never displaces an earlier key.
/// Returns the new fill.
#[cube]
fn insert_top(
    best: &mut Array<f32>,
    best_keys: &mut Array<u32>,
    filled: usize,
    score: f32,
    key: u32,
    #[comptime] topk: usize,
) -> usize {
    let mut admit = filled < topk;
    if !admit {
        admit = score > best[topk - 1];
    }
    let mut fill = filled;
    if admit {
        let mut slot = filled;
        if filled == topk {
            slot = topk - 1;
        }
        loop {
            if slot == 0 {
                break;
            }
            if score <= best[slot - 1] {
                break;
            }
            best[slot] = best[slot - 1];
            best_keys[slot] = best_keys[slot - 1];
            slot -= 1;
        }
        best[slot] = score;
        best_keys[slot] = key;
        if filled < topk {
            fill += 1;
        }
    }
    fill
}

/// Loads the centroid row `row` of `bh` into registers, as `f32` (zeros for an inactive unit).
#[cube]
fn load_query<F: Float>(
    centroids: &Tensor<F>,
    bh: usize,
    row: usize,
    active: bool,
    #[comptime] dim: usize,
) -> Array<f32> {
    let clusters = centroids.shape(2);
    let mut query = Array::<f32>::new(dim);
    let base = (bh * clusters + row) * dim;
    #[unroll]
    for e in 0..dim {
        query[e] = 0.0f32;
        if active {
            query[e] = f32::cast_from(centroids[base + e]);
        }
    }
    query
}

/// Copies keys `start..start + tile` of `bh` (rows of `dim` floats of `source`, `[B, H, S,
/// dim]`) into `shared` as `f32`, zeros past the last key; all units of the cube take part.
#[cube]
fn load_tile<F: Float>(
    source: &Tensor<F>,
    shared: &mut SharedMemory<f32>,
    bh: usize,
    start: usize,
    #[comptime] tile: usize,
    #[comptime] dim: usize,
) {
    let keys_len = source.shape(2);
    let base = (bh * keys_len + start) * dim;
    let available = (keys_len - start) * dim;
    let mut i = UNIT_POS_X as usize;
    while i < comptime!(tile * dim) {
        let mut x = 0.0f32;
        if i < available {
            x = f32::cast_from(source[base + i]);
        }
        shared[i] = x;
        i += CUBE_DIM_X as usize;
    }
}

/// Pass 1. Grid: X over chunks of `tile · tiles` keys, Y over blocks of `CUBE_DIM_X` rows,
/// Z over `bh`.
///
/// - `centroids`: `[B, H, C, E]`, `keys`: `[B, H, S, E]`, `key_lengths`: `[B]`
/// - `maxima`, `sums`: `[B·H·C, chunks]`
/// - `top_scores`, `top_keys`: `[B·H·C, chunks · topk]` (unused with `topk = 0`)
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn centroid_scan_kernel<F: Float, I: Int>(
    centroids: &Tensor<F>,
    keys: &Tensor<F>,
    key_lengths: &Tensor<I>,
    maxima: &mut Tensor<f32>,
    sums: &mut Tensor<f32>,
    top_scores: &mut Tensor<f32>,
    top_keys: &mut Tensor<u32>,
    #[comptime] dim: usize,
    #[comptime] topk: usize,
    #[comptime] tile: usize,
    #[comptime] tiles: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let keys_len = keys.shape(2);
    let (chunk, chunks) = (CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let bh = CUBE_POS_Z as usize;
    let row = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let active = row < clusters;
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let query = load_query::<F>(centroids, bh, row, active, dim);

    let mut shared = SharedMemory::<f32>::new(comptime!(tile * dim));
    let mut maximum = f32::min_value();
    let mut sum = 0.0f32;
    let slots = comptime!(if topk > 0 { topk } else { 1 });
    let mut best = Array::<f32>::new(slots);
    let mut best_keys = Array::<u32>::new(slots);
    let mut filled = 0usize;
    let first = chunk * comptime!(tile * tiles);
    for t in 0..tiles {
        let start = first + t * tile;
        if start < keys_len {
            load_tile::<F>(keys, &mut shared, bh, start, tile, dim);
            sync_cube();
            if active {
                let end = min(start + tile, keys_len);
                for key in start..end {
                    let mut score = tile_score(&query, &shared, key - start, dim);
                    if key < valid {
                        if score > maximum {
                            sum = sum * (maximum - score).exp() + 1.0f32;
                            maximum = score;
                        } else {
                            sum += (score - maximum).exp();
                        }
                    } else {
                        score = f32::min_value();
                    }
                    if topk > 0 {
                        filled =
                            insert_top(&mut best, &mut best_keys, filled, score, key as u32, topk);
                    }
                }
            }
            sync_cube();
        }
    }
    if active {
        let out = (bh * clusters + row) * chunks + chunk;
        maxima[out] = maximum;
        sums[out] = sum;
        if topk > 0 {
            #[unroll]
            for r in 0..topk {
                let mut score = f32::min_value();
                let mut key = u32::new(EMPTY as i64);
                if r < filled {
                    score = best[r];
                    key = best_keys[r];
                }
                top_scores[out * topk + r] = score;
                top_keys[out * topk + r] = key;
            }
        }
    }
}

/// Pass 2. One unit per row: the row's maximum and softmax denominator over its chunks and,
/// with `topk > 0`, its top-k merged from the chunks' lists and their weights.
///
/// - `maxima`, `sums`: `[rows, chunks]`; `top_scores`, `top_keys`: `[rows, chunks · topk]`
/// - `stats`: `[rows, 3]`: maximum, denominator, k-th best score; `kth_keys`: `[rows]`
/// - `top_indices`, `top_weights`: `[rows, topk]` (unused with `topk = 0`)
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn centroid_merge_kernel<F: Float, I: Int>(
    maxima: &Tensor<f32>,
    sums: &Tensor<f32>,
    top_scores: &Tensor<f32>,
    top_keys: &Tensor<u32>,
    stats: &mut Tensor<f32>,
    kth_keys: &mut Tensor<u32>,
    top_indices: &mut Tensor<I>,
    top_weights: &mut Tensor<F>,
    #[comptime] topk: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (rows, chunks) = (maxima.shape(0), maxima.shape(1));
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if row >= rows {
        terminate!();
    }
    let base = row * chunks;
    let mut maximum = f32::min_value();
    for c in 0..chunks {
        maximum = max(maximum, maxima[base + c]);
    }
    let mut denominator = 0.0f32;
    for c in 0..chunks {
        denominator += sums[base + c] * (maxima[base + c] - maximum).exp();
    }
    stats[row * 3] = maximum;
    stats[row * 3 + 1] = denominator;
    if topk > 0 {
        let mut best = Array::<f32>::new(topk);
        let mut best_keys = Array::<u32>::new(topk);
        let mut filled = 0usize;
        // Chunks in key order, each list sorted: equal scores arrive lower key first.
        for i in 0..chunks * topk {
            let key = top_keys[base * topk + i];
            if key != EMPTY {
                filled = insert_top(
                    &mut best,
                    &mut best_keys,
                    filled,
                    top_scores[base * topk + i],
                    key,
                    topk,
                );
            }
        }
        #[unroll]
        for r in 0..topk {
            top_indices[row * topk + r] = I::cast_from(best_keys[r]);
            top_weights[row * topk + r] = F::cast_from((best[r] - maximum).exp() / denominator);
        }
        stats[row * 3 + 2] = best[topk - 1];
        kth_keys[row] = best_keys[topk - 1];
    }
}

/// Pass 3. Grid as [`centroid_scan_kernel`] (its own chunks). `partial[row, chunk]` =
/// `Σ exp(s − M) · values[key]` over the chunk's valid keys outside the row's top-k.
///
/// - `values`: `[B, H, S, D]`; `stats`, `kth_keys`: from [`centroid_merge_kernel`]
/// - `partial`: `[B·H·C, chunks · D]`
#[allow(clippy::too_many_arguments)]
#[cube(launch)]
fn centroid_rest_kernel<F: Float, I: Int>(
    centroids: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    key_lengths: &Tensor<I>,
    stats: &Tensor<f32>,
    kth_keys: &Tensor<u32>,
    partial: &mut Tensor<f32>,
    #[comptime] dim: usize,
    #[comptime] dim_v: usize,
    #[comptime] topk: usize,
    #[comptime] tile: usize,
    #[comptime] tiles: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let keys_len = keys.shape(2);
    let (chunk, chunks) = (CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let bh = CUBE_POS_Z as usize;
    let row = CUBE_POS_Y as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let active = row < clusters;
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let query = load_query::<F>(centroids, bh, row, active, dim);
    let flat = bh * clusters + row;
    let mut maximum = 0.0f32;
    let mut kth = 0.0f32;
    let mut kth_key = 0u32;
    if active {
        maximum = stats[flat * 3];
        if topk > 0 {
            kth = stats[flat * 3 + 2];
            kth_key = kth_keys[flat];
        }
    }

    let mut shared_keys = SharedMemory::<f32>::new(comptime!(tile * dim));
    let mut shared_values = SharedMemory::<f32>::new(comptime!(tile * dim_v));
    let mut sums = Array::<f32>::new(dim_v);
    #[unroll]
    for d in 0..dim_v {
        sums[d] = 0.0f32;
    }
    let first = chunk * comptime!(tile * tiles);
    for t in 0..tiles {
        let start = first + t * tile;
        if start < keys_len {
            load_tile::<F>(keys, &mut shared_keys, bh, start, tile, dim);
            load_tile::<F>(values, &mut shared_values, bh, start, tile, dim_v);
            sync_cube();
            if active {
                let end = min(min(start + tile, keys_len), valid);
                let mut key = start;
                while key < end {
                    let score = tile_score(&query, &shared_keys, key - start, dim);
                    let mut outside = true;
                    if topk > 0 {
                        outside = score < kth || (score == kth && key as u32 > kth_key);
                    }
                    if outside {
                        let weight = (score - maximum).exp();
                        let base = (key - start) * dim_v;
                        #[unroll]
                        for d in 0..dim_v {
                            sums[d] += weight * shared_values[base + d];
                        }
                    }
                    key += 1;
                }
            }
            sync_cube();
        }
    }
    if active {
        let out = (flat * chunks + chunk) * dim_v;
        #[unroll]
        for d in 0..dim_v {
            partial[out + d] = sums[d];
        }
    }
}

/// Pass 4. One unit per output element: `output[row, d] = Σ_chunks partial / Z`.
///
/// - `partial`: `[rows, chunks · D]`, `stats`: `[rows, 3]`, `output`: `[rows, D]`
#[cube(launch)]
fn centroid_finish_kernel<F: Float>(
    partial: &Tensor<f32>,
    stats: &Tensor<f32>,
    output: &mut Tensor<F>,
    #[define(F)] _dtype: StorageType,
) {
    let id = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if id >= output.len() {
        terminate!();
    }
    let dim_v = output.shape(1);
    let (row, d) = (id / dim_v, id % dim_v);
    let chunks = partial.shape(1) / dim_v;
    let mut sum = 0.0f32;
    for c in 0..chunks {
        sum += partial[(row * chunks + c) * dim_v + d];
    }
    output[id] = F::cast_from(sum / stats[row * 3 + 1]);
}

/// Most features `E` or `D` the kernels keep in registers per row.
const MAX_DIM: usize = 128;

/// Most `topk` the kernels keep sorted in registers per row.
pub(super) const MAX_TOPK: usize = 64;

/// `f32`s of shared memory a cube may use: 16 KiB, WebGPU's guaranteed minimum.
const SHARED_FLOATS: usize = 4096;

/// Cubes to aim for, so that every multiprocessor of a large GPU has several.
const TARGET_CUBES: usize = 1024;

/// Keys per shared-memory tile when each key takes `floats` floats, at most 128.
fn tile_keys(floats: usize) -> usize {
    (SHARED_FLOATS / floats.max(1)).clamp(1, 128)
}

/// Tiles per chunk: as few as leave at least [`TARGET_CUBES`] cubes, at most 64.
fn tiles_per_chunk(keys_len: usize, tile: usize, other_cubes: usize) -> usize {
    let tiles = keys_len.div_ceil(tile);
    let chunks_wanted = TARGET_CUBES.div_ceil(other_cubes.max(1)).max(1);
    tiles.div_ceil(chunks_wanted).clamp(1, 64)
}

/// Whether the kernels take these sizes: `E, D ≤ 128` and `topk ≤ 64`; otherwise the caller
/// uses the default body.
pub(super) fn supported(dim: usize, dim_v: usize, topk: usize) -> bool {
    dim > 0 && dim_v > 0 && dim <= MAX_DIM && dim_v <= MAX_DIM && topk <= MAX_TOPK
}

/// Centroid attention by the four kernels: see the module docs, and
/// [`ClusteredAttentionBackend::centroid_attention`](crate::ClusteredAttentionBackend::centroid_attention)
/// for the contract. Call only when [`supported`].
pub(super) fn centroid_attention<R, F, I, BT>(
    centroids: CubeTensor<R>,
    keys: CubeTensor<R>,
    values: CubeTensor<R>,
    key_lengths: Option<CubeTensor<R>>,
    topk: usize,
) -> CentroidAttention<CubeBackend<R, F, I, BT>>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [batch, heads, clusters, dim] = centroids.shape().dims();
    let [_, _, keys_len, dim_v] = values.shape().dims();
    check_centroid_attention(
        [batch, heads, clusters, dim],
        keys.shape().dims(),
        [batch, heads, keys_len, dim_v],
        topk,
    );
    debug_assert!(supported(dim, dim_v, topk));
    let (client, device) = (centroids.client.clone(), centroids.device.clone());
    let float_dtype = centroids.dtype;
    let int_dtype = I::dtype();
    let dtypes = [float_dtype.into(), int_dtype.into()];
    let key_lengths = match key_lengths {
        Some(lengths) => into_contiguous(lengths),
        None => into_contiguous(
            BurnTensor::<CubeBackend<R, F, I, BT>, 1, IntKind>::from_data(
                TensorData::new(vec![keys_len as i64; batch], [batch]),
                (&device, int_dtype),
            )
            .into_primitive(),
        ),
    };
    let (centroids, keys, values) = (
        into_contiguous(centroids),
        into_contiguous(keys),
        into_contiguous(values),
    );
    let rows = batch * heads * clusters;
    let empty = |shape: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::from(shape), dtype)
    };
    // One unit per cluster row, 32 or 64 rows per cube.
    let units = if clusters <= 32 { 32 } else { 64 };
    let row_blocks = clusters.div_ceil(units);
    let slots = topk.max(1);

    let scan_tile = tile_keys(dim);
    let scan_tiles = tiles_per_chunk(keys_len, scan_tile, row_blocks * batch * heads);
    let scan_chunks = keys_len.div_ceil(scan_tile * scan_tiles);
    let maxima = empty(vec![rows, scan_chunks], DType::F32);
    let sums = empty(vec![rows, scan_chunks], DType::F32);
    let top_scores = empty(vec![rows, scan_chunks * slots], DType::F32);
    let top_keys = empty(vec![rows, scan_chunks * slots], DType::U32);
    centroid_scan_kernel::launch::<R>(
        &client,
        CubeCount::Static(
            scan_chunks as u32,
            row_blocks as u32,
            (batch * heads) as u32,
        ),
        CubeDim::new_1d(units as u32),
        linear(centroids.clone()),
        linear(keys.clone()),
        linear(key_lengths.clone()),
        linear(maxima.clone()),
        linear(sums.clone()),
        linear(top_scores.clone()),
        linear(top_keys.clone()),
        dim,
        topk,
        scan_tile,
        scan_tiles,
        dtypes,
    );

    let stats = empty(vec![rows, 3], DType::F32);
    let kth_keys = empty(vec![rows], DType::U32);
    let top_indices = empty(vec![rows, slots], int_dtype);
    let top_weights = empty(vec![rows, slots], float_dtype);
    let merge_units = 64;
    centroid_merge_kernel::launch::<R>(
        &client,
        super::cube_count(rows.div_ceil(merge_units), 1),
        CubeDim::new_1d(merge_units as u32),
        linear(maxima),
        linear(sums),
        linear(top_scores),
        linear(top_keys),
        linear(stats.clone()),
        linear(kth_keys.clone()),
        linear(top_indices.clone()),
        linear(top_weights.clone()),
        topk,
        dtypes,
    );

    let rest_tile = tile_keys(dim + dim_v);
    let rest_tiles = tiles_per_chunk(keys_len, rest_tile, row_blocks * batch * heads);
    let rest_chunks = keys_len.div_ceil(rest_tile * rest_tiles);
    let partial = empty(vec![rows, rest_chunks * dim_v], DType::F32);
    centroid_rest_kernel::launch::<R>(
        &client,
        CubeCount::Static(
            rest_chunks as u32,
            row_blocks as u32,
            (batch * heads) as u32,
        ),
        CubeDim::new_1d(units as u32),
        linear(centroids),
        linear(keys),
        linear(values),
        linear(key_lengths),
        linear(stats.clone()),
        linear(kth_keys),
        linear(partial.clone()),
        dim,
        dim_v,
        topk,
        rest_tile,
        rest_tiles,
        dtypes,
    );

    let output = empty(vec![rows, dim_v], float_dtype);
    let finish_units = 256;
    centroid_finish_kernel::launch::<R>(
        &client,
        super::cube_count((rows * dim_v).div_ceil(finish_units), 1),
        CubeDim::new_1d(finish_units as u32),
        linear(partial),
        linear(stats),
        linear(output.clone()),
        float_dtype.into(),
    );

    let shape = |last: usize| Shape::new([batch, heads, clusters, last]);
    CentroidAttention {
        values: reshape(output, shape(dim_v)),
        top: (topk > 0).then(|| {
            (
                reshape(top_indices, shape(topk)),
                reshape(top_weights, shape(topk)),
            )
        }),
        log_sum_exp: None,
    }
}
