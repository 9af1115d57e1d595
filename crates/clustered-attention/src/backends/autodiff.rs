//! [`Autodiff`]: the clustering ops and the top-k pass through to the inner backend (integer
//! outputs, no gradient); the three sparse products are differentiated with the inner backend's own
//! sparse products, since the gradient of each is made of the other two; the centroid attention and
//! the per-query top-k attention run the inner backend's fused ops forward and its
//! [`centroid_attention_backward`](ClusteredAttentionBackend::centroid_attention_backward) and
//! [`top_attention_backward`](ClusteredAttentionBackend::top_attention_backward) backward; the
//! whole improved attention after clustering
//! ([`improved_attention`](ClusteredAttentionBackend::improved_attention)) is one node, run forward
//! by the inner backend's
//! [`improved_attention_forward`](ClusteredAttentionBackend::improved_attention_forward) and
//! backward by the inner backend's
//! [`improved_attention_backward`](ClusteredAttentionBackend::improved_attention_backward).

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, unary};
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{DType, Tensor, TensorMetadata, TensorPrimitive};

use crate::ClusteredAttentionBackend;
use crate::ops::{CentroidAttention, ClusterTop, ImprovedForward, QueryClusters, ScoreProducts};

/// Backward state: the two float inputs, the top-k indices and the assignments.
type State<B> = (FloatTensor<B>, FloatTensor<B>, IntTensor<B>, IntTensor<B>);

/// `out = sparse_dot(q, k)`: `dq = sparse_weighted_sum(g, k)`, `dk = sparse_scatter(g, q)`.
#[derive(Debug)]
struct SparseDot;

impl<B: ClusteredAttentionBackend> Backward<B, 2> for SparseDot {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (queries, keys, topk, assignments) = ops.state;
        let keys_len = keys.shape()[2];
        let (topk2, assignments2) = (topk.clone(), assignments.clone());
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| B::sparse_weighted_sum(grad, keys, topk, assignments),
            |grad| B::sparse_scatter(grad, queries, topk2, assignments2, keys_len),
        );
    }
}

/// `out = sparse_weighted_sum(w, v)`: `dw = sparse_dot(g, v)`, `dv = sparse_scatter(w, g)`.
#[derive(Debug)]
struct SparseWeightedSum;

impl<B: ClusteredAttentionBackend> Backward<B, 2> for SparseWeightedSum {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (weights, values, topk, assignments) = ops.state;
        let keys_len = values.shape()[2];
        let (topk2, assignments2) = (topk.clone(), assignments.clone());
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| B::sparse_dot(grad, values, topk, assignments),
            |grad| B::sparse_scatter(weights, grad, topk2, assignments2, keys_len),
        );
    }
}

/// `out = sparse_scatter(w, x)`: `dw = sparse_dot(x, g)`, `dx = sparse_weighted_sum(w, g)`.
#[derive(Debug)]
struct SparseScatter;

impl<B: ClusteredAttentionBackend> Backward<B, 2> for SparseScatter {
    type State = State<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (weights, x, topk, assignments) = ops.state;
        let (topk2, assignments2) = (topk.clone(), assignments.clone());
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |grad| B::sparse_dot(x, grad, topk, assignments),
            |grad| B::sparse_weighted_sum(weights, grad, topk2, assignments2),
        );
    }
}

/// `y = softmax(x)`: `dx = y ⊙ g − y ⊙ Σ_last (y ⊙ g)`.
#[derive(Debug)]
struct AttentionSoftmax;

impl<B: ClusteredAttentionBackend> Backward<B, 1> for AttentionSoftmax {
    type State = FloatTensor<B>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let output = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            let last = output.shape().num_dims() - 1;
            let weighted = B::float_mul(grad, output.clone());
            let row_sums = B::float_sum_dim(weighted.clone(), last);
            B::float_sub(weighted, B::float_mul(output, row_sums))
        });
    }
}

/// Backward state of the top-k attention: its inputs (the float ones of the inner backend),
/// the key lengths and the scale.
type TopState<B> = (
    [FloatTensor<B>; 5],
    (IntTensor<B>, IntTensor<B>),
    Option<IntTensor<B>>,
    f64,
);

/// `out = top_attention(q, k, v, (assignments, topk, mass, rest))`: the five gradients by
/// the inner backend's `top_attention_backward`.
#[derive(Debug)]
struct TopAttention;

impl<B: ClusteredAttentionBackend> Backward<B, 5> for TopAttention {
    type State = TopState<B>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let ([queries, keys, values, mass, rest], (assignments, topk), key_lengths, scale) =
            ops.state;
        let clusters = ClusterTop {
            assignments,
            topk,
            mass,
            rest,
        };
        let out =
            B::top_attention_backward(queries, keys, values, clusters, key_lengths, scale, grad);
        let outputs = [out.queries, out.keys, out.values, out.mass, out.rest];
        for (parent, grad) in ops.parents.into_iter().zip(outputs) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward state of the centroid attention: its float inputs (of the inner backend), the key
/// lengths, its result (the rest of `Aᶜ V`, the top-k indices and weights, the log-sum-exps)
/// and `D`, the width of (the rest of) `Aᶜ V` in the joined output.
type CentroidState<B> = (
    [FloatTensor<B>; 3],
    Option<IntTensor<B>>,
    CentroidOutput<B>,
    usize,
);

/// The parts of a [`CentroidAttention`] (which is not `Clone`).
type CentroidOutput<B> = (
    FloatTensor<B>,
    Option<(IntTensor<B>, FloatTensor<B>)>,
    Option<FloatTensor<B>>,
);

/// `[rest of Aᶜ V, Aᶜ at the top-k keys] = centroid_attention(centroids, keys, values)`, the two
/// float outputs joined along the last dimension: the three gradients by the inner backend's
/// `centroid_attention_backward`.
#[derive(Debug)]
struct CentroidAttentionOp;

impl<B: ClusteredAttentionBackend> Backward<B, 3> for CentroidAttentionOp {
    type State = CentroidState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let ([centroids, keys, values], key_lengths, (out_values, top, log_sum_exp), dim_v) =
            ops.state;
        let (grad_values, grad_top) = match top {
            Some(_) => {
                let grad = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(grad));
                let k = grad.dims()[3] - dim_v;
                let part =
                    |start, len| grad.clone().narrow(3, start, len).into_primitive().tensor();
                (part(0, dim_v), Some(part(dim_v, k)))
            }
            None => (grad, None),
        };
        let forward = CentroidAttention {
            values: out_values,
            top,
            log_sum_exp,
        };
        let out = B::centroid_attention_backward(
            centroids,
            keys,
            values,
            key_lengths,
            forward,
            grad_values,
            grad_top,
        );
        let outputs = [out.centroids, out.keys, out.values];
        for (parent, grad) in ops.parents.into_iter().zip(outputs) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward state of the whole improved attention: its float inputs (of the inner backend),
/// the clustering, the key lengths and the scale, and its intermediate results: the scaled
/// centroids, the centroid attention's result (as [`CentroidState`]'s) and the mass.
type ImprovedState<B> = (
    [FloatTensor<B>; 3],
    (IntTensor<B>, FloatTensor<B>),
    Option<IntTensor<B>>,
    f64,
    (FloatTensor<B>, CentroidOutput<B>, FloatTensor<B>),
);

/// `out = improved_attention(q, k, v, clusters)`: the three gradients by the inner backend's
/// `improved_attention_backward`.
#[derive(Debug)]
struct ImprovedAttention;

impl<B: ClusteredAttentionBackend> Backward<B, 3> for ImprovedAttention {
    type State = ImprovedState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (
            [queries, keys, values],
            (assignments, inverse_counts),
            key_lengths,
            scale,
            (centroids, (out_values, top, log_sum_exp), mass),
        ) = ops.state;
        let forward = ImprovedForward {
            centroids,
            centroid_attention: CentroidAttention {
                values: out_values,
                top,
                log_sum_exp,
            },
            mass,
        };
        let clusters = QueryClusters {
            assignments,
            inverse_counts,
        };
        let out = B::improved_attention_backward(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            forward,
            grad,
        );
        let outputs = [out.queries, out.keys, out.values];
        for (parent, grad) in ops.parents.into_iter().zip(outputs) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B: ClusteredAttentionBackend, C: CheckpointStrategy> ClusteredAttentionBackend
    for Autodiff<B, C>
{
    fn score_products(device: &Self::Device, dtype: DType) -> ScoreProducts {
        B::score_products(device, dtype)
    }

    fn attention_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        match AttentionSoftmax
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::attention_softmax(x.primitive);
                prep.finish(output.clone(), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::attention_softmax(x.primitive)),
        }
    }

    fn centroid_attention(
        centroids: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        key_lengths: Option<IntTensor<Self>>,
        topk: usize,
    ) -> CentroidAttention<Self> {
        let nodes = [&centroids, &keys, &values].map(|x| x.node.clone());
        let floats = [centroids, keys, values].map(|x| x.primitive);
        let dim_v = floats[2].shape().dims::<4>()[3];
        let [c, k, v] = floats.clone();
        let out = B::centroid_attention(c, k, v, key_lengths.clone(), topk);
        let float = |x| Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
        let joined = match &out.top {
            Some((_, weights)) => {
                let joined =
                    Tensor::cat(vec![float(out.values.clone()), float(weights.clone())], 3);
                joined.into_primitive().tensor()
            }
            None => out.values.clone(),
        };
        let top = out.top.as_ref().map(|(top, _)| top.clone());
        let joined = match CentroidAttentionOp
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = (out.values, out.top, out.log_sum_exp);
                prep.finish((floats, key_lengths, output, dim_v), joined)
            }
            OpsKind::UnTracked(prep) => prep.finish(joined),
        };
        let joined = Tensor::<Self, 4>::from_primitive(TensorPrimitive::Float(joined));
        let part = |start, len| {
            joined
                .clone()
                .narrow(3, start, len)
                .into_primitive()
                .tensor()
        };
        CentroidAttention {
            values: part(0, dim_v),
            top: top.map(|top| (top, part(dim_v, topk))),
            log_sum_exp: None,
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
        let nodes =
            [&queries, &keys, &values, &clusters.mass, &clusters.rest].map(|x| x.node.clone());
        let floats = [queries, keys, values, clusters.mass, clusters.rest].map(|x| x.primitive);
        let forward = |[queries, keys, values, mass, rest]: [FloatTensor<B>; 5],
                       assignments,
                       topk,
                       key_lengths| {
            let clusters = ClusterTop {
                assignments,
                topk,
                mass,
                rest,
            };
            B::top_attention(queries, keys, values, clusters, key_lengths, scale)
        };
        let (assignments, topk) = (clusters.assignments, clusters.topk);
        match TopAttention.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let output = forward(
                    floats.clone(),
                    assignments.clone(),
                    topk.clone(),
                    key_lengths.clone(),
                );
                prep.finish((floats, (assignments, topk), key_lengths, scale), output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(forward(floats, assignments, topk, key_lengths))
            }
        }
    }

    fn improved_attention(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        values: FloatTensor<Self>,
        clusters: QueryClusters<Self>,
        key_lengths: Option<IntTensor<Self>>,
        topk: usize,
        scale: f64,
    ) -> FloatTensor<Self> {
        let nodes = [&queries, &keys, &values].map(|x| x.node.clone());
        let floats = [queries, keys, values].map(|x| x.primitive);
        // The clustering is a constant: its inverse counts carry no gradient.
        let clusters = QueryClusters::<B> {
            assignments: clusters.assignments,
            inverse_counts: clusters.inverse_counts.primitive,
        };
        match ImprovedAttention
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let [q, k, v] = floats.clone();
                let kept = (
                    clusters.assignments.clone(),
                    clusters.inverse_counts.clone(),
                );
                let (output, forward) = B::improved_attention_forward(
                    q,
                    k,
                    v,
                    clusters,
                    key_lengths.clone(),
                    topk,
                    scale,
                );
                let attention = forward.centroid_attention;
                let kept_forward = (
                    forward.centroids,
                    (attention.values, attention.top, attention.log_sum_exp),
                    forward.mass,
                );
                prep.finish((floats, kept, key_lengths, scale, kept_forward), output)
            }
            OpsKind::UnTracked(prep) => {
                let [q, k, v] = floats;
                prep.finish(B::improved_attention(
                    q,
                    k,
                    v,
                    clusters,
                    key_lengths,
                    topk,
                    scale,
                ))
            }
        }
    }

    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        B::lsh_hash(queries.primitive, planes.primitive)
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Option<IntTensor<Self>>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        B::hamming_kmeans(codes, query_lengths, clusters, iterations, seed)
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        B::topk_indices(scores.primitive, k)
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match SparseDot
            .prepare::<C>([queries.node.clone(), keys.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::sparse_dot(
                    queries.primitive.clone(),
                    keys.primitive.clone(),
                    topk.clone(),
                    assignments.clone(),
                );
                prep.finish(
                    (queries.primitive, keys.primitive, topk, assignments),
                    output,
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::sparse_dot(
                queries.primitive,
                keys.primitive,
                topk,
                assignments,
            )),
        }
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        match SparseWeightedSum
            .prepare::<C>([weights.node.clone(), values.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::sparse_weighted_sum(
                    weights.primitive.clone(),
                    values.primitive.clone(),
                    topk.clone(),
                    assignments.clone(),
                );
                prep.finish(
                    (weights.primitive, values.primitive, topk, assignments),
                    output,
                )
            }
            OpsKind::UnTracked(prep) => prep.finish(B::sparse_weighted_sum(
                weights.primitive,
                values.primitive,
                topk,
                assignments,
            )),
        }
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        match SparseScatter
            .prepare::<C>([weights.node.clone(), x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::sparse_scatter(
                    weights.primitive.clone(),
                    x.primitive.clone(),
                    topk.clone(),
                    assignments.clone(),
                    keys_len,
                );
                prep.finish((weights.primitive, x.primitive, topk, assignments), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::sparse_scatter(
                weights.primitive,
                x.primitive,
                topk,
                assignments,
                keys_len,
            )),
        }
    }
}
