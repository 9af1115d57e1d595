//! The BERT encoder: embeddings, clustered-attention's transformer encoder (post-norm, GELU:
//! BERT's layers), and sentence embeddings by mean pooling.

use burn::config::Config;
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, LayerNorm, LayerNormConfig};
use burn::tensor::Device;
use burn::tensor::{Int, Tensor};
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoder, ClusteredTransformerEncoderConfig,
    ClusteredTransformerEncoderInput,
};

/// Configuration of a [`TextEncoder`]: the hyper-parameters of a BERT checkpoint
/// (Devlin et al., 2019) and the attention its layers compute.
///
/// [`crate::loader::HfBertConfig`] reads them from a Hugging Face `config.json`.
#[derive(Config, Debug)]
pub struct TextEncoderConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Size of the hidden states, `d_model`.
    pub hidden_size: usize,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer; must divide `hidden_size`.
    pub num_attention_heads: usize,
    /// Size of the feed-forward hidden layer.
    pub intermediate_size: usize,
    /// Positions with an embedding: the longest input, in tokens.
    pub max_position_embeddings: usize,
    /// Token types (segments) with an embedding.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    #[config(default = 1e-12)]
    pub layer_norm_eps: f64,
    /// The attention of every layer (the pretrained model's is full attention).
    #[config(default = "AttentionKind::Full")]
    pub attention: AttentionKind,
    /// Hash bits of clustered and improved attention.
    #[config(default = 32)]
    pub bits: usize,
    /// Lloyd iterations of the Hamming K-means.
    #[config(default = 10)]
    pub iterations: usize,
    /// Seed of the hash planes and initial centroids.
    #[config(default = 0)]
    pub seed: u64,
}

/// Word, position and token-type embeddings, summed and normalised.
#[derive(Module, Debug)]
pub struct Embeddings {
    /// Token embeddings `[vocab_size, hidden_size]`.
    pub word_embeddings: Embedding,
    /// Absolute position embeddings `[max_position_embeddings, hidden_size]`.
    pub position_embeddings: Embedding,
    /// Token-type embeddings `[type_vocab_size, hidden_size]`.
    pub token_type_embeddings: Embedding,
    /// LayerNorm of the sum.
    pub layer_norm: LayerNorm,
}

/// A BERT-family encoder whose self-attention is full, clustered or improved clustered
/// attention (a [`ClusteredTransformerEncoder`]), with sentence-transformers' mean pooling and
/// L2 normalisation for sentence embeddings.
///
/// The attention holds no weights, so a model pretrained with full attention is evaluated with
/// another one by [`TextEncoder::with_attention`], as in the paper's §4.3 (Table 4).
#[derive(Module, Debug)]
pub struct TextEncoder {
    /// The input embeddings.
    pub embeddings: Embeddings,
    /// The transformer layers: BERT's layer is burn-nn's post-norm encoder layer with GELU
    /// (`mha`, `norm_1` after the attention's residual sum, `pwff.linear_inner` and
    /// `pwff.linear_outer`, `norm_2` after the feed-forward's).
    pub encoder: ClusteredTransformerEncoder,
}

impl TextEncoderConfig {
    /// Creates an encoder with freshly initialised weights; load pretrained ones with
    /// [`crate::loader::load_safetensors`]. Attention dropout is 0: the encoder is used for
    /// inference.
    ///
    /// # Panics
    /// If `num_attention_heads` does not divide `hidden_size`, `bits` is outside `1..=32`, or
    /// the attention kind is invalid (a cluster count or `topk` of 0; see
    /// [`ClusteredTransformerEncoderConfig::init`]).
    pub fn init(&self, device: &Device) -> TextEncoder {
        let d = self.hidden_size;
        let norm = || {
            LayerNormConfig::new(d)
                .with_epsilon(self.layer_norm_eps)
                .init(device)
        };
        let embeddings = Embeddings {
            word_embeddings: EmbeddingConfig::new(self.vocab_size, d).init(device),
            position_embeddings: EmbeddingConfig::new(self.max_position_embeddings, d).init(device),
            token_type_embeddings: EmbeddingConfig::new(self.type_vocab_size, d).init(device),
            layer_norm: norm(),
        };
        let encoder = ClusteredTransformerEncoderConfig::new(
            d,
            self.intermediate_size,
            self.num_attention_heads,
            self.num_hidden_layers,
            self.attention,
        )
        .with_dropout(0.0)
        .with_layer_norm_eps(self.layer_norm_eps)
        .with_bits(self.bits)
        .with_iterations(self.iterations)
        .with_seed(self.seed)
        .init(device);
        TextEncoder {
            embeddings,
            encoder,
        }
    }
}

impl TextEncoder {
    /// The same weights with every layer computing `attention` (paper §4.3: approximating a
    /// pretrained model without retraining).
    ///
    /// # Panics
    /// If `attention` is shared-QK (`shared-full`, `lsh:X`): the pretrained keys come from their
    /// own projection. A cluster count or `topk` of 0 panics at the next forward pass.
    pub fn with_attention(self, attention: AttentionKind) -> Self {
        Self {
            encoder: self.encoder.with_attention(attention),
            ..self
        }
    }

    /// The longest input, in tokens.
    pub fn max_len(&self) -> usize {
        self.embeddings.position_embeddings.weight.dims()[0]
    }

    /// The token ids the word embeddings cover: `0..vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.embeddings.word_embeddings.weight.dims()[0]
    }

    /// Hidden states of the last layer.
    ///
    /// # Shapes
    /// - tokens: `[batch, seq]` token ids (token type 0, positions `0..seq`)
    /// - lengths: `[batch]`, tokens at positions `≥ lengths[b]` are padding
    /// - output: `[batch, seq, hidden_size]`
    ///
    /// # Panics
    /// If `seq` exceeds [`Self::max_len`], `lengths` is not `[batch]`, or a length is 0
    /// or exceeds `seq` (the attention's checks).
    pub fn forward(&self, tokens: Tensor<2, Int>, lengths: Tensor<1, Int>) -> Tensor<3> {
        let [batch, seq] = tokens.dims();
        assert!(
            seq <= self.max_len(),
            "tokens [{batch}, {seq}]: at most {} positions have an embedding",
            self.max_len()
        );
        assert_eq!(
            lengths.dims(),
            [batch],
            "lengths {:?} must be [batch] for tokens [{batch}, {seq}]",
            lengths.dims()
        );
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .expand([batch, seq]);
        let types = Tensor::<2, Int>::zeros([batch, seq], &device);
        let e = &self.embeddings;
        let x = e.layer_norm.forward(
            e.word_embeddings.forward(tokens)
                + e.position_embeddings.forward(positions)
                + e.token_type_embeddings.forward(types),
        );
        self.encoder
            .forward(ClusteredTransformerEncoderInput::new(x).key_lengths(lengths))
    }

    /// Sentence embeddings: the mean of the last hidden states over each input's tokens,
    /// divided by its L2 norm (sentence-transformers' `Pooling(mean)` then `Normalize`).
    ///
    /// # Shapes
    /// - tokens: `[batch, seq]`, lengths: `[batch]` (as in [`Self::forward`])
    /// - output: `[batch, hidden_size]`, unit rows
    ///
    /// # Panics
    /// As [`Self::forward`].
    pub fn sentence_embeddings(
        &self,
        tokens: Tensor<2, Int>,
        lengths: Tensor<1, Int>,
    ) -> Tensor<2> {
        let [batch, seq] = tokens.dims();
        let hidden = self.forward(tokens, lengths.clone());
        let device = hidden.device();
        let d = hidden.dims()[2];
        let valid = Tensor::<1, Int>::arange(0..seq as i64, &device)
            .reshape([1, seq])
            .expand([batch, seq])
            .lower(lengths.clone().reshape([batch, 1]).expand([batch, seq]))
            .float()
            .reshape([batch, seq, 1]);
        let count = lengths.float().clamp_min(1.0).reshape([batch, 1]);
        let mean = (hidden * valid).sum_dim(1).reshape([batch, d]) / count;
        let norm = mean.clone().square().sum_dim(1).sqrt().clamp_min(1e-12);
        mean / norm
    }
}
