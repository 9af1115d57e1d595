//! `asr train`: train a model on a corpus, then print its test phone error rate.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use asr_model::augment::{AugmentSet, Augmentation};
use asr_model::ctc::CtcLossImpl;
use asr_model::data::{load_corpus, load_split, mix};
use asr_model::features::{LogMel, LogMelConfig};
use asr_model::model::{Activation, AsrModelConfig, FrontEnd, check_inter_ctc_weight};
use asr_model::phones::PhoneInventory;
use asr_model::train::{
    SavedModel, Strategy, TrainOptions, check_output_dir, evaluate, feasible, train_on_devices,
};
use backend_select::BackendName;
use burn::tensor::Device;
use clap::Args;
use clustered_attention::AttentionKind;

/// Arguments of `asr train`.
#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Corpus directory (phones.txt, train/dev/test.jsonl). Repeat it to train on a mix: the
    /// phone inventories must agree, dev is the union of the dev splits, and each corpus's
    /// test split is scored on its own.
    #[arg(long, default_value = "data/corpus")]
    corpus: Vec<PathBuf>,
    /// Sampling weight of each --corpus, in order (default 1 each): an epoch takes each of the
    /// corpus's training utterances ⌊w⌋ times, plus a random fraction w − ⌊w⌋ of them once
    /// more (see `asr_model::data::mix`).
    #[arg(long = "weight")]
    weights: Vec<f64>,
    /// Output directory: checkpoints, logs, the final model.
    #[arg(long, default_value = "runs/improved")]
    out: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    pub backend: BackendName,
    /// Devices to train on, data-parallel: `cpu:N` (N workers on the CPU backends, flex or
    /// ndarray, whose one device is the whole machine), or `cuda:I,J,…` / `wgpu:I,J,…` (device
    /// indices of the GPU backends). Each device trains on its own batch; the optimizer steps
    /// on the mean of their gradients.
    #[arg(long, default_value = "cpu:1", value_parser = parse_devices)]
    devices: DeviceSpec,
    /// How the devices share the work: `multi` (burn-train's multi-device strategy, any
    /// backend) or `ddp` (distributed data parallel over NCCL: CUDA devices, in a build with
    /// the `ddp` feature).
    #[arg(long, value_enum, default_value = "multi")]
    strategy: Strategy,
    /// Attention: full, clustered:C, improved:C:K, shared-full, lsh:X or oracle:K.
    #[arg(long, default_value = "improved:16:16")]
    attention: AttentionKind,
    /// Last epoch.
    #[arg(long, default_value_t = 40)]
    epochs: usize,
    /// Peak learning rate (Adam).
    #[arg(long, default_value_t = 2e-3)]
    learning_rate: f64,
    /// Linear warm-up steps.
    #[arg(long, default_value_t = 200)]
    warmup_steps: usize,
    /// Learning rate at the last step: the rate then falls linearly over the run, from the
    /// peak (within the warm-up, its ramp) at the first step to this at the last step of
    /// --epochs (default: no decay).
    #[arg(long)]
    final_learning_rate: Option<f64>,
    /// Largest gradient L2 norm per parameter.
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f32,
    /// Padded frames per batch (length-bucketed batches).
    #[arg(long, default_value_t = 6000)]
    batch_frames: usize,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    n_heads: usize,
    /// Encoder layers.
    #[arg(long, default_value_t = 4)]
    n_layers: usize,
    /// Feed-forward hidden size.
    #[arg(long, default_value_t = 512)]
    d_ff: usize,
    /// Dropout probability.
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
    /// Time subsampling (1, 2 or 4 frames per encoder step).
    #[arg(long, default_value_t = 4)]
    subsampling: usize,
    /// How frames become encoder steps: `stack` (frame stacking and a linear projection) or
    /// `conv:C` (two 1-D convolutions over time with C channels; see
    /// `asr_model::model::FrontEnd`).
    #[arg(long, default_value = "stack")]
    front_end: FrontEnd,
    /// Activation of the feed-forward blocks and the convolutional front end: gelu, relu or
    /// silu.
    #[arg(long, default_value = "gelu")]
    activation: Activation,
    /// Kernel size of a Conformer convolution module in every layer (odd; 0 for none; see
    /// `asr_model::model::ConvModule`).
    #[arg(long, default_value_t = 0)]
    conv_kernel: usize,
    /// Weight w in [0, 1) of an intermediate CTC loss on the middle layer's output: the
    /// training loss is (1 − w)·CTC(last layer) + w·CTC(middle layer) (Lee and Watanabe,
    /// 2021); 0 for none.
    #[arg(long, default_value_t = 0.0)]
    inter_ctc: f64,
    /// Implementation of the CTC loss: `burn` (burn-nn's `CTCLoss`) or `alpha-beta` (the
    /// recursions on the host with the gradient in closed form, `asr_model::ctc`; the same
    /// loss, far cheaper on long utterances).
    #[arg(long, default_value = "alpha-beta")]
    ctc_loss: CtcLossImpl,
    /// Mel bands.
    #[arg(long, default_value_t = 40)]
    n_mels: usize,
    /// Seed of the weights, the hashing planes and the batch order.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Continue from the last checkpoint in --out.
    #[arg(long)]
    resume: bool,
    /// Interrupt after this many training steps (to try --resume).
    #[arg(long)]
    stop_after_steps: Option<usize>,
    /// Stop once the run has trained this many minutes of wall-clock time (training and
    /// validation; over every sitting of a resumed run), at the next batch, and measure the
    /// final model's dev phone error rate, so that models compare at equal compute (the
    /// paper's Figure 1). --epochs still bounds the run.
    #[arg(long, value_parser = parse_minutes)]
    time_budget: Option<f64>,
    /// Training-time augmentation: `all`, `none`, or a comma-separated list of speed, reverb,
    /// band, noise, quantize, specaugment.
    #[arg(long, default_value = "all", value_parser = parse_augment)]
    augment: AugmentSet,
    /// Upper edge of the mel filterbank in Hz (default: 8000, the Nyquist frequency).
    #[arg(long)]
    f_max_hz: Option<f64>,
    /// Further test manifests (e.g. real recordings) evaluated after training, beside the
    /// corpus's test split; their phones must be in the corpus's inventory.
    #[arg(long = "also-test")]
    also_test: Vec<PathBuf>,
}

/// The devices of `--devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// `cpu:N`: N workers on the CPU backends' one device.
    Cpu(usize),
    /// `cuda:…` or `wgpu:…`: the runtime's name and the device indices.
    Gpu(String, Vec<usize>),
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu(n) => write!(f, "cpu:{n}"),
            DeviceSpec::Gpu(kind, ids) => {
                let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
                write!(f, "{kind}:{}", ids.join(","))
            }
        }
    }
}

fn parse_devices(s: &str) -> Result<DeviceSpec, String> {
    let (kind, list) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected cpu:N, cuda:I,J,… or wgpu:I,J,…"))?;
    let numbers = list
        .split(',')
        .map(|n| n.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{s:?}: {e}"))?;
    match kind {
        "cpu" if numbers.len() == 1 && numbers[0] > 0 => Ok(DeviceSpec::Cpu(numbers[0])),
        "cpu" => Err(format!("{s:?}: cpu:N takes one number of workers, N ≥ 1")),
        "cuda" | "wgpu" => {
            let mut unique = numbers.clone();
            unique.sort_unstable();
            unique.dedup();
            if unique.len() != numbers.len() {
                return Err(format!("{s:?}: a device is listed twice"));
            }
            if let Some(n) = numbers.iter().find(|&&n| n > u16::MAX as usize) {
                return Err(format!("{s:?}: device index {n} is too large"));
            }
            Ok(DeviceSpec::Gpu(kind.to_string(), numbers))
        }
        other => Err(format!(
            "{s:?}: unknown device kind {other:?} (cpu, cuda or wgpu)"
        )),
    }
}

impl DeviceSpec {
    /// The devices of backend `backend` whose default device is `default`.
    ///
    /// # Errors
    /// When the kind does not match the backend (`cpu:` for flex and ndarray, `cuda:` for the
    /// CUDA backend, `wgpu:` for the WGPU and Vulkan ones).
    pub fn devices(&self, backend: BackendName, default: &Device) -> anyhow::Result<Vec<Device>> {
        let kind = match backend {
            BackendName::Flex | BackendName::Ndarray => "cpu",
            BackendName::Cuda => "cuda",
            _ => "wgpu",
        };
        match self {
            DeviceSpec::Cpu(n) if kind == "cpu" => Ok(vec![default.clone(); *n]),
            DeviceSpec::Gpu(k, ids) if *k == kind => Ok(ids
                .iter()
                .map(|&i| gpu_device(backend, i, default))
                .collect()),
            _ => anyhow::bail!(
                "--devices {self} does not fit --backend {}: use {kind}:…",
                backend.name()
            ),
        }
    }
}

/// GPU `index` of `backend`, with autodiff when `default` has it: CUDA device `index`; for
/// WGPU and Vulkan, `default` whatever the index, as Burn 0.21 read an index of WGPU's default
/// device (its kind kept, the index ignored).
fn gpu_device(backend: BackendName, index: usize, default: &Device) -> Device {
    #[cfg(feature = "cuda")]
    {
        if backend == BackendName::Cuda {
            let device = Device::cuda(index);
            return if default.is_autodiff() {
                device.autodiff()
            } else {
                device
            };
        }
    }
    let _ = (backend, index);
    default.clone()
}

fn parse_minutes(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(m) if m.is_finite() && m > 0.0 => Ok(m),
        _ => Err(format!("{s:?}: expected a positive number of minutes")),
    }
}

fn parse_augment(s: &str) -> Result<AugmentSet, String> {
    match s {
        "all" => Ok(AugmentSet::new(&Augmentation::ALL)),
        "none" => Ok(AugmentSet::default()),
        list => Ok(AugmentSet::new(
            &list
                .split(',')
                .map(|a| a.trim().parse())
                .collect::<Result<Vec<Augmentation>, _>>()?,
        )),
    }
}

/// Trains on `device` (with autodiff), then prints the test phone error rates.
pub fn run(args: &TrainArgs, backend: BackendName, device: Device) -> anyhow::Result<()> {
    let start = Instant::now();
    let devices = args.devices.devices(backend, &device)?;
    if args.strategy == Strategy::Ddp
        && !matches!(args.devices, DeviceSpec::Gpu(ref k, _) if k == "cuda")
    {
        anyhow::bail!(
            "--strategy ddp with --devices {}: DDP runs on CUDA devices only (its all-reduce \
             is NCCL's); use --strategy multi",
            args.devices
        );
    }
    let features = LogMelConfig::new()
        .with_n_mels(args.n_mels)
        .with_f_max_hz(args.f_max_hz);
    let log_mel = LogMel::new(features.clone());
    if !args.weights.is_empty() && args.weights.len() != args.corpus.len() {
        anyhow::bail!(
            "--weight: {} weight(s) for {} --corpus; give one per corpus, in order, or none",
            args.weights.len(),
            args.corpus.len()
        );
    }
    if let Some(w) = args.weights.iter().find(|w| !(w.is_finite() && **w >= 0.0)) {
        anyhow::bail!("--weight {w}: a sampling weight must be finite and ≥ 0");
    }
    check_inter_ctc_weight(args.inter_ctc, args.n_layers)
        .map_err(|message| anyhow::anyhow!("--inter-ctc (with --n-layers) {message}"))?;
    check_output_dir(&args.out).context("--out")?;
    let mut inventory: Option<PhoneInventory> = None;
    let (mut mixed, mut dev, mut tests) = (Vec::new(), Vec::new(), Vec::new());
    let mut dropped = 0;
    for (i, corpus) in args.corpus.iter().enumerate() {
        let (corpus_inventory, mut splits) = load_corpus(
            corpus,
            &log_mel,
            &["train", "dev", "test"],
            args.augment.alters_waveform(),
        )?;
        match &inventory {
            Some(first) if *first != corpus_inventory => anyhow::bail!(
                "--corpus {}: its phones.txt differs from that of --corpus {}; a mix needs one inventory",
                corpus.display(),
                args.corpus[0].display()
            ),
            Some(_) => {}
            None => inventory = Some(corpus_inventory),
        }
        let test = splits.pop().expect("three splits");
        let corpus_dev = splits.pop().expect("three splits");
        let (corpus_train, corpus_dropped) =
            feasible(splits.pop().expect("three splits"), args.subsampling);
        dropped += corpus_dropped;
        let weight = args.weights.get(i).copied().unwrap_or(1.0);
        eprintln!(
            "corpus {}: {} train (weight {weight}), {} dev, {} test utterances",
            corpus.display(),
            corpus_train.len(),
            corpus_dev.len(),
            test.len(),
        );
        mixed.push((corpus_train, weight));
        dev.extend(corpus_dev);
        tests.push((corpus.join("test.jsonl"), test));
    }
    let inventory = inventory.expect("clap gives at least one corpus");
    let mut also_test = Vec::new();
    for manifest in &args.also_test {
        also_test.push(load_split(manifest, &inventory, &log_mel)?);
    }
    if dropped > 0 {
        eprintln!(
            "note: {dropped} training utterance(s) have more labels than encoder steps at subsampling {} and are left out",
            args.subsampling
        );
    }
    let train_split = mix(mixed, args.seed);
    eprintln!(
        "training on {} utterances per epoch, validating on {}; features in {:.1} s",
        train_split.len(),
        dev.len(),
        start.elapsed().as_secs_f64()
    );
    let saved = SavedModel {
        model: AsrModelConfig::new(inventory.n_outputs())
            .with_n_mels(args.n_mels)
            .with_d_model(args.d_model)
            .with_n_heads(args.n_heads)
            .with_n_layers(args.n_layers)
            .with_d_ff(args.d_ff)
            .with_dropout(args.dropout)
            .with_attention(args.attention)
            .with_subsampling(args.subsampling)
            .with_front_end(args.front_end)
            .with_conv_kernel(args.conv_kernel)
            .with_activation(args.activation)
            .with_inter_ctc_weight(args.inter_ctc)
            .with_ctc_loss(args.ctc_loss)
            .with_seed(args.seed),
        features,
        phones: inventory.phones().to_vec(),
    };
    let options = TrainOptions {
        dir: args.out.clone(),
        epochs: args.epochs,
        learning_rate: args.learning_rate,
        warmup_steps: args.warmup_steps,
        final_learning_rate: args.final_learning_rate,
        grad_clip: args.grad_clip,
        batch_frames: args.batch_frames,
        seed: args.seed,
        shuffle: true,
        resume: args.resume,
        stop_after_steps: args.stop_after_steps,
        time_budget_s: args.time_budget.map(|minutes| minutes * 60.0),
        application_log: true,
        augment: args.augment.clone(),
        strategy: args.strategy,
    };
    let model = train_on_devices(&saved, train_split, dev, &options, &devices)?;
    // The trained model has no autodiff; it is evaluated without.
    let device = device.inner();
    for (manifest, test) in &tests {
        let per = evaluate(&model, test, None, args.batch_frames, &device);
        println!(
            "test PER on {}: {:.2} % ({} errors / {} phones, {} utterances, attention {})",
            manifest.display(),
            per.percent(),
            per.errors,
            per.reference_phones,
            test.len(),
            args.attention,
        );
    }
    for (manifest, examples) in args.also_test.iter().zip(&also_test) {
        let per = evaluate(&model, examples, None, args.batch_frames, &device);
        println!(
            "test PER on {}: {:.2} % ({} errors / {} phones, {} utterances)",
            manifest.display(),
            per.percent(),
            per.errors,
            per.reference_phones,
            examples.len()
        );
    }
    println!(
        "model: {}; wall time {:.0} s",
        args.out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
