//! `Fusion<CubeBackend>` (`burn::backend::Cube`: WGPU, Vulkan, CUDA): hashing, K-means, the
//! top-k, the sparse products and the centroid and top-k attentions (the forward passes, and
//! the centroid attention's backward) are registered as custom operations that run the CubeCL
//! kernels of [`super`] on the inner `CubeBackend`'s tensors when the fusion stream executes.
//! The attentions run whole on the inner backend, so Fusion never sees (and never fuses) the
//! matrix products, masks and softmaxes inside them: on CUDA, Burn's fused matmul and reduce
//! gave wrong centroid weights on those graphs. The softmax on its own keeps its default body,
//! which fuses; so do the ops without a kernel (the backward passes of the top-k attention and
//! of the whole improved attention) and the calls whose sizes the kernels do not take, whose
//! default bodies ([`crate::ops::reference`]) run on `Fusion<CubeBackend>` itself.
//!
//! Each custom operation records, in its [`CustomOpIr`], every argument that affects its
//! result: the tensors, and the `clusters`, `iterations`, `seed`, `k`, `topk`, `keys_len` and
//! `scale` arguments and whether the optional tensors are given as scalars, which the operation
//! reads back when it executes. Its outputs' shapes and dtypes are fixed where it is
//! registered; the int outputs take the dtype of the int input they derive from (the codes for
//! the K-means) or the device's settings (the codes of the hashing and the top-k indices).

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::cast;
use burn_cubecl::tensor::CubeTensor;
use burn_fusion::custom::{
    CustomOpIr, HandleContainer, Operation, OperationIr, OperationOutput, ScalarIr, StreamId,
    TensorIr,
};
use burn_fusion::{ExecutionError, Fusion, FusionBackend, FusionRuntime, FusionTensor};

use super::{centroid, sparse, top, topk};
use crate::ops::checks::{
    check_centroid_attention, check_cluster_top, check_planes, check_query_clusters, check_topk,
};
use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusterTop, ClusteredAttentionBackend,
    ClusteredAttentionBackward, ImprovedForward, Lengths, QueryClusters, reference,
};

/// The runtime of `Fusion<CubeBackend>`'s streams.
type Runtime = <CubeBackend as FusionBackend>::FusionRuntime;

/// The handles of the tensors a custom operation reads and writes when its stream executes.
type Handles = HandleContainer<<Runtime as FusionRuntime>::FusionHandle>;

/// A tensor of `Fusion<CubeBackend>`, of any kind.
type Tensor = FusionTensor<Runtime>;

/// The names of the custom operations ([`CustomOpIr::id`]).
const LSH_HASH: &str = "clustered_attention::lsh_hash";
const HAMMING_KMEANS: &str = "clustered_attention::hamming_kmeans";
const TOPK_INDICES: &str = "clustered_attention::topk_indices";
const SPARSE_DOT: &str = "clustered_attention::sparse_dot";
const SPARSE_WEIGHTED_SUM: &str = "clustered_attention::sparse_weighted_sum";
const SPARSE_SCATTER: &str = "clustered_attention::sparse_scatter";
const CENTROID_ATTENTION: &str = "clustered_attention::centroid_attention";
const CENTROID_ATTENTION_BACKWARD: &str = "clustered_attention::centroid_attention_backward";
const TOP_ATTENTION: &str = "clustered_attention::top_attention";
const IMPROVED_ATTENTION_FORWARD: &str = "clustered_attention::improved_attention_forward";

/// One of the ops as a Fusion custom operation: `desc` names it and holds its inputs, outputs
/// and scalars, in the order [`execute`] reads them.
#[derive(Debug)]
struct ClusteredOp {
    desc: CustomOpIr,
}

impl Operation<Runtime> for ClusteredOp {
    fn execute(&self, handles: &mut Handles) -> Result<(), ExecutionError> {
        execute(&self.desc, handles)
    }
}

/// Registers the custom operation `id` with `inputs` (in the order [`execute`] reads them),
/// outputs of the given shapes and dtypes, and `scalars`, on the current stream; returns the
/// outputs.
fn register(
    id: &'static str,
    inputs: Vec<Tensor>,
    outputs: Vec<(Shape, DType)>,
    scalars: Vec<ScalarIr>,
) -> Vec<Tensor> {
    let client = inputs[0].client.clone();
    let outputs: Vec<TensorIr> = outputs
        .into_iter()
        .map(|(shape, dtype)| TensorIr::uninit(client.create_empty_handle(), shape, dtype))
        .collect();
    let inputs: Vec<TensorIr> = inputs.into_iter().map(|tensor| tensor.into_ir()).collect();
    let desc = CustomOpIr::with_scalars(id, &inputs, &outputs, scalars);
    client.register(
        StreamId::current(),
        OperationIr::Custom(desc.clone()),
        ClusteredOp { desc },
    )
}

/// `usize` as a scalar of a custom operation.
fn uint(value: usize) -> ScalarIr {
    ScalarIr::UInt(value as u64)
}

/// `(shape, dtype)` of a tensor, for an output of the same shape.
fn like(tensor: &Tensor) -> (Shape, DType) {
    (tensor.shape(), tensor.dtype)
}

/// The dtype of the int tensors the ops create on `tensor`'s device (see [`super::int_dtype`]).
fn int_dtype(tensor: &Tensor) -> DType {
    super::int_dtype(tensor.client.device())
}

/// An output of a custom operation, by kind.
enum Output {
    Float(CubeTensor),
    Int(CubeTensor),
}

/// The error of a custom operation whose description does not match what [`register`] was
/// given for its name.
fn malformed(desc: &CustomOpIr) -> ExecutionError {
    ExecutionError::generic(format!(
        "custom operation {} does not have the inputs, outputs and scalars it is registered with",
        desc.id
    ))
}

/// Takes the inputs of a custom operation in their order of registration, and registers its
/// outputs.
struct Io<'a> {
    desc: &'a CustomOpIr,
    handles: &'a mut Handles,
    read: usize,
}

impl Io<'_> {
    fn next(&mut self) -> Result<&TensorIr, ExecutionError> {
        let desc = self.desc;
        let ir = desc.inputs.get(self.read).ok_or_else(|| malformed(desc))?;
        self.read += 1;
        Ok(ir)
    }

    fn float(&mut self) -> Result<CubeTensor, ExecutionError> {
        let ir = self.next()?.clone();
        Ok(self.handles.get_float_tensor::<CubeBackend>(&ir))
    }

    fn int(&mut self) -> Result<CubeTensor, ExecutionError> {
        let ir = self.next()?.clone();
        Ok(self.handles.get_int_tensor::<CubeBackend>(&ir))
    }

    fn float_if(&mut self, present: bool) -> Result<Option<CubeTensor>, ExecutionError> {
        present.then(|| self.float()).transpose()
    }

    fn int_if(&mut self, present: bool) -> Result<Option<CubeTensor>, ExecutionError> {
        present.then(|| self.int()).transpose()
    }

    /// The dtype output `index` was registered with.
    fn output_dtype(&self, index: usize) -> Result<DType, ExecutionError> {
        let desc = self.desc;
        desc.outputs
            .get(index)
            .map(|ir| ir.dtype)
            .ok_or_else(|| malformed(desc))
    }

    /// Registers `outputs` under the ids of the operation's outputs, in order, each in the
    /// dtype it was registered with (a kernel whose int outputs take another dtype is cast).
    fn finish(self, outputs: Vec<Output>) -> Result<(), ExecutionError> {
        let desc = self.desc;
        if self.read != desc.inputs.len() || outputs.len() != desc.outputs.len() {
            return Err(malformed(desc));
        }
        for (ir, output) in desc.outputs.iter().zip(outputs) {
            match output {
                Output::Float(tensor) => self
                    .handles
                    .register_float_tensor::<CubeBackend>(&ir.id, cast(tensor, ir.dtype)),
                Output::Int(tensor) => self
                    .handles
                    .register_int_tensor::<CubeBackend>(&ir.id, cast(tensor, ir.dtype)),
            }
        }
        Ok(())
    }
}

/// Runs the custom operation `desc` on the inner backend's tensors: the launchers of
/// [`super`], with the arguments it was registered with.
fn execute(desc: &CustomOpIr, handles: &mut Handles) -> Result<(), ExecutionError> {
    let mut io = Io {
        desc,
        handles,
        read: 0,
    };
    let outputs = match (desc.id.as_str(), desc.scalars.as_slice()) {
        (LSH_HASH, []) => {
            let (queries, planes) = (io.float()?, io.float()?);
            let codes = super::lsh_hash(queries, planes, io.output_dtype(0)?);
            vec![Output::Int(codes)]
        }
        (
            HAMMING_KMEANS,
            &[
                ScalarIr::UInt(clusters),
                ScalarIr::UInt(iterations),
                ScalarIr::UInt(seed),
                ScalarIr::Bool(lengths),
            ],
        ) => {
            let codes = io.int()?;
            let lengths = io.int_if(lengths)?;
            let (assignments, counts) =
                super::hamming_kmeans(codes, lengths, clusters as usize, iterations as usize, seed);
            vec![Output::Int(assignments), Output::Int(counts)]
        }
        (TOPK_INDICES, &[ScalarIr::UInt(k)]) => {
            let scores = io.float()?;
            let indices = super::topk_indices(scores, k as usize, io.output_dtype(0)?);
            vec![Output::Int(indices)]
        }
        (SPARSE_DOT | SPARSE_WEIGHTED_SUM, []) => {
            let (first, second) = (io.float()?, io.float()?);
            let (topk, assignments) = (io.int()?, io.int()?);
            let output = if desc.id == SPARSE_DOT {
                super::sparse_dot(first, second, topk, assignments)
            } else {
                super::sparse_weighted_sum(first, second, topk, assignments)
            };
            vec![Output::Float(output)]
        }
        (SPARSE_SCATTER, &[ScalarIr::UInt(keys_len)]) => {
            let (weights, x) = (io.float()?, io.float()?);
            let (topk, assignments) = (io.int()?, io.int()?);
            let output = super::sparse_scatter(weights, x, topk, assignments, keys_len as usize);
            vec![Output::Float(output)]
        }
        (CENTROID_ATTENTION, &[ScalarIr::UInt(topk), ScalarIr::Bool(lengths)]) => {
            let (centroids, keys, values) = (io.float()?, io.float()?, io.float()?);
            let key_lengths = io.int_if(lengths)?;
            // The top-k indices' dtype; without them, the kernels still read the key lengths.
            let int_dtype = match topk {
                0 => super::int_dtype(&centroids.device),
                _ => io.output_dtype(1)?,
            };
            let (values, top) = super::centroid_attention(
                centroids,
                keys,
                values,
                key_lengths,
                topk as usize,
                int_dtype,
            );
            let mut outputs = vec![Output::Float(values)];
            if let Some((indices, weights)) = top {
                outputs.extend([Output::Int(indices), Output::Float(weights)]);
            }
            outputs
        }
        (CENTROID_ATTENTION_BACKWARD, &[ScalarIr::Bool(lengths), ScalarIr::Bool(top)]) => {
            let (centroids, keys, values) = (io.float()?, io.float()?, io.float()?);
            let key_lengths = io.int_if(lengths)?;
            let forward_values = io.float()?;
            let top_pair = if top {
                Some((io.int()?, io.float()?))
            } else {
                None
            };
            let grad_values = io.float()?;
            let grad_top_weights = io.float_if(top)?;
            let forward = CentroidAttention {
                values: forward_values,
                top: top_pair,
                log_sum_exp: None,
            };
            let grads = super::centroid_attention_backward(
                centroids,
                keys,
                values,
                key_lengths,
                forward,
                grad_values,
                grad_top_weights,
            );
            vec![
                Output::Float(grads.centroids),
                Output::Float(grads.keys),
                Output::Float(grads.values),
            ]
        }
        (TOP_ATTENTION, &[ScalarIr::Float(scale), ScalarIr::Bool(lengths)]) => {
            let (queries, keys, values) = (io.float()?, io.float()?, io.float()?);
            let clusters = ClusterTop {
                assignments: io.int()?,
                topk: io.int()?,
                mass: io.float()?,
                rest: io.float()?,
            };
            let key_lengths = io.int_if(lengths)?;
            let output = super::top_attention(queries, keys, values, clusters, key_lengths, scale);
            vec![Output::Float(output)]
        }
        (
            IMPROVED_ATTENTION_FORWARD,
            &[
                ScalarIr::UInt(topk),
                ScalarIr::Float(scale),
                ScalarIr::Bool(lengths),
            ],
        ) => {
            let (queries, keys, values) = (io.float()?, io.float()?, io.float()?);
            let clusters = QueryClusters {
                assignments: io.int()?,
                inverse_counts: io.float()?,
            };
            let key_lengths = io.int_if(lengths)?;
            let (output, forward) = super::improved_attention_forward(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                topk as usize,
                scale,
                io.output_dtype(3)?,
            );
            let (indices, weights) = forward
                .centroid_attention
                .top
                .ok_or_else(|| malformed(desc))?;
            vec![
                Output::Float(output),
                Output::Float(forward.centroids),
                Output::Float(forward.centroid_attention.values),
                Output::Int(indices),
                Output::Float(weights),
                Output::Float(forward.mass),
            ]
        }
        _ => return Err(malformed(desc)),
    };
    io.finish(outputs)
}

/// The inputs of a top-k attention op, in the order [`execute`] reads them: the three float
/// inputs, then the clusters' assignments, top-k, mass and rest.
fn top_inputs(
    queries: Tensor,
    keys: Tensor,
    values: Tensor,
    clusters: ClusterTop<Fusion<CubeBackend>>,
) -> Vec<Tensor> {
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

impl ClusteredAttentionBackend for Fusion<CubeBackend> {
    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        let [batch, heads, len, dim] = queries.shape().dims();
        let [bits, columns] = planes.shape().dims();
        check_planes([batch, heads, len, dim], [bits, columns]);
        let codes = (Shape::new([batch, heads, len]), int_dtype(&queries));
        register(LSH_HASH, vec![queries, planes], vec![codes], vec![]).output()
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Lengths<Self>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        assert!(clusters > 0, "clusters must be at least 1, got 0");
        let [batch, heads, len] = codes.shape().dims();
        let dtype = codes.dtype;
        let query_lengths = query_lengths.into_option();
        let scalars = vec![
            uint(clusters),
            uint(iterations),
            ScalarIr::UInt(seed),
            ScalarIr::Bool(query_lengths.is_some()),
        ];
        let mut inputs = vec![codes];
        inputs.extend(query_lengths);
        let outputs = vec![
            (Shape::new([batch, heads, len]), dtype),
            (Shape::new([batch, heads, clusters]), dtype),
        ];
        let [assignments, counts] = register(HAMMING_KMEANS, inputs, outputs, scalars).outputs();
        (assignments, counts)
    }

    fn centroid_attention(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
    ) -> (
        FloatTensor<Self>,
        Option<(IntTensor<Self>, FloatTensor<Self>)>,
    ) {
        let attention = Self::centroid_attention_forward(
            centroids,
            keys,
            values,
            key_lengths.into_option(),
            topk,
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
    ) -> FloatTensor<Self> {
        // Checked where the call is made, not when the stream runs it.
        check_cluster_top::<Self>(&queries, &keys, &values, &clusters);
        let [batch, heads, len, dim] = queries.shape().dims();
        let dim_v = values.shape()[3];
        let [_, _, num_clusters, k] = clusters.topk.shape().dims();
        if !top::supported(dim, dim_v, k, num_clusters) {
            return reference::top_attention::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                scale,
            );
        }
        let key_lengths = key_lengths.into_option();
        let scalars = vec![
            ScalarIr::Float(scale),
            ScalarIr::Bool(key_lengths.is_some()),
        ];
        let outputs = vec![(Shape::new([batch, heads, len, dim_v]), queries.dtype)];
        let mut inputs = top_inputs(queries, keys, values, clusters);
        inputs.extend(key_lengths);
        register(TOP_ATTENTION, inputs, outputs, scalars).output()
    }

    fn improved_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Lengths<Self>,
        topk: usize,
        scale: f64,
    ) -> FloatTensor<Self> {
        Self::improved_attention_forward(
            queries,
            keys,
            values,
            clusters,
            key_lengths.into_option(),
            topk,
            scale,
        )
        .0
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        let [batch, heads, rows, len] = scores.shape().dims();
        check_topk(k, len);
        if k > topk::TOPK_SHARED {
            // One sorted list of k would not fit in the merge's shared memory: the default
            // body, which sorts on the host.
            return reference::topk_indices::<Self>(scores, k);
        }
        let indices = (Shape::new([batch, heads, rows, k]), int_dtype(&scores));
        register(TOPK_INDICES, vec![scores], vec![indices], vec![uint(k)]).output()
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let [batch, heads, len, _] = queries.shape().dims();
        let k = topk.shape()[3];
        let output = (Shape::new([batch, heads, len, k]), queries.dtype);
        let inputs = vec![queries, keys, topk, assignments];
        register(SPARSE_DOT, inputs, vec![output], vec![]).output()
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let [batch, heads, len, _] = weights.shape().dims();
        let dim = values.shape()[3];
        let output = (Shape::new([batch, heads, len, dim]), weights.dtype);
        let inputs = vec![weights, values, topk, assignments];
        register(SPARSE_WEIGHTED_SUM, inputs, vec![output], vec![]).output()
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        if topk.shape()[2] > sparse::SORT_CLUSTERS {
            // Too many clusters for the counting sort's shared memory: the default body.
            return reference::sparse_scatter::<Self>(weights, x, topk, assignments, keys_len);
        }
        let [batch, heads, _, features] = x.shape().dims();
        let output = (
            Shape::new([batch, heads, keys_len, features]),
            weights.dtype,
        );
        let inputs = vec![weights, x, topk, assignments];
        register(SPARSE_SCATTER, inputs, vec![output], vec![uint(keys_len)]).output()
    }
}

impl ClusteredAttentionBackward for Fusion<CubeBackend> {
    fn centroid_attention_forward(
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
        if !centroid::supported(dim, dim_v, topk) {
            // Rows too wide for registers, or a top-k list too long: the default body.
            let (values, top) = reference::centroid_attention::<Self>(
                centroids,
                keys,
                values,
                Lengths::from(key_lengths),
                topk,
            );
            return CentroidAttention {
                values,
                top,
                log_sum_exp: None,
            };
        }
        let (float, int) = (centroids.dtype, int_dtype(&centroids));
        let shape = |last: usize| Shape::new([batch, heads, clusters, last]);
        let mut outputs = vec![(shape(dim_v), float)];
        if topk > 0 {
            outputs.extend([(shape(topk), int), (shape(topk), float)]);
        }
        let scalars = vec![uint(topk), ScalarIr::Bool(key_lengths.is_some())];
        let mut inputs = vec![centroids, keys, values];
        inputs.extend(key_lengths);
        let mut outputs = register(CENTROID_ATTENTION, inputs, outputs, scalars).into_iter();
        let values = outputs.next().expect("the values");
        let top = (topk > 0).then(|| {
            let indices = outputs.next().expect("the top indices");
            (indices, outputs.next().expect("the top weights"))
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
        let dim = centroids.shape()[3];
        let dim_v = values.shape()[3];
        let topk = forward.top.as_ref().map_or(0, |(top, _)| top.shape()[3]);
        let empty = [&centroids, &keys]
            .iter()
            .any(|x| x.shape().num_elements() == 0);
        if empty || !centroid::supported(dim, dim_v, topk) {
            return reference::centroid_attention_backward::<Self>(
                centroids,
                keys,
                values,
                key_lengths,
                forward,
                grad_values,
                grad_top_weights,
            );
        }
        let outputs = vec![like(&centroids), like(&keys), like(&values)];
        let scalars = vec![
            ScalarIr::Bool(key_lengths.is_some()),
            ScalarIr::Bool(forward.top.is_some()),
        ];
        // The log-sum-exp is not an input: the kernels recompute the softmax statistics (and
        // neither the kernels nor the default body produce it on this backend).
        let mut inputs = vec![centroids, keys, values];
        inputs.extend(key_lengths);
        inputs.push(forward.values);
        if let Some((indices, weights)) = forward.top {
            inputs.extend([indices, weights]);
        }
        inputs.push(grad_values);
        inputs.extend(grad_top_weights);
        let [centroids, keys, values] =
            register(CENTROID_ATTENTION_BACKWARD, inputs, outputs, scalars).outputs();
        CentroidAttentionGrads {
            centroids,
            keys,
            values,
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
        if !top::supported(dim, dim_v, topk, num_clusters) || !centroid::supported(dim, dim_v, topk)
        {
            return reference::improved_attention_forward::<Self>(
                queries,
                keys,
                values,
                clusters,
                key_lengths,
                topk,
                scale,
            );
        }
        let (float, int) = (queries.dtype, int_dtype(&queries));
        let shape = |rows: usize, last: usize| Shape::new([batch, heads, rows, last]);
        let outputs = vec![
            (shape(len, dim_v), float),
            (shape(num_clusters, dim), float),
            (shape(num_clusters, dim_v), float),
            (shape(num_clusters, topk), int),
            (shape(num_clusters, topk), float),
            (shape(num_clusters, 1), float),
        ];
        let scalars = vec![
            uint(topk),
            ScalarIr::Float(scale),
            ScalarIr::Bool(key_lengths.is_some()),
        ];
        let mut inputs = vec![
            queries,
            keys,
            values,
            clusters.assignments,
            clusters.inverse_counts,
        ];
        inputs.extend(key_lengths);
        let [output, centroids, rest, indices, weights, mass] =
            register(IMPROVED_ATTENTION_FORWARD, inputs, outputs, scalars).outputs();
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
