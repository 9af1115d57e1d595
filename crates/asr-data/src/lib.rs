//! The speech data of the ASR example (`asr-model`), everything done on the host before a
//! tensor exists: audio in and out, log-mel filterbank features, augmentation, phone
//! inventories and the corpora the model trains on. Its modules are re-exported by
//! `asr-model` under the same names (`asr_model::features`, …).
//!
//! - [`corpus`]: a multi-speaker English corpus synthesized with `espeak-ng` (and `flite`);
//! - [`manifest`], [`audio`], [`features`]: JSONL manifests validated up front, audio in the
//!   common formats at any sample rate, log-mel filterbank features;
//! - [`augment`]: training-time augmentation (speed, reverberation, band-limiting, noise,
//!   8-bit quantization, SpecAugment);
//! - [`manifest::import`](mod@manifest::import): a corpus split from one's own recordings
//!   (LibriSpeech, Kaldi or TSV layout);
//! - [`join`]: long-form utterances, consecutive clips of one speaker joined;
//! - [`games`]: real recorded speech from two freeware games' voice tracks (Debian packages
//!   `beneath-a-steel-sky`, `flight-of-the-amazon-queen`);
//! - [`phones`]: the phone inventory and its CTC blank;
//! - [`data`]: utterances as model inputs, length-bucketed batches, the batchers;
//! - [`files`]: files written whole or not at all (a temporary file renamed into place).
#![warn(missing_docs)]

pub mod audio;
pub mod augment;
pub mod corpus;
pub mod data;
pub mod features;
pub mod files;
pub mod games;
pub mod join;
pub mod manifest;
pub mod phones;
