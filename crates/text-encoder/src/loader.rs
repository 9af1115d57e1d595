//! Loading Hugging Face BERT checkpoints (`config.json` + `model.safetensors`) through
//! burn-store.

use std::path::{Path, PathBuf};
use std::sync::LazyLock;

use burn::tensor::Device;
use burn_store::{ModuleSnapshot, PyTorchToBurnAdapter, SafetensorsStore, SafetensorsStoreError};
use clustered_attention::AttentionKind;
use regex::Regex;
use serde::Deserialize;

use crate::model::{TextEncoder, TextEncoderConfig};

/// The checkpoint's names (`transformers`' `BertModel`) → this crate's module paths: burn-nn's
/// transformer encoder's (`encoder.layers.N.mha.{query, key, value, output}`, `norm_1`,
/// `pwff.linear_inner`, `pwff.linear_outer`, `norm_2`), and LayerNorm's `weight`/`bias`
/// renamed to burn-nn's `gamma`/`beta` (the patterns apply in order). burn-store's
/// [`PyTorchToBurnAdapter`] transposes the Linear weights; it would also find `gamma`/`beta`
/// under the PyTorch names, but then still lists those as unused, which [`load_safetensors`]
/// treats as an error.
const KEY_MAP: [(&str, &str); 9] = [
    (r"^embeddings\.LayerNorm\.", "embeddings.layer_norm."),
    (
        r"^encoder\.layer\.(\d+)\.attention\.self\.(query|key|value)\.",
        "encoder.layers.$1.mha.$2.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.",
        "encoder.layers.$1.mha.output.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.",
        "encoder.layers.$1.norm_1.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.intermediate\.dense\.",
        "encoder.layers.$1.pwff.linear_inner.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.output\.dense\.",
        "encoder.layers.$1.pwff.linear_outer.",
    ),
    (
        r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.",
        "encoder.layers.$1.norm_2.",
    ),
    (r"(layer_norm|norm_1|norm_2)\.weight$", "$1.gamma"),
    (r"(layer_norm|norm_1|norm_2)\.bias$", "$1.beta"),
];

/// The inverse of [`KEY_MAP`], to name tensors in errors as the checkpoint does.
const NAME_MAP: [(&str, &str); 7] = [
    (r"^embeddings\.layer_norm\.", "embeddings.LayerNorm."),
    (
        r"^encoder\.layers\.(\d+)\.mha\.(query|key|value)\.",
        "encoder.layer.$1.attention.self.$2.",
    ),
    (
        r"^encoder\.layers\.(\d+)\.mha\.output\.",
        "encoder.layer.$1.attention.output.dense.",
    ),
    (
        r"^encoder\.layers\.(\d+)\.norm_1\.",
        "encoder.layer.$1.attention.output.LayerNorm.",
    ),
    (
        r"^encoder\.layers\.(\d+)\.pwff\.linear_inner\.",
        "encoder.layer.$1.intermediate.dense.",
    ),
    (
        r"^encoder\.layers\.(\d+)\.pwff\.linear_outer\.",
        "encoder.layer.$1.output.dense.",
    ),
    (
        r"^encoder\.layers\.(\d+)\.norm_2\.",
        "encoder.layer.$1.output.LayerNorm.",
    ),
];

/// Checkpoint tensors the encoder does not use, on purpose: the position-id buffer
/// (`0..max_position_embeddings`, not a weight) and the `[CLS]` pooler, which mean pooling
/// replaces (sentence-transformers).
pub const IGNORED_TENSORS: [&str; 3] = [
    "embeddings.position_ids",
    "pooler.dense.weight",
    "pooler.dense.bias",
];

/// Error while loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// A file cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `config.json` is not a BERT configuration.
    #[error("{path}: not a BERT config.json: {source}")]
    Config {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
    /// The configuration asks for something the encoder does not implement.
    #[error("{path}: {setting} is {value:?}; the encoder implements {supported:?} only")]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// The setting.
        setting: &'static str,
        /// Its value in the file.
        value: String,
        /// The value the encoder implements.
        supported: &'static str,
    },
    /// burn-store cannot read the safetensors file.
    #[error("{path}: {source}")]
    Store {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: SafetensorsStoreError,
    },
    /// `config.json` asks for more layers than the checkpoint has tensors (each layer has
    /// tensors of its own): refused before any layer is built.
    #[error("{path}: num_hidden_layers is {layers}, more than the {tensors} tensors of {weights}")]
    TooManyLayers {
        /// `config.json`.
        path: PathBuf,
        /// Its `num_hidden_layers`.
        layers: usize,
        /// The checkpoint.
        weights: PathBuf,
        /// The checkpoint's number of tensors.
        tensors: usize,
    },
    /// The checkpoint's tensors do not match the encoder's: tensors missing from the file,
    /// tensors in the file that the encoder does not use, and tensors of the wrong shape or
    /// type. Tensors are named as in the checkpoint.
    #[error(
        "{path} does not fit the encoder:{}{}{}",
        list("missing", missing),
        list("unused", unused),
        list("invalid", invalid)
    )]
    Mismatch {
        /// The file.
        path: PathBuf,
        /// Tensors the encoder needs that the file lacks.
        missing: Vec<String>,
        /// Tensors in the file that the encoder has no place for (besides
        /// [`IGNORED_TENSORS`]).
        unused: Vec<String>,
        /// Tensors whose shape or type does not fit, with what was expected and found.
        invalid: Vec<String>,
    },
}

fn list(what: &str, names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!(" {what}: {};", names.join(", "))
    }
}

/// The fields of a Hugging Face BERT `config.json` that the encoder reads.
#[derive(Debug, Clone, Deserialize)]
pub struct HfBertConfig {
    /// Tokens in the vocabulary.
    pub vocab_size: usize,
    /// Size of the hidden states.
    pub hidden_size: usize,
    /// Transformer layers.
    pub num_hidden_layers: usize,
    /// Attention heads per layer.
    pub num_attention_heads: usize,
    /// Feed-forward size.
    pub intermediate_size: usize,
    /// Longest input, in tokens.
    pub max_position_embeddings: usize,
    /// Token types.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Feed-forward activation; the encoder implements `gelu` (erf form).
    pub hidden_act: String,
    /// The architecture; the encoder implements `bert` (RoBERTa-family checkpoints share its
    /// tensor names but number positions from `pad_token_id + 1`).
    #[serde(default = "bert")]
    pub model_type: String,
    /// Position embeddings; the encoder implements `absolute`.
    #[serde(default = "absolute")]
    pub position_embedding_type: String,
}

fn absolute() -> String {
    "absolute".to_string()
}

fn bert() -> String {
    "bert".to_string()
}

impl HfBertConfig {
    /// Reads and checks a `config.json`.
    ///
    /// # Errors
    /// If the file cannot be read or parsed, its `model_type` is not `bert`, it asks for an
    /// activation other than `gelu` or position embeddings other than `absolute`, or
    /// `num_attention_heads` does not divide `hidden_size`.
    pub fn read(path: &Path) -> Result<Self, LoadError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoadError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let config: Self = serde_json::from_str(&text).map_err(|source| LoadError::Config {
            path: path.to_path_buf(),
            source,
        })?;
        let unsupported = |setting, value: &str, supported| LoadError::Unsupported {
            path: path.to_path_buf(),
            setting,
            value: value.to_string(),
            supported,
        };
        if config.model_type != "bert" {
            return Err(unsupported("model_type", &config.model_type, "bert"));
        }
        if config.num_attention_heads == 0
            || !config
                .hidden_size
                .is_multiple_of(config.num_attention_heads)
        {
            return Err(unsupported(
                "num_attention_heads",
                &format!(
                    "{} (hidden_size {})",
                    config.num_attention_heads, config.hidden_size
                ),
                "a divisor of hidden_size",
            ));
        }
        if config.hidden_act != "gelu" {
            return Err(unsupported("hidden_act", &config.hidden_act, "gelu"));
        }
        if config.position_embedding_type != "absolute" {
            return Err(unsupported(
                "position_embedding_type",
                &config.position_embedding_type,
                "absolute",
            ));
        }
        Ok(config)
    }

    /// The encoder's configuration, with `attention` in every layer.
    pub fn encoder_config(&self, attention: AttentionKind) -> TextEncoderConfig {
        TextEncoderConfig::new(
            self.vocab_size,
            self.hidden_size,
            self.num_hidden_layers,
            self.num_attention_heads,
            self.intermediate_size,
            self.max_position_embeddings,
            self.type_vocab_size,
        )
        .with_layer_norm_eps(self.layer_norm_eps)
        .with_attention(attention)
    }
}

/// Loads a checkpoint directory holding `config.json` and `model.safetensors` (Hugging Face
/// layout, e.g. sentence-transformers/all-MiniLM-L6-v2) into an encoder computing `attention`.
///
/// # Errors
/// See [`HfBertConfig::read`] and [`load_safetensors`]; [`LoadError::TooManyLayers`] when
/// `config.json` asks for more layers than `model.safetensors` has tensors (checked before
/// any layer is built, so a corrupt layer count cannot size an allocation).
///
/// # Panics
/// If `attention` is invalid for the layer (a cluster count or `topk` of 0).
pub fn load_pretrained(
    dir: &Path,
    attention: AttentionKind,
    device: &Device,
) -> Result<TextEncoder, LoadError> {
    let path = dir.join("config.json");
    let config = HfBertConfig::read(&path)?;
    let weights = dir.join("model.safetensors");
    let bytes = std::fs::read(&weights).map_err(|source| LoadError::Io {
        path: weights.clone(),
        source,
    })?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .map_err(|e| LoadError::Store {
            path: weights.clone(),
            source: SafetensorsStoreError::Safetensors(e),
        })?
        .len();
    if config.num_hidden_layers > tensors {
        return Err(LoadError::TooManyLayers {
            path,
            layers: config.num_hidden_layers,
            weights,
            tensors,
        });
    }
    let mut model = config.encoder_config(attention).init(device);
    load_safetensors_bytes(&mut model, &weights, bytes)?;
    Ok(model)
}

/// Loads the weights of a `transformers` `BertModel` safetensors file into `model`.
///
/// Every parameter of `model` must be in the file with its shape (Linear weights
/// `[out, in]` as PyTorch stores them), and every tensor of the file must have a place in the
/// model, except [`IGNORED_TENSORS`].
///
/// # Errors
/// [`LoadError::Io`] if the file cannot be read, [`LoadError::Store`] if it is not a
/// safetensors file; [`LoadError::Mismatch`], naming the tensors, if tensors are missing,
/// unused or of the wrong shape or type. On error `model` may hold some of the file's
/// tensors: drop it.
pub fn load_safetensors(model: &mut TextEncoder, path: &Path) -> Result<(), LoadError> {
    let bytes = std::fs::read(path).map_err(|source| LoadError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    load_safetensors_bytes(model, path, bytes)
}

/// [`load_safetensors`] of the file `path` already read into `bytes`.
fn load_safetensors_bytes(
    model: &mut TextEncoder,
    path: &Path,
    bytes: Vec<u8>,
) -> Result<(), LoadError> {
    let mut store = SafetensorsStore::from_bytes(Some(bytes))
        .with_from_adapter(PyTorchToBurnAdapter)
        .validate(false)
        .allow_partial(true);
    for (from, to) in KEY_MAP {
        store = store.with_key_remapping(from, to);
    }
    let result = model
        .load_from(&mut store)
        .map_err(|source| LoadError::Store {
            path: path.to_path_buf(),
            source,
        })?;
    let missing: Vec<String> = result
        .missing
        .iter()
        .map(|(name, _)| checkpoint_name(name))
        .collect();
    let unused: Vec<String> = result
        .unused
        .iter()
        .map(|name| checkpoint_name(name))
        .filter(|name| !IGNORED_TENSORS.contains(&name.as_str()))
        .collect();
    let invalid: Vec<String> = result
        .errors
        .iter()
        .map(|error| {
            let text = error.to_string();
            let path = match error {
                burn_store::ApplyError::ShapeMismatch { path, .. }
                | burn_store::ApplyError::DTypeMismatch { path, .. }
                | burn_store::ApplyError::AdapterError { path, .. }
                | burn_store::ApplyError::LoadError { path, .. } => path,
            };
            format!("{} ({text})", checkpoint_name(path))
        })
        .collect();
    if missing.is_empty() && unused.is_empty() && invalid.is_empty() {
        Ok(())
    } else {
        Err(LoadError::Mismatch {
            path: path.to_path_buf(),
            missing,
            unused,
            invalid,
        })
    }
}

/// The checkpoint's name of a module path (`encoder.layers.0.norm_1.gamma` →
/// `encoder.layer.0.attention.output.LayerNorm.weight`).
///
/// The loader's tests check that this inverts `KEY_MAP` for every parameter (each one's
/// missing-tensor error names it).
pub fn checkpoint_name(module_path: &str) -> String {
    static PATTERNS: LazyLock<Vec<(Regex, &str)>> = LazyLock::new(|| {
        NAME_MAP
            .iter()
            .map(|&(from, to)| (Regex::new(from).expect("valid pattern"), to))
            .collect()
    });
    let mut name = module_path.to_string();
    for (pattern, to) in PATTERNS.iter() {
        if pattern.is_match(&name) {
            name = pattern.replace(&name, *to).into_owned();
            break;
        }
    }
    if name.contains("LayerNorm.") {
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias");
    }
    name
}
