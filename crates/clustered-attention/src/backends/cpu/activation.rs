//! Host [`activation_dropout`]: the Philox factors applied to a copy, a row at a time.

use burn::backend::TensorMetadata;
use burn::backend::tensor::FloatTensor;
use burn::tensor::TensorData;

use super::access::{HostAccess, on_host};
use super::parallel::for_each_row;
use super::simd;
use crate::dropout::AttentionDropout;
#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::reference;

/// Host
/// [`ClusteredAttentionBackend::activation_dropout`](ClusteredAttentionBackend::activation_dropout)
/// of an `f32`, `f16` or `bf16` tensor, computed in `f32` on a copy: each row times its
/// factors, sixteen Philox counters at a time where the CPU has the vector instructions
/// (other dtypes use the default body).
///
/// # Panics
/// As the default body ([`reference::activation_dropout_rows`]).
pub fn activation_dropout<B: HostAccess + crate::ops::ClusteredAttentionBackend>(
    x: FloatTensor<B>,
    dropout: AttentionDropout,
    stream: u32,
) -> FloatTensor<B> {
    let shape = x.shape();
    let (rows, columns) = reference::activation_dropout_rows(&shape);
    if !on_host::<B>(&x) {
        return reference::activation_dropout::<B>(x, dropout, stream);
    }
    let (device, dtype) = (x.device(), x.dtype());
    let mut out = B::with_f32(&x, <[f32]>::to_vec);
    drop(x);
    for_each_row(&mut out, rows, columns, |row, values| {
        simd::dropout_run(&dropout, [stream, 0, row as u32, 0], values)
    });
    B::float_from_data(TensorData::new(out, shape).convert_dtype(dtype), &device)
}
