//! Cross-backend benchmark of full, clustered and improved clustered attention.
//!
//! The same attention code runs on every compiled backend. Per backend and sequence length it
//! times our full attention, Burn's fused `burn::tensor::module::attention`, clustered and
//! improved clustered attention, and the hashing and K-means ops alone; it prints a markdown
//! table and writes CSV, JSON and an SVG plot under `--out-dir`. `--mode encoder` times a
//! training step of a whole transformer encoder instead, burn-nn's beside this crate's
//! (`encoder.rs`).

/// mimalloc keeps freed pages for reuse: glibc's malloc maps every allocation above 32 MiB
/// fresh and unmaps it on free, so each large intermediate tensor pays its page faults again
/// and the CPU timings grow faster than the work at long sequences. Wrapped so that in the
/// children of `--mode encoder` a failed allocation ends the process with an exit status of its
/// own ([`capped::ExitOnFailure`]).
#[global_allocator]
static GLOBAL: capped::ExitOnFailure<mimalloc::MiMalloc> =
    capped::ExitOnFailure(mimalloc::MiMalloc);

mod backends;
mod capped;
mod encoder;
mod launches;
mod measure;
mod report;

use std::path::PathBuf;

use anyhow::{Result, bail};
use backend_select::BackendName;
use clap::{Parser, ValueEnum};

/// Command-line arguments.
#[derive(Parser, Debug, Clone)]
#[command(about = "Benchmark full, clustered and improved clustered attention across backends")]
pub struct Args {
    /// Backends to run, comma separated: `ndarray`, `flex`, `wgpu`, `vulkan`, `cuda` (Burn's
    /// CubeCL backend on WGPU, Vulkan and CUDA, with fusion); default: every compiled one.
    #[arg(long, value_enum, value_delimiter = ',')]
    pub backends: Vec<BackendName>,
    /// Sequence lengths L = S, comma separated.
    #[arg(long, value_delimiter = ',', default_value = "1024,4096,16384,65536")]
    pub lengths: Vec<usize>,
    /// Batch size.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Attention heads (default: 4; 8 with `--mode encoder`).
    #[arg(long)]
    pub heads: Option<usize>,
    /// Per-head dimension E = D of queries, keys and values.
    #[arg(long, default_value_t = 64)]
    pub dim: usize,
    /// Clusters C.
    #[arg(long, default_value_t = 100)]
    pub clusters: usize,
    /// Keys recomputed exactly per cluster by improved clustered attention.
    #[arg(long, default_value_t = 32)]
    pub topk: usize,
    /// Hash bits.
    #[arg(long, default_value_t = 32)]
    pub bits: usize,
    /// Lloyd iterations.
    #[arg(long, default_value_t = 10)]
    pub iterations: usize,
    /// `--mode encoder`: layers of the encoder.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// `--mode encoder`: the model's width (`d_model`, `heads` times the per-head dimension).
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    /// `--mode encoder`: the feed-forward network's hidden width.
    #[arg(long, default_value_t = 1024)]
    pub d_ff: usize,
    /// Attention dropout, in `[0, 1)`: with `--mode encoder` the encoders' (default 0.1,
    /// burn-nn's), with `--mode train` the attentions' on their weights (default 0; Burn's
    /// `fused` attention, which has none, is left out above 0; above 0, a step without dropout
    /// is timed beside each timed step, before and after it in turn, and the table gives the
    /// time over its median after "dropout"). Refused with `--mode forward`, which does not train.
    #[arg(long)]
    pub dropout: Option<f64>,
    /// Runs one measurement of `--mode encoder` as a child process (the parent starts it).
    #[arg(long, hide = true)]
    pub encoder_child: Option<String>,
    /// `forward` times the forward pass; `train` times forward + backward; `encoder` one
    /// training step of a whole encoder, burn-nn's and this crate's, each in a child process
    /// under `--memory-gib` (then `--only` names encoders: burn-nn, full, clustered, improved,
    /// improved-recompute, the last with every layer recomputed in the backward pass).
    #[arg(long, value_enum, default_value_t = Mode::Forward)]
    pub mode: Mode,
    /// Float type of the queries, keys and values (and so of the whole computation).
    #[arg(long, value_enum, default_value_t = Precision::F32)]
    pub dtype: Precision,
    /// Timed runs per measurement (after the warm-up), at least.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    /// After `--runs` timed runs, keep timing until the timed runs add up to this many
    /// seconds (at most 1000 runs), so that a short measurement's median is of enough runs to
    /// be stable on a busy machine; 0 times exactly `--runs` runs.
    #[arg(long, default_value_t = 1.0)]
    pub min_time_s: f64,
    /// Untimed warm-up runs per measurement.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// Only these attentions/ops (full, fused, clustered, improved, lsh_hash, hamming_kmeans);
    /// with `--mode encoder`, these encoders (burn-nn, full, clustered, improved).
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Memory budget in GiB for one measurement; larger ones are skipped with a note
    /// (default: 70 % of the available RAM for CPU backends, 64 GiB for GPU backends). With
    /// `--mode encoder`, the cap of each child process's data segment (`RLIMIT_DATA`, the
    /// virtual memory it maps for its data, not the peak RSS the table reports; default: 70 %
    /// of the available RAM).
    #[arg(long)]
    pub memory_gib: Option<f64>,
    /// Once a measurement's median exceeds this many seconds, longer lengths of that op are
    /// skipped with a note.
    #[arg(long, default_value_t = 120.0)]
    pub time_limit_s: f64,
    /// Output directory for the CSV, JSON and SVG files.
    #[arg(long, default_value = "bench-results")]
    pub out_dir: PathBuf,
    /// Name of the output files (default: `<mode>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Count the kernel launches of one run of each measurement on the Cube backends (`wgpu`,
    /// `vulkan`, `cuda`), through CubeCL's profiling logger at its
    /// `minimal` level, and print them beside the times. The logger then formats and queues
    /// one line per launch during the timed runs too (no device synchronisation).
    #[arg(long)]
    pub count_launches: bool,
}

/// What is timed.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The forward pass.
    Forward,
    /// Forward and backward passes.
    Train,
    /// One training step (forward, backward, Adam) of an N-layer encoder.
    Encoder,
}

impl Args {
    /// The dropout: `--dropout`, or 0.1 with `--mode encoder` (burn-nn's default) and 0 else.
    pub fn dropout(&self) -> f64 {
        self.dropout
            .unwrap_or(if self.mode == Mode::Encoder { 0.1 } else { 0.0 })
    }

    /// Attention heads: `--heads`, or 4 (8 with `--mode encoder`, as a Burn user's encoder).
    pub fn heads(&self) -> usize {
        self.heads
            .unwrap_or(if self.mode == Mode::Encoder { 8 } else { 4 })
    }
}

/// The float type the attention runs in.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// IEEE single precision.
    F32,
    /// IEEE half precision (11-bit significand).
    F16,
    /// bfloat16 (8-bit significand, the exponent range of f32).
    Bf16,
}

impl Precision {
    /// The Burn dtype.
    pub fn dtype(self) -> burn::tensor::DType {
        match self {
            Self::F32 => burn::tensor::DType::F32,
            Self::F16 => burn::tensor::DType::F16,
            Self::Bf16 => burn::tensor::DType::BF16,
        }
    }

    /// The name in the reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Bf16 => "bf16",
        }
    }

    /// Bytes per element.
    pub fn bytes(self) -> f64 {
        match self {
            Self::F32 => 4.0,
            Self::F16 | Self::Bf16 => 2.0,
        }
    }
}

fn main() -> Result<()> {
    let mut args = Args::parse();
    let compiled = backends::compiled();
    if args.backends.is_empty() {
        args.backends = compiled.clone();
    }
    for backend in &args.backends {
        if !compiled.contains(backend) {
            let names: Vec<&str> = compiled.iter().map(|b| b.name()).collect();
            bail!(
                "backend {backend} is not compiled into this binary (compiled: {}); rebuild with `--features {}`",
                names.join(", "),
                backend.feature()
            );
        }
    }
    if let Some(encoder) = args.encoder_child.clone() {
        return encoder::child(&args, &encoder);
    }
    for op in &args.only {
        if args.mode != Mode::Encoder && !measure::OPS.contains(&op.as_str()) {
            bail!(
                "unknown op {op:?} in --only (known: {})",
                measure::OPS.join(", ")
            );
        }
    }
    if !(args.min_time_s.is_finite() && args.min_time_s >= 0.0) {
        bail!(
            "--min-time-s must be a finite number of seconds, 0 or more, got {}",
            args.min_time_s
        );
    }
    if args.lengths.is_empty() || args.lengths.contains(&0) {
        bail!(
            "--lengths must list positive lengths, got {:?}",
            args.lengths
        );
    }

    if args.count_launches {
        let cube = args
            .backends
            .iter()
            .any(|b| !matches!(b, BackendName::Ndarray | BackendName::Flex));
        if !cube {
            bail!(
                "--count-launches counts the kernels of the Cube backends (wgpu, vulkan, cuda); --backends lists none"
            );
        }
        #[cfg(any(feature = "wgpu", feature = "cuda"))]
        launches::enable()?;
    }
    if !(0.0..1.0).contains(&args.dropout()) {
        bail!("--dropout must be in [0, 1), got {}", args.dropout());
    }
    if args.mode == Mode::Forward && args.dropout.is_some() {
        bail!("--dropout applies in training (--mode train or encoder), not with --mode forward");
    }
    let machine = report::Machine::detect();
    eprintln!("machine: {}", machine.describe());
    if args.mode == Mode::Encoder {
        if args.d_model % args.heads() != 0 {
            bail!(
                "--d-model {} must be a multiple of --heads {}",
                args.d_model,
                args.heads()
            );
        }
        return encoder::run(&args, &machine);
    }
    let mut records = Vec::new();
    for backend in args.backends.clone() {
        records.extend(backends::run(backend, &args)?);
    }
    report::write_all(&args, &machine, &records)
}

#[cfg(all(test, feature = "wgpu"))]
mod tests {
    use burn::tensor::{Device, DeviceKind, Distribution, Tensor};

    use crate::launches;

    /// The launch count on WGPU against kernels known beforehand: one element-wise op is one
    /// kernel, three each followed by a device synchronisation (which executes what Burn's
    /// fusion holds) are three, and the same three in a row are one fused kernel. Then the
    /// launches of an improved clustered forward, against their budget. A result tensor that
    /// is never read still counts (the device is synchronised). This test is the binary's only
    /// one that uses a device: CubeCL's configuration must be set before the first.
    #[test]
    fn launches_are_counted_kernel_by_kernel() {
        launches::enable().unwrap();
        let device = Device::wgpu(DeviceKind::DefaultDevice);
        let x = Tensor::<2>::random([64, 64], Distribution::Default, &device);
        let step = |x: Tensor<2>, i: usize| match i {
            0 => x + 1.0,
            1 => x * 2.0,
            _ => x.exp(),
        };
        let apart = |x: Tensor<2>| {
            (0..3).fold(x, |x, i| {
                let y = step(x, i);
                device.sync().expect("device sync");
                y
            })
        };
        let chain = |x: Tensor<2>| (0..3).fold(x, step);
        // Compiled once before they are counted.
        let _ = launches::count(&device, || (apart(x.clone()), chain(x.clone())));
        let one = launches::count(&device, || x.clone() + 1.0);
        assert_eq!(one, Some(1), "one element-wise op");
        let three = launches::count(&device, || apart(x.clone()));
        assert_eq!(
            three,
            Some(3),
            "three element-wise ops, each executed alone"
        );
        let fused = launches::count(&device, || chain(x.clone()));
        assert_eq!(fused, Some(1), "three element-wise ops fused by Burn");

        // An improved clustered forward at the bench's defaults (4 heads, E = D = 64,
        // C = 100, topk = 32, 32 bits, 10 Lloyd iterations), shorter: 15 launches at most
        // (hashing, the whole Lloyd loop in one, the grouping, the centroid attention, the
        // top-k attention and Burn's own ops around them).
        let [q, k, v] = [1, 2, 3].map(|seed| {
            device.seed(seed);
            Tensor::<4>::random([1, 4, 512, 64], Distribution::Default, &device)
        });
        let improved = || {
            clustered_attention::ImprovedClusteredAttention::new(100, 32).forward(
                clustered_attention::AttentionInput::new(q.clone(), k.clone(), v.clone()),
            )
        };
        let _ = launches::count(&device, improved);
        let launches = launches::count(&device, improved).unwrap();
        assert!(
            launches <= 15,
            "an improved forward took {launches} kernel launches, over 15"
        );
    }
}
