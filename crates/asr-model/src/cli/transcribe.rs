//! `asr transcribe`: the phones recognized in one audio file.

use std::path::PathBuf;

use anyhow::{Context, bail};
use asr_model::audio::load_audio;
use asr_model::data::{CtcBatcher, Example};
use asr_model::features::LogMel;
use asr_model::phones::PhoneInventory;
use asr_model::train::load_model;
use backend_select::BackendName;
use burn::tensor::Device;
use clap::Args;

/// Arguments of `asr transcribe`.
#[derive(Args, Debug)]
pub struct TranscribeArgs {
    /// Trained model directory.
    #[arg(long)]
    model: PathBuf,
    /// Audio file.
    file: PathBuf,
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    pub backend: BackendName,
}

/// Prints the recognized phones, space separated.
pub fn run(args: &TranscribeArgs, _: BackendName, device: Device) -> anyhow::Result<()> {
    let (model, saved) = load_model(&args.model, &device)?;
    let log_mel = LogMel::new(saved.features.clone());
    let samples = load_audio(&args.file)?;
    if samples.is_empty() {
        bail!("{}: the audio is empty", args.file.display());
    }
    let example = Example {
        id: args.file.display().to_string(),
        features: std::sync::Arc::new(log_mel.features(&samples)),
        targets: Vec::new(),
        audio: None,
    };
    let batch = CtcBatcher.make(std::slice::from_ref(&example), &device);
    let log_probs = model.forward(batch.features, &batch.frame_lengths);
    let inventory = PhoneInventory::new(saved.phones.clone()).map_err(anyhow::Error::msg)?;
    let outputs = model.decode(log_probs, &batch.frame_lengths).remove(0);
    let phones: Vec<&str> = outputs
        .iter()
        .map(|&o| {
            inventory
                .phone_of(o)
                .context("output outside the inventory")
        })
        .collect::<anyhow::Result<_>>()?;
    println!("{}", phones.join(" "));
    Ok(())
}
