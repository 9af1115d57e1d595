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
//! They serve every op that a backend has no kernel for, the CPU and CubeCL backends where
//! their own ops do not apply (e.g. `f64`), and they are the specification that kernels must
//! reproduce bit for bit. All arithmetic on bits and counts is done on small integers held
//! exactly by the backend's float type (Hamming distances ≤ 32, counts ≤ L < 2²⁴ for `f32`).
//!
//! Each body turns the backend's primitives into [`Tensor`]s ([`TensorConversion`]), runs on
//! them, calling the ops of the trait it builds on through the tensor-level functions of
//! [`crate::ops`] (which run the backend's own ops again, since the tensors live on its
//! device), and turns its outputs back into primitives. Int tensors are taken in the int type
//! of their device's settings, the type of the ones the bodies create.
//!
//! [`ClusteredAttentionBackend`]: super::ClusteredAttentionBackend
//! [`TensorConversion`]: super::TensorConversion

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

use burn::backend::tensor::FloatTensor;
use burn::tensor::{Bool, Int, Tensor, TensorData};

use super::ClusteredAttentionBackend;
use crate::dropout::AttentionDropout;

/// `x` in the int type of its device's settings (`i32` on Flex and `Cube`, `i64` on NdArray,
/// unless the device is configured otherwise): the type of the int tensors the default bodies
/// create (`arange`, `from_data`, `bool::int`), so that they and the inputs combine whatever
/// int type a backend's own ops gave the inputs.
pub(super) fn device_ints<const D: usize>(x: Tensor<D, Int>) -> Tensor<D, Int> {
    let dtype = x.device().settings().int_dtype;
    x.cast(dtype)
}

/// Whether each key index of `keys` (`[batch, …]`) is padding, at or past its sequence's
/// `key_lengths[b]`.
///
/// # Panics
/// If `key_lengths` is not `[batch]`.
pub(super) fn padded_keys(lengths: Tensor<1, Int>, keys: Tensor<4, Int>) -> Tensor<4, Bool> {
    let shape = keys.dims();
    let batch = shape[0];
    assert!(
        lengths.dims() == [batch],
        "key_lengths must have shape [batch] = [{batch}], got {:?}",
        lengths.dims()
    );
    let lengths = lengths.cast(keys.dtype());
    keys.greater_equal(lengths.reshape([batch, 1, 1, 1]).expand(shape))
}

/// The factors of `dropout` on `stream` for weights shaped like `like`, `[batch, heads, rows,
/// keys]`, as a tensor like it, by the backend's
/// [`ClusteredAttentionBackend::attention_dropout_factors`]: rows are clusters and keys key
/// indices on [`AttentionDropout::CLUSTER_ROWS`], rows queries and keys ranks in the top-k on
/// [`AttentionDropout::QUERY_TOP`].
pub(super) fn dropout_factors<B: ClusteredAttentionBackend>(
    dropout: &AttentionDropout,
    stream: u32,
    like: &Tensor<4>,
) -> Tensor<4> {
    B::float_tensor::<4>(B::attention_dropout_factors(
        *dropout,
        stream,
        B::float_primitive(like.clone()),
    ))
}

/// Default body of [`ClusteredAttentionBackend::attention_dropout_factors`]:
/// [`AttentionDropout::factors`] on the host, uploaded to `like`'s device in its float type.
///
/// # Panics
/// If `like` is not 4-dimensional.
pub fn attention_dropout_factors<B: ClusteredAttentionBackend>(
    dropout: AttentionDropout,
    stream: u32,
    like: FloatTensor<B>,
) -> FloatTensor<B> {
    let like = B::float_tensor::<4>(like);
    let shape = like.dims();
    let factors = dropout.factors(stream, shape);
    let factors =
        Tensor::<4>::from_data(TensorData::new(factors, shape), &like.device()).cast(like.dtype());
    B::float_primitive(factors)
}

/// The rows and columns of the activation dropout's mask for `shape`: every dimension but the
/// last flattened, and the last.
///
/// # Panics
/// If `shape` is empty, or the rows or columns number `2³²` or more (Philox's counter words).
pub fn activation_dropout_rows(shape: &[usize]) -> (usize, usize) {
    let (&columns, rest) = shape
        .split_last()
        .expect("activation dropout: x needs at least one dimension");
    let rows = rest.iter().product::<usize>();
    assert!(
        rows <= u32::MAX as usize && columns <= u32::MAX as usize,
        "activation dropout: x of shape {shape:?} has {rows} rows of {columns}; \
         the mask counts each below 2^32"
    );
    (rows, columns)
}

/// Default body of [`ClusteredAttentionBackend::activation_dropout`]: `x` times
/// [`ClusteredAttentionBackend::attention_dropout_factors`] on the view `[1, 1, rows,
/// columns]`.
///
/// # Panics
/// As [`activation_dropout_rows`].
pub fn activation_dropout<B: ClusteredAttentionBackend>(
    x: FloatTensor<B>,
    dropout: AttentionDropout,
    stream: u32,
) -> FloatTensor<B> {
    use burn::backend::TensorMetadata;
    let shape = x.shape();
    let (rows, columns) = activation_dropout_rows(&shape);
    let view = B::float_reshape(x.clone(), burn::tensor::Shape::new([1, 1, rows, columns]));
    let factors = B::float_reshape(B::attention_dropout_factors(dropout, stream, view), shape);
    B::float_mul(x, factors)
}
