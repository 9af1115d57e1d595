//! Real recorded English speech from two freeware adventure games in Debian's archive: their
//! voice tracks and the game texts that transcribe them, as a corpus of `asr train`
//! (`asr import --game sky|queen`).
//!
//! - `sky.rs`: *Beneath a Steel Sky* (Revolution Software, 1994; CD version 0.0372, Debian
//!   package `beneath-a-steel-sky`): the `sky.dnr` index of `sky.dsk`, RNC method-1
//!   unpacking (`rnc.rs`), the Huffman-coded game texts and the speech files they name;
//! - `queen.rs`: *Flight of the Amazon Queen* (Interactive Binary Illusions, 1995; the rebuilt
//!   CD data CEM10, Debian package `flight-of-the-amazon-queen`): the file table embedded in
//!   `queen.1c`, the dialogue, object-description and cutscene texts, and the MP3 voice
//!   files of each of their segments;
//! - this file: what both share. Each game yields [`Clip`]s (audio, transcript, speaker,
//!   scene); [`import_game`] labels them as `asr manifest` does ([`normalize_text`],
//!   [`label`]), splits them by speaker so that dev and test voices are not heard in
//!   training ([`split_by_speaker`]), writes the audio files as the game stores them (8-bit
//!   11 025 Hz WAV; MP3) and the manifests, and reports every line left out and why.
//!
//! The games' licences allow free redistribution with their notices kept; the importer copies
//! the Debian package's `copyright` and `readme.txt.gz` beside the manifests.

pub mod queen;
pub mod rnc;
pub mod sky;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use crate::audio::{SAMPLE_RATE_HZ, decode_audio};
use crate::data::{fnv1a, map_on_all_cores};
use crate::manifest::import::{check_espeak, label, normalize_text};
use crate::manifest::{ManifestEntry, write_manifest};
use crate::phones::PhoneInventory;

/// A game whose voice track can be imported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Game {
    /// *Beneath a Steel Sky*, CD version 0.0372 (`sky.dnr`, `sky.dsk`).
    Sky,
    /// *Flight of the Amazon Queen*, rebuilt CD data CEM10 (`queen.1c`).
    Queen,
}

impl Game {
    /// Where Debian's package installs the game's data.
    pub fn default_dir(self) -> PathBuf {
        PathBuf::from(match self {
            Game::Sky => "/usr/share/scummvm/beneath-a-steel-sky",
            Game::Queen => "/usr/share/scummvm/flight-of-the-amazon-queen",
        })
    }

    /// Debian's package of the game.
    pub fn package(self) -> &'static str {
        match self {
            Game::Sky => "beneath-a-steel-sky",
            Game::Queen => "flight-of-the-amazon-queen",
        }
    }

    /// Reads every voiced line of the game data in `dir`: the clips, and the lines left out
    /// with the reason (one `where: why` each).
    ///
    /// # Errors
    /// When a data file is missing or malformed; the message names the file and the offset.
    pub fn read(self, dir: &Path) -> anyhow::Result<(Vec<Clip>, Vec<String>)> {
        match self {
            Game::Sky => sky::read_clips(dir),
            Game::Queen => queen::read_clips(dir),
        }
    }
}

impl std::fmt::Display for Game {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Game::Sky => "sky",
            Game::Queen => "queen",
        })
    }
}

/// The audio of a clip, as the game stores it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClipAudio {
    /// Unsigned 8-bit mono PCM (128 is silence) at `rate_hz`.
    PcmU8 {
        /// Sample rate in Hz.
        rate_hz: u32,
        /// The samples.
        samples: Vec<u8>,
    },
    /// An MP3 stream.
    Mp3(Vec<u8>),
}

impl ClipAudio {
    /// The file extension the audio is written with.
    pub fn extension(&self) -> &'static str {
        match self {
            ClipAudio::PcmU8 { .. } => "wav",
            ClipAudio::Mp3(_) => "mp3",
        }
    }

    /// The bytes of the audio file: a WAV file (8-bit PCM, written by `hound`) or the MP3
    /// stream as it is.
    pub fn file_bytes(&self) -> Vec<u8> {
        match self {
            ClipAudio::PcmU8 { rate_hz, samples } => {
                let spec = hound::WavSpec {
                    channels: 1,
                    sample_rate: *rate_hz,
                    bits_per_sample: 8,
                    sample_format: hound::SampleFormat::Int,
                };
                let mut cursor = std::io::Cursor::new(Vec::new());
                let mut writer =
                    hound::WavWriter::new(&mut cursor, spec).expect("writing to memory");
                for &s in samples {
                    writer
                        .write_sample((s as i16 - 128) as i8)
                        .expect("writing to memory");
                }
                writer.finalize().expect("writing to memory");
                cursor.into_inner()
            }
            ClipAudio::Mp3(bytes) => bytes.clone(),
        }
    }
}

/// One voiced line: its audio and its transcript.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Clip {
    /// Unique id within the game (also the audio file's stem).
    pub id: String,
    /// The audio.
    pub audio: ClipAudio,
    /// The line as the game's text shows it.
    pub transcript: String,
    /// Who speaks it, where the data says so (a character's name), else a group of lines.
    pub speaker: String,
    /// Where the line is (`file:offset` of its text), for reports.
    pub at: String,
}

/// What [`import_game`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct GameImportReport {
    /// Utterances written per split (`train`, `dev`, `test`).
    pub utterances: BTreeMap<String, usize>,
    /// Their audio in seconds, per split.
    pub seconds: BTreeMap<String, f64>,
    /// Speakers per split.
    pub speakers: BTreeMap<String, Vec<String>>,
    /// Every line left out: `where: why` (also written to `left-out.txt`).
    pub left_out: Vec<String>,
}

/// Settings of [`import_game`].
#[derive(Debug, Clone)]
pub struct GameImportOptions {
    /// The game.
    pub game: Game,
    /// Its data directory (e.g. [`Game::default_dir`]).
    pub dir: PathBuf,
    /// Corpus directory to write into (`phones.txt`, `train/dev/test.jsonl`, `audio/`,
    /// `left-out.txt`, the package's `copyright` and `readme.txt.gz`).
    pub out: PathBuf,
    /// `espeak-ng` voice whose phonemizer labels the transcripts.
    pub accent: String,
    /// Fraction of the clips whose speakers are held out for dev, and the same for test
    /// ([`split_by_speaker`]).
    pub held_out: f64,
}

/// The documentation directory of the game's Debian package, which holds its `copyright`
/// notice and its `readme.txt.gz` (the licence asks that both stay with the game): beside the
/// data in the package's tree (`usr/share/doc/<package>` for data in
/// `usr/share/scummvm/<package>`), else the system's.
fn package_doc_dir(game: Game, dir: &Path) -> Option<PathBuf> {
    let beside = dir.join("../../doc").join(game.package());
    let system = Path::new("/usr/share/doc").join(game.package());
    [beside, system]
        .into_iter()
        .find(|d| d.join("copyright").exists())
}

/// The speaker of clips whose speaker the data does not give (a mixture of voices).
pub const UNKNOWN_SPEAKER: &str = "UNKNOWN";

/// Splits speakers into `train`, `dev` and `test` so that no speaker is in two splits: the
/// speakers are taken in an order fixed by their names (FNV-1a, then SplitMix64's finaliser,
/// so neither alphabetical nor grouped by common prefixes), the most frequent one and
/// [`UNKNOWN_SPEAKER`] never, and given to `test` until it holds `held_out` of the clips (at
/// most twice that), then to `dev` likewise; the rest is `train`. Returns the split of each
/// speaker.
///
/// # Panics
/// When `held_out` is not in `[0, 0.5)`.
pub fn split_by_speaker(
    clips_per_speaker: &BTreeMap<String, usize>,
    held_out: f64,
) -> BTreeMap<String, &'static str> {
    assert!(
        (0.0..0.5).contains(&held_out),
        "held_out must be in [0, 0.5), got {held_out}"
    );
    let total: usize = clips_per_speaker.values().sum();
    let most = clips_per_speaker
        .iter()
        .max_by_key(|(name, n)| (**n, std::cmp::Reverse((*name).clone())))
        .map(|(name, _)| name.clone());
    let hash = |s: &str| {
        let mut z = fnv1a(s.bytes());
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<&String> = clips_per_speaker.keys().collect();
    order.sort_by_key(|name| (hash(name), (*name).clone()));
    let target = (held_out * total as f64).ceil() as usize;
    let (mut test, mut dev) = (0, 0);
    let mut splits = BTreeMap::new();
    for name in order {
        let n = clips_per_speaker[name];
        let split = if Some(name) == most.as_ref() || name == UNKNOWN_SPEAKER {
            "train"
        } else if test < target && test + n <= 2 * target.max(1) {
            test += n;
            "test"
        } else if dev < target && dev + n <= 2 * target.max(1) {
            dev += n;
            "dev"
        } else {
            "train"
        };
        splits.insert(name.clone(), split);
    }
    splits
}

/// Labels a game's clips and writes them as a corpus: `audio/<id>.{wav,mp3}`,
/// `train.jsonl`/`dev.jsonl`/`test.jsonl` (speakers split by [`split_by_speaker`]),
/// `phones.txt` (the standard inventory), `left-out.txt` (every line left out and why) and
/// the package's `copyright` notice and readme. Transcripts are normalised and phonemized as by
/// `asr manifest`, on all cores; every clip's audio is decoded to measure its duration.
///
/// # Errors
/// When the game data cannot be read (the error names the file and offset), `espeak-ng`
/// does not run, no clip is usable, or `out` cannot be written.
pub fn import_game(options: &GameImportOptions) -> anyhow::Result<GameImportReport> {
    check_espeak(&options.accent)?;
    let (clips, mut left_out) = options.game.read(&options.dir)?;
    let labelled = label_clips(&clips, &options.accent);
    let audio_dir = options.out.join("audio");
    std::fs::create_dir_all(&audio_dir)
        .with_context(|| format!("{}: cannot create", audio_dir.display()))?;
    let mut entries = Vec::new();
    for (clip, labelled) in clips.iter().zip(labelled) {
        let (text, phones) = match labelled {
            Ok(ok) => ok,
            Err(why) => {
                left_out.push(format!("{} ({}): {why}", clip.at, clip.id));
                continue;
            }
        };
        let file = format!("audio/{}.{}", clip.id, clip.audio.extension());
        let bytes = clip.audio.file_bytes();
        let path = options.out.join(&file);
        let samples = match decode_audio(bytes.clone(), &path) {
            Ok(samples) if !samples.is_empty() => samples,
            Ok(_) => {
                left_out.push(format!("{} ({}): the audio is empty", clip.at, clip.id));
                continue;
            }
            Err(e) => {
                left_out.push(format!("{} ({}): {e}", clip.at, clip.id));
                continue;
            }
        };
        crate::files::write_atomic(&path, &bytes)
            .with_context(|| format!("{}: cannot write", path.display()))?;
        entries.push((
            clip.speaker.clone(),
            ManifestEntry {
                id: clip.id.clone(),
                audio: file,
                duration_s: (samples.len() as f64 / SAMPLE_RATE_HZ as f64 * 1000.0).round()
                    / 1000.0,
                text,
                phones,
                voice: clip.speaker.clone(),
            },
        ));
    }
    if entries.is_empty() {
        bail!(
            "{}: no usable clip; {} line(s) left out:\n{}",
            options.dir.display(),
            left_out.len(),
            left_out.join("\n")
        );
    }
    let mut per_speaker = BTreeMap::new();
    for (speaker, _) in &entries {
        *per_speaker.entry(speaker.clone()).or_insert(0) += 1;
    }
    let splits = split_by_speaker(&per_speaker, options.held_out);
    let mut report = GameImportReport {
        utterances: BTreeMap::new(),
        seconds: BTreeMap::new(),
        speakers: BTreeMap::new(),
        left_out,
    };
    for split in ["train", "dev", "test"] {
        let chosen: Vec<ManifestEntry> = entries
            .iter()
            .filter(|(speaker, _)| splits[speaker] == split)
            .map(|(_, e)| e.clone())
            .collect();
        report.utterances.insert(split.to_string(), chosen.len());
        report
            .seconds
            .insert(split.to_string(), chosen.iter().map(|e| e.duration_s).sum());
        report.speakers.insert(
            split.to_string(),
            splits
                .iter()
                .filter(|(_, s)| **s == split)
                .map(|(name, _)| name.clone())
                .collect(),
        );
        let manifest = options.out.join(format!("{split}.jsonl"));
        write_manifest(&manifest, &chosen)
            .with_context(|| format!("{}: cannot write", manifest.display()))?;
    }
    PhoneInventory::standard().save(&options.out.join("phones.txt"))?;
    match package_doc_dir(options.game, &options.dir) {
        Some(doc) => {
            for name in ["copyright", "readme.txt.gz"] {
                let file = doc.join(name);
                if file.exists() {
                    std::fs::copy(&file, options.out.join(name))
                        .with_context(|| format!("{}: cannot copy", file.display()))?;
                }
            }
        }
        None => report.left_out.push(format!(
            "{}: no copyright notice of the package {} found to copy beside the corpus",
            options.dir.display(),
            options.game.package()
        )),
    }
    let mut text = report.left_out.join("\n");
    text.push('\n');
    crate::files::write_atomic(&options.out.join("left-out.txt"), text.as_bytes())?;
    Ok(report)
}

/// Normalises and phonemizes every clip's transcript on all cores: `(text, phones)` or why
/// the line is left out.
fn label_clips(clips: &[Clip], accent: &str) -> Vec<Result<(String, String), String>> {
    let one = |clip: &Clip| -> Result<(String, String), String> {
        let text = normalize_text(&clip.transcript)
            .map_err(|words| format!("unspeakable word(s) {words:?}"))?;
        if text.is_empty() {
            return Err("empty transcript".to_string());
        }
        let phones = label(&text, accent)
            .map_err(|words| format!("espeak-ng ({accent}) cannot phonemize {words:?}"))?;
        Ok((text, phones.join(" ")))
    };
    map_on_all_cores(clips, one)
}
