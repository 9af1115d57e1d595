//! The functional forms on `[batch, heads, seq, dim]` tensors: full, clustered and improved
//! clustered attention, and the paper's baselines (Reformer's lsh-X, shared-full,
//! oracle-top).
//!
//! Each attention is a small value holding its options, named as in Burn (`new` with what it
//! needs, `with_*` for the rest), whose `forward` takes an [`AttentionInput`]: queries
//! `[batch, heads, L, E]`, keys `[batch, heads, S, E]`, values `[batch, heads, S, D]` (S may
//! differ from L) and optional `[batch]` Int query and key lengths. Positions at or past a
//! sequence's length are padding: padded keys get no attention, padded queries join no
//! cluster and get a zero output row. `forward` returns `[batch, heads, L, D]`.
//!
//! ```
//! use burn::tensor::{Device, Distribution, Int, Tensor};
//! use clustered_attention::{AttentionInput, ImprovedClusteredAttention};
//!
//! let device = Device::default();
//! let queries = Tensor::<4>::random([2, 4, 300, 32], Distribution::Default, &device);
//! let keys = Tensor::<4>::random([2, 4, 200, 32], Distribution::Default, &device);
//! let values = Tensor::<4>::random([2, 4, 200, 32], Distribution::Default, &device);
//! let key_lengths = Tensor::<1, Int>::from_ints([200, 150], &device);
//! // 25 clusters, the 32 top keys of each recomputed per query.
//! let attention = ImprovedClusteredAttention::new(25, 32).with_seed(42);
//! let out = attention.forward(
//!     AttentionInput::new(queries, keys, values).with_key_lengths(key_lengths),
//! );
//! assert_eq!(out.dims(), [2, 4, 300, 32]);
//! ```
//!
//! The attentions are made of Burn tensor ops and the
//! [`ClusteredAttentionBackend`](crate::ClusteredAttentionBackend) ops of the backend of the
//! tensors' device, so gradients flow to queries, keys and values on any autodiff device.
//!
//! - `full.rs`: [`FullAttention`] (eqs. 1–2), the exact baseline.
//! - `clustered.rs`: [`ClusteredAttention`] (eqs. 3–6).
//! - `improved.rs`: [`ImprovedClusteredAttention`] (eqs. 9–11).
//! - `lsh.rs`: Reformer's [`LshAttention`] and its hashing and sort by bucket.
//! - `shared.rs`: [`SharedFullAttention`], full attention with shared queries and keys.
//! - `oracle.rs`: [`OracleTopAttention`], each query's top keys only.
//! - `input.rs`: [`AttentionInput`], the input checks, padding masks and helpers the attentions
//!   share.

mod clustered;
mod full;
mod improved;
mod input;
mod lsh;
mod oracle;
mod shared;

pub use clustered::ClusteredAttention;
pub use full::FullAttention;
pub use improved::ImprovedClusteredAttention;
pub use input::AttentionInput;
pub(crate) use lsh::unit_keys;
pub use lsh::{LshAttention, LshOptions, angular_buckets, lsh_rotations, sort_by_bucket};
pub use oracle::OracleTopAttention;
pub use shared::SharedFullAttention;

pub(crate) use crate::dropout::dropout;
pub(crate) use input::{Checked, HostLengths, inverse_counts, positions, top_keys};

use burn::config::Config;

/// Options shared by all the attentions.
#[derive(Config, Debug, PartialEq)]
pub struct AttentionOptions {
    /// Softmax temperature applied to `q · k`; `None` means `1 / sqrt(E)` (paper eq. 1).
    #[config(default = "None")]
    pub scale: Option<f64>,
    /// Dropout probability `p` on the attention weights, active only on autodiff devices
    /// (training), as in [`burn::nn::Dropout`]: each weight is zeroed with probability `p` and
    /// the others are scaled by `1 / (1 − p)`, so the expected output of every attention is
    /// its output without dropout.
    ///
    /// What one weight is follows what each attention computes:
    /// - full, shared-full, lsh-X, oracle-top: one per (query, key);
    /// - clustered: one per (cluster, key). A cluster's attention row is computed once
    ///   (eq. 5) and all its members receive it (eq. 6), so they share its dropout mask;
    ///   per-query masks would need the `L × S` matrix clustering avoids;
    /// - improved clustered: one per (query, key) on the cluster's top-k keys (computed per
    ///   query, eq. 10) and one per (cluster, key) on the other keys (kept from `Aᶜ`).
    ///
    /// Clustered and improved clustered attention draw their masks inside their fused ops,
    /// from a counter-based generator ([`crate::dropout::AttentionDropout`]), and draw them
    /// again in the backward pass instead of storing them.
    ///
    /// Proposition 2 bounds the attention without dropout, hence the expected attention, not
    /// the attention of one draw.
    #[config(default = 0.0)]
    pub dropout: f64,
}

/// The `with_scale`, `with_dropout` and `with_options` builders of an attention whose
/// [`AttentionOptions`] are in its field `options`.
macro_rules! attention_options_builders {
    () => {
        /// Softmax temperature applied to `q · k` ([`AttentionOptions::scale`]); default
        /// `1 / sqrt(E)` (paper eq. 1).
        pub fn with_scale(mut self, scale: f64) -> Self {
            self.options.scale = Some(scale);
            self
        }

        /// Dropout probability on the attention weights, in `[0, 1)`, active in training only
        /// ([`AttentionOptions::dropout`]); default 0.
        pub fn with_dropout(mut self, dropout: f64) -> Self {
            self.options.dropout = dropout;
            self
        }

        /// All the options shared by the attentions at once.
        pub fn with_options(mut self, options: crate::AttentionOptions) -> Self {
            self.options = options;
            self
        }
    };
}

/// The builders of the clustering options of an attention whose
/// [`ClusteringOptions`](crate::ClusteringOptions) are in its field `clustering`.
macro_rules! clustering_builders {
    () => {
        /// Hash bits `B`, in `1..=32` ([`ClusteringOptions::bits`](crate::ClusteringOptions::bits));
        /// default 32.
        pub fn with_bits(mut self, bits: usize) -> Self {
            self.clustering.bits = bits;
            self
        }

        /// Lloyd iterations of the Hamming K-means; default 10.
        pub fn with_iterations(mut self, iterations: usize) -> Self {
            self.clustering.iterations = iterations;
            self
        }

        /// Whether the hash has a random threshold per plane (tracks L2 distance) or none
        /// (tracks cosine distance); default true.
        pub fn with_hash_bias(mut self, hash_bias: bool) -> Self {
            self.clustering.hash_bias = hash_bias;
            self
        }

        /// Seed of the hyperplanes and the initial centroids; default 0.
        pub fn with_seed(mut self, seed: u64) -> Self {
            self.clustering.seed = seed;
            self
        }

        /// What groups the queries: their hashes (default, the paper's method) or their
        /// positions.
        pub fn with_grouping(mut self, grouping: crate::QueryGrouping) -> Self {
            self.clustering.grouping = grouping;
            self
        }

        /// All the clustering options at once (the number of clusters among them).
        pub fn with_clustering(mut self, clustering: crate::ClusteringOptions) -> Self {
            self.clustering = clustering;
            self
        }
    };
}

pub(crate) use {attention_options_builders, clustering_builders};
