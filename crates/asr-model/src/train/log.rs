//! The per-epoch log of a training run (`training.json`), read by `asr compare`.

use std::path::Path;
use std::time::SystemTime;

use anyhow::Context;
use clustered_attention::AttentionKind;
use serde::{Deserialize, Serialize};

/// File of a model directory that holds its [`TrainingLog`].
pub const TRAINING_LOG: &str = "training.json";

/// What a training run took, per epoch: written by [`train`](super::train) as `dir/training.json`, read by
/// `asr compare` (the paper's Table 2).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainingLog {
    /// The attention trained with.
    pub attention: AttentionKind,
    /// Wall-clock seconds of the whole run (training and validation of every epoch).
    pub train_seconds: f64,
    /// The run continued from a checkpoint (`--resume`). burn-train 0.21 does not keep the
    /// per-epoch logs of the earlier run apart from the resumed one's, so a resumed run
    /// records no epochs.
    pub resumed: bool,
    /// Every epoch with a validation log, in order (empty for a resumed run).
    pub epochs: Vec<EpochLog>,
}

/// One epoch of a [`TrainingLog`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpochLog {
    /// Epoch number, from 1.
    pub epoch: usize,
    /// Seconds from the start of the run to the end of this epoch's validation (when burn-train
    /// last wrote its validation log); `None` when the log predates the run.
    pub end_seconds: Option<f64>,
    /// Phone error rate on the validation split (dev), in percent.
    pub dev_per: f64,
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

    /// Reads the validation logs burn-train wrote under `dir/valid/epoch-N/PER.log`
    /// (`value,phones` per batch) and their modification times.
    ///
    /// # Errors
    /// When a log cannot be read or parsed.
    pub fn read(
        dir: &Path,
        attention: AttentionKind,
        started: SystemTime,
        train_seconds: f64,
        resumed: bool,
    ) -> anyhow::Result<Self> {
        let mut epochs = Vec::new();
        for epoch in 1.. {
            if resumed {
                break;
            }
            let path = dir
                .join("valid")
                .join(format!("epoch-{epoch}"))
                .join("PER.log");
            if !path.exists() {
                break;
            }
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("{}: cannot read", path.display()))?;
            let (mut weighted, mut phones) = (0.0, 0.0);
            for (n, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let parsed = line.split_once(',').and_then(|(v, c)| {
                    Some((v.parse::<f64>().ok()?, c.trim().parse::<f64>().ok()?))
                });
                let Some((value, count)) = parsed else {
                    anyhow::bail!(
                        "{}:{}: expected `value,count`, got {line:?}",
                        path.display(),
                        n + 1
                    );
                };
                weighted += value * count;
                phones += count;
            }
            let modified = std::fs::metadata(&path)?.modified()?;
            epochs.push(EpochLog {
                epoch,
                end_seconds: modified
                    .duration_since(started)
                    .ok()
                    .map(|d| d.as_secs_f64()),
                dev_per: if phones > 0.0 {
                    weighted / phones
                } else {
                    f64::NAN
                },
            });
        }
        Ok(Self {
            attention,
            train_seconds,
            resumed,
            epochs,
        })
    }

    /// The epoch with the lowest dev PER (the first of equals).
    pub fn best_epoch(&self) -> Option<&EpochLog> {
        self.epochs
            .iter()
            .filter(|e| e.dev_per.is_finite())
            .min_by(|a, b| a.dev_per.total_cmp(&b.dev_per))
    }

    /// Seconds per epoch of this run: its wall time over the epochs it trained.
    pub fn seconds_per_epoch(&self) -> Option<f64> {
        let timed = self
            .epochs
            .iter()
            .filter(|e| e.end_seconds.is_some())
            .count();
        (timed > 0).then(|| self.train_seconds / timed as f64)
    }
}
