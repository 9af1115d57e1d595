//! The CubeCL kernels against references, bit for bit: codes against the default body of
//! `lsh_hash` on NdArray, assignments and counts against the plain-loop K-means of
//! `kmeans.rs` (itself checked against the default bodies there), for bits ∈ {1, 8, 31, 32},
//! L ∈ {1, 7, 1000, 4099}, C ∈ {1, 2, 100, 200} (at 200 the K-means votes go to global
//! memory), with and without padding; on a WGPU device (the fused `Cube` backend) and on its
//! autodiff form (and on CUDA, `#[ignore]`d: run with `--ignored` where an NVIDIA GPU is
//! present). Burn 0.22's dispatch reaches the CubeCL backend only through fusion when fusion is
//! on (as it is with this crate's `cube` feature), so the unfused `CubeBackend` is not tested.
//!
//! Queries and planes are dyadic rationals with few significant bits, so every projection is
//! exact in `f32` whatever the summation order: a matrix product (the default body) and the
//! kernel's sequential sum then give the same codes.

use std::sync::OnceLock;

use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use clustered_attention::{hamming_kmeans, lsh_hash, lsh_planes};
use rand::RngExt;

use crate::common::*;
use crate::kmeans::{initial_positions, kmeans_reference};

const BITS: [usize; 4] = [1, 8, 31, 32];
const LENGTHS: [usize; 4] = [1, 7, 1000, 4099];
const CLUSTERS: [usize; 4] = [1, 2, 100, 200];
const ITERATIONS: usize = 10;
const DIM: usize = 16;
const SEED: u64 = 17;

/// One hashing case and the K-means cases built on its codes, with the reference results.
struct Case {
    bits: usize,
    dims: [usize; 4],
    queries: Vec<f32>,
    planes: Vec<f32>,
    codes: Vec<i64>,
    kmeans: Vec<KmeansCase>,
}

struct KmeansCase {
    clusters: usize,
    lengths: Option<Vec<usize>>,
    assignments: Vec<i64>,
    counts: Vec<i64>,
}

/// The query lengths of the K-means cases of `len` queries: none (every query valid) and a
/// full and a half-padded sequence.
fn kmeans_lengths(len: usize) -> [Option<Vec<usize>>; 2] {
    [None, Some(vec![len, len / 2])]
}

/// The reference results, computed once: codes with the default body on NdArray, K-means
/// with the plain loops.
fn cases() -> &'static [Case] {
    static CASES: OnceLock<Vec<Case>> = OnceLock::new();
    CASES.get_or_init(|| {
        type R = NdArrayBackend;
        let device = ndarray();
        let mut rng = rng(SEED);
        let mut cases = Vec::new();
        for bits in BITS {
            for len in LENGTHS {
                let dims = [2, 2, len, DIM];
                let queries: Vec<f32> = (0..dims.iter().product::<usize>())
                    .map(|_| rng.random_range(-32i32..32) as f32 / 8.0)
                    .collect();
                let planes: Vec<f32> = lsh_planes(bits, DIM, true, SEED, &device)
                    .mul_scalar(64.0)
                    .round()
                    .div_scalar(64.0)
                    .into_data()
                    .iter::<f32>()
                    .collect();
                let codes = host_ints(crate::defaults::lsh_hash::<R>(
                    tensor4(&queries, dims, &device),
                    tensor2(&planes, [bits, DIM + 1], &device),
                ));
                let (batch, heads) = (dims[0], dims[1]);
                let code_words: Vec<u32> = codes.iter().map(|&c| c as u32).collect();
                let mut kmeans = Vec::new();
                for clusters in CLUSTERS {
                    for lengths in kmeans_lengths(len) {
                        let valid = lengths.clone().unwrap_or(vec![len; batch]);
                        let initial = initial_positions(&valid, heads, clusters, SEED);
                        let (mut assignments, mut counts) = (Vec::new(), Vec::new());
                        for row in 0..batch * heads {
                            let (a, c, _) = kmeans_reference(
                                &code_words[row * len..(row + 1) * len],
                                valid[row / heads],
                                clusters,
                                ITERATIONS,
                                &initial[row * clusters..(row + 1) * clusters],
                            );
                            assignments.extend(a);
                            counts.extend(c);
                        }
                        kmeans.push(KmeansCase {
                            clusters,
                            lengths,
                            assignments,
                            counts,
                        });
                    }
                }
                cases.push(Case {
                    bits,
                    dims,
                    queries,
                    planes,
                    codes,
                    kmeans,
                });
            }
        }
        cases
    })
}

fn tensor4(values: &[f32], dims: [usize; 4], device: &Device) -> Tensor<4> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), device)
}

fn tensor2(values: &[f32], dims: [usize; 2], device: &Device) -> Tensor<2> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), device)
}

fn int3(values: &[i64], dims: [usize; 3], device: &Device) -> Tensor<3, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), device)
}

/// Panics with the first mismatch (and how many there are) unless `actual == expected`.
fn assert_same(actual: &[i64], expected: &[i64], context: &str) {
    assert_eq!(actual.len(), expected.len(), "{context}: lengths differ");
    let mismatches: Vec<usize> = (0..actual.len())
        .filter(|&i| actual[i] != expected[i])
        .collect();
    if let Some(&first) = mismatches.first() {
        panic!(
            "{context}: {} of {} values differ, first at {first}: {} instead of {}",
            mismatches.len(),
            actual.len(),
            actual[first],
            expected[first]
        );
    }
}

/// The kernels of `device`'s backend reproduce every reference case bit for bit.
pub fn kernels_match_reference(device: &Device) {
    for case in cases() {
        let codes = host_ints(lsh_hash(
            tensor4(&case.queries, case.dims, device),
            tensor2(&case.planes, [case.bits, DIM + 1], device),
        ));
        let [_, _, len, _] = case.dims;
        assert_same(
            &codes,
            &case.codes,
            &format!("codes: bits {}, L {len}", case.bits),
        );
        for k in &case.kmeans {
            let result = hamming_kmeans(
                int3(&case.codes, [2, 2, len], device),
                k.lengths.as_deref().map(|l| lengths(l, device)),
                k.clusters,
                ITERATIONS,
                SEED,
            );
            let context = format!(
                "bits {}, L {len}, C {}, lengths {:?}",
                case.bits, k.clusters, k.lengths
            );
            assert_eq!(
                host_ints(result.assignments),
                k.assignments,
                "assignments: {context}"
            );
            assert_eq!(host_ints(result.counts), k.counts, "counts: {context}");
        }
    }
}

/// K-means of long rows (two of L = 16384, one half padded, 100 clusters, 10 iterations: past
/// what one thread of the one-launch loop may iterate on lavapipe) reproduces the plain-loop
/// reference bit for bit on `device`.
pub fn long_rows_match_reference(device: &Device) {
    const LEN: usize = 16384;
    const CLUSTERS: usize = 100;
    let mut rng = rng(SEED);
    let codes: Vec<i64> = (0..2 * LEN)
        .map(|_| rng.random::<u32>() as i32 as i64)
        .collect();
    let words: Vec<u32> = codes.iter().map(|&c| c as u32).collect();
    for valid in [[LEN, LEN], [LEN, LEN / 2]] {
        let initial = initial_positions(&valid, 1, CLUSTERS, SEED);
        let (mut assignments, mut counts) = (Vec::new(), Vec::new());
        for row in 0..2 {
            let (a, c, _) = kmeans_reference(
                &words[row * LEN..(row + 1) * LEN],
                valid[row],
                CLUSTERS,
                ITERATIONS,
                &initial[row * CLUSTERS..(row + 1) * CLUSTERS],
            );
            assignments.extend(a);
            counts.extend(c);
        }
        let result = hamming_kmeans(
            int3(&codes, [2, 1, LEN], device),
            Some(lengths(&valid, device)),
            CLUSTERS,
            ITERATIONS,
            SEED,
        );
        let context = format!("L {LEN}, C {CLUSTERS}, lengths {valid:?}");
        assert_same(
            &host_ints(result.assignments),
            &assignments,
            &format!("assignments: {context}"),
        );
        assert_same(
            &host_ints(result.counts),
            &counts,
            &format!("counts: {context}"),
        );
    }
}

/// The half-precision checks of `half.rs` in `dtype` on `device` (the fused backend).
fn half_precision_matches_reference(device: &Device, dtype: DType) {
    crate::half::attention_matches_reference(device, dtype);
    crate::half::exact_regime_equals_full(device, dtype);
    crate::baselines::half_baselines_match_reference(device, dtype);
    crate::half::hashing_and_kmeans_match_reference(device, dtype);
    crate::half::centroid_gradients_match_reference(device, dtype);
}

/// With the `cmma` feature, the fused attention kernels with their scores on cooperative
/// matrices in `dtype`, on `device` (the fused backend): the device must report a tile shape (a
/// device without one fails here rather than test the multiply-add path again); then the
/// centroid attention and the top-k attention against plain f64 loops and the half-precision
/// checks of `half.rs` (the attentions, the centroid attention's gradients), each fed the
/// inputs rounded to `dtype`.
#[cfg(feature = "cmma")]
fn cmma_products_match_reference(device: &Device, dtype: DType) {
    use clustered_attention::ops::{ScoreProducts, score_products};
    let products = score_products(device, dtype);
    assert!(
        matches!(products, ScoreProducts::Cmma { .. }),
        "the device reports no cooperative matrices for {dtype:?} into f32: {products}"
    );
    assert_eq!(
        score_products(&autodiff(device), dtype),
        products,
        "the autodiff device's products"
    );
    crate::fused::centroid_attention_matches_loops_in(device, dtype);
    crate::fused::top_attention_matches_loops_in::<burn::backend::Cube>(device, dtype);
    half_precision_matches_reference(device, dtype);
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use burn::tensor::{DType, Distribution, Tensor};
    use clustered_attention::{
        AttentionInput, AttentionOptions, ClusteringOptions, ImprovedClusteredAttention,
        LshAttention, LshOptions,
    };

    use crate::common::{Host4, autodiff, in_child_process, normal, wgpu};

    /// Device-to-host reads seen so far: wgpu-core logs every buffer mapping
    /// (`Buffer::map_async … op: … Read`) at trace level, and every read of a WGPU tensor maps
    /// a staging buffer for reading.
    static READS: AtomicUsize = AtomicUsize::new(0);

    struct ReadCounter;

    impl log::Log for ReadCounter {
        fn enabled(&self, metadata: &log::Metadata) -> bool {
            metadata.target().starts_with("wgpu_core")
        }

        fn log(&self, record: &log::Record) {
            if record.target().starts_with("wgpu_core") {
                let message = record.args().to_string();
                if message.contains("map_async") && message.contains("Read") {
                    READS.fetch_add(1, Ordering::SeqCst);
                }
            }
        }

        fn flush(&self) {}
    }

    /// The forwards of improved clustered attention and of lsh-X on a WGPU device (fusion on),
    /// without lengths, read nothing back from the device: hashing, K-means, top-k and the
    /// sparse products stay there, and so do the angular hashing and the bucket sort of lsh-X.
    /// Runs alone in a child process of the test binary, since the read counter is
    /// process-wide and other tests read.
    #[test]
    fn forwards_read_nothing_back() {
        if !in_child_process("gpu::wgpu::forwards_read_nothing_back") {
            return;
        }
        log::set_logger(&ReadCounter).expect("no other logger");
        log::set_max_level(log::LevelFilter::Trace);

        let device = wgpu();
        let dims = [2, 2, 600, 16];
        let (q, k, v) = (normal(dims, 1), normal(dims, 2), normal(dims, 3));
        let clustering = ClusteringOptions::new(12).with_seed(5);
        let forward = || {
            ImprovedClusteredAttention {
                clustering: clustering.clone(),
                topk: 8,
                options: AttentionOptions::new(),
            }
            .forward(AttentionInput::new(
                q.to_tensor(&device),
                k.to_tensor(&device),
                v.to_tensor(&device),
            ))
        };
        // The first run compiles the kernels (and may autotune, which reads timings back).
        let warm = forward();
        device.sync().unwrap();
        drop(warm);

        let before = READS.load(Ordering::SeqCst);
        let out = forward();
        device.sync().unwrap();
        let during = READS.load(Ordering::SeqCst) - before;
        assert_eq!(
            during, 0,
            "the forward read {during} buffers back to the host"
        );

        let lsh = LshOptions::new().with_rounds(2);
        let lsh_forward = || {
            LshAttention {
                lsh: lsh.clone(),
                options: AttentionOptions::new(),
            }
            .forward(AttentionInput::new(
                q.to_tensor(&device),
                q.to_tensor(&device),
                v.to_tensor(&device),
            ))
        };
        let warm = lsh_forward();
        device.sync().unwrap();
        drop(warm);
        let before_lsh = READS.load(Ordering::SeqCst);
        let lsh_out = lsh_forward();
        device.sync().unwrap();
        let during = READS.load(Ordering::SeqCst) - before_lsh;
        assert_eq!(during, 0, "lsh-2 read {during} buffers back to the host");
        drop(lsh_out);

        // The counter does see reads: of the output, and of Burn's host sort (Burn 0.22's
        // CubeCL backend still sorts on the host, `burn_backend::ops::sort_with_indices`).
        let _ = Host4::from_tensor(out.clone());
        let after_output = READS.load(Ordering::SeqCst);
        assert!(after_output > before, "reading the output was not counted");
        let scores: Tensor<4> = normal([1, 1, 4, 50], 4).to_tensor(&device);
        let (_, sorted) = scores.sort_descending_with_indices(3);
        device.sync().unwrap();
        drop(sorted);
        assert!(
            READS.load(Ordering::SeqCst) > after_output,
            "the host sort's read was not counted"
        );
    }

    /// One forward of a 3-layer encoder on a WGPU device (fusion on), given a padding mask or
    /// the same lengths (`key_lengths`), reads one buffer back: the lengths, once, to check
    /// them. The mask is turned into lengths on the device, and no layer reads anything (its
    /// attention checks the lengths and the K-means draws its initial centroids from the
    /// values read once). A layer given its lengths' values on the host (`key_lengths_host`)
    /// reads nothing back and computes what it computes given them as a tensor, which it
    /// reads once. In training (attention dropout on an autodiff device) a forward of 3
    /// layers reads back what one of 1 layer reads: the layers' dropout seeds come from one
    /// draw. Runs alone in a child process of the test binary, since the read counter is
    /// process-wide.
    #[test]
    fn lengths_are_read_once_per_encoder_forward() {
        use burn::tensor::Int;
        use clustered_attention::{
            AttentionKind, ClusteredAttentionInput, ClusteredTransformerEncoderConfig,
            ClusteredTransformerEncoderInput, MultiHeadClusteredAttentionConfig,
        };

        if !in_child_process("gpu::wgpu::lengths_are_read_once_per_encoder_forward") {
            return;
        }
        log::set_logger(&ReadCounter).expect("no other logger");
        log::set_max_level(log::LevelFilter::Trace);

        let device = wgpu();
        let (len, layers) = (64, 3);
        let attention = AttentionKind::Improved {
            clusters: 4,
            topk: 4,
        };
        let encoder = ClusteredTransformerEncoderConfig::new(16, 32, 2, layers, attention)
            .with_dropout(0.0)
            .init(&device);
        let x = Tensor::<3>::random([2, len, 16], Distribution::Default, &device);
        let lengths = [len, 40];
        let mask = crate::common::padding_mask(&lengths, len, &device);
        let key_lengths = Tensor::<1, Int>::from_ints([len as i64, 40], &device);
        let with_mask = || {
            encoder.forward(ClusteredTransformerEncoderInput::new(x.clone()).mask_pad(mask.clone()))
        };
        let with_lengths = || {
            encoder.forward(
                ClusteredTransformerEncoderInput::new(x.clone()).key_lengths(key_lengths.clone()),
            )
        };
        let reads = |forward: &dyn Fn() -> Tensor<3>| {
            let before = READS.load(Ordering::SeqCst);
            let out = forward();
            device.sync().unwrap();
            let during = READS.load(Ordering::SeqCst) - before;
            drop(out);
            during
        };
        // The first runs compile the kernels (and may autotune, which reads timings back).
        reads(&with_mask);
        reads(&with_lengths);
        let (mask_reads, length_reads) = (reads(&with_mask), reads(&with_lengths));
        eprintln!(
            "one forward of {layers} layers: {mask_reads} reads with mask_pad, {length_reads} \
             with key_lengths"
        );
        assert_eq!(
            (mask_reads, length_reads),
            (1, 1),
            "one forward of {layers} layers read {mask_reads} buffers back with mask_pad and \
             {length_reads} with the same lengths: one read, of the lengths, expected"
        );

        let layer = MultiHeadClusteredAttentionConfig::new(16, 2, attention).init(&device);
        let host_lengths = || {
            layer.forward(ClusteredAttentionInput::self_attn(x.clone()).key_lengths_host(&lengths))
        };
        let tensor_lengths = || {
            layer.forward(
                ClusteredAttentionInput::self_attn(x.clone()).key_lengths(key_lengths.clone()),
            )
        };
        reads(&host_lengths);
        reads(&tensor_lengths);
        let (host_reads, tensor_reads) = (reads(&host_lengths), reads(&tensor_lengths));
        assert_eq!(
            (host_reads, tensor_reads),
            (0, 1),
            "a layer's forward read {host_reads} buffers back given its lengths on the host and \
             {tensor_reads} given them as a tensor (expected none, and one read of the lengths, \
             its key and query lengths)"
        );
        let values = |x: Tensor<3>| x.into_data().iter::<f32>().collect::<Vec<_>>();
        assert_eq!(
            values(host_lengths()),
            values(tensor_lengths()),
            "the outputs given the lengths from the host and from a tensor differ"
        );

        // Training (an autodiff device, attention dropout 0.1): the layers' dropout seeds come
        // from one draw of the backend's, so 3 layers read back what 1 layer reads.
        let training = autodiff(&device);
        let x = x.to_device(&training);
        let mask = mask.to_device(&training);
        let training_reads = |layers| {
            let encoder = ClusteredTransformerEncoderConfig::new(16, 32, 2, layers, attention)
                .with_dropout(0.1)
                .init(&training);
            let forward = || {
                encoder.forward(
                    ClusteredTransformerEncoderInput::new(x.clone()).mask_pad(mask.clone()),
                )
            };
            reads(&forward);
            reads(&forward)
        };
        let (one, three) = (training_reads(1), training_reads(3));
        eprintln!("a training forward: {one} reads with 1 layer, {three} with 3");
        assert_eq!(
            one, three,
            "a training forward read {one} buffers back with 1 layer and {three} with 3 layers"
        );
    }

    /// The improved forward on a WGPU device (fusion on) allocates no device buffer of `C × S`
    /// elements or more (no `[C, S]` centroid scores or weights): in a child process of the
    /// test binary (a fresh device), the largest allocation the device's memory pools served
    /// during the forward (`Device::memory_pool_report`, Burn 0.22, whose runtime has no memory
    /// pool that refuses large allocations) stays below `C × S` `f32`s. `S ≫ L` and a small `E`
    /// keep every legitimate buffer (inputs, codes, K-means state, the kernels' per-chunk
    /// results) well below that. The report is checked to see a `[C, S]` tensor, last. That
    /// the forward reads nothing back is [`forwards_read_nothing_back`].
    #[test]
    fn improved_forward_allocates_no_scores() {
        if !in_child_process("gpu::wgpu::improved_forward_allocates_no_scores") {
            return;
        }
        let ([batch, heads, len, keys_len, dim], clusters, topk) = ([1, 2, 1024, 8192, 16], 64, 32);
        let limit = (clusters * keys_len * size_of::<f32>()) as u64;
        let device = wgpu();
        // The largest allocation every reported pool of the device has served so far.
        let largest = || {
            let pools = device
                .memory_pool_report()
                .expect("the WGPU device reports its memory pools");
            assert!(!pools.is_empty(), "the WGPU device reports no memory pool");
            pools.iter().map(|pool| pool.largest_alloc).max().unwrap()
        };

        let queries = normal([batch, heads, len, dim], 1).to_tensor(&device);
        let keys = normal([batch, heads, keys_len, dim], 2).to_tensor(&device);
        let values = normal([batch, heads, keys_len, dim], 3).to_tensor(&device);
        let output = ImprovedClusteredAttention::new(clusters, topk)
            .with_seed(5)
            .forward(AttentionInput::new(queries, keys, values));
        device.sync().unwrap();
        assert_eq!(output.dims(), [batch, heads, len, dim]);
        let during = largest();
        assert!(
            during < limit,
            "the improved forward allocated a buffer of {during} bytes, C × S = {clusters} × \
             {keys_len} elements ({limit} bytes) or more"
        );
        // The forward did run: its output came back, finite and not all zero.
        let host: Vec<f32> = output.into_data().iter::<f32>().collect();
        assert!(host.iter().all(|x| x.is_finite()) && host.iter().any(|&x| x != 0.0));

        // Last (the largest allocation only grows): the report sees a `[C, S]` tensor.
        let scores = Tensor::<2>::zeros([clusters, keys_len], &device) + 1.0;
        device.sync().unwrap();
        let probe = largest();
        drop(scores);
        assert!(
            probe >= limit,
            "the memory report missed a [C, S] = [{clusters}, {keys_len}] tensor ({limit} bytes): \
             largest allocation {probe} bytes"
        );
    }

    #[test]
    fn fused_kernels_match_reference() {
        super::kernels_match_reference(&wgpu());
    }

    #[test]
    fn long_rows_match_reference() {
        super::long_rows_match_reference(&wgpu());
    }

    /// The half-precision checks of `half.rs` in `f16` on a WGPU device, when the adapter has
    /// `shader-f16` (lavapipe does); `bf16` has no WGSL type, so it is skipped with a message.
    #[test]
    fn half_precision_matches_reference() {
        let device = wgpu();
        for dtype in [DType::F16, DType::BF16] {
            if !device.supports_dtype(dtype) {
                eprintln!("skipped: the WGPU adapter does not support {dtype:?}");
                continue;
            }
            super::half_precision_matches_reference(&device, dtype);
        }
    }

    /// The kernels on cooperative matrices in `f16` (`super::cmma_products_match_reference`):
    /// on Vulkan (the `vulkan` feature) with a driver that has `VK_KHR_cooperative_matrix`,
    /// such as lavapipe from Mesa 25.1 on (`scripts/cmma-lavapipe.sh`).
    #[cfg(feature = "cmma")]
    #[test]
    fn cmma_products_match_reference() {
        super::cmma_products_match_reference(&wgpu(), DType::F16);
    }

    #[test]
    fn autodiff_kernels_match_reference() {
        super::kernels_match_reference(&autodiff(&wgpu()));
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::tensor::{DType, FloatDType};

    use crate::common::{autodiff, cuda};

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn fused_kernels_match_reference() {
        super::kernels_match_reference(&cuda());
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn autodiff_kernels_match_reference() {
        super::kernels_match_reference(&autodiff(&cuda()));
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn long_rows_match_reference() {
        super::long_rows_match_reference(&cuda());
    }

    /// The half-precision checks of `half.rs` in `f16` (one test per dtype, so that each
    /// compiles only its own kernels and reports on its own).
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn half_precision_f16_matches_reference() {
        super::half_precision_matches_reference(&cuda(), DType::F16);
    }

    /// As [`half_precision_f16_matches_reference`] in `bf16`.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn half_precision_bf16_matches_reference() {
        super::half_precision_matches_reference(&cuda(), DType::BF16);
    }

    /// The kernels on cooperative matrices (`super::cmma_products_match_reference`) in `f16`,
    /// on tensor cores.
    #[cfg(feature = "cmma")]
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn cmma_f16_products_match_reference() {
        super::cmma_products_match_reference(&cuda(), DType::F16);
    }

    /// As [`cmma_f16_products_match_reference`] in `bf16`.
    #[cfg(feature = "cmma")]
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn cmma_bf16_products_match_reference() {
        super::cmma_products_match_reference(&cuda(), DType::BF16);
    }

    /// The fused ops with dropout against Burn's ops given the same factors
    /// (`dropout.rs`), the masks of one seed against NdArray's, and the factors the device
    /// draws against the host's.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn dropout_matches_composition_and_ndarray() {
        crate::dropout::fused_dropout_matches_composition(&cuda());
        crate::dropout::masks_agree_with_ndarray(&cuda());
        crate::dropout::device_factors_match_the_host(&cuda());
    }

    /// The layer trains one batch to near-zero loss in `bf16`.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn layer_trains_one_batch_in_bf16() {
        crate::half::layer_trains_one_batch(&autodiff(&cuda()), FloatDType::BF16);
    }
}
