//! Host [`centroid_attention`] and [`centroid_attention_backward`]: one pass over the keys, a
//! block of cluster rows against a part of the keys at a time, as flash attention makes it.

use burn::backend::TensorMetadata;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::tensor::DType;
use rayon::prelude::*;

use super::access::{
    HostAccess, dims, key_lengths_on_host, on_host, read_ints, write_float, write_ints,
};
use super::gemm::{matmul_add, matmul_into};
use super::parallel::{PARALLEL_THRESHOLD, head_splits};
use super::simd;
use crate::dropout::AttentionDropout;
use crate::ops::checks::check_centroid_attention;
use crate::ops::{
    CentroidAttention, CentroidAttentionGrads, ClusteredAttentionBackend,
    ClusteredAttentionBackward, Lengths, reference,
};

/// Cluster rows per block of the host centroid attention: all the clusters of a head in the
/// paper's settings, so that each part of the keys and values is packed for `gemm` once per
/// head.
const CENTROID_ROWS: usize = 128;

/// Keys per task of the host centroid attention's backward: a `(batch, head)` splits into
/// tasks of four parts, so that the pool's threads share the work whatever the number of
/// heads; each task has its own block of the centroids' gradient, summed afterwards.
const KEY_CHUNK: usize = 4 * KEY_PART;

/// Keys per part of the host centroid attention: a block's scores against one part,
/// `128 × 512` floats (256 KiB), and the part's keys and values stay in a core's L2 cache
/// through the top-k, the softmax and the products, whatever the sequence length (as in
/// flash attention).
const KEY_PART: usize = 512;

thread_local! {
    /// The scores block of the host centroid attention, reused between calls.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Host
/// [`ClusteredAttentionBackward::centroid_attention_forward`](ClusteredAttentionBackward::centroid_attention_forward)
/// (and, without its log-sum-exps,
/// [`ClusteredAttentionBackend::centroid_attention`](ClusteredAttentionBackend::centroid_attention))
/// in `f32` (`f16` and `bf16` widened), one pass over the keys as flash attention makes it: for
/// every block of up to 128 cluster rows of a `(batch, head)` (fewer rows when there are fewer
/// `(batch, head)`s than threads), on rayon's pool, and every part of 512 valid keys, the part's
/// scores (a `gemm` product into a per-thread scratch block), each row's top-k so far updated, the
/// online softmax (the rows' running maxima and sums, `e^(scores − max)` in place), and the product
/// of the part's weights outside the current top-k with its values added to the rescaled output
/// rows. A key that leaves a row's top-k in a later part adds its weight times its value then, so
/// the output is the rest of `Aᶜ V` without a subtraction. Also returns each row's log-sum-exp of
/// the scores (`f32`), which the backward pass uses. Falls back to the default body (without
/// log-sum-exps) when an input is not `f32`, `f16` or `bf16`, or is empty.
pub fn centroid_attention<B: HostAccess + ClusteredAttentionBackend>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Option<IntTensor<B>>,
    topk: usize,
    dropout: Option<AttentionDropout>,
) -> CentroidAttention<B> {
    let empty = [&centroids, &values]
        .iter()
        .any(|x| x.shape().num_elements() == 0);
    if empty || ![&centroids, &keys, &values].iter().all(|x| on_host::<B>(x)) {
        let (values, top) = reference::centroid_attention::<B>(
            centroids,
            keys,
            values,
            key_lengths.into(),
            topk,
            dropout,
        );
        return CentroidAttention {
            values,
            top,
            log_sum_exp: None,
        };
    }
    let (device, dtype) = (centroids.device(), centroids.dtype());
    let ([batch, heads, clusters, dim], [_, _, keys_len, dim_v]) = check_centroid_attention(
        dims::<B, 4>(&centroids),
        dims::<B, 4>(&keys),
        dims::<B, 4>(&values),
        topk,
    );
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    // One block of rows of one (batch, head) per task; `top_k` keeps chunks non-empty. With
    // fewer (batch, head)s than threads, a head's rows split into as many blocks as it takes
    // to give every thread one (of 16 rows or more): each block packs the keys once more.
    let top_k = topk.max(1);
    let blocks = head_splits(batch * heads, clusters, 16);
    let block_rows = clusters.div_ceil(blocks).clamp(1, CENTROID_ROWS);
    let mut out = vec![0f32; batch * heads * clusters * dim_v];
    let mut top = vec![0i64; batch * heads * clusters * top_k];
    let mut top_weights = vec![0f32; batch * heads * clusters * top_k];
    let mut log_sum_exp = vec![0f32; batch * heads * clusters];
    B::with_f32(&centroids, |centroids| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                let task = |bh: usize, r0: usize, block: CentroidRows| {
                    let valid = lengths[bh / heads];
                    let rows = block.log_sum_exp.len();
                    let centroids = &centroids[(bh * clusters + r0) * dim..][..rows * dim];
                    let keys = &keys[bh * keys_len * dim..][..valid * dim];
                    let values = &values[bh * keys_len * dim_v..][..valid * dim_v];
                    SCRATCH.with_borrow_mut(|scores| {
                        scores.resize(rows * KEY_PART, 0.0);
                        centroid_rows_forward(
                            centroids,
                            keys,
                            values,
                            [dim, dim_v, topk],
                            scores,
                            block,
                            dropout.map(|d| (d, bh as u32, r0 as u32)),
                        );
                    });
                };
                let parts = out
                    .chunks_mut(clusters * dim_v)
                    .zip(top.chunks_mut(clusters * top_k))
                    .zip(top_weights.chunks_mut(clusters * top_k))
                    .zip(log_sum_exp.chunks_mut(clusters))
                    .enumerate()
                    .flat_map(|(bh, (((o, t), w), l))| {
                        let rows = block_rows;
                        o.chunks_mut(rows * dim_v)
                            .zip(t.chunks_mut(rows * top_k))
                            .zip(w.chunks_mut(rows * top_k))
                            .zip(l.chunks_mut(rows))
                            .enumerate()
                            .map(move |(i, (((o, t), w), l))| {
                                let block = CentroidRows {
                                    out: o,
                                    top: t,
                                    top_weights: w,
                                    log_sum_exp: l,
                                };
                                (bh, i * rows, block)
                            })
                    });
                if batch * heads * clusters * keys_len * (dim + dim_v) < PARALLEL_THRESHOLD {
                    parts.for_each(|(bh, r0, block)| task(bh, r0, block));
                } else {
                    parts
                        .collect::<Vec<_>>()
                        .into_par_iter()
                        .for_each(|(bh, r0, block)| task(bh, r0, block));
                }
            })
        })
    });
    let shape = [batch, heads, clusters, topk];
    CentroidAttention {
        values: write_float::<B, 4>(out, [batch, heads, clusters, dim_v], &device, dtype),
        top: (topk > 0).then(|| {
            (
                write_ints::<B, 4>(top, shape, &device),
                write_float::<B, 4>(top_weights, shape, &device, dtype),
            )
        }),
        log_sum_exp: Some(write_float::<B, 4>(
            log_sum_exp,
            [batch, heads, clusters, 1],
            &device,
            DType::F32,
        )),
    }
}

/// `scores [rows × n] = centroids [rows × E] · part_keysᵀ`: the scores of a block of cluster
/// rows against a part of `n` keys, row stride `n`.
///
/// # Panics
/// If `scores` holds fewer than `rows × n` floats.
fn part_scores(centroids: &[f32], part_keys: &[f32], dim: usize, scores: &mut [f32]) {
    let (rows, n) = (centroids.len() / dim, part_keys.len() / dim);
    let scores = &mut scores[..rows * n];
    // SAFETY: scores [rows × n], centroids [rows × E] and part_keys [n × E] are addressed
    // within their slices, and scores overlaps neither operand.
    unsafe {
        matmul_into(
            [rows, n, dim],
            (scores.as_mut_ptr(), 1, n as isize),
            (centroids.as_ptr(), 1, dim as isize),
            (part_keys.as_ptr(), dim as isize, 1),
        );
    }
}

/// The outputs of one block of cluster rows of the host centroid attention: the rest of
/// `Aᶜ V` `[rows, D]`, the top-k keys and their weights `[rows, k]` (one ignored column when
/// `k = 0`), and the log-sum-exp of the scores `[rows]`.
struct CentroidRows<'a> {
    out: &'a mut [f32],
    top: &'a mut [i64],
    top_weights: &'a mut [f32],
    log_sum_exp: &'a mut [f32],
}

/// The centroid attention of one block of cluster rows against the `valid` keys and values
/// of its `(batch, head)`, one part of [`KEY_PART`] keys at a time; `scores` is scratch of at
/// least `rows × KEY_PART` floats. With `dropout` (and the `(batch, head)`'s index and the
/// block's first row), the weights in the rest are multiplied by the dropout's factors.
#[allow(clippy::too_many_arguments)]
fn centroid_rows_forward(
    centroids: &[f32],
    keys: &[f32],
    values: &[f32],
    [dim, dim_v, topk]: [usize; 3],
    scores: &mut [f32],
    block: CentroidRows,
    dropout: Option<(AttentionDropout, u32, u32)>,
) {
    // A kept weight's factor, 1 / (1 − p), as a shift of the evicted keys' log-weights.
    let log_scale = dropout.map_or(0.0, |(d, ..)| d.scale().ln());
    let rows = block.log_sum_exp.len();
    let valid = keys.len() / dim;
    let mut max = vec![f32::NEG_INFINITY; rows];
    let mut sum = vec![0f32; rows];
    let mut best: Vec<Vec<(f32, u32)>> = (0..rows).map(|_| Vec::with_capacity(topk + 1)).collect();
    let mut evicted = Vec::new();
    for offset in (0..valid).step_by(KEY_PART) {
        let n = (valid - offset).min(KEY_PART);
        let part = &mut scores[..rows * n];
        let part_keys = &keys[offset * dim..(offset + n) * dim];
        let part_values = &values[offset * dim_v..(offset + n) * dim_v];
        part_scores(centroids, part_keys, dim, part);
        for (r, row) in part.chunks_exact_mut(n).enumerate() {
            let best = &mut best[r];
            evicted.clear();
            let entered = simd::topk_offer(row, offset, topk, best, &mut evicted);
            let (new_max, part_sum) = simd::exp_row(row, max[r]);
            let out = &mut block.out[r * dim_v..(r + 1) * dim_v];
            if offset > 0 && new_max != max[r] {
                let factor = simd::exp_f32(max[r] - new_max);
                sum[r] *= factor;
                out.iter_mut().for_each(|o| *o *= factor);
            }
            sum[r] += part_sum;
            max[r] = new_max;
            // With dropout, this part's weights times their factors, and of the keys that left
            // the top-k, the kept ones.
            if let Some((d, bh, r0)) = dropout {
                let cluster = r0 + r as u32;
                let stream = AttentionDropout::CLUSTER_ROWS;
                evicted.retain(|&(_, key)| d.factor(stream, bh, cluster, key) != 0.0);
                simd::dropout_run(&d, [stream, bh, cluster, offset as u32], row);
            }
            // Keys of earlier parts that left the top-k join the rest now.
            if !evicted.is_empty() {
                simd::add_weighted_rows(&evicted, new_max - log_scale, values, out);
            }
            // The weights of this part's keys in the top-k so far stay out of the product.
            if entered {
                for &(_, key) in best.iter() {
                    if let Some(i) = (key as usize).checked_sub(offset).filter(|&i| i < n) {
                        row[i] = 0.0;
                    }
                }
            }
        }
        // SAFETY: out [rows × D] (+)= part [rows × n] · values [n × D], within their slices.
        unsafe {
            matmul_add(
                offset > 0,
                [rows, dim_v, n],
                (block.out.as_mut_ptr(), 1, dim_v as isize),
                (part.as_ptr(), 1, n as isize),
                (part_values.as_ptr(), 1, dim_v as isize),
            );
        }
    }
    for r in 0..rows {
        let inv = 1.0 / sum[r];
        block.out[r * dim_v..(r + 1) * dim_v]
            .iter_mut()
            .for_each(|o| *o *= inv);
        block.log_sum_exp[r] = max[r] + sum[r].ln();
        if topk == 0 {
            continue;
        }
        let top = &mut block.top[r * topk..(r + 1) * topk];
        let weights = &mut block.top_weights[r * topk..(r + 1) * topk];
        // With fewer valid keys than k, the padded keys follow in order, with weight 0 (as
        // a ranking of the whole row with the padded scores at -inf gives them).
        let padded = (valid..).map(|key| (f32::NEG_INFINITY, key as u32));
        for ((t, w), (score, key)) in top
            .iter_mut()
            .zip(weights.iter_mut())
            .zip(best[r].iter().copied().chain(padded))
        {
            *t = key as i64;
            *w = simd::exp_f32(score - max[r]) * inv;
        }
    }
}

thread_local! {
    /// The gradient block of the host centroid attention's backward, beside [`SCRATCH`].
    static GRAD_SCRATCH: std::cell::RefCell<Vec<f32>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// A task of the host centroid attention's backward: its `(batch, head)`, the first of its
/// keys, and its share of the centroids' gradient and its keys' and values' gradients.
type CentroidTask<'a> = (
    usize,
    usize,
    (&'a mut [f32], (&'a mut [f32], &'a mut [f32])),
);

/// Host
/// [`ClusteredAttentionBackward::centroid_attention_backward`](ClusteredAttentionBackward::centroid_attention_backward)
/// in `f32` (`f16` and `bf16` widened), one pass over the keys as flash attention's backward makes
/// it: `rowsum(Aᶜ ⊙ dA)` of every cluster row from the forward outputs, then per `(batch, head)`
/// and chunk of 2048 valid keys on rayon's pool, per block of up to 128 cluster rows and per part
/// of 512 keys, the part's scores and `dA = grad_values · valuesᵀ` (two `gemm` products into
/// per-thread scratch blocks), the top-k weights' gradients at the top-k keys, `Aᶜ` from the scores
/// and the forward's log-sum-exps with the softmax's Jacobian in place, then `dS · keys` added to
/// the chunk's block of the centroids' gradient and `dSᵀ · centroids` and `Rᵀ · grad_values` (`R`:
/// `Aᶜ` without the top-k keys) to the part's keys' and values' gradients; the chunks' blocks are
/// summed in order of their keys. Falls back to the default body when `forward` has no
/// log-sum-exps.
#[allow(clippy::too_many_arguments)]
pub fn centroid_attention_backward<B: HostAccess + ClusteredAttentionBackward>(
    centroids: FloatTensor<B>,
    keys: FloatTensor<B>,
    values: FloatTensor<B>,
    key_lengths: Option<IntTensor<B>>,
    forward: CentroidAttention<B>,
    grad_values: FloatTensor<B>,
    grad_top_weights: Option<FloatTensor<B>>,
    dropout: Option<AttentionDropout>,
) -> CentroidAttentionGrads<B> {
    let empty = [&centroids, &values]
        .iter()
        .any(|x| x.shape().num_elements() == 0);
    let floats = [&centroids, &keys, &values, &grad_values, &forward.values];
    let on_host_all = floats.iter().all(|x| on_host::<B>(x))
        && grad_top_weights.as_ref().is_none_or(|x| on_host::<B>(x))
        && forward.top.as_ref().is_none_or(|(_, w)| on_host::<B>(w))
        && forward
            .log_sum_exp
            .as_ref()
            .is_some_and(|x| on_host::<B>(x));
    if empty || !on_host_all || forward.top.is_some() != grad_top_weights.is_some() {
        return reference::centroid_attention_backward::<B>(
            centroids,
            keys,
            values,
            Lengths::from(key_lengths),
            forward,
            grad_values,
            grad_top_weights,
            dropout,
        );
    }
    let (device, dtype) = (centroids.device(), centroids.dtype());
    let [batch, heads, clusters, dim] = dims::<B, 4>(&centroids);
    let [_, _, keys_len, dim_v] = dims::<B, 4>(&values);
    let mut grad_keys = vec![0f32; batch * heads * keys_len * dim];
    let mut grad_vals = vec![0f32; batch * heads * keys_len * dim_v];
    let grad_centroids = centroid_backward_into::<B>(
        [centroids, keys, values],
        key_lengths,
        forward,
        grad_values,
        grad_top_weights,
        (&mut grad_keys, &mut grad_vals),
        dropout,
    );
    CentroidAttentionGrads {
        centroids: write_float::<B, 4>(
            grad_centroids,
            [batch, heads, clusters, dim],
            &device,
            dtype,
        ),
        keys: write_float::<B, 4>(grad_keys, [batch, heads, keys_len, dim], &device, dtype),
        values: write_float::<B, 4>(grad_vals, [batch, heads, keys_len, dim_v], &device, dtype),
    }
}

/// The body of [`centroid_attention_backward`] once its inputs are known to be on the host,
/// with the log-sum-exps and the top-k (or neither): adds the keys' and values' gradients to
/// `grad_keys` `[batch, heads, S, E]` and `grad_vals` `[batch, heads, S, D]` and returns the
/// centroids' gradient `[batch, heads, C, E]`. With `dropout`, the forward pass's factors are
/// drawn again.
pub(super) fn centroid_backward_into<B: HostAccess + ClusteredAttentionBackend>(
    [centroids, keys, values]: [FloatTensor<B>; 3],
    key_lengths: Option<IntTensor<B>>,
    forward: CentroidAttention<B>,
    grad_values: FloatTensor<B>,
    grad_top_weights: Option<FloatTensor<B>>,
    (grad_keys, grad_vals): (&mut [f32], &mut [f32]),
    dropout: Option<AttentionDropout>,
) -> Vec<f32> {
    let ([batch, heads, clusters, dim], [_, _, keys_len, dim_v]) = check_centroid_attention(
        dims::<B, 4>(&centroids),
        dims::<B, 4>(&keys),
        dims::<B, 4>(&values),
        0,
    );
    for (name, x) in [
        ("grad_values", &grad_values),
        ("forward.values", &forward.values),
    ] {
        assert!(
            dims::<B, 4>(x) == [batch, heads, clusters, dim_v],
            "{name} {:?} must be [batch, heads, C, D] = {:?}",
            dims::<B, 4>(x),
            [batch, heads, clusters, dim_v]
        );
    }
    let log_sum_exp = forward.log_sum_exp.expect("checked above");
    assert!(
        dims::<B, 4>(&log_sum_exp) == [batch, heads, clusters, 1],
        "forward.log_sum_exp {:?} must be [batch, heads, C, 1] = {:?}",
        dims::<B, 4>(&log_sum_exp),
        [batch, heads, clusters, 1]
    );
    let (top, top_weights, k) = match forward.top {
        Some((top, weights)) => {
            let (top, shape) = read_ints::<B, 4>(top);
            let grad_shape = dims::<B, 4>(grad_top_weights.as_ref().expect("checked above"));
            assert!(
                shape == grad_shape
                    && shape == dims::<B, 4>(&weights)
                    && shape[..3] == [batch, heads, clusters],
                "forward.top {shape:?}, its weights {:?} and grad_top_weights {grad_shape:?} \
                 must all be [batch, heads, C, k] with [batch, heads, C] = {:?}",
                dims::<B, 4>(&weights),
                [batch, heads, clusters]
            );
            if let Some(t) = top.iter().find(|&&t| !(0..keys_len as i64).contains(&t)) {
                panic!("forward.top holds {t}, outside 0..{keys_len} (the number of keys)");
            }
            (top, Some(weights), shape[3])
        }
        None => (Vec::new(), None, 0),
    };
    let lengths = key_lengths_on_host::<B>(key_lengths, batch, keys_len);
    // δ = rowsum(Aᶜ ⊙ dA) = grad_values · rest + grad_top_weights · top weights, per row.
    let mut delta = vec![0f32; batch * heads * clusters];
    B::with_f32(&grad_values, |grad_values| {
        B::with_f32(&forward.values, |rest| {
            let rows = grad_values
                .chunks_exact(dim_v)
                .zip(rest.chunks_exact(dim_v));
            for (d, (g, r)) in delta.iter_mut().zip(rows) {
                *d = g.iter().zip(r).map(|(&g, &r)| g * r).sum();
            }
        })
    });
    if let (Some(weights), Some(grad_top)) = (&top_weights, &grad_top_weights) {
        B::with_f32(weights, |weights| {
            B::with_f32(grad_top, |grad_top| {
                let rows = weights.chunks_exact(k).zip(grad_top.chunks_exact(k));
                for (d, (w, g)) in delta.iter_mut().zip(rows) {
                    *d += w.iter().zip(g).map(|(&w, &g)| w * g).sum::<f32>();
                }
            })
        });
    }
    let mut grad_centroids = vec![0f32; batch * heads * clusters * dim];
    let chunks_of = |bh: usize| lengths[bh / heads].div_ceil(KEY_CHUNK);
    let chunks: usize = (0..batch * heads).map(chunks_of).sum();
    let mut partial = vec![0f32; chunks * clusters * dim];
    assert!(
        grad_keys.len() == batch * heads * keys_len * dim
            && grad_vals.len() == batch * heads * keys_len * dim_v,
        "the keys' and values' gradient buffers must hold [batch, heads, S, E] and \
         [batch, heads, S, D] floats"
    );
    let no_top = [];
    B::with_f32(&centroids, |centroids| {
        B::with_f32(&keys, |keys| {
            B::with_f32(&values, |values| {
                B::with_f32(&grad_values, |grad_values| {
                    B::with_f32(&log_sum_exp, |log_sum_exp| {
                        let with_top = |f: &mut dyn FnMut(&[f32])| match &grad_top_weights {
                            Some(g) => B::with_f32(g, f),
                            None => f(&no_top),
                        };
                        with_top(&mut |grad_top: &[f32]| {
                            let task = |(bh, first, (dc, (dk, dv))): CentroidTask| {
                                let n = dk.len() / dim;
                                let keys = &keys[(bh * keys_len + first) * dim..][..n * dim];
                                let values =
                                    &values[(bh * keys_len + first) * dim_v..][..n * dim_v];
                                let head = CentroidHead {
                                    centroids: head_rows(centroids, bh, clusters * dim),
                                    grad_values: head_rows(grad_values, bh, clusters * dim_v),
                                    top: &top[bh * clusters * k..][..clusters * k],
                                    grad_top: head_rows(grad_top, bh, clusters * k),
                                    log_sum_exp: head_rows(log_sum_exp, bh, clusters),
                                    delta: head_rows(&delta, bh, clusters),
                                    dropout: dropout.map(|d| (d, bh as u32)),
                                };
                                SCRATCH.with_borrow_mut(|scores| {
                                    GRAD_SCRATCH.with_borrow_mut(|grads| {
                                        let rows = clusters.min(CENTROID_ROWS);
                                        scores.resize(rows * KEY_PART, 0.0);
                                        grads.resize(rows * KEY_PART, 0.0);
                                        centroid_head_backward(
                                            &head,
                                            first,
                                            keys,
                                            values,
                                            [dim, dim_v, k],
                                            (scores, grads),
                                            (dc, dk, dv),
                                        );
                                    })
                                });
                            };
                            // One task per chunk of a (batch, head)'s valid keys: the keys' and
                            // values' gradients of the chunk, and its share of the centroids'
                            // gradient in a block of its own.
                            let mut tasks = Vec::with_capacity(partial.len() / (clusters * dim));
                            let mut blocks = partial.chunks_exact_mut(clusters * dim);
                            let heads_grads = grad_keys
                                .chunks_mut(keys_len * dim)
                                .zip(grad_vals.chunks_mut(keys_len * dim_v));
                            for (bh, (dk, dv)) in heads_grads.enumerate() {
                                let valid = lengths[bh / heads];
                                let chunks = dk[..valid * dim]
                                    .chunks_mut(KEY_CHUNK * dim)
                                    .zip(dv[..valid * dim_v].chunks_mut(KEY_CHUNK * dim_v));
                                for (i, grads) in chunks.enumerate() {
                                    let dc = blocks.next().expect("a block per chunk");
                                    tasks.push((bh, i * KEY_CHUNK, (dc, grads)));
                                }
                            }
                            let cost = clusters * KEY_CHUNK * (dim + dim_v);
                            if tasks.len() == 1 || tasks.len() * cost < PARALLEL_THRESHOLD {
                                tasks.into_iter().for_each(task);
                            } else {
                                tasks.into_par_iter().for_each(task);
                            }
                        })
                    })
                })
            })
        })
    });
    // The centroids' gradient: the chunks' shares in order of their keys.
    let mut blocks = partial.chunks_exact(clusters * dim);
    for (bh, dc) in grad_centroids.chunks_mut(clusters * dim).enumerate() {
        for block in blocks.by_ref().take(chunks_of(bh)) {
            for (o, &x) in dc.iter_mut().zip(block) {
                *o += x;
            }
        }
    }
    grad_centroids
}

/// The `bh`-th run of `n` values of `x`.
fn head_rows(x: &[f32], bh: usize, n: usize) -> &[f32] {
    &x[bh * n..(bh + 1) * n]
}

/// One `(batch, head)` of the centroid attention's backward: the scaled centroids `[C, E]`,
/// the gradient of the rest of `Aᶜ V` `[C, D]`, the top-k indices and their weights'
/// gradient `[C, k]` (empty without top-k), and each row's log-sum-exp of the scores and
/// `rowsum(Aᶜ ⊙ dA)` `[C]`, and the dropout with the `(batch, head)`'s index.
struct CentroidHead<'a> {
    centroids: &'a [f32],
    grad_values: &'a [f32],
    top: &'a [i64],
    grad_top: &'a [f32],
    log_sum_exp: &'a [f32],
    delta: &'a [f32],
    dropout: Option<(AttentionDropout, u32)>,
}

/// The backward of one [`CentroidHead`] against a run of its valid keys and values, from key
/// `first` on, a block of up to [`CENTROID_ROWS`] rows against a part of [`KEY_PART`] keys at
/// a time; `scratch` is two blocks of at least `min(C, 128) × KEY_PART` floats. Writes the
/// run's share of the centroids' gradients and adds the run's keys' and values' gradients to
/// what `grad_keys` and `grad_values` hold.
fn centroid_head_backward(
    head: &CentroidHead,
    first: usize,
    keys: &[f32],
    values: &[f32],
    [dim, dim_v, k]: [usize; 3],
    (scores, grads): (&mut [f32], &mut [f32]),
    (grad_centroids, grad_keys, grad_values): (&mut [f32], &mut [f32], &mut [f32]),
) {
    let clusters = head.log_sum_exp.len();
    let valid = keys.len() / dim;
    // A row's dropout factors for one part of the keys.
    let mut factors = vec![1f32; KEY_PART];
    for r0 in (0..clusters).step_by(CENTROID_ROWS) {
        let rows = (clusters - r0).min(CENTROID_ROWS);
        let centroids = &head.centroids[r0 * dim..(r0 + rows) * dim];
        let grad_out = &head.grad_values[r0 * dim_v..(r0 + rows) * dim_v];
        let grad_centroids = &mut grad_centroids[r0 * dim..(r0 + rows) * dim];
        for offset in (0..valid).step_by(KEY_PART) {
            let n = (valid - offset).min(KEY_PART);
            let (weights, grads) = (&mut scores[..rows * n], &mut grads[..rows * n]);
            let part_keys = &keys[offset * dim..(offset + n) * dim];
            let part_values = &values[offset * dim_v..(offset + n) * dim_v];
            part_scores(centroids, part_keys, dim, weights);
            // SAFETY (the other four products): every operand is addressed within its slice,
            // the scratch blocks as [rows × n], the part's keys [n × E] and values [n × D],
            // the block's centroids and their gradient [rows × E], grad_out [rows × D], and
            // the part's keys' and values' gradients [n × E] and [n × D]; no destination
            // overlaps an operand.
            unsafe {
                // dA = grad_out · valuesᵀ.
                matmul_into(
                    [rows, n, dim_v],
                    (grads.as_mut_ptr(), 1, n as isize),
                    (grad_out.as_ptr(), 1, dim_v as isize),
                    (part_values.as_ptr(), dim_v as isize, 1),
                );
            }
            for (r, (w, g)) in weights
                .chunks_exact_mut(n)
                .zip(grads.chunks_exact_mut(n))
                .enumerate()
            {
                let c = r0 + r;
                let top = &head.top[c * k..(c + 1) * k];
                let in_part = |t: i64| (t as usize).checked_sub(first + offset).filter(|&i| i < n);
                // With dropout, the rest's weights are Aᶜ times the forward pass's factors: so
                // is their gradient dA (before the top-k keys' entries), and their values' one.
                let factors = &mut factors[..n];
                if let Some((d, bh)) = head.dropout {
                    let stream = AttentionDropout::CLUSTER_ROWS;
                    factors.fill(1.0);
                    let first = (first + offset) as u32;
                    simd::dropout_run(&d, [stream, bh, c as u32, first], factors);
                    g.iter_mut().zip(&*factors).for_each(|(g, f)| *g *= f);
                }
                // A top-k key's weight reaches the output through the top-k weights only.
                for (&t, &g_top) in top.iter().zip(&head.grad_top[c * k..(c + 1) * k]) {
                    if let Some(i) = in_part(t) {
                        g[i] = g_top;
                    }
                }
                simd::softmax_backward_part(w, g, head.log_sum_exp[c], head.delta[c]);
                if head.dropout.is_some() {
                    w.iter_mut().zip(&*factors).for_each(|(w, f)| *w *= f);
                }
                // The rest's weights for the values' gradient: Aᶜ without the top-k keys.
                for &t in top {
                    if let Some(i) = in_part(t) {
                        w[i] = 0.0;
                    }
                }
            }
            let (grad_keys, grad_values) = (
                &mut grad_keys[offset * dim..(offset + n) * dim],
                &mut grad_values[offset * dim_v..(offset + n) * dim_v],
            );
            unsafe {
                // The centroids' gradient dS · keys.
                matmul_add(
                    offset > 0,
                    [rows, dim, n],
                    (grad_centroids.as_mut_ptr(), 1, dim as isize),
                    (grads.as_ptr(), 1, n as isize),
                    (part_keys.as_ptr(), 1, dim as isize),
                );
                // The keys' gradient dSᵀ · centroids.
                matmul_add(
                    true,
                    [n, dim, rows],
                    (grad_keys.as_mut_ptr(), 1, dim as isize),
                    (grads.as_ptr(), n as isize, 1),
                    (centroids.as_ptr(), 1, dim as isize),
                );
                // The values' gradient Rᵀ · grad_out.
                matmul_add(
                    true,
                    [n, dim_v, rows],
                    (grad_values.as_mut_ptr(), 1, dim_v as isize),
                    (weights.as_ptr(), n as isize, 1),
                    (grad_out.as_ptr(), 1, dim_v as isize),
                );
            }
        }
    }
}
