//! The commands of `asr`, one file each: its arguments and what it runs.
//!
//! - `corpus.rs`: `asr corpus`, the synthesized corpus.
//! - `manifest.rs`: `asr manifest`, a corpus split from one's own recordings.
//! - `import.rs`: `asr import`, a corpus from an installed game's voice track.
//! - `join.rs`: `asr join`, long-form utterances joined from a corpus.
//! - `train.rs`: `asr train`.
//! - `eval.rs`: `asr eval`, the phone error rates of trained models (the paper's Table 1).
//! - `compare.rs`: `asr compare`, the paper's Table 2 and Figure 1.
//! - `clusters.rs`: `asr clusters`, which steps share a cluster, per layer and head.
//! - `transcribe.rs`: `asr transcribe`, one audio file.
//! - `step_time.rs`: `asr step-time`, the time of a training step per attention.

pub mod clusters;
pub mod compare;
pub mod corpus;
pub mod eval;
pub mod import;
pub mod join;
pub mod manifest;
pub mod step_time;
pub mod train;
pub mod transcribe;
