//! A transformer encoder with burn-nn's fields, layout and record paths, whose self-attention
//! is the crate's multi-head layer: burn-nn's `TransformerEncoder` with clustered attention.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, PoisonError};

use burn::config::Config;
use burn::module::{Initializer, Module};
use burn::nn::activation::ActivationConfig;
use burn::nn::transformer::{PositionWiseFeedForward, PositionWiseFeedForwardConfig};
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig};
use burn::tensor::{Bool, Device, Int, Tensor};

use crate::clustering::{ClusterMemo, with_cluster_memo};
use crate::dropout::AttentionDropout;
use crate::kind::AttentionKind;
use crate::layer::{
    ClusteredAttentionInput, MultiHeadClusteredAttention, MultiHeadClusteredAttentionConfig,
    key_lengths_of,
};
use crate::ops::Clusters;
use crate::ops::checks::host_lengths;
use crate::recompute::{RecomputedForward, flatten_parameters, unflatten_parameters};

/// Configuration of a [`ClusteredTransformerEncoder`]: burn-nn 0.22's
/// [`TransformerEncoderConfig`](burn::nn::transformer::TransformerEncoderConfig) (the same
/// fields, defaults and meanings) with the attention and its clustering options.
///
/// Swapping burn-nn's encoder for this one: `TransformerEncoderConfig::new(256, 1024, 8, 4)`
/// becomes `ClusteredTransformerEncoderConfig::new(256, 1024, 8, 4, AttentionKind::Improved {
/// clusters: 100, topk: 32 })`, the model's field `TransformerEncoder` becomes
/// [`ClusteredTransformerEncoder`] and its input `TransformerEncoderInput` becomes
/// [`ClusteredTransformerEncoderInput`] (the same builders); a burn-nn record loads as it is,
/// a burn-nn configuration saved as JSON needs the fields this one adds (`attention`, `bits`,
/// `iterations`, `hash_bias`, `seed`, `recompute_layers`, `stored_dropout_masks`). The
/// differences from burn-nn are listed in the repository's `docs/burn-nn.md`.
///
/// In training, what a step keeps for the backward pass is each layer's activations (the
/// attention's are linear in `L`): about 80 KiB a token for 4 layers of `d_model` 256 and
/// `d_ff` 1024 in `f32`. `recompute_layers` trades a second forward pass of those layers for
/// keeping only their inputs (the repository's `docs/bench/encoder.md` has the memory model
/// and the measurements).
#[derive(Config, Debug)]
pub struct ClusteredTransformerEncoderConfig {
    /// Size of the model (the input and output features).
    pub d_model: usize,
    /// Size of the position-wise feed-forward network's hidden layer.
    pub d_ff: usize,
    /// Number of attention heads; must divide `d_model`.
    pub n_heads: usize,
    /// Number of layers.
    pub n_layers: usize,
    /// The attention of every layer.
    pub attention: AttentionKind,
    /// Dropout on the attention weights, after each sub-layer and inside the feed-forward
    /// network (training only), burn-nn's default.
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Layer norm before each sub-layer (pre-norm) instead of after its residual sum.
    #[config(default = false)]
    pub norm_first: bool,
    /// burn-nn's "quiet softmax" (a softmax with one more zero logit, so a query may attend to
    /// nothing), with [`AttentionKind::Full`] only: every other kind computes the softmax in its
    /// own ops, and [`Self::init`] panics rather than ignore it. Not in records: a burn-nn
    /// record trained with it needs it set here too.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// Initializer of the projections and of the feed-forward network (burn-nn's default).
    #[config(
        default = "Initializer::KaimingUniform{gain: 0.577_350_269_189_625_8, fan_out_only: false}"
    )]
    pub initializer: Initializer,
    /// Activation of the feed-forward network.
    #[config(default = "ActivationConfig::Gelu")]
    pub activation: ActivationConfig,
    /// Epsilon of the layer norms.
    #[config(default = 1e-5)]
    pub layer_norm_eps: f64,
    /// Hash bits of the clustered kinds, in `1..=32`.
    #[config(default = 32)]
    pub bits: usize,
    /// Lloyd iterations of the clustered kinds' K-means.
    #[config(default = 10)]
    pub iterations: usize,
    /// Random thresholds on the hash planes.
    #[config(default = true)]
    pub hash_bias: bool,
    /// Seed of the hash planes and initial centroids; layer `i` uses `seed + i`.
    #[config(default = 0)]
    pub seed: u64,
    /// How many layers (the first ones) are recomputed in the backward pass instead of keeping
    /// their activations ("activation checkpointing"): in training, such a layer keeps its
    /// input and a copy of its parameters, and runs its forward pass again, with the same
    /// clusters and dropout masks, when its gradients are needed (about one more forward pass
    /// of the layer per step). `0` (the default): none; `n_layers`: all. Needs the
    /// counter-based dropout (`stored_dropout_masks` false) where the encoder drops anything:
    /// [`Self::init`] panics otherwise.
    #[config(default = 0)]
    pub recompute_layers: usize,
    /// burn-nn's `Dropout` on the activations (after each sub-layer and inside the
    /// feed-forward network): masks drawn from the backend's generator and stored for the
    /// backward pass, as burn-nn's encoder does. By default (`false`) the encoder draws them
    /// with a counter-based generator (Philox4x32-10, as the attention's dropout,
    /// [`crate::ops::activation_dropout`]) and draws them again in the backward pass: no
    /// mask stored, the same rate and scaling, other masks than burn-nn's.
    #[config(default = false)]
    pub stored_dropout_masks: bool,
}

/// burn-nn's transformer encoder ("Attention Is All You Need", Vaswani et al. 2017) with the
/// crate's attention in every layer (Vyas et al., NeurIPS 2020).
///
/// Its module tree is burn-nn's `TransformerEncoder`'s (`layers.N.mha.{query, key, value,
/// output}`, `layers.N.pwff.{linear_inner, linear_outer}`, `layers.N.norm_1`,
/// `layers.N.norm_2`), so that a record saved from one loads into the other, and with
/// [`AttentionKind::Full`] it computes what burn-nn's computes at every valid position.
/// Padded positions (given by `mask_pad`) join no cluster: their attention output is zero
/// before the output projection, where burn-nn's attends to the valid keys.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{
///     AttentionKind, ClusteredTransformerEncoderConfig, ClusteredTransformerEncoderInput,
/// };
///
/// let device = Device::default();
/// let attention = AttentionKind::Improved { clusters: 10, topk: 8 };
/// let encoder = ClusteredTransformerEncoderConfig::new(32, 64, 4, 2, attention).init(&device);
/// let x = Tensor::<3>::random([2, 50, 32], Distribution::Default, &device);
/// let y = encoder.forward(ClusteredTransformerEncoderInput::new(x));
/// assert_eq!(y.dims(), [2, 50, 32]);
/// ```
#[derive(Module, Debug)]
pub struct ClusteredTransformerEncoder {
    /// The layers.
    pub layers: Vec<ClusteredTransformerEncoderLayer>,
    /// Size of the model.
    pub d_model: usize,
    /// Size of the feed-forward network's hidden layer.
    pub d_ff: usize,
    /// Number of attention heads.
    pub n_heads: usize,
    /// Number of layers.
    pub n_layers: usize,
    /// The dropout rate.
    pub dropout: f64,
    /// Layer norm before each sub-layer.
    pub norm_first: bool,
    /// The configuration's `quiet_softmax`, as burn-nn's encoder keeps it; what the layers
    /// compute is their own `mha.quiet_softmax`.
    pub quiet_softmax: bool,
    /// How many layers (the first ones) are recomputed in the backward pass
    /// ([`ClusteredTransformerEncoderConfig::recompute_layers`]).
    pub recompute_layers: usize,
}

/// One layer of a [`ClusteredTransformerEncoder`]: burn-nn's `TransformerEncoderLayer` with
/// [`MultiHeadClusteredAttention`] as its `mha`.
#[derive(Module, Debug)]
pub struct ClusteredTransformerEncoderLayer {
    /// Multi-head self-attention.
    pub mha: MultiHeadClusteredAttention,
    /// Position-wise feed-forward network.
    pub pwff: PositionWiseFeedForward,
    /// Layer norm around the feed-forward sub-layer (before it with `norm_first`, after the
    /// attention's residual sum without).
    pub norm_1: LayerNorm,
    /// Layer norm around the attention sub-layer (before it with `norm_first`, after the
    /// feed-forward's residual sum without).
    pub norm_2: LayerNorm,
    /// Dropout on each sub-layer's output, before its residual sum.
    pub dropout: Dropout,
    /// Layer norm before each sub-layer.
    pub norm_first: bool,
    /// burn-nn's `Dropout` (stored masks) on the activations instead of the counter-based one
    /// ([`ClusteredTransformerEncoderConfig::stored_dropout_masks`]).
    pub stored_dropout_masks: bool,
}

/// Input of [`ClusteredTransformerEncoder::forward`], with burn-nn's
/// `TransformerEncoderInput` builders.
#[derive(Debug, Clone)]
pub struct ClusteredTransformerEncoderInput {
    tensor: Tensor<3>,
    mask_pad: Option<Tensor<2, Bool>>,
    key_lengths: Option<Tensor<1, Int>>,
    mask_attn: Option<Tensor<3, Bool>>,
}

impl ClusteredTransformerEncoderInput {
    /// The input sequences, `[batch, L, d_model]`.
    pub fn new(tensor: Tensor<3>) -> Self {
        Self {
            tensor,
            mask_pad: None,
            key_lengths: None,
            mask_attn: None,
        }
    }

    /// Padding mask `[batch, L]`, `true` = padded, as burn-nn's. It must mark a suffix of each
    /// sequence; `forward` panics otherwise. `forward` turns it into lengths once, on its
    /// device, for every layer. A sequence that is all padding gives finite rows: those of a
    /// zero attention output in every layer (burn-nn's attention, which fills masked scores
    /// with −10⁴, attends to all its padded keys alike).
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// The sequences' lengths `[batch]`: positions `≥ lengths[b]` are padding. The same as
    /// [`Self::mask_pad`] (not in burn-nn); give one or the other, not both (`forward`
    /// panics).
    pub fn key_lengths(mut self, lengths: Tensor<1, Int>) -> Self {
        self.key_lengths = Some(lengths);
        self
    }

    /// Attention mask `[batch, L, L]`, `true` where a position may not attend to another, as
    /// burn-nn's. Only [`AttentionKind::Full`] honours it: `forward` panics with any other kind.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }
}

impl ClusteredTransformerEncoderConfig {
    /// Creates the encoder on `device`.
    ///
    /// # Panics
    /// If a layer's configuration is invalid (see
    /// [`MultiHeadClusteredAttentionConfig::validate`]: `n_heads` not dividing `d_model`,
    /// `bits` outside `1..=32`, a count of the attention 0, `dropout` outside `[0, 1)`,
    /// `quiet_softmax` with an attention other than full), if `recompute_layers` exceeds
    /// `n_layers`, or is not 0 with `stored_dropout_masks`.
    pub fn init(&self, device: &Device) -> ClusteredTransformerEncoder {
        assert!(
            self.recompute_layers <= self.n_layers,
            "recompute_layers = {} exceeds n_layers = {}",
            self.recompute_layers,
            self.n_layers
        );
        assert!(
            self.recompute_layers == 0 || !self.stored_dropout_masks || self.dropout == 0.0,
            "recompute_layers = {} needs the counter-based dropout: stored_dropout_masks draws \
             masks that a recomputed forward pass cannot draw again",
            self.recompute_layers
        );
        let layers = (0..self.n_layers)
            .map(|i| self.init_layer(i, device))
            .collect();
        ClusteredTransformerEncoder {
            layers,
            d_model: self.d_model,
            d_ff: self.d_ff,
            n_heads: self.n_heads,
            n_layers: self.n_layers,
            dropout: self.dropout,
            norm_first: self.norm_first,
            quiet_softmax: self.quiet_softmax,
            recompute_layers: self.recompute_layers,
        }
    }

    /// Layer `index`, as burn-nn's `TransformerEncoderLayer::new` builds it.
    fn init_layer(&self, index: usize, device: &Device) -> ClusteredTransformerEncoderLayer {
        let mha =
            MultiHeadClusteredAttentionConfig::new(self.d_model, self.n_heads, self.attention)
                .with_initializer(self.initializer.clone())
                .with_dropout(self.dropout)
                .with_bits(self.bits)
                .with_iterations(self.iterations)
                .with_hash_bias(self.hash_bias)
                .with_seed(self.seed.wrapping_add(index as u64))
                .with_quiet_softmax(self.quiet_softmax)
                .init(device);
        let norm = || {
            LayerNormConfig::new(self.d_model)
                .with_epsilon(self.layer_norm_eps)
                .init(device)
        };
        let pwff = PositionWiseFeedForwardConfig::new(self.d_model, self.d_ff)
            .with_initializer(self.initializer.clone())
            .with_dropout(self.dropout)
            .with_activation(self.activation.clone())
            .init(device);
        ClusteredTransformerEncoderLayer {
            mha,
            pwff,
            norm_1: norm(),
            norm_2: norm(),
            dropout: DropoutConfig::new(self.dropout).init(),
            norm_first: self.norm_first,
            stored_dropout_masks: self.stored_dropout_masks,
        }
    }
}

impl ClusteredTransformerEncoder {
    /// The same encoder (same weights) with `attention` in every layer: the paper's Table 1
    /// evaluates a model trained with one attention with another.
    ///
    /// # Panics
    /// As [`MultiHeadClusteredAttention::with_attention`].
    pub fn with_attention(mut self, attention: AttentionKind) -> Self {
        self.layers = self
            .layers
            .into_iter()
            .map(|mut layer| {
                layer.mha = layer.mha.with_attention(attention);
                layer
            })
            .collect();
        self
    }

    /// Applies the encoder, layer after layer.
    ///
    /// # Shapes
    /// - tensor: `[batch, L, d_model]`; mask_pad: `[batch, L]`; key_lengths: `[batch]`;
    ///   mask_attn: `[batch, L, L]`
    /// - output: `[batch, L, d_model]`
    ///
    /// # Panics
    /// As [`MultiHeadClusteredAttention::forward`]: if the last dimension is not `d_model`,
    /// `mask_pad` does not mark a suffix of each row, both `mask_pad` and `key_lengths` are
    /// given, a length is outside `0..=L`, or `mask_attn` is given with an attention other
    /// than [`AttentionKind::Full`].
    pub fn forward(&self, input: ClusteredTransformerEncoderInput) -> Tensor<3> {
        let ClusteredTransformerEncoderInput {
            tensor,
            mask_pad,
            key_lengths,
            mask_attn,
        } = input;
        // The padding mask as lengths once for every layer, on the device, and their values
        // read back (and checked) once: the layers' attentions read nothing back.
        let [batch, len, _] = tensor.dims();
        let key_lengths = key_lengths_of(mask_pad, key_lengths).map(|lengths| {
            let host = host_lengths("key_lengths", Some(lengths.clone()), batch, len);
            (lengths, host)
        });
        let masks = |x| self_attention(x, &None, &key_lengths, &mask_attn);
        // In training, the layers' dropout seeds from one draw of the backend's: each layer
        // draws one seed, from which its dropouts' seeds come (so that a recomputed layer
        // draws the same masks again).
        crate::dropout::with_one_seed_draw(|| {
            self.layers
                .iter()
                .enumerate()
                .fold(tensor, |x, (i, layer)| {
                    if !x.is_autodiff() {
                        layer.forward_with(x, masks)
                    } else if i < self.recompute_layers {
                        layer.forward_recomputed(x, &key_lengths, &mask_attn)
                    } else {
                        let seed = layer.dropout_seed(&x.device());
                        crate::dropout::with_seeds(seed, || layer.forward_with(x, masks))
                    }
                })
        })
    }
}

impl ClusteredTransformerEncoderLayer {
    /// Applies the layer in burn-nn's order: the attention's residual path (layer norm first
    /// with `norm_first`), dropout and sum, then the feed-forward's.
    ///
    /// # Shapes
    /// - x: `[batch, L, d_model]`; mask_pad: `[batch, L]`; mask_attn: `[batch, L, L]`
    /// - output: `[batch, L, d_model]`
    ///
    /// # Panics
    /// As [`ClusteredTransformerEncoder::forward`].
    pub fn forward(
        &self,
        x: Tensor<3>,
        mask_pad: Option<Tensor<2, Bool>>,
        mask_attn: Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        self.forward_with(x, |x| self_attention(x, &mask_pad, &None, &mask_attn))
    }

    /// [`Self::forward`] as one node of the autodiff graph that keeps only `x` and the layer's
    /// parameters and runs the layer again in the backward pass (see
    /// [`crate::recompute`]), its dropout masks drawn from a seed drawn here (the same masks
    /// both times).
    fn forward_recomputed(
        &self,
        x: Tensor<3>,
        key_lengths: &Option<(Tensor<1, Int>, Vec<usize>)>,
        mask_attn: &Option<Tensor<3, Bool>>,
    ) -> Tensor<3> {
        assert!(
            !self.stored_dropout_masks || !self.drops(),
            "a recomputed layer needs the counter-based dropout: stored_dropout_masks draws \
             masks that its second forward pass cannot draw again"
        );
        let seed = self.dropout_seed(&x.device());
        let parameters = flatten_parameters(self);
        // The masks without autodiff, set on each run's device (the fresh leaves' autodiff).
        let key_lengths = key_lengths
            .clone()
            .map(|(lengths, host)| (lengths.inner(), host));
        let mask_attn = mask_attn.clone().map(Tensor::inner);
        let template = self.clone();
        // The clusters of the forward pass, replayed when it runs again.
        let clusters = Arc::new(Mutex::new(None::<VecDeque<Clusters>>));
        let forward = RecomputedForward::new(move |x, parameters| {
            let layer = unflatten_parameters(template.clone(), parameters);
            let key_lengths = key_lengths
                .clone()
                .map(|(lengths, host)| (lengths.autodiff(), host));
            let mask_attn = mask_attn.clone().map(Tensor::autodiff);
            // (A lock poisoned by a panic in an earlier run holds what that run left.)
            let kept = clusters
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            let memo = match kept {
                Some(replay) => ClusterMemo::Replay(replay),
                None => ClusterMemo::Record(Vec::new()),
            };
            // The seeds of the counter-based masks from `seed`; the masks full attention and
            // the baselines draw on the host (crate::dropout::dropout) from another generator.
            let (output, memo) = with_cluster_memo(memo, || {
                crate::dropout::with_dropout_seed(seed.wrapping_add(1), || {
                    crate::dropout::with_seeds(seed, || {
                        layer
                            .forward_with(x, |x| self_attention(x, &None, &key_lengths, &mask_attn))
                    })
                })
            });
            if let ClusterMemo::Record(recorded) = memo {
                *clusters.lock().unwrap_or_else(PoisonError::into_inner) = Some(recorded.into());
            }
            output
        });
        crate::ops::recompute(x, parameters, forward)
    }

    /// The seed of the layer's dropouts in one training forward pass: a fresh one (see
    /// [`crate::dropout::next_seed`]), or 0 without a draw (on a GPU, a read back) when the
    /// layer drops nothing.
    fn dropout_seed(&self, device: &Device) -> u64 {
        if self.drops() {
            crate::dropout::next_seed(device)
        } else {
            0
        }
    }

    /// Whether any of the layer's dropouts has a rate above 0.
    fn drops(&self) -> bool {
        self.mha.dropout > 0.0 || self.dropout.prob > 0.0 || self.pwff.dropout.prob > 0.0
    }

    /// [`Self::forward`], the attention's input (self-attention with its masks or lengths) made
    /// by `attention_input` from the attention's residual path. In training each layer norm is
    /// one node that keeps its input only ([`layer_norm`]).
    fn forward_with(
        &self,
        x: Tensor<3>,
        attention_input: impl Fn(Tensor<3>) -> ClusteredAttentionInput,
    ) -> Tensor<3> {
        let norm = |norm: &LayerNorm, x: Tensor<3>| layer_norm(norm, x);
        let residual = if self.norm_first {
            norm(&self.norm_2, x.clone())
        } else {
            x.clone()
        };
        let residual =
            self.apply_dropout(self.mha.forward(attention_input(residual)), &self.dropout);
        let mut x = x + residual;

        let residual = if self.norm_first {
            norm(&self.norm_1, x.clone())
        } else {
            x = norm(&self.norm_1, x);
            x.clone()
        };
        let residual = self.apply_dropout(self.feed_forward(residual), &self.dropout);
        let x = x + residual;
        if self.norm_first {
            x
        } else {
            norm(&self.norm_2, x)
        }
    }
}

impl ClusteredTransformerEncoderLayer {
    /// `dropout` (one of the layer's burn-nn `Dropout` modules: its rate and training flag) on
    /// `x`: burn-nn's own with `stored_dropout_masks`, else the counter-based one, with a
    /// fresh seed, when training (an autodiff device and the flag set) with a rate above 0.
    fn apply_dropout(&self, x: Tensor<3>, dropout: &Dropout) -> Tensor<3> {
        if self.stored_dropout_masks {
            return dropout.forward(x);
        }
        if !dropout.training.is_enabled() {
            return x;
        }
        match AttentionDropout::for_forward(dropout.prob, &x.device()) {
            Some(masks) => crate::ops::activation_dropout(x, masks, AttentionDropout::ACTIVATIONS),
            None => x,
        }
    }

    /// burn-nn's `PositionWiseFeedForward::forward` with [`Self::apply_dropout`] on its hidden
    /// layer: `linear_outer(dropout(activation(linear_inner(x))))`.
    fn feed_forward(&self, x: Tensor<3>) -> Tensor<3> {
        if self.stored_dropout_masks {
            return self.pwff.forward(x);
        }
        let pwff = &self.pwff;
        let hidden = pwff.activation.forward(pwff.linear_inner.forward(x));
        pwff.linear_outer
            .forward(self.apply_dropout(hidden, &pwff.dropout))
    }
}

/// burn-nn's layer norm `norm` on `x`; on an autodiff device, as one node of
/// the graph ([`crate::ops::recompute`]) that keeps `x` and the norm's two parameters and runs
/// the norm again in the backward pass: Burn's layer norm keeps its centred and its
/// normalised input for the backward pass (two tensors like `x`), this node `x` alone. The
/// same values and gradients.
fn layer_norm(norm: &LayerNorm, x: Tensor<3>) -> Tensor<3> {
    if !x.is_autodiff() {
        return norm.forward(x);
    }
    let parameters = flatten_parameters(norm);
    let template = norm.clone();
    let forward = RecomputedForward::new(move |x, parameters| {
        unflatten_parameters(template.clone(), parameters).forward(x)
    });
    crate::ops::recompute(x, parameters, forward)
}

/// The self-attention input of `x` with the masks or lengths (with their values on the host)
/// given.
fn self_attention(
    x: Tensor<3>,
    mask_pad: &Option<Tensor<2, Bool>>,
    key_lengths: &Option<(Tensor<1, Int>, Vec<usize>)>,
    mask_attn: &Option<Tensor<3, Bool>>,
) -> ClusteredAttentionInput {
    let mut input = ClusteredAttentionInput::self_attn(x);
    if let Some(mask) = mask_pad {
        input = input.mask_pad(mask.clone());
    }
    if let Some((lengths, host)) = key_lengths {
        input = input.with_key_lengths_host(lengths.clone(), host.clone());
    }
    if let Some(mask) = mask_attn {
        input = input.mask_attn(mask.clone());
    }
    input
}
