//! Helpers shared by the test files: toy utterances, a toy model, and the comparison of a
//! data-parallel run with a one-device run.
#![allow(dead_code)]

use std::sync::Arc;

use asr_model::augment::AugmentSet;
use asr_model::data::Example;
use asr_model::features::{Features, LogMelConfig};
use asr_model::model::AsrModelConfig;
use asr_model::phones::PhoneInventory;
use asr_model::train::{SavedModel, Strategy, TrainOptions, train, train_on_devices};
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use clustered_attention::AttentionKind;

pub fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("asr-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A toy utterance: `frames` frames of noise with a distinct pattern per label segment.
pub fn toy_example(id: usize, targets: Vec<usize>, frames: usize, n_mels: usize) -> Example {
    let mut data = vec![0f32; frames * n_mels];
    let per = frames / targets.len();
    for t in 0..frames {
        let label = targets[(t / per).min(targets.len() - 1)];
        for m in 0..n_mels {
            let noise = (((t * 31 + m * 17 + id * 7) % 13) as f32 - 6.0) * 0.02;
            data[t * n_mels + m] = if m % 8 == label % 8 { 1.5 } else { -0.2 } + noise;
        }
    }
    Example {
        id: format!("toy-{id}"),
        features: Arc::new(Features {
            frames,
            n_mels,
            data,
        }),
        targets,
        audio: None,
    }
}

pub fn toy_config(attention: AttentionKind) -> AsrModelConfig {
    AsrModelConfig::new(9)
        .with_n_mels(16)
        .with_d_model(32)
        .with_n_heads(2)
        .with_n_layers(1)
        .with_d_ff(64)
        .with_dropout(0.0)
        .with_subsampling(2)
        .with_attention(attention)
}

/// `n` toy utterances of 24 frames and a model of `attention` to train on them.
pub fn toy_run(n: usize, attention: AttentionKind) -> (Vec<Example>, SavedModel) {
    let examples = (0..n)
        .map(|i| toy_example(i, vec![1 + i % 8, 2, 3], 24, 16))
        .collect();
    let saved = SavedModel {
        model: toy_config(attention),
        features: LogMelConfig::new().with_n_mels(16),
        phones: PhoneInventory::standard().phones()[..8].to_vec(),
    };
    (examples, saved)
}

/// Training options for the toy runs, written to `dir`: one epoch of batches of 48 padded
/// frames in a fixed order, learning rate 3e-3 after one warm-up step, seed 0, no
/// augmentation, no application log.
pub fn toy_options(dir: std::path::PathBuf) -> TrainOptions {
    TrainOptions {
        dir,
        epochs: 1,
        learning_rate: 3e-3,
        warmup_steps: 1,
        final_learning_rate: None,
        grad_clip: 1.0,
        batch_frames: 48,
        seed: 0,
        shuffle: false,
        resume: false,
        stop_after_steps: None,
        time_budget_s: None,
        application_log: false,
        augment: AugmentSet::default(),
        strategy: Strategy::Multi,
    }
}

/// Every float parameter of a module, in visiting order.
struct Parameters(Vec<Vec<f32>>);

impl ModuleVisitor for Parameters {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0
            .push(param.val().into_data().try_into_vec_as::<f32>().unwrap());
    }
}

/// The weights file that `dir/model.json` names (`model-N.safetensors`).
pub fn weights_file(dir: &std::path::Path) -> std::path::PathBuf {
    let json = std::fs::read_to_string(dir.join("model.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    dir.join(
        json["weights"]
            .as_str()
            .expect("model.json names its weights"),
    )
}

/// Every float parameter of `model`, in visiting order, on the host.
pub fn parameters<M: Module>(model: &M) -> Vec<Vec<f32>> {
    let mut parameters = Parameters(Vec::new());
    model.visit(&mut parameters);
    parameters.0
}

/// The largest difference between two models' parameters ([`parameters`]), element by element.
pub fn largest_difference(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}

/// How far a data-parallel run ended from the one-device run it should equal.
pub struct Comparison {
    /// Largest difference of a weight between the two runs.
    pub worst: f32,
    /// Largest change of a weight by the one-device run's steps (that the steps did move them).
    pub moved: f32,
}

/// Trains 4 toy utterances of 24 frames with full attention for two steps data-parallel on
/// `devices` with `strategy`, one utterance per device and step, and on `devices[0]` alone
/// with batches of `devices.len()` utterances (no dropout, no augmentation, fixed order); each
/// weight is compared between the runs and with its initial value.
pub fn data_parallel_against_one_device(
    name: &str,
    devices: &[Device],
    strategy: Strategy,
) -> Comparison {
    let n = devices.len();
    let (examples, saved) = toy_run(2 * n, AttentionKind::Full);
    let options = |run: &str, batch_frames| TrainOptions {
        batch_frames,
        ..toy_options(tempdir(&format!("{name}-{run}")))
    };
    let mut parallel = options("parallel", 24);
    parallel.strategy = strategy;
    let parallel = train_on_devices(
        &saved,
        examples.clone(),
        examples.clone(),
        &parallel,
        devices,
    )
    .unwrap();
    let device = &devices[0];
    let one = train(
        &saved,
        examples.clone(),
        examples.clone(),
        &options("one-device", 24 * n),
        device,
    )
    .unwrap();
    // The initial weights, drawn as the runs above drew them: a run whose steps move nothing.
    let mut still = options("no-step", 24 * n);
    still.learning_rate = 1e-12;
    let init = train(&saved, examples.clone(), examples, &still, device).unwrap();
    let (a, b) = (parameters(&parallel), parameters(&one));
    assert_eq!(a.len(), b.len());
    Comparison {
        worst: largest_difference(&a, &b),
        moved: largest_difference(&b, &parameters(&init)),
    }
}
