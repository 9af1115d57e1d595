//! `asr step-time`: the time of a training step (forward + backward + Adam) of the default
//! model on random features, per attention, with the model's forward pass and the CTC loss
//! (its forward) timed apart. The dropout masks come from a generator seeded per step, as
//! `asr train` seeds one per batch (`clustered_attention::with_dropout_seed`).

use std::time::Instant;

use asr_model::ctc::CtcLossImpl;
use asr_model::model::{Activation, AsrModelConfig, FrontEnd};
use asr_model::phones::PhoneInventory;
use backend_select::BackendName;
use burn::optim::GradientsParams;
use burn::tensor::{Device, Distribution, Int, Tensor};
use clap::Args;
use clustered_attention::{AttentionKind, with_dropout_seed};

/// Arguments of `asr step-time`.
#[derive(Args, Debug)]
pub struct StepTimeArgs {
    /// Backend.
    #[arg(long, value_enum, default_value = "flex")]
    pub backend: BackendName,
    /// Attentions to time, comma separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,clustered:100,improved:100:32"
    )]
    attention: Vec<AttentionKind>,
    /// Frames per utterance.
    #[arg(long, default_value_t = 800)]
    frames: usize,
    /// Utterances per batch.
    #[arg(long, default_value_t = 4)]
    batch: usize,
    /// Time subsampling (1 = none, as in the paper).
    #[arg(long, default_value_t = 1)]
    subsampling: usize,
    /// How frames become encoder steps: `stack` or `conv:C` (as `asr train --front-end`).
    #[arg(long, default_value = "stack")]
    front_end: FrontEnd,
    /// Kernel size of a convolution module in every layer (as `asr train --conv-kernel`).
    #[arg(long, default_value_t = 0)]
    conv_kernel: usize,
    /// Activation of the feed-forward blocks (as `asr train --activation`).
    #[arg(long, default_value = "gelu")]
    activation: Activation,
    /// Timed steps (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Implementation of the CTC loss: burn (burn-nn's `CTCLoss`) or alpha-beta (as `asr
    /// train --ctc-loss`).
    #[arg(long, default_value = "alpha-beta")]
    ctc_loss: CtcLossImpl,
    /// Model width.
    #[arg(long, default_value_t = 128)]
    d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    n_heads: usize,
    /// Encoder layers.
    #[arg(long, default_value_t = 4)]
    n_layers: usize,
    /// Feed-forward hidden size.
    #[arg(long, default_value_t = 512)]
    d_ff: usize,
    /// Dropout probability (attention weights, residual branches; as `asr train --dropout`).
    #[arg(long, default_value_t = 0.1)]
    dropout: f64,
}

/// Times the steps on `device` (with autodiff) and prints a markdown table.
pub fn run(args: &StepTimeArgs, _: BackendName, device: Device) -> anyhow::Result<()> {
    let inventory = PhoneInventory::standard();
    let targets_len = args.frames / args.subsampling / 4;
    println!(
        "| attention | frames | batch | subsampling | dropout | CTC loss | median step (s) | min (s) | max (s) | forward (s) | loss (s) |\n|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|"
    );
    for &attention in &args.attention {
        device.seed(0);
        let mut model = AsrModelConfig::new(inventory.n_outputs())
            .with_attention(attention)
            .with_subsampling(args.subsampling)
            .with_front_end(args.front_end)
            .with_conv_kernel(args.conv_kernel)
            .with_activation(args.activation)
            .with_ctc_loss(args.ctc_loss)
            .with_d_model(args.d_model)
            .with_n_heads(args.n_heads)
            .with_n_layers(args.n_layers)
            .with_d_ff(args.d_ff)
            .with_dropout(args.dropout)
            .init(&device);
        let mut optim = burn::optim::AdamConfig::new().init();
        let features = Tensor::<3>::random(
            [args.batch, args.frames, 40],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let targets = Tensor::<2, Int>::random(
            [args.batch, targets_len],
            Distribution::Uniform(1.0, 40.0),
            &device,
        );
        let frame_lengths = vec![args.frames; args.batch];
        let target_lengths = vec![targets_len; args.batch];
        let (mut times, mut forwards, mut losses) = (Vec::new(), Vec::new(), Vec::new());
        for step in 0..=args.steps {
            let start = Instant::now();
            // The dropout masks drawn as `asr train` draws them: from a generator seeded per
            // step, not the backend's (Flex draws its one element at a time, under a lock).
            let (forward, loss_done, grads) = with_dropout_seed(step as u64, || {
                let log_probs = model.forward(features.clone(), &frame_lengths);
                let _ = device.sync();
                let forward = start.elapsed().as_secs_f64();
                let loss = model
                    .ctc_loss(log_probs, &frame_lengths, targets.clone(), &target_lengths)
                    .mean();
                let _ = device.sync();
                let loss_done = start.elapsed().as_secs_f64();
                (forward, loss_done, loss.backward())
            });
            let grads = GradientsParams::from_grads(grads, &model);
            model = optim.step(1e-4, model, grads);
            // Wait for the device: read one value back.
            let _ = device.sync();
            if step > 0 {
                times.push(start.elapsed().as_secs_f64());
                forwards.push(forward);
                losses.push(loss_done - forward);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let step = median(&mut times);
        println!(
            "| {attention} | {} | {} | {} | {} | {} | {step:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            args.frames,
            args.batch,
            args.subsampling,
            args.dropout,
            args.ctc_loss,
            times[0],
            times[times.len() - 1],
            median(&mut forwards),
            median(&mut losses),
        );
    }
    Ok(())
}
