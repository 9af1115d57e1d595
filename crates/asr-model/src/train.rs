//! Training with burn-train, evaluation and the phone error rate metric.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::{Dataset, DatasetError};
use burn::lr_scheduler::{LrScheduler, LrSchedulerRecord};
use burn::module::Module;
use burn::optim::AdamConfig;
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::tensor::{Device, ExecutionError, Tensor, TensorData, TensorReadError};
use burn::train::logger::FileMetricLogger;
use burn::train::metric::state::{FormatOptions, NumericMetricState};
use burn::train::metric::{
    Adaptor, LossInput, LossMetric, Metric, MetricAttributes, MetricMetadata, MetricName, Numeric,
    NumericAttributes, NumericEntry, SerializedEntry,
};
use burn::train::{
    ExecutionStrategy, InferenceStep, Interrupter, ItemLazy, Learner, MultiDeviceOptim,
    SupervisedTraining, TrainOutput, TrainStep,
};
use clustered_attention::AttentionKind;

use crate::augment::AugmentSet;
use crate::data::{AugmentingBatcher, BucketDataset, CtcBatch, CtcBatcher, Example, bucket};
use crate::decode::{BeamSearch, PhoneErrorRate, beam_search, greedy_ctc_decode};
use crate::features::LogMel;
use crate::json::save_json;
use crate::model::AsrModel;

mod clock;
mod log;
mod metrics;
mod saved;

pub use clock::{
    EPOCH_RECORDS, EpochClock, EpochRecord, FORWARD_METRIC, RunTime, peak_memory_mib, read_records,
    resume_point,
};
pub use log::{EpochLog, TRAINING_LOG, TrainingLog};
pub use metrics::{CtcOutput, ForwardTime, ForwardTimeMetric, PhoneErrorRateMetric};
pub use saved::{AtomicFileCheckpointer, SavedModel, load_model, save_model};

impl AsrModel {
    fn loss_of(&self, batch: &CtcBatch, log_probs: Tensor<3>) -> Tensor<1> {
        let per_utterance = self.ctc_loss(
            log_probs,
            &batch.frame_lengths,
            batch.targets.clone(),
            &batch.target_lengths,
        );
        let device = per_utterance.device();
        let lengths: Vec<f32> = batch.target_lengths.iter().map(|&t| t as f32).collect();
        let n = lengths.len();
        (per_utterance / Tensor::<1>::from_data(TensorData::new(lengths, [n]), &device)).mean()
    }

    /// The phone errors of a batch: its greedy transcriptions from the log-probabilities
    /// `[batch, steps, n_outputs]` against its reference phones.
    pub fn phone_errors(&self, log_probs: Tensor<3>, batch: &CtcBatch) -> PhoneErrorRate {
        let mut per = PhoneErrorRate::default();
        per.add_all(
            &self.decode(log_probs, &batch.frame_lengths),
            &batch.references,
        );
        per
    }

    /// Transcriptions of a batch's log-probabilities `[batch, steps, n_outputs]` by
    /// [`beam_search`], each over its utterance's [`AsrModel::output_length`] steps.
    ///
    /// # Panics
    /// When `search`'s LM has another number of outputs than the model.
    pub fn beam_decode(
        &self,
        log_probs: Tensor<3>,
        frame_lengths: &[usize],
        search: &BeamSearch,
    ) -> Vec<Vec<usize>> {
        let [_, steps, n_outputs] = log_probs.dims();
        assert_eq!(
            search.lm.n_outputs(),
            n_outputs,
            "the phone LM has {} outputs, the model {n_outputs}",
            search.lm.n_outputs()
        );
        let values: Vec<f32> = log_probs
            .into_data()
            .try_into_vec_as::<f32>()
            .expect("f32 log-probabilities");
        frame_lengths
            .iter()
            .enumerate()
            .map(|(b, &frames)| {
                let len = self.output_length(frames).min(steps);
                let start = b * steps * n_outputs;
                beam_search(&values[start..start + len * n_outputs], search)
            })
            .collect()
    }

    /// Greedy transcriptions of a batch's log-probabilities `[batch, steps, n_outputs]`.
    pub fn decode(&self, log_probs: Tensor<3>, frame_lengths: &[usize]) -> Vec<Vec<usize>> {
        let [batch, steps, _] = log_probs.dims();
        let best = log_probs.argmax(2).into_data();
        let best: Vec<i64> = best
            .try_into_vec_as::<i64>()
            .expect("arg-max indices convert to i64");
        (0..batch)
            .map(|b| {
                let len = self.output_length(frame_lengths[b]).min(steps);
                let path: Vec<usize> = best[b * steps..b * steps + len]
                    .iter()
                    .map(|&i| i as usize)
                    .collect();
                greedy_ctc_decode(&path)
            })
            .collect()
    }
}

impl TrainStep for AsrModel {
    type Input = CtcBatch;
    type Output = CtcOutput;

    /// One training step: forward, CTC loss, backward. With [`CtcBatch::dropout_seed`] the
    /// dropout masks come from it; with [`CtcBatch::step_threads`] the step runs on a thread
    /// pool of that many threads of the calling thread's own.
    fn step(&self, batch: CtcBatch) -> TrainOutput<CtcOutput> {
        let Some(threads) = batch.step_threads else {
            return self.seeded_train_step(batch);
        };
        thread_local! {
            static POOL: std::cell::RefCell<Option<(usize, rayon::ThreadPool)>> =
                const { std::cell::RefCell::new(None) };
        }
        let model = self.clone();
        POOL.with(|pool| {
            let mut pool = pool.borrow_mut();
            if pool.as_ref().is_none_or(|(n, _)| *n != threads) {
                let built = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("a thread pool for the training step");
                *pool = Some((threads, built));
            }
            let (_, pool) = pool.as_ref().expect("built above");
            pool.install(move || model.seeded_train_step(batch))
        })
    }
}

impl AsrModel {
    fn seeded_train_step(&self, batch: CtcBatch) -> TrainOutput<CtcOutput> {
        match batch.dropout_seed {
            Some(seed) => clustered_attention::with_dropout_seed(seed, || self.train_step(batch)),
            None => self.train_step(batch),
        }
    }

    /// The loss is [`AsrModel::loss_of`]'s, or with an intermediate CTC loss
    /// `(1 − w)·loss(last layer) + w·loss(middle layer)`
    /// ([`crate::model::AsrModelConfig::inter_ctc_weight`]).
    fn train_step(&self, batch: CtcBatch) -> TrainOutput<CtcOutput> {
        let start = std::time::Instant::now();
        let (log_probs, middle) =
            self.forward_with_intermediate(batch.features.clone(), &batch.frame_lengths);
        let _ = log_probs.device().sync();
        let forward_ms = start.elapsed().as_secs_f64() * 1000.0;
        let loss = match middle {
            Some(middle) => {
                let w = self.inter_ctc_weight();
                self.loss_of(&batch, log_probs) * (1.0 - w) + self.loss_of(&batch, middle) * w
            }
            None => self.loss_of(&batch, log_probs),
        };
        let grads = (loss.clone() * batch.loss_weight).backward();
        TrainOutput::new(
            self,
            grads,
            CtcOutput {
                loss,
                per: PhoneErrorRate::default(),
                forward_ms,
            },
        )
    }
}

impl InferenceStep for AsrModel {
    type Input = CtcBatch;
    type Output = CtcOutput;

    fn step(&self, batch: CtcBatch) -> CtcOutput {
        let log_probs = self.forward(batch.features.clone(), &batch.frame_lengths);
        let loss = self.loss_of(&batch, log_probs.clone());
        let per = self.phone_errors(log_probs, &batch);
        CtcOutput {
            loss,
            per,
            forward_ms: 0.0,
        }
    }
}

/// Training settings.
#[derive(Debug, Clone)]
pub struct TrainOptions {
    /// Output directory (checkpoints, logs, the final model).
    pub dir: PathBuf,
    /// Epochs (absolute: with `resume`, training stops after this epoch).
    pub epochs: usize,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Linear warm-up steps.
    pub warmup_steps: usize,
    /// Learning rate at the last step of the last epoch: the warm-up's rate times a factor
    /// falling linearly from 1 at the first step to `final / learning_rate` at the last.
    /// `None`: the peak rate from the end of the warm-up on.
    pub final_learning_rate: Option<f64>,
    /// Gradient clipping: largest L2 norm of each parameter's gradient.
    pub grad_clip: f32,
    /// Padded frames per batch.
    pub batch_frames: usize,
    /// Seed of the weights, the hashing planes and the batch order.
    pub seed: u64,
    /// Shuffle the batches every epoch (off only for reproducibility checks).
    pub shuffle: bool,
    /// Continue from the last checkpoint in `dir`.
    pub resume: bool,
    /// Stop (as an interruption would) after this many training steps of this run.
    pub stop_after_steps: Option<usize>,
    /// Stop once the run has trained this many seconds (over every sitting of a resumed
    /// run; [`RunTime`]), at the next batch, then measure the dev phone error rate.
    pub time_budget_s: Option<f64>,
    /// Install burn-train's application logger (`dir/experiment.log`; a process-wide
    /// logger, so at most once per process).
    pub application_log: bool,
    /// Training-time augmentation ([`crate::augment`]); waveform steps need the examples'
    /// kept audio ([`crate::data::featurize`] with `keep_audio`).
    pub augment: AugmentSet,
    /// How several devices share the work ([`train_on_devices`]).
    pub strategy: Strategy,
}

/// How [`train_on_devices`] trains on several devices: both are data-parallel (each device
/// computes the gradients of its own batch, the optimizer steps on their mean) and give the
/// same run up to float rounding; they differ in where the gradients meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Strategy {
    /// burn-train's multi-device strategy: the gradients are moved to the first device and
    /// summed there; one optimizer, on the first device. Every backend; on the CPU backends a
    /// device listed `n` times is `n` workers.
    #[default]
    Multi,
    /// burn-train's distributed data parallel: one worker and one optimizer per device, the
    /// gradients summed by an all-reduce (NCCL) during the backward pass. CUDA only, in a
    /// build with this crate's `ddp` feature: Burn 0.22 runs collective operations on its
    /// CubeCL backends alone, and CubeCL 0.11 implements the all-reduce on CUDA alone.
    Ddp,
}

/// Creates `dir` if needed and checks that a file can be written in it (an empty temporary
/// file, written and removed), so that an output directory that cannot take the model,
/// checkpoints and logs is reported before any work, not when the first checkpoint is due.
///
/// # Errors
/// When `dir` cannot be created or written in; the message names it.
pub fn check_output_dir(dir: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("{}: cannot create the output directory", dir.display()))?;
    let probe = dir.join(".write-check");
    asr_data::files::write_atomic(&probe, b"")
        .and_then(|()| std::fs::remove_file(&probe))
        .with_context(|| format!("{}: cannot write in the output directory", dir.display()))
}

/// The last epoch with a model checkpoint in `dir/checkpoint`.
pub fn last_checkpoint(dir: &Path) -> Option<usize> {
    checkpoints(dir).into_iter().max()
}

/// The epochs with a whole checkpoint in `dir/checkpoint`, in no particular order: the
/// model's, the optimizer's and the learning-rate schedule's records of the epoch all there
/// (`model-N.bpk`, `optim-N.bpk`, `scheduler-N.bpk`, burnpack; burn-train writes them from
/// three threads, each file whole or not at all: [`AtomicFileCheckpointer`]).
pub fn checkpoints(dir: &Path) -> Vec<usize> {
    checkpoints_of(dir, saved::CHECKPOINT_EXTENSION)
}

/// The epochs whose model, optimizer and schedule files of `extension` are all in
/// `dir/checkpoint`.
fn checkpoints_of(dir: &Path, extension: &str) -> Vec<usize> {
    let dir = dir.join("checkpoint");
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    entries
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            let epoch = usize::try_from(saved::model_file_number(&name, extension)?).ok()?;
            ["optim", "scheduler"]
                .iter()
                .all(|part| dir.join(format!("{part}-{epoch}.{extension}")).is_file())
                .then_some(epoch)
        })
        .collect()
}

/// A dataset that interrupts training after its `limit`-th item.
struct StopAfter {
    inner: BucketDataset,
    limit: usize,
    served: std::sync::atomic::AtomicUsize,
    interrupter: Interrupter,
}

impl Dataset<Vec<Example>> for StopAfter {
    fn get(&self, index: usize) -> Result<Vec<Example>, DatasetError> {
        let served = self
            .served
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
            + 1;
        if served >= self.limit {
            self.interrupter.stop(Some("--stop-after-steps reached"));
        }
        self.inner.get(index)
    }

    fn len(&self) -> usize {
        self.inner.len()
    }
}

/// Trains `config` on `train` (validating on `valid` each epoch) with burn-train on `device`
/// (with autodiff: [`Device::autodiff`], whether or not `device` has it already); returns the
/// trained model (without autodiff, on `device`'s backend) and saves it in `dir`
/// ([`save_model`]: `model-N.safetensors` and `model.json`). [`train_on_devices`] with one
/// device.
///
/// # Errors
/// When the directory cannot be written, a checkpoint cannot be read, or burn-train stops on
/// an error.
pub fn train(
    saved: &SavedModel,
    train: Vec<Example>,
    valid: Vec<Example>,
    options: &TrainOptions,
    device: &Device,
) -> anyhow::Result<AsrModel> {
    train_on_devices(saved, train, valid, options, std::slice::from_ref(device))
}

/// Trains as [`train`] does, data-parallel on `devices` with `options.strategy`
/// ([`Strategy`]): each step, every device computes the gradients of its own batch, with its
/// loss weighted `1/n`, and the optimizer takes their sum, the mean over `n` batches. With
/// [`Strategy::Multi`] a device may be listed more than once: on the CPU backends, whose one
/// device is the whole machine, `n` copies are `n` workers. The batches are dealt to the
/// devices in turn in length order, so each device gets batches of every length. Validation
/// and checkpoints are the first device's.
///
/// # Errors
/// As [`train`]; or when `devices` is empty; or with [`Strategy::Ddp`] in a build without
/// the `ddp` feature, or with a device listed twice; or with `resume` when `dir/checkpoint`
/// holds only checkpoints of an older version (`model-N.mpk`, Burn 0.21's format).
pub fn train_on_devices(
    saved: &SavedModel,
    train: Vec<Example>,
    valid: Vec<Example>,
    options: &TrainOptions,
    devices: &[Device],
) -> anyhow::Result<AsrModel> {
    // The training devices, with autodiff; validation runs on the first without it.
    let devices: Vec<Device> = devices.iter().map(|d| d.clone().autodiff()).collect();
    let Some(device) = devices.first() else {
        anyhow::bail!("training needs at least one device");
    };
    if options.strategy == Strategy::Ddp {
        if cfg!(not(feature = "ddp")) {
            anyhow::bail!(
                "strategy ddp needs a build with asr-model's `ddp` feature \
                 (`--features ddp`)"
            );
        }
        if most_listed(&devices) > 1 {
            anyhow::bail!(
                "strategy ddp runs one worker per device: {devices:?} lists a device twice"
            );
        }
    }
    if valid.is_empty() {
        anyhow::bail!("the validation split is empty: training needs at least one dev utterance");
    }
    check_output_dir(&options.dir)?;
    if options.resume && checkpoints(&options.dir).is_empty() {
        let older = checkpoints_of(&options.dir, "mpk");
        if let Some(epoch) = older.iter().max() {
            anyhow::bail!(
                "{}: the checkpoints there (the last of epoch {epoch}, model-{epoch}.mpk) are \
                 an older version's (Burn 0.21's format), which this version does not read; \
                 train from scratch, without --resume",
                options.dir.join("checkpoint").display()
            );
        }
    }
    device.seed(options.seed);
    let model: AsrModel = saved.model.init(device);
    let dataset = BucketDataset::new(deal(bucket(train, options.batch_frames), devices.len()));
    let optim = AdamConfig::new()
        .with_grad_clipping(Some(GradientClippingConfig::Norm(options.grad_clip)))
        .init();
    // Steps per epoch: the largest of the devices' slices of the batches, the last.
    let steps_per_epoch = slice_lengths(dataset.len(), devices.len())
        .last()
        .copied()
        .unwrap_or(0)
        .max(1);
    if let Some(last) = options.final_learning_rate
        && !(0.0..=options.learning_rate).contains(&last)
    {
        anyhow::bail!(
            "final learning rate {last} must be in [0, learning rate = {}]",
            options.learning_rate
        );
    }
    // Each worker advances its scheduler once per step of its own (burn-train 0.22's DDP
    // workers included: 0.21's advanced theirs once per device every step).
    let scheduler = WarmupDecay {
        peak: options.learning_rate,
        final_rate: options.final_learning_rate,
        warmup: options.warmup_steps.max(1),
        total: options.epochs.max(1) * steps_per_epoch,
        step: 0,
    };
    // Kept to measure the dev PER of a run that the time budget stops mid-epoch.
    let valid_for_budget = options.time_budget_s.map(|_| valid.clone());
    let valid_device = device.clone().inner();
    let valid_loader = DataLoaderBuilder::new(CtcBatcher)
        .batch_size(1)
        .set_device(valid_device.clone())
        .build(BucketDataset::new(bucket(valid, options.batch_frames)));
    let interrupter = Interrupter::new();
    let batcher = AugmentingBatcher::new(
        options.augment.clone(),
        Arc::new(LogMel::new(saved.features.clone())),
        saved.model.subsampling,
        options.seed,
    )
    .with_loss_weight(1.0 / devices.len() as f32)
    .with_step_threads(step_threads(&devices));
    let builder = || {
        let mut builder = DataLoaderBuilder::new(batcher.clone())
            .batch_size(1)
            .set_device(device.clone());
        // Batches (and their augmentation) are made by one worker thread, beside the training
        // step; not under --stop-after-steps, whose count must not include prefetched batches.
        if options.stop_after_steps.is_none() {
            builder = builder.num_workers(1);
        }
        if options.shuffle {
            builder.shuffle(options.seed)
        } else {
            builder
        }
    };
    // The temporary files of checkpoints that a killed run was writing (`write_atomic` leaves
    // them behind; burn-train does not know them).
    let checkpoint_dir = options.dir.join("checkpoint");
    if checkpoint_dir.is_dir() {
        asr_data::files::remove_partial_files(&checkpoint_dir, "").with_context(|| {
            format!(
                "{}: cannot remove temporary files",
                checkpoint_dir.display()
            )
        })?;
    }
    let resume_from = if options.resume {
        resume_point(&options.dir, &checkpoints(&options.dir))?
    } else {
        None
    };
    let mut clock = match resume_from {
        Some(epoch) => EpochClock::resume(&options.dir, epoch)?,
        None => EpochClock::fresh(&options.dir)?,
    };
    let run_time = clock.run_time();
    if let Some(budget) = options.time_budget_s {
        if !(budget.is_finite() && budget > 0.0) {
            anyhow::bail!("the time budget must be a positive number of seconds, got {budget}");
        }
        clock = clock.with_budget(budget, interrupter.clone());
    }
    let train_loader = match options.stop_after_steps {
        Some(limit) => builder().build(StopAfter {
            inner: dataset,
            limit,
            served: 0.into(),
            interrupter: interrupter.clone(),
        }),
        None => builder().build(dataset),
    };
    let mut training =
        SupervisedTraining::<AsrModel>::new(&options.dir, train_loader, valid_loader)
            .with_interrupter(interrupter)
            .with_metric_logger(FileMetricLogger::new(&options.dir))
            .with_metric_logger(clock)
            .metrics((LossMetric::new(),))
            .metric_train_numeric(ForwardTimeMetric::default())
            .metric_valid_numeric(PhoneErrorRateMetric::default())
            .with_custom_checkpointers(
                AtomicFileCheckpointer::new(&checkpoint_dir, "model"),
                AtomicFileCheckpointer::new(&checkpoint_dir, "optim"),
                AtomicFileCheckpointer::new(&checkpoint_dir, "scheduler"),
            )
            .num_epochs(options.epochs)
            .summary();
    if !(cfg!(feature = "tui") && std::io::IsTerminal::is_terminal(&std::io::stdout())) {
        training = training.renderer(Box::new(crate::render::ProgressLines::default()));
    }
    if !options.application_log {
        training = training.with_application_logger(None);
    }
    match options.strategy {
        Strategy::Multi if devices.len() > 1 => {
            training = training.with_training_strategy(
                ExecutionStrategy::multi(devices.to_vec(), MultiDeviceOptim::OptimMainDevice)
                    .into(),
            );
        }
        Strategy::Multi => {}
        #[cfg(feature = "ddp")]
        Strategy::Ddp => {
            use burn::tensor::distributed::{DistributedConfig, ReduceOperation};
            // The losses are weighted 1/n already: the all-reduce sums.
            let config = DistributedConfig {
                all_reduce_op: ReduceOperation::Sum,
            };
            training = training
                .with_training_strategy(ExecutionStrategy::ddp(devices.to_vec(), config).into());
        }
        #[cfg(not(feature = "ddp"))]
        Strategy::Ddp => unreachable!("rejected above"),
    }
    if options.resume {
        if let Some(epoch) = resume_from {
            eprintln!(
                "resuming after epoch {epoch} (checkpoint in {})",
                options.dir.display()
            );
            training = training.checkpoint(epoch);
        } else {
            eprintln!(
                "no checkpoint in {}: starting from scratch",
                options.dir.display()
            );
        }
    }
    let result = training.launch(Learner::new(model, optim, scheduler));
    let stopped_seconds = run_time.seconds();
    let stopped_by_budget = run_time.budget_reached();
    // burn-train 0.22 returns a failure of the training (a batch, a metric, a checkpoint, a
    // worker) rather than panicking: the model is not saved, as a crash would have left it.
    if let Some(error) = result.error {
        anyhow::bail!(
            "{}: training stopped on an error: {error}",
            options.dir.display()
        );
    }
    let model = result.model;
    save_model(&model, saved, &options.dir)?;
    let mut log = TrainingLog::new(
        saved.model.attention,
        &read_records(&options.dir)?,
        resume_from.is_some(),
    );
    if let (Some(budget), Some(valid)) = (options.time_budget_s, &valid_for_budget) {
        log.time_budget_s = Some(budget);
        // The epochs' records end at the last completed epoch; the budget may have stopped a
        // later one part-way.
        if stopped_by_budget {
            log.train_seconds = stopped_seconds;
            log.final_dev_per =
                Some(evaluate(&model, valid, None, options.batch_frames, &valid_device).percent());
        }
    }
    save_json(&options.dir.join(TRAINING_LOG), &log)?;
    Ok(model)
}

/// The key of [`WarmupDecay`]'s step count in its record.
const STEP_KEY: &str = "step";

/// The learning-rate schedule of [`train_on_devices`]: a linear warm-up from `peak / warmup`
/// at the first step to `peak` at step `warmup + 1`, times, with a final rate, a factor
/// falling linearly from 1 at the first step to `final / peak` at step `total`, the run's
/// last (burn's `LinearLrScheduler`s, composed by product). Its record is the step count
/// alone, so a run resumed with more epochs stretches the decay to its new last step (burn's
/// linear scheduler keeps its steps left, and would go on at the final rate).
#[derive(Debug, Clone)]
struct WarmupDecay {
    peak: f64,
    final_rate: Option<f64>,
    warmup: usize,
    total: usize,
    step: usize,
}

impl LrScheduler for WarmupDecay {
    fn step(&mut self) -> f64 {
        self.step += 1;
        // Both factors as burn's `LinearLrScheduler` computes them (`final − size · left`)
        // and multiplied as its `ComposedLrScheduler` does, so the rates are those of burn's
        // schedules, bit for bit; only the record differs.
        let linear = |initial: f64, last: f64, iters: usize| {
            let size = (last - initial) / iters as f64;
            let left = (iters + 1).saturating_sub(self.step);
            last - size * left as f64
        };
        let w = self.warmup.max(1);
        let ramp = linear(self.peak / w as f64, self.peak, w);
        let factor = match self.final_rate {
            Some(last) => linear(1.0, last / self.peak, self.total.saturating_sub(1).max(1)),
            None => linear(1.0, 1.0, 1),
        };
        ramp * factor
    }

    fn to_record(&self) -> LrSchedulerRecord {
        LrSchedulerRecord::new().with_scalar(STEP_KEY, self.step)
    }

    fn load_record(&mut self, record: LrSchedulerRecord) {
        if let Some(step) = record.scalar::<usize>(STEP_KEY) {
            self.step = step;
        }
    }
}

/// Reorders length-sorted batches for `n` devices: burn-train gives device `k` the `k`-th of
/// `n` consecutive slices, so slice `k` gets batches `k, k + n, k + 2n, …`.
fn deal(batches: Vec<Vec<Example>>, n: usize) -> Vec<Vec<Example>> {
    if n <= 1 {
        return batches;
    }
    let room = slice_lengths(batches.len(), n);
    let mut slices: Vec<Vec<Vec<Example>>> = vec![Vec::new(); n];
    for (i, batch) in batches.into_iter().enumerate() {
        let k = (0..n)
            .map(|j| (i + j) % n)
            .find(|&k| slices[k].len() < room[k])
            .expect("the slices hold every batch");
        slices[k].push(batch);
    }
    slices.into_iter().flatten().collect()
}

/// The lengths of the slices burn-train cuts `m` batches into for `n ≥ 1` devices: ⌊m/n⌋
/// each, the rest to the last.
fn slice_lengths(m: usize, n: usize) -> Vec<usize> {
    let mut lengths = vec![m / n; n];
    lengths[n - 1] = m - (m / n) * (n - 1);
    lengths
}

/// How many times the most listed device of `devices` is listed (0 for none).
fn most_listed(devices: &[Device]) -> usize {
    devices
        .iter()
        .map(|d| devices.iter().filter(|e| *e == d).count())
        .max()
        .unwrap_or(0)
}

/// The threads each worker's training step keeps to: when a device is listed `k > 1` times
/// (the CPU backends' one device, as `k` workers), its workers share the machine's cores,
/// `cores / k` each (at least one), each worker's step on a thread pool of its own, so that
/// they do not queue on one pool; else none (rayon's global pool).
fn step_threads(devices: &[Device]) -> Option<usize> {
    let most = most_listed(devices);
    (most > 1).then(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        (cores / most).max(1)
    })
}

/// Phone error rate of `model` (with `attention`, when given) over `examples`, decoded
/// greedily, on `device` (without autodiff: [`Device::inner`]).
pub fn evaluate(
    model: &AsrModel,
    examples: &[Example],
    attention: Option<AttentionKind>,
    batch_frames: usize,
    device: &Device,
) -> PhoneErrorRate {
    evaluate_with(model, examples, attention, batch_frames, device, None)
}

/// [`evaluate`], decoded by [`beam_search`] with `search` when given, else greedily.
pub fn evaluate_with(
    model: &AsrModel,
    examples: &[Example],
    attention: Option<AttentionKind>,
    batch_frames: usize,
    device: &Device,
    search: Option<&BeamSearch>,
) -> PhoneErrorRate {
    // In validation mode, without autodiff (as a model of Burn 0.21's inner backend was).
    let model = match attention {
        Some(kind) => model.valid().with_attention(kind),
        None => model.valid(),
    };
    let device = device.clone().inner();
    let mut per = PhoneErrorRate::default();
    for batch in bucket(examples.to_vec(), batch_frames) {
        let batch: CtcBatch = CtcBatcher.make(&batch, &device);
        let log_probs = model.forward(batch.features.clone(), &batch.frame_lengths);
        let hypotheses = match search {
            None => model.decode(log_probs, &batch.frame_lengths),
            Some(search) => model.beam_decode(log_probs, &batch.frame_lengths, search),
        };
        per.add_all(&hypotheses, &batch.references);
    }
    per
}

/// Keeps the examples that a CTC alignment can fit (`steps ≥ labels + repeated neighbours`),
/// returning them and the number dropped (the caller reports it).
pub fn feasible(examples: Vec<Example>, subsampling: usize) -> (Vec<Example>, usize) {
    let before = examples.len();
    let kept: Vec<Example> = examples
        .into_iter()
        .filter(|e| crate::data::ctc_feasible(e.features.frames, &e.targets, subsampling))
        .collect();
    let dropped = before - kept.len();
    (kept, dropped)
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::WarmupDecay;
    use crate::data::CtcBatch;
    use crate::model::AsrModelConfig;
    use burn::lr_scheduler::LrScheduler;
    use burn::lr_scheduler::composed::{ComposedLrSchedulerConfig, SchedulerReduction};
    use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
    use burn::tensor::{Device, Distribution, Tensor, TensorData};
    use clustered_attention::AttentionKind;

    /// The schedule's rates are those of burn's two linear schedulers composed by product,
    /// bit for bit, over a whole run and past it, with and without decay; a fresh schedule
    /// loaded with its record halfway goes on with the same rates.
    #[test]
    fn schedule_is_burns_composed_linear_schedules() {
        for (peak, last, warmup, total) in [
            (3e-3, Some(0.0), 100, 2_000),
            (2e-3, Some(1e-4), 7, 50),
            (1e-3, None, 3, 10),
            (5e-4, Some(5e-4), 1, 1),
        ] {
            let mut ours = WarmupDecay {
                peak,
                final_rate: last,
                warmup,
                total,
                step: 0,
            };
            let decay = match last {
                Some(last) => LinearLrSchedulerConfig::new(1.0, last / peak, (total - 1).max(1)),
                None => LinearLrSchedulerConfig::new(1.0, 1.0, 1),
            };
            let mut burns = ComposedLrSchedulerConfig::new()
                .with_reduction(SchedulerReduction::Prod)
                .linear(LinearLrSchedulerConfig::new(
                    peak / warmup as f64,
                    peak,
                    warmup,
                ))
                .linear(decay)
                .init()
                .unwrap();
            for step in 1..=total + 5 {
                assert_eq!(ours.step(), burns.step().base(), "step {step} of {total}");
                if step == total / 2 {
                    let record = ours.to_record();
                    ours = WarmupDecay { step: 0, ..ours };
                    ours.load_record(record);
                }
            }
        }
    }

    /// With an intermediate CTC loss of weight w, a training step's loss is
    /// `(1 − w)·loss(last layer) + w·loss(middle layer)` (Lee and Watanabe, 2021, eq. 6), each
    /// the mean CTC loss per target phone of its log-probabilities; to 1e-5. The model and the
    /// features are drawn again (up to 8 times) until the two losses differ by more than 1e-3,
    /// so that the step's loss tells them apart: an untrained model's two losses came that
    /// close in 2 of 80 single draws.
    #[test]
    #[allow(deprecated)] // NdArray's device, deprecated in Burn 0.22
    fn intermediate_ctc_loss_mixes_the_two_losses() {
        let device = Device::ndarray().autodiff();
        let w = 0.3;
        let draw = || {
            let model = AsrModelConfig::new(5)
                .with_n_mels(6)
                .with_d_model(8)
                .with_n_heads(2)
                .with_n_layers(4)
                .with_d_ff(16)
                .with_dropout(0.0)
                .with_attention(AttentionKind::Full)
                .with_inter_ctc_weight(w)
                .init(&device);
            let batch = CtcBatch {
                features: Tensor::random([2, 24, 6], Distribution::Normal(0.0, 1.0), &device),
                frame_lengths: vec![24, 17],
                targets: Tensor::from_data(
                    TensorData::new(vec![1i64, 2, 3, 4, 2, 0], [2, 3]),
                    &device,
                ),
                target_lengths: vec![3, 2],
                references: vec![vec![1, 2, 3], vec![4, 2]],
                loss_weight: 1.0,
                dropout_seed: None,
                step_threads: None,
            };
            let (last, middle) =
                model.forward_with_intermediate(batch.features.clone(), &batch.frame_lengths);
            let loss =
                |log_probs| -> f64 { model.loss_of(&batch, log_probs).into_scalar::<f32>() as f64 };
            let losses = (loss(last), loss(middle.unwrap()));
            (model, batch, losses)
        };
        let (model, batch, (last, middle)) = (0..8)
            .map(|_| draw())
            .find(|(_, _, (last, middle))| (last - middle).abs() > 1e-3)
            .expect("the two losses should differ for one of 8 draws of the model and features");
        let step = model
            .train_step(batch.clone())
            .item
            .loss
            .into_scalar::<f32>() as f64;
        let expected = (1.0 - w) * last + w * middle;
        assert!(
            (step - expected).abs() < 1e-5,
            "step loss {step}, expected {expected}"
        );
    }
}
