//! `asr compare`: the paper's Table 2 and Figure 1 for trained models.

use std::path::PathBuf;

use anyhow::bail;
use asr_model::compare::{
    ModelSummary, forward_ms_per_utterance, markdown_table, plot, save_model_result,
};
use asr_model::data::load_split_of;
use asr_model::features::LogMel;
use asr_model::json::load_json;
use asr_model::train::{TrainingLog, evaluate, load_model};
use backend_select::BackendName;
use burn::tensor::Device;
use clap::Args;

/// Arguments of `asr compare`.
#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Trained model directories (each with model.json, its weights file and training.json).
    #[arg(long = "model", required_unless_present = "saved")]
    models: Vec<PathBuf>,
    /// Rows measured earlier (`--save`), tabulated after the models measured now.
    #[arg(long)]
    saved: Vec<PathBuf>,
    /// Save each measured model's row as JSON in this directory, as `<model directory
    /// name>.json` (replacing one there), for a later `--saved`.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Corpus directory (its dev split is timed, its test split scored); repeat it for the
    /// union of several corpora's splits.
    #[arg(long, default_value = "data/corpus")]
    corpus: Vec<PathBuf>,
    /// Backend of the forward-time measurement and the test PER.
    #[arg(long, value_enum, default_value = "flex")]
    pub backend: BackendName,
    /// Padded frames per batch.
    #[arg(long, default_value_t = 6000)]
    batch_frames: usize,
    /// Write Figure 1 here (SVG): final dev PER against forward time, and dev PER against
    /// training time.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Title of the plot.
    #[arg(long, default_value = "dev PER against forward time and training time")]
    caption: String,
}

/// Times and scores every model on `device`, prints the table and draws the plot.
pub fn run(args: &CompareArgs, _: BackendName, device: Device) -> anyhow::Result<()> {
    if args.models.is_empty() && args.save.is_some() {
        bail!("--save saves the models measured now, and no --model is given");
    }
    let mut rows = Vec::new();
    let mut loaded_splits = None;
    for dir in &args.models {
        let (model, saved) = load_model(dir, &device)?;
        let log = TrainingLog::load(dir)?;
        if loaded_splits.is_none() {
            let log_mel = LogMel::new(saved.features.clone());
            let (inventory, _, dev) = load_split_of(&args.corpus, "dev", &log_mel)?;
            let (_, _, test) = load_split_of(&args.corpus, "test", &log_mel)?;
            loaded_splits = Some((inventory, [dev, test]));
        }
        let (inventory, splits) = loaded_splits.as_ref().expect("loaded above");
        if saved.phones != inventory.phones() {
            bail!(
                "{}: the model's phone inventory differs from {}",
                dir.display(),
                args.corpus[0].display()
            );
        }
        let (dev, test) = (&splits[0], &splits[1]);
        // One untimed pass first: kernels, caches and allocations warm up.
        let warm_up = &dev[..dev.len().min(4)];
        forward_ms_per_utterance(&model, warm_up, args.batch_frames, &device);
        let forward_ms = forward_ms_per_utterance(&model, dev, args.batch_frames, &device);
        let test_per = evaluate(&model, test, None, args.batch_frames, &device).percent();
        let row = ModelSummary::new(dir, &log, saved.model.n_layers, test_per, forward_ms)?;
        if let Some(save) = &args.save {
            let path = save_model_result(save, dir, ".json", &row)?;
            eprintln!("wrote {}", path.display());
        }
        rows.push(row);
    }
    for path in &args.saved {
        rows.push(load_json(path)?);
    }
    print!("{}", markdown_table(&rows));
    if let Some(path) = &args.svg {
        plot(path, &rows, &args.caption)?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
