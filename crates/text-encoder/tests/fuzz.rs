//! Fuzzing of the checkpoint's readers: `config.json` and `model.safetensors` (read together by
//! `load_pretrained`) and `tokenizer.json` (`WordPieceTokenizer::from_file`, then a text
//! encoded), each mutated at random ([`fuzz_harness`]) from a tiny checkpoint written here. A
//! target passes when every input loads or gives an error within the deadline, without a panic
//! and without an allocation over [`fuzz_harness::ALLOCATION_CAP`] (this test binary's global
//! allocator refuses one, which aborts the process).
//!
//! `FUZZ_CASES` sets the inputs per target (default 300, as CI runs them) and `FUZZ_SEED` the
//! generator's seed (default 0). A module of `encoder.rs`, whose checkpoint writer it uses.

use std::path::{Path, PathBuf};

use clustered_attention::AttentionKind;
use fuzz_harness::CappedAllocator;
use text_encoder::{WordPieceTokenizer, load_pretrained};

use super::{random_checkpoint, tiny_config, write_checkpoint};

#[global_allocator]
static ALLOCATOR: CappedAllocator = CappedAllocator;

/// [`tiny_config`] as a Hugging Face `config.json`.
fn tiny_config_json() -> String {
    let c = tiny_config();
    serde_json::json!({
        "model_type": "bert",
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "max_position_embeddings": c.max_position_embeddings,
        "type_vocab_size": c.type_vocab_size,
        "layer_norm_eps": 1e-12,
        "hidden_act": "gelu",
        "position_embedding_type": "absolute",
    })
    .to_string()
}

/// A WordPiece `tokenizer.json` in the layout of all-MiniLM-L6-v2's, with a vocabulary of 7
/// tokens: the four special ones, `the`, `cat` and `##s`.
fn tiny_tokenizer_json() -> String {
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "special": true, "content": content, "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false})
    };
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(0, "[PAD]"), special(1, "[UNK]"), special(2, "[CLS]"),
            special(3, "[SEP]")],
        "normalizer": {"type": "BertNormalizer", "clean_text": true,
            "handle_chinese_chars": true, "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
            "max_input_chars_per_word": 100,
            "vocab": {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "the": 4, "cat": 5,
                "##s": 6}},
    })
    .to_string()
}

/// A checkpoint directory of [`tiny_config`] with random weights, its `config.json` and the
/// tiny tokenizer, one per target `name`; the seeds load (checked here, so that the targets
/// start from valid files).
fn checkpoint_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("text-encoder-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_checkpoint(
        &dir.join("model.safetensors"),
        &random_checkpoint(&tiny_config()),
    );
    std::fs::write(dir.join("config.json"), tiny_config_json()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tiny_tokenizer_json()).unwrap();
    load_pretrained(&dir, AttentionKind::Full, &super::ndarray()).unwrap();
    let tokenizer = WordPieceTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(tokenizer.encode_words("The cats").unwrap(), [4, 5, 6]);
    dir
}

/// Runs target `name` on mutations of the checkpoint's file `file`, each written into a copy
/// of the checkpoint directory and read by `read`.
fn fuzz_file(name: &'static str, file: &'static str, read: fn(&Path)) {
    let seed_dir = checkpoint_dir(name);
    let seed = std::fs::read(seed_dir.join(file)).unwrap();
    fuzz_harness::fuzz(name, &std::env::temp_dir(), vec![seed], move |bytes| {
        let dir = seed_dir.join(format!("{name}-{:?}", std::thread::current().id()));
        std::fs::create_dir_all(&dir).unwrap();
        for other in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::fs::copy(seed_dir.join(other), dir.join(other)).unwrap();
        }
        std::fs::write(dir.join(file), bytes).unwrap();
        read(&dir);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Reads the checkpoint as `text-encoder` does before embedding.
fn load(dir: &Path) {
    let _ = load_pretrained(dir, AttentionKind::Full, &super::ndarray());
}

/// Mutations of `config.json` (the sizes, the layer count, the settings checked).
#[test]
fn fuzz_checkpoint_config() {
    fuzz_file("config.json", "config.json", load);
}

/// Mutations of `model.safetensors` (its header, then the tensors' bytes).
#[test]
fn fuzz_checkpoint_weights() {
    fuzz_file("model.safetensors", "model.safetensors", load);
}

/// Mutations of `tokenizer.json`, each read and then used on a text.
#[test]
fn fuzz_tokenizer() {
    fuzz_file("tokenizer.json", "tokenizer.json", |dir| {
        if let Ok(tokenizer) = WordPieceTokenizer::from_file(&dir.join("tokenizer.json")) {
            let _ = tokenizer.encode("The cats sat on the mat.");
        }
    });
}

/// A tokenizer is checked against the checkpoint it is used with: the tiny tokenizer's ids
/// (`0..7`) fit the tiny checkpoint's 50 word embeddings, and are refused by an encoder of 6,
/// naming both sizes.
#[test]
fn tokenizer_beyond_the_word_embeddings_is_refused() {
    let dir = checkpoint_dir("vocabulary");
    let model = load_pretrained(&dir, AttentionKind::Full, &super::ndarray()).unwrap();
    let tokenizer = WordPieceTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(model.vocab_size(), 50);
    assert_eq!(tokenizer.vocab_size(), 7);
    tokenizer.check_fits(model.vocab_size()).unwrap();
    let error = tokenizer.check_fits(6).unwrap_err().to_string();
    assert!(
        error.contains("up to 6") && error.contains("6 word embeddings"),
        "{error}"
    );
}

/// A `config.json` asking for more layers than the checkpoint has tensors is refused before
/// any layer is built (a trillion layers would otherwise be allocated first).
#[test]
fn config_with_more_layers_than_tensors_is_refused() {
    let dir = checkpoint_dir("layers");
    let mut config: serde_json::Value = serde_json::from_str(&tiny_config_json()).unwrap();
    config["num_hidden_layers"] = 1_000_000_000_000u64.into();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let error = load_pretrained(&dir, AttentionKind::Full, &super::ndarray())
        .expect_err("refused")
        .to_string();
    assert!(
        error.contains("num_hidden_layers is 1000000000000, more than the"),
        "{error}"
    );
}

/// The input class that the target `tokenizer.json` found (`FUZZ_SEED=0`, within 300
/// inputs): a file cut right after `"decoder":`, as by an interrupted download, made
/// `tokenizers` panic while reading its decoder. It is an error naming the file.
#[test]
fn tokenizer_cut_inside_its_decoder_is_an_error() {
    let dir = checkpoint_dir("cut-tokenizer");
    let text = tiny_tokenizer_json();
    let cut = text.find("\"decoder\":").unwrap() + "\"decoder\":".len();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, &text[..cut]).unwrap();
    let error = WordPieceTokenizer::from_file(&path)
        .expect_err("refused")
        .to_string();
    assert!(error.contains("tokenizer.json"), "{error}");
}
