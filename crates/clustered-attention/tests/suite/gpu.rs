//! The CubeCL kernels against references, bit for bit: codes against the default body of
//! `lsh_hash` on NdArray, assignments and counts against the plain-loop K-means of
//! `kmeans.rs` (itself checked against the default bodies there), for bits ∈ {1, 8, 31, 32},
//! L ∈ {1, 7, 1000, 4099}, C ∈ {1, 2, 100, 200} (at 200 the K-means votes go to global
//! memory), with and without padding; on `Wgpu` (fused), on the unfused `CubeBackend` and under
//! `Autodiff<Wgpu>` (and on CUDA, `#[ignore]`d: run with `--ignored` where an NVIDIA GPU is
//! present).
//!
//! Queries and planes are dyadic rationals with few significant bits, so every projection is
//! exact in `f32` whatever the summation order: a matrix product (the default body) and the
//! kernel's sequential sum then give the same codes.

use std::sync::OnceLock;

use burn::tensor::{DType, Int, Tensor, TensorData};
use clustered_attention::ops::reference;
use clustered_attention::{ClusteredAttentionBackend, hamming_kmeans, lsh_hash, lsh_planes};
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
        let device = Default::default();
        let mut rng = rng(SEED);
        let mut cases = Vec::new();
        for bits in BITS {
            for len in LENGTHS {
                let dims = [2, 2, len, DIM];
                let queries: Vec<f32> = (0..dims.iter().product::<usize>())
                    .map(|_| rng.random_range(-32i32..32) as f32 / 8.0)
                    .collect();
                let planes: Vec<f32> = lsh_planes::<R>(bits, DIM, true, SEED, &device)
                    .mul_scalar(64.0)
                    .round()
                    .div_scalar(64.0)
                    .into_data()
                    .iter::<f32>()
                    .collect();
                let codes = host_ints(Tensor::<R, 3, Int>::from_primitive(
                    reference::lsh_hash::<R>(
                        tensor4::<R>(&queries, dims).into_primitive().tensor(),
                        tensor2::<R>(&planes, [bits, DIM + 1])
                            .into_primitive()
                            .tensor(),
                    ),
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

fn tensor4<B: ClusteredAttentionBackend>(values: &[f32], dims: [usize; 4]) -> Tensor<B, 4> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), &Default::default())
}

fn tensor2<B: ClusteredAttentionBackend>(values: &[f32], dims: [usize; 2]) -> Tensor<B, 2> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), &Default::default())
}

fn int3<B: ClusteredAttentionBackend>(values: &[i64], dims: [usize; 3]) -> Tensor<B, 3, Int> {
    Tensor::from_data(TensorData::new(values.to_vec(), dims), &Default::default())
}

fn lengths_tensor<B: ClusteredAttentionBackend>(values: &[usize]) -> Tensor<B, 1, Int> {
    lengths::<B>(values, &Default::default())
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

/// The backend's kernels reproduce every reference case bit for bit.
pub fn kernels_match_reference<B: ClusteredAttentionBackend>() {
    for case in cases() {
        let codes = host_ints(lsh_hash(
            tensor4::<B>(&case.queries, case.dims),
            tensor2::<B>(&case.planes, [case.bits, DIM + 1]),
        ));
        let [_, _, len, _] = case.dims;
        assert_same(
            &codes,
            &case.codes,
            &format!("codes: bits {}, L {len}", case.bits),
        );
        for k in &case.kmeans {
            let result = hamming_kmeans(
                int3::<B>(&case.codes, [2, 2, len]),
                k.lengths.as_deref().map(lengths_tensor::<B>),
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

/// The half-precision checks of `half.rs` in `dtype` on the fused backend `F` and on the
/// unfused `CubeBackend` `U` of the same runtime.
fn half_precision_matches_reference<F: ClusteredAttentionBackend, U: ClusteredAttentionBackend>(
    dtype: DType,
) {
    crate::half::attention_matches_reference::<F>(dtype);
    crate::half::exact_regime_equals_full::<F>(dtype);
    crate::baselines::half_baselines_match_reference::<F>(dtype);
    crate::half::hashing_and_kmeans_match_reference::<F>(dtype);
    crate::half::centroid_gradients_match_reference::<F>(dtype);
    crate::half::attention_matches_reference::<U>(dtype);
    crate::half::hashing_and_kmeans_match_reference::<U>(dtype);
    crate::half::centroid_gradients_match_reference::<U>(dtype);
}

/// With the `cmma` feature, the fused attention kernels with their scores on cooperative
/// matrices in `dtype`, on the fused backend `F` and the unfused `U` of one runtime: the device
/// must report a tile shape (a device without one fails here rather than test the multiply-add
/// path twice); then the centroid attention and the top-k attention against plain f64 loops
/// and the half-precision checks of `half.rs` (the attentions, the centroid attention's
/// gradients), each fed the inputs rounded to `dtype`.
#[cfg(feature = "cmma")]
fn cmma_products_match_reference<F: ClusteredAttentionBackend, U: ClusteredAttentionBackend>(
    dtype: DType,
) {
    use clustered_attention::ops::ScoreProducts;
    let device = Default::default();
    let products = F::score_products(&device, dtype);
    assert!(
        matches!(products, ScoreProducts::Cmma { .. }),
        "the device reports no cooperative matrices for {dtype:?} into f32: {products}"
    );
    assert_eq!(U::score_products(&Default::default(), dtype), products);
    crate::fused::centroid_attention_matches_loops_in::<F>(dtype);
    crate::fused::top_attention_matches_loops_in::<F>(dtype);
    crate::fused::centroid_attention_matches_loops_in::<U>(dtype);
    crate::fused::top_attention_matches_loops_in::<U>(dtype);
    half_precision_matches_reference::<F, U>(dtype);
}

#[cfg(feature = "wgpu")]
mod wgpu {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use burn::backend::wgpu::{CubeBackend, WgpuRuntime};
    use burn::backend::{Autodiff, Wgpu};
    use burn::tensor::backend::Backend;
    use burn::tensor::{DType, Tensor};
    use clustered_attention::ops::reference;
    use clustered_attention::{
        AttentionInput, AttentionOptions, ClusteringOptions, ImprovedClusteredAttention,
        LshAttention, LshOptions,
    };

    use crate::common::{Host4, in_child_process, normal};

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

    /// The forwards of improved clustered attention and of lsh-X on `Wgpu` (fusion on), without
    /// lengths, read nothing back from the device: hashing, K-means, top-k and the sparse products
    /// stay there, and so do the angular hashing and the bucket sort of lsh-X. Runs alone in a
    /// child process of the test binary, since the read counter is process-wide and other tests
    /// read.
    #[test]
    fn forwards_read_nothing_back() {
        if !in_child_process("gpu::wgpu::forwards_read_nothing_back") {
            return;
        }
        log::set_logger(&ReadCounter).expect("no other logger");
        log::set_max_level(log::LevelFilter::Trace);

        type B = Wgpu;
        let device = Default::default();
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
                q.to_tensor::<B>(&device),
                k.to_tensor::<B>(&device),
                v.to_tensor::<B>(&device),
            ))
        };
        // The first run compiles the kernels (and may autotune, which reads timings back).
        let warm = forward();
        B::sync(&device).unwrap();
        drop(warm);

        let before = READS.load(Ordering::SeqCst);
        let out = forward();
        B::sync(&device).unwrap();
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
                q.to_tensor::<B>(&device),
                q.to_tensor::<B>(&device),
                v.to_tensor::<B>(&device),
            ))
        };
        let warm = lsh_forward();
        B::sync(&device).unwrap();
        drop(warm);
        let before_lsh = READS.load(Ordering::SeqCst);
        let lsh_out = lsh_forward();
        B::sync(&device).unwrap();
        let during = READS.load(Ordering::SeqCst) - before_lsh;
        assert_eq!(during, 0, "lsh-2 read {during} buffers back to the host");
        drop(lsh_out);

        // The counter does see reads: of the output, and of Burn's host sort.
        let _ = Host4::from_tensor(out.clone());
        let after_output = READS.load(Ordering::SeqCst);
        assert!(after_output > before, "reading the output was not counted");
        let scores: Tensor<B, 4> = normal([1, 1, 4, 50], 4).to_tensor(&device);
        let sorted = reference::topk_indices::<B>(scores.into_primitive().tensor(), 5);
        B::sync(&device).unwrap();
        drop(sorted);
        assert!(
            READS.load(Ordering::SeqCst) > after_output,
            "the host sort's read was not counted"
        );
    }

    /// The improved forward on `Wgpu` (fusion on) allocates no device buffer of `C × S`
    /// elements or more (no `[C, S]` centroid scores or weights): in a child process of the
    /// test binary, the device gets one memory pool that refuses any allocation of `C × S`
    /// `f32`s (less 256 bytes), so such a buffer makes the forward panic. `S ≫ L` and a small
    /// `E` keep every legitimate buffer (inputs, codes, K-means state, the kernels' per-chunk
    /// results) well below that. The pool is checked to refuse a `[C, S]` tensor, last. That
    /// the forward reads nothing back is [`forwards_read_nothing_back`].
    #[test]
    fn improved_forward_allocates_no_scores() {
        use burn::backend::wgpu::graphics::AutoGraphicsApi;
        use burn::backend::wgpu::{MemoryConfiguration, RuntimeOptions, WgpuDevice, init_setup};
        use cubecl_runtime::memory_management::{MemoryPoolOptions, PoolType};

        if !in_child_process("gpu::wgpu::improved_forward_allocates_no_scores") {
            return;
        }
        let ([batch, heads, len, keys_len, dim], clusters, topk) = ([1, 2, 1024, 8192, 16], 64, 32);
        let limit = (clusters * keys_len * size_of::<f32>()) as u64;
        let device = WgpuDevice::DefaultDevice;
        init_setup::<AutoGraphicsApi>(
            &device,
            RuntimeOptions {
                memory_config: MemoryConfiguration::Custom {
                    pool_options: vec![MemoryPoolOptions {
                        // The pool's size must be a multiple of the device's alignment (at
                        // most 256 bytes); `limit` is 2 MiB.
                        pool_type: PoolType::ExclusivePages {
                            max_alloc_size: limit - 256,
                        },
                        dealloc_period: None,
                    }],
                },
                ..Default::default()
            },
        );

        // A refused allocation panics in the device's server thread, not in this one: count
        // the panics of every thread (and keep the expected one at the end out of the output).
        static PANICS: AtomicUsize = AtomicUsize::new(0);
        static EXPECTED: AtomicBool = AtomicBool::new(false);
        let default_hook = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            if !EXPECTED.load(Ordering::SeqCst) {
                default_hook(info);
            }
        }));

        type B = Wgpu;
        let queries = normal([batch, heads, len, dim], 1).to_tensor::<B>(&device);
        let keys = normal([batch, heads, keys_len, dim], 2).to_tensor::<B>(&device);
        let values = normal([batch, heads, keys_len, dim], 3).to_tensor::<B>(&device);
        let output = ImprovedClusteredAttention::new(clusters, topk)
            .with_seed(5)
            .forward(AttentionInput::new(queries, keys, values));
        let _ = B::sync(&device);
        assert_eq!(output.dims(), [batch, heads, len, dim]);
        assert_eq!(
            PANICS.load(Ordering::SeqCst),
            0,
            "the improved forward allocated a buffer of C × S = {clusters} × {keys_len} \
             elements or more"
        );
        // The forward did run: its output came back, finite and not all zero.
        let host = output.into_data().to_vec::<f32>().unwrap();
        assert!(host.iter().all(|x| x.is_finite()) && host.iter().any(|&x| x != 0.0));

        // Last (a refused allocation may leave the device unusable): the pool refuses `[C, S]`.
        EXPECTED.store(true, Ordering::SeqCst);
        let _ = std::panic::catch_unwind(|| {
            let scores = Tensor::<B, 2>::zeros([clusters, keys_len], &device) + 1.0;
            let _ = B::sync(&device);
            drop(scores);
        });
        assert!(
            PANICS.load(Ordering::SeqCst) > 0,
            "the pool took a [C, S] = [{clusters}, {keys_len}] tensor past its {limit}-byte limit"
        );
    }

    #[test]
    fn fused_kernels_match_reference() {
        super::kernels_match_reference::<Wgpu>();
    }

    /// The half-precision checks of `half.rs` in `f16` on `Wgpu` and on the unfused
    /// `CubeBackend`, when the adapter has `shader-f16` (lavapipe does); `bf16` has no WGSL
    /// type, so it is skipped with a message.
    #[test]
    fn half_precision_matches_reference() {
        let device = Default::default();
        for dtype in [DType::F16, DType::BF16] {
            if !<Wgpu as Backend>::supports_dtype(&device, dtype) {
                eprintln!("skipped: the WGPU adapter does not support {dtype:?}");
                continue;
            }
            type Unfused = CubeBackend<WgpuRuntime, f32, i32, u32>;
            super::half_precision_matches_reference::<Wgpu, Unfused>(dtype);
        }
    }

    #[test]
    fn unfused_kernels_match_reference() {
        super::kernels_match_reference::<CubeBackend<WgpuRuntime, f32, i32, u32>>();
    }

    /// The kernels on cooperative matrices in `f16` (`super::cmma_products_match_reference`):
    /// on Vulkan (the `vulkan` feature) with a driver that has `VK_KHR_cooperative_matrix`,
    /// such as lavapipe from Mesa 25.1 on (`scripts/cmma-lavapipe.sh`).
    #[cfg(feature = "cmma")]
    #[test]
    fn cmma_products_match_reference() {
        type Unfused = CubeBackend<WgpuRuntime, f32, i32, u32>;
        super::cmma_products_match_reference::<Wgpu, Unfused>(DType::F16);
    }

    #[test]
    fn autodiff_kernels_match_reference() {
        super::kernels_match_reference::<Autodiff<Wgpu>>();
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use burn::backend::{Autodiff, Cuda};
    use burn::tensor::{DType, FloatDType};
    use burn_cubecl::CubeBackend;
    use cubecl::cuda::CudaRuntime;

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn fused_kernels_match_reference() {
        super::kernels_match_reference::<Cuda>();
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn unfused_kernels_match_reference() {
        super::kernels_match_reference::<CubeBackend<CudaRuntime, f32, i32, u8>>();
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn autodiff_kernels_match_reference() {
        super::kernels_match_reference::<Autodiff<Cuda>>();
    }

    type Unfused = CubeBackend<CudaRuntime, f32, i32, u8>;

    /// The half-precision checks of `half.rs` in `f16`, fused and unfused (one test per dtype,
    /// so that each compiles only its own kernels and reports on its own).
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn half_precision_f16_matches_reference() {
        super::half_precision_matches_reference::<Cuda, Unfused>(DType::F16);
    }

    /// As [`half_precision_f16_matches_reference`] in `bf16`.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn half_precision_bf16_matches_reference() {
        super::half_precision_matches_reference::<Cuda, Unfused>(DType::BF16);
    }

    /// The kernels on cooperative matrices (`super::cmma_products_match_reference`) in `f16`,
    /// on tensor cores.
    #[cfg(feature = "cmma")]
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn cmma_f16_products_match_reference() {
        super::cmma_products_match_reference::<Cuda, Unfused>(DType::F16);
    }

    /// As [`cmma_f16_products_match_reference`] in `bf16`.
    #[cfg(feature = "cmma")]
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn cmma_bf16_products_match_reference() {
        super::cmma_products_match_reference::<Cuda, Unfused>(DType::BF16);
    }

    /// The layer trains one batch to near-zero loss in `bf16`.
    #[test]
    #[ignore = "needs an NVIDIA GPU: run with --ignored"]
    fn layer_trains_one_batch_in_bf16() {
        crate::half::layer_trains_one_batch::<Autodiff<Cuda>>(FloatDType::BF16);
    }
}
