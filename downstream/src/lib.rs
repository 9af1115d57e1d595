//! A pre-norm transformer encoder block whose self-attention is clustered-attention's
//! [`MultiHeadClusteredAttention`], as a Burn user would write one in their own crate.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig, Relu};
use burn::tensor::{Device, Int, Tensor};
use clustered_attention::{
    AttentionKind, MultiHeadClusteredAttentionConfig, ClusteredAttentionInput, MultiHeadClusteredAttention,
};

/// The block's sizes and its attention.
#[derive(Config, Debug)]
pub struct EncoderBlockConfig {
    /// Model width.
    pub d_model: usize,
    /// Attention heads (`d_model` divisible by it).
    pub n_heads: usize,
    /// Width of the feed-forward layer.
    pub d_ff: usize,
    /// The attention, e.g. `AttentionKind::Improved { clusters: 16, topk: 8 }`.
    pub attention: AttentionKind,
}

impl EncoderBlockConfig {
    /// A block with Burn's default initialisation and no dropout.
    pub fn init(&self, device: &Device) -> EncoderBlock {
        EncoderBlock {
            attention_norm: LayerNormConfig::new(self.d_model).init(device),
            attention: MultiHeadClusteredAttentionConfig::new(self.d_model, self.n_heads, self.attention)
                .with_dropout(0.0)
                .init(device),
            ff_norm: LayerNormConfig::new(self.d_model).init(device),
            ff_in: LinearConfig::new(self.d_model, self.d_ff).init(device),
            ff_out: LinearConfig::new(self.d_ff, self.d_model).init(device),
            activation: Relu::new(),
        }
    }
}

/// `x + attention(norm(x))`, then `x + ff(norm(x))`.
#[derive(Module, Debug)]
pub struct EncoderBlock {
    attention_norm: LayerNorm,
    /// The self-attention.
    pub attention: MultiHeadClusteredAttention,
    ff_norm: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
    activation: Relu,
}

impl EncoderBlock {
    /// `x`: `[batch, seq, d_model]`; `lengths`: `[batch]`, the valid positions of each
    /// sequence (the rest is padding). Returns `[batch, seq, d_model]`.
    pub fn forward(&self, x: Tensor<3>, lengths: Option<Tensor<1, Int>>) -> Tensor<3> {
        let normed = self.attention_norm.forward(x.clone());
        let mut input = ClusteredAttentionInput::self_attn(normed);
        if let Some(lengths) = lengths {
            input = input.key_lengths(lengths);
        }
        let x = x + self.attention.forward(input);
        let hidden = self
            .activation
            .forward(self.ff_in.forward(self.ff_norm.forward(x.clone())));
        x + self.ff_out.forward(hidden)
    }
}
