//! Utterances as model inputs: log-mel features computed once per run, length-bucketed
//! batches, the batcher.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::Device;
use burn::tensor::{Int, Tensor, TensorData};
use rand::Rng;

use crate::audio::load_audio;
use crate::augment::{AugmentSet, rng_for};
use crate::features::{Features, LogMel};
use crate::manifest::{ManifestError, Utterance, read_manifest};
use crate::phones::PhoneInventory;

/// One utterance ready for the model.
#[derive(Debug, Clone)]
pub struct Example {
    /// Utterance id.
    pub id: String,
    /// Log-mel features, `[frames, n_mels]`.
    pub features: Arc<Features>,
    /// Labels as model outputs (1-based; 0 is the blank).
    pub targets: Vec<usize>,
    /// The 16 kHz samples, kept for training-time waveform augmentation ([`featurize`] with
    /// `keep_audio`); `None` otherwise.
    pub audio: Option<Arc<Vec<f32>>>,
}

/// Reads, validates and featurizes a split: the manifest is validated as a whole (every audio
/// file decoded) before any feature is computed; features are computed once, on all cores.
///
/// # Errors
/// The [`ManifestError`] listing every bad line.
pub fn load_split(
    manifest: &Path,
    inventory: &PhoneInventory,
    log_mel: &LogMel,
) -> Result<Vec<Example>, ManifestError> {
    let utterances = read_manifest(manifest, inventory, true)?;
    Ok(featurize(&utterances, log_mel, false))
}

/// Reads split `split` (`<split>.jsonl`) of each corpus of `corpora` and joins them, in
/// order: the union of, e.g., several corpora's dev splits. Returns the phone inventory, the
/// manifests read and the examples.
///
/// # Errors
/// When `corpora` is empty, a corpus's `phones.txt` cannot be read or differs from the first
/// one's, or a manifest is invalid ([`load_split`]).
pub fn load_split_of(
    corpora: &[PathBuf],
    split: &str,
    log_mel: &LogMel,
) -> anyhow::Result<(PhoneInventory, Vec<PathBuf>, Vec<Example>)> {
    let Some(first) = corpora.first() else {
        anyhow::bail!("no corpus given");
    };
    let inventory = PhoneInventory::load(&first.join("phones.txt")).map_err(anyhow::Error::msg)?;
    let (mut manifests, mut examples) = (Vec::new(), Vec::new());
    for corpus in corpora {
        let phones =
            PhoneInventory::load(&corpus.join("phones.txt")).map_err(anyhow::Error::msg)?;
        if phones != inventory {
            anyhow::bail!(
                "{}: its phones.txt differs from that of {}; a union needs one inventory",
                corpus.display(),
                first.display()
            );
        }
        let manifest = corpus.join(format!("{split}.jsonl"));
        examples.extend(load_split(&manifest, &inventory, log_mel)?);
        manifests.push(manifest);
    }
    Ok((inventory, manifests, examples))
}

/// Reads a corpus directory: its phone inventory (`phones.txt`) and the splits `splits`
/// (`<split>.jsonl`), every manifest validated (all problems reported at once) before any
/// feature is computed. The audio of the `train` split is kept when `keep_train_audio` (for
/// waveform augmentation).
///
/// # Errors
/// When `phones.txt` cannot be read, or a manifest has bad lines (all of them listed).
pub fn load_corpus(
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
        match read_manifest(&path, &inventory, true) {
            Ok(utterances) => manifests.push(utterances),
            Err(e) => problems.push(e.to_string()),
        }
    }
    if !problems.is_empty() {
        anyhow::bail!("the corpus is not usable:\n{}", problems.join("\n"));
    }
    let examples = splits
        .iter()
        .zip(&manifests)
        .map(|(split, u)| featurize(u, log_mel, keep_train_audio && *split == "train"))
        .collect();
    Ok((inventory, examples))
}

/// Computes the features of utterances on all cores (the audio was validated).
pub fn featurize(utterances: &[Utterance], log_mel: &LogMel, keep_audio: bool) -> Vec<Example> {
    map_on_all_cores(utterances, |u| {
        let samples = load_audio(&u.audio_path).expect("audio was validated with the manifest");
        Example {
            id: u.entry.id.clone(),
            features: Arc::new(log_mel.features(&samples)),
            targets: u.targets.clone(),
            audio: keep_audio.then(|| Arc::new(samples)),
        }
    })
}

/// `items.iter().map(f)`, in order, computed on all cores (one scoped thread per core, each
/// on a contiguous share).
pub(crate) fn map_on_all_cores<T: Sync, R: Send>(
    items: &[T],
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = items.len().div_ceil(threads).max(1);
    let f = &f;
    std::thread::scope(|scope| {
        let handles: Vec<_> = items
            .chunks(chunk)
            .map(|part| scope.spawn(move || part.iter().map(f).collect::<Vec<_>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a worker thread panicked"))
            .collect()
    })
}

/// 64-bit FNV-1a of `bytes`.
pub(crate) fn fnv1a(bytes: impl IntoIterator<Item = u8>) -> u64 {
    bytes.into_iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Length-bucketed batches: utterances sorted by length, cut into batches of at most
/// `max_frames` padded frames (batch size × longest utterance), at least one utterance each.
pub fn bucket(mut examples: Vec<Example>, max_frames: usize) -> Vec<Vec<Example>> {
    examples.sort_by_key(|e| (e.features.frames, e.id.clone()));
    let mut batches = Vec::new();
    let mut current: Vec<Example> = Vec::new();
    for example in examples {
        let longest = example.features.frames;
        if !current.is_empty() && (current.len() + 1) * longest > max_frames {
            batches.push(std::mem::take(&mut current));
        }
        current.push(example);
    }
    if !current.is_empty() {
        batches.push(current);
    }
    batches
}

/// A dataset whose items are whole batches (see [`bucket`]); use it with batch size 1.
#[derive(Debug, Clone)]
pub struct BucketDataset {
    batches: Vec<Vec<Example>>,
}

impl BucketDataset {
    /// Wraps pre-made batches.
    pub fn new(batches: Vec<Vec<Example>>) -> Self {
        Self { batches }
    }
}

impl Dataset<Vec<Example>> for BucketDataset {
    fn get(&self, index: usize) -> Result<Vec<Example>, DatasetError> {
        self.batches.get(index).cloned().ok_or_else(|| {
            DatasetError::new(std::io::Error::other(format!(
                "batch {index} of a dataset of {} batches",
                self.batches.len()
            )))
        })
    }

    fn len(&self) -> usize {
        self.batches.len()
    }
}

/// A padded batch.
#[derive(Debug, Clone)]
pub struct CtcBatch {
    /// Features `[batch, frames, n_mels]`, zero past each utterance's end.
    pub features: Tensor<3>,
    /// Valid frames per utterance.
    pub frame_lengths: Vec<usize>,
    /// Labels `[batch, max_target_len]`, padded with the blank (0).
    pub targets: Tensor<2, Int>,
    /// Labels per utterance.
    pub target_lengths: Vec<usize>,
    /// The labels on the host, for the phone error rate.
    pub references: Vec<Vec<usize>>,
    /// Factor of the batch's loss (1; `1/n` when `n` devices each train on a batch and their
    /// gradients are summed, so that a step is the mean over all of them).
    pub loss_weight: f32,
    /// Seed of the dropout masks of the batch's training step
    /// (`clustered_attention::with_dropout_seed`); `None`: the backend's generator.
    pub dropout_seed: Option<u64>,
    /// Threads the batch's training step may use for the host ops (the CPU backends' and the
    /// attention's, on rayon): `None`, rayon's global pool; `Some(t)` when several workers
    /// train side by side on one machine's cores, each then keeps to `t` of them.
    pub step_threads: Option<usize>,
}

/// Pads the utterances of a bucket into a [`CtcBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct CtcBatcher;

impl CtcBatcher {
    /// Pads `examples` into a batch on `device`.
    ///
    /// # Panics
    /// When `examples` is empty or the utterances disagree on `n_mels`.
    pub fn make(&self, examples: &[Example], device: &Device) -> CtcBatch {
        assert!(!examples.is_empty(), "a batch needs at least one utterance");
        let n_mels = examples[0].features.n_mels;
        let frames = examples
            .iter()
            .map(|e| e.features.frames)
            .max()
            .unwrap_or(0);
        let labels = examples
            .iter()
            .map(|e| e.targets.len())
            .max()
            .unwrap_or(0)
            .max(1);
        let batch = examples.len();
        let mut features = vec![0f32; batch * frames * n_mels];
        let mut targets = vec![0i64; batch * labels];
        for (b, e) in examples.iter().enumerate() {
            assert_eq!(
                e.features.n_mels, n_mels,
                "utterance {} has {} mel bands, expected {n_mels}",
                e.id, e.features.n_mels
            );
            let start = b * frames * n_mels;
            features[start..start + e.features.data.len()].copy_from_slice(&e.features.data);
            for (i, &t) in e.targets.iter().enumerate() {
                targets[b * labels + i] = t as i64;
            }
        }
        CtcBatch {
            features: Tensor::from_data(TensorData::new(features, [batch, frames, n_mels]), device),
            frame_lengths: examples.iter().map(|e| e.features.frames).collect(),
            targets: Tensor::from_data(TensorData::new(targets, [batch, labels]), device),
            target_lengths: examples.iter().map(|e| e.targets.len()).collect(),
            references: examples.iter().map(|e| e.targets.clone()).collect(),
            loss_weight: 1.0,
            dropout_seed: None,
            step_threads: None,
        }
    }
}

impl Batcher<Vec<Example>, CtcBatch> for CtcBatcher {
    fn batch(&self, items: Vec<Vec<Example>>, device: &Device) -> CtcBatch {
        let examples: Vec<Example> = items.into_iter().flatten().collect();
        self.make(&examples, device)
    }
}

/// Whether CTC can align `targets` with `frames` feature frames at time subsampling
/// `subsampling`: it needs one encoder step per label plus one per repeated label.
pub fn ctc_feasible(frames: usize, targets: &[usize], subsampling: usize) -> bool {
    let repeats = targets.windows(2).filter(|w| w[0] == w[1]).count();
    frames.div_ceil(subsampling.max(1)) >= targets.len() + repeats
}

/// The training batcher: every utterance is augmented afresh ([`crate::augment`]) from its
/// kept audio (waveform steps, then the log-mel front end, then SpecAugment), then batched as
/// by [`CtcBatcher`]. An utterance without kept audio only gets SpecAugment; one whose altered
/// features would be too short for its labels ([`ctc_feasible`]) keeps its original features.
///
/// The random choices depend on the seed, the batch (its utterance ids), how many times this
/// batcher has made that batch before and the position in the batch: a run is reproducible,
/// whatever the order in which data-loading threads make the batches, and every epoch draws
/// new choices (a resumed run draws the first epoch's again).
#[derive(Debug, Clone)]
pub struct AugmentingBatcher {
    augment: Arc<AugmentSet>,
    log_mel: Arc<LogMel>,
    subsampling: usize,
    seed: u64,
    loss_weight: f32,
    step_threads: Option<usize>,
    calls: Arc<Mutex<HashMap<u64, u64>>>,
}

impl AugmentingBatcher {
    /// A batcher applying `augment`, featurizing with `log_mel`, for a model with time
    /// subsampling `subsampling`.
    pub fn new(augment: AugmentSet, log_mel: Arc<LogMel>, subsampling: usize, seed: u64) -> Self {
        Self {
            augment: Arc::new(augment),
            log_mel,
            subsampling,
            seed,
            loss_weight: 1.0,
            step_threads: None,
            calls: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// The same batcher making batches whose loss counts `weight` times ([`CtcBatch::loss_weight`]).
    pub fn with_loss_weight(mut self, weight: f32) -> Self {
        self.loss_weight = weight;
        self
    }

    /// The same batcher making batches whose training step keeps to `threads` threads
    /// ([`CtcBatch::step_threads`]).
    pub fn with_step_threads(mut self, threads: Option<usize>) -> Self {
        self.step_threads = threads;
        self
    }

    /// The augmented copies of `examples` (one call's random choices).
    pub fn augment(&self, examples: &[Example]) -> Vec<Example> {
        self.augment_call(examples, self.call(examples))
    }

    /// The key of this call's random choices: the batch's utterance ids and how many times
    /// this batcher has made that batch before.
    fn call(&self, examples: &[Example]) -> u64 {
        let key = fnv1a(examples.iter().flat_map(|e| e.id.bytes().chain([0])));
        let mut calls = self.calls.lock().unwrap_or_else(PoisonError::into_inner);
        let count = calls.entry(key).or_insert(0);
        *count += 1;
        key ^ (*count - 1)
    }

    fn augment_call(&self, examples: &[Example], call: u64) -> Vec<Example> {
        examples
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let mut rng = rng_for(self.seed, call, i);
                let mut features = match &e.audio {
                    Some(audio) if self.augment.alters_waveform() => {
                        let altered = self.augment.waveform(audio, &mut rng);
                        let features = self.log_mel.features(&altered);
                        if ctc_feasible(features.frames, &e.targets, self.subsampling) {
                            features
                        } else {
                            (*e.features).clone()
                        }
                    }
                    _ => (*e.features).clone(),
                };
                self.augment.spec_augment(&mut features, &mut rng);
                Example {
                    id: e.id.clone(),
                    features: Arc::new(features),
                    targets: e.targets.clone(),
                    audio: None,
                }
            })
            .collect()
    }
}

impl Batcher<Vec<Example>, CtcBatch> for AugmentingBatcher {
    fn batch(&self, items: Vec<Vec<Example>>, device: &Device) -> CtcBatch {
        let examples: Vec<Example> = items.into_iter().flatten().collect();
        let call = self.call(&examples);
        let mut batch = CtcBatcher.make(&self.augment_call(&examples, call), device);
        batch.loss_weight = self.loss_weight;
        batch.step_threads = self.step_threads;
        // A stream of its own: past every utterance's index.
        batch.dropout_seed = Some(rng_for(self.seed, call, usize::MAX).next_u64());
        batch
    }
}

/// One training epoch's utterances drawn from several corpora with sampling weights: corpus
/// `i`'s utterances enter `⌊wᵢ⌋` times each, plus `round((wᵢ − ⌊wᵢ⌋)·nᵢ)` of them once more,
/// chosen at random under `seed`. A weight of 1 takes a corpus as it is, 2 twice, 0.5 a random
/// half, 0 none of it.
///
/// # Panics
/// When a weight is negative or not finite.
pub fn mix(corpora: Vec<(Vec<Example>, f64)>, seed: u64) -> Vec<Example> {
    use rand::SeedableRng;
    use rand::seq::SliceRandom;
    let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(seed ^ 0x6D69_785F_636F_7270);
    let mut out = Vec::new();
    for (i, (examples, weight)) in corpora.into_iter().enumerate() {
        assert!(
            weight.is_finite() && weight >= 0.0,
            "corpus {i}: the sampling weight must be finite and ≥ 0, got {weight}"
        );
        let whole = weight.floor() as usize;
        let extra = ((weight - weight.floor()) * examples.len() as f64).round() as usize;
        for _ in 0..whole {
            out.extend(examples.iter().cloned());
        }
        let mut order: Vec<usize> = (0..examples.len()).collect();
        order.shuffle(&mut rng);
        out.extend(
            order[..extra.min(examples.len())]
                .iter()
                .map(|&j| examples[j].clone()),
        );
    }
    out
}
