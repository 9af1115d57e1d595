//! CPU backends: host loops for hashing, K-means, the attention softmax, top-k, the centroid
//! attention, the per-query top-k attention and the sparse products ([`crate::ops::host`]),
//! compiled for the CPU's vector instructions.

/// Implements [`ClusteringBackend`](crate::ClusteringBackend) with the host ops.
#[cfg(any(feature = "ndarray", feature = "flex"))]
macro_rules! host_ops {
    () => {
        fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
            host::lsh_hash::<Self>(queries, planes)
        }

        fn attention_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
            host::attention_softmax::<Self>(x)
        }

        fn hamming_kmeans(
            codes: IntTensor<Self>,
            query_lengths: Option<IntTensor<Self>>,
            clusters: usize,
            iterations: usize,
            seed: u64,
        ) -> (IntTensor<Self>, IntTensor<Self>) {
            host::hamming_kmeans::<Self>(codes, query_lengths, clusters, iterations, seed)
        }

        fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
            host::topk_indices::<Self>(scores, k)
        }

        fn centroid_attention(
            centroids: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            key_lengths: Option<IntTensor<Self>>,
            topk: usize,
        ) -> CentroidAttention<Self> {
            host::centroid_attention::<Self>(centroids, keys, values, key_lengths, topk)
        }

        fn top_attention(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: ClusterTop<Self>,
            key_lengths: Option<IntTensor<Self>>,
            scale: f64,
        ) -> FloatTensor<Self> {
            host::top_attention::<Self>(queries, keys, values, clusters, key_lengths, scale)
        }

        fn centroid_attention_backward(
            centroids: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            key_lengths: Option<IntTensor<Self>>,
            forward: CentroidAttention<Self>,
            grad_values: FloatTensor<Self>,
            grad_top_weights: Option<FloatTensor<Self>>,
        ) -> CentroidAttentionGrads<Self> {
            host::centroid_attention_backward::<Self>(
                centroids,
                keys,
                values,
                key_lengths,
                forward,
                grad_values,
                grad_top_weights,
            )
        }

        #[allow(clippy::too_many_arguments)]
        fn improved_attention_backward(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: QueryClusters<Self>,
            key_lengths: Option<IntTensor<Self>>,
            scale: f64,
            forward: ImprovedForward<Self>,
            grad: FloatTensor<Self>,
        ) -> AttentionGrads<Self> {
            host::improved_attention_backward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                scale,
                forward,
                grad,
            )
        }

        fn top_attention_backward(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            values: FloatTensor<Self>,
            clusters: ClusterTop<Self>,
            key_lengths: Option<IntTensor<Self>>,
            scale: f64,
            grad: FloatTensor<Self>,
        ) -> TopAttentionGrads<Self> {
            host::top_attention_backward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                scale,
                grad,
            )
        }

        fn sparse_dot(
            queries: FloatTensor<Self>,
            keys: FloatTensor<Self>,
            topk: IntTensor<Self>,
            assignments: IntTensor<Self>,
        ) -> FloatTensor<Self> {
            host::sparse_dot::<Self>(queries, keys, topk, assignments)
        }

        fn sparse_weighted_sum(
            weights: FloatTensor<Self>,
            values: FloatTensor<Self>,
            topk: IntTensor<Self>,
            assignments: IntTensor<Self>,
        ) -> FloatTensor<Self> {
            host::sparse_weighted_sum::<Self>(weights, values, topk, assignments)
        }

        fn sparse_scatter(
            weights: FloatTensor<Self>,
            x: FloatTensor<Self>,
            topk: IntTensor<Self>,
            assignments: IntTensor<Self>,
            keys_len: usize,
        ) -> FloatTensor<Self> {
            host::sparse_scatter::<Self>(weights, x, topk, assignments, keys_len)
        }
    };
}

#[cfg(feature = "ndarray")]
mod ndarray {
    use crate::ClusteringBackend;
    use crate::ops::host::{self, HostAccess};
    use crate::ops::{
        AttentionGrads, CentroidAttention, CentroidAttentionGrads, ClusterTop, ImprovedForward,
        QueryClusters, TopAttentionGrads,
    };
    use burn::backend::ndarray::{FloatNdArrayElement, IntNdArrayElement, NdArray, QuantElement};
    use burn::backend::ndarray::{NdArrayTensor, SharedArray};
    use burn::tensor::TensorMetadata;
    use burn::tensor::ops::{FloatTensor, IntTensor};

    impl<E, I, Q> HostAccess for NdArray<E, I, Q>
    where
        E: FloatNdArrayElement,
        I: IntNdArrayElement,
        Q: QuantElement,
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        /// Borrows the array when it is in standard layout (NdArray copies shared arrays
        /// element by element in `into_data`).
        fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
            match x {
                NdArrayTensor::F32(storage) => {
                    let view = storage.view();
                    match view.as_slice() {
                        Some(values) => f(values),
                        None => f(&view.iter().copied().collect::<Vec<f32>>()),
                    }
                }
                other => panic!("expected an f32 tensor, got {:?}", other.dtype()),
            }
        }

        /// Copies the array in one piece when it is in standard layout (`into_data` walks it
        /// element by element).
        fn ints_to_vec(x: IntTensor<Self>) -> Vec<i64> {
            match &x {
                NdArrayTensor::I64(storage) => {
                    if let Some(values) = storage.view().as_slice() {
                        return values.to_vec();
                    }
                }
                NdArrayTensor::I32(storage) => {
                    if let Some(values) = storage.view().as_slice() {
                        return values.iter().map(|&v| i64::from(v)).collect();
                    }
                }
                _ => {}
            }
            host::ints_through_data::<Self>(x)
        }
    }

    impl<E, I, Q> ClusteringBackend for NdArray<E, I, Q>
    where
        E: FloatNdArrayElement,
        I: IntNdArrayElement,
        Q: QuantElement,
        NdArrayTensor: From<SharedArray<E>>,
        NdArrayTensor: From<SharedArray<I>>,
    {
        host_ops!();
    }
}

#[cfg(feature = "flex")]
mod flex {
    use crate::ClusteringBackend;
    use crate::ops::host::{self, HostAccess};
    use crate::ops::{
        AttentionGrads, CentroidAttention, CentroidAttentionGrads, ClusterTop, ImprovedForward,
        QueryClusters, TopAttentionGrads,
    };
    use burn::backend::Flex;
    use burn::tensor::ops::{FloatTensor, IntTensor};
    use burn::tensor::{DType, Element, bf16, f16};

    impl HostAccess for Flex {
        /// Borrows `f32` storage when it is contiguous; widens `f16` and `bf16` into a copy.
        fn with_f32<R>(x: &FloatTensor<Self>, f: impl FnOnce(&[f32]) -> R) -> R {
            fn widened<E: Element + bytemuck::Pod>(
                x: &FloatTensor<Flex>,
                to_f32: fn(E) -> f32,
            ) -> Vec<f32> {
                match x.as_slice::<E>() {
                    Some(values) => values.iter().map(|&v| to_f32(v)).collect(),
                    None => widened(&x.to_contiguous(), to_f32),
                }
            }
            match x.dtype() {
                DType::F16 => f(&widened::<f16>(x, f16::to_f32)),
                DType::BF16 => f(&widened::<bf16>(x, bf16::to_f32)),
                _ => match x.as_slice::<f32>() {
                    Some(values) => f(values),
                    None => f(x.to_contiguous().as_slice::<f32>().expect("an f32 tensor")),
                },
            }
        }
    }

    impl ClusteringBackend for Flex {
        host_ops!();
    }
}
