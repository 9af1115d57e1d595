//! Plain progress lines for burn-train when stdout is not a terminal: one line per quarter
//! epoch of training and one per validation, with the metrics' current values.

use std::collections::HashMap;

use burn::train::logger::{EvaluationProgressLogger, TrainingProgressLogger};
use burn::train::metric::{MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining,
};

/// A [`MetricsRenderer`] printing plain lines to stdout (for logs and pipes; the TUI is
/// used on a terminal).
#[derive(Debug, Default)]
pub struct ProgressLines {
    names: HashMap<MetricId, String>,
    train: Vec<(String, String)>,
    valid: Vec<(String, String)>,
    started: Option<std::time::Instant>,
    /// The epoch under way (from 1) and the run's last.
    epoch: usize,
    epochs: usize,
    /// The split under way (`train` or `valid`) and its number of items.
    split: String,
    split_items: usize,
}

fn record(
    names: &HashMap<MetricId, String>,
    values: &mut Vec<(String, String)>,
    state: MetricState,
) {
    let entry = match state {
        MetricState::Generic(entry) | MetricState::Numeric(entry, _) => entry,
    };
    let name = names
        .get(&entry.metric_id)
        .cloned()
        .unwrap_or_else(|| format!("{:?}", entry.metric_id));
    let value = entry.serialized_entry.formatted.clone();
    match values.iter_mut().find(|(n, _)| *n == name) {
        Some(slot) => slot.1 = value,
        None => values.push((name, value)),
    }
}

impl ProgressLines {
    /// The line of `done` items of the split under way, printed at every `1 / every` of the
    /// split (4 for training, 1 for validation) and at its end.
    fn line(&mut self, done: usize) {
        let every = if self.split == "train" { 4 } else { 1 };
        let total = self.split_items.max(1);
        let step = total.div_ceil(every).max(1);
        if done != total && !done.is_multiple_of(step) {
            return;
        }
        let started = *self.started.get_or_insert_with(std::time::Instant::now);
        let values = if self.split == "train" {
            &self.train
        } else {
            &self.valid
        };
        let metrics: Vec<String> = values.iter().map(|(n, v)| format!("{n}: {v}")).collect();
        println!(
            "[{:>6.0} s] epoch {}/{} {} {done}/{total} | {}",
            started.elapsed().as_secs_f64(),
            self.epoch,
            self.epochs,
            self.split,
            metrics.join(" | ")
        );
    }
}

impl MetricsRendererTraining for ProgressLines {
    fn update_train(&mut self, state: MetricState) {
        record(&self.names, &mut self.train, state);
    }

    fn update_valid(&mut self, state: MetricState) {
        record(&self.names, &mut self.valid, state);
    }
}

impl TrainingProgressLogger for ProgressLines {
    fn start(
        &mut self,
        total_epochs: usize,
        starting_epoch: usize,
        _total_items: Option<usize>,
        _label: Option<&str>,
    ) {
        self.epochs = total_epochs;
        self.epoch = starting_epoch;
    }

    fn update_epoch(&mut self, epoch: usize) {
        // burn-train reports the epoch that ended; the next one is under way.
        self.epoch = epoch + 1;
    }

    fn start_split(&mut self, split: &str, total_items: usize) {
        self.split = split.to_string();
        self.split_items = total_items;
    }

    fn update_split(&mut self, items_processed: usize) {
        self.line(items_processed);
    }

    fn end_split(&mut self) {}

    fn end(&mut self) {}

    fn log_event_training(&mut self, _event: String) {}
}

impl MetricsRendererEvaluation for ProgressLines {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}
}

impl EvaluationProgressLogger for ProgressLines {
    fn start_global_progress(&mut self, _total_tests: usize) {}

    fn start_test(&mut self, _name: &str, _total_items: usize) {}

    fn update_test_progress(&mut self, _items_processed: usize) {}

    fn end_test(&mut self) {}

    fn end_global_progress(&mut self) {}

    fn log_event_evaluation(&mut self, _event: String) {}
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names
            .insert(definition.metric_id, definition.name.to_string());
    }
}
