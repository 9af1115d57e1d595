#![warn(missing_docs)]
//! A BERT-family sentence encoder whose self-attention is the clustered-attention crate's
//! [`MultiHeadClusteredAttention`](clustered_attention::MultiHeadClusteredAttention), loading
//! pretrained Hugging Face checkpoints (sentence-transformers all-MiniLM-L6-v2) through
//! burn-store and tokenizing with the checkpoint's `tokenizer.json`.
//!
//! It answers the question of the paper's §4.3 (Vyas et al., NeurIPS 2020, Table 4): can the
//! attention of a model pretrained with full attention be replaced by clustered or improved
//! clustered attention without retraining? [`approx::approximate`] measures it on long
//! documents.
//!
//! # Example
//! ```no_run
//! use std::path::Path;
//! use burn::tensor::Device;
//! use clustered_attention::AttentionKind;
//! use text_encoder::{WordPieceTokenizer, batch, load_pretrained};
//!
//! let dir = Path::new("data/minilm"); // bash scripts/get-minilm.sh
//! let device = Device::flex();
//! let model = load_pretrained(dir, AttentionKind::Full, &device)?;
//! let tokenizer = WordPieceTokenizer::from_file(&dir.join("tokenizer.json"))?;
//! let inputs = vec![tokenizer.encode("A gem of a film.")?];
//! let (tokens, lengths) = batch(&inputs, tokenizer.pad_id(), &device);
//! let improved = model.with_attention(AttentionKind::Improved { clusters: 25, topk: 32 });
//! let embeddings = improved.sentence_embeddings(tokens, lengths); // [1, 384], unit rows
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod approx;
pub mod data;
pub mod loader;
pub mod model;
pub mod probe;
pub mod tokenize;

pub use loader::{HfBertConfig, LoadError, load_pretrained, load_safetensors};
pub use model::{Embeddings, TextEncoder, TextEncoderConfig};
pub use tokenize::{TokenizeError, WordPieceTokenizer, batch};

// The tests, written against the public API as an integration test would be (`text_encoder::`
// names this crate), compiled as unit tests so that `cargo test` does not build the program.
#[cfg(test)]
extern crate self as text_encoder;
#[cfg(test)]
#[path = "../tests/encoder.rs"]
mod encoder_tests;
