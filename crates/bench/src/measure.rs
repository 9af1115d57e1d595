//! Timing the attentions and the clustering ops on one backend.

use std::time::Instant;

use anyhow::Result;
use burn::tensor::module::attention;
use burn::tensor::ops::AttentionModuleOptions;
use burn::tensor::{Device, Distribution, Tensor};
use clustered_attention::ops::{ScoreProducts, score_products};
use clustered_attention::{
    AttentionInput, ClusteredAttention, ClusteringOptions, FullAttention,
    ImprovedClusteredAttention, hamming_kmeans, lsh_hash, lsh_planes,
};
use serde::Serialize;

use crate::{Args, Mode, launches};

/// Everything that can be timed, in table order.
pub const OPS: [&str; 6] = [
    "full",
    "fused",
    "clustered",
    "improved",
    "lsh_hash",
    "hamming_kmeans",
];

/// Ops that have a backward pass (timed in `--mode train`).
const ATTENTIONS: [&str; 4] = ["full", "fused", "clustered", "improved"];

/// One measurement (or one skipped measurement).
#[derive(Debug, Clone, Serialize)]
pub struct Record {
    pub backend: String,
    pub dtype: &'static str,
    pub mode: Mode,
    pub op: String,
    pub batch: usize,
    pub heads: usize,
    pub length: usize,
    pub dim: usize,
    pub clusters: usize,
    pub topk: usize,
    pub bits: usize,
    pub iterations: usize,
    /// The attention dropout (`--mode train`; 0 in the forward pass).
    pub dropout: f64,
    /// Timed runs behind the figures: at least `--runs`, more while the timed seconds are
    /// under `--min-time-s`; 0 for a skipped measurement.
    pub runs: usize,
    /// Median, minimum and maximum wall time of the timed runs, in seconds.
    pub median_s: Option<f64>,
    pub min_s: Option<f64>,
    pub max_s: Option<f64>,
    /// Estimated floating-point (or, for the clustering ops, bit) operations of one run.
    pub flops: f64,
    pub gflops_per_s: Option<f64>,
    /// Device memory the backend's pools held at the end of the measurement, in MiB, after
    /// unused pages were released before it (GPU backends): the pools keep their high-water
    /// mark, so this bounds the peak from above (inputs included).
    pub peak_device_mib: Option<f64>,
    /// Peak resident memory of the process during the measurement, in MiB (CPU backends on
    /// Linux: `VmHWM` after releasing the allocator's free pages and resetting it through
    /// `/proc/self/clear_refs`): the inputs and the program itself included.
    pub peak_rss_mib: Option<f64>,
    /// `--mode train`: the median wall time of the forward pass alone, in seconds, timed in
    /// the same run (each timed forward pass right before a timed forward + backward), so that
    /// `median_s / forward_median_s` compares the two under the same conditions.
    pub forward_median_s: Option<f64>,
    /// `--mode train` with `--dropout` above 0: the median wall time of a forward + backward
    /// pass without dropout, in seconds, timed in the same run (each beside a timed forward +
    /// backward with dropout, before it and after it in turn), so that `median_s /
    /// no_dropout_median_s` is what the dropout costs a step under the same conditions.
    pub no_dropout_median_s: Option<f64>,
    /// `--count-launches` on a Cube backend: the kernel launches of one run (the forward
    /// pass, or in `--mode train` the forward + backward pass), counted by CubeCL's profiling
    /// logger after the timed runs ([`crate::launches`]).
    pub launches: Option<usize>,
    /// `--count-launches`, `--mode train`: the kernel launches of the forward pass alone.
    pub forward_launches: Option<usize>,
    /// How the fused attention kernels compute their scores on this backend in this dtype
    /// ([`ScoreProducts`]'s display: `multiply-add`, or `cmma m×n×k` with clustered-attention's
    /// `cmma` feature where the device has cooperative matrices).
    pub score_products: String,
    /// Why the measurement was skipped, if it was.
    pub skipped: Option<String>,
}

fn selected(args: &Args) -> Vec<&'static str> {
    let ops: &[&'static str] = match args.mode {
        Mode::Forward => &OPS,
        Mode::Train => &ATTENTIONS,
        Mode::Encoder => unreachable!("--mode encoder runs encoder::run"),
    };
    ops.iter()
        .copied()
        // Burn's fused attention has no dropout.
        .filter(|&op| op != "fused" || args.dropout() == 0.0)
        .filter(|op| args.only.is_empty() || args.only.iter().any(|o| o == op))
        .collect()
}

/// Estimated operations of one forward run (see [`Record::flops`]).
fn flops(op: &str, args: &Args, len: usize) -> f64 {
    let (b, h, l, e) = (
        args.batch as f64,
        args.heads() as f64,
        len as f64,
        args.dim as f64,
    );
    let c = args.clusters.min(len) as f64;
    let k = args.topk.min(len) as f64;
    let hash = 2.0 * b * h * l * e * args.bits as f64;
    let kmeans = (args.iterations as f64 + 1.0) * b * h * l * c * args.bits as f64;
    let clustered = hash + kmeans + 2.0 * b * h * c * l * 2.0 * e + 2.0 * b * h * l * e;
    match op {
        "full" | "fused" => 2.0 * b * h * l * l * 2.0 * e,
        "clustered" => clustered,
        "improved" => clustered + 2.0 * b * h * l * k * 2.0 * e,
        "lsh_hash" => hash,
        "hamming_kmeans" => kmeans,
        _ => unreachable!(),
    }
}

/// Whether Burn's fused attention materialises the `[L, S]` scores: always under autodiff (its
/// backward is the decomposed fallback), on CPU backends, and on CubeCL backends built without
/// Burn's autotune (this program's `autotune` feature), whose default strategy is then the
/// fallback. With it, burn-cubecl 0.22.1's autotune lets the fallback compete only while
/// `L ≤ E` (`kernel/attention/tune.rs`: scores no larger than a `[batch, S, d_model]`
/// activation) and otherwise runs a flash kernel, which keeps `O(L)` memory.
fn fused_materialises(args: &Args, gpu: bool, len: usize) -> bool {
    args.mode == Mode::Train || !gpu || !cfg!(feature = "autotune") || len <= args.dim
}

/// Rough peak memory of one run in bytes (floats in `--dtype`, K-means in 32-bit integers),
/// to skip what would not fit.
fn memory_bytes(op: &str, args: &Args, gpu: bool, len: usize) -> f64 {
    let (b, h, l, e) = (
        args.batch as f64,
        args.heads() as f64,
        len as f64,
        args.dim as f64,
    );
    let c = args.clusters.min(len) as f64;
    let k = args.topk.min(len) as f64;
    let train = if args.mode == Mode::Train { 3.0 } else { 1.0 };
    let f = args.dtype.bytes();
    let inputs = 3.0 * b * h * l * e * f;
    let kmeans = 6.0 * b * h * l * c.max(32.0) * 4.0;
    let centroid = 4.0 * b * h * c * l * 2.0 * f;
    inputs
        + train
            * match op {
                "fused" if !fused_materialises(args, gpu, len) => 2.0 * b * h * l * e * f,
                "full" | "fused" => 3.0 * b * h * l * l * f,
                "clustered" => kmeans + centroid,
                // The sparse products read the top-k keys in place: only `[L, k]` scores,
                // weights and their gradients.
                "improved" => kmeans + centroid + 8.0 * b * h * l * k * f,
                _ => kmeans,
            }
}

struct Stats {
    /// Timed runs behind the figures.
    runs: usize,
    median: f64,
    min: f64,
    max: f64,
    /// The forward pass's median where it was timed beside (`--mode train`).
    forward_median: Option<f64>,
    /// The median of the train step without dropout where it was timed beside.
    no_dropout_median: Option<f64>,
    /// Kernel launches of one run, and of the forward pass alone in `--mode train`, where
    /// counted.
    launches: Option<usize>,
    forward_launches: Option<usize>,
}

/// Median, minimum and maximum of `times` (not empty).
fn stats(mut times: Vec<f64>) -> Stats {
    times.sort_by(f64::total_cmp);
    Stats {
        runs: times.len(),
        median: times[times.len() / 2],
        min: times[0],
        max: times[times.len() - 1],
        forward_median: None,
        no_dropout_median: None,
        launches: None,
        forward_launches: None,
    }
}

/// Wall time of one call of `f`, the device synchronised inside the timed region and the
/// result kept alive until it has been.
fn time_once<R>(device: &Device, f: &mut impl FnMut() -> R) -> f64 {
    let start = Instant::now();
    let out = f();
    device.sync().expect("device sync");
    let elapsed = start.elapsed().as_secs_f64();
    drop(out);
    elapsed
}

/// Most timed runs of one measurement that `--min-time-s` can ask for.
const MAX_RUNS: usize = 1000;

/// Calls `run` (which times one run and returns its seconds) `--runs` times, then again until
/// the timed seconds add up to `--min-time-s`, or [`MAX_RUNS`] runs (never fewer than
/// `--runs`): short measurements get enough runs for a stable median.
fn repeat(args: &Args, mut run: impl FnMut() -> f64) {
    let (min_runs, mut runs, mut total) = (args.runs.max(1), 0, 0.0);
    while runs < min_runs || (total < args.min_time_s && runs < MAX_RUNS) {
        total += run();
        runs += 1;
    }
}

/// Runs `f` `warmup` times untimed, then timed as [`repeat`] says; the device is synchronised
/// inside the timed region, and the result is kept alive until it has been.
fn time<R>(device: &Device, args: &Args, mut f: impl FnMut() -> R) -> Stats {
    for _ in 0..args.warmup {
        time_once(device, &mut f);
    }
    let mut times = Vec::new();
    repeat(args, || {
        times.push(time_once(device, &mut f));
        times[times.len() - 1]
    });
    stats(times)
}

/// [`time`], then the kernel launches of one more call on a GPU backend
/// ([`launches::count`], where counted).
fn time_and_count<R>(device: &Device, args: &Args, gpu: bool, mut f: impl FnMut() -> R) -> Stats {
    let stats = time(device, args, &mut f);
    Stats {
        launches: gpu.then(|| launches::count(device, f)).flatten(),
        ..stats
    }
}

/// [`time`] for `train`, with `forward` timed right before each run of it (and warmed up
/// likewise), and `baseline` (the step without dropout, where given) beside it, before it in
/// one run and after it in the next, so that neither gains from following the other: the
/// train statistics, with the forward pass's and the baseline's medians. `--min-time-s` counts
/// the forward + backward runs of `train` only.
fn time_beside<R, S>(
    device: &Device,
    args: &Args,
    mut forward: impl FnMut() -> R,
    mut baseline: Option<impl FnMut() -> S>,
    mut train: impl FnMut() -> S,
) -> Stats {
    for _ in 0..args.warmup {
        time_once(device, &mut forward);
        if let Some(baseline) = &mut baseline {
            time_once(device, baseline);
        }
        time_once(device, &mut train);
    }
    let (mut forward_times, mut baseline_times, mut train_times) =
        (Vec::new(), Vec::new(), Vec::new());
    repeat(args, || {
        forward_times.push(time_once(device, &mut forward));
        let first = forward_times.len() % 2 == 1;
        if let Some(baseline) = baseline.as_mut().filter(|_| first) {
            baseline_times.push(time_once(device, baseline));
        }
        let time = time_once(device, &mut train);
        if let Some(baseline) = baseline.as_mut().filter(|_| !first) {
            baseline_times.push(time_once(device, baseline));
        }
        train_times.push(time);
        time
    });
    Stats {
        forward_median: Some(stats(forward_times).median),
        no_dropout_median: (!baseline_times.is_empty()).then(|| stats(baseline_times).median),
        ..stats(train_times)
    }
}

fn clustering(args: &Args) -> ClusteringOptions {
    ClusteringOptions::new(args.clusters)
        .with_bits(args.bits)
        .with_iterations(args.iterations)
}

/// One attention forward pass, with attention dropout `dropout` (in training).
fn attend(
    op: &str,
    args: &Args,
    dropout: f64,
    q: Tensor<4>,
    k: Tensor<4>,
    v: Tensor<4>,
) -> Tensor<4> {
    let clusters = clustering(args);
    let input = AttentionInput::new(q, k, v);
    match op {
        "full" => FullAttention::new().with_dropout(dropout).forward(input),
        "fused" => attention(
            input.queries,
            input.keys,
            input.values,
            None,
            None,
            AttentionModuleOptions::default(),
        ),
        "clustered" => ClusteredAttention::new(args.clusters)
            .with_clustering(clusters)
            .with_dropout(dropout)
            .forward(input),
        "improved" => ImprovedClusteredAttention::new(args.clusters, args.topk)
            .with_clustering(clusters)
            .with_dropout(dropout)
            .forward(input),
        _ => unreachable!(),
    }
}

fn inputs(args: &Args, len: usize, device: &Device) -> [Tensor<4>; 3] {
    let shape = [args.batch, args.heads(), len, args.dim];
    device.seed(0);
    [0, 1, 2].map(|_| {
        Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(args.dtype.dtype())
    })
}

/// Fails unless the backend computes in `--dtype` on `device`.
fn check_dtype(backend: &str, device: &Device, args: &Args) -> Result<()> {
    let dtype = args.dtype.dtype();
    if !device.supports_dtype(dtype) {
        anyhow::bail!(
            "backend {backend} does not support --dtype {} ({dtype:?}) on this device",
            args.dtype.name()
        );
    }
    Ok(())
}

/// What one measurement may use on a backend, and how to read its device memory.
pub struct Limits {
    gpu: bool,
    /// Largest buffer a kernel may bind, in bytes (WebGPU on lavapipe: 128 MiB).
    max_tensor_bytes: Option<f64>,
    memory: Option<DeviceMemory>,
}

/// The memory pools of a CubeCL device.
struct DeviceMemory {
    /// Releases the pages no tensor uses.
    release: Box<dyn Fn()>,
    /// Bytes the pools hold.
    reserved: Box<dyn Fn() -> u64>,
}

impl Limits {
    /// A CPU backend: the budget is the host's memory.
    pub fn host() -> Self {
        Self {
            gpu: false,
            max_tensor_bytes: None,
            memory: None,
        }
    }

    /// The limits of `device`: a CubeCL device's memory and the largest buffer it can bind,
    /// the host's otherwise.
    pub fn of(device: &Device) -> Self {
        match device.as_dispatch() {
            #[cfg(any(feature = "wgpu", feature = "cuda"))]
            burn::backend::DispatchDevice::Cube(device) => Self::cube(device.client()),
            #[allow(unreachable_patterns)]
            _ => Self::host(),
        }
    }

    /// MiB the device's memory pools hold now; `None` off CubeCL devices.
    pub(crate) fn device_reserved_mib(&self) -> Option<f64> {
        self.memory
            .as_ref()
            .map(|memory| (memory.reserved)() as f64 / 1024f64.powi(2))
    }

    /// A CubeCL device, by its compute client.
    #[cfg(any(feature = "wgpu", feature = "cuda"))]
    fn cube(client: cubecl::client::Client) -> Self {
        use cubecl::MemoryScope;
        let (release, reserved) = (client.clone(), client.clone());
        Self {
            gpu: true,
            max_tensor_bytes: Some(client.properties().memory.max_page_size as f64),
            memory: Some(DeviceMemory {
                release: Box::new(move || {
                    // Nothing to release where the device refuses (while it records a graph).
                    let _ = release.memory_cleanup();
                }),
                reserved: Box::new(move || {
                    reserved
                        .memory_report(MemoryScope::Device)
                        .usage()
                        .bytes_reserved
                }),
            }),
        }
    }
}

/// The largest single tensor of one run in bytes (in `--dtype`): the attention matrix of full
/// attention, the `[C, S]` centroid attention of the clustered ones.
fn largest_tensor_bytes(op: &str, args: &Args, gpu: bool, len: usize) -> f64 {
    let (b, h, l) = (args.batch as f64, args.heads() as f64, len as f64);
    let c = args.clusters.min(len) as f64;
    let f = args.dtype.bytes();
    match op {
        "fused" if !fused_materialises(args, gpu, len) => b * h * l * args.dim as f64 * f,
        "full" | "fused" => b * h * l * l * f,
        "clustered" | "improved" => (b * h * c * l * f).max(b * h * l * args.dim as f64 * f),
        _ => b * h * l * args.dim as f64 * f,
    }
}

/// Bytes one measurement may take: `--memory-gib`, or 64 GiB on a GPU, 70 % of the memory
/// available now on the host.
pub(crate) fn memory_budget(args: &Args, gpu: bool) -> f64 {
    let gib = 1024.0 * 1024.0 * 1024.0;
    match args.memory_gib {
        Some(budget) => budget * gib,
        None if gpu => 64.0 * gib,
        None => {
            let mut system = sysinfo::System::new();
            system.refresh_memory();
            0.7 * system.available_memory() as f64
        }
    }
}

/// Measures every selected op at every length, calling `measure` for the ones that fit.
fn run_all(
    backend: &str,
    limits: Limits,
    args: &Args,
    products: ScoreProducts,
    mut measure: impl FnMut(&str, usize) -> Stats,
) -> Vec<Record> {
    eprintln!("{backend}: scores by {products} in {}", args.dtype.name());
    let budget = memory_budget(args, limits.gpu);
    let mut records = Vec::new();
    let mut slow: Vec<(&str, f64)> = Vec::new();
    for &len in &args.lengths {
        for op in selected(args) {
            let flops = flops(op, args, len) * if args.mode == Mode::Train { 3.0 } else { 1.0 };
            let needed = memory_bytes(op, args, limits.gpu, len);
            let mut record = Record {
                backend: backend.to_string(),
                dtype: args.dtype.name(),
                mode: args.mode,
                op: op.to_string(),
                batch: args.batch,
                heads: args.heads(),
                length: len,
                dim: args.dim,
                clusters: args.clusters,
                topk: args.topk,
                bits: args.bits,
                iterations: args.iterations,
                dropout: args.dropout(),
                runs: 0,
                median_s: None,
                min_s: None,
                max_s: None,
                flops,
                gflops_per_s: None,
                peak_device_mib: None,
                peak_rss_mib: None,
                forward_median_s: None,
                no_dropout_median_s: None,
                launches: None,
                forward_launches: None,
                score_products: products.to_string(),
                skipped: None,
            };
            let largest = largest_tensor_bytes(op, args, limits.gpu, len);
            let skip = if needed > budget {
                Some(format!(
                    "needs ~{:.1} GiB, over the {:.1} GiB budget (--memory-gib)",
                    needed / 1024f64.powi(3),
                    budget / 1024f64.powi(3)
                ))
            } else if let Some(max) = limits.max_tensor_bytes.filter(|&max| largest > max) {
                Some(format!(
                    "a {:.0} MiB tensor, over the device's {:.0} MiB buffer limit",
                    largest / 1024f64.powi(2),
                    max / 1024f64.powi(2)
                ))
            } else {
                slow.iter()
                    .find(|(o, _)| *o == op)
                    .map(|(_, t)| format!("a shorter length took {t:.1} s, over --time-limit-s"))
            };
            if let Some(note) = skip {
                eprintln!("{backend:>8} L={len:<6} {op:<15} skipped: {note}");
                record.skipped = Some(note);
            } else {
                if let Some(memory) = &limits.memory {
                    (memory.release)();
                }
                let rss = !limits.gpu && reset_peak_rss();
                let stats = measure(op, len);
                record.peak_rss_mib = if rss { peak_rss_mib() } else { None };
                record.peak_device_mib = limits
                    .memory
                    .as_ref()
                    .map(|memory| (memory.reserved)() as f64 / 1024f64.powi(2));
                eprintln!(
                    "{backend:>8} L={len:<6} {op:<15} median {:.4} s (min {:.4}, max {:.4}){}{}{}{}",
                    stats.median,
                    stats.min,
                    stats.max,
                    stats
                        .forward_median
                        .map(|f| format!(", forward alone {f:.4} s"))
                        .unwrap_or_default(),
                    stats
                        .no_dropout_median
                        .map(|b| format!(", without dropout {b:.4} s"))
                        .unwrap_or_default(),
                    match (stats.launches, stats.forward_launches) {
                        (Some(n), Some(f)) => format!(", {n} kernel launches ({f} forward)"),
                        (Some(n), None) => format!(", {n} kernel launches"),
                        _ => String::new(),
                    },
                    record
                        .peak_device_mib
                        .map(|mib| format!(", device memory {mib:.0} MiB"))
                        .or(record
                            .peak_rss_mib
                            .map(|mib| format!(", peak RSS {mib:.0} MiB")))
                        .unwrap_or_default()
                );
                record.runs = stats.runs;
                record.median_s = Some(stats.median);
                record.min_s = Some(stats.min);
                record.max_s = Some(stats.max);
                record.forward_median_s = stats.forward_median;
                record.no_dropout_median_s = stats.no_dropout_median;
                record.launches = stats.launches;
                record.forward_launches = stats.forward_launches;
                record.gflops_per_s = Some(flops / stats.median / 1e9);
                if stats.median > args.time_limit_s {
                    slow.push((op, stats.median));
                }
            }
            records.push(record);
        }
    }
    records
}

/// `--mode forward`: every op's forward pass.
pub fn run_forward(
    backend: &str,
    device: Device,
    limits: Limits,
    args: &Args,
) -> Result<Vec<Record>> {
    check_dtype(backend, &device, args)?;
    let mut cache: Option<(usize, [Tensor<4>; 3])> = None;
    let gpu = limits.gpu;
    let products = score_products(&device, args.dtype.dtype());
    Ok(run_all(backend, limits, args, products, |op, len| {
        if cache.as_ref().is_none_or(|(l, _)| *l != len) {
            cache = Some((len, inputs(args, len, &device)));
        }
        let [q, k, v] = cache.as_ref().unwrap().1.clone();
        match op {
            "lsh_hash" => {
                let planes = lsh_planes(args.bits, args.dim, true, 0, &device);
                time_and_count(&device, args, gpu, || lsh_hash(q.clone(), planes.clone()))
            }
            "hamming_kmeans" => {
                let planes = lsh_planes(args.bits, args.dim, true, 0, &device);
                let codes = lsh_hash(q, planes);
                time_and_count(&device, args, gpu, || {
                    hamming_kmeans(codes.clone(), None, args.clusters, args.iterations, 0)
                })
            }
            _ => time_and_count(&device, args, gpu, || {
                attend(op, args, 0.0, q.clone(), k.clone(), v.clone())
            }),
        }
    }))
}

/// `--mode train`: forward and backward of `sum(attention(q, k, v))` with respect to q, k, v,
/// each run right after a run of the forward pass alone (inputs not tracked, so no autodiff
/// graph is built) and, with `--dropout` above 0, beside a run of the step without dropout.
pub fn run_train(
    backend: &str,
    device: Device,
    limits: Limits,
    args: &Args,
) -> Result<Vec<Record>> {
    check_dtype(backend, &device, args)?;
    let mut cache: Option<(usize, [Tensor<4>; 3])> = None;
    let gpu = limits.gpu;
    let products = score_products(&device, args.dtype.dtype());
    Ok(run_all(backend, limits, args, products, |op, len| {
        if cache.as_ref().is_none_or(|(l, _)| *l != len) {
            cache = Some((len, inputs(args, len, &device)));
        }
        let [q, k, v] = cache.as_ref().unwrap().1.clone();
        let dropout = args.dropout();
        let mut forward = || attend(op, args, dropout, q.clone(), k.clone(), v.clone());
        let step = |dropout: f64| {
            let [q, k, v] = [&q, &k, &v].map(|x| x.clone().require_grad());
            attend(op, args, dropout, q, k, v).sum().backward()
        };
        let baseline = (dropout > 0.0).then_some(|| step(0.0));
        let stats = time_beside(&device, args, &mut forward, baseline, || step(dropout));
        if !gpu {
            return stats;
        }
        Stats {
            launches: launches::count(&device, || step(dropout)),
            forward_launches: launches::count(&device, forward),
            ..stats
        }
    }))
}

/// Returns the allocator's free pages to the system and resets the process's peak resident set
/// size (Linux: writing 5 to `/proc/self/clear_refs`); false where that is not available.
fn reset_peak_rss() -> bool {
    // SAFETY: `mi_collect` only returns the allocator's free pages to the system.
    unsafe { libmimalloc_sys::mi_collect(true) };
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The process's peak resident set size since the last reset, in MiB (`VmHWM` of
/// `/proc/self/status`).
pub(crate) fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
