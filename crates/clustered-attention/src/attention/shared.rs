use burn::tensor::{Int, Tensor};

use super::lsh::{SELF_SCORE, check_self_attention, unit_keys, zero_padded_positions};
use super::{AttentionOptions, check_input, dropout};
use crate::ClusteredAttentionBackend;
use crate::ops::attention_softmax;

/// Full attention with shared queries and keys, the paper's **shared-full** (Table 1): the
/// attention that [`lsh_attention`](super::lsh_attention) approximates.
///
/// As in Reformer (Kitaev et al. 2020, §2), position `i` holds query `i` and key `i`, keys are
/// normalised to unit length here (pass the queries as keys for Reformer's `k_j = q_j / ‖q_j‖`),
/// and a query's own key scores −10⁴, so it gets weight only when every other key is padded.
/// It equals lsh-X with a single chunk covering the sequence. Costs `O(L² · (E + D))`.
///
/// # Shapes
/// - `queries`, `keys`: `[batch, heads, L, E]`; `values`: `[batch, heads, L, D]`
/// - `query_lengths`, `key_lengths`: `[batch]`; a position at or past either length is
///   padding: its key gets no attention, its output row is zero
/// - output: `[batch, heads, L, D]`
///
/// # Panics
/// If the shapes disagree (see [`full_attention`](super::full_attention)), `keys` is not as
/// long as `queries`, or a length tensor is not `[batch]` or out of range.
///
/// # Example
/// ```
/// use burn::backend::NdArray;
/// use burn::tensor::{Distribution, Tensor};
/// use clustered_attention::{AttentionOptions, shared_full_attention};
///
/// let device = Default::default();
/// let q = Tensor::<NdArray, 4>::random([1, 2, 20, 8], Distribution::Default, &device);
/// let v = Tensor::<NdArray, 4>::random([1, 2, 20, 3], Distribution::Default, &device);
/// let out = shared_full_attention(q.clone(), q, v, None, None, &AttentionOptions::new());
/// assert_eq!(out.dims(), [1, 2, 20, 3]);
/// ```
pub fn shared_full_attention<B: ClusteredAttentionBackend>(
    queries: Tensor<B, 4>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    options: &AttentionOptions,
) -> Tensor<B, 4> {
    check_self_attention("shared_full_attention", &queries, &keys);
    let input = check_input(
        &queries,
        &keys,
        &values,
        query_lengths,
        key_lengths,
        options,
    );
    let [batch, heads, len, _] = queries.dims();
    let positions = Tensor::<B, 1, Int>::arange(0..len as i64, &queries.device());
    let own = positions
        .clone()
        .reshape([1, 1, len, 1])
        .equal(positions.reshape([1, 1, 1, len]))
        .expand([batch, heads, len, len]);
    let scores = queries
        .matmul(unit_keys(keys).swap_dims(2, 3))
        .mul_scalar(input.scale);
    let scores = input.mask_keys(scores).mask_fill(own, SELF_SCORE);
    let weights = dropout(attention_softmax(scores), options.dropout);
    zero_padded_positions(&input, input.zero_padded_queries(weights.matmul(values)))
}
