//! [`Autodiff`]: the clustering ops and the top-k pass through to the inner backend (integer
//! outputs, no gradient); the three sparse products are differentiated with the inner backend's own
//! sparse products, since the gradient of each is made of the other two; the centroid attention and
//! the per-query top-k attention run the inner backend's fused ops forward and its
//! [`centroid_attention_backward`](ClusteredAttentionBackward::centroid_attention_backward) and
//! [`top_attention_backward`](ClusteredAttentionBackward::top_attention_backward) backward; the
//! whole improved attention after clustering
//! ([`improved_attention`](ClusteredAttentionBackend::improved_attention)) is one node, run forward
//! by the inner backend's
//! [`improved_attention_forward`](ClusteredAttentionBackward::improved_attention_forward) and
//! backward by the inner backend's
//! [`improved_attention_backward`](ClusteredAttentionBackward::improved_attention_backward).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, binary, unary};
use burn::backend::ops::FloatTensorOps;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Autodiff, TensorMetadata};
use burn::tensor::Slice;

use crate::dropout::AttentionDropout;
use crate::recompute::RecomputedForward;

use crate::ops::{
    CentroidAttention, ClusterTop, ClusteredAttentionBackend, ClusteredAttentionBackward,
    ImprovedForward, Lengths, QueryClusters,
};

/// The slices that take `len` entries of dimension `dim` from `start`, and all of the other
/// dimensions of `dims` (as `Tensor::narrow`, on primitives).
fn narrow_slices(dims: &[usize], dim: usize, start: usize, len: usize) -> Vec<Slice> {
    dims.iter()
        .enumerate()
        .map(|(i, &size)| {
            if i == dim {
                Slice::from(start..start + len)
            } else {
                Slice::from(0..size)
            }
        })
        .collect()
}

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

/// `y = x ⊙ factors(dropout, stream)`: `dx = g ⊙ factors(dropout, stream)`, the factors drawn
/// again (the state is the dropout's seed and stream, not the mask).
#[derive(Debug)]
struct ActivationDropout;

impl<B: ClusteredAttentionBackend> Backward<B, 1> for ActivationDropout {
    type State = (AttentionDropout, u32);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (dropout, stream) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::activation_dropout(grad, dropout, stream)
        });
    }
}

/// `y = forward(x, parameters)`, recomputed: the gradients of `x` and `parameters` from the
/// forward pass run again on the kept `x` and `parameters`.
#[derive(Debug)]
struct Recompute;

impl<B: ClusteredAttentionBackend> Backward<B, 2> for Recompute {
    type State = (FloatTensor<B>, FloatTensor<B>, RecomputedForward);

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (input, parameters, forward) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let wanted = ops.parents.each_ref().map(Option::is_some);
        let computed = forward.gradients::<B>(input, parameters, grad, wanted);
        for (parent, grad) in ops.parents.into_iter().zip(computed) {
            if let (Some(node), Some(grad)) = (parent, grad) {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward state of the top-k attention: its inputs (the float ones of the inner backend),
/// the key lengths, the scale and the dropout.
type TopState<B> = (
    [FloatTensor<B>; 5],
    (IntTensor<B>, IntTensor<B>),
    Lengths<B>,
    (f64, Option<AttentionDropout>),
);

/// `out = top_attention(q, k, v, (assignments, topk, mass, rest))`: the five gradients by
/// the inner backend's `top_attention_backward`.
#[derive(Debug)]
struct TopAttention;

impl<B: ClusteredAttentionBackward> Backward<B, 5> for TopAttention {
    type State = TopState<B>;

    fn backward(self, ops: Ops<Self::State, 5>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (
            [queries, keys, values, mass, rest],
            (assignments, topk),
            key_lengths,
            (scale, dropout),
        ) = ops.state;
        let clusters = ClusterTop {
            assignments,
            topk,
            mass,
            rest,
        };
        let out = B::top_attention_backward(
            queries,
            keys,
            values,
            clusters,
            key_lengths,
            scale,
            grad,
            dropout,
        );
        let outputs = [out.queries, out.keys, out.values, out.mass, out.rest];
        for (parent, grad) in ops.parents.into_iter().zip(outputs) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// Backward state of the centroid attention: its float inputs (of the inner backend), the key
/// lengths, its result (the rest of `Aᶜ V`, the top-k indices and weights, the log-sum-exps),
/// `D`, the width of (the rest of) `Aᶜ V` in the joined output, and the dropout.
type CentroidState<B> = (
    [FloatTensor<B>; 3],
    Lengths<B>,
    CentroidOutput<B>,
    (usize, Option<AttentionDropout>),
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

impl<B: ClusteredAttentionBackward> Backward<B, 3> for CentroidAttentionOp {
    type State = CentroidState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (
            [centroids, keys, values],
            key_lengths,
            (out_values, top, log_sum_exp),
            (dim_v, dropout),
        ) = ops.state;
        let (grad_values, grad_top) = match top {
            Some(_) => {
                let dims = grad.shape();
                let k = dims[3] - dim_v;
                let part =
                    |start, len| B::float_slice(grad.clone(), &narrow_slices(&dims, 3, start, len));
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
            dropout,
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
/// the clustering, the key lengths, the scale and the dropout, and its intermediate results:
/// the scaled centroids, the centroid attention's result (as [`CentroidState`]'s) and the mass.
type ImprovedState<B> = (
    [FloatTensor<B>; 3],
    (IntTensor<B>, FloatTensor<B>),
    Lengths<B>,
    (f64, Option<AttentionDropout>),
    (FloatTensor<B>, CentroidOutput<B>, FloatTensor<B>),
);

/// `out = improved_attention(q, k, v, clusters)`: the three gradients by the inner backend's
/// `improved_attention_backward`.
#[derive(Debug)]
struct ImprovedAttention;

impl<B: ClusteredAttentionBackward> Backward<B, 3> for ImprovedAttention {
    type State = ImprovedState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let (
            [queries, keys, values],
            (assignments, inverse_counts),
            key_lengths,
            (scale, dropout),
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
            dropout,
        );
        let outputs = [out.queries, out.keys, out.values];
        for (parent, grad) in ops.parents.into_iter().zip(outputs) {
            if let Some(node) = parent {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

impl<B, C> ClusteredAttentionBackend for Autodiff<B, C>
where
    B: ClusteredAttentionBackward,
    C: CheckpointStrategy,
    burn::backend::DispatchTensor: burn::backend::DispatchKindConversion<Autodiff<B, C>>,
{
    fn attention_softmax(x: FloatTensor<Self>) -> FloatTensor<Self> {
        let node = x.node();
        match AttentionSoftmax
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::attention_softmax(x.into_primitive());
                prep.finish(output.clone(), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::attention_softmax(x.into_primitive())),
        }
    }

    fn activation_dropout(
        x: FloatTensor<Self>,
        dropout: AttentionDropout,
        stream: u32,
    ) -> FloatTensor<Self> {
        let node = x.node();
        match ActivationDropout
            .prepare::<C>([node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                (dropout, stream),
                B::activation_dropout(x.into_primitive(), dropout, stream),
            ),
            OpsKind::UnTracked(prep) => {
                prep.finish(B::activation_dropout(x.into_primitive(), dropout, stream))
            }
        }
    }

    fn recompute(
        input: FloatTensor<Self>,
        parameters: FloatTensor<Self>,
        forward: RecomputedForward,
    ) -> FloatTensor<Self> {
        let nodes = [input.node(), parameters.node()];
        let (input, parameters) = (input.into_primitive(), parameters.into_primitive());
        match Recompute.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let output = forward.value::<B>(input.clone(), parameters.clone());
                prep.finish((input, parameters, forward), output)
            }
            OpsKind::UnTracked(prep) => prep.finish(forward.value::<B>(input, parameters)),
        }
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
        let key_lengths = key_lengths.map(std::convert::identity);
        let nodes = [&centroids, &keys, &values].map(|x| x.node());
        let floats = [centroids, keys, values].map(|x| x.into_primitive());
        let dim_v = floats[2].shape().dims::<4>()[3];
        let [c, k, v] = floats.clone();
        let out = B::centroid_attention_forward(c, k, v, key_lengths.clone(), topk, dropout);
        let joined = match &out.top {
            Some((_, weights)) => B::float_cat(vec![out.values.clone(), weights.clone()], 3),
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
                prep.finish((floats, key_lengths, output, (dim_v, dropout)), joined)
            }
            OpsKind::UnTracked(prep) => prep.finish(joined),
        };
        let dims = joined.shape();
        let part =
            |start, len| Self::float_slice(joined.clone(), &narrow_slices(&dims, 3, start, len));
        (part(0, dim_v), top.map(|top| (top, part(dim_v, topk))))
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
        let key_lengths = key_lengths.map(std::convert::identity);
        let nodes = [&queries, &keys, &values, &clusters.mass, &clusters.rest].map(|x| x.node());
        let floats =
            [queries, keys, values, clusters.mass, clusters.rest].map(|x| x.into_primitive());
        let forward = |[queries, keys, values, mass, rest]: [FloatTensor<B>; 5],
                       assignments,
                       topk,
                       key_lengths: Lengths<B>| {
            let clusters = ClusterTop {
                assignments,
                topk,
                mass,
                rest,
            };
            B::top_attention(queries, keys, values, clusters, key_lengths, scale, dropout)
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
                prep.finish(
                    (floats, (assignments, topk), key_lengths, (scale, dropout)),
                    output,
                )
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(forward(floats, assignments, topk, key_lengths))
            }
        }
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
        let key_lengths = key_lengths.map(std::convert::identity);
        let nodes = [&queries, &keys, &values].map(|x| x.node());
        let floats = [queries, keys, values].map(|x| x.into_primitive());
        // The clustering is a constant: its inverse counts carry no gradient.
        let clusters = QueryClusters::<B> {
            assignments: clusters.assignments,
            inverse_counts: clusters.inverse_counts.into_primitive(),
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
                    dropout,
                );
                let attention = forward.centroid_attention;
                let kept_forward = (
                    forward.centroids,
                    (attention.values, attention.top, attention.log_sum_exp),
                    forward.mass,
                );
                prep.finish(
                    (floats, kept, key_lengths, (scale, dropout), kept_forward),
                    output,
                )
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
                    dropout,
                ))
            }
        }
    }

    fn lsh_hash(queries: FloatTensor<Self>, planes: FloatTensor<Self>) -> IntTensor<Self> {
        B::lsh_hash(queries.into_primitive(), planes.into_primitive())
    }

    fn hamming_kmeans(
        codes: IntTensor<Self>,
        query_lengths: Lengths<Self>,
        clusters: usize,
        iterations: usize,
        seed: u64,
    ) -> (IntTensor<Self>, IntTensor<Self>) {
        let query_lengths = query_lengths.map(std::convert::identity);
        B::hamming_kmeans(codes, query_lengths, clusters, iterations, seed)
    }

    fn topk_indices(scores: FloatTensor<Self>, k: usize) -> IntTensor<Self> {
        B::topk_indices(scores.into_primitive(), k)
    }

    fn sparse_dot(
        queries: FloatTensor<Self>,
        keys: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [queries.node(), keys.node()];
        let (queries, keys) = (queries.into_primitive(), keys.into_primitive());
        match SparseDot.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let output = B::sparse_dot(
                    queries.clone(),
                    keys.clone(),
                    topk.clone(),
                    assignments.clone(),
                );
                prep.finish((queries, keys, topk, assignments), output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::sparse_dot(queries, keys, topk, assignments))
            }
        }
    }

    fn sparse_weighted_sum(
        weights: FloatTensor<Self>,
        values: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        let nodes = [weights.node(), values.node()];
        let (weights, values) = (weights.into_primitive(), values.into_primitive());
        match SparseWeightedSum
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let output = B::sparse_weighted_sum(
                    weights.clone(),
                    values.clone(),
                    topk.clone(),
                    assignments.clone(),
                );
                prep.finish((weights, values, topk, assignments), output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::sparse_weighted_sum(weights, values, topk, assignments))
            }
        }
    }

    fn sparse_scatter(
        weights: FloatTensor<Self>,
        x: FloatTensor<Self>,
        topk: IntTensor<Self>,
        assignments: IntTensor<Self>,
        keys_len: usize,
    ) -> FloatTensor<Self> {
        let nodes = [weights.node(), x.node()];
        let (weights, x) = (weights.into_primitive(), x.into_primitive());
        match SparseScatter.prepare::<C>(nodes).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let output = B::sparse_scatter(
                    weights.clone(),
                    x.clone(),
                    topk.clone(),
                    assignments.clone(),
                    keys_len,
                );
                prep.finish((weights, x, topk, assignments), output)
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(B::sparse_scatter(weights, x, topk, assignments, keys_len))
            }
        }
    }
}
