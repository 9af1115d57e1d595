//! The functional forms on `[batch, heads, seq, dim]` tensors: full, clustered and improved
//! clustered attention, and the paper's baselines (Reformer's lsh-X, shared-full,
//! oracle-top).
//!
//! All take the same inputs:
//! - `queries`: `[batch, heads, L, E]`, `keys`: `[batch, heads, S, E]`,
//!   `values`: `[batch, heads, S, D]` (S may differ from L);
//! - `query_lengths`, `key_lengths`: optional `[batch]` Int tensors. Positions at or past a
//!   sequence's length are padding: padded keys get no attention, padded queries join no
//!   cluster and get a zero output row.
//!
//! and return `[batch, heads, L, D]`. They are made of Burn tensor ops and the backend's
//! [`ClusteredAttentionBackend`](crate::ClusteredAttentionBackend) ops, so gradients flow to
//! queries, keys and values on any autodiff backend.
//!
//! - `full.rs`: [`full_attention`] (eqs. 1–2), the exact baseline.
//! - `clustered.rs`: [`clustered_attention`] (eqs. 3–6).
//! - `improved.rs`: [`improved_clustered_attention`] (eqs. 9–11).
//! - `lsh.rs`: Reformer's [`lsh_attention`] and its hashing and sort by bucket.
//! - `shared.rs`: [`shared_full_attention`], full attention with shared queries and keys.
//! - `oracle.rs`: [`oracle_top_attention`], each query's top keys only.
//! - `input.rs`: the input checks, padding masks and helpers the attentions share.

mod clustered;
mod full;
mod improved;
mod input;
mod lsh;
mod oracle;
mod shared;

pub use clustered::clustered_attention;
pub use full::full_attention;
pub use improved::improved_clustered_attention;
pub(crate) use lsh::unit_keys;
pub use lsh::{LshOptions, angular_buckets, lsh_attention, lsh_rotations, sort_by_bucket};
pub use oracle::oracle_top_attention;
pub use shared::shared_full_attention;

pub(crate) use crate::dropout::dropout;
pub(crate) use input::{Checked, check_input, inverse_counts, positions, top_keys};

use burn::config::Config;

/// Options shared by all the attentions.
#[derive(Config, Debug, PartialEq)]
pub struct AttentionOptions {
    /// Softmax temperature applied to `q · k`; `None` means `1 / sqrt(E)` (paper eq. 1).
    #[config(default = "None")]
    pub scale: Option<f64>,
    /// Dropout probability `p` on the attention weights, active only on autodiff backends
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
    /// Proposition 2 bounds the attention without dropout, hence the expected attention, not
    /// the attention of one draw.
    #[config(default = 0.0)]
    pub dropout: f64,
}
