//! Top-k selection on the device (paper §3.3: the `k` keys each cluster attends to most).
//!
//! The order is total and the same as the host implementation's: by score, descending, ties
//! to the lower index. Rows holding NaN give an unspecified set of in-range indices.

use cubecl::prelude::*;

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

/// One cube per row. Unit `u` scans the scores `u, u + cube_size, …` of its row and keeps its
/// own `k` best, sorted, in registers; then `k` rounds of a shared-memory tree reduction pick
/// the best remaining head among the units, whose owner (`index % cube_size`) pops it.
///
/// - `scores`: `[rows, S]`, contiguous
/// - `indices`: `[rows, k]`, in `0..S`
#[cube(launch)]
pub(crate) fn topk_kernel<F: Float, I: Int>(
    scores: &Tensor<F>,
    indices: &mut Tensor<I>,
    #[comptime] k: usize,
    #[comptime] cube_size: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
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
        s += cube_size;
    }

    let mut best_values = SharedMemory::<F>::new(cube_size);
    let mut best_indices = SharedMemory::<u32>::new(cube_size);
    let mut head = 0usize;
    for r in 0..k {
        if head < filled {
            best_values[unit] = values[head];
            best_indices[unit] = positions[head];
        } else {
            best_values[unit] = F::new(0.0);
            best_indices[unit] = EMPTY;
        }
        sync_cube();
        // A runtime value (a comptime one would be folded at expansion).
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if unit < stride {
                let other_value = best_values[unit + stride];
                let other_index = best_indices[unit + stride];
                if ranks_before::<F>(
                    other_value,
                    other_index,
                    best_values[unit],
                    best_indices[unit],
                ) {
                    best_values[unit] = other_value;
                    best_indices[unit] = other_index;
                }
            }
            sync_cube();
            stride /= 2;
        }
        let winner = best_indices[0];
        if unit == 0 {
            // Only a row of NaN can run out of candidates; stay in range.
            let mut index = winner as usize;
            if winner == EMPTY {
                index = len - 1;
            }
            indices[row * k + r] = I::cast_from(index as u32);
        }
        if winner != EMPTY && (winner as usize) % cube_size == unit {
            head += 1;
        }
        sync_cube();
    }
}
