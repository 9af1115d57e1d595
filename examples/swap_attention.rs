//! Swapping a pretrained encoder's attention without retraining: all-MiniLM-L6-v2 (loaded
//! through burn-store) embeds a long text with full, clustered and improved clustered
//! attention, and the embeddings are compared with full attention's.
//!
//! Needs the checkpoint: `bash scripts/get-minilm.sh` (into `data/minilm`). Run with
//! `cargo run --release -p text-encoder --example swap_attention` from the workspace root.

use std::path::Path;

use anyhow::Context;
use burn::tensor::{Device, Tensor};
use clustered_attention::AttentionKind;
use text_encoder::{WordPieceTokenizer, batch, load_pretrained};

fn main() -> anyhow::Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../data/minilm");
    let device = Device::flex();
    let model = load_pretrained(&dir, AttentionKind::Full, &device)
        .with_context(|| format!("{}: run `bash scripts/get-minilm.sh` first", dir.display()))?;
    let tokenizer = WordPieceTokenizer::from_file(&dir.join("tokenizer.json"))?;

    // A review of about 300 tokens: long enough for 25 clusters to group its queries.
    let text = [
        "The film opens slowly, with long shots of a grey harbour town and its fishermen.",
        "Its first hour is patient to a fault, and some viewers will drift away.",
        "Those who stay are rewarded: the performances deepen scene by scene,",
        "the score never tells us what to feel, and the photography finds beauty in rust.",
        "By the final act every small gesture carries the weight of the whole story.",
        "It is not an easy film, nor a perfect one, but it is honest and moving,",
        "and its quiet ending stayed with me for days after I left the cinema.",
    ]
    .join(" ")
    .repeat(3);
    let ids = tokenizer.encode(&text)?;
    anyhow::ensure!(ids.len() <= model.max_len(), "{} tokens", ids.len());
    let embed = |attention| {
        let (tokens, lengths) = batch(std::slice::from_ref(&ids), tokenizer.pad_id(), &device);
        model
            .clone()
            .with_attention(attention)
            .sentence_embeddings(tokens, lengths) // [1, 384], unit rows
    };
    let full = embed(AttentionKind::Full);
    println!(
        "{} tokens; cosine with full attention's embedding:",
        ids.len()
    );
    for attention in [
        AttentionKind::Clustered { clusters: 25 },
        AttentionKind::Improved {
            clusters: 25,
            topk: 32,
        },
    ] {
        let cosine: f32 = cosine(full.clone(), embed(attention));
        println!("  {attention:>14}: {cosine:.4}");
        assert!(cosine.is_finite() && cosine <= 1.0 + 1e-5, "{cosine}");
    }
    Ok(())
}

/// Cosine of two `[1, dim]` embeddings.
fn cosine(a: Tensor<2>, b: Tensor<2>) -> f32 {
    let dot: f32 = (a.clone() * b.clone()).sum().into_scalar();
    let norms: f32 = (a.powi_scalar(2).sum().sqrt() * b.powi_scalar(2).sum().sqrt()).into_scalar();
    dot / norms
}

/// `cargo test` runs the example.
#[cfg(test)]
#[test]
fn example_runs() {
    main().unwrap();
}
