//! The multi-head layer: projections around full, clustered or improved clustered attention.

use burn::config::Config;
use burn::module::{Flag, Initializer, Module, Param};
use burn::nn::{Linear, LinearConfig};
use burn::tensor::{Bool, Device, Int, Tensor, TensorData};

use crate::attention::{
    AttentionInput, AttentionOptions, ClusteredAttention, FullAttention, HostLengths,
    ImprovedClusteredAttention, LshAttention, OracleTopAttention, SharedFullAttention,
};
use crate::clustering::{ClusteringOptions, QueryGrouping};
use crate::kind::AttentionKind;
use crate::ops::checks::{host_lengths, validate_bits};

/// Configuration of a [`MultiHeadClusteredAttention`] layer.
#[derive(Config, Debug)]
pub struct MultiHeadClusteredAttentionConfig {
    /// Size of the input and output features.
    pub d_model: usize,
    /// Number of heads; must divide `d_model`.
    pub n_heads: usize,
    /// The attention computed by the layer.
    pub attention: AttentionKind,
    /// Hash bits, in `1..=32`.
    #[config(default = 32)]
    pub bits: usize,
    /// Lloyd iterations of the Hamming K-means.
    #[config(default = 10)]
    pub iterations: usize,
    /// Random thresholds on the hash planes (L2-like rather than cosine-like grouping).
    #[config(default = true)]
    pub hash_bias: bool,
    /// Softmax temperature; `None` means `1 / sqrt(d_model / n_heads)`.
    #[config(default = "None")]
    pub scale: Option<f64>,
    /// Dropout on the attention weights (training only), burn-nn's `MultiHeadAttention`
    /// default. What a weight is for each attention, and why the expected output is unchanged,
    /// is told at [`AttentionOptions::dropout`].
    #[config(default = 0.1)]
    pub dropout: f64,
    /// Seed of the hash planes and initial centroids.
    #[config(default = 0)]
    pub seed: u64,
    /// burn-nn's quiet softmax (one more zero logit per row, so a query may attend to
    /// nothing), with [`AttentionKind::Full`] only: every other kind computes the softmax in
    /// its own ops ([`FullAttention::quiet_softmax`]). Not in records: a burn-nn record trained
    /// with it needs it set here too.
    #[config(default = false)]
    pub quiet_softmax: bool,
    /// Initializer of the four projections (burn-nn's `MultiHeadAttention` default).
    #[config(
        default = "Initializer::KaimingUniform{gain: 0.577_350_269_189_625_8, fan_out_only: false}"
    )]
    pub initializer: Initializer,
}

/// Multi-head attention whose attention is full, clustered or improved clustered
/// (Vyas et al., NeurIPS 2020).
///
/// Its parameters are those of burn-nn's
/// [`MultiHeadAttention`](burn::nn::attention::MultiHeadAttention): four `d_model × d_model`
/// [`Linear`] projections named `query`, `key`, `value` and `output`, so a record saved from one
/// loads into the other. With [`AttentionKind::Full`] it computes what `MultiHeadAttention`
/// computes at every valid query (padded queries' rows are zero here; the dropout masks are
/// drawn apart, so they differ for the same seed).
///
/// A layer created with a shared-QK kind (`shared-full`, `lsh:X`) computes its keys with the
/// `query` projection, normalised to unit length (Reformer), whatever kind it later switches
/// to; its `key` projection is unused.
///
/// # Example
/// ```
/// use burn::tensor::{Device, Distribution, Tensor};
/// use clustered_attention::{AttentionKind, MultiHeadClusteredAttentionConfig, ClusteredAttentionInput};
///
/// let device = Device::default();
/// let layer = MultiHeadClusteredAttentionConfig::new(32, 4, AttentionKind::Improved { clusters: 10, topk: 8 })
///     .init(&device);
/// let x = Tensor::<3>::random([2, 50, 32], Distribution::Default, &device);
/// let y = layer.forward(ClusteredAttentionInput::self_attn(x));
/// assert_eq!(y.dims(), [2, 50, 32]);
///
/// // Evaluate the same weights with full attention.
/// let full = layer.with_attention(AttentionKind::Full);
/// ```
#[derive(Module, Debug)]
pub struct MultiHeadClusteredAttention {
    /// Projection of the inputs to the queries, `d_model → d_model`.
    pub query: Linear,
    /// Projection of the inputs to the keys, `d_model → d_model`.
    pub key: Linear,
    /// Projection of the inputs to the values, `d_model → d_model`.
    pub value: Linear,
    /// Projection of the attention output, `d_model → d_model`.
    pub output: Linear,
    /// The attention computed (configuration, not a parameter: no record holds it).
    #[module(skip)]
    pub attention: AttentionKind,
    /// Keys come from the `query` projection, normalised (set when the layer is created with
    /// a shared-QK kind, [`AttentionKind::is_shared_qk`]).
    pub shared_qk: bool,
    /// Size of the input and output features.
    pub d_model: usize,
    /// Number of heads.
    pub n_heads: usize,
    /// Size of each head's queries, keys and values (`d_model / n_heads`).
    pub d_k: usize,
    /// Hash bits.
    pub bits: usize,
    /// Lloyd iterations.
    pub iterations: usize,
    /// Random thresholds on the hash planes.
    pub hash_bias: bool,
    /// Softmax temperature, `None` for `1 / sqrt(d_k)`.
    pub scale: Option<f64>,
    /// Dropout on the attention weights.
    pub dropout: f64,
    /// Whether the dropout applies (on an autodiff device), as burn-nn's `Dropout::training`:
    /// enabled by [`MultiHeadClusteredAttentionConfig::init`], disabled by `Module::freeze` and
    /// `Module::valid`, enabled again by `Module::unfreeze`. A flag is runtime configuration:
    /// no record holds its value.
    pub training: Param<Flag>,
    /// Seed of the hash planes and initial centroids.
    pub seed: u64,
    /// burn-nn's quiet softmax (full attention only; `forward` panics with another kind).
    pub quiet_softmax: bool,
}

impl MultiHeadClusteredAttentionConfig {
    /// Checks the configuration without building anything: what [`Self::init`] would panic
    /// on, as an error (for a configuration read from a file).
    ///
    /// # Errors
    /// A sentence naming the setting and its value, when `d_model` is not divisible by
    /// `n_heads` (or `n_heads` is 0), `bits` is outside `1..=32`, a cluster count, `topk`,
    /// `rounds` or `chunk_size` is 0 ([`AttentionKind::validate`]), `dropout` is outside
    /// `[0, 1)`, or `quiet_softmax` is set with an attention other than full.
    pub fn validate(&self) -> Result<(), String> {
        if self.n_heads == 0 || !self.d_model.is_multiple_of(self.n_heads) {
            return Err(format!(
                "d_model ({}) must be divisible by n_heads ({})",
                self.d_model, self.n_heads
            ));
        }
        self.attention.validate()?;
        validate_bits(self.bits)?;
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout must be in [0, 1), got {}", self.dropout));
        }
        check_quiet_softmax(self.quiet_softmax, self.attention)
    }

    /// Creates the layer.
    ///
    /// # Panics
    /// If `d_model` is not divisible by `n_heads`, `bits` is outside `1..=32`, a cluster count
    /// or `topk` is 0, `dropout` is outside `[0, 1)`, or `quiet_softmax` is set with an
    /// attention other than full (see [`Self::validate`]).
    pub fn init(&self, device: &Device) -> MultiHeadClusteredAttention {
        if let Err(message) = self.validate() {
            panic!("{message}");
        }
        let linear = || {
            LinearConfig::new(self.d_model, self.d_model)
                .with_initializer(self.initializer.clone())
                .init(device)
        };
        MultiHeadClusteredAttention {
            query: linear(),
            key: linear(),
            value: linear(),
            output: linear(),
            attention: self.attention,
            shared_qk: self.attention.is_shared_qk(),
            d_model: self.d_model,
            n_heads: self.n_heads,
            d_k: self.d_model / self.n_heads,
            bits: self.bits,
            iterations: self.iterations,
            hash_bias: self.hash_bias,
            scale: self.scale,
            dropout: self.dropout,
            training: Param::from_bool(true),
            seed: self.seed,
            quiet_softmax: self.quiet_softmax,
        }
    }
}

/// `Err` naming both when the quiet softmax is asked of an attention other than full.
fn check_quiet_softmax(quiet_softmax: bool, attention: AttentionKind) -> Result<(), String> {
    if quiet_softmax && attention != AttentionKind::Full {
        return Err(format!(
            "quiet_softmax = true needs full attention: {attention} computes the softmax in its \
             own ops (every kind but full does); set quiet_softmax to false or use full"
        ));
    }
    Ok(())
}

/// Input of [`MultiHeadClusteredAttention::forward`], in the style of burn-nn's `MhaInput`.
#[derive(Debug, Clone)]
pub struct ClusteredAttentionInput {
    query: Tensor<3>,
    key: Tensor<3>,
    value: Tensor<3>,
    self_attention: bool,
    mask_pad: Option<Tensor<2, Bool>>,
    mask_attn: Option<Tensor<3, Bool>>,
    key_lengths: Option<Tensor<1, Int>>,
    query_lengths: Option<Tensor<1, Int>>,
    /// The values of `key_lengths` on the host, where given so.
    key_host: Option<Vec<usize>>,
    /// The values of `query_lengths` on the host, where given so.
    query_host: Option<Vec<usize>>,
}

impl ClusteredAttentionInput {
    /// Self-attention: queries, keys and values all come from `x`, `[batch, seq, d_model]`.
    /// A padding mask or key lengths then also mark the padded queries.
    pub fn self_attn(x: Tensor<3>) -> Self {
        Self {
            query: x.clone(),
            key: x.clone(),
            value: x,
            self_attention: true,
            mask_pad: None,
            mask_attn: None,
            key_lengths: None,
            query_lengths: None,
            key_host: None,
            query_host: None,
        }
    }

    /// Cross-attention: `query` `[batch, L, d_model]`, `key` and `value` `[batch, S, d_model]`.
    pub fn new(query: Tensor<3>, key: Tensor<3>, value: Tensor<3>) -> Self {
        Self {
            query,
            key,
            value,
            self_attention: false,
            mask_pad: None,
            mask_attn: None,
            key_lengths: None,
            query_lengths: None,
            key_host: None,
            query_host: None,
        }
    }

    /// Key padding mask `[batch, S]`, `true` = masked, as in burn-nn. It must mark a suffix of
    /// each sequence (padding); `forward` panics otherwise, and when key lengths are given too.
    pub fn mask_pad(mut self, mask_pad: Tensor<2, Bool>) -> Self {
        self.mask_pad = Some(mask_pad);
        self
    }

    /// Attention mask `[batch, L, S]`, `true` where a query may not attend to a key, as
    /// burn-nn's `mask_attn` (a causal mask, say). Only full attention honours an arbitrary
    /// mask: `forward` panics with any other kind.
    pub fn mask_attn(mut self, mask_attn: Tensor<3, Bool>) -> Self {
        self.mask_attn = Some(mask_attn);
        self
    }

    /// Key lengths `[batch]`: keys at positions `≥ key_lengths[b]` are padding. Give this or
    /// [`Self::mask_pad`], not both.
    pub fn key_lengths(mut self, lengths: Tensor<1, Int>) -> Self {
        self.key_lengths = Some(lengths);
        self.key_host = None;
        self
    }

    /// Key lengths as [`Self::key_lengths`], given by their values on the host (one per
    /// sequence, each in `0..=S`): the `[batch]` tensor is made on the key's device and the
    /// attention takes the values from here, reading nothing back to check them or to cluster
    /// the queries (on a GPU a read waits for the device; without this, the layer reads its
    /// lengths back in every forward).
    pub fn key_lengths_host(self, lengths: &[usize]) -> Self {
        let tensor = lengths_tensor(lengths, &self.key.device());
        self.with_key_lengths_host(tensor, lengths.to_vec())
    }

    /// Key lengths `tensor` whose values `host` holds (the caller vouches they agree).
    pub(crate) fn with_key_lengths_host(
        mut self,
        tensor: Tensor<1, Int>,
        host: Vec<usize>,
    ) -> Self {
        self.key_lengths = Some(tensor);
        self.key_host = Some(host);
        self
    }

    /// Query lengths `[batch]`: queries at positions `≥ query_lengths[b]` are padding; they join
    /// no cluster and their output rows are zero.
    pub fn query_lengths(mut self, lengths: Tensor<1, Int>) -> Self {
        self.query_lengths = Some(lengths);
        self.query_host = None;
        self
    }

    /// Query lengths as [`Self::query_lengths`], given by their values on the host (one per
    /// sequence, each in `0..=L`), as [`Self::key_lengths_host`] gives the key lengths.
    pub fn query_lengths_host(mut self, lengths: &[usize]) -> Self {
        self.query_lengths = Some(lengths_tensor(lengths, &self.query.device()));
        self.query_host = Some(lengths.to_vec());
        self
    }
}

/// `[batch]` Int lengths on `device` of their values on the host.
fn lengths_tensor(lengths: &[usize], device: &Device) -> Tensor<1, Int> {
    let values: Vec<i64> = lengths.iter().map(|&n| n as i64).collect();
    Tensor::from_data(TensorData::new(values, [lengths.len()]), device)
}

/// Lengths `[batch]` of the unmasked prefix of each row of a padding mask `[batch, S]`,
/// computed on the mask's device (nothing is read back to the host): the number of unmasked
/// positions of each row, or −1 for a row that is not a padding mask (one that unmasks a
/// position after a masked one), which the check of the lengths (the encoder's, or the
/// attention's) then refuses
/// ([`checked_lengths`](crate::ops::checks::checked_lengths)).
pub(crate) fn padding_lengths(mask: Tensor<2, Bool>) -> Tensor<1, Int> {
    let [batch, len] = mask.dims();
    let device = mask.device();
    let lengths = mask.clone().bool_not().int().sum_dim(1);
    let positions = Tensor::<1, Int>::arange(0..len as i64, &device)
        .reshape([1, len])
        .expand([batch, len]);
    let padding = positions.greater_equal(lengths.clone().expand([batch, len]));
    let not_suffix = padding.int().not_equal(mask.int()).any_dim(1);
    lengths.mask_fill(not_suffix, -1).reshape([batch])
}

/// The key lengths `[batch]` a padding mask `[batch, S]` or lengths give: the lengths, the
/// mask's ([`padding_lengths`]), or `None`.
///
/// # Panics
/// If both are given.
pub(crate) fn key_lengths_of(
    mask_pad: Option<Tensor<2, Bool>>,
    key_lengths: Option<Tensor<1, Int>>,
) -> Option<Tensor<1, Int>> {
    match (key_lengths, mask_pad) {
        (Some(lengths), Some(mask)) => panic!(
            "give either mask_pad {:?} or key_lengths {:?}, not both",
            mask.dims(),
            lengths.dims()
        ),
        (lengths, None) => lengths,
        (None, Some(mask)) => Some(padding_lengths(mask)),
    }
}

impl MultiHeadClusteredAttention {
    /// The same layer (same weights) computing another attention.
    ///
    /// # Panics
    /// If a count of `attention` is 0, or `attention` is shared-QK (`shared-full`, `lsh:X`)
    /// and the layer was not created with a shared-QK kind: its keys come from its own `key`
    /// projection, which a shared-QK attention cannot use; or the layer has the quiet softmax
    /// and `attention` is not full.
    pub fn with_attention(mut self, attention: AttentionKind) -> Self {
        attention.check();
        if let Err(message) = check_quiet_softmax(self.quiet_softmax, attention) {
            panic!("{message}");
        }
        assert!(
            !attention.is_shared_qk() || self.shared_qk,
            "{attention} needs a layer trained with shared queries and keys; this one was created with {}",
            self.attention
        );
        self.attention = attention;
        self
    }

    /// Applies the layer.
    ///
    /// # Shapes
    /// - query: `[batch, L, d_model]`
    /// - key, value: `[batch, S, d_model]`
    /// - mask_pad: `[batch, S]`; mask_attn: `[batch, L, S]`; key_lengths, query_lengths:
    ///   `[batch]`
    /// - output: `[batch, L, d_model]`
    ///
    /// # Panics
    /// If the last dimension of an input is not `d_model`, the inputs disagree on batch or on
    /// `S`, `mask_pad` is not a padding mask, both `mask_pad` and key lengths are given, a
    /// length is out of range (see [`FullAttention::forward`]), the attention is shared-QK and
    /// `S ≠ L`, `mask_attn` is given with an attention other than [`AttentionKind::Full`] or
    /// is not `[batch, L, S]`, or [`Self::quiet_softmax`] is set with another attention than
    /// full.
    pub fn forward(&self, input: ClusteredAttentionInput) -> Tensor<3> {
        let [batch, queries_len, _] = input.query.dims();
        for (name, x) in [
            ("query", &input.query),
            ("key", &input.key),
            ("value", &input.value),
        ] {
            assert!(
                x.dims()[2] == self.d_model,
                "{name} must have shape [batch, seq, d_model = {}], got {:?}",
                self.d_model,
                x.dims()
            );
        }
        if let Err(message) = check_quiet_softmax(self.quiet_softmax, self.attention) {
            panic!("{message}");
        }
        if let Some(mask) = &input.mask_attn {
            assert!(
                self.attention == AttentionKind::Full,
                "mask_attn {:?} needs full attention: {} honours padding only (mask_pad or \
                 key_lengths)",
                mask.dims(),
                self.attention
            );
        }
        let key_lengths = key_lengths_of(input.mask_pad, input.key_lengths);
        // A self-attention input's key lengths are its query lengths unless it has its own:
        // where their values are not given, they are read (and checked) once for both.
        let shared = input.self_attention && input.query_lengths.is_none();
        let key_host = match (input.key_host, &key_lengths) {
            (None, Some(lengths)) if shared => {
                let keys_len = input.key.dims()[1];
                let lengths = Some(lengths.clone());
                Some(host_lengths("key_lengths", lengths, batch, keys_len))
            }
            (host, _) => host,
        };
        let (query_lengths, query_host) = match input.query_lengths {
            Some(lengths) => (Some(lengths), input.query_host),
            None if input.self_attention => (key_lengths.clone(), key_host.clone()),
            None => (None, None),
        };
        let host = HostLengths {
            query: query_host,
            key: key_host,
        };

        let input_mask_attn = input.mask_attn;
        let queries = self.heads(input.query, &self.query);
        let keys = if self.shared_qk {
            crate::attention::unit_keys(self.heads(input.key, &self.query))
        } else {
            self.heads(input.key, &self.key)
        };
        let values = self.heads(input.value, &self.value);
        let dropout = match self.training.is_enabled() {
            true => self.dropout,
            false => 0.0,
        };
        let options = AttentionOptions::new()
            .with_scale(self.scale)
            .with_dropout(dropout);
        let clustering =
            || (self.clustering_options()).expect("the clustered kinds have clustering options");
        let input = AttentionInput {
            queries,
            keys,
            values,
            query_lengths,
            key_lengths,
        };
        let context = match self.attention {
            AttentionKind::Full => FullAttention::new()
                .with_options(options)
                .with_quiet_softmax(self.quiet_softmax)
                .forward_masked_host(input, input_mask_attn, &host),
            AttentionKind::Clustered { clusters } | AttentionKind::Blocks { clusters } => {
                ClusteredAttention::new(clusters)
                    .with_clustering(clustering())
                    .with_options(options)
                    .forward_host(input, &host)
            }
            AttentionKind::Improved { clusters, topk }
            | AttentionKind::ImprovedBlocks { clusters, topk } => {
                ImprovedClusteredAttention::new(clusters, topk)
                    .with_clustering(clustering())
                    .with_options(options)
                    .forward_host(input, &host)
            }
            AttentionKind::SharedFull => SharedFullAttention::new()
                .with_options(options)
                .forward_host(input, &host),
            AttentionKind::Lsh { rounds, chunk_size } => LshAttention::new(rounds)
                .with_chunk_size(chunk_size)
                .with_seed(self.seed)
                .with_options(options)
                .forward_host(input, &host),
            AttentionKind::OracleTop { topk } => OracleTopAttention::new(topk)
                .with_options(options)
                .forward_host(input, &host),
        };
        let context = context
            .swap_dims(1, 2)
            .reshape([batch, queries_len, self.d_model]);
        self.output.forward(context)
    }

    /// The clusters of the queries of `x` that the layer's attention groups them into: those
    /// of [`cluster_queries`](crate::cluster_queries) (hashing and K-means, or position blocks
    /// for the `blocks` kinds) on the queries `x · W_q`, with the layer's options. `None` for
    /// the kinds that do not cluster the queries (full, shared-full, lsh-X, oracle-top).
    /// For analysis: which positions share a cluster, per head.
    ///
    /// # Shapes
    /// - `x`: `[batch, L, d_model]`
    /// - `query_lengths`: `[batch]`
    /// - output: [`Clusters`](crate::Clusters), assignments `[batch, heads, L]`, counts
    ///   `[batch, heads, C]`
    ///
    /// # Panics
    /// If the last dimension of `x` is not `d_model`, or a length is outside `0..=L`.
    pub fn query_clusters(
        &self,
        x: Tensor<3>,
        query_lengths: Option<Tensor<1, Int>>,
    ) -> Option<crate::Clusters> {
        let options = self.clustering_options()?;
        assert!(
            x.dims()[2] == self.d_model,
            "x must have shape [batch, seq, d_model = {}], got {:?}",
            self.d_model,
            x.dims()
        );
        Some(crate::cluster_queries(
            self.heads(x, &self.query),
            query_lengths,
            &options,
        ))
    }

    /// The clustering of the layer's attention: its clusters, grouped by Hamming K-means or
    /// (the `blocks` kinds) by position blocks, with the layer's bits, iterations, hash bias
    /// and seed. `None` for the kinds that do not cluster the queries.
    fn clustering_options(&self) -> Option<ClusteringOptions> {
        let (clusters, grouping) = match self.attention {
            AttentionKind::Clustered { clusters } | AttentionKind::Improved { clusters, .. } => {
                (clusters, QueryGrouping::HammingKmeans)
            }
            AttentionKind::Blocks { clusters } | AttentionKind::ImprovedBlocks { clusters, .. } => {
                (clusters, QueryGrouping::PositionBlocks)
            }
            _ => return None,
        };
        let options = ClusteringOptions::new(clusters)
            .with_bits(self.bits)
            .with_iterations(self.iterations)
            .with_hash_bias(self.hash_bias)
            .with_seed(self.seed)
            .with_grouping(grouping);
        Some(options)
    }

    /// `[batch, seq, d_model]` → `[batch, heads, seq, d_k]` through `linear`.
    fn heads(&self, x: Tensor<3>, linear: &Linear) -> Tensor<4> {
        let [batch, len, _] = x.dims();
        linear
            .forward(x)
            .reshape([batch, len, self.n_heads, self.d_k])
            .swap_dims(1, 2)
    }
}
