//! A trained model on disk: its weights (`model-N.safetensors`, written and read with
//! burn-store) and what rebuilds it (`model.json`, which names the weights file).

use std::path::{Path, PathBuf};

use anyhow::Context;
use asr_data::files::{remove_partial_files, write_atomic};
use burn::tensor::Device;
use burn::train::checkpoint::{Checkpoint, Checkpointer, CheckpointerError};
use burn_store::{ModuleSnapshot, SafetensorsStore};
use serde::{Deserialize, Serialize};

use crate::features::LogMelConfig;
use crate::model::{AsrModel, AsrModelConfig};

/// Everything needed to rebuild a trained model: stored as `model.json` next to the weights.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SavedModel {
    /// The model's configuration (its attention is the one it was trained with).
    pub model: AsrModelConfig,
    /// The front end's configuration.
    pub features: LogMelConfig,
    /// The phone inventory, in output order (after the blank).
    pub phones: Vec<String>,
}

/// The key of `model.json` that names the weights file.
const WEIGHTS_KEY: &str = "weights";
/// The extension of the weights files.
const WEIGHTS_EXTENSION: &str = "safetensors";

/// The weights file of number `n`: `model-<n>.safetensors`.
fn weights_name(n: u64) -> String {
    format!("model-{n}.{WEIGHTS_EXTENSION}")
}

/// The number `n` of a file named `model-<n>.<extension>`, if `name` is one.
pub(crate) fn model_file_number(name: &str, extension: &str) -> Option<u64> {
    let digits = name
        .strip_prefix("model-")?
        .strip_suffix(extension)?
        .strip_suffix('.')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The number of a weights file's name (`model-<n>.safetensors`), if it is one.
fn weights_number(name: &str) -> Option<u64> {
    model_file_number(name, WEIGHTS_EXTENSION)
}

/// Saves weights and configuration in `dir` so that it always holds one whole model, the one
/// it held before or the new one, even when the process is killed while saving: the weights
/// go to a file of a new number (`dir/model-N.safetensors`, N one more than any there, the
/// tensors named by their module paths, e.g. `layers.0.ff_in.weight`), then
/// `dir/model.json`, which names that file, replaces the old one in one rename; the weights
/// files it no longer names are removed last. Each file is written through a temporary file
/// renamed into place ([`write_atomic`]). One process at a time saves into a directory.
///
/// # Errors
/// When `dir` cannot be listed or written.
pub fn save_model(model: &AsrModel, saved: &SavedModel, dir: &Path) -> anyhow::Result<()> {
    let listing = || -> std::io::Result<Vec<String>> {
        std::fs::read_dir(dir)?
            .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
            .collect()
    };
    let names = listing().with_context(|| format!("{}: cannot list", dir.display()))?;
    let number = names
        .iter()
        .filter_map(|n| weights_number(n))
        .max()
        .unwrap_or(0);
    let number = number
        .checked_add(1)
        .with_context(|| format!("{}: no weights number after {number}", dir.display()))?;
    let weights = weights_name(number);
    let mut store = SafetensorsStore::from_bytes(None);
    model
        .save_into(&mut store)
        .and_then(|()| store.get_bytes())
        .with_context(|| format!("{}: cannot encode the model's weights", dir.display()))
        .and_then(|bytes| {
            write_atomic(&dir.join(&weights), &bytes).context("cannot save the model's weights")
        })?;
    let mut json = serde_json::to_value(saved)?;
    json.as_object_mut()
        .expect("a SavedModel is a JSON object")
        .insert(WEIGHTS_KEY.into(), weights.clone().into());
    write_atomic(
        &dir.join("model.json"),
        serde_json::to_string_pretty(&json)?.as_bytes(),
    )
    .context("cannot save model.json")?;
    // `model.json` names the new weights from here on: the others are garbage, as are the
    // temporary files of a save that was killed.
    for name in listing().with_context(|| format!("{}: cannot list", dir.display()))? {
        if name != weights && weights_number(&name).is_some() {
            std::fs::remove_file(dir.join(&name))
                .with_context(|| format!("{}: cannot remove {name}", dir.display()))?;
        }
    }
    remove_partial_files(dir, "model")
        .with_context(|| format!("{}: cannot remove temporary files", dir.display()))?;
    Ok(())
}

/// Loads a model saved by [`save_model`] (weights and configuration) onto `device`.
///
/// Everything read is checked before it is used: `model.json`'s configuration
/// ([`AsrModelConfig::validate`]), the weights file's header against the file's bytes (the
/// safetensors format), its number of tensors against the layers `model.json` asks for
/// (before any layer is built), and then every tensor against the parameter of the model it
/// goes to, name and shape. So a directory whose files do not belong together is an error,
/// not a model with some of its weights left at random.
///
/// # Errors
/// When a file is missing or cannot be read; when `model.json` is not valid JSON, lacks a
/// setting, has an invalid one or names a weights file that is not `model-<N>.safetensors`
/// in the directory itself (a directory saved by an older version, with `model.mpk`, is
/// refused as such); when the weights file is not a safetensors file; or when its tensors
/// do not fit the model: the error names the tensors missing, the tensors unused and the
/// tensors of the wrong shape or type.
pub fn load_model(dir: &Path, device: &Device) -> anyhow::Result<(AsrModel, SavedModel)> {
    let json = std::fs::read_to_string(dir.join("model.json"))
        .with_context(|| format!("{}: no model.json (train a model first)", dir.display()))?;
    let (saved, weights) = parse_saved_model(&json)
        .with_context(|| format!("{}: malformed model.json", dir.display()))?;
    let weights = weights.with_context(|| {
        format!(
            "{}: model.json names no weights file (\"{WEIGHTS_KEY}\"): saved by an older \
             version, whose model.mpk this version does not read; train the model again",
            dir.display()
        )
    })?;
    anyhow::ensure!(
        weights_number(&weights).is_some(),
        "{}: model.json names the weights file {weights:?}, expected model-<N>.{WEIGHTS_EXTENSION}",
        dir.display()
    );
    saved
        .model
        .validate()
        .map_err(|message| anyhow::anyhow!("{}: model.json: {message}", dir.display()))?;
    let path = dir.join(&weights);
    let bytes = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let tensors = safetensors::SafeTensors::deserialize(&bytes)
        .with_context(|| format!("{}: not a safetensors file", path.display()))?
        .len();
    // Each layer has tensors of its own: no more layers are built than the file could fill.
    anyhow::ensure!(
        saved.model.n_layers <= tensors,
        "{}: model.json asks for {} layers, more than the {tensors} tensors of {weights}",
        dir.display(),
        saved.model.n_layers
    );
    let mut model = saved.model.init(device);
    let mut store = SafetensorsStore::from_bytes(Some(bytes))
        .validate(false)
        .allow_partial(true);
    let result = model
        .load_from(&mut store)
        .with_context(|| format!("{}: cannot read the weights", path.display()))?;
    let mut problems = Vec::new();
    if !result.missing.is_empty() {
        let names: Vec<&str> = result
            .missing
            .iter()
            .map(|(name, _)| name.as_str())
            .collect();
        problems.push(format!("missing tensors {}", names.join(", ")));
    }
    if !result.unused.is_empty() {
        problems.push(format!("unused tensors {}", result.unused.join(", ")));
    }
    for error in &result.errors {
        problems.push(error.to_string());
    }
    anyhow::ensure!(
        problems.is_empty(),
        "{} does not fit the model of model.json: {}",
        path.display(),
        problems.join("; ")
    );
    Ok((model, saved))
}

/// The extension of burn-train's checkpoint files (burnpack).
pub(crate) const CHECKPOINT_EXTENSION: &str = "bpk";

/// burn-train's file checkpointer (`FileCheckpointer`: `<dir>/<name>-<epoch>.bpk`, burnpack),
/// with each file written whole or not at all ([`write_atomic`]): a checkpoint that
/// burn-train was writing when the process was killed is absent, not truncated. Files it
/// writes load with `FileCheckpointer` and the other way round.
#[derive(Debug, Clone)]
pub struct AtomicFileCheckpointer {
    dir: PathBuf,
    name: String,
}

impl AtomicFileCheckpointer {
    /// The checkpointer of the records named `name` (`model`, `optim`, `scheduler`) in `dir`,
    /// which it creates if needed.
    pub fn new(dir: &Path, name: &str) -> Self {
        // As burn-train's `FileCheckpointer`: a directory that cannot be made shows as an
        // error of the first save.
        std::fs::create_dir_all(dir).ok();
        Self {
            dir: dir.to_path_buf(),
            name: name.to_string(),
        }
    }

    fn path(&self, epoch: usize) -> PathBuf {
        self.dir
            .join(format!("{}-{epoch}.{CHECKPOINT_EXTENSION}", self.name))
    }
}

impl<R: Checkpoint> Checkpointer<R> for AtomicFileCheckpointer {
    fn save(&self, epoch: usize, record: R) -> Result<(), CheckpointerError> {
        let bytes = record
            .checkpoint_into_bytes()
            .map_err(CheckpointerError::Record)?;
        write_atomic(&self.path(epoch), &bytes).map_err(CheckpointerError::IOError)
    }

    fn delete(&self, epoch: usize) -> Result<(), CheckpointerError> {
        let path = self.path(epoch);
        if path.exists() {
            std::fs::remove_file(path).map_err(CheckpointerError::IOError)?;
        }
        Ok(())
    }

    fn restore(&self, epoch: usize) -> Result<R, CheckpointerError> {
        R::load(self.path(epoch))
    }
}

/// Reads a `model.json`: the configuration and the weights file it names, if it names one.
/// Models saved before the model had its `front_end`, `conv_kernel`, `activation` and
/// `inter_ctc_weight` options stacked frames, had no convolution module, used GELU and had
/// no intermediate loss: those options are filled in as such.
fn parse_saved_model(json: &str) -> anyhow::Result<(SavedModel, Option<String>)> {
    let mut value: serde_json::Value = serde_json::from_str(json)?;
    let weights = match value.as_object_mut().and_then(|v| v.remove(WEIGHTS_KEY)) {
        None => None,
        Some(serde_json::Value::String(name)) => Some(name),
        Some(other) => anyhow::bail!("\"{WEIGHTS_KEY}\" is {other}, expected a file name"),
    };
    if let Some(model) = value.get_mut("model").and_then(|m| m.as_object_mut()) {
        let defaults = AsrModelConfig::new(2);
        for (key, default) in [
            ("front_end", serde_json::to_value(defaults.front_end)?),
            ("conv_kernel", defaults.conv_kernel.into()),
            ("activation", serde_json::to_value(defaults.activation)?),
            ("inter_ctc_weight", defaults.inter_ctc_weight.into()),
        ] {
            model.entry(key).or_insert(default);
        }
    }
    Ok((serde_json::from_value(value)?, weights))
}

#[cfg(test)]
mod tests {
    use super::{SavedModel, parse_saved_model};
    use crate::features::LogMelConfig;
    use crate::model::{Activation, AsrModelConfig, FrontEnd};

    /// A `model.json` without `front_end`, `conv_kernel`, `activation` and
    /// `inter_ctc_weight` reads as frame stacking with GELU, without a convolution module or
    /// an intermediate loss; one with them keeps them.
    #[test]
    fn model_json_without_front_end_options_reads_as_stacking() {
        let saved = SavedModel {
            model: AsrModelConfig::new(9)
                .with_front_end(FrontEnd::Conv { channels: 8 })
                .with_conv_kernel(5)
                .with_activation(Activation::Relu)
                .with_inter_ctc_weight(0.25),
            features: LogMelConfig::new(),
            phones: vec!["a".into()],
        };
        let json = serde_json::to_string(&saved).unwrap();
        let (read, weights) = parse_saved_model(&json).unwrap();
        assert_eq!(weights, None);
        assert_eq!(read.model.front_end, FrontEnd::Conv { channels: 8 });
        assert_eq!(read.model.conv_kernel, 5);
        assert_eq!(read.model.activation, Activation::Relu);
        assert_eq!(read.model.inter_ctc_weight, 0.25);
        let mut value: serde_json::Value = serde_json::from_str(&json).unwrap();
        let model = value["model"].as_object_mut().unwrap();
        model.remove("front_end").unwrap();
        model.remove("conv_kernel").unwrap();
        model.remove("activation").unwrap();
        model.remove("inter_ctc_weight").unwrap();
        let (read, _) = parse_saved_model(&value.to_string()).unwrap();
        assert_eq!(read.model.front_end, FrontEnd::Stack);
        assert_eq!(read.model.conv_kernel, 0);
        assert_eq!(read.model.activation, Activation::Gelu);
        assert_eq!(read.model.inter_ctc_weight, 0.0);
        assert_eq!(read.model.n_outputs, 9);
    }
}
