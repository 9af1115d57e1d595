//! Dropping the clustered-attention layer into a Burn model, training it a few steps, and
//! evaluating the trained weights with another attention.
//!
//! Run with `cargo run --release -p clustered-attention --example drop_in_layer`.

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Tensor};
use clustered_attention::{
    AttentionKind, ClusteredAttentionInput, MultiHeadClusteredAttention,
    MultiHeadClusteredAttentionConfig,
};

/// A one-layer model: self-attention, then a linear read-out.
#[derive(Module, Debug)]
struct Model {
    attention: MultiHeadClusteredAttention,
    readout: Linear,
}

impl Model {
    fn new(attention: AttentionKind, device: &Device) -> Self {
        Self {
            attention: MultiHeadClusteredAttentionConfig::new(32, 4, attention)
                .with_dropout(0.0)
                .init(device),
            readout: LinearConfig::new(32, 1).init(device),
        }
    }

    /// `x`: `[batch, seq, 32]` → `[batch, seq, 1]`.
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let context = self
            .attention
            .forward(ClusteredAttentionInput::self_attn(x.clone()));
        self.readout.forward(context + x)
    }
}

fn main() {
    // Flex, the crate's default CPU backend, with autodiff for training.
    let device = Device::flex().autodiff();
    let mut model = Model::new(
        AttentionKind::Improved {
            clusters: 16,
            topk: 8,
        },
        &device,
    );
    let mut optimizer = AdamConfig::new().init();

    // Target: the mean of the first feature over the sequence, at every position.
    let batch = |seed: u64| {
        device.seed(seed);
        let x = Tensor::<3>::random([8, 128, 32], Distribution::Normal(0.0, 1.0), &device);
        let y = x
            .clone()
            .slice([0..8, 0..128, 0..1])
            .mean_dim(1)
            .expand([8, 128, 1]);
        (x, y)
    };
    for step in 0..30 {
        let (x, y) = batch(step);
        let loss = (model.forward(x) - y).powi_scalar(2).mean();
        if step % 10 == 0 || step == 29 {
            println!(
                "step {step:2}: mse {:.5}",
                loss.clone().into_scalar::<f32>()
            );
        }
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(1e-2, model, grads);
    }

    // The trained weights, evaluated with each attention (no gradient tracking).
    let (x, y) = batch(1000);
    let (x, y) = (x.inner(), y.inner());
    let trained = model.valid();
    for kind in [
        AttentionKind::Full,
        AttentionKind::Clustered { clusters: 16 },
        AttentionKind::Improved {
            clusters: 16,
            topk: 8,
        },
    ] {
        let model = Model {
            attention: trained.attention.clone().with_attention(kind),
            readout: trained.readout.clone(),
        };
        let mse: f32 = (model.forward(x.clone()) - y.clone())
            .powi_scalar(2)
            .mean()
            .into_scalar();
        println!("evaluated with {kind:>14}: mse {mse:.5}");
    }
}
