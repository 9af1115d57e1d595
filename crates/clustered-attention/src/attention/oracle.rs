use burn::tensor::Tensor;

use super::{
    AttentionInput, AttentionOptions, HostLengths, attention_options_builders, dropout, positions,
    top_keys,
};
use crate::ops::{attention_softmax, sparse_weighted_sum};

/// **oracle-top** (paper Table 1): full attention restricted, for every query, to its `topk`
/// highest-scoring keys, renormalised over them; the rest of the attention is dropped. An
/// analysis tool: it computes all `L × S` scores to choose the keys, `O(L · S · E)`.
///
/// Improved clustered attention (§3.3) keeps the centroid's attention on the other keys; this
/// shows what the top keys alone give. With `topk ≥ S` it equals
/// [`FullAttention`](super::FullAttention). Gradients flow through the kept scores; the
/// choice of keys carries none.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionInput, OracleTopAttention};
///
/// let device = Device::default();
/// let q = Tensor::<4>::random([1, 2, 40, 8], Distribution::Default, &device);
/// let k = Tensor::<4>::random([1, 2, 50, 8], Distribution::Default, &device);
/// let v = Tensor::<4>::random([1, 2, 50, 3], Distribution::Default, &device);
/// let out = OracleTopAttention::new(8).forward(AttentionInput::new(q, k, v));
/// assert_eq!(out.dims(), [1, 2, 40, 3]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct OracleTopAttention {
    /// Keys `k ≥ 1` kept per query (`min(k, S)` are used).
    pub topk: usize,
    /// The scale and the dropout.
    pub options: AttentionOptions,
}

impl OracleTopAttention {
    /// Oracle-top attention keeping each query's `topk` highest-scoring keys (`k ≥ 1`), with
    /// the scale `1 / sqrt(E)` and no dropout.
    pub fn new(topk: usize) -> Self {
        Self {
            topk,
            options: AttentionOptions::new(),
        }
    }

    attention_options_builders!();

    /// The oracle-top attention of `input`'s queries on its keys and values.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`,
    ///   `values`: `[batch, heads, S, D]`
    /// - `query_lengths`, `key_lengths`: `[batch]`; padded keys get no attention (a sequence with
    ///   fewer than `topk` valid keys uses all of them), padded query rows of the output are zero
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// If the shapes disagree (see [`FullAttention`](super::FullAttention)), a length tensor is
    /// not `[batch]` or out of range, or `topk` is 0.
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        self.forward_host(input, &HostLengths::default())
    }

    /// [`Self::forward`] given the host copies of the input's lengths where the caller has
    /// them ([`HostLengths`]), which are then not read back.
    pub(crate) fn forward_host(&self, input: AttentionInput, host: &HostLengths) -> Tensor<4> {
        let (topk, options) = (self.topk, &self.options);
        assert!(topk > 0, "topk must be at least 1, got 0");
        let (queries, keys, values, input) = input.checked(options, host);
        let [batch, heads, len, _] = queries.dims();
        let device = queries.device();
        let scores = input.mask_keys(queries.mul_scalar(input.scale).matmul(keys.swap_dims(2, 3)));
        let top = top_keys(scores.clone(), topk);
        // Every query is its own "cluster" of the sparse products.
        let rows = positions(batch, heads, len, &device);
        let weights = dropout(
            attention_softmax(scores.gather(3, top.clone())),
            options.dropout,
        );
        input.zero_padded_queries(sparse_weighted_sum(weights, values, top, rows))
    }
}
