//! A transformer CTC phone recognizer whose encoder layers use full, clustered or improved
//! clustered attention ([`clustered_attention`]), after the speech experiments of Vyas,
//! Katharopoulos & Fleuret, *Fast Transformers with Clustered Attention* (NeurIPS 2020), §4.1.
//!
//! The speech data (corpus, manifests, audio, features, augmentation, joins, games, phones and
//! the batchers' [`data`]) is the `asr-data` crate's, re-exported here under the same names.
//!
//! - [`corpus`]: a multi-speaker English corpus synthesized with `espeak-ng` (and `flite`);
//! - [`manifest`], [`audio`], [`features`]: JSONL manifests validated up front, WAV/FLAC at any
//!   sample rate, log-mel filterbank features;
//! - [`augment`]: training-time augmentation (speed, reverberation, band-limiting, noise,
//!   8-bit quantization, SpecAugment);
//! - [`manifest::import`](mod@manifest::import): `asr manifest`, a corpus split from one's own
//!   recordings (LibriSpeech, Kaldi or TSV layout);
//! - [`join`]: long-form utterances, consecutive clips of one speaker joined (`asr join`);
//! - [`games`]: `asr import`, real recorded speech from two freeware games' voice tracks
//!   (Debian packages `beneath-a-steel-sky`, `flight-of-the-amazon-queen`);
//! - [`model`]: the encoder ([`model::AsrModelConfig`]) and its CTC loss;
//! - [`ctc`]: the CTC loss by the alpha–beta recursions, with its gradient in closed form;
//! - [`decode`]: greedy CTC decoding and the phone error rate;
//! - [`train`]: training with burn-train, evaluation, saving and loading;
//! - [`compare`]: the paper's Table 2 and Figure 1 for trained models;
//! - [`json`]: the training log and the tables' results as JSON files, written whole or not at
//!   all;
//! - [`clusters`]: which encoder steps share a cluster, per layer and head (`asr clusters`).
#![warn(missing_docs)]

pub mod clusters;
pub mod compare;
pub mod ctc;
pub mod decode;
pub mod json;
pub mod model;
pub mod render;
pub mod train;

// The speech data, host-side (its own crate, so that its tests' heavy loops build optimized
// while this crate's tests build at opt-level 0; see the workspace's Cargo.toml).
pub use asr_data::{audio, augment, corpus, data, features, files, games, join, manifest, phones};
