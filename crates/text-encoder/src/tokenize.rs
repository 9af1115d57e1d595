//! WordPiece tokenization with the checkpoint's `tokenizer.json` (Hugging Face `tokenizers`),
//! and batching of token ids.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
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
    /// The tokenizer gives ids beyond the encoder's word embeddings (the tokenizer of
    /// another model).
    #[error(
        "the tokenizer's ids go up to {}, beyond the encoder's {embeddings} word embeddings",
        vocab_size - 1
    )]
    VocabularyTooLarge {
        /// One more than the tokenizer's largest id.
        vocab_size: usize,
        /// The encoder's word embeddings.
        embeddings: usize,
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
    /// Reads `tokenizer.json`, without its decoder: the encoder never turns ids back into
    /// text, and `tokenizers` 0.22 panics on a malformed decoder entry (a file cut inside it,
    /// as by an interrupted download) instead of returning an error, so the file is parsed
    /// as JSON first and the decoder dropped before the tokenizer is built from it.
    ///
    /// # Errors
    /// If the file cannot be read or parsed, or has no `[CLS]`, `[SEP]` or `[PAD]` token.
    pub fn from_file(path: &Path) -> Result<Self, TokenizeError> {
        let load_error = |message: String| TokenizeError::Load {
            path: path.to_path_buf(),
            message,
        };
        let text = std::fs::read_to_string(path).map_err(|e| load_error(e.to_string()))?;
        let mut json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| load_error(e.to_string()))?;
        if let Some(object) = json.as_object_mut() {
            object.insert("decoder".into(), serde_json::Value::Null);
        }
        let mut inner: Tokenizer =
            serde_json::from_value(json).map_err(|e| load_error(e.to_string()))?;
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

    /// One more than the largest id the tokenizer gives (added tokens included): its ids are
    /// in `0..vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&id| id as usize + 1)
    }

    /// Checks that every id the tokenizer gives has a row in an encoder's word embeddings of
    /// `embeddings` rows ([`TextEncoder::vocab_size`](crate::TextEncoder::vocab_size)), as
    /// when the tokenizer and the checkpoint come from the same model.
    ///
    /// # Errors
    /// [`TokenizeError::VocabularyTooLarge`], giving both sizes.
    pub fn check_fits(&self, embeddings: usize) -> Result<(), TokenizeError> {
        let vocab_size = self.vocab_size();
        if vocab_size <= embeddings {
            Ok(())
        } else {
            Err(TokenizeError::VocabularyTooLarge {
                vocab_size,
                embeddings,
            })
        }
    }
}

/// Pads `inputs` with `pad` to the longest one.
///
/// # Shapes
/// - output: tokens `[inputs.len(), max length]`, lengths `[inputs.len()]`
///
/// # Panics
/// If `inputs` is empty.
pub fn batch(inputs: &[Vec<u32>], pad: u32, device: &Device) -> (Tensor<2, Int>, Tensor<1, Int>) {
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
