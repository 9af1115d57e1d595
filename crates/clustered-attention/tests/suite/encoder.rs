//! The transformer encoder against burn-nn's `TransformerEncoder`: records both ways, the same
//! outputs with full attention (padding and attention masks), the attention swapped on trained
//! weights, dropout off when frozen, and the options it cannot honour rejected.

use burn::module::{Module, Param};
use burn::nn::transformer::{
    TransformerEncoder, TransformerEncoderConfig, TransformerEncoderInput,
};
use burn::store::ModuleRecord;
use burn::tensor::{Bool, Bytes, Device, Distribution, Tensor, TensorData};
use clustered_attention::{
    AttentionKind, ClusteredTransformerEncoderConfig, ClusteredTransformerEncoderInput,
};

use crate::common::{autodiff, flex, ndarray, padding_mask};

const D_MODEL: usize = 32;
const D_FF: usize = 64;
const HEADS: usize = 4;
const LAYERS: usize = 2;

fn max_abs(a: Tensor<3>, b: Tensor<3>) -> f32 {
    (a - b).abs().max().into_scalar::<f32>()
}

/// `module`'s record as burnpack bytes: what `Module::save_file` writes.
fn record_bytes(module: impl Module) -> Bytes {
    module
        .into_record()
        .into_bytes()
        .expect("the record serializes")
}

fn record(bytes: &Bytes) -> ModuleRecord {
    ModuleRecord::from_bytes(bytes.clone()).expect("the record deserializes")
}

/// `[batch, len, len]`, true where key `j > i` (a causal mask).
fn causal_mask(batch: usize, len: usize, device: &Device) -> Tensor<3, Bool> {
    let mask: Vec<bool> = (0..batch * len * len)
        .map(|at| at % len > (at / len) % len)
        .collect();
    Tensor::from_data(TensorData::new(mask, [batch, len, len]), device)
}

/// burn-nn's encoder of `config` with its layer norms' scales and shifts drawn at random (a
/// fresh layer norm is the identity, which would hide one norm taken for the other).
fn burn_nn_encoder(config: &TransformerEncoderConfig, device: &Device) -> TransformerEncoder {
    let mut encoder = config.init(device);
    let d = config.d_model;
    let random = |low: f64, high: f64| {
        Param::from_tensor(Tensor::<1>::random(
            [d],
            Distribution::Uniform(low, high),
            device,
        ))
    };
    for layer in &mut encoder.layers {
        for norm in [&mut layer.norm_1, &mut layer.norm_2] {
            norm.gamma = random(0.5, 1.5);
            norm.beta = Some(random(-0.5, 0.5));
        }
    }
    encoder
}

fn burn_nn_config(norm_first: bool) -> TransformerEncoderConfig {
    TransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS).with_norm_first(norm_first)
}

fn config(attention: AttentionKind, norm_first: bool) -> ClusteredTransformerEncoderConfig {
    ClusteredTransformerEncoderConfig::new(D_MODEL, D_FF, HEADS, LAYERS, attention)
        .with_norm_first(norm_first)
}

/// A burn-nn `TransformerEncoder` record loads into the encoder, which with full attention
/// gives burn-nn's outputs to 1e-5 (post-norm and pre-norm; without a mask, at the valid
/// positions with a padding mask, and with a causal attention mask); the encoder's record loads
/// back into burn-nn's.
#[test]
fn burn_nn_encoder_record_loads_and_computes_alike() {
    let device = ndarray();
    let len = 12;
    for norm_first in [false, true] {
        let bytes = record_bytes(burn_nn_encoder(&burn_nn_config(norm_first), &device));
        let nn = burn_nn_config(norm_first)
            .init(&device)
            .load_record(record(&bytes));
        let ours = config(AttentionKind::Full, norm_first)
            .init(&device)
            .load_record(record(&bytes));
        let x = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device);

        let diff = max_abs(
            nn.forward(TransformerEncoderInput::new(x.clone())),
            ours.forward(ClusteredTransformerEncoderInput::new(x.clone())),
        );
        assert!(diff <= 1e-5, "norm_first {norm_first}, unmasked: {diff}");

        let mask = padding_mask(&[len, 7], len, &device);
        let expected = nn.forward(TransformerEncoderInput::new(x.clone()).mask_pad(mask.clone()));
        let actual = ours.forward(ClusteredTransformerEncoderInput::new(x.clone()).mask_pad(mask));
        for (b, valid) in [(0, len), (1, 7)] {
            let diff = max_abs(
                expected.clone().slice([b..b + 1, 0..valid]),
                actual.clone().slice([b..b + 1, 0..valid]),
            );
            assert!(
                diff <= 1e-5,
                "norm_first {norm_first}, padded, item {b}: {diff}"
            );
        }

        let causal = causal_mask(2, len, &device);
        let diff = max_abs(
            nn.forward(TransformerEncoderInput::new(x.clone()).mask_attn(causal.clone())),
            ours.forward(ClusteredTransformerEncoderInput::new(x.clone()).mask_attn(causal)),
        );
        assert!(diff <= 1e-5, "norm_first {norm_first}, causal mask: {diff}");

        let back = burn_nn_config(norm_first)
            .init(&device)
            .load_record(record(&record_bytes(ours.clone())));
        let diff = max_abs(
            back.forward(TransformerEncoderInput::new(x.clone())),
            ours.forward(ClusteredTransformerEncoderInput::new(x)),
        );
        assert!(diff <= 1e-5, "norm_first {norm_first}, loaded back: {diff}");
    }
}

/// `with_attention` swaps every layer's attention on the same weights: improved attention with
/// as many clusters as positions and top-k over every key is full attention (to 1e-5); with 3
/// clusters, in either layer, the output moves.
#[test]
fn with_attention_swaps_every_layer() {
    let device = ndarray();
    let len = 16;
    let encoder = config(AttentionKind::Full, false).init(&device);
    let encoder = encoder.clone().load_record(record(&record_bytes(encoder)));
    let x = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device);
    let forward = |kind| {
        encoder
            .clone()
            .with_attention(kind)
            .forward(ClusteredTransformerEncoderInput::new(x.clone()))
    };
    let full = forward(AttentionKind::Full);
    let exact = forward(AttentionKind::Improved {
        clusters: len,
        topk: len,
    });
    let diff = max_abs(full.clone(), exact);
    assert!(diff <= 1e-5, "improved in its exact regime: {diff}");
    let clustered = encoder
        .clone()
        .with_attention(AttentionKind::Clustered { clusters: 3 });
    for layer in &clustered.layers {
        assert_eq!(
            layer.mha.attention,
            AttentionKind::Clustered { clusters: 3 }
        );
    }
    let diff = max_abs(
        full,
        clustered.forward(ClusteredTransformerEncoderInput::new(x)),
    );
    assert!(diff > 1e-3, "3 clusters should change the output: {diff}");
}

/// As burn-nn's encoder, the encoder drops out only while training on an autodiff device:
/// unfrozen there, dropout 0.5 moves its output off the same weights' without dropout by more
/// than 1e-2; frozen (`Module::freeze`) it equals them to 1e-6, and so does burn-nn's frozen
/// encoder loaded with the same record.
#[test]
fn frozen_encoder_applies_no_dropout() {
    let device = autodiff(&flex());
    let len = 10;
    let x = Tensor::<3>::random([2, len, D_MODEL], Distribution::Default, &device);
    let input = || ClusteredTransformerEncoderInput::new(x.clone());
    let kind = AttentionKind::Improved {
        clusters: 4,
        topk: 4,
    };
    let bytes = record_bytes(config(kind, false).init(&device));
    let with_dropout = |dropout: f64| {
        config(kind, false)
            .with_dropout(dropout)
            .init(&device)
            .load_record(record(&bytes))
    };
    let without = with_dropout(0.0).forward(input());
    let training = with_dropout(0.5);
    let dropped = max_abs(training.forward(input()), without.clone());
    assert!(dropped > 1e-2, "dropout 0.5 moved the output by {dropped}");
    let diff = max_abs(training.freeze().forward(input()), without);
    assert!(diff <= 1e-6, "the frozen encoder is {diff} off no dropout");

    let nn = |dropout: f64| {
        burn_nn_config(false)
            .with_dropout(dropout)
            .init(&device)
            .load_record(record(&bytes))
    };
    let nn_input = || TransformerEncoderInput::new(x.clone());
    let diff = max_abs(
        nn(0.5).freeze().forward(nn_input()),
        nn(0.0).forward(nn_input()),
    );
    assert!(
        diff <= 1e-6,
        "burn-nn's frozen encoder is {diff} off no dropout"
    );
}

/// An attention mask with a clustered attention is refused, naming the option.
#[test]
#[should_panic(expected = "mask_attn [2, 8, 8] needs full attention")]
fn mask_attn_needs_full_attention() {
    let device = ndarray();
    let encoder = config(AttentionKind::Clustered { clusters: 2 }, false).init(&device);
    let x = Tensor::<3>::random([2, 8, D_MODEL], Distribution::Default, &device);
    encoder.forward(ClusteredTransformerEncoderInput::new(x).mask_attn(causal_mask(2, 8, &device)));
}

/// burn-nn's quiet softmax is refused at `init`, not ignored.
#[test]
#[should_panic(expected = "quiet_softmax = true")]
fn quiet_softmax_is_refused() {
    config(AttentionKind::Full, false)
        .with_quiet_softmax(true)
        .init(&ndarray());
}
