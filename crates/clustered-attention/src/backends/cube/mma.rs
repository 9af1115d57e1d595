//! Score tiles on cooperative matrices (CubeCL `cmma`: tensor cores on CUDA,
//! `VK_KHR_cooperative_matrix` on Vulkan), with the crate's `cmma` feature: the scores of the
//! centroid attention's `scan` and `rest` passes and of the top-k attention, in `f16` and
//! `bf16`, summed in `f32`.
//!
//! A kernel that takes them copies its rows (centroids or queries) and a tile of keys into
//! shared memory in the float type, zero-padded to whole tiles, and [`score_tile`] writes the
//! tile of scores to shared memory in `f32`; each unit then reads its own row's scores from
//! there instead of summing them itself. Everything after the scores (the softmax, the top-k,
//! the weighted sums of the values) is the multiply-add path's code.

use burn::tensor::DType;
use cubecl::ir::features::MmaConfig;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;

use super::{MAX_SHARED_BYTES, cmma_feature, device_properties};
use crate::ops::ScoreProducts;

/// The tile shape of a cooperative matrix product, `m × k` times `k × n` into `m × n`; all
/// zero for multiply-adds ([`Mma::NONE`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Mma {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

impl Mma {
    /// Multiply-adds: no cooperative matrices.
    pub(super) const NONE: Self = Self { m: 0, n: 0, k: 0 };

    /// Whether the scores go through cooperative matrices.
    pub(super) fn is_some(self) -> bool {
        self.m > 0
    }

    /// `depth` rounded up to a whole number of `k`.
    pub(super) fn pad_depth(self, depth: usize) -> usize {
        depth.div_ceil(self.k) * self.k
    }

    /// `cols` rounded up to a whole number of `n`.
    pub(super) fn pad_cols(self, cols: usize) -> usize {
        cols.div_ceil(self.n) * self.n
    }
}

/// Tile shapes tried, best first: CUDA's tensor cores take 16 × 16 × 16 in `f16` and `bf16`;
/// lavapipe's `VK_KHR_cooperative_matrix` 8 × 8 × 8 in `f16`.
const SHAPES: [(u32, u32, u32); 2] = [(16, 16, 16), (8, 8, 8)];

/// The cooperative-matrix tile shape for scores in `dtype` on a device of `properties` (see
/// `device_properties`): [`Mma::NONE`] without the `cmma` feature, for another type than `f16`
/// and `bf16`, on a device whose planes may not divide a cube of 32 units (the kernels' cubes
/// have 32 or 64, and a product takes whole planes), or when the device reports none of
/// [`SHAPES`] for that type into `f32`.
pub(super) fn mma_shape(properties: &DeviceProperties, dtype: DType) -> Mma {
    let plane = plane_size(properties);
    if !cmma_feature() || plane == 0 || 32 % plane != 0 {
        return Mma::NONE;
    }
    let input = match dtype {
        DType::F16 => ElemType::Float(FloatKind::F16),
        DType::BF16 => ElemType::Float(FloatKind::BF16),
        _ => return Mma::NONE,
    };
    let output = ElemType::Float(FloatKind::F32);
    let supported = &properties.features.matmul.cmma;
    SHAPES
        .into_iter()
        .find(|&(m, n, k)| {
            supported.contains(&MmaConfig {
                a_type: input,
                b_type: input,
                cd_type: output,
                m,
                n,
                k,
            })
        })
        .map_or(Mma::NONE, |(m, n, k)| Mma {
            m: m as usize,
            n: n as usize,
            k: k as usize,
        })
}

/// The device's plane size, where every plane has the same (0 where they may differ).
fn plane_size(properties: &DeviceProperties) -> usize {
    let hardware = &properties.hardware;
    if hardware.plane_size_min == hardware.plane_size_max {
        hardware.plane_size_max as usize
    } else {
        0
    }
}

/// What [`mma_shape`] says, as the crate's public [`ScoreProducts`].
pub(super) fn score_products(client: &Client, dtype: DType) -> ScoreProducts {
    let mma = mma_shape(&device_properties(client), dtype);
    if mma.is_some() {
        ScoreProducts::Cmma {
            m: mma.m,
            n: mma.n,
            k: mma.k,
        }
    } else {
        ScoreProducts::MultiplyAdd
    }
}

/// `scores[c · rows + r] = Σ_e lhs[r · depth + e] · rhs[c · depth + e]` for every `r < rows`
/// and `c < cols`: the product of `lhs` (`[rows, depth]`, row-major) and the transpose of
/// `rhs` (`[cols, depth]`, row-major), stored column by column so that the units reading one
/// row each touch consecutive words. `rows`, `cols` and `depth` are whole numbers of `m`, `n`
/// and `k`; the planes of the cube take the `m × n` tiles of the scores in turn, so every unit
/// of the cube must call it, from uniform control flow, with a `sync_cube` before (the inputs
/// written) and after (the scores read).
#[allow(clippy::too_many_arguments)]
#[cube]
pub(super) fn score_tile<F: Float>(
    lhs: &Shared<[F]>,
    rhs: &Shared<[F]>,
    scores: &mut Shared<[f32]>,
    #[comptime] rows: usize,
    #[comptime] cols: usize,
    #[comptime] depth: usize,
    #[comptime] m: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
) {
    let row_tiles = comptime!(rows / m);
    let tiles = comptime!(rows / m * (cols / n));
    let planes = (CUBE_DIM_X / PLANE_DIM) as usize;
    let mut tile = (UNIT_POS_X / PLANE_DIM) as usize;
    while tile < tiles {
        let (row_tile, col_tile) = (tile % row_tiles, tile / row_tiles);
        let sums = cmma::Matrix::<f32>::from_value(
            cmma::MatrixIdent::Accumulator,
            m,
            n,
            k,
            cmma::MatrixLayout::Undefined,
            0.0f32,
        );
        #[unroll]
        for step in 0..comptime!(depth / k) {
            let lhs_start = row_tile * comptime!(m * depth) + step * k;
            let rhs_start = col_tile * comptime!(n * depth) + step * k;
            let a = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::A,
                m,
                n,
                k,
                cmma::MatrixLayout::RowMajor,
                lhs.slice(lhs_start, comptime!(rows * depth)),
                depth as u32,
            );
            let b = cmma::Matrix::<F>::from_slice(
                cmma::MatrixIdent::B,
                m,
                n,
                k,
                cmma::MatrixLayout::ColMajor,
                rhs.slice(rhs_start, comptime!(cols * depth)),
                depth as u32,
            );
            cmma::execute::<F, F, f32, f32, cmma::Plane>(&a, &b, &sums, &sums);
        }
        let start = col_tile * comptime!(n * rows) + row_tile * m;
        cmma::store(
            scores.slice_mut(start, comptime!(rows * cols)),
            &sums,
            rows as u32,
            cmma::MatrixLayout::ColMajor,
        );
        tile += planes;
    }
}

/// Copies rows `start..start + count` of `bh` (rows of `dim` values of `source`, `[B, H, rows,
/// dim]`) into `shared` in the float type, `dim_pad` values a row, zeros past the last row and
/// past `dim`; all units of the cube take part.
#[cube]
pub(super) fn load_padded<F: Float>(
    source: &Tensor<F>,
    shared: &mut Shared<[F]>,
    bh: usize,
    start: usize,
    #[comptime] count: usize,
    #[comptime] dim: usize,
    #[comptime] dim_pad: usize,
) {
    let len = source.shape(2);
    let mut i = UNIT_POS_X as usize;
    while i < comptime!(count * dim_pad) {
        let (row, e) = (start + i / dim_pad, i % dim_pad);
        let mut x = F::new(0.0_f32);
        if row < len && e < dim {
            x = source[(bh * len + row) * dim + e];
        }
        shared[i] = x;
        i += CUBE_DIM_X as usize;
    }
}

/// The shared memory of the centroid attention's `scan` and `rest` passes on cooperative
/// matrices: the cube's `units` centroid rows and a tile of `tile` keys in the float type
/// (`dim_pad` values a row), and the tile's scores, `[tile, units]` in `f32`. With
/// [`Mma::NONE`] every buffer has one element and nothing is loaded.
#[derive(CubeType)]
pub(super) struct MmaTiles<F: Float> {
    rows: Shared<[F]>,
    keys: Shared<[F]>,
    scores: Shared<[f32]>,
    #[cube(comptime)]
    units: usize,
    #[cube(comptime)]
    tile: usize,
    #[cube(comptime)]
    dim: usize,
    #[cube(comptime)]
    dim_pad: usize,
    #[cube(comptime)]
    mma: Mma,
}

#[cube]
impl<F: Float> MmaTiles<F> {
    /// The buffers, with the cube's centroid rows (`centroids`, `[B, H, C, dim]`, rows
    /// `CUBE_POS_Y · units..` of `bh`) loaded; every unit of the cube calls it, and the first
    /// [`Self::scores`] synchronises before reading them.
    pub(super) fn new(
        centroids: &Tensor<F>,
        bh: usize,
        #[comptime] units: usize,
        #[comptime] tile: usize,
        #[comptime] dim: usize,
        #[comptime] mma: Mma,
    ) -> MmaTiles<F> {
        let on = comptime!(mma.is_some());
        let dim_pad = comptime!(if on { mma.pad_depth(dim) } else { 1 });
        let mut rows = Shared::<[F]>::new_aligned_slice(
            comptime!(if on { units * dim_pad } else { 1 }),
            32usize,
        );
        let keys = Shared::<[F]>::new_aligned_slice(
            comptime!(if on { tile * dim_pad } else { 1 }),
            32usize,
        );
        let scores = Shared::<[f32]>::new_aligned_slice(
            comptime!(if on { tile * units } else { 1 }),
            32usize,
        );
        if on {
            let first = CUBE_POS_Y as usize * units;
            load_padded::<F>(centroids, &mut rows, bh, first, units, dim, dim_pad);
        }
        MmaTiles::<F> {
            rows,
            keys,
            scores,
            units,
            tile,
            dim,
            dim_pad,
            mma,
        }
    }

    /// Loads keys `start..start + tile` of `bh` and computes their scores against the cube's
    /// rows. Every unit of the cube calls it, after a `sync_cube` that ends the reads of the
    /// previous tile's scores, and synchronises again before reading the new ones.
    pub(super) fn scores(&mut self, keys: &Tensor<F>, bh: usize, start: usize) {
        load_padded::<F>(
            keys,
            &mut self.keys,
            bh,
            start,
            self.tile,
            self.dim,
            self.dim_pad,
        );
        sync_cube();
        score_tile::<F>(
            &self.rows,
            &self.keys,
            &mut self.scores,
            self.units,
            self.tile,
            self.dim_pad,
            comptime!(self.mma.m),
            comptime!(self.mma.n),
            comptime!(self.mma.k),
        );
    }

    /// The score of the tile's key `key` for the cube's row `unit`.
    pub(super) fn score(&self, key: usize, unit: usize) -> f32 {
        self.scores[key * self.units + unit]
    }
}

/// The key tile of the centroid attention's `scan` (`extra` 0) or `rest` (`extra` the bytes of
/// a key's value row in `f32`) on cooperative matrices: the most of 64, 32 and 16 keys whose
/// shared memory ([`MmaTiles`] and `extra` per key) fits [`MAX_SHARED_BYTES`] with `units` rows of
/// `dim` features, none when 16 do not fit (the pass then takes multiply-adds).
pub(super) fn centroid_tile(mma: Mma, units: usize, dim: usize, extra: usize) -> Option<usize> {
    let dim_pad = mma.pad_depth(dim);
    let half = 2;
    [64, 32, 16].into_iter().find(|&tile| {
        tile % mma.n == 0
            && units * dim_pad * half + tile * (dim_pad * half + units * 4 + extra)
                <= MAX_SHARED_BYTES
    })
}
