//! The per-epoch log of a training run (`training.json`), read by `asr compare`.

use std::path::Path;

use anyhow::Context;
use clustered_attention::AttentionKind;
use serde::{Deserialize, Serialize};

use super::EpochRecord;

/// File of a model directory that holds its [`TrainingLog`].
pub const TRAINING_LOG: &str = "training.json";

/// What a training run took, per epoch: written by [`train`](super::train) as
/// `dir/training.json` from the run's [`EpochRecord`]s, read by `asr compare` (the paper's
/// Table 2 and Figure 1).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainingLog {
    /// The attention trained with.
    pub attention: AttentionKind,
    /// Seconds of the whole run: training and validation of every epoch, over every sitting
    /// of a resumed run; for a run stopped by its time budget, up to the stop.
    pub train_seconds: f64,
    /// The last sitting continued from a checkpoint (`--resume` with a checkpoint there).
    pub resumed: bool,
    /// Every epoch with a validation, in order.
    pub epochs: Vec<EpochLog>,
    /// The run's time budget in seconds (`--time-budget`), if it had one.
    #[serde(default)]
    pub time_budget_s: Option<f64>,
    /// The dev phone error rate of the final model, in percent, when the time budget stopped
    /// the run part-way through an epoch (else the last epoch's is the final one).
    #[serde(default)]
    pub final_dev_per: Option<f64>,
}

/// One epoch of a [`TrainingLog`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpochLog {
    /// Epoch number, from 1.
    pub epoch: usize,
    /// Seconds from the start of the run to the end of this epoch's validation
    /// ([`EpochRecord::total_seconds`]).
    pub end_seconds: Option<f64>,
    /// Phone error rate on the validation split (dev), in percent.
    pub dev_per: f64,
    /// Seconds of the epoch's training steps.
    #[serde(default)]
    pub train_seconds: Option<f64>,
    /// Seconds of its validation.
    #[serde(default)]
    pub valid_seconds: Option<f64>,
    /// Mean forward time per training batch, in milliseconds.
    #[serde(default)]
    pub forward_ms: Option<f64>,
    /// Peak resident memory of the process during the epoch, in MiB.
    #[serde(default)]
    pub peak_memory_mib: Option<f64>,
}

impl TrainingLog {
    /// Loads the log that [`train`](super::train) wrote into the model directory `dir`
    /// (`dir/training.json`).
    ///
    /// # Errors
    /// When the file cannot be read (the model was not trained there) or is malformed.
    pub fn load(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join(TRAINING_LOG);
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: cannot read (train the model first)", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: malformed", path.display()))
    }

    /// The log of a run whose epochs are `records`; its seconds are the last record's.
    pub fn new(attention: AttentionKind, records: &[EpochRecord], resumed: bool) -> Self {
        Self {
            attention,
            train_seconds: records.last().map_or(0.0, |r| r.total_seconds),
            resumed,
            epochs: records
                .iter()
                .map(|r| EpochLog {
                    epoch: r.epoch,
                    end_seconds: Some(r.total_seconds),
                    dev_per: r.dev_per,
                    train_seconds: Some(r.train_seconds),
                    valid_seconds: Some(r.valid_seconds),
                    forward_ms: Some(r.forward_ms),
                    peak_memory_mib: r.peak_memory_mib,
                })
                .collect(),
            time_budget_s: None,
            final_dev_per: None,
        }
    }

    /// The epoch with the lowest dev PER (the first of equals).
    pub fn best_epoch(&self) -> Option<&EpochLog> {
        self.epochs
            .iter()
            .filter(|e| e.dev_per.is_finite())
            .min_by(|a, b| a.dev_per.total_cmp(&b.dev_per))
    }

    /// The dev PER of the final model: [`Self::final_dev_per`] when the budget stopped the
    /// run part-way, else the last epoch's.
    pub fn last_dev_per(&self) -> Option<f64> {
        self.final_dev_per
            .or_else(|| self.epochs.last().map(|e| e.dev_per))
    }

    /// Seconds per epoch: the mean of the epochs' training and validation seconds where
    /// they are recorded, else the run's seconds over its epochs.
    pub fn seconds_per_epoch(&self) -> Option<f64> {
        let timed: Vec<f64> = self
            .epochs
            .iter()
            .filter_map(|e| Some(e.train_seconds? + e.valid_seconds?))
            .collect();
        if !timed.is_empty() {
            return Some(timed.iter().sum::<f64>() / timed.len() as f64);
        }
        (!self.epochs.is_empty()).then(|| self.train_seconds / self.epochs.len() as f64)
    }

    /// Seconds of training per epoch, validation left out (the mean over the epochs that
    /// record it).
    pub fn train_seconds_per_epoch(&self) -> Option<f64> {
        mean(self.epochs.iter().filter_map(|e| e.train_seconds))
    }

    /// Mean forward time per training batch over the run, in milliseconds.
    pub fn forward_ms(&self) -> Option<f64> {
        mean(self.epochs.iter().filter_map(|e| e.forward_ms))
    }

    /// The largest peak resident memory of any epoch, in MiB.
    pub fn peak_memory_mib(&self) -> Option<f64> {
        self.epochs
            .iter()
            .filter_map(|e| e.peak_memory_mib)
            .reduce(f64::max)
    }

    /// Seconds from the start of the run to the end of the first epoch whose dev PER is at
    /// most `per`.
    pub fn seconds_to(&self, per: f64) -> Option<f64> {
        self.epochs
            .iter()
            .find(|e| e.dev_per <= per)
            .and_then(|e| e.end_seconds)
    }
}

fn mean(values: impl Iterator<Item = f64>) -> Option<f64> {
    let values: Vec<f64> = values.collect();
    (!values.is_empty()).then(|| values.iter().sum::<f64>() / values.len() as f64)
}
