//! `asr join`: a corpus of long-form utterances, each speaker's consecutive clips joined.

use std::path::PathBuf;

use asr_model::join::{JoinOptions, join_corpus};
use clap::Args;

/// Arguments of `asr join`.
#[derive(Args, Debug)]
pub struct JoinArgs {
    /// Source corpus directory (phones.txt, train/dev/test.jsonl).
    #[arg(long)]
    corpus: PathBuf,
    /// Output corpus directory.
    #[arg(long)]
    out: PathBuf,
    /// Shortest utterance, in seconds.
    #[arg(long, default_value_t = 15.0)]
    min_seconds: f64,
    /// Mean target length, in seconds: each utterance's target is min + an exponential draw
    /// of mean (mean − min), at most max. Speakers whose clips run out end utterances short, so
    /// the joined mean is below it: 33 s gives about 770 encoder steps at time subsampling 4
    /// on the games' and the bundled corpus's training splits together (the paper's 780).
    #[arg(long, default_value_t = 33.0)]
    mean_seconds: f64,
    /// Longest utterance, in seconds.
    #[arg(long, default_value_t = 90.0)]
    max_seconds: f64,
    /// Silence between two joined clips, in seconds.
    #[arg(long = "pause-seconds", default_value_t = 0.25)]
    pause_s: f64,
    /// Seed of the target lengths.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Splits to join.
    #[arg(long = "split", default_values_t = ["train".to_string(), "dev".to_string(), "test".to_string()])]
    splits: Vec<String>,
    /// Time subsampling of the printed histogram of encoder steps.
    #[arg(long, default_value_t = 4)]
    subsampling: usize,
}

/// Joins the corpus and prints the length histogram per split.
pub fn run(args: JoinArgs) -> anyhow::Result<()> {
    let report = join_corpus(&JoinOptions {
        corpus: args.corpus.clone(),
        out: args.out.clone(),
        min_seconds: args.min_seconds,
        max_seconds: args.max_seconds,
        mean_seconds: args.mean_seconds,
        pause_s: args.pause_s,
        seed: args.seed,
        splits: args.splits,
    })?;
    println!("{} → {}", args.corpus.display(), args.out.display());
    for (split, (clips, seconds)) in &report.left_out {
        println!(
            "{split}: {} clips joined; {clips} clips ({seconds:.0} s) left out",
            report.clips_used[split]
        );
    }
    print!("{}", report.histogram(args.subsampling, 250));
    Ok(())
}
