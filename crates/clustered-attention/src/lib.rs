#![warn(missing_docs)]
#![doc = include_str!("../README.md")]
//!
//! ## Items
//!
//! - The attentions on `[batch, heads, seq, dim]` tensors, each its options with a `forward`
//!   taking an [`AttentionInput`]: [`FullAttention`], [`ClusteredAttention`],
//!   [`ImprovedClusteredAttention`], and the paper's baselines [`LshAttention`] (Reformer's
//!   lsh-X), [`SharedFullAttention`] and [`OracleTopAttention`].
//! - A multi-head layer with burn-nn's parameter layout: [`MultiHeadClusteredAttentionConfig`] →
//!   [`MultiHeadClusteredAttention`]; the attention named by [`AttentionKind`].
//! - burn-nn's transformer encoder on that layer, its fields and record paths:
//!   [`ClusteredTransformerEncoderConfig`] → [`ClusteredTransformerEncoder`].
//! - The clustering: [`ClusteringOptions`], [`cluster_queries`].
//! - The ops behind a backend extension trait, [`ClusteredAttentionBackend`] ([`ops`]):
//!   hashing, K-means, the fused centroid and top-k attentions and the sparse top-k products,
//!   with default bodies made of Burn tensor ops ([`ops::reference`]), so every backend works;
//!   host loops on NdArray and Flex ([`backends::cpu`]), CubeCL kernels on WGPU, Vulkan and
//!   CUDA, backward nodes on `Autodiff`. The tensor-level functions of [`ops`] take Burn's
//!   backend-free [`Tensor`](burn::tensor::Tensor)s and reach the backend of their device
//!   through Burn's `Dispatch`.
//! - What the backends share beside the trait: [`ops::TensorConversion`] (a backend's
//!   primitives to and from [`Tensor`](burn::tensor::Tensor)s, which the default bodies run
//!   on), [`ops::Lengths`] (the optional `[batch]` lengths an op takes, all positions valid or
//!   given) and [`ops::ClusteredAttentionBackward`] (the forward passes that keep what the
//!   backward needs, and the backward passes, that `Autodiff`'s nodes call on the inner
//!   backend).
//!
//! ## The crate's layout
//!
//! - `lib.rs`: this page and the re-exports.
//! - `layer.rs`: the multi-head layer; `kind.rs`: [`AttentionKind`] and its parser;
//!   `encoder.rs`: the transformer encoder.
//! - `attention/`: the functional forms, one file per attention.
//! - `clustering.rs`: [`ClusteringOptions`], the hashing planes and [`cluster_queries`].
//! - `dropout.rs`: dropout whose masks can be seeded per thread ([`with_dropout_seed`]).
//! - `recompute.rs`: a layer recomputed in the backward pass ([`recompute::RecomputedForward`]).
//! - `ops/`: the backend traits (the extension and its backward), their structs, the conversion
//!   of primitives to and from `Tensor`s, checks, tensor-level forms and default bodies.
//! - `backends/`: the trait's implementations, `cpu/`, `cube/` and `autodiff.rs`.

// The CubeCL kernels need one of Burn's CubeCL runtimes (`wgpu`, `vulkan` or `cuda`): `cmma`
// (or the internal `cube`) alone would compile them for none.
#[cfg(all(feature = "cube", not(any(feature = "wgpu", feature = "cuda"))))]
compile_error!(
    "clustered-attention: the `cmma` feature needs a CubeCL backend feature too (`wgpu`, `vulkan` or `cuda`)"
);

pub mod attention;
pub mod backends;
pub mod clustering;
pub mod dropout;
mod encoder;
mod kind;
mod layer;
pub mod ops;
pub mod recompute;

pub use attention::{
    AttentionInput, AttentionOptions, ClusteredAttention, FullAttention,
    ImprovedClusteredAttention, LshAttention, LshOptions, OracleTopAttention, SharedFullAttention,
};
pub use clustering::{
    ClusteringOptions, Clusters, QueryGrouping, cluster_queries, hamming_kmeans, lsh_hash,
    lsh_planes, position_blocks,
};
pub use dropout::with_dropout_seed;
pub use encoder::{
    ClusteredTransformerEncoder, ClusteredTransformerEncoderConfig,
    ClusteredTransformerEncoderInput, ClusteredTransformerEncoderLayer,
};
pub use kind::{AttentionKind, ParseAttentionKindError};
pub use layer::{
    ClusteredAttentionInput, MultiHeadClusteredAttention, MultiHeadClusteredAttentionConfig,
};
pub use ops::ClusteredAttentionBackend;

/// The README's examples run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
