//! `asr manifest`: a corpus split (JSONL manifest and `phones.txt`) from one's own
//! recordings and transcripts.
//!
//! Three layouts are read ([`Source`]): a LibriSpeech-style tree (`*.trans.txt` beside the
//! audio files), a Kaldi-style data directory (`wav.scp` and `text`, optionally `utt2spk`),
//! or a TSV of audio path, transcript and optionally speaker. Transcripts are normalised
//! ([`normalize_text`]: case, punctuation, numbers spelled out) and labelled exactly as
//! [`crate::corpus`] labels its synthesized speech: `espeak-ng`'s phonemization in one accent,
//! folded onto the 39-phone inventory. Every audio file is decoded (any format and rate the
//! loader reads). Every problem — unreadable audio, an empty transcript, a word `espeak-ng`
//! cannot phonemize in English, an utterance missing from one of two files — is reported with
//! its file and line, all at once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use num2words::{Lang, Num2Words};

use super::read::{ManifestEntry, write_manifest};
use crate::audio::{SAMPLE_RATE_HZ, load_audio};
use crate::corpus::phonemize;
use crate::phones::PhoneInventory;

/// Where the recordings and transcripts are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A LibriSpeech-style tree: every `*.trans.txt` under the directory holds lines
    /// `<utterance id> <transcript>`, the audio being `<utterance id>.{flac,wav,…}` beside it;
    /// the speaker is the id's part before its first `-`.
    LibriSpeech(PathBuf),
    /// A Kaldi-style data directory: `wav.scp` (`<id> <path>`), `text` (`<id> <transcript>`)
    /// and optionally `utt2spk` (`<id> <speaker>`); relative paths are relative to the
    /// directory.
    Kaldi(PathBuf),
    /// A tab-separated file, one utterance per line: `<path>\t<transcript>[\t<speaker>]`,
    /// paths relative to the file's directory; a first line `path\ttranscript…` is a header.
    Tsv(PathBuf),
}

/// One utterance found in a source, before checking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// `file:line` of the transcript.
    pub at: String,
    /// Utterance id.
    pub id: String,
    /// Audio file.
    pub audio: PathBuf,
    /// Transcript as written.
    pub transcript: String,
    /// Speaker.
    pub speaker: String,
}

/// Audio file extensions tried beside a LibriSpeech transcript, in order.
pub const AUDIO_EXTENSIONS: [&str; 7] = ["flac", "wav", "ogg", "mp3", "m4a", "opus", "aac"];

fn read_lines(path: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    Ok(text
        .lines()
        .enumerate()
        .map(|(i, line)| (format!("{}:{}", path.display(), i + 1), line.to_string()))
        .filter(|(_, line)| !line.trim().is_empty())
        .collect())
}

fn split_id(line: &str) -> (String, String) {
    let line = line.trim();
    match line.split_once(char::is_whitespace) {
        Some((id, rest)) => (id.to_string(), rest.trim().to_string()),
        None => (line.to_string(), String::new()),
    }
}

fn find_files(dir: &Path, suffix: &str, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        if path.is_dir() {
            find_files(&path, suffix, out)?;
        } else if path.to_string_lossy().ends_with(suffix) {
            out.push(path);
        }
    }
    Ok(())
}

/// Lists the utterances of a source. Problems that concern one utterance (no audio file
/// beside a LibriSpeech transcript, an id in only one Kaldi file, a malformed TSV line) are
/// returned in the second vector, one `file:line: what` each.
///
/// # Errors
/// When the source's files cannot be read or hold no utterance.
pub fn scan(source: &Source) -> anyhow::Result<(Vec<Found>, Vec<String>)> {
    let mut found = Vec::new();
    let mut problems = Vec::new();
    match source {
        Source::LibriSpeech(root) => {
            let mut transcripts = Vec::new();
            find_files(root, ".trans.txt", &mut transcripts)
                .with_context(|| format!("{}: cannot list", root.display()))?;
            if transcripts.is_empty() {
                bail!("{}: no *.trans.txt file under it", root.display());
            }
            for file in transcripts {
                let dir = file.parent().unwrap_or(Path::new("."));
                for (at, line) in read_lines(&file)? {
                    let (id, transcript) = split_id(&line);
                    let audio = AUDIO_EXTENSIONS
                        .iter()
                        .map(|ext| dir.join(format!("{id}.{ext}")))
                        .find(|p| p.exists());
                    let Some(audio) = audio else {
                        problems.push(format!(
                            "{at}: no audio file {id}.{{{}}} in {}",
                            AUDIO_EXTENSIONS.join(","),
                            dir.display()
                        ));
                        continue;
                    };
                    let speaker = id.split('-').next().unwrap_or(&id).to_string();
                    found.push(Found {
                        at,
                        id,
                        audio,
                        transcript,
                        speaker,
                    });
                }
            }
        }
        Source::Kaldi(dir) => {
            let wav_scp = dir.join("wav.scp");
            let mut audio: HashMap<String, (String, PathBuf)> = HashMap::new();
            for (at, line) in read_lines(&wav_scp)? {
                let (id, path) = split_id(&line);
                if path.is_empty() {
                    problems.push(format!("{at}: no audio path for {id:?}"));
                } else if path.ends_with('|') {
                    problems.push(format!(
                        "{at}: {id:?} is a command pipe ({path}); give an audio file path"
                    ));
                } else if audio
                    .insert(id.clone(), (at.clone(), dir.join(&path)))
                    .is_some()
                {
                    problems.push(format!("{at}: duplicate id {id:?}"));
                }
            }
            let utt2spk = dir.join("utt2spk");
            let mut speakers = HashMap::new();
            if utt2spk.exists() {
                for (_, line) in read_lines(&utt2spk)? {
                    let (id, speaker) = split_id(&line);
                    speakers.insert(id, speaker);
                }
            }
            let mut seen = HashSet::new();
            for (at, line) in read_lines(&dir.join("text"))? {
                let (id, transcript) = split_id(&line);
                if !seen.insert(id.clone()) {
                    problems.push(format!("{at}: duplicate id {id:?}"));
                    continue;
                }
                let Some((_, path)) = audio.get(&id) else {
                    problems.push(format!("{at}: {id:?} has no line in {}", wav_scp.display()));
                    continue;
                };
                found.push(Found {
                    at,
                    speaker: speakers
                        .get(&id)
                        .cloned()
                        .unwrap_or_else(|| "unknown".into()),
                    id,
                    audio: path.clone(),
                    transcript,
                });
            }
            let mut orphans: Vec<_> = audio
                .iter()
                .filter(|(id, _)| !seen.contains(*id))
                .map(|(id, (at, _))| format!("{at}: {id:?} has no transcript in text"))
                .collect();
            orphans.sort();
            problems.extend(orphans);
        }
        Source::Tsv(file) => {
            let dir = file.parent().unwrap_or(Path::new("."));
            let mut ids: HashMap<String, usize> = HashMap::new();
            for (n, (at, line)) in read_lines(file)?.into_iter().enumerate() {
                let fields: Vec<&str> = line.split('\t').collect();
                if n == 0 && fields[0].trim().eq_ignore_ascii_case("path") {
                    continue;
                }
                if !(2..=3).contains(&fields.len()) {
                    problems.push(format!(
                        "{at}: expected `path<TAB>transcript[<TAB>speaker]`, found {} field(s)",
                        fields.len()
                    ));
                    continue;
                }
                let audio = dir.join(fields[0].trim());
                let stem = audio
                    .file_stem()
                    .map_or("utterance".into(), |s| s.to_string_lossy().to_string());
                let count = ids.entry(stem.clone()).or_default();
                *count += 1;
                let id = if *count == 1 {
                    stem
                } else {
                    format!("{stem}-{count}")
                };
                found.push(Found {
                    at,
                    id,
                    audio,
                    transcript: fields[1].trim().to_string(),
                    speaker: fields.get(2).map_or("unknown", |s| s.trim()).to_string(),
                });
            }
        }
    }
    if found.is_empty() && problems.is_empty() {
        bail!("{source:?}: no utterance found");
    }
    Ok((found, problems))
}

/// English words of a num2words request (cardinal, ordinal or year), hyphens and commas as
/// spaces.
fn number_words(n: Num2Words) -> Option<String> {
    n.lang(Lang::English)
        .to_words()
        .ok()
        .map(|w| w.replace(['-', ','], " "))
}

/// Normalises a transcript for labelling: lower case; `&`, `%`, `+`, `@` as words; numbers
/// spelled out (num2words: `25` → "twenty five", `1st` → "first", `3.5` → "three point
/// five", 1100–1999 and 2010–2099 written without a separator read as years); thousands
/// separators dropped; abbreviations spelled with dots read letter by letter (`d.n.a.` →
/// "d n a"); punctuation around words removed (apostrophes inside words kept; hyphens,
/// dashes and slashes become spaces).
///
/// # Errors
/// The words that remain unspeakable: tokens with characters that are neither letters nor
/// inner apostrophes once numbers are spelled out (e.g. `5€`, `$5`, `½`, `<unk>`), or
/// letters of another script than Latin (`你好`, `ω`).
pub fn normalize_text(text: &str) -> Result<String, Vec<String>> {
    let lower = text.to_lowercase();
    let mut spaced = String::new();
    for c in lower.chars() {
        match c {
            '&' => spaced.push_str(" and "),
            '%' => spaced.push_str(" percent "),
            '+' => spaced.push_str(" plus "),
            '@' => spaced.push_str(" at "),
            '-' | '–' | '—' | '/' | '_' => spaced.push(' '),
            '’' | '‘' => spaced.push('\''),
            _ => spaced.push(c),
        }
    }
    let mut words = Vec::new();
    let mut bad = Vec::new();
    for raw in spaced.split_whitespace() {
        let token = raw.trim_matches(|c: char| {
            matches!(
                c,
                '.' | ','
                    | ';'
                    | ':'
                    | '!'
                    | '?'
                    | '"'
                    | '\''
                    | '('
                    | ')'
                    | '['
                    | ']'
                    | '{'
                    | '}'
                    | '*'
                    | '#'
                    | '…'
                    | '“'
                    | '”'
                    | '«'
                    | '»'
                    | '¿'
                    | '¡'
            )
        });
        if token.is_empty() {
            continue;
        }
        let digits = token.replace(',', "");
        let spoken = if digits.chars().all(|c| c.is_ascii_digit()) {
            let n: i64 = match digits.parse() {
                Ok(n) => n,
                Err(_) => {
                    bad.push(token.to_string());
                    continue;
                }
            };
            let year = token.len() == 4 && ((1100..2000).contains(&n) || (2010..2100).contains(&n));
            number_words(if year {
                Num2Words::new(n).year()
            } else {
                Num2Words::new(n)
            })
        } else if let Some(n) = ["st", "nd", "rd", "th"]
            .iter()
            .find_map(|s| digits.strip_suffix(s))
            .filter(|d| !d.is_empty() && d.chars().all(|c| c.is_ascii_digit()))
            .and_then(|d| d.parse::<i64>().ok())
        {
            number_words(Num2Words::new(n).ordinal())
        } else if let Some((whole, fraction)) = digits.split_once('.').filter(|(w, f)| {
            !w.is_empty() && !f.is_empty() && w.chars().chain(f.chars()).all(|c| c.is_ascii_digit())
        }) {
            let whole = whole
                .parse::<i64>()
                .ok()
                .and_then(|w| number_words(Num2Words::new(w)));
            let fraction: Vec<String> = fraction
                .chars()
                .filter_map(|d| number_words(Num2Words::new(d.to_digit(10)? as i64)))
                .collect();
            whole.map(|w| format!("{w} point {}", fraction.join(" ")))
        } else if token.contains('.')
            && token.split('.').count() >= 2
            && token
                .split('.')
                .all(|part| part.len() == 1 && part.chars().all(|c| c.is_ascii_alphabetic()))
        {
            // An abbreviation spelled with dots (`d.n.a`): its letters, read one by one.
            Some(token.split('.').collect::<Vec<_>>().join(" "))
        } else {
            let chars: Vec<char> = token.chars().collect();
            // Latin letters only: espeak-ng's English voices read other scripts as "Chinese
            // letter", "Greek letter", … instead of the word.
            let latin = |c: char| {
                c.is_ascii_alphabetic()
                    || (c.is_alphabetic() && ('\u{C0}'..='\u{24F}').contains(&c))
            };
            let speakable = chars
                .iter()
                .enumerate()
                .all(|(i, c)| latin(*c) || (*c == '\'' && i > 0 && i + 1 < chars.len()));
            speakable.then(|| token.to_string())
        };
        match spoken {
            Some(w) => words.push(w),
            None => bad.push(token.to_string()),
        }
    }
    if bad.is_empty() {
        Ok(words.join(" "))
    } else {
        Err(bad)
    }
}

/// `espeak-ng`'s folded phones of a normalised transcript in `accent` (as
/// [`crate::corpus::phonemize`]), or the words it cannot phonemize in English: words it reads
/// in another language (its output then holds a language switch such as `(zh)`) or whose
/// phonemes fall outside the inventory. Run [`check_espeak`] first: a failure to run
/// `espeak-ng` is reported here as unspeakable words.
///
/// # Errors
/// The unspeakable words (the whole transcript when no single word is to blame).
pub fn label(normalized: &str, accent: &str) -> Result<Vec<&'static str>, Vec<String>> {
    let one = |text: &str| phonemize(text, accent).ok().filter(|p| !p.is_empty());
    if let Some(phones) = one(normalized) {
        return Ok(phones);
    }
    let mut bad: Vec<String> = normalized
        .split_whitespace()
        .filter(|word| one(word).is_none())
        .map(String::from)
        .collect();
    if bad.is_empty() {
        bad.push(normalized.to_string());
    }
    Err(bad)
}

/// Checks that `espeak-ng` runs and knows `accent`.
///
/// # Errors
/// When it is missing or rejects the voice.
pub fn check_espeak(accent: &str) -> anyhow::Result<()> {
    let out = std::process::Command::new("espeak-ng")
        .args(["-q", "--ipa", "-v", accent, "a"])
        .output()
        .context("cannot run espeak-ng (is it installed? Debian: apt install espeak-ng)")?;
    if !out.status.success() || out.stdout.is_empty() {
        bail!(
            "espeak-ng rejects the voice {accent:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Settings of `asr manifest`.
#[derive(Debug, Clone)]
pub struct ImportOptions {
    /// The recordings.
    pub source: Source,
    /// Corpus directory to write `<split>.jsonl` and `phones.txt` into.
    pub out: PathBuf,
    /// Split name (`train`, `dev`, `test` or another).
    pub split: String,
    /// `espeak-ng` voice whose phonemizer labels the transcripts (e.g. `en-us`, `en-gb`).
    pub accent: String,
    /// Write the good utterances and report the others, instead of failing.
    pub skip_bad: bool,
}

/// What [`import`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ImportReport {
    /// The manifest written.
    pub manifest: PathBuf,
    /// Utterances written.
    pub utterances: usize,
    /// Their audio, in seconds.
    pub seconds: f64,
    /// Problems of the utterances left out (only with `skip_bad`).
    pub skipped: Vec<String>,
}

fn relative_to(path: &Path, dir: &Path) -> String {
    let (abs_path, abs_dir) = (
        std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf()),
        std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf()),
    );
    match abs_path.strip_prefix(&abs_dir) {
        Ok(rel) => rel.to_string_lossy().into_owned(),
        Err(_) => abs_path.to_string_lossy().into_owned(),
    }
}

/// Builds `<out>/<split>.jsonl` (and `<out>/phones.txt`, the standard inventory) from a
/// source: every utterance's audio decoded, its transcript normalised and labelled.
/// Audio paths are written relative to `out` when under it, absolute otherwise.
///
/// # Errors
/// Every problem at once, one `file:line: what` per line (unless `skip_bad`: then only when
/// no utterance is usable); or when `out/phones.txt` exists with another inventory, or a
/// file cannot be written.
pub fn import(options: &ImportOptions) -> anyhow::Result<ImportReport> {
    check_espeak(&options.accent)?;
    let (found, mut problems) = scan(&options.source)?;
    let inventory = PhoneInventory::standard();
    let phones_path = options.out.join("phones.txt");
    if phones_path.exists() {
        let existing = PhoneInventory::load(&phones_path).map_err(anyhow::Error::msg)?;
        if existing != inventory {
            bail!(
                "{}: another phone inventory than the standard one; choose another --out",
                phones_path.display()
            );
        }
    }
    let mut entries = BTreeMap::new();
    let mut seconds = 0.0;
    for item in &found {
        let mut ok = true;
        let duration_s = match load_audio(&item.audio) {
            Ok(samples) if samples.is_empty() => {
                problems.push(format!(
                    "{}: {}: the audio is empty",
                    item.at,
                    item.audio.display()
                ));
                ok = false;
                0.0
            }
            Ok(samples) => samples.len() as f64 / SAMPLE_RATE_HZ as f64,
            Err(e) => {
                problems.push(format!("{}: {e}", item.at));
                ok = false;
                0.0
            }
        };
        let phones = match normalize_text(&item.transcript) {
            Ok(text) if text.is_empty() => {
                problems.push(format!(
                    "{}: {:?} has an empty transcript",
                    item.at, item.id
                ));
                None
            }
            Ok(text) => match label(&text, &options.accent) {
                Ok(phones) => Some((text, phones)),
                Err(words) => {
                    problems.push(format!(
                        "{}: {:?}: espeak-ng ({}) cannot phonemize {words:?}",
                        item.at, item.id, options.accent
                    ));
                    None
                }
            },
            Err(words) => {
                problems.push(format!(
                    "{}: {:?}: unspeakable word(s) {words:?}",
                    item.at, item.id
                ));
                None
            }
        };
        let (Some((text, phones)), true) = (phones, ok) else {
            continue;
        };
        if entries.contains_key(&item.id) {
            problems.push(format!("{}: duplicate id {:?}", item.at, item.id));
            continue;
        }
        seconds += duration_s;
        entries.insert(
            item.id.clone(),
            ManifestEntry {
                id: item.id.clone(),
                audio: relative_to(&item.audio, &options.out),
                duration_s: (duration_s * 1000.0).round() / 1000.0,
                text,
                phones: phones.join(" "),
                voice: item.speaker.clone(),
            },
        );
    }
    if !problems.is_empty() && (!options.skip_bad || entries.is_empty()) {
        bail!(
            "{} problem(s); nothing written{}:\n{}",
            problems.len(),
            if options.skip_bad {
                ""
            } else {
                " (--skip-bad writes the rest)"
            },
            problems.join("\n")
        );
    }
    std::fs::create_dir_all(&options.out)
        .with_context(|| format!("{}: cannot create", options.out.display()))?;
    inventory.save(&phones_path)?;
    let manifest = options.out.join(format!("{}.jsonl", options.split));
    let entries: Vec<ManifestEntry> = entries.into_values().collect();
    write_manifest(&manifest, &entries)
        .with_context(|| format!("{}: cannot write", manifest.display()))?;
    Ok(ImportReport {
        manifest,
        utterances: entries.len(),
        seconds,
        skipped: problems,
    })
}
