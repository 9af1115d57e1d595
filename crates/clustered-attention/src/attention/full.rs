use burn::tensor::activation::quiet_softmax;
use burn::tensor::{Bool, Tensor};

use super::{AttentionInput, AttentionOptions, HostLengths, attention_options_builders, dropout};
use crate::ops::attention_softmax;

/// The score given to a masked key by [`FullAttention::forward_masked`]: burn-nn's default
/// `min_float` (`MultiHeadAttentionConfig`), with which its attention fills every masked score.
const MASKED_SCORE: f32 = -1.0e4;

/// Full softmax attention, `softmax(Q Kᵀ · scale) V` (paper eqs. 1–2): the exact baseline
/// that clustered attention approximates. Costs `O(L · S · (E + D))` time and `O(L · S)` memory.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionInput, FullAttention};
///
/// let device = Device::default();
/// let q = Tensor::<4>::random([1, 2, 5, 8], Distribution::Default, &device);
/// let k = Tensor::<4>::random([1, 2, 7, 8], Distribution::Default, &device);
/// let v = Tensor::<4>::random([1, 2, 7, 3], Distribution::Default, &device);
/// let out = FullAttention::new().forward(AttentionInput::new(q, k, v));
/// assert_eq!(out.dims(), [1, 2, 5, 3]);
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct FullAttention {
    /// The scale and the dropout.
    pub options: AttentionOptions,
    /// burn-nn's quiet softmax (`quiet_softmax` of `MultiHeadAttentionConfig`): the softmax of
    /// each row with one more logit fixed at 0, so a query may attend to nothing
    /// ([`burn::tensor::activation::quiet_softmax`]); default false.
    pub quiet_softmax: bool,
}

impl Default for FullAttention {
    fn default() -> Self {
        Self::new()
    }
}

impl FullAttention {
    /// Full attention with the default scale `1 / sqrt(E)` and no dropout.
    pub fn new() -> Self {
        Self {
            options: AttentionOptions::new(),
            quiet_softmax: false,
        }
    }

    attention_options_builders!();

    /// The softmax with one more zero logit ([`Self::quiet_softmax`]) instead of the softmax.
    pub fn with_quiet_softmax(mut self, quiet_softmax: bool) -> Self {
        self.quiet_softmax = quiet_softmax;
        self
    }

    /// The attention of `input`'s queries on its keys and values.
    ///
    /// # Shapes
    /// - `queries`: `[batch, heads, L, E]`
    /// - `keys`: `[batch, heads, S, E]`
    /// - `values`: `[batch, heads, S, D]`
    /// - `query_lengths`, `key_lengths`: `[batch]`; padded keys get no attention, padded
    ///   query rows of the output are zero
    /// - output: `[batch, heads, L, D]`
    ///
    /// # Panics
    /// If the shapes disagree (batch, heads, E of queries and keys, S of keys and values), a
    /// length tensor is not `[batch]`, a length exceeds its sequence, or
    /// the dropout is outside `[0, 1)`.
    pub fn forward(&self, input: AttentionInput) -> Tensor<4> {
        self.forward_masked(input, None)
    }

    /// [`Self::forward`] with an attention mask besides the lengths: `mask_attn`
    /// `[batch, L, S]`, `true` where a query may not attend to a key (burn-nn's `mask_attn`),
    /// the same for every head. As burn-nn's `MultiHeadAttention`, the masked scores (and,
    /// with a mask, the padded keys' scores) are filled with −10⁴ (burn-nn's
    /// default `min_float`) rather than `-inf`: a query row masked at every key then attends
    /// to every key alike (its output is the mean of the values, finite, with a finite
    /// gradient) and, with the quiet softmax, to none (zeros).
    ///
    /// # Panics
    /// As [`Self::forward`], and if `mask_attn` is not `[batch, L, S]`.
    pub fn forward_masked(
        &self,
        input: AttentionInput,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<4> {
        self.forward_masked_host(input, mask_attn, &HostLengths::default())
    }

    /// [`Self::forward_masked`] given the host copies of the input's lengths where the caller
    /// has them ([`HostLengths`]), which are then not read back.
    pub(crate) fn forward_masked_host(
        &self,
        input: AttentionInput,
        mask_attn: Option<Tensor<3, Bool>>,
        host: &HostLengths,
    ) -> Tensor<4> {
        let options = &self.options;
        let (queries, keys, values, input) = input.checked(options, host);
        // Scaling the queries rather than the scores: L × E products instead of L × S.
        let scores = queries.mul_scalar(input.scale).matmul(keys.swap_dims(2, 3));
        let scores = match mask_attn {
            Some(mask) => {
                let [batch, heads, len, keys_len] = scores.dims();
                assert!(
                    mask.dims() == [batch, len, keys_len],
                    "mask_attn {:?} must be [batch, L, S] = {:?}",
                    mask.dims(),
                    [batch, len, keys_len]
                );
                let mask = mask
                    .unsqueeze_dim::<4>(1)
                    .expand([batch, heads, len, keys_len]);
                let mask = match &input.key_padding {
                    Some(padding) => {
                        mask.bool_or(padding.clone().expand([batch, heads, len, keys_len]))
                    }
                    None => mask,
                };
                scores.mask_fill(mask, MASKED_SCORE)
            }
            None => input.mask_keys(scores),
        };
        let weights = if self.quiet_softmax {
            quiet_softmax(scores, 3)
        } else {
            attention_softmax(scores)
        };
        let weights = dropout(weights, options.dropout);
        input.zero_padded_queries(weights.matmul(values))
    }
}
