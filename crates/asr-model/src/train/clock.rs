//! What each epoch of a run cost, kept across sittings (`epochs.jsonl` in the model
//! directory), and the wall-clock budget of `asr train --time-budget`.
//!
//! [`EpochClock`] is a burn-train metric logger: it hears the end of every training and
//! validation epoch and the metrics of every batch, and appends one [`EpochRecord`] per epoch
//! once its validation ends: training and validation seconds, seconds of training since the
//! run began (over every sitting of a resumed run), the mean forward time per batch, the
//! process's peak resident memory and the dev phone error rate. A resumed run keeps the
//! records of the epochs up to its checkpoint ([`EpochClock::resume`]). With a budget
//! ([`EpochClock::with_budget`]) it stops the training once the run's seconds reach it, when
//! it hears of the next training batch.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Context;
use burn::train::Interrupter;
use burn::train::logger::MetricLogger;
use burn::train::metric::store::{EpochSummary, MetricsUpdate, Split};
use burn::train::metric::{MetricDefinition, MetricId, NumericEntry};
use serde::{Deserialize, Serialize};

/// File of a model directory that holds its [`EpochRecord`]s, one JSON object per line.
pub const EPOCH_RECORDS: &str = "epochs.jsonl";

/// One epoch of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochRecord {
    /// Epoch number, from 1.
    pub epoch: usize,
    /// Wall-clock seconds of the epoch's training steps (data loading included).
    pub train_seconds: f64,
    /// Wall-clock seconds of its validation.
    pub valid_seconds: f64,
    /// Seconds from the start of the run to the end of this epoch's validation, counting
    /// only the time spent in training and validation of the epochs kept (a sitting's
    /// partial epoch before an interruption is not counted).
    pub total_seconds: f64,
    /// Mean wall-clock time of the forward pass of one training batch, in milliseconds.
    pub forward_ms: f64,
    /// The process's peak resident memory during the epoch, in MiB (Linux: `VmHWM`, reset
    /// at every epoch's start); `None` where it cannot be read.
    pub peak_memory_mib: Option<f64>,
    /// Phone error rate on the validation split, in percent.
    pub dev_per: f64,
}

/// Reads the records of `dir` (none when the file is absent).
///
/// # Errors
/// When the file cannot be read or a line is malformed.
pub fn read_records(dir: &Path) -> anyhow::Result<Vec<EpochRecord>> {
    let path = dir.join(EPOCH_RECORDS);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot read", path.display())),
    };
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str(line)
                .with_context(|| format!("{}:{}: malformed epoch record", path.display(), n + 1))
        })
        .collect()
}

/// The process's peak resident memory in MiB since the last reset (`reset_peak_memory`, at
/// the start of each epoch), from Linux's `/proc/self/status` (`VmHWM`).
pub fn peak_memory_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

/// Resets the peak of [`peak_memory_mib`] to the current resident memory (Linux: writes 5 to
/// `/proc/self/clear_refs`); does nothing where that is not possible.
pub fn reset_peak_memory() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

#[derive(Debug)]
struct ClockState {
    definitions: Vec<(MetricId, String)>,
    epoch_start: Instant,
    train_end: Option<Instant>,
    forward_ms_sum: f64,
    forward_batches: usize,
    dev_per: f64,
}

/// Seconds of training kept before this sitting, and this sitting's start: what
/// [`EpochClock`] counts from.
#[derive(Debug, Clone)]
pub struct RunTime {
    before: f64,
    sitting: Instant,
    budget_reached: Arc<AtomicBool>,
}

impl RunTime {
    /// A clock that counts `before` seconds of earlier sittings.
    pub fn new(before: f64) -> Self {
        Self {
            before,
            sitting: Instant::now(),
            budget_reached: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Seconds of the run so far: earlier sittings' and this one's (from the clock's creation,
    /// just before the training starts: loading a checkpoint and starting the data loaders
    /// count, in the first epoch of the sitting).
    pub fn seconds(&self) -> f64 {
        self.before + self.sitting.elapsed().as_secs_f64()
    }

    /// Whether the clock's budget stopped the training ([`EpochClock::with_budget`]).
    pub fn budget_reached(&self) -> bool {
        self.budget_reached.load(Ordering::SeqCst)
    }
}

/// The metric logger that writes [`EpochRecord`]s (see the module's documentation).
pub struct EpochClock {
    path: PathBuf,
    run: RunTime,
    state: ClockState,
    budget: Option<(f64, Interrupter)>,
}

impl EpochClock {
    /// A clock for a fresh run in `dir`: earlier records are removed.
    ///
    /// # Errors
    /// When the records cannot be removed.
    pub fn fresh(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join(EPOCH_RECORDS);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("{}: cannot remove", path.display())),
        }
        Ok(Self::new(path, 0.0))
    }

    /// A clock for a run resumed after epoch `checkpoint` in `dir`: the records of later
    /// epochs (written before an interruption, without a checkpoint) are dropped, and the
    /// run's seconds go on from the last one kept ([`resume_point`] picks a checkpoint whose
    /// epochs all have records). A run with no records at all (from before they were kept)
    /// resumes with its earlier seconds unknown, counted as 0.
    ///
    /// # Errors
    /// When the records cannot be read or rewritten, or some but not all epochs up to
    /// `checkpoint` have one.
    pub fn resume(dir: &Path, checkpoint: usize) -> anyhow::Result<Self> {
        let records: Vec<EpochRecord> = read_records(dir)?
            .into_iter()
            .filter(|r| r.epoch <= checkpoint)
            .collect();
        let epochs: Vec<usize> = records.iter().map(|r| r.epoch).collect();
        if !epochs.is_empty() && epochs != (1..=checkpoint).collect::<Vec<_>>() {
            anyhow::bail!(
                "{}: records of epochs {epochs:?}, expected 1 to {checkpoint} (the checkpoint resumed from)",
                dir.join(EPOCH_RECORDS).display()
            );
        }
        if epochs.is_empty() && checkpoint > 0 {
            eprintln!(
                "{}: no epoch records; the {checkpoint} epoch(s) before this sitting count 0 s",
                dir.display()
            );
        }
        let path = dir.join(EPOCH_RECORDS);
        let mut text = String::new();
        for r in &records {
            text.push_str(&serde_json::to_string(r).expect("a record serialises"));
            text.push('\n');
        }
        asr_data::files::write_atomic(&path, text.as_bytes())
            .with_context(|| format!("{}: cannot write", path.display()))?;
        let before = records.last().map_or(0.0, |r| r.total_seconds);
        Ok(Self::new(path, before))
    }

    fn new(path: PathBuf, before: f64) -> Self {
        reset_peak_memory();
        Self {
            path,
            run: RunTime::new(before),
            state: ClockState {
                definitions: Vec::new(),
                epoch_start: Instant::now(),
                train_end: None,
                forward_ms_sum: 0.0,
                forward_batches: 0,
                dev_per: f64::NAN,
            },
            budget: None,
        }
    }

    /// Stops the training through `interrupter` once the run's seconds
    /// ([`RunTime::seconds`]) reach `seconds`: checked whenever a training batch's metrics
    /// arrive (burn-train hands them over on a thread of its own, so one or two more steps
    /// may run before it stops). An epoch whose validation ends after the stop (cut short)
    /// gets no record.
    pub fn with_budget(mut self, seconds: f64, interrupter: Interrupter) -> Self {
        self.budget = Some((seconds, interrupter));
        self
    }

    /// The run's clock: seconds of training so far, over every sitting.
    pub fn run_time(&self) -> RunTime {
        self.run.clone()
    }
}

/// Name of the training metric [`ForwardTimeMetric`](super::ForwardTimeMetric).
pub const FORWARD_METRIC: &str = "forward ms";

impl MetricLogger for EpochClock {
    fn log(&mut self, update: MetricsUpdate, _epoch: usize, split: &Split) {
        if let (Split::Train, Some((seconds, interrupter))) = (split, &self.budget)
            && self.run.seconds() >= *seconds
        {
            self.run.budget_reached.store(true, Ordering::SeqCst);
            interrupter.stop(Some("--time-budget reached"));
        }
        let state = &mut self.state;
        for numeric in &update.entries_numeric {
            let Some((_, name)) = state
                .definitions
                .iter()
                .find(|(id, _)| *id == numeric.entry.metric_id)
            else {
                continue;
            };
            let name = name.clone();
            match (split, name.as_str(), &numeric.numeric_entry) {
                // Each batch's own value; not the epoch's final one, which burn-train logs
                // at the end of the split besides.
                (Split::Train, FORWARD_METRIC, Some(entry))
                    if !matches!(entry, NumericEntry::Final(_)) =>
                {
                    state.forward_ms_sum += entry.current();
                    state.forward_batches += 1;
                }
                // The epoch's value so far, and at the end of the split its final one (the
                // same).
                (Split::Valid, "PER", entry) => {
                    if let Some(value) = numeric.running_entry.as_ref().or(entry.as_ref()) {
                        state.dev_per = value.current();
                    }
                }
                _ => {}
            }
        }
    }

    fn read_numeric(
        &mut self,
        _name: &str,
        _epoch: usize,
        _split: &Split,
    ) -> Result<Vec<NumericEntry>, String> {
        Err("the epoch clock keeps no metric values".to_string())
    }

    fn log_metric_definition(&mut self, definition: MetricDefinition) {
        self.state
            .definitions
            .push((definition.metric_id, definition.name.to_string()));
    }

    fn log_epoch_summary(&mut self, summary: EpochSummary) {
        let now = Instant::now();
        let state = &mut self.state;
        match summary.split {
            Split::Train => state.train_end = Some(now),
            Split::Valid if self.run.budget_reached() => {}
            Split::Valid => {
                let train_end = state.train_end.unwrap_or(now);
                let record = EpochRecord {
                    epoch: summary.epoch_number,
                    train_seconds: (train_end - state.epoch_start).as_secs_f64(),
                    valid_seconds: (now - train_end).as_secs_f64(),
                    total_seconds: self.run.seconds(),
                    forward_ms: state.forward_ms_sum / state.forward_batches.max(1) as f64,
                    peak_memory_mib: peak_memory_mib(),
                    dev_per: state.dev_per,
                };
                if let Err(e) = append(&self.path, &record) {
                    eprintln!(
                        "{}: cannot append the epoch record: {e}",
                        self.path.display()
                    );
                }
                state.epoch_start = Instant::now();
                state.train_end = None;
                state.forward_ms_sum = 0.0;
                state.forward_batches = 0;
                state.dev_per = f64::NAN;
                reset_peak_memory();
            }
            Split::Test(_) => {}
        }
    }
}

fn append(path: &Path, record: &EpochRecord) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    // One write of the whole line: a process killed while appending leaves no part of it.
    let line = serde_json::to_string(record).expect("a record serialises") + "\n";
    file.write_all(line.as_bytes())?;
    file.sync_data()
}

/// The epoch a run in `dir` resumes after: the last one with a checkpoint (`checkpoints`)
/// whose epochs all have records (burn-train may write a checkpoint before the record of
/// its epoch arrives, so a run killed in between resumes from the checkpoint before); the
/// last checkpoint when the run has no records at all. `None`: start from scratch.
///
/// # Errors
/// When the records cannot be read.
pub fn resume_point(dir: &Path, checkpoints: &[usize]) -> anyhow::Result<Option<usize>> {
    let recorded: Vec<usize> = read_records(dir)?.iter().map(|r| r.epoch).collect();
    if recorded.is_empty() {
        return Ok(checkpoints.iter().copied().max());
    }
    let mut candidates = checkpoints.to_vec();
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    Ok(candidates
        .into_iter()
        .find(|&epoch| (1..=epoch).all(|e| recorded.contains(&e))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(epoch: usize) -> EpochRecord {
        EpochRecord {
            epoch,
            train_seconds: 10.0,
            valid_seconds: 1.0,
            total_seconds: 11.0 * epoch as f64,
            forward_ms: 5.0,
            peak_memory_mib: None,
            dev_per: 50.0,
        }
    }

    /// The resume point is the last checkpoint whose epochs all have records; without
    /// records, the last checkpoint; resuming drops the records past it and goes on from its
    /// seconds.
    #[test]
    fn resume_point_needs_a_record_for_every_epoch_up_to_the_checkpoint() {
        let dir = std::env::temp_dir().join(format!("asr-clock-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(resume_point(&dir, &[1, 3, 2]).unwrap(), Some(3));
        assert_eq!(resume_point(&dir, &[]).unwrap(), None);
        for epoch in [1, 2, 3] {
            append(&dir.join(EPOCH_RECORDS), &record(epoch)).unwrap();
        }
        // Checkpoint 4 was written before its record arrived.
        assert_eq!(resume_point(&dir, &[3, 4]).unwrap(), Some(3));
        assert_eq!(resume_point(&dir, &[4, 5]).unwrap(), None);
        let clock = EpochClock::resume(&dir, 2).unwrap();
        assert_eq!(read_records(&dir).unwrap(), vec![record(1), record(2)]);
        assert!(clock.run_time().seconds() >= 22.0);
        assert!(
            EpochClock::resume(&dir, 3).is_err(),
            "epoch 3's record was dropped"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
