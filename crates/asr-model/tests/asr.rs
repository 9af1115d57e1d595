//! Tests of the ASR example: front end against librosa, decoding, PER, manifests, over-fitting
//! one batch, resuming an interrupted training run, augmentation, and `asr manifest` on the
//! LibriSpeech, Kaldi and TSV layouts (fixtures synthesized with espeak-ng).

use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use asr_model::audio::{load_audio, write_flac};
use asr_model::augment::{self, AugmentSet, Augmentation};
use asr_model::compare::{
    ModelSummary, Table1Column, Table1Setting, common_dev_per, markdown_table, plot,
    table1_markdown,
};
use asr_model::corpus::phonemize;
use asr_model::corpus::{CorpusOptions, generate, phrases};
use asr_model::data::{AugmentingBatcher, CtcBatcher, Example, ctc_feasible, load_split};
use asr_model::decode::{PhoneErrorRate, edit_distance, greedy_ctc_decode};
use asr_model::features::{Features, LogMel, LogMelConfig};
use asr_model::json::{load_json, save_json};
use asr_model::manifest::import::{ImportOptions, Source, import, normalize_text};
use asr_model::manifest::{ManifestEntry, read_manifest, write_manifest};
use asr_model::model::{AsrModelConfig, FrontEnd};
use asr_model::phones::PhoneInventory;
use asr_model::train::{
    EpochLog, SavedModel, Strategy, TRAINING_LOG, TrainOptions, TrainingLog, evaluate,
    last_checkpoint, load_model, save_model, train, train_on_devices,
};
use burn::module::Module;
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use clustered_attention::AttentionKind;

mod common;
use common::{
    data_parallel_against_one_device, largest_difference, parameters, tempdir, toy_config,
    toy_example, toy_options, toy_run,
};

/// NdArray's device, where the tests run (deprecated in Burn 0.22, still the tests' reference).
#[allow(deprecated)]
fn cpu() -> Device {
    Device::ndarray()
}

/// NdArray's device with autodiff, where the tests train.
fn train_device() -> Device {
    cpu().autodiff()
}

/// NdArray has one random generator per process, and Burn draws a parameter's initial values
/// when the parameter is first used. A test that seeds that generator, draws from it or
/// initialises a model takes this lock first and holds it to its end, so that no test running
/// beside it draws in between: each such test then sees only its own seed's draws.
static PROCESS_RNG: Mutex<()> = Mutex::new(());

/// Takes [`PROCESS_RNG`] (also after a test that held it failed).
fn process_rng() -> MutexGuard<'static, ()> {
    PROCESS_RNG.lock().unwrap_or_else(PoisonError::into_inner)
}

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

/// A model saved by `save_model` and loaded back by `load_model` has the same configuration and
/// phones and gives the same log-probabilities, bit for bit, as the model that was saved.
#[test]
fn saved_model_loads_back_identical() {
    let _rng = process_rng();
    let device = cpu();
    device.seed(2);
    let saved = SavedModel {
        model: toy_config(AttentionKind::Improved {
            clusters: 4,
            topk: 4,
        }),
        features: LogMelConfig::new().with_n_mels(16),
        phones: PhoneInventory::standard().phones()[..8].to_vec(),
    };
    let model = saved.model.init(&device);
    let features = Tensor::<3>::random([2, 24, 16], Distribution::Normal(0., 1.), &device);
    let lengths = [24, 17];
    // Before saving, as after training: Burn draws a parameter's initial values when it is
    // first used, and a clone taken before that draws its own.
    let expected = model.forward(features.clone(), &lengths).into_data();
    let dir = tempdir("save-load");
    save_model(&model, &saved, &dir).unwrap();
    let (loaded, loaded_saved) = load_model(&dir, &device).unwrap();
    assert_eq!(loaded_saved.phones, saved.phones);
    assert_eq!(
        serde_json::to_string(&loaded_saved.model).unwrap(),
        serde_json::to_string(&saved.model).unwrap()
    );
    assert_eq!(
        serde_json::to_string(&loaded_saved.features).unwrap(),
        serde_json::to_string(&saved.features).unwrap()
    );
    loaded
        .forward(features, &lengths)
        .into_data()
        .assert_eq(&expected, true);
}

/// A model directory whose `model.json` does not fit its weights, or is itself invalid, is
/// refused with an error saying what does not fit, before any layer is built: a changed width
/// names the tensor of the wrong shape, an extra layer its missing tensors, a layer count
/// beyond the file's tensors, an invalid setting and a foreign or absent weights file are
/// each named. The model is never returned with some weights left at their random values.
#[test]
fn model_json_that_does_not_fit_its_weights_is_refused_naming_why() {
    let _rng = process_rng();
    let device = cpu();
    let saved = SavedModel {
        model: toy_config(AttentionKind::Full),
        features: LogMelConfig::new().with_n_mels(16),
        phones: PhoneInventory::standard().phones()[..8].to_vec(),
    };
    let dir = tempdir("misfit");
    save_model(&saved.model.init(&device), &saved, &dir).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.json")).unwrap()).unwrap();
    let weights = json["weights"].as_str().unwrap().to_string();
    let cases: [(&str, serde_json::Value, &str); 6] = [
        ("d_ff", 48.into(), "layers.0.ff_in.weight"),
        ("n_layers", 2.into(), "missing tensors layers.1."),
        (
            "n_layers",
            1_000_000_000_000u64.into(),
            "asks for 1000000000000 layers",
        ),
        (
            "subsampling",
            3.into(),
            "model.json: subsampling must be 1, 2 or 4, got 3",
        ),
        (
            "n_heads",
            3.into(),
            "model.json: d_model (32) must be divisible by n_heads (3)",
        ),
        (
            "attention",
            serde_json::json!({"Clustered": {"clusters": 0}}),
            "model.json: clusters must be at least 1, got 0",
        ),
    ];
    let load_error = |json: &serde_json::Value| {
        std::fs::write(dir.join("model.json"), json.to_string()).unwrap();
        match load_model(&dir, &device) {
            Ok(_) => panic!("{json} loaded"),
            Err(e) => format!("{e:#}"),
        }
    };
    for (key, value, expected) in cases {
        let mut changed = json.clone();
        changed["model"][key] = value;
        let error = load_error(&changed);
        assert!(error.contains(expected), "{key}: {error}");
    }
    let mut foreign = json.clone();
    foreign["weights"] = "../model-1.safetensors".into();
    let error = load_error(&foreign);
    assert!(error.contains("expected model-<N>.safetensors"), "{error}");
    let mut older = json.clone();
    older.as_object_mut().unwrap().remove("weights");
    let error = load_error(&older);
    assert!(error.contains("model.mpk"), "{error}");
    let bytes = std::fs::read(dir.join(&weights)).unwrap();
    std::fs::write(dir.join(&weights), &bytes[..bytes.len() / 2]).unwrap();
    let error = load_error(&json);
    assert!(error.contains("not a safetensors file"), "{error}");
    std::fs::write(dir.join(&weights), &bytes).unwrap();
    std::fs::write(dir.join("model.json"), json.to_string()).unwrap();
    load_model(&dir, &device).expect("the restored directory loads");
}

/// Makes [`model_directory_killed_while_saving_holds_one_model`] the saving child: it saves
/// its two models into the directory this names, in turn, until it is killed.
const SAVE_LOOP_DIR: &str = "ASR_TEST_SAVE_LOOP_DIR";

/// A directory whose saving process is killed (SIGKILL) at 24 points of its first three
/// saves holds, each time, one of the two models it was saving in turn, whole: `model.json` names a
/// weights file that loads, and its parameters are bit for bit those of one of the two. A
/// later save leaves only its own weights and `model.json` (no other weights file, no
/// temporary file of the killed saves).
#[test]
fn model_directory_killed_while_saving_holds_one_model() {
    use std::io::BufRead;
    let _rng = process_rng();
    let device = cpu();
    // 0.8 M parameters: writing the weights is most of a save.
    let saved = SavedModel {
        model: toy_config(AttentionKind::Full)
            .with_d_model(128)
            .with_d_ff(512)
            .with_n_layers(4),
        features: LogMelConfig::new().with_n_mels(16),
        phones: PhoneInventory::standard().phones()[..8].to_vec(),
    };
    let models = [1, 2].map(|seed| {
        device.seed(seed);
        let model = saved.model.init(&device);
        // Draws the parameters now, once (Burn draws them when first used).
        parameters(&model);
        model
    });
    if let Some(dir) = std::env::var_os(SAVE_LOOP_DIR) {
        let dir = std::path::PathBuf::from(dir);
        // After libtest's "test … " on the same line.
        println!("{SAVE_LOOP_DIR}: saving");
        loop {
            for model in &models {
                save_model(model, &saved, &dir).unwrap();
            }
        }
    }
    let expected = models.each_ref().map(parameters);
    assert_ne!(expected[0], expected[1]);
    let dir = tempdir("killed-while-saving");
    let start = std::time::Instant::now();
    save_model(&models[0], &saved, &dir).unwrap();
    let save_time = start.elapsed();
    let mut seen = [0; 2];
    for kill in 0..24u32 {
        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "model_directory_killed_while_saving_holds_one_model",
                "--exact",
                "--nocapture",
                "--test-threads",
                "1",
            ])
            .env(SAVE_LOOP_DIR, &dir)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let marker = format!("{SAVE_LOOP_DIR}: saving");
        let started = std::io::BufReader::new(child.stdout.take().unwrap())
            .lines()
            .any(|line| line.unwrap().ends_with(&marker));
        assert!(started, "the saving process ended before saving");
        // Over its first three saves, an eighth of a save apart.
        std::thread::sleep(save_time * kill / 8);
        child.kill().unwrap();
        child.wait().unwrap();
        let (loaded, _) = load_model(&dir, &device)
            .unwrap_or_else(|e| panic!("killed after {kill} steps: {e:#}"));
        let loaded = parameters(&loaded);
        let which = expected.iter().position(|p| *p == loaded);
        let which = which.unwrap_or_else(|| panic!("killed after {kill} steps: neither model"));
        seen[which] += 1;
    }
    eprintln!(
        "after 24 kills ({save_time:?} a save): the first model {} times, the second {}",
        seen[0], seen[1]
    );
    save_model(&models[1], &saved, &dir).unwrap();
    let mut names = file_names(&dir);
    names.sort();
    assert_eq!(names.len(), 2, "{names:?}");
    assert_eq!(names[1], "model.json", "{names:?}");
    assert_eq!(common::weights_file(&dir), dir.join(&names[0]));
    let (loaded, _) = load_model(&dir, &device).unwrap();
    assert_eq!(parameters(&loaded), expected[1]);
}

/// An utterance gets the same log-probabilities alone as in a batch where it is padded to a
/// longer utterance's length, for every front end and with the convolution module, at
/// subsampling 1, 2 and 4: padding reaches no valid step. Full attention (clustered attention
/// draws its K-means starting centroids from (seed, head, the sequence's valid length), the
/// same alone and padded in a batch); to 1e-5.
#[test]
fn an_utterance_is_recognized_alike_alone_and_padded_in_a_batch() {
    let _rng = process_rng();
    let device = cpu();
    device.seed(5);
    let (short, long) = (17, 24);
    let features = Tensor::<3>::random([2, long, 16], Distribution::Normal(0., 1.), &device);
    // The batch's padding is zeros, as CtcBatcher makes it.
    let padded = Tensor::cat(
        vec![
            features.clone().slice([0..1, 0..short]),
            Tensor::zeros([1, long - short, 16], &device),
        ],
        1,
    );
    let batch = Tensor::cat(vec![padded, features.clone().slice([1..2, 0..long])], 0);
    let alone = features.slice([0..1, 0..short]);
    for front_end in [FrontEnd::Stack, FrontEnd::Conv { channels: 8 }] {
        for conv_kernel in [0, 5] {
            for subsampling in [1, 2, 4] {
                let model = toy_config(AttentionKind::Full)
                    .with_subsampling(subsampling)
                    .with_front_end(front_end)
                    .with_conv_kernel(conv_kernel)
                    .init(&device);
                let steps = model.output_length(short);
                let expected = model.forward(alone.clone(), &[short]);
                let batched = model
                    .forward(batch.clone(), &[short, long])
                    .slice([0..1, 0..steps]);
                let diff = (batched - expected).abs().max().into_scalar::<f32>();
                assert!(
                    diff < 1e-5,
                    "front end {front_end}, conv kernel {conv_kernel}, subsampling {subsampling}: largest difference {diff}"
                );
            }
        }
    }
}

/// One batch, trained alone, reaches a CTC loss near zero and is transcribed exactly.
#[test]
fn one_batch_overfits_to_near_zero_loss() {
    let _rng = process_rng();
    let device = train_device();
    device.seed(1);
    let examples = vec![
        toy_example(0, vec![1, 2, 3, 4], 32, 16),
        toy_example(1, vec![5, 6, 5, 7, 8], 40, 16),
    ];
    let mut model = toy_config(AttentionKind::Improved {
        clusters: 4,
        topk: 4,
    })
    .init(&device);
    let mut optim = AdamConfig::new().init();
    let batch = CtcBatcher.make(&examples, &device);
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
    let batch = CtcBatcher.make(&examples, &cpu());
    let decoded = model.decode(
        model.forward(batch.features, &batch.frame_lengths),
        &batch.frame_lengths,
    );
    assert_eq!(decoded, batch.references);
}

/// Data-parallel training on two devices (two workers on NdArray's one device), each step one
/// utterance per device, ends with the same weights as one device whose batches hold both
/// utterances: the gradients of the two halves, each loss weighted 1/2, sum to the whole
/// batch's. Two steps, no dropout, no augmentation, batches in a fixed order; to 1e-5.
///
/// Full attention. (Clustered attention draws its K-means starting centroids from (seed, head,
/// the sequence's valid length), the same for a sequence at any position of a batch.)
#[test]
fn two_devices_train_as_one_device_on_twice_the_batch() {
    let _rng = process_rng();
    let device = cpu();
    let run = data_parallel_against_one_device("multi", &[device.clone(), device], Strategy::Multi);
    // Measured: 5.4e-7.
    assert!(run.worst <= 1e-5, "largest difference {}", run.worst);
    assert!(
        run.moved > 1e-3,
        "the steps changed the weights (largest change {})",
        run.moved
    );
}

/// Two data-parallel workers on one device, with dropout (0.1) and SpecAugment on and the
/// batches shuffled, end two runs of the same seed with the same weights, bit for bit: each
/// batch's dropout masks and augmentation are drawn from its own seed, not from a generator
/// that the workers share in whatever order they reach it. A third run with another seed
/// ends elsewhere.
#[test]
fn two_workers_with_dropout_repeat_bit_for_bit() {
    let _rng = process_rng();
    let (examples, mut saved) = toy_run(
        8,
        AttentionKind::Improved {
            clusters: 3,
            topk: 4,
        },
    );
    saved.model = saved.model.with_dropout(0.1);
    let device = cpu();
    let run = |name: &str, seed: u64| {
        let options = TrainOptions {
            seed,
            shuffle: true,
            augment: AugmentSet::new(&[Augmentation::SpecAugment]),
            ..toy_options(tempdir(name))
        };
        let model = train_on_devices(
            &saved,
            examples.clone(),
            examples.clone(),
            &options,
            &[device.clone(), device.clone()],
        )
        .unwrap();
        parameters(&model)
    };
    let first = run("repeat-a", 0);
    let again = largest_difference(&first, &run("repeat-b", 0));
    assert_eq!(again, 0.0, "the same seed gave other weights");
    let other = largest_difference(&first, &run("repeat-c", 1));
    assert!(other > 0.0, "another seed gave the same weights");
}

/// A corpus of the first utterances of the bundled corpus's splits (24 train, 6 dev, 6
/// test), their audio by absolute path, in a fresh directory `name`.
fn small_corpus(name: &str) -> std::path::PathBuf {
    let bundled = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus");
    let corpus = tempdir(name);
    std::fs::copy(bundled.join("phones.txt"), corpus.join("phones.txt")).unwrap();
    for (split, n) in [("train", 24), ("dev", 6), ("test", 6)] {
        let text = std::fs::read_to_string(bundled.join(format!("{split}.jsonl"))).unwrap();
        let lines: Vec<String> = text
            .lines()
            .take(n)
            .map(|line| {
                let mut entry: ManifestEntry = serde_json::from_str(line).unwrap();
                entry.audio = bundled.join(&entry.audio).to_string_lossy().into_owned();
                serde_json::to_string(&entry).unwrap()
            })
            .collect();
        std::fs::write(
            corpus.join(format!("{split}.jsonl")),
            lines.join("\n") + "\n",
        )
        .unwrap();
    }
    corpus
}

/// `asr train` of a one-layer model on [`small_corpus`] into `out`, with `extra` arguments.
fn small_training(corpus: &Path, out: &Path, extra: &[&str]) -> std::process::Command {
    let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_asr"));
    command
        .arg("train")
        .arg("--corpus")
        .arg(corpus)
        .arg("--out")
        .arg(out)
        .args(["--d-model", "32", "--n-heads", "2"])
        .args(["--n-layers", "1", "--d-ff", "64", "--augment", "none"])
        .args(["--batch-frames", "1500", "--warmup-steps", "2"])
        .args(extra);
    command
}

/// `asr train --devices cpu:2` (two data-parallel workers) trains an epoch of a small corpus,
/// writes its checkpoint, and `--resume` continues it to a second epoch.
#[test]
fn cli_trains_on_two_cpu_workers_and_resumes() {
    let corpus = small_corpus("cli-corpus");
    let out = tempdir("cli-run");
    let run = |extra: &[&str]| {
        let output = small_training(&corpus, &out, &["--devices", "cpu:2"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "{stdout}\n{stderr}");
        (stdout, stderr)
    };
    let (stdout, _) = run(&["--epochs", "1"]);
    assert!(stdout.contains("test PER on"), "{stdout}");
    assert_eq!(last_checkpoint(&out), Some(1));
    let (_, stderr) = run(&["--epochs", "2", "--resume"]);
    assert!(stderr.contains("resuming after epoch 1"), "{stderr}");
    assert_eq!(last_checkpoint(&out), Some(2));
    assert!(common::weights_file(&out).exists());
}

/// `asr train` (3 epochs) killed with SIGKILL at 5 points spread over an uninterrupted run's
/// time (during an epoch, its checkpoint, the epoch after, the final save), then run again
/// with `--resume`: each time the second run finishes the 3 epochs from the last whole
/// checkpoint, and the model it saves loads. A checkpoint is whole when the model's, the
/// optimizer's and the schedule's files of its epoch are all there (each written whole or
/// not at all).
#[test]
fn cli_training_killed_anywhere_resumes_to_the_end() {
    let corpus = small_corpus("kill-corpus");
    let epochs = ["--epochs", "3"];
    let start = std::time::Instant::now();
    let whole = small_training(&corpus, &tempdir("kill-whole"), &epochs)
        .output()
        .unwrap();
    assert!(whole.status.success(), "{whole:?}");
    let run_time = start.elapsed();
    for kill in 1..=5u32 {
        let out = tempdir(&format!("kill-{kill}"));
        let mut child = small_training(&corpus, &out, &epochs)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(run_time * kill / 6);
        child.kill().unwrap();
        child.wait().unwrap();
        let killed_at = last_checkpoint(&out);
        let output = small_training(&corpus, &out, &["--epochs", "3", "--resume"])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "killed at {kill}/6 of the run (checkpoint {killed_at:?}): {stderr}"
        );
        assert_eq!(last_checkpoint(&out), Some(3), "killed at {kill}/6");
        load_model(&out, &cpu()).unwrap_or_else(|e| panic!("killed at {kill}/6: {e:#}"));
        eprintln!("killed at {kill}/6 of {run_time:?}: checkpoint {killed_at:?}, resumed to 3");
    }
}

/// The file names in `dir` (none when it does not exist).
fn file_names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir).map_or_else(
        |_| Vec::new(),
        |entries| {
            entries
                .filter_map(|e| e.ok()?.file_name().into_string().ok())
                .collect()
        },
    )
}

/// The temporary files of interrupted writes in `dir` (`write_atomic`'s `….partial`).
fn partial_files(dir: &Path) -> Vec<String> {
    file_names(dir)
        .into_iter()
        .filter(|name| name.ends_with(".partial"))
        .collect()
}

/// `asr train` killed (SIGKILL) while it writes the checkpoint of epoch 1, then of epoch 2 —
/// a temporary file of that checkpoint in `checkpoint/` at the kill and still there after
/// it — holds the checkpoints before it, whole; `--resume` goes on from the last of them
/// (from scratch for epoch 1), finishes the run, removes the temporary files, and the model
/// loads. The model has 0.8 M parameters, so that a checkpoint's files (the model and Adam's
/// two moments, about 10 MB) take milliseconds to write; the test watches the directory
/// without pause and kills the run as soon as a temporary file of the aimed checkpoint shows.
/// A run where the write ended before the kill is retried, up to 10 times.
#[test]
fn cli_training_killed_inside_a_checkpoint_write_resumes_from_the_last_whole_one() {
    let corpus = small_corpus("checkpoint-kill-corpus");
    let training = |out: &Path, extra: &[&str]| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_asr"));
        command
            .arg("train")
            .arg("--corpus")
            .arg(&corpus)
            .arg("--out")
            .arg(out)
            .args(["--d-model", "128", "--n-heads", "2", "--n-layers", "4"])
            .args(["--d-ff", "512", "--augment", "none", "--epochs", "3"])
            .args(["--batch-frames", "1500", "--warmup-steps", "2"])
            .args(extra);
        command
    };
    for epoch in [1usize, 2] {
        let aimed = format!("-{epoch}.bpk.");
        let mut landed = false;
        for attempt in 0..10 {
            let out = tempdir(&format!("checkpoint-kill-{epoch}-{attempt}"));
            let checkpoint = out.join("checkpoint");
            let mut child = training(&out, &[])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            while child.try_wait().unwrap().is_none() {
                let writing = file_names(&checkpoint)
                    .iter()
                    .any(|name| name.ends_with(".partial") && name.contains(&aimed));
                if writing {
                    child.kill().unwrap();
                    break;
                }
            }
            child.wait().unwrap();
            let left = partial_files(&checkpoint);
            if !left.iter().any(|name| name.contains(&aimed)) {
                continue;
            }
            landed = true;
            let before = (epoch > 1).then_some(epoch - 1);
            assert_eq!(last_checkpoint(&out), before, "killed in {left:?}");
            let output = training(&out, &["--resume"]).output().unwrap();
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert!(output.status.success(), "killed in {left:?}: {stderr}");
            let resumed = match before {
                Some(n) => format!("resuming after epoch {n}"),
                None => "no checkpoint in".to_string(),
            };
            assert!(stderr.contains(&resumed), "killed in {left:?}: {stderr}");
            assert_eq!(last_checkpoint(&out), Some(3), "killed in {left:?}");
            let partial = partial_files(&checkpoint);
            assert!(
                partial.is_empty(),
                "left after the resumed run: {partial:?}"
            );
            load_model(&out, &cpu()).unwrap_or_else(|e| panic!("killed in {left:?}: {e:#}"));
            eprintln!("killed inside {left:?} (run {attempt}), resumed from {before:?} to 3");
            break;
        }
        assert!(
            landed,
            "no kill landed inside the checkpoint of epoch {epoch} in 10 runs"
        );
    }
}

/// `asr train --out` where no directory can be made (below a plain file; file permissions
/// would not stop a test run as root) is refused before any work: the message names
/// `--out` and the path, not the corpus, which does not exist either.
#[test]
fn cli_refuses_an_output_directory_it_cannot_write_before_any_work() {
    let dir = tempdir("unwritable-out");
    std::fs::write(dir.join("a-file"), b"").unwrap();
    let out = dir.join("a-file").join("run");
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_asr"))
        .arg("train")
        .arg("--corpus")
        .arg(dir.join("no-corpus"))
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("--out") && stderr.contains(&*out.to_string_lossy()),
        "{stderr}"
    );
    assert!(!stderr.contains("no-corpus"), "{stderr}");
}

/// `asr train --strategy ddp` off CUDA is refused before any work, naming the devices, and
/// `--devices` that do not fit `--backend` are too.
#[test]
fn cli_refuses_ddp_off_cuda_and_devices_of_another_backend() {
    let train = |args: &[&str]| {
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_asr"))
            .arg("train")
            .args(args)
            .output()
            .unwrap();
        assert!(!output.status.success(), "{args:?} ran");
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let stderr = train(&["--devices", "cpu:2", "--strategy", "ddp"]);
    assert!(
        stderr.contains("--strategy ddp with --devices cpu:2") && stderr.contains("CUDA"),
        "{stderr}"
    );
    let stderr = train(&["--devices", "cuda:0"]);
    assert!(
        stderr.contains("--devices cuda:0 does not fit --backend flex"),
        "{stderr}"
    );
}

/// `final_learning_rate` is the rate of the run's last step: a two-step run decaying to 0 ends
/// with the weights its first step left, bit for bit (Adam moves nothing at rate 0), while
/// the same run without decay moves them on; resumed to a second epoch, it trains on.
#[test]
fn learning_rate_decays_to_the_final_rate_at_the_last_step() {
    let _rng = process_rng();
    let (examples, saved) = toy_run(2, AttentionKind::Full);
    let device = train_device();
    let weights = |options: &TrainOptions| {
        let model = train(&saved, examples.clone(), examples.clone(), options, &device).unwrap();
        parameters(&model)
    };
    let run = |name: &str, final_learning_rate, stop_after_steps| {
        weights(&TrainOptions {
            batch_frames: 24,
            final_learning_rate,
            stop_after_steps,
            ..toy_options(tempdir(name))
        })
    };
    let one_step = run("decay-one-step", Some(0.0), Some(1));
    let decayed = run("decay-two-steps", Some(0.0), None);
    assert_eq!(largest_difference(&one_step, &decayed), 0.0);
    let constant = run("constant-two-steps", None, None);
    assert!(largest_difference(&one_step, &constant) > 1e-4);
    // Resumed to a second epoch, the decay is stretched to the new last step: the weights move
    // on (at the final rate, they would not).
    let dir = tempdir("decay-resumed");
    let options = |epochs, resume| TrainOptions {
        epochs,
        resume,
        batch_frames: 24,
        final_learning_rate: Some(0.0),
        ..toy_options(dir.clone())
    };
    let first_epoch = weights(&options(1, false));
    assert_eq!(largest_difference(&first_epoch, &decayed), 0.0);
    let second_epoch = weights(&options(2, true));
    assert!(largest_difference(&first_epoch, &second_epoch) > 1e-4);
}

/// `resume` in a directory whose checkpoints are an older version's (Burn 0.21's
/// `model-N.mpk`, which Burn 0.22 cannot read) is refused before any training, naming them;
/// they are not counted as checkpoints.
#[test]
fn resume_refuses_checkpoints_of_an_older_version() {
    let (examples, saved) = toy_run(2, AttentionKind::Full);
    let dir = tempdir("older-checkpoints");
    let checkpoint = dir.join("checkpoint");
    std::fs::create_dir_all(&checkpoint).unwrap();
    for part in ["model", "optim", "scheduler"] {
        std::fs::write(checkpoint.join(format!("{part}-2.mpk")), b"").unwrap();
    }
    assert_eq!(last_checkpoint(&dir), None);
    let options = TrainOptions {
        resume: true,
        ..toy_options(dir.clone())
    };
    let error = train(
        &saved,
        examples.clone(),
        examples,
        &options,
        &train_device(),
    )
    .unwrap_err();
    let message = format!("{error:#}");
    assert!(
        message.contains("model-2.mpk") && message.contains("older version"),
        "{message}"
    );
}

/// A run interrupted in its second epoch and restarted with `resume` continues from the
/// first epoch's checkpoint (weights, Adam state and learning-rate schedule): it ends with the
/// same weights as an uninterrupted two-epoch run (batch order fixed, no dropout), to 1e-5.
#[test]
fn interrupted_training_resumes_from_its_last_checkpoint() {
    let _rng = process_rng();
    let (examples, saved) = toy_run(6, AttentionKind::Clustered { clusters: 4 });
    let options = |dir: &Path, epochs, resume, stop_after_steps| TrainOptions {
        epochs,
        learning_rate: 1e-3,
        warmup_steps: 2,
        resume,
        stop_after_steps,
        ..toy_options(dir.to_path_buf())
    };
    let device = train_device();
    let run =
        |o: TrainOptions| train(&saved, examples.clone(), examples.clone(), &o, &device).unwrap();

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
    assert!(common::weights_file(&dir).exists());

    let batch = CtcBatcher.make(&examples, &cpu());
    let a = reference.forward(batch.features.clone(), &batch.frame_lengths);
    let b = resumed.forward(batch.features, &batch.frame_lengths);
    let diff = (a - b).abs().max().into_scalar::<f32>();
    assert!(
        diff <= 1e-5,
        "resumed weights differ from the uninterrupted run: max |Δ log p| = {diff}"
    );

    // The training log: each epoch's dev PER as burn-train validated it; the last one is the
    // final model's PER on the validation examples (no dropout), by `evaluate`.
    let read = |dir: &Path| -> TrainingLog {
        serde_json::from_str(&std::fs::read_to_string(dir.join(TRAINING_LOG)).unwrap()).unwrap()
    };
    let log = read(&reference_dir);
    assert_eq!(log.epochs.len(), 2);
    assert!(!log.resumed);
    let expected = evaluate(&reference, &examples, None, 48, &cpu()).percent();
    assert!(
        (log.epochs[1].dev_per - expected).abs() <= 1e-6,
        "logged dev PER {} against evaluate's {expected}",
        log.epochs[1].dev_per
    );
    let ends: Vec<f64> = log.epochs.iter().map(|e| e.end_seconds.unwrap()).collect();
    assert!(ends[0] <= ends[1] && ends[1] <= log.train_seconds + 1.0);
    for e in &log.epochs {
        let (train, valid) = (e.train_seconds.unwrap(), e.valid_seconds.unwrap());
        assert!(train > 0.0 && valid > 0.0, "{e:?}");
        assert!(e.forward_ms.unwrap() > 0.0, "{e:?}");
    }
    // The resumed run keeps the first sitting's epoch (its checkpoint's) and counts its time:
    // the interrupted sitting's partial epoch is not in it.
    let log = read(&dir);
    assert!(log.resumed, "{log:?}");
    assert_eq!(
        log.epochs.iter().map(|e| e.epoch).collect::<Vec<_>>(),
        [1, 2],
        "{log:?}"
    );
    let (first, second) = (&log.epochs[0], &log.epochs[1]);
    let expected =
        first.end_seconds.unwrap() + second.train_seconds.unwrap() + second.valid_seconds.unwrap();
    assert!(
        (second.end_seconds.unwrap() - expected).abs() < 0.5,
        "epoch 2 ends at {:?}, expected about {expected}",
        second.end_seconds
    );
}

/// `--time-budget`: a budget below one step stops the run at its first batches, without a
/// completed epoch; the log records the budget and the final model's dev PER, which is
/// `evaluate`'s on the validation examples. A resumed run counts its earlier sitting's time:
/// with a budget just past the first sitting's seconds it stops in the next epoch, keeping
/// the first epoch. A budget that is never reached changes nothing (no final PER of its own).
#[test]
fn time_budget_stops_training_and_measures_the_dev_per() {
    let _rng = process_rng();
    let (examples, saved) = toy_run(6, AttentionKind::Full);
    let device = train_device();
    let run =
        |o: TrainOptions| train(&saved, examples.clone(), examples.clone(), &o, &device).unwrap();
    let read = |dir: &Path| -> TrainingLog {
        serde_json::from_str(&std::fs::read_to_string(dir.join(TRAINING_LOG)).unwrap()).unwrap()
    };

    let dir = tempdir("budget");
    let model = run(TrainOptions {
        epochs: 20,
        time_budget_s: Some(1e-3),
        ..toy_options(dir.clone())
    });
    let log = read(&dir);
    assert!(log.epochs.is_empty(), "{log:?}");
    assert_eq!(log.time_budget_s, Some(1e-3));
    assert!(log.train_seconds >= 1e-3, "{log:?}");
    let expected = evaluate(&model, &examples, None, 48, &cpu()).percent();
    assert_eq!(log.final_dev_per, Some(expected));
    assert_eq!(log.last_dev_per(), Some(expected));
    assert!(common::weights_file(&dir).exists());

    // One epoch, then a resumed run whose budget ends just after it.
    let dir = tempdir("budget-resume");
    run(toy_options(dir.clone()));
    let first = read(&dir).epochs[0].end_seconds.unwrap();
    let model = run(TrainOptions {
        epochs: 20,
        resume: true,
        time_budget_s: Some(first + 1e-3),
        ..toy_options(dir.clone())
    });
    let log = read(&dir);
    assert_eq!(log.epochs.len(), 1, "{log:?}");
    assert!(log.train_seconds >= first + 1e-3, "{log:?}");
    let expected = evaluate(&model, &examples, None, 48, &cpu()).percent();
    assert_eq!(log.final_dev_per, Some(expected));

    let dir = tempdir("budget-unreached");
    run(TrainOptions {
        epochs: 2,
        time_budget_s: Some(1e6),
        ..toy_options(dir.clone())
    });
    let log = read(&dir);
    assert_eq!((log.epochs.len(), log.final_dev_per), (2, None), "{log:?}");
    assert_eq!(log.last_dev_per(), Some(log.epochs[1].dev_per));
}

/// Table 2 and Figure 1 from training logs: the best epoch is the lowest dev PER (first of
/// equals), its time is its end; a run stopped by its time budget ends with its final PER;
/// the common dev PER is the worst model's best, and each model's time to it the end of its
/// first epoch at or below it; the SVG names every model.
#[test]
fn compare_picks_the_best_epoch_and_plots_every_model() {
    let epoch = |epoch, end, dev_per| EpochLog {
        epoch,
        end_seconds: Some(end),
        dev_per,
        train_seconds: Some(90.0),
        valid_seconds: Some(10.0),
        forward_ms: Some(20.0),
        peak_memory_mib: Some(100.0 * epoch as f64),
    };
    let log = |attention: &str, pers: [f64; 3], stopped: Option<f64>| TrainingLog {
        attention: attention.parse().unwrap(),
        train_seconds: if stopped.is_some() { 350.0 } else { 300.0 },
        resumed: false,
        epochs: vec![
            epoch(1, 100.0, pers[0]),
            epoch(2, 200.0, pers[1]),
            epoch(3, 300.0, pers[2]),
        ],
        time_budget_s: stopped.map(|_| 350.0),
        final_dev_per: stopped,
    };
    let dir = tempdir("compare");
    let rows = vec![
        ModelSummary::new(&dir, &log("full", [50.0, 30.0, 30.0], None), 4, 31.5, 12.25).unwrap(),
        ModelSummary::new(
            &dir,
            &log("lsh:4", [60.0, 55.0, 40.0], Some(38.0)),
            2,
            41.0,
            20.0,
        )
        .unwrap(),
    ];
    assert_eq!(
        (
            rows[0].best_epoch,
            rows[0].seconds_to_best,
            rows[0].final_dev_per
        ),
        (2, Some(200.0), 30.0)
    );
    assert_eq!(
        (
            rows[1].best_epoch,
            rows[1].seconds_to_best,
            rows[1].final_dev_per
        ),
        (0, Some(350.0), 38.0)
    );
    assert_eq!(rows[0].seconds_per_epoch, Some(100.0));
    assert_eq!(common_dev_per(&rows), Some(38.0));
    assert_eq!(
        (rows[0].seconds_to(38.0), rows[1].seconds_to(38.0)),
        (Some(200.0), Some(350.0))
    );
    let table = markdown_table(&rows);
    assert!(table.contains("| s to 38.00 % dev PER |"), "{table}");
    assert!(
        table.contains(
            "| full | 4 | 3 | 100 | 90 | 20 | 300 | 30.00 | 30.00 | 200 | 31.50 | 12.2 |"
        ),
        "{table}"
    );
    let svg = dir.join("figure.svg");
    plot(&svg, &rows, "test").unwrap();
    let text = std::fs::read_to_string(&svg).unwrap();
    let labels: Vec<&str> = text
        .split("<text")
        .skip(1)
        .filter_map(|t| t.split_once('>').map(|(_, rest)| rest))
        .map(|t| t.split('<').next().unwrap_or("").trim())
        .collect();
    assert!(
        labels.contains(&"full ×4") && labels.contains(&"lsh:4 ×2"),
        "{labels:?}"
    );
}

/// Results saved by one sitting tabulate in a later one as when measured: a Table 2 row
/// survives its JSON round trip (same markdown), rows of two machines are told apart, and
/// Table 1 columns join into the table written by hand here, `–` where an attention does not
/// apply; columns of different settings are refused, naming both models.
#[test]
fn saved_rows_and_columns_tabulate_as_measured() {
    let dir = tempdir("saved-results");
    let log = TrainingLog {
        attention: "clustered:100".parse().unwrap(),
        train_seconds: 200.0,
        resumed: false,
        epochs: vec![EpochLog {
            epoch: 1,
            end_seconds: Some(200.0),
            dev_per: 61.25,
            train_seconds: Some(180.0),
            valid_seconds: Some(20.0),
            forward_ms: Some(7.0),
            peak_memory_mib: Some(900.0),
        }],
        time_budget_s: None,
        final_dev_per: None,
    };
    let row = ModelSummary::new(&dir, &log, 4, 63.5, 26.5).unwrap();
    let path = dir.join("clustered-100-4.json");
    save_json(&path, &row).unwrap();
    assert!(!dir.join("clustered-100-4.json.partial").exists());
    let loaded: ModelSummary = load_json(&path).unwrap();
    assert_eq!(
        serde_json::to_value(&loaded).unwrap(),
        serde_json::to_value(&row).unwrap()
    );
    assert_eq!(
        markdown_table(std::slice::from_ref(&loaded)),
        markdown_table(&[row])
    );
    let mut other = loaded.clone();
    other.machine = "another CPU, 2 CPUs".to_string();
    let table = markdown_table(&[loaded, other]);
    assert!(
        table.contains("- clustered:100 ×4: another CPU, 2 CPUs\n"),
        "{table}"
    );

    // A mean whose last digit serde_json may not read back exactly.
    let setting = Table1Setting {
        split: "dev.jsonl".to_string(),
        utterances: 10,
        mean_steps: 15505.0 / 31.0,
        clusters: 100,
        topk: 32,
        decoding: "greedy decoding".to_string(),
    };
    let column = |model: &str, trained: &str, cells: [Option<f64>; 2]| Table1Column {
        model: model.into(),
        trained_with: trained.parse().unwrap(),
        setting: setting.clone(),
        cells: vec![
            (AttentionKind::Full, cells[0]),
            (AttentionKind::SharedFull, cells[1]),
        ],
        machine: "a CPU".to_string(),
    };
    let full = column("full-4", "full", [Some(58.024), None]);
    let shared = column("shared-full-4", "shared-full", [Some(70.0), Some(62.756)]);
    let path = dir.join("full-4.table1.json");
    save_json(&path, &full).unwrap();
    let full: Table1Column = load_json(&path).unwrap();
    assert_eq!(
        table1_markdown(&[full.clone(), shared.clone()]).unwrap(),
        "PER (%) on dev.jsonl (10 utterances, mean 500 encoder steps, C = 100, K = 32, greedy \
         decoding); columns: trained with, rows: evaluated with\n\
         | evaluated with | full | shared-full |\n\
         |---|---:|---:|\n\
         | full | 58.02 | 70.00 |\n\
         | shared-full | – | 62.76 |\n"
    );
    let mut elsewhere = shared.clone();
    elsewhere.setting.clusters = 200;
    let error = table1_markdown(&[full.clone(), elsewhere])
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("full-4")
            && error.contains("shared-full-4")
            && error.contains("share split and settings"),
        "{error}"
    );
    let mut fewer = shared;
    fewer.cells.pop();
    let error = table1_markdown(&[full, fewer]).unwrap_err().to_string();
    assert!(error.contains("different attentions"), "{error}");
    assert!(table1_markdown(&[]).is_err());
    assert!(load_json::<Table1Column>(&dir.join("clustered-100-4.json")).is_err());
}

/// `phrases` against phrases cut by hand: verse references dropped, a phrase ends at
/// punctuation once it has 3 words or at 8 words, shorter rests are dropped, and punctuation
/// but apostrophes and hyphens is removed.
#[test]
fn phrases_are_cut_at_punctuation_and_max_words() {
    let text = "Ge1:1 In the beginning God created the heaven and the earth.\n\
        Ge1:2 And the earth was without form, and void; and darkness was upon the face of the \
        deep. And the Spirit of God moved upon the face of the waters.\n\
        Hello, world\n\
        Don't stop the well-known song, then stop.";
    assert_eq!(
        phrases(text, 8),
        [
            "In the beginning God created the heaven and",
            "And the earth was without form",
            "and void and darkness was upon the face",
            "of the deep",
            "And the Spirit of God moved upon the",
            "face of the waters",
            "Don't stop the well-known song",
        ]
    );
}

/// `asr corpus --min-seconds`: every utterance lasts at least that long and its text is
/// consecutive phrases of the source joined (phrases as the test above checks them).
#[test]
fn corpus_joins_consecutive_phrases_into_long_utterances() {
    let dir = tempdir("long-corpus");
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/text/kjv-pentateuch.txt");
    generate(&CorpusOptions {
        out: dir.clone(),
        hours: 0.01,
        held_out_fraction: 0.2,
        text: text.clone(),
        text_licence: "public domain".into(),
        seed: 3,
        bits_per_sample: 16,
        max_words: 8,
        min_seconds: 5.0,
    })
    .unwrap();
    let source = phrases(&std::fs::read_to_string(&text).unwrap(), 8);
    let inventory = PhoneInventory::load(&dir.join("phones.txt")).unwrap();
    let mut next = 0;
    let mut joined = 0;
    for split in ["train", "dev", "test"] {
        let utterances =
            read_manifest(&dir.join(format!("{split}.jsonl")), &inventory, true).unwrap();
        assert!(!utterances.is_empty(), "{split} is empty");
        for u in utterances {
            let seconds = load_audio(&u.audio_path).unwrap().len() as f64 / 16_000.0;
            assert!(seconds >= 5.0, "{}: {seconds} s", u.entry.id);
            // The text is phrases next, next + 1, ... of the source.
            let mut rest = u.entry.text.as_str();
            let mut parts = 0;
            while !rest.is_empty() {
                let phrase = &source[next % source.len()];
                next += 1;
                rest = rest
                    .strip_prefix(phrase.as_str())
                    .unwrap_or_else(|| {
                        panic!("{}: {rest:?} does not continue with {phrase:?}", u.entry.id)
                    })
                    .trim_start();
                parts += 1;
            }
            joined += usize::from(parts > 1);
        }
    }
    assert!(joined > 0, "no utterance joined two phrases");
}

/// `asr join` on a corpus written here: in each split, each speaker's clips (in manifest
/// order, interleaved with another speaker's in the source) become utterances of consecutive
/// clips of that speaker alone, covering its clips in order; each utterance's audio is its
/// clips' samples (each clip a constant level of its own) with exactly 0.5 s of silence
/// between them, and its text and phones are theirs joined in order; every utterance lasts
/// between the minimum and the maximum; dev and test hold their own speakers only; a clip
/// longer than the maximum, and a speaker whose clips cannot reach the minimum, are left out
/// and counted.
#[test]
fn join_makes_long_utterances_of_one_speakers_consecutive_clips() {
    use asr_model::join::{JoinOptions, join_corpus};
    let dir = tempdir("join");
    let source = dir.join("source");
    std::fs::create_dir_all(source.join("audio")).unwrap();
    PhoneInventory::standard()
        .save(&source.join("phones.txt"))
        .unwrap();
    let phones = ["p", "t", "k", "s", "m", "n", "l", "f"];
    // (split, voice, seconds) in manifest order; each clip's level is 0.01 × (its index + 1).
    let clips: Vec<(&str, &str, f64)> = [
        ("train", "anna", 1.0),
        ("train", "bert", 1.5),
        ("train", "anna", 1.2),
        ("train", "anna", 0.8),
        ("train", "bert", 1.0),
        ("train", "anna", 1.5),
        ("train", "anna", 9.0),
        ("train", "bert", 1.1),
        ("train", "anna", 1.0),
        ("train", "anna", 0.9),
        ("train", "carl", 0.5),
        ("dev", "dora", 1.3),
        ("dev", "dora", 1.4),
        ("dev", "dora", 1.0),
        ("test", "emil", 2.0),
        ("test", "emil", 1.0),
    ]
    .to_vec();
    let mut manifests: std::collections::BTreeMap<&str, Vec<ManifestEntry>> = Default::default();
    for (i, &(split, voice, seconds)) in clips.iter().enumerate() {
        let samples = vec![0.01 * (i + 1) as f32; (seconds * 16_000.0) as usize];
        let audio = format!("audio/c{i:02}.flac");
        write_flac(&source.join(&audio), &samples, 16_000, 16).unwrap();
        manifests.entry(split).or_default().push(ManifestEntry {
            id: format!("c{i:02}"),
            audio,
            duration_s: seconds,
            text: format!("clip {i}"),
            phones: format!("{} {}", phones[i % 8], phones[(i + 3) % 8]),
            voice: voice.to_string(),
        });
    }
    for (split, entries) in &manifests {
        write_manifest(&source.join(format!("{split}.jsonl")), entries).unwrap();
    }
    let out = dir.join("long");
    let options = JoinOptions {
        corpus: source.clone(),
        out: out.clone(),
        min_seconds: 2.5,
        mean_seconds: 3.0,
        max_seconds: 5.0,
        pause_s: 0.5,
        seed: 4,
        splits: vec!["train".into(), "dev".into(), "test".into()],
    };
    let report = join_corpus(&options).unwrap();

    let inventory = PhoneInventory::load(&out.join("phones.txt")).unwrap();
    let sources: std::collections::HashMap<String, Vec<usize>> =
        std::fs::read_to_string(out.join("joined-from.tsv"))
            .unwrap()
            .lines()
            .map(|line| {
                let mut fields = line.split('\t');
                let id = fields.next().unwrap().to_string();
                (id, fields.map(|c| c[1..].parse().unwrap()).collect())
            })
            .collect();
    let pause = 8_000;
    for (split, voices) in [
        ("train", vec!["anna", "bert"]),
        ("dev", vec!["dora"]),
        ("test", vec!["emil"]),
    ] {
        let utterances =
            read_manifest(&out.join(format!("{split}.jsonl")), &inventory, true).unwrap();
        let mut covered: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
        for u in &utterances {
            let parts = &sources[&u.entry.id];
            assert!(
                voices.contains(&u.entry.voice.as_str()),
                "{split}: {:?}",
                u.entry
            );
            assert!(
                parts
                    .iter()
                    .all(|&i| clips[i].0 == split && clips[i].1 == u.entry.voice)
            );
            covered
                .entry(u.entry.voice.clone())
                .or_default()
                .extend(parts);
            // The audio: each clip's level for its length, 0.5 s of zeros between.
            let samples = load_audio(&u.audio_path).unwrap();
            let mut at = 0;
            for (n, &i) in parts.iter().enumerate() {
                if n > 0 {
                    assert!(
                        samples[at..at + pause].iter().all(|&x| x == 0.0),
                        "{}: pause",
                        u.entry.id
                    );
                    at += pause;
                }
                let len = (clips[i].2 * 16_000.0) as usize;
                let level = 0.01 * (i + 1) as f32;
                assert!(
                    samples[at..at + len]
                        .iter()
                        .all(|x| (x - level).abs() < 1e-3),
                    "{}: clip {i} not where expected",
                    u.entry.id
                );
                at += len;
            }
            assert_eq!(at, samples.len(), "{}", u.entry.id);
            let seconds = samples.len() as f64 / 16_000.0;
            assert!(
                (2.5..=5.0).contains(&seconds),
                "{}: {seconds} s",
                u.entry.id
            );
            assert!((u.entry.duration_s - seconds).abs() < 1e-3);
            let text: Vec<String> = parts.iter().map(|i| format!("clip {i}")).collect();
            assert_eq!(u.entry.text, text.join(" "));
            let expected: Vec<String> = parts
                .iter()
                .map(|&i| format!("{} {}", phones[i % 8], phones[(i + 3) % 8]))
                .collect();
            assert_eq!(u.entry.phones, expected.join(" "));
        }
        // Each utterance is a run of consecutive clips of its speaker (the clips longer than
        // the maximum aside), the utterances in order; dev and test lose no clip.
        for voice in voices {
            let all: Vec<usize> = (0..clips.len())
                .filter(|&i| clips[i].0 == split && clips[i].1 == voice && clips[i].2 <= 5.0)
                .collect();
            let got = covered.get(voice).cloned().unwrap_or_default();
            assert!(got.windows(2).all(|w| w[0] < w[1]), "{voice}: {got:?}");
            for u in utterances.iter().filter(|u| u.entry.voice == voice) {
                let parts = &sources[&u.entry.id];
                let first = all.iter().position(|&i| i == parts[0]).unwrap();
                assert_eq!(
                    &all[first..first + parts.len()],
                    &parts[..],
                    "{voice}: not consecutive"
                );
            }
            if split != "train" {
                assert_eq!(got, all, "{voice}: every clip joined");
            }
        }
    }
    // Left out in train: at least the 9 s clip and carl's only clip; every clip is either
    // joined or counted as left out.
    let (dropped, dropped_s) = report.left_out["train"];
    let used = report.clips_used["train"];
    assert_eq!(used + dropped, 11, "{report:?}");
    assert!(dropped >= 2 && dropped_s >= 9.5, "{report:?}");
    assert_eq!(report.left_out["dev"], (0, 0.0));
    let histogram = report.histogram(4, 250);
    assert!(histogram.contains("dev: 1 utterances"), "{histogram}");
}

// ---------------------------------------------------------------------------------------------
// Augmentation

fn sine(hz: f64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (2.0 * std::f64::consts::PI * hz * i as f64 / 16000.0).sin() as f32)
        .collect()
}

/// Amplitude of the `hz` component of `x` (projection on sine and cosine), in f64.
fn amplitude(x: &[f32], hz: f64) -> f64 {
    let (mut s, mut c) = (0.0, 0.0);
    for (i, v) in x.iter().enumerate() {
        let phase = 2.0 * std::f64::consts::PI * hz * i as f64 / 16000.0;
        s += *v as f64 * phase.sin();
        c += *v as f64 * phase.cos();
    }
    2.0 * (s * s + c * c).sqrt() / x.len() as f64
}

/// Speed perturbation by `f` turns a 200 Hz sine into a 200·f Hz sine of `len / f` samples:
/// equal to the analytic signal to 1e-3 (the linear interpolation error bound at 200 Hz is
/// (2π·200/16000)²/8 ≈ 6e-4).
#[test]
fn speed_perturbation_scales_frequency_and_length() {
    let x = sine(200.0, 16000);
    for factor in [0.9, 1.0, 1.1] {
        let y = augment::speed(&x, factor);
        assert_eq!(y.len(), (16000.0 / factor).round() as usize);
        let expected = sine(200.0 * factor, y.len() - 2);
        for (i, (a, b)) in y.iter().zip(&expected).enumerate() {
            assert!(
                (a - b).abs() < 1e-3,
                "factor {factor}, sample {i}: {a} vs {b}"
            );
        }
    }
}

/// The FFT filter convolves like the direct sum Σ h[j]·x[i−j] (then rescales to the input's
/// peak), and its low-pass removes a 6 kHz tone while keeping a 1 kHz tone.
#[test]
fn reverb_is_a_convolution_and_band_limit_removes_high_frequencies() {
    let x: Vec<f32> = (0..3000)
        .map(|i| ((i * 7919) % 101) as f32 / 100.0 - 0.5)
        .collect();
    let h = [1.0f32, 0.0, -0.3, 0.0, 0.0, 0.25, 0.1];
    let direct: Vec<f64> = (0..x.len())
        .map(|i| {
            (0..h.len())
                .filter(|j| *j <= i)
                .map(|j| h[j] as f64 * x[i - j] as f64)
                .sum()
        })
        .collect();
    let peak_in = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let peak_direct = direct.iter().fold(0f64, |m, v| m.max(v.abs()));
    let ours = augment::filter(&x, Some(&h), None);
    assert_eq!(ours.len(), x.len());
    for (i, (a, b)) in ours.iter().zip(&direct).enumerate() {
        let b = b * peak_in / peak_direct;
        assert!((*a as f64 - b).abs() < 1e-4, "sample {i}: {a} vs {b}");
    }

    let two: Vec<f32> = sine(1000.0, 8000)
        .iter()
        .zip(sine(6000.0, 8000))
        .map(|(a, b)| 0.5 * a + 0.5 * b)
        .collect();
    let low = augment::filter(&two, None, Some(4000.0));
    // Away from the edges (the FFT filter is circular over a zero-padded block).
    let middle = &low[1000..7000];
    let (kept, removed) = (amplitude(middle, 1000.0), amplitude(middle, 6000.0));
    assert!(
        removed < 1e-3 * kept,
        "6 kHz left: {removed} vs 1 kHz {kept}"
    );
}

/// Additive noise lands at the requested SNR (±0.01 dB), white or brown; 8-bit quantization
/// leaves at most 255 levels, with the error bound of each law.
#[test]
fn noise_snr_and_8bit_quantization() {
    use rand::SeedableRng;
    let x = sine(440.0, 16000);
    for brown in [false, true] {
        let mut y = x.clone();
        let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(1);
        augment::add_noise(&mut y, 10.0, brown, &mut rng);
        let signal: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum();
        let noise: f64 = y
            .iter()
            .zip(&x)
            .map(|(a, b)| ((a - b) as f64).powi(2))
            .sum();
        let snr = 10.0 * (signal / noise).log10();
        assert!((snr - 10.0).abs() < 0.01, "brown {brown}: SNR {snr} dB");
    }
    for mu_law in [false, true] {
        let mut y = x.clone();
        augment::quantize_8bit(&mut y, 0.5, mu_law);
        let mut levels: Vec<i64> = y.iter().map(|v| (*v as f64 * 1e6).round() as i64).collect();
        levels.sort();
        levels.dedup();
        assert!(levels.len() <= 255, "{} levels", levels.len());
        for (a, b) in y.iter().zip(&x) {
            let b = 0.5 * b;
            // Linear: half a step of 1/127. μ-law: half a step of the compressed value, whose
            // slope is at most ln(256)·(1 + 255·|x|)/255 per unit.
            let bound = if mu_law {
                0.5 / 127.0 * 256f32.ln() * (1.0 + 255.0 * b.abs()) / 255.0 * 1.05
            } else {
                0.5 / 127.0 + 1e-6
            };
            assert!((a - b).abs() <= bound, "mu_law {mu_law}: {a} vs {b}");
        }
    }
}

/// SpecAugment zeroes at most two bands of width ≤ n_mels/5 and one span of ≤ 25 frames per
/// second (≤ 20 % of the frames), and leaves every other value as it was.
#[test]
fn spec_augment_masks_bands_and_frames_only() {
    use rand::SeedableRng;
    let (frames, n_mels) = (300, 40);
    let data: Vec<f32> = (0..frames * n_mels).map(|i| 1.0 + (i % 7) as f32).collect();
    let set = AugmentSet::new(&[Augmentation::SpecAugment]);
    for seed in 0..20 {
        let mut features = Features {
            frames,
            n_mels,
            data: data.clone(),
        };
        let mut rng = rand::rngs::Xoshiro256PlusPlus::seed_from_u64(seed);
        set.spec_augment(&mut features, &mut rng);
        let zero = |t: usize, m: usize| features.data[t * n_mels + m] == 0.0;
        let masked_bands = (0..n_mels)
            .filter(|&m| (0..frames).all(|t| zero(t, m)))
            .count();
        let masked_frames = (0..frames)
            .filter(|&t| (0..n_mels).all(|m| zero(t, m)))
            .count();
        assert!(masked_bands <= 16, "seed {seed}: {masked_bands} bands");
        assert!(
            masked_frames <= 3 * 20,
            "seed {seed}: {masked_frames} frames"
        );
        for t in 0..frames {
            for m in 0..n_mels {
                let v = features.data[t * n_mels + m];
                assert!(
                    v == data[t * n_mels + m]
                        || (v == 0.0 && (masked_bands > 0 || masked_frames > 0)),
                    "seed {seed}: value at ({t}, {m}) changed to {v}"
                );
                if v == 0.0 {
                    let band = (0..frames).all(|t| zero(t, m));
                    let frame = (0..n_mels).all(|m| zero(t, m));
                    assert!(band || frame, "seed {seed}: stray zero at ({t}, {m})");
                }
            }
        }
    }
}

/// The augmenting batcher is reproducible from its seed, draws anew on every call, and keeps
/// the original features of an utterance that the augmentation would make too short for CTC.
#[test]
fn augmenting_batcher_is_seeded_and_keeps_ctc_feasible() {
    let log_mel = Arc::new(LogMel::new(LogMelConfig::new()));
    let audio = sine(300.0, 8000);
    let example = |targets: Vec<usize>| Example {
        id: "x".into(),
        features: Arc::new(log_mel.features(&audio)),
        targets,
        audio: Some(Arc::new(audio.clone())),
    };
    let all = AugmentSet::new(&Augmentation::ALL);
    let a = AugmentingBatcher::new(all.clone(), log_mel.clone(), 1, 7);
    let b = AugmentingBatcher::new(all.clone(), log_mel.clone(), 1, 7);
    let batch = vec![example(vec![1, 2, 3]); 4];
    let (first_a, first_b) = (a.augment(&batch), b.augment(&batch));
    for (x, y) in first_a.iter().zip(&first_b) {
        assert_eq!(
            x.features, y.features,
            "same seed, same call: same features"
        );
    }
    let second = a.augment(&batch);
    assert!(
        first_a
            .iter()
            .zip(&second)
            .any(|(x, y)| x.features != y.features),
        "a second call draws new augmentations"
    );
    // 49 frames; 48 distinct labels fit only without speed-up (1.1× leaves 44 frames).
    let frames = log_mel.n_frames(audio.len());
    let tight = example((1..frames).map(|i| 1 + i % 39).collect());
    let speed_only = AugmentingBatcher::new(
        AugmentSet::new(&[Augmentation::Speed]),
        log_mel.clone(),
        1,
        3,
    );
    for _ in 0..10 {
        for out in speed_only.augment(std::slice::from_ref(&tight)) {
            assert!(ctc_feasible(out.features.frames, &out.targets, 1));
        }
    }
}

/// `phonemize` (espeak-ng, then the fold into the model's inventory) against phones written
/// by hand for General American English: one word per vowel class and a phrase.
#[test]
fn phonemize_gives_hand_written_phones() {
    for (text, expected) in [
        ("cat", "k æ t"),
        ("sheep", "ʃ iː p"),
        ("two", "t uː"),
        ("thing", "θ ɪ ŋ"),
        ("boy", "b ɔɪ"),
        ("house", "h aʊ s"),
        ("go", "ɡ oʊ"),
        ("fish", "f ɪ ʃ"),
        ("zoo", "z uː"),
        ("red", "ɹ ɛ d"),
        ("bird", "b ɜ d"),
        ("the cat sat on the mat", "ð ə k æ t s æ t ɑ n ð ə m æ t"),
    ] {
        assert_eq!(
            phonemize(text, "en-us").unwrap().join(" "),
            expected,
            "{text:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// asr manifest

/// The normaliser spells numbers, ordinals, decimals, years and symbols, drops punctuation
/// and reports what it cannot speak.
#[test]
fn transcripts_are_normalized_for_labelling() {
    for (text, expected) in [
        ("Hello, World!", "hello world"),
        (
            "He paid 25 pounds & left.",
            "he paid twenty five pounds and left",
        ),
        (
            "the 3rd of May, 1999",
            "the third of may nineteen ninety nine",
        ),
        (
            "3.5 percent, or 7%",
            "three point five percent or seven percent",
        ),
        (
            "1,200 men — well-armed",
            "one thousand two hundred men well armed",
        ),
        ("don't “quote” me", "don't quote me"),
        ("'tis rock 'n' roll", "tis rock n roll"),
        ("Your D.N.A. and the C.I.A.!", "your d n a and the c i a"),
    ] {
        assert_eq!(normalize_text(text).unwrap(), expected, "{text:?}");
    }
    assert_eq!(
        normalize_text("a #tag costs 5€ or ½").unwrap_err(),
        vec!["5€".to_string(), "½".to_string()]
    );
    assert_eq!(normalize_text(" .. ").unwrap(), "");
}

fn synthesize_wav(text: &str, path: &Path) {
    let status = std::process::Command::new("espeak-ng")
        .args(["-v", "en-us", "-w"])
        .arg(path)
        .arg(text)
        .status()
        .expect("espeak-ng is installed (scripts/system-packages/main-job.txt)");
    assert!(status.success());
}

/// Writes `samples` (mono, 16 kHz) as a WAV file with `channels` identical channels at
/// `rate` Hz (nearest-sample rate change) and 16-bit or 8-bit unsigned PCM: the layouts of
/// phone and archive recordings.
fn write_wav(path: &Path, samples: &[f32], rate: u32, channels: u16, bits: u16) {
    let n = (samples.len() as u64 * rate as u64 / 16000) as usize;
    let mut data = Vec::new();
    for i in 0..n {
        let x = samples[(i as u64 * 16000 / rate as u64) as usize].clamp(-1.0, 1.0);
        for _ in 0..channels {
            if bits == 8 {
                data.push((x * 127.0 + 128.0).round() as u8);
            } else {
                data.extend_from_slice(&((x * 32767.0).round() as i16).to_le_bytes());
            }
        }
    }
    let block = channels as u32 * bits as u32 / 8;
    let mut out = Vec::new();
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes());
    out.extend_from_slice(&1u16.to_le_bytes());
    out.extend_from_slice(&channels.to_le_bytes());
    out.extend_from_slice(&rate.to_le_bytes());
    out.extend_from_slice(&(rate * block).to_le_bytes());
    out.extend_from_slice(&(block as u16).to_le_bytes());
    out.extend_from_slice(&bits.to_le_bytes());
    out.extend_from_slice(b"data");
    out.extend_from_slice(&(data.len() as u32).to_le_bytes());
    out.extend_from_slice(&data);
    std::fs::write(path, out).unwrap();
}

const SENTENCES: [&str; 3] = [
    "The 2 boats left at dawn.",
    "She sells sea shells!",
    "Go forward ten meters",
];

/// [`SENTENCES`] normalised for labelling and their phones in the standard inventory, written
/// by hand (General American; `ɔː` folds to `ɑ`, `ɚ` to `ɜ`, the flap of "meters" to `t`).
const LABELS: [(&str, &str); 3] = [
    (
        "the two boats left at dawn",
        "ð ə t uː b oʊ t s l ɛ f t æ t d ɑ n",
    ),
    ("she sells sea shells", "ʃ iː s ɛ l z s iː ʃ ɛ l z"),
    ("go forward ten meters", "ɡ oʊ f ɑ ɹ w ɜ d t ɛ n m iː t ɜ z"),
];

/// The three layouts, made from synthesized speech: a LibriSpeech tree (FLAC), a Kaldi data
/// directory (stereo 22.05 kHz WAV and 8-bit 11.025 kHz WAV, with utt2spk) and a TSV. Each
/// gives a manifest that `eval` reads and `train` trains on, with the normalised text and
/// phones written by hand ([`LABELS`]).
#[test]
fn manifests_from_librispeech_kaldi_and_tsv_layouts() {
    let _rng = process_rng();
    let dir = tempdir("import");
    let scratch = dir.join("scratch.wav");
    let speech: Vec<Vec<f32>> = SENTENCES
        .iter()
        .map(|s| {
            synthesize_wav(s, &scratch);
            load_audio(&scratch).unwrap()
        })
        .collect();
    // LibriSpeech: 19/198/19-198-000{0,1,2}.flac + 19-198.trans.txt.
    let chapter = dir.join("libri/19/198");
    std::fs::create_dir_all(&chapter).unwrap();
    let mut trans = String::new();
    for (i, (s, x)) in SENTENCES.iter().zip(&speech).enumerate() {
        write_flac(&chapter.join(format!("19-198-000{i}.flac")), x, 16000, 16).unwrap();
        trans.push_str(&format!("19-198-000{i} {}\n", s.to_uppercase()));
    }
    std::fs::write(chapter.join("19-198.trans.txt"), trans).unwrap();
    // Kaldi.
    let kaldi = dir.join("kaldi");
    std::fs::create_dir_all(kaldi.join("wav")).unwrap();
    let (mut scp, mut text, mut spk) = (String::new(), String::new(), String::new());
    for (i, (s, x)) in SENTENCES.iter().zip(&speech).enumerate() {
        let (rate, channels, bits) = if i % 2 == 0 {
            (22050, 2, 16)
        } else {
            (11025, 1, 8)
        };
        write_wav(
            &kaldi.join(format!("wav/u{i}.wav")),
            x,
            rate,
            channels,
            bits,
        );
        scp.push_str(&format!("u{i} wav/u{i}.wav\n"));
        text.push_str(&format!("u{i} {s}\n"));
        spk.push_str(&format!("u{i} speaker{}\n", i % 2));
    }
    std::fs::write(kaldi.join("wav.scp"), scp).unwrap();
    std::fs::write(kaldi.join("text"), text).unwrap();
    std::fs::write(kaldi.join("utt2spk"), spk).unwrap();
    // TSV.
    let tsv = dir.join("tsv");
    std::fs::create_dir_all(&tsv).unwrap();
    let mut lines = String::from("path\ttranscript\tspeaker\n");
    for (i, (s, x)) in SENTENCES.iter().zip(&speech).enumerate() {
        write_flac(&tsv.join(format!("t{i}.flac")), x, 16000, 16).unwrap();
        lines.push_str(&format!("t{i}.flac\t{s}\tme\n"));
    }
    std::fs::write(tsv.join("list.tsv"), lines).unwrap();

    let inventory = PhoneInventory::standard();
    let log_mel = LogMel::new(LogMelConfig::new());
    for (name, source) in [
        ("libri", Source::LibriSpeech(dir.join("libri"))),
        ("kaldi", Source::Kaldi(kaldi.clone())),
        ("tsv", Source::Tsv(tsv.join("list.tsv"))),
    ] {
        let out = dir.join(format!("corpus-{name}"));
        let report = import(&ImportOptions {
            source,
            out: out.clone(),
            split: "train".into(),
            accent: "en-us".into(),
            skip_bad: false,
        })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(report.utterances, 3, "{name}");
        let utterances = read_manifest(&out.join("train.jsonl"), &inventory, true).unwrap();
        for u in &utterances {
            let i = u.entry.id.chars().last().unwrap().to_digit(10).unwrap() as usize;
            let (text, phones) = LABELS[i];
            assert_eq!(u.entry.text, text, "{name}: {}", u.entry.id);
            assert_eq!(u.entry.phones, phones, "{name}: {}", u.entry.id);
            let seconds = u.entry.duration_s;
            let synthesized = speech[i].len() as f64 / 16000.0;
            assert!(
                (seconds - synthesized).abs() < 0.01,
                "{name}: {seconds} vs {synthesized} s"
            );
        }
        if name == "kaldi" {
            let voices: Vec<&str> = utterances.iter().map(|u| u.entry.voice.as_str()).collect();
            assert_eq!(voices, ["speaker0", "speaker1", "speaker0"]);
        }
        // What `eval` does, then one training epoch on it.
        let examples = load_split(&out.join("train.jsonl"), &inventory, &log_mel).unwrap();
        assert_eq!(examples.len(), 3);
        let saved = SavedModel {
            model: AsrModelConfig {
                n_outputs: inventory.n_outputs(),
                ..toy_config(AttentionKind::Full).with_n_mels(40)
            },
            features: LogMelConfig::new(),
            phones: inventory.phones().to_vec(),
        };
        let model = train(
            &saved,
            examples.clone(),
            examples.clone(),
            &TrainOptions {
                learning_rate: 1e-3,
                batch_frames: 2000,
                ..toy_options(out.join("run"))
            },
            &train_device(),
        )
        .unwrap();
        let per = evaluate(&model, &examples, None, 2000, &cpu());
        assert_eq!(
            per.reference_phones,
            examples.iter().map(|e| e.targets.len()).sum::<usize>()
        );
    }
}

/// Unreadable audio, a missing file, an empty transcript, a currency sign and a word in another
/// script (which espeak-ng would read as "Chinese letter") are all reported, each with its file and
/// line, in one error; with `skip_bad` the good utterance is written and the others are listed.
#[test]
fn manifest_problems_are_reported_with_file_and_line_all_at_once() {
    let dir = tempdir("import-bad");
    let chapter = dir.join("libri/7/1");
    std::fs::create_dir_all(&chapter).unwrap();
    synthesize_wav("good morning", &chapter.join("7-1-0.wav"));
    std::fs::write(chapter.join("7-1-1.flac"), b"fLaC garbage").unwrap();
    synthesize_wav("x", &chapter.join("7-1-3.wav"));
    synthesize_wav("x", &chapter.join("7-1-4.wav"));
    synthesize_wav("x", &chapter.join("7-1-5.wav"));
    std::fs::write(
        chapter.join("7-1.trans.txt"),
        "7-1-0 GOOD MORNING\n7-1-1 BROKEN AUDIO\n7-1-2 NO FILE\n7-1-3 ...\n7-1-4 PAY 5€ NOW\n7-1-5 SAY 你好\n",
    )
    .unwrap();
    let options = |skip_bad| ImportOptions {
        source: Source::LibriSpeech(dir.join("libri")),
        out: dir.join("corpus"),
        split: "test".into(),
        accent: "en-us".into(),
        skip_bad,
    };
    let message = import(&options(false)).unwrap_err().to_string();
    assert!(message.starts_with("5 problem(s)"), "{message}");
    let trans = chapter.join("7-1.trans.txt").display().to_string();
    for (line, needle) in [
        (2, "corrupt"),
        (3, "no audio file 7-1-2"),
        (4, "empty transcript"),
        (5, "\"5€\""),
        (6, "unspeakable word(s) [\"你好\"]"),
    ] {
        let at = format!("{trans}:{line}:");
        assert!(
            message
                .lines()
                .any(|l| l.starts_with(&at) && l.contains(needle)),
            "no `{needle}` at {at} in:\n{message}"
        );
    }
    assert!(
        !dir.join("corpus/test.jsonl").exists(),
        "nothing is written"
    );
    let report = import(&options(true)).unwrap();
    assert_eq!(report.utterances, 1);
    assert_eq!(report.skipped.len(), 5);
    let written = read_manifest(&report.manifest, &PhoneInventory::standard(), true).unwrap();
    assert_eq!(written[0].entry.text, "good morning");
}

/// A Kaldi directory whose `text` names an utterance that `wav.scp` does not list: the error
/// names the `text` line and the missing id; with `skip_bad` the listed utterance is written.
#[test]
fn kaldi_text_id_missing_from_wav_scp_is_reported() {
    let dir = tempdir("import-kaldi-missing");
    let kaldi = dir.join("kaldi");
    std::fs::create_dir_all(kaldi.join("wav")).unwrap();
    synthesize_wav("good morning", &kaldi.join("wav/a.wav"));
    std::fs::write(kaldi.join("wav.scp"), "a wav/a.wav\n").unwrap();
    std::fs::write(kaldi.join("text"), "a GOOD MORNING\nb GOOD NIGHT\n").unwrap();
    let options = |skip_bad| ImportOptions {
        source: Source::Kaldi(kaldi.clone()),
        out: dir.join("corpus"),
        split: "test".into(),
        accent: "en-us".into(),
        skip_bad,
    };
    let message = import(&options(false)).unwrap_err().to_string();
    let at = format!("{}:2:", kaldi.join("text").display());
    let needle = format!("\"b\" has no line in {}", kaldi.join("wav.scp").display());
    assert!(
        message
            .lines()
            .any(|l| l.starts_with(&at) && l.contains(&needle)),
        "no `{needle}` at {at} in:\n{message}"
    );
    let report = import(&options(true)).unwrap();
    assert_eq!((report.utterances, report.skipped.len()), (1, 1));
}
