//! Default bodies of [`ClusteredAttentionBackend`], made of Burn tensor ops: one file per op
//! family.
//!
//! - `hash.rs`: [`lsh_hash`], a matrix product of the queries with the planes.
//! - `kmeans.rs`: [`hamming_kmeans`], Lloyd's algorithm on integer tensors.
//! - `topk.rs`: [`topk_indices`], a descending sort.
//! - `centroid.rs`: [`centroid_attention`] and its backward.
//! - `top.rs`: [`top_attention`] and its backward.
//! - `improved.rs`: [`improved_attention`], its forward with intermediate results and its
//!   backward, composed of the ops above.
//! - `sparse.rs`: [`sparse_dot`], [`sparse_weighted_sum`] and [`sparse_scatter`] by gathered
//!   rows.
//!
//! They serve every backend that has no kernel of its own (LibTorch, Candle, …), the CPU and
//! CubeCL backends where their own ops do not apply (e.g. `f64`), and they are the
//! specification that kernels must reproduce bit for bit. All arithmetic on bits and counts is
//! done on small integers held exactly by the backend's float type (Hamming distances ≤ 32,
//! counts ≤ L < 2²⁴ for `f32`).
//!
//! [`ClusteredAttentionBackend`]: super::ClusteredAttentionBackend

mod centroid;
mod hash;
mod improved;
mod kmeans;
mod sparse;
mod top;
mod topk;

pub use centroid::{centroid_attention, centroid_attention_backward};
pub use hash::lsh_hash;
pub use improved::{improved_attention, improved_attention_backward, improved_attention_forward};
pub use kmeans::hamming_kmeans;
pub use sparse::{sparse_dot, sparse_scatter, sparse_weighted_sum};
pub use top::{top_attention, top_attention_backward};
pub use topk::topk_indices;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Bool, Int, Tensor, TensorPrimitive};

/// `x` as a rank-4 float tensor.
pub(super) fn float4<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// The primitive of the rank-4 float tensor `x`.
pub(super) fn float_out<B: Backend>(x: Tensor<B, 4>) -> FloatTensor<B> {
    x.into_primitive().tensor()
}

/// Whether each key index of `keys` (`[batch, …]`) is padding, at or past its sequence's
/// `key_lengths[b]`.
///
/// # Panics
/// If `key_lengths` is not `[batch]`.
pub(super) fn padded_keys<B: Backend>(
    key_lengths: IntTensor<B>,
    keys: Tensor<B, 4, Int>,
) -> Tensor<B, 4, Bool> {
    let lengths = Tensor::<B, 1, Int>::from_primitive(key_lengths);
    let shape = keys.dims();
    let batch = shape[0];
    assert!(
        lengths.dims() == [batch],
        "key_lengths must have shape [batch] = [{batch}], got {:?}",
        lengths.dims()
    );
    keys.greater_equal(lengths.reshape([batch, 1, 1, 1]).expand(shape))
}
