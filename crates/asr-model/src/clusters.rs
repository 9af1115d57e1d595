//! Which encoder steps share a cluster: per layer and head of a trained model, over one
//! utterance (`asr clusters`). The reviewers of the paper asked whether the clusters follow
//! position or content; [`ClusterMap`] answers with two numbers per head and a picture.
//!
//! - runs per cluster: the maximal runs of consecutive steps in one cluster, over the
//!   clusters used; 1 when every cluster is one contiguous block (position alone), larger
//!   when a cluster gathers steps from several places of the utterance (content);
//! - span: the mean, over the clusters used, of the share of the utterance between a
//!   cluster's first and last step; about `1 / C` for position blocks.

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

/// The cluster of each step of one utterance, per layer and head.
#[derive(Debug, Clone, PartialEq)]
pub struct ClusterMap {
    /// `[layer][head][step]`: the cluster of each valid step.
    pub assignments: Vec<Vec<Vec<usize>>>,
}

/// The two numbers of one head (see the module's documentation).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterShape {
    /// Clusters with at least one step.
    pub clusters_used: usize,
    /// Maximal runs of consecutive steps of one cluster, per cluster used.
    pub runs_per_cluster: f64,
    /// Mean share of the utterance between a cluster's first and last step.
    pub span: f64,
}

impl ClusterShape {
    /// The shape of one head's assignments (one cluster per step).
    pub fn of(assignments: &[usize]) -> Self {
        let steps = assignments.len().max(1);
        let mut first = std::collections::BTreeMap::<usize, (usize, usize)>::new();
        for (t, &c) in assignments.iter().enumerate() {
            first.entry(c).and_modify(|e| e.1 = t).or_insert((t, t));
        }
        let runs = assignments
            .iter()
            .enumerate()
            .filter(|(t, c)| *t == 0 || assignments[t - 1] != **c)
            .count();
        let used = first.len().max(1);
        Self {
            clusters_used: first.len(),
            runs_per_cluster: runs as f64 / used as f64,
            span: first
                .values()
                .map(|(a, b)| (b - a + 1) as f64 / steps as f64)
                .sum::<f64>()
                / used as f64,
        }
    }
}

impl ClusterMap {
    /// A markdown table: per layer and head, the clusters used, the runs per cluster and the
    /// span.
    pub fn table(&self) -> String {
        let mut out = String::from(
            "| layer | head | clusters used | runs per cluster | span |\n|---:|---:|---:|---:|---:|\n",
        );
        for (l, heads) in self.assignments.iter().enumerate() {
            for (h, row) in heads.iter().enumerate() {
                let shape = ClusterShape::of(row);
                out.push_str(&format!(
                    "| {} | {} | {} | {:.2} | {:.3} |\n",
                    l + 1,
                    h + 1,
                    shape.clusters_used,
                    shape.runs_per_cluster,
                    shape.span
                ));
            }
        }
        out
    }

    /// Draws the utterance's log-mel spectrogram (`[frames, n_mels]` row-major,
    /// `subsampling` frames per step, averaged to one column per step) above one strip per
    /// layer and head, each step coloured by its cluster, as SVG.
    ///
    /// # Errors
    /// When the file cannot be written.
    pub fn plot(
        &self,
        path: &Path,
        features: &[f32],
        n_mels: usize,
        subsampling: usize,
        caption: &str,
    ) -> anyhow::Result<()> {
        let steps = self
            .assignments
            .first()
            .and_then(|h| h.first())
            .map_or(0, Vec::len);
        let frames = features.len() / n_mels.max(1);
        let strips: usize = self.assignments.iter().map(Vec::len).sum();
        let (left, top, strip, gap) = (130i32, 40i32, 12i32, 3i32);
        let mel_px = 3i32;
        let width = 1400u32;
        let spectrogram_h = mel_px * n_mels as i32;
        let height = (top + spectrogram_h + 20 + strips as i32 * (strip + gap) + 20) as u32;
        let column = (width as i32 - left - 20) as f64 / steps.max(1) as f64;
        let x = |t: usize| left + (t as f64 * column).round() as i32;
        let mut svg = String::new();
        let mut draw = || -> Result<(), Box<dyn std::error::Error>> {
            let root = SVGBackend::with_string(&mut svg, (width, height)).into_drawing_area();
            root.fill(&WHITE)?;
            root.draw(&Text::new(caption, (10, 10), ("sans-serif", 16)))?;
            // The spectrogram, one column per step, 10 grey levels, runs merged.
            let mut columns = vec![0f32; steps * n_mels];
            for t in 0..steps {
                let frames_of = (t * subsampling)..((t + 1) * subsampling).min(frames);
                let count = frames_of.len().max(1) as f32;
                for f in frames_of {
                    for m in 0..n_mels {
                        columns[t * n_mels + m] += features[f * n_mels + m] / count;
                    }
                }
            }
            let (lo, hi) = columns
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
                    (a.min(v), b.max(v))
                });
            let level = |v: f32| (((v - lo) / (hi - lo).max(1e-6)) * 9.0).round() as u8;
            for m in 0..n_mels {
                let y = top + spectrogram_h - (m as i32 + 1) * mel_px;
                let mut t = 0;
                while t < steps {
                    let l = level(columns[t * n_mels + m]);
                    let mut end = t + 1;
                    while end < steps && level(columns[end * n_mels + m]) == l {
                        end += 1;
                    }
                    let grey = 255 - l * 25;
                    root.draw(&Rectangle::new(
                        [(x(t), y), (x(end), y + mel_px)],
                        RGBColor(grey, grey, grey).filled(),
                    ))?;
                    t = end;
                }
            }
            root.draw(&Text::new(
                "log-mel",
                (10, top + spectrogram_h / 2),
                ("sans-serif", 13),
            ))?;
            let mut y = top + spectrogram_h + 20;
            for (l, heads) in self.assignments.iter().enumerate() {
                for (h, row) in heads.iter().enumerate() {
                    root.draw(&Text::new(
                        format!("layer {}, head {}", l + 1, h + 1),
                        (10, y),
                        ("sans-serif", 11),
                    ))?;
                    let mut t = 0;
                    while t < row.len() {
                        let mut end = t + 1;
                        while end < row.len() && row[end] == row[t] {
                            end += 1;
                        }
                        // Hues spread by the golden ratio, so neighbouring ids differ.
                        let hue = (row[t] as f64 * 0.618_033_988_75).fract();
                        root.draw(&Rectangle::new(
                            [(x(t), y), (x(end), y + strip)],
                            HSLColor(hue, 0.65, 0.5).filled(),
                        ))?;
                        t = end;
                    }
                    y += strip + gap;
                }
            }
            root.present()?;
            Ok(())
        };
        draw().map_err(|e| anyhow::anyhow!("{}: cannot draw the plot: {e}", path.display()))?;
        asr_data::files::write_atomic(path, svg.as_bytes())
            .with_context(|| format!("{}: cannot write the plot", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::ClusterShape;

    /// Position blocks give one run per cluster and spans of 1/C; a cluster whose steps
    /// alternate with another's gives one run per step and a span near 1.
    #[test]
    fn cluster_shape_tells_blocks_from_scattered_clusters() {
        let blocks: Vec<usize> = (0..12).map(|t| t / 3).collect();
        let shape = ClusterShape::of(&blocks);
        assert_eq!(shape.clusters_used, 4);
        assert_eq!(shape.runs_per_cluster, 1.0);
        assert!((shape.span - 0.25).abs() < 1e-12);
        let alternating: Vec<usize> = (0..12).map(|t| t % 2).collect();
        let shape = ClusterShape::of(&alternating);
        assert_eq!(shape.clusters_used, 2);
        assert_eq!(shape.runs_per_cluster, 6.0);
        // Each cluster spans 11 of the 12 steps.
        assert!((shape.span - 11.0 / 12.0).abs() < 1e-12, "{}", shape.span);
    }
}
