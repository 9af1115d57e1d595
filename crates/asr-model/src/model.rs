//! The transformer CTC encoder: frame stacking, sinusoidal positions, pre-norm encoder layers
//! built on [`MultiHeadClusteredAttention`], a linear output over phones + blank.

use burn::config::Config;
use burn::module::Module;
use burn::nn::loss::CTCLossConfig;
use burn::nn::{Dropout, DropoutConfig, LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::{gelu, log_softmax};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use clustered_attention::dropout::dropout;
use clustered_attention::{
    AttentionKind, ClusteredAttentionBackend, ClusteredAttentionConfig, ClusteredAttentionInput,
    MultiHeadClusteredAttention,
};

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
    /// Time subsampling by frame stacking: 1, 2 or 4 frames per encoder step.
    #[config(default = 4)]
    pub subsampling: usize,
    /// Seed of the attention's hashing planes.
    #[config(default = 0)]
    pub seed: u64,
}

/// One pre-norm encoder layer: `x + Attn(LN(x))`, then `x + FF(LN(x))`.
#[derive(Module, Debug)]
pub struct EncoderLayer<B: Backend> {
    norm_attention: LayerNorm<B>,
    attention: MultiHeadClusteredAttention<B>,
    norm_ff: LayerNorm<B>,
    ff_in: Linear<B>,
    ff_out: Linear<B>,
    dropout: Dropout,
}

/// The phone recognizer: `[batch, frames, n_mels]` log-mel features → `[batch, steps,
/// n_outputs]` log-probabilities.
#[derive(Module, Debug)]
pub struct AsrModel<B: Backend> {
    input: Linear<B>,
    layers: Vec<EncoderLayer<B>>,
    norm: LayerNorm<B>,
    output: Linear<B>,
    dropout: Dropout,
    d_model: usize,
    subsampling: usize,
    n_outputs: usize,
}

impl AsrModelConfig {
    /// Builds the model on `device`.
    ///
    /// # Panics
    /// When `subsampling` is not 1, 2 or 4, `n_outputs < 2`, or `d_model` is not divisible by
    /// `n_heads`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> AsrModel<B> {
        assert!(
            matches!(self.subsampling, 1 | 2 | 4),
            "subsampling must be 1, 2 or 4, got {}",
            self.subsampling
        );
        assert!(
            self.n_outputs >= 2,
            "n_outputs must count phones + blank, got {}",
            self.n_outputs
        );
        let layers = (0..self.n_layers)
            .map(|i| EncoderLayer {
                norm_attention: LayerNormConfig::new(self.d_model).init(device),
                attention: ClusteredAttentionConfig::new(
                    self.d_model,
                    self.n_heads,
                    self.attention,
                )
                .with_dropout(self.dropout)
                .with_seed(self.seed + i as u64)
                .init(device),
                norm_ff: LayerNormConfig::new(self.d_model).init(device),
                ff_in: LinearConfig::new(self.d_model, self.d_ff).init(device),
                ff_out: LinearConfig::new(self.d_ff, self.d_model).init(device),
                dropout: DropoutConfig::new(self.dropout).init(),
            })
            .collect();
        AsrModel {
            input: LinearConfig::new(self.n_mels * self.subsampling, self.d_model).init(device),
            layers,
            norm: LayerNormConfig::new(self.d_model).init(device),
            output: LinearConfig::new(self.d_model, self.n_outputs).init(device),
            dropout: DropoutConfig::new(self.dropout).init(),
            d_model: self.d_model,
            subsampling: self.subsampling,
            n_outputs: self.n_outputs,
        }
    }
}

/// Fixed sinusoidal positional encodings (Vaswani et al., 2017, §3.5): `[steps, d_model]`.
pub fn sinusoidal_positions<B: Backend>(
    steps: usize,
    d_model: usize,
    device: &B::Device,
) -> Tensor<B, 2> {
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

impl<B: ClusteredAttentionBackend> AsrModel<B> {
    /// Encoder steps of an utterance of `frames` feature frames: `ceil(frames / subsampling)`.
    pub fn output_length(&self, frames: usize) -> usize {
        frames.div_ceil(self.subsampling)
    }

    /// Number of outputs (phones + blank).
    pub fn n_outputs(&self) -> usize {
        self.n_outputs
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
    pub fn forward(&self, features: Tensor<B, 3>, frame_lengths: &[usize]) -> Tensor<B, 3> {
        let [batch, frames, n_mels] = features.dims();
        let s = self.subsampling;
        assert_eq!(
            frame_lengths.len(),
            batch,
            "frame_lengths has {} entries for features of shape {:?}",
            frame_lengths.len(),
            features.dims()
        );
        assert_eq!(
            n_mels * s,
            self.input.weight.dims()[0],
            "features must be [batch, frames, n_mels = {}], got {:?}",
            self.input.weight.dims()[0] / s,
            features.dims()
        );
        let device = features.device();
        let steps = frames.div_ceil(s);
        let features = if steps * s > frames {
            let pad = Tensor::zeros([batch, steps * s - frames, n_mels], &device);
            Tensor::cat(vec![features, pad], 1)
        } else {
            features
        };
        let x = self
            .input
            .forward(features.reshape([batch, steps, s * n_mels]));
        let x = x * (self.d_model as f64).sqrt()
            + sinusoidal_positions::<B>(steps, self.d_model, &device).unsqueeze_dim(0);
        let mut x = dropout(x, self.dropout.prob);
        let lengths: Vec<i64> = frame_lengths
            .iter()
            .map(|&f| self.output_length(f).min(steps) as i64)
            .collect();
        let lengths = Tensor::<B, 1, Int>::from_data(TensorData::new(lengths, [batch]), &device);
        for layer in &self.layers {
            let h = layer.norm_attention.forward(x.clone());
            let h = layer.attention.forward(
                ClusteredAttentionInput::self_attn(h)
                    .key_lengths(lengths.clone())
                    .query_lengths(lengths.clone()),
            );
            x = x + dropout(h, layer.dropout.prob);
            let h = layer.norm_ff.forward(x.clone());
            let h = layer
                .ff_out
                .forward(dropout(gelu(layer.ff_in.forward(h)), layer.dropout.prob));
            x = x + dropout(h, layer.dropout.prob);
        }
        log_softmax(self.output.forward(self.norm.forward(x)), 2)
    }

    /// Mean CTC loss per utterance (burn-nn's `CTCLoss`, blank 0) of a batch.
    ///
    /// # Shapes
    /// - log_probs: `[batch, steps, n_outputs]` from [`Self::forward`]
    /// - targets: `[batch, max_target_len]` (padded with 0)
    pub fn ctc_loss(
        &self,
        log_probs: Tensor<B, 3>,
        frame_lengths: &[usize],
        targets: Tensor<B, 2, Int>,
        target_lengths: &[usize],
    ) -> Tensor<B, 1> {
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
