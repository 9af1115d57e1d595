//! [`Fusion`] (`burn::backend::Wgpu`, `Cuda`): hashing, K-means, the top-k and the sparse
//! products are registered as custom operations that run the inner backend's kernels when the
//! fusion stream executes, as burn-vision does for its ops. The softmax keeps its default
//! body, which fuses.

use core::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use crate::ClusteredAttentionBackend;
use crate::ops::checks::{check_planes, check_topk};

type Handles<B> =
    HandleContainer<<<B as FusionBackend>::FusionRuntime as FusionRuntime>::FusionHandle>;

#[derive(Clone, Debug)]
struct LshHash<B> {
    desc: CustomOpIr,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ClusteredAttentionBackend> Operation<B::FusionRuntime> for LshHash<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let ([queries, planes], [codes]) = self.desc.as_fixed();
        let output = B::lsh_hash(
            handles.get_float_tensor::<B>(queries),
            handles.get_float_tensor::<B>(planes),
        );
        handles.register_int_tensor::<B>(&codes.id, output);
    }
}

#[derive(Clone, Debug)]
struct HammingKmeans<B> {
    desc: CustomOpIr,
    clusters: usize,
    iterations: usize,
    seed: u64,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ClusteredAttentionBackend> Operation<B::FusionRuntime>
    for HammingKmeans<B>
{
    fn execute(&self, handles: &mut Handles<B>) {
        let codes = handles.get_int_tensor::<B>(&self.desc.inputs[0]);
        let lengths = self
            .desc
            .inputs
            .get(1)
            .map(|lengths| handles.get_int_tensor::<B>(lengths));
        let (assignments, counts) =
            B::hamming_kmeans(codes, lengths, self.clusters, self.iterations, self.seed);
        let [assignments_ir, counts_ir] = [&self.desc.outputs[0], &self.desc.outputs[1]];
        handles.register_int_tensor::<B>(&assignments_ir.id, assignments);
        handles.register_int_tensor::<B>(&counts_ir.id, counts);
    }
}

#[derive(Clone, Debug)]
struct TopkIndices<B> {
    desc: CustomOpIr,
    k: usize,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ClusteredAttentionBackend> Operation<B::FusionRuntime> for TopkIndices<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let ([scores], [indices]) = self.desc.as_fixed();
        let output = B::topk_indices(handles.get_float_tensor::<B>(scores), self.k);
        handles.register_int_tensor::<B>(&indices.id, output);
    }
}

/// Which sparse product a [`SparseProduct`] runs.
#[derive(Clone, Copy, Debug)]
enum Sparse {
    Dot,
    WeightedSum,
    Scatter { keys_len: usize },
}

impl Sparse {
    /// The name of the custom operation.
    fn name(self) -> &'static str {
        match self {
            Sparse::Dot => "sparse_dot",
            Sparse::WeightedSum => "sparse_weighted_sum",
            Sparse::Scatter { .. } => "sparse_scatter",
        }
    }
}

/// A sparse product: inputs `[float, float, topk, assignments]`, one float output.
#[derive(Clone, Debug)]
struct SparseProduct<B> {
    desc: CustomOpIr,
    op: Sparse,
    _backend: PhantomData<B>,
}

impl<B: FusionBackend + ClusteredAttentionBackend> Operation<B::FusionRuntime>
    for SparseProduct<B>
{
    fn execute(&self, handles: &mut Handles<B>) {
        let ([first, second, topk, assignments], [output]) = self.desc.as_fixed();
        let first = handles.get_float_tensor::<B>(first);
        let second = handles.get_float_tensor::<B>(second);
        let topk = handles.get_int_tensor::<B>(topk);
        let assignments = handles.get_int_tensor::<B>(assignments);
        let result = match self.op {
            Sparse::Dot => B::sparse_dot(first, second, topk, assignments),
            Sparse::WeightedSum => B::sparse_weighted_sum(first, second, topk, assignments),
            Sparse::Scatter { keys_len } => {
                B::sparse_scatter(first, second, topk, assignments, keys_len)
            }
        };
        handles.register_float_tensor::<B>(&output.id, result);
    }
}

/// Registers a sparse product whose output has shape `shape` and the dtype of `first`.
fn sparse_product<B: FusionBackend + ClusteredAttentionBackend>(
    op: Sparse,
    inputs: [FloatTensor<Fusion<B>>; 2],
    topk: IntTensor<Fusion<B>>,
    assignments: IntTensor<Fusion<B>>,
    shape: Shape,
) -> FloatTensor<Fusion<B>> {
    let [first, second] = inputs;
    let client = first.client.clone();
    let streams = OperationStreams::with_inputs([&first, &second, &topk, &assignments]);
    let output = TensorIr::uninit(client.create_empty_handle(), shape, first.dtype);
    let desc = CustomOpIr::new(
        op.name(),
        &[
            first.into_ir(),
            second.into_ir(),
            topk.into_ir(),
            assignments.into_ir(),
        ],
        &[output],
    );
    client
        .register(
            streams,
            OperationIr::Custom(desc.clone()),
            SparseProduct::<B> {
                desc,
                op,
                _backend: PhantomData,
            },
        )
        .output()
}

impl<B: FusionBackend + ClusteredAttentionBackend> ClusteredAttentionBackend for Fusion<B> {
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        let [batch, heads, len, dim] = queries.shape().dims();
        let [bits, columns] = planes.shape().dims();
        check_planes([batch, heads, len, dim], [bits, columns]);
        let client = queries.client.clone();
        let streams = OperationStreams::with_inputs([&queries, &planes]);
        let codes = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, len]),
            <B::IntElem as burn::tensor::Element>::dtype(),
        );
        let desc = CustomOpIr::new("lsh_hash", &[queries.into_ir(), planes.into_ir()], &[codes]);
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                LshHash::<B> {
                    desc,
                    _backend: PhantomData,
                },
            )
            .output()
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        assert!(clusters > 0, "clusters must be at least 1, got 0");
        let [batch, heads, len] = codes.shape().dims();
        let (client, dtype) = (codes.client.clone(), codes.dtype);
        let streams = match &query_lengths {
            Some(lengths) => OperationStreams::with_inputs([&codes, lengths]),
            None => OperationStreams::with_inputs([&codes]),
        };
        let mut inputs = vec![codes.into_ir()];
        inputs.extend(query_lengths.map(|lengths| lengths.into_ir()));
        let outputs = [
            TensorIr::uninit(
                client.create_empty_handle(),
                Shape::new([batch, heads, len]),
                dtype,
            ),
            TensorIr::uninit(
                client.create_empty_handle(),
                Shape::new([batch, heads, clusters]),
                dtype,
            ),
        ];
        let desc = CustomOpIr::new("hamming_kmeans", &inputs, &outputs);
        let [assignments, counts] = client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                HammingKmeans::<B> {
                    desc,
                    clusters,
                    iterations,
                    seed,
                    _backend: PhantomData,
                },
            )
            .try_into()
            .expect("two outputs");
        (assignments, counts)
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        let [batch, heads, rows, len] = scores.shape().dims();
        check_topk(k, len);
        let client = scores.client.clone();
        let streams = OperationStreams::with_inputs([&scores]);
        let indices = TensorIr::uninit(
            client.create_empty_handle(),
            Shape::new([batch, heads, rows, k]),
            <B::IntElem as burn::tensor::Element>::dtype(),
        );
        let desc = CustomOpIr::new("topk_indices", &[scores.into_ir()], &[indices]);
        client
            .register(
                streams,
                OperationIr::Custom(desc.clone()),
                TopkIndices::<B> {
                    desc,
                    k,
                    _backend: PhantomData,
                },
            )
            .output()
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let [batch, heads, len, _] = queries.shape().dims();
        let k = topk.shape()[3];
        let shape = Shape::new([batch, heads, len, k]);
        sparse_product::<B>(Sparse::Dot, [queries, keys], topk, assignments, shape)
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let [batch, heads, len, _] = weights.shape().dims();
        let dim = values.shape()[3];
        let shape = Shape::new([batch, heads, len, dim]);
        sparse_product::<B>(
            Sparse::WeightedSum,
            [weights, values],
            topk,
            assignments,
            shape,
        )
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        let [batch, heads, _, features] = x.shape().dims();
        let shape = Shape::new([batch, heads, keys_len, features]);
        sparse_product::<B>(
            Sparse::Scatter { keys_len },
            [weights, x],
            topk,
            assignments,
            shape,
        )
    }
}
