//! Half precision (`f16`, `bf16`): the attentions (the baselines' check is in `baselines.rs`),
//! the hashing, the K-means and the layer on Flex (the CPU backend with half types; NdArray has
//! none), and on WGPU where the adapter has `shader-f16` (see `gpu.rs`).
//!
//! The references take the inputs rounded to the half type and compute in `f64`, so that what
//! is measured is the rounding inside the computation. Tolerances are relative to the largest
//! reference output: 5e-3 for `f16` (unit roundoff 4.9e-4) and 3e-2 for `bf16` (3.9e-3): the
//! scores, the centroids, the weights and the outputs are each rounded to the half type, and
//! the errors found on Flex are 1.4e-3 and 1.2e-2.

use burn::backend::Autodiff;
use burn::module::{Module, ModuleMapper, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{DType, Device, Distribution, FloatDType, Int, Tensor};
use clustered_attention::{
    AttentionInput, AttentionKind, AttentionOptions, ClusteredAttention, ClusteredAttentionInput,
    ClusteringOptions, FullAttention, ImprovedClusteredAttention, MultiHeadClusteredAttention,
    MultiHeadClusteredAttentionConfig, cluster_queries, hamming_kmeans, lsh_hash, lsh_planes,
};

use crate::common::*;

/// Relative tolerance of a half-precision output against the `f64` reference, 2.6–2.8× the
/// largest error measured on the project's 2-core AMD EPYC (2026-11-27): `f16` 1.76e-3 (Flex;
/// 1.69e-3 on WGPU, lavapipe), `bf16` 1.16e-2 (Flex; lavapipe has no `bf16`). Their unit
/// roundoffs are 4.9e-4 and 3.9e-3: the inputs, the products' results and the output are each
/// rounded once.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 5e-3,
        DType::BF16 => 3e-2,
        other => panic!("not a half type: {other:?}"),
    }
}

/// Batch of 2 with query and key padding, S ≠ L, in `dtype` on `device`; the host copies hold
/// the values rounded to `dtype`.
struct HalfCase {
    device: Device,
    q: Host4,
    k: Host4,
    v: Host4,
    tensors: [Tensor<4>; 3],
    query_lengths: Vec<usize>,
    key_lengths: Vec<usize>,
}

impl HalfCase {
    fn new(device: &Device, len: usize, keys_len: usize, dtype: DType, seed: u64) -> Self {
        let round = |host: Host4| {
            let tensor = host.to_tensor(device).cast(dtype);
            (Host4::from_tensor(tensor.clone().cast(DType::F32)), tensor)
        };
        let (q, tq) = round(clustered_queries([2, 2, len, 16], 4, 1.5, seed));
        let (k, tk) = round(normal([2, 2, keys_len, 16], seed + 1));
        let (v, tv) = round(normal([2, 2, keys_len, 8], seed + 2));
        Self {
            device: device.clone(),
            q,
            k,
            v,
            tensors: [tq, tk, tv],
            query_lengths: vec![len, len - len / 3],
            key_lengths: vec![keys_len - 5, keys_len / 2],
        }
    }

    fn setup(&self) -> Setup<'_> {
        Setup {
            query_lengths: &self.query_lengths,
            key_lengths: &self.key_lengths,
            scale: 0.25,
        }
    }

    fn lengths(&self) -> [Option<Tensor<1, Int>>; 2] {
        [
            Some(lengths(&self.query_lengths, &self.device)),
            Some(lengths(&self.key_lengths, &self.device)),
        ]
    }

    fn input(&self) -> AttentionInput {
        let [queries, keys, values] = self.tensors.clone();
        let [query_lengths, key_lengths] = self.lengths();
        AttentionInput {
            queries,
            keys,
            values,
            query_lengths,
            key_lengths,
        }
    }

    fn full(&self) -> Tensor<4> {
        FullAttention::new().forward(self.input())
    }

    fn clustered(&self, clustering: &ClusteringOptions) -> Tensor<4> {
        ClusteredAttention {
            clustering: clustering.clone(),
            options: AttentionOptions::new(),
        }
        .forward(self.input())
    }

    fn improved(&self, clustering: &ClusteringOptions, topk: usize) -> Tensor<4> {
        ImprovedClusteredAttention {
            clustering: clustering.clone(),
            topk,
            options: AttentionOptions::new(),
        }
        .forward(self.input())
    }

    fn assignments(&self, clustering: &ClusteringOptions) -> Vec<i64> {
        let [ql, _] = self.lengths();
        host_ints(cluster_queries(self.tensors[0].clone(), ql, clustering).assignments)
    }
}

/// The gradients of the centroid attention in `dtype` on `device`'s autodiff form (both outputs
/// weighted: the rest of `Aᶜ V` and the top-k weights; padded keys; `topk` 4 and 0), against
/// Autodiff through the default forward body on NdArray in `f32` with the same inputs and outer
/// gradients rounded to `dtype`: each input's gradient within [`tolerance`] of its largest
/// reference entry. The backward passes compute in `f32` from the half-type inputs, forward
/// outputs and outer gradients, and round their results once.
pub fn centroid_gradients_match_reference(device: &Device, dtype: DType) {
    type Reference = Autodiff<NdArrayBackend>;
    let reference_device = autodiff(&ndarray());
    let rounded =
        |host: Host4| Host4::from_tensor(host.to_tensor(device).cast(dtype).cast(DType::F32));
    let (clusters, keys_len, key_lengths) = (9, 70, [70, 33]);
    // Centroids of a quarter of the keys' scale, so that the weights spread over many keys.
    let mut centroids = normal([2, 2, clusters, 16], 300);
    centroids.data.iter_mut().for_each(|x| *x *= 0.25);
    let inputs = [
        rounded(centroids),
        rounded(normal([2, 2, keys_len, 16], 301)),
        rounded(normal([2, 2, keys_len, 8], 302)),
    ];
    for topk in [4, 0] {
        let outer_values = rounded(normal([2, 2, clusters, 8], 303));
        let outer_top = rounded(normal([2, 2, clusters, topk], 304));
        let expected = {
            let x: Vec<Tensor<4>> = inputs
                .iter()
                .map(|h| h.to_tensor(&reference_device).require_grad())
                .collect();
            let (values, top) = crate::defaults::centroid_attention::<Reference>(
                x[0].clone(),
                x[1].clone(),
                x[2].clone(),
                Some(lengths(&key_lengths, &reference_device)),
                topk,
            );
            let mut loss = (values * outer_values.to_tensor(&reference_device)).sum();
            if let Some((_, weights)) = top {
                loss = loss + (weights * outer_top.to_tensor(&reference_device)).sum();
            }
            let grads = loss.backward();
            x.iter()
                .map(|x| Host4::from_tensor(x.grad(&grads).expect("a gradient")))
                .collect::<Vec<_>>()
        };
        let got = {
            let device = autodiff(device);
            let half = |h: &Host4| h.to_tensor(&device).cast(dtype);
            let x: Vec<Tensor<4>> = inputs.iter().map(|h| half(h).require_grad()).collect();
            let (values, top) = clustered_attention::ops::centroid_attention(
                x[0].clone(),
                x[1].clone(),
                x[2].clone(),
                Some(lengths(&key_lengths, &device)),
                topk,
                None,
            );
            let mut loss = (values * half(&outer_values)).sum();
            if let Some((_, weights)) = top {
                loss = loss + (weights * half(&outer_top)).sum();
            }
            let grads = loss.backward();
            x.iter()
                .map(|x| {
                    let grad = x.grad(&grads).expect("a gradient");
                    assert_eq!(grad.dtype(), dtype, "the gradient's dtype");
                    Host4::from_tensor(grad.cast(DType::F32))
                })
                .collect::<Vec<_>>()
        };
        for ((name, got), expected) in ["centroids", "keys", "values"]
            .iter()
            .zip(got)
            .zip(expected)
        {
            let largest = expected.data.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
            let error = got
                .data
                .iter()
                .zip(&expected.data)
                .map(|(a, b)| (a - b).abs() as f64)
                .fold(0.0, f64::max);
            assert!(
                error <= tolerance(dtype) * largest,
                "{dtype:?}, topk {topk}: the gradient of {name} is off by {error} (largest {largest})"
            );
        }
    }
}

/// The output, checked to be of `dtype`, as `f32` host values.
fn host(out: Tensor<4>, dtype: DType) -> Host4 {
    assert_eq!(out.dtype(), dtype, "the output dtype");
    Host4::from_tensor(out.cast(DType::F32))
}

/// `max |out − reference| / max |reference|`.
pub fn relative_error(out: &Host4, reference: &Rows) -> f64 {
    let scale = reference
        .iter()
        .flatten()
        .fold(0.0f64, |m, x| m.max(x.abs()));
    max_abs_diff(out, reference) / scale
}

/// Full, clustered and improved attention in `dtype` against the `f64` references (the latter
/// two on the assignments the half-precision run made), with C < L and topk < S.
pub fn attention_matches_reference(device: &Device, dtype: DType) {
    let tolerance = tolerance(dtype);
    let case = HalfCase::new(device, 96, 80, dtype, 5);
    let setup = case.setup();
    let check = |name: &str, out: Tensor<4>, reference: Rows| {
        let error = relative_error(&host(out, dtype), &reference);
        assert!(
            error <= tolerance,
            "{dtype:?} {name} vs the f64 reference: relative error {error} > {tolerance}"
        );
    };
    check(
        "full",
        case.full(),
        full_reference(&case.q, &case.k, &case.v, &setup),
    );
    let clustering = ClusteringOptions::new(6).with_seed(3);
    let assignments = case.assignments(&clustering);
    check(
        "clustered",
        case.clustered(&clustering),
        clustered_reference(&case.q, &case.k, &case.v, &assignments, &setup),
    );
    for topk in [1, 10, 32] {
        check(
            &format!("improved (topk {topk})"),
            case.improved(&clustering, topk),
            improved_reference(&case.q, &case.k, &case.v, &assignments, topk, &setup),
        );
    }
}

/// With no more valid queries than clusters, clustered and improved attention in `dtype` equal
/// full attention (the `f64` reference); so does improved with topk ≥ S.
pub fn exact_regime_equals_full(device: &Device, dtype: DType) {
    let tolerance = tolerance(dtype);
    let case = HalfCase::new(device, 40, 30, dtype, 9);
    let full = full_reference(&case.q, &case.k, &case.v, &case.setup());
    let check = |name: &str, out: Tensor<4>| {
        let error = relative_error(&host(out, dtype), &full);
        assert!(
            error <= tolerance,
            "{dtype:?} {name} vs the f64 full attention: relative error {error}"
        );
    };
    let all = ClusteringOptions::new(40);
    check("clustered, 40 clusters ≥ L", case.clustered(&all));
    check("improved, 40 clusters ≥ L", case.improved(&all, 4));
    check(
        "improved, topk 30 ≥ S",
        case.improved(&ClusteringOptions::new(3), 30),
    );
}

/// Hashing in `dtype`: every bit of a query whose projection is farther from the plane's
/// threshold than 1 % of `Σ |q_e · p_e| + |threshold|` matches the `f64` projection of the
/// rounded query on the rounded plane. Then K-means on those codes gives the same assignments
/// and counts as the default body (integer arithmetic) computes on NdArray in `f32`.
pub fn hashing_and_kmeans_match_reference(device: &Device, dtype: DType) {
    let dims = [2, 2, 300, 16];
    let queries = clustered_queries(dims, 3, 1.0, 21)
        .to_tensor(device)
        .cast(dtype);
    let planes = lsh_planes(32, 16, true, 4, device).cast(dtype);
    let codes = lsh_hash(queries.clone(), planes.clone());
    let q = Host4::from_tensor(queries.cast(DType::F32));
    let p: Vec<f64> = planes
        .cast(DType::F32)
        .into_data()
        .iter::<f32>()
        .map(f64::from)
        .collect();
    let host_codes = host_ints(codes.clone());
    let mut checked = 0;
    for (row, &code) in host_codes.iter().enumerate() {
        let query = &q.data[row * 16..(row + 1) * 16];
        for bit in 0..32 {
            let plane = &p[bit * 17..(bit + 1) * 17];
            let terms = query.iter().zip(plane).map(|(&x, &w)| x as f64 * w);
            let projection: f64 = terms.clone().sum();
            let magnitude: f64 = terms.map(f64::abs).sum::<f64>() + plane[16].abs();
            if (projection - plane[16]).abs() > 1e-2 * magnitude {
                checked += 1;
                assert_eq!(
                    (code as i32 as u32 >> bit) & 1 == 1,
                    projection > plane[16],
                    "{dtype:?}: bit {bit} of query {row} (projection {projection}, threshold {})",
                    plane[16]
                );
            }
        }
    }
    assert!(
        checked > 300 * 4 * 30,
        "only {checked} bits were far from their plane"
    );

    // Two clusters of ~300 members each: more than bf16 holds exactly as integers (256).
    let query_lengths = [300, 250];
    let clusters = hamming_kmeans(codes, Some(lengths(&query_lengths, device)), 2, 10, 8);
    let cpu = ndarray();
    let codes_f32 =
        Tensor::<3, Int>::from_data(burn::tensor::TensorData::new(host_codes, [2, 2, 300]), &cpu);
    let (assignments, counts) = crate::defaults::hamming_kmeans::<NdArrayBackend>(
        codes_f32,
        Some(lengths(&query_lengths, &cpu)),
        2,
        10,
        8,
    );
    assert_eq!(
        host_ints(clusters.assignments),
        host_ints(assignments),
        "{dtype:?}: assignments"
    );
    assert_eq!(
        host_ints(clusters.counts),
        host_ints(counts),
        "{dtype:?}: counts"
    );
}

/// Casts every float parameter of a module to `dtype`, keeping it a trainable leaf.
struct CastParams(FloatDType);

impl ModuleMapper for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let dtype = self.0;
        param.map(|tensor| tensor.cast(dtype).detach().require_grad())
    }
}

/// The layer with improved clustered attention, its parameters in `dtype`, fits one batch:
/// targets are the sequence mean of the inputs through a fixed random matrix (reachable with
/// uniform attention), and within 300 Adam steps the mean squared error falls below 0.1 % of
/// its start (the same floor an `f32` run reaches: clusters and top-k sets move as the
/// queries do). `device` is an autodiff device.
pub fn layer_trains_one_batch(device: &Device, dtype: FloatDType) {
    device.seed(3);
    let (batch, len, d_model) = (2, 40, 16);
    let layer = MultiHeadClusteredAttentionConfig::new(
        d_model,
        2,
        AttentionKind::Improved {
            clusters: 4,
            topk: 4,
        },
    )
    .init(device);
    let mut layer = layer.map(&mut CastParams(dtype));
    let x = Tensor::<3>::random([batch, len, d_model], Distribution::Default, device);
    let mixing = Tensor::<2>::random([d_model, d_model], Distribution::Default, device);
    let target = x
        .clone()
        .mean_dim(1)
        .matmul(mixing.unsqueeze())
        .expand([batch, len, d_model])
        .cast(dtype)
        .detach();
    let x = x.cast(dtype).detach();
    let mut optim = AdamConfig::new().init();
    let mse = |layer: &MultiHeadClusteredAttention| {
        let out = layer.forward(ClusteredAttentionInput::self_attn(x.clone()));
        assert_eq!(out.dtype(), DType::from(dtype), "the layer's output dtype");

        (out - target.clone()).powi_scalar(2).mean()
    };
    let start: f32 = mse(&layer).cast(DType::F32).into_scalar::<f32>();
    let mut best = start;
    for step in 0..300 {
        let loss = mse(&layer);
        best = best.min(loss.clone().cast(DType::F32).into_scalar::<f32>());
        if best < 1e-3 * start {
            break;
        }
        let grads = GradientsParams::from_grads(loss.backward(), &layer);
        layer = optim.step(1e-2 / (1.0 + step as f64 / 50.0), layer, grads);
    }
    assert!(
        best < 1e-3 * start,
        "{dtype:?}: mean squared error {best} at best in 300 steps, {start} before"
    );
}

mod flex {
    use burn::tensor::{DType, FloatDType};

    use crate::common::{autodiff, flex};

    #[test]
    fn attention_matches_reference() {
        super::attention_matches_reference(&flex(), DType::F16);
        super::attention_matches_reference(&flex(), DType::BF16);
    }

    #[test]
    fn exact_regime_equals_full() {
        super::exact_regime_equals_full(&flex(), DType::F16);
        super::exact_regime_equals_full(&flex(), DType::BF16);
    }

    #[test]
    fn baselines_match_reference() {
        crate::baselines::half_baselines_match_reference(&flex(), DType::F16);
        crate::baselines::half_baselines_match_reference(&flex(), DType::BF16);
    }

    #[test]
    fn hashing_and_kmeans_match_reference() {
        super::hashing_and_kmeans_match_reference(&flex(), DType::F16);
        super::hashing_and_kmeans_match_reference(&flex(), DType::BF16);
    }

    #[test]
    fn layer_trains_one_batch_in_bf16() {
        super::layer_trains_one_batch(&autodiff(&flex()), FloatDType::BF16);
    }

    #[test]
    fn centroid_gradients_match_reference() {
        super::centroid_gradients_match_reference(&flex(), DType::F16);
        super::centroid_gradients_match_reference(&flex(), DType::BF16);
    }
}
