//! `asr clusters`: which encoder steps share a cluster, per layer and head, over one
//! utterance (a table and an SVG over its log-mel spectrogram).

use std::path::PathBuf;

use anyhow::{Context, bail};
use asr_model::clusters::ClusterMap;
use asr_model::data::{CtcBatcher, load_split};
use asr_model::features::LogMel;
use asr_model::phones::PhoneInventory;
use asr_model::train::load_model;
use backend_select::BackendName;
use burn::tensor::Device;
use clap::Args;
use clustered_attention::AttentionKind;

/// Arguments of `asr clusters`.
#[derive(Args, Debug)]
pub struct ClustersArgs {
    /// Trained model directory.
    #[arg(long)]
    model: PathBuf,
    /// Corpus directory.
    #[arg(long, default_value = "data/corpus")]
    corpus: PathBuf,
    /// Split of the utterance.
    #[arg(long, default_value = "dev")]
    split: String,
    /// Utterance id (default: the first of the split).
    #[arg(long)]
    utterance: Option<String>,
    /// Evaluate with this attention instead of the trained one (one that clusters the
    /// queries: clustered:C, improved:C:K, blocks:C or improved-blocks:C:K).
    #[arg(long)]
    attention: Option<AttentionKind>,
    /// Write the picture here (SVG).
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    pub backend: BackendName,
}

/// Clusters the utterance's queries in every layer on `device` and prints the table.
pub fn run(args: &ClustersArgs, _: BackendName, device: Device) -> anyhow::Result<()> {
    let (model, saved) = load_model(&args.model, &device)?;
    let model = match args.attention {
        Some(kind) => model.with_attention(kind),
        None => model,
    };
    let inventory =
        PhoneInventory::load(&args.corpus.join("phones.txt")).map_err(anyhow::Error::msg)?;
    let manifest = args.corpus.join(format!("{}.jsonl", args.split));
    let examples = load_split(&manifest, &inventory, &LogMel::new(saved.features.clone()))?;
    let example = match &args.utterance {
        Some(id) => examples
            .iter()
            .find(|e| &e.id == id)
            .with_context(|| format!("{}: no utterance {id:?}", manifest.display()))?,
        None => examples.first().context("the split is empty")?,
    };
    let batch = CtcBatcher.make(std::slice::from_ref(example), &device);
    let layers = model.query_clusters(batch.features, &batch.frame_lengths);
    let steps = model.output_length(example.features.frames);
    let mut assignments = Vec::new();
    for (l, clusters) in layers.into_iter().enumerate() {
        let Some(clusters) = clusters else {
            bail!(
                "layer {}: its attention ({}) does not cluster the queries; pass --attention",
                l + 1,
                args.attention.unwrap_or(saved.model.attention)
            );
        };
        let [_, heads, len] = clusters.assignments.dims();
        let values: Vec<i64> = clusters
            .assignments
            .into_data()
            .try_into_vec_as::<i64>()
            .expect("i64 assignments");
        assignments.push(
            (0..heads)
                .map(|h| {
                    values[h * len..h * len + steps]
                        .iter()
                        .map(|&c| c as usize)
                        .collect()
                })
                .collect(),
        );
    }
    let map = ClusterMap { assignments };
    let attention = args.attention.unwrap_or(saved.model.attention);
    println!(
        "{} of {} ({} encoder steps), model {} evaluated with {attention}",
        example.id,
        manifest.display(),
        steps,
        args.model.display(),
    );
    print!("{}", map.table());
    if let Some(path) = &args.svg {
        let caption = format!(
            "{}: the cluster of each encoder step, per layer and head ({attention}, {steps} steps)",
            example.id
        );
        map.plot(
            path,
            &example.features.data,
            example.features.n_mels,
            saved.model.subsampling,
            &caption,
        )?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
