//! `asr manifest`: a corpus split (JSONL manifest + phones.txt) from recordings and
//! transcripts.

use std::path::PathBuf;

use asr_model::manifest::{ImportOptions, Source, import};
use clap::Args;

/// Arguments of `asr manifest`.
#[derive(Args, Debug)]
#[command(group(clap::ArgGroup::new("source").required(true).multiple(false)))]
pub struct ManifestArgs {
    /// LibriSpeech-style tree: `*.trans.txt` beside the audio files.
    #[arg(long, group = "source")]
    librispeech: Option<PathBuf>,
    /// Kaldi-style data directory with `wav.scp`, `text` and optionally `utt2spk`.
    #[arg(long, group = "source")]
    kaldi: Option<PathBuf>,
    /// TSV file: `path<TAB>transcript[<TAB>speaker]` per line.
    #[arg(long, group = "source")]
    tsv: Option<PathBuf>,
    /// Corpus directory to write `<split>.jsonl` and `phones.txt` into.
    #[arg(long)]
    out: PathBuf,
    /// Split name.
    #[arg(long)]
    split: String,
    /// espeak-ng voice whose phonemizer labels the transcripts.
    #[arg(long, default_value = "en-us")]
    accent: String,
    /// Write the usable utterances and report the others instead of failing.
    #[arg(long)]
    skip_bad: bool,
}

/// Imports the split and reports what it wrote and what it left out.
pub fn run(args: ManifestArgs) -> anyhow::Result<()> {
    let source = match (args.librispeech, args.kaldi, args.tsv) {
        (Some(dir), None, None) => Source::LibriSpeech(dir),
        (None, Some(dir), None) => Source::Kaldi(dir),
        (None, None, Some(file)) => Source::Tsv(file),
        _ => unreachable!("clap requires exactly one source"),
    };
    let report = import(&ImportOptions {
        source,
        out: args.out,
        split: args.split,
        accent: args.accent,
        skip_bad: args.skip_bad,
    })?;
    for problem in &report.skipped {
        eprintln!("skipped: {problem}");
    }
    println!(
        "{}: {} utterances, {:.1} min{}",
        report.manifest.display(),
        report.utterances,
        report.seconds / 60.0,
        if report.skipped.is_empty() {
            String::new()
        } else {
            format!(", {} skipped", report.skipped.len())
        }
    );
    Ok(())
}
