//! Learning a dependency between tokens far apart, with burn-nn's encoder and with this crate's.
//!
//! The task: a sequence of `--length` tokens opens with a symbol (one of `--symbols`), then
//! filler, then `--window` symbols; the label says whether the opening symbol recurs among
//! those last ones (half the sequences, at a random place of the window; the other window
//! symbols are drawn from the other symbols). Nothing but attention carries the opening
//! symbol to the end, `length − window` positions away.
//!
//! The model: symbol and segment (opening, filler, window) embeddings, an encoder, the maximum
//! over positions, a linear layer to two logits; cross-entropy, Adam. Each encoder of
//! `--encoders` (`burn-nn` for burn-nn's `TransformerEncoder`, or an attention of this crate
//! for `ClusteredTransformerEncoder`: `full`, `clustered:C`, `improved:C:K`) is trained from
//! scratch on the same sequences for `--steps` steps, then scored on `--held-out` sequences of
//! another seed. Prints each one's held-out accuracy and its wall times.
//!
//! Run with `cargo run --release -p clustered-attention --example long_range_recall`
//! (`-- --help` for the options).

use std::time::Instant;

use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoder, ClusteredTransformerEncoderConfig,
    ClusteredTransformerEncoderInput,
};
use rand::rngs::Xoshiro256PlusPlus;
use rand::{RngExt, SeedableRng};

/// Segments: the opening symbol, the filler, the window.
const SEGMENTS: usize = 3;

#[derive(Parser, Debug)]
#[command(about = "Whether the opening symbol recurs at the end: burn-nn's encoder and ours")]
struct Args {
    /// Tokens per sequence.
    #[arg(long, default_value_t = 4096)]
    length: usize,
    /// Symbols at the end, among which the opening one recurs or not.
    #[arg(long, default_value_t = 4)]
    window: usize,
    /// Distinct symbols.
    #[arg(long, default_value_t = 4)]
    symbols: usize,
    /// Training steps.
    #[arg(long, default_value_t = 600)]
    steps: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Held-out sequences scored after training.
    #[arg(long, default_value_t = 256)]
    held_out: usize,
    /// Encoder layers.
    #[arg(long, default_value_t = 1)]
    layers: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 2)]
    heads: usize,
    /// Model width.
    #[arg(long, default_value_t = 64)]
    d_model: usize,
    /// Dropout of the encoders.
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// Adam's learning rate.
    #[arg(long, default_value_t = 1e-3)]
    learning_rate: f64,
    /// The encoders, in order: `burn-nn`, or an attention kind of this crate.
    #[arg(long, value_delimiter = ',', default_value = "improved:100:32,burn-nn")]
    encoders: Vec<String>,
    /// Seed of the training sequences and the weights (the held-out ones take the next).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Layers of this crate's encoders recomputed in the backward pass
    /// (`ClusteredTransformerEncoderConfig::recompute_layers`; at most `--layers`).
    #[arg(long, default_value_t = 0)]
    recompute_layers: usize,
}

#[derive(Module, Debug)]
enum Encoder {
    BurnNn(TransformerEncoder),
    Clustered(ClusteredTransformerEncoder),
}

#[derive(Module, Debug)]
struct Classifier {
    symbols: Embedding,
    segments: Embedding,
    encoder: Encoder,
    head: Linear,
}

impl Classifier {
    fn new(args: &Args, encoder: &str, device: &Device) -> Self {
        let d_ff = 2 * args.d_model;
        let encoder = match encoder {
            "burn-nn" => Encoder::BurnNn(
                TransformerEncoderConfig::new(args.d_model, d_ff, args.heads, args.layers)
                    .with_dropout(args.dropout)
                    .init(device),
            ),
            kind => {
                let kind: AttentionKind = kind
                    .parse()
                    .unwrap_or_else(|e| panic!("--encoders: {kind:?} is neither burn-nn nor {e}"));
                Encoder::Clustered(
                    ClusteredTransformerEncoderConfig::new(
                        args.d_model,
                        d_ff,
                        args.heads,
                        args.layers,
                        kind,
                    )
                    .with_dropout(args.dropout)
                    .with_recompute_layers(args.recompute_layers)
                    .init(device),
                )
            }
        };
        Self {
            // The symbols and one filler token.
            symbols: EmbeddingConfig::new(args.symbols + 1, args.d_model).init(device),
            segments: EmbeddingConfig::new(SEGMENTS, args.d_model).init(device),
            encoder,
            head: LinearConfig::new(args.d_model, 2).init(device),
        }
    }

    /// Logits `[batch, 2]` of symbols and segments `[batch, L]`.
    fn forward(&self, symbols: Tensor<2, Int>, segments: Tensor<2, Int>) -> Tensor<2> {
        let x = self.symbols.forward(symbols) + self.segments.forward(segments);
        let h = match &self.encoder {
            Encoder::BurnNn(e) => e.forward(TransformerEncoderInput::new(x)),
            Encoder::Clustered(e) => e.forward(ClusteredTransformerEncoderInput::new(x)),
        };
        self.head.forward(h.max_dim(1).squeeze_dim::<2>(1))
    }
}

/// `n` sequences: symbols and segments `[n, L]`, labels `[n]` (1: the opening symbol recurs).
fn sequences(
    args: &Args,
    n: usize,
    rng: &mut Xoshiro256PlusPlus,
    device: &Device,
) -> (Tensor<2, Int>, Tensor<2, Int>, Tensor<1, Int>) {
    let (len, window, filler) = (args.length, args.window, args.symbols as i64);
    let mut symbols = Vec::with_capacity(n * len);
    let mut segments = Vec::with_capacity(n * len);
    let mut labels = Vec::with_capacity(n);
    for _ in 0..n {
        let opening = rng.random_range(0..args.symbols) as i64;
        let mut end: Vec<i64> = (0..window)
            .map(|_| {
                // Uniform over the other symbols.
                let s = rng.random_range(0..args.symbols - 1) as i64;
                if s >= opening { s + 1 } else { s }
            })
            .collect();
        let recurs = rng.random_bool(0.5);
        if recurs {
            end[rng.random_range(0..window)] = opening;
        }
        symbols.push(opening);
        segments.push(0);
        symbols.extend(std::iter::repeat_n(filler, len - 1 - window));
        segments.extend(std::iter::repeat_n(1, len - 1 - window));
        symbols.extend(end);
        segments.extend(std::iter::repeat_n(2, window));
        labels.push(recurs as i64);
    }
    (
        Tensor::from_data(TensorData::new(symbols, [n, len]), device),
        Tensor::from_data(TensorData::new(segments, [n, len]), device),
        Tensor::from_data(TensorData::new(labels, [n]), device),
    )
}

/// How many rows of `logits` `[n, 2]` have their larger logit at `labels` `[n]`.
fn correct(logits: Tensor<2>, labels: Tensor<1, Int>) -> usize {
    let predicted = logits.argmax(1).squeeze_dim::<1>(1);
    predicted.equal(labels).int().sum().into_scalar::<i64>() as usize
}

fn main() {
    let args = Args::parse();
    assert!(
        args.symbols >= 2
            && args.window >= 1
            && args.length >= args.window + 2
            && args.batch >= 1
            && args.held_out >= 1,
        "need at least 2 symbols, a window of 1, a length over window + 1, a batch of 1 and 1 \
         held-out sequence, got {args:?}"
    );
    let device = Device::flex().autodiff();
    println!("{args:?}");
    let mut results = Vec::new();
    for name in &args.encoders {
        device.seed(args.seed);
        let mut model = Classifier::new(&args, name, &device);
        let mut optimizer = AdamConfig::new().init();
        let loss_fn = CrossEntropyLossConfig::new().init(&device);
        let mut train = Xoshiro256PlusPlus::seed_from_u64(args.seed);
        let start = Instant::now();
        let (mut seen, mut right, mut loss_sum) = (0, 0, 0.0);
        for step in 1..=args.steps {
            let (symbols, segments, labels) = sequences(&args, args.batch, &mut train, &device);
            let logits = model.forward(symbols, segments);
            right += correct(logits.clone(), labels.clone());
            seen += args.batch;
            let loss = loss_fn.forward(logits, labels);
            loss_sum += loss.clone().into_scalar::<f32>() as f64;
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optimizer.step(args.learning_rate, model, grads);
            if step % 25 == 0 || step == args.steps {
                println!(
                    "{name}: step {step}, loss {:.4}, training accuracy {:.3} (last {} steps), {:.0} s",
                    loss_sum / (seen / args.batch) as f64,
                    right as f64 / seen as f64,
                    seen / args.batch,
                    start.elapsed().as_secs_f64()
                );
                (seen, right, loss_sum) = (0, 0, 0.0);
            }
        }
        let train_s = start.elapsed().as_secs_f64();

        // Scored without autodiff (and so without dropout), as burn-nn's `Module::valid`.
        let start = Instant::now();
        let trained = model.valid();
        let mut held_out = Xoshiro256PlusPlus::seed_from_u64(args.seed + 1);
        let mut right = 0;
        let mut left = args.held_out;
        while left > 0 {
            let n = left.min(args.batch);
            let (symbols, segments, labels) = sequences(&args, n, &mut held_out, &device);
            right += correct(
                trained.forward(symbols.inner(), segments.inner()),
                labels.inner(),
            );
            left -= n;
        }
        let accuracy = right as f64 / args.held_out as f64;
        let eval_s = start.elapsed().as_secs_f64();
        println!(
            "{name}: held-out accuracy {accuracy:.3} ({right} of {}), training {train_s:.0} s, \
             scoring {eval_s:.0} s",
            args.held_out
        );
        results.push((name.clone(), accuracy, train_s, eval_s));
    }
    println!(
        "\n| encoder | held-out accuracy | training (s) | scoring (s) |\n|---|---:|---:|---:|"
    );
    for (name, accuracy, train_s, eval_s) in results {
        println!("| {name} | {accuracy:.3} | {train_s:.0} | {eval_s:.0} |");
    }
}
