//! Host [`attention_softmax`]: three passes per row with a vectorised `exp`.

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;

use super::access::{HostAccess, dims, on_host, write_float};
use super::parallel::for_each_row;
use super::simd;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;

/// Host
/// [`ClusteredAttentionBackend::attention_softmax`](ClusteredAttentionBackend::attention_softmax)
/// of a rank-4 `f32`, `f16` or `bf16` tensor, computed in `f32` on a copy: one pass for the
/// maximum, one for the exponentials and their sum, one for the scaling, per row, with a vectorised
/// `exp` (other ranks and dtypes use the backend's softmax).
pub fn attention_softmax<B: HostAccess>(x: FloatTensor<B>) -> FloatTensor<B> {
    let shape = x.shape();
    let last = shape.num_dims() - 1;
    if !on_host::<B>(&x) || shape.num_dims() != 4 || shape[last] == 0 {
        return B::softmax(x, last);
    }
    let (device, dtype) = (x.device(), x.dtype());
    let dims = dims::<B, 4>(&x);
    let width = dims[3];
    let rows = dims[0] * dims[1] * dims[2];
    let mut out = B::with_f32(&x, <[f32]>::to_vec);
    for_each_row(&mut out, rows, width, |_, row| {
        simd::softmax_rows(row, width)
    });
    write_float::<B, 4>(out, dims, &device, dtype)
}
