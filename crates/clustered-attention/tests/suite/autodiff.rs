//! Gradients: they reach queries, keys and values; in the exact regime they equal full
//! attention's; in the approximate regime they match central finite differences (f64).

use burn::tensor::{DType, Device, Tensor, TensorData};
use clustered_attention::{
    AttentionInput, ClusteredAttention, FullAttention, ImprovedClusteredAttention, LshAttention,
    OracleTopAttention, SharedFullAttention,
};

use crate::common::*;

#[derive(Clone, Copy, Debug)]
enum Kind {
    Full,
    Clustered(usize),
    Improved(usize, usize),
    SharedFull,
    /// Rounds, chunk size.
    Lsh(usize, usize),
    OracleTop(usize),
}

struct Grads {
    queries: Vec<f64>,
    keys: Vec<f64>,
    values: Vec<f64>,
}

/// Gradients of `Σ output ⊙ weights` with respect to queries, keys and values, on `device`
/// (an autodiff device).
#[allow(clippy::too_many_arguments)]
fn gradients(
    device: &Device,
    kind: Kind,
    q: &Host4,
    k: &Host4,
    v: &Host4,
    weights: &Host4,
    query_lengths: &[usize],
    key_lengths: &[usize],
) -> Grads {
    let queries = q.to_tensor(device).require_grad();
    let keys = k.to_tensor(device).require_grad();
    let values = v.to_tensor(device).require_grad();
    let out = run(
        kind,
        queries.clone(),
        keys.clone(),
        values.clone(),
        query_lengths,
        key_lengths,
    );
    let loss = (out * weights.to_tensor(device)).sum();
    let grads = loss.backward();
    let host = |t: Tensor<4>| -> Vec<f64> {
        t.grad(&grads)
            .expect("a gradient")
            .into_data()
            .iter::<f64>()
            .collect()
    };
    Grads {
        queries: host(queries),
        keys: host(keys),
        values: host(values),
    }
}

fn run(
    kind: Kind,
    queries: Tensor<4>,
    keys: Tensor<4>,
    values: Tensor<4>,
    query_lengths: &[usize],
    key_lengths: &[usize],
) -> Tensor<4> {
    let device = queries.device();
    let input = AttentionInput::new(queries, keys, values)
        .with_query_lengths(lengths(query_lengths, &device))
        .with_key_lengths(lengths(key_lengths, &device));
    match kind {
        Kind::Full => FullAttention::new().forward(input),
        Kind::Clustered(c) => ClusteredAttention::new(c).forward(input),
        Kind::Improved(c, topk) => ImprovedClusteredAttention::new(c, topk).forward(input),
        Kind::SharedFull => SharedFullAttention::new().forward(input),
        Kind::Lsh(rounds, chunk) => LshAttention::new(rounds)
            .with_chunk_size(chunk)
            .forward(input),
        Kind::OracleTop(topk) => OracleTopAttention::new(topk).forward(input),
    }
}

fn max_diff(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Gradients reach queries, keys and values through clustered and improved attention, and in
/// the exact regime equal full attention's to 1e-4 (5e-3 on CUDA, whose f32 matmul rounds to
/// TF32: [`matmul_tolerance`]). `device` is an autodiff device.
fn gradients_reach_inputs_and_match_full(device: &Device) {
    let q = clustered_queries([2, 2, 24, 8], 3, 1.0, 31);
    let k = normal([2, 2, 19, 8], 32);
    let v = normal([2, 2, 19, 4], 33);
    let weights = normal([2, 2, 24, 4], 34);
    let (ql, kl) = ([24, 17], [19, 12]);

    for kind in [Kind::Clustered(4), Kind::Improved(4, 5)] {
        let g = gradients(device, kind, &q, &k, &v, &weights, &ql, &kl);
        for (name, grad) in [
            ("queries", &g.queries),
            ("keys", &g.keys),
            ("values", &g.values),
        ] {
            assert!(
                grad.iter().all(|x| x.is_finite()),
                "{kind:?}: non-finite gradient of {name}"
            );
            assert!(
                norm(grad) > 1e-3,
                "{kind:?}: no gradient reaches the {name}"
            );
        }
    }

    let full = gradients(device, Kind::Full, &q, &k, &v, &weights, &ql, &kl);
    for kind in [
        Kind::Clustered(24),
        Kind::Improved(24, 3),
        Kind::Improved(2, 19),
    ] {
        let g = gradients(device, kind, &q, &k, &v, &weights, &ql, &kl);
        for (name, a, b) in [
            ("queries", &g.queries, &full.queries),
            ("keys", &g.keys, &full.keys),
            ("values", &g.values, &full.values),
        ] {
            let diff = max_diff(a, b);
            assert!(
                diff <= matmul_tolerance(device, 1e-4),
                "{kind:?} (exact regime): gradient of {name} differs from full by {diff}"
            );
        }
    }
}

/// Flex holds any float dtype at run time: the f64 tensors are created on its autodiff device
/// with an explicit dtype and every op keeps it. (Configuring a device's default float dtype to
/// f64 would change it for the f32 tests running in the same process.)
fn tensor_f64(dims: [usize; 4], data: &[f64]) -> Tensor<4> {
    Tensor::from_data(
        TensorData::new(data.to_vec(), dims),
        (&autodiff(&flex()), DType::F64),
    )
}

/// The gradients equal central finite differences (f64, step 1e-6, tolerance 1e-6 times the
/// largest gradient): full attention's (the reference of the exact-regime test above) and, in
/// the approximate regime, the others': the clusters, top-k sets and LSH buckets are
/// piecewise constant, and a step this small does not move them. Shared-QK attentions (lsh-X,
/// shared-full) are checked on self-attention inputs, keys distinct from queries.
#[test]
fn gradients_match_finite_differences() {
    let cross = [
        clustered_queries([1, 2, 20, 6], 3, 1.0, 41),
        normal([1, 2, 15, 6], 42),
        normal([1, 2, 15, 3], 43),
    ];
    check_finite_differences(
        &[
            Kind::Full,
            Kind::Clustered(3),
            Kind::Improved(3, 4),
            Kind::OracleTop(4),
        ],
        cross,
        ([18], [13]),
    );
    let shared = [
        clustered_queries([1, 2, 20, 6], 3, 1.0, 45),
        normal([1, 2, 20, 6], 46),
        normal([1, 2, 20, 3], 47),
    ];
    check_finite_differences(
        &[Kind::SharedFull, Kind::Lsh(1, 4), Kind::Lsh(3, 5)],
        shared,
        ([17], [17]),
    );
}

fn check_finite_differences(kinds: &[Kind], hosts: [Host4; 3], (ql, kl): ([usize; 1], [usize; 1])) {
    let out_dims = [1, 2, hosts[0].dims[2], hosts[2].dims[3]];
    let weights = normal(out_dims, 44);
    let weights: Vec<f64> = weights.data.iter().map(|&x| x as f64).collect();
    let dims = [hosts[0].dims, hosts[1].dims, hosts[2].dims];
    let loss = |kind: Kind, inputs: &[Vec<f64>; 3], track: bool| {
        let [q, k, v] = [0, 1, 2].map(|i| {
            let t = tensor_f64(dims[i], &inputs[i]);
            if track { t.require_grad() } else { t }
        });
        let out = run(kind, q.clone(), k.clone(), v.clone(), &ql, &kl);
        let loss = (out * tensor_f64(out_dims, &weights)).sum();
        (loss, [q, k, v])
    };
    let inputs: [Vec<f64>; 3] = hosts.map(|h| h.data.iter().map(|&x| x as f64).collect());
    for &kind in kinds {
        let (value, tracked) = loss(kind, &inputs, true);
        let grads = value.backward();
        for (which, name) in ["queries", "keys", "values"].into_iter().enumerate() {
            let grad: Vec<f64> = tracked[which]
                .grad(&grads)
                .expect("a gradient")
                .into_data()
                .iter::<f64>()
                .collect();
            assert!(
                norm(&grad) > 1e-3,
                "{kind:?}: no gradient reaches the {name}"
            );
            let scale = grad.iter().fold(1.0f64, |m, g| m.max(g.abs()));
            for index in (0..grad.len()).step_by(5) {
                let step = 1e-6;
                let eval = |delta: f64| {
                    let mut shifted = inputs.clone();
                    shifted[which][index] += delta;
                    loss(kind, &shifted, false)
                        .0
                        .into_data()
                        .iter::<f64>()
                        .next()
                        .unwrap()
                };
                let numeric = (eval(step) - eval(-step)) / (2.0 * step);
                let diff = (numeric - grad[index]).abs();
                assert!(
                    diff <= 1e-6 * scale,
                    "{kind:?}: d loss / d {name}[{index}] = {} by autodiff, {numeric} by finite differences",
                    grad[index]
                );
            }
        }
    }
}

#[test]
fn ndarray_gradients_reach_inputs_and_match_full() {
    gradients_reach_inputs_and_match_full(&autodiff(&ndarray()));
}

#[test]
fn flex_gradients_reach_inputs_and_match_full() {
    gradients_reach_inputs_and_match_full(&autodiff(&flex()));
}

#[cfg(feature = "wgpu")]
#[test]
fn wgpu_gradients_reach_inputs_and_match_full() {
    gradients_reach_inputs_and_match_full(&autodiff(&wgpu()));
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn cuda_gradients_reach_inputs_and_match_full() {
    gradients_reach_inputs_and_match_full(&autodiff(&cuda()));
}

/// Clustered and improved attention on long rows (L = 16384, C = 100, top 32, 4 heads,
/// E = D = 64: past what one thread of the one-launch K-means may loop on lavapipe), forward and
/// backward on `device` against Flex: each gradient within `tolerance` of Flex's.
fn long_rows_gradients_match_flex(device: &Device, tolerance: f64) {
    let (len, dim) = (16384, 64);
    let q = clustered_queries([1, 4, len, dim], 100, 3.0, 41);
    let k = normal([1, 4, len, dim], 42);
    let v = normal([1, 4, len, dim], 43);
    let weights = normal([1, 4, len, dim], 44);
    for kind in [Kind::Clustered(100), Kind::Improved(100, 32)] {
        let expected = gradients(
            &autodiff(&flex()),
            kind,
            &q,
            &k,
            &v,
            &weights,
            &[len],
            &[len],
        );
        let actual = gradients(device, kind, &q, &k, &v, &weights, &[len], &[len]);
        for (name, a, b) in [
            ("queries", &actual.queries, &expected.queries),
            ("keys", &actual.keys, &expected.keys),
            ("values", &actual.values, &expected.values),
        ] {
            let diff = max_diff(a, b);
            assert!(
                diff <= tolerance,
                "{kind:?}, L = {len}: gradient of {name} differs from Flex's by {diff}"
            );
        }
    }
}

/// On lavapipe (2026-12-03) the gradients agreed with Flex's to 9.4e-5 at most.
#[cfg(feature = "wgpu")]
#[test]
fn wgpu_long_rows_gradients_match_flex() {
    long_rows_gradients_match_flex(&autodiff(&wgpu()), 1e-3);
}

#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored"]
fn cuda_long_rows_gradients_match_flex() {
    let device = autodiff(&cuda());
    long_rows_gradients_match_flex(&device, matmul_tolerance(&device, 1e-3));
}
