//! The encoder against an independent numpy reference on the real all-MiniLM-L6-v2 weights
//! (skipped, with a `skipped:` line on stderr, when `bash scripts/get-minilm.sh` has not run,
//! unless `TEXT_ENCODER_REQUIRE_MINILM=1`, as `scripts/test.sh` sets), the checkpoint loader on
//! random checkpoints written here, the document joining and the probe; in `fuzz.rs`, the
//! checkpoint's readers under random mutations (this test binary's allocations are capped
//! there).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::tensor::Device;
use burn::tensor::Tensor;
use clustered_attention::AttentionKind;
use safetensors::{Dtype, tensor::TensorView};
use serde::Deserialize;
use text_encoder::data::{Snippet, join_documents, split_documents};
use text_encoder::probe::{LinearProbe, ProbeOptions};
use text_encoder::{
    HfBertConfig, LoadError, TextEncoder, TextEncoderConfig, WordPieceTokenizer, batch,
    load_pretrained, load_safetensors,
};

fn minilm_dir() -> Option<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/minilm");
    if dir.join("model.safetensors").exists() && dir.join("tokenizer.json").exists() {
        Some(dir)
    } else {
        let message = format!(
            "{} has no all-MiniLM-L6-v2 checkpoint; run `bash scripts/get-minilm.sh`",
            dir.display()
        );
        assert!(
            std::env::var("TEXT_ENCODER_REQUIRE_MINILM").as_deref() != Ok("1"),
            "{message}"
        );
        // Straight to the process's stderr, past libtest's capture of passing tests' output,
        // so that the skip shows in every run (scripts/test.sh lists these lines at its end).
        let test = std::thread::current().name().unwrap_or("?").to_string();
        let _ = writeln!(std::io::stderr(), "skipped: {test}: {message}");
        None
    }
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    embedding: Vec<f64>,
}

fn fixture() -> Fixture {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm_reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("fixture json")
}

/// NdArray's device: Burn 0.22 deprecates NdArray in favour of Flex; the tests keep comparing
/// the two.
#[allow(deprecated)]
fn ndarray() -> Device {
    Device::ndarray()
}

fn rows(tensor: Tensor<2>) -> Vec<Vec<f32>> {
    let [n, d] = tensor.dims();
    let values = tensor
        .into_data()
        .convert::<f32>()
        .try_to_vec::<f32>()
        .unwrap();
    (0..n)
        .map(|r| values[r * d..(r + 1) * d].to_vec())
        .collect()
}

/// Largest absolute error allowed in an embedding: 3.4× the largest measured, 1.46e-7 (on the
/// project's 2-core AMD EPYC, 2026-11-27, with every vector version of the host ops:
/// AVX-512, AVX2 and the baseline; full and improved attention, NdArray and Flex).
const TOLERANCE: f64 = 5e-7;

/// The numpy reference's embeddings, all sentences in one padded batch: max abs ≤
/// [`TOLERANCE`].
fn check_reference(device: Device, attention: AttentionKind) {
    let Some(dir) = minilm_dir() else { return };
    let tokenizer = WordPieceTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let model = load_pretrained(&dir, attention, &device).unwrap();
    let fixture = fixture();
    assert!(fixture.cases.len() >= 5);
    let mut inputs = Vec::new();
    for case in &fixture.cases {
        let ids = tokenizer.encode(&case.text).unwrap();
        assert_eq!(ids, case.ids, "token ids of {:?}", case.text);
        inputs.push(ids);
    }
    let (tokens, lengths) = batch(&inputs, tokenizer.pad_id(), &device);
    let embeddings = rows(model.sentence_embeddings(tokens, lengths));
    assert_eq!(embeddings.len(), fixture.cases.len());
    for (case, embedding) in fixture.cases.iter().zip(&embeddings) {
        assert_eq!(embedding.len(), case.embedding.len());
        let error = embedding
            .iter()
            .zip(&case.embedding)
            .map(|(&a, &b)| (a as f64 - b).abs())
            .fold(0.0, f64::max);
        assert!(
            error <= TOLERANCE,
            "{attention}: max abs error {error:e} on {:?}",
            case.text
        );
    }
}

#[test]
fn full_attention_matches_numpy_reference_on_flex() {
    check_reference(Device::flex(), AttentionKind::Full);
}

#[test]
fn full_attention_matches_numpy_reference_on_ndarray() {
    check_reference(ndarray(), AttentionKind::Full);
}

/// With `topk` at least the sequence length (the fixture's longest input has 187 tokens),
/// improved clustered attention recomputes every key exactly, so it must equal full attention
/// (the reference) whatever the clusters.
#[test]
fn improved_with_every_key_in_topk_matches_numpy_reference() {
    check_reference(
        Device::flex(),
        AttentionKind::Improved {
            clusters: 3,
            topk: 256,
        },
    );
}

/// A BERT checkpoint of random weights in the `transformers` layout, as `(name, shape, values)`.
fn random_checkpoint(config: &TextEncoderConfig) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let d = config.hidden_size;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        (
            "embeddings.word_embeddings.weight".into(),
            vec![config.vocab_size, d],
        ),
        (
            "embeddings.position_embeddings.weight".into(),
            vec![config.max_position_embeddings, d],
        ),
        (
            "embeddings.token_type_embeddings.weight".into(),
            vec![config.type_vocab_size, d],
        ),
        ("embeddings.LayerNorm.weight".into(), vec![d]),
        ("embeddings.LayerNorm.bias".into(), vec![d]),
        ("pooler.dense.weight".into(), vec![d, d]),
        ("pooler.dense.bias".into(), vec![d]),
    ];
    for i in 0..config.num_hidden_layers {
        let p = format!("encoder.layer.{i}.");
        for name in ["query", "key", "value"] {
            shapes.push((format!("{p}attention.self.{name}.weight"), vec![d, d]));
            shapes.push((format!("{p}attention.self.{name}.bias"), vec![d]));
        }
        shapes.push((format!("{p}attention.output.dense.weight"), vec![d, d]));
        shapes.push((format!("{p}attention.output.dense.bias"), vec![d]));
        shapes.push((format!("{p}attention.output.LayerNorm.weight"), vec![d]));
        shapes.push((format!("{p}attention.output.LayerNorm.bias"), vec![d]));
        let ff = config.intermediate_size;
        shapes.push((format!("{p}intermediate.dense.weight"), vec![ff, d]));
        shapes.push((format!("{p}intermediate.dense.bias"), vec![ff]));
        shapes.push((format!("{p}output.dense.weight"), vec![d, ff]));
        shapes.push((format!("{p}output.dense.bias"), vec![d]));
        shapes.push((format!("{p}output.LayerNorm.weight"), vec![d]));
        shapes.push((format!("{p}output.LayerNorm.bias"), vec![d]));
    }
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    shapes
        .into_iter()
        .map(|(name, shape)| {
            let values = (0..shape.iter().product::<usize>())
                .map(|_| {
                    state = state
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695_040_888_963_407);
                    ((state >> 40) as f32 / (1u64 << 24) as f32) - 0.5
                })
                .collect();
            (name, shape, values)
        })
        .collect()
}

fn write_checkpoint(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(name, shape, values)| {
            let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(name, shape, bytes)| {
            (
                name.clone(),
                TensorView::new(Dtype::F32, shape.clone(), bytes).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

fn tiny_config() -> TextEncoderConfig {
    TextEncoderConfig::new(50, 16, 2, 2, 24, 20, 2)
}

fn temp_file(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("text-encoder-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn values<const D: usize>(tensor: Tensor<D>) -> (Vec<usize>, Vec<f32>) {
    let data = tensor.into_data().convert::<f32>();
    (data.shape().to_vec(), data.try_to_vec::<f32>().unwrap())
}

fn transposed(shape: &[usize], values: &[f32]) -> (Vec<usize>, Vec<f32>) {
    let (rows, cols) = (shape[0], shape[1]);
    let mut out = vec![0.0; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    (vec![cols, rows], out)
}

/// Every parameter of the loaded encoder, by the checkpoint name it must come from, in the
/// checkpoint's layout (Linear weights `[out, in]`).
fn loaded_parameters(model: &TextEncoder) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let mut out = BTreeMap::new();
    let e = &model.embeddings;
    let mut put = |name: String, value: (Vec<usize>, Vec<f32>)| {
        out.insert(name, value);
    };
    put(
        "embeddings.word_embeddings.weight".into(),
        values(e.word_embeddings.weight.val()),
    );
    put(
        "embeddings.position_embeddings.weight".into(),
        values(e.position_embeddings.weight.val()),
    );
    put(
        "embeddings.token_type_embeddings.weight".into(),
        values(e.token_type_embeddings.weight.val()),
    );
    put(
        "embeddings.LayerNorm.weight".into(),
        values(e.layer_norm.gamma.val()),
    );
    put(
        "embeddings.LayerNorm.bias".into(),
        values(e.layer_norm.beta.as_ref().unwrap().val()),
    );
    for (i, layer) in model.encoder.layers.iter().enumerate() {
        let p = format!("encoder.layer.{i}.");
        let linears = [
            ("attention.self.query", &layer.mha.query),
            ("attention.self.key", &layer.mha.key),
            ("attention.self.value", &layer.mha.value),
            ("attention.output.dense", &layer.mha.output),
            ("intermediate.dense", &layer.pwff.linear_inner),
            ("output.dense", &layer.pwff.linear_outer),
        ];
        for (name, linear) in linears {
            let (shape, weight) = values(linear.weight.val());
            put(format!("{p}{name}.weight"), transposed(&shape, &weight));
            put(
                format!("{p}{name}.bias"),
                values(linear.bias.as_ref().unwrap().val()),
            );
        }
        for (name, norm) in [
            ("attention.output.LayerNorm", &layer.norm_1),
            ("output.LayerNorm", &layer.norm_2),
        ] {
            put(format!("{p}{name}.weight"), values(norm.gamma.val()));
            put(
                format!("{p}{name}.bias"),
                values(norm.beta.as_ref().unwrap().val()),
            );
        }
    }
    out
}

#[test]
fn random_checkpoint_round_trips_through_the_loader() {
    let config = tiny_config();
    let tensors = random_checkpoint(&config);
    let path = temp_file("round-trip.safetensors");
    write_checkpoint(&path, &tensors);
    let mut model = config.init(&ndarray());
    load_safetensors(&mut model, &path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let loaded = loaded_parameters(&model);
    let mut compared = 0;
    for (name, shape, expected) in &tensors {
        if name.starts_with("pooler.") {
            continue;
        }
        let (loaded_shape, loaded_values) = &loaded[name];
        assert_eq!(loaded_shape, shape, "shape of {name}");
        assert_eq!(loaded_values, expected, "values of {name}");
        compared += 1;
    }
    assert_eq!(
        compared,
        loaded.len(),
        "every parameter comes from the file"
    );
}

fn load_error(tensors: &[(String, Vec<usize>, Vec<f32>)], file: &str) -> String {
    let path = temp_file(file);
    write_checkpoint(&path, tensors);
    let mut model = tiny_config().init(&ndarray());
    let result = load_safetensors(&mut model, &path);
    std::fs::remove_file(&path).unwrap();
    match result {
        Err(error @ LoadError::Mismatch { .. }) => error.to_string(),
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

#[test]
fn missing_tensor_is_an_error_naming_it() {
    let all = random_checkpoint(&tiny_config());
    for (name, _, _) in all.iter().filter(|(n, _, _)| !n.starts_with("pooler.")) {
        let mut tensors = all.clone();
        tensors.retain(|(n, _, _)| n != name);
        let message = load_error(&tensors, "missing.safetensors");
        assert!(message.contains(&format!("missing: {name};")), "{message}");
    }
}

#[test]
fn misshapen_tensor_is_an_error_naming_it() {
    for name in [
        "encoder.layer.0.attention.self.key.weight",
        "encoder.layer.1.output.LayerNorm.bias",
    ] {
        let mut tensors = random_checkpoint(&tiny_config());
        let entry = tensors.iter_mut().find(|(n, _, _)| n == name).unwrap();
        let last = entry.1.len() - 1;
        entry.1[last] -= 1;
        entry.2.truncate(entry.1.iter().product());
        let message = load_error(&tensors, "misshapen.safetensors");
        assert!(
            message.contains("invalid: ") && message.contains(name),
            "{message}"
        );
    }
}

#[test]
fn unexpected_tensor_is_an_error_naming_it() {
    let config = tiny_config();
    let mut tensors = random_checkpoint(&config);
    let name = "encoder.layer.2.attention.self.query.weight";
    tensors.push((name.into(), vec![16, 16], vec![0.0; 256]));
    let message = load_error(&tensors, "unexpected.safetensors");
    assert!(
        message.contains("unused: ") && message.contains(name),
        "{message}"
    );
}

#[test]
fn config_with_another_activation_is_rejected() {
    let path = temp_file("config.json");
    let config = |model_type: &str, heads: usize, act: &str| {
        format!(
            r#"{{"model_type": "{model_type}", "vocab_size": 50, "hidden_size": 16,
                "num_hidden_layers": 2, "num_attention_heads": {heads}, "intermediate_size": 24,
                "max_position_embeddings": 20, "type_vocab_size": 2, "layer_norm_eps": 1e-12,
                "hidden_act": "{act}"}}"#
        )
    };
    std::fs::write(&path, config("bert", 2, "gelu")).unwrap();
    assert_eq!(HfBertConfig::read(&path).unwrap().num_attention_heads, 2);
    for (text, words) in [
        (config("bert", 2, "relu"), ["hidden_act", "relu"]),
        (config("roberta", 2, "gelu"), ["model_type", "roberta"]),
        (config("bert", 3, "gelu"), ["num_attention_heads", "3"]),
    ] {
        std::fs::write(&path, text).unwrap();
        let message = HfBertConfig::read(&path).unwrap_err().to_string();
        assert!(
            message.contains(words[0]) && message.contains(words[1]),
            "{message}"
        );
    }
    std::fs::remove_file(&path).unwrap();
}

fn snippet(id: u32, rating: f64) -> Snippet {
    Snippet {
        id,
        rating,
        text: String::new(),
    }
}

#[test]
fn documents_join_consecutive_sentences_of_one_label() {
    // Ratings (+, +, +, −, −, 0, −, −, −) with 3, 2, 4, 5, 1, 2, 2, 2, 2 word pieces; documents of 5.
    let snippets: Vec<Snippet> = [1.0, 0.5, 2.0, -1.0, -0.2, 0.0, -3.0, -1.0, -1.5]
        .iter()
        .enumerate()
        .map(|(i, &r)| snippet(i as u32 + 1, r))
        .collect();
    let lengths = [3, 2, 4, 5, 1, 2, 2, 2, 2];
    let words: Vec<Vec<u32>> = lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| (0..n).map(|j| (100 * (i + 1) + j) as u32).collect())
        .collect();
    let documents = join_documents(&snippets, &words, 5);
    let summary: Vec<(u32, usize, bool, Vec<u32>)> = documents
        .iter()
        .map(|d| (d.first_id, d.sentences, d.positive, d.words.clone()))
        .collect();
    assert_eq!(
        summary,
        vec![
            // Sentences 1 and 2 fill 5 exactly.
            (1, 2, true, vec![100, 101, 102, 200, 201]),
            // Sentence 3 alone (4 pieces) is cut short by the negative sentence 4: dropped.
            (4, 1, false, vec![400, 401, 402, 403, 404]),
            // Sentence 5 is cut short by the 0-rated sentence 6; 7, 8, 9 fill 5 (the last cut).
            (7, 3, false, vec![700, 701, 800, 801, 900]),
        ]
    );
    let (train, test) = split_documents(documents);
    assert_eq!(train.iter().map(|d| d.first_id).collect::<Vec<_>>(), [1, 4]);
    assert_eq!(test.iter().map(|d| d.first_id).collect::<Vec<_>>(), [7]);
}

#[test]
fn probe_separates_linearly_separable_labels() {
    // Labels from a known hyperplane with a margin; the probe must classify held-out points
    // (distinct pseudo-random points, features on different scales).
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut uniform = move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    let score = |x: &[f32]| x[0] - 0.5 * x[2] + 0.25 * x[5];
    let label = |x: &[f32]| score(x) > 0.0;
    let points: Vec<Vec<f32>> = (0..600)
        .map(|_| {
            (0..6)
                .map(|j| uniform() * (j as f32 + 1.0))
                .collect::<Vec<f32>>()
        })
        .filter(|x| score(x).abs() > 0.05)
        .collect();
    let (train, test) = points.split_at(points.len() * 2 / 3);
    let train_labels: Vec<bool> = train.iter().map(|x| label(x)).collect();
    let test_labels: Vec<bool> = test.iter().map(|x| label(x)).collect();
    let probe = LinearProbe::fit(
        train,
        &train_labels,
        ProbeOptions {
            steps: 400,
            learning_rate: 0.05,
            weight_decay: 0.0,
            seed: 0,
        },
        &ndarray(),
    );
    assert_eq!(probe.accuracy(test, &test_labels), 1.0);
}

#[path = "fuzz.rs"]
mod fuzz;
