//! The backend extension trait, [`ClusteredAttentionBackend`]: the clustering ops, the fused
//! attention ops and the sparse top-k products of clustered attention, with default bodies
//! that serve every Burn backend, and the tensor-level functions that call it.
//!
//! - `backend.rs`: the extension trait and [`ClusteredAttentionBackward`], the backward passes
//!   that `Autodiff<B>` asks of `B`.
//! - `conversion.rs`: [`TensorConversion`], a backend's primitives as [`Tensor`]s and back.
//! - `types.rs`: the structs its ops take and return ([`CentroidAttention`], [`ClusterTop`],
//!   [`Lengths`], …).
//! - `checks.rs`: the argument checks every backend shares (shapes, bits, top-k, lengths).
//! - `seeding.rs`: the initial K-means centroids, drawn on the host for every backend.
//! - `grouping.rs`: which query belongs to which cluster, as the sparse products take it.
//! - `tensor.rs`: the ops on [`Tensor`]s, the crate's tensor-level API, each a call of
//!   `Dispatch`'s implementation of the trait, which runs the tensors' backend's.
//! - [`reference`](mod@reference): the default bodies, one file per op family; the specification.
//!
//! Clustered attention (Vyas et al., 2020, §3.2.2) groups the queries in two steps:
//! [`lsh_hash`](ClusteredAttentionBackend::lsh_hash) turns each query into a `bits`-bit code
//! with random hyperplanes, and [`hamming_kmeans`](ClusteredAttentionBackend::hamming_kmeans)
//! runs Lloyd's algorithm on those codes in Hamming space. Both produce integer tensors and
//! carry no gradient.
//!
//! Improved clustered attention (§3.3) also needs, per cluster, the `k` keys with the highest
//! centroid attention ([`topk_indices`](ClusteredAttentionBackend::topk_indices)) and two
//! *sparse* products of every query with its cluster's top-k keys and values (eqs. 10–11):
//! [`sparse_dot`](ClusteredAttentionBackend::sparse_dot),
//! [`sparse_weighted_sum`](ClusteredAttentionBackend::sparse_weighted_sum) and their transpose
//! [`sparse_scatter`](ClusteredAttentionBackend::sparse_scatter). The three are
//! differentiable, and the gradient of each is made of the other two, so `Autodiff<B>`
//! differentiates them with `B`'s own implementations. Everything else (centroids, softmax,
//! broadcast) is ordinary Burn tensor ops in [`crate::attention`].
//!
//! The attentions call two fused ops instead (with the attention-weight dropout inside them,
//! [`crate::dropout::AttentionDropout`]):
//! [`centroid_attention`](ClusteredAttentionBackend::centroid_attention) (eqs. 4–5 and 9: the
//! clusters' scores, top-k, softmax and `Aᶜ V`) and
//! [`top_attention`](ClusteredAttentionBackend::top_attention) (eqs. 10–11: each query's
//! top-k scores, softmax, weighted sum and its cluster's rest). Their default bodies compose
//! the ops above; the CPU backends override them so that no `[C, S]` or `[L, k]` tensor is
//! built. `Autodiff<B>` runs `B`'s fused ops forward (the centroid attention through
//! [`centroid_attention_forward`](ClusteredAttentionBackward::centroid_attention_forward)) and
//! differentiates them with
//! [`centroid_attention_backward`](ClusteredAttentionBackward::centroid_attention_backward)
//! and [`top_attention_backward`](ClusteredAttentionBackward::top_attention_backward), which
//! recompute the `[C, S]` and `[L, k]` softmax instead of keeping it. Improved clustered
//! attention calls them through
//! [`improved_attention`](ClusteredAttentionBackend::improved_attention) (the centroids, both
//! fused ops and the mass), which `Autodiff<B>` records as one node, run forward by
//! [`improved_attention_forward`](ClusteredAttentionBackward::improved_attention_forward) and
//! differentiated by
//! [`improved_attention_backward`](ClusteredAttentionBackward::improved_attention_backward):
//! the CPU backends add the two ops' gradients of the keys and values, and the centroids'
//! share of the queries', in place.
//!
//! Every method has a default body made of Burn tensor ops ([`reference`](mod@reference)), so every
//! backend works with `impl ClusteredAttentionBackend for MyBackend {}` (and
//! `impl ClusteredAttentionBackward for MyBackend {}` under `Autodiff`), given
//! [`TensorConversion`]; `Dispatch` reaches the backends its `#[backend_extension]` attribute
//! lists (NdArray, Flex, `Cube`, and `Autodiff` of each). The CPU backends (NdArray, Flex)
//! override them with multi-threaded host loops ([`crate::backends::cpu`]), the CubeCL backend
//! (WGPU, Vulkan, CUDA, with Burn's fusion) with CubeCL kernels that keep every step on the
//! device; the default bodies are the specification: codes, assignments and counts must be
//! reproduced bit for bit, top-k sets up to ties, the sparse products up to rounding.
//!
//! [`Tensor`]: burn::tensor::Tensor

mod backend;
pub(crate) mod checks;
mod conversion;
pub(crate) mod grouping;
pub mod reference;
mod seeding;
pub(crate) mod tensor;
mod types;

pub use backend::{ClusteredAttentionBackend, ClusteredAttentionBackward};
pub use conversion::TensorConversion;
pub use seeding::initial_centroid_positions;
pub(crate) use tensor::hamming_kmeans_host;
pub use tensor::{
    activation_dropout, attention_dropout_factors, attention_softmax, centroid_attention,
    hamming_kmeans, improved_attention, lsh_hash, recompute, score_products, sparse_dot,
    sparse_scatter, sparse_weighted_sum, top_attention, topk_indices,
};
pub use types::{
    AttentionGrads, CentroidAttention, CentroidAttentionGrads, ClusterTop, Clusters,
    ImprovedForward, Lengths, QueryClusters, ScoreProducts, TopAttentionGrads,
};

/// Largest number of hash bits: codes are read as `u32` (WGSL has no 64-bit integers).
pub const MAX_BITS: usize = 32;

/// Marker stored in `assignments` for a padded query (position ≥ its sequence's length).
pub const NO_CLUSTER: i64 = -1;
