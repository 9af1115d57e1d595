//! Default body of [`ClusteredAttentionBackend::topk_indices`].

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Tensor, TensorPrimitive};

#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::checks::check_topk;

/// Default body of [`ClusteredAttentionBackend::topk_indices`]:
/// a descending sort of each row, then its first `k` indices.
///
/// # Panics
/// If `k` is 0 or greater than `S`.
pub fn topk_indices<B: Backend>(scores: FloatTensor<B>, k: usize) -> IntTensor<B> {
    let scores = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(scores));
    let [batch, heads, rows, len] = scores.dims();
    check_topk(k, len);
    let (_, order) = scores.sort_descending_with_indices(3);
    order
        .slice([0..batch, 0..heads, 0..rows, 0..k])
        .into_primitive()
}
