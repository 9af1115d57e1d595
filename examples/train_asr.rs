//! Training the ASR example from code: a small improved-clustered-attention model trained for
//! one short epoch on part of the bundled corpus, then evaluated and used to transcribe.
//!
//! Run with `cargo run --release -p asr-model --example train_asr` from the workspace root
//! (it reads `data/corpus`). The full recipe is `asr train` (`bash scripts/train.sh`).

use std::path::Path;

use asr_model::augment::AugmentSet;
use asr_model::data::featurize;
use asr_model::features::{LogMel, LogMelConfig};
use asr_model::manifest::read_manifest;
use asr_model::model::AsrModelConfig;
use asr_model::phones::PhoneInventory;
use asr_model::train::{SavedModel, Strategy, TrainOptions, evaluate, load_model, train};
use burn::tensor::Device;
use clustered_attention::AttentionKind;

fn main() -> anyhow::Result<()> {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus");
    let device = Device::flex();

    // The corpus's phone inventory and the first utterances of two of its splits; every
    // utterance of a split is read and checked, the audio decoded for these only.
    let inventory = PhoneInventory::load(&corpus.join("phones.txt")).map_err(anyhow::Error::msg)?;
    let features = LogMelConfig::new(); // 40 log-mel bands of 25 ms windows every 10 ms
    let log_mel = LogMel::new(features.clone());
    let split = |name: &str, n: usize| -> anyhow::Result<_> {
        let utterances = read_manifest(&corpus.join(format!("{name}.jsonl")), &inventory, false)?;
        Ok(featurize(&utterances[..n], &log_mel, false))
    };
    let (train_split, dev) = (split("train", 24)?, split("dev", 8)?);

    // A small encoder: 2 layers of width 64, improved clustered attention with 8 clusters and
    // the 8 keys each cluster attends to most recomputed exactly per query.
    let saved = SavedModel {
        model: AsrModelConfig::new(inventory.n_outputs())
            .with_d_model(64)
            .with_n_heads(4)
            .with_n_layers(2)
            .with_d_ff(128)
            .with_attention(AttentionKind::Improved {
                clusters: 8,
                topk: 8,
            }),
        features,
        phones: inventory.phones().to_vec(),
    };
    let dir = std::env::temp_dir().join("clustered-attention-train-asr-example");
    let options = TrainOptions {
        dir: dir.clone(),
        epochs: 1,
        learning_rate: 2e-3,
        warmup_steps: 4,
        final_learning_rate: None,
        grad_clip: 1.0,
        batch_frames: 3000,
        seed: 0,
        shuffle: true,
        resume: false,
        stop_after_steps: None,
        time_budget_s: None,
        application_log: false,
        augment: AugmentSet::default(),
        strategy: Strategy::Multi,
    };
    let model = train(&saved, train_split, dev.clone(), &options, &device)?;
    let per = evaluate(&model, &dev, None, options.batch_frames, &device);
    println!(
        "after one short epoch: dev phone error rate {:.1} % ({} errors / {} phones)",
        per.percent(),
        per.errors,
        per.reference_phones
    );

    // The saved model, loaded back as `asr eval` and `asr transcribe` load it, gives the same
    // phone error rate; evaluated with full attention instead, another.
    let (loaded, _) = load_model(&dir, &device)?;
    let again = evaluate(&loaded, &dev, None, options.batch_frames, &device);
    assert_eq!(again, per, "the saved model differs from the trained one");
    let full = evaluate(
        &loaded,
        &dev,
        Some(AttentionKind::Full),
        options.batch_frames,
        &device,
    );
    println!(
        "the same weights with full attention: {:.1} %",
        full.percent()
    );
    Ok(())
}

/// `cargo test` runs the example.
#[cfg(test)]
#[test]
fn example_runs() {
    main().unwrap();
}
