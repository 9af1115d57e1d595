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
//!    top-k kernel orders them), their weights `exp(s − M) / Z` and the same keys sorted by
//!    index.
//! 3. `rest`: the same grid as `scan`, with keys and values in shared memory: each row sums
//!    `exp(s − M) · v` over the chunk's valid keys outside its top-k, in `f32`: the rest is
//!    summed without the top-k keys, not as a difference. On multiply-adds at wide rows a
//!    row's features are split over a group of units (see "Rows over several units" below). The row's top-k keys, sorted by
//!    index by `merge`, are walked in step with the chunk's keys (one comparison per key), so a
//!    key's place in or out of the top-k is read from the list, never from a recomputed score.
//! 4. `finish`: `values = Σ_chunks rest / Z`, cast to the float type.
//!
//! The backward pass (`centroid_attention_backward`) recomputes `Aᶜ` in the same way, tile by
//! tile, and writes no `[C, S]` tensor either: `scan` and `merge` again for each row's `M` and
//! `Z`; `prepare`, one unit per row, for `δ = rowsum(Aᶜ ⊙ dA)` from the forward's outputs and
//! the k-th best score, recomputed as `scan` computes it; `grad_rows`, the grid of `rest`, for
//! the centroids' gradient per chunk of keys, summed by `finish`; and `grad_keys`, a group of
//! units per key with the rows streamed through shared memory, for the keys' and values'
//! gradients. There
//! a key's recomputed score is compared with the row's k-th best score, and a key that ranks
//! before it or comes within a relative `1e-3` of it is looked up in the row's top-k list
//! (`top_slot`), so that a score rounded differently from `scan`'s cannot move a key in or out
//! of the top-k.
//!
//! Rows over several units: a unit that holds a whole row (`E` or `D` features), a second row
//! and a sum for each would need up to 512 floats of registers at `E = D = 128`, more than a
//! CUDA thread has (255), and spill to local memory. So `grad_rows`, `grad_keys` and `rest` on
//! multiply-adds give each row a group of `group` units ([`row_group`]), each holding features
//! `lane, lane + group, …` of the row and of its sums ([`load_row`]); per tile, each unit
//! writes its part of every score to shared memory, and after a barrier every unit of the group
//! sums the group's parts in the same order ([`group_sum`]), so that all see the same score.
//!
//! Scores, sums and products accumulate in `f32` whatever the float type; every tensor is
//! contiguous; `bh` is the flattened `(batch, head)` index. Padded keys (at or past
//! `key_lengths[b]`) take no weight; they stay candidates of the top-k with the lowest score,
//! as the default body's `-inf` makes them, so a row with fewer valid keys than `topk` gets
//! them last, lower indices first, at weight 0.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::{cast, into_contiguous};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::device_properties;
use super::dropout::{KernelDropout, RowDraws, kernel_dropout};
use super::mma::{Mma, MmaTiles, centroid_tile, mma_shape};
use super::{MAX_DIM, SHARED_FLOATS, linear};
use crate::dropout::AttentionDropout;
use crate::ops::CentroidAttention;
use crate::ops::checks::check_centroid_attention;

mod backward;
mod rows;
pub(super) use backward::centroid_attention_backward;
use rows::{group_sum, load_row, load_tile, row_group, split_tile, store_row, tile_add, tile_dot};

/// Marks an empty top-k slot (a chunk with fewer keys than `topk`).
const EMPTY: u32 = u32::MAX;

/// Whether `(score, key)` ranks after `(other, other_key)`: a lower score, or an equal score
/// at a higher key (the top-k order is by score, descending, ties to the lower key).
#[cube]
fn ranks_after(score: f32, key: u32, other: f32, other_key: u32) -> bool {
    score < other || (score == other && key > other_key)
}

/// Inserts `(score, key)` into the sorted list `best[..topk]` (best first, empty slots at
/// score `f32::MIN` and key [`EMPTY`], which rank after everything) when it ranks before the
/// last entry; the caller checks that it does. Every index is known at expansion (the loop is
/// unrolled), so the list stays in registers: an array indexed at run time sits in scratch
/// memory, which is slow on GPUs and very slow on CPU drivers such as lavapipe.
#[cube]
fn insert_sorted(
    best: &mut Array<f32>,
    best_keys: &mut Array<u32>,
    score: f32,
    key: u32,
    #[comptime] topk: usize,
) {
    // From the last slot down: slot `j` takes slot `j − 1`'s entry when the new one ranks
    // before that, or the new entry when it ranks before slot `j`'s only.
    #[unroll]
    for i in 0..comptime!(topk - 1) {
        let j = topk - 1 - i;
        if ranks_after(best[j - 1], best_keys[j - 1], score, key) {
            best[j] = best[j - 1];
            best_keys[j] = best_keys[j - 1];
        } else if ranks_after(best[j], best_keys[j], score, key) {
            best[j] = score;
            best_keys[j] = key;
        }
    }
    if ranks_after(best[0usize], best_keys[0usize], score, key) {
        best[0usize] = score;
        best_keys[0usize] = key;
    }
}

/// A sorted list of `topk` empty slots for [`insert_sorted`].
#[cube]
fn empty_list(best: &mut Array<f32>, best_keys: &mut Array<u32>, #[comptime] topk: usize) {
    #[unroll]
    for r in 0..topk {
        best[r] = f32::min_value();
        best_keys[r] = u32::new(EMPTY as i64);
    }
}

/// Pass 1. Grid: X over chunks of `tile · tiles` keys, Y over blocks of `CUBE_DIM_X` rows,
/// Z over `bh`.
///
/// With cooperative matrices (`mma`), the cube's `units` centroid rows and each tile of keys
/// go to shared memory in the float type and [`score_tile`] computes the tile's scores there;
/// otherwise each unit holds its centroid in registers and sums its scores from the keys in
/// `f32` ([`tile_dot`]).
///
/// - `centroids`: `[B, H, C, E]`, `keys`: `[B, H, S, E]`, `key_lengths`: `[B]`
/// - `maxima`, `sums`: `[B·H·C, chunks]`
/// - `top_scores`, `top_keys`: `[B·H·C, chunks · topk]` (unused with `topk = 0`)
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
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
    #[comptime] units: usize,
    #[comptime] mma: Mma,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let keys_len = keys.shape(2);
    let (chunk, chunks) = (CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let bh = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let row = CUBE_POS_Y as usize * units + unit;
    let active = row < clusters;
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let query = load_row::<F>(centroids, bh, row, active, 0usize, dim, 1usize);
    let mut tiles_in = MmaTiles::<F>::new(centroids, bh, units, tile, dim, mma);

    let mut shared =
        Shared::<[f32]>::new_slice(comptime!(if mma.is_some() { 1 } else { tile * dim }));
    let mut maximum = f32::min_value();
    let mut sum = 0.0f32;
    let slots = comptime!(if topk > 0 { topk } else { 1 });
    let mut best = Array::<f32>::new(slots);
    let mut best_keys = Array::<u32>::new(slots);
    if topk > 0 {
        empty_list(&mut best, &mut best_keys, topk);
    }
    let first = chunk * comptime!(tile * tiles);
    for t in 0..tiles {
        let start = first + t * tile;
        if start < keys_len {
            if comptime!(mma.is_some()) {
                tiles_in.scores(keys, bh, start);
            } else {
                load_tile::<F>(keys, &mut shared, bh, start, tile, dim);
            }
            sync_cube();
            if active {
                let end = min(start + tile, keys_len);
                for key in start..end {
                    let mut score = if comptime!(mma.is_some()) {
                        tiles_in.score(key - start, unit)
                    } else {
                        tile_dot(&query, &shared, key - start, 0usize, dim, 1usize)
                    };
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
                        let last = comptime!(topk - 1);
                        if ranks_after(best[last], best_keys[last], score, key as u32) {
                            insert_sorted(&mut best, &mut best_keys, score, key as u32, topk);
                        }
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
                top_scores[out * topk + r] = best[r];
                top_keys[out * topk + r] = best_keys[r];
            }
        }
    }
}

/// Pass 2. One cube per row: the row's maximum and softmax denominator over its chunks and,
/// with `topk > 0`, its top-k merged from the chunks' sorted lists and their weights. Unit `u`
/// takes chunks `u, u + units, …` into a sorted list of its own (a chunk's list stops at its
/// first entry that is not admitted, since the lists are sorted), and the units' lists are
/// then merged pairwise in shared memory in `log2(units)` rounds.
///
/// - `maxima`, `sums`: `[rows, chunks]`; `top_scores`, `top_keys`: `[rows, chunks · topk]`
/// - `stats`: `[rows, 2]`: maximum, denominator
/// - `top_indices`, `top_weights`: `[rows, topk]`, by score; `top_ascending`: `[rows, topk]`,
///   the same keys by index (all three unused with `topk = 0`)
/// - shared memory: `units · topk` scores and keys
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
fn centroid_merge_kernel<F: Float, I: Int>(
    maxima: &Tensor<f32>,
    sums: &Tensor<f32>,
    top_scores: &Tensor<f32>,
    top_keys: &Tensor<u32>,
    stats: &mut Tensor<f32>,
    top_indices: &mut Tensor<I>,
    top_weights: &mut Tensor<F>,
    top_ascending: &mut Tensor<u32>,
    #[comptime] topk: usize,
    #[comptime] units: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (rows, chunks) = (maxima.shape(0), maxima.shape(1));
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let base = row * chunks;
    let mut shared_max = Shared::<[f32]>::new_slice(1usize);
    if unit == 0usize {
        let mut maximum = f32::min_value();
        for c in 0..chunks {
            maximum = max(maximum, maxima[base + c]);
        }
        let mut denominator = 0.0f32;
        for c in 0..chunks {
            denominator += sums[base + c] * (maxima[base + c] - maximum).exp();
        }
        stats[row * 2] = maximum;
        stats[row * 2 + 1] = denominator;
        shared_max[0usize] = maximum;
    }
    if topk > 0 {
        let slots = comptime!(units * topk);
        let mut shared_scores = Shared::<[f32]>::new_slice(slots);
        let mut shared_keys = Shared::<[u32]>::new_slice(slots);
        let mut best = Array::<f32>::new(topk);
        let mut best_keys = Array::<u32>::new(topk);
        empty_list(&mut best, &mut best_keys, topk);
        let last = comptime!(topk - 1);
        let mut c = unit;
        while c < chunks {
            let list = (base + c) * topk;
            for r in 0..topk {
                let key = top_keys[list + r];
                let score = top_scores[list + r];
                if key == EMPTY || !ranks_after(best[last], best_keys[last], score, key) {
                    // Sorted: the rest of this list ranks lower still.
                    break;
                }
                insert_sorted(&mut best, &mut best_keys, score, key, topk);
            }
            c += units;
        }
        let own = unit * topk;
        #[unroll]
        for r in 0..topk {
            shared_scores[own + r] = best[r];
            shared_keys[own + r] = best_keys[r];
        }
        sync_cube();
        // A runtime value (a comptime one would be folded at expansion).
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if unit < stride {
                let other = (unit + stride) * topk;
                let mut i = 0usize;
                let mut j = 0usize;
                // i + j < topk: neither list runs out.
                #[unroll]
                for out in 0..topk {
                    let (a, a_key) = (shared_scores[own + i], shared_keys[own + i]);
                    let (b, b_key) = (shared_scores[other + j], shared_keys[other + j]);
                    // An empty slot ranks after everything.
                    let take_a =
                        a_key != EMPTY && (b_key == EMPTY || !ranks_after(a, a_key, b, b_key));
                    if take_a {
                        best[out] = a;
                        best_keys[out] = a_key;
                        i += 1;
                    } else {
                        best[out] = b;
                        best_keys[out] = b_key;
                        j += 1;
                    }
                }
                #[unroll]
                for out in 0..topk {
                    shared_scores[own + out] = best[out];
                    shared_keys[own + out] = best_keys[out];
                }
            }
            sync_cube();
            stride /= 2;
        }
        let maximum = shared_max[0usize];
        let denominator = stats[row * 2 + 1];
        let mut r = unit;
        while r < topk {
            let key = shared_keys[r];
            top_indices[row * topk + r] = I::cast_from(key);
            top_weights[row * topk + r] =
                F::cast_from((shared_scores[r] - maximum).exp() / denominator);
            // The keys are distinct (`topk ≤ S`, and padded keys are candidates too), so the
            // ranks are a permutation.
            let mut rank = 0usize;
            for j in 0..topk {
                if shared_keys[j] < key {
                    rank += 1;
                }
            }
            top_ascending[row * topk + rank] = key;
            r += units;
        }
    }
}

/// Pass 3. Grid as [`centroid_scan_kernel`] (its own chunks), `group` units per row.
/// `partial[row, chunk]` = `Σ exp(s − M) · values[key]` over the chunk's valid keys outside the
/// row's top-k: the units hold the next top-k key at or past the current one (from
/// `top_ascending`) and skip the key that equals it. With `dropout` on, each weight times its
/// factor on [`AttentionDropout::CLUSTER_ROWS`] (rows the clusters, keys the key indices), a
/// Philox block drawn per eight keys.
///
/// With `group = 1` each unit owns a row, scored as [`centroid_scan_kernel`] scores it (by the
/// same code, or the same cooperative-matrix tiles). With `group > 1` (multiply-adds only) the
/// `group` units of a row each hold every `group`-th feature of its centroid and of its sums, so
/// that a unit's registers hold `(E + D) / group` floats rather than `E + D`: each unit writes
/// its part of every score of the tile to shared memory, and after a barrier each sums its
/// group's parts ([`group_sum`]).
///
/// - `values`: `[B, H, S, D]`; `stats`, `top_ascending`: from [`centroid_merge_kernel`]
/// - `partial`: `[B·H·C, chunks · D]`
/// - cube: `units · group` units over `units` rows
#[allow(clippy::too_many_arguments)]
#[cube(launch, create_dummy_kernel)]
fn centroid_rest_kernel<F: Float, I: Int>(
    centroids: &Tensor<F>,
    keys: &Tensor<F>,
    values: &Tensor<F>,
    key_lengths: &Tensor<I>,
    stats: &Tensor<f32>,
    top_ascending: &Tensor<u32>,
    partial: &mut Tensor<f32>,
    dropout: KernelDropout,
    #[comptime] dim: usize,
    #[comptime] dim_v: usize,
    #[comptime] topk: usize,
    #[comptime] tile: usize,
    #[comptime] tiles: usize,
    #[comptime] units: usize,
    #[comptime] group: usize,
    #[comptime] mma: Mma,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let (heads, clusters) = (centroids.shape(1), centroids.shape(2));
    let keys_len = keys.shape(2);
    let (chunk, chunks) = (CUBE_POS_X as usize, CUBE_COUNT_X as usize);
    let bh = CUBE_POS_Z as usize;
    let unit = UNIT_POS_X as usize;
    let (local, lane) = (unit / group, unit % group);
    let row = CUBE_POS_Y as usize * units + local;
    let active = row < clusters;
    let valid = u32::cast_from(key_lengths[bh / heads]) as usize;
    let query = load_row::<F>(centroids, bh, row, active, lane, dim, group);
    let mut tiles_in = MmaTiles::<F>::new(centroids, bh, units, tile, dim, mma);
    let flat = bh * clusters + row;
    let first = chunk * comptime!(tile * tiles);
    let mut maximum = 0.0f32;
    // The next top-k key (by index) at or past the current key, and its slot in the sorted
    // list; `EMPTY` past the last (and with `topk = 0`), which no key index equals.
    let mut next = u32::new(EMPTY as i64);
    let mut slot = 0usize;
    if active {
        maximum = stats[flat * 2];
        let base = flat * topk;
        for r in 0..topk {
            if (top_ascending[base + r] as usize) < first {
                slot += 1;
            }
        }
        if slot < topk {
            next = top_ascending[base + slot];
        }
    }

    let mut shared_keys =
        Shared::<[f32]>::new_slice(comptime!(if mma.is_some() { 1 } else { tile * dim }));
    let mut shared_values = Shared::<[f32]>::new_slice(comptime!(tile * dim_v));
    let mut parts =
        Shared::<[f32]>::new_slice(comptime!(if group > 1 { tile * units * group } else { 1 }));
    let mut sums = Array::<f32>::new(comptime!(dim_v.div_ceil(group)));
    #[unroll]
    for d in 0..comptime!(dim_v.div_ceil(group)) {
        sums[d] = 0.0f32;
    }
    let mut draws = RowDraws::new();
    let stream = u32::new(AttentionDropout::CLUSTER_ROWS as i64);
    for t in 0..tiles {
        let start = first + t * tile;
        if start < keys_len {
            if comptime!(mma.is_some()) {
                tiles_in.scores(keys, bh, start);
            } else {
                load_tile::<F>(keys, &mut shared_keys, bh, start, tile, dim);
            }
            load_tile::<F>(values, &mut shared_values, bh, start, tile, dim_v);
            sync_cube();
            let end = min(min(start + tile, keys_len), valid);
            if comptime!(group > 1) {
                if active {
                    for key in start..end {
                        parts[(key - start) * comptime!(units * group) + unit] =
                            tile_dot(&query, &shared_keys, key - start, lane, dim, group);
                    }
                }
                sync_cube();
            }
            if active {
                let mut key = start;
                while key < end {
                    if key as u32 == next {
                        slot += 1;
                        next = u32::new(EMPTY as i64);
                        if slot < topk {
                            next = top_ascending[flat * topk + slot];
                        }
                    } else {
                        let score = if comptime!(group > 1) {
                            group_sum(
                                &parts,
                                key - start,
                                local * group,
                                comptime!(units * group),
                                group,
                            )
                        } else if comptime!(mma.is_some()) {
                            tiles_in.score(key - start, unit)
                        } else {
                            tile_dot(&query, &shared_keys, key - start, 0usize, dim, 1usize)
                        };
                        let factor = dropout
                            .row_factor(&mut draws, stream, bh as u32, row as u32, key as u32);
                        let weight = (score - maximum).exp() * factor;
                        tile_add(
                            &mut sums,
                            weight,
                            &shared_values,
                            key - start,
                            lane,
                            dim_v,
                            group,
                        );
                    }
                    key += 1;
                }
            }
            sync_cube();
        }
    }
    if active {
        store_row::<f32>(
            partial,
            &sums,
            (flat * chunks + chunk) * dim_v,
            lane,
            dim_v,
            group,
        );
    }
}

/// Pass 4. One unit per output element: `output[row, d] = Σ_chunks partial / Z`, or the sum
/// alone without `normalize` (the centroids' gradient, from [`centroid_grad_rows_kernel`]).
///
/// - `partial`: `[rows, chunks · D]`, `stats`: `[rows, 2]`, `output`: `[rows, D]`
#[cube(launch, create_dummy_kernel)]
fn centroid_finish_kernel<F: Float>(
    partial: &Tensor<f32>,
    stats: &Tensor<f32>,
    output: &mut Tensor<F>,
    #[comptime] normalize: bool,
    #[define(F)] _dtype: ElemType,
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
    if normalize {
        sum /= stats[row * 2 + 1];
    }
    output[id] = F::cast_from(sum);
}

/// The slot of `key` in row `flat`'s top-k list (`top_indices`, `[rows, topk]`), or [`EMPTY`]
/// when it is not in the list. The row's k-th best `(kth, kth_key)` decides without reading the
/// list when the score is far from the k-th: a key that ranks after it is not in the top-k.
/// Within a relative `1e-3` of it (plus `1e-3`), or ranking before it, the list is read: a
/// score recomputed here may round differently from `scan`'s (a multiply-add fused in one
/// kernel and not in another), and that must not move a key in or out of the top-k.
#[cube]
fn top_slot<I: Int>(
    top_indices: &Tensor<I>,
    flat: usize,
    score: f32,
    key: u32,
    kth: f32,
    kth_key: u32,
    #[comptime] topk: usize,
) -> u32 {
    let mut slot = u32::new(EMPTY as i64);
    let margin = 0.001f32 * (f32::abs(score) + f32::abs(kth)) + 0.001f32;
    if f32::abs(score - kth) <= margin || !ranks_after(score, key, kth, kth_key) {
        let base = flat * topk;
        for r in 0..topk {
            if u32::cast_from(top_indices[base + r]) == key {
                slot = r as u32;
            }
        }
    }
    slot
}

/// Most `topk` the kernels keep sorted in registers per row.
pub(super) const MAX_TOPK: usize = 64;

/// Most units per row of the merge.
const MERGE_UNITS: usize = 32;

/// Cubes to aim for, so that every multiprocessor of a large GPU has several.
const TARGET_CUBES: usize = 1024;

/// Keys per shared-memory tile when each key takes `floats` floats, at most 128.
fn tile_keys(floats: usize) -> usize {
    (SHARED_FLOATS / floats.max(1)).clamp(1, 128)
}

/// Keys per chunk of the scan, at least, per top-k slot.
const CHUNK_PER_TOPK: usize = 16;

/// Tiles per chunk: as few as leave at least [`TARGET_CUBES`] cubes, at most 64.
fn tiles_per_chunk(keys_len: usize, tile: usize, other_cubes: usize) -> usize {
    let tiles = keys_len.div_ceil(tile);
    let chunks_wanted = TARGET_CUBES.div_ceil(other_cubes.max(1)).max(1);
    tiles.div_ceil(chunks_wanted).clamp(1, 64)
}

/// Floats of registers a unit of the `scan` pass holds for its row: the centroid (`E`) and its
/// sorted top-k list (`topk` scores and `topk` keys). Past about 224, ptxas spills: at E = 128
/// and top-k 64 the kernel took 255 registers and spilled 204 to 244 B on sm_80 and sm_90
/// (`scripts/cuda-offline.sh`).
const SCAN_REGISTERS: usize = 224;

/// The most `topk` the kernels take with `dim` features a head: [`MAX_TOPK`], less where the
/// `scan` pass's row and list would pass [`SCAN_REGISTERS`] (48 at `E = 128`).
pub(super) fn max_topk(dim: usize) -> usize {
    MAX_TOPK.min(SCAN_REGISTERS.saturating_sub(dim) / 2)
}

/// Whether the kernels take these sizes: `E, D ≤ 128` and `topk ≤` [`max_topk`]`(E)` (64, 48
/// at `E = 128`); otherwise the caller uses the default body.
pub(super) fn supported(dim: usize, dim_v: usize, topk: usize) -> bool {
    dim > 0 && dim_v > 0 && dim <= MAX_DIM && dim_v <= MAX_DIM && topk <= max_topk(dim)
}

/// Cluster rows per cube of the kernels with one unit per row: 32 or 64.
fn row_units(clusters: usize) -> usize {
    if clusters <= 32 { 32 } else { 64 }
}

/// The tile shape and key tile of the `scan` (`extra` 0) or `rest` pass (`extra` the bytes of a
/// key's value row) over `units` rows of `centroids`: cooperative matrices where
/// [`mma_shape`] gives a shape for their float type and the tiles fit ([`centroid_tile`]);
/// otherwise multiply-adds over `fallback` keys a tile.
fn pass_tiles(
    centroids: &CubeTensor,
    units: usize,
    dim: usize,
    extra: usize,
    fallback: usize,
) -> (Mma, usize) {
    let mma = mma_shape(&device_properties(&centroids.client), centroids.dtype);
    if mma.is_some()
        && let Some(tile) = centroid_tile(mma, units, dim, extra)
    {
        return (mma, tile);
    }
    (Mma::NONE, fallback)
}

/// The results of [`scan_and_merge`].
struct Scan {
    /// `[B·H·C, 2]` in `f32`: each row's maximum score `M` and its softmax denominator `Z` (of
    /// `exp(s − M)` over the valid keys).
    stats: CubeTensor,
    /// `[B·H·C, max(topk, 1)]`, the top-k indices in the int type (unwritten with `topk = 0`).
    top_indices: CubeTensor,
    /// `[B·H·C, max(topk, 1)]`, the top-k weights in the float type (unwritten with `topk = 0`).
    top_weights: CubeTensor,
    /// `[B·H·C, max(topk, 1)]` in `u32`: the top-k indices sorted ascending (unwritten with
    /// `topk = 0`).
    top_ascending: CubeTensor,
}

/// Passes 1 and 2 (`scan`, `merge`) over contiguous inputs: each row's softmax statistics and,
/// with `topk > 0`, its top-k.
fn scan_and_merge(
    centroids: &CubeTensor,
    keys: &CubeTensor,
    key_lengths: &CubeTensor,
    topk: usize,
    int_dtype: DType,
) -> Scan {
    let [batch, heads, clusters, dim] = centroids.shape().dims();
    let keys_len = keys.shape()[2];
    let (client, device) = (centroids.client.clone(), centroids.device.clone());
    let float_dtype = centroids.dtype;
    let dtypes = [
        dtype_to_storage_type(float_dtype),
        dtype_to_storage_type(int_dtype),
    ];
    let rows = batch * heads * clusters;
    let empty = |shape: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::from(shape), dtype)
    };
    let units = row_units(clusters);
    let row_blocks = clusters.div_ceil(units);
    let slots = topk.max(1);

    let (scan_mma, scan_tile) = pass_tiles(centroids, units, dim, 0, tile_keys(dim));
    // Chunks of at least `CHUNK_PER_TOPK · topk` keys, so that a unit's top-k list fills early
    // in its chunk and admits few keys after, and the merge has few lists per row.
    let scan_tiles = tiles_per_chunk(keys_len, scan_tile, row_blocks * batch * heads)
        .max((CHUNK_PER_TOPK * topk).div_ceil(scan_tile))
        .min(keys_len.div_ceil(scan_tile));
    let scan_chunks = keys_len.div_ceil(scan_tile * scan_tiles);
    let maxima = empty(vec![rows, scan_chunks], DType::F32);
    let sums = empty(vec![rows, scan_chunks], DType::F32);
    let top_scores = empty(vec![rows, scan_chunks * slots], DType::F32);
    let top_keys = empty(vec![rows, scan_chunks * slots], DType::U32);
    launch!(centroid_scan_kernel(
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
        units,
        scan_mma,
        dtypes,
    ));

    let stats = empty(vec![rows, 2], DType::F32);
    let top_indices = empty(vec![rows, slots], int_dtype);
    let top_weights = empty(vec![rows, slots], float_dtype);
    let top_ascending = empty(vec![rows, slots], DType::U32);
    // A power of two, at most the chunks, and one list of `topk` per unit in 16 KiB.
    let merge_units = MERGE_UNITS
        .min(scan_chunks.next_power_of_two())
        .min(SHARED_FLOATS / 2 / slots);
    let merge_units = 1usize << merge_units.max(1).ilog2();
    launch!(centroid_merge_kernel(
        &client,
        super::cube_count(rows, 1),
        CubeDim::new_1d(merge_units as u32),
        linear(maxima),
        linear(sums),
        linear(top_scores),
        linear(top_keys),
        linear(stats.clone()),
        linear(top_indices.clone()),
        linear(top_weights.clone()),
        linear(top_ascending.clone()),
        topk,
        merge_units,
        dtypes,
    ));
    Scan {
        stats,
        top_indices,
        top_weights,
        top_ascending,
    }
}

/// Centroid attention by the four kernels: see the module docs, and
/// [`ClusteredAttentionBackend::centroid_attention`](crate::ClusteredAttentionBackend::centroid_attention)
/// for the contract (with `dropout`, the rest's weights are dropped in the `rest` pass; the
/// top-k weights are not). The top-k indices are of dtype `int_dtype` (`key_lengths`, when
/// given, is cast to it). Call only when [`supported`].
pub(super) fn centroid_attention(
    centroids: CubeTensor,
    keys: CubeTensor,
    values: CubeTensor,
    key_lengths: Option<CubeTensor>,
    topk: usize,
    int_dtype: DType,
    dropout: Option<AttentionDropout>,
) -> CentroidAttention<CubeBackend> {
    let ([batch, heads, clusters, dim], [_, _, keys_len, dim_v]) = check_centroid_attention(
        centroids.shape().dims(),
        keys.shape().dims(),
        values.shape().dims(),
        topk,
    );
    debug_assert!(supported(dim, dim_v, topk));
    let (client, device) = (centroids.client.clone(), centroids.device.clone());
    let float_dtype = centroids.dtype;
    let dtypes = [
        dtype_to_storage_type(float_dtype),
        dtype_to_storage_type(int_dtype),
    ];
    // The kernels read the lengths and write the top-k indices as one int type.
    let key_lengths = key_lengths.map(|lengths| cast(lengths, int_dtype));
    let key_lengths = super::key_lengths_or_all(key_lengths, batch, keys_len, &device, int_dtype);
    let (centroids, keys, values) = (
        into_contiguous(centroids),
        into_contiguous(keys),
        into_contiguous(values),
    );
    let rows = batch * heads * clusters;
    let empty = |shape: Vec<usize>, dtype: DType| {
        empty_device_contiguous_dtype(client.clone(), device.clone(), Shape::from(shape), dtype)
    };
    // 32 or 64 cluster rows per cube (`scan` and `merge`: one unit a row; `rest`: `rest_group`
    // units a row).
    let units = row_units(clusters);
    let row_blocks = clusters.div_ceil(units);
    let Scan {
        stats,
        top_indices,
        top_weights,
        top_ascending,
    } = scan_and_merge(&centroids, &keys, &key_lengths, topk, int_dtype);

    let (rest_mma, rest_tile) =
        pass_tiles(&centroids, units, dim, dim_v * 4, tile_keys(dim + dim_v));
    // Multiply-adds hold a centroid and its sums per row: split over units beyond 128 floats.
    let rest_group = if rest_mma.is_some() {
        1
    } else {
        row_group([dim, dim_v], 1, 128)
    };
    let rest_tile = if rest_group > 1 {
        split_tile(dim + dim_v, units * rest_group)
    } else {
        rest_tile
    };
    let rest_tiles = tiles_per_chunk(keys_len, rest_tile, row_blocks * batch * heads);
    let rest_chunks = keys_len.div_ceil(rest_tile * rest_tiles);
    let partial = empty(vec![rows, rest_chunks * dim_v], DType::F32);
    launch!(centroid_rest_kernel(
        &client,
        CubeCount::Static(
            rest_chunks as u32,
            row_blocks as u32,
            (batch * heads) as u32,
        ),
        CubeDim::new_1d((units * rest_group) as u32),
        linear(centroids),
        linear(keys),
        linear(values),
        linear(key_lengths),
        linear(stats.clone()),
        linear(top_ascending),
        linear(partial.clone()),
        kernel_dropout(dropout),
        dim,
        dim_v,
        topk,
        rest_tile,
        rest_tiles,
        units,
        rest_group,
        rest_mma,
        dtypes,
    ));

    let output = empty(vec![rows, dim_v], float_dtype);
    let finish_units = 256;
    launch!(centroid_finish_kernel(
        &client,
        super::cube_count((rows * dim_v).div_ceil(finish_units), 1),
        CubeDim::new_1d(finish_units as u32),
        linear(partial),
        linear(stats),
        linear(output.clone()),
        true,
        dtype_to_storage_type(float_dtype),
    ));

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
