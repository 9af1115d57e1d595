//! The paper's baselines (Reformer's lsh-X, shared-full, oracle-top) against straightforward
//! host references in f64, and dropout on every attention's weights.

use burn::tensor::{DType, Device, Int, Tensor};
use clustered_attention::attention::{angular_buckets, lsh_rotations, sort_by_bucket};
use clustered_attention::dropout::dropout;
use clustered_attention::{
    AttentionInput, ClusteredAttention, ClusteringOptions, FullAttention,
    ImprovedClusteredAttention, LshAttention, LshOptions, OracleTopAttention, SharedFullAttention,
    cluster_queries, with_dropout_seed,
};
use rand_distr::{Distribution, StandardNormal};

use crate::common::*;

/// Tolerance of every f32-versus-f64 comparison of attention outputs (on CUDA, where Burn's
/// matmul rounds to TF32, raised by [`matmul_tolerance`] in the tests that run there).
const TOLERANCE: f64 = 1e-5;

type SharedInputs = (
    Tensor<4>,
    Tensor<4>,
    Option<Tensor<1, Int>>,
    Option<Tensor<1, Int>>,
);

/// A shared-QK batch: queries are the keys, 3 sequences with padding.
struct SharedCase {
    q: Host4,
    v: Host4,
    lengths: Vec<usize>,
}

impl SharedCase {
    fn new(len: usize, dim: usize, value_dim: usize, seed: u64) -> Self {
        Self {
            q: clustered_queries([3, 2, len, dim], 5, 1.5, seed),
            v: normal([3, 2, len, value_dim], seed + 1),
            lengths: vec![len, len - 7, len / 3],
        }
    }

    /// Queries, values, query lengths, key lengths.
    fn tensors(&self, device: &Device) -> SharedInputs {
        (
            self.q.to_tensor(device),
            self.v.to_tensor(device),
            Some(lengths(&self.lengths, device)),
            Some(lengths(&self.lengths, device)),
        )
    }

    fn scale(&self) -> f64 {
        1.0 / (self.q.dims[3] as f64).sqrt()
    }
}

/// The input of a shared-QK self-attention: the queries are the keys.
fn shared_input(
    q: Tensor<4>,
    v: Tensor<4>,
    query_lengths: Option<Tensor<1, Int>>,
    key_lengths: Option<Tensor<1, Int>>,
) -> AttentionInput {
    AttentionInput {
        queries: q.clone(),
        keys: q,
        values: v,
        query_lengths,
        key_lengths,
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn unit(x: &[f64]) -> Vec<f64> {
    let norm = dot(x, x).sqrt().max(1e-6);
    x.iter().map(|v| v / norm).collect()
}

/// Softmax-weighted values over `keys` with `scores`; also returns the log-sum-exp.
fn attend(scores: &[(usize, f64)], v: &Host4, b: usize, h: usize) -> (Vec<f64>, f64) {
    let max = scores.iter().map(|s| s.1).fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = scores.iter().map(|s| (s.1 - max).exp()).sum();
    let lse = max + sum.ln();
    let mut out = vec![0.0; v.dims[3]];
    for &(j, s) in scores {
        let w = (s - lse).exp();
        for (d, o) in out.iter_mut().enumerate() {
            *o += w * v.at(b, h, j, d);
        }
    }
    (out, lse)
}

/// A query's score against key `j` in shared-QK attention: own key −10⁴ (Reformer).
fn shared_score(case: &SharedCase, b: usize, h: usize, i: usize, j: usize) -> f64 {
    if i == j {
        -1.0e4
    } else {
        case.scale() * dot(&case.q.row(b, h, i), &unit(&case.q.row(b, h, j)))
    }
}

/// shared-full: every valid key, own key penalised.
fn shared_full_reference(case: &SharedCase) -> Rows {
    let [batch, heads, len, _] = case.q.dims;
    let mut rows = Vec::new();
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..len {
                if i >= case.lengths[b] {
                    rows.push(vec![0.0; case.v.dims[3]]);
                    continue;
                }
                let scores: Vec<(usize, f64)> = (0..case.lengths[b])
                    .map(|j| (j, shared_score(case, b, h, i, j)))
                    .collect();
                rows.push(attend(&scores, &case.v, b, h).0);
            }
        }
    }
    rows
}

/// Component `c` of `[xR ; −xR]` in f64, and the sum of its products' magnitudes
/// `Σ_e |x_e R_ec|` (what bounds its rounding error).
fn projection(x: &[f64], rotations: &[f64], half: usize, c: usize) -> (f64, f64) {
    let products = (0..x.len()).map(|e| x[e] * rotations[e * half + c % half]);
    let p: f64 = products.clone().sum();
    (if c < half { p } else { -p }, products.map(f64::abs).sum())
}

/// Angular LSH bucket of a vector, `argmax([xR ; −xR])`, in f64.
fn bucket(x: &[f64], rotations: &[f64], half: usize) -> usize {
    (0..2 * half)
        .map(|c| (projection(x, rotations, half, c).0, c))
        .fold(
            (f64::NEG_INFINITY, 0),
            |best, p| if p.0 > best.0 { p } else { best },
        )
        .1
}

/// Relative rounding error of one product `xR` on `device`: TF32 on CUDA (10 mantissa bits,
/// both factors rounded: 2 · 2^-11 ≈ 1e-3, doubled), f32 elsewhere.
fn projection_tolerance(device: &Device) -> f64 {
    if is_cuda(device) { 2e-3 } else { 1e-5 }
}

/// Checks a device's bucket `got` of `x` against the f64 arg-max: equal, or a near tie that
/// the device's rounding may break the other way (the two projections closer than
/// `relative · (Σ|products| of both)`).
fn check_bucket(
    x: &[f64],
    rotations: &[f64],
    half: usize,
    got: usize,
    relative: f64,
) -> Result<(), String> {
    let best = bucket(x, rotations, half);
    if got == best {
        return Ok(());
    }
    if got >= 2 * half {
        return Err(format!("bucket {got} out of 0..{}", 2 * half));
    }
    let (p_best, s_best) = projection(x, rotations, half, best);
    let (p_got, s_got) = projection(x, rotations, half, got);
    if p_best - p_got <= relative * (s_best + s_got) {
        Ok(())
    } else {
        Err(format!(
            "bucket {got} (projection {p_got}) where the arg-max is {best} ({p_best})"
        ))
    }
}

/// The device's buckets of every hashing round of `case` under `options` (the crate's
/// [`lsh_rotations`] and [`angular_buckets`], as [`LshAttention`] hashes), each
/// `[batch, heads, L]` flattened, checked against the f64 arg-max of the reference's own
/// rotations ([`check_bucket`]) at the valid positions.
fn device_buckets(
    device: &Device,
    case: &SharedCase,
    options: &LshOptions,
    reference_rotations: &[Vec<f64>],
) -> Vec<Vec<i64>> {
    let [_, heads, len, dim] = case.q.dims;
    let buckets = options.buckets_for(len);
    assert_eq!(
        buckets,
        self::reference_rotations(case, options).0,
        "LshOptions::buckets_for({len}) differs from the documented count"
    );
    (0..options.rounds)
        .map(|r| {
            let rotations = lsh_rotations(dim, buckets, options.round_seed(r), device);
            let hashed = host_ints(angular_buckets(case.q.to_tensor(device), rotations));
            for (row, keys) in hashed.chunks(len).enumerate() {
                let (b, h) = (row / heads, row % heads);
                for (i, &key) in keys.iter().enumerate().take(case.lengths[b]) {
                    let x = case.q.row(b, h, i);
                    check_bucket(
                        &x,
                        &reference_rotations[r],
                        buckets / 2,
                        key as usize,
                        projection_tolerance(device),
                    )
                    .unwrap_or_else(|e| panic!("round {r}, position [{b}, {h}, {i}]: {e}"));
                }
            }
            hashed
        })
        .collect()
}

/// The reference's hashing: Reformer's `2 · ⌈L / m⌉` buckets unless given, and round `r`'s
/// rotations `[E, buckets / 2]` (row-major), standard normal `f32` draws of a
/// `Xoshiro256PlusPlus` seeded `seed + r · 0x9E3779B97F4A7C15`. Written from the
/// documentation, not the crate's `buckets_for`, `round_seed` and `lsh_rotations`.
fn reference_rotations(case: &SharedCase, options: &LshOptions) -> (usize, Vec<Vec<f64>>) {
    let [_, _, len, dim] = case.q.dims;
    let buckets = options
        .buckets
        .unwrap_or(2 * len.div_ceil(options.chunk_size));
    let rotations = (0..options.rounds)
        .map(|r| {
            let mut rng = rng(options
                .seed
                .wrapping_add((r as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
            (0..dim * buckets / 2)
                .map(|_| {
                    let x: f32 = StandardNormal.sample(&mut rng);
                    f64::from(x)
                })
                .collect()
        })
        .collect();
    (buckets, rotations)
}

/// lsh-X as Reformer defines it, one query at a time: sort by (bucket, position), the keys of
/// the own and previous chunk, rounds weighted by the softmax of their log-sum-exps. The
/// buckets are `hashed[round]` (`[batch, heads, L]` flattened: the device's, checked apart by
/// [`device_buckets`], so that a near tie the device's rounding breaks the other way moves the
/// same query in both); padded positions take the extra, last bucket.
fn lsh_reference(case: &SharedCase, options: &LshOptions, hashed: &[Vec<i64>]) -> Rows {
    let [batch, heads, len, _] = case.q.dims;
    let (buckets, _) = reference_rotations(case, options);
    let m = options.chunk_size.min(len);
    let mut rows = Vec::new();
    for b in 0..batch {
        let n = case.lengths[b];
        for h in 0..heads {
            let mut per_round = Vec::new();
            for round in hashed {
                let row = &round[(b * heads + h) * len..][..len];
                let keys: Vec<usize> = (0..len)
                    .map(|i| if i < n { row[i] as usize } else { buckets })
                    .collect();
                let mut order: Vec<usize> = (0..len).collect();
                order.sort_by_key(|&i| (keys[i], i));
                let mut results = vec![(Vec::new(), 0.0); len];
                for (slot, &i) in order.iter().enumerate() {
                    let chunk = slot / m;
                    let first = chunk.saturating_sub(1) * m;
                    let last = ((chunk + 1) * m).min(len);
                    let scores: Vec<(usize, f64)> = order[first..last]
                        .iter()
                        .filter(|&&j| j < n)
                        .map(|&j| (j, shared_score(case, b, h, i, j)))
                        .collect();
                    if i < n {
                        results[i] = attend(&scores, &case.v, b, h);
                    }
                }
                per_round.push(results);
            }
            for i in 0..len {
                if i >= n {
                    rows.push(vec![0.0; case.v.dims[3]]);
                    continue;
                }
                let lses: Vec<f64> = per_round.iter().map(|r| r[i].1).collect();
                let max = lses.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let total = max + lses.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
                let mut out = vec![0.0; case.v.dims[3]];
                for round in &per_round {
                    let w = (round[i].1 - total).exp();
                    for (o, x) in out.iter_mut().zip(&round[i].0) {
                        *o += w * x;
                    }
                }
                rows.push(out);
            }
        }
    }
    rows
}

fn run_lsh(device: &Device, case: &SharedCase, options: &LshOptions) -> Host4 {
    let (q, v, ql, kl) = case.tensors(device);
    Host4::from_tensor(
        LshAttention::new(options.rounds)
            .with_lsh(options.clone())
            .forward(shared_input(q, v, ql, kl)),
    )
}

fn run_shared_full(device: &Device, case: &SharedCase) -> Host4 {
    let (q, v, ql, kl) = case.tensors(device);
    Host4::from_tensor(SharedFullAttention::new().forward(shared_input(q, v, ql, kl)))
}

/// The angular buckets equal the f64 arg-max (near ties excepted on CUDA's TF32 products,
/// [`check_bucket`]), and the device sort equals a stable host sort by
/// bucket, with buckets spanning one to three hexadecimal digits.
pub fn buckets_and_sort_match_reference(device: &Device) {
    let q = normal([2, 3, 300, 8], 11);
    for buckets in [2, 14, 40, 600] {
        let rotations = lsh_rotations(8, buckets, 5, device);
        let host_rotations: Vec<f64> = rotations
            .clone()
            .into_data()
            .iter::<f32>()
            .map(f64::from)
            .collect();
        let hashed = angular_buckets(q.to_tensor(device), rotations);
        let hashed_host = host_ints(hashed.clone());
        let order = host_ints(sort_by_bucket(hashed, buckets - 1));
        for (row, keys) in hashed_host.chunks(300).enumerate() {
            let (b, h) = (row / 3, row % 3);
            for (i, &key) in keys.iter().enumerate() {
                check_bucket(
                    &q.row(b, h, i),
                    &host_rotations,
                    buckets / 2,
                    key as usize,
                    projection_tolerance(device),
                )
                .unwrap_or_else(|e| panic!("[{b}, {h}, {i}] with {buckets} buckets: {e}"));
            }
            let mut expected: Vec<i64> = (0..300).collect();
            expected.sort_by_key(|&i| (keys[i as usize], i));
            assert_eq!(
                order[row * 300..(row + 1) * 300],
                expected[..],
                "sort of row {row} with {buckets} buckets"
            );
        }
    }
}

/// lsh-X against the reference, for 1 and 4 rounds, chunks dividing L or not, the default and
/// explicit bucket counts, with padded sequences: the device's buckets checked against the
/// f64 arg-max (near ties excepted, [`check_bucket`]), then the attention against the
/// reference fed those buckets.
pub fn lsh_matches_reference(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    for (len, rounds, chunk, buckets, seed) in [
        (64, 1, 8, None, 1),
        (70, 4, 8, None, 2),
        (50, 2, 16, Some(4), 3),
        (33, 4, 5, Some(12), 4),
    ] {
        let case = SharedCase::new(len, 8, 3, seed);
        let options = LshOptions::new()
            .with_rounds(rounds)
            .with_chunk_size(chunk)
            .with_buckets(buckets)
            .with_seed(seed);
        let (_, rotations) = reference_rotations(&case, &options);
        let hashed = device_buckets(device, &case, &options, &rotations);
        let diff = max_abs_diff(
            &run_lsh(device, &case, &options),
            &lsh_reference(&case, &options, &hashed),
        );
        assert!(
            diff <= tolerance,
            "lsh (L {len}, {rounds} rounds, chunk {chunk}, buckets {buckets:?}) differs from the reference by {diff}"
        );
    }
}

/// One chunk covering the sequence: lsh-X attends to every valid key, so it equals the
/// shared-full reference, as shared-full does.
pub fn one_chunk_lsh_equals_shared_full(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    let case = SharedCase::new(40, 8, 4, 9);
    let shared = run_shared_full(device, &case);
    let diff = max_abs_diff(&shared, &shared_full_reference(&case));
    assert!(
        diff <= tolerance,
        "shared-full differs from the reference by {diff}"
    );
    for rounds in [1, 3] {
        let options = LshOptions::new().with_rounds(rounds).with_chunk_size(40);
        let lsh = run_lsh(device, &case, &options);
        let diff = max_abs_diff(&lsh, &shared_full_reference(&case));
        assert!(
            diff <= tolerance,
            "lsh-{rounds} with one chunk differs from the shared-full reference by {diff}"
        );
    }
}

/// A query whose other keys are all padded attends to itself.
pub fn lone_query_attends_to_itself(device: &Device) {
    let mut case = SharedCase::new(10, 4, 2, 12);
    case.lengths = vec![1, 10, 2];
    let lsh = run_lsh(device, &case, &LshOptions::new().with_chunk_size(4));
    for h in 0..2 {
        for d in 0..2 {
            let (actual, expected) = (lsh.at(0, h, 0, d), case.v.at(0, h, 0, d));
            assert!(
                (actual - expected).abs() <= TOLERANCE,
                "head {h}: a lone query's output {actual} is not its own value {expected}"
            );
        }
    }
}

/// In shared-QK attention a position past its key length is padding even when its query
/// length covers it: with every query length the whole sequence, lsh-X and shared-full give
/// their references' rows at the key lengths and zero rows past them.
pub fn positions_past_key_length_are_padding(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    let case = SharedCase::new(30, 8, 3, 14);
    let options = LshOptions::new().with_chunk_size(4).with_rounds(2);
    for shared in [false, true] {
        let (q, v) = (case.q.to_tensor(device), case.v.to_tensor(device));
        let (ql, kl) = (
            Some(lengths(&[30, 30, 30], device)),
            Some(lengths(&case.lengths, device)),
        );
        let input = shared_input(q, v, ql, kl);
        let (out, reference) = if shared {
            (
                SharedFullAttention::new().forward(input),
                shared_full_reference(&case),
            )
        } else {
            (
                LshAttention::new(options.rounds)
                    .with_lsh(options.clone())
                    .forward(input),
                {
                    let (_, rotations) = reference_rotations(&case, &options);
                    lsh_reference(
                        &case,
                        &options,
                        &device_buckets(device, &case, &options, &rotations),
                    )
                },
            )
        };
        let diff = max_abs_diff(&Host4::from_tensor(out), &reference);
        assert!(
            diff <= tolerance,
            "shared-full: {shared}: query lengths 30 against key lengths {:?} differ from the reference by {diff}",
            case.lengths
        );
    }
}

/// A zero key (its norm is 0) leaves every gradient finite.
#[test]
fn zero_key_gives_finite_gradients() {
    let device = autodiff(&ndarray());
    let mut q = normal([1, 2, 12, 4], 15);
    q.data[3 * 4..4 * 4].fill(0.0);
    let v = normal([1, 2, 12, 2], 16);
    for shared in [false, true] {
        let queries = q.to_tensor(&device).require_grad();
        let values = v.to_tensor(&device);
        let out = if shared {
            SharedFullAttention::new().forward(AttentionInput::new(
                queries.clone(),
                queries.clone(),
                values,
            ))
        } else {
            LshAttention::new(1)
                .with_chunk_size(4)
                .forward(AttentionInput::new(
                    queries.clone(),
                    queries.clone(),
                    values,
                ))
        };
        let grads = out.sum().backward();
        let grad: Vec<f32> = queries
            .grad(&grads)
            .unwrap()
            .into_data()
            .iter::<f32>()
            .collect();
        assert!(
            grad.iter().all(|g| g.is_finite()),
            "shared-full {shared}: a zero key gives a non-finite gradient"
        );
    }
}

/// The same seed gives bit-identical outputs; another seed other buckets.
pub fn lsh_same_seed_bit_identical(device: &Device) {
    let case = SharedCase::new(96, 8, 4, 13);
    let options = LshOptions::new()
        .with_rounds(2)
        .with_chunk_size(8)
        .with_seed(1);
    assert_eq!(
        run_lsh(device, &case, &options).data,
        run_lsh(device, &case, &options).data
    );
    assert_ne!(
        run_lsh(device, &case, &options).data,
        run_lsh(device, &case, &options.clone().with_seed(2)).data
    );
}

/// oracle-top: each query's top-k valid keys by score, softmax over them; with `k ≥ S` it is
/// full attention.
pub fn oracle_top_matches_reference(device: &Device) {
    let q = clustered_queries([3, 2, 30, 8], 4, 1.5, 21);
    let k = normal([3, 2, 25, 8], 22);
    let v = normal([3, 2, 25, 3], 23);
    let (query_lengths, key_lengths) = ([30, 21, 9], [25, 5, 17]);
    let scale = 1.0 / 8f64.sqrt();
    for topk in [1, 6, 25, 40] {
        let out = Host4::from_tensor(
            OracleTopAttention::new(topk).forward(
                AttentionInput::new(
                    q.to_tensor(device),
                    k.to_tensor(device),
                    v.to_tensor(device),
                )
                .with_query_lengths(lengths(&query_lengths, device))
                .with_key_lengths(lengths(&key_lengths, device)),
            ),
        );
        let mut reference = Vec::new();
        for b in 0..3 {
            for h in 0..2 {
                for i in 0..30 {
                    if i >= query_lengths[b] {
                        reference.push(vec![0.0; 3]);
                        continue;
                    }
                    let mut scores: Vec<(usize, f64)> = (0..key_lengths[b])
                        .map(|j| (j, scale * dot(&q.row(b, h, i), &k.row(b, h, j))))
                        .collect();
                    scores.sort_by(|x, y| y.1.total_cmp(&x.1));
                    scores.truncate(topk);
                    reference.push(attend(&scores, &v, b, h).0);
                }
            }
        }
        let diff = max_abs_diff(&out, &reference);
        assert!(
            diff <= TOLERANCE,
            "oracle-top with k = {topk} differs from the reference by {diff}"
        );
    }
}

macro_rules! baseline_tests {
    ($module:ident, $device:expr) => {
        mod $module {
            #[test]
            fn buckets_and_sort_match_reference() {
                super::buckets_and_sort_match_reference(&$device);
            }
            #[test]
            fn lsh_matches_reference() {
                super::lsh_matches_reference(&$device);
            }
            #[test]
            fn one_chunk_lsh_equals_shared_full() {
                super::one_chunk_lsh_equals_shared_full(&$device);
            }
            #[test]
            fn lone_query_attends_to_itself() {
                super::lone_query_attends_to_itself(&$device);
            }
            #[test]
            fn positions_past_key_length_are_padding() {
                super::positions_past_key_length_are_padding(&$device);
            }
            #[test]
            fn lsh_same_seed_bit_identical() {
                super::lsh_same_seed_bit_identical(&$device);
            }
            #[test]
            fn oracle_top_matches_reference() {
                super::oracle_top_matches_reference(&$device);
            }
        }
    };
}

baseline_tests!(ndarray, crate::common::ndarray());
baseline_tests!(flex, crate::common::flex());

/// lsh-X and shared-full on the GPU backends.
#[cfg(any(feature = "wgpu", feature = "cuda"))]
macro_rules! gpu_baseline_tests {
    ($module:ident, $device:expr $(, $ignore:meta)?) => {
        mod $module {
            #[test]
            $(#[$ignore])?
            fn buckets_and_sort_match_reference() {
                super::buckets_and_sort_match_reference(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn lsh_matches_reference() {
                super::lsh_matches_reference(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn one_chunk_lsh_equals_shared_full() {
                super::one_chunk_lsh_equals_shared_full(&$device);
            }
        }
    };
}

#[cfg(feature = "wgpu")]
gpu_baseline_tests!(wgpu, crate::common::wgpu());
#[cfg(feature = "cuda")]
gpu_baseline_tests!(
    cuda,
    crate::common::cuda(),
    ignore = "needs an NVIDIA GPU: run with --ignored"
);

/// Dropout on every attention's weights, checked on the weights themselves: with the identity
/// as values (`D = S`), an output row is the row's attention weights. After dropout (p = 0.3)
/// every weight is either 0 or its value without dropout times `1 / (1 − p)` (within 1e-5 of
/// it, relative), the fraction of zeroed weights is within 5 standard errors of `p`, and the
/// members of a cluster share clustered attention's mask (their rows are equal, zeros
/// included). The fraction counts each weight that is not 0 without dropout, in one row per
/// cluster for clustered and improved attention, whose members share the cluster's mask.
/// Seeded, and run alone in a child process of the test binary: NdArray's random generator is
/// one per process, and the other tests draw from it. lsh-X with one round, where a weight is
/// not a sum over rounds.
#[test]
fn dropout_zeroes_and_scales_the_weights() {
    if !in_child_process("baselines::dropout_zeroes_and_scales_the_weights") {
        return;
    }
    let device = autodiff(&ndarray());
    let (prob, draws) = (0.3, 20);
    let case = SharedCase::new(24, 4, 2, 31);
    let (q, _, ql, kl) = case.tensors(&device);
    let [batch, heads, len, _] = q.dims();
    device.seed(7);
    let identity = Tensor::<2>::eye(len, &device)
        .reshape([1, 1, len, len])
        .expand([batch, heads, len, len]);
    let clustering = ClusteringOptions::new(3).with_seed(2);
    let assignments = host_ints(cluster_queries(q.clone(), ql.clone(), &clustering).assignments);
    let run = |name: &str, p: f64| -> Host4 {
        let input = AttentionInput {
            queries: q.clone(),
            keys: q.clone(),
            values: identity.clone(),
            query_lengths: ql.clone(),
            key_lengths: kl.clone(),
        };
        Host4::from_tensor(match name {
            "full" => FullAttention::new().with_dropout(p).forward(input),
            "clustered" => ClusteredAttention::new(3)
                .with_seed(2)
                .with_dropout(p)
                .forward(input),
            "improved" => ImprovedClusteredAttention::new(3, 4)
                .with_seed(2)
                .with_dropout(p)
                .forward(input),
            "shared-full" => SharedFullAttention::new().with_dropout(p).forward(input),
            "lsh" => LshAttention::new(1)
                .with_chunk_size(6)
                .with_dropout(p)
                .forward(input),
            "oracle" => OracleTopAttention::new(5).with_dropout(p).forward(input),
            _ => unreachable!(),
        })
    };
    for name in [
        "full",
        "clustered",
        "improved",
        "shared-full",
        "lsh",
        "oracle",
    ] {
        let exact = run(name, 0.0);
        // One row per cluster for clustered and improved attention: members share the mask of
        // the cluster's weights.
        let shared = name == "clustered" || name == "improved";
        // The masks from the backend's generator, then from the thread's, seeded per draw.
        for seeded in [false, true] {
            let (mut zeros, mut weights) = (0usize, 0usize);
            for draw in 0..draws {
                let out = if seeded {
                    with_dropout_seed(draw as u64, || run(name, prob))
                } else {
                    run(name, prob)
                };
                let mut seen_clusters = std::collections::HashSet::new();
                for bh in 0..batch * heads {
                    let (b, h) = (bh / heads, bh % heads);
                    for i in 0..len {
                        let cluster = assignments[bh * len + i];
                        let counted = !shared || seen_clusters.insert((bh, cluster));
                        for j in 0..len {
                            let (x, w) = (out.at(b, h, i, j), exact.at(b, h, i, j));
                            let scaled = w / (1.0 - prob);
                            assert!(
                                x == 0.0 || (x - scaled).abs() <= 1e-5 * scaled.abs().max(1e-3),
                                "{name}: weight ({b}, {h}, {i}, {j}) is {x} under dropout, neither 0 nor {w} / (1 − {prob})"
                            );
                            if counted && w != 0.0 {
                                weights += 1;
                                zeros += usize::from(x == 0.0);
                            }
                        }
                    }
                }
                if name == "clustered" {
                    for bh in 0..batch * heads {
                        let (b, h) = (bh / heads, bh % heads);
                        for i in 0..len {
                            for k in 0..len {
                                let (a, c) = (assignments[bh * len + i], assignments[bh * len + k]);
                                if a >= 0 && a == c {
                                    for j in 0..len {
                                        assert_eq!(
                                            out.at(b, h, i, j),
                                            out.at(b, h, k, j),
                                            "clustered: queries {i} and {k} of one cluster got different masks"
                                        );
                                    }
                                }
                            }
                        }
                    }
                }
            }
            let fraction = zeros as f64 / weights as f64;
            let bound = 5.0 * (prob * (1.0 - prob) / weights as f64).sqrt();
            assert!(
                (fraction - prob).abs() <= bound,
                "{name} (seeded: {seeded}): dropout zeroed {fraction:.4} of {weights} weights, p = {prob} (bound {bound:.4})"
            );
        }
    }
}

/// Dropout inside `with_dropout_seed`: the same seed gives the same masks on any thread, in
/// any interleaving of threads (two threads drawing at once with one seed get what one thread
/// gets alone); another seed gives other masks; a nested seed leaves the outer sequence as it
/// was; the masks are 0 or exactly `1 / (1 − p)`; the zeroed fraction of 200,000 draws is
/// within 5 standard errors of `p`; without autodiff, dropout is the identity.
fn host_floats<const D: usize>(tensor: Tensor<D>) -> Vec<f32> {
    tensor.into_data().try_into_vec_as::<f32>().unwrap()
}

#[test]
fn seeded_dropout_repeats_per_thread() {
    let device = autodiff(&ndarray());
    let prob = 0.25;
    let ones = || Tensor::<2>::ones([400, 500], &device);
    let draw = || host_floats(dropout(ones(), prob).inner());
    let first = with_dropout_seed(11, draw);
    let scale = (1.0 / (1.0 - prob)) as f32;
    assert!(first.iter().all(|&x| x == 0.0 || x == scale));
    let zeroed = first.iter().filter(|&&x| x == 0.0).count() as f64 / first.len() as f64;
    let bound = 5.0 * (prob * (1.0 - prob) / first.len() as f64).sqrt();
    assert!(
        (zeroed - prob).abs() <= bound,
        "zeroed {zeroed}, p = {prob}"
    );
    assert_eq!(with_dropout_seed(11, draw), first);
    assert_ne!(with_dropout_seed(12, draw), first);
    let threads: Vec<_> = (0..2)
        .map(|_| {
            let device = device.clone();
            std::thread::spawn(move || {
                with_dropout_seed(11, || {
                    host_floats(dropout(Tensor::<2>::ones([400, 500], &device), prob).inner())
                })
            })
        })
        .collect();
    for thread in threads {
        assert_eq!(thread.join().unwrap(), first);
    }
    let (plain_second, nested_second) = (
        with_dropout_seed(11, || {
            draw();
            draw()
        }),
        with_dropout_seed(11, || {
            draw();
            with_dropout_seed(99, draw);
            draw()
        }),
    );
    assert_eq!(plain_second, nested_second);
    assert_ne!(plain_second, first);
    let x = Tensor::<2>::ones([3, 4], &ndarray());
    let same = with_dropout_seed(11, || dropout(x.clone(), prob));
    assert_eq!(host_floats(same), host_floats(x));
}

/// shared-full, lsh-X with one chunk (1 and 3 rounds) and oracle-top with topk ≥ S in `dtype`
/// against the `f64` references on the inputs rounded to `dtype`, within
/// [`crate::half::tolerance`] of the largest output.
pub fn half_baselines_match_reference(device: &Device, dtype: DType) {
    let tolerance = crate::half::tolerance(dtype);
    let exact = SharedCase::new(40, 8, 4, 9);
    let (q, v, ql, kl) = exact.tensors(device);
    let (q, v) = (q.cast(dtype), v.cast(dtype));
    let case = SharedCase {
        q: Host4::from_tensor(q.clone().cast(DType::F32)),
        v: Host4::from_tensor(v.clone().cast(DType::F32)),
        lengths: exact.lengths.clone(),
    };
    let check = |name: &str, out: Tensor<4>, reference: &Rows| {
        assert_eq!(out.dtype(), dtype, "{name}: the output dtype");
        let error =
            crate::half::relative_error(&Host4::from_tensor(out.cast(DType::F32)), reference);
        assert!(
            error <= tolerance,
            "{dtype:?} {name} vs the f64 reference: relative error {error} > {tolerance}"
        );
    };
    let shared = shared_full_reference(&case);
    check(
        "shared-full",
        SharedFullAttention::new().forward(shared_input(
            q.clone(),
            v.clone(),
            ql.clone(),
            kl.clone(),
        )),
        &shared,
    );
    for rounds in [1, 3] {
        check(
            &format!("lsh-{rounds}, one chunk"),
            LshAttention::new(rounds)
                .with_chunk_size(40)
                .forward(shared_input(q.clone(), v.clone(), ql.clone(), kl.clone())),
            &shared,
        );
    }
    let setup = Setup {
        query_lengths: &case.lengths,
        key_lengths: &case.lengths,
        scale: case.scale(),
    };
    check(
        "oracle-top, topk ≥ S",
        OracleTopAttention::new(40).forward(shared_input(q, v, ql, kl)),
        &full_reference(&case.q, &case.q, &case.v, &setup),
    );
}
