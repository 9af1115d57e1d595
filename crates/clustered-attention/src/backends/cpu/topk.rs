//! Host [`topk_indices`]: one pass per row with a small sorted buffer.

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};

use super::access::{HostAccess, dims, on_host, write_ints};
use super::parallel::for_each_row;
use super::simd;
use crate::ops::checks::check_topk;
use crate::ops::{ClusteredAttentionBackend, reference};

/// Host [`ClusteredAttentionBackend::topk_indices`](ClusteredAttentionBackend::topk_indices).
pub fn topk_indices<B: HostAccess + ClusteredAttentionBackend>(
    scores: FloatTensor<B>,
    k: usize,
) -> IntTensor<B> {
    if !on_host::<B>(&scores) {
        return reference::topk_indices::<B>(scores, k);
    }
    let device = scores.device();
    let [batch, heads, rows, len] = dims::<B, 4>(&scores);
    check_topk(k, len);
    let mut out = vec![0i64; batch * heads * rows * k];
    B::with_f32(&scores, |scores| {
        for_each_row(&mut out, batch * heads, rows * len, |row, chunk| {
            let mut best = Vec::with_capacity(k + 1);
            for (c, out_row) in chunk.chunks_mut(k).enumerate() {
                let start = (row * rows + c) * len;
                simd::topk_row(&scores[start..start + len], out_row, &mut best);
            }
        })
    });
    write_ints::<B, 4>(out, [batch, heads, rows, k], &device)
}
