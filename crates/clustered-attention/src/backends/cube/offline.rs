#![cfg_attr(not(feature = "wgpu"), allow(dead_code))]
//! The CUDA source of every kernel, checked without a GPU: the launchers run on a WGPU device
//! (lavapipe where there is no GPU) inside a [`Capture`] that stands for an NVIDIA GPU, so each
//! kernel is planned from that GPU's properties (its plane size and cooperative-matrix shapes,
//! [`super::device_properties`]) and built, not launched (`launch!`, in `mod.rs`); every kernel
//! so captured is then compiled to CUDA C++ by cubecl-cpp's CUDA compiler, as cubecl-cuda
//! 0.11.3 compiles it before handing the source to NVRTC (`compute/context.rs`,
//! `compile_kernel`), and checked against the GPU's limits (cube size, units per cube, shared
//! memory).
//!
//! The GPUs are an A100 (`sm_80`) and an H100 (`sm_90`), described as cubecl-cuda 0.11.3's
//! `runtime.rs` describes a device from what its driver reports. The configurations are those
//! the launchers plan differently: `f32`, `f16` and `bf16`, the scores on cooperative matrices
//! on and off, at the cases of [`cases`] (every width a quarter of the most the kernels take,
//! rows of 4,096 to 65,536 keys, top-k 0, 32 and 64, clusters on each side of the launchers'
//! limits; the attention kernels with dropout off and on), and the K-means launcher by each of
//! its plans ([`kmeans_cases`]). The kernels expected are every `#[cube(launch, ..)]` function
//! found in the crate's `src/`, walked: a kernel that no configuration reaches fails the test.
//!
//! With `CUDA_KERNELS_DIR` set, the sources are written there (`sm_80/*.cu`, `sm_90/*.cu`) with
//! `kernels.tsv`, one line per source: `scripts/cuda-offline.sh` compiles them with NVRTC
//! (registers, spills) and writes the table of docs/backends.md.

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::rc::Rc;
use std::sync::Arc;

use burn::backend::ops::{FloatTensorOps, IntTensorOps};
use burn::tensor::{DType, Shape};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{CubeBackend, CubeDevice};
use cubecl::ir::features::{AtomicUsage, Features, Plane, Tma, TypeUsage};
use cubecl::ir::{
    DeviceIdentity, ElemType, FloatKind, HardwareProperties, MemoryDeviceProperties, MmaProperties,
    OpaqueType, Type,
};
use cubecl::prelude::*;
use cubecl::{Compiler, CubeKernel, define_kernel};
use cubecl_cpp::cuda::arch::CudaArchitecture;
use cubecl_cpp::cuda::mma::CudaCmmaCompiler;
use cubecl_cpp::cuda::mma::manual::contiguous_elements_cuda;
use cubecl_cpp::shared::{
    CompilationOptions, CppCompiler, CppSupportedFeatures, register_mma_features,
    register_wmma_features,
};
use cubecl_cpp::target::Cuda;

use super::kmeans::{self, KmeansPlan};
use crate::dropout::AttentionDropout;
use crate::ops::{CentroidAttention, QueryClusters};

/// The kernels the launchers built while a capture was open on the thread, in place of
/// launching them, for the device properties it carries.
pub(in crate::backends::cube) struct Capture {
    properties: Arc<DeviceProperties>,
    target: Arc<TargetProperties>,
    cmma: bool,
    kernels: RefCell<Vec<(&'static str, Box<dyn CubeKernel>)>>,
}

thread_local! {
    static OPEN: RefCell<Option<Rc<Capture>>> = const { RefCell::new(None) };
}

impl Capture {
    /// The capture open on this thread, if any.
    pub(in crate::backends::cube) fn open() -> Option<Rc<Capture>> {
        OPEN.with(|open| open.borrow().clone())
    }

    /// The properties of the device the kernels are built for.
    pub(in crate::backends::cube) fn properties(&self) -> Arc<DeviceProperties> {
        self.properties.clone()
    }

    /// The target properties of the device's runtime.
    pub(in crate::backends::cube) fn target(&self) -> Arc<TargetProperties> {
        self.target.clone()
    }

    /// Whether the scores may go through cooperative matrices (the `cmma` feature's role).
    pub(in crate::backends::cube) fn cmma(&self) -> bool {
        self.cmma
    }

    /// Keeps `kernel`, built by the launcher of `name`.
    pub(in crate::backends::cube) fn record(&self, name: &'static str, kernel: impl CubeKernel) {
        self.kernels.borrow_mut().push((name, Box::new(kernel)));
    }
}

/// Runs `ops` with a capture for `gpu` open on the thread and returns the kernels built.
fn capture(
    gpu: &CudaGpu,
    cmma: bool,
    ops: impl FnOnce(),
) -> Vec<(&'static str, Box<dyn CubeKernel>)> {
    let capture = Rc::new(Capture {
        properties: gpu.properties.clone(),
        target: Arc::new(cuda_target_properties()),
        cmma,
        kernels: RefCell::new(Vec::new()),
    });
    OPEN.with(|open| *open.borrow_mut() = Some(capture.clone()));
    // Closed however `ops` ends, so that a failing case leaves no capture behind.
    struct Close;
    impl Drop for Close {
        fn drop(&mut self) {
            OPEN.with(|open| *open.borrow_mut() = None);
        }
    }
    let close = Close;
    ops();
    drop(close);
    Rc::try_unwrap(capture)
        .ok()
        .expect("the capture is closed")
        .kernels
        .into_inner()
}

/// An NVIDIA GPU as cubecl-cuda 0.11.3 describes it to the kernels.
struct CudaGpu {
    /// The architecture's name, as NVRTC's `--gpu-architecture` takes it.
    arch: &'static str,
    properties: Arc<DeviceProperties>,
    options: CompilationOptions,
}

/// The device properties and compilation options cubecl-cuda 0.11.3 gives a GPU of compute
/// capability `version` (its `runtime.rs`, `DeviceService::init`, with a CUDA 13 build: what
/// NVRTC 13 supports), for a GPU with tensor cores, `max_shared` bytes of shared memory per
/// block (the opt-in maximum) and `sms` multiprocessors. The complex types and the memory size
/// are left out: no kernel of the crate uses them.
fn cuda_gpu(arch: &'static str, version: u32, max_shared: usize, sms: u32) -> CudaGpu {
    const CUDA_VERSION: u32 = 13000;
    let cuda_arch = CudaArchitecture {
        version,
        tensor_cores: true,
    };
    let cmma = CudaCmmaCompiler::Cpp.supported_cmma_combinations(&cuda_arch);
    let hardware = HardwareProperties {
        load_width: 128,
        vector_register_count: None,
        plane_size_min: 32,
        plane_size_max: 32,
        max_bindings: 1024,
        max_shared_memory_size: max_shared,
        max_cube_count: (i32::MAX as u32, 65_535, 65_535),
        max_units_per_cube: 1024,
        max_cube_dim: (1024, 1024, 64),
        num_streaming_multiprocessors: Some(sms),
        num_tensor_cores: Some(4),
        min_tensor_cores_dim: (!cmma.is_empty()).then_some(8),
        num_cpu_cores: None,
        last_level_cache_size: None,
        max_vector_size: VectorSize::MAX,
        cube_mma_reserved_shared_memory: 0,
    };
    let mut properties = DeviceProperties::new(
        Features::default(),
        MemoryDeviceProperties::new(u64::MAX, 512),
        hardware,
        cubecl::profile::TimingMethod::Device,
        DeviceIdentity {
            name: format!("offline {arch}"),
            fingerprint: format!("ptx_sm{version}"),
            physical: None,
        },
    );
    let mut features = CppSupportedFeatures {
        fast_math: true,
        dp4a: true,
        ..Default::default()
    };
    cubecl_cpp::register_supported_types(&mut properties);
    properties.register_atomic_type_usage(
        Type::atomic(ElemType::Float(FloatKind::F64)),
        AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
    );
    properties.register_atomic_type_usage(
        Type::atomic(ElemType::Float(FloatKind::F16)),
        AtomicUsage::Add,
    );
    properties.register_atomic_type_usage(
        Type::atomic(Type::new(ElemType::Float(FloatKind::F16)).with_vector_size(2)),
        AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
    );
    properties.register_opaque_type(OpaqueType::Barrier);
    properties.features.plane.insert(Plane::Sync);
    features.grid_constants = true;
    for float in [FloatKind::F16, FloatKind::BF16] {
        properties
            .features
            .matmul
            .ldmatrix
            .insert(ElemType::Float(float));
    }
    features.fast_tanh = CUDA_VERSION >= 12080;
    properties.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
    properties.features.copy_async = true;
    if version >= 90 {
        properties.features.tma.insert(Tma::Base);
        properties.register_opaque_type(OpaqueType::TensorMap);
        properties.features.cube_cluster = true;
        features.clusters = true;
        features.elect_sync = true;
        for float in [FloatKind::F16, FloatKind::BF16] {
            properties
                .features
                .matmul
                .stmatrix
                .insert(ElemType::Float(float));
        }
        let half_vectors = [
            (
                2,
                AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
            ),
            (
                4,
                AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
            ),
            (
                8,
                AtomicUsage::Add | AtomicUsage::LoadStore | AtomicUsage::Exchange,
            ),
            (4, AtomicUsage::MinMax.into()),
            (8, AtomicUsage::MinMax.into()),
        ];
        for (vector, usage) in half_vectors {
            for float in [FloatKind::BF16, FloatKind::F16] {
                properties.register_atomic_type_usage(
                    Type::atomic(Type::new(float).with_vector_size(vector)),
                    usage,
                );
            }
        }
        for vector in [2, 4] {
            properties.register_atomic_type_usage(
                Type::atomic(Type::new(ElemType::Float(FloatKind::F32)).with_vector_size(vector)),
                AtomicUsage::LoadStore | AtomicUsage::Exchange | AtomicUsage::Add,
            );
        }
    }
    properties.features.memory_reinterpret = true;
    properties.features.alignment = true;
    properties.features.device_memory_scope = true;
    properties.features.plane.insert(Plane::Ops);
    properties
        .features
        .plane
        .insert(Plane::NonUniformControlFlow);
    register_wmma_features(cmma, &mut properties);
    register_mma_features(
        cubecl_cpp::cuda::supported_mma_combinations(&cuda_arch),
        &mut properties,
    );
    CudaGpu {
        arch,
        properties: Arc::new(properties),
        options: CompilationOptions {
            warp_size: 32,
            supports_features: features,
            amd_wmma: None,
        },
    }
}

/// `CudaRuntime::target_properties()` of cubecl-cuda 0.11.3.
fn cuda_target_properties() -> TargetProperties {
    TargetProperties {
        mma: MmaProperties {
            register_size_bits: 32,
            const_plane_size: 32,
            register_layout_a: cubecl::cmma::MatrixLayout::RowMajor,
            register_layout_b: cubecl::cmma::MatrixLayout::ColMajor,
            register_layout_acc: cubecl::cmma::MatrixLayout::RowMajor,
            register_duplication_a: 1,
            register_duplication_b: 1,
            register_duplication_acc: 1,
            contiguous_elements: cubecl::ir::ContiguousElements::new(contiguous_elements_cuda),
        },
    }
}

/// The A100 (`sm_80`: 164 KiB of shared memory a block at most, 108 SMs) and the H100 SXM
/// (`sm_90`: 227 KiB, 132 SMs).
fn gpus() -> [CudaGpu; 2] {
    [
        cuda_gpu("sm_80", 80, 166_912, 108),
        cuda_gpu("sm_90", 90, 232_448, 132),
    ]
}

/// The float types of the configurations.
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Lloyd iterations of the K-means cases (the crate's default).
const ITERATIONS: usize = 10;

/// Batch and heads of every case.
const BATCH: usize = 1;
const HEADS: usize = 8;

/// The sizes a case runs the attention launchers at: `dim` features a head (`E = D`), `len`
/// queries and keys, `clusters`, `topk`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Case {
    dim: usize,
    len: usize,
    clusters: usize,
    topk: usize,
}

/// The base case: the crate's defaults (100 clusters, top-k 32) at 4,096 keys.
const BASE: Case = Case {
    dim: 64,
    len: 4096,
    clusters: 100,
    topk: 32,
};

/// The cases of the attention launchers, each an axis moved away from [`BASE`] to where the
/// launchers plan otherwise:
/// - every width a quarter of the most the kernels take apart ([`MAX_DIM`](super::MAX_DIM):
///   32, 64, 96, 128; the row splits and tiles change with it);
/// - long rows, 16 times the base's keys (65,536: the centroid kernels' chunks and tiles),
///   at the widest and the base width;
/// - the most top-k the kernels take at every width ([`super::centroid::max_topk`]: 64, 48 at
///   the widest; the top-k attention takes it at narrow rows only, see
///   [`super::top::supported`]);
/// - clusters on each side of the centroid kernels' row blocks (32 rows a cube up to 32
///   clusters, 64 beyond).
///
/// The K-means (integer kernels) has cases of its own ([`kmeans_cases`]), and so has the top-k
/// kernel, built for every length of list it runs with ([`topk_cases`]).
fn cases() -> BTreeSet<Case> {
    let widths = (1..=4).map(|q| q * super::MAX_DIM / 4);
    let mut cases = BTreeSet::new();
    for dim in widths {
        cases.insert(Case { dim, ..BASE });
        cases.insert(Case {
            dim,
            topk: super::centroid::max_topk(dim),
            ..BASE
        });
    }
    for dim in [BASE.dim, super::MAX_DIM] {
        cases.insert(Case {
            dim,
            len: 16 * BASE.len,
            ..BASE
        });
    }
    cases.insert(Case {
        clusters: 16,
        ..BASE
    });
    cases
}

/// Rows and clusters at which [`kmeans::hamming_kmeans_planned`] runs each of
/// [`KmeansPlan::ALL`]: for every plan, the first K-means candidate that
/// [`kmeans::kmeans_plan`] gives that plan on a device with or without llvmpipe's loop limit.
/// The candidates: the base's clusters first, then those of [`cases`] and one past each of the
/// launcher's limits ([`kmeans::LOOP_CLUSTERS`], [`kmeans::SHARED_VOTES`],
/// [`kmeans::SHARED_CENTROIDS`]); the lengths of [`cases`], the longest row lavapipe takes in
/// one launch at the crate's defaults and one query past it.
///
/// # Panics
/// If a plan is given by no candidate.
fn kmeans_cases() -> Vec<(KmeansPlan, usize, usize)> {
    let mut clusters: BTreeSet<usize> = cases().iter().map(|case| case.clusters).collect();
    clusters.extend([
        kmeans::LOOP_CLUSTERS + 1,
        kmeans::SHARED_VOTES + 1,
        kmeans::SHARED_CENTROIDS + 1,
    ]);
    let mut lens: BTreeSet<usize> = cases().iter().map(|case| case.len).collect();
    let longest = kmeans::longest_one_launch_row(BASE.clusters, ITERATIONS);
    lens.extend([longest, longest + 1]);
    let limits = [None, Some(kmeans::LLVMPIPE_LOOP_PASSES)];
    KmeansPlan::ALL
        .iter()
        .map(|&plan| {
            // The crate's defaults first.
            let (len, clusters) = std::iter::once(&BASE.clusters)
                .chain(&clusters)
                .flat_map(|&c| lens.iter().map(move |&len| (len, c)))
                .find(|&(len, c)| {
                    len >= c
                        && limits
                            .iter()
                            .any(|&limit| kmeans::kmeans_plan(len, c, ITERATIONS, limit) == plan)
                })
                .unwrap_or_else(|| panic!("no K-means candidate takes {plan:?}"));
            (plan, len, clusters)
        })
        .collect()
}

/// A float tensor of `shape` and `dtype` on `device`, not initialised (the kernels are built,
/// not launched).
fn floats(shape: [usize; 4], dtype: DType, device: &CubeDevice) -> CubeTensor {
    CubeBackend::float_empty(Shape::new(shape), device, dtype.into())
}

/// An int tensor of `shape` on `device`, zeros (one cluster, key 0).
fn ints<const N: usize>(shape: [usize; N], device: &CubeDevice) -> CubeTensor {
    CubeBackend::int_zeros(Shape::new(shape), device, DType::I32.into())
}

/// Runs the K-means launcher by `plan` at rows of `len` queries and `clusters` clusters on
/// `device` (integer kernels: the same for every float type).
fn run_kmeans(plan: KmeansPlan, len: usize, clusters: usize, device: &CubeDevice) {
    let codes = ints([BATCH, HEADS, len], device);
    let _ = kmeans::hamming_kmeans_planned(codes, None, None, clusters, ITERATIONS, 7, plan);
}

/// The `k` the top-k launcher is run at: one for every length of list its kernel runs with
/// ([`super::topk::list_len`] of `1..=`[`super::topk::MAX_K`]).
fn topk_cases() -> BTreeSet<usize> {
    (1..=super::topk::MAX_K)
        .map(super::topk::list_len)
        .collect()
}

/// Runs the top-k launcher for `k` best of `BASE.len` scores in `dtype` on `device`.
fn run_topk(dtype: DType, k: usize, device: &CubeDevice) {
    let scores = floats([BATCH, HEADS, BASE.clusters, BASE.len], dtype, device);
    let _ = super::topk::topk_indices(scores, k, DType::I32);
}

/// Runs every attention launcher of the crate as the ops call them, at `case` in `dtype` on
/// `device`: without `dropout`, hashing, top-k, the centroid attention forward and backward,
/// the improved attention's forward and the sparse products; with it, the launchers that take
/// it (the centroid attention forward and backward, the improved attention's forward) and the
/// dropout factors of the top-k weights. Nothing is read back: the kernels are captured, and
/// the tensors between them hold whatever Burn's allocation left (zeros or garbage, which the
/// launchers never read on the host).
fn run_ops(dtype: DType, case: Case, dropout: Option<AttentionDropout>, device: &CubeDevice) {
    let Case {
        dim,
        len,
        clusters,
        topk,
    } = case;
    let int = DType::I32;
    // One tensor for every `[B, H, L, E]` operand: nothing runs, so they may alias.
    let rows = floats([BATCH, HEADS, len, dim], dtype, device);
    let queries = || rows.clone();
    if dropout.is_none() {
        let planes = CubeBackend::float_zeros(Shape::new([32, dim + 1]), device, dtype.into());
        let _ = super::hash::lsh_hash(queries(), planes, int);
        let scores = floats([BATCH, HEADS, clusters, len], dtype, device);
        let _ = super::topk::topk_indices(scores, topk, int);
    }

    let centroids = floats([BATCH, HEADS, clusters, dim], dtype, device);
    for topk in [0, topk] {
        assert!(super::centroid::supported(dim, dim, topk));
        let forward = super::centroid::centroid_attention(
            centroids.clone(),
            queries(),
            queries(),
            None,
            topk,
            int,
            dropout,
        );
        let grad_top = forward
            .top
            .as_ref()
            .map(|_| floats([BATCH, HEADS, clusters, topk], dtype, device));
        let _ = super::centroid::centroid_attention_backward(
            centroids.clone(),
            queries(),
            queries(),
            None,
            CentroidAttention {
                values: forward.values,
                top: forward.top,
                log_sum_exp: None,
            },
            floats([BATCH, HEADS, clusters, dim], dtype, device),
            grad_top,
            dropout,
        );
    }
    if super::top::supported(dim, dim, topk, clusters) {
        let clusters = QueryClusters {
            assignments: ints([BATCH, HEADS, len], device),
            inverse_counts: CubeBackend::float_zeros(
                Shape::new([BATCH, HEADS, clusters]),
                device,
                dtype.into(),
            ),
        };
        let _ = super::improved_forward(
            queries(),
            queries(),
            queries(),
            clusters,
            None,
            topk,
            0.125,
            int,
            dropout,
        );
    }

    let weights = floats([BATCH, HEADS, len, topk], dtype, device);
    if let Some(dropout) = dropout {
        let _ = super::dropout::dropout_factors(weights, dropout, AttentionDropout::QUERY_TOP);
        return;
    }
    let indices = ints([BATCH, HEADS, clusters, topk], device);
    let assignments = ints([BATCH, HEADS, len], device);
    let weights = || weights.clone();
    let _ = super::sparse::sparse_dot(queries(), queries(), indices.clone(), assignments.clone());
    let _ = super::sparse::sparse_weighted_sum(
        weights(),
        queries(),
        indices.clone(),
        assignments.clone(),
    );
    let _ = super::sparse::sparse_scatter(weights(), queries(), indices, assignments, len);
}

/// The kernels of the crate: every `#[cube(launch, ..)]` function of its source tree (`src/`,
/// walked), with the file that holds it.
fn kernel_names() -> BTreeMap<String, String> {
    fn walk(dir: &std::path::Path, names: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|entry| entry.expect("a directory entry").path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(&path, names);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                let source = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                let mut lines = source.lines().map(str::trim_start);
                while let Some(line) = lines.next() {
                    if line.starts_with("#[cube(launch") {
                        let signature = lines
                            .find(|line| line.contains("fn "))
                            .expect("a function after #[cube(launch)]");
                        let name = signature
                            .split("fn ")
                            .nth(1)
                            .and_then(|rest| rest.split(['<', '(']).next())
                            .expect("a kernel name");
                        names.insert(name.to_string(), path.display().to_string());
                    }
                }
            }
        }
    }
    let mut names = BTreeMap::new();
    walk(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut names,
    );
    names
}

/// `source` as the key of its kernel: the variables (`v123`) renumbered in order of first use
/// and the hash that ends the entry point's name dropped, so that two builds of the same code
/// (whose numbering depends on what the expansion met before) count once.
fn canonical(source: &str) -> String {
    let mut names = BTreeMap::new();
    let mut out = String::with_capacity(source.len());
    let mut token = String::new();
    let flush = |token: &mut String, out: &mut String, names: &mut BTreeMap<String, usize>| {
        let is_variable = token.len() > 1
            && token.starts_with('v')
            && token[1..].bytes().all(|b| b.is_ascii_digit());
        let hashed = token.contains("_kernel")
            && token.len() > 9
            && token.as_bytes()[token.len() - 9] == b'_'
            && token[token.len() - 8..]
                .bytes()
                .all(|b| b.is_ascii_hexdigit());
        if is_variable {
            let next = names.len();
            let index = *names.entry(token.clone()).or_insert(next);
            let _ = write!(out, "v{index}");
        } else if hashed {
            out.push_str(&token[..token.len() - 9]);
        } else {
            out.push_str(token);
        }
        token.clear();
    };
    for c in source.chars() {
        if c.is_ascii_alphanumeric() || c == '_' {
            token.push(c);
        } else {
            flush(&mut token, &mut out, &mut names);
            out.push(c);
        }
    }
    flush(&mut token, &mut out, &mut names);
    out
}

/// What built a source: the float type, the scores' products (`cmma` or `fma`), attention
/// dropout and the case, or the K-means plan with its rows.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Config {
    Attention {
        dtype: String,
        products: &'static str,
        /// Whether the attention kernels drop weights (`p=0.1`; `p=0` without).
        dropout: bool,
        case: Case,
    },
    Kmeans {
        plan: KmeansPlan,
        len: usize,
        clusters: usize,
    },
    TopK {
        dtype: String,
        k: usize,
    },
}

impl Config {
    /// Whether the launchers may put the scores on cooperative matrices (the `cmma` feature's
    /// role in a capture).
    fn cmma(&self) -> bool {
        matches!(
            self,
            Config::Attention {
                products: "cmma",
                ..
            }
        )
    }
}

/// `dtype`'s name in the table, `f32`, `f16` or `bf16`.
fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

/// `configs` in a line: each field's values, e.g. `f16, bf16 · cmma, fma · p=0, p=0.1 · E=64, 128
/// · L=4096 · C=100 · k=32` (`p` the attention dropout), or the K-means plans with their rows.
fn summary(configs: &BTreeSet<Config>) -> String {
    // The float types, the products and the dropout, then E, L, C and k.
    let mut names: [BTreeSet<String>; 3] = Default::default();
    let mut sizes: [BTreeSet<usize>; 4] = Default::default();
    let mut plans = Vec::new();
    for config in configs {
        match config {
            Config::Attention {
                dtype,
                products,
                dropout,
                case,
            } => {
                names[0].insert(dtype.clone());
                names[1].insert(products.to_string());
                names[2].insert(if *dropout { "p=0.1" } else { "p=0" }.to_string());
                for (field, value) in
                    sizes
                        .iter_mut()
                        .zip([case.dim, case.len, case.clusters, case.topk])
                {
                    field.insert(value);
                }
            }
            Config::Kmeans {
                plan,
                len,
                clusters,
            } => plans.push(format!("K-means {plan:?} L={len} C={clusters}")),
            Config::TopK { dtype, k } => {
                names[0].insert(dtype.clone());
                sizes[3].insert(*k);
            }
        }
    }
    let join = |values: Vec<String>| values.join(", ");
    let mut parts: Vec<String> = names
        .into_iter()
        .filter(|field| !field.is_empty())
        .map(|field| join(field.into_iter().collect()))
        .collect();
    for (prefix, field) in ["E=", "L=", "C=", "k="].iter().zip(sizes) {
        if !field.is_empty() {
            let values = field.iter().map(usize::to_string).collect();
            parts.push(format!("{prefix}{}", join(values)));
        }
    }
    parts.extend(plans);
    parts.join(" · ")
}

/// A configuration and the launchers' calls that build its kernels.
type Run = (Config, Box<dyn Fn()>);

/// One kernel compiled for one GPU.
struct Compiled {
    kernel: &'static str,
    /// The configurations that built this source.
    configs: BTreeSet<Config>,
    source: String,
    shared_bytes: usize,
    cube_dim: (u32, u32, u32),
}

/// Every launcher of the crate, for both GPUs, at every case of [`cases`] in every float type
/// with the scores' products on cooperative matrices and not, and by every K-means plan
/// ([`kmeans_cases`]), captured and compiled to CUDA C++; each distinct source checked against
/// its GPU's limits (and written to `CUDA_KERNELS_DIR` when set). Fails on a kernel that does
/// not compile, a cube larger than the GPU takes or more shared memory than it has, and on a
/// `#[cube(launch)]` kernel of the crate's sources that no configuration reaches.
#[cfg(feature = "wgpu")]
#[test]
fn cuda_sources_compile_for_sm_80_and_sm_90() {
    let device = CubeDevice::Wgpu(Default::default());
    let out = std::env::var_os("CUDA_KERNELS_DIR").map(std::path::PathBuf::from);
    let mut manifest = String::from("arch\tfile\tkernel\tcube_dim\tshared_bytes\tconfigs\n");
    let expected = kernel_names();
    assert!(
        expected.len() >= 20,
        "found only {expected:?} in the sources"
    );
    let mut runs: Vec<Run> = Vec::new();
    for dtype in DTYPES {
        for cmma in [false, true] {
            for (case, dropout) in cases().into_iter().flat_map(|c| [(c, false), (c, true)]) {
                let config = Config::Attention {
                    dtype: dtype_name(dtype),
                    products: if cmma { "cmma" } else { "fma" },
                    dropout,
                    case,
                };
                let device = device.clone();
                let dropout = dropout.then(|| AttentionDropout::new(0.1, 7));
                runs.push((
                    config,
                    Box::new(move || run_ops(dtype, case, dropout, &device)),
                ));
            }
        }
    }
    for dtype in DTYPES {
        for k in topk_cases() {
            let config = Config::TopK {
                dtype: dtype_name(dtype),
                k,
            };
            let device = device.clone();
            runs.push((config, Box::new(move || run_topk(dtype, k, &device))));
        }
    }
    for (plan, len, clusters) in kmeans_cases() {
        let config = Config::Kmeans {
            plan,
            len,
            clusters,
        };
        let device = device.clone();
        runs.push((
            config,
            Box::new(move || run_kmeans(plan, len, clusters, &device)),
        ));
    }
    for gpu in gpus() {
        let mut sources: BTreeMap<String, Compiled> = BTreeMap::new();
        // The source of each kernel id compiled so far: the same id (kernel, comptime
        // arguments, cube) gives the same source, compiled once.
        let mut compiled_ids = HashMap::new();
        for (config, run) in &runs {
            for (kernel, built) in capture(&gpu, config.cmma(), run) {
                if let Some(key) = compiled_ids.get(&built.id()) {
                    let entry: &mut Compiled = sources.get_mut(key).expect("a compiled source");
                    entry.configs.insert(config.clone());
                    continue;
                }
                let definition =
                    define_kernel(&*built).unwrap_or_else(|e| panic!("{kernel} ({config:?}): {e}"));
                let compiled = CppCompiler::<Cuda>::default()
                    .compile(definition, &gpu.options)
                    .unwrap_or_else(|e| panic!("{kernel} ({config:?}) for {}: {e}", gpu.arch));
                let cube_dim = built.id().cube_dim;
                let key = canonical(&compiled.source);
                compiled_ids.insert(built.id(), key.clone());
                let entry = sources.entry(key).or_insert_with(|| Compiled {
                    kernel,
                    configs: BTreeSet::new(),
                    source: compiled.source.clone(),
                    shared_bytes: compiled.shared_memory_size,
                    cube_dim: (cube_dim.x, cube_dim.y, cube_dim.z),
                });
                entry.configs.insert(config.clone());
            }
        }
        let hardware = &gpu.properties.hardware;
        let mut seen = BTreeSet::new();
        for (index, compiled) in sources.values().enumerate() {
            let (x, y, z) = compiled.cube_dim;
            let (max_x, max_y, max_z) = hardware.max_cube_dim;
            assert!(
                x <= max_x && y <= max_y && z <= max_z && x * y * z <= hardware.max_units_per_cube,
                "{} on {}: a cube of {x}×{y}×{z} units",
                compiled.kernel,
                gpu.arch
            );
            assert!(
                compiled.shared_bytes <= hardware.max_shared_memory_size,
                "{} on {} ({:?}): {} B of shared memory, the GPU has {} B a block",
                compiled.kernel,
                gpu.arch,
                compiled.configs,
                compiled.shared_bytes,
                hardware.max_shared_memory_size
            );
            seen.insert(compiled.kernel.to_string());
            if let Some(out) = &out {
                let file = format!("{}/{}-{index:03}.cu", gpu.arch, compiled.kernel);
                let path = out.join(&file);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &compiled.source).unwrap();
                writeln!(
                    manifest,
                    "{}\t{file}\t{}\t{x}x{y}x{z}\t{}\t{}",
                    gpu.arch,
                    compiled.kernel,
                    compiled.shared_bytes,
                    summary(&compiled.configs)
                )
                .unwrap();
            }
        }
        let missed: Vec<_> = expected
            .iter()
            .filter(|(name, _)| !seen.contains(*name))
            .collect();
        assert!(
            missed.is_empty(),
            "no configuration reaches {missed:?} on {}",
            gpu.arch
        );
        assert_eq!(
            seen,
            expected.keys().cloned().collect(),
            "the kernels captured on {} are not the kernels of the sources",
            gpu.arch
        );
    }
    if let Some(out) = &out {
        std::fs::write(out.join("kernels.tsv"), manifest).unwrap();
    }
}
