//! LSH hashing (paper §3.2.2): bit `b` of a query's code is set when its projection on plane
//! `b` exceeds the plane's threshold.

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use super::{cube_count, linear};
use crate::ops::checks::check_planes;

/// One thread per query. A cube of `tile` threads first copies its `tile × dim` queries into
/// shared memory with coalesced reads (rows padded to `dim + 1` floats, so that the threads'
/// row-wise reads hit different banks), then each thread projects its own query on every
/// plane. Planes are read by all threads at once (broadcast).
///
/// - `queries`: `[rows, dim]`, contiguous
/// - `planes`: `[bits, dim + 1]`, contiguous, the last column the thresholds
/// - `codes`: `[rows]`, the 32-bit codes as `i32` bit patterns
#[cube(launch, create_dummy_kernel)]
fn lsh_hash_kernel<F: Float, I: Int>(
    queries: &Tensor<F>,
    planes: &Tensor<F>,
    codes: &mut Tensor<I>,
    #[comptime] dim: usize,
    #[comptime] tile: usize,
    #[define(F, I)] _dtypes: [ElemType; 2],
) {
    let rows = codes.len();
    let bits = planes.shape(0);
    let cube = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize;
    let first = cube * tile;
    let unit = UNIT_POS_X as usize;
    let stride = dim + 1;

    let mut shared = Shared::<[F]>::new_slice(tile * (dim + 1));
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

/// Launches [`lsh_hash_kernel`]: `queries [batch, heads, L, E]`, `planes [bits, E + 1]` →
/// codes `[batch, heads, L]` of dtype `int_dtype`.
pub(super) fn lsh_hash(queries: CubeTensor, planes: CubeTensor, int_dtype: DType) -> CubeTensor {
    let [batch, heads, len, dim] = queries.shape().dims();
    let [bits, columns] = planes.shape().dims();
    check_planes([batch, heads, len, dim], [bits, columns]);
    assert_eq!(
        queries.dtype, planes.dtype,
        "queries and planes must share a dtype"
    );
    let (queries, planes) = (into_contiguous(queries), into_contiguous(planes));
    let client = queries.client.clone();
    let rows = batch * heads * len;
    let codes = empty_device_contiguous_dtype(
        client.clone(),
        queries.device.clone(),
        Shape::new([batch, heads, len]),
        int_dtype,
    );
    // Queries per cube: a power of two, at most 64, with the tile within 16 KiB of f32.
    let fit = (4096 / (dim + 1)).clamp(1, 64);
    let tile = 1usize << fit.ilog2();
    let float_dtype = queries.dtype;
    launch!(lsh_hash_kernel(
        &client,
        cube_count(rows.div_ceil(tile), 1),
        CubeDim::new_1d(tile as u32),
        linear(queries),
        linear(planes),
        linear(codes.clone()),
        dim,
        tile,
        [
            dtype_to_storage_type(float_dtype),
            dtype_to_storage_type(int_dtype),
        ],
    ));
    codes
}
