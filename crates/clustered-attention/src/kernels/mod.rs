//! CubeCL kernels of the clustering ops, the top-k and the sparse products, for the CubeCL
//! backends (WGPU, Vulkan, CUDA).
//!
//! They reproduce the default bodies ([`crate::ops::reference`]) bit for bit where the result
//! is integer: the codes whenever the projections are computed exactly (the summation order
//! differs from a matrix product), the K-means always (integer arithmetic only), the top-k
//! given the same scores (same order, ties to the lower index); the sparse products up
//! to rounding (they accumulate in `f32`, in another order).

pub(crate) mod hash;
pub(crate) mod kmeans;
pub(crate) mod sparse;
pub(crate) mod topk;

use cubecl::prelude::CubeCount;

/// Most cubes a grid dimension may hold on every runtime (WebGPU's limit).
const MAX_CUBES_PER_DIM: u32 = 65_535;

/// A 2-D grid of at least `cubes` cubes along X (folded into Y beyond the per-dimension
/// limit), times `rows` along Z.
pub(crate) fn cube_count(cubes: usize, rows: usize) -> CubeCount {
    let cubes = cubes.max(1) as u32;
    let x = cubes.min(MAX_CUBES_PER_DIM);
    CubeCount::Static(x, cubes.div_ceil(x), rows.max(1) as u32)
}
