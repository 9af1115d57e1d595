//! `text-encoder`: sentence embeddings of a pretrained BERT-family checkpoint with full,
//! clustered or improved clustered attention, and the approximation experiment (the paper's
//! Table 4 analogue).

use std::path::PathBuf;

use anyhow::{Context, bail};
use backend_select::BackendName;
use burn::tensor::Device;
use clap::{Parser, Subcommand};
use clustered_attention::AttentionKind;
use text_encoder::approx::{ApproxOptions, approximate, markdown};
use text_encoder::data::read_snippets;
use text_encoder::probe::ProbeOptions;
use text_encoder::{WordPieceTokenizer, batch, load_pretrained};

#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the sentence embedding of each text as a JSON array.
    Embed(EmbedArgs),
    /// Replace the attention of the pretrained encoder without retraining and measure what
    /// changes on long documents: mean cosine with full attention's embeddings and the
    /// accuracy of a sentiment probe trained on full attention's (the paper's Table 4
    /// analogue). Prints a markdown table and writes CSV.
    Approx(ApproxArgs),
}

#[derive(clap::Args)]
struct EmbedArgs {
    /// Checkpoint directory: config.json, model.safetensors, tokenizer.json.
    #[arg(long, default_value = "data/minilm")]
    model: PathBuf,
    /// Attention: full, clustered:C, improved:C:K or oracle:K.
    #[arg(long, default_value = "full")]
    attention: AttentionKind,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
    /// Texts to embed.
    #[arg(required = true)]
    texts: Vec<String>,
}

#[derive(clap::Args)]
struct ApproxArgs {
    /// Checkpoint directory: config.json, model.safetensors, tokenizer.json.
    #[arg(long, default_value = "data/minilm")]
    model: PathBuf,
    /// The rated sentences (scripts/get-minilm.sh).
    #[arg(
        long,
        default_value = "data/rotten-tomatoes/movieReviewSnippets_GroundTruth.txt"
    )]
    data: PathBuf,
    /// Input lengths in tokens, [CLS] and [SEP] included.
    #[arg(long, value_delimiter = ',', default_value = "128,256,512")]
    lengths: Vec<usize>,
    /// Cluster counts C.
    #[arg(long, value_delimiter = ',', default_value = "25,50")]
    clusters: Vec<usize>,
    /// Keys recomputed exactly per cluster (improved) and kept per query (oracle-top).
    #[arg(long, default_value_t = 32)]
    topk: usize,
    /// Leave out oracle-top.
    #[arg(long)]
    no_oracle: bool,
    /// Documents per forward pass.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// At most this many documents per length (evenly spaced through the file).
    #[arg(long)]
    max_documents: Option<usize>,
    /// Timed passes per attention at the longest length.
    #[arg(long, default_value_t = 5)]
    timing_repeats: usize,
    /// CSV output.
    #[arg(long, default_value = "runs/approx.csv")]
    csv: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    backend: BackendName,
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Embed(args) => run_embed(&args, &args.backend.device()?),
        Command::Approx(args) => run_approx(&args, &args.backend.device()?),
    }
}

fn run_embed(args: &EmbedArgs, device: &Device) -> anyhow::Result<()> {
    let model = load_pretrained(&args.model, args.attention, device)?;
    let tokenizer = WordPieceTokenizer::from_file(&args.model.join("tokenizer.json"))?;
    tokenizer.check_fits(model.vocab_size())?;
    for (i, text) in args.texts.iter().enumerate() {
        let ids = tokenizer.encode(text)?;
        if ids.len() > model.max_len() {
            bail!(
                "text {} ({} characters) has {} tokens; the model takes at most {}",
                i + 1,
                text.chars().count(),
                ids.len(),
                model.max_len()
            );
        }
        let (tokens, lengths) = batch(&[ids], tokenizer.pad_id(), device);
        let embedding = model
            .sentence_embeddings(tokens, lengths)
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32 embedding");
        println!("{}", serde_json::to_string(&embedding)?);
    }
    Ok(())
}

fn run_approx(args: &ApproxArgs, device: &Device) -> anyhow::Result<()> {
    let model = load_pretrained(&args.model, AttentionKind::Full, device)?;
    let tokenizer = WordPieceTokenizer::from_file(&args.model.join("tokenizer.json"))?;
    tokenizer.check_fits(model.vocab_size())?;
    let snippets = read_snippets(&args.data)?;
    let options = ApproxOptions {
        lengths: args.lengths.clone(),
        clusters: args.clusters.clone(),
        topk: args.topk,
        oracle: !args.no_oracle,
        batch_size: args.batch_size,
        max_documents: args.max_documents,
        timing_repeats: args.timing_repeats,
        probe: ProbeOptions::default(),
    };
    let rows = approximate(&model, &tokenizer, &snippets, &options, device)?;
    print!("{}", markdown(&rows, args.batch_size));
    if let Some(dir) = args.csv.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let mut writer = csv::Writer::from_path(&args.csv)
        .with_context(|| format!("cannot write {}", args.csv.display()))?;
    for row in &rows {
        writer.serialize(row)?;
    }
    writer.flush()?;
    eprintln!("wrote {}", args.csv.display());
    Ok(())
}
