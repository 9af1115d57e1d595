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
//! and return `[batch, heads, L, D]`. Only the clustering ops are custom; everything else is
//! Burn tensor ops, so gradients flow to queries, keys and values on any autodiff backend.

mod clustered;
mod full;
mod improved;
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

use burn::config::Config;
use burn::nn::DropoutConfig;
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, FloatDType, Int, Tensor, TensorData};

use crate::ClusteringBackend;
use crate::clustering::Clusters;
use crate::ops::host_lengths;
use crate::sparse::{sparse_scatter, sparse_weighted_sum, topk_indices};

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

/// The scale and the lengths and padding masks of a checked attention input.
pub(crate) struct Checked<B: Backend> {
    pub scale: f64,
    /// `[batch]` query lengths, `None` when every query is valid.
    pub query_lengths: Option<Tensor<B, 1, Int>>,
    /// `[batch, 1, L, 1]`, true for padded queries; `None` when no query is padded.
    pub query_padding: Option<Tensor<B, 4, Bool>>,
    /// `[batch, 1, 1, S]`, true for padded keys; `None` when no key is padded.
    pub key_padding: Option<Tensor<B, 4, Bool>>,
    /// `[batch, 1, 1, 1]` key lengths, for masks on gathered key indices.
    pub key_lengths: Option<Tensor<B, 4, Int>>,
}

/// Checks the shapes and lengths of an attention input.
///
/// # Panics
/// With a message naming the argument and the shapes when the batch or head dimensions
/// disagree, the E of queries and keys differ, the S of keys and values differ, a length
/// tensor is not `[batch]`, a length is greater than its sequence, or a key length is 0.
pub(crate) fn check_input<B: Backend>(
    queries: &Tensor<B, 4>,
    keys: &Tensor<B, 4>,
    values: &Tensor<B, 4>,
    query_lengths: Option<Tensor<B, 1, Int>>,
    key_lengths: Option<Tensor<B, 1, Int>>,
    options: &AttentionOptions,
) -> Checked<B> {
    let [batch, heads, queries_len, dim] = queries.dims();
    let [k_batch, k_heads, keys_len, k_dim] = keys.dims();
    let [v_batch, v_heads, v_len, _] = values.dims();
    assert!(
        k_dim == dim,
        "the E of queries {:?} and keys {:?} differ",
        queries.dims(),
        keys.dims()
    );
    assert!(
        v_len == keys_len,
        "the S of keys {:?} and values {:?} differ",
        keys.dims(),
        values.dims()
    );
    assert!(
        k_batch == batch && v_batch == batch && k_heads == heads && v_heads == heads,
        "queries {:?}, keys {:?} and values {:?} must share [batch, heads]",
        queries.dims(),
        keys.dims(),
        values.dims()
    );
    assert!(
        queries_len > 0 && keys_len > 0,
        "queries {:?} and keys {:?} need at least one position",
        queries.dims(),
        keys.dims()
    );
    assert!(
        (0.0..1.0).contains(&options.dropout),
        "dropout must be in [0, 1), got {}",
        options.dropout
    );
    let device = queries.device();

    let query_lengths = query_lengths.map(|lengths| {
        let host = host_lengths("query_lengths", Some(lengths.clone()), batch, queries_len);
        (lengths, host)
    });
    let key_lengths = key_lengths.map(|lengths| {
        let host = host_lengths("key_lengths", Some(lengths.clone()), batch, keys_len);
        if let Some(b) = host.iter().position(|&n| n == 0) {
            panic!("key_lengths[{b}] = 0: every sequence needs at least one key");
        }
        host
    });

    let query_padding = query_lengths
        .as_ref()
        .filter(|(_, host)| host.iter().any(|&n| n < queries_len))
        .map(|(_, host)| {
            padding_mask::<B>(host, queries_len, &device).reshape([batch, 1, queries_len, 1])
        });
    let key_padding = key_lengths
        .as_ref()
        .filter(|host| host.iter().any(|&n| n < keys_len))
        .map(|host| padding_mask::<B>(host, keys_len, &device).reshape([batch, 1, 1, keys_len]));
    let key_lengths = key_lengths.map(|host| {
        Tensor::<B, 1, Int>::from_data(
            TensorData::new(host.iter().map(|&n| n as i64).collect(), [batch]),
            &device,
        )
        .reshape([batch, 1, 1, 1])
    });

    Checked {
        scale: options.scale.unwrap_or(1.0 / (dim as f64).sqrt()),
        query_lengths: query_lengths.map(|(lengths, _)| lengths),
        query_padding,
        key_padding,
        key_lengths,
    }
}

/// `[batch, len]`, true at positions `≥ lengths[batch]`.
fn padding_mask<B: Backend>(
    lengths: &[usize],
    len: usize,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let mask: Vec<bool> = lengths
        .iter()
        .flat_map(|&n| (0..len).map(move |i| i >= n))
        .collect();
    Tensor::from_data(TensorData::new(mask, [lengths.len(), len]), device)
}

impl<B: Backend> Checked<B> {
    /// Fills the scores of padded keys with `-inf`. `scores`: `[batch, heads, rows, S]`.
    pub fn mask_keys(&self, scores: Tensor<B, 4>) -> Tensor<B, 4> {
        match &self.key_padding {
            Some(mask) => {
                let shape = scores.dims();
                scores.mask_fill(mask.clone().expand(shape), f32::NEG_INFINITY)
            }
            None => scores,
        }
    }

    /// The `[batch]` key lengths, `None` when no key length was given.
    pub fn batch_key_lengths(&self) -> Option<Tensor<B, 1, Int>> {
        self.key_lengths.clone().map(|lengths| {
            let [batch, ..] = lengths.dims();
            lengths.reshape([batch])
        })
    }

    /// Zeroes the rows of padded queries. `x`: `[batch, heads, L, F]`.
    pub fn zero_padded_queries(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        match &self.query_padding {
            Some(mask) => {
                let shape = x.dims();
                x.mask_fill(mask.clone().expand(shape), 0.0)
            }
            None => x,
        }
    }
}

/// `[batch, heads, len]` Int, `positions[b, h, i] = i`.
pub(crate) fn positions<B: Backend>(
    batch: usize,
    heads: usize,
    len: usize,
    device: &B::Device,
) -> Tensor<B, 3, Int> {
    Tensor::<B, 1, Int>::arange(0..len as i64, device)
        .reshape([1, 1, len])
        .expand([batch, heads, len])
}

/// Indices of the `k = min(topk, S)` highest scores of every row, `[batch, heads, rows, k]`
/// (no gradient); all keys in order when `k = S`, since Burn's `topk` needs `k < S`.
pub(crate) fn top_keys<B: ClusteringBackend>(
    scores: Tensor<B, 4>,
    topk: usize,
) -> Tensor<B, 4, Int> {
    let [batch, heads, rows, keys_len] = scores.dims();
    let k = topk.min(keys_len);
    if k == keys_len {
        Tensor::<B, 1, Int>::arange(0..k as i64, &scores.device())
            .reshape([1, 1, 1, k])
            .expand([batch, heads, rows, k])
    } else {
        topk_indices(scores.detach(), k)
    }
}

/// Dropout on attention weights, active only when autodiff is enabled (as `burn::nn::Dropout`).
pub(crate) fn dropout<B: Backend, const D: usize>(x: Tensor<B, D>, prob: f64) -> Tensor<B, D> {
    if prob == 0.0 {
        return x;
    }
    DropoutConfig::new(prob).init().forward(x)
}

/// `1 / count` of each cluster's members (1 for an empty cluster): `counts` `[batch, heads, C]`
/// → `[batch, heads, C, 1]` in `dtype`. The counts go to `f32` directly (in f16 a count above
/// 65504 would be infinite, in bf16 one above 256 inexact), and only 1 / count is rounded to
/// `dtype`.
pub(crate) fn inverse_counts<B: Backend>(counts: Tensor<B, 3, Int>, dtype: DType) -> Tensor<B, 4> {
    let counts = counts.cast(FloatDType::F32).clamp_min(1.0);
    Tensor::<B, 3>::ones(counts.dims(), (&counts.device(), DType::F32))
        .div(counts)
        .cast(dtype)
        .unsqueeze_dim::<4>(3)
}

/// The clustering of a batch in the form the sparse products take: each query's cluster as a
/// one-entry "top-k" (`identity[b, h, j, 0] = j`) with unit weights, so that summing the
/// queries of each cluster is a [`sparse_scatter`] and handing each query its cluster's row is
/// a [`sparse_weighted_sum`]. Both skip padded queries (assignment `-1`).
pub(crate) struct Grouping<B: Backend> {
    pub assignments: Tensor<B, 3, Int>,
    counts: Tensor<B, 3, Int>,
    identity: Tensor<B, 4, Int>,
    ones: Tensor<B, 4>,
}

impl<B: ClusteringBackend> Grouping<B> {
    pub fn new(clusters: Clusters<B>, queries: &Tensor<B, 4>) -> Self {
        let [batch, heads, len, _] = queries.dims();
        let [_, _, num_clusters] = clusters.counts.dims();
        let device = queries.device();
        let identity = Tensor::<B, 1, Int>::arange(0..num_clusters as i64, &device)
            .reshape([1, 1, num_clusters, 1])
            .expand([batch, heads, num_clusters, 1]);
        Self {
            identity,
            ones: Tensor::ones([batch, heads, len, 1], (&device, queries.dtype())),
            assignments: clusters.assignments,
            counts: clusters.counts,
        }
    }

    /// Centroids of the clusters, the mean of their member queries (paper eq. 3).
    ///
    /// `queries`: `[batch, heads, L, E]` → `[batch, heads, C, E]` (zero for an empty cluster).
    pub fn centroids(&self, queries: Tensor<B, 4>) -> Tensor<B, 4> {
        let [_, _, clusters] = self.counts.dims();
        let sums = sparse_scatter(
            self.ones.clone(),
            queries,
            self.identity.clone(),
            self.assignments.clone(),
            clusters,
        );
        // Multiply by 1 / count, a constant: the backward of a division goes through
        // `recip`, which NdArray's SIMD path computes to only ~12 bits.
        let inverse_counts = inverse_counts(self.counts.clone(), sums.dtype());
        sums * inverse_counts
    }

    /// `[batch, heads, C]`, `rows[b, h, j] = j`: assignments that make each cluster its own
    /// "query", for sparse products over the clusters' top-k keys.
    pub fn cluster_rows(&self) -> Tensor<B, 3, Int> {
        let [batch, heads, clusters, _] = self.identity.dims();
        self.identity.clone().reshape([batch, heads, clusters])
    }

    /// Each query's cluster row (paper eq. 6), zero for padded queries.
    ///
    /// `x`: `[batch, heads, C, F]` → `[batch, heads, L, F]`.
    pub fn broadcast(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        sparse_weighted_sum(
            self.ones.clone(),
            x,
            self.identity.clone(),
            self.assignments.clone(),
        )
    }
}
