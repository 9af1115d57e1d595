use burn::tensor::{Int, Tensor};

use super::lsh::{SELF_SCORE, check_self_attention, unit_keys, zero_padded_positions};
use super::{AttentionInput, AttentionOptions, HostLengths, attention_options_builders, dropout};
use crate::ops::attention_softmax;

/// Full attention with shared queries and keys, the paper's **shared-full** (Table 1): the
/// attention that [`LshAttention`](super::LshAttention) approximates.
///
/// As in Reformer (Kitaev et al. 2020, §2), position `i` holds query `i` and key `i`, keys are
/// normalised to unit length here (pass the queries as keys for Reformer's `k_j = q_j / ‖q_j‖`),
/// and a query's own key scores −10⁴, so it gets weight only when every other key is padded.
/// It equals lsh-X with a single chunk covering the sequence. Costs `O(L² · (E + D))`.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionInput, SharedFullAttention};
///
/// let device = Device::default();
/// let q = Tensor::<4>::random([1, 2, 20, 8], Distribution::Default, &device);
/// let v = Tensor::<4>::random([1, 2, 20, 3], Distribution::Default, &device);
/// let out = SharedFullAttention::new().forward(AttentionInput::new(q.clone(), q, v));
/// assert_eq!(out.dims(), [1, 2, 20, 3]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct SharedFullAttention {
    /// The scale and the dropout.
    pub options: AttentionOptions,
}

impl Default for SharedFullAttention {
    fn default() -> Self {
        Self::new()
    }
}

impl SharedFullAttention {
    /// Shared-full attention with the scale `1 / sqrt(E)` and no dropout.
    pub fn new() -> Self {
        Self {
            options: AttentionOptions::new(),
        }
    }

    attention_options_builders!();

    /// The shared-full attention of `input`'s queries on its keys and values.
    ///
    /// # Shapes
    /// - `queries`, `keys`: `[batch, heads, L, E]`; `values`: `[batch, heads, L, D]`
    /// - `query_lengths`, `key_lengths`: `[batch]`; a position at or past either length is
    ///   padding: its key gets no attention, its output row is zero
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// If the shapes disagree (see [`FullAttention`](super::FullAttention)), `keys` is not as
    /// long as `queries`, or a length tensor is not `[batch]` or out of range.
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        self.forward_host(input, &HostLengths::default())
    }

    /// [`Self::forward`] given the host copies of the input's lengths where the caller has
    /// them ([`HostLengths`]), which are then not read back.
    pub(crate) fn forward_host(&self, input: AttentionInput, host: &HostLengths) -> Tensor<4> {
        let options = &self.options;
        check_self_attention("SharedFullAttention", &input.queries, &input.keys);
        let (queries, keys, values, input) = input.checked(options, host);
        let [batch, heads, len, _] = queries.dims();
        let positions = Tensor::<1, Int>::arange(0..len as i64, &queries.device());
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
}
