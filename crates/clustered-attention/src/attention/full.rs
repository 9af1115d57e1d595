use burn::tensor::{Int, Tensor};

use super::{AttentionOptions, check_input, dropout};
use crate::ClusteredAttentionBackend;
use crate::ops::attention_softmax;

/// Full softmax attention, `softmax(Q Kᵀ · scale) V` (paper eqs. 1–2): the exact baseline
/// that clustered attention approximates. Costs `O(L · S · (E + D))` time and `O(L · S)` memory.
///
/// # Shapes
/// - `queries`: `[batch, heads, L, E]`
/// - `keys`: `[batch, heads, S, E]`
/// - `values`: `[batch, heads, S, D]`
/// - `query_lengths`, `key_lengths`: `[batch]`; padded keys get no attention, padded query rows
///   of the output are zero
/// - output: `[batch, heads, L, D]`
///
/// # Panics
/// If the shapes disagree (batch, heads, E of queries and keys, S of keys and values), a length
/// tensor is not `[batch]`, a length exceeds its sequence, or a key length is 0.
///
/// # Example
/// ```
/// use burn::backend::NdArray;
/// use burn::tensor::{Distribution, Tensor};
/// use clustered_attention::{AttentionOptions, full_attention};
///
/// let device = Default::default();
/// let q = Tensor::<NdArray, 4>::random([1, 2, 5, 8], Distribution::Default, &device);
/// let k = Tensor::<NdArray, 4>::random([1, 2, 7, 8], Distribution::Default, &device);
/// let v = Tensor::<NdArray, 4>::random([1, 2, 7, 3], Distribution::Default, &device);
/// let out = full_attention(q, k, v, None, None, &AttentionOptions::new());
/// assert_eq!(out.dims(), [1, 2, 5, 3]);
/// ```
pub fn full_attention<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    options: &AttentionOptions,
) -> Tensor<B, 4> {
    let input = check_input(
        &queries,
        &keys,
        &values,
        query_lengths,
        key_lengths,
        options,
    );
    // Scaling the queries rather than the scores: L × E products instead of L × S.
    let scores = queries.mul_scalar(input.scale).matmul(keys.swap_dims(2, 3));
    let weights = attention_softmax(input.mask_keys(scores));
    let weights = dropout(weights, options.dropout);
    input.zero_padded_queries(weights.matmul(values))
}
