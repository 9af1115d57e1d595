//! Attention dropout inside the kernels: [`AttentionDropout`]'s mask drawn where the weights
//! are computed, Philox4x32-10 in CubeCL ([`philox`]), so that the kernels drop the same
//! weights as the host loops and the default bodies, bit for bit.
//!
//! A kernel that drops weights takes a [`KernelDropout`] launch argument (the Philox key, the
//! threshold and the kept weights' scale at run time, whether it is on at expansion: a kernel
//! without dropout draws nothing, its factors the constant 1). A unit that walks a row's keys in order
//! keeps the Philox block of the current eight keys in a [`RowDraws`] and draws a block once
//! per eight keys ([`KernelDropout::row_factor`]: the centroid attention's `rest` pass, the
//! top-k attention); a kernel that splits a row over several units, or whose units hold keys
//! and walk rows, draws a tile's factors into shared memory first, each block once per cube
//! ([`KernelDropout::block_factors`]: the centroid attention's backward). [`dropout_factors`]
//! writes the factors as a tensor, for the default bodies that multiply their weights by them
//! (the top-k attention's backward).

use burn::backend::TensorMetadata;
use burn::backend::cubecl::dtype_to_storage_type;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::prelude::*;

use crate::dropout::AttentionDropout;

/// The first multiplier of Philox4x32's rounds (Salmon et al., SC 2011; Random123).
const M0: u32 = 0xD251_1F53;
/// The second multiplier.
const M1: u32 = 0xCD9E_8D57;
/// The first word of the key's bump between rounds (the golden ratio).
const W0: u32 = 0x9E37_79B9;
/// The second word (√3 − 1).
const W1: u32 = 0xBB67_AE85;

/// [`crate::dropout::philox4x32_10`] in a kernel: the four words of the block `[c0, c1, c2,
/// c3]` under the key `[k0, k1]`.
#[cube]
pub(super) fn philox(c0: u32, c1: u32, c2: u32, c3: u32, k0: u32, k1: u32) -> (u32, u32, u32, u32) {
    let mut x0 = c0;
    let mut x1 = c1;
    let mut x2 = c2;
    let mut x3 = c3;
    let mut key0 = k0;
    let mut key1 = k1;
    let (m0, m1) = (u32::new(M0 as i64), u32::new(M1 as i64));
    let (w0, w1) = (u32::new(W0 as i64), u32::new(W1 as i64));
    // The key is bumped after each round (the last bump unused): before every round but the
    // first, as Random123 bumps it.
    #[unroll]
    for _ in 0..10u32 {
        let hi0 = x0.mul_hi(m0);
        let lo0 = x0 * m0;
        let hi1 = x2.mul_hi(m1);
        let lo1 = x2 * m1;
        x0 = hi1 ^ x1 ^ key0;
        x1 = lo1;
        x2 = hi0 ^ x3 ^ key1;
        x3 = lo0;
        key0 += w0;
        key1 += w1;
    }
    (x0, x1, x2, x3)
}

/// The Philox block of a row's eight keys `8 · block .. 8 · block + 8`, kept by a unit that
/// walks the row's keys in order ([`KernelDropout::row_factor`]). Declare it `let mut`.
#[derive(CubeType)]
pub(super) struct RowDraws {
    /// The block held (`u32::MAX` before the first).
    block: u32,
    w0: u32,
    w1: u32,
    w2: u32,
    w3: u32,
}

#[cube]
impl RowDraws {
    /// No block held yet.
    pub(super) fn new() -> RowDraws {
        RowDraws {
            block: u32::new(u32::MAX as i64),
            w0: 0u32,
            w1: 0u32,
            w2: 0u32,
            w3: 0u32,
        }
    }
}

/// [`AttentionDropout`] as a kernel's launch argument (see the [module](self)): off, every
/// factor is 1 and nothing is drawn.
#[derive(CubeType, CubeLaunch, Clone, Copy)]
pub(super) struct KernelDropout {
    /// The Philox key's low word.
    key0: u32,
    /// Its high word.
    key1: u32,
    /// [`AttentionDropout::threshold`].
    threshold: u32,
    /// [`AttentionDropout::scale`].
    scale: f32,
    /// Whether the kernel drops weights (known at expansion).
    #[cube(comptime)]
    pub(super) on: bool,
}

/// The launch argument of `dropout` (off for `None`).
pub(super) fn kernel_dropout(dropout: Option<AttentionDropout>) -> KernelDropoutLaunch {
    match dropout {
        Some(dropout) => {
            let [key0, key1] = dropout.key();
            KernelDropoutLaunch::new(key0, key1, dropout.threshold(), dropout.scale(), true)
        }
        None => KernelDropoutLaunch::new(0, 0, 0, 1.0, false),
    }
}

#[cube]
impl KernelDropout {
    /// The factor of the draw in half `key & 1` of word `(key >> 1) & 3` of a block:
    /// 0 below the threshold, else the scale ([`AttentionDropout::draw`]).
    fn pick(&self, w0: u32, w1: u32, w2: u32, w3: u32, key: u32) -> f32 {
        let word = (key >> 1) & 3;
        let mut bits = w0;
        if word == 1 {
            bits = w1;
        } else if word == 2 {
            bits = w2;
        } else if word == 3 {
            bits = w3;
        }
        let draw = (bits >> ((key & 1) * 16)) & 0xFFFF;
        let mut factor = self.scale;
        if draw < self.threshold {
            factor = 0.0f32;
        }
        factor
    }

    /// The factor of the weight at `(stream, bh, row, key)`, drawing the block of `key` into
    /// `draws` when it holds another: a unit that walks a row's keys in order draws once per
    /// eight keys. 1 when off.
    pub(super) fn row_factor(
        &self,
        draws: &mut RowDraws,
        stream: u32,
        bh: u32,
        row: u32,
        key: u32,
    ) -> f32 {
        let mut factor = 1.0f32;
        if comptime!(self.on) {
            let block = key >> 3;
            if block != draws.block {
                let (w0, w1, w2, w3) = philox(block, row, bh, stream, self.key0, self.key1);
                draws.w0 = w0;
                draws.w1 = w1;
                draws.w2 = w2;
                draws.w3 = w3;
                draws.block = block;
            }
            factor = self.pick(draws.w0, draws.w1, draws.w2, draws.w3, key);
        }
        factor
    }

    /// Writes the factors of `(stream, bh, row, 8 · block + j)` for `j < 8` (one Philox block)
    /// to `factors[at + j · stride]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn block_factors(
        &self,
        factors: &mut Shared<[f32]>,
        stream: u32,
        bh: u32,
        row: u32,
        block: u32,
        at: usize,
        #[comptime] stride: usize,
    ) {
        let (w0, w1, w2, w3) = philox(block, row, bh, stream, self.key0, self.key1);
        #[unroll]
        for j in 0..8usize {
            factors[at + j * stride] = self.pick(w0, w1, w2, w3, j as u32);
        }
    }
}

/// The factors of `dropout` on `stream` of every weight of `factors` (`[batch, heads, rows,
/// keys]`, contiguous), as [`AttentionDropout::factors`] gives them: one unit per Philox block
/// (eight keys of a row), in the grid's X (and Y) over the blocks of every row.
#[cube(launch, create_dummy_kernel)]
fn dropout_factors_kernel<F: Float>(
    factors: &mut Tensor<F>,
    dropout: KernelDropout,
    stream: u32,
    #[define(F)] _dtype: ElemType,
) {
    let (rows, keys) = (factors.shape(2), factors.shape(3));
    let blocks = keys.div_ceil(8);
    let all_rows = factors.shape(0) * factors.shape(1) * rows;
    let id = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize
        + UNIT_POS_X as usize;
    if id >= all_rows * blocks {
        terminate!();
    }
    let (flat, block) = (id / blocks, id % blocks);
    let (bh, row) = (flat / rows, flat % rows);
    let (w0, w1, w2, w3) = philox(
        block as u32,
        row as u32,
        bh as u32,
        stream,
        dropout.key0,
        dropout.key1,
    );
    #[unroll]
    for j in 0..8usize {
        let key = block * 8 + j;
        if key < keys {
            factors[flat * keys + key] = F::cast_from(dropout.pick(w0, w1, w2, w3, j as u32));
        }
    }
}

/// Units per cube of [`dropout_factors_kernel`].
const FACTOR_UNITS: usize = 256;

/// [`AttentionDropout::factors`] on the device: the factors of `dropout` on `stream` for
/// weights shaped like `like` (`[batch, heads, rows, keys]`; its values are not read), in its
/// float type, by [`dropout_factors_kernel`].
pub(super) fn dropout_factors(
    like: CubeTensor,
    dropout: AttentionDropout,
    stream: u32,
) -> CubeTensor {
    let shape = like.shape();
    let [batch, heads, rows, keys] = shape.dims();
    let factors =
        empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype);
    let units = batch * heads * rows * keys.div_ceil(8);
    launch!(dropout_factors_kernel(
        &like.client,
        super::cube_count(units.div_ceil(FACTOR_UNITS), 1),
        CubeDim::new_1d(FACTOR_UNITS as u32),
        super::linear(factors.clone()),
        kernel_dropout(Some(dropout)),
        stream,
        dtype_to_storage_type(like.dtype),
    ));
    factors
}
