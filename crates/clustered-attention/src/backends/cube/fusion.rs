//! [`Fusion`] (`burn::backend::Wgpu`, `Cuda`): hashing, K-means, the top-k, the sparse
//! products and the centroid and top-k attentions (forward and backward) are registered as
//! custom operations that run the inner backend's op when the fusion stream executes, as
//! burn-vision does for its ops. The attentions run whole on the inner backend, so Fusion never
//! sees (and never fuses) the matrix products, masks and softmaxes inside them: on CUDA, Burn's
//! fused matmul and reduce gave wrong centroid weights on those graphs. The softmax on its own
//! keeps its default body, which fuses.

use core::marker::PhantomData;

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_fusion::stream::{Operation, OperationStreams};
use burn_fusion::{Fusion, FusionBackend, FusionRuntime, FusionTensor};
use burn_ir::{CustomOpIr, HandleContainer, OperationIr, OperationOutput, TensorIr};

use crate::ClusteredAttentionBackend;
use crate::ops::checks::{
    check_centroid_attention, check_cluster_top, check_planes, check_query_clusters, check_topk,
};
use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusterTop, ImprovedForward, QueryClusters,
    ScoreProducts, TopAttentionGrads,
};

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

/// Which attention op an [`AttentionOp`] runs on the inner backend, with its inputs and outputs
/// in the order they are registered (those in brackets only when the flag says so).
#[derive(Clone, Copy, Debug)]
enum Attention {
    /// `centroids, keys, values, [key_lengths]` → `values, [top indices, top weights]`.
    Centroid { topk: usize, lengths: bool },
    /// `centroids, keys, values, [key_lengths], forward values, [top indices, top weights],
    /// grad_values, [grad_top_weights]` → the gradients of `centroids, keys, values`.
    CentroidBackward { lengths: bool, top: bool },
    /// `queries, keys, values, assignments, topk, mass, rest, [key_lengths]` → output.
    Top { scale: f64, lengths: bool },
    /// As [`Attention::Top`], then `grad` → the gradients of `queries, keys, values, mass, rest`.
    TopBackward { scale: f64, lengths: bool },
    /// `queries, keys, values, assignments, inverse_counts, [key_lengths]` → `output,
    /// centroids, rest, top weights, mass, top indices` (the output and [`ImprovedForward`]).
    Improved {
        topk: usize,
        scale: f64,
        lengths: bool,
    },
}

impl Attention {
    /// The name of the custom operation.
    fn name(self) -> &'static str {
        match self {
            Attention::Centroid { .. } => "centroid_attention",
            Attention::CentroidBackward { .. } => "centroid_attention_backward",
            Attention::Top { .. } => "top_attention",
            Attention::TopBackward { .. } => "top_attention_backward",
            Attention::Improved { .. } => "improved_attention_forward",
        }
    }
}

/// One of the attention ops, run whole by the inner backend.
#[derive(Clone, Debug)]
struct AttentionOp<B> {
    desc: CustomOpIr,
    op: Attention,
    _backend: PhantomData<B>,
}

/// Takes the inputs of a custom operation in their order of registration.
struct Inputs<'a, B: FusionBackend> {
    irs: core::slice::Iter<'a, TensorIr>,
    handles: &'a mut Handles<B>,
}

impl<B: FusionBackend> Inputs<'_, B> {
    fn next(&mut self) -> &TensorIr {
        self.irs
            .next()
            .expect("a custom operation has the inputs it was registered with")
    }
    fn float(&mut self) -> FloatTensor<B> {
        let ir = self.next().clone();
        self.handles.get_float_tensor::<B>(&ir)
    }
    fn int(&mut self) -> IntTensor<B> {
        let ir = self.next().clone();
        self.handles.get_int_tensor::<B>(&ir)
    }
    fn float_if(&mut self, present: bool) -> Option<FloatTensor<B>> {
        present.then(|| self.float())
    }
    fn int_if(&mut self, present: bool) -> Option<IntTensor<B>> {
        present.then(|| self.int())
    }
}

impl<B: FusionBackend + ClusteredAttentionBackend> Operation<B::FusionRuntime> for AttentionOp<B> {
    fn execute(&self, handles: &mut Handles<B>) {
        let outputs = &self.desc.outputs;
        let mut inputs = Inputs::<B> {
            irs: self.desc.inputs.iter(),
            handles,
        };
        let (floats, ints): (Vec<FloatTensor<B>>, Vec<IntTensor<B>>) = match self.op {
            Attention::Centroid { topk, lengths } => {
                let (centroids, keys, values) = (inputs.float(), inputs.float(), inputs.float());
                let key_lengths = inputs.int_if(lengths);
                let result = B::centroid_attention(centroids, keys, values, key_lengths, topk);
                match result.top {
                    Some((indices, weights)) => (vec![result.values, weights], vec![indices]),
                    None => (vec![result.values], vec![]),
                }
            }
            Attention::CentroidBackward { lengths, top } => {
                let (centroids, keys, values) = (inputs.float(), inputs.float(), inputs.float());
                let key_lengths = inputs.int_if(lengths);
                let forward_values = inputs.float();
                let top_pair = top.then(|| (inputs.int(), inputs.float()));
                let grad_values = inputs.float();
                let grad_top_weights = inputs.float_if(top);
                let forward = CentroidAttention {
                    values: forward_values,
                    top: top_pair,
                    log_sum_exp: None,
                };
                let grads = B::centroid_attention_backward(
                    centroids,
                    keys,
                    values,
                    key_lengths,
                    forward,
                    grad_values,
                    grad_top_weights,
                );
                (vec![grads.centroids, grads.keys, grads.values], vec![])
            }
            Attention::Improved {
                topk,
                scale,
                lengths,
            } => {
                let (queries, keys, values) = (inputs.float(), inputs.float(), inputs.float());
                let clusters = QueryClusters {
                    assignments: inputs.int(),
                    inverse_counts: inputs.float(),
                };
                let key_lengths = inputs.int_if(lengths);
                let (output, forward) = B::improved_attention_forward(
                    queries,
                    keys,
                    values,
                    clusters,
                    key_lengths,
                    topk,
                    scale,
                );
                let (indices, weights) = forward
                    .centroid_attention
                    .top
                    .expect("improved attention has the top-k");
                (
                    vec![
                        output,
                        forward.centroids,
                        forward.centroid_attention.values,
                        weights,
                        forward.mass,
                    ],
                    vec![indices],
                )
            }
            Attention::Top { scale, lengths } | Attention::TopBackward { scale, lengths } => {
                let (queries, keys, values) = (inputs.float(), inputs.float(), inputs.float());
                let clusters = ClusterTop {
                    assignments: inputs.int(),
                    topk: inputs.int(),
                    mass: inputs.float(),
                    rest: inputs.float(),
                };
                let key_lengths = inputs.int_if(lengths);
                if let Attention::Top { .. } = self.op {
                    let output =
                        B::top_attention(queries, keys, values, clusters, key_lengths, scale);
                    (vec![output], vec![])
                } else {
                    let grad = inputs.float();
                    let grads = B::top_attention_backward(
                        queries,
                        keys,
                        values,
                        clusters,
                        key_lengths,
                        scale,
                        grad,
                    );
                    (
                        vec![
                            grads.queries,
                            grads.keys,
                            grads.values,
                            grads.mass,
                            grads.rest,
                        ],
                        vec![],
                    )
                }
            }
        };
        // The outputs were registered floats first, then ints (the top indices).
        let (float_outputs, int_outputs) = outputs.split_at(floats.len());
        for (ir, tensor) in float_outputs.iter().zip(floats) {
            handles.register_float_tensor::<B>(&ir.id, tensor);
        }
        for (ir, tensor) in int_outputs.iter().zip(ints) {
            handles.register_int_tensor::<B>(&ir.id, tensor);
        }
    }
}

/// Registers an attention op with `inputs` (in [`Attention`]'s order) and outputs of the given
/// shapes and dtypes (floats first, then ints), and returns the outputs.
fn attention_op<B: FusionBackend + ClusteredAttentionBackend>(
    op: Attention,
    inputs: Vec<FusionTensor<B::FusionRuntime>>,
    outputs: Vec<(Shape, DType)>,
) -> Vec<FusionTensor<B::FusionRuntime>> {
    let client = inputs[0].client.clone();
    let streams = OperationStreams::with_inputs(&inputs);
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|tensor| tensor.into_ir()).collect();
    let desc = CustomOpIr::new(op.name(), &inputs, &outputs);
    client.register(
        streams,
        OperationIr::Custom(desc.clone()),
        AttentionOp::<B> {
            desc,
            op,
            _backend: PhantomData,
        },
    )
}

/// `(shape, dtype)` of a tensor, for an output of the same shape.
fn like(tensor: &FusionTensor<impl FusionRuntime>) -> (Shape, DType) {
    (tensor.shape(), tensor.dtype)
}

impl<B: FusionBackend + ClusteredAttentionBackend> ClusteredAttentionBackend for Fusion<B> {
    fn score_products(device: &Self::Device, dtype: DType) -> ScoreProducts {
        B::score_products(device, dtype)
    }

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

    fn centroid_attention(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Option<IntTensor<Self>>,
        topk: usize,
    ) -> CentroidAttention<Self> {
        let [batch, heads, clusters, dim] = centroids.shape().dims();
        let [_, _, keys_len, dim_v] = values.shape().dims();
        check_centroid_attention(
            [batch, heads, clusters, dim],
            keys.shape().dims(),
            [batch, heads, keys_len, dim_v],
            topk,
        );
        let float = centroids.dtype;
        let mut outputs = vec![(Shape::new([batch, heads, clusters, dim_v]), float)];
        if topk > 0 {
            let top = Shape::new([batch, heads, clusters, topk]);
            outputs.push((top.clone(), float));
            outputs.push((top, <B::IntElem as burn::tensor::Element>::dtype()));
        }
        let lengths = key_lengths.is_some();
        let mut inputs = vec![centroids, keys, values];
        inputs.extend(key_lengths);
        let mut outputs =
            attention_op::<B>(Attention::Centroid { topk, lengths }, inputs, outputs).into_iter();
        let values = outputs.next().expect("the values");
        let top = (topk > 0).then(|| {
            let weights = outputs.next().expect("the top weights");
            (outputs.next().expect("the top indices"), weights)
        });
        CentroidAttention {
            values,
            top,
            log_sum_exp: None,
        }
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
        check_centroid_attention(
            centroids.shape().dims(),
            keys.shape().dims(),
            values.shape().dims(),
            0,
        );
        assert!(
            forward.top.is_some() == grad_top_weights.is_some(),
            "forward.top and grad_top_weights must both be given or both be None"
        );
        let outputs = vec![like(&centroids), like(&keys), like(&values)];
        let (lengths, top) = (key_lengths.is_some(), forward.top.is_some());
        let mut inputs = vec![centroids, keys, values];
        inputs.extend(key_lengths);
        inputs.push(forward.values);
        if let Some((indices, weights)) = forward.top {
            inputs.extend([indices, weights]);
        }
        inputs.push(grad_values);
        inputs.extend(grad_top_weights);
        let [centroids, keys, values] = attention_op::<B>(
            Attention::CentroidBackward { lengths, top },
            inputs,
            outputs,
        )
        .try_into()
        .expect("three gradients");
        CentroidAttentionGrads {
            centroids,
            keys,
            values,
        }
    }

    fn top_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: ClusterTop<Self>,
        key_lengths: Option<IntTensor<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        // Checked where the call is made, not when the stream runs it.
        check_cluster_top::<Self>(&queries, &keys, &values, &clusters);
        let [batch, heads, len, _] = queries.shape().dims();
        let dim_v = values.shape()[3];
        let outputs = vec![(Shape::new([batch, heads, len, dim_v]), queries.dtype)];
        let lengths = key_lengths.is_some();
        let mut inputs = top_inputs(queries, keys, values, clusters);
        inputs.extend(key_lengths);
        let [output] = attention_op::<B>(Attention::Top { scale, lengths }, inputs, outputs)
            .try_into()
            .expect("one output");
        output
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
        // Checked where the call is made, not when the stream runs it.
        check_cluster_top::<Self>(&queries, &keys, &values, &clusters);
        let outputs = vec![
            like(&queries),
            like(&keys),
            like(&values),
            like(&clusters.mass),
            like(&clusters.rest),
        ];
        let lengths = key_lengths.is_some();
        let mut inputs = top_inputs(queries, keys, values, clusters);
        inputs.extend(key_lengths);
        inputs.push(grad);
        let [queries, keys, values, mass, rest] =
            attention_op::<B>(Attention::TopBackward { scale, lengths }, inputs, outputs)
                .try_into()
                .expect("five gradients");
        TopAttentionGrads {
            queries,
            keys,
            values,
            mass,
            rest,
        }
    }

    fn improved_attention_forward(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Option<IntTensor<Self>>,
        topk: usize,
        scale: f64,
    ) -> (FloatTensor<Self>, ImprovedForward<Self>) {
        assert!(topk > 0, "topk must be at least 1, got 0");
        let num_clusters = check_query_clusters(queries.shape().dims(), &clusters);
        let [batch, heads, len, dim] = queries.shape().dims();
        let [_, _, keys_len, dim_v] = values.shape().dims();
        check_centroid_attention(
            [batch, heads, num_clusters, dim],
            keys.shape().dims(),
            [batch, heads, keys_len, dim_v],
            topk,
        );
        let float = queries.dtype;
        let shape = |rows: usize, last: usize| Shape::new([batch, heads, rows, last]);
        let outputs = vec![
            (shape(len, dim_v), float),
            (shape(num_clusters, dim), float),
            (shape(num_clusters, dim_v), float),
            (shape(num_clusters, topk), float),
            (shape(num_clusters, 1), float),
            (
                shape(num_clusters, topk),
                <B::IntElem as burn::tensor::Element>::dtype(),
            ),
        ];
        let lengths = key_lengths.is_some();
        let mut inputs = vec![
            queries,
            keys,
            values,
            clusters.assignments,
            clusters.inverse_counts,
        ];
        inputs.extend(key_lengths);
        let op = Attention::Improved {
            topk,
            scale,
            lengths,
        };
        let [output, centroids, rest, weights, mass, indices] =
            attention_op::<B>(op, inputs, outputs)
                .try_into()
                .expect("six outputs");
        let forward = ImprovedForward {
            centroids,
            centroid_attention: CentroidAttention {
                values: rest,
                top: Some((indices, weights)),
                log_sum_exp: None,
            },
            mass,
        };
        (output, forward)
    }
}

/// The inputs of a top-k attention op, in [`Attention::Top`]'s order.
fn top_inputs<R: FusionRuntime, B: FusionBackend<FusionRuntime = R>>(
    queries: FusionTensor<R>,
    keys: FusionTensor<R>,
    values: FusionTensor<R>,
    clusters: ClusterTop<Fusion<B>>,
) -> Vec<FusionTensor<R>> {
    vec![
        queries,
        keys,
        values,
        clusters.assignments,
        clusters.topk,
        clusters.mass,
        clusters.rest,
    ]
}
