//! Tests of the ASR example: front end against librosa, decoding, PER, manifests, over-fitting
//! one batch, and resuming an interrupted training run.

use std::path::Path;
use std::sync::Arc;

use asr_model::audio::{load_audio, write_flac};
use asr_model::data::{CtcBatcher, Example};
use asr_model::decode::{PhoneErrorRate, edit_distance, greedy_ctc_decode};
use asr_model::features::{Features, LogMel, LogMelConfig};
use asr_model::manifest::{ManifestEntry, read_manifest, write_manifest};
use asr_model::model::AsrModelConfig;
use asr_model::phones::PhoneInventory;
use asr_model::train::{SavedModel, TrainOptions, last_checkpoint, train};
use burn::backend::{Autodiff, NdArray};
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::Backend;
use clustered_attention::AttentionKind;

type Cpu = NdArray<f32>;
type Train = Autodiff<Cpu>;

/// The test signal of `tests/fixtures/librosa_mel.py`: two tones and a chirp.
fn test_signal() -> Vec<f32> {
    (0..4000)
        .map(|n| {
            let t = n as f64 / 16000.0;
            let pi2 = 2.0 * std::f64::consts::PI;
            (0.5 * (pi2 * 440.0 * t).sin()
                + 0.3 * (pi2 * 3150.0 * t + 0.1).sin()
                + 0.1 * (pi2 * (100.0 * t + 0.5 * (6900.0 / 0.25) * t * t)).sin())
                as f32
        })
        .collect()
}

fn librosa_reference() -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/librosa_mel.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The Slaney filterbank equals librosa 0.11's `filters.mel(sr=16000, n_fft=400, n_mels=40)`
/// to 1e-6 absolute (weights are ≤ 0.03).
#[test]
fn mel_filterbank_matches_librosa() {
    let reference = librosa_reference();
    let log_mel = LogMel::new(LogMelConfig::new());
    let ours = log_mel.filterbank();
    let rows = reference["filterbank"].as_array().unwrap();
    assert_eq!(rows.len(), 40);
    for (m, row) in rows.iter().enumerate() {
        for (k, value) in row.as_array().unwrap().iter().enumerate() {
            let expected = value.as_f64().unwrap();
            let got = ours[m * 201 + k] as f64;
            assert!(
                (got - expected).abs() <= 1e-6,
                "filter {m}, bin {k}: {got} vs {expected}"
            );
        }
    }
}

/// The mel power spectrogram equals librosa's `melspectrogram(center=False, window="hann",
/// power=2)` of the same signal to 1e-4 relative (plus 1e-6 absolute).
#[test]
fn mel_power_matches_librosa() {
    let reference = librosa_reference();
    let log_mel = LogMel::new(LogMelConfig::new());
    let ours = log_mel.mel_power(&test_signal());
    let frames = reference["mel_power"].as_array().unwrap();
    assert_eq!(
        ours.len(),
        frames.len() * 40,
        "frame count differs from librosa"
    );
    for (t, frame) in frames.iter().enumerate() {
        for (m, value) in frame.as_array().unwrap().iter().enumerate() {
            let expected = value.as_f64().unwrap();
            let got = ours[t * 40 + m] as f64;
            assert!(
                (got - expected).abs() <= 1e-4 * expected.abs() + 1e-6,
                "frame {t}, band {m}: {got} vs {expected}"
            );
        }
    }
    // The normalised log-mel features equal librosa's mel power through the documented
    // steps: ln(max(x, 1e-10)), then (x − mean) / sqrt(var + 1e-5) per band.
    let features = log_mel.features(&test_signal());
    let frames_n = frames.len();
    for m in 0..40 {
        let logs: Vec<f64> = frames
            .iter()
            .map(|f| f.as_array().unwrap()[m].as_f64().unwrap().max(1e-10).ln())
            .collect();
        let log_tolerance = logs
            .iter()
            .map(|x| 1e-4 + 1e-6 / x.exp())
            .fold(0.0, f64::max);
        let mean = logs.iter().sum::<f64>() / frames_n as f64;
        let var = logs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / frames_n as f64;
        for (t, x) in logs.iter().enumerate() {
            let expected = (x - mean) / (var + 1e-5).sqrt();
            let got = features.data[t * 40 + m] as f64;
            // The mel powers p agree to 1e-4·p + 1e-6, i.e. their logs to 1e-4 + 1e-6 / p;
            // the mean shifts by at most as much, and normalisation divides by
            // sqrt(var + 1e-5).
            let tolerance = 2.0 * log_tolerance / (var + 1e-5).sqrt() + 1e-5;
            assert!(
                (got - expected).abs() <= tolerance,
                "frame {t}, band {m}: {got} vs {expected} (tolerance {tolerance})"
            );
        }
    }
}

#[test]
fn greedy_decoding_collapses_repeats_and_drops_blanks() {
    assert_eq!(
        greedy_ctc_decode(&[0, 3, 3, 0, 3, 5, 5, 0, 0, 2]),
        vec![3, 3, 5, 2]
    );
    assert_eq!(greedy_ctc_decode(&[0, 0, 0]), Vec::<usize>::new());
    assert_eq!(greedy_ctc_decode(&[]), Vec::<usize>::new());
    assert_eq!(greedy_ctc_decode(&[7, 7, 7]), vec![7]);
}

#[test]
fn edit_distance_and_phone_error_rate() {
    // Classic cases, counted by hand.
    assert_eq!(edit_distance(&[1, 2, 3], &[1, 2, 3]), 0);
    assert_eq!(edit_distance(&[], &[1, 2, 3]), 3);
    assert_eq!(edit_distance(&[1, 3], &[1, 2, 3]), 1); // one deletion
    assert_eq!(edit_distance(&[1, 4, 3], &[1, 2, 3]), 1); // one substitution
    assert_eq!(edit_distance(&[2, 1, 2, 3, 9], &[1, 2, 3]), 2); // two insertions
    let mut per = PhoneErrorRate::default();
    per.add(&[1, 3], &[1, 2, 3]); // 1 error / 3
    per.add(&[5, 6, 7, 8], &[5]); // 3 errors / 1
    assert_eq!((per.errors, per.reference_phones), (4, 4));
    assert!((per.percent() - 100.0).abs() < 1e-12);
}

fn entry(id: &str, audio: &str, text: &str, phones: &str) -> ManifestEntry {
    ManifestEntry {
        id: id.into(),
        audio: audio.into(),
        duration_s: 0.5,
        text: text.into(),
        phones: phones.into(),
        voice: "test".into(),
    }
}

#[test]
fn manifest_reads_and_reports_every_problem_with_its_line() {
    let dir = tempdir("manifest");
    let tone: Vec<f32> = (0..8000).map(|n| (n as f32 * 0.05).sin() * 0.3).collect();
    write_flac(&dir.join("ok.flac"), &tone, 16000, 16).unwrap();
    write_flac(&dir.join("empty.flac"), &[], 16000, 16).unwrap();
    std::fs::write(dir.join("corrupt.flac"), b"fLaC but not really").unwrap();
    let inventory = PhoneInventory::standard();
    let good = dir.join("good.jsonl");
    write_manifest(&good, &[entry("a", "ok.flac", "be he", "b iː h iː")]).unwrap();
    let read = read_manifest(&good, &inventory, true).unwrap();
    assert_eq!(read.len(), 1);
    let b = inventory.output_of("b").unwrap();
    let ee = inventory.output_of("iː").unwrap();
    let h = inventory.output_of("h").unwrap();
    assert_eq!(read[0].targets, vec![b, ee, h, ee]);
    // FLAC written and read back: the same samples to 16-bit precision.
    let back = load_audio(&dir.join("ok.flac")).unwrap();
    assert_eq!(back.len(), tone.len());
    assert!(
        back.iter()
            .zip(&tone)
            .all(|(x, y)| (x - y).abs() < 1.0 / 16000.0)
    );

    let bad = dir.join("bad.jsonl");
    write_manifest(
        &bad,
        &[
            entry("ok", "ok.flac", "be", "b iː"),
            entry("missing", "nowhere.flac", "be", "b iː"),
            entry("corrupt", "corrupt.flac", "be", "b iː"),
            entry("empty", "empty.flac", "be", "b iː"),
            entry("notext", "ok.flac", "  ", "b iː"),
            entry("alien", "ok.flac", "click", "k ǃ"),
        ],
    )
    .unwrap();
    let mut text = std::fs::read_to_string(&bad).unwrap();
    text.push_str("{not json\n");
    std::fs::write(&bad, text).unwrap();
    let error = read_manifest(&bad, &inventory, true).unwrap_err();
    let message = error.to_string();
    assert_eq!(error.problems.len(), 6, "{message}");
    for (line, needle) in [
        (2, "nowhere.flac"),
        (3, "corrupt"),
        (4, "empty"),
        (5, "empty transcript"),
        (6, "\"ǃ\" is not in the inventory"),
        (7, "malformed"),
    ] {
        let at = format!("bad.jsonl:{line}:");
        assert!(
            error
                .problems
                .iter()
                .any(|p| p.contains(&at) && p.contains(needle)),
            "no problem `{needle}` at line {line} in:\n{message}"
        );
    }
}

fn tempdir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("asr-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A toy utterance: `frames` frames of noise with a distinct pattern per label segment.
fn toy_example(id: usize, targets: Vec<usize>, frames: usize, n_mels: usize) -> Example {
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
    }
}

fn toy_config(attention: AttentionKind) -> AsrModelConfig {
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

/// One batch, trained alone, reaches a CTC loss near zero and is transcribed exactly.
#[test]
fn one_batch_overfits_to_near_zero_loss() {
    let device = Default::default();
    Train::seed(&device, 1);
    let examples = vec![
        toy_example(0, vec![1, 2, 3, 4], 32, 16),
        toy_example(1, vec![5, 6, 5, 7, 8], 40, 16),
    ];
    let mut model = toy_config(AttentionKind::Improved {
        clusters: 4,
        topk: 4,
    })
    .init::<Train>(&device);
    let mut optim = AdamConfig::new().init();
    let batch = CtcBatcher.make::<Train>(&examples, &device);
    let mut loss_value = f32::INFINITY;
    for _ in 0..300 {
        let log_probs = model.forward(batch.features.clone(), &batch.frame_lengths);
        let loss = model
            .ctc_loss(
                log_probs,
                &batch.frame_lengths,
                batch.targets.clone(),
                &batch.target_lengths,
            )
            .mean();
        loss_value = loss.clone().into_scalar();
        if loss_value < 0.05 {
            break;
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(3e-3, model, grads);
    }
    assert!(loss_value < 0.05, "CTC loss after training: {loss_value}");
    let model = model.valid();
    let batch = CtcBatcher.make::<Cpu>(&examples, &device);
    let decoded = model.decode(
        model.forward(batch.features, &batch.frame_lengths),
        &batch.frame_lengths,
    );
    assert_eq!(decoded, batch.references);
}

/// A run interrupted in its second epoch and restarted with `resume` continues from the
/// first epoch's checkpoint (weights, Adam state and learning-rate schedule): it ends with the
/// same weights as an uninterrupted two-epoch run (batch order fixed, no dropout), to 1e-5.
#[test]
fn interrupted_training_resumes_from_its_last_checkpoint() {
    let examples: Vec<Example> = (0..6)
        .map(|i| toy_example(i, vec![1 + i % 8, 2, 3], 24, 16))
        .collect();
    let saved = SavedModel {
        model: toy_config(AttentionKind::Clustered { clusters: 4 }),
        features: LogMelConfig::new().with_n_mels(16),
        phones: PhoneInventory::standard().phones()[..8].to_vec(),
    };
    let options = |dir: &Path, epochs, resume, stop_after_steps| TrainOptions {
        dir: dir.to_path_buf(),
        epochs,
        learning_rate: 1e-3,
        warmup_steps: 2,
        grad_clip: 1.0,
        batch_frames: 48,
        seed: 0,
        shuffle: false,
        resume,
        stop_after_steps,
        application_log: false,
    };
    let device = Default::default();
    let run = |o: TrainOptions| {
        train::<Train>(&saved, examples.clone(), examples.clone(), &o, &device).unwrap()
    };

    // Reference: two epochs without interruption.
    let reference_dir = tempdir("resume-reference");
    let reference = run(options(&reference_dir, 2, false, None));

    // One epoch; then a two-epoch run interrupted after 1 of epoch 2's 3 steps; then resume.
    let dir = tempdir("resume");
    run(options(&dir, 1, false, None));
    assert_eq!(last_checkpoint(&dir), Some(1));
    run(options(&dir, 2, true, Some(1)));
    assert_eq!(
        last_checkpoint(&dir),
        Some(1),
        "an interrupted epoch leaves no checkpoint"
    );
    let resumed = run(options(&dir, 2, true, None));
    assert_eq!(last_checkpoint(&dir), Some(2));
    assert!(dir.join("model.mpk").exists() && dir.join("model.json").exists());

    let batch = CtcBatcher.make::<Cpu>(&examples, &device);
    let a = reference.forward(batch.features.clone(), &batch.frame_lengths);
    let b = resumed.forward(batch.features, &batch.frame_lengths);
    let diff = (a - b).abs().max().into_scalar();
    assert!(
        diff <= 1e-5,
        "resumed weights differ from the uninterrupted run: max |Δ log p| = {diff}"
    );
}
