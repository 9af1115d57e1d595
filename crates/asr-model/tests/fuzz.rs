//! Fuzzing of the model directory's readers: `model.json` and the weights file
//! (`model-N.safetensors`), each mutated at random ([`fuzz_harness`]) in a directory saved by
//! `save_model` and read with `load_model`. A target passes when every input loads or gives
//! an error within the deadline, without a panic and without an allocation over
//! [`fuzz_harness::ALLOCATION_CAP`] (this binary's global allocator refuses one, which aborts
//! the process).
//!
//! `FUZZ_CASES` sets the inputs per target (default 300, as CI runs them) and `FUZZ_SEED`
//! the generator's seed (default 0); `scripts/fuzz.sh` runs the long campaign.

use std::path::{Path, PathBuf};

use asr_model::features::LogMelConfig;
use asr_model::model::FrontEnd;
use asr_model::phones::PhoneInventory;
use asr_model::train::{SavedModel, load_model, save_model};
use burn::tensor::Device;
use clustered_attention::AttentionKind;
use fuzz_harness::CappedAllocator;

mod common;
use common::{tempdir, toy_config, weights_file};

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// NdArray's device (deprecated in Burn 0.22, still the tests' reference).
#[allow(deprecated)]
fn cpu() -> Device {
    Device::ndarray()
}

/// Two saved models, in directories of target `name`'s own: one layer of full attention on
/// stacked frames, and two layers of improved clustered attention on the convolutional front
/// end with a convolution module.
fn saved_models(name: &str) -> Vec<PathBuf> {
    let phones = PhoneInventory::standard().phones()[..8].to_vec();
    let models = [
        toy_config(AttentionKind::Full),
        toy_config(AttentionKind::Improved {
            clusters: 3,
            topk: 2,
        })
        .with_n_layers(2)
        .with_front_end(FrontEnd::Conv { channels: 8 })
        .with_conv_kernel(3),
    ];
    models
        .into_iter()
        .enumerate()
        .map(|(i, model)| {
            let saved = SavedModel {
                model,
                features: LogMelConfig::new().with_n_mels(16),
                phones: phones.clone(),
            };
            let dir = tempdir(&format!("fuzz-{name}-seed-{i}"));
            let model = saved.model.init(&cpu());
            save_model(&model, &saved, &dir).unwrap();
            dir
        })
        .collect()
}

/// Runs target `name`: the seeds are the files `file(dir)` of the saved model directories;
/// each input replaces that file in a copy of each directory in turn, which `load_model`
/// then reads.
fn fuzz_file(name: &'static str, file: fn(&Path) -> PathBuf) {
    let dirs = saved_models(name);
    let seeds = dirs
        .iter()
        .map(|dir| std::fs::read(file(dir)).unwrap())
        .collect();
    fuzz_harness::fuzz(
        name,
        Path::new(env!("CARGO_TARGET_TMPDIR")),
        seeds,
        move |bytes| {
            for seed_dir in &dirs {
                let dir = tempdir(&format!("fuzz-{name}-{:?}", std::thread::current().id()));
                for entry in std::fs::read_dir(seed_dir).unwrap() {
                    let path = entry.unwrap().path();
                    std::fs::copy(&path, dir.join(path.file_name().unwrap())).unwrap();
                }
                std::fs::write(file(&dir), bytes).unwrap();
                let _ = load_model(&dir, &cpu());
                let _ = std::fs::remove_dir_all(&dir);
            }
        },
    );
}

/// Mutations of `model.json` (the configuration, the phones and the weights file's name).
#[test]
fn fuzz_model_json() {
    fuzz_file("model.json", |dir| dir.join("model.json"));
}

/// Mutations of the weights file (its header, then the tensors' bytes).
#[test]
fn fuzz_model_weights() {
    fuzz_file("weights", weights_file);
}
