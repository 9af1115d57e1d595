//! Long-form utterances: consecutive clips of one speaker joined, in their original order,
//! with short pauses (`asr join`), and the joining itself, which `asr corpus --min-seconds`
//! shares ([`Joined`]).
//!
//! The paper's speech experiment (§4.1) runs on Wall Street Journal utterances whose
//! attention spans average about 780 steps and reach 2500; the clips of this project's
//! corpora last 1–5 s. [`join_corpus`] builds a corpus of 15–90 s utterances from one: within
//! each split (so dev and test speakers stay apart from training as in the source), each
//! speaker's clips are taken in manifest order and appended, with [`Joined::pause_s`] of
//! silence between them, until the utterance reaches a target length drawn per utterance
//! ([`JoinOptions::target_seconds`]); transcripts and phones are joined alike.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, bail};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

use crate::audio::{SAMPLE_RATE_HZ, load_audio, write_flac};
use crate::files::write_atomic;
use crate::manifest::{ManifestEntry, read_manifest, write_manifest};
use crate::phones::PhoneInventory;

/// One utterance being joined from parts: samples at [`SAMPLE_RATE_HZ`], the text and the
/// phones, each part separated from the one before by `pause_s` seconds of silence (and a
/// space in the text and the phones).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Joined {
    /// The samples so far.
    pub samples: Vec<f32>,
    /// The transcripts so far, separated by spaces.
    pub text: String,
    /// The phones so far.
    pub phones: Vec<String>,
    /// Parts joined so far.
    pub parts: usize,
    /// Silence between two parts, in seconds.
    pub pause_s: f64,
}

impl Joined {
    /// An empty utterance whose parts will be `pause_s` seconds apart.
    pub fn new(pause_s: f64) -> Self {
        Self {
            pause_s,
            ..Self::default()
        }
    }

    /// Appends a part: a pause first unless it is the first part.
    pub fn push(&mut self, samples: &[f32], text: &str, phones: impl IntoIterator<Item = String>) {
        if self.parts > 0 {
            let pause = (self.pause_s * SAMPLE_RATE_HZ as f64).round() as usize;
            self.samples.extend(std::iter::repeat_n(0.0, pause));
            self.text.push(' ');
        }
        self.samples.extend_from_slice(samples);
        self.text.push_str(text);
        self.phones.extend(phones);
        self.parts += 1;
    }

    /// Duration in seconds.
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / SAMPLE_RATE_HZ as f64
    }

    /// The duration after appending a part of `seconds` (with its pause).
    pub fn seconds_with(&self, seconds: f64) -> f64 {
        let pause = if self.parts > 0 { self.pause_s } else { 0.0 };
        self.seconds() + pause + seconds
    }
}

/// Settings of [`join_corpus`].
#[derive(Debug, Clone)]
pub struct JoinOptions {
    /// The source corpus (`phones.txt`, `train/dev/test.jsonl`).
    pub corpus: PathBuf,
    /// Output corpus directory.
    pub out: PathBuf,
    /// Shortest utterance, in seconds.
    pub min_seconds: f64,
    /// Longest utterance, in seconds.
    pub max_seconds: f64,
    /// Mean of the target lengths, in seconds ([`Self::target_seconds`]).
    pub mean_seconds: f64,
    /// Silence between two clips, in seconds.
    pub pause_s: f64,
    /// Seed of the target lengths.
    pub seed: u64,
    /// Splits to join (each `<split>.jsonl` of the corpus).
    pub splits: Vec<String>,
}

impl JoinOptions {
    /// Checks the settings.
    ///
    /// # Errors
    /// When the lengths are not `0 < min_seconds < mean_seconds < max_seconds`, or the pause
    /// is negative or not finite.
    pub fn check(&self) -> anyhow::Result<()> {
        let finite = [
            self.min_seconds,
            self.mean_seconds,
            self.max_seconds,
            self.pause_s,
        ]
        .iter()
        .all(|v| v.is_finite());
        if !(finite
            && 0.0 < self.min_seconds
            && self.min_seconds < self.mean_seconds
            && self.mean_seconds < self.max_seconds)
        {
            bail!(
                "the lengths must be 0 < min < mean < max seconds, got min {}, mean {}, max {}",
                self.min_seconds,
                self.mean_seconds,
                self.max_seconds
            );
        }
        if self.pause_s < 0.0 {
            bail!("the pause must be ≥ 0 s, got {}", self.pause_s);
        }
        Ok(())
    }

    /// A target length for the next utterance: `min + X` seconds with `X` exponential of mean
    /// `mean − min`, at most `max` — a long right tail, as in read-speech corpora (the WSJ
    /// inputs of the paper average about 780 steps and reach 2500).
    pub fn target_seconds(&self, rng: &mut Xoshiro256PlusPlus) -> f64 {
        let u: f64 = rng.random_range(0.0..1.0);
        let extra = -(1.0 - u).ln() * (self.mean_seconds - self.min_seconds);
        (self.min_seconds + extra).min(self.max_seconds)
    }
}

/// What [`join_corpus`] wrote, per split.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JoinReport {
    /// Per split: the durations of the joined utterances, in seconds, in order.
    pub seconds: BTreeMap<String, Vec<f64>>,
    /// Per split: clips joined.
    pub clips_used: BTreeMap<String, usize>,
    /// Per split: clips left out (a speaker's clips that could not make an utterance of at
    /// least `min_seconds`, or one clip longer than `max_seconds`), with their seconds.
    pub left_out: BTreeMap<String, (usize, f64)>,
}

impl JoinReport {
    /// A text histogram of the utterances' encoder steps (100 feature frames per second,
    /// `subsampling` frames per step), in bins of `bin` steps, with the mean and the maximum.
    pub fn histogram(&self, subsampling: usize, bin: usize) -> String {
        let bin = bin.max(1);
        let steps = |s: f64| (s * 100.0).ceil() as usize / subsampling.max(1);
        let mut out = String::new();
        for (split, seconds) in &self.seconds {
            if seconds.is_empty() {
                out.push_str(&format!("{split}: no utterance\n"));
                continue;
            }
            let all: Vec<usize> = seconds.iter().map(|&s| steps(s)).collect();
            let mean = all.iter().sum::<usize>() as f64 / all.len() as f64;
            let max = all.iter().copied().max().unwrap_or(0);
            out.push_str(&format!(
                "{split}: {} utterances, {:.2} h, encoder steps at subsampling {subsampling}: mean {mean:.0}, max {max}\n",
                all.len(),
                seconds.iter().sum::<f64>() / 3600.0
            ));
            let mut bins = vec![0usize; max / bin + 1];
            for s in &all {
                bins[s / bin] += 1;
            }
            let widest = bins.iter().copied().max().unwrap_or(1).max(1);
            for (i, n) in bins.iter().enumerate() {
                out.push_str(&format!(
                    "  {:>5}–{:<5} {:>5} {}\n",
                    i * bin,
                    (i + 1) * bin - 1,
                    n,
                    "#".repeat((n * 50).div_ceil(widest))
                ));
            }
        }
        out
    }
}

/// Joins the clips of `options.corpus` into long-form utterances in `options.out`:
/// `phones.txt`, `<split>.jsonl` per split, `audio/<split>/<id>.flac` (16-bit, 16 kHz),
/// `joined-from.tsv` (each utterance's clip ids, in order) and the source's licence files
/// (`copyright`, `readme.txt.gz`, `README.md`, where present).
///
/// Within a split, each speaker (`voice`) is taken on its own, its clips in manifest order;
/// an utterance gets clips until it reaches its target ([`JoinOptions::target_seconds`]), or
/// until the next clip would take it past `max_seconds`. A speaker's last utterance, when
/// shorter than `min_seconds`, joins the one before when both fit within `max_seconds`, else
/// is left out (reported); so is a single clip longer than `max_seconds`.
///
/// # Errors
/// When the options are invalid, a manifest or audio file cannot be read, or the output cannot
/// be written.
pub fn join_corpus(options: &JoinOptions) -> anyhow::Result<JoinReport> {
    options.check()?;
    let inventory = PhoneInventory::load(&options.corpus.join("phones.txt"))
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("{}: not a corpus", options.corpus.display()))?;
    std::fs::create_dir_all(&options.out)
        .with_context(|| format!("{}: cannot create", options.out.display()))?;
    inventory.save(&options.out.join("phones.txt"))?;
    let mut rng = Xoshiro256PlusPlus::seed_from_u64(options.seed);
    let mut report = JoinReport::default();
    let mut sources = String::new();
    for split in &options.splits {
        let manifest = options.corpus.join(format!("{split}.jsonl"));
        let utterances = read_manifest(&manifest, &inventory, false)?;
        // Speakers in the order of their first clip; each one's clips in manifest order.
        let mut speakers: Vec<(String, Vec<usize>)> = Vec::new();
        for (i, u) in utterances.iter().enumerate() {
            match speakers.iter_mut().find(|(v, _)| *v == u.entry.voice) {
                Some((_, clips)) => clips.push(i),
                None => speakers.push((u.entry.voice.clone(), vec![i])),
            }
        }
        let dir = options.out.join("audio").join(split);
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("{}: cannot create", dir.display()))?;
        let mut entries = Vec::new();
        let (mut used, mut dropped, mut dropped_s) = (0, 0, 0.0);
        for (voice, clips) in &speakers {
            // Groups of clip indices, each one utterance.
            let mut groups: Vec<(Vec<usize>, f64)> = Vec::new();
            let mut current: (Vec<usize>, f64) = (Vec::new(), 0.0);
            let mut target = options.target_seconds(&mut rng);
            for &i in clips {
                let seconds = utterances[i].entry.duration_s;
                if seconds > options.max_seconds {
                    dropped += 1;
                    dropped_s += seconds;
                    continue;
                }
                let with = if current.0.is_empty() {
                    seconds
                } else {
                    current.1 + options.pause_s + seconds
                };
                if with > options.max_seconds {
                    groups.push(std::mem::take(&mut current));
                    target = options.target_seconds(&mut rng);
                    current = (vec![i], seconds);
                } else {
                    current.0.push(i);
                    current.1 = with;
                }
                if current.1 >= target {
                    groups.push(std::mem::take(&mut current));
                    target = options.target_seconds(&mut rng);
                }
            }
            if !current.0.is_empty() {
                groups.push(current);
            }
            // A short last group joins the one before when both fit, else is left out; so is
            // any other group below the minimum (one closed short because the next clip would
            // have taken it past the maximum).
            if groups.len() >= 2 {
                let (last, before) = (&groups[groups.len() - 1], &groups[groups.len() - 2]);
                if last.1 < options.min_seconds
                    && before.1 + options.pause_s + last.1 <= options.max_seconds
                {
                    let last = groups.pop().expect("two groups");
                    let before = groups.last_mut().expect("two groups");
                    before.0.extend(last.0);
                    before.1 += options.pause_s + last.1;
                }
            }
            for (group, seconds) in groups {
                if seconds < options.min_seconds {
                    dropped += group.len();
                    dropped_s += group
                        .iter()
                        .map(|&i| utterances[i].entry.duration_s)
                        .sum::<f64>();
                    continue;
                }
                let mut joined = Joined::new(options.pause_s);
                for &i in &group {
                    let u = &utterances[i];
                    let samples = load_audio(&u.audio_path)?;
                    joined.push(
                        &samples,
                        u.entry.text.trim(),
                        u.entry.phones.split_whitespace().map(str::to_string),
                    );
                }
                let id = format!("{split}-{:05}", entries.len());
                let audio = format!("audio/{split}/{id}.flac");
                write_flac(
                    &options.out.join(&audio),
                    &joined.samples,
                    SAMPLE_RATE_HZ,
                    16,
                )?;
                sources.push_str(&id);
                for &i in &group {
                    sources.push('\t');
                    sources.push_str(&utterances[i].entry.id);
                }
                sources.push('\n');
                used += group.len();
                entries.push(ManifestEntry {
                    id,
                    audio,
                    duration_s: (joined.seconds() * 1000.0).round() / 1000.0,
                    text: joined.text,
                    phones: joined.phones.join(" "),
                    voice: voice.clone(),
                });
            }
        }
        let path = options.out.join(format!("{split}.jsonl"));
        write_manifest(&path, &entries)
            .with_context(|| format!("{}: cannot write", path.display()))?;
        report.seconds.insert(
            split.clone(),
            entries.iter().map(|e| e.duration_s).collect(),
        );
        report.clips_used.insert(split.clone(), used);
        report.left_out.insert(split.clone(), (dropped, dropped_s));
    }
    write_atomic(&options.out.join("joined-from.tsv"), sources.as_bytes())?;
    for name in ["copyright", "readme.txt.gz", "README.md"] {
        let file = options.corpus.join(name);
        if file.exists() {
            let to = if name == "README.md" {
                options.out.join("SOURCE-README.md")
            } else {
                options.out.join(name)
            };
            std::fs::copy(&file, &to)
                .with_context(|| format!("{}: cannot copy", file.display()))?;
        }
    }
    write_atomic(
        &options.out.join("README.md"),
        format!(
            "# Long-form utterances joined from `{}`\n\n\
             Made by `asr join --corpus {} --min-seconds {} --mean-seconds {} --max-seconds {} --pause-seconds {} --seed {}`: \
             each speaker's clips of a split, in manifest order, joined with {} s pauses into utterances of \
             {}–{} s (see `asr_model::join`); `joined-from.tsv` lists each utterance's clips. The source's \
             licence files are copied beside this one{}.\n",
            options.corpus.display(),
            options.corpus.display(),
            options.min_seconds,
            options.mean_seconds,
            options.max_seconds,
            options.pause_s,
            options.seed,
            options.pause_s,
            options.min_seconds,
            options.max_seconds,
            if options.corpus.join("README.md").exists() {
                " (its README as `SOURCE-README.md`)"
            } else {
                ""
            }
        )
        .as_bytes(),
    )?;
    Ok(report)
}
