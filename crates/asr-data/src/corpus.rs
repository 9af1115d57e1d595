//! `asr corpus`: a multi-speaker English corpus synthesized with `espeak-ng` (and `flite`
//! when installed), labelled with `espeak-ng`'s own phonemizer.
//!
//! A speaker ("voice") is an `espeak-ng` English accent with a voice variant
//! (`en-gb-scotland+f2`), or a `flite` voice. Every utterance gets a random speed
//! (120–230 words per minute) and pitch. Voices are split once, by a fixed rule, into
//! train, dev and test, so that dev and test voices never occur in training. Labels are the
//! accent's IPA phonemization of the same text (`espeak-ng -q --ipa --sep=" "`), folded onto
//! the 39-phone inventory ([`crate::phones::fold_ipa`]).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};
use rand::{RngExt, SeedableRng, rngs::Xoshiro256PlusPlus};

use crate::audio::{SAMPLE_RATE_HZ, load_audio, write_flac};
use crate::join::Joined;
use crate::manifest::{ManifestEntry, write_manifest};
use crate::phones::{PhoneInventory, fold_ipa};

/// `espeak-ng` English accents used as speakers.
pub const ESPEAK_ACCENTS: [&str; 8] = [
    "en-us",
    "en-gb",
    "en-gb-scotland",
    "en-gb-x-gbclan",
    "en-gb-x-rp",
    "en-gb-x-gbcwmd",
    "en-029",
    "en-us-nyc",
];
/// `espeak-ng` voice variants combined with each accent.
pub const ESPEAK_VARIANTS: [&str; 11] = [
    "m1", "m2", "m3", "m4", "m5", "m6", "m7", "f1", "f2", "f3", "f4",
];
/// `flite` voices used when `flite` is installed (training only; labelled with the `en-us`
/// phonemizer).
pub const FLITE_VOICES: [&str; 4] = ["kal16", "awb", "rms", "slt"];

/// MBROLA diphone voices driven by `espeak-ng` (`mb-<name>`), used when their databases are
/// installed under `/usr/share/mbrola` (Debian's non-free `mbrola-us1` …): `us3` in test,
/// the others in training. Labelled with `en-us` (`us*`) or `en-gb` (`en1`).
pub const MBROLA_VOICES: [&str; 4] = ["us1", "us2", "en1", "us3"];

/// Share of a split's utterances spoken by its MBROLA and `flite` voices when it has any:
/// they sound more natural than `espeak-ng`'s formant voices, yet are few.
pub const NATURAL_VOICE_SHARE: f64 = 0.5;

/// The three splits.
pub const SPLITS: [&str; 3] = ["train", "dev", "test"];

/// A synthesis voice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Voice {
    /// `espeak-ng` accent and variant.
    Espeak {
        /// Accent (language) name, e.g. `en-gb-scotland`.
        accent: &'static str,
        /// Voice variant, e.g. `f2`.
        variant: &'static str,
    },
    /// A `flite` voice.
    Flite(&'static str),
    /// An MBROLA voice through `espeak-ng` (`mb-us1`).
    Mbrola(&'static str),
}

impl Voice {
    /// The voice's name in manifests.
    pub fn name(&self) -> String {
        match self {
            Voice::Espeak { accent, variant } => format!("espeak:{accent}+{variant}"),
            Voice::Flite(voice) => format!("flite:{voice}"),
            Voice::Mbrola(voice) => format!("mbrola:{voice}"),
        }
    }

    /// The accent whose phonemizer labels this voice.
    pub fn accent(&self) -> &'static str {
        match self {
            Voice::Espeak { accent, .. } => accent,
            Voice::Flite(_) => "en-us",
            Voice::Mbrola(voice) if voice.starts_with("en") => "en-gb",
            Voice::Mbrola(_) => "en-us",
        }
    }

    /// Whether this is one of the few natural-sounding voices (MBROLA, `flite`).
    pub fn is_natural(&self) -> bool {
        !matches!(self, Voice::Espeak { .. })
    }
}

/// The voices of each split (train, dev, test): `espeak-ng` accent `a` with variant `v` is
/// in test when `(a + v) % 8 == 0`, in dev when `(a + v) % 8 == 4`, in train otherwise;
/// `flite` voices (if `with_flite`) are in train; MBROLA voices (those in `mbrola`) as
/// [`MBROLA_VOICES`] says.
pub fn split_voices(with_flite: bool, mbrola: &[&'static str]) -> [Vec<Voice>; 3] {
    let mut splits: [Vec<Voice>; 3] = Default::default();
    for (a, accent) in ESPEAK_ACCENTS.iter().enumerate() {
        for (v, variant) in ESPEAK_VARIANTS.iter().enumerate() {
            let split = match (a + v) % 8 {
                0 => 2,
                4 => 1,
                _ => 0,
            };
            splits[split].push(Voice::Espeak { accent, variant });
        }
    }
    if with_flite {
        splits[0].extend(FLITE_VOICES.iter().map(|v| Voice::Flite(v)));
    }
    for voice in mbrola {
        let split = if *voice == "us3" { 2 } else { 0 };
        splits[split].push(Voice::Mbrola(voice));
    }
    splits
}

/// Settings of `asr corpus`.
#[derive(Debug, Clone)]
pub struct CorpusOptions {
    /// Output directory.
    pub out: PathBuf,
    /// Hours of audio over all splits.
    pub hours: f64,
    /// Share of the audio in dev and in test (each).
    pub held_out_fraction: f64,
    /// Plain-text source, one sentence or verse per line.
    pub text: PathBuf,
    /// Licence of the text source, recorded in the corpus README.
    pub text_licence: String,
    /// Seed of the voice, speed, pitch and text choices.
    pub seed: u64,
    /// Bits per FLAC sample (8–24).
    pub bits_per_sample: usize,
    /// Words per phrase: phrases are cut at punctuation into at most this many words.
    pub max_words: usize,
    /// Shortest utterance in seconds: consecutive phrases of the text, spoken by one voice
    /// with a pause of [`JOIN_PAUSE_S`] between them, are joined into one utterance until it
    /// lasts this long (0: one phrase per utterance).
    pub min_seconds: f64,
}

/// Silence between the phrases of a joined utterance ([`CorpusOptions::min_seconds`]).
pub const JOIN_PAUSE_S: f64 = 0.25;

/// Splits text into phrases of 3..=`max_words` words at punctuation, then at `max_words`.
pub fn phrases(text: &str, max_words: usize) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        // Drop verse references such as "Ge1:1".
        let line = line.trim();
        let line = match line.split_once(' ') {
            Some((first, rest)) if first.contains(':') => rest,
            _ => line,
        };
        let mut current: Vec<&str> = Vec::new();
        for word in line.split_whitespace() {
            current.push(word);
            let ends = word.ends_with(['.', ',', ';', ':', '?', '!']);
            if (ends && current.len() >= 3) || current.len() >= max_words {
                out.push(current.join(" "));
                current.clear();
            }
        }
        if current.len() >= 3 {
            out.push(current.join(" "));
        }
    }
    out.into_iter()
        .map(|p| {
            p.chars()
                .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '\'' | '-'))
                .collect::<String>()
        })
        .filter(|p| p.split_whitespace().count() >= 3)
        .collect()
}

fn run(command: &mut Command) -> anyhow::Result<Vec<u8>> {
    let output = command
        .output()
        .with_context(|| format!("cannot run {command:?} (is it installed?)"))?;
    if !output.status.success() {
        bail!(
            "{command:?} failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(output.stdout)
}

/// The folded phone labels of `text` in `accent`.
///
/// # Errors
/// When `espeak-ng` fails or emits a symbol the folding table does not cover.
pub fn phonemize(text: &str, accent: &str) -> anyhow::Result<Vec<&'static str>> {
    let ipa = run(Command::new("espeak-ng")
        .args(["-q", "--ipa", "--sep= ", "-v", accent])
        .arg(text))?;
    let ipa = String::from_utf8(ipa).context("espeak-ng printed invalid UTF-8")?;
    let mut phones = Vec::new();
    for token in ipa.split_whitespace() {
        phones.extend(fold_ipa(token).with_context(|| format!("{accent}: {text:?}"))?);
    }
    Ok(phones)
}

/// Synthesizes `text` with `voice` at `wpm` words per minute and `pitch` (0–99); returns
/// 16 kHz samples with leading and trailing silence trimmed to 0.1 s.
///
/// # Errors
/// When the synthesizer fails or its output cannot be decoded.
pub fn synthesize(
    text: &str,
    voice: &Voice,
    wpm: u32,
    pitch: u32,
    scratch: &Path,
) -> anyhow::Result<Vec<f32>> {
    match voice {
        Voice::Espeak { accent, variant } => run(Command::new("espeak-ng")
            .args(["-v", &format!("{accent}+{variant}")])
            .args(["-s", &wpm.to_string(), "-p", &pitch.to_string(), "-w"])
            .arg(scratch)
            .arg(text))?,
        Voice::Mbrola(name) => run(Command::new("espeak-ng")
            .args(["-v", &format!("mb-{name}")])
            .args(["-s", &wpm.to_string(), "-p", &pitch.to_string(), "-w"])
            .arg(scratch)
            .arg(text))?,
        Voice::Flite(name) => run(Command::new("flite")
            .args(["-voice", name])
            .args([
                "--setf",
                &format!("duration_stretch={:.3}", 175.0 / wpm as f64),
            ])
            .args(["--setf", &format!("int_f0_target_mean={}", 80 + pitch)])
            .args(["-t", text, "-o"])
            .arg(scratch))?,
    };
    let samples = load_audio(scratch)?;
    let loud = |x: &&f32| x.abs() > 0.01;
    let margin = SAMPLE_RATE_HZ / 10;
    let first = samples.iter().position(|x| loud(&x)).unwrap_or(0);
    let last = samples
        .iter()
        .rposition(|x| loud(&x))
        .unwrap_or(samples.len());
    Ok(samples[first.saturating_sub(margin)..(last + margin).min(samples.len())].to_vec())
}

/// Generates a corpus: `phones.txt`, `{train,dev,test}.jsonl`, `audio/<split>/<id>.flac` and
/// a `README.md` with its provenance.
///
/// # Errors
/// When a synthesizer is missing or fails, the text source is unreadable, or a file cannot
/// be written.
pub fn generate(options: &CorpusOptions) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&options.text)
        .with_context(|| format!("{}: cannot read the text source", options.text.display()))?;
    if !(options.min_seconds.is_finite() && options.min_seconds >= 0.0) {
        bail!(
            "min_seconds must be a finite number ≥ 0, got {}",
            options.min_seconds
        );
    }
    let phrases = phrases(&text, options.max_words);
    if phrases.is_empty() {
        bail!("{}: no phrase of 3 or more words", options.text.display());
    }
    let espeak = String::from_utf8_lossy(&run(Command::new("espeak-ng").arg("--version"))?)
        .trim()
        .to_string();
    let with_flite = Command::new("flite").arg("-lv").output().is_ok();
    let mbrola: Vec<&'static str> = MBROLA_VOICES
        .into_iter()
        .filter(|v| Path::new("/usr/share/mbrola").join(v).exists())
        .collect();
    let voices = split_voices(with_flite, &mbrola);
    let inventory = PhoneInventory::standard();
    std::fs::create_dir_all(&options.out)?;
    inventory.save(&options.out.join("phones.txt"))?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(options.seed);
    let scratch = options.out.join(".synth.wav");
    let total_s = options.hours * 3600.0;
    let budgets = [
        total_s * (1.0 - 2.0 * options.held_out_fraction),
        total_s * options.held_out_fraction,
        total_s * options.held_out_fraction,
    ];
    let mut next_phrase = 0usize;
    for (split, name) in SPLITS.iter().enumerate() {
        let dir = options.out.join("audio").join(name);
        std::fs::create_dir_all(&dir)?;
        let mut entries = Vec::new();
        let mut seconds = 0.0;
        while seconds < budgets[split] {
            let text = &phrases[next_phrase % phrases.len()];
            next_phrase += 1;
            let natural: Vec<&Voice> = voices[split].iter().filter(|v| v.is_natural()).collect();
            let formant: Vec<&Voice> = voices[split].iter().filter(|v| !v.is_natural()).collect();
            let pool = if !natural.is_empty() && rng.random_bool(NATURAL_VOICE_SHARE) {
                natural
            } else {
                formant
            };
            let voice = pool[rng.random_range(0..pool.len())];
            let wpm = rng.random_range(120..=230);
            let pitch = rng.random_range(25..=75);
            let samples = synthesize(text, voice, wpm, pitch, &scratch)?;
            let phones = phonemize(text, voice.accent())?;
            if samples.len() < SAMPLE_RATE_HZ / 4 || phones.is_empty() {
                continue;
            }
            let mut joined = Joined::new(JOIN_PAUSE_S);
            joined.push(&samples, text, phones.iter().map(|p| p.to_string()));
            while joined.seconds() < options.min_seconds {
                let next = &phrases[next_phrase % phrases.len()];
                next_phrase += 1;
                let more = synthesize(next, voice, wpm, pitch, &scratch)?;
                let more_phones = phonemize(next, voice.accent())?;
                if more.is_empty() || more_phones.is_empty() {
                    continue;
                }
                joined.push(&more, next, more_phones.iter().map(|p| p.to_string()));
            }
            let Joined {
                samples,
                text,
                phones,
                ..
            } = joined;
            let id = format!("{name}-{:05}", entries.len());
            let audio = format!("audio/{name}/{id}.flac");
            write_flac(
                &options.out.join(&audio),
                &samples,
                SAMPLE_RATE_HZ,
                options.bits_per_sample,
            )?;
            // Read it back: a file the loader rejects must not enter the corpus.
            load_audio(&options.out.join(&audio))?;
            let duration_s = samples.len() as f64 / SAMPLE_RATE_HZ as f64;
            seconds += duration_s;
            entries.push(ManifestEntry {
                id,
                audio,
                duration_s: (duration_s * 1000.0).round() / 1000.0,
                text,
                phones: phones.join(" "),
                voice: voice.name(),
            });
        }
        write_manifest(&options.out.join(format!("{name}.jsonl")), &entries)?;
        eprintln!(
            "{name}: {} utterances, {:.1} min, {} voices",
            entries.len(),
            seconds / 60.0,
            voices[split].len()
        );
    }
    let _ = std::fs::remove_file(&scratch);
    let readme = format!(
        "# Synthesized English phone corpus\n\n\
         Generated by `asr corpus --hours {hours} --seed {seed} --bits-per-sample {bits} --max-words {max_words} --min-seconds {min_seconds} --text {text}`.\n\n\
         - Synthesizers: {espeak}{flite}; voices: `espeak-ng` accents {accents:?} × variants {variants:?}, \
         split by the rule of `asr_model::corpus::split_voices` (dev and test voices never occur in training).{mbrola}\n\
         - Speed 120–230 words per minute, pitch 25–75, 16 kHz mono FLAC, {bits} bits per sample.\n\
         - Labels: `espeak-ng -q --ipa --sep=\" \" -v <accent>` folded onto the 39 phones of `phones.txt`.\n\
         - Text: `{text}`; licence: {licence}.\n",
        hours = options.hours,
        seed = options.seed,
        bits = options.bits_per_sample,
        text = options.text.display(),
        flite = if with_flite {
            ", flite (voices kal16, awb, rms, slt: train only)"
        } else {
            ""
        },
        mbrola = if mbrola.is_empty() {
            String::new()
        } else {
            format!(
                "\n- MBROLA voices through espeak-ng: {mbrola:?} (us3 in test, the others in training); \
                 the diphone databases (© Faculté Polytechnique de Mons, Babel Technology; Debian \
                 non-free `mbrola-*`) may be used with the MBROLA program and distributed free of \
                 charge; this corpus holds speech synthesized with them, not the databases. Half of \
                 the utterances of a split with MBROLA or flite voices are spoken by them."
            )
        },
        max_words = options.max_words,
        min_seconds = options.min_seconds,
        accents = ESPEAK_ACCENTS,
        variants = ESPEAK_VARIANTS,
        licence = options.text_licence,
    );
    crate::files::write_atomic(&options.out.join("README.md"), readme.as_bytes())?;
    Ok(())
}
