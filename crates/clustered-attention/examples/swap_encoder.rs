//! From burn-nn's transformer encoder to clustered attention: the one-line change, and the
//! weights of a burn-nn encoder loaded into the clustered one.
//!
//! A burn-nn `TransformerEncoder` is trained a few steps at 256 tokens and saved
//! (`Module::save_file`); the same model with `ClusteredTransformerEncoder` in its place loads
//! that file, computes what burn-nn's computes with full attention, and trains on with improved
//! clustered attention at 4,096 tokens, where burn-nn's encoder keeps a `[1, 4, 4096, 4096]`
//! tensor of scores per layer for the backward.
//!
//! Run with `cargo run --release -p clustered-attention --example swap_encoder`.

use burn::module::Module;
use burn::nn::transformer::{TransformerEncoderConfig, TransformerEncoderInput};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoderConfig, ClusteredTransformerEncoderInput,
};

const D_MODEL: usize = 64;

/// A few Adam steps of `model` on random sequences of `len` tokens (the loss: the mean square
/// of the output), printing the losses.
fn train<M: Module>(
    name: &str,
    mut model: M,
    len: usize,
    device: &Device,
    forward: impl Fn(&M, Tensor<3>) -> Tensor<3>,
) -> M {
    let mut optimizer = AdamConfig::new().init();
    for step in 0..3 {
        let x = Tensor::<3>::random([1, len, D_MODEL], Distribution::Default, device);
        let loss = forward(&model, x).powi_scalar(2).mean();
        println!(
            "{name}, L = {len}, step {step}: loss {:.4}",
            loss.clone().into_scalar::<f32>()
        );
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(1e-3, model, grads);
    }
    model
}

fn main() {
    let device = Device::flex().autodiff();
    device.seed(0);

    // burn-nn's encoder, trained and saved.
    let burn_nn = TransformerEncoderConfig::new(D_MODEL, 128, 4, 2).init(&device);
    let burn_nn = train("burn-nn", burn_nn, 256, &device, |m, x| {
        m.forward(TransformerEncoderInput::new(x))
    });
    let path = std::env::temp_dir().join(format!("swap-encoder-{}", std::process::id()));
    burn_nn.clone().save_file(&path).expect("the record saves");

    // The one-line change: the same arguments and the attention.
    let clustered = ClusteredTransformerEncoderConfig::new(D_MODEL, 128, 4, 2, AttentionKind::Full)
        .init(&device)
        .try_load_file(&path)
        .expect("burn-nn's record loads");

    // With full attention it computes what burn-nn's does (both frozen: no dropout).
    let x = Tensor::<3>::random([1, 256, D_MODEL], Distribution::Default, &device);
    let expected = burn_nn
        .freeze()
        .forward(TransformerEncoderInput::new(x.clone()));
    let got = clustered
        .clone()
        .freeze()
        .forward(ClusteredTransformerEncoderInput::new(x));
    let diff = (expected - got).abs().max().into_scalar::<f32>();
    println!("burn-nn's weights, full attention: max |difference| {diff:e}");
    assert!(
        diff <= 1e-4,
        "the loaded encoder differs from burn-nn's by {diff}"
    );

    // The same weights with improved clustered attention, trained on at 4,096 tokens.
    let improved = clustered.with_attention(AttentionKind::Improved {
        clusters: 32,
        topk: 16,
    });
    train("improved", improved, 4096, &device, |m, x| {
        m.forward(ClusteredTransformerEncoderInput::new(x))
    });
    // The loaded tensors are read from the file when first used: removed at the end.
    let _ = std::fs::remove_file(path.with_extension("bpk"));
}
