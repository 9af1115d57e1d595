//! `asr corpus`: synthesize a corpus with espeak-ng (and flite, when installed).

use std::path::PathBuf;

use asr_model::corpus::{CorpusOptions, generate};
use clap::Args;

/// Arguments of `asr corpus`.
#[derive(Args, Debug)]
pub struct CorpusArgs {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// Hours of audio over all splits.
    #[arg(long, default_value_t = 1.0)]
    hours: f64,
    /// Share of the audio in dev and in test, each.
    #[arg(long, default_value_t = 0.1)]
    held_out_fraction: f64,
    /// Plain-text source, one sentence or verse per line.
    #[arg(long, default_value = "data/text/kjv-pentateuch.txt")]
    text: PathBuf,
    /// Licence of the text source, recorded in the corpus README.
    #[arg(
        long,
        default_value = "public domain (King James Version, 1611; Crown copyright applies in the UK only)"
    )]
    licence: String,
    /// Seed of the voice, speed and pitch choices.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Bits per FLAC sample.
    #[arg(long, default_value_t = 16)]
    bits_per_sample: usize,
    /// Longest phrase, in words.
    #[arg(long, default_value_t = 12)]
    max_words: usize,
    /// Shortest utterance, in seconds: consecutive phrases are joined (one voice, 0.25 s
    /// pauses) until an utterance lasts this long; 0 keeps one phrase per utterance.
    #[arg(long, default_value_t = 0.0)]
    min_seconds: f64,
}

/// Generates the corpus.
pub fn run(args: CorpusArgs) -> anyhow::Result<()> {
    generate(&CorpusOptions {
        out: args.out,
        hours: args.hours,
        held_out_fraction: args.held_out_fraction,
        text: args.text,
        text_licence: args.licence,
        seed: args.seed,
        bits_per_sample: args.bits_per_sample,
        max_words: args.max_words,
        min_seconds: args.min_seconds,
    })
}
