//! WordPiece tokenization with the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`),
//! and batching of token ids.

use std::path::{Path, PathBuf};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};
use tokenizers::Tokenizer;

/// Error of the tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    /// `tokenizer.json` cannot be read or parsed.
    #[error("cannot load tokenizer {path}: {message}")]
    Load {
        /// The file.
        path: PathBuf,
        /// The cause.
        message: String,
    },
    /// The vocabulary lacks a special token.
    #[error("tokenizer {path} has no {token} token")]
    MissingToken {
        /// The file.
        path: PathBuf,
        /// The token.
        token: &'static str,
    },
    /// Encoding failed.
    #[error("cannot tokenize {text:?}: {message}")]
    Encode {
        /// The text (its start).
        text: String,
        /// The cause.
        message: String,
    },
}

/// A BERT WordPiece tokenizer read from a `tokenizer.json`, with its padding and truncation
/// turned off: [`Self::encode`] returns the whole text's ids, and callers cut and pad
/// explicitly ([`Self::wrap`], [`batch`]).
#[derive(Debug, Clone)]
pub struct WordPieceTokenizer {
    inner: Tokenizer,
    cls: u32,
    sep: u32,
    pad: u32,
}

impl WordPieceTokenizer {
    /// Reads `tokenizer.json`.
    ///
    /// # Errors
    /// If the file cannot be read or parsed, or has no `[CLS]`, `[SEP]` or `[PAD]` token.
    pub fn from_file(path: &Path) -> Result<Self, TokenizeError> {
        let mut inner = Tokenizer::from_file(path).map_err(|e| TokenizeError::Load {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        inner.with_padding(None);
        inner
            .with_truncation(None)
            .map_err(|e| TokenizeError::Load {
                path: path.to_path_buf(),
                message: e.to_string(),
            })?;
        let id = |token| {
            inner
                .token_to_id(token)
                .ok_or_else(|| TokenizeError::MissingToken {
                    path: path.to_path_buf(),
                    token,
                })
        };
        let (cls, sep, pad) = (id("[CLS]")?, id("[SEP]")?, id("[PAD]")?);
        Ok(Self {
            inner,
            cls,
            sep,
            pad,
        })
    }

    /// `[CLS]`, the text's ids, `[SEP]`; as many as the text needs (no truncation).
    ///
    /// # Errors
    /// If the tokenizer fails on the text.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        Ok(self.wrap(&self.encode_words(text)?, usize::MAX))
    }

    /// The text's ids without special tokens.
    ///
    /// # Errors
    /// If the tokenizer fails on the text.
    pub fn encode_words(&self, text: &str) -> Result<Vec<u32>, TokenizeError> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| TokenizeError::Encode {
                text: text.chars().take(80).collect(),
                message: e.to_string(),
            })?;
        Ok(encoding.get_ids().to_vec())
    }

    /// `[CLS]`, the first `max_len − 2` of `words`, `[SEP]`: an input of at most `max_len`
    /// tokens.
    ///
    /// # Panics
    /// If `max_len < 2`.
    pub fn wrap(&self, words: &[u32], max_len: usize) -> Vec<u32> {
        assert!(
            max_len >= 2,
            "max_len {max_len} leaves no room for [CLS] and [SEP]"
        );
        let kept = words.len().min(max_len - 2);
        let mut ids = Vec::with_capacity(kept + 2);
        ids.push(self.cls);
        ids.extend_from_slice(&words[..kept]);
        ids.push(self.sep);
        ids
    }

    /// The `[PAD]` id.
    pub fn pad_id(&self) -> u32 {
        self.pad
    }
}

/// Pads `inputs` with `pad` to the longest one.
///
/// # Shapes
/// - output: tokens `[inputs.len(), max length]`, lengths `[inputs.len()]`
///
/// # Panics
/// If `inputs` is empty.
pub fn batch<B: Backend>(
    inputs: &[Vec<u32>],
    pad: u32,
    device: &B::Device,
) -> (Tensor<B, 2, Int>, Tensor<B, 1, Int>) {
    assert!(!inputs.is_empty(), "batch of no inputs");
    let seq = inputs.iter().map(Vec::len).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(inputs.len() * seq);
    for input in inputs {
        ids.extend(input.iter().map(|&id| id as i64));
        ids.extend(std::iter::repeat_n(pad as i64, seq - input.len()));
    }
    let lengths: Vec<i64> = inputs.iter().map(|input| input.len() as i64).collect();
    (
        Tensor::from_data(TensorData::new(ids, [inputs.len(), seq]), device),
        Tensor::from_data(TensorData::new(lengths, [inputs.len()]), device),
    )
}
