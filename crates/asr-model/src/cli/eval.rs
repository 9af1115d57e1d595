//! `asr eval`: the phone error rates of trained models, with their own or another attention,
//! or the paper's Table 1.

use std::path::PathBuf;

use anyhow::bail;
use asr_model::compare::{
    Table1Column, Table1Setting, save_model_result, table1_attentions, table1_markdown,
    this_machine,
};
use asr_model::data::load_split_of;
use asr_model::decode::{BeamSearch, PhoneLm};
use asr_model::features::LogMel;
use asr_model::json::load_json;
use asr_model::manifest::read_manifest;
use asr_model::phones::PhoneInventory;
use asr_model::train::{evaluate_with, load_model};
use backend_select::BackendName;
use burn::tensor::Device;
use clap::Args;
use clustered_attention::AttentionKind;

/// Arguments of `asr eval`.
#[derive(Args, Debug)]
pub struct EvalArgs {
    /// Trained model directories (each with model.json and its weights file).
    #[arg(long = "model", required_unless_present = "saved")]
    models: Vec<PathBuf>,
    /// Corpus directory; repeat it to evaluate on the union of the corpora's splits (their
    /// phone inventories must agree).
    #[arg(long, default_value = "data/corpus")]
    corpus: Vec<PathBuf>,
    /// Split to evaluate.
    #[arg(long, default_value = "test")]
    split: String,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    pub backend: BackendName,
    /// Evaluate with this attention instead of the trained one.
    #[arg(long, conflicts_with = "table")]
    attention: Option<AttentionKind>,
    /// Print the paper's Table 1: every model (columns, trained with) evaluated with full,
    /// shared-full, lsh:1, lsh:4, clustered:C, clustered:2C, improved:C:K, improved:2C:K and
    /// oracle:K (rows); shared-QK rows are left empty (–) for models not trained shared-QK.
    #[arg(long)]
    table: bool,
    /// Save each model's column of the table as JSON in this directory, as `<model directory
    /// name>.table1.json` (replacing one there), for a later `--saved`.
    #[arg(long, requires = "table")]
    save: Option<PathBuf>,
    /// Columns of the table evaluated earlier (`--save`), placed after the models evaluated
    /// now; their split and settings must match.
    #[arg(long, requires = "table")]
    saved: Vec<PathBuf>,
    /// Clusters C of the table (default: the mean number of encoder steps / 8).
    #[arg(long)]
    clusters: Option<usize>,
    /// Top keys K of the table's improved and oracle-top attention.
    #[arg(long, default_value_t = 32)]
    topk: usize,
    /// Padded frames per batch.
    #[arg(long, default_value_t = 6000)]
    batch_frames: usize,
    /// Decode by CTC prefix beam search with a phone n-gram LM counted on this corpus's
    /// training split (repeat it for several corpora), instead of greedily. The defaults of
    /// the four options below were tuned on the dev splits of the main job's three corpora.
    #[arg(long = "lm-corpus")]
    lm_corpora: Vec<PathBuf>,
    /// Order n of the phone LM.
    #[arg(long, default_value_t = 5, requires = "lm_corpora")]
    lm_order: usize,
    /// Weight α of the LM's log-probabilities.
    #[arg(long, default_value_t = 0.4, requires = "lm_corpora")]
    lm_weight: f64,
    /// Bonus β per emitted phone.
    #[arg(long, default_value_t = 1.0, requires = "lm_corpora")]
    insertion_bonus: f64,
    /// Prefixes kept per step of the beam search.
    #[arg(long, default_value_t = 8, requires = "lm_corpora")]
    beam: usize,
}

/// The beam search of `--lm-corpus`, when given.
fn beam_search_of(
    args: &EvalArgs,
    inventory: &PhoneInventory,
) -> anyhow::Result<Option<BeamSearch>> {
    if args.lm_corpora.is_empty() {
        return Ok(None);
    }
    if args.lm_order == 0 || args.beam == 0 {
        bail!(
            "--lm-order and --beam must be at least 1, got {} and {}",
            args.lm_order,
            args.beam
        );
    }
    let mut utterances = Vec::new();
    for corpus in &args.lm_corpora {
        let phones =
            PhoneInventory::load(&corpus.join("phones.txt")).map_err(anyhow::Error::msg)?;
        if phones.phones() != inventory.phones() {
            bail!(
                "{}: its phone inventory differs from the evaluated corpus's",
                corpus.display()
            );
        }
        utterances.extend(read_manifest(
            &corpus.join("train.jsonl"),
            inventory,
            false,
        )?);
    }
    let lm = PhoneLm::new(
        args.lm_order,
        inventory.n_outputs(),
        utterances.iter().map(|u| u.targets.as_slice()),
    );
    Ok(Some(BeamSearch {
        lm,
        width: args.beam,
        lm_weight: args.lm_weight,
        insertion_bonus: args.insertion_bonus,
    }))
}

/// Evaluates on `device` and prints a markdown table.
pub fn run(args: &EvalArgs, _: BackendName, device: Device) -> anyhow::Result<()> {
    if args.models.is_empty() {
        if args.save.is_some() || !args.lm_corpora.is_empty() || args.clusters.is_some() {
            bail!(
                "--save, --lm-corpus and --clusters apply to the models evaluated now, and no --model is given"
            );
        }
        let columns = saved_columns(args)?;
        print!("{}", table1_markdown(&columns)?);
        return Ok(());
    }
    let mut loaded = Vec::new();
    for dir in &args.models {
        loaded.push(load_model(dir, &device)?);
    }
    let log_mel = LogMel::new(loaded[0].1.features.clone());
    let (inventory, manifests, examples) = load_split_of(&args.corpus, &args.split, &log_mel)?;
    let split = manifests
        .iter()
        .map(|m| m.display().to_string())
        .collect::<Vec<_>>()
        .join(" + ");
    for (dir, (_, saved)) in args.models.iter().zip(&loaded) {
        if saved.phones != inventory.phones() {
            bail!(
                "{}: the model's phone inventory differs from {}",
                dir.display(),
                args.corpus[0].display()
            );
        }
    }
    let steps: f64 = examples
        .iter()
        .map(|e| e.features.frames.div_ceil(loaded[0].1.model.subsampling) as f64)
        .sum::<f64>()
        / examples.len() as f64;
    let clusters = args
        .clusters
        .unwrap_or(((steps / 8.0).round() as usize).max(1));
    let search = beam_search_of(args, &inventory)?;
    let per = |model, kind| {
        evaluate_with(
            model,
            &examples,
            kind,
            args.batch_frames,
            &device,
            search.as_ref(),
        )
    };
    let decoding = match &search {
        Some(_) => format!(
            "CTC prefix beam search with a phone {}-gram LM of {} (weight {}, bonus {}, beam {})",
            args.lm_order,
            args.lm_corpora
                .iter()
                .map(|c| c.display().to_string())
                .collect::<Vec<_>>()
                .join(" + "),
            args.lm_weight,
            args.insertion_bonus,
            args.beam
        ),
        None => "greedy decoding".to_string(),
    };
    if !args.table {
        println!(
            "PER (%) on {} ({} utterances, mean {:.0} encoder steps, {decoding})",
            split,
            examples.len(),
            steps
        );
        println!("| model | trained with | evaluated with | PER |\n|---|---|---|---:|");
        for (dir, (model, saved)) in args.models.iter().zip(&loaded) {
            let kind = args.attention.unwrap_or(saved.model.attention);
            println!(
                "| {} | {} | {kind} | {:.2} |",
                dir.display(),
                saved.model.attention,
                per(model, Some(kind)).percent()
            );
        }
        return Ok(());
    }
    let setting = Table1Setting {
        split,
        utterances: examples.len(),
        mean_steps: steps,
        clusters,
        topk: args.topk,
        decoding,
    };
    let mut columns = Vec::new();
    for (dir, (model, saved)) in args.models.iter().zip(&loaded) {
        let cells = table1_attentions(clusters, args.topk)
            .into_iter()
            .map(|kind| {
                let cell = (!kind.is_shared_qk() || model.shared_qk())
                    .then(|| per(model, Some(kind)).percent());
                (kind, cell)
            })
            .collect();
        let column = Table1Column {
            model: dir.clone(),
            trained_with: saved.model.attention,
            setting: setting.clone(),
            cells,
            machine: this_machine(),
        };
        if let Some(save) = &args.save {
            let path = save_model_result(save, dir, ".table1.json", &column)?;
            eprintln!("wrote {}", path.display());
        }
        columns.push(column);
    }
    columns.extend(saved_columns(args)?);
    print!("{}", table1_markdown(&columns)?);
    Ok(())
}

/// The columns of `--saved`.
fn saved_columns(args: &EvalArgs) -> anyhow::Result<Vec<Table1Column>> {
    args.saved.iter().map(|path| load_json(path)).collect()
}
