//! The CPU backends (NdArray, Flex): host loops for every op of
//! [`ClusteredAttentionBackend`](crate::ops::ClusteredAttentionBackend) and
//! [`ClusteredAttentionBackward`](crate::ops::ClusteredAttentionBackward), compiled for the CPU's
//! vector instructions, one file per op family.
//!
//! - `access.rs`: [`HostAccess`], the backends' tensors borrowed as `f32` slices, and the
//!   reads and writes of the host ops.
//! - `parallel.rs`: the work split over rayon's global pool.
//! - `gemm.rs`: matrix products with the `gemm` crate.
//! - `simd.rs`: the vector loops (dot products, softmax, top-k, gathers and scatters), each
//!   compiled for AVX-512, AVX2 + FMA and the baseline; [`simd_level`] says which one runs,
//!   and the environment variable [`SIMD_ENV`] caps it.
//! - `activation.rs`: [`activation_dropout`].
//! - `hash.rs`: [`lsh_hash`]; `kmeans.rs`: [`hamming_kmeans`]; `softmax.rs`:
//!   [`attention_softmax`]; `topk.rs`: [`topk_indices`].
//! - `centroid.rs`: [`centroid_attention`] and its backward; `top.rs`: [`top_attention`] and
//!   its backward; `improved.rs`: [`improved_attention_forward`] and
//!   [`improved_attention_backward`].
//! - `sparse.rs`: [`sparse_dot`], [`sparse_weighted_sum`], [`sparse_scatter`].
//!
//! The tensors already live in host memory on these backends, so each op borrows its float
//! inputs (copying only non-contiguous ones), runs loops — the projections of four queries on
//! all hash planes at once, for the K-means vector popcounts over sixteen codes (AVX-512) or
//! per-byte distance tables (elsewhere), a vectorised `exp` for the softmax, a single pass with
//! a small sorted buffer for the top-k, per-cluster blocks of gathered keys for the sparse
//! products and the per-query top-k attention, and the `gemm` crate's products for the
//! centroid attention — split over rows on rayon's global pool (the one the backends use), and
//! writes the result back with the backend's `float_from_data` and `int_from_data` (the integers
//! in the device's int dtype: `i64` on NdArray, `i32` on Flex, unless the device is configured
//! otherwise). They reproduce the default bodies
//! ([`crate::ops::reference`]): bit for bit for the integer outputs, to rounding for the float
//! ones. Float ops compute and accumulate in `f32`: `f16` and `bf16` inputs are widened on the
//! way in and the results rounded to the input's dtype on the way out; `f64` inputs fall back
//! to the default bodies.
//!
//! A CPU backend of one's own gets them by implementing [`HostAccess`] and calling these
//! functions from its `ClusteredAttentionBackend` and `ClusteredAttentionBackward` methods.

mod access;
mod activation;
mod centroid;
mod gemm;
mod hash;
mod improved;
mod kmeans;
mod parallel;
mod simd;
mod softmax;
mod sparse;
mod top;
mod topk;

pub use access::HostAccess;
pub use activation::activation_dropout;
pub use centroid::{centroid_attention, centroid_attention_backward};
pub use hash::lsh_hash;
pub use improved::{improved_attention_backward, improved_attention_forward};
pub use kmeans::hamming_kmeans;
pub use simd::{SIMD_ENV, SimdLevel, simd_level};
pub use softmax::attention_softmax;
pub use sparse::{sparse_dot, sparse_scatter, sparse_weighted_sum};
pub use top::{top_attention, top_attention_backward};
pub use topk::topk_indices;

/// Implements [`ClusteredAttentionBackend`](crate::ops::ClusteredAttentionBackend) (`backend`)
/// and [`ClusteredAttentionBackward`](crate::ops::ClusteredAttentionBackward) (`backward`) with
/// the host ops.
#[cfg(any(feature = "ndarray", feature = "flex"))]
macro_rules! host_ops {
    (backend) => {
        fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
            $crate::backends::cpu::lsh_hash::<Self>(queries, planes)
        }

        fn attention_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
            $crate::backends::cpu::attention_softmax::<Self>(x)
        }

        fn activation_dropout(
            x: FloatTensor<Self>,
            dropout: AttentionDropout,
            stream: u32,
        ) -> FloatTensor<Self> {
            $crate::backends::cpu::activation_dropout::<Self>(x, dropout, stream)
        }

        fn hamming_kmeans(
            codes: IntTensor<Self>,
            query_lengths: Lengths<Self>,
            clusters: usize,
            iterations: usize,
            seed: u64,
        ) -> (IntTensor<Self>, IntTensor<Self>) {
            $crate::backends::cpu::hamming_kmeans::<Self>(
                codes,
                query_lengths.into_option(),
                clusters,
                iterations,
                seed,
            )
        }

        fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
            $crate::backends::cpu::topk_indices::<Self>(scores, k)
        }

        fn centroid_attention(
            centroids: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            key_lengths: Lengths<Self>,
            topk: usize,
            dropout: Option<AttentionDropout>,
        ) -> (
            FloatTensor<Self>,
            Option<(IntTensor<Self>, FloatTensor<Self>)>,
        ) {
            let attention = $crate::backends::cpu::centroid_attention::<Self>(
                centroids,
                keys,
                values,
                key_lengths.into_option(),
                topk,
                dropout,
            );
            (attention.values, attention.top)
        }

        fn top_attention(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: ClusterTop<Self>,
            key_lengths: Lengths<Self>,
            scale: f64,
            dropout: Option<AttentionDropout>,
        ) -> FloatTensor<Self> {
            $crate::backends::cpu::top_attention::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths.into_option(),
                scale,
                dropout,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn improved_attention(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: QueryClusters<Self>,
            key_lengths: Lengths<Self>,
            topk: usize,
            scale: f64,
            dropout: Option<AttentionDropout>,
        ) -> FloatTensor<Self> {
            $crate::backends::cpu::improved_attention_forward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths.into_option(),
                topk,
                scale,
                dropout,
            )
            .0
        }

        fn sparse_dot(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            topk: IntTensor<Self>,
            assignments: IntTensor<Self>,
        ) -> FloatTensor<Self> {
            $crate::backends::cpu::sparse_dot::<Self>(queries, keys, topk, assignments)
        }

        fn sparse_weighted_sum(
            weights: FloatTensor<Self>,
            values: FloatTensor<Self>,
            topk: IntTensor<Self>,
            assignments: IntTensor<Self>,
        ) -> FloatTensor<Self> {
            $crate::backends::cpu::sparse_weighted_sum::<Self>(weights, values, topk, assignments)
        }

        fn sparse_scatter(
            weights: FloatTensor<Self>,
            x: FloatTensor<Self>,
            topk: IntTensor<Self>,
            assignments: IntTensor<Self>,
            keys_len: usize,
        ) -> FloatTensor<Self> {
            $crate::backends::cpu::sparse_scatter::<Self>(weights, x, topk, assignments, keys_len)
        }
    };
    (backward) => {
        fn centroid_attention_forward(
            centroids: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            key_lengths: Lengths<Self>,
            topk: usize,
            dropout: Option<AttentionDropout>,
        ) -> CentroidAttention<Self> {
            $crate::backends::cpu::centroid_attention::<Self>(
                centroids,
                keys,
                values,
                key_lengths.into_option(),
                topk,
                dropout,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn centroid_attention_backward(
            centroids: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            key_lengths: Lengths<Self>,
            forward: CentroidAttention<Self>,
            grad_values: FloatTensor<Self>,
            grad_top_weights: Option<FloatTensor<Self>>,
            dropout: Option<AttentionDropout>,
        ) -> CentroidAttentionGrads<Self> {
            $crate::backends::cpu::centroid_attention_backward::<Self>(
                centroids,
                keys,
                values,
                key_lengths.into_option(),
                forward,
                grad_values,
                grad_top_weights,
                dropout,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn top_attention_backward(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: ClusterTop<Self>,
            key_lengths: Lengths<Self>,
            scale: f64,
            grad: FloatTensor<Self>,
            dropout: Option<AttentionDropout>,
        ) -> TopAttentionGrads<Self> {
            $crate::backends::cpu::top_attention_backward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths.into_option(),
                scale,
                grad,
                dropout,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn improved_attention_forward(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: QueryClusters<Self>,
            key_lengths: Lengths<Self>,
            topk: usize,
            scale: f64,
            dropout: Option<AttentionDropout>,
        ) -> (FloatTensor<Self>, ImprovedForward<Self>) {
            $crate::backends::cpu::improved_attention_forward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths.into_option(),
                topk,
                scale,
                dropout,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn improved_attention_backward(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: QueryClusters<Self>,
            key_lengths: Lengths<Self>,
            scale: f64,
            forward: ImprovedForward<Self>,
            grad: FloatTensor<Self>,
            dropout: Option<AttentionDropout>,
        ) -> AttentionGrads<Self> {
            $crate::backends::cpu::improved_attention_backward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths.into_option(),
                scale,
                forward,
                grad,
                dropout,
            )
        }
    };
}

// Both traits on each CPU backend of the build, by the host ops above. `burn-ndarray` is
// deprecated in Burn 0.22 (for Flex); its backend is still supported here.
#[cfg(any(feature = "ndarray", feature = "flex"))]
#[allow(deprecated)]
mod impls {
    use burn::backend::tensor::{FloatTensor, IntTensor};

    use crate::dropout::AttentionDropout;
    use crate::ops::{
        AttentionGrads, CentroidAttention, CentroidAttentionGrads, ClusterTop,
        ClusteredAttentionBackend, ClusteredAttentionBackward, ImprovedForward, Lengths,
        QueryClusters, TopAttentionGrads,
    };

    #[cfg(feature = "ndarray")]
    impl ClusteredAttentionBackend for burn::backend::NdArray {
        host_ops!(backend);
    }

    #[cfg(feature = "ndarray")]
    impl ClusteredAttentionBackward for burn::backend::NdArray {
        host_ops!(backward);
    }

    #[cfg(feature = "flex")]
    impl ClusteredAttentionBackend for burn::backend::Flex {
        host_ops!(backend);
    }

    #[cfg(feature = "flex")]
    impl ClusteredAttentionBackward for burn::backend::Flex {
        host_ops!(backward);
    }
}
