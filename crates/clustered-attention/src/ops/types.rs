//! The structs and enums the ops of [`ClusteredAttentionBackend`] and
//! [`ClusteredAttentionBackward`] take and return.

use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, ExtensionType};
use burn::tensor::{Int, Tensor};

#[cfg(doc)]
use super::{ClusteredAttentionBackend, ClusteredAttentionBackward, NO_CLUSTER};

/// The result of clustering the queries of every `(batch, head)`.
#[derive(Debug, Clone)]
pub struct Clusters {
    /// Cluster of each query, `[batch, heads, L]`, in `0..C`; `-1` for padded queries.
    pub assignments: Tensor<3, Int>,
    /// Number of valid queries in each cluster, `[batch, heads, C]`.
    pub counts: Tensor<3, Int>,
}

/// The valid lengths of a batch's sequences, as the ops of [`ClusteredAttentionBackend`] take
/// them: every position valid ([`Lengths::All`]) or a `[batch]` int tensor of lengths
/// ([`Lengths::Given`], or [`Lengths::Known`] with a host copy of its values). The ops' `Option`
/// of a lengths tensor, in a form that crosses the `Dispatch` boundary.
#[derive(ExtensionType, Debug, Clone)]
pub enum Lengths<B: Backend> {
    /// Every position of every sequence is valid.
    All,
    /// `[batch]`: the number of valid positions of each sequence (the first ones).
    Given(IntTensor<B>),
    /// `[batch]` lengths as [`Lengths::Given`], with their values already on the host (one per
    /// sequence, equal to the tensor's): an op that needs them there (the CubeCL K-means draws
    /// its initial centroids on the host) takes `host` instead of reading the tensor back, which
    /// on a GPU would wait for the device. The caller vouches that the two agree.
    Known {
        /// `[batch]`: the number of valid positions of each sequence.
        lengths: IntTensor<B>,
        /// The same values on the host.
        host: Vec<usize>,
    },
}

impl<B: Backend> Lengths<B> {
    /// The lengths tensor, `None` for [`Lengths::All`].
    pub fn into_option(self) -> Option<IntTensor<B>> {
        match self {
            Self::All => None,
            Self::Given(lengths) | Self::Known { lengths, .. } => Some(lengths),
        }
    }

    /// A reference to the lengths tensor, `None` for [`Lengths::All`].
    pub fn as_option(&self) -> Option<&IntTensor<B>> {
        match self {
            Self::All => None,
            Self::Given(lengths) | Self::Known { lengths, .. } => Some(lengths),
        }
    }

    /// The host copy of the lengths of [`Lengths::Known`], `None` otherwise.
    pub fn host(&self) -> Option<&[usize]> {
        match self {
            Self::Known { host, .. } => Some(host),
            _ => None,
        }
    }

    /// The same lengths with the tensor mapped by `f` (to another backend's type), the host
    /// copy kept.
    pub fn map<C: Backend>(self, f: impl FnOnce(IntTensor<B>) -> IntTensor<C>) -> Lengths<C> {
        match self {
            Self::All => Lengths::All,
            Self::Given(lengths) => Lengths::Given(f(lengths)),
            Self::Known { lengths, host } => Lengths::Known {
                lengths: f(lengths),
                host,
            },
        }
    }
}

impl<B: Backend> From<Option<IntTensor<B>>> for Lengths<B> {
    /// [`Lengths::Given`] of the tensor, [`Lengths::All`] for `None`.
    fn from(lengths: Option<IntTensor<B>>) -> Self {
        match lengths {
            Some(lengths) => Self::Given(lengths),
            None => Self::All,
        }
    }
}

/// The result of [`ClusteredAttentionBackward::centroid_attention_forward`]: the outputs of
/// [`ClusteredAttentionBackend::centroid_attention`] and, where the backend computes it, the
/// log-sum-exp its backward pass takes.
pub struct CentroidAttention<B: Backend> {
    /// `Aᶜ · values` (paper eq. 5), over the keys outside each row's top-k when `top` is
    /// given (eq. 10, second case), `[batch, heads, C, D]`.
    pub values: FloatTensor<B>,
    /// With `topk > 0`: the `[batch, heads, C, topk]` indices of each cluster's top-k keys in
    /// descending order of score, and the `[batch, heads, C, topk]` weights `Aᶜ` at them (their
    /// sum is the mass `m̂` of paper eq. 9).
    pub top: Option<(IntTensor<B>, FloatTensor<B>)>,
    /// Where the op computes it (the host loops of the CPU backends): each row's log-sum-exp
    /// of the scores, `log Σ_l e^(centroids_j · keys_l)` over the valid keys,
    /// `[batch, heads, C, 1]` in `f32`, so that the backward pass has `Aᶜ` from one product.
    pub log_sum_exp: Option<FloatTensor<B>>,
}

impl<B: Backend> CentroidAttention<B> {
    /// The clusters' share of improved attention that this centroid attention gives: its top-k
    /// keys and its rest, with the queries' `assignments` and the clusters' `mass` (paper
    /// eqs. 9–10).
    ///
    /// # Panics
    /// If it has no top-k (`topk = 0`).
    pub(crate) fn cluster_top(
        &self,
        assignments: IntTensor<B>,
        mass: FloatTensor<B>,
    ) -> ClusterTop<B> {
        let (topk, _) = self.top.as_ref().expect("improved attention has the top-k");
        ClusterTop {
            assignments,
            topk: topk.clone(),
            mass,
            rest: self.values.clone(),
        }
    }
}

/// The gradients of [`ClusteredAttentionBackend::centroid_attention`] with respect to its inputs,
/// each of its input's shape ([`ClusteredAttentionBackward::centroid_attention_backward`]).
pub struct CentroidAttentionGrads<B: Backend> {
    /// `[batch, heads, C, E]`.
    pub centroids: FloatTensor<B>,
    /// `[batch, heads, S, E]`.
    pub keys: FloatTensor<B>,
    /// `[batch, heads, S, D]`.
    pub values: FloatTensor<B>,
}

/// Each cluster's share of improved clustered attention that its member queries use: the
/// input of [`ClusteredAttentionBackend::top_attention`] (paper eqs. 9–10).
#[derive(ExtensionType, Debug, Clone)]
pub struct ClusterTop<B: Backend> {
    /// `[batch, heads, L]`: each query's cluster, in `0..C`, or [`NO_CLUSTER`] for a padded
    /// query.
    pub assignments: IntTensor<B>,
    /// `[batch, heads, C, k]`: each cluster's top-k keys, distinct within a row, in `0..S`.
    pub topk: IntTensor<B>,
    /// `[batch, heads, C, 1]`: the centroid attention mass `m̂` of the top-k keys (eq. 9).
    pub mass: FloatTensor<B>,
    /// `[batch, heads, C, D]`: `Aᶜ V` over the keys outside the top-k (eq. 10, second case).
    pub rest: FloatTensor<B>,
}

/// The gradients of [`ClusteredAttentionBackend::top_attention`] with respect to its float inputs,
/// each of its input's shape ([`ClusteredAttentionBackward::top_attention_backward`]).
pub struct TopAttentionGrads<B: Backend> {
    /// `[batch, heads, L, E]`.
    pub queries: FloatTensor<B>,
    /// `[batch, heads, S, E]`.
    pub keys: FloatTensor<B>,
    /// `[batch, heads, S, D]`.
    pub values: FloatTensor<B>,
    /// `[batch, heads, C, 1]`: of [`ClusterTop::mass`].
    pub mass: FloatTensor<B>,
    /// `[batch, heads, C, D]`: of [`ClusterTop::rest`].
    pub rest: FloatTensor<B>,
}

/// The clustering of the queries that [`ClusteredAttentionBackend::improved_attention`] takes.
#[derive(ExtensionType, Debug, Clone)]
pub struct QueryClusters<B: Backend> {
    /// `[batch, heads, L]`: each query's cluster, in `0..C`, or [`NO_CLUSTER`] for a padded
    /// query.
    pub assignments: IntTensor<B>,
    /// `[batch, heads, C, 1]`: `1 / count` of each cluster's member queries, in the queries'
    /// float type (any value for an empty cluster, which has no members to scale).
    pub inverse_counts: FloatTensor<B>,
}

/// The intermediate results of [`ClusteredAttentionBackend::improved_attention`] that its backward
/// pass takes ([`ClusteredAttentionBackward::improved_attention_forward`]).
pub struct ImprovedForward<B: Backend> {
    /// `[batch, heads, C, E]`: the scaled centroids.
    pub centroids: FloatTensor<B>,
    /// Their [`ClusteredAttentionBackward::centroid_attention_forward`] with the top-k keys.
    pub centroid_attention: CentroidAttention<B>,
    /// `[batch, heads, C, 1]`: the mass `m̂` of each cluster's top-k keys (eq. 9).
    pub mass: FloatTensor<B>,
}

/// The gradients of an attention with respect to its queries, keys and values, each of its
/// input's shape ([`ClusteredAttentionBackward::improved_attention_backward`]).
pub struct AttentionGrads<B: Backend> {
    /// `[batch, heads, L, E]`.
    pub queries: FloatTensor<B>,
    /// `[batch, heads, S, E]`.
    pub keys: FloatTensor<B>,
    /// `[batch, heads, S, D]`.
    pub values: FloatTensor<B>,
}

/// How a backend's fused attention kernels compute the scores, `centroids · keysᵀ` in
/// [`ClusteredAttentionBackend::centroid_attention`] and `queries · keysᵀ` over each cluster's
/// top-k keys in [`ClusteredAttentionBackend::top_attention`], in a given float type on a
/// given device ([`score_products`](super::score_products)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ScoreProducts {
    /// Multiply-adds in `f32`, one score per unit: the CubeCL kernels of every backend by
    /// default, and the host loops, the default bodies and whatever products they call.
    MultiplyAdd,
    /// Cooperative matrix multiply-accumulate (CubeCL `cmma`: tensor cores on CUDA,
    /// `VK_KHR_cooperative_matrix` on Vulkan): `m × k` tiles of the inputs in the float type
    /// times `k × n` tiles into `m × n` tiles of `f32` sums. Only with the crate's `cmma`
    /// feature, in `f16` and `bf16`, where the device reports the tile shape.
    Cmma {
        /// Rows of a tile of the scores (queries or centroids).
        m: usize,
        /// Columns of a tile of the scores (keys).
        n: usize,
        /// The depth of one product (features of a query and a key).
        k: usize,
    },
}

impl std::fmt::Display for ScoreProducts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::MultiplyAdd => write!(f, "multiply-add"),
            Self::Cmma { m, n, k } => write!(f, "cmma {m}×{n}×{k}"),
        }
    }
}
