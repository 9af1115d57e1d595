//! Plain progress lines for burn-train when stdout is not a terminal: one line per quarter
//! epoch of training and one per validation, with the metrics' current values.

use std::collections::HashMap;

use burn::train::metric::{MetricDefinition, MetricId};
use burn::train::renderer::{
    EvaluationName, EvaluationProgress, MetricState, MetricsRenderer, MetricsRendererEvaluation,
    MetricsRendererTraining, ProgressType, TrainingProgress,
};

/// A [`MetricsRenderer`] printing plain lines to stdout (for logs and pipes; the TUI is
/// used on a terminal).
#[derive(Debug, Default)]
pub struct ProgressLines {
    names: HashMap<MetricId, String>,
    train: Vec<(String, String)>,
    valid: Vec<(String, String)>,
    started: Option<std::time::Instant>,
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
    fn line(&mut self, split: &str, item: &TrainingProgress, every: usize) {
        let Some(progress) = &item.progress else {
            return;
        };
        let done = progress.items_processed;
        let total = progress.items_total.max(1);
        let step = total.div_ceil(every).max(1);
        if done != total && done % step != 0 {
            return;
        }
        let started = *self.started.get_or_insert_with(std::time::Instant::now);
        let values = if split == "train" {
            &self.train
        } else {
            &self.valid
        };
        let metrics: Vec<String> = values.iter().map(|(n, v)| format!("{n}: {v}")).collect();
        println!(
            "[{:>6.0} s] epoch {}/{} {split} {done}/{total} | {}",
            started.elapsed().as_secs_f64(),
            item.global_progress.items_processed,
            item.global_progress.items_total,
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

    fn render_train(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        self.line("train", &item, 4);
    }

    fn render_valid(&mut self, item: TrainingProgress, _progress: Vec<ProgressType>) {
        self.line("valid", &item, 1);
    }
}

impl MetricsRendererEvaluation for ProgressLines {
    fn update_test(&mut self, _name: EvaluationName, _state: MetricState) {}

    fn render_test(&mut self, _item: EvaluationProgress, _progress: Vec<ProgressType>) {}
}

impl MetricsRenderer for ProgressLines {
    fn manual_close(&mut self) {}

    fn register_metric(&mut self, definition: MetricDefinition) {
        self.names.insert(definition.metric_id, definition.name);
    }
}
