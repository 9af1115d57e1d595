//! Reading and writing JSONL manifests: one utterance per line, validated as a whole before
//! any training.
//!
//! A line is `{"id", "audio", "duration_s", "text", "phones", "voice"}`; `audio` is relative to
//! the manifest's directory (or absolute) and `phones` is the space-separated phone labels.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::audio::load_audio;
use crate::phones::PhoneInventory;

/// One utterance of a manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManifestEntry {
    /// Unique utterance id.
    pub id: String,
    /// Audio file (any of [`crate::audio::FORMATS`], any sample rate), relative to the
    /// manifest's directory.
    pub audio: String,
    /// Duration in seconds.
    pub duration_s: f64,
    /// The spoken text.
    pub text: String,
    /// Space-separated phone labels, each in the corpus's phone inventory.
    pub phones: String,
    /// The synthesis voice (speaker).
    pub voice: String,
}

/// An utterance read from a manifest: its entry, the audio's resolved path and its labels
/// as model outputs (1-based; 0 is the CTC blank).
#[derive(Debug, Clone)]
pub struct Utterance {
    /// The manifest entry.
    pub entry: ManifestEntry,
    /// Path of the audio file.
    pub audio_path: PathBuf,
    /// The labels as model outputs (`1..=inventory.len()`).
    pub targets: Vec<usize>,
}

/// Every problem found in a manifest, each with its file and line.
#[derive(Debug, thiserror::Error)]
#[error("{} problem(s) in {}:\n{}", .problems.len(), .manifest.display(), .problems.join("\n"))]
pub struct ManifestError {
    /// The manifest.
    pub manifest: PathBuf,
    /// One message per problem: `file:line: what`.
    pub problems: Vec<String>,
}

/// Reads and validates a manifest. When `check_audio` is true every audio file is also
/// opened and decoded (missing, corrupt or empty files are reported).
///
/// # Errors
/// A [`ManifestError`] listing every problem at once: unreadable manifest, malformed JSON,
/// duplicate id, empty transcript or phones, a phone outside `inventory`, a missing, corrupt
/// or empty audio file.
pub fn read_manifest(
    path: &Path,
    inventory: &PhoneInventory,
    check_audio: bool,
) -> Result<Vec<Utterance>, ManifestError> {
    let fail = |problems| ManifestError {
        manifest: path.to_path_buf(),
        problems,
    };
    let text = std::fs::read_to_string(path)
        .map_err(|e| fail(vec![format!("{}: cannot read: {e}", path.display())]))?;
    let dir = path.parent().unwrap_or(Path::new("."));
    let mut problems = Vec::new();
    let mut utterances = Vec::new();
    let mut ids = std::collections::HashSet::new();
    for (number, line) in text.lines().enumerate() {
        let at = format!("{}:{}", path.display(), number + 1);
        if line.trim().is_empty() {
            continue;
        }
        let entry: ManifestEntry = match serde_json::from_str(line) {
            Ok(entry) => entry,
            Err(e) => {
                problems.push(format!("{at}: malformed entry: {e}"));
                continue;
            }
        };
        let mut ok = true;
        if !ids.insert(entry.id.clone()) {
            problems.push(format!("{at}: duplicate id {:?}", entry.id));
            ok = false;
        }
        if entry.text.trim().is_empty() {
            problems.push(format!(
                "{at}: utterance {:?} has an empty transcript",
                entry.id
            ));
            ok = false;
        }
        let mut targets = Vec::new();
        for phone in entry.phones.split_whitespace() {
            match inventory.output_of(phone) {
                Some(output) => targets.push(output),
                None => {
                    problems.push(format!(
                        "{at}: utterance {:?}: phone {phone:?} is not in the inventory",
                        entry.id
                    ));
                    ok = false;
                }
            }
        }
        if targets.is_empty() && ok {
            problems.push(format!("{at}: utterance {:?} has no phones", entry.id));
            ok = false;
        }
        let audio_path = dir.join(&entry.audio);
        if check_audio {
            match load_audio(&audio_path) {
                Ok(samples) if samples.is_empty() => {
                    problems.push(format!(
                        "{at}: {}: the audio is empty",
                        audio_path.display()
                    ));
                    ok = false;
                }
                Ok(_) => {}
                Err(e) => {
                    problems.push(format!("{at}: {e}"));
                    ok = false;
                }
            }
        }
        if ok {
            utterances.push(Utterance {
                entry,
                audio_path,
                targets,
            });
        }
    }
    if utterances.is_empty() && problems.is_empty() {
        problems.push(format!(
            "{}: the manifest has no utterances",
            path.display()
        ));
    }
    if problems.is_empty() {
        Ok(utterances)
    } else {
        Err(fail(problems))
    }
}

/// Writes a manifest, one JSON object per line, whole or not at all
/// ([`write_atomic`](crate::files::write_atomic)).
///
/// # Errors
/// When the file cannot be written.
pub fn write_manifest(path: &Path, entries: &[ManifestEntry]) -> std::io::Result<()> {
    let mut out = String::new();
    for entry in entries {
        out.push_str(&serde_json::to_string(entry).expect("a manifest entry serialises"));
        out.push('\n');
    }
    crate::files::write_atomic(path, out.as_bytes())
}
