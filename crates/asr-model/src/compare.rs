//! The paper's tables for trained models: the attentions of Table 1's rows, and Table 2 and
//! Figure 1 (time per epoch, time to a common dev PER and test PER per model; dev PER against
//! forward time per utterance and against training time).
//!
//! Rows of Table 2 ([`ModelSummary`]) and columns of Table 1 ([`Table1Column`]) serialize to
//! JSON ([`json::save_json`](crate::json::save_json),
//! [`json::load_json`](crate::json::load_json)), so a grid trained over several sittings, on
//! machines that keep no models between them, is tabulated from what each sitting measured.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, bail};
use burn::tensor::Device;
use clustered_attention::AttentionKind;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};

use crate::data::{CtcBatch, CtcBatcher, Example, bucket};
use crate::json::save_json;
use crate::model::AsrModel;
use crate::train::TrainingLog;

/// The attentions of the paper's Table 1 rows, with which every trained model is evaluated:
/// full, shared-full, lsh-1, lsh-4, clustered with `clusters` and `2 · clusters` clusters,
/// clustered over `clusters` position blocks, improved clustered with the same and `topk`
/// keys, improved over position blocks, and oracle-top with `topk` keys.
pub fn table1_attentions(clusters: usize, topk: usize) -> Vec<AttentionKind> {
    // Reformer's chunks of the parser's default size.
    let lsh = |rounds: usize| -> AttentionKind {
        format!("lsh:{rounds}")
            .parse()
            .expect("lsh:X parses for X ≥ 1")
    };
    vec![
        AttentionKind::Full,
        AttentionKind::SharedFull,
        lsh(1),
        lsh(4),
        AttentionKind::Clustered { clusters },
        AttentionKind::Clustered {
            clusters: 2 * clusters,
        },
        AttentionKind::Blocks { clusters },
        AttentionKind::Improved { clusters, topk },
        AttentionKind::Improved {
            clusters: 2 * clusters,
            topk,
        },
        AttentionKind::ImprovedBlocks { clusters, topk },
        AttentionKind::OracleTop { topk },
    ]
}

/// What every column of one Table 1 must share: the evaluation split, its size and the
/// attentions' settings. Compare two with [`Table1Setting::agrees_with`] (no exact
/// equality: the mean length may lose its last digit in JSON).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Table1Setting {
    /// The split's manifests, joined with ` + `.
    pub split: String,
    /// Utterances in the split.
    pub utterances: usize,
    /// Mean encoder steps per utterance.
    pub mean_steps: f64,
    /// Clusters C of the rows ([`table1_attentions`]).
    pub clusters: usize,
    /// Top keys K of the improved and oracle-top rows.
    pub topk: usize,
    /// How the outputs were decoded (greedy, or beam search with an LM).
    pub decoding: String,
}

impl Table1Setting {
    /// Whether two evaluations share split and settings: every field equal, the mean length
    /// to a relative 10⁻⁹ (it went through a JSON round trip, which may change its last
    /// digit).
    pub fn agrees_with(&self, other: &Self) -> bool {
        let close =
            (self.mean_steps - other.mean_steps).abs() <= 1e-9 * self.mean_steps.abs().max(1.0);
        close
            && (
                &self.split,
                self.utterances,
                self.clusters,
                self.topk,
                &self.decoding,
            ) == (
                &other.split,
                other.utterances,
                other.clusters,
                other.topk,
                &other.decoding,
            )
    }
}

/// One trained model's column of Table 1: its PER (percent) evaluated with each attention of
/// [`table1_attentions`], `None` where the attention does not apply (shared-QK attention on a
/// model not trained shared-QK).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Table1Column {
    /// Model directory.
    pub model: PathBuf,
    /// Attention the model was trained with.
    pub trained_with: AttentionKind,
    /// Split and settings of the evaluation.
    pub setting: Table1Setting,
    /// (evaluated with, PER) in the order of [`table1_attentions`].
    pub cells: Vec<(AttentionKind, Option<f64>)>,
    /// The machine of the evaluation ([`this_machine`]).
    pub machine: String,
}

/// Table 1 as markdown: a title line naming the split and settings, then one row per
/// evaluating attention and one column per model (trained with).
///
/// # Errors
/// When `columns` is empty, or two columns differ in split, settings or rows.
pub fn table1_markdown(columns: &[Table1Column]) -> anyhow::Result<String> {
    let Some(first) = columns.first() else {
        bail!("Table 1 needs at least one model");
    };
    for column in &columns[1..] {
        if !column.setting.agrees_with(&first.setting) {
            bail!(
                "{} was evaluated on {:?}, {} on {:?}: Table 1's columns must share split and settings",
                first.model.display(),
                first.setting,
                column.model.display(),
                column.setting
            );
        }
        let kinds = |c: &Table1Column| c.cells.iter().map(|(k, _)| *k).collect::<Vec<_>>();
        if kinds(column) != kinds(first) {
            bail!(
                "{} and {} were evaluated with different attentions",
                first.model.display(),
                column.model.display()
            );
        }
    }
    let s = &first.setting;
    let mut out = format!(
        "PER (%) on {} ({} utterances, mean {:.0} encoder steps, C = {}, K = {}, {}); columns: trained with, rows: evaluated with\n",
        s.split, s.utterances, s.mean_steps, s.clusters, s.topk, s.decoding
    );
    let header: Vec<String> = columns.iter().map(|c| c.trained_with.to_string()).collect();
    out.push_str(&format!("| evaluated with | {} |\n", header.join(" | ")));
    out.push_str(&format!("|---|{}\n", "---:|".repeat(columns.len())));
    for (row, (kind, _)) in first.cells.iter().enumerate() {
        let cells: Vec<String> = columns.iter().map(|c| number(c.cells[row].1, 2)).collect();
        out.push_str(&format!("| {kind} | {} |\n", cells.join(" | ")));
    }
    Ok(out)
}

/// The machine this process runs on, for the record of where a figure was measured: the
/// CPU's model name (from `/proc/cpuinfo`, else the architecture) and the number of CPUs the
/// process may use.
pub fn this_machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{cpu}, {cpus} CPUs")
}

/// Saves one model's result in `dir` (created if missing) as `<model directory
/// name><suffix>`, with [`save_json`], and returns the file's path.
///
/// # Errors
/// When `model` has no file name, or `dir` cannot be created or written.
pub fn save_model_result<T: Serialize>(
    dir: &Path,
    model: &Path,
    suffix: &str,
    value: &T,
) -> anyhow::Result<PathBuf> {
    let name = model
        .file_name()
        .with_context(|| format!("{}: a model directory has a name", model.display()))?;
    std::fs::create_dir_all(dir).with_context(|| format!("{}: cannot create", dir.display()))?;
    let path = dir.join(format!("{}{suffix}", name.to_string_lossy()));
    save_json(&path, value)?;
    Ok(path)
}

/// One trained model's row of Table 2 and point of Figure 1.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelSummary {
    /// Model directory.
    pub dir: PathBuf,
    /// Attention trained (and evaluated) with.
    pub attention: AttentionKind,
    /// Encoder layers.
    pub layers: usize,
    /// Epochs completed.
    pub epochs: usize,
    /// Wall-clock seconds per epoch (training and validation).
    pub seconds_per_epoch: Option<f64>,
    /// Wall-clock seconds per epoch of training alone.
    pub train_seconds_per_epoch: Option<f64>,
    /// Mean forward time of a training batch, in milliseconds.
    pub train_forward_ms: Option<f64>,
    /// Largest peak resident memory of an epoch, in MiB.
    pub peak_memory_mib: Option<f64>,
    /// Seconds of training of the whole run.
    pub train_seconds: f64,
    /// Epoch with the lowest dev PER (0: the final model, measured after a time budget
    /// stopped the run part-way through an epoch).
    pub best_epoch: usize,
    /// The lowest dev PER, in percent.
    pub best_dev_per: f64,
    /// Seconds from the start of training to the end of the best epoch.
    pub seconds_to_best: Option<f64>,
    /// Dev PER of the final model, in percent.
    pub final_dev_per: f64,
    /// Dev PER (percent) against seconds of training: every epoch's, then the final
    /// model's when a time budget stopped the run part-way.
    pub curve: Vec<(f64, f64)>,
    /// Test PER of the final model, in percent.
    pub test_per: f64,
    /// Forward time per utterance over the dev split, in milliseconds.
    pub forward_ms: f64,
    /// The run's time budget in seconds (`asr train --time-budget`), if it had one.
    #[serde(default)]
    pub time_budget_s: Option<f64>,
    /// The machine of the test PER and forward time ([`this_machine`]); `scripts/paper-tables.sh`
    /// measures each model right after training it, on the same machine.
    #[serde(default)]
    pub machine: String,
}

impl ModelSummary {
    /// Summarizes a model of `layers` layers from its training log and a test PER and
    /// forward time measured by the caller.
    ///
    /// # Errors
    /// When the log has no dev PER (no epoch, and no final measurement).
    pub fn new(
        dir: &Path,
        log: &TrainingLog,
        layers: usize,
        test_per: f64,
        forward_ms: f64,
    ) -> anyhow::Result<Self> {
        let mut curve: Vec<(f64, f64)> = log
            .epochs
            .iter()
            .filter_map(|e| Some((e.end_seconds?, e.dev_per)))
            .collect();
        if let Some(per) = log.final_dev_per {
            curve.push((log.train_seconds, per));
        }
        let final_dev_per = log
            .last_dev_per()
            .with_context(|| format!("{}: no dev PER in its training log", dir.display()))?;
        let (best_epoch, best_dev_per, seconds_to_best) = match log.best_epoch() {
            Some(best) if log.final_dev_per.is_none_or(|f| best.dev_per <= f) => {
                (best.epoch, best.dev_per, best.end_seconds)
            }
            _ => (0, final_dev_per, Some(log.train_seconds)),
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            attention: log.attention,
            layers,
            epochs: log.epochs.len(),
            seconds_per_epoch: log.seconds_per_epoch(),
            train_seconds_per_epoch: log.train_seconds_per_epoch(),
            train_forward_ms: log.forward_ms(),
            peak_memory_mib: log.peak_memory_mib(),
            train_seconds: log.train_seconds,
            best_epoch,
            best_dev_per,
            seconds_to_best,
            final_dev_per,
            curve,
            test_per,
            forward_ms,
            time_budget_s: log.time_budget_s,
            machine: this_machine(),
        })
    }

    /// The model's name in tables and plots: its attention and depth.
    pub fn label(&self) -> String {
        format!("{} ×{}", self.attention, self.layers)
    }

    /// Seconds of training until the dev PER was first at most `per` (`None`: never).
    pub fn seconds_to(&self, per: f64) -> Option<f64> {
        self.curve.iter().find(|(_, p)| *p <= per).map(|(s, _)| *s)
    }
}

/// The dev PER every model reached: the highest of their best dev PERs (the paper's Table 2
/// reports the time to convergence; with runs of equal budget the common target is the
/// worst model's best). One model that learned little makes it an easy target for the rest:
/// give `asr compare` the models to compare.
pub fn common_dev_per(rows: &[ModelSummary]) -> Option<f64> {
    rows.iter()
        .map(|r| r.best_dev_per)
        .filter(|p| p.is_finite())
        .reduce(f64::max)
}

/// Mean wall-clock time of the forward pass per utterance over `examples`, in milliseconds: batches
/// of at most `batch_frames` padded frames, each waited for
/// ([`burn::tensor::Device::sync`]).
pub fn forward_ms_per_utterance(
    model: &AsrModel,
    examples: &[Example],
    batch_frames: usize,
    device: &Device,
) -> f64 {
    let batches: Vec<CtcBatch> = bucket(examples.to_vec(), batch_frames)
        .iter()
        .map(|batch| CtcBatcher.make(batch, device))
        .collect();
    let start = Instant::now();
    for batch in batches {
        let out = model.forward(batch.features, &batch.frame_lengths);
        let _ = device.sync();
        drop(out);
    }
    start.elapsed().as_secs_f64() * 1000.0 / examples.len().max(1) as f64
}

fn number(value: Option<f64>, decimals: usize) -> String {
    value.map_or("–".to_string(), |v| format!("{v:.decimals$}"))
}

/// Table 2 as markdown: per model, its depth, epochs, time per epoch (with validation, and
/// training alone), forward time per training batch, peak memory, final and best dev PER,
/// the time to the dev PER every model reached ([`common_dev_per`]), test PER and forward
/// time per dev utterance; then the machine the rows were measured on, per row where they
/// differ.
pub fn markdown_table(rows: &[ModelSummary]) -> String {
    let common = common_dev_per(rows);
    let mut out = format!(
        "| trained with | layers | epochs | s / epoch | train s / epoch | forward ms / batch | peak memory (MiB) | final dev PER (%) | best dev PER (%) | s to {} % dev PER | test PER (%) | forward ms / utt |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        number(common, 2)
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.2} | {} | {:.2} | {:.1} |\n",
            r.attention,
            r.layers,
            r.epochs,
            number(r.seconds_per_epoch, 0),
            number(r.train_seconds_per_epoch, 0),
            number(r.train_forward_ms, 0),
            number(r.peak_memory_mib, 0),
            r.final_dev_per,
            r.best_dev_per,
            number(common.and_then(|c| r.seconds_to(c)), 0),
            r.test_per,
            r.forward_ms
        ));
    }
    fn machine(r: &ModelSummary) -> &str {
        if r.machine.is_empty() {
            "not recorded"
        } else {
            &r.machine
        }
    }
    let mut machines: Vec<&str> = rows.iter().map(machine).collect();
    machines.sort_unstable();
    machines.dedup();
    match machines.as_slice() {
        [] | ["not recorded"] => {}
        [one] => out.push_str(&format!("\nEvery row measured on one machine: {one}.\n")),
        _ => {
            out.push_str(
                "\nRows measured on different machines (times compare only between rows of one machine):\n",
            );
            for r in rows {
                out.push_str(&format!("- {}: {}\n", r.label(), machine(r)));
            }
        }
    }
    out
}

/// Figure 1 as SVG, two panels: (a) the final dev PER against the forward time per
/// utterance, one labelled point per model (the paper's Figure 1a); (b) the dev PER against
/// minutes of training, one line per model.
///
/// # Errors
/// When the file cannot be written.
pub fn plot(path: &Path, rows: &[ModelSummary], caption: &str) -> anyhow::Result<()> {
    let mut svg = String::new();
    let mut draw = || -> Result<(), Box<dyn std::error::Error>> {
        let root = SVGBackend::with_string(&mut svg, (1300, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let root = root.titled(caption, ("sans-serif", 20))?;
        let (left, right) = root.split_horizontally(620);
        let pers = rows
            .iter()
            .flat_map(|r| r.curve.iter().map(|(_, p)| *p).chain([r.final_dev_per]))
            .filter(|p| p.is_finite());
        let (lo, hi) = pers.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
            (lo.min(p), hi.max(p))
        });
        let (lo, hi) = if lo.is_finite() {
            (lo, hi)
        } else {
            (0.0, 100.0)
        };
        let span = (hi - lo).max(1.0);
        let finals = rows
            .iter()
            .map(|r| r.final_dev_per)
            .filter(|p| p.is_finite());
        let (flo, fhi) = finals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| {
            (lo.min(p), hi.max(p))
        });
        let (flo, fhi) = if flo.is_finite() {
            (flo, fhi)
        } else {
            (lo, hi)
        };
        let fspan = (fhi - flo).max(1.0);
        let max_x = rows.iter().map(|r| r.forward_ms).fold(1.0, f64::max) * 1.25;
        let mut chart = ChartBuilder::on(&left)
            .caption("(a) final dev PER against forward time", ("sans-serif", 16))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_x, (flo - 0.1 * fspan)..(fhi + 0.15 * fspan))?;
        chart
            .configure_mesh()
            .x_desc("forward time per dev utterance (ms)")
            .y_desc("final dev PER (%)")
            .draw()?;
        for (i, r) in rows.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let point = (r.forward_ms, r.final_dev_per);
            chart.draw_series(std::iter::once(Circle::new(point, 5, color.filled())))?;
            chart.draw_series(std::iter::once(Text::new(
                r.label(),
                point,
                ("sans-serif", 13).into_font(),
            )))?;
        }
        let max_minutes = rows
            .iter()
            .flat_map(|r| r.curve.iter().map(|(s, _)| s / 60.0))
            .fold(1.0, f64::max)
            * 1.05;
        let mut chart = ChartBuilder::on(&right)
            .caption("(b) dev PER against training time", ("sans-serif", 16))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_minutes, (lo - 0.05 * span)..(hi + 0.05 * span))?;
        chart
            .configure_mesh()
            .x_desc("training time (minutes)")
            .y_desc("dev PER (%)")
            .draw()?;
        for (i, r) in rows.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let points: Vec<(f64, f64)> = r.curve.iter().map(|(s, p)| (s / 60.0, *p)).collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                .label(r.label())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                });
            chart.draw_series(
                points
                    .into_iter()
                    .map(|p| Circle::new(p, 3, color.filled())),
            )?;
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()?;
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{}: cannot draw the plot: {e}", path.display()))?;
    asr_data::files::write_atomic(path, svg.as_bytes())
        .with_context(|| format!("{}: cannot write the plot", path.display()))
}
