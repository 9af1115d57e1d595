//! `asr import`: a corpus from an installed game's voice track and texts.

use std::path::PathBuf;

use asr_model::games::{Game, GameImportOptions, import_game};
use clap::Args;

/// Arguments of `asr import`.
#[derive(Args, Debug)]
pub struct ImportArgs {
    /// The game.
    #[arg(long, value_enum)]
    game: Game,
    /// The game's data directory (default: where Debian's package installs it,
    /// /usr/share/scummvm/beneath-a-steel-sky or /usr/share/scummvm/flight-of-the-amazon-queen).
    #[arg(long)]
    from: Option<PathBuf>,
    /// Corpus directory to write (audio/, train/dev/test.jsonl, phones.txt, left-out.txt, the
    /// package's copyright and readme.txt.gz).
    #[arg(long)]
    out: PathBuf,
    /// espeak-ng voice whose phonemizer labels the transcripts.
    #[arg(long, default_value = "en-us")]
    accent: String,
    /// Fraction of the clips whose speakers are held out for dev, and the same for test.
    #[arg(long, default_value_t = 0.06)]
    held_out: f64,
}

/// Imports the game and prints what it wrote and how many lines it left out.
pub fn run(args: ImportArgs) -> anyhow::Result<()> {
    if !(0.0..0.5).contains(&args.held_out) {
        anyhow::bail!("--held-out {}: must be in [0, 0.5)", args.held_out);
    }
    let dir = args.from.unwrap_or_else(|| args.game.default_dir());
    let report = import_game(&GameImportOptions {
        game: args.game,
        dir,
        out: args.out.clone(),
        accent: args.accent,
        held_out: args.held_out,
    })?;
    for (split, n) in &report.utterances {
        println!(
            "{}/{split}.jsonl: {n} clips, {:.2} h, {} speakers",
            args.out.display(),
            report.seconds[split] / 3600.0,
            report.speakers[split].len()
        );
    }
    println!(
        "{} clips in all; {} line(s) left out (listed in {})",
        report.utterances.values().sum::<usize>(),
        report.left_out.len(),
        args.out.join("left-out.txt").display()
    );
    Ok(())
}
