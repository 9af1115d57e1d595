//! Attention-level checks against the host references, on NdArray and Flex.

use burn::tensor::{Bool, Device, Int, Tensor, TensorData};
use clustered_attention::{
    AttentionInput, AttentionOptions, ClusteredAttention, ClusteringOptions, FullAttention,
    ImprovedClusteredAttention, QueryGrouping, cluster_queries,
};

use crate::common::*;

/// Tolerance of every f32-versus-f64 comparison of attention outputs (on CUDA, where Burn's
/// matmul rounds to TF32, raised by [`matmul_tolerance`] in the tests that run there).
const TOLERANCE: f64 = 1e-5;

struct Case {
    q: Host4,
    k: Host4,
    v: Host4,
    query_lengths: Vec<usize>,
    key_lengths: Vec<usize>,
}

impl Case {
    /// Batch of 3 with query padding, key padding and S ≠ L.
    fn padded(len: usize, keys_len: usize, dim: usize, value_dim: usize, seed: u64) -> Self {
        let q = clustered_queries([3, 2, len, dim], 4, 1.5, seed);
        let k = normal([3, 2, keys_len, dim], seed + 1);
        let v = normal([3, 2, keys_len, value_dim], seed + 2);
        Self {
            q,
            k,
            v,
            query_lengths: vec![len, len - 5, len / 2],
            key_lengths: vec![keys_len - 3, keys_len, keys_len / 3],
        }
    }

    fn setup(&self) -> Setup<'_> {
        Setup {
            query_lengths: &self.query_lengths,
            key_lengths: &self.key_lengths,
            scale: 1.0 / (self.q.dims[3] as f64).sqrt(),
        }
    }

    fn input(&self, device: &Device) -> AttentionInput {
        let (queries, keys, values, query_lengths, key_lengths) = self.tensors(device);
        AttentionInput {
            queries,
            keys,
            values,
            query_lengths,
            key_lengths,
        }
    }

    fn tensors(&self, device: &Device) -> Inputs {
        (
            self.q.to_tensor(device),
            self.k.to_tensor(device),
            self.v.to_tensor(device),
            Some(lengths(&self.query_lengths, device)),
            Some(lengths(&self.key_lengths, device)),
        )
    }
}

type Inputs = (
    Tensor<4>,
    Tensor<4>,
    Tensor<4>,
    Option<Tensor<1, Int>>,
    Option<Tensor<1, Int>>,
);

fn full(device: &Device, case: &Case) -> Host4 {
    Host4::from_tensor(FullAttention::new().forward(case.input(device)))
}

fn clustered(device: &Device, case: &Case, clustering: &ClusteringOptions) -> Host4 {
    Host4::from_tensor(
        ClusteredAttention {
            clustering: clustering.clone(),
            options: AttentionOptions::new(),
        }
        .forward(case.input(device)),
    )
}

fn improved(device: &Device, case: &Case, clustering: &ClusteringOptions, topk: usize) -> Host4 {
    Host4::from_tensor(
        ImprovedClusteredAttention {
            clustering: clustering.clone(),
            topk,
            options: AttentionOptions::new(),
        }
        .forward(case.input(device)),
    )
}

fn assignments(device: &Device, case: &Case, clustering: &ClusteringOptions) -> Vec<i64> {
    let (q, _, _, ql, _) = case.tensors(device);
    host_ints(cluster_queries(q, ql, clustering).assignments)
}

/// Full attention against the f64 reference, with query padding, key padding and S ≠ L.
pub fn full_matches_reference(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    let case = Case::padded(40, 29, 8, 5, 1);
    let diff = max_abs_diff(
        &full(device, &case),
        &full_reference(&case.q, &case.k, &case.v, &case.setup()),
    );
    assert!(
        diff <= tolerance,
        "full attention vs reference: max abs diff {diff}"
    );
}

/// Clustered == full when clusters ≥ valid queries; improved == full when topk ≥ S.
pub fn exact_regime_equals_full(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    let case = Case::padded(40, 29, 8, 5, 2);
    let reference = full_reference(&case.q, &case.k, &case.v, &case.setup());

    for clusters in [40, 64] {
        let out = clustered(device, &case, &ClusteringOptions::new(clusters));
        let diff = max_abs_diff(&out, &reference);
        assert!(
            diff <= tolerance,
            "clustered ({clusters} clusters ≥ L) vs full: {diff}"
        );
        let out = improved(device, &case, &ClusteringOptions::new(clusters), 3);
        let diff = max_abs_diff(&out, &reference);
        assert!(
            diff <= tolerance,
            "improved ({clusters} clusters ≥ L, topk 3) vs full: {diff}"
        );
    }
    for topk in [29, 100] {
        let out = improved(device, &case, &ClusteringOptions::new(3), topk);
        let diff = max_abs_diff(&out, &reference);
        assert!(
            diff <= tolerance,
            "improved (topk {topk} ≥ S, 3 clusters) vs full: {diff}"
        );
    }
    // A batch whose longest sequence has more queries than clusters, but the others fewer.
    let clustering = ClusteringOptions::new(20);
    let out = clustered(device, &case, &clustering);
    let assignments = assignments(device, &case, &clustering);
    let [_, heads, len, _] = case.q.dims;
    for b in 0..3 {
        if case.query_lengths[b] <= 20 {
            for h in 0..heads {
                for i in 0..len {
                    let row = &reference[(b * heads + h) * len + i];
                    for (d, expected) in row.iter().enumerate() {
                        let diff = (out.at(b, h, i, d) - expected).abs();
                        assert!(
                            diff <= tolerance,
                            "clustered, batch item {b} with ≤ C queries: {diff}"
                        );
                    }
                }
            }
        } else {
            let distinct: std::collections::HashSet<_> = assignments
                [b * heads * len..(b * heads + 1) * len]
                .iter()
                .filter(|&&a| a >= 0)
                .collect();
            assert!(
                distinct.len() <= 20,
                "batch item {b}: more clusters than asked"
            );
        }
    }
}

/// Clustered and improved attention against the f64 references computed from the same
/// assignments (C < L, topk < S), with padding.
pub fn approximate_regime_matches_reference(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    let case = Case::padded(48, 37, 8, 6, 3);
    let clustering = ClusteringOptions::new(5).with_seed(11);
    let assignments = assignments(device, &case, &clustering);
    let setup = case.setup();

    let reference = clustered_reference(&case.q, &case.k, &case.v, &assignments, &setup);
    let diff = max_abs_diff(&clustered(device, &case, &clustering), &reference);
    assert!(diff <= tolerance, "clustered vs reference: {diff}");

    for topk in [1, 4, 13] {
        let reference = improved_reference(&case.q, &case.k, &case.v, &assignments, topk, &setup);
        let diff = max_abs_diff(&improved(device, &case, &clustering, topk), &reference);
        assert!(
            diff <= tolerance,
            "improved (topk {topk}) vs reference: {diff}"
        );
    }
}

/// Position blocks: the assignments are `C` contiguous, ordered blocks of the valid queries
/// whose sizes differ by at most one (each query alone when a sequence has no more valid
/// queries than `C`), the same in every head, padded queries in none, the counts their sizes;
/// clustered and improved attention over them match the f64 references fed the same
/// assignments, to the tolerance above.
pub fn position_blocks_match_reference(device: &Device) {
    let tolerance = matmul_tolerance(device, TOLERANCE);
    let case = Case::padded(48, 37, 8, 6, 5);
    for clusters in [5, 24, 48] {
        let clustering =
            ClusteringOptions::new(clusters).with_grouping(QueryGrouping::PositionBlocks);
        let (q, _, _, ql, _) = case.tensors(device);
        let groups = cluster_queries(q, ql, &clustering);
        let assignments = host_ints(groups.assignments);
        let counts = host_ints(groups.counts);
        let [batch, heads, len, _] = case.q.dims;
        for b in 0..batch {
            let n = case.query_lengths[b];
            for h in 0..heads {
                let row = &assignments[(b * heads + h) * len..(b * heads + h + 1) * len];
                assert!(
                    row[n..].iter().all(|&a| a == -1),
                    "C {clusters}: padded queries in a cluster"
                );
                let valid = &row[..n];
                // Ordered and contiguous: every step is 0 or +1, starting at 0.
                assert_eq!(valid[0], 0, "C {clusters}, batch {b}: first block");
                assert!(
                    valid.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1),
                    "C {clusters}, batch {b}, head {h}: blocks not contiguous: {valid:?}"
                );
                let blocks = clusters.min(n);
                assert_eq!(
                    valid[n - 1] as usize,
                    blocks - 1,
                    "C {clusters}, batch {b}: blocks used"
                );
                let sizes: Vec<i64> = (0..clusters)
                    .map(|j| valid.iter().filter(|&&a| a == j as i64).count() as i64)
                    .collect();
                assert_eq!(
                    &counts[(b * heads + h) * clusters..(b * heads + h + 1) * clusters],
                    &sizes[..],
                    "C {clusters}, batch {b}: counts"
                );
                let used = &sizes[..blocks];
                let (lo, hi) = (used.iter().min().unwrap(), used.iter().max().unwrap());
                assert!(
                    hi - lo <= 1,
                    "C {clusters}, batch {b}: block sizes {used:?}"
                );
            }
        }
        let setup = case.setup();
        let reference = clustered_reference(&case.q, &case.k, &case.v, &assignments, &setup);
        let diff = max_abs_diff(&clustered(device, &case, &clustering), &reference);
        assert!(
            diff <= tolerance,
            "C {clusters}: clustered over blocks vs reference: {diff}"
        );
        let reference = improved_reference(&case.q, &case.k, &case.v, &assignments, 4, &setup);
        let diff = max_abs_diff(&improved(device, &case, &clustering, 4), &reference);
        assert!(
            diff <= tolerance,
            "C {clusters}: improved over blocks vs reference: {diff}"
        );
    }
}

/// Proposition 2: ‖Aᵗ_i − A_i‖₁ ≤ ‖Aᶜ_j − A_i‖₁ + 1e-6 for every valid query (+ 5e-3 on CUDA,
/// whose f32 matmul rounds to TF32: [`matmul_tolerance`]). With identity values
/// (D = S) the outputs are the attention matrices themselves.
pub fn proposition_2(device: &Device) {
    let slack = matmul_tolerance(device, 1e-6);
    for (seed, clusters, topk) in [(4, 3, 5), (5, 6, 2), (6, 2, 16)] {
        let mut case = Case::padded(36, 30, 8, 1, seed);
        case.v = identity_values(3, 2, 30);
        let clustering = ClusteringOptions::new(clusters).with_seed(seed);
        let exact = full_reference(&case.q, &case.k, &case.v, &case.setup());
        let clustered = clustered(device, &case, &clustering);
        let improved = improved(device, &case, &clustering, topk);
        let [batch, heads, len, keys_len] = clustered.dims;
        let mut strict = 0;
        for b in 0..batch {
            for h in 0..heads {
                for i in 0..case.query_lengths[b] {
                    let a = &exact[(b * heads + h) * len + i];
                    let l1 = |out: &Host4| -> f64 {
                        (0..keys_len)
                            .map(|s| (out.at(b, h, i, s) - a[s]).abs())
                            .sum()
                    };
                    let (improved_error, clustered_error) = (l1(&improved), l1(&clustered));
                    assert!(
                        improved_error <= clustered_error + slack,
                        "Proposition 2 fails at batch {b}, head {h}, query {i}: \
                         ‖Aᵗ − A‖₁ = {improved_error} > ‖Aᶜ − A‖₁ = {clustered_error}"
                    );
                    if improved_error < clustered_error - 1e-3 {
                        strict += 1;
                    }
                }
            }
        }
        // The inequality must not hold only because both sides vanish.
        assert!(
            strict > 0,
            "improved attention never beat clustered (seed {seed})"
        );
    }
}

/// The same seed gives bit-identical outputs; another seed gives other clusters.
pub fn same_seed_bit_identical(device: &Device) {
    let case = Case::padded(64, 50, 8, 4, 7);
    let clustering = ClusteringOptions::new(6).with_seed(3);
    assert_eq!(
        clustered(device, &case, &clustering).data,
        clustered(device, &case, &clustering).data
    );
    assert_eq!(
        improved(device, &case, &clustering, 5).data,
        improved(device, &case, &clustering, 5).data
    );
    let other = ClusteringOptions::new(6).with_seed(4);
    assert_ne!(
        assignments(device, &case, &clustering),
        assignments(device, &case, &other)
    );
}

/// A sequence's output does not depend on its batch: the same sequence (40 queries, keys and
/// values, self-attention) alone, in the second slot of a batch padded to 50, and in the first
/// slot beside a longer sequence (padded to 60, the padding filled with other values) gives the
/// same output rows to 1e-5, in clustered and improved attention. The clustering's starting
/// centroids come from the seed, the head and the sequence's valid length, never its slot.
pub fn same_sequence_same_output_in_any_slot(device: &Device) {
    let (len, heads, dim, value_dim) = (40, 2, 8, 4);
    let sequence = |len: usize, seed: u64| {
        [
            clustered_queries([1, heads, len, dim], 4, 1.5, seed),
            normal([1, heads, len, dim], seed + 1),
            normal([1, heads, len, value_dim], seed + 2),
        ]
    };
    let own = sequence(len, 70);
    // `[sequences, heads, padded, width]` of one input of each sequence, padded with 7s.
    let stack = |sequences: &[&[Host4; 3]], which: usize, padded: usize| {
        let width = sequences[0][which].dims[3];
        let mut data = Vec::new();
        for sequence in sequences {
            let [_, _, n, _] = sequence[which].dims;
            for h in 0..heads {
                let row = |i| h * n * width + i * width;
                for i in 0..padded {
                    if i < n {
                        data.extend_from_slice(&sequence[which].data[row(i)..row(i) + width]);
                    } else {
                        data.extend(std::iter::repeat_n(7.0f32, width));
                    }
                }
            }
        }
        Host4 {
            dims: [sequences.len(), heads, padded, width],
            data,
        }
    };
    let clustering = ClusteringOptions::new(6).with_bits(16).with_seed(3);
    let run = |sequences: &[&[Host4; 3]], improved: bool| -> Host4 {
        let padded = sequences.iter().map(|s| s[0].dims[2]).max().unwrap();
        let sizes: Vec<usize> = sequences.iter().map(|s| s[0].dims[2]).collect();
        let input = AttentionInput {
            queries: stack(sequences, 0, padded).to_tensor(device),
            keys: stack(sequences, 1, padded).to_tensor(device),
            values: stack(sequences, 2, padded).to_tensor(device),
            query_lengths: Some(lengths(&sizes, device)),
            key_lengths: Some(lengths(&sizes, device)),
        };
        let options = AttentionOptions::new();
        let out = if improved {
            ImprovedClusteredAttention {
                clustering: clustering.clone(),
                topk: 5,
                options,
            }
            .forward(input)
        } else {
            ClusteredAttention {
                clustering: clustering.clone(),
                options,
            }
            .forward(input)
        };
        Host4::from_tensor(out)
    };
    let (longer, shorter, longest) = (sequence(50, 80), sequence(30, 90), sequence(60, 100));
    for improved in [false, true] {
        let name = if improved { "improved" } else { "clustered" };
        let alone = run(&[&own], improved);
        for (batch, slot) in [
            (vec![&longer, &own, &shorter], 1),
            (vec![&own, &longest], 0),
        ] {
            let out = run(&batch, improved);
            for h in 0..heads {
                for i in 0..len {
                    for d in 0..value_dim {
                        let (got, expected) = (out.at(slot, h, i, d), alone.at(0, h, i, d));
                        assert!(
                            (got - expected).abs() <= TOLERANCE,
                            "{name}, slot {slot} of {}: ({h}, {i}, {d}) {got} vs {expected} alone",
                            batch.len()
                        );
                    }
                }
            }
        }
    }
}

/// A NaN in one query row leaves every other batch item's output unchanged.
pub fn nan_query_is_contained(device: &Device) {
    let case = Case::padded(30, 20, 8, 4, 8);
    let mut poisoned = Case::padded(30, 20, 8, 4, 8);
    let [_, heads, len, dim] = case.q.dims;
    let row = (heads + 1) * len + 3; // batch item 1, head 1, query 3
    poisoned.q.data[row * dim..(row + 1) * dim].fill(f32::NAN);
    let clustering = ClusteringOptions::new(4);
    type Run = fn(&Device, &Case, &ClusteringOptions) -> Host4;
    let runs: [(&str, Run); 3] = [
        ("full", |d, c, _| full(d, c)),
        ("clustered", clustered),
        ("improved", |d, c, o| improved(d, c, o, 3)),
    ];
    for (name, run) in runs {
        let (clean, dirty) = (
            run(device, &case, &clustering),
            run(device, &poisoned, &clustering),
        );
        let per_item = clean.data.len() / 3;
        for b in [0, 2] {
            let range = b * per_item..(b + 1) * per_item;
            assert_eq!(
                clean.data[range.clone()],
                dirty.data[range],
                "{name}: a NaN query in batch item 1 changed batch item {b}"
            );
        }
    }
}

/// Full attention with burn-nn's quiet softmax against an f64 reference, to 1e-5: each row's
/// weights `exp(s_j − m) / (exp(−m) + Σ_k exp(s_k − m))` over its unmasked keys, `m` the
/// larger of 0 and the row's largest score (the extra logit is 0), under an attention mask that
/// hides the keys after `i + 1` from query `i`, and every key from query 3 of the second
/// sequence, whose output is then zero.
#[test]
fn quiet_softmax_matches_reference() {
    let device = ndarray();
    let (batch, heads, len, keys_len, dim) = (2, 2, 5, 6, 4);
    let q = normal([batch, heads, len, dim], 1);
    let k = normal([batch, heads, keys_len, dim], 2);
    let v = normal([batch, heads, keys_len, dim], 3);
    let masked = |b: usize, i: usize, j: usize| j > i + 1 || (b == 1 && i == 3);
    let mask: Vec<bool> = (0..batch * len * keys_len)
        .map(|at| masked(at / (len * keys_len), (at / keys_len) % len, at % keys_len))
        .collect();
    let mask = Tensor::<3, Bool>::from_data(TensorData::new(mask, [batch, len, keys_len]), &device);
    let input = AttentionInput::new(
        q.to_tensor(&device),
        k.to_tensor(&device),
        v.to_tensor(&device),
    );
    let out = Host4::from_tensor(
        FullAttention::new()
            .with_quiet_softmax(true)
            .forward_masked(input, Some(mask)),
    );
    let scale = 1.0 / (dim as f64).sqrt();
    for b in 0..batch {
        for h in 0..heads {
            for i in 0..len {
                let scores: Vec<Option<f64>> = (0..keys_len)
                    .map(|j| {
                        (!masked(b, i, j)).then(|| dot(&q.row(b, h, i), &k.row(b, h, j)) * scale)
                    })
                    .collect();
                let m = scores.iter().flatten().fold(0f64, |m, &s| m.max(s));
                let denominator =
                    (-m).exp() + scores.iter().flatten().map(|s| (s - m).exp()).sum::<f64>();
                for d in 0..dim {
                    let expected: f64 = scores
                        .iter()
                        .enumerate()
                        .filter_map(|(j, s)| {
                            s.map(|s| (s - m).exp() / denominator * v.at(b, h, j, d))
                        })
                        .sum();
                    let actual = out.at(b, h, i, d);
                    assert!(
                        (expected - actual).abs() <= 1e-5,
                        "sequence {b}, head {h}, query {i}, value {d}: {actual} against {expected}"
                    );
                }
            }
        }
    }
}

/// The builders set the option they name: each hands its argument to its field, compared
/// with the options built field by field.
#[test]
fn builders_set_the_options_they_name() {
    use clustered_attention::{LshAttention, LshOptions, QueryGrouping};

    let improved = ImprovedClusteredAttention::new(5, 3)
        .with_bits(12)
        .with_iterations(4)
        .with_hash_bias(false)
        .with_seed(9)
        .with_grouping(QueryGrouping::PositionBlocks)
        .with_scale(0.3)
        .with_dropout(0.25);
    let clustering = ClusteringOptions::new(5)
        .with_bits(12)
        .with_iterations(4)
        .with_hash_bias(false)
        .with_seed(9)
        .with_grouping(QueryGrouping::PositionBlocks);
    let options = AttentionOptions::new()
        .with_scale(Some(0.3))
        .with_dropout(0.25);
    assert_eq!(improved.clustering, clustering);
    assert_eq!(improved.topk, 3);
    assert_eq!(improved.options, options);
    let lsh = LshAttention::new(3)
        .with_chunk_size(8)
        .with_buckets(6)
        .with_seed(4);
    let lsh_options = LshOptions::new()
        .with_rounds(3)
        .with_chunk_size(8)
        .with_buckets(Some(6))
        .with_seed(4);
    assert_eq!(lsh.lsh, lsh_options);
}

macro_rules! attention_tests {
    ($module:ident, $device:expr) => {
        mod $module {
            #[test]
            fn full_matches_reference() {
                super::full_matches_reference(&$device);
            }
            #[test]
            fn exact_regime_equals_full() {
                super::exact_regime_equals_full(&$device);
            }
            #[test]
            fn approximate_regime_matches_reference() {
                super::approximate_regime_matches_reference(&$device);
            }
            #[test]
            fn proposition_2() {
                super::proposition_2(&$device);
            }
            #[test]
            fn position_blocks_match_reference() {
                super::position_blocks_match_reference(&$device);
            }
            #[test]
            fn same_seed_bit_identical() {
                super::same_seed_bit_identical(&$device);
            }
            #[test]
            fn nan_query_is_contained() {
                super::nan_query_is_contained(&$device);
            }
            #[test]
            fn same_sequence_same_output_in_any_slot() {
                super::same_sequence_same_output_in_any_slot(&$device);
            }
        }
    };
}

attention_tests!(ndarray, crate::common::ndarray());
attention_tests!(flex, crate::common::flex());

/// The attention-level checks on the GPU backends (NaN propagation is left to the CPU ones:
/// GPU shader arithmetic need not preserve NaN).
#[cfg(any(feature = "wgpu", feature = "cuda"))]
macro_rules! gpu_attention_tests {
    ($module:ident, $device:expr $(, $ignore:meta)?) => {
        mod $module {
            #[test]
            $(#[$ignore])?
            fn full_matches_reference() {
                super::full_matches_reference(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn exact_regime_equals_full() {
                super::exact_regime_equals_full(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn approximate_regime_matches_reference() {
                super::approximate_regime_matches_reference(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn proposition_2() {
                super::proposition_2(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn same_seed_bit_identical() {
                super::same_seed_bit_identical(&$device);
            }
            #[test]
            $(#[$ignore])?
            fn same_sequence_same_output_in_any_slot() {
                super::same_sequence_same_output_in_any_slot(&$device);
            }
        }
    };
}

#[cfg(feature = "wgpu")]
gpu_attention_tests!(wgpu, crate::common::wgpu());
#[cfg(feature = "cuda")]
gpu_attention_tests!(
    cuda,
    crate::common::cuda(),
    ignore = "needs an NVIDIA GPU: run with --ignored"
);
