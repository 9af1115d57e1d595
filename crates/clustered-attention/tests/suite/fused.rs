//! The fused attention ops, centroid attention (eqs. 4–5 and 9) and per-query top-k attention
//! (eqs. 10–11), and the whole improved attention after clustering: the backends'
//! implementations against plain f64 loops, and their backward passes against autodiff through
//! the default bodies. The per-backend test functions are in `sparse.rs`'s `sparse_tests!`.

use burn::backend::Autodiff;
use burn::tensor::{DType, Device, Int, Tensor};
use clustered_attention::ops::{
    ClusteredAttentionBackend, ClusteredAttentionBackward, centroid_attention, improved_attention,
    reference, top_attention,
};

use crate::common::*;
use crate::defaults;
use crate::sparse::{Indices, indices, max_diff};

/// The backend's centroid attention against plain f64 loops: `Aᶜ V` over the keys outside the
/// returned top-k (all of it with `topk` 0) and the top-k weights to 1e-5, the top-k sets by
/// score (a chosen key may differ only among scores within 1e-5 of the k-th best); on CUDA
/// 5e-3 instead of 1e-5, relative to the k-th best score when it exceeds 1
/// ([`matmul_tolerance`]), with padded
/// keys, `topk` from 0 to S, shapes small enough for one thread and large enough for several,
/// rows of 128 features (which the CubeCL kernels split over units),
/// and one (batch, head) with enough clusters for the host loops to split its rows between
/// threads (on a machine with two or more); in the last case the centroids and keys are in
/// `{-1, 0, 1}`, so that many scores tie with the k-th best (ties go to the lower key).
pub fn centroid_attention_matches_loops(device: &Device) {
    centroid_attention_matches_loops_in(device, DType::F32);
}

/// [`centroid_attention_matches_loops`] in `dtype`, the references fed the inputs rounded to
/// it: in `f16` and `bf16` the outputs, convex combinations of the values, within
/// [`tolerance`](crate::half::tolerance) of the values' largest entry, the top-k weights within
/// it, and the chosen keys' scores within it of the k-th best (relative to it above 1: a
/// device's cooperative matrices may round each product to the half type, as lavapipe's seem
/// to, and a key near the k-th best may then rank either way); with one more case at the bench's
/// widths (`E = D = 64`, `topk` 32).
pub fn centroid_attention_matches_loops_in(device: &Device, dtype: DType) {
    let half = dtype != DType::F32;
    let tolerance = matmul_tolerance(device, 1e-5);
    // TF32 rounds a score relative to its size; f32 elsewhere keeps 1e-5 absolute.
    let score_slack = |kth: f64| {
        if half {
            crate::half::tolerance(dtype) * kth.abs().max(1.0)
        } else if tolerance > 1e-5 {
            tolerance * kth.abs().max(1.0)
        } else {
            tolerance
        }
    };
    // (centroid dims [batch, heads, C, E], S, D, key lengths, topks)
    type Case = ([usize; 4], usize, usize, &'static [usize], &'static [usize]);
    let mut cases: Vec<Case> = vec![
        ([1, 1, 3, 8], 20, 5, &[20], &[0, 1, 4, 20]),
        ([2, 3, 37, 8], 300, 5, &[300, 123], &[0, 1, 7, 300]),
        ([1, 4, 150, 16], 2000, 16, &[1999], &[32]),
        ([1, 1, 45, 16], 1100, 5, &[1050], &[0, 6]),
        ([1, 2, 40, 128], 300, 128, &[280], &[0, 8]),
        ([1, 2, 9, 4], 60, 3, &[50], &[7, 13]),
    ];
    let ties = cases.len() - 1;
    if half {
        cases.push(([1, 2, 100, 64], 700, 64, &[650], &[0, 32]));
    }
    for (n, (centroid_dims, keys_len, dim_v, key_lengths, topks)) in cases.into_iter().enumerate() {
        let [batch, heads, clusters, dim] = centroid_dims;
        let seed = 90 + 3 * n as u64;
        let ternary = |x: Host4| if n == ties { ternary(x) } else { x };
        // Centroids of 128 features scaled by 1/4, as attention scales its queries by 1/√E,
        // which keeps the scores within the range where f32 holds the outputs to 1e-5.
        let mut centroids = normal(centroid_dims, seed);
        if dim > 64 {
            centroids.data.iter_mut().for_each(|x| *x /= 4.0);
        }
        let (centroids, centroids_in) = rounded(&ternary(centroids), dtype, device);
        let (keys, keys_in) = rounded(
            &ternary(normal([batch, heads, keys_len, dim], seed + 1)),
            dtype,
            device,
        );
        let (values, values_in) = rounded(
            &normal([batch, heads, keys_len, dim_v], seed + 2),
            dtype,
            device,
        );
        let tolerance = if half {
            crate::half::tolerance(dtype) * largest(&values)
        } else {
            tolerance
        };
        let weight_tolerance = if half {
            crate::half::tolerance(dtype)
        } else {
            tolerance
        };
        for &topk in topks {
            let (out, top) = centroid_attention(
                centroids_in.clone(),
                keys_in.clone(),
                values_in.clone(),
                Some(lengths(key_lengths, device)),
                topk,
                None,
            );
            assert_eq!(out.dims(), [batch, heads, clusters, dim_v]);
            let out = Host4::from_tensor(out.cast(DType::F32));
            let top = top.map(|(indices, weights)| {
                assert_eq!(indices.dims(), [batch, heads, clusters, topk]);
                (
                    host_ints(indices),
                    Host4::from_tensor(weights.cast(DType::F32)),
                )
            });
            assert_eq!(top.is_some(), topk > 0, "top-k present iff topk > 0");
            for (b, &valid) in key_lengths.iter().enumerate() {
                for h in 0..heads {
                    for c in 0..clusters {
                        let case = format!("case {n}, topk {topk}, ({b}, {h}, {c})");
                        let query = centroids.row(b, h, c);
                        let scores: Vec<f64> = (0..keys_len)
                            .map(|j| {
                                if j < valid {
                                    dot(&query, &keys.row(b, h, j))
                                } else {
                                    f64::NEG_INFINITY
                                }
                            })
                            .collect();
                        let weights = softmax(&scores);
                        let row = ((b * heads + h) * clusters + c) * topk;
                        let in_top = |j: usize| match &top {
                            Some((indices, _)) => indices[row..row + topk].contains(&(j as i64)),
                            None => false,
                        };
                        for d in 0..dim_v {
                            let expected: f64 = (0..keys_len)
                                .filter(|&j| !in_top(j))
                                .map(|j| weights[j] * values.at(b, h, j, d))
                                .sum();
                            let got = out.at(b, h, c, d);
                            assert!(
                                (got - expected).abs() <= tolerance,
                                "{case}, column {d}: {got} vs {expected}"
                            );
                        }
                        let Some((indices, top_weights)) = &top else {
                            continue;
                        };
                        let chosen = &indices[row..row + topk];
                        let mut sorted = scores.clone();
                        sorted.sort_by(|a, b| b.total_cmp(a));
                        let kth = sorted[topk - 1];
                        let mut seen = vec![false; keys_len];
                        for (r, &j) in chosen.iter().enumerate() {
                            let j = usize::try_from(j).expect("a key index");
                            assert!(
                                j < keys_len && !seen[j],
                                "{case}: key {j} repeated or out of range"
                            );
                            seen[j] = true;
                            assert!(
                                scores[j] >= kth - score_slack(kth),
                                "{case}: key {j} scores {} below the k-th best {kth}",
                                scores[j]
                            );
                            let got = top_weights.at(b, h, c, r);
                            assert!(
                                (got - weights[j]).abs() <= weight_tolerance,
                                "{case}: weight of key {j}: {got} vs {}",
                                weights[j]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// `x` with each entry rounded to the nearest of -1, 0 and 1: small integer scores, which tie.
fn ternary(mut x: Host4) -> Host4 {
    x.data
        .iter_mut()
        .for_each(|v| *v = v.round().clamp(-1.0, 1.0));
    x
}

/// The backend's per-query top-k attention and its default body against plain f64 loops:
/// padded queries, a sequence with padded keys in its top-k sets (each set keeps at least one
/// valid key, as the centroid attention's top-k always does), and widths across the 16-lane
/// blocks of the host kernels (k = 33, E = 70, D = 20), and one (batch, head) with enough
/// queries for the host loops to split them between threads (on a machine with two or more),
/// with the tolerance of `sparse_products_match_reference`.
///
/// `X` is the backend of `device`, whose default body is checked too.
pub fn top_attention_matches_loops<X: ClusteredAttentionBackend>(device: &Device) {
    top_attention_matches_loops_in::<X>(device, DType::F32);
}

/// [`top_attention_matches_loops`] in `dtype` (the backend's op only), the references fed the
/// inputs rounded to it: in `f16` and `bf16` each output within
/// [`tolerance`](crate::half::tolerance) of the largest entries of the values and the rests
/// added (an output is its cluster's mass, below 1, times a convex combination of values,
/// plus its rest); with one more case at the bench's widths (`E = D = 64`, `k` 32).
pub fn top_attention_matches_loops_in<X: ClusteredAttentionBackend>(device: &Device, dtype: DType) {
    let half = dtype != DType::F32;
    // (batch, heads, L, S, E, D, C, k, key lengths, tolerance)
    type Case = (
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        usize,
        &'static [usize],
        f64,
    );
    let mut cases: Vec<Case> = vec![
        (2, 3, 37, 29, 10, 7, 5, 6, &[29, 4], 1e-5),
        (1, 2, 301, 90, 70, 20, 6, 33, &[85], 1e-4),
        (1, 1, 2500, 60, 8, 5, 7, 4, &[55], 1e-5),
    ];
    if half {
        cases.push((1, 2, 600, 300, 64, 64, 9, 32, &[290], 0.0));
    }
    let scale = 0.3;
    for (n, (batch, heads, len, keys_len, dim, dim_v, clusters, k, key_lengths, tolerance)) in
        cases.into_iter().enumerate()
    {
        let seed = 70 + 5 * n as u64;
        let mut ix = indices(batch, heads, len, keys_len, clusters, k, seed);
        for (row, top) in ix.topk.chunks_mut(k).enumerate() {
            let valid = key_lengths[row / (heads * clusters)] as i64;
            if top.iter().all(|&t| t >= valid) {
                top[0] = 0;
            }
        }
        let (queries, queries_in) =
            rounded(&normal([batch, heads, len, dim], seed + 1), dtype, device);
        let (keys, keys_in) = rounded(
            &normal([batch, heads, keys_len, dim], seed + 2),
            dtype,
            device,
        );
        let (values, values_in) = rounded(
            &normal([batch, heads, keys_len, dim_v], seed + 3),
            dtype,
            device,
        );
        let mut mass = normal([batch, heads, clusters, 1], seed + 4);
        for m in &mut mass.data {
            *m = m.abs() / (1.0 + m.abs());
        }
        let (mass, mass_in) = rounded(&mass, dtype, device);
        let (rest, rest_in) = rounded(
            &normal([batch, heads, clusters, dim_v], seed + 5),
            dtype,
            device,
        );
        let tolerance = if half {
            crate::half::tolerance(dtype) * (largest(&values) + largest(&rest))
        } else {
            tolerance
        };
        let (topk, assignments) = ix.tensors(device);
        let inputs = || {
            (
                queries_in.clone(),
                keys_in.clone(),
                values_in.clone(),
                topk.clone(),
                assignments.clone(),
                mass_in.clone(),
                rest_in.clone(),
                Some(lengths(key_lengths, device)),
            )
        };
        let (q, kt, v, t, a, m, r, l) = inputs();
        let out = top_attention(q, kt, v, a, t, m, r, l, scale, None).cast(DType::F32);
        let mut checked = vec![("backend", out)];
        // The default body in `f32` only: in a half type it rounds at every op.
        if !half {
            let (q, kt, v, t, a, m, r, l) = inputs();
            let default_body = defaults::top_attention::<X>(q, kt, v, a, t, m, r, l, scale);
            checked.push(("default body", default_body));
        }
        for (name, out) in checked {
            assert_eq!(out.dims(), [batch, heads, len, dim_v]);
            let out = Host4::from_tensor(out);
            for (b, &valid) in key_lengths.iter().enumerate() {
                for h in 0..heads {
                    for i in 0..len {
                        let case = format!("case {n}, {name}, ({b}, {h}, {i})");
                        let a = ix.assignments[(b * heads + h) * len + i];
                        let expected: Vec<f64> = if a < 0 {
                            vec![0.0; dim_v]
                        } else {
                            let a = a as usize;
                            let row = ((b * heads + h) * clusters + a) * k;
                            let top = &ix.topk[row..row + k];
                            let scores: Vec<f64> = top
                                .iter()
                                .map(|&t| {
                                    if (t as usize) < valid {
                                        scale
                                            * dot(
                                                &queries.row(b, h, i),
                                                &keys.row(b, h, t as usize),
                                            )
                                    } else {
                                        f64::NEG_INFINITY
                                    }
                                })
                                .collect();
                            let weights = softmax(&scores);
                            (0..dim_v)
                                .map(|d| {
                                    let top_part: f64 = top
                                        .iter()
                                        .zip(&weights)
                                        .map(|(&t, w)| w * values.at(b, h, t as usize, d))
                                        .sum();
                                    mass.at(b, h, a, 0) * top_part + rest.at(b, h, a, d)
                                })
                                .collect()
                        };
                        for (d, expected) in expected.iter().enumerate() {
                            let got = out.at(b, h, i, d);
                            assert!(
                                (got - expected).abs() <= tolerance,
                                "{case}, column {d}: {got} vs {expected}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Under Autodiff, the gradients of the centroid attention with respect to the centroids, keys
/// and values, through the backend's `centroid_attention_backward` and through the default body
/// of that op, equal autodiff through the default forward body (matmul, the attention softmax,
/// a gather, a scatter): both outputs weighted (the rest of `Aᶜ V` and the top-k weights),
/// padded keys, `topk` 0 and above 0, more clusters than one block of the host loops (128
/// rows), more keys than one of their parts (512 keys) and than one task of their backward
/// (2048 keys); more clusters than keys with `topk = S`, padded keys in the top-k; wider rows
/// (`E = D = 32`, `topk` 16) over several row blocks and key blocks of the CubeCL kernels; the
/// widths at which those kernels split a row's features over 2, 4 and 8 units (`E` 19, 32, 64
/// and 128; the forward's `rest` over 2 at 128); and centroids and keys in `{-1, 0, 1}`, whose
/// scores tie with the k-th best (the last case). The scores on both sides are Burn matmuls: 1e-4, raised where the matmul
/// rounds to TF32 ([`matmul_tolerance`]).
///
/// `X` is the backend of `device`: the backend's op runs through the crate's tensor-level
/// `centroid_attention` on `device`'s autodiff form (which Burn routes to `Autodiff<X>`'s op, and
/// so to `X`'s forward and backward), the default forward body is `Autodiff<X>`'s.
pub fn centroid_attention_gradients_match_reference<X>(device: &Device)
where
    X: ClusteredAttentionBackward,
    Autodiff<X>: ClusteredAttentionBackend,
{
    let ad = autodiff(device);
    let tolerance = matmul_tolerance(device, 1e-4) as f32;
    // ([batch, heads, C, E], S, D, key lengths, topk)
    type Case = ([usize; 4], usize, usize, &'static [usize], usize);
    let cases: [Case; 10] = [
        ([2, 2, 5, 19], 37, 18, &[37, 9], 6),
        ([2, 2, 5, 19], 37, 18, &[30, 37], 0),
        ([1, 1, 130, 8], 40, 5, &[33], 3),
        ([2, 1, 9, 8], 1300, 6, &[1300, 700], 5),
        ([2, 2, 7, 8], 4700, 6, &[4700, 2100], 5),
        ([2, 1, 12, 8], 6, 4, &[6, 3], 6),
        ([1, 2, 70, 32], 300, 32, &[251], 16),
        ([1, 1, 33, 64], 90, 40, &[90], 4),
        ([1, 2, 40, 128], 150, 128, &[130], 8),
        ([1, 2, 9, 4], 60, 3, &[50], 7),
    ];
    let ties = cases.len() - 1;
    for (n, (centroid_dims, keys_len, dim_v, key_lengths, topk)) in cases.into_iter().enumerate() {
        let [batch, heads, clusters, dim] = centroid_dims;
        let seed = 110 + 7 * n as u64;
        let ternary = |x: Host4| if n == ties { ternary(x) } else { x };
        let inputs = [
            ternary(normal(centroid_dims, seed)),
            ternary(normal([batch, heads, keys_len, dim], seed + 1)),
            normal([batch, heads, keys_len, dim_v], seed + 2),
        ];
        let outer_values = normal([batch, heads, clusters, dim_v], seed + 3);
        // A weight per key, gathered at each row's top-k: the loss does not depend on the order
        // of the top-k (by score on the backends, in key order in the default body at topk = S).
        let outer_top = normal([batch, heads, clusters, keys_len], seed + 4);
        type Forward = fn(
            [Tensor<4>; 3],
            Option<Tensor<1, Int>>,
            usize,
        ) -> (Tensor<4>, Option<(Tensor<4, Int>, Tensor<4>)>);
        // Gradients of Σ Aᶜ V ⊙ outer_values + Σ top weights ⊙ outer_top at the top-k keys.
        let gradients = |forward: Forward| -> Vec<Tensor<4>> {
            let x: Vec<Tensor<4>> = inputs
                .iter()
                .map(|h| h.to_tensor(&ad).require_grad())
                .collect();
            let (values, top) = forward(
                [x[0].clone(), x[1].clone(), x[2].clone()],
                Some(lengths(key_lengths, &ad)),
                topk,
            );
            let mut loss = (values * outer_values.to_tensor(&ad)).sum();
            if let Some((top, weights)) = top {
                let outer = outer_top.to_tensor(&ad).gather(3, top);
                loss = loss + (weights * outer).sum();
            }
            let grads = loss.backward();
            x.iter()
                .map(|x| x.grad(&grads).expect("a gradient"))
                .collect()
        };
        let expected = gradients(|[c, k, v], l, topk| {
            defaults::centroid_attention::<Autodiff<X>>(c, k, v, l, topk)
        });
        let backend = gradients(|[c, k, v], l, topk| centroid_attention(c, k, v, l, topk, None));
        let default_body = defaults::centroid_attention_backward::<X>(
            inputs[0].to_tensor(device),
            inputs[1].to_tensor(device),
            inputs[2].to_tensor(device),
            Some(lengths(key_lengths, device)),
            topk,
            outer_values.to_tensor(device),
            // The top-k indices as the default forward body picks them.
            |top| outer_top.to_tensor(device).gather(3, top),
        );
        let names = ["centroids", "keys", "values"];
        for (body, got) in [
            ("backend", backend),
            ("default body", Vec::from(default_body)),
        ] {
            for ((name, got), expected) in names.iter().zip(got).zip(&expected) {
                assert_eq!(got.dims(), expected.dims(), "case {n}, {body}, {name}");
                let diff = max_diff(got, expected.clone());
                assert!(
                    diff <= tolerance,
                    "case {n}, {body}: the gradients of {name} differ by {diff}"
                );
            }
        }
    }
}

/// Under Autodiff, the gradients of the per-query top-k attention with respect to its five
/// float inputs, through the backend's `top_attention_backward` and through the default body of
/// that op, equal autodiff through the default forward body (whose sparse products have their
/// own backward, checked above): padded queries, a sequence with padded keys in its top-k sets,
/// widths across the 16-lane blocks of the host kernels (k = 17, E = 19, D = 18), and one
/// (batch, head) with clusters of several hundred queries, which the host loops take in runs
/// and split between threads (on a machine with two or more).
///
/// `X` is the backend of `device`, as in [`centroid_attention_gradients_match_reference`].
pub fn top_attention_gradients_match_reference<X>(device: &Device)
where
    X: ClusteredAttentionBackward,
    Autodiff<X>: ClusteredAttentionBackend,
{
    let cases: [TopGradCase; 2] = [
        (2, 2, 41, 37, 19, 18, 4, 17, &[37, 9]),
        (1, 1, 2500, 300, 16, 12, 6, 9, &[280]),
    ];
    for (n, case) in cases.into_iter().enumerate() {
        top_attention_gradients_case::<X>(device, n, case, 91 + 10 * n as u64);
    }
}

/// (batch, heads, L, S, E, D, C, k, key lengths) of `top_attention_gradients_match_reference`.
type TopGradCase = (
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    usize,
    &'static [usize],
);

/// The float inputs of the top-k attention's backward (queries, keys, values, mass in (0, 1),
/// rest, and the output's gradient), its top-k indices (each set keeping a valid key, as the
/// centroid attention's top-k always does) and assignments, and its key lengths.
struct TopBackwardInputs {
    ix: Indices,
    floats: [Host4; 6],
    key_lengths: &'static [usize],
}

impl TopBackwardInputs {
    fn new(
        (batch, heads, len, keys_len, dim, dim_v, clusters, k, key_lengths): TopGradCase,
        seed: u64,
    ) -> Self {
        let mut ix = indices(batch, heads, len, keys_len, clusters, k, seed);
        for (row, top) in ix.topk.chunks_mut(k).enumerate() {
            let valid = key_lengths[row / (heads * clusters)] as i64;
            if top.iter().all(|&t| t >= valid) {
                top[0] = 0;
            }
        }
        let mut mass = normal([batch, heads, clusters, 1], seed + 4);
        for m in &mut mass.data {
            *m = m.abs() / (1.0 + m.abs());
        }
        let floats = [
            normal([batch, heads, len, dim], seed + 1),
            normal([batch, heads, keys_len, dim], seed + 2),
            normal([batch, heads, keys_len, dim_v], seed + 3),
            mass,
            normal([batch, heads, clusters, dim_v], seed + 5),
            normal([batch, heads, len, dim_v], seed + 6),
        ];
        Self {
            ix,
            floats,
            key_lengths,
        }
    }

    /// The gradients of the queries, keys, values, mass and rest by `backward` (the backend's
    /// op or its default body, of `X`, the backend of `device`), with scale 0.4.
    fn backward<X: ClusteredAttentionBackward>(
        &self,
        device: &Device,
        backward: defaults::TopBackward<X>,
    ) -> Vec<Tensor<4>> {
        let float_in = |i: usize| self.floats[i].to_tensor(device);
        let (topk, assignments) = self.ix.tensors(device);
        defaults::top_attention_backward::<X>(
            backward,
            float_in(0),
            float_in(1),
            float_in(2),
            assignments,
            topk,
            float_in(3),
            float_in(4),
            Some(lengths(self.key_lengths, device)),
            0.4,
            float_in(5),
        )
        .into()
    }
}

fn top_attention_gradients_case<X>(device: &Device, n: usize, case: TopGradCase, seed: u64)
where
    X: ClusteredAttentionBackward,
    Autodiff<X>: ClusteredAttentionBackend,
{
    let ad = autodiff(device);
    let scale = 0.4;
    let input = TopBackwardInputs::new(case, seed);
    // Queries, keys, values, mass, rest; assignments, top-k, key lengths, scale.
    type Forward = fn(
        [Tensor<4>; 5],
        Tensor<3, Int>,
        Tensor<4, Int>,
        Option<Tensor<1, Int>>,
        f64,
    ) -> Tensor<4>;
    // Gradients of Σ out ⊙ outer.
    let gradients = |forward: Forward| -> Vec<Tensor<4>> {
        let x: Vec<Tensor<4>> = input.floats[..5]
            .iter()
            .map(|h| h.to_tensor(&ad).require_grad())
            .collect();
        let (topk, assignments) = input.ix.tensors(&ad);
        let out = forward(
            [
                x[0].clone(),
                x[1].clone(),
                x[2].clone(),
                x[3].clone(),
                x[4].clone(),
            ],
            assignments,
            topk,
            Some(lengths(input.key_lengths, &ad)),
            scale,
        );
        let outer = input.floats[5].to_tensor(&ad);
        let loss = (out * outer).sum();
        let grads = loss.backward();
        x.iter()
            .map(|x| x.grad(&grads).expect("a gradient"))
            .collect()
    };
    let expected = gradients(|[q, k, v, m, r], a, t, l, s| {
        defaults::top_attention::<Autodiff<X>>(q, k, v, a, t, m, r, l, s)
    });
    let backend =
        gradients(|[q, k, v, m, r], a, t, l, s| top_attention(q, k, v, a, t, m, r, l, s, None));
    let default_body = input.backward::<X>(device, reference::top_attention_backward::<X>);
    let names = ["queries", "keys", "values", "mass", "rest"];
    for (body, got) in [("backend", backend), ("default body", default_body)] {
        for ((name, got), expected) in names.iter().zip(got).zip(&expected) {
            assert_eq!(got.dims(), expected.dims(), "case {n}, {body}, {name}");
            let diff = max_diff(got, expected.clone());
            assert!(
                diff <= 1e-4,
                "case {n}, {body}: the gradients of {name} differ by {diff}"
            );
        }
    }
}

/// Under Autodiff, the gradients of the whole improved attention after clustering with respect
/// to the queries, keys and values, through the backend's `improved_attention_backward` (one
/// node: the host loops add the two fused ops' gradients in place) and through the default body
/// of that op, equal autodiff through the default forward body, whose sparse scatter, centroid
/// attention and top-k attention are separate nodes whose gradients Burn sums: padded queries
/// (assignment -1), padded keys, an empty cluster, k = 17 across the 16-lane blocks, and one
/// case with more keys than a part of the host loops (512) and clusters of several hundred
/// queries. The centroid scores on both sides are Burn matmuls: 1e-4, raised where the
/// matmul rounds to TF32 ([`matmul_tolerance`]).
///
/// `X` is the backend of `device`, as in [`centroid_attention_gradients_match_reference`].
pub fn improved_attention_gradients_match_reference<X>(device: &Device)
where
    X: ClusteredAttentionBackward,
    Autodiff<X>: ClusteredAttentionBackend,
{
    let ad = autodiff(device);
    let tolerance = matmul_tolerance(device, 1e-4) as f32;
    let scale = 0.3;
    // (batch, heads, L, S, E, D, C, k, key lengths)
    let cases: [TopGradCase; 2] = [
        (2, 2, 41, 37, 19, 18, 4, 17, &[37, 9]),
        (1, 2, 1500, 1100, 16, 12, 5, 9, &[1100]),
    ];
    for (n, (batch, heads, len, keys_len, dim, dim_v, clusters, k, key_lengths)) in
        cases.into_iter().enumerate()
    {
        let seed = 171 + 10 * n as u64;
        let mut ix = indices(batch, heads, len, keys_len, clusters, k, seed);
        for a in &mut ix.assignments[..len] {
            if *a == 1 {
                *a = 2; // cluster 1 of the first head is empty
            }
        }
        // 1 / count of each cluster's members (1 for an empty cluster).
        let mut inverse_counts = vec![0usize; batch * heads * clusters];
        for (i, &a) in ix.assignments.iter().enumerate() {
            if a >= 0 {
                inverse_counts[(i / len) * clusters + a as usize] += 1;
            }
        }
        let inverse_counts = Host4 {
            data: inverse_counts
                .iter()
                .map(|&c| 1.0 / c.max(1) as f32)
                .collect(),
            dims: [batch, heads, clusters, 1],
        };
        let inputs = [
            normal([batch, heads, len, dim], seed + 1),
            normal([batch, heads, keys_len, dim], seed + 2),
            normal([batch, heads, keys_len, dim_v], seed + 3),
        ];
        let outer = normal([batch, heads, len, dim_v], seed + 4);
        // Queries, keys, values; assignments, inverse counts, key lengths, topk, scale.
        type Forward = fn(
            [Tensor<4>; 3],
            Tensor<3, Int>,
            Tensor<4>,
            Option<Tensor<1, Int>>,
            usize,
            f64,
        ) -> Tensor<4>;
        // Gradients of Σ out ⊙ outer.
        let gradients = |forward: Forward| -> Vec<Tensor<4>> {
            let x: Vec<Tensor<4>> = inputs
                .iter()
                .map(|h| h.to_tensor(&ad).require_grad())
                .collect();
            let out = forward(
                [x[0].clone(), x[1].clone(), x[2].clone()],
                ix.tensors(&ad).1,
                inverse_counts.to_tensor(&ad),
                Some(lengths(key_lengths, &ad)),
                k,
                scale,
            );
            let loss = (out * outer.to_tensor(&ad)).sum();
            let grads = loss.backward();
            x.iter()
                .map(|x| x.grad(&grads).expect("a gradient"))
                .collect()
        };
        let expected = gradients(|[q, k, v], a, c, l, topk, s| {
            defaults::improved_attention::<Autodiff<X>>(q, k, v, a, c, l, topk, s)
        });
        let backend = gradients(|[q, k, v], a, c, l, topk, s| {
            improved_attention(q, k, v, a, c, l, topk, s, None)
        });
        let default_body = defaults::improved_attention_backward::<X>(
            inputs[0].to_tensor(device),
            inputs[1].to_tensor(device),
            inputs[2].to_tensor(device),
            ix.tensors(device).1,
            inverse_counts.to_tensor(device),
            Some(lengths(key_lengths, device)),
            k,
            scale,
            outer.to_tensor(device),
        );
        let names = ["queries", "keys", "values"];
        for (body, got) in [
            ("backend", backend),
            ("default body", Vec::from(default_body)),
        ] {
            for ((name, got), expected) in names.iter().zip(got).zip(&expected) {
                assert_eq!(got.dims(), expected.dims(), "case {n}, {body}, {name}");
                let diff = max_diff(got, expected.clone());
                assert!(
                    diff <= tolerance,
                    "case {n}, {body}: the gradients of {name} differ by {diff}"
                );
            }
        }
    }
}

/// The backend's `top_attention_backward` gives the same gradients, bit for bit, on one thread
/// and on four, where the host loops split each of the two heads' clusters between tasks (their
/// key and value gradients are added in cluster order either way): clusters of several hundred
/// queries, one of them empty, padded keys and queries, keys in the top-k of several clusters.
/// `X` is the backend of `device`.
pub fn top_attention_backward_is_deterministic_across_threads<X: ClusteredAttentionBackward>(
    device: &Device,
) {
    // Few keys, so that most are in the top-k of several clusters, and of both halves.
    let len = 2500;
    let mut input = TopBackwardInputs::new((1, 2, len, 24, 16, 12, 6, 9, &[20]), 141);
    for a in &mut input.ix.assignments[..len] {
        if *a == 2 {
            *a = 3; // cluster 2 of the first head is empty
        }
    }
    let gradients = |threads: usize| -> Vec<Vec<f32>> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .expect("a thread pool");
        pool.install(|| {
            input
                .backward::<X>(device, X::top_attention_backward)
                .into_iter()
                .map(|x| x.into_data().try_into_vec::<f32>().expect("f32"))
                .collect()
        })
    };
    let (one, four) = (gradients(1), gradients(4));
    let names = ["queries", "keys", "values", "mass", "rest"];
    for ((name, one), four) in names.iter().zip(&one).zip(&four) {
        let differ = one
            .iter()
            .zip(four)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "the gradients of {name} differ in {differ} places between one and four threads"
        );
    }
}
