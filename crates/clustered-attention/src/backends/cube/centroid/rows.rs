//! A row of features on the device: a unit's part of a row in registers (the whole row, or
//! every `group`-th feature when a row is split over a group of units), the tiles of rows in
//! shared memory, and the products between them. See the parent module's "Rows over several
//! units".

use cubecl::prelude::*;

use super::super::MAX_SHARED_BYTES;

/// The dot product of a unit's features of a row (`own`, from [`load_row`]) with the same
/// features of row `key` of the tile in `shared` (`dim` floats per row): with `group = 1` the
/// whole row's, summed in feature order. `scan`, `rest` (at `group = 1`) and `prepare` all sum a
/// score by it, so a key's score is the same bits in all three.
#[cube]
pub(super) fn tile_dot(
    own: &Array<f32>,
    shared: &Shared<[f32]>,
    key: usize,
    lane: usize,
    #[comptime] dim: usize,
    #[comptime] group: usize,
) -> f32 {
    let base = key * dim + lane;
    let mut sum = 0.0f32;
    #[unroll]
    for i in 0..comptime!(dim / group) {
        sum += own[i] * shared[base + i * group];
    }
    // The last, partial stripe, which only some lanes have.
    if comptime!(!dim.is_multiple_of(group)) {
        let i = comptime!(dim / group);
        if lane + i * group < dim {
            sum += own[i] * shared[base + i * group];
        }
    }
    sum
}

/// `sums += weight · row`, over a unit's features (`lane, lane + group, …` below `dim`) of row
/// `key` of the tile in `shared`.
#[cube]
pub(super) fn tile_add(
    sums: &mut Array<f32>,
    weight: f32,
    shared: &Shared<[f32]>,
    key: usize,
    lane: usize,
    #[comptime] dim: usize,
    #[comptime] group: usize,
) {
    let base = key * dim + lane;
    #[unroll]
    for i in 0..comptime!(dim / group) {
        sums[i] += weight * shared[base + i * group];
    }
    if comptime!(!dim.is_multiple_of(group)) {
        let i = comptime!(dim / group);
        if lane + i * group < dim {
            sums[i] += weight * shared[base + i * group];
        }
    }
}

/// The sum of the `group` partial products that the units `first, …, first + group − 1` wrote
/// for key `key` of the tile (`parts`: `[tile, cube]`, one column per unit of the cube), in the
/// same order in every unit of the group, so that all of them see the same score.
#[cube]
pub(super) fn group_sum(
    parts: &Shared<[f32]>,
    key: usize,
    first: usize,
    #[comptime] cube: usize,
    #[comptime] group: usize,
) -> f32 {
    let base = key * cube + first;
    let mut sum = 0.0f32;
    #[unroll]
    for l in 0..group {
        sum += parts[base + l];
    }
    sum
}

/// Loads a unit's features of row `row` of `bh` (of `source`, `[B, H, rows, dim]`) into
/// registers as `f32`: features `lane, lane + group, …` below `dim` (the whole row with
/// `group = 1`), zeros past them and for an inactive unit.
#[cube]
pub(super) fn load_row<F: Float>(
    source: &Tensor<F>,
    bh: usize,
    row: usize,
    active: bool,
    lane: usize,
    #[comptime] dim: usize,
    #[comptime] group: usize,
) -> Array<f32> {
    let rows = source.shape(2);
    let mut own = Array::<f32>::new(comptime!(dim.div_ceil(group)));
    let base = (bh * rows + row) * dim + lane;
    #[unroll]
    for i in 0..comptime!(dim.div_ceil(group)) {
        own[i] = 0.0f32;
        if active && lane + i * group < dim {
            own[i] = f32::cast_from(source[base + i * group]);
        }
    }
    own
}

/// Writes a unit's features of `sums` (as [`load_row`] holds them) to `output[base + e]`.
#[cube]
pub(super) fn store_row<T: CubePrimitive>(
    output: &mut Tensor<T>,
    sums: &Array<f32>,
    base: usize,
    lane: usize,
    #[comptime] dim: usize,
    #[comptime] group: usize,
) {
    #[unroll]
    for i in 0..comptime!(dim.div_ceil(group)) {
        if lane + i * group < dim {
            output[base + lane + i * group] = T::cast_from(sums[i]);
        }
    }
}

/// Copies keys `start..start + tile` of `bh` (rows of `dim` floats of `source`, `[B, H, S,
/// dim]`) into `shared` as `f32`, zeros past the last key; all units of the cube take part.
#[cube]
pub(super) fn load_tile<F: Float>(
    source: &Tensor<F>,
    shared: &mut Shared<[f32]>,
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

/// Units per row of the kernels that split a row's features over units (a power of two, at
/// most 8, which keeps rows of [`MAX_DIM`](super::super::MAX_DIM) features within the budget): the fewest for which a
/// unit's `copies` of its features of two rows of `dims` features (the rows, and sums of the
/// same widths) take at most `budget` floats of registers. Register use past about 200 floats
/// a unit spills to local memory on CUDA, as `scripts/cuda-offline.sh` reports.
pub(super) fn row_group(dims: [usize; 2], copies: usize, budget: usize) -> usize {
    let mut group = 1;
    while group < 8 && copies * (dims[0].div_ceil(group) + dims[1].div_ceil(group)) > budget {
        group *= 2;
    }
    group
}

/// Keys per tile of a kernel whose rows are split over units ([`row_group`]): each key takes
/// `floats` floats of shared memory plus one per part written for it (`parts`), in
/// [`MAX_SHARED_BYTES`]; at most 128.
pub(super) fn split_tile(floats: usize, parts: usize) -> usize {
    (MAX_SHARED_BYTES / 4 / (floats + parts)).clamp(1, 128)
}
