//! A trained model on disk: its weights (`model.mpk`) and what rebuilds it (`model.json`).

use std::path::Path;

use anyhow::Context;
use burn::module::Module;
use burn::record::{DefaultRecorder, Recorder};
use burn::tensor::backend::Backend;
use clustered_attention::ClusteredAttentionBackend;
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

/// Saves weights (`dir/model.mpk`) and configuration (`dir/model.json`).
///
/// # Errors
/// When a file cannot be written.
pub fn save_model<B: Backend>(
    model: &AsrModel<B>,
    saved: &SavedModel,
    dir: &Path,
) -> anyhow::Result<()> {
    DefaultRecorder::new()
        .record(model.clone().into_record(), dir.join("model"))
        .with_context(|| format!("{}: cannot save the model", dir.display()))?;
    std::fs::write(dir.join("model.json"), serde_json::to_string_pretty(saved)?)?;
    Ok(())
}

/// Loads a model saved by [`save_model`] (weights and configuration) onto `device`.
///
/// # Errors
/// When a file is missing or does not match.
pub fn load_model<B: ClusteredAttentionBackend>(
    dir: &Path,
    device: &B::Device,
) -> anyhow::Result<(AsrModel<B>, SavedModel)> {
    let json = std::fs::read_to_string(dir.join("model.json"))
        .with_context(|| format!("{}: no model.json (train a model first)", dir.display()))?;
    let saved = parse_saved_model(&json)
        .with_context(|| format!("{}: malformed model.json", dir.display()))?;
    let record = DefaultRecorder::new()
        .load(dir.join("model"), device)
        .with_context(|| format!("{}: cannot load model.mpk", dir.display()))?;
    Ok((saved.model.init::<B>(device).load_record(record), saved))
}

/// Reads a `model.json`. Models saved before the model had its `front_end`, `conv_kernel`,
/// `activation` and `inter_ctc_weight` options stacked frames, had no convolution module, used
/// GELU and had no intermediate loss: those options are filled in as such.
fn parse_saved_model(json: &str) -> serde_json::Result<SavedModel> {
    let mut value: serde_json::Value = serde_json::from_str(json)?;
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
    serde_json::from_value(value)
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
        let read = parse_saved_model(&json).unwrap();
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
        let read = parse_saved_model(&value.to_string()).unwrap();
        assert_eq!(read.model.front_end, FrontEnd::Stack);
        assert_eq!(read.model.conv_kernel, 0);
        assert_eq!(read.model.activation, Activation::Gelu);
        assert_eq!(read.model.inter_ctc_weight, 0.0);
        assert_eq!(read.model.n_outputs, 9);
    }
}
