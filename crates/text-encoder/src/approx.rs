//! Approximating the pretrained encoder with clustered attention, without retraining: the
//! analogue of the paper's Table 4 (§4.3, RoBERTa on GLUE) with all-MiniLM-L6-v2 on long
//! Rotten Tomatoes documents.

use std::fmt::Write as _;
use std::time::Instant;

use anyhow::bail;
use burn::tensor::Device;
use clustered_attention::AttentionKind;
use serde::Serialize;

use crate::data::{Document, Snippet, join_documents, split_documents};
use crate::model::TextEncoder;
use crate::probe::{LinearProbe, ProbeOptions};
use crate::tokenize::{WordPieceTokenizer, batch};

/// Settings of [`approximate`].
#[derive(Debug, Clone)]
pub struct ApproxOptions {
    /// Input lengths in tokens, `[CLS]` and `[SEP]` included.
    pub lengths: Vec<usize>,
    /// Cluster counts `C` of clustered and improved clustered attention.
    pub clusters: Vec<usize>,
    /// Keys recomputed exactly per cluster by improved clustered attention, and kept per query
    /// by oracle-top.
    pub topk: usize,
    /// Also evaluate oracle-top (each query's `topk` best keys; `O(L·S)`).
    pub oracle: bool,
    /// Documents per forward pass.
    pub batch_size: usize,
    /// At most this many documents per length (evenly spaced through the file), `None` for all.
    pub max_documents: Option<usize>,
    /// Timed forward passes per attention (median reported) at the longest length, after one
    /// untimed pass.
    pub timing_repeats: usize,
    /// The probe's training.
    pub probe: ProbeOptions,
}

/// One attention at one length.
#[derive(Debug, Clone, Serialize)]
pub struct ApproxRow {
    /// Input length in tokens.
    pub length: usize,
    /// The attention (`full`, `clustered:C`, `improved:C:K`, `oracle:K`).
    pub attention: String,
    /// Documents the probe was trained on (full attention).
    pub train_documents: usize,
    /// Documents evaluated.
    pub test_documents: usize,
    /// Mean cosine between this attention's and full attention's embedding of a test document.
    pub mean_cosine: f64,
    /// Lowest such cosine.
    pub min_cosine: f64,
    /// Probe accuracy on this attention's embeddings of the test documents.
    pub accuracy: f64,
    /// Median milliseconds to embed one batch of `batch_size` test documents (fewer if there
    /// are fewer), tokens to embeddings on the host: batching, forward pass, pooling and
    /// read-back (longest length only).
    pub ms_per_batch: Option<f64>,
}

/// The attentions compared: full, then clustered-C and improved-C for each `C`, then
/// oracle-top.
pub fn attentions(options: &ApproxOptions) -> Vec<AttentionKind> {
    let mut kinds = vec![AttentionKind::Full];
    kinds.extend(
        options
            .clusters
            .iter()
            .map(|&clusters| AttentionKind::Clustered { clusters }),
    );
    kinds.extend(
        options
            .clusters
            .iter()
            .map(|&clusters| AttentionKind::Improved {
                clusters,
                topk: options.topk,
            }),
    );
    if options.oracle {
        kinds.push(AttentionKind::OracleTop { topk: options.topk });
    }
    kinds
}

/// Embeds `documents` cut to `length` tokens, `batch_size` at a time.
pub fn embed_documents(
    model: &TextEncoder,
    tokenizer: &WordPieceTokenizer,
    documents: &[Document],
    length: usize,
    batch_size: usize,
    device: &Device,
) -> Vec<Vec<f32>> {
    let mut embeddings = Vec::with_capacity(documents.len());
    for chunk in documents.chunks(batch_size.max(1)) {
        let inputs: Vec<Vec<u32>> = chunk
            .iter()
            .map(|document| tokenizer.wrap(&document.words, length))
            .collect();
        let (tokens, lengths) = batch(&inputs, tokenizer.pad_id(), device);
        let output = model.sentence_embeddings(tokens, lengths);
        let [rows, d] = output.dims();
        let values = output
            .into_data()
            .convert::<f32>()
            .try_to_vec::<f32>()
            .expect("f32 embeddings");
        embeddings.extend((0..rows).map(|r| values[r * d..(r + 1) * d].to_vec()));
    }
    embeddings
}

fn evenly_spaced(documents: Vec<Document>, max: Option<usize>) -> Vec<Document> {
    match max {
        Some(max) if documents.len() > max => {
            let n = documents.len();
            (0..max).map(|i| documents[i * n / max].clone()).collect()
        }
        _ => documents,
    }
}

/// Runs the experiment: for each length, documents of exactly that many tokens
/// ([`join_documents`]), split 2:1 ([`split_documents`]); a [`LinearProbe`] trained on full
/// attention's embeddings of the training documents; then, for each attention, the cosine of
/// its test embeddings with full attention's and the probe's accuracy on them. At the longest
/// length, the forward time of one batch per attention.
///
/// The encoder runs on `device`, the probe trains on it with autodiff. Progress goes to
/// stderr.
///
/// # Errors
/// If a text cannot be tokenized, a length exceeds the model's [`TextEncoder::max_len`] or is
/// below 3, a length has no training or test document, or a cluster count or `topk` is 0.
pub fn approximate(
    model: &TextEncoder,
    tokenizer: &WordPieceTokenizer,
    snippets: &[Snippet],
    options: &ApproxOptions,
    device: &Device,
) -> anyhow::Result<Vec<ApproxRow>> {
    let words = snippets
        .iter()
        .map(|snippet| tokenizer.encode_words(&snippet.text))
        .collect::<Result<Vec<_>, _>>()?;
    if options.clusters.contains(&0) || options.topk == 0 || options.batch_size == 0 {
        bail!(
            "cluster counts {:?}, topk {} and batch size {} must be at least 1",
            options.clusters,
            options.topk,
            options.batch_size
        );
    }
    let kinds = attentions(options);
    let longest = options.lengths.iter().copied().max().unwrap_or(0);
    let mut rows = Vec::new();
    for &length in &options.lengths {
        if !(3..=model.max_len()).contains(&length) {
            bail!("length {length} must be in 3..={}", model.max_len());
        }
        let documents = join_documents(snippets, &words, length - 2);
        let (train, test) = split_documents(evenly_spaced(documents, options.max_documents));
        if train.is_empty() || test.is_empty() {
            bail!(
                "length {length}: {} training and {} test documents; the probe needs both",
                train.len(),
                test.len()
            );
        }
        let train_labels: Vec<bool> = train.iter().map(|d| d.positive).collect();
        let test_labels: Vec<bool> = test.iter().map(|d| d.positive).collect();
        eprintln!(
            "length {length}: {} train / {} test documents",
            train.len(),
            test.len()
        );
        let full = model.clone().with_attention(AttentionKind::Full);
        let train_full =
            embed_documents(&full, tokenizer, &train, length, options.batch_size, device);
        let probe = LinearProbe::fit(&train_full, &train_labels, options.probe, device);
        let mut test_full = Vec::new();
        for &kind in &kinds {
            let encoder = model.clone().with_attention(kind);
            let start = Instant::now();
            let embeddings = embed_documents(
                &encoder,
                tokenizer,
                &test,
                length,
                options.batch_size,
                device,
            );
            if kind == AttentionKind::Full {
                test_full = embeddings.clone();
            }
            let cosines: Vec<f64> = embeddings
                .iter()
                .zip(&test_full)
                .map(|(a, b)| a.iter().zip(b).map(|(x, y)| (x * y) as f64).sum())
                .collect();
            let row = ApproxRow {
                length,
                attention: kind.to_string(),
                train_documents: train.len(),
                test_documents: test.len(),
                mean_cosine: cosines.iter().sum::<f64>() / cosines.len() as f64,
                min_cosine: cosines.iter().copied().fold(f64::INFINITY, f64::min),
                accuracy: probe.accuracy(&embeddings, &test_labels),
                ms_per_batch: (length == longest)
                    .then(|| time_batch(&encoder, tokenizer, &test, length, options, device)),
            };
            eprintln!(
                "  {:<16} cosine {:.4}  accuracy {:.2} %  ({:.1} s)",
                row.attention,
                row.mean_cosine,
                100.0 * row.accuracy,
                start.elapsed().as_secs_f64()
            );
            rows.push(row);
        }
    }
    Ok(rows)
}

fn time_batch(
    model: &TextEncoder,
    tokenizer: &WordPieceTokenizer,
    documents: &[Document],
    length: usize,
    options: &ApproxOptions,
    device: &Device,
) -> f64 {
    let documents = &documents[..options.batch_size.min(documents.len())];
    let mut times = Vec::new();
    for repeat in 0..=options.timing_repeats {
        let start = Instant::now();
        embed_documents(model, tokenizer, documents, length, documents.len(), device);
        if repeat > 0 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The rows as a markdown table: one line per attention, for each length the mean cosine with
/// full attention and the probe's accuracy (%), then the time per batch at the longest length.
pub fn markdown(rows: &[ApproxRow], batch_size: usize) -> String {
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.length).collect();
    lengths.dedup();
    let mut attentions: Vec<&str> = Vec::new();
    for row in rows {
        if !attentions.contains(&row.attention.as_str()) {
            attentions.push(&row.attention);
        }
    }
    let mut out = String::from("| attention |");
    for length in &lengths {
        let _ = write!(out, " cos {length} | acc % {length} |");
    }
    let longest = lengths.iter().max().copied().unwrap_or(0);
    let _ = writeln!(out, " ms / batch of {batch_size} at {longest} |");
    out.push_str("|---|");
    out.push_str(&"---:|---:|".repeat(lengths.len()));
    out.push_str("---:|\n");
    for attention in attentions {
        let _ = write!(out, "| {attention} |");
        let mut time = None;
        for length in &lengths {
            match rows
                .iter()
                .find(|r| r.length == *length && r.attention == attention)
            {
                Some(row) => {
                    let _ = write!(
                        out,
                        " {:.4} | {:.2} |",
                        row.mean_cosine,
                        100.0 * row.accuracy
                    );
                    time = time.or(row.ms_per_batch);
                }
                None => out.push_str(" – | – |"),
            }
        }
        match time {
            Some(ms) => {
                let _ = writeln!(out, " {ms:.0} |");
            }
            None => out.push_str(" – |\n"),
        }
    }
    out
}
