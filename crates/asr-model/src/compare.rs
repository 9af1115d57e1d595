//! The paper's tables for trained models: the attentions of Table 1's rows, and Table 2 and
//! Figure 1 (time per epoch, time to the best dev PER and test PER per attention, and dev PER
//! against forward time per utterance).

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Context;
use clustered_attention::{AttentionKind, ClusteredAttentionBackend};
use plotters::prelude::*;

use crate::data::{CtcBatch, CtcBatcher, Example, bucket};
use crate::model::AsrModel;
use crate::train::TrainingLog;

/// The attentions of the paper's Table 1 rows, with which every trained model is evaluated:
/// full, shared-full, lsh-1, lsh-4, clustered with `clusters` and `2 · clusters` clusters,
/// improved clustered with the same and `topk` keys, and oracle-top with `topk` keys.
pub fn table1_attentions(clusters: usize, topk: usize) -> [AttentionKind; 9] {
    // Reformer's chunks of the parser's default size.
    let lsh = |rounds: usize| -> AttentionKind {
        format!("lsh:{rounds}")
            .parse()
            .expect("lsh:X parses for X ≥ 1")
    };
    [
        AttentionKind::Full,
        AttentionKind::SharedFull,
        lsh(1),
        lsh(4),
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
    ]
}

/// One trained model's row of Table 2 and point of Figure 1.
#[derive(Debug, Clone)]
pub struct ModelSummary {
    /// Model directory.
    pub dir: PathBuf,
    /// Attention trained (and evaluated) with.
    pub attention: AttentionKind,
    /// Epochs trained.
    pub epochs: usize,
    /// Wall-clock seconds per epoch (training and validation).
    pub seconds_per_epoch: Option<f64>,
    /// Epoch with the lowest dev PER.
    pub best_epoch: usize,
    /// The lowest dev PER, in percent.
    pub best_dev_per: f64,
    /// Seconds from the start of training to the end of the best epoch.
    pub seconds_to_best: Option<f64>,
    /// Test PER of the final model, in percent.
    pub test_per: f64,
    /// Forward time per utterance over the dev split, in milliseconds.
    pub forward_ms: f64,
}

impl ModelSummary {
    /// Summarizes a model from its training log and a test PER and forward time measured by
    /// the caller.
    ///
    /// # Errors
    /// When the log has no epoch with a dev PER.
    pub fn new(
        dir: &Path,
        log: &TrainingLog,
        test_per: f64,
        forward_ms: f64,
    ) -> anyhow::Result<Self> {
        let best = log.best_epoch().with_context(|| {
            format!(
                "{}: no epoch with a dev PER in its training log",
                dir.display()
            )
        })?;
        Ok(Self {
            dir: dir.to_path_buf(),
            attention: log.attention,
            epochs: log.epochs.len(),
            seconds_per_epoch: log.seconds_per_epoch(),
            best_epoch: best.epoch,
            best_dev_per: best.dev_per,
            seconds_to_best: best.end_seconds,
            test_per,
            forward_ms,
        })
    }
}

/// Mean wall-clock time of the forward pass per utterance over `examples`, in milliseconds: batches
/// of at most `batch_frames` padded frames, each waited for
/// ([`burn::tensor::backend::Backend::sync`]).
pub fn forward_ms_per_utterance<B: ClusteredAttentionBackend>(
    model: &AsrModel<B>,
    examples: &[Example],
    batch_frames: usize,
    device: &B::Device,
) -> f64 {
    let batches: Vec<CtcBatch<B>> = bucket(examples.to_vec(), batch_frames)
        .iter()
        .map(|batch| CtcBatcher.make(batch, device))
        .collect();
    let start = Instant::now();
    for batch in batches {
        let out = model.forward(batch.features, &batch.frame_lengths);
        let _ = B::sync(device);
        drop(out);
    }
    start.elapsed().as_secs_f64() * 1000.0 / examples.len().max(1) as f64
}

fn seconds(s: Option<f64>) -> String {
    s.map_or("–".to_string(), |s| format!("{s:.0}"))
}

/// Table 2 as markdown: per model, time per epoch, best dev epoch, time to it, test PER and
/// forward time.
pub fn markdown_table(rows: &[ModelSummary]) -> String {
    let mut out = String::from(
        "| trained with | s / epoch | epochs | best dev PER (%) | at epoch | s to best | test PER (%) | forward ms / utt |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {} | {} | {:.2} | {:.1} |\n",
            r.attention,
            seconds(r.seconds_per_epoch),
            r.epochs,
            r.best_dev_per,
            r.best_epoch,
            seconds(r.seconds_to_best),
            r.test_per,
            r.forward_ms
        ));
    }
    out
}

/// Figure 1 (a) as SVG: best dev PER against forward time per utterance, one labelled point
/// per model.
///
/// # Errors
/// When the file cannot be written.
pub fn plot(path: &Path, rows: &[ModelSummary], caption: &str) -> anyhow::Result<()> {
    let draw = || -> Result<(), Box<dyn std::error::Error>> {
        let max_x = rows.iter().map(|r| r.forward_ms).fold(1.0, f64::max) * 1.2;
        let max_y = rows.iter().map(|r| r.best_dev_per).fold(1.0, f64::max) * 1.15;
        let min_y = rows.iter().map(|r| r.best_dev_per).fold(max_y, f64::min) * 0.85;
        let root = SVGBackend::new(path, (800, 550)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 20))
            .margin(15)
            .x_label_area_size(45)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_x, min_y..max_y)?;
        chart
            .configure_mesh()
            .x_desc("forward time per utterance (ms)")
            .y_desc("best dev PER (%)")
            .draw()?;
        for (i, r) in rows.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let point = (r.forward_ms, r.best_dev_per);
            chart.draw_series(std::iter::once(Circle::new(point, 5, color.filled())))?;
            chart.draw_series(std::iter::once(Text::new(
                r.attention.to_string(),
                point,
                ("sans-serif", 15).into_font(),
            )))?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{}: cannot draw the plot: {e}", path.display()))
}
