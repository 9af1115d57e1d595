//! `asr`: generate the corpus, train, evaluate and transcribe.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use burn::backend::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use clap::{Args, Parser, Subcommand, ValueEnum};
use clustered_attention::{AttentionKind, ClusteringBackend};

use asr_model::audio::load_audio;
use asr_model::augment::{AugmentSet, Augmentation};
use asr_model::compare::{ModelSummary, forward_ms_per_utterance, markdown_table, plot};
use asr_model::corpus::{CorpusOptions, generate};
use asr_model::data::{CtcBatcher, Example, load_split};
use asr_model::features::{LogMel, LogMelConfig};
use asr_model::import::{ImportOptions, Source, import};
use asr_model::model::AsrModelConfig;
use asr_model::phones::PhoneInventory;
use asr_model::train::{
    SavedModel, TRAINING_LOG, TrainOptions, TrainingLog, evaluate, feasible, load_model, train,
};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "CTC phone recognition with full, clustered or improved clustered attention"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Synthesize a corpus with espeak-ng (and flite, when installed).
    Corpus(CorpusArgs),
    /// Build a corpus split (JSONL manifest + phones.txt) from recordings and transcripts:
    /// a LibriSpeech tree, a Kaldi data directory or a TSV.
    Manifest(ManifestArgs),
    /// Train a model on a corpus; prints the test phone error rate.
    Train(TrainArgs),
    /// Evaluate trained models, with their own or another attention (paper Table 1).
    Eval(EvalArgs),
    /// Compare trained models (paper Table 2 and Figure 1): time per epoch, time to the best
    /// dev PER, test PER, forward time per utterance; an SVG of dev PER against forward time.
    Compare(CompareArgs),
    /// Print the phones recognized in one audio file (WAV or FLAC, any sample rate).
    Transcribe(TranscribeArgs),
    /// Time training steps (forward + backward + Adam) of the default model on random
    /// features, per attention (a benchmark; the paper's Figure 2 setting is 800 frames).
    StepTime(StepTimeArgs),
}

#[derive(Args, Debug)]
struct StepTimeArgs {
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
    /// Attentions to time, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,clustered:100,improved:100:32"
    )]
    attention: Vec<AttentionKind>,
    /// Frames per utterance.
    #[arg(long, default_value_t = 800)]
    frames: usize,
    /// Utterances per batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Time subsampling (1 = none, as in the paper).
    #[arg(long, default_value_t = 1)]
    subsampling: usize,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum BackendName {
    /// Burn's NdArray CPU backend.
    Ndarray,
    /// Burn's Flex CPU backend.
    Flex,
    /// WGPU (Vulkan, Metal or DX12; lavapipe without a GPU).
    Wgpu,
    /// WGPU through Vulkan with SPIR-V kernels.
    Vulkan,
    /// CUDA.
    Cuda,
}

#[derive(Args, Debug)]
struct CorpusArgs {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Hours of audio over all splits.
    #[arg(long, default_value_t = 1.0)]
    hours: f64,
    /// Share of the audio in dev and in test, each.
    #[arg(long, default_value_t = 0.1)]
    held_out_fraction: f64,
    /// Plain-text source, one sentence or verse per line.
    #[arg(long, default_value = "data/text/kjv-pentateuch.txt")]
    text: PathBuf,
    /// Licence of the text source, recorded in the corpus README.
    #[arg(
        long,
        default_value = "public domain (King James Version, 1611; Crown copyright applies in the UK only)"
    )]
    licence: String,
    /// Seed of the voice, speed and pitch choices.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bits per FLAC sample.
    #[arg(long, default_value_t = 16)]
    bits_per_sample: usize,
    /// Longest phrase, in words.
    #[arg(long, default_value_t = 12)]
    max_words: usize,
    /// Shortest utterance, in seconds: consecutive phrases are joined (one voice, 0.25 s
    /// pauses) until an utterance lasts this long; 0 keeps one phrase per utterance.
    #[arg(long, default_value_t = 0.0)]
    min_seconds: f64,
}

#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).multiple(false)))]
struct ManifestArgs {
    /// LibriSpeech-style tree: `*.trans.txt` beside the audio files.
    #[arg(long, group = "source")]
    librispeech: Option<PathBuf>,
    /// Kaldi-style data directory with `wav.scp`, `text` and optionally `utt2spk`.
    #[arg(long, group = "source")]
    kaldi: Option<PathBuf>,
    /// TSV file: `path<TAB>transcript[<TAB>speaker]` per line.
    #[arg(long, group = "source")]
    tsv: Option<PathBuf>,
    /// Corpus directory to write `<split>.jsonl` and `phones.txt` into.
    #[arg(long)]
    out: PathBuf,
    /// Split name.
    #[arg(long)]
    split: String,
    /// espeak-ng voice whose phonemizer labels the transcripts.
    #[arg(long, default_value = "en-us")]
    accent: String,
    /// Write the usable utterances and report the others instead of failing.
    #[arg(long)]
    skip_bad: bool,
}

#[derive(Args, Debug)]
struct TrainArgs {
    /// Corpus directory (phones.txt, train/dev/test.jsonl).
    #[arg(long, default_value = "data/corpus")]
    corpus: PathBuf,
    /// Output directory: checkpoints, logs, the final model.
    #[arg(long, default_value = "runs/improved")]
    out: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
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
    /// Time subsampling by frame stacking (1, 2 or 4).
    #[arg(long, default_value_t = 4)]
    subsampling: usize,
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

#[derive(Args, Debug)]
struct EvalArgs {
    /// Trained model directories (each with model.json and model.mpk).
    #[arg(long = "model", required = true)]
    models: Vec<PathBuf>,
    /// Corpus directory.
    #[arg(long, default_value = "data/corpus")]
    corpus: PathBuf,
    /// Split to evaluate.
    #[arg(long, default_value = "test")]
    split: String,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
    /// Evaluate with this attention instead of the trained one.
    #[arg(long)]
    attention: Option<AttentionKind>,
    /// Print the paper's Table 1: every model (columns, trained with) evaluated with full,
    /// shared-full, lsh:1, lsh:4, clustered:C, clustered:2C, improved:C:K, improved:2C:K and
    /// oracle:K (rows); shared-QK rows are left empty (–) for models not trained shared-QK.
    #[arg(long)]
    table: bool,
    /// Clusters C of the table (default: the mean number of encoder steps / 8).
    #[arg(long)]
    clusters: Option<usize>,
    /// Top keys K of the table's improved and oracle-top attention.
    #[arg(long, default_value_t = 32)]
    topk: usize,
    /// Padded frames per batch.
    #[arg(long, default_value_t = 6000)]
    batch_frames: usize,
}

#[derive(Args, Debug)]
struct CompareArgs {
    /// Trained model directories (each with model.json, model.mpk and training.json).
    #[arg(long = "model", required = true)]
    models: Vec<PathBuf>,
    /// Corpus directory (its dev split is timed, its test split scored).
    #[arg(long, default_value = "data/corpus")]
    corpus: PathBuf,
    /// Backend of the forward-time measurement and the test PER.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
    /// Padded frames per batch.
    #[arg(long, default_value_t = 6000)]
    batch_frames: usize,
    /// Write the plot of best dev PER against forward time here (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Title of the plot.
    #[arg(long, default_value = "dev PER against forward time")]
    caption: String,
}

#[derive(Args, Debug)]
struct TranscribeArgs {
    /// Trained model directory.
    #[arg(long)]
    model: PathBuf,
    /// Audio file.
    file: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
}

/// Runs `$body` with `$B` bound to the chosen (autodiff) backend type and `$device` to its
/// default device.
macro_rules! with_backend {
    ($name:expr, $B:ident, $device:ident, $body:expr) => {
        match $name {
            #[cfg(feature = "ndarray")]
            BackendName::Ndarray => {
                type $B = Autodiff<burn::backend::NdArray>;
                let $device = Default::default();
                $body
            }
            #[cfg(feature = "flex")]
            BackendName::Flex => {
                type $B = Autodiff<burn::backend::Flex>;
                let $device = Default::default();
                $body
            }
            #[cfg(feature = "wgpu")]
            BackendName::Wgpu => {
                type $B = Autodiff<burn::backend::Wgpu>;
                let $device = Default::default();
                $body
            }
            #[cfg(feature = "vulkan")]
            BackendName::Vulkan => {
                type $B = Autodiff<burn::backend::Vulkan>;
                let $device = Default::default();
                $body
            }
            #[cfg(feature = "cuda")]
            BackendName::Cuda => {
                type $B = Autodiff<burn::backend::Cuda>;
                let $device = Default::default();
                $body
            }
            #[allow(unreachable_patterns)]
            other => bail!(
                "backend {other:?} is not compiled in: rebuild with `--features {}`",
                format!("{other:?}").to_lowercase()
            ),
        }
    };
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Corpus(args) => generate(&CorpusOptions {
            out: args.out,
            hours: args.hours,
            held_out_fraction: args.held_out_fraction,
            text: args.text,
            text_licence: args.licence,
            seed: args.seed,
            bits_per_sample: args.bits_per_sample,
            max_words: args.max_words,
            min_seconds: args.min_seconds,
        }),
        Command::Manifest(args) => {
            let source = match (args.librispeech, args.kaldi, args.tsv) {
                (Some(dir), None, None) => Source::LibriSpeech(dir),
                (None, Some(dir), None) => Source::Kaldi(dir),
                (None, None, Some(file)) => Source::Tsv(file),
                _ => unreachable!("clap requires exactly one source"),
            };
            let report = import(&ImportOptions {
                source,
                out: args.out,
                split: args.split,
                accent: args.accent,
                skip_bad: args.skip_bad,
            })?;
            for problem in &report.skipped {
                eprintln!("skipped: {problem}");
            }
            println!(
                "{}: {} utterances, {:.1} min{}",
                report.manifest.display(),
                report.utterances,
                report.seconds / 60.0,
                if report.skipped.is_empty() {
                    String::new()
                } else {
                    format!(", {} skipped", report.skipped.len())
                }
            );
            Ok(())
        }
        Command::Train(args) => {
            with_backend!(args.backend, B, device, run_train::<B>(&args, &device))
        }
        Command::Eval(args) => with_backend!(
            args.backend,
            B,
            device,
            run_eval::<<B as AutodiffBackend>::InnerBackend>(&args, &device)
        ),
        Command::StepTime(args) => {
            with_backend!(args.backend, B, device, run_step_time::<B>(&args, &device))
        }
        Command::Compare(args) => with_backend!(
            args.backend,
            B,
            device,
            run_compare::<<B as AutodiffBackend>::InnerBackend>(&args, &device)
        ),
        Command::Transcribe(args) => with_backend!(
            args.backend,
            B,
            device,
            run_transcribe::<<B as AutodiffBackend>::InnerBackend>(&args, &device)
        ),
    }
}

/// Reads the corpus's inventory and validates all three manifests (every problem at once)
/// before computing any feature.
fn load_corpus(
    corpus: &Path,
    log_mel: &LogMel,
    splits: &[&str],
    keep_train_audio: bool,
) -> anyhow::Result<(PhoneInventory, Vec<Vec<Example>>)> {
    let inventory = PhoneInventory::load(&corpus.join("phones.txt")).map_err(anyhow::Error::msg)?;
    let mut problems = Vec::new();
    let mut manifests = Vec::new();
    for split in splits {
        let path = corpus.join(format!("{split}.jsonl"));
        match asr_model::manifest::read_manifest(&path, &inventory, true) {
            Ok(utterances) => manifests.push(utterances),
            Err(e) => problems.push(e.to_string()),
        }
    }
    if !problems.is_empty() {
        bail!("the corpus is not usable:\n{}", problems.join("\n"));
    }
    let examples = splits
        .iter()
        .zip(&manifests)
        .map(|(split, u)| {
            asr_model::data::featurize(u, log_mel, keep_train_audio && *split == "train")
        })
        .collect();
    Ok((inventory, examples))
}

fn run_train<B: AutodiffBackend + ClusteringBackend>(
    args: &TrainArgs,
    device: &B::Device,
) -> anyhow::Result<()>
where
    B::InnerBackend: ClusteringBackend,
{
    let start = Instant::now();
    let features = LogMelConfig::new()
        .with_n_mels(args.n_mels)
        .with_f_max_hz(args.f_max_hz);
    let log_mel = LogMel::new(features.clone());
    let (inventory, mut splits) = load_corpus(
        &args.corpus,
        &log_mel,
        &["train", "dev", "test"],
        args.augment.alters_waveform(),
    )?;
    let mut also_test = Vec::new();
    for manifest in &args.also_test {
        also_test.push(load_split(manifest, &inventory, &log_mel)?);
    }
    let test = splits.pop().expect("three splits");
    let dev = splits.pop().expect("three splits");
    let train_split = splits.pop().expect("three splits");
    let (train_split, dropped) = feasible(train_split, args.subsampling);
    if dropped > 0 {
        eprintln!(
            "note: {dropped} training utterance(s) have more labels than encoder steps at subsampling {} and are left out",
            args.subsampling
        );
    }
    eprintln!(
        "corpus {}: {} train, {} dev, {} test utterances; features in {:.1} s",
        args.corpus.display(),
        train_split.len(),
        dev.len(),
        test.len(),
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
            .with_seed(args.seed),
        features,
        phones: inventory.phones().to_vec(),
    };
    let options = TrainOptions {
        dir: args.out.clone(),
        epochs: args.epochs,
        learning_rate: args.learning_rate,
        warmup_steps: args.warmup_steps,
        grad_clip: args.grad_clip,
        batch_frames: args.batch_frames,
        seed: args.seed,
        shuffle: true,
        resume: args.resume,
        stop_after_steps: args.stop_after_steps,
        application_log: true,
        augment: args.augment.clone(),
    };
    let model = train::<B>(&saved, train_split, dev, &options, device)?;
    let per = evaluate(&model, &test, None, args.batch_frames, device);
    println!(
        "test PER: {:.2} % ({} errors / {} phones, {} utterances, attention {}); model: {}; wall time {:.0} s",
        per.percent(),
        per.errors,
        per.reference_phones,
        test.len(),
        args.attention,
        args.out.display(),
        start.elapsed().as_secs_f64()
    );
    for (manifest, examples) in args.also_test.iter().zip(&also_test) {
        let per = evaluate(&model, examples, None, args.batch_frames, device);
        println!(
            "test PER on {}: {:.2} % ({} errors / {} phones, {} utterances)",
            manifest.display(),
            per.percent(),
            per.errors,
            per.reference_phones,
            examples.len()
        );
    }
    Ok(())
}

fn run_eval<B: ClusteringBackend>(args: &EvalArgs, device: &B::Device) -> anyhow::Result<()> {
    let mut loaded = Vec::new();
    for dir in &args.models {
        loaded.push(load_model::<B>(dir, device)?);
    }
    let log_mel = LogMel::new(loaded[0].1.features.clone());
    let inventory =
        PhoneInventory::load(&args.corpus.join("phones.txt")).map_err(anyhow::Error::msg)?;
    let examples = load_split(
        &args.corpus.join(format!("{}.jsonl", args.split)),
        &inventory,
        &log_mel,
    )?;
    for (dir, (_, saved)) in args.models.iter().zip(&loaded) {
        if saved.phones != inventory.phones() {
            bail!(
                "{}: the model's phone inventory differs from {}",
                dir.display(),
                args.corpus.display()
            );
        }
    }
    let steps: f64 = examples
        .iter()
        .map(|e| e.features.frames.div_ceil(loaded[0].1.model.subsampling) as f64)
        .sum::<f64>()
        / examples.len() as f64;
    let clusters = args
        .clusters
        .unwrap_or(((steps / 8.0).round() as usize).max(1));
    if !args.table {
        println!(
            "PER (%) on {} ({} utterances, mean {:.0} encoder steps)",
            args.split,
            examples.len(),
            steps
        );
        println!("| model | trained with | evaluated with | PER |\n|---|---|---|---:|");
        for (dir, (model, saved)) in args.models.iter().zip(&loaded) {
            let kind = args.attention.unwrap_or(saved.model.attention);
            let per = evaluate(model, &examples, Some(kind), args.batch_frames, device);
            println!(
                "| {} | {} | {kind} | {:.2} |",
                dir.display(),
                saved.model.attention,
                per.percent()
            );
        }
        return Ok(());
    }
    let topk = args.topk;
    let rows = [
        AttentionKind::Full,
        AttentionKind::SharedFull,
        "lsh:1".parse()?,
        "lsh:4".parse()?,
        AttentionKind::Clustered { clusters },
        AttentionKind::Clustered {
            clusters: 2 * clusters,
        },
        AttentionKind::Improved { clusters, topk },
        AttentionKind::Improved {
            clusters: 2 * clusters,
            topk,
        },
        AttentionKind::OracleTop { topk },
    ];
    println!(
        "PER (%) on {} ({} utterances, mean {:.0} encoder steps, C = {clusters}, K = {topk}); columns: trained with, rows: evaluated with",
        args.split,
        examples.len(),
        steps
    );
    let header: Vec<String> = loaded
        .iter()
        .map(|(_, saved)| saved.model.attention.to_string())
        .collect();
    println!("| evaluated with | {} |", header.join(" | "));
    println!("|---|{}", "---:|".repeat(loaded.len()));
    for kind in rows {
        let cells: Vec<String> = loaded
            .iter()
            .map(|(model, _)| {
                if kind.is_shared_qk() && !model.shared_qk() {
                    "–".to_string()
                } else {
                    let per = evaluate(model, &examples, Some(kind), args.batch_frames, device);
                    format!("{:.2}", per.percent())
                }
            })
            .collect();
        println!("| {kind} | {} |", cells.join(" | "));
    }
    Ok(())
}

fn run_compare<B: ClusteringBackend>(args: &CompareArgs, device: &B::Device) -> anyhow::Result<()> {
    let mut rows = Vec::new();
    let mut loaded_splits = None;
    for dir in &args.models {
        let (model, saved) = load_model::<B>(dir, device)?;
        let log_path = dir.join(TRAINING_LOG);
        let text = std::fs::read_to_string(&log_path).with_context(|| {
            format!(
                "{}: cannot read (train the model first)",
                log_path.display()
            )
        })?;
        let log: TrainingLog = serde_json::from_str(&text)
            .with_context(|| format!("{}: malformed", log_path.display()))?;
        if loaded_splits.is_none() {
            let log_mel = LogMel::new(saved.features.clone());
            loaded_splits = Some(load_corpus(
                &args.corpus,
                &log_mel,
                &["dev", "test"],
                false,
            )?);
        }
        let (inventory, splits) = loaded_splits.as_ref().expect("loaded above");
        if saved.phones != inventory.phones() {
            bail!(
                "{}: the model's phone inventory differs from {}",
                dir.display(),
                args.corpus.display()
            );
        }
        let (dev, test) = (&splits[0], &splits[1]);
        // One untimed pass first: kernels, caches and allocations warm up.
        forward_ms_per_utterance(&model, &dev[..dev.len().min(4)], args.batch_frames, device);
        let forward_ms = forward_ms_per_utterance(&model, dev, args.batch_frames, device);
        let test_per = evaluate(&model, test, None, args.batch_frames, device).percent();
        rows.push(ModelSummary::new(dir, &log, test_per, forward_ms)?);
    }
    print!("{}", markdown_table(&rows));
    if let Some(path) = &args.svg {
        plot(path, &rows, &args.caption)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

fn run_transcribe<B: ClusteringBackend>(
    args: &TranscribeArgs,
    device: &B::Device,
) -> anyhow::Result<()> {
    let (model, saved) = load_model::<B>(&args.model, device)?;
    let log_mel = LogMel::new(saved.features.clone());
    let samples = load_audio(&args.file)?;
    if samples.is_empty() {
        bail!("{}: the audio is empty", args.file.display());
    }
    let example = Example {
        id: args.file.display().to_string(),
        features: std::sync::Arc::new(log_mel.features(&samples)),
        targets: Vec::new(),
        audio: None,
    };
    let batch = CtcBatcher.make::<B>(std::slice::from_ref(&example), device);
    let log_probs = model.forward(batch.features, &batch.frame_lengths);
    let inventory = PhoneInventory::new(saved.phones.clone()).map_err(anyhow::Error::msg)?;
    let outputs = model.decode(log_probs, &batch.frame_lengths).remove(0);
    let phones: Vec<&str> = outputs
        .iter()
        .map(|&o| {
            inventory
                .phone_of(o)
                .context("output outside the inventory")
        })
        .collect::<anyhow::Result<_>>()?;
    println!("{}", phones.join(" "));
    Ok(())
}

fn run_step_time<B: AutodiffBackend + ClusteringBackend>(
    args: &StepTimeArgs,
    device: &B::Device,
) -> anyhow::Result<()> {
    use burn::optim::{GradientsParams, Optimizer};
    use burn::tensor::{Distribution, Int, Tensor};
    let inventory = PhoneInventory::standard();
    let targets_len = args.frames / args.subsampling / 4;
    println!(
        "| attention | frames | batch | subsampling | median step (s) | min (s) | max (s) |\n|---|---:|---:|---:|---:|---:|---:|"
    );
    for &attention in &args.attention {
        B::seed(device, 0);
        let mut model = AsrModelConfig::new(inventory.n_outputs())
            .with_attention(attention)
            .with_subsampling(args.subsampling)
            .init::<B>(device);
        let mut optim = burn::optim::AdamConfig::new().init();
        let features = Tensor::<B, 3>::random(
            [args.batch, args.frames, 40],
            Distribution::Normal(0.0, 1.0),
            device,
        );
        let targets = Tensor::<B, 2, Int>::random(
            [args.batch, targets_len],
            Distribution::Uniform(1.0, 40.0),
            device,
        );
        let frame_lengths = vec![args.frames; args.batch];
        let target_lengths = vec![targets_len; args.batch];
        let mut times = Vec::new();
        for step in 0..=args.steps {
            let start = Instant::now();
            let log_probs = model.forward(features.clone(), &frame_lengths);
            let loss = model
                .ctc_loss(log_probs, &frame_lengths, targets.clone(), &target_lengths)
                .mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-4, model, grads);
            // Wait for the device: read one value back.
            let _ = B::sync(device);
            if step > 0 {
                times.push(start.elapsed().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        println!(
            "| {attention} | {} | {} | {} | {:.3} | {:.3} | {:.3} |",
            args.frames,
            args.batch,
            args.subsampling,
            times[times.len() / 2],
            times[0],
            times[times.len() - 1]
        );
    }
    Ok(())
}
