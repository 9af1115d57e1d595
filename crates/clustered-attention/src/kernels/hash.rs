//! LSH hashing (paper §3.2.2): bit `b` of a query's code is set when its projection on plane
//! `b` exceeds the plane's threshold.

use cubecl::prelude::*;

/// One thread per query. A cube of `tile` threads first copies its `tile × dim` queries into
/// shared memory with coalesced reads (rows padded to `dim + 1` floats, so that the threads'
/// row-wise reads hit different banks), then each thread projects its own query on every
/// plane. Planes are read by all threads at once (broadcast).
///
/// - `queries`: `[rows, dim]`, contiguous
/// - `planes`: `[bits, dim + 1]`, contiguous, the last column the thresholds
/// - `codes`: `[rows]`, the 32-bit codes as `i32` bit patterns
#[cube(launch)]
pub(crate) fn lsh_hash_kernel<F: Float, I: Int>(
    queries: &Tensor<F>,
    planes: &Tensor<F>,
    codes: &mut Tensor<I>,
    #[comptime] dim: usize,
    #[comptime] tile: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let rows = codes.len();
    let bits = planes.shape(0);
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let first = cube * tile;
    let unit = UNIT_POS_X as usize;
    let stride = dim + 1;

    let mut shared = SharedMemory::<F>::new(tile * (dim + 1));
    let mut index = unit;
    while index < tile * dim {
        let row = first + index / dim;
        if row < rows {
            shared[(index / dim) * stride + index % dim] = queries[first * dim + index];
        }
        index += CUBE_DIM_X as usize;
    }
    sync_cube();

    let row = first + unit;
    if row < rows {
        let mut code = 0u32;
        for b in 0..bits {
            let plane = b * stride;
            // Accumulated in f32 whatever the dtype: in f16 or bf16 a query far from a plane
            // keeps its side, only queries within rounding of the plane may change it.
            let mut projection = 0.0f32;
            for e in 0..dim {
                projection +=
                    f32::cast_from(shared[unit * stride + e]) * f32::cast_from(planes[plane + e]);
            }
            if projection > f32::cast_from(planes[plane + dim]) {
                code |= 1u32 << u32::cast_from(b);
            }
        }
        codes[row] = I::cast_from(i32::reinterpret(code));
    }
}
