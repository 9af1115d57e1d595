//! The transformer CTC encoder: a front end (frame stacking or strided 1-D convolutions),
//! sinusoidal positions, pre-norm encoder layers built on [`MultiHeadClusteredAttention`], a
//! linear output over phones + blank.

use core::fmt;
use core::str::FromStr;

use burn::config::Config;
use burn::module::Module;
use burn::nn::conv::{Conv1d, Conv1dConfig};
use burn::nn::loss::CTCLossConfig;
use burn::nn::{
    Dropout, DropoutConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig, PaddingConfig1d,
};
use burn::tensor::activation::{gelu, log_softmax, relu, sigmoid, silu};
use burn::tensor::module::linear;
use burn::tensor::{Device, Int, Tensor, TensorData};
use clustered_attention::dropout::dropout;
use clustered_attention::{
    AttentionKind, ClusteredAttentionInput, Clusters, MultiHeadClusteredAttention,
    MultiHeadClusteredAttentionConfig,
};
use serde::{Deserialize, Serialize};

use crate::ctc::CtcLossImpl;

/// How the model turns feature frames into encoder steps, `subsampling` frames per step.
///
/// Parses from and prints as `stack` or `conv:C`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FrontEnd {
    /// Stacks `subsampling` consecutive frames into one vector, then projects it linearly to
    /// `d_model`.
    Stack,
    /// Two 1-D convolutions over time, each with kernel 3, padding 1 and the model's
    /// [`Activation`], with strides
    /// whose product is `subsampling` (2·2, 2·1 or 1·1), then a linear projection to
    /// `d_model`: the convolutional subsampling of speech transformers (Mohamed, Okhonko and
    /// Zettlemoyer, 2019, "Transformers with convolutional context for ASR"; here over time
    /// only, with the mel bands as input channels).
    Conv {
        /// Channels of both convolutions.
        channels: usize,
    },
}

impl fmt::Display for FrontEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Stack => f.pad("stack"),
            Self::Conv { channels } => f.pad(&format!("conv:{channels}")),
        }
    }
}

impl FromStr for FrontEnd {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let error = || format!("invalid front end {s:?}: expected stack or conv:C with C ≥ 1");
        match s.trim().split(':').collect::<Vec<_>>().as_slice() {
            ["stack"] => Ok(Self::Stack),
            ["conv", c] => match c.parse::<usize>() {
                Ok(channels) if channels > 0 => Ok(Self::Conv { channels }),
                _ => Err(error()),
            },
            _ => Err(error()),
        }
    }
}

/// The activation of the feed-forward blocks and of the convolutional front end.
///
/// Parses from and prints as `gelu`, `relu` or `silu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Activation {
    /// `x·Φ(x)` with `Φ` the standard normal CDF (Hendrycks and Gimpel, 2016).
    Gelu,
    /// `max(x, 0)`: the cheapest on the CPU backends, whose GELU evaluates `erf` one element
    /// at a time.
    Relu,
    /// `x·σ(x)`, the Swish of the Conformer's feed-forward modules.
    Silu,
}

impl Activation {
    fn apply<const D: usize>(self, x: Tensor<D>) -> Tensor<D> {
        match self {
            Self::Gelu => gelu(x),
            Self::Relu => relu(x),
            Self::Silu => silu(x),
        }
    }
}

impl fmt::Display for Activation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(match self {
            Self::Gelu => "gelu",
            Self::Relu => "relu",
            Self::Silu => "silu",
        })
    }
}

impl FromStr for Activation {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "gelu" => Ok(Self::Gelu),
            "relu" => Ok(Self::Relu),
            "silu" => Ok(Self::Silu),
            _ => Err(format!(
                "invalid activation {s:?}: expected gelu, relu or silu"
            )),
        }
    }
}

/// Configuration of [`AsrModel`].
#[derive(Config, Debug)]
pub struct AsrModelConfig {
    /// Number of model outputs: phones + the CTC blank (output 0).
    pub n_outputs: usize,
    /// Mel bands per input frame.
    #[config(default = 40)]
    pub n_mels: usize,
    /// Model width.
    #[config(default = 128)]
    pub d_model: usize,
    /// Attention heads per layer.
    #[config(default = 4)]
    pub n_heads: usize,
    /// Encoder layers.
    #[config(default = 4)]
    pub n_layers: usize,
    /// Hidden size of the feed-forward blocks.
    #[config(default = 512)]
    pub d_ff: usize,
    /// Dropout probability (attention weights, residual branches).
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Attention of every layer.
    #[config(default = "AttentionKind::Improved { clusters: 16, topk: 16 }")]
    pub attention: AttentionKind,
    /// Time subsampling: 1, 2 or 4 frames per encoder step.
    #[config(default = 4)]
    pub subsampling: usize,
    /// How frames become encoder steps.
    #[config(default = "FrontEnd::Stack")]
    pub front_end: FrontEnd,
    /// Activation of the feed-forward blocks and of the convolutional front end.
    #[config(default = "Activation::Gelu")]
    pub activation: Activation,
    /// Kernel size of a convolution module in every layer, after the attention (Conformer's,
    /// [`ConvModule`]); 0 for none.
    #[config(default = 0)]
    pub conv_kernel: usize,
    /// Weight `w` of an intermediate CTC loss (Lee and Watanabe, 2021, "Intermediate loss
    /// regularization for CTC-based speech recognition"): the output of the middle layer
    /// ([`AsrModel::middle_layer`]) also goes through the final norm and output layer, and
    /// the training loss is `(1 − w)·CTC(last layer) + w·CTC(middle layer)`. 0 for none.
    /// Training only: recognition reads the last layer.
    #[config(default = 0.0)]
    pub inter_ctc_weight: f64,
    /// Seed of the attention's hashing planes.
    #[config(default = 0)]
    pub seed: u64,
    /// Which implementation computes the CTC loss ([`AsrModel::ctc_loss`]); the same loss
    /// either way. Training only.
    #[config(default = "CtcLossImpl::AlphaBeta")]
    pub ctc_loss: CtcLossImpl,
}

/// The convolution module of a Conformer layer (Gulati et al., 2020, "Conformer:
/// Convolution-augmented transformer for speech recognition", §2.2, Fig. 2): a pointwise
/// projection to `2·d_model` and a GLU, a depthwise convolution over time, a normalisation, a
/// Swish (SiLU) and a pointwise projection. The normalisation is a layer norm instead of the
/// paper's batch norm, so that an utterance's output does not depend on its batch; padded
/// steps are zeroed before the depthwise convolution, so they do not leak into valid ones.
#[derive(Module, Debug)]
pub struct ConvModule {
    norm_input: LayerNorm,
    pointwise_in: Linear,
    depthwise: Conv1d,
    norm_depthwise: LayerNorm,
    pointwise_out: Linear,
}

impl ConvModule {
    /// `glu(pointwise_in(x), 2)`, each half of the projection computed by itself from its half
    /// of the weights: the same values, without the strided views of the halves of one
    /// `[batch, steps, 2·d_model]` output, which the CPU backends read element by element.
    fn pointwise_glu(&self, x: Tensor<3>) -> Tensor<3> {
        let weight = self.pointwise_in.weight.val();
        let bias = self.pointwise_in.bias.as_ref().map(|b| b.val());
        let d = weight.dims()[1] / 2;
        let half = |columns: core::ops::Range<usize>| {
            linear(
                x.clone(),
                weight.clone().slice_dim(1, columns.clone()),
                bias.clone().map(|b| b.slice_dim(0, columns)),
            )
        };
        half(0..d) * sigmoid(half(d..2 * d))
    }

    /// `x`: `[batch, steps, d_model]`; `valid`: `[batch, steps, 1]`, 1 on valid steps and 0 on
    /// padding. Returns the module's branch, `[batch, steps, d_model]` (without the residual).
    fn forward(&self, x: Tensor<3>, valid: Tensor<3>) -> Tensor<3> {
        let h = self.pointwise_glu(self.norm_input.forward(x)) * valid;
        let h = self.depthwise.forward(h.swap_dims(1, 2)).swap_dims(1, 2);
        self.pointwise_out
            .forward(silu(self.norm_depthwise.forward(h)))
    }
}

/// One pre-norm encoder layer: `x + Attn(LN(x))`, then `x + Conv(x)` when the layer has a
/// [`ConvModule`], then `x + FF(LN(x))`.
#[derive(Module, Debug)]
pub struct EncoderLayer {
    norm_attention: LayerNorm,
    attention: MultiHeadClusteredAttention,
    conv: Option<ConvModule>,
    norm_ff: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
    dropout: Dropout,
}

/// `[batch, width]`: 1 at each row's first `lengths[row]` positions (at most `width`), 0 after.
fn length_mask(
    lengths: impl ExactSizeIterator<Item = usize>,
    width: usize,
    device: &Device,
) -> Tensor<2> {
    let batch = lengths.len();
    let mut mask = vec![0f32; batch * width];
    for (row, len) in mask.chunks_mut(width.max(1)).zip(lengths) {
        row[..len.min(width)].fill(1.0);
    }
    Tensor::from_data(TensorData::new(mask, [batch, width]), device)
}

/// Stride of the first convolution of [`FrontEnd::Conv`] at time subsampling `subsampling`.
fn first_stride(subsampling: usize) -> usize {
    subsampling.min(2)
}

/// The convolutions of [`FrontEnd::Conv`].
#[derive(Module, Debug)]
pub struct ConvFrontEnd {
    first: Conv1d,
    second: Conv1d,
}

/// The phone recognizer: `[batch, frames, n_mels]` log-mel features → `[batch, steps,
/// n_outputs]` log-probabilities.
#[derive(Module, Debug)]
pub struct AsrModel {
    conv: Option<ConvFrontEnd>,
    input: Linear,
    layers: Vec<EncoderLayer>,
    norm: LayerNorm,
    output: Linear,
    dropout: Dropout,
    #[module(skip)]
    activation: Activation,
    d_model: usize,
    subsampling: usize,
    n_outputs: usize,
    inter_ctc_weight: f64,
    #[module(skip)]
    ctc_loss: CtcLossImpl,
}

impl AsrModelConfig {
    /// Checks the configuration without building anything: what [`Self::init`] would panic
    /// on, as an error (for a configuration read from a file).
    ///
    /// # Errors
    /// A sentence naming the setting and its value, when `subsampling` is not 1, 2 or 4,
    /// `n_outputs < 2`, `n_mels`, `d_model` or `d_ff` is 0, the front end has 0 channels,
    /// `conv_kernel` is even, `inter_ctc_weight` is outside `[0, 1)` or positive with fewer
    /// than 2 layers, or the attention's settings are invalid
    /// ([`MultiHeadClusteredAttentionConfig::validate`]: `d_model` not divisible by `n_heads`, a
    /// count of the attention 0, `dropout` outside `[0, 1)`).
    pub fn validate(&self) -> Result<(), String> {
        if !matches!(self.subsampling, 1 | 2 | 4) {
            return Err(format!(
                "subsampling must be 1, 2 or 4, got {}",
                self.subsampling
            ));
        }
        if self.n_outputs < 2 {
            return Err(format!(
                "n_outputs must count phones + blank, got {}",
                self.n_outputs
            ));
        }
        for (name, value) in [
            ("n_mels", self.n_mels),
            ("d_model", self.d_model),
            ("d_ff", self.d_ff),
        ] {
            if value == 0 {
                return Err(format!("{name} must be at least 1, got 0"));
            }
        }
        if self.front_end == (FrontEnd::Conv { channels: 0 }) {
            return Err("the conv front end needs channels ≥ 1, got 0".into());
        }
        if self.conv_kernel.is_multiple_of(2) && self.conv_kernel != 0 {
            return Err(format!(
                "conv_kernel must be odd (or 0 for none), got {}",
                self.conv_kernel
            ));
        }
        check_inter_ctc_weight(self.inter_ctc_weight, self.n_layers)
            .map_err(|message| format!("inter_ctc_weight {message}"))?;
        self.attention_config(0).validate()
    }

    /// The attention of layer `layer`: its hashing planes seeded by `seed + layer`.
    fn attention_config(&self, layer: usize) -> MultiHeadClusteredAttentionConfig {
        MultiHeadClusteredAttentionConfig::new(self.d_model, self.n_heads, self.attention)
            .with_dropout(self.dropout)
            .with_seed(self.seed.wrapping_add(layer as u64))
    }

    /// Builds the model on `device`.
    ///
    /// # Panics
    /// When the configuration is invalid: see [`Self::validate`], whose message it panics
    /// with.
    pub fn init(&self, device: &Device) -> AsrModel {
        if let Err(message) = self.validate() {
            panic!("{message}");
        }
        let conv_module = || {
            (self.conv_kernel > 0).then(|| ConvModule {
                norm_input: LayerNormConfig::new(self.d_model).init(device),
                pointwise_in: LinearConfig::new(self.d_model, 2 * self.d_model).init(device),
                depthwise: Conv1dConfig::new(self.d_model, self.d_model, self.conv_kernel)
                    .with_groups(self.d_model)
                    .with_padding(PaddingConfig1d::Explicit(
                        self.conv_kernel / 2,
                        self.conv_kernel / 2,
                    ))
                    .init(device),
                norm_depthwise: LayerNormConfig::new(self.d_model).init(device),
                pointwise_out: LinearConfig::new(self.d_model, self.d_model).init(device),
            })
        };
        let layers = (0..self.n_layers)
            .map(|i| EncoderLayer {
                norm_attention: LayerNormConfig::new(self.d_model).init(device),
                attention: self.attention_config(i).init(device),
                conv: conv_module(),
                norm_ff: LayerNormConfig::new(self.d_model).init(device),
                ff_in: LinearConfig::new(self.d_model, self.d_ff).init(device),
                ff_out: LinearConfig::new(self.d_ff, self.d_model).init(device),
                dropout: DropoutConfig::new(self.dropout).init(),
            })
            .collect();
        let (conv, input_width) = match self.front_end {
            FrontEnd::Stack => (None, self.n_mels * self.subsampling),
            FrontEnd::Conv { channels } => {
                let conv = |input, stride| {
                    Conv1dConfig::new(input, channels, 3)
                        .with_stride(stride)
                        .with_padding(PaddingConfig1d::Explicit(1, 1))
                        .init(device)
                };
                let front = ConvFrontEnd {
                    first: conv(self.n_mels, first_stride(self.subsampling)),
                    second: conv(channels, self.subsampling / first_stride(self.subsampling)),
                };
                (Some(front), channels)
            }
        };
        AsrModel {
            conv,
            input: LinearConfig::new(input_width, self.d_model).init(device),
            layers,
            norm: LayerNormConfig::new(self.d_model).init(device),
            output: LinearConfig::new(self.d_model, self.n_outputs).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            activation: self.activation,
            d_model: self.d_model,
            subsampling: self.subsampling,
            n_outputs: self.n_outputs,
            inter_ctc_weight: self.inter_ctc_weight,
            ctc_loss: self.ctc_loss,
        }
    }
}

/// Whether `weight` is a valid [`AsrModelConfig::inter_ctc_weight`] for `n_layers` layers: in
/// `[0, 1)`, and 0 with fewer than 2 layers.
///
/// # Errors
/// What is wrong, as the end of a sentence naming the weight.
pub fn check_inter_ctc_weight(weight: f64, n_layers: usize) -> Result<(), String> {
    if (0.0..1.0).contains(&weight) && (weight == 0.0 || n_layers >= 2) {
        Ok(())
    } else {
        Err(format!(
            "must be in [0, 1), and 0 with fewer than 2 layers; got {weight} with {n_layers} layers"
        ))
    }
}

/// Fixed sinusoidal positional encodings (Vaswani et al., 2017, §3.5): `[steps, d_model]`.
pub fn sinusoidal_positions(steps: usize, d_model: usize, device: &Device) -> Tensor<2> {
    let mut data = vec![0f32; steps * d_model];
    for t in 0..steps {
        for i in 0..d_model {
            let rate = 1.0 / 10000f64.powf((2 * (i / 2)) as f64 / d_model as f64);
            let angle = t as f64 * rate;
            data[t * d_model + i] = if i % 2 == 0 { angle.sin() } else { angle.cos() } as f32;
        }
    }
    Tensor::from_data(TensorData::new(data, [steps, d_model]), device)
}

impl AsrModel {
    /// Encoder steps of an utterance of `frames` feature frames: `ceil(frames / subsampling)`.
    pub fn output_length(&self, frames: usize) -> usize {
        frames.div_ceil(self.subsampling)
    }

    /// Number of outputs (phones + blank).
    pub fn n_outputs(&self) -> usize {
        self.n_outputs
    }

    /// The weight of the intermediate CTC loss ([`AsrModelConfig::inter_ctc_weight`]).
    pub fn inter_ctc_weight(&self) -> f64 {
        self.inter_ctc_weight
    }

    /// The number of layers whose output the intermediate CTC loss reads: `n_layers / 2`.
    pub fn middle_layer(&self) -> usize {
        self.layers.len() / 2
    }

    /// Whether the layers compute their keys with the query projection (trained with a
    /// shared-QK attention: shared-full or lsh-X), so that shared-QK attentions can evaluate
    /// them.
    pub fn shared_qk(&self) -> bool {
        self.layers.iter().all(|layer| layer.attention.shared_qk)
    }

    /// The same weights with another attention in every layer (paper Table 1).
    ///
    /// # Panics
    /// If `attention` is shared-QK and the model was not trained with one ([`Self::shared_qk`]).
    pub fn with_attention(mut self, attention: AttentionKind) -> Self {
        self.layers = self
            .layers
            .into_iter()
            .map(|mut layer| {
                layer.attention = layer.attention.with_attention(attention);
                layer
            })
            .collect();
        self
    }

    /// Log-probabilities over phones + blank.
    ///
    /// # Shapes
    /// - features: `[batch, frames, n_mels]`, zero after each utterance's end
    /// - frame_lengths: `[batch]`, valid frames per utterance
    /// - output: `[batch, steps, n_outputs]` with `steps = ceil(frames / subsampling)`;
    ///   positions past an utterance's [`Self::output_length`] are padding
    ///
    /// # Panics
    /// When `features` does not have `n_mels` bands or `frame_lengths` disagrees with the
    /// batch.
    pub fn forward(&self, features: Tensor<3>, frame_lengths: &[usize]) -> Tensor<3> {
        self.encode(features, frame_lengths, None, None).0
    }

    /// The clusters that each layer's attention groups its queries into, for one forward pass
    /// over `features` (see `MultiHeadClusteredAttention::query_clusters`): one entry per layer,
    /// `None` for a layer whose attention does not cluster its queries. For analysis: which
    /// encoder steps share a cluster, per layer and head.
    ///
    /// # Shapes
    /// - features, frame_lengths: as [`Self::forward`]
    /// - output: per layer, assignments `[batch, heads, steps]` and counts `[batch, heads, C]`
    ///
    /// # Panics
    /// As [`Self::forward`].
    pub fn query_clusters(
        &self,
        features: Tensor<3>,
        frame_lengths: &[usize],
    ) -> Vec<Option<Clusters>> {
        let mut clusters = Vec::new();
        self.encode(features, frame_lengths, None, Some(&mut clusters));
        clusters
    }

    /// [`Self::forward`], and when the model has an intermediate CTC loss
    /// ([`Self::inter_ctc_weight`] > 0) also the log-probabilities read from the output of
    /// its first [`Self::middle_layer`] layers through the same final norm and output layer,
    /// of the same shape.
    ///
    /// # Panics
    /// As [`Self::forward`].
    pub fn forward_with_intermediate(
        &self,
        features: Tensor<3>,
        frame_lengths: &[usize],
    ) -> (Tensor<3>, Option<Tensor<3>>) {
        let tap = (self.inter_ctc_weight > 0.0).then(|| self.middle_layer());
        self.encode(features, frame_lengths, tap, None)
    }

    /// The encoder: the last layer's log-probabilities, and those of the output of the first
    /// `tap` layers when asked; with `clusters`, each layer's query clusters pushed onto it.
    fn encode(
        &self,
        features: Tensor<3>,
        frame_lengths: &[usize],
        tap: Option<usize>,
        mut clusters: Option<&mut Vec<Option<Clusters>>>,
    ) -> (Tensor<3>, Option<Tensor<3>>) {
        let [batch, frames, n_mels] = features.dims();
        let s = self.subsampling;
        assert_eq!(
            frame_lengths.len(),
            batch,
            "frame_lengths has {} entries for features of shape {:?}",
            frame_lengths.len(),
            features.dims()
        );
        let expected_mels = match &self.conv {
            Some(conv) => conv.first.weight.dims()[1],
            None => self.input.weight.dims()[0] / s,
        };
        assert_eq!(
            n_mels,
            expected_mels,
            "features must be [batch, frames, n_mels = {expected_mels}], got {:?}",
            features.dims()
        );
        let device = features.device();
        let steps = frames.div_ceil(s);
        let x = self.front_end(features, frame_lengths);
        let x = x * (self.d_model as f64).sqrt()
            + sinusoidal_positions(steps, self.d_model, &device).unsqueeze_dim(0);
        let mut x = dropout(x, self.dropout.prob);
        let step_lengths: Vec<usize> = frame_lengths
            .iter()
            .map(|&f| self.output_length(f).min(steps))
            .collect();
        let valid =
            self.layers.iter().any(|l| l.conv.is_some()).then(|| {
                length_mask(step_lengths.iter().copied(), steps, &device).unsqueeze_dim(2)
            });
        let lengths = Tensor::<1, Int>::from_data(
            TensorData::new(step_lengths.iter().map(|&n| n as i64).collect(), [batch]),
            &device,
        );
        let head = |x: Tensor<3>| log_softmax(self.output.forward(self.norm.forward(x)), 2);
        let mut middle = None;
        for (i, layer) in self.layers.iter().enumerate() {
            if tap == Some(i) {
                middle = Some(head(x.clone()));
            }
            let h = layer.norm_attention.forward(x.clone());
            if let Some(clusters) = clusters.as_mut() {
                clusters.push(
                    layer
                        .attention
                        .query_clusters(h.clone(), Some(lengths.clone())),
                );
            }
            // The lengths' values from the host: the attention need not read them back (on a
            // GPU a read would wait for the device in every layer). Self-attention: they are
            // the query lengths too.
            let h = layer
                .attention
                .forward(ClusteredAttentionInput::self_attn(h).key_lengths_host(&step_lengths));
            x = x + dropout(h, layer.dropout.prob);
            if let (Some(conv), Some(valid)) = (&layer.conv, &valid) {
                x = x.clone() + dropout(conv.forward(x, valid.clone()), layer.dropout.prob);
            }
            let h = layer.norm_ff.forward(x.clone());
            let h = layer.ff_out.forward(dropout(
                self.activation.apply(layer.ff_in.forward(h)),
                layer.dropout.prob,
            ));
            x = x + dropout(h, layer.dropout.prob);
        }
        (head(x), middle)
    }

    /// The front end: `[batch, frames, n_mels]` features → `[batch, ceil(frames /
    /// subsampling), d_model]`, before the positions are added.
    fn front_end(&self, features: Tensor<3>, frame_lengths: &[usize]) -> Tensor<3> {
        let [batch, frames, n_mels] = features.dims();
        let s = self.subsampling;
        let device = features.device();
        let steps = frames.div_ceil(s);
        match &self.conv {
            // Stride 2 with kernel 3 and padding 1 gives ceil(n / 2) outputs: `steps` in all.
            // The first convolution's outputs past an utterance's end are zeroed, as its
            // zero padding would be if the utterance were alone.
            Some(conv) => {
                let x = self
                    .activation
                    .apply(conv.first.forward(features.swap_dims(1, 2)));
                let [_, _, width] = x.dims();
                let stride = first_stride(s);
                let lengths = frame_lengths.iter().map(|f| f.div_ceil(stride));
                let x = x * length_mask(lengths, width, &device).unsqueeze_dim(1);
                let x = self.activation.apply(conv.second.forward(x));
                self.input.forward(x.swap_dims(1, 2))
            }
            None => {
                let features = if steps * s > frames {
                    let pad = Tensor::zeros([batch, steps * s - frames, n_mels], &device);
                    Tensor::cat(vec![features, pad], 1)
                } else {
                    features
                };
                self.input
                    .forward(features.reshape([batch, steps, s * n_mels]))
            }
        }
    }

    /// The CTC loss (blank 0) of each utterance of a batch, by the model's
    /// [`AsrModelConfig::ctc_loss`]: burn-nn's `CTCLoss` or [`crate::ctc::ctc_loss`].
    ///
    /// # Shapes
    /// - log_probs: `[batch, steps, n_outputs]` from [`Self::forward`]
    /// - targets: `[batch, max_target_len]` (padded with 0)
    /// - output: `[batch]`
    pub fn ctc_loss(
        &self,
        log_probs: Tensor<3>,
        frame_lengths: &[usize],
        targets: Tensor<2, Int>,
        target_lengths: &[usize],
    ) -> Tensor<1> {
        let steps = log_probs.dims()[1];
        if self.ctc_loss == CtcLossImpl::AlphaBeta {
            let input_lengths: Vec<usize> = frame_lengths
                .iter()
                .map(|&f| self.output_length(f).min(steps))
                .collect();
            return crate::ctc::ctc_loss(log_probs, targets, &input_lengths, target_lengths, 0);
        }
        let device = log_probs.device();
        let batch = frame_lengths.len();
        let input_lengths: Vec<i64> = frame_lengths
            .iter()
            .map(|&f| self.output_length(f) as i64)
            .collect();
        let target_lengths: Vec<i64> = target_lengths.iter().map(|&t| t as i64).collect();
        CTCLossConfig::new().init().forward(
            log_probs.swap_dims(0, 1),
            targets,
            Tensor::from_data(TensorData::new(input_lengths, [batch]), &device),
            Tensor::from_data(TensorData::new(target_lengths, [batch]), &device),
        )
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use burn::tensor::Distribution;

    /// The tests' device: NdArray's (deprecated in Burn 0.22, still the tests' reference).
    #[allow(deprecated)]
    fn cpu() -> Device {
        Device::ndarray()
    }

    fn values<const D: usize>(t: Tensor<D>) -> Vec<f32> {
        t.into_data().try_to_vec::<f32>().unwrap()
    }

    /// erf to 1.5e-7 (Abramowitz and Stegun 7.1.26).
    fn erf(x: f64) -> f64 {
        let t = 1.0 / (1.0 + 0.3275911 * x.abs());
        let poly = t
            * (0.254829592
                + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
        (1.0 - poly * (-x * x).exp()).copysign(x)
    }

    fn gelu_ref(x: f64) -> f64 {
        0.5 * x * (1.0 + erf(x / std::f64::consts::SQRT_2))
    }

    /// `x`: `[c_in, n]` → `[c_out, (n + 2·pad − k) / stride + 1]`, zero padding, `groups`
    /// groups, as in the definition of a convolution (no library code).
    fn conv1d_ref(x: &[f32], n: usize, conv: &Conv1d, pad: usize) -> (Vec<f64>, usize) {
        let [c_out, c_in_group, k] = conv.weight.dims();
        let w = values(conv.weight.val());
        let bias = values(conv.bias.as_ref().unwrap().val());
        let out_group = c_out / conv.groups;
        let n_out = (n + 2 * pad - k) / conv.stride + 1;
        let mut y = vec![0f64; c_out * n_out];
        for o in 0..c_out {
            let group = o / out_group;
            for t in 0..n_out {
                let mut acc = bias[o] as f64;
                for ci in 0..c_in_group {
                    let c = group * c_in_group + ci;
                    for j in 0..k {
                        let pos = (t * conv.stride + j) as isize - pad as isize;
                        if pos >= 0 && (pos as usize) < n {
                            acc += w[(o * c_in_group + ci) * k + j] as f64
                                * x[c * n + pos as usize] as f64;
                        }
                    }
                }
                y[o * n_out + t] = acc;
            }
        }
        (y, n_out)
    }

    /// `x`: `[n, d_in]` rows → `[n, d_out]`.
    fn linear_ref(x: &[f64], n: usize, linear: &Linear) -> Vec<f64> {
        let [d_in, d_out] = linear.weight.dims();
        let w = values(linear.weight.val());
        let bias = values(linear.bias.as_ref().unwrap().val());
        let mut y = vec![0f64; n * d_out];
        for r in 0..n {
            for o in 0..d_out {
                y[r * d_out + o] = bias[o] as f64
                    + (0..d_in)
                        .map(|i| x[r * d_in + i] * w[i * d_out + o] as f64)
                        .sum::<f64>();
            }
        }
        y
    }

    /// `x`: `[n, d]` rows, each normalised: `(x − mean) / sqrt(var + 1e-5) · γ + β`.
    fn layer_norm_ref(x: &[f64], d: usize, norm: &LayerNorm) -> Vec<f64> {
        let gamma = values(norm.gamma.val());
        let beta = values(norm.beta.as_ref().unwrap().val());
        x.chunks(d)
            .flat_map(|row| {
                let mean = row.iter().sum::<f64>() / d as f64;
                let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
                row.iter()
                    .enumerate()
                    .map(|(i, v)| {
                        (v - mean) / (var + 1e-5).sqrt() * gamma[i] as f64 + beta[i] as f64
                    })
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    fn largest_difference(ours: &[f32], reference: &[f64]) -> f64 {
        assert_eq!(ours.len(), reference.len());
        ours.iter()
            .zip(reference)
            .map(|(a, b)| (*a as f64 - b).abs())
            .fold(0.0, f64::max)
    }

    fn random(shape: [usize; 3]) -> Tensor<3> {
        Tensor::random(shape, Distribution::Normal(0.0, 1.0), &cpu())
    }

    /// The convolutional front end of one utterance of 13 frames, at subsampling 1, 2 and 4,
    /// with GELU and with ReLU, against the definitions (a convolution of kernel 3 with zero
    /// padding 1, the activation, a linear map), computed in f64: ceil(13 / s) steps, to 1e-4.
    #[test]
    fn conv_front_end_is_two_convolutions_and_a_projection() {
        type Reference = fn(f64) -> f64;
        let relu_ref = |x: f64| x.max(0.0);
        let activations: [(Activation, Reference); 2] =
            [(Activation::Gelu, gelu_ref), (Activation::Relu, relu_ref)];
        for ((activation, act), s) in activations
            .into_iter()
            .flat_map(|a| [1, 2, 4].map(|s| (a, s)))
        {
            let model = AsrModelConfig::new(5)
                .with_activation(activation)
                .with_n_mels(6)
                .with_d_model(8)
                .with_n_heads(2)
                .with_n_layers(1)
                .with_subsampling(s)
                .with_front_end(FrontEnd::Conv { channels: 7 })
                .init(&cpu());
            let features = random([1, 13, 6]);
            let ours = values(model.front_end(features.clone(), &[13]));
            // [frames, mels] → [mels, frames]
            let x = values(features.swap_dims(1, 2));
            let conv = model.conv.as_ref().unwrap();
            let (h, n1) = conv1d_ref(&x, 13, &conv.first, 1);
            let h: Vec<f32> = h.into_iter().map(|v| act(v) as f32).collect();
            let (h, n2) = conv1d_ref(&h, n1, &conv.second, 1);
            assert_eq!(n2, 13usize.div_ceil(s), "steps at subsampling {s}");
            // [channels, steps] → [steps, channels]
            let h: Vec<f64> = (0..n2 * 7).map(|i| act(h[(i % 7) * n2 + i / 7])).collect();
            let reference = linear_ref(&h, n2, &model.input);
            let diff = largest_difference(&ours, &reference);
            assert!(
                diff < 1e-4,
                "{activation}, subsampling {s}: largest difference {diff}"
            );
        }
    }

    /// The Conformer convolution module of one sequence whose last 3 of 11 steps are padding,
    /// against its definition computed in f64: layer norm, a projection to 2·d, GLU (first
    /// half × sigmoid(second half)), padding zeroed, a depthwise convolution of kernel 5 with
    /// zero padding 2, layer norm, SiLU, a projection; to 1e-4 on every step.
    #[test]
    fn conv_module_is_the_conformer_convolution_block() {
        let (d, n, valid_steps) = (6, 11, 8);
        let model = AsrModelConfig::new(5)
            .with_n_mels(4)
            .with_d_model(d)
            .with_n_heads(2)
            .with_n_layers(1)
            .with_conv_kernel(5)
            .init(&cpu());
        let module = model.layers[0].conv.as_ref().unwrap();
        let x = random([1, n, d]);
        let mut mask = vec![0f32; n];
        mask[..valid_steps].fill(1.0);
        let valid = Tensor::<3>::from_data(TensorData::new(mask, [1, n, 1]), &cpu());
        let ours = values(module.forward(x.clone(), valid));

        let x: Vec<f64> = values(x).into_iter().map(f64::from).collect();
        let h = linear_ref(
            &layer_norm_ref(&x, d, &module.norm_input),
            n,
            &module.pointwise_in,
        );
        // GLU, padding zeroed, as [d, n] for the convolution
        let mut g = vec![0f32; d * n];
        for t in 0..valid_steps {
            for c in 0..d {
                let (a, b) = (h[t * 2 * d + c], h[t * 2 * d + d + c]);
                g[c * n + t] = (a / (1.0 + (-b).exp())) as f32;
            }
        }
        let (h, n_out) = conv1d_ref(&g, n, &module.depthwise, 2);
        assert_eq!(n_out, n);
        let h: Vec<f64> = (0..n * d).map(|i| h[(i % d) * n + i / d]).collect();
        let h: Vec<f64> = layer_norm_ref(&h, d, &module.norm_depthwise)
            .into_iter()
            .map(|v| v / (1.0 + (-v).exp()))
            .collect();
        let reference = linear_ref(&h, n, &module.pointwise_out);
        let diff = largest_difference(&ours, &reference);
        assert!(diff < 1e-4, "largest difference {diff}");
    }

    #[test]
    fn front_end_and_activation_parse_and_print() {
        for text in ["stack", "conv:128"] {
            assert_eq!(text.parse::<FrontEnd>().unwrap().to_string(), text);
        }
        for text in ["gelu", "relu", "silu"] {
            assert_eq!(text.parse::<Activation>().unwrap().to_string(), text);
        }
        let error = "swish".parse::<Activation>().unwrap_err();
        assert!(error.contains("swish"), "{error}");
        for bad in ["conv", "conv:0", "conv:x", "stacked", "conv:1:2"] {
            let error = bad.parse::<FrontEnd>().unwrap_err();
            assert!(error.contains(bad), "{error}");
        }
    }

    /// The intermediate log-probabilities are those of the same model cut to its first
    /// `n_layers / 2` layers, whose output goes through the same final norm and output layer
    /// (Lee and Watanabe, 2021, eq. 5), for an even and an odd depth, with and without
    /// convolution modules, on a padded batch; to 1e-6. The last layer's are
    /// [`AsrModel::forward`]'s; a weight of 0 taps nothing.
    #[test]
    fn intermediate_ctc_reads_the_middle_layer() {
        let device = cpu();
        let features = random([2, 13, 6]);
        let lengths = [13, 9];
        for (n_layers, conv_kernel) in [(4, 0), (3, 5), (2, 3)] {
            let config = AsrModelConfig::new(5)
                .with_n_mels(6)
                .with_d_model(8)
                .with_n_heads(2)
                .with_n_layers(n_layers)
                .with_d_ff(16)
                .with_dropout(0.0)
                .with_attention(AttentionKind::Full)
                .with_front_end(FrontEnd::Conv { channels: 4 })
                .with_conv_kernel(conv_kernel);
            let model = config.clone().with_inter_ctc_weight(0.3).init(&device);
            let (last, middle) = model.forward_with_intermediate(features.clone(), &lengths);
            let mut cut = model.clone();
            cut.layers.truncate(n_layers / 2);
            let expected = values(cut.forward(features.clone(), &lengths));
            let diff = largest_difference(
                &values(middle.expect("a weight above 0 taps the middle layer")),
                &expected.iter().map(|&v| f64::from(v)).collect::<Vec<_>>(),
            );
            assert!(diff < 1e-6, "{n_layers} layers: largest difference {diff}");
            assert_eq!(
                values(last),
                values(model.forward(features.clone(), &lengths))
            );
            let plain = config.init(&device);
            assert!(
                plain
                    .forward_with_intermediate(features.clone(), &lengths)
                    .1
                    .is_none()
            );
        }
    }

    #[test]
    #[should_panic(expected = "inter_ctc_weight must be in [0, 1), and 0 with fewer than 2 layers")]
    fn intermediate_ctc_needs_two_layers() {
        AsrModelConfig::new(5)
            .with_n_layers(1)
            .with_inter_ctc_weight(0.3)
            .init(&cpu());
    }

    #[test]
    #[should_panic(expected = "conv_kernel must be odd (or 0 for none), got 4")]
    fn even_conv_kernel_is_refused() {
        AsrModelConfig::new(5).with_conv_kernel(4).init(&cpu());
    }
}
