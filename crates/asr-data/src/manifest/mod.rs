//! Corpus splits as JSONL manifests, one utterance per line.
//!
//! - `read.rs`: the format ([`ManifestEntry`]), [`read_manifest`] (every line validated, every
//!   audio file decoded, before any training) and [`write_manifest`].
//! - `import.rs`: `asr manifest`, a split from one's own recordings and transcripts
//!   ([`import()`]: LibriSpeech, Kaldi or TSV layouts).
//!
//! A line is `{"id", "audio", "duration_s", "text", "phones", "voice"}`; `audio` is relative to
//! the manifest's directory (or absolute) and `phones` is the space-separated phone labels.

pub mod import;
mod read;

pub use import::{ImportOptions, ImportReport, Source, import};
pub use read::{ManifestEntry, ManifestError, Utterance, read_manifest, write_manifest};
