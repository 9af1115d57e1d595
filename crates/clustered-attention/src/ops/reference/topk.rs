//! Default body of [`ClusteredAttentionBackend::topk_indices`].

use burn::backend::tensor::{FloatTensor, IntTensor};

#[cfg(doc)]
use crate::ops::ClusteredAttentionBackend;
use crate::ops::TensorConversion;
use crate::ops::checks::check_topk;

/// Default body of [`ClusteredAttentionBackend::topk_indices`]:
/// a descending sort of each row, then its first `k` indices.
///
/// # Panics
/// If `k` is 0 or greater than `S`.
pub fn topk_indices<B: TensorConversion>(scores: FloatTensor<B>, k: usize) -> IntTensor<B> {
    let scores = B::float_tensor::<4>(scores);
    let [batch, heads, rows, len] = scores.dims();
    check_topk(k, len);
    let (_, order) = scores.sort_descending_with_indices(3);
    B::int_primitive(order.slice([0..batch, 0..heads, 0..rows, 0..k]))
}
