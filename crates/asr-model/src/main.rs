//! `asr`: generate the corpus, import recordings, train, evaluate, compare and transcribe.
//!
//! This file parses the command line and dispatches; each command is a file of `cli/`.

mod cli;

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "CTC phone recognition with full, clustered or improved clustered attention"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Synthesize a corpus with espeak-ng (and flite, when installed).
    Corpus(cli::corpus::CorpusArgs),
    /// Build a corpus split (JSONL manifest + phones.txt) from recordings and transcripts:
    /// a LibriSpeech tree, a Kaldi data directory or a TSV.
    Manifest(cli::manifest::ManifestArgs),
    /// Build a corpus (train/dev/test split by speaker) from an installed game's voice track
    /// and texts: Beneath a Steel Sky or Flight of the Amazon Queen (Debian packages).
    Import(cli::import::ImportArgs),
    /// Build a corpus of long-form utterances (15–90 s) from a corpus: each speaker's
    /// consecutive clips joined with short pauses, splits kept apart.
    Join(cli::join::JoinArgs),
    /// Train a model on a corpus; prints the test phone error rate.
    Train(Box<cli::train::TrainArgs>),
    /// Evaluate trained models, with their own or another attention (paper Table 1).
    Eval(cli::eval::EvalArgs),
    /// Compare trained models (paper Table 2 and Figure 1): time per epoch, time to the best
    /// dev PER, test PER, forward time per utterance; an SVG of dev PER against forward time.
    Compare(cli::compare::CompareArgs),
    /// Which encoder steps share a cluster, per layer and head of a trained model, over one
    /// utterance: a table (runs per cluster, span) and an SVG over its spectrogram.
    Clusters(cli::clusters::ClustersArgs),
    /// Print the phones recognized in one audio file (WAV, FLAC, Ogg Vorbis, MP3, AAC, ALAC;
    /// any sample rate).
    Transcribe(cli::transcribe::TranscribeArgs),
    /// Time training steps (forward + backward + Adam) of the default model on random
    /// features, per attention (a benchmark; the paper's Figure 2 setting is 800 frames).
    StepTime(cli::step_time::StepTimeArgs),
}

fn main() -> anyhow::Result<()> {
    keep_freed_pages();
    match Cli::parse().command {
        Command::Corpus(args) => cli::corpus::run(args),
        Command::Manifest(args) => cli::manifest::run(args),
        Command::Import(args) => cli::import::run(args),
        Command::Join(args) => cli::join::run(args),
        Command::Train(args) => {
            cli::train::run(&args, args.backend, args.backend.device()?.autodiff())
        }
        Command::Eval(args) => cli::eval::run(&args, args.backend, args.backend.device()?),
        Command::Compare(args) => cli::compare::run(&args, args.backend, args.backend.device()?),
        Command::Clusters(args) => cli::clusters::run(&args, args.backend, args.backend.device()?),
        Command::Transcribe(args) => {
            cli::transcribe::run(&args, args.backend, args.backend.device()?)
        }
        Command::StepTime(args) => {
            cli::step_time::run(&args, args.backend, args.backend.device()?.autodiff())
        }
    }
}

/// Keeps glibc's malloc from giving pages back to the system: every block on the heap (no
/// block mapped on its own, as glibc maps those above its threshold, at most 32 MiB, and unmaps
/// them on free), and the heap's free top kept up to 2 GiB. Without it each large intermediate
/// tensor (full attention's `[batch, heads, L, S]` scores and weights, forward and backward)
/// pays its page faults again on every step: a step of full attention at 1,560 encoder steps
/// took 2.3 times as long on Flex. The process's resident memory then stays at its peak.
fn keep_freed_pages() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only sets malloc's parameters; no thread has been started yet.
    unsafe {
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}
