//! Attention-weight dropout inside the fused ops ([`AttentionDropout`]): Philox4x32-10 against
//! Random123's known answers; the kept fraction and the factors; the fused ops with dropout
//! against a composition of Burn's own ops given the same factors, outputs and every gradient;
//! the masks of one seed on every backend.

use burn::tensor::activation::softmax;
use burn::tensor::{Bool, DType, Device, IndexingUpdateOp, Int, Tensor, TensorData};
use clustered_attention::dropout::{AttentionDropout, philox4x32_10};
use clustered_attention::ops::{attention_dropout_factors, centroid_attention, improved_attention};
use clustered_attention::{
    AttentionInput, ClusteredAttention, ClusteringOptions, ImprovedClusteredAttention,
    cluster_queries, with_dropout_seed,
};

use crate::common::*;

/// Random123's known-answer vectors for Philox4x32-10 (its `tests/kat_vectors`): the zero
/// block, the all-ones block and the digits of π.
#[test]
fn philox_matches_random123_known_answers() {
    let cases = [
        (
            [0, 0, 0, 0],
            [0, 0],
            [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8],
        ),
        (
            [u32::MAX; 4],
            [u32::MAX; 2],
            [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd],
        ),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];
    for (counter, key, expected) in cases {
        assert_eq!(
            philox4x32_10(counter, key),
            expected,
            "Philox4x32-10 of {counter:x?} under {key:x?}"
        );
    }
}

/// Over 10⁶ weights, the kept fraction is within 4 standard errors of `1 − p`, and every factor
/// is 0 or exactly `1 / (1 − p)`; a row's factors from any first key equal the factors of each
/// key alone; the two streams and two seeds give other masks.
#[test]
fn kept_fraction_is_one_minus_p() {
    let (prob, seed) = (0.1, 0x0123_4567_89ab_cdef);
    let dropout = AttentionDropout::new(prob, seed);
    let shape = [2, 2, 250, 1000];
    let factors = dropout.factors(AttentionDropout::CLUSTER_ROWS, shape);
    let scale = (1.0 / (1.0 - prob)) as f32;
    assert!(factors.iter().all(|&f| f == 0.0 || f == scale));
    let n = factors.len() as f64;
    let kept = factors.iter().filter(|&&f| f != 0.0).count() as f64 / n;
    let bound = 4.0 * (prob * (1.0 - prob) / n).sqrt();
    assert!(
        (kept - (1.0 - prob)).abs() <= bound,
        "kept {kept} of {n} weights, 1 − p = {} (bound {bound})",
        1.0 - prob
    );
    for first in 0..9u32 {
        let mut row = vec![1f32; 19];
        dropout.apply_row(AttentionDropout::QUERY_TOP, 3, 7, first, &mut row);
        for (i, &f) in row.iter().enumerate() {
            let alone = dropout.factor(AttentionDropout::QUERY_TOP, 3, 7, first + i as u32);
            assert_eq!(f, alone, "key {} from first key {first}", first + i as u32);
        }
    }
    let other_stream = dropout.factors(AttentionDropout::QUERY_TOP, shape);
    let other_seed = AttentionDropout::new(prob, seed + 1).factors(0, shape);
    assert_ne!(factors, other_stream);
    assert_ne!(factors, other_seed);
}

/// The inputs of a case: queries, keys, values `[batch, heads, L, E]`, `[batch, heads, S, E]`,
/// `[batch, heads, S, D]`, the key lengths (the last batch entry's 5 short), and the outer
/// gradient `[batch, heads, L, D]`.
struct Case {
    queries: Host4,
    keys: Host4,
    values: Host4,
    key_lengths: Vec<usize>,
    outer: Host4,
}

impl Case {
    fn new([batch, heads, len, keys_len]: [usize; 4], dim: usize, dim_v: usize, seed: u64) -> Self {
        let mut key_lengths = vec![keys_len; batch];
        key_lengths[batch - 1] -= 5;
        Self {
            queries: normal([batch, heads, len, dim], seed),
            keys: normal([batch, heads, keys_len, dim], seed + 1),
            values: normal([batch, heads, keys_len, dim_v], seed + 2),
            key_lengths,
            outer: normal([batch, heads, len, dim_v], seed + 3),
        }
    }
}

/// The clustering of a case's queries: the assignments, the one-hot membership `G`
/// `[batch, heads, C, L]` and the inverse counts `[batch, heads, C, 1]` (1 for an empty cluster).
fn membership(
    queries: &Tensor<4>,
    clusters: usize,
    device: &Device,
) -> (Tensor<3, Int>, Tensor<4>, Tensor<4>) {
    let [batch, heads, len, _] = queries.dims();
    let options = ClusteringOptions::new(clusters).with_seed(3);
    let assignments = cluster_queries(queries.clone().detach(), None, &options).assignments;
    let assigned = host_ints(assignments.clone());
    let mut one_hot = vec![0f32; batch * heads * clusters * len];
    let mut counts = vec![0f32; batch * heads * clusters];
    for (row, &a) in assigned.iter().enumerate() {
        let (bh, i, a) = (row / len, row % len, a as usize);
        one_hot[(bh * clusters + a) * len + i] = 1.0;
        counts[bh * clusters + a] += 1.0;
    }
    let inverse: Vec<f32> = counts.iter().map(|&c| 1.0 / c.max(1.0)).collect();
    (
        assignments,
        Tensor::from_data(
            TensorData::new(one_hot, [batch, heads, clusters, len]),
            device,
        ),
        Tensor::from_data(
            TensorData::new(inverse, [batch, heads, clusters, 1]),
            device,
        ),
    )
}

/// Whether each key of `[batch, heads, rows, S]` is padding.
fn padded(key_lengths: &[usize], dims: [usize; 4], device: &Device) -> Tensor<4, Bool> {
    let [batch, heads, rows, keys_len] = dims;
    let data: Vec<bool> = (0..batch * heads * rows * keys_len)
        .map(|i| i % keys_len >= key_lengths[i / (heads * rows * keys_len)])
        .collect();
    Tensor::from_data(TensorData::new(data, dims), device)
}

/// The factors of `dropout` as a tensor of `dims` (stream `CLUSTER_ROWS`).
fn cluster_factors(dropout: &AttentionDropout, dims: [usize; 4], device: &Device) -> Tensor<4> {
    let factors = dropout.factors(AttentionDropout::CLUSTER_ROWS, dims);
    Tensor::from_data(TensorData::new(factors, dims), device)
}

/// `x` `[batch, heads, S, F]` gathered at `index` `[batch, heads, L, k]`: `[batch, heads, L, k, F]`.
fn gather_rows(x: Tensor<4>, index: Tensor<4, Int>) -> Tensor<5> {
    let [batch, heads, len, k] = index.dims();
    let width = x.dims()[3];
    let index = index
        .reshape([batch, heads, len * k, 1])
        .expand([batch, heads, len * k, width]);
    x.gather(2, index).reshape([batch, heads, len, k, width])
}

/// Improved clustered attention with dropout composed of Burn's ops (matmul, softmax, topk,
/// gather, scatter), given the factors of `dropout`: `Aᶜ ⊙ F₁` outside each cluster's top-k
/// times the values, plus each query's `m̂ · softmax(q · k_top) ⊙ F₂` times its top-k values;
/// `F₂` at the ranks in the top-k.
fn improved_composed(
    [queries, keys, values]: [Tensor<4>; 3],
    (assignments, one_hot, inverse): (&Tensor<3, Int>, &Tensor<4>, &Tensor<4>),
    key_lengths: &[usize],
    (topk, scale, dropout): (usize, f64, &AttentionDropout),
) -> Tensor<4> {
    let device = queries.device();
    let [batch, heads, len, _] = queries.dims();
    let centroids = one_hot.clone().matmul(queries.clone()) * inverse.clone();
    let scores = centroids
        .mul_scalar(scale)
        .matmul(keys.clone().swap_dims(2, 3));
    let dims = scores.dims();
    let scores = scores.mask_fill(padded(key_lengths, dims, &device), f32::NEG_INFINITY);
    let weights = softmax(scores.clone(), 3);
    let (_, top) = scores.detach().topk_with_indices(topk, 3);
    let mass = weights.clone().gather(3, top.clone()).sum_dim(3);
    let in_top = Tensor::<4>::zeros(dims, &device)
        .scatter(
            3,
            top.clone(),
            Tensor::ones(top.dims(), &device),
            IndexingUpdateOp::Add,
        )
        .greater_elem(0.5);
    let dropped = weights * cluster_factors(dropout, dims, &device);
    let rest = dropped.mask_fill(in_top, 0.0).matmul(values.clone());
    let members = one_hot.clone().swap_dims(2, 3); // [batch, heads, L, C]
    let index = assignments
        .clone()
        .reshape([batch, heads, len, 1])
        .expand([batch, heads, len, topk]);
    let query_top = top.gather(2, index); // [batch, heads, L, k]
    let top_keys = gather_rows(keys, query_top.clone());
    let top_values = gather_rows(values, query_top);
    let top_scores: Tensor<4> = (queries.unsqueeze_dim::<5>(3) * top_keys)
        .sum_dim(4)
        .squeeze_dim(4);
    let probs = softmax(top_scores.mul_scalar(scale), 3);
    let factors = dropout.factors(AttentionDropout::QUERY_TOP, [batch, heads, len, topk]);
    let factors = Tensor::from_data(TensorData::new(factors, [batch, heads, len, topk]), &device);
    let top_weights = probs * members.clone().matmul(mass) * factors;
    let top_out: Tensor<4> = (top_weights.unsqueeze_dim::<5>(4) * top_values)
        .sum_dim(3)
        .squeeze_dim(3);
    top_out + members.matmul(rest)
}

/// Clustered attention with dropout composed of Burn's ops: every member gets its cluster's
/// `(softmax(centroid · keysᵀ) ⊙ F₁) · values`.
fn clustered_composed(
    [queries, keys, values]: [Tensor<4>; 3],
    (one_hot, inverse): (&Tensor<4>, &Tensor<4>),
    key_lengths: &[usize],
    (scale, dropout): (f64, &AttentionDropout),
) -> Tensor<4> {
    let device = queries.device();
    let centroids = one_hot.clone().matmul(queries) * inverse.clone();
    let scores = centroids.mul_scalar(scale).matmul(keys.swap_dims(2, 3));
    let dims = scores.dims();
    let scores = scores.mask_fill(padded(key_lengths, dims, &device), f32::NEG_INFINITY);
    let dropped = softmax(scores, 3) * cluster_factors(dropout, dims, &device);
    one_hot
        .clone()
        .swap_dims(2, 3)
        .matmul(dropped.matmul(values))
}

/// The output and the gradients of the queries, keys and values of `f` on `case`, on the
/// autodiff form of `device`, with the loss `Σ out ⊙ outer`.
fn run_with_gradients(
    case: &Case,
    device: &Device,
    f: impl Fn([Tensor<4>; 3]) -> Tensor<4>,
) -> [Host4; 4] {
    let inputs =
        [&case.queries, &case.keys, &case.values].map(|x| x.to_tensor(device).require_grad());
    let out = f(inputs.clone());
    let grads = (out.clone() * case.outer.to_tensor(device))
        .sum()
        .backward();
    let [q, k, v] = inputs.map(|x| Host4::from_tensor(x.grad(&grads).expect("a gradient")));
    [Host4::from_tensor(out.detach()), q, k, v]
}

/// The largest difference of `a` and `b` relative to the larger of 1 and `b`'s largest entry.
fn relative_diff(a: &Host4, b: &Host4) -> f64 {
    assert_eq!(a.dims, b.dims);
    let largest = largest(b).max(1.0);
    a.data
        .iter()
        .zip(&b.data)
        .map(|(&x, &y)| (x as f64 - y as f64).abs())
        .fold(0.0, f64::max)
        / largest
}

/// Asserts that the output and the three gradients of [`run_with_gradients`] agree within
/// `tolerance` ([`relative_diff`]).
fn assert_agree(case: &str, fused: &[Host4; 4], composed: &[Host4; 4], tolerance: f64) {
    let names = [
        "output",
        "queries' gradient",
        "keys' gradient",
        "values' gradient",
    ];
    for (name, (a, b)) in names.iter().zip(fused.iter().zip(composed)) {
        let diff = relative_diff(a, b);
        assert!(
            diff <= tolerance,
            "{case}: the {name} is {diff} from the composition's"
        );
    }
}

/// The fused ops with dropout on `device` (improved attention's whole op, and clustered
/// attention's centroid attention) against [`improved_composed`] and [`clustered_composed`],
/// given the same factors: the outputs and the gradients of the queries, keys and values to
/// 1e-5 (relative to the largest entry above 1; TF32's tolerance on CUDA), with padded keys,
/// `p` 0.1 with 23 keys, 0.5 with 2,100 and 0.3 with 1,500 queries in one (batch, head).
pub fn fused_dropout_matches_composition(device: &Device) {
    let device = &autodiff(device);
    let tolerance = matmul_tolerance(device, 1e-5);
    let (clusters, topk) = (4, 5);
    // The second case's keys span several of the host loops' parts and chunks, so that keys
    // leave a cluster's top-k in a later part and the backward splits the keys; the third's
    // one (batch, head) of 1,500 queries splits between threads in the top-k attention's loops;
    // the fourth's wide rows split over several units in the CubeCL kernels.
    let cases = [
        (10, 0.1, [2, 2, 19, 23], [8, 6]),
        (20, 0.5, [2, 2, 19, 2100], [8, 6]),
        (30, 0.3, [1, 1, 1500, 700], [8, 6]),
        (40, 0.2, [1, 2, 40, 300], [96, 80]),
    ];
    for (case_seed, prob, shape, [dim, dim_v]) in cases {
        let case = Case::new(shape, dim, dim_v, case_seed);
        let scale = 1.0 / (dim as f64).sqrt();
        let dropout = AttentionDropout::new(prob, 0xfeed_0000 + case_seed);
        let key_lengths = lengths(&case.key_lengths, device);
        let (assignments, one_hot, inverse) =
            membership(&case.queries.to_tensor(device), clusters, device);
        let fused = run_with_gradients(&case, device, |[q, k, v]| {
            improved_attention(
                q,
                k,
                v,
                assignments.clone(),
                inverse.clone(),
                Some(key_lengths.clone()),
                topk,
                scale,
                Some(dropout),
            )
        });
        let composed = run_with_gradients(&case, device, |inputs| {
            improved_composed(
                inputs,
                (&assignments, &one_hot, &inverse),
                &case.key_lengths,
                (topk, scale, &dropout),
            )
        });
        assert_agree(
            &format!("improved, p = {prob}"),
            &fused,
            &composed,
            tolerance,
        );
        let fused = run_with_gradients(&case, device, |[q, k, v]| {
            let centroids = (one_hot.clone().matmul(q) * inverse.clone()).mul_scalar(scale);
            let out =
                centroid_attention(centroids, k, v, Some(key_lengths.clone()), 0, Some(dropout));
            one_hot.clone().swap_dims(2, 3).matmul(out.0)
        });
        let composed = run_with_gradients(&case, device, |inputs| {
            clustered_composed(
                inputs,
                (&one_hot, &inverse),
                &case.key_lengths,
                (scale, &dropout),
            )
        });
        assert_agree(
            &format!("clustered, p = {prob}"),
            &fused,
            &composed,
            tolerance,
        );
    }
}

/// The dropped weights themselves, from the values as the identity (`D = S`: an output row is
/// the row's weights after dropout), of clustered and improved attention under one
/// `with_dropout_seed` on the autodiff form of `device`.
fn dropped_weights(device: &Device) -> [Host4; 2] {
    let device = &autodiff(device);
    let (len, dim) = (40, 8);
    let queries = normal([2, 2, len, dim], 51).to_tensor(device);
    let values = identity_values(2, 2, len).to_tensor(device);
    let input = || {
        AttentionInput::new(queries.clone(), queries.clone(), values.clone())
            .with_key_lengths(lengths(&[len, len - 7], device))
    };
    with_dropout_seed(77, || {
        [
            ClusteredAttention::new(5)
                .with_seed(2)
                .with_dropout(0.3)
                .forward(input()),
            ImprovedClusteredAttention::new(5, 6)
                .with_seed(2)
                .with_dropout(0.3)
                .forward(input()),
        ]
        .map(|out| Host4::from_tensor(out.detach()))
    })
}

/// One seed gives the same masks on every backend of the build: the weights of clustered and
/// improved attention after dropout agree with NdArray's, zeros at the same places, the other
/// weights to 1e-5 (TF32's tolerance on CUDA).
pub fn masks_agree_with_ndarray(device: &Device) {
    let tolerance = matmul_tolerance(device, 1e-5);
    let expected = dropped_weights(&ndarray());
    let got = dropped_weights(device);
    for (name, (a, b)) in ["clustered", "improved"]
        .iter()
        .zip(got.iter().zip(&expected))
    {
        for (n, (&x, &y)) in a.data.iter().zip(&b.data).enumerate() {
            assert_eq!(
                x == 0.0,
                y == 0.0,
                "{name}: weight {n} is {x} here and {y} on NdArray (dropped on one only)"
            );
            assert!(
                (x - y).abs() as f64 <= tolerance,
                "{name}: weight {n} is {x} here and {y} on NdArray"
            );
        }
    }
}

/// The factors the backend draws on its device for the default bodies
/// (`attention_dropout_factors`, a kernel on the CubeCL backends) equal
/// `AttentionDropout::factors` on the host, exactly: both streams, rows of keys that end
/// inside a Philox block, in `f32` and `f16`.
pub fn device_factors_match_the_host(device: &Device) {
    for (n, shape) in [[2, 3, 5, 19], [1, 2, 70, 32], [1, 1, 3, 1]]
        .into_iter()
        .enumerate()
    {
        let dropout = AttentionDropout::new(0.1 + 0.2 * n as f64, 0x5eed_0000 + n as u64);
        for stream in [AttentionDropout::CLUSTER_ROWS, AttentionDropout::QUERY_TOP] {
            let expected = dropout.factors(stream, shape);
            for dtype in [DType::F32, DType::F16] {
                let like = Tensor::<4>::zeros(shape, (device, dtype));
                let got: Vec<f32> = attention_dropout_factors(dropout, stream, &like)
                    .cast(DType::F32)
                    .into_data()
                    .iter::<f32>()
                    .collect();
                assert_eq!(got.len(), expected.len());
                for (i, (&x, &y)) in got.iter().zip(&expected).enumerate() {
                    // In `f16` the scale 1 / (1 − p) is rounded: 11 bits.
                    let tolerance = if dtype == DType::F16 { y * 1e-3 } else { 0.0 };
                    assert!(
                        (x - y).abs() <= tolerance,
                        "{shape:?}, stream {stream}, {dtype:?}: factor {i} is {x}, the host's {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn ndarray_fused_dropout_matches_composition() {
    fused_dropout_matches_composition(&ndarray());
}

#[test]
fn flex_fused_dropout_matches_composition() {
    fused_dropout_matches_composition(&flex());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_fused_dropout_matches_composition() {
    fused_dropout_matches_composition(&wgpu());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_masks_agree_with_ndarray() {
    masks_agree_with_ndarray(&wgpu());
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_device_factors_match_the_host() {
    device_factors_match_the_host(&wgpu());
}
