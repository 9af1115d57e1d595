//! Trains a transformer encoder on clustered attention a few Adam steps on one backend (the one
//! the crate's feature selects), saves its record to a file (Burn's `Module::save_file`,
//! burnpack), loads it into a fresh model and checks that the loaded model computes what the
//! trained one does. Exits non-zero when a check fails.
//!
//! The encoder is clustered-attention's `ClusteredTransformerEncoder`, burn-nn's
//! `TransformerEncoder` with the attention chosen: a Burn user's model swaps
//! `TransformerEncoderConfig::new(d_model, d_ff, n_heads, n_layers)` for
//! `ClusteredTransformerEncoderConfig::new(d_model, d_ff, n_heads, n_layers, attention)`.
//!
//! The task: every position predicts the mean of the first feature over its sequence's valid
//! positions, a quantity only attention can gather, in a padded batch (a padding mask). Twelve
//! steps do not learn it; what is checked is that Adam lowers the loss (by 10 % at least)
//! through the attention's gradients, and that the record round-trips exactly.

use std::process::ExitCode;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Bool, Device, Distribution, Tensor, TensorData};
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoder, ClusteredTransformerEncoderConfig,
    ClusteredTransformerEncoderInput,
};

const BATCH: usize = 4;
const LEN: usize = 192;
const D_MODEL: usize = 32;
const STEPS: usize = 12;

/// One pre-norm encoder layer and a linear read-out to one value per position.
#[derive(Module, Debug)]
struct Model {
    encoder: ClusteredTransformerEncoder,
    readout: Linear,
}

impl Model {
    /// A freshly initialised model with improved clustered attention (16 clusters, top 8), no
    /// dropout.
    fn init(device: &Device) -> Self {
        let attention = AttentionKind::Improved {
            clusters: 16,
            topk: 8,
        };
        Self {
            encoder: ClusteredTransformerEncoderConfig::new(D_MODEL, 64, 4, 1, attention)
                .with_norm_first(true)
                .with_dropout(0.0)
                .init(device),
            readout: LinearConfig::new(D_MODEL, 1).init(device),
        }
    }

    fn forward(&self, x: Tensor<3>, mask_pad: Tensor<2, Bool>) -> Tensor<3> {
        let input = ClusteredTransformerEncoderInput::new(x).mask_pad(mask_pad);
        self.readout.forward(self.encoder.forward(input))
    }
}

/// A batch: inputs `[BATCH, LEN, D_MODEL]`, the padding mask `[BATCH, LEN]` (`true` past each
/// sequence's length), and the target `[BATCH, LEN, 1]` (each sequence's mean of feature 0
/// over its valid positions, at every position; 0 past the end), with a mask of the valid
/// positions.
fn batch(
    seed: u64,
    device: &Device,
) -> (Tensor<3>, Tensor<2, Bool>, Tensor<3>, Tensor<3>) {
    device.seed(seed);
    let x = Tensor::<3>::random(
        [BATCH, LEN, D_MODEL],
        Distribution::Normal(0.0, 1.0),
        device,
    );
    let lengths: Vec<usize> = (0..BATCH).map(|b| LEN - b * 37).collect();
    let host = x.to_data().try_to_vec::<f32>().expect("f32 inputs");
    let (mut target, mut mask) = (vec![0f32; BATCH * LEN], vec![0f32; BATCH * LEN]);
    for (b, &len) in lengths.iter().enumerate() {
        let mean = (0..len).map(|i| host[(b * LEN + i) * D_MODEL]).sum::<f32>() / len as f32;
        target[b * LEN..b * LEN + len].fill(mean);
        mask[b * LEN..b * LEN + len].fill(1.0);
    }
    let padding: Vec<bool> = lengths
        .iter()
        .flat_map(|&n| (0..LEN).map(move |i| i >= n))
        .collect();
    (
        x,
        Tensor::from_data(TensorData::new(padding, [BATCH, LEN]), device),
        Tensor::from_data(TensorData::new(target, [BATCH, LEN, 1]), device),
        Tensor::from_data(TensorData::new(mask, [BATCH, LEN, 1]), device),
    )
}

/// Mean squared error over the valid positions.
fn loss(
    prediction: Tensor<3>,
    target: Tensor<3>,
    mask: Tensor<3>,
) -> Tensor<1> {
    let count = mask.clone().sum();
    ((prediction - target).powi_scalar(2) * mask).sum() / count
}

/// Trains on `device` (with autodiff), then saves, loads and compares on `device` (without).
fn run(name: &str, device: &Device) -> Result<(), String> {
    let train_device = device.clone().autodiff();
    train_device.seed(7);
    let mut model = Model::init(&train_device);
    let mut optimizer = AdamConfig::new().init();
    let (x, mask_pad, target, mask) = batch(0, &train_device);
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let loss = loss(
            model.forward(x.clone(), mask_pad.clone()),
            target.clone(),
            mask.clone(),
        );
        losses.push(loss.clone().into_scalar::<f32>());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(3e-3, model, grads);
    }
    println!(
        "{name}: training loss {:.4} → {:.4} in {STEPS} Adam steps",
        losses[0],
        losses[STEPS - 1]
    );
    if !losses.iter().all(|l| l.is_finite()) || losses[STEPS - 1] >= 0.9 * losses[0] {
        return Err(format!("{name}: the loss did not fall by 10 %: {losses:?}"));
    }

    // Save the trained record, load it into a freshly initialised model, compare the outputs.
    let trained = model.valid();
    let path =
        std::env::temp_dir().join(format!("downstream-encoder-{}-{name}", std::process::id()));
    trained
        .clone()
        .save_file(&path)
        .map_err(|e| format!("{name}: saving the record: {e}"))?;
    device.seed(8);
    let fresh = Model::init(device);
    let loaded = fresh
        .try_load_file(&path)
        .map_err(|e| format!("{name}: loading the record: {e}"))?;
    let (x, mask_pad, target, mask) = batch(1, device);
    let expected = trained.forward(x.clone(), mask_pad.clone());
    let got = loaded.forward(x, mask_pad);
    // The loaded record's tensors are read from the file when first used.
    let _ = std::fs::remove_file(path.with_extension("bpk"));
    let diff = (expected.clone() - got)
        .abs()
        .max()
        .into_scalar::<f32>();
    let held_out = loss(expected, target, mask).into_scalar::<f32>();
    println!(
        "{name}: record saved and loaded, max |difference| {diff:e}; held-out loss {held_out:.4}"
    );
    if diff != 0.0 {
        return Err(format!(
            "{name}: the loaded model differs from the saved one by {diff}"
        ));
    }
    Ok(())
}

// One push per backend feature on: with one feature, clippy would rather see `vec![…]`.
#[allow(clippy::vec_init_then_push)]
fn main() -> ExitCode {
    let mut results = Vec::new();
    // NdArray is deprecated in Burn 0.22 (in favour of Flex) and still supported by the crate.
    #[cfg(feature = "ndarray")]
    #[allow(deprecated)]
    results.push(run("ndarray", &Device::ndarray()));
    #[cfg(feature = "flex")]
    results.push(run("flex", &Device::flex()));
    #[cfg(feature = "wgpu")]
    results.push(run(
        "wgpu",
        &Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
    ));
    if results.is_empty() {
        eprintln!("no backend: build with --features ndarray, flex or wgpu");
        return ExitCode::FAILURE;
    }
    let mut code = ExitCode::SUCCESS;
    for result in results {
        if let Err(message) = result {
            eprintln!("{message}");
            code = ExitCode::FAILURE;
        }
    }
    code
}
