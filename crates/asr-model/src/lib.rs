//! A transformer CTC phone recognizer whose encoder layers use full, clustered or improved
//! clustered attention ([`clustered_attention`]), after the speech experiments of Vyas,
//! Katharopoulos & Fleuret, *Fast Transformers with Clustered Attention* (NeurIPS 2020), §4.1.
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
//! - [`clusters`]: which encoder steps share a cluster, per layer and head (`asr clusters`).
#![warn(missing_docs)]

pub mod audio;
pub mod augment;
pub mod clusters;
pub mod compare;
pub mod corpus;
pub mod ctc;
pub mod data;
pub mod decode;
pub mod features;
pub mod games;
pub mod join;
pub mod manifest;
pub mod model;
pub mod phones;
pub mod render;
pub mod train;

/// `asr manifest`'s importer, now [`manifest::import`](mod@manifest::import).
#[deprecated(note = "moved to `asr_model::manifest::import`")]
pub mod import {
    pub use crate::manifest::import::*;
}
