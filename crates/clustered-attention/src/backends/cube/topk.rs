//! Top-k selection on the device (paper §3.3: the `k` keys each cluster attends to most).
//!
//! The order is total and the same as the host implementation's: by score, descending, ties
//! to the lower index. Rows holding NaN give an unspecified set of in-range indices.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::IntTensorOps;
use burn::tensor::{DType, Shape, Slice};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::ops::reshape;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{cube_count, linear};
use crate::ops::checks::check_topk;

/// Marks an empty slot of the merge (no candidate left in that unit).
const EMPTY: u32 = u32::MAX;

/// Whether `(value, index)` ranks before `(other_value, other_index)`: higher score first,
/// the lower index among equal scores; an empty slot ranks after everything.
#[cube]
fn ranks_before<F: Float>(value: F, index: u32, other_value: F, other_index: u32) -> bool {
    let mut before = false;
    if index != EMPTY {
        if other_index == EMPTY {
            before = true;
        } else {
            before = value > other_value || (value == other_value && index < other_index);
        }
    }
    before
}

/// One cube of `units` units per row. Unit `u` scans the scores `u, u + units, …` of its row
/// and keeps its own `k` best, sorted, in registers; the sorted lists then go to shared memory
/// and are merged pairwise in `log2(units)` rounds, each keeping the best `k`.
///
/// - `scores`: `[rows, S]`, contiguous
/// - `indices`: `[rows, k]`, in `0..S`
/// - shared memory: `units · k` scores and indices
#[cube(launch, create_dummy_kernel)]
fn topk_kernel<F: Float, I: Int>(
    scores: &Tensor<F>,
    indices: &mut Tensor<I>,
    #[comptime] k: usize,
    #[comptime] units: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let len = scores.shape(1);
    let rows = indices.shape(0);
    let row = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    if row >= rows {
        terminate!();
    }
    let unit = UNIT_POS_X as usize;
    let base = row * len;

    // This unit's best k, sorted: values[0] is the best.
    let mut values = Array::<F>::new(k);
    let mut positions = Array::<u32>::new(k);
    let mut filled = 0usize;
    let mut s = unit;
    while s < len {
        let value = scores[base + s];
        // Scanning in increasing index, an equal score never displaces an earlier one.
        let mut admit = filled < k;
        if !admit {
            admit = value > values[k - 1];
        }
        if admit {
            let mut slot = filled;
            if filled == k {
                slot = k - 1;
            }
            loop {
                if slot == 0 {
                    break;
                }
                if value <= values[slot - 1] {
                    break;
                }
                values[slot] = values[slot - 1];
                positions[slot] = positions[slot - 1];
                slot -= 1;
            }
            values[slot] = value;
            positions[slot] = s as u32;
            if filled < k {
                filled += 1;
            }
        }
        s += units;
    }

    let mut shared_values = Shared::<[F]>::new_slice(comptime!(units * k));
    let mut shared_positions = Shared::<[u32]>::new_slice(comptime!(units * k));
    let own = unit * k;
    for j in 0..k {
        if j < filled {
            shared_values[own + j] = values[j];
            shared_positions[own + j] = positions[j];
        } else {
            shared_values[own + j] = F::new(0.0_f32);
            shared_positions[own + j] = EMPTY;
        }
    }
    sync_cube();

    // A runtime value (a comptime one would be folded at expansion).
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            let other = (unit + stride) * k;
            let mut i = 0usize;
            let mut j = 0usize;
            // i + j < k: neither list runs out.
            for out in 0..k {
                if ranks_before::<F>(
                    shared_values[own + i],
                    shared_positions[own + i],
                    shared_values[other + j],
                    shared_positions[other + j],
                ) {
                    values[out] = shared_values[own + i];
                    positions[out] = shared_positions[own + i];
                    i += 1;
                } else {
                    values[out] = shared_values[other + j];
                    positions[out] = shared_positions[other + j];
                    j += 1;
                }
            }
            for out in 0..k {
                shared_values[own + out] = values[out];
                shared_positions[own + out] = positions[out];
            }
        }
        sync_cube();
        stride /= 2;
    }

    let mut j = unit;
    while j < k {
        let position = shared_positions[j];
        // Only a row of NaN can run out of candidates; stay in range.
        let mut index = position as usize;
        if position == EMPTY {
            index = len - 1;
        }
        indices[row * k + j] = I::cast_from(index as u32);
        j += units;
    }
}

/// Most units per row of the top-k kernel.
const TOPK_UNITS: usize = 64;

/// Scores and indices the top-k kernel's merge may keep in shared memory (8 KiB).
const TOPK_SHARED: usize = 1024;

/// The most `k` the top-k kernel takes: each unit keeps its list of `k` scores and indices in
/// local memory (indexed at run time), 1 KiB at 128 in `f32`, CUDA's default stack a thread
/// (`scripts/cuda_offline.py`'s limit). Beyond, the caller uses the default body.
pub(super) const MAX_K: usize = 128;

/// The lists' length the kernel runs with for `k`: the next power of two, so that the kernel
/// is built for eight lengths only (1 to [`MAX_K`]), each of them checked for CUDA (at k = 48
/// the lists half in registers spilled 266 to 296 B in `f16` and `bf16`; at 64, in local
/// memory, they did not). The first `k` of the longer list are the top `k`.
pub(super) fn list_len(k: usize) -> usize {
    k.next_power_of_two()
}

/// Launches [`topk_kernel`]: `scores [batch, heads, C, S]` → indices `[batch, heads, C, k]`
/// of dtype `int_dtype`, descending by score, ties to the lower index. Takes `k` up to
/// [`MAX_K`].
pub(super) fn topk_indices(scores: CubeTensor, k: usize, int_dtype: DType) -> CubeTensor {
    let [batch, heads, rows, len] = scores.shape().dims();
    check_topk(k, len);
    assert!(
        k <= MAX_K,
        "the top-k kernel takes k up to {MAX_K}, got {k}"
    );
    let listed = list_len(k);
    let scores = into_contiguous(scores);
    let client = scores.client.clone();
    let all_rows = batch * heads * rows;
    // Written as `[all_rows, k]` and reshaped after, so that the tensor returned is the one the
    // kernel wrote, whatever `reshape` does.
    let indices = empty_device_contiguous_dtype(
        client.clone(),
        scores.device.clone(),
        Shape::new([all_rows, listed]),
        int_dtype,
    );
    // A power of two: one list per unit in shared memory, and no more units than scores.
    let units = (TOPK_SHARED / listed)
        .min(TOPK_UNITS)
        .min(len.next_power_of_two());
    let units = 1usize << units.max(1).ilog2();
    let float_dtype = scores.dtype;
    launch!(topk_kernel(
        &client,
        cube_count(all_rows, 1),
        CubeDim::new_1d(units as u32),
        linear(reshape(scores, Shape::new([all_rows, len]))),
        linear(indices.clone()),
        listed,
        units,
        [
            dtype_to_storage_type(float_dtype),
            dtype_to_storage_type(int_dtype),
        ],
    ));
    let indices = if listed > k {
        into_contiguous(CubeBackend::int_slice(
            indices,
            &[Slice::from(0..all_rows), Slice::from(0..k)],
        ))
    } else {
        indices
    };
    reshape(indices, Shape::new([batch, heads, rows, k]))
}
