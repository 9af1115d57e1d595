//! Host [`top_attention`] and [`top_attention_backward`]: per `(batch, head)` and cluster, the
//! cluster's top-k keys and values gathered into small blocks, then its member queries.

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};
use rayon::prelude::*;

use super::access::{HostAccess, dims, key_lengths_on_host, on_host, write_float};
use super::gemm::{matmul_add, matmul_into};
use super::parallel::{DisjointRows, PARALLEL_THRESHOLD, head_splits};
use super::simd::{self, padded};
use super::sparse::{MEMBER_CHUNK, Members, Sparse, add_block_rows, gather_rows, prefetch_ahead};
use crate::dropout::AttentionDropout;
use crate::ops::checks::check_top_attention;
use crate::ops::{
    ClusterTop, ClusteredAttentionBackend, ClusteredAttentionBackward, Lengths, TopAttentionGrads,
    reference,
};

/// The queries' dimensions `[batch, heads, L, E]` and the values' `[batch, heads, S, D]`,
/// once [`check_top_attention`] has checked the shapes of the top-k attention's inputs.
///
/// # Panics
/// If the shapes disagree.
fn checked_dims<B: HostAccess + ClusteredAttentionBackend>(
    queries: &FloatTensor<B>,
    keys: &FloatTensor<B>,
    values: &FloatTensor<B>,
    clusters: &ClusterTop<B>,
) -> ([usize; 4], [usize; 4]) {
    let (queries, values) = (dims::<B, 4>(queries), dims::<B, 4>(values));
    check_top_attention(
        queries,
        dims::<B, 4>(keys),
        values,
        clusters.assignments.shape().dims(),
        clusters.topk.shape().dims(),
        dims::<B, 4>(&clusters.mass),
        dims::<B, 4>(&clusters.rest),
    );
    (queries, values)
}

/// Host [`ClusteredAttentionBackend::top_attention`](ClusteredAttentionBackend::top_attention) in
/// `f32` (`f16` and `bf16` widened): per `(batch, head)` (per run of its queries when there
/// are fewer `(batch, head)`s than threads) on rayon's pool and per cluster, the cluster's
/// top-k keys (transposed) and values gathered into small blocks, then for four member queries
/// at a time the scores, their softmax and the weighted sum in registers, plus the cluster's
/// rest row.
pub fn top_attention<B: HostAccess + ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    dropout: Option<AttentionDropout>,
) -> FloatTensor<B> {
    let floats = [&queries, &keys, &values, &clusters.mass, &clusters.rest];
    if !floats.iter().all(|x| on_host::<B>(x)) {
        return reference::top_attention::<B>(
            queries,
            keys,
            values,
            clusters,
            key_lengths.into(),
            scale,
            dropout,
        );
    }
    let (device, dtype) = (queries.device(), queries.dtype());
    let ([batch, heads, len, dim], [_, _, keys_len, dim_v]) =
        checked_dims::<B>(&queries, &keys, &values, &clusters);
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    let sparse = Sparse::read::<B>(clusters.topk, clusters.assignments);
    sparse.check(keys_len);
    let (k, num_clusters) = (sparse.k, sparse.clusters);
    let (kp, dp) = (padded(k), padded(dim_v));
    let mut out = vec![0f32; sparse.rows() * len * dim_v];
    B::with_f32(&queries, |queries| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                B::with_f32(&clusters.mass, |mass| {
                    B::with_f32(&clusters.rest, |rest| {
                        // One task per run of a (batch, head)'s queries: with fewer
                        // (batch, head)s than threads, a head's queries split into runs, each
                        // gathering the keys and values of the clusters it meets.
                        let runs = head_splits(sparse.rows(), len, 1024);
                        let run_len = len.div_ceil(runs);
                        let task = |(row, first, out): (usize, usize, &mut [f32])| {
                            let run = first..first + out.len() / dim_v;
                            let members = sparse.members_in(row, run.clone());
                            let valid = lengths[row / heads];
                            let queries =
                                &queries[(row * len + run.start) * dim..][..run.len() * dim];
                            let keys = &keys[row * keys_len * dim..(row + 1) * keys_len * dim];
                            let values =
                                &values[row * keys_len * dim_v..(row + 1) * keys_len * dim_v];
                            let mut key_t = vec![0f32; dim * kp];
                            let mut value_block = vec![0f32; k * dp];
                            let mut bias = vec![f32::NEG_INFINITY; kp];
                            let mut scratch = vec![0f32; 4 * kp];
                            let mut rest_row = vec![0f32; dp];
                            for j in 0..num_clusters {
                                let members = members.of(j);
                                if members.is_empty() {
                                    continue;
                                }
                                sparse.gather_transposed(row, j, keys, dim, &mut key_t);
                                sparse.gather(row, j, values, dim_v, &mut value_block);
                                sparse.prefetch_top(row, j + 1, keys, dim);
                                sparse.prefetch_top(row, j + 1, values, dim_v);
                                for (b, &t) in bias.iter_mut().zip(sparse.top(row, j)) {
                                    *b = if (t as usize) < valid {
                                        0.0
                                    } else {
                                        f32::NEG_INFINITY
                                    };
                                }
                                let c = row * num_clusters + j;
                                rest_row[..dim_v]
                                    .copy_from_slice(&rest[c * dim_v..(c + 1) * dim_v]);
                                let cluster = simd::ClusterBlock {
                                    key_t: &key_t,
                                    bias: &bias,
                                    values: &value_block,
                                    rest: &rest_row,
                                    dv: dim_v,
                                    mass: mass[c],
                                    scale: scale as f32,
                                    dropout: dropout.map(|d| (d, row as u32, run.start as u32)),
                                };
                                simd::attend_members(
                                    queries,
                                    dim,
                                    members,
                                    &cluster,
                                    &mut scratch,
                                    out,
                                );
                            }
                        };
                        if out.is_empty() {
                            return;
                        }
                        let tasks: Vec<_> = out
                            .chunks_mut(len * dim_v)
                            .enumerate()
                            .flat_map(|(row, out)| {
                                out.chunks_mut(run_len * dim_v)
                                    .enumerate()
                                    .map(move |(r, out)| (row, r * run_len, out))
                            })
                            .collect();
                        if tasks.len() == 1
                            || tasks.len() * run_len * k * (dim + dim_v) < PARALLEL_THRESHOLD
                        {
                            tasks.into_iter().for_each(task);
                        } else {
                            tasks.into_par_iter().for_each(task);
                        }
                    })
                })
            })
        })
    });
    write_float::<B, 4>(out, [batch, heads, len, dim_v], &device, dtype)
}

/// One `(batch, head)`'s operands of the host top-k attention's backward.
struct TopHead<'a> {
    sparse: &'a Sparse,
    row: usize,
    /// The `(batch, head)`'s valid keys.
    valid: usize,
    scale: f32,
    /// The `(batch, head)`'s masses, `[C]`.
    mass: &'a [f32],
    queries: &'a [f32],
    grad: &'a [f32],
    keys: &'a [f32],
    values: &'a [f32],
    dim: usize,
    dim_v: usize,
    /// The attention dropout: each weight times its factor (the forward pass's).
    dropout: Option<AttentionDropout>,
}

/// A task's blocks for [`TopHead::cluster`]: the cluster's top keys and values transposed
/// (`[ep, kp]`, `[dp, kp]`) and its top keys as rows (`[k, ep]`), its members' query and
/// gradient rows (`[n, ep]`, `[n, dp]`), their scores and gradient dot products (`[n, k]`), and
/// the results: the members' queries' gradient (`[n, dim]`), the top keys' and values' gradient
/// blocks (`[k, ep]`, `[k, dp]`) and the rest's gradient (`[dim_v]`). Sized for the largest
/// run of members and zeroed once: the loops overwrite what they read (the gradient blocks are
/// zeroed per cluster and added to over its runs), and padding stays zero.
struct TopScratch {
    key_t: Vec<f32>,
    value_t: Vec<f32>,
    key_block: Vec<f32>,
    bias: Vec<f32>,
    query_rows: Vec<f32>,
    grad_rows: Vec<f32>,
    probs: Vec<f32>,
    grad_scores: Vec<f32>,
    factors: Vec<f32>,
    positions: Vec<u32>,
    grad_queries: Vec<f32>,
    grad_keys: Vec<f32>,
    grad_values: Vec<f32>,
    grad_rest: Vec<f32>,
}

impl TopScratch {
    fn new(k: usize, dim: usize, dim_v: usize, most: usize) -> Self {
        let (kp, ep, dp) = (padded(k), padded(dim), padded(dim_v));
        Self {
            key_t: vec![0.0; ep * kp],
            value_t: vec![0.0; dp * kp],
            key_block: vec![0.0; k * ep],
            bias: vec![0.0; k],
            query_rows: vec![0.0; most * ep],
            grad_rows: vec![0.0; most * dp],
            probs: vec![0.0; most * k],
            grad_scores: vec![0.0; most * k],
            factors: vec![0.0; most * k],
            positions: (0..most as u32).collect(),
            grad_queries: vec![0.0; most * dim],
            grad_keys: vec![0.0; k * ep],
            grad_values: vec![0.0; k * dp],
            grad_rest: vec![0.0; dim_v],
        }
    }
}

impl TopHead<'_> {
    /// Cluster `j`'s gradients, for its `members`, into `s` (see [`TopScratch`]); returns the
    /// gradient of its mass. The cluster's top keys and values are gathered into small blocks;
    /// then per run of up to [`MEMBER_CHUNK`] members, their query and gradient rows gathered,
    /// their scores and the gradient's dot products with the values, the softmax's Jacobian in
    /// place, then their queries' gradient, passed to `write_queries(run, rows)`, and their
    /// share of the keys', values' and rest's gradients, added to the blocks. The five products
    /// of a run are `gemm` calls on its gathered rows.
    fn cluster(
        &self,
        j: usize,
        members: &[u32],
        s: &mut TopScratch,
        mut write_queries: impl FnMut(&[u32], &[f32]),
    ) -> f32 {
        let (sparse, row, k) = (self.sparse, self.row, self.sparse.k);
        let (dim, dim_v) = (self.dim, self.dim_v);
        let (ep, dp) = (padded(dim), padded(dim_v));
        let top = sparse.top(row, j);
        sparse.gather_transposed(row, j, self.keys, dim, &mut s.key_t);
        sparse.gather_transposed(row, j, self.values, dim_v, &mut s.value_t);
        sparse.gather(row, j, self.keys, dim, &mut s.key_block);
        sparse.prefetch_top(row, j + 1, self.keys, dim);
        sparse.prefetch_top(row, j + 1, self.values, dim_v);
        for (b, &t) in s.bias.iter_mut().zip(top) {
            *b = if (t as usize) < self.valid {
                0.0
            } else {
                f32::NEG_INFINITY
            };
        }
        s.grad_keys.fill(0.0);
        s.grad_values.fill(0.0);
        s.grad_rest.fill(0.0);
        let mut grad_mass = 0.0;
        for run in members.chunks(MEMBER_CHUNK) {
            let n = run.len();
            let local = &s.positions[..n];
            let query_rows = &mut s.query_rows[..n * ep];
            let grad_rows = &mut s.grad_rows[..n * dp];
            gather_rows(self.queries, dim, run, query_rows);
            gather_rows(self.grad, dim_v, run, grad_rows);
            let probs = &mut s.probs[..n * k];
            let grad_scores = &mut s.grad_scores[..n * k];
            let kp = padded(k);
            // SAFETY (the five products): the gathered rows are [n × ep] and [n × dp], the
            // transposed blocks [ep × kp] and [dp × kp], the key block and the keys' and
            // values' gradient blocks [k × ep] and [k × dp], probs and grad_scores [n × k],
            // grad_queries [n × dim]; no destination overlaps an operand.
            unsafe {
                matmul_into(
                    [n, k, dim],
                    (probs.as_mut_ptr(), 1, k as isize),
                    (query_rows.as_ptr(), 1, ep as isize),
                    (s.key_t.as_ptr(), 1, kp as isize),
                );
                matmul_into(
                    [n, k, dim_v],
                    (grad_scores.as_mut_ptr(), 1, k as isize),
                    (grad_rows.as_ptr(), 1, dp as isize),
                    (s.value_t.as_ptr(), 1, kp as isize),
                );
            }
            // With dropout, the weights are `m̂ · p` times the forward pass's factors: so is
            // the gradient of `p` (before the softmax's Jacobian), and the values' weights.
            let factors = &mut s.factors[..n * k];
            if let Some(dropout) = self.dropout {
                let stream = AttentionDropout::QUERY_TOP;
                factors.fill(1.0);
                simd::dropout_rows(&dropout, [stream, row as u32, 0], run, (k, k), factors);
                grad_scores
                    .iter_mut()
                    .zip(&*factors)
                    .for_each(|(g, f)| *g *= f);
            }
            grad_mass += simd::softmax_backward_members(
                probs,
                grad_scores,
                local,
                &s.bias,
                self.scale,
                self.mass[j],
            );
            if self.dropout.is_some() {
                probs.iter_mut().zip(&*factors).for_each(|(p, f)| *p *= f);
            }
            let grad_queries = &mut s.grad_queries[..n * dim];
            // Queries: dS · top keys; keys: dSᵀ · q; values: Wᵀ · g; rest: Σ_i g_i.
            unsafe {
                matmul_into(
                    [n, dim, k],
                    (grad_queries.as_mut_ptr(), 1, dim as isize),
                    (grad_scores.as_ptr(), 1, k as isize),
                    (s.key_block.as_ptr(), 1, ep as isize),
                );
                matmul_add(
                    true,
                    [k, ep, n],
                    (s.grad_keys.as_mut_ptr(), 1, ep as isize),
                    (grad_scores.as_ptr(), k as isize, 1),
                    (query_rows.as_ptr(), 1, ep as isize),
                );
                matmul_add(
                    true,
                    [k, dp, n],
                    (s.grad_values.as_mut_ptr(), 1, dp as isize),
                    (probs.as_ptr(), k as isize, 1),
                    (grad_rows.as_ptr(), 1, dp as isize),
                );
            }
            write_queries(run, grad_queries);
            for row in grad_rows.chunks_exact(dp) {
                for (o, &g) in s.grad_rest.iter_mut().zip(row) {
                    *o += g;
                }
            }
        }
        grad_mass
    }
}

/// One `(batch, head)`'s gradients of the queries and keys, and of the values, mass and rest.
type GradRows<'a> = (
    (&'a mut [f32], &'a mut [f32]),
    (&'a mut [f32], (&'a mut [f32], &'a mut [f32])),
);

/// The gradients of a run of a `(batch, head)`'s clusters, for a head split between tasks
/// (its queries' gradient rows are written in place): its clusters' key and value gradient
/// blocks (`[k, padded(dim)]`, `[k, padded(dim_v)]` each) and mass and rest gradients, put in
/// place afterwards, the blocks added in cluster order.
struct TopPart {
    row: usize,
    clusters: std::ops::Range<usize>,
    scratch: TopScratch,
    keys: Vec<f32>,
    values: Vec<f32>,
    mass: Vec<f32>,
    rest: Vec<f32>,
}

/// Host
/// [`ClusteredAttentionBackward::top_attention_backward`](ClusteredAttentionBackward::top_attention_backward)
/// in `f32` (`f16` and `bf16` widened): per `(batch, head)` on rayon's pool (per run of its
/// clusters when there are fewer `(batch, head)`s than threads and enough work) and per cluster
/// (one pass over its members); the keys' and values' gradients of each cluster are added to their
/// rows in cluster order, so the result does not depend on the split.
#[allow(clippy::too_many_arguments)]
pub fn top_attention_backward<B: HostAccess + ClusteredAttentionBackward>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    grad: FloatTensor<B>,
    dropout: Option<AttentionDropout>,
) -> TopAttentionGrads<B> {
    let floats = [&queries, &keys, &values, &clusters.mass, &grad];
    if !floats.iter().all(|x| on_host::<B>(x)) {
        return reference::top_attention_backward::<B>(
            queries,
            keys,
            values,
            clusters,
            Lengths::from(key_lengths),
            scale,
            grad,
            dropout,
        );
    }
    let (device, dtype) = (queries.device(), queries.dtype());
    let [batch, heads, len, dim] = dims::<B, 4>(&queries);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let clusters_len = dims::<B, 4>(&clusters.mass)[2];
    let g = top_backward_buffers::<B>(
        queries,
        keys,
        values,
        clusters,
        key_lengths,
        scale,
        grad,
        dropout,
    );
    TopAttentionGrads {
        queries: write_float::<B, 4>(g.queries, [batch, heads, len, dim], &device, dtype),
        keys: write_float::<B, 4>(g.keys, [batch, heads, keys_len, dim], &device, dtype),
        values: write_float::<B, 4>(g.values, [batch, heads, keys_len, dim_v], &device, dtype),
        mass: write_float::<B, 4>(g.mass, [batch, heads, clusters_len, 1], &device, dtype),
        rest: write_float::<B, 4>(g.rest, [batch, heads, clusters_len, dim_v], &device, dtype),
    }
}

/// The host top-k attention backward's gradients as `f32` buffers, in row-major order: of the
/// queries `[batch, heads, L, E]`, keys `[batch, heads, S, E]`, values `[batch, heads, S, D]`,
/// mass `[batch, heads, C, 1]` and rest `[batch, heads, C, D]`.
pub(super) struct TopGradBuffers {
    pub(super) queries: Vec<f32>,
    pub(super) keys: Vec<f32>,
    pub(super) values: Vec<f32>,
    pub(super) mass: Vec<f32>,
    pub(super) rest: Vec<f32>,
}

/// The body of [`top_attention_backward`] once its inputs are known to be on the host.
#[allow(clippy::too_many_arguments)]
pub(super) fn top_backward_buffers<B: HostAccess + ClusteredAttentionBackend>(
    queries: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    clusters: ClusterTop<B>,
    key_lengths: Option<IntTensor<B>>,
    scale: f64,
    grad: FloatTensor<B>,
    dropout: Option<AttentionDropout>,
) -> TopGradBuffers {
    let ([batch, heads, len, dim], [_, _, keys_len, dim_v]) =
        checked_dims::<B>(&queries, &keys, &values, &clusters);
    assert!(
        dims::<B, 4>(&grad) == [batch, heads, len, dim_v],
        "grad {:?} must be [batch, heads, L, D] = {:?}",
        dims::<B, 4>(&grad),
        [batch, heads, len, dim_v]
    );
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    let sparse = Sparse::read::<B>(clusters.topk, clusters.assignments);
    sparse.check(keys_len);
    let (k, num_clusters, rows) = (sparse.k, sparse.clusters, sparse.rows());
    let (ep, dp) = (padded(dim), padded(dim_v));
    let mut grad_queries = vec![0f32; rows * len * dim];
    let mut grad_keys = vec![0f32; rows * keys_len * dim];
    let mut grad_values = vec![0f32; rows * keys_len * dim_v];
    let mut grad_mass = vec![0f32; rows * num_clusters];
    let mut grad_rest = vec![0f32; rows * num_clusters * dim_v];
    let members: Vec<Members> = (0..rows)
        .into_par_iter()
        .map(|row| sparse.members(row))
        .collect();
    let most = |row: usize, clusters: std::ops::Range<usize>| {
        clusters
            .map(|j| members[row].of(j).len().min(MEMBER_CHUNK))
            .max()
            .unwrap_or(0)
    };
    B::with_f32(&queries, |queries| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                B::with_f32(&clusters.mass, |mass| {
                    B::with_f32(&grad, |grad| {
                        let head = |row: usize| TopHead {
                            sparse: &sparse,
                            row,
                            valid: lengths[row / heads],
                            scale: scale as f32,
                            mass: &mass[row * num_clusters..(row + 1) * num_clusters],
                            queries: &queries[row * len * dim..(row + 1) * len * dim],
                            grad: &grad[row * len * dim_v..(row + 1) * len * dim_v],
                            keys: &keys[row * keys_len * dim..(row + 1) * keys_len * dim],
                            values: &values[row * keys_len * dim_v..(row + 1) * keys_len * dim_v],
                            dim,
                            dim_v,
                            dropout,
                        };
                        // A whole head per task: the gradients go straight to their rows.
                        let work = |(row, ((dq, dk), (dv, (dm, dr)))): (usize, GradRows)| {
                            let head = head(row);
                            let mut s = TopScratch::new(k, dim, dim_v, most(row, 0..num_clusters));
                            for j in 0..num_clusters {
                                let members = members[row].of(j);
                                if members.is_empty() {
                                    continue;
                                }
                                sparse.prefetch_top(row, j + 1, dk, dim);
                                sparse.prefetch_top(row, j + 1, dv, dim_v);
                                dm[j] = head.cluster(j, members, &mut s, |run, rows| {
                                    let rows = rows.chunks_exact(dim);
                                    for (m, (&i, g)) in run.iter().zip(rows).enumerate() {
                                        prefetch_ahead(dq, dim, run, m);
                                        let i = i as usize;
                                        dq[i * dim..(i + 1) * dim].copy_from_slice(g);
                                    }
                                });
                                let top = sparse.top(row, j);
                                add_block_rows(&s.grad_keys, top, dim, dk);
                                add_block_rows(&s.grad_values, top, dim_v, dv);
                                dr[j * dim_v..(j + 1) * dim_v].copy_from_slice(&s.grad_rest);
                            }
                        };
                        let cost = len * k * (3 * dim + 2 * dim_v);
                        let splits = if rows * cost < PARALLEL_THRESHOLD {
                            1
                        } else {
                            head_splits(rows, len, 1024)
                        };
                        if splits == 1 {
                            let parts: Vec<_> = grad_queries
                                .chunks_mut(len * dim)
                                .zip(grad_keys.chunks_mut(keys_len * dim))
                                .zip(
                                    grad_values.chunks_mut(keys_len * dim_v).zip(
                                        grad_mass
                                            .chunks_mut(num_clusters)
                                            .zip(grad_rest.chunks_mut(num_clusters * dim_v)),
                                    ),
                                )
                                .enumerate()
                                .collect();
                            if rows == 1 || rows * cost < PARALLEL_THRESHOLD {
                                parts.into_iter().for_each(work);
                            } else {
                                parts.into_par_iter().for_each(work);
                            }
                            return;
                        }
                        // A run of a head's clusters per task: its queries' gradient rows in
                        // place, the rest into its part.
                        let dq = DisjointRows::new(&mut grad_queries, dim);
                        let part_work = |part: &mut TopPart| {
                            let (row, clusters) = (part.row, part.clusters.clone());
                            let head = head(row);
                            let s = &mut part.scratch;
                            for j in clusters {
                                let members = members[row].of(j);
                                let grad_mass = if members.is_empty() {
                                    s.grad_keys.fill(0.0);
                                    s.grad_values.fill(0.0);
                                    s.grad_rest.fill(0.0);
                                    0.0
                                } else {
                                    head.cluster(j, members, s, |run, rows| {
                                        for (&i, g) in run.iter().zip(rows.chunks_exact(dim)) {
                                            let i = row * len + i as usize;
                                            // SAFETY: query i is a member of cluster j only,
                                            // and no other task has cluster j.
                                            unsafe { dq.row(i) }.copy_from_slice(g);
                                        }
                                    })
                                };
                                part.mass.push(grad_mass);
                                part.keys.extend_from_slice(&s.grad_keys);
                                part.values.extend_from_slice(&s.grad_values);
                                part.rest.extend_from_slice(&s.grad_rest);
                            }
                        };
                        let mut parts: Vec<TopPart> = (0..rows)
                            .flat_map(|row| {
                                cluster_runs(&members[row], num_clusters, splits)
                                    .into_iter()
                                    .map(move |clusters| {
                                        let c = clusters.len();
                                        TopPart {
                                            row,
                                            scratch: TopScratch::new(
                                                k,
                                                dim,
                                                dim_v,
                                                most(row, clusters.clone()),
                                            ),
                                            clusters,
                                            keys: Vec::with_capacity(c * k * ep),
                                            values: Vec::with_capacity(c * k * dp),
                                            mass: Vec::with_capacity(c),
                                            rest: Vec::with_capacity(c * dim_v),
                                        }
                                    })
                            })
                            .collect();
                        parts.par_iter_mut().for_each(part_work);
                        // Each head's key and value blocks added in cluster order (and its
                        // mass and rest gradients put in place), heads in parallel.
                        let outs: Vec<_> = grad_keys
                            .chunks_mut(keys_len * dim)
                            .zip(grad_values.chunks_mut(keys_len * dim_v))
                            .zip(
                                grad_mass
                                    .chunks_mut(num_clusters)
                                    .zip(grad_rest.chunks_mut(num_clusters * dim_v)),
                            )
                            .enumerate()
                            .collect();
                        outs.into_par_iter()
                            .for_each(|(row, ((dk, dv), (dm, dr)))| {
                                for part in parts.iter().filter(|p| p.row == row) {
                                    for (c, j) in part.clusters.clone().enumerate() {
                                        if members[row].of(j).is_empty() {
                                            continue;
                                        }
                                        let top = sparse.top(row, j);
                                        let key_block = &part.keys[c * k * ep..(c + 1) * k * ep];
                                        let value_block =
                                            &part.values[c * k * dp..(c + 1) * k * dp];
                                        add_block_rows(key_block, top, dim, dk);
                                        add_block_rows(value_block, top, dim_v, dv);
                                        dm[j] = part.mass[c];
                                        dr[j * dim_v..(j + 1) * dim_v].copy_from_slice(
                                            &part.rest[c * dim_v..(c + 1) * dim_v],
                                        );
                                    }
                                }
                            });
                    })
                })
            })
        })
    });
    TopGradBuffers {
        queries: grad_queries,
        keys: grad_keys,
        values: grad_values,
        mass: grad_mass,
        rest: grad_rest,
    }
}

/// Up to `splits` runs of consecutive clusters covering `0..clusters`, none empty (but the one
/// run of no clusters), with about as many `members` each.
fn cluster_runs(members: &Members, clusters: usize, splits: usize) -> Vec<std::ops::Range<usize>> {
    let total = members.start[clusters];
    let mut runs = Vec::with_capacity(splits);
    let mut first = 0;
    for p in 1..splits {
        // The first cluster that starts at or past this run's share of the members.
        let end = (first..clusters)
            .find(|&j| members.start[j] * splits >= p * total)
            .unwrap_or(clusters);
        if end > first {
            runs.push(first..end);
            first = end;
        }
    }
    if first < clusters || runs.is_empty() {
        runs.push(first..clusters);
    }
    runs
}
